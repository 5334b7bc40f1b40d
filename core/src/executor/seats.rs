//! Seats: reservations and running jobs, what a seat charges, and who may take one (E2, E3).

use std::collections::BTreeMap;

use crate::job::JobSpec;
use crate::types::{bounded_reason, validate_resources, JobId, LeaseId, Resources, Time};
use crate::wire::{EngineStatus, MAX_ACTIVE_LEASES, MAX_REASON};

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

/// E16: a direct ask (M36) that found every seat of its engine taken: it holds no seat and
/// starts on the next one that frees, once its commit has come.
#[derive(Debug, Clone)]
pub(super) struct Waiting {
    pub(super) reservation: Reservation,
    /// Its `CommitLease` came, with these secrets (never persisted): it starts on the next
    /// free seat, and the commit is answered then, once it is durable (E4). Until it comes
    /// the lease expires at its ttl like any reservation (E3).
    pub(super) secrets: Option<BTreeMap<String, String>>,
}

/// Every seat in use, and the leases waiting for one (E16).
#[derive(Debug, Clone, Default)]
pub(super) struct Seats {
    pub(super) reserved: BTreeMap<LeaseId, Reservation>,
    pub(super) running: BTreeMap<LeaseId, RunningJob>,
    pub(super) waiting: BTreeMap<LeaseId, Waiting>,
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

    /// Leases of `engine` waiting for a seat (E16).
    pub(super) fn waiting_on(&self, engine: &str) -> u32 {
        let n = self
            .waiting
            .values()
            .filter(|w| w.reservation.spec.engine == engine)
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Every lease held here: reserved, running or waiting for a seat.
    pub(super) fn leases_held(&self) -> usize {
        self.reserved.len() + self.running.len() + self.waiting.len()
    }

    /// E16: whether one more lease of `engine` (with `capacity` seats) may wait for a seat:
    /// at most `capacity` wait per engine, and never so many leases in all that a snapshot's
    /// list would pass its bound.
    fn may_wait(&self, engine: &str, capacity: u32) -> bool {
        self.waiting_on(engine) < capacity && self.leases_held() < MAX_ACTIVE_LEASES
    }

    /// Outbox entries the current seats may still need: Running + Terminal for a seat whose
    /// job has not started (or a lease waiting for one), Terminal for one that has.
    pub(super) fn events_owed(&self) -> usize {
        let reserved = (self.reserved.len() + self.waiting.len()).saturating_mul(2);
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

/// How an admitted lease holds its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admitted {
    /// A seat is free for it now (E2).
    Seat,
    /// E16: a direct ask with every seat taken: it waits for the next free one.
    Wait,
}

/// Admission of a new seat (E2): incompatibility first (it is the lasting answer), then
/// draining, outbox headroom and free capacity (transient). A `direct` ask (M35, M36) that
/// finds every seat taken waits for one while the engine's wait list has room (E16). Returns the
/// charge and how it is held.
pub(super) fn admit(
    config: &ExecutorConfig,
    seats: &Seats,
    spec: &JobSpec,
    closed: Option<&str>,
    direct: bool,
) -> Result<(Resources, Admitted), Refusal> {
    let charged = compatibility(config, spec)
        .map_err(|r| Refusal::Incompatible(bounded_reason(r, MAX_REASON)))?;
    if let Some(why) = closed {
        return Err(Refusal::Transient(bounded_reason(why, MAX_REASON)));
    }
    if let Some(engine) = config.engines.get(&spec.engine) {
        if let Err(why) = fits_now(seats, &spec.engine, engine, &charged) {
            // E16: only a direct ask that finds every seat taken waits (the mill stages a
            // job only on a node whose seats it holds all of, M36); one short of a resource
            // is refused, so the mill learns which (M34).
            let seats_full = seats.in_use(&spec.engine) >= engine.capacity;
            if direct && seats_full && seats.may_wait(&spec.engine, engine.capacity) {
                return Ok((charged, Admitted::Wait));
            }
            return Err(Refusal::Transient(bounded_reason(why, MAX_REASON)));
        }
    }
    Ok((charged, Admitted::Seat))
}

/// E16: whether a seat of `spec`'s engine is free now for a job charging `charged`.
pub(super) fn seat_free(
    config: &ExecutorConfig,
    seats: &Seats,
    spec: &JobSpec,
    charged: &Resources,
) -> bool {
    config
        .engines
        .get(&spec.engine)
        .is_some_and(|engine| fits_now(seats, &spec.engine, engine, charged).is_ok())
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
