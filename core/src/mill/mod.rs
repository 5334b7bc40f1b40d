//! The mill: a sans-IO state machine that accepts jobs, places them on executors by bidding,
//! and applies their events exactly once (DESIGN §4, M1–M30).
//!
//! One `Mill` value holds all coordinator state. Drivers feed it [`MillInput`]s with
//! [`Mill::handle`], drain [`MillOutput`]s with [`Mill::poll_output`] and call `handle(now,
//! Tick)` at or after [`Mill::next_deadline`]. Every `Persist` output must be durable before
//! the driver acts on any output after it; within one `handle` call the mill emits at most one
//! `Persist`, and every message or client update of that call follows it.
//!
//! The logic is split by concern: `session` (hello, silence, grace, reconcile, violations),
//! `placement` (ranking, bids, quota admission, publish and commit), `events` (sequenced event
//! batches), `cancel` (cancels and timeouts), `restart` (restore from a snapshot).

mod audit;
mod cancel;
mod config;
mod events;
mod keys;
mod placement;
mod restart;
mod session;
mod store;
mod terminals;
#[cfg(test)]
mod tests;
mod view;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

pub use config::{ConfigError, MillConfig};
pub use placement::{RankIndex, RankKey};
pub use store::{
    AttemptEnd, AttemptOutcome, AttemptTally, CancelRecord, JobRecord, KeyRecord, LeaseRecord,
    LeaseState, MillBatch, MillSnapshot, MillWrite,
};
pub use view::SessionView;

use crate::job::{IdempotencyKey, JobSpec, JobState, SpecError, Terminal};
use crate::quota::QuotaLedger;
use crate::timers::TimerTable;
use crate::types::{ConnId, Epoch, JobId, LeaseId, NodeId, Resources, Seqno, Time};
use crate::wire::{ToExecutor, ToMill};

/// Lease ids are reserved durably in blocks of this many, so that a lease id is persisted
/// before it is sent without a write per bid (M30).
const LEASE_BLOCK: u64 = 1024;

/// Longest reason the mill puts on the wire or in a terminal.
const MAX_REASON: usize = crate::wire::MAX_REASON;

/// Something that happened to the mill, from outside.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum MillInput {
    /// An executor connection was accepted.
    Connected {
        /// The driver's id for it.
        conn: ConnId,
    },
    /// A decoded message arrived on a connection.
    Message {
        /// The connection.
        conn: ConnId,
        /// The message.
        msg: ToMill,
    },
    /// A connection closed (by the peer, the network, or after a `Close` output).
    Disconnected {
        /// The connection.
        conn: ConnId,
    },
    /// Time passed; deadlines at or before `now` fire.
    Tick,
}

/// A client request the mill refused; nothing was stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The job spec is invalid; the error names the field.
    #[error("invalid job: {0}")]
    Spec(#[from] SpecError),
    /// Too many jobs wait for placement (M10).
    #[error("too many pending jobs: {pending} waiting, at most {max}")]
    TooManyPending {
        /// Jobs waiting now.
        pending: usize,
        /// `max_pending`.
        max: usize,
    },
    /// The job is unknown or has already ended.
    #[error("job {job} is not active (unknown or already ended)")]
    JobNotActive {
        /// The job.
        job: JobId,
    },
    /// The node is not quarantined.
    #[error("node {node} is not quarantined")]
    NotQuarantined {
        /// The node.
        node: NodeId,
    },
    /// The idempotency key was used for a different spec (M31).
    #[error("Idempotency-Key \"{key}\" was already used for job {job} with a different spec")]
    KeyConflict {
        /// The key.
        key: IdempotencyKey,
        /// The job it maps to.
        job: JobId,
    },
}

/// What a submit did (M31).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    /// The job.
    pub job: JobId,
    /// True when this submit created it; false when its key named an existing job with
    /// the same spec (nothing was stored).
    pub created: bool,
}

/// What the mill asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum MillOutput {
    /// Send a message on a connection.
    Send {
        /// The connection.
        conn: ConnId,
        /// The message.
        msg: ToExecutor,
    },
    /// Close a connection (after sending what was queued before this output).
    Close {
        /// The connection.
        conn: ConnId,
        /// Why, for the logs.
        reason: String,
    },
    /// Make these writes durable, atomically, before acting on any later output.
    Persist(MillBatch),
    /// A job changed state; tell whoever watches it.
    JobUpdate {
        /// The job.
        job: JobId,
        /// Its new state.
        state: JobState,
    },
    /// Best-effort log bytes from the executor running a job.
    LiveLog {
        /// The job.
        job: JobId,
        /// The lease it runs under.
        lease: LeaseId,
        /// Position of the first byte in the lease's output (E15); bytes before it that
        /// never arrived are lost, not adjacent.
        offset: u64,
        /// Raw bytes (empty: the output ends at `offset`).
        bytes: Vec<u8>,
    },
    /// Something worth counting or logging (metrics, simulator coverage). No action needed.
    Observed(Observation),
}

/// Facts for metrics, logs and the simulator's coverage counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// A job won a bid and its lease was published.
    Placed {
        /// The job.
        job: JobId,
        /// The lease.
        lease: LeaseId,
        /// The executor.
        node: NodeId,
        /// From queued (submit, requeue or restart) to published.
        latency: Duration,
    },
    /// A session was closed for a protocol violation (M28).
    Violation {
        /// The executor.
        node: NodeId,
        /// What kind of violation: what metrics and checkers match on.
        kind: ViolationKind,
        /// What it did, for people (never matched on).
        reason: String,
    },
    /// An event batch's events were applied (M20, M23): `events` of them, the first with
    /// seqno `first` and the last with `last`. Only events above the cursor are applied, each
    /// once, so a correct mill reports `first` = old cursor + 1, `last` = the new cursor and
    /// `events` = `last − first + 1` (the simulator's I4 counts them).
    Applied {
        /// The session's connection (a copy, not the node id: one per batch, kept cheap).
        conn: ConnId,
        /// The batch's epoch.
        epoch: Epoch,
        /// The first event applied.
        first: Seqno,
        /// The last event applied.
        last: Seqno,
        /// How many were applied.
        events: u64,
    },
    /// An attempt ended and the job's retry policy queued it again (M32).
    Retried {
        /// The job.
        job: JobId,
        /// The attempt that ended.
        attempt: u32,
        /// Why it ended.
        cause: Option<crate::job::TerminalCause>,
        /// The next attempt waits out a fence (the run may still have been going).
        fenced: bool,
    },
    /// A job taken up for placement waits for quota (M15, Q2): it left the queue without an
    /// ask (a direct placement asks quota first, M35) or after one (a bid's acceptance).
    QuotaWait {
        /// The job.
        job: JobId,
    },
    /// A node was quarantined (M28).
    Quarantined {
        /// The executor.
        node: NodeId,
    },
    /// An executor has seen a term above this mill's (E13): in a `Hello` (refused), or by
    /// answering `Stale`. The mill may have been deposed; its driver checks the store and
    /// steps down if so. A hint, not a verdict: only the store says who leads.
    Deposed {
        /// The executor that said so.
        node: NodeId,
        /// This mill's term.
        ours: crate::types::Term,
        /// The term the executor has seen.
        seen: crate::types::Term,
    },
    /// A Hello was refused (M1, M2).
    Refused {
        /// The connection.
        conn: ConnId,
        /// Why.
        reason: String,
    },
    /// A rarely taken path was taken.
    Rare(RarePath),
}

/// A kind of protocol violation the mill detects (M28): data beside the human reason, as
/// quinn's `TransportError{code, reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ViolationKind {
    /// A second `Hello` on one session (M1).
    SecondHello,
    /// A message over a bound: a snapshot's engines or leases, a batch's events, a reason or
    /// error text (DESIGN §3, STYLE 6).
    Oversize,
    /// A snapshot with an invalid engine name or load (M7).
    BadSnapshot,
    /// A snapshot seqno that does not exceed the last one (M7).
    SnapshotRegression,
    /// An event batch for another epoch than the session's (M19).
    WrongEpoch,
    /// Event seqnos that do not increase within a batch (M20).
    SeqnoOrder,
    /// A gap in the event seqnos (M20).
    SeqnoGap,
    /// An event for a lease after its terminal (M22).
    EventAfterTerminal,
    /// A log reference that is not `logs/<lease>.log` with a sha256 (M25).
    BadLogRef,
    /// A `ReserveResult` for an ask not made of this node, or answered twice (M12).
    UnaskedReserveResult,
    /// An acceptance claiming invalid resources (M14).
    BadResources,
}

impl ViolationKind {
    /// Every kind, in order (for metrics that list zero counts).
    pub const ALL: [ViolationKind; 11] = [
        ViolationKind::SecondHello,
        ViolationKind::Oversize,
        ViolationKind::BadSnapshot,
        ViolationKind::SnapshotRegression,
        ViolationKind::WrongEpoch,
        ViolationKind::SeqnoOrder,
        ViolationKind::SeqnoGap,
        ViolationKind::EventAfterTerminal,
        ViolationKind::BadLogRef,
        ViolationKind::UnaskedReserveResult,
        ViolationKind::BadResources,
    ];

    /// A stable snake_case name (metrics labels, logs).
    pub fn name(self) -> &'static str {
        match self {
            ViolationKind::SecondHello => "second_hello",
            ViolationKind::Oversize => "oversize",
            ViolationKind::BadSnapshot => "bad_snapshot",
            ViolationKind::SnapshotRegression => "snapshot_regression",
            ViolationKind::WrongEpoch => "wrong_epoch",
            ViolationKind::SeqnoOrder => "seqno_order",
            ViolationKind::SeqnoGap => "seqno_gap",
            ViolationKind::EventAfterTerminal => "event_after_terminal",
            ViolationKind::BadLogRef => "bad_log_ref",
            ViolationKind::UnaskedReserveResult => "unasked_reserve_result",
            ViolationKind::BadResources => "bad_resources",
        }
    }
}

impl std::fmt::Display for ViolationKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Rare paths the simulator must reach (issue 4, item 9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RarePath {
    /// Grace expired while a cancel was pending for one of the node's leases (M5).
    GraceExpiredWithPendingCancel,
    /// A snapshot reported the run of an attempt retried behind a fence: the fence holds
    /// while the run lives (M32).
    FencedRunReported,
    /// A commit was re-sent (M17).
    CommitResent,
    /// The mill restarted holding running leases (M29).
    RestartWithRunningLeases,
    /// The mill restarted holding published, not yet committed leases (M29 as revised).
    RestartWithPublishedLeases,
    /// A reconciling snapshot waited for events still in flight (`outbox_high`, M8).
    ReconcileAwaitedEvents,
    /// A re-bid after a quota wait charged different resources (M15).
    QuotaRebidChangedResources,
    /// A job waited for quota (M15).
    QuotaWait,
    /// An untracked cancel was sent for a lease the mill does not know (M8).
    UntrackedCancel,
    /// A cancel's teardown deadline passed (M26).
    TeardownDeadline,
    /// A reconciling snapshot failed a lease the executor no longer has (M8).
    ReconcileFailedLease,
    /// A lease of an older epoch failed at grace expiry after its node came back wiped.
    OldEpochLeaseFailed,
    /// An executor refused a direct ask; its commit found nothing to start (M35).
    DirectRefused,
    /// A queued job was staged on a full node, to start on its next free seat (M36).
    Staged,
    /// A staged lease was withdrawn and the executor answered that it never started (M36).
    StagedWithdrawn,
}

/// One decision a `Tick` may take, keyed in the timer table: each key has at most one
/// deadline, set while the thing it watches is live and stopped when that thing ends (see
/// [`Mill::check_timers`]). A timer is still checked against the state when it fires.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Handshake(ConnId),
    Silence(NodeId),
    Grace(NodeId),
    Ask(LeaseId),
    Stray(LeaseId),
    Commit(LeaseId),
    CancelAck(NodeId, LeaseId),
    Teardown(LeaseId),
    JobTimeout(JobId),
    QueueTimeout(JobId),
    /// A retry's fence is over: the job may be placed (M32).
    RetryFence(JobId),
}

/// A connection the driver reported.
#[derive(Debug)]
struct Conn {
    node: Option<NodeId>,
}

/// A cancel in progress for a lease (M26).
#[derive(Debug, Clone)]
struct LeaseCancel {
    reason: String,
    /// `Cancelled` for a user cancel, `Timeout` for M18.
    status: crate::job::TerminalStatus,
    /// The matching cause (`Cancelled` or `Timeout`).
    cause: crate::job::TerminalCause,
    phase: CancelPhase,
}

impl LeaseCancel {
    /// What is stored of it (M29): everything but the phase, which a restart begins again
    /// at `Waiting`.
    fn record(&self) -> CancelRecord {
        CancelRecord {
            reason: self.reason.clone(),
            status: self.status,
            cause: self.cause,
        }
    }

    /// A cancel restored from the store: it goes out again when the node is ready (M26).
    fn restored(record: CancelRecord) -> Self {
        LeaseCancel {
            reason: record.reason,
            status: record.status,
            cause: record.cause,
            phase: CancelPhase::Waiting,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CancelPhase {
    /// Not sent: the node is not ready.
    Waiting,
    /// Sent; the ack is due by the session's pending-cancel deadline.
    Sent,
    /// Acked; a terminal is due by this deadline.
    Acked { teardown: Time },
}

/// A lease the mill holds (M16, M17).
#[derive(Debug)]
struct Lease {
    job: JobId,
    node: NodeId,
    epoch: Epoch,
    resources: Resources,
    state: LeaseState,
    /// For a reserved lease: the connection the commit went on, and when to re-send it.
    commit_sent: Option<(ConnId, Time)>,
    /// A `CommitLease` for it went out at least once: the node may be running it, and only
    /// a cancel stops it (E8), even after a reconnect cleared `commit_sent`.
    commit_out: bool,
    cancel: Option<LeaseCancel>,
    /// The job's attempt this lease is (M32).
    attempt: u32,
    /// M35: published directly, and the executor's answer to its `ReserveSeat{direct}` has
    /// not come yet.
    direct_answer_due: bool,
    /// M36: staged on a node whose seats were all taken: it starts on the node's next free
    /// seat, and its commit is answered then. Not stored: a restarted mill holds it as any
    /// published lease.
    staged: bool,
    /// M36: a staged lease the mill asked back (`ReleaseLease`); it ends Released if the
    /// executor answers that it never started, and runs if it won the race.
    withdrawn: bool,
}

/// Where a job that has not ended stands.
#[derive(Debug)]
enum Phase {
    Queued,
    Bidding(placement::BidRound),
    QuotaWait {
        charge: Resources,
    },
    Leased(LeaseId),
    /// Its last attempt's executor was lost: the next attempt waits until the run it may
    /// still have is surely stopped (M32, I1, E12).
    Fenced {
        until: Time,
    },
}

#[derive(Debug)]
struct Job {
    spec: JobSpec,
    /// When it last entered the queue, for placement latency.
    queued_at: Time,
    /// When it times out (M18).
    deadline: Time,
    /// Until a lease first takes it: when it ends for having waited `queue_timeout`.
    queue_deadline: Option<Time>,
    phase: Phase,
    /// After a quota wait: the charge already held for the re-bid (M15).
    quota_held: Option<Resources>,
    /// Whether anything other than `Queued` was persisted for it.
    persisted_beyond_queued: bool,
    /// Its last bid found nobody; it waits until the fleet changes (never polls, M13).
    waits_for_change: Option<u64>,
    /// Nodes that answered Incompatible, with the connection they answered on: while that
    /// session lasts they are not asked again if another candidate can be (M13, I9) — an
    /// ask would only hold their seat from jobs they can run.
    incompatible: BTreeMap<NodeId, ConnId>,
    /// M34: nodes that refused it Transient for a resource, with their `frees` mark then:
    /// not asked again until that node frees something (a seat, a lease, a new snapshot),
    /// since until then its answer would be the same. At most one entry per node.
    refused: BTreeMap<NodeId, u64>,
    /// The highest attempt number used (M32): its next lease is attempt `attempt + 1`.
    attempt: u32,
    /// The lease of its last attempt while that attempt's run may live on (M32).
    fenced_run: Option<LeaseId>,
    /// Attempts that ended in a retry (M32): at most `spec.retry.retries`.
    retried: u32,
    /// M35: it was placed directly once; every later placement is a bid, so a node that
    /// refuses direct asks costs one wasted lease per job, never a loop.
    direct_tried: bool,
    /// M36: a staged lease of it was withdrawn for a job that went before it (M33): it
    /// never makes another staged job yield.
    yielded: bool,
    /// M36: how many of its staged leases were withdrawn (at most `MAX_WITHDRAWALS` for a
    /// seat elsewhere).
    withdrawn: u32,
}

/// The mill. See the module docs.
#[derive(Debug)]
pub struct Mill {
    config: MillConfig,
    now: Time,

    conns: BTreeMap<ConnId, Conn>,
    sessions: BTreeMap<NodeId, session::Session>,
    strikes: BTreeMap<NodeId, u32>,
    quarantined: BTreeSet<NodeId>,
    cursors: BTreeMap<(NodeId, Epoch), Seqno>,
    /// Per node, its idle epochs whose cursors are still kept, oldest retired first (M23,
    /// retention; at most `session::RETIRED_EPOCHS_KEPT` each).
    retired: BTreeMap<NodeId, VecDeque<Epoch>>,
    /// Leases whose terminal each (node, epoch) stream delivered (M22), bounded FIFO each.
    /// Kept per stream, not per connection, so a reconnect does not forget them.
    terminals: BTreeMap<(NodeId, Epoch), terminals::TerminalMemory>,

    /// Boxed: a `Job` is a few hundred bytes, and B-tree nodes shift their values on every
    /// insert and remove.
    jobs: BTreeMap<JobId, Box<Job>>,
    queue: BTreeSet<JobId>,
    /// Per owner with a job: its jobs and, in submit order, those of them queued (M33).
    owners: BTreeMap<Arc<str>, OwnerJobs>,
    /// M33's order: one entry per owner with a queued job, (its load — jobs bidding,
    /// waiting for quota or leased —, its first queued job's priority (highest first) and
    /// id, the owner). The first entry's job is the next to try.
    fair: BTreeSet<FairKey>,
    leases: BTreeMap<LeaseId, Lease>,
    node_leases: BTreeMap<NodeId, BTreeSet<LeaseId>>,
    /// Ask lease id → job, for asks of live bid rounds.
    asks: BTreeMap<LeaseId, JobId>,
    /// Asks whose round is over: an acceptance is released at once (M12).
    strays: BTreeMap<LeaseId, (NodeId, String)>,
    rank: RankIndex,
    /// M36: the staged lease of each node that holds one (at most one per node).
    staged: BTreeMap<NodeId, LeaseId>,
    /// M36: ready nodes with an engine whose seats the mill holds all of and no staged lease:
    /// where a queued job may be staged. Kept with the rank index.
    stage_slots: BTreeSet<NodeId>,
    /// Nodes whose rank-index entry is stale (see `flush_index`).
    index_dirty: BTreeSet<NodeId>,
    quota: QuotaLedger,
    /// Idempotency keys (M31).
    keys: keys::Keys,
    /// M32: leases whose attempt was retried behind a fence (their executor was lost, so
    /// the run may live on), with their node and job, until the job's next lease or end. A
    /// snapshot that still reports one is evidence the run lives: the fence holds while it
    /// does, whatever the clock says.
    fenced_runs: BTreeMap<LeaseId, (NodeId, JobId)>,

    next_job: JobId,
    next_lease: LeaseId,
    lease_floor: LeaseId,

    timers: TimerTable<Timer>,
    placement_dirty: bool,
    /// Bumped on every change that may let a waiting job be placed (M13).
    change_seq: u64,
    /// M34: counts every chance a node had to free resources, across nodes and sessions, so
    /// a session's `frees` mark never repeats, not even in a node's next session.
    free_seq: u64,
    writes: Vec<MillWrite>,
    /// Where this step's outputs begin in `out`: the step's `Persist` goes there, after the
    /// step's early asks and before every other output it emitted (persist before send), so
    /// outputs are moved once.
    step_start: usize,
    /// M12: asks at the front of this step's outputs, ahead of its `Persist`. An ask whose
    /// lease id an earlier step made durable (M30) depends on no write of this step: it
    /// promises nothing (a reservation the mill forgets is released by M8 or expires, E3),
    /// so it goes out while the step's writes are being made durable.
    early: usize,
    /// The lease floor at the start of the step: ids below it are durable (M30).
    floor_at_start: LeaseId,
    /// Connections this step told to release a seat: an ask to them stays behind the
    /// release, so it cannot find the seat still held.
    released_to: Vec<ConnId>,
    out: VecDeque<MillOutput>,
}

impl Mill {
    /// A mill with `config`, restored from `restored` if the driver loaded a store (M29).
    pub fn new(
        config: MillConfig,
        restored: Option<MillSnapshot>,
        now: Time,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let quota = QuotaLedger::new(config.quota.clone());
        let mut mill = Mill {
            config,
            now,
            conns: BTreeMap::new(),
            sessions: BTreeMap::new(),
            strikes: BTreeMap::new(),
            quarantined: BTreeSet::new(),
            cursors: BTreeMap::new(),
            retired: BTreeMap::new(),
            terminals: BTreeMap::new(),
            jobs: BTreeMap::new(),
            queue: BTreeSet::new(),
            owners: BTreeMap::new(),
            fair: BTreeSet::new(),
            leases: BTreeMap::new(),
            node_leases: BTreeMap::new(),
            asks: BTreeMap::new(),
            strays: BTreeMap::new(),
            rank: RankIndex::default(),
            staged: BTreeMap::new(),
            stage_slots: BTreeSet::new(),
            index_dirty: BTreeSet::new(),
            quota,
            keys: keys::Keys::default(),
            fenced_runs: BTreeMap::new(),
            next_job: JobId(1),
            next_lease: LeaseId(1),
            lease_floor: LeaseId(1),
            timers: TimerTable::default(),
            placement_dirty: false,
            change_seq: 0,
            free_seq: 0,
            writes: Vec::new(),
            step_start: 0,
            early: 0,
            floor_at_start: LeaseId(1),
            released_to: Vec::new(),
            out: VecDeque::new(),
        };
        if let Some(snapshot) = restored {
            mill.restore(snapshot);
        }
        mill.finish_step();
        Ok(mill)
    }

    /// Feeds one network or time input. Bad network input never fails here: it becomes a
    /// violation output instead. Client commands are methods with their own typed results
    /// ([`Mill::submit`], [`Mill::cancel`], [`Mill::lift_quarantine`]).
    pub fn handle(&mut self, now: Time, input: MillInput) {
        self.begin_step(now);
        match input {
            MillInput::Connected { conn } => self.on_connected(conn),
            MillInput::Message { conn, msg } => self.on_message(conn, msg),
            MillInput::Disconnected { conn } => self.on_disconnected(conn),
            MillInput::Tick => self.on_tick(),
        }
        self.finish_step();
    }

    /// A client submits a job (M10). `submitted_at_ms` is wall-clock time for people (ms
    /// since the Unix epoch), never used for deadlines. A refusal stores nothing and emits
    /// nothing; on success the outputs carry the durable insert, then the job's update.
    pub fn submit(
        &mut self,
        now: Time,
        spec: JobSpec,
        submitted_at_ms: u64,
    ) -> Result<JobId, RequestError> {
        self.submit_keyed(now, spec, submitted_at_ms, None)
            .map(|s| s.job)
    }

    /// [`Mill::submit`] with an idempotency key (M31): a key already used with the same
    /// spec answers its job and stores nothing (even when the queue is full: that job is
    /// already accepted); with a different spec it is refused with
    /// [`RequestError::KeyConflict`]. A new key is persisted in the job's insert batch.
    pub fn submit_keyed(
        &mut self,
        now: Time,
        spec: JobSpec,
        submitted_at_ms: u64,
        key: Option<IdempotencyKey>,
    ) -> Result<Submitted, RequestError> {
        self.begin_step(now);
        let result = self.enqueue_keyed(spec, submitted_at_ms, key);
        self.finish_step();
        result
    }

    /// Retention deleted these finished jobs from the store, with their idempotency keys in
    /// the same transaction (M31): the mill forgets the keys too, so a later submit under
    /// one of them makes a new job. Nothing is persisted (the store already holds the
    /// result); a job the mill still runs keeps its key.
    pub fn forget_keys_of(&mut self, jobs: &[JobId]) {
        for job in jobs {
            if !self.jobs.contains_key(job) {
                self.keys.forget_job(*job);
            }
        }
    }

    /// Every idempotency key the mill holds, in key order (M31; read-only, for audits).
    pub fn idempotency_keys(&self) -> impl Iterator<Item = (&IdempotencyKey, &KeyRecord)> + '_ {
        self.keys.iter()
    }

    /// How many idempotency keys the mill holds (`/metrics`).
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The job an idempotency key maps to, if the mill holds the key (M31).
    pub fn key_job(&self, key: &IdempotencyKey) -> Option<JobId> {
        self.keys.get(key).map(|r| r.job)
    }

    /// A client cancels a job (M26); `reason` is kept for the record.
    pub fn cancel(&mut self, now: Time, job: JobId, reason: String) -> Result<(), RequestError> {
        self.begin_step(now);
        let result = self.cancel_job(job, reason);
        self.finish_step();
        result
    }

    /// An operator lifts a node's quarantine (M28).
    pub fn lift_quarantine(&mut self, now: Time, node: NodeId) -> Result<(), RequestError> {
        self.begin_step(now);
        let result = self.lift(node);
        self.finish_step();
        result
    }

    fn begin_step(&mut self, now: Time) {
        self.now = self.now.max(now);
        self.step_start = self.out.len();
        self.early = 0;
        self.floor_at_start = self.lease_floor;
        self.released_to.clear();
        debug_assert!(self.writes.is_empty(), "a step began with unflushed writes");
    }

    /// The next output, in order. Drain until `None` after every `handle`.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<MillOutput> {
        self.out.pop_front()
    }

    /// When to call `handle(now, Tick)` next, if anything is scheduled.
    /// `None` exactly when nothing is pending: every timer belongs to something live.
    pub fn next_deadline(&self) -> Option<Time> {
        self.timers.next_deadline()
    }

    /// How many timers are set (one per live deadline: a job's timeout, a session's
    /// silence or grace, an ask, a commit, a cancel…). Read-only, for benches and tests.
    pub fn timer_count(&self) -> usize {
        self.timers.len()
    }

    /// The config in force.
    pub fn config(&self) -> &MillConfig {
        &self.config
    }

    /// A job's state, if it has not ended.
    pub fn job_state(&self, job: JobId) -> Option<JobState> {
        let j = self.jobs.get(&job)?;
        Some(match &j.phase {
            Phase::Queued | Phase::Bidding(_) | Phase::QuotaWait { .. } | Phase::Fenced { .. } => {
                JobState::Queued
            }
            Phase::Leased(lease) => {
                let l = self.leases.get(lease)?;
                match l.state {
                    LeaseState::Reserved => JobState::Reserved {
                        lease: *lease,
                        node: l.node.clone(),
                    },
                    LeaseState::Running => JobState::Running {
                        lease: *lease,
                        node: l.node.clone(),
                    },
                }
            }
        })
    }

    /// The spec of a job waiting in the queue with no bid going (no candidate took it up
    /// when it was last tried); `None` for any other job.
    pub fn queued_spec(&self, job: JobId) -> Option<&JobSpec> {
        let j = self.jobs.get(&job)?;
        matches!(j.phase, Phase::Queued).then_some(&j.spec)
    }

    /// Jobs waiting for placement (queued, bidding or waiting for quota) (M10).
    pub fn pending(&self) -> usize {
        self.jobs.len().saturating_sub(self.leases.len())
    }

    /// Read-only view of every lease: (lease, job, node, epoch, state, charge).
    pub fn leases(
        &self,
    ) -> impl Iterator<Item = (LeaseId, JobId, &NodeId, Epoch, LeaseState, &Resources)> + '_ {
        self.leases
            .iter()
            .map(|(id, l)| (*id, l.job, &l.node, l.epoch, l.state, &l.resources))
    }

    /// Whether `lease` is an ask of a live bid round (M12), read-only: the simulator checks
    /// that every seat an executor reserved is known to the mill.
    pub fn is_ask(&self, lease: LeaseId) -> bool {
        self.asks.contains_key(&lease)
    }

    /// Whether `lease` was published directly (M35) and its `ReserveSeat{direct}` is still
    /// unanswered, read-only: the simulator judges a `ReserveResult` for it like an open
    /// ask's.
    pub fn is_direct_ask(&self, lease: LeaseId) -> bool {
        self.leases.get(&lease).is_some_and(|l| l.direct_answer_due)
    }

    /// The node of `lease` if it is a stray: an ask whose round is over, whose acceptance is
    /// released when it comes or when its deadline passes (M12), read-only.
    pub fn stray(&self, lease: LeaseId) -> Option<&NodeId> {
        self.strays.get(&lease).map(|(node, _)| node)
    }

    /// The node of `lease` if the mill holds it (reserved or running), read-only.
    pub fn lease_node(&self, lease: LeaseId) -> Option<&NodeId> {
        self.leases.get(&lease).map(|l| &l.node)
    }

    /// The quota ledger, read-only (I5).
    pub fn quota(&self) -> &QuotaLedger {
        &self.quota
    }

    /// Quarantined nodes (I8).
    pub fn quarantined(&self) -> &BTreeSet<NodeId> {
        &self.quarantined
    }

    /// The applied cursor of (node, epoch) (I4).
    pub fn cursor(&self, node: &NodeId, epoch: Epoch) -> Seqno {
        self.cursors
            .get(&(node.clone(), epoch))
            .copied()
            .unwrap_or_default()
    }

    /// Nodes with a session (connected or in grace), with whether each is connected.
    pub fn sessions(&self) -> impl Iterator<Item = (&NodeId, bool)> + '_ {
        self.sessions.iter().map(|(n, s)| (n, s.conn.is_some()))
    }

    // ---- the output discipline --------------------------------------------------------------

    /// Records a durable write for this step.
    fn persist(&mut self, write: MillWrite) {
        self.writes.push(write);
    }

    /// Queues an output that must follow this step's writes.
    fn emit(&mut self, output: MillOutput) {
        self.out.push_back(output);
    }

    fn send(&mut self, conn: ConnId, msg: ToExecutor) {
        self.emit(MillOutput::Send { conn, msg });
    }

    /// Tells `conn` to drop the reservation of `lease` (E8); asks to it later in the step
    /// stay behind this.
    fn send_release(&mut self, conn: ConnId, lease: LeaseId) {
        if !self.released_to.contains(&conn) {
            self.released_to.push(conn);
        }
        let term = self.config.term;
        self.send(conn, ToExecutor::ReleaseLease { term, lease });
    }

    /// M12: sends an ask ahead of the step's `Persist` when it depends on none of the step's
    /// writes — its lease id was durable before the step (M30) and no release to the same
    /// connection precedes it in the step — else in order like any send.
    fn send_ask(&mut self, conn: ConnId, lease: LeaseId, msg: ToExecutor) {
        if lease < self.floor_at_start && !self.released_to.contains(&conn) {
            self.out
                .insert(self.step_start + self.early, MillOutput::Send { conn, msg });
            self.early += 1;
        } else {
            self.send(conn, msg);
        }
    }

    fn observe(&mut self, o: Observation) {
        self.emit(MillOutput::Observed(o));
    }

    /// Sets `timer` to fire at `at`, replacing the deadline it had.
    fn arm(&mut self, at: Time, timer: Timer) {
        self.timers.set(timer, at);
    }

    /// Stops `timer`: what it watched has ended or no longer needs it.
    fn disarm(&mut self, timer: &Timer) {
        self.timers.stop(timer);
    }

    /// Forgets a connection and its handshake deadline.
    fn drop_conn(&mut self, conn: ConnId) -> Option<Conn> {
        self.disarm(&Timer::Handshake(conn));
        self.conns.remove(&conn)
    }

    /// Ends a step: runs placement if anything changed, then emits one `Persist` with every
    /// write of the step followed by everything that depends on it (persist before send).
    fn finish_step(&mut self) {
        // A pass may wake placement again (a quota release grants waiters); it ends because
        // grants are finite and a job re-queued by a pass waits for the next change.
        while self.placement_dirty {
            self.placement_dirty = false;
            self.place_pending();
        }
        self.flush_index();
        if !self.writes.is_empty() {
            let writes = std::mem::take(&mut self.writes);
            // Usually at the front (the driver drained the last step), where a deque
            // inserts without moving anything; behind the step's early asks (M12).
            self.out.insert(
                self.step_start + self.early,
                MillOutput::Persist(MillBatch { writes }),
            );
        }
        self.debug_check_timers();
    }

    fn wake_placement(&mut self) {
        self.placement_dirty = true;
        self.change_seq += 1;
    }

    fn on_tick(&mut self) {
        while let Some((at, timer)) = self.timers.pop_due(self.now) {
            self.fire(at, timer);
        }
    }

    fn fire(&mut self, at: Time, timer: Timer) {
        match timer {
            Timer::Handshake(conn) => self.handshake_expired(conn),
            Timer::Silence(node) => self.silence_check(node),
            Timer::Grace(node) => self.grace_check(node, at),
            Timer::Ask(lease) => self.ask_expired(lease, at),
            Timer::Stray(lease) => self.stray_expired(lease),
            Timer::Commit(lease) => self.commit_check(lease, at),
            Timer::CancelAck(node, lease) => self.cancel_ack_expired(node, lease, at),
            Timer::Teardown(lease) => self.teardown_expired(lease, at),
            Timer::JobTimeout(job) => self.job_timed_out(job, at),
            Timer::QueueTimeout(job) => self.queue_timed_out(job, at),
            Timer::RetryFence(job) => self.fence_over(job, at),
        }
    }

    // ---- jobs ---------------------------------------------------------------------------------

    fn enqueue_keyed(
        &mut self,
        spec: JobSpec,
        submitted_at_ms: u64,
        key: Option<IdempotencyKey>,
    ) -> Result<Submitted, RequestError> {
        spec.validate()?;
        let Some(key) = key else {
            let job = self.enqueue(spec, submitted_at_ms)?;
            return Ok(Submitted { job, created: true });
        };
        let fingerprint = spec.fingerprint();
        if let Some(existing) = self.keys.get(&key) {
            return if existing.fingerprint == fingerprint {
                Ok(Submitted {
                    job: existing.job,
                    created: false,
                })
            } else {
                Err(RequestError::KeyConflict {
                    job: existing.job,
                    key,
                })
            };
        }
        let job = self.enqueue(spec, submitted_at_ms)?;
        let record = KeyRecord { fingerprint, job };
        // After the job's insert, in the same batch (M31, M29).
        self.persist(MillWrite::KeyInsert {
            key: key.clone(),
            record,
        });
        self.keys.insert(key, record);
        Ok(Submitted { job, created: true })
    }

    fn enqueue(&mut self, spec: JobSpec, submitted_at_ms: u64) -> Result<JobId, RequestError> {
        spec.validate()?;
        let pending = self.pending();
        if pending >= self.config.max_pending {
            return Err(RequestError::TooManyPending {
                pending,
                max: self.config.max_pending,
            });
        }
        let id = self.next_job;
        self.next_job = JobId(id.0 + 1);
        self.persist(MillWrite::Counters {
            next_job: self.next_job,
            lease_floor: self.lease_floor,
        });
        self.persist(MillWrite::JobInsert {
            job: id,
            record: Box::new(JobRecord {
                spec: spec.clone(),
                submitted_at_ms,
                state: JobState::Queued,
            }),
        });
        let deadline = self
            .now
            .plus(spec.timeout.unwrap_or(self.config.job_timeout));
        self.arm(deadline, Timer::JobTimeout(id));
        let queue_deadline = self.arm_queue_timeout(id, deadline);
        self.jobs.insert(
            id,
            Box::new(Job {
                spec,
                queued_at: self.now,
                deadline,
                queue_deadline,
                phase: Phase::Queued,
                quota_held: None,
                persisted_beyond_queued: false,
                waits_for_change: None,
                incompatible: BTreeMap::new(),
                refused: BTreeMap::new(),
                attempt: 0,
                retried: 0,
                direct_tried: false,
                yielded: false,
                withdrawn: 0,
                fenced_run: None,
            }),
        );
        self.owner_job_added(id);
        self.queue_insert(id);
        self.emit(MillOutput::JobUpdate {
            job: id,
            state: JobState::Queued,
        });
        self.wake_placement();
        Ok(id)
    }

    /// Records a job's end (I2: once, never changed) and forgets it. The job must hold no
    /// lease; quota waits and volatile holds are dropped.
    fn finish_job(&mut self, job: JobId, terminal: Terminal) {
        self.end_job(job, terminal, true);
    }

    /// [`Mill::finish_job`]; `release_quota` is false only when the caller has just released
    /// the job's quota itself (then the job neither holds nor waits, and a second release
    /// would only look that up again).
    fn end_job(&mut self, job: JobId, terminal: Terminal, release_quota: bool) {
        let Some(j) = self.jobs.remove(&job) else {
            return;
        };
        self.disarm(&Timer::JobTimeout(job));
        self.disarm(&Timer::QueueTimeout(job));
        self.disarm(&Timer::RetryFence(job));
        if let Some(lease) = j.fenced_run {
            self.fenced_runs.remove(&lease);
        }
        let owner = j.spec.identity.owner.as_str();
        self.fair_out(owner);
        if let Some(o) = self.owners.get_mut(owner) {
            o.queued.remove(&QueueKey::of(job, &j.spec));
            o.jobs = o.jobs.saturating_sub(1);
            if o.jobs == 0 {
                self.owners.remove(owner);
            }
        }
        self.fair_in(owner);
        self.queue.remove(&job);
        if let Phase::Bidding(round) = j.phase {
            self.abandon_round(round);
        }
        // A quota wait or a hold granted for a re-bid is volatile; a published lease's hold
        // is released by `end_lease`.
        if release_quota {
            self.release_quota(job, false);
        }
        let state = JobState::Done(terminal);
        self.persist(MillWrite::JobState {
            job,
            state: state.clone(),
        });
        self.emit(MillOutput::JobUpdate { job, state });
    }

    /// Arms the queue timeout of a job not yet leased, when it comes before its job timeout
    /// (M18 ends it first otherwise); returns the deadline.
    fn arm_queue_timeout(&mut self, job: JobId, deadline: Time) -> Option<Time> {
        let at = self.now.plus(self.config.queue_timeout);
        if at >= deadline {
            return None;
        }
        self.arm(at, Timer::QueueTimeout(job));
        Some(at)
    }

    /// A job's first lease is published: it no longer waits for placement.
    fn placed(&mut self, job: JobId) {
        if let Some(j) = self.jobs.get_mut(&job) {
            if j.queue_deadline.take().is_some() {
                self.disarm(&Timer::QueueTimeout(job));
            }
        }
    }

    /// The queue timeout of a job no lease took: it ends Failed, saying why no executor
    /// took it.
    fn queue_timed_out(&mut self, job: JobId, fired: Time) {
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        if j.queue_deadline != Some(fired) {
            return;
        }
        debug_assert!(
            !matches!(j.phase, Phase::Leased(_)),
            "{job}: a leased job keeps no queue deadline"
        );
        let why = format!(
            "not placed within queue_timeout {:?}: {}",
            self.config.queue_timeout,
            self.why_waiting(job, &j.spec, &j.phase)
        );
        self.finish_job(
            job,
            Terminal::by_mill(
                crate::job::TerminalStatus::Failed,
                crate::job::TerminalCause::QueueTimeout,
                why,
            ),
        );
    }

    /// Why no executor has taken a waiting job of `spec`, from the sessions the mill holds.
    fn why_waiting(&self, job: JobId, spec: &JobSpec, phase: &Phase) -> String {
        if let Phase::QuotaWait { .. } = phase {
            // M15, Q2: which scope and resource holds it up.
            return match self.quota.blocked(job) {
                Some(blocked) => format!("waiting for quota: {blocked}"),
                None => format!("waiting for quota of owner {}", spec.identity.owner),
            };
        }
        if let Phase::Fenced { until } = phase {
            return format!(
                "retrying: waiting {:?} more for the lost executor's run to be surely stopped (M32)",
                until.since(self.now)
            );
        }
        let live: Vec<_> = self
            .sessions
            .iter()
            .filter(|(node, _)| !self.quarantined.contains(*node))
            .map(|(_, s)| s)
            .collect();
        if live.is_empty() {
            return "no executor is connected".to_string();
        }
        let with_engine: Vec<_> = live
            .iter()
            .filter(|s| s.engines.contains(&spec.engine))
            .collect();
        if with_engine.is_empty() {
            return format!("no executor offers engine {}", spec.engine);
        }
        if !with_engine
            .iter()
            .any(|s| spec.labels.iter().all(|l| s.labels.contains(l)))
        {
            let wanted: Vec<&str> = spec.labels.iter().map(String::as_str).collect();
            return format!(
                "no executor with engine {} holds the labels {}",
                spec.engine,
                wanted.join(", ")
            );
        }
        "no executor that can run it had a free seat".to_string()
    }

    /// Puts a job back in the queue (nothing ran, or it will be placed again).
    fn requeue(&mut self, job: JobId) {
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        j.phase = Phase::Queued;
        j.queued_at = self.now;
        let persist = std::mem::replace(&mut j.persisted_beyond_queued, false);
        self.queue_insert(job);
        if persist {
            self.persist(MillWrite::JobState {
                job,
                state: JobState::Queued,
            });
            self.emit(MillOutput::JobUpdate {
                job,
                state: JobState::Queued,
            });
        }
        // Not a change of the fleet: only this job needs a placement pass.
        self.placement_dirty = true;
    }

    /// Releases a job's quota (Q3, idempotent) and turns grants into re-bids (Q2, M15).
    fn release_quota(&mut self, job: JobId, durable: bool) {
        let (held, granted) = self.quota.release_reporting(job);
        if held && durable {
            self.persist(MillWrite::QuotaRelease { job });
        }
        for g in granted {
            self.quota_granted(g);
        }
    }

    /// Ends a lease: deletes it, releases its quota, and records `terminal` for its job if
    /// given (else the job is re-queued).
    fn end_lease(&mut self, lease: LeaseId, terminal: Option<Terminal>) {
        let Some(l) = self.leases.remove(&lease) else {
            return;
        };
        self.disarm(&Timer::Commit(lease));
        self.disarm(&Timer::Teardown(lease));
        if l.staged {
            self.unstage(&l.node, lease);
        }
        if let Some(set) = self.node_leases.get_mut(&l.node) {
            set.remove(&lease);
            if set.is_empty() {
                self.node_leases.remove(&l.node);
            }
        }
        self.job_seat_released(&l.node, l.job);
        self.persist(MillWrite::LeaseDelete { lease });
        // The last lease of an old epoch ending lets its stream be forgotten (M23), after
        // the lease's own delete in the batch.
        if self
            .sessions
            .get(&l.node)
            .is_some_and(|s| s.greeted && s.epoch != l.epoch)
        {
            self.forget_old_epochs(&l.node);
        }
        self.withdraw_commit(lease);
        self.release_quota(l.job, true);
        let Some(t) = terminal else {
            self.persist_attempt(&l, lease, None, AttemptOutcome::Released);
            self.requeue(l.job);
            self.wake_placement();
            return;
        };
        match self.retry_fence(&l, &t) {
            Some(fence) => {
                let fenced = !fence.is_zero();
                self.persist_attempt(&l, lease, Some(&t), AttemptOutcome::Retried { fenced });
                if fenced {
                    if let Some(j) = self.jobs.get_mut(&l.job) {
                        if let Some(old) = j.fenced_run.replace(lease) {
                            self.fenced_runs.remove(&old);
                        }
                        self.fenced_runs.insert(lease, (l.node.clone(), l.job));
                    }
                }
                self.retry(l.job, &t, fence);
            }
            None => {
                self.persist_attempt(&l, lease, Some(&t), AttemptOutcome::Final);
                // The release above left the job neither holding nor waiting (Q3).
                self.end_job(l.job, t, false);
            }
        }
        self.wake_placement();
    }

    /// M32: whether the attempt `l` ended with `t` is retried, and if so how long the next
    /// attempt waits. An end the executor reported (the run is over, self-fencing included)
    /// or a snapshot that no longer holds the job (the executor does not run it) waits
    /// nothing. An executor the mill gave up on (grace expiry, a replaced store, quarantine)
    /// may still run the job: it stops it once it has heard nothing from the mill for
    /// `reconnect_grace` (E12), and it may have heard the mill up to now (a `Welcome` of a
    /// recovery that did not complete, acks while M6 extended the grace), so the next
    /// attempt waits that whole bound plus `retry_fence` for the stop itself.
    fn retry_fence(&self, l: &Lease, t: &Terminal) -> Option<Duration> {
        use crate::job::TerminalCause;
        let j = self.jobs.get(&l.job)?;
        if j.retried >= j.spec.retry.retries || !j.spec.retry.retries_on(t.status, t.cause) {
            return None;
        }
        // A job being cancelled or past its timeout (M26, M18) is never run again, even
        // when its engine's own failure beat the cancel.
        if l.cancel.is_some() || j.deadline <= self.now {
            return None;
        }
        Some(match t.cause {
            Some(
                TerminalCause::ExecutorLost
                | TerminalCause::ExecutorReplaced
                | TerminalCause::Quarantined,
            ) => self
                .config
                .reconnect_grace
                .saturating_add(self.config.retry_fence),
            _ => Duration::ZERO,
        })
    }

    /// Records how attempt `l` (under `lease`) ended (M32).
    fn persist_attempt(
        &mut self,
        l: &Lease,
        lease: LeaseId,
        t: Option<&Terminal>,
        outcome: AttemptOutcome,
    ) {
        self.persist(MillWrite::Attempt(Box::new(AttemptEnd {
            job: l.job,
            attempt: l.attempt,
            lease,
            node: l.node.clone(),
            status: t.map(|t| t.status),
            cause: t.and_then(|t| t.cause),
            exit_code: t.and_then(|t| t.exit_code),
            error: t.and_then(|t| t.error.clone()),
            outcome,
        })));
    }

    /// M32: the job's attempt ended with `t` and its policy retries it: it is queued again
    /// (durably, so a restart keeps the attempt count), at once or after `fence`.
    fn retry(&mut self, job: JobId, t: &Terminal, fence: Duration) {
        let until = self.now.plus(fence);
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        j.retried = j.retried.saturating_add(1);
        debug_assert!(
            j.retried <= j.spec.retry.retries,
            "M32: {job} retried {} times, its policy allows {}",
            j.retried,
            j.spec.retry.retries
        );
        let attempt = j.attempt;
        if !fence.is_zero() {
            j.phase = Phase::Fenced { until };
            j.persisted_beyond_queued = false;
        }
        self.observe(Observation::Retried {
            job,
            attempt,
            cause: t.cause,
            fenced: !fence.is_zero(),
        });
        if fence.is_zero() {
            self.requeue(job);
            return;
        }
        self.persist(MillWrite::JobState {
            job,
            state: JobState::Queued,
        });
        self.emit(MillOutput::JobUpdate {
            job,
            state: JobState::Queued,
        });
        self.arm(until, Timer::RetryFence(job));
    }

    /// M32: `node`'s snapshot reports `active`; a fenced run among them still lives, so its
    /// job's next attempt waits `retry_fence` past this report (the executor reports every
    /// `snapshot_interval`, well within it, while the run lasts). A job whose next attempt
    /// already waits in the queue is taken back out; one already bidding or leased is past
    /// help (the fence was the promise, and it has been kept by the clock).
    pub(super) fn fenced_runs_alive(&mut self, node: &NodeId, active: &[LeaseId]) {
        for lease in active {
            let Some((on, job)) = self.fenced_runs.get(lease) else {
                continue;
            };
            if on != node {
                continue;
            }
            let job = *job;
            let until = self.now.plus(self.config.retry_fence);
            let Some(j) = self.jobs.get_mut(&job) else {
                continue;
            };
            match j.phase {
                Phase::Fenced { until: old } if old >= until => continue,
                Phase::Fenced { .. } => {}
                Phase::Queued => {}
                Phase::Bidding(_) | Phase::QuotaWait { .. } | Phase::Leased(_) => continue,
            }
            j.phase = Phase::Fenced { until };
            self.queue_remove(job);
            self.disarm(&Timer::RetryFence(job));
            self.arm(until, Timer::RetryFence(job));
            self.observe(Observation::Rare(RarePath::FencedRunReported));
        }
    }

    /// The fence of a retry is over: the job is placed again (M32).
    fn fence_over(&mut self, job: JobId, fired: Time) {
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        if !matches!(j.phase, Phase::Fenced { until } if until == fired) {
            return;
        }
        self.requeue(job);
        self.wake_placement();
    }

    /// M16: a `CommitLease` queued in this step has not gone out yet (a step's outputs follow
    /// its `Persist`), so a lease ended in the step that published it is never committed. A
    /// late `Tick` (I12) fires a bid's end and the job's timeout (or its node's grace) together;
    /// without this, the commit of a lease whose deletion is in the same batch would start a
    /// job the mill has already ended. A commit that went out in an earlier step is not
    /// affected: the caller stops that one with a cancel (M26).
    fn withdraw_commit(&mut self, lease: LeaseId) {
        let mut k = self.step_start;
        while k < self.out.len() {
            let queued = matches!(
                &self.out[k],
                MillOutput::Send {
                    msg: ToExecutor::CommitLease { lease: l, .. },
                    ..
                } if *l == lease
            );
            if queued {
                self.out.remove(k);
            } else {
                k += 1;
            }
        }
    }

    fn add_lease(&mut self, id: LeaseId, lease: Lease) {
        // I1: a job is leased under one lease at a time; its phase names it.
        debug_assert!(
            self.jobs.get(&lease.job).is_none_or(|j| !matches!(
                j.phase,
                Phase::Leased(other) if other != id && self.leases.contains_key(&other)
            )),
            "I1: {} gets {id} while it holds another lease",
            lease.job
        );
        self.node_leases
            .entry(lease.node.clone())
            .or_default()
            .insert(id);
        self.leases.insert(id, lease);
    }

    /// `job`, just put in `jobs`, counts for its owner (M33).
    fn owner_job_added(&mut self, job: JobId) {
        let Some(owner) = self.jobs.get(&job).map(|j| j.spec.identity.owner.clone()) else {
            return;
        };
        self.fair_out(&owner);
        match self.owners.get_mut(owner.as_str()) {
            Some(o) => o.jobs += 1,
            None => {
                self.owners.insert(
                    Arc::from(owner.as_str()),
                    OwnerJobs {
                        jobs: 1,
                        queued: BTreeSet::new(),
                    },
                );
            }
        }
        self.fair_in(&owner);
    }

    /// Takes `owner`'s entry out of M33's order (before its counts change).
    fn fair_out(&mut self, owner: &str) {
        if let Some((name, o)) = self.owners.get_key_value(owner) {
            if let Some(first) = o.queued.first() {
                self.fair.remove(&first.fair(o.load(), name));
            }
        }
    }

    /// Puts `owner`'s entry back in M33's order (after its counts changed).
    fn fair_in(&mut self, owner: &str) {
        if let Some((name, o)) = self.owners.get_key_value(owner) {
            if let Some(first) = o.queued.first() {
                self.fair.insert(first.fair(o.load(), name));
            }
        }
    }

    /// Puts `job` in the queue and in its owner's queue (M33).
    fn queue_insert(&mut self, job: JobId) {
        if !self.queue.insert(job) {
            return;
        }
        self.owner_queue(job, true);
    }

    /// Takes `job` out of the queue and its owner's queue (M33).
    fn queue_remove(&mut self, job: JobId) {
        if self.queue.remove(&job) {
            self.owner_queue(job, false);
        }
    }

    fn owner_queue(&mut self, job: JobId, queued: bool) {
        let Some((owner, key)) = self
            .jobs
            .get(&job)
            .map(|j| (j.spec.identity.owner.clone(), QueueKey::of(job, &j.spec)))
        else {
            return;
        };
        self.fair_out(&owner);
        if let Some(o) = self.owners.get_mut(owner.as_str()) {
            if queued {
                o.queued.insert(key);
            } else {
                o.queued.remove(&key);
            }
        }
        self.fair_in(&owner);
    }

    fn lease_record(&self, id: LeaseId) -> Option<LeaseRecord> {
        let l = self.leases.get(&id)?;
        Some(LeaseRecord {
            lease: id,
            job: l.job,
            node: l.node.clone(),
            epoch: l.epoch,
            resources: l.resources.clone(),
            state: l.state,
            cancel: l.cancel.as_ref().map(LeaseCancel::record),
            attempt: l.attempt,
        })
    }

    /// A fresh lease id, persisted (in blocks) before it can be sent (M30).
    fn alloc_lease(&mut self) -> LeaseId {
        let id = self.next_lease;
        self.next_lease = LeaseId(id.0 + 1);
        if self.next_lease > self.lease_floor {
            self.lease_floor = LeaseId(id.0 + LEASE_BLOCK);
            self.persist(MillWrite::Counters {
                next_job: self.next_job,
                lease_floor: self.lease_floor,
            });
        }
        id
    }
}

/// Compares secrets in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    // `subtle` (issue 18 item 3): the time depends on the lengths, never on the bytes.
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

fn reason(s: impl Into<String>) -> String {
    crate::types::bounded_reason(s, MAX_REASON)
}

/// One owner's jobs, for M33.
#[derive(Debug, Default)]
struct OwnerJobs {
    /// Its jobs the mill holds (not ended).
    jobs: usize,
    /// Those of them queued, highest priority first, then in submit order.
    queued: BTreeSet<QueueKey>,
}

/// A queued job's place in its owner's queue (M33): higher priority first, then submit
/// order. A job's priority never changes, so the key can be rebuilt from its spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct QueueKey {
    priority: std::cmp::Reverse<i32>,
    pub(super) job: JobId,
}

impl QueueKey {
    pub(super) fn of(job: JobId, spec: &JobSpec) -> QueueKey {
        QueueKey {
            priority: std::cmp::Reverse(spec.priority),
            job,
        }
    }

    /// The owner's entry in M33's order when this is its first queued job.
    pub(super) fn fair(self, load: usize, owner: &Arc<str>) -> FairKey {
        (load, self, owner.clone())
    }
}

/// M33's order between owners: fewest jobs bidding, waiting for quota or leased, then the
/// first queued job's priority and submit order.
pub(super) type FairKey = (usize, QueueKey, Arc<str>);

impl OwnerJobs {
    /// Its jobs bidding, waiting for quota or leased: what M33 ranks owners by.
    fn load(&self) -> usize {
        self.jobs.saturating_sub(self.queued.len())
    }
}
