//! Executor rules E1–E12, one behaviour per test, asserting outputs.
//!
//! The harness keeps its own store, built only from `Persist` outputs, and checks after every
//! step that (a) every event sent was persisted by an earlier output and (b) the store equals
//! what the executor believes is durable.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::*;
use crate::job::{Identity, JobSpec, LogRef, TerminalStatus};
use crate::types::{ConnId, Epoch, JobId, LeaseId, NodeId, Resources, Seqno, Time};
use crate::wire::{EndCause, Event, EventKind, RejectKind, SessionTimers, ToExecutor, ToMill};

mod term;

const EPOCH: Epoch = Epoch(7);
const L1: LeaseId = LeaseId(1);
const L2: LeaseId = LeaseId(2);
const L3: LeaseId = LeaseId(3);

fn config() -> ExecutorConfig {
    let mut c = ExecutorConfig::new(NodeId::new("exec-1").unwrap(), "secret-token");
    c.labels = BTreeSet::from(["linux".to_string()]);
    c.engines = BTreeMap::from([
        (
            "shell".to_string(),
            EngineConfig {
                capacity: 1,
                resources: Resources::from([("cpu_millis".to_string(), 4000)]),
            },
        ),
        ("docker".to_string(), EngineConfig::seats(2)),
    ]);
    c.backoff_seed = 42;
    c
}

/// [`config`] with two shell seats sharing 1,500 cpu_millis: a job of [`spec`] (1,000)
/// fits once, so the second seat is free but short of cpu (M34).
fn two_seats_short_of_cpu() -> ExecutorConfig {
    let mut c = config();
    c.engines.insert(
        "shell".into(),
        EngineConfig {
            capacity: 2,
            resources: Resources::from([("cpu_millis".to_string(), 1500)]),
        },
    );
    c
}

fn spec(engine: &str) -> JobSpec {
    JobSpec {
        retry: Default::default(),
        priority: 0,
        node: None,
        engine: engine.into(),
        labels: BTreeSet::from(["linux".to_string()]),
        resources: Resources::from([("cpu_millis".to_string(), 1000)]),
        identity: Identity {
            owner: "acme".into(),
            repo: "acme/app".into(),
        },
        timeout: None,
        payload: b"make test".to_vec(),
        env: Default::default(),
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// One output, named; exhaustive over outputs and messages so a new variant fails here.
fn name(o: &ExecutorOutput) -> String {
    match o {
        ExecutorOutput::Connect { .. } => "connect".into(),
        ExecutorOutput::Send { msg, .. } => format!("send:{}", msg_name(msg)),
        ExecutorOutput::Close { .. } => "close".into(),
        ExecutorOutput::Persist(_) => "persist".into(),
        ExecutorOutput::StartJob { .. } => "start".into(),
        ExecutorOutput::AdoptJob { .. } => "adopt".into(),
        ExecutorOutput::StopJob { .. } => "stop".into(),
    }
}

fn msg_name(m: &ToMill) -> &'static str {
    match m {
        ToMill::Hello { .. } => "Hello",
        ToMill::Snapshot { .. } => "Snapshot",
        ToMill::ReserveResult { .. } => "ReserveResult",
        ToMill::CommitResult { .. } => "CommitResult",
        ToMill::EventBatch { .. } => "EventBatch",
        ToMill::CancelAck { .. } => "CancelAck",
        ToMill::LiveLog { .. } => "LiveLog",
        ToMill::Stale { .. } => "Stale",
    }
}

fn names(outs: &[ExecutorOutput]) -> Vec<String> {
    outs.iter().map(name).collect()
}

fn sent(outs: &[ExecutorOutput]) -> Vec<ToMill> {
    outs.iter()
        .filter_map(|o| match o {
            ExecutorOutput::Send { msg, .. } => Some(msg.clone()),
            ExecutorOutput::Connect { .. }
            | ExecutorOutput::Close { .. }
            | ExecutorOutput::Persist(_)
            | ExecutorOutput::StartJob { .. }
            | ExecutorOutput::AdoptJob { .. }
            | ExecutorOutput::StopJob { .. } => None,
        })
        .collect()
}

/// Every write of `outs` but the fence clock's (E12), which rides along on batches and has
/// tests of its own (`contacts`).
fn writes(outs: &[ExecutorOutput]) -> Vec<ExecutorWrite> {
    all_writes(outs)
        .into_iter()
        .filter(|w| !matches!(w, ExecutorWrite::Contact { .. }))
        .collect()
}

fn all_writes(outs: &[ExecutorOutput]) -> Vec<ExecutorWrite> {
    outs.iter()
        .filter_map(|o| match o {
            ExecutorOutput::Persist(b) => Some(b.writes.clone()),
            ExecutorOutput::Connect { .. }
            | ExecutorOutput::Send { .. }
            | ExecutorOutput::Close { .. }
            | ExecutorOutput::StartJob { .. }
            | ExecutorOutput::AdoptJob { .. }
            | ExecutorOutput::StopJob { .. } => None,
        })
        .flatten()
        .collect()
}

/// The last contacts `outs` writes (E12).
fn contacts(outs: &[ExecutorOutput]) -> Vec<Time> {
    all_writes(outs)
        .into_iter()
        .filter_map(|w| match w {
            ExecutorWrite::Contact { at } => Some(at),
            _ => None,
        })
        .collect()
}

fn batches(outs: &[ExecutorOutput]) -> Vec<Vec<Event>> {
    sent(outs)
        .into_iter()
        .filter_map(|m| match m {
            ToMill::EventBatch { events, .. } => Some(events),
            _ => None,
        })
        .collect()
}

fn outbox_highs(outs: &[ExecutorOutput]) -> Vec<Seqno> {
    sent(outs)
        .into_iter()
        .filter_map(|m| match m {
            ToMill::Snapshot { outbox_high, .. } => Some(outbox_high),
            _ => None,
        })
        .collect()
}

fn snapshots(outs: &[ExecutorOutput]) -> Vec<(u64, BTreeMap<String, bool>, Vec<LeaseId>)> {
    sent(outs)
        .into_iter()
        .filter_map(|m| match m {
            ToMill::Snapshot {
                seqno,
                engines,
                active_leases,
                ..
            } => Some((
                seqno,
                engines
                    .iter()
                    .map(|(k, v)| (k.clone(), v.available))
                    .collect(),
                active_leases,
            )),
            _ => None,
        })
        .collect()
}

fn reserve_result(outs: &[ExecutorOutput]) -> (bool, Option<RejectKind>, String, Resources) {
    let found = sent(outs).into_iter().find_map(|m| match m {
        ToMill::ReserveResult {
            accepted,
            reject,
            reason,
            resources,
            ..
        } => Some((accepted, reject, reason, resources)),
        _ => None,
    });
    found.expect("a ReserveResult")
}

/// The events `outs` appends to the outbox for `lease`.
fn appended(outs: &[ExecutorOutput], lease: LeaseId) -> Vec<EventKind> {
    writes(outs)
        .into_iter()
        .filter_map(|w| match w {
            ExecutorWrite::Append(e) if e.lease == lease => Some(e.kind),
            _ => None,
        })
        .collect()
}

fn terminal(status: TerminalStatus, error: Option<&str>) -> EventKind {
    terminal_by(status, error, EndCause::Engine)
}

fn terminal_by(status: TerminalStatus, error: Option<&str>, cause: EndCause) -> EventKind {
    EventKind::Terminal {
        status,
        exit_code: None,
        error: error.map(str::to_string),
        log: None,
        cause,
    }
}

struct Harness {
    exec: Executor,
    config: ExecutorConfig,
    now: Time,
    store: ExecutorSnapshot,
    conn: Option<ConnId>,
    conns: u64,
}

impl Harness {
    fn new(config: ExecutorConfig) -> (Self, Vec<ExecutorOutput>) {
        Self::with_store(
            config,
            ExecutorSnapshot::fresh(EPOCH),
            Time::from_micros(1_000_000),
        )
    }

    fn with_store(
        config: ExecutorConfig,
        store: ExecutorSnapshot,
        now: Time,
    ) -> (Self, Vec<ExecutorOutput>) {
        let exec = Executor::try_new(config.clone(), store.clone(), now).unwrap();
        let mut h = Harness {
            exec,
            config,
            now,
            store,
            conn: None,
            conns: 0,
        };
        let outs = h.drain();
        (h, outs)
    }

    /// A welcomed executor with cursor 0 and the startup outputs drained.
    fn ready(config: ExecutorConfig) -> Self {
        let (mut h, outs) = Self::new(config);
        assert_eq!(names(&outs), ["connect"]);
        h.connect(Seqno(0));
        h
    }

    /// Crash and restart on what was persisted.
    fn restart(&mut self, advance: Duration) -> Vec<ExecutorOutput> {
        self.now = self.now.plus(advance);
        self.exec = Executor::try_new(self.config.clone(), self.store.clone(), self.now).unwrap();
        self.conn = None;
        self.drain()
    }

    fn drain(&mut self) -> Vec<ExecutorOutput> {
        let mut outs = Vec::new();
        while let Some(o) = self.exec.poll_output() {
            match &o {
                ExecutorOutput::Persist(batch) => self.store.apply(batch),
                ExecutorOutput::Send {
                    msg: ToMill::EventBatch { epoch, events },
                    ..
                } => {
                    assert_eq!(*epoch, self.store.epoch);
                    for e in events {
                        assert!(
                            self.store.outbox.contains(e),
                            "sent before persisted: {e:?}"
                        );
                    }
                }
                ExecutorOutput::Send { .. }
                | ExecutorOutput::Connect { .. }
                | ExecutorOutput::Close { .. }
                | ExecutorOutput::StartJob { .. }
                | ExecutorOutput::AdoptJob { .. }
                | ExecutorOutput::StopJob { .. } => {}
            }
            outs.push(o);
        }
        assert_eq!(
            &self.store,
            self.exec.durable(),
            "store drifted from durable"
        );
        outs
    }

    fn feed(&mut self, input: ExecutorInput) -> Vec<ExecutorOutput> {
        self.exec.handle(self.now, input);
        self.drain()
    }

    fn advance(&mut self, d: Duration) -> Vec<ExecutorOutput> {
        self.now = self.now.plus(d);
        self.feed(ExecutorInput::Tick)
    }

    /// Answers a pending `Connect` and welcomes the session with `cursor`, on the
    /// executor's own timers.
    fn connect(&mut self, cursor: Seqno) -> Vec<ExecutorOutput> {
        let timers = self.config.session_timers();
        self.connect_with(cursor, timers)
    }

    /// [`Harness::connect`] by a mill on `timers`.
    fn connect_with(&mut self, cursor: Seqno, timers: SessionTimers) -> Vec<ExecutorOutput> {
        self.connect_as(cursor, timers, crate::types::Term(1))
    }

    /// [`Harness::connect_with`] by a mill of `term` (E13).
    fn connect_as(
        &mut self,
        cursor: Seqno,
        timers: SessionTimers,
        term: crate::types::Term,
    ) -> Vec<ExecutorOutput> {
        self.conns += 1;
        let conn = ConnId(self.conns);
        let outs = self.feed(ExecutorInput::Connected { conn });
        match sent(&outs).as_slice() {
            [ToMill::Hello {
                node_id,
                epoch,
                token,
                ..
            }] => {
                assert_eq!(node_id, "exec-1");
                assert_eq!(*epoch, self.store.epoch);
                assert_eq!(token, "secret-token");
            }
            other => panic!("expected Hello, got {other:?}"),
        }
        self.conn = Some(conn);
        self.mill(ToExecutor::Welcome {
            term,
            cursor,
            timers,
        })
    }

    fn mill(&mut self, msg: ToExecutor) -> Vec<ExecutorOutput> {
        let conn = self.conn.expect("connected");
        self.feed(ExecutorInput::Message { conn, msg })
    }

    fn disconnect(&mut self) -> Vec<ExecutorOutput> {
        let conn = self.conn.take().expect("connected");
        self.feed(ExecutorInput::Disconnected { conn })
    }

    /// Advances to the next deadline and ticks; returns the gap and the outputs.
    fn until_deadline(&mut self) -> (Duration, Vec<ExecutorOutput>) {
        let deadline = self.exec.next_deadline().expect("a deadline");
        let gap = deadline.since(self.now);
        self.now = self.now.max(deadline);
        (gap, self.feed(ExecutorInput::Tick))
    }

    fn reserve(&mut self, lease: LeaseId, spec: JobSpec) -> Vec<ExecutorOutput> {
        self.ask(lease, spec, false)
    }

    /// A `ReserveSeat` for `lease` (job `lease + 100`), a bid or a direct ask (M35).
    fn ask(&mut self, lease: LeaseId, spec: JobSpec, direct: bool) -> Vec<ExecutorOutput> {
        self.mill(ToExecutor::ReserveSeat {
            term: crate::types::Term(1),
            lease,
            job: JobId(lease.get() + 100),
            spec: Box::new(spec),
            ttl: secs(45),
            direct,
        })
    }

    fn commit(&mut self, lease: LeaseId) -> Vec<ExecutorOutput> {
        let secrets = BTreeMap::from([("TOKEN".to_string(), "hunter2".to_string())]);
        self.mill(ToExecutor::CommitLease {
            term: crate::types::Term(1),
            lease,
            secrets,
        })
    }

    /// Reserve, commit and report the engine started: a running job.
    fn run(&mut self, lease: LeaseId, engine: &str) {
        let (accepted, ..) = reserve_result(&self.reserve(lease, spec(engine)));
        assert!(accepted);
        self.commit(lease);
        self.feed(ExecutorInput::JobStarted { lease });
    }

    fn exited(&mut self, lease: LeaseId, status: TerminalStatus) -> Vec<ExecutorOutput> {
        self.feed(ExecutorInput::JobExited {
            lease,
            status,
            exit_code: None,
            error: None,
            log: None,
        })
    }
}

// ---------------------------------------------------------------------------------------- E1

#[test]
fn e1_fresh_store_has_the_given_epoch_and_restart_keeps_it() {
    let mut h = Harness::ready(config());
    assert_eq!(h.exec.epoch(), EPOCH);
    h.run(L1, "shell");
    let outs = h.restart(secs(3));
    assert_eq!(h.exec.epoch(), EPOCH, "restart keeps the epoch");
    assert_eq!(names(&outs), ["adopt", "connect"]);
    h.connect(Seqno(0)); // Hello asserts the epoch

    let (wiped, _) = Harness::with_store(config(), ExecutorSnapshot::fresh(Epoch(8)), Time::ZERO);
    assert_eq!(wiped.exec.epoch(), Epoch(8), "a wiped store is a new epoch");
    assert_eq!(wiped.exec.durable().next_seqno, Seqno(1));
}

// ---------------------------------------------------------------------------------------- E2

#[test]
fn e2_reserve_accepts_a_free_seat_and_names_the_charge() {
    let mut h = Harness::ready(config());
    let outs = h.reserve(L1, spec("shell"));
    let (accepted, reject, _, resources) = reserve_result(&outs);
    assert!(accepted);
    assert_eq!(reject, None);
    let charge = Resources::from([("cpu_millis".to_string(), 1000), ("jobs".to_string(), 1)]);
    assert_eq!(resources, charge);
    assert_eq!(h.exec.reserved_leases().collect::<Vec<_>>(), [L1]);
}

#[test]
fn e2_reserve_rejects_transient_when_full() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    let (accepted, reject, reason, resources) = reserve_result(&h.reserve(L2, spec("shell")));
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Transient));
    assert!(reason.contains("busy"), "{reason}");
    assert!(resources.is_empty());

    // A free seat but not enough of a declared resource left is transient too.
    let mut h = Harness::ready(two_seats_short_of_cpu());
    h.reserve(L1, spec("shell"));
    let (accepted, reject, reason, _) = reserve_result(&h.reserve(L2, spec("shell")));
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Transient));
    assert!(reason.contains("cpu_millis"), "{reason}");
}

/// M34: a job pinned to another node is Incompatible here (the lasting answer), whatever
/// the mill asked; pinned to this node it is accepted like any other.
#[test]
fn m34_a_job_pinned_to_another_node_is_refused_and_one_pinned_here_is_accepted() {
    let mut h = Harness::ready(config());
    let mut elsewhere = spec("shell");
    elsewhere.node = Some(NodeId::new("exec-2").unwrap());
    let (accepted, reject, reason, _) = reserve_result(&h.reserve(L1, elsewhere));
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Incompatible));
    assert!(reason.contains("exec-2"), "{reason}");
    assert_eq!(h.exec.reserved_leases().count(), 0, "nothing held");

    let mut here = spec("shell");
    here.node = Some(NodeId::new("exec-1").unwrap());
    let (accepted, ..) = reserve_result(&h.reserve(L2, here));
    assert!(accepted);
}

/// M34, E2: three jobs that each ask for all 64 CPUs of a 64-seat engine run one at a time:
/// while one holds the CPUs the next is turned down as Transient (it may fit later), and
/// once it ends the next is accepted. The resources stay charged for the whole run, not
/// just the reservation.
#[test]
fn m34_three_whole_cpu_jobs_on_a_64_cpu_engine_run_one_at_a_time() {
    let mut c = config();
    c.engines.insert(
        "shell".into(),
        EngineConfig {
            capacity: 64,
            resources: Resources::from([("cpu".to_string(), 64)]),
        },
    );
    c.outbox_capacity = 256;
    let mut h = Harness::ready(c);
    let whole = || {
        let mut s = spec("shell");
        s.resources = Resources::from([("cpu".to_string(), 64)]);
        s
    };
    let leases = [L1, L2, L3];
    for (i, &lease) in leases.iter().enumerate() {
        let (accepted, ..) = reserve_result(&h.reserve(lease, whole()));
        assert!(accepted, "job {i} gets the CPUs once the one before ended");
        h.commit(lease);
        h.feed(ExecutorInput::JobStarted { lease });
        for (j, &other) in leases.iter().enumerate().skip(i + 1) {
            let (accepted, reject, reason, _) = reserve_result(&h.reserve(other, whole()));
            assert!(!accepted, "job {j} must wait while job {i} runs");
            assert_eq!(reject, Some(RejectKind::Transient));
            assert!(reason.contains("cpu"), "{reason}");
        }
        // A job that asks for no CPU still takes one of the 63 free seats.
        let mut light = spec("shell");
        light.resources.clear();
        let probe = LeaseId(50 + lease.get());
        let (accepted, ..) = reserve_result(&h.reserve(probe, light));
        assert!(accepted, "a job without a CPU ask fits beside it");
        h.mill(ToExecutor::ReleaseLease {
            term: crate::types::Term(1),
            lease: probe,
        });
        h.exited(lease, TerminalStatus::Success);
    }
}

#[test]
fn e2_reserve_rejects_incompatible_engine_or_labels() {
    let mut h = Harness::ready(config());
    let (accepted, reject, reason, _) = reserve_result(&h.reserve(L1, spec("podman")));
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Incompatible));
    assert!(reason.contains("podman"), "{reason}");

    let mut needs_gpu = spec("shell");
    needs_gpu.labels.insert("gpu".into());
    let (accepted, reject, reason, _) = reserve_result(&h.reserve(L2, needs_gpu));
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Incompatible));
    assert!(reason.contains("gpu"), "{reason}");

    let mut too_big = spec("shell");
    too_big.resources.insert("cpu_millis".into(), 8000);
    let (_, reject, reason, _) = reserve_result(&h.reserve(L3, too_big));
    assert_eq!(reject, Some(RejectKind::Incompatible));
    assert!(reason.contains("4000"), "{reason}");

    // Incompatible wins over busy: it is the lasting answer.
    h.reserve(LeaseId(4), spec("shell"));
    let (_, reject, _, _) = reserve_result(&h.reserve(LeaseId(5), spec("podman")));
    assert_eq!(reject, Some(RejectKind::Incompatible));
    assert_eq!(h.exec.reserved_leases().collect::<Vec<_>>(), [LeaseId(4)]);
}

#[test]
fn e2_reserve_rejects_transient_when_draining() {
    let mut h = Harness::ready(config());
    let outs = h.feed(ExecutorInput::Drain);
    let snaps = snapshots(&outs);
    assert_eq!(snaps.len(), 1, "availability changed: {:?}", names(&outs));
    assert!(snaps[0].1.values().all(|a| !a), "draining is unavailable");
    let (accepted, reject, reason, _) = reserve_result(&h.reserve(L1, spec("docker")));
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Transient));
    assert!(reason.contains("draining"), "{reason}");
    assert!(h.exec.is_drained());
}

#[test]
fn e2_repeated_reserve_is_idempotent_and_a_conflicting_one_is_refused() {
    let mut h = Harness::ready(config());
    let first = reserve_result(&h.reserve(L1, spec("docker")));
    let again = reserve_result(&h.reserve(L1, spec("docker")));
    assert_eq!(first, again);
    let conflicting = h.mill(ToExecutor::ReserveSeat {
        term: crate::types::Term(1),
        lease: L1,
        job: JobId(999),
        spec: Box::new(spec("docker")),
        ttl: secs(45),
        direct: false,
    });
    let (accepted, reject, _, _) = reserve_result(&conflicting);
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Incompatible));
    assert_eq!(h.exec.reserved_leases().count(), 1);
}

// ---------------------------------------------------------------------------------------- E3

#[test]
fn e3_uncommitted_reservation_frees_itself_after_ttl() {
    let mut h = Harness::ready(config());
    let outs = h.mill(ToExecutor::ReserveSeat {
        term: crate::types::Term(1),
        lease: L1,
        job: JobId(1),
        spec: Box::new(spec("shell")),
        ttl: secs(2),
        direct: false,
    });
    assert!(reserve_result(&outs).0);
    assert_eq!(h.exec.next_deadline(), Some(h.now.plus(secs(2))));
    let (gap, outs) = h.until_deadline();
    assert_eq!(gap, secs(2));
    assert_eq!(h.exec.reserved_leases().count(), 0);
    // The seat came back: availability changed, so a snapshot says so.
    let snaps = snapshots(&outs);
    assert_eq!(snaps.len(), 1);
    assert_eq!(snaps[0].1.get("shell"), Some(&true));
    assert!(snaps[0].2.is_empty());
    assert!(reserve_result(&h.reserve(L2, spec("shell"))).0);
    // A late commit for the expired lease starts nothing.
    let outs = h.commit(L1);
    assert_eq!(names(&outs), ["send:CommitResult"]);
}

#[test]
fn e3_ttl_is_capped_by_reconnect_grace() {
    let mut h = Harness::ready(config());
    h.mill(ToExecutor::ReserveSeat {
        term: crate::types::Term(1),
        lease: L1,
        job: JobId(1),
        spec: Box::new(spec("docker")),
        ttl: secs(3600),
        direct: false,
    });
    h.advance(secs(44));
    assert_eq!(h.exec.reserved_leases().count(), 1);
    h.advance(secs(1));
    assert_eq!(h.exec.reserved_leases().count(), 0);
}

// ---------------------------------------------------------------------------------------- E4

#[test]
fn e4_commit_starts_the_job_once() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    let outs = h.commit(L1);
    assert_eq!(
        names(&outs),
        ["persist", "start", "send:CommitResult"],
        "the job is durable before it starts and before the mill hears committed"
    );
    assert_eq!(
        writes(&outs),
        [ExecutorWrite::JobCommitted {
            lease: L1,
            job: StoredJob {
                job: JobId(101),
                engine: "shell".into(),
                resources: Resources::from([
                    ("cpu_millis".to_string(), 1000),
                    ("jobs".to_string(), 1)
                ]),
                stop: None,
            },
        }]
    );
    match &outs[1] {
        ExecutorOutput::StartJob {
            lease,
            job,
            spec: s,
            secrets,
        } => {
            assert_eq!((*lease, *job), (L1, JobId(101)));
            assert_eq!(*s, spec("shell"));
            assert_eq!(secrets.get("TOKEN").map(String::as_str), Some("hunter2"));
        }
        other => panic!("expected StartJob, got {other:?}"),
    }
    assert_eq!(
        sent(&outs),
        [ToMill::CommitResult {
            lease: L1,
            committed: true
        }]
    );
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L1]);
}

#[test]
fn e4_repeat_commit_starts_nothing() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let committed = vec![ToMill::CommitResult {
        lease: L1,
        committed: true,
    }];
    let outs = h.commit(L1);
    assert_eq!(names(&outs), ["send:CommitResult"]);
    assert_eq!(sent(&outs), committed);
    // Finished but the terminal is not acked yet: still committed, still no start.
    h.exited(L1, TerminalStatus::Success);
    let outs = h.commit(L1);
    assert_eq!(sent(&outs), committed);
    assert_eq!(names(&outs), ["send:CommitResult"]);
}

#[test]
fn e4_unknown_lease_is_not_committed() {
    let mut h = Harness::ready(config());
    let outs = h.commit(LeaseId(77));
    assert_eq!(
        sent(&outs),
        [ToMill::CommitResult {
            lease: LeaseId(77),
            committed: false
        }]
    );
    assert_eq!(names(&outs), ["send:CommitResult"]);
}

// ---------------------------------------------------------------------------------------- E5

#[test]
fn e5_events_are_persisted_before_sent_and_trimmed_on_ack() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    h.commit(L1);
    let outs = h.feed(ExecutorInput::JobStarted { lease: L1 });
    assert_eq!(names(&outs), ["persist", "send:EventBatch"]);
    let running = Event {
        seqno: Seqno(1),
        lease: L1,
        kind: EventKind::Running,
    };
    assert_eq!(writes(&outs), [ExecutorWrite::Append(running.clone())]);
    assert_eq!(batches(&outs), [vec![running]]);

    let log = LogRef {
        path: LogRef::path_for(L1),
        hash: format!("sha256:{}", "0f".repeat(32)),
    };
    let outs = h.feed(ExecutorInput::JobExited {
        lease: L1,
        status: TerminalStatus::Failed,
        exit_code: Some(2),
        error: Some("make: *** [test] Error 2".into()),
        log: Some(log.clone()),
    });
    // Terminal and the job's end in one batch, then the event, then the freed seat.
    assert_eq!(
        names(&outs),
        ["persist", "send:EventBatch", "send:Snapshot"]
    );
    let done = Event {
        seqno: Seqno(2),
        lease: L1,
        kind: EventKind::Terminal {
            status: TerminalStatus::Failed,
            exit_code: Some(2),
            error: Some("make: *** [test] Error 2".into()),
            log: Some(log),
            cause: crate::wire::EndCause::Engine,
        },
    };
    assert_eq!(
        writes(&outs),
        [
            ExecutorWrite::Append(done.clone()),
            ExecutorWrite::JobEnded { lease: L1 }
        ]
    );
    assert_eq!(batches(&outs), [vec![done]]);
    assert_eq!(h.store.outbox.len(), 2);

    let outs = h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(1),
    });
    assert_eq!(writes(&outs), [ExecutorWrite::Trim { up_to: Seqno(1) }]);
    assert_eq!(h.store.outbox.len(), 1);
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(2),
    });
    assert!(h.store.outbox.is_empty());
    // A repeated ack changes nothing and writes nothing.
    let outs = h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(2),
    });
    assert!(outs.is_empty(), "{:?}", names(&outs));
}

/// E5, issue 15: of the batches one job's life writes, only the trim of its acked events
/// (and contact marks, E12) may skip the wait for the disk; its commit, its events and its
/// end may not.
#[test]
fn e5_only_trims_and_contact_marks_are_written_without_waiting_for_the_disk() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    let mut synced = Vec::new();
    let mut lazy = Vec::new();
    let mut sort = |outs: &[ExecutorOutput]| {
        for o in outs {
            if let ExecutorOutput::Persist(b) = o {
                if b.needs_sync() {
                    synced.extend(b.writes.clone());
                } else {
                    lazy.extend(b.writes.clone());
                }
            }
        }
    };
    sort(&h.commit(L1));
    sort(&h.feed(ExecutorInput::JobStarted { lease: L1 }));
    sort(&h.feed(ExecutorInput::JobExited {
        lease: L1,
        status: TerminalStatus::Success,
        exit_code: Some(0),
        error: None,
        log: None,
    }));
    sort(&h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(2),
    }));
    assert!(
        synced
            .iter()
            .any(|w| matches!(w, ExecutorWrite::JobCommitted { .. })),
        "{synced:?}"
    );
    assert_eq!(
        synced
            .iter()
            .filter(|w| matches!(w, ExecutorWrite::Append(_)))
            .count(),
        2,
        "Running and the terminal wait for the disk: {synced:?}"
    );
    assert!(synced.contains(&ExecutorWrite::JobEnded { lease: L1 }));
    assert_eq!(lazy, [ExecutorWrite::Trim { up_to: Seqno(2) }]);
    let contact = ExecutorBatch {
        writes: vec![ExecutorWrite::Contact { at: Time::ZERO }],
    };
    assert!(!contact.needs_sync());
    let mixed = ExecutorBatch {
        writes: vec![
            ExecutorWrite::Trim { up_to: Seqno(1) },
            ExecutorWrite::JobEnded { lease: L1 },
        ],
    };
    assert!(mixed.needs_sync(), "a trim with anything else waits");
}

#[test]
fn e5_ack_beyond_what_was_sent_or_for_another_epoch_trims_nothing() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let outs = h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(5),
    });
    assert_eq!(names(&outs), ["close"]);
    assert_eq!(h.store.outbox.len(), 1);
    assert!(!h.exec.is_ready());

    let (_, outs) = h.until_deadline();
    assert_eq!(names(&outs), ["connect"]);
    h.connect(Seqno(0));
    let outs = h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: Epoch(99),
        up_to: Seqno(1),
    });
    assert_eq!(names(&outs), ["close"]);
    assert_eq!(h.store.outbox.len(), 1);
}

#[test]
fn e5_invalid_log_reference_is_left_out() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let outs = h.feed(ExecutorInput::JobExited {
        lease: L1,
        status: TerminalStatus::Success,
        exit_code: Some(0),
        error: None,
        log: Some(LogRef {
            path: "logs/../../etc/passwd".into(),
            hash: "sha256:nope".into(),
        }),
    });
    let kinds: Vec<EventKind> = batches(&outs)
        .concat()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        [EventKind::Terminal {
            status: TerminalStatus::Success,
            exit_code: Some(0),
            error: None,
            log: None,
            cause: crate::wire::EndCause::Engine,
        }]
    );
}

// ---------------------------------------------------------------------------------------- E6

#[test]
fn e6_reconnect_resends_outbox_above_cursor() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.disconnect();
    // While disconnected: events are persisted, nothing is sent.
    let outs = h.exited(L1, TerminalStatus::Success);
    assert_eq!(names(&outs), ["persist"]);
    let (_, outs) = h.until_deadline();
    assert_eq!(names(&outs), ["connect"]);

    // The mill had applied s1 before the link broke.
    let outs = h.connect(Seqno(1));
    assert_eq!(
        names(&outs),
        ["persist", "send:Snapshot", "send:EventBatch"]
    );
    assert_eq!(writes(&outs), [ExecutorWrite::Trim { up_to: Seqno(1) }]);
    let snaps = snapshots(&outs);
    assert!(
        snaps[0].2.is_empty(),
        "only held seats are listed; the unacked terminal is announced by outbox_high"
    );
    assert_eq!(
        outbox_highs(&outs),
        [Seqno(2)],
        "the mill must apply s2 before judging L1 (M8, DESIGN §3)"
    );
    assert_eq!(
        batches(&outs),
        [vec![Event {
            seqno: Seqno(2),
            lease: L1,
            kind: terminal(TerminalStatus::Success, None),
        }]]
    );
}

#[test]
fn e6_messages_before_welcome_close_the_connection() {
    let (mut h, _) = Harness::new(config());
    let outs = h.feed(ExecutorInput::Connected { conn: ConnId(1) });
    assert_eq!(names(&outs), ["send:Hello"]);
    h.conn = Some(ConnId(1));
    let outs = h.reserve(L1, spec("shell"));
    assert_eq!(names(&outs), ["close"], "no seat is taken before Welcome");
    assert_eq!(h.exec.reserved_leases().count(), 0);
    // Welcome on the dead connection changes nothing.
    let outs = h.mill(ToExecutor::Welcome {
        term: crate::types::Term(1),
        cursor: Seqno(0),
        timers: config().session_timers(),
    });
    assert!(outs.is_empty());
    assert!(!h.exec.is_ready());
}

#[test]
fn e6_refused_closes_and_backs_off() {
    let (mut h, _) = Harness::new(config());
    h.feed(ExecutorInput::Connected { conn: ConnId(1) });
    h.conn = Some(ConnId(1));
    let outs = h.mill(ToExecutor::Refused {
        leader: None,
        reason: "quarantined".into(),
    });
    match outs.as_slice() {
        [ExecutorOutput::Close { conn, reason }] => {
            assert_eq!(*conn, ConnId(1));
            assert!(reason.contains("quarantined"), "{reason}");
        }
        other => panic!("expected Close, got {other:?}"),
    }
    let (gap, outs) = h.until_deadline();
    assert!(gap >= Duration::from_millis(50) && gap <= Duration::from_millis(100));
    assert_eq!(names(&outs), ["connect"]);
}

#[test]
fn e6_welcome_cursor_beyond_the_outbox_is_refused_without_trimming() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.disconnect();
    h.until_deadline();
    let outs = h.connect(Seqno(9));
    assert_eq!(names(&outs), ["close"]);
    assert_eq!(h.store.outbox.len(), 1, "nothing unsent is trimmed");
    assert!(!h.exec.is_ready());
}

// ---------------------------------------------------------------------------------------- E7

#[test]
fn e7_cancel_is_acked_at_once_and_ends_cancelled() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let outs = h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: L1,
        reason: "cancelled by alice".into(),
    });
    // The stop is durable before the ack goes out (persist before send).
    assert_eq!(
        outs,
        [
            ExecutorOutput::Persist(ExecutorBatch {
                writes: vec![ExecutorWrite::JobStopping {
                    lease: L1,
                    stop: StopReason::Cancel("cancelled by alice".into()),
                }]
            }),
            ExecutorOutput::StopJob {
                lease: L1,
                grace: DEFAULT_STOP_GRACE
            },
            ExecutorOutput::Send {
                conn: ConnId(1),
                msg: ToMill::CancelAck { lease: L1 }
            },
        ]
    );
    // A repeat is acked again, with no second stop.
    let outs = h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: L1,
        reason: "again".into(),
    });
    assert_eq!(names(&outs), ["send:CancelAck"]);
    // The engine says the killed process failed; the terminal is Cancelled.
    let outs = h.feed(ExecutorInput::JobExited {
        lease: L1,
        status: TerminalStatus::Failed,
        exit_code: Some(143),
        error: Some("killed".into()),
        log: None,
    });
    let events = batches(&outs).concat();
    assert_eq!(
        events[0].kind,
        EventKind::Terminal {
            status: TerminalStatus::Cancelled,
            exit_code: Some(143),
            error: Some("cancelled by alice".into()),
            log: None,
            cause: EndCause::Cancelled,
        }
    );
}

/// Found by I11 (driver-lag seed 12): the job was being fenced (E12) when the executor got
/// back in touch and the mill's pending cancel arrived before the engine exited; the cancel
/// decides the status, not the fencing.
#[test]
fn e7_cancel_reaching_a_fenced_job_before_it_exits_ends_it_cancelled() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.disconnect();
    let mut stopped = false;
    while !stopped {
        let (_, outs) = h.until_deadline();
        stopped = outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::StopJob { lease: L1, .. }));
        if !stopped
            && outs
                .iter()
                .any(|o| matches!(o, ExecutorOutput::Connect { .. }))
        {
            h.feed(ExecutorInput::ConnectFailed);
        }
    }
    // Back in touch before the engine exits; the mill's pending cancel arrives (M26).
    while !h
        .until_deadline()
        .1
        .iter()
        .any(|o| matches!(o, ExecutorOutput::Connect { .. }))
    {}
    h.connect(Seqno(0));
    let outs = h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: L1,
        reason: "cancelled by alice".into(),
    });
    assert_eq!(
        names(&outs),
        ["persist", "send:CancelAck"],
        "the cancel is durable before its ack (E7, E9); already stopping: no second stop"
    );
    let outs = h.exited(L1, TerminalStatus::Failed);
    let events = batches(&outs).concat();
    let appended: Vec<_> = writes(&outs)
        .into_iter()
        .filter_map(|w| match w {
            ExecutorWrite::Append(e) => Some(e.kind),
            _ => None,
        })
        .collect();
    let want = terminal_by(
        TerminalStatus::Cancelled,
        Some("cancelled by alice"),
        EndCause::Cancelled,
    );
    assert_eq!(appended, std::slice::from_ref(&want));
    assert!(events.iter().all(|e| e.kind == want), "{events:?}");
}

#[test]
fn e7_cancel_of_unknown_lease_is_acked() {
    let mut h = Harness::ready(config());
    let outs = h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: LeaseId(77),
        reason: "untracked".into(),
    });
    assert_eq!(sent(&outs), [ToMill::CancelAck { lease: LeaseId(77) }]);
    assert_eq!(names(&outs), ["send:CancelAck"]);
}

#[test]
fn e7_cancel_of_a_reservation_drops_it() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    let outs = h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: L1,
        reason: "user".into(),
    });
    assert_eq!(names(&outs), ["send:CancelAck", "send:Snapshot"]);
    assert_eq!(h.exec.reserved_leases().count(), 0);
    assert_eq!(names(&h.commit(L1)), ["send:CommitResult"]);
}

// ---------------------------------------------------------------------------------------- E8

#[test]
fn e8_release_never_stops_a_running_job() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let outs = h.mill(ToExecutor::ReleaseLease {
        term: crate::types::Term(1),
        lease: L1,
    });
    assert!(outs.is_empty(), "{:?}", names(&outs));
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L1]);

    h.reserve(L2, spec("docker"));
    h.mill(ToExecutor::ReleaseLease {
        term: crate::types::Term(1),
        lease: L2,
    });
    assert_eq!(h.exec.reserved_leases().count(), 0);
}

// ---------------------------------------------------------------------------------------- E9

/// The `AdoptJob` outputs of a step, in order.
fn adoptions(outs: &[ExecutorOutput]) -> Vec<(LeaseId, JobId)> {
    outs.iter()
        .filter_map(|o| match o {
            ExecutorOutput::AdoptJob { lease, job } => Some((*lease, *job)),
            ExecutorOutput::Connect { .. }
            | ExecutorOutput::Send { .. }
            | ExecutorOutput::Close { .. }
            | ExecutorOutput::Persist(_)
            | ExecutorOutput::StartJob { .. }
            | ExecutorOutput::StopJob { .. } => None,
        })
        .collect()
}

#[test]
fn e9_restart_adopts_jobs_through_their_supervisors_and_starts_none_again() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.run(L2, "docker");
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(2),
    });
    let outs = h.restart(secs(10));
    // Nothing is failed or started: each job is re-attached, then the mill is dialled.
    assert_eq!(names(&outs), ["adopt", "adopt", "connect"]);
    assert_eq!(adoptions(&outs), [(L1, JobId(101)), (L2, JobId(102))]);
    assert!(writes(&outs).is_empty());
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L1, L2]);
    assert_eq!(h.store.jobs.len(), 2, "adopted jobs stay committed");
    // Their seats stay taken: the shell engine (one seat) is full.
    let outs = h.connect(Seqno(2));
    let snaps = snapshots(&outs);
    assert_eq!(snaps.len(), 1);
    assert_eq!(snaps[0].1.get("shell"), Some(&false), "{snaps:?}");
}

#[test]
fn e14_an_adopted_job_that_still_runs_keeps_its_lease_and_reports_its_real_end() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(1),
    });
    h.restart(secs(10));
    // The supervisor answers: still running. Its Running was acked, so it is appended
    // again (a no-op repeat at the mill); no second start.
    let outs = h.feed(ExecutorInput::JobStarted { lease: L1 });
    assert!(!names(&outs).contains(&"start".to_string()));
    h.connect(Seqno(1));
    let outs = h.exited(L1, TerminalStatus::Success);
    let events: Vec<Event> = batches(&outs).concat();
    assert_eq!(
        events
            .iter()
            .map(|e| (e.lease, e.kind.clone()))
            .collect::<Vec<_>>(),
        [(L1, terminal(TerminalStatus::Success, None))]
    );
    assert!(h.store.jobs.is_empty());
    assert_eq!(h.exec.running_leases().count(), 0);
}

#[test]
fn e14_a_job_that_ended_while_the_executor_was_down_reports_its_recorded_status() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.restart(secs(10));
    // The supervisor recorded the job's exit durably; the driver reports it as it is.
    let outs = h.feed(ExecutorInput::JobExited {
        lease: L1,
        status: TerminalStatus::Failed,
        exit_code: Some(3),
        error: Some("exit status 3".into()),
        log: None,
    });
    assert_eq!(
        writes(&outs),
        [
            ExecutorWrite::Append(Event {
                seqno: Seqno(2),
                lease: L1,
                kind: EventKind::Terminal {
                    status: TerminalStatus::Failed,
                    exit_code: Some(3),
                    error: Some("exit status 3".into()),
                    log: None,
                    cause: EndCause::Engine,
                },
            }),
            ExecutorWrite::JobEnded { lease: L1 },
        ]
    );
}

#[test]
fn e9_only_a_job_whose_supervisor_is_gone_ends_executor_restarted() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.run(L2, "docker");
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(2),
    });
    h.restart(secs(10));
    h.feed(ExecutorInput::JobStarted { lease: L2 });
    let outs = h.feed(ExecutorInput::JobLost { lease: L1 });
    assert_eq!(
        writes(&outs),
        [
            ExecutorWrite::Append(Event {
                seqno: Seqno(4),
                lease: L1,
                kind: terminal_by(TerminalStatus::Failed, Some(RESTARTED), EndCause::Restarted),
            }),
            ExecutorWrite::JobEnded { lease: L1 },
        ]
    );
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L2]);
    let outs = h.connect(Seqno(2));
    let leases: Vec<LeaseId> = batches(&outs).concat().iter().map(|e| e.lease).collect();
    assert_eq!(leases, [L2, L1], "L2's Running again, then L1's terminal");
}

#[test]
fn e14_a_cancelled_adopted_job_is_stopped_through_its_supervisor_and_ends_cancelled() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.restart(secs(1));
    h.feed(ExecutorInput::JobStarted { lease: L1 });
    h.connect(Seqno(1));
    let outs = h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: L1,
        reason: "user".into(),
    });
    assert!(names(&outs).contains(&"stop".to_string()), "{outs:?}");
    let outs = h.exited(L1, TerminalStatus::Failed);
    let events = batches(&outs).concat();
    assert!(
        matches!(
            &events[..],
            [Event {
                kind: EventKind::Terminal {
                    status: TerminalStatus::Cancelled,
                    ..
                },
                ..
            }]
        ),
        "{events:?}"
    );
}

/// E9 with E12: the fence clock survives the restart (it counts from the last contact), and a
/// restart well within `reconnect_grace` of it leaves the adopted job running once the mill
/// is back, however long the session then lasts.
#[test]
fn e9_a_prompt_restart_keeps_adopted_jobs_running() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let heard = h.now;
    let outs = h.restart(secs(10));
    assert_eq!(names(&outs), ["adopt", "connect"]);
    assert!(
        all_writes(&outs).is_empty(),
        "nothing heard since: nothing written"
    );
    h.feed(ExecutorInput::JobStarted { lease: L1 });
    h.connect(Seqno(0));
    while h.now < heard.plus(DEFAULT_RECONNECT_GRACE * 3) {
        let (_, outs) = h.until_deadline();
        assert!(!names(&outs).contains(&"stop".to_string()), "{outs:?}");
        h.mill(ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: EPOCH,
            up_to: Seqno(1),
        });
    }
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L1]);
    assert_eq!(h.store.jobs[&L1].stop, None);
}

#[test]
fn e12_self_fencing_stops_adopted_jobs_too() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let outs = h.restart(secs(1));
    assert_eq!(adoptions(&outs), [(L1, JobId(101))]);
    h.feed(ExecutorInput::JobStarted { lease: L1 });
    // Never reaches the mill: within reconnect_grace of the restart the job is stopped.
    let grace = h.config.reconnect_grace;
    let mut stopped = false;
    let mut waited = Duration::ZERO;
    while !stopped && waited <= grace {
        let (gap, outs) = h.until_deadline();
        waited += gap;
        stopped = outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::StopJob { lease, .. } if *lease == L1));
        if outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::Connect { .. }))
        {
            h.feed(ExecutorInput::ConnectFailed);
        }
    }
    assert!(stopped, "no stop within reconnect_grace ({waited:?})");
    let outs = h.exited(L1, TerminalStatus::Failed);
    assert_eq!(
        writes(&outs)[0],
        ExecutorWrite::Append(Event {
            seqno: Seqno(2),
            lease: L1,
            kind: terminal_by(
                TerminalStatus::Failed,
                Some(LOST_CONTACT),
                EndCause::LostContact
            ),
        })
    );
}

#[test]
fn e9_a_restart_forgets_reservations() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    let outs = h.restart(secs(1));
    assert_eq!(names(&outs), ["connect"]);
    h.connect(Seqno(0));
    assert_eq!(
        sent(&h.commit(L1)),
        [ToMill::CommitResult {
            lease: L1,
            committed: false
        }]
    );
}

// --------------------------------------------------------------------------------------- E10

#[test]
fn e10_snapshot_on_interval_and_on_availability_change() {
    let (mut h, _) = Harness::new(config());
    let outs = h.connect(Seqno(0));
    let first = snapshots(&outs);
    assert_eq!(first.len(), 1, "a snapshot right after Welcome");
    assert_eq!(first[0].0, 1);
    assert_eq!(
        first[0].1,
        BTreeMap::from([("docker".to_string(), true), ("shell".to_string(), true)])
    );

    // Every snapshot_interval.
    let (gap, outs) = h.until_deadline();
    assert_eq!(gap, DEFAULT_SNAPSHOT_INTERVAL);
    assert_eq!(snapshots(&outs)[0].0, 2);

    // Taking the only shell seat changes its availability: a snapshot at once.
    let outs = h.reserve(L1, spec("shell"));
    assert_eq!(names(&outs), ["send:ReserveResult", "send:Snapshot"]);
    let snap = &snapshots(&outs)[0];
    assert_eq!(snap.0, 3);
    assert_eq!(snap.1.get("shell"), Some(&false));
    assert_eq!(snap.2, [L1]);

    // One docker seat of two: load changes, availability does not: no snapshot.
    let outs = h.reserve(L2, spec("docker"));
    assert_eq!(names(&outs), ["send:ReserveResult"]);

    // The periodic schedule is not moved by the change-driven snapshot.
    let (gap, outs) = h.until_deadline();
    assert_eq!(gap, DEFAULT_SNAPSHOT_INTERVAL);
    let snap = &snapshots(&outs)[0];
    assert_eq!(snap.0, 4, "strictly increasing");
    assert_eq!(snap.2, [L1, L2]);
}

#[test]
fn e10_snapshot_reports_loads_in_unit_range() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    h.reserve(L2, spec("docker"));
    let (_, outs) = h.until_deadline();
    let engines = sent(&outs)
        .into_iter()
        .find_map(|m| match m {
            ToMill::Snapshot { engines, .. } => Some(engines),
            _ => None,
        })
        .unwrap();
    let shell = &engines["shell"];
    assert_eq!(shell.capacity, 1);
    assert_eq!(shell.load.get("seats"), Some(&1.0));
    assert_eq!(shell.load.get("cpu_millis"), Some(&0.25));
    let docker = &engines["docker"];
    assert_eq!(docker.load.get("seats"), Some(&0.5));
    assert!(docker.available);
}

// --------------------------------------------------------------------------------------- E11

#[test]
fn e11_backoff_grows_exponentially_with_jitter_and_resets() {
    let (mut h, _) = Harness::new(config());
    let mut gaps = Vec::new();
    for _ in 0..10 {
        let outs = h.feed(ExecutorInput::ConnectFailed);
        assert!(outs.is_empty());
        let (gap, outs) = h.until_deadline();
        assert_eq!(names(&outs), ["connect"]);
        gaps.push(gap);
    }
    for (n, gap) in gaps.iter().enumerate() {
        let ceiling = (DEFAULT_BACKOFF_MIN * (1 << n)).min(DEFAULT_BACKOFF_MAX);
        assert!(
            *gap >= ceiling / 2 && *gap <= ceiling,
            "attempt {n}: {gap:?} outside [{:?}, {ceiling:?}]",
            ceiling / 2
        );
    }
    assert!(gaps[9] >= DEFAULT_BACKOFF_MAX / 2, "capped, not reset");
    let distinct: BTreeSet<_> = gaps.iter().map(|g| g.as_micros() % 1000).collect();
    assert!(distinct.len() > 1, "jittered: {gaps:?}");

    // A Welcome resets the schedule.
    h.connect(Seqno(0));
    h.disconnect();
    let (gap, outs) = h.until_deadline();
    assert_eq!(names(&outs), ["connect"]);
    assert!(
        gap <= DEFAULT_BACKOFF_MIN && gap >= DEFAULT_BACKOFF_MIN / 2,
        "{gap:?}"
    );
}

#[test]
fn e11_jitter_depends_only_on_the_seed() {
    let schedule = |seed| {
        let mut c = config();
        c.backoff_seed = seed;
        let (mut h, _) = Harness::new(c);
        (0..6)
            .map(|_| {
                h.feed(ExecutorInput::ConnectFailed);
                h.until_deadline().0
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(schedule(1), schedule(1));
    assert_ne!(schedule(1), schedule(2));
}

#[test]
fn e11_jobs_keep_running_while_disconnected() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let cut_off = h.now;
    h.disconnect();
    let mut attempts = 0;
    // Stay inside the reconnect grace (E12 is the next test).
    while h.exec.next_deadline().unwrap() < cut_off.plus(secs(44)) {
        let (_, outs) = h.until_deadline();
        assert_eq!(names(&outs), ["connect"]);
        attempts += 1;
        h.feed(ExecutorInput::ConnectFailed);
    }
    assert!(attempts >= 5, "{attempts}");
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L1]);
}

/// E9 with E7: an executor restarted after it acked a cancel still ends the job Cancelled
/// with the cancel's reason, because the stop was durable before the ack (issue 10).
#[test]
fn e9_restart_after_a_cancel_ack_ends_the_job_cancelled() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.run(L2, "docker");
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(2),
    });
    let outs = h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: L1,
        reason: "cancelled by alice".into(),
    });
    assert_eq!(names(&outs), ["persist", "stop", "send:CancelAck"]);
    // The process dies before the engine reports the stop; both jobs are adopted (E14).
    let outs = h.restart(secs(10));
    assert_eq!(names(&outs), ["adopt", "adopt", "connect"]);
    // L1's supervisor still runs it: it is asked to stop again (the stop is durable).
    let outs = h.feed(ExecutorInput::JobStarted { lease: L1 });
    assert!(names(&outs).contains(&"stop".to_string()), "{outs:?}");
    // It ends Cancelled with the cancel's reason, whatever the engine says.
    let outs = h.exited(L1, TerminalStatus::Failed);
    let ended = appended(&outs, L1);
    assert_eq!(
        ended,
        [terminal_by(
            TerminalStatus::Cancelled,
            Some("cancelled by alice"),
            EndCause::Cancelled
        )]
    );
    // L2's supervisor is gone: executor restarted, by cause.
    let outs = h.feed(ExecutorInput::JobLost { lease: L2 });
    let ended = appended(&outs, L2);
    assert_eq!(
        ended,
        [terminal_by(
            TerminalStatus::Failed,
            Some(RESTARTED),
            EndCause::Restarted
        )]
    );
    assert!(h.store.jobs.is_empty());
}

/// E9 with E12: an executor restarted while self-fencing stopped a job reports the fence
/// (lost contact), not the restart: the fence's stop was durable.
#[test]
fn e9_restart_after_self_fencing_reports_lost_contact() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(1),
    });
    h.disconnect();
    while h.store.jobs.get(&L1).and_then(|j| j.stop.clone()).is_none() {
        let (_, outs) = h.until_deadline();
        if outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::Connect { .. }))
        {
            h.feed(ExecutorInput::ConnectFailed);
        }
    }
    assert_eq!(h.store.jobs[&L1].stop, Some(StopReason::Fence));
    h.restart(secs(1));
    // Its supervisor is gone (or reports the stopped run): the durable fence decides.
    let outs = h.feed(ExecutorInput::JobLost { lease: L1 });
    let Some(ExecutorWrite::Append(event)) = writes(&outs).first().cloned() else {
        panic!("expected an append");
    };
    assert_eq!(
        event.kind,
        terminal_by(
            TerminalStatus::Failed,
            Some(LOST_CONTACT),
            EndCause::LostContact
        )
    );
}

// --------------------------------------------------------------------------------------- E12

#[test]
fn e12_self_fences_after_reconnect_grace() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.reserve(L2, spec("docker"));
    let last_heard = h.now;
    h.disconnect();
    let mut stops = Vec::new();
    while stops.is_empty() {
        let (_, outs) = h.until_deadline();
        for o in &outs {
            match o {
                ExecutorOutput::StopJob { lease, grace } => stops.push((*lease, *grace, h.now)),
                ExecutorOutput::Connect { .. } => {}
                // The fence's stop is durable before the stop (E12, E9).
                ExecutorOutput::Persist(b) => assert_eq!(
                    b.writes,
                    [ExecutorWrite::JobStopping {
                        lease: L1,
                        stop: StopReason::Fence
                    }]
                ),
                ExecutorOutput::Send { .. }
                | ExecutorOutput::Close { .. }
                | ExecutorOutput::StartJob { .. }
                | ExecutorOutput::AdoptJob { .. } => panic!("unexpected {o:?}"),
            }
        }
        if outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::Connect { .. }))
        {
            h.feed(ExecutorInput::ConnectFailed);
        }
    }
    assert_eq!(
        stops,
        [(
            L1,
            DEFAULT_STOP_GRACE,
            last_heard.plus(DEFAULT_RECONNECT_GRACE)
        )]
    );
    assert_eq!(h.exec.reserved_leases().count(), 0, "reservations let go");

    let outs = h.exited(L1, TerminalStatus::Failed);
    assert_eq!(names(&outs), ["persist"]);
    let Some(ExecutorWrite::Append(event)) = writes(&outs).first().cloned() else {
        panic!("expected an append");
    };
    assert_eq!(
        event.kind,
        terminal_by(
            TerminalStatus::Failed,
            Some(LOST_CONTACT),
            EndCause::LostContact
        )
    );
    assert_eq!(h.exec.running_leases().count(), 0);
}

#[test]
fn e12_reconnecting_within_grace_keeps_jobs_running() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let cut_off = h.now;
    h.disconnect();
    while h.exec.next_deadline().unwrap() < cut_off.plus(secs(30)) {
        h.until_deadline();
        h.feed(ExecutorInput::ConnectFailed);
    }
    h.until_deadline();
    let welcomed_at = h.now;
    let outs = h.connect(Seqno(1));
    assert_eq!(names(&outs), ["persist", "send:Snapshot"]);
    // Keep the session alive past the old fence deadline; no job is stopped.
    while h.now < cut_off.plus(secs(60)) {
        let (_, outs) = h.until_deadline();
        for o in &outs {
            assert!(!matches!(o, ExecutorOutput::StopJob { .. }), "{o:?}");
        }
        h.mill(ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: EPOCH,
            up_to: Seqno(1),
        });
    }
    assert!(welcomed_at > cut_off.plus(secs(29)));
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L1]);
    assert!(h.exec.is_ready());
}

#[test]
fn e12_a_silent_mill_is_probed_then_its_connection_closed() {
    let mut h = Harness::ready(config());
    // The mill said nothing for an interval: snapshot plus an empty batch it must ack.
    let (_, outs) = h.until_deadline();
    assert_eq!(names(&outs), ["send:Snapshot", "send:EventBatch"]);
    assert_eq!(batches(&outs), [Vec::<Event>::new()]);
    // An ack heard within the interval means the next periodic snapshot needs no probe.
    h.advance(secs(1));
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(0),
    });
    let quiet_since = h.now;
    let (_, outs) = h.until_deadline();
    assert_eq!(names(&outs), ["send:Snapshot"]);
    let mut closed_at = None;
    let mut probes = 0;
    while closed_at.is_none() {
        let (_, outs) = h.until_deadline();
        probes += batches(&outs).len();
        if let Some(ExecutorOutput::Close { reason, .. }) = outs.first() {
            assert!(reason.contains("silent"), "{reason}");
            closed_at = Some(h.now);
        }
    }
    assert_eq!(closed_at, Some(quiet_since.plus(DEFAULT_SILENCE_TIMEOUT)));
    assert_eq!(probes, 2, "probed at +9 s and +14 s of silence");
    assert!(!h.exec.is_ready());
}

/// StopJob outputs of `outs`, by lease.
fn stops(outs: &[ExecutorOutput]) -> Vec<LeaseId> {
    outs.iter()
        .filter_map(|o| match o {
            ExecutorOutput::StopJob { lease, .. } => Some(*lease),
            ExecutorOutput::Connect { .. }
            | ExecutorOutput::Send { .. }
            | ExecutorOutput::Close { .. }
            | ExecutorOutput::Persist(_)
            | ExecutorOutput::StartJob { .. }
            | ExecutorOutput::AdoptJob { .. } => None,
        })
        .collect()
}

/// E12/I1: a process started after `reconnect_grace` of silence (counted from the store's
/// last contact, not from its own start) fences the jobs it adopts at once, durably.
#[test]
fn e12_a_restart_after_reconnect_grace_of_silence_fences_adopted_jobs_at_once() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    assert_eq!(
        h.store.last_contact,
        Some(h.now),
        "the commit carried the contact"
    );
    let outs = h.restart(DEFAULT_RECONNECT_GRACE + secs(1));
    assert_eq!(names(&outs), ["adopt", "persist", "stop", "connect"]);
    assert_eq!(
        all_writes(&outs),
        [ExecutorWrite::JobStopping {
            lease: L1,
            stop: StopReason::Fence
        }]
    );
    // Its supervisor says it still runs: it is being stopped already, no second stop.
    let outs = h.feed(ExecutorInput::JobStarted { lease: L1 });
    assert!(stops(&outs).is_empty(), "{outs:?}");
    let outs = h.exited(L1, TerminalStatus::Failed);
    assert_eq!(
        appended(&outs, L1),
        [terminal_by(
            TerminalStatus::Failed,
            Some(LOST_CONTACT),
            EndCause::LostContact
        )]
    );
}

/// E12/I1: restarts that each come within `reconnect_grace`, but never reach the mill, do
/// not extend it: the second process fences the job at the last contact + grace.
#[test]
fn e12_a_restart_does_not_restart_the_fence_clock() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let heard = h.now;
    for _ in 0..2 {
        let outs = h.restart(secs(20));
        assert_eq!(names(&outs), ["adopt", "connect"]);
        h.feed(ExecutorInput::JobStarted { lease: L1 });
        h.feed(ExecutorInput::ConnectFailed);
    }
    let mut stopped = Vec::new();
    while stopped.is_empty() {
        let (_, outs) = h.until_deadline();
        stopped = stops(&outs);
        if outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::Connect { .. }))
        {
            h.feed(ExecutorInput::ConnectFailed);
        }
    }
    assert_eq!(stopped, [L1]);
    assert_eq!(
        h.now,
        heard.plus(DEFAULT_RECONNECT_GRACE),
        "counted from the contact"
    );
    assert_eq!(h.store.jobs[&L1].stop, Some(StopReason::Fence));
    assert_eq!(
        h.store.last_contact,
        Some(heard),
        "nothing heard: nothing newer written"
    );
}

/// E12: a store written before the last contact was kept counts the grace from the first
/// start that finds it, and keeps that start: a later restart does not count again.
#[test]
fn e12_a_store_without_a_last_contact_counts_from_its_first_start_only() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.store.last_contact = None;
    let outs = h.restart(secs(1));
    let started = h.now;
    assert_eq!(names(&outs), ["adopt", "connect", "persist"]);
    assert_eq!(all_writes(&outs), [ExecutorWrite::Contact { at: started }]);
    let outs = h.restart(DEFAULT_RECONNECT_GRACE);
    assert_eq!(stops(&outs), [L1], "{outs:?}");
}

/// E12: a last contact later than the start (the driver's clock was set back between
/// processes) is replaced by the start at once, so the lateness is one step, not one per
/// restart.
#[test]
fn e12_a_last_contact_after_the_start_is_replaced_by_the_start() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.store.last_contact = Some(h.now.plus(secs(3600)));
    let outs = h.restart(secs(1));
    let started = h.now;
    assert_eq!(all_writes(&outs), [ExecutorWrite::Contact { at: started }]);
    let outs = h.restart(DEFAULT_RECONNECT_GRACE);
    assert_eq!(stops(&outs), [L1], "{outs:?}");
}

/// E12: while a job runs and the mill keeps answering, the contact gets a batch of its own
/// at most once per `snapshot_interval`, and the store's never lags more than that; once no
/// job runs, nothing is written for it.
#[test]
fn e12_contact_is_persisted_at_most_once_per_snapshot_interval_and_only_while_jobs_run() {
    let mut h = Harness::ready(config());
    let interval = h.config.snapshot_interval;
    h.run(L1, "shell");
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(1),
    });
    let start = h.now;
    let mut own = Vec::new();
    while h.now < start.plus(secs(120)) {
        let (_, mut outs) = h.until_deadline();
        outs.extend(h.mill(ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: EPOCH,
            up_to: Seqno(1),
        }));
        for o in &outs {
            if let ExecutorOutput::Persist(b) = o {
                assert!(
                    matches!(b.writes[..], [ExecutorWrite::Contact { .. }]),
                    "only the contact is written: {b:?}"
                );
                own.push(h.now);
            }
        }
        let durable = h.store.last_contact.expect("a contact");
        assert!(
            h.now.since(durable) <= interval,
            "lags by {:?}",
            h.now.since(durable)
        );
    }
    assert!(own.len() >= 2, "{own:?}");
    for pair in own.windows(2) {
        assert!(pair[1].since(pair[0]) >= interval, "{own:?}");
    }

    h.exited(L1, TerminalStatus::Success);
    h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(2),
    });
    let idle = h.now;
    while h.now < idle.plus(secs(120)) {
        let (_, mut outs) = h.until_deadline();
        outs.extend(h.mill(ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: EPOCH,
            up_to: Seqno(2),
        }));
        assert!(all_writes(&outs).is_empty(), "no job runs: {outs:?}");
    }
}

/// E12: a batch written anyway carries the contact; no batch of its own is added.
#[test]
fn e12_contact_rides_on_a_batch_written_anyway() {
    let mut h = Harness::ready(config());
    h.run(L1, "docker");
    h.advance(secs(2));
    h.reserve(L2, spec("docker"));
    let outs = h.commit(L2);
    assert_eq!(names(&outs), ["persist", "start", "send:CommitResult"]);
    assert_eq!(contacts(&outs), [h.now]);
    assert_eq!(h.store.last_contact, Some(h.now));
    // Nothing is left for the contact's own timer.
    let outs = h.advance(h.config.snapshot_interval);
    assert!(all_writes(&outs).is_empty(), "{outs:?}");
}

// ------------------------------------------------------------------------------- outbox bound

#[test]
fn e5_outbox_full_stops_taking_seats() {
    let mut c = config();
    c.outbox_capacity = 6; // 3 seats: the minimum is 2 × 3
    let mut h = Harness::ready(c);
    h.run(L1, "shell");
    h.exited(L1, TerminalStatus::Success); // 2 unacked events
                                           // One more event held and one owed for L2's terminal.
    h.run(L2, "docker");
    // 3 held + 1 owed + 2 for a new seat = 6: still fits.
    assert!(reserve_result(&h.reserve(L3, spec("docker"))).0);
    // Now 3 held + 3 owed: a fourth seat would need 2 more than the bound.
    let outs = h.reserve(LeaseId(4), spec("shell"));
    let (accepted, reject, reason, _) = reserve_result(&outs);
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Transient));
    assert!(reason.contains("outbox full"), "{reason}");

    // The snapshot said unavailable the moment it filled up.
    let (_, outs) = h.until_deadline();
    assert!(snapshots(&outs)[0].1.values().all(|a| !a));

    // Acks make room and availability comes back with a snapshot.
    let outs = h.mill(ToExecutor::Ack {
        term: crate::types::Term(1),
        epoch: EPOCH,
        up_to: Seqno(3),
    });
    assert_eq!(names(&outs), ["persist", "send:Snapshot"]);
    assert_eq!(snapshots(&outs)[0].1.get("shell"), Some(&true));
    // Sequenced events are never dropped, even at the bound.
    h.commit(L3);
    h.feed(ExecutorInput::JobStarted { lease: L3 });
    h.exited(L2, TerminalStatus::Success);
    h.exited(L3, TerminalStatus::Success);
    let seqnos: Vec<u64> = h.store.outbox.iter().map(|e| e.seqno.get()).collect();
    assert_eq!(seqnos, [4, 5, 6]);
}

// ----------------------------------------------------------------------------- bad input, misc

#[test]
fn stale_connections_and_unexpected_inputs_are_ignored_or_closed() {
    let mut h = Harness::ready(config());
    // A message on a connection that is not the session's.
    let outs = h.feed(ExecutorInput::Message {
        conn: ConnId(99),
        msg: ToExecutor::CancelAttempt {
            term: crate::types::Term(1),
            lease: L1,
            reason: "x".into(),
        },
    });
    assert!(outs.is_empty());
    // A connection nobody asked for is closed.
    let outs = h.feed(ExecutorInput::Connected { conn: ConnId(5) });
    assert_eq!(names(&outs), ["close"]);
    assert!(h.exec.is_ready());
    // A second Welcome is a protocol error.
    let outs = h.mill(ToExecutor::Welcome {
        term: crate::types::Term(1),
        cursor: Seqno(0),
        timers: config().session_timers(),
    });
    assert_eq!(names(&outs), ["close"]);
    // Engine reports for unknown leases do nothing.
    assert!(h.exited(LeaseId(42), TerminalStatus::Success).is_empty());
    assert!(h
        .feed(ExecutorInput::JobStarted { lease: LeaseId(42) })
        .is_empty());
}

/// The `LiveLog`s among `outs`, as (offset, bytes).
fn live_chunks(outs: &[ExecutorOutput]) -> Vec<(u64, Vec<u8>)> {
    sent(outs)
        .into_iter()
        .filter_map(|m| match m {
            ToMill::LiveLog {
                lease,
                offset,
                bytes,
            } => {
                assert_eq!(lease, L1);
                Some((offset, bytes))
            }
            _ => None,
        })
        .collect()
}

fn job_log(offset: u64, bytes: &[u8]) -> ExecutorInput {
    ExecutorInput::JobLog {
        lease: L1,
        offset,
        bytes: bytes.to_vec(),
    }
}

#[test]
fn e15_live_log_chunks_carry_their_offsets() {
    let mut c = config();
    c.live_log_chunk = 4;
    let mut h = Harness::ready(c);
    h.run(L1, "shell");
    let chunks = live_chunks(&h.feed(job_log(100, b"hello world")));
    assert_eq!(
        chunks,
        [
            (100, b"hell".to_vec()),
            (104, b"o wo".to_vec()),
            (108, b"rld".to_vec())
        ]
    );
}

#[test]
fn e15_bytes_dropped_while_cut_off_leave_a_hole_not_a_marker() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    assert_eq!(
        live_chunks(&h.feed(job_log(0, b"seen "))),
        [(0, b"seen ".to_vec())]
    );
    h.disconnect();
    assert!(h.feed(job_log(5, b"lost ")).is_empty());
    h.until_deadline();
    h.connect(Seqno(1));
    // The next chunk starts where the engine says, five bytes past the last one sent, and
    // nothing was written into the output to cover the hole.
    let chunks = live_chunks(&h.feed(job_log(10, b"!")));
    assert_eq!(chunks, [(10, b"!".to_vec())]);
}

#[test]
fn e15_bytes_over_budget_are_a_hole_and_the_end_mark_reveals_a_trailing_one() {
    let mut c = config();
    c.live_log_budget = 8;
    let mut h = Harness::ready(c);
    h.run(L1, "shell");
    // 8 of 12 bytes fit the window's budget; the rest are dropped, not delayed.
    assert_eq!(
        live_chunks(&h.feed(job_log(0, b"0123456789ab"))),
        [(0, b"01234567".to_vec())]
    );
    assert!(live_chunks(&h.feed(job_log(12, b"cd"))).is_empty());
    // The job ends: an empty chunk at the end of its output goes before the terminal, so the
    // mill knows six bytes never reached it.
    let outs = h.exited(L1, TerminalStatus::Success);
    assert_eq!(live_chunks(&outs), [(14, Vec::new())]);
    let kinds: Vec<&str> = sent(&outs).iter().map(msg_name).collect();
    let end = kinds.iter().position(|k| *k == "LiveLog");
    let terminal = kinds.iter().position(|k| *k == "EventBatch");
    assert!(end < terminal, "{kinds:?}");
}

#[test]
fn e15_a_job_without_output_sends_no_end_mark() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    assert!(live_chunks(&h.exited(L1, TerminalStatus::Success)).is_empty());
}

#[test]
fn config_defaults_are_valid_and_errors_name_the_setting() {
    let c = ExecutorConfig::new(NodeId::new("n1").unwrap(), "t");
    assert_eq!(c.validate(), Ok(()));
    assert_eq!(c.snapshot_interval, secs(5));
    assert_eq!(c.reconnect_grace, secs(45));
    assert_eq!(c.outbox_capacity, 10_000);

    let mut bad = c.clone();
    bad.snapshot_interval = Duration::from_millis(7500);
    let err = bad.validate().unwrap_err();
    assert_eq!(err.setting(), "snapshot_interval");
    assert!(err.to_string().contains("7.5s"), "{err}");

    let mut bad = c.clone();
    bad.engines.insert("gpu".into(), EngineConfig::seats(0));
    assert_eq!(bad.validate().unwrap_err().setting(), "engines");

    let mut bad = c.clone();
    bad.outbox_capacity = 1;
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::OutboxCapacity {
            capacity: 1,
            min: 2
        })
    ));

    let mut bad = c.clone();
    bad.backoff_max = secs(60);
    assert_eq!(bad.validate().unwrap_err().setting(), "backoff_max");

    let mut bad = c;
    bad.engines
        .get_mut("shell")
        .unwrap()
        .resources
        .insert("jobs".into(), 3);
    assert_eq!(bad.validate().unwrap_err().setting(), "engines");
}

#[test]
fn store_validation_refuses_a_gapped_outbox() {
    let mut store = ExecutorSnapshot::fresh(EPOCH);
    store.next_seqno = Seqno(4);
    for s in [1, 3] {
        store.outbox.push_back(Event {
            seqno: Seqno(s),
            lease: L1,
            kind: EventKind::Running,
        });
    }
    assert!(matches!(
        store.validate(),
        Err(StoreError::OutboxOrder {
            seqno: Seqno(3),
            ..
        })
    ));
    assert!(matches!(
        Executor::try_new(config(), store, Time::ZERO),
        Err(StartError::Store(_))
    ));
}

#[test]
fn one_input_sequence_gives_one_output_sequence() {
    let script = || {
        let (mut h, mut all) = Harness::new(config());
        all.extend(h.feed(ExecutorInput::ConnectFailed));
        all.extend(h.until_deadline().1);
        all.extend(h.connect(Seqno(0)));
        all.extend(h.reserve(L1, spec("shell")));
        all.extend(h.reserve(L2, spec("docker")));
        all.extend(h.commit(L1));
        all.extend(h.feed(ExecutorInput::JobStarted { lease: L1 }));
        all.extend(h.until_deadline().1);
        all.extend(h.disconnect());
        all.extend(h.exited(L1, TerminalStatus::Success));
        for _ in 0..4 {
            let (_, outs) = h.until_deadline();
            let dialed = outs
                .iter()
                .any(|o| matches!(o, ExecutorOutput::Connect { .. }));
            all.extend(outs);
            if dialed {
                all.extend(h.feed(ExecutorInput::ConnectFailed));
            }
        }
        all.extend(h.until_deadline().1);
        all.extend(h.connect(Seqno(1)));
        all.extend(h.mill(ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: EPOCH,
            up_to: Seqno(2),
        }));
        (all, h.now)
    };
    let (a, ta) = script();
    let (b, tb) = script();
    assert!(a.len() > 15);
    assert_eq!(ta, tb);
    assert_eq!(a, b);
}

// ---------------------------------------------------------------------------- the timer table

/// Every timer of `h`'s executor watches something live, and everything live has its timer.
fn audited(h: &Harness) {
    if let Err(e) = h.exec.check_timers() {
        panic!("timer table: {e}");
    }
}

#[test]
fn e3_a_reservation_that_ends_leaves_no_ttl_behind() {
    let mut h = Harness::ready(config());
    let baseline = h.exec.timer_count();
    assert_eq!(
        baseline, 1,
        "an idle welcomed executor waits only on its link"
    );
    // Released, cancelled, committed: each takes its ttl with it.
    h.reserve(L1, spec("shell"));
    assert_eq!(h.exec.timer_count(), baseline + 1);
    h.mill(ToExecutor::ReleaseLease {
        term: crate::types::Term(1),
        lease: L1,
    });
    assert_eq!(h.exec.timer_count(), baseline);
    h.reserve(L2, spec("shell"));
    h.mill(ToExecutor::CancelAttempt {
        term: crate::types::Term(1),
        lease: L2,
        reason: "user".into(),
    });
    assert_eq!(h.exec.timer_count(), baseline);
    audited(&h);
    h.run(L3, "shell");
    // Running: self-fencing watches it (E12); no ttl is left for the committed seat.
    assert_eq!(h.exec.timer_count(), baseline + 1);
    audited(&h);
    h.exited(L3, TerminalStatus::Success);
    assert_eq!(h.exec.timer_count(), baseline);
    audited(&h);
}

#[test]
fn e3_an_expired_reservation_fires_once_and_is_gone() {
    let mut h = Harness::ready(config());
    h.reserve(L1, spec("shell"));
    audited(&h);
    h.advance(secs(46));
    assert_eq!(h.exec.reserved_leases().count(), 0);
    assert_eq!(h.exec.timer_count(), 1);
    audited(&h);
}

/// Runs until `lease` is told to stop, answering dials with failures; returns how long that
/// took, or `None` if nothing stopped it within `bound`.
fn time_to_fence(h: &mut Harness, lease: LeaseId, bound: Duration) -> Option<Duration> {
    let mut waited = Duration::ZERO;
    while waited <= bound {
        let (gap, outs) = h.until_deadline();
        waited += gap;
        if outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::StopJob { lease: l, .. } if *l == lease))
        {
            return Some(waited);
        }
        if outs
            .iter()
            .any(|o| matches!(o, ExecutorOutput::Connect { .. }))
        {
            h.feed(ExecutorInput::ConnectFailed);
        }
    }
    None
}

/// A mill on timers other than the executor's flags: a shorter grace (20 s, against 45 s).
fn mill_timers() -> SessionTimers {
    SessionTimers {
        silence_timeout: secs(8),
        snapshot_interval: secs(2),
        reconnect_grace: secs(20),
    }
}

#[test]
fn m1_e12_a_welcomed_executor_runs_on_the_mills_timers_and_fences_by_its_grace() {
    let (mut h, outs) = Harness::new(config());
    assert_eq!(names(&outs), ["connect"]);
    assert_eq!(h.exec.timers(), config().session_timers());
    let outs = h.connect_with(Seqno(0), mill_timers());
    assert!(
        writes(&outs).contains(&ExecutorWrite::Timers(mill_timers())),
        "the mill's timers are made durable: {outs:?}"
    );
    assert_eq!(h.exec.timers(), mill_timers());
    assert_eq!(h.store.timers, Some(mill_timers()));
    h.run(L1, "shell");
    // The mill goes silent: the executor gives up on the connection by the mill's silence
    // timeout and fences by the mill's grace (20 s), not by its own flag (45 s).
    let took = time_to_fence(&mut h, L1, secs(45)).expect("fenced");
    assert!(
        took <= secs(20),
        "fenced after {took:?}, the mill's grace is 20 s"
    );
    assert!(took >= secs(19), "fenced early, after {took:?}");
}

#[test]
fn e12_a_restarted_executor_fences_by_the_timers_its_store_holds() {
    let (mut h, _) = Harness::new(config());
    h.connect_with(Seqno(0), mill_timers());
    h.run(L1, "shell");
    let outs = h.restart(secs(1));
    assert_eq!(adoptions(&outs), [(L1, JobId(101))]);
    assert_eq!(
        h.exec.timers(),
        mill_timers(),
        "the store's timers, not the flags"
    );
    h.feed(ExecutorInput::JobStarted { lease: L1 });
    let took = time_to_fence(&mut h, L1, secs(45)).expect("fenced");
    assert!(took <= secs(20), "fenced {took:?} after the restart");
}

#[test]
fn m1_a_welcome_on_the_same_timers_writes_nothing_for_them() {
    let (mut h, _) = Harness::new(config());
    let outs = h.connect(Seqno(0));
    assert!(
        !writes(&outs)
            .iter()
            .any(|w| matches!(w, ExecutorWrite::Timers(_))),
        "{outs:?}"
    );
    assert_eq!(h.store.timers, None);
}

#[test]
fn m1_timers_the_executor_cannot_run_on_close_the_connection_naming_both_values() {
    // The mill's grace is below this executor's largest reconnect backoff (10 s).
    let short = SessionTimers {
        silence_timeout: secs(4),
        snapshot_interval: secs(1),
        reconnect_grace: secs(6),
    };
    let (mut h, _) = Harness::new(config());
    let outs = h.connect_with(Seqno(0), short);
    let reason = closes(&outs);
    assert!(
        reason.contains("--reconnect-grace 6s") && reason.contains("--backoff-max is 10s"),
        "{reason}"
    );
    assert_eq!(
        h.exec.timers(),
        config().session_timers(),
        "nothing adopted"
    );
    assert!(h.exec.ready_conn().is_none());
    // Timers no session can run on (a snapshot interval above half the silence timeout).
    let (mut h, _) = Harness::new(config());
    let broken = SessionTimers {
        snapshot_interval: secs(5),
        ..mill_timers()
    };
    let reason = closes(&h.connect_with(Seqno(0), broken));
    assert!(reason.contains("--snapshot-interval 5s"), "{reason}");
}

/// The reason of the one `Close` in `outs`.
fn closes(outs: &[ExecutorOutput]) -> String {
    let reasons: Vec<&String> = outs
        .iter()
        .filter_map(|o| match o {
            ExecutorOutput::Close { reason, .. } => Some(reason),
            _ => None,
        })
        .collect();
    assert_eq!(reasons.len(), 1, "one close: {outs:?}");
    reasons[0].clone()
}

// --------------------------------------------------------------------------------------- E16

impl Harness {
    fn reserve_direct(&mut self, lease: LeaseId, spec: JobSpec) -> Vec<ExecutorOutput> {
        self.ask(lease, spec, true)
    }
}

#[test]
fn e16_a_direct_ask_with_every_seat_taken_waits_and_starts_on_the_next_free_seat_commit_durable_first(
) {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    let (accepted, ..) = reserve_result(&h.reserve_direct(L2, spec("shell")));
    assert!(accepted, "E16: a direct ask waits for the next free seat");
    assert_eq!(h.exec.queued_leases().collect::<Vec<_>>(), [L2]);
    assert!(
        h.exec.reserved_leases().next().is_none(),
        "it holds no seat"
    );
    let outs = h.commit(L2);
    assert!(
        outs.is_empty(),
        "its commit is answered when it starts, once durable (E4): {outs:?}"
    );
    // It waits past its ttl (45 s): a committed lease no longer expires (E3). The mill is
    // heard meanwhile, so nothing fences (E12).
    let mut snaps = Vec::new();
    for _ in 0..10 {
        snaps.extend(snapshots(&h.advance(secs(5))));
        h.mill(ToExecutor::ReleaseLease {
            term: crate::types::Term(1),
            lease: L3,
        });
    }
    assert_eq!(h.exec.queued_leases().collect::<Vec<_>>(), [L2]);
    // The snapshots list it, so the mill's reconcile (M8) never ends it as gone.
    assert!(
        !snaps.is_empty() && snaps.iter().all(|(_, _, active)| active.contains(&L2)),
        "{snaps:?}"
    );
    // The running job ends: its seat goes to the waiting lease in the same step.
    let outs = h.exited(L1, TerminalStatus::Success);
    let n = names(&outs);
    let start = n.iter().position(|s| s == "start").expect("started");
    let commit = n
        .iter()
        .position(|s| s == "send:CommitResult")
        .expect("answered");
    let persist = n
        .iter()
        .rposition(|s| s == "persist")
        .filter(|&p| p < start)
        .expect("persisted before it starts");
    assert!(persist < start && start < commit, "{n:?}");
    assert!(all_writes(&outs)
        .iter()
        .any(|w| matches!(w, ExecutorWrite::JobCommitted { lease, .. } if *lease == L2)));
    assert!(sent(&outs).contains(&ToMill::CommitResult {
        lease: L2,
        committed: true
    }));
    assert_eq!(h.exec.running_leases().collect::<Vec<_>>(), [L2]);
    assert!(h.exec.queued_leases().next().is_none());
}

#[test]
fn e16_releasing_a_waiting_lease_drops_it_and_answers_not_committed() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    h.reserve_direct(L2, spec("shell"));
    h.commit(L2);
    let outs = h.mill(ToExecutor::ReleaseLease {
        term: crate::types::Term(1),
        lease: L2,
    });
    assert_eq!(
        sent(&outs),
        [ToMill::CommitResult {
            lease: L2,
            committed: false
        }]
    );
    assert!(h.exec.queued_leases().next().is_none());
    // The seat frees: nothing else starts.
    let outs = h.exited(L1, TerminalStatus::Success);
    assert!(!names(&outs).iter().any(|n| n == "start"), "{outs:?}");
}

#[test]
fn e16_bids_and_asks_short_of_a_resource_are_refused_and_at_most_capacity_leases_wait() {
    let mut h = Harness::ready(config());
    h.run(L1, "shell");
    // A bid is answered now: refused.
    let (accepted, reject, ..) = reserve_result(&h.reserve(L2, spec("shell")));
    assert!(!accepted);
    assert_eq!(reject, Some(RejectKind::Transient));
    // One direct ask waits (capacity 1); the next is refused.
    assert!(reserve_result(&h.reserve_direct(L2, spec("shell"))).0);
    let (accepted, reject, reason, _) = reserve_result(&h.reserve_direct(L3, spec("shell")));
    assert!(
        !accepted && reject == Some(RejectKind::Transient),
        "{reason}"
    );
    // A free seat short of a resource is refused, never waited for: the mill learns which
    // resource (M34).
    let mut h = Harness::ready(two_seats_short_of_cpu());
    h.run(L1, "shell");
    let (accepted, _, reason, _) = reserve_result(&h.reserve_direct(L2, spec("shell")));
    assert!(!accepted && reason.contains("cpu_millis"), "{reason}");
}

#[test]
fn e16_a_cancel_a_drain_or_self_fencing_drops_a_waiting_lease_and_a_restart_forgets_it() {
    for how in ["cancel", "drain", "fence", "restart"] {
        let mut h = Harness::ready(config());
        h.run(L1, "shell");
        h.reserve_direct(L2, spec("shell"));
        h.commit(L2);
        match how {
            "cancel" => {
                let outs = h.mill(ToExecutor::CancelAttempt {
                    term: crate::types::Term(1),
                    lease: L2,
                    reason: "stop".into(),
                });
                assert!(sent(&outs).contains(&ToMill::CancelAck { lease: L2 }));
            }
            "drain" => {
                let outs = h.feed(ExecutorInput::Drain);
                assert!(sent(&outs).contains(&ToMill::CommitResult {
                    lease: L2,
                    committed: false
                }));
            }
            "fence" => {
                h.disconnect();
                h.advance(secs(120));
            }
            _ => {
                h.restart(secs(1));
            }
        }
        assert!(h.exec.queued_leases().next().is_none(), "{how}");
        let outs = h.exited(L1, TerminalStatus::Success);
        assert!(
            !names(&outs).iter().any(|n| n == "start"),
            "{how}: nothing waiting starts: {outs:?}"
        );
    }
}
