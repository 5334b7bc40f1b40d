//! Failure reports: everything needed to understand a failing seed and the one command that
//! replays it.

use std::fmt::Write as _;

use crate::trace::secs;
use crate::workload::ExecSpec;
use crate::Outcome;

/// Lines of trace a report shows.
pub const REPORT_LINES: usize = 50;

/// One line describing an executor of the fleet.
pub fn describe_exec(e: &ExecSpec) -> String {
    let mut s = format!("{}:", e.name);
    for (name, engine) in &e.engines {
        let _ = write!(s, " {name}×{}", engine.capacity);
        for (r, v) in &engine.resources {
            let _ = write!(s, "({r}={v})");
        }
    }
    if !e.labels.is_empty() {
        let labels: Vec<&str> = e.labels.iter().map(String::as_str).collect();
        let _ = write!(s, " labels={}", labels.join(","));
    }
    if let Some(k) = e.byzantine {
        let _ = write!(s, " MISBEHAVES:{}", k.name());
    }
    if e.slow_stop {
        s.push_str(" slow-stop");
    }
    if let Some((r, v)) = &e.extra_charge {
        let _ = write!(s, " charges+{r}={v}");
    }
    s
}

/// The replay command for a seed.
pub fn replay_command(scenario: &str, seed: u64) -> String {
    format!("cargo run --release -p sim -- replay --seed {seed} --scenario {scenario} --trace trace-{seed}.txt")
}

/// The full report of a failing outcome. `traced` should be a traced re-run of the same seed
/// (for its last lines); the outcome itself is used if it was traced.
pub fn failure_report(o: &Outcome, traced: Option<&Outcome>) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "FAILED: seed {} in scenario {}", o.seed, o.scenario);
    if let Some(v) = &o.failure {
        let _ = writeln!(s, "  violated: {v}");
    }
    let _ = writeln!(s, "  at simulated time {}", secs(o.end));
    let _ = writeln!(s, "  fault families on: {}", o.plan.swarm);
    let _ = writeln!(s, "  fleet:");
    for e in &o.fleet {
        let _ = writeln!(s, "    {}", describe_exec(e));
    }
    let _ = writeln!(
        s,
        "  fault schedule ({} faults):",
        o.plan.faults.faults.len()
    );
    for (at, f) in &o.plan.faults.faults {
        let _ = writeln!(s, "    {:>10}  {f}", secs(*at));
    }
    let lines = traced.map_or(&o.last_lines, |t| &t.last_lines);
    if let Some(t) = traced {
        if t.failure != o.failure {
            let _ = writeln!(
                s,
                "  !! the traced re-run ended differently: {:?} (determinism broken, I10)",
                t.failure
            );
        }
    }
    let _ = writeln!(s, "  last {} trace lines:", lines.len());
    for l in lines {
        let _ = writeln!(s, "    {l}");
    }
    let _ = writeln!(s, "  replay: {}", replay_command(&o.scenario, o.seed));
    s
}
