//! The executor driver: one thread owns the `Executor`. Inputs (connection events, engine
//! reports, drain) arrive on a bounded channel; each step's `Persist` batches are written in
//! one SQLite transaction before any output of the step is acted on; connections are dialled
//! when the core asks (`Connect`), with the backoff the core computes (E11).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use millrace_core::codec::FrameDecoder;
use millrace_core::executor::{ExecutorInput, ExecutorOutput, ExecutorWrite};
use millrace_core::wire::{ToExecutor, ToMill};
use millrace_core::ConnId;
use tokio::sync::{mpsc, watch};

use crate::clock::Clock;
use crate::exec_store::ExecStore;
use crate::net::{self, ConnOut, OUT_QUEUE};
/// The engine the driver runs jobs on: the shell engine, or under madsim (issue 16) the
/// simulated one behind the same interface.
#[cfg(not(madsim))]
pub use crate::shell::ShellEngine as Engine;
#[cfg(madsim)]
pub use crate::sim_engine::SimEngine as Engine;
use crate::sqlite::StoreError;

/// Inputs queued for the executor driver, at most.
pub const CMD_QUEUE: usize = 4096;
/// Inputs handled in one step at most.
const MAX_STEP_INPUTS: usize = 1024;

/// Something for the executor driver.
#[derive(Debug)]
pub enum ExecCmd {
    /// A dialled connection is up; its writer queue.
    Connected {
        /// The connection.
        conn: ConnId,
        /// Messages for it.
        tx: mpsc::Sender<ConnOut<ToMill>>,
    },
    /// Any other input: connect failures, messages, disconnects, engine reports.
    Input(ExecutorInput),
}

/// How the executor driver stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ExecDriverError {
    /// A group commit failed; the process must stop (persist before acting).
    #[error("executor store write failed: {0}")]
    Store(#[from] StoreError),
    /// The driver's runtime could not start.
    #[error("executor runtime: {0}")]
    Runtime(std::io::Error),
}

/// What the driver needs besides the core.
pub struct ExecDriverParts {
    /// The state machine.
    pub executor: millrace_core::executor::Executor,
    /// Its store.
    pub store: ExecStore,
    /// The process clock.
    pub clock: Clock,
    /// The mills' executor addresses, as the core's `ExecutorConfig::mills` lists them, each
    /// with its TLS settings (`None`: plain TCP): `Connect{mill: i}` dials `mills[i]`
    /// (DESIGN §10).
    pub mills: Vec<(String, Option<crate::tls::ExecTls>)>,
    /// The engine.
    pub engine: Engine,
    /// How long a drain may wait for running jobs and the outbox.
    pub drain_timeout: Duration,
    /// Where connection tasks run.
    pub runtime: tokio::runtime::Handle,
}

/// Starts the driver thread. It runs until `shutdown` turns true, drains (no new seats,
/// running jobs finish, the outbox is acked) up to `drain_timeout`, then kills what still
/// runs and closes the store.
pub fn spawn(
    parts: ExecDriverParts,
    tx: mpsc::Sender<ExecCmd>,
    rx: mpsc::Receiver<ExecCmd>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<crate::rt::Joiner<Result<(), ExecDriverError>>> {
    let name = format!("exec-{}", parts.executor.node_id());
    crate::rt::spawn_async(
        name,
        move || {
            let driver = Driver {
                conns: std::collections::BTreeMap::new(),
                next_conn: 1,
                outs: Vec::new(),
                tx,
                parts,
            };
            driver.run(rx, shutdown)
        },
        |e| Err(ExecDriverError::Runtime(e)),
    )
}

struct Driver {
    parts: ExecDriverParts,
    conns: std::collections::BTreeMap<ConnId, mpsc::Sender<ConnOut<ToMill>>>,
    next_conn: u64,
    outs: Vec<ExecutorOutput>,
    tx: mpsc::Sender<ExecCmd>,
}

impl Driver {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<ExecCmd>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), ExecDriverError> {
        self.drain_outputs();
        self.flush()?;
        let mut drain_deadline: Option<Instant> = None;
        loop {
            if drain_deadline.is_none() && *shutdown.borrow() {
                let timeout = self.parts.drain_timeout;
                tracing::info!(
                    ?timeout,
                    "draining: no new seats; waiting for running jobs and the outbox"
                );
                drain_deadline = Some(Instant::now() + timeout);
                let now = self.parts.clock.now();
                self.parts.executor.handle(now, ExecutorInput::Drain);
                self.drain_outputs();
                self.flush()?;
            }
            if drain_deadline.is_some() && self.parts.executor.is_drained() {
                tracing::info!("drained");
                break;
            }
            if drain_deadline.is_some_and(|d| Instant::now() >= d) {
                let left = self.parts.executor.running_leases().count();
                tracing::warn!(running = left, "drain timeout: leaving what still runs to its supervisors; the next executor process adopts it (E9, E14)");
                break;
            }
            let deadline = self
                .parts
                .executor
                .next_deadline()
                .map(|t| self.parts.clock.instant_of(t));
            let wake = match (deadline, drain_deadline) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let sleep = async {
                match wake {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            let stopping = drain_deadline.is_some();
            let first = tokio::select! {
                biased;
                r = shutdown.changed(), if !stopping => {
                    if r.is_err() {
                        // The owner is gone: treat as a shutdown request.
                        drain_deadline.get_or_insert_with(|| Instant::now() + self.parts.drain_timeout);
                    }
                    continue;
                }
                cmd = rx.recv() => cmd,
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
            let now = self.parts.clock.now();
            if self
                .parts
                .executor
                .next_deadline()
                .is_some_and(|d| d <= now)
            {
                self.parts.executor.handle(now, ExecutorInput::Tick);
                self.drain_outputs();
            }
            self.flush()?;
        }
        self.parts.engine.detach_all();
        for (_, tx) in std::mem::take(&mut self.conns) {
            let _ = tx.try_send(ConnOut::Close("the executor is shutting down".into()));
        }
        self.parts.store.close()?;
        tracing::info!("executor store closed");
        Ok(())
    }

    fn drain_outputs(&mut self) {
        while let Some(o) = self.parts.executor.poll_output() {
            self.outs.push(o);
        }
    }

    fn input(&mut self, cmd: ExecCmd) {
        let now = self.parts.clock.now();
        let input = match cmd {
            ExecCmd::Connected { conn, tx } => {
                self.conns.insert(conn, tx);
                ExecutorInput::Connected { conn }
            }
            ExecCmd::Input(input) => input,
        };
        match &input {
            ExecutorInput::Disconnected { conn } => {
                self.conns.remove(conn);
            }
            ExecutorInput::JobExited { lease, .. } | ExecutorInput::JobLost { lease } => {
                self.parts.engine.exited(*lease);
            }
            ExecutorInput::Message {
                msg: ToExecutor::Refused { leader: _, reason },
                ..
            } => {
                tracing::error!(%reason, "the mill refused this executor");
            }
            _ => {}
        }
        self.parts.executor.handle(now, input);
        self.drain_outputs();
    }

    fn flush(&mut self) -> Result<(), ExecDriverError> {
        if self.outs.is_empty() {
            return Ok(());
        }
        let (batches, rest) = crate::sqlite::split_persists(&mut self.outs, |o| match o {
            ExecutorOutput::Persist(b) => crate::sqlite::Split::Persist(b),
            other => crate::sqlite::Split::Other(other),
        });
        if !batches.is_empty() {
            self.parts.store.apply(&batches)?;
            // A job's supervisor directory holds its exit record until its terminal is
            // durable here; only then may it go (E5, E14).
            for batch in &batches {
                for write in &batch.writes {
                    match write {
                        ExecutorWrite::JobEnded { lease } => self.parts.engine.collected(*lease),
                        ExecutorWrite::JobStopping {
                            lease,
                            stop: millrace_core::executor::StopReason::Fence,
                        } => {
                            let grace = self.parts.executor.timers().reconnect_grace;
                            tracing::warn!(%lease, ?grace, "self-fencing: nothing heard from the mill for reconnect_grace; stopping the job, which ends failed \"executor lost contact with the mill\" (E12)");
                        }
                        // Supervisors fence by the durable contact too (E12, E14).
                        ExecutorWrite::Contact { at } => {
                            self.parts.engine.contact(at.as_micros() / 1000);
                        }
                        // A Welcome handed over the mill's timers (M1, E12).
                        ExecutorWrite::Timers(t) => {
                            let flags = self.parts.executor.config().session_timers();
                            tracing::warn!(
                                silence_timeout = ?t.silence_timeout,
                                snapshot_interval = ?t.snapshot_interval,
                                reconnect_grace = ?t.reconnect_grace,
                                flag_silence_timeout = ?flags.silence_timeout,
                                flag_snapshot_interval = ?flags.snapshot_interval,
                                flag_reconnect_grace = ?flags.reconnect_grace,
                                "the mill's Welcome carries other timers than this executor ran on: adopting them (--silence-timeout {:?}, --snapshot-interval {:?}, --reconnect-grace {:?})",
                                t.silence_timeout, t.snapshot_interval, t.reconnect_grace
                            );
                            self.parts.engine.timers(t.reconnect_grace);
                        }
                        _ => {}
                    }
                }
            }
        }
        for o in rest {
            self.act(o);
        }
        Ok(())
    }

    fn act(&mut self, output: ExecutorOutput) {
        match output {
            ExecutorOutput::Connect { mill } => self.dial(mill),
            ExecutorOutput::Send { conn, msg } => {
                let Some(tx) = self.conns.get(&conn) else {
                    return;
                };
                match tx.try_send(ConnOut::Send(msg)) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        tracing::warn!(%conn, "send queue full; closing the connection");
                        self.conns.remove(&conn);
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        // The connection already ended; its task reports `Disconnected`.
                        tracing::debug!(%conn, "send to a connection that already ended");
                        self.conns.remove(&conn);
                    }
                }
            }
            ExecutorOutput::Close { conn, reason } => {
                tracing::info!(%conn, %reason, "closing the connection to the mill");
                if let Some(tx) = self.conns.remove(&conn) {
                    let _ = tx.try_send(ConnOut::Close(reason));
                }
            }
            ExecutorOutput::Persist(_) => {
                // Written by `flush` before any output is acted on.
            }
            ExecutorOutput::StartJob {
                lease,
                job,
                spec,
                secrets,
            } => self.parts.engine.start(lease, job, spec, secrets),
            ExecutorOutput::AdoptJob { lease, .. } => self.parts.engine.adopt(lease),
            ExecutorOutput::StopJob { lease, grace } => self.parts.engine.stop(lease, grace),
        }
    }

    /// Dials the mill; reports `Connected` or `ConnectFailed`, then runs the connection. With
    /// TLS, the handshake is part of the dial and shares its timeout.
    fn dial(&mut self, mill: usize) {
        let conn = ConnId(self.next_conn);
        self.next_conn += 1;
        let tx = self.tx.clone();
        let Some((addr, tls)) = self.parts.mills.get(mill).cloned() else {
            // The core only names addresses its config lists, and that list is this one.
            tracing::error!(mill, "no such mill address; treating the dial as failed");
            let _ = tx.try_send(ExecCmd::Input(ExecutorInput::ConnectFailed));
            return;
        };
        let timeout = self.parts.executor.config().silence_timeout;
        self.parts.runtime.spawn(async move {
            let dialled = tokio::time::timeout(timeout, async {
                let tcp = connect(&addr).await.map_err(Dial::Tcp)?;
                let _ = tcp.set_nodelay(true);
                match &tls {
                    None => Ok(Stream::Plain(tcp)),
                    Some(t) => tokio_rustls::TlsConnector::from(t.config.clone())
                        .connect(t.server_name.clone(), tcp)
                        .await
                        .map(|s| Stream::Tls(Box::new(s)))
                        .map_err(Dial::Handshake),
                }
            })
            .await;
            let stream = match dialled {
                Ok(Ok(s)) => s,
                Ok(Err(Dial::Tcp(e))) => {
                    // Every attempt, with why; the reconnect backoff (E11) bounds how often.
                    tracing::info!(mill = %addr, error = %e, "connecting to the mill failed; retrying after the reconnect backoff");
                    let _ = tx.send(ExecCmd::Input(ExecutorInput::ConnectFailed)).await;
                    return;
                }
                Ok(Err(Dial::Handshake(e))) => {
                    // A configuration problem more often than not (wrong CA, wrong name):
                    // say so every time; the reconnect backoff bounds how often.
                    tracing::warn!(
                        mill = %addr,
                        server_name = tls.as_ref().map(|t| t.server_name.to_str().into_owned()),
                        error = %e,
                        "TLS handshake with the mill failed"
                    );
                    let _ = tx.send(ExecCmd::Input(ExecutorInput::ConnectFailed)).await;
                    return;
                }
                Err(_) => {
                    tracing::info!(mill = %addr, timeout = ?timeout, "connecting to the mill timed out; retrying after the reconnect backoff");
                    let _ = tx.send(ExecCmd::Input(ExecutorInput::ConnectFailed)).await;
                    return;
                }
            };
            tracing::info!(mill = %addr, %conn, tls = tls.is_some(), "connected to the mill");
            let (out_tx, out_rx) = mpsc::channel(OUT_QUEUE);
            if tx
                .send(ExecCmd::Connected { conn, tx: out_tx })
                .await
                .is_err()
            {
                return;
            }
            let ended = match stream {
                Stream::Plain(s) => run_conn(s, conn, out_rx, tx.clone()).await,
                Stream::Tls(s) => run_conn(*s, conn, out_rx, tx.clone()).await,
            };
            tracing::info!(%conn, reason = %ended, "disconnected from the mill");
            let _ = tx
                .send(ExecCmd::Input(ExecutorInput::Disconnected { conn }))
                .await;
        });
    }
}

/// Why a dial failed.
enum Dial {
    /// No TCP connection.
    Tcp(std::io::Error),
    /// The TLS handshake failed.
    Handshake(std::io::Error),
}

/// A dialled connection.
enum Stream {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

/// Frames one connection to the mill until it ends.
async fn run_conn<S: net::Transport>(
    stream: S,
    conn: ConnId,
    out_rx: mpsc::Receiver<ConnOut<ToMill>>,
    tx: mpsc::Sender<ExecCmd>,
) -> net::Ended {
    net::run(
        stream,
        out_rx,
        |d: &mut FrameDecoder| d.next_frame::<ToExecutor>(),
        move |msg| {
            let tx = tx.clone();
            async move {
                tx.send(ExecCmd::Input(ExecutorInput::Message { conn, msg }))
                    .await
                    .is_ok()
            }
        },
    )
    .await
}

async fn connect(addr: &str) -> std::io::Result<tokio::net::TcpStream> {
    match addr.parse::<SocketAddr>() {
        Ok(a) => tokio::net::TcpStream::connect(a).await,
        Err(_) => tokio::net::TcpStream::connect(addr).await,
    }
}
