//! Restart from the durable store (M29, M30).
//!
//! Restored leases wait for their nodes with a grace that starts now, and are claimed or
//! ended by reconcile (M8) or grace expiry (M5). That holds for published (Reserved) leases
//! too (M29 as revised): a durable Reserved lease was published (M16), so its `CommitLease`
//! may have reached the executor and the job may be running. It is kept as unclaimed: if
//! the node's snapshot reports it, the commit is sent again (E4 makes a repeat harmless);
//! if not, it is released and its job queued again; at grace expiry it fails like a running
//! lease. Dropping it would queue a job that may already run (I1). Queued jobs are placed
//! again. Job timeouts count again from now, since `Time` does not survive a restart.

use super::{
    Job, Lease, LeaseCancel, LeaseState, Mill, MillSnapshot, MillWrite, Observation, Phase,
    RarePath,
};
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
        // Keys of active and finished jobs alike (M31): a retry after the restart still
        // finds its job.
        for (key, record) in snap.keys {
            self.keys.insert(key, record);
        }

        let mut running = 0usize;
        let mut published = 0usize;
        let mut restored_holds = Vec::new();
        for (id, record) in snap.leases {
            // The job's state names the lease it was last leased under: the lease of record.
            let job_holds = snap.jobs.get(&record.job).is_some_and(|j| match j.state {
                JobState::Running { lease, .. } | JobState::Reserved { lease, .. } => lease == id,
                _ => false,
            });
            if !job_holds {
                self.persist(MillWrite::LeaseDelete { lease: id });
                continue;
            }
            match record.state {
                LeaseState::Running => running += 1,
                LeaseState::Reserved => published += 1,
            }
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
                    state: record.state,
                    commit_sent: None,
                    // Published before the crash: a commit may be out (M29).
                    commit_out: true,
                    // An accepted cancel survives (M26, M29): it goes out again once the
                    // node is reconciled, its ack re-arms the teardown deadline, and grace
                    // expiry or reconcile end the lease with its status (M5, M8).
                    cancel: record.cancel.map(LeaseCancel::restored),
                    attempt: record.attempt,
                    direct_answer_due: false,
                    staged: false,
                    withdrawn: false,
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
                JobState::Running { lease, .. } | JobState::Reserved { lease, .. }
                    if self.leases.contains_key(&lease) =>
                {
                    Some(lease)
                }
                _ => None,
            };
            let requeued = lease.is_none() && record.state != JobState::Queued;
            let tally = snap.attempts.get(&id).cloned().unwrap_or_default();
            // M32: a retry waiting out its fence before the crash waits it out whole again,
            // with the full E12 bound: how much of it passed is unknown (`Time` does not
            // survive a restart), and waiting longer is safe.
            let fence = (lease.is_none() && tally.fence_pending).then(|| {
                self.now.plus(
                    self.config
                        .reconnect_grace
                        .saturating_add(self.config.retry_fence),
                )
            });
            // A job no lease ever took waits its queue timeout again from the restart, as
            // its job timeout does.
            let queue_deadline = if record.state == JobState::Queued {
                self.arm_queue_timeout(id, deadline)
            } else {
                None
            };
            self.jobs.insert(
                id,
                Box::new(Job {
                    spec: record.spec,
                    queued_at: self.now,
                    deadline,
                    queue_deadline,
                    phase: match (lease, fence) {
                        (Some(l), _) => Phase::Leased(l),
                        (None, Some(until)) => Phase::Fenced { until },
                        (None, None) => Phase::Queued,
                    },
                    quota_held: None,
                    persisted_beyond_queued: lease.is_some(),
                    waits_for_change: None,
                    incompatible: std::collections::BTreeMap::new(),
                    refused: std::collections::BTreeMap::new(),
                    attempt: tally.last,
                    retried: tally.retried,
                    direct_tried: false,
                    yielded: false,
                    withdrawn: 0,
                    fenced_run: fence.and(tally.fenced_run.as_ref().map(|(l, _)| *l)),
                }),
            );
            self.owner_job_added(id);
            match (lease, fence) {
                (Some(_), _) => {}
                (None, Some(until)) => {
                    self.arm(until, super::Timer::RetryFence(id));
                    // The old run's reports hold the fence after the restart too (M32).
                    if let Some((lease, node)) = tally.fenced_run {
                        self.fenced_runs.insert(lease, (node, id));
                    }
                }
                (None, None) => self.queue_insert(id),
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
        if published > 0 {
            self.observe(Observation::Rare(RarePath::RestartWithPublishedLeases));
        }
        self.wake_placement();
    }
}
