//! Randomness: one printed `u64` seed, split into named ChaCha streams.
//!
//! Each purpose draws from its own stream, so that changing how much one purpose draws (a
//! bigger workload, say) does not reshuffle the others (the network keeps its latencies).
//! Nothing else in the simulator may be a source of randomness.

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

/// What a stream is for. The discriminant is the ChaCha stream number: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Which fault families are on, and how hard (swarm testing).
    Swarm = 1,
    /// The fault schedule: partitions, clogs, spikes, resets, crashes.
    Faults = 2,
    /// Latencies.
    Network = 3,
    /// Arrivals, specs, cancels, invalid submits, the fleet's shape.
    Workload = 4,
    /// Job durations, exit codes, stop delays.
    Engines = 5,
    /// Choices misbehaving executors make.
    Byzantine = 6,
    /// Where in a step a crash lands, new epochs, backoff seeds.
    Process = 7,
    /// How long a lagging driver holds each due `Tick` (I12).
    Lag = 8,
    /// The timer flags each executor starts with, which the mill's `Welcome` replaces (M1,
    /// E12).
    Flags = 9,
    /// Which jobs get a retry policy (M32), and which one.
    Retry = 10,
}

/// A seeded generator for one purpose, with the few distributions the simulator needs.
#[derive(Debug, Clone)]
pub struct Rng(ChaCha8Rng);

impl Rng {
    /// The stream for `purpose` of `seed`.
    pub fn new(seed: u64, purpose: Purpose) -> Self {
        let mut r = ChaCha8Rng::seed_from_u64(seed);
        r.set_stream(purpose as u64);
        Rng(r)
    }

    /// A uniform `u64`.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `lo..=hi` (`lo` if `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        let span = hi - lo;
        match span.checked_add(1) {
            // Lemire's multiply-shift; the bias is far below anything a test could see.
            Some(n) => lo + ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64,
            None => self.next_u64(),
        }
    }

    /// Uniform index below `n` (`n` > 0).
    pub fn index(&mut self, n: usize) -> usize {
        self.range(0, n.saturating_sub(1) as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Exponentially distributed with the given mean (in whatever unit the caller uses).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * ln(1.0 - self.unit())
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }
}

/// The natural logarithm of `x` in (0, 1], from `+ - * /` only.
///
/// `f64::ln` calls the platform's libm, whose last bit may differ between machines; this one
/// gives the same bits everywhere, so a seed draws the same durations on every machine (I10).
pub fn ln(x: f64) -> f64 {
    if x <= 0.0 {
        return f64::MIN;
    }
    // x = m · 2^e with m in [0.5, 1).
    let bits = x.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i64 - 1022;
    let m = f64::from_bits((bits & !(0x7ff << 52)) | (1022 << 52));
    // ln m = 2 atanh(z), z = (m − 1)/(m + 1) in (−1/3, 0].
    let z = (m - 1.0) / (m + 1.0);
    let z2 = z * z;
    let mut term = z;
    let mut sum = 0.0;
    for k in 0..30 {
        sum += term / f64::from(2 * k + 1);
        term *= z2;
    }
    const LN_2: f64 = std::f64::consts::LN_2;
    2.0 * sum + exp as f64 * LN_2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_independent_and_repeatable() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7, Purpose::Network);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7, Purpose::Network);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = Rng::new(7, Purpose::Workload);
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn ln_matches_the_library_closely() {
        for x in [1.0, 0.999, 0.75, 0.5, 0.1, 1e-3, 1e-9, 3e-300] {
            let (a, b) = (ln(x), f64::ln(x));
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{x}: {a} vs {b}");
        }
    }

    #[test]
    fn range_stays_in_bounds() {
        let mut r = Rng::new(1, Purpose::Faults);
        for _ in 0..1000 {
            let x = r.range(3, 9);
            assert!((3..=9).contains(&x));
        }
        assert_eq!(r.range(5, 5), 5);
    }
}
