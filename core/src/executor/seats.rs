//! Seats: reservations and running jobs, what a seat charges, and who may take one (E2, E3).

use std::collections::BTreeMap;

use crate::job::JobSpec;
use crate::types::{bounded_reason, validate_resources, JobId, LeaseId, Resources, Time};
use crate::wire::{EngineStatus, MAX_REASON};

use super::config::{EngineConfig, ExecutorConfig, SEAT_LOAD, SEAT_RESOURCE};

/// A seat held for a job the mill has not committed yet.
#[derive(Debug, Clone)]
pub(super) struct Reservation {
    pub(super) job: JobId,
    pub(super) spec: JobSpec,
    pub(super) charged: Resources,
    pub(super) expires: Time,
}

pub(super) use super::store::StopReason;

/// A committed job: started (or being started) by the engine.
#[derive(Debug, Clone)]
pub(super) struct RunningJob {
    pub(super) engine: String,
    pub(super) charged: Resources,
    /// The engine reported it started and its Running event is in the outbox.
    pub(super) started: bool,
    pub(super) stop: Option<StopReason>,
    /// End of the job's output as far as the engine reported it (E15): where the end mark
    /// sent with its terminal says the output stops.
    pub(super) log_end: u64,
}

/// Every seat in use.
#[derive(Debug, Clone, Default)]
pub(super) struct Seats {
    pub(super) reserved: BTreeMap<LeaseId, Reservation>,
    pub(super) running: BTreeMap<LeaseId, RunningJob>,
}

/// A seat turned down (E2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Busy now; may fit later.
    Transient(String),
    /// Never on this executor.
    Incompatible(String),
}

impl Seats {
    /// Seats and declared resources used on `engine`.
    fn used(&self, engine: &str) -> (u32, Resources) {
        let mut seats = 0u32;
        let mut resources = Resources::new();
        let charges = self
            .reserved
            .values()
            .filter(|r| r.spec.engine == engine)
            .map(|r| &r.charged)
            .chain(
                self.running
                    .values()
                    .filter(|j| j.engine == engine)
                    .map(|j| &j.charged),
            );
        for charged in charges {
            seats = seats.saturating_add(1);
            for (name, amount) in charged {
                let used = resources.entry(name.clone()).or_insert(0);
                *used = used.saturating_add(*amount);
            }
        }
        (seats, resources)
    }

    /// Seats of `engine` reserved or running (what `used` counts, without the resources).
    pub(super) fn in_use(&self, engine: &str) -> u32 {
        let reserved = self.reserved.values().filter(|r| r.spec.engine == engine);
        let running = self.running.values().filter(|j| j.engine == engine);
        u32::try_from(reserved.count() + running.count()).unwrap_or(u32::MAX)
    }

    /// Outbox entries the current seats may still need: Running + Terminal for a seat whose
    /// job has not started, Terminal for one that has.
    pub(super) fn events_owed(&self) -> usize {
        let reserved = self.reserved.len().saturating_mul(2);
        let running: usize = self
            .running
            .values()
            .map(|j| if j.started { 1 } else { 2 })
            .sum();
        reserved.saturating_add(running)
    }
}

/// Whether a job could ever run here, and what its seat charges: `jobs: 1` plus every
/// resource the job asks for.
pub(super) fn compatibility(config: &ExecutorConfig, spec: &JobSpec) -> Result<Resources, String> {
    if let Err(e) = spec.validate() {
        return Err(format!("invalid job spec: {e}"));
    }
    // M34: a job pinned to another node never runs here, whatever the mill asked.
    if let Some(node) = &spec.node {
        if node != &config.node_id {
            return Err(format!("pinned to node {node}, this is {}", config.node_id));
        }
    }
    let Some(engine) = config.engines.get(&spec.engine) else {
        let offered: Vec<&str> = config.engines.keys().map(String::as_str).collect();
        return Err(format!(
            "engine {:?} is not offered (offered: {})",
            spec.engine,
            offered.join(", ")
        ));
    };
    let missing: Vec<&str> = spec
        .labels
        .iter()
        .filter(|l| !config.labels.contains(*l))
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        return Err(format!("missing labels: {}", missing.join(", ")));
    }
    if let Some(&jobs) = spec.resources.get(SEAT_RESOURCE) {
        if jobs != 1 {
            return Err(format!(
                "a job takes one seat; it asks for {SEAT_RESOURCE}: {jobs}"
            ));
        }
    }
    for (name, &total) in &engine.resources {
        let asked = spec.resources.get(name).copied().unwrap_or(0);
        if asked > total {
            return Err(format!(
                "resource {name}: asks for {asked}, engine {:?} has {total} in all",
                spec.engine
            ));
        }
    }
    let charged = spec.seat_charge();
    if let Err(e) = validate_resources(&charged) {
        return Err(format!("resources: {e}"));
    }
    Ok(charged)
}

/// Whether a seat of `engine` is free now for a job asking for `charged`.
fn fits_now(
    seats: &Seats,
    name: &str,
    engine: &EngineConfig,
    charged: &Resources,
) -> Result<(), String> {
    let (used_seats, used) = seats.used(name);
    if used_seats >= engine.capacity {
        return Err(format!(
            "engine {name:?} busy: {used_seats}/{} seats in use",
            engine.capacity
        ));
    }
    for (resource, &total) in &engine.resources {
        let asked = charged.get(resource).copied().unwrap_or(0);
        let free = total.saturating_sub(used.get(resource).copied().unwrap_or(0));
        if asked > free {
            return Err(format!(
                "resource {resource}: asks for {asked}, {free} of {total} free"
            ));
        }
    }
    Ok(())
}

/// Admission of a new seat (E2): incompatibility first (it is the lasting answer), then
/// draining, outbox headroom and free capacity (transient). Returns the charge.
pub(super) fn admit(
    config: &ExecutorConfig,
    seats: &Seats,
    spec: &JobSpec,
    closed: Option<&str>,
) -> Result<Resources, Refusal> {
    let charged = compatibility(config, spec)
        .map_err(|r| Refusal::Incompatible(bounded_reason(r, MAX_REASON)))?;
    if let Some(why) = closed {
        return Err(Refusal::Transient(bounded_reason(why, MAX_REASON)));
    }
    if let Some(engine) = config.engines.get(&spec.engine) {
        fits_now(seats, &spec.engine, engine, &charged)
            .map_err(|r| Refusal::Transient(bounded_reason(r, MAX_REASON)))?;
    }
    Ok(charged)
}

/// Per-engine status for a snapshot: available when open and a seat is free; loads in 0..=1
/// for `seats` and each declared resource.
pub(super) fn engine_statuses(
    config: &ExecutorConfig,
    seats: &Seats,
    open: bool,
) -> BTreeMap<String, EngineStatus> {
    config
        .engines
        .iter()
        .map(|(name, engine)| {
            let (used_seats, used) = seats.used(name);
            let mut load = BTreeMap::new();
            load.insert(
                SEAT_LOAD.to_string(),
                ratio(u64::from(used_seats), u64::from(engine.capacity)),
            );
            for (resource, &total) in &engine.resources {
                let u = used.get(resource).copied().unwrap_or(0);
                load.insert(resource.clone(), ratio(u, total));
            }
            let status = EngineStatus {
                available: open && used_seats < engine.capacity,
                capacity: engine.capacity,
                load,
            };
            (name.clone(), status)
        })
        .collect()
}

fn ratio(used: u64, total: u64) -> f64 {
    if total == 0 {
        return 1.0;
    }
    // Precision loss above 2^53 is irrelevant for a load figure.
    #[allow(clippy::cast_precision_loss)]
    let r = used as f64 / total as f64;
    r.clamp(0.0, 1.0)
}
