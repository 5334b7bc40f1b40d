//! What the mill makes durable (M29): typed writes grouped into batches, and the snapshot a
//! driver loads at restart.
//!
//! A [`MillBatch`] is applied atomically (one SQL transaction in the node, one in-memory step
//! in the simulator) before the driver acts on any output that follows it. [`MillSnapshot`]
//! doubles as the reference in-memory store: [`MillSnapshot::apply`] is exactly what a durable
//! store must do with a batch, so the simulator keeps one per mill and the node's SQLite
//! schema mirrors it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::job::{
    Fingerprint, IdempotencyKey, Identity, JobSpec, JobState, TerminalCause, TerminalStatus,
};
use crate::types::{Epoch, JobId, LeaseId, NodeId, Resources, Seqno};

/// Where a durable lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseState {
    /// Published (M16): the seat is held and the commit is on its way. Kept at restart as
    /// unclaimed, since the commit may have reached the executor (M29).
    Reserved,
    /// Committed (M17): the executor runs the job.
    Running,
}

/// A lease as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The lease.
    pub lease: LeaseId,
    /// The job it runs.
    pub job: JobId,
    /// The executor.
    pub node: NodeId,
    /// The executor's store epoch when the lease was made.
    pub epoch: Epoch,
    /// What the executor charges (M14); the quota hold is for the same charge.
    pub resources: Resources,
    /// Reserved or running.
    pub state: LeaseState,
    /// The cancel the mill accepted for it (M26), if any: kept so that a restarted mill
    /// sends it again and ends the job with its status (M29).
    pub cancel: Option<CancelRecord>,
    /// The job's attempt this lease is (M32): 1 for its first lease, one more for each
    /// lease after; never reused.
    pub attempt: u32,
}

/// What became of a job after one of its attempts ended (M32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    /// The job ended with this attempt's terminal.
    Final,
    /// The job is queued for its next attempt under its retry policy. `fenced`: the run
    /// may still have been going when its lease ended (the executor was lost), so the next
    /// attempt waits until it is surely stopped (I1, E12).
    Retried {
        /// The next attempt waits out the fence.
        fenced: bool,
    },
    /// Nothing ran (the seat was never committed, or the executor never started it): the
    /// job is placed again without spending a retry.
    Released,
}

/// How one attempt ended (M32).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptEnd {
    /// The job.
    pub job: JobId,
    /// Its attempt number (the lease's [`LeaseRecord::attempt`]).
    pub attempt: u32,
    /// The attempt's lease.
    pub lease: LeaseId,
    /// The executor it ran on.
    pub node: NodeId,
    /// How the attempt ended; `None` when nothing ran (`Released`).
    pub status: Option<TerminalStatus>,
    /// Why.
    pub cause: Option<TerminalCause>,
    /// The engine's exit code, if it ran to one.
    pub exit_code: Option<i32>,
    /// Human text.
    pub error: Option<String>,
    /// What became of the job.
    pub outcome: AttemptOutcome,
}

/// Where an open job's attempts stand, as a restarted mill needs it (M32, M29).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptTally {
    /// The highest attempt number used.
    pub last: u32,
    /// Attempts that ended `Retried` (retries spent).
    pub retried: u32,
    /// The latest attempt ended `Retried { fenced: true }` and no lease has been made
    /// since: the next attempt must wait out the fence again after a restart.
    pub fence_pending: bool,
    /// That attempt's lease and node, while `fence_pending`: a snapshot of the node that
    /// still reports the lease holds the fence after a restart too.
    pub fenced_run: Option<(LeaseId, NodeId)>,
}

/// A cancel the mill accepted for a running lease (M26, M18), as stored (M29).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRecord {
    /// Why, for the record and the `CancelAttempt`.
    pub reason: String,
    /// `Cancelled` for a client's cancel, `Timeout` for M18.
    pub status: TerminalStatus,
    /// The matching cause (`Cancelled` or `Timeout`).
    pub cause: TerminalCause,
}

/// A job as stored; terminal jobs leave the snapshot (the driver keeps their history).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    /// What to run.
    pub spec: JobSpec,
    /// Wall-clock submission time from the driver (plain data for people: ms since the Unix
    /// epoch), never used for deadlines.
    pub submitted_at_ms: u64,
    /// The latest state.
    pub state: JobState,
}

/// What an idempotency key maps to (M31).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The fingerprint of the spec first submitted under the key.
    pub fingerprint: Fingerprint,
    /// The job that submit created.
    pub job: JobId,
}

/// One durable change. Drivers match these exhaustively.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MillWrite {
    /// High-water marks: job ids below `next_job` and lease ids below `lease_floor` may have
    /// been used and are never handed out again (M30).
    Counters {
        /// Next job id.
        next_job: JobId,
        /// Lease ids below this may have been used.
        lease_floor: LeaseId,
    },
    /// A new job, queued.
    JobInsert {
        /// Its id.
        job: JobId,
        /// The record, boxed: it is by far the largest write, and every write of a batch
        /// (most are a few words: lease deletes, quota releases, cursors) is as large as the
        /// largest variant. Serialized exactly as an unboxed record.
        record: Box<JobRecord>,
    },
    /// A submit's idempotency key (M31), in the same batch as its job's insert (right after
    /// it), so that a crash never leaves a job without its key or a key without its job.
    /// Kept until retention deletes the job (then the driver deletes the key with it).
    KeyInsert {
        /// The key.
        key: IdempotencyKey,
        /// What it maps to.
        record: KeyRecord,
    },
    /// A job's new state; also one entry of its status history.
    JobState {
        /// The job.
        job: JobId,
        /// Its state from now on.
        state: JobState,
    },
    /// A lease was published or committed.
    LeaseUpsert(LeaseRecord),
    /// A cancel was accepted for a running lease (M26); written before its `CancelAttempt`
    /// goes out and before the client hears Ok, so a restart keeps it (M29).
    LeaseCancel {
        /// The lease.
        lease: LeaseId,
        /// The cancel.
        cancel: CancelRecord,
    },
    /// An attempt ended (M32): written with the lease's delete.
    Attempt(Box<AttemptEnd>),
    /// A lease ended.
    LeaseDelete {
        /// The lease.
        lease: LeaseId,
    },
    /// Events up to `seqno` of (node, epoch) are applied (M23).
    Cursor {
        /// The executor.
        node: NodeId,
        /// Its epoch.
        epoch: Epoch,
        /// Last applied seqno.
        seqno: Seqno,
    },
    /// The cursor of (node, epoch) is forgotten: the node is on a newer epoch and holds no
    /// lease of this one, so no event of it can be applied any more (M23, retention).
    CursorDelete {
        /// The executor.
        node: NodeId,
        /// The old epoch.
        epoch: Epoch,
    },
    /// A quota hold for a published lease's job.
    QuotaHold {
        /// The job (the reservation id).
        job: JobId,
        /// Scopes charged.
        identity: Identity,
        /// The charge.
        charge: Resources,
    },
    /// A quota hold ended.
    QuotaRelease {
        /// The job.
        job: JobId,
    },
    /// A node entered or left quarantine (M28).
    Quarantine {
        /// The executor.
        node: NodeId,
        /// True when quarantined.
        quarantined: bool,
    },
}

/// Writes to apply atomically, in order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MillBatch {
    /// The writes.
    pub writes: Vec<MillWrite>,
}

/// Everything durable, as loaded at restart (M29).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MillSnapshot {
    /// Next job id to hand out.
    pub next_job: JobId,
    /// Lease ids below this may have been used.
    pub lease_floor: LeaseId,
    /// Jobs that have not ended.
    pub jobs: BTreeMap<JobId, JobRecord>,
    /// Leases, reserved or running.
    pub leases: BTreeMap<LeaseId, LeaseRecord>,
    /// Applied seqno per (node, epoch).
    pub cursors: BTreeMap<(NodeId, Epoch), Seqno>,
    /// Quota holds by job.
    pub quota_holds: BTreeMap<JobId, (Identity, Resources)>,
    /// Quarantined nodes.
    pub quarantined: BTreeSet<NodeId>,
    /// Idempotency keys (M31), of active and finished jobs alike, until retention.
    pub keys: BTreeMap<IdempotencyKey, KeyRecord>,
    /// Attempts of jobs that have not ended (M32).
    pub attempts: BTreeMap<JobId, AttemptTally>,
}

impl MillSnapshot {
    /// What a store's retention does with the keys of `jobs` as it deletes those finished
    /// jobs (M31: keys expire with their jobs, in the same transaction).
    pub fn forget_keys_of(&mut self, jobs: &BTreeSet<JobId>) {
        self.keys.retain(|_, r| !jobs.contains(&r.job));
    }

    /// Applies a batch exactly as a durable store must.
    pub fn apply(&mut self, batch: &MillBatch) {
        for write in &batch.writes {
            self.apply_write(write);
        }
    }

    fn apply_write(&mut self, write: &MillWrite) {
        match write {
            MillWrite::Counters {
                next_job,
                lease_floor,
            } => {
                self.next_job = self.next_job.max(*next_job);
                self.lease_floor = self.lease_floor.max(*lease_floor);
            }
            MillWrite::JobInsert { job, record } => {
                self.jobs.insert(*job, JobRecord::clone(record));
            }
            MillWrite::KeyInsert { key, record } => {
                self.keys.insert(key.clone(), *record);
            }
            MillWrite::JobState { job, state } => {
                if matches!(state, JobState::Done(_)) {
                    self.jobs.remove(job);
                    self.attempts.remove(job);
                } else if let Some(record) = self.jobs.get_mut(job) {
                    record.state = state.clone();
                }
            }
            MillWrite::LeaseUpsert(record) => {
                let tally = self.attempts.entry(record.job).or_default();
                if record.attempt > tally.last {
                    tally.last = record.attempt;
                    tally.fence_pending = false;
                    tally.fenced_run = None;
                }
                self.leases.insert(record.lease, record.clone());
            }
            MillWrite::Attempt(end) => {
                if let Some(tally) = self.attempts.get_mut(&end.job) {
                    match end.outcome {
                        AttemptOutcome::Retried { fenced } => {
                            tally.retried = tally.retried.saturating_add(1);
                            tally.fence_pending = fenced;
                            tally.fenced_run = fenced.then(|| (end.lease, end.node.clone()));
                        }
                        AttemptOutcome::Final | AttemptOutcome::Released => {
                            tally.fence_pending = false;
                            tally.fenced_run = None;
                        }
                    }
                }
            }
            MillWrite::LeaseCancel { lease, cancel } => {
                if let Some(record) = self.leases.get_mut(lease) {
                    record.cancel = Some(cancel.clone());
                }
            }
            MillWrite::LeaseDelete { lease } => {
                self.leases.remove(lease);
            }
            MillWrite::Cursor { node, epoch, seqno } => {
                self.cursors.insert((node.clone(), *epoch), *seqno);
            }
            MillWrite::CursorDelete { node, epoch } => {
                self.cursors.remove(&(node.clone(), *epoch));
            }
            MillWrite::QuotaHold {
                job,
                identity,
                charge,
            } => {
                self.quota_holds
                    .insert(*job, (identity.clone(), charge.clone()));
            }
            MillWrite::QuotaRelease { job } => {
                self.quota_holds.remove(job);
            }
            MillWrite::Quarantine { node, quarantined } => {
                if *quarantined {
                    self.quarantined.insert(node.clone());
                } else {
                    self.quarantined.remove(node);
                }
            }
        }
    }
}
