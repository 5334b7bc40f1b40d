//! Counts of the durable syncs (`fsync`/`fdatasync`) this process asks for, per side, so
//! that benches can report syncs per job (issue 15 item 4) without strace.
//!
//! Counted where the node asks for them: one per SQLite write transaction (WAL mode with
//! `synchronous=FULL` syncs the WAL once per commit), two per checkpoint that copied frames
//! (the WAL, then the database file), and one per explicit `sync_all`/`sync_data` of a file
//! or directory. BENCHMARKS.md checks these counts against `strace -c` once.

use std::sync::atomic::{AtomicU64, Ordering};

/// Which side of the protocol a sync belongs to (one process may run both, as `bench` and
/// `standalone` do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The mill's store and its checkpointer.
    Mill,
    /// The executor's store, its checkpointer and the job supervisors' records.
    Executor,
}

static MILL: AtomicU64 = AtomicU64::new(0);
static EXECUTOR: AtomicU64 = AtomicU64::new(0);

fn counter(side: Side) -> &'static AtomicU64 {
    match side {
        Side::Mill => &MILL,
        Side::Executor => &EXECUTOR,
    }
}

/// Records `n` syncs by `side`.
pub fn add(side: Side, n: u64) {
    counter(side).fetch_add(n, Ordering::Relaxed);
}

/// Syncs by `side` since the process started.
pub fn count(side: Side) -> u64 {
    counter(side).load(Ordering::Relaxed)
}

/// Latency of one small durable write on a disk.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    /// Writes measured.
    pub samples: usize,
    /// Median, in microseconds.
    pub p50_us: u64,
    /// 99th percentile, in microseconds.
    pub p99_us: u64,
}

/// Measures `n` appends of 4 KiB, each followed by `fdatasync`, to a scratch file in `dir`
/// (removed afterwards): the floor under one group commit on that disk.
pub fn probe(dir: &std::path::Path, n: usize) -> std::io::Result<Probe> {
    use std::io::Write;
    let path = dir.join("fsync-probe.tmp");
    let mut f = std::fs::File::create(&path)?;
    let block = [0x5au8; 4096];
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = std::time::Instant::now();
        f.write_all(&block)?;
        f.sync_data()?;
        us.push(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
    }
    drop(f);
    std::fs::remove_file(&path)?;
    us.sort_unstable();
    let at = |q: f64| {
        let i = ((us.len() as f64 * q) as usize).min(us.len().saturating_sub(1));
        us.get(i).copied().unwrap_or(0)
    };
    Ok(Probe {
        samples: us.len(),
        p50_us: at(0.5),
        p99_us: at(0.99),
    })
}

/// Measures the disk under `dir` ([`probe`], 200 samples) and prints it, for a benchmark's
/// output: what one sync costs at best there, in the same run (issue 15).
pub fn print_probe(dir: &std::path::Path) {
    match probe(dir, 200) {
        Ok(p) => println!(
            "disk (same dir, 4 KiB write + fdatasync x{}): p50 {:.3} ms, p99 {:.3} ms",
            p.samples,
            p.p50_us as f64 / 1000.0,
            p.p99_us as f64 / 1000.0
        ),
        Err(e) => println!("disk probe failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_side() {
        let (m, e) = (count(Side::Mill), count(Side::Executor));
        add(Side::Mill, 2);
        add(Side::Executor, 1);
        assert!(count(Side::Mill) >= m + 2);
        assert!(count(Side::Executor) > e);
    }

    #[test]
    fn the_probe_measures_every_write_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = probe(dir.path(), 5).unwrap();
        assert_eq!(p.samples, 5);
        assert!(p.p50_us <= p.p99_us);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
