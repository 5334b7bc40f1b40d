//! Plain types shared across the simulator that import nothing from the crate: simulated
//! time as microseconds and the broken-rule record every checker returns. A leaf, so that
//! `byzantine`, `scenario`, `checkers` and `liveness` can share them without importing each
//! other in a circle (issue 17 item 3); `scenario` and `checkers` re-export them under their
//! old paths.

use std::fmt;

/// One microsecond-resolution instant of simulated time, as a plain number.
pub type Micros = u64;

/// Microseconds in a second.
pub const SEC: Micros = 1_000_000;
/// Microseconds in a millisecond.
pub const MS: Micros = 1_000;

/// A broken rule: which, and what happened, with the ids involved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The invariant or rule (`I1`…`I10`, `persist-before-send`).
    pub rule: &'static str,
    /// What happened.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.rule, self.message)
    }
}
