//! Built-in scenarios, the swarm (which fault families a seed turns on, and how hard), and
//! the fault plan: plain data derived from the seed before the run starts (TigerBeetle's
//! habit), printed in every failure report.

use std::fmt;
use std::time::Duration;

use millrace_core::mill::MillConfig;

use crate::rng::{Purpose, Rng};

/// One microsecond-resolution instant of simulated time, as a plain number.
pub type Micros = u64;

/// Microseconds in a second.
pub const SEC: Micros = 1_000_000;
/// Microseconds in a millisecond.
pub const MS: Micros = 1_000;
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
        c
    }
}

/// Every scenario of the library (the files embedded at build time, see `scenario_file`).
/// Panics if one does not load: `cargo test -p sim` loads them all first.
pub fn scenarios() -> Vec<Scenario> {
    crate::scenario_file::embedded().unwrap_or_else(|e| panic!("{e}"))
}

/// Looks a scenario of the library up by name.
pub fn scenario(name: &str) -> Option<Scenario> {
    scenarios().into_iter().find(|s| s.name == name)
}

/// The families a seed turned on, each with an intensity in (0, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct Swarm {
    /// By `Family::ALL` index; `None` is off.
    pub on: [Option<f64>; Family::COUNT],
}

impl Swarm {
    /// Draws the swarm for a seed: `On` families always, `Swarm` families with probability
    /// one half; at least one `Swarm` family stays off.
    pub fn draw(scenario: &Scenario, rng: &mut Rng) -> Swarm {
        let mut on = [None; Family::COUNT];
        let mut swarmed = Vec::new();
        for f in Family::ALL {
            if f.late() && scenario.mode(f) == Mode::Off {
                continue;
            }
            let drawn = 0.15 + 0.85 * rng.unit();
            let intensity = scenario.intensity[f as usize].unwrap_or(drawn);
            let coin = rng.chance(0.5);
            match scenario.mode(f) {
                Mode::Off => {}
                Mode::On => on[f as usize] = Some(intensity),
                Mode::Swarm => {
                    swarmed.push(f);
                    if coin {
                        on[f as usize] = Some(intensity);
                    }
                }
            }
        }
        if !swarmed.is_empty() && swarmed.iter().all(|f| on[*f as usize].is_some()) {
            let f = *rng.pick(&swarmed);
            on[f as usize] = None;
        }
        Swarm { on }
    }

    /// The intensity of `f`, if on.
    pub fn get(&self, f: Family) -> Option<f64> {
        self.on[f as usize]
    }

    /// Whether `f` is on.
    pub fn has(&self, f: Family) -> bool {
        self.get(f).is_some()
    }
}

impl fmt::Display for Swarm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for fam in Family::ALL {
            if let Some(i) = self.get(fam) {
                if !first {
                    f.write_str(", ")?;
                }
                first = false;
                write!(f, "{}={:.2}", fam.name(), i)?;
            }
        }
        if first {
            f.write_str("(none)")?;
        }
        Ok(())
    }
}

/// A process, as faults name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proc {
    /// The mill.
    Mill,
    /// Executor `i`.
    Exec(usize),
}

impl fmt::Display for Proc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Proc::Mill => f.write_str("mill"),
            Proc::Exec(i) => write!(f, "x{i}"),
        }
    }
}

/// One fault of the plan.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Cut every link between `side` and the other processes (both ways, or only from
    /// `side` outwards when `one_way`) until `until`.
    Partition {
        /// The executors cut off together (the mill is always on the other side).
        side: Vec<usize>,
        /// Only messages from `side` are held.
        one_way: bool,
        /// When it heals.
        until: Micros,
    },
    /// Hold the messages of one direction of one executor's link until `until`.
    Clog {
        /// The executor.
        exec: usize,
        /// True: executor → mill; false: mill → executor.
        to_mill: bool,
        /// When it clears.
        until: Micros,
    },
    /// Add `extra` to every latency until `until`.
    Spike {
        /// Added latency.
        extra: Micros,
        /// When it ends.
        until: Micros,
    },
    /// Reset the executor's connections.
    Reset {
        /// The executor.
        exec: usize,
    },
    /// Crash an executor at its next output boundary; it restarts after `down`.
    CrashExec {
        /// The executor.
        exec: usize,
        /// Its store is wiped: it comes back with a new epoch.
        wipe: bool,
        /// How long it stays down.
        down: Micros,
        /// The host dies with it (no FIN reaches the peer).
        silent: bool,
        /// The crash waits for a step that received a new `CommitLease` and lands before
        /// the commit is persisted (at the latest `COMMIT_CRASH_WAIT` after it was armed).
        at_commit: bool,
    },
    /// Crash the mill at its next output boundary; it restarts from its store after `down`.
    CrashMill {
        /// How long it stays down.
        down: Micros,
        /// The host dies with it (no FIN reaches the peers).
        silent: bool,
    },
    /// The process's driver batches inputs before its `Tick` until `until` (I12): a due
    /// `Tick` waits behind up to `max_inputs` more inputs or `max_delay`, whichever ends
    /// first (the node's drivers take up to 1–2k inputs per step).
    Lag {
        /// The process.
        proc: Proc,
        /// When its driver catches up again.
        until: Micros,
        /// The longest a due `Tick` waits.
        max_delay: Micros,
        /// The largest batch of inputs a due `Tick` waits behind.
        max_inputs: u32,
    },
    /// The executor's process hangs until `until` (SIGSTOP, a disk stall, a VM pause): its
    /// connections stay open, it sends and handles nothing and runs no timer; its engine's
    /// jobs run on, their reports wait. At `until` it handles what waited, late timers first.
    Hang {
        /// The executor.
        exec: usize,
        /// When it resumes.
        until: Micros,
    },
    /// The executor's host dies for good, without a FIN: it never comes back, not even at
    /// the heal (the fleet shrinks; the mill's silence check and grace end its leases).
    Lose {
        /// The executor.
        exec: usize,
    },
    /// The leading mill's process stops (a GC pause, SIGSTOP) until `until`, past its leader
    /// lease ([`LEADER_LEASE`]): at `LEADER_LEASE` a standby takes over from the store under
    /// the next term at the other address (DESIGN §10). The paused one keeps its connections
    /// and its state; when it resumes it handles what waited and acts until it steps down —
    /// at its first write (the store refuses its term), when an executor tells it of a higher
    /// term (E13), or when its renewal fails ([`RENEW_AFTER_RESUME`] at most).
    PauseMill {
        /// When it resumes.
        until: Micros,
    },
    /// The leading mill loses the store but not its executors: it runs on, its writes fail
    /// (it steps down at the first, or when its local lease runs out), and a standby takes
    /// over at [`LEADER_LEASE`] (DESIGN §10).
    CutMillStore,
    /// A second executor process claims the node id of `exec` (a misconfigured duplicate
    /// host: same node id, its own store and epoch) until `until`, when an operator stops
    /// it for good. While the first holds a live session the mill refuses it (M2).
    Twin {
        /// The executor whose node id it claims.
        exec: usize,
        /// When it is stopped.
        until: Micros,
    },
}

fn secs(m: Micros) -> String {
    format!("{}.{:03}s", m / SEC, (m % SEC) / MS)
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Partition {
                side,
                one_way,
                until,
            } => write!(
                f,
                "partition {:?}{} until {}",
                side,
                if *one_way { " (one-way, outbound)" } else { "" },
                secs(*until)
            ),
            Fault::Clog {
                exec,
                to_mill,
                until,
            } => write!(
                f,
                "clog x{exec} {} until {}",
                if *to_mill { "->mill" } else { "<-mill" },
                secs(*until)
            ),
            Fault::Spike { extra, until } => {
                write!(f, "latency +{} until {}", secs(*extra), secs(*until))
            }
            Fault::Reset { exec } => write!(f, "reset x{exec}"),
            Fault::CrashExec {
                exec,
                wipe,
                down,
                silent,
                at_commit,
            } => write!(
                f,
                "crash x{exec}{}{}{} for {}",
                if *wipe { " (wipe store)" } else { "" },
                if *silent { " (host)" } else { "" },
                if *at_commit {
                    " (at a commit, before it is persisted)"
                } else {
                    ""
                },
                secs(*down)
            ),
            Fault::CrashMill { down, silent } => write!(
                f,
                "crash mill{} for {}",
                if *silent { " (host)" } else { "" },
                secs(*down)
            ),
            Fault::Lag {
                proc,
                until,
                max_delay,
                max_inputs,
            } => write!(
                f,
                "driver lag {proc} (ticks up to {} or {max_inputs} inputs late) until {}",
                secs(*max_delay),
                secs(*until)
            ),
            Fault::Hang { exec, until } => write!(f, "hang x{exec} until {}", secs(*until)),
            Fault::Lose { exec } => write!(f, "lose x{exec} for good (host dies, no FIN)"),
            Fault::PauseMill { until } => {
                write!(f, "pause the leading mill until {}", secs(*until))
            }
            Fault::CutMillStore => write!(f, "cut the leading mill from its store"),
            Fault::Twin { exec, until } => write!(
                f,
                "a twin process claims x{exec}'s node id until {}",
                secs(*until)
            ),
        }
    }
}

/// The fault plan: when each fault starts. Ends are part of each fault.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultPlan {
    /// In time order.
    pub faults: Vec<(Micros, Fault)>,
}

impl FaultPlan {
    /// Draws the plan for `swarm` over `[0, window)` for `executors` executors.
    pub fn draw(
        swarm: &Swarm,
        window: Micros,
        executors: usize,
        timing: Timing,
        rng: &mut Rng,
    ) -> FaultPlan {
        let mut faults = Vec::new();
        let win_s = window as f64 / SEC as f64;
        // Expected count: intensity × window / mean gap.
        let count = |rng: &mut Rng, intensity: f64, mean_gap_s: f64| -> usize {
            let expected = intensity * win_s / mean_gap_s;
            let base = expected.floor() as usize;
            base + usize::from(rng.chance(expected - expected.floor()))
        };
        let at = |rng: &mut Rng| rng.range(SEC, window.saturating_sub(SEC).max(SEC));
        let clamp = |t: Micros| t.min(window);
        if let Some(i) = swarm.get(Family::Partition) {
            for _ in 0..count(rng, i, 50.0) {
                let start = at(rng);
                let roll = rng.unit();
                let len = if roll < 0.1 {
                    // Longer than grace + silence: only self-fencing (E12) stops the jobs.
                    rng.range(120 * SEC, 240 * SEC)
                } else if roll < 0.35 {
                    rng.range(40 * SEC, 90 * SEC)
                } else {
                    rng.range(500 * MS, 20 * SEC)
                };
                let side = partition_side(rng, executors);
                faults.push((
                    start,
                    Fault::Partition {
                        side,
                        one_way: false,
                        until: clamp(start + len),
                    },
                ));
            }
        }
        if let Some(i) = swarm.get(Family::OneWay) {
            for _ in 0..count(rng, i, 50.0) {
                let start = at(rng);
                let len = rng.range(500 * MS, 50 * SEC);
                let fault = if rng.chance(0.4) {
                    Fault::Partition {
                        side: partition_side(rng, executors),
                        one_way: true,
                        until: clamp(start + len),
                    }
                } else {
                    Fault::Clog {
                        exec: rng.index(executors),
                        to_mill: rng.chance(0.5),
                        until: clamp(start + len),
                    }
                };
                faults.push((start, fault));
            }
        }
        if let Some(i) = swarm.get(Family::Spike) {
            for _ in 0..count(rng, i, 40.0) {
                let start = at(rng);
                let len = rng.range(SEC, 20 * SEC);
                let extra = rng.range(20 * MS, 3 * SEC);
                faults.push((
                    start,
                    Fault::Spike {
                        extra,
                        until: clamp(start + len),
                    },
                ));
            }
        }
        if let Some(i) = swarm.get(Family::Reset) {
            for _ in 0..count(rng, i, 15.0) {
                let start = at(rng);
                faults.push((
                    start,
                    Fault::Reset {
                        exec: rng.index(executors),
                    },
                ));
            }
        }
        if let Some(i) = swarm.get(Family::ExecCrash) {
            for _ in 0..count(rng, i, 60.0) {
                let start = at(rng);
                let down = if rng.chance(0.25) {
                    rng.range(45 * SEC, 80 * SEC)
                } else {
                    rng.range(100 * MS, 20 * SEC)
                };
                let exec = rng.index(executors);
                let silent = rng.chance(0.4);
                faults.push((
                    start,
                    Fault::CrashExec {
                        exec,
                        wipe: false,
                        down,
                        silent,
                        // A third of them wait for a commit: the executor loses a job the
                        // mill committed while keeping its epoch (E4, M8, M29).
                        at_commit: rng.chance(0.35),
                    },
                ));
            }
        }
        if let Some(i) = swarm.get(Family::DiskWipe) {
            for _ in 0..count(rng, i, 120.0).max(1) {
                let start = at(rng);
                faults.push((
                    start,
                    Fault::CrashExec {
                        exec: rng.index(executors),
                        wipe: true,
                        down: rng.range(100 * MS, 30 * SEC),
                        silent: rng.chance(0.4),
                        at_commit: false,
                    },
                ));
            }
        }
        if let Some(i) = swarm.get(Family::MillCrash) {
            for _ in 0..count(rng, i, 90.0).max(1) {
                let start = at(rng);
                faults.push((
                    start,
                    Fault::CrashMill {
                        down: rng.range(50 * MS, 30 * SEC),
                        silent: rng.chance(0.4),
                    },
                ));
            }
        }
        if let Some(i) = swarm.get(Family::DriverLag) {
            // The mill's driver lags in most lagging seeds; executors' drivers now and then.
            let mut procs = Vec::new();
            if rng.chance(0.8) {
                procs.push(Proc::Mill);
            }
            for x in 0..executors {
                if rng.chance(0.5 * i) {
                    procs.push(Proc::Exec(x));
                }
            }
            if procs.is_empty() {
                procs.push(Proc::Mill);
            }
            for proc in procs {
                // One long stretch of lag (most of the window) or a few shorter ones.
                let stretches = if rng.chance(0.5) { 1 } else { rng.range(2, 5) };
                for _ in 0..stretches {
                    let start = rng.range(0, window / 2);
                    let len = if stretches == 1 {
                        window - start
                    } else {
                        rng.range(10 * SEC, 60 * SEC)
                    };
                    let max_delay = rng.range(20 * MS, MS + (3000.0 * i) as Micros * MS);
                    let max_inputs = rng.range(1, 2 + (2000.0 * i) as u64) as u32;
                    faults.push((
                        start,
                        Fault::Lag {
                            proc,
                            until: clamp(start + len),
                            max_delay,
                            max_inputs,
                        },
                    ));
                }
            }
        }
        if let Some(i) = swarm.get(Family::Hang) {
            let Timing {
                silence,
                grace,
                bid,
            } = timing;
            for _ in 0..count(rng, i, 60.0).max(1) {
                let start = at(rng);
                let roll = rng.unit();
                let len = if roll < 0.4 {
                    // Past bid_timeout, within silence: the mill re-sends an unanswered
                    // commit on a live session (M17).
                    rng.range(
                        bid + 200 * MS,
                        silence.saturating_sub(500 * MS).max(bid + 300 * MS),
                    )
                } else if roll < 0.8 {
                    // Past silence_timeout: only the mill's silence check closes the session
                    // (M9); back within grace.
                    rng.range(
                        silence + SEC,
                        silence + grace.saturating_sub(SEC).max(2 * SEC),
                    )
                } else {
                    // Past silence and grace: the leases end at grace expiry while the process
                    // is still stopped; its late fence (E12) stops the jobs when it resumes,
                    // within I1's bound (a watchdog restarts a process hung longer).
                    rng.range(silence + grace + SEC, silence + 2 * grace)
                };
                faults.push((
                    start,
                    Fault::Hang {
                        exec: rng.index(executors),
                        until: start + len,
                    },
                ));
            }
        }
        if let Some(i) = swarm.get(Family::Lose) {
            // At most one host in three lost, and never the whole fleet.
            let most = (executors / 3).max(1).min(executors.saturating_sub(1));
            let n = count(rng, i, 200.0).clamp(1, most.max(1));
            if executors > 1 {
                let mut all: Vec<usize> = (0..executors).collect();
                for _ in 0..n {
                    let k = rng.index(all.len());
                    let exec = all.swap_remove(k);
                    faults.push((at(rng), Fault::Lose { exec }));
                }
            }
        }
        if let Some(i) = swarm.get(Family::Failover) {
            let silence = timing.silence;
            for _ in 0..count(rng, i, 120.0).max(1) {
                let start = at(rng);
                if rng.chance(0.6) {
                    // Back before the executors' silence check (their links still open,
                    // they have not heard the successor) or after it (they have).
                    let long = rng.chance(0.5);
                    let len = LEADER_LEASE
                        + if long {
                            rng.range(silence + SEC, silence + 20 * SEC)
                        } else {
                            rng.range(SEC, silence.saturating_sub(LEADER_LEASE).max(2 * SEC))
                        };
                    faults.push((start, Fault::PauseMill { until: start + len }));
                    // Executors restarted just after a long pause ends have heard the
                    // successor; each dials the first address first and may reach the
                    // deposed mill before it steps down (E13: refused at Hello).
                    if long {
                        for _ in 0..2 {
                            faults.push((
                                start + len + rng.range(0, RENEW_AFTER_RESUME / 2),
                                Fault::CrashExec {
                                    exec: rng.index(executors),
                                    wipe: false,
                                    down: rng.range(20 * MS, 300 * MS),
                                    silent: false,
                                    at_commit: false,
                                },
                            ));
                        }
                    }
                } else {
                    faults.push((start, Fault::CutMillStore));
                }
            }
        }
        faults.sort_by_key(|(t, _)| *t);
        FaultPlan { faults }
    }
}

/// The mill's timings a fault plan draws lengths from (microseconds).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// `silence_timeout`.
    pub silence: Micros,
    /// `reconnect_grace`.
    pub grace: Micros,
    /// `bid_timeout`.
    pub bid: Micros,
}

impl Timing {
    /// The timings of `scenario`'s mill config.
    pub fn of(scenario: &Scenario) -> Timing {
        let c = scenario.mill_config();
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Timing {
            silence: us(c.silence_timeout),
            grace: us(c.reconnect_grace),
            bid: us(c.bid_timeout),
        }
    }
}

/// A random non-empty proper subset of the executors (the mill stays on the other side).
fn partition_side(rng: &mut Rng, executors: usize) -> Vec<usize> {
    let k = rng.range(1, executors.max(1) as u64) as usize;
    let mut all: Vec<usize> = (0..executors).collect();
    let mut side = Vec::with_capacity(k);
    for _ in 0..k.min(executors) {
        let i = rng.index(all.len());
        side.push(all.swap_remove(i));
    }
    side.sort_unstable();
    side
}

/// The items of `all` whose index is in `keep` (out-of-range indices are ignored), in order.
pub fn keep_indices<T>(all: Vec<T>, keep: &[usize]) -> Vec<T> {
    let keep: std::collections::BTreeSet<usize> = keep.iter().copied().collect();
    all.into_iter()
        .enumerate()
        .filter(|(k, _)| keep.contains(k))
        .map(|(_, x)| x)
        .collect()
}

/// The swarm and fault plan of one seed.
#[derive(Debug, Clone)]
pub struct SeedPlan {
    /// The seed.
    pub seed: u64,
    /// Families on.
    pub swarm: Swarm,
    /// Faults.
    pub faults: FaultPlan,
}

impl SeedPlan {
    /// Derives both from the seed.
    pub fn new(scenario: &Scenario, seed: u64) -> SeedPlan {
        let mut swarm_rng = Rng::new(seed, Purpose::Swarm);
        let swarm = Swarm::draw(scenario, &mut swarm_rng);
        let mut fault_rng = Rng::new(seed, Purpose::Faults);
        let faults = FaultPlan::draw(
            &swarm,
            scenario.fault_window,
            scenario.executors,
            Timing::of(scenario),
            &mut fault_rng,
        );
        // Scripted faults join the drawn ones; a stable sort keeps drawn-before-scripted at
        // equal times, and leaves a plan without a script exactly as drawn.
        let mut faults = faults;
        if !scenario.script.is_empty() {
            faults.faults.extend(scenario.script.iter().cloned());
            faults.faults.sort_by_key(|(t, _)| *t);
        }
        if let Some(keep) = &scenario.keep {
            faults.faults = keep_indices(std::mem::take(&mut faults.faults), &keep.faults);
        }
        SeedPlan {
            seed,
            swarm,
            faults,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_has_a_valid_mill_config_and_unique_name() {
        let all = scenarios();
        for s in &all {
            assert!(s.mill_config().validate().is_ok(), "{}", s.name);
            assert!(!s.about.is_empty(), "{}", s.name);
            assert_eq!(all.iter().filter(|o| o.name == s.name).count(), 1);
        }
    }

    #[test]
    fn swarm_leaves_at_least_one_family_off() {
        let s = scenario("smoke").unwrap();
        for seed in 0..200 {
            let plan = SeedPlan::new(&s, seed);
            assert!(Family::ALL.iter().any(|f| !plan.swarm.has(*f)));
        }
    }

    #[test]
    fn plans_are_a_function_of_the_seed() {
        let s = scenario("fleet-5x1000").unwrap();
        let a = SeedPlan::new(&s, 42);
        let b = SeedPlan::new(&s, 42);
        assert_eq!(a.swarm, b.swarm);
        assert_eq!(a.faults, b.faults);
    }
}
