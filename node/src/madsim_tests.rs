//! The production node under madsim (issue 16): a mill and three executors, each a simulated
//! node running the node's own start-up, drivers, group commit, TCP framing, connection
//! tasks, HTTP server and handlers — everything but the shell engine, which the simulated
//! one replaces (`sim_engine`), and the threads, which are tasks (`rt`). A client node
//! submits jobs over HTTP with idempotency keys and polls them; a fault task kills and
//! restarts nodes (stores kept, or an executor's wiped), stops them gracefully (SIGINT in
//! the middle of whatever commit runs), partitions and clogs links one way. From one seed.
//!
//! Checked at the end of every seed:
//! - every job ends (I9's promise, bounded in simulated time after the faults stop);
//! - I1: no job's engine starts twice anywhere in the fleet (no retry policy: M32);
//! - I2: one job per idempotency key, and a terminal once seen never changes;
//! - I3: a job whose engine run ended Success on an executor whose store was never wiped
//!   ends Success (every outage here is shorter than `reconnect_grace`);
//! - I11: a job whose cancel the mill accepted (a fifth of the short jobs, through the
//!   faults, and three two-minute jobs once the fleet healed) ends cancelled unless its engine
//!   ended on its own first, and on the healed fleet its run stops within the mill's
//!   `cancel_ack_timeout` plus the executor's stop grace;
//!
//! - determinism: each seed runs twice, each time in a fresh process; the second run checks
//!   every draw of madsim's RNG (and the simulated instant of each) against the first's log,
//!   and both must end with the same outcome hash. So a failing seed's replay (`SEED=S`) is
//!   the same run to the instant.
//!
//! Run: `RUSTFLAGS="--cfg madsim" cargo test -p node --bin millrace --target-dir
//! target/madsim madsim_` (`SEEDS=N` runs N seeds from 1; `SEED=S` replays one).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use madsim::rand::Rng;
use madsim::runtime::{Handle, NodeHandle, Runtime};
use millrace_core::job::TerminalStatus;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::cli::{Cli, Cmd};
use crate::clock::Clock;
use crate::node::{ExecOptions, MillOptions};
use crate::sim_engine;

const EXECUTORS: usize = 3;
/// How to rerun one seed (after `SEED=S`).
const REPLAY: &str = "RUSTFLAGS=\"--cfg madsim\" cargo test -p node --bin millrace --target-dir target/madsim madsim_ -- --nocapture";
const JOBS: usize = 24;
/// Jobs of two simulated minutes, submitted first: still running when the fleet heals, each is
/// cancelled then, on a connected fleet, where I11 bounds how long its run may go on.
const LONG_JOBS: usize = 3;
/// How long after the heal the long jobs are cancelled: every executor has redialled by then
/// (`--backoff-max 500ms`, `--silence-timeout 2s`).
const CANCEL_AFTER_HEAL: Duration = Duration::from_secs(5);
/// Jobs of two simulated minutes that the fault loop cancels and then kills the mill in the
/// commit after the mill handled the cancel: a cancel answered 202 must survive that (I11, M26).
/// Those the faults did not pick are cancelled with the long jobs.
const CRASH_CANCEL_JOBS: usize = 2;
const MILL_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const EXEC_PORT: u16 = 7071;
const HTTP_PORT: u16 = 8080;
const TOKEN: &str = "madsim-executor-token";
const API_TOKEN: &str = "madsim-api-token";
/// Faults are injected for this long, then the fleet heals.
const FAULT_TIME: Duration = Duration::from_secs(40);
/// After the heal every job must end within this (simulated) time.
const SETTLE: Duration = Duration::from_secs(300);
/// The fixed seeds CI runs.
const CI_SEEDS: u64 = 100;

fn exec_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 0, 10 + u8::try_from(i).unwrap_or(0))
}

/// The timer and retry flags of a small, fast cluster, parsed as a user would give them.
fn mill_options(data: &Path) -> MillOptions {
    let cli = Cli::try_parse_from([
        "millrace",
        "mill",
        "--data",
        &data.display().to_string(),
        "--reconnect-grace",
        "10s",
        "--silence-timeout",
        "2s",
        "--snapshot-interval",
        "500ms",
        "--bid-timeout",
        "1s",
    ])
    .unwrap();
    let Cmd::Mill(a) = cli.cmd else {
        unreachable!()
    };
    MillOptions {
        data: data.to_path_buf(),
        store: None,
        executor_listen: format!("0.0.0.0:{EXEC_PORT}"),
        http_listen: format!("0.0.0.0:{HTTP_PORT}"),
        token: TOKEN.into(),
        api_token: API_TOKEN.into(),
        timing: a.timing,
        tuning: a.tuning,
        tls: None,
        quota: Default::default(),
        ha: Default::default(),
    }
}

fn exec_options(data: &Path, i: usize) -> ExecOptions {
    let cli = Cli::try_parse_from([
        "millrace",
        "executor",
        "--node-id",
        &format!("x{i}"),
        "--data",
        &data.display().to_string(),
        "--reconnect-grace",
        "10s",
        "--silence-timeout",
        "2s",
        "--snapshot-interval",
        "500ms",
        "--backoff-max",
        "500ms",
        "--drain-timeout",
        "2s",
        "--resources",
        "cpu=64,memory_mb=65536",
    ])
    .unwrap();
    let Cmd::Executor(a) = cli.cmd else {
        unreachable!()
    };
    ExecOptions {
        mill: format!("{MILL_IP}:{EXEC_PORT}"),
        node_id: format!("x{i}"),
        labels: Vec::new(),
        engine: "shell:4".into(),
        data: data.to_path_buf(),
        token: TOKEN.into(),
        timing: a.timing,
        tuning: a.tuning,
        tls: None,
    }
}

/// One HTTP/1.1 exchange over a fresh simulated connection: (status, body).
async fn http(method: &str, path: &str, key: Option<&str>, body: &str) -> Option<(u16, String)> {
    let addr = SocketAddr::new(IpAddr::V4(MILL_IP), HTTP_PORT);
    let exchange = async {
        let mut s = match tokio::net::TcpStream::connect(addr).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "client connect failed");
                return None;
            }
        };
        let key = key
            .map(|k| format!("Idempotency-Key: {k}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: mill\r\nAuthorization: Bearer {API_TOKEN}\r\n{key}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.ok()?;
        s.flush().await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text.split(' ').nth(1)?.parse::<u16>().ok()?;
        let body = text.split_once("\r\n\r\n")?.1.to_string();
        Some((status, body))
    };
    let r = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()
        .flatten();
    tracing::debug!(method, path, answer = ?r, "client request");
    r
}

/// Cancels a job through the API until the mill answers: 202 (accepted, recorded with the
/// time), or 409 (it had ended). Gives up after [`SETTLE`].
async fn cancel_job(key: &str, id: u64, accepted: &Mutex<Vec<(String, u64, Instant)>>) {
    let give_up = Instant::now() + SETTLE;
    while Instant::now() < give_up {
        match http("POST", &format!("/v1/jobs/{id}/cancel"), None, "").await {
            Some((202, _)) => {
                accepted.lock().unwrap_or_else(|e| e.into_inner()).push((
                    key.to_string(),
                    id,
                    Instant::now(),
                ));
                return;
            }
            Some((409, _)) => return,
            _ => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

/// What a seed ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    /// Per idempotency key: (job id, final state, exit code).
    jobs: BTreeMap<String, (u64, String, Option<i64>)>,
    /// Engine starts in the fleet.
    starts: usize,
    /// Faults injected, by kind.
    faults: BTreeMap<&'static str, u32>,
    /// Cancels the mill accepted (202), by key: simulated milliseconds since the start.
    cancels: BTreeMap<String, u64>,
    /// What failed, if anything.
    violations: Vec<String>,
    /// Simulated time the seed took.
    simulated: Duration,
}

impl Outcome {
    fn hash(&self) -> u64 {
        // FNV-1a over the debug form: stable across runs of one build.
        let text = format!(
            "{:?}|{}|{:?}|{:?}|{:?}|{:?}",
            self.jobs, self.starts, self.faults, self.cancels, self.violations, self.simulated
        );
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

fn root_for(seed: u64) -> PathBuf {
    std::env::temp_dir().join(format!("millrace-madsim-{}-{seed}", std::process::id()))
}

fn spawn_mill(h: &Handle, data: PathBuf) -> NodeHandle {
    h.create_node()
        .name("mill")
        .ip(IpAddr::V4(MILL_IP))
        .init(move || {
            let data = data.clone();
            async move {
                let mill = loop {
                    match crate::node::start_mill(mill_options(&data), Clock::start()).await {
                        Ok(m) => break m,
                        Err(e) => {
                            tracing::warn!(error = %e, "mill start failed; retrying");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                };
                crate::node::signalled().await;
                let _ = mill.stop().await;
            }
        })
        .build()
}

fn spawn_executor(h: &Handle, data: PathBuf, i: usize) -> NodeHandle {
    h.create_node()
        .name(format!("x{i}"))
        .ip(IpAddr::V4(exec_ip(i)))
        .init(move || {
            let data = data.clone();
            async move {
                let exec = loop {
                    match crate::node::start_executor(
                        exec_options(&data, i),
                        Clock::start(),
                        tokio::runtime::Handle::current(),
                    ) {
                        Ok(x) => break x,
                        Err(e) => {
                            tracing::warn!(error = %e, "executor start failed; retrying");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                };
                crate::node::signalled().await;
                let _ = exec.stop().await;
            }
        })
        .build()
}

/// One seed: the cluster, the workload, the faults, the checks.
async fn scenario(seed: u64) -> Outcome {
    let root = root_for(seed);
    let _ = std::fs::remove_dir_all(&root);
    sim_engine::reset(&root);
    let h = Handle::current();
    let mill_data = root.join("mill");
    let mill = spawn_mill(&h, mill_data);
    let exec_data: Vec<PathBuf> = (0..EXECUTORS).map(|i| root.join(format!("x{i}"))).collect();
    let execs: Vec<NodeHandle> = exec_data
        .iter()
        .enumerate()
        .map(|(i, d)| spawn_executor(&h, d.clone(), i))
        .collect();
    let mut wiped: Vec<PathBuf> = Vec::new();
    let mut faults: BTreeMap<&'static str, u32> = BTreeMap::new();

    // The workload: jobs of 0.1–3 s, a sixth of them failing, submitted at random moments
    // through the faults, each retried with its key until the mill answers.
    let client = h
        .create_node()
        .name("client")
        .ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 99)))
        .build();
    let client_id = client.id();
    // Cancels the mill accepted: key, job, when (I11).
    let accepted: Arc<Mutex<Vec<(String, u64, Instant)>>> = Arc::default();
    // Set when the faults are over and healed.
    let healed: Arc<Mutex<Option<Instant>>> = Arc::default();
    // Submitted jobs the fault loop may cancel just before a mill kill.
    let crash_targets: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let submitter = client.spawn({
        let (accepted, healed, crash_targets) =
            (accepted.clone(), healed.clone(), crash_targets.clone());
        async move {
            let mut ids: BTreeMap<String, u64> = BTreeMap::new();
            let mut long = Vec::new();
            for k in 0..LONG_JOBS + CRASH_CANCEL_JOBS + JOBS {
                let (key, body) = if k < LONG_JOBS {
                    (
                        format!("long-{k}"),
                        r#"{"command": "sim 120000 0"}"#.to_string(),
                    )
                } else if k < LONG_JOBS + CRASH_CANCEL_JOBS {
                    (
                        format!("crash-{}", k - LONG_JOBS),
                        r#"{"command": "sim 120000 0"}"#.to_string(),
                    )
                } else {
                    let ms = madsim::rand::thread_rng().gen_range(100..3000u64);
                    let code = u8::from(madsim::rand::thread_rng().gen_range(0..6u8) == 0);
                    (
                        format!("job-{}", k - LONG_JOBS - CRASH_CANCEL_JOBS),
                        format!(r#"{{"command": "sim {ms} {code}"}}"#),
                    )
                };
                let give_up = tokio::time::Instant::now() + SETTLE;
                while tokio::time::Instant::now() < give_up {
                    if let Some((200 | 201, text)) =
                        http("POST", "/v1/jobs", Some(&key), &body).await
                    {
                        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                        if let Some(id) = v.get("id").and_then(serde_json::Value::as_u64) {
                            ids.insert(key.clone(), id);
                            if k < LONG_JOBS {
                                long.push((key, id));
                            } else if k < LONG_JOBS + CRASH_CANCEL_JOBS {
                                crash_targets
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .push((key, id));
                            } else if madsim::rand::thread_rng().gen_range(0..5u8) == 0 {
                                // A fifth of the short jobs are cancelled through the faults,
                                // queued, placed, running or just ended.
                                let wait = madsim::rand::thread_rng().gen_range(0..2500u64);
                                let accepted = accepted.clone();
                                tokio::spawn(async move {
                                    tokio::time::sleep(Duration::from_millis(wait)).await;
                                    cancel_job(&key, id, &accepted).await;
                                });
                            }
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                let gap = madsim::rand::thread_rng().gen_range(0..1500u64);
                tokio::time::sleep(Duration::from_millis(gap)).await;
            }
            // The long jobs, once the fleet is whole again.
            loop {
                let at = *healed.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(at) = at {
                    tokio::time::sleep_until(at + CANCEL_AFTER_HEAL).await;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            long.append(&mut crash_targets.lock().unwrap_or_else(|e| e.into_inner()));
            for (key, id) in long {
                cancel_job(&key, id, &accepted).await;
            }
            ids
        }
    });

    // The faults.
    let net = madsim::net::NetSim::current();
    let started = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    while started.elapsed() < FAULT_TIME {
        let pause = madsim::rand::thread_rng().gen_range(500..3000u64);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let i = madsim::rand::thread_rng().gen_range(0..EXECUTORS);
        let x = execs[i].id();
        let target = {
            let mut t = crash_targets.lock().unwrap_or_else(|e| e.into_inner());
            (!t.is_empty()).then(|| t.remove(0))
        };
        let pick = madsim::rand::thread_rng().gen_range(0..11u32);
        if let (Some((key, id)), 10) = (target.clone(), pick) {
            // A user cancel, then a kill inside the commit after the mill handled it: the
            // 202, if it came, followed that commit, so the cancel is durable (I11, M26).
            *faults.entry("cancel-then-kill-mill").or_default() += 1;
            let seen = crate::mill_commit::cancels_seen();
            let accepted = accepted.clone();
            let _cancel = client.spawn(async move { cancel_job(&key, id, &accepted).await });
            let until = tokio::time::Instant::now() + Duration::from_secs(3);
            while crate::mill_commit::cancels_seen() == seen && tokio::time::Instant::now() < until
            {
                tokio::time::sleep(Duration::from_micros(500)).await;
            }
            while !crate::mill_commit::committing() && tokio::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_micros(500)).await;
            }
            h.kill(mill.id());
            tokio::time::sleep(Duration::from_millis(200)).await;
            h.restart(mill.id());
            continue;
        }
        if let Some(t) = target {
            crash_targets
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(0, t);
        }
        match pick {
            7 | 8 => {
                // In the middle of a commit: between the writes' hand-over and their fsync's
                // end, killed (7) or stopped gracefully (8).
                let kill = madsim::rand::thread_rng().gen_bool(0.5);
                let until = tokio::time::Instant::now() + Duration::from_secs(3);
                while !crate::mill_commit::committing() && tokio::time::Instant::now() < until {
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                if kill {
                    *faults.entry("kill-mill-mid-commit").or_default() += 1;
                } else {
                    *faults.entry("stop-mill-mid-commit").or_default() += 1;
                    h.send_ctrl_c(mill.id());
                    tokio::time::sleep(Duration::from_millis(800)).await;
                }
                h.kill(mill.id());
                tokio::time::sleep(Duration::from_millis(200)).await;
                h.restart(mill.id());
            }
            9 => {
                // Towards the client only, for longer than its 5 s request timeout: the
                // mill takes submits whose answers do not arrive, and the client retries
                // them with their keys (M31).
                *faults.entry("clog-client-in").or_default() += 1;
                net.clog_node_in(client_id);
                let d = madsim::rand::thread_rng().gen_range(5500..8000u64);
                tokio::time::sleep(Duration::from_millis(d)).await;
                net.unclog_node_in(client_id);
            }
            0 => {
                *faults.entry("kill-mill").or_default() += 1;
                h.kill(mill.id());
                tokio::time::sleep(Duration::from_millis(200)).await;
                h.restart(mill.id());
            }
            1 => {
                // SIGINT: the mill stops gracefully in whatever commit it is in.
                *faults.entry("stop-mill").or_default() += 1;
                h.send_ctrl_c(mill.id());
                tokio::time::sleep(Duration::from_millis(800)).await;
                // What has not stopped by now is killed, as a service manager would
                // (madsim's restart alone would leave the old process's sockets bound).
                h.kill(mill.id());
                h.restart(mill.id());
            }
            2 => {
                *faults.entry("kill-executor").or_default() += 1;
                h.kill(x);
                tokio::time::sleep(Duration::from_millis(300)).await;
                h.restart(x);
            }
            3 => {
                *faults.entry("stop-executor").or_default() += 1;
                h.send_ctrl_c(x);
                tokio::time::sleep(Duration::from_millis(2500)).await;
                h.kill(x);
                h.restart(x);
            }
            4 if wiped.len() < 1 => {
                // The executor's disk is lost: its store and its supervisors go.
                *faults.entry("wipe-executor").or_default() += 1;
                h.kill(x);
                let _ = std::fs::remove_dir_all(&exec_data[i]);
                sim_engine::wipe(&exec_data[i]);
                wiped.push(exec_data[i].clone());
                tokio::time::sleep(Duration::from_millis(300)).await;
                h.restart(x);
            }
            5 => {
                *faults.entry("partition").or_default() += 1;
                net.clog_link(x, mill.id());
                net.clog_link(mill.id(), x);
                let d = madsim::rand::thread_rng().gen_range(200..1500u64);
                tokio::time::sleep(Duration::from_millis(d)).await;
                net.unclog_link(x, mill.id());
                net.unclog_link(mill.id(), x);
            }
            _ => {
                // One way only: the mill hears the executor, the executor not the mill.
                *faults.entry("clog-one-way").or_default() += 1;
                net.clog_link(mill.id(), x);
                let d = madsim::rand::thread_rng().gen_range(200..1500u64);
                tokio::time::sleep(Duration::from_millis(d)).await;
                net.unclog_link(mill.id(), x);
            }
        }
    }

    let healed_at = Instant::now();
    *healed.lock().unwrap_or_else(|e| e.into_inner()) = Some(healed_at);
    let ids = submitter.await.unwrap_or_default();
    let mut violations = Vec::new();
    if ids.len() != LONG_JOBS + CRASH_CANCEL_JOBS + JOBS {
        violations.push(format!(
            "only {} of {} submits were answered",
            ids.len(),
            LONG_JOBS + CRASH_CANCEL_JOBS + JOBS
        ));
    }
    let mut seen_ids: BTreeMap<u64, &str> = BTreeMap::new();
    for (key, id) in &ids {
        if let Some(other) = seen_ids.insert(*id, key) {
            violations.push(format!("I2/M31: keys {other} and {key} share job {id}"));
        }
    }

    // Every job ends, and a terminal once seen stays.
    let poll = client.spawn({
        let ids = ids.clone();
        async move {
            let deadline = tokio::time::Instant::now() + SETTLE;
            let mut first: BTreeMap<String, (String, Option<i64>)> = BTreeMap::new();
            let mut changed = Vec::new();
            loop {
                for (key, id) in &ids {
                    let Some((200, text)) = http("GET", &format!("/v1/jobs/{id}"), None, "").await
                    else {
                        continue;
                    };
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    if v.get("done").and_then(serde_json::Value::as_bool) != Some(true) {
                        continue;
                    }
                    let state = v
                        .get("state")
                        .and_then(serde_json::Value::as_str)
                        .unwrap_or("?")
                        .to_string();
                    let code = v.get("exit_code").and_then(serde_json::Value::as_i64);
                    match first.get(key) {
                        Some(old) if *old != (state.clone(), code) => changed.push(format!(
                            "I2: job {id} ({key}) was {old:?}, later {state} {code:?}"
                        )),
                        Some(_) => {}
                        None => {
                            first.insert(key.clone(), (state, code));
                        }
                    }
                }
                if first.len() == ids.len() || tokio::time::Instant::now() >= deadline {
                    return (first, changed);
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    });
    let (ended, changed) = poll.await.unwrap_or_default();
    violations.extend(changed);
    let mut jobs = BTreeMap::new();
    for (key, id) in &ids {
        match ended.get(key) {
            Some((state, code)) => {
                jobs.insert(key.clone(), (*id, state.clone(), *code));
            }
            None => violations.push(format!(
                "liveness: job {id} ({key}) did not end within {SETTLE:?} of the heal"
            )),
        }
    }

    // I1 and I3 from the engine's records.
    let runs = sim_engine::runs(&root);
    let mut starts: BTreeMap<u64, Vec<&sim_engine::Run>> = BTreeMap::new();
    for r in &runs {
        starts.entry(r.job.get()).or_default().push(r);
    }
    let answered: std::collections::BTreeSet<u64> = ids.values().copied().collect();
    for (job, rs) in &starts {
        if !answered.contains(job) {
            violations.push(format!(
                "M31: job {job} ran but no submit was answered with it (a retried submit made a second job)"
            ));
        }
        if rs.len() > 1 {
            violations.push(format!("I1: job {job} started {} times: {rs:?}", rs.len()));
        }
    }
    let accepted = accepted.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let accepted_keys: std::collections::BTreeSet<&str> =
        accepted.iter().map(|(k, _, _)| k.as_str()).collect();
    for (key, (id, state, _)) in &jobs {
        let succeeded = starts.get(id).is_some_and(|rs| {
            rs.iter().any(|r| {
                r.ended == Some(TerminalStatus::Success)
                    && !wiped.iter().any(|w| r.machine.starts_with(w))
            })
        });
        // I11 lets a cancel win over an engine's end that had not been sent when the cancel
        // reached the executor; which came first at the executor is not observed here, so a
        // cancelled job whose cancel the mill accepted is not held to I3.
        let cancel_won = state == "cancelled" && accepted_keys.contains(key.as_str());
        if succeeded && state != "success" && !cancel_won {
            violations.push(format!(
                "I3: job {id} ({key}) ran to success on a kept store but ended {state}"
            ));
        }
    }
    // I11: a cancel the mill accepted stops the job's runs within the mill's
    // cancel_ack_timeout plus the executor's stop grace of a connected fleet: of its
    // acceptance when the fleet was whole, else of the moment every executor had redialled
    // after the heal. Its job ends cancelled unless a run ended on its own before that
    // deadline (its own terminal may have been sent before the cancel reached the executor);
    // a run that ends on its own later ran on past a cancel that was lost.
    let bound =
        mill_options(&root).tuning.cancel_ack_timeout + exec_options(&root, 0).tuning.stop_grace;
    let mut cancels = BTreeMap::new();
    for (key, id, at) in &accepted {
        cancels.insert(
            key.clone(),
            u64::try_from((*at - started).as_millis()).unwrap_or(u64::MAX),
        );
        let deadline = if *at >= healed_at {
            *at + bound
        } else {
            healed_at + CANCEL_AFTER_HEAL + bound
        };
        let rs = starts.get(id).map(Vec::as_slice).unwrap_or_default();
        let ended_itself = rs.iter().any(|r| {
            matches!(
                r.ended,
                Some(TerminalStatus::Success | TerminalStatus::Failed)
            ) && r.ended_at.is_some_and(|e| e <= deadline)
        });
        if let Some((_, state, _)) = jobs.get(key) {
            if state != "cancelled" && !ended_itself {
                violations.push(format!(
                    "I11: job {id} ({key}) ended {state} after its cancel was accepted at {:?}, and no engine run of it ended on its own by {:?}: {rs:?}",
                    *at - started,
                    deadline - started
                ));
            }
        }
        for r in rs {
            if wiped.iter().any(|w| r.machine.starts_with(w)) {
                continue;
            }
            let late = match r.ended_at {
                Some(e) => e > deadline,
                None => true,
            };
            if late {
                violations.push(format!(
                    "I11: job {id} ({key}) cancelled at {:?} (healed at {:?}), its run {:?} ended at {:?}, past {:?}",
                    *at - started,
                    healed_at - started,
                    r.lease,
                    r.ended_at.map(|e| e - started),
                    deadline - started
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
    Outcome {
        jobs,
        starts: runs.len(),
        faults,
        cancels,
        violations,
        simulated: started.elapsed(),
    }
}

/// `RUST_LOG=info` shows the nodes' logs (each line names its simulated node and task).
fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Set in a child process: the seed it runs (the suite runs each seed in a process of its own).
const CHILD_SEED: &str = "MILLRACE_MADSIM_CHILD_SEED";
/// Set in a child process: where it writes madsim's determinism log of its run.
const CHILD_LOG: &str = "MILLRACE_MADSIM_CHILD_LOG";
/// Set in a child process: the log of an earlier run of its seed to check every RNG draw of
/// this one against (madsim's determinism check, across processes).
const CHILD_CHECK: &str = "MILLRACE_MADSIM_CHILD_CHECK";
/// The line a child prints its report on.
const REPORT_TAG: &str = "MILLRACE-MADSIM-REPORT ";

/// What a child process reports to the suite: the outcome and its hash.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Report {
    seed: u64,
    jobs: usize,
    starts: usize,
    faults: BTreeMap<String, u32>,
    /// Cancels the mill accepted.
    cancels: usize,
    violations: Vec<String>,
    simulated_ns: u64,
    hash: u64,
    /// The determinism log's length (log mode) or the draws checked (check mode).
    draws: usize,
}

/// One seed, in this process, on a thread of its own, with madsim's determinism log taken
/// (`log`) or checked against an earlier run's (`check`).
///
/// Why a process per seed: tokio's `watch` channels (the node's shutdown signal, madsim's
/// ctrl-c) pick which of eight queues a waiter joins from tokio's thread RNG, which is seeded
/// from a process-wide counter, so a seed run second in a process wakes its waiters in another
/// order than the same seed run first (madsim's in-process `check_determinism` fails for that
/// reason). Every process-wide counter (connection ids, madsim's task ids) starts over too.
/// Why a thread: std's `HashMap` keys are drawn once per thread, and madsim seeds them only on
/// a thread that has drawn none yet (`node/build.rs` exports its `getrandom` so std finds it).
fn run_seed(seed: u64, log: Option<&Path>, check: Option<&Path>) -> Result<Report, String> {
    init_logs();
    let check = match check {
        Some(p) => Some(std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => None,
    };
    let record = log.is_some();
    let run = std::thread::Builder::new()
        .name(format!("madsim-seed-{seed}"))
        .spawn(move || {
            let mut rt = Runtime::with_seed_and_config(seed, madsim::Config::default());
            rt.set_time_limit(FAULT_TIME + SETTLE + Duration::from_secs(120));
            if record {
                rt.enable_determinism_log();
            }
            if let Some(c) = check {
                rt.enable_determinism_check(c);
            }
            let out = rt.block_on(scenario(seed));
            (out, rt.take_determinism_log())
        })
        .map_err(|e| format!("cannot start the seed's thread: {e}"))?;
    let (out, det) = run.join().map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_else(|| "a panic without a message".into())
    })?;
    let draws = match det {
        Ok(bytes) => {
            if let Some(p) = log {
                std::fs::write(p, &bytes).map_err(|e| format!("{}: {e}", p.display()))?;
            }
            bytes.len()
        }
        Err((made, logged)) => {
            return Err(format!(
                "non-determinism: this run made {made} RNG draws, the first made {logged}"
            ))
        }
    };
    Ok(Report {
        seed,
        jobs: out.jobs.len(),
        starts: out.starts,
        faults: out
            .faults
            .iter()
            .map(|(k, v)| ((*k).to_string(), *v))
            .collect(),
        cancels: out.cancels.len(),
        violations: out.violations.clone(),
        simulated_ns: u64::try_from(out.simulated.as_nanos()).unwrap_or(u64::MAX),
        hash: out.hash(),
        draws,
    })
}

/// Runs one seed in a child process of this test binary (see [`run_seed`] for why).
fn run_child(seed: u64, log: Option<&Path>, check: Option<&Path>) -> Result<Report, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args([
        "--exact",
        "madsim_tests::madsim_cluster_keeps_its_promises_under_faults",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_SEED, seed.to_string())
    .env_remove(CHILD_LOG)
    .env_remove(CHILD_CHECK);
    if let Some(p) = log {
        cmd.env(CHILD_LOG, p);
    }
    if let Some(p) = check {
        cmd.env(CHILD_CHECK, p);
    }
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run the child: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // libtest prints the test's name on the line the report starts on.
    let reported = stdout
        .lines()
        .find_map(|l| l.find(REPORT_TAG).map(|i| &l[i + REPORT_TAG.len()..]));
    match reported {
        Some(json) => serde_json::from_str(json).map_err(|e| format!("bad report {json}: {e}")),
        None => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let said: Vec<&str> = stderr
                .lines()
                .chain(stdout.lines())
                .filter(|l| {
                    l.contains("panicked") || l.contains("non-determinism") || l.contains("error")
                })
                .take(6)
                .collect();
            Err(format!(
                "the child ended {} without a report: {}",
                out.status,
                said.join(" | ")
            ))
        }
    }
}

fn seeds() -> Vec<u64> {
    if let Some(s) = std::env::var("SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![s];
    }
    let n = std::env::var("SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CI_SEEDS);
    (1..=n).collect()
}

/// The suite: every seed run twice, each time in a process of its own; the first run's
/// checks must hold, and the second must draw madsim's RNG exactly as the first did at the
/// same simulated instants (madsim's determinism check, across processes) and end with the
/// same outcome hash. A child (`MILLRACE_MADSIM_CHILD_SEED` set) runs its one seed and prints
/// its report instead.
#[test]
fn madsim_cluster_keeps_its_promises_under_faults() {
    if let Some(seed) = std::env::var(CHILD_SEED).ok().and_then(|s| s.parse().ok()) {
        let log = std::env::var_os(CHILD_LOG).map(PathBuf::from);
        let check = std::env::var_os(CHILD_CHECK).map(PathBuf::from);
        match run_seed(seed, log.as_deref(), check.as_deref()) {
            Ok(r) => match serde_json::to_string(&r) {
                Ok(json) => println!("{REPORT_TAG}{json}"),
                Err(e) => panic!("seed {seed}: report: {e}"),
            },
            Err(e) => panic!("seed {seed}: {e}"),
        }
        return;
    }
    let seeds = seeds();
    let wall = std::time::Instant::now();
    let queue = std::sync::Mutex::new(seeds.clone().into_iter());
    let results = std::sync::Mutex::new(BTreeMap::new());
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let scratch = std::env::temp_dir().join(format!("millrace-madsim-det-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap_or_else(|e| panic!("{}: {e}", scratch.display()));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let next = queue.lock().map(|mut q| q.next()).unwrap_or(None);
                let Some(seed) = next else { break };
                let log = scratch.join(format!("{seed}.rng"));
                let first = run_child(seed, Some(&log), None);
                let second = match &first {
                    Ok(_) => Some(run_child(seed, None, Some(&log))),
                    Err(_) => None,
                };
                let _ = std::fs::remove_file(&log);
                if let Ok(mut r) = results.lock() {
                    r.insert(seed, (first, second));
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&scratch);
    let wall = wall.elapsed();
    let results = results.into_inner().unwrap_or_default();
    let mut failed = Vec::new();
    let mut simulated_ns = 0u64;
    for (seed, (first, second)) in &results {
        let mut problems = Vec::new();
        match first {
            Ok(r) => {
                simulated_ns += r.simulated_ns;
                println!(
                    "seed {seed}: {} jobs ended, {} engine starts, {} cancels accepted, faults {:?}, {} RNG draws, hash {:016x}",
                    r.jobs, r.starts, r.cancels, r.faults, r.draws, r.hash
                );
                problems.extend(r.violations.iter().cloned());
            }
            Err(e) => problems.push(e.clone()),
        }
        match (first, second) {
            (Ok(a), Some(Ok(b))) if a.hash != b.hash || a.draws != b.draws => problems.push(format!(
                "non-determinism: the second run ended with hash {:016x} after {} draws, the first {:016x} after {}",
                b.hash, b.draws, a.hash, a.draws
            )),
            (_, Some(Err(e))) => problems.push(format!("second run: {e}")),
            _ => {}
        }
        if !problems.is_empty() {
            failed.push(format!(
                "seed {seed}:\n  {}\n  replay: SEED={seed} {REPLAY}\n  one run with logs: {CHILD_SEED}={seed} RUST_LOG=debug {REPLAY}",
                problems.join("\n  ")
            ));
        }
    }
    // Seeds per second (each seed counted once, though run twice) and time compression, for
    // BENCHMARKS.md; the real clock is read outside the simulations and nothing asserts on it.
    println!(
        "{} seeds (each run twice, {workers} at a time) in {:.2} s wall: {:.1} seeds/s, {:.0} s simulated ({:.0}x compression counting both runs)",
        seeds.len(),
        wall.as_secs_f64(),
        seeds.len() as f64 / wall.as_secs_f64().max(1e-9),
        simulated_ns as f64 / 1e9,
        2.0 * simulated_ns as f64 / 1e9 / wall.as_secs_f64().max(1e-9)
    );
    assert_eq!(results.len(), seeds.len(), "every seed reported");
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
