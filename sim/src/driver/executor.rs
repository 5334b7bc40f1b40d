//! The event loop's executor adapter: feeding inputs to each executor's state machine and
//! carrying out its outputs (moved out of `driver/mod.rs` unchanged, issue 17 item 3); the
//! engine model its commands drive is in `driver/engine.rs`.

use super::*;

impl Sim {
    // ---- executors -----------------------------------------------------------------------

    pub(super) fn exec_input(&mut self, i: usize, input: ExecutorInput) {
        let now = self.w.now;
        if self.w.execs[i].hung_until.is_some() {
            // A stopped process handles nothing: its socket buffers and its engine's
            // reports wait until it resumes (`resume`).
            if self.w.execs[i].exec.is_some() && !matches!(input, ExecutorInput::Tick) {
                self.w.execs[i].deferred.push_back(input);
            }
            return;
        }
        // A cancel reaches the executor if it handles it now (a hung one only when it
        // resumes) — unless it has already closed that connection (a hung executor's late
        // silence timer may close it just before the waiting message is handed over; the
        // executor drops messages of a connection it closed, and the mill re-sends), or it
        // crashes in this step before its stop is durable (E7: durable before the ack; what
        // it lost is as if never received, and the mill re-sends, M26). Judged after the step.
        let cancel = match &input {
            ExecutorInput::Message {
                conn,
                msg: ToExecutor::CancelAttempt { lease, .. },
            } if self.w.net.conns.get(conn).is_some_and(|c| c.exec_open) => {
                Some((*lease, self.w.execs[i].inc))
            }
            _ => None,
        };
        // No pre-tick: the executor runs its due timers inside `handle` (the node's driver
        // hands it inputs the same way, and ticks only after a batch), so a step may hold
        // the timers' outputs and the input's — group-committed below as the node does.
        let tick = matches!(input, ExecutorInput::Tick);
        self.exec_commit_input = match &input {
            ExecutorInput::Message {
                msg: ToExecutor::CommitLease { lease, .. },
                ..
            } => Some(*lease),
            _ => None,
        };
        // E13, I13: a message below the highest term this executor has seen must be refused
        // (judged on the step's outputs); one from a deposed mill to an executor that has
        // not heard its successor is fine (the successor judges that node later, §10).
        let welcome = match &input {
            ExecutorInput::Message {
                conn,
                msg: ToExecutor::Welcome { term, .. },
            } => Some((*conn, *term)),
            _ => None,
        };
        if let (ExecutorInput::Message { msg, .. }, Some(x)) = (&input, &self.w.execs[i].exec) {
            // The highest term it accepted a `Welcome` of in this epoch, as seen from
            // outside, so an executor that forgot one (a lost write) is judged too.
            let epoch = x.durable().epoch;
            let outside = self.seen_terms[i]
                .filter(|(e, _)| *e == epoch)
                .map_or(millrace_core::Term(0), |(_, t)| t);
            let seen = x.durable().term.max(outside);
            match msg.term() {
                Some(term) if term < seen => self.exec_stale = Some((term, seen)),
                Some(term) if term < self.w.mill_cfg.term => {
                    self.cov.hit(Path::DeposedMessageDelivered)
                }
                Some(_) | None => {}
            }
        }
        let p = &mut self.w.execs[i];
        let Some(x) = p.exec.as_mut() else {
            return;
        };
        p.held_before.clear();
        p.held_before.extend(
            x.reserved_leases()
                .chain(x.running_leases())
                .chain(x.queued_leases()),
        );
        p.outbox_before = p.store.outbox.iter().map(|e| e.seqno).max();
        if self.trace.enabled() {
            let name = &self.names[i + 1];
            self.trace.line(now, name, |s| trace::exec_input(s, &input));
        }
        x.handle(t(now), input);
        self.stats.exec_steps += 1;
        let epoch = x.durable().epoch;
        self.after_exec_step(i);
        // Accepted: the link is up on that connection (no close, no `Stale`).
        if let Some((conn, term)) = welcome {
            let accepted = self.w.execs[i]
                .exec
                .as_ref()
                .is_some_and(|x| x.session_conn() == Some(conn));
            if accepted {
                let best = self.seen_terms[i]
                    .filter(|(e, _)| *e == epoch)
                    .map_or(term, |(_, t)| t.max(term));
                self.seen_terms[i] = Some((epoch, best));
            }
        }
        self.exec_commit_input = None;
        if let Some((lease, inc)) = cancel {
            let p = &self.w.execs[i];
            let kept = p.inc == inc || p.store.jobs.get(&lease).is_some_and(|j| j.stop.is_some());
            if kept {
                self.c.cancel_delivered(i, lease, now);
            }
        }
        if !tick {
            self.count_held_input(i + 1);
        }
    }

    pub(super) fn after_exec_step(&mut self, i: usize) {
        let mut outs = std::mem::take(&mut self.exec_outs);
        if let Some(x) = self.w.execs[i].exec.as_mut() {
            while let Some(o) = x.poll_output() {
                outs.push(o);
            }
        }
        if let Some((term, seen)) = self.exec_stale.take() {
            self.check_stale_refused(i, &outs, term, seen);
        }
        // Group commit, as the node's executor driver does (`flush`: every `Persist` of a
        // batch of inputs is written before any other output is acted on, order otherwise
        // kept). Without the pre-tick a step may carry its due timers' outputs before the
        // input's, so a `Persist` can follow a `Send` of the same step.
        let effect_first = outs
            .iter()
            .position(|o| !matches!(o, ExecutorOutput::Persist(_)));
        let last_persist = outs
            .iter()
            .rposition(|o| matches!(o, ExecutorOutput::Persist(_)));
        if let (Some(e), Some(p)) = (effect_first, last_persist) {
            if p > e {
                let (mut persists, rest): (Vec<_>, Vec<_>) = outs
                    .drain(..)
                    .partition(|o| matches!(o, ExecutorOutput::Persist(_)));
                persists.extend(rest);
                outs = persists;
            }
        }
        // A new commit: the step received `CommitLease` and persists it.
        let new_commit = self.exec_commit_input.filter(|lease| {
            outs.iter().any(|o| match o {
                ExecutorOutput::Persist(b) => b.writes.iter().any(
                    |w| matches!(w, ExecutorWrite::JobCommitted { lease: l, .. } if l == lease),
                ),
                _ => false,
            })
        });
        let crash_at = match self.w.execs[i].crash {
            None => None,
            // It waits for a commit and lands before its persist.
            Some(plan) if plan.at_commit => new_commit.map(|_| 0),
            Some(_) => {
                let after_persist = matches!(outs.first(), Some(ExecutorOutput::Persist(_)));
                Some(crash_point(&mut self.process, outs.len(), after_persist))
            }
        };
        if let (Some(lease), Some(k)) = (new_commit, crash_at) {
            let persisted_before = outs[..k.min(outs.len())].iter().any(|o| match o {
                ExecutorOutput::Persist(b) => b.writes.iter().any(
                    |w| matches!(w, ExecutorWrite::JobCommitted { lease: l, .. } if *l == lease),
                ),
                _ => false,
            });
            if !persisted_before {
                self.cov.hit(Path::CrashBeforeCommitPersisted);
                let wipe = self.w.execs[i].crash.is_some_and(|p| p.wipe);
                if !wipe {
                    self.lost_commits.push((i, lease));
                }
            }
        }
        let mut crashed = false;
        for (k, o) in outs.drain(..).enumerate() {
            if crash_at == Some(k) {
                crashed = true;
                break;
            }
            if self.failure.is_some() || self.w.execs[i].exec.is_none() {
                break;
            }
            self.exec_output(i, o);
        }
        self.exec_outs = outs;
        if crashed || crash_at.is_some() {
            if let Some(plan) = self.w.execs[i].crash.take() {
                self.crash_exec(i, plan);
            }
            return;
        }
        self.schedule_exec_tick(i);
    }

    pub(super) fn schedule_exec_tick(&mut self, i: usize) {
        if self.held[i + 1].is_some() {
            return; // the lagging driver's release ticks it
        }
        let Some(d) = self.w.execs[i]
            .exec
            .as_ref()
            .and_then(|x| x.next_deadline())
        else {
            return;
        };
        let d = d.as_micros().max(self.w.now);
        if self.w.execs[i].tick_at.is_none_or(|s| d < s) {
            self.w.execs[i].tick_at = Some(d);
            self.at(d, Ev::ExecTick(i));
        }
    }

    pub(super) fn exec_output(&mut self, i: usize, o: ExecutorOutput) {
        let now = self.w.now;
        if self.trace.enabled() {
            let name = &self.names[i + 1];
            self.trace.line(now, name, |s| trace::exec_output(s, &o));
        }
        match o {
            ExecutorOutput::Connect { mill } => {
                let inc = self.w.execs[i].inc;
                let (conn, at) = self.w.net.open(now, i, inc, mill);
                self.at(at, Ev::Pump { conn, up: true });
                self.w.execs[i].connecting = Some(conn);
                self.at(now + CONNECT_TIMEOUT, Ev::ConnectTimeout { exec: i, conn });
            }
            ExecutorOutput::Send { conn, msg } => {
                if self.w.execs[i].honest() || self.w.execs[i].byz.is_some() {
                    let r = self.c.exec_send(&self.w, i, &msg);
                    self.check(r);
                }
                if let ToMill::ReserveResult {
                    accepted: false,
                    reject: Some(RejectKind::Transient),
                    reason,
                    ..
                } = &msg
                {
                    if reason.starts_with("resource ") {
                        self.cov.hit(Path::ResourceRefused);
                    }
                }
                let open = self.w.net.conns.get(&conn).is_some_and(|c| c.exec_open);
                if !open {
                    return;
                }
                let ctx = if self.w.execs[i].byz.is_some() {
                    byz_ctx(&self.w, i)
                } else {
                    ByzCtx::default()
                };
                // An executor may charge more than the job asks for (M14): this one names
                // one more resource, so a re-bid elsewhere can change the charge (M15).
                let msg = match (&self.w.execs[i].spec.extra_charge, msg) {
                    (
                        Some((name, amount)),
                        ToMill::ReserveResult {
                            lease,
                            accepted: true,
                            reject,
                            reason,
                            mut resources,
                        },
                    ) => {
                        resources.insert(name.clone(), *amount);
                        ToMill::ReserveResult {
                            lease,
                            accepted: true,
                            reject,
                            reason,
                            resources,
                        }
                    }
                    (_, msg) => msg,
                };
                let msgs = match self.w.execs[i].byz.as_mut() {
                    Some(b) => b.outgoing(now, conn, msg, &ctx, &mut self.byz),
                    None => vec![msg],
                };
                // A lease-dropping executor loses its lease in a crash at its next step.
                let p = &mut self.w.execs[i];
                if p.byz.as_ref().is_some_and(|b| b.wants_drop()) && p.crash.is_none() {
                    p.crash = Some(CrashPlan {
                        wipe: false,
                        down: self.byz.range(SEC, 5 * SEC),
                        silent: false,
                        at_commit: false,
                    });
                }
                for m in msgs {
                    let payload = self.encode_up(m);
                    if let Some(at) = self.w.net.push(now, conn, true, Packet::Msg(payload)) {
                        self.at(at, Ev::Pump { conn, up: true });
                    }
                }
            }
            ExecutorOutput::Close { conn, .. } => {
                let Some(c) = self.w.net.conns.get_mut(&conn) else {
                    return;
                };
                if c.exec_open || c.exec_waiting {
                    c.exec_open = false;
                    c.exec_waiting = false;
                    if let Some(at) = self.w.net.push(now, conn, true, Packet::Fin) {
                        self.at(at, Ev::Pump { conn, up: true });
                    }
                }
            }
            ExecutorOutput::Persist(batch) => {
                let p = &mut self.w.execs[i];
                if batch.needs_sync() {
                    p.synced = None;
                } else if p.synced.is_none() {
                    p.synced = Some(p.store.clone());
                }
                p.store.apply(&batch);
                let r = self.c.exec_persist(&self.w, i, &batch);
                self.check(r);
            }
            ExecutorOutput::StartJob {
                lease, job, spec, ..
            } => {
                self.runs += 1;
                let run = self.runs;
                let epoch = self.w.execs[i].store.epoch;
                self.w.execs[i].engine.insert(
                    lease,
                    EngineJob {
                        job,
                        started: false,
                        stopping: false,
                        hung: false,
                        forever: false,
                        counted: false,
                        ends_at: None,
                        run,
                        epoch,
                        attached: true,
                        orphaned: 0,
                    },
                );
                let retry_starts = self.c.retry_starts;
                let r = self.c.start(&self.w, i, lease, job, &spec);
                self.check(r);
                if self.w.scenario.bug == Some(crate::scenario::SimBug::DoubleStartAfterCrash)
                    && self.w.execs[i].inc > 0
                {
                    // The deliberate breakage: the engine runs the job a second time.
                    let r = self.c.start(&self.w, i, lease, job, &spec);
                    self.check(r);
                }
                if spec.node.is_some() {
                    self.cov.hit(Path::PinnedRan);
                }
                if self.c.retry_starts > retry_starts {
                    self.cov.hit(Path::RetryStarted);
                }
                let exact = self.durations.as_ref().map(|d| d.of(&spec));
                if exact == Some(None) {
                    // A quality run must give every job its exact duration; a made-up one
                    // would skew the comparison with the ideal.
                    self.violate(Violation {
                        rule: "quality",
                        message: format!("{lease:?}: the job's payload names no exact duration"),
                    });
                }
                let exact = exact.flatten();
                let rng = &mut self.engines;
                if let Some(d) = exact {
                    // The engine starts at once, runs exactly `d` and succeeds.
                    self.at(
                        now,
                        Ev::EngineStart {
                            exec: i,
                            run,
                            lease,
                        },
                    );
                    self.ends_at(i, lease, now + d);
                    self.at(
                        now + d,
                        Ev::EngineExit {
                            exec: i,
                            run,
                            lease,
                            how: Exit::Natural {
                                success: true,
                                code: 0,
                            },
                        },
                    );
                } else if rng.chance(0.01) {
                    let at = now + rng.range(MS, 50 * MS);
                    self.ends_at(i, lease, at);
                    self.at(
                        at,
                        Ev::EngineExit {
                            exec: i,
                            run,
                            lease,
                            how: Exit::FailedToStart,
                        },
                    );
                } else {
                    let start = now + rng.range(MS, 50 * MS);
                    let d = job_duration(rng, self.w.scenario.job_mean, self.w.scenario.job_max);
                    let success = rng.chance(0.85);
                    let code = if success { 0 } else { rng.range(1, 255) as i32 };
                    self.at(
                        start,
                        Ev::EngineStart {
                            exec: i,
                            run,
                            lease,
                        },
                    );
                    self.ends_at(i, lease, start + d);
                    self.at(
                        start + d,
                        Ev::EngineExit {
                            exec: i,
                            run,
                            lease,
                            how: Exit::Natural { success, code },
                        },
                    );
                }
            }
            ExecutorOutput::AdoptJob { .. } => {
                // Answered in `start_exec`, in the step that made it.
            }
            ExecutorOutput::StopJob { lease, .. } => {
                self.c.stop(lease);
                self.stop_run(i, lease, Exit::Stopped);
            }
        }
    }
}
