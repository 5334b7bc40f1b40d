//! The simulator's own speed: whole `fleet-5x1000` seeds (5 executors, 1,000 jobs, swarm
//! faults, every checker on), as seeds per second. Issue 4's target is ≥ 20 seeds/s on one
//! core.
#![allow(missing_docs)] // criterion_group! generates undocumented items
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// The same allocator as `millrace-sim`, so the numbers are the binary's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Seeds run per iteration: a few, so one iteration mixes seeds with and without faults.
const SEEDS: u64 = 4;

fn fleet_5x1000(c: &mut Criterion) {
    let Some(scenario) = sim::scenario_file::scenario("fleet-5x1000") else {
        panic!("the fleet-5x1000 scenario is gone");
    };
    let mut group = c.benchmark_group("sim_throughput");
    group.throughput(Throughput::Elements(SEEDS));
    group.sample_size(10);
    group.bench_function("fleet-5x1000", |b| {
        b.iter(|| {
            for seed in 0..SEEDS {
                let o = sim::run_fast(&scenario, seed);
                assert!(o.failure.is_none(), "seed {seed} failed: {:?}", o.failure);
                black_box(o.stats.events);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, fleet_5x1000);
criterion_main!(benches);
