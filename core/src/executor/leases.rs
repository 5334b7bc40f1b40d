//! What happens to a lease: the mill's ReserveSeat / CommitLease / ReleaseLease /
//! CancelAttempt (E2, E4, E7, E8), the engine's reports, and self-fencing (E12).
//!
//! Commands are idempotent by lease id (as in reference 004): a repeat with the same content
//! gets the same answer and no second effect; a repeat that conflicts is turned down.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::job::{JobSpec, LogRef, TerminalStatus};
use crate::types::{ConnId, JobId, LeaseId, Resources, Time};
use crate::wire::{EndCause, EventKind, RejectKind, ToMill};

use super::outbox::bounded_error;
use super::seats::{admit, seat_free, Admitted, Refusal, Reservation, RunningJob, StopReason};
use super::{Executor, ExecutorOutput, ExecutorWrite, StoredJob};

fn accepted(lease: LeaseId, resources: Resources) -> ToMill {
    ToMill::accepted(lease, resources)
}

fn rejected(lease: LeaseId, kind: RejectKind, reason: String) -> ToMill {
    ToMill::rejected(lease, kind, bounded_error(reason))
}

impl Executor {
    /// E2/E3: hold a seat if one is free and the job can run here. A `direct` ask (M35) is
    /// committed without waiting for this answer; this executor always charges the standard
    /// charge a direct ask requires.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_reserve(
        &mut self,
        now: Time,
        conn: ConnId,
        lease: LeaseId,
        job: JobId,
        spec: JobSpec,
        ttl: Duration,
        direct: bool,
    ) {
        let held = self
            .seats
            .reserved
            .get(&lease)
            .or_else(|| self.seats.waiting.get(&lease).map(|w| &w.reservation));
        if let Some(held) = held {
            let answer = if held.job == job && held.spec == spec {
                accepted(lease, held.charged.clone())
            } else {
                let reason = format!("lease {lease} is already reserved for job {}", held.job);
                rejected(lease, RejectKind::Incompatible, reason)
            };
            return self.send(conn, answer);
        }
        if self.seats.running.contains_key(&lease) || self.outbox_has(lease) {
            let reason = format!("lease {lease} is already committed here");
            return self.send(conn, rejected(lease, RejectKind::Incompatible, reason));
        }
        let closed = self.closed_reason();
        let answer = match admit(&self.config, &self.seats, &spec, closed.as_deref(), direct) {
            Ok((charged, admitted)) => {
                debug_assert!(
                    !direct || charged == spec.seat_charge(),
                    "E2, M35: a direct ask is accepted only with the standard charge"
                );
                // A zero ttl is meaningless; a seat is never held past our own grace (E3).
                let grace = self.timers().reconnect_grace;
                let ttl = if ttl.is_zero() { grace } else { ttl.min(grace) };
                let reservation = Reservation {
                    job,
                    spec,
                    charged: charged.clone(),
                    expires: now.plus(ttl),
                };
                match admitted {
                    Admitted::Seat => self.hold_reservation(lease, reservation),
                    Admitted::Wait => self.hold_waiting(lease, reservation),
                }
                accepted(lease, charged)
            }
            Err(Refusal::Transient(reason)) => rejected(lease, RejectKind::Transient, reason),
            Err(Refusal::Incompatible(reason)) => rejected(lease, RejectKind::Incompatible, reason),
        };
        self.send(conn, answer);
    }

    /// E4: a reservation starts its job, persisted first; a repeat for a job that runs or ran
    /// (events not yet acked) is committed again with no second start; anything else is not
    /// committed.
    pub(super) fn on_commit(
        &mut self,
        conn: ConnId,
        lease: LeaseId,
        secrets: BTreeMap<String, String>,
    ) {
        if let Some(w) = self.seats.waiting.get_mut(&lease) {
            // E16: it starts on the next free seat, and the commit is answered then, once
            // durable (E4); a repeat changes nothing. It no longer expires (E3): only a
            // release, a cancel, a drain, self-fencing or a restart drops it.
            if w.secrets.is_none() {
                w.secrets = Some(secrets);
                self.timers.stop(&super::Timer::Expire(lease));
            }
            return;
        }
        let committed = if let Some(reservation) = self.take_reservation(lease) {
            self.start_committed(lease, reservation, secrets);
            true
        } else {
            self.seats.running.contains_key(&lease) || self.outbox_has(lease)
        };
        self.send(conn, ToMill::CommitResult { lease, committed });
    }

    /// E4: a committed reservation's job starts: the commit is durable before the engine
    /// is asked to start it.
    fn start_committed(
        &mut self,
        lease: LeaseId,
        reservation: Reservation,
        secrets: BTreeMap<String, String>,
    ) {
        let Reservation {
            job, spec, charged, ..
        } = reservation;
        let stored = StoredJob {
            job,
            engine: spec.engine.clone(),
            resources: charged.clone(),
            stop: None,
        };
        self.persist(vec![ExecutorWrite::JobCommitted { lease, job: stored }]);
        let running = RunningJob {
            engine: spec.engine.clone(),
            charged,
            started: false,
            stop: None,
            log_end: 0,
        };
        self.seats.running.insert(lease, running);
        self.emit(ExecutorOutput::StartJob {
            lease,
            job,
            spec,
            secrets,
        });
    }

    /// E16: committed leases waiting for a seat take the seats free now, in lease order;
    /// each one's commit is durable before it starts and is answered after (E4). Runs after
    /// every input, so a freed seat goes to a waiting lease before anything else can ask
    /// for it.
    pub(super) fn fill_seats(&mut self) {
        if self.seats.waiting.is_empty() || self.draining {
            return;
        }
        let ready: Vec<LeaseId> = self
            .seats
            .waiting
            .iter()
            .filter(|(_, w)| w.secrets.is_some())
            .map(|(l, _)| *l)
            .collect();
        for lease in ready {
            let fits = self.seats.waiting.get(&lease).is_some_and(|w| {
                seat_free(
                    &self.config,
                    &self.seats,
                    &w.reservation.spec,
                    &w.reservation.charged,
                )
            });
            if !fits {
                continue;
            }
            let Some(w) = self.seats.waiting.remove(&lease) else {
                continue;
            };
            self.start_committed(lease, w.reservation, w.secrets.unwrap_or_default());
            if let Some(conn) = self.ready_conn() {
                self.send(
                    conn,
                    ToMill::CommitResult {
                        lease,
                        committed: true,
                    },
                );
            }
        }
    }

    /// E16: drops a lease waiting for a seat; a commit it held is answered not committed on
    /// `conn` (nothing started, so the mill may place the job again, M36).
    pub(super) fn drop_waiting(&mut self, conn: Option<ConnId>, lease: LeaseId) {
        let Some(w) = self.seats.waiting.remove(&lease) else {
            return;
        };
        self.timers.stop(&super::Timer::Expire(lease));
        if let (Some(_), Some(conn)) = (w.secrets, conn) {
            self.send(
                conn,
                ToMill::CommitResult {
                    lease,
                    committed: false,
                },
            );
        }
    }

    /// Every lease waiting for a seat is dropped (a drain or self-fencing, E16).
    pub(super) fn drop_all_waiting(&mut self) {
        let conn = self.ready_conn();
        let waiting: Vec<LeaseId> = self.seats.waiting.keys().copied().collect();
        for lease in waiting {
            self.drop_waiting(conn, lease);
        }
    }

    /// E8: drop a reservation; a running job is left alone (only a cancel stops it). A lease
    /// waiting for a seat is dropped and its commit answered not committed (E16, M36).
    pub(super) fn on_release(&mut self, conn: ConnId, lease: LeaseId) {
        self.take_reservation(lease);
        self.drop_waiting(Some(conn), lease);
    }

    /// E7: ack at once; drop a reservation; stop a running job, whose terminal will be
    /// Cancelled when the engine reports it stopped. The stop is durable before the ack goes
    /// out, so an executor restarted after the ack still ends the job Cancelled (E9).
    pub(super) fn on_cancel(&mut self, conn: ConnId, lease: LeaseId, reason: String) {
        self.take_reservation(lease);
        // E16: a waiting lease never started; the ack below is all the mill needs.
        if self.seats.waiting.remove(&lease).is_some() {
            self.timers.stop(&super::Timer::Expire(lease));
        }
        let stop = match self.seats.running.get_mut(&lease) {
            Some(job) => match job.stop {
                None => {
                    let stop = StopReason::Cancel(bounded_error(reason));
                    job.stop = Some(stop.clone());
                    Some((stop, true))
                }
                // E7/I11: a cancel that reaches a job already being fenced (E12: its stop
                // was asked for while cut off, and the engine has not exited yet) decides
                // its status: the user asked for this stop, and the run is ending anyway.
                // The engine is already stopping, so no second StopJob.
                Some(StopReason::Fence) => {
                    let stop = StopReason::Cancel(bounded_error(reason));
                    job.stop = Some(stop.clone());
                    Some((stop, false))
                }
                Some(StopReason::Cancel(_)) => None,
            },
            None => None,
        };
        if let Some((stop, ask_engine)) = stop {
            self.persist(vec![ExecutorWrite::JobStopping { lease, stop }]);
            if ask_engine {
                let grace = self.config.stop_grace;
                self.emit(ExecutorOutput::StopJob { lease, grace });
            }
        }
        self.send(conn, ToMill::CancelAck { lease });
    }

    /// E5: the engine started the job: Running goes to the outbox, then to the mill.
    pub(super) fn on_job_started(&mut self, lease: LeaseId) {
        if self.restop.remove(&lease) && self.seats.running.contains_key(&lease) {
            let grace = self.config.stop_grace;
            self.emit(ExecutorOutput::StopJob { lease, grace });
        }
        match self.seats.running.get_mut(&lease) {
            Some(job) if !job.started => job.started = true,
            Some(_) | None => return,
        }
        let write = self.next_event(0, lease, EventKind::Running);
        self.persist(vec![write]);
        self.flush_outbox();
    }

    /// E5/E7/E12: the job ended. A stop we asked for decides the status; the engine's exit
    /// code and log are kept. The terminal and the job's removal are one batch.
    pub(super) fn on_job_exited(
        &mut self,
        lease: LeaseId,
        status: TerminalStatus,
        exit_code: Option<i32>,
        error: Option<String>,
        log: Option<LogRef>,
    ) {
        self.end_running(lease, status, exit_code, error, log, EndCause::Engine);
    }

    /// Ends a running job with the engine's (or the driver's) verdict and `cause`, unless a
    /// stop was asked for, which decides the status (E7, E12).
    pub(super) fn end_running(
        &mut self,
        lease: LeaseId,
        status: TerminalStatus,
        exit_code: Option<i32>,
        error: Option<String>,
        log: Option<LogRef>,
        cause: EndCause,
    ) {
        self.restop.remove(&lease);
        let Some(job) = self.seats.running.remove(&lease) else {
            return;
        };
        self.send_log_end(lease, job.log_end);
        let (status, error, cause) = match job.stop {
            Some(stop) => stop.terminal(),
            None => (status, error.map(bounded_error), cause),
        };
        // A log reference the mill would call a violation (M25) is left out.
        let log = log.filter(|l| l.is_valid_for(lease));
        let kind = EventKind::Terminal {
            status,
            exit_code,
            error,
            log,
            cause,
        };
        let append = self.next_event(0, lease, kind);
        self.persist(vec![append, ExecutorWrite::JobEnded { lease }]);
        self.flush_outbox();
    }

    /// E15: best-effort live log, forwarded in chunks while a session is up, within a byte
    /// budget per snapshot interval. Every chunk says where it starts in the job's output, so
    /// bytes dropped here (over budget, no session) are a hole the mill counts, never a
    /// splice; nothing is written into the output to say so.
    pub(super) fn on_job_log(&mut self, now: Time, lease: LeaseId, offset: u64, bytes: Vec<u8>) {
        if bytes.is_empty() {
            return;
        }
        let conn = self.ready_conn();
        let budget = self.config.live_log_budget;
        if now >= self.live_log.start.plus(self.timers().snapshot_interval) {
            self.live_log.start = now;
            self.live_log.used = 0;
        }
        let Some(job) = self.seats.running.get_mut(&lease) else {
            return;
        };
        let len = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
        job.log_end = job.log_end.max(offset.saturating_add(len));
        let Some(conn) = conn else {
            return;
        };
        let room = budget.saturating_sub(self.live_log.used);
        let take = bytes.len().min(room);
        if take == 0 {
            return;
        }
        self.live_log.used += take;
        let step = self.config.live_log_chunk.max(1);
        let mut at = offset;
        let chunks: Vec<(u64, Vec<u8>)> = bytes[..take]
            .chunks(step)
            .map(|c| {
                let here = at;
                at = at.saturating_add(u64::try_from(c.len()).unwrap_or(u64::MAX));
                (here, c.to_vec())
            })
            .collect();
        for (offset, bytes) in chunks {
            self.send(
                conn,
                ToMill::LiveLog {
                    lease,
                    offset,
                    bytes,
                },
            );
        }
    }

    /// E15: the end mark, an empty `LiveLog` at the end of the job's output, sent (best
    /// effort) before its terminal so that bytes dropped at the very end are a hole too.
    fn send_log_end(&mut self, lease: LeaseId, log_end: u64) {
        if log_end == 0 {
            return;
        }
        if let Some(conn) = self.ready_conn() {
            let end = ToMill::LiveLog {
                lease,
                offset: log_end,
                bytes: Vec::new(),
            };
            self.send(conn, end);
        }
    }

    /// E12: when self-fencing is due, if any job would be stopped by it.
    pub(super) fn fence_deadline(&self) -> Option<Time> {
        self.seats
            .running
            .values()
            .any(|j| j.stop.is_none())
            .then(|| self.last_heard.plus(self.timers().reconnect_grace))
    }

    /// E12: whether the store's last contact is not the one the fence clock counts from (the
    /// mill was heard since it was written, or it has none).
    pub(super) fn contact_is_behind(&self) -> bool {
        self.durable.last_contact != Some(self.last_heard)
    }

    /// E12: when the last contact must be written in a batch of its own: one
    /// `snapshot_interval` after the store's, while jobs run (a restart would adopt them) and
    /// no other batch carried it. At most one such write per interval, none while cut off.
    /// A store with no contact (written before it was kept), or one from a clock set back,
    /// gets ours at once.
    pub(super) fn contact_deadline(&self) -> Option<Time> {
        if self.seats.running.is_empty() || !self.contact_is_behind() {
            return None;
        }
        Some(match self.durable.last_contact {
            Some(at) if at <= self.last_heard => at.plus(self.timers().snapshot_interval),
            // None, or later than ours (the driver's clock went back between processes, and
            // this process counts from its start): written over at once, so that the next
            // restart does not count from its own start again.
            Some(_) | None => self.last_heard,
        })
    }

    /// E12: makes the fence clock durable when its deadline passed and no batch of this
    /// step carried it: a restart counts `reconnect_grace` from here.
    pub(super) fn persist_contact_if_due(&mut self, now: Time) {
        if self.contact_deadline().is_some_and(|d| now >= d) {
            let at = self.last_heard;
            self.write_batch(vec![ExecutorWrite::Contact { at }]);
        }
    }

    /// E12: nothing heard for `reconnect_grace`: stop every running job (terminal Failed
    /// "executor lost contact with the mill") and let go of every reservation.
    pub(super) fn fence(&mut self) {
        let mut stopping = Vec::new();
        for (lease, job) in &mut self.seats.running {
            if job.stop.is_none() {
                job.stop = Some(StopReason::Fence);
                stopping.push(*lease);
            }
        }
        // Durable like a cancel's stop: a restart mid-stop still reports E12, not E9.
        let writes = stopping
            .iter()
            .map(|&lease| ExecutorWrite::JobStopping {
                lease,
                stop: StopReason::Fence,
            })
            .collect();
        self.persist(writes);
        let reserved: Vec<LeaseId> = self.seats.reserved.keys().copied().collect();
        for lease in reserved {
            self.take_reservation(lease);
        }
        self.drop_all_waiting();
        let grace = self.config.stop_grace;
        for lease in stopping {
            self.emit(ExecutorOutput::StopJob { lease, grace });
        }
    }
}
