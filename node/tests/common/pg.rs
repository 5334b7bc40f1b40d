//! A throwaway PostgreSQL server for tests (issue 14): `initdb` in a temporary directory as
//! an unprivileged user, `postgres` on a free loopback port with `fsync=on`, ready once
//! `pg_isready` says so, and stopped (fast shutdown, then SIGKILL) and waited for on drop,
//! so no server outlives its test.
//!
//! Without PostgreSQL's binaries a test prints a loud skip line and returns; with
//! `MILLRACE_REQUIRE_POSTGRES=1` (CI) it fails instead. Shared by the node's unit tests
//! (`#[path]`) and its process tests (`tests/common`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; stopped on drop.
pub struct TestPg {
    child: Option<Child>,
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// Its TCP port on 127.0.0.1.
    pub port: u16,
    user: Option<nix::unistd::User>,
}

/// Where PostgreSQL's server binaries are: `pg_config --bindir`, else the newest
/// `/usr/lib/postgresql/*/bin` that has `initdb`.
fn bindir() -> Option<PathBuf> {
    let from_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(dir) = from_config.filter(|d| d.join("initdb").exists()) {
        return Some(dir);
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| d.join("initdb").exists())
        .collect();
    dirs.sort_by_key(|d| {
        d.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.pop()
}

/// The user the server runs as when the tests run as root (initdb refuses root): the
/// package's `postgres` user, else a system user made for it.
fn server_user() -> Option<nix::unistd::User> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    for name in ["postgres", "millrace-pg"] {
        if let Ok(Some(u)) = nix::unistd::User::from_name(name) {
            return Some(u);
        }
    }
    let made = Command::new("useradd")
        .args(["--system", "--no-create-home", "millrace-pg"])
        .status();
    assert!(
        made.is_ok_and(|s| s.success()),
        "could not create the system user millrace-pg for the test PostgreSQL server"
    );
    nix::unistd::User::from_name("millrace-pg").ok().flatten()
}

/// A loopback port nothing listens on now.
/// A loopback port that was free a moment ago, for a server started next.
///
/// Taken below the kernel's ephemeral range (`ip_local_port_range`, 32768–60999 by
/// default), never from it: a port the kernel hands out for `bind(0)` is also where it picks
/// the source ports of outgoing connections, so under load a client connection could take
/// it before the server binds (a failover test once waited 60 s for a mill that had failed
/// to bind its fixed port). Tests in one process never get the same port twice; the start
/// depends on the pid so parallel test binaries spread out.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id() * 97) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let port = u16::try_from(LOW + n % SPAN).unwrap();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {LOW}..{}", LOW + SPAN);
}

fn command(bin: &Path, program: &str, user: Option<&nix::unistd::User>, cwd: &Path) -> Command {
    let mut c = Command::new(bin.join(program));
    c.current_dir(cwd).env("LC_ALL", "C").env_remove("PGDATA");
    if let Some(u) = user {
        use std::os::unix::process::CommandExt;
        c.uid(u.uid.as_raw()).gid(u.gid.as_raw());
    }
    c
}

impl TestPg {
    /// Starts a server, or `None` (after a loud skip line) when PostgreSQL is not installed
    /// and `MILLRACE_REQUIRE_POSTGRES` is not `1`.
    pub fn start(test: &str) -> Option<TestPg> {
        let Some(bin) = bindir() else {
            assert!(
                std::env::var("MILLRACE_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "{test}: MILLRACE_REQUIRE_POSTGRES=1 but no PostgreSQL binaries (pg_config --bindir, /usr/lib/postgresql/*/bin)"
            );
            eprintln!("!!! SKIPPED {test}: PostgreSQL is not installed (no initdb); set MILLRACE_REQUIRE_POSTGRES=1 to fail instead !!!");
            return None;
        };
        let user = server_user();
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let sock = dir.path().join("sock");
        std::fs::create_dir(&sock).unwrap();
        if let Some(u) = &user {
            for p in [dir.path(), sock.as_path()] {
                nix::unistd::chown(p, Some(u.uid), Some(u.gid)).unwrap();
            }
        }
        let out = command(&bin, "initdb", user.as_ref(), dir.path())
            .args(["-D"])
            .arg(&data)
            .args(["-U", "millrace", "-A", "trust", "--no-sync", "-E", "UTF8"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let mut pg = TestPg {
            child: None,
            dir,
            bin,
            port,
            user,
        };
        pg.spawn_server();
        pg.wait_ready();
        Some(pg)
    }

    /// Starts the server process on the same data directory and port.
    fn spawn_server(&mut self) {
        let log_path = self.dir.path().join("server.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        if let Some(u) = &self.user {
            nix::unistd::chown(&log_path, Some(u.uid), Some(u.gid)).unwrap();
        }
        let (data, sock) = (self.dir.path().join("data"), self.dir.path().join("sock"));
        let child = command(&self.bin, "postgres", self.user.as_ref(), self.dir.path())
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(&sock)
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=on"])
            .args(["-p", &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Stops the server (fast shutdown: clients are disconnected) and starts it again on
    /// the same data and port; returns once it accepts connections.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn_server();
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = Command::new(self.bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the test PostgreSQL server did not get ready: {}",
                self.server_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the server logged.
    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// The URL of database `db` (made by [`TestPg::create_db`], or `postgres`).
    pub fn url_of(&self, db: &str) -> String {
        format!("postgres://millrace@127.0.0.1:{}/{db}", self.port)
    }

    /// The URL of a fresh database named `db`.
    pub fn create_db(&self, db: &str) -> String {
        self.sql("postgres", &format!("CREATE DATABASE {db}"));
        self.url_of(db)
    }

    /// Runs `sql` on database `db` with a plain client.
    pub fn sql(&self, db: &str, sql: &str) {
        let mut c = postgres::Client::connect(&self.url_of(db), postgres::NoTls).unwrap();
        c.batch_execute(sql).unwrap();
    }
}

impl Drop for TestPg {
    fn drop(&mut self) {
        self.stop();
    }
}

impl TestPg {
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        // Fast shutdown: disconnects clients, stops at once.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
