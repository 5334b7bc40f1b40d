//! millrace's protocol core: pure, deterministic state machines for the mill and its executors.
//!
//! Nothing here reads a clock, touches I/O, spawns a thread or draws a random number: time is
//! an argument, durable writes are `Persist` outputs that the driver applies before acting on
//! anything that follows them, and every map that is iterated is ordered. One input sequence
//! therefore gives one output sequence, which is what lets the simulator (`sim`) find a bug
//! from a seed and replay it, and lets the production driver (`node`) run the very same logic.
//!
//! Output and write enums (`MillOutput`, `ExecutorOutput`, `MillWrite`, wire messages) are
//! deliberately *not* `#[non_exhaustive]`: every driver matches them exhaustively, so a new
//! effect fails to compile in each driver until it is handled (the openraft habit). Input
//! enums, which drivers only construct, are `#[non_exhaustive]`.
//!
//! See docs/design.md for the rules (M…, E…, Q…, I…) that the modules cite.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod codec;
pub mod duration;
pub mod executor;
pub mod job;
pub mod mill;
pub mod quota;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod timers;
pub mod types;
pub mod wire;

pub use job::{
    Fingerprint, IdempotencyKey, Identity, JobSpec, JobState, KeyError, LogRef, SpecError,
    Terminal, TerminalCause, TerminalStatus,
};
pub use types::{ConnId, Epoch, IdError, JobId, LeaseId, NodeId, Resources, Seqno, Term, Time};
