//! Executor sessions: hello (M1, M2), readiness (M3), disconnect and grace (M4–M6), snapshots
//! and reconcile (M7, M8), silence (M9), violations and quarantine (M28).

use std::collections::{BTreeMap, BTreeSet};

use super::{
    constant_time_eq, reason, CancelPhase, Conn, Mill, MillOutput, MillWrite, Observation,
    RarePath, RequestError, Timer, ViolationKind,
};
use crate::job::{Terminal, TerminalCause, TerminalStatus};
use crate::types::{ConnId, Epoch, LeaseId, NodeId, Seqno, Term, Time};
use crate::wire::{self, EngineStatus, ToExecutor, ToMill};

/// Idle epochs of a node whose cursors are kept, beyond its live ones (see
/// `Mill::forget_old_epochs`): one, so that a node id shared in turn by two processes on
/// their own stores (M2) finds both cursors, while repeated store wipes leave at most one
/// dead cursor behind.
pub(super) const RETIRED_EPOCHS_KEPT: usize = 1;

/// What the mill knows of one executor. Lives from its first Hello until grace expires
/// without recovery (M5); survives disconnects during grace.
#[derive(Debug)]
pub(super) struct Session {
    pub(super) epoch: Epoch,
    /// The live connection, if any.
    pub(super) conn: Option<ConnId>,
    pub(super) labels: BTreeSet<String>,
    pub(super) engines: BTreeSet<String>,
    pub(super) last_heard: Time,
    /// The latest snapshot: seqno and per-engine status.
    pub(super) snapshot: Option<(u64, BTreeMap<String, EngineStatus>)>,
    /// The first snapshot of this connection was reconciled (M8).
    pub(super) reconciled: bool,
    /// The first snapshot of this connection, waiting for the events it announced: the
    /// leases it reported and its `outbox_high`. Reconcile runs once the cursor reaches
    /// that mark (M8, DESIGN §3), so a result in flight is never judged lost.
    pub(super) awaiting_events: Option<(BTreeSet<LeaseId>, Seqno)>,
    /// Grace deadline while recovering (M4–M6), or while leases of an older epoch wait.
    pub(super) grace: Option<Time>,
    /// When the current recovery began (the disconnect, or the mill's restart): M6 may
    /// extend grace to at most twice `reconnect_grace` from here, so a node that trickles
    /// events without ever finishing recovery cannot keep its leases forever (I9).
    pub(super) recovery_since: Option<Time>,
    /// Cancels sent and not yet acked, with their ack deadlines (M8, M26, M27).
    pub(super) pending_cancels: BTreeMap<LeaseId, Time>,
    /// Seats the mill holds on this node per engine: asks in flight, strays and leases.
    pub(super) held: BTreeMap<String, u32>,
    /// This connection applied an event for a lease the node held: it did real work (M28:
    /// only such a session, ended without a violation, clears the node's strikes).
    pub(super) did_work: bool,
    /// This connection was closed for a violation (M28).
    pub(super) violated: bool,
    /// The session's epoch is the node's own word (its Hello), not a restored lease's
    /// (a placeholder, M29): only then are the node's other epochs known to be old.
    pub(super) greeted: bool,
    /// M34: the mill's `free_seq` when this node last may have freed resources (a seat or
    /// lease released, a snapshot applied); a job it refused for a resource waits for this
    /// to move.
    pub(super) frees: u64,
    /// M35: this session refused a direct ask for its charge (it charges more than the
    /// standard charge, M14): it is only bid for from then on.
    pub(super) refuses_direct: bool,
    /// M36: the `frees` mark when this session refused a staged ask (draining, outbox full,
    /// its wait list full): nothing more is staged there until it frees something.
    pub(super) stage_refused: Option<u64>,
}

impl Session {
    fn new(epoch: Epoch, now: Time) -> Self {
        Session {
            epoch,
            conn: None,
            labels: BTreeSet::new(),
            engines: BTreeSet::new(),
            last_heard: now,
            snapshot: None,
            reconciled: false,
            awaiting_events: None,
            grace: None,
            recovery_since: None,
            pending_cancels: BTreeMap::new(),
            held: BTreeMap::new(),
            did_work: false,
            violated: false,
            greeted: false,
            frees: 0,
            refuses_direct: false,
            stage_refused: None,
        }
    }

    /// Takes new work (M3, M11, M27): connected, reconciled, no pending cancel, snapshotted.
    pub(super) fn ready(&self) -> bool {
        self.conn.is_some()
            && self.reconciled
            && self.pending_cancels.is_empty()
            && self.snapshot.is_some()
    }
}

impl Mill {
    /// A session for `node` that waits for it to come back (restart, M29).
    pub(super) fn placeholder_session(&mut self, node: &NodeId, epoch: Epoch) {
        if self.sessions.contains_key(node) {
            return;
        }
        let mut s = Session::new(epoch, self.now);
        let grace = self.now.plus(self.config.reconnect_grace);
        s.grace = Some(grace);
        s.recovery_since = Some(self.now);
        self.sessions.insert(node.clone(), s);
        self.arm(grace, Timer::Grace(node.clone()));
    }

    pub(super) fn on_connected(&mut self, conn: ConnId) {
        let unbound = self.conns.values().filter(|c| c.node.is_none()).count();
        if unbound >= self.config.max_sessions {
            self.emit(MillOutput::Close {
                conn,
                reason: "too many connections awaiting Hello".into(),
            });
            return;
        }
        self.conns.insert(conn, Conn { node: None });
        let at = self.now.plus(self.config.silence_timeout);
        self.arm(at, Timer::Handshake(conn));
    }

    pub(super) fn handshake_expired(&mut self, conn: ConnId) {
        if matches!(self.conns.get(&conn), Some(Conn { node: None })) {
            self.drop_conn(conn);
            self.emit(MillOutput::Close {
                conn,
                reason: "no Hello within silence_timeout".into(),
            });
        }
    }

    pub(super) fn on_disconnected(&mut self, conn: ConnId) {
        let Some(c) = self.drop_conn(conn) else {
            return;
        };
        if let Some(node) = c.node {
            if self.sessions.get(&node).and_then(|s| s.conn) == Some(conn) {
                self.detach(&node);
            }
        }
    }

    pub(super) fn on_message(&mut self, conn: ConnId, msg: ToMill) {
        let Some(c) = self.conns.get(&conn) else {
            return; // already closed by us
        };
        let node = match (&c.node, msg) {
            (
                None,
                ToMill::Hello {
                    protocol_version,
                    node_id,
                    epoch,
                    token,
                    labels,
                    engines,
                    stop_grace_ms,
                    term,
                },
            ) => {
                self.hello(
                    conn,
                    protocol_version,
                    node_id,
                    epoch,
                    token,
                    labels,
                    engines,
                    std::time::Duration::from_millis(u64::from(stop_grace_ms)),
                    term,
                );
                return;
            }
            (None, _) => {
                self.drop_conn(conn);
                self.emit(MillOutput::Close {
                    conn,
                    reason: "the first message must be Hello".into(),
                });
                return;
            }
            (Some(node), msg) => (node.clone(), msg),
        };
        let (node, msg) = node;
        let Some(s) = self.sessions.get_mut(&node) else {
            return;
        };
        if s.conn != Some(conn) {
            return;
        }
        s.last_heard = self.now;
        match msg {
            ToMill::Hello { .. } => self.violation(
                &node,
                ViolationKind::SecondHello,
                "a second Hello on one session",
            ),
            ToMill::Snapshot {
                seqno,
                engines,
                active_leases,
                outbox_high,
            } => self.on_snapshot(&node, seqno, engines, active_leases, outbox_high),
            ToMill::ReserveResult {
                lease,
                accepted,
                reject,
                reason,
                resources,
            } => self.on_reserve_result(&node, lease, accepted, reject, reason, resources),
            ToMill::CommitResult { lease, committed } => {
                self.on_commit_result(&node, lease, committed)
            }
            ToMill::EventBatch { epoch, events } => self.on_event_batch(&node, epoch, events),
            ToMill::CancelAck { lease } => self.on_cancel_ack(&node, lease),
            ToMill::Stale { term } => self.on_stale(&node, conn, term),
            ToMill::LiveLog {
                lease,
                offset,
                bytes,
            } => {
                if let Some(l) = self.leases.get(&lease) {
                    if l.node == node {
                        let job = l.job;
                        self.emit(MillOutput::LiveLog {
                            job,
                            lease,
                            offset,
                            bytes,
                        });
                    }
                }
            }
        }
    }

    /// E13: the executor has seen a higher term than ours and acted on nothing we sent
    /// since; it closes the connection, and so do we. A hint that this mill may be
    /// deposed (its driver checks the store before stepping down: an executor's word alone
    /// must not stop a mill that still leads). The node enters grace as on any disconnect.
    fn on_stale(&mut self, node: &NodeId, conn: ConnId, seen: Term) {
        let ours = self.config.term;
        self.observe(Observation::Deposed {
            node: node.clone(),
            ours,
            seen,
        });
        self.drop_conn(conn);
        self.detach(node);
        self.emit(MillOutput::Close {
            conn,
            reason: format!(
                "node {node} has seen term {}, above this mill's {} (E13)",
                seen.get(),
                ours.get()
            ),
        });
    }

    fn refuse(&mut self, conn: ConnId, why: String) {
        self.drop_conn(conn);
        self.send(
            conn,
            ToExecutor::Refused {
                reason: why.clone(),
                leader: None,
            },
        );
        self.emit(MillOutput::Close {
            conn,
            reason: why.clone(),
        });
        self.observe(Observation::Refused { conn, reason: why });
    }

    /// M1, M2: validate the Hello, then open or replace the node's session.
    #[allow(clippy::too_many_arguments)]
    fn hello(
        &mut self,
        conn: ConnId,
        version: u32,
        node_id: String,
        epoch: Epoch,
        token: String,
        labels: Vec<String>,
        engines: Vec<String>,
        stop_grace: std::time::Duration,
        seen: Term,
    ) {
        if version != wire::PROTOCOL_VERSION {
            let why = format!(
                "unsupported protocol version {version}; this mill speaks {}",
                wire::PROTOCOL_VERSION
            );
            return self.refuse(conn, why);
        }
        let node = match NodeId::new(node_id) {
            Ok(n) => n,
            Err(e) => return self.refuse(conn, format!("invalid node id: {e}")),
        };
        if let Some(expected) = &self.config.executor_token {
            if !constant_time_eq(expected.as_bytes(), token.as_bytes()) {
                return self.refuse(conn, format!("node {node}: token not accepted"));
            }
        }
        // E13: only after the token, so that no stranger can make a mill doubt its term.
        if seen > self.config.term {
            self.observe(Observation::Deposed {
                node: node.clone(),
                ours: self.config.term,
                seen,
            });
            return self.refuse(
                conn,
                format!(
                    "node {node} has seen term {}, above this mill's term {} (E13): this mill no longer leads",
                    seen.get(),
                    self.config.term.get()
                ),
            );
        }
        if self.quarantined.contains(&node) {
            return self.refuse(
                conn,
                format!("node {node} is quarantined; an operator must lift it"),
            );
        }
        if labels.len() > wire::MAX_NODE_LABELS
            || engines.len() > wire::MAX_ENGINES
            || !labels
                .iter()
                .chain(&engines)
                .all(|n| crate::types::valid_name(n))
        {
            return self.refuse(
                conn,
                format!(
                    "node {node}: labels (at most {}) and engines (at most {}) must be 1-64 printable ASCII characters",
                    wire::MAX_NODE_LABELS,
                    wire::MAX_ENGINES
                ),
            );
        }
        if stop_grace > self.config.retry_fence {
            return self.refuse(
                conn,
                format!(
                    "node {node}: stop grace {stop_grace:?} exceeds the mill's retry fence {:?} (M32: a retry after a lost executor waits that long for its fenced run to stop); lower --stop-grace or raise the mill's --retry-fence",
                    self.config.retry_fence
                ),
            );
        }
        let grace = match self.sessions.get(&node) {
            Some(old) => {
                let live = old.conn.is_some()
                    && self.now.since(old.last_heard) < self.config.silence_timeout;
                if live {
                    return self.refuse(conn, format!("node {node} already has a live session"));
                }
                let carried = old.grace;
                let since = old.recovery_since.unwrap_or(self.now);
                if let Some(old_conn) = old.conn {
                    self.drop_conn(old_conn);
                    self.emit(MillOutput::Close {
                        conn: old_conn,
                        reason: "replaced by a new session".into(),
                    });
                    self.detach(&node);
                }
                Some((
                    carried.unwrap_or_else(|| self.now.plus(self.config.reconnect_grace)),
                    since,
                ))
            }
            None => {
                if self.sessions.len() >= self.config.max_sessions {
                    return self.refuse(
                        conn,
                        format!("mill is at max_sessions ({})", self.config.max_sessions),
                    );
                }
                None
            }
        };
        let held = self
            .sessions
            .remove(&node)
            .map(|s| s.held)
            .unwrap_or_default();
        let mut s = Session::new(epoch, self.now);
        s.conn = Some(conn);
        s.labels = labels.into_iter().collect();
        s.engines = engines.into_iter().collect();
        s.grace = grace.map(|(g, _)| g);
        s.recovery_since = grace.map(|(_, since)| since);
        s.held = held;
        s.greeted = true;
        self.sessions.insert(node.clone(), s);
        if let Some(c) = self.conns.get_mut(&conn) {
            c.node = Some(node.clone());
        }
        self.disarm(&Timer::Handshake(conn));
        match grace {
            Some((g, _)) => self.arm(g, Timer::Grace(node.clone())),
            None => self.disarm(&Timer::Grace(node.clone())),
        }
        let at = self.now.plus(self.config.silence_timeout);
        self.arm(at, Timer::Silence(node.clone()));
        self.forget_old_epochs(&node);
        let cursor = self.cursor(&node, epoch);
        let timers = self.config.session_timers();
        let term = self.config.term;
        self.send(
            conn,
            ToExecutor::Welcome {
                cursor,
                timers,
                term,
            },
        );
        self.reindex(&node);
    }

    /// M22, M23 and retention (issue 11 item 7): a node greeted on one epoch can apply no
    /// event of its other epochs while that lasts (a batch must carry the session's epoch,
    /// M19), so the streams of those that hold no lease are retired: their terminal memory
    /// goes at once, and their cursor joins the node's retired epochs. The cursors of all but
    /// the [`RETIRED_EPOCHS_KEPT`] most recently retired are forgotten, with a durable
    /// delete, so memory and store stay bounded by the node's live epochs plus that many.
    ///
    /// Why keep any: an epoch changes with a new store (E1), but two processes may share a
    /// node id in turn (a twin taking over a dead session, M2). The first one, back on its
    /// intact store, must find its cursor, or it refuses the Welcome (E6: a cursor behind
    /// what was acked) and never delivers its outbox (twin seed 7000631, I9).
    ///
    /// Called at each Hello and whenever a lease of an old epoch ends. The current epoch is
    /// never touched, nor anything while the session is a placeholder (restored from
    /// leases, M29): until its Hello the mill does not know which of the node's epochs is
    /// current.
    pub(super) fn forget_old_epochs(&mut self, node: &NodeId) {
        let Some(s) = self.sessions.get(node) else {
            return;
        };
        if !s.greeted {
            return;
        }
        let current = s.epoch;
        let leases = &self.leases;
        let holds = |e: Epoch| {
            self.node_leases.get(node).is_some_and(|set| {
                set.iter()
                    .any(|id| leases.get(id).is_some_and(|l| l.epoch == e))
            })
        };
        let idle_memory: Vec<Epoch> = self
            .terminals
            .range((node.clone(), Epoch(0))..)
            .take_while(|((n, _), _)| n == node)
            .map(|((_, e), _)| *e)
            .filter(|e| *e != current && !holds(*e))
            .collect();
        let idle_cursors: Vec<Epoch> = self
            .cursors
            .range((node.clone(), Epoch(0))..)
            .take_while(|((n, _), _)| n == node)
            .map(|((_, e), _)| *e)
            .filter(|e| *e != current && !holds(*e))
            .collect();
        for e in idle_memory {
            self.terminals.remove(&(node.clone(), e));
        }
        let retired = self.retired.entry(node.clone()).or_default();
        // Back on a retired epoch: it is live again.
        retired.retain(|e| *e != current);
        for e in idle_cursors {
            if !retired.contains(&e) {
                retired.push_back(e);
            }
        }
        let mut forget = Vec::new();
        while retired.len() > RETIRED_EPOCHS_KEPT {
            forget.extend(retired.pop_front());
        }
        if retired.is_empty() {
            self.retired.remove(node);
        }
        for e in forget {
            // M22, M23: a stream is forgotten whole; a terminal memory left behind would
            // judge a new stream's events against the old one's leases.
            debug_assert!(
                e != current && !self.terminals.contains_key(&(node.clone(), e)),
                "M23: the cursor of ({node}, {e}) is forgotten but its stream is live"
            );
            self.cursors.remove(&(node.clone(), e));
            self.persist(MillWrite::CursorDelete {
                node: node.clone(),
                epoch: e,
            });
        }
    }

    /// M4: the node's connection is gone. Its leases stay; grace starts if not running.
    pub(super) fn detach(&mut self, node: &NodeId) {
        let grace_len = self.config.reconnect_grace;
        let now = self.now;
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        let conn = s.conn.take();
        // M28: a run of strikes is broken only by a session that did real work and ended
        // without a violation. A clean close alone is not enough: a node that violates and
        // then closes an idle session cleanly would never reach quarantine.
        let worked_cleanly = conn.is_some() && s.did_work && !s.violated;
        s.did_work = false;
        s.violated = false;
        s.reconciled = false;
        s.awaiting_events = None;
        s.snapshot = None;
        let pending: Vec<LeaseId> = std::mem::take(&mut s.pending_cancels).into_keys().collect();
        if s.grace.is_none() {
            s.recovery_since = Some(now);
        }
        let grace = *s.grace.get_or_insert(now.plus(grace_len));
        if let Some(conn) = conn {
            self.drop_conn(conn);
        }
        if worked_cleanly {
            self.strikes.remove(node);
        }
        self.arm(grace, Timer::Grace(node.clone()));
        // Silence is watched only on a connection; acks are due only on one.
        self.disarm(&Timer::Silence(node.clone()));
        for lease in &pending {
            self.disarm(&Timer::CancelAck(node.clone(), *lease));
        }
        // Tracked cancels go out again when the node is ready; untracked ones are found again
        // by the next reconcile.
        for lease in pending {
            if let Some(c) = self.leases.get_mut(&lease).and_then(|l| l.cancel.as_mut()) {
                c.phase = CancelPhase::Waiting;
            }
        }
        // Commits wait for the node to come back (M17).
        if let Some(ids) = self.node_leases.get(node) {
            for id in ids {
                if let Some(l) = self.leases.get_mut(id) {
                    if l.commit_sent.take().is_some() {
                        self.timers.stop(&Timer::Commit(*id));
                    }
                }
            }
        }
        self.fail_asks_to(node);
        self.reindex(node);
        self.wake_placement();
    }

    /// Closes the session's connection for `why` and detaches it.
    fn close_session(&mut self, node: &NodeId, why: String) {
        if let Some(conn) = self.sessions.get(node).and_then(|s| s.conn) {
            self.emit(MillOutput::Close { conn, reason: why });
            self.detach(node);
        }
    }

    /// M9: a session silent for `silence_timeout` is closed.
    pub(super) fn silence_check(&mut self, node: NodeId) {
        let Some(s) = self.sessions.get(&node) else {
            return;
        };
        if s.conn.is_none() {
            return;
        }
        let due = s.last_heard.plus(self.config.silence_timeout);
        if due > self.now {
            self.arm(due, Timer::Silence(node));
            return;
        }
        let why = format!(
            "silent for {:?} (silence_timeout)",
            self.config.silence_timeout
        );
        self.close_session(&node, why);
    }

    /// M5, M6: grace ran out. Without completed recovery every lease of the node fails;
    /// with it, only leases of an older epoch (the node came back with a wiped store) fail.
    pub(super) fn grace_check(&mut self, node: NodeId, fired: Time) {
        let Some(s) = self.sessions.get(&node) else {
            return;
        };
        let Some(deadline) = s.grace else {
            return;
        };
        if deadline != fired {
            // Extended (M6) or replaced: a newer timer is armed.
            return;
        }
        let recovered = s.ready();
        if !recovered && s.conn.is_some() && s.awaiting_events.is_some() {
            // M5, M6, I3: back within grace, and its snapshot announced events still in
            // flight (`outbox_high`): a result may be among them, and judging now would record
            // "executor lost" for a job that finished. Wait for them as M6 waits while events
            // arrive: a `silence_timeout` at a time (a live session delivers within it, M9), and
            // never past twice `reconnect_grace` from the start of the recovery (I9).
            let cap = s
                .recovery_since
                .unwrap_or(fired)
                .plus(self.config.reconnect_grace * 2);
            let due = self.now.plus(self.config.silence_timeout).min(cap);
            if due > self.now {
                if let Some(s) = self.sessions.get_mut(&node) {
                    s.grace = Some(due);
                }
                self.arm(due, Timer::Grace(node));
                return;
            }
        }
        if !recovered && s.conn.is_some() && s.reconciled {
            // Back and reconciled, only its cancel acks are due: wait for them (M6: never
            // shorten), but no longer. A missed ack closes the session (M26) and this
            // deadline, then reached, fails the node's leases.
            let acks_due = s.pending_cancels.values().max().copied();
            if let Some(due) = acks_due.filter(|due| *due > fired) {
                if let Some(s) = self.sessions.get_mut(&node) {
                    s.grace = Some(due);
                }
                self.arm(due, Timer::Grace(node));
                return;
            }
        }
        let epoch = s.epoch;
        let leases: Vec<LeaseId> = self
            .node_leases
            .get(&node)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        if recovered {
            for id in leases {
                let Some(l) = self.leases.get(&id) else {
                    continue;
                };
                if l.epoch == epoch {
                    continue;
                }
                let (state, commit_out) = (l.state, l.commit_out);
                self.observe(Observation::Rare(RarePath::OldEpochLeaseFailed));
                // A reserved lease whose commit went out (M16; every restored lease counts,
                // M29) may have run on the old process, even to its end, with the result
                // lost in the wipe: placing it again would run it twice (I1). Only a lease
                // never committed is placed again.
                if state == super::LeaseState::Running || commit_out {
                    self.fail_lease(
                        id,
                        TerminalCause::ExecutorReplaced,
                        "executor lost (its store was replaced)".into(),
                    );
                } else {
                    self.end_lease(id, None);
                }
            }
            if let Some(s) = self.sessions.get_mut(&node) {
                s.grace = None;
                s.recovery_since = None;
            }
            return;
        }
        for id in leases {
            self.fail_lease(id, TerminalCause::ExecutorLost, "executor lost".into());
        }
        if let Some(conn) = self.sessions.get(&node).and_then(|s| s.conn) {
            self.drop_conn(conn);
            self.emit(MillOutput::Close {
                conn,
                reason: "recovery did not complete within reconnect_grace".into(),
            });
        }
        self.fail_asks_to(&node);
        self.forget_session(&node);
        self.rank.remove(&node);
        self.wake_placement();
    }

    /// Drops a node's session and every timer it owned (silence, grace, cancel acks).
    fn forget_session(&mut self, node: &NodeId) {
        let Some(s) = self.sessions.remove(node) else {
            return;
        };
        if let Some(conn) = s.conn {
            self.drop_conn(conn);
        }
        self.disarm(&Timer::Silence(node.clone()));
        self.disarm(&Timer::Grace(node.clone()));
        for lease in s.pending_cancels.keys() {
            self.disarm(&Timer::CancelAck(node.clone(), *lease));
        }
        // Its leases are gone, so no event of it can be applied any more (M21).
        let epochs: Vec<Epoch> = self
            .terminals
            .range((node.clone(), Epoch(0))..)
            .take_while(|((n, _), _)| n == node)
            .map(|((_, e), _)| *e)
            .collect();
        for e in epochs {
            self.terminals.remove(&(node.clone(), e));
        }
    }

    /// Ends a lease whose executor can no longer be trusted to finish it: failed with `why`,
    /// or with its pending cancel's status and reason (M5).
    pub(super) fn fail_lease(&mut self, id: LeaseId, cause: TerminalCause, why: String) {
        let Some(l) = self.leases.get(&id) else {
            return;
        };
        let cancelled = l.cancel.is_some();
        let mut t = match &l.cancel {
            Some(c) => Terminal::by_mill(c.status, c.cause, c.reason.clone()),
            None => Terminal::by_mill(TerminalStatus::Failed, cause, why),
        };
        t.node = Some(l.node.clone());
        t.lease = Some(id);
        if cancelled {
            self.observe(Observation::Rare(RarePath::GraceExpiredWithPendingCancel));
        }
        self.end_lease(id, Some(t));
    }

    /// M6: events applied while recovering push the grace deadline out, never in, and never
    /// past twice `reconnect_grace` from the start of the recovery (I9: a bound on how long a
    /// node that never completes recovery keeps its leases).
    pub(super) fn extend_grace(&mut self, node: &NodeId) {
        let grace_len = self.config.reconnect_grace;
        let now = self.now;
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        if s.ready() {
            return;
        }
        let cap = s.recovery_since.unwrap_or(now).plus(grace_len * 2);
        let extended = now.plus(grace_len).min(cap);
        if let Some(g) = s.grace.as_mut() {
            if extended > *g {
                *g = extended;
                self.arm(extended, Timer::Grace(node.clone()));
            }
        }
    }

    /// M7, M8, M10 wake-up: a snapshot updates capacity; the first one of a connection
    /// reconciles the node's leases, once every event it announced has been applied.
    fn on_snapshot(
        &mut self,
        node: &NodeId,
        seqno: u64,
        engines: BTreeMap<String, EngineStatus>,
        active: Vec<crate::types::LeaseId>,
        outbox_high: Seqno,
    ) {
        if engines.len() > wire::MAX_ENGINES || active.len() > wire::MAX_ACTIVE_LEASES {
            return self.violation(
                node,
                ViolationKind::Oversize,
                "snapshot exceeds the engine or lease bound",
            );
        }
        for (name, e) in &engines {
            let bad_load = e.load.len() > wire::MAX_LOAD_ENTRIES
                || e.load
                    .iter()
                    .any(|(k, v)| !crate::types::valid_name(k) || !(0.0..=1.0).contains(v));
            if !crate::types::valid_name(name) || bad_load {
                let why = format!("snapshot engine {name:?}: loads must be 0..=1 with valid names");
                return self.violation(node, ViolationKind::BadSnapshot, &why);
            }
        }
        if !self.fenced_runs.is_empty() {
            self.fenced_runs_alive(node, &active);
        }
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        if let Some((last, _)) = &s.snapshot {
            if seqno <= *last {
                let why = format!("snapshot seqno {seqno} does not exceed {last} (M7)");
                return self.violation(node, ViolationKind::SnapshotRegression, &why);
            }
        }
        s.snapshot = Some((seqno, engines));
        self.free_seq += 1;
        s.frees = self.free_seq;
        if !s.reconciled && s.awaiting_events.is_none() {
            let epoch = s.epoch;
            // A mark at or below the cursor (an honest executor never sends one below: it
            // refuses a Welcome whose cursor passes its last event) leaves nothing in flight.
            if outbox_high > self.cursor(node, epoch) {
                if let Some(s) = self.sessions.get_mut(node) {
                    s.awaiting_events = Some((active.into_iter().collect(), outbox_high));
                }
                // M6, I3: the node is back within grace and its announced events are in
                // flight on this connection: grace must not run out before they land
                // (still capped at twice reconnect_grace from the start of the recovery).
                self.extend_grace(node);
                self.observe(Observation::Rare(RarePath::ReconcileAwaitedEvents));
            } else {
                self.reconcile(node, active.into_iter().collect());
            }
        }
        self.reindex(node);
        self.wake_placement();
    }

    /// M8: the events a reconciling snapshot announced have all been applied: judge now.
    pub(super) fn reconcile_if_caught_up(&mut self, node: &NodeId) {
        let Some(s) = self.sessions.get(node) else {
            return;
        };
        let Some((_, high)) = &s.awaiting_events else {
            return;
        };
        if self.cursor(node, s.epoch) < *high {
            return;
        }
        let reported = self
            .sessions
            .get_mut(node)
            .and_then(|s| s.awaiting_events.take());
        if let Some((reported, _)) = reported {
            self.reconcile(node, reported);
        }
    }

    /// M8: settle the node's leases of this epoch against what it reports.
    fn reconcile(&mut self, node: &NodeId, reported: BTreeSet<LeaseId>) {
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        s.reconciled = true;
        let epoch = s.epoch;
        let ours: Vec<LeaseId> = self
            .node_leases
            .get(node)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        for id in &ours {
            let Some(l) = self.leases.get(id) else {
                continue;
            };
            if l.epoch != epoch || reported.contains(id) {
                continue;
            }
            match l.state {
                super::LeaseState::Running => {
                    self.observe(Observation::Rare(RarePath::ReconcileFailedLease));
                    self.fail_lease(
                        *id,
                        TerminalCause::NoLongerHasJob,
                        "executor no longer has the job".into(),
                    );
                }
                // Never committed there: nothing ran, place it again.
                super::LeaseState::Reserved => self.end_lease(*id, None),
            }
        }
        for id in reported {
            let known = self
                .leases
                .get(&id)
                .is_some_and(|l| &l.node == node && l.epoch == epoch);
            if !known {
                self.observe(Observation::Rare(RarePath::UntrackedCancel));
                self.send_cancel(
                    node,
                    id,
                    "the mill holds no such lease for this node".into(),
                );
            }
        }
        // Cancels that waited for the node (M26).
        let waiting: Vec<(LeaseId, String)> = ours
            .iter()
            .filter_map(|id| {
                let c = self.leases.get(id)?.cancel.as_ref()?;
                (c.phase == CancelPhase::Waiting).then(|| (*id, c.reason.clone()))
            })
            .collect();
        for (id, why) in waiting {
            if let Some(c) = self.leases.get_mut(&id).and_then(|l| l.cancel.as_mut()) {
                c.phase = CancelPhase::Sent;
            }
            self.send_cancel(node, id, why);
        }
        self.maybe_ready(node);
    }

    /// Sends a `CancelAttempt` and starts its ack deadline (M8, M26).
    pub(super) fn send_cancel(&mut self, node: &NodeId, lease: LeaseId, why: String) {
        let deadline = self.now.plus(self.config.cancel_ack_timeout);
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        let Some(conn) = s.conn else {
            return;
        };
        s.pending_cancels.insert(lease, deadline);
        self.arm(deadline, Timer::CancelAck(node.clone(), lease));
        self.send(
            conn,
            ToExecutor::CancelAttempt {
                term: self.config.term,
                lease,
                reason: reason(why),
            },
        );
        self.reindex(node);
    }

    /// M3, M17: once reconciled with no pending cancel, the node is recovered: grace ends
    /// (unless leases of an older epoch still wait for it), held commits go out, and
    /// placement may use it.
    pub(super) fn maybe_ready(&mut self, node: &NodeId) {
        let Some(s) = self.sessions.get(node) else {
            return;
        };
        if !(s.conn.is_some() && s.reconciled && s.pending_cancels.is_empty()) {
            return;
        }
        let epoch = s.epoch;
        let ids: Vec<LeaseId> = self
            .node_leases
            .get(node)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        let old_epoch_waits = ids
            .iter()
            .any(|id| self.leases.get(id).is_some_and(|l| l.epoch != epoch));
        if !old_epoch_waits {
            if let Some(s) = self.sessions.get_mut(node) {
                s.grace = None;
                s.recovery_since = None;
            }
            self.disarm(&Timer::Grace(node.clone()));
        }
        for id in ids {
            let resend = self.leases.get(&id).is_some_and(|l| {
                l.state == super::LeaseState::Reserved
                    && l.commit_sent.is_none()
                    && l.epoch == epoch
            });
            if resend {
                self.send_commit(id);
            }
        }
        self.reindex(node);
        self.wake_placement();
    }

    pub(super) fn on_cancel_ack(&mut self, node: &NodeId, lease: LeaseId) {
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        if s.pending_cancels.remove(&lease).is_none() {
            return; // a repeat, or for a cancel we no longer wait on
        }
        self.disarm(&Timer::CancelAck(node.clone(), lease));
        let teardown = self.now.plus(self.config.cancel_teardown_timeout);
        if let Some(c) = self.leases.get_mut(&lease).and_then(|l| l.cancel.as_mut()) {
            if c.phase == CancelPhase::Sent {
                c.phase = CancelPhase::Acked { teardown };
                self.arm(teardown, Timer::Teardown(lease));
            }
        }
        self.maybe_ready(node);
    }

    /// M8, M26: a cancel not acked in time closes the session.
    pub(super) fn cancel_ack_expired(&mut self, node: NodeId, lease: LeaseId, fired: Time) {
        let due = self
            .sessions
            .get(&node)
            .and_then(|s| s.pending_cancels.get(&lease))
            .copied();
        if due == Some(fired) {
            let why = format!(
                "cancel of lease {lease} not acked within {:?}",
                self.config.cancel_ack_timeout
            );
            self.close_session(&node, why);
        }
    }

    /// M28: close the session; `quarantine_strikes` in a row quarantine the node.
    pub(super) fn violation(&mut self, node: &NodeId, kind: ViolationKind, what: &str) {
        let why = reason(format!("protocol violation: {what}"));
        self.observe(Observation::Violation {
            node: node.clone(),
            kind,
            reason: why.clone(),
        });
        if let Some(s) = self.sessions.get_mut(node) {
            s.violated = true;
        }
        let strikes = self.strikes.entry(node.clone()).or_insert(0);
        *strikes += 1;
        let quarantine = *strikes >= self.config.quarantine_strikes;
        self.close_session(node, why);
        if quarantine {
            self.quarantine(node);
        }
    }

    fn quarantine(&mut self, node: &NodeId) {
        self.quarantined.insert(node.clone());
        self.persist(MillWrite::Quarantine {
            node: node.clone(),
            quarantined: true,
        });
        self.observe(Observation::Quarantined { node: node.clone() });
        let leases: Vec<LeaseId> = self
            .node_leases
            .get(node)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        for id in leases {
            self.fail_lease(
                id,
                TerminalCause::Quarantined,
                format!("executor {node} quarantined"),
            );
        }
        self.fail_asks_to(node);
        self.forget_session(node);
        self.rank.remove(node);
        self.wake_placement();
    }

    pub(super) fn lift(&mut self, node: NodeId) -> Result<(), RequestError> {
        if !self.quarantined.remove(&node) {
            return Err(RequestError::NotQuarantined { node });
        }
        self.strikes.remove(&node);
        self.persist(MillWrite::Quarantine {
            node,
            quarantined: false,
        });
        Ok(())
    }
}
