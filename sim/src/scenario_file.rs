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

// ---- the schema ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Doc {
    about: Spanned<String>,
    topology: Spanned<TopologyDoc>,
    workload: WorkloadDoc,
    #[serde(default)]
    faults: FaultsDoc,
    #[serde(default)]
    config: Option<Spanned<ConfigDoc>>,
    #[serde(default)]
    expect: ExpectDoc,
    #[serde(default)]
    shrunk: Option<ShrunkDoc>,
}

/// `[shrunk]`: what `millrace-sim shrink` kept of its seed's plan and workload.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShrunkDoc {
    /// The seed it was shrunk from (replay with this seed).
    seed: u64,
    /// Indices into the seed's fault plan.
    faults: Vec<usize>,
    /// Indices into the seed's arrivals.
    jobs: Vec<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopologyDoc {
    /// A drawn fleet of this many executors, `x0`, `x1`, …
    executors: Option<Spanned<usize>>,
    /// Seats per engine of a drawn fleet, lowest and highest.
    seats: Option<Spanned<(u32, u32)>>,
    /// An explicit fleet, in groups.
    #[serde(default)]
    executor: Vec<GroupDoc>,
    /// Fraction of messages through the wire codec.
    codec_fraction: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupDoc {
    name: Spanned<String>,
    count: Option<Spanned<usize>>,
    #[serde(default)]
    labels: BTreeSet<String>,
    #[serde(default)]
    engines: BTreeMap<String, EngineDoc>,
    byzantine: Option<Spanned<String>>,
    #[serde(default)]
    slow_stop: bool,
    #[serde(default)]
    extra_charge: Option<Spanned<BTreeMap<String, u64>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineDoc {
    seats: Spanned<u32>,
    #[serde(default)]
    resources: BTreeMap<String, u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkloadDoc {
    jobs: Spanned<usize>,
    arrivals: Spanned<Dur>,
    duration: DurationDoc,
    burst: Option<Spanned<f64>>,
    cancel_rate: Option<Spanned<f64>>,
    cancel_within: Option<Dur>,
    invalid_rate: Option<Spanned<f64>>,
    owners: Option<Spanned<usize>>,
    max_pending: Option<Spanned<usize>>,
    cpu_millis: Option<Spanned<(u64, u64)>>,
    quota: Option<QuotaDoc>,
    #[serde(default)]
    require: Vec<RequireDoc>,
    retry_rate: Option<Spanned<f64>>,
    priorities: Option<Spanned<u32>>,
    pinned: Option<Spanned<f64>>,
    whole_engine: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DurationDoc {
    mean: Spanned<Dur>,
    max: Spanned<Dur>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaDoc {
    #[serde(default)]
    owner: Resources,
    #[serde(default)]
    repo: Resources,
    #[serde(default)]
    owners: BTreeMap<String, Resources>,
    #[serde(default)]
    repos: BTreeMap<String, Resources>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequireDoc {
    labels: BTreeSet<String>,
    share: Spanned<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultsDoc {
    window: Option<Spanned<Dur>>,
    #[serde(default)]
    on: Vec<Spanned<String>>,
    #[serde(default)]
    swarm: Vec<Spanned<String>>,
    #[serde(default)]
    intensity: BTreeMap<String, Spanned<f64>>,
    #[serde(default)]
    script: Vec<Spanned<FaultDoc>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultDoc {
    at: Spanned<Dur>,
    #[serde(rename = "for")]
    for_: Option<Spanned<Dur>>,
    partition: Option<Vec<Spanned<String>>>,
    one_way: Option<bool>,
    clog: Option<Spanned<String>>,
    direction: Option<Spanned<String>>,
    spike: Option<Dur>,
    reset: Option<Spanned<String>>,
    crash: Option<Spanned<String>>,
    wipe: Option<Spanned<String>>,
    restart_after: Option<Dur>,
    silent: Option<bool>,
    flap: Option<Spanned<String>>,
    period: Option<Spanned<Dur>>,
    down: Option<Dur>,
    at_commit: Option<bool>,
    lag: Option<Spanned<String>>,
    hang: Option<Spanned<String>>,
    lose: Option<Spanned<String>>,
    twin: Option<Spanned<String>>,
    max_delay: Option<Spanned<Dur>>,
    max_inputs: Option<Spanned<u32>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigDoc {
    preset: Option<Spanned<String>>,
    reconnect_grace: Option<Dur>,
    silence_timeout: Option<Dur>,
    snapshot_interval: Option<Dur>,
    bid_timeout: Option<Dur>,
    cancel_ack_timeout: Option<Dur>,
    cancel_teardown_timeout: Option<Dur>,
    job_timeout: Option<Dur>,
    queue_timeout: Option<Dur>,
    quarantine_strikes: Option<u32>,
    max_sessions: Option<usize>,
    direct_placement: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpectDoc {
    invariants: Option<Vec<Spanned<String>>>,
    liveness_bound: Option<Dur>,
    #[serde(default)]
    reach: Vec<Spanned<String>>,
    seeds: Option<u64>,
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
    let about = doc.about.get_ref().trim().to_string();
    if about.is_empty() || about.contains('\n') {
        return Err(cx.err(
            Some(&doc.about.span()),
            "about",
            "must be one non-empty line",
        ));
    }

    // Topology.
    let topo_span = doc.topology.span();
    let topo = doc.topology.into_inner();
    let seats = match &topo.seats {
        Some(s) => {
            let (lo, hi) = *s.get_ref();
            if lo == 0 || lo > hi {
                return Err(cx.err(
                    Some(&s.span()),
                    "topology.seats",
                    format!("[{lo}, {hi}] is not a seat range (lowest >= 1, lowest <= highest)"),
                ));
            }
            (lo, hi)
        }
        None => (1, 4),
    };
    let (executors, fleet) =
        match (&topo.executors, topo.executor.is_empty()) {
            (Some(n), true) => {
                if *n.get_ref() == 0 {
                    return Err(cx.err(
                        Some(&n.span()),
                        "topology.executors",
                        "at least one executor",
                    ));
                }
                (*n.get_ref(), None)
            }
            (None, false) => {
                let fleet = build_fleet(cx, &topo.executor)?;
                (fleet.len(), Some(fleet))
            }
            (Some(n), false) => return Err(cx.err(
                Some(&n.span()),
                "topology.executors",
                "give either a count (`executors = N`) or `[[topology.executor]]` groups, not both",
            )),
            (None, true) => {
                return Err(cx.err(
                    Some(&topo_span),
                    "topology",
                    "missing field `executors` (a count) or `[[topology.executor]]` groups",
                ))
            }
        };
    let names: Vec<String> = match &fleet {
        Some(f) => f.iter().map(|t: &ExecTemplate| t.name.clone()).collect(),
        None => (0..executors).map(|i| format!("x{i}")).collect(),
    };
    let codec_fraction = match &topo.codec_fraction {
        Some(v) => cx.share(v, "topology.codec_fraction")?,
        None => 1.0,
    };

    // Workload.
    let wl = doc.workload;
    if *wl.jobs.get_ref() == 0 {
        return Err(cx.err(
            Some(&wl.jobs.span()),
            "workload.jobs",
            "at least one job: a scenario without jobs checks nothing",
        ));
    }
    let job_mean = wl.duration.mean.get_ref().0;
    let job_max = wl.duration.max.get_ref().0;
    if job_mean == 0 || job_mean > job_max {
        return Err(cx.err(
            Some(&wl.duration.mean.span()),
            "workload.duration.mean",
            format!(
                "{} must be positive and at most max ({})",
                format_micros(job_mean),
                format_micros(job_max)
            ),
        ));
    }
    let mut knobs = Knobs::default();
    if let Some(v) = &wl.burst {
        knobs.burst = Some(cx.share(v, "workload.burst")?);
    }
    if let Some(v) = &wl.cancel_rate {
        knobs.cancel_rate = Some(cx.share(v, "workload.cancel_rate")?);
    }
    knobs.cancel_within = wl.cancel_within.map(|d| d.0.max(1));
    if let Some(v) = &wl.invalid_rate {
        knobs.invalid_rate = Some(cx.share(v, "workload.invalid_rate")?);
    }
    if let Some(v) = &wl.retry_rate {
        knobs.retry_rate = Some(cx.share(v, "workload.retry_rate")?);
    }
    if let Some(v) = &wl.pinned {
        knobs.pinned = Some(cx.share(v, "workload.pinned")?);
    }
    if let Some(v) = &wl.whole_engine {
        knobs.whole_engine = Some(cx.share(v, "workload.whole_engine")?);
    }
    if let Some(v) = &wl.priorities {
        if *v.get_ref() > 1_000_000 {
            return Err(cx.err(
                Some(&v.span()),
                "workload.priorities",
                "at most 1000000 (jobs draw a priority in -n..=n)",
            ));
        }
        knobs.priorities = Some(*v.get_ref());
    }
    if let Some(v) = &wl.owners {
        if *v.get_ref() == 0 {
            return Err(cx.err(Some(&v.span()), "workload.owners", "at least one owner"));
        }
        knobs.owners = Some(*v.get_ref());
    }
    if let Some(v) = &wl.max_pending {
        if *v.get_ref() == 0 {
            return Err(cx.err(Some(&v.span()), "workload.max_pending", "at least 1"));
        }
        knobs.max_pending = Some(*v.get_ref());
    }
    if let Some(v) = &wl.cpu_millis {
        let (lo, hi) = *v.get_ref();
        if lo == 0 || lo >= hi {
            return Err(cx.err(
                Some(&v.span()),
                "workload.cpu_millis",
                format!("[{lo}, {hi}] is not a range (0 < lowest < highest)"),
            ));
        }
        knobs.cpu_millis = Some((lo, hi));
    }
    knobs.quota = wl.quota.map(|q| QuotaConfig {
        owner_defaults: q.owner,
        repo_defaults: q.repo,
        owner_overrides: q.owners,
        repo_overrides: q.repos,
    });
    for (k, r) in wl.require.iter().enumerate() {
        let share = cx.share(&r.share, &format!("workload.require[{k}].share"))?;
        let holders = fleet.as_ref().map(|f: &Vec<ExecTemplate>| {
            f.iter()
                .filter(|t| t.byzantine.is_none() && r.labels.is_subset(&t.labels))
                .count()
        });
        if holders == Some(0) {
            return Err(cx.err(
                Some(&r.share.span()),
                format!("workload.require[{k}].labels"),
                format!(
                    "no honest executor holds all of {:?}: such jobs would wait forever (M13)",
                    r.labels
                ),
            ));
        }
        knobs.require.push((r.labels.clone(), share));
    }
    let arrival = wl.arrivals.get_ref().0;

    // Faults.
    let fd = doc.faults;
    let mut modes = [Mode::Off; Family::COUNT];
    for (k, f) in fd.on.iter().enumerate() {
        if f.get_ref() == "all" {
            // "all": the families the library's seed plans were fixed with; the late
            // ones (hang, lose) are named explicitly.
            for fam in Family::ALL.into_iter().filter(|f| !f.late()) {
                modes[fam as usize] = Mode::On;
            }
        } else {
            modes[family(cx, f, &format!("faults.on[{k}]"))? as usize] = Mode::On;
        }
    }
    for (k, f) in fd.swarm.iter().enumerate() {
        if f.get_ref() == "all" {
            for fam in Family::ALL.into_iter().filter(|f| !f.late()) {
                modes[fam as usize] = Mode::Swarm;
            }
        } else {
            let fam = family(cx, f, &format!("faults.swarm[{k}]"))?;
            if modes[fam as usize] == Mode::On {
                return Err(cx.err(
                    Some(&f.span()),
                    format!("faults.swarm[{k}]"),
                    format!("{:?} is already in `on`", f.get_ref()),
                ));
            }
            modes[fam as usize] = Mode::Swarm;
        }
    }
    let mut intensity = [None; Family::COUNT];
    for (fam, v) in &fd.intensity {
        let field = format!("faults.intensity.{fam}");
        let spanned = Spanned::new(v.span(), fam.clone());
        let f = family(cx, &spanned, &field)?;
        let x = cx.share(v, &field)?;
        if x <= 0.0 {
            return Err(cx.err(Some(&v.span()), field, "an intensity is above 0"));
        }
        intensity[f as usize] = Some(x);
    }
    let mut script = Vec::new();
    let mut last_end: Micros = 0;
    for (k, f) in fd.script.iter().enumerate() {
        let span = f.span();
        let faults = build_fault(cx, k, f.get_ref(), &span, &names)?;
        for (at, fault) in faults {
            last_end = last_end.max(fault_end(at, &fault));
            script.push((at, fault));
        }
    }
    script.sort_by_key(|(t, _)| *t);
    let any_family = modes.iter().any(|m| *m != Mode::Off);
    let fault_window = match &fd.window {
        Some(w) => {
            let w_val = w.get_ref().0;
            for (k, f) in fd.script.iter().enumerate() {
                let at = f.get_ref().at.get_ref().0;
                let end = build_fault(cx, k, f.get_ref(), &f.span(), &names)?
                    .iter()
                    .map(|(at, fault)| fault_end(*at, fault))
                    .max()
                    .unwrap_or(at);
                if at < w_val && end > w_val {
                    return Err(cx.err(
                        Some(&f.span()),
                        format!("faults.script[{k}]"),
                        format!(
                            "lasts until {}, after the end of the fault window ({}): the heal \
                             would cut it short",
                            format_micros(end),
                            format_micros(w_val)
                        ),
                    ));
                }
                if at >= w_val {
                    return Err(cx.err(
                        Some(&f.get_ref().at.span()),
                        format!("faults.script[{k}].at"),
                        format!(
                            "{} is after the end of the fault window ({}): the network heals then",
                            format_micros(at),
                            format_micros(w_val)
                        ),
                    ));
                }
            }
            w_val
        }
        None if any_family => {
            return Err(cx.err(
                fd.on
                    .iter()
                    .chain(&fd.swarm)
                    .next()
                    .map(Spanned::span)
                    .as_ref(),
                "faults.window",
                "missing: families in `on` or `swarm` need a window to act in",
            ))
        }
        None if script.is_empty() => 0,
        None => last_end + 10 * SEC,
    };

    // Config.
    let mut config = ConfigOverrides::default();
    let mut tight = false;
    let mut config_span = None;
    if let Some(c) = doc.config {
        config_span = Some(c.span());
        let c = c.into_inner();
        if let Some(p) = &c.preset {
            match p.get_ref().as_str() {
                "tight" => tight = true,
                "production" => {}
                other => {
                    return Err(cx.err(
                        Some(&p.span()),
                        "config.preset",
                        format!("unknown preset {other:?}; known: tight, production"),
                    ))
                }
            }
        }
        let d = |x: Option<Dur>| x.map(|d| Duration::from_micros(d.0));
        config = ConfigOverrides {
            reconnect_grace: d(c.reconnect_grace),
            silence_timeout: d(c.silence_timeout),
            snapshot_interval: d(c.snapshot_interval),
            bid_timeout: d(c.bid_timeout),
            cancel_ack_timeout: d(c.cancel_ack_timeout),
            cancel_teardown_timeout: d(c.cancel_teardown_timeout),
            job_timeout: d(c.job_timeout),
            queue_timeout: d(c.queue_timeout),
            quarantine_strikes: c.quarantine_strikes,
            max_sessions: c.max_sessions,
            direct_placement: c.direct_placement,
        };
    }

    // Expectations.
    let ed = doc.expect;
    let invariants = match &ed.invariants {
        None => None,
        Some(list) => {
            let mut set = BTreeSet::new();
            for (k, r) in list.iter().enumerate() {
                let rule = r.get_ref().as_str();
                if rule == "all" {
                    return Err(cx.err(
                        Some(&r.span()),
                        format!("expect.invariants[{k}]"),
                        "leave `invariants` out to check them all",
                    ));
                }
                if !RULES.contains(&rule) {
                    return Err(cx.err(
                        Some(&r.span()),
                        format!("expect.invariants[{k}]"),
                        format!("unknown invariant {rule:?}; known: {}", RULES.join(", ")),
                    ));
                }
                set.insert(rule.to_string());
            }
            Some(set)
        }
    };
    let mut reach = Vec::new();
    for (k, r) in ed.reach.iter().enumerate() {
        let p = Path::from_key(r.get_ref()).ok_or_else(|| {
            let known: Vec<&str> = Path::ALL.iter().map(|p| p.key()).collect();
            cx.err(
                Some(&r.span()),
                format!("expect.reach[{k}]"),
                format!(
                    "unknown rare-path counter {:?}; known: {}",
                    r.get_ref(),
                    known.join(", ")
                ),
            )
        })?;
        reach.push(p);
    }
    let expect = Expect {
        invariants,
        liveness_bound: ed.liveness_bound.map(|d| d.0),
        reach,
        seeds: ed.seeds.unwrap_or(Expect::default().seeds),
    };

    let s = Scenario {
        name,
        about,
        executors,
        jobs: *wl.jobs.get_ref(),
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

fn build_fleet(cx: &Ctx<'_>, groups: &[GroupDoc]) -> Result<Vec<ExecTemplate>, LoadError> {
    let mut fleet: Vec<ExecTemplate> = Vec::new();
    for (k, g) in groups.iter().enumerate() {
        let field = |f: &str| format!("topology.executor[{k}].{f}");
        let mut engines = BTreeMap::new();
        for (ename, e) in &g.engines {
            if *e.seats.get_ref() == 0 {
                return Err(cx.err(
                    Some(&e.seats.span()),
                    field(&format!("engines.{ename}.seats")),
                    "seats = 0: an engine needs at least one seat",
                ));
            }
            engines.insert(
                ename.clone(),
                EngineConfig {
                    capacity: *e.seats.get_ref(),
                    resources: e.resources.clone(),
                },
            );
        }
        if engines.is_empty() {
            engines.insert(
                "shell".to_string(),
                EngineConfig {
                    capacity: 2,
                    resources: Resources::from([("cpu_millis".to_string(), 8000)]),
                },
            );
        }
        let byzantine = match &g.byzantine {
            None => None,
            Some(b) => Some(
                ByzKind::NAMED
                    .into_iter()
                    .find(|x| x.name() == b.get_ref())
                    .ok_or_else(|| {
                        let known: Vec<&str> = ByzKind::NAMED.iter().map(|x| x.name()).collect();
                        cx.err(
                            Some(&b.span()),
                            field("byzantine"),
                            format!(
                                "unknown misbehaviour {:?}; known: {}",
                                b.get_ref(),
                                known.join(", ")
                            ),
                        )
                    })?,
            ),
        };
        let extra_charge = match &g.extra_charge {
            None => None,
            Some(m) => {
                if m.get_ref().len() != 1 {
                    return Err(cx.err(
                        Some(&m.span()),
                        field("extra_charge"),
                        "name exactly one resource, like { disk_mb = 2 }",
                    ));
                }
                m.get_ref().iter().next().map(|(r, a)| (r.clone(), *a))
            }
        };
        let names: Vec<String> = match &g.count {
            None => vec![g.name.get_ref().clone()],
            Some(c) if *c.get_ref() == 0 => {
                return Err(cx.err(Some(&c.span()), field("count"), "at least 1"));
            }
            Some(c) => (0..*c.get_ref())
                .map(|j| format!("{}-{j}", g.name.get_ref()))
                .collect(),
        };
        for n in names {
            if millrace_core::NodeId::new(n.clone()).is_err() || n == "mill" {
                return Err(cx.err(
                    Some(&g.name.span()),
                    field("name"),
                    format!("{n:?} is not a valid node id"),
                ));
            }
            if fleet.iter().any(|t| t.name == n) {
                return Err(cx.err(
                    Some(&g.name.span()),
                    field("name"),
                    format!("executor {n:?} is defined twice"),
                ));
            }
            fleet.push(ExecTemplate {
                name: n,
                labels: g.labels.clone(),
                engines: engines.clone(),
                byzantine,
                slow_stop: g.slow_stop,
                extra_charge: extra_charge.clone(),
            });
        }
    }
    if fleet.iter().all(|t| t.byzantine.is_some()) {
        return Err(cx.err(
            groups.first().map(|g| g.name.span()).as_ref(),
            "topology.executor",
            "at least one executor must be honest (it runs the workload)",
        ));
    }
    Ok(fleet)
}

fn fault_end(at: Micros, f: &Fault) -> Micros {
    match f {
        Fault::Partition { until, .. }
        | Fault::Clog { until, .. }
        | Fault::Spike { until, .. }
        | Fault::Lag { until, .. }
        | Fault::Hang { until, .. }
        | Fault::Twin { until, .. } => *until,
        Fault::PauseMill { until } => *until,
        Fault::CutMillStore => at + crate::scenario::LEADER_LEASE,
        Fault::Reset { .. } | Fault::Lose { .. } => at,
        Fault::CrashExec { down, .. } | Fault::CrashMill { down, .. } => at + down,
    }
}

fn build_fault(
    cx: &Ctx<'_>,
    k: usize,
    f: &FaultDoc,
    span: &Range<usize>,
    names: &[String],
) -> Result<Vec<(Micros, Fault)>, LoadError> {
    let field = |x: &str| format!("faults.script[{k}].{x}");
    let exec = |n: &Spanned<String>, x: &str| -> Result<usize, LoadError> {
        names.iter().position(|m| m == n.get_ref()).ok_or_else(|| {
            let shown: Vec<&str> = names.iter().take(8).map(String::as_str).collect();
            cx.err(
                Some(&n.span()),
                field(x),
                format!(
                    "unknown executor {:?}; the fleet has {}{}",
                    n.get_ref(),
                    shown.join(", "),
                    if names.len() > 8 { ", …" } else { "" }
                ),
            )
        })
    };
    let actions = [
        f.partition.is_some(),
        f.clog.is_some(),
        f.spike.is_some(),
        f.reset.is_some(),
        f.crash.is_some(),
        f.wipe.is_some(),
        f.flap.is_some(),
        f.lag.is_some(),
        f.hang.is_some(),
        f.lose.is_some(),
        f.twin.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if actions != 1 {
        return Err(cx.err(
            Some(span),
            format!("faults.script[{k}]"),
            format!(
                "name exactly one of partition, clog, spike, reset, crash, wipe, flap, lag, hang, lose, twin ({actions} given)"
            ),
        ));
    }
    let at = f.at.get_ref().0;
    let length = |what: &str| -> Result<Micros, LoadError> {
        match &f.for_ {
            Some(d) if d.get_ref().0 > 0 => Ok(d.get_ref().0),
            Some(d) => Err(cx.err(Some(&d.span()), field("for"), "must be positive")),
            None => Err(cx.err(
                Some(span),
                field("for"),
                format!("missing field `for`: how long the {what} lasts"),
            )),
        }
    };
    let silent = f.silent.unwrap_or(false);
    if let Some(side) = &f.partition {
        if side.is_empty() {
            return Err(cx.err(Some(span), field("partition"), "name at least one executor"));
        }
        let mut idx = Vec::new();
        for (j, n) in side.iter().enumerate() {
            idx.push(exec(n, &format!("partition[{j}]"))?);
        }
        idx.sort_unstable();
        idx.dedup();
        let until = at + length("partition")?;
        return Ok(vec![(
            at,
            Fault::Partition {
                side: idx,
                one_way: f.one_way.unwrap_or(false),
                until,
            },
        )]);
    }
    if let Some(n) = &f.clog {
        let exec = exec(n, "clog")?;
        let to_mill = match &f.direction {
            None => true,
            Some(d) => match d.get_ref().as_str() {
                "to-mill" => true,
                "from-mill" => false,
                other => {
                    return Err(cx.err(
                        Some(&d.span()),
                        field("direction"),
                        format!("unknown direction {other:?}; known: to-mill, from-mill"),
                    ))
                }
            },
        };
        let until = at + length("clog")?;
        return Ok(vec![(
            at,
            Fault::Clog {
                exec,
                to_mill,
                until,
            },
        )]);
    }
    if let Some(extra) = f.spike {
        let until = at + length("latency spike")?;
        return Ok(vec![(
            at,
            Fault::Spike {
                extra: extra.0,
                until,
            },
        )]);
    }
    if let Some(n) = &f.reset {
        return Ok(vec![(
            at,
            Fault::Reset {
                exec: exec(n, "reset")?,
            },
        )]);
    }
    if let Some(n) = &f.crash {
        let down = f.restart_after.map_or(5 * SEC, |d| d.0.max(MS));
        if n.get_ref() == "mill" {
            if f.at_commit.is_some() {
                return Err(cx.err(
                    Some(span),
                    field("at_commit"),
                    "only an executor's crash can wait for a commit",
                ));
            }
            return Ok(vec![(at, Fault::CrashMill { down, silent })]);
        }
        return Ok(vec![(
            at,
            Fault::CrashExec {
                exec: exec(n, "crash")?,
                wipe: false,
                down,
                silent,
                at_commit: f.at_commit.unwrap_or(false),
            },
        )]);
    }
    if let Some(n) = &f.lag {
        let proc = if n.get_ref() == "mill" {
            Proc::Mill
        } else {
            Proc::Exec(exec(n, "lag")?)
        };
        let until = at + length("driver lag")?;
        let max_delay = match &f.max_delay {
            None => 2 * SEC,
            Some(d) if d.get_ref().0 > 0 => d.get_ref().0,
            Some(d) => return Err(cx.err(Some(&d.span()), field("max_delay"), "must be positive")),
        };
        let max_inputs = match &f.max_inputs {
            None => 1000,
            Some(k) if *k.get_ref() > 0 => *k.get_ref(),
            Some(k) => return Err(cx.err(Some(&k.span()), field("max_inputs"), "at least 1")),
        };
        return Ok(vec![(
            at,
            Fault::Lag {
                proc,
                until,
                max_delay,
                max_inputs,
            },
        )]);
    }
    if let Some(n) = &f.hang {
        let exec = exec(n, "hang")?;
        let until = at + length("hang")?;
        return Ok(vec![(at, Fault::Hang { exec, until })]);
    }
    if let Some(n) = &f.twin {
        let exec = exec(n, "twin")?;
        let until = at + length("twin")?;
        return Ok(vec![(at, Fault::Twin { exec, until })]);
    }
    if let Some(n) = &f.lose {
        return Ok(vec![(
            at,
            Fault::Lose {
                exec: exec(n, "lose")?,
            },
        )]);
    }
    if let Some(n) = &f.wipe {
        let down = f.restart_after.map_or(SEC, |d| d.0.max(MS));
        return Ok(vec![(
            at,
            Fault::CrashExec {
                exec: exec(n, "wipe")?,
                wipe: true,
                down,
                silent,
                at_commit: false,
            },
        )]);
    }
    if let Some(n) = &f.flap {
        let x = exec(n, "flap")?;
        let total = length("flapping")?;
        let period = match &f.period {
            None => 10 * SEC,
            Some(p) if p.get_ref().0 >= 2 * MS => p.get_ref().0,
            Some(p) => return Err(cx.err(Some(&p.span()), field("period"), "at least 2ms")),
        };
        let down = f.down.map_or(period / 2, |d| d.0).clamp(MS, period - MS);
        // Each period: the connection resets and the link stays cut for `down`.
        let mut out = Vec::new();
        let mut t = at;
        while t < at + total {
            out.push((t, Fault::Reset { exec: x }));
            out.push((
                t,
                Fault::Partition {
                    side: vec![x],
                    one_way: false,
                    until: t + down,
                },
            ));
            t += period;
        }
        return Ok(out);
    }
    Err(cx.err(Some(span), format!("faults.script[{k}]"), "no fault named"))
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
