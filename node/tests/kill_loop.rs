//! "No job runs twice", proved with real processes (issue 10, item 9; DESIGN I1, I2, I3, M29).
//!
//! Every job appends a marker line per execution (`start`/`end`, its index, lease and pid) to
//! a file named by its job id, so executions are counted from what really ran, not from what
//! the mill believes. Two tests:
//! - the kill loop: one mill, two executors, a few hundred short shell jobs submitted while the
//!   mill is killed at seeded pseudo-random moments, alternating SIGKILL and SIGTERM, and
//!   restarted on the same `--data` each time;
//! - the delayed proxy: an in-test TCP proxy between executor and mill holds one direction
//!   from a chosen message on, so the kill lands exactly between `CommitLease` leaving the
//!   mill and the executor's `CommitResult`/`Running` reaching it.
//!
//! Nothing asserts speed; waits poll with generous bounds.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    read_markers, start_executor, start_mill, strings, timing, wait_for, wait_for_within, Api,
    Markers, Rng,
};
use serde_json::{json, Value};

/// The mill logs its rare paths (M29's restored published leases) at debug.
const MILL_LOG: &str = "info,millrace::mill_driver=debug";

fn mill_flags(grace: &str, silence: &str) -> Vec<String> {
    let mut f = timing(grace, silence);
    f.extend(strings(&["--bid-timeout", "1s"]));
    f
}

fn idx_of(command: &str) -> Option<u64> {
    command
        .strip_prefix(": idx=")?
        .split(';')
        .next()?
        .parse()
        .ok()
}

/// The exit code job `idx` was given: every fifth fails with 3, so a recorded result can be
/// told apart from a made-up one (I3).
fn exit_of(idx: u64) -> i32 {
    if idx.is_multiple_of(5) {
        3
    } else {
        0
    }
}

fn count_in_logs(root: &Path, prefix: &str, needle: &str) -> usize {
    std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            name.starts_with(prefix)
                .then(|| std::fs::read_to_string(e.path()).unwrap_or_default())
        })
        .map(|t| t.matches(needle).count())
        .sum()
}

/// Restored leases over every restart, from the mill's "restoring" log lines.
fn restored_leases(root: &Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        if !name.starts_with("mill-") {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for line in text.lines().filter(|l| l.contains("restoring the mill")) {
            if let Some(rest) = line.split(" leases=").nth(1) {
                n += rest
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    n
}

/// What the kill loop found, job by job.
#[derive(Debug, Default)]
struct Tally {
    jobs: usize,
    executions: usize,
    doubles: Vec<(u64, Markers)>,
    lost: Vec<u64>,
    not_ended: Vec<Value>,
    wrong_result: Vec<(Value, Markers)>,
    never_ran: Vec<Value>,
    orphan_markers: Vec<u64>,
}

fn tally(jobs: &[Value], accepted: &[(u64, u64)], markers: &BTreeMap<u64, Markers>) -> Tally {
    let mut t = Tally {
        jobs: jobs.len(),
        executions: markers.values().map(|m| m.starts.len()).sum(),
        ..Tally::default()
    };
    let by_id: BTreeMap<u64, &Value> = jobs
        .iter()
        .map(|j| (j["id"].as_u64().unwrap(), j))
        .collect();
    for (_, id) in accepted {
        if !by_id.contains_key(id) {
            t.lost.push(*id);
        }
    }
    for id in markers.keys() {
        if !by_id.contains_key(id) {
            t.orphan_markers.push(*id);
        }
    }
    let empty = Markers::default();
    for (id, job) in &by_id {
        let m = markers.get(id).unwrap_or(&empty);
        let idx = idx_of(job["command"].as_str().unwrap()).unwrap();
        if m.starts.len() > 1 {
            t.doubles.push((*id, m.clone()));
        }
        if job["done"] != true {
            t.not_ended.push((*job).clone());
            continue;
        }
        if m.starts.is_empty() {
            t.never_ran.push((*job).clone());
            continue;
        }
        // One execution that finished: the recorded result is that execution's, under its lease.
        let expected_state = if exit_of(idx) == 0 {
            "success"
        } else {
            "failed"
        };
        let ok = m.starts.len() == 1
            && m.ends.len() == 1
            && m.starts[0].idx == idx
            && m.ends[0] == m.starts[0]
            && job["state"] == expected_state
            && job["exit_code"] == exit_of(idx)
            && job["lease"] == m.starts[0].lease;
        if !ok {
            t.wrong_result.push(((*job).clone(), m.clone()));
        }
    }
    t
}

/// I1/I2/I3 under fire: the mill is killed ≥ 10 times (alternating SIGKILL and SIGTERM, at
/// seeded moments) and restarted on its store while ≥ 300 jobs flow over two executors.
/// Every accepted job ends, each ran exactly once, and its recorded result is the one its
/// single execution produced. `KILL_LOOP_SEED`, `KILL_LOOP_KILLS`, `KILL_LOOP_JOBS` override.
#[test]
fn i1_mill_kill_loop_runs_no_job_twice_and_loses_none() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let seed = env("KILL_LOOP_SEED", 0x6d69_6c6c);
    let kills = env("KILL_LOOP_KILLS", 16);
    let min_jobs = usize::try_from(env("KILL_LOOP_JOBS", 320)).unwrap();
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let markers = root.join("markers");
    std::fs::create_dir_all(&markers).unwrap();
    let flags = mill_flags("15s", "3s");
    let mut mill = start_mill(root, "127.0.0.1:0", &flags, MILL_LOG, 0);
    let exec_addr = mill.addrs.executor.clone();
    let tok = mill.data.join("token");
    let token = common::api_token(&mill.data);
    let xflags = timing("15s", "3s");
    let _x1 = start_executor(root, &exec_addr, "x1", 4, &tok, &xflags);
    let _x2 = start_executor(root, &exec_addr, "x2", 4, &tok, &xflags);
    wait_for("both executors", || {
        (mill.api.ready("x1") && mill.api.ready("x2")).then_some(())
    });

    // The submitter: a steady flow, a fresh index per attempt (a retried submit whose first
    // answer was lost must not share its index with a job that was stored after all).
    let http: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(Some(mill.addrs.http.clone())));
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let submitter = {
        let (http, stop, markers, token) = (http.clone(), stop.clone(), markers.clone(), token);
        let answered = answered.clone();
        std::thread::spawn(move || {
            let mut rng = Rng::new(seed ^ 0x5u64);
            let mut accepted: Vec<(u64, u64)> = Vec::new();
            let mut refused = 0usize;
            let mut idx = 0u64;
            let mut api: Option<Api> = None;
            while !(stop.load(Ordering::SeqCst) && accepted.len() >= min_jobs) {
                let base = http.lock().unwrap().clone();
                let Some(base) = base else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                if api.as_ref().is_none_or(|a| a.base != base) {
                    api = Some(Api::new(&base, &token));
                }
                idx += 1;
                let cmd = common::marker_job(&markers, idx, rng.range(20, 150), exit_of(idx));
                match api.as_ref().unwrap().try_submit(&json!({ "command": cmd })) {
                    Some(id) => {
                        accepted.push((idx, id));
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                    None => {
                        refused += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                std::thread::sleep(Duration::from_millis(rng.range(5, 25)));
            }
            (accepted, refused)
        })
    };

    let mut rng = Rng::new(seed);
    let (mut sigkills, mut sigterms) = (0, 0);
    for cycle in 0..kills {
        // A seeded moment: the mill has been up a while (placing, committing, applying
        // events), then a job was accepted and the kill follows within a few milliseconds,
        // while that job's placement (ReserveSeat, Reserved persisted, CommitLease,
        // CommitResult) is likely in flight.
        // Every fourth kill instead lands early, while the restarted mill is still
        // recovering: executors redialling, snapshots and outbox replays in flight, restored
        // leases unclaimed (M29, M8).
        if cycle % 4 == 3 {
            std::thread::sleep(Duration::from_millis(rng.range(0, 250)));
        } else {
            std::thread::sleep(Duration::from_millis(rng.range(150, 1000)));
            let seen = answered.load(Ordering::SeqCst);
            wait_for("a submit to be accepted", || {
                (answered.load(Ordering::SeqCst) > seen).then_some(())
            });
            std::thread::sleep(Duration::from_micros(rng.range(0, 15_000)));
        }
        *http.lock().unwrap() = None;
        if cycle % 2 == 0 {
            mill.proc.kill9();
            sigkills += 1;
        } else {
            let status = mill.proc.term();
            assert!(
                status.success(),
                "mill exit {status:?} after SIGTERM: {}",
                mill.proc.logs()
            );
            assert!(
                mill.proc.logs().contains("mill store closed"),
                "{}",
                mill.proc.logs()
            );
            sigterms += 1;
        }
        mill = start_mill(
            root,
            &exec_addr,
            &flags,
            MILL_LOG,
            usize::try_from(cycle + 1).unwrap(),
        );
        *http.lock().unwrap() = Some(mill.addrs.http.clone());
    }
    stop.store(true, Ordering::SeqCst);
    let (accepted, refused) = submitter.join().unwrap();

    wait_for_within("every job to end", Duration::from_secs(240), || {
        let (s, v) = mill.api.get("/v1/jobs?state=active&limit=1");
        (s == 200 && v["jobs"].as_array().is_some_and(|a| a.is_empty())).then_some(())
    });
    let jobs = common::all_jobs(&mill.api);
    let markers = read_markers(&markers);
    let t = tally(&jobs, &accepted, &markers);
    let published = count_in_logs(root, "mill-", "RestartWithPublishedLeases");
    let restored = restored_leases(root);
    println!(
        "kill loop (seed {seed:#x}): {sigkills} SIGKILL + {sigterms} SIGTERM restarts; \
         {} submits accepted, {refused} refused or unanswered; {} jobs stored; {} executions; \
         {restored} leases restored over all restarts, {published} restarts with published \
         (reserved) leases; double executions: {}; lost: {}; not ended: {}; wrong result: {}; \
         ended without running: {}; markers of unknown jobs: {}",
        accepted.len(),
        t.jobs,
        t.executions,
        t.doubles.len(),
        t.lost.len(),
        t.not_ended.len(),
        t.wrong_result.len(),
        t.never_ran.len(),
        t.orphan_markers.len(),
    );
    assert!(accepted.len() >= min_jobs);
    assert!(
        t.doubles.is_empty(),
        "I1: jobs executed more than once: {:?}",
        t.doubles
    );
    assert!(
        t.lost.is_empty(),
        "accepted jobs the mill no longer has: {:?}",
        t.lost
    );
    assert!(
        t.not_ended.is_empty(),
        "jobs that never ended: {:?}",
        t.not_ended
    );
    assert!(
        t.wrong_result.is_empty(),
        "I2/I3: recorded results that are not their execution's: {:?}",
        t.wrong_result
    );
    assert!(
        t.never_ran.is_empty(),
        "jobs that ended without running (no executor was lost, so none may): {:?}",
        t.never_ran
    );
    assert!(t.orphan_markers.is_empty(), "{:?}", t.orphan_markers);
}

/// An in-test TCP proxy between executors and the mill. Once armed with a trap, the first
/// frame matching it, and every later frame in that direction of that connection, is held
/// (never delivered): as if the network delayed it past the mill's death.
mod proxy {
    use std::sync::{Arc, Mutex};

    use millrace_core::codec::{decode, PREFIX_LEN};
    use millrace_core::wire::{ToExecutor, ToMill};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// Which message starts a hold.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Trap {
        /// The executor's `CommitResult` (and everything after it) never reaches the mill.
        CommitResultToMill,
        /// The mill's `CommitLease` (and everything after it) never reaches the executor.
        CommitLeaseToExecutor,
    }

    #[derive(Debug, Default)]
    struct State {
        armed: Option<Trap>,
        fired: usize,
        held: usize,
    }

    pub struct Proxy {
        pub addr: String,
        state: Arc<Mutex<State>>,
    }

    impl Proxy {
        pub fn start(rt: &tokio::runtime::Runtime, upstream: String) -> Proxy {
            let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let state = Arc::new(Mutex::new(State::default()));
            let st = state.clone();
            rt.spawn(async move {
                loop {
                    let Ok((down, _)) = listener.accept().await else {
                        continue;
                    };
                    tokio::spawn(relay(down, upstream.clone(), st.clone()));
                }
            });
            Proxy { addr, state }
        }

        pub fn arm(&self, trap: Trap) {
            self.state.lock().unwrap().armed = Some(trap);
        }

        /// Frames held so far (0 until the trap fired).
        pub fn held(&self) -> usize {
            let s = self.state.lock().unwrap();
            if s.fired > 0 {
                s.held
            } else {
                0
            }
        }
    }

    async fn relay(down: TcpStream, upstream: String, state: Arc<Mutex<State>>) {
        // The mill may be down: closing the executor's side makes it back off and redial.
        let Ok(up) = TcpStream::connect(&upstream).await else {
            return;
        };
        let _ = down.set_nodelay(true);
        let _ = up.set_nodelay(true);
        let (dr, dw) = down.into_split();
        let (ur, uw) = up.into_split();
        tokio::select! {
            () = pump(dr, uw, true, state.clone()) => {}
            () = pump(ur, dw, false, state) => {}
        }
        // Dropping both halves closes both sockets; held frames are lost with them.
    }

    async fn pump(
        mut rd: tokio::net::tcp::OwnedReadHalf,
        mut wr: tokio::net::tcp::OwnedWriteHalf,
        to_mill: bool,
        state: Arc<Mutex<State>>,
    ) {
        let mut holding = false;
        loop {
            let mut prefix = [0u8; PREFIX_LEN];
            if rd.read_exact(&mut prefix).await.is_err() {
                return;
            }
            let len = usize::try_from(u32::from_be_bytes(prefix)).unwrap();
            let mut body = vec![0u8; len];
            if rd.read_exact(&mut body).await.is_err() {
                return;
            }
            let matches = |trap: Trap| match trap {
                Trap::CommitResultToMill => {
                    to_mill
                        && matches!(
                            decode::<ToMill>(&body),
                            Ok(ToMill::CommitResult {
                                committed: true,
                                ..
                            })
                        )
                }
                Trap::CommitLeaseToExecutor => {
                    !to_mill
                        && matches!(
                            decode::<ToExecutor>(&body),
                            Ok(ToExecutor::CommitLease { .. })
                        )
                }
            };
            {
                let mut s = state.lock().unwrap();
                if !holding && s.armed.is_some_and(matches) {
                    s.armed = None;
                    s.fired += 1;
                    holding = true;
                }
                if holding {
                    s.held += 1;
                    continue;
                }
            }
            if wr.write_all(&prefix).await.is_err() || wr.write_all(&body).await.is_err() {
                return;
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kill {
    Sigkill,
    Sigterm,
}

/// One deterministic case: a gated job, the proxy holding one side of its commit, the mill
/// killed while the hold is on, then restarted. The job must run once and end with its own
/// result. `finish_while_down`: the gate opens while the mill is down (the result waits in
/// the executor's outbox); otherwise it opens once the restarted mill has claimed the lease.
fn held_commit_case(trap: proxy::Trap, kill: Kill, finish_while_down: bool) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let markers = root.join("markers");
    std::fs::create_dir_all(&markers).unwrap();
    let gate = root.join("gate");
    // Silence timeouts well above the few hundred ms the held direction stays quiet.
    let flags = mill_flags("10s", "5s");
    let mut mill = start_mill(root, "127.0.0.1:0", &flags, MILL_LOG, 0);
    let exec_addr = mill.addrs.executor.clone();
    let proxy = proxy::Proxy::start(&rt, exec_addr.clone());
    let tok = mill.data.join("token");
    let _x = start_executor(root, &proxy.addr, "x1", 1, &tok, &timing("10s", "5s"));
    wait_for("the executor", || mill.api.ready("x1").then_some(()));

    proxy.arm(trap);
    // The wait also ends when the test's directory is gone, so a failed test leaves no
    // shell looping behind it.
    let command = format!(
        ": idx=1; {}; while [ ! -e {} ] && [ -d {} ]; do sleep 0.02; done; {}; exit 0",
        common::marker_cmd(&markers, 1, "start"),
        gate.display(),
        markers.display(),
        common::marker_cmd(&markers, 1, "end"),
    );
    let id = mill.api.try_submit(&json!({ "command": command })).unwrap();
    wait_for("the proxy to hold the commit", || {
        (proxy.held() > 0).then_some(())
    });
    let started = || {
        read_markers(&markers)
            .get(&id)
            .map_or(0, |m| m.starts.len())
    };
    if trap == proxy::Trap::CommitResultToMill {
        // The executor got CommitLease and runs the job; the mill has not heard so.
        wait_for("the job to start on the executor", || {
            (started() == 1).then_some(())
        });
    }
    let v = mill.api.job(id).unwrap();
    assert_eq!(
        v["state"], "reserved",
        "the kill must land before the mill hears of the commit: {v}"
    );
    match kill {
        Kill::Sigkill => mill.proc.kill9(),
        Kill::Sigterm => {
            let status = mill.proc.term();
            assert!(status.success(), "{}", mill.proc.logs());
        }
    }
    if trap == proxy::Trap::CommitLeaseToExecutor {
        assert_eq!(started(), 0, "the executor never received the commit");
    }
    if finish_while_down {
        std::fs::write(&gate, b"").unwrap();
        if trap == proxy::Trap::CommitResultToMill {
            wait_for("the job to finish while the mill is down", || {
                let m = read_markers(&markers);
                (m.get(&id).map_or(0, |m| m.ends.len()) == 1).then_some(())
            });
        }
    }
    let mill = start_mill(root, &exec_addr, &flags, MILL_LOG, 1);
    if !finish_while_down {
        mill.api
            .wait_state(id, |s| s == "running", "running (claimed)");
        std::fs::write(&gate, b"").unwrap();
    }
    let v = mill.api.wait_done(id);
    let m = read_markers(&markers).remove(&id).unwrap_or_default();
    println!(
        "held {trap:?}, {kill:?}, finish while down {finish_while_down}: job {id} ended {} \
         after {} execution(s); restarts with published leases: {}",
        v["state"],
        m.starts.len(),
        count_in_logs(root, "mill-", "RestartWithPublishedLeases"),
    );
    assert_eq!(m.starts.len(), 1, "I1: job {id} executed {m:?}; {v}");
    assert_eq!(m.ends.len(), 1, "{m:?}");
    assert_eq!(v["state"], "success", "I3: {v}");
    assert_eq!(
        v["lease"], m.starts[0].lease,
        "I2: the result is its execution's: {v}"
    );
    let leases: BTreeSet<u64> = m.starts.iter().map(|s| s.lease).collect();
    assert_eq!(leases.len(), 1);
}

/// M29 + E4: the executor runs the job, its CommitResult is in flight when the mill dies
/// (SIGKILL); the restarted mill claims the lease from the executor's snapshot instead of
/// queueing the job again.
#[test]
fn i1_commit_result_in_flight_at_sigkill_is_claimed_not_rerun() {
    held_commit_case(proxy::Trap::CommitResultToMill, Kill::Sigkill, false);
}

/// M29 + I3: as above with SIGTERM, and the job finishes while the mill is down: its result
/// arrives from the outbox after the restart and is the one recorded.
#[test]
fn i1_commit_result_in_flight_at_sigterm_result_recorded_after_restart() {
    held_commit_case(proxy::Trap::CommitResultToMill, Kill::Sigterm, true);
}

/// M29: the CommitLease never reached the executor before the mill died; the restarted mill
/// either claims the reserved seat (commit re-sent) or releases it and places the job again —
/// either way it runs once.
#[test]
fn m29_commit_lease_lost_at_sigkill_runs_once() {
    held_commit_case(proxy::Trap::CommitLeaseToExecutor, Kill::Sigkill, false);
}
