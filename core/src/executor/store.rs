//! What an executor keeps on disk, and the typed writes that change it.
//!
//! The executor mutates its durable state only by emitting `Persist(batch)` and applying the
//! same batch to its own copy, so a store that applies every persisted batch in order holds
//! exactly what the executor believes is durable — that is what a restart loads (E1, E5, E9).
//! Nothing here holds a secret (secrets never touch the disk), and the only `Time` is the
//! last contact with the mill, the self-fencing clock that must survive restarts (E12): its
//! driver keeps one time origin across the processes of a store (DESIGN §2).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::job::TerminalStatus;
use crate::types::{Epoch, JobId, LeaseId, Resources, Seqno, Term, Time};
use crate::wire::{EndCause, Event, SessionTimers};

/// A committed job, as much as a restart needs to report its end (E9).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredJob {
    /// The job.
    pub job: JobId,
    /// The engine that runs it.
    pub engine: String,
    /// What its seat charges.
    pub resources: Resources,
    /// Why it is being stopped, once a stop was asked for: durable before the cancel's ack
    /// goes out, so a restart ends the job as the stop said (E7, E9, E12).
    pub stop: Option<StopReason>,
}

/// Why a running job is being stopped; decides its terminal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// The mill cancelled it (E7): terminal Cancelled with this reason.
    Cancel(String),
    /// Self-fencing (E12): terminal Failed "executor lost contact with the mill".
    Fence,
}

/// The executor's durable store, as loaded at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutorSnapshot {
    /// The store's id, made when it was created (E1).
    pub epoch: Epoch,
    /// The seqno the next event gets; the first event of an epoch is 1.
    pub next_seqno: Seqno,
    /// Unacked events, in seqno order, contiguous, each below `next_seqno` (E5).
    pub outbox: VecDeque<Event>,
    /// Jobs committed and not yet ended, by lease.
    pub jobs: BTreeMap<LeaseId, StoredJob>,
    /// The last time the executor heard the mill, as far as the store knows (E12): a
    /// restarted executor counts `reconnect_grace` for the jobs it adopts from here, not from
    /// its own start (I1). It lags the executor's own clock by at most about one
    /// `snapshot_interval` while jobs run, which only makes a restart fence earlier. `None`
    /// in a fresh store, or one written before the field existed.
    pub last_contact: Option<Time>,
    /// The timers of the last mill that welcomed this executor, which it runs on instead of
    /// its configured ones (M1, E12): a restarted executor fences by the grace the mill
    /// counts, not by a flag that may differ. `None` until the first `Welcome`.
    pub timers: Option<SessionTimers>,
    /// The highest mill term this executor has seen (E13; 0 for none): durable before
    /// anything of that term is acted on, so no restart brings back a deposed mill's say.
    pub term: Term,
}

impl StopReason {
    /// The terminal a job stopped for this reason gets: status, error text and cause.
    pub fn terminal(self) -> (TerminalStatus, Option<String>, EndCause) {
        match self {
            StopReason::Cancel(reason) => {
                (TerminalStatus::Cancelled, Some(reason), EndCause::Cancelled)
            }
            StopReason::Fence => (
                TerminalStatus::Failed,
                Some(super::LOST_CONTACT.to_string()),
                EndCause::LostContact,
            ),
        }
    }
}

/// One durable change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExecutorWrite {
    /// Append an event to the outbox; its seqno is the store's `next_seqno`.
    Append(Event),
    /// Drop outbox events with seqno ≤ `up_to` (acked by the mill).
    Trim {
        /// Highest seqno dropped.
        up_to: Seqno,
    },
    /// A lease was committed; the job is (about to be) running.
    JobCommitted {
        /// The lease.
        lease: LeaseId,
        /// The job.
        job: StoredJob,
    },
    /// The job under `lease` is being stopped, and why (E7, E12).
    JobStopping {
        /// The lease.
        lease: LeaseId,
        /// Why.
        stop: StopReason,
    },
    /// The job under `lease` ended (its terminal is appended in the same batch).
    JobEnded {
        /// The lease.
        lease: LeaseId,
    },
    /// The executor last heard the mill at `at` (E12): replaces `last_contact`.
    Contact {
        /// When, on the driver's clock.
        at: Time,
    },
    /// A `Welcome` carried timers other than those the executor ran on: replaces `timers`.
    Timers(SessionTimers),
    /// A `Welcome` carried a term above every one seen (E13): replaces `term`.
    Term(Term),
}

/// Writes the driver applies atomically, before acting on any later output.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExecutorBatch {
    /// In order.
    pub writes: Vec<ExecutorWrite>,
}

impl ExecutorBatch {
    /// Whether the batch must be on disk before the driver acts on what follows it (E5).
    /// Only outbox trims and contact marks may be lost to a crash of the host: a lost trim
    /// re-sends events the mill acked, which it drops as replays (M20), and a lost contact
    /// mark makes a restart fence earlier, never later (E12). A batch of nothing else is
    /// written in order but without waiting for the disk; the next batch that does wait
    /// makes it durable too.
    pub fn needs_sync(&self) -> bool {
        self.writes.iter().any(|w| match w {
            ExecutorWrite::Trim { .. } | ExecutorWrite::Contact { .. } => false,
            ExecutorWrite::Append(_)
            | ExecutorWrite::JobCommitted { .. }
            | ExecutorWrite::JobStopping { .. }
            | ExecutorWrite::JobEnded { .. }
            | ExecutorWrite::Timers(_)
            | ExecutorWrite::Term(_) => true,
        })
    }
}

/// Why a loaded store was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// `next_seqno` is 0; seqnos start at 1.
    #[error("next_seqno: 0; seqnos start at 1")]
    ZeroNextSeqno,
    /// An outbox event is out of order or at/after `next_seqno`.
    #[error("outbox: event {seqno} follows {previous} (next_seqno {next}); events must be contiguous and below next_seqno")]
    OutboxOrder {
        /// The offending seqno.
        seqno: Seqno,
        /// The seqno before it (or 0).
        previous: Seqno,
        /// The store's `next_seqno`.
        next: Seqno,
    },
}

impl ExecutorSnapshot {
    /// A new, empty store with the epoch the driver picked (E1: a wiped store is a new epoch).
    pub fn fresh(epoch: Epoch) -> Self {
        ExecutorSnapshot {
            epoch,
            next_seqno: Seqno(1),
            outbox: VecDeque::new(),
            jobs: BTreeMap::new(),
            last_contact: None,
            timers: None,
            term: Term(0),
        }
    }

    /// Applies a persisted batch, exactly as the executor did.
    pub fn apply(&mut self, batch: &ExecutorBatch) {
        for write in &batch.writes {
            match write {
                ExecutorWrite::Append(event) => {
                    self.next_seqno = self.next_seqno.max(event.seqno.next());
                    self.outbox.push_back(event.clone());
                }
                ExecutorWrite::Trim { up_to } => {
                    while self.outbox.front().is_some_and(|e| e.seqno <= *up_to) {
                        self.outbox.pop_front();
                    }
                }
                ExecutorWrite::JobCommitted { lease, job } => {
                    self.jobs.insert(*lease, job.clone());
                }
                ExecutorWrite::JobStopping { lease, stop } => {
                    if let Some(job) = self.jobs.get_mut(lease) {
                        job.stop = Some(stop.clone());
                    }
                }
                ExecutorWrite::JobEnded { lease } => {
                    self.jobs.remove(lease);
                }
                ExecutorWrite::Contact { at } => self.last_contact = Some(*at),
                ExecutorWrite::Timers(t) => self.timers = Some(*t),
                ExecutorWrite::Term(t) => self.term = self.term.max(*t),
            }
        }
    }

    /// Checks that the outbox is contiguous and below `next_seqno`.
    pub fn validate(&self) -> Result<(), StoreError> {
        if self.next_seqno == Seqno(0) {
            return Err(StoreError::ZeroNextSeqno);
        }
        let mut previous: Option<Seqno> = None;
        for event in &self.outbox {
            let in_order = previous.is_none_or(|p| event.seqno == p.next());
            if !in_order || event.seqno >= self.next_seqno || event.seqno == Seqno(0) {
                return Err(StoreError::OutboxOrder {
                    seqno: event.seqno,
                    previous: previous.unwrap_or_default(),
                    next: self.next_seqno,
                });
            }
            previous = Some(event.seqno);
        }
        Ok(())
    }

    /// The last seqno appended in this epoch (0 if none).
    pub fn last_seqno(&self) -> Seqno {
        Seqno(self.next_seqno.get().saturating_sub(1))
    }

    /// The highest seqno the mill has acked as far as this store knows: everything before the
    /// first unacked event (or everything appended, when the outbox is empty).
    pub fn acked_up_to(&self) -> Seqno {
        match self.outbox.front() {
            Some(e) => Seqno(e.seqno.get().saturating_sub(1)),
            None => self.last_seqno(),
        }
    }
}
