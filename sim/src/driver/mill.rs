//! The event loop's mill adapter: feeding inputs to the mill's state machine and carrying
//! out its outputs (moved out of `driver/mod.rs` unchanged, issue 17 item 3).

use super::*;

impl Sim {
    // ---- the mill ------------------------------------------------------------------------

    /// Feeds the mill one input; `self.ctx` says what it was (reset to `Other` after).
    /// False if the mill is down.
    pub(super) fn mill_input(&mut self, input: MillInput) -> bool {
        let traced = |s: &mut String| trace::mill_input(s, &input);
        let line = self.trace.enabled().then(|| line_of(traced));
        let tick = matches!(input, MillInput::Tick);
        self.mill_step(line, tick, |mill, now| mill.handle(now, input))
            .is_some()
    }

    /// A client's submit, through [`Mill::submit`]; `None` if the mill is down.
    pub(super) fn mill_submit(
        &mut self,
        spec: JobSpec,
        at_ms: u64,
    ) -> Option<Result<JobId, RequestError>> {
        self.mill_submit_keyed(spec, at_ms, None)
            .map(|r| r.map(|s| s.job))
    }

    /// A client's submit under an optional idempotency key, through
    /// [`Mill::submit_keyed`] (M31); `None` if the mill is down.
    pub(super) fn mill_submit_keyed(
        &mut self,
        spec: JobSpec,
        at_ms: u64,
        key: Option<IdempotencyKey>,
    ) -> Option<Result<Submitted, RequestError>> {
        let line = self
            .trace
            .enabled()
            .then(|| line_of(|s| trace::mill_submit(s, &spec)));
        self.mill_step(line, false, |mill, now| {
            mill.submit_keyed(now, spec, at_ms, key)
        })
    }

    /// A user's cancel, through [`Mill::cancel`]; `None` if the mill is down.
    pub(super) fn mill_cancel(
        &mut self,
        job: JobId,
        reason: String,
    ) -> Option<Result<(), RequestError>> {
        let line = self
            .trace
            .enabled()
            .then(|| line_of(|s| trace::mill_cancel(s, job)));
        self.mill_step(line, false, |mill, now| mill.cancel(now, job, reason))
    }

    /// One step of the mill: traces `line`, calls `f`, then acts on the outputs. `tick`
    /// says the step was a Tick (which does not count as an input driver lag waits for).
    pub(super) fn mill_step<R>(
        &mut self,
        line: Option<String>,
        tick: bool,
        f: impl FnOnce(&mut Mill, Time) -> R,
    ) -> Option<R> {
        let now = self.w.now;
        let Some(mill) = self.w.mill.as_mut() else {
            self.ctx.kind = StepKind::Other;
            return None;
        };
        if let Some(line) = line {
            self.trace.line(now, "mill", |s| s.push_str(&line));
        }
        let reply = f(mill, t(now));
        self.stats.mill_steps += 1;
        self.after_mill_step();
        self.ctx.kind = StepKind::Other;
        if !tick {
            // Ticks held back by driver lag wait behind inputs (I12).
            self.count_held_input(0);
        }
        if !tick {
            self.count_held_input(0);
        }
        Some(reply)
    }

    /// Drains the mill's outputs and acts on them in order (or crashes it at a boundary).
    pub(super) fn after_mill_step(&mut self) {
        let mut outs = std::mem::take(&mut self.mill_outs);
        if let Some(m) = self.w.mill.as_mut() {
            while let Some(o) = m.poll_output() {
                outs.push(o);
            }
        }
        self.step_outputs = outs.len();
        self.step_wrote = false;
        // Persist before send: at most one Persist, and nothing before it but asks (M12: an
        // ask's lease id must already be durable, which `mill_send` checks, M30).
        let persists = outs
            .iter()
            .filter(|o| matches!(o, MillOutput::Persist(_)))
            .count();
        let asks_first = outs
            .iter()
            .take_while(|o| {
                matches!(
                    o,
                    MillOutput::Send {
                        msg: ToExecutor::ReserveSeat { .. },
                        ..
                    }
                )
            })
            .count();
        let persist_at = outs
            .iter()
            .position(|o| matches!(o, MillOutput::Persist(_)));
        if persists > 1 || persist_at.is_some_and(|p| p > asks_first) {
            self.violate(Violation {
                rule: "persist-before-send",
                message: format!(
                    "a mill step emitted {persists} Persist outputs, the first at a later position than an effect"
                ),
            });
        }
        let mut asks: Vec<(LeaseId, JobId, &JobSpec)> = outs
            .iter()
            .filter_map(|o| match o {
                MillOutput::Send {
                    msg:
                        ToExecutor::ReserveSeat {
                            lease, job, spec, ..
                        },
                    ..
                } => Some((*lease, *job, &**spec)),
                _ => None,
            })
            .collect();
        // Jobs the step took up without an ask: ended by it (a direct placement's quota
        // denial) or sent to wait for quota (M35 asks quota before any seat).
        let mut ended: Vec<JobId> = Vec::new();
        for o in &outs {
            match o {
                MillOutput::Persist(batch) => {
                    for w in &batch.writes {
                        if let MillWrite::JobState {
                            job,
                            state: JobState::Done(_),
                        } = w
                        {
                            ended.push(*job);
                        }
                    }
                }
                MillOutput::Observed(Observation::QuotaWait { job }) => ended.push(*job),
                _ => {}
            }
        }
        self.c.taken_up(&ended);
        if !asks.is_empty() {
            let overtakes = (self.c.priority_overtakes(), self.c.owner_overtakes());
            let r = self.c.step_asks(&mut asks);
            self.check(r);
            for _ in overtakes.0..self.c.priority_overtakes() {
                self.cov.hit(Path::PriorityOvertook);
            }
            for _ in overtakes.1..self.c.owner_overtakes() {
                self.cov.hit(Path::OwnerOvertook);
            }
        }
        drop(asks);
        let direct_at = outs.iter().position(|o| {
            matches!(
                o,
                MillOutput::Send {
                    msg: ToExecutor::ReserveSeat { direct: true, .. },
                    ..
                }
            )
        });
        let armed = self
            .w
            .mill_crash
            .filter(|p| !p.at_commit || direct_at.is_some());
        let crash_at = armed.map(|plan| match persist_at {
            // A direct ask out, its commit not (M35): the executor holds a reservation
            // nobody commits until it expires (E3) or the restarted mill settles it (M29).
            _ if plan.at_commit => direct_at.map_or(0, |d| d + 1),
            _ if direct_at.is_some() && self.process.chance(0.3) => direct_at.map_or(0, |d| d + 1),
            // Early asks out, the step's write not yet durable: the boundary M12 is about.
            Some(p) if p > 0 && self.process.chance(0.5) => p,
            Some(p) if p > 0 => p + crash_point(&mut self.process, outs.len() - p, true),
            _ => {
                let after_persist = persist_at == Some(0);
                crash_point(&mut self.process, outs.len(), after_persist)
            }
        });
        let mut crashed = false;
        let mut after_direct_ask = false;
        for (k, o) in outs.drain(..).enumerate() {
            if crash_at == Some(k) {
                crashed = true;
                match persist_at {
                    Some(p) if k == p + 1 => self.cov.hit(Path::CrashAfterPersist),
                    Some(p) if k == p && p > 0 => self.cov.hit(Path::CrashAfterEarlyAsk),
                    _ => {}
                }
                if after_direct_ask {
                    self.cov.hit(Path::CrashBetweenDirectAskAndCommit);
                }
                break;
            }
            if self.failure.is_some() {
                break;
            }
            after_direct_ask = matches!(
                o,
                MillOutput::Send {
                    msg: ToExecutor::ReserveSeat { direct: true, .. },
                    ..
                }
            );
            self.mill_output(o);
        }
        let r = self.c.mill_step_end(crashed || self.failure.is_some());
        self.check(r);
        // Again once the step's `Persist` registered its inserts: a job submitted and sent
        // to wait for quota in one step is taken up too.
        self.c.taken_up(&ended);
        self.mill_outs = outs;
        if crashed || crash_at.is_some() {
            if let Some(plan) = self.w.mill_crash.take() {
                self.crash_mill(plan);
            }
            return;
        }
        self.schedule_mill_tick();
    }

    pub(super) fn schedule_mill_tick(&mut self) {
        if self.held[0].is_some() {
            return; // the lagging driver's release ticks it
        }
        let Some(d) = self.w.mill.as_ref().and_then(|m| m.next_deadline()) else {
            return;
        };
        let d = d.as_micros().max(self.w.now);
        if self.w.mill_tick_at.is_none_or(|s| d < s) {
            self.w.mill_tick_at = Some(d);
            self.at(d, Ev::MillTick);
        }
    }

    pub(super) fn mill_output(&mut self, o: MillOutput) {
        let now = self.w.now;
        if self.trace.enabled() {
            self.trace.line(now, "mill", |s| trace::mill_output(s, &o));
        }
        match o {
            MillOutput::Persist(batch) => {
                self.step_wrote = true;
                self.note_term_write(self.w.mill_cfg.term, self.w.mill_inc);
                self.w.mill_store.apply(&batch);
                for write in &batch.writes {
                    if let MillWrite::JobState {
                        state: JobState::Done(t),
                        job,
                    } = write
                    {
                        self.times
                            .terminal(*job, now, t.status == TerminalStatus::Success);
                        if t.cause == Some(TerminalCause::ExecutorLost) {
                            self.note_lost_while_away(t.node.as_ref());
                        }
                        // Coverage by cause, never by the text beside it.
                        if t.status == TerminalStatus::Timeout {
                            self.cov.hit(Path::JobTimeout);
                        } else if t.cause == Some(TerminalCause::NoCompatibleExecutor) {
                            self.cov.hit(Path::NoCompatibleExecutor);
                        } else if t.cause == Some(TerminalCause::QuotaDenied) {
                            self.cov.hit(Path::QuotaDenied);
                        } else if t.cause == Some(TerminalCause::QueueTimeout) {
                            self.cov.hit(Path::QueueTimeout);
                        }
                    }
                }
                let r = self.c.mill_persist(&self.w, &batch, &self.ctx);
                self.check(r);
                if !self.restart_results.is_empty() {
                    let c = &self.c;
                    let before = self.restart_results.len();
                    self.restart_results
                        .retain(|(i, epoch, seqno)| c.cursor(*i, *epoch) < *seqno);
                    for _ in self.restart_results.len()..before {
                        self.cov.hit(Path::RestartDeliveredUnackedResult);
                    }
                }
            }
            MillOutput::Send { conn, msg } => {
                let r = self.c.mill_send(&self.w, conn, &msg);
                self.check(r);
                if let ToExecutor::Welcome { .. } = &msg {
                    self.check_one_session(conn);
                }
                if let ToExecutor::Refused { .. } = &msg {
                    let twin = self
                        .w
                        .exec_of_conn(conn)
                        .is_some_and(|i| self.w.execs[i].twin_of.is_some());
                    if twin {
                        self.cov.hit(Path::TwinRefused);
                    }
                }
                if let ToExecutor::CommitLease { lease, .. } = &msg {
                    let again = !self.commits_sent.insert((conn, *lease));
                    let hung = self
                        .w
                        .exec_of_conn(conn)
                        .is_some_and(|i| self.w.execs[i].hung_until.is_some());
                    if again && hung {
                        self.cov.hit(Path::HangCommitResent);
                    }
                }
                if let ToExecutor::CancelAttempt { lease, .. } = &msg {
                    if self.cancels_while_down.remove(lease) {
                        self.cov.hit(Path::CancelResentAfterReconnect);
                    }
                }
                if let ToExecutor::ReserveSeat {
                    lease, job, spec, ..
                } = &msg
                {
                    watch::reserve_seat(&self.w, spec, &mut self.cov);
                    if let Some(exec) = self.w.exec_of_conn(conn) {
                        self.w.leases.insert(
                            *lease,
                            LeaseInfo {
                                job: *job,
                                exec,
                                engine: spec.engine.clone(),
                                resources: spec.resources.clone(),
                            },
                        );
                        self.w.last_ask[exec] = Some(*lease);
                    }
                }
                let open = self.w.net.conns.get(&conn).is_some_and(|c| c.mill_open);
                if open {
                    let payload = self.encode_down(msg);
                    if let Some(at) = self.w.net.push(now, conn, false, Packet::Msg(payload)) {
                        self.at(at, Ev::Pump { conn, up: false });
                    }
                }
            }
            MillOutput::Close { conn, .. } => {
                self.c.mill_closed(conn);
                self.note_silent_close(conn);
                let Some(c) = self.w.net.conns.get_mut(&conn) else {
                    return;
                };
                if c.mill_open {
                    c.mill_open = false;
                    if let Some(at) = self.w.net.push(now, conn, false, Packet::Fin) {
                        self.at(at, Ev::Pump { conn, up: false });
                    }
                }
            }
            MillOutput::JobUpdate { .. } | MillOutput::LiveLog { .. } => {}
            MillOutput::Observed(obs) => match obs {
                Observation::Rare(p) => {
                    if let Some(path) = from_rare(p) {
                        self.cov.hit(path);
                    }
                    if from_rare(p) == Some(Path::TeardownDeadline) {
                        self.note_teardown_deadline();
                    }
                }
                Observation::Quarantined { node } => {
                    self.cov.hit(Path::Quarantine);
                    self.c.quarantine_observed(&node);
                    if let Some(i) = self.w.exec_of(&node) {
                        if !self.w.execs[i].violator() {
                            self.violate(Violation {
                                rule: "I8",
                                message: format!("{node}, no violator, was quarantined"),
                            });
                        }
                    }
                }
                Observation::Violation { node, kind, reason } => {
                    self.stats.violations += 1;
                    self.c.violation_observed(&node, kind);
                    if let Some(i) = self.w.exec_of(&node) {
                        if !self.w.execs[i].violator() {
                            self.violate(Violation {
                                rule: "I8",
                                message: format!(
                                    "honest {node} charged with a {kind} violation: {reason}"
                                ),
                            });
                        }
                    }
                }
                Observation::Placed { job, latency, .. } => {
                    self.times.placed(job, now, latency);
                }
                Observation::QuotaWait { .. } | Observation::Deposed { .. } => {}
                Observation::Retried { fenced, .. } => {
                    self.cov.hit(if fenced {
                        Path::RetriedAfterFence
                    } else {
                        Path::RetriedAtOnce
                    });
                }
                Observation::Applied {
                    conn,
                    epoch,
                    first,
                    last,
                    events,
                } => {
                    let r = self.c.applied(&self.w, conn, epoch, (first, last, events));
                    self.check(r);
                }
                Observation::Refused { .. } => {}
            },
        }
    }

    /// Whether the next message goes through the wire codec: a fixed fraction, spread
    /// evenly by a counter (no random draw, so the fraction does not move the network).
    pub(super) fn through_codec(&mut self) -> bool {
        self.codec_credit += self.w.scenario.codec_fraction;
        if self.codec_credit >= 1.0 {
            self.codec_credit -= 1.0;
            return true;
        }
        false
    }

    pub(super) fn encode_down(&mut self, msg: ToExecutor) -> Payload {
        if self.through_codec() {
            match codec::encode(&msg) {
                Ok(bytes) => return Payload::Frame(bytes),
                Err(e) => {
                    self.violate(Violation {
                        rule: "codec",
                        message: format!("mill message does not encode: {e}"),
                    });
                }
            }
        }
        Payload::ToExec(msg)
    }

    pub(super) fn encode_up(&mut self, msg: ToMill) -> Payload {
        if self.through_codec() {
            match codec::encode(&msg) {
                Ok(bytes) => return Payload::Frame(bytes),
                Err(e) => {
                    self.violate(Violation {
                        rule: "codec",
                        message: format!("executor message does not encode: {e}"),
                    });
                }
            }
        }
        Payload::ToMill(msg)
    }
}
