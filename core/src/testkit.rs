//! Builders of executor → mill messages and a scripted executor, for tests, benches and the
//! node's load generator (feature `testkit`; always on in this crate's own tests).
//!
//! These are the fake-executor messages that were written out by hand in five places (the
//! node's `loadgen`, the benches' fleet, the latency report, the mill's rule tests and their
//! randomized review): one definition here keeps them agreeing with the wire as it changes.
//! A real executor is [`crate::executor::Executor`]; the [`ScriptedExecutor`] is a honest,
//! instant one — it accepts while it has a free seat, charges the standard charge, and
//! finishes every committed job at once with success — for measuring the mill, not the
//! executor.

use std::collections::{BTreeMap, BTreeSet};

use crate::job::{Identity, JobSpec, TerminalStatus};
use crate::types::{Epoch, LeaseId, Resources, Seqno, Term, SEAT_RESOURCE};
use crate::wire::{
    EndCause, EngineStatus, Event, EventKind, RejectKind, ToExecutor, ToMill, PROTOCOL_VERSION,
};

/// The engine every builder offers unless told otherwise.
pub const SHELL: &str = "shell";

/// A `Hello` with the defaults a test wants (protocol [`PROTOCOL_VERSION`], term 0, the
/// `shell` engine, no labels, no token, 10 s stop grace); setters change one field each.
#[derive(Debug, Clone)]
pub struct Hello {
    msg: HelloFields,
}

#[derive(Debug, Clone)]
struct HelloFields {
    node_id: String,
    epoch: Epoch,
    token: String,
    labels: Vec<String>,
    engines: Vec<String>,
    term: Term,
    stop_grace_ms: u32,
    protocol_version: u32,
}

impl Hello {
    /// A `Hello` from `node_id` in `epoch`.
    pub fn new(node_id: impl Into<String>, epoch: Epoch) -> Self {
        Hello {
            msg: HelloFields {
                node_id: node_id.into(),
                epoch,
                token: String::new(),
                labels: Vec::new(),
                engines: vec![SHELL.to_string()],
                term: Term(0),
                stop_grace_ms: 10_000,
                protocol_version: PROTOCOL_VERSION,
            },
        }
    }

    /// The executor credential (M1).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.msg.token = token.into();
        self
    }

    /// The node's labels (M11).
    pub fn labels<S: ToString>(mut self, labels: &[S]) -> Self {
        self.msg.labels = labels.iter().map(ToString::to_string).collect();
        self
    }

    /// The engines offered (M11).
    pub fn engines<S: ToString>(mut self, engines: &[S]) -> Self {
        self.msg.engines = engines.iter().map(ToString::to_string).collect();
        self
    }

    /// The highest mill term the executor has seen (E13).
    pub fn term(mut self, term: Term) -> Self {
        self.msg.term = term;
        self
    }

    /// The stop grace the executor gives a job between SIGTERM and SIGKILL (E14, M32).
    pub fn stop_grace_ms(mut self, ms: u32) -> Self {
        self.msg.stop_grace_ms = ms;
        self
    }

    /// Offers no engine at all.
    pub fn no_engines(mut self) -> Self {
        self.msg.engines.clear();
        self
    }

    /// The protocol version claimed (M1 refuses any other than [`PROTOCOL_VERSION`]).
    pub fn protocol_version(mut self, version: u32) -> Self {
        self.msg.protocol_version = version;
        self
    }

    /// The message.
    pub fn build(self) -> ToMill {
        let m = self.msg;
        ToMill::Hello {
            protocol_version: m.protocol_version,
            node_id: m.node_id,
            epoch: m.epoch,
            token: m.token,
            labels: m.labels,
            engines: m.engines,
            stop_grace_ms: m.stop_grace_ms,
            term: m.term,
        }
    }
}

/// One engine `name` with `capacity` seats, `available` or not, reporting `load` (0..=1) for
/// the resource `resource`.
pub fn engine(
    name: &str,
    available: bool,
    capacity: u32,
    resource: &str,
    load: f64,
) -> BTreeMap<String, EngineStatus> {
    BTreeMap::from([(
        name.to_string(),
        EngineStatus {
            available,
            capacity,
            load: BTreeMap::from([(resource.to_string(), load)]),
        },
    )])
}

/// A `Snapshot` (M7, M8): `seqno`, the engines, the leases held, the outbox mark.
pub fn snapshot(
    seqno: u64,
    engines: BTreeMap<String, EngineStatus>,
    active_leases: Vec<LeaseId>,
    outbox_high: Seqno,
) -> ToMill {
    ToMill::Snapshot {
        seqno,
        engines,
        active_leases,
        outbox_high,
    }
}

/// An acceptance of `lease` charging `resources` (E2, M14).
pub fn accept(lease: LeaseId, resources: Resources) -> ToMill {
    ToMill::accepted(lease, resources)
}

/// The charge of one seat and nothing else: the standard charge of a job that asks for no
/// resources ([`JobSpec::seat_charge`]).
pub fn one_seat() -> Resources {
    Resources::from([(SEAT_RESOURCE.to_string(), 1)])
}

/// A refusal of `lease` (E2).
pub fn reject(lease: LeaseId, kind: RejectKind, reason: impl Into<String>) -> ToMill {
    ToMill::rejected(lease, kind, reason.into())
}

/// The answer to `CommitLease` (E4).
pub fn commit_result(lease: LeaseId, committed: bool) -> ToMill {
    ToMill::CommitResult { lease, committed }
}

/// An engine's terminal with `status` (exit code 0 for success, 1 otherwise), no log.
pub fn terminal(status: TerminalStatus) -> EventKind {
    EventKind::Terminal {
        status,
        exit_code: Some(if status == TerminalStatus::Success {
            0
        } else {
            1
        }),
        error: None,
        log: None,
        cause: EndCause::Engine,
    }
}

/// Event `seqno` of `lease`.
pub fn event(seqno: Seqno, lease: LeaseId, kind: EventKind) -> Event {
    Event { seqno, lease, kind }
}

/// A successful terminal, event `seqno` of `lease`.
pub fn success(seqno: Seqno, lease: LeaseId) -> Event {
    event(seqno, lease, terminal(TerminalStatus::Success))
}

/// An `EventBatch` of `epoch` (M19, M20).
pub fn batch(epoch: Epoch, events: Vec<Event>) -> ToMill {
    ToMill::EventBatch { epoch, events }
}

/// A `shell` job of `owner` (repo `owner/app`) running `payload`, with every optional field
/// empty.
pub fn shell_job(owner: &str, payload: &str) -> JobSpec {
    JobSpec {
        retry: Default::default(),
        priority: 0,
        node: None,
        engine: SHELL.into(),
        labels: BTreeSet::new(),
        resources: Resources::new(),
        identity: Identity {
            owner: owner.into(),
            repo: format!("{owner}/app"),
        },
        timeout: None,
        payload: payload.as_bytes().to_vec(),
        env: Default::default(),
    }
}

/// What a [`ScriptedExecutor`] cannot go on from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScriptError {
    /// The mill refused the session.
    #[error("refused: {reason}")]
    Refused {
        /// The mill's reason.
        reason: String,
    },
}

/// An honest executor that answers at once, sans-IO like everything in this crate: feed it
/// the mill's messages with [`ScriptedExecutor::handle`], send what it returns. It accepts an
/// ask while reserved seats are below `seats` (charging [`JobSpec::seat_charge`], so direct
/// asks (M35) are accepted too), refuses `Transient` when full, runs a committed job to
/// success at once (`Running` and the terminal in one batch, E5 seqnos from the cursor of its
/// `Welcome`), drops released reservations (E8) and acks cancels (E7). Its snapshots report
/// the reservations it holds. It keeps no outbox: events are sent once, which is enough on a
/// connection that stays up, and is why it is for load, not for fault tests.
#[derive(Debug, Clone)]
pub struct ScriptedExecutor {
    node_id: String,
    epoch: Epoch,
    seats: u32,
    reserved: BTreeSet<LeaseId>,
    next_seqno: Seqno,
    snapshot_seqno: u64,
    welcomed: bool,
    finished: u64,
}

impl ScriptedExecutor {
    /// An executor `node_id` of `epoch` with `seats` seats of the `shell` engine.
    pub fn new(node_id: impl Into<String>, epoch: Epoch, seats: u32) -> Self {
        ScriptedExecutor {
            node_id: node_id.into(),
            epoch,
            seats,
            reserved: BTreeSet::new(),
            next_seqno: Seqno(1),
            snapshot_seqno: 0,
            welcomed: false,
            finished: 0,
        }
    }

    /// The session's first message.
    pub fn hello(&self, token: &str) -> ToMill {
        Hello::new(self.node_id.clone(), self.epoch)
            .token(token)
            .build()
    }

    /// Whether the mill has welcomed the session.
    pub fn welcomed(&self) -> bool {
        self.welcomed
    }

    /// Jobs run to their terminal so far.
    pub fn finished(&self) -> u64 {
        self.finished
    }

    /// A periodic snapshot (M9, E10): `None` before the `Welcome`.
    pub fn snapshot(&mut self) -> Option<ToMill> {
        if !self.welcomed {
            return None;
        }
        self.snapshot_seqno += 1;
        let used = u32::try_from(self.reserved.len()).unwrap_or(u32::MAX);
        let load = (f64::from(used) / f64::from(self.seats.max(1))).min(1.0);
        Some(snapshot(
            self.snapshot_seqno,
            engine(SHELL, used < self.seats, self.seats, "seats", load),
            self.reserved.iter().copied().collect(),
            // Its events go out with the commit; a low mark lets the mill judge at once.
            Seqno(0),
        ))
    }

    /// Answers one message of the mill, appending what to send to `out`.
    pub fn handle(&mut self, msg: ToExecutor, out: &mut Vec<ToMill>) -> Result<(), ScriptError> {
        match msg {
            ToExecutor::Welcome { cursor, .. } => {
                self.welcomed = true;
                self.next_seqno = cursor.next();
                out.extend(self.snapshot());
            }
            ToExecutor::Refused { reason, .. } => return Err(ScriptError::Refused { reason }),
            ToExecutor::ReserveSeat { lease, spec, .. } => {
                let used = u32::try_from(self.reserved.len()).unwrap_or(u32::MAX);
                if used < self.seats {
                    self.reserved.insert(lease);
                    out.push(accept(lease, spec.seat_charge()));
                } else {
                    out.push(reject(lease, RejectKind::Transient, "busy"));
                }
            }
            ToExecutor::CommitLease { lease, .. } => {
                let known = self.reserved.remove(&lease);
                out.push(commit_result(lease, known));
                if known {
                    let running = event(self.next_seqno, lease, EventKind::Running);
                    let done = success(self.next_seqno.next(), lease);
                    self.next_seqno = done.seqno.next();
                    self.finished += 1;
                    out.push(batch(self.epoch, vec![running, done]));
                }
            }
            ToExecutor::ReleaseLease { lease, .. } => {
                self.reserved.remove(&lease);
            }
            ToExecutor::CancelAttempt { lease, .. } => {
                self.reserved.remove(&lease);
                out.push(ToMill::CancelAck { lease });
            }
            ToExecutor::Ack { .. } => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::JobState;
    use crate::mill::{Mill, MillConfig, MillInput, MillOutput};
    use crate::types::{ConnId, JobId, Time};

    /// Scripted executors against a real mill: every job of a burst larger than the fleet's
    /// seats ends Success, bid (M12) or direct (M35), and nothing stays reserved (I6).
    fn run_burst(direct: bool) {
        let mut now = Time::from_micros(1_000_000);
        let config = MillConfig {
            executor_token: Some("t".into()),
            direct_placement: direct,
            ..MillConfig::default()
        };
        let mut mill = Mill::new(config, None, now).unwrap();
        let mut fleet: Vec<(ConnId, ScriptedExecutor)> = (0..3)
            .map(|i| {
                (
                    ConnId(i + 1),
                    ScriptedExecutor::new(format!("x{i}"), Epoch(9), 2),
                )
            })
            .collect();
        let mut wire: Vec<(ConnId, ToMill)> = Vec::new();
        for (conn, x) in &fleet {
            mill.handle(now, MillInput::Connected { conn: *conn });
            wire.push((*conn, x.hello("t")));
        }
        let jobs: Vec<JobId> = (0..20)
            .map(|_| mill.submit(now, shell_job("acme", "true"), 0).unwrap())
            .collect();
        let mut done = BTreeMap::new();
        for _ in 0..10_000 {
            for (conn, msg) in wire.drain(..) {
                mill.handle(now, MillInput::Message { conn, msg });
            }
            now = now.plus(std::time::Duration::from_millis(1));
            mill.handle(now, MillInput::Tick);
            while let Some(o) = mill.poll_output() {
                match o {
                    MillOutput::Send { conn, msg } => {
                        let (_, x) = fleet.iter_mut().find(|(c, _)| *c == conn).unwrap();
                        let mut out = Vec::new();
                        x.handle(msg, &mut out).unwrap();
                        wire.extend(out.into_iter().map(|m| (conn, m)));
                    }
                    MillOutput::JobUpdate {
                        job,
                        state: JobState::Done(t),
                    } => {
                        done.insert(job, t.status);
                    }
                    _ => {}
                }
            }
            if wire.is_empty() && done.len() == jobs.len() {
                break;
            }
        }
        assert_eq!(done.len(), jobs.len(), "every job ends");
        assert!(done.values().all(|s| *s == TerminalStatus::Success));
        let finished: u64 = fleet.iter().map(|(_, x)| x.finished()).sum();
        assert_eq!(finished, 20, "each job ran once");
        assert!(fleet.iter().all(|(_, x)| x.reserved.is_empty()));
    }

    #[test]
    fn scripted_executors_run_a_burst_by_bid() {
        run_burst(false);
    }

    #[test]
    fn scripted_executors_run_a_burst_directly() {
        run_burst(true);
    }

    #[test]
    fn a_refused_session_is_an_error_and_a_full_executor_refuses_transient() {
        let mut x = ScriptedExecutor::new("x", Epoch(1), 0);
        let mut out = Vec::new();
        let refused = ToExecutor::Refused {
            reason: "quarantined".into(),
            leader: None,
        };
        assert_eq!(
            x.handle(refused, &mut out),
            Err(ScriptError::Refused {
                reason: "quarantined".into()
            })
        );
        assert_eq!(x.snapshot(), None, "no snapshot before the Welcome");
        let ask = ToExecutor::ReserveSeat {
            term: Term(1),
            lease: LeaseId(5),
            job: JobId(1),
            spec: Box::new(shell_job("a", "true")),
            ttl: std::time::Duration::from_secs(1),
            direct: false,
        };
        x.handle(ask, &mut out).unwrap();
        assert_eq!(out, vec![reject(LeaseId(5), RejectKind::Transient, "busy")]);
    }
}
