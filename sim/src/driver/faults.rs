//! The event loop's faults: partitions, clogs, spikes, resets, crashes and restarts of the
//! mill and the executors, hangs, lost hosts, twins, failover, and the heal after the fault
//! window (moved out of `driver/mod.rs` unchanged, issue 17 item 3).

use super::*;

impl Sim {
    // ---- faults --------------------------------------------------------------------------

    pub(super) fn fault(&mut self, fault: Fault) {
        let now = self.w.now;
        self.trace
            .line(now, "net", |s| s.push_str(&format!("fault: {fault}")));
        // The watch looks once the blocks are in force (a cut that blocks nothing counts
        // nothing).
        let cut =
            matches!(fault, Fault::Partition { .. } | Fault::Clog { .. }).then(|| fault.clone());
        match fault {
            Fault::Partition {
                side,
                one_way,
                until,
            } => {
                for &i in &side {
                    self.w.net.blocks.up[i] += 1;
                    if !one_way {
                        self.w.net.blocks.down[i] += 1;
                    }
                }
                self.at(
                    until,
                    Ev::Unblock {
                        side,
                        up: true,
                        down: !one_way,
                    },
                );
            }
            Fault::Clog {
                exec,
                to_mill,
                until,
            } => {
                if to_mill {
                    self.w.net.blocks.up[exec] += 1;
                } else {
                    self.w.net.blocks.down[exec] += 1;
                }
                self.at(
                    until,
                    Ev::Unblock {
                        side: vec![exec],
                        up: to_mill,
                        down: !to_mill,
                    },
                );
            }
            Fault::Spike { extra, until } => {
                self.w.net.spike += extra;
                self.at(until, Ev::SpikeEnd(extra));
            }
            Fault::Reset { exec } => self.reset(exec),
            Fault::CrashExec {
                exec,
                wipe,
                down,
                silent,
                at_commit,
            } => {
                if self.w.execs[exec].exec.is_some() && self.w.execs[exec].crash.is_none() {
                    self.w.execs[exec].crash = Some(CrashPlan {
                        wipe,
                        down,
                        silent,
                        at_commit,
                    });
                    let wait = if at_commit {
                        COMMIT_CRASH_WAIT
                    } else {
                        CRASH_DEADLINE
                    };
                    self.at(now + wait, Ev::CrashDeadline(Proc::Exec(exec)));
                }
            }
            Fault::Lag {
                proc,
                until,
                max_delay,
                max_inputs,
            } => {
                let slot = match proc {
                    Proc::Mill => 0,
                    Proc::Exec(i) => i + 1,
                };
                self.lag[slot] = Some(LagWindow {
                    until,
                    max_delay,
                    max_inputs,
                });
            }
            Fault::Twin { .. } => {} // started by `twin_starts`
            Fault::Hang { exec, until } => {
                let p = &mut self.w.execs[exec];
                if p.exec.is_some() && p.hung_until.is_none() && !p.lost {
                    p.hung_until = Some(until);
                    p.away_since_inc = Some(self.w.mill_inc);
                    self.at(until, Ev::Resume(exec));
                }
            }
            Fault::PauseMill { until } => self.depose_leader(Some(until)),
            Fault::CutMillStore => self.depose_leader(None),
            Fault::Lose { exec } => {
                let p = &mut self.w.execs[exec];
                if !p.lost {
                    p.lost = true;
                    p.restart_at = None;
                    p.crash = None;
                    if p.exec.is_some() {
                        let plan = CrashPlan {
                            wipe: false,
                            down: 0,
                            silent: true,
                            at_commit: false,
                        };
                        self.crash_exec(exec, plan);
                    }
                }
            }
            Fault::CrashMill { down, silent } => {
                if self.w.mill.is_some() && self.w.mill_crash.is_none() {
                    let aim =
                        self.w.mill_cfg.direct_placement && self.w.mill_crashes_planned % 2 == 1;
                    self.w.mill_crashes_planned += 1;
                    self.w.mill_crash = Some(CrashPlan {
                        wipe: false,
                        down,
                        silent,
                        at_commit: aim,
                    });
                    self.at(now + CRASH_DEADLINE, Ev::CrashDeadline(Proc::Mill));
                }
            }
        }
        if let Some(f) = cut {
            watch::fault_applied(&self.w, &f, &mut self.cov);
        }
    }

    pub(super) fn reset(&mut self, exec: usize) {
        let now = self.w.now;
        let mut notify = Vec::new();
        for (id, c) in self.w.net.conns.iter_mut() {
            if c.exec != exec || c.reset {
                continue;
            }
            c.reset = true;
            c.up.queue.clear();
            c.down.queue.clear();
            c.up.pump_at = None;
            c.down.pump_at = None;
            if c.mill_open {
                notify.push((*id, true));
            }
            if c.exec_open || c.exec_waiting {
                notify.push((*id, false));
            }
        }
        for (conn, to_mill) in notify {
            let at = now + self.process.range(100, 5 * MS);
            self.at(at, Ev::ResetNotify { conn, to_mill });
        }
    }

    pub(super) fn crash_mill(&mut self, plan: CrashPlan) {
        let now = self.w.now;
        self.trace.line(now, "mill", |s| {
            s.push_str(&format!("!! crash (down {})", trace::secs(plan.down)))
        });
        watch::mill_crashes(&self.w, &mut self.cov);
        self.w.mill = None;
        self.w.mill_inc += 1;
        self.w.mill_tick_at = None;
        self.held[0] = None;
        self.w.mill_host_down = plan.silent;
        let mut fins = Vec::new();
        for (id, c) in self.w.net.conns.iter_mut() {
            if c.mill_open {
                c.mill_open = false;
                c.up.queue.retain(|(_, p)| matches!(p, Packet::Syn));
                if !plan.silent {
                    fins.push(*id);
                }
            }
        }
        self.send_fins(now, fins, false);
        let back = now + plan.down;
        self.w.mill_restart_at = Some(back);
        self.at(back, Ev::Restart(Proc::Mill));
    }

    pub(super) fn restart_mill(&mut self) {
        let now = self.w.now;
        self.trace
            .line(now, "mill", |s| s.push_str("!! restart from store"));
        self.w.mill_restart_at = None;
        self.w.mill_host_down = false;
        // E13: every start takes a higher term from the store, as the node's SQLite store
        // counts one up at each open; executors welcomed again persist it.
        self.w.mill_cfg.term = millrace_core::Term(self.w.mill_cfg.term.get() + 1);
        // DESIGN §10: with two addresses the standby at the other one takes over; a deposed
        // mill still there has stepped down first (its process is that standby).
        if self.w.mill_addrs > 1 {
            self.w.leader_addr = (self.w.leader_addr + 1) % self.w.mill_addrs;
            if self.w.deposed.is_some() {
                self.cov.hit(Path::Takeover);
            }
            if self
                .w
                .deposed
                .as_ref()
                .is_some_and(|d| d.addr == self.w.leader_addr)
            {
                self.deposed_step_down("a standby again: it takes over");
            }
        }
        match Mill::new(
            self.w.mill_cfg.clone(),
            Some(self.w.mill_store.clone()),
            t(now),
        ) {
            Ok(m) => self.w.mill = Some(m),
            Err(e) => {
                return self.violate(Violation {
                    rule: "config",
                    message: format!("mill restart: {e}"),
                })
            }
        }
        self.after_mill_step();
    }

    pub(super) fn crash_exec(&mut self, i: usize, plan: CrashPlan) {
        let now = self.w.now;
        let name = self.names[i + 1].clone();
        self.trace.line(now, &name, |s| {
            s.push_str(&format!(
                "!! crash{} (down {})",
                if plan.wipe { " + wipe" } else { "" },
                trace::secs(plan.down)
            ))
        });
        watch::exec_crashes(&self.w, i, &mut self.cov);
        let inc = self.w.mill_inc;
        let p = &mut self.w.execs[i];
        p.exec = None;
        p.inc += 1;
        p.hung_until = None;
        p.deferred.clear();
        p.away_since_inc.get_or_insert(inc);
        p.tick_at = None;
        p.connecting = None;
        self.held[i + 1] = None;
        let p = &mut self.w.execs[i];
        // A lease-dropping executor forgets one running lease, epoch kept (M8 must fail it).
        if let Some(b) = p.byz.as_mut() {
            if let Some(lease) = b.take_drop(p.store.epoch, &p.store.jobs, &p.store.outbox) {
                p.store.jobs.remove(&lease);
                self.cov.hit(Path::LeaseDroppedSameEpoch);
                self.trace
                    .line(now, &name, |s| s.push_str(&format!("!! drops {lease}")));
            }
        }
        let p = &mut self.w.execs[i];
        if !p.engine.is_empty() {
            self.cov.hit(Path::ExecCrashWithRunningJobs);
        }
        // E5: writes that did not wait for the disk die with the host, not with the process.
        if let (true, Some(synced)) = (plan.silent, p.synced.take()) {
            p.store = synced;
            self.cov.hit(Path::HostCrashLostUnsyncedWrites);
        }
        let p = &mut self.w.execs[i];
        if plan.silent {
            // The host went down with the process: the supervisors and their jobs die too
            // (what a supervisor recorded durably while orphaned stays on disk).
            let killed: Vec<LeaseId> = std::mem::take(&mut p.engine).into_keys().collect();
            for lease in killed {
                self.c.exited(lease, now, false);
            }
        } else {
            // Only the executor process died: each job runs on under its supervisor, which
            // waits `reconnect_grace` for an executor to re-attach (E14), counted from the
            // earlier of the death and the last contact with the mill the executor made
            // durable and passed on to it (E12's clock; the node's `Contact`).
            let grace = dur(p
                .store
                .timers
                .map_or(p.cfg.reconnect_grace, |t| t.reconnect_grace));
            let contact = p.store.last_contact.map_or(now, |c| c.as_micros().min(now));
            let due = (contact + grace).max(now);
            let mut orphans = Vec::new();
            // A run already orphaned keeps its supervisor's first wait: a process that never
            // re-attached to it does not restart that clock.
            for (lease, job) in p.engine.iter_mut().filter(|(_, j)| j.attached) {
                job.attached = false;
                job.orphaned += 1;
                orphans.push((*lease, job.run, job.orphaned));
            }
            for (lease, run, orphaned) in orphans {
                self.at(
                    due,
                    Ev::SupervisorGrace {
                        exec: i,
                        lease,
                        run,
                        orphaned,
                    },
                );
            }
        }
        let p = &mut self.w.execs[i];
        if plan.wipe {
            let epoch = Epoch(self.process.range(1, u64::MAX / 2));
            p.store = ExecutorSnapshot::fresh(epoch);
        }
        let mut fins = Vec::new();
        for (id, c) in self.w.net.conns.iter_mut() {
            if c.exec != i {
                continue;
            }
            if c.exec_open || c.exec_waiting {
                c.exec_open = false;
                c.exec_waiting = false;
                c.down.queue.clear();
                if !plan.silent {
                    fins.push(*id);
                }
            }
        }
        self.send_fins(now, fins, true);
        if self.w.execs[i].lost {
            return; // never back
        }
        let back = now + plan.down;
        self.w.execs[i].restart_at = Some(back);
        self.at(back, Ev::Restart(Proc::Exec(i)));
    }

    /// A twin process of another executor's node id starts; it is stopped at `until`.
    pub(super) fn twin_starts(&mut self, twin: usize, until: Micros) {
        let now = self.w.now;
        let p = &mut self.w.execs[twin];
        if !p.lost || p.exec.is_some() {
            return;
        }
        p.lost = false;
        let name = self.names[twin + 1].clone();
        self.trace.line(now, &name, |s| {
            s.push_str("!! a second process with the same node id starts")
        });
        self.start_exec(twin);
        self.at(until, Ev::TwinStop(twin));
    }

    /// M2: another process claiming the node id of the process behind `conn` holds a live
    /// session as its Hello reaches the mill — a connection the mill welcomed, still open at
    /// the mill, on which it heard something within `silence_timeout`: (rival connection,
    /// when last heard). Taken before the step, which may close the rival (a replacement).
    pub(super) fn live_rival(&self, conn: ConnId) -> Option<(ConnId, Micros)> {
        let now = self.w.now;
        let me = self.w.exec_of_conn(conn)?;
        let node = &self.w.execs[me].node;
        let silence = dur(self.w.mill_cfg.silence_timeout);
        let inc = self.w.mill_inc;
        self.welcomed.iter().find_map(|c| {
            let x = self.w.net.conns.get(c)?;
            let heard = *self.last_up.get(c)?;
            let live = x.exec != me
                && &self.w.execs[x.exec].node == node
                && x.mill_open
                && x.mill_inc == inc
                && now.saturating_sub(heard) < silence;
            live.then_some((*c, heard))
        })
    }

    /// M2: the mill welcomes `conn`; fails when its Hello came while another process of the
    /// same node id held a live session (`live_rival`, taken before the step).
    pub(super) fn check_one_session(&mut self, conn: ConnId) {
        let now = self.w.now;
        self.welcomed.insert(conn);
        let Some((hello, other, heard)) = self.rival else {
            return;
        };
        if hello != conn {
            return;
        }
        let me = self.w.exec_of_conn(conn).unwrap_or(0);
        let other_exec = self.w.exec_of_conn(other).unwrap_or(0);
        let node = self.w.execs[me].node.clone();
        let silence = dur(self.w.mill_cfg.silence_timeout);
        self.violate(Violation {
            rule: "one-session",
            message: format!(
                "{node}: welcomed {} on {conn} while {} held a live session on {other} (heard {} before the Hello, silence_timeout {}): a second process claiming a live node id must be refused (M2)",
                self.names[me + 1],
                self.names[other_exec + 1],
                trace::secs(now.saturating_sub(heard)),
                trace::secs(silence)
            ),
        });
    }

    /// A hung executor's process resumes: its late timers run first (inside the first
    /// input it handles, or a `Tick`), then every input that waited, in order (E12, M9).
    pub(super) fn resume(&mut self, i: usize) {
        let now = self.w.now;
        let p = &mut self.w.execs[i];
        p.hung_until = None;
        p.away_since_inc = None;
        let late = p
            .exec
            .as_ref()
            .and_then(|x| x.next_deadline())
            .is_some_and(|d| d.as_micros() < now);
        if late {
            self.cov.hit(Path::HangResumedLate);
        }
        let name = self.names[i + 1].clone();
        self.trace
            .line(now, &name, |s| s.push_str("!! resumes (was hung)"));
        self.exec_input(i, ExecutorInput::Tick);
        while let Some(input) = self.w.execs[i].deferred.pop_front() {
            if self.w.execs[i].exec.is_none() || self.failure.is_some() {
                break;
            }
            self.exec_input(i, input);
        }
        self.w.execs[i].deferred.clear();
        self.schedule_exec_tick(i);
    }

    /// The mill closes `conn`: counts it when the mill had heard nothing on it for
    /// `silence_timeout` and the executor behind it is hung or lost for good — its own
    /// silence check (M9) is what closed it.
    pub(super) fn note_silent_close(&mut self, conn: ConnId) {
        let Some(i) = self.w.exec_of_conn(conn) else {
            return;
        };
        let silence = dur(self.w.mill_cfg.silence_timeout);
        let quiet = self
            .last_up
            .get(&conn)
            .is_none_or(|at| self.w.now.saturating_sub(*at) >= silence);
        if !quiet {
            return;
        }
        let p = &self.w.execs[i];
        if p.hung_until.is_some() {
            self.cov.hit(Path::HangClosedBySilence);
        } else if p.lost {
            self.cov.hit(Path::LostHostClosedBySilence);
        }
    }

    /// The mill recorded "executor lost" for a lease of `node`: counts it when the node's
    /// process has been away since before the mill's last restart, so the restored
    /// placeholder session's grace is what ended it (M29, M5).
    pub(super) fn note_lost_while_away(&mut self, node: Option<&NodeId>) {
        let Some(i) = node.and_then(|n| self.w.exec_of(n)) else {
            return;
        };
        if self.w.execs[i]
            .away_since_inc
            .is_some_and(|inc| inc < self.w.mill_inc)
        {
            self.cov.hit(Path::RestoredGraceEndedLeases);
        }
    }

    pub(super) fn start_exec(&mut self, i: usize) {
        let now = self.w.now;
        let p = &mut self.w.execs[i];
        p.restart_at = None;
        p.away_since_inc = None;
        p.cfg.backoff_seed = self.process.next_u64();
        let restarted = p.inc > 0;
        let x = Executor::new(p.cfg.clone(), p.store.clone(), t(now));
        p.exec = Some(x);
        if restarted {
            let name = self.names[i + 1].clone();
            self.trace.line(now, &name, |s| s.push_str("!! restart"));
        }
        self.adopt(i);
        self.after_exec_step(i);
        let p = &self.w.execs[i];
        if restarted {
            let last_result = p
                .store
                .outbox
                .iter()
                .filter(|e| matches!(e.kind, millrace_core::wire::EventKind::Terminal { .. }))
                .map(|e| e.seqno)
                .max();
            if let Some(seqno) = last_result {
                self.restart_results.push((i, p.store.epoch, seqno));
            }
        }
    }

    /// E9/E14: the new process of executor `i` re-attaches to the supervisors of the jobs
    /// its store holds, in the step that made its `AdoptJob`s: a job still running is
    /// adopted (`JobStarted`), one that ended while no executor was attached is reported
    /// with the status its supervisor recorded (`JobExited`), and only one with nothing
    /// left ends as lost (`JobLost`, Failed "executor restarted"). With a new store (a wiped
    /// one, a new epoch) nothing is adopted and every leftover supervisor is told at once
    /// to stop its job; supervisors of jobs the store does not hold wait out their grace.
    pub(super) fn adopt(&mut self, i: usize) {
        let now = self.w.now;
        let name = self.names[i + 1].clone();
        let p = &mut self.w.execs[i];
        let epoch = p.store.epoch;
        let leases: Vec<LeaseId> = p.store.jobs.keys().copied().collect();
        let mut answers = Vec::new();
        for lease in &leases {
            let lease = *lease;
            if let Some(input) = p.recorded.remove(&lease) {
                answers.push((input, Path::AdoptedRecordedExit));
            } else if let Some(job) = p.engine.get_mut(&lease).filter(|j| !j.attached) {
                job.attached = true;
                job.started = true;
                answers.push((ExecutorInput::JobStarted { lease }, Path::AdoptedRunningJob));
            } else {
                answers.push((ExecutorInput::JobLost { lease }, Path::AdoptedNothingLeft));
            }
        }
        // The rest belong to no job of this store: stale records are dropped; a run of an
        // older store is stopped at once (its epoch will never come back), one this store
        // forgot (same epoch) is left to its supervisor's grace.
        p.recorded.clear();
        let foreign: Vec<LeaseId> = p
            .engine
            .iter()
            .filter(|(l, j)| !j.attached && j.epoch != epoch && !leases.contains(l))
            .map(|(l, _)| *l)
            .collect();
        for (input, path) in answers {
            self.cov.hit(path);
            self.trace.line(now, &name, |s| {
                s.push_str("adopt: ");
                trace::exec_input(s, &input);
            });
            if let Some(x) = self.w.execs[i].exec.as_mut() {
                x.handle(t(now), input);
            }
        }
        for lease in foreign {
            self.cov.hit(Path::SupervisorForeignEpochStop);
            self.trace.line(now, &name, |s| {
                s.push_str(&format!(
                    "supervisor of {lease}: a new store took over, stops the job (E14)"
                ))
            });
            self.c.stop(lease);
            self.stop_run(i, lease, Exit::ForeignEpoch);
        }
    }

    pub(super) fn heal(&mut self) {
        let now = self.w.now;
        self.trace
            .line(now, "net", |s| s.push_str("heal: faults stop"));
        self.w.healed = true;
        for b in self
            .w
            .net
            .blocks
            .up
            .iter_mut()
            .chain(self.w.net.blocks.down.iter_mut())
        {
            *b = 0;
        }
        self.w.net.spike = 0;
        self.repump(|_| true);
        // Drivers catch up (a held Tick still comes at its release, within its bound).
        for l in &mut self.lag {
            *l = None;
        }
        // The operator kills engines that ignored every stop.
        for i in 0..self.w.execs.len() {
            let forever: Vec<(LeaseId, u64)> = self.w.execs[i]
                .engine
                .iter_mut()
                .filter(|(_, j)| j.forever)
                .map(|(l, j)| {
                    j.forever = false;
                    (*l, j.run)
                })
                .collect();
            for (lease, run) in forever {
                let at = now + self.engines.range(5 * MS, 3 * SEC);
                self.ends_at(i, lease, at);
                self.at(
                    at,
                    Ev::EngineExit {
                        exec: i,
                        run,
                        lease,
                        how: Exit::Stopped,
                    },
                );
            }
        }
        self.w.mill_crash = None;
        self.deposed_step_down("faults stop");
        if self.w.mill.is_none() {
            self.restart_mill();
        }
        for i in 0..self.w.execs.len() {
            self.w.execs[i].crash = None;
            if self.w.execs[i].hung_until.is_some() {
                self.resume(i);
            }
            if self.w.execs[i].exec.is_none() && !self.w.execs[i].lost {
                self.start_exec(i);
            }
        }
        // Liveness (I9): each job's bound is computed from the work ahead of it on every
        // sample from now on (`crate::liveness`); a scenario may set one wall instead.
        if let Some(bound) = self.w.scenario.expect.liveness_bound {
            let deadline = now + bound;
            self.deadline = Some(deadline);
            self.at(deadline, Ev::Deadline);
        }
    }
}
