//! Maps the driver's `Instant`s to the core's `Time`: microseconds since the process's start.

use std::time::{Duration, Instant};

use millrace_core::Time;

/// The process's time origin. Copy it into every driver of the process so that all of them
/// (a standalone mill and its executors) agree on what a `Time` means.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: Instant,
}

impl Clock {
    /// A clock whose origin is now.
    pub fn start() -> Self {
        Clock {
            origin: Instant::now(),
        }
    }

    /// The core's `Time` for now.
    pub fn now(&self) -> Time {
        self.time_of(Instant::now())
    }

    /// The core's `Time` for `at` (the origin if `at` is earlier).
    pub fn time_of(&self, at: Instant) -> Time {
        let micros = at.saturating_duration_since(self.origin).as_micros();
        Time::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
    }

    /// The `Instant` of a core `Time`, for sleeping until a deadline.
    pub fn instant_of(&self, t: Time) -> Instant {
        let far = self.origin + Duration::from_secs(100 * 365 * 24 * 3600);
        self.origin
            .checked_add(Duration::from_micros(t.as_micros()))
            .map_or(far, |i| i.min(far))
    }
}

/// Wall-clock milliseconds since the Unix epoch, for people (never for deadlines).
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Parses a duration such as `250ms`, `2s`, `5m`, `24h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as 250ms, 2s, 5m or 24h"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(format!("{s:?}: unknown unit {unit:?}; use ms, s, m or h")),
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86400)));
        assert!(parse_duration("2 weeks").is_err());
        assert!(parse_duration("ms").is_err());
    }

    #[test]
    fn time_round_trips_through_instants() {
        let c = Clock::start();
        let t = Time::from_micros(1_500_000);
        assert_eq!(c.time_of(c.instant_of(t)), t);
    }
}
