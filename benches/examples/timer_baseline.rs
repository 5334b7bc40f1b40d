//! Issue 10's done-when: 1,000,000 jobs submitted and ended in process leave the mill's
//! timer count and memory at their baseline (STYLE 13: nothing that ended keeps a deadline).
//!
//! `cargo run --release -p benches --example timer_baseline -- 1000000` runs ARG1 jobs (default
//! 1,000,000) through a mill with 4 fake executors (`benches::Fleet`): each round places
//! 1,000 jobs (submit → asks → accept → commit → running) and ends them with one batch of
//! `Success` terminals per executor. It prints the mill's timer count and the process's
//! resident memory (`/proc/self/statm`) before any job, after a warm-up round (the baseline:
//! allocator pools and the mill's maps at their working size) and every 100,000 jobs, and
//! exits non-zero if the timer count differs from the idle one or resident memory grew by
//! more than 8 MiB over the baseline. (Before the timer table, each ended job left its 24 h
//! timeout behind: about 79 bytes and one timer per job.)

use std::collections::BTreeMap;
use std::time::Instant;

use millrace_core::types::{ConnId, LeaseId};

const ROUND: usize = 1_000;
/// Growth of resident memory over the warmed-up baseline that counts as a leak.
const SLACK_BYTES: u64 = 8 << 20;

/// Resident set size in bytes (Linux), 0 where `/proc` is missing.
fn rss_bytes() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// Places `ROUND` jobs and ends them all; returns how many ended.
fn round(fleet: &mut benches::Fleet) -> usize {
    let mut by_conn: BTreeMap<ConnId, Vec<LeaseId>> = BTreeMap::new();
    for _ in 0..ROUND {
        let (conn, lease) = fleet.place_one();
        by_conn.entry(conn).or_default().push(lease);
    }
    fleet.consume();
    let mut ended = 0;
    for (conn, leases) in by_conn {
        fleet.finish(conn, &leases);
        ended += leases.len();
    }
    ended
}

fn main() {
    let jobs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let rounds = jobs.div_ceil(ROUND).max(2);
    let mut fleet = benches::Fleet::new(4, 2_000);
    fleet.consume();
    let idle_timers = fleet.mill.timer_count();
    println!(
        "before any job: {idle_timers} timers (the 4 sessions' silence deadlines), rss {:.1} MiB",
        mib(rss_bytes())
    );
    let start = Instant::now();
    let mut ended = round(&mut fleet);
    let base_timers = fleet.mill.timer_count();
    let base_rss = rss_bytes();
    println!(
        "baseline after {ended} jobs: {base_timers} timers, {} jobs pending, rss {:.1} MiB",
        fleet.mill.pending(),
        mib(base_rss)
    );
    let mut peak_rss = base_rss;
    for r in 1..rounds {
        ended += round(&mut fleet);
        peak_rss = peak_rss.max(rss_bytes());
        if (r + 1) % 100 == 0 || r + 1 == rounds {
            println!(
                "after {ended:>9} jobs: {:>2} timers, {} leases, rss {:.1} MiB ({:+.2} MiB)",
                fleet.mill.timer_count(),
                fleet.mill.leases().count(),
                mib(rss_bytes()),
                mib(rss_bytes()) - mib(base_rss)
            );
        }
    }
    let end_timers = fleet.mill.timer_count();
    let end_rss = rss_bytes();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{ended} jobs in {secs:.1} s ({:.0} jobs/s): timers {end_timers} (idle {idle_timers}), \
         rss {:.1} MiB (baseline {:.1}, peak {:.1})",
        ended as f64 / secs,
        mib(end_rss),
        mib(base_rss),
        mib(peak_rss)
    );
    let timers_ok = end_timers == idle_timers && base_timers == idle_timers;
    let memory_ok = end_rss <= base_rss + SLACK_BYTES;
    if let Err(e) = fleet.mill.check_timers() {
        eprintln!("FAIL: timer table out of step: {e}");
        std::process::exit(1);
    }
    if !(timers_ok && memory_ok) {
        eprintln!("FAIL: timers back to idle: {timers_ok}; memory within 8 MiB: {memory_ok}");
        std::process::exit(1);
    }
    println!("OK: timer count and memory back at their baseline");
}
