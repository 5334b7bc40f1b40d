//! `cargo run --release -p benches --bin latency-report`: submit → committed placement
//! latency of the core in process, of the simulator in virtual time (with and without
//! faults) and of the node on loopback; then placement quality against an omniscient
//! scheduler. Prints the tables and rewrites their sections of BENCHMARKS.md (between
//! `<!-- latency-report:begin -->`/`end` and `<!-- quality:begin -->`/`end`).
//!
//! `--no-write` prints only; `--quick` runs smaller workloads (a smoke check of the tool) and
//! never writes: its numbers are not the ones the sections describe.
//!
//! Exit codes: 0 every measurement ran; 1 one did not (its row says why; the tables are still
//! printed and written) or BENCHMARKS.md could not be read or written.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;
use millrace_core::mill::{MillInput, MillOutput, Observation};
use millrace_core::testkit;
use millrace_core::types::{ConnId, Epoch, JobId, LeaseId, Seqno};
use millrace_core::wire::{ToExecutor, ToMill};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const LAT_BEGIN: &str = "<!-- latency-report:begin -->";
const LAT_END: &str = "<!-- latency-report:end -->";
const Q_BEGIN: &str = "<!-- quality:begin -->";
const Q_END: &str = "<!-- quality:end -->";

/// One row of the latency table.
struct Row {
    what: String,
    committed: String,
    /// Latencies in microseconds, or why there are none.
    result: Result<Quant, String>,
    note: String,
}

/// Percentiles in microseconds.
struct Quant {
    n: u64,
    p50: u64,
    p90: u64,
    p99: u64,
    p999: u64,
    max: u64,
}

impl Quant {
    fn of(h: &Histogram<u64>) -> Quant {
        Quant {
            n: h.len(),
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        }
    }
}

fn histogram() -> Histogram<u64> {
    match Histogram::new_with_bounds(1, 3_600_000_000, 3) {
        Ok(h) => h,
        Err(e) => panic!("histogram bounds: {e}"),
    }
}

fn record(h: &mut Histogram<u64>, us: u64) {
    let _ = h.record(us.clamp(1, 3_600_000_000));
}

fn ms(us: u64) -> String {
    let m = us as f64 / 1000.0;
    if m < 1.0 {
        format!("{:.0} µs", us as f64)
    } else if m < 100.0 {
        format!("{m:.2} ms")
    } else {
        format!("{m:.0} ms")
    }
}

// ---- (1) the core in process --------------------------------------------------------

enum In {
    Submit(usize),
    Msg(ConnId, ToMill),
}

/// A mill and `execs` × `seats` fake executors in one thread, on the wall clock. Jobs
/// arrive as a Poisson process at `rate`/s for `secs`; the thread serves inputs in arrival
/// order (a submit waits behind the replies already queued), executors answer every ask at
/// once, and each job runs an exponential 50 ms (wall) before its terminal event. Latency:
/// scheduled arrival → the end of the mill step that published the lease (`Observation::
/// Placed`, the step whose `Persist` carries the lease and which sends `CommitLease`).
fn core_in_process(
    rate: f64,
    secs: f64,
    execs: usize,
    seats: u32,
) -> Result<(Histogram<u64>, Duration), String> {
    let mut fleet = benches::Fleet::new(execs, seats);
    let base = fleet.now;
    // A deterministic Poisson schedule (xorshift), in ns since the start.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut unit = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut arrivals = Vec::new();
    let mut t = 0.0f64;
    loop {
        t += -unit().ln() / rate;
        if t >= secs {
            break;
        }
        arrivals.push(Duration::from_secs_f64(t));
    }
    let durations: Vec<Duration> = arrivals
        .iter()
        .map(|_| Duration::from_secs_f64(-unit().ln() * 0.050))
        .collect();
    let mut queue: VecDeque<In> = VecDeque::new();
    let mut finishing: BinaryHeap<Reverse<(Duration, ConnId, LeaseId)>> = BinaryHeap::new();
    let mut job_of: HashMap<JobId, usize> = HashMap::new();
    let mut lease_job: HashMap<LeaseId, usize> = HashMap::new();
    let mut seqnos: BTreeMap<ConnId, u64> = BTreeMap::new();
    let mut h = histogram();
    let mut next = 0;
    let mut placed = 0;
    let started = Instant::now();
    let give_up = Duration::from_secs_f64(secs + 30.0);
    // The longest time between two turns of the loop: a turn costs microseconds, so a long
    // one is the thread losing its core (the machine is shared).
    let mut stall = Duration::ZERO;
    let mut last_turn = Duration::ZERO;
    while placed < arrivals.len() {
        let now = started.elapsed();
        stall = stall.max(now.saturating_sub(last_turn));
        last_turn = now;
        if now > give_up {
            return Err(format!(
                "only {placed} of {} placed in time",
                arrivals.len()
            ));
        }
        while next < arrivals.len() && arrivals[next] <= now {
            queue.push_back(In::Submit(next));
            next += 1;
        }
        while let Some(Reverse((at, conn, lease))) = finishing.peek().copied() {
            if at > now {
                break;
            }
            finishing.pop();
            let seq = seqnos.entry(conn).or_insert(0);
            *seq += 1;
            queue.push_back(In::Msg(
                conn,
                testkit::batch(Epoch(1), vec![testkit::success(Seqno(*seq), lease)]),
            ));
        }
        let mill_now = base.plus(now);
        let due = fleet.mill.next_deadline().is_some_and(|d| d <= mill_now);
        if due {
            fleet.mill.handle(mill_now, MillInput::Tick);
        } else {
            match queue.pop_front() {
                None => {
                    std::hint::spin_loop();
                    continue;
                }
                Some(In::Submit(k)) => {
                    let job = fleet
                        .mill
                        .submit(mill_now, benches::job_spec(), 0)
                        .map_err(|e| format!("mill refused a submit: {e}"))?;
                    job_of.insert(job, k);
                }
                Some(In::Msg(conn, msg)) => {
                    fleet
                        .mill
                        .handle(mill_now, MillInput::Message { conn, msg });
                }
            }
        }
        let end = started.elapsed();
        while let Some(o) = fleet.mill.poll_output() {
            match o {
                MillOutput::Send { conn, msg } => match msg {
                    ToExecutor::ReserveSeat { lease, job, .. } => {
                        if let Some(k) = job_of.get(&job) {
                            lease_job.insert(lease, *k);
                        }
                        queue.push_back(In::Msg(conn, testkit::accept(lease, testkit::one_seat())));
                    }
                    ToExecutor::CommitLease { lease, .. } => {
                        queue.push_back(In::Msg(conn, testkit::commit_result(lease, true)));
                        let d = lease_job
                            .get(&lease)
                            .map_or(Duration::ZERO, |k| durations[*k]);
                        finishing.push(Reverse((end + d, conn, lease)));
                    }
                    _ => {}
                },
                MillOutput::Observed(Observation::Placed { job, .. }) => {
                    if let Some(k) = job_of.get(&job) {
                        let us = end.saturating_sub(arrivals[*k]).as_micros();
                        record(&mut h, u64::try_from(us).unwrap_or(u64::MAX));
                        placed += 1;
                    }
                }
                _ => {}
            }
        }
    }
    Ok((h, stall))
}

// ---- (2) the simulator, virtual time -------------------------------------------------

/// Submit → first published lease of every job that got one, over `seeds` seeds.
fn sim_latency(scenario: &str, seeds: u64) -> Result<Histogram<u64>, String> {
    let s = sim::scenario_file::scenario(scenario).ok_or(format!("no scenario {scenario}"))?;
    let mut h = histogram();
    for seed in 0..seeds {
        let o = sim::run_fast(&s, seed);
        if let Some(f) = &o.failure {
            return Err(format!("seed {seed} broke a rule: {f}"));
        }
        for us in o.times.submit_to_placed() {
            record(&mut h, us);
        }
    }
    Ok(h)
}

// ---- (3) the node on loopback ----------------------------------------------------------

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Builds `millrace` (release) from this workspace; returns its path.
fn build_node() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("MILLRACE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let root = workspace();
    eprintln!("node: cargo build --release -p node --bin millrace (progress below)");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "-p", "node", "--bin", "millrace"])
        .current_dir(&root)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build of the node failed ({status})"));
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let bin = target.join("release").join("millrace");
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!("built, but {} is missing", bin.display()))
    }
}

/// Runs `millrace bench` with `args`; parses its submit → committed percentiles.
fn node_bench(bin: &Path, args: &[&str]) -> Result<(Quant, String), String> {
    let out = Command::new(bin)
        .env("RUST_LOG", "warn")
        .arg("bench")
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        return Err(format!(
            "millrace bench failed ({}): {}",
            out.status,
            text.trim()
        ));
    }
    // "jobs committed: N (...)" and
    // "submit -> committed: p50 X ms, p90 X ms, p99 X ms, p999 X ms, max X ms".
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("submit -> committed:"))
        .ok_or_else(|| format!("no percentiles in the output: {}", text.trim()))?;
    let mut v = BTreeMap::new();
    for part in line.split(',') {
        let mut w = part.split_whitespace();
        if let (Some(k), Some(x)) = (w.next(), w.next()) {
            if let Ok(x) = x.parse::<f64>() {
                v.insert(k.to_string(), (x * 1000.0) as u64);
            }
        }
    }
    let get = |k: &str| v.get(k).copied().ok_or(format!("no {k} in: {line}"));
    let n = text
        .lines()
        .find_map(|l| l.strip_prefix("jobs committed:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let q = Quant {
        n,
        p50: get("p50")?,
        p90: get("p90")?,
        p99: get("p99")?,
        p999: get("p999")?,
        max: get("max")?,
    };
    let placements = text
        .lines()
        .find(|l| l.starts_with("placements/s:"))
        .unwrap_or("")
        .trim()
        .to_string();
    Ok((q, placements))
}

// ---- the report ----------------------------------------------------------------------

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into());
    let rustc = Command::new("rustc")
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    format!("{cpu}, {cores} cores, load average {load} (1/5/15 min) at the start; {rustc}")
}

/// Now, UTC, as `YYYY-MM-DD HH:MM` (civil from days, H. Hinnant's algorithm).
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60
    )
}

fn latency_table(rows: &[Row]) -> String {
    let mut t = String::new();
    t.push_str("| what | 'committed' is | jobs | p50 | p90 | p99 | p999 | max | notes |\n");
    t.push_str("|---|---|---:|---:|---:|---:|---:|---:|---|\n");
    for r in rows {
        match &r.result {
            Ok(q) => {
                let _ = writeln!(
                    t,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    r.what,
                    r.committed,
                    q.n,
                    ms(q.p50),
                    ms(q.p90),
                    ms(q.p99),
                    ms(q.p999),
                    ms(q.max),
                    r.note
                );
            }
            Err(why) => {
                let _ = writeln!(
                    t,
                    "| {} | {} | — | — | — | — | — | — | **did not run: {}** |",
                    r.what,
                    r.committed,
                    why.replace('|', "/")
                );
            }
        }
    }
    t
}

fn quality_table(reports: &[sim::quality::Report]) -> String {
    let f = |us: f64| format!("{:.1} ms", us / 1000.0);
    let mut t = String::new();
    t.push_str("| load | jobs (measured) | millrace mean | ideal mean | mean ratio | millrace p99 | ideal p99 | p99 ratio | submit → placed p50 / p99 | ideal mean wait | ideal + protocol trips (2 direct, 4 by bid) mean / p99 |\n");
    t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in reports {
        let _ = writeln!(
            t,
            "| {:.0}% | {} ({}) | {} | {} | **{:.3}** | {} | {} | {:.3} | {} / {} | {} | {} / {}{} |",
            r.setup.load * 100.0,
            r.jobs,
            r.measured,
            f(r.mill.mean),
            f(r.ideal.mean),
            r.mean_ratio(),
            f(r.mill.p99 as f64),
            f(r.ideal.p99 as f64),
            r.p99_ratio(),
            f(r.placed.p50 as f64),
            f(r.placed.p99 as f64),
            f(r.ideal_wait_mean),
            f(r.protocol.mean),
            f(r.protocol.p99 as f64),
            match (&r.failure, r.missing, r.unsuccessful) {
                (Some(v), _, _) => format!(" — **run broke a rule: {v}**"),
                (None, 0, 0) => String::new(),
                (None, 0, n) => format!(" — **{n} jobs did not succeed**"),
                (None, n, _) => format!(" — **{n} jobs never ended**"),
            }
        );
    }
    t
}

/// Replaces the text between `begin` and `end` in `doc`, or appends the section under
/// `heading` when neither marker is there. A lone marker, markers out of order or a marker
/// twice is an error: rewriting would duplicate the section or swallow text around it.
fn splice(doc: &str, begin: &str, end: &str, body: &str, heading: &str) -> Result<String, String> {
    let count = |m: &str| doc.matches(m).count();
    match (doc.find(begin), doc.find(end)) {
        _ if count(begin) > 1 || count(end) > 1 => {
            Err(format!("{begin} or {end} appears more than once"))
        }
        (Some(b), Some(e)) if b < e => Ok(format!("{}{begin}\n{body}{}", &doc[..b], &doc[e..])),
        (None, None) => Ok(format!(
            "{}\n\n{heading}\n\n{begin}\n{body}{end}\n",
            doc.trim_end()
        )),
        _ => Err(format!("{begin} and {end} are not a begin/end pair")),
    }
}

/// The rewritten BENCHMARKS.md: its text with both sections replaced (a missing file starts
/// empty; any other read error is an error, never a reason to overwrite the file).
fn rewrite(path: &Path, lat_body: &str, qual_body: &str) -> Result<String, String> {
    let doc = match std::fs::read_to_string(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "# Benchmarks\n".into(),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let doc = splice(
        &doc,
        LAT_BEGIN,
        LAT_END,
        lat_body,
        "## Submit → committed latency (latency-report)",
    )?;
    splice(
        &doc,
        Q_BEGIN,
        Q_END,
        qual_body,
        "## Placement quality against an omniscient scheduler",
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let write = !quick && !args.iter().any(|a| a == "--no-write");
    if let Some(a) = args.iter().find(|a| *a != "--quick" && *a != "--no-write") {
        eprintln!("error: unknown argument {a:?} (known: --quick, --no-write)");
        return ExitCode::from(2);
    }
    let began = Instant::now();
    let machine = machine();
    let date = utc_now();
    let mut rows = Vec::new();

    // (1) The core in process.
    let secs = if quick { 0.5 } else { 3.0 };
    for rate in [5_000.0, 20_000.0] {
        eprintln!("[1/4] core in process: Poisson {rate}/s for {secs} s ...");
        let r = core_in_process(rate, secs, 100, 16);
        let stall = r.as_ref().map_or(Duration::ZERO, |(_, s)| *s);
        rows.push(Row {
            what: format!("core in process, Poisson {rate:.0} jobs/s for {secs} s, 100 executors × 16 seats"),
            committed: "end of the mill step that publishes the lease (`Placed`; its `Persist` and `CommitLease` are that step's outputs), wall clock".into(),
            result: r.map(|(h, _)| Quant::of(&h)),
            note: format!("one thread serves submits and executor replies in arrival order; executors accept every ask at once; jobs run an exponential 50 ms; no store; longest stall of the thread between two inputs: {:.1} ms", stall.as_secs_f64() * 1000.0),
        });
    }

    // (2) The simulator, virtual time.
    let sims: [(&str, u64, &str); 3] = [
        ("calm", 50, "no faults; 3 executors, 60 jobs over 60 s"),
        (
            "smoke",
            50,
            "swarm faults over every family; 3 executors, 60 jobs",
        ),
        (
            "fleet-5x1000",
            10,
            "swarm faults; 5 executors, 1,000 jobs over 9 min",
        ),
    ];
    for (name, seeds, about) in sims {
        let seeds = if quick { seeds.min(3) } else { seeds };
        eprintln!("[2/4] simulator: {name}, seeds 0..{seeds} ...");
        rows.push(Row {
            what: format!("simulator `{name}`, seeds 0..{seeds}"),
            committed: "the mill publishes the lease (`Observation::Placed`; the sim's store write is instantaneous), virtual time".into(),
            result: sim_latency(name, seeds).map(|h| Quant::of(&h)),
            note: format!("{about}; 0.1–1 ms network, 1% tail to 150 ms; first placement of each job; includes waiting for a seat"),
        });
    }

    // (3) The node on loopback.
    eprintln!("[3/4] node on loopback ...");
    let node_runs: [(&str, Vec<&str>); 2] = [
        (
            "200 jobs/s",
            vec![
                "--executors",
                "10",
                "--seats",
                "64",
                "--jobs",
                if quick { "200" } else { "2000" },
                "--concurrency",
                "4",
                "--rate",
                "200",
            ],
        ),
        (
            "1,000 jobs/s",
            vec![
                "--executors",
                "10",
                "--seats",
                "64",
                "--jobs",
                if quick { "1000" } else { "5000" },
                "--concurrency",
                "16",
                "--rate",
                "1000",
            ],
        ),
    ];
    match build_node() {
        Err(why) => {
            for (rate, _) in &node_runs {
                rows.push(Row {
                    what: format!("node on loopback, {rate}"),
                    committed: "—".into(),
                    result: Err(why.clone()),
                    note: String::new(),
                });
            }
        }
        Ok(bin) => {
            for (rate, a) in &node_runs {
                eprintln!("  millrace bench {} ...", a.join(" "));
                let r = node_bench(&bin, a);
                let (result, placements) = match r {
                    Ok((q, p)) => (Ok(q), p),
                    Err(e) => (Err(e), String::new()),
                };
                rows.push(Row {
                    what: format!("node on loopback, {rate}: `millrace bench {}`", a.join(" ")),
                    committed: "the mill's driver acts on the job's durable `Running` state (after `CommitResult`), wall clock from before `POST /v1/jobs`".into(),
                    result,
                    note: format!("real SQLite store (WAL, synchronous=FULL) in a temp dir, HTTP submitters, fake executors over loopback TCP; {placements}"),
                });
            }
        }
    }

    // (4) Placement quality.
    let mut reports = Vec::new();
    for load in [0.5, 0.8, 0.9] {
        eprintln!("[4/4] placement quality at {:.0}% load ...", load * 100.0);
        let mut setup = sim::quality::Setup::sparrow(load);
        if quick {
            setup.executors = 100;
            setup.arrival = 2 * sim::scenario::SEC;
        }
        reports.push(sim::quality::run(&setup));
    }

    let lat = latency_table(&rows);
    let qual = quality_table(&reports);
    let took = began.elapsed().as_secs();
    let command = format!(
        "cargo run --release -p benches --bin latency-report{}",
        if quick { " -- --quick" } else { "" }
    );
    let lat_body = format!(
        "Command: `{command}` ({date}; took {took} s). Machine: {machine}.\n\n{lat}\n\
Latency is from the submit to the moment named in the second column. The core row is the \
core's own cost plus queueing behind other inputs on one thread; the simulator rows are \
protocol round trips and waiting for seats in virtual time (no CPU cost); the node rows add \
HTTP, SQLite fsyncs and thread hand-offs.\n"
    );
    let s = &reports.first().map(|r| r.setup.clone());
    let qual_body = format!(
        "Command: `{command}` (or `millrace-sim quality`; {date}). In the simulator: {} executors \
with one seat each, exponential job durations with mean {} ms, a constant {} ms one-way \
network latency on every packet, Poisson arrivals over {} s at rate = load × executors ÷ \
mean, no faults, mill defaults (top_k {}); jobs arriving in the first {} s are warm-up and \
not measured. **Response** (millrace) = submit → the mill writes the job's terminal state. \
**Ideal** = an exact FCFS M/M/{} event simulation on the same arrivals and durations (each \
job starts at once on any free executor, else waits in one global FIFO queue) + 2 × {} ms \
of network (deliver the job, return the result): wait + duration + {} ms.\n\n{qual}\n",
        s.as_ref().map_or(0, |s| s.executors),
        s.as_ref().map_or(0, |s| s.job_mean / 1000),
        s.as_ref().map_or(0, |s| s.latency / 1000),
        s.as_ref().map_or(0, |s| s.arrival / sim::scenario::SEC),
        reports.first().map_or(0, |r| r.top_k),
        s.as_ref().map_or(0, |s| s.warmup / sim::scenario::SEC),
        s.as_ref().map_or(0, |s| s.executors),
        s.as_ref().map_or(0, |s| s.latency / 1000),
        s.as_ref().map_or(0, |s| 2 * s.latency / 1000),
    );
    println!("{lat_body}\n{qual_body}");
    let mut failed = false;
    for r in &rows {
        if let Err(why) = &r.result {
            failed = true;
            eprintln!("error: {} did not run: {why}", r.what);
        }
    }
    for r in &reports {
        if r.failure.is_some() || r.missing > 0 || r.unsuccessful > 0 {
            failed = true;
            eprintln!(
                "error: placement quality at {:.0}% load is not a clean run (see its row)",
                r.setup.load * 100.0
            );
        }
    }
    if write {
        let path = workspace().join("BENCHMARKS.md");
        let written = rewrite(&path, &lat_body, &qual_body).and_then(|doc| {
            std::fs::write(&path, doc).map_err(|e| format!("cannot write {}: {e}", path.display()))
        });
        match written {
            Ok(()) => eprintln!("wrote {}", path.display()),
            Err(e) => {
                eprintln!("error: {e}; BENCHMARKS.md left as it was");
                return ExitCode::from(1);
            }
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splice_replaces_only_its_section() {
        let doc = "# B\n\nbefore\n<!-- a -->\nold\n<!-- b -->\nafter\n";
        let out = splice(doc, "<!-- a -->", "<!-- b -->", "new\n", "## H").unwrap();
        assert_eq!(out, "# B\n\nbefore\n<!-- a -->\nnew\n<!-- b -->\nafter\n");
    }

    #[test]
    fn splice_appends_a_missing_section() {
        let out = splice("# B\n", "<!-- a -->", "<!-- b -->", "new\n", "## H").unwrap();
        assert_eq!(out, "# B\n\n## H\n\n<!-- a -->\nnew\n<!-- b -->\n");
    }

    #[test]
    fn splice_refuses_broken_markers() {
        for doc in [
            "x <!-- a --> y",
            "x <!-- b --> y",
            "<!-- b --> x <!-- a -->",
            "<!-- a --> 1 <!-- b --> 2 <!-- a --> 3 <!-- b -->",
        ] {
            assert!(
                splice(doc, "<!-- a -->", "<!-- b -->", "new\n", "## H").is_err(),
                "{doc}"
            );
        }
    }

    #[test]
    fn an_unreadable_benchmarks_file_is_not_overwritten() {
        // A directory where the file should be: reading fails with something other than
        // NotFound, and rewrite must refuse rather than start from an empty document.
        let dir = std::env::temp_dir().join(format!("latency-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(rewrite(&dir, "l\n", "q\n").is_err());
        let missing = dir.join("absent.md");
        let doc = rewrite(&missing, "l\n", "q\n").unwrap();
        assert!(doc.starts_with("# Benchmarks\n"), "{doc}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
