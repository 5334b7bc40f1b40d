//! What a client asks the mill to run, and how a job ends.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::types::{valid_name, validate_resources, LeaseId, NodeId, ResourceError, Resources};

/// Most labels a job may require.
pub const MAX_LABELS: usize = 32;
/// Largest opaque engine payload (the command, for the shell engine).
pub const MAX_PAYLOAD: usize = 256 * 1024;
/// Longest owner or repo name.
pub const MAX_SCOPE_NAME: usize = 256;
/// Most environment variables a job may set (issue 13 item 6).
pub const MAX_ENV_VARS: usize = 64;
/// Most bytes of environment (names plus values) a job may set.
pub const MAX_ENV_BYTES: usize = 32 * 1024;
/// Prefix of the names millrace sets itself (`MILLRACE_JOB_ID`, …); a job may not set them.
pub const RESERVED_ENV_PREFIX: &str = "MILLRACE_";
/// Longest idempotency key (M31).
pub const MAX_KEY_LEN: usize = 256;
/// Most retries a job's policy may ask for (M32).
pub const MAX_RETRIES: u32 = 20;

/// What may end an attempt and start the next one (M32). Only ends where the job did not
/// run to its own result, plus `Failed` for a user who wants a failing job run again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryOn {
    /// The executor was lost (M5 grace expiry, a replaced store, quarantine) or fenced
    /// itself off (E12).
    ExecutorLost,
    /// The executor restarted and the job's process died with it (E9).
    ExecutorRestarted,
    /// The executor no longer had the job (M8).
    NoLongerHasJob,
    /// The engine ran the job and it failed by itself (a non-zero exit).
    Failed,
}

impl RetryOn {
    /// Every value, in order.
    pub const ALL: [RetryOn; 4] = [
        RetryOn::ExecutorLost,
        RetryOn::ExecutorRestarted,
        RetryOn::NoLongerHasJob,
        RetryOn::Failed,
    ];

    /// The stable name (JSON, the CLI).
    pub fn name(self) -> &'static str {
        match self {
            RetryOn::ExecutorLost => "executor_lost",
            RetryOn::ExecutorRestarted => "executor_restarted",
            RetryOn::NoLongerHasJob => "no_longer_has_job",
            RetryOn::Failed => "failed",
        }
    }

    /// Parses [`RetryOn::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }

    /// Which retry cause, if any, an attempt's end is.
    pub fn of(status: TerminalStatus, cause: Option<TerminalCause>) -> Option<Self> {
        match cause? {
            TerminalCause::ExecutorLost
            | TerminalCause::ExecutorReplaced
            | TerminalCause::LostContact
            | TerminalCause::Quarantined => Some(RetryOn::ExecutorLost),
            TerminalCause::ExecutorRestarted => Some(RetryOn::ExecutorRestarted),
            TerminalCause::NoLongerHasJob => Some(RetryOn::NoLongerHasJob),
            TerminalCause::Reported if status == TerminalStatus::Failed => Some(RetryOn::Failed),
            _ => None,
        }
    }
}

/// A job's retry policy (M32): how many more attempts it may get, and which ends start one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Attempts after the first (0..=[`MAX_RETRIES`]); 0 means the job runs at most once.
    pub retries: u32,
    /// Which ends retry; by default the executor's failures, never the job's own.
    pub on: BTreeSet<RetryOn>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            retries: 0,
            on: [
                RetryOn::ExecutorLost,
                RetryOn::ExecutorRestarted,
                RetryOn::NoLongerHasJob,
            ]
            .into(),
        }
    }
}

impl RetryPolicy {
    /// The policy retries an attempt that ended so.
    pub fn retries_on(&self, status: TerminalStatus, cause: Option<TerminalCause>) -> bool {
        RetryOn::of(status, cause).is_some_and(|r| self.on.contains(&r))
    }
}

/// Who a job is charged to (quota scopes, §6).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Identity {
    /// The owner scope, e.g. an organisation.
    pub owner: String,
    /// The repository scope.
    pub repo: String,
}

/// A job as submitted: what to run, where it may run and who pays for it.
///
/// `Debug` shows the names of `env` but never its values (they may be credentials).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Engine that must run it (e.g. `shell`).
    pub engine: String,
    /// Labels an executor must hold, all of them.
    pub labels: BTreeSet<String>,
    /// Resources the job asks for; the executor names what it charges when it accepts.
    pub resources: Resources,
    /// Quota identity.
    pub identity: Identity,
    /// Timeout; `None` means the mill's `job_timeout` (M18).
    pub timeout: Option<Duration>,
    /// Opaque to the mill: the engine's input, such as a shell command.
    pub payload: Vec<u8>,
    /// Environment for the job's process, on top of what the executor sets (issue 13 item
    /// 6): at most [`MAX_ENV_VARS`] names of `[A-Za-z_][A-Za-z0-9_]*` not starting with
    /// [`RESERVED_ENV_PREFIX`], at most [`MAX_ENV_BYTES`] in all.
    pub env: BTreeMap<String, String>,
    /// Retries (M32).
    pub retry: RetryPolicy,
    /// Among one owner's waiting jobs, higher goes first (M33); 0 by default.
    pub priority: i32,
    /// The one node it may run on (M34), if pinned.
    pub node: Option<NodeId>,
}

impl fmt::Debug for JobSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobSpec")
            .field("engine", &self.engine)
            .field("labels", &self.labels)
            .field("resources", &self.resources)
            .field("identity", &self.identity)
            .field("timeout", &self.timeout)
            .field("payload", &String::from_utf8_lossy(&self.payload))
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("retry", &self.retry)
            .field("priority", &self.priority)
            .field("node", &self.node)
            .finish()
    }
}

/// A client's key for a submit (M31): 1–256 printable ASCII characters, no spaces. Valid
/// by construction.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IdempotencyKey(String);

/// Why an idempotency key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Empty or longer than [`MAX_KEY_LEN`].
    #[error("Idempotency-Key: must be 1-{MAX_KEY_LEN} characters, got {len}")]
    Length {
        /// Bytes given.
        len: usize,
    },
    /// A byte outside printable ASCII (`!`..=`~`).
    #[error("Idempotency-Key: byte {at} is not printable ASCII (0x21-0x7e)")]
    Char {
        /// Where.
        at: usize,
    },
}

impl IdempotencyKey {
    /// The header that carries it, and the field name errors give.
    pub const FIELD: &'static str = "Idempotency-Key";

    /// Validates `key`.
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(KeyError::Length { len: key.len() });
        }
        if let Some(at) = key.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(KeyError::Char { at });
        }
        Ok(IdempotencyKey(key))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stable hash of a job spec (M31): SHA-256 of a version tag and the spec's canonical
/// encoding (postcard, with every map and set ordered), so equal specs have equal
/// fingerprints in every process and across restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The tag hashed before the spec: a new spec layout gets a new tag.
const FINGERPRINT_TAG: &[u8] = b"millrace-spec-v3\0";

/// Why a job spec was refused; each variant names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// `engine` is empty, too long or not printable ASCII.
    #[error("engine: {engine:?} must be 1-64 printable ASCII characters")]
    Engine {
        /// As given (cut).
        engine: String,
    },
    /// `labels` has too many entries.
    #[error("labels: {count} labels, at most {max}")]
    TooManyLabels {
        /// Labels given.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// A label is empty, too long or not printable ASCII.
    #[error("labels: {label:?} must be 1-64 printable ASCII characters")]
    Label {
        /// As given (cut).
        label: String,
    },
    /// `resources` is invalid.
    #[error("resources: {0}")]
    Resources(#[from] ResourceError),
    /// `timeout` is zero.
    #[error("timeout: must be greater than zero")]
    Timeout,
    /// `payload` is too large.
    #[error("payload: {len} bytes, at most {max}")]
    Payload {
        /// Bytes given.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// `identity.owner` or `identity.repo` is empty or too long.
    #[error("identity.{field}: must be 1-256 characters")]
    Identity {
        /// `owner` or `repo`.
        field: &'static str,
    },
    /// `env` has too many entries.
    #[error("env: {count} variables, at most {max}")]
    TooManyEnv {
        /// Variables given.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// An `env` name is not `[A-Za-z_][A-Za-z0-9_]*` (at most 256 bytes).
    #[error("env: name {name:?} must match [A-Za-z_][A-Za-z0-9_]*")]
    EnvName {
        /// As given (cut).
        name: String,
    },
    /// An `env` name starts with `MILLRACE_`, which millrace sets itself.
    #[error("env: name {name:?} is reserved (names starting with MILLRACE_ are set by millrace)")]
    EnvReserved {
        /// As given (cut).
        name: String,
    },
    /// An `env` value holds a NUL byte, which no process environment can carry.
    #[error("env: the value of {name} holds a NUL byte")]
    EnvValue {
        /// The variable's name (never its value).
        name: String,
    },
    /// `retry.retries` is above [`MAX_RETRIES`].
    #[error("retry.retries: {retries}, at most {max}")]
    Retries {
        /// Given.
        retries: u32,
        /// The bound.
        max: u32,
    },
    /// `retry.on` is empty while `retry.retries` is not: nothing would ever retry.
    #[error("retry.on: empty, so retry.retries {retries} could never be used")]
    RetryOnEmpty {
        /// Given.
        retries: u32,
    },
    /// `env` is too large in all.
    #[error("env: {bytes} bytes of names and values, at most {max}")]
    EnvSize {
        /// Bytes given.
        bytes: usize,
        /// The bound.
        max: usize,
    },
}

impl SpecError {
    /// The name of the field that was wrong, for APIs that report it separately.
    pub fn field(&self) -> &'static str {
        match self {
            SpecError::Engine { .. } => "engine",
            SpecError::TooManyLabels { .. } | SpecError::Label { .. } => "labels",
            SpecError::Resources(_) => "resources",
            SpecError::Timeout => "timeout",
            SpecError::Payload { .. } => "payload",
            SpecError::Identity { field } => field,
            SpecError::TooManyEnv { .. }
            | SpecError::EnvName { .. }
            | SpecError::EnvReserved { .. }
            | SpecError::EnvValue { .. }
            | SpecError::EnvSize { .. } => "env",
            SpecError::Retries { .. } => "retry.retries",
            SpecError::RetryOnEmpty { .. } => "retry.on",
        }
    }
}

fn cut(s: &str) -> String {
    s.chars().take(crate::types::MAX_NAME_LEN).collect()
}

impl JobSpec {
    /// The charge an honest executor names for this job's seat (E2): its resources plus
    /// `jobs: 1`. Direct placement (M35) takes quota for it before any executor answers.
    pub fn seat_charge(&self) -> Resources {
        let mut charge = self.resources.clone();
        charge.insert(crate::types::SEAT_RESOURCE.to_string(), 1);
        charge
    }

    /// Checks every bound of the spec (issue 2: engine 1–64 chars, ≤ 32 labels of ≤ 64 chars,
    /// resources name → 1..=2^53, timeout > 0, payload ≤ 256 KiB).
    pub fn validate(&self) -> Result<(), SpecError> {
        if !valid_name(&self.engine) {
            return Err(SpecError::Engine {
                engine: cut(&self.engine),
            });
        }
        if self.labels.len() > MAX_LABELS {
            return Err(SpecError::TooManyLabels {
                count: self.labels.len(),
                max: MAX_LABELS,
            });
        }
        if let Some(label) = self.labels.iter().find(|l| !valid_name(l)) {
            return Err(SpecError::Label { label: cut(label) });
        }
        validate_resources(&self.resources)?;
        if self.timeout == Some(Duration::ZERO) {
            return Err(SpecError::Timeout);
        }
        if self.payload.len() > MAX_PAYLOAD {
            return Err(SpecError::Payload {
                len: self.payload.len(),
                max: MAX_PAYLOAD,
            });
        }
        for (field, value) in [
            ("owner", &self.identity.owner),
            ("repo", &self.identity.repo),
        ] {
            if value.is_empty() || value.len() > MAX_SCOPE_NAME {
                return Err(SpecError::Identity { field });
            }
        }
        let retries = self.retry.retries;
        if retries > MAX_RETRIES {
            return Err(SpecError::Retries {
                retries,
                max: MAX_RETRIES,
            });
        }
        if retries > 0 && self.retry.on.is_empty() {
            return Err(SpecError::RetryOnEmpty { retries });
        }
        self.validate_env()
    }

    /// Issue 13 item 6: ≤ 64 variables, names `[A-Za-z_][A-Za-z0-9_]*` outside `MILLRACE_`,
    /// no NUL in values, ≤ 32 KiB of names and values.
    fn validate_env(&self) -> Result<(), SpecError> {
        if self.env.len() > MAX_ENV_VARS {
            return Err(SpecError::TooManyEnv {
                count: self.env.len(),
                max: MAX_ENV_VARS,
            });
        }
        let mut bytes = 0usize;
        for (name, value) in &self.env {
            if !valid_env_name(name) {
                return Err(SpecError::EnvName { name: cut(name) });
            }
            if name.starts_with(RESERVED_ENV_PREFIX) {
                return Err(SpecError::EnvReserved { name: cut(name) });
            }
            if value.contains('\0') {
                return Err(SpecError::EnvValue { name: name.clone() });
            }
            bytes = bytes.saturating_add(name.len()).saturating_add(value.len());
        }
        if bytes > MAX_ENV_BYTES {
            return Err(SpecError::EnvSize {
                bytes,
                max: MAX_ENV_BYTES,
            });
        }
        Ok(())
    }

    /// The spec's [`Fingerprint`] (M31).
    pub fn fingerprint(&self) -> Fingerprint {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(FINGERPRINT_TAG);
        // Encoding into a Vec only fails for types serde cannot represent; a spec is plain
        // data, so the empty fallback is unreachable (and would still be deterministic).
        h.update(postcard::to_allocvec(self).unwrap_or_default());
        Fingerprint(h.finalize().into())
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`, at most 256 bytes.
fn valid_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= 256
        && bytes
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TerminalStatus {
    /// The engine ran it to a zero exit.
    Success,
    /// It failed: non-zero exit, engine error, executor lost, quota denied, no executor.
    Failed,
    /// Its timeout expired (M18).
    Timeout,
    /// A user (or the mill) cancelled it.
    Cancelled,
}

impl fmt::Display for TerminalStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TerminalStatus::Success => "success",
            TerminalStatus::Failed => "failed",
            TerminalStatus::Timeout => "timeout",
            TerminalStatus::Cancelled => "cancelled",
        })
    }
}

/// Why a job ended, as data: what downstream code (metrics, the simulator's checkers, the
/// HTTP API) matches on. The human text is [`Terminal::error`], beside it (quinn's
/// `TransportError{code, reason}`); nothing matches on that text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalCause {
    /// The executor reported the end: the engine's result (or a stop the executor was asked
    /// for that the mill no longer tracks).
    Reported,
    /// The executor restarted and the job's process died with it (E9).
    ExecutorRestarted,
    /// The executor heard nothing from the mill for its grace and stopped the job (E12).
    LostContact,
    /// Grace expired without recovery (M5).
    ExecutorLost,
    /// The node came back with a new store; a running lease of its old epoch failed (M5).
    ExecutorReplaced,
    /// A reconciling snapshot left out a running lease (M8).
    NoLongerHasJob,
    /// Its executor was quarantined (M28).
    Quarantined,
    /// A client cancelled it (M26).
    Cancelled,
    /// Its timeout expired (M18).
    Timeout,
    /// A cancel was acked but no terminal came within the teardown timeout (M26).
    TeardownExceeded,
    /// Every candidate said it can never run the job (M13).
    NoCompatibleExecutor,
    /// Quota refused it for good (M15, Q1).
    QuotaDenied,
    /// No lease took it within `queue_timeout` of its submission.
    QueueTimeout,
}

impl TerminalCause {
    /// A stable snake_case name (metrics labels, JSON).
    pub fn name(self) -> &'static str {
        match self {
            TerminalCause::Reported => "reported",
            TerminalCause::ExecutorRestarted => "executor_restarted",
            TerminalCause::LostContact => "lost_contact",
            TerminalCause::ExecutorLost => "executor_lost",
            TerminalCause::ExecutorReplaced => "executor_replaced",
            TerminalCause::NoLongerHasJob => "no_longer_has_job",
            TerminalCause::Quarantined => "quarantined",
            TerminalCause::Cancelled => "cancelled",
            TerminalCause::Timeout => "timeout",
            TerminalCause::TeardownExceeded => "teardown_exceeded",
            TerminalCause::NoCompatibleExecutor => "no_compatible_executor",
            TerminalCause::QuotaDenied => "quota_denied",
            TerminalCause::QueueTimeout => "queue_timeout",
        }
    }

    /// True when the mill gave up on the executor that held the job (M5, M8, M28): the job
    /// may still have been running there.
    pub fn executor_given_up(self) -> bool {
        match self {
            TerminalCause::ExecutorLost
            | TerminalCause::ExecutorReplaced
            | TerminalCause::NoLongerHasJob
            | TerminalCause::Quarantined => true,
            TerminalCause::Reported
            | TerminalCause::ExecutorRestarted
            | TerminalCause::LostContact
            | TerminalCause::Cancelled
            | TerminalCause::Timeout
            | TerminalCause::TeardownExceeded
            | TerminalCause::NoCompatibleExecutor
            | TerminalCause::QuotaDenied
            | TerminalCause::QueueTimeout => false,
        }
    }
}

impl fmt::Display for TerminalCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where an executor stored a job's log, and its hash (M25).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRef {
    /// Must be exactly `logs/<lease id>.log`.
    pub path: String,
    /// Must be `sha256:` followed by 64 lowercase hex digits.
    pub hash: String,
}

impl LogRef {
    /// The only path a log for `lease` may have (M25).
    pub fn path_for(lease: LeaseId) -> String {
        format!("logs/{}.log", lease.get())
    }

    /// Checks M25 for a log reported under `lease`.
    pub fn is_valid_for(&self, lease: LeaseId) -> bool {
        let hex_ok = self.hash.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        hex_ok && self.path == Self::path_for(lease)
    }
}

/// The end of a job, as recorded once and never changed (I2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Terminal {
    /// How it ended.
    pub status: TerminalStatus,
    /// Why, as data; `None` only in records written before causes were kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<TerminalCause>,
    /// The process exit code, when an engine ran it.
    pub exit_code: Option<i32>,
    /// Why, for anything but success: human text beside `cause`, never matched on.
    pub error: Option<String>,
    /// The log, when an engine produced one.
    pub log: Option<LogRef>,
    /// The executor that ran it, if any did.
    pub node: Option<NodeId>,
    /// The lease it ran under, if any.
    pub lease: Option<LeaseId>,
}

impl Terminal {
    /// A terminal decided by the mill itself, not reported by an engine.
    pub fn by_mill(status: TerminalStatus, cause: TerminalCause, error: impl Into<String>) -> Self {
        Terminal {
            status,
            cause: Some(cause),
            exit_code: None,
            error: Some(error.into()),
            log: None,
            node: None,
            lease: None,
        }
    }
}

/// Where a job stands, as reported to clients and recorded in its status history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    /// Waiting for placement (or for quota).
    Queued,
    /// A seat is held and the lease is being committed.
    Reserved {
        /// The lease.
        lease: LeaseId,
        /// The executor.
        node: NodeId,
    },
    /// Committed: the executor runs it.
    Running {
        /// The lease.
        lease: LeaseId,
        /// The executor.
        node: NodeId,
    },
    /// Ended; never changes again.
    Done(Terminal),
}

impl JobState {
    /// A short name: `queued`, `reserved`, `running`, or the terminal status.
    pub fn name(&self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Reserved { .. } => "reserved",
            JobState::Running { .. } => "running",
            JobState::Done(t) => match t.status {
                TerminalStatus::Success => "success",
                TerminalStatus::Failed => "failed",
                TerminalStatus::Timeout => "timeout",
                TerminalStatus::Cancelled => "cancelled",
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn spec() -> JobSpec {
        JobSpec {
            retry: Default::default(),
            priority: 0,
            node: None,
            engine: "shell".into(),
            labels: BTreeSet::new(),
            resources: Resources::new(),
            identity: Identity {
                owner: "acme".into(),
                repo: "acme/app".into(),
            },
            timeout: None,
            payload: b"true".to_vec(),
            env: BTreeMap::new(),
        }
    }

    #[test]
    fn spec_validation_names_each_field() {
        assert!(spec().validate().is_ok());
        let mut s = spec();
        s.engine = String::new();
        assert_eq!(s.validate().map_err(|e| e.field()), Err("engine"));
        let mut s = spec();
        s.labels = (0..33).map(|i| format!("l{i}")).collect();
        assert_eq!(s.validate().map_err(|e| e.field()), Err("labels"));
        let mut s = spec();
        s.labels.insert("x".repeat(65));
        assert_eq!(s.validate().map_err(|e| e.field()), Err("labels"));
        let mut s = spec();
        s.resources.insert("cpu".into(), 0);
        assert_eq!(s.validate().map_err(|e| e.field()), Err("resources"));
        let mut s = spec();
        s.timeout = Some(Duration::ZERO);
        assert_eq!(s.validate().map_err(|e| e.field()), Err("timeout"));
        let mut s = spec();
        s.payload = vec![0; MAX_PAYLOAD + 1];
        assert_eq!(s.validate().map_err(|e| e.field()), Err("payload"));
        let mut s = spec();
        s.identity.repo.clear();
        assert_eq!(s.validate().map_err(|e| e.field()), Err("repo"));
    }

    /// Issue 13 item 6: every env bound is a typed error naming `env`; a maximal env passes.
    #[test]
    fn env_validation_names_the_field_and_admits_the_maximum() {
        let with = |pairs: Vec<(String, String)>| {
            let mut s = spec();
            s.env = pairs.into_iter().collect();
            s.validate().map_err(|e| (e.field(), e))
        };
        assert!(with(vec![
            ("A_1".into(), "x".into()),
            ("_b".into(), String::new())
        ])
        .is_ok());
        for bad in ["1A", "A-B", "", "A B", "É"] {
            let e = with(vec![(bad.into(), "v".into())]).unwrap_err();
            assert_eq!(e.0, "env", "{bad:?}");
            assert!(
                matches!(e.1, SpecError::EnvName { .. }),
                "{bad:?}: {:?}",
                e.1
            );
        }
        let e = with(vec![("MILLRACE_JOB_ID".into(), "7".into())]).unwrap_err();
        assert!(matches!(e.1, SpecError::EnvReserved { .. }));
        let e = with(vec![("A".into(), "x\0y".into())]).unwrap_err();
        assert!(
            !e.1.to_string().contains("x\0y"),
            "never the value: {}",
            e.1
        );
        let many = (0..=MAX_ENV_VARS)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert!(matches!(
            with(many).unwrap_err().1,
            SpecError::TooManyEnv { .. }
        ));
        // 64 names of 4 bytes, values filling 32 KiB exactly: the maximum.
        let value = "v".repeat(MAX_ENV_BYTES / MAX_ENV_VARS - 4);
        let max: Vec<_> = (0..MAX_ENV_VARS)
            .map(|i| (format!("V{i:03}"), value.clone()))
            .collect();
        assert!(with(max.clone()).is_ok());
        let mut over = max;
        over[0].1.push('v');
        assert!(matches!(
            with(over).unwrap_err().1,
            SpecError::EnvSize { .. }
        ));
    }

    /// M31: the fingerprint is stable for equal specs and changes with any field.
    #[test]
    fn m31_fingerprint_follows_the_spec() {
        assert_eq!(spec().fingerprint(), spec().fingerprint());
        let mut s = spec();
        s.env.insert("A".into(), "1".into());
        assert_ne!(s.fingerprint(), spec().fingerprint());
        let mut t = spec();
        t.env.insert("A".into(), "2".into());
        assert_ne!(s.fingerprint(), t.fingerprint());
        let mut u = spec();
        u.identity.owner = "other".into();
        assert_ne!(u.fingerprint(), spec().fingerprint());
        assert_eq!(spec().fingerprint().to_string().len(), 64);
    }

    /// M31: keys are 1-256 printable ASCII characters; errors name the header.
    #[test]
    fn m31_keys_are_bounded_printable_ascii() {
        assert!(IdempotencyKey::new("build-42/retry:1").is_ok());
        assert!(IdempotencyKey::new("k".repeat(MAX_KEY_LEN)).is_ok());
        for bad in [
            String::new(),
            "k".repeat(MAX_KEY_LEN + 1),
            "a b".into(),
            "é".into(),
        ] {
            let e = IdempotencyKey::new(bad.clone()).unwrap_err();
            assert!(e.to_string().starts_with("Idempotency-Key"), "{bad:?}: {e}");
        }
    }

    /// Issue 13 item 6: `Debug` (what logs would print) never shows an env value.
    #[test]
    fn spec_debug_hides_env_values() {
        let mut s = spec();
        s.env.insert("TOKEN".into(), "hunter2".into());
        let text = format!("{s:?}");
        assert!(
            text.contains("TOKEN") && !text.contains("hunter2"),
            "{text}"
        );
    }

    #[test]
    fn m25_log_ref_must_name_the_lease_and_a_sha256() {
        let lease = LeaseId(42);
        let good = LogRef {
            path: "logs/42.log".into(),
            hash: format!("sha256:{}", "ab".repeat(32)),
        };
        assert!(good.is_valid_for(lease));
        assert!(!good.is_valid_for(LeaseId(43)));
        let mut bad = good.clone();
        bad.path = "logs/../42.log".into();
        assert!(!bad.is_valid_for(lease));
        let mut bad = good.clone();
        bad.hash = format!("md5:{}", "ab".repeat(32));
        assert!(!bad.is_valid_for(lease));
        let mut bad = good;
        bad.hash = format!("sha256:{}", "AB".repeat(32));
        assert!(!bad.is_valid_for(lease));
    }
}
