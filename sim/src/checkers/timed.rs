//! The time-bounded checks run on every sample: I1's stop bound, job timeouts (M18), and every
//! reserved seat known to the mill (moved out of `checkers.rs` unchanged, issue 17 item 3).

use super::*;

impl Checker {
    /// Every couple of simulated seconds: I1's time bound, I9's starvation rule; I5 on the
    /// ledger every ten.
    pub fn sample(&mut self, w: &World) -> Result<(), Violation> {
        self.i1_stop_bound(w)?;
        self.i11_stop_bound(w)?;
        self.m18_timeouts(w)?;
        self.i11_cancel_sent(w)?;
        self.reservations_known(w)?;
        if (w.now / SEC) % 10 < 2 {
            self.quota_within_limits(w)?;
            self.ledger_within_limits(w)?;
        }
        if w.healed {
            self.i9_liveness(w)?;
        }
        Ok(())
    }

    pub(super) fn i1_stop_bound(&mut self, w: &World) -> Result<(), Violation> {
        let held: BTreeSet<LeaseId> = match &w.mill {
            Some(m) => m.leases().map(|(l, ..)| l).collect(),
            None => w.mill_store.leases.keys().copied().collect(),
        };
        if let Some(m) = &w.mill {
            let mut jobs = BTreeSet::new();
            for (lease, job, ..) in m.leases() {
                if !jobs.insert(job) {
                    return fail(
                        "I1",
                        format!("the mill holds two leases for {job} (one is {lease})"),
                    );
                }
            }
        }
        for &lease in &self.running {
            if held.contains(&lease) || self.stopped.contains(&lease) {
                self.not_held_since.remove(&lease);
                continue;
            }
            let since = *self.not_held_since.entry(lease).or_insert(w.now);
            if w.now.saturating_sub(since) > self.bounds.stop {
                let run = &self.runs[&lease];
                let ended = self
                    .ended
                    .get(&lease)
                    .map_or("never stored".to_string(), |t| secs(*t));
                return fail(
                    "I1",
                    format!(
                        "x{} still runs {} under {lease} (mill ended the lease: {ended}) and was not told to stop within {}",
                        run.exec,
                        run.job,
                        secs(self.bounds.stop)
                    ),
                );
            }
        }
        Ok(())
    }

    /// M18 through I11: a job whose own timeout has passed is cancelled by the mill. The
    /// clock starts at acceptance and starts again at a mill restart (the restored mill
    /// re-arms every job's timeout from its own start, M29). Once `timeout + 5 s` (a lagging
    /// driver's slack) has passed on a running mill, a job still queued is a failure (its
    /// timeout ends it at once), and a leased job is held to I11 as if a client had
    /// cancelled it then: its cancel goes out, its engine stops, its terminal is Timeout or
    /// Cancelled unless the engine's own result beat the cancel to the executor.
    pub(super) fn m18_timeouts(&mut self, w: &World) -> Result<(), Violation> {
        if w.mill.is_none() {
            return Ok(());
        }
        if self.timeouts_inc != w.mill_inc {
            self.timeouts_inc = w.mill_inc;
            for (start, _) in self.timeouts.values_mut() {
                *start = (*start).max(w.now);
            }
        }
        let now = w.now;
        let due: Vec<JobId> = self
            .timeouts
            .iter()
            .filter(|(_, (start, t))| now > start.saturating_add(*t).saturating_add(5 * SEC))
            .map(|(j, _)| *j)
            .collect();
        for job in due {
            let Some((start, t)) = self.timeouts.remove(&job) else {
                continue;
            };
            if self.terminals.contains_key(&job) {
                continue;
            }
            let state = w.mill_store.jobs.get(&job).map(|r| r.state.clone());
            match state {
                Some(JobState::Queued) => {
                    return fail(
                        "I11",
                        format!(
                            "{job}: its timeout ({}) ran out at {} while it was queued, yet it is still queued (M18)",
                            secs(t),
                            secs(start + t)
                        ),
                    );
                }
                Some(before @ (JobState::Reserved { .. } | JobState::Running { .. })) => {
                    self.cancel_accepted(w, job, Some(before));
                }
                Some(JobState::Done(_)) | None => {}
            }
        }
        Ok(())
    }

    /// Every seat an executor has reserved is known to the mill: as an ask of a live bid
    /// round, a stray (an ask whose round is over, released when its answer or deadline
    /// comes), or a lease of that node (M12, M16). Checked on every sample while the mill
    /// is up, for honest executors. Excused, because the seat is already being let go:
    /// - the mill sent `ReleaseLease` or `CancelAttempt` for it (in flight, or lost with its
    ///   connection: the next snapshot reports it and M8 cancels it, or its ttl ends it, E3);
    /// - the `ReserveSeat` went out on a connection the mill no longer has open, or from a
    ///   mill that crashed since: asks are volatile and die with the session (M8 cancels
    ///   what the next snapshot reports; the ttl, at most `reconnect_grace`, bounds it).
    ///
    /// What is left is a mill that forgot a reservation on a live session without telling
    /// the executor: a seat held for nothing until its ttl runs out.
    pub(super) fn reservations_known(&self, w: &World) -> Result<(), Violation> {
        let Some(m) = &w.mill else {
            return Ok(());
        };
        for (i, p) in w.execs.iter().enumerate() {
            let Some(x) = &p.exec else {
                continue;
            };
            if !p.honest() {
                continue;
            }
            // A lease waiting for a seat (E16) is a reservation the mill must know too.
            for lease in x.reserved_leases().chain(x.queued_leases()) {
                let asked_here = w.leases.get(&lease).is_some_and(|l| l.exec == i);
                // A deposed mill that still runs knows what it asked (DESIGN §10).
                let by_deposed = w.deposed.as_ref().is_some_and(|d| {
                    (d.mill.is_ask(lease) && asked_here)
                        || d.mill.stray(lease) == Some(&p.node)
                        || d.mill.lease_node(lease) == Some(&p.node)
                });
                let known = (m.is_ask(lease) && asked_here)
                    || m.stray(lease) == Some(&p.node)
                    || m.lease_node(lease) == Some(&p.node)
                    || by_deposed;
                if known || self.let_go.contains(&lease) {
                    continue;
                }
                let Some(&(conn, inc)) = self.ask_conn.get(&lease) else {
                    return fail(
                        "reservations-known",
                        format!("x{i} holds a seat for {lease}, which the mill never asked of it"),
                    );
                };
                let live = inc == w.mill_inc && w.net.conns.get(&conn).is_some_and(|c| c.mill_open);
                if live {
                    return fail(
                        "reservations-known",
                        format!(
                            "x{i} holds a seat for {lease} (asked on {conn}, still open), but the mill knows it as no ask, stray or lease and never released it (M12)"
                        ),
                    );
                }
            }
        }
        Ok(())
    }
}
