//! The `shell` engine: runs a job's payload with `sh -c` in a fresh working directory, in its
//! own process group, with stdout and stderr captured to `logs/<lease>.log` (hashed with
//! sha256 for the log reference, M25) and streamed to the driver as `JobLog`.
//!
//! A stop sends SIGTERM to the whole group and SIGKILL after the grace. When the job's shell
//! exits, whatever it left running in its group is killed. The process group id is written
//! to `work/<lease>.pgid` so that a restarted executor can kill the leftovers of a previous
//! process before the core fails their jobs "executor restarted" (E9).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use millrace_core::executor::ExecutorInput;
use millrace_core::job::{JobSpec, LogRef, TerminalStatus};
use millrace_core::{JobId, LeaseId};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use crate::exec_driver::ExecCmd;

/// Bytes read from a job's output at once (and the largest `JobLog`).
const READ_CHUNK: usize = 32 * 1024;
/// How long the log reader may take to finish after the job's group is gone.
const READER_GRACE: Duration = Duration::from_secs(5);
/// Largest log kept per job on the executor's disk; the rest of the output is discarded.
const MAX_LOG: u64 = 1 << 30;
/// Environment variable marking a job's processes with its lease (for restart cleanup).
const LEASE_ENV: &str = "MILLRACE_LEASE_ID";

struct Running {
    stop: Option<oneshot::Sender<Duration>>,
    pgid: std::sync::Arc<std::sync::atomic::AtomicI32>,
}

/// Runs shell jobs for one executor. Owned by the executor driver.
pub struct ShellEngine {
    data: PathBuf,
    tx: mpsc::Sender<ExecCmd>,
    runtime: tokio::runtime::Handle,
    hard_cap: Option<Duration>,
    running: BTreeMap<LeaseId, Running>,
}

impl ShellEngine {
    /// An engine storing logs and working directories under `data`, reporting on `tx`.
    /// `hard_cap` kills a job that runs longer (the mill's timeout, M18, normally ends it
    /// first through a cancel).
    pub fn new(
        data: &Path,
        tx: mpsc::Sender<ExecCmd>,
        runtime: tokio::runtime::Handle,
        hard_cap: Option<Duration>,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(data.join("logs"))?;
        std::fs::create_dir_all(data.join("work"))?;
        Ok(ShellEngine {
            data: data.to_path_buf(),
            tx,
            runtime,
            hard_cap,
            running: BTreeMap::new(),
        })
    }

    /// Starts a committed job (`StartJob`). Reports `JobStarted`, `JobLog`s, then `JobExited`.
    pub fn start(
        &mut self,
        lease: LeaseId,
        job: JobId,
        spec: JobSpec,
        secrets: BTreeMap<String, String>,
    ) {
        let (stop_tx, stop_rx) = oneshot::channel();
        let pgid = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
        self.running.insert(
            lease,
            Running {
                stop: Some(stop_tx),
                pgid: pgid.clone(),
            },
        );
        let ctx = JobCtx {
            lease,
            job,
            payload: spec.payload,
            secrets,
            data: self.data.clone(),
            tx: self.tx.clone(),
            hard_cap: self.hard_cap,
            pgid,
        };
        self.runtime.spawn(run_job(ctx, stop_rx));
    }

    /// Stops a job (`StopJob`): SIGTERM to its group now, SIGKILL after `grace`.
    pub fn stop(&mut self, lease: LeaseId, grace: Duration) {
        if let Some(r) = self.running.get_mut(&lease) {
            if let Some(stop) = r.stop.take() {
                let _ = stop.send(grace);
            }
        }
    }

    /// The driver saw the job's `JobExited`.
    pub fn exited(&mut self, lease: LeaseId) {
        self.running.remove(&lease);
    }

    /// Kills every running job's group at once (shutdown after the drain timeout).
    pub fn kill_all(&mut self) {
        for (lease, r) in &self.running {
            let pgid = r.pgid.load(std::sync::atomic::Ordering::SeqCst);
            if pgid > 0 {
                tracing::warn!(%lease, pgid, "killing job at shutdown");
                let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            }
        }
    }

    /// Kills the leftovers of jobs a previous process of this executor ran (every
    /// `work/<lease>.pgid` left behind), so that nothing keeps running that the core is about to fail (E9).
    pub fn reap_previous(data: &Path) {
        let work = data.join("work");
        let Ok(entries) = std::fs::read_dir(&work) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("pgid") {
                continue;
            }
            let lease = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse::<u64>().ok())
                .map(LeaseId);
            let pgid = std::fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok());
            if let (Some(lease), Some(pgid)) = (lease, pgid) {
                let killed = kill_marked_group(pgid, lease);
                if killed > 0 {
                    tracing::warn!(%lease, pgid, killed, "killed processes left by the previous executor process");
                }
            }
            let _ = std::fs::remove_file(&path);
            if let Some(lease) = lease {
                let _ = std::fs::remove_dir_all(work.join(lease.get().to_string()));
            }
        }
    }
}

/// Kills the processes of group `pgid` that carry `lease`'s marker (a pid may have been
/// reused since, so unmarked processes are left alone). Returns how many were signalled.
fn kill_marked_group(pgid: i32, lease: LeaseId) -> usize {
    let marker = format!("{LEASE_ENV}={}", lease.get());
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut killed = 0;
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(p.path().join("stat")) else {
            continue;
        };
        // Fields after the command name (which may hold spaces) in parentheses.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let group = rest
            .split_whitespace()
            .nth(2)
            .and_then(|s| s.parse::<i32>().ok());
        if group != Some(pgid) {
            continue;
        }
        let Ok(env) = std::fs::read(p.path().join("environ")) else {
            continue;
        };
        if env.split(|b| *b == 0).any(|kv| kv == marker.as_bytes()) {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
            killed += 1;
        }
    }
    killed
}

struct JobCtx {
    lease: LeaseId,
    job: JobId,
    payload: Vec<u8>,
    secrets: BTreeMap<String, String>,
    data: PathBuf,
    tx: mpsc::Sender<ExecCmd>,
    hard_cap: Option<Duration>,
    pgid: std::sync::Arc<std::sync::atomic::AtomicI32>,
}

enum Outcome {
    Exited(std::io::Result<ExitStatus>),
    Stopped(std::io::Result<ExitStatus>),
    HardCap(std::io::Result<ExitStatus>),
}

async fn report(tx: &mpsc::Sender<ExecCmd>, input: ExecutorInput) {
    let _ = tx.send(ExecCmd::Input(input)).await;
}

async fn run_job(ctx: JobCtx, stop_rx: oneshot::Receiver<Duration>) {
    let lease = ctx.lease;
    let work_root = ctx.data.join("work");
    let work = work_root.join(lease.get().to_string());
    let pgid_file = work_root.join(format!("{}.pgid", lease.get()));
    let log_path = ctx.data.join(LogRef::path_for(lease));
    let spawned = spawn(&ctx, &work, &log_path);
    let (mut child, reader) = match spawned {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!(%lease, error = %e, "job could not start");
            report(
                &ctx.tx,
                ExecutorInput::JobExited {
                    lease,
                    status: TerminalStatus::Failed,
                    exit_code: None,
                    error: Some(format!("could not start the job: {e}")),
                    log: None,
                },
            )
            .await;
            return;
        }
    };
    let pgid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    ctx.pgid.store(pgid, std::sync::atomic::Ordering::SeqCst);
    if pgid > 0 {
        let _ = std::fs::write(&pgid_file, pgid.to_string());
    }
    tracing::info!(%lease, job = %ctx.job, pgid, "job started");
    report(&ctx.tx, ExecutorInput::JobStarted { lease }).await;

    let stop = async {
        match stop_rx.await {
            Ok(grace) => grace,
            Err(_) => std::future::pending().await,
        }
    };
    let cap = async {
        match ctx.hard_cap {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    let outcome = tokio::select! {
        status = child.wait() => Outcome::Exited(status),
        grace = stop => Outcome::Stopped(terminate(&mut child, pgid, grace).await),
        () = cap => Outcome::HardCap(terminate(&mut child, pgid, Duration::from_secs(10)).await),
    };
    // Whatever the job left in its group goes with it.
    if pgid > 0 {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
    let hash = match tokio::time::timeout(READER_GRACE, reader).await {
        Ok(Ok(Ok(hash))) => Some(hash),
        Ok(Ok(Err(e))) => {
            tracing::warn!(%lease, error = %e, "job log could not be written");
            None
        }
        _ => {
            // A process that left the group still holds the pipe: hash what is on disk.
            hash_file(&log_path).ok()
        }
    };
    let _ = std::fs::remove_file(&pgid_file);
    let _ = std::fs::remove_dir_all(&work);
    let log = hash.map(|h| LogRef {
        path: LogRef::path_for(lease),
        hash: format!("sha256:{h}"),
    });
    let (status, exit_code, error) = match outcome {
        Outcome::Exited(Ok(s)) => exit_meaning(s),
        Outcome::Stopped(Ok(s)) => {
            let (_, code, _) = exit_meaning(s);
            (TerminalStatus::Cancelled, code, Some("stopped".to_string()))
        }
        Outcome::HardCap(Ok(s)) => {
            let (_, code, _) = exit_meaning(s);
            let cap = ctx.hard_cap.unwrap_or_default();
            (
                TerminalStatus::Timeout,
                code,
                Some(format!("exceeded the executor's hard cap of {cap:?}")),
            )
        }
        Outcome::Exited(Err(e)) | Outcome::Stopped(Err(e)) | Outcome::HardCap(Err(e)) => (
            TerminalStatus::Failed,
            None,
            Some(format!("could not wait for the job: {e}")),
        ),
    };
    tracing::info!(%lease, job = %ctx.job, %status, ?exit_code, "job exited");
    report(
        &ctx.tx,
        ExecutorInput::JobExited {
            lease,
            status,
            exit_code,
            error,
            log,
        },
    )
    .await;
}

type Reader = tokio::task::JoinHandle<std::io::Result<String>>;

fn spawn(
    ctx: &JobCtx,
    work: &Path,
    log_path: &Path,
) -> std::io::Result<(tokio::process::Child, Reader)> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    if let Some(dir) = log_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let log = std::fs::File::create(log_path)?;
    let (read_end, write_end) = std::io::pipe()?;
    let child = {
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c")
            .arg(std::ffi::OsStr::from_bytes(&ctx.payload))
            .current_dir(work)
            .stdin(std::process::Stdio::null())
            .stdout(write_end.try_clone()?)
            .stderr(write_end)
            .process_group(0)
            .kill_on_drop(false);
        // The executor's own settings (its token above all) are not the job's business.
        for (key, _) in std::env::vars_os() {
            if key.as_bytes().starts_with(b"MILLRACE_") {
                cmd.env_remove(key);
            }
        }
        cmd.env("MILLRACE_JOB_ID", ctx.job.get().to_string())
            .env(LEASE_ENV, ctx.lease.get().to_string())
            .env("MILLRACE_WORKDIR", work);
        for (k, v) in &ctx.secrets {
            cmd.env(k, v);
        }
        cmd.spawn()?
        // `cmd` (holding the pipe's write ends) drops here, so the reader sees EOF once
        // the job's processes are gone.
    };
    let tx = ctx.tx.clone();
    let lease = ctx.lease;
    let reader = tokio::task::spawn_blocking(move || pump(read_end, log, lease, &tx));
    Ok((child, reader))
}

/// Copies the job's output to its log file and the driver; returns the sha256 (hex).
fn pump(
    mut from: std::io::PipeReader,
    mut log: std::fs::File,
    lease: LeaseId,
    tx: &mpsc::Sender<ExecCmd>,
) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut written = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if written >= MAX_LOG {
            // Keep draining so the job does not block on a full pipe; keep nothing.
            continue;
        }
        let mut chunk = buf.get(..n).unwrap_or_default();
        let room = usize::try_from(MAX_LOG - written).unwrap_or(usize::MAX);
        let cut = chunk.len() > room;
        if cut {
            chunk = chunk.get(..room).unwrap_or_default();
        }
        log.write_all(chunk)?;
        hasher.update(chunk);
        written += chunk.len() as u64;
        if cut {
            let marker = b"\n[millrace: log truncated at the executor's limit]\n";
            log.write_all(marker)?;
            hasher.update(marker);
            written = MAX_LOG;
        }
        let _ = tx.blocking_send(ExecCmd::Input(ExecutorInput::JobLog {
            lease,
            bytes: chunk.to_vec(),
        }));
    }
    log.sync_data()?;
    Ok(hex(&hasher.finalize()))
}

fn hash_file(path: &Path) -> std::io::Result<String> {
    let bytes = std::fs::read(path)?;
    Ok(hex(&Sha256::digest(&bytes)))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// SIGTERM to the group, SIGKILL after `grace`, then the exit status.
async fn terminate(
    child: &mut tokio::process::Child,
    pgid: i32,
    grace: Duration,
) -> std::io::Result<ExitStatus> {
    if pgid > 0 {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGTERM);
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(status) => status,
        Err(_) => {
            if pgid > 0 {
                let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            }
            child.wait().await
        }
    }
}

fn exit_meaning(s: ExitStatus) -> (TerminalStatus, Option<i32>, Option<String>) {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(0), _) => (TerminalStatus::Success, Some(0), None),
        (Some(code), _) => (
            TerminalStatus::Failed,
            Some(code),
            Some(format!("exit status {code}")),
        ),
        (None, Some(sig)) => (
            TerminalStatus::Failed,
            None,
            Some(format!("killed by signal {sig}")),
        ),
        (None, None) => (
            TerminalStatus::Failed,
            None,
            Some("ended without a status".to_string()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn m25_log_hash_is_lowercase_sha256_hex() {
        let h = hex(&Sha256::digest(b"hello\n"));
        assert_eq!(
            h,
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
        );
        let r = LogRef {
            path: LogRef::path_for(LeaseId(3)),
            hash: format!("sha256:{h}"),
        };
        assert!(r.is_valid_for(LeaseId(3)));
    }
}
