//! Invariant checkers I1–I11 (DESIGN §7), plus the persist-before-send discipline and the
//! rule that every seat an executor reserved is known to the mill (`reservations-known`).
//!
//! A [`Checker`] reads the world through shared references only: it never changes a process.
//! The driver feeds it what happened, in output order (a durable write, a message leaving a
//! process, an engine starting or stopping a job), and it checks the cheap rules at once;
//! [`Checker::sample`] runs the time-bounded ones every simulated second and
//! [`Checker::quiescent`] the rules about the end state.
//!
//! Where a rule needs history that no process keeps (what an engine really ran, which seqnos
//! an executor appended), the checker records it from the outputs it is shown.
//!
//! This file holds the checker's state and the records it keeps; each family of rules is one
//! file of `impl Checker` (issue 17 item 3): `mill_writes` (I1–I3, I11 terminals), `seqnos`
//! (I4), `quota` (I5), `mill_sends` (placement, M33, M35, persist-before-send), `order`
//! (M33's order), `byzantine` (I8, M28), `executors` (I6, I7, engine runs), `timed` (the
//! sampled bounds), `cancels` (I11) and `liveness` (I9, quiescence).

use std::collections::{BTreeMap, BTreeSet};

use millrace_core::executor::{ExecutorBatch, ExecutorWrite};
use millrace_core::job::{
    IdempotencyKey, JobSpec, JobState, RetryPolicy, Terminal, TerminalCause, TerminalStatus,
};
use millrace_core::mill::{
    AttemptEnd, AttemptOutcome, MillBatch, MillWrite, RequestError, Submitted, ViolationKind,
};
use millrace_core::quota::Scope;
use millrace_core::wire::{EndCause, Event, EventKind, ToExecutor, ToMill};
use millrace_core::{ConnId, Epoch, JobId, LeaseId, NodeId, Resources, Seqno};

use crate::byzantine::{ByzKind, Expect};
use crate::coverage::Path;
use crate::scenario::{Micros, SEC};
use crate::trace::secs;
use crate::world::World;

pub use crate::types::Violation;

mod byzantine;
mod cancels;
mod executors;
mod liveness;
mod mill_sends;
mod mill_writes;
mod order;
mod quota;
mod seqnos;
mod timed;

use order::FreshOrder;

fn fail<T>(rule: &'static str, message: String) -> Result<T, Violation> {
    Err(Violation { rule, message })
}

/// One event of a batch, as much as the checkers need of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventSummary {
    /// Its seqno.
    pub seqno: Seqno,
    /// Its lease.
    pub lease: LeaseId,
    /// Status, exit code and who ended the job, for a terminal.
    pub terminal: Option<(TerminalStatus, Option<i32>, EndCause)>,
}

impl EventSummary {
    /// The summary of `e`.
    pub fn of(e: &Event) -> Self {
        EventSummary {
            seqno: e.seqno,
            lease: e.lease,
            terminal: match &e.kind {
                EventKind::Running => None,
                EventKind::Terminal {
                    status,
                    exit_code,
                    cause,
                    ..
                } => Some((*status, *exit_code, *cause)),
            },
        }
    }
}

/// What the mill step being checked was handling, for rules that relate input to writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Anything else.
    Other,
    /// An event batch from executor `exec` of `epoch` (its events are in [`StepCtx::events`]).
    Batch {
        /// The executor.
        exec: usize,
        /// The batch's epoch.
        epoch: Epoch,
    },
    /// A snapshot from executor `exec` (its leases are in [`StepCtx::active`]).
    Snapshot {
        /// The executor.
        exec: usize,
    },
}

/// The input of the mill step being checked. Its buffers are reused from step to step.
#[derive(Debug, Clone)]
pub struct StepCtx {
    /// What it was.
    pub kind: StepKind,
    /// A batch's events.
    pub events: Vec<EventSummary>,
    /// A snapshot's leases.
    pub active: Vec<LeaseId>,
}

impl Default for StepCtx {
    fn default() -> Self {
        StepCtx {
            kind: StepKind::Other,
            events: Vec::new(),
            active: Vec::new(),
        }
    }
}

/// What an engine did with one lease: one execution of a job (I1 counts these).
#[derive(Debug, Clone)]
struct EngineRun {
    exec: usize,
    job: JobId,
    /// The executor's epoch when it started the job.
    epoch: Epoch,
    /// When `StartJob` reached the engine.
    start: Micros,
    /// Exit time, and whether it ran to success by itself.
    exited: Option<(Micros, bool)>,
}

/// A terminal an executor persisted for a lease (E5): what its engine produced, or what
/// the executor decided (a stop it asked for, self-fencing, a restart).
#[derive(Debug, Clone, Copy)]
struct ResultRec {
    at: Micros,
    seqno: Seqno,
    status: TerminalStatus,
    exit_code: Option<i32>,
    cause: EndCause,
}

/// I3: the terminal the mill records for a result the executor reported keeps its status
/// and exit code, but for the mill's own cancel: a Cancelled stop is recorded Timeout when
/// M18 asked for it, and an executor's own verdict (E9 restart, E12 fencing) on a job the
/// mill was cancelling is recorded as that cancel (M26, like M5's grace expiry).
fn recorded_as_reported(
    status: TerminalStatus,
    exit_code: Option<i32>,
    cause: EndCause,
    t: &Terminal,
) -> bool {
    let cancelled = matches!(
        t.status,
        TerminalStatus::Cancelled | TerminalStatus::Timeout
    );
    let same = status == t.status
        || (status == TerminalStatus::Cancelled && t.status == TerminalStatus::Timeout)
        || (matches!(cause, EndCause::Restarted | EndCause::LostContact)
            && cancelled
            && matches!(
                t.cause,
                Some(TerminalCause::Cancelled | TerminalCause::Timeout)
            ));
    same && exit_code == t.exit_code
}

/// An I11 deadline and the connections it holds on.
type Due = (Micros, Vec<ConnId>);

/// A cancel the mill accepted (I11).
#[derive(Debug, Clone)]
struct CancelRec {
    at: Micros,
    /// The mill's incarnation when it accepted it.
    mill_inc: u32,
    /// The executor and lease the job was leased to when the cancel was accepted.
    target: Option<(usize, LeaseId)>,
    /// When the engine run must have stopped, if the node was connected and ready then:
    /// `at + cancel_ack_timeout + stop_grace`, with the connections it could ack on.
    deadline: Option<(Micros, Vec<ConnId>)>,
    /// When the mill must have recorded the job's terminal, on the same condition:
    /// `at + cancel_ack_timeout + cancel_teardown_timeout` + slack (M26), whether or not
    /// the engine honours the stop.
    teardown: Option<(Micros, Vec<ConnId>)>,
}

/// How long a retry after a lost executor may wait before it is placed (M32): E12's bound
/// plus the mill's `retry_fence`.
fn fence_len(w: &World) -> Micros {
    dur(w.mill_cfg.reconnect_grace) + dur(w.mill_cfg.retry_fence)
}

/// A job's retry policy and attempts as the mill persisted them (M32).
#[derive(Debug, Clone, Default)]
struct Attempts {
    policy: RetryPolicy,
    /// The highest attempt number persisted.
    last: u32,
    /// Attempt number of each of its leases.
    leases: BTreeMap<LeaseId, u32>,
    /// Leases whose attempt end was persisted.
    ended: BTreeSet<LeaseId>,
    /// Attempts that ended `Retried`.
    retried: u32,
    /// From its insert, when its timeout passes at the earliest (M18: a job past it is
    /// never retried).
    timeout_at: Micros,
    /// A cancel of one of its leases is durable (M26): a job being cancelled is never
    /// retried (M32), even if the mill crashed before its user heard the cancel accepted.
    cancel_durable: bool,
}

/// A durable lease, as the checker saw it written.
#[derive(Debug, Clone)]
struct LeaseRec {
    job: JobId,
    exec: Option<usize>,
    epoch: Epoch,
    /// Usage keys it charges (scope, resource) with the amount; released at its delete.
    charge: Vec<(UsageKey, u64)>,
}

/// (is a repo, scope name id, resource name id).
type UsageKey = (bool, u32, u32);

/// Quota usage by the durable leases, kept incrementally (I5): names are interned so that a
/// lease costs no allocation once its scopes have been seen.
#[derive(Debug, Default)]
struct QuotaTally {
    names: BTreeMap<String, u32>,
    usage: BTreeMap<UsageKey, u64>,
    limits: BTreeMap<UsageKey, Option<u64>>,
}

impl QuotaTally {
    fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.names.get(name) {
            return id;
        }
        let id = self.names.len() as u32;
        self.names.insert(name.to_string(), id);
        id
    }

    fn name(&self, id: u32) -> &str {
        self.names
            .iter()
            .find(|(_, v)| **v == id)
            .map_or("?", |(k, _)| k.as_str())
    }

    fn limit(&mut self, cfg: &millrace_core::quota::QuotaConfig, key: UsageKey) -> Option<u64> {
        if let Some(l) = self.limits.get(&key) {
            return *l;
        }
        let scope = if key.0 {
            Scope::Repo(self.name(key.1).to_string())
        } else {
            Scope::Owner(self.name(key.1).to_string())
        };
        let l = cfg.limit(&scope, self.name(key.2));
        self.limits.insert(key, l);
        l
    }
}

/// Time bounds derived from the config.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// I1: an engine runs a job under a lease the mill has ended for at most this long before
    /// it is told to stop: reconnect grace (self-fencing counts from the last word heard,
    /// which may be a Welcome just before the mill's grace ran out) + silence + slack.
    pub stop: Micros,
    /// I9: the protocol's allowances (a free seat takes a waiting job within `place`; each
    /// job's bound is computed from the work ahead of it, see `crate::liveness`).
    pub live: crate::liveness::Allowances,
}

/// The checkers' memory.
#[derive(Debug)]
pub struct Checker {
    bounds: Bounds,
    inserted: BTreeSet<JobId>,
    /// Idempotency keys persisted, with their jobs (M31; the simulator has no retention, so
    /// a key maps to one job for the whole run).
    keys: BTreeMap<IdempotencyKey, JobId>,
    /// When each job was inserted, and whether a lease of it was ever written: a queue
    /// timeout may end only a job no lease took, `queue_timeout` after its submission.
    queued_since: BTreeMap<JobId, (Micros, bool)>,
    /// Accepted jobs → arrival index.
    accepted: BTreeMap<JobId, usize>,
    terminals: BTreeMap<JobId, Terminal>,
    leases: BTreeMap<LeaseId, LeaseRec>,
    tally: QuotaTally,
    lease_of_job: BTreeMap<JobId, LeaseId>,
    ended: BTreeMap<LeaseId, Micros>,
    /// Durable cursors per (executor, epoch).
    cursors: BTreeMap<(usize, Epoch), Seqno>,
    /// Events each executor appended, per epoch, index = seqno − 1.
    history: BTreeMap<(usize, Epoch), Vec<Event>>,
    /// Each executor's persisted terminal of a lease: (exec, epoch, lease) → what and when.
    results: BTreeMap<(usize, Epoch, LeaseId), ResultRec>,
    committed: BTreeSet<(usize, Epoch, LeaseId)>,
    runs: BTreeMap<LeaseId, EngineRun>,
    /// Every engine start of each job, in start order (I1).
    job_runs: BTreeMap<JobId, Vec<LeaseId>>,
    /// Each job's retry policy and its attempts so far (M32).
    attempts: BTreeMap<JobId, Attempts>,
    /// Engine starts of a second or later attempt that I1 allowed (coverage).
    pub retry_starts: u64,
    /// M33's order (checked with I9): jobs whose insert is durable and that no
    /// `ReserveSeat` has asked for yet.
    order: FreshOrder,
    /// Retries waiting out their fence (M32), until when; a restarted mill waits the whole
    /// fence again from its start.
    fences: BTreeMap<JobId, Micros>,
    /// The mill incarnation `fences` were last brought up to date for.
    fences_inc: u32,
    /// Ended leases a snapshot delivered to the mill still reported, and when (M32).
    reported_alive: BTreeMap<LeaseId, Micros>,

    /// Cancels the mill accepted, by job (I11).
    cancels: BTreeMap<JobId, CancelRec>,
    /// When an executor first received a `CancelAttempt` for a lease (I11).
    cancel_seen: BTreeMap<(usize, LeaseId), Micros>,
    /// The connection the mill last sent a `CancelAttempt` for a lease on (M26, I11).
    cancel_sent: BTreeMap<LeaseId, ConnId>,
    /// Open jobs with a timeout of their own (M18): when the mill's clock for it started
    /// (its acceptance, or the mill's latest restart, which re-arms it) and the timeout.
    timeouts: BTreeMap<JobId, (Micros, Micros)>,
    /// The mill incarnation the timeout clocks were last brought up to date for.
    timeouts_inc: u32,
    /// The connection and mill incarnation each `ReserveSeat` went out on.
    ask_conn: BTreeMap<LeaseId, (ConnId, u32)>,
    /// M35: a `ReserveSeat{direct}` sent in this step whose `CommitLease` has not followed
    /// yet on its connection.
    direct_due: Option<(ConnId, LeaseId)>,
    /// M35: leases the mill asked for directly.
    direct_asks: BTreeSet<LeaseId>,
    /// M35: direct asks an executor refused (the executor and the lease): their commit must
    /// start nothing there (E4).
    refused_direct: BTreeSet<(usize, LeaseId)>,
    /// Leases the mill sent a `ReleaseLease` or `CancelAttempt` for.
    let_go: BTreeSet<LeaseId>,
    /// Leases an engine runs now.
    running: BTreeSet<LeaseId>,
    stopped: BTreeSet<LeaseId>,
    not_held_since: BTreeMap<LeaseId, Micros>,
    quarantined: BTreeSet<NodeId>,
    /// I9's memory: free seats, per-job bounds (`crate::liveness`).
    live: crate::liveness::Liveness,
    /// I8: a violating message of a misbehaving executor the mill is handling now.
    byz_pending: Option<ByzPending>,
    /// I8: violations the mill observed in that step: (node, kind).
    step_violations: Vec<(NodeId, ViolationKind)>,
    /// I8: connections the mill closed in that step.
    step_closed: Vec<ConnId>,
    /// I4: the cursor move of the batch being applied: (exec, epoch, from, to).
    cursor_move: Option<(usize, Epoch, Seqno, Seqno)>,
}

/// A violating message a misbehaving executor sent and the mill received (I8).
#[derive(Debug)]
struct ByzPending {
    exec: usize,
    conn: ConnId,
    kind: ViolationKind,
    what: String,
}

/// What the mill must find wrong in an event batch whose events `bad` were made bad as
/// `kind` says, applying M20 against `cursor` in the mill's order (disorder, then per new
/// event a gap, then the event's own fault); `None` if the batch is legal there.
fn batch_violation(
    cursor: Seqno,
    events: &[Event],
    kind: ViolationKind,
    bad: &[Seqno],
) -> Option<ViolationKind> {
    let mut prev: Option<Seqno> = None;
    let mut expected = cursor.next();
    for e in events {
        if prev.is_some_and(|p| e.seqno <= p) {
            return Some(ViolationKind::SeqnoOrder);
        }
        prev = Some(e.seqno);
        if e.seqno <= cursor {
            continue;
        }
        if e.seqno != expected {
            return Some(ViolationKind::SeqnoGap);
        }
        expected = expected.next();
        if bad.contains(&e.seqno) {
            return Some(kind);
        }
    }
    None
}

/// A short description of a message, for failures.
fn describe(msg: &ToMill) -> String {
    match msg {
        ToMill::Snapshot { seqno, .. } => format!("Snapshot seqno {seqno}"),
        ToMill::EventBatch { epoch, events } => {
            let seqnos: Vec<u64> = events.iter().take(8).map(|e| e.seqno.get()).collect();
            format!("EventBatch {epoch} seqnos {seqnos:?}")
        }
        ToMill::ReserveResult {
            lease, resources, ..
        } => format!("ReserveResult {lease} accepted, resources {resources:?}"),
        other => format!("{other:?}").chars().take(120).collect(),
    }
}

/// A short description of a mill → executor message, for failures.
fn describe_down(msg: &ToExecutor) -> String {
    format!("{msg:?}").chars().take(120).collect()
}

/// One of `conns` is still open at both ends, from the running mill incarnation (I11).
fn still_connected(w: &World, conns: &[ConnId]) -> bool {
    w.mill.is_some()
        && conns.iter().any(|id| {
            w.net
                .conns
                .get(id)
                .is_some_and(|k| k.mill_open && k.exec_open && k.mill_inc == w.mill_inc)
        })
}

/// The exec index of a node id `x<i>`.
fn exec_index(w: &World, node: &NodeId) -> Option<usize> {
    w.exec_of(node)
}

/// The process of `node` whose store has `epoch`: a twin that took over a dead process's node
/// id (M2) has its own epoch; else the node id's first process.
fn exec_index_at(w: &World, node: &NodeId, epoch: Epoch) -> Option<usize> {
    w.execs
        .iter()
        .position(|p| &p.node == node && p.store.epoch == epoch)
        .or_else(|| exec_index(w, node))
}

impl Checker {
    /// First asks that passed over an older, lower-priority job of the owner (M33 coverage).
    pub fn priority_overtakes(&self) -> u64 {
        self.order.priority_overtakes
    }

    /// First asks that passed over an older job of another owner (M33 coverage).
    pub fn owner_overtakes(&self) -> u64 {
        self.order.owner_overtakes
    }

    /// A checker with `bounds`.
    pub fn new(bounds: Bounds) -> Self {
        Checker {
            bounds,
            inserted: BTreeSet::new(),
            keys: BTreeMap::new(),
            queued_since: BTreeMap::new(),
            accepted: BTreeMap::new(),
            terminals: BTreeMap::new(),
            leases: BTreeMap::new(),
            tally: QuotaTally::default(),
            lease_of_job: BTreeMap::new(),
            attempts: BTreeMap::new(),
            retry_starts: 0,
            order: FreshOrder::default(),
            fences: BTreeMap::new(),
            fences_inc: 0,
            reported_alive: BTreeMap::new(),

            ended: BTreeMap::new(),
            cursors: BTreeMap::new(),
            history: BTreeMap::new(),
            results: BTreeMap::new(),
            committed: BTreeSet::new(),
            runs: BTreeMap::new(),
            job_runs: BTreeMap::new(),
            cancels: BTreeMap::new(),
            cancel_seen: BTreeMap::new(),
            cancel_sent: BTreeMap::new(),
            timeouts: BTreeMap::new(),
            timeouts_inc: 0,
            ask_conn: BTreeMap::new(),
            direct_due: None,
            direct_asks: BTreeSet::new(),
            refused_direct: BTreeSet::new(),
            let_go: BTreeSet::new(),
            running: BTreeSet::new(),
            stopped: BTreeSet::new(),
            not_held_since: BTreeMap::new(),
            quarantined: BTreeSet::new(),
            live: crate::liveness::Liveness::default(),
            byz_pending: None,
            step_violations: Vec::new(),
            step_closed: Vec::new(),
            cursor_move: None,
        }
    }

    /// The bounds in force.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// A client was told `job` is accepted (its insert is durable).
    pub fn accepted(&mut self, job: JobId, arrival: usize) -> Result<(), Violation> {
        if !self.inserted.contains(&job) {
            return fail(
                "persist-before-send",
                format!("submit answered {job} but no durable insert preceded the answer"),
            );
        }
        self.accepted.insert(job, arrival);
        Ok(())
    }

    /// The mill accepted `job` at `now` with its own `timeout`, if it has one (M18).
    pub fn timeout_armed(&mut self, job: JobId, now: Micros, timeout: Option<std::time::Duration>) {
        if let Some(t) = timeout {
            let t = Micros::try_from(t.as_micros()).unwrap_or(Micros::MAX);
            self.timeouts.insert(job, (now, t));
        }
    }

    /// Whether `job`'s insert is durable.
    pub fn inserted(&self, job: JobId) -> bool {
        self.inserted.contains(&job)
    }

    /// M31: a client's retry under an idempotency key the mill made durable for `first`
    /// answers `first`, creates nothing and stores nothing (`wrote`: the step persisted).
    pub fn keyed_retry(
        &self,
        key: &IdempotencyKey,
        first: JobId,
        got: &Result<Submitted, RequestError>,
        wrote: bool,
    ) -> Result<(), Violation> {
        let expected = Submitted {
            job: first,
            created: false,
        };
        if self.keys.get(key) != Some(&first) || got.as_ref().ok() != Some(&expected) || wrote {
            return fail(
                "I2",
                format!(
                    "a retry under key {key} of {first} answered {got:?} (wrote: {wrote}); it must answer {first} and store nothing (M31)"
                ),
            );
        }
        Ok(())
    }

    /// Jobs accepted so far.
    pub fn accepted_jobs(&self) -> impl Iterator<Item = (JobId, usize)> + '_ {
        self.accepted.iter().map(|(j, a)| (*j, *a))
    }

    /// The recorded terminal of `job`.
    pub fn terminal(&self, job: JobId) -> Option<&Terminal> {
        self.terminals.get(&job)
    }

    /// Accepted jobs without a terminal.
    pub fn open_jobs(&self) -> Vec<JobId> {
        self.accepted
            .keys()
            .filter(|j| !self.terminals.contains_key(j))
            .copied()
            .collect()
    }
}

/// I7: `spec` may run on executor `exec`: its engine, all its labels, and (M34) the node it
/// is pinned to, if any.
fn compatible(
    rule: &'static str,
    exec: usize,
    p: &crate::world::ExecProc,
    spec: &JobSpec,
    job: JobId,
) -> Result<(), Violation> {
    if !p.cfg.engines.contains_key(&spec.engine) {
        return fail(
            rule,
            format!("{job} needs engine {}, which x{exec} lacks", spec.engine),
        );
    }
    if let Some(l) = spec.labels.iter().find(|l| !p.cfg.labels.contains(*l)) {
        return fail(rule, format!("{job} needs label {l}, which x{exec} lacks"));
    }
    if let Some(node) = spec.node.as_ref().filter(|n| **n != p.cfg.node_id) {
        return fail(
            rule,
            format!(
                "{job} is pinned to {node} but runs on x{exec} ({})",
                p.cfg.node_id
            ),
        );
    }
    Ok(())
}

fn dur(d: std::time::Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Seconds, for bounds in messages.
pub fn bound_secs(m: Micros) -> u64 {
    m / SEC
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seqno: u64) -> Event {
        Event {
            seqno: Seqno(seqno),
            lease: LeaseId(1),
            kind: EventKind::Running,
        }
    }

    /// I8's judge of a tagged batch follows M20's order against the mill's cursor.
    #[test]
    fn batch_violation_judges_against_the_cursor() {
        let bad = ViolationKind::BadLogRef;
        // A gap only counts where the batch's first new event is not cursor + 1.
        assert_eq!(
            batch_violation(Seqno(3), &[ev(5)], bad, &[]),
            Some(ViolationKind::SeqnoGap)
        );
        assert_eq!(batch_violation(Seqno(4), &[ev(4), ev(5)], bad, &[]), None);
        // Disorder is found before anything else, replays included.
        assert_eq!(
            batch_violation(Seqno(9), &[ev(2), ev(2)], bad, &[Seqno(2)]),
            Some(ViolationKind::SeqnoOrder)
        );
        // A bad event owes its own kind only when it is new.
        assert_eq!(batch_violation(Seqno(5), &[ev(5)], bad, &[Seqno(5)]), None);
        assert_eq!(
            batch_violation(Seqno(4), &[ev(4), ev(5)], bad, &[Seqno(5)]),
            Some(bad)
        );
    }
}
