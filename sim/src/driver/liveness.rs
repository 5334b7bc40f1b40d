//! The event loop's liveness bookkeeping (I9): the deadline after the heal, whether the run
//! went quiet, and the report of what is stuck when the bound passes (moved out of
//! `driver/mod.rs` and `driver/faults.rs` unchanged, issue 17 item 3). The rule itself — the
//! per-job bounds and the idle-seat check sampled by the checkers — lives in
//! `crate::liveness`; this file is the driver's side of it, which needs `Sim`'s private state.

use super::*;

impl Sim {
    /// The liveness deadline, once the faults have healed.
    pub fn deadline(&self) -> Option<Micros> {
        self.deadline
    }

    /// After the heal: everything submitted ended, nothing held, every outbox drained.
    pub(super) fn quiet(&self) -> bool {
        let w = &self.w;
        if w.arrivals_done < w.workload.arrivals.len() || !self.c.open_jobs().is_empty() {
            return false;
        }
        let Some(mill) = &w.mill else {
            return false;
        };
        if mill.leases().next().is_some() || mill.quota().waiting() > 0 {
            return false;
        }
        w.execs.iter().all(|p| {
            if p.lost {
                return p.exec.is_none() && p.engine.is_empty();
            }
            let quarantined = mill.quarantined().contains(&p.node);
            p.exec.as_ref().is_some_and(|x| {
                x.reserved_leases().next().is_none()
                    && x.running_leases().next().is_none()
                    && x.queued_leases().next().is_none()
                    && (quarantined || p.store.outbox.is_empty())
                    && (!p.violator() || quarantined)
            }) && p.engine.is_empty()
        })
    }

    /// The liveness bound passed: say which jobs are stuck, and where.
    pub(super) fn stuck(&mut self) {
        if !self.w.scenario.checks("I9") {
            self.done = true; // liveness is left out: stop at the bound without a verdict
            return;
        }
        let mut lines = Vec::new();
        for job in self.c.open_jobs().into_iter().take(10) {
            let state = self.w.mill.as_ref().and_then(|m| m.job_state(job)).map_or(
                "(mill down or unknown)".to_string(),
                |s| {
                    let mut out = String::new();
                    match &s {
                        millrace_core::JobState::Queued => out.push_str("queued"),
                        millrace_core::JobState::Reserved { lease, node } => {
                            out.push_str(&format!("reserved {lease}@{node}"))
                        }
                        millrace_core::JobState::Running { lease, node } => {
                            out.push_str(&format!("running {lease}@{node}"))
                        }
                        millrace_core::JobState::Done(t) => trace::terminal(&mut out, t),
                    }
                    out
                },
            );
            let waiting = self
                .w
                .mill
                .as_ref()
                .is_some_and(|m| m.quota().is_waiting(job));
            let spec = self
                .w
                .mill_store
                .jobs
                .get(&job)
                .map(|r| {
                    format!(
                        "{} labels={:?} res={:?}",
                        r.spec.engine, r.spec.labels, r.spec.resources
                    )
                })
                .unwrap_or_default();
            lines.push(format!(
                "{job}: {state}{} ({spec})",
                if waiting { ", waiting for quota" } else { "" }
            ));
        }
        let mut detail = String::new();
        if lines.is_empty() {
            detail.push_str("every job ended, but the system never went quiet:");
            if let Some(m) = &self.w.mill {
                for (l, j, n, ..) in m.leases().take(5) {
                    detail.push_str(&format!(" mill holds {l} of {j} on {n};"));
                }
                if m.quota().waiting() > 0 {
                    detail.push_str(" quota waiters remain;");
                }
            }
            for (i, p) in self.w.execs.iter().enumerate() {
                let q = self
                    .w
                    .mill
                    .as_ref()
                    .is_some_and(|m| m.quarantined().contains(&p.node));
                match &p.exec {
                    None => detail.push_str(&format!(" x{i} down;")),
                    Some(x) => {
                        let r: Vec<LeaseId> = x
                            .reserved_leases()
                            .chain(x.running_leases())
                            .chain(x.queued_leases())
                            .collect();
                        if !r.is_empty()
                            || (!q && !p.store.outbox.is_empty())
                            || !p.engine.is_empty()
                        {
                            detail.push_str(&format!(
                                " x{i}: seats {r:?}, outbox {}, engine {}, ready {};",
                                p.store.outbox.len(),
                                p.engine.len(),
                                x.is_ready()
                            ));
                        }
                        if p.violator() && !q {
                            detail.push_str(&format!(" misbehaving x{i} not quarantined;"));
                        }
                    }
                }
            }
        } else {
            detail = lines.join("; ");
        }
        let heal = self.w.heal_at;
        self.violate(Violation {
            rule: "I9",
            message: format!(
                "not every job ended within the liveness bound ({} after the heal at {}): {detail}",
                trace::secs(self.w.now.saturating_sub(heal)),
                trace::secs(heal)
            ),
        });
    }
}
