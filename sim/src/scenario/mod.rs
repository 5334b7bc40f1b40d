//! Scenarios: what a scenario is (topology, workload size, time windows, families, a scenario
//! file's additions and expectations). The swarm and the fault plan a seed draws from one are
//! in `plan` (re-exported here); the library of scenarios, loaded from `scenarios/*.toml`, is
//! `crate::scenario_file` (`scenarios()`, `scenario(name)`), which imports this module and not
//! the other way round (issue 17 item 3).

use std::time::Duration;

use millrace_core::mill::MillConfig;

use crate::rng::{Purpose, Rng};

pub use crate::types::{Micros, MS, SEC};

mod plan;
pub use plan::*;
/// How long a leading mill's lease in the store lasts (DESIGN §10): a standby takes over
/// this long after the leader last renewed.
pub const LEADER_LEASE: Micros = 10 * SEC;
/// The longest a deposed mill that resumed acts before its failed renewal makes it step
/// down (it renews every third of its lease).
pub const RENEW_AFTER_RESUME: Micros = LEADER_LEASE / 3;

/// A kind of trouble (or of workload feature) that a seed may turn on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    /// Symmetric partitions between groups of processes.
    Partition,
    /// One-way partitions and clogs of single links.
    OneWay,
    /// Latency spikes.
    Spike,
    /// Connection resets.
    Reset,
    /// Executor crashes and restarts, store intact.
    ExecCrash,
    /// Executor crashes that wipe the store (a new epoch).
    DiskWipe,
    /// Mill crashes and restarts from its store.
    MillCrash,
    /// Executors that send protocol violations.
    Byzantine,
    /// Engines that take longer to stop than the teardown deadline.
    SlowStop,
    /// Users cancel jobs at random moments.
    Cancel,
    /// Tight quotas, quota denials, executors that charge differently, a small `max_pending`.
    Quota,
    /// Invalid submits (must be refused with nothing stored).
    InvalidSubmit,
    /// Drivers that batch inputs before a `Tick`: deadlines handled late (I12).
    DriverLag,
    /// Executor processes that hang (SIGSTOP, a stalled disk, a VM pause): the connection
    /// stays open, nothing is sent or processed, timers do not run; they resume later and
    /// their late timers fire first (M9, M17, E12).
    Hang,
    /// Executor hosts that die for good without a FIN (decommissioned after a hardware
    /// failure): only the mill's silence check (M9) and grace (M5, M29) end their leases.
    Lose,
    /// A second mill address and leader terms (DESIGN §10, E13, I13): the leading mill is
    /// paused past its leader lease (a GC pause) or cut from the store, a standby takes over
    /// at the other address under a higher term, and the deposed one comes back and acts
    /// until it steps down; a crashed mill's successor also starts at the other address.
    Failover,
}

impl Family {
    /// Every family, in a fixed order.
    pub const ALL: [Family; Family::COUNT] = [
        Family::Partition,
        Family::OneWay,
        Family::Spike,
        Family::Reset,
        Family::ExecCrash,
        Family::DiskWipe,
        Family::MillCrash,
        Family::Byzantine,
        Family::SlowStop,
        Family::Cancel,
        Family::Quota,
        Family::InvalidSubmit,
        Family::DriverLag,
        Family::Hang,
        Family::Lose,
        Family::Failover,
    ];

    /// How many families there are.
    pub const COUNT: usize = 16;

    /// Families added after the seed plans of the scenario library were fixed: they draw
    /// from the seed only when a scenario uses them, so older scenarios keep their plans.
    /// `"all"` in a scenario file leaves them out: a lost host may hold the only labels
    /// some jobs need, which a drawn fleet does not avoid.
    pub fn late(self) -> bool {
        matches!(self, Family::Hang | Family::Lose | Family::Failover)
    }

    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Family::Partition => "partition",
            Family::OneWay => "one-way",
            Family::Spike => "spike",
            Family::Reset => "reset",
            Family::ExecCrash => "exec-crash",
            Family::DiskWipe => "disk-wipe",
            Family::MillCrash => "mill-crash",
            Family::Byzantine => "byzantine",
            Family::SlowStop => "slow-stop",
            Family::Cancel => "cancel",
            Family::Quota => "quota",
            Family::InvalidSubmit => "invalid-submit",
            Family::DriverLag => "driver-lag",
            Family::Hang => "hang",
            Family::Lose => "lose",
            Family::Failover => "failover",
        }
    }
}

/// How a scenario treats a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Never.
    Off,
    /// On for about half the seeds, with a random intensity.
    Swarm,
    /// Always, with a random intensity.
    On,
}

/// A scenario: topology, workload size, time windows, which families it uses, and what a
/// scenario file adds (an explicit fleet, workload knobs, scripted faults, config overrides,
/// expectations). Loaded from `scenarios/*.toml` (see `scenario_file`).
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Its name on the command line (the file's stem).
    pub name: String,
    /// One line for `list`.
    pub about: String,
    /// Executors in the fleet.
    pub executors: usize,
    /// Jobs the workload submits.
    pub jobs: usize,
    /// Jobs arrive over `[0, arrival)`.
    pub arrival: Micros,
    /// Faults happen over `[0, fault_window)`; then the network heals and every process
    /// comes back (liveness mode).
    pub fault_window: Micros,
    /// Mean job duration.
    pub job_mean: Micros,
    /// Longest job duration.
    pub job_max: Micros,
    /// Seats per engine, lowest and highest.
    pub seats: (u32, u32),
    /// Fraction of messages round-tripped through the wire codec.
    pub codec_fraction: f64,
    /// Family modes, by `Family::ALL` index.
    pub modes: [Mode; Family::COUNT],
    /// Timers three times tighter than production's, so that timeouts race messages.
    pub tight: bool,
    /// Fixed intensities, by `Family::ALL` index (`None`: drawn from the seed).
    pub intensity: [Option<f64>; Family::COUNT],
    /// An explicit fleet (`None`: drawn from `executors` and `seats`).
    pub fleet: Option<Vec<ExecTemplate>>,
    /// Workload knobs that override what the swarm would pick.
    pub knobs: Knobs,
    /// Scripted faults, added to the seed's drawn plan.
    pub script: Vec<(Micros, Fault)>,
    /// Mill settings overriding the defaults (and the `tight` preset).
    pub config: ConfigOverrides,
    /// What a run of this scenario must show.
    pub expect: Expect,
    /// A shrunk schedule (`[shrunk]` in a file that `millrace-sim shrink` wrote): only these
    /// faults and arrivals of the seed's plan and workload run.
    pub keep: Option<Keep>,
    /// A deliberate breakage of the simulator's engine model, for tests of the tooling
    /// around a failure (shrinking); never set by a scenario file.
    pub bug: Option<SimBug>,
}

/// What a shrunk scenario keeps of its seed's plan and workload: indices into the fault plan
/// the seed draws (scripted faults included, in time order) and into its arrivals. Filtering
/// after the draw leaves every other random stream of the seed where it was.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Keep {
    /// The seed it was shrunk from: the indices mean something only with this seed.
    pub seed: u64,
    /// The faults kept, by index into the seed's plan.
    pub faults: Vec<usize>,
    /// The arrivals kept, by index into the seed's workload.
    pub jobs: Vec<usize>,
}

/// A deliberate breakage of the simulator (not of the product), compiled in for tests that
/// need a real failure caught by a real checker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimBug {
    /// An executor's engine starts a job a second time once that executor has crashed and
    /// restarted at least once, so I1 fails ("started twice").
    DoubleStartAfterCrash,
}

/// One executor of an explicit fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecTemplate {
    /// Node id.
    pub name: String,
    /// Labels held.
    pub labels: std::collections::BTreeSet<String>,
    /// Engines offered.
    pub engines: std::collections::BTreeMap<String, millrace_core::executor::EngineConfig>,
    /// Misbehaves this way, if it does.
    pub byzantine: Option<crate::byzantine::ByzKind>,
    /// Its engine takes longer than the teardown deadline to stop jobs.
    pub slow_stop: bool,
    /// It charges one more resource than jobs ask for (M14).
    pub extra_charge: Option<(String, u64)>,
}

/// Workload settings a scenario file may fix; `None` keeps the swarm's choice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Knobs {
    /// Fraction of jobs their user cancels.
    pub cancel_rate: Option<f64>,
    /// A cancel comes within this long after the submit.
    pub cancel_within: Option<Micros>,
    /// Fraction of jobs followed by an invalid submit.
    pub invalid_rate: Option<f64>,
    /// Distinct owners (`o0`, `o1`, …); four by default.
    pub owners: Option<usize>,
    /// The mill's `max_pending`.
    pub max_pending: Option<usize>,
    /// Quota limits.
    pub quota: Option<millrace_core::quota::QuotaConfig>,
    /// Fraction of arrivals that come with their predecessor.
    pub burst: Option<f64>,
    /// CPU a shell job asks for, lowest and highest (millis).
    pub cpu_millis: Option<(u64, u64)>,
    /// Label constraints: this share of jobs requires these labels.
    pub require: Vec<(std::collections::BTreeSet<String>, f64)>,
    /// Share of jobs with a retry policy (M32); a quarter by default.
    pub retry_rate: Option<f64>,
    /// Jobs draw a priority in `-n..=n` (M33); all 0 when unset.
    pub priorities: Option<u32>,
    /// Share of jobs pinned to the executor their spec was drawn for (M34).
    pub pinned: Option<f64>,
    /// Share of shell jobs that ask for all of their executor's `cpu_millis` (M34, E2: they
    /// run one at a time there).
    pub whole_engine: Option<f64>,
}

/// Mill settings a scenario file may override.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConfigOverrides {
    /// `reconnect_grace`.
    pub reconnect_grace: Option<Duration>,
    /// `silence_timeout`.
    pub silence_timeout: Option<Duration>,
    /// `snapshot_interval`.
    pub snapshot_interval: Option<Duration>,
    /// `bid_timeout`.
    pub bid_timeout: Option<Duration>,
    /// `cancel_ack_timeout`.
    pub cancel_ack_timeout: Option<Duration>,
    /// `cancel_teardown_timeout`.
    pub cancel_teardown_timeout: Option<Duration>,
    /// `job_timeout`.
    pub job_timeout: Option<Duration>,
    /// `queue_timeout`.
    pub queue_timeout: Option<Duration>,
    /// `quarantine_strikes`.
    pub quarantine_strikes: Option<u32>,
    /// `max_sessions`.
    pub max_sessions: Option<usize>,
    /// `direct_placement` (M35); `None`: on in three seeds of four, off in the rest
    /// ([`direct_for_seed`]).
    pub direct_placement: Option<bool>,
    /// `late_binding` (M36); `None`: the mill's default (on).
    pub late_binding: Option<bool>,
}

/// M35 when the scenario does not say: on in three seeds of four, so both placement paths
/// (direct and bid, M12) run under every fault. Taken from the seed itself, not from a
/// random stream, so no other draw of the seed moves.
pub fn direct_for_seed(seed: u64) -> bool {
    seed % 4 != 3
}

/// What a scenario expects of its runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Expect {
    /// The invariants checked (`None`: all of them).
    pub invariants: Option<std::collections::BTreeSet<String>>,
    /// The liveness bound after the heal (`None`: derived from the config and workload).
    pub liveness_bound: Option<Micros>,
    /// Rare paths that must be reached, summed over the test seeds.
    pub reach: Vec<crate::coverage::Path>,
    /// Seeds `0..seeds` that `cargo test -p sim` runs.
    pub seeds: u64,
}

impl Default for Expect {
    fn default() -> Self {
        Expect {
            invariants: None,
            liveness_bound: None,
            reach: Vec::new(),
            seeds: 4,
        }
    }
}

/// Every rule a checker may report, for `expect.invariants`.
pub const RULES: [&str; 16] = [
    "I1",
    "I2",
    "I3",
    "I4",
    "I5",
    "I6",
    "I7",
    "I8",
    "I9",
    "I10",
    "M35",
    "persist-before-send",
    "one-session",
    "codec",
    "panic",
    "config",
];

impl Scenario {
    /// The mode of `f`.
    pub fn mode(&self, f: Family) -> Mode {
        self.modes[f as usize]
    }

    /// Whether a violation of `rule` fails the run.
    pub fn checks(&self, rule: &str) -> bool {
        self.expect
            .invariants
            .as_ref()
            .is_none_or(|set| set.contains(rule))
    }

    /// The mill's settings in this scenario: production defaults, except a teardown deadline
    /// short enough to be reached within a run, then the file's overrides.
    pub fn mill_config(&self) -> MillConfig {
        let base = MillConfig {
            cancel_teardown_timeout: Duration::from_secs(60),
            ..MillConfig::default()
        };
        let mut c = if self.tight {
            MillConfig {
                reconnect_grace: Duration::from_secs(15),
                silence_timeout: Duration::from_secs(5),
                snapshot_interval: Duration::from_millis(1500),
                bid_timeout: Duration::from_millis(1500),
                cancel_ack_timeout: Duration::from_secs(3),
                cancel_teardown_timeout: Duration::from_secs(20),
                ..base
            }
        } else {
            base
        };
        let o = &self.config;
        let set = |slot: &mut Duration, v: Option<Duration>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut c.reconnect_grace, o.reconnect_grace);
        set(&mut c.silence_timeout, o.silence_timeout);
        set(&mut c.snapshot_interval, o.snapshot_interval);
        set(&mut c.bid_timeout, o.bid_timeout);
        set(&mut c.cancel_ack_timeout, o.cancel_ack_timeout);
        set(&mut c.cancel_teardown_timeout, o.cancel_teardown_timeout);
        set(&mut c.job_timeout, o.job_timeout);
        set(&mut c.queue_timeout, o.queue_timeout);
        if let Some(v) = o.quarantine_strikes {
            c.quarantine_strikes = v;
        }
        if let Some(v) = o.max_sessions {
            c.max_sessions = v;
        }
        if let Some(v) = o.direct_placement {
            c.direct_placement = v;
        }
        if let Some(v) = o.late_binding {
            c.late_binding = v;
        }
        c
    }
}
