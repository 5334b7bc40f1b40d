//! Placement decision: rank the fleet and choose the top-K candidates (M11), at 10 … 10,000
//! executors, for an unconstrained job and for one that needs a label only 10% hold.
#![allow(missing_docs)] // criterion_group! generates undocumented items
use std::collections::BTreeSet;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

fn placement_decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("placement_decision");
    let none = BTreeSet::new();
    let gpu: BTreeSet<String> = ["gpu".to_string()].into_iter().collect();
    for n in [10usize, 100, 1_000, 10_000] {
        let idx = benches::fleet_index(n);
        let mut out = Vec::with_capacity(16);
        group.bench_with_input(BenchmarkId::new("top3+8_any", n), &n, |b, _| {
            b.iter(|| {
                out.clear();
                idx.top(black_box("shell"), black_box(&none), 11, &mut out);
                black_box(out.len())
            })
        });
        group.bench_with_input(BenchmarkId::new("top3+8_gpu_label", n), &n, |b, _| {
            b.iter(|| {
                out.clear();
                idx.top(black_box("shell"), black_box(&gpu), 11, &mut out);
                black_box(out.len())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, placement_decision);
criterion_main!(benches);
