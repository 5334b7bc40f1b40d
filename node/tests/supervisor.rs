//! Job supervision with real processes (issue 12; DESIGN E9, E14): jobs outlive a killed
//! executor under their supervisors, are re-adopted by a restarted one, and never outlive
//! `reconnect_grace` + stop grace when no executor of their epoch comes back — `setsid`
//! children included.
//!
//! Every wait polls with a generous cap (`common::TIMEOUT`); nothing asserts speed. Job
//! executions are counted from per-execution marker files (I1).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::path::{Path, PathBuf};

use common::{
    marker_cmd, read_markers, start_executor, strings, timing, wait_for, Mill, Proc, Rng,
};
use serde_json::{json, Value};

/// A mill whose executors lose their leases after `grace`.
fn start_mill(root: &Path, grace: &str) -> Mill {
    let mut extra = strings(&["--bid-timeout", "1s"]);
    extra.extend(timing(grace, "1s"));
    let n = std::fs::read_dir(root).map(|d| d.count()).unwrap_or(0);
    common::start_mill(root, "127.0.0.1:0", &extra, "info", n)
}

/// Executor `x1` with `seats` shell seats whose supervisors keep jobs for `grace` alone.
fn start_exec(root: &Path, mill: &Mill, seats: u32, grace: &str) -> Proc {
    let tok = mill.data.join("token");
    start_executor(
        root,
        &mill.addrs.executor,
        "x1",
        seats,
        &tok,
        &timing(grace, "1s"),
    )
}

fn pid_alive(pid: i32) -> bool {
    // A zombie is dead for our purposes: nothing of it runs.
    stat_field(pid, 0).is_some_and(|state| state != "Z" && state != "X")
}

/// Field `i` after the command name in /proc/<pid>/stat (0 = state, 1 = ppid, 3 = session).
fn stat_field(pid: i32, i: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(i).map(str::to_string)
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn kill_pid(pid: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// A job that starts a `setsid` child (its own session: out of the job's process group and
/// session) and then waits; both record their pids.
fn escaping_job(root: &Path) -> (String, PathBuf, PathBuf) {
    let child = root.join("child.pid");
    let shell = root.join("shell.pid");
    let cmd = format!(
        "setsid sh -c 'echo $$ > {c}; exec sleep 300' & echo $$ > {s}; sleep 300",
        c = child.display(),
        s = shell.display()
    );
    (cmd, child, shell)
}

/// Waits for both pids of an [`escaping_job`] and checks that the child really left the
/// job's session (else the test would prove nothing about `setsid`).
fn escaping_pids(child: &Path, shell: &Path) -> (i32, i32) {
    let c = wait_for("the setsid child's pid", || read_pid(child));
    let s = wait_for("the job shell's pid", || read_pid(shell));
    assert!(pid_alive(c) && pid_alive(s));
    let (cs, ss) = (stat_field(c, 3).unwrap(), stat_field(s, 3).unwrap());
    assert_ne!(cs, ss, "the child must run in a session of its own");
    (c, s)
}

/// The exit records the supervisors of `node` left in its data directory.
fn exit_records(root: &Path, node: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(root.join(node).join("jobs")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("exit.json")).ok())
        .collect()
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// E9/E14: kill -9 the executor mid-job and restart it on the same data: the job is
/// adopted, not failed; it completes once and is recorded with its real status.
#[test]
fn e9_e14_killed_executor_restarted_adopts_its_job_which_completes_once() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "10s");
    let mut x = start_exec(root.path(), &mill, 2, "10s");
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let gate = root.path().join("gate");
    let starts = root.path().join("starts");
    let ends = root.path().join("ends");
    let id = mill.api.submit(&json!({
        "command": format!(
            "echo run >> {s}; while [ ! -e {g} ]; do sleep 0.05; done; echo after-the-restart; echo run >> {e}",
            s = starts.display(), g = gate.display(), e = ends.display()
        ),
    }));
    mill.api.wait_state(id, |s| s == "running", "running");
    wait_for("the job to start", || (lines(&starts) == 1).then_some(()));
    x.kill9();
    let x = start_exec(root.path(), &mill, 2, "10s");
    wait_for("the restarted executor", || {
        mill.api.ready("x1").then_some(())
    });
    std::fs::write(&gate, b"").unwrap();
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "success", "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(lines(&starts), 1, "started once");
    assert_eq!(lines(&ends), 1, "completed once");
    let (_, log) = mill.api.get_raw(&format!("/v1/jobs/{id}/log"), true);
    assert!(log.contains("after-the-restart"), "{log:?}");
    assert!(
        x.logs().contains("attached to the job's supervisor"),
        "{}",
        x.logs()
    );
}

/// E9/E14: a job that ends while its executor is down is reported, after the restart,
/// with the status its supervisor recorded (not "executor restarted").
#[test]
fn e9_e14_a_job_that_ended_while_the_executor_was_down_reports_its_real_status() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "10s");
    let mut x = start_exec(root.path(), &mill, 2, "10s");
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let gate = root.path().join("gate");
    let started = root.path().join("started");
    let id = mill.api.submit(&json!({
        "command": format!(
            "touch {}; while [ ! -e {} ]; do sleep 0.05; done; echo bye; exit 3",
            started.display(),
            gate.display()
        ),
    }));
    // The job runs (a committed lease whose supervisor has not started it yet would be
    // lost with the executor: nothing ran).
    wait_for("the job to start", || started.exists().then_some(()));
    x.kill9();
    std::fs::write(&gate, b"").unwrap();
    wait_for("the supervisor's exit record", || {
        (!exit_records(root.path(), "x1").is_empty()).then_some(())
    });
    let x = start_exec(root.path(), &mill, 2, "10s");
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "failed", "{v}");
    let supervisors: Vec<String> = std::fs::read_dir(root.path().join("x1").join("jobs"))
        .map(|d| {
            d.flatten()
                .map(|e| {
                    let log = std::fs::read_to_string(e.path().join("supervisor.log"));
                    format!("{:?}: {log:?}", e.path())
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        v["exit_code"],
        3,
        "{v}\nexecutor:\n{}\nmill:\n{}\nsupervisors: {supervisors:?}",
        x.logs(),
        mill.proc.logs()
    );
    assert_eq!(v["error"], "exit status 3", "{v}");
}

/// E14: kill -9 the executor and never restart it: within `reconnect_grace` + stop grace
/// its supervisor stops the job, `setsid` child included, and records why.
#[test]
fn e14_killed_executor_never_restarted_leaves_no_job_process_setsid_child_included() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "2s");
    let mut x = start_exec(root.path(), &mill, 1, "2s");
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let (cmd, child, shell) = escaping_job(root.path());
    let id = mill.api.submit(&json!({ "command": cmd }));
    mill.api.wait_state(id, |s| s == "running", "running");
    let (c, s) = escaping_pids(&child, &shell);
    x.kill9();
    wait_for("every process of the job to be gone", || {
        (!pid_alive(c) && !pid_alive(s)).then_some(())
    });
    // The record follows once the job's log is closed.
    let records = wait_for("the supervisor's exit record", || {
        let r = exit_records(root.path(), "x1");
        (!r.is_empty()).then_some(r)
    });
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(records[0].contains("NoExecutor"), "{records:?}");
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "failed", "{v}");
    kill_pid(c);
    kill_pid(s);
}

/// E1/E14: restart with a wiped store (a new epoch) on the same data directory: the old
/// epoch's supervisor is told so and stops its job, `setsid` child included; the mill
/// ends the job "executor lost".
#[test]
fn e14_restart_with_a_wiped_store_stops_the_old_epochs_jobs() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "3s");
    let mut x = start_exec(root.path(), &mill, 1, "30s");
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let (cmd, child, shell) = escaping_job(root.path());
    let id = mill.api.submit(&json!({ "command": cmd }));
    mill.api.wait_state(id, |s| s == "running", "running");
    let (c, s) = escaping_pids(&child, &shell);
    x.kill9();
    for f in ["executor.db", "executor.db-wal", "executor.db-shm"] {
        let _ = std::fs::remove_file(root.path().join("x1").join(f));
    }
    let _x = start_exec(root.path(), &mill, 1, "30s");
    // Far sooner than the 30 s grace: the new epoch's executor tells the supervisor.
    wait_for("every process of the old epoch's job to be gone", || {
        (!pid_alive(c) && !pid_alive(s)).then_some(())
    });
    let records = wait_for("the supervisor's exit record", || {
        let r = exit_records(root.path(), "x1");
        (!r.is_empty()).then_some(r)
    });
    assert!(
        records.iter().any(|r| r.contains("ForeignEpoch")),
        "{records:?}"
    );
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "failed", "{v}");
    assert!(
        v["error"].as_str().unwrap().starts_with("executor lost"),
        "{v}"
    );
    kill_pid(c);
    kill_pid(s);
}

/// E7/E14: a cancel stops the job's whole tree, a `setsid` child included.
#[test]
fn e14_cancel_kills_a_setsid_child_too() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "5s");
    let _x = start_exec(root.path(), &mill, 1, "5s");
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let (cmd, child, shell) = escaping_job(root.path());
    let id = mill.api.submit(&json!({ "command": cmd }));
    mill.api.wait_state(id, |s| s == "running", "running");
    let (c, s) = escaping_pids(&child, &shell);
    let (status, v) = mill
        .api
        .post(&format!("/v1/jobs/{id}/cancel"), r#"{"reason": "test"}"#);
    assert_eq!(status, 202, "{v}");
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "cancelled", "{v}");
    wait_for("the job's tree to be gone", || {
        (!pid_alive(c) && !pid_alive(s)).then_some(())
    });
    kill_pid(c);
    kill_pid(s);
}

/// E9/E14/I1: a rolling restart (SIGTERM with no drain wait, then the next process at once,
/// as an upgrade does) repeated while 50 short jobs run: none fails, none runs twice.
#[test]
fn e9_i1_rolling_executor_restarts_during_fifty_jobs_fail_none_and_double_none() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "10s");
    let markers = root.path().join("markers");
    std::fs::create_dir_all(&markers).unwrap();
    let exec = |n: usize| {
        let tok = mill.data.join("token");
        let data = root.path().join("x1");
        let mut args = strings(&[
            "executor",
            "--mill",
            &mill.addrs.executor,
            "--node-id",
            "x1",
            "--engine",
            "shell:4",
            "--data",
            data.to_str().unwrap(),
            "--token-file",
            tok.to_str().unwrap(),
            "--backoff-min",
            "50ms",
            "--backoff-max",
            "300ms",
            "--stop-grace",
            "1s",
            "--drain-timeout",
            "0s",
        ]);
        args.extend(timing("10s", "1s"));
        Proc::spawn(&args, root.path().join(format!("x1-{n}.log")), "info")
    };
    let mut x = exec(0);
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let mut rng = Rng::new(0x5eed_0012);
    let ids: Vec<u64> = (0..50u64)
        .map(|i| {
            let ms = rng.range(200, 900);
            let cmd = format!(
                "{}; sleep 0.{ms:03}; {}",
                marker_cmd(&markers, i, "start"),
                marker_cmd(&markers, i, "end")
            );
            mill.api.submit(&json!({ "command": cmd }))
        })
        .collect();
    let done = |api: &common::Api| {
        ids.iter()
            .filter(|id| {
                api.job(**id).is_some_and(|v| {
                    !matches!(v["state"].as_str(), Some("queued" | "reserved" | "running"))
                })
            })
            .count()
    };
    let mut restarts = 0;
    while done(&mill.api) < ids.len() && restarts < 12 {
        // Let some jobs start, then restart mid-flight.
        wait_for("a job to be running", || {
            let running = ids
                .iter()
                .any(|id| mill.api.job(*id).is_some_and(|v| v["state"] == "running"));
            (running || done(&mill.api) == ids.len()).then_some(())
        });
        let status = x.term();
        assert!(status.success(), "executor exit {status:?}: {}", x.logs());
        restarts += 1;
        x = exec(restarts);
    }
    assert!(restarts >= 3, "only {restarts} restarts happened mid-run");
    let jobs: Vec<Value> = ids.iter().map(|id| mill.api.wait_done(*id)).collect();
    let failed: Vec<&Value> = jobs.iter().filter(|v| v["state"] != "success").collect();
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    let seen = read_markers(&markers);
    assert_eq!(seen.len(), ids.len(), "every job ran");
    for (job, m) in &seen {
        assert_eq!(
            m.starts.len(),
            1,
            "job {job} started {} times",
            m.starts.len()
        );
        assert_eq!(m.ends.len(), 1, "job {job} ended {} times", m.ends.len());
    }
    let adopted: usize = (0..=restarts)
        .map(|n| {
            std::fs::read_to_string(root.path().join(format!("x1-{n}.log")))
                .unwrap_or_default()
                .matches("adopted=true")
                .count()
        })
        .sum();
    assert!(
        adopted > 0,
        "no restart adopted a running job: the test proved nothing"
    );
    eprintln!(
        "rolling restarts: {restarts} restarts, {adopted} adoptions, 50 jobs, 0 failed, 0 doubled"
    );
}

/// A runtime directory for `--runtime-dir` (issue 15): on tmpfs where there is one, so the
/// test runs the layout users are told to use.
fn runtime_dir(root: &Path) -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() { shm } else { root };
    tempfile::Builder::new()
        .prefix("millrace-test-run-")
        .tempdir_in(base)
        .unwrap()
}

/// A runtime directory, a mill, executor flags naming that directory, and executor `x1` on
/// them, ready.
fn runtime_setup(root: &Path) -> (tempfile::TempDir, Mill, Vec<String>, Proc) {
    let run = runtime_dir(root);
    let mill = start_mill(root, "10s");
    let mut flags = timing("10s", "1s");
    flags.extend(strings(&["--runtime-dir", run.path().to_str().unwrap()]));
    let tok = mill.data.join("token");
    let x = start_executor(root, &mill.addrs.executor, "x1", 2, &tok, &flags);
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    (run, mill, flags, x)
}

/// The one supervisor directory under `dir/jobs`.
fn only_job_dir(dir: &Path) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(dir.join("jobs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found.into_iter().next().unwrap()
}

/// E9/E14 with `--runtime-dir` (issue 15): the supervisor's socket and pid file live in the
/// runtime directory, none of them on the data disk. A job that ends while its executor is
/// down has its record made durable on the data disk; a "reboot" that empties the runtime
/// directory loses nothing: the restarted executor reports the job's real status.
#[test]
fn e14_runtime_dir_a_job_that_ended_while_its_executor_was_down_survives_a_reboot() {
    let root = tempfile::tempdir().unwrap();
    let (run, mill, flags, mut x) = runtime_setup(root.path());
    let tok = mill.data.join("token");
    let gate = root.path().join("gate");
    let started = root.path().join("started");
    let runs = root.path().join("runs");
    let id = mill.api.submit(&json!({
        "command": format!(
            "echo run >> {r}; touch {s}; while [ ! -e {g} ]; do sleep 0.05; done; echo bye; exit 3",
            r = runs.display(),
            s = started.display(),
            g = gate.display()
        ),
    }));
    wait_for("the job to start", || started.exists().then_some(()));
    let sup_dir = only_job_dir(run.path());
    assert!(sup_dir.join("sock").exists() && sup_dir.join("supervisor.pid").exists());
    let lease = sup_dir.file_name().unwrap().to_owned();
    let on_disk = root.path().join("x1").join("jobs").join(&lease);
    assert!(
        !on_disk.exists(),
        "nothing of a running job's supervisor on the data disk"
    );
    let sup_pid = read_pid(&sup_dir.join("supervisor.pid")).unwrap();
    x.kill9();
    std::fs::write(&gate, b"").unwrap();
    wait_for("the durable exit record on the data disk", || {
        on_disk.join("exit.json").exists().then_some(())
    });
    wait_for("the supervisor to exit", || {
        (!pid_alive(sup_pid)).then_some(())
    });
    // The reboot: tmpfs comes back empty.
    std::fs::remove_dir_all(run.path().join("jobs")).unwrap();
    let x = start_executor(root.path(), &mill.addrs.executor, "x1", 2, &tok, &flags);
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "failed", "{v}");
    assert_eq!(v["exit_code"], 3, "{v}\nexecutor:\n{}", x.logs());
    assert_eq!(v["error"], "exit status 3", "{v}");
    assert_eq!(lines(&runs), 1, "ran once");
    wait_for(
        "the durable record to go once the terminal is stored",
        || (!on_disk.exists()).then_some(()),
    );
}

/// E9/E14/I1 with `--runtime-dir` (issue 15): an executor restarted with another runtime
/// directory than the one its running supervisors are in would not find them, take the
/// job for lost and have it run again: it refuses to start and names both directories.
/// Restarted with the right one, it adopts the job, which completes once.
#[test]
fn e14_runtime_dir_a_change_while_a_supervisor_runs_is_refused_and_the_job_runs_once() {
    let root = tempfile::tempdir().unwrap();
    let (run, mill, flags, mut x) = runtime_setup(root.path());
    let tok = mill.data.join("token");
    let gate = root.path().join("gate");
    let starts = root.path().join("starts");
    let ends = root.path().join("ends");
    let id = mill.api.submit(&json!({
        "command": format!(
            "echo run >> {s}; while [ ! -e {g} ]; do sleep 0.05; done; echo run >> {e}",
            s = starts.display(), g = gate.display(), e = ends.display()
        ),
    }));
    wait_for("the job to start", || (lines(&starts) == 1).then_some(()));
    x.kill9();
    // Without the flag: refused, naming the setting and both places.
    let mut wrong = start_executor(
        root.path(),
        &mill.addrs.executor,
        "x1",
        2,
        &tok,
        &timing("10s", "1s"),
    );
    let status = wrong.wait_exit();
    assert!(!status.success(), "{status:?}");
    let logs = wrong.logs();
    assert!(
        logs.contains("--runtime-dir") && logs.contains(run.path().to_str().unwrap()),
        "{logs}"
    );
    let x = start_executor(root.path(), &mill.addrs.executor, "x1", 2, &tok, &flags);
    wait_for("the restarted executor", || {
        mill.api.ready("x1").then_some(())
    });
    std::fs::write(&gate, b"").unwrap();
    let v = mill.api.wait_done(id);
    assert_eq!(v["state"], "success", "{v}\nexecutor:\n{}", x.logs());
    assert_eq!(lines(&starts), 1, "started once");
    assert_eq!(lines(&ends), 1, "completed once");
}

/// The parent of the supervisor of the job that wrote `file` (its line: the supervisor's
/// ppid, read by the job from /proc).
fn supervisors_parent(file: &Path) -> i32 {
    wait_for("the job's report of its supervisor's parent", || {
        read_pid(file)
    })
}

fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Zombie children of `parent`.
fn zombies_of(parent: i32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            stat_field(pid, 0).as_deref() == Some("Z")
                && stat_field(pid, 1).and_then(|p| p.parse().ok()) == Some(parent)
        })
        .collect()
}

/// E14 with the supervisor zygote (issue 15 target 3): supervisors are forked by one
/// long-lived `supervise --zygote`, which reaps them when they end. Killing the zygote
/// costs nothing: the next job's supervisor is exec'd as before, and the one after is
/// forked by a new zygote. Every job runs once and succeeds.
#[test]
fn e14_zygote_forks_supervisors_reaps_them_and_a_killed_zygote_is_replaced() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "10s");
    let _x = start_exec(root.path(), &mill, 2, "10s");
    wait_for("the executor", || mill.api.ready("x1").then_some(()));
    let runs = root.path().join("runs");
    let job = |n: u32| {
        let report = root.path().join(format!("parent-{n}"));
        let id = mill.api.submit(&json!({
            "command": format!(
                "echo {n} >> {r}; sed 's/.*) //' /proc/$PPID/stat | cut -d' ' -f2 > {p}.tmp && mv {p}.tmp {p}",
                r = runs.display(),
                p = report.display()
            ),
        }));
        let v = mill.api.wait_done(id);
        assert_eq!(v["state"], "success", "{v}");
        supervisors_parent(&report)
    };
    let zygote = job(1);
    assert!(
        cmdline(zygote).contains("supervise --zygote"),
        "pid {zygote}: {:?}",
        cmdline(zygote)
    );
    wait_for("the zygote to reap the ended supervisor", || {
        zombies_of(zygote).is_empty().then_some(())
    });
    kill_pid(zygote);
    wait_for("the zygote to be gone", || {
        (!pid_alive(zygote)).then_some(())
    });
    let second = job(2);
    assert!(
        !cmdline(second).contains("--zygote"),
        "the job after the zygote died is exec'd by the executor: {:?}",
        cmdline(second)
    );
    let third = job(3);
    assert!(
        third != zygote && cmdline(third).contains("supervise --zygote"),
        "a new zygote forks again: pid {third} {:?}",
        cmdline(third)
    );
    assert_eq!(
        std::fs::read_to_string(&runs).unwrap(),
        "1\n2\n3\n",
        "each job ran once"
    );
}
