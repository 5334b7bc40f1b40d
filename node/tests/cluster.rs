//! Integration tests with real `millrace` processes on loopback (issue 5, item 10).
//!
//! Short timers come in through flags; every wait polls the HTTP API (or a store file) with
//! a bounded deadline — nothing sleeps in place of synchronisation.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::io::Read;
use std::path::Path;
use std::process::Command;

use common::{addrs, start_executor, strings, timing, wait_for, Api, Mill, Proc, BIN, TIMEOUT};
use serde_json::json;

/// Starts a mill whose executors lose their leases after `grace`; waits until it listens.
fn start_mill(root: &Path, grace: &str, executor_listen: &str) -> Mill {
    let mut extra = strings(&["--bid-timeout", "1s"]);
    extra.extend(timing(grace, "1s"));
    let n = std::fs::read_dir(root).map(|d| d.count()).unwrap_or(0);
    common::start_mill(root, executor_listen, &extra, "info", n)
}

/// Starts executor `node` with `labels` and `seats` shell seats, dialling `mill`.
fn start_exec(
    root: &Path,
    mill: &Mill,
    node: &str,
    labels: &str,
    seats: u32,
    grace: &str,
    token_file: &Path,
) -> Proc {
    let mut extra = strings(&["--labels", labels]);
    extra.extend(timing(grace, "1s"));
    start_executor(root, &mill.addrs.executor, node, seats, token_file, &extra)
}

fn pid_alive(pid: i32) -> bool {
    // A zombie (state Z) is dead for our purposes: nothing runs.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn kill_pid(pid: Option<i32>) {
    if let Some(p) = pid {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// (a) standalone runs 20 shell jobs to success and serves their logs; the CLI's
/// `submit --wait` works; `/metrics` is valid Prometheus text; `/health` needs no token.
#[test]
fn a_standalone_runs_twenty_jobs_and_serves_their_logs() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("sa");
    let args = strings(&[
        "standalone",
        "--data",
        data.to_str().unwrap(),
        "--http-listen",
        "127.0.0.1:0",
        "--executor-listen",
        "127.0.0.1:0",
        "--engine",
        "shell:4",
    ]);
    let mut sa = Proc::spawn(&args, root.path().join("sa.log"), "info");
    let addrs = addrs(&data, sa.pid());
    let api = Api::new(&addrs.http, &common::api_token(&data));
    let (s, _) = api.get_raw("/health", false);
    assert_eq!(s, 200);
    let (s, body) = api.get_raw("/v1/jobs", false);
    assert_eq!(s, 401, "{body}");

    let ids: Vec<u64> = (0..20)
        .map(|i| api.submit(&json!({"command": format!("echo out-{i}; echo err-{i} >&2")})))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        let v = api.wait_done(*id);
        assert_eq!(v["state"], "success", "{v}");
        assert_eq!(v["exit_code"], 0);
        let hash = v["log"]["hash"].as_str().unwrap();
        assert!(hash.starts_with("sha256:") && hash.len() == 71, "{hash}");
        let (s, log) = api.get_raw(&format!("/v1/jobs/{id}/log"), true);
        assert_eq!(s, 200);
        assert!(
            log.contains(&format!("out-{i}\n")),
            "log of job {id}: {log:?}"
        );
        assert!(
            log.contains(&format!("err-{i}\n")),
            "log of job {id}: {log:?}"
        );
    }
    let (s, list) = api.get("/v1/jobs?state=success&limit=100");
    assert_eq!(s, 200);
    assert_eq!(list["jobs"].as_array().unwrap().len(), 20);

    // The CLI, as the README shows it.
    let out = Command::new(BIN)
        .args([
            "submit",
            "--server",
            &addrs.http,
            "--data",
            data.to_str().unwrap(),
            "--wait",
            "--",
            "echo",
            "hello",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    let out = Command::new(BIN)
        .args([
            "submit",
            "--server",
            &addrs.http,
            "--data",
            data.to_str().unwrap(),
            "--wait",
            "--",
            "exit 4",
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(4),
        "--wait exits with the job's own code (issue 13 item 6): {out:?}"
    );

    // /metrics parses as Prometheus text and counts what happened.
    let (s, text) = api.get_raw("/metrics", true);
    assert_eq!(s, 200);
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    let value = |name: &str, label: Option<(&str, &str)>| -> f64 {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
            .unwrap_or_else(|| panic!("no sample {name} {label:?} in\n{text}"))
    };
    assert_eq!(
        value("millrace_placements_total", Some(("result", "placed"))),
        22.0
    );
    assert_eq!(
        value("millrace_jobs_finished_total", Some(("status", "success"))),
        21.0
    );
    assert_eq!(
        value("millrace_jobs_finished_total", Some(("status", "failed"))),
        1.0
    );
    assert_eq!(
        value("millrace_sessions", Some(("state", "connected"))),
        1.0
    );
    assert_eq!(value("millrace_leases", Some(("state", "running"))), 0.0);
    assert!(value("millrace_events_applied_total", None) >= 44.0);
    assert!(scrape
        .samples
        .iter()
        .any(|s| s.metric == "millrace_placement_latency_seconds"
            && matches!(s.value, prometheus_parse::Value::Histogram(_))));
    for (name, kind) in [
        ("millrace_placements_total", "counter"),
        ("millrace_placement_latency_seconds", "histogram"),
        ("millrace_sessions", "gauge"),
        ("millrace_leases", "gauge"),
        ("millrace_events_applied_total", "counter"),
        ("millrace_violations_total", "counter"),
        ("millrace_quota_usage", "gauge"),
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} {kind}")),
            "{name} {kind}"
        );
    }
    assert!(sa.term().success(), "{}", sa.logs());
}

/// (b) mill + 2 executors; `kill -9` one mid-job: its job fails after grace, the other's
/// jobs succeed.
#[test]
fn b_killed_executor_fails_its_jobs_after_grace_the_other_succeeds() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "2s", "127.0.0.1:0");
    let tok = mill.data.join("token");
    let mut x1 = start_exec(root.path(), &mill, "x1", "a", 2, "2s", &tok);
    let _x2 = start_exec(root.path(), &mill, "x2", "b", 2, "2s", &tok);
    wait_for("both executors", || {
        (mill.api.ready("x1") && mill.api.ready("x2")).then_some(())
    });
    let pidfile = root.path().join("a.pid");
    let a = mill.api.submit(&json!({
        "command": format!("echo $$ > {}; exec sleep 60", pidfile.display()),
        "labels": ["a"],
    }));
    mill.api.wait_state(a, |s| s == "running", "running");
    wait_for("the job's pid", || read_pid(&pidfile));
    let bs: Vec<u64> = (0..4)
        .map(|_| {
            mill.api
                .submit(&json!({"command": "sleep 0.2; echo ok", "labels": ["b"]}))
        })
        .collect();
    x1.kill9();
    let v = mill.api.wait_done(a);
    assert_eq!(v["state"], "failed", "{v}");
    assert_eq!(v["cause"], "executor_lost", "{v}");
    for b in bs {
        let v = mill.api.wait_done(b);
        assert_eq!(v["state"], "success", "{v}");
        assert_eq!(v["node"], "x2");
    }
    kill_pid(read_pid(&pidfile));
}

/// (c) restart the mill mid-job: the running job is claimed and ends with its real status.
#[test]
fn c_mill_restart_mid_job_keeps_the_real_status() {
    let root = tempfile::tempdir().unwrap();
    let mut mill = start_mill(root.path(), "5s", "127.0.0.1:0");
    let tok = mill.data.join("token");
    let _x = start_exec(root.path(), &mill, "x1", "", 2, "5s", &tok);
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let gate = root.path().join("gate");
    let id = mill.api.submit(&json!({
        "command": format!("while [ ! -e {} ]; do sleep 0.05; done; echo finished; exit 3", gate.display()),
    }));
    mill.api.wait_state(id, |s| s == "running", "running");
    let exec_addr = mill.addrs.executor.clone();
    mill.proc.kill9();
    // The job ends while the mill is down; its terminal waits in the executor's outbox.
    std::fs::write(&gate, b"").unwrap();
    let mill = start_mill(root.path(), "5s", &exec_addr);
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "failed", "{v}");
    assert_eq!(v["exit_code"], 3, "{v}");
    assert_eq!(v["error"], "exit status 3", "{v}");
    // The restarted mill places new work too.
    let next = mill.api.submit(&json!({"command": "true"}));
    assert_eq!(mill.api.wait_done(next)["state"], "success");
}

/// (d) restart an executor with its store intact mid-job: a result that finished before it
/// died (unacked, the mill was frozen) arrives; the job that was running is adopted through
/// its supervisor (E9, E14) and ends with its own status, its process gone.
#[test]
fn d_executor_restart_delivers_finished_results_and_adopts_the_running_job() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "5s", "127.0.0.1:0");
    let tok = mill.data.join("token");
    let mut x = start_exec(root.path(), &mill, "x1", "", 2, "5s", &tok);
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let gate = root.path().join("gate");
    let pidfile = root.path().join("b.pid");
    let a = mill.api.submit(&json!({
        "command": format!("while [ ! -e {} ]; do sleep 0.05; done; echo a-done", gate.display()),
    }));
    let gate_b = root.path().join("gate-b");
    let b = mill.api.submit(&json!({
        "command": format!(
            "echo $$ > {}; while [ ! -e {} ]; do sleep 0.05; done; exit 4",
            pidfile.display(),
            gate_b.display()
        ),
    }));
    mill.api.wait_state(a, |s| s == "running", "running");
    mill.api.wait_state(b, |s| s == "running", "running");
    let b_pid = wait_for("job b's pid", || read_pid(&pidfile));
    // Freeze the mill so nothing gets acked, let job a finish, and wait until its terminal
    // is in the executor's durable outbox (the job left the store's job table).
    mill.proc.signal(nix::sys::signal::Signal::SIGSTOP);
    std::fs::write(&gate, b"").unwrap();
    let db = root.path().join("x1").join("executor.db");
    wait_for("job a's terminal in the executor's outbox", || {
        let conn =
            rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .ok()?;
        let jobs: i64 = conn
            .query_row("SELECT COUNT(*) FROM jobs", [], |r| r.get(0))
            .ok()?;
        let outbox: i64 = conn
            .query_row("SELECT COUNT(*) FROM outbox", [], |r| r.get(0))
            .ok()?;
        (jobs == 1 && outbox >= 1).then_some(())
    });
    x.kill9();
    mill.proc.signal(nix::sys::signal::Signal::SIGCONT);
    let _x = start_exec(root.path(), &mill, "x1", "", 2, "5s", &tok);
    let va = mill.api.wait_done(a);
    assert_eq!(va["state"], "success", "{va}");
    assert_eq!(va["exit_code"], 0, "{va}");
    assert!(pid_alive(b_pid), "job b runs on under its supervisor");
    std::fs::write(&gate_b, b"").unwrap();
    let vb = mill.api.wait_done(b);
    assert_eq!(vb["state"], "failed", "{vb}");
    assert_eq!(vb["exit_code"], 4, "{vb}");
    assert_eq!(vb["error"], "exit status 4", "{vb}");
    assert_eq!(
        vb["cause"], "reported",
        "the adopted job's own end (E14): {vb}"
    );
    wait_for("job b's process to be killed", || {
        (!pid_alive(b_pid)).then_some(())
    });
}

/// (e) an executor with a wrong token is refused; both sides log the reason.
#[test]
fn e_wrong_token_is_refused_and_logged_on_both_sides() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "2s", "127.0.0.1:0");
    let bad = root.path().join("bad-token");
    std::fs::write(&bad, "not-the-token\n").unwrap();
    let x = start_exec(root.path(), &mill, "intruder", "", 1, "2s", &bad);
    wait_for("the refusal in the executor's log", || {
        x.logs()
            .contains("the mill refused this executor")
            .then_some(())
    });
    // Refused before it reaches the mill driver (issue 11: tokenless peers cost no session).
    wait_for("the refusal in the mill's log", || {
        mill.proc
            .logs()
            .contains("token not accepted")
            .then_some(())
    });
    let (_, text) = mill.api.get_raw("/metrics", true);
    assert!(
        !text.contains("millrace_preauth_rejected_total{reason=\"token\"} 0\n"),
        "{text}"
    );
    assert!(!mill.api.ready("intruder"));

    // Item 3: a frame over the limit, or a malformed one, closes that connection only.
    let good = start_exec(
        root.path(),
        &mill,
        "honest",
        "",
        1,
        "2s",
        &mill.data.join("token"),
    );
    wait_for("the honest executor", || {
        mill.api.ready("honest").then_some(())
    });
    for bytes in [
        vec![0xff, 0xff, 0xff, 0xff, 1, 2, 3],
        vec![0, 0, 0, 3, 0xee, 0xee, 0xee],
    ] {
        let mut s = std::net::TcpStream::connect(&mill.addrs.executor).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        std::io::Write::write_all(&mut s, &bytes).unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        assert_eq!(
            n, 0,
            "the mill should close a connection that sent {bytes:?}"
        );
    }
    assert!(mill.api.ready("honest"));
    let id = mill.api.submit(&json!({"command": "true"}));
    assert_eq!(mill.api.wait_done(id)["state"], "success");
    drop(good);
}

/// (f) malformed HTTP bodies get 400 naming the field; unknown jobs 404; ended jobs 409.
#[test]
fn f_malformed_bodies_get_400_naming_the_field() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "2s", "127.0.0.1:0");
    for (body, field) in [
        ("{}", "command"),
        (r#"{"command": 3}"#, "command"),
        (r#"{"command": ""}"#, "command"),
        (r#"{"command": "x", "labels": "a"}"#, "labels"),
        (r#"{"command": "x", "labels": ["has space"]}"#, "labels"),
        (r#"{"command": "x", "timeout_secs": 0}"#, "timeout_secs"),
        (r#"{"command": "x", "resources": {"cpu": 0}}"#, "resources"),
        (r#"{"command": "x", "owner": ""}"#, "owner"),
        (r#"{"command": "x", "colour": "red"}"#, "colour"),
        ("{not json", "body"),
    ] {
        let (s, v) = mill.api.post("/v1/jobs", body);
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["field"], field, "{body}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let huge = format!(r#"{{"command": "{}"}}"#, "x".repeat(600 * 1024));
    let (s, v) = mill.api.post("/v1/jobs", &huge);
    assert_eq!((s, v["field"].as_str()), (413, Some("body")), "{v}");
    let (s, v) = mill.api.get("/v1/jobs/999");
    assert_eq!(s, 404, "{v}");
    let (s, v) = mill.api.get("/v1/jobs?state=bogus");
    assert_eq!((s, v["field"].as_str()), (400, Some("state")), "{v}");
    let (s, v) = mill.api.post("/v1/jobs/999/cancel", "{}");
    assert_eq!(s, 404, "{v}");
    // No executor: the job queues; cancelling it ends it, a second cancel conflicts.
    let id = mill.api.submit(&json!({"command": "true"}));
    let (s, v) = mill.api.post(&format!("/v1/jobs/{id}/cancel"), "{}");
    assert_eq!(s, 202, "{v}");
    assert_eq!(mill.api.wait_done(id)["state"], "cancelled");
    let (s, v) = mill.api.post(&format!("/v1/jobs/{id}/cancel"), "{}");
    assert_eq!(s, 409, "{v}");
    let (s, v) = mill.api.post("/v1/nodes/nobody/quarantine/lift", "");
    assert_eq!(s, 409, "{v}");
}

/// (g) cancelling a running job kills its whole process group.
#[test]
fn g_cancel_kills_the_whole_process_group() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "2s", "127.0.0.1:0");
    let tok = mill.data.join("token");
    let _x = start_exec(root.path(), &mill, "x1", "", 1, "2s", &tok);
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let child = root.path().join("child.pid");
    let shell = root.path().join("sh.pid");
    let id = mill.api.submit(&json!({
        "command": format!(
            "sleep 300 & echo $! > {c}; echo $$ > {s}; wait",
            c = child.display(),
            s = shell.display()
        ),
    }));
    mill.api.wait_state(id, |s| s == "running", "running");
    let child_pid = wait_for("the background child's pid", || read_pid(&child));
    let shell_pid = wait_for("the shell's pid", || read_pid(&shell));
    assert!(pid_alive(child_pid) && pid_alive(shell_pid));
    let (s, v) = mill
        .api
        .post(&format!("/v1/jobs/{id}/cancel"), r#"{"reason": "test"}"#);
    assert_eq!(s, 202, "{v}");
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "cancelled", "{v}");
    wait_for("the whole group to be gone", || {
        (!pid_alive(child_pid) && !pid_alive(shell_pid)).then_some(())
    });
}

/// Item 4: a store held by another live process is refused, naming the path.
#[test]
fn store_held_by_a_live_process_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "2s", "127.0.0.1:0");
    let out = Command::new(BIN)
        .args([
            "mill",
            "--data",
            mill.data.to_str().unwrap(),
            "--executor-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let mut err = String::new();
    out.stderr.as_slice().read_to_string(&mut err).unwrap();
    assert!(err.contains("held by another live process"), "{err}");
    assert!(err.contains("mill.db"), "{err}");
}

/// Item 8: SIGTERM drains an executor — its running job finishes and its result reaches the
/// mill before it exits cleanly — and stops the mill cleanly.
#[test]
fn h_sigterm_drains_the_executor_and_stops_the_mill_cleanly() {
    let root = tempfile::tempdir().unwrap();
    let mut mill = start_mill(root.path(), "2s", "127.0.0.1:0");
    let tok = mill.data.join("token");
    let mut x = start_exec(root.path(), &mill, "x1", "", 1, "2s", &tok);
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let id = mill
        .api
        .submit(&json!({"command": "sleep 0.5; echo drained"}));
    mill.api.wait_state(id, |s| s == "running", "running");
    let status = x.term();
    assert!(status.success(), "executor exit {status:?}: {}", x.logs());
    // The result was acked before the executor exited (the outbox is flushed in a drain).
    let v = mill.api.job(id).expect("the job is known");
    assert_eq!(v["state"], "success", "{v}");
    let (_, log) = mill.api.get_raw(&format!("/v1/jobs/{id}/log"), true);
    assert!(log.contains("drained"), "{log:?}");
    let status = mill.proc.term();
    assert!(
        status.success(),
        "mill exit {status:?}: {}",
        mill.proc.logs()
    );
    assert!(mill.proc.logs().contains("mill store closed"));
}
