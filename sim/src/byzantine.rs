//! Misbehaving executors: a filter between an honest [`Executor`](millrace_core::executor)
//! and the network that mutates or adds outgoing messages, one kind of violation per node.
//!
//! Each session (from a Welcome), the filter violates once, at the first message that gives
//! it the chance; if none does within a few seconds it injects a violation of its own. The
//! mill closes the session for each (M28), so a violator is quarantined after
//! `quarantine_strikes` sessions in a row. The `ForeignLease` kind also rewrites its events
//! to name other nodes' leases, which the mill must skip (M21) without touching their jobs.

use std::collections::BTreeMap;

use millrace_core::job::{LogRef, TerminalStatus};
use millrace_core::wire::{EndCause, Event, EventKind, ToExecutor, ToMill};
use millrace_core::{ConnId, Epoch, LeaseId, Resources, Seqno};

use crate::rng::Rng;
use crate::scenario::{Micros, SEC};

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
}

impl ByzKind {
    /// Every kind.
    pub const ALL: [ByzKind; 7] = [
        ByzKind::Gap,
        ByzKind::Regression,
        ByzKind::WrongEpoch,
        ByzKind::ForeignLease,
        ByzKind::BadResources,
        ByzKind::BadLogRef,
        ByzKind::AfterTerminal,
    ];

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
        }
    }
}

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
            committed: 0,
        }
    }

    /// The kind.
    pub fn kind(&self) -> ByzKind {
        self.kind
    }

    /// Sees a message from the mill before the executor does: a Welcome starts a session.
    pub fn incoming(&mut self, now: Micros, conn: ConnId, msg: &ToExecutor, rng: &mut Rng) {
        if let ToExecutor::Welcome { .. } = msg {
            self.conn = Some(conn);
            self.snapshots = 0;
            self.fallback_at = now + rng.range(2 * SEC, 9 * SEC);
        }
    }

    /// Filters one outgoing message; returns what goes on the wire instead, in order.
    pub fn outgoing(
        &mut self,
        now: Micros,
        conn: ConnId,
        msg: ToMill,
        ctx: &ByzCtx,
        rng: &mut Rng,
    ) -> Vec<ToMill> {
        let in_session = self.conn == Some(conn);
        if let ToMill::Hello { epoch, .. } = &msg {
            self.epoch = Some(*epoch);
        }
        if let ToMill::EventBatch { epoch, events } = &msg {
            if let Some(last) = events.last() {
                let e = self.last_seqno.entry(*epoch).or_default();
                *e = (*e).max(last.seqno);
            }
        }
        if !in_session {
            return vec![self.rewrite_foreign(msg, ctx)];
        }
        // Every chance in the session is taken: the mill may not count one (an answer to an
        // ask that is already over is ignored, M12), so one is not enough.
        let mut out = match self.try_violate(msg, ctx, rng) {
            Ok(v) => {
                self.committed += 1;
                v
            }
            Err(m) => vec![self.rewrite_foreign(m, ctx)],
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
    ) -> Result<Vec<ToMill>, ToMill> {
        match (self.kind, msg) {
            (ByzKind::Gap, ToMill::EventBatch { epoch, mut events }) if !events.is_empty() => {
                for e in &mut events {
                    e.seqno = e.seqno.next();
                }
                Ok(vec![ToMill::EventBatch { epoch, events }])
            }
            (
                ByzKind::Regression,
                ToMill::Snapshot {
                    seqno,
                    engines,
                    active_leases,
                    outbox_high,
                },
            ) => {
                self.snapshots += 1;
                let msg = ToMill::Snapshot {
                    seqno: if self.snapshots > 1 { 1 } else { seqno },
                    engines,
                    active_leases,
                    outbox_high,
                };
                if self.snapshots > 1 {
                    Ok(vec![msg])
                } else {
                    Err(msg)
                }
            }
            (ByzKind::Regression, ToMill::EventBatch { epoch, mut events })
                if !events.is_empty() && rng.chance(0.5) =>
            {
                let first = events[0].clone();
                events.insert(0, first);
                Ok(vec![ToMill::EventBatch { epoch, events }])
            }
            (ByzKind::WrongEpoch, ToMill::EventBatch { epoch, events }) => {
                Ok(vec![ToMill::EventBatch {
                    epoch: Epoch(epoch.get() ^ 0x5eed),
                    events,
                }])
            }
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
                let resources = if rng.chance(0.5) {
                    Resources::from([("cpu_millis".to_string(), 0)])
                } else {
                    Resources::from([(String::new(), 1)])
                };
                Ok(vec![ToMill::ReserveResult {
                    lease,
                    accepted: true,
                    reject,
                    reason,
                    resources,
                }])
            }
            (ByzKind::BadLogRef, ToMill::EventBatch { epoch, mut events }) => {
                let mut hit = false;
                for e in &mut events {
                    if let EventKind::Terminal { log, .. } = &mut e.kind {
                        *log = Some(bad_log(e.lease));
                        hit = true;
                    }
                }
                let msg = ToMill::EventBatch { epoch, events };
                if hit {
                    Ok(vec![msg])
                } else {
                    Err(msg)
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
                        Ok(vec![msg, after])
                    }
                    _ => Err(msg),
                }
            }
            (ByzKind::ForeignLease, msg) => match (ctx.foreign_ask, &msg) {
                (Some(lease), ToMill::Snapshot { .. }) => Ok(vec![
                    msg,
                    ToMill::ReserveResult {
                        lease,
                        accepted: true,
                        reject: None,
                        reason: String::new(),
                        resources: Resources::from([("jobs".to_string(), 1)]),
                    },
                ]),
                _ => Err(msg),
            },
            (_, msg) => Err(msg),
        }
    }

    /// A violation made from nothing, when the session gave no chance for this node's own.
    fn fallback(&mut self, ctx: &ByzCtx) -> Option<ToMill> {
        let epoch = self.epoch?;
        let last = self.last_seqno.get(&epoch).copied().unwrap_or_default();
        Some(match self.kind {
            ByzKind::Gap => ToMill::EventBatch {
                epoch,
                events: vec![Event {
                    seqno: Seqno(last.get() + 2),
                    lease: ctx.foreign_lease.unwrap_or(LeaseId(u64::MAX / 2)),
                    kind: EventKind::Running,
                }],
            },
            ByzKind::BadLogRef => {
                let lease = ctx.foreign_lease.unwrap_or(LeaseId(u64::MAX / 2));
                ToMill::EventBatch {
                    epoch,
                    events: vec![Event {
                        seqno: last.next(),
                        lease,
                        kind: EventKind::Terminal {
                            status: TerminalStatus::Success,
                            exit_code: Some(0),
                            error: None,
                            log: Some(bad_log(lease)),
                            cause: EndCause::Engine,
                        },
                    }],
                }
            }
            ByzKind::Regression
            | ByzKind::WrongEpoch
            | ByzKind::ForeignLease
            | ByzKind::BadResources
            | ByzKind::AfterTerminal => ToMill::EventBatch {
                epoch: Epoch(epoch.get() ^ 0x5eed),
                events: Vec::new(),
            },
        })
    }
}
