//! The mill's durable writes (`Persist`): one terminal per accepted job that never changes
//! (I2), each engine attempt and lease verdict (I1, I3), results recorded as reported (I3), and
//! the terminals of cancelled jobs (I11) (moved out of `checkers.rs` unchanged, issue 17 item
//! 3).

use super::*;

impl Checker {
    /// A mill `Persist`, already applied to its store (I1, I2, I3, I4, I5, I8).
    pub fn mill_persist(
        &mut self,
        w: &World,
        batch: &MillBatch,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        for write in &batch.writes {
            match write {
                MillWrite::JobInsert { job, record } => {
                    if !self.inserted.insert(*job) {
                        return fail("I2", format!("job id {job} inserted twice"));
                    }
                    let timeout = record.spec.timeout.unwrap_or(w.mill_cfg.job_timeout);
                    self.attempts.insert(
                        *job,
                        Attempts {
                            policy: record.spec.retry.clone(),
                            timeout_at: w.now.saturating_add(dur(timeout)),
                            ..Attempts::default()
                        },
                    );
                    self.queued_since.insert(*job, (w.now, false));
                    self.order.inserted(*job, &record.spec);
                }
                MillWrite::KeyInsert { key, record } => {
                    // M31 with M29: a key is durable in its job's insert batch, never
                    // without it, and never maps a second job.
                    let with_job = batch.writes.iter().any(
                        |w| matches!(w, MillWrite::JobInsert { job, .. } if *job == record.job),
                    );
                    if !with_job {
                        return fail(
                            "I2",
                            format!(
                                "key {key} persisted for {} outside its job's insert batch (M31)",
                                record.job
                            ),
                        );
                    }
                    if let Some(old) = self.keys.insert(key.clone(), record.job) {
                        return fail(
                            "I2",
                            format!("key {key} mapped {old}, then {} (M31)", record.job),
                        );
                    }
                }
                MillWrite::JobState { job, state } => {
                    if let Some(t) = self.terminals.get(job) {
                        return fail(
                            "I2",
                            format!(
                                "{job} changed to {} after its terminal {} was recorded",
                                state.name(),
                                t.status
                            ),
                        );
                    }
                    if let JobState::Done(t) = state {
                        self.job_done(w, *job, t, ctx)?;
                    }
                }
                MillWrite::LeaseUpsert(r) => {
                    if let Some(q) = self.queued_since.get_mut(&r.job) {
                        q.1 = true;
                    }
                    let exec = exec_index_at(w, &r.node, r.epoch);
                    if let Some(old) = self.leases.get(&r.lease) {
                        if old.job != r.job || old.exec != exec {
                            return fail(
                                "I1",
                                format!(
                                    "lease {} reused: {}@x{:?} then {}@{} (M30)",
                                    r.lease, old.job, old.exec, r.job, r.node
                                ),
                            );
                        }
                        continue;
                    }
                    if let Some(&other) = self.lease_of_job.get(&r.job) {
                        if other != r.lease {
                            return fail(
                                "I1",
                                format!(
                                    "{} holds two leases at once: {other} and {} (on {})",
                                    r.job, r.lease, r.node
                                ),
                            );
                        }
                    }
                    if let Some(info) = w.leases.get(&r.lease) {
                        // By node id: a twin process that legitimately took over a dead
                        // process's node id (M2) is asked under that id (twin seed 7000631).
                        let same_node = w.execs.get(info.exec).is_some_and(|p| p.node == r.node);
                        if info.job != r.job || !same_node {
                            return fail(
                                "I1",
                                format!(
                                    "lease {} stored for {}@{} but was asked for {} of x{}",
                                    r.lease, r.job, r.node, info.job, info.exec
                                ),
                            );
                        }
                    }
                    self.fences.remove(&r.job);
                    if let Some(a) = self.attempts.get_mut(&r.job) {
                        // M32: attempt numbers only move forward, one per lease.
                        if r.attempt != a.last.saturating_add(1) {
                            return fail(
                                "I2",
                                format!(
                                    "{} got {} as attempt {}, after attempt {} (M32: one more per lease)",
                                    r.job, r.lease, r.attempt, a.last
                                ),
                            );
                        }
                        a.last = r.attempt;
                        a.leases.insert(r.lease, r.attempt);
                    }
                    let charge = self.charge_quota(w, r)?;
                    self.leases.insert(
                        r.lease,
                        LeaseRec {
                            job: r.job,
                            exec,
                            epoch: r.epoch,
                            charge,
                        },
                    );
                    self.lease_of_job.insert(r.job, r.lease);
                }
                MillWrite::LeaseDelete { lease } => {
                    if let Some(rec) = self.leases.get_mut(lease) {
                        if self.lease_of_job.get(&rec.job) == Some(lease) {
                            self.lease_of_job.remove(&rec.job);
                        }
                        for (key, amount) in std::mem::take(&mut rec.charge) {
                            if let Some(u) = self.tally.usage.get_mut(&key) {
                                *u = u.saturating_sub(amount);
                            }
                        }
                    }
                    self.ended.entry(*lease).or_insert(w.now);
                }
                MillWrite::Cursor { node, epoch, seqno } => {
                    self.cursor_advanced(w, node, *epoch, *seqno, ctx)?;
                }
                MillWrite::CursorDelete { node, epoch } => {
                    self.cursor_forgotten(w, node, *epoch)?;
                }
                MillWrite::Quarantine { node, quarantined } => {
                    if *quarantined {
                        self.quarantined.insert(node.clone());
                    } else {
                        self.quarantined.remove(node);
                    }
                }
                MillWrite::Attempt(end) => self.attempt_ended(w, end, ctx)?,
                MillWrite::LeaseCancel { lease, .. } => {
                    let job = self.leases.get(lease).map(|r| r.job);
                    if let Some(a) = job.and_then(|j| self.attempts.get_mut(&j)) {
                        a.cancel_durable = true;
                    }
                }
                MillWrite::Counters { .. }
                | MillWrite::QuotaRelease { .. }
                | MillWrite::QuotaHold { .. } => {}
            }
        }
        Ok(())
    }

    /// A snapshot of `exec` reached the mill at `now` reporting `active` (M32: an ended
    /// lease it still reports is evidence its run lives).
    pub fn snapshot_received(&mut self, now: Micros, active: &[LeaseId], retry_fence: Micros) {
        for lease in active {
            if self.ended.contains_key(lease) {
                self.reported_alive.insert(*lease, now);
                // The mill holds a fenced retry while its old run is reported (M32).
                let job = self.leases.get(lease).map(|r| r.job);
                if let Some(until) = job.and_then(|j| self.fences.get_mut(&j)) {
                    *until = (*until).max(now.saturating_add(retry_fence));
                }
            }
        }
    }

    /// M32: an attempt's end as persisted: of a lease of that attempt, once; a retry only
    /// for an end the job's policy retries and only while retries are left; an end the
    /// policy would retry, with retries left, never ends the job. A retried end gets the
    /// same I3 checks as a terminal.
    pub(super) fn attempt_ended(
        &mut self,
        w: &World,
        end: &AttemptEnd,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        let job = end.job;
        let Some(a) = self.attempts.get_mut(&job) else {
            return fail(
                "I2",
                format!("attempt end persisted for {job}, never inserted"),
            );
        };
        if a.leases.get(&end.lease) != Some(&end.attempt) {
            return fail(
                "I2",
                format!(
                    "{job}: attempt {} ended under {}, which is not that attempt's lease (M32)",
                    end.attempt, end.lease
                ),
            );
        }
        if !a.ended.insert(end.lease) {
            return fail(
                "I2",
                format!(
                    "{job}: attempt {} under {} ended twice",
                    end.attempt, end.lease
                ),
            );
        }
        let retryable = end
            .status
            .is_some_and(|st| a.policy.retries_on(st, end.cause));
        match end.outcome {
            AttemptOutcome::Retried { .. } => {
                if !retryable {
                    return fail(
                        "I2",
                        format!(
                            "{job}: attempt {} ended {:?} {:?} and was retried, which its policy {:?} does not allow (M32)",
                            end.attempt, end.status, end.cause, a.policy
                        ),
                    );
                }
                a.retried += 1;
                if matches!(end.outcome, AttemptOutcome::Retried { fenced: true }) {
                    self.fences.insert(job, w.now.saturating_add(fence_len(w)));
                }
                if a.retried > a.policy.retries {
                    return fail(
                        "I2",
                        format!(
                            "{job}: retried {} times, its policy allows {} (M32)",
                            a.retried, a.policy.retries
                        ),
                    );
                }
                let t = Terminal {
                    status: end.status.unwrap_or(TerminalStatus::Failed),
                    cause: end.cause,
                    exit_code: end.exit_code,
                    error: end.error.clone(),
                    log: None,
                    node: self
                        .leases
                        .get(&end.lease)
                        .and_then(|r| r.exec)
                        .and_then(|x| w.execs.get(x))
                        .map(|p| p.node.clone()),
                    lease: Some(end.lease),
                };
                let exec = self
                    .runs
                    .get(&end.lease)
                    .map(|r| r.exec)
                    .or_else(|| t.node.as_ref().and_then(|n| exec_index(w, n)));
                self.lease_verdict(w, job, &t, exec, ctx)?;
            }
            AttemptOutcome::Final
                if retryable
                    && a.retried < a.policy.retries
                    && !self.cancels.contains_key(&job)
                    && !a.cancel_durable
                    && w.now < a.timeout_at =>
            {
                return fail(
                    "I2",
                    format!(
                        "{job}: attempt {} ended {:?} {:?} and ended the job with {} of {} retries left (M32)",
                        end.attempt,
                        end.status,
                        end.cause,
                        a.policy.retries - a.retried,
                        a.policy.retries
                    ),
                );
            }
            AttemptOutcome::Final | AttemptOutcome::Released => {}
        }
        Ok(())
    }

    /// I2, I3 for a recorded terminal.
    pub(super) fn job_done(
        &mut self,
        w: &World,
        job: JobId,
        t: &Terminal,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        self.terminals.insert(job, t.clone());
        self.order.ended(job);
        if !self.inserted.contains(&job) {
            return fail("I2", format!("terminal recorded for {job}, never inserted"));
        }
        let queued = self.queued_since.remove(&job);
        if t.cause == Some(TerminalCause::QueueTimeout) {
            let bound = dur(w.mill_cfg.queue_timeout);
            match queued {
                Some((_, true)) => {
                    return fail(
                        "I2",
                        format!("{job} ended by its queue timeout, yet a lease of it was written"),
                    );
                }
                Some((since, false)) if w.now < since.saturating_add(bound) => {
                    return fail(
                        "I2",
                        format!(
                            "{job} ended by its queue timeout at {}, submitted at {}: before queue_timeout {}",
                            secs(w.now),
                            secs(since),
                            secs(bound)
                        ),
                    );
                }
                _ => {}
            }
        }
        // The process that ran the lease (a twin that took over a dead process's node id has
        // its own index, M2), else the node id's first process.
        let exec = t
            .lease
            .and_then(|l| self.runs.get(&l))
            .map(|r| r.exec)
            .or_else(|| t.node.as_ref().and_then(|n| exec_index(w, n)));
        if t.status == TerminalStatus::Success {
            // Judged by node id: a twin that took over a dead process's node id (M2) ran it
            // under that id (twin seed 7000631).
            let ok = t.lease.and_then(|l| self.runs.get(&l)).is_some_and(|r| {
                r.job == job
                    && t.node.as_ref() == w.execs.get(r.exec).map(|p| &p.node)
                    && r.exited.is_some_and(|(_, s)| s)
            });
            if !ok {
                return fail(
                    "I2",
                    format!(
                        "{job} recorded Success under {:?} on {:?}, but no engine completed it there",
                        t.lease, t.node
                    ),
                );
            }
        }
        self.i11_terminal(w, job, t, exec)?;
        self.lease_verdict(w, job, t, exec, ctx)
    }

    /// I3 for how a lease ended, whether that ended its job or started a retry (M32): a
    /// result the mill applied is the one recorded, a reported terminal keeps the engine's
    /// status, and "executor lost" is never the verdict on a result the executor had
    /// durable and delivered.
    pub(super) fn lease_verdict(
        &mut self,
        w: &World,
        job: JobId,
        t: &Terminal,
        exec: Option<usize>,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        let (Some(lease), Some(exec)) = (t.lease, exec) else {
            return Ok(());
        };
        self.i3_applied_result(w, job, t, exec, lease, ctx)?;
        // I3: a terminal the executor reported is recorded with the engine's status.
        if let StepKind::Batch { exec: from, .. } = ctx.kind {
            if from == exec && w.execs[exec].honest() {
                let reported = ctx
                    .events
                    .iter()
                    .find(|e| e.lease == lease)
                    .and_then(|e| e.terminal);
                if let Some((status, exit_code, cause)) = reported {
                    if !recorded_as_reported(status, exit_code, cause, t) {
                        return fail(
                            "I3",
                            format!(
                                "{job} under {lease}: x{exec} reported {status} {exit_code:?}, mill recorded {} {:?}",
                                t.status, t.exit_code
                            ),
                        );
                    }
                }
            }
        }
        let error = t.error.as_deref().unwrap_or("");
        // The mill's own verdicts (M5, M8), by cause, never by text; the executor's own
        // verdicts (E9 `ExecutorRestarted`, E12 `LostContact`) are results it reported.
        let lost = matches!(
            t.cause,
            Some(
                TerminalCause::ExecutorLost
                    | TerminalCause::ExecutorReplaced
                    | TerminalCause::NoLongerHasJob
            )
        );
        if !lost || !w.execs[exec].honest() {
            return Ok(());
        }
        // I3 (M8): a snapshot that reports the lease must not fail it.
        if let StepKind::Snapshot { exec: from } = ctx.kind {
            if from == exec && ctx.active.contains(&lease) {
                return fail(
                    "I3",
                    format!("{job}: x{exec}'s snapshot reported {lease}, yet the mill failed it ({error})"),
                );
            }
        }
        // I3: the result was durable at the executor, and the executor was back (its snapshot
        // reached the mill on a session still open), yet the mill recorded it lost.
        let p = &w.execs[exec];
        let Some(rec) = self.leases.get(&lease) else {
            return Ok(());
        };
        if p.store.epoch != rec.epoch {
            return Ok(());
        }
        let Some(persisted) = self.results.get(&(exec, rec.epoch, lease)).map(|r| r.at) else {
            return Ok(());
        };
        let Some((conn, at)) = w.snapshot_delivered[exec] else {
            return Ok(());
        };
        let live = w
            .net
            .conns
            .get(&conn)
            .is_some_and(|c| c.mill_open && c.exec_open);
        if live && at >= persisted && p.store.outbox.iter().any(|e| e.lease == lease) {
            return fail(
                "I3",
                format!(
                    "{job} under {lease}: x{exec} persisted its result at {} and reconnected (snapshot on {conn} at {}), yet the mill recorded {error:?}",
                    secs(persisted),
                    secs(at)
                ),
            );
        }
        Ok(())
    }

    /// I3: once the mill has applied an executor's terminal for a lease (the cursor of its
    /// (node, epoch) covers the event's seqno), the job's recorded terminal under that lease
    /// is the one the executor sent: a later verdict of the mill's own ("executor lost",
    /// a teardown deadline) may not replace a result it already holds. A Cancelled result
    /// may be recorded as Timeout (M18 cancels through the same path).
    pub(super) fn i3_applied_result(
        &self,
        w: &World,
        job: JobId,
        t: &Terminal,
        exec: usize,
        lease: LeaseId,
        ctx: &StepCtx,
    ) -> Result<(), Violation> {
        if !w.execs[exec].honest() {
            return Ok(());
        }
        let Some(epoch) = self.runs.get(&lease).map(|r| r.epoch) else {
            return Ok(());
        };
        let Some(r) = self.results.get(&(exec, epoch, lease)) else {
            return Ok(());
        };
        let mut applied = self.cursor(exec, epoch);
        if let StepKind::Batch {
            exec: from,
            epoch: e,
        } = ctx.kind
        {
            if from == exec && e == epoch {
                if let Some(last) = ctx.events.iter().map(|e| e.seqno).max() {
                    applied = applied.max(last);
                }
            }
        }
        if r.seqno > applied {
            return Ok(());
        }
        if !recorded_as_reported(r.status, r.exit_code, r.cause, t) {
            return fail(
                "I3",
                format!(
                    "{job} under {lease}: x{exec} {epoch} persisted {} {:?} at {} (seqno {}, applied: cursor {applied}), yet the mill recorded {} {:?} ({})",
                    r.status,
                    r.exit_code,
                    secs(r.at),
                    r.seqno,
                    t.status,
                    t.exit_code,
                    t.error.as_deref().unwrap_or("")
                ),
            );
        }
        Ok(())
    }

    /// I11: a job whose cancel the mill accepted ends Cancelled (or Timeout, when the mill's
    /// own M18 cancel was first), unless the executor persisted its own terminal for the
    /// lease before the `CancelAttempt` reached it (the engine's result raced the cancel).
    ///
    /// Held in full, across mill restarts (the accepted cancel is durable, M29) and executor
    /// restarts (the stop is durable before the ack, E7). An executor's own verdict, E9's
    /// restart or E12's self-fencing (known by cause, never by text), is never excused: it
    /// is no engine result, so the mill, which holds the cancel, records the cancel (M26).
    pub(super) fn i11_terminal(
        &self,
        w: &World,
        job: JobId,
        t: &Terminal,
        exec: Option<usize>,
    ) -> Result<(), Violation> {
        let Some(c) = self.cancels.get(&job) else {
            return Ok(());
        };
        if matches!(
            t.status,
            TerminalStatus::Cancelled | TerminalStatus::Timeout
        ) {
            return Ok(());
        }
        if let Some(kind @ (TerminalCause::ExecutorRestarted | TerminalCause::LostContact)) =
            t.cause
        {
            let rule = if kind == TerminalCause::ExecutorRestarted {
                "E9"
            } else {
                "E12"
            };
            return fail(
                "I11",
                format!(
                    "{job}: cancel accepted at {} (mill incarnation {}, now {}), yet the mill recorded the executor's own verdict ({kind}, {rule}) {} under {:?} on {:?}: the cancel it held should have decided the terminal (M26)",
                    secs(c.at),
                    c.mill_inc,
                    w.mill_inc,
                    t.status,
                    t.lease,
                    t.node
                ),
            );
        }
        let own = match (exec, t.lease) {
            (Some(exec), Some(lease)) => self
                .runs
                .get(&lease)
                .and_then(|r| self.results.get(&(exec, r.epoch, lease)))
                .map(|r| (exec, lease, r.at)),
            _ => None,
        };
        if let Some((exec, lease, at)) = own {
            match self.cancel_seen.get(&(exec, lease)) {
                None => return Ok(()),
                Some(&seen) if at <= seen => return Ok(()),
                Some(&seen) => {
                    return fail(
                        "I11",
                        format!(
                            "{job}: cancel accepted at {} (mill incarnation {}), reached x{exec} at {}, yet {lease} ended {} by x{exec}'s terminal of {} (E7: a stop asked for decides the status)",
                            secs(c.at),
                            c.mill_inc,
                            secs(seen),
                            t.status,
                            secs(at)
                        ),
                    );
                }
            }
        }
        fail(
            "I11",
            format!(
                "{job}: cancel accepted at {} (mill incarnation {}, now {}), yet the mill recorded {} {:?} under {:?} on {:?} with no executor terminal before the cancel",
                secs(c.at),
                c.mill_inc,
                w.mill_inc,
                t.status,
                t.error.as_deref().unwrap_or(""),
                t.lease,
                t.node
            ),
        )
    }
}
