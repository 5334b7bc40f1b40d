//! `millrace demo`: a throwaway standalone mill with E local executors, N shell jobs, a
//! progress bar, and a summary. Exits 0 only if every job succeeded.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use millrace_core::job::{Identity, JobSpec, JobState, TerminalStatus};
use millrace_core::JobId;

use crate::cli::{DemoArgs, ExecTuning, MillTuning, Timing};
use crate::clock::Clock;
use crate::mill_driver::JobEventKind;
use crate::node::{self, ExecOptions, MillOptions};

/// The executors' runtime directory: one the demo made (and removes), or the user's.
enum Runtime {
    Temp(tempfile::TempDir),
    Given(std::path::PathBuf),
}

impl Runtime {
    fn path(&self) -> &std::path::Path {
        match self {
            Runtime::Temp(t) => t.path(),
            Runtime::Given(p) => p,
        }
    }
}

/// Runs the demo; returns whether every job succeeded.
pub async fn demo(args: DemoArgs) -> Result<bool, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let token =
        node::ensure_token(&node::executor_token_path(dir.path())).map_err(|e| e.to_string())?;
    let api_token =
        node::ensure_token(&node::api_token_path(dir.path())).map_err(|e| e.to_string())?;
    let timing = Timing {
        reconnect_grace: Duration::from_secs(45),
        silence_timeout: Duration::from_secs(15),
        snapshot_interval: Duration::from_secs(5),
    };
    // Removed when the demo ends, like `dir`.
    let runtime = match args.runtime_dir.as_str() {
        "none" => None,
        "auto" => std::path::Path::new("/dev/shm")
            .is_dir()
            .then(|| {
                tempfile::Builder::new()
                    .prefix("millrace-demo-")
                    .tempdir_in("/dev/shm")
            })
            .and_then(Result::ok)
            .map(Runtime::Temp),
        path => Some(Runtime::Given(std::path::PathBuf::from(path))),
    };
    let clock = Clock::start();
    let mill = node::start_mill(
        MillOptions {
            data: dir.path().to_path_buf(),
            store: None,
            executor_listen: "127.0.0.1:0".into(),
            http_listen: "127.0.0.1:0".into(),
            token: token.clone(),
            api_token,
            timing: timing.clone(),
            tuning: MillTuning {
                bid_timeout: Duration::from_secs(5),
                top_k: 3,
                direct_placement: true,
                late_binding: true,
                max_pending: args.jobs.max(10_000),
                cancel_ack_timeout: Duration::from_secs(10),
                cancel_teardown_timeout: Duration::from_secs(600),
                job_timeout: Duration::from_secs(600),
                quarantine_strikes: 3,
                max_sessions: 10_000,
                ..MillTuning::default()
            },
            tls: None,
            quota: Default::default(),
            ha: Default::default(),
        },
        clock,
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut executors = Vec::new();
    for i in 1..=args.executors.max(1) {
        let e = node::start_executor(
            ExecOptions {
                mill: mill.executor_addr.to_string(),
                node_id: format!("demo-{i}"),
                labels: Vec::new(),
                engine: format!("shell:{}", args.seats.max(1)),
                data: dir.path().join("executors").join(format!("demo-{i}")),
                token: token.clone(),
                timing: timing.clone(),
                tuning: ExecTuning {
                    backoff_min: Duration::from_millis(100),
                    backoff_max: Duration::from_secs(10),
                    stop_grace: Duration::from_secs(10),
                    drain_timeout: Duration::from_secs(30),
                    job_hard_cap: None,
                    run_as: None,
                    live_log_budget: millrace_core::executor::DEFAULT_LIVE_LOG_BUDGET,
                    resources: None,
                    runtime_dir: runtime.as_ref().map(|r| r.path().join(format!("demo-{i}"))),
                },
                tls: None,
            },
            clock,
            tokio::runtime::Handle::current(),
        )
        .map_err(|e| e.to_string())?;
        executors.push(e);
    }
    println!(
        "millrace demo: mill on http://{} with {} executors x {} seats, {} shell jobs (store in {}, supervisors in {})",
        mill.http_addr,
        executors.len(),
        args.seats,
        args.jobs,
        dir.path().display(),
        runtime
            .as_ref()
            .map_or_else(|| "the data directory".to_string(), |r| r.path().display().to_string())
    );
    let mut sub = mill.events.subscribe();
    let bar = indicatif::ProgressBar::new(args.jobs as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} done  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let syncs_before = (
        crate::syncs::count(crate::syncs::Side::Mill),
        crate::syncs::count(crate::syncs::Side::Executor),
    );
    let started = Instant::now();
    let mut ids = Vec::with_capacity(args.jobs);
    let mut batch = Vec::new();
    for i in 0..args.jobs {
        let spec = JobSpec {
            retry: Default::default(),
            priority: 0,
            node: None,
            engine: "shell".into(),
            labels: Default::default(),
            resources: Default::default(),
            identity: Identity {
                owner: "demo".into(),
                repo: "demo/app".into(),
            },
            timeout: None,
            payload: match &args.command {
                Some(c) => c.clone().into_bytes(),
                None => format!(
                    "echo \"job {i} on $(hostname) in $PWD\"; sleep 0.0$(( MILLRACE_JOB_ID % 10 )); test -n \"$MILLRACE_JOB_ID\""
                )
                .into_bytes(),
            },
            env: Default::default(),
        };
        // Submitted in batches (one group commit each), as a pipeline would.
        batch.push((spec, None));
        if batch.len() == crate::http::MAX_BATCH || i + 1 == args.jobs {
            let answers = mill
                .handle
                .submit_batch(std::mem::take(&mut batch))
                .await
                .map_err(|e| e.to_string())?;
            for a in answers {
                ids.push(a.map_err(|e| e.to_string())?.0.job);
            }
        }
    }
    let mut ends: BTreeMap<JobId, TerminalStatus> = BTreeMap::new();
    let wanted: std::collections::BTreeSet<JobId> = ids.iter().copied().collect();
    let deadline = Instant::now() + Duration::from_secs(600);
    while ends.len() < wanted.len() && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            Ok(Ok(ev)) => {
                if let JobEventKind::State(JobState::Done(t)) = ev.kind {
                    if wanted.contains(&ev.job) && ends.insert(ev.job, t.status).is_none() {
                        bar.inc(1);
                    }
                }
            }
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) | Err(_) => {
                // Missed events or a quiet spell: ask the store's view through the API handle.
                let nodes = mill.handle.nodes().await.unwrap_or_default();
                let running: usize = nodes.iter().map(|n| n.running).sum();
                bar.set_message(format!("{running} running"));
            }
            Ok(Err(_)) => break,
        }
    }
    bar.finish();
    let took = started.elapsed();
    let stats = mill.handle.stats().await.unwrap_or_default();
    let ok = ends
        .values()
        .filter(|s| **s == TerminalStatus::Success)
        .count();
    let failed = ends.len() - ok;
    let missing = wanted.len() - ends.len();
    println!();
    println!("succeeded: {ok}   failed: {failed}   unfinished: {missing}");
    println!(
        "placement latency: p50 {:.2} ms, p99 {:.2} ms  ({} placements)",
        stats.p50_us as f64 / 1000.0,
        stats.p99_us as f64 / 1000.0,
        stats.placed
    );
    println!(
        "throughput: {:.1} jobs/s ({} jobs in {:.2} s)",
        ends.len() as f64 / took.as_secs_f64().max(1e-9),
        ends.len(),
        took.as_secs_f64()
    );
    let per_job = |n: u64| n as f64 / ends.len().max(1) as f64;
    let syncs = (
        crate::syncs::count(crate::syncs::Side::Mill) - syncs_before.0,
        crate::syncs::count(crate::syncs::Side::Executor) - syncs_before.1,
    );
    println!(
        "durable syncs: mill {} ({:.2} per job), executors {} ({:.2} per job), and each job's \
         supervisor syncs its log once",
        syncs.0,
        per_job(syncs.0),
        syncs.1,
        per_job(syncs.1)
    );
    for e in executors {
        let _ = e.stop().await;
    }
    mill.stop().await.map_err(|e| e.to_string())?;
    // The disk under the stores, right after the run (issue 15: every benchmark records it).
    crate::syncs::print_probe(dir.path());
    Ok(ok == wanted.len())
}
