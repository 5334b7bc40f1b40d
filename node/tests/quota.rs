//! Issue 13 item 5, quota in the node, through the real binary on loopback: `--config`'s
//! `[quota]` limits reach the mill's ledger (§6); a job over its owner's limit waits for
//! quota without a seat (M15) and says so in its status and in `GET /v1/quota` / `millrace
//! quota`, then runs once the holder ends (Q2, Q3); a bad config file stops `mill` and
//! `standalone` before they listen, naming the key and the value. Waits poll with a bound
//! and assert outcomes, never durations.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{start_mill, start_ready_executor, strings, timing, wait_for, Mill, TIMEOUT};
use serde_json::{json, Value};

fn write_config(root: &Path, text: &str) -> PathBuf {
    let path = root.join("millrace.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A shell command that runs until `gate` exists.
fn held_until(gate: &Path) -> String {
    format!(
        "while [ ! -e {} ]; do sleep 0.05; done; echo released",
        gate.display()
    )
}

fn cli(mill: &Mill, args: &[&str]) -> (bool, String) {
    let out = Command::new(common::BIN)
        .args(args)
        .args(["--server", &mill.addrs.http, "--data"])
        .arg(&mill.data)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// M15, Q2, Q3: owner alice may run one job at a time. Her second job waits for quota —
/// its status and `/v1/quota` say owner alice's `jobs` is used up — while another owner's
/// job runs beside the first; when the first ends the second runs, and nothing is left held.
#[test]
fn m15_a_job_over_its_owner_limit_waits_for_quota_says_why_and_runs_after_the_holder() {
    let root = tempfile::tempdir().unwrap();
    let config = write_config(
        root.path(),
        "[quota.defaults.owner]\njobs = 1\n[quota.owner.\"bob\"]\njobs = 5\n",
    );
    let mut extra = strings(&["--config", config.to_str().unwrap()]);
    extra.extend(timing("5s", "2s"));
    let mill = start_mill(root.path(), "127.0.0.1:0", &extra, "info", 0);
    let _exec = start_ready_executor(root.path(), &mill, "x1", 4, &timing("5s", "2s"));

    // The limits as configured.
    let (s, q) = mill.api.get("/v1/quota");
    assert_eq!(s, 200, "{q}");
    assert_eq!(q["limits"]["defaults"]["owner"], json!({"jobs": 1}), "{q}");
    assert_eq!(q["limits"]["owner"]["bob"], json!({"jobs": 5}), "{q}");

    let gate = root.path().join("release-first");
    let first = mill.api.submit(&json!({
        "command": held_until(&gate), "owner": "alice", "repo": "alice/app",
    }));
    mill.api.wait_state(first, |s| s == "running", "running");
    let second = mill.api.submit(&json!({
        "command": "echo second", "owner": "alice", "repo": "alice/app",
    }));
    let waiting = wait_for("the second job to wait for quota", || {
        let v = mill.api.job(second)?;
        let w = v["waiting"].as_str()?.to_string();
        w.starts_with("waiting for quota").then_some((w, v))
    });
    let (text, status) = waiting;
    assert_eq!(status["state"], "queued", "{status}");
    assert!(
        text.contains("owner \"alice\" jobs 1/1 in use (asks 1)"),
        "{text}"
    );
    assert_eq!(
        status["quota_wait"],
        json!({"kind": "limit", "scope": "owner", "name": "alice", "resource": "jobs",
               "used": 1, "asks": 1, "limit": 1}),
        "{status}"
    );

    // Another owner is not held up by alice's limit.
    let other = mill
        .api
        .submit(&json!({"command": "echo other", "owner": "bob"}));
    assert_eq!(mill.api.wait_done(other)["state"], "success");

    let (s, q) = mill.api.get("/v1/quota");
    assert_eq!(s, 200, "{q}");
    assert_eq!(q["waiters_total"], 1, "{q}");
    assert_eq!(q["waiters_truncated"], false, "{q}");
    let w = &q["waiters"][0];
    assert_eq!(w["job"], second, "{q}");
    assert_eq!(
        (&w["owner"], &w["repo"]),
        (&json!("alice"), &json!("alice/app"))
    );
    assert_eq!(w["asks"]["jobs"], 1, "{q}");
    assert_eq!(w["blocked"]["kind"], "limit", "{q}");
    assert_eq!(w["blocked"]["name"], "alice", "{q}");
    let alice = q["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["kind"] == "owner" && s["name"] == "alice")
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(alice["used"]["jobs"], 1, "{q}");
    assert_eq!(alice["limits"]["jobs"], 1, "{q}");
    assert_eq!(alice["waiting"], 1, "{q}");
    let (s, cut) = mill.api.get("/v1/quota?limit=1");
    assert_eq!(s, 200, "{cut}");
    assert_eq!(cut["scopes"].as_array().map(Vec::len), Some(1), "{cut}");
    assert_eq!(cut["scopes_truncated"], true, "{cut}");
    let (s, bad) = mill.api.get("/v1/quota?limit=0");
    assert_eq!((s, &bad["field"]), (400, &json!("limit")), "{bad}");
    let (s, bad) = mill.api.get("/v1/quota?owner=alice");
    assert_eq!((s, &bad["field"]), (400, &json!("owner")), "{bad}");
    let (s, _) = mill.api.get_raw("/v1/quota", false);
    assert_eq!(s, 401, "the token is required");

    // The CLI says the same.
    let (ok, table) = cli(&mill, &["quota"]);
    assert!(ok, "{table}");
    assert!(table.contains("WAITING FOR QUOTA"), "{table}");
    assert!(
        table.contains(&format!("{second:>8}  alice")),
        "the waiter's row: {table}"
    );
    assert!(
        table.contains("owner \"alice\" jobs 1/1 in use (asks 1)"),
        "{table}"
    );
    let (ok, shown) = cli(&mill, &["status", &second.to_string()]);
    assert!(ok, "{shown}");
    assert!(shown.contains("waiting for quota: owner"), "{shown}");

    // The holder ends: the waiter is granted (Q2) and runs; nothing stays held (Q3).
    std::fs::write(&gate, "").unwrap();
    assert_eq!(mill.api.wait_done(first)["state"], "success");
    let done = mill.api.wait_done(second);
    assert_eq!(done["state"], "success", "{done}");
    assert!(done.get("quota_wait").is_none(), "{done}");
    let q = wait_for("the ledger to be empty", || {
        let (s, q) = mill.api.get("/v1/quota");
        (s == 200 && q["scopes_total"] == 0).then_some(q)
    });
    assert_eq!(q["waiters_total"], 0, "{q}");
}

/// Runs `millrace ARGS…` and waits (bounded) for it to exit; its status and stderr. A
/// process still running at the bound is killed and fails the test: a bad config must stop
/// the start.
fn run_to_exit(args: &[String]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(common::BIN)
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("millrace {args:?} did not exit on a bad config");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    (status, err)
}

/// Issue 13 item 5: an unknown key, a bad amount, a zero, a bad resource or scope name and a
/// missing file each stop `mill` and `standalone` with a non-zero exit, naming the file,
/// the key path and the value, before anything listens (no address file, no store).
#[test]
fn a_bad_config_stops_mill_and_standalone_before_they_listen_naming_the_key() {
    let root = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &[&str]); 6] = [
        (
            "unknown-key",
            "[quota.owners.\"alice\"]\njobs = 1\n",
            &["quota.owners", "unknown field `owners`"],
        ),
        (
            "negative",
            "[quota.defaults.owner]\njobs = 10\n[quota.owner.\"alice\"]\njobs = -3\n",
            &[
                ":4: quota.owner.\"alice\".jobs: must be a positive integer",
                "got -3",
            ],
        ),
        (
            "zero",
            "[quota.defaults.repo]\njobs = 0\n",
            &["quota.defaults.repo.jobs", "got 0"],
        ),
        (
            "text",
            "[quota.repo.\"org/big\"]\njobs = \"many\"\n",
            &["quota.repo.\"org/big\".jobs", "got \"many\""],
        ),
        (
            "resource-name",
            "[quota.defaults.owner]\n\"cpu millis\" = 4\n",
            &["quota.defaults.owner.\"cpu millis\"", "resource name"],
        ),
        (
            "scope-name",
            "[quota.owner.\"\"]\njobs = 1\n",
            &["quota.owner.\"\"", "owner name"],
        ),
    ];
    for (name, text, expect) in cases {
        let file = root.path().join(format!("{name}.toml"));
        std::fs::write(&file, text).unwrap();
        for cmd in ["mill", "standalone"] {
            let data = root.path().join(format!("{cmd}-{name}"));
            let args = strings(&[
                cmd,
                "--config",
                file.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--http-listen",
                "127.0.0.1:0",
                "--executor-listen",
                "127.0.0.1:0",
            ]);
            let (status, err) = run_to_exit(&args);
            assert!(!status.success(), "{cmd} {name}: exited 0: {err}");
            assert!(
                err.contains(&format!("--config {}", file.display())),
                "{cmd} {name}: the file is not named: {err}"
            );
            for part in expect {
                assert!(err.contains(part), "{cmd} {name}: {part:?} missing: {err}");
            }
            assert!(
                !data.join("addr.json").exists() && !data.join("mill.db").exists(),
                "{cmd} {name}: it started before checking the config"
            );
        }
    }
    let missing = root.path().join("missing.toml");
    let (status, err) = run_to_exit(&strings(&[
        "mill",
        "--config",
        missing.to_str().unwrap(),
        "--data",
        root.path().join("m").to_str().unwrap(),
    ]));
    assert!(!status.success(), "{err}");
    assert!(err.contains("cannot open"), "{err}");
}

/// `--config` is listed by `mill --help` and `standalone --help`.
#[test]
fn help_lists_the_config_flag() {
    for cmd in ["mill", "standalone"] {
        let out = Command::new(common::BIN)
            .args([cmd, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("--config <FILE>"), "{cmd}: {help}");
    }
}
