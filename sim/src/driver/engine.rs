//! The event loop's engine model: how each engine run of an executor starts, is stopped
//! (slow engines hang past the stop), exits and is fenced by its supervisor (E14) (moved out
//! of `driver/mod.rs` and `driver/executor.rs` unchanged, issue 17 item 3).

use super::*;

/// How an engine's job ends.
#[derive(Debug, Clone, Copy)]
pub(super) enum Exit {
    /// It ran out by itself.
    Natural { success: bool, code: i32 },
    /// It stopped after `StopJob`.
    Stopped,
    /// Its supervisor stopped it: no executor re-attached within `reconnect_grace` (E14).
    Fenced,
    /// Its supervisor stopped it at once: the executor came back with a new store (E1, E14).
    ForeignEpoch,
    /// It never started.
    FailedToStart,
}

impl Sim {
    /// The engine run `run` of `lease` on executor `exec` starts (`Ev::EngineStart`).
    pub(super) fn engine_start(&mut self, exec: usize, run: u64, lease: LeaseId) {
        let p = &mut self.w.execs[exec];
        let Some(job) = p.engine.get_mut(&lease) else {
            return;
        };
        if job.run != run || job.started {
            return;
        }
        job.started = true;
        if job.attached && p.exec.is_some() {
            self.exec_input(exec, ExecutorInput::JobStarted { lease });
        }
    }

    /// Records when the engine run of `lease` on executor `i` will exit (I9 counts it).
    pub(super) fn ends_at(&mut self, i: usize, lease: LeaseId, at: Micros) {
        if let Some(job) = self.w.execs[i].engine.get_mut(&lease) {
            job.ends_at = Some(at);
        }
    }
    /// The engine's run of `lease` on executor `i` is asked to stop, by its executor
    /// (`StopJob`) or by its supervisor (E14); `how` is what its exit will report. A slow
    /// engine may hang past the stop, or (before the heal) ignore it for good.
    pub(super) fn stop_run(&mut self, i: usize, lease: LeaseId, how: Exit) {
        let now = self.w.now;
        let slow = self.w.execs[i].spec.slow_stop;
        let teardown = dur(self.w.mill_cfg.cancel_teardown_timeout);
        let Some(job) = self.w.execs[i].engine.get_mut(&lease) else {
            return;
        };
        if job.stopping {
            return;
        }
        job.stopping = true;
        let run = job.run;
        let healed = self.w.healed;
        let delay = if slow && self.engines.chance(0.7) {
            job.hung = true;
            if !healed && self.engines.chance(0.3) {
                // It ignores the stop and the kill for good: only the mill's
                // teardown deadline ends the cancel (M26); the heal ends the engine.
                job.forever = true;
                job.ends_at = None;
                return;
            }
            let delay = self.engines.range(teardown + 5 * SEC, teardown + 40 * SEC);
            // A hung engine ignores its natural exit: this one is what ends it.
            job.ends_at = Some(now + delay);
            delay
        } else {
            let delay = self.engines.range(5 * MS, 3 * SEC);
            job.ends_at = Some(job.ends_at.map_or(now + delay, |e| e.min(now + delay)));
            delay
        };
        self.at(
            now + delay,
            Ev::EngineExit {
                exec: i,
                run,
                lease,
                how,
            },
        );
    }

    pub(super) fn engine_exit(&mut self, exec: usize, run: u64, lease: LeaseId, how: Exit) {
        let now = self.w.now;
        let p = &mut self.w.execs[exec];
        let (hung, attached) = match p.engine.get(&lease) {
            Some(job) if job.run == run => (job.hung, job.attached),
            _ => return, // stale: an earlier run, or one its host took down
        };
        if hung && matches!(how, Exit::Natural { .. }) {
            return;
        }
        p.engine.remove(&lease);
        let log = Some(LogRef {
            path: LogRef::path_for(lease),
            hash: format!(
                "sha256:{:064x}",
                u128::from(lease.get()).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ),
        });
        let input = match how {
            Exit::Natural { success, code } => {
                self.c.exited(lease, now, success);
                ExecutorInput::JobExited {
                    lease,
                    status: if success {
                        TerminalStatus::Success
                    } else {
                        TerminalStatus::Failed
                    },
                    exit_code: Some(code),
                    error: (!success).then(|| format!("exit status {code}")),
                    log,
                }
            }
            Exit::Stopped => {
                self.c.exited(lease, now, false);
                ExecutorInput::JobExited {
                    lease,
                    status: TerminalStatus::Cancelled,
                    exit_code: Some(143),
                    error: Some("terminated".into()),
                    log,
                }
            }
            Exit::FailedToStart => {
                self.c.exited(lease, now, false);
                ExecutorInput::JobExited {
                    lease,
                    status: TerminalStatus::Failed,
                    exit_code: None,
                    error: Some("engine failed to start the job".into()),
                    log: None,
                }
            }
            Exit::Fenced => {
                self.c.exited(lease, now, false);
                ExecutorInput::JobExited {
                    lease,
                    status: TerminalStatus::Failed,
                    exit_code: Some(143),
                    error: Some(
                        "stopped by its supervisor: no executor re-attached within the reconnect grace (E14)"
                            .into(),
                    ),
                    log,
                }
            }
            Exit::ForeignEpoch => {
                // Nobody collects it: the store that knew the job is gone (E1).
                self.c.exited(lease, now, false);
                return;
            }
        };
        let p = &mut self.w.execs[exec];
        if attached && p.exec.is_some() {
            self.exec_input(exec, input);
        } else {
            // No executor process holds it: its supervisor records the end durably for the
            // next one to collect (E14, E9).
            p.recorded.insert(lease, input);
            let name = self.names[exec + 1].clone();
            self.trace.line(now, &name, |s| {
                s.push_str(&format!(
                    "supervisor of {lease} records its exit (no executor)"
                ))
            });
        }
    }

    /// E14: the supervisor of `lease` on executor `i` has waited `reconnect_grace` since its
    /// executor died (`orphaned` names that death) and no process re-attached: it stops the
    /// job itself and records why.
    pub(super) fn supervisor_grace(&mut self, i: usize, lease: LeaseId, run: u64, orphaned: u32) {
        let now = self.w.now;
        let due = self.w.execs[i]
            .engine
            .get(&lease)
            .is_some_and(|j| j.run == run && j.orphaned == orphaned && !j.attached);
        if !due {
            return;
        }
        self.cov.hit(Path::SupervisorFenced);
        let name = self.names[i + 1].clone();
        self.trace.line(now, &name, |s| {
            s.push_str(&format!(
                "supervisor of {lease}: no executor within the grace, stops the job (E14)"
            ))
        });
        self.c.stop(lease);
        self.stop_run(i, lease, Exit::Fenced);
    }
}
