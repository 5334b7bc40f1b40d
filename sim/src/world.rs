//! The simulated world: the processes (one mill, N executors), their durable stores, their
//! engines, the network and the workload's bookkeeping. This is the state that checkers
//! read; `driver` changes it.

use std::collections::BTreeMap;

use millrace_core::executor::{Executor, ExecutorConfig, ExecutorSnapshot};
use millrace_core::mill::{Mill, MillConfig, MillSnapshot};
use millrace_core::{ConnId, JobId, LeaseId, NodeId};

use crate::byzantine::Byzantine;
use crate::net::Net;
use crate::scenario::{Micros, Scenario, SeedPlan};
use crate::workload::{ExecSpec, Workload};

/// A crash waiting for the process's next output boundary.
#[derive(Debug, Clone, Copy)]
pub struct CrashPlan {
    /// The store is wiped (executors only).
    pub wipe: bool,
    /// How long the process stays down.
    pub down: Micros,
    /// The host dies too: no FIN reaches the peers.
    pub silent: bool,
    /// It lands only in a step that received a new `CommitLease`, before the commit is
    /// persisted (or at its deadline, wherever the process is).
    pub at_commit: bool,
}

/// A job the engine of an executor runs.
#[derive(Debug, Clone)]
pub struct EngineJob {
    /// The job.
    pub job: JobId,
    /// `JobStarted` was reported.
    pub started: bool,
    /// `StopJob` came; the exit is scheduled.
    pub stopping: bool,
    /// It ignores the stop and hangs until its (late) stopped exit: it will not run out
    /// by itself either.
    pub hung: bool,
    /// It ignores the stop and the kill for good: no exit is scheduled; only the heal (an
    /// operator) or its executor's crash ends it (M26: the mill's deadlines end the cancel).
    pub forever: bool,
    /// Counted once as a cancel ended by the mill's deadline alone.
    pub counted: bool,
    /// When its scheduled exit takes effect (`None`: none is scheduled, it hangs for good):
    /// the real remaining work I9's bounds count.
    pub ends_at: Option<u64>,
    /// Which run this is: engine reports of an earlier run of the same lease are stale.
    pub run: u64,
    /// The executor's epoch when it started the run.
    pub epoch: millrace_core::Epoch,
    /// An executor process is attached to its supervisor (E14): the one that started it or
    /// adopted it. False from that process's death until a restart adopts it.
    pub attached: bool,
    /// Bumped each time the run is orphaned, so that an earlier orphaning's supervisor
    /// grace (E14) does not fire after a re-attachment.
    pub orphaned: u32,
}

/// One executor process and everything around it.
#[derive(Debug)]
pub struct ExecProc {
    /// Its shape.
    pub spec: ExecSpec,
    /// Its node id.
    pub node: NodeId,
    /// Its config.
    pub cfg: ExecutorConfig,
    /// The process, when up.
    pub exec: Option<Executor>,
    /// The store: exactly what its `Persist` outputs wrote.
    pub store: ExecutorSnapshot,
    /// The store as of its last batch that waited for the disk, while batches that did not
    /// (E5: only trims and contact marks) were written after it: a crash of the host loses
    /// those and the store goes back to this.
    pub synced: Option<ExecutorSnapshot>,
    /// Bumped at every crash, so stale engine reports are dropped.
    pub inc: u32,
    /// The earliest tick event scheduled.
    pub tick_at: Option<Micros>,
    /// A crash armed for the next step.
    pub crash: Option<CrashPlan>,
    /// The misbehaviour filter, for a violator.
    pub byz: Option<Byzantine>,
    /// The connection a `Connect` is waiting on.
    pub connecting: Option<ConnId>,
    /// The engine's jobs, by lease: each runs under its own supervisor (E14), which outlives
    /// the executor process but not its host.
    pub engine: BTreeMap<LeaseId, EngineJob>,
    /// Exits the supervisors recorded durably while no executor process was attached
    /// (`exit.json`, E14), as the input a restarted executor's adoption gets for them.
    pub recorded: BTreeMap<LeaseId, millrace_core::executor::ExecutorInput>,
    /// When it is due back up, while down.
    pub restart_at: Option<Micros>,
    /// The seats (reserved or running) it held before the step in progress: a message of
    /// the step's due timers precedes its input, which may take or free seats (I3's snapshot
    /// check owes only seats held before and after).
    pub held_before: std::collections::BTreeSet<LeaseId>,
    /// The highest seqno in its durable outbox before the step in progress (the same
    /// reason: a timer's snapshot precedes the events the step's input appends).
    pub outbox_before: Option<millrace_core::Seqno>,
    /// Its host died for good (`Fault::Lose`): it never restarts, not even at the heal.
    pub lost: bool,
    /// Its process is hung until then (`Fault::Hang`): it handles nothing.
    pub hung_until: Option<Micros>,
    /// Inputs that reached it while hung, handled in order when it resumes.
    pub deferred: std::collections::VecDeque<millrace_core::executor::ExecutorInput>,
    /// A second process claiming this executor's node id (`Fault::Twin`): the index of the
    /// first. Dormant (`lost`) before and after its life.
    pub twin_of: Option<usize>,
    /// The mill incarnation when it last went away (crashed, lost or hung); `None` while up.
    pub away_since_inc: Option<u32>,
}

impl ExecProc {
    /// True for an executor that follows the protocol (a `replay-at-cursor` one does: M20
    /// makes replays legal).
    pub fn honest(&self) -> bool {
        self.spec.byzantine.is_none_or(|k| k.legal())
    }

    /// True for an executor that commits protocol violations: it must end quarantined (M28);
    /// any other must never be charged with a violation or quarantined (I8).
    pub fn violator(&self) -> bool {
        self.spec.byzantine.is_some_and(|k| k.violates())
    }
}

/// What the simulator knows of a lease from the mill's `ReserveSeat`.
#[derive(Debug, Clone)]
pub struct LeaseInfo {
    /// The job.
    pub job: JobId,
    /// The executor asked.
    pub exec: usize,
    /// The job's engine.
    pub engine: String,
    /// What the job asks for (M34: an executor's reservations and runs fit its engine's
    /// declared resources, I6).
    pub resources: millrace_core::Resources,
}

/// Everything simulated.
#[derive(Debug)]
pub struct World {
    /// Simulated time now.
    pub now: Micros,
    /// The scenario.
    pub scenario: Scenario,
    /// Swarm and fault plan.
    pub plan: SeedPlan,
    /// Fleet and workload.
    pub workload: Workload,
    /// The mill's settings.
    pub mill_cfg: MillConfig,
    /// The mill, when up.
    pub mill: Option<Mill>,
    /// The mill's durable store.
    pub mill_store: MillSnapshot,
    /// Bumped at every mill crash.
    pub mill_inc: u32,
    /// The earliest mill tick scheduled.
    pub mill_tick_at: Option<Micros>,
    /// A mill crash armed for its next step (with `at_commit`: for its next step that sends
    /// a direct ask, M35, or its deadline).
    pub mill_crash: Option<CrashPlan>,
    /// Mill crashes planned so far: with direct placement on, every second one waits for a
    /// direct ask (M35), so the boundary between it and its commit is reached without a
    /// random draw of its own (which would move every later draw of the seed).
    pub mill_crashes_planned: u64,
    /// The mill's host is down (connects time out instead of being refused).
    pub mill_host_down: bool,
    /// When the mill is due back up, while down.
    pub mill_restart_at: Option<Micros>,
    /// Executors.
    pub execs: Vec<ExecProc>,
    /// The network.
    pub net: Net,
    /// When faults stop.
    pub heal_at: Micros,
    /// Faults stopped; everything came back.
    pub healed: bool,
    /// Arrival index → the job it became, once accepted.
    pub job_of_arrival: Vec<Option<JobId>>,
    /// Arrivals handled (accepted, refused, or given up).
    pub arrivals_done: usize,
    /// Leases asked by the mill, from its `ReserveSeat`s (M30 bookkeeping).
    pub leases: BTreeMap<LeaseId, LeaseInfo>,
    /// The latest ask sent to each executor.
    pub last_ask: Vec<Option<LeaseId>>,
    /// Node id → executor index.
    pub index: BTreeMap<NodeId, usize>,
    /// The last snapshot delivered to the mill from each executor: (connection, time).
    pub snapshot_delivered: Vec<Option<(ConnId, Micros)>>,
    /// Mill addresses the executors know (2 with the failover family, DESIGN §10).
    pub mill_addrs: usize,
    /// The address the leading mill (`mill`) listens on.
    pub leader_addr: usize,
    /// A mill that lost its leadership but may still run (paused past its lease, or cut
    /// from the store): it keeps its connections until it steps down.
    pub deposed: Option<Deposed>,
    /// Which mill incarnation wrote under each term (I13: never two).
    pub term_writers: BTreeMap<millrace_core::Term, u32>,
}

/// A deposed mill process (DESIGN §10): it still holds its state, its term and the
/// connections it accepted, and acts on them while it runs, until it steps down.
#[derive(Debug)]
pub struct Deposed {
    /// Its state machine.
    pub mill: Mill,
    /// The incarnation whose connections it holds (`Conn::mill_inc`).
    pub inc: u32,
    /// Its term (below the store's once a successor took over).
    pub term: millrace_core::Term,
    /// The address it listens on.
    pub addr: usize,
    /// Paused (SIGSTOP) until then: it handles nothing, its inputs wait.
    pub paused_until: Option<Micros>,
    /// Cut from the store: none of its writes can succeed.
    pub cut: bool,
    /// Inputs that reached it while paused, in order.
    pub deferred: std::collections::VecDeque<millrace_core::mill::MillInput>,
}

impl World {
    /// The executor index of `node`.
    pub fn exec_of(&self, node: &NodeId) -> Option<usize> {
        self.index.get(node).copied()
    }

    /// The executor at the other end of `conn`.
    pub fn exec_of_conn(&self, conn: ConnId) -> Option<usize> {
        self.net.conns.get(&conn).map(|c| c.exec)
    }
}
