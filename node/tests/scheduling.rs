//! Issue 13 items 2–4 through the real binary on loopback: a job whose executor is killed is
//! retried on another node once its first run is surely stopped (M32, I1); an owner's queue
//! goes by priority (M33); a pinned job runs only on its node and says why it waits (M34);
//! resources an executor declares are enforced, so three whole-machine jobs run one at a
//! time (M34, E2). Jobs leave markers in files; every assertion is about counts and order,
//! never wall-clock durations, and every wait polls with a bound.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{cli, start_mill, start_ready_executor, strings, timing, wait_for, Mill, Proc, BIN};
use serde_json::json;

fn mill(root: &Path, extra: &[&str]) -> Mill {
    let mut args = strings(extra);
    args.extend(timing("3s", "2s"));
    start_mill(root, "127.0.0.1:0", &args, "info", 0)
}

fn executor(root: &Path, mill: &Mill, node: &str, seats: u32, extra: &[&str]) -> Proc {
    let mut args = timing("3s", "2s");
    args.extend(strings(extra));
    start_ready_executor(root, mill, node, seats, &args)
}

/// A shell snippet that blocks until the test creates `dir/go`.
fn gate(dir: &Path) -> String {
    format!("while [ ! -e {}/go ]; do sleep 0.05; done", dir.display())
}

fn open_gate(dir: &Path) {
    std::fs::write(dir.join("go"), b"").unwrap();
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// M32, I1: a job with `retries: 1` whose executor is killed -9 mid-run is retried on the
/// other node; the retry starts only after the first run's process is gone (the job itself
/// checks, with `kill -0`, and leaves an `overlap` marker if not), and status lists both
/// attempts with their nodes and causes.
#[test]
fn m32_a_job_whose_executor_is_killed_is_retried_on_another_node_once_its_run_is_stopped() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("marks");
    std::fs::create_dir_all(&dir).unwrap();
    let m = mill(root.path(), &["--retry-fence", "2s"]);
    let mut x1 = executor(root.path(), &m, "x1", 1, &[]);
    let d = dir.display();
    // First run: note its pid, then run "forever". A later run: check the first is gone.
    let command = format!(
        "if [ -e {d}/first.pid ]; then \
           kill -0 $(cat {d}/first.pid) 2>/dev/null && echo overlap >> {d}/overlap; \
           echo \"retry $MILLRACE_LEASE_ID\" >> {d}/runs; \
         else \
           echo $$ > {d}/first.pid; echo \"first $MILLRACE_LEASE_ID\" >> {d}/runs; \
           sleep 1000; \
         fi"
    );
    let id = m.api.submit(&json!({"command": command, "retries": 1}));
    let running = m.api.wait_state(id, |s| s == "running", "running");
    assert_eq!(running["node"], "x1", "{running}");
    wait_for("the first run's pid", || {
        dir.join("first.pid").exists().then_some(())
    });
    let _x2 = executor(root.path(), &m, "x2", 1, &[]);
    x1.kill9();

    let done = m.api.wait_done(id);
    assert_eq!(done["state"], "success", "{done}");
    assert_eq!(
        done["node"], "x2",
        "the retry ran on the surviving node: {done}"
    );
    assert!(
        !dir.join("overlap").exists(),
        "the retry started while the first run's process was alive (I1)"
    );
    let runs = lines(&dir.join("runs"));
    assert_eq!(runs.len(), 2, "one first run and one retry: {runs:?}");
    assert!(runs[0].starts_with("first ") && runs[1].starts_with("retry "));
    assert_ne!(runs[0][6..], runs[1][6..], "each attempt has its own lease");

    let attempts = done["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{done}");
    assert_eq!(attempts[0]["node"], "x1", "{done}");
    assert_eq!(attempts[1]["node"], "x2", "{done}");
    let first = attempts[0].to_string();
    assert!(
        first.contains("executor_lost"),
        "the first attempt ended by the lost executor: {first}"
    );
}

/// M33: with the only seat busy, an owner's waiting jobs go by priority (higher first), then
/// submit order.
#[test]
fn m33_an_owners_waiting_jobs_run_by_priority_then_submit_order() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("marks");
    std::fs::create_dir_all(&dir).unwrap();
    let m = mill(root.path(), &[]);
    let _x1 = executor(root.path(), &m, "x1", 1, &[]);
    let blocker = m.api.submit(&json!({"command": gate(&dir), "owner": "a"}));
    m.api.wait_state(blocker, |s| s == "running", "running");
    let order = dir.join("order");
    let mut ids = Vec::new();
    for (tag, priority) in [("p0-first", 0), ("p5", 5), ("p0-second", 0), ("p1", 1)] {
        let cmd = format!("echo {tag} >> {}", order.display());
        ids.push(
            m.api
                .submit(&json!({"command": cmd, "owner": "a", "priority": priority})),
        );
    }
    // Through the CLI as well: `--priority` reaches the spec.
    let out = cli(
        &m,
        &[
            "submit",
            "--owner",
            "a",
            "--priority",
            "3",
            "--",
            &format!("echo p3 >> {}", order.display()),
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let cli_id: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    ids.push(cli_id);
    assert_eq!(m.api.job(cli_id).unwrap()["priority"], 3);
    open_gate(&dir);
    for id in ids {
        let v = m.api.wait_done(id);
        assert_eq!(v["state"], "success", "{v}");
    }
    assert_eq!(
        lines(&order),
        ["p5", "p3", "p1", "p0-first", "p0-second"],
        "M33: priority first, then submit order"
    );
}

/// M34: a pinned job runs only on its node, through the API and `submit --node`; one pinned
/// to a node that is not connected waits and says so, and can be cancelled; a bad node name
/// is a 400 naming the field.
#[test]
fn m34_a_pinned_job_runs_only_on_its_node_and_says_why_it_waits() {
    let root = tempfile::tempdir().unwrap();
    let m = mill(root.path(), &[]);
    let _x1 = executor(root.path(), &m, "x1", 2, &[]);
    let _x2 = executor(root.path(), &m, "x2", 2, &[]);
    let pinned: Vec<u64> = (0..6)
        .map(|_| m.api.submit(&json!({"command": "true", "node": "x2"})))
        .collect();
    for id in pinned {
        let v = m.api.wait_done(id);
        assert_eq!(v["state"], "success", "{v}");
        assert_eq!(v["node"], "x2", "M34: a pinned job runs on its node: {v}");
        assert_eq!(v["pinned"], "x2", "{v}");
    }

    let out = cli(
        &m,
        &[
            "submit",
            "--node",
            "x1",
            "--resource",
            "cpu=1",
            "--wait",
            "--",
            "echo pinned",
        ],
    );
    assert!(out.status.success(), "{out:?}");

    let (s, v) = m.api.post(
        "/v1/jobs",
        &json!({"command": "true", "node": "ghost"}).to_string(),
    );
    assert_eq!(s, 201, "{v}");
    let warning = v["warning"].as_str().unwrap_or_default();
    assert!(
        warning.contains("pinned to node ghost, which is not connected"),
        "{v}"
    );
    let ghost = v["id"].as_u64().unwrap();
    let status = m.api.job(ghost).unwrap();
    assert_eq!(status["state"], "queued", "{status}");
    assert!(
        status["waiting"]
            .as_str()
            .unwrap_or_default()
            .contains("ghost"),
        "{status}"
    );
    let (s, v) = m.api.post(&format!("/v1/jobs/{ghost}/cancel"), "{}");
    assert_eq!(s, 202, "{v}");
    assert_eq!(m.api.wait_done(ghost)["state"], "cancelled");

    let (s, v) = m.api.post(
        "/v1/jobs",
        &json!({"command": "true", "node": "no such node"}).to_string(),
    );
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["field"], "node", "{v}");
}

/// M34, E2: on an executor with 64 seats and `--resources cpu=64`, three `cpu: 64` jobs run
/// one at a time (each writes start and end markers; they never interleave), while a job
/// asking no cpu runs beside the first; a job asking for more than the executor has fails as
/// having no compatible executor; a bad `--resources` makes the executor exit naming the
/// flag.
#[test]
fn m34_three_whole_cpu_jobs_on_a_64_cpu_executor_run_one_at_a_time() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("marks");
    std::fs::create_dir_all(&dir).unwrap();
    let m = mill(root.path(), &[]);
    let _x1 = executor(root.path(), &m, "x1", 64, &["--resources", "cpu=64"]);
    let log = dir.join("cpu");
    let l = log.display();
    let whole = |first: bool| {
        format!(
            "echo \"start $MILLRACE_JOB_ID\" >> {l}; {}; sleep 0.2; echo \"end $MILLRACE_JOB_ID\" >> {l}",
            if first { gate(&dir) } else { "true".into() }
        )
    };
    let first = m
        .api
        .submit(&json!({"command": whole(true), "resources": {"cpu": 64}}));
    m.api.wait_state(first, |s| s == "running", "running");
    let rest: Vec<u64> = (0..2)
        .map(|_| {
            m.api
                .submit(&json!({"command": whole(false), "resources": {"cpu": 64}}))
        })
        .collect();
    // A job asking no cpu takes one of the 63 free seats while the first holds all the cpu.
    let small = m.api.submit(&json!({"command": "true"}));
    assert_eq!(m.api.wait_done(small)["state"], "success");
    for &id in &rest {
        let v = m.api.job(id).unwrap();
        assert_eq!(
            v["state"], "queued",
            "M34: no cpu is free while the first runs: {v}"
        );
    }
    open_gate(&dir);
    for id in std::iter::once(first).chain(rest.iter().copied()) {
        let v = m.api.wait_done(id);
        assert_eq!(v["state"], "success", "{v}");
    }
    let marks = lines(&log);
    assert_eq!(marks.len(), 6, "{marks:?}");
    for pair in marks.chunks(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            a.starts_with("start ") && b.starts_with("end ") && a[6..] == b[4..],
            "M34: the cpu:64 jobs interleaved: {marks:?}"
        );
    }

    let too_big = m
        .api
        .submit(&json!({"command": "true", "resources": {"cpu": 65}}));
    let v = m.api.wait_done(too_big);
    assert_eq!(v["state"], "failed", "{v}");
    assert_eq!(v["cause"], "no_compatible_executor", "{v}");

    let bad = Command::new(BIN)
        .args(["executor", "--node-id", "x9", "--resources", "cpu=0"])
        .arg("--data")
        .arg(root.path().join("x9"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--resources"), "{err}");
}
