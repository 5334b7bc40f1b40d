//! Restart from the durable store (M29, M30).
//!
//! Restored running leases wait for their nodes with a grace that starts now, and are claimed
//! or failed by reconcile (M8) or grace expiry (M5). Reserved-not-committed leases are dropped
//! and their jobs queued again. Queued jobs are placed again. Job timeouts count again from
//! now, since `Time` does not survive a restart.

use super::{Job, Lease, LeaseState, Mill, MillSnapshot, MillWrite, Observation, Phase, RarePath};
use crate::job::JobState;
use crate::types::{JobId, LeaseId};

impl Mill {
    pub(super) fn restore(&mut self, snap: MillSnapshot) {
        self.next_job = snap.next_job.max(JobId(1));
        // Every id below the floor may have been sent before the crash (M30).
        self.next_lease = snap.lease_floor.max(LeaseId(1));
        self.lease_floor = self.next_lease;
        self.cursors = snap.cursors;
        self.quarantined = snap.quarantined;

        let mut running = 0usize;
        let mut restored_holds = Vec::new();
        for (id, record) in snap.leases {
            let job_running = snap
                .jobs
                .get(&record.job)
                .is_some_and(|j| matches!(j.state, JobState::Running { lease, .. } if lease == id));
            let keep = record.state == LeaseState::Running && job_running;
            if !keep {
                self.persist(MillWrite::LeaseDelete { lease: id });
                continue;
            }
            running += 1;
            if let Some((identity, charge)) = snap.quota_holds.get(&record.job) {
                restored_holds.push((record.job, identity.clone(), charge.clone()));
            }
            self.placeholder_session(&record.node, record.epoch);
            if let (Some(s), Some(j)) = (
                self.sessions.get_mut(&record.node),
                snap.jobs.get(&record.job),
            ) {
                *s.held.entry(j.spec.engine.clone()).or_insert(0) += 1;
            }
            self.add_lease(
                id,
                Lease {
                    job: record.job,
                    node: record.node,
                    epoch: record.epoch,
                    resources: record.resources,
                    state: LeaseState::Running,
                    commit_sent: None,
                    commit_out: true,
                    cancel: None,
                },
            );
        }
        // Holds of jobs whose lease did not survive are released.
        for job in snap.quota_holds.keys() {
            if !restored_holds.iter().any(|(j, _, _)| j == job) {
                self.persist(MillWrite::QuotaRelease { job: *job });
            }
        }
        self.quota = crate::quota::QuotaLedger::restore(self.config.quota.clone(), restored_holds);

        for (id, record) in snap.jobs {
            let deadline = self
                .now
                .plus(record.spec.timeout.unwrap_or(self.config.job_timeout));
            self.arm(deadline, super::Timer::JobTimeout(id));
            let lease = match record.state {
                JobState::Running { lease, .. } if self.leases.contains_key(&lease) => Some(lease),
                _ => None,
            };
            let requeued = lease.is_none() && record.state != JobState::Queued;
            self.jobs.insert(
                id,
                Box::new(Job {
                    spec: record.spec,
                    queued_at: self.now,
                    deadline,
                    phase: match lease {
                        Some(l) => Phase::Leased(l),
                        None => Phase::Queued,
                    },
                    quota_held: None,
                    persisted_beyond_queued: lease.is_some(),
                    waits_for_change: None,
                    incompatible: std::collections::BTreeMap::new(),
                }),
            );
            if lease.is_none() {
                self.queue.insert(id);
            }
            if requeued {
                self.persist(MillWrite::JobState {
                    job: id,
                    state: JobState::Queued,
                });
            }
        }
        // A lease whose job is gone cannot be finished by anyone: drop it.
        let orphans: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| !self.jobs.contains_key(&l.job))
            .map(|(id, _)| *id)
            .collect();
        for id in orphans {
            if let Some(l) = self.leases.remove(&id) {
                if let Some(set) = self.node_leases.get_mut(&l.node) {
                    set.remove(&id);
                }
            }
            self.persist(MillWrite::LeaseDelete { lease: id });
        }
        if running > 0 {
            self.observe(Observation::Rare(RarePath::RestartWithRunningLeases));
        }
        self.wake_placement();
    }
}
