//! The event loop's rare-path bookkeeping: situations the coverage report counts that need
//! the driver's memory across steps (cancels while disconnected, late grace, charge changes,
//! teardown deadlines, lost commits) (moved out of `driver/mod.rs` unchanged, issue 17 item 3).

use super::*;

impl Sim {
    // ---- rare-path bookkeeping -------------------------------------------------------------

    /// A user cancels `job`: remembered when its lease's node is disconnected from the mill,
    /// so that the `CancelAttempt` sent after the reconnect is counted (M26).
    pub(super) fn note_cancel_while_down(&mut self, job: JobId) {
        let Some(m) = self.w.mill.as_ref() else {
            return;
        };
        let Some(JobState::Running { lease, node }) = m.job_state(job) else {
            return;
        };
        let connected = m.sessions().any(|(n, c)| *n == node && c);
        if !connected {
            self.cancels_while_down.insert(lease);
        }
    }

    /// The mill is about to apply a batch from `exec`: counts it when the node is
    /// recovering within the last fifth of its grace, or past its grace deadline while the
    /// mill's `Tick` is held (M5, M6, I12). Call before the step; `applied` after.
    pub(super) fn grace_left(&self, exec: usize) -> Option<Micros> {
        let m = self.w.mill.as_ref()?;
        let node = &self.w.execs[exec].node;
        let v = m.session_views().find(|v| v.node == node)?;
        if !v.connected || !v.in_grace {
            return None;
        }
        let deadline = v.grace_deadline?.as_micros();
        let window = dur(self.w.mill_cfg.reconnect_grace) / 5;
        let now = self.w.now;
        (deadline <= now + window).then(|| deadline.saturating_sub(now))
    }

    /// The mill received an accepted bid from `exec` charging `resources`: counts a charge
    /// that differs from the job's previous accepted bid on a resource its owner or repo has
    /// a quota limit on (M14, M15).
    pub(super) fn note_charge(&mut self, lease: LeaseId, resources: &Resources) {
        let Some(info) = self.w.leases.get(&lease) else {
            return;
        };
        let job = info.job;
        let Some(identity) = self
            .w
            .mill_store
            .jobs
            .get(&job)
            .map(|r| r.spec.identity.clone())
        else {
            return;
        };
        if let Some(prev) = self.last_charge.get(&job) {
            let quota = &self.w.mill_cfg.quota;
            let names: BTreeSet<&String> = prev.keys().chain(resources.keys()).collect();
            let changed_limited = names.into_iter().any(|name| {
                prev.get(name) != resources.get(name)
                    && millrace_core::quota::Scope::of(&identity)
                        .iter()
                        .any(|scope| quota.limit(scope, name).is_some())
            });
            if changed_limited {
                self.cov.hit(Path::ChargeChangeOnLimitedResource);
            }
        }
        self.last_charge.insert(job, resources.clone());
    }

    /// The mill's teardown deadline fired: counts each cancelled job whose engine never
    /// stopped and which the mill has now ended (M26).
    pub(super) fn note_teardown_deadline(&mut self) {
        let Some(m) = self.w.mill.as_ref() else {
            return;
        };
        let mut hits = 0;
        for p in &mut self.w.execs {
            for j in p.engine.values_mut() {
                if j.forever
                    && !j.counted
                    && m.job_state(j.job)
                        .is_none_or(|s| matches!(s, JobState::Done(_)))
                {
                    j.counted = true;
                    hits += 1;
                }
            }
        }
        for _ in 0..hits {
            self.cov.hit(Path::CancelEndedByDeadline);
        }
    }

    /// A snapshot of `exec` reaches the mill: counts each commit the executor lost in a
    /// crash before persisting it (same epoch) that the snapshot leaves out while the mill
    /// still holds the lease (M8 releases it, M29).
    pub(super) fn note_lost_commits(&mut self, exec: usize, active: &[LeaseId]) {
        if self.lost_commits.iter().all(|(i, _)| *i != exec) {
            return;
        }
        let Some(m) = self.w.mill.as_ref() else {
            return;
        };
        let held: BTreeSet<LeaseId> = m.leases().map(|(l, ..)| l).collect();
        let mut hits = 0;
        self.lost_commits.retain(|(i, lease)| {
            if *i != exec {
                return true;
            }
            if held.contains(lease) && !active.contains(lease) {
                hits += 1;
            }
            false
        });
        for _ in 0..hits {
            self.cov.hit(Path::LostCommitKeptEpoch);
        }
    }
}
