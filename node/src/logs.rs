//! The mill's copy of job logs: `LiveLog` bytes appended to `<data>/logs/<job>.log` by one
//! writer thread, so that the API can serve and follow a job's output from the mill alone
//! (executors may be on other machines). Live logs are best effort (DESIGN §3): bytes the
//! writer could not keep up with are dropped and counted.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use millrace_core::JobId;
use tokio::sync::{broadcast, mpsc};

use crate::mill_driver::{JobEvent, JobEventKind};

/// Chunks queued for the writer, at most.
pub const LOG_QUEUE: usize = 4096;
/// Largest log the mill keeps per job; beyond it bytes are dropped with one marker.
pub const MAX_JOB_LOG: u64 = 64 * 1024 * 1024;
/// Files kept open at once.
const MAX_OPEN: usize = 256;

/// What the writer is asked to do.
#[derive(Debug)]
pub enum LogMsg {
    /// Append bytes to a job's log.
    Append {
        /// The job.
        job: JobId,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// The job ended: close its file.
    Done {
        /// The job.
        job: JobId,
    },
    /// Retention deleted these finished jobs from the store: delete their log files and
    /// markers. Queued behind every `Append` and `Done` of theirs, so a late `Done` cannot
    /// bring a file back.
    Forget {
        /// The jobs.
        jobs: Vec<JobId>,
    },
}

/// The path of a job's log under the mill's data directory.
pub fn job_log_path(data: &Path, job: JobId) -> PathBuf {
    data.join("logs").join(format!("{}.log", job.get()))
}

/// The marker written once a finished job's log is complete.
pub fn done_marker(data: &Path, job: JobId) -> PathBuf {
    data.join("logs").join(format!("{}.done", job.get()))
}

/// Deletes a finished job's log and marker; how many files were there.
fn forget(data: &Path, job: JobId) -> u64 {
    let mut removed = 0;
    for path in [job_log_path(data, job), done_marker(data, job)] {
        match std::fs::remove_file(&path) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(%job, path = %path.display(), error = %e, "retention: cannot delete job log");
            }
        }
    }
    removed
}

/// Starts the writer thread; it ends when every sender is dropped. Files it deletes for
/// retention are counted in `files_deleted`.
pub fn spawn_writer(
    data: PathBuf,
    events: broadcast::Sender<JobEvent>,
    files_deleted: Arc<AtomicU64>,
) -> std::io::Result<(mpsc::Sender<LogMsg>, std::thread::JoinHandle<()>)> {
    std::fs::create_dir_all(data.join("logs"))?;
    let (tx, mut rx) = mpsc::channel::<LogMsg>(LOG_QUEUE);
    let handle = std::thread::Builder::new()
        .name("mill-logs".into())
        .spawn(move || {
            let mut open: BTreeMap<JobId, (File, u64)> = BTreeMap::new();
            while let Some(msg) = rx.blocking_recv() {
                match msg {
                    LogMsg::Append { job, bytes } => {
                        if !open.contains_key(&job) {
                            if open.len() >= MAX_OPEN {
                                open.pop_first();
                            }
                            let path = job_log_path(&data, job);
                            match File::options().create(true).append(true).open(&path) {
                                Ok(f) => {
                                    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                                    open.insert(job, (f, len));
                                }
                                Err(e) => {
                                    tracing::warn!(%job, path = %path.display(), error = %e, "cannot open job log");
                                    continue;
                                }
                            }
                        }
                        if let Some((f, len)) = open.get_mut(&job) {
                            let n = bytes.len() as u64;
                            if *len >= MAX_JOB_LOG {
                                continue;
                            }
                            let result = if len.saturating_add(n) > MAX_JOB_LOG {
                                f.write_all(b"\n[millrace: log truncated at 64 MiB]\n")
                            } else {
                                f.write_all(&bytes)
                            };
                            *len = len.saturating_add(n);
                            if let Err(e) = result {
                                tracing::warn!(%job, error = %e, "cannot write job log");
                            }
                        }
                        let _ = events.send(JobEvent {
                            job,
                            kind: JobEventKind::Log,
                            at: Instant::now(),
                        });
                    }
                    LogMsg::Done { job } => {
                        open.remove(&job);
                        // The marker tells followers that every byte the mill got is in.
                        let path = job_log_path(&data, job);
                        let _ = File::options().create(true).append(true).open(&path);
                        if let Err(e) = File::create(done_marker(&data, job)) {
                            tracing::warn!(%job, error = %e, "cannot mark job log complete");
                        }
                        let _ = events.send(JobEvent {
                            job,
                            kind: JobEventKind::Log,
                            at: Instant::now(),
                        });
                    }
                    LogMsg::Forget { jobs } => {
                        let mut removed = 0;
                        for job in &jobs {
                            open.remove(job);
                            removed += forget(&data, *job);
                        }
                        files_deleted.fetch_add(removed, Ordering::Relaxed);
                        tracing::debug!(jobs = jobs.len(), files = removed, "retention: deleted job logs");
                    }
                }
            }
        })?;
    Ok((tx, handle))
}
