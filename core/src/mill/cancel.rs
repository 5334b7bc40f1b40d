//! Cancels (M26, M27) and job timeouts (M18).

use super::{
    reason, CancelPhase, LeaseCancel, LeaseState, Mill, MillWrite, Observation, Phase, RarePath,
};
use crate::job::{Terminal, TerminalCause, TerminalStatus};
use crate::types::{JobId, LeaseId, Time};

use super::RequestError;

impl Mill {
    /// A client cancels a job (M26).
    pub(super) fn cancel_job(&mut self, job: JobId, why: String) -> Result<(), RequestError> {
        if !self.jobs.contains_key(&job) {
            return Err(RequestError::JobNotActive { job });
        }
        let why = reason(if why.is_empty() {
            "cancelled by user".to_string()
        } else {
            why
        });
        self.stop_job(
            job,
            why,
            TerminalStatus::Cancelled,
            TerminalCause::Cancelled,
        );
        Ok(())
    }

    /// M18: the job's timeout passed; it is stopped and ends Timeout.
    pub(super) fn job_timed_out(&mut self, job: JobId, fired: Time) {
        if self.jobs.get(&job).is_some_and(|j| j.deadline == fired) {
            let why = "job timeout exceeded".to_string();
            self.stop_job(job, why, TerminalStatus::Timeout, TerminalCause::Timeout);
        }
    }

    /// Ends a job with `status`: at once if nothing runs it, else through a cancel of its
    /// lease (M26).
    fn stop_job(&mut self, job: JobId, why: String, status: TerminalStatus, cause: TerminalCause) {
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        let lease = match &j.phase {
            Phase::Queued | Phase::Bidding(_) | Phase::QuotaWait { .. } | Phase::Fenced { .. } => {
                return self.finish_job(job, Terminal::by_mill(status, cause, why));
            }
            Phase::Leased(lease) => *lease,
        };
        let Some(l) = self.leases.get_mut(&lease) else {
            return;
        };
        if l.cancel.is_some() {
            return; // already being cancelled
        }
        match l.state {
            LeaseState::Reserved => {
                // Releasing the seat ends the job. If a commit ever went out (even on an
                // earlier connection), the executor may have started the job, and a release
                // never stops a running job (E8): send a cancel instead, which stops either.
                let node = l.node.clone();
                let committing = l.commit_out;
                let mut t = Terminal::by_mill(status, cause, why.clone());
                t.node = Some(node.clone());
                t.lease = Some(lease);
                self.end_lease(lease, Some(t));
                let conn = self.sessions.get(&node).and_then(|s| s.conn);
                match (committing, conn) {
                    (true, Some(_)) => self.send_cancel(&node, lease, why),
                    (false, Some(conn)) => self.send_release(conn, lease),
                    (_, None) => {} // the next reconcile cancels what the node still holds
                }
            }
            LeaseState::Running => {
                let c = LeaseCancel {
                    reason: why.clone(),
                    status,
                    cause,
                    phase: CancelPhase::Waiting,
                };
                // Durable before the `CancelAttempt` goes out and before the client hears
                // Ok: a restarted mill still knows the job is being cancelled (M26, M29).
                let write = MillWrite::LeaseCancel {
                    lease,
                    cancel: c.record(),
                };
                l.cancel = Some(c);
                let (node, epoch) = (l.node.clone(), l.epoch);
                self.persist(write);
                let connected = self
                    .sessions
                    .get(&node)
                    .is_some_and(|s| s.conn.is_some() && s.reconciled && s.epoch == epoch);
                if connected {
                    if let Some(c) = self.leases.get_mut(&lease).and_then(|l| l.cancel.as_mut()) {
                        c.phase = CancelPhase::Sent;
                    }
                    self.send_cancel(&node, lease, why);
                }
            }
        }
    }

    /// M26: the node acked the cancel but no terminal came within the teardown timeout.
    pub(super) fn teardown_expired(&mut self, lease: LeaseId, fired: Time) {
        let Some(l) = self.leases.get(&lease) else {
            return;
        };
        let Some(c) = &l.cancel else {
            return;
        };
        if c.phase != (CancelPhase::Acked { teardown: fired }) {
            return;
        }
        let why = format!(
            "{} (node teardown exceeded {:?})",
            c.reason, self.config.cancel_teardown_timeout
        );
        let mut t = Terminal::by_mill(c.status, TerminalCause::TeardownExceeded, reason(why));
        t.node = Some(l.node.clone());
        t.lease = Some(lease);
        self.observe(Observation::Rare(RarePath::TeardownDeadline));
        self.end_lease(lease, Some(t));
    }
}
