//! Read-only views of the mill's sessions for operators (the node's `/v1/nodes`). Nothing
//! here changes state.

use std::collections::BTreeSet;

use super::Mill;
use crate::types::{ConnId, Epoch, NodeId, Time};

/// One executor session as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionView<'a> {
    /// The executor.
    pub node: &'a NodeId,
    /// Its store epoch (E1).
    pub epoch: Epoch,
    /// A connection is live.
    pub connected: bool,
    /// The live connection, if any.
    pub conn: Option<ConnId>,
    /// The first snapshot of the live connection was reconciled (M8): cancels that waited
    /// for the node have gone out on it (M26).
    pub reconciled: bool,
    /// It takes new work (M3, M11, M27): connected, reconciled, snapshotted, no pending cancel.
    pub ready: bool,
    /// It is in grace: disconnected or recovering, its leases kept (M4–M6).
    pub in_grace: bool,
    /// When its grace runs out, while in grace (M5, M6). A driver that handles deadlines
    /// late (I12) may see it in the past until its next `Tick`.
    pub grace_deadline: Option<Time>,
    /// Labels it holds.
    pub labels: &'a BTreeSet<String>,
    /// Engines it offers.
    pub engines: &'a BTreeSet<String>,
    /// Seats over all engines in its latest snapshot (0 before the first).
    pub capacity: u64,
    /// Cancels sent to it and not yet acked.
    pub pending_cancels: usize,
}

impl Mill {
    /// Every session (connected or in grace), in node order.
    pub fn session_views(&self) -> impl Iterator<Item = SessionView<'_>> + '_ {
        self.sessions.iter().map(|(node, s)| SessionView {
            node,
            epoch: s.epoch,
            connected: s.conn.is_some(),
            conn: s.conn,
            reconciled: s.conn.is_some() && s.reconciled,
            ready: s.ready(),
            in_grace: s.grace.is_some(),
            grace_deadline: s.grace,
            labels: &s.labels,
            engines: &s.engines,
            capacity: s
                .snapshot
                .as_ref()
                .map(|(_, engines)| engines.values().map(|e| u64::from(e.capacity)).sum())
                .unwrap_or(0),
            pending_cancels: s.pending_cancels.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{node, H};
    use crate::mill::MillInput;

    #[test]
    fn session_views_show_readiness_grace_and_capacity() {
        let mut h = H::new();
        let conn = h.ready("a", 0.1);
        let views: Vec<_> = h.mill.session_views().collect();
        assert_eq!(views.len(), 1);
        let v = &views[0];
        assert_eq!(v.node, &node("a"));
        assert!(v.connected && v.ready && !v.in_grace);
        assert!(v.capacity > 0);
        h.input(MillInput::Disconnected { conn }).unwrap();
        let v = h.mill.session_views().next().unwrap();
        assert!(!v.connected && !v.ready && v.in_grace);
    }
}
