//! Rule tests for the mill: a small harness feeds inputs and collects outputs; tests assert
//! what was sent, persisted and reported, never internals. Each test names its rule.

mod cancel;
mod direct;
mod events;
mod keys;
mod placement;
mod restart;
mod retries;
mod review;
mod sessions;
mod staging;
mod term;
mod timers;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::*;
use crate::job::{JobSpec, TerminalStatus};
use crate::testkit;
use crate::wire::{EngineStatus, EventKind, RejectKind, ToExecutor, ToMill};

pub(super) const SEC: Duration = Duration::from_secs(1);

/// A mill, a clock, and the outputs of the last step.
pub(super) struct H {
    pub mill: Mill,
    pub now: Time,
    pub out: Vec<MillOutput>,
    /// Every output ever, for order checks.
    pub all: Vec<MillOutput>,
    /// The in-memory durable store, fed by every `Persist`.
    pub store: MillSnapshot,
    next_conn: u64,
    snap_seq: BTreeMap<ConnId, u64>,
}

/// The test mill's settings: the defaults but a token, and placement by bid (M12) — the
/// tests of direct placement (M35) turn it on themselves.
pub(super) fn config() -> MillConfig {
    MillConfig {
        executor_token: Some("secret".into()),
        direct_placement: false,
        ..MillConfig::default()
    }
}

/// The `Welcome` the test mill (on [`config`]) sends with cursor `cursor` (M1).
pub(super) fn welcome(cursor: u64) -> ToExecutor {
    ToExecutor::Welcome {
        term: crate::types::Term(1),
        cursor: Seqno(cursor),
        timers: config().session_timers(),
    }
}

pub(super) fn spec() -> JobSpec {
    testkit::shell_job("acme", "echo hi")
}

pub(super) fn node(s: &str) -> NodeId {
    NodeId::new(s).unwrap()
}

pub(super) fn charge(pairs: &[(&str, u64)]) -> Resources {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

pub(super) fn engines(available: bool, load: f64) -> BTreeMap<String, EngineStatus> {
    testkit::engine("shell", available, 4, "seats", load)
}

pub(super) fn terminal(status: TerminalStatus) -> EventKind {
    testkit::terminal(status)
}

impl H {
    pub fn new() -> Self {
        Self::with(config())
    }

    pub fn with(config: MillConfig) -> Self {
        Self::restart_from(config, None, Time::from_micros(1_000_000))
    }

    pub fn restart_from(config: MillConfig, snapshot: Option<MillSnapshot>, now: Time) -> Self {
        let store = snapshot.clone().unwrap_or_default();
        let mill = Mill::new(config, snapshot, now).unwrap();
        let mut h = H {
            mill,
            now,
            out: Vec::new(),
            all: Vec::new(),
            store,
            next_conn: 1,
            snap_seq: BTreeMap::new(),
        };
        h.drain();
        h
    }

    /// Restarts the mill from what it persisted so far.
    pub fn restart(&mut self) {
        let config = self.mill.config().clone();
        let next_conn = self.next_conn;
        *self = H::restart_from(config, Some(self.store.clone()), self.now.plus(SEC));
        self.next_conn = next_conn;
    }

    /// Drains one step's outputs. Asserts the persist-before-send discipline on every step
    /// of every test: at most one `Persist`, and nothing that depends on it before it — only
    /// asks whose lease id is already durable (M12, M30) may lead it.
    fn drain(&mut self) {
        self.out.clear();
        let mut effects_seen = false;
        let mut persists = 0;
        while let Some(o) = self.mill.poll_output() {
            match &o {
                MillOutput::Send {
                    msg: ToExecutor::ReserveSeat { lease, .. },
                    ..
                } if persists == 0 && !effects_seen => {
                    assert!(
                        *lease < self.store.lease_floor,
                        "an ask ahead of the step's Persist uses lease {lease}, not durable \
                         below the floor {} (M30)",
                        self.store.lease_floor
                    );
                }
                MillOutput::Persist(_) => {
                    assert!(
                        !effects_seen,
                        "a Persist after a send in one step: {:?}",
                        self.out
                    );
                    persists += 1;
                    assert_eq!(persists, 1, "more than one Persist in one step");
                }
                MillOutput::Send { .. }
                | MillOutput::Close { .. }
                | MillOutput::JobUpdate { .. }
                | MillOutput::LiveLog { .. }
                | MillOutput::Observed(_) => effects_seen = true,
            }
            if let MillOutput::Persist(b) = &o {
                self.store.apply(b);
            }
            self.out.push(o.clone());
            self.all.push(o);
        }
    }

    /// Feeds a network or time input (it cannot be refused: `Ok` always, so tests read
    /// alike whatever the input).
    pub fn input(&mut self, input: MillInput) -> Result<(), RequestError> {
        self.mill.handle(self.now, input);
        self.drain();
        Ok(())
    }

    pub fn submit_req(&mut self, spec: JobSpec) -> Result<JobId, RequestError> {
        let r = self.mill.submit(self.now, spec, 0);
        self.drain();
        r
    }

    pub fn cancel_req(&mut self, job: JobId, reason: String) -> Result<(), RequestError> {
        let r = self.mill.cancel(self.now, job, reason);
        self.drain();
        r
    }

    pub fn lift_req(&mut self, node: NodeId) -> Result<(), RequestError> {
        let r = self.mill.lift_quarantine(self.now, node);
        self.drain();
        r
    }

    pub fn msg(&mut self, conn: ConnId, msg: ToMill) {
        self.input(MillInput::Message { conn, msg }).unwrap();
    }

    /// Moves the clock and fires every deadline due, one tick per deadline.
    pub fn advance(&mut self, d: Duration) {
        let target = self.now.plus(d);
        let mut collected = Vec::new();
        while let Some(t) = self.mill.next_deadline() {
            if t > target {
                break;
            }
            self.now = self.now.max(t);
            self.input(MillInput::Tick).unwrap();
            collected.append(&mut self.out);
        }
        self.now = target;
        self.input(MillInput::Tick).unwrap();
        collected.append(&mut self.out);
        self.out = collected;
    }

    /// Advances `d` in 5 s steps, with `conn` snapshotting so the session stays live;
    /// `out` holds everything of the whole span.
    pub fn keep_alive(&mut self, conn: ConnId, d: Duration, active: &[LeaseId]) {
        let mut collected = Vec::new();
        let mut left = d;
        while !left.is_zero() {
            let step = left.min(5 * SEC);
            left -= step;
            self.advance(step);
            collected.append(&mut self.out);
            self.snapshot(conn, 0.0, active);
            collected.append(&mut self.out);
        }
        self.out = collected;
    }

    pub fn hello_as(&mut self, name: &str, epoch: u64, labels: &[&str]) -> ConnId {
        let conn = ConnId(self.next_conn);
        self.next_conn += 1;
        self.input(MillInput::Connected { conn }).unwrap();
        let hello = testkit::Hello::new(name, Epoch(epoch))
            .token("secret")
            .labels(labels)
            .build();
        self.msg(conn, hello);
        conn
    }

    pub fn snapshot(&mut self, conn: ConnId, load: f64, active: &[LeaseId]) {
        self.snapshot_with(conn, engines(true, load), active);
    }

    pub fn snapshot_with(
        &mut self,
        conn: ConnId,
        engines: BTreeMap<String, EngineStatus>,
        active: &[LeaseId],
    ) {
        self.snapshot_marked(conn, engines, active, 0);
    }

    /// A snapshot announcing events up to `outbox_high` (DESIGN §3).
    pub fn snapshot_marked(
        &mut self,
        conn: ConnId,
        engines: BTreeMap<String, EngineStatus>,
        active: &[LeaseId],
        outbox_high: u64,
    ) {
        let seq = self.snap_seq.entry(conn).or_insert(0);
        *seq += 1;
        let seqno = *seq;
        let snapshot = testkit::snapshot(seqno, engines, active.to_vec(), Seqno(outbox_high));
        self.msg(conn, snapshot);
    }

    /// A connected, reconciled executor with no leases.
    pub fn ready(&mut self, name: &str, load: f64) -> ConnId {
        let conn = self.hello_as(name, 1, &[]);
        self.snapshot(conn, load, &[]);
        conn
    }

    pub fn submit(&mut self, spec: JobSpec) -> JobId {
        match self.submit_req(spec) {
            Ok(j) => j,
            other => panic!("submit: {other:?}"),
        }
    }

    pub fn sent(&self, conn: ConnId) -> Vec<ToExecutor> {
        self.out
            .iter()
            .filter_map(|o| match o {
                MillOutput::Send { conn: c, msg } if *c == conn => Some(msg.clone()),
                _ => None,
            })
            .collect()
    }

    /// Lease ids of the `ReserveSeat`s sent to `conn` in the last step.
    pub fn asks(&self, conn: ConnId) -> Vec<LeaseId> {
        self.sent(conn)
            .into_iter()
            .filter_map(|m| match m {
                ToExecutor::ReserveSeat { lease, .. } => Some(lease),
                _ => None,
            })
            .collect()
    }

    pub fn commits(&self, conn: ConnId) -> Vec<LeaseId> {
        self.sent(conn)
            .into_iter()
            .filter_map(|m| match m {
                ToExecutor::CommitLease { lease, .. } => Some(lease),
                _ => None,
            })
            .collect()
    }

    pub fn releases(&self, conn: ConnId) -> Vec<LeaseId> {
        self.sent(conn)
            .into_iter()
            .filter_map(|m| match m {
                ToExecutor::ReleaseLease { term: _, lease } => Some(lease),
                _ => None,
            })
            .collect()
    }

    pub fn cancels(&self, conn: ConnId) -> Vec<LeaseId> {
        self.sent(conn)
            .into_iter()
            .filter_map(|m| match m {
                ToExecutor::CancelAttempt { lease, .. } => Some(lease),
                _ => None,
            })
            .collect()
    }

    pub fn closed(&self, conn: ConnId) -> Option<String> {
        self.out.iter().find_map(|o| match o {
            MillOutput::Close { conn: c, reason } if *c == conn => Some(reason.clone()),
            _ => None,
        })
    }

    pub fn refused(&self, conn: ConnId) -> Option<String> {
        self.sent(conn).into_iter().find_map(|m| match m {
            ToExecutor::Refused { leader: _, reason } => Some(reason),
            _ => None,
        })
    }

    pub fn writes(&self) -> Vec<MillWrite> {
        self.out
            .iter()
            .filter_map(|o| match o {
                MillOutput::Persist(b) => Some(b.writes.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    pub fn updates(&self) -> Vec<(JobId, JobState)> {
        self.out
            .iter()
            .filter_map(|o| match o {
                MillOutput::JobUpdate { job, state } => Some((*job, state.clone())),
                _ => None,
            })
            .collect()
    }

    /// `job`'s terminal, if any step so far (since the last restart) ended it.
    pub fn ended(&self, job: JobId) -> Option<Terminal> {
        self.all.iter().find_map(|o| match o {
            MillOutput::JobUpdate {
                job: j,
                state: JobState::Done(t),
            } if *j == job => Some(t.clone()),
            _ => None,
        })
    }

    pub fn terminal_of(&self, job: JobId) -> Option<Terminal> {
        self.updates().into_iter().find_map(|(j, s)| match s {
            JobState::Done(t) if j == job => Some(t),
            _ => None,
        })
    }

    pub fn violations(&self) -> Vec<String> {
        self.out
            .iter()
            .filter_map(|o| match o {
                MillOutput::Observed(Observation::Violation { reason, .. }) => Some(reason.clone()),
                _ => None,
            })
            .collect()
    }

    /// The kinds of this step's violations, in order.
    pub fn violation_kinds(&self) -> Vec<ViolationKind> {
        self.out
            .iter()
            .filter_map(|o| match o {
                MillOutput::Observed(Observation::Violation { kind, .. }) => Some(*kind),
                _ => None,
            })
            .collect()
    }

    pub fn rare(&self, path: RarePath) -> bool {
        self.out
            .iter()
            .any(|o| matches!(o, MillOutput::Observed(Observation::Rare(p)) if *p == path))
    }

    pub fn accept(&mut self, conn: ConnId, lease: LeaseId, resources: Resources) {
        self.msg(conn, testkit::accept(lease, resources));
    }

    pub fn reject(&mut self, conn: ConnId, lease: LeaseId, kind: RejectKind, why: &str) {
        self.msg(conn, testkit::reject(lease, kind, why));
    }

    pub fn committed(&mut self, conn: ConnId, lease: LeaseId) {
        self.msg(conn, testkit::commit_result(lease, true));
    }

    pub fn events(&mut self, conn: ConnId, epoch: u64, events: Vec<(u64, LeaseId, EventKind)>) {
        let events = events
            .into_iter()
            .map(|(seqno, lease, kind)| testkit::event(Seqno(seqno), lease, kind))
            .collect();
        self.msg(conn, testkit::batch(Epoch(epoch), events));
    }

    /// Submits a job and runs it to `Running` on the single ready executor `conn`.
    pub fn run_on(&mut self, conn: ConnId, spec: JobSpec) -> (JobId, LeaseId) {
        let job = self.submit(spec);
        let asks = self.asks(conn);
        assert_eq!(asks.len(), 1, "one ask expected, got {:?}", self.out);
        let lease = asks[0];
        self.accept(conn, lease, charge(&[("jobs", 1)]));
        assert_eq!(self.commits(conn), vec![lease]);
        self.committed(conn, lease);
        assert!(matches!(
            self.mill.job_state(job),
            Some(JobState::Running { .. })
        ));
        (job, lease)
    }
}
