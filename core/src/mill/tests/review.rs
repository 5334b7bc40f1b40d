//! Adversarial review: each test names the rule it defends and reproduces a bug that was
//! found and fixed, through inputs and outputs only. The randomized test at the end feeds
//! well-typed but hostile executor traffic and checks that everything drains at quiescence.

use super::*;
use std::collections::VecDeque;

use crate::quota::QuotaConfig;

fn cancel(h: &mut H, job: JobId) {
    h.cancel_req(job, "user".into()).unwrap();
}

/// A connected executor offering only `engine`, with one snapshot (so it is ready).
fn ready_with(h: &mut H, name: &str, engine: &str, capacity: u32) -> ConnId {
    let conn = ConnId(h.next_conn);
    h.next_conn += 1;
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(
        conn,
        crate::testkit::Hello::new(name, Epoch(1))
            .token("secret")
            .engines(&[engine])
            .build(),
    );
    h.snapshot_with(conn, one_engine(engine, true, capacity), &[]);
    conn
}

fn one_engine(engine: &str, available: bool, capacity: u32) -> BTreeMap<String, EngineStatus> {
    [(
        engine.to_string(),
        EngineStatus {
            available,
            capacity,
            load: BTreeMap::new(),
        },
    )]
    .into_iter()
    .collect()
}

#[test]
fn m12_a_job_ended_while_bidding_gives_back_every_seat_it_asked_for() {
    // Two nodes with four seats each; each round ends by a cancel while one ask is accepted
    // (b) and a better one is still in flight (a). Both seats must come back, or after four
    // rounds neither node is ever asked again.
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    for _ in 0..4 {
        let job = h.submit(spec());
        let (la, lb) = (h.asks(a)[0], h.asks(b)[0]);
        h.accept(b, lb, charge(&[("jobs", 1)]));
        cancel(&mut h, job);
        assert_eq!(h.releases(b), vec![lb]);
        h.accept(a, la, charge(&[("jobs", 1)]));
        assert_eq!(h.releases(a), vec![la]);
    }
    h.submit(spec());
    assert_eq!(h.asks(a).len(), 1, "a's seats leaked: {:?}", h.out);
    assert_eq!(h.asks(b).len(), 1, "b's seats leaked: {:?}", h.out);
}

#[test]
fn m17_commit_is_resent_after_a_pending_cancel_briefly_made_the_node_busy() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (first, l1) = h.run_on(a, spec());
    h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![l2]);
    // The commit goes unanswered; meanwhile a cancel makes the node take no new work (M27)
    // just when the commit is due again.
    cancel(&mut h, first);
    assert_eq!(h.cancels(a), vec![l1]);
    h.keep_alive(a, 6 * SEC, &[l1, l2]);
    h.msg(a, ToMill::CancelAck { lease: l1 });
    let mut resent = h.commits(a);
    h.keep_alive(a, 20 * SEC, &[l1, l2]);
    resent.extend(h.commits(a));
    assert!(
        resent.contains(&l2),
        "the commit of {l2} was never sent again"
    );
}

#[test]
fn m5_i3_grace_expiring_while_a_cancel_ack_is_in_flight_does_not_fail_reported_leases() {
    // After a mill restart the node comes back just before grace ends, reports its running
    // lease and one the mill does not know; the mill cancels the latter. Grace must not
    // fail the reported lease while that ack is on its way.
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, l1) = h.run_on(a, spec());
    h.restart();
    h.advance(44 * SEC);
    let a2 = h.hello_as("a", 1, &[]);
    let l2 = LeaseId(l1.0 + 500);
    h.snapshot(a2, 0.0, &[l1, l2]);
    assert_eq!(h.cancels(a2), vec![l2]);
    h.advance(2 * SEC);
    assert!(
        h.terminal_of(job).is_none(),
        "a reported lease failed at grace expiry: {:?}",
        h.terminal_of(job)
    );
    h.msg(a2, ToMill::CancelAck { lease: l2 });
    h.events(a2, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Success);
}

#[test]
fn m5_a_cancel_never_acked_after_grace_still_fails_the_nodes_leases() {
    // The other side of the test above: grace is only stretched to the ack deadline.
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, l1) = h.run_on(a, spec());
    h.restart();
    h.advance(44 * SEC);
    let a2 = h.hello_as("a", 1, &[]);
    let l2 = LeaseId(l1.0 + 500);
    h.snapshot(a2, 0.0, &[l1, l2]);
    h.keep_alive(a2, 15 * SEC, &[l1, l2]);
    assert!(h.closed(a2).is_some());
    assert_eq!(
        h.terminal_of(job).unwrap().error.as_deref(),
        Some("executor lost")
    );
}

#[test]
fn m15_i9_a_quota_grant_is_not_held_while_the_job_cannot_bid() {
    // Owner quota of one job. Job 2 waits for quota on a shell node; when job 1 ends the
    // grant goes to job 2, but no shell seat is offered any more. A docker job of the same
    // owner must not wait behind that grant while its docker node sits idle.
    let mut h = H::with(MillConfig {
        top_k: 1,
        quota: QuotaConfig {
            owner_defaults: charge(&[("jobs", 1)]),
            ..QuotaConfig::default()
        },
        ..config()
    });
    let a = h.ready("a", 0.0);
    let (_, l1) = h.run_on(a, spec());
    let _second = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    assert_eq!(h.releases(a), vec![l2], "waits for quota without the seat");
    h.snapshot_with(a, engines(false, 1.0), &[l1]);
    h.events(a, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);

    let d = ready_with(&mut h, "d", "docker", 1);
    let mut s = spec();
    s.engine = "docker".into();
    let third = h.submit(s);
    let l3 = h.asks(d)[0];
    h.accept(d, l3, charge(&[("jobs", 1)]));
    assert_eq!(
        h.commits(d),
        vec![l3],
        "the docker job waits behind a grant no shell node can use"
    );
    assert!(matches!(
        h.mill.job_state(third),
        Some(JobState::Reserved { .. })
    ));
}

#[test]
fn m26_i1_cancel_of_a_reserved_lease_whose_commit_went_out_before_a_reconnect_stops_it() {
    // The commit reached the node, which started the job, but the connection broke before
    // the answer came back. On reconnect the node reports the lease; a cancel still pending
    // from the outage keeps it busy, so the commit is not re-sent yet. A user cancel now
    // must stop the job: a release never stops a running one (E8).
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (first, l0) = h.run_on(a, spec());
    let job = h.submit(spec());
    let l1 = h.asks(a)[0];
    h.accept(a, l1, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![l1]);
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    cancel(&mut h, first);
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[l0, l1]);
    assert_eq!(h.cancels(a2), vec![l0], "the cancel that waited goes out");
    cancel(&mut h, job);
    assert_eq!(
        h.terminal_of(job).unwrap().status,
        TerminalStatus::Cancelled
    );
    assert!(
        h.cancels(a2).contains(&l1),
        "only a release was sent for a lease whose commit may have started it: {:?}",
        h.sent(a2)
    );
}

#[test]
fn i9_m6_a_node_that_never_snapshots_cannot_keep_a_lease_past_its_timeout() {
    // Back after a disconnect, the node never sends its Snapshot (so it never reconciles and
    // the timeout's cancel is never sent) but trickles one new event every 10 s. Each extends
    // grace (M6), but never past twice reconnect_grace from the disconnect: the lease fails.
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let mut s = spec();
    s.timeout = Some(60 * SEC);
    let (job, _) = h.run_on(a, s);
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    let a2 = h.hello_as("a", 1, &[]);
    let mut ended = false;
    for k in 1..=120u64 {
        h.advance(10 * SEC);
        ended |= h.terminal_of(job).is_some();
        h.events(a2, 1, vec![(k, LeaseId(900 + k), EventKind::Running)]);
        ended |= h.terminal_of(job).is_some();
    }
    assert!(ended, "the job outlived its 60 s timeout by 20 minutes");
}

// ---- randomized hostile traffic -------------------------------------------------------------

/// A tiny deterministic generator (xorshift64): a failing seed replays exactly.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> Option<T> {
        if items.is_empty() {
            return None;
        }
        Some(items[self.below(items.len() as u64) as usize].clone())
    }
}

/// A fake executor: well-typed messages, any order, often wrong.
struct Fake {
    name: String,
    conn: Option<ConnId>,
    /// The connection before a half-open reconnect, used again if the new one is refused.
    prev: Option<ConnId>,
    epoch: u64,
    snap: u64,
    engines: Vec<String>,
    /// Lease ids this node was told about (asks, commits, cancels), latest last.
    seen: Vec<LeaseId>,
    asks: Vec<LeaseId>,
    commits: Vec<LeaseId>,
    cancels: Vec<LeaseId>,
    /// What an honest executor still has to answer, oldest first.
    todo: VecDeque<ToExecutor>,
    /// Leases it holds: accepted seats and running jobs.
    holds: Vec<LeaseId>,
    running: Vec<LeaseId>,
}

const ENGINES: [&str; 2] = ["shell", "docker"];
const LABELS: [&str; 2] = ["gpu", "linux"];

fn remember(list: &mut Vec<LeaseId>, lease: LeaseId) {
    if !list.contains(&lease) {
        list.push(lease);
        if list.len() > 24 {
            list.remove(0);
        }
    }
}

struct Chaos {
    h: H,
    rng: XorShift,
    fakes: Vec<Fake>,
    owner: BTreeMap<ConnId, usize>,
    /// Which node each ask was sent to (for the seat accounting check).
    ask_node: BTreeMap<LeaseId, NodeId>,
    submitted: Vec<JobId>,
    terminals: BTreeMap<JobId, u32>,
    /// What the run reached, by kind (coverage).
    seen: BTreeMap<String, u32>,
}

impl Chaos {
    fn new(seed: u64) -> Self {
        let config = MillConfig {
            job_timeout: 300 * SEC,
            cancel_teardown_timeout: 60 * SEC,
            quarantine_strikes: 4,
            top_k: 2,
            bid_fallbacks: 2,
            max_pending: 40,
            quota: QuotaConfig {
                owner_defaults: charge(&[("jobs", 3), ("cpu", 6)]),
                ..QuotaConfig::default()
            },
            ..config()
        };
        let fakes = (0..4)
            .map(|i| Fake {
                name: format!("n{i}"),
                conn: None,
                prev: None,
                epoch: 1,
                snap: 0,
                engines: Vec::new(),
                seen: Vec::new(),
                asks: Vec::new(),
                commits: Vec::new(),
                cancels: Vec::new(),
                todo: VecDeque::new(),
                holds: Vec::new(),
                running: Vec::new(),
            })
            .collect();
        Chaos {
            h: H::with(config),
            rng: XorShift(seed),
            fakes,
            owner: BTreeMap::new(),
            ask_node: BTreeMap::new(),
            submitted: Vec::new(),
            terminals: BTreeMap::new(),
            seen: BTreeMap::new(),
        }
    }

    /// Reads the last step's outputs like a driver: records what each fake was sent,
    /// counts terminals, and reports closed connections back as `Disconnected`.
    fn pump(&mut self) {
        loop {
            let mut closed = Vec::new();
            for o in &self.h.out {
                match o {
                    MillOutput::Send { conn, msg } => {
                        let Some(&i) = self.owner.get(conn) else {
                            continue;
                        };
                        let f = &mut self.fakes[i];
                        if !matches!(msg, ToExecutor::Ack { .. } | ToExecutor::Welcome { .. }) {
                            f.todo.push_back(msg.clone());
                        }
                        match msg {
                            ToExecutor::ReserveSeat { lease, .. } => {
                                remember(&mut f.asks, *lease);
                                remember(&mut f.seen, *lease);
                                self.ask_node.insert(*lease, node(&f.name));
                            }
                            ToExecutor::CommitLease { lease, .. } => {
                                remember(&mut f.commits, *lease);
                                remember(&mut f.seen, *lease);
                            }
                            ToExecutor::CancelAttempt { lease, .. } => {
                                remember(&mut f.cancels, *lease);
                            }
                            ToExecutor::Ack {
                                term: _,
                                epoch,
                                up_to,
                            } => {
                                // I4: no ack exceeds the durable cursor.
                                let stored = self.h.store.cursors.get(&(node(&f.name), *epoch));
                                assert!(
                                    *up_to == Seqno(0) || stored.is_some_and(|c| c >= up_to),
                                    "ack {up_to} above the durable cursor {stored:?}"
                                );
                            }
                            _ => {}
                        }
                    }
                    MillOutput::Close { conn, .. } => closed.push(*conn),
                    MillOutput::Observed(o) => {
                        let kind = match o {
                            Observation::Placed { .. } => "placed".to_string(),
                            Observation::Violation { .. } => "violation".to_string(),
                            Observation::Quarantined { .. } => "quarantined".to_string(),
                            Observation::Refused { .. } => "refused".to_string(),
                            Observation::Applied { .. } => "applied".to_string(),
                            Observation::Retried { .. } => "retried".to_string(),
                            Observation::QuotaWait { .. } => "quota-wait".to_string(),
                            Observation::Deposed { .. } => "deposed".to_string(),
                            Observation::Rare(p) => format!("{p:?}"),
                        };
                        *self.seen.entry(kind).or_insert(0) += 1;
                    }
                    MillOutput::JobUpdate {
                        job,
                        state: JobState::Done(_),
                    } => {
                        if let MillOutput::JobUpdate {
                            state: JobState::Done(t),
                            ..
                        } = o
                        {
                            let by = if t.exit_code.is_some() {
                                "engine"
                            } else {
                                "mill"
                            };
                            assert!(
                                by == "engine" || t.status != TerminalStatus::Success,
                                "I2: the mill made up a success for {job}"
                            );
                            *self.seen.entry(format!("{by} {}", t.status)).or_insert(0) += 1;
                        }
                        let n = self.terminals.entry(*job).or_insert(0);
                        *n += 1;
                        if *n > 1 && std::env::var("REVIEW_DEBUG").is_ok() {
                            for o in &self.h.all[self.h.all.len().saturating_sub(400)..] {
                                let s = format!("{o:?}");
                                eprintln!("{}", &s[..s.len().min(260)]);
                            }
                            panic!("second terminal for {job}");
                        }
                    }
                    _ => {}
                }
            }
            if closed.is_empty() {
                return;
            }
            // Only the outputs of the disconnects are read next round.
            let mut fresh = Vec::new();
            for conn in closed {
                if let Some(i) = self.owner.remove(&conn) {
                    let f = &mut self.fakes[i];
                    if f.conn == Some(conn) {
                        f.conn = f.prev.take().filter(|p| self.owner.contains_key(p));
                    }
                }
                self.h
                    .input(MillInput::Disconnected { conn })
                    .expect("disconnect");
                fresh.append(&mut self.h.out);
            }
            self.h.out = fresh;
        }
    }

    fn spec(&mut self) -> JobSpec {
        let mut s = spec();
        s.engine = ENGINES[self.rng.below(2) as usize].into();
        if self.rng.chance(20) {
            s.labels.insert(LABELS[self.rng.below(2) as usize].into());
        }
        s.resources = charge(&[("cpu", 1 + self.rng.below(3))]);
        s.identity.owner = format!("o{}", self.rng.below(2));
        if self.rng.chance(50) {
            s.timeout = Some(Duration::from_secs(20 + self.rng.below(200)));
        }
        s
    }

    fn claim(&mut self) -> Resources {
        match self.rng.below(20) {
            0 => charge(&[("jobs", 0)]),
            1..=4 => charge(&[("jobs", 1), ("cpu", 7)]),
            _ => charge(&[("jobs", 1), ("cpu", 1 + self.rng.below(3))]),
        }
    }

    fn hello(&mut self, i: usize) {
        let conn = ConnId(self.h.next_conn);
        self.h.next_conn += 1;
        self.h.input(MillInput::Connected { conn }).unwrap();
        self.pump();
        if self.rng.chance(10) {
            let f = &mut self.fakes[i];
            f.epoch += 1; // a wiped store
            f.holds.clear();
            f.running.clear();
        }
        self.fakes[i].todo.clear();
        let mut engines: Vec<String> = ENGINES
            .iter()
            .filter(|_| self.rng.chance(70))
            .map(|e| e.to_string())
            .collect();
        if engines.is_empty() {
            engines.push("shell".into());
        }
        let labels: Vec<String> = LABELS
            .iter()
            .filter(|_| self.rng.chance(50))
            .map(|l| l.to_string())
            .collect();
        let f = &mut self.fakes[i];
        f.prev = f.conn.replace(conn);
        f.snap = 0;
        f.engines = engines.clone();
        self.owner.insert(conn, i);
        let msg = crate::testkit::Hello::new(f.name.clone(), Epoch(f.epoch))
            .token("secret")
            .labels(&labels)
            .engines(&engines)
            .build();
        self.h.msg(conn, msg);
    }

    fn executor_step(&mut self, i: usize) {
        let Some(conn) = self.fakes[i].conn else {
            return self.hello(i);
        };
        if self.rng.chance(2) {
            // A new connection while the old one is half-open (M2: refused or replaced).
            return self.hello(i);
        }
        if self.rng.chance(85) {
            if let Some(msg) = self.honest(i) {
                return self.h.msg(conn, msg);
            }
        }
        let roll = self.rng.below(100);
        let msg = if roll < 25 {
            let f = &mut self.fakes[i];
            f.snap = if self.rng.chance(2) {
                f.snap
            } else {
                f.snap + 1
            };
            let engines = f
                .engines
                .clone()
                .into_iter()
                .map(|e| {
                    let status = EngineStatus {
                        available: self.rng.chance(85),
                        capacity: 1 + self.rng.below(3) as u32,
                        load: [("cpu".to_string(), self.rng.below(11) as f64 / 10.0)]
                            .into_iter()
                            .collect(),
                    };
                    (e, status)
                })
                .collect();
            let f = &self.fakes[i];
            let mut active: Vec<LeaseId> = f
                .seen
                .iter()
                .copied()
                .filter(|_| self.rng.chance(50))
                .collect();
            if self.rng.chance(2) {
                active.push(LeaseId(1 + self.rng.below(60)));
            }
            crate::testkit::snapshot(self.fakes[i].snap, engines, active, Seqno(0))
        } else if roll < 50 {
            let lease = if self.rng.chance(90) {
                self.rng.pick(&self.fakes[i].asks)
            } else {
                Some(LeaseId(1 + self.rng.below(60)))
            };
            let Some(lease) = lease else { return };
            let accepted = self.rng.chance(70);
            let reject = match self.rng.below(3) {
                0 => None,
                1 => Some(RejectKind::Transient),
                _ => Some(RejectKind::Incompatible),
            };
            let resources = if accepted {
                self.claim()
            } else {
                Resources::new()
            };
            ToMill::ReserveResult {
                lease,
                accepted,
                reject,
                reason: "r".into(),
                resources,
            }
        } else if roll < 62 {
            let Some(lease) = self.rng.pick(&self.fakes[i].commits) else {
                return;
            };
            crate::testkit::commit_result(lease, self.rng.chance(85))
        } else if roll < 82 {
            let f = &self.fakes[i];
            let cursor = self.h.mill.cursor(&node(&f.name), Epoch(f.epoch)).get();
            let start = match self.rng.below(40) {
                0 => cursor.saturating_sub(1).max(1),
                1 => cursor + 2,
                _ => cursor + 1,
            };
            let n = self.rng.below(4);
            let mut events = Vec::new();
            for k in 0..n {
                let lease = if self.rng.chance(85) {
                    self.rng.pick(&self.fakes[i].seen)
                } else {
                    Some(LeaseId(1 + self.rng.below(60)))
                };
                let Some(lease) = lease else { continue };
                let kind = if self.rng.chance(40) {
                    EventKind::Running
                } else {
                    let status = match self.rng.below(4) {
                        0 => TerminalStatus::Success,
                        1 => TerminalStatus::Failed,
                        2 => TerminalStatus::Timeout,
                        _ => TerminalStatus::Cancelled,
                    };
                    let log = match self.rng.below(10) {
                        0 => Some(crate::job::LogRef {
                            path: crate::job::LogRef::path_for(lease),
                            hash: format!("sha256:{}", "ab".repeat(32)),
                        }),
                        1 => Some(crate::job::LogRef {
                            path: "logs/x.log".into(),
                            hash: "md5:0".into(),
                        }),
                        _ => None,
                    };
                    EventKind::Terminal {
                        status,
                        exit_code: Some(0),
                        error: None,
                        log,
                        cause: crate::wire::EndCause::Engine,
                    }
                };
                events.push(crate::testkit::event(Seqno(start + k), lease, kind));
            }
            let epoch = if self.rng.chance(3) {
                Epoch(self.fakes[i].epoch + 1)
            } else {
                Epoch(self.fakes[i].epoch)
            };
            crate::testkit::batch(epoch, events)
        } else if roll < 92 {
            let Some(lease) = self.rng.pick(&self.fakes[i].cancels) else {
                return;
            };
            ToMill::CancelAck { lease }
        } else if roll < 94 {
            let Some(lease) = self.rng.pick(&self.fakes[i].seen) else {
                return;
            };
            ToMill::LiveLog {
                lease,
                offset: 0,
                bytes: vec![b'x'; 8],
            }
        } else if roll < 95 {
            crate::testkit::Hello::new(self.fakes[i].name.clone(), Epoch(self.fakes[i].epoch))
                .token("secret")
                .build()
        } else {
            self.owner.remove(&conn);
            self.fakes[i].conn = None;
            self.h.input(MillInput::Disconnected { conn }).unwrap();
            return;
        };
        self.h.msg(conn, msg);
    }

    /// What a well-behaved executor would send next: answers in order, then events for its
    /// jobs, then a snapshot.
    fn honest(&mut self, i: usize) -> Option<ToMill> {
        let f = &mut self.fakes[i];
        if f.snap == 0 || self.rng.chance(10) {
            f.snap += 1;
            let engines = f
                .engines
                .iter()
                .map(|e| {
                    let status = EngineStatus {
                        available: true,
                        capacity: 3,
                        load: BTreeMap::new(),
                    };
                    (e.clone(), status)
                })
                .collect();
            return Some(crate::testkit::snapshot(
                f.snap,
                engines,
                f.holds.clone(),
                Seqno(0),
            ));
        }
        if let Some(msg) = f.todo.pop_front() {
            return Some(match msg {
                ToExecutor::ReserveSeat { lease, .. } => {
                    let accepted = f.holds.len() < 3 && self.rng.chance(80);
                    if accepted {
                        f.holds.push(lease);
                    }
                    ToMill::ReserveResult {
                        lease,
                        accepted,
                        reject: (!accepted).then_some(RejectKind::Transient),
                        reason: String::new(),
                        resources: if accepted {
                            charge(&[("jobs", 1), ("cpu", 1 + self.rng.below(2))])
                        } else {
                            Resources::new()
                        },
                    }
                }
                ToExecutor::CommitLease { lease, .. } => {
                    let committed = f.holds.contains(&lease);
                    if committed && !f.running.contains(&lease) {
                        f.running.push(lease);
                    }
                    crate::testkit::commit_result(lease, committed)
                }
                ToExecutor::ReleaseLease { term: _, lease } => {
                    if !f.running.contains(&lease) {
                        f.holds.retain(|l| *l != lease);
                    }
                    return None;
                }
                ToExecutor::CancelAttempt { lease, .. } => {
                    if !f.running.contains(&lease) {
                        f.holds.retain(|l| *l != lease);
                    }
                    ToMill::CancelAck { lease }
                }
                _ => return None,
            });
        }
        let lease = self.rng.pick(&f.running)?;
        let cursor = self.h.mill.cursor(&node(&f.name), Epoch(f.epoch)).get();
        let kind = if self.rng.chance(30) {
            EventKind::Running
        } else {
            f.running.retain(|l| *l != lease);
            f.holds.retain(|l| *l != lease);
            terminal(if self.rng.chance(70) {
                TerminalStatus::Success
            } else {
                TerminalStatus::Failed
            })
        };
        let event = crate::testkit::event(Seqno(cursor + 1), lease, kind);
        Some(crate::testkit::batch(Epoch(f.epoch), vec![event]))
    }

    fn step(&mut self) {
        // Outputs already read must not be read again if this step sends nothing.
        self.h.out.clear();
        let roll = self.rng.below(100);
        if roll < 75 {
            let i = self.rng.below(self.fakes.len() as u64) as usize;
            self.executor_step(i);
        } else if roll < 85 {
            let d = Duration::from_millis(self.rng.below(3_000));
            self.h.advance(d);
        } else if roll < 93 {
            let s = self.spec();
            if let Ok(job) = self.h.submit_req(s) {
                self.submitted.push(job);
            }
        } else if roll < 96 {
            if let Some(job) = self.rng.pick(&self.submitted) {
                let _ = self.h.cancel_req(job, String::new());
            }
        } else if roll < 98 {
            let quarantined: Vec<NodeId> = self.h.mill.quarantined().iter().cloned().collect();
            if let Some(n) = self.rng.pick(&quarantined) {
                self.h.lift_req(n).unwrap();
            }
        } else if roll < 99 && self.rng.chance(20) {
            // The mill restarts: every connection is gone with it.
            self.h.restart();
            self.owner.clear();
            for f in &mut self.fakes {
                f.conn = None;
            }
            return;
        } else {
            self.h
                .advance(Duration::from_millis(self.rng.below(50_000)));
        }
        self.pump();
    }
}

/// Everything that must hold between any two steps, read from the mill's own state: each
/// structure agrees with the others, every seat the mill counts is accounted for, and every
/// wait has a timer that will end it (I9).
fn check_invariants(m: &Mill, ask_node: &BTreeMap<LeaseId, NodeId>, at: &str) {
    let armed = |t: Time, timer: Timer| m.timers.get(&timer) == Some(t);
    let armed_any = |f: &dyn Fn(&Timer) -> bool| m.timers.iter().any(|(t, _)| f(t));
    for (id, l) in &m.leases {
        let j = m
            .jobs
            .get(&l.job)
            .unwrap_or_else(|| panic!("{at}: lease {id} of no job"));
        assert!(
            matches!(j.phase, Phase::Leased(x) if x == *id),
            "{at}: lease {id} but job phase {:?}",
            j.phase
        );
        assert!(
            m.node_leases.get(&l.node).is_some_and(|s| s.contains(id)),
            "{at}: lease {id} missing from node_leases"
        );
        let s = m.sessions.get(&l.node);
        assert!(
            s.is_some(),
            "{at}: lease {id} on {} with no session",
            l.node
        );
        if let Some(s) = s {
            if l.state == LeaseState::Reserved && s.ready() && s.epoch == l.epoch {
                let Some((conn, due)) = l.commit_sent else {
                    panic!("{at}: reserved lease {id} on a ready node with no commit out");
                };
                assert_eq!(Some(conn), s.conn, "{at}: commit of {id} on an old conn");
                assert!(armed(due, Timer::Commit(*id)), "{at}: no commit timer {id}");
            }
        }
        match l.cancel.as_ref().map(|c| c.phase) {
            Some(CancelPhase::Acked { teardown }) => {
                assert!(
                    armed(teardown, Timer::Teardown(*id)),
                    "{at}: no teardown {id}"
                );
            }
            Some(CancelPhase::Sent) => {
                let due = s.and_then(|s| s.pending_cancels.get(id));
                assert!(due.is_some(), "{at}: cancel of {id} sent but not pending");
            }
            Some(CancelPhase::Waiting) => {
                // It goes out at the next reconcile; until then grace bounds it (M5).
                let s = s.expect("checked above");
                let sendable = s.conn.is_some() && s.reconciled && s.epoch == l.epoch;
                assert!(
                    !sendable,
                    "{at}: cancel of {id} waits on a node that could take it"
                );
                assert!(
                    s.grace.is_some(),
                    "{at}: cancel of {id} waits with no grace"
                );
            }
            None => {}
        }
    }
    for set in m.node_leases.values() {
        for id in set {
            assert!(
                m.leases.contains_key(id),
                "{at}: node_leases holds ended {id}"
            );
        }
    }
    let mut not_leased = 0;
    for (id, j) in &m.jobs {
        // Once the timeout fired, a running job ends through its lease's cancel.
        let cancelling = match j.phase {
            Phase::Leased(l) => m.leases.get(&l).is_some_and(|l| l.cancel.is_some()),
            _ => false,
        };
        assert!(
            cancelling || armed(j.deadline, Timer::JobTimeout(*id)),
            "{at}: job {id} has no timeout armed"
        );
        if j.quota_held.is_some() {
            assert!(m.quota.is_held(*id), "{at}: job {id} thinks it holds quota");
        }
        match &j.phase {
            Phase::Queued => assert!(m.queue.contains(id), "{at}: queued {id} not in queue"),
            Phase::Bidding(_) => {
                not_leased += 1;
                assert!(!m.queue.contains(id), "{at}: bidding {id} in queue");
                let live = m
                    .asks
                    .iter()
                    .filter(|(_, x)| *x == id)
                    .any(|(l, _)| armed_any(&|t| *t == Timer::Ask(*l)));
                assert!(live, "{at}: job {id} bids with no ask that can time out");
            }
            Phase::QuotaWait { .. } => {
                assert!(m.quota.is_waiting(*id), "{at}: {id} waits for no quota");
                assert!(!m.queue.contains(id));
            }
            Phase::Leased(l) => assert!(m.leases.contains_key(l), "{at}: {id} on gone {l}"),
            Phase::Fenced { until } => {
                assert!(!m.queue.contains(id), "{at}: fenced {id} in queue");
                assert!(
                    armed(*until, Timer::RetryFence(*id)),
                    "{at}: fenced {id} has no fence timer"
                );
            }
        }
        if matches!(j.phase, Phase::Queued | Phase::QuotaWait { .. }) {
            not_leased += 1;
        }
    }
    assert_eq!(m.pending(), not_leased, "{at}: pending() disagrees");
    for id in &m.queue {
        assert!(
            matches!(m.jobs.get(id).map(|j| &j.phase), Some(Phase::Queued)),
            "{at}: queue holds {id} which is not queued"
        );
    }
    for (id, _, _) in m.quota.holds() {
        let j = m.jobs.get(&id);
        assert!(
            j.is_some_and(|j| matches!(j.phase, Phase::Leased(_)) || j.quota_held.is_some()),
            "{at}: quota held for {id} by nobody"
        );
    }
    for (id, _, _) in m.quota.waiters() {
        assert!(
            matches!(
                m.jobs.get(&id).map(|j| &j.phase),
                Some(Phase::QuotaWait { .. })
            ),
            "{at}: quota waiter {id} does not wait"
        );
    }
    // Seats: asks in flight, strays and leases, per node and engine.
    let mut seats: BTreeMap<(NodeId, String), u32> = BTreeMap::new();
    for (lease, job) in &m.asks {
        let n = ask_node.get(lease).expect("every ask was seen on the wire");
        let engine = m.jobs[job].spec.engine.clone();
        *seats.entry((n.clone(), engine)).or_insert(0) += 1;
    }
    for (lease, (n, engine)) in &m.strays {
        assert!(
            armed_any(&|t| *t == Timer::Stray(*lease)),
            "{at}: stray {lease} never expires"
        );
        *seats.entry((n.clone(), engine.clone())).or_insert(0) += 1;
    }
    for l in m.leases.values() {
        let engine = m.jobs[&l.job].spec.engine.clone();
        *seats.entry((l.node.clone(), engine)).or_insert(0) += 1;
    }
    let mut held: BTreeMap<(NodeId, String), u32> = BTreeMap::new();
    for (n, s) in &m.sessions {
        for (engine, k) in &s.held {
            held.insert((n.clone(), engine.clone()), *k);
        }
        for (lease, due) in &s.pending_cancels {
            assert!(
                armed(*due, Timer::CancelAck(n.clone(), *lease)),
                "{at}: cancel of {lease} on {n} has no ack deadline"
            );
        }
        match s.conn {
            None => {
                let g = s
                    .grace
                    .unwrap_or_else(|| panic!("{at}: {n} away with no grace"));
                assert!(
                    armed(g, Timer::Grace(n.clone())),
                    "{at}: grace of {n} not armed"
                );
            }
            Some(_) => assert!(
                armed_any(&|t| *t == Timer::Silence(n.clone())),
                "{at}: {n} connected with no silence check"
            ),
        }
        if let Some(g) = s.grace {
            assert!(
                armed(g, Timer::Grace(n.clone())),
                "{at}: grace of {n} not armed"
            );
        }
    }
    assert_eq!(
        held, seats,
        "{at}: held seats differ from asks + strays + leases"
    );
}

/// The durable store says what memory says (M16, M23, M29): a restart from it now would
/// bring back exactly these jobs, leases and holds.
fn check_store(m: &Mill, store: &MillSnapshot, at: &str) {
    let jobs: Vec<JobId> = m.jobs.keys().copied().collect();
    let stored: Vec<JobId> = store.jobs.keys().copied().collect();
    assert_eq!(jobs, stored, "{at}: stored jobs differ");
    for (id, record) in &store.jobs {
        assert_eq!(
            Some(&record.state),
            m.job_state(*id).as_ref(),
            "{at}: state of {id}"
        );
    }
    let leases: Vec<_> = m
        .leases()
        .map(|(l, j, n, e, st, r)| (l, j, n.clone(), e, st, r.clone()))
        .collect();
    let stored: Vec<_> = store
        .leases
        .values()
        .map(|r| {
            (
                r.lease,
                r.job,
                r.node.clone(),
                r.epoch,
                r.state,
                r.resources.clone(),
            )
        })
        .collect();
    assert_eq!(leases, stored, "{at}: stored leases differ");
    let holds: Vec<JobId> = m
        .quota
        .holds()
        .map(|(j, _, _)| j)
        .filter(|j| matches!(m.jobs.get(j).map(|j| &j.phase), Some(Phase::Leased(_))))
        .collect();
    let stored: Vec<JobId> = store.quota_holds.keys().copied().collect();
    assert_eq!(holds, stored, "{at}: stored quota holds differ");
    assert_eq!(&m.quarantined, &store.quarantined, "{at}: quarantine list");
    let keys: Vec<_> = m.idempotency_keys().map(|(k, r)| (k.clone(), *r)).collect();
    let stored: Vec<_> = store.keys.iter().map(|(k, r)| (k.clone(), *r)).collect();
    assert_eq!(keys, stored, "{at}: M31: stored idempotency keys differ");
    for n in &m.quarantined {
        assert!(
            !m.node_leases.contains_key(n),
            "{at}: I8: quarantined {n} holds leases"
        );
        assert!(
            !m.sessions.contains_key(n),
            "{at}: I8: quarantined {n} has a session"
        );
    }
}

fn chaos_run(seed: u64, steps: u32) -> Chaos {
    let mut c = Chaos::new(seed);
    for step in 0..steps {
        c.step();
        let at = format!("seed {seed:#x} step {step}");
        check_invariants(&c.h.mill, &c.ask_node, &at);
        check_store(&c.h.mill, &c.h.store, &at);
    }
    // Quiescence: every connection closes and every timeout runs out.
    let open: Vec<ConnId> = c.owner.keys().copied().collect();
    for conn in open {
        c.h.input(MillInput::Disconnected { conn }).unwrap();
        c.pump();
    }
    c.owner.clear();
    for _ in 0..4 {
        c.h.advance(1_000 * SEC);
        c.pump();
        check_invariants(&c.h.mill, &c.ask_node, &format!("seed {seed:#x} quiescing"));
    }
    c
}

#[test]
fn i9_random_hostile_executors_never_panic_the_mill_and_everything_drains() {
    // REVIEW_SEEDS=n REVIEW_STEPS=m widen the search; the default is what CI runs.
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (seeds, steps) = (env("REVIEW_SEEDS", 6), env("REVIEW_STEPS", 3_000) as u32);
    for seed in 1..=seeds {
        let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let c = chaos_run(seed, steps);
        if std::env::var("REVIEW_DEBUG").is_ok() {
            eprintln!("seed {seed:#x}: {} jobs, {:?}", c.submitted.len(), c.seen);
        }
        let m = &c.h.mill;
        let at = format!("seed {seed:#x} at quiescence");
        assert_eq!(m.leases().count(), 0, "{at}: leases left");
        assert_eq!(m.pending(), 0, "{at}: jobs left pending");
        assert!(m.jobs.is_empty(), "{at}: jobs left");
        assert_eq!(m.quota().holds().count(), 0, "{at}: quota holds left");
        assert_eq!(m.quota().waiting(), 0, "{at}: quota waiters left");
        assert!(m.asks.is_empty() && m.strays.is_empty(), "{at}: asks left");
        assert_eq!(m.sessions().count(), 0, "{at}: sessions left");
        assert_eq!(m.next_deadline(), None, "{at}: timers left");
        // The durable store agrees.
        assert!(c.h.store.jobs.is_empty(), "{at}: stored jobs left");
        assert!(c.h.store.leases.is_empty(), "{at}: stored leases left");
        assert!(c.h.store.quota_holds.is_empty(), "{at}: stored holds left");
        // I2: every accepted job ended exactly once.
        for job in &c.submitted {
            assert_eq!(c.terminals.get(job), Some(&1), "{at}: terminals of {job}");
        }
    }
}
