//! The driver: a single-threaded discrete-event loop over a virtual clock. Events are ordered
//! by (time, insertion sequence); each one feeds one input to one process (or changes the
//! network), then the process's outputs are acted on in order — `Persist` applied to its
//! store, messages handed to the network, engine commands to the engine model — with the
//! checkers shown each. A crash may land at any output boundary of a step.

mod engine;
mod executor;
mod failover;
mod faults;
mod lag;
mod liveness;
mod mill;
mod rare_paths;
mod transport;
mod workload;

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

use engine::Exit;
use lag::{Hold, LagWindow};

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
    pub durations: Option<crate::workload::Durations>,
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
            Ev::EngineStart { exec, run, lease } => self.engine_start(exec, run, lease),
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
