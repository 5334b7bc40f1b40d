//! The scenario library: TOML files in `scenarios/` at the workspace root, one scenario each,
//! named by the file's stem. The files are embedded at build time (`build.rs`), so the binary
//! runs anywhere; `--scenarios DIR` and `--scenario-file PATH` load others from disk.
//!
//! A file has five parts — `[topology]`, `[workload]`, `[faults]`, `[config]`, `[expect]` —
//! and a leading comment saying what it exercises. Unknown keys are errors, and every error
//! names the file, the line and the field: `scenarios/flap.toml:14: faults.script[2].for:
//! invalid duration "4x"`. See `scenarios/README.md` for the schema.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;
use std::path::Path as FsPath;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;
use toml::Spanned;

use millrace_core::executor::EngineConfig;
use millrace_core::quota::QuotaConfig;
use millrace_core::Resources;

use crate::byzantine::ByzKind;
use crate::coverage::Path;
use crate::scenario::{
    ConfigOverrides, ExecTemplate, Expect, Family, Fault, Knobs, Micros, Mode, Proc, Scenario, MS,
    RULES, SEC,
};

mod faults;
mod schema;
mod sections;

use faults::*;
use schema::*;
use sections::*;

mod embedded_files {
    include!(concat!(env!("OUT_DIR"), "/scenarios.rs"));
}

/// The directory of the library in the source tree (what `build.rs` embedded).
pub const SOURCE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios");

/// A scenario file that does not load: where, which field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// The file, as given.
    pub file: String,
    /// The 1-based line (0: unknown).
    pub line: usize,
    /// The field's path, like `faults.script[2].for`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if self.line > 0 {
            write!(f, ":{}", self.line)?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for LoadError {}

/// A duration written as a string: `"30s"`, `"250ms"`, `"1.5s"`, `"2m30s"`, `"1h"`, `"800us"`
/// — the one syntax of `millrace_core::duration`, which the CLI reads too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Micros);

use millrace_core::duration::format_micros;

/// Parses a duration string (see `Dur`) in microseconds.
pub fn parse_duration(text: &str) -> Option<Micros> {
    millrace_core::duration::parse_micros(text).ok()
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Dur, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s).map(Dur).ok_or_else(|| {
            de::Error::custom(format!(
                "invalid duration {s:?} (write e.g. \"30s\", \"250ms\", \"1.5s\", \"2m\")"
            ))
        })
    }
}

// ---- loading ------------------------------------------------------------------------------

struct Ctx<'a> {
    file: &'a str,
    text: &'a str,
}

impl Ctx<'_> {
    fn line(&self, span: &Range<usize>) -> usize {
        let end = span.start.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|b| **b == b'\n')
            .count()
            + 1
    }

    fn err(
        &self,
        span: Option<&Range<usize>>,
        field: impl Into<String>,
        msg: impl Into<String>,
    ) -> LoadError {
        LoadError {
            file: self.file.to_string(),
            line: span.map_or(0, |s| self.line(s)),
            field: field.into(),
            message: msg.into(),
        }
    }

    fn share(&self, v: &Spanned<f64>, field: &str) -> Result<f64, LoadError> {
        let x = *v.get_ref();
        if !(0.0..=1.0).contains(&x) {
            return Err(self.err(
                Some(&v.span()),
                field,
                format!("{x} is not a share in [0, 1]"),
            ));
        }
        Ok(x)
    }
}

/// Loads a scenario from `text`; `file` names it in errors, and its stem names the scenario.
pub fn load_str(file: &str, text: &str) -> Result<Scenario, LoadError> {
    let cx = Ctx { file, text };
    let doc: Doc = parse(&cx)?;
    let name = FsPath::new(file)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(file)
        .to_string();
    build(&cx, name, doc)
}

/// Loads one scenario file from disk.
pub fn load_file(path: &FsPath) -> Result<Scenario, LoadError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| LoadError {
        file: file.clone(),
        line: 0,
        field: String::new(),
        message: format!("cannot read: {e}"),
    })?;
    load_str(&file, &text)
}

/// Loads every `*.toml` of a directory, sorted by scenario name.
pub fn load_dir(dir: &FsPath) -> Result<Vec<Scenario>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LoadError {
        file: dir.display().to_string(),
        line: 0,
        field: String::new(),
        message: format!("cannot read the scenario directory: {e}"),
    })?;
    let paths: Vec<_> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    let mut all = paths
        .iter()
        .map(|p| load_file(p))
        .collect::<Result<Vec<_>, _>>()?;
    all.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(all)
}

/// The library as embedded at build time, sorted by name.
pub fn embedded() -> Result<Vec<Scenario>, LoadError> {
    embedded_files::EMBEDDED
        .iter()
        .map(|(_, file, text)| load_str(file, text))
        .collect()
}

/// Every scenario of the library (the files embedded at build time). Moved here from
/// `scenario` with `scenario(name)` so that `scenario` does not import this module.
/// Panics if one does not load: `cargo test -p sim` loads them all first.
pub fn scenarios() -> Vec<Scenario> {
    embedded().unwrap_or_else(|e| panic!("{e}"))
}

/// Looks a scenario of the library up by name.
pub fn scenario(name: &str) -> Option<Scenario> {
    scenarios().into_iter().find(|s| s.name == name)
}

/// The leading comment of each embedded file: (name, comment lines).
pub fn embedded_texts() -> impl Iterator<Item = (&'static str, &'static str)> {
    embedded_files::EMBEDDED.iter().map(|(n, _, t)| (*n, *t))
}

fn parse(cx: &Ctx<'_>) -> Result<Doc, LoadError> {
    let de = toml::Deserializer::parse(cx.text).map_err(|e| {
        let field = e
            .span()
            .map(|span| syntax_field(cx.text, &span))
            .unwrap_or_default();
        cx.err(e.span().as_ref(), field, e.message().to_string())
    })?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        // `Spanned` wraps values in a private struct; its field is no part of the schema.
        let field = field.replace(".$__serde_spanned_private_value", "");
        let field = field.replace("$__serde_spanned_private_value.", "");
        let field = if field == "." { String::new() } else { field };
        cx.err(inner.span().as_ref(), field, inner.message().to_string())
    })
}

/// The field a TOML syntax error sits in, as far as the text says: the enclosing table
/// header and, when the error's span is a bare key (a duplicate key), that key.
fn syntax_field(text: &str, span: &Range<usize>) -> String {
    let start = span.start.min(text.len());
    let table = text[..start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .and_then(|l| l.trim_start_matches('[').split(']').next())
        .map(|t| t.trim().to_string());
    let key = text.get(span.clone()).map(str::trim).filter(|k| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    });
    match (table, key) {
        (Some(t), Some(k)) => format!("{t}.{k}"),
        (Some(t), None) => t,
        (None, Some(k)) => k.to_string(),
        (None, None) => String::new(),
    }
}

fn family(cx: &Ctx<'_>, name: &Spanned<String>, field: &str) -> Result<Family, LoadError> {
    Family::ALL
        .into_iter()
        .find(|f| f.name() == name.get_ref())
        .ok_or_else(|| {
            let known: Vec<&str> = Family::ALL.iter().map(|f| f.name()).collect();
            cx.err(
                Some(&name.span()),
                field,
                format!(
                    "unknown fault family {:?}; known: {}",
                    name.get_ref(),
                    known.join(", ")
                ),
            )
        })
}

fn build(cx: &Ctx<'_>, name: String, doc: Doc) -> Result<Scenario, LoadError> {
    let about = build_about(cx, &doc.about)?;
    let Topology {
        seats,
        executors,
        fleet,
        names,
        codec_fraction,
    } = build_topology(cx, doc.topology)?;
    let WorkloadParts {
        jobs,
        job_mean,
        job_max,
        knobs,
        arrival,
    } = build_workload(cx, doc.workload, &fleet)?;
    let FaultsParts {
        modes,
        intensity,
        script,
        fault_window,
    } = build_faults(cx, doc.faults, &names)?;
    let (config, tight, config_span) = build_config(cx, doc.config)?;
    let expect = build_expect(cx, doc.expect)?;

    let s = Scenario {
        name,
        about,
        executors,
        jobs,
        arrival,
        fault_window,
        job_mean,
        job_max,
        seats,
        codec_fraction,
        modes,
        tight,
        intensity,
        fleet,
        knobs,
        script,
        config,
        expect,
        keep: doc.shrunk.map(|k| crate::scenario::Keep {
            seed: k.seed,
            faults: k.faults,
            jobs: k.jobs,
        }),
        bug: None,
    };
    if let Err(e) = s.mill_config().validate() {
        return Err(cx.err(
            config_span.as_ref(),
            "config",
            format!("invalid mill config: {e}"),
        ));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"# a test scenario
about = "two executors"

[topology]
executors = 2

[workload]
jobs = 10
arrivals = "20s"
duration = { mean = "1s", max = "5s" }

[faults]
window = "60s"
script = [
  { at = "10s", partition = ["x1"], for = "5s" },
  { at = "30s", crash = "mill", restart_after = "2s" },
]

[expect]
reach = ["commit-resent"]
"#;

    fn load(text: &str) -> Result<Scenario, LoadError> {
        load_str("scenarios/t.toml", text)
    }

    fn err(text: &str) -> String {
        match load(text) {
            Ok(_) => panic!("loaded:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_good_file_loads() {
        let s = load(GOOD).unwrap();
        assert_eq!(s.name, "t");
        assert_eq!(s.executors, 2);
        assert_eq!(s.fault_window, 60 * SEC);
        assert_eq!(s.script.len(), 2);
        assert_eq!(s.expect.reach, vec![Path::CommitResent]);
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30s"), Some(30 * SEC));
        assert_eq!(parse_duration("250ms"), Some(250 * MS));
        assert_eq!(parse_duration("1.5s"), Some(1500 * MS));
        assert_eq!(parse_duration("2m30s"), Some(150 * SEC));
        assert_eq!(parse_duration("4x"), None);
        assert_eq!(parse_duration(""), None);
        assert_eq!(parse_duration("s"), None);
    }

    #[test]
    fn a_bad_duration_names_file_line_and_field() {
        let text = GOOD.replace(
            r#"{ at = "30s", crash = "mill", restart_after = "2s" }"#,
            r#"{ at = "30s", crash = "mill", restart_after = "4x" }"#,
        );
        let e = err(&text);
        assert!(
            e.starts_with(
                "scenarios/t.toml:16: faults.script[1].restart_after: invalid duration \"4x\""
            ),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_field_names_file_line_and_field() {
        let text = GOOD.replace("jobs = 10", "jobs = 10\njobz = 3");
        let e = err(&text);
        assert!(
            e.starts_with("scenarios/t.toml:9: workload.jobz: unknown field `jobz`"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_executor_names_file_line_and_field() {
        let text = GOOD.replace(r#"partition = ["x1"]"#, r#"partition = ["exec-7"]"#);
        let e = err(&text);
        assert!(
            e.starts_with(
                "scenarios/t.toml:15: faults.script[0].partition[0]: unknown executor \"exec-7\""
            ),
            "{e}"
        );
    }

    #[test]
    fn a_missing_required_field_names_file_line_and_field() {
        let text = GOOD.replace("jobs = 10\n", "");
        let e = err(&text);
        assert!(
            e.starts_with("scenarios/t.toml:7: workload: missing field `jobs`"),
            "{e}"
        );
        let text = GOOD.replace(r#", for = "5s""#, "");
        let e = err(&text);
        assert!(
            e.starts_with("scenarios/t.toml:15: faults.script[0].for: missing field `for`"),
            "{e}"
        );
    }

    #[test]
    fn semantic_errors_name_file_line_and_field() {
        let e = err(&GOOD.replace(r#"at = "30s""#, r#"at = "90s""#));
        assert!(
            e.starts_with("scenarios/t.toml:16: faults.script[1].at: 90s is after the end"),
            "{e}"
        );
        let e = err(&GOOD.replace("executors = 2", "executors = 2\nseats = [0, 3]"));
        assert!(e.starts_with("scenarios/t.toml:6: topology.seats:"), "{e}");
        let e = err(&GOOD.replace(r#"["commit-resent"]"#, r#"["commit-resend"]"#));
        assert!(
            e.starts_with(
                "scenarios/t.toml:20: expect.reach[0]: unknown rare-path counter \"commit-resend\""
            ),
            "{e}"
        );
    }

    #[test]
    fn more_mistakes_name_file_line_and_field() {
        let e = err(&GOOD.replace(r#"about = "two executors""#, r#"about = " ""#));
        assert!(
            e.starts_with("scenarios/t.toml:2: about: must be one non-empty line"),
            "{e}"
        );
        let e = err(&GOOD.replace("jobs = 10", "jobs = 0"));
        assert!(
            e.starts_with("scenarios/t.toml:8: workload.jobs: at least one job"),
            "{e}"
        );
        let e = err(&GOOD.replace("window = \"60s\"\n", "on = [\"partition\"]\n"));
        assert!(
            e.starts_with("scenarios/t.toml:13: faults.window: missing"),
            "{e}"
        );
    }

    #[test]
    fn syntax_errors_name_the_field_too() {
        let e = err(&GOOD.replace("jobs = 10", "jobs = 10\njobs = 3"));
        assert!(
            e.starts_with("scenarios/t.toml:9: workload.jobs: duplicate key"),
            "{e}"
        );
        let e = err(&GOOD.replace("jobs = 10", "jobs = = 10"));
        assert!(e.starts_with("scenarios/t.toml:8: workload: "), "{e}");
        let e = err(&GOOD.replace("[workload]", "[workload]  # the jobs\nwho = 1\nwho = 2"));
        assert!(
            e.starts_with("scenarios/t.toml:9: workload.who: duplicate key"),
            "{e}"
        );
    }

    #[test]
    fn a_fault_outlasting_the_window_is_an_error_not_cut_short() {
        // The heal at the end of the window lifts every cut and restarts every process: a
        // partition "for 40s" at 30 s in a 60 s window would silently last 30 s.
        let e = err(&GOOD.replace(
            r#"{ at = "10s", partition = ["x1"], for = "5s" }"#,
            r#"{ at = "30s", partition = ["x1"], for = "40s" }"#,
        ));
        assert!(
            e.starts_with("scenarios/t.toml:15: faults.script[0]: lasts until 70s, after the end"),
            "{e}"
        );
        let e = err(&GOOD.replace(r#"restart_after = "2s""#, r#"restart_after = "31s""#));
        assert!(
            e.starts_with("scenarios/t.toml:16: faults.script[1]: lasts until 61s"),
            "{e}"
        );
        // Ending exactly at the window is fine.
        load(&GOOD.replace(r#"restart_after = "2s""#, r#"restart_after = "30s""#)).unwrap();
    }

    #[test]
    fn invariants_and_config_are_checked() {
        let s = load(&GOOD.replace("[expect]", "[expect]\ninvariants = [\"I1\", \"I9\"]")).unwrap();
        assert!(s.checks("I1") && s.checks("I9") && !s.checks("I3"));
        let e = err(&GOOD.replace("[expect]", "[expect]\ninvariants = [\"I11\"]"));
        assert!(
            e.starts_with("scenarios/t.toml:20: expect.invariants[0]: unknown invariant \"I11\""),
            "{e}"
        );
        let e = err(&GOOD.replace("[expect]", "[config]\nbid_timeout = \"0s\"\n\n[expect]"));
        assert!(e.starts_with("scenarios/t.toml:"), "{e}");
        assert!(e.contains(": config: invalid mill config"), "{e}");
        let e = err(&GOOD.replace(
            "executors = 2",
            "executors = 2\n[[topology.executor]]\nname = \"a\"",
        ));
        assert!(
            e.starts_with("scenarios/t.toml:5: topology.executors: give either"),
            "{e}"
        );
    }

    #[test]
    fn the_embedded_library_loads() {
        let all = embedded().unwrap();
        assert!(all.len() >= 22, "{} scenarios", all.len());
        for (name, text) in embedded_texts() {
            assert!(text.starts_with('#'), "{name}: no leading comment");
        }
    }
}

#[cfg(test)]
mod library_tests {
    use super::*;
    use crate::scenario::SeedPlan;

    #[test]
    fn every_scenario_has_a_valid_mill_config_and_unique_name() {
        let all = scenarios();
        for s in &all {
            assert!(s.mill_config().validate().is_ok(), "{}", s.name);
            assert!(!s.about.is_empty(), "{}", s.name);
            assert_eq!(all.iter().filter(|o| o.name == s.name).count(), 1);
        }
    }

    #[test]
    fn swarm_leaves_at_least_one_family_off() {
        let s = scenario("smoke").unwrap();
        for seed in 0..200 {
            let plan = SeedPlan::new(&s, seed);
            assert!(Family::ALL.iter().any(|f| !plan.swarm.has(*f)));
        }
    }

    #[test]
    fn plans_are_a_function_of_the_seed() {
        let s = scenario("fleet-5x1000").unwrap();
        let a = SeedPlan::new(&s, 42);
        let b = SeedPlan::new(&s, 42);
        assert_eq!(a.swarm, b.swarm);
        assert_eq!(a.faults, b.faults);
    }
}
