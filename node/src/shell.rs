//! The `shell` engine: runs each job's payload with `sh -c` under its own supervisor process
//! (`millrace supervise`, see `supervisor`), which outlives the executor (E14). The engine
//! launches supervisors for new jobs (`StartJob`), re-attaches to the supervisors of a
//! previous process of this executor (`AdoptJob`, E9), relays their output to the driver as
//! `JobLog`, passes stops on, and reports each job's end from the exit record its supervisor
//! wrote durably in `jobs/<lease>/exit.json`. Logs are `logs/<lease>.log` (hashed, M25).
//!
//! With `--runtime-dir` (issue 15) a supervisor's directory (socket, pid file, its own log,
//! the record it hands to an attached executor) is `RUNTIME/jobs/<lease>`, typically on
//! tmpfs: per job that is five files and a directory fewer created and deleted on the data
//! disk. A record no executor takes over is still made durable on the data disk, in
//! `DATA/jobs/<lease>/exit.json`, so a job that ended while its executor was away reports
//! its real status even after a reboot emptied the runtime directory. Supervisors do not
//! survive a reboot, so nothing else in the runtime directory needs to.
//!
//! A job directory is removed only after the driver has persisted the job's terminal
//! (`collected`), so a crash in between finds the exit record again and reports the same
//! end (exactly once through the outbox, E5).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use millrace_core::executor::ExecutorInput;
use millrace_core::job::{JobSpec, LogRef, TerminalStatus};
use millrace_core::{Epoch, JobId, LeaseId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::exec_driver::ExecCmd;
use crate::supervisor::{self, ExitRecord, FromSupervisor, Launch, StopCause, ToSupervisor};

/// How long a new supervisor may take to listen.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connecting to (and greeting) a supervisor may take.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a job's attachment waits for its terminal to be durable here before leaving
/// the supervisor to make its exit record durable itself.
const COLLECT_WAIT: Duration = Duration::from_secs(30);
/// The longest pause between attempts to connect to a supervisor that is starting up.
const CONNECT_POLL_MAX: Duration = Duration::from_millis(20);
/// Stops queued for one job at most (a job is stopped once; repeats are dropped).
const STOP_QUEUE: usize = 4;

/// What the engine needs to know about the executor.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// The executor's data directory.
    pub data: PathBuf,
    /// The executor's epoch; supervisors refuse (and stop for) any other (E1, E14).
    pub epoch: Epoch,
    /// How long a supervisor keeps its job with no executor attached (E14).
    pub reconnect_grace: Duration,
    /// SIGTERM → SIGKILL when a supervisor stops its job on its own.
    pub stop_grace: Duration,
    /// A job running longer is stopped (Timeout); the mill's timeout (M18) normally ends it
    /// first through a cancel.
    pub hard_cap: Option<Duration>,
    /// The user jobs run as (`--run-as`).
    pub run_as: Option<supervisor::RunAs>,
    /// `--runtime-dir`: where supervisors' directories go instead of the data directory.
    pub runtime: Option<PathBuf>,
}

impl EngineSettings {
    /// The directory supervisors' directories are made in.
    fn supervisors(&self) -> PathBuf {
        self.runtime.as_deref().unwrap_or(&self.data).join("jobs")
    }

    /// A job's supervisor directory, and the durable home of its exit record when that
    /// directory is a runtime one.
    fn job_dirs(&self, lease: LeaseId) -> (PathBuf, Option<PathBuf>) {
        let name = lease.get().to_string();
        let dir = self.supervisors().join(&name);
        let durable = self
            .runtime
            .is_some()
            .then(|| self.data.join("jobs").join(&name));
        (dir, durable)
    }
}

/// The file in the data directory naming the runtime directory the last process used.
const RUNTIME_MARK: &str = "runtime-dir";

/// Checks `--runtime-dir` against what the previous process of this data directory used
/// (issue 15), then records it. Supervisors of the previous process are found only where
/// it put them: a change while one may still run (a directory with its pid file) is refused
/// with both paths named, so no running job is taken for lost and run again elsewhere (I1).
pub fn check_runtime_dir(data: &Path, runtime: Option<&Path>) -> Result<(), String> {
    let mark = data.join(RUNTIME_MARK);
    // Compared as the directories they are (`/run/x/` and `/run/x` are one).
    let runtime = match runtime {
        Some(r) => std::fs::create_dir_all(r.join("jobs"))
            .and_then(|()| r.canonicalize())
            .map(Some)
            .map_err(|e| format!("--runtime-dir {}: {e}", r.display()))?,
        None => None,
    };
    let runtime = runtime.as_deref();
    let previous = match std::fs::read(&mark) {
        Ok(bytes) => Some(PathBuf::from(
            <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(bytes),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", mark.display())),
    };
    let previous = previous.map(|p| p.canonicalize().unwrap_or(p));
    if previous.as_deref() != runtime {
        let old = previous.as_deref().unwrap_or(data).join("jobs");
        let live = std::fs::read_dir(&old)
            .into_iter()
            .flatten()
            .flatten()
            .find(|e| e.path().join("supervisor.pid").exists());
        if let Some(entry) = live {
            let shown = |p: Option<&Path>| match p {
                Some(p) => p.display().to_string(),
                None => "(none: the data directory)".to_string(),
            };
            return Err(format!(
                "--runtime-dir {}: the previous executor process kept its supervisors in {} and {} may still run; start with --runtime-dir {} until its jobs are done",
                shown(runtime),
                old.display(),
                entry.path().display(),
                shown(previous.as_deref()),
            ));
        }
    }
    match runtime {
        Some(r) => std::fs::write(&mark, std::os::unix::ffi::OsStrExt::as_bytes(r.as_os_str()))
            .map_err(|e| format!("{}: {e}", mark.display())),
        None => match std::fs::remove_file(&mark) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("{}: {e}", mark.display())),
        },
    }
}

/// Runs shell jobs for one executor, through their supervisors. Owned by the executor driver.
pub struct ShellEngine {
    settings: EngineSettings,
    tx: mpsc::Sender<ExecCmd>,
    runtime: tokio::runtime::Handle,
    /// Stop requests for each job's attachment task.
    running: BTreeMap<LeaseId, mpsc::Sender<Duration>>,
    /// For each job's attachment task: the signal that its terminal is durable in this
    /// executor's store, passed on to the supervisor as `Collected`.
    collecting: BTreeMap<LeaseId, tokio::sync::oneshot::Sender<()>>,
    /// The executor's last contact with the mill its store holds (E12), wall ms (0: none
    /// yet), and the `reconnect_grace` it runs on (its mill's once welcomed, M1), ms; every
    /// attachment passes both on to its supervisor (`Contact`).
    contact: tokio::sync::watch::Sender<(u64, u64)>,
    /// What each supervisor runs as.
    program: SupervisorProgram,
    /// The zygote that forks supervisors, once started (dropped when it fails).
    zygote: Option<Zygote>,
}

/// The binary every job's supervisor runs (E14): `millrace-supervise` when it lies next to
/// this binary and speaks this supervisor protocol (issue 15 target 3: a small binary is a
/// cheaper `exec` per job), else this very binary's `millrace supervise`. Either is held
/// open from the engine's start and run through `/proc/self/fd`, so that, as with
/// `/proc/self/exe`, an upgrade replacing the files meanwhile does not change what runs.
#[derive(Debug)]
struct SupervisorProgram {
    /// The open `millrace-supervise`, if found (kept open for `path`).
    _file: Option<std::fs::File>,
    /// What to `exec`.
    path: PathBuf,
    /// It can run as a zygote (`supervise --zygote`): the small binary, which starts fast
    /// and has nothing else in its memory to copy into every child.
    forks: bool,
}

/// How long a zygote may take to answer one launch.
const ZYGOTE_ANSWER: Duration = Duration::from_secs(5);
/// The largest launch handed to the zygote: it fits the pipe (64 KiB on Linux), which is
/// empty at every launch (the zygote read the last one whole before answering it), so the
/// write never blocks, even on a zygote that hangs. A larger launch (a big environment or
/// many secrets) has its supervisor exec'd, with the launch on its stdin as before.
const ZYGOTE_MAX_LAUNCH: usize = 60 * 1024;

/// The executor's supervisor zygote (issue 15 target 3, `supervisor::zygote_main`): one
/// long-lived process that forks each job's supervisor, saving the `exec` of one per job.
struct Zygote {
    child: std::process::Child,
    tx: std::process::ChildStdin,
    rx: std::process::ChildStdout,
}

/// Why a zygote did not answer a launch with a pid.
enum ZygoteError {
    /// Nothing was forked for it: the launch may be started another way.
    NotForked(String),
    /// A supervisor may have been forked and its pid is not known: the launch must not be
    /// started again (two supervisors of one lease).
    Unknown(String),
}

impl Zygote {
    fn start(program: &Path) -> std::io::Result<Zygote> {
        let mut cmd = std::process::Command::new(program);
        cmd.args([supervisor::SUBCOMMAND, supervisor::ZYGOTE])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        without_millrace_env(&mut cmd);
        let mut child = cmd.spawn()?;
        match (child.stdin.take(), child.stdout.take()) {
            (Some(tx), Some(rx)) => Ok(Zygote { child, tx, rx }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(std::io::Error::other("the zygote's pipes"))
            }
        }
    }

    /// Hands `launch` (encoded) to the zygote; the pid of the supervisor it forked.
    fn launch(&mut self, launch: &[u8]) -> Result<i32, ZygoteError> {
        use std::os::fd::AsFd;
        supervisor::write_zygote_frame(&mut self.tx, launch)
            .map_err(|e| ZygoteError::NotForked(format!("writing the launch: {e}")))?;
        let mut fds = [nix::poll::PollFd::new(
            self.rx.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let wait =
            nix::poll::PollTimeout::try_from(ZYGOTE_ANSWER).unwrap_or(nix::poll::PollTimeout::MAX);
        match nix::poll::poll(&mut fds, wait) {
            Ok(0) => {
                return Err(ZygoteError::Unknown(format!(
                    "no answer within {ZYGOTE_ANSWER:?}"
                )))
            }
            Ok(_) => {}
            Err(e) => return Err(ZygoteError::Unknown(format!("poll: {e}"))),
        }
        let body = match supervisor::read_zygote_frame(&mut self.rx, 64 * 1024) {
            Ok(Some(body)) => body,
            Ok(None) => return Err(ZygoteError::Unknown("it closed its answers".into())),
            Err(e) => return Err(ZygoteError::Unknown(format!("its answer: {e}"))),
        };
        match postcard::from_bytes::<supervisor::Forked>(&body) {
            Ok(supervisor::Forked::Pid(pid)) => Ok(pid),
            Ok(supervisor::Forked::Refused(why)) => Err(ZygoteError::NotForked(why)),
            Err(e) => Err(ZygoteError::Unknown(format!("its answer: {e}"))),
        }
    }
}

impl Drop for Zygote {
    /// It holds no job state (each supervisor is a process of its own): killed and reaped.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The executor's own settings (its token above all) are not a supervisor's business.
fn without_millrace_env(cmd: &mut std::process::Command) {
    for (key, _) in std::env::vars_os() {
        if std::os::unix::ffi::OsStrExt::as_bytes(key.as_os_str()).starts_with(b"MILLRACE_") {
            cmd.env_remove(key);
        }
    }
}

impl SupervisorProgram {
    fn find() -> Self {
        use std::os::fd::AsRawFd;
        let fallback = SupervisorProgram {
            _file: None,
            path: PathBuf::from("/proc/self/exe"),
            forks: false,
        };
        let Some(sibling) = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join(supervisor::BINARY)))
        else {
            return fallback;
        };
        let Ok(file) = std::fs::File::open(&sibling) else {
            return fallback;
        };
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let speaks = std::process::Command::new(&path)
            .arg(supervisor::PROTOCOL_QUERY)
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|v| v.trim().parse::<u32>().ok());
        if speaks != Some(supervisor::PROTOCOL) {
            tracing::warn!(
                binary = %sibling.display(),
                ?speaks,
                expected = supervisor::PROTOCOL,
                "not using this supervisor binary (another supervisor protocol); jobs run under `millrace supervise`"
            );
            return fallback;
        }
        SupervisorProgram {
            _file: Some(file),
            path,
            forks: true,
        }
    }
}

/// How a job's attachment task begins.
enum Mode {
    /// A new job whose supervisor was just launched (or could not be: why).
    Start(Result<(), String>),
    /// A job of a previous process: re-attach (E9).
    Adopt,
}

impl ShellEngine {
    /// An engine storing logs, supervisors' directories and working directories under the
    /// data directory, reporting on `tx`.
    pub fn new(
        settings: EngineSettings,
        tx: mpsc::Sender<ExecCmd>,
        runtime: tokio::runtime::Handle,
    ) -> std::io::Result<Self> {
        for sub in ["logs", "work", "jobs"] {
            std::fs::create_dir_all(settings.data.join(sub))?;
        }
        std::fs::create_dir_all(settings.supervisors())?;
        let grace_ms = millis(settings.reconnect_grace);
        Ok(ShellEngine {
            settings,
            tx,
            runtime,
            running: BTreeMap::new(),
            collecting: BTreeMap::new(),
            contact: tokio::sync::watch::Sender::new((0, grace_ms)),
            program: SupervisorProgram::find(),
            zygote: None,
        })
    }

    /// Starts a committed job (`StartJob`) under a new supervisor. Reports `JobStarted`,
    /// `JobLog`s, then `JobExited`.
    pub fn start(
        &mut self,
        lease: LeaseId,
        job: JobId,
        spec: JobSpec,
        secrets: BTreeMap<String, String>,
    ) {
        let s = &self.settings;
        let workdir = s.data.join("work").join(lease.get().to_string());
        // The job's own environment first (issue 13 item 6; validated at submit: no
        // `MILLRACE_` names), then what millrace sets, then secrets: later entries win.
        let mut env: Vec<(String, String)> = spec.env.into_iter().collect();
        env.extend([
            ("MILLRACE_JOB_ID".to_string(), job.get().to_string()),
            ("MILLRACE_LEASE_ID".to_string(), lease.get().to_string()),
            (
                "MILLRACE_WORKDIR".to_string(),
                workdir.to_string_lossy().into_owned(),
            ),
        ]);
        env.extend(secrets);
        let launch = Launch {
            version: supervisor::PROTOCOL,
            epoch: s.epoch.get(),
            lease: lease.get(),
            job: job.get(),
            payload: spec.payload,
            env,
            dir: s.job_dirs(lease).0,
            workdir,
            log: s.data.join(LogRef::path_for(lease)),
            reconnect_grace_ms: millis(s.reconnect_grace),
            stop_grace_ms: millis(s.stop_grace),
            hard_cap_ms: s.hard_cap.map(millis),
            run_as: s.run_as.clone(),
            durable: s.job_dirs(lease).1,
        };
        // Launched here, in the driver's step that acted on `StartJob`, so that a graceful
        // shutdown right after it leaves a supervisor for the next process to adopt.
        let launched = launch_supervisor(&self.program, &mut self.zygote, &launch);
        self.spawn_task(lease, Mode::Start(launched));
    }

    /// Re-attaches to a job a previous process of this executor started (`AdoptJob`, E9):
    /// reports `JobStarted` then its output and `JobExited` if it still runs, `JobExited`
    /// from its exit record if it ended meanwhile, `JobLost` if nothing of it is left.
    pub fn adopt(&mut self, lease: LeaseId) {
        self.spawn_task(lease, Mode::Adopt);
    }

    fn spawn_task(&mut self, lease: LeaseId, mode: Mode) {
        let (stop_tx, stop_rx) = mpsc::channel(STOP_QUEUE);
        self.running.insert(lease, stop_tx);
        let (collected_tx, collected_rx) = tokio::sync::oneshot::channel();
        self.collecting.insert(lease, collected_tx);
        let (dir, durable) = self.settings.job_dirs(lease);
        let ctx = Ctx {
            lease,
            settings: self.settings.clone(),
            dir,
            durable,
            tx: self.tx.clone(),
            contact: self.contact.subscribe(),
        };
        self.runtime.spawn(attend(ctx, mode, stop_rx, collected_rx));
    }

    /// Stops a job (`StopJob`): its supervisor sends SIGTERM to the job's tree now and
    /// SIGKILL after `grace`.
    pub fn stop(&mut self, lease: LeaseId, grace: Duration) {
        if let Some(stop) = self.running.get(&lease) {
            let _ = stop.try_send(grace);
        }
    }

    /// The executor's store now holds `at_ms` as its last contact with the mill (E12): every
    /// supervisor hears it, so that one left without an executor fences by E12's clock.
    pub fn contact(&mut self, at_ms: u64) {
        self.contact.send_if_modified(|(c, _)| {
            let newer = at_ms > *c;
            if newer {
                *c = at_ms;
            }
            newer
        });
    }

    /// The executor's store now holds a mill's timers (M1, E12): new supervisors are
    /// launched on its `reconnect_grace`, and running ones hear it with the next `Contact`.
    pub fn timers(&mut self, reconnect_grace: Duration) {
        self.settings.reconnect_grace = reconnect_grace;
        let grace_ms = millis(reconnect_grace);
        self.contact.send_if_modified(|(_, g)| {
            let changed = *g != grace_ms;
            *g = grace_ms;
            changed
        });
    }

    /// The driver saw the job's `JobExited` (or `JobLost`).
    pub fn exited(&mut self, lease: LeaseId) {
        self.running.remove(&lease);
    }

    /// The job's terminal is durable in the outbox: its supervisor's directory and working
    /// directory go (its log stays).
    pub fn collected(&mut self, lease: LeaseId) {
        if let Some(collected) = self.collecting.remove(&lease) {
            let _ = collected.send(());
        }
        let (dir, durable) = self.settings.job_dirs(lease);
        let _ = std::fs::remove_dir_all(dir);
        if let Some(durable) = durable {
            let _ = std::fs::remove_dir_all(durable);
        }
        let data = &self.settings.data;
        let _ = std::fs::remove_dir_all(data.join("work").join(lease.get().to_string()));
    }

    /// At shutdown: the jobs still running are left to their supervisors, which keep them
    /// for `reconnect_grace` for the next executor process to adopt (an upgrade), and stop
    /// them after that (E14).
    pub fn detach_all(&mut self) {
        for lease in self.running.keys() {
            tracing::warn!(%lease, grace = ?self.settings.reconnect_grace, "leaving the job to its supervisor: the next executor process adopts it, or the supervisor stops it after reconnect_grace (E14)");
        }
        self.running.clear();
        // Their attachments close without `Collected`: each supervisor that already
        // recorded an end makes its record durable itself.
        self.collecting.clear();
    }

    /// At start, before the core adopts its jobs: supervisors in `jobs/` whose lease the
    /// store does not hold are not this store's to adopt (a wiped store left its data
    /// directory, or a terminal was persisted before the directory went): each still alive
    /// is told this executor's epoch and asked to stop its job now; directories with no live
    /// supervisor are removed. Also kills what a pre-supervisor executor left (`work/*.pgid`).
    /// With a runtime directory, its `jobs/` is swept first, then the data directory's
    /// (durable exit records, which no supervisor listens beside).
    pub fn sweep_foreign(
        data: &Path,
        runtime: Option<&Path>,
        epoch: Epoch,
        known: &BTreeSet<LeaseId>,
        stop_grace: Duration,
    ) {
        legacy::reap_previous(data);
        let bases = runtime.into_iter().chain([data]).map(|b| b.join("jobs"));
        let entries = bases.flat_map(|b| std::fs::read_dir(b).into_iter().flatten().flatten());
        for entry in entries {
            let Some(lease) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok())
                .map(LeaseId)
            else {
                continue;
            };
            if known.contains(&lease) {
                continue;
            }
            let dir = entry.path();
            match stop_foreign(&dir, epoch, lease, stop_grace) {
                Ok(()) => {
                    tracing::warn!(%lease, "asked a supervisor this store does not know to stop its job");
                }
                Err(_) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    let _ =
                        std::fs::remove_dir_all(data.join("work").join(lease.get().to_string()));
                }
            }
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Greets a live supervisor with this executor's epoch and asks it to stop (blocking, with
/// timeouts). `Err` only when no supervisor listens: once one has accepted, its directory is
/// its own, whatever happens to the greeting after that. (The supervisor answers a foreign
/// epoch's `Hello` with `Refused` and closes the connection, stopping its job by itself; a
/// `Stop` written after that fails with EPIPE. Counting that failure as "no supervisor"
/// once removed the directory of a live supervisor, which then could not write its exit
/// record.)
fn stop_foreign(dir: &Path, epoch: Epoch, lease: LeaseId, grace: Duration) -> std::io::Result<()> {
    use std::io::Write;
    let mut s = std::os::unix::net::UnixStream::connect(supervisor::socket_path(dir))?;
    let hello = ToSupervisor::Hello {
        version: supervisor::PROTOCOL,
        epoch: epoch.get(),
        lease: lease.get(),
    };
    let stop = ToSupervisor::Stop {
        grace_ms: millis(grace),
    };
    let mut frames = Vec::new();
    for msg in [hello, stop] {
        match supervisor::encode(&msg) {
            Ok(frame) => frames.extend_from_slice(&frame),
            Err(e) => {
                tracing::warn!(%lease, error = %e, "cannot encode a message to a foreign supervisor")
            }
        }
    }
    // One write for both frames; its failure leaves the supervisor alive and its directory
    // in place (see above).
    let sent = s
        .set_write_timeout(Some(ATTACH_TIMEOUT))
        .and_then(|()| s.write_all(&frames));
    if let Err(e) = sent {
        tracing::warn!(%lease, error = %e, "a foreign supervisor closed before the stop request; its Hello already stops it (E14)");
    }
    Ok(())
}

struct Ctx {
    lease: LeaseId,
    settings: EngineSettings,
    /// The supervisor's directory.
    dir: PathBuf,
    /// Where its exit record is made durable, if not in `dir` (`--runtime-dir`).
    durable: Option<PathBuf>,
    tx: mpsc::Sender<ExecCmd>,
    contact: tokio::sync::watch::Receiver<(u64, u64)>,
}

impl Ctx {
    /// The job's exit record: the one handed over in the supervisor's directory, else the
    /// durable one.
    fn record(&self) -> Option<ExitRecord> {
        read_record(&self.dir, self.durable.as_deref())
    }

    async fn report(&self, input: ExecutorInput) {
        let _ = self.tx.send(ExecCmd::Input(input)).await;
    }
}

/// How an attachment ended.
enum Ended {
    /// The supervisor said the job ended (its record is durable).
    Exited,
    /// The connection closed or failed without that.
    Closed(String),
}

/// One job's attachment: launch (for a new job), attach, relay, report the end.
async fn attend(
    mut ctx: Ctx,
    mode: Mode,
    mut stops: mpsc::Receiver<Duration>,
    collected: tokio::sync::oneshot::Receiver<()>,
) {
    let lease = ctx.lease;
    let adopting = matches!(mode, Mode::Adopt);
    if let Mode::Start(Err(e)) = mode {
        tracing::warn!(%lease, error = %e, "job could not start");
        // The supervisor may have recorded why; if not, say what we know.
        let input = match ctx.record() {
            Some(rec) => exited(lease, &rec, &ctx.settings),
            None => ExecutorInput::JobExited {
                lease,
                status: TerminalStatus::Failed,
                exit_code: None,
                error: Some(format!("could not start the job: {e}")),
                log: None,
            },
        };
        ctx.report(input).await;
        return;
    }
    let (ended, writer) = match attach(&ctx).await {
        Ok((reader, mut writer, pid)) => {
            tracing::info!(%lease, pid, adopted = adopting, "attached to the job's supervisor");
            ctx.report(ExecutorInput::JobStarted { lease }).await;
            let ended = relay(&mut ctx, reader, &mut writer, &mut stops).await;
            (ended, Some(writer))
        }
        Err(e) => (Ended::Closed(e), None),
    };
    let input = match (ctx.record(), &ended) {
        (Some(rec), _) => exited(lease, &rec, &ctx.settings),
        (None, Ended::Exited) => ExecutorInput::JobExited {
            lease,
            status: TerminalStatus::Failed,
            exit_code: None,
            error: Some("the job's supervisor reported an end but left no exit record".into()),
            log: None,
        },
        (None, Ended::Closed(why)) => {
            // No supervisor and no record: whatever of the job is left has nobody to stop
            // it; kill it here.
            let killed = supervisor::kill_marked(ctx.settings.epoch.get(), lease.get());
            tracing::warn!(%lease, reason = %why, killed, "the job's supervisor is gone and recorded no end");
            if adopting {
                ExecutorInput::JobLost { lease }
            } else {
                ExecutorInput::JobExited {
                    lease,
                    status: TerminalStatus::Failed,
                    exit_code: None,
                    error: Some(format!("the job's supervisor died ({why})")),
                    log: None,
                }
            }
        }
    };
    ctx.report(input).await;
    // The supervisor holds its exit record unsynced until this executor's store has the
    // terminal (`collected`); then it may exit without an fsync of its own.
    if let (Ended::Exited, Some(mut writer)) = (ended, writer) {
        if let Ok(Ok(())) = tokio::time::timeout(COLLECT_WAIT, collected).await {
            if let Err(e) = write_frame(&mut writer, &ToSupervisor::Collected).await {
                tracing::debug!(%lease, error = %e, "the supervisor left before Collected");
            }
        }
    }
}

/// Starts `millrace supervise` for a new job and hands it its launch on stdin (secrets
/// travel there, never on disk). Its pid goes to `supervisor.pid` in its directory, so that
/// an attachment (now or after a restart) can tell a supervisor still starting up from one
/// that is gone. Blocking, but short: a spawn and a pipe write the supervisor reads at once.
fn launch_supervisor(
    program: &SupervisorProgram,
    zygote: &mut Option<Zygote>,
    launch: &Launch,
) -> Result<(), String> {
    use std::io::Write;
    let dir = &launch.dir;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let _ = std::fs::remove_file(supervisor::exit_path(dir));
    if let Some(durable) = &launch.durable {
        let _ = std::fs::remove_file(supervisor::exit_path(durable));
    }
    let bytes = postcard::to_allocvec(launch).map_err(|e| format!("launch: {e}"))?;
    if program.forks && bytes.len() <= ZYGOTE_MAX_LAUNCH {
        if zygote.is_none() {
            match Zygote::start(&program.path) {
                Ok(z) => *zygote = Some(z),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the supervisor zygote; this job's supervisor is exec'd");
                }
            }
        }
        if let Some(z) = zygote.as_mut() {
            match z.launch(&bytes) {
                Ok(pid) => {
                    let _ = std::fs::write(dir.join("supervisor.pid"), pid.to_string());
                    return Ok(());
                }
                Err(ZygoteError::NotForked(e)) => {
                    tracing::warn!(lease = launch.lease, error = %e, "the supervisor zygote forked nothing; this job's supervisor is exec'd and a new zygote started for the next");
                    *zygote = None;
                }
                Err(ZygoteError::Unknown(e)) => {
                    *zygote = None;
                    // A supervisor may be waiting for its attachment: the attachment task
                    // does not attach (the job is reported not started), so it starts
                    // nothing and ends after `reconnect_grace` (E14).
                    return Err(format!("the supervisor zygote: {e}"));
                }
            }
        }
    }
    let errlog = dir.join("supervisor.log");
    let err = std::fs::File::create(&errlog).map_err(|e| format!("{}: {e}", errlog.display()))?;
    let mut cmd = std::process::Command::new(&program.path);
    cmd.arg(supervisor::SUBCOMMAND)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(err);
    without_millrace_env(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("millrace supervise: {e}"))?;
    let _ = std::fs::write(dir.join("supervisor.pid"), child.id().to_string());
    let written = match child.stdin.take() {
        Some(mut stdin) => stdin.write_all(&bytes).map_err(|e| format!("launch: {e}")),
        None => Err("launch: no stdin".to_string()),
    };
    // Reap it when it exits (if the executor dies first, init or a subreaper does).
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    written
}

/// Whether the supervisor whose pid is in `dir/supervisor.pid` still runs.
fn supervisor_alive(dir: &Path) -> bool {
    let Some(pid) = std::fs::read_to_string(dir.join("supervisor.pid"))
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
    else {
        return false;
    };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let mut fields = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace())
        .into_iter()
        .flatten();
    let running = fields
        .next()
        .is_some_and(|state| state != "Z" && state != "X");
    let ppid = fields.next().and_then(|p| p.parse::<u32>().ok());
    // Our own child, just forked (it may not have exec'd yet), or a process running the
    // supervisor mode: the pid may have been reused by an unrelated process since.
    let ours = ppid == Some(std::process::id());
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    running
        && (ours
            || cmdline
                .split(|b| *b == 0)
                .any(|a| a == supervisor::SUBCOMMAND.as_bytes()))
}

/// The exit record in `dir`, else the one in `durable`.
fn read_record(dir: &Path, durable: Option<&Path>) -> Option<ExitRecord> {
    supervisor::read_exit(dir).or_else(|| durable.and_then(supervisor::read_exit))
}

/// Connects to the job's supervisor, waiting while it is still starting up (alive, no
/// socket yet, no exit record), up to `LAUNCH_TIMEOUT`.
async fn connect(dir: &Path, durable: Option<&Path>) -> Result<tokio::net::UnixStream, String> {
    let sock = supervisor::socket_path(dir);
    let deadline = tokio::time::Instant::now() + LAUNCH_TIMEOUT;
    // A supervisor listens a few milliseconds after its spawn: poll often at first, then
    // back off to CONNECT_POLL_MAX.
    let mut pause = Duration::from_millis(1);
    loop {
        let err = match tokio::net::UnixStream::connect(&sock).await {
            Ok(s) => return Ok(s),
            Err(e) => format!("connect {}: {e}", sock.display()),
        };
        if read_record(dir, durable).is_some() {
            return Err("the supervisor has exited".to_string());
        }
        if !supervisor_alive(dir) {
            return Err(format!("no supervisor ({err})"));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "the supervisor did not listen within {LAUNCH_TIMEOUT:?} ({err})"
            ));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(CONNECT_POLL_MAX);
    }
}

#[cfg(not(madsim))]
type Reader = tokio::net::unix::OwnedReadHalf;
#[cfg(not(madsim))]
type Writer = tokio::net::unix::OwnedWriteHalf;
// The madsim build (issue 16) compiles the shell engine but runs its simulated one.
#[cfg(madsim)]
type Reader = tokio::io::ReadHalf<tokio::net::UnixStream>;
#[cfg(madsim)]
type Writer = tokio::io::WriteHalf<tokio::net::UnixStream>;

/// Connects to the job's supervisor and greets it; its job's pid.
async fn attach(ctx: &Ctx) -> Result<(Reader, Writer, i32), String> {
    let stream = connect(&ctx.dir, ctx.durable.as_deref()).await?;
    let go = async {
        #[cfg(not(madsim))]
        let (mut reader, mut writer) = stream.into_split();
        #[cfg(madsim)]
        let (mut reader, mut writer) = tokio::io::split(stream);
        let hello = ToSupervisor::Hello {
            version: supervisor::PROTOCOL,
            epoch: ctx.settings.epoch.get(),
            lease: ctx.lease.get(),
        };
        write_frame(&mut writer, &hello).await?;
        match read_frame(&mut reader).await? {
            Some(FromSupervisor::Attached { pid }) => Ok((reader, writer, pid)),
            Some(FromSupervisor::Refused { reason }) => Err(format!("refused: {reason}")),
            Some(FromSupervisor::Exited) => Err("the job had ended".to_string()),
            Some(FromSupervisor::Output { .. }) => Err("output before attachment".to_string()),
            None => Err("closed before attaching".to_string()),
        }
    };
    match tokio::time::timeout(ATTACH_TIMEOUT, go).await {
        Ok(r) => r,
        Err(_) => Err("attaching timed out".to_string()),
    }
}

/// Relays output to the driver and stops to the supervisor until the job ends.
async fn relay(
    ctx: &mut Ctx,
    mut reader: Reader,
    writer: &mut Writer,
    stops: &mut mpsc::Receiver<Duration>,
) -> Ended {
    let lease = ctx.lease;
    let mut stops_open = true;
    let mut contact_open = true;
    // The current last contact first (if any), then each renewal.
    ctx.contact.mark_changed();
    loop {
        tokio::select! {
            changed = ctx.contact.changed(), if contact_open => match changed {
                Ok(()) => {
                    let (at_ms, grace_ms) = *ctx.contact.borrow_and_update();
                    if at_ms > 0 {
                        let contact = ToSupervisor::Contact { at_ms, grace_ms };
                        if let Err(e) = write_frame(writer, &contact).await {
                            tracing::debug!(%lease, error = %e, "could not pass the last contact to the job's supervisor");
                        }
                    }
                }
                Err(_) => contact_open = false,
            },
            frame = read_frame(&mut reader) => match frame {
                Ok(Some(FromSupervisor::Output { offset, bytes })) => {
                    ctx.report(ExecutorInput::JobLog { lease, offset, bytes }).await;
                }
                Ok(Some(FromSupervisor::Exited)) => return Ended::Exited,
                Ok(Some(other)) => return Ended::Closed(format!("unexpected {other:?}")),
                Ok(None) => return Ended::Closed("the supervisor closed the connection".into()),
                Err(e) => return Ended::Closed(e),
            },
            grace = stops.recv(), if stops_open => match grace {
                Some(grace) => {
                    let stop = ToSupervisor::Stop { grace_ms: millis(grace) };
                    if let Err(e) = write_frame(writer, &stop).await {
                        tracing::warn!(%lease, error = %e, "could not pass a stop to the job's supervisor");
                    }
                }
                None => stops_open = false,
            },
        }
    }
}

async fn write_frame(w: &mut Writer, msg: &ToSupervisor) -> Result<(), String> {
    let frame = supervisor::encode(msg)?;
    w.write_all(&frame).await.map_err(|e| e.to_string())
}

async fn read_frame(r: &mut Reader) -> Result<Option<FromSupervisor>, String> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > supervisor::MAX_FRAME {
        return Err(format!(
            "supervisor frame of {len} bytes exceeds the bound of {}",
            supervisor::MAX_FRAME
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| e.to_string())?;
    postcard::from_bytes(&body)
        .map(Some)
        .map_err(|e| format!("supervisor frame: {e}"))
}

/// The `JobExited` an exit record means.
fn exited(lease: LeaseId, rec: &ExitRecord, settings: &EngineSettings) -> ExecutorInput {
    let log = rec.log_sha256.as_ref().map(|h| LogRef {
        path: LogRef::path_for(lease),
        hash: format!("sha256:{h}"),
    });
    let (status, exit_code, error) = meaning(rec, settings);
    ExecutorInput::JobExited {
        lease,
        status,
        exit_code,
        error,
        log,
    }
}

fn meaning(
    rec: &ExitRecord,
    settings: &EngineSettings,
) -> (TerminalStatus, Option<i32>, Option<String>) {
    if let Some(e) = &rec.spawn_error {
        return (
            TerminalStatus::Failed,
            None,
            Some(format!("could not start the job: {e}")),
        );
    }
    match &rec.stopped {
        Some(StopCause::Requested) => {
            return (
                TerminalStatus::Cancelled,
                rec.code,
                Some("stopped".to_string()),
            );
        }
        Some(StopCause::HardCap { cap_ms }) => {
            let cap = settings.hard_cap.unwrap_or(Duration::from_millis(*cap_ms));
            return (
                TerminalStatus::Timeout,
                rec.code,
                Some(format!("exceeded the executor's hard cap of {cap:?}")),
            );
        }
        Some(StopCause::NoExecutor { grace_ms }) => {
            return (
                TerminalStatus::Failed,
                rec.code,
                Some(format!(
                    "stopped by its supervisor: no executor re-attached within {:?} (E14)",
                    Duration::from_millis(*grace_ms)
                )),
            );
        }
        Some(StopCause::ForeignEpoch { epoch }) => {
            return (
                TerminalStatus::Failed,
                rec.code,
                Some(format!(
                    "stopped by its supervisor: an executor of another epoch ({epoch}) took over its directory"
                )),
            );
        }
        None => {}
    }
    match (rec.code, rec.signal) {
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

/// Leftovers of executors from before supervisors (`work/<lease>.pgid`): killed at start.
mod legacy {
    use std::path::Path;

    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;

    const LEASE_ENV: &str = "MILLRACE_LEASE_ID";

    pub(super) fn reap_previous(data: &Path) {
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
                .and_then(|s| s.parse::<u64>().ok());
            let pgid = std::fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok());
            if let (Some(lease), Some(pgid)) = (lease, pgid) {
                kill_marked_group(pgid, lease);
            }
            let _ = std::fs::remove_file(&path);
            if let Some(lease) = lease {
                let _ = std::fs::remove_dir_all(work.join(lease.to_string()));
            }
        }
    }

    fn kill_marked_group(pgid: i32, lease: u64) {
        let marker = format!("{LEASE_ENV}={lease}");
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return;
        };
        for p in procs.flatten() {
            let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(p.path().join("stat")) else {
                continue;
            };
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
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// E14: the sweep of a wiped store removes a job directory only when no supervisor
    /// listens there. One that accepts and hangs up at once (as a real one does after
    /// refusing a foreign epoch) keeps its directory, where its exit record goes.
    #[test]
    fn e14_sweep_keeps_the_directory_of_a_supervisor_that_hangs_up() {
        let data = tempfile::tempdir().unwrap();
        let live = data.path().join("jobs").join("7");
        let dead = data.path().join("jobs").join("8");
        std::fs::create_dir_all(&live).unwrap();
        std::fs::create_dir_all(&dead).unwrap();
        let listener =
            std::os::unix::net::UnixListener::bind(supervisor::socket_path(&live)).unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            s.shutdown(std::net::Shutdown::Both).unwrap();
        });
        ShellEngine::sweep_foreign(
            data.path(),
            None,
            Epoch(9),
            &BTreeSet::new(),
            Duration::from_secs(1),
        );
        server.join().unwrap();
        assert!(live.exists(), "a live supervisor's directory stays");
        assert!(!dead.exists(), "a directory with no supervisor goes");
    }

    /// Issue 15, I1: `--runtime-dir` may change only while no supervisor of the previous
    /// process may run in the old place; the same directory spelt differently is no change.
    #[test]
    fn e14_runtime_dir_changes_only_with_no_supervisor_left_in_the_old_place() {
        let data = tempfile::tempdir().unwrap();
        let run = tempfile::tempdir().unwrap();
        let d = data.path();
        check_runtime_dir(d, None).unwrap();
        check_runtime_dir(d, Some(run.path())).unwrap();
        assert!(run.path().join("jobs").is_dir());
        let live = run.path().join("jobs").join("7");
        std::fs::create_dir_all(&live).unwrap();
        std::fs::write(live.join("supervisor.pid"), "1").unwrap();
        let slash = PathBuf::from(format!("{}/", run.path().display()));
        check_runtime_dir(d, Some(&slash)).expect("the same directory");
        let e = check_runtime_dir(d, None).unwrap_err();
        assert!(e.contains(&run.path().display().to_string()), "{e}");
        let other = tempfile::tempdir().unwrap();
        assert!(check_runtime_dir(d, Some(other.path())).is_err());
        // Once the old place holds no supervisor, the change goes through, both ways.
        std::fs::remove_file(live.join("supervisor.pid")).unwrap();
        check_runtime_dir(d, None).unwrap();
        let back = d.join("jobs").join("8");
        std::fs::create_dir_all(&back).unwrap();
        std::fs::write(back.join("supervisor.pid"), "1").unwrap();
        let e = check_runtime_dir(d, Some(run.path())).unwrap_err();
        assert!(e.contains("the data directory"), "{e}");
    }

    #[test]
    fn m25_log_hash_is_lowercase_sha256_hex() {
        let h = supervisor::hex(&Sha256::digest(b"hello\n"));
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

    fn settings() -> EngineSettings {
        EngineSettings {
            data: PathBuf::from("/nonexistent"),
            epoch: Epoch(1),
            reconnect_grace: Duration::from_secs(45),
            stop_grace: Duration::from_secs(10),
            hard_cap: None,
            run_as: None,
            runtime: None,
        }
    }

    fn record(code: Option<i32>, stopped: Option<StopCause>) -> ExitRecord {
        ExitRecord {
            code,
            signal: None,
            stopped,
            spawn_error: None,
            log_sha256: None,
        }
    }

    #[test]
    fn e9_an_exit_record_reports_the_jobs_real_status() {
        let s = settings();
        assert_eq!(
            meaning(&record(Some(0), None), &s).0,
            TerminalStatus::Success
        );
        let (status, code, error) = meaning(&record(Some(3), None), &s);
        assert_eq!((status, code), (TerminalStatus::Failed, Some(3)));
        assert_eq!(error.as_deref(), Some("exit status 3"));
    }

    #[test]
    fn e14_a_job_its_supervisor_stopped_for_want_of_an_executor_says_so() {
        let rec = record(None, Some(StopCause::NoExecutor { grace_ms: 45_000 }));
        let (status, _, error) = meaning(&rec, &settings());
        assert_eq!(status, TerminalStatus::Failed);
        assert!(error.unwrap().contains("no executor re-attached"));
    }
}
