//! Adoption after a restart (E9, E14): jobs run under supervisors that outlive the executor
//! process, so a restart with the store intact re-attaches to them instead of failing them.
//!
//! The store's committed jobs are held as running again at start (their seats stay taken)
//! and the driver is asked to re-attach to each (`AdoptJob`). It answers `JobStarted` (the
//! job still runs), `JobExited` (it ended while the executor was down, with the status its
//! supervisor recorded durably) or `JobLost` (nothing of it is left). Only a lost job ends
//! Failed "executor restarted". An adopted job is never started a second time (I1).

use crate::job::TerminalStatus;
use crate::types::LeaseId;
use crate::wire::{EndCause, EventKind};

use super::seats::RunningJob;
use super::{Executor, ExecutorOutput, StoredJob, RESTARTED};

impl Executor {
    /// E9/E14: hold every job the store still holds as running and ask the driver to
    /// re-attach to it.
    pub(super) fn adopt_jobs_of_previous_process(&mut self) {
        let jobs: Vec<(LeaseId, StoredJob)> = self
            .durable
            .jobs
            .iter()
            .map(|(lease, job)| (*lease, job.clone()))
            .collect();
        for (lease, stored) in jobs {
            // Its Running may still be in the outbox; if it was acked (or never appended),
            // the adoption's `JobStarted` appends one, which the mill takes as a no-op
            // repeat for a lease it already has running.
            let started = self
                .durable
                .outbox
                .iter()
                .any(|e| e.lease == lease && e.kind == EventKind::Running);
            let running = RunningJob {
                engine: stored.engine,
                charged: stored.resources,
                started,
                // A stop asked for before the restart is durable (E7, E12) and still decides
                // the job's end; the adopted run is asked to stop again once re-attached.
                stop: stored.stop.clone(),
                log_end: 0,
            };
            if running.stop.is_some() {
                self.restop.insert(lease);
            }
            self.seats.running.insert(lease, running);
            self.emit(ExecutorOutput::AdoptJob {
                lease,
                job: stored.job,
            });
        }
    }

    /// E9: the job's supervisor is gone and left no recorded status: the job died with
    /// the previous process (or its supervisor was killed). A stop asked for since still
    /// decides the terminal (a cancelled job that is gone is Cancelled).
    pub(super) fn on_job_lost(&mut self, lease: LeaseId) {
        self.end_running(
            lease,
            TerminalStatus::Failed,
            None,
            Some(RESTARTED.to_string()),
            None,
            EndCause::Restarted,
        );
    }
}
