//! The swarm (which fault families a seed turns on, and how hard) and the fault plan: plain
//! data derived from the seed before the run starts (TigerBeetle's habit), printed in every
//! failure report (moved out of `scenario.rs` unchanged, issue 17 item 3).

use std::fmt;

use super::*;

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
