//! Per-job timestamps of one run, for latency and placement-quality reports: when each job
//! was accepted, when the mill first published a lease for it, and when the mill recorded
//! its terminal result. Simulated time; the mill's store writes are instantaneous in the
//! simulator, so "published" is also "durable".

use std::collections::{BTreeMap, BTreeSet};

use millrace_core::JobId;

use crate::scenario::Micros;

/// What the driver saw of each job.
#[derive(Debug, Clone, Default)]
pub struct JobTimes {
    /// The mill accepted the submit (its insert was durable) at this time.
    pub submitted: BTreeMap<JobId, Micros>,
    /// The mill first published a lease for the job (`Observation::Placed`: the lease and
    /// the job's `Reserved` state were written, and `CommitLease` goes out in the same step).
    pub first_placed: BTreeMap<JobId, Micros>,
    /// Every `Observation::Placed` latency (queued → published; a re-placement after a lost
    /// executor counts from its requeue), in microseconds.
    pub placed_latency: Vec<Micros>,
    /// The mill first wrote the job's terminal state (`JobState::Done`).
    pub terminal: BTreeMap<JobId, Micros>,
    /// Jobs whose first terminal state was not a success (failed, cancelled, timed out).
    pub unsuccessful: BTreeSet<JobId>,
}

impl JobTimes {
    /// The mill accepted `job` at `now`.
    pub fn submitted(&mut self, job: JobId, now: Micros) {
        self.submitted.entry(job).or_insert(now);
    }

    /// The mill published a lease for `job` at `now`, `latency` after it was queued.
    pub fn placed(&mut self, job: JobId, now: Micros, latency: std::time::Duration) {
        self.first_placed.entry(job).or_insert(now);
        self.placed_latency
            .push(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
    }

    /// The mill wrote `job`'s terminal state at `now`; `success` says whether it succeeded.
    pub fn terminal(&mut self, job: JobId, now: Micros, success: bool) {
        if let std::collections::btree_map::Entry::Vacant(e) = self.terminal.entry(job) {
            e.insert(now);
            if !success {
                self.unsuccessful.insert(job);
            }
        }
    }

    /// Submit → first published lease, per job that got one, in microseconds.
    pub fn submit_to_placed(&self) -> Vec<Micros> {
        self.first_placed
            .iter()
            .filter_map(|(job, at)| Some(at.saturating_sub(*self.submitted.get(job)?)))
            .collect()
    }
}

/// The `q`-quantile (0..=1) of `sorted` (ascending), nearest rank; 0 when empty.
pub fn quantile(sorted: &[Micros], q: f64) -> Micros {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The mean of `v`, 0 when empty.
pub fn mean(v: &[Micros]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64
}
