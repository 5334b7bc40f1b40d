#!/usr/bin/env python3
"""Runs the node's deliberate breakages (node/madsim_mutations.toml) against the madsim suite.

For each mutation: apply one exact text replacement to a scratch copy of the tree, build the
node under `--cfg madsim` into one shared target directory (only the node recompiles between
mutations), run `madsim_cluster_keeps_its_promises_under_faults` over the CI seeds and say
whether an invariant failed. A breakage counts as caught only when the suite reports an
invariant (I1, I2, I3, M31, liveness, or I10: the second run of a seed drawing madsim's RNG
differently from the first) or the node panics; a build error is reported as such.

    python3 ci/node_mutants.py               # every mutation, a table to stdout
    python3 ci/node_mutants.py --only node-acts-before-commit
    python3 ci/node_mutants.py --check       # only: every `find` occurs exactly once (CI)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "madsim_cluster_keeps_its_promises_under_faults"


def load() -> list[dict]:
    return tomllib.loads((ROOT / "node/madsim_mutations.toml").read_text())["mutation"]


def check(muts: list[dict]) -> int:
    bad = 0
    for m in muts:
        text = (ROOT / m["file"]).read_text()
        n = text.count(m["find"])
        if n != 1:
            print(f"  - {m['id']}: `find` occurs {n} times in {m['file']} (must be once)")
            bad += 1
    print(f"node mutations: {len(muts)} listed, {len(muts) - bad} apply")
    return 1 if bad else 0


def run(m: dict, src: Path, target: Path, seeds: str) -> tuple[str, str, float]:
    path = src / m["file"]
    original = path.read_text()
    if original.count(m["find"]) != 1:
        return ("does not apply", "", 0.0)
    path.write_text(original.replace(m["find"], m["replace"]))
    env = dict(os.environ, RUSTFLAGS="--cfg madsim", CARGO_TARGET_DIR=str(target), SEEDS=seeds)
    started = time.time()
    try:
        p = subprocess.run(
            ["cargo", "test", "-q", "-p", "node", "--bin", "millrace", TEST, "--", "--nocapture"],
            cwd=src, env=env, capture_output=True, text=True,
        )
    finally:
        path.write_text(original)
    took = time.time() - started
    out = p.stdout + p.stderr
    if "error[E" in out or "could not compile" in out:
        return ("build failed", out[-400:], took)
    if p.returncode == 0:
        return ("NOT caught", "", took)
    found = re.findall(r"^  ((?:I\d+|M31|liveness|I2/M31|non-determinism|second run: )[^\n]*)", out, re.M)
    seeds_failed = re.findall(r"^seed (\d+):\s*$", out, re.M)
    if found:
        first = seeds_failed[0] if seeds_failed else "?"
        return (f"caught ({len(seeds_failed)} seeds, first {first})", found[0][:160], took)
    if "panicked" in out:
        line = next((l for l in out.splitlines() if "panicked" in l), "")
        return ("caught (panic)", line[:160], took)
    return ("failed without an invariant", out[-300:], took)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--work", default="/tmp/millrace-node-mutants")
    ap.add_argument("--seeds", default="100", help="SEEDS for the suite (CI runs 100)")
    args = ap.parse_args()
    muts = load()
    if args.check:
        return check(muts)
    if args.only:
        muts = [m for m in muts if m["id"] in args.only]
    work = Path(args.work)
    src = work / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    # The working tree as it is (committed or not), without targets.
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    for f in files:
        s = ROOT / f
        if s.is_file():
            d = src / f
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)
    target = work / "target"
    rows = []
    for m in muts:
        verdict, detail, took = run(m, src, target, args.seeds)
        rows.append((m["id"], m["rule"], verdict, detail, took))
        print(f"{m['id']}: {verdict} in {took:.0f} s  {detail}", flush=True)
    print("\n| mutation | rule | verdict | what failed |\n|---|---|---|---|")
    for id_, rule, verdict, detail, _ in rows:
        print(f"| `{id_}` | {rule} | {verdict} | {detail.replace('|', '/')} |")
    return 0 if all(r[2].startswith("caught") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
