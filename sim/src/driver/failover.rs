//! Leadership in the simulator (DESIGN §10, E13, I13): a leading mill that is paused past its
//! lease or cut from the store becomes *deposed* — it keeps its state, its term and the
//! connections it accepted — while a standby takes over from the store under the next term at
//! the other address. The deposed process acts on what it holds until it steps down: at its
//! first write (the store refuses its term), when an executor says it has seen a higher term
//! (after the store confirms it), or when its renewal fails. Executors that heard the successor
//! must refuse whatever it sends (E13); the checks are in `exec_input` and `mill_output`.
//!
//! The store is the sim's `mill_store` and its term is `mill_cfg.term`, raised by every
//! campaign (`restart_mill`); a write is accepted only under the store's term, which is what
//! the node's PostgreSQL store does with `SELECT term … FOR SHARE` (node/src/pg_store.rs).

use std::collections::VecDeque;

use millrace_core::mill::{MillInput, MillOutput, Observation};
use millrace_core::{ConnId, Term};

use super::{t, Ev, Proc, Sim};
use crate::checkers::Violation;
use crate::coverage::Path;
use crate::net::Packet;
use crate::scenario::{Micros, LEADER_LEASE, RENEW_AFTER_RESUME, SEC};
use crate::world::Deposed;

impl Sim {
    /// `Fault::PauseMill` (`paused_until`) or `Fault::CutMillStore` (`None`): the leader
    /// loses its leadership; a standby takes over when its lease has run out in the store.
    pub(super) fn depose_leader(&mut self, paused_until: Option<Micros>) {
        let now = self.w.now;
        if self.w.deposed.is_some() || self.w.mill.is_none() || self.w.mill_crash.is_some() {
            return;
        }
        let Some(mill) = self.w.mill.take() else {
            return;
        };
        let takeover = now + LEADER_LEASE;
        self.trace.line(now, "mill", |s| match paused_until {
            Some(u) => s.push_str(&format!(
                "!! paused until {} (its lease runs out at {})",
                crate::trace::secs(u),
                crate::trace::secs(takeover)
            )),
            None => s.push_str("!! cut from its store: every write fails"),
        });
        let inc = self.w.mill_inc;
        self.w.deposed = Some(Deposed {
            mill,
            inc,
            term: self.w.mill_cfg.term,
            addr: self.w.leader_addr,
            paused_until,
            cut: paused_until.is_none(),
            deferred: VecDeque::new(),
        });
        // Connections from now on belong to whoever leads next.
        self.w.mill_inc += 1;
        self.w.mill_tick_at = None;
        self.held[0] = None;
        self.w.mill_restart_at = Some(takeover);
        self.at(takeover, Ev::Restart(Proc::Mill));
        match paused_until {
            Some(until) => self.at(until, Ev::DeposedResume(inc)),
            None => {
                // Its renewals fail from now on; its local lease runs out within one.
                let at = now + self.process.range(SEC / 10, 2 * LEADER_LEASE / 3);
                self.at(at, Ev::DeposedStepDown(inc));
                self.deposed_tick();
            }
        }
    }

    /// Whether `conn` belongs to the deposed mill.
    pub(super) fn deposed_conn(&self, mill_inc: u32) -> bool {
        self.w.deposed.as_ref().is_some_and(|d| d.inc == mill_inc)
    }

    /// A connection attempt to the deposed mill's address: accepted if it runs, unanswered
    /// while it is paused. Returns false if the deposed mill is not at `addr`.
    pub(super) fn deposed_syn(&mut self, conn: ConnId, addr: usize) -> bool {
        let now = self.w.now;
        let Some(d) = self.w.deposed.as_ref() else {
            return false;
        };
        if d.addr != addr {
            return false;
        }
        if d.paused_until.is_some() {
            return true; // a stopped process accepts nothing: the connect times out
        }
        let inc = d.inc;
        if let Some(c) = self.w.net.conns.get_mut(&conn) {
            c.mill_open = true;
            c.mill_inc = inc;
        }
        if let Some(at) = self.w.net.push(now, conn, false, Packet::Accept) {
            self.at(at, Ev::Pump { conn, up: false });
        }
        self.deposed_input(MillInput::Connected { conn });
        true
    }

    /// Feeds the deposed mill (or keeps the input for when it resumes).
    pub(super) fn deposed_input(&mut self, input: MillInput) {
        let now = self.w.now;
        let Some(d) = self.w.deposed.as_mut() else {
            return;
        };
        if d.paused_until.is_some() {
            if !matches!(input, MillInput::Tick) {
                d.deferred.push_back(input);
            }
            return;
        }
        if self.trace.enabled() {
            self.trace
                .line(now, "deposed", |s| crate::trace::mill_input(s, &input));
        }
        d.mill.handle(t(now), input);
        self.deposed_outputs();
    }

    /// Acts on the deposed mill's outputs, in order, until it steps down.
    fn deposed_outputs(&mut self) {
        let now = self.w.now;
        loop {
            let Some(d) = self.w.deposed.as_mut() else {
                return;
            };
            let Some(o) = d.mill.poll_output() else {
                break;
            };
            let (inc, term, cut) = (d.inc, d.term, d.cut);
            if self.trace.enabled() {
                self.trace
                    .line(now, "deposed", |s| crate::trace::mill_output(s, &o));
            }
            match o {
                MillOutput::Send { conn, msg } => {
                    // The checkers know every lease asked of an executor (I6, M30), whoever
                    // asked.
                    if let millrace_core::wire::ToExecutor::ReserveSeat {
                        lease, job, spec, ..
                    } = &msg
                    {
                        if let Some(exec) = self.w.exec_of_conn(conn) {
                            self.w.last_ask[exec] = Some(*lease);
                            self.w.leases.insert(
                                *lease,
                                crate::world::LeaseInfo {
                                    job: *job,
                                    exec,
                                    engine: spec.engine.clone(),
                                    resources: spec.resources.clone(),
                                },
                            );
                        }
                    }
                    self.c.deposed_send(conn, &msg, inc);
                    let open = self
                        .w
                        .net
                        .conns
                        .get(&conn)
                        .is_some_and(|c| c.mill_open && c.mill_inc == inc);
                    if open {
                        let payload = self.encode_down(msg);
                        if let Some(at) = self.w.net.push(now, conn, false, Packet::Msg(payload)) {
                            self.at(at, Ev::Pump { conn, up: false });
                        }
                    }
                }
                MillOutput::Close { conn, .. } => self.deposed_close(conn, inc),
                MillOutput::Persist(batch) => {
                    // The store takes a write only under its own term (I13); a cut mill
                    // reaches no store at all.
                    if cut || term != self.w.mill_cfg.term {
                        let why = if cut {
                            "its write failed: the store cannot be reached".to_string()
                        } else {
                            format!(
                                "its write under {term} failed: the store is at {}",
                                self.w.mill_cfg.term
                            )
                        };
                        return self.deposed_step_down(&why);
                    }
                    self.note_term_write(term, inc);
                    self.w.mill_store.apply(&batch);
                }
                MillOutput::Observed(Observation::Deposed { .. }) => {
                    self.cov.hit(Path::DeposedRefusedHello);
                    // The hint is checked against the store, as the node's driver does.
                    if !cut && term < self.w.mill_cfg.term {
                        return self.deposed_step_down("an executor has seen a higher term");
                    }
                }
                MillOutput::JobUpdate { .. }
                | MillOutput::LiveLog { .. }
                | MillOutput::Observed(_) => {}
            }
        }
        self.deposed_tick();
    }

    fn deposed_close(&mut self, conn: ConnId, inc: u32) {
        let now = self.w.now;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        if c.mill_open && c.mill_inc == inc {
            c.mill_open = false;
            if let Some(at) = self.w.net.push(now, conn, false, Packet::Fin) {
                self.at(at, Ev::Pump { conn, up: false });
            }
        }
    }

    /// The deposed mill's next timer.
    fn deposed_tick(&mut self) {
        let Some(d) = self.w.deposed.as_ref() else {
            return;
        };
        if d.paused_until.is_some() {
            return;
        }
        let inc = d.inc;
        if let Some(at) = d.mill.next_deadline() {
            let at = at.as_micros().max(self.w.now);
            self.at(at, Ev::DeposedTick(inc));
        }
    }

    /// `Ev::DeposedTick`.
    pub(super) fn deposed_timer(&mut self, inc: u32) {
        let due = self.w.deposed.as_ref().is_some_and(|d| {
            d.inc == inc
                && d.paused_until.is_none()
                && d.mill
                    .next_deadline()
                    .is_some_and(|at| at.as_micros() <= self.w.now)
        });
        if due {
            self.deposed_input(MillInput::Tick);
        }
    }

    /// `Ev::DeposedResume`: the paused process runs again — late timers first, then what
    /// waited — and steps down at its next renewal at the latest.
    pub(super) fn deposed_resume(&mut self, inc: u32) {
        let now = self.w.now;
        let Some(d) = self.w.deposed.as_mut().filter(|d| d.inc == inc) else {
            return;
        };
        d.paused_until = None;
        let deferred = std::mem::take(&mut d.deferred);
        self.trace
            .line(now, "deposed", |s| s.push_str("!! resumes (was paused)"));
        let renew = now + self.process.range(0, RENEW_AFTER_RESUME);
        self.at(renew, Ev::DeposedStepDown(inc));
        self.deposed_input(MillInput::Tick);
        for input in deferred {
            if self.w.deposed.as_ref().is_none_or(|d| d.inc != inc) || self.failure.is_some() {
                break;
            }
            self.deposed_input(input);
        }
    }

    /// `Ev::DeposedStepDown`: its renewal failed (or its local lease ran out).
    pub(super) fn deposed_renewal_failed(&mut self, inc: u32) {
        if self
            .w
            .deposed
            .as_ref()
            .is_some_and(|d| d.inc == inc && d.paused_until.is_none())
        {
            self.deposed_step_down("its leadership renewal failed");
        }
    }

    /// The deposed mill stops leading for good: it closes every connection it holds and
    /// forgets its state (its process would restart as a standby).
    pub(super) fn deposed_step_down(&mut self, why: &str) {
        let now = self.w.now;
        let Some(d) = self.w.deposed.take() else {
            return;
        };
        self.trace.line(now, "deposed", |s| {
            s.push_str(&format!("!! steps down: {why}"))
        });
        self.cov.hit(Path::DeposedSteppedDown);
        let conns: Vec<ConnId> = self
            .w
            .net
            .conns
            .iter()
            .filter(|(_, c)| c.mill_open && c.mill_inc == d.inc)
            .map(|(id, _)| *id)
            .collect();
        for conn in conns {
            self.deposed_close(conn, d.inc);
        }
    }

    /// I13: no two mill incarnations commit writes under one term.
    pub(super) fn note_term_write(&mut self, term: Term, inc: u32) {
        let first = *self.w.term_writers.entry(term).or_insert(inc);
        if first != inc {
            self.violate(Violation {
                rule: "I13",
                message: format!(
                    "two mills wrote under {term}: incarnations {first} and {inc} (DESIGN §10: every write is conditional on the writer's term)"
                ),
            });
        }
    }
}

impl Sim {
    /// I13 (E13): an executor handed a message of a term below the highest it has seen sends
    /// `Stale` and then only closes the connection; what came before `Stale` in the step was
    /// its own due timers, run before the message.
    pub(super) fn check_stale_refused(
        &mut self,
        exec: usize,
        outs: &[millrace_core::executor::ExecutorOutput],
        term: Term,
        seen: Term,
    ) {
        use millrace_core::executor::ExecutorOutput;
        use millrace_core::wire::ToMill;
        let stale = outs.iter().position(|o| {
            matches!(
                o,
                ExecutorOutput::Send {
                    msg: ToMill::Stale { .. },
                    ..
                }
            )
        });
        let acted = match stale {
            None => Some("it sent no Stale".to_string()),
            Some(k) => outs[k + 1..]
                .iter()
                .find(|o| !matches!(o, ExecutorOutput::Close { .. }))
                .map(|o| format!("after its Stale it did {o:?}")),
        };
        match acted {
            Some(what) => self.violate(Violation {
                rule: "I13",
                message: format!(
                    "x{exec} acted on a message of {term} after seeing {seen}: {what} (E13)"
                ),
            }),
            None => self.cov.hit(Path::StaleRefused),
        }
    }
}
