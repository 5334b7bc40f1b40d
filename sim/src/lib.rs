//! millrace's deterministic simulator.
//!
//! One `u64` seed drives a whole cluster — one mill, N executors, a TCP-like network, engines
//! and a workload — through the very state machines production runs (`millrace_core`), on a
//! virtual clock, in a single thread. The seed picks which fault families are on (swarm
//! testing) and a fault plan (partitions, clogs, latency spikes, resets, crashes at any output
//! boundary or between a commit's receipt and its persist, disk wipes, mill restarts,
//! misbehaving executors, engines that ignore stops, and driver lag: Ticks held behind
//! batches of inputs so deadlines are handled late, as the node's drivers do, I12). There is
//! no pre-tick: an executor runs its due timers inside `handle`, and a step's `Persist`
//! outputs are group-committed before its other outputs, as the node's drivers do. Checkers
//! watch every step; after the fault window the network heals and every job must end
//! (liveness). A failing seed replays byte for byte: the trace hash is the proof.
//!
//! Modules: `types` (time units and `Violation`, a leaf), `rng` (seeded streams), `scenario`
//! (scenarios, swarm, fault plan), `scenario_file` (the TOML scenario library in `scenarios/`,
//! and its lookups `scenarios()`/`scenario(name)`), `watch` (scenario-targeted situations),
//! `workload` (fleet and jobs), `net` (connections), `byzantine` (violators), `world`
//! (state), `driver` (the event loop), `checkers` (invariants, one file per rule family),
//! `coverage` (rare paths), `trace` (lines, hash),
//! `report` (failure reports), `latency` (per-job times of a run), `quality` (placement
//! quality against an omniscient scheduler).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod byzantine;
pub mod checkers;
pub mod coverage;
pub mod driver;
pub mod fairness;
pub mod latency;
pub mod liveness;
pub mod net;
pub mod quality;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod scenario_file;
pub mod shrink;
pub mod timeline;
pub mod trace;
pub mod types;
pub mod watch;
pub mod workload;
pub mod world;

use std::panic::{catch_unwind, AssertUnwindSafe};

use checkers::Violation;
use coverage::Coverage;
use driver::{Sim, Stats};
use scenario::{Micros, Scenario, SeedPlan};
use trace::Trace;
use workload::ExecSpec;

/// What one seed did.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The scenario's name.
    pub scenario: String,
    /// The seed.
    pub seed: u64,
    /// Its swarm and fault plan.
    pub plan: SeedPlan,
    /// Its fleet.
    pub fleet: Vec<ExecSpec>,
    /// The first broken rule, if any.
    pub failure: Option<Violation>,
    /// Simulated time when it failed (or ended).
    pub end: Micros,
    /// Rare paths reached.
    pub coverage: Coverage,
    /// Counters.
    pub stats: Stats,
    /// Per-job submit, placement and terminal times.
    pub times: latency::JobTimes,
    /// The trace hash, when traced.
    pub trace_hash: Option<String>,
    /// Trace lines recorded.
    pub trace_lines: u64,
    /// The last trace lines, when traced.
    pub last_lines: Vec<String>,
}

/// Runs one seed. A panic inside the core (or the simulator) is reported as a failure.
pub fn run(scenario: &Scenario, seed: u64, trace: Trace) -> Outcome {
    let mut sim = Sim::new(scenario, seed, trace);
    let result = catch_unwind(AssertUnwindSafe(|| sim.run()));
    if let Err(panic) = result {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "(no message)".into());
        sim.failure.get_or_insert(Violation {
            rule: "panic",
            message: what,
        });
    }
    let traced = sim.trace.enabled();
    Outcome {
        scenario: scenario.name.clone(),
        seed,
        plan: sim.w.plan.clone(),
        fleet: sim.w.workload.fleet.clone(),
        failure: sim.failure.clone(),
        end: sim.w.now,
        coverage: sim.cov.clone(),
        stats: sim.stats,
        times: std::mem::take(&mut sim.times),
        trace_hash: traced.then(|| sim.trace.hash()),
        trace_lines: sim.trace.count(),
        last_lines: sim.trace.last_lines(),
    }
}

/// Runs one seed without a trace (the fast path fuzzing takes).
pub fn run_fast(scenario: &Scenario, seed: u64) -> Outcome {
    run(scenario, seed, Trace::off())
}

/// Runs one seed with a trace keeping the last `keep` lines.
pub fn run_traced(scenario: &Scenario, seed: u64, keep: usize) -> Outcome {
    run(scenario, seed, Trace::on(keep, None))
}
