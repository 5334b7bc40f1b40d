//! The executors' side: their durable writes and sends (E5 bookkeeping), seats within capacity
//! (I6), and engine runs starting, stopping and exiting (I1, I7) (moved out of `checkers.rs`
//! unchanged, issue 17 item 3).

use super::*;

impl Checker {
    /// An executor `Persist`, applied to its store (E5 bookkeeping).
    pub fn exec_persist(
        &mut self,
        w: &World,
        exec: usize,
        batch: &ExecutorBatch,
    ) -> Result<(), Violation> {
        let epoch = w.execs[exec].store.epoch;
        for write in &batch.writes {
            match write {
                ExecutorWrite::Append(e) => {
                    let h = self.history.entry((exec, epoch)).or_default();
                    if e.seqno.get() != h.len() as u64 + 1 {
                        return fail(
                            "I4",
                            format!(
                                "x{exec} {epoch} appended seqno {} after {} events (E5)",
                                e.seqno,
                                h.len()
                            ),
                        );
                    }
                    h.push(e.clone());
                    if let EventKind::Terminal {
                        status,
                        exit_code,
                        cause,
                        ..
                    } = &e.kind
                    {
                        // E7 at the source: once a cancel reached this executor for the lease
                        // (it survived that step or made the stop durable), the stop decides
                        // the terminal it reports — whatever else (the engine, a fence, a
                        // restart) ended the run since. The mill may map a verdict to the
                        // cancel it holds (M26), which would hide a slip here from I11.
                        let seen = self.cancel_seen.get(&(exec, e.lease)).copied();
                        if let Some(seen) = seen.filter(|s| w.now > *s) {
                            if w.execs[exec].honest() && *status != TerminalStatus::Cancelled {
                                return fail(
                                    "I11",
                                    format!(
                                        "x{exec} reported {} {status} ({cause:?}) at {}, though a cancel reached it at {} (E7: a stop asked for decides the status)",
                                        e.lease,
                                        secs(w.now),
                                        secs(seen)
                                    ),
                                );
                            }
                        }
                        self.results.insert(
                            (exec, epoch, e.lease),
                            ResultRec {
                                at: w.now,
                                seqno: e.seqno,
                                status: *status,
                                exit_code: *exit_code,
                                cause: *cause,
                            },
                        );
                    }
                }
                ExecutorWrite::JobCommitted { lease, .. } => {
                    self.committed.insert((exec, epoch, *lease));
                }
                ExecutorWrite::Trim { .. }
                | ExecutorWrite::JobStopping { .. }
                | ExecutorWrite::JobEnded { .. }
                | ExecutorWrite::Contact { .. }
                | ExecutorWrite::Timers(_)
                | ExecutorWrite::Term(_) => {}
            }
        }
        Ok(())
    }

    /// A message an honest executor sends (before any misbehaviour filter): persist before
    /// send (E4, E5), complete snapshots (I3), seats within capacity (I6).
    pub fn exec_send(&mut self, w: &World, exec: usize, msg: &ToMill) -> Result<(), Violation> {
        let p = &w.execs[exec];
        let epoch = p.store.epoch;
        match msg {
            ToMill::ReserveResult {
                lease,
                accepted: false,
                ..
            } if self.direct_asks.contains(lease) => {
                self.refused_direct.insert((exec, *lease));
            }
            ToMill::EventBatch { epoch: e, events } => {
                let h = self.history.get(&(exec, *e));
                for ev in events {
                    let appended = h.and_then(|h| h.get(ev.seqno.get().wrapping_sub(1) as usize));
                    if appended != Some(ev) {
                        return fail(
                            "persist-before-send",
                            format!(
                                "x{exec} sent event {} of {e} that it had not persisted (E5)",
                                ev.seqno
                            ),
                        );
                    }
                }
            }
            ToMill::CommitResult {
                lease,
                committed: true,
            } if !self.committed.contains(&(exec, epoch, *lease)) => {
                return fail(
                    "persist-before-send",
                    format!("x{exec} answered committed for {lease} without a durable commit (E4)"),
                );
            }
            ToMill::Snapshot {
                active_leases,
                outbox_high,
                ..
            } => {
                let Some(x) = &p.exec else {
                    return Ok(());
                };
                // Since `outbox_high` (DESIGN §3) the snapshot lists only held seats: a lease
                // whose result waits in the outbox is covered by `outbox_high` instead (the mill
                // judges it only once those events are applied).
                // Without the pre-tick (I12) a snapshot of the step's due timers precedes the
                // step's input, which may take a seat after it: owed are the seats held both
                // before and after the step.
                // Checked in full, however many leases there are.
                {
                    let reported = |l: &LeaseId| active_leases.contains(l);
                    let mut owed = x
                        .reserved_leases()
                        .chain(x.running_leases())
                        .chain(x.queued_leases())
                        .filter(|l| p.held_before.contains(l));
                    if let Some(missing) = owed.find(|l| !reported(l)) {
                        return fail(
                            "I3",
                            format!("x{exec}'s snapshot leaves out {missing}, which it holds (M8 would fail it)"),
                        );
                    }
                }
                // Entries the step itself appended may follow its timers' snapshot.
                if let Some(high) = p.outbox_before.filter(|h| h > outbox_high) {
                    return fail(
                        "I3",
                        format!(
                            "x{exec}'s snapshot names outbox_high {outbox_high}, below its outbox entry {high}"
                        ),
                    );
                }
            }
            ToMill::ReserveResult { accepted: true, .. } => self.seats_within_capacity(w, exec)?,
            // E7: the stop of a running job is durable before its ack goes out, so a
            // restart still ends the job Cancelled (E9).
            ToMill::CancelAck { lease }
                if p.store.jobs.get(lease).is_some_and(|j| j.stop.is_none()) =>
            {
                return fail(
                    "persist-before-send",
                    format!("x{exec} acked the cancel of {lease} before its stop was durable (E7)"),
                );
            }
            _ => {}
        }
        Ok(())
    }

    /// I6: reservations + running jobs per engine within capacity, and (M34) what they ask
    /// for within each resource the engine declares.
    pub(super) fn seats_within_capacity(&self, w: &World, exec: usize) -> Result<(), Violation> {
        let p = &w.execs[exec];
        let Some(x) = &p.exec else {
            return Ok(());
        };
        let mut used: BTreeMap<&str, (u32, BTreeMap<&str, u64>)> = BTreeMap::new();
        for lease in x.reserved_leases().chain(x.running_leases()) {
            let info = w.leases.get(&lease);
            let engine = info.map(|i| i.engine.as_str()).unwrap_or("?");
            let (seats, asked) = used.entry(engine).or_default();
            *seats += 1;
            for (name, amount) in info.into_iter().flat_map(|i| &i.resources) {
                let total = asked.entry(name.as_str()).or_insert(0);
                *total = total.saturating_add(*amount);
            }
        }
        for (engine, (n, asked)) in used {
            let cfg = p.cfg.engines.get(engine);
            let cap = cfg.map_or(0, |e| e.capacity);
            if n > cap {
                return fail(
                    "I6",
                    format!("x{exec} holds {n} seats of {engine}, capacity {cap}"),
                );
            }
            // E16: at most `capacity` leases wait for a seat of an engine.
            let waiting = x
                .queued_leases()
                .filter(|l| w.leases.get(l).is_some_and(|i| i.engine == engine))
                .count();
            if waiting > cap as usize {
                return fail(
                    "I6",
                    format!(
                        "x{exec} holds {waiting} leases waiting for {engine}, capacity {cap} (E16)"
                    ),
                );
            }
            for (name, &total) in cfg.into_iter().flat_map(|e| &e.resources) {
                let held = asked.get(name.as_str()).copied().unwrap_or(0);
                if held > total {
                    return fail(
                        "I6",
                        format!(
                            "x{exec}'s {engine} seats hold {held} {name}, {total} declared (E2, M34)"
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// The engine of `exec` is told to start `job` under `lease` (I1, I3, I6, I7, E4).
    ///
    /// I1 counted from engine starts: no retry policy exists yet (M32), so a job has one
    /// attempt and its engine may start once across the whole fleet and every restart of
    /// every process. A second start is a double execution, whether or not the first run
    /// is over (it overlaps, or it already produced a result the mill should have kept, I3).
    pub fn start(
        &mut self,
        w: &World,
        exec: usize,
        lease: LeaseId,
        job: JobId,
        spec: &JobSpec,
    ) -> Result<(), Violation> {
        let p = &w.execs[exec];
        compatible("I7", exec, p, spec, job)?;
        if self.refused_direct.contains(&(exec, lease)) {
            return fail(
                "I1",
                format!(
                    "x{exec} started {job} under {lease}, a direct ask it refused: its commit must find no reservation (M35, E4)"
                ),
            );
        }
        if let Some(run) = self.runs.get(&lease) {
            return fail(
                "I1",
                format!(
                    "{lease} started twice: on x{} at {} and on x{exec} at {} (E4)",
                    run.exec,
                    secs(run.start),
                    secs(w.now)
                ),
            );
        }
        let retries = self.attempts.get(&job).map_or(0, |a| a.policy.retries);
        let earlier = self.job_runs.get(&job).map_or(&[][..], Vec::as_slice);
        if let Some(&first) = earlier.first().filter(|_| earlier.len() > retries as usize) {
            let r = &self.runs[&first];
            let how = match r.exited {
                None => "still running: the runs overlap".to_string(),
                Some((at, _)) => format!("ended at {}", secs(at)),
            };
            let result = self
                .results
                .get(&(r.exec, r.epoch, first))
                .map(|res| {
                    format!(
                        "; its result {} was persisted at {} (I3: a result is recorded and its job not started again)",
                        res.status,
                        secs(res.at)
                    )
                })
                .unwrap_or_default();
            return fail(
                "I1",
                format!(
                    "{job} started {} times, its retry policy allows {} (M32): first under {first} on x{} {} at {} ({how}{result}), now under {lease} on x{exec} {} at {}",
                    earlier.len() + 1,
                    retries + 1,
                    r.exec,
                    r.epoch,
                    secs(r.start),
                    p.store.epoch,
                    secs(w.now)
                ),
            );
        }
        // M32 with I1: a later attempt starts only once every earlier run has stopped and
        // the mill has ended its lease.
        for l in earlier {
            let r = &self.runs[l];
            // A lying executor that dropped a lease it still runs (M8 then fails it) is
            // outside the promise: nothing it says about its runs can be trusted.
            // An engine that ignored its kill (`slow_stop`: a kill that does not take)
            // outlives any bound the mill could wait; then only evidence counts: the mill
            // may not start the retry within `retry_fence` of a snapshot, delivered to it,
            // that still reported the old run (M32).
            let unkillable = w.execs[r.exec].engine.get(l).is_some_and(|e| e.hung);
            let reported = self
                .reported_alive
                .get(l)
                .is_some_and(|&at| w.now < at.saturating_add(dur(w.mill_cfg.retry_fence)));
            if r.exited.is_none() && w.execs[r.exec].honest() && (!unkillable || reported) {
                return fail(
                    "I1",
                    format!(
                        "{job}: attempt under {lease} starts on x{exec} at {} while the earlier run under {l} on x{} (started {}) still runs: the runs overlap (M32: a retry waits until the earlier run is stopped or fenced, E12)",
                        secs(w.now),
                        r.exec,
                        secs(r.start)
                    ),
                );
            }
            if !self.ended.contains_key(l) {
                return fail(
                    "I1",
                    format!(
                        "{job}: attempt under {lease} starts on x{exec} while the mill still holds the earlier lease {l} (M32)"
                    ),
                );
            }
        }
        if !earlier.is_empty() {
            self.retry_starts += 1;
        }
        // The jobs the executor holds: a leftover run of a replaced store (being stopped at
        // once) or one a lying executor forgot is no seat of its; E14's grace and I1's
        // ended-lease bound hold those.
        let cap = p.cfg.total_capacity() as usize;
        let held = p.engine.values().filter(|j| j.attached).count();
        if held > cap {
            return fail(
                "I6",
                format!("x{exec}'s engine runs {held} jobs it holds, capacity {cap}"),
            );
        }
        self.runs.insert(
            lease,
            EngineRun {
                exec,
                job,
                epoch: p.store.epoch,
                start: w.now,
                exited: None,
            },
        );
        self.job_runs.entry(job).or_default().push(lease);
        self.running.insert(lease);
        Ok(())
    }

    /// The engine was told to stop `lease`.
    pub fn stop(&mut self, lease: LeaseId) {
        self.stopped.insert(lease);
    }

    /// The engine's job under `lease` is gone (exited, or died with its executor).
    pub fn exited(&mut self, lease: LeaseId, now: Micros, success: bool) {
        if let Some(r) = self.runs.get_mut(&lease) {
            r.exited.get_or_insert((now, success));
        }
        self.running.remove(&lease);
        self.not_held_since.remove(&lease);
    }
}
