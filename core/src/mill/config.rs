//! The mill's settings, with the defaults a production operator would want.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::quota::QuotaConfig;

/// Every number an operator may tune. Defaults follow DESIGN §4 and the reference mill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MillConfig {
    /// How long a node's leases survive its disconnection before they fail "executor lost"
    /// (M4, M5). Also the ttl of a seat reservation (M12). Default 45 s.
    pub reconnect_grace: Duration,
    /// No message for this long closes a session (M9). Default 15 s.
    pub silence_timeout: Duration,
    /// How often executors must snapshot; must be below `silence_timeout / 2` (M9). Default 5 s.
    pub snapshot_interval: Duration,
    /// How long one ask of a bid, and one commit attempt, may take (M12, M17). Default 5 s.
    pub bid_timeout: Duration,
    /// How many executors are asked in parallel per placement (M12). Default 3.
    pub top_k: usize,
    /// How many more candidates beyond `top_k` a bid may fall back to when asks fail (M12).
    /// Default 8.
    pub bid_fallbacks: usize,
    /// M35: place a job on the best-ranked candidate with a free seat by publishing its
    /// lease at once and sending `ReserveSeat{direct}` and `CommitLease` back to back,
    /// instead of a bid. Default true.
    pub direct_placement: bool,
    /// M36: late binding. A queued job that finds no free seat is staged on a node whose
    /// seats are all taken (a direct ask the executor holds for its next free seat, E16),
    /// and withdrawn if a seat elsewhere frees first or a job that goes before it (M33)
    /// arrives. Needs `direct_placement`. Default true.
    pub late_binding: bool,
    /// Most jobs waiting for placement; beyond it `Submit` is refused (M10). Default 10,000.
    pub max_pending: usize,
    /// How long an executor has to ack a `CancelAttempt` (M8, M26). Default 10 s.
    pub cancel_ack_timeout: Duration,
    /// How long an acked cancel may take to produce a terminal (M26). Default 10 min.
    pub cancel_teardown_timeout: Duration,
    /// Default job timeout (M18). Default 24 h.
    pub job_timeout: Duration,
    /// A job no lease has taken this long after its submission ends Failed, with why no
    /// executor took it (cause `QueueTimeout`). Default 24 h.
    pub queue_timeout: Duration,
    /// Violation closures in a row that quarantine a node (M28). Default 3.
    pub quarantine_strikes: u32,
    /// Shared secret executors present in `Hello` (M1); `None` accepts any token (tests,
    /// simulation). Compared in constant time.
    pub executor_token: Option<String>,
    /// Most executor sessions at once; a `Hello` beyond it is refused. Default 10,000.
    pub max_sessions: usize,
    /// Most terminal lease ids remembered per session to detect an event after a terminal
    /// (M22). Default 4,096.
    pub terminal_memory: usize,
    /// Quota limits (§6).
    pub quota: QuotaConfig,
    /// M32: how long after an executor is known to have fenced itself off (E12) a retry of
    /// its job waits for the fenced run to be gone: covers the executor's stop grace
    /// (SIGTERM to SIGKILL; an executor with a longer `stop_grace` is refused at `Hello`)
    /// and message delay. Default 30 s.
    pub retry_fence: Duration,
    /// This mill's leadership term (E13, DESIGN §10): the driver takes it from the store
    /// before the mill starts (a SQLite store counts up at every start; a shared store by
    /// campaign) and every message to an executor carries it. At least 1. Default 1.
    pub term: crate::types::Term,
}

impl Default for MillConfig {
    fn default() -> Self {
        MillConfig {
            reconnect_grace: Duration::from_secs(45),
            silence_timeout: Duration::from_secs(15),
            snapshot_interval: Duration::from_secs(5),
            bid_timeout: Duration::from_secs(5),
            top_k: 3,
            bid_fallbacks: 8,
            direct_placement: true,
            late_binding: true,
            retry_fence: Duration::from_secs(30),
            max_pending: 10_000,
            cancel_ack_timeout: Duration::from_secs(10),
            cancel_teardown_timeout: Duration::from_secs(600),
            job_timeout: Duration::from_secs(24 * 3600),
            queue_timeout: Duration::from_secs(24 * 3600),
            quarantine_strikes: 3,
            executor_token: None,
            max_sessions: 10_000,
            terminal_memory: 4096,
            quota: QuotaConfig::default(),
            term: crate::types::Term(1),
        }
    }
}

/// A setting that cannot work, named with its value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("setting {setting} = {value}: {reason}")]
pub struct ConfigError {
    /// The setting's name, as in the config file.
    pub setting: &'static str,
    /// The value given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

fn err(setting: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> ConfigError {
    ConfigError {
        setting,
        value: format!("{value:?}"),
        reason,
    }
}

impl MillConfig {
    /// The timers every `Welcome` carries, for the executor to adopt (M1, E12).
    pub fn session_timers(&self) -> crate::wire::SessionTimers {
        crate::wire::SessionTimers {
            silence_timeout: self.silence_timeout,
            snapshot_interval: self.snapshot_interval,
            reconnect_grace: self.reconnect_grace,
        }
    }

    /// Checks every setting; the error names the first bad one with its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("reconnect_grace", self.reconnect_grace),
            ("silence_timeout", self.silence_timeout),
            ("snapshot_interval", self.snapshot_interval),
            ("bid_timeout", self.bid_timeout),
            ("cancel_ack_timeout", self.cancel_ack_timeout),
            ("cancel_teardown_timeout", self.cancel_teardown_timeout),
            ("job_timeout", self.job_timeout),
            ("queue_timeout", self.queue_timeout),
            ("retry_fence", self.retry_fence),
        ];
        for (setting, value) in positive {
            if value.is_zero() {
                return Err(err(setting, value, "must be greater than zero"));
            }
        }
        if self.term.get() == 0 {
            return Err(err(
                "term",
                self.term.get(),
                "must be at least 1 (0 means no term, E13)",
            ));
        }
        if self.snapshot_interval * 2 >= self.silence_timeout {
            return Err(err(
                "snapshot_interval",
                self.snapshot_interval,
                "must be below silence_timeout / 2 (M9)",
            ));
        }
        if self.reconnect_grace <= self.silence_timeout {
            return Err(err(
                "reconnect_grace",
                self.reconnect_grace,
                "must be above silence_timeout (M5, E12)",
            ));
        }
        if !(1..=64).contains(&self.top_k) {
            return Err(err("top_k", self.top_k, "must be 1..=64"));
        }
        if self.bid_fallbacks > 1024 {
            return Err(err(
                "bid_fallbacks",
                self.bid_fallbacks,
                "must be at most 1024",
            ));
        }
        if self.max_pending == 0 {
            return Err(err("max_pending", self.max_pending, "must be at least 1"));
        }
        if self.quarantine_strikes == 0 {
            return Err(err(
                "quarantine_strikes",
                self.quarantine_strikes,
                "must be at least 1",
            ));
        }
        if self.max_sessions == 0 {
            return Err(err("max_sessions", self.max_sessions, "must be at least 1"));
        }
        if self.terminal_memory == 0 {
            return Err(err(
                "terminal_memory",
                self.terminal_memory,
                "must be at least 1",
            ));
        }
        if let Some(token) = &self.executor_token {
            if token.is_empty() || token.len() > crate::wire::MAX_TOKEN {
                return Err(err(
                    "executor_token",
                    token.len(),
                    "must be 1-1024 bytes long (value is its length)",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_match_the_design() {
        let c = MillConfig::default();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.reconnect_grace, Duration::from_secs(45));
        assert_eq!(c.top_k, 3);
        assert_eq!(c.max_pending, 10_000);
        assert_eq!(c.quarantine_strikes, 3);
    }

    #[test]
    fn bad_settings_are_named_with_their_value() {
        let c = MillConfig {
            top_k: 0,
            ..MillConfig::default()
        };
        let e = c.validate().unwrap_err();
        assert_eq!(e.setting, "top_k");
        assert_eq!(e.value, "0");
        let c = MillConfig {
            snapshot_interval: Duration::from_secs(8),
            ..MillConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().setting, "snapshot_interval");
        // M5/E12: a grace at or below the silence timeout would hand executors timers
        // they cannot adopt.
        let c = MillConfig {
            reconnect_grace: Duration::from_secs(15),
            ..MillConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().setting, "reconnect_grace");
        assert!(c.session_timers().problem().is_some());
        assert_eq!(MillConfig::default().session_timers().problem(), None);
        let c = MillConfig {
            silence_timeout: Duration::ZERO,
            ..MillConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().setting, "silence_timeout");
    }
}
