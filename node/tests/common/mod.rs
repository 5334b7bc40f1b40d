//! Helpers for tests that run real `millrace` processes on loopback: spawning and killing
//! processes, the mill's address file, a small HTTP client, bounded polling and a seeded
//! pseudo-random source. Every wait polls with a deadline; nothing sleeps in place of
//! synchronisation.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod pg;

pub const BIN: &str = env!("CARGO_BIN_EXE_millrace");

/// How long a wait may take before the test fails, saying what it waited for. Generous: the
/// machine may be busy; nothing asserts speed.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// A child process whose output goes to a log file; killed (SIGKILL) when dropped.
pub struct Proc {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(args: &[String], log: PathBuf, rust_log: &str) -> Proc {
        Proc::spawn_under(&[], args, log, rust_log)
    }

    /// [`Proc::spawn`] through a wrapper that executes the binary in its own process (such
    /// as `prlimit --nofile=N:N`), so the pid is still the binary's.
    pub fn spawn_under(wrapper: &[&str], args: &[String], log: PathBuf, rust_log: &str) -> Proc {
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = match wrapper.split_first() {
            None => Command::new(BIN),
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(BIN);
                c
            }
        };
        let child = cmd
            .args(args)
            .env("RUST_LOG", rust_log)
            .env_remove("MILLRACE_TOKEN")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Proc {
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid()).unwrap());
        nix::sys::signal::kill(pid, sig).unwrap();
    }

    /// SIGTERM and wait for the process to exit; its exit status.
    pub fn term(&mut self) -> std::process::ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let mut c = self.child.take().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "process did not stop after SIGTERM; log:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (bounded by [`TIMEOUT`]) for the process to exit by itself; its exit status.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let c = self.child.as_mut().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                self.child = None;
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "process did not exit by itself; log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process has exited (reaping it if so).
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            None => true,
            Some(c) => c.try_wait().unwrap().is_some(),
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Polls `f` until it yields, or fails the test after [`TIMEOUT`] saying what it waited for.
pub fn wait_for<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    wait_for_within(what, TIMEOUT, f)
}

/// [`wait_for`] with its own bound.
pub fn wait_for_within<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where a mill process listens, from the address file it wrote.
#[derive(Debug, Clone)]
pub struct Addrs {
    pub http: String,
    pub executor: String,
}

/// The addresses the mill process `pid` wrote once it listened.
pub fn addrs(data: &Path, pid: u32) -> Addrs {
    wait_for("the mill's address file", || {
        let text = std::fs::read_to_string(data.join("addr.json")).ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        if v["pid"].as_u64()? != u64::from(pid) {
            return None;
        }
        Some(Addrs {
            http: format!("http://{}", v["http"].as_str()?),
            executor: v["executor"].as_str()?.to_string(),
        })
    })
}

/// The mill's executor token, once it wrote it.
pub fn token(data: &Path) -> String {
    read_credential(&data.join("token"))
}

/// The mill's API token, once it wrote it.
pub fn api_token(data: &Path) -> String {
    read_credential(&data.join("api-token"))
}

fn read_credential(path: &Path) -> String {
    wait_for(&format!("the credential {}", path.display()), || {
        let t = std::fs::read_to_string(path).ok()?;
        let t = t.trim().to_string();
        (!t.is_empty()).then_some(t)
    })
}

/// A small client of the mill's HTTP API. Transport failures answer status 0.
pub struct Api {
    pub base: String,
    token: String,
    agent: ureq::Agent,
}

impl Api {
    pub fn new(base: &str, token: &str) -> Api {
        Api::with_tls(base, token, ureq::tls::TlsConfig::default())
    }

    /// A client of an https API whose certificate `ca` (PEM) signed.
    pub fn with_ca(base: &str, token: &str, ca: &Path) -> Api {
        let pem = std::fs::read(ca).unwrap();
        let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item.unwrap() {
                ureq::tls::PemItem::Certificate(c) => Some(c),
                _ => None,
            })
            .collect();
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(ureq::tls::RootCerts::new_with_certs(&certs))
            .unversioned_rustls_crypto_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .build();
        Api::with_tls(base, token, tls)
    }

    fn with_tls(base: &str, token: &str, tls: ureq::tls::TlsConfig) -> Api {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .tls_config(tls)
            .build()
            .into();
        Api {
            base: base.to_string(),
            token: token.to_string(),
            agent,
        }
    }

    /// A GET's status and body text; `auth` says whether to send the token.
    pub fn get_raw(&self, path: &str, auth: bool) -> (u16, String) {
        let mut req = self.agent.get(format!("{}{path}", self.base));
        if auth {
            req = req.header("Authorization", &format!("Bearer {}", self.token));
        }
        match req.call() {
            Ok(mut r) => (
                r.status().as_u16(),
                r.body_mut().read_to_string().unwrap_or_default(),
            ),
            Err(_) => (0, String::new()),
        }
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        let (s, t) = self.get_raw(path, true);
        (s, serde_json::from_str(&t).unwrap_or(Value::Null))
    }

    pub fn post(&self, path: &str, body: &str) -> (u16, Value) {
        let r = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Authorization", &format!("Bearer {}", self.token))
            .header("Content-Type", "application/json")
            .send(body);
        match r {
            Ok(mut r) => (
                r.status().as_u16(),
                serde_json::from_str(&r.body_mut().read_to_string().unwrap_or_default())
                    .unwrap_or(Value::Null),
            ),
            Err(_) => (0, Value::Null),
        }
    }

    /// A POST with extra headers: its status and body.
    pub fn post_with(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
        let mut req = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Authorization", &format!("Bearer {}", self.token))
            .header("Content-Type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        match req.send(body) {
            Ok(mut r) => (
                r.status().as_u16(),
                serde_json::from_str(&r.body_mut().read_to_string().unwrap_or_default())
                    .unwrap_or(Value::Null),
            ),
            Err(_) => (0, Value::Null),
        }
    }

    /// Submits; the job id when the mill accepted it (201).
    pub fn try_submit(&self, body: &Value) -> Option<u64> {
        let (s, v) = self.post("/v1/jobs", &body.to_string());
        (s == 201).then(|| v["id"].as_u64()).flatten()
    }

    /// Submits; the job id, failing the test unless the mill accepted it (201).
    pub fn submit(&self, body: &Value) -> u64 {
        let (s, v) = self.post("/v1/jobs", &body.to_string());
        assert_eq!(s, 201, "submit answered {s}: {v}");
        v["id"].as_u64().unwrap()
    }

    pub fn job(&self, id: u64) -> Option<Value> {
        let (s, v) = self.get(&format!("/v1/jobs/{id}"));
        (s == 200).then_some(v)
    }

    pub fn wait_state(&self, id: u64, pred: impl Fn(&str) -> bool, what: &str) -> Value {
        wait_for(&format!("job {id} to be {what}"), || {
            let v = self.job(id)?;
            pred(v["state"].as_str().unwrap_or("")).then_some(v)
        })
    }

    pub fn wait_done(&self, id: u64) -> Value {
        wait_for(&format!("job {id} to end"), || {
            let v = self.job(id)?;
            (v["done"].as_bool() == Some(true)).then_some(v)
        })
    }

    /// Whether `node` has a session that takes work.
    pub fn ready(&self, node: &str) -> bool {
        let (s, v) = self.get("/v1/nodes");
        s == 200
            && v["nodes"].as_array().is_some_and(|ns| {
                ns.iter()
                    .any(|n| n["node"] == node && n["state"] == "ready")
            })
    }
}

/// `millrace <args before -->` against `mill`'s API and data directory (its token), then
/// the args from `--` on.
pub fn cli(mill: &Mill, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args.iter().take_while(|a| **a != "--"))
        .args(["--server", &mill.addrs.http, "--data"])
        .arg(&mill.data)
        .args(args.iter().skip_while(|a| **a != "--"))
        .output()
        .unwrap()
}

/// Timers both sides share: seconds, not minutes.
pub fn timing(grace: &str, silence: &str) -> Vec<String> {
    strings(&[
        "--reconnect-grace",
        grace,
        "--silence-timeout",
        silence,
        "--snapshot-interval",
        "300ms",
    ])
}

pub fn strings(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

/// A mill process on `data`, listening for executors on `executor_listen` (a fixed address
/// keeps executors' `--mill` valid across restarts).
pub struct Mill {
    pub proc: Proc,
    pub data: PathBuf,
    pub addrs: Addrs,
    pub api: Api,
}

/// Starts a mill; waits until it listens. `extra` are more flags (timers).
pub fn start_mill(
    root: &Path,
    executor_listen: &str,
    extra: &[String],
    rust_log: &str,
    n: usize,
) -> Mill {
    start_mill_under(&[], root, executor_listen, extra, rust_log, n)
}

/// [`start_mill`] through a wrapper ([`Proc::spawn_under`]).
pub fn start_mill_under(
    wrapper: &[&str],
    root: &Path,
    executor_listen: &str,
    extra: &[String],
    rust_log: &str,
    n: usize,
) -> Mill {
    let data = root.join("mill");
    let mut args = strings(&[
        "mill",
        "--data",
        data.to_str().unwrap(),
        "--executor-listen",
        executor_listen,
        "--http-listen",
        "127.0.0.1:0",
    ]);
    args.extend_from_slice(extra);
    let proc = Proc::spawn_under(wrapper, &args, root.join(format!("mill-{n}.log")), rust_log);
    let addrs = addrs(&data, proc.pid());
    let api = Api::new(&addrs.http, &api_token(&data));
    Mill {
        proc,
        data,
        addrs,
        api,
    }
}

/// Starts an executor dialling `mill_addr`.
pub fn start_executor(
    root: &Path,
    mill_addr: &str,
    node: &str,
    seats: u32,
    token_file: &Path,
    extra: &[String],
) -> Proc {
    let data = root.join(node);
    let mut args = strings(&[
        "executor",
        "--mill",
        mill_addr,
        "--node-id",
        node,
        "--engine",
        &format!("shell:{seats}"),
        "--data",
        data.to_str().unwrap(),
        "--token-file",
        token_file.to_str().unwrap(),
        "--backoff-min",
        "50ms",
        "--backoff-max",
        "300ms",
        "--stop-grace",
        "1s",
        "--drain-timeout",
        "5s",
    ]);
    args.extend_from_slice(extra);
    Proc::spawn(&args, fresh_log(root, node), "info")
}

/// [`start_executor`] with `extra` flags, then waits until the mill has it ready.
pub fn start_ready_executor(
    root: &Path,
    mill: &Mill,
    node: &str,
    seats: u32,
    extra: &[String],
) -> Proc {
    let p = start_executor(
        root,
        &mill.addrs.executor,
        node,
        seats,
        &mill.data.join("token"),
        extra,
    );
    wait_for(&format!("{node} ready"), || {
        mill.api.ready(node).then_some(())
    });
    p
}

/// A mill (`extra` flags, grace 5 s, silence 2 s) and one executor `x1` with `seats`
/// seats, ready.
pub fn start_mill_and_x1(root: &Path, extra: &[&str], n: usize, seats: u32) -> (Mill, Proc) {
    let mut args = strings(extra);
    args.extend(timing("5s", "2s"));
    let mill = start_mill(root, "127.0.0.1:0", &args, "info", n);
    let exec = start_executor(
        root,
        &mill.addrs.executor,
        "x1",
        seats,
        &mill.data.join("token"),
        &timing("5s", "2s"),
    );
    wait_for("x1 ready", || mill.api.ready("x1").then_some(()));
    (mill, exec)
}

/// `<root>/<stem>-<i>.log` for the first `i` not yet taken, so a restarted process does not
/// overwrite the log of the one before it.
pub fn fresh_log(root: &Path, stem: &str) -> PathBuf {
    (0..)
        .map(|i| root.join(format!("{stem}-{i}.log")))
        .find(|p| !p.exists())
        .unwrap()
}

/// splitmix64: a seeded, reproducible sequence for kill moments and job shapes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (hi > lo).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo)
    }
}

/// Execution markers a job left: each execution appends `start <idx> <lease> <pid>` when it
/// begins and `end <idx> <lease> <pid>` when it finishes, to `<dir>/<job id>`.
#[derive(Debug, Default, Clone)]
pub struct Markers {
    pub starts: Vec<Marker>,
    pub ends: Vec<Marker>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    pub idx: u64,
    pub lease: u64,
    pub pid: u64,
}

/// The shell snippet that appends a marker line of `kind` for this execution.
pub fn marker_cmd(dir: &Path, idx: u64, kind: &str) -> String {
    format!(
        "echo \"{kind} {idx} $MILLRACE_LEASE_ID $$\" >> {}/$MILLRACE_JOB_ID",
        dir.display()
    )
}

/// A job's command: markers around a short sleep, then `exit <code>`. `: idx=N` names the
/// submit attempt, so a job whose submit answer was lost in a kill is still recognised.
pub fn marker_job(markers: &Path, idx: u64, sleep_ms: u64, exit: i32) -> String {
    format!(
        ": idx={idx}; {}; sleep {}.{:03}; {}; exit {exit}",
        marker_cmd(markers, idx, "start"),
        sleep_ms / 1000,
        sleep_ms % 1000,
        marker_cmd(markers, idx, "end"),
    )
}

/// Every marker file under `dir`, by job id.
pub fn read_markers(dir: &Path) -> std::collections::BTreeMap<u64, Markers> {
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let job: u64 = e.file_name().to_str().unwrap().parse().unwrap();
        let text = std::fs::read_to_string(e.path()).unwrap();
        let mut m = Markers::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f.len(), 4, "marker line {line:?} of job {job}");
            let marker = Marker {
                idx: f[1].parse().unwrap(),
                lease: f[2].parse().unwrap(),
                pid: f[3].parse().unwrap(),
            };
            match f[0] {
                "start" => m.starts.push(marker),
                "end" => m.ends.push(marker),
                other => panic!("marker kind {other:?} of job {job}"),
            }
        }
        out.insert(job, m);
    }
    out
}

/// Every job the mill holds, through the API (one page, or job by job beyond a page).
pub fn all_jobs(api: &Api) -> Vec<Value> {
    let (s, v) = api.get("/v1/jobs?limit=1000");
    assert_eq!(s, 200, "{v}");
    let jobs = v["jobs"].as_array().unwrap().clone();
    if jobs.len() < 1000 {
        return jobs;
    }
    // Newest first: the first row has the highest id.
    let max = jobs[0]["id"].as_u64().unwrap();
    (1..=max).filter_map(|id| api.job(id)).collect()
}
