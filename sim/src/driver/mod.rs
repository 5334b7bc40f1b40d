//! The driver: a single-threaded discrete-event loop over a virtual clock. Events are ordered
//! by (time, insertion sequence); each one feeds one input to one process (or changes the
//! network), then the process's outputs are acted on in order — `Persist` applied to its
//! store, messages handed to the network, engine commands to the engine model — with the
//! checkers shown each. A crash may land at any output boundary of a step.

mod failover;
mod faults;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

use millrace_core::codec;
use millrace_core::executor::{
    Executor, ExecutorConfig, ExecutorInput, ExecutorOutput, ExecutorSnapshot, ExecutorWrite,
};
use millrace_core::job::{IdempotencyKey, JobSpec, LogRef, TerminalCause, TerminalStatus};
use millrace_core::mill::{
    Mill, MillInput, MillOutput, MillWrite, Observation, RequestError, Submitted,
};
use millrace_core::wire::{RejectKind, ToExecutor, ToMill};
use millrace_core::JobState;
use millrace_core::{ConnId, Epoch, JobId, LeaseId, NodeId, Resources, Seqno, Time};

use crate::byzantine::{ByzCtx, Byzantine};
use crate::checkers::{Bounds, Checker, EventSummary, StepCtx, StepKind, Violation};
use crate::coverage::{from_rare, Coverage, Path};
use crate::net::{Net, Packet, Payload};
use crate::rng::{Purpose, Rng};
use crate::scenario::{Fault, Micros, Proc, Scenario, SeedPlan, MS, SEC};
use crate::trace::{self, Trace};
use crate::watch::{self, Watch};
use crate::workload::{job_duration, Arrival, Workload};
use crate::world::{CrashPlan, EngineJob, ExecProc, LeaseInfo, World};

/// How an engine's job ends.
#[derive(Debug, Clone, Copy)]
enum Exit {
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

#[derive(Debug)]
enum Ev {
    MillTick,
    ExecTick(usize),
    Pump {
        conn: ConnId,
        up: bool,
    },
    ConnectTimeout {
        exec: usize,
        conn: ConnId,
    },
    ResetNotify {
        conn: ConnId,
        to_mill: bool,
    },
    EngineStart {
        exec: usize,
        run: u64,
        lease: LeaseId,
    },
    EngineExit {
        exec: usize,
        run: u64,
        lease: LeaseId,
        how: Exit,
    },
    /// A supervisor's wait for its executor to come back runs out (E14).
    SupervisorGrace {
        exec: usize,
        lease: LeaseId,
        run: u64,
        orphaned: u32,
    },
    Arrive(usize),
    /// The client of an accepted arrival submits it again under its idempotency key (M31).
    Resubmit(usize),
    UserCancel(usize),
    Fault(usize),
    Unblock {
        side: Vec<usize>,
        up: bool,
        down: bool,
    },
    SpikeEnd(Micros),
    CrashDeadline(Proc),
    Restart(Proc),
    Heal,
    Sample,
    Deadline,
    /// A hung executor's process resumes (`Fault::Hang`).
    Resume(usize),
    /// A twin process is stopped for good (`Fault::Twin`).
    TwinStop(usize),
    /// A paused, deposed mill resumes (`Fault::PauseMill`), by its incarnation.
    DeposedResume(u32),
    /// A deposed mill's timer is due.
    DeposedTick(u32),
    /// A deposed mill's renewal fails: it steps down.
    DeposedStepDown(u32),
    /// A held `Tick` is due to be released (driver lag, I12).
    LagRelease {
        slot: usize,
        gen: u64,
    },
}

/// A stretch of driver lag on one process (`Fault::Lag`).
#[derive(Debug, Clone, Copy)]
struct LagWindow {
    until: Micros,
    max_delay: Micros,
    max_inputs: u32,
}

/// A due `Tick` a lagging driver holds back: released after `inputs_left` more inputs or at
/// `release_at`, whichever comes first.
#[derive(Debug, Clone, Copy)]
struct Hold {
    inputs_left: u32,
    release_at: Micros,
    gen: u64,
}

struct Entry {
    at: Micros,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    // A max-heap popping the earliest (time, sequence) first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// Counters of one run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    /// Events processed.
    pub events: u64,
    /// Mill steps.
    pub mill_steps: u64,
    /// Executor steps.
    pub exec_steps: u64,
    /// Messages (and connection packets) sent.
    pub packets: u64,
    /// Jobs accepted.
    pub accepted: u64,
    /// Keyed retries of accepted jobs answered (M31).
    pub resubmits: u64,
    /// Protocol violations the mill observed.
    pub violations: u64,
    /// Ticks a lagging driver delivered after their deadline (I12).
    pub late_ticks: u64,
    /// The latest a lagging driver delivered a deadline.
    pub max_tick_lateness: Micros,
}

/// Connect attempts give up after this long without an answer.
const CONNECT_TIMEOUT: Micros = 3 * SEC;
/// How often the time-bounded checkers run (their bounds are tens of seconds).
const SAMPLE: Micros = 2 * SEC;
/// An armed crash lands at the latest this long after it was armed.
const CRASH_DEADLINE: Micros = 2 * SEC;
/// A crash waiting for a commit lands at the latest this long after it was armed.
pub const COMMIT_CRASH_WAIT: Micros = 60 * SEC;

/// The simulation of one seed.
pub struct Sim {
    /// The world.
    pub w: World,
    /// The checkers.
    pub c: Checker,
    queue: BinaryHeap<Entry>,
    seq: u64,
    engines: Rng,
    process: Rng,
    byz: Rng,
    /// The trace.
    pub trace: Trace,
    /// Rare paths reached.
    pub cov: Coverage,
    /// Counters.
    pub stats: Stats,
    /// The first broken rule.
    pub failure: Option<Violation>,
    names: Vec<String>,
    mill_outs: Vec<MillOutput>,
    exec_outs: Vec<ExecutorOutput>,
    /// (exec, epoch, seqno): a restarted executor's unacked result, until the mill has it.
    restart_results: Vec<(usize, Epoch, Seqno)>,
    /// The input of the mill step in progress, for the checkers.
    ctx: StepCtx,
    /// The executor step in progress handles a message of this term, below the one it has
    /// seen (term, seen): E13 says it must be refused (checked by `check_stale_refused`).
    exec_stale: Option<(millrace_core::Term, millrace_core::Term)>,
    /// Per executor, (epoch, the highest term it accepted a `Welcome` of in it), as the
    /// simulator saw it (I13 judges against it, not only against the executor's own store).
    seen_terms: Vec<Option<(Epoch, millrace_core::Term)>>,
    /// Accumulates `codec_fraction` per message.
    codec_credit: f64,
    /// Whether the last mill step wrote anything.
    step_wrote: bool,
    /// Whether the last mill step emitted anything at all.
    step_outputs: usize,
    done: bool,
    deadline: Option<Micros>,
    /// Counts the situations scenario files target (`watch`).
    watch: Watch,
    /// Per-job submit, placement and terminal times (latency and quality reports).
    pub times: crate::latency::JobTimes,
    /// Exact job durations instead of the engine model's (placement-quality runs).
    pub durations: Option<crate::quality::Durations>,
    /// Driver lag in force, by slot (0: the mill; i + 1: executor i).
    lag: Vec<Option<LagWindow>>,
    /// The due `Tick` each lagging driver holds back, by slot.
    held: Vec<Option<Hold>>,
    hold_gen: u64,
    lag_rng: Rng,
    /// Engine runs started so far: each run's id (`EngineJob::run`).
    runs: u64,
    /// The executor step in progress received a `CommitLease` for this lease.
    exec_commit_input: Option<LeaseId>,
    /// (executor, lease): commits an executor lost in a crash before persisting them, its
    /// store (and epoch) kept.
    lost_commits: Vec<(usize, LeaseId)>,
    /// Leases whose job a user cancelled while their node was disconnected from the mill.
    cancels_while_down: BTreeSet<LeaseId>,
    /// The charge of each job's latest accepted bid, as the mill received it.
    last_charge: BTreeMap<JobId, Resources>,
    /// When the mill last received a message on each connection (M9 coverage).
    last_up: BTreeMap<ConnId, Micros>,
    /// (connection, lease): each `CommitLease` the mill sent (M17 coverage).
    commits_sent: BTreeSet<(ConnId, LeaseId)>,
    /// Plan index of each `Fault::Twin` → the twin's process index.
    twin_of_fault: BTreeMap<usize, usize>,
    /// Connections the mill welcomed (M2).
    welcomed: BTreeSet<ConnId>,
    /// (Hello's connection, rival connection, when the rival was last heard): a Hello in
    /// progress while another process of its node id held a live session (M2).
    rival: Option<(ConnId, ConnId, Micros)>,
}

fn t(m: Micros) -> Time {
    Time::from_micros(m)
}

impl Sim {
    /// A crashed process's side of each connection in `fins` closes: a FIN travels toward
    /// the peer (`up`: from the executor to the mill).
    fn send_fins(&mut self, now: u64, fins: Vec<ConnId>, up: bool) {
        for conn in fins {
            if let Some(at) = self.w.net.push(now, conn, up, Packet::Fin) {
                self.at(at, Ev::Pump { conn, up });
            }
        }
    }

    /// Builds the world of `seed` in `scenario`.
    pub fn new(scenario: &Scenario, seed: u64, trace: Trace) -> Sim {
        Sim::with_workload(scenario, seed, trace, None)
    }

    /// Builds the world of `seed` in `scenario`, with `workload` instead of the drawn one
    /// when given (placement-quality runs bring their own fleet and arrivals).
    pub fn with_workload(
        scenario: &Scenario,
        seed: u64,
        trace: Trace,
        workload: Option<Workload>,
    ) -> Sim {
        let plan = SeedPlan::new(scenario, seed);
        let mut wl_rng = Rng::new(seed, Purpose::Workload);
        let mut byz = Rng::new(seed, Purpose::Byzantine);
        let workload = workload.unwrap_or_else(|| {
            let mut retry = Rng::new(seed, Purpose::Retry);
            let mut drawn =
                Workload::draw(scenario, &plan.swarm, &mut wl_rng, &mut byz, &mut retry);
            if let Some(keep) = &scenario.keep {
                drawn.arrivals = crate::scenario::keep_indices(drawn.arrivals, &keep.jobs);
            }
            drawn
        });
        let mut process = Rng::new(seed, Purpose::Process);
        let mut mill_cfg = scenario.mill_config();
        if scenario.config.direct_placement.is_none() {
            mill_cfg.direct_placement = crate::scenario::direct_for_seed(seed);
        }
        mill_cfg.quota = workload.quota.clone();
        mill_cfg.max_pending = workload.max_pending;
        let n = workload.fleet.len();
        let mut execs = Vec::with_capacity(n);
        let mut index = BTreeMap::new();
        // In half the seeds the executors start on timer flags of their own (half, once,
        // twice or three times the mill's): only the timers in `Welcome` make them agree
        // (M1, E12). An executor that kept a longer grace would run a job on after the mill
        // failed its lease and placed it again (I1).
        // DESIGN §10: with the failover family the executors know two mill addresses; a
        // standby listens on the one the leader does not.
        let mill_addrs = if plan.swarm.has(crate::scenario::Family::Failover) {
            2
        } else {
            1
        };
        let mut flags = Rng::new(seed, Purpose::Flags);
        let drift = flags.chance(0.5);
        for (i, spec) in workload.fleet.iter().enumerate() {
            let node =
                NodeId::new(spec.name.clone()).unwrap_or_else(|e| panic!("fleet node id: {e}"));
            index.insert(node.clone(), i);
            let mut cfg = ExecutorConfig::new(node.clone(), "sim-token");
            cfg.mills = (0..mill_addrs).map(|a| format!("mill-{a}")).collect();
            cfg.labels = spec.labels.clone();
            cfg.engines = spec.engines.clone();
            let (num, den) = if drift {
                [(1, 2), (1, 1), (2, 1), (3, 1)][flags.range(0, 3) as usize]
            } else {
                (1, 1)
            };
            cfg.reconnect_grace = mill_cfg.reconnect_grace * num / den;
            cfg.silence_timeout = mill_cfg.silence_timeout * num / den;
            cfg.snapshot_interval = mill_cfg.snapshot_interval * num / den;
            cfg.backoff_max = cfg.backoff_max.min(mill_cfg.reconnect_grace / 3);
            cfg.stop_grace = cfg.stop_grace.min(mill_cfg.cancel_teardown_timeout / 2);
            cfg.backoff_seed = process.next_u64();
            if let Err(e) = cfg.validate() {
                panic!("fleet config of x{i}: {e}");
            }
            let epoch = Epoch(process.range(1, u64::MAX / 2));
            execs.push(ExecProc {
                spec: spec.clone(),
                node,
                cfg,
                exec: None,
                store: ExecutorSnapshot::fresh(epoch),
                synced: None,
                inc: 0,
                tick_at: None,
                crash: None,
                byz: spec.byzantine.map(Byzantine::new),
                connecting: None,
                engine: BTreeMap::new(),
                recorded: BTreeMap::new(),
                restart_at: None,
                held_before: Default::default(),
                outbox_before: None,
                lost: false,
                hung_until: None,
                deferred: Default::default(),
                away_since_inc: None,
                twin_of: None,
            });
        }
        // Twins (`Fault::Twin`), one process each, after the fleet, in plan order.
        let mut twin_of_fault = BTreeMap::new();
        for (k, (_, f)) in plan.faults.faults.iter().enumerate() {
            let Fault::Twin { exec, .. } = f else {
                continue;
            };
            let Some(first) = execs.get(*exec) else {
                continue;
            };
            let mut cfg = first.cfg.clone();
            cfg.backoff_seed = process.next_u64();
            let epoch = Epoch(process.range(1, u64::MAX / 2));
            let p = ExecProc {
                spec: first.spec.clone(),
                node: first.node.clone(),
                cfg,
                exec: None,
                store: ExecutorSnapshot::fresh(epoch),
                synced: None,
                inc: 0,
                tick_at: None,
                crash: None,
                byz: None,
                connecting: None,
                engine: BTreeMap::new(),
                recorded: BTreeMap::new(),
                restart_at: None,
                held_before: Default::default(),
                outbox_before: None,
                lost: true,
                hung_until: None,
                deferred: Default::default(),
                away_since_inc: None,
                twin_of: Some(*exec),
            };
            twin_of_fault.insert(k, execs.len());
            execs.push(p);
        }
        let fleet_len = n;
        let n = execs.len();
        let bounds = Bounds {
            stop: dur(mill_cfg.reconnect_grace) + dur(mill_cfg.silence_timeout) + 5 * SEC,
            live: crate::liveness::Allowances::new(
                &mill_cfg,
                scenario,
                plan.swarm.has(crate::scenario::Family::DriverLag),
            ),
        };
        let arrivals = workload.arrivals.len();
        let w = World {
            now: 0,
            scenario: scenario.clone(),
            heal_at: scenario.fault_window,
            plan,
            workload,
            mill_cfg,
            mill: None,
            mill_store: Default::default(),
            mill_inc: 0,
            mill_tick_at: None,
            mill_crash: None,
            mill_crashes_planned: 0,
            mill_host_down: false,
            mill_restart_at: None,
            execs,
            net: Net::new(n, Rng::new(seed, Purpose::Network)),
            healed: false,
            job_of_arrival: vec![None; arrivals],
            arrivals_done: 0,
            leases: BTreeMap::new(),
            last_ask: vec![None; n],
            index,
            snapshot_delivered: vec![None; n],
            mill_addrs,
            leader_addr: 0,
            deposed: None,
            term_writers: BTreeMap::new(),
        };
        let mut names = vec!["mill".to_string()];
        names.extend((0..fleet_len).map(|i| format!("x{i}")));
        for p in &w.execs[fleet_len..] {
            names.push(format!("x{}-twin", p.twin_of.unwrap_or(0)));
        }
        Sim {
            w,
            c: Checker::new(bounds),
            queue: BinaryHeap::with_capacity(4096),
            seq: 0,
            engines: Rng::new(seed, Purpose::Engines),
            process,
            byz,
            trace,
            cov: Coverage::default(),
            stats: Stats::default(),
            failure: None,
            names,
            mill_outs: Vec::new(),
            exec_outs: Vec::new(),
            restart_results: Vec::new(),
            ctx: StepCtx::default(),
            exec_stale: None,
            seen_terms: vec![None; n],
            codec_credit: 0.0,
            step_wrote: false,
            step_outputs: 0,
            done: false,
            deadline: None,
            watch: Watch::default(),
            times: Default::default(),
            durations: None,
            lag: vec![None; n + 1],
            held: vec![None; n + 1],
            hold_gen: 0,
            lag_rng: Rng::new(seed, Purpose::Lag),
            exec_commit_input: None,
            lost_commits: Vec::new(),
            cancels_while_down: BTreeSet::new(),
            last_charge: BTreeMap::new(),
            last_up: BTreeMap::new(),
            commits_sent: BTreeSet::new(),
            twin_of_fault,
            runs: 0,
            welcomed: BTreeSet::new(),
            rival: None,
        }
    }

    fn at(&mut self, at: Micros, ev: Ev) {
        self.seq += 1;
        self.queue.push(Entry {
            at: at.max(self.w.now),
            seq: self.seq,
            ev,
        });
    }

    fn violate(&mut self, v: Violation) {
        if !self.w.scenario.checks(v.rule) {
            return; // the scenario file leaves this invariant out (`expect.invariants`)
        }
        if self.failure.is_none() {
            let now = self.w.now;
            let text = v.to_string();
            self.trace.line(now, "sim", |s| {
                s.push_str("!! ");
                s.push_str(&text);
            });
            self.failure = Some(v);
        }
    }

    fn check(&mut self, r: Result<(), Violation>) {
        if let Err(v) = r {
            self.violate(v);
        }
    }

    /// Runs to the end: everything quiescent after the heal, a failure, or the liveness bound.
    pub fn run(&mut self) {
        let mill = Mill::new(self.w.mill_cfg.clone(), None, t(0));
        match mill {
            Ok(m) => self.w.mill = Some(m),
            Err(e) => {
                self.violate(Violation {
                    rule: "config",
                    message: format!("mill config: {e}"),
                });
                return;
            }
        }
        self.after_mill_step();
        for i in 0..self.w.execs.len() {
            if self.w.execs[i].twin_of.is_none() {
                self.start_exec(i);
            }
        }
        for k in 0..self.w.workload.arrivals.len() {
            let at = self.w.workload.arrivals[k].0;
            self.at(at, Ev::Arrive(k));
        }
        for k in 0..self.w.plan.faults.faults.len() {
            let at = self.w.plan.faults.faults[k].0;
            self.at(at, Ev::Fault(k));
        }
        self.at(self.w.heal_at, Ev::Heal);
        self.at(SAMPLE, Ev::Sample);
        while let Some(e) = self.queue.pop() {
            if self.failure.is_some() || self.done {
                break;
            }
            self.w.now = self.w.now.max(e.at);
            self.stats.events += 1;
            self.event(e.ev);
        }
        self.stats.packets = self.w.net.sent;
        self.trace.finish();
    }

    fn event(&mut self, ev: Ev) {
        let now = self.w.now;
        match ev {
            Ev::MillTick => {
                if self.w.mill_tick_at == Some(now) {
                    self.w.mill_tick_at = None;
                }
                let due = self
                    .w
                    .mill
                    .as_ref()
                    .and_then(|m| m.next_deadline())
                    .is_some_and(|d| d.as_micros() <= now);
                if due {
                    if !self.hold_tick(0) {
                        self.mill_input(MillInput::Tick);
                    }
                } else {
                    self.schedule_mill_tick();
                }
            }
            Ev::ExecTick(i) => {
                if self.w.execs[i].tick_at == Some(now) {
                    self.w.execs[i].tick_at = None;
                }
                let due = self.w.execs[i]
                    .exec
                    .as_ref()
                    .and_then(|x| x.next_deadline())
                    .is_some_and(|d| d.as_micros() <= now);
                if due {
                    if !self.hold_tick(i + 1) {
                        self.exec_input(i, ExecutorInput::Tick);
                    }
                } else {
                    self.schedule_exec_tick(i);
                }
            }
            Ev::Pump { conn, up } => self.pump(conn, up),
            Ev::ConnectTimeout { exec, conn } => {
                if self.w.execs[exec].connecting == Some(conn) {
                    self.w.execs[exec].connecting = None;
                    self.abandon(conn);
                    self.exec_input(exec, ExecutorInput::ConnectFailed);
                }
            }
            Ev::ResetNotify { conn, to_mill } => self.reset_notify(conn, to_mill),
            Ev::EngineStart { exec, run, lease } => {
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
            Ev::EngineExit {
                exec,
                run,
                lease,
                how,
            } => self.engine_exit(exec, run, lease, how),
            Ev::SupervisorGrace {
                exec,
                lease,
                run,
                orphaned,
            } => self.supervisor_grace(exec, lease, run, orphaned),
            Ev::Arrive(k) => self.arrive(k),
            Ev::Resubmit(k) => self.resubmit(k),
            Ev::UserCancel(k) => {
                if let Some(job) = self.w.job_of_arrival[k] {
                    watch::user_cancel(&self.w, job, &mut self.cov);
                    self.note_cancel_while_down(job);
                    let before = self.w.mill.as_ref().and_then(|m| m.job_state(job));
                    let inc = self.w.mill_inc;
                    let r = self.mill_cancel(job, "cancelled by its user".into());
                    // Accepted: answered Ok by a mill that did not crash in that step (I11).
                    if matches!(r, Some(Ok(()))) && self.w.mill_inc == inc {
                        self.c.cancel_accepted(&self.w, job, before);
                    }
                }
            }
            Ev::Fault(k) => {
                if !self.w.healed {
                    let fault = self.w.plan.faults.faults[k].1.clone();
                    if let Fault::Twin { until, .. } = fault {
                        if let Some(&twin) = self.twin_of_fault.get(&k) {
                            self.twin_starts(twin, until);
                        }
                    }
                    self.fault(fault);
                }
            }
            Ev::Unblock { side, up, down } => {
                for &i in &side {
                    if up {
                        self.w.net.blocks.up[i] = self.w.net.blocks.up[i].saturating_sub(1);
                    }
                    if down {
                        self.w.net.blocks.down[i] = self.w.net.blocks.down[i].saturating_sub(1);
                    }
                }
                self.trace.line(now, "net", |s| {
                    s.push_str(&format!("unblock {side:?} up={up} down={down}"))
                });
                self.repump(|i| side.contains(&i));
            }
            Ev::SpikeEnd(extra) => {
                self.w.net.spike = self.w.net.spike.saturating_sub(extra);
            }
            Ev::CrashDeadline(p) => match p {
                Proc::Mill => {
                    if let Some(plan) = self.w.mill_crash.take() {
                        self.crash_mill(plan);
                    }
                }
                Proc::Exec(i) => {
                    if let Some(plan) = self.w.execs[i].crash.take() {
                        self.crash_exec(i, plan);
                    }
                }
            },
            Ev::Restart(p) => match p {
                Proc::Mill => {
                    if self.w.mill.is_none() && self.w.mill_restart_at.is_some_and(|r| r <= now) {
                        self.restart_mill();
                    }
                }
                Proc::Exec(i) => {
                    let p = &self.w.execs[i];
                    if p.exec.is_none() && p.restart_at.is_some_and(|r| r <= now) {
                        self.start_exec(i);
                    }
                }
            },
            Ev::Heal => self.heal(),
            Ev::Sample => {
                let r = self.c.sample(&self.w);
                if r.as_ref().is_err_and(|v| v.rule == "I9") && !self.w.scenario.checks("I9") {
                    self.done = true; // liveness is left out: stop at the bound without a verdict
                    return;
                }
                self.check(r);
                if self.w.healed && self.failure.is_none() && self.quiet() {
                    let r = self.c.quiescent(&self.w);
                    self.check(r);
                    self.done = true;
                    self.trace
                        .line(now, "sim", |s| s.push_str("quiescent: done"));
                    return;
                }
                if self.w.healed && self.failure.is_none() && self.c.quiet_overdue(now) {
                    return self.stuck();
                }
                self.at(now + SAMPLE, Ev::Sample);
            }
            Ev::Deadline => self.stuck(),
            Ev::TwinStop(i) => {
                let p = &mut self.w.execs[i];
                p.lost = true;
                p.restart_at = None;
                p.crash = None;
                if p.exec.is_some() {
                    let plan = CrashPlan {
                        wipe: false,
                        down: 0,
                        silent: false,
                        at_commit: false,
                    };
                    self.crash_exec(i, plan);
                }
            }
            Ev::Resume(i) => {
                if self.w.execs[i].hung_until.is_some_and(|u| u <= now) {
                    self.resume(i);
                }
            }
            Ev::DeposedResume(inc) => self.deposed_resume(inc),
            Ev::DeposedTick(inc) => self.deposed_timer(inc),
            Ev::DeposedStepDown(inc) => self.deposed_renewal_failed(inc),
            Ev::LagRelease { slot, gen } => {
                if self.held[slot].is_some_and(|h| h.gen == gen) {
                    self.release_tick(slot);
                }
            }
        }
    }

    // ---- rare-path bookkeeping -------------------------------------------------------------

    /// A user cancels `job`: remembered when its lease's node is disconnected from the mill,
    /// so that the `CancelAttempt` sent after the reconnect is counted (M26).
    fn note_cancel_while_down(&mut self, job: JobId) {
        let Some(m) = self.w.mill.as_ref() else {
            return;
        };
        let Some(JobState::Running { lease, node }) = m.job_state(job) else {
            return;
        };
        let connected = m.sessions().any(|(n, c)| *n == node && c);
        if !connected {
            self.cancels_while_down.insert(lease);
        }
    }

    /// The mill is about to apply a batch from `exec`: counts it when the node is
    /// recovering within the last fifth of its grace, or past its grace deadline while the
    /// mill's `Tick` is held (M5, M6, I12). Call before the step; `applied` after.
    fn grace_left(&self, exec: usize) -> Option<Micros> {
        let m = self.w.mill.as_ref()?;
        let node = &self.w.execs[exec].node;
        let v = m.session_views().find(|v| v.node == node)?;
        if !v.connected || !v.in_grace {
            return None;
        }
        let deadline = v.grace_deadline?.as_micros();
        let window = dur(self.w.mill_cfg.reconnect_grace) / 5;
        let now = self.w.now;
        (deadline <= now + window).then(|| deadline.saturating_sub(now))
    }

    /// The mill received an accepted bid from `exec` charging `resources`: counts a charge
    /// that differs from the job's previous accepted bid on a resource its owner or repo has
    /// a quota limit on (M14, M15).
    fn note_charge(&mut self, lease: LeaseId, resources: &Resources) {
        let Some(info) = self.w.leases.get(&lease) else {
            return;
        };
        let job = info.job;
        let Some(identity) = self
            .w
            .mill_store
            .jobs
            .get(&job)
            .map(|r| r.spec.identity.clone())
        else {
            return;
        };
        if let Some(prev) = self.last_charge.get(&job) {
            let quota = &self.w.mill_cfg.quota;
            let names: BTreeSet<&String> = prev.keys().chain(resources.keys()).collect();
            let changed_limited = names.into_iter().any(|name| {
                prev.get(name) != resources.get(name)
                    && millrace_core::quota::Scope::of(&identity)
                        .iter()
                        .any(|scope| quota.limit(scope, name).is_some())
            });
            if changed_limited {
                self.cov.hit(Path::ChargeChangeOnLimitedResource);
            }
        }
        self.last_charge.insert(job, resources.clone());
    }

    /// The mill's teardown deadline fired: counts each cancelled job whose engine never
    /// stopped and which the mill has now ended (M26).
    fn note_teardown_deadline(&mut self) {
        let Some(m) = self.w.mill.as_ref() else {
            return;
        };
        let mut hits = 0;
        for p in &mut self.w.execs {
            for j in p.engine.values_mut() {
                if j.forever
                    && !j.counted
                    && m.job_state(j.job)
                        .is_none_or(|s| matches!(s, JobState::Done(_)))
                {
                    j.counted = true;
                    hits += 1;
                }
            }
        }
        for _ in 0..hits {
            self.cov.hit(Path::CancelEndedByDeadline);
        }
    }

    /// A snapshot of `exec` reaches the mill: counts each commit the executor lost in a
    /// crash before persisting it (same epoch) that the snapshot leaves out while the mill
    /// still holds the lease (M8 releases it, M29).
    fn note_lost_commits(&mut self, exec: usize, active: &[LeaseId]) {
        if self.lost_commits.iter().all(|(i, _)| *i != exec) {
            return;
        }
        let Some(m) = self.w.mill.as_ref() else {
            return;
        };
        let held: BTreeSet<LeaseId> = m.leases().map(|(l, ..)| l).collect();
        let mut hits = 0;
        self.lost_commits.retain(|(i, lease)| {
            if *i != exec {
                return true;
            }
            if held.contains(lease) && !active.contains(lease) {
                hits += 1;
            }
            false
        });
        for _ in 0..hits {
            self.cov.hit(Path::LostCommitKeptEpoch);
        }
    }

    // ---- driver lag (I12) ----------------------------------------------------------------

    /// A due `Tick` for `slot` (0: the mill, i + 1: executor i): a lagging driver holds it
    /// back behind a batch of inputs, as the node's drivers do (they take up to 1–2k inputs
    /// before a `Tick`). Returns whether it is held.
    fn hold_tick(&mut self, slot: usize) -> bool {
        let now = self.w.now;
        if self.held[slot].is_some() {
            return true;
        }
        let Some(lag) = self.lag[slot].filter(|l| now < l.until) else {
            return false;
        };
        let inputs_left = self.lag_rng.range(1, u64::from(lag.max_inputs.max(1))) as u32;
        let delay = self.lag_rng.range(MS, lag.max_delay.max(MS));
        self.hold_gen += 1;
        let gen = self.hold_gen;
        let release_at = now + delay;
        self.held[slot] = Some(Hold {
            inputs_left,
            release_at,
            gen,
        });
        self.at(release_at, Ev::LagRelease { slot, gen });
        true
    }

    /// One more input reached the process of `slot`: a held `Tick` whose batch is complete
    /// is released right after this step (an event at the same instant, so the step's
    /// caller still sees its own outputs).
    fn count_held_input(&mut self, slot: usize) {
        let now = self.w.now;
        let Some(h) = self.held[slot].as_mut() else {
            return;
        };
        if h.inputs_left == 0 {
            return; // released already, waiting for its event
        }
        h.inputs_left -= 1;
        if h.inputs_left == 0 {
            h.release_at = now;
            let gen = h.gen;
            self.at(now, Ev::LagRelease { slot, gen });
        }
    }

    /// The lagging driver of `slot` gets to its `Tick`: handled if still due (the node's
    /// drivers check `next_deadline() <= now` too), counted when late.
    fn release_tick(&mut self, slot: usize) {
        let now = self.w.now;
        self.held[slot] = None;
        let deadline = if slot == 0 {
            self.w.mill.as_ref().and_then(|m| m.next_deadline())
        } else {
            self.w.execs[slot - 1]
                .exec
                .as_ref()
                .and_then(|x| x.next_deadline())
        };
        let Some(d) = deadline.map(|d| d.as_micros()) else {
            return;
        };
        if d > now {
            // Handled meanwhile (an executor runs due timers before any input).
            if slot == 0 {
                self.schedule_mill_tick();
            } else {
                self.schedule_exec_tick(slot - 1);
            }
            return;
        }
        let late = now - d;
        if late > 0 {
            self.stats.late_ticks += 1;
            self.stats.max_tick_lateness = self.stats.max_tick_lateness.max(late);
            self.cov.hit(Path::LateTick);
        }
        if slot == 0 {
            self.mill_input(MillInput::Tick);
        } else {
            self.exec_input(slot - 1, ExecutorInput::Tick);
        }
    }

    // ---- the mill ------------------------------------------------------------------------

    /// Feeds the mill one input; `self.ctx` says what it was (reset to `Other` after).
    /// False if the mill is down.
    fn mill_input(&mut self, input: MillInput) -> bool {
        let traced = |s: &mut String| trace::mill_input(s, &input);
        let line = self.trace.enabled().then(|| line_of(traced));
        let tick = matches!(input, MillInput::Tick);
        self.mill_step(line, tick, |mill, now| mill.handle(now, input))
            .is_some()
    }

    /// A client's submit, through [`Mill::submit`]; `None` if the mill is down.
    fn mill_submit(&mut self, spec: JobSpec, at_ms: u64) -> Option<Result<JobId, RequestError>> {
        self.mill_submit_keyed(spec, at_ms, None)
            .map(|r| r.map(|s| s.job))
    }

    /// A client's submit under an optional idempotency key, through
    /// [`Mill::submit_keyed`] (M31); `None` if the mill is down.
    fn mill_submit_keyed(
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
    fn mill_cancel(&mut self, job: JobId, reason: String) -> Option<Result<(), RequestError>> {
        let line = self
            .trace
            .enabled()
            .then(|| line_of(|s| trace::mill_cancel(s, job)));
        self.mill_step(line, false, |mill, now| mill.cancel(now, job, reason))
    }

    /// One step of the mill: traces `line`, calls `f`, then acts on the outputs. `tick`
    /// says the step was a Tick (which does not count as an input driver lag waits for).
    fn mill_step<R>(
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
    fn after_mill_step(&mut self) {
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

    fn schedule_mill_tick(&mut self) {
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

    fn mill_output(&mut self, o: MillOutput) {
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
    fn through_codec(&mut self) -> bool {
        self.codec_credit += self.w.scenario.codec_fraction;
        if self.codec_credit >= 1.0 {
            self.codec_credit -= 1.0;
            return true;
        }
        false
    }

    fn encode_down(&mut self, msg: ToExecutor) -> Payload {
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

    fn encode_up(&mut self, msg: ToMill) -> Payload {
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

    // ---- executors -----------------------------------------------------------------------

    fn exec_input(&mut self, i: usize, input: ExecutorInput) {
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
        p.held_before
            .extend(x.reserved_leases().chain(x.running_leases()));
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

    fn after_exec_step(&mut self, i: usize) {
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

    fn schedule_exec_tick(&mut self, i: usize) {
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

    fn exec_output(&mut self, i: usize, o: ExecutorOutput) {
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

    /// The engine's run of `lease` on executor `i` is asked to stop, by its executor
    /// (`StopJob`) or by its supervisor (E14); `how` is what its exit will report. A slow
    /// engine may hang past the stop, or (before the heal) ignore it for good.
    fn stop_run(&mut self, i: usize, lease: LeaseId, how: Exit) {
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

    fn engine_exit(&mut self, exec: usize, run: u64, lease: LeaseId, how: Exit) {
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
    fn supervisor_grace(&mut self, i: usize, lease: LeaseId, run: u64, orphaned: u32) {
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

    // ---- the network ---------------------------------------------------------------------

    fn pump(&mut self, conn: ConnId, up: bool) {
        let now = self.w.now;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let exec = c.exec;
        let d = if up { &mut c.up } else { &mut c.down };
        if d.pump_at != Some(now) {
            return; // stale
        }
        d.pump_at = None;
        if c.reset {
            return;
        }
        let blocked = {
            let b = if up {
                &self.w.net.blocks.up
            } else {
                &self.w.net.blocks.down
            };
            b[exec] > 0
        };
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let d = if up { &mut c.up } else { &mut c.down };
        if blocked {
            return; // held until the block clears (repump)
        }
        let Some((at, _)) = d.queue.front() else {
            return;
        };
        if *at > now {
            let at = *at;
            d.pump_at = Some(at);
            self.at(at, Ev::Pump { conn, up });
            return;
        }
        let Some((_, packet)) = d.queue.pop_front() else {
            return;
        };
        if let Some((next, _)) = d.queue.front() {
            let next = (*next).max(now);
            d.pump_at = Some(next);
            self.at(next, Ev::Pump { conn, up });
        }
        if up {
            self.deliver_up(conn, packet);
        } else {
            self.deliver_down(conn, packet);
        }
        self.w.net.reap(conn);
    }

    /// Schedules deliveries held by blocks that no longer apply, for executors `which`.
    fn repump(&mut self, which: impl Fn(usize) -> bool) {
        let now = self.w.now;
        let mut todo = Vec::new();
        for (id, c) in self.w.net.conns.iter_mut() {
            if !which(c.exec) || c.reset {
                continue;
            }
            for (up, d) in [(true, &mut c.up), (false, &mut c.down)] {
                if d.pump_at.is_none() {
                    if let Some((at, _)) = d.queue.front() {
                        let at = (*at).max(now);
                        d.pump_at = Some(at);
                        todo.push((at, *id, up));
                    }
                }
            }
        }
        for (at, conn, up) in todo {
            self.at(at, Ev::Pump { conn, up });
        }
    }

    fn deliver_up(&mut self, conn: ConnId, packet: Packet) {
        let now = self.w.now;
        let mill_up = self.w.mill.is_some();
        let inc = self.w.mill_inc;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let exec = c.exec;
        let (addr, conn_inc, conn_open) = (c.addr, c.mill_inc, c.mill_open);
        // DESIGN §10: a deposed mill still holds what it accepted, and its address.
        if self.deposed_conn(conn_inc) && conn_open && !matches!(packet, Packet::Syn) {
            return self.deliver_to_deposed(conn, packet);
        }
        if matches!(packet, Packet::Syn) && self.deposed_syn(conn, addr) {
            return;
        }
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        match packet {
            Packet::Syn if addr != self.w.leader_addr => {
                // A standby listens there and takes no executor (it would answer `Hello`
                // with `Refused{leader}`, E13 tests that in core).
                if let Some(at) = self.w.net.push(now, conn, false, Packet::Refuse) {
                    self.at(at, Ev::Pump { conn, up: false });
                }
            }
            Packet::Syn => {
                if mill_up {
                    c.mill_open = true;
                    c.mill_inc = inc;
                    self.watch.mill_connected(inc, now, &mut self.cov);
                    if let Some(at) = self.w.net.push(now, conn, false, Packet::Accept) {
                        self.at(at, Ev::Pump { conn, up: false });
                    }
                    self.mill_input(MillInput::Connected { conn });
                } else if !self.w.mill_host_down {
                    if let Some(at) = self.w.net.push(now, conn, false, Packet::Refuse) {
                        self.at(at, Ev::Pump { conn, up: false });
                    }
                }
            }
            Packet::Msg(payload) => {
                // What the misbehaving executor's filter said of this message (I8 counts it).
                let tag = self.w.execs[exec]
                    .byz
                    .as_mut()
                    .and_then(|b| b.delivered(conn));
                if !(c.mill_open && mill_up && c.mill_inc == inc) {
                    return;
                }
                let msg = match decode_up(c, payload) {
                    Ok(Some(m)) => m,
                    Ok(None) => return,
                    Err(e) => return self.violate(e),
                };
                self.last_up.insert(conn, now);
                let mut near_grace = None;
                match &msg {
                    ToMill::EventBatch { epoch, events } => {
                        self.ctx.kind = StepKind::Batch {
                            exec,
                            epoch: *epoch,
                        };
                        self.ctx.events.clear();
                        self.ctx.events.extend(events.iter().map(EventSummary::of));
                        if self.grace_left(exec).is_some() {
                            let node = self.w.execs[exec].node.clone();
                            near_grace = self
                                .w
                                .mill
                                .as_ref()
                                .map(|m| (node.clone(), *epoch, m.cursor(&node, *epoch)));
                        }
                    }
                    ToMill::Snapshot { active_leases, .. } => {
                        self.w.snapshot_delivered[exec] = Some((conn, now));
                        self.ctx.kind = StepKind::Snapshot { exec };
                        self.ctx.active.clear();
                        self.ctx.active.extend_from_slice(active_leases);
                        let fence = dur(self.w.mill_cfg.retry_fence);
                        self.c.snapshot_received(now, active_leases, fence);
                        self.note_lost_commits(exec, active_leases);
                    }
                    ToMill::CommitResult {
                        committed: false, ..
                    } => {
                        // The reservation ran out before its commit arrived, on a live
                        // connection (M17: the job is placed again).
                        self.ctx.kind = StepKind::Other;
                        if self.w.execs[exec].honest() {
                            self.cov.hit(Path::CommitRefusedOnLiveSession);
                        }
                    }
                    ToMill::ReserveResult {
                        lease,
                        accepted: true,
                        resources,
                        ..
                    } => {
                        self.ctx.kind = StepKind::Other;
                        let (lease, resources) = (*lease, resources.clone());
                        self.note_charge(lease, &resources);
                    }
                    _ => self.ctx.kind = StepKind::Other,
                }
                self.rival = match &msg {
                    ToMill::Hello { .. } => self.live_rival(conn).map(|(c, at)| (conn, c, at)),
                    _ => None,
                };
                if let Some(tag) = tag {
                    if let Some(path) = self.c.byz_received(&self.w, exec, conn, &msg, tag) {
                        self.cov.hit(path);
                    }
                }
                self.mill_input(MillInput::Message { conn, msg });
                self.rival = None;
                let r = self.c.byz_step_done(&self.w);
                self.check(r);
                if let Some((node, epoch, before)) = near_grace {
                    let after = self.w.mill.as_ref().map(|m| m.cursor(&node, epoch));
                    if after.is_some_and(|a| a > before) {
                        self.cov.hit(Path::EventNearGraceExpiry);
                    }
                }
            }
            Packet::Fin => {
                if c.mill_open && c.mill_inc == inc {
                    c.mill_open = false;
                    self.mill_input(MillInput::Disconnected { conn });
                }
            }
            Packet::Accept | Packet::Refuse => {}
        }
    }

    /// What a deposed mill's connection delivers to it.
    fn deliver_to_deposed(&mut self, conn: ConnId, packet: Packet) {
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        match packet {
            Packet::Msg(payload) => {
                let msg = match decode_up(c, payload) {
                    Ok(Some(m)) => m,
                    Ok(None) => return,
                    Err(e) => return self.violate(e),
                };
                self.deposed_input(MillInput::Message { conn, msg });
            }
            Packet::Fin => {
                c.mill_open = false;
                self.deposed_input(MillInput::Disconnected { conn });
            }
            Packet::Syn | Packet::Accept | Packet::Refuse => {}
        }
    }

    fn deliver_down(&mut self, conn: ConnId, packet: Packet) {
        let now = self.w.now;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let exec = c.exec;
        let p = &self.w.execs[exec];
        let alive = p.exec.is_some() && p.inc == c.exec_inc;
        match packet {
            Packet::Accept => {
                if c.exec_waiting && alive && p.connecting == Some(conn) {
                    c.exec_waiting = false;
                    c.exec_open = true;
                    self.w.execs[exec].connecting = None;
                    self.watch.exec_connected(exec, now, &mut self.cov);
                    self.exec_input(exec, ExecutorInput::Connected { conn });
                } else if c.exec_waiting || !c.exec_open {
                    // Nobody waits for it: the executor's host resets it.
                    c.exec_waiting = false;
                    if c.mill_open {
                        if let Some(at) = self.w.net.push(now, conn, true, Packet::Fin) {
                            self.at(at, Ev::Pump { conn, up: true });
                        }
                    }
                }
            }
            Packet::Refuse => {
                c.exec_waiting = false;
                if alive && p.connecting == Some(conn) {
                    self.w.execs[exec].connecting = None;
                    self.exec_input(exec, ExecutorInput::ConnectFailed);
                }
            }
            Packet::Msg(payload) => {
                if !(c.exec_open && alive) {
                    return;
                }
                let msg = match payload {
                    Payload::ToExec(m) => m,
                    Payload::Frame(bytes) => {
                        c.down.decoder.push(&bytes);
                        match c.down.decoder.next_frame::<ToExecutor>() {
                            Ok(Some(m)) => m,
                            other => {
                                self.violate(Violation {
                                    rule: "codec",
                                    message: format!(
                                        "frame to x{exec} on {conn} did not decode: {other:?}"
                                    ),
                                });
                                return;
                            }
                        }
                    }
                    Payload::ToMill(_) => return,
                };
                // M35, E2: an executor that charges more than the standard charge (M14)
                // refuses a direct ask, whose commit follows without waiting for the answer;
                // that commit then finds no reservation and starts nothing (E4).
                if let ToExecutor::ReserveSeat {
                    lease,
                    direct: true,
                    ..
                } = &msg
                {
                    if let Some((name, amount)) = self.w.execs[exec].spec.extra_charge.clone() {
                        let refusal = ToMill::ReserveResult {
                            lease: *lease,
                            accepted: false,
                            reject: Some(RejectKind::Transient),
                            reason: format!(
                                "charge: this executor charges {name} {amount} on top of the standard charge a direct ask needs"
                            ),
                            resources: Default::default(),
                        };
                        self.exec_output(exec, ExecutorOutput::Send { conn, msg: refusal });
                        return;
                    }
                }
                if let Some(b) = self.w.execs[exec].byz.as_mut() {
                    b.incoming(now, conn, &msg, &mut self.byz);
                }
                self.exec_input(exec, ExecutorInput::Message { conn, msg });
            }
            Packet::Fin => {
                if c.exec_open && alive {
                    c.exec_open = false;
                    self.exec_input(exec, ExecutorInput::Disconnected { conn });
                } else {
                    c.exec_open = false;
                }
            }
            Packet::Syn => {}
        }
    }

    /// The executor gave up on a connect: its end is gone; the mill end (if the SYN got
    /// there) sees a FIN.
    fn abandon(&mut self, conn: ConnId) {
        let now = self.w.now;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        c.exec_waiting = false;
        c.exec_open = false;
        if let Some(at) = self.w.net.push(now, conn, true, Packet::Fin) {
            self.at(at, Ev::Pump { conn, up: true });
        }
    }

    fn reset_notify(&mut self, conn: ConnId, to_mill: bool) {
        let inc = self.w.mill_inc;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        if to_mill {
            let deposed = self.w.deposed.as_ref().is_some_and(|d| d.inc == c.mill_inc);
            if c.mill_open && deposed {
                c.mill_open = false;
                self.deposed_input(MillInput::Disconnected { conn });
            } else if c.mill_open && c.mill_inc == inc && self.w.mill.is_some() {
                c.mill_open = false;
                self.mill_input(MillInput::Disconnected { conn });
            } else {
                c.mill_open = false;
            }
        } else {
            let exec = c.exec;
            let alive = self.w.execs[exec].exec.is_some() && self.w.execs[exec].inc == c.exec_inc;
            if c.exec_open {
                c.exec_open = false;
                if alive {
                    self.exec_input(exec, ExecutorInput::Disconnected { conn });
                }
            } else if c.exec_waiting {
                c.exec_waiting = false;
                if alive && self.w.execs[exec].connecting == Some(conn) {
                    self.w.execs[exec].connecting = None;
                    self.exec_input(exec, ExecutorInput::ConnectFailed);
                }
            }
        }
        self.w.net.reap(conn);
    }

    // ---- the workload --------------------------------------------------------------------

    fn arrive(&mut self, k: usize) {
        let now = self.w.now;
        let (_, arrival) = self.w.workload.arrivals[k].clone();
        if self.w.mill.is_none() {
            // The client retries until the mill is back.
            self.at(now + SEC, Ev::Arrive(k));
            return;
        }
        match arrival {
            Arrival::Job { spec, cancel_after } => {
                let timeout = spec.timeout;
                let r = self
                    .mill_submit_keyed(spec, now / MS, Some(arrival_key(k)))
                    .map(|r| r.map(|s| s.job));
                match r {
                    Some(Ok(job)) => {
                        if self.c.inserted(job) {
                            self.times.submitted(job, now);
                            self.w.arrivals_done += 1;
                            self.stats.accepted += 1;
                            self.w.job_of_arrival[k] = Some(job);
                            let r = self.c.accepted(job, k);
                            self.check(r);
                            self.c.timeout_armed(job, now, timeout);
                            if let Some(after) = cancel_after {
                                self.at(now + after, Ev::UserCancel(k));
                            }
                            // Every fourth client retries as if the answer was lost (M31);
                            // by arrival index, so no random stream moves.
                            if k % RESUBMIT_EVERY == 0 {
                                self.at(now + SEC, Ev::Resubmit(k));
                            }
                        } else {
                            // The mill crashed before the insert was durable: no answer
                            // reached the client, which tries again.
                            self.at(now + SEC, Ev::Arrive(k));
                        }
                    }
                    Some(Err(RequestError::TooManyPending { .. })) => {
                        self.w.arrivals_done += 1;
                        self.cov.hit(Path::TooManyPending);
                        if self.step_wrote {
                            self.violate(Violation {
                                rule: "I2",
                                message: "a submit refused for max_pending stored something (M10)"
                                    .into(),
                            });
                        }
                    }
                    Some(Err(e)) => {
                        self.w.arrivals_done += 1;
                        self.violate(Violation {
                            rule: "I2",
                            message: format!("a valid submit was refused: {e}"),
                        });
                    }
                    None => self.at(now + SEC, Ev::Arrive(k)),
                }
            }
            Arrival::Invalid { spec, what } => {
                self.w.arrivals_done += 1;
                let r = self.mill_submit(spec, now / MS);
                let refused = matches!(r, Some(Err(RequestError::Spec(_))));
                if !refused || self.step_outputs > 0 {
                    self.violate(Violation {
                        rule: "I2",
                        message: format!(
                            "an invalid submit ({what}) was not refused cleanly: {r:?}, {} outputs",
                            self.step_outputs
                        ),
                    });
                }
            }
        }
    }

    /// M31: an accepted arrival's client submits it again under the same key; the mill
    /// must answer the same job and store nothing, across mill restarts too.
    fn resubmit(&mut self, k: usize) {
        let now = self.w.now;
        let (Some(first), (_, Arrival::Job { spec, .. })) = (
            self.w.job_of_arrival[k],
            self.w.workload.arrivals[k].clone(),
        ) else {
            return;
        };
        if self.w.mill.is_none() {
            self.at(now + SEC, Ev::Resubmit(k));
            return;
        }
        let key = arrival_key(k);
        if let Some(got) = self.mill_submit_keyed(spec, now / MS, Some(key.clone())) {
            self.stats.resubmits += 1;
            let r = self.c.keyed_retry(&key, first, &got, self.step_wrote);
            self.check(r);
        }
    }

    /// The liveness deadline, once the faults have healed.
    pub fn deadline(&self) -> Option<Micros> {
        self.deadline
    }
}

/// One accepted arrival in this many is submitted again by its client (M31).
const RESUBMIT_EVERY: usize = 4;

/// The idempotency key the client of arrival `k` submits under (M31).
fn arrival_key(k: usize) -> IdempotencyKey {
    // "arrival-" and a decimal index: always 1-256 printable ASCII characters.
    IdempotencyKey::new(format!("arrival-{k}")).unwrap_or_else(|e| unreachable!("{e}"))
}

/// What an executor's packet on `c` carries for the mill: `None` for a payload that is not
/// for the mill (or a frame not complete yet), a codec violation for a frame that does not
/// decode (honest peers' frames always do).
fn decode_up(c: &mut crate::net::Conn, payload: Payload) -> Result<Option<ToMill>, Violation> {
    match payload {
        Payload::ToMill(m) => Ok(Some(m)),
        Payload::Frame(bytes) => {
            c.up.decoder.push(&bytes);
            match c.up.decoder.next_to_mill() {
                Ok(Some(m)) => Ok(Some(m)),
                other => Err(Violation {
                    rule: "codec",
                    message: format!("frame from x{} did not decode: {other:?}", c.exec),
                }),
            }
        }
        Payload::ToExec(_) => Ok(None),
    }
}

fn dur(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn byz_ctx(w: &World, me: usize) -> ByzCtx {
    let foreign_ask = w
        .last_ask
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != me)
        .filter_map(|(_, l)| *l)
        .max();
    let foreign_lease = w
        .execs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != me)
        .flat_map(|(_, p)| p.engine.keys().copied())
        .max();
    ByzCtx {
        foreign_ask,
        foreign_lease,
    }
}

/// Where in a step of `n` outputs a crash lands: before output k (k = n: after them all).
/// Half the time, when the step starts with a `Persist`, right after it — between a write and
/// the sends that depend on it, the boundary persist-before-send is about.
fn crash_point(rng: &mut Rng, n: usize, starts_with_persist: bool) -> usize {
    if n > 1 && starts_with_persist && rng.chance(0.5) {
        1
    } else {
        rng.index(n + 1)
    }
}

/// Renders one trace line with `f`.
fn line_of(f: impl FnOnce(&mut String)) -> String {
    let mut s = String::new();
    f(&mut s);
    s
}
