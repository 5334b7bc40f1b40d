//! Maps the driver's `Instant`s to the core's `Time`: wall-clock microseconds since the Unix
//! epoch as read once at the process's start, advanced by the monotonic `Instant` from there.
//!
//! Anchored to the wall clock because one `Time` is durable: the executor's last contact with
//! the mill, which a restarted executor counts its self-fencing grace from (E12, I1), so a
//! `Time` must mean the same in consecutive processes of one store. Within a process only the
//! monotonic clock moves it, so a wall-clock step while running changes nothing. Between two
//! processes it shows: a wall clock stepped forward in between makes the new process think
//! the mill has been silent longer and fence adopted jobs early (safe); one stepped back
//! makes it fence them late, by at most the step (and only once: the executor then writes
//! its own start as the last contact).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use millrace_core::Time;

/// The process's time origin. Copy it into every driver of the process so that all of them
/// (a standalone mill and its executors) agree on what a `Time` means.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: Instant,
    /// `Time` at `origin`: the wall clock then, in microseconds since the Unix epoch.
    origin_micros: u64,
}

impl Clock {
    /// A clock whose origin is now, on the wall clock. A wall clock before 1970 counts as the
    /// epoch itself (times are then since the process's start, as if not anchored).
    pub fn start() -> Self {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Clock {
            origin: Instant::now(),
            origin_micros: u64::try_from(wall.as_micros()).unwrap_or(u64::MAX),
        }
    }

    /// The core's `Time` for now.
    pub fn now(&self) -> Time {
        self.time_of(Instant::now())
    }

    /// The core's `Time` for `at` (the origin if `at` is earlier).
    pub fn time_of(&self, at: Instant) -> Time {
        let since = at.saturating_duration_since(self.origin);
        Time::from_micros(self.origin_micros).plus(since)
    }

    /// The `Instant` of a core `Time`, for sleeping until a deadline (the origin if `t` is
    /// earlier, at most a century ahead).
    pub fn instant_of(&self, t: Time) -> Instant {
        let far = self.origin + Duration::from_secs(100 * 365 * 24 * 3600);
        let since = Duration::from_micros(t.as_micros().saturating_sub(self.origin_micros));
        self.origin.checked_add(since).map_or(far, |i| i.min(far))
    }
}

/// Wall-clock milliseconds since the Unix epoch, for people (never for deadlines).
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Parses a duration such as `250ms`, `2s`, `5m`, `24h`, `30d` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    millrace_core::duration::parse(s).map_err(|e| e.to_string())
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
        assert_eq!(parse_duration("30d"), Ok(Duration::from_secs(30 * 86400)));
        // The syntax the scenario files use too (one parser, core::duration).
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m30s"), Ok(Duration::from_secs(150)));
        assert!(parse_duration("2 weeks").is_err());
        assert!(parse_duration("ms").is_err());
    }

    #[test]
    fn time_round_trips_through_instants() {
        let c = Clock::start();
        let t = c.time_of(c.origin).plus(Duration::from_micros(1_500_000));
        assert_eq!(c.time_of(c.instant_of(t)), t);
        // Before the origin (an earlier process's time): the origin, never a panic.
        assert_eq!(c.instant_of(Time::from_micros(1)), c.origin);
    }

    /// E12: a `Time` means the same in two processes (two clocks started apart): the later
    /// clock's origin is the earlier one's time for that moment, give or take the wall
    /// clock's own steps.
    #[test]
    fn e12_times_of_two_processes_share_the_wall_clock_origin() {
        let first = Clock::start();
        let second = Clock::start();
        let in_first = first.now();
        let in_second = second.now();
        let skew = in_first.since(in_second).max(in_second.since(in_first));
        assert!(skew < Duration::from_secs(1), "{in_first} vs {in_second}");
        let unix_2020 = Time::from_micros(1_577_836_800_000_000);
        assert!(
            second.now() > unix_2020,
            "anchored to the wall clock: {}",
            second.now()
        );
    }
}
