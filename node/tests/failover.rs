//! Failover between two mills on one PostgreSQL store, with real processes (issue 14 item 6;
//! DESIGN §10, I1, I2, I13, E13, M29, M31).
//!
//! A throwaway PostgreSQL server (`common::pg`), two `millrace mill` processes on it with
//! fixed ports and shared credentials, and two executors whose `--mill` lists both. A
//! submitter thread sends shell jobs with an `Idempotency-Key` per job and retries each on
//! whichever mill answers until one acknowledges it (201, or 200 `existing`), so an
//! acknowledged submit is one job however many mills saw it. Every job appends a marker
//! line per execution (`common::marker_cmd`), so executions are counted from what really
//! ran. Three faults:
//! - the leader is killed with SIGKILL under load: the standby leads, every acknowledged job
//!   ends, each ran once;
//! - the leader is stopped (SIGSTOP) past its lease and resumed (SIGCONT): it exits with code
//!   3 ("stepped down"), the new leader's jobs run once, none of the old leader's commands
//!   acted on;
//! - PostgreSQL itself restarts under load: no acknowledged submit is lost.
//!
//! Nothing asserts speed; waits poll with generous bounds. The failover times are printed
//! (`--nocapture`) for BENCHMARKS.md; `FAILOVER_DEFAULT_TIMERS=1` runs the kill test with
//! the default `--leader-lease` and session timers.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pg::TestPg;
use common::{read_markers, strings, timing, wait_for, Api, Markers, Proc, Rng};
use serde_json::{json, Value};

const API_TOKEN: &str = "failover-api-token-0123456789abcdef";
const EXEC_TOKEN: &str = "failover-executor-token-0123456789ab";

fn write_secret(path: &Path, value: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, value).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Timers: short ones by default; the defaults with `FAILOVER_DEFAULT_TIMERS=1`.
#[derive(Clone, Copy)]
struct Timers {
    short: bool,
}

impl Timers {
    fn mill_flags(self) -> Vec<String> {
        let mut f = strings(&["--bid-timeout", "1s"]);
        if self.short {
            f.extend(strings(&["--leader-lease", "3s"]));
            f.extend(timing("8s", "2s"));
        }
        f
    }

    fn exec_flags(self) -> Vec<String> {
        if self.short {
            timing("8s", "2s")
        } else {
            Vec::new()
        }
    }
}

/// One mill's fixed place: its ports and data directory.
struct Slot {
    executor: String,
    http: String,
    data: PathBuf,
}

/// PostgreSQL, two mill slots, the executors, and the processes running in them.
struct Cluster {
    root: PathBuf,
    pg: TestPg,
    url: String,
    slots: [Slot; 2],
    mills: [Option<Proc>; 2],
    starts: usize,
    executors: Vec<Proc>,
    timers: Timers,
    markers: PathBuf,
}

impl Cluster {
    fn new(test: &str, root: &Path, timers: Timers) -> Option<Cluster> {
        let pg = TestPg::start(test)?;
        let url = pg.create_db("millrace");
        write_secret(&root.join("api-token"), API_TOKEN);
        write_secret(&root.join("token"), EXEC_TOKEN);
        let slot = |n: usize| Slot {
            executor: format!("127.0.0.1:{}", common::pg::free_port()),
            http: format!("127.0.0.1:{}", common::pg::free_port()),
            data: root.join(format!("mill{n}")),
        };
        let markers = root.join("markers");
        std::fs::create_dir_all(&markers).unwrap();
        Some(Cluster {
            root: root.to_path_buf(),
            pg,
            url,
            slots: [slot(0), slot(1)],
            mills: [None, None],
            starts: 0,
            executors: Vec::new(),
            timers,
            markers,
        })
    }

    /// Starts the mill of slot `n`; it leads or stands by, as the store decides.
    fn start_mill(&mut self, n: usize) {
        let s = &self.slots[n];
        let mut args = strings(&[
            "mill",
            "--data",
            s.data.to_str().unwrap(),
            "--store",
            &self.url,
            "--executor-listen",
            &s.executor,
            "--http-listen",
            &s.http,
            "--token-file",
            self.root.join("token").to_str().unwrap(),
            "--api-token-file",
            self.root.join("api-token").to_str().unwrap(),
        ]);
        args.extend(self.timers.mill_flags());
        let log = self.root.join(format!("mill{n}-{}.log", self.starts));
        self.starts += 1;
        self.mills[n] = Some(Proc::spawn(&args, log, "info"));
    }

    fn start_executors(&mut self, count: usize) {
        let list = format!("{},{}", self.slots[0].executor, self.slots[1].executor);
        for i in 0..count {
            let node = format!("x{i}");
            let p = common::start_executor(
                &self.root,
                &list,
                &node,
                4,
                &self.root.join("token"),
                &self.timers.exec_flags(),
            );
            self.executors.push(p);
        }
    }

    fn api(&self, n: usize) -> Api {
        Api::new(&format!("http://{}", self.slots[n].http), API_TOKEN)
    }

    /// What slot `n`'s `/health` says (`Null` when nothing answers).
    fn health(&self, n: usize) -> Value {
        let (s, v) = self.api(n).get("/health");
        if s == 200 {
            v
        } else {
            Value::Null
        }
    }

    /// Waits until slot `n` leads; its term.
    fn wait_leader(&self, n: usize) -> u64 {
        self.wait(&format!("mill {n} to lead"), || {
            let h = self.health(n);
            (h["role"] == "leader")
                .then(|| h["term"].as_u64())
                .flatten()
        })
    }

    /// Waits until slot `n` stands by; its `/health`.
    fn wait_standby(&self, n: usize) -> Value {
        self.wait(&format!("mill {n} to stand by"), || {
            let h = self.health(n);
            (h["role"] == "standby" && h["leader"]["term"].is_u64()).then_some(h)
        })
    }

    /// Waits until slot `n` leads and has every executor ready.
    fn wait_executors_on(&self, n: usize) {
        let api = self.api(n);
        let count = self.executors.len();
        self.wait(&format!("{count} executors ready on mill {n}"), || {
            (0..count)
                .all(|i| api.ready(&format!("x{i}")))
                .then_some(())
        });
    }

    /// [`wait_for`], failing with the processes' logs.
    fn wait<T>(&self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + common::TIMEOUT;
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn mill(&mut self, n: usize) -> &mut Proc {
        self.mills[n].as_mut().unwrap()
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        let mut names: Vec<PathBuf> = std::fs::read_dir(&self.root)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        names.sort();
        for p in names {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            out.push_str(&format!("--- {} (last 40 lines)\n", p.display()));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

/// Submits job `idx` until a mill acknowledges it; its id. Tries the mill that answered
/// last first, then the other; gives up (None) once `stop` is set.
fn submit_until_acked(
    apis: &[Api; 2],
    prefer: &mut usize,
    body: &Value,
    key: &str,
    stop: &AtomicBool,
) -> Option<u64> {
    let text = body.to_string();
    loop {
        for k in 0..2 {
            let n = (*prefer + k) % 2;
            let (s, v) = apis[n].post_with("/v1/jobs", &text, &[("Idempotency-Key", key)]);
            if s == 201 || s == 200 {
                *prefer = n;
                return Some(v["id"].as_u64().unwrap());
            }
            assert!(
                s == 0 || s == 503 || s == 500,
                "submit {key} answered {s}: {v}"
            );
        }
        if stop.load(Ordering::SeqCst) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A thread that submits jobs until told to stop; `acked` counts acknowledgements.
struct Submitter {
    stop: Arc<AtomicBool>,
    acked: Arc<AtomicUsize>,
    thread: std::thread::JoinHandle<Vec<(u64, u64)>>,
}

impl Submitter {
    fn start(c: &Cluster, seed: u64) -> Submitter {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicUsize::new(0));
        let apis = [c.api(0), c.api(1)];
        let markers = c.markers.clone();
        let (s, a) = (stop.clone(), acked.clone());
        let thread = std::thread::spawn(move || {
            let mut rng = Rng::new(seed);
            let mut out = Vec::new();
            let mut prefer = 0;
            for idx in 1u64.. {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let body =
                    json!({ "command": common::marker_job(&markers, idx, rng.range(50, 400), 0) });
                let key = format!("fo-{seed}-{idx}");
                match submit_until_acked(&apis, &mut prefer, &body, &key, &s) {
                    Some(id) => {
                        out.push((idx, id));
                        a.fetch_add(1, Ordering::SeqCst);
                    }
                    None => break,
                }
                std::thread::sleep(Duration::from_millis(rng.range(10, 40)));
            }
            out
        });
        Submitter {
            stop,
            acked,
            thread,
        }
    }

    fn wait_acked(&self, n: usize) {
        wait_for(&format!("{n} acknowledged submits"), || {
            (self.acked.load(Ordering::SeqCst) >= n).then_some(())
        });
    }

    fn finish(self) -> Vec<(u64, u64)> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

/// Waits until every job on the leader `n` has ended, then checks I1/I2 against the markers:
/// every acknowledged job is there and ended, each job that ran did so exactly once with a
/// start and an end under the lease the mill recorded, and no marker belongs to a job the
/// store does not hold. Returns the number of jobs checked.
fn check_once(c: &Cluster, n: usize, acked: &[(u64, u64)]) -> usize {
    let api = c.api(n);
    let jobs = wait_for("every job to end", || {
        let jobs = common::all_jobs(&api);
        jobs.iter().all(|j| j["done"] == true).then_some(jobs)
    });
    let markers = read_markers(&c.markers);
    let by_id: BTreeMap<u64, &Value> = jobs
        .iter()
        .map(|j| (j["id"].as_u64().unwrap(), j))
        .collect();
    let lost: Vec<u64> = acked
        .iter()
        .filter(|(_, id)| !by_id.contains_key(id))
        .map(|(_, id)| *id)
        .collect();
    assert!(
        lost.is_empty(),
        "acknowledged jobs the store lost: {lost:?}\n{}",
        c.logs()
    );
    let orphans: Vec<&u64> = markers
        .keys()
        .filter(|id| !by_id.contains_key(id))
        .collect();
    assert!(
        orphans.is_empty(),
        "executions of jobs the store does not hold: {orphans:?}"
    );
    let empty = Markers::default();
    let mut bad = Vec::new();
    for (id, job) in &by_id {
        let m = markers.get(id).unwrap_or(&empty);
        let ok = job["state"] == "success"
            && m.starts.len() == 1
            && m.ends.len() == 1
            && m.starts[0] == m.ends[0]
            && job["lease"] == m.starts[0].lease;
        if !ok {
            bad.push(((*job).clone(), m.clone()));
        }
    }
    assert!(
        bad.is_empty(),
        "{} jobs did not run exactly once to success under their recorded lease: {:#?}\n{}",
        bad.len(),
        &bad[..bad.len().min(5)],
        c.logs()
    );
    // The submitter's keys: one job per acknowledged submit (M31 across mills).
    let mut ids: Vec<u64> = acked.iter().map(|(_, id)| *id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), acked.len(), "two submits were given one job id");
    jobs.len()
}

/// Submits a probe job to leader `n` and waits until it runs; when it was first seen running.
fn probe_runs(c: &Cluster, n: usize, key: &str) -> Instant {
    let api = c.api(n);
    let body = json!({ "command": common::marker_job(&c.markers, 0, 10, 0) }).to_string();
    let id = wait_for("the new leader to accept the probe", || {
        let (s, v) = api.post_with("/v1/jobs", &body, &[("Idempotency-Key", key)]);
        (s == 201 || s == 200).then(|| v["id"].as_u64()).flatten()
    });
    wait_for("the probe to be placed", || {
        let v = api.job(id)?;
        let placed = v["lease"].as_u64().is_some_and(|l| l > 0) || v["done"] == true;
        placed.then(Instant::now)
    })
}

/// Kill -9 the leader under load: the standby takes over (a higher term), executors follow
/// their `--mill` list to it, every acknowledged job ends and each ran exactly once (I1, I2,
/// M29, §10). Then the killed mill comes back as a standby naming the new leader.
#[test]
fn i1_kill9_of_the_leader_under_load_the_standby_leads_and_every_job_runs_once() {
    let timers = Timers {
        short: std::env::var("FAILOVER_DEFAULT_TIMERS").as_deref() != Ok("1"),
    };
    let root = tempfile::tempdir().unwrap();
    let Some(mut c) = Cluster::new("kill9_leader", root.path(), timers) else {
        return;
    };
    c.start_mill(0);
    let term0 = c.wait_leader(0);
    c.start_mill(1);
    let standby = c.wait_standby(1);
    assert_eq!(standby["leader"]["term"], term0, "{standby}");
    assert_eq!(standby["leader"]["http_address"], c.slots[0].http.as_str());
    assert_eq!(
        standby["leader"]["executor_address"],
        c.slots[0].executor.as_str()
    );
    // A standby serves no API: 503 naming the leader.
    let (s, v) = c.api(1).get("/v1/jobs");
    assert_eq!(s, 503, "{v}");
    assert!(
        v.to_string().contains(&c.slots[0].http),
        "the standby's 503 names the leader: {v}"
    );
    c.start_executors(2);
    c.wait_executors_on(0);

    let sub = Submitter::start(&c, 1);
    sub.wait_acked(40);
    let killed = Instant::now();
    c.mill(0).kill9();
    let term1 = c.wait_leader(1);
    let leads = killed.elapsed();
    assert!(term1 > term0, "the new leader's term {term1} > {term0}");
    let placed = probe_runs(&c, 1, "probe-kill9").duration_since(killed);
    eprintln!(
        "FAILOVER kill -9 → new leader leads: {} ms; → first placement by it: {} ms (lease {}, timers {})",
        leads.as_millis(),
        placed.as_millis(),
        if timers.short { "3s" } else { "15s (default)" },
        if timers.short { "short" } else { "default" },
    );
    let seen = sub.acked.load(Ordering::SeqCst);
    sub.wait_acked(seen + 40);
    c.wait_executors_on(1);
    let acked = sub.finish();
    let n = check_once(&c, 1, &acked);
    assert!(n >= 80, "only {n} jobs");

    // The killed mill restarts as a standby of the new term.
    c.start_mill(0);
    let h = c.wait_standby(0);
    assert_eq!(h["leader"]["term"], term1, "{h}");
    assert_eq!(h["leader"]["http_address"], c.slots[1].http.as_str());
}

/// SIGSTOP the leader past its lease (a GC pause), SIGCONT it: the standby has taken over
/// under a higher term; the resumed mill's renewal and writes fail (I13), it exits with code
/// 3 saying it stepped down, and no job runs twice — executors refuse its stale-term
/// commands (E13).
#[test]
fn i13_a_leader_stopped_past_its_lease_steps_down_on_sigcont_and_no_job_runs_twice() {
    use nix::sys::signal::Signal;
    let root = tempfile::tempdir().unwrap();
    let Some(mut c) = Cluster::new("sigstop_leader", root.path(), Timers { short: true }) else {
        return;
    };
    c.start_mill(0);
    let term0 = c.wait_leader(0);
    c.start_mill(1);
    c.wait_standby(1);
    c.start_executors(2);
    c.wait_executors_on(0);

    let sub = Submitter::start(&c, 2);
    sub.wait_acked(30);
    c.mill(0).signal(Signal::SIGSTOP);
    let term1 = c.wait_leader(1);
    assert!(term1 > term0);
    c.wait_executors_on(1);
    let seen = sub.acked.load(Ordering::SeqCst);
    sub.wait_acked(seen + 20);
    c.mill(0).signal(Signal::SIGCONT);
    let status = c.mill(0).wait_exit();
    let log = c.mill(0).logs();
    assert_eq!(
        status.code(),
        Some(3),
        "the resumed mill exits 3 (stepped down): {status:?}\n{log}"
    );
    assert!(log.contains("stepped down"), "{log}");
    // The new leader kept leading.
    assert_eq!(c.health(1)["term"], term1);
    let seen = sub.acked.load(Ordering::SeqCst);
    sub.wait_acked(seen + 20);
    let acked = sub.finish();
    let n = check_once(&c, 1, &acked);
    assert!(n >= 70, "only {n} jobs");
}

/// PostgreSQL restarts under load: a leader whose commit or renewal fails stops (its
/// supervisor would restart it), the standby or a restarted mill takes over, and no
/// acknowledged submit is lost; every job still runs once.
#[test]
fn i2_postgres_restarts_under_load_lose_no_acknowledged_submit() {
    let root = tempfile::tempdir().unwrap();
    let Some(mut c) = Cluster::new("postgres_restart", root.path(), Timers { short: true }) else {
        return;
    };
    c.start_mill(0);
    c.wait_leader(0);
    c.start_mill(1);
    c.wait_standby(1);
    c.start_executors(2);
    c.wait_executors_on(0);

    let sub = Submitter::start(&c, 3);
    for round in 0..2 {
        let seen = sub.acked.load(Ordering::SeqCst);
        sub.wait_acked(seen + 30);
        c.pg.restart();
        // A supervisor's part: a mill that exited is started again (as a standby or
        // leader). Done once a mill leads with every executor ready on it.
        let count = c.executors.len();
        let mut restarts = 0;
        let deadline = Instant::now() + common::TIMEOUT;
        loop {
            for n in 0..2 {
                // In the second round the standby must take over first: the exited mill
                // is restarted only once the other one leads.
                let other_leads = c.health(1 - n)["role"] == "leader";
                if round == 1 && !other_leads {
                    continue;
                }
                if c.mills[n].as_mut().is_some_and(Proc::exited) {
                    let p = c.mills[n].as_mut().unwrap();
                    let code = p.wait_exit().code();
                    let logs = p.logs();
                    let last = logs.lines().last().unwrap_or("");
                    eprintln!("round {round}: mill {n} exited {code:?} ({last}); restarting it");
                    c.start_mill(n);
                    restarts += 1;
                }
            }
            let ready = (0..2).any(|n| {
                c.health(n)["role"] == "leader"
                    && (0..count).all(|i| c.api(n).ready(&format!("x{i}")))
            });
            if ready {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: no mill leads with every executor ready\n{}",
                c.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let leader = (0..2).find(|&n| c.health(n)["role"] == "leader");
        eprintln!("round {round}: mill {leader:?} leads after {restarts} restarts");
    }
    let seen = sub.acked.load(Ordering::SeqCst);
    sub.wait_acked(seen + 20);
    let acked = sub.finish();
    let leader = wait_for("a leader", || {
        (0..2).find(|&n| c.health(n)["role"] == "leader")
    });
    let n = check_once(&c, leader, &acked);
    assert!(n >= 80, "only {n} jobs");
}
