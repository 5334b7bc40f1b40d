//! One mill and three executors wired directly through their public APIs, with a simulated
//! clock and no faults but the ones a test injects (issue 3, item 4). The driver here is a
//! miniature of the real ones: it routes outputs, applies every `Persist` to an in-memory
//! store before acting on what follows, plays the engine, and ticks at deadlines.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use millrace_core::executor::{
    EngineConfig, Executor, ExecutorConfig, ExecutorInput, ExecutorOutput, ExecutorSnapshot,
};
use millrace_core::job::{Identity, JobSpec, JobState, LogRef, TerminalStatus};
use millrace_core::mill::{Mill, MillConfig, MillInput, MillOutput, MillSnapshot};
use millrace_core::quota::{QuotaConfig, Scope};
use millrace_core::types::{ConnId, Epoch, JobId, LeaseId, NodeId, Resources, Time};
use millrace_core::wire::{ToExecutor, ToMill};

const TOKEN: &str = "in-memory-token";
const MS: u64 = 1_000;

/// A message in flight on one connection, delivered in order.
#[derive(Debug)]
enum Wire {
    ToMill(ConnId, ToMill),
    ToExec(usize, ConnId, ToExecutor),
    MillClosed(ConnId),
    ExecClosed(usize, ConnId),
}

/// What the simulated engine will do with a job: run for `ms`, then exit with `code`.
/// Encoded in the payload as `ms:code`.
fn payload(ms: u64, code: i32) -> Vec<u8> {
    format!("{ms}:{code}").into_bytes()
}

fn parse_payload(p: &[u8]) -> (u64, i32) {
    let s = String::from_utf8_lossy(p);
    let mut it = s.split(':');
    let ms = it.next().and_then(|x| x.parse().ok()).unwrap_or(10);
    let code = it.next().and_then(|x| x.parse().ok()).unwrap_or(0);
    (ms, code)
}

fn exited(lease: LeaseId, code: i32) -> ExecutorInput {
    let status = if code == 0 {
        TerminalStatus::Success
    } else {
        TerminalStatus::Failed
    };
    let log = LogRef {
        path: LogRef::path_for(lease),
        hash: format!("sha256:{}", "ab".repeat(32)),
    };
    ExecutorInput::JobExited {
        lease,
        status,
        exit_code: Some(code),
        error: None,
        log: Some(log),
    }
}

struct Node {
    exec: Option<Executor>,
    config: ExecutorConfig,
    store: ExecutorSnapshot,
    conn: Option<ConnId>,
    /// Engine timers: (due, lease, exit). Jobs run under supervisors that outlive the
    /// executor process (E14): a crash leaves them running.
    running: BTreeMap<LeaseId, (Time, i32)>,
    /// Exit codes its supervisors recorded while the executor process was down.
    ended: BTreeMap<LeaseId, i32>,
}

struct World {
    now: Time,
    mill: Mill,
    mill_store: MillSnapshot,
    nodes: Vec<Node>,
    wire: VecDeque<Wire>,
    next_conn: u64,
    /// Every terminal recorded, by job; a second one for a job fails the test (I2).
    done: BTreeMap<JobId, millrace_core::job::Terminal>,
    /// A trace of every output, for determinism checks.
    trace: Vec<String>,
    /// Drop messages to the mill from this node (a crash before the mill heard it).
    mute: BTreeSet<usize>,
}

fn mill_config() -> MillConfig {
    MillConfig {
        executor_token: Some(TOKEN.into()),
        quota: QuotaConfig {
            owner_defaults: [("jobs".to_string(), 6)].into_iter().collect(),
            ..QuotaConfig::default()
        },
        ..MillConfig::default()
    }
}

fn exec_config(i: usize) -> ExecutorConfig {
    let node = NodeId::new(format!("exec-{i}")).unwrap();
    let mut c = ExecutorConfig::new(node, TOKEN);
    c.backoff_seed = i as u64;
    c.engines = BTreeMap::from([("shell".to_string(), EngineConfig::seats(3))]);
    match i {
        0 => {
            c.labels = ["linux".to_string()].into_iter().collect();
        }
        1 => {
            c.labels = ["linux".to_string(), "gpu".to_string()]
                .into_iter()
                .collect();
            c.engines
                .insert("docker".to_string(), EngineConfig::seats(2));
        }
        _ => {
            c.labels = ["macos".to_string()].into_iter().collect();
            c.engines
                .insert("docker".to_string(), EngineConfig::seats(1));
        }
    }
    c
}

impl World {
    fn new() -> Self {
        let now = Time::from_micros(1_000_000);
        let mill = Mill::new(mill_config(), None, now).unwrap();
        let nodes = (0..3)
            .map(|i| {
                let config = exec_config(i);
                let store = ExecutorSnapshot::fresh(Epoch(100 + i as u64));
                Node {
                    exec: Some(Executor::new(config.clone(), store.clone(), now)),
                    config,
                    store,
                    conn: None,
                    running: BTreeMap::new(),
                    ended: BTreeMap::new(),
                }
            })
            .collect();
        let mut w = World {
            now,
            mill,
            mill_store: MillSnapshot::default(),
            nodes,
            wire: VecDeque::new(),
            next_conn: 1,
            done: BTreeMap::new(),
            trace: Vec::new(),
            mute: BTreeSet::new(),
        };
        w.drain();
        w
    }

    fn submit(&mut self, spec: JobSpec) -> JobId {
        let r = self.mill.submit(self.now, spec, 0);
        let Ok(job) = r else {
            panic!("submit refused: {r:?}");
        };
        self.drain();
        job
    }

    fn cancel(&mut self, job: JobId) {
        self.mill
            .cancel(self.now, job, "user cancel".into())
            .unwrap();
        self.drain();
    }

    /// Drains every state machine's outputs until all are quiet.
    fn drain(&mut self) {
        loop {
            let mut any = false;
            while let Some(o) = self.mill.poll_output() {
                any = true;
                self.trace.push(format!("{} mill {o:?}", self.now));
                self.mill_output(o);
            }
            for i in 0..self.nodes.len() {
                while let Some(o) = self.nodes[i].exec.as_mut().and_then(|e| e.poll_output()) {
                    any = true;
                    self.trace.push(format!("{} exec-{i} {o:?}", self.now));
                    self.exec_output(i, o);
                }
            }
            if !any {
                break;
            }
        }
    }

    fn mill_output(&mut self, o: MillOutput) {
        match o {
            MillOutput::Persist(batch) => self.mill_store.apply(&batch),
            MillOutput::Send { conn, msg } => {
                if let Some(i) = self.node_of(conn) {
                    self.wire.push_back(Wire::ToExec(i, conn, msg));
                }
            }
            MillOutput::Close { conn, .. } => {
                if let Some(i) = self.node_of(conn) {
                    self.wire.push_back(Wire::ExecClosed(i, conn));
                }
                self.wire.push_back(Wire::MillClosed(conn));
            }
            MillOutput::JobUpdate { job, state } => {
                if let JobState::Done(t) = state {
                    assert!(
                        self.done.insert(job, t).is_none(),
                        "I2: a second terminal for {job}"
                    );
                }
            }
            MillOutput::LiveLog { .. } | MillOutput::Observed(_) => {}
        }
    }

    fn node_of(&self, conn: ConnId) -> Option<usize> {
        self.nodes.iter().position(|n| n.conn == Some(conn))
    }

    fn exec_output(&mut self, i: usize, o: ExecutorOutput) {
        match o {
            ExecutorOutput::Connect { .. } => {
                let conn = ConnId(self.next_conn);
                self.next_conn += 1;
                self.nodes[i].conn = Some(conn);
                self.mill.handle(self.now, MillInput::Connected { conn });
                self.exec_input(i, ExecutorInput::Connected { conn });
            }
            ExecutorOutput::Send { conn, msg } => {
                if !self.mute.contains(&i) {
                    self.wire.push_back(Wire::ToMill(conn, msg));
                }
            }
            ExecutorOutput::Close { conn, .. } => {
                self.wire.push_back(Wire::MillClosed(conn));
                self.wire.push_back(Wire::ExecClosed(i, conn));
            }
            ExecutorOutput::Persist(batch) => self.nodes[i].store.apply(&batch),
            ExecutorOutput::StartJob { lease, spec, .. } => {
                let (ms, code) = parse_payload(&spec.payload);
                self.nodes[i]
                    .running
                    .insert(lease, (self.now.plus(Duration::from_micros(ms * MS)), code));
                self.exec_input(i, ExecutorInput::JobStarted { lease });
            }
            ExecutorOutput::AdoptJob { lease, .. } => {
                // The supervisor answers: still running, ended while the executor was down
                // (its recorded status), or gone.
                let input = if self.nodes[i].running.contains_key(&lease) {
                    ExecutorInput::JobStarted { lease }
                } else if let Some(code) = self.nodes[i].ended.remove(&lease) {
                    exited(lease, code)
                } else {
                    ExecutorInput::JobLost { lease }
                };
                self.exec_input(i, input);
            }
            ExecutorOutput::StopJob { lease, .. } => {
                if self.nodes[i].running.remove(&lease).is_some() {
                    self.exec_input(
                        i,
                        ExecutorInput::JobExited {
                            lease,
                            status: TerminalStatus::Cancelled,
                            exit_code: Some(143),
                            error: Some("stopped".into()),
                            log: None,
                        },
                    );
                }
            }
        }
    }

    fn exec_input(&mut self, i: usize, input: ExecutorInput) {
        if let Some(exec) = self.nodes[i].exec.as_mut() {
            exec.handle(self.now, input);
        }
    }

    /// Delivers one message, or moves time to the next deadline. False when nothing is left
    /// before `until`.
    fn step(&mut self, until: Time) -> bool {
        self.drain();
        if let Some(w) = self.wire.pop_front() {
            match w {
                Wire::ToMill(conn, msg) => {
                    self.mill.handle(self.now, MillInput::Message { conn, msg });
                }
                Wire::ToExec(i, conn, msg) => {
                    if self.nodes[i].conn == Some(conn) {
                        self.exec_input(i, ExecutorInput::Message { conn, msg });
                    }
                }
                Wire::MillClosed(conn) => {
                    self.mill.handle(self.now, MillInput::Disconnected { conn });
                }
                Wire::ExecClosed(i, conn) => {
                    if self.nodes[i].conn == Some(conn) {
                        self.nodes[i].conn = None;
                        self.exec_input(i, ExecutorInput::Disconnected { conn });
                    }
                }
            }
            self.drain();
            return true;
        }
        // Quiet: jump to the earliest deadline.
        let mut next = self.mill.next_deadline();
        for n in &self.nodes {
            let d = n.exec.as_ref().and_then(|e| e.next_deadline());
            let e = n.running.values().map(|(t, _)| *t).min();
            for t in [d, e].into_iter().flatten() {
                next = Some(next.map_or(t, |x: Time| x.min(t)));
            }
        }
        let Some(t) = next else {
            return false;
        };
        if t > until {
            return false;
        }
        self.now = self.now.max(t);
        // Engines finish first, then every machine ticks.
        for i in 0..self.nodes.len() {
            let due: Vec<(LeaseId, i32)> = self.nodes[i]
                .running
                .iter()
                .filter(|(_, (at, _))| *at <= self.now)
                .map(|(l, (_, c))| (*l, *c))
                .collect();
            for (lease, code) in due {
                self.nodes[i].running.remove(&lease);
                if self.nodes[i].exec.is_none() {
                    // Its supervisor keeps the status for the next executor process.
                    self.nodes[i].ended.insert(lease, code);
                } else {
                    self.exec_input(i, exited(lease, code));
                }
            }
        }
        self.mill.handle(self.now, MillInput::Tick);
        for i in 0..self.nodes.len() {
            self.exec_input(i, ExecutorInput::Tick);
        }
        true
    }

    fn run_for(&mut self, d: Duration) {
        let until = self.now.plus(d);
        while self.step(until) {}
        self.now = self.now.max(until);
    }

    /// Runs until every given job has a terminal, or `limit` passes.
    fn run_until_done(&mut self, jobs: &[JobId], limit: Duration) {
        let until = self.now.plus(limit);
        while !jobs.iter().all(|j| self.done.contains_key(j)) {
            if !self.step(until) {
                break;
            }
        }
    }

    /// The process dies: volatile state and in-flight messages are lost; the store stays,
    /// and so do the jobs' supervisors (E14).
    fn crash(&mut self, i: usize) {
        self.crash_with(i, true);
    }

    /// The process dies, and its jobs' supervisors with it when `supervisors` is false
    /// (the machine rebooted, say).
    fn crash_with(&mut self, i: usize, supervisors: bool) {
        self.nodes[i].exec = None;
        if !supervisors {
            self.nodes[i].running.clear();
            self.nodes[i].ended.clear();
        }
        if let Some(conn) = self.nodes[i].conn.take() {
            self.wire.retain(|w| match w {
                Wire::ToMill(c, _) | Wire::MillClosed(c) => *c != conn,
                Wire::ToExec(n, _, _) | Wire::ExecClosed(n, _) => *n != i,
            });
            self.wire.push_back(Wire::MillClosed(conn));
        }
    }

    fn restart(&mut self, i: usize, wipe: Option<Epoch>) {
        if let Some(epoch) = wipe {
            self.nodes[i].store = ExecutorSnapshot::fresh(epoch);
            // No executor of the old epoch re-attaches: its supervisors stop their jobs.
            self.nodes[i].running.clear();
            self.nodes[i].ended.clear();
        }
        let n = &mut self.nodes[i];
        n.exec = Some(Executor::new(n.config.clone(), n.store.clone(), self.now));
        self.drain();
    }

    fn assert_quiescent(&self) {
        assert_eq!(self.mill.leases().count(), 0, "no lease left");
        assert_eq!(self.mill.pending(), 0, "nothing waits");
        for scope in ["acme", "globex"] {
            assert!(
                self.mill
                    .quota()
                    .usage(&Scope::Owner(scope.into()))
                    .values()
                    .all(|v| *v == 0),
                "quota usage back to zero for {scope}"
            );
        }
        assert_eq!(self.mill.quota().holds().count(), 0);
        for (i, n) in self.nodes.iter().enumerate() {
            let e = n.exec.as_ref().unwrap();
            assert_eq!(e.reserved_leases().count(), 0, "exec-{i} holds no seat");
            assert_eq!(e.running_leases().count(), 0, "exec-{i} runs nothing");
        }
        assert!(self.mill_store.leases.is_empty());
        assert!(self.mill_store.jobs.is_empty());
    }
}

fn spec(engine: &str, labels: &[&str], owner: &str, ms: u64, code: i32) -> JobSpec {
    JobSpec {
        retry: Default::default(),
        priority: 0,
        node: None,
        engine: engine.into(),
        labels: labels.iter().map(|s| s.to_string()).collect(),
        resources: Resources::new(),
        identity: Identity {
            owner: owner.into(),
            repo: format!("{owner}/repo"),
        },
        timeout: None,
        payload: payload(ms, code),
        env: Default::default(),
    }
}

/// A tiny deterministic generator for the seeded job mix.
struct SplitMix(u64);
impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Submits 100 jobs from `seed`: shell or docker, with labels some executors lack, two
/// owners with a quota of 6 concurrent jobs each, durations 10 ms..2 s, one in five failing.
fn job_mix(w: &mut World, seed: u64) -> Vec<(JobId, i32, JobSpec)> {
    let mut rng = SplitMix(seed);
    let mut jobs = Vec::new();
    for _ in 0..100 {
        let engine = if rng.next() % 4 == 0 {
            "docker"
        } else {
            "shell"
        };
        let labels: &[&str] = match (engine, rng.next() % 3) {
            ("docker", 0) => &["gpu"],
            ("docker", _) => &[],
            (_, 0) => &["linux"],
            (_, 1) => &["macos"],
            _ => &[],
        };
        let owner = if rng.next() % 2 == 0 {
            "acme"
        } else {
            "globex"
        };
        let ms = 10 + rng.next() % 2000;
        let code = if rng.next() % 5 == 0 { 1 } else { 0 };
        let s = spec(engine, labels, owner, ms, code);
        let job = w.submit(s.clone());
        jobs.push((job, code, s));
        w.run_for(Duration::from_millis(rng.next() % 50));
    }
    jobs
}

#[test]
fn hundred_mixed_jobs_all_reach_the_engines_terminal_status() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    let jobs = job_mix(&mut w, 7);
    let ids: Vec<JobId> = jobs.iter().map(|(j, _, _)| *j).collect();
    w.run_until_done(&ids, Duration::from_secs(600));
    for (job, code, s) in &jobs {
        let t = w
            .done
            .get(job)
            .unwrap_or_else(|| panic!("{job} never ended"));
        let want = if *code == 0 {
            TerminalStatus::Success
        } else {
            TerminalStatus::Failed
        };
        assert_eq!(t.status, want, "{job}: {t:?}");
        assert_eq!(t.exit_code, Some(*code));
        assert!(t.log.is_some(), "{job}: the engine's log ref is recorded");
        // I7: it ran on an executor with its engine and labels.
        let node = t.node.clone().unwrap();
        let i: usize = node.as_str().trim_start_matches("exec-").parse().unwrap();
        let c = exec_config(i);
        assert!(
            c.engines.contains_key(&s.engine),
            "{job} ran on {node} without {}",
            s.engine
        );
        assert!(
            s.labels.is_subset(&c.labels),
            "{job} ran on {node} without its labels"
        );
    }
    // Let acks flow and snapshots settle.
    w.run_for(Duration::from_secs(10));
    w.assert_quiescent();
}

#[test]
fn jobs_run_only_where_their_engine_and_labels_are() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    let gpu = w.submit(spec("docker", &["gpu"], "acme", 100, 0));
    let mac = w.submit(spec("shell", &["macos"], "acme", 100, 0));
    let linux = w.submit(spec("shell", &["linux"], "acme", 100, 0));
    w.run_until_done(&[gpu, mac, linux], Duration::from_secs(60));
    let node = |j: JobId| w.done[&j].node.clone().unwrap().to_string();
    assert_eq!(node(gpu), "exec-1");
    assert_eq!(node(mac), "exec-2");
    assert!(["exec-0", "exec-1"].contains(&node(linux).as_str()));
}

#[test]
fn cancel_of_a_running_job_ends_cancelled() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    let job = w.submit(spec("shell", &[], "acme", 60_000, 0));
    w.run_for(Duration::from_secs(2));
    assert!(matches!(
        w.mill.job_state(job),
        Some(JobState::Running { .. })
    ));
    w.cancel(job);
    w.run_until_done(&[job], Duration::from_secs(30));
    assert_eq!(w.done[&job].status, TerminalStatus::Cancelled);
    w.run_for(Duration::from_secs(10));
    w.assert_quiescent();
}

#[test]
fn e9_i3_an_executor_restart_with_its_store_delivers_a_result_that_finished_before_the_crash() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    // Only exec-2 offers macOS.
    let job = w.submit(spec("shell", &["macos"], "acme", 3_000, 0));
    w.run_for(Duration::from_secs(2));
    assert!(matches!(
        w.mill.job_state(job),
        Some(JobState::Running { .. })
    ));
    // The job finishes, but the mill never hears of it: the terminal sits in the outbox.
    w.mute.insert(2);
    w.run_for(Duration::from_secs(2));
    assert!(!w.done.contains_key(&job));
    assert!(
        w.nodes[2]
            .store
            .outbox
            .iter()
            .any(|e| matches!(e.kind, millrace_core::wire::EventKind::Terminal { .. })),
        "the terminal waits in the durable outbox"
    );
    w.crash(2);
    w.mute.remove(&2);
    w.run_for(Duration::from_secs(5));
    w.restart(2, None);
    w.run_until_done(&[job], Duration::from_secs(40));
    let t = &w.done[&job];
    assert_eq!(t.status, TerminalStatus::Success, "{t:?}");
    assert_eq!(
        t.exit_code,
        Some(0),
        "the engine's result, not 'executor lost'"
    );
    w.run_for(Duration::from_secs(10));
    w.assert_quiescent();
}

#[test]
fn e9_a_job_whose_supervisor_died_with_the_executor_ends_failed_executor_restarted() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    let job = w.submit(spec("shell", &["macos"], "acme", 60_000, 0));
    w.run_for(Duration::from_secs(2));
    w.crash_with(2, false);
    w.run_for(Duration::from_secs(3));
    w.restart(2, None);
    w.run_until_done(&[job], Duration::from_secs(40));
    let t = &w.done[&job];
    assert_eq!(t.status, TerminalStatus::Failed);
    assert_eq!(t.error.as_deref(), Some("executor restarted"), "{t:?}");
    assert_eq!(
        t.cause,
        Some(millrace_core::TerminalCause::ExecutorRestarted),
        "{t:?}"
    );
}

#[test]
fn e9_e14_a_job_running_when_the_executor_died_is_adopted_and_recorded_with_its_real_status() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    let job = w.submit(spec("shell", &["macos"], "acme", 8_000, 7));
    w.run_for(Duration::from_secs(2));
    w.crash(2);
    w.run_for(Duration::from_secs(2));
    w.restart(2, None);
    w.run_until_done(&[job], Duration::from_secs(40));
    let t = &w.done[&job];
    assert_eq!(t.status, TerminalStatus::Failed, "{t:?}");
    assert_eq!(
        t.exit_code,
        Some(7),
        "the job's own exit, not 'executor restarted'"
    );
    w.run_for(Duration::from_secs(10));
    w.assert_quiescent();
}

#[test]
fn e9_e14_a_job_that_ended_while_the_executor_was_down_is_recorded_success() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    let job = w.submit(spec("shell", &["macos"], "acme", 3_000, 0));
    w.run_for(Duration::from_secs(2));
    w.crash(2);
    // The job ends while nobody is attached; its supervisor keeps the status.
    w.run_for(Duration::from_secs(6));
    assert!(!w.done.contains_key(&job));
    w.restart(2, None);
    w.run_until_done(&[job], Duration::from_secs(40));
    let t = &w.done[&job];
    assert_eq!(t.status, TerminalStatus::Success, "{t:?}");
    assert_eq!(t.exit_code, Some(0));
    w.run_for(Duration::from_secs(10));
    w.assert_quiescent();
}

#[test]
fn e1_m5_a_wiped_executor_comes_back_with_a_new_epoch_and_its_old_jobs_end_executor_lost() {
    let mut w = World::new();
    w.run_for(Duration::from_secs(1));
    let job = w.submit(spec("shell", &["macos"], "acme", 600_000, 0));
    w.run_for(Duration::from_secs(2));
    w.crash(2);
    w.run_for(Duration::from_secs(3));
    w.restart(2, Some(Epoch(999)));
    w.run_for(Duration::from_secs(10));
    assert!(
        !w.done.contains_key(&job),
        "not before grace: the old process may live"
    );
    // The wiped node is back and takes new work meanwhile.
    let fresh = w.submit(spec("shell", &["macos"], "acme", 100, 0));
    w.run_until_done(&[job, fresh], Duration::from_secs(60));
    let t = &w.done[&job];
    assert_eq!(t.status, TerminalStatus::Failed);
    assert!(
        t.error.as_deref().unwrap().starts_with("executor lost"),
        "{t:?}"
    );
    assert_eq!(w.done[&fresh].status, TerminalStatus::Success);
}

#[test]
fn the_seeded_run_gives_the_same_outputs_twice() {
    let run = |seed| {
        let mut w = World::new();
        w.run_for(Duration::from_secs(1));
        let jobs = job_mix(&mut w, seed);
        let ids: Vec<JobId> = jobs.iter().map(|(j, _, _)| *j).collect();
        w.run_until_done(&ids, Duration::from_secs(600));
        assert_eq!(w.done.len(), 100);
        w.trace
    };
    let a = run(42);
    let b = run(42);
    assert!(a.len() > 1000, "{} outputs", a.len());
    assert!(a == b, "same seed, different trace");
    let c = run(43);
    assert!(a != c, "a different seed gives a different mix");
}
