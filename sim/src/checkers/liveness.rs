//! I9 after the heal (the per-job bounds are computed in `crate::liveness`) and the rules about
//! the quiescent end state (moved out of `checkers.rs` unchanged, issue 17 item 3).

use super::*;

impl Checker {
    /// I9 after the heal: a free compatible seat takes a waiting job within the protocol's
    /// allowances, and every job ends by a bound computed from the work ahead of it
    /// (`crate::liveness`, where the formula is).
    pub(super) fn i9_liveness(&mut self, w: &World) -> Result<(), Violation> {
        if w.mill.is_some() && self.fences_inc != w.mill_inc {
            self.fences_inc = w.mill_inc;
            let again = w.now.saturating_add(fence_len(w));
            for until in self.fences.values_mut() {
                *until = (*until).max(again);
            }
        }
        let open: Vec<crate::liveness::OpenJob> = self
            .accepted
            .iter()
            .filter(|(j, _)| !self.terminals.contains_key(j))
            .map(|(&job, &arrival)| crate::liveness::OpenJob {
                job,
                arrival,
                ran: self.job_runs.get(&job).is_some_and(|runs| {
                    runs.iter().any(|l| {
                        self.runs.get(l).is_some_and(|r| r.exited.is_some())
                            && !self.ended.contains_key(l)
                    })
                }),
                fenced_until: self.fences.get(&job).copied(),
                retried: self.attempts.get(&job).map_or(0, |a| a.retried),
            })
            .collect();
        let a = self.bounds.live;
        self.live
            .check(w, &a, &open, &self.accepted, &self.quarantined)
    }

    /// Every job ended after the heal, yet the system is still not quiet past I9's allowance.
    pub fn quiet_overdue(&self, now: Micros) -> bool {
        self.live.quiet_overdue(now)
    }

    /// The end state, after the faults healed and every job ended (I2, I5, I6, I8, I9).
    pub fn quiescent(&self, w: &World) -> Result<(), Violation> {
        if let Some(job) = self.open_jobs().first() {
            return fail("I9", format!("{job} never reached a terminal"));
        }
        for job in self.terminals.keys() {
            if !self.inserted.contains(job) {
                return fail(
                    "I2",
                    format!("terminal for {job}, which was never accepted"),
                );
            }
        }
        let Some(mill) = &w.mill else {
            return fail("I9", "the mill is down at the end".into());
        };
        if let Some((lease, job, node, ..)) = mill.leases().next() {
            return fail(
                "I6",
                format!("the mill still holds {lease} of {job} on {node}"),
            );
        }
        if !w.mill_store.leases.is_empty() || !w.mill_store.jobs.is_empty() {
            return fail(
                "I6",
                format!(
                    "the mill's store still holds {} leases and {} jobs",
                    w.mill_store.leases.len(),
                    w.mill_store.jobs.len()
                ),
            );
        }
        if let Some((job, ..)) = mill.quota().holds().next() {
            return fail("I5", format!("quota still held for {job} at quiescence"));
        }
        if mill.quota().waiting() > 0 || !w.mill_store.quota_holds.is_empty() {
            return fail(
                "I5",
                "quota waiters or durable holds remain at quiescence".into(),
            );
        }
        for (i, p) in w.execs.iter().enumerate() {
            if p.lost {
                continue; // its host died for good (`Fault::Lose`)
            }
            let Some(x) = &p.exec else {
                return fail("I9", format!("x{i} is down at the end"));
            };
            let held = x.reserved_leases().chain(x.running_leases());
            if let Some(l) = held.chain(x.queued_leases()).next() {
                return fail("I6", format!("x{i} still holds {l} at quiescence"));
            }
            if x.durable() != &p.store {
                return fail(
                    "persist-before-send",
                    format!("x{i}'s store differs from what it believes is durable"),
                );
            }
            let quarantined = mill.quarantined().contains(&p.node);
            if p.violator() && !quarantined {
                return fail(
                    "I8",
                    format!(
                        "misbehaving x{i} ({}) was never quarantined",
                        p.spec.byzantine.map_or("", |k| k.name())
                    ),
                );
            }
            if !p.violator() && quarantined {
                return fail("I8", format!("x{i}, no violator, was quarantined"));
            }
            if p.honest() && !p.store.outbox.is_empty() {
                return fail(
                    "I4",
                    format!(
                        "x{i}'s outbox still holds {} unacked events",
                        p.store.outbox.len()
                    ),
                );
            }
        }
        if let Some(l) = self.running.first() {
            return fail("I1", format!("an engine still runs {l} at the end"));
        }
        Ok(())
    }
}
