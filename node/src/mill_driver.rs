//! The mill driver: one thread owns the `Mill`. It reads commands from a bounded channel,
//! calls `handle`, drains `poll_output`, hands every `Persist` of its steps to the committer
//! thread ([`crate::mill_commit`]) as one SQLite transaction (group commit), and acts on the
//! outputs that follow them only once that commit is durable, in order; then it sleeps until
//! `next_deadline`. One commit is in flight at a time, and the steps the driver runs while
//! it is form the next one (pipelined group commit, issue 15): the fsync of step N overlaps
//! the work of step N+1, and nothing that follows an unsynced write is acted on. Client
//! replies wait for their step's commit, so a job id is never handed out before its job is
//! durable.
//!
//! Shutdown is a command like any other ([`MillCmd::Shutdown`]): the commit in flight and
//! the steps after it are committed and acted on, every connection is closed after what is
//! queued for it and given a bounded moment to write it out, and only then does the
//! committer close the store. Nothing else ever touches the store, so no close can land in
//! the middle of a commit.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use millrace_core::job::{IdempotencyKey, JobSpec, JobState};
use millrace_core::mill::{
    Mill, MillInput, MillOutput, MillWrite, Observation, RequestError, Submitted,
};
use millrace_core::wire::ToExecutor;
use millrace_core::{ConnId, JobId, NodeId};
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::clock::{wall_ms, Clock};
use crate::logs::{Ending, LogMsg};
use crate::metrics::MillMetrics;
use crate::mill_commit::{Committer, Finished, Work};
use crate::mill_store::Purged;
use crate::net::ConnOut;
use crate::sqlite::StoreError;
use crate::store::Store;

/// Commands queued for the mill driver, at most.
pub const CMD_QUEUE: usize = 16 * 1024;
/// Inputs handled in one step (one commit) at most, so a flood cannot stall replies.
const MAX_STEP_INPUTS: usize = 2048;
/// A commit of at most this many writes, with no command waiting, is written on the driver's
/// own thread (issue 15): at low load nothing runs beside it, and the hand-over to the
/// committer and back costs two thread wakes. Larger groups, or any with work queued behind
/// them, go to the committer so the next steps run during the fsync.
#[cfg(not(madsim))]
const INLINE_COMMIT_WRITES: usize = 16;
/// The longest a small commit is held for the answers to the asks its steps sent ahead of it
/// (issue 15): at most one commit's time is ever worth waiting (see [`Driver::hold_for_asks`]),
/// and never more than this, however slow the disk measured.
const MAX_ASK_HOLD: Duration = Duration::from_millis(1);
/// A group of at most this many writes may be held for its asks (one job's insert and the
/// placement it waits for); larger groups come from load that shares fsyncs already.
const HOLD_MAX_WRITES: usize = 16;
/// What a commit is taken to cost before one has been measured.
const FIRST_COMMIT_GUESS: Duration = Duration::from_micros(300);
/// Events buffered per subscriber of job events.
pub const EVENT_BUFFER: usize = 16 * 1024;
/// At shutdown, how long connection writers may take to send what the last steps queued.
const SHUTDOWN_SEND_GRACE: std::time::Duration = std::time::Duration::from_secs(2);
/// Finished jobs deleted per retention batch, in one transaction: small enough that a batch
/// never holds up the next step's group commit for long.
pub const RETENTION_BATCH: usize = 500;
/// Time between retention batches when the last one found less than a full batch.
const RETENTION_EVERY: Duration = Duration::from_secs(1);
/// Time between retention batches while catching up (the last one was full).
const RETENTION_CATCH_UP: Duration = Duration::from_millis(100);

/// How soon `Done`s the log writer's full queue refused are offered again.
const DONE_RETRY: Duration = Duration::from_millis(50);

/// Retention (issue 11 item 7): finished jobs, their history and their logs are deleted
/// once they ended more than `max_age` ago, or beyond the `max_count` most recent ones.
#[derive(Debug, Clone)]
pub struct Retention {
    /// `--retention`.
    pub max_age: Duration,
    /// `--retention-count`.
    pub max_count: Option<u64>,
    /// Log files the log writer deleted, for `/metrics`.
    pub files_deleted: Arc<AtomicU64>,
}

impl Retention {
    /// The default policy (30 days, no count limit) with a fresh counter.
    #[cfg(test)]
    pub fn default_policy() -> Self {
        Retention {
            max_age: Duration::from_secs(30 * 86_400),
            max_count: None,
            files_deleted: Arc::new(AtomicU64::new(0)),
        }
    }
}

/// Something for the mill driver.
#[derive(Debug)]
pub enum MillCmd {
    /// A connection was accepted; its writer queue.
    Connected {
        /// The connection.
        conn: ConnId,
        /// Messages for it.
        tx: mpsc::Sender<ConnOut<ToExecutor>>,
    },
    /// A message or a disconnect from a connection task.
    Net(MillInput),
    /// A client submits a job.
    Submit {
        /// The job.
        spec: JobSpec,
        /// The client's idempotency key, if any (M31).
        key: Option<IdempotencyKey>,
        /// The answer, after the job (and its key) is durable, with a warning if no
        /// connected executor could ever take it.
        reply: oneshot::Sender<SubmitAnswer>,
    },
    /// A client submits several jobs at once (`POST /v1/jobs/batch`): each is its own step,
    /// all share one group commit, and the answers come back in order after it.
    SubmitBatch {
        /// The jobs with their idempotency keys.
        items: Vec<(JobSpec, Option<IdempotencyKey>)>,
        /// One answer per job, after they are durable.
        reply: oneshot::Sender<Vec<SubmitAnswer>>,
    },
    /// A client cancels a job.
    Cancel {
        /// The job.
        job: JobId,
        /// Why.
        reason: String,
        /// The answer, after the cancel is durable.
        reply: oneshot::Sender<Result<(), RequestError>>,
    },
    /// An operator lifts a quarantine.
    Lift {
        /// The node.
        node: NodeId,
        /// The answer, after it is durable.
        reply: oneshot::Sender<Result<(), RequestError>>,
    },
    /// Executors as the mill sees them.
    Nodes {
        /// The answer.
        reply: oneshot::Sender<Vec<NodeView>>,
    },
    /// The quota ledger's limits, usage and waiters, each list cut at `limit` (§6).
    Quota {
        /// Most entries per list.
        limit: usize,
        /// The answer.
        reply: oneshot::Sender<crate::quota_view::QuotaView>,
    },
    /// What holds a job up, if it waits for quota (M15, Q2).
    QuotaWait {
        /// The job.
        job: JobId,
        /// The answer.
        reply: oneshot::Sender<Option<crate::quota_view::BlockedView>>,
    },
    /// Prometheus text.
    Metrics {
        /// The answer.
        reply: oneshot::Sender<String>,
    },
    /// Placement latency quantiles (µs) and counts, for the demo and benchmarks.
    Stats {
        /// The answer.
        reply: oneshot::Sender<Stats>,
    },
    /// Stop after the step in flight: commit it, act on its outputs, close every connection
    /// once its queue is written, then close the store. Commands queued behind this one are
    /// dropped (their askers hear that the mill is shutting down).
    Shutdown,
}

/// What a submit is answered: the job (new or the key's existing one, M31) with a warning
/// if no connected executor could ever take it, or the mill's refusal.
pub type SubmitAnswer = Result<(Submitted, Option<String>), RequestError>;

/// One executor as `/v1/nodes` shows it.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct NodeView {
    /// Its node id.
    pub node: String,
    /// `ready` (takes work), `connected` (not ready yet: reconciling or cancels pending),
    /// `grace` (disconnected, leases kept) or `quarantined`.
    #[schema(value_type = String)]
    pub state: &'static str,
    /// Its store epoch while it has a session, as a decimal string (u64 exceeds what JSON
    /// numbers keep exactly in many clients).
    #[schema(pattern = "^[0-9]+$")]
    pub epoch: Option<String>,
    /// Labels it holds.
    pub labels: Vec<String>,
    /// Engines it offers.
    pub engines: Vec<String>,
    /// Seats in its latest snapshot.
    pub capacity: u64,
    /// Leases it holds (reserved or running).
    pub leases: usize,
    /// Leases running on it.
    pub running: usize,
    /// While in grace (M5, M6): when its grace runs out and its leases fail (ms since the
    /// Unix epoch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grace_until_ms: Option<u64>,
}

/// Placement statistics.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Leases published.
    pub placed: u64,
    /// Placement latency p50 (µs).
    pub p50_us: u64,
    /// p99 (µs).
    pub p99_us: u64,
    /// p99.9 (µs).
    pub p999_us: u64,
    /// Group commits.
    pub commits: u64,
    /// Mean commit time (µs).
    pub commit_mean_us: u64,
    /// Small commits held for the answers to their early asks (issue 15).
    pub held: u64,
    /// Of those, the ones whose asks were all decided before the hold ran out: their
    /// placement and their job's insert shared one fsync.
    pub held_answered: u64,
}

/// A job changed, for followers (log streams, `--wait`, the demo).
#[derive(Debug, Clone)]
pub struct JobEvent {
    /// The job.
    pub job: JobId,
    /// What changed.
    pub kind: JobEventKind,
    /// When the driver acted on it (after it was durable).
    pub at: Instant,
}

/// What changed about a job.
#[derive(Debug, Clone)]
pub enum JobEventKind {
    /// Its state (already durable).
    State(JobState),
    /// Its log grew or was closed.
    Log,
}

/// How the driver stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A group commit failed; the process must stop (persist before acting).
    #[error("mill store write failed: {0}")]
    Store(#[from] StoreError),
    /// The committer thread ended without answering (it panicked).
    #[error("the mill's commit thread is gone")]
    CommitterGone,
}

/// A cheap handle to the mill driver.
#[derive(Debug, Clone)]
pub struct MillHandle {
    tx: mpsc::Sender<MillCmd>,
}

/// Why a request could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// The mill refused it.
    #[error("{0}")]
    Refused(#[from] RequestError),
    /// The driver is stopping or stopped.
    #[error("the mill is shutting down")]
    Unavailable,
}

impl MillHandle {
    /// The raw command sender (for connection tasks).
    pub fn sender(&self) -> mpsc::Sender<MillCmd> {
        self.tx.clone()
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> MillCmd) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Submits a job under an optional idempotency key (M31): the answer says whether the
    /// job is new or the key's existing one; either way it is durable when it comes back.
    /// A new job that no connected executor could ever take comes with a warning saying why
    /// (computed in the same step, so a submit costs one trip to the driver).
    pub async fn submit_keyed(
        &self,
        spec: JobSpec,
        key: Option<IdempotencyKey>,
    ) -> Result<(Submitted, Option<String>), HandleError> {
        let r = self
            .ask(|reply| MillCmd::Submit { spec, key, reply })
            .await
            .ok_or(HandleError::Unavailable)?;
        Ok(r?)
    }

    /// Submits jobs together; one answer per job, in order, once they are all durable.
    pub async fn submit_batch(
        &self,
        items: Vec<(JobSpec, Option<IdempotencyKey>)>,
    ) -> Result<Vec<SubmitAnswer>, HandleError> {
        self.ask(|reply| MillCmd::SubmitBatch { items, reply })
            .await
            .ok_or(HandleError::Unavailable)
    }

    /// Cancels a job.
    pub async fn cancel(&self, job: JobId, reason: String) -> Result<(), HandleError> {
        let r = self
            .ask(|reply| MillCmd::Cancel { job, reason, reply })
            .await
            .ok_or(HandleError::Unavailable)?;
        Ok(r?)
    }

    /// Lifts a node's quarantine.
    pub async fn lift(&self, node: NodeId) -> Result<(), HandleError> {
        let r = self
            .ask(|reply| MillCmd::Lift { node, reply })
            .await
            .ok_or(HandleError::Unavailable)?;
        Ok(r?)
    }

    /// Executors as the mill sees them.
    pub async fn nodes(&self) -> Option<Vec<NodeView>> {
        self.ask(|reply| MillCmd::Nodes { reply }).await
    }

    /// The quota ledger, each list cut at `limit`.
    pub async fn quota(&self, limit: usize) -> Option<crate::quota_view::QuotaView> {
        self.ask(|reply| MillCmd::Quota { limit, reply }).await
    }

    /// What holds `job` up, if it waits for quota; `None` also when the mill is stopping.
    pub async fn quota_wait(&self, job: JobId) -> Option<crate::quota_view::BlockedView> {
        self.ask(|reply| MillCmd::QuotaWait { job, reply })
            .await
            .flatten()
    }

    /// Prometheus text.
    pub async fn metrics(&self) -> Option<String> {
        self.ask(|reply| MillCmd::Metrics { reply }).await
    }

    /// Placement statistics.
    pub async fn stats(&self) -> Option<Stats> {
        self.ask(|reply| MillCmd::Stats { reply }).await
    }
}

/// A client answer computed in a step and sent once that step is durable.
enum Deferred {
    Submit(oneshot::Sender<SubmitAnswer>, SubmitAnswer),
    Batch(oneshot::Sender<Vec<SubmitAnswer>>, Vec<SubmitAnswer>),
    Done(
        oneshot::Sender<Result<(), RequestError>>,
        Result<(), RequestError>,
    ),
    /// A read of state that may include writes not yet durable (leases, quota holds).
    Read(Box<dyn FnOnce() + Send>),
}

impl Deferred {
    fn send(self) {
        match self {
            Deferred::Submit(tx, r) => {
                let _ = tx.send(r);
            }
            Deferred::Batch(tx, r) => {
                let _ = tx.send(r);
            }
            Deferred::Done(tx, r) => {
                let _ = tx.send(r);
            }
            Deferred::Read(reply) => reply(),
        }
    }
}

/// The outputs that follow the commit in flight, and the answers of its steps.
struct Flight {
    rest: Vec<MillOutput>,
    deferred: Vec<Deferred>,
}

/// What an executor hears when the mill closes its connection: the reason and the mill's
/// timers, named as the flags both sides must agree on (at most `wire::MAX_REASON` bytes).
fn close_notice(reason: &str, c: &millrace_core::mill::MillConfig) -> String {
    let mut text = format!(
        "connection closed by the mill: {reason} (this mill runs --silence-timeout {:?}, --snapshot-interval {:?}, --reconnect-grace {:?}; executors must use the same)",
        c.silence_timeout, c.snapshot_interval, c.reconnect_grace
    );
    let max = millrace_core::wire::MAX_REASON;
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// The driver's state; lives on its own thread.
struct Driver {
    mill: Mill,
    committer: Committer,
    /// The committer's answers, in the order of the work.
    finished: mpsc::UnboundedReceiver<Finished>,
    /// The commit in flight and what waits for it.
    inflight: Option<Flight>,
    /// A retention batch is queued or running on the committer.
    purging: bool,
    clock: Clock,
    conns: BTreeMap<ConnId, mpsc::Sender<ConnOut<ToExecutor>>>,
    /// Outputs of the steps since the last commit was handed over, in order.
    outs: Vec<MillOutput>,
    /// Their answers.
    deferred: Vec<Deferred>,
    metrics: MillMetrics,
    latency_us: hdrhistogram::Histogram<u64>,
    commit_us_total: u64,
    events: broadcast::Sender<JobEvent>,
    logs: mpsc::Sender<LogMsg>,
    /// Jobs whose end is decided and whose `Done` the log writer has not processed (E15).
    ending: Arc<Ending>,
    /// A `Shutdown` came in: this step is the last.
    stopping: bool,
    retention: Retention,
    /// When the next retention batch runs.
    retention_due: Instant,
    /// Jobs retention deleted whose log files the log writer has not been handed yet (its
    /// queue was full); no new batch runs until they are.
    forget_pending: Vec<JobId>,
    /// Jobs that ended whose `Done` the log writer's full queue did not take yet: it marks
    /// the stored log complete and frees the live buffer (E15), so it is never dropped.
    /// Bounded by the jobs that end while the writer is a whole queue behind.
    done_pending: Vec<JobId>,
    /// The small commit waiting for its early asks is handed over at this instant at the
    /// latest ([`Driver::hold_for_asks`]).
    hold_until: Option<Instant>,
    /// The early asks of the steps since the last commit, while one of them is undecided.
    held_asks: Vec<millrace_core::LeaseId>,
    /// Recent commit time (an average of the last few, 1/8 weight each).
    commit_avg: Duration,
    /// Counts for the bench: holds begun, and holds that ended with every ask decided.
    holds: (u64, u64),
}

/// Starts the driver thread for `mill` on `store`. It runs until [`MillCmd::Shutdown`] (or
/// until every handle is dropped), then commits what is left, sends it, closes every
/// connection and closes the store cleanly.
pub fn spawn(
    mill: Mill,
    store: Store,
    clock: Clock,
    events: broadcast::Sender<JobEvent>,
    (logs, ending): (mpsc::Sender<LogMsg>, Arc<Ending>),
    restored_cursors: std::collections::BTreeMap<
        (NodeId, millrace_core::Epoch),
        millrace_core::Seqno,
    >,
    retention: Retention,
) -> std::io::Result<(MillHandle, crate::rt::Joiner<Result<(), DriverError>>)> {
    let (tx, rx) = mpsc::channel(CMD_QUEUE);
    let latency_us = hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let (done_tx, finished) = mpsc::unbounded_channel();
    let committer = Committer::start(store, done_tx)?;
    let driver = Driver {
        mill,
        committer,
        finished,
        inflight: None,
        purging: false,
        clock,
        conns: BTreeMap::new(),
        outs: Vec::new(),
        deferred: Vec::new(),
        metrics: MillMetrics::with_cursors(restored_cursors),
        latency_us,
        commit_us_total: 0,
        events,
        logs,
        ending,
        stopping: false,
        retention,
        retention_due: Instant::now() + RETENTION_EVERY,
        forget_pending: Vec::new(),
        done_pending: Vec::new(),
        hold_until: None,
        held_asks: Vec::new(),
        commit_avg: FIRST_COMMIT_GUESS,
        holds: (0, 0),
    };
    let handle = crate::rt::spawn_async(
        "mill-driver".into(),
        move || driver.run(rx),
        |e| {
            Err(DriverError::from(StoreError::Io {
                path: "runtime".into(),
                source: e,
            }))
        },
    )?;
    Ok((MillHandle { tx }, handle))
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::Receiver<MillCmd>) -> Result<(), DriverError> {
        // Outputs of `Mill::new` (a restart's persists and updates) come first.
        self.drain();
        self.flush()?;
        while !self.stopping {
            // The mill's next deadline, or the next retention batch if that comes first.
            let wake = self.mill.next_deadline().map(|t| self.clock.instant_of(t));
            let wake = match (wake, self.purging) {
                (Some(d), true) => d,
                (Some(d), false) => d.min(self.retention_due),
                (None, true) => Instant::now() + RETENTION_EVERY,
                (None, false) => self.retention_due,
            };
            // `Done`s the log writer could not take yet are offered again soon.
            let wake = if self.done_pending.is_empty() {
                wake
            } else {
                wake.min(Instant::now() + DONE_RETRY)
            };
            // A commit held for its asks is handed over when the hold runs out.
            let wake = self.hold_until.map_or(wake, |h| wake.min(h));
            let sleep = tokio::time::sleep_until(wake.into());
            let mut first = None;
            tokio::select! {
                biased;
                f = self.finished.recv() => match f {
                    Some(f) => self.on_finished(f)?,
                    None => return Err(DriverError::CommitterGone),
                },
                cmd = rx.recv() => match cmd {
                    Some(c) => first = Some(c),
                    // Every handle is gone: nobody can ask for anything any more.
                    None => break,
                },
                () = sleep => {}
            }
            if let Some(cmd) = first {
                self.input(cmd);
                for _ in 1..MAX_STEP_INPUTS {
                    if self.stopping {
                        break;
                    }
                    match rx.try_recv() {
                        Ok(cmd) => self.input(cmd),
                        Err(_) => break,
                    }
                }
            }
            let now = self.clock.now();
            if self.mill.next_deadline().is_some_and(|d| d <= now) {
                self.mill.handle(now, MillInput::Tick);
                self.drain();
            }
            // Hand the steps' writes over, unless a commit is in flight (they form the
            // next one, handed over when it is done); written here if nothing waits. A small
            // commit whose early asks are out waits for their answers, bounded.
            let idle = rx.is_empty();
            if !self.hold_for_asks(idle) {
                self.flush_with(idle)?;
            }
            if !self.done_pending.is_empty() {
                self.hand_over_done();
            }
            // Between commits, never inside one: one bounded batch at a time.
            if !self.stopping && !self.purging && Instant::now() >= self.retention_due {
                self.retention_batch();
            }
        }
        // The last steps: commit them and act on what follows, a shutdown waits for both.
        self.flush()?;
        while self.inflight.is_some() || self.purging || !self.outs.is_empty() {
            match self.finished.recv().await {
                Some(f) => self.on_finished(f)?,
                None => return Err(DriverError::CommitterGone),
            }
            self.flush()?;
        }
        // `rx` stays open until the writers are done: a reader whose delivery failed would
        // end its connection and abort the writer with the last sends still queued.
        self.close_connections().await;
        drop(rx);
        self.committer.close().await?;
        Ok(())
    }

    /// Closes every connection after what is queued for it, and waits (bounded) until the
    /// writers have put it on the wire: the sends of the last step leave before the process.
    async fn close_connections(&mut self) {
        let conns: Vec<_> = std::mem::take(&mut self.conns).into_values().collect();
        for tx in &conns {
            let _ = tx.try_send(ConnOut::Close("the mill is shutting down".into()));
        }
        let written = async {
            for tx in &conns {
                tx.closed().await;
            }
        };
        if tokio::time::timeout(SHUTDOWN_SEND_GRACE, written)
            .await
            .is_err()
        {
            tracing::warn!(
                "some executor connections did not take their last messages in time; \
                 they will be re-sent or reconciled after the restart (M29)"
            );
        }
    }

    /// Starts one retention batch (issue 11 item 7) on the committer: it deletes at most
    /// [`RETENTION_BATCH`] finished jobs with their history in one transaction, between
    /// commits; [`Driver::purged`] then hands their log files to the log writer (behind
    /// every write of theirs). The core holds no finished job (a terminal removes it, M24),
    /// only their idempotency keys (M31), which it forgets once the store has deleted them
    /// with their jobs.
    fn retention_batch(&mut self) {
        if !self.hand_over_logs() {
            // The writer is a batch behind: try again soon.
            self.retention_due = Instant::now() + RETENTION_CATCH_UP;
            return;
        }
        let max_age_ms = u64::try_from(self.retention.max_age.as_millis()).unwrap_or(u64::MAX);
        let work = Work::Purge {
            cutoff_ms: wall_ms().saturating_sub(max_age_ms),
            keep: self.retention.max_count,
            limit: RETENTION_BATCH,
        };
        self.purging = self.committer.send(work);
    }

    /// A retention batch ran on the committer.
    fn purged(&mut self, r: Result<(Purged, Duration), StoreError>) {
        self.purging = false;
        let mut full = false;
        match r {
            Ok((purged, took)) => {
                self.metrics.retention_batches.inc();
                full = purged.jobs.len() >= RETENTION_BATCH;
                if !purged.jobs.is_empty() {
                    for &job in &purged.jobs {
                        // I2: a job done in the store is done in the mill, which is never
                        // behind its store.
                        let open = self.mill.job_state(job).is_some();
                        debug_assert!(!open, "I2: {job} is done in the store but open in the mill");
                        if open {
                            tracing::error!(%job, "retention deleted a job the mill still holds (I2)");
                        }
                    }
                    let jobs = purged.jobs.len() as u64;
                    self.metrics.retention_deleted("jobs", jobs);
                    self.metrics
                        .retention_deleted("history_rows", purged.history_rows);
                    // Their keys left the store in the same transaction (M31).
                    self.mill.forget_keys_of(&purged.jobs);
                    tracing::info!(
                        jobs,
                        history_rows = purged.history_rows,
                        keys = purged.keys,
                        took_us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                        full,
                        "retention: deleted finished jobs"
                    );
                    self.forget_pending = purged.jobs;
                    self.hand_over_logs();
                }
            }
            Err(e) => {
                // Rolled back; nothing half-deleted. The next batch tries again.
                tracing::warn!(error = %e, "retention batch failed; retrying later");
            }
        }
        self.retention_due = Instant::now()
            + if full {
                RETENTION_CATCH_UP
            } else {
                RETENTION_EVERY
            };
    }

    /// Hands the ended jobs' `Done`s to the log writer, in order, as far as its queue takes
    /// them; the rest wait for the next step.
    fn hand_over_done(&mut self) {
        let mut handed = 0;
        for &job in &self.done_pending {
            match self.logs.try_send(LogMsg::Done { job }) {
                Ok(()) => handed += 1,
                Err(mpsc::error::TrySendError::Full(_)) => break,
                // The writer is gone (shutting down): nobody reads the buffers any more.
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    handed = self.done_pending.len();
                    break;
                }
            }
        }
        self.done_pending.drain(..handed);
    }

    /// Hands the pending log deletions to the log writer; false if its queue is full (they
    /// stay pending, bounded by one batch).
    fn hand_over_logs(&mut self) -> bool {
        // A job's files are deleted only behind its `Done`, or the marker would come back.
        self.hand_over_done();
        if !self.done_pending.is_empty() {
            return false;
        }
        if self.forget_pending.is_empty() {
            return true;
        }
        let jobs = std::mem::take(&mut self.forget_pending);
        match self.logs.try_send(LogMsg::Forget { jobs }) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(LogMsg::Forget { jobs })) => {
                self.forget_pending = jobs;
                false
            }
            Err(mpsc::error::TrySendError::Full(_)) => false,
            // The writer is gone (shutting down): nothing will write those files again.
            Err(mpsc::error::TrySendError::Closed(_)) => true,
        }
    }

    fn drain(&mut self) {
        while let Some(o) = self.mill.poll_output() {
            if let MillOutput::JobUpdate {
                job,
                state: JobState::Done(_),
            } = &o
            {
                // Before the step is durable: a reader that sees the job done in the store
                // must find it here until the log writer has its last chunks (E15).
                self.ending.begin(*job);
            }
            self.outs.push(o);
        }
    }

    fn input(&mut self, cmd: MillCmd) {
        let now = self.clock.now();
        match cmd {
            MillCmd::Connected { conn, tx } => {
                self.conns.insert(conn, tx);
                self.mill.handle(now, MillInput::Connected { conn });
            }
            MillCmd::Net(input) => {
                if let MillInput::Disconnected { conn } = &input {
                    self.conns.remove(conn);
                }
                self.mill.handle(now, input);
            }
            MillCmd::Submit { spec, key, reply } => {
                let r = self.submit_one(now, spec, key);
                self.deferred.push(Deferred::Submit(reply, r));
            }
            MillCmd::SubmitBatch { items, reply } => {
                let answers = items
                    .into_iter()
                    .map(|(spec, key)| {
                        let r = self.submit_one(now, spec, key);
                        self.drain();
                        r
                    })
                    .collect();
                self.deferred.push(Deferred::Batch(reply, answers));
            }
            MillCmd::Cancel { job, reason, reply } => {
                #[cfg(madsim)]
                crate::mill_commit::saw_cancel();
                let r = self.mill.cancel(now, job, reason);
                self.deferred.push(Deferred::Done(reply, r));
            }
            MillCmd::Lift { node, reply } => {
                let r = self.mill.lift_quarantine(now, node);
                self.deferred.push(Deferred::Done(reply, r));
            }
            // Reads of leases and quota holds are answered once what they show is durable.
            MillCmd::Nodes { reply } => {
                let nodes = self.nodes();
                self.deferred.push(Deferred::Read(Box::new(move || {
                    let _ = reply.send(nodes);
                })));
            }
            MillCmd::Quota { limit, reply } => {
                let view = crate::quota_view::view(self.mill.quota(), limit);
                self.deferred.push(Deferred::Read(Box::new(move || {
                    let _ = reply.send(view);
                })));
            }
            MillCmd::QuotaWait { job, reply } => {
                let wait = crate::quota_view::job_wait(self.mill.quota(), job);
                self.deferred.push(Deferred::Read(Box::new(move || {
                    let _ = reply.send(wait);
                })));
            }
            MillCmd::Metrics { reply } => {
                self.metrics
                    .retention_log_files(self.retention.files_deleted.load(Ordering::Relaxed));
                let _ = reply.send(self.metrics.render(&self.mill));
            }
            MillCmd::Stats { reply } => {
                let h = &self.latency_us;
                let _ = reply.send(Stats {
                    placed: self.metrics.placed_count(),
                    p50_us: h.value_at_quantile(0.5),
                    p99_us: h.value_at_quantile(0.99),
                    p999_us: h.value_at_quantile(0.999),
                    commits: self.metrics.batches.get(),
                    commit_mean_us: self
                        .commit_us_total
                        .checked_div(self.metrics.batches.get())
                        .unwrap_or(0),
                    held: self.holds.0,
                    held_answered: self.holds.1,
                });
            }
            MillCmd::Shutdown => {
                tracing::info!("shutdown: finishing the step in flight");
                self.stopping = true;
            }
        }
        self.drain();
    }

    /// One submit (M31's key, if any): the mill's answer, with the unplaceable warning.
    fn submit_one(
        &mut self,
        now: millrace_core::Time,
        spec: JobSpec,
        key: Option<IdempotencyKey>,
    ) -> SubmitAnswer {
        let r = self.mill.submit_keyed(now, spec, wall_ms(), key);
        let mut warning = None;
        match &r {
            Ok(s) if s.created => {
                self.metrics.submitted.inc();
                // Only a job no candidate took up can be unplaceable: the node list is built
                // for those alone.
                if let Some(spec) = self.mill.queued_spec(s.job) {
                    let (engine, labels) = (spec.engine.clone(), spec.labels.clone());
                    let pin = spec.node.clone();
                    warning =
                        crate::http::unplaceable(&engine, &labels, pin.as_ref(), &self.nodes());
                }
            }
            Ok(s) => {
                self.metrics.submit_replays.inc();
                tracing::debug!(job = %s.job, "submit: idempotency key names an existing job (M31)");
            }
            Err(_) => {}
        }
        r.map(|s| (s, warning))
    }

    fn nodes(&self) -> Vec<NodeView> {
        let mut leases: BTreeMap<&NodeId, (usize, usize)> = BTreeMap::new();
        for (_, _, node, _, state, _) in self.mill.leases() {
            let e = leases.entry(node).or_default();
            e.0 += 1;
            if state == millrace_core::mill::LeaseState::Running {
                e.1 += 1;
            }
        }
        let mut out: Vec<NodeView> = self
            .mill
            .session_views()
            .map(|v| {
                let (n, running) = leases.get(v.node).copied().unwrap_or_default();
                let state = if v.ready {
                    "ready"
                } else if v.connected {
                    "connected"
                } else {
                    "grace"
                };
                NodeView {
                    node: v.node.to_string(),
                    state,
                    epoch: Some(v.epoch.get().to_string()),
                    labels: v.labels.iter().cloned().collect(),
                    engines: v.engines.iter().cloned().collect(),
                    capacity: v.capacity,
                    leases: n,
                    running,
                    grace_until_ms: v.grace_deadline.map(|t| t.as_micros() / 1000),
                }
            })
            .collect();
        for node in self.mill.quarantined() {
            let (n, running) = leases.get(node).copied().unwrap_or_default();
            out.push(NodeView {
                node: node.to_string(),
                state: "quarantined",
                epoch: None,
                labels: Vec::new(),
                engines: Vec::new(),
                capacity: 0,
                leases: n,
                running,
                grace_until_ms: None,
            });
        }
        out
    }

    /// Group commit, pipelined: unless a commit is in flight, acts on the outputs before the
    /// first `Persist` at once (they follow no unsynced write), hands every `Persist` of the
    /// steps since the last commit to the committer as one transaction, and keeps the
    /// outputs after the first one, with the steps' answers, until it is durable.
    fn flush(&mut self) -> Result<(), DriverError> {
        self.flush_with(false)
    }

    /// Whether the steps since the last commit are held back a moment longer, for the answers
    /// to the asks they sent ahead of their `Persist` (M12's early asks, issue 15). At a
    /// CI fleet's rate a job's insert is one small commit and its placement, when the bid
    /// comes back, a second one right behind it; a bid that comes back within one commit's
    /// time lets both share one fsync, and the job runs a commit sooner. The hold is only
    /// ever a delay: nothing is acted on that follows an unsynced write, the outputs ahead
    /// of the first `Persist` go now (as [`Driver::flush`] would send them), and a step's
    /// answer still waits for its commit. So it applies only when it cannot cost throughput
    /// or safety: no command waits (`idle`), no commit is in flight, the group is small, an
    /// early ask of it is still undecided, and for at most the recent commit time (waiting
    /// longer than a commit saves nothing) capped at [`MAX_ASK_HOLD`].
    fn hold_for_asks(&mut self, idle: bool) -> bool {
        if !idle || self.stopping || self.inflight.is_some() {
            return self.end_hold(false);
        }
        let Some(first) = self
            .outs
            .iter()
            .position(|o| matches!(o, MillOutput::Persist(_)))
        else {
            return self.end_hold(false);
        };
        let ahead: Vec<MillOutput> = self.outs.drain(..first).collect();
        for o in ahead {
            if let MillOutput::Send {
                msg: ToExecutor::ReserveSeat { lease, .. },
                ..
            } = &o
            {
                self.held_asks.push(*lease);
            }
            self.act(o);
        }
        let writes: usize = self
            .outs
            .iter()
            .map(|o| match o {
                MillOutput::Persist(b) => b.writes.len(),
                _ => 0,
            })
            .sum();
        if writes > HOLD_MAX_WRITES {
            return self.end_hold(false);
        }
        let mill = &self.mill;
        self.held_asks.retain(|lease| mill.is_ask(*lease));
        if self.held_asks.is_empty() {
            // Every early ask is decided (or there was none): commit now.
            let answered = self.hold_until.is_some();
            return self.end_hold(answered);
        }
        let now = Instant::now();
        let until = match self.hold_until {
            Some(until) => until,
            None => {
                self.holds.0 += 1;
                let until = now + self.commit_avg.min(MAX_ASK_HOLD);
                self.hold_until = Some(until);
                until
            }
        };
        if now >= until {
            return self.end_hold(false);
        }
        true
    }

    /// Ends a hold (if any): false, so the caller hands the group over now.
    fn end_hold(&mut self, answered: bool) -> bool {
        if self.hold_until.take().is_some() && answered {
            self.holds.1 += 1;
        }
        self.held_asks.clear();
        false
    }

    /// [`Driver::flush`], writing a small group on this thread when `idle` (no command
    /// waits) and the committer has nothing of ours: the same order, the same rule (nothing
    /// after a `Persist` is acted on before the write returns), two thread wakes fewer.
    fn flush_with(&mut self, idle: bool) -> Result<(), DriverError> {
        if self.inflight.is_some() || (self.outs.is_empty() && self.deferred.is_empty()) {
            return Ok(());
        }
        let first = self
            .outs
            .iter()
            .position(|o| matches!(o, MillOutput::Persist(_)));
        let Some(first) = first else {
            // No write to wait for: act now, answer now.
            let outs = std::mem::take(&mut self.outs);
            for o in outs {
                self.act(o);
            }
            for d in std::mem::take(&mut self.deferred) {
                d.send();
            }
            return Ok(());
        };
        self.end_hold(false);
        let mut outs = std::mem::take(&mut self.outs);
        let mut tail = outs.split_off(first);
        for o in outs {
            self.act(o);
        }
        let (batches, rest) = crate::sqlite::split_persists(&mut tail, |o| match o {
            MillOutput::Persist(b) => crate::sqlite::Split::Persist(b),
            other => crate::sqlite::Split::Other(other),
        });
        // `tail` is empty now: its writes are handed over, the rest waits in the flight.
        self.outs = tail;
        for b in &batches {
            for w in &b.writes {
                match w {
                    MillWrite::Cursor { node, epoch, seqno } => {
                        self.metrics.cursor(node, *epoch, *seqno);
                    }
                    MillWrite::CursorDelete { node, epoch } => {
                        tracing::info!(%node, %epoch, "forgot the cursor of an old epoch");
                        self.metrics.cursor_forgotten(node, *epoch);
                    }
                    MillWrite::Counters { .. }
                    | MillWrite::JobInsert { .. }
                    | MillWrite::KeyInsert { .. }
                    | MillWrite::JobState { .. }
                    | MillWrite::LeaseUpsert(_)
                    | MillWrite::Attempt(_)
                    | MillWrite::LeaseCancel { .. }
                    | MillWrite::LeaseDelete { .. }
                    | MillWrite::QuotaHold { .. }
                    | MillWrite::QuotaRelease { .. }
                    | MillWrite::Quarantine { .. } => {}
                }
            }
        }
        #[cfg(not(madsim))]
        if idle
            && !self.purging
            && self.committer.can_commit_now()
            && batches.iter().map(|b| b.writes.len()).sum::<usize>() <= INLINE_COMMIT_WRITES
        {
            let r = self.committer.commit_now(&batches, wall_ms());
            self.inflight = Some(Flight {
                rest,
                deferred: std::mem::take(&mut self.deferred),
            });
            return self.on_finished(Finished::Committed(r));
        }
        #[cfg(madsim)]
        let _ = idle;
        if !self.committer.send(Work::Commit {
            batches,
            now_ms: wall_ms(),
        }) {
            return Err(DriverError::CommitterGone);
        }
        self.inflight = Some(Flight {
            rest,
            deferred: std::mem::take(&mut self.deferred),
        });
        Ok(())
    }

    /// The committer finished a piece of work: after a commit, acts on what followed it in
    /// order and answers its steps' clients, then hands over the next group.
    fn on_finished(&mut self, f: Finished) -> Result<(), DriverError> {
        match f {
            Finished::Committed(Ok(took)) => {
                self.metrics.commit_latency.observe(took.as_secs_f64());
                self.commit_avg = (self.commit_avg * 7 + took) / 8;
                self.metrics.batches.inc();
                self.commit_us_total = self
                    .commit_us_total
                    .saturating_add(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
                if let Some(flight) = self.inflight.take() {
                    for o in flight.rest {
                        self.act(o);
                    }
                    for d in flight.deferred {
                        d.send();
                    }
                }
                self.flush()
            }
            Finished::Committed(Err(e)) => Err(DriverError::Store(e)),
            Finished::Purged(r) => {
                self.purged(r);
                Ok(())
            }
        }
    }

    fn act(&mut self, output: MillOutput) {
        match output {
            MillOutput::Send { conn, msg } => {
                let Some(tx) = self.conns.get(&conn) else {
                    return;
                };
                match tx.try_send(ConnOut::Send(msg)) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        // A peer this far behind is cut off; its task reports Disconnected.
                        tracing::warn!(%conn, "send queue full; closing the connection");
                        self.metrics.send_overflows.inc();
                        self.conns.remove(&conn);
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        // The connection already ended (its `Disconnected` is on the way):
                        // not an overflow, nothing for an operator to act on.
                        tracing::debug!(%conn, "send to a connection that already ended");
                        self.conns.remove(&conn);
                    }
                }
            }
            MillOutput::Close { conn, reason } => {
                tracing::info!(%conn, %reason, "closing executor connection");
                if let Some(tx) = self.conns.remove(&conn) {
                    // Tell the executor why, with the timers this mill runs: an executor on
                    // other timers (issue 11: a mill on `--silence-timeout 4s`, executors on
                    // the defaults) otherwise only sees its connection drop.
                    let notice = close_notice(&reason, self.mill.config());
                    let _ = tx.try_send(ConnOut::Send(ToExecutor::Refused {
                        leader: None,
                        reason: notice,
                    }));
                    let _ = tx.try_send(ConnOut::Close(reason));
                }
            }
            MillOutput::Persist(_) => {
                // Written by `flush` before any output is acted on.
            }
            MillOutput::JobUpdate { job, state } => {
                self.metrics.job_update(&state);
                if let JobState::Done(t) = &state {
                    tracing::info!(%job, status = %t.status, error = ?t.error, "job ended");
                    self.done_pending.push(job);
                    self.hand_over_done();
                }
                let _ = self.events.send(JobEvent {
                    job,
                    kind: JobEventKind::State(state),
                    at: Instant::now(),
                });
            }
            MillOutput::LiveLog {
                job,
                lease,
                offset,
                bytes,
            } => {
                // Best effort: a chunk the writer cannot take is a hole its readers see as
                // a gap (E15), since the next chunk says where it starts.
                let append = LogMsg::Append {
                    job,
                    lease,
                    offset,
                    bytes,
                };
                if self.logs.try_send(append).is_err() {
                    self.metrics.live_log_dropped.inc();
                }
            }
            MillOutput::Observed(o) => self.observed(o),
        }
    }

    fn observed(&mut self, o: Observation) {
        match o {
            Observation::Placed {
                job,
                lease,
                node,
                latency,
            } => {
                self.metrics.placed();
                self.metrics
                    .placement_latency
                    .observe(latency.as_secs_f64());
                let us = u64::try_from(latency.as_micros())
                    .unwrap_or(u64::MAX)
                    .max(1);
                let _ = self.latency_us.record(us.min(3_600_000_000));
                tracing::debug!(%job, %lease, %node, ?latency, "placed");
            }
            Observation::Violation { node, kind, reason } => {
                self.metrics.violation(kind);
                tracing::warn!(%node, %kind, %reason, "protocol violation");
            }
            Observation::Quarantined { node } => {
                self.metrics.quarantined.inc();
                tracing::warn!(%node, "node quarantined; lift with `millrace quarantine lift`");
            }
            Observation::Refused { conn, reason } => {
                self.metrics.refused.inc();
                tracing::warn!(%conn, %reason, "executor refused");
            }
            Observation::Applied { .. } | Observation::QuotaWait { .. } => {}
            Observation::Deposed { node, ours, seen } => {
                // E13: with a store of its own this mill is the only one that can hold a
                // term, so an executor that has seen a higher one is confused (or was
                // pointed at another mill's store); it was refused or closed. A shared
                // store's leadership check acts on this (DESIGN §10).
                tracing::warn!(%node, term = ours.get(), seen = seen.get(), "executor has seen a higher mill term");
            }
            Observation::Retried {
                job,
                attempt,
                cause,
                fenced,
            } => {
                self.metrics.retried.inc();
                let cause = cause.map_or("unknown", |c| c.name());
                tracing::info!(%job, attempt, cause, fenced, "attempt ended; retrying (M32)");
            }
            Observation::Rare(path) => {
                tracing::debug!(?path, "rare path");
            }
        }
    }
}

// Real threads and runtimes: the production build only (the madsim build runs madsim_tests).
#[cfg(test)]
#[cfg(not(madsim))]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use millrace_core::mill::MillConfig;
    use millrace_core::{Epoch, Identity, Resources};

    use super::*;

    fn spec() -> JobSpec {
        JobSpec {
            retry: Default::default(),
            priority: 0,
            node: None,
            engine: "shell".into(),
            labels: BTreeSet::new(),
            resources: Resources::new(),
            identity: Identity {
                owner: "o".into(),
                repo: "r".into(),
            },
            timeout: None,
            payload: b"true".to_vec(),
            env: Default::default(),
        }
    }

    /// M29 / DESIGN §2 at shutdown: everything queued before `Shutdown` is one last step —
    /// committed (the submit's job survives in the store, its id is answered), then acted on
    /// (the Welcome that followed the Hello reaches the connection before its Close) — and
    /// only then is the store closed, by the driver's own thread. Nothing queued after
    /// `Shutdown` is taken.
    type Thread = crate::rt::Joiner<Result<(), DriverError>>;

    /// A driver on a fresh store in `dir`, and a runtime to talk to it from the test.
    fn driver(dir: &std::path::Path) -> (MillHandle, Thread, tokio::runtime::Runtime) {
        driver_with(dir, MillConfig::default())
    }

    /// [`driver`] with the mill's config.
    fn driver_with(
        dir: &std::path::Path,
        config: MillConfig,
    ) -> (MillHandle, Thread, tokio::runtime::Runtime) {
        let store = crate::store::open_sqlite(dir).unwrap();
        let clock = Clock::start();
        let mill = Mill::new(config, None, clock.now()).unwrap();
        let (events, _) = broadcast::channel(16);
        let (logs, _) = mpsc::channel(16);
        let (handle, thread) = spawn(
            mill,
            store,
            clock,
            events,
            (logs, Arc::default()),
            BTreeMap::new(),
            Retention::default_policy(),
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        (handle, thread, rt)
    }

    fn hello(conn: ConnId) -> MillCmd {
        MillCmd::Net(MillInput::Message {
            conn,
            msg: millrace_core::testkit::Hello::new("x1", Epoch(7)).build(),
        })
    }

    #[test]
    fn shutdown_finishes_the_step_in_flight_then_closes_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let (handle, thread, rt) = driver(dir.path());
        let conn = ConnId(1);
        let (conn_tx, mut conn_rx) = mpsc::channel(16);
        let (first, late) = rt.block_on(async {
            let tx = handle.sender();
            tx.send(MillCmd::Connected { conn, tx: conn_tx })
                .await
                .unwrap();
            tx.send(hello(conn)).await.unwrap();
            let (first_tx, first_rx) = oneshot::channel();
            tx.send(MillCmd::Submit {
                spec: spec(),
                key: None,
                reply: first_tx,
            })
            .await
            .unwrap();
            tx.send(MillCmd::Shutdown).await.unwrap();
            let (late_tx, late_rx) = oneshot::channel();
            let _ = tx
                .send(MillCmd::Submit {
                    spec: spec(),
                    key: None,
                    reply: late_tx,
                })
                .await;
            let mut got = Vec::new();
            while let Some(out) = conn_rx.recv().await {
                let close = matches!(out, ConnOut::Close(_));
                got.push(out);
                if close {
                    break;
                }
            }
            assert!(
                matches!(
                    got.as_slice(),
                    [ConnOut::Send(ToExecutor::Welcome { .. }), ConnOut::Close(_)]
                ),
                "{got:?}"
            );
            // The writer is done: the driver may close the store now.
            drop(conn_rx);
            (first_rx.await, late_rx.await)
        });
        assert!(
            matches!(first, Ok(Ok((Submitted { job: JobId(1), .. }, _)))),
            "{first:?}"
        );
        assert!(
            late.is_err(),
            "a submit behind the shutdown was taken: {late:?}"
        );
        thread.join().unwrap().unwrap();
        let store = crate::mill_store::MillStore::open(dir.path()).unwrap();
        let snap = store.load().unwrap().unwrap();
        assert_eq!(snap.jobs.len(), 1);
    }

    /// Issue 15, M12's early asks: a small commit held for the answer to an ask sent ahead
    /// of it is handed over when the hold runs out, answered or not. An executor that never
    /// answers leaves the submit answered and its job durable (the hold is a delay, never a
    /// wait on a peer); answered later, the ask places the job as any late acceptance would.
    #[test]
    fn a_commit_held_for_an_unanswered_ask_is_still_made_and_answered() {
        use millrace_core::testkit::ScriptedExecutor;
        let dir = tempfile::tempdir().unwrap();
        let config = MillConfig {
            direct_placement: false,
            late_binding: false,
            ..MillConfig::default()
        };
        let (handle, thread, rt) = driver_with(dir.path(), config);
        let conn = ConnId(1);
        let mut script = ScriptedExecutor::new("x1", Epoch(7), 4);
        let (stats, held_ask, job) = rt.block_on(async {
            let bound = Duration::from_secs(60);
            let (conn_tx, mut conn_rx) = mpsc::channel(64);
            let tx = handle.sender();
            tx.send(MillCmd::Connected { conn, tx: conn_tx })
                .await
                .unwrap();
            // The executor's side: answers everything, except asks while `silent`.
            let mut talk = async |script: &mut ScriptedExecutor, silent: bool, done: u64| loop {
                let Some(ConnOut::Send(msg)) = conn_rx.recv().await else {
                    panic!("the mill closed the connection");
                };
                if silent && matches!(msg, ToExecutor::ReserveSeat { .. }) {
                    return Some(msg);
                }
                // The mill's Ack of the results follows their commit: nothing is left in
                // flight for the next submit to wait behind.
                let acked = matches!(msg, ToExecutor::Ack { .. });
                let mut out = Vec::new();
                script.handle(msg, &mut out).unwrap();
                for m in out {
                    tx.send(MillCmd::Net(MillInput::Message { conn, msg: m }))
                        .await
                        .unwrap();
                }
                if !silent && acked && script.finished() == done {
                    return None;
                }
            };
            tx.send(MillCmd::Net(MillInput::Message {
                conn,
                msg: script.hello(""),
            }))
            .await
            .unwrap();
            // The first job runs: its ask needed the lease floor's write (M30), so it went
            // behind the insert; after it the floor is durable and asks go early.
            let first = tokio::time::timeout(bound, async {
                let (answer, ()) = tokio::join!(handle.submit_keyed(spec(), None), async {
                    assert!(talk(&mut script, false, 1).await.is_none());
                });
                answer
            })
            .await
            .expect("the first job was answered");
            assert!(first.is_ok(), "{first:?}");
            let before = handle.stats().await.unwrap();
            // The second job's ask goes ahead of its insert and is never answered: the
            // submit is answered anyway.
            let (answer, ask) = tokio::time::timeout(bound, async {
                tokio::join!(
                    handle.submit_keyed(spec(), None),
                    talk(&mut script, true, 0)
                )
            })
            .await
            .expect("a submit whose ask is never answered was answered");
            let job = answer.unwrap().0.job;
            let after = handle.stats().await.unwrap();
            let stats = (
                after.held - before.held,
                after.held_answered - before.held_answered,
            );
            // Answered now (late): the job is placed and runs.
            let mut out = Vec::new();
            script.handle(ask.clone().unwrap(), &mut out).unwrap();
            for m in out {
                tx.send(MillCmd::Net(MillInput::Message { conn, msg: m }))
                    .await
                    .unwrap();
            }
            tokio::time::timeout(bound, talk(&mut script, false, 2))
                .await
                .expect("the late acceptance placed the job");
            tx.send(MillCmd::Shutdown).await.unwrap();
            (stats, ask, job)
        });
        thread.join().unwrap().unwrap();
        assert!(
            matches!(held_ask, Some(ToExecutor::ReserveSeat { job: j, .. }) if j == job),
            "{held_ask:?}"
        );
        assert_eq!(stats, (1, 0), "one hold, run out without its answer");
        assert_eq!(script.finished(), 2);
        let reader = crate::mill_store::MillReader::open(&dir.path().join("mill.db")).unwrap();
        let row = reader.job(job).unwrap();
        assert!(
            row.is_some_and(|r| r.state.name() == "success"),
            "the held job is durable and ran"
        );
    }

    /// A send to a connection whose task already ended (its `Disconnected` not yet handled)
    /// is not a queue overflow: `millrace_send_overflows_total` counts only peers cut off
    /// for falling behind.
    #[test]
    fn a_send_to_an_ended_connection_is_not_an_overflow() {
        let dir = tempfile::tempdir().unwrap();
        let (handle, thread, rt) = driver(dir.path());
        let conn = ConnId(1);
        let text = rt.block_on(async {
            let (conn_tx, conn_rx) = mpsc::channel(16);
            drop(conn_rx);
            let tx = handle.sender();
            tx.send(MillCmd::Connected { conn, tx: conn_tx })
                .await
                .unwrap();
            // Answered by a Welcome, which finds the connection gone.
            tx.send(hello(conn)).await.unwrap();
            // A submit is answered after its step's outputs were acted on: the Welcome too.
            handle.submit_keyed(spec(), None).await.unwrap();
            let text = handle.metrics().await.unwrap();
            tx.send(MillCmd::Shutdown).await.unwrap();
            text
        });
        thread.join().unwrap().unwrap();
        assert!(
            text.contains("\nmillrace_send_overflows_total 0\n"),
            "{text}"
        );
    }
}
