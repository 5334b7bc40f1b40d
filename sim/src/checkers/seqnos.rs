//! I4 (M20): per (node, epoch) the applied seqnos are exactly 1..=cursor, each once; the
//! cursor's bookkeeping (moved out of `checkers.rs` unchanged, issue 17 item 3).

use super::*;

impl Checker {
    /// I4: a cursor only moves forward, over exactly the events of the batch being applied.
    pub(super) fn cursor_advanced(
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
    pub(super) fn cursor_forgotten(
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
}
