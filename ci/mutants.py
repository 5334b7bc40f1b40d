#!/usr/bin/env python3
"""Runs the deliberate breakages of sim/mutations.toml against the simulator's fixed seeds.

For each mutation: apply one exact text replacement to a copy of the tree, build
`millrace-sim` (release, debug assertions on) into its own target directory, and fuzz the
fixed seed plan (the mutation's own scenarios first, then the seeds `cargo test -p sim` runs:
sim/tests/fuzz.rs FIXED and every scenario file's `expect.seeds`) until the first failure.
A mutation counts as caught only when an invariant checker (or a core debug assertion, a
panic) fails; a coverage counter falling to zero never counts.

    python3 ci/mutants.py                      # every mutation, table to stdout
    python3 ci/mutants.py --only m29-drop-published e12-no-fence
    python3 ci/mutants.py --list

The working tree is never modified: the mutation is applied to a `git worktree` of HEAD
(plus the working tree's uncommitted changes to sim/ and core/, copied in), under
--work (default /tmp/millrace-mutants).
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


def fixed_plan() -> list[tuple[str, int, int]]:
    """The seeds `cargo test -p sim` runs: FIXED of tests/fuzz.rs, then each file's expect.seeds."""
    plan: list[tuple[str, int, int]] = []
    text = (ROOT / "sim/tests/fuzz.rs").read_text()
    block = text[text.index("const FIXED") :]
    block = block[: block.index("];")]
    for name, start, count in re.findall(r'\("([^"]+)",\s*(\d+),\s*(\d+)\)', block):
        plan.append((name, int(start), int(count)))
    named = {p[0] for p in plan}
    for f in sorted((ROOT / "scenarios").glob("*.toml")):
        if f.stem in named:
            continue
        data = tomllib.loads(f.read_text())
        seeds = data.get("expect", {}).get("seeds")
        if isinstance(seeds, int) and seeds > 0:
            plan.append((f.stem, 0, seeds))
    return plan


def sh(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def prepare(work: Path) -> Path:
    src = work / "src"
    if src.exists():
        sh(["git", "worktree", "remove", "--force", str(src)], ROOT)
        shutil.rmtree(src, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    r = sh(["git", "worktree", "add", "--detach", str(src), "HEAD"], ROOT)
    if r.returncode != 0:
        sys.exit(f"git worktree add failed: {r.stderr}")
    # Uncommitted edits of the tree under test come along.
    diff = sh(["git", "diff", "HEAD"], ROOT).stdout
    if diff.strip():
        p = subprocess.run(["git", "apply"], cwd=src, input=diff, text=True, capture_output=True)
        if p.returncode != 0:
            sys.exit(f"could not carry uncommitted changes: {p.stderr}")
    return src


def run_one(m: dict, src: Path, target: Path, plan: list[tuple[str, int, int]]) -> dict:
    path = src / m["file"]
    original = path.read_text()
    count = original.count(m["find"])
    if count != 1:
        return {"result": f"stale: `find` occurs {count} times in {m['file']}"}
    # Debug assertions in every crate, the core's too: the workspace's release profile turns
    # them on for `sim` alone (a production binary must not pay for the core's audits), and
    # a core debug assertion that fails counts as caught.
    env = dict(
        os.environ,
        CARGO_TARGET_DIR=str(target),
        CARGO_TERM_COLOR="never",
        CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS="true",
    )
    try:
        path.write_text(original.replace(m["find"], m["replace"], 1))
        b = sh(["cargo", "build", "--release", "-q", "-p", "sim"], src, env)
    finally:
        path.write_text(original)
    if b.returncode != 0:
        return {"result": "does not compile", "detail": b.stderr[-2000:]}
    binary = target / "release" / "millrace-sim"
    first = [p for name in m.get("scenarios", []) for p in plan if p[0] == name]
    ordered = first + [p for p in plan if p not in first]
    seeds_run = 0
    for name, start, count in ordered:
        r = sh(
            [str(binary), "fuzz", "--start", str(start), "--seeds", str(count), "--scenario", name],
            src,
            env,
        )
        out = r.stdout + r.stderr
        if r.returncode == 0:
            seeds_run += count
            continue
        failed = re.search(r"FAILED: seed (\d+) in scenario (\S+)", out)
        violated = re.search(r"violated: (.*)", out)
        panicked = re.search(r"panicked at ([^\n]*)\n([^\n]*)", out)
        if failed:
            seed = int(failed.group(1))
            return {
                "result": "caught",
                "scenario": name,
                "seeds": seeds_run + (seed - start) + 1,
                "seed": seed,
                "by": (violated.group(1) if violated else "?")[:220],
            }
        if panicked:
            return {
                "result": "caught",
                "scenario": name,
                "seeds": seeds_run,
                "seed": None,
                "by": f"debug assertion: {panicked.group(2)[:160]} ({panicked.group(1)})",
            }
        return {"result": f"error: exit {r.returncode}", "detail": out[-1500:]}
    return {"result": "ESCAPED", "seeds": seeds_run}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="mutation ids to run")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--work", default="/tmp/millrace-mutants", help="scratch directory")
    ap.add_argument(
        "--check-finds",
        action="store_true",
        help="only check that every mutation's `find` text occurs exactly once in its file "
        "(ci/check runs this, so an edit cannot silently retire a mutation)",
    )
    args = ap.parse_args()

    muts = tomllib.loads((ROOT / "sim/mutations.toml").read_text())["mutation"]
    if args.check_finds:
        stale = []
        for m in muts:
            path = ROOT / m["file"]
            n = path.read_text().count(m["find"]) if path.exists() else 0
            if n != 1:
                stale.append(f"{m['id']}: its find text occurs {n} times in {m['file']} (must be once)")
        if stale:
            sys.exit("sim/mutations.toml is stale:\n  " + "\n  ".join(stale))
        print(f"mutation finds ok: {len(muts)} mutations, each find once in its file")
        return
    if args.list:
        for m in muts:
            print(f"{m['id']:40} {m['rule']:6} {m['family']:10} {m['what']}")
        return
    if args.only:
        unknown = set(args.only) - {m["id"] for m in muts}
        if unknown:
            sys.exit(f"unknown mutation ids: {sorted(unknown)}")
        muts = [m for m in muts if m["id"] in args.only]
    work = Path(args.work)
    src = prepare(work)
    target = work / "target"
    plan = fixed_plan()
    head = sh(["git", "rev-parse", "--short", "HEAD"], ROOT).stdout.strip()
    print(f"# {len(muts)} mutations against {head}; seed plan: "
          + ", ".join(f"{n} {s}..{s + c}" for n, s, c in plan), flush=True)
    print("| id | rule | family | breakage | result | caught by | scenario | seeds |")
    print("|---|---|---|---|---|---|---|---:|", flush=True)
    escaped = 0
    for i, m in enumerate(muts, 1):
        t0 = time.monotonic()
        print(f"[{i}/{len(muts)}] {m['id']} …", file=sys.stderr, flush=True)
        r = run_one(m, src, target, plan)
        if r["result"] != "caught":
            escaped += 1
        by = r.get("by", r.get("detail", "")[:200].replace("\n", " ")).replace("|", "\\|")
        print(
            f"| {m['id']} | {m['rule']} | {m['family']} | {m['what']} | {r['result']} | {by} "
            f"| {r.get('scenario', '')} | {r.get('seeds', '')} |",
            flush=True,
        )
        print(f"    {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    sh(["git", "worktree", "remove", "--force", str(src)], ROOT)
    print(f"# {len(muts) - escaped} caught, {escaped} not caught", flush=True)
    sys.exit(1 if escaped else 0)


if __name__ == "__main__":
    main()
