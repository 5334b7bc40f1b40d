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

/// What makes two jobs interchangeable for placement: the same candidates, the same fit
/// (engine, labels, resources, pinned node).
type PlaceClass = (String, BTreeSet<String>, Resources, Option<NodeId>);

/// A job's place in its owner's queue (M33): higher priority first, then submit order.
type OwnerKey = (std::cmp::Reverse<i32>, JobId);

/// M33 checked from outside the mill: the first `ReserveSeat` of a job that was never asked
/// for must not pass over a job of the same owner and class that was never asked for either
/// and comes first in the owner's order (priority, then submit order). Only never-asked jobs
/// are compared: a job whose earlier round failed may rightly wait (it waits for a change
/// of the fleet, or its candidates said incompatible), and a later ask of a round started
/// before another job arrived is not a choice between them.
#[derive(Debug, Default)]
struct FreshOrder {
    jobs: BTreeMap<JobId, (PlaceClass, String, OwnerKey)>,
    /// Per (class, owner), in the owner's order.
    by_owner: BTreeMap<(PlaceClass, String), BTreeSet<OwnerKey>>,
    /// Per class, in submit order: the owner of each job.
    by_class: BTreeMap<PlaceClass, BTreeMap<JobId, String>>,
    /// First asks that passed over an older never-asked job of the owner with a lower
    /// priority (coverage: priority decided).
    priority_overtakes: u64,
    /// First asks that passed over an older never-asked job of the same class of another
    /// owner (coverage: M33's owner order decided, not submit order).
    owner_overtakes: u64,
    /// Jobs first asked for ahead of their insert (M12: an early ask leads its step's
    /// `Persist`), judged then from the spec the ask carried; their insert adds nothing.
    asked_early: BTreeSet<JobId>,
}

impl FreshOrder {
    fn inserted(&mut self, job: JobId, spec: &JobSpec) {
        if self.asked_early.remove(&job) {
            return;
        }
        self.register(job, spec);
    }

    fn register(&mut self, job: JobId, spec: &JobSpec) {
        let class: PlaceClass = (
            spec.engine.clone(),
            spec.labels.clone(),
            spec.resources.clone(),
            spec.node.clone(),
        );
        let owner = spec.identity.owner.clone();
        let key = (std::cmp::Reverse(spec.priority), job);
        self.by_owner
            .entry((class.clone(), owner.clone()))
            .or_default()
            .insert(key);
        self.by_class
            .entry(class.clone())
            .or_default()
            .insert(job, owner.clone());
        self.jobs.insert(job, (class, owner, key));
    }

    fn forget(&mut self, job: JobId) -> Option<(PlaceClass, String, OwnerKey)> {
        let (class, owner, key) = self.jobs.remove(&job)?;
        let slot = (class, owner);
        if let Some(set) = self.by_owner.get_mut(&slot) {
            set.remove(&key);
            if set.is_empty() {
                self.by_owner.remove(&slot);
            }
        }
        let (class, owner) = slot;
        if let Some(m) = self.by_class.get_mut(&class) {
            m.remove(&job);
            if m.is_empty() {
                self.by_class.remove(&class);
            }
        }
        Some((class, owner, key))
    }

    fn ended(&mut self, job: JobId) {
        self.forget(job);
    }

    /// A `ReserveSeat` for `job` went out; `inserted` says whether its insert is durable.
    fn asked(&mut self, job: JobId, spec: &JobSpec, inserted: bool) -> Result<(), Violation> {
        if !inserted && self.asked_early.insert(job) {
            // M12: the ask leads its job's insert in the same step; judge it as a first ask.
            self.register(job, spec);
        }
        let Some((class, owner, key)) = self.jobs.get(&job).cloned() else {
            return Ok(());
        };
        let slot = (class, owner);
        if let Some(set) = self.by_owner.get(&slot) {
            if let Some(first) = set.first().filter(|f| **f < key) {
                return fail(
                    "I9",
                    format!(
                        "M33: {job} (priority {}) asked for while {} (priority {}) of the same \
                         owner {} and class waited, never asked, ahead of it in the owner's order",
                        key.0 .0, first.1, first.0 .0, slot.1
                    ),
                );
            }
            if set.iter().any(|k| k.1 < job && k.0 > key.0) {
                self.priority_overtakes += 1;
            }
        }
        if let Some(m) = self.by_class.get(&slot.0) {
            if m.iter()
                .next()
                .is_some_and(|(k, o)| *k < job && *o != slot.1)
            {
                self.owner_overtakes += 1;
            }
        }
        self.forget(job);
        Ok(())
    }
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

    // ---- the mill ------------------------------------------------------------------------

    /// A mill `Persist`, already applied to its store (I1, I2, I3, I4, I5, I8).
    pub fn mill_persist(
        &mut self,
        w: &World,
        batch: &MillBatch,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        for write in &batch.writes {
            match write {
                MillWrite::JobInsert { job, record } => {
                    if !self.inserted.insert(*job) {
                        return fail("I2", format!("job id {job} inserted twice"));
                    }
                    let timeout = record.spec.timeout.unwrap_or(w.mill_cfg.job_timeout);
                    self.attempts.insert(
                        *job,
                        Attempts {
                            policy: record.spec.retry.clone(),
                            timeout_at: w.now.saturating_add(dur(timeout)),
                            ..Attempts::default()
                        },
                    );
                    self.queued_since.insert(*job, (w.now, false));
                    self.order.inserted(*job, &record.spec);
                }
                MillWrite::KeyInsert { key, record } => {
                    // M31 with M29: a key is durable in its job's insert batch, never
                    // without it, and never maps a second job.
                    let with_job = batch.writes.iter().any(
                        |w| matches!(w, MillWrite::JobInsert { job, .. } if *job == record.job),
                    );
                    if !with_job {
                        return fail(
                            "I2",
                            format!(
                                "key {key} persisted for {} outside its job's insert batch (M31)",
                                record.job
                            ),
                        );
                    }
                    if let Some(old) = self.keys.insert(key.clone(), record.job) {
                        return fail(
                            "I2",
                            format!("key {key} mapped {old}, then {} (M31)", record.job),
                        );
                    }
                }
                MillWrite::JobState { job, state } => {
                    if let Some(t) = self.terminals.get(job) {
                        return fail(
                            "I2",
                            format!(
                                "{job} changed to {} after its terminal {} was recorded",
                                state.name(),
                                t.status
                            ),
                        );
                    }
                    if let JobState::Done(t) = state {
                        self.job_done(w, *job, t, ctx)?;
                    }
                }
                MillWrite::LeaseUpsert(r) => {
                    if let Some(q) = self.queued_since.get_mut(&r.job) {
                        q.1 = true;
                    }
                    let exec = exec_index_at(w, &r.node, r.epoch);
                    if let Some(old) = self.leases.get(&r.lease) {
                        if old.job != r.job || old.exec != exec {
                            return fail(
                                "I1",
                                format!(
                                    "lease {} reused: {}@x{:?} then {}@{} (M30)",
                                    r.lease, old.job, old.exec, r.job, r.node
                                ),
                            );
                        }
                        continue;
                    }
                    if let Some(&other) = self.lease_of_job.get(&r.job) {
                        if other != r.lease {
                            return fail(
                                "I1",
                                format!(
                                    "{} holds two leases at once: {other} and {} (on {})",
                                    r.job, r.lease, r.node
                                ),
                            );
                        }
                    }
                    if let Some(info) = w.leases.get(&r.lease) {
                        // By node id: a twin process that legitimately took over a dead
                        // process's node id (M2) is asked under that id (twin seed 7000631).
                        let same_node = w.execs.get(info.exec).is_some_and(|p| p.node == r.node);
                        if info.job != r.job || !same_node {
                            return fail(
                                "I1",
                                format!(
                                    "lease {} stored for {}@{} but was asked for {} of x{}",
                                    r.lease, r.job, r.node, info.job, info.exec
                                ),
                            );
                        }
                    }
                    self.fences.remove(&r.job);
                    if let Some(a) = self.attempts.get_mut(&r.job) {
                        // M32: attempt numbers only move forward, one per lease.
                        if r.attempt != a.last.saturating_add(1) {
                            return fail(
                                "I2",
                                format!(
                                    "{} got {} as attempt {}, after attempt {} (M32: one more per lease)",
                                    r.job, r.lease, r.attempt, a.last
                                ),
                            );
                        }
                        a.last = r.attempt;
                        a.leases.insert(r.lease, r.attempt);
                    }
                    let charge = self.charge_quota(w, r)?;
                    self.leases.insert(
                        r.lease,
                        LeaseRec {
                            job: r.job,
                            exec,
                            epoch: r.epoch,
                            charge,
                        },
                    );
                    self.lease_of_job.insert(r.job, r.lease);
                }
                MillWrite::LeaseDelete { lease } => {
                    if let Some(rec) = self.leases.get_mut(lease) {
                        if self.lease_of_job.get(&rec.job) == Some(lease) {
                            self.lease_of_job.remove(&rec.job);
                        }
                        for (key, amount) in std::mem::take(&mut rec.charge) {
                            if let Some(u) = self.tally.usage.get_mut(&key) {
                                *u = u.saturating_sub(amount);
                            }
                        }
                    }
                    self.ended.entry(*lease).or_insert(w.now);
                }
                MillWrite::Cursor { node, epoch, seqno } => {
                    self.cursor_advanced(w, node, *epoch, *seqno, ctx)?;
                }
                MillWrite::CursorDelete { node, epoch } => {
                    self.cursor_forgotten(w, node, *epoch)?;
                }
                MillWrite::Quarantine { node, quarantined } => {
                    if *quarantined {
                        self.quarantined.insert(node.clone());
                    } else {
                        self.quarantined.remove(node);
                    }
                }
                MillWrite::Attempt(end) => self.attempt_ended(w, end, ctx)?,
                MillWrite::LeaseCancel { lease, .. } => {
                    let job = self.leases.get(lease).map(|r| r.job);
                    if let Some(a) = job.and_then(|j| self.attempts.get_mut(&j)) {
                        a.cancel_durable = true;
                    }
                }
                MillWrite::Counters { .. }
                | MillWrite::QuotaRelease { .. }
                | MillWrite::QuotaHold { .. } => {}
            }
        }
        Ok(())
    }

    /// A snapshot of `exec` reached the mill at `now` reporting `active` (M32: an ended
    /// lease it still reports is evidence its run lives).
    pub fn snapshot_received(&mut self, now: Micros, active: &[LeaseId], retry_fence: Micros) {
        for lease in active {
            if self.ended.contains_key(lease) {
                self.reported_alive.insert(*lease, now);
                // The mill holds a fenced retry while its old run is reported (M32).
                let job = self.leases.get(lease).map(|r| r.job);
                if let Some(until) = job.and_then(|j| self.fences.get_mut(&j)) {
                    *until = (*until).max(now.saturating_add(retry_fence));
                }
            }
        }
    }

    /// M32: an attempt's end as persisted: of a lease of that attempt, once; a retry only
    /// for an end the job's policy retries and only while retries are left; an end the
    /// policy would retry, with retries left, never ends the job. A retried end gets the
    /// same I3 checks as a terminal.
    fn attempt_ended(
        &mut self,
        w: &World,
        end: &AttemptEnd,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        let job = end.job;
        let Some(a) = self.attempts.get_mut(&job) else {
            return fail(
                "I2",
                format!("attempt end persisted for {job}, never inserted"),
            );
        };
        if a.leases.get(&end.lease) != Some(&end.attempt) {
            return fail(
                "I2",
                format!(
                    "{job}: attempt {} ended under {}, which is not that attempt's lease (M32)",
                    end.attempt, end.lease
                ),
            );
        }
        if !a.ended.insert(end.lease) {
            return fail(
                "I2",
                format!(
                    "{job}: attempt {} under {} ended twice",
                    end.attempt, end.lease
                ),
            );
        }
        let retryable = end
            .status
            .is_some_and(|st| a.policy.retries_on(st, end.cause));
        match end.outcome {
            AttemptOutcome::Retried { .. } => {
                if !retryable {
                    return fail(
                        "I2",
                        format!(
                            "{job}: attempt {} ended {:?} {:?} and was retried, which its policy {:?} does not allow (M32)",
                            end.attempt, end.status, end.cause, a.policy
                        ),
                    );
                }
                a.retried += 1;
                if matches!(end.outcome, AttemptOutcome::Retried { fenced: true }) {
                    self.fences.insert(job, w.now.saturating_add(fence_len(w)));
                }
                if a.retried > a.policy.retries {
                    return fail(
                        "I2",
                        format!(
                            "{job}: retried {} times, its policy allows {} (M32)",
                            a.retried, a.policy.retries
                        ),
                    );
                }
                let t = Terminal {
                    status: end.status.unwrap_or(TerminalStatus::Failed),
                    cause: end.cause,
                    exit_code: end.exit_code,
                    error: end.error.clone(),
                    log: None,
                    node: self
                        .leases
                        .get(&end.lease)
                        .and_then(|r| r.exec)
                        .and_then(|x| w.execs.get(x))
                        .map(|p| p.node.clone()),
                    lease: Some(end.lease),
                };
                let exec = self
                    .runs
                    .get(&end.lease)
                    .map(|r| r.exec)
                    .or_else(|| t.node.as_ref().and_then(|n| exec_index(w, n)));
                self.lease_verdict(w, job, &t, exec, ctx)?;
            }
            AttemptOutcome::Final
                if retryable
                    && a.retried < a.policy.retries
                    && !self.cancels.contains_key(&job)
                    && !a.cancel_durable
                    && w.now < a.timeout_at =>
            {
                return fail(
                    "I2",
                    format!(
                        "{job}: attempt {} ended {:?} {:?} and ended the job with {} of {} retries left (M32)",
                        end.attempt,
                        end.status,
                        end.cause,
                        a.policy.retries - a.retried,
                        a.policy.retries
                    ),
                );
            }
            AttemptOutcome::Final | AttemptOutcome::Released => {}
        }
        Ok(())
    }

    /// I2, I3 for a recorded terminal.
    fn job_done(
        &mut self,
        w: &World,
        job: JobId,
        t: &Terminal,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        self.terminals.insert(job, t.clone());
        self.order.ended(job);
        if !self.inserted.contains(&job) {
            return fail("I2", format!("terminal recorded for {job}, never inserted"));
        }
        let queued = self.queued_since.remove(&job);
        if t.cause == Some(TerminalCause::QueueTimeout) {
            let bound = dur(w.mill_cfg.queue_timeout);
            match queued {
                Some((_, true)) => {
                    return fail(
                        "I2",
                        format!("{job} ended by its queue timeout, yet a lease of it was written"),
                    );
                }
                Some((since, false)) if w.now < since.saturating_add(bound) => {
                    return fail(
                        "I2",
                        format!(
                            "{job} ended by its queue timeout at {}, submitted at {}: before queue_timeout {}",
                            secs(w.now),
                            secs(since),
                            secs(bound)
                        ),
                    );
                }
                _ => {}
            }
        }
        // The process that ran the lease (a twin that took over a dead process's node id has
        // its own index, M2), else the node id's first process.
        let exec = t
            .lease
            .and_then(|l| self.runs.get(&l))
            .map(|r| r.exec)
            .or_else(|| t.node.as_ref().and_then(|n| exec_index(w, n)));
        if t.status == TerminalStatus::Success {
            // Judged by node id: a twin that took over a dead process's node id (M2) ran it
            // under that id (twin seed 7000631).
            let ok = t.lease.and_then(|l| self.runs.get(&l)).is_some_and(|r| {
                r.job == job
                    && t.node.as_ref() == w.execs.get(r.exec).map(|p| &p.node)
                    && r.exited.is_some_and(|(_, s)| s)
            });
            if !ok {
                return fail(
                    "I2",
                    format!(
                        "{job} recorded Success under {:?} on {:?}, but no engine completed it there",
                        t.lease, t.node
                    ),
                );
            }
        }
        self.i11_terminal(w, job, t, exec)?;
        self.lease_verdict(w, job, t, exec, ctx)
    }

    /// I3 for how a lease ended, whether that ended its job or started a retry (M32): a
    /// result the mill applied is the one recorded, a reported terminal keeps the engine's
    /// status, and "executor lost" is never the verdict on a result the executor had
    /// durable and delivered.
    fn lease_verdict(
        &mut self,
        w: &World,
        job: JobId,
        t: &Terminal,
        exec: Option<usize>,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        let (Some(lease), Some(exec)) = (t.lease, exec) else {
            return Ok(());
        };
        self.i3_applied_result(w, job, t, exec, lease, ctx)?;
        // I3: a terminal the executor reported is recorded with the engine's status.
        if let StepKind::Batch { exec: from, .. } = ctx.kind {
            if from == exec && w.execs[exec].honest() {
                let reported = ctx
                    .events
                    .iter()
                    .find(|e| e.lease == lease)
                    .and_then(|e| e.terminal);
                if let Some((status, exit_code, cause)) = reported {
                    if !recorded_as_reported(status, exit_code, cause, t) {
                        return fail(
                            "I3",
                            format!(
                                "{job} under {lease}: x{exec} reported {status} {exit_code:?}, mill recorded {} {:?}",
                                t.status, t.exit_code
                            ),
                        );
                    }
                }
            }
        }
        let error = t.error.as_deref().unwrap_or("");
        // The mill's own verdicts (M5, M8), by cause, never by text; the executor's own
        // verdicts (E9 `ExecutorRestarted`, E12 `LostContact`) are results it reported.
        let lost = matches!(
            t.cause,
            Some(
                TerminalCause::ExecutorLost
                    | TerminalCause::ExecutorReplaced
                    | TerminalCause::NoLongerHasJob
            )
        );
        if !lost || !w.execs[exec].honest() {
            return Ok(());
        }
        // I3 (M8): a snapshot that reports the lease must not fail it.
        if let StepKind::Snapshot { exec: from } = ctx.kind {
            if from == exec && ctx.active.contains(&lease) {
                return fail(
                    "I3",
                    format!("{job}: x{exec}'s snapshot reported {lease}, yet the mill failed it ({error})"),
                );
            }
        }
        // I3: the result was durable at the executor, and the executor was back (its snapshot
        // reached the mill on a session still open), yet the mill recorded it lost.
        let p = &w.execs[exec];
        let Some(rec) = self.leases.get(&lease) else {
            return Ok(());
        };
        if p.store.epoch != rec.epoch {
            return Ok(());
        }
        let Some(persisted) = self.results.get(&(exec, rec.epoch, lease)).map(|r| r.at) else {
            return Ok(());
        };
        let Some((conn, at)) = w.snapshot_delivered[exec] else {
            return Ok(());
        };
        let live = w
            .net
            .conns
            .get(&conn)
            .is_some_and(|c| c.mill_open && c.exec_open);
        if live && at >= persisted && p.store.outbox.iter().any(|e| e.lease == lease) {
            return fail(
                "I3",
                format!(
                    "{job} under {lease}: x{exec} persisted its result at {} and reconnected (snapshot on {conn} at {}), yet the mill recorded {error:?}",
                    secs(persisted),
                    secs(at)
                ),
            );
        }
        Ok(())
    }

    /// I3: once the mill has applied an executor's terminal for a lease (the cursor of its
    /// (node, epoch) covers the event's seqno), the job's recorded terminal under that lease
    /// is the one the executor sent: a later verdict of the mill's own ("executor lost",
    /// a teardown deadline) may not replace a result it already holds. A Cancelled result
    /// may be recorded as Timeout (M18 cancels through the same path).
    fn i3_applied_result(
        &self,
        w: &World,
        job: JobId,
        t: &Terminal,
        exec: usize,
        lease: LeaseId,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        if !w.execs[exec].honest() {
            return Ok(());
        }
        let Some(epoch) = self.runs.get(&lease).map(|r| r.epoch) else {
            return Ok(());
        };
        let Some(r) = self.results.get(&(exec, epoch, lease)) else {
            return Ok(());
        };
        let mut applied = self.cursor(exec, epoch);
        if let StepKind::Batch {
            exec: from,
            epoch: e,
        } = ctx.kind
        {
            if from == exec && e == epoch {
                if let Some(last) = ctx.events.iter().map(|e| e.seqno).max() {
                    applied = applied.max(last);
                }
            }
        }
        if r.seqno > applied {
            return Ok(());
        }
        if !recorded_as_reported(r.status, r.exit_code, r.cause, t) {
            return fail(
                "I3",
                format!(
                    "{job} under {lease}: x{exec} {epoch} persisted {} {:?} at {} (seqno {}, applied: cursor {applied}), yet the mill recorded {} {:?} ({})",
                    r.status,
                    r.exit_code,
                    secs(r.at),
                    r.seqno,
                    t.status,
                    t.exit_code,
                    t.error.as_deref().unwrap_or("")
                ),
            );
        }
        Ok(())
    }

    /// I11: a job whose cancel the mill accepted ends Cancelled (or Timeout, when the mill's
    /// own M18 cancel was first), unless the executor persisted its own terminal for the
    /// lease before the `CancelAttempt` reached it (the engine's result raced the cancel).
    ///
    /// Held in full, across mill restarts (the accepted cancel is durable, M29) and executor
    /// restarts (the stop is durable before the ack, E7). An executor's own verdict, E9's
    /// restart or E12's self-fencing (known by cause, never by text), is never excused: it
    /// is no engine result, so the mill, which holds the cancel, records the cancel (M26).
    fn i11_terminal(
        &self,
        w: &World,
        job: JobId,
        t: &Terminal,
        exec: Option<usize>,
    ) -> Result<(), Violation> {
        let Some(c) = self.cancels.get(&job) else {
            return Ok(());
        };
        if matches!(
            t.status,
            TerminalStatus::Cancelled | TerminalStatus::Timeout
        ) {
            return Ok(());
        }
        if let Some(kind @ (TerminalCause::ExecutorRestarted | TerminalCause::LostContact)) =
            t.cause
        {
            let rule = if kind == TerminalCause::ExecutorRestarted {
                "E9"
            } else {
                "E12"
            };
            return fail(
                "I11",
                format!(
                    "{job}: cancel accepted at {} (mill incarnation {}, now {}), yet the mill recorded the executor's own verdict ({kind}, {rule}) {} under {:?} on {:?}: the cancel it held should have decided the terminal (M26)",
                    secs(c.at),
                    c.mill_inc,
                    w.mill_inc,
                    t.status,
                    t.lease,
                    t.node
                ),
            );
        }
        let own = match (exec, t.lease) {
            (Some(exec), Some(lease)) => self
                .runs
                .get(&lease)
                .and_then(|r| self.results.get(&(exec, r.epoch, lease)))
                .map(|r| (exec, lease, r.at)),
            _ => None,
        };
        if let Some((exec, lease, at)) = own {
            match self.cancel_seen.get(&(exec, lease)) {
                None => return Ok(()),
                Some(&seen) if at <= seen => return Ok(()),
                Some(&seen) => {
                    return fail(
                        "I11",
                        format!(
                            "{job}: cancel accepted at {} (mill incarnation {}), reached x{exec} at {}, yet {lease} ended {} by x{exec}'s terminal of {} (E7: a stop asked for decides the status)",
                            secs(c.at),
                            c.mill_inc,
                            secs(seen),
                            t.status,
                            secs(at)
                        ),
                    );
                }
            }
        }
        fail(
            "I11",
            format!(
                "{job}: cancel accepted at {} (mill incarnation {}, now {}), yet the mill recorded {} {:?} under {:?} on {:?} with no executor terminal before the cancel",
                secs(c.at),
                c.mill_inc,
                w.mill_inc,
                t.status,
                t.error.as_deref().unwrap_or(""),
                t.lease,
                t.node
            ),
        )
    }

    /// I4: a cursor only moves forward, over exactly the events of the batch being applied.
    fn cursor_advanced(
        &mut self,
        w: &World,
        node: &NodeId,
        epoch: Epoch,
        seqno: Seqno,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        let StepKind::Batch {
            exec,
            epoch: batch_epoch,
        } = ctx.kind
        else {
            return fail(
                "I4",
                format!("cursor of ({node}, {epoch}) moved to {seqno} outside an event batch"),
            );
        };
        if w.execs.get(exec).map(|p| &p.node) != Some(node) || batch_epoch != epoch {
            return fail(
                "I4",
                format!("cursor of ({node}, {epoch}) moved by a batch of x{exec} {batch_epoch}"),
            );
        }
        let prev = self
            .cursors
            .get(&(exec, epoch))
            .copied()
            .unwrap_or_default();
        if seqno <= prev {
            return fail(
                "I4",
                format!("cursor of ({node}, {epoch}) went from {prev} to {seqno}"),
            );
        }
        let mut expect = prev.get() + 1;
        for e in ctx
            .events
            .iter()
            .filter(|e| e.seqno > prev && e.seqno <= seqno)
        {
            if e.seqno.get() != expect {
                break;
            }
            expect += 1;
        }
        if expect != seqno.get() + 1 {
            let got: Vec<u64> = ctx.events.iter().map(|e| e.seqno.get()).collect();
            return fail(
                "I4",
                format!(
                    "cursor of ({node}, {epoch}) moved {prev} → {seqno} on a batch with seqnos {got:?}"
                ),
            );
        }
        if w.execs[exec].honest() {
            // What is applied is what the executor appended (the batch passed through
            // unchanged: its events were checked against the appends when sent, E5).
            let history = self.history.get(&(exec, epoch));
            for e in ctx
                .events
                .iter()
                .filter(|e| e.seqno > prev && e.seqno <= seqno)
            {
                let appended = history
                    .and_then(|h| h.get(e.seqno.get() as usize - 1))
                    .map(EventSummary::of);
                if appended != Some(*e) {
                    return fail(
                        "I4",
                        format!(
                            "({node}, {epoch}) seqno {} applied as {e:?}, but x{exec} appended {appended:?}",
                            e.seqno
                        ),
                    );
                }
            }
        }
        self.cursors.insert((exec, epoch), seqno);
        self.cursor_move = Some((exec, epoch, prev, seqno));
        Ok(())
    }

    /// I4, M23 (retention, issue 11 item 7): a cursor is forgotten only for an epoch of which
    /// no durable lease remains, since an event of such a stream can touch nothing: every
    /// event of it is skipped (M21; lease ids never repeat, M30). The stream then starts
    /// again from zero, as the mill's does.
    fn cursor_forgotten(
        &mut self,
        w: &World,
        node: &NodeId,
        epoch: Epoch,
    ) -> Result<(), Violation> {
        let live = self.leases.iter().find(|(id, rec)| {
            rec.epoch == epoch
                && !self.ended.contains_key(id)
                && rec
                    .exec
                    .and_then(|x| w.execs.get(x))
                    .is_some_and(|p| &p.node == node)
        });
        if let Some((id, rec)) = live {
            return fail(
                "I4",
                format!(
                    "cursor of ({node}, {epoch}) forgotten while {id} of {} is durable under it (M23)",
                    rec.job
                ),
            );
        }
        if let Some(exec) = exec_index_at(w, node, epoch) {
            self.cursors.remove(&(exec, epoch));
        }
        Ok(())
    }

    /// The durable cursor of executor `exec`'s `epoch`, as the checker saw it written.
    pub fn cursor(&self, exec: usize, epoch: Epoch) -> Seqno {
        self.cursors
            .get(&(exec, epoch))
            .copied()
            .unwrap_or_default()
    }

    /// I5: a new durable lease adds its charge to both of its job's scopes; none may pass
    /// its limit.
    fn charge_quota(
        &mut self,
        w: &World,
        r: &millrace_core::mill::LeaseRecord,
    ) -> Result<Vec<(UsageKey, u64)>, Violation> {
        let cfg = &w.mill_cfg.quota;
        let limited = !(cfg.owner_defaults.is_empty()
            && cfg.repo_defaults.is_empty()
            && cfg.owner_overrides.is_empty()
            && cfg.repo_overrides.is_empty());
        if !limited {
            return Ok(Vec::new());
        }
        // The post-batch store may have lost the job already: a late Tick (I12) can fire a
        // bid's end (publishing the lease) and the job's timeout (ending it) in one step, so
        // one batch inserts the lease and ends its job. The job's identity then comes from
        // the arrival it was submitted as.
        let from_arrival = || match self
            .accepted
            .get(&r.job)
            .map(|k| &w.workload.arrivals[*k].1)
        {
            Some(crate::workload::Arrival::Job { spec, .. }) => Some(spec.identity.clone()),
            _ => None,
        };
        let Some(id) = w
            .mill_store
            .jobs
            .get(&r.job)
            .map(|j| j.spec.identity.clone())
            .or_else(from_arrival)
        else {
            return fail(
                "I5",
                format!("durable lease {} of unknown {}", r.lease, r.job),
            );
        };
        let id = &id;
        let mut charge = Vec::with_capacity(2 * r.resources.len());
        for (repo, scope) in [(false, id.owner.as_str()), (true, id.repo.as_str())] {
            let scope_id = self.tally.id(scope);
            for (name, amount) in &r.resources {
                let key = (repo, scope_id, self.tally.id(name));
                let used = self.tally.usage.entry(key).or_insert(0);
                *used += amount;
                let used = *used;
                charge.push((key, *amount));
                if let Some(limit) = self.tally.limit(cfg, key) {
                    if used > limit {
                        return fail(
                            "I5",
                            format!(
                                "{} {scope} uses {used} {name} through its leases (with {} of {}); limit {limit}",
                                if repo { "repo" } else { "owner" },
                                r.lease,
                                r.job
                            ),
                        );
                    }
                }
            }
        }
        Ok(charge)
    }

    /// I5: usage by the durable leases never exceeds a limit; nor does the ledger's.
    pub fn quota_within_limits(&self, w: &World) -> Result<(), Violation> {
        let cfg = &w.mill_cfg.quota;
        let limited = !(cfg.owner_defaults.is_empty()
            && cfg.repo_defaults.is_empty()
            && cfg.owner_overrides.is_empty()
            && cfg.repo_overrides.is_empty());
        if !limited {
            return Ok(());
        }
        // (is_repo, scope name, resource) → amount; a handful of entries, so a flat list.
        let mut usage: Vec<((bool, &str, &str), u64)> = Vec::new();
        for l in w.mill_store.leases.values() {
            let Some(job) = w.mill_store.jobs.get(&l.job) else {
                return fail(
                    "I5",
                    format!("durable lease {} of unknown {}", l.lease, l.job),
                );
            };
            let id = &job.spec.identity;
            for scope in [(false, id.owner.as_str()), (true, id.repo.as_str())] {
                for (name, amount) in &l.resources {
                    let key = (scope.0, scope.1, name.as_str());
                    match usage.iter_mut().find(|(k, _)| *k == key) {
                        Some((_, u)) => *u += amount,
                        None => usage.push((key, *amount)),
                    }
                }
            }
        }
        for ((repo, scope, name), amount) in usage {
            let scope = if repo {
                Scope::Repo(scope.to_string())
            } else {
                Scope::Owner(scope.to_string())
            };
            if let Some(limit) = cfg.limit(&scope, name) {
                if amount > limit {
                    return fail(
                        "I5",
                        format!("{scope} uses {amount} {name} through its leases; limit {limit}"),
                    );
                }
            }
        }
        Ok(())
    }

    /// I5 on the mill's ledger (volatile holds too).
    pub fn ledger_within_limits(&self, w: &World) -> Result<(), Violation> {
        let cfg = &w.mill_cfg.quota;
        let Some(mill) = &w.mill else {
            return Ok(());
        };
        let mut scopes: BTreeSet<Scope> = BTreeSet::new();
        for (_, identity, _) in mill.quota().holds() {
            scopes.extend(Scope::of(identity));
        }
        for scope in scopes {
            for (name, amount) in mill.quota().usage(&scope) {
                if let Some(limit) = cfg.limit(&scope, &name) {
                    if amount > limit {
                        return fail(
                            "I5",
                            format!("quota ledger: {scope} uses {amount} {name}; limit {limit}"),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// M33: the asks of one mill step (`ReserveSeat`s, direct or not), judged before its
    /// outputs go out, in the order the mill decided them: by lease id, which it allocates
    /// in that order (M30). Output order is not decision order: an early ask (M12) leads
    /// the step's `Persist` while a direct ask (M35) decided before it follows it. Judged
    /// whatever connection each goes out on: the mill chose the job.
    pub fn step_asks(&mut self, asks: &mut [(LeaseId, JobId, &JobSpec)]) -> Result<(), Violation> {
        asks.sort_by_key(|a| a.0);
        for (_, job, spec) in asks.iter() {
            let inserted = self.inserted.contains(job);
            self.order.asked(*job, spec, inserted)?;
        }
        Ok(())
    }

    /// M33: jobs a mill step took up without an ask, before its asks are judged: ended by
    /// the step (a direct placement's quota denial, M35) or sent to wait for quota (the mill
    /// observes `QuotaWait`; M35 asks quota before any seat). They are never passed over.
    pub fn taken_up(&mut self, jobs: &[JobId]) {
        for job in jobs {
            self.order.ended(*job);
        }
    }

    /// A deposed mill (DESIGN §10) sent `msg` on `conn`, one of the connections of its
    /// incarnation `inc`: its asks and releases are known, as the leader's are.
    pub fn deposed_send(&mut self, conn: ConnId, msg: &ToExecutor, inc: u32) {
        match msg {
            ToExecutor::ReserveSeat { lease, .. } => {
                self.ask_conn.insert(*lease, (conn, inc));
            }
            ToExecutor::ReleaseLease { lease, .. } => {
                self.let_go.insert(*lease);
            }
            ToExecutor::Welcome { .. }
            | ToExecutor::Refused { .. }
            | ToExecutor::CommitLease { .. }
            | ToExecutor::CancelAttempt { .. }
            | ToExecutor::Ack { .. } => {}
        }
    }

    /// A message the mill sends, after the step's `Persist` was applied (persist before
    /// send; I4, I7, I8, M16, M30).
    pub fn mill_send(
        &mut self,
        w: &World,
        conn: ConnId,
        msg: &ToExecutor,
    ) -> Result<(), Violation> {
        // M35: a direct ask's commit follows it on its connection before anything else.
        if let Some((due_conn, due)) = self.direct_due {
            if due_conn == conn {
                match msg {
                    ToExecutor::CommitLease { lease, .. } if *lease == due => {
                        self.direct_due = None;
                    }
                    other => {
                        return fail(
                            "M35",
                            format!(
                                "ReserveSeat{{direct}} {due} on {conn} was followed by {} instead of its CommitLease",
                                describe_down(other)
                            ),
                        );
                    }
                }
            }
        }
        let Some(exec) = w.exec_of_conn(conn) else {
            return Ok(());
        };
        let p = &w.execs[exec];
        match msg {
            ToExecutor::ReserveSeat {
                lease,
                job,
                spec,
                direct,
                ..
            } => {
                if *direct {
                    self.direct_ask(w, exec, conn, *lease, *job, spec)?;
                }
                if *lease >= w.mill_store.lease_floor {
                    return fail(
                        "persist-before-send",
                        format!(
                            "ReserveSeat {lease} sent above the durable lease floor {} (M30)",
                            w.mill_store.lease_floor
                        ),
                    );
                }
                if let Some(old) = w.leases.get(lease) {
                    return fail(
                        "I1",
                        format!(
                            "lease id {lease} asked twice: {} of x{} and {job} of x{exec} (M30)",
                            old.job, old.exec
                        ),
                    );
                }
                if self.quarantined.contains(&p.node) {
                    return fail(
                        "I8",
                        format!("quarantined {} asked to reserve {lease} for {job}", p.node),
                    );
                }
                compatible("I7", exec, p, spec, *job)?;
                self.ask_conn.insert(*lease, (conn, w.mill_inc));
            }
            ToExecutor::ReleaseLease { term: _, lease } => {
                self.let_go.insert(*lease);
            }
            ToExecutor::CancelAttempt { lease, .. } => {
                self.let_go.insert(*lease);
                self.cancel_sent.insert(*lease, conn);
                // A cancel of a lease the mill still holds durably (a running lease: a
                // reserved one is deleted before its cancel) is durable first (M26, M29).
                let undurable = w
                    .mill_store
                    .leases
                    .get(lease)
                    .is_some_and(|l| l.node == p.node && l.cancel.is_none());
                if undurable {
                    return fail(
                        "persist-before-send",
                        format!(
                            "CancelAttempt {lease} to x{exec} before the cancel was durable (M26, M29)"
                        ),
                    );
                }
            }
            ToExecutor::CommitLease { lease, .. } => {
                let stored = w
                    .mill_store
                    .leases
                    .get(lease)
                    .is_some_and(|l| l.node == p.node);
                if !stored {
                    return fail(
                        "persist-before-send",
                        format!(
                            "CommitLease {lease} to x{exec} before the lease was durable (M16)"
                        ),
                    );
                }
                if self.quarantined.contains(&p.node) {
                    return fail(
                        "I8",
                        format!("quarantined {} sent CommitLease {lease}", p.node),
                    );
                }
            }
            ToExecutor::Ack {
                term: _,
                epoch,
                up_to,
            } => {
                let durable = self.cursor(exec, *epoch);
                if *up_to > durable {
                    return fail(
                        "I4",
                        format!("Ack ({}, {epoch}) up to {up_to} exceeds the durable cursor {durable} (M23)", p.node),
                    );
                }
            }
            ToExecutor::Welcome { cursor, .. } => {
                let durable = w
                    .mill_store
                    .cursors
                    .iter()
                    .filter(|((n, _), _)| *n == p.node)
                    .map(|(_, s)| *s)
                    .max()
                    .unwrap_or_default();
                if *cursor > durable {
                    return fail(
                        "I4",
                        format!(
                            "Welcome to {} with cursor {cursor} beyond every durable cursor",
                            p.node
                        ),
                    );
                }
            }
            ToExecutor::Refused { .. } => {}
        }
        Ok(())
    }

    /// M35: a `ReserveSeat{direct}`: published first (M16: its commit follows at once),
    /// holding quota for exactly the standard charge (E2, M15), and the step's previous
    /// direct ask already followed by its commit.
    fn direct_ask(
        &mut self,
        w: &World,
        exec: usize,
        conn: ConnId,
        lease: LeaseId,
        job: JobId,
        spec: &JobSpec,
    ) -> Result<(), Violation> {
        let p = &w.execs[exec];
        match w.mill_store.leases.get(&lease) {
            Some(l) if l.node == p.node && l.job == job => {
                if l.resources != spec.seat_charge() {
                    return fail(
                        "M35",
                        format!(
                            "direct ask {lease} for {job} published with charge {:?}, not the standard charge {:?} (E2)",
                            l.resources,
                            spec.seat_charge()
                        ),
                    );
                }
            }
            _ => {
                return fail(
                    "persist-before-send",
                    format!(
                        "ReserveSeat{{direct}} {lease} to x{exec} before its lease was durable (M35, M16)"
                    ),
                );
            }
        }
        if let Some((c, l)) = self.direct_due {
            return fail(
                "M35",
                format!("direct ask {l} on {c} not followed by its CommitLease before direct ask {lease}"),
            );
        }
        self.direct_asks.insert(lease);
        self.direct_due = Some((conn, lease));
        Ok(())
    }

    /// A mill step's outputs are all out (`crashed`: the step was cut short by a crash).
    /// M35: a direct ask's commit went out in the same step, unless a crash cut it off.
    pub fn mill_step_end(&mut self, crashed: bool) -> Result<(), Violation> {
        match self.direct_due.take() {
            Some((conn, lease)) if !crashed => fail(
                "M35",
                format!("ReserveSeat{{direct}} {lease} on {conn} without its CommitLease in the same step"),
            ),
            _ => Ok(()),
        }
    }

    /// The mill quarantined `node` (seen in its output order).
    pub fn quarantine_observed(&mut self, node: &NodeId) {
        self.quarantined.insert(node.clone());
    }

    /// The mill observed a violation by `node` (M28).
    pub fn violation_observed(&mut self, node: &NodeId, kind: ViolationKind) {
        if self.byz_pending.is_some() {
            self.step_violations.push((node.clone(), kind));
        }
    }

    /// The mill closed `conn`.
    pub fn mill_closed(&mut self, conn: ConnId) {
        if self.byz_pending.is_some() {
            self.step_closed.push(conn);
        }
    }

    /// I8 (M28, DESIGN §8): a message of misbehaving executor `exec` reaches the mill on
    /// `conn`, tagged by its filter. Works out, from the mill's state before the step, which
    /// violation the mill must find in it (if any: a replay, an answer to an ask already over
    /// or a batch the cursor makes legal owe nothing), for [`Checker::byz_step_done`] to
    /// check. Returns a coverage path the delivery reached.
    pub fn byz_received(
        &mut self,
        w: &World,
        exec: usize,
        conn: ConnId,
        msg: &ToMill,
        tag: Expect,
    ) -> Option<Path> {
        let m = w.mill.as_ref()?;
        let node = &w.execs[exec].node;
        let kind = match (tag, msg) {
            (Expect::Always(kind), _) => Some(kind),
            (Expect::Batch { kind, bad }, ToMill::EventBatch { epoch, events }) => {
                batch_violation(m.cursor(node, *epoch), events, kind, &bad)
            }
            (Expect::Answer { kind, lease }, _) => {
                // An open ask of a bid, or a direct ask (M35) whose answer is still due:
                // both are judged the same way.
                let open = (m.is_ask(lease) && m.stray(lease).is_none()) || m.is_direct_ask(lease);
                let asked_here = w.leases.get(&lease).is_some_and(|l| l.exec == exec);
                match (open, asked_here, kind) {
                    (false, _, _) => None,
                    (true, false, _) => Some(ViolationKind::UnaskedReserveResult),
                    (true, true, ViolationKind::BadResources) => Some(kind),
                    (true, true, _) => None,
                }
            }
            (Expect::Replay(seqno), ToMill::EventBatch { epoch, .. }) => {
                // M20: dropped, still acked; I4 (`applied`) sees it applied if it is not.
                return (m.cursor(node, *epoch) == seqno).then_some(Path::ReplayAtCursor);
            }
            _ => None,
        }?;
        self.byz_pending = Some(ByzPending {
            exec,
            conn,
            kind,
            what: describe(msg),
        });
        self.step_violations.clear();
        self.step_closed.clear();
        let repeat = w.execs[exec].spec.byzantine == Some(ByzKind::SnapshotRepeat);
        Some(if repeat && kind == ViolationKind::SnapshotRegression {
            Path::SnapshotRepeatRefused
        } else {
            Path::ViolationReceived
        })
    }

    /// I8: the mill's step over a violating message is done: it must have observed that
    /// violation (the same kind) for the node and closed the connection, so nothing later on
    /// it is applied (M28).
    pub fn byz_step_done(&mut self, w: &World) -> Result<(), Violation> {
        let Some(p) = self.byz_pending.take() else {
            return Ok(());
        };
        let violations = std::mem::take(&mut self.step_violations);
        let closed = std::mem::take(&mut self.step_closed);
        if w.mill.is_none() {
            return Ok(()); // crashed within the step: its outputs were cut short
        }
        let node = &w.execs[p.exec].node;
        let seen = violations.iter().any(|(n, k)| n == node && *k == p.kind);
        if seen && closed.contains(&p.conn) {
            return Ok(());
        }
        let did: Vec<String> = violations
            .iter()
            .map(|(n, k)| format!("{n}: {k}"))
            .collect();
        fail(
            "I8",
            format!(
                "x{} ({}) sent {} on {}: a {} violation ({}), yet the mill accepted it (violations observed: {did:?}; closed {:?})",
                p.exec,
                w.execs[p.exec].spec.byzantine.map_or("", |k| k.name()),
                p.what,
                p.conn,
                p.kind,
                Expect::rule(p.kind),
                closed
            ),
        )
    }

    /// I4 (M20): the mill applied `events` events of a batch, seqnos `first..=last`, on
    /// `conn`. Applied seqnos run exactly old cursor + 1 ..= new cursor, each once: a replay
    /// (seqno ≤ cursor) is never applied.
    pub fn applied(
        &mut self,
        w: &World,
        conn: ConnId,
        epoch: Epoch,
        (first, last, events): (Seqno, Seqno, u64),
    ) -> Result<(), Violation> {
        let Some(exec) = w.exec_of_conn(conn) else {
            return Ok(());
        };
        let moved = self.cursor_move.take();
        let ok = moved.is_some_and(|(x, e, from, to)| {
            x == exec
                && e == epoch
                && first == from.next()
                && last == to
                && events == to.get() - from.get()
        });
        if ok {
            return Ok(());
        }
        let how = match moved {
            Some((x, e, from, to)) if x == exec && e == epoch => {
                format!("its cursor moved {from} → {to}")
            }
            _ => format!("its cursor stayed at {}", self.cursor(exec, epoch)),
        };
        fail(
            "I4",
            format!(
                "x{exec} {epoch}: the mill applied {events} events {first}..={last} on {conn}, but {how}: applied seqnos must be exactly cursor+1..=new cursor, each once (M20: a replay is dropped)"
            ),
        )
    }

    // ---- executors -----------------------------------------------------------------------

    /// An executor `Persist`, applied to its store (E5 bookkeeping).
    pub fn exec_persist(
        &mut self,
        w: &World,
        exec: usize,
        batch: &ExecutorBatch,
    ) -> Result<(), Violation> {
        let epoch = w.execs[exec].store.epoch;
        for write in &batch.writes {
            match write {
                ExecutorWrite::Append(e) => {
                    let h = self.history.entry((exec, epoch)).or_default();
                    if e.seqno.get() != h.len() as u64 + 1 {
                        return fail(
                            "I4",
                            format!(
                                "x{exec} {epoch} appended seqno {} after {} events (E5)",
                                e.seqno,
                                h.len()
                            ),
                        );
                    }
                    h.push(e.clone());
                    if let EventKind::Terminal {
                        status,
                        exit_code,
                        cause,
                        ..
                    } = &e.kind
                    {
                        // E7 at the source: once a cancel reached this executor for the lease
                        // (it survived that step or made the stop durable), the stop decides
                        // the terminal it reports — whatever else (the engine, a fence, a
                        // restart) ended the run since. The mill may map a verdict to the
                        // cancel it holds (M26), which would hide a slip here from I11.
                        let seen = self.cancel_seen.get(&(exec, e.lease)).copied();
                        if let Some(seen) = seen.filter(|s| w.now > *s) {
                            if w.execs[exec].honest() && *status != TerminalStatus::Cancelled {
                                return fail(
                                    "I11",
                                    format!(
                                        "x{exec} reported {} {status} ({cause:?}) at {}, though a cancel reached it at {} (E7: a stop asked for decides the status)",
                                        e.lease,
                                        secs(w.now),
                                        secs(seen)
                                    ),
                                );
                            }
                        }
                        self.results.insert(
                            (exec, epoch, e.lease),
                            ResultRec {
                                at: w.now,
                                seqno: e.seqno,
                                status: *status,
                                exit_code: *exit_code,
                                cause: *cause,
                            },
                        );
                    }
                }
                ExecutorWrite::JobCommitted { lease, .. } => {
                    self.committed.insert((exec, epoch, *lease));
                }
                ExecutorWrite::Trim { .. }
                | ExecutorWrite::JobStopping { .. }
                | ExecutorWrite::JobEnded { .. }
                | ExecutorWrite::Contact { .. }
                | ExecutorWrite::Timers(_)
                | ExecutorWrite::Term(_) => {}
            }
        }
        Ok(())
    }

    /// A message an honest executor sends (before any misbehaviour filter): persist before
    /// send (E4, E5), complete snapshots (I3), seats within capacity (I6).
    pub fn exec_send(&mut self, w: &World, exec: usize, msg: &ToMill) -> Result<(), Violation> {
        let p = &w.execs[exec];
        let epoch = p.store.epoch;
        match msg {
            ToMill::ReserveResult {
                lease,
                accepted: false,
                ..
            } if self.direct_asks.contains(lease) => {
                self.refused_direct.insert((exec, *lease));
            }
            ToMill::EventBatch { epoch: e, events } => {
                let h = self.history.get(&(exec, *e));
                for ev in events {
                    let appended = h.and_then(|h| h.get(ev.seqno.get().wrapping_sub(1) as usize));
                    if appended != Some(ev) {
                        return fail(
                            "persist-before-send",
                            format!(
                                "x{exec} sent event {} of {e} that it had not persisted (E5)",
                                ev.seqno
                            ),
                        );
                    }
                }
            }
            ToMill::CommitResult {
                lease,
                committed: true,
            } if !self.committed.contains(&(exec, epoch, *lease)) => {
                return fail(
                    "persist-before-send",
                    format!("x{exec} answered committed for {lease} without a durable commit (E4)"),
                );
            }
            ToMill::Snapshot {
                active_leases,
                outbox_high,
                ..
            } => {
                let Some(x) = &p.exec else {
                    return Ok(());
                };
                // Since `outbox_high` (DESIGN §3) the snapshot lists only held seats: a lease
                // whose result waits in the outbox is covered by `outbox_high` instead (the mill
                // judges it only once those events are applied).
                // Without the pre-tick (I12) a snapshot of the step's due timers precedes the
                // step's input, which may take a seat after it: owed are the seats held both
                // before and after the step.
                // Checked in full, however many leases there are.
                {
                    let reported = |l: &LeaseId| active_leases.contains(l);
                    let mut owed = x
                        .reserved_leases()
                        .chain(x.running_leases())
                        .filter(|l| p.held_before.contains(l));
                    if let Some(missing) = owed.find(|l| !reported(l)) {
                        return fail(
                            "I3",
                            format!("x{exec}'s snapshot leaves out {missing}, which it holds (M8 would fail it)"),
                        );
                    }
                }
                // Entries the step itself appended may follow its timers' snapshot.
                if let Some(high) = p.outbox_before.filter(|h| h > outbox_high) {
                    return fail(
                        "I3",
                        format!(
                            "x{exec}'s snapshot names outbox_high {outbox_high}, below its outbox entry {high}"
                        ),
                    );
                }
            }
            ToMill::ReserveResult { accepted: true, .. } => self.seats_within_capacity(w, exec)?,
            // E7: the stop of a running job is durable before its ack goes out, so a
            // restart still ends the job Cancelled (E9).
            ToMill::CancelAck { lease }
                if p.store.jobs.get(lease).is_some_and(|j| j.stop.is_none()) =>
            {
                return fail(
                    "persist-before-send",
                    format!("x{exec} acked the cancel of {lease} before its stop was durable (E7)"),
                );
            }
            _ => {}
        }
        Ok(())
    }

    /// I6: reservations + running jobs per engine within capacity, and (M34) what they ask
    /// for within each resource the engine declares.
    fn seats_within_capacity(&self, w: &World, exec: usize) -> Result<(), Violation> {
        let p = &w.execs[exec];
        let Some(x) = &p.exec else {
            return Ok(());
        };
        let mut used: BTreeMap<&str, (u32, BTreeMap<&str, u64>)> = BTreeMap::new();
        for lease in x.reserved_leases().chain(x.running_leases()) {
            let info = w.leases.get(&lease);
            let engine = info.map(|i| i.engine.as_str()).unwrap_or("?");
            let (seats, asked) = used.entry(engine).or_default();
            *seats += 1;
            for (name, amount) in info.into_iter().flat_map(|i| &i.resources) {
                let total = asked.entry(name.as_str()).or_insert(0);
                *total = total.saturating_add(*amount);
            }
        }
        for (engine, (n, asked)) in used {
            let cfg = p.cfg.engines.get(engine);
            let cap = cfg.map_or(0, |e| e.capacity);
            if n > cap {
                return fail(
                    "I6",
                    format!("x{exec} holds {n} seats of {engine}, capacity {cap}"),
                );
            }
            for (name, &total) in cfg.into_iter().flat_map(|e| &e.resources) {
                let held = asked.get(name.as_str()).copied().unwrap_or(0);
                if held > total {
                    return fail(
                        "I6",
                        format!(
                            "x{exec}'s {engine} seats hold {held} {name}, {total} declared (E2, M34)"
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// The engine of `exec` is told to start `job` under `lease` (I1, I3, I6, I7, E4).
    ///
    /// I1 counted from engine starts: no retry policy exists yet (M32), so a job has one
    /// attempt and its engine may start once across the whole fleet and every restart of
    /// every process. A second start is a double execution, whether or not the first run
    /// is over (it overlaps, or it already produced a result the mill should have kept, I3).
    pub fn start(
        &mut self,
        w: &World,
        exec: usize,
        lease: LeaseId,
        job: JobId,
        spec: &JobSpec,
    ) -> Result<(), Violation> {
        let p = &w.execs[exec];
        compatible("I7", exec, p, spec, job)?;
        if self.refused_direct.contains(&(exec, lease)) {
            return fail(
                "I1",
                format!(
                    "x{exec} started {job} under {lease}, a direct ask it refused: its commit must find no reservation (M35, E4)"
                ),
            );
        }
        if let Some(run) = self.runs.get(&lease) {
            return fail(
                "I1",
                format!(
                    "{lease} started twice: on x{} at {} and on x{exec} at {} (E4)",
                    run.exec,
                    secs(run.start),
                    secs(w.now)
                ),
            );
        }
        let retries = self.attempts.get(&job).map_or(0, |a| a.policy.retries);
        let earlier = self.job_runs.get(&job).map_or(&[][..], Vec::as_slice);
        if let Some(&first) = earlier.first().filter(|_| earlier.len() > retries as usize) {
            let r = &self.runs[&first];
            let how = match r.exited {
                None => "still running: the runs overlap".to_string(),
                Some((at, _)) => format!("ended at {}", secs(at)),
            };
            let result = self
                .results
                .get(&(r.exec, r.epoch, first))
                .map(|res| {
                    format!(
                        "; its result {} was persisted at {} (I3: a result is recorded and its job not started again)",
                        res.status,
                        secs(res.at)
                    )
                })
                .unwrap_or_default();
            return fail(
                "I1",
                format!(
                    "{job} started {} times, its retry policy allows {} (M32): first under {first} on x{} {} at {} ({how}{result}), now under {lease} on x{exec} {} at {}",
                    earlier.len() + 1,
                    retries + 1,
                    r.exec,
                    r.epoch,
                    secs(r.start),
                    p.store.epoch,
                    secs(w.now)
                ),
            );
        }
        // M32 with I1: a later attempt starts only once every earlier run has stopped and
        // the mill has ended its lease.
        for l in earlier {
            let r = &self.runs[l];
            // A lying executor that dropped a lease it still runs (M8 then fails it) is
            // outside the promise: nothing it says about its runs can be trusted.
            // An engine that ignored its kill (`slow_stop`: a kill that does not take)
            // outlives any bound the mill could wait; then only evidence counts: the mill
            // may not start the retry within `retry_fence` of a snapshot, delivered to it,
            // that still reported the old run (M32).
            let unkillable = w.execs[r.exec].engine.get(l).is_some_and(|e| e.hung);
            let reported = self
                .reported_alive
                .get(l)
                .is_some_and(|&at| w.now < at.saturating_add(dur(w.mill_cfg.retry_fence)));
            if r.exited.is_none() && w.execs[r.exec].honest() && (!unkillable || reported) {
                return fail(
                    "I1",
                    format!(
                        "{job}: attempt under {lease} starts on x{exec} at {} while the earlier run under {l} on x{} (started {}) still runs: the runs overlap (M32: a retry waits until the earlier run is stopped or fenced, E12)",
                        secs(w.now),
                        r.exec,
                        secs(r.start)
                    ),
                );
            }
            if !self.ended.contains_key(l) {
                return fail(
                    "I1",
                    format!(
                        "{job}: attempt under {lease} starts on x{exec} while the mill still holds the earlier lease {l} (M32)"
                    ),
                );
            }
        }
        if !earlier.is_empty() {
            self.retry_starts += 1;
        }
        // The jobs the executor holds: a leftover run of a replaced store (being stopped at
        // once) or one a lying executor forgot is no seat of its; E14's grace and I1's
        // ended-lease bound hold those.
        let cap = p.cfg.total_capacity() as usize;
        let held = p.engine.values().filter(|j| j.attached).count();
        if held > cap {
            return fail(
                "I6",
                format!("x{exec}'s engine runs {held} jobs it holds, capacity {cap}"),
            );
        }
        self.runs.insert(
            lease,
            EngineRun {
                exec,
                job,
                epoch: p.store.epoch,
                start: w.now,
                exited: None,
            },
        );
        self.job_runs.entry(job).or_default().push(lease);
        self.running.insert(lease);
        Ok(())
    }

    /// The engine was told to stop `lease`.
    pub fn stop(&mut self, lease: LeaseId) {
        self.stopped.insert(lease);
    }

    /// The engine's job under `lease` is gone (exited, or died with its executor).
    pub fn exited(&mut self, lease: LeaseId, now: Micros, success: bool) {
        if let Some(r) = self.runs.get_mut(&lease) {
            r.exited.get_or_insert((now, success));
        }
        self.running.remove(&lease);
        self.not_held_since.remove(&lease);
    }

    // ---- over time -----------------------------------------------------------------------

    /// Every couple of simulated seconds: I1's time bound, I9's starvation rule; I5 on the
    /// ledger every ten.
    pub fn sample(&mut self, w: &World) -> Result<(), Violation> {
        self.i1_stop_bound(w)?;
        self.i11_stop_bound(w)?;
        self.m18_timeouts(w)?;
        self.i11_cancel_sent(w)?;
        self.reservations_known(w)?;
        if (w.now / SEC) % 10 < 2 {
            self.quota_within_limits(w)?;
            self.ledger_within_limits(w)?;
        }
        if w.healed {
            self.i9_liveness(w)?;
        }
        Ok(())
    }

    fn i1_stop_bound(&mut self, w: &World) -> Result<(), Violation> {
        let held: BTreeSet<LeaseId> = match &w.mill {
            Some(m) => m.leases().map(|(l, ..)| l).collect(),
            None => w.mill_store.leases.keys().copied().collect(),
        };
        if let Some(m) = &w.mill {
            let mut jobs = BTreeSet::new();
            for (lease, job, ..) in m.leases() {
                if !jobs.insert(job) {
                    return fail(
                        "I1",
                        format!("the mill holds two leases for {job} (one is {lease})"),
                    );
                }
            }
        }
        for &lease in &self.running {
            if held.contains(&lease) || self.stopped.contains(&lease) {
                self.not_held_since.remove(&lease);
                continue;
            }
            let since = *self.not_held_since.entry(lease).or_insert(w.now);
            if w.now.saturating_sub(since) > self.bounds.stop {
                let run = &self.runs[&lease];
                let ended = self
                    .ended
                    .get(&lease)
                    .map_or("never stored".to_string(), |t| secs(*t));
                return fail(
                    "I1",
                    format!(
                        "x{} still runs {} under {lease} (mill ended the lease: {ended}) and was not told to stop within {}",
                        run.exec,
                        run.job,
                        secs(self.bounds.stop)
                    ),
                );
            }
        }
        Ok(())
    }

    /// A client's cancel of `job` was answered Ok by a mill that did not crash in that step;
    /// `before` is the job's state just before the cancel (I11).
    ///
    /// The time bound, when the node was connected and ready at `at` (the mill sends the
    /// `CancelAttempt` at once, M26): if the session stays up, the ack came back within
    /// `cancel_ack_timeout` (else the mill closes the session), so the executor received
    /// the cancel by `at + cancel_ack_timeout` and asked its engine to stop in that same
    /// step (E7); an engine honouring `StopJob` ends within the executor's `stop_grace`.
    /// Hence `deadline = at + cancel_ack_timeout + stop_grace`, checked while one of the
    /// node's connections that were live at `at` is still open at both ends. If the node is
    /// cut off instead, the mill ends the lease at grace expiry (M5, Cancelled) and I1's
    /// ended-lease bound (E12: `reconnect_grace + silence_timeout` + slack) applies.
    pub fn cancel_accepted(&mut self, w: &World, job: JobId, before: Option<JobState>) {
        let target = match &before {
            Some(JobState::Reserved { lease, node } | JobState::Running { lease, node }) => {
                exec_index(w, node).map(|e| (e, *lease))
            }
            _ => None,
        };
        let mut deadline = None;
        let mut teardown = None;
        if let (Some((exec, lease)), Some(m)) = (target, &w.mill) {
            let p = &w.execs[exec];
            let epoch = self.leases.get(&lease).map(|r| r.epoch);
            // The mill sends the cancel at once when the node's session is connected and
            // recovered (M26); `ready` would also demand no pending cancel, which this very
            // cancel has just made true.
            let ready = m
                .session_views()
                .any(|v| v.node == &p.node && v.connected && !v.in_grace && Some(v.epoch) == epoch);
            let conns: Vec<ConnId> = w
                .net
                .conns
                .iter()
                .filter(|(_, c)| {
                    c.exec == exec && c.mill_open && c.exec_open && c.mill_inc == w.mill_inc
                })
                .map(|(id, _)| *id)
                .collect();
            if ready && !conns.is_empty() {
                let bound = dur(w.mill_cfg.cancel_ack_timeout) + dur(p.cfg.stop_grace);
                // The teardown deadline is a timer of the mill's: a lagging driver may
                // handle it up to its lag late (I12), inside the slack.
                let end = dur(w.mill_cfg.cancel_ack_timeout)
                    + dur(w.mill_cfg.cancel_teardown_timeout)
                    + 5 * SEC;
                teardown = Some((w.now + end, conns.clone()));
                deadline = Some((w.now + bound, conns));
            }
        }
        self.cancels.entry(job).or_insert(CancelRec {
            at: w.now,
            mill_inc: w.mill_inc,
            target,
            deadline,
            teardown,
        });
    }

    /// Takes the I11 deadlines (`which` of each cancel) that `now` has passed.
    fn take_due(
        &mut self,
        now: Micros,
        which: fn(&mut CancelRec) -> &mut Option<Due>,
    ) -> Vec<(JobId, Micros, Vec<ConnId>)> {
        let mut due = Vec::new();
        for (job, c) in &mut self.cancels {
            let slot = which(c);
            if slot.as_ref().is_some_and(|(d, _)| now > *d) {
                if let Some((d, conns)) = slot.take() {
                    due.push((*job, d, conns));
                }
            }
        }
        due
    }

    /// I11 with M26's teardown deadline: a cancel accepted while the job's node was
    /// connected and ready ends the job in the mill's books within `cancel_ack_timeout +
    /// cancel_teardown_timeout` (+ slack for a lagging driver) as long as that connection
    /// stays open and the mill does not restart — even when the engine never stops (a kill
    /// that does not take): the user's cancel must not wait on a stuck process.
    fn i11_teardown_bound(&mut self, w: &World) -> Result<(), Violation> {
        for (job, deadline, conns) in self.take_due(w.now, |c| &mut c.teardown) {
            let Some(c) = self.cancels.get(&job) else {
                continue;
            };
            if c.mill_inc != w.mill_inc
                || self.terminals.contains_key(&job)
                || !still_connected(w, &conns)
            {
                continue;
            }
            return fail(
                "I11",
                format!(
                    "{job}: cancel accepted at {} (leased as {:?}), node connected throughout, yet the mill has recorded no terminal by {} (M26: cancel_ack_timeout + cancel_teardown_timeout)",
                    secs(c.at),
                    c.target,
                    secs(deadline)
                ),
            );
        }
        Ok(())
    }

    /// I11 with M26's "a cancel for a disconnected node is sent when its session becomes
    /// ready": once the mill has reconciled the job's node on a connection (same epoch as
    /// the lease; a restored mill too, M29), a `CancelAttempt` for the lease has gone out
    /// on that connection — unless the lease has ended, or the executor already received
    /// the cancel on an earlier connection (it is stopping the job; E7).
    fn i11_cancel_sent(&mut self, w: &World) -> Result<(), Violation> {
        let Some(m) = &w.mill else {
            return Ok(());
        };
        for (job, c) in &self.cancels {
            let Some((exec, lease)) = c.target else {
                continue;
            };
            // Across a mill restart too: the cancel is durable and the restored mill sends it
            // again at reconcile (M29).
            if self.terminals.contains_key(job) || self.cancel_seen.contains_key(&(exec, lease)) {
                continue;
            }
            let p = &w.execs[exec];
            let live = w
                .mill_store
                .leases
                .get(&lease)
                .is_some_and(|l| l.node == p.node);
            let Some(epoch) = self.leases.get(&lease).map(|r| r.epoch) else {
                continue;
            };
            if !live {
                continue;
            }
            let Some(v) = m.session_views().find(|v| v.node == &p.node) else {
                continue;
            };
            let (Some(conn), true) = (v.conn, v.reconciled) else {
                continue;
            };
            if v.epoch != epoch || self.cancel_sent.get(&lease) == Some(&conn) {
                continue;
            }
            return fail(
                "I11",
                format!(
                    "{job}: cancel accepted at {} for {lease} on x{exec}; the mill reconciled x{exec} on {conn} but sent no CancelAttempt there (M26: a cancel waiting for its node goes out when the session is ready)",
                    secs(c.at)
                ),
            );
        }
        Ok(())
    }

    /// M18 through I11: a job whose own timeout has passed is cancelled by the mill. The
    /// clock starts at acceptance and starts again at a mill restart (the restored mill
    /// re-arms every job's timeout from its own start, M29). Once `timeout + 5 s` (a lagging
    /// driver's slack) has passed on a running mill, a job still queued is a failure (its
    /// timeout ends it at once), and a leased job is held to I11 as if a client had
    /// cancelled it then: its cancel goes out, its engine stops, its terminal is Timeout or
    /// Cancelled unless the engine's own result beat the cancel to the executor.
    fn m18_timeouts(&mut self, w: &World) -> Result<(), Violation> {
        if w.mill.is_none() {
            return Ok(());
        }
        if self.timeouts_inc != w.mill_inc {
            self.timeouts_inc = w.mill_inc;
            for (start, _) in self.timeouts.values_mut() {
                *start = (*start).max(w.now);
            }
        }
        let now = w.now;
        let due: Vec<JobId> = self
            .timeouts
            .iter()
            .filter(|(_, (start, t))| now > start.saturating_add(*t).saturating_add(5 * SEC))
            .map(|(j, _)| *j)
            .collect();
        for job in due {
            let Some((start, t)) = self.timeouts.remove(&job) else {
                continue;
            };
            if self.terminals.contains_key(&job) {
                continue;
            }
            let state = w.mill_store.jobs.get(&job).map(|r| r.state.clone());
            match state {
                Some(JobState::Queued) => {
                    return fail(
                        "I11",
                        format!(
                            "{job}: its timeout ({}) ran out at {} while it was queued, yet it is still queued (M18)",
                            secs(t),
                            secs(start + t)
                        ),
                    );
                }
                Some(before @ (JobState::Reserved { .. } | JobState::Running { .. })) => {
                    self.cancel_accepted(w, job, Some(before));
                }
                Some(JobState::Done(_)) | None => {}
            }
        }
        Ok(())
    }

    /// Executor `exec` received a `CancelAttempt` for `lease` (I11).
    pub fn cancel_delivered(&mut self, exec: usize, lease: LeaseId, now: Micros) {
        self.cancel_seen.entry((exec, lease)).or_insert(now);
    }

    /// I11's time bound (see [`Checker::cancel_accepted`]): past the deadline, an engine
    /// still runs the cancelled job although the node stayed connected. An engine that
    /// ignores stops (`slow_stop`: it models a kill that does not take) is left to M26's
    /// teardown deadline and I1's bound.
    fn i11_stop_bound(&mut self, w: &World) -> Result<(), Violation> {
        self.i11_teardown_bound(w)?;
        for (job, deadline, conns) in self.take_due(w.now, |c| &mut c.deadline) {
            let Some(c) = self.cancels.get(&job) else {
                continue;
            };
            let (at, target) = (c.at, c.target);
            if !still_connected(w, &conns) {
                continue;
            }
            let Some(runs) = self.job_runs.get(&job) else {
                continue;
            };
            for lease in runs {
                let r = &self.runs[lease];
                if r.exited.is_some() {
                    continue;
                }
                let hung = w.execs[r.exec].engine.get(lease).is_some_and(|e| e.hung);
                if hung {
                    continue;
                }
                let seen = self
                    .cancel_seen
                    .get(&(r.exec, *lease))
                    .map_or("never".to_string(), |t| secs(*t));
                return fail(
                    "I11",
                    format!(
                        "{job}: cancel accepted at {} (leased as {target:?}), node connected throughout, yet x{} still runs it under {lease} past {} (cancel_ack_timeout + stop_grace); the cancel reached x{} {seen}",
                        secs(at),
                        r.exec,
                        secs(deadline),
                        r.exec
                    ),
                );
            }
        }
        Ok(())
    }

    /// Every seat an executor has reserved is known to the mill: as an ask of a live bid
    /// round, a stray (an ask whose round is over, released when its answer or deadline
    /// comes), or a lease of that node (M12, M16). Checked on every sample while the mill
    /// is up, for honest executors. Excused, because the seat is already being let go:
    /// - the mill sent `ReleaseLease` or `CancelAttempt` for it (in flight, or lost with its
    ///   connection: the next snapshot reports it and M8 cancels it, or its ttl ends it, E3);
    /// - the `ReserveSeat` went out on a connection the mill no longer has open, or from a
    ///   mill that crashed since: asks are volatile and die with the session (M8 cancels
    ///   what the next snapshot reports; the ttl, at most `reconnect_grace`, bounds it).
    ///
    /// What is left is a mill that forgot a reservation on a live session without telling
    /// the executor: a seat held for nothing until its ttl runs out.
    fn reservations_known(&self, w: &World) -> Result<(), Violation> {
        let Some(m) = &w.mill else {
            return Ok(());
        };
        for (i, p) in w.execs.iter().enumerate() {
            let Some(x) = &p.exec else {
                continue;
            };
            if !p.honest() {
                continue;
            }
            for lease in x.reserved_leases() {
                let asked_here = w.leases.get(&lease).is_some_and(|l| l.exec == i);
                // A deposed mill that still runs knows what it asked (DESIGN §10).
                let by_deposed = w.deposed.as_ref().is_some_and(|d| {
                    (d.mill.is_ask(lease) && asked_here)
                        || d.mill.stray(lease) == Some(&p.node)
                        || d.mill.lease_node(lease) == Some(&p.node)
                });
                let known = (m.is_ask(lease) && asked_here)
                    || m.stray(lease) == Some(&p.node)
                    || m.lease_node(lease) == Some(&p.node)
                    || by_deposed;
                if known || self.let_go.contains(&lease) {
                    continue;
                }
                let Some(&(conn, inc)) = self.ask_conn.get(&lease) else {
                    return fail(
                        "reservations-known",
                        format!("x{i} holds a seat for {lease}, which the mill never asked of it"),
                    );
                };
                let live = inc == w.mill_inc && w.net.conns.get(&conn).is_some_and(|c| c.mill_open);
                if live {
                    return fail(
                        "reservations-known",
                        format!(
                            "x{i} holds a seat for {lease} (asked on {conn}, still open), but the mill knows it as no ask, stray or lease and never released it (M12)"
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// I9 after the heal: a free compatible seat takes a waiting job within the protocol's
    /// allowances, and every job ends by a bound computed from the work ahead of it
    /// (`crate::liveness`, where the formula is).
    fn i9_liveness(&mut self, w: &World) -> Result<(), Violation> {
        if w.mill.is_some() && self.fences_inc != w.mill_inc {
            self.fences_inc = w.mill_inc;
            let again = w.now.saturating_add(fence_len(w));
            for until in self.fences.values_mut() {
                *until = (*until).max(again);
            }
        }
        let open: Vec<crate::liveness::OpenJob> = self
            .accepted
            .iter()
            .filter(|(j, _)| !self.terminals.contains_key(j))
            .map(|(&job, &arrival)| crate::liveness::OpenJob {
                job,
                arrival,
                ran: self.job_runs.get(&job).is_some_and(|runs| {
                    runs.iter().any(|l| {
                        self.runs.get(l).is_some_and(|r| r.exited.is_some())
                            && !self.ended.contains_key(l)
                    })
                }),
                fenced_until: self.fences.get(&job).copied(),
                retried: self.attempts.get(&job).map_or(0, |a| a.retried),
            })
            .collect();
        let a = self.bounds.live;
        self.live
            .check(w, &a, &open, &self.accepted, &self.quarantined)
    }

    /// Every job ended after the heal, yet the system is still not quiet past I9's allowance.
    pub fn quiet_overdue(&self, now: Micros) -> bool {
        self.live.quiet_overdue(now)
    }

    /// The end state, after the faults healed and every job ended (I2, I5, I6, I8, I9).
    pub fn quiescent(&self, w: &World) -> Result<(), Violation> {
        if let Some(job) = self.open_jobs().first() {
            return fail("I9", format!("{job} never reached a terminal"));
        }
        for job in self.terminals.keys() {
            if !self.inserted.contains(job) {
                return fail(
                    "I2",
                    format!("terminal for {job}, which was never accepted"),
                );
            }
        }
        let Some(mill) = &w.mill else {
            return fail("I9", "the mill is down at the end".into());
        };
        if let Some((lease, job, node, ..)) = mill.leases().next() {
            return fail(
                "I6",
                format!("the mill still holds {lease} of {job} on {node}"),
            );
        }
        if !w.mill_store.leases.is_empty() || !w.mill_store.jobs.is_empty() {
            return fail(
                "I6",
                format!(
                    "the mill's store still holds {} leases and {} jobs",
                    w.mill_store.leases.len(),
                    w.mill_store.jobs.len()
                ),
            );
        }
        if let Some((job, ..)) = mill.quota().holds().next() {
            return fail("I5", format!("quota still held for {job} at quiescence"));
        }
        if mill.quota().waiting() > 0 || !w.mill_store.quota_holds.is_empty() {
            return fail(
                "I5",
                "quota waiters or durable holds remain at quiescence".into(),
            );
        }
        for (i, p) in w.execs.iter().enumerate() {
            if p.lost {
                continue; // its host died for good (`Fault::Lose`)
            }
            let Some(x) = &p.exec else {
                return fail("I9", format!("x{i} is down at the end"));
            };
            if let Some(l) = x.reserved_leases().chain(x.running_leases()).next() {
                return fail("I6", format!("x{i} still holds {l} at quiescence"));
            }
            if x.durable() != &p.store {
                return fail(
                    "persist-before-send",
                    format!("x{i}'s store differs from what it believes is durable"),
                );
            }
            let quarantined = mill.quarantined().contains(&p.node);
            if p.violator() && !quarantined {
                return fail(
                    "I8",
                    format!(
                        "misbehaving x{i} ({}) was never quarantined",
                        p.spec.byzantine.map_or("", |k| k.name())
                    ),
                );
            }
            if !p.violator() && quarantined {
                return fail("I8", format!("x{i}, no violator, was quarantined"));
            }
            if p.honest() && !p.store.outbox.is_empty() {
                return fail(
                    "I4",
                    format!(
                        "x{i}'s outbox still holds {} unacked events",
                        p.store.outbox.len()
                    ),
                );
            }
        }
        if let Some(l) = self.running.first() {
            return fail("I1", format!("an engine still runs {l} at the end"));
        }
        Ok(())
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
