//! The wire protocol between executors and the mill (DESIGN §3).
//!
//! Every message is a variant of [`ToMill`] or [`ToExecutor`]; frames are a u32 big-endian
//! length and a postcard body (see [`crate::codec`]). The protocol version travels in `Hello`.
//! Fields that come from an untrusted peer and need validation with a reason (the node id in
//! `Hello`) are carried raw and validated by the receiver.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::job::{JobSpec, LogRef, TerminalStatus};
use crate::types::{Epoch, JobId, LeaseId, Resources, Seqno, Term};

/// The protocol version this build speaks. 2: a terminal event carries its [`EndCause`].
/// 3: `Welcome` carries the mill's [`SessionTimers`] (M1, M9, E12: the timers of a session
/// agree by construction). 4: `LiveLog` carries the offset of its first byte in the lease's
/// output (E15: a reader sees bytes that never arrived as a gap, never as continuity).
/// 5: a job spec carries its retry policy, priority and pinned node (M32–M34), and `Hello`
/// the executor's stop grace (M32: how long a fenced run may take to stop).
/// 6: `ReserveSeat` says whether it is `direct` (M35: its commit follows without waiting for
/// the answer, so the seat must charge the standard charge, E2).
/// 7: term fencing (E13, DESIGN §10): `Welcome` and every command carry the mill's [`Term`],
/// `Hello` the highest term the executor has seen, an executor answers a lower one with
/// `Stale`, and `Refused` may name the leader's address.
/// 8: late binding (M36, E16): a `direct` ask that finds every seat taken may wait for the
/// next free one; its commit is answered when it starts (committed) or is released (not).
pub const PROTOCOL_VERSION: u32 = 8;

/// Most engines an executor may advertise.
pub const MAX_ENGINES: usize = 16;
/// Most labels an executor may advertise.
pub const MAX_NODE_LABELS: usize = 64;
/// Most load entries per engine in a snapshot.
pub const MAX_LOAD_ENTRIES: usize = 32;
/// Most active leases one snapshot may report.
pub const MAX_ACTIVE_LEASES: usize = 4096;
/// Most events in one batch.
pub const MAX_BATCH_EVENTS: usize = 1024;
/// Longest reason or error text carried on the wire.
pub const MAX_REASON: usize = 4096;
/// Longest token.
pub const MAX_TOKEN: usize = 1024;

/// What an executor offers for one engine, in a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineStatus {
    /// A seat is free right now.
    pub available: bool,
    /// Seats in all.
    pub capacity: u32,
    /// Load per resource, each in 0..=1.
    pub load: BTreeMap<String, f64>,
}

/// Why an executor turned a seat down (E2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RejectKind {
    /// Busy now; may fit later.
    Transient,
    /// Can never run this job (engine, spec).
    Incompatible,
}

/// One sequenced event from an executor's outbox (E5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Position in the (node, epoch) stream.
    pub seqno: Seqno,
    /// The lease it is about.
    pub lease: LeaseId,
    /// What happened.
    pub kind: EventKind,
}

/// What an event reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// The engine started the job.
    Running,
    /// The job ended on the executor.
    Terminal {
        /// How it ended.
        status: TerminalStatus,
        /// The exit code, if a process ran.
        exit_code: Option<i32>,
        /// Why it failed, if it did.
        error: Option<String>,
        /// The log, if one was kept.
        log: Option<LogRef>,
        /// Who ended it, as data; `error` is the text for people.
        cause: EndCause,
    },
}

/// Who ended a job on the executor, as the executor reports it in its terminal event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EndCause {
    /// The engine's own result: the job ran out, failed to start, or exited.
    Engine,
    /// A stop the mill asked for (E7); the status is Cancelled.
    Cancelled,
    /// The job's process died with the executor (E9): Failed "executor restarted".
    Restarted,
    /// Self-fencing stopped it (E12): Failed "executor lost contact with the mill".
    LostContact,
}

/// Executor → mill.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToMill {
    /// First message of every session (M1).
    Hello {
        /// Must equal [`PROTOCOL_VERSION`].
        protocol_version: u32,
        /// Raw; validated by the mill (M1).
        node_id: String,
        /// The executor's store id (E1).
        epoch: Epoch,
        /// Shared secret.
        token: String,
        /// Labels this executor holds.
        labels: Vec<String>,
        /// Engines it runs.
        engines: Vec<String>,
        /// How long the executor gives a job between the polite stop and the kill: the mill
        /// refuses an executor whose stop grace exceeds its `retry_fence` (M32), since a
        /// retry after a lost executor waits only that long for the fenced run to be gone.
        /// Milliseconds, as a `u32` so that `Hello` stays no larger than other messages.
        stop_grace_ms: u32,
        /// The highest mill term this executor has seen (E13; 0 for none). A mill whose own
        /// term is lower has been deposed: it refuses the executor and learns that it must
        /// step down.
        term: Term,
    },
    /// Capacity and the leases the executor holds (reserved or running).
    Snapshot {
        /// Strictly increasing within a session (M7).
        seqno: u64,
        /// Per engine.
        engines: BTreeMap<String, EngineStatus>,
        /// Every lease the executor holds, reserved or running. At most the executor's
        /// seats, so never more than [`MAX_ACTIVE_LEASES`]; never truncated.
        active_leases: Vec<LeaseId>,
        /// The last seqno this executor has assigned in its epoch (0: none). The mill judges
        /// (M8) a lease the snapshot does not report only once it has applied every event
        /// up to here, so a result still in flight is never mistaken for a lost job.
        outbox_high: Seqno,
    },
    /// Answer to `ReserveSeat`.
    ReserveResult {
        /// The lease asked about.
        lease: LeaseId,
        /// Whether a seat is held now.
        accepted: bool,
        /// Why not, when not accepted.
        reject: Option<RejectKind>,
        /// Human-readable reason.
        reason: String,
        /// What the executor charges, when accepted (M14).
        resources: Resources,
    },
    /// Answer to `CommitLease`.
    CommitResult {
        /// The lease.
        lease: LeaseId,
        /// True when the job runs (or already ran) under it.
        committed: bool,
    },
    /// Sequenced events (E5).
    EventBatch {
        /// Must equal the session's epoch (M19).
        epoch: Epoch,
        /// In seqno order.
        events: Vec<Event>,
    },
    /// Answer to `CancelAttempt` (E7).
    CancelAck {
        /// The lease.
        lease: LeaseId,
    },
    /// A message carried a term below the highest this executor has seen (E13): it was
    /// not acted on, and the executor closes the connection after this.
    Stale {
        /// The highest term the executor has seen.
        term: Term,
    },
    /// Best-effort log bytes, not sequenced (E15). Chunks may be missing; `offset` says
    /// where each one sits, so the mill counts what it never got instead of splicing.
    LiveLog {
        /// The lease.
        lease: LeaseId,
        /// Position of the first byte in the lease's output (its log file on the executor).
        /// An empty chunk marks the end of the output (sent when the job ends).
        offset: u64,
        /// Raw bytes.
        bytes: Vec<u8>,
    },
}

impl ToMill {
    /// An executor's acceptance of the ask `lease`, charging `resources` (E2, M14).
    pub fn accepted(lease: LeaseId, resources: Resources) -> Self {
        ToMill::ReserveResult {
            lease,
            accepted: true,
            reject: None,
            reason: String::new(),
            resources,
        }
    }

    /// An executor's refusal of the ask `lease` (E2); `reason` must already be bounded.
    pub fn rejected(lease: LeaseId, kind: RejectKind, reason: String) -> Self {
        ToMill::ReserveResult {
            lease,
            accepted: false,
            reject: Some(kind),
            reason,
            resources: Resources::new(),
        }
    }
}

/// The timers both ends of a session must agree on. The mill sends its own in `Welcome` and
/// the executor runs on them from then on: an executor that self-fenced later than the mill
/// fails its leases (E12 against M5) could run a job the mill has already placed elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionTimers {
    /// The mill closes a session silent this long (M9); the executor closes a connection on
    /// which the mill was silent this long.
    pub silence_timeout: Duration,
    /// The executor snapshots at least this often (M9, E10); below `silence_timeout / 2`.
    pub snapshot_interval: Duration,
    /// The mill fails a gone executor's leases after this (M5); the executor self-fences
    /// after hearing nothing from the mill for this long (E12); above `silence_timeout`.
    pub reconnect_grace: Duration,
}

impl SessionTimers {
    /// Why these timers cannot run a session, if they cannot: the bounds `MillConfig` and
    /// `ExecutorConfig` both check, named as the flags.
    pub fn problem(&self) -> Option<String> {
        let SessionTimers {
            silence_timeout: silence,
            snapshot_interval: interval,
            reconnect_grace: grace,
        } = *self;
        if interval.is_zero() {
            return Some("--snapshot-interval must be above zero".to_string());
        }
        if interval.saturating_mul(2) >= silence {
            return Some(format!(
                "--snapshot-interval {interval:?} must be below half of --silence-timeout {silence:?}"
            ));
        }
        if grace <= silence {
            return Some(format!(
                "--reconnect-grace {grace:?} must be above --silence-timeout {silence:?}"
            ));
        }
        None
    }
}

/// Mill → executor. Every variant but `Refused` carries the sending mill's [`Term`] (E13).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToExecutor {
    /// Session accepted; `cursor` is the last applied seqno for (node, epoch).
    Welcome {
        /// Last seqno the mill applied.
        cursor: Seqno,
        /// The mill's session timers; the executor adopts them (M1, E12).
        timers: SessionTimers,
        /// The mill's term (E13).
        term: Term,
    },
    /// Session refused; the connection closes.
    Refused {
        /// Why.
        reason: String,
        /// Where the leading mill listens, when the refusing mill is a standby (DESIGN §10).
        /// The executor follows it only if it is one of the addresses it was configured
        /// with, so a mill cannot send executors anywhere else.
        leader: Option<String>,
    },
    /// A bid: hold a seat for this job (M12).
    ReserveSeat {
        /// The mill's term (E13).
        term: Term,
        /// Fresh for every ask.
        lease: LeaseId,
        /// The job.
        job: JobId,
        /// What to run. Boxed: with its `env` a spec is the largest field of any message,
        /// and every message in flight (and every queued output) is as large as the largest
        /// variant. Serialized exactly as an unboxed spec, so the wire is unchanged by it.
        spec: Box<JobSpec>,
        /// Drop the seat if not committed within this (E3).
        ttl: Duration,
        /// M35: the `CommitLease` follows without waiting for the answer. Accept only with
        /// the standard charge ([`JobSpec::seat_charge`], E2); refuse otherwise.
        direct: bool,
    },
    /// Start the reserved job (E4).
    CommitLease {
        /// The mill's term (E13).
        term: Term,
        /// The lease.
        lease: LeaseId,
        /// Secrets for the job's environment.
        secrets: BTreeMap<String, String>,
    },
    /// Drop a reservation; never stops a running job (E8).
    ReleaseLease {
        /// The mill's term (E13).
        term: Term,
        /// The lease.
        lease: LeaseId,
    },
    /// Stop the job and ack at once (E7).
    CancelAttempt {
        /// The mill's term (E13).
        term: Term,
        /// The lease.
        lease: LeaseId,
        /// Why.
        reason: String,
    },
    /// Events up to `up_to` are durable at the mill; trim the outbox (E5).
    Ack {
        /// The mill's term (E13).
        term: Term,
        /// The executor's epoch.
        epoch: Epoch,
        /// Highest applied seqno.
        up_to: Seqno,
    },
}

impl ToExecutor {
    /// The term the message carries (E13); `None` for `Refused`, which commands nothing.
    pub fn term(&self) -> Option<Term> {
        match self {
            ToExecutor::Welcome { term, .. }
            | ToExecutor::ReserveSeat { term, .. }
            | ToExecutor::CommitLease { term, .. }
            | ToExecutor::ReleaseLease { term, .. }
            | ToExecutor::CancelAttempt { term, .. }
            | ToExecutor::Ack { term, .. } => Some(*term),
            ToExecutor::Refused { .. } => None,
        }
    }
}
