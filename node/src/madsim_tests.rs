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
//!   ends Success (every outage here is shorter than `reconnect_grace`).
//!
//! Determinism is not there yet: see `madsim_determinism_check_of_one_seed`, ignored with
//! the reason. A failing seed's replay reruns its schedule and workload, not always its exact
//! interleaving.
//!
//! Run: `RUSTFLAGS="--cfg madsim" cargo test -p node --bin millrace --target-dir
//! target/madsim madsim_` (`SEEDS=N` runs N seeds from 1; `SEED=S` replays one).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use madsim::rand::Rng;
use madsim::runtime::{Handle, NodeHandle, Runtime};
use millrace_core::job::TerminalStatus;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cli::{Cli, Cmd};
use crate::clock::Clock;
use crate::node::{ExecOptions, MillOptions};
use crate::sim_engine;

const EXECUTORS: usize = 3;
const JOBS: usize = 24;
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

/// What a seed ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    /// Per idempotency key: (job id, final state, exit code).
    jobs: BTreeMap<String, (u64, String, Option<i64>)>,
    /// Engine starts in the fleet.
    starts: usize,
    /// Faults injected, by kind.
    faults: BTreeMap<&'static str, u32>,
    /// What failed, if anything.
    violations: Vec<String>,
    /// Simulated time the seed took.
    simulated: Duration,
}

impl Outcome {
    fn hash(&self) -> u64 {
        // FNV-1a over the debug form: stable across runs of one build.
        let text = format!("{:?}|{}|{:?}", self.jobs, self.starts, self.faults);
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
    let submitter = client.spawn(async move {
        let mut ids: BTreeMap<String, u64> = BTreeMap::new();
        for k in 0..JOBS {
            let ms = madsim::rand::thread_rng().gen_range(100..3000u64);
            let code = u8::from(madsim::rand::thread_rng().gen_range(0..6u8) == 0);
            let key = format!("job-{k}");
            let body = format!(r#"{{"command": "sim {ms} {code}"}}"#);
            let give_up = tokio::time::Instant::now() + SETTLE;
            while tokio::time::Instant::now() < give_up {
                if let Some((200 | 201, text)) = http("POST", "/v1/jobs", Some(&key), &body).await {
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    if let Some(id) = v.get("id").and_then(serde_json::Value::as_u64) {
                        ids.insert(key, id);
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            let gap = madsim::rand::thread_rng().gen_range(0..1500u64);
            tokio::time::sleep(Duration::from_millis(gap)).await;
        }
        ids
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
        match madsim::rand::thread_rng().gen_range(0..10u32) {
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

    let ids = submitter.await.unwrap_or_default();
    let mut violations = Vec::new();
    if ids.len() != JOBS {
        violations.push(format!(
            "only {} of {JOBS} submits were answered",
            ids.len()
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
    for (key, (id, state, _)) in &jobs {
        let succeeded = starts.get(id).is_some_and(|rs| {
            rs.iter().any(|r| {
                r.ended == Some(TerminalStatus::Success)
                    && !wiped.iter().any(|w| r.machine.starts_with(w))
            })
        });
        if succeeded && state != "success" {
            violations.push(format!(
                "I3: job {id} ({key}) ran to success on a kept store but ended {state}"
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&root);
    Outcome {
        jobs,
        starts: runs.len(),
        faults,
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

fn run_seed(seed: u64) -> Outcome {
    init_logs();
    let mut rt = Runtime::with_seed_and_config(seed, madsim::Config::default());
    rt.set_time_limit(FAULT_TIME + SETTLE + Duration::from_secs(120));
    rt.block_on(scenario(seed))
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

/// The suite: every seed's checks, then determinism of the first seed twice over.
#[test]
fn madsim_cluster_keeps_its_promises_under_faults() {
    let mut failed = Vec::new();
    let wall = std::time::Instant::now();
    let mut simulated = Duration::ZERO;
    let seeds = seeds();
    for &seed in &seeds {
        let out = run_seed(seed);
        simulated += out.simulated;
        println!(
            "seed {seed}: {} jobs ended, {} engine starts, faults {:?}, hash {:016x}",
            out.jobs.len(),
            out.starts,
            out.faults,
            out.hash()
        );
        if !out.violations.is_empty() {
            failed.push(format!(
                "seed {seed}:\n  {}\n  replay: SEED={seed} RUSTFLAGS=\"--cfg madsim\" cargo test -p node --bin millrace --target-dir target/madsim madsim_ -- --nocapture",
                out.violations.join("\n  ")
            ));
        }
    }
    // Seeds per second and time compression, for BENCHMARKS.md (the real clock is read
    // outside the simulations; nothing asserts on it).
    let wall = wall.elapsed();
    println!(
        "{} seeds in {:.2} s wall: {:.1} seeds/s, {:.0} s simulated ({:.0}x compression)",
        seeds.len(),
        wall.as_secs_f64(),
        seeds.len() as f64 / wall.as_secs_f64().max(1e-9),
        simulated.as_secs_f64(),
        simulated.as_secs_f64() / wall.as_secs_f64().max(1e-9)
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// madsim's own determinism check (its RNG log compared across two runs) on one seed
/// (`DET_SEED=S` picks another). Ignored: it fails on this toolchain for most seeds (seeds
/// 1, 2, 3 and 8 pass, 4–7, 9, 10 and 101 diverge). madsim 0.2.34 makes std's `HashMap`
/// deterministic by interposing `getrandom` when its runtime starts; Rust 1.95's std takes
/// its hash keys past that ("failed to initialize std random state" in the log), and
/// madsim's own network drops a killed node's sockets out of a std `HashMap`, so the order
/// of the wake-ups after a kill differs by process. The node's own sources of divergence
/// are gone (its maps are ordered, its `select!`s biased, its randomness madsim's). Un-ignore
/// once madsim's network is ordered (issue 16's note).
#[test]
#[ignore = "madsim's std-HashMap interposition fails on Rust 1.95: see the comment"]
fn madsim_determinism_check_of_one_seed() {
    init_logs();
    let seed = std::env::var("DET_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    Runtime::check_determinism(seed, madsim::Config::default(), || async {
        let seed = madsim::runtime::Handle::current().seed();
        let out = scenario(seed).await;
        assert!(out.violations.is_empty(), "{:?}", out.violations);
    });
}
