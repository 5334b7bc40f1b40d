//! The simulated engine of the madsim build (issue 16): the shell engine's interface, with
//! jobs that take simulated time and end with an exit code instead of processes.
//!
//! A payload reads `sim <millis> <exit code>` (`sim 250 0`). What the shell engine keeps in
//! supervisor processes, which outlive the executor (E14), lives here in a per-machine table
//! outside every simulated node ([`MACHINES`], keyed by the executor's data directory): a
//! killed executor node loses its driver and attachments, never its running jobs, and its
//! next process adopts them (E9) or finds their ends, as with real supervisors. A wiped
//! store's sweep stops what the table holds for it.
//!
//! Every engine start is recorded there too ([`runs`]), with how and when it ended: the
//! suite's I1 check counts starts per job across the fleet, as the real-process tests count
//! per-execution markers, and its I11 check times the stops of cancelled jobs.
//!
//! Not modelled (say so rather than pretend): a supervisor stopping its job when no executor
//! re-attaches within `reconnect_grace` (E14), job output (`JobLog`), `--run-as`, the hard
//! cap.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use millrace_core::executor::ExecutorInput;
use millrace_core::job::{JobSpec, TerminalStatus};
use millrace_core::{Epoch, JobId, LeaseId};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::exec_driver::ExecCmd;
use crate::shell::EngineSettings;

/// One engine start, for I1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// The job.
    pub job: JobId,
    /// The lease it ran under.
    pub lease: LeaseId,
    /// The executor's data directory.
    pub machine: PathBuf,
    /// How the engine ended it, once it did.
    pub ended: Option<TerminalStatus>,
    /// When (simulated), for I11's bound.
    pub ended_at: Option<Instant>,
}

#[derive(Debug, Clone)]
struct SimJob {
    ends_at: Instant,
    code: i32,
    /// Set once it ended: (status, exit code, why).
    ended: Option<(TerminalStatus, Option<i32>, Option<String>)>,
}

#[derive(Debug, Default)]
struct Machine {
    jobs: BTreeMap<LeaseId, SimJob>,
}

/// Every simulated machine's "supervisors", by data directory; and every start.
static MACHINES: Mutex<BTreeMap<PathBuf, Machine>> = Mutex::new(BTreeMap::new());
static RUNS: Mutex<Vec<Run>> = Mutex::new(Vec::new());

fn machines() -> std::sync::MutexGuard<'static, BTreeMap<PathBuf, Machine>> {
    MACHINES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every engine start on machines under `root` (one simulated run's directory), in order.
pub fn runs(root: &Path) -> Vec<Run> {
    RUNS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|r| r.machine.starts_with(root))
        .cloned()
        .collect()
}

/// Forgets every start under `root` (a run begins afresh, e.g. madsim's determinism check
/// running one seed twice).
pub fn reset(root: &Path) {
    RUNS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|r| !r.machine.starts_with(root));
    machines().retain(|m, _| !m.starts_with(root));
}

/// The machine's table is gone with its disk (a wiped executor): its jobs stop.
pub fn wipe(data: &Path) {
    machines().remove(data);
}

/// Parses `sim <millis> <code>`.
fn parse(payload: &[u8]) -> Result<(Duration, i32), String> {
    let text = std::str::from_utf8(payload).map_err(|_| "payload is not UTF-8".to_string())?;
    let mut words = text.split_whitespace();
    match (words.next(), words.next(), words.next(), words.next()) {
        (Some("sim"), Some(ms), Some(code), None) => {
            let ms = ms
                .parse::<u64>()
                .map_err(|_| format!("bad millis {ms:?}"))?;
            let code = code
                .parse::<i32>()
                .map_err(|_| format!("bad code {code:?}"))?;
            Ok((Duration::from_millis(ms), code))
        }
        _ => Err(format!("not `sim <millis> <code>`: {text:?}")),
    }
}

/// Runs simulated jobs for one executor. Owned by the executor driver.
pub struct SimEngine {
    data: PathBuf,
    tx: mpsc::Sender<ExecCmd>,
    running: BTreeMap<LeaseId, mpsc::Sender<()>>,
}

impl SimEngine {
    /// The shell engine's constructor, for the same call site.
    pub fn new(
        settings: EngineSettings,
        tx: mpsc::Sender<ExecCmd>,
        _runtime: tokio::runtime::Handle,
    ) -> std::io::Result<Self> {
        machines().entry(settings.data.clone()).or_default();
        Ok(SimEngine {
            data: settings.data,
            tx,
            running: BTreeMap::new(),
        })
    }

    /// Starts a committed job (`StartJob`).
    pub fn start(
        &mut self,
        lease: LeaseId,
        job: JobId,
        spec: JobSpec,
        _secrets: BTreeMap<String, String>,
    ) {
        let (duration, code, ended) = match parse(&spec.payload) {
            Ok((d, c)) => (d, c, None),
            Err(e) => (
                Duration::ZERO,
                0,
                Some((
                    TerminalStatus::Failed,
                    None,
                    Some(format!("could not start the job: {e}")),
                )),
            ),
        };
        RUNS.lock().unwrap_or_else(|e| e.into_inner()).push(Run {
            job,
            lease,
            machine: self.data.clone(),
            ended: ended.as_ref().map(|e| e.0),
            ended_at: ended.as_ref().map(|_| Instant::now()),
        });
        machines()
            .entry(self.data.clone())
            .or_default()
            .jobs
            .insert(
                lease,
                SimJob {
                    ends_at: Instant::now() + duration,
                    code,
                    ended,
                },
            );
        self.attend(lease, false);
    }

    /// Re-attaches to a job of a previous process (`AdoptJob`, E9).
    pub fn adopt(&mut self, lease: LeaseId) {
        self.attend(lease, true);
    }

    fn attend(&mut self, lease: LeaseId, adopting: bool) {
        let (stop_tx, mut stop_rx) = mpsc::channel(4);
        self.running.insert(lease, stop_tx);
        let (data, tx) = (self.data.clone(), self.tx.clone());
        tokio::spawn(async move {
            let found = machines()
                .get(&data)
                .and_then(|m| m.jobs.get(&lease).cloned());
            let Some(job) = found else {
                let input = if adopting {
                    ExecutorInput::JobLost { lease }
                } else {
                    ExecutorInput::JobExited {
                        lease,
                        status: TerminalStatus::Failed,
                        exit_code: None,
                        error: Some("the job's supervisor is gone".into()),
                        log: None,
                    }
                };
                let _ = tx.send(ExecCmd::Input(input)).await;
                return;
            };
            let ended = match job.ended {
                Some(e) => e,
                None => {
                    let _ = tx
                        .send(ExecCmd::Input(ExecutorInput::JobStarted { lease }))
                        .await;
                    let e = tokio::select! {
                        biased;
                        () = tokio::time::sleep_until(job.ends_at) => {
                            let status = if job.code == 0 {
                                TerminalStatus::Success
                            } else {
                                TerminalStatus::Failed
                            };
                            (status, Some(job.code), None)
                        }
                        Some(()) = stop_rx.recv() => {
                            (TerminalStatus::Cancelled, None, Some("stopped".to_string()))
                        }
                    };
                    // The "supervisor" records the end before it is reported.
                    if let Some(j) = machines()
                        .get_mut(&data)
                        .and_then(|m| m.jobs.get_mut(&lease))
                    {
                        j.ended = Some(e.clone());
                    }
                    if let Some(r) = RUNS
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .iter_mut()
                        .find(|r| r.lease == lease && r.machine == data)
                    {
                        r.ended = Some(e.0);
                        r.ended_at = Some(Instant::now());
                    }
                    e
                }
            };
            let (status, exit_code, error) = ended;
            let input = ExecutorInput::JobExited {
                lease,
                status,
                exit_code,
                error,
                log: None,
            };
            let _ = tx.send(ExecCmd::Input(input)).await;
        });
    }

    /// Stops a job (`StopJob`).
    pub fn stop(&mut self, lease: LeaseId, _grace: Duration) {
        if let Some(stop) = self.running.get(&lease) {
            let _ = stop.try_send(());
        }
    }

    /// The last contact with the mill (E12): supervisors are not modelled past it.
    pub fn contact(&mut self, _at_ms: u64) {}

    /// A mill's timers (M1, E12).
    pub fn timers(&mut self, _reconnect_grace: Duration) {}

    /// The driver saw the job's end.
    pub fn exited(&mut self, lease: LeaseId) {
        self.running.remove(&lease);
    }

    /// The job's terminal is durable in the outbox: its "supervisor" goes.
    pub fn collected(&mut self, lease: LeaseId) {
        if let Some(m) = machines().get_mut(&self.data) {
            m.jobs.remove(&lease);
        }
    }

    /// At shutdown: running jobs are left to their "supervisors".
    pub fn detach_all(&mut self) {
        self.running.clear();
    }

    /// At start: "supervisors" whose lease the store does not hold stop (a wiped store).
    pub fn sweep_foreign(
        data: &Path,
        _runtime: Option<&Path>,
        _epoch: Epoch,
        known: &BTreeSet<LeaseId>,
        _stop_grace: Duration,
    ) {
        if let Some(m) = machines().get_mut(data) {
            m.jobs.retain(|lease, _| known.contains(lease));
        }
    }
}
