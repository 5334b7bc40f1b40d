//! E15 (issue 13 item 7) with real processes on loopback: live output read by cursor from
//! the mill's bounded buffers, explicit gaps for bytes evicted or never forwarded, follow
//! reads that reach `done`, and the stored final log, whole. Waits poll with a bound; every
//! assertion is on bytes and counts, never on wall-clock time.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{start_executor, strings, timing, wait_for, Api, Mill, Proc, BIN};
use serde_json::{json, Value};

const LINES: usize = 4000;

/// What the test job prints before its gate: `LINES` numbered lines of 49 bytes.
fn body() -> Vec<u8> {
    (0..LINES)
        .map(|i| format!("line {i:06} abcdefghijklmnopqrstuvwxyz0123456789\n"))
        .collect::<String>()
        .into_bytes()
}

/// A job printing [`body`], then (after `gate` exists, if given) `tail`.
fn job_cmd(gate: Option<&Path>) -> String {
    let wait = gate.map_or(String::new(), |g| {
        format!("while [ ! -e {} ]; do sleep 0.05; done; ", g.display())
    });
    format!(
        "i=0; while [ $i -lt {LINES} ]; do printf 'line %06d abcdefghijklmnopqrstuvwxyz0123456789\\n' $i; i=$((i+1)); done; {wait}echo tail"
    )
}

fn expected() -> Vec<u8> {
    let mut all = body();
    all.extend_from_slice(b"tail\n");
    all
}

fn start(root: &Path, mill_flags: &[&str], exec_flags: &[&str]) -> (Mill, Proc) {
    let mut args = strings(mill_flags);
    args.extend(timing("5s", "2s"));
    let mill = common::start_mill(root, "127.0.0.1:0", &args, "info", 0);
    let mut extra = strings(exec_flags);
    extra.extend(timing("5s", "2s"));
    let exec = start_executor(
        root,
        &mill.addrs.executor,
        "x1",
        2,
        &mill.data.join("token"),
        &extra,
    );
    wait_for("x1 ready", || mill.api.ready("x1").then_some(()));
    (mill, exec)
}

/// One cursor read, decoded.
#[derive(Debug, Clone)]
struct Piece {
    gap: Option<(u64, u64, u64, String)>,
    bytes: Vec<u8>,
    next: u64,
    end: u64,
    done: bool,
}

fn b64(text: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a' + 26),
            b'0'..=b'9' => u32::from(c - b'0' + 52),
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let mut out = Vec::new();
    for q in text.as_bytes().chunks(4) {
        let pad = q.iter().filter(|&&c| c == b'=').count();
        let n = q[..4 - pad].iter().fold(0u32, |n, &c| (n << 6) | val(c)) << (6 * pad);
        out.extend_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8][..3 - pad]);
    }
    out
}

fn read(api: &Api, job: u64, cursor: u64, wait: u64) -> Piece {
    let (s, v) = api.get(&format!("/v1/jobs/{job}/log?cursor={cursor}&wait={wait}"));
    assert_eq!(s, 200, "{v}");
    let gap = match &v["gap"] {
        Value::Null => None,
        g => Some((
            g["from"].as_u64().unwrap(),
            g["to"].as_u64().unwrap(),
            g["lost"].as_u64().unwrap(),
            g["reason"].as_str().unwrap().to_string(),
        )),
    };
    let bytes = b64(v["data"].as_str().unwrap());
    assert_eq!(v["len"].as_u64().unwrap(), bytes.len() as u64, "{v}");
    assert_eq!(v["cursor"].as_u64().unwrap(), cursor);
    let piece = Piece {
        gap,
        bytes,
        next: v["next"].as_u64().unwrap(),
        end: v["end"].as_u64().unwrap(),
        done: v["done"].as_bool().unwrap(),
    };
    // The cursor arithmetic every reader relies on.
    let start = match &piece.gap {
        Some((from, to, lost, _)) => {
            assert_eq!(*from, cursor, "{v}");
            assert_eq!(to - from, *lost, "{v}");
            *to
        }
        None => cursor,
    };
    assert_eq!(piece.next, start + piece.bytes.len() as u64, "{v}");
    piece
}

/// What a reader from `cursor` collected: each byte at its offset, and the gaps.
#[derive(Debug, Default)]
struct Seen {
    bytes: Vec<(u64, u8)>,
    gaps: Vec<(u64, u64, u64, String)>,
}

impl Seen {
    fn take(&mut self, p: &Piece, cursor: u64) {
        let start = p.gap.as_ref().map_or(cursor, |g| g.1);
        if let Some(g) = &p.gap {
            self.gaps.push(g.clone());
        }
        for (i, &b) in p.bytes.iter().enumerate() {
            self.bytes.push((start + i as u64, b));
        }
    }

    /// Every offset below `end` is a byte (the right one) or inside exactly one gap.
    fn accounts_for(&self, want: &[u8]) {
        let lost: u64 = self.gaps.iter().map(|g| g.2).sum();
        assert_eq!(
            self.bytes.len() as u64 + lost,
            want.len() as u64,
            "bytes + gaps cover every offset"
        );
        for &(at, b) in &self.bytes {
            assert_eq!(want[at as usize], b, "byte at offset {at}");
        }
    }
}

/// Reads from `cursor` until the job is done; returns what was seen.
fn follow(api: &Api, job: u64, mut cursor: u64, seen: &mut Seen) {
    wait_for(&format!("job {job}'s log to be done"), || {
        let p = read(api, job, cursor, 5);
        seen.take(&p, cursor);
        cursor = p.next;
        p.done.then_some(())
    });
}

/// `millrace logs [flags] JOB` against `mill`; its stdout.
fn cli_logs(mill: &Mill, job: u64, flags: &[&str]) -> Vec<u8> {
    let out = Command::new(BIN)
        .arg("logs")
        .args(flags)
        .arg(job.to_string())
        .args(["--server", &mill.addrs.http, "--data"])
        .arg(&mill.data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// E15: a job prints far more than the mill's per-job buffer while a reader lags. The reader
/// at cursor 0 gets an explicit evicted gap with the exact count, then the oldest byte held;
/// `millrace logs` prints a marker line for it; following reaches `done`; bytes and gaps
/// account for every offset; and once the job is done the stored log is whole, no gap.
#[test]
fn e15_a_lagging_reader_gets_an_explicit_gap_and_the_final_log_is_whole() {
    let root = tempfile::tempdir().unwrap();
    let (mill, _exec) = start(
        root.path(),
        &["--live-log-per-job", "16KiB", "--live-log-total", "1MiB"],
        &[],
    );
    let api = &mill.api;
    let gate = root.path().join("gate");
    let job = api.submit(&json!({"command": job_cmd(Some(&gate))}));
    let body = body();
    let len = body.len() as u64;
    // The job is held at its gate once all of `body` has reached the mill.
    wait_for("the body to reach the mill", || {
        (read(api, job, 0, 1).end >= len).then_some(())
    });
    let first = read(api, job, 0, 0);
    let (from, to, lost, reason) = first.gap.clone().expect("a gap at cursor 0");
    assert_eq!((from, reason.as_str()), (0, "evicted"));
    assert_eq!(to, len - 16 * 1024, "exactly the per-job bound is held");
    assert_eq!(lost, to);
    assert_eq!(
        first.bytes[..],
        body[to as usize..to as usize + first.bytes.len()]
    );

    // The CLI, with nothing changing meanwhile (the job waits at its gate): the marker line,
    // then exactly the bytes held.
    let printed = cli_logs(&mill, job, &[]);
    let mut want = format!("\n--- {lost} bytes lost (evicted) ---\n").into_bytes();
    want.extend_from_slice(&body[to as usize..]);
    assert_eq!(
        String::from_utf8_lossy(&printed),
        String::from_utf8_lossy(&want)
    );

    // The lagging reader goes on from where the gap ended, then follows to the end.
    let mut seen = Seen::default();
    seen.take(&first, 0);
    let mut cursor = first.next;
    while cursor < len {
        let p = read(api, job, cursor, 0);
        assert!(p.gap.is_none(), "no further gap while caught up: {p:?}");
        seen.take(&p, cursor);
        cursor = p.next;
    }
    std::fs::write(&gate, b"").unwrap();
    follow(api, job, cursor, &mut seen);
    seen.accounts_for(&expected());
    assert_eq!(seen.gaps.len(), 1, "{:?}", seen.gaps);
    assert_eq!(api.wait_done(job)["state"], "success");

    // The final log, whole: cursor reads from 0 with no gap, the text route, the CLI.
    let mut whole = Seen::default();
    follow(api, job, 0, &mut whole);
    assert!(whole.gaps.is_empty(), "{:?}", whole.gaps);
    whole.accounts_for(&expected());
    let (s, text) = api.get_raw(&format!("/v1/jobs/{job}/log?follow=false"), true);
    assert_eq!(s, 200);
    assert_eq!(text.as_bytes(), expected());
    assert_eq!(cli_logs(&mill, job, &["-f"]), expected());
    // A cursor past the end of a finished log is refused, naming the field.
    let (s, v) = api.get(&format!("/v1/jobs/{job}/log?cursor={}", len + 100));
    assert_eq!((s, v["field"].as_str()), (400, Some("cursor")), "{v}");
}

/// E15: bytes the executor did not forward (over its live-log budget) are a hole the mill
/// stores as such: the final log's reads report them as dropped gaps with exact counts, the
/// end mark counts the trailing ones, and nothing is spliced.
#[test]
fn e15_bytes_over_the_executors_budget_are_dropped_gaps_never_continuity() {
    let root = tempfile::tempdir().unwrap();
    let (mill, _exec) = start(root.path(), &[], &["--live-log-budget", "4KiB"]);
    let api = &mill.api;
    let job = api.submit(&json!({"command": job_cmd(None)}));
    assert_eq!(api.wait_done(job)["state"], "success");
    let mut seen = Seen::default();
    follow(api, job, 0, &mut seen);
    seen.accounts_for(&expected());
    assert!(!seen.gaps.is_empty(), "a 4 KiB budget cannot carry 196 KB");
    assert!(
        seen.gaps.iter().all(|g| g.3 == "dropped"),
        "{:?}",
        seen.gaps
    );
    assert!(seen.bytes.len() < expected().len());
    // The text stream marks each gap on a line of its own.
    let (s, text) = api.get_raw(&format!("/v1/jobs/{job}/log?follow=false"), true);
    assert_eq!(s, 200);
    let first = &seen.gaps[0];
    assert!(
        text.contains(&format!("\n--- {} bytes lost (dropped) ---\n", first.2)),
        "{text:.300}"
    );
}

/// E15 with E14: output a job writes while its executor is down never reaches the mill; the
/// re-attached supervisor's next chunk says where it starts, so readers see exactly those
/// bytes as a dropped gap, and what follows sits at its true offset.
#[test]
fn e15_output_written_while_the_executor_was_down_is_a_dropped_gap_of_its_exact_size() {
    let root = tempfile::tempdir().unwrap();
    let (mill, mut exec) = start(root.path(), &[], &[]);
    let api = &mill.api;
    let (gate1, gate2) = (root.path().join("gate1"), root.path().join("gate2"));
    let cmd = format!(
        "echo before; while [ ! -e {g1} ]; do sleep 0.05; done; echo while-down; \
         while [ ! -e {g2} ]; do sleep 0.05; done; echo after",
        g1 = gate1.display(),
        g2 = gate2.display()
    );
    let job = api.submit(&json!({ "command": cmd }));
    wait_for("the first line at the mill", || {
        (read(api, job, 0, 1).end >= 7).then_some(())
    });
    exec.kill9();
    std::fs::write(&gate1, b"").unwrap();
    // The job writes its second line to the executor's log with no executor attached.
    let logs = root.path().join("x1/logs");
    wait_for("the second line in the executor's log", || {
        let dir = std::fs::read_dir(&logs).ok()?;
        dir.filter_map(Result::ok)
            .any(|e| std::fs::read(e.path()).is_ok_and(|b| b == b"before\nwhile-down\n"))
            .then_some(())
    });
    let _exec = start_executor(
        root.path(),
        &mill.addrs.executor,
        "x1",
        2,
        &mill.data.join("token"),
        &timing("5s", "2s"),
    );
    wait_for("x1 ready again", || mill.api.ready("x1").then_some(()));
    std::fs::write(&gate2, b"").unwrap();
    assert_eq!(api.wait_done(job)["state"], "success");
    let mut seen = Seen::default();
    follow(api, job, 0, &mut seen);
    seen.accounts_for(b"before\nwhile-down\nafter\n");
    assert_eq!(
        seen.gaps,
        [(7, 18, 11, "dropped".to_string())],
        "exactly `while-down\\n` is lost"
    );
}
