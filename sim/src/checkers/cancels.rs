//! I11, cancels take effect: an accepted cancel is sent, delivered and stops the engine run
//! within its bounds, or the teardown deadline ends it (moved out of `checkers.rs` unchanged,
//! issue 17 item 3).

use super::*;

impl Checker {
    /// A client's cancel of `job` was answered Ok by a mill that did not crash in that step;
    /// `before` is the job's state just before the cancel (I11).
    ///
    /// The time bound, when the node was connected and ready at `at` (the mill sends the
    /// `CancelAttempt` at once, M26): if the session stays up, the ack came back within
    /// `cancel_ack_timeout` (else the mill closes the session), so the executor received
    /// the cancel by `at + cancel_ack_timeout` and asked its engine to stop in that same
    /// step (E7); an engine honouring `StopJob` ends within the executor's `stop_grace`.
    /// Hence `deadline = at + cancel_ack_timeout + stop_grace`, checked while one of the
    /// node's connections that were live at `at` is still open at both ends. If the node is
    /// cut off instead, the mill ends the lease at grace expiry (M5, Cancelled) and I1's
    /// ended-lease bound (E12: `reconnect_grace + silence_timeout` + slack) applies.
    pub fn cancel_accepted(&mut self, w: &World, job: JobId, before: Option<JobState>) {
        let target = match &before {
            Some(JobState::Reserved { lease, node } | JobState::Running { lease, node }) => {
                exec_index(w, node).map(|e| (e, *lease))
            }
            _ => None,
        };
        let mut deadline = None;
        let mut teardown = None;
        if let (Some((exec, lease)), Some(m)) = (target, &w.mill) {
            let p = &w.execs[exec];
            let epoch = self.leases.get(&lease).map(|r| r.epoch);
            // The mill sends the cancel at once when the node's session is connected and
            // recovered (M26); `ready` would also demand no pending cancel, which this very
            // cancel has just made true.
            let ready = m
                .session_views()
                .any(|v| v.node == &p.node && v.connected && !v.in_grace && Some(v.epoch) == epoch);
            let conns: Vec<ConnId> = w
                .net
                .conns
                .iter()
                .filter(|(_, c)| {
                    c.exec == exec && c.mill_open && c.exec_open && c.mill_inc == w.mill_inc
                })
                .map(|(id, _)| *id)
                .collect();
            if ready && !conns.is_empty() {
                let bound = dur(w.mill_cfg.cancel_ack_timeout) + dur(p.cfg.stop_grace);
                // The teardown deadline is a timer of the mill's: a lagging driver may
                // handle it up to its lag late (I12), inside the slack.
                let end = dur(w.mill_cfg.cancel_ack_timeout)
                    + dur(w.mill_cfg.cancel_teardown_timeout)
                    + 5 * SEC;
                teardown = Some((w.now + end, conns.clone()));
                deadline = Some((w.now + bound, conns));
            }
        }
        self.cancels.entry(job).or_insert(CancelRec {
            at: w.now,
            mill_inc: w.mill_inc,
            target,
            deadline,
            teardown,
        });
    }

    /// Takes the I11 deadlines (`which` of each cancel) that `now` has passed.
    pub(super) fn take_due(
        &mut self,
        now: Micros,
        which: fn(&mut CancelRec) -> &mut Option<Due>,
    ) -> Vec<(JobId, Micros, Vec<ConnId>)> {
        let mut due = Vec::new();
        for (job, c) in &mut self.cancels {
            let slot = which(c);
            if slot.as_ref().is_some_and(|(d, _)| now > *d) {
                if let Some((d, conns)) = slot.take() {
                    due.push((*job, d, conns));
                }
            }
        }
        due
    }

    /// I11 with M26's teardown deadline: a cancel accepted while the job's node was
    /// connected and ready ends the job in the mill's books within `cancel_ack_timeout +
    /// cancel_teardown_timeout` (+ slack for a lagging driver) as long as that connection
    /// stays open and the mill does not restart — even when the engine never stops (a kill
    /// that does not take): the user's cancel must not wait on a stuck process.
    pub(super) fn i11_teardown_bound(&mut self, w: &World) -> Result<(), Violation> {
        for (job, deadline, conns) in self.take_due(w.now, |c| &mut c.teardown) {
            let Some(c) = self.cancels.get(&job) else {
                continue;
            };
            if c.mill_inc != w.mill_inc
                || self.terminals.contains_key(&job)
                || !still_connected(w, &conns)
            {
                continue;
            }
            return fail(
                "I11",
                format!(
                    "{job}: cancel accepted at {} (leased as {:?}), node connected throughout, yet the mill has recorded no terminal by {} (M26: cancel_ack_timeout + cancel_teardown_timeout)",
                    secs(c.at),
                    c.target,
                    secs(deadline)
                ),
            );
        }
        Ok(())
    }

    /// I11 with M26's "a cancel for a disconnected node is sent when its session becomes
    /// ready": once the mill has reconciled the job's node on a connection (same epoch as
    /// the lease; a restored mill too, M29), a `CancelAttempt` for the lease has gone out
    /// on that connection — unless the lease has ended, or the executor already received
    /// the cancel on an earlier connection (it is stopping the job; E7).
    pub(super) fn i11_cancel_sent(&mut self, w: &World) -> Result<(), Violation> {
        let Some(m) = &w.mill else {
            return Ok(());
        };
        for (job, c) in &self.cancels {
            let Some((exec, lease)) = c.target else {
                continue;
            };
            // Across a mill restart too: the cancel is durable and the restored mill sends it
            // again at reconcile (M29).
            if self.terminals.contains_key(job) || self.cancel_seen.contains_key(&(exec, lease)) {
                continue;
            }
            let p = &w.execs[exec];
            let live = w
                .mill_store
                .leases
                .get(&lease)
                .is_some_and(|l| l.node == p.node);
            let Some(epoch) = self.leases.get(&lease).map(|r| r.epoch) else {
                continue;
            };
            if !live {
                continue;
            }
            let Some(v) = m.session_views().find(|v| v.node == &p.node) else {
                continue;
            };
            let (Some(conn), true) = (v.conn, v.reconciled) else {
                continue;
            };
            if v.epoch != epoch || self.cancel_sent.get(&lease) == Some(&conn) {
                continue;
            }
            return fail(
                "I11",
                format!(
                    "{job}: cancel accepted at {} for {lease} on x{exec}; the mill reconciled x{exec} on {conn} but sent no CancelAttempt there (M26: a cancel waiting for its node goes out when the session is ready)",
                    secs(c.at)
                ),
            );
        }
        Ok(())
    }

    /// Executor `exec` received a `CancelAttempt` for `lease` (I11).
    pub fn cancel_delivered(&mut self, exec: usize, lease: LeaseId, now: Micros) {
        self.cancel_seen.entry((exec, lease)).or_insert(now);
    }

    /// I11's time bound (see [`Checker::cancel_accepted`]): past the deadline, an engine
    /// still runs the cancelled job although the node stayed connected. An engine that
    /// ignores stops (`slow_stop`: it models a kill that does not take) is left to M26's
    /// teardown deadline and I1's bound.
    pub(super) fn i11_stop_bound(&mut self, w: &World) -> Result<(), Violation> {
        self.i11_teardown_bound(w)?;
        for (job, deadline, conns) in self.take_due(w.now, |c| &mut c.deadline) {
            let Some(c) = self.cancels.get(&job) else {
                continue;
            };
            let (at, target) = (c.at, c.target);
            if !still_connected(w, &conns) {
                continue;
            }
            let Some(runs) = self.job_runs.get(&job) else {
                continue;
            };
            for lease in runs {
                let r = &self.runs[lease];
                if r.exited.is_some() {
                    continue;
                }
                let hung = w.execs[r.exec].engine.get(lease).is_some_and(|e| e.hung);
                if hung {
                    continue;
                }
                let seen = self
                    .cancel_seen
                    .get(&(r.exec, *lease))
                    .map_or("never".to_string(), |t| secs(*t));
                return fail(
                    "I11",
                    format!(
                        "{job}: cancel accepted at {} (leased as {target:?}), node connected throughout, yet x{} still runs it under {lease} past {} (cancel_ack_timeout + stop_grace); the cancel reached x{} {seen}",
                        secs(at),
                        r.exec,
                        secs(deadline),
                        r.exec
                    ),
                );
            }
        }
        Ok(())
    }
}
