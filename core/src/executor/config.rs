//! What an operator tunes on an executor, with the defaults a production node wants.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::types::{valid_name, validate_resources, NodeId, ResourceError, Resources};
use crate::wire::{
    MAX_ACTIVE_LEASES, MAX_ENGINES, MAX_LOAD_ENTRIES, MAX_NODE_LABELS, MAX_REASON, MAX_TOKEN,
};

pub use crate::types::SEAT_RESOURCE;
/// The load key that reports used seats / capacity in a snapshot.
pub const SEAT_LOAD: &str = "seats";

/// Default [`ExecutorConfig::snapshot_interval`]: 5 s, under the mill's default
/// `silence_timeout / 2` = 7.5 s (M9), so one lost snapshot never silences a session.
pub const DEFAULT_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(5);
/// Default [`ExecutorConfig::silence_timeout`]: 15 s, the mill's default.
pub const DEFAULT_SILENCE_TIMEOUT: Duration = Duration::from_secs(15);
/// Default [`ExecutorConfig::reconnect_grace`]: 45 s, the mill's default.
pub const DEFAULT_RECONNECT_GRACE: Duration = Duration::from_secs(45);
/// Default [`ExecutorConfig::backoff_min`]: 100 ms.
pub const DEFAULT_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Default [`ExecutorConfig::backoff_max`]: 10 s — at least four attempts fit in one
/// reconnect grace even at the cap.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Default [`ExecutorConfig::stop_grace`]: 10 s between the polite stop and the kill.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// Default [`ExecutorConfig::outbox_capacity`]: 10,000 unacked events (~5,000 finished jobs
/// waiting for the mill; well under a few MiB on disk since reasons are bounded).
pub const DEFAULT_OUTBOX_CAPACITY: usize = 10_000;
/// Default [`ExecutorConfig::live_log_chunk`]: 64 KiB per `LiveLog` message.
pub const DEFAULT_LIVE_LOG_CHUNK: usize = 64 * 1024;
/// Default [`ExecutorConfig::live_log_budget`]: 1 MiB of live log per snapshot interval.
pub const DEFAULT_LIVE_LOG_BUDGET: usize = 1024 * 1024;
/// Largest allowed [`ExecutorConfig::live_log_chunk`]: half a 1 MiB frame.
pub const MAX_LIVE_LOG_CHUNK: usize = 512 * 1024;
/// Most mill addresses an executor may be given (DESIGN §10).
pub const MAX_MILLS: usize = 16;

/// One engine the executor offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Seats: jobs of this engine that may be reserved or running at once (1..=4096).
    pub capacity: u32,
    /// Resources this engine has in all (e.g. `cpu_millis: 8000`), shared by its seats.
    ///
    /// A job asking for more of a declared resource than the total is Incompatible; more than
    /// is free now is Transient. Resources the engine does not declare are charged (for quota)
    /// but not limited here. `jobs` and `seats` are reserved names.
    pub resources: Resources,
}

impl EngineConfig {
    /// An engine with `capacity` seats and no declared resources.
    pub fn seats(capacity: u32) -> Self {
        EngineConfig {
            capacity,
            resources: Resources::new(),
        }
    }
}

/// Executor settings. Build with [`ExecutorConfig::new`] (defaults) and check with
/// [`ExecutorConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorConfig {
    /// This executor's name (E1).
    pub node_id: NodeId,
    /// Shared secret sent in `Hello` (1–1024 bytes).
    pub token: String,
    /// Labels held; a job runs here only if it requires none we lack (≤ 64).
    pub labels: BTreeSet<String>,
    /// Engines offered, by name (1–16). Default: `shell` with one seat.
    pub engines: BTreeMap<String, EngineConfig>,
    /// Snapshot at least this often (E10). Default 5 s; must be < `silence_timeout / 2`.
    pub snapshot_interval: Duration,
    /// Close a connection on which the mill has said nothing for this long, and give up on a
    /// connect or a Welcome after this long. Default 15 s (the mill's).
    pub silence_timeout: Duration,
    /// Self-fence after hearing nothing from the mill for this long (E12); also the longest a
    /// reservation is held (E3). Default 45 s; must be > `silence_timeout`.
    pub reconnect_grace: Duration,
    /// First reconnect delay (E11). Default 100 ms.
    pub backoff_min: Duration,
    /// Largest reconnect delay (E11). Default 10 s; must be < `reconnect_grace`.
    pub backoff_max: Duration,
    /// Seed of the backoff jitter; the driver picks it (random at every process start in
    /// production, so a fleet restarted together spreads out; from the run's seed in the
    /// simulator). Default 0.
    pub backoff_seed: u64,
    /// What `StopJob` gives the engine before it kills the job. Default 10 s.
    pub stop_grace: Duration,
    /// Most unacked events held (E5). New seats are refused once the outbox could not hold
    /// the Running and Terminal events of every seat. Default 10,000; at least 2 × seats.
    pub outbox_capacity: usize,
    /// Largest `LiveLog` message in bytes. Default 64 KiB; 1..=512 KiB.
    pub live_log_chunk: usize,
    /// Live-log bytes forwarded per `snapshot_interval`; beyond it bytes are dropped, and the
    /// offset of the next chunk (or of the end mark) shows the mill the hole (E15). 0 turns live logs off. Default 1 MiB.
    pub live_log_budget: usize,
    /// The mills' addresses, in the order they are tried (DESIGN §10): `Connect{mill: i}`
    /// asks the driver to dial `mills[i]`. A connect that fails, or a mill that refuses,
    /// moves on to the next; a standby's `Refused{leader}` naming one of these is followed
    /// at once. The core only compares them. 1–16 non-empty entries; default one, `mill`.
    pub mills: Vec<String>,
}

impl ExecutorConfig {
    /// The configured session timers: what the executor runs on until a mill's `Welcome`
    /// hands it the mill's (M1, E12).
    pub fn session_timers(&self) -> crate::wire::SessionTimers {
        crate::wire::SessionTimers {
            silence_timeout: self.silence_timeout,
            snapshot_interval: self.snapshot_interval,
            reconnect_grace: self.reconnect_grace,
        }
    }

    /// Defaults for `node_id`: one `shell` engine with one seat, no labels.
    pub fn new(node_id: NodeId, token: impl Into<String>) -> Self {
        ExecutorConfig {
            node_id,
            token: token.into(),
            labels: BTreeSet::new(),
            engines: BTreeMap::from([("shell".to_string(), EngineConfig::seats(1))]),
            snapshot_interval: DEFAULT_SNAPSHOT_INTERVAL,
            silence_timeout: DEFAULT_SILENCE_TIMEOUT,
            reconnect_grace: DEFAULT_RECONNECT_GRACE,
            backoff_min: DEFAULT_BACKOFF_MIN,
            backoff_max: DEFAULT_BACKOFF_MAX,
            backoff_seed: 0,
            stop_grace: DEFAULT_STOP_GRACE,
            outbox_capacity: DEFAULT_OUTBOX_CAPACITY,
            live_log_chunk: DEFAULT_LIVE_LOG_CHUNK,
            live_log_budget: DEFAULT_LIVE_LOG_BUDGET,
            mills: vec!["mill".to_string()],
        }
    }

    /// Seats over all engines.
    pub fn total_capacity(&self) -> u64 {
        self.engines.values().map(|e| u64::from(e.capacity)).sum()
    }

    /// Checks every setting; the error names the setting and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.token.is_empty() || self.token.len() > MAX_TOKEN {
            return Err(ConfigError::Token {
                len: self.token.len(),
                max: MAX_TOKEN,
            });
        }
        if self.labels.len() > MAX_NODE_LABELS {
            return Err(ConfigError::TooManyLabels {
                count: self.labels.len(),
                max: MAX_NODE_LABELS,
            });
        }
        if let Some(label) = self.labels.iter().find(|l| !valid_name(l)) {
            return Err(ConfigError::Label { label: cut(label) });
        }
        self.validate_engines()?;
        self.validate_timers()?;
        let min_outbox =
            usize::try_from(self.total_capacity().saturating_mul(2)).unwrap_or(usize::MAX);
        if self.outbox_capacity < min_outbox {
            return Err(ConfigError::OutboxCapacity {
                capacity: self.outbox_capacity,
                min: min_outbox,
            });
        }
        if self.mills.is_empty()
            || self.mills.len() > MAX_MILLS
            || self
                .mills
                .iter()
                .any(|m| m.is_empty() || m.len() > MAX_REASON)
        {
            return Err(ConfigError::Mills {
                count: self.mills.len(),
                max: MAX_MILLS,
            });
        }
        if self.live_log_chunk == 0 || self.live_log_chunk > MAX_LIVE_LOG_CHUNK {
            return Err(ConfigError::LiveLogChunk {
                chunk: self.live_log_chunk,
                max: MAX_LIVE_LOG_CHUNK,
            });
        }
        Ok(())
    }

    fn validate_engines(&self) -> Result<(), ConfigError> {
        if self.engines.is_empty() || self.engines.len() > MAX_ENGINES {
            return Err(ConfigError::EngineCount {
                count: self.engines.len(),
                max: MAX_ENGINES,
            });
        }
        let max_capacity = u32::try_from(MAX_ACTIVE_LEASES).unwrap_or(u32::MAX);
        for (name, engine) in &self.engines {
            if !valid_name(name) {
                return Err(ConfigError::EngineName { name: cut(name) });
            }
            if engine.capacity == 0 || engine.capacity > max_capacity {
                return Err(ConfigError::EngineCapacity {
                    engine: name.clone(),
                    capacity: engine.capacity,
                    max: max_capacity,
                });
            }
            // One load entry is the seats themselves.
            let max_resources = MAX_LOAD_ENTRIES - 1;
            if engine.resources.len() > max_resources {
                return Err(ConfigError::EngineResources {
                    engine: name.clone(),
                    source: ResourceError::TooMany {
                        count: engine.resources.len(),
                        max: max_resources,
                    },
                });
            }
            validate_resources(&engine.resources).map_err(|source| {
                ConfigError::EngineResources {
                    engine: name.clone(),
                    source,
                }
            })?;
            if let Some(reserved) = [SEAT_RESOURCE, SEAT_LOAD]
                .into_iter()
                .find(|r| engine.resources.contains_key(*r))
            {
                return Err(ConfigError::ReservedResource {
                    engine: name.clone(),
                    name: reserved,
                });
            }
        }
        let total = self.total_capacity();
        if total > MAX_ACTIVE_LEASES as u64 {
            return Err(ConfigError::TotalCapacity {
                total,
                max: MAX_ACTIVE_LEASES,
            });
        }
        Ok(())
    }

    fn validate_timers(&self) -> Result<(), ConfigError> {
        for (setting, value) in [
            ("snapshot_interval", self.snapshot_interval),
            ("silence_timeout", self.silence_timeout),
            ("reconnect_grace", self.reconnect_grace),
            ("backoff_min", self.backoff_min),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Zero { setting, value });
            }
        }
        let limit = self.silence_timeout / 2;
        if self.snapshot_interval >= limit {
            return Err(ConfigError::SnapshotInterval {
                interval: self.snapshot_interval,
                limit,
            });
        }
        if self.reconnect_grace <= self.silence_timeout {
            return Err(ConfigError::ReconnectGrace {
                grace: self.reconnect_grace,
                silence_timeout: self.silence_timeout,
            });
        }
        if self.backoff_min > self.backoff_max {
            return Err(ConfigError::BackoffMin {
                min: self.backoff_min,
                max: self.backoff_max,
            });
        }
        if self.backoff_max >= self.reconnect_grace {
            return Err(ConfigError::BackoffMax {
                max: self.backoff_max,
                grace: self.reconnect_grace,
            });
        }
        Ok(())
    }
}

fn cut(s: &str) -> String {
    s.chars().take(crate::types::MAX_NAME_LEN).collect()
}

/// Why an [`ExecutorConfig`] was refused; each variant names the setting and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `mills` is empty, too long, or holds an empty address.
    #[error("mills: {count} addresses; give 1-{max}, none empty")]
    Mills {
        /// Addresses given.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// `token` is empty or too long.
    #[error("token: {len} bytes; must be 1-{max}")]
    Token {
        /// Bytes given.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// `labels` has too many entries.
    #[error("labels: {count} labels; at most {max}")]
    TooManyLabels {
        /// Labels given.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// A label is empty, too long or not printable ASCII.
    #[error("labels: {label:?} must be 1-64 printable ASCII characters")]
    Label {
        /// The label (cut).
        label: String,
    },
    /// No engines, or too many.
    #[error("engines: {count} engines; must be 1-{max}")]
    EngineCount {
        /// Engines given.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// An engine name is empty, too long or not printable ASCII.
    #[error("engines: name {name:?} must be 1-64 printable ASCII characters")]
    EngineName {
        /// The name (cut).
        name: String,
    },
    /// An engine's capacity is zero or too large.
    #[error("engines.{engine}.capacity: {capacity}; must be 1-{max}")]
    EngineCapacity {
        /// The engine.
        engine: String,
        /// Capacity given.
        capacity: u32,
        /// The bound.
        max: u32,
    },
    /// An engine's resources are invalid.
    #[error("engines.{engine}.resources: {source}")]
    EngineResources {
        /// The engine.
        engine: String,
        /// What was wrong.
        source: ResourceError,
    },
    /// An engine declares `jobs` or `seats`, which the executor manages itself.
    #[error("engines.{engine}.resources: {name:?} is reserved (each seat charges jobs: 1; seats is the seat load)")]
    ReservedResource {
        /// The engine.
        engine: String,
        /// The reserved name.
        name: &'static str,
    },
    /// More seats in all than one snapshot can report.
    #[error("engines: {total} seats in all; at most {max}")]
    TotalCapacity {
        /// Seats over all engines.
        total: u64,
        /// The bound.
        max: usize,
    },
    /// A duration that must be positive is zero.
    #[error("{setting}: {value:?}; must be greater than zero")]
    Zero {
        /// The setting.
        setting: &'static str,
        /// The value given.
        value: Duration,
    },
    /// `snapshot_interval` is not below `silence_timeout / 2` (M9).
    #[error("snapshot_interval: {interval:?}; must be less than silence_timeout / 2 = {limit:?}")]
    SnapshotInterval {
        /// The interval given.
        interval: Duration,
        /// `silence_timeout / 2`.
        limit: Duration,
    },
    /// `reconnect_grace` is not above `silence_timeout`.
    #[error(
        "reconnect_grace: {grace:?}; must be greater than silence_timeout {silence_timeout:?}"
    )]
    ReconnectGrace {
        /// The grace given.
        grace: Duration,
        /// The silence timeout.
        silence_timeout: Duration,
    },
    /// `backoff_min` is above `backoff_max`.
    #[error("backoff_min: {min:?}; must be at most backoff_max {max:?}")]
    BackoffMin {
        /// `backoff_min`.
        min: Duration,
        /// `backoff_max`.
        max: Duration,
    },
    /// `backoff_max` is not below `reconnect_grace`, so a reconnect might not fit in grace.
    #[error("backoff_max: {max:?}; must be less than reconnect_grace {grace:?}")]
    BackoffMax {
        /// `backoff_max`.
        max: Duration,
        /// `reconnect_grace`.
        grace: Duration,
    },
    /// `outbox_capacity` cannot hold the Running and Terminal events of every seat.
    #[error("outbox_capacity: {capacity}; must be at least {min} (two events per seat)")]
    OutboxCapacity {
        /// Capacity given.
        capacity: usize,
        /// 2 × total seats.
        min: usize,
    },
    /// `live_log_chunk` is zero or too large for a frame.
    #[error("live_log_chunk: {chunk} bytes; must be 1-{max}")]
    LiveLogChunk {
        /// Bytes given.
        chunk: usize,
        /// The bound.
        max: usize,
    },
}

impl ConfigError {
    /// The setting that was wrong (`engines` for any per-engine setting).
    pub fn setting(&self) -> &'static str {
        match self {
            ConfigError::Mills { .. } => "mills",
            ConfigError::Token { .. } => "token",
            ConfigError::TooManyLabels { .. } | ConfigError::Label { .. } => "labels",
            ConfigError::EngineCount { .. }
            | ConfigError::EngineName { .. }
            | ConfigError::EngineCapacity { .. }
            | ConfigError::EngineResources { .. }
            | ConfigError::ReservedResource { .. }
            | ConfigError::TotalCapacity { .. } => "engines",
            ConfigError::Zero { setting, .. } => setting,
            ConfigError::SnapshotInterval { .. } => "snapshot_interval",
            ConfigError::ReconnectGrace { .. } => "reconnect_grace",
            ConfigError::BackoffMin { .. } => "backoff_min",
            ConfigError::BackoffMax { .. } => "backoff_max",
            ConfigError::OutboxCapacity { .. } => "outbox_capacity",
            ConfigError::LiveLogChunk { .. } => "live_log_chunk",
        }
    }
}
