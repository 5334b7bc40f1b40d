#!/usr/bin/env python3
"""Rule coverage: every rule of docs/design.md that is implemented has a test named for it.

Reads the rule list from docs/design.md (lines `- **M12** ...`; a rule whose id is followed by
`*planned (issue N)*` is not implemented yet) and the workspace's Rust test functions, then:

- each implemented rule M…, E…, Q… needs at least one test whose name starts with the rule id
  in lowercase and an underscore (`fn m20_…`, `fn e4_…`, `fn q2_…`);
- each implemented invariant I… needs a checker: a place in the simulator's non-test code
  (sim/src) that reports a `Violation` under that id — `rule: "I4"`, or the id as the first
  argument of the helper that builds one, `fail("I4", …)` / `compatible("I7", …)` — or a test
  named for it (`fn i10_…`) for a property of whole runs, such as determinism;
- a rule marked planned must have neither (drop the marker when it lands);
- every rule id cited in the repository's code and documents is defined in docs/design.md;
- the ids of each family run 1..n without a gap or a repeat.

Prints a table of rule -> tests (and checker sites) and exits 1 listing every gap.

It also keeps the rule index, docs/rules.md, true: each rule with its first words, the
non-test source files of core/ and node/ that cite it (where it is implemented), the tests
named for it and the simulator files that check it. The check fails when the file differs
from what the tree says; `python3 ci/rules.py --write` rewrites it.

Standard library only; no network. Run from anywhere: `python3 ci/rules.py`;
`--self-test` runs it on a small tree seeded with one of each defect and fails unless it
reports exactly those.
"""

import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DESIGN = os.path.join("docs", "design.md")
INDEX = os.path.join("docs", "rules.md")
# Off in the self-test, whose small tree has no index.
CHECK_INDEX = True
SKIP_DIRS = {".git", "target", "node_modules"}
CITING_SUFFIXES = (".rs", ".md", ".toml", ".sh", ".py")
FAMILIES = "MEQI"

RULE_LINE = re.compile(r"^- \*\*([MEQI])(\d+)\*\*(.*)$")
PLANNED = re.compile(r"^\s*\*planned \(issue (\d+)\)\*")
# `#[test]` (or `#[tokio::test]`), then any further attributes or comments, then the fn.
TEST_FN = re.compile(
    r"#\[(?:[\w:]+::)?test\]"
    r"((?:\s*(?:#\[[^\]]*\]|//[^\n]*))*)"
    r"\s*(?:pub(?:\([^)]*\))?\s+)?(?:async\s+)?fn\s+(\w+)"
)
CHECKER_SITE = re.compile(r'(?:\brule:\s*|\b\w+\(\s*)"(I\d+)"\s*[,}]')
CITATION = re.compile(r"\b([MEQI])(\d+)\b")


def rel(path):
    return os.path.relpath(path, ROOT)


def walk(top, suffixes):
    for base, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(suffixes) or (suffixes == CITING_SUFFIXES and name == "check"):
                yield os.path.join(base, name)


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def parse_design(errors):
    path = os.path.join(ROOT, DESIGN)
    if not os.path.exists(path):
        errors.append(f"{DESIGN} is missing")
        return {}
    rules = {}  # id -> (line number, planned issue or None, first words)
    for n, line in enumerate(read(path).splitlines(), 1):
        m = RULE_LINE.match(line)
        if not m:
            continue
        rid = m.group(1) + m.group(2)
        planned = PLANNED.match(m.group(3))
        if rid in rules:
            errors.append(f"{DESIGN}:{n}: {rid} is defined twice (first on line {rules[rid][0]})")
            continue
        rules[rid] = (n, planned.group(1) if planned else None, summary(m.group(3)))
    for fam in FAMILIES:
        nums = sorted(int(r[1:]) for r in rules if r[0] == fam)
        if not nums:
            errors.append(f"{DESIGN}: no {fam} rules found")
        elif nums != list(range(1, nums[-1] + 1)):
            missing = sorted(set(range(1, nums[-1] + 1)) - set(nums))
            errors.append(f"{DESIGN}: {fam} rules have gaps: " + ", ".join(f"{fam}{i}" for i in missing))
    return rules


def summary(text):
    """The first words of a rule's text, plain, for the index."""
    t = re.sub(r"^\s*\*planned \(issue \d+\)\*\s*", "", text)
    t = re.sub(r"[`*]", "", t).strip().replace("|", "/")
    return t if len(t) <= 90 else t[:87].rsplit(" ", 1)[0] + " …"


def collect_implementations():
    """Rule id -> the non-test source files of core/ and node/ that cite it."""
    impl = {}
    for top in ("core", "node"):
        for path in walk(os.path.join(ROOT, top, "src"), (".rs",)):
            r = rel(path)
            if "/tests/" in r or r.endswith("/tests.rs"):
                continue
            for m in CITATION.finditer(strip_cfg_test(read(path))):
                files = impl.setdefault(m.group(1) + m.group(2), [])
                if r not in files:
                    files.append(r)
    return impl


def render_index(rules, tests, sites, impl):
    """docs/rules.md as the tree says it should be."""
    def cell(items, limit):
        items = sorted(set(items))
        shown = ", ".join(f"`{i}`" for i in items[:limit])
        more = len(items) - limit
        return shown + (f" (+{more} more)" if more > 0 else "") if items else "—"

    out = [
        "# Rule index",
        "",
        "Generated by `python3 ci/rules.py --write` from docs/design.md and the tree; `ci/check`",
        "fails when it is stale. Implemented in: non-test sources of core/ and node/ that cite the",
        "rule. Tests: `#[test]` functions named for it. Checked by: simulator files that report a",
        "violation under it (invariants).",
        "",
        "| rule | what | implemented in | tests | checked by |",
        "|---|---|---|---|---|",
    ]
    for rid in sorted(rules, key=key):
        _, issue, what = rules[rid]
        if issue:
            what = f"*planned (issue {issue})* {what}"
        prefix = rid.lower() + "_"
        named = [t for t, _ in tests if t.startswith(prefix)]
        checked = sites.get(rid, []) if rid[0] == "I" else []
        out.append(
            f"| {rid} | {what} | {cell(impl.get(rid, []), 6)} | {cell(named, 8)} | "
            f"{cell(checked, 6)} |"
        )
    return "\n".join(out) + "\n"


def strip_cfg_test(text):
    """The text without `#[cfg(test)]` items (test modules are not checkers)."""
    out, i = [], 0
    while True:
        j = text.find("#[cfg(test)]", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = text.find("{", j)
        semi = text.find(";", j)
        if k < 0 or (0 <= semi < k):
            i = j + len("#[cfg(test)]")  # `mod tests;` or an attribute on a one-line item
            continue
        i = skip_block(text, k)


def skip_block(text, k):
    """Index just past the block opened at text[k] == '{', skipping strings and comments."""
    depth, i, n = 0, k, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
            continue
        if text.startswith("/*", i):
            e = text.find("*/", i + 2)
            i = n if e < 0 else e + 2
            continue
        raw = re.match(r'r(#*)"', text[i : i + 260]) if c == "r" and not text[i - 1].isalnum() else None
        if raw:
            close = '"' + raw.group(1)
            e = text.find(close, i + len(raw.group(0)))
            i = n if e < 0 else e + len(close)
            continue
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        if c == "'":
            m = re.match(r"'(?:\\.|[^\\'])'", text[i : i + 12])
            if m:
                i += len(m.group(0))
                continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def collect_tests():
    tests = []  # (name, path)
    ignored = []
    for path in walk(ROOT, (".rs",)):
        for m in TEST_FN.finditer(read(path)):
            if "#[ignore" in m.group(1):
                ignored.append((m.group(2), rel(path)))
            else:
                tests.append((m.group(2), rel(path)))
    return tests, ignored


def collect_checker_sites():
    sites = {}
    top = os.path.join(ROOT, "sim", "src")
    for path in walk(top, (".rs",)):
        for m in CHECKER_SITE.finditer(strip_cfg_test(read(path))):
            sites.setdefault(m.group(1), []).append(rel(path))
    return sites


def collect_citations():
    cited = {}
    for path in walk(ROOT, CITING_SUFFIXES):
        r = rel(path)
        if r == DESIGN:
            continue
        for n, line in enumerate(read(path).splitlines(), 1):
            for m in CITATION.finditer(line):
                cited.setdefault(m.group(1) + m.group(2), f"{r}:{n}")
    return cited


def key(rid):
    return (FAMILIES.index(rid[0]), int(rid[1:]))


def main():
    errors = []
    rules = parse_design(errors)
    tests, ignored = collect_tests()
    sites = collect_checker_sites()
    cited = collect_citations()

    def named(rid):
        prefix = rid.lower() + "_"
        return [t for t, _ in tests if t.startswith(prefix)]

    rows, planned_rows = [], []
    for rid in sorted(rules, key=key):
        line, issue, _ = rules[rid]
        n_tests = len(named(rid))
        n_sites = len(sites.get(rid, [])) if rid[0] == "I" else None
        covered = n_tests > 0 or bool(n_sites)
        if issue:
            planned_rows.append((rid, issue))
            status = f"planned (issue {issue})"
            if covered:
                what = f"{n_tests} test(s)" + (f", {n_sites} checker site(s)" if n_sites else "")
                errors.append(
                    f"{rid} is marked planned (issue {issue}) in {DESIGN}:{line} but has {what}: "
                    "drop the marker if it is implemented, or rename what is not about it"
                )
        elif covered:
            status = "ok"
        else:
            status = "MISSING"
            if rid[0] == "I":
                errors.append(
                    f"{rid} has no checker: no Violation with rule \"{rid}\" in sim/src "
                    f"and no test fn {rid.lower()}_…"
                )
            else:
                errors.append(f"{rid} has no test named for it (fn {rid.lower()}_…)")
        rows.append((rid, status, n_tests, n_sites))

    for rid, where in sorted(cited.items(), key=lambda kv: key(kv[0])):
        if rid not in rules:
            errors.append(f"{where}: cites {rid}, which {DESIGN} does not define")

    index = render_index(rules, tests, sites, collect_implementations())
    index_path = os.path.join(ROOT, INDEX)
    if WRITE:
        with open(index_path, "w", encoding="utf-8") as f:
            f.write(index)
        print(f"wrote {INDEX}")
    elif CHECK_INDEX:
        current = read(index_path) if os.path.exists(index_path) else None
        if current != index:
            errors.append(f"{INDEX} is stale (or missing): run python3 ci/rules.py --write")

    print(f"rule coverage ({DESIGN}; tests = #[test] fns named <rule>_…; "
          "checker sites = Violations under that id in sim/src)")
    print(f"{'rule':<6} {'tests':>5} {'checker sites':>13}  status")
    for rid, status, n_tests, n_sites in rows:
        sites_col = "" if n_sites is None else str(n_sites)
        print(f"{rid:<6} {n_tests:>5} {sites_col:>13}  {status}")
    implemented = len(rows) - len(planned_rows)
    print(f"{len(rows)} rules: {implemented} implemented, {len(planned_rows)} planned "
          f"(skipped: {', '.join(r for r, _ in planned_rows) or 'none'}); "
          f"{len(tests)} tests scanned")
    for name, path in ignored:
        if re.match(r"[meqi]\d+_", name):
            print(f"note: {path}: {name} is #[ignore]d and does not count")
    if errors:
        print(f"\nrule coverage FAILED ({len(errors)}):", file=sys.stderr)
        for e in errors:
            print(f"  - {e}", file=sys.stderr)
        return 1
    print("rule coverage ok")
    return 0


SELF_TEST_DESIGN = """\
- **M1** a rule with a test
- **M2** a rule whose test is ignored
- **M3** *planned (issue 9)* a planned rule that already has a test
- **E1** a rule with no test
- **Q2** a family with a gap
- **I1** an invariant with a checker
- **I2** an invariant whose only report is in test code
- **I3** a whole-run invariant with a test
"""

SELF_TEST_FILES = {
    "core/src/a.rs": "#[test]\nfn m1_ok() {}\n#[test]\n#[ignore]\nfn m2_slow() {}\n"
    "#[test]\n/// doc\nfn m3_early() {}\n// cites M9\n",
    "sim/src/c.rs": 'fn f() -> R { fail(\n "I1",\n m) }\n#[cfg(test)]\nmod t {\n'
    '    const S: &str = "}";\n    fn g() { let _ = Violation { rule: "I2", message: m }; }\n}\n',
    "sim/tests/d.rs": "#[test]\nfn i3_same_seed_same_trace() {}\n",
}

SELF_TEST_EXPECTED = [
    "Q rules have gaps: Q1",
    "M2 has no test named for it",
    "M3 is marked planned (issue 9)",
    "E1 has no test named for it",
    "Q2 has no test named for it",
    "I2 has no checker",
    "cites M9, which",
]


def self_test():
    """The check fails where it should: run it on a small tree with one of each defect."""
    import contextlib
    import io
    import tempfile

    global ROOT, CHECK_INDEX
    saved = ROOT
    CHECK_INDEX = False
    with tempfile.TemporaryDirectory() as tmp:
        files = dict(SELF_TEST_FILES)
        files[DESIGN] = SELF_TEST_DESIGN
        for path, text in files.items():
            full = os.path.join(tmp, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        ROOT = tmp
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main()
        finally:
            ROOT = saved
    report = err.getvalue()
    problems = [f"expected a failure containing {e!r}" for e in SELF_TEST_EXPECTED if e not in report]
    reported = report.count("\n  - ")
    if rc != 1 or problems or reported != len(SELF_TEST_EXPECTED):
        print(out.getvalue() + report, file=sys.stderr)
        for p in problems:
            print(f"rules.py self-test: {p}", file=sys.stderr)
        print(f"rules.py self-test FAILED (exit {rc}, {reported} failures reported, "
              f"{len(SELF_TEST_EXPECTED)} expected)", file=sys.stderr)
        return 1
    print(f"rules.py self-test ok: {reported} seeded defects reported")
    return 0


WRITE = False

if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if sys.argv[1:] == ["--write"]:
        WRITE = True
    elif sys.argv[1:]:
        print("usage: python3 ci/rules.py [--self-test | --write]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
