//! M33's bench: one owner floods the queue, another submits a few jobs behind it. Under FIFO
//! the second owner waits for the whole backlog; with M33 (fewest leases first) its jobs go
//! to the next seats that free up, so their wait is about one job duration whatever the
//! backlog. Runs the real mill and executors in the simulator, with no faults, one-seat
//! executors and fixed job durations.

use millrace_core::quota::QuotaConfig;

use crate::driver::Sim;
use crate::quality::{fleet, job, Durations};
use crate::scenario::{Micros, SEC};
use crate::scenario_file::scenario;
use crate::trace::Trace;
use crate::workload::{Arrival, Workload};

/// One fairness run.
#[derive(Debug, Clone)]
pub struct Setup {
    /// One-seat executors.
    pub executors: usize,
    /// Owner A's jobs, all submitted at time 0.
    pub flood: usize,
    /// Owner B's jobs, submitted at `late`.
    pub few: usize,
    /// When owner B submits.
    pub late: Micros,
    /// Every job's duration.
    pub duration: Micros,
    /// The seed (network latencies).
    pub seed: u64,
}

/// What a run measured (simulated time).
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Owner B's waits from submit to first placement, largest.
    pub few_wait_max: Micros,
    /// Owner B's waits, mean.
    pub few_wait_mean: Micros,
    /// Owner B's jobs that never started.
    pub few_missing: usize,
    /// When owner A's last job started: how long B would have waited under FIFO, from `late`.
    pub flood_last_start: Micros,
    /// A checker failure, if any.
    pub failure: Option<String>,
}

/// Runs one setup in the `calm` scenario, resized.
pub fn run(setup: &Setup) -> Report {
    let Some(mut sc) = scenario("calm") else {
        return Report {
            failure: Some("the calm scenario is gone".into()),
            ..Report::default()
        };
    };
    let total = setup.flood + setup.few;
    sc.name = "fairness".into();
    sc.executors = setup.executors;
    sc.jobs = total;
    sc.fault_window = 0;
    sc.job_mean = setup.duration;
    sc.job_max = setup.duration * 2;
    sc.seats = (1, 1);
    sc.codec_fraction = 0.0;
    let mut arrivals = Vec::with_capacity(total);
    for k in 0..total {
        let mut spec = job(k);
        let (owner, at) = if k < setup.flood {
            ("flood", 0)
        } else {
            ("few", setup.late)
        };
        spec.identity.owner = owner.into();
        spec.identity.repo = format!("{owner}/app");
        arrivals.push((
            at,
            Arrival::Job {
                spec,
                cancel_after: None,
            },
        ));
    }
    let workload = Workload {
        fleet: fleet(setup.executors),
        arrivals,
        quota: QuotaConfig::default(),
        max_pending: 1_000_000,
    };
    let mut sim = Sim::with_workload(&sc, setup.seed, Trace::off(), Some(workload));
    sim.durations = Some(Durations {
        per_job: vec![setup.duration; total],
    });
    sim.run();
    let mut waits = Vec::new();
    let mut missing = 0;
    let mut flood_last_start = 0;
    for k in 0..total {
        let placed = sim.w.job_of_arrival[k].and_then(|j| sim.times.first_placed.get(&j).copied());
        if k < setup.flood {
            flood_last_start = flood_last_start.max(placed.unwrap_or(0));
        } else {
            match placed {
                Some(p) => waits.push(p.saturating_sub(setup.late)),
                None => missing += 1,
            }
        }
    }
    let n = waits.len().max(1) as u64;
    Report {
        few_wait_max: waits.iter().copied().max().unwrap_or(0),
        few_wait_mean: waits.iter().sum::<u64>() / n,
        few_missing: missing,
        flood_last_start,
        failure: sim.failure.as_ref().map(|v| v.to_string()),
    }
}

/// The bench of issue 13: 10 executors, owner A submits 1,000 jobs of 10 s at once, owner B
/// 10 jobs 30 s later.
pub fn issue_setup(seed: u64) -> Setup {
    Setup {
        executors: 10,
        flood: 1_000,
        few: 10,
        late: 30 * SEC,
        duration: 10 * SEC,
        seed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// M33: owner B's 10 jobs behind owner A's 1,000 start within two job durations of their
    /// submission (one seat frees about every second on 10 executors), not after A's
    /// backlog (~1,000 s under FIFO), and every checker stays quiet.
    #[test]
    fn m33_a_flood_does_not_starve_a_later_owner() {
        let setup = issue_setup(1);
        let r = run(&setup);
        eprintln!(
            "fairness: B's wait max {:.1} s, mean {:.1} s; A's last job started at {:.1} s",
            r.few_wait_max as f64 / SEC as f64,
            r.few_wait_mean as f64 / SEC as f64,
            r.flood_last_start as f64 / SEC as f64
        );
        assert_eq!(r.failure, None);
        assert_eq!(r.few_missing, 0);
        assert!(
            r.few_wait_max <= 2 * setup.duration,
            "B waited up to {} s; A's last job started at {} s",
            r.few_wait_max / SEC,
            r.flood_last_start / SEC
        );
        assert!(
            r.flood_last_start > 50 * setup.duration,
            "the backlog is real: {} s",
            r.flood_last_start / SEC
        );
    }
}
