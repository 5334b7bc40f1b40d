//! Reconnect backoff (E11): exponential, capped, jittered from a seed.
//!
//! The jitter keeps a fleet that lost the mill at the same instant from reconnecting in
//! lockstep. It is drawn from a tiny seeded generator so one seed gives one schedule.

use std::time::Duration;

/// SplitMix64: small, fast, good enough for spreading retries; seeded from config.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..=bound` (the modulo bias is irrelevant for jitter).
    fn up_to(&mut self, bound: u64) -> u64 {
        match bound.checked_add(1) {
            Some(n) => self.next_u64() % n,
            None => self.next_u64(),
        }
    }
}

/// "Equal jitter": attempt `n` waits a uniform time in `[b/2, b]` where
/// `b = min(max, min·2ⁿ)`; a Welcome resets `n` to 0.
#[derive(Debug, Clone)]
pub(super) struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
    rng: SplitMix64,
}

impl Backoff {
    pub(super) fn new(min: Duration, max: Duration, seed: u64) -> Self {
        Backoff {
            min,
            max,
            attempt: 0,
            rng: SplitMix64(seed),
        }
    }

    /// The cap for the current attempt, before jitter.
    pub(super) fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.min.saturating_mul(factor).min(self.max)
    }

    /// The delay before the next attempt; counts the attempt.
    pub(super) fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1).min(32);
        let micros = u64::try_from(ceiling.as_micros()).unwrap_or(u64::MAX);
        let half = micros / 2;
        Duration::from_micros(half + self.rng.up_to(micros - half))
    }

    /// A session was welcomed: start again from `min`.
    pub(super) fn reset(&mut self) {
        self.attempt = 0;
    }
}
