//! The core alone, in process: full placement cycles, event application, quota ops.
#![allow(missing_docs)] // criterion_group! generates undocumented items
use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use millrace_core::job::Identity;
use millrace_core::quota::{QuotaConfig, QuotaLedger};
use millrace_core::types::{ConnId, JobId, LeaseId, Resources};

/// submit → reserve top-3 → accept → release losers → commit → running → terminal.
fn placement_cycle(c: &mut Criterion) {
    let mut group = c.benchmark_group("placement_cycle");
    group.throughput(Throughput::Elements(1));
    for n in [1_000usize, 10_000] {
        let mut fleet = benches::Fleet::new(n, 1_000);
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let (conn, lease) = fleet.place_one();
                fleet.finish(conn, &[lease]);
                black_box(lease)
            })
        });
    }
    group.finish();
}

/// M33 with a backlog (issue 13): one one-seat executor, `waiting` queued jobs from 1,000
/// owners. Each iteration ends the running job — whose step places the next waiting job
/// (the fairest owner's oldest) — runs it, and submits one more, so the backlog stays put.
fn placement_backlog(c: &mut Criterion) {
    let mut group = c.benchmark_group("placement_backlog");
    group.throughput(Throughput::Elements(1));
    group.sample_size(20);
    for waiting in [1_000usize, 100_000] {
        let mut fleet = benches::Fleet::new(1, 1);
        let owners: Vec<String> = (0..1_000).map(|o| format!("owner-{o:04}")).collect();
        let mut asks = Vec::new();
        for k in 0..=waiting {
            fleet.submit_as(&owners[k % owners.len()]);
            asks.extend(fleet.asks());
        }
        let Some(&(conn, first)) = asks.first() else {
            panic!("the first job was not asked");
        };
        fleet.run_ask(conn, first);
        let mut running = first;
        let mut k = waiting + 1;
        group.bench_with_input(BenchmarkId::from_parameter(waiting), &waiting, |b, _| {
            b.iter(|| {
                fleet.finish_keeping(conn, &[running]);
                let Some(&(c, next)) = fleet.asks().first() else {
                    panic!("ending a job placed no waiting one");
                };
                fleet.run_ask(c, next);
                running = next;
                fleet.submit_as(&owners[k % owners.len()]);
                k += 1;
                black_box(next)
            })
        });
    }
    group.finish();
}

/// M36 with a backlog of one owner (issue 15): four one-seat executors placing directly,
/// each running one job with the next staged on it, and `waiting` more queued. Each
/// iteration ends executor 0's running job, starts its staged one (the executor answers
/// the staged commit when the seat frees, E16) — whose step stages the next queued job
/// there — and submits one more. Every such step runs a staging pass over the queue; with
/// no stage slot free it must not cost the pass's whole budget (256 jobs, each against
/// every staged node) when nothing in it can be staged (BENCHMARKS.md, seventh session).
fn placement_backlog_staged(c: &mut Criterion) {
    let mut group = c.benchmark_group("placement_backlog_staged");
    group.throughput(Throughput::Elements(1));
    group.sample_size(20);
    for waiting in [1_000usize, 100_000] {
        let mut fleet = benches::Fleet::direct(4, 1);
        // Per connection: its running lease, then its staged one, in the order sent.
        let mut sent: BTreeMap<ConnId, Vec<LeaseId>> = BTreeMap::new();
        for _ in 0..(8 + waiting) {
            fleet.submit();
            for (conn, lease) in fleet.asks() {
                sent.entry(conn).or_default().push(lease);
            }
        }
        let Some((&conn, leases)) = sent.iter().next() else {
            panic!("nothing was placed");
        };
        let [running, staged] = leases.as_slice() else {
            panic!("executor 0 holds {leases:?}, not one running and one staged lease");
        };
        let (mut running, mut staged) = (*running, *staged);
        fleet.run_ask(conn, running);
        group.bench_with_input(BenchmarkId::from_parameter(waiting), &waiting, |b, _| {
            b.iter(|| {
                fleet.finish_keeping(conn, &[running]);
                fleet.run_ask(conn, staged);
                let Some(&(c, next)) = fleet.asks().first() else {
                    panic!("starting the staged job staged no queued one");
                };
                assert_eq!(c, conn, "the next job is staged where a seat will free");
                running = staged;
                staged = next;
                fleet.submit();
                black_box(next)
            })
        });
    }
    group.finish();
}

/// One executor applying a batch of 1,000 terminal events for its running leases.
fn event_application(c: &mut Criterion) {
    let mut group = c.benchmark_group("event_application");
    group.throughput(Throughput::Elements(1_000));
    group.sample_size(20);
    group.bench_function("batch_of_1000_terminals", |b| {
        b.iter_batched(
            || benches::Fleet::running(1_000),
            |(mut fleet, conn, leases)| {
                if let Some(conn) = conn {
                    fleet.finish(conn, &leases);
                }
                fleet
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// Quota acquire + release pairs with a limit that is never reached.
fn quota_ops(c: &mut Criterion) {
    let mut group = c.benchmark_group("quota");
    group.throughput(Throughput::Elements(2));
    let config = QuotaConfig {
        owner_defaults: Resources::from([("jobs".to_string(), 1_000_000)]),
        repo_defaults: Resources::from([("jobs".to_string(), 1_000_000)]),
        owner_overrides: BTreeMap::new(),
        repo_overrides: BTreeMap::new(),
    };
    let mut ledger = QuotaLedger::new(config);
    let identity = Identity {
        owner: "acme".into(),
        repo: "acme/app".into(),
    };
    let charge = Resources::from([("jobs".to_string(), 1), ("cpu_millis".to_string(), 500)]);
    // A standing population of holds, as in a busy mill.
    for i in 0..1_000 {
        let _ = ledger.try_acquire(JobId(i), &identity, &charge);
    }
    let mut next = 1_000u64;
    group.bench_function("acquire_release", |b| {
        b.iter(|| {
            let id = JobId(next);
            next += 1;
            let r = ledger.try_acquire(id, &identity, &charge);
            let granted = ledger.release(id);
            black_box((r.is_ok(), granted.len()))
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    placement_cycle,
    placement_backlog,
    placement_backlog_staged,
    event_application,
    quota_ops
);
criterion_main!(benches);
