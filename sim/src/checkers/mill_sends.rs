//! What the mill sends: placement asks in owner order (M33), seats taken up, direct asks (M35),
//! the deposed mill's sends (E13), persist-before-send, and what the mill observes of
//! quarantine (I8) and violations (moved out of `checkers.rs` unchanged, issue 17 item 3).

use super::*;

impl Checker {
    /// M33: the asks of one mill step (`ReserveSeat`s, direct or not), judged before its
    /// outputs go out, in the order the mill decided them: by lease id, which it allocates
    /// in that order (M30). Output order is not decision order: an early ask (M12) leads
    /// the step's `Persist` while a direct ask (M35) decided before it follows it. Judged
    /// whatever connection each goes out on: the mill chose the job.
    pub fn step_asks(&mut self, asks: &mut [(LeaseId, JobId, &JobSpec)]) -> Result<(), Violation> {
        asks.sort_by_key(|a| a.0);
        for (_, job, spec) in asks.iter() {
            let inserted = self.inserted.contains(job);
            self.order.asked(*job, spec, inserted)?;
        }
        Ok(())
    }

    /// M33: jobs a mill step took up without an ask, before its asks are judged: ended by
    /// the step (a direct placement's quota denial, M35) or sent to wait for quota (the mill
    /// observes `QuotaWait`; M35 asks quota before any seat). They are never passed over.
    pub fn taken_up(&mut self, jobs: &[JobId]) {
        for job in jobs {
            self.order.ended(*job);
        }
    }

    /// A deposed mill (DESIGN §10) sent `msg` on `conn`, one of the connections of its
    /// incarnation `inc`: its asks and releases are known, as the leader's are.
    pub fn deposed_send(&mut self, conn: ConnId, msg: &ToExecutor, inc: u32) {
        match msg {
            ToExecutor::ReserveSeat { lease, .. } => {
                self.ask_conn.insert(*lease, (conn, inc));
            }
            ToExecutor::ReleaseLease { lease, .. } => {
                self.let_go.insert(*lease);
            }
            ToExecutor::Welcome { .. }
            | ToExecutor::Refused { .. }
            | ToExecutor::CommitLease { .. }
            | ToExecutor::CancelAttempt { .. }
            | ToExecutor::Ack { .. } => {}
        }
    }

    /// A message the mill sends, after the step's `Persist` was applied (persist before
    /// send; I4, I7, I8, M16, M30).
    pub fn mill_send(
        &mut self,
        w: &World,
        conn: ConnId,
        msg: &ToExecutor,
    ) -> Result<(), Violation> {
        // M35: a direct ask's commit follows it on its connection before anything else.
        if let Some((due_conn, due)) = self.direct_due {
            if due_conn == conn {
                match msg {
                    ToExecutor::CommitLease { lease, .. } if *lease == due => {
                        self.direct_due = None;
                    }
                    other => {
                        return fail(
                            "M35",
                            format!(
                                "ReserveSeat{{direct}} {due} on {conn} was followed by {} instead of its CommitLease",
                                describe_down(other)
                            ),
                        );
                    }
                }
            }
        }
        let Some(exec) = w.exec_of_conn(conn) else {
            return Ok(());
        };
        let p = &w.execs[exec];
        match msg {
            ToExecutor::ReserveSeat {
                lease,
                job,
                spec,
                direct,
                ..
            } => {
                if *direct {
                    self.direct_ask(w, exec, conn, *lease, *job, spec)?;
                }
                if *lease >= w.mill_store.lease_floor {
                    return fail(
                        "persist-before-send",
                        format!(
                            "ReserveSeat {lease} sent above the durable lease floor {} (M30)",
                            w.mill_store.lease_floor
                        ),
                    );
                }
                if let Some(old) = w.leases.get(lease) {
                    return fail(
                        "I1",
                        format!(
                            "lease id {lease} asked twice: {} of x{} and {job} of x{exec} (M30)",
                            old.job, old.exec
                        ),
                    );
                }
                if self.quarantined.contains(&p.node) {
                    return fail(
                        "I8",
                        format!("quarantined {} asked to reserve {lease} for {job}", p.node),
                    );
                }
                compatible("I7", exec, p, spec, *job)?;
                self.ask_conn.insert(*lease, (conn, w.mill_inc));
            }
            ToExecutor::ReleaseLease { term: _, lease } => {
                self.let_go.insert(*lease);
            }
            ToExecutor::CancelAttempt { lease, .. } => {
                self.let_go.insert(*lease);
                self.cancel_sent.insert(*lease, conn);
                // A cancel of a lease the mill still holds durably (a running lease: a
                // reserved one is deleted before its cancel) is durable first (M26, M29).
                let undurable = w
                    .mill_store
                    .leases
                    .get(lease)
                    .is_some_and(|l| l.node == p.node && l.cancel.is_none());
                if undurable {
                    return fail(
                        "persist-before-send",
                        format!(
                            "CancelAttempt {lease} to x{exec} before the cancel was durable (M26, M29)"
                        ),
                    );
                }
            }
            ToExecutor::CommitLease { lease, .. } => {
                let stored = w
                    .mill_store
                    .leases
                    .get(lease)
                    .is_some_and(|l| l.node == p.node);
                if !stored {
                    return fail(
                        "persist-before-send",
                        format!(
                            "CommitLease {lease} to x{exec} before the lease was durable (M16)"
                        ),
                    );
                }
                if self.quarantined.contains(&p.node) {
                    return fail(
                        "I8",
                        format!("quarantined {} sent CommitLease {lease}", p.node),
                    );
                }
            }
            ToExecutor::Ack {
                term: _,
                epoch,
                up_to,
            } => {
                let durable = self.cursor(exec, *epoch);
                if *up_to > durable {
                    return fail(
                        "I4",
                        format!("Ack ({}, {epoch}) up to {up_to} exceeds the durable cursor {durable} (M23)", p.node),
                    );
                }
            }
            ToExecutor::Welcome { cursor, .. } => {
                let durable = w
                    .mill_store
                    .cursors
                    .iter()
                    .filter(|((n, _), _)| *n == p.node)
                    .map(|(_, s)| *s)
                    .max()
                    .unwrap_or_default();
                if *cursor > durable {
                    return fail(
                        "I4",
                        format!(
                            "Welcome to {} with cursor {cursor} beyond every durable cursor",
                            p.node
                        ),
                    );
                }
            }
            ToExecutor::Refused { .. } => {}
        }
        Ok(())
    }

    /// M35: a `ReserveSeat{direct}`: published first (M16: its commit follows at once),
    /// holding quota for exactly the standard charge (E2, M15), and the step's previous
    /// direct ask already followed by its commit.
    pub(super) fn direct_ask(
        &mut self,
        w: &World,
        exec: usize,
        conn: ConnId,
        lease: LeaseId,
        job: JobId,
        spec: &JobSpec,
    ) -> Result<(), Violation> {
        let p = &w.execs[exec];
        match w.mill_store.leases.get(&lease) {
            Some(l) if l.node == p.node && l.job == job => {
                if l.resources != spec.seat_charge() {
                    return fail(
                        "M35",
                        format!(
                            "direct ask {lease} for {job} published with charge {:?}, not the standard charge {:?} (E2)",
                            l.resources,
                            spec.seat_charge()
                        ),
                    );
                }
            }
            _ => {
                return fail(
                    "persist-before-send",
                    format!(
                        "ReserveSeat{{direct}} {lease} to x{exec} before its lease was durable (M35, M16)"
                    ),
                );
            }
        }
        if let Some((c, l)) = self.direct_due {
            return fail(
                "M35",
                format!("direct ask {l} on {c} not followed by its CommitLease before direct ask {lease}"),
            );
        }
        self.direct_asks.insert(lease);
        self.direct_due = Some((conn, lease));
        Ok(())
    }

    /// A mill step's outputs are all out (`crashed`: the step was cut short by a crash).
    /// M35: a direct ask's commit went out in the same step, unless a crash cut it off.
    pub fn mill_step_end(&mut self, crashed: bool) -> Result<(), Violation> {
        match self.direct_due.take() {
            Some((conn, lease)) if !crashed => fail(
                "M35",
                format!("ReserveSeat{{direct}} {lease} on {conn} without its CommitLease in the same step"),
            ),
            _ => Ok(()),
        }
    }

    /// The mill quarantined `node` (seen in its output order).
    pub fn quarantine_observed(&mut self, node: &NodeId) {
        self.quarantined.insert(node.clone());
    }

    /// The mill observed a violation by `node` (M28).
    pub fn violation_observed(&mut self, node: &NodeId, kind: ViolationKind) {
        if self.byz_pending.is_some() {
            self.step_violations.push((node.clone(), kind));
        }
    }

    /// The mill closed `conn`.
    pub fn mill_closed(&mut self, conn: ConnId) {
        if self.byz_pending.is_some() {
            self.step_closed.push(conn);
        }
    }
}
