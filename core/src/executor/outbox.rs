//! The durable outbox (E5): appending sequenced events and sending what the mill lacks.
//!
//! An event is appended in a `Persist` batch and sent only after it, so the mill never sees a
//! seqno a crash could take back. Events stay until acked; while disconnected they wait
//! (E11) and a Welcome's cursor decides which are sent again (E6).

use crate::types::{bounded_reason, LeaseId, Seqno};
use crate::wire::{Event, EventKind, ToMill, MAX_BATCH_EVENTS, MAX_REASON};

use super::session::Link;
use super::{Executor, ExecutorWrite};

/// A conservative budget for one batch's encoded size, far below the 1 MiB frame limit.
const MAX_BATCH_BYTES: usize = 256 * 1024;

/// An upper bound on an event's postcard size: varints, tags, and the variable strings.
fn encoded_size_bound(event: &Event) -> usize {
    let fixed = 48;
    match &event.kind {
        EventKind::Running => fixed,
        EventKind::Terminal { error, log, .. } => {
            let error = error.as_ref().map_or(0, |e| e.len() + 10);
            let log = log.as_ref().map_or(0, |l| l.path.len() + l.hash.len() + 20);
            fixed + error + log
        }
    }
}

impl Executor {
    /// The write that appends the next event for `lease`; `offset` counts earlier appends in
    /// the same batch.
    pub(super) fn next_event(&self, offset: u64, lease: LeaseId, kind: EventKind) -> ExecutorWrite {
        let seqno = Seqno(self.durable.next_seqno.get().saturating_add(offset));
        ExecutorWrite::Append(Event { seqno, lease, kind })
    }

    /// Whether the outbox still holds an event for `lease` (finished or running, not acked).
    pub(super) fn outbox_has(&self, lease: LeaseId) -> bool {
        self.durable.outbox.iter().any(|e| e.lease == lease)
    }

    /// Sends every outbox event above what this session has, in bounded batches.
    pub(super) fn flush_outbox(&mut self) {
        let Link::Ready(session) = &self.link else {
            return;
        };
        let conn = session.conn;
        let sent = session.sent_up_to;
        let Some(front) = self.durable.outbox.front().map(|e| e.seqno) else {
            return;
        };
        let skip = usize::try_from(sent.get().saturating_add(1).saturating_sub(front.get()))
            .unwrap_or(usize::MAX);
        let mut batches: Vec<Vec<Event>> = Vec::new();
        let mut current: Vec<Event> = Vec::new();
        let mut bytes = 0usize;
        for event in self.durable.outbox.iter().skip(skip) {
            let size = encoded_size_bound(event);
            if !current.is_empty()
                && (current.len() >= MAX_BATCH_EVENTS || bytes + size > MAX_BATCH_BYTES)
            {
                batches.push(std::mem::take(&mut current));
                bytes = 0;
            }
            bytes += size;
            current.push(event.clone());
        }
        if !current.is_empty() {
            batches.push(current);
        }
        let epoch = self.durable.epoch;
        for events in batches {
            let last = events.last().map(|e| e.seqno);
            self.send(conn, ToMill::EventBatch { epoch, events });
            if let (Some(last), Link::Ready(session)) = (last, &mut self.link) {
                session.sent_up_to = last;
            }
        }
    }
}

/// Reasons and errors on the wire are bounded by `MAX_REASON` (the mill enforces it).
pub(super) fn bounded_error(error: impl Into<String>) -> String {
    bounded_reason(error, MAX_REASON)
}
