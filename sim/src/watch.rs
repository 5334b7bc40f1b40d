//! Watches for the situations scenario files target that neither the core's `RarePath`s nor
//! the checkers name: a cut during a commit, a cancel to a cut-off executor, a reconnect storm,
//! a flapping link, a label-constrained placement. Read-only over the world; it only counts,
//! so a run's events and trace are the same with or without it (I10).

use std::collections::{BTreeMap, VecDeque};

use millrace_core::job::JobSpec;
use millrace_core::mill::LeaseState;
use millrace_core::wire::EventKind;
use millrace_core::{JobId, JobState};

use crate::coverage::{Coverage, Path};
use crate::scenario::{Fault, Micros, SEC};
use crate::world::World;

/// Sessions to one restarted mill incarnation, within `STORM_WINDOW` of its first, that make
/// a storm.
pub const STORM: u32 = 50;
/// The window of `STORM`.
pub const STORM_WINDOW: Micros = 10 * SEC;
/// Connects of one executor within `FLAP_WINDOW` that make it flapping.
pub const FLAPS: usize = 5;
/// The window of `FLAPS`.
pub const FLAP_WINDOW: Micros = 120 * SEC;

/// State of the watches that count over time.
#[derive(Debug, Default)]
pub struct Watch {
    /// The current mill incarnation, when it accepted its first session, and how many it
    /// accepted within `STORM_WINDOW` of that.
    sessions: (u32, Micros, u32),
    /// Recent connects per executor.
    connects: BTreeMap<usize, VecDeque<Micros>>,
}

impl Watch {
    /// The mill (incarnation `inc`) accepted a connection at `now`.
    pub fn mill_connected(&mut self, inc: u32, now: Micros, cov: &mut Coverage) {
        if self.sessions.0 != inc {
            self.sessions = (inc, now, 0);
        }
        if now > self.sessions.1 + STORM_WINDOW {
            return;
        }
        self.sessions.2 += 1;
        if inc > 0 && self.sessions.2 == STORM {
            cov.hit(Path::ReconnectStorm);
        }
    }

    /// Executor `exec` connected at `now`.
    pub fn exec_connected(&mut self, exec: usize, now: Micros, cov: &mut Coverage) {
        let q = self.connects.entry(exec).or_default();
        q.push_back(now);
        while q.front().is_some_and(|t| *t + FLAP_WINDOW < now) {
            q.pop_front();
        }
        if q.len() >= FLAPS {
            cov.hit(Path::FlappingReconnects);
            q.clear();
        }
    }
}

/// Whether the mill holds a lease on executor `i` that it published (`Reserved`: persisted,
/// `CommitLease` sent or waiting for the node's session) and whose commit it has not yet
/// heard answered: a commit is in flight between the two.
fn commit_in_flight(w: &World, i: usize) -> bool {
    let node = &w.execs[i].node;
    w.mill.as_ref().is_some_and(|m| {
        m.leases()
            .any(|(_, _, n, _, state, _)| n == node && state == LeaseState::Reserved)
    })
}

/// A partition or clog has just been applied (call it after the blocks are in force): counts
/// `PartitionDuringCommit` when a link the fault really blocks carries a commit in flight.
/// A fault that blocks nothing (or a fault model that stops blocking) counts nothing.
pub fn fault_applied(w: &World, fault: &Fault, cov: &mut Coverage) {
    let cut: &[usize] = match fault {
        Fault::Partition { side, .. } => side,
        Fault::Clog { exec, .. } => std::slice::from_ref(exec),
        _ => return,
    };
    let blocked = |i: usize| w.net.blocked(i, true) || w.net.blocked(i, false);
    if cut.iter().any(|&i| blocked(i) && commit_in_flight(w, i)) {
        cov.hit(Path::PartitionDuringCommit);
    }
}

/// Executor `i` is about to crash: counts `CrashWithResultsBehindCut` when its link to the
/// mill is blocked and its durable outbox holds a terminal result (finished, not yet acked).
pub fn exec_crashes(w: &World, i: usize, cov: &mut Coverage) {
    let p = &w.execs[i];
    let terminal_unacked = p
        .store
        .outbox
        .iter()
        .any(|e| matches!(e.kind, EventKind::Terminal { .. }));
    if w.net.blocked(i, true) && terminal_unacked {
        cov.hit(Path::CrashWithResultsBehindCut);
    }
}

/// The mill is about to crash.
pub fn mill_crashes(w: &World, cov: &mut Coverage) {
    let reserved = w.mill.as_ref().is_some_and(|m| {
        m.leases()
            .any(|(.., state, _)| state == LeaseState::Reserved)
    });
    if reserved {
        cov.hit(Path::MillCrashWithReservedLeases);
    }
}

/// A user cancels `job`.
pub fn user_cancel(w: &World, job: JobId, cov: &mut Coverage) {
    let Some(node) = w.mill.as_ref().and_then(|m| match m.job_state(job) {
        Some(JobState::Reserved { node, .. } | JobState::Running { node, .. }) => Some(node),
        _ => None,
    }) else {
        return;
    };
    let Some(i) = w.exec_of(&node) else {
        return;
    };
    if w.net.blocks.down[i] > 0 || w.net.blocks.up[i] > 0 || w.execs[i].exec.is_none() {
        cov.hit(Path::CancelWhilePartitioned);
    }
}

/// The mill asks an executor for a seat for `spec`.
pub fn reserve_seat(w: &World, spec: &JobSpec, cov: &mut Coverage) {
    if spec.labels.is_empty() {
        return;
    }
    if w.execs
        .iter()
        .any(|p| !spec.labels.is_subset(&p.spec.labels))
    {
        cov.hit(Path::LabelConstrainedPlacement);
    }
}
