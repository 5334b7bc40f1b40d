//! Assembling processes: a mill (store, driver, executor listener, HTTP API) and executors
//! (store, driver, shell engine), with start-up checks and clean shutdown.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use millrace_core::codec::FrameDecoder;
use millrace_core::executor::{EngineConfig, Executor, ExecutorConfig};
use millrace_core::mill::{Mill, MillConfig, MillInput};
use millrace_core::quota::QuotaConfig;
use millrace_core::{ConnId, NodeId};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, watch};

use crate::cli::{ExecTuning, MillTuning, Timing};
use crate::clock::Clock;
use crate::exec_driver::Engine;
use crate::exec_driver::{self, ExecDriverParts};
use crate::exec_store::ExecStore;
use crate::http::{self, Api};
use crate::mill_driver::{self, JobEvent, MillCmd, MillHandle, EVENT_BUFFER};
use crate::net::{self, OUT_QUEUE};
use crate::pg_store::PgStore;
use crate::preauth::{Preauth, PreauthConfig, Reject, Rejected};
use crate::shell::EngineSettings;
use crate::sqlite::StoreError;
use crate::store::{Reader, Store, StoreLocation};

/// Why a node could not start or stopped badly. Messages name the path or setting.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A store could not be opened or loaded.
    #[error("{0}")]
    Store(#[from] crate::sqlite::StoreError),
    /// A setting is invalid.
    #[error("invalid setting: {0}")]
    Config(String),
    /// A file or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A driver failed.
    #[error("{0}")]
    Driver(String),
    /// A TLS file or setting is unusable (the message names the flag and the path).
    #[error("{0}")]
    Tls(#[from] crate::tls::TlsError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
    let what = what.into();
    move |source| NodeError::Io { what, source }
}

/// Reads a token file (trimmed), refusing an empty one; warns when others may read it.
pub fn read_token(path: &Path) -> Result<String, NodeError> {
    warn_if_readable_by_others(path);
    let t = std::fs::read_to_string(path).map_err(io(format!("token file {}", path.display())))?;
    let t = t.trim().to_string();
    if t.is_empty() {
        return Err(NodeError::Config(format!(
            "token file {} is empty",
            path.display()
        )));
    }
    Ok(t)
}

/// Warns when a credential file is readable (or writable) by its group or others.
pub fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{mode:o}"),
                "credential file is accessible to its group or others; chmod 600 it"
            );
        }
    }
}

/// Warns when a data directory is open to its group or others (new ones are made 0700).
fn warn_if_dir_open(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{mode:o}"),
                "data directory is accessible to its group or others; chmod 700 it"
            );
        }
    }
}

/// Where the executor credential lives by default.
pub fn executor_token_path(data: &Path) -> PathBuf {
    data.join("token")
}

/// Where the API credential lives by default.
pub fn api_token_path(data: &Path) -> PathBuf {
    data.join("api-token")
}

/// The token at `path`, made (random, 0600) if the file does not exist.
pub fn ensure_token(path: &Path) -> Result<String, NodeError> {
    if path.exists() {
        return read_token(path);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(format!("directory {}", dir.display())))?;
    }
    let mut token = String::new();
    for _ in 0..4 {
        let r =
            crate::sqlite::random_u64().map_err(io("the operating system's random generator"))?;
        token.push_str(&format!("{r:016x}"));
    }
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io(format!("token file {}", path.display())))?;
    writeln!(f, "{token}").map_err(io(format!("token file {}", path.display())))?;
    tracing::info!(path = %path.display(), "generated a new token");
    Ok(token)
}

/// Everything a mill needs.
#[derive(Debug, Clone)]
pub struct MillOptions {
    /// Data directory.
    pub data: PathBuf,
    /// Where the durable state lives; `None`: SQLite in `data`.
    pub store: Option<StoreLocation>,
    /// Executor listener address.
    pub executor_listen: String,
    /// HTTP listener address.
    pub http_listen: String,
    /// The executor credential (executors' `Hello`).
    pub token: String,
    /// The API credential (`Authorization: Bearer`); an executor's token gets 401.
    pub api_token: String,
    /// Timers.
    pub timing: Timing,
    /// Mill settings.
    pub tuning: MillTuning,
    /// TLS on both listeners (`--tls-cert`, `--tls-key`, `--tls-client-ca`); `None`: plain TCP.
    pub tls: Option<crate::tls::MillTlsFiles>,
    /// Quota limits (`--config`'s `[quota]`, §6); the default limits nothing.
    pub quota: QuotaConfig,
    /// Leadership of a PostgreSQL store (`--leader-lease`, `--advertise-*`); unused on SQLite.
    pub ha: crate::standby::HaSettings,
}

impl MillOptions {
    fn config(&self) -> MillConfig {
        MillConfig {
            reconnect_grace: self.timing.reconnect_grace,
            silence_timeout: self.timing.silence_timeout,
            snapshot_interval: self.timing.snapshot_interval,
            bid_timeout: self.tuning.bid_timeout,
            top_k: self.tuning.top_k,
            direct_placement: self.tuning.direct_placement,
            late_binding: self.tuning.late_binding,
            max_pending: self.tuning.max_pending,
            cancel_ack_timeout: self.tuning.cancel_ack_timeout,
            cancel_teardown_timeout: self.tuning.cancel_teardown_timeout,
            job_timeout: self.tuning.job_timeout,
            queue_timeout: self.tuning.queue_timeout,
            retry_fence: self.tuning.retry_fence,
            quarantine_strikes: self.tuning.quarantine_strikes,
            executor_token: Some(self.token.clone()),
            max_sessions: self.tuning.max_sessions,
            quota: self.quota.clone(),
            ..MillConfig::default()
        }
    }
}

/// Descriptors kept aside for the store, job logs and the runtime (at most; a quarter of a
/// lower limit, see [`fd_reserve`]).
const FD_RESERVE: u64 = 128;

/// The descriptors kept aside under the soft limit `soft`: [`FD_RESERVE`], or a quarter of a
/// limit too low for it, so that a tiny `ulimit -n` still leaves room for connections.
fn fd_reserve(soft: u64) -> u64 {
    FD_RESERVE.min(soft / 4)
}

/// Fits the connection caps into the descriptor limit: when `--max-sessions` +
/// `--max-preauth-connections` + `--http-max-connections` + [`FD_RESERVE`] exceed the soft
/// `RLIMIT_NOFILE` (already raised to the hard limit), the pre-`Hello` and HTTP caps are cut
/// to an eighth of the budget each (at least 16) and sessions get the rest, with a warning
/// naming every value. Then a flood is evicted (pre-`Hello`) or waits in the backlog (HTTP)
/// instead of taking the descriptors the store, the logs and an honest executor need.
fn fit_caps_to_fds(t: &mut MillTuning, soft: u64) {
    let as_u64 = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let want = [
        t.max_sessions,
        t.max_preauth_connections,
        t.http_max_connections,
    ]
    .iter()
    .map(|n| as_u64(*n))
    .fold(fd_reserve(soft), u64::saturating_add);
    if want <= soft {
        return;
    }
    let reserve = fd_reserve(soft);
    let budget = usize::try_from(soft.saturating_sub(reserve).max(48)).unwrap_or(usize::MAX);
    let side = (budget / 8).max(16);
    let preauth = t.max_preauth_connections.min(side);
    let http = t.http_max_connections.min(side);
    let sessions = t
        .max_sessions
        .min(budget.saturating_sub(preauth + http).max(1));
    tracing::warn!(
        limit = soft,
        reserve,
        max_sessions = sessions,
        max_preauth_connections = preauth,
        http_max_connections = http,
        "the descriptor limit (ulimit -n {soft}) is below --max-sessions {} + --max-preauth-connections {} + --http-max-connections {} + {reserve} kept for the store and logs: running with the caps cut to {sessions}, {preauth} and {http}; raise the limit to lift them",
        t.max_sessions, t.max_preauth_connections, t.http_max_connections
    );
    t.max_sessions = sessions;
    t.max_preauth_connections = preauth;
    t.http_max_connections = http;
}

/// A running mill.
pub struct MillNode {
    /// Where the HTTP API listens.
    pub http_addr: SocketAddr,
    /// Where executors connect.
    pub executor_addr: SocketAddr,
    /// The driver.
    pub handle: MillHandle,
    /// Job events (after they are durable).
    pub events: broadcast::Sender<JobEvent>,
    shutdown: watch::Sender<bool>,
    driver: crate::rt::Joiner<Result<(), mill_driver::DriverError>>,
    logs: crate::rt::Joiner<()>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Renews the leadership of a PostgreSQL store.
    watchdog: Option<crate::standby::Watchdog>,
}

fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// A store, what it holds and a reader for the HTTP API.
type Opened = (Store, Option<millrace_core::mill::MillSnapshot>, Reader);

fn open_sqlite_store(dir: &std::path::Path) -> Result<Opened, StoreError> {
    let mut store = crate::store::open_sqlite(dir)?;
    let snapshot = store.load()?;
    let reader = store.reader()?;
    Ok((store, snapshot, reader))
}

/// Opens the PostgreSQL store at `url` under the term this mill won (DESIGN §10).
fn open_pg_store(url: &crate::store::PgUrl, term: u64) -> Result<Opened, StoreError> {
    let mut store = Store::Postgres(Box::new(PgStore::open(url, term)?));
    let snapshot = store.load()?;
    let reader = store.reader()?;
    Ok((store, snapshot, reader))
}

/// The listeners and the leadership a mill on a shared store starts leading with.
pub struct Leading {
    listeners: crate::standby::Listeners,
    won: crate::standby::Won,
}

/// What this mill writes into the leader row, from its bound listeners.
fn candidate(
    opts: &MillOptions,
    listeners: &crate::standby::Listeners,
) -> Result<crate::standby::Candidate, NodeError> {
    let (executor, http) = listeners.addrs().map_err(io("listener addresses"))?;
    Ok(crate::standby::Candidate {
        holder: leader_name(&executor.to_string()),
        executor: opts
            .ha
            .advertise_executor
            .clone()
            .unwrap_or_else(|| executor.to_string()),
        http: opts
            .ha
            .advertise_http
            .clone()
            .unwrap_or_else(|| http.to_string()),
    })
}

/// Starts a mill that may have to wait for leadership: on SQLite it starts at once; on a
/// PostgreSQL store it binds its listeners, stands by while another mill leads (DESIGN
/// §10) and starts leading when it wins a campaign. `None`: `stop` fired first.
pub async fn start_or_stand_by(
    opts: MillOptions,
    clock: Clock,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Option<MillNode>, NodeError> {
    let Some(StoreLocation::Postgres(url)) = &opts.store else {
        return start_mill(opts, clock).await.map(Some);
    };
    opts.ha.validate().map_err(NodeError::Config)?;
    let tls = opts.tls.as_ref().map(|f| f.load()).transpose()?;
    let listeners =
        crate::standby::Listeners::bind(&opts.executor_listen, &opts.http_listen).await?;
    let who = candidate(&opts, &listeners)?;
    let fd_limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft);
    let serve = crate::standby::StandbyServe {
        preauth: PreauthConfig {
            hello_timeout: opts.tuning.hello_timeout,
            max_connections: opts.tuning.max_preauth_connections,
            token: opts.token.clone(),
        },
        limits: http::HttpLimits {
            header_timeout: opts.tuning.http_header_timeout,
            body_timeout: opts.tuning.http_body_timeout,
            max_connections: opts.tuning.http_max_connections,
        },
        tls,
        fds: net::FdBudget::new(fd_limit, fd_reserve(fd_limit)),
    };
    let url = url.clone();
    let Some(won) = crate::standby::stand_by(&url, &who, &opts.ha, &listeners, serve, stop).await?
    else {
        return Ok(None);
    };
    start_leading(opts, clock, Some(Leading { listeners, won }))
        .await
        .map(Some)
}

/// This mill's name in the leader row: the host and its executor listener, the same
/// across restarts (so a restart takes a new term at once) and distinct between hosts.
fn leader_name(executor_listen: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    format!("{host}/{executor_listen}")
}

/// Opens the store, restores the mill (M29), binds both listeners and starts serving. On a
/// PostgreSQL store it campaigns once and fails with [`StoreError::NotLeader`] while another
/// mill leads ([`start_or_stand_by`] waits instead).
pub async fn start_mill(opts: MillOptions, clock: Clock) -> Result<MillNode, NodeError> {
    start_leading(opts, clock, None).await
}

async fn start_leading(
    mut opts: MillOptions,
    clock: Clock,
    leading: Option<Leading>,
) -> Result<MillNode, NodeError> {
    opts.tuning.validate().map_err(NodeError::Config)?;
    opts.ha.validate().map_err(NodeError::Config)?;
    let fd_limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft);
    fit_caps_to_fds(&mut opts.tuning, fd_limit);
    // Bad certificate files stop the start before anything is opened or bound.
    let tls = opts.tls.as_ref().map(|f| f.load()).transpose()?;
    if crate::http::constant_time_eq(opts.token.as_bytes(), opts.api_token.as_bytes()) {
        tracing::warn!("the executor and API credentials are the same: any executor host can cancel jobs and lift quarantines; give --api-token-file its own file");
    }
    std::fs::create_dir_all(&opts.data)
        .map_err(io(format!("data directory {}", opts.data.display())))?;
    warn_if_dir_open(&opts.data);
    let mut listeners = None;
    let mut watchdog = None;
    let (store, snapshot, reader) = match &opts.store {
        None => open_sqlite_store(&opts.data)?,
        Some(StoreLocation::Sqlite(dir)) => open_sqlite_store(dir)?,
        Some(StoreLocation::Postgres(url)) => {
            let leading = match leading {
                Some(l) => l,
                None => campaign_once(&opts, url).await?,
            };
            let who = candidate(&opts, &leading.listeners)?;
            let term = leading.won.term;
            tracing::info!(term, holder = %who.holder, executor_address = %who.executor, http_address = %who.http, "leading the mill's store");
            // Renewals start before the restore: a long load must not let the lease lapse.
            watchdog = Some(
                crate::standby::Watchdog::spawn(leading.won, who.holder, &opts.ha)
                    .map_err(io("leader renewal thread"))?,
            );
            listeners = Some(leading.listeners);
            let url = url.clone();
            // The sync client blocks and runs its own runtime: never inside this task.
            tokio::task::spawn_blocking(move || open_pg_store(&url, term))
                .await
                .map_err(|e| NodeError::Config(format!("opening the store: {e}")))??
        }
    };
    let restored = snapshot
        .as_ref()
        .map(|s| s.cursors.clone())
        .unwrap_or_default();
    tracing::info!(store = %store.describe(), term = store.term(), "mill store open");
    if let Some(s) = &snapshot {
        tracing::info!(
            store = %store.describe(),
            jobs = s.jobs.len(),
            leases = s.leases.len(),
            quarantined = s.quarantined.len(),
            "restoring the mill from its store"
        );
    }
    // E13: the mill speaks with the term its store gave it (a SQLite store counts one up at
    // every open; PostgreSQL's by campaign), so every executor that hears this mill refuses
    // an earlier one from then on.
    let config = MillConfig {
        term: millrace_core::Term(store.term()),
        ..opts.config()
    };
    let config_term = config.term.0;
    let mill =
        Mill::new(config, snapshot, clock.now()).map_err(|e| NodeError::Config(e.to_string()))?;
    let (events, _) = broadcast::channel(EVENT_BUFFER);
    let retention = mill_driver::Retention {
        max_age: opts.tuning.retention,
        max_count: opts.tuning.retention_count,
        files_deleted: Arc::new(std::sync::atomic::AtomicU64::new(0)),
    };
    let live = Arc::new(Mutex::new(crate::live::LiveLogs::new(
        crate::live::LiveLimits {
            per_job: opts.tuning.live_log_per_job,
            total: opts.tuning.live_log_total,
        },
    )));
    let ending = Arc::new(crate::logs::Ending::default());
    let (log_tx, logs) = crate::logs::spawn_writer(
        opts.data.clone(),
        live.clone(),
        ending.clone(),
        events.clone(),
        retention.files_deleted.clone(),
    )
    .map_err(io("job log writer"))?;
    let (shutdown, shutdown_rx) = watch::channel(false);
    let (handle, driver) = mill_driver::spawn(
        mill,
        store,
        clock,
        events.clone(),
        (log_tx, ending.clone()),
        restored,
        retention,
    )
    .map_err(io("mill driver thread"))?;

    let (exec_listener, http_listener) = match listeners {
        Some(l) => {
            #[cfg(not(madsim))]
            let wrap = |l: std::net::TcpListener| {
                l.set_nonblocking(true)?;
                TcpListener::from_std(l)
            };
            // Leading listeners come from a PostgreSQL campaign, never simulated (issue 16).
            #[cfg(madsim)]
            let wrap = |_: std::net::TcpListener| -> std::io::Result<TcpListener> {
                Err(std::io::Error::other("standing by is not simulated"))
            };
            (
                wrap(l.executor).map_err(io("executor listener"))?,
                wrap(l.http).map_err(io("HTTP listener"))?,
            )
        }
        None => (
            TcpListener::bind(&opts.executor_listen)
                .await
                .map_err(io(format!("executor listener {}", opts.executor_listen)))?,
            TcpListener::bind(&opts.http_listen)
                .await
                .map_err(io(format!("HTTP listener {}", opts.http_listen)))?,
        ),
    };
    let executor_addr = exec_listener
        .local_addr()
        .map_err(io("executor listener address"))?;
    let http_addr = http_listener
        .local_addr()
        .map_err(io("HTTP listener address"))?;
    for (what, addr) in [("executor", executor_addr), ("HTTP", http_addr)] {
        if tls.is_none() && !is_loopback(&addr) {
            tracing::warn!(
                %addr,
                "!!! the {what} listener is on a non-loopback address WITHOUT TLS: the token and all traffic cross the network in clear text. Use --tls-cert/--tls-key, a private network or a tunnel. !!!"
            );
            eprintln!("WARNING: millrace {what} listener on {addr} has no TLS; traffic and the token are in clear text.");
        }
    }
    let addr_file = opts.data.join("addr.json");
    let addrs = serde_json::json!({
        "http": http_addr.to_string(),
        "executor": executor_addr.to_string(),
        "pid": std::process::id(),
    });
    std::fs::write(&addr_file, addrs.to_string())
        .map_err(io(format!("address file {}", addr_file.display())))?;

    let mut tasks = Vec::new();
    let fds = net::FdBudget::new(fd_limit, fd_reserve(fd_limit));
    tracing::info!(
        fd_limit,
        reserve = fd_reserve(fd_limit),
        connections = fds.max(),
        "descriptor budget for accepted connections"
    );
    let preauth = Arc::new(Preauth::new(PreauthConfig {
        hello_timeout: opts.tuning.hello_timeout,
        max_connections: opts.tuning.max_preauth_connections,
        token: opts.token.clone(),
    }));
    tasks.push(tokio::spawn(accept_loop(
        exec_listener,
        handle.sender(),
        preauth.clone(),
        fds.clone(),
        tls.as_ref()
            .map(|t| tokio_rustls::TlsAcceptor::from(t.executor.clone())),
        shutdown_rx.clone(),
    )));
    let api = Api {
        mill: handle.clone(),
        reader: Arc::new(Mutex::new(reader)),
        token: Arc::new(opts.api_token.clone()),
        events: events.clone(),
        data: opts.data.clone(),
        live,
        ending,
        max_job_timeout: opts.tuning.max_job_timeout,
        preauth,
        term: config_term,
        ui: Arc::new(crate::ui::Sessions::new(
            tls.is_some(),
            opts.tuning.ui_session_ttl,
            opts.tuning.ui_max_sessions,
        )),
    };
    let limits = http::HttpLimits {
        header_timeout: opts.tuning.http_header_timeout,
        body_timeout: opts.tuning.http_body_timeout,
        max_connections: opts.tuning.http_max_connections,
    };
    let app = http::router(api, &limits);
    tasks.push(tokio::spawn(http::serve(
        http_listener,
        app,
        limits,
        fds,
        tls.as_ref()
            .map(|t| tokio_rustls::TlsAcceptor::from(t.http.clone())),
        shutdown_rx.clone(),
    )));
    tracing::info!(
        http = %http_addr,
        executors = %executor_addr,
        data = %opts.data.display(),
        tls = tls.is_some(),
        mutual_tls = tls.as_ref().is_some_and(|t| t.mutual),
        "mill listening"
    );
    Ok(MillNode {
        http_addr,
        executor_addr,
        handle,
        events,
        shutdown,
        driver,
        logs,
        tasks,
        watchdog,
    })
}

/// One campaign for a mill started without standing by: binds the listeners, wins or fails
/// naming the leader.
async fn campaign_once(
    opts: &MillOptions,
    url: &crate::store::PgUrl,
) -> Result<Leading, NodeError> {
    let listeners =
        crate::standby::Listeners::bind(&opts.executor_listen, &opts.http_listen).await?;
    let who = candidate(opts, &listeners)?;
    let (u, lease) = (url.clone(), opts.ha.lease);
    let result =
        tokio::task::spawn_blocking(move || crate::standby::Won::try_campaign(&u, &who, lease))
            .await
            .map_err(|e| NodeError::Config(format!("campaigning: {e}")))??;
    match result {
        Ok(won) => Ok(Leading { listeners, won }),
        Err((leadership, leader)) => {
            let target = leadership.target().to_string();
            // The sync client must not be dropped inside a task.
            tokio::task::spawn_blocking(move || drop(leadership))
                .await
                .map_err(|e| NodeError::Config(format!("campaigning: {e}")))?;
            Err(match leader {
                Some(l) => StoreError::NotLeader {
                    target,
                    holder: l.holder,
                    address: l.address,
                    term: l.term,
                    expires_in: l.expires_in,
                },
                None => StoreError::ForeignDatabase {
                    target,
                    reason: "the campaign lost, yet millrace_leader has no row".into(),
                },
            }
            .into())
        }
    }
}

impl MillNode {
    /// Stops accepting, lets in-flight HTTP requests finish (bounded), then asks the driver
    /// to stop: it finishes the step in flight (commit, then sends), closes the connections
    /// and closes the store on its own thread (never from here, never mid-commit).
    pub async fn stop(self) -> Result<(), NodeError> {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            // Log followers may hold the HTTP server open; do not wait for them forever.
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
        // Fails only if the driver already stopped (a failed commit); join tells why.
        let _ = self.handle.sender().send(MillCmd::Shutdown).await;
        let driver = self.driver;
        let result = driver.wait().await;
        drop(self.handle);
        drop(self.events);
        let logs = self.logs;
        let _ = tokio::time::timeout(Duration::from_secs(5), logs.wait()).await;
        if let Some(w) = self.watchdog {
            // The last commit is done (or failed): hand over now, not at the lease's end.
            w.resign().await;
        }
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(NodeError::Driver(e.to_string())),
            Err(_) => Err(NodeError::Driver("the mill driver panicked".into())),
        }
    }

    /// Whether the driver thread has stopped (a failed commit stops it).
    pub fn driver_finished(&self) -> bool {
        self.driver.is_finished()
    }

    /// Why this mill must stop leading its PostgreSQL store at once, if it must (its term
    /// moved on, or it could not renew within the lease; DESIGN §10).
    pub fn stepped_down(&self) -> Option<crate::standby::SteppedDown> {
        self.watchdog.as_ref().and_then(|w| w.stepped_down())
    }
}

/// The executor port's TLS handshake: the stream and the client's certificate, if any
/// (mutual TLS); a failed handshake is a typed pre-`Hello` rejection.
pub(crate) async fn tls_accept(
    acceptor: tokio_rustls::TlsAcceptor,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
) -> Result<
    (
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        Option<rustls::pki_types::CertificateDer<'static>>,
    ),
    Rejected,
> {
    let s = acceptor.accept(stream).await.map_err(|e| Rejected {
        kind: Reject::Handshake,
        detail: format!("TLS handshake with {peer}: {e}"),
    })?;
    let cert = s
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned());
    Ok((s, cert))
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// After a failed `accept` (out of descriptors, most often), wait this long before the next
/// one instead of spinning or giving up on the listener.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Accepts executor connections. Each is first a pre-`Hello` connection, handled by its own
/// task within the bounds of [`Preauth`] (the TLS handshake, when `tls` is set, included);
/// only a connection whose `Hello` carries the executor token (and, with mutual TLS, the node
/// id its certificate names) is announced to the mill driver (`Connected`, then the `Hello`).
async fn accept_loop(
    listener: TcpListener,
    tx: mpsc::Sender<MillCmd>,
    preauth: Arc<Preauth>,
    fds: Arc<net::FdBudget>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut failures = 0u64;
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait_for(|s| *s) => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors and the like: back off, keep the listener.
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::warn!(error = %e, failures, "accepting an executor connection failed; retrying");
                }
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Some(fd) = fds.take() else {
            drop(stream);
            preauth.refused_for_fds(format!(
                "{peer}: {} connections hold every descriptor but those kept for the store and logs",
                fds.max()
            ));
            continue;
        };
        // Nagle off from the first byte: the handshake is small messages too.
        let _ = stream.set_nodelay(true);
        let tx = tx.clone();
        let preauth = preauth.clone();
        match tls.clone() {
            None => {
                tokio::spawn(async move {
                    let _fd = fd;
                    let admitted = preauth.admit(async { Ok((stream, None)) }).await;
                    session(admitted, peer, tx).await;
                });
            }
            Some(acceptor) => {
                tokio::spawn(async move {
                    let _fd = fd;
                    let admitted = preauth.admit(tls_accept(acceptor, stream, peer)).await;
                    session(admitted, peer, tx).await;
                });
            }
        }
    }
}

/// Runs one admitted executor connection: announces it to the driver, frames it until it
/// ends, then reports `Disconnected` once.
async fn session<S: net::Transport>(
    admitted: Result<(S, millrace_core::wire::ToMill), Rejected>,
    peer: SocketAddr,
    tx: mpsc::Sender<MillCmd>,
) {
    let (stream, hello) = match admitted {
        Ok(x) => x,
        Err(rej) => {
            tracing::debug!(%peer, reason = rej.kind.name(), detail = %rej.detail, "executor connection closed before Hello");
            return;
        }
    };
    let conn = ConnId(NEXT_CONN.fetch_add(1, Ordering::Relaxed));
    let (out_tx, out_rx) = mpsc::channel(OUT_QUEUE);
    if tx
        .send(MillCmd::Connected { conn, tx: out_tx })
        .await
        .is_err()
        || tx
            .send(MillCmd::Net(MillInput::Message { conn, msg: hello }))
            .await
            .is_err()
    {
        return;
    }
    tracing::debug!(%conn, %peer, "executor connection authenticated");
    let deliver = tx.clone();
    let ended = net::run(
        stream,
        out_rx,
        |d: &mut FrameDecoder| d.next_to_mill(),
        move |msg| {
            let tx = deliver.clone();
            async move {
                tx.send(MillCmd::Net(MillInput::Message { conn, msg }))
                    .await
                    .is_ok()
            }
        },
    )
    .await;
    match &ended {
        net::Ended::Codec(e) => {
            tracing::warn!(%conn, %peer, error = %e, "bad frame from executor; connection closed")
        }
        other => {
            tracing::debug!(%conn, %peer, reason = %other, "executor connection ended")
        }
    }
    let _ = tx
        .send(MillCmd::Net(MillInput::Disconnected { conn }))
        .await;
}

/// Everything an executor needs.
#[derive(Debug, Clone)]
pub struct ExecOptions {
    /// The mill's executor address.
    pub mill: String,
    /// Node id.
    pub node_id: String,
    /// Labels.
    pub labels: Vec<String>,
    /// `shell` or `shell:N`.
    pub engine: String,
    /// Data directory.
    pub data: PathBuf,
    /// The token.
    pub token: String,
    /// Timers.
    pub timing: Timing,
    /// Executor settings.
    pub tuning: ExecTuning,
    /// TLS towards the mill (`--tls-ca`, `--tls-cert`/`--tls-key`, `--tls-server-name`).
    pub tls: Option<crate::tls::ExecTlsFiles>,
}

/// Parses `shell` or `shell:N` (default seats: the CPU count).
pub fn parse_engine(s: &str) -> Result<(String, u32), NodeError> {
    let (name, seats) = match s.split_once(':') {
        Some((n, c)) => {
            let c = c.parse::<u32>().map_err(|_| {
                NodeError::Config(format!("--engine {s:?}: seats {c:?} is not a number"))
            })?;
            (n, c)
        }
        None => {
            let cpus = std::thread::available_parallelism()
                .map(|n| u32::try_from(n.get()).unwrap_or(1))
                .unwrap_or(1);
            (s, cpus)
        }
    };
    if name != "shell" {
        return Err(NodeError::Config(format!(
            "--engine {s:?}: only the shell engine exists"
        )));
    }
    Ok((name.to_string(), seats))
}

/// What this machine has, for `--resources`' default (M34): `cpu` is the CPUs this process
/// may use, `memory_mb` the machine's memory (`MemTotal` in /proc/meminfo). A value that
/// cannot be read is left out, so it is not limited, rather than guessed.
pub fn machine_resources() -> millrace_core::Resources {
    let mut out = millrace_core::Resources::new();
    if let Ok(n) = std::thread::available_parallelism() {
        out.insert("cpu".into(), n.get() as u64);
    }
    if let Some(mb) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .as_deref()
        .and_then(mem_total_mb)
    {
        out.insert("memory_mb".into(), mb);
    }
    out
}

/// `MemTotal` in MiB from the text of /proc/meminfo.
fn mem_total_mb(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024).filter(|&mb| mb > 0)
}

/// A running executor.
pub struct ExecNode {
    shutdown: watch::Sender<bool>,
    driver: crate::rt::Joiner<Result<(), exec_driver::ExecDriverError>>,
}

/// Opens the store (a new one gets a random epoch, E1), kills leftovers of the previous
/// process (E9) and starts the driver, which dials the mill.
pub fn start_executor(
    opts: ExecOptions,
    clock: Clock,
    runtime: tokio::runtime::Handle,
) -> Result<ExecNode, NodeError> {
    let node_id = NodeId::new(opts.node_id.clone())
        .map_err(|e| NodeError::Config(format!("--node-id: {e}")))?;
    let (name, seats) = parse_engine(&opts.engine)?;
    // DESIGN §10: `--mill a:7071,b:7071` — every mill that may lead, tried in order.
    let mill_addrs: Vec<String> = opts
        .mill
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(str::to_string)
        .collect();
    if mill_addrs.is_empty() {
        return Err(NodeError::Config(format!(
            "--mill {:?}: give one or more host:port addresses, comma separated",
            opts.mill
        )));
    }
    let mills = mill_addrs
        .iter()
        .map(|m| Ok((m.clone(), opts.tls.as_ref().map(|f| f.load(m)).transpose()?)))
        .collect::<Result<Vec<_>, NodeError>>()?;
    let tls = mills.first().and_then(|(_, t)| t.clone());
    std::fs::create_dir_all(&opts.data)
        .map_err(io(format!("data directory {}", opts.data.display())))?;
    warn_if_dir_open(&opts.data);
    let (store, snapshot) = ExecStore::open(&opts.data)?;
    let loopback_mill = mill_addrs.iter().all(|m| {
        m.parse::<SocketAddr>()
            .map(|a| a.ip().is_loopback())
            .unwrap_or_else(|_| m.starts_with("localhost:"))
    });
    if tls.is_none() && !loopback_mill {
        tracing::warn!(mill = %opts.mill, "!!! connecting to a non-loopback mill WITHOUT TLS: the token and all traffic cross the network in clear text. !!!");
        eprintln!("WARNING: millrace executor talks to {} without TLS; traffic and the token are in clear text.", opts.mill);
    }
    if !snapshot.jobs.is_empty() {
        tracing::info!(
            jobs = snapshot.jobs.len(),
            "re-attaching to the jobs of the previous process through their supervisors (E9, E14)"
        );
    }
    let known: std::collections::BTreeSet<_> = snapshot.jobs.keys().copied().collect();
    let runtime_dir = opts.tuning.runtime_dir.as_deref();
    #[cfg(not(madsim))]
    crate::shell::check_runtime_dir(&opts.data, runtime_dir).map_err(NodeError::Config)?;
    Engine::sweep_foreign(
        &opts.data,
        runtime_dir,
        snapshot.epoch,
        &known,
        opts.tuning.stop_grace,
    );
    let mut config = ExecutorConfig::new(node_id.clone(), opts.token.clone());
    config.mills = mill_addrs.clone();
    config.labels = opts
        .labels
        .iter()
        .filter(|l| !l.is_empty())
        .cloned()
        .collect();
    let resources = opts
        .tuning
        .resources
        .clone()
        .unwrap_or_else(machine_resources);
    tracing::info!(node = %node_id, engine = %name, seats, resources = ?resources, "engine resources (M34, --resources)");
    config.engines = [(
        name,
        EngineConfig {
            capacity: seats,
            resources,
        },
    )]
    .into_iter()
    .collect();
    config.snapshot_interval = opts.timing.snapshot_interval;
    config.silence_timeout = opts.timing.silence_timeout;
    config.reconnect_grace = opts.timing.reconnect_grace;
    config.backoff_min = opts.tuning.backoff_min;
    config.backoff_max = opts.tuning.backoff_max;
    config.stop_grace = opts.tuning.stop_grace;
    config.live_log_budget = opts.tuning.live_log_budget;
    config.backoff_seed = crate::sqlite::random_u64().unwrap_or(0);
    config.outbox_capacity = config.outbox_capacity.max(
        usize::try_from(seats)
            .unwrap_or(usize::MAX)
            .saturating_mul(2),
    );
    let run_as = match &opts.tuning.run_as {
        Some(user) => Some(crate::supervisor::RunAs::resolve(user).map_err(NodeError::Config)?),
        None => None,
    };
    match &run_as {
        Some(r) => {
            tracing::info!(node = %node_id, user = %r.user, uid = r.uid, gid = r.gid, "jobs run as an unprivileged user (--run-as)");
        }
        None if nix::unistd::geteuid().is_root() => {
            tracing::warn!(node = %node_id, "the executor runs as root and so do its jobs: a job can read the executor's credential and store; use --run-as USER");
        }
        None => {}
    }
    let epoch = snapshot.epoch;
    let last_contact = snapshot.last_contact;
    let executor = Executor::try_new(config, snapshot, clock.now())
        .map_err(|e| NodeError::Config(e.to_string()))?;
    // A mill's Welcome replaced the timer flags before (M1, E12): run on its timers.
    let timers = executor.timers();
    if timers != executor.config().session_timers() {
        tracing::info!(
            node = %node_id,
            silence_timeout = ?timers.silence_timeout,
            snapshot_interval = ?timers.snapshot_interval,
            reconnect_grace = ?timers.reconnect_grace,
            "running on the timers of the mill that last welcomed this executor, not on the timer flags"
        );
    }
    let (tx, rx) = mpsc::channel(exec_driver::CMD_QUEUE);
    let engine = Engine::new(
        EngineSettings {
            data: opts.data.clone(),
            epoch,
            reconnect_grace: timers.reconnect_grace,
            stop_grace: opts.tuning.stop_grace,
            hard_cap: opts.tuning.job_hard_cap,
            run_as,
            runtime: opts.tuning.runtime_dir.clone(),
        },
        tx.clone(),
        runtime.clone(),
    )
    .map_err(io(format!("executor data {}", opts.data.display())))?;
    // Adopted jobs' supervisors hear the durable last contact at once (E12, E14).
    let mut engine = engine;
    if let Some(at) = last_contact {
        engine.contact(at.as_micros() / 1000);
    }
    let (shutdown, shutdown_rx) = watch::channel(false);
    let driver = exec_driver::spawn(
        ExecDriverParts {
            executor,
            store,
            clock,
            mills,
            engine,
            drain_timeout: opts.tuning.drain_timeout,
            runtime,
        },
        tx,
        rx,
        shutdown_rx,
    )
    .map_err(io("executor driver thread"))?;
    tracing::info!(
        node = %node_id,
        %epoch,
        mill = %opts.mill,
        seats,
        data = %opts.data.display(),
        tls = tls.is_some(),
        tls_server_name = tls.as_ref().map(|t| t.server_name.to_str().into_owned()),
        "executor started"
    );
    Ok(ExecNode { shutdown, driver })
}

impl ExecNode {
    /// Drains (no new seats; running jobs finish and the outbox is acked, up to the drain
    /// timeout), then closes the store.
    pub async fn stop(self) -> Result<(), NodeError> {
        let _ = self.shutdown.send(true);
        let driver = self.driver;
        let r = driver.wait().await;
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(NodeError::Driver(e.to_string())),
            Err(_) => Err(NodeError::Driver("the executor driver panicked".into())),
        }
    }

    /// Whether the driver has stopped.
    pub fn finished(&self) -> bool {
        self.driver.is_finished()
    }
}

/// Waits for SIGINT or SIGTERM.
pub async fn signalled() {
    #[cfg(madsim)]
    let term = std::future::pending::<()>();
    #[cfg(not(madsim))]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// M34: the default `memory_mb` comes from MemTotal; an unreadable line limits nothing.
    #[test]
    fn m34_machine_memory_is_read_from_meminfo() {
        let text = "MemTotal:        8043772 kB\nMemFree:  1 kB\n";
        assert_eq!(mem_total_mb(text), Some(7855));
        assert_eq!(mem_total_mb("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total_mb("MemTotal: lots\n"), None);
        let here = machine_resources();
        assert!(here.get("cpu").is_some_and(|&c| c >= 1), "{here:?}");
    }
}
