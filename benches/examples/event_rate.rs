//! Event application rate as a distribution, for a noisy shared machine where one criterion
//! run can land on a busy or a quiet stretch:
//! `cargo run --release -p benches --example event_rate -- 40` applies ARG1 batches of 1,000
//! terminals (each on a fresh one-executor fleet, as the criterion bench does) and prints
//! the fastest, median and slowest batch as events/s.
use std::time::Instant;

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(40);
    let mut secs = Vec::with_capacity(runs);
    for _ in 0..runs {
        let (mut fleet, conn, leases) = benches::Fleet::running(1_000);
        let Some(conn) = conn else {
            return;
        };
        let start = Instant::now();
        fleet.finish(conn, &leases);
        secs.push(start.elapsed().as_secs_f64());
        drop(std::hint::black_box(fleet));
    }
    secs.sort_by(f64::total_cmp);
    let rate = |s: f64| 1_000.0 / s;
    let (Some(&fast), Some(&slow)) = (secs.first(), secs.last()) else {
        return;
    };
    let median = secs[secs.len() / 2];
    println!(
        "{runs} batches of 1000 terminals: fastest {:.0}/s, median {:.0}/s, slowest {:.0}/s",
        rate(fast),
        rate(median),
        rate(slow)
    );
}
