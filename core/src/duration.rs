//! One duration syntax for every place a person writes one: the CLI and its environment
//! variables, config files and the simulator's scenario files.
//!
//! A duration is one or more `<number><unit>` parts written together (`250ms`, `1.5s`,
//! `2m30s`, `1h`, `30d`, `800us`); a number alone is seconds (`3`). Units: `us`, `ms`, `s`,
//! `m`, `h`, `d`. Fractions are exact to the microsecond (integer arithmetic, no float
//! rounding); digits beyond it are an error rather than a silent truncation.

use std::fmt;
use std::time::Duration;

/// Why a duration did not parse: the text and what was wrong, with the syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError {
    text: String,
    why: &'static str,
}

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a duration ({}); write a number and a unit such as 250ms, 1.5s, 2m30s, 24h or 30d (us, ms, s, m, h, d)",
            self.text, self.why
        )
    }
}

impl std::error::Error for DurationError {}

const US_PER_UNIT: [(&str, u64); 6] = [
    ("us", 1),
    ("ms", 1_000),
    ("s", 1_000_000),
    ("m", 60_000_000),
    ("h", 3_600_000_000),
    ("d", 86_400_000_000),
];

/// Parses `text` (see the module docs).
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    parse_micros(text).map(Duration::from_micros)
}

/// [`parse`] in whole microseconds.
pub fn parse_micros(text: &str) -> Result<u64, DurationError> {
    let fail = |why| DurationError {
        text: text.to_string(),
        why,
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(fail("empty"));
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            // A number alone is seconds, and only alone.
            "" if rest.len() == text.trim().len() => 1_000_000,
            "" => return Err(fail("a number without a unit after another part")),
            unit => US_PER_UNIT
                .iter()
                .find(|(name, _)| *name == unit)
                .map(|(_, us)| *us)
                .ok_or_else(|| fail("unknown unit"))?,
        };
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        if int.is_empty() && frac.is_empty() {
            return Err(fail("a unit without a number"));
        }
        if frac.contains('.') {
            return Err(fail("two decimal points"));
        }
        let int: u64 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| fail("too large"))?
        };
        let mut value = int.checked_mul(scale).ok_or_else(|| fail("too large"))?;
        let mut place = scale;
        for d in frac.chars() {
            let d = u64::from(d.to_digit(10).ok_or_else(|| fail("not a number"))?);
            if place < 10 {
                if d != 0 {
                    return Err(fail("finer than a microsecond"));
                }
                continue;
            }
            place /= 10;
            value = value
                .checked_add(d * place)
                .ok_or_else(|| fail("too large"))?;
        }
        total = total.checked_add(value).ok_or_else(|| fail("too large"))?;
        rest = tail;
    }
    Ok(total)
}

/// Formats `d` in the largest unit that writes it exactly (`30s`, `250ms`, `90m`, `2d`,
/// `1500us`); [`parse`] reads it back to the same value (to the microsecond).
pub fn format(d: Duration) -> String {
    format_micros(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// [`format`] of whole microseconds.
pub fn format_micros(us: u64) -> String {
    if us == 0 {
        return "0s".to_string();
    }
    for (name, scale) in US_PER_UNIT.iter().rev() {
        if us % scale == 0 {
            return format!("{}{name}", us / scale);
        }
    }
    format!("{us}us")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_fractions_and_compounds_parse() {
        let ok = |t: &str, us: u64| assert_eq!(parse_micros(t), Ok(us), "{t}");
        ok("800us", 800);
        ok("250ms", 250_000);
        ok("2s", 2_000_000);
        ok("3", 3_000_000);
        ok(" 1.5s ", 1_500_000);
        ok(".5s", 500_000);
        ok("2m30s", 150_000_000);
        ok("1h", 3_600_000_000);
        ok("30d", 30 * 86_400_000_000);
        ok("1.0000000s", 1_000_000);
        ok("0s", 0);
    }

    #[test]
    fn bad_text_is_refused_with_the_syntax() {
        for t in [
            "",
            "s",
            "4x",
            "2 weeks",
            "ms",
            "1..5s",
            "1s5",
            "1.5us0",
            "0.0001us",
            "1.0000001s",
            "99999999999999999999s",
        ] {
            let e = parse(t).expect_err(t);
            let msg = e.to_string();
            assert!(msg.contains("250ms, 1.5s"), "{msg}");
        }
    }

    #[test]
    fn formatting_reads_back() {
        for us in [
            0,
            1,
            999,
            1_000,
            1_500_000,
            60_000_000,
            5_400_000_000,
            86_400_000_000,
        ] {
            assert_eq!(parse_micros(&format_micros(us)), Ok(us), "{us}");
        }
        assert_eq!(format(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format(Duration::from_secs(90 * 60)), "90m");
    }
}
