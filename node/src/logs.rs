//! The mill's copy of job logs: `LiveLog` bytes written to `<data>/logs/<job>.log` by one
//! writer thread, so that the API can serve and follow a job's output from the mill alone
//! (executors may be on other machines). Live logs are best effort (DESIGN §3); E15 makes
//! what is missing explicit instead of spliced:
//!
//! - Every chunk carries its offset in the attempt's output; the writer places it at the job's
//!   stream offset (`base` of the attempt + offset), so file offsets are cursors. Offsets the
//!   mill never got (the executor's budget, a disconnect, this writer's full queue) are holes,
//!   recorded in `<job>.idx` and served as gaps, never as the zeros a sparse file reads back.
//! - The writer also feeds the bounded live buffers ([`crate::live::LiveLogs`]) that reads of
//!   a running job are served from.
//! - `Done` records the output's end in the index and drops the job's live buffer: from then
//!   on reads come from the stored log, whole up to [`MAX_JOB_LOG`], with no gap but the holes
//!   the mill never got. A stored log is complete when its job is done in the store and its
//!   `Done` is not still on the way to the writer ([`Ending`]); no file marks it, so a job
//!   without output has no file at all (issue 15: a file created per job cost more CPU than
//!   the rest of its placement).
//!
//! The index is text, one record per line: `lease <lease> <base>` (an attempt's output starts
//! at stream offset `base`), `hole <from> <to>`, `cut <at>` (too many holes: nothing stored
//! from there), `end <at>` (the output's end, written at `Done`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use millrace_core::{JobId, LeaseId};
use tokio::sync::{broadcast, mpsc};

use crate::live::{Gap, GapReason, LiveLogs, Piece};
use crate::mill_driver::{JobEvent, JobEventKind};

/// Chunks queued for the writer, at most.
pub const LOG_QUEUE: usize = 4096;
/// Largest log the mill keeps per job; offsets beyond it are not stored (reads say
/// `truncated`).
pub const MAX_JOB_LOG: u64 = 64 * 1024 * 1024;
/// Holes recorded per job; past it the stored log is cut where the next hole begins.
pub const MAX_HOLES: usize = 10_000;
/// Largest index file read back (a few records per hole).
const MAX_IDX: u64 = 1 << 20;
/// Files kept open at once.
const MAX_OPEN: usize = 256;

/// What the writer is asked to do.
#[derive(Debug)]
pub enum LogMsg {
    /// Place bytes of a job's output.
    Append {
        /// The job.
        job: JobId,
        /// The attempt's lease: its offsets count from its own start.
        lease: LeaseId,
        /// Offset of the first byte in the attempt's output.
        offset: u64,
        /// The bytes (empty: an end mark, E15).
        bytes: Vec<u8>,
    },
    /// The job ended: record the end, mark the log complete, drop the live buffer.
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

/// The marker older builds wrote once a finished job's log was complete; retention still
/// deletes it.
fn done_marker(data: &Path, job: JobId) -> PathBuf {
    data.join("logs").join(format!("{}.done", job.get()))
}

/// Jobs whose end the mill has decided but whose `Done` the writer has not processed yet:
/// their stored log may still lack its last chunks. The driver adds a job before the step
/// that ends it is committed, the writer removes it after `Done`; so a reader that sees the
/// job done in the store and then not here knows the stored log is complete. Bounded by the
/// writer's queue and the driver's `Done`s waiting for room in it. Empty after a restart:
/// whatever a crash lost will never come.
#[derive(Debug, Default)]
pub struct Ending(Mutex<std::collections::BTreeSet<JobId>>);

impl Ending {
    fn set(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<JobId>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The driver decided `job`'s end (before that step is durable).
    pub fn begin(&self, job: JobId) {
        self.set().insert(job);
    }

    /// The writer processed `job`'s `Done`.
    fn end(&self, job: JobId) {
        self.set().remove(&job);
    }

    /// Whether `job`'s `Done` is still on the way: check only after seeing the job done.
    pub fn pending(&self, job: JobId) -> bool {
        self.set().contains(&job)
    }
}

/// The job log's index (holes, attempts, end).
pub fn index_path(data: &Path, job: JobId) -> PathBuf {
    data.join("logs").join(format!("{}.idx", job.get()))
}

/// Deletes a finished job's log, index and marker; how many files were there.
fn forget(data: &Path, job: JobId) -> u64 {
    let mut removed = 0;
    for path in [
        job_log_path(data, job),
        index_path(data, job),
        done_marker(data, job),
    ] {
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

/// What a job's index says.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Index {
    /// The last attempt's lease and base.
    pub lease: Option<(LeaseId, u64)>,
    /// Holes, in order.
    pub holes: Vec<(u64, u64)>,
    /// Nothing stored from here (too many holes).
    pub cut: Option<u64>,
    /// The output's end, once the job is done.
    pub end: Option<u64>,
}

impl Index {
    /// Where the output ends as far as a log file of `size` bytes and this index know: the
    /// furthest of the file's end, any hole's end and the recorded end.
    fn output_end(&self, size: u64) -> u64 {
        self.holes
            .iter()
            .map(|h| h.1)
            .chain(self.end)
            .fold(size, u64::max)
    }

    /// Parses an index; malformed lines are skipped (and logged).
    pub fn parse(text: &str) -> Index {
        let mut idx = Index::default();
        for line in text.lines() {
            let mut w = line.split_ascii_whitespace();
            let kind = w.next();
            let a = w.next().and_then(|v| v.parse::<u64>().ok());
            let b = w.next().and_then(|v| v.parse::<u64>().ok());
            match (kind, a, b) {
                (Some("lease"), Some(l), Some(base)) => idx.lease = Some((LeaseId(l), base)),
                (Some("hole"), Some(f), Some(t)) if f < t => idx.holes.push((f, t)),
                (Some("cut"), Some(at), None) => idx.cut = Some(at),
                (Some("end"), Some(at), None) => idx.end = Some(at),
                _ => tracing::warn!(line, "job log index: skipping a malformed line"),
            }
        }
        idx
    }

    /// Reads `job`'s index (empty if there is none).
    pub fn load(data: &Path, job: JobId) -> std::io::Result<Index> {
        let path = index_path(data, job);
        let f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Index::default()),
            Err(e) => return Err(e),
        };
        let mut text = String::new();
        f.take(MAX_IDX).read_to_string(&mut text)?;
        Ok(Index::parse(&text))
    }
}

fn append_index(data: &Path, job: JobId, record: &str) {
    let path = index_path(data, job);
    let r = File::options()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(format!("{record}\n").as_bytes()));
    if let Err(e) = r {
        tracing::warn!(%job, path = %path.display(), error = %e, "cannot write job log index");
    }
}

/// A job the writer has open.
struct Open {
    file: File,
    lease: Option<LeaseId>,
    base: u64,
    /// One past the last offset known.
    end: u64,
    holes: usize,
    /// Offsets from here are not stored.
    cap: u64,
}

impl Open {
    fn load(data: &Path, job: JobId) -> std::io::Result<Open> {
        let path = job_log_path(data, job);
        let file = File::options()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)?;
        let size = file.metadata()?.len();
        let idx = Index::load(data, job)?;
        let end = idx.output_end(size);
        Ok(Open {
            file,
            lease: idx.lease.map(|l| l.0),
            base: idx.lease.map_or(0, |l| l.1),
            end,
            holes: idx.holes.len(),
            cap: idx.cut.unwrap_or(MAX_JOB_LOG).min(MAX_JOB_LOG),
        })
    }
}

/// The writer's state: open files and the live buffers it feeds.
struct Writer {
    data: PathBuf,
    open: BTreeMap<JobId, Open>,
    live: Arc<Mutex<LiveLogs>>,
    ending: Arc<Ending>,
}

impl Writer {
    /// Handles one message of the queue.
    fn take(
        &mut self,
        msg: LogMsg,
        events: &broadcast::Sender<JobEvent>,
        files_deleted: &AtomicU64,
    ) {
        match msg {
            LogMsg::Append {
                job,
                lease,
                offset,
                bytes,
            } => {
                self.append(job, lease, offset, bytes);
                let _ = events.send(JobEvent {
                    job,
                    kind: JobEventKind::Log,
                    at: Instant::now(),
                });
            }
            LogMsg::Done { job } => {
                self.done(job);
                let _ = events.send(JobEvent {
                    job,
                    kind: JobEventKind::Log,
                    at: Instant::now(),
                });
            }
            LogMsg::Forget { jobs } => {
                let mut removed = 0;
                for job in &jobs {
                    self.open.remove(job);
                    self.live
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(*job);
                    removed += forget(&self.data, *job);
                }
                files_deleted.fetch_add(removed, Ordering::Relaxed);
                tracing::debug!(
                    jobs = jobs.len(),
                    files = removed,
                    "retention: deleted job logs"
                );
            }
        }
    }

    fn get(&mut self, job: JobId) -> Option<&mut Open> {
        if !self.open.contains_key(&job) {
            if self.open.len() >= MAX_OPEN {
                self.open.pop_first();
            }
            match Open::load(&self.data, job) {
                Ok(o) => {
                    self.open.insert(job, o);
                }
                Err(e) => {
                    tracing::warn!(%job, error = %e, "cannot open job log");
                    return None;
                }
            }
        }
        self.open.get_mut(&job)
    }

    /// Whether `job` has any stored log file: a job this writer has not opened may still
    /// have output from before a restart.
    fn stored(&self, job: JobId) -> bool {
        self.open.contains_key(&job)
            || job_log_path(&self.data, job).exists()
            || index_path(&self.data, job).exists()
    }

    fn append(&mut self, job: JobId, lease: LeaseId, offset: u64, bytes: Vec<u8>) {
        if bytes.is_empty() && offset == 0 && !self.stored(job) {
            // The end mark of an attempt that wrote nothing, and nothing stored before it:
            // no byte, no hole, no attempt base to record (issue 15: no files for a job
            // without output).
            return;
        }
        let data = self.data.clone();
        let live = self.live.clone();
        let Some(o) = self.get(job) else {
            return;
        };
        if o.lease != Some(lease) {
            // A new attempt's output continues the job's stream where the last one ended.
            o.lease = Some(lease);
            o.base = o.end;
            append_index(&data, job, &format!("lease {} {}", lease.get(), o.base));
        }
        let at = o.base.saturating_add(offset);
        let len = bytes.len() as u64;
        if at.saturating_add(len) <= o.end {
            return; // already accounted for (an end mark inside the known output, too)
        }
        let mut bytes = Bytes::from(bytes);
        let at = if at < o.end {
            let skip = usize::try_from(o.end - at).unwrap_or(usize::MAX);
            bytes = bytes.slice(skip.min(bytes.len())..);
            o.end
        } else {
            at
        };
        if at > o.end {
            if o.holes >= MAX_HOLES && o.cap > o.end {
                o.cap = o.end;
                append_index(&data, job, &format!("cut {}", o.cap));
                tracing::warn!(%job, at = o.cap, "job log: too many holes; not stored from here");
            } else if o.holes < MAX_HOLES {
                o.holes += 1;
                append_index(&data, job, &format!("hole {} {}", o.end, at));
            }
        }
        let stored = o.cap.saturating_sub(at).min(bytes.len() as u64);
        if stored > 0 {
            let part = bytes.get(..stored as usize).unwrap_or_default();
            if let Err(e) = o.file.write_all_at(part, at) {
                tracing::warn!(%job, error = %e, "cannot write job log");
            }
        }
        let stored_before = o.end;
        o.end = at.saturating_add(bytes.len() as u64);
        let mut live = live.lock().unwrap_or_else(|e| e.into_inner());
        live.open(job, stored_before);
        live.append(job, at, bytes);
    }

    fn done(&mut self, job: JobId) {
        let data = self.data.clone();
        // A job without output has no log or index (a read of no files is an empty log):
        // nothing to record.
        let end = if self.stored(job) {
            self.get(job).map(|o| o.end)
        } else {
            None
        };
        self.open.remove(&job);
        if let Some(end) = end {
            append_index(&data, job, &format!("end {end}"));
        }
        // Every byte the mill got is in: readers may now take the stored log as whole.
        self.ending.end(job);
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.finish(job);
        live.remove(job);
    }
}

/// A cursor past the end of a finished job's log.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The cursor is beyond the end of the stored log.
    #[error("cursor {cursor} is past the end of the log ({end} bytes)")]
    PastEnd {
        /// The cursor asked for.
        cursor: u64,
        /// The log's end.
        end: u64,
    },
    /// The stored log could not be read.
    #[error("reading the stored log: {0}")]
    Io(#[from] std::io::Error),
}

/// E15: reads at most `max` bytes of `job`'s stored log at `cursor`, with the gap (a hole,
/// or the part past the cap) the cursor is in. `complete`: the `.done` marker exists, so a
/// read at the end is done.
pub fn read_stored(
    data: &Path,
    job: JobId,
    cursor: u64,
    max: usize,
    complete: bool,
) -> Result<Piece, ReadError> {
    let idx = Index::load(data, job)?;
    let mut file = match File::open(job_log_path(data, job)) {
        Ok(f) => Some(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e.into()),
    };
    let size = match &file {
        Some(f) => f.metadata()?.len(),
        None => 0,
    };
    let cap = idx.cut.unwrap_or(MAX_JOB_LOG).min(MAX_JOB_LOG);
    let stored = size.min(cap);
    let end = idx.output_end(size);
    if complete && cursor > end {
        return Err(ReadError::PastEnd { cursor, end });
    }
    let hole = idx.holes.iter().find(|h| h.0 <= cursor && cursor < h.1);
    let gap = match hole {
        Some(&(_, to)) => Some(Gap::new(cursor, to, GapReason::Dropped)),
        None if cursor >= stored && cursor < end => {
            Some(Gap::new(cursor, end, GapReason::Truncated))
        }
        None => None,
    };
    let pos = gap.map_or(cursor, |g| g.to);
    let mut bytes = Vec::new();
    if let (Some(f), true) = (file.as_mut(), pos < stored) {
        let next_hole = idx
            .holes
            .iter()
            .map(|h| h.0)
            .filter(|&h| h > pos)
            .min()
            .unwrap_or(u64::MAX);
        let until = stored.min(next_hole).min(pos.saturating_add(max as u64));
        f.seek(std::io::SeekFrom::Start(pos))?;
        f.take(until - pos).read_to_end(&mut bytes)?;
    }
    let next = pos + bytes.len() as u64;
    Ok(Piece {
        gap,
        bytes: Bytes::from(bytes),
        next,
        end,
        done: complete && next >= end,
    })
}

/// Starts the writer thread; it ends when every sender is dropped. Files it deletes for
/// retention are counted in `files_deleted`.
pub fn spawn_writer(
    data: PathBuf,
    live: Arc<Mutex<LiveLogs>>,
    ending: Arc<Ending>,
    events: broadcast::Sender<JobEvent>,
    files_deleted: Arc<AtomicU64>,
) -> std::io::Result<(mpsc::Sender<LogMsg>, crate::rt::Joiner<()>)> {
    std::fs::create_dir_all(data.join("logs"))?;
    let (tx, mut rx) = mpsc::channel::<LogMsg>(LOG_QUEUE);
    let mut w = Writer {
        data,
        open: BTreeMap::new(),
        live,
        ending,
    };
    #[cfg(not(madsim))]
    let handle = crate::rt::spawn_thread("mill-logs", move || {
        while let Some(msg) = rx.blocking_recv() {
            w.take(msg, &events, &files_deleted);
        }
    })?;
    // Under madsim (issue 16): the same loop as a task of the simulated node.
    #[cfg(madsim)]
    let handle = crate::rt::spawn_task(async move {
        while let Some(msg) = rx.recv().await {
            w.take(msg, &events, &files_deleted);
        }
    });
    Ok((tx, handle))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::LiveLimits;

    fn writer(dir: &Path) -> Writer {
        std::fs::create_dir_all(dir.join("logs")).unwrap();
        Writer {
            data: dir.to_path_buf(),
            open: BTreeMap::new(),
            live: Arc::new(Mutex::new(LiveLogs::new(LiveLimits::default()))),
            ending: Arc::default(),
        }
    }

    /// Every piece of `job`'s stored log from 0: (gap, bytes) in order.
    fn pieces(dir: &Path, job: JobId) -> Vec<(Option<Gap>, Vec<u8>)> {
        let mut out = Vec::new();
        let mut cursor = 0;
        loop {
            let p = read_stored(dir, job, cursor, 1024, true).unwrap();
            if p.gap.is_some() || !p.bytes.is_empty() {
                out.push((p.gap, p.bytes.to_vec()));
            }
            if p.done {
                return out;
            }
            assert_ne!(p.next, cursor, "a read that is not done moves on");
            cursor = p.next;
        }
    }

    #[test]
    fn e15_holes_are_gaps_in_the_stored_log_and_attempts_follow_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let job = JobId(9);
        let mut w = writer(dir.path());
        w.append(job, LeaseId(1), 0, b"abc".to_vec());
        w.append(job, LeaseId(1), 6, b"ghi".to_vec());
        w.append(job, LeaseId(1), 2, b"cd".to_vec()); // overlap: only nothing new
        w.append(job, LeaseId(1), 12, Vec::new()); // end mark: a trailing hole
        w.append(job, LeaseId(2), 0, b"retry".to_vec()); // the next attempt, from 12
        w.done(job);
        let dropped = |from, to| Some(Gap::new(from, to, GapReason::Dropped));
        assert_eq!(
            pieces(dir.path(), job),
            [
                (None, b"abc".to_vec()),
                (dropped(3, 6), b"ghi".to_vec()),
                (dropped(9, 12), b"retry".to_vec()),
            ]
        );
        // A new writer (a restarted mill) reads the index back: same attempt, same base.
        let mut w = writer(dir.path());
        w.append(job, LeaseId(2), 5, b"!".to_vec());
        assert_eq!(
            read_stored(dir.path(), job, 17, 10, false).unwrap().bytes[..],
            b"!"[..]
        );
        assert!(matches!(
            read_stored(dir.path(), job, 99, 10, true),
            Err(ReadError::PastEnd {
                cursor: 99,
                end: 18
            })
        ));
    }

    #[test]
    fn e15_a_job_without_output_leaves_no_file_and_reads_as_an_empty_complete_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = writer(dir.path());
        let (quiet, retried) = (JobId(1), JobId(2));
        w.ending.begin(quiet);
        w.append(quiet, LeaseId(1), 0, Vec::new()); // its end mark
        assert!(w.ending.pending(quiet));
        w.done(quiet);
        assert!(!w.ending.pending(quiet), "the writer's Done ends it");
        let files = std::fs::read_dir(dir.path().join("logs")).unwrap().count();
        assert_eq!(files, 0);
        let p = read_stored(dir.path(), quiet, 0, 10, true).unwrap();
        assert!(p.done && p.bytes.is_empty() && p.gap.is_none() && p.end == 0);
        // A silent first attempt, then one with output: the output starts at 0.
        w.append(retried, LeaseId(3), 0, Vec::new());
        w.append(retried, LeaseId(4), 0, b"out".to_vec());
        w.append(retried, LeaseId(4), 3, Vec::new());
        w.done(retried);
        assert_eq!(pieces(dir.path(), retried), [(None, b"out".to_vec())]);
    }
}
