//! Load generation for benchmarks: fake executors that speak the wire protocol with raw
//! frames (accept every seat they have room for, finish each job at once), and the
//! submit→committed latency bench on loopback.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use millrace_core::codec::{encode, FrameDecoder};
use millrace_core::testkit::ScriptedExecutor;
use millrace_core::wire::{ToExecutor, ToMill};
use millrace_core::{Epoch, JobId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::cli::{BenchArgs, LoadgenArgs, MillTuning, Timing};
use crate::clock::Clock;
use crate::mill_driver::JobEventKind;
use crate::node::{self, MillOptions};

/// One fake executor session; runs until `stop` or the connection ends. The protocol is the
/// core's [`ScriptedExecutor`] (accept while a seat is free, finish each job at once); this
/// only moves its frames.
pub async fn fake_executor(
    addr: String,
    node: String,
    token: String,
    seats: u32,
    snapshot_interval: Duration,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(&addr).await?;
    stream.set_nodelay(true)?;
    let mut script = ScriptedExecutor::new(node, Epoch(crate::sqlite::random_u64()?), seats);
    let frame = |m: &ToMill| encode(m).map_err(|e| std::io::Error::other(e.to_string()));
    stream.write_all(&frame(&script.hello(&token))?).await?;
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 16 * 1024];
    let mut tick = tokio::time::interval(snapshot_interval);
    let mut replies: Vec<ToMill> = Vec::new();
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return Ok(()),
            _ = tick.tick() => replies.extend(script.snapshot()),
            n = stream.read(&mut buf) => {
                let n = n?;
                if n == 0 {
                    return Ok(());
                }
                decoder.push(buf.get(..n).unwrap_or_default());
                while let Some(msg) = decoder
                    .next_frame::<ToExecutor>()
                    .map_err(|e| std::io::Error::other(e.to_string()))?
                {
                    script
                        .handle(msg, &mut replies)
                        .map_err(|e| std::io::Error::other(e.to_string()))?;
                }
            }
        }
        if !replies.is_empty() {
            let mut out: Vec<u8> = Vec::new();
            for m in replies.drain(..) {
                out.extend(frame(&m)?);
            }
            stream.write_all(&out).await?;
        }
    }
}

/// `millrace loadgen`: opens many fake executor sessions against a running mill.
pub async fn loadgen(args: LoadgenArgs) -> Result<(), String> {
    let token = node::read_token(&args.token_file).map_err(|e| e.to_string())?;
    let (stop_tx, stop) = watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..args.executors {
        let (addr, token, stop) = (args.mill.clone(), token.clone(), stop.clone());
        let (seats, interval) = (args.seats, args.snapshot_interval);
        tasks.push(tokio::spawn(async move {
            let r = fake_executor(addr, format!("load-{i}"), token, seats, interval, stop).await;
            if let Err(e) = r {
                tracing::warn!(executor = i, error = %e, "fake executor ended");
            }
        }));
    }
    eprintln!(
        "{} fake executors started for {:?}",
        args.executors, args.duration
    );
    tokio::select! {
        () = tokio::time::sleep(args.duration) => {}
        () = node::signalled() => {}
    }
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

/// `millrace bench`: an in-process mill with a real SQLite store on a temp dir, fake
/// executors over loopback TCP, and HTTP submitters; reports submit→committed latency and
/// placements/s.
pub async fn bench(args: BenchArgs) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let store = args
        .store
        .as_deref()
        .map(crate::store::StoreLocation::parse)
        .transpose()
        .map_err(|e| format!("--store: {e}"))?;
    let token = "bench-token-0123456789".to_string();
    let api_token = "bench-api-token-0123456789".to_string();
    let opts = MillOptions {
        data: dir.path().to_path_buf(),
        store,
        executor_listen: "127.0.0.1:0".into(),
        http_listen: "127.0.0.1:0".into(),
        token: token.clone(),
        api_token: api_token.clone(),
        timing: Timing {
            reconnect_grace: Duration::from_secs(45),
            silence_timeout: Duration::from_secs(15),
            snapshot_interval: Duration::from_secs(5),
        },
        tuning: MillTuning {
            bid_timeout: Duration::from_secs(5),
            top_k: 3,
            direct_placement: args.direct_placement,
            late_binding: args.late_binding,
            max_pending: args.jobs.max(10_000),
            cancel_ack_timeout: Duration::from_secs(10),
            cancel_teardown_timeout: Duration::from_secs(600),
            job_timeout: Duration::from_secs(86_400),
            quarantine_strikes: 3,
            max_sessions: 10_000,
            ..MillTuning::default()
        },
        tls: None,
        quota: Default::default(),
        ha: Default::default(),
    };
    let mill = node::start_mill(opts, Clock::start())
        .await
        .map_err(|e| e.to_string())?;
    let (stop_tx, stop) = watch::channel(false);
    for i in 0..args.executors {
        let addr = mill.executor_addr.to_string();
        let (token, stop) = (token.clone(), stop.clone());
        let seats = args.seats;
        tokio::spawn(async move {
            let r = fake_executor(
                addr,
                format!("bench-{i}"),
                token,
                seats,
                Duration::from_secs(1),
                stop,
            )
            .await;
            if let Err(e) = r {
                tracing::warn!(executor = i, error = %e, "fake executor ended");
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = mill.handle.nodes().await.unwrap_or_default();
        if n.iter().filter(|v| v.state == "ready").count() >= args.executors {
            break;
        }
        if Instant::now() > deadline {
            return Err("fake executors did not connect within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Collect commit times from the driver's events (sent once the Running state is durable).
    let committed: Arc<Mutex<HashMap<JobId, Instant>>> = Arc::default();
    let mut sub = mill.events.subscribe();
    let sink = committed.clone();
    let target = args.jobs;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<u64>();
    tokio::spawn(async move {
        let mut lagged = 0u64;
        loop {
            match sub.recv().await {
                Ok(ev) => {
                    if let JobEventKind::State(millrace_core::job::JobState::Running { .. }) =
                        ev.kind
                    {
                        if let Ok(mut m) = sink.lock() {
                            m.insert(ev.job, ev.at);
                            if m.len() >= target {
                                break;
                            }
                        }
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => lagged += n,
                Err(_) => break,
            }
        }
        let _ = done_tx.send(lagged);
    });
    let url = format!("http://{}", mill.http_addr);
    let syncs_before = (
        crate::syncs::count(crate::syncs::Side::Mill),
        crate::syncs::count(crate::syncs::Side::Executor),
    );
    let started = Instant::now();
    let per = args.jobs.div_ceil(args.concurrency.max(1));
    let rate = args.rate;
    let conc = args.concurrency.max(1);
    let batch = usize::from(args.batch.max(1));
    let mut threads = Vec::new();
    for t in 0..conc {
        let (url, token) = (url.clone(), api_token.clone());
        let count = per.min(args.jobs.saturating_sub(t * per));
        threads.push(std::thread::spawn(move || {
            let c = crate::client::Client::with_token(&url, &token);
            let mut sent = Vec::with_capacity(count);
            // Arrivals are evenly spaced across all submitters: the `i`-th request of
            // submitter `t` is request `i * conc + t` of the whole run, due at that many
            // `batch / rate` after the start (not `conc` requests at once every `conc / rate`).
            let gap = (rate > 0).then(|| Duration::from_secs_f64(batch as f64 / rate as f64));
            let requests = count.div_ceil(batch);
            for i in 0..requests {
                if let Some(g) = gap {
                    let n = i * conc + t;
                    let due = started + g.mul_f64(n as f64);
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                }
                let jobs = batch.min(count - i * batch);
                let t0 = Instant::now();
                let job = serde_json::json!({"command": "true"});
                if batch == 1 {
                    match c.post("/v1/jobs", &job) {
                        Ok((201, v)) => {
                            if let Some(id) = v.get("id").and_then(serde_json::Value::as_u64) {
                                sent.push((JobId(id), t0, t0.elapsed()));
                            }
                        }
                        Ok((s, v)) => eprintln!("submit: HTTP {s}: {v}"),
                        Err(e) => eprintln!("submit: {e}"),
                    }
                    continue;
                }
                let body = serde_json::json!({"jobs": vec![job; jobs]});
                match c.post("/v1/jobs/batch", &body) {
                    Ok((200, v)) => {
                        let took = t0.elapsed();
                        let answers = v.get("jobs").and_then(serde_json::Value::as_array);
                        for a in answers.into_iter().flatten() {
                            match a.get("id").and_then(serde_json::Value::as_u64) {
                                Some(id) => sent.push((JobId(id), t0, took)),
                                None => eprintln!("submit: refused in a batch: {a}"),
                            }
                        }
                    }
                    Ok((s, v)) => eprintln!("submit: HTTP {s}: {v}"),
                    Err(e) => eprintln!("submit: {e}"),
                }
            }
            sent
        }));
    }
    let mut sent = Vec::new();
    for t in threads {
        sent.extend(t.join().map_err(|_| "submitter panicked".to_string())?);
    }
    let submitted_in = started.elapsed();
    let lagged = tokio::time::timeout(Duration::from_secs(60), done_rx)
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(0);
    let map = committed.lock().map_err(|_| "poisoned")?.clone();
    let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
        .map_err(|e| e.to_string())?;
    let mut answered = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
        .map_err(|e| e.to_string())?;
    let mut last = started;
    for (job, t0, took) in &sent {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let _ = answered.record(us.clamp(1, 60_000_000));
        if let Some(t1) = map.get(job) {
            let us =
                u64::try_from(t1.saturating_duration_since(*t0).as_micros()).unwrap_or(u64::MAX);
            let _ = h.record(us.clamp(1, 60_000_000));
            last = last.max(*t1);
        }
    }
    let span = last.saturating_duration_since(started).as_secs_f64();
    let stats = mill.handle.stats().await.unwrap_or_default();
    let syncs = (
        crate::syncs::count(crate::syncs::Side::Mill) - syncs_before.0,
        crate::syncs::count(crate::syncs::Side::Executor) - syncs_before.1,
    );
    println!(
        "jobs submitted: {} in {:.2} s over HTTP ({} submitters, {} job(s) per request)",
        sent.len(),
        submitted_in.as_secs_f64(),
        conc,
        batch
    );
    println!("jobs committed: {} (events lagged: {lagged})", h.len());
    println!(
        "submit answered (job durable): p50 {:.2} ms, p99 {:.2} ms",
        answered.value_at_quantile(0.5) as f64 / 1000.0,
        answered.value_at_quantile(0.99) as f64 / 1000.0
    );
    println!(
        "submit -> committed: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, p999 {:.2} ms, max {:.2} ms",
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.9) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.value_at_quantile(0.999) as f64 / 1000.0,
        h.max() as f64 / 1000.0
    );
    println!(
        "placements/s: {:.0} ({} placed in {:.2} s)",
        h.len() as f64 / span.max(1e-9),
        h.len(),
        span
    );
    println!(
        "placement (queued -> published) p50 {:.2} ms p99 {:.2} ms p999 {:.2} ms; group commits {} (mean {:.2} ms, {:.1} jobs/commit)",
        stats.p50_us as f64 / 1000.0,
        stats.p99_us as f64 / 1000.0,
        stats.p999_us as f64 / 1000.0,
        stats.commits,
        stats.commit_mean_us as f64 / 1000.0,
        h.len() as f64 / stats.commits.max(1) as f64
    );
    println!(
        "commits held for their early asks: {} ({} with every ask decided in time)",
        stats.held, stats.held_answered
    );
    let per_job = |n: u64| n as f64 / h.len().max(1) as f64;
    println!(
        "syncs: mill {} ({:.2} per job), executor {} ({:.2} per job; fake executors keep no store)",
        syncs.0,
        per_job(syncs.0),
        syncs.1,
        per_job(syncs.1)
    );
    let _ = stop_tx.send(true);
    mill.stop().await.map_err(|e| e.to_string())?;
    // The disk under the store, measured right after the run on the same directory: what
    // one commit's sync costs at best here.
    crate::syncs::print_probe(dir.path());
    Ok(())
}
