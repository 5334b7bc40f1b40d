//! Shrinking a real failure (issue 17 item 1): a deliberate breakage of the simulator's
//! engine model (`SimBug::DoubleStartAfterCrash`: an engine starts a job a second time once
//! its executor has crashed and restarted) makes the I1 checker fail; the failing seed
//! shrinks to a handful of faults and jobs, and the written scenario file, loaded by the
//! ordinary loader, fails with the same invariant on its own.
#![allow(clippy::expect_used)] // a test: a missing library file or a passing seed is a failure

use sim::scenario::{Scenario, SimBug};
use sim::scenario_file;

fn crashes() -> (Scenario, String) {
    let (_, text) = scenario_file::embedded_texts()
        .find(|(n, _)| *n == "crashes")
        .expect("the crashes scenario is in the library");
    let mut s = scenario_file::load_str("scenarios/crashes.toml", text).expect("it loads");
    s.bug = Some(SimBug::DoubleStartAfterCrash);
    (s, text.to_string())
}

#[test]
fn i1_a_double_start_shrinks_to_a_handful_of_faults_and_jobs() {
    let (s, text) = crashes();
    let seed = (0..40)
        .find(|&seed| {
            sim::run_fast(&s, seed)
                .failure
                .is_some_and(|v| v.rule == "I1")
        })
        .expect("the breakage fails I1 on one of the first 40 seeds");
    let mut lines = 0;
    let shrunk = sim::shrink::shrink(&s, seed, 3000, &mut |_| lines += 1).expect("it fails");
    assert_eq!(shrunk.rule, "I1");
    assert!(lines >= 3, "progress was reported ({lines} lines)");
    let (faults, jobs) = (shrunk.keep.faults.len(), shrunk.keep.jobs.len());
    assert!(
        faults <= 5 && jobs <= 5,
        "seed {seed}: {} faults, {} jobs shrank only to {faults} faults, {jobs} jobs ({} runs)",
        shrunk.before.0,
        shrunk.before.1,
        shrunk.runs
    );
    eprintln!(
        "crashes seed {seed} (I1): {} faults, {} jobs -> {faults} faults, {jobs} jobs in {} runs",
        shrunk.before.0, shrunk.before.1, shrunk.runs
    );
    assert!(faults < shrunk.before.0 || jobs < shrunk.before.1);
    // The file stands on its own: loaded as any scenario file, the breakage compiled in.
    let written = sim::shrink::write_toml(&text, &s, seed, &shrunk);
    let mut again = scenario_file::load_str("shrunk.toml", &written).expect("the file loads");
    assert_eq!(again.keep.as_ref().map(|k| k.seed), Some(seed));
    again.bug = Some(SimBug::DoubleStartAfterCrash);
    let o = sim::run_fast(&again, seed);
    assert_eq!(o.failure.map(|v| v.rule), Some("I1"), "{written}");
    assert_eq!(o.plan.faults.faults.len(), faults);
    // Without the breakage the same schedule passes: the failure is the breakage's.
    again.bug = None;
    assert!(sim::run_fast(&again, seed).failure.is_none());
}
