//! Sequenced event batches, applied exactly once (M19–M25).

use std::collections::BTreeSet;

use super::terminals::TerminalMemory;
use super::{reason, LeaseState, Mill, MillWrite, Observation, ViolationKind};
use crate::job::{Terminal, TerminalCause, TerminalStatus};
use crate::types::{Epoch, LeaseId, NodeId, Seqno};
use crate::wire::{self, EndCause, Event, EventKind, ToExecutor};

impl Mill {
    /// Checks the whole batch first (M19, M20, M22, M25): a bad batch is a violation and
    /// nothing of it is applied. Then applies the new events, persists their effects and the
    /// cursor in one batch, and acks (M23).
    pub(super) fn on_event_batch(&mut self, node: &NodeId, epoch: Epoch, events: Vec<Event>) {
        let Some(s) = self.sessions.get(node) else {
            return;
        };
        let Some(conn) = s.conn else {
            return;
        };
        // Only a Hello's session has a connection, so events move only the stream of the
        // epoch the node said it is on: an old epoch's stream never moves again (M23).
        debug_assert!(s.greeted, "M23: {node} has a connection without a Hello");
        if epoch != s.epoch {
            let what = format!(
                "event batch for epoch {epoch} on a session of epoch {}",
                s.epoch
            );
            return self.violation(node, ViolationKind::WrongEpoch, &what);
        }
        if events.len() > wire::MAX_BATCH_EVENTS {
            let what = format!(
                "event batch of {} events (at most {})",
                events.len(),
                wire::MAX_BATCH_EVENTS
            );
            return self.violation(node, ViolationKind::Oversize, &what);
        }
        let cursor = self.cursor(node, epoch);
        let key = (node.clone(), epoch);
        let empty = TerminalMemory::default();
        let memory = self.terminals.get(&key).unwrap_or(&empty);
        if let Err((kind, what)) = check_batch(cursor, &events, memory) {
            return self.violation(node, kind, &what);
        }
        // Each new event writes at most three records (lease delete, quota release, job
        // state) and one client update; sized once instead of grown per event.
        let new = events.iter().filter(|e| e.seqno > cursor).count();
        self.writes.reserve(3 * new + 1);
        self.out.reserve(new + 2);
        let bound = self.config.terminal_memory;
        // Taken out while the batch is applied, put back after: one lookup per batch.
        let mut memory = self.terminals.remove(&key).unwrap_or_default();
        memory.reserve(new, bound);
        let mut up_to = cursor;
        let mut first = None;
        let mut count = 0u64;
        let mut applied_any = false;
        let mut worked = false;
        for event in events {
            if event.seqno <= cursor {
                continue; // M20: a replay, dropped
            }
            up_to = event.seqno;
            first.get_or_insert(event.seqno);
            count += 1;
            applied_any = true;
            worked |= self.apply_event(node, epoch, event, &mut memory, bound);
        }
        if !memory.is_empty() {
            self.terminals.insert(key, memory);
        }
        if worked {
            if let Some(s) = self.sessions.get_mut(node) {
                s.did_work = true;
            }
        }
        if up_to > cursor {
            self.cursors.insert((node.clone(), epoch), up_to);
            self.persist(MillWrite::Cursor {
                node: node.clone(),
                epoch,
                seqno: up_to,
            });
        }
        if applied_any {
            self.extend_grace(node);
        }
        if up_to > cursor {
            self.reconcile_if_caught_up(node);
        }
        if let Some(first) = first {
            self.observe(Observation::Applied {
                conn,
                epoch,
                first,
                last: up_to,
                events: count,
            });
        }
        // M20, M23: acked after the persist, replays included.
        let term = self.config.term;
        self.send(conn, ToExecutor::Ack { term, epoch, up_to });
    }

    /// Applies one new event (M21, M24); true if it was for a lease the node held (work
    /// done, for M28's strike reset).
    fn apply_event(
        &mut self,
        node: &NodeId,
        epoch: Epoch,
        event: Event,
        memory: &mut TerminalMemory,
        bound: usize,
    ) -> bool {
        let lease = self
            .leases
            .get(&event.lease)
            .filter(|l| &l.node == node && l.epoch == epoch);
        let held = lease.is_some();
        let reserved = lease.is_some_and(|l| l.state == LeaseState::Reserved);
        // A job stopped for its timeout reports Cancelled; it ended by Timeout (M18).
        let cancel = lease
            .and_then(|l| l.cancel.as_ref())
            .map(|c| (c.status, c.cause, c.reason.clone()));
        if let EventKind::Terminal { .. } = &event.kind {
            memory.remember(event.lease, bound);
        }
        if !held {
            return false; // M21: not this node's (or already done): skipped, cursor advances
        }
        match event.kind {
            EventKind::Running => {
                if reserved {
                    self.mark_running(event.lease);
                }
            }
            EventKind::Terminal {
                status,
                exit_code,
                error,
                log,
                cause,
            } => {
                // A stop the mill asked for ended it: that cancel is the cause (M26, M18).
                // So it is when the executor's own verdict ended a job the mill was cancelling
                // (its restart, E9, or self-fencing, E12, before it acted on the cancel): the
                // job did not produce a result, and the cancel stands, as at grace expiry (M5).
                // Otherwise the executor's typed account: the engine's result, or its verdict.
                let verdict = matches!(cause, EndCause::Restarted | EndCause::LostContact);
                let (status, cause, error) = match (cancel, cause) {
                    (Some((c, cause, _)), _) if status == TerminalStatus::Cancelled => {
                        (c, cause, error)
                    }
                    (Some((c, cause, why)), _) if verdict => {
                        let text = error.as_deref().unwrap_or("executor stopped the job");
                        (c, cause, Some(reason(format!("{why} ({text})"))))
                    }
                    (_, EndCause::Restarted) => (status, TerminalCause::ExecutorRestarted, error),
                    (_, EndCause::LostContact) => (status, TerminalCause::LostContact, error),
                    (_, EndCause::Engine | EndCause::Cancelled) => {
                        (status, TerminalCause::Reported, error)
                    }
                };
                let t = Terminal {
                    status,
                    cause: Some(cause),
                    exit_code,
                    error,
                    log,
                    node: Some(node.clone()),
                    lease: Some(event.lease),
                };
                self.end_lease(event.lease, Some(t));
            }
        }
        true
    }
}

/// M20, M22, M25 and the text bounds, for a batch with `cursor` already applied.
///
/// An event after a terminal of the same batch (M22) is rare, so a first pass looks for one
/// with a sorted list of the batch's terminals; only a batch that has one pays for the set
/// of leases ended so far. Either way the checks run in event order and the first failure
/// is reported.
fn check_batch(
    cursor: Seqno,
    events: &[Event],
    terminated: &TerminalMemory,
) -> Result<(), (ViolationKind, String)> {
    check_events(
        cursor,
        events,
        terminated,
        may_repeat_a_terminal(cursor, events),
    )
}

/// True if some new event's lease had a terminal earlier among the batch's new events (a
/// superset of what M22 rejects within a batch: seqno checks may stop the batch sooner).
fn may_repeat_a_terminal(cursor: Seqno, events: &[Event]) -> bool {
    let mut terminals: Vec<(LeaseId, usize)> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.seqno > cursor && matches!(e.kind, EventKind::Terminal { .. }))
        .map(|(i, e)| (e.lease, i))
        .collect();
    if terminals.is_empty() {
        return false;
    }
    // Sorted by lease, then position: the first entry of a lease is its first terminal.
    terminals.sort_unstable();
    events.iter().enumerate().any(|(i, e)| {
        if e.seqno <= cursor {
            return false;
        }
        let first = terminals.partition_point(|&(lease, _)| lease < e.lease);
        terminals
            .get(first)
            .is_some_and(|&(lease, at)| lease == e.lease && at < i)
    })
}

/// The checks of [`check_batch`]; `track_ended` keeps the set of leases ended so far in the
/// batch (needed only if [`may_repeat_a_terminal`] found a candidate).
fn check_events(
    cursor: Seqno,
    events: &[Event],
    terminated: &TerminalMemory,
    track_ended: bool,
) -> Result<(), (ViolationKind, String)> {
    let mut prev: Option<Seqno> = None;
    let mut expected = cursor.next();
    let mut ended_here: BTreeSet<LeaseId> = BTreeSet::new();
    for e in events {
        if prev.is_some_and(|p| e.seqno <= p) {
            return Err((
                ViolationKind::SeqnoOrder,
                format!(
                    "event seqnos must increase within a batch: {} after {:?}",
                    e.seqno, prev
                ),
            ));
        }
        prev = Some(e.seqno);
        if e.seqno <= cursor {
            continue;
        }
        if e.seqno != expected {
            return Err((
                ViolationKind::SeqnoGap,
                format!("seqno gap: expected {expected}, got {} (M20)", e.seqno),
            ));
        }
        expected = expected.next();
        if terminated.contains(e.lease) || ended_here.contains(&e.lease) {
            return Err((
                ViolationKind::EventAfterTerminal,
                format!(
                    "event {} for lease {} after its terminal (M22)",
                    e.seqno, e.lease
                ),
            ));
        }
        if let EventKind::Terminal { error, log, .. } = &e.kind {
            if error.as_ref().is_some_and(|t| t.len() > wire::MAX_REASON) {
                return Err((
                    ViolationKind::Oversize,
                    format!("event {}: error text over 4096 bytes", e.seqno),
                ));
            }
            if let Some(log) = log {
                if !log.is_valid_for(e.lease) {
                    return Err((
                        ViolationKind::BadLogRef,
                        format!(
                            "event {}: log reference {:?} / {:?} must be logs/{}.log with a sha256 (M25)",
                            e.seqno,
                            crate::types::bounded_reason(log.path.clone(), 256),
                            crate::types::bounded_reason(log.hash.clone(), 80),
                            e.lease.get()
                        ),
                    ));
                }
            }
            if track_ended {
                ended_here.insert(e.lease);
            }
        }
    }
    Ok(())
}
