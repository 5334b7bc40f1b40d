//! `millrace-sim`: fuzz seeds, replay one, list scenarios, measure placement quality.
//!
//! Exit codes: 0 all good, 1 an invariant failed, 2 bad arguments.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use sim::coverage::Coverage;
use sim::report::{failure_report, REPORT_LINES};
use sim::scenario::{Scenario, SEC};
use sim::scenario_file::{self, LoadError};
use sim::trace::Trace;

/// Prints a line; a closed stdout (`| head`) is not worth a panic.
macro_rules! out {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// The simulator allocates and frees small maps and strings at a high rate (the core's
/// messages and snapshots); mimalloc makes that about a fifth cheaper than the system
/// allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "millrace-sim",
    about = "millrace's deterministic simulator",
    version
)]
struct Cli {
    /// Loads the scenario library from this directory instead of the files embedded at
    /// build time (the workspace's `scenarios/`).
    #[arg(long, global = true)]
    scenarios: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// Which scenario: one of the library by name, or an ad-hoc file.
#[derive(clap::Args)]
struct Which {
    /// The scenario (see `list`).
    #[arg(long, default_value = "smoke")]
    scenario: String,
    /// Runs the scenario in this TOML file instead (see scenarios/README.md).
    #[arg(long, conflicts_with = "scenario")]
    scenario_file: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Runs seeds start..start+N, stopping at the first failure (exit 1). With
    /// `--all-scenarios`, a campaign: N seeds of every scenario of the library, a summary
    /// table, every failure with its replay command (exit 1 if any).
    Fuzz {
        /// How many seeds (per scenario with `--all-scenarios`).
        #[arg(long)]
        seeds: u64,
        /// The first seed.
        #[arg(long, default_value_t = 0)]
        start: u64,
        /// Runs every scenario of the library (`list`), not just one.
        #[arg(long, conflicts_with_all = ["scenario", "scenario_file"])]
        all_scenarios: bool,
        /// Worker threads for `--all-scenarios` (1..=64).
        #[arg(long, default_value_t = 1)]
        jobs: usize,
        /// With `--all-scenarios`: leave out this scenario (repeatable), e.g. a slow one
        /// run separately with fewer seeds.
        #[arg(long, requires = "all_scenarios")]
        except: Vec<String>,
        #[command(flatten)]
        which: Which,
    },
    /// Runs one seed, prints the invariant outcome and the trace hash.
    Replay {
        /// The seed.
        #[arg(long)]
        seed: u64,
        #[command(flatten)]
        which: Which,
        /// Writes the full trace (one line per event) to this file.
        #[arg(long)]
        trace: Option<std::path::PathBuf>,
        /// Writes a self-contained HTML timeline of the run to this file.
        #[arg(long)]
        html: Option<std::path::PathBuf>,
    },
    /// Shrinks a failing seed: delta debugging over its faults, then its jobs, keeping the
    /// same invariant failing; writes a scenario file that fails on its own.
    Shrink {
        /// The failing seed.
        #[arg(long)]
        seed: u64,
        #[command(flatten)]
        which: Which,
        /// Where to write the shrunk scenario file.
        #[arg(long, default_value = "shrunk.toml")]
        out: std::path::PathBuf,
        /// The most simulator runs to spend (1..=100000).
        #[arg(long, default_value_t = 2000)]
        max_runs: usize,
    },
    /// Lists the scenario library: name and what each exercises.
    List,
    /// Placement quality against an omniscient scheduler (Sparrow-style; see `sim::quality`).
    Quality {
        /// Offered loads, comma-separated.
        #[arg(long, default_value = "0.5,0.8,0.9", value_delimiter = ',')]
        loads: Vec<f64>,
        /// One-seat executors.
        #[arg(long, default_value_t = 1000)]
        executors: usize,
        /// Seconds of arrivals (the first second is warm-up).
        #[arg(long, default_value_t = 6)]
        seconds: u64,
        /// The mill's top_k (executors asked per placement); default: the mill's default.
        #[arg(long)]
        top_k: Option<usize>,
        /// The seed of arrivals and durations.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Bid for every job (M12) instead of placing directly (M35), to compare.
        #[arg(long)]
        bid: bool,
        /// Leave a job with no free seat queued instead of staging it on a full executor
        /// (M36), to compare.
        #[arg(long)]
        no_late_binding: bool,
    },
}

/// The library: embedded, or loaded from `--scenarios DIR`.
fn library(dir: Option<&std::path::Path>) -> Result<Vec<Scenario>, ExitCode> {
    let loaded: Result<Vec<Scenario>, LoadError> = match dir {
        Some(d) => scenario_file::load_dir(d),
        None => scenario_file::embedded(),
    };
    loaded.map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })
}

fn find(dir: Option<&std::path::Path>, which: &Which) -> Result<Scenario, ExitCode> {
    if let Some(path) = &which.scenario_file {
        return scenario_file::load_file(path).map_err(|e| {
            eprintln!("error: {e}");
            ExitCode::from(2)
        });
    }
    let all = library(dir)?;
    let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
    let list = names.join(", ");
    all.iter()
        .find(|s| s.name == which.scenario)
        .cloned()
        .ok_or_else(|| {
            eprintln!(
                "error: unknown scenario {:?}; known: {list} (see `millrace-sim list`)",
                which.scenario
            );
            ExitCode::from(2)
        })
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                    ExitCode::SUCCESS
                }
                _ => ExitCode::from(2),
            };
        }
    };
    let dir = cli.scenarios.as_deref();
    match cli.command {
        Command::List => match library(dir) {
            Ok(all) => {
                let width = all.iter().map(|s| s.name.len()).max().unwrap_or(0);
                for s in all {
                    out!("{:<width$}  {}", s.name, s.about);
                }
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Quality {
            loads,
            executors,
            seconds,
            top_k,
            seed,
            bid,
            no_late_binding,
        } => quality(
            &loads,
            executors,
            seconds,
            top_k,
            seed,
            !bid,
            !no_late_binding,
        ),
        Command::Fuzz {
            seeds,
            start,
            all_scenarios: true,
            jobs,
            except,
            ..
        } => match library(dir) {
            Ok(all) => {
                if let Some(unknown) = except.iter().find(|e| !all.iter().any(|s| &s.name == *e)) {
                    eprintln!("error: --except {unknown}: no such scenario (see `list`)");
                    return ExitCode::from(2);
                }
                let kept: Vec<Scenario> = all
                    .into_iter()
                    .filter(|s| !except.contains(&s.name))
                    .collect();
                if kept.is_empty() {
                    eprintln!("error: --except leaves no scenario to run");
                    return ExitCode::from(2);
                }
                campaign(&kept, start, seeds, jobs)
            }
            Err(code) => code,
        },
        Command::Fuzz {
            seeds,
            start,
            which,
            ..
        } => match find(dir, &which) {
            Ok(s) => fuzz(&s, start, seeds),
            Err(code) => code,
        },
        Command::Shrink {
            seed,
            which,
            out,
            max_runs,
        } => match (find(dir, &which), text_of(dir, &which)) {
            (Ok(s), Ok(text)) => shrink(&s, &text, seed, &out, max_runs),
            (Err(code), _) | (_, Err(code)) => code,
        },
        Command::Replay {
            seed,
            which,
            trace,
            html,
        } => match find(dir, &which) {
            Ok(s) => {
                let code = replay(&s, seed, trace);
                match html {
                    Some(path) => match timeline(&s, seed, &path) {
                        Ok(()) => code,
                        Err(c) => c,
                    },
                    None => code,
                }
            }
            Err(code) => code,
        },
    }
}

/// `replay --html`: runs the seed again keeping its last trace lines and draws them.
fn timeline(s: &Scenario, seed: u64, path: &std::path::Path) -> Result<(), ExitCode> {
    let o = sim::run(s, seed, Trace::on(sim::timeline::MAX_LINES, None));
    let title = format!("{} seed {seed}", s.name);
    let failure = o.failure.as_ref().map(|v| {
        (
            o.end as f64 / SEC as f64,
            format!("{}: {}", v.rule, v.message),
        )
    });
    let page = sim::timeline::html(&title, &o.last_lines, o.trace_lines, failure);
    std::fs::write(path, page).map_err(|e| {
        eprintln!("error: writing {}: {e}", path.display());
        ExitCode::from(2)
    })?;
    out!(
        "  timeline: {} ({} trace lines, trace-hash {})",
        path.display(),
        o.trace_lines,
        o.trace_hash.unwrap_or_default()
    );
    Ok(())
}

/// The text of the scenario's file (to copy into a shrunk file).
fn text_of(dir: Option<&std::path::Path>, which: &Which) -> Result<String, ExitCode> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).map_err(|e| {
            eprintln!("error: {}: {e}", path.display());
            ExitCode::from(2)
        })
    };
    if let Some(path) = &which.scenario_file {
        return read(path);
    }
    if let Some(d) = dir {
        return read(&d.join(format!("{}.toml", which.scenario)));
    }
    scenario_file::embedded_texts()
        .find(|(name, _)| *name == which.scenario)
        .map(|(_, text)| text.to_string())
        .ok_or_else(|| {
            eprintln!(
                "error: unknown scenario {:?} (see `millrace-sim list`)",
                which.scenario
            );
            ExitCode::from(2)
        })
}

fn shrink(s: &Scenario, text: &str, seed: u64, out: &std::path::Path, max_runs: usize) -> ExitCode {
    if !(1..=100_000).contains(&max_runs) {
        eprintln!("error: --max-runs must be 1..=100000, not {max_runs}");
        return ExitCode::from(2);
    }
    let shrunk = match sim::shrink::shrink(s, seed, max_runs, &mut |line| eprintln!("{line}")) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let toml = sim::shrink::write_toml(text, s, seed, &shrunk);
    if let Err(e) = std::fs::write(out, &toml) {
        eprintln!("error: writing {}: {e}", out.display());
        return ExitCode::from(2);
    }
    out!(
        "{} seed {seed} fails {}: shrunk from {} faults and {} jobs to {} faults and {} jobs in {} runs{}",
        s.name,
        shrunk.rule,
        shrunk.before.0,
        shrunk.before.1,
        shrunk.keep.faults.len(),
        shrunk.keep.jobs.len(),
        shrunk.runs,
        if shrunk.capped { " (stopped at --max-runs: not minimal)" } else { "" }
    );
    out!("  wrote {}", out.display());
    out!(
        "  replay: cargo run --release -p sim -- replay --scenario-file {} --seed {seed}",
        out.display()
    );
    ExitCode::SUCCESS
}

fn fuzz(s: &Scenario, start: u64, seeds: u64) -> ExitCode {
    if seeds == 0 {
        eprintln!("error: --seeds must be at least 1");
        return ExitCode::from(2);
    }
    let Some(end) = start.checked_add(seeds) else {
        eprintln!("error: --start + --seeds overflows u64");
        return ExitCode::from(2);
    };
    let bar = ProgressBar::new(seeds);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} seeds  {per_sec}  eta {eta}  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let began = Instant::now();
    let mut coverage = Coverage::default();
    let mut sim_time: u64 = 0;
    let mut accepted: u64 = 0;
    let (mut late_ticks, mut max_late) = (0u64, 0u64);
    for seed in start..end {
        let o = sim::run_fast(s, seed);
        coverage.add(&o.coverage);
        sim_time += o.end;
        accepted += o.stats.accepted;
        late_ticks += o.stats.late_ticks;
        max_late = max_late.max(o.stats.max_tick_lateness);
        bar.inc(1);
        if o.failure.is_some() {
            bar.abandon();
            let traced = sim::run_traced(s, seed, REPORT_LINES);
            out!("{}", failure_report(&o, Some(&traced)));
            out!(
                "  shrink: cargo run --release -p sim -- shrink --seed {seed} --scenario {} --out shrunk-{seed}.toml",
                s.name
            );
            return ExitCode::from(1);
        }
    }
    bar.finish_and_clear();
    let wall = began.elapsed().as_secs_f64();
    out!(
        "{seeds} seeds of {} passed (seeds {start}..{end}) in {wall:.2}s",
        s.name
    );
    out!("  {:.1} seeds/s", seeds as f64 / wall.max(1e-9));
    out!(
        "  simulated {:.0}s in all: {:.0}x simulated ÷ wall time",
        sim_time as f64 / SEC as f64,
        sim_time as f64 / SEC as f64 / wall.max(1e-9)
    );
    out!("  jobs accepted: {accepted}");
    out!(
        "  driver lag (I12): {late_ticks} ticks late, the latest by {:.3}s",
        max_late as f64 / SEC as f64
    );
    out!("  rare paths (* = required):");
    let _ = write!(std::io::stdout(), "{coverage}");
    let missed: Vec<&str> = s
        .expect
        .reach
        .iter()
        .filter(|p| coverage.get(**p) == 0)
        .map(|p| p.key())
        .collect();
    if !missed.is_empty() {
        out!(
            "  note: the scenario expects these rare paths, not reached over these seeds: {}",
            missed.join(", ")
        );
    }
    let _ = std::io::stdout().flush();
    ExitCode::SUCCESS
}

/// One scenario's tally in a campaign.
#[derive(Default)]
struct Tally {
    seeds: u64,
    failures: u64,
    /// Wall time spent on its seeds, summed over workers.
    busy: f64,
    simulated: u64,
}

/// The most failures a campaign lists one by one.
const MAX_LISTED: usize = 50;

/// `fuzz --all-scenarios`: `seeds` fresh seeds of every scenario, on `jobs` threads. A
/// failure does not stop the campaign; each is listed with its replay command.
fn campaign(all: &[Scenario], start: u64, seeds: u64, jobs: usize) -> ExitCode {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    if seeds == 0 {
        eprintln!("error: --seeds must be at least 1");
        return ExitCode::from(2);
    }
    if !(1..=64).contains(&jobs) {
        eprintln!("error: --jobs must be 1..=64, not {jobs}");
        return ExitCode::from(2);
    }
    if start.checked_add(seeds).is_none() {
        eprintln!("error: --start + --seeds overflows u64");
        return ExitCode::from(2);
    }
    let Some(total) = seeds.checked_mul(all.len() as u64) else {
        eprintln!("error: --seeds × scenarios overflows u64");
        return ExitCode::from(2);
    };
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} seeds  {per_sec}  eta {eta}  failures: {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("0");
    let next = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let tallies: Mutex<Vec<Tally>> = Mutex::new(all.iter().map(|_| Tally::default()).collect());
    // (scenario index, seed, what failed), in the order found.
    let failures: Mutex<Vec<(usize, u64, String)>> = Mutex::new(Vec::new());
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let began = Instant::now();
    // Seeds are dealt round-robin over the scenarios, so a partial run covers them all.
    let n = all.len() as u64;
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= total {
                    break;
                }
                let (si, seed) = ((k % n) as usize, start + k / n);
                let t0 = Instant::now();
                let o = sim::run_fast(&all[si], seed);
                let spent = t0.elapsed().as_secs_f64();
                if let Ok(mut t) = tallies.lock() {
                    let t = &mut t[si];
                    t.seeds += 1;
                    t.busy += spent;
                    t.simulated += o.end;
                    if o.failure.is_some() {
                        t.failures += 1;
                    }
                }
                if let Some(v) = &o.failure {
                    let f = failed.fetch_add(1, Ordering::Relaxed) + 1;
                    bar.set_message(f.to_string());
                    let line = format!("FAILED: {} seed {seed}: {v}", all[si].name);
                    if tty {
                        bar.println(line);
                    } else {
                        eprintln!("{line}"); // a hidden bar prints nothing
                    }
                    if let Ok(mut list) = failures.lock() {
                        list.push((si, seed, v.to_string()));
                    }
                }
                bar.inc(1);
                // The bar is hidden when stderr is not a terminal (a background run): a plain
                // line every 2,000 seeds instead.
                let done = k + 1;
                if !tty && done % 2000 == 0 {
                    eprintln!(
                        "{done}/{total} seeds dealt, {} failures, {:.1} seeds/s",
                        failed.load(Ordering::Relaxed),
                        done as f64 / began.elapsed().as_secs_f64().max(1e-9)
                    );
                }
            });
        }
    });
    bar.finish_and_clear();
    let wall = began.elapsed().as_secs_f64().max(1e-9);
    let tallies = tallies.into_inner().unwrap_or_default();
    let failures = failures.into_inner().unwrap_or_default();
    let width = all.iter().map(|s| s.name.len()).max().unwrap_or(8).max(8);
    out!(
        "| {:<width$} | seeds | failures | seeds/s (one worker) |",
        "scenario"
    );
    out!(
        "|{}|------:|---------:|---------------------:|",
        "-".repeat(width + 2)
    );
    for (s, t) in all.iter().zip(&tallies) {
        out!(
            "| {:<width$} | {:>5} | {:>8} | {:>20.1} |",
            s.name,
            t.seeds,
            t.failures,
            t.seeds as f64 / t.busy.max(1e-9)
        );
    }
    let done: u64 = tallies.iter().map(|t| t.seeds).sum();
    let simulated: u64 = tallies.iter().map(|t| t.simulated).sum();
    out!(
        "{done} seeds ({seeds} per scenario × {} scenarios, seeds {start}..{}), {} failures, in {wall:.0}s on {jobs} worker(s): {:.1} seeds/s, {:.0}x simulated ÷ wall time",
        all.len(),
        start + seeds,
        failures.len(),
        done as f64 / wall,
        simulated as f64 / SEC as f64 / wall
    );
    if failures.is_empty() {
        return ExitCode::SUCCESS;
    }
    out!("failures:");
    for (si, seed, what) in failures.iter().take(MAX_LISTED) {
        out!("  {} seed {seed}: {what}", all[*si].name);
        out!(
            "    replay: {}",
            sim::report::replay_command(&all[*si].name, *seed)
        );
    }
    if failures.len() > MAX_LISTED {
        out!("  … and {} more", failures.len() - MAX_LISTED);
    }
    ExitCode::from(1)
}

fn replay(s: &Scenario, seed: u64, trace: Option<std::path::PathBuf>) -> ExitCode {
    let file = match &trace {
        Some(path) => match std::fs::File::create(path) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("error: cannot write the trace to {}: {e}", path.display());
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let began = Instant::now();
    let o = sim::run(s, seed, Trace::on(REPORT_LINES, file));
    let wall = began.elapsed().as_secs_f64();
    let code = match &o.failure {
        None => {
            out!(
                "seed {seed} of {}: every invariant held ({} jobs accepted, ended at {:.1}s simulated, {:.3}s wall)",
                s.name,
                o.stats.accepted,
                o.end as f64 / SEC as f64,
                wall
            );
            out!("  fault families on: {}", o.plan.swarm);
            out!("  faults: {}", o.plan.faults.faults.len());
            out!(
                "  events {}, mill steps {}, executor steps {}, packets {}, violations observed {}",
                o.stats.events,
                o.stats.mill_steps,
                o.stats.exec_steps,
                o.stats.packets,
                o.stats.violations
            );
            ExitCode::SUCCESS
        }
        Some(_) => {
            out!("{}", failure_report(&o, None));
            ExitCode::from(1)
        }
    };
    if let Some(path) = trace {
        out!("  trace: {} lines in {}", o.trace_lines, path.display());
    }
    out!("trace-hash: {}", o.trace_hash.unwrap_or_default());
    code
}

fn quality(
    loads: &[f64],
    executors: usize,
    seconds: u64,
    top_k: Option<usize>,
    seed: u64,
    direct: bool,
    late_binding: bool,
) -> ExitCode {
    let mut failed = false;
    let trips = if direct { 2 } else { 4 };
    out!("| load | jobs measured | top_k | millrace mean | ideal mean | mean ratio | millrace p99 | ideal p99 | p99 ratio | submit→placed p50 / p99 | ideal + {trips} trips mean / p99 | wall |");
    out!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &load in loads {
        let mut setup = sim::quality::Setup::sparrow(load);
        setup.executors = executors;
        setup.arrival = seconds.max(2) * SEC;
        setup.top_k = top_k;
        setup.seed = seed;
        setup.direct = direct;
        setup.late_binding = late_binding;
        eprintln!("quality: load {load} ...");
        let began = Instant::now();
        let r = sim::quality::run(&setup);
        let wall = began.elapsed().as_secs_f64();
        let ms = |us: f64| us / 1000.0;
        out!(
            "| {:.0}% | {} | {} | {:.1} ms | {:.1} ms | {:.3} | {:.1} ms | {:.1} ms | {:.3} | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {wall:.1} s |",
            load * 100.0,
            r.measured,
            r.top_k,
            ms(r.mill.mean),
            ms(r.ideal.mean),
            r.mean_ratio(),
            ms(r.mill.p99 as f64),
            ms(r.ideal.p99 as f64),
            r.p99_ratio(),
            ms(r.placed.p50 as f64),
            ms(r.placed.p99 as f64),
            ms(r.protocol.mean),
            ms(r.protocol.p99 as f64),
        );
        if let Some(f) = &r.failure {
            failed = true;
            eprintln!("  load {load}: the run broke a rule: {f}");
        }
        if r.missing > 0 {
            failed = true;
            eprintln!("  load {load}: {} measured jobs never ended", r.missing);
        }
        if r.unsuccessful > 0 {
            failed = true;
            eprintln!(
                "  load {load}: {} measured jobs did not succeed (their response times are not comparable)",
                r.unsuccessful
            );
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
