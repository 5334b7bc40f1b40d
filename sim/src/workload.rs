//! The fleet's shape and the workload: executors with engines, seats, labels and resources;
//! jobs arriving over time with engines, labels, resources, owners under quota, timeouts,
//! user cancels, and invalid submits. All drawn from the workload stream (violators from the
//! byzantine stream), before the run starts.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use millrace_core::executor::EngineConfig;
use millrace_core::job::{Identity, JobSpec, RetryOn, RetryPolicy};
use millrace_core::quota::QuotaConfig;
use millrace_core::Resources;

use crate::byzantine::ByzKind;
use crate::rng::Rng;
use crate::scenario::{Family, Knobs, Micros, Scenario, Swarm, MS, SEC};

/// One executor of the fleet.
#[derive(Debug, Clone)]
pub struct ExecSpec {
    /// Node id.
    pub name: String,
    /// Labels held.
    pub labels: BTreeSet<String>,
    /// Engines offered.
    pub engines: BTreeMap<String, EngineConfig>,
    /// Misbehaves this way, if it does.
    pub byzantine: Option<ByzKind>,
    /// Its engine takes longer than the teardown deadline to stop jobs.
    pub slow_stop: bool,
    /// It charges one more resource than the job asks for (an honest, different policy;
    /// M14 lets executors name their charge), so re-bids may change charges (M15).
    pub extra_charge: Option<(String, u64)>,
}

/// What arrives at the mill's client API.
#[derive(Debug, Clone)]
pub enum Arrival {
    /// A valid job; `cancel_after` is when (after submission) its user cancels it.
    Job {
        /// The spec.
        spec: JobSpec,
        /// When the user cancels, after the submit.
        cancel_after: Option<Micros>,
    },
    /// An invalid spec; `what` names the broken field.
    Invalid {
        /// The spec.
        spec: JobSpec,
        /// The field that is wrong.
        what: &'static str,
    },
}

/// Fleet and workload of one seed.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Executors.
    pub fleet: Vec<ExecSpec>,
    /// Arrivals in time order.
    pub arrivals: Vec<(Micros, Arrival)>,
    /// Quota limits for the mill.
    pub quota: QuotaConfig,
    /// The mill's `max_pending`.
    pub max_pending: usize,
}

const LABELS: [(&str, f64); 4] = [("linux", 0.8), ("arm", 0.3), ("gpu", 0.2), ("ssd", 0.5)];

impl Workload {
    /// Draws the fleet and the workload. `byz` decides which executors misbehave.
    /// `retry` decides which jobs get a retry policy (M32), from a stream of its own so that
    /// every other draw of a seed stays what it was.
    pub fn draw(
        scenario: &Scenario,
        swarm: &Swarm,
        rng: &mut Rng,
        byz: &mut Rng,
        retry: &mut Rng,
    ) -> Workload {
        let fleet = match &scenario.fleet {
            Some(list) => list
                .iter()
                .map(|t| ExecSpec {
                    name: t.name.clone(),
                    labels: t.labels.clone(),
                    engines: t.engines.clone(),
                    byzantine: t.byzantine,
                    slow_stop: t.slow_stop,
                    extra_charge: t.extra_charge.clone(),
                })
                .collect(),
            None => draw_fleet(scenario, swarm, rng, byz),
        };
        let n = fleet.len();
        let honest: Vec<usize> = (0..n).filter(|i| fleet[*i].byzantine.is_none()).collect();

        let knobs = &scenario.knobs;
        let quota_on = swarm.get(Family::Quota);
        let quota = match quota_on {
            Some(q) => {
                let jobs = 2 + ((1.0 - q) * 6.0) as u64;
                // A limit on every resource an executor charges (the job's own, and the
                // `disk_mb` some executors add, M14), so a charge that changes between bids
                // counts against quota (M15).
                QuotaConfig {
                    owner_defaults: Resources::from([
                        ("jobs".to_string(), jobs),
                        ("cpu_millis".to_string(), 6000),
                        ("memory_mb".to_string(), 12_288),
                        ("disk_mb".to_string(), 4 + ((1.0 - q) * 4.0) as u64),
                    ]),
                    repo_defaults: Resources::from([("jobs".to_string(), jobs.max(2) - 1)]),
                    owner_overrides: BTreeMap::from([(
                        "o0".to_string(),
                        Resources::from([("jobs".to_string(), 1)]),
                    )]),
                    repo_overrides: BTreeMap::new(),
                }
            }
            None => QuotaConfig::default(),
        };
        let quota = knobs.quota.clone().unwrap_or(quota);
        let max_pending = match quota_on {
            Some(q) => 8 + ((1.0 - q) * 40.0) as usize,
            None => 10_000,
        };
        let max_pending = knobs.max_pending.unwrap_or(max_pending);

        let cancel_p = swarm.get(Family::Cancel).map_or(0.0, |i| 0.3 * i);
        let cancel_p = knobs.cancel_rate.unwrap_or(cancel_p);
        let cancel_within = knobs.cancel_within.unwrap_or(2 * scenario.job_mean + SEC);
        let invalid_p = swarm.get(Family::InvalidSubmit).map_or(0.0, |i| 0.1 * i);
        let invalid_p = knobs.invalid_rate.unwrap_or(invalid_p);
        let burst = knobs
            .burst
            .or_else(|| quota_on.is_some().then_some(0.1))
            .unwrap_or(0.0);
        let mut times: Vec<Micros> = (0..scenario.jobs)
            .map(|_| rng.range(0, scenario.arrival.max(1)))
            .collect();
        times.sort_unstable();
        if burst > 0.0 {
            // Bursts: a share of the jobs arrive with their predecessor (M10, Q2).
            for i in 1..times.len() {
                if rng.chance(burst) {
                    times[i] = times[i - 1];
                }
            }
        }
        let mut arrivals = Vec::with_capacity(times.len() + times.len() / 8);
        for (k, at) in times.into_iter().enumerate() {
            // A label constraint (M13): only the part of the fleet holding the labels may
            // take the job, and the spec is drawn from one of those executors.
            let mut required = None;
            for (labels, share) in &knobs.require {
                if rng.chance(*share) {
                    required = Some(labels);
                    break;
                }
            }
            let hosts: Vec<usize> = match required {
                Some(l) => honest
                    .iter()
                    .copied()
                    .filter(|i| l.is_subset(&fleet[*i].labels))
                    .collect(),
                None => Vec::new(),
            };
            let hosts = if hosts.is_empty() { &honest } else { &hosts };
            let h = &fleet[*rng.pick(hosts)];
            let mut spec = job_spec(rng, h, k, quota_on.is_some(), knobs);
            if let Some(l) = required.filter(|l| l.is_subset(&h.labels)) {
                spec.labels = l.clone();
            }
            spec.retry = retry_policy(retry, knobs.retry_rate.unwrap_or(0.25));
            if let Some(n) = knobs.priorities {
                // From the retry stream too, and only when asked for: no other scenario's
                // draws move.
                let n = u64::from(n);
                spec.priority = i32::try_from(retry.range(0, 2 * n)).unwrap_or(0)
                    - i32::try_from(n).unwrap_or(0);
            }
            // M34, like priorities: from the retry stream, only when asked for.
            if knobs.pinned.is_some_and(|p| retry.chance(p)) {
                spec.node = millrace_core::NodeId::new(h.name.clone()).ok();
            }
            if spec.engine == "shell" && knobs.whole_engine.is_some_and(|p| retry.chance(p)) {
                let cpu = h
                    .engines
                    .get("shell")
                    .and_then(|e| e.resources.get("cpu_millis"));
                if let Some(&cpu) = cpu {
                    spec.resources.insert("cpu_millis".to_string(), cpu);
                }
            }
            let cancel_after = rng.chance(cancel_p).then(|| rng.range(0, cancel_within));
            arrivals.push((at, Arrival::Job { spec, cancel_after }));
            if rng.chance(invalid_p) {
                let (spec, what) = invalid_spec(rng, k);
                arrivals.push((at + rng.range(0, SEC), Arrival::Invalid { spec, what }));
            }
        }
        arrivals.sort_by_key(|(t, _)| *t);
        Workload {
            fleet,
            arrivals,
            quota,
            max_pending,
        }
    }
}

/// Draws a fleet of `scenario.executors` executors (labels, engines, seats, slow engines,
/// different charges, and the violators the swarm asks for).
fn draw_fleet(scenario: &Scenario, swarm: &Swarm, rng: &mut Rng, byz: &mut Rng) -> Vec<ExecSpec> {
    let n = scenario.executors.max(1);
    let mut fleet = Vec::with_capacity(n);
    for i in 0..n {
        let labels: BTreeSet<String> = LABELS
            .iter()
            .filter(|(_, p)| rng.chance(*p))
            .map(|(l, _)| l.to_string())
            .collect();
        let mut engines = BTreeMap::new();
        let (lo, hi) = scenario.seats;
        let cpu = *rng.pick(&[4000u64, 8000, 16000]);
        engines.insert(
            "shell".to_string(),
            EngineConfig {
                capacity: rng.range(u64::from(lo), u64::from(hi)) as u32,
                resources: Resources::from([("cpu_millis".to_string(), cpu)]),
            },
        );
        if rng.chance(0.5) {
            let mem = *rng.pick(&[4096u64, 8192]);
            engines.insert(
                "docker".to_string(),
                EngineConfig {
                    capacity: rng.range(u64::from(lo), u64::from(hi)) as u32,
                    resources: Resources::from([("memory_mb".to_string(), mem)]),
                },
            );
        }
        let slow_stop = swarm
            .get(Family::SlowStop)
            .is_some_and(|p| rng.chance(0.3 + 0.7 * p));
        let extra_charge = swarm
            .get(Family::Quota)
            .filter(|_| rng.chance(0.5))
            .map(|_| ("disk_mb".to_string(), rng.range(1, 3)));
        fleet.push(ExecSpec {
            name: format!("x{i}"),
            labels,
            engines,
            byzantine: None,
            slow_stop,
            extra_charge,
        });
    }
    if let Some(p) = swarm.get(Family::Byzantine) {
        // At most a third of the fleet (at least one), never everyone.
        let max = (n / 3).max(1).min(n.saturating_sub(1));
        let k = ((max as f64 * p).ceil() as usize).clamp(1, max.max(1));
        if n > 1 {
            let mut idx: Vec<usize> = (0..n).collect();
            for _ in 0..k {
                let j = byz.index(idx.len());
                let i = idx.swap_remove(j);
                fleet[i].byzantine = Some(*byz.pick(&ByzKind::ALL));
            }
        }
    }
    fleet
}

fn job_spec(rng: &mut Rng, on: &ExecSpec, k: usize, quota: bool, knobs: &Knobs) -> JobSpec {
    let engines: Vec<&String> = on.engines.keys().collect();
    let engine = (*rng.pick(&engines)).clone();
    let labels: BTreeSet<String> = on
        .labels
        .iter()
        .filter(|_| rng.chance(0.3))
        .cloned()
        .collect();
    let mut resources = Resources::new();
    let total = |name: &str| {
        on.engines
            .get(&engine)
            .and_then(|e| e.resources.get(name))
            .copied()
            .unwrap_or(0)
    };
    if engine == "shell" {
        let cpu = total("cpu_millis");
        if rng.chance(0.02) {
            // Incompatible everywhere (M13): more CPU than any engine has.
            resources.insert("cpu_millis".to_string(), 1_000_000);
        } else if quota && cpu >= 7000 && rng.chance(0.04) {
            // Over the owner's cpu limit: quota denied (M15).
            resources.insert("cpu_millis".to_string(), 7000);
        } else if rng.chance(0.6) {
            // Up to a quarter of the engine: CI jobs share a machine.
            let (lo, hi) = knobs.cpu_millis.unwrap_or((100, (cpu / 4).max(200)));
            resources.insert("cpu_millis".to_string(), rng.range(lo, hi));
        }
    } else if rng.chance(0.6) {
        let mem = total("memory_mb").max(512);
        resources.insert("memory_mb".to_string(), rng.range(128, mem / 2));
    }
    let owner = rng.index(knobs.owners.unwrap_or(4));
    let identity = Identity {
        owner: format!("o{owner}"),
        repo: format!("o{owner}/r{}", rng.index(3)),
    };
    let timeout = rng
        .chance(0.08)
        .then(|| Duration::from_micros(rng.range(5 * SEC, 90 * SEC)));
    JobSpec {
        retry: Default::default(),
        priority: 0,
        node: None,
        engine,
        labels,
        resources,
        identity,
        timeout,
        payload: format!("job {k}").into_bytes(),
        env: Default::default(),
    }
}

/// M32: a share `rate` of jobs may be retried, 1–3 times, on the executor's failures and
/// sometimes on its own.
fn retry_policy(rng: &mut Rng, rate: f64) -> RetryPolicy {
    if !rng.chance(rate) {
        return RetryPolicy::default();
    }
    let retries = rng.range(1, 4) as u32;
    let mut on: BTreeSet<RetryOn> = RetryOn::ALL
        .into_iter()
        .filter(|r| rng.chance(if *r == RetryOn::Failed { 0.3 } else { 0.8 }))
        .collect();
    if on.is_empty() {
        on.insert(RetryOn::ExecutorLost);
    }
    RetryPolicy { retries, on }
}

/// A job any shell seat can run: no labels, no resources, owner `o0`, empty payload.
pub(crate) fn plain_spec() -> JobSpec {
    JobSpec {
        retry: Default::default(),
        priority: 0,
        node: None,
        engine: "shell".into(),
        labels: BTreeSet::new(),
        resources: Resources::new(),
        identity: Identity {
            owner: "o0".into(),
            repo: "o0/r0".into(),
        },
        timeout: None,
        payload: Vec::new(),
        env: Default::default(),
    }
}

fn invalid_spec(rng: &mut Rng, k: usize) -> (JobSpec, &'static str) {
    let mut s = plain_spec();
    s.payload = format!("invalid {k}").into_bytes();
    let what = match rng.index(6) {
        0 => {
            s.engine = String::new();
            "engine"
        }
        1 => {
            s.labels = (0..40).map(|i| format!("l{i}")).collect();
            "labels"
        }
        2 => {
            s.resources.insert("cpu_millis".into(), 0);
            "resources"
        }
        3 => {
            s.timeout = Some(Duration::ZERO);
            "timeout"
        }
        4 => {
            s.identity.owner = String::new();
            "owner"
        }
        _ => {
            s.payload = vec![0; millrace_core::job::MAX_PAYLOAD + 1 + rng.index(100)];
            "payload"
        }
    };
    (s, what)
}

/// The longest job runs this many times `Scenario::job_max`.
pub const LONG_JOBS: u64 = 5;

/// How long the engine of a job runs it: exponential around `mean` up to `max`, a few
/// between `max / 2` and `max`, and one in fifty up to `LONG_JOBS × max`.
pub fn job_duration(rng: &mut Rng, mean: Micros, max: Micros) -> Micros {
    let roll = rng.unit();
    if roll < 0.02 {
        // A long one, outliving partitions and grace periods (E12, M5).
        return rng.range(max, LONG_JOBS * max);
    }
    if roll < 0.05 {
        return rng.range(max / 2, max);
    }
    (rng.exp(mean as f64) as Micros).clamp(20 * MS, max)
}

/// Exact per-job durations, looked up by the job index in the spec's payload (placement-quality
/// runs, `crate::quality`).
#[derive(Debug, Clone)]
pub struct Durations {
    /// By job index.
    pub per_job: Vec<Micros>,
}

impl Durations {
    /// The duration of the job `spec` (its payload holds its index, little-endian u64);
    /// `None` when the payload names no job of the experiment.
    pub fn of(&self, spec: &JobSpec) -> Option<Micros> {
        let k = spec
            .payload
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes)
            .and_then(|k| usize::try_from(k).ok())?;
        self.per_job.get(k).copied()
    }
}
