//! The mill's committer: one thread that owns the store and writes what the driver hands it,
//! in order, so that the driver can compute step N+1 while step N's fsync runs (issue 15,
//! pipelined group commit).
//!
//! The driver keeps DESIGN §2's rule itself: it hands over the `Persist` batches of the
//! steps it ran, keeps every output that follows them, and acts on those only when this
//! thread says the commit is durable. One commit is in flight at a time; the steps run while
//! it is form the next one. Retention batches go through the same queue, so they run between
//! commits, never inside one. A failed write is answered and ends the thread: the driver
//! stops (fail-stop, DESIGN §2), and restart (M29) sorts out what the lost batch held.

use std::time::{Duration, Instant};

use millrace_core::mill::MillBatch;
use tokio::sync::mpsc;

use crate::mill_store::Purged;
use crate::sqlite::StoreError;
use crate::store::Store;

/// What the driver asks of the committer.
#[derive(Debug)]
pub enum Work {
    /// Write these batches in one transaction.
    Commit {
        /// Every `Persist` of the steps since the last commit, in order.
        batches: Vec<MillBatch>,
        /// Wall clock for the rows' timestamps.
        now_ms: u64,
    },
    /// One retention batch ([`Store::purge_finished`]).
    Purge {
        /// Finished jobs that ended before this (wall clock, ms) go.
        cutoff_ms: u64,
        /// Keep at most this many finished jobs.
        keep: Option<u64>,
        /// At most this many jobs per batch.
        limit: usize,
    },
}

/// What the committer answers, in the order the work came.
#[derive(Debug)]
pub enum Finished {
    /// The commit is durable (or failed: the driver must stop).
    Committed(Result<Duration, StoreError>),
    /// A retention batch ran (a failed one rolled back; nothing half-deleted).
    Purged(Result<(Purged, Duration), StoreError>),
}

/// The committer thread's handle.
pub struct Committer {
    tx: Option<std::sync::mpsc::Sender<Work>>,
    thread: Option<std::thread::JoinHandle<Result<(), StoreError>>>,
}

impl Committer {
    /// Starts the thread on `store`; answers go to `done`.
    pub fn start(mut store: Store, done: mpsc::UnboundedSender<Finished>) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Work>();
        let thread = std::thread::Builder::new()
            .name("mill-commit".into())
            .spawn(move || {
                while let Ok(work) = rx.recv() {
                    match work {
                        Work::Commit { batches, now_ms } => {
                            let started = Instant::now();
                            let r = store.apply(&batches, now_ms);
                            let took = started.elapsed();
                            // Dropped here, not on the driver's thread.
                            drop(batches);
                            let failed = r.is_err();
                            let _ = done.send(Finished::Committed(r.map(|()| took)));
                            if failed {
                                // Nothing after a failed commit may be written (fail-stop).
                                return Ok(());
                            }
                        }
                        Work::Purge {
                            cutoff_ms,
                            keep,
                            limit,
                        } => {
                            let started = Instant::now();
                            // No done row is open in the mill (I2: the store never runs
                            // ahead of it); the driver checks the answer against its jobs.
                            let r = store.purge_finished(cutoff_ms, keep, limit, |_| false);
                            let _ = done.send(Finished::Purged(r.map(|p| (p, started.elapsed()))));
                        }
                    }
                }
                let path = store.describe();
                store.close()?;
                tracing::info!(store = %path, "mill store closed");
                Ok(())
            })?;
        Ok(Committer {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues `work`; false if the thread is gone (it stopped after a failed commit).
    pub fn send(&self, work: Work) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(work).is_ok())
    }

    /// Lets the thread finish what is queued, close the store and end.
    pub fn close(mut self) -> Result<(), StoreError> {
        drop(self.tx.take());
        match self.thread.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(StoreError::Io {
                path: "mill-commit".into(),
                source: std::io::Error::other("the commit thread panicked"),
            }),
            None => Ok(()),
        }
    }
}
