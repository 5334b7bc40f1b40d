//! The schema of a scenario file: the serde documents each TOML section deserializes into,
//! unknown keys refused (moved out of `scenario_file.rs` unchanged, issue 17 item 3).

use super::*;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Doc {
    pub(super) about: Spanned<String>,
    pub(super) topology: Spanned<TopologyDoc>,
    pub(super) workload: WorkloadDoc,
    #[serde(default)]
    pub(super) faults: FaultsDoc,
    #[serde(default)]
    pub(super) config: Option<Spanned<ConfigDoc>>,
    #[serde(default)]
    pub(super) expect: ExpectDoc,
    #[serde(default)]
    pub(super) shrunk: Option<ShrunkDoc>,
}

/// `[shrunk]`: what `millrace-sim shrink` kept of its seed's plan and workload.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ShrunkDoc {
    /// The seed it was shrunk from (replay with this seed).
    pub(super) seed: u64,
    /// Indices into the seed's fault plan.
    pub(super) faults: Vec<usize>,
    /// Indices into the seed's arrivals.
    pub(super) jobs: Vec<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TopologyDoc {
    /// A drawn fleet of this many executors, `x0`, `x1`, …
    pub(super) executors: Option<Spanned<usize>>,
    /// Seats per engine of a drawn fleet, lowest and highest.
    pub(super) seats: Option<Spanned<(u32, u32)>>,
    /// An explicit fleet, in groups.
    #[serde(default)]
    pub(super) executor: Vec<GroupDoc>,
    /// Fraction of messages through the wire codec.
    pub(super) codec_fraction: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GroupDoc {
    pub(super) name: Spanned<String>,
    pub(super) count: Option<Spanned<usize>>,
    #[serde(default)]
    pub(super) labels: BTreeSet<String>,
    #[serde(default)]
    pub(super) engines: BTreeMap<String, EngineDoc>,
    pub(super) byzantine: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) slow_stop: bool,
    #[serde(default)]
    pub(super) extra_charge: Option<Spanned<BTreeMap<String, u64>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EngineDoc {
    pub(super) seats: Spanned<u32>,
    #[serde(default)]
    pub(super) resources: BTreeMap<String, u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WorkloadDoc {
    pub(super) jobs: Spanned<usize>,
    pub(super) arrivals: Spanned<Dur>,
    pub(super) duration: DurationDoc,
    pub(super) burst: Option<Spanned<f64>>,
    pub(super) cancel_rate: Option<Spanned<f64>>,
    pub(super) cancel_within: Option<Dur>,
    pub(super) invalid_rate: Option<Spanned<f64>>,
    pub(super) owners: Option<Spanned<usize>>,
    pub(super) max_pending: Option<Spanned<usize>>,
    pub(super) cpu_millis: Option<Spanned<(u64, u64)>>,
    pub(super) quota: Option<QuotaDoc>,
    #[serde(default)]
    pub(super) require: Vec<RequireDoc>,
    pub(super) retry_rate: Option<Spanned<f64>>,
    pub(super) priorities: Option<Spanned<u32>>,
    pub(super) pinned: Option<Spanned<f64>>,
    pub(super) whole_engine: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DurationDoc {
    pub(super) mean: Spanned<Dur>,
    pub(super) max: Spanned<Dur>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct QuotaDoc {
    #[serde(default)]
    pub(super) owner: Resources,
    #[serde(default)]
    pub(super) repo: Resources,
    #[serde(default)]
    pub(super) owners: BTreeMap<String, Resources>,
    #[serde(default)]
    pub(super) repos: BTreeMap<String, Resources>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RequireDoc {
    pub(super) labels: BTreeSet<String>,
    pub(super) share: Spanned<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FaultsDoc {
    pub(super) window: Option<Spanned<Dur>>,
    #[serde(default)]
    pub(super) on: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) swarm: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) intensity: BTreeMap<String, Spanned<f64>>,
    #[serde(default)]
    pub(super) script: Vec<Spanned<FaultDoc>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FaultDoc {
    pub(super) at: Spanned<Dur>,
    #[serde(rename = "for")]
    pub(super) for_: Option<Spanned<Dur>>,
    pub(super) partition: Option<Vec<Spanned<String>>>,
    pub(super) one_way: Option<bool>,
    pub(super) clog: Option<Spanned<String>>,
    pub(super) direction: Option<Spanned<String>>,
    pub(super) spike: Option<Dur>,
    pub(super) reset: Option<Spanned<String>>,
    pub(super) crash: Option<Spanned<String>>,
    pub(super) wipe: Option<Spanned<String>>,
    pub(super) restart_after: Option<Dur>,
    pub(super) silent: Option<bool>,
    pub(super) flap: Option<Spanned<String>>,
    pub(super) period: Option<Spanned<Dur>>,
    pub(super) down: Option<Dur>,
    pub(super) at_commit: Option<bool>,
    pub(super) lag: Option<Spanned<String>>,
    pub(super) hang: Option<Spanned<String>>,
    pub(super) lose: Option<Spanned<String>>,
    pub(super) twin: Option<Spanned<String>>,
    pub(super) max_delay: Option<Spanned<Dur>>,
    pub(super) max_inputs: Option<Spanned<u32>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ConfigDoc {
    pub(super) preset: Option<Spanned<String>>,
    pub(super) reconnect_grace: Option<Dur>,
    pub(super) silence_timeout: Option<Dur>,
    pub(super) snapshot_interval: Option<Dur>,
    pub(super) bid_timeout: Option<Dur>,
    pub(super) cancel_ack_timeout: Option<Dur>,
    pub(super) cancel_teardown_timeout: Option<Dur>,
    pub(super) job_timeout: Option<Dur>,
    pub(super) queue_timeout: Option<Dur>,
    pub(super) quarantine_strikes: Option<u32>,
    pub(super) max_sessions: Option<usize>,
    pub(super) direct_placement: Option<bool>,
    pub(super) late_binding: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExpectDoc {
    pub(super) invariants: Option<Vec<Spanned<String>>>,
    pub(super) liveness_bound: Option<Dur>,
    #[serde(default)]
    pub(super) reach: Vec<Spanned<String>>,
    pub(super) seeds: Option<u64>,
}
