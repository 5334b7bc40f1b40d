//! The mill's own check of its timer table (STYLE 13, 15): every timer watches something
//! live, at the deadline that thing holds, and everything live that needs a deadline has one.
//! So an ended job, lease, ask or session leaves no timer behind, and an idle mill has no
//! deadline at all. The fairness indexes (M33) are checked here too.

use super::{CancelPhase, Conn, Mill, Phase, Timer};

impl Mill {
    /// Checks the timer table against the state; `Err` names the first mismatch. Costs a walk
    /// of every timer, job, lease and session: tests and the simulator call it, and debug
    /// builds run it after each step while the mill is small.
    pub fn check_timers(&self) -> Result<(), String> {
        for (timer, at) in self.timers.iter() {
            let live = match timer {
                Timer::Handshake(conn) => matches!(self.conns.get(conn), Some(Conn { node: None })),
                Timer::Silence(node) => self.sessions.get(node).is_some_and(|s| s.conn.is_some()),
                Timer::Grace(node) => self.sessions.get(node).is_some_and(|s| s.grace == Some(at)),
                Timer::Ask(lease) => self.asks.get(lease).is_some_and(|job| {
                    self.jobs.get(job).is_some_and(|j| match &j.phase {
                        Phase::Bidding(round) => round.open_ask_deadline(*lease) == Some(at),
                        Phase::Queued
                        | Phase::QuotaWait { .. }
                        | Phase::Leased(_)
                        | Phase::Fenced { .. } => false,
                    })
                }),
                Timer::Stray(lease) => self.strays.contains_key(lease),
                Timer::Commit(lease) => self
                    .leases
                    .get(lease)
                    .is_some_and(|l| l.commit_sent.is_some_and(|(_, due)| due == at)),
                Timer::CancelAck(node, lease) => self
                    .sessions
                    .get(node)
                    .is_some_and(|s| s.pending_cancels.get(lease) == Some(&at)),
                Timer::Teardown(lease) => self.leases.get(lease).is_some_and(|l| {
                    l.cancel
                        .as_ref()
                        .is_some_and(|c| c.phase == CancelPhase::Acked { teardown: at })
                }),
                Timer::JobTimeout(job) => self.jobs.get(job).is_some_and(|j| j.deadline == at),
                Timer::QueueTimeout(job) => self.jobs.get(job).is_some_and(|j| {
                    j.queue_deadline == Some(at) && !matches!(j.phase, Phase::Leased(_))
                }),
                Timer::RetryFence(job) => self
                    .jobs
                    .get(job)
                    .is_some_and(|j| matches!(j.phase, Phase::Fenced { until } if until == at)),
            };
            if !live {
                return Err(format!("timer {timer:?} at {at:?} watches nothing live"));
            }
        }
        let missing = |timer: Timer, at: super::Time| -> Result<(), String> {
            if self.timers.get(&timer) == Some(at) {
                Ok(())
            } else {
                Err(format!("{timer:?} has no timer at {at:?}"))
            }
        };
        for (id, j) in &self.jobs {
            // A timeout that fired leaves a job only while the cancel it started runs
            // (M18, M26); that cancel has its own deadlines.
            let stopping = j.deadline <= self.now
                && match j.phase {
                    Phase::Leased(lease) => {
                        self.leases.get(&lease).is_some_and(|l| l.cancel.is_some())
                    }
                    Phase::Queued
                    | Phase::Bidding(_)
                    | Phase::QuotaWait { .. }
                    | Phase::Fenced { .. } => false,
                };
            if !stopping {
                missing(Timer::JobTimeout(*id), j.deadline)?;
            }
            if let Some(at) = j.queue_deadline {
                missing(Timer::QueueTimeout(*id), at)?;
            }
            if let Phase::Fenced { until } = j.phase {
                missing(Timer::RetryFence(*id), until)?;
            }
            if let Phase::Bidding(round) = &j.phase {
                for (lease, at) in round.open_asks() {
                    missing(Timer::Ask(lease), at)?;
                }
            }
        }
        for (conn, c) in &self.conns {
            if c.node.is_none() && self.timers.get(&Timer::Handshake(*conn)).is_none() {
                return Err(format!("unbound connection {conn} has no handshake timer"));
            }
        }
        for (node, s) in &self.sessions {
            if s.conn.is_some() && self.timers.get(&Timer::Silence(node.clone())).is_none() {
                return Err(format!("connected {node} has no silence timer"));
            }
            if let Some(g) = s.grace {
                missing(Timer::Grace(node.clone()), g)?;
            }
            for (lease, at) in &s.pending_cancels {
                missing(Timer::CancelAck(node.clone(), *lease), *at)?;
            }
        }
        for lease in self.strays.keys() {
            if self.timers.get(&Timer::Stray(*lease)).is_none() {
                return Err(format!("stray ask {lease} has no timer"));
            }
        }
        for (id, l) in &self.leases {
            if let Some(c) = &l.cancel {
                if let CancelPhase::Acked { teardown } = c.phase {
                    missing(Timer::Teardown(*id), teardown)?;
                }
            }
        }
        self.check_fairness_index()
    }

    /// M33's indexes agree with the state: each owner's job count is its jobs, its queued
    /// set is its part of the queue, and `fair` holds exactly one entry per owner with a
    /// queued job, at its load and oldest queued job.
    pub fn check_fairness_index(&self) -> Result<(), String> {
        use std::collections::{BTreeMap, BTreeSet};
        let mut jobs: BTreeMap<&str, usize> = BTreeMap::new();
        let mut queued: BTreeMap<&str, BTreeSet<super::QueueKey>> = BTreeMap::new();
        for (id, j) in &self.jobs {
            let owner = j.spec.identity.owner.as_str();
            *jobs.entry(owner).or_insert(0) += 1;
            if self.queue.contains(id) {
                queued
                    .entry(owner)
                    .or_default()
                    .insert(super::QueueKey::of(*id, &j.spec));
            }
        }
        if self.owners.len() != jobs.len() {
            return Err(format!(
                "{} owners indexed, {} own jobs (M33)",
                self.owners.len(),
                jobs.len()
            ));
        }
        let mut fair = BTreeSet::new();
        for (owner, o) in &self.owners {
            let want_jobs = jobs.get(&**owner).copied().unwrap_or(0);
            let want_queued = queued.remove(&**owner).unwrap_or_default();
            if o.jobs != want_jobs || o.queued != want_queued {
                return Err(format!(
                    "owner {owner}: indexed {} jobs, {} queued; holds {want_jobs}, {} queued (M33)",
                    o.jobs,
                    o.queued.len(),
                    want_queued.len()
                ));
            }
            if let Some(first) = o.queued.first() {
                fair.insert(first.fair(o.load(), owner));
            }
        }
        if fair != self.fair {
            return Err(format!(
                "M33's order {:?} is not the owners' {fair:?}",
                self.fair
            ));
        }
        Ok(())
    }

    /// Debug builds check the table after each step while the mill is small enough for the
    /// walk to be cheap; the simulator's fleets are.
    pub(super) fn debug_check_timers(&self) {
        if cfg!(debug_assertions) && self.timers.len() + self.jobs.len() <= 512 {
            if let Err(e) = self.check_timers() {
                panic!("timer table out of step with the mill: {e}");
            }
        }
    }
}
