//! Shrinking a failing seed: delta debugging (Zeller's ddmin) over the seed's fault plan,
//! then over its arrivals, re-running the simulator for each candidate and keeping a
//! candidate only when the same invariant (by id, not message) still fails. The result is a
//! scenario file — the original text plus a `[shrunk]` section naming the kept faults and
//! arrivals by index — that the ordinary loader runs and that fails on its own.
//!
//! Deterministic (the candidates are tried in a fixed order, each run is a function of the
//! scenario and seed) and bounded (`max_runs`).

use crate::scenario::{Keep, Scenario, SeedPlan};

/// What a shrink found.
#[derive(Debug, Clone)]
pub struct Shrunk {
    /// The rule that failed before and still fails.
    pub rule: &'static str,
    /// Faults and arrivals before.
    pub before: (usize, usize),
    /// What is kept.
    pub keep: Keep,
    /// Simulator runs spent.
    pub runs: usize,
    /// Whether the run cap stopped it before a minimum was reached.
    pub capped: bool,
}

/// Why a shrink could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShrinkError {
    /// The seed does not fail in this scenario.
    Passes {
        /// The scenario.
        scenario: String,
        /// The seed.
        seed: u64,
    },
}

impl std::fmt::Display for ShrinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShrinkError::Passes { scenario, seed } => {
                write!(
                    f,
                    "seed {seed} of scenario {scenario} does not fail: nothing to shrink"
                )
            }
        }
    }
}

impl std::error::Error for ShrinkError {}

/// The counts of the seed's full fault plan and workload (before any `keep`).
fn full_counts(scenario: &Scenario, seed: u64) -> (usize, usize) {
    let mut open = scenario.clone();
    open.keep = None;
    let plan = SeedPlan::new(&open, seed);
    let sim = crate::driver::Sim::new(&open, seed, crate::trace::Trace::off());
    (plan.faults.faults.len(), sim.w.workload.arrivals.len())
}

/// Shrinks `seed` of `scenario`; `progress` gets one line per accepted reduction.
pub fn shrink(
    scenario: &Scenario,
    seed: u64,
    max_runs: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Shrunk, ShrinkError> {
    let first = crate::run_fast(scenario, seed);
    let Some(failure) = first.failure else {
        return Err(ShrinkError::Passes {
            scenario: scenario.name.clone(),
            seed,
        });
    };
    let rule = failure.rule;
    let before = full_counts(scenario, seed);
    // Start from what the scenario already keeps (shrinking a shrunk file again).
    let mut keep = scenario.keep.clone().unwrap_or_else(|| Keep {
        seed,
        faults: (0..before.0).collect(),
        jobs: (0..before.1).collect(),
    });
    keep.seed = seed;
    let mut runs = 1;
    let mut capped = false;
    progress(&format!(
        "shrink: {} seed {seed} fails {rule}; {} faults, {} jobs",
        scenario.name,
        keep.faults.len(),
        keep.jobs.len()
    ));
    let fails = |k: &Keep, runs: &mut usize| -> Option<bool> {
        if *runs >= max_runs {
            return None;
        }
        *runs += 1;
        let mut s = scenario.clone();
        s.keep = Some(k.clone());
        let o = crate::run_fast(&s, seed);
        Some(o.failure.is_some_and(|v| v.rule == rule))
    };
    for what in ["faults", "jobs"] {
        let items = if what == "faults" {
            keep.faults.clone()
        } else {
            keep.jobs.clone()
        };
        let mut test = |sub: &[usize], runs: &mut usize| -> Option<bool> {
            let mut k = keep.clone();
            if what == "faults" {
                k.faults = sub.to_vec();
            } else {
                k.jobs = sub.to_vec();
            }
            fails(&k, runs)
        };
        let (min, hit_cap) = ddmin(items, &mut test, &mut runs, &mut |n| {
            progress(&format!("shrink: {what} down to {n}"))
        });
        capped |= hit_cap;
        if what == "faults" {
            keep.faults = min;
        } else {
            keep.jobs = min;
        }
        progress(&format!(
            "shrink: {} faults, {} jobs after the {what} pass ({runs} runs)",
            keep.faults.len(),
            keep.jobs.len()
        ));
    }
    Ok(Shrunk {
        rule,
        before,
        keep,
        runs,
        capped,
    })
}

/// ddmin: a 1-minimal subset of `items` for which `test` holds (it holds for `items`).
/// `test` answers `None` once the run budget is spent; then the smallest subset found so far
/// is returned with `true`.
fn ddmin(
    mut items: Vec<usize>,
    test: &mut dyn FnMut(&[usize], &mut usize) -> Option<bool>,
    runs: &mut usize,
    progress: &mut dyn FnMut(usize),
) -> (Vec<usize>, bool) {
    if items.is_empty() {
        return (items, false);
    }
    // The empty set first: many failures need none of one kind.
    match test(&[], runs) {
        None => return (items, true),
        Some(true) => {
            progress(0);
            return (Vec::new(), false);
        }
        Some(false) => {}
    }
    let mut n = 2usize;
    while items.len() >= 2 {
        let chunks = split(&items, n);
        let mut next = None;
        // Each chunk alone, then (with more than two chunks) each complement.
        for c in &chunks {
            match test(c, runs) {
                None => return (items, true),
                Some(true) => {
                    next = Some((c.clone(), 2));
                    break;
                }
                Some(false) => {}
            }
        }
        if next.is_none() && chunks.len() > 2 {
            for k in 0..chunks.len() {
                let rest: Vec<usize> = chunks
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != k)
                    .flat_map(|(_, c)| c.iter().copied())
                    .collect();
                match test(&rest, runs) {
                    None => return (items, true),
                    Some(true) => {
                        next = Some((rest, (n - 1).max(2)));
                        break;
                    }
                    Some(false) => {}
                }
            }
        }
        match next {
            Some((smaller, m)) => {
                items = smaller;
                n = m;
                progress(items.len());
            }
            None if n >= items.len() => break,
            None => n = (2 * n).min(items.len()),
        }
    }
    (items, false)
}

/// `items` in `n` nearly equal consecutive chunks.
fn split(items: &[usize], n: usize) -> Vec<Vec<usize>> {
    let n = n.clamp(1, items.len().max(1));
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for k in 0..n {
        let end = start + (items.len() - start) / (n - k);
        out.push(items[start..end].to_vec());
        start = end;
    }
    out
}

/// The scenario file for `shrunk`: `text` (the scenario's own file) without any earlier
/// `[shrunk]` section, then a comment listing what is kept and the new section.
pub fn write_toml(text: &str, scenario: &Scenario, seed: u64, shrunk: &Shrunk) -> String {
    let base = match text.find("\n[shrunk]") {
        Some(at) => &text[..at],
        None => text,
    };
    let mut out = base.trim_end().to_string();
    let mut open = scenario.clone();
    open.keep = None;
    let plan = SeedPlan::new(&open, seed);
    out.push_str(&format!(
        "\n\n# Shrunk by `millrace-sim shrink --seed {seed}` from {} faults and {} jobs: {} still\n\
         # fails with the faults and arrivals below alone (indices into seed {seed}'s plan and\n\
         # workload). Replay: millrace-sim replay --scenario-file THIS_FILE --seed {seed}\n",
        shrunk.before.0, shrunk.before.1, shrunk.rule
    ));
    for &k in &shrunk.keep.faults {
        if let Some((at, f)) = plan.faults.faults.get(k) {
            out.push_str(&format!(
                "#   fault {k} at {}: {f}\n",
                crate::trace::secs(*at)
            ));
        }
    }
    let list = |v: &[usize]| {
        v.iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    out.push_str(&format!(
        "[shrunk]\nseed = {seed}\nfaults = [{}]\njobs = [{}]\n",
        list(&shrunk.keep.faults),
        list(&shrunk.keep.jobs)
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ddmin_finds_the_two_items_that_matter() {
        let mut test = |s: &[usize], _: &mut usize| Some(s.contains(&3) && s.contains(&11));
        let (min, capped) = ddmin((0..20).collect(), &mut test, &mut 0, &mut |_| {});
        assert_eq!(min, vec![3, 11]);
        assert!(!capped);
    }

    #[test]
    fn ddmin_stops_at_the_cap() {
        let mut test = |s: &[usize], runs: &mut usize| {
            if *runs >= 3 {
                return None;
            }
            *runs += 1;
            Some(s.contains(&7))
        };
        let (min, capped) = ddmin((0..20).collect(), &mut test, &mut 0, &mut |_| {});
        assert!(capped);
        assert!(min.contains(&7));
    }

    #[test]
    fn split_covers_every_item_once() {
        let parts = split(&[1, 2, 3, 4, 5, 6, 7], 3);
        assert_eq!(parts.concat(), vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(parts.len(), 3);
    }
}
