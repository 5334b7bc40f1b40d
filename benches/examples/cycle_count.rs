//! A fixed amount of core work for instruction counting under callgrind, which is repeatable
//! on a noisy machine where wall-clock benches are not:
//! `valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/cycle_count 1000 2000`
//! places ARG2 jobs on a fleet of ARG1 executors, each through the full cycle, then applies
//! one batch of 1,000 terminals. A third argument `direct` places directly (M35) instead of
//! by bid (M12).
fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1_000);
    let jobs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2_000);
    let direct = args.next().is_some_and(|a| a == "direct");
    let mut fleet = if direct {
        benches::Fleet::direct(n, 1_000)
    } else {
        benches::Fleet::new(n, 1_000)
    };
    for _ in 0..jobs {
        let (conn, lease) = fleet.place_one();
        fleet.finish(conn, &[lease]);
    }
    let mut one = benches::Fleet::new(1, 2_000);
    let mut leases = Vec::new();
    let mut conn = None;
    for _ in 0..1_000 {
        let (c, l) = one.place_one();
        conn = Some(c);
        leases.push(l);
    }
    one.consume(); // the setup's last outputs are not the batch's
    if let Some(conn) = conn {
        one.finish(conn, &leases);
    }
    println!("placed {jobs} on {n} executors, applied 1000 terminals");
}
