//! The connection to the mill: dial with backoff (E11), Hello → Welcome → Snapshot → resend
//! (E6), acks (E5), snapshots (E10), and closing a connection on which the mill is silent.
//!
//! The wire has no mill → executor heartbeat, yet silence and self-fencing (E12) need to hear
//! the mill. When the mill has said nothing for a `snapshot_interval`, the periodic snapshot is
//! followed by an empty `EventBatch`: every event in it is (vacuously) a replay, which the mill
//! acks (M20), so a live mill answers within one round trip.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::types::{bounded_reason, ConnId, Epoch, LeaseId, Seqno, Term, Time};
use crate::wire::{
    SessionTimers, ToExecutor, ToMill, MAX_ACTIVE_LEASES, MAX_REASON, PROTOCOL_VERSION,
};

use super::seats::engine_statuses;
use super::{Executor, ExecutorOutput, ExecutorWrite};

/// Where the connection to the mill stands.
#[derive(Debug, Clone)]
pub(super) enum Link {
    /// No connection; dial at `retry_at`.
    Down {
        /// When to emit `Connect`.
        retry_at: Time,
    },
    /// `Connect` was emitted at `since`; waiting for `Connected`/`ConnectFailed`.
    Connecting {
        /// When it was emitted.
        since: Time,
    },
    /// Hello sent on `conn` at `since`; waiting for Welcome.
    Hello {
        /// The connection.
        conn: ConnId,
        /// When Hello was sent.
        since: Time,
    },
    /// Welcomed: a session.
    Ready(Session),
}

/// A welcomed session.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub(super) conn: ConnId,
    /// Highest seqno the mill has or was sent on this session (the cursor, then resends).
    pub(super) sent_up_to: Seqno,
    /// When the periodic snapshot is due.
    next_snapshot: Time,
    /// Per-engine availability in the last snapshot sent.
    last_availability: BTreeMap<String, bool>,
}

/// A name for a mill message in reasons, without its payload.
struct MsgName<'a>(&'a ToExecutor);

impl fmt::Display for MsgName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            ToExecutor::Welcome { .. } => "Welcome",
            ToExecutor::Refused { .. } => "Refused",
            ToExecutor::ReserveSeat { .. } => "ReserveSeat",
            ToExecutor::CommitLease { .. } => "CommitLease",
            ToExecutor::ReleaseLease { .. } => "ReleaseLease",
            ToExecutor::CancelAttempt { .. } => "CancelAttempt",
            ToExecutor::Ack { .. } => "Ack",
        })
    }
}

impl Executor {
    pub(super) fn send(&mut self, conn: ConnId, msg: ToMill) {
        self.emit(ExecutorOutput::Send { conn, msg });
    }

    /// The current session's connection, if welcomed.
    pub(super) fn ready_conn(&self) -> Option<ConnId> {
        match &self.link {
            Link::Ready(s) => Some(s.conn),
            Link::Down { .. } | Link::Connecting { .. } | Link::Hello { .. } => None,
        }
    }

    /// Closes `conn` (if given) and waits a backoff delay before dialing again (E11). A link
    /// that never got its `Welcome` moves on to the next mill address (DESIGN §10); a
    /// session that was up dials the same mill first.
    fn drop_link(&mut self, now: Time, close: Option<(ConnId, String)>) {
        if !matches!(self.link, Link::Ready(_)) {
            self.mill = (self.mill + 1) % self.config.mills.len().max(1);
        }
        self.close_link(now, close);
    }

    fn close_link(&mut self, now: Time, close: Option<(ConnId, String)>) {
        if let Some((conn, reason)) = close {
            let reason = bounded_reason(reason, MAX_REASON);
            self.emit(ExecutorOutput::Close { conn, reason });
        }
        let delay = self.backoff.next_delay();
        self.link = Link::Down {
            retry_at: now.plus(delay),
        };
    }

    /// A mill refused the `Hello`. A standby names the leader (DESIGN §10): if that is one of
    /// the configured addresses it is dialed next, at once the first time since the last
    /// `Welcome`; otherwise the next address is, after the backoff.
    fn refused(&mut self, now: Time, conn: ConnId, reason: String, leader: Option<String>) {
        let reason = format!("refused by the mill: {reason}");
        let hinted = leader.and_then(|l| self.config.mills.iter().position(|m| *m == l));
        match hinted {
            Some(i) if i != self.mill => {
                self.mill = i;
                self.close_link(now, Some((conn, reason)));
                if !self.redirected {
                    self.redirected = true;
                    self.link = Link::Down { retry_at: now };
                }
            }
            Some(_) | None => self.drop_link(now, Some((conn, reason))),
        }
    }

    /// E13: `term` is below the highest this executor has seen: nothing of the message is
    /// acted on; the mill is told (`Stale`) and the connection closed. A session that was
    /// up dials the next address, for this mill no longer leads.
    fn stale(&mut self, now: Time, conn: ConnId, what: &ToExecutor, term: Term) {
        let seen = self.durable.term;
        debug_assert!(term < seen, "only a lower term is stale");
        self.send(conn, ToMill::Stale { term: seen });
        self.mill = (self.mill + 1) % self.config.mills.len().max(1);
        let reason = format!(
            "stale term: the mill sent {} under term {}, below {} seen before (E13)",
            MsgName(what),
            term.get(),
            seen.get()
        );
        self.close_link(now, Some((conn, reason)));
    }

    pub(super) fn link_deadline(&self) -> Option<Time> {
        let silence = self.timers().silence_timeout;
        Some(match &self.link {
            Link::Down { retry_at } => *retry_at,
            Link::Connecting { since } | Link::Hello { since, .. } => since.plus(silence),
            Link::Ready(s) => s.next_snapshot.min(self.last_heard.plus(silence)),
        })
    }

    pub(super) fn run_link_timers(&mut self, now: Time) {
        let silence = self.timers().silence_timeout;
        let interval = self.timers().snapshot_interval;
        enum Due {
            Dial,
            GiveUp(Option<(ConnId, String)>),
            Periodic(ConnId),
        }
        let due = match &self.link {
            Link::Down { retry_at } if now >= *retry_at => Due::Dial,
            // The driver never answered; a late `Connected` is closed as unexpected.
            Link::Connecting { since } if now >= since.plus(silence) => Due::GiveUp(None),
            Link::Hello { conn, since } if now >= since.plus(silence) => {
                Due::GiveUp(Some((*conn, format!("no Welcome within {silence:?}"))))
            }
            Link::Ready(s) if now >= self.last_heard.plus(silence) => {
                Due::GiveUp(Some((s.conn, format!("mill silent for {silence:?}"))))
            }
            Link::Ready(s) if now >= s.next_snapshot => Due::Periodic(s.conn),
            Link::Down { .. } | Link::Connecting { .. } | Link::Hello { .. } | Link::Ready(_) => {
                return
            }
        };
        match due {
            Due::Dial => {
                self.link = Link::Connecting { since: now };
                let mill = self.mill;
                self.emit(ExecutorOutput::Connect { mill });
            }
            Due::GiveUp(close) => self.drop_link(now, close),
            Due::Periodic(conn) => {
                self.send_snapshot();
                self.rearm_snapshot(now);
                if now >= self.last_heard.plus(interval) {
                    let epoch = self.durable.epoch;
                    let events = Vec::new();
                    self.send(conn, ToMill::EventBatch { epoch, events });
                }
            }
        }
    }

    pub(super) fn on_connected(&mut self, now: Time, conn: ConnId) {
        if !matches!(self.link, Link::Connecting { .. }) {
            let reason = "unexpected connection: no connect attempt is pending".to_string();
            self.emit(ExecutorOutput::Close { conn, reason });
            return;
        }
        let hello = ToMill::Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: self.config.node_id.as_str().to_string(),
            epoch: self.durable.epoch,
            token: self.config.token.clone(),
            labels: self.config.labels.iter().cloned().collect(),
            engines: self.config.engines.keys().cloned().collect(),
            stop_grace_ms: u32::try_from(self.config.stop_grace.as_millis()).unwrap_or(u32::MAX),
            term: self.durable.term,
        };
        self.send(conn, hello);
        self.link = Link::Hello { conn, since: now };
    }

    pub(super) fn on_connect_failed(&mut self, now: Time) {
        if matches!(self.link, Link::Connecting { .. }) {
            self.drop_link(now, None);
        }
    }

    pub(super) fn on_disconnected(&mut self, now: Time, conn: ConnId) {
        let current = match &self.link {
            Link::Hello { conn: c, .. } => *c == conn,
            Link::Ready(s) => s.conn == conn,
            Link::Down { .. } | Link::Connecting { .. } => false,
        };
        if current {
            self.drop_link(now, None);
        }
    }

    pub(super) fn on_message(&mut self, now: Time, conn: ConnId, msg: ToExecutor) {
        let (welcoming, ready) = match &self.link {
            Link::Hello { conn: c, .. } => (*c == conn, false),
            Link::Ready(s) => (false, s.conn == conn),
            Link::Down { .. } | Link::Connecting { .. } => (false, false),
        };
        if welcoming {
            self.on_message_before_welcome(now, conn, msg);
        } else if ready {
            // A stale term is no word from the mill that leads (E12 counts only those, E13).
            if msg.term().is_none_or(|t| t >= self.durable.term) {
                self.last_heard = now;
            }
            self.on_session_message(now, conn, msg);
        }
        // Otherwise it came on a connection we already gave up: nothing to act on.
    }

    fn on_message_before_welcome(&mut self, now: Time, conn: ConnId, msg: ToExecutor) {
        if let Some(term) = msg.term().filter(|t| *t < self.durable.term) {
            return self.stale(now, conn, &msg, term);
        }
        match msg {
            ToExecutor::Welcome {
                cursor,
                timers,
                term,
            } => self.on_welcome(now, conn, cursor, timers, term),
            ToExecutor::Refused { reason, leader } => self.refused(now, conn, reason, leader),
            other @ (ToExecutor::ReserveSeat { .. }
            | ToExecutor::CommitLease { .. }
            | ToExecutor::ReleaseLease { .. }
            | ToExecutor::CancelAttempt { .. }
            | ToExecutor::Ack { .. }) => {
                let reason = format!("protocol: mill sent {} before Welcome", MsgName(&other));
                self.drop_link(now, Some((conn, reason)));
            }
        }
    }

    /// E13: every command carries the session's term, which its `Welcome` made the highest
    /// seen. A lower one is stale and acted on not at all; a higher one cannot come from the
    /// mill that welcomed us, so the session is closed as confused (only a `Welcome` raises
    /// the term).
    fn on_session_message(&mut self, now: Time, conn: ConnId, msg: ToExecutor) {
        match msg.term() {
            Some(term) if term < self.durable.term => return self.stale(now, conn, &msg, term),
            Some(term) if term > self.durable.term => {
                let reason = format!(
                    "protocol: {} under term {}, but the session's Welcome had {} (E13)",
                    MsgName(&msg),
                    term.get(),
                    self.durable.term.get()
                );
                return self.drop_link(now, Some((conn, reason)));
            }
            Some(_) | None => {}
        }
        match msg {
            ToExecutor::Welcome { .. } => {
                let reason = "protocol: second Welcome in one session".to_string();
                self.drop_link(now, Some((conn, reason)));
            }
            ToExecutor::Refused { reason, leader: _ } => {
                let reason = format!("refused by the mill: {reason}");
                self.drop_link(now, Some((conn, reason)));
            }
            ToExecutor::ReserveSeat {
                term: _,
                lease,
                job,
                spec,
                ttl,
                direct,
            } => self.on_reserve(now, conn, lease, job, *spec, ttl, direct),
            ToExecutor::CommitLease {
                term: _,
                lease,
                secrets,
            } => self.on_commit(conn, lease, secrets),
            ToExecutor::ReleaseLease { term: _, lease } => self.on_release(conn, lease),
            ToExecutor::CancelAttempt {
                term: _,
                lease,
                reason,
            } => self.on_cancel(conn, lease, reason),
            ToExecutor::Ack {
                term: _,
                epoch,
                up_to,
            } => self.on_ack(now, conn, epoch, up_to),
        }
    }

    /// E6: the cursor says what the mill has. Events at or below it are dropped; a cursor
    /// that does not fit the outbox means the two sides disagree about this epoch, and
    /// going on would lose events, so the connection is closed with the reason.
    fn on_welcome(
        &mut self,
        now: Time,
        conn: ConnId,
        cursor: Seqno,
        timers: SessionTimers,
        term: Term,
    ) {
        if let Some(problem) = self.unusable(&timers) {
            return self.drop_link(now, Some((conn, problem)));
        }
        let last = self.durable.last_seqno();
        let acked = self.durable.acked_up_to();
        if cursor > last {
            let reason = format!(
                "protocol: mill cursor {cursor} is beyond the last event {last} of epoch {}",
                self.durable.epoch
            );
            return self.drop_link(now, Some((conn, reason)));
        }
        if cursor < acked {
            let reason = format!(
                "protocol: mill cursor {cursor} is behind {acked}, which it acked before (epoch {})",
                self.durable.epoch
            );
            return self.drop_link(now, Some((conn, reason)));
        }
        self.last_heard = now;
        self.backoff.reset();
        self.redirected = false;
        let mut writes = Vec::new();
        // E13: the new term is durable before anything this mill says is acted on (every
        // output below follows this step's `Persist`), so a restart never forgets it.
        if term > self.durable.term {
            writes.push(ExecutorWrite::Term(term));
        }
        if cursor > acked {
            writes.push(ExecutorWrite::Trim { up_to: cursor });
        }
        // Run on the mill's timers from here on, durably: a restart fences by the grace the
        // mill counts (E12 against M5), whatever the flags say.
        if timers != self.timers() {
            writes.push(ExecutorWrite::Timers(timers));
        }
        self.persist(writes);
        debug_assert_eq!(
            self.timers(),
            timers,
            "a welcomed executor runs on its mill's timers"
        );
        self.link = Link::Ready(Session {
            conn,
            sent_up_to: cursor,
            next_snapshot: now,
            last_availability: BTreeMap::new(),
        });
        self.send_snapshot();
        self.rearm_snapshot(now);
        self.flush_outbox();
    }

    /// Why the timers a `Welcome` carries cannot be adopted, if they cannot: they break the
    /// bounds a session needs (M9, E12), or this executor's reconnect backoff would outlast
    /// the mill's grace (E11). The reason names the mill's value and this executor's.
    fn unusable(&self, timers: &SessionTimers) -> Option<String> {
        if let Some(problem) = timers.problem() {
            return Some(format!(
                "protocol: the mill's timers cannot run a session: {problem}"
            ));
        }
        let backoff_max = self.config.backoff_max;
        if backoff_max >= timers.reconnect_grace {
            return Some(format!(
                "config: the mill runs --reconnect-grace {:?}, but this executor's --backoff-max is {backoff_max:?}; it must be below the mill's grace",
                timers.reconnect_grace
            ));
        }
        None
    }

    /// E5: trim what the mill acked. An ack for another epoch, or beyond what this session
    /// sent, is a confused mill: the connection is closed and nothing is trimmed.
    fn on_ack(&mut self, now: Time, conn: ConnId, epoch: Epoch, up_to: Seqno) {
        let sent = match &self.link {
            Link::Ready(s) => s.sent_up_to,
            Link::Down { .. } | Link::Connecting { .. } | Link::Hello { .. } => return,
        };
        if epoch != self.durable.epoch {
            let reason = format!(
                "protocol: Ack for epoch {epoch}, this executor's is {}",
                self.durable.epoch
            );
            return self.drop_link(now, Some((conn, reason)));
        }
        if up_to > sent {
            let reason = format!("protocol: Ack up to {up_to}, but only up to {sent} was sent");
            return self.drop_link(now, Some((conn, reason)));
        }
        if up_to > self.durable.acked_up_to() {
            self.persist(vec![ExecutorWrite::Trim { up_to }]);
        }
    }

    /// Whether new seats would be accepted, as reported in snapshots.
    fn open(&self) -> bool {
        self.closed_reason().is_none()
    }

    /// E10: sends a snapshot on the current session (none if not welcomed).
    pub(super) fn send_snapshot(&mut self) {
        let engines = engine_statuses(&self.config, &self.seats, self.open());
        let active_leases = self.active_leases();
        let Link::Ready(session) = &mut self.link else {
            return;
        };
        session.last_availability = engines
            .iter()
            .map(|(name, status)| (name.clone(), status.available))
            .collect();
        let conn = session.conn;
        self.snapshot_seqno = self.snapshot_seqno.saturating_add(1);
        let seqno = self.snapshot_seqno;
        self.send(
            conn,
            ToMill::Snapshot {
                seqno,
                engines,
                active_leases,
                outbox_high: self.durable.last_seqno(),
            },
        );
    }

    /// The next periodic snapshot is due one interval from `now`.
    fn rearm_snapshot(&mut self, now: Time) {
        let next = now.plus(self.timers().snapshot_interval);
        if let Link::Ready(session) = &mut self.link {
            session.next_snapshot = next;
        }
    }

    /// E10: a snapshot whenever an engine's availability changed since the last one. It
    /// leaves the periodic schedule (and its probe) as it was.
    pub(super) fn snapshot_if_availability_changed(&mut self) {
        let Link::Ready(session) = &self.link else {
            return;
        };
        // Runs after every input: decide without building the snapshot's maps (available
        // means what `engine_statuses` says: open and a seat free).
        let open = self.open();
        let changed = self.config.engines.len() != session.last_availability.len()
            || self.config.engines.iter().any(|(name, engine)| {
                let available = open && self.seats.in_use(name) < engine.capacity;
                session.last_availability.get(name) != Some(&available)
            });
        if changed {
            self.send_snapshot();
        }
    }

    /// Leases held here: reserved and running seats, and leases waiting for one (E16). Leases whose only trace is an unacked
    /// event are not listed: the snapshot's `outbox_high` tells the mill to judge nothing
    /// before it has applied those events (M8), so a job that finished while disconnected
    /// is never failed as "no longer has the job" just before its terminal arrives (I3).
    /// At most the configured seats, which `ExecutorConfig::validate` bounds by
    /// `MAX_ACTIVE_LEASES`: the list is never truncated.
    pub(super) fn active_leases(&self) -> Vec<LeaseId> {
        let leases: BTreeSet<_> = self
            .seats
            .reserved
            .keys()
            .chain(self.seats.running.keys())
            .chain(self.seats.waiting.keys())
            .copied()
            .collect();
        debug_assert!(
            leases.len() <= MAX_ACTIVE_LEASES,
            "{} leases held, more than the snapshot bound",
            leases.len()
        );
        leases.into_iter().collect()
    }
}
