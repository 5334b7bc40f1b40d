//! What a client asks the mill to run, and how a job ends.

use std::collections::BTreeSet;
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

/// Who a job is charged to (quota scopes, §6).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Identity {
    /// The owner scope, e.g. an organisation.
    pub owner: String,
    /// The repository scope.
    pub repo: String,
}

/// A job as submitted: what to run, where it may run and who pays for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
}

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
        }
    }
}

fn cut(s: &str) -> String {
    s.chars().take(crate::types::MAX_NAME_LEN).collect()
}

impl JobSpec {
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
        Ok(())
    }
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
            engine: "shell".into(),
            labels: BTreeSet::new(),
            resources: Resources::new(),
            identity: Identity {
                owner: "acme".into(),
                repo: "acme/app".into(),
            },
            timeout: None,
            payload: b"true".to_vec(),
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
