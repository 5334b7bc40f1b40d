//! I8 and M28 against misbehaving executors: every violating message refused in its step,
//! violators quarantined, nobody else harmed (moved out of `checkers.rs` unchanged, issue 17
//! item 3).

use super::*;

impl Checker {
    /// I8 (M28, DESIGN §8): a message of misbehaving executor `exec` reaches the mill on
    /// `conn`, tagged by its filter. Works out, from the mill's state before the step, which
    /// violation the mill must find in it (if any: a replay, an answer to an ask already over
    /// or a batch the cursor makes legal owe nothing), for [`Checker::byz_step_done`] to
    /// check. Returns a coverage path the delivery reached.
    pub fn byz_received(
        &mut self,
        w: &World,
        exec: usize,
        conn: ConnId,
        msg: &ToMill,
        tag: Expect,
    ) -> Option<Path> {
        let m = w.mill.as_ref()?;
        let node = &w.execs[exec].node;
        let kind = match (tag, msg) {
            (Expect::Always(kind), _) => Some(kind),
            (Expect::Batch { kind, bad }, ToMill::EventBatch { epoch, events }) => {
                batch_violation(m.cursor(node, *epoch), events, kind, &bad)
            }
            (Expect::Answer { kind, lease }, _) => {
                // An open ask of a bid, or a direct ask (M35) whose answer is still due:
                // both are judged the same way.
                let open = (m.is_ask(lease) && m.stray(lease).is_none()) || m.is_direct_ask(lease);
                let asked_here = w.leases.get(&lease).is_some_and(|l| l.exec == exec);
                match (open, asked_here, kind) {
                    (false, _, _) => None,
                    (true, false, _) => Some(ViolationKind::UnaskedReserveResult),
                    (true, true, ViolationKind::BadResources) => Some(kind),
                    (true, true, _) => None,
                }
            }
            (Expect::Replay(seqno), ToMill::EventBatch { epoch, .. }) => {
                // M20: dropped, still acked; I4 (`applied`) sees it applied if it is not.
                return (m.cursor(node, *epoch) == seqno).then_some(Path::ReplayAtCursor);
            }
            _ => None,
        }?;
        self.byz_pending = Some(ByzPending {
            exec,
            conn,
            kind,
            what: describe(msg),
        });
        self.step_violations.clear();
        self.step_closed.clear();
        let repeat = w.execs[exec].spec.byzantine == Some(ByzKind::SnapshotRepeat);
        Some(if repeat && kind == ViolationKind::SnapshotRegression {
            Path::SnapshotRepeatRefused
        } else {
            Path::ViolationReceived
        })
    }

    /// I8: the mill's step over a violating message is done: it must have observed that
    /// violation (the same kind) for the node and closed the connection, so nothing later on
    /// it is applied (M28).
    pub fn byz_step_done(&mut self, w: &World) -> Result<(), Violation> {
        let Some(p) = self.byz_pending.take() else {
            return Ok(());
        };
        let violations = std::mem::take(&mut self.step_violations);
        let closed = std::mem::take(&mut self.step_closed);
        if w.mill.is_none() {
            return Ok(()); // crashed within the step: its outputs were cut short
        }
        let node = &w.execs[p.exec].node;
        let seen = violations.iter().any(|(n, k)| n == node && *k == p.kind);
        if seen && closed.contains(&p.conn) {
            return Ok(());
        }
        let did: Vec<String> = violations
            .iter()
            .map(|(n, k)| format!("{n}: {k}"))
            .collect();
        fail(
            "I8",
            format!(
                "x{} ({}) sent {} on {}: a {} violation ({}), yet the mill accepted it (violations observed: {did:?}; closed {:?})",
                p.exec,
                w.execs[p.exec].spec.byzantine.map_or("", |k| k.name()),
                p.what,
                p.conn,
                p.kind,
                Expect::rule(p.kind),
                closed
            ),
        )
    }
}
