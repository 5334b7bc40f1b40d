//! The mill driver: one thread owns the `Mill`. It reads commands from a bounded channel,
//! calls `handle`, drains `poll_output`, writes every `Persist` of the step in one SQLite
//! transaction (group commit), then acts on the outputs in order, and sleeps until
//! `next_deadline`. Client replies are sent only after the step's commit, so a job id is
//! never handed out before its job is durable.

use std::collections::HashMap;
use std::time::Instant;

use millrace_core::job::{JobSpec, JobState};
use millrace_core::mill::{
    Mill, MillInput, MillOutput, MillWrite, Observation, Reply, RequestError,
};
use millrace_core::wire::ToExecutor;
use millrace_core::{ConnId, JobId, NodeId};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use crate::clock::{wall_ms, Clock};
use crate::logs::LogMsg;
use crate::metrics::MillMetrics;
use crate::mill_store::MillStore;
use crate::net::ConnOut;
use crate::sqlite::StoreError;

/// Commands queued for the mill driver, at most.
pub const CMD_QUEUE: usize = 16 * 1024;
/// Inputs handled in one step (one commit) at most, so a flood cannot stall replies.
const MAX_STEP_INPUTS: usize = 2048;
/// Events buffered per subscriber of job events.
pub const EVENT_BUFFER: usize = 16 * 1024;

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
        /// The answer, after the job is durable.
        reply: oneshot::Sender<Result<JobId, RequestError>>,
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
}

/// One executor as `/v1/nodes` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeView {
    /// Its node id.
    pub node: String,
    /// `ready` (takes work), `connected` (not ready yet: reconciling or cancels pending),
    /// `grace` (disconnected, leases kept) or `quarantined`.
    pub state: &'static str,
    /// Its store epoch while it has a session, as a decimal string (u64 exceeds what JSON
    /// numbers keep exactly in many clients).
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

    /// Submits a job; the id comes back once the job is durable.
    pub async fn submit(&self, spec: JobSpec) -> Result<JobId, HandleError> {
        let r = self
            .ask(|reply| MillCmd::Submit { spec, reply })
            .await
            .ok_or(HandleError::Unavailable)?;
        Ok(r?)
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

    /// Prometheus text.
    pub async fn metrics(&self) -> Option<String> {
        self.ask(|reply| MillCmd::Metrics { reply }).await
    }

    /// Placement statistics.
    pub async fn stats(&self) -> Option<Stats> {
        self.ask(|reply| MillCmd::Stats { reply }).await
    }
}

enum Deferred {
    Submit(
        oneshot::Sender<Result<JobId, RequestError>>,
        Result<JobId, RequestError>,
    ),
    Done(
        oneshot::Sender<Result<(), RequestError>>,
        Result<(), RequestError>,
    ),
}

/// The driver's state; lives on its own thread.
struct Driver {
    mill: Mill,
    store: MillStore,
    clock: Clock,
    conns: HashMap<ConnId, mpsc::Sender<ConnOut<ToExecutor>>>,
    outs: Vec<MillOutput>,
    deferred: Vec<Deferred>,
    metrics: MillMetrics,
    latency_us: hdrhistogram::Histogram<u64>,
    commit_us_total: u64,
    events: broadcast::Sender<JobEvent>,
    logs: mpsc::Sender<LogMsg>,
}

/// Starts the driver thread for `mill` on `store`. It runs until `shutdown` turns true, then
/// commits what is left, closes every connection and closes the store cleanly.
pub fn spawn(
    mill: Mill,
    store: MillStore,
    clock: Clock,
    events: broadcast::Sender<JobEvent>,
    logs: mpsc::Sender<LogMsg>,
    restored_cursors: std::collections::BTreeMap<
        (NodeId, millrace_core::Epoch),
        millrace_core::Seqno,
    >,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<(MillHandle, std::thread::JoinHandle<Result<(), DriverError>>)> {
    let (tx, rx) = mpsc::channel(CMD_QUEUE);
    let latency_us = hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let driver = Driver {
        mill,
        store,
        clock,
        conns: HashMap::new(),
        outs: Vec::new(),
        deferred: Vec::new(),
        metrics: MillMetrics::with_cursors(restored_cursors),
        latency_us,
        commit_us_total: 0,
        events,
        logs,
    };
    let handle = std::thread::Builder::new()
        .name("mill-driver".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .map_err(|e| StoreError::Io {
                    path: "runtime".into(),
                    source: e,
                })?;
            rt.block_on(driver.run(rx, shutdown))
        })?;
    Ok((MillHandle { tx }, handle))
}

impl Driver {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<MillCmd>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), DriverError> {
        // Outputs of `Mill::new` (a restart's persists and updates) come first.
        self.drain();
        self.flush()?;
        loop {
            if *shutdown.borrow() {
                break;
            }
            let deadline = self.mill.next_deadline().map(|t| self.clock.instant_of(t));
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            let first = tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                cmd = rx.recv() => match cmd {
                    Some(c) => Some(c),
                    None => break,
                },
                () = sleep => None,
            };
            if let Some(cmd) = first {
                self.input(cmd);
                for _ in 1..MAX_STEP_INPUTS {
                    match rx.try_recv() {
                        Ok(cmd) => self.input(cmd),
                        Err(_) => break,
                    }
                }
            }
            let now = self.clock.now();
            if self.mill.next_deadline().is_some_and(|d| d <= now) {
                let _ = self.mill.handle(now, MillInput::Tick);
                self.drain();
            }
            self.flush()?;
        }
        self.flush()?;
        for (_, tx) in self.conns.drain() {
            let _ = tx.try_send(ConnOut::Close("the mill is shutting down".into()));
        }
        let path = self.store.path().display().to_string();
        self.store.close()?;
        tracing::info!(store = %path, "mill store closed");
        Ok(())
    }

    fn drain(&mut self) {
        while let Some(o) = self.mill.poll_output() {
            self.outs.push(o);
        }
    }

    fn input(&mut self, cmd: MillCmd) {
        let now = self.clock.now();
        match cmd {
            MillCmd::Connected { conn, tx } => {
                self.conns.insert(conn, tx);
                let _ = self.mill.handle(now, MillInput::Connected { conn });
            }
            MillCmd::Net(input) => {
                if let MillInput::Disconnected { conn } = &input {
                    self.conns.remove(conn);
                }
                let _ = self.mill.handle(now, input);
            }
            MillCmd::Submit { spec, reply } => {
                let r = self.mill.handle(
                    now,
                    MillInput::Submit {
                        spec,
                        submitted_at_ms: wall_ms(),
                    },
                );
                let r = r.map(|reply| match reply {
                    Reply::Submitted(job) => job,
                    Reply::Done => JobId(0),
                });
                if r.is_ok() {
                    self.metrics.submitted += 1;
                }
                self.deferred.push(Deferred::Submit(reply, r));
            }
            MillCmd::Cancel { job, reason, reply } => {
                let r = self.mill.handle(now, MillInput::Cancel { job, reason });
                self.deferred.push(Deferred::Done(reply, r.map(|_| ())));
            }
            MillCmd::Lift { node, reply } => {
                let r = self.mill.handle(now, MillInput::LiftQuarantine { node });
                self.deferred.push(Deferred::Done(reply, r.map(|_| ())));
            }
            MillCmd::Nodes { reply } => {
                let _ = reply.send(self.nodes());
            }
            MillCmd::Metrics { reply } => {
                let _ = reply.send(self.metrics.render(&self.mill));
            }
            MillCmd::Stats { reply } => {
                let h = &self.latency_us;
                let _ = reply.send(Stats {
                    placed: self.metrics.placed,
                    p50_us: h.value_at_quantile(0.5),
                    p99_us: h.value_at_quantile(0.99),
                    p999_us: h.value_at_quantile(0.999),
                    commits: self.metrics.batches,
                    commit_mean_us: self
                        .commit_us_total
                        .checked_div(self.metrics.batches)
                        .unwrap_or(0),
                });
            }
        }
        self.drain();
    }

    fn nodes(&self) -> Vec<NodeView> {
        let mut leases: HashMap<&NodeId, (usize, usize)> = HashMap::new();
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
            });
        }
        out
    }

    /// Group commit: every `Persist` of the step in one transaction, then the other outputs
    /// in order, then the deferred client replies.
    fn flush(&mut self) -> Result<(), DriverError> {
        if self.outs.is_empty() && self.deferred.is_empty() {
            return Ok(());
        }
        let (batches, rest) = crate::sqlite::split_persists(&mut self.outs, |o| match o {
            MillOutput::Persist(b) => crate::sqlite::Split::Persist(b),
            other => crate::sqlite::Split::Other(other),
        });
        if !batches.is_empty() {
            let started = Instant::now();
            self.store.apply(&batches, wall_ms())?;
            let took = started.elapsed();
            self.metrics.commit_latency.observe(took);
            self.metrics.batches += 1;
            self.commit_us_total = self
                .commit_us_total
                .saturating_add(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
            for b in &batches {
                for w in &b.writes {
                    if let MillWrite::Cursor { node, epoch, seqno } = w {
                        self.metrics.cursor(node, *epoch, *seqno);
                    }
                }
            }
        }
        for o in rest {
            self.act(o);
        }
        for d in self.deferred.drain(..) {
            match d {
                Deferred::Submit(tx, r) => {
                    let _ = tx.send(r);
                }
                Deferred::Done(tx, r) => {
                    let _ = tx.send(r);
                }
            }
        }
        Ok(())
    }

    fn act(&mut self, output: MillOutput) {
        match output {
            MillOutput::Send { conn, msg } => {
                let Some(tx) = self.conns.get(&conn) else {
                    return;
                };
                if tx.try_send(ConnOut::Send(msg)).is_err() {
                    // A peer this far behind is cut off; its task reports Disconnected.
                    tracing::warn!(%conn, "send queue full; closing the connection");
                    self.metrics.send_overflows += 1;
                    self.conns.remove(&conn);
                }
            }
            MillOutput::Close { conn, reason } => {
                tracing::info!(%conn, %reason, "closing executor connection");
                if let Some(tx) = self.conns.remove(&conn) {
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
                    let _ = self.logs.try_send(LogMsg::Done { job });
                }
                let _ = self.events.send(JobEvent {
                    job,
                    kind: JobEventKind::State(state),
                    at: Instant::now(),
                });
            }
            MillOutput::LiveLog { job, bytes, .. } => {
                if self.logs.try_send(LogMsg::Append { job, bytes }).is_err() {
                    self.metrics.live_log_dropped += 1;
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
                self.metrics.placed += 1;
                self.metrics.placement_latency.observe(latency);
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
                self.metrics.quarantined += 1;
                tracing::warn!(%node, "node quarantined; lift with `millrace quarantine lift`");
            }
            Observation::Refused { conn, reason } => {
                self.metrics.refused += 1;
                tracing::warn!(%conn, %reason, "executor refused");
            }
            Observation::Rare(path) => {
                tracing::debug!(?path, "rare path");
            }
        }
    }
}
