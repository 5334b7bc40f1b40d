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
    #[cfg(not(madsim))]
    tx: Option<std::sync::mpsc::Sender<Work>>,
    #[cfg(not(madsim))]
    thread: Option<std::thread::JoinHandle<Result<(), StoreError>>>,
    /// The store: the thread holds it while it works; [`Committer::commit_now`] takes it
    /// when the thread is idle (the driver knows: nothing of its is queued or running).
    #[cfg(not(madsim))]
    store: Option<std::sync::Arc<std::sync::Mutex<Store>>>,
    /// Whether [`Committer::commit_now`] may run: only on SQLite, a local file whose commit
    /// is one fsync. PostgreSQL's client runs its own runtime, which may not be entered from
    /// the driver's, and its commit is a network round trip the driver should not wait on.
    #[cfg(not(madsim))]
    inline: bool,
    #[cfg(madsim)]
    tx: Option<mpsc::UnboundedSender<Work>>,
    #[cfg(madsim)]
    thread: Option<tokio::task::JoinHandle<Result<(), StoreError>>>,
}

impl Committer {
    /// Starts the thread on `store`; answers go to `done`.
    pub fn start(store: Store, done: mpsc::UnboundedSender<Finished>) -> std::io::Result<Self> {
        #[cfg(not(madsim))]
        {
            let (tx, rx) = std::sync::mpsc::channel::<Work>();
            let inline = matches!(store, Store::Sqlite(_));
            let store = std::sync::Arc::new(std::sync::Mutex::new(store));
            let shared = store.clone();
            let thread = std::thread::Builder::new()
                .name("mill-commit".into())
                .spawn(move || {
                    while let Ok(work) = rx.recv() {
                        let mut store = shared.lock().unwrap_or_else(|e| e.into_inner());
                        if !do_work(&mut store, work, &done) {
                            return Ok(());
                        }
                    }
                    // The store is closed here, on this thread, never on the driver's (a
                    // PostgreSQL client may not be used inside its runtime): `close` drops
                    // the committer's handle on it before the channel, so this is the last.
                    match std::sync::Arc::try_unwrap(shared) {
                        Ok(store) => close(store.into_inner().unwrap_or_else(|e| e.into_inner())),
                        Err(_) => Err(StoreError::Io {
                            path: "mill-commit".into(),
                            source: std::io::Error::other("the store is still shared at close"),
                        }),
                    }
                })?;
            Ok(Committer {
                tx: Some(tx),
                thread: Some(thread),
                store: Some(store),
                inline,
            })
        }
        #[cfg(madsim)]
        {
            // A task of the simulated node (no system threads). Each commit first waits a
            // simulated fsync: a kill inside it loses the commit's writes, as a crash before
            // the sync would, and nothing that follows them was acted on.
            let (tx, mut rx) = mpsc::unbounded_channel::<Work>();
            let thread = tokio::task::spawn_local(async move {
                let mut store = store;
                while let Some(work) = rx.recv().await {
                    if matches!(work, Work::Commit { .. }) {
                        let _inside = Committing::enter();
                        tokio::time::sleep(SIM_FSYNC).await;
                    }
                    if !do_work(&mut store, work, &done) {
                        return Ok(());
                    }
                }
                close(store)
            });
            Ok(Committer {
                tx: Some(tx),
                thread: Some(thread),
            })
        }
    }

    /// Queues `work`; false if the thread is gone (it stopped after a failed commit).
    pub fn send(&self, work: Work) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(work).is_ok())
    }

    /// Whether [`Committer::commit_now`] may be used: on SQLite only (see `inline`).
    #[cfg(not(madsim))]
    pub fn can_commit_now(&self) -> bool {
        self.inline
    }

    /// Writes `batches` in one transaction on the caller's thread, now (issue 15: at low load
    /// the two thread wakes of a hand-over cost more than the pipelining gains). Only while
    /// none of the caller's work is queued or running on the thread, so the order of
    /// commits is the order of the steps, and only if [`Committer::can_commit_now`]. A
    /// failed commit is the caller's to stop on, as for an answer from the thread.
    #[cfg(not(madsim))]
    pub fn commit_now(&self, batches: &[MillBatch], now_ms: u64) -> Result<Duration, StoreError> {
        let Some(store) = self.store.as_ref() else {
            return Err(closed());
        };
        let mut store = store.lock().unwrap_or_else(|e| e.into_inner());
        let started = Instant::now();
        store.apply(batches, now_ms)?;
        Ok(started.elapsed())
    }

    /// Lets the thread finish what is queued, close the store and end.
    pub async fn close(mut self) -> Result<(), StoreError> {
        #[cfg(not(madsim))]
        drop(self.store.take());
        drop(self.tx.take());
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        // The driver's own thread waits: nothing else runs on it (the madsim build awaits
        // the committer's task instead).
        #[cfg(not(madsim))]
        let joined = thread.join().map_err(|_| ());
        #[cfg(madsim)]
        let joined = thread.await.map_err(|_| ());
        match joined {
            Ok(r) => r,
            Err(()) => Err(StoreError::Io {
                path: "mill-commit".into(),
                source: std::io::Error::other("the commit thread panicked"),
            }),
        }
    }
}

/// How long a simulated commit's fsync takes (madsim build).
#[cfg(madsim)]
const SIM_FSYNC: Duration = Duration::from_millis(2);

#[cfg(madsim)]
thread_local! {
    /// A commit's simulated fsync is running (one simulation per thread): the madsim suite
    /// kills or stops the mill in the middle of one.
    static COMMITTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks a commit's fsync as running until dropped: at its end, or when a kill drops the
/// committer's task inside it.
#[cfg(madsim)]
struct Committing;

#[cfg(madsim)]
impl Committing {
    fn enter() -> Self {
        COMMITTING.with(|c| c.set(true));
        Committing
    }
}

#[cfg(madsim)]
impl Drop for Committing {
    fn drop(&mut self) {
        COMMITTING.with(|c| c.set(false));
    }
}

/// Whether the mill of this thread's simulation is inside a commit (madsim build).
#[cfg(madsim)]
pub fn committing() -> bool {
    COMMITTING.with(std::cell::Cell::get)
}

#[cfg(madsim)]
thread_local! {
    /// User cancels the mill of this thread's simulation has handled, across its restarts: the
    /// madsim suite kills the mill in the commit that follows one (I11).
    static CANCELS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts a user cancel the mill driver handled (madsim build).
#[cfg(madsim)]
pub fn saw_cancel() {
    CANCELS.with(|c| c.set(c.get() + 1));
}

/// How many user cancels the mill of this thread's simulation has handled (madsim build).
#[cfg(madsim)]
pub fn cancels_seen() -> u64 {
    CANCELS.with(std::cell::Cell::get)
}

/// Does one piece of work and answers it; false after a failed commit (fail-stop: nothing
/// after it may be written).
fn do_work(store: &mut Store, work: Work, done: &mpsc::UnboundedSender<Finished>) -> bool {
    match work {
        Work::Commit { batches, now_ms } => {
            let started = Instant::now();
            let r = store.apply(&batches, now_ms);
            let took = started.elapsed();
            // Dropped here, not on the driver's thread.
            drop(batches);
            let failed = r.is_err();
            let _ = done.send(Finished::Committed(r.map(|()| took)));
            !failed
        }
        Work::Purge {
            cutoff_ms,
            keep,
            limit,
        } => {
            let started = Instant::now();
            // No done row is open in the mill (I2: the store never runs ahead of it); the
            // driver checks the answer against its jobs.
            let r = store.purge_finished(cutoff_ms, keep, limit, |_| false);
            let _ = done.send(Finished::Purged(r.map(|p| (p, started.elapsed()))));
            true
        }
    }
}

/// The error of a commit asked of a committer that has closed its store.
#[cfg(not(madsim))]
fn closed() -> StoreError {
    StoreError::Io {
        path: "mill-commit".into(),
        source: std::io::Error::other("the store is closed"),
    }
}

fn close(store: Store) -> Result<(), StoreError> {
    let path = store.describe();
    store.close()?;
    tracing::info!(store = %path, "mill store closed");
    Ok(())
}
