//! `cargo test -p sim`: a large fixed seed list for each of the ten original scenarios, a random fuzz budget
//! (`SIM_SEEDS=N` raises it), determinism (I10), and coverage of the rare paths.
//!
//! The fixed seeds never change, so a regression shows up as the same seed failing again;
//! the random budget starts from a seed derived from the clock and prints it, so any failure
//! it finds is a `replay` away.

use std::sync::OnceLock;

use sim::coverage::{Coverage, Path};
use sim::report::{failure_report, REPORT_LINES};
use sim::scenario::Scenario;
use sim::scenario_file::{scenario, scenarios};

/// Fixed seeds per scenario: (name, first seed, count). About a minute on two cores.
const FIXED: &[(&str, u64, u64)] = &[
    ("calm", 0, 40),
    ("smoke", 0, 2000),
    ("partitions", 0, 700),
    ("crashes", 0, 700),
    ("byzantine", 0, 700),
    ("quota", 0, 450),
    ("teardown", 0, 700),
    ("tight", 0, 500),
    ("wide", 0, 60),
    ("fleet-5x1000", 0, 50),
];

/// Random seeds of `smoke` on top, unless `SIM_SEEDS` says otherwise.
const DEFAULT_RANDOM: u64 = 400;

fn get(name: &str) -> Scenario {
    scenario(name).unwrap_or_else(|| panic!("no scenario {name}"))
}

fn check(s: &Scenario, seed: u64, total: &mut Coverage) {
    let o = sim::run_fast(s, seed);
    total.add(&o.coverage);
    if o.failure.is_some() {
        let traced = sim::run_traced(s, seed, REPORT_LINES);
        panic!("{}", failure_report(&o, Some(&traced)));
    }
}

/// Runs every fixed seed once, scenarios spread over two threads (shared by the tests that
/// need their coverage).
fn fixed_coverage() -> &'static Coverage {
    static COVERAGE: OnceLock<Coverage> = OnceLock::new();
    COVERAGE.get_or_init(|| {
        let halves: Vec<Vec<&(&str, u64, u64)>> = vec![
            FIXED.iter().step_by(2).collect(),
            FIXED.iter().skip(1).step_by(2).collect(),
        ];
        std::thread::scope(|scope| {
            let workers: Vec<_> = halves
                .into_iter()
                .map(|half| {
                    scope.spawn(move || {
                        let mut total = Coverage::default();
                        for (name, start, count) in half {
                            let s = get(name);
                            for seed in *start..start + count {
                                check(&s, seed, &mut total);
                            }
                        }
                        total
                    })
                })
                .collect();
            let mut total = Coverage::default();
            for w in workers {
                match w.join() {
                    Ok(c) => total.add(&c),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            total
        })
    })
}

#[test]
fn fixed_seeds_of_every_scenario_hold_every_invariant() {
    let cov = fixed_coverage();
    println!("rare paths over the fixed seeds:\n{cov}");
}

#[test]
fn every_fixed_scenario_is_in_the_library() {
    // The other files of `scenarios/` run over their own seeds in tests/scenarios.rs.
    let names: Vec<String> = scenarios().into_iter().map(|s| s.name).collect();
    for (n, ..) in FIXED {
        assert!(
            names.iter().any(|m| m == n),
            "fixed seeds for {n}, not in scenarios/"
        );
    }
}

#[test]
fn random_fuzz_budget_holds_every_invariant() {
    let n = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(DEFAULT_RANDOM);
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        & 0xffff_ffff;
    println!(
        "random fuzz: seeds {start}..{} of smoke (SIM_SEEDS={n})",
        start + n
    );
    let s = get("smoke");
    let mut total = Coverage::default();
    for seed in start..start + n {
        check(&s, seed, &mut total);
    }
}

#[test]
fn rare_paths_are_all_reached_over_the_default_budget() {
    let cov = fixed_coverage();
    let missing: Vec<&str> = cov.missing().iter().map(|p| p.name()).collect();
    assert!(
        missing.is_empty(),
        "rare paths never reached over the fixed seeds: {missing:?}\n{cov}"
    );
    assert!(cov.get(Path::Quarantine) > 0);
}

#[test]
fn i10_fifty_seeds_replay_to_the_same_trace_hash() {
    let s = get("smoke");
    for seed in 0..50 {
        let a = sim::run_traced(&s, seed, 0);
        let b = sim::run_traced(&s, seed, 0);
        assert!(
            a.trace_lines > 100,
            "seed {seed}: a trace of {} lines",
            a.trace_lines
        );
        assert_eq!(
            a.trace_hash, b.trace_hash,
            "seed {seed}: two runs gave different traces (I10)"
        );
        assert_eq!(a.failure, b.failure);
    }
}

#[test]
fn i10_tracing_does_not_change_the_run() {
    let s = get("crashes");
    for seed in 0..5 {
        let fast = sim::run_fast(&s, seed);
        let traced = sim::run_traced(&s, seed, 0);
        assert_eq!(fast.end, traced.end, "seed {seed}");
        assert_eq!(fast.coverage, traced.coverage, "seed {seed}");
        assert_eq!(fast.stats.events, traced.stats.events, "seed {seed}");
    }
}

#[test]
fn different_seeds_give_different_runs() {
    let s = get("smoke");
    let a = sim::run_traced(&s, 1, 0);
    let b = sim::run_traced(&s, 2, 0);
    assert_ne!(a.trace_hash, b.trace_hash);
}
