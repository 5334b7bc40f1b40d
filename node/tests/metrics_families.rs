//! `/metrics` keeps its metric families (issue 18 item 3): a mill with one executor, after a
//! job that succeeded, one that failed and one running under an owner's quota hold, answers
//! the same family names, types and label names as the fixture captured from the hand-written
//! exposition before the move to `prometheus-client`
//! (`tests/fixtures/metrics-before-prometheus-client.txt`, scraped from a standalone node
//! after the same three jobs). Values are not compared (timings differ run to run). The
//! empty-family case (`millrace_quota_usage` while nothing is held) is checked by
//! `cluster.rs` (its TYPE line with no series).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

const BEFORE: &str = include_str!("fixtures/metrics-before-prometheus-client.txt");

/// Family name → type, from the `# TYPE` lines (text format 0.0.4).
fn types(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.strip_prefix("# TYPE ")?.split(' ');
            Some((it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect()
}

/// Every sample's (series name, label names).
fn series(text: &str) -> BTreeSet<(String, Vec<String>)> {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("parses as Prometheus text");
    scrape
        .samples
        .into_iter()
        .map(|s| {
            let mut names: Vec<String> = s.labels.keys().cloned().collect();
            names.sort();
            (s.metric, names)
        })
        .collect()
}

#[test]
fn metrics_keep_their_family_names_types_and_labels() {
    let root = tempfile::tempdir().unwrap();
    let (mill, _exec) = common::start_mill_and_x1(root.path(), &[], 0, 4);
    let api = &mill.api;
    let ok = api.submit(&json!({"command": "echo ok"}));
    let failed = api.submit(&json!({"command": "exit 3"}));
    let held = api.submit(&json!({"command": "sleep 600", "owner": "alice", "repo": "alice/x"}));
    assert_eq!(api.wait_done(ok)["state"], "success");
    assert_eq!(api.wait_done(failed)["state"], "failed");
    api.wait_state(held, |s| s == "running", "running");

    let (s, now) = api.get_raw("/metrics", true);
    assert_eq!(s, 200, "{now}");
    let (before_types, now_types) = (types(BEFORE), types(&now));
    assert!(before_types.len() > 20, "{before_types:?}");
    assert_eq!(now_types, before_types, "family names and types\n{now}");
    // One change: every violation kind is a series from the start (at 0) where the
    // hand-written exposition had none until the first violation; same name, type, label.
    let mut expected = series(BEFORE);
    expected.insert(("millrace_violations_total".into(), vec!["kind".into()]));
    assert_eq!(series(&now), expected, "series and label names\n{now}");
    let zeros = now
        .lines()
        .filter(|l| l.starts_with("millrace_violations_total{kind=") && l.ends_with(" 0"))
        .count();
    assert!(zeros > 3, "every violation kind at 0\n{now}");
    assert!(
        !now.contains("# EOF"),
        "classic text format, no OpenMetrics trailer\n{now}"
    );
}

/// `promtool check metrics` accepts the exposition (issue 18 item 3). promtool ships in the
/// Debian package `prometheus`; CI does not install it, so without it the test says so and
/// checks nothing else.
#[test]
fn promtool_accepts_the_exposition_when_present() {
    use std::io::Write as _;
    use std::process::{Command, Stdio};

    if Command::new("promtool").arg("--version").output().is_err() {
        eprintln!("skipped: promtool is not on PATH (Debian package `prometheus` ships it)");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let (mill, _exec) = common::start_mill_and_x1(root.path(), &[], 0, 2);
    let job = mill.api.submit(&json!({"command": "echo ok"}));
    assert_eq!(mill.api.wait_done(job)["state"], "success");
    let (s, text) = mill.api.get_raw("/metrics", true);
    assert_eq!(s, 200, "{text}");
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}\n{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
