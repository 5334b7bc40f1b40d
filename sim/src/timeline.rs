//! `replay --html`: one self-contained HTML timeline of a run (issue 17 item 2). A lane per
//! process, messages as arrows from send to delivery, faults shaded, each lease's life as a
//! bar, the failing invariant marked; zoom (wheel, buttons) and a filter by job or lease.
//!
//! The data is the run's own trace, parsed back (`time process > cN Msg …` is a send on
//! connection N, `<` its delivery, `!!` a fault): recording it changes nothing in the run,
//! so the trace hash is the same with and without `--html`. Only the last
//! [`MAX_LINES`] trace lines are drawn (the failure is at the end); the page says so when
//! it cut.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;

/// The most trace lines a timeline draws.
pub const MAX_LINES: usize = 40_000;

#[derive(Serialize)]
struct Arrow {
    /// Send time, delivery time (seconds).
    t0: f64,
    t1: f64,
    /// Lane indices.
    from: usize,
    to: usize,
    /// The message (kind and ids).
    text: String,
}

#[derive(Serialize)]
struct Mark {
    t: f64,
    lane: usize,
    /// Seconds it lasts (a crash's downtime), 0 when unknown.
    len: f64,
    text: String,
}

#[derive(Serialize)]
struct LeaseLife {
    lease: String,
    job: String,
    lane: usize,
    t0: f64,
    t1: f64,
}

#[derive(Serialize)]
struct Data {
    title: String,
    lanes: Vec<String>,
    arrows: Vec<Arrow>,
    faults: Vec<Mark>,
    leases: Vec<LeaseLife>,
    failure: Option<Mark>,
    note: String,
}

/// One parsed trace line: time, process, the rest.
fn parse(line: &str) -> Option<(f64, &str, &str)> {
    let line = line.trim_start();
    let (t, rest) = line.split_once(' ')?;
    let t: f64 = t.parse().ok()?;
    let rest = rest.trim_start();
    let (proc_, rest) = rest.split_once(' ')?;
    Some((t, proc_, rest.trim_start()))
}

/// The first word of `text` that starts with `prefix` and a digit (`l12`, `j3`).
fn id(text: &str, prefix: char) -> Option<&str> {
    text.split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',' || c == '@')
        .find(|w| {
            w.strip_prefix(prefix)
                .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
        })
}

/// Seconds in a `down 2.000s` phrase.
fn down(text: &str) -> f64 {
    text.split_once("down ")
        .and_then(|(_, r)| r.split(['s', ')']).next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0)
}

/// The page for `lines` (the last trace lines of a run that recorded `total` in all).
pub fn html(title: &str, lines: &[String], total: u64, failure: Option<(f64, String)>) -> String {
    let mut lanes: Vec<String> = Vec::new();
    let lane = |p: &str, lanes: &mut Vec<String>| match lanes.iter().position(|l| l == p) {
        Some(i) => i,
        None => {
            lanes.push(p.to_string());
            lanes.len() - 1
        }
    };
    lane("mill", &mut lanes);
    // Sends waiting for their delivery, by (connection, direction-free message text).
    let mut pending: BTreeMap<(String, String), VecDeque<(f64, usize)>> = BTreeMap::new();
    let mut arrows = Vec::new();
    let mut faults = Vec::new();
    let mut lives: BTreeMap<String, LeaseLife> = BTreeMap::new();
    for l in lines {
        let Some((t, p, rest)) = parse(l) else {
            continue;
        };
        let li = lane(p, &mut lanes);
        if let Some(msg) = rest.strip_prefix("> c") {
            if let Some((conn, text)) = msg.split_once(' ') {
                pending
                    .entry((conn.to_string(), text.to_string()))
                    .or_default()
                    .push_back((t, li));
            }
        } else if let Some(msg) = rest.strip_prefix("< c") {
            if let Some((conn, text)) = msg.split_once(' ') {
                let key = (conn.to_string(), text.to_string());
                if let Some((t0, from)) = pending.get_mut(&key).and_then(VecDeque::pop_front) {
                    arrows.push(Arrow {
                        t0,
                        t1: t,
                        from,
                        to: li,
                        text: text.to_string(),
                    });
                }
            }
        } else if rest.starts_with("!!") {
            faults.push(Mark {
                t,
                lane: li,
                len: down(rest),
                text: rest.trim_start_matches("!! ").to_string(),
            });
        }
        // A lease lives from its first to its last mention on an executor's lane.
        if p != "mill" {
            if let Some(lease) = id(rest, 'l') {
                let job = id(rest, 'j').unwrap_or("").to_string();
                let life = lives.entry(format!("{lease}@{p}")).or_insert(LeaseLife {
                    lease: lease.to_string(),
                    job: String::new(),
                    lane: li,
                    t0: t,
                    t1: t,
                });
                life.t1 = t;
                if life.job.is_empty() {
                    life.job = job;
                }
            }
        }
    }
    let failure = failure.map(|(t, text)| Mark {
        t,
        lane: 0,
        len: 0.0,
        text,
    });
    let note = if total > lines.len() as u64 {
        format!(
            "showing the last {} of {total} trace lines (the cap is {MAX_LINES})",
            lines.len()
        )
    } else {
        format!("{total} trace lines")
    };
    let data = Data {
        title: title.to_string(),
        lanes,
        arrows,
        faults,
        leases: lives.into_values().collect(),
        failure,
        note,
    };
    // `</` cannot close the script element from inside the data.
    let json = serde_json::to_string(&data)
        .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
        .replace("</", "<\\/");
    PAGE.replace("__TITLE__", &escape(title))
        .replace("__DATA__", &json)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

const PAGE: &str = include_str!("timeline.html");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_and_its_delivery_make_one_arrow() {
        let lines: Vec<String> = [
            "    3.913388 mill > c1 CommitLease l3",
            "    3.913911 x0   < c1 CommitLease l3",
            "    3.913911 x0   > start l3 j2",
            "    5.000000 x0   !! crash (down 2.000s)",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let page = html("t", &lines, 4, Some((5.0, "I1: x".into())));
        assert!(page.contains("\"from\":0,\"to\":1,\"text\":\"CommitLease l3\""));
        assert!(page.contains("\"len\":2.0"));
        assert!(page.contains("\"lease\":\"l3\",\"job\":\"j2\""));
        // Nothing is fetched: no external script, style, image or font.
        for fetch in ["src=\"http", "href=\"http", "url(http", "@import"] {
            assert!(!page.contains(fetch), "{fetch}");
        }
    }
}
