//! Misbehaving executors: a filter between an honest [`Executor`](millrace_core::executor)
//! and the network that mutates or adds outgoing messages, one kind of violation per node.
//!
//! Each session (from a Welcome), the filter violates once, at the first message that gives
//! it the chance; if none does within a few seconds it injects a violation of its own. The
//! mill closes the session for each (M28), so a violator is quarantined after
//! `quarantine_strikes` sessions in a row. The `ForeignLease` kind also rewrites its events
//! to name other nodes' leases, which the mill must skip (M21) without touching their jobs.
//!
//! Every message the filter puts on the wire carries an [`Expect`] tag, kept here in send
//! order per connection: what the mill must do with it on receipt (checkers' I8 accounting:
//! a violating message received must close its session with the matching [`ViolationKind`],
//! M28). Two kinds break no rule the mill can see and must never be charged: `Replay` repeats
//! the event at its cursor (M20: dropped, still acked) and `DropLease` loses a running lease
//! while keeping its epoch (M8 must fail it "executor no longer has the job").

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use millrace_core::job::{LogRef, TerminalStatus};
use millrace_core::mill::ViolationKind;
use millrace_core::wire::{EndCause, Event, EventKind, ToExecutor, ToMill};
use millrace_core::{ConnId, Epoch, LeaseId, Resources, Seqno};

use crate::rng::Rng;
use crate::types::{Micros, SEC};

/// Which violation a misbehaving executor commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByzKind {
    /// Event seqnos skip one (M20).
    Gap,
    /// Snapshot seqnos go back, or event seqnos repeat within a batch (M7, M20).
    Regression,
    /// Event batches name another epoch (M19).
    WrongEpoch,
    /// Events name other nodes' leases (skipped, M21), and it answers asks made of others.
    ForeignLease,
    /// Accepted seats claim invalid resources (M14).
    BadResources,
    /// Terminals carry a log reference outside `logs/<lease>.log` (M25).
    BadLogRef,
    /// An event follows a lease's terminal (M22).
    AfterTerminal,
    /// A snapshot repeats the previous snapshot's seqno (M7: equal is a regression too).
    SnapshotRepeat,
    /// Replays the event at its cursor (its last acked event) after a reconnect and in front
    /// of batches (M20: dropped, still acked). Legal: never charged, never quarantined.
    Replay,
    /// Now and then loses a running lease the mill has seen running: kills its engine, drops
    /// it from its store (keeping its epoch) and restarts, so its next snapshot leaves it out
    /// (M8: the mill must fail it "executor no longer has the job"). Breaks no wire rule:
    /// never charged, never quarantined; not honest for I3 (its results may vanish).
    DropLease,
}

impl ByzKind {
    /// The kinds the swarm's `byzantine` family draws from (the fixed seeds' fleets).
    pub const ALL: [ByzKind; 7] = [
        ByzKind::Gap,
        ByzKind::Regression,
        ByzKind::WrongEpoch,
        ByzKind::ForeignLease,
        ByzKind::BadResources,
        ByzKind::BadLogRef,
        ByzKind::AfterTerminal,
    ];

    /// Every kind a scenario file may name.
    pub const NAMED: [ByzKind; 10] = [
        ByzKind::Gap,
        ByzKind::Regression,
        ByzKind::WrongEpoch,
        ByzKind::ForeignLease,
        ByzKind::BadResources,
        ByzKind::BadLogRef,
        ByzKind::AfterTerminal,
        ByzKind::SnapshotRepeat,
        ByzKind::Replay,
        ByzKind::DropLease,
    ];

    /// True for a kind that commits protocol violations (and must end quarantined, M28).
    pub fn violates(self) -> bool {
        !matches!(self, ByzKind::Replay | ByzKind::DropLease)
    }

    /// True for a kind whose messages are all legal and whose store is never doctored: the
    /// checkers treat it as honest.
    pub fn legal(self) -> bool {
        matches!(self, ByzKind::Replay)
    }

    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            ByzKind::Gap => "seqno-gap",
            ByzKind::Regression => "seqno-regression",
            ByzKind::WrongEpoch => "wrong-epoch",
            ByzKind::ForeignLease => "foreign-lease",
            ByzKind::BadResources => "bad-resources",
            ByzKind::BadLogRef => "bad-log-ref",
            ByzKind::AfterTerminal => "event-after-terminal",
            ByzKind::SnapshotRepeat => "snapshot-repeat",
            ByzKind::Replay => "replay-at-cursor",
            ByzKind::DropLease => "drop-lease",
        }
    }
}

/// What the mill must do with one message the filter sent, once it receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Close the session for a violation of this kind, whatever the mill's state.
    Always(ViolationKind),
    /// An event batch: a violation if its seqnos pass M20 against the mill's cursor up to the
    /// first new event among `bad`, which is bad in the way `kind` says (M22, M25); a gap or
    /// disorder found first is a violation of that kind instead.
    Batch {
        /// What is wrong with the events in `bad`.
        kind: ViolationKind,
        /// Seqnos of the events made bad.
        bad: Vec<Seqno>,
    },
    /// A `ReserveResult`: a violation of `kind` if the mill still has the ask open.
    Answer {
        /// The violation.
        kind: ViolationKind,
        /// The ask answered.
        lease: LeaseId,
    },
    /// A replay of the event at the cursor: the mill must drop it (M20, nothing applied).
    Replay(Seqno),
}

impl Expect {
    /// The rule a violation of `kind` breaks.
    pub fn rule(kind: ViolationKind) -> &'static str {
        match kind {
            ViolationKind::SecondHello => "M1",
            ViolationKind::Oversize => "M28",
            ViolationKind::BadSnapshot | ViolationKind::SnapshotRegression => "M7",
            ViolationKind::WrongEpoch => "M19",
            ViolationKind::SeqnoOrder | ViolationKind::SeqnoGap => "M20",
            ViolationKind::EventAfterTerminal => "M22",
            ViolationKind::BadLogRef => "M25",
            ViolationKind::UnaskedReserveResult => "M12",
            ViolationKind::BadResources => "M14",
        }
    }
}

/// Tags kept per connection at most (older connections' tags are dropped: a reset
/// connection delivers nothing more).
const TAGGED_CONNS: usize = 8;
/// Events remembered for replays.
const REMEMBERED_EVENTS: usize = 256;

/// What the filter may know of the world: leases asked of or held by other nodes.
#[derive(Debug, Default)]
pub struct ByzCtx {
    /// A recent `ReserveSeat` lease sent to another node, if any.
    pub foreign_ask: Option<LeaseId>,
    /// A lease running on another node, if any.
    pub foreign_lease: Option<LeaseId>,
}

/// The filter's state for one misbehaving node.
#[derive(Debug)]
pub struct Byzantine {
    kind: ByzKind,
    conn: Option<ConnId>,
    fallback_at: Micros,
    snapshots: u32,
    /// The epoch of the last Hello.
    epoch: Option<Epoch>,
    /// Highest event seqno sent, per epoch.
    last_seqno: BTreeMap<Epoch, Seqno>,
    /// The last terminal sent: (epoch, lease).
    last_terminal: Option<(Epoch, LeaseId)>,
    /// The seqno of the last snapshot sent in this session.
    last_snapshot: Option<u64>,
    /// Tags of the messages sent, per connection, in send order (popped on delivery).
    tags: BTreeMap<ConnId, VecDeque<Option<Expect>>>,
    /// Events sent, by (epoch, seqno), for replays (bounded).
    sent_events: BTreeMap<(Epoch, Seqno), Event>,
    /// The cursor the mill last told it, per epoch (Welcome, Ack).
    acked: BTreeMap<Epoch, Seqno>,
    /// A replay of the Welcome's cursor is owed at the session's first snapshot.
    replay_owed: bool,
    /// Running events sent and not yet acked: (epoch, seqno, lease).
    running_sent: Vec<(Epoch, Seqno, LeaseId)>,
    /// Leases the mill has applied a Running event of (acked) and no terminal was sent for.
    confirmed: BTreeSet<(Epoch, LeaseId)>,
    /// A drop was asked for and waits for the crash that makes it.
    drop_pending: bool,
    /// No drop before this time.
    next_drop: Micros,
    /// Violations committed.
    pub committed: u32,
}

fn bad_log(lease: LeaseId) -> LogRef {
    LogRef {
        path: format!("logs/../{}.log", lease.get()),
        hash: format!("sha256:{}", "0".repeat(64)),
    }
}

impl Byzantine {
    /// A filter committing `kind`.
    pub fn new(kind: ByzKind) -> Self {
        Byzantine {
            kind,
            conn: None,
            fallback_at: Micros::MAX,
            snapshots: 0,
            epoch: None,
            last_seqno: BTreeMap::new(),
            last_terminal: None,
            last_snapshot: None,
            tags: BTreeMap::new(),
            sent_events: BTreeMap::new(),
            acked: BTreeMap::new(),
            replay_owed: false,
            running_sent: Vec::new(),
            confirmed: BTreeSet::new(),
            drop_pending: false,
            next_drop: 20 * SEC,
            committed: 0,
        }
    }

    /// The tag of the next message delivered on `conn` (call once per delivered message).
    pub fn delivered(&mut self, conn: ConnId) -> Option<Expect> {
        self.tags
            .get_mut(&conn)
            .and_then(|q| q.pop_front())
            .flatten()
    }

    /// Whether a lease drop waits for a crash (`DropLease`); the driver arms one.
    pub fn wants_drop(&self) -> bool {
        self.drop_pending
    }

    /// At the crash: the lease to drop from `jobs` (the store's committed jobs), one the mill
    /// has seen running and whose terminal is not in `outbox`. Clears the request.
    pub fn take_drop(
        &mut self,
        epoch: Epoch,
        jobs: &BTreeMap<LeaseId, millrace_core::executor::StoredJob>,
        outbox: &VecDeque<Event>,
    ) -> Option<LeaseId> {
        if !std::mem::take(&mut self.drop_pending) {
            return None;
        }
        let lease = self
            .confirmed
            .iter()
            .filter(|(e, l)| {
                *e == epoch
                    && jobs.contains_key(l)
                    && !outbox
                        .iter()
                        .any(|ev| ev.lease == *l && matches!(ev.kind, EventKind::Terminal { .. }))
            })
            .map(|(_, l)| *l)
            .next()?;
        self.confirmed.remove(&(epoch, lease));
        Some(lease)
    }

    /// The kind.
    pub fn kind(&self) -> ByzKind {
        self.kind
    }

    /// Sees a message from the mill before the executor does: a Welcome starts a session.
    pub fn incoming(&mut self, now: Micros, conn: ConnId, msg: &ToExecutor, rng: &mut Rng) {
        match msg {
            ToExecutor::Welcome { cursor, .. } => {
                self.conn = Some(conn);
                self.snapshots = 0;
                self.last_snapshot = None;
                self.fallback_at = now + rng.range(2 * SEC, 9 * SEC);
                if let Some(epoch) = self.epoch {
                    self.acked.insert(epoch, *cursor);
                    self.replay_owed = self.kind == ByzKind::Replay;
                    self.confirm(epoch, *cursor);
                }
                // Older connections deliver nothing more that matters once a session is new.
                while self.tags.len() > TAGGED_CONNS {
                    self.tags.pop_first();
                }
            }
            ToExecutor::Ack {
                term: _,
                epoch,
                up_to,
            } => {
                let a = self.acked.entry(*epoch).or_default();
                *a = (*a).max(*up_to);
                self.confirm(*epoch, *up_to);
            }
            _ => {}
        }
    }

    /// Running events of `epoch` up to `up_to` were applied: their leases are running at
    /// the mill (a `DropLease` candidate).
    fn confirm(&mut self, epoch: Epoch, up_to: Seqno) {
        if self.kind != ByzKind::DropLease {
            return;
        }
        let confirmed = &mut self.confirmed;
        self.running_sent.retain(|(e, s, l)| {
            if *e == epoch && *s <= up_to {
                confirmed.insert((epoch, *l));
                false
            } else {
                true
            }
        });
    }

    /// Remembers what an honest batch says (replays, drop candidates).
    fn note_batch(&mut self, epoch: Epoch, events: &[Event]) {
        match self.kind {
            ByzKind::Replay => {
                for e in events {
                    self.sent_events.insert((epoch, e.seqno), e.clone());
                }
                while self.sent_events.len() > REMEMBERED_EVENTS {
                    self.sent_events.pop_first();
                }
            }
            ByzKind::DropLease => {
                for e in events {
                    match e.kind {
                        EventKind::Running => {
                            if self.running_sent.len() < REMEMBERED_EVENTS {
                                self.running_sent.push((epoch, e.seqno, e.lease));
                            }
                        }
                        EventKind::Terminal { .. } => {
                            self.confirmed.remove(&(epoch, e.lease));
                            self.running_sent.retain(|(_, _, l)| *l != e.lease);
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// The event at the cursor of `epoch`, if it was sent and remembered.
    fn at_cursor(&self, epoch: Epoch) -> Option<Event> {
        let c = self.acked.get(&epoch).copied()?;
        if c == Seqno(0) {
            return None;
        }
        self.sent_events.get(&(epoch, c)).cloned()
    }

    /// Filters one outgoing message; returns what goes on the wire instead, in order. Each
    /// is tagged with what the mill must do with it (see [`Byzantine::delivered`]).
    pub fn outgoing(
        &mut self,
        now: Micros,
        conn: ConnId,
        msg: ToMill,
        ctx: &ByzCtx,
        rng: &mut Rng,
    ) -> Vec<ToMill> {
        let out = self.filter(now, conn, msg, ctx, rng);
        let q = self.tags.entry(conn).or_default();
        let mut msgs = Vec::with_capacity(out.len());
        for (m, tag) in out {
            q.push_back(tag);
            msgs.push(m);
        }
        msgs
    }

    fn filter(
        &mut self,
        now: Micros,
        conn: ConnId,
        msg: ToMill,
        ctx: &ByzCtx,
        rng: &mut Rng,
    ) -> Vec<(ToMill, Option<Expect>)> {
        let in_session = self.conn == Some(conn);
        if let ToMill::Hello { epoch, .. } = &msg {
            self.epoch = Some(*epoch);
        }
        if let ToMill::EventBatch { epoch, events } = &msg {
            if let Some(last) = events.last() {
                let e = self.last_seqno.entry(*epoch).or_default();
                *e = (*e).max(last.seqno);
            }
            let (epoch, events) = (*epoch, events.clone());
            self.note_batch(epoch, &events);
        }
        if !in_session {
            return vec![(self.rewrite_foreign(msg, ctx), None)];
        }
        match self.kind {
            ByzKind::Replay => return self.replay(msg, rng),
            ByzKind::DropLease => {
                if now >= self.next_drop
                    && !self.drop_pending
                    && !self.confirmed.is_empty()
                    && rng.chance(0.2)
                {
                    self.drop_pending = true;
                    self.next_drop = now + rng.range(30 * SEC, 90 * SEC);
                }
                return vec![(msg, None)];
            }
            _ => {}
        }
        // Every chance in the session is taken: the mill may not count one (an answer to an
        // ask that is already over is ignored, M12), so one is not enough.
        let mut out = match self.try_violate(msg, ctx, rng) {
            Ok(v) => {
                self.committed += 1;
                v
            }
            Err(m) => vec![(self.rewrite_foreign(m, ctx), None)],
        };
        if now >= self.fallback_at {
            if let Some(injected) = self.fallback(ctx) {
                self.committed += 1;
                self.fallback_at = now + rng.range(3 * SEC, 9 * SEC);
                out.push(injected);
            }
        }
        out
    }

    /// The replaying kind: the event at its cursor goes again, alone after the session's
    /// first snapshot (the Welcome's cursor) and in front of half its batches.
    fn replay(&mut self, msg: ToMill, rng: &mut Rng) -> Vec<(ToMill, Option<Expect>)> {
        match msg {
            ToMill::Snapshot { .. } if std::mem::take(&mut self.replay_owed) => {
                let again = self.epoch.and_then(|epoch| {
                    let e = self.at_cursor(epoch)?;
                    let seqno = e.seqno;
                    let batch = ToMill::EventBatch {
                        epoch,
                        events: vec![e],
                    };
                    Some((batch, Some(Expect::Replay(seqno))))
                });
                let mut out = vec![(msg, None)];
                out.extend(again);
                out
            }
            ToMill::EventBatch { epoch, mut events } if rng.chance(0.5) => {
                let front = self
                    .at_cursor(epoch)
                    .filter(|e| events.first().is_some_and(|f| e.seqno < f.seqno));
                let tag = front.as_ref().map(|e| Expect::Replay(e.seqno));
                if let Some(e) = front {
                    events.insert(0, e);
                }
                vec![(ToMill::EventBatch { epoch, events }, tag)]
            }
            msg => vec![(msg, None)],
        }
    }

    /// The foreign-lease kind names other nodes' leases in its Running events (M21: the mill
    /// skips them, advancing the cursor).
    fn rewrite_foreign(&self, msg: ToMill, ctx: &ByzCtx) -> ToMill {
        match (self.kind, msg, ctx.foreign_lease) {
            (ByzKind::ForeignLease, ToMill::EventBatch { epoch, events }, Some(foreign)) => {
                let events = events
                    .into_iter()
                    .map(|mut e| {
                        if e.kind == EventKind::Running {
                            e.lease = foreign;
                        }
                        e
                    })
                    .collect();
                ToMill::EventBatch { epoch, events }
            }
            (_, msg, _) => msg,
        }
    }

    /// Commits this node's violation on `msg` if it allows; gives `msg` back otherwise.
    fn try_violate(
        &mut self,
        msg: ToMill,
        ctx: &ByzCtx,
        rng: &mut Rng,
    ) -> Result<Vec<(ToMill, Option<Expect>)>, ToMill> {
        match (self.kind, msg) {
            (ByzKind::Gap, ToMill::EventBatch { epoch, mut events }) if !events.is_empty() => {
                for e in &mut events {
                    e.seqno = e.seqno.next();
                }
                // A gap only if the batch's first event is new to the mill: the checker
                // judges against the mill's cursor (M20).
                let tag = Expect::Batch {
                    kind: ViolationKind::SeqnoGap,
                    bad: Vec::new(),
                };
                Ok(vec![(ToMill::EventBatch { epoch, events }, Some(tag))])
            }
            (
                kind @ (ByzKind::Regression | ByzKind::SnapshotRepeat),
                ToMill::Snapshot {
                    seqno,
                    engines,
                    active_leases,
                    outbox_high,
                },
            ) => {
                self.snapshots += 1;
                let previous = self.last_snapshot;
                let sent = match (kind, previous) {
                    (_, None) => seqno,
                    (ByzKind::Regression, Some(_)) => 1,
                    (_, Some(p)) => p,
                };
                self.last_snapshot = Some(sent);
                let msg = ToMill::Snapshot {
                    seqno: sent,
                    engines,
                    active_leases,
                    outbox_high,
                };
                if previous.is_some() {
                    Ok(vec![(
                        msg,
                        Some(Expect::Always(ViolationKind::SnapshotRegression)),
                    )])
                } else {
                    Err(msg)
                }
            }
            (ByzKind::Regression, ToMill::EventBatch { epoch, mut events })
                if !events.is_empty() && rng.chance(0.5) =>
            {
                let first = events[0].clone();
                events.insert(0, first);
                Ok(vec![(
                    ToMill::EventBatch { epoch, events },
                    Some(Expect::Always(ViolationKind::SeqnoOrder)),
                )])
            }
            (ByzKind::WrongEpoch, ToMill::EventBatch { epoch, events }) => Ok(vec![(
                ToMill::EventBatch {
                    epoch: Epoch(epoch.get() ^ 0x5eed),
                    events,
                },
                Some(Expect::Always(ViolationKind::WrongEpoch)),
            )]),
            (
                ByzKind::BadResources,
                ToMill::ReserveResult {
                    lease,
                    accepted: true,
                    reject,
                    reason,
                    ..
                },
            ) => {
                // Each breaks `validate_resources` (M14) one way: a zero amount, a bad name,
                // an amount over the bound.
                let resources = match rng.index(3) {
                    0 => Resources::from([("cpu_millis".to_string(), 0)]),
                    1 => Resources::from([(String::new(), 1)]),
                    _ => Resources::from([("jobs".to_string(), u64::MAX)]),
                };
                let tag = Expect::Answer {
                    kind: ViolationKind::BadResources,
                    lease,
                };
                Ok(vec![(
                    ToMill::ReserveResult {
                        lease,
                        accepted: true,
                        reject,
                        reason,
                        resources,
                    },
                    Some(tag),
                )])
            }
            (ByzKind::BadLogRef, ToMill::EventBatch { epoch, mut events }) => {
                let mut bad = Vec::new();
                for e in &mut events {
                    if let EventKind::Terminal { log, .. } = &mut e.kind {
                        *log = Some(bad_log(e.lease));
                        bad.push(e.seqno);
                    }
                }
                let msg = ToMill::EventBatch { epoch, events };
                if bad.is_empty() {
                    Err(msg)
                } else {
                    let kind = ViolationKind::BadLogRef;
                    Ok(vec![(msg, Some(Expect::Batch { kind, bad }))])
                }
            }
            (ByzKind::AfterTerminal, ToMill::EventBatch { epoch, events }) => {
                let terminal = events
                    .iter()
                    .rev()
                    .find(|e| matches!(e.kind, EventKind::Terminal { .. }))
                    .map(|e| e.lease);
                let last = events.last().map(|e| e.seqno);
                let msg = ToMill::EventBatch { epoch, events };
                match (terminal, last) {
                    (Some(lease), Some(last)) => {
                        self.last_terminal = Some((epoch, lease));
                        let after = ToMill::EventBatch {
                            epoch,
                            events: vec![Event {
                                seqno: last.next(),
                                lease,
                                kind: EventKind::Running,
                            }],
                        };
                        let tag = Expect::Batch {
                            kind: ViolationKind::EventAfterTerminal,
                            bad: vec![last.next()],
                        };
                        Ok(vec![(msg, None), (after, Some(tag))])
                    }
                    _ => Err(msg),
                }
            }
            (ByzKind::ForeignLease, msg) => match (ctx.foreign_ask, &msg) {
                (Some(lease), ToMill::Snapshot { .. }) => Ok(vec![
                    (msg, None),
                    (
                        ToMill::ReserveResult {
                            lease,
                            accepted: true,
                            reject: None,
                            reason: String::new(),
                            resources: Resources::from([("jobs".to_string(), 1)]),
                        },
                        Some(Expect::Answer {
                            kind: ViolationKind::UnaskedReserveResult,
                            lease,
                        }),
                    ),
                ]),
                _ => Err(msg),
            },
            (_, msg) => Err(msg),
        }
    }

    /// A violation made from nothing, when the session gave no chance for this node's own.
    fn fallback(&mut self, ctx: &ByzCtx) -> Option<(ToMill, Option<Expect>)> {
        let epoch = self.epoch?;
        let last = self.last_seqno.get(&epoch).copied().unwrap_or_default();
        Some(match self.kind {
            ByzKind::Gap => (
                ToMill::EventBatch {
                    epoch,
                    events: vec![Event {
                        seqno: Seqno(last.get() + 2),
                        lease: ctx.foreign_lease.unwrap_or(LeaseId(u64::MAX / 2)),
                        kind: EventKind::Running,
                    }],
                },
                Some(Expect::Batch {
                    kind: ViolationKind::SeqnoGap,
                    bad: Vec::new(),
                }),
            ),
            ByzKind::BadLogRef => {
                let lease = ctx.foreign_lease.unwrap_or(LeaseId(u64::MAX / 2));
                let seqno = last.next();
                (
                    ToMill::EventBatch {
                        epoch,
                        events: vec![Event {
                            seqno,
                            lease,
                            kind: EventKind::Terminal {
                                status: TerminalStatus::Success,
                                exit_code: Some(0),
                                error: None,
                                log: Some(bad_log(lease)),
                                cause: EndCause::Engine,
                            },
                        }],
                    },
                    Some(Expect::Batch {
                        kind: ViolationKind::BadLogRef,
                        bad: vec![seqno],
                    }),
                )
            }
            ByzKind::Regression
            | ByzKind::WrongEpoch
            | ByzKind::ForeignLease
            | ByzKind::BadResources
            | ByzKind::AfterTerminal
            | ByzKind::SnapshotRepeat => (
                ToMill::EventBatch {
                    epoch: Epoch(epoch.get() ^ 0x5eed),
                    events: Vec::new(),
                },
                Some(Expect::Always(ViolationKind::WrongEpoch)),
            ),
            ByzKind::Replay | ByzKind::DropLease => return None,
        })
    }
}
