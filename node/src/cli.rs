//! Command-line interface: every setting is a flag and a `MILLRACE_*` environment variable.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use millrace_core::executor::{SEAT_LOAD, SEAT_RESOURCE};
use millrace_core::types::{validate_resources, Resources};

use crate::clock::parse_duration;

/// millrace: a CI job scheduler that keeps its promises while the fleet misbehaves.
#[derive(Debug, Parser)]
#[command(name = "millrace", version, about, long_about = None)]
pub struct Cli {
    /// Log format on stderr (filter with RUST_LOG, default `info`).
    #[arg(long, global = true, env = "MILLRACE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Pretty)]
    pub log_format: LogFormat,
    /// What to run.
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Log formats.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable lines.
    Pretty,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Run the coordinator: executor listener, HTTP API, SQLite store.
    Mill(MillArgs),
    /// Run an executor that takes jobs from a mill.
    Executor(ExecutorArgs),
    /// A mill and one local executor in one process, on loopback (the one-machine default).
    Standalone(StandaloneArgs),
    /// Run N shell jobs on a throwaway standalone mill with E executors and summarise.
    Demo(DemoArgs),
    /// Submit a job: `millrace submit [--wait] -- COMMAND…`.
    Submit(SubmitArgs),
    /// Show a job.
    Status(JobArgs),
    /// Cancel a job.
    Cancel(JobArgs),
    /// List jobs.
    Jobs(JobsArgs),
    /// Print a job's output: `millrace logs [-f] JOB` (E15: lost bytes show as a marker line).
    Logs(LogsArgs),
    /// List executors.
    Nodes(ClientArgs),
    /// Show quota: the limits in force, usage per owner and repo, and the jobs waiting for
    /// quota with what holds each up.
    Quota(QuotaArgs),
    /// Manage quarantined executors.
    Quarantine {
        /// What to do.
        #[command(subcommand)]
        cmd: QuarantineCmd,
    },
    /// Open many fake executor sessions against a mill (benchmarks).
    #[command(hide = true)]
    Loadgen(LoadgenArgs),
    /// Submit→committed latency and placement throughput on loopback (benchmarks).
    #[command(hide = true)]
    Bench(BenchArgs),
    /// Print a shell completion script:
    /// `millrace completions bash > /usr/share/bash-completion/completions/millrace`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff): `millrace man > millrace.1; man ./millrace.1`.
    Man,
    /// Print the HTTP API's OpenAPI 3.1 document (what `GET /v1/openapi.json` serves):
    /// `millrace openapi > docs/openapi.json`.
    Openapi,
}

/// Writes the completion script for `shell` (generated from the CLI's own definition, so it
/// lists every subcommand and flag this build has).
pub fn completions(shell: clap_complete::Shell, out: &mut dyn std::io::Write) {
    let mut cmd = <Cli as clap::CommandFactory>::command();
    clap_complete::generate(shell, &mut cmd, "millrace", out);
}

/// Writes the man page, generated from the CLI's own definition.
pub fn man(out: &mut dyn std::io::Write) -> std::io::Result<()> {
    clap_mangen::Man::new(<Cli as clap::CommandFactory>::command()).render(out)
}

/// Quarantine subcommands.
#[derive(Debug, Subcommand)]
pub enum QuarantineCmd {
    /// Let a quarantined executor connect again.
    Lift {
        /// The node id.
        node: String,
        /// Server and token.
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// `NAME=VALUE` for `--env`; the error names the variable, never its value.
fn env_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.to_string(), value.to_string())),
        _ => Err("expected NAME=VALUE".to_string()),
    }
}

/// `NAME=AMOUNT` for `--resource`.
fn resource_pair(s: &str) -> Result<(String, u64), String> {
    let (name, amount) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAME=AMOUNT, e.g. cpu=4"))?;
    let name = name.trim();
    let amount: u64 = amount
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: the amount of {name:?} must be a whole number, e.g. cpu=4"))?;
    let one: Resources = [(name.to_string(), amount)].into_iter().collect();
    validate_resources(&one).map_err(|e| format!("{s:?}: {e}"))?;
    Ok((name.to_string(), amount))
}

/// `NAME=AMOUNT,…` (or `none`) for `--resources`: names valid and distinct, amounts
/// positive, `jobs` and `seats` reserved (they are the seats themselves).
pub fn resource_list(s: &str) -> Result<Resources, String> {
    let mut out = Resources::new();
    if s.trim() == "none" {
        return Ok(out);
    }
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, amount) = resource_pair(part)?;
        if name == SEAT_RESOURCE || name == SEAT_LOAD {
            return Err(format!(
                "{name:?} is reserved (it is the seats; set them with --engine shell:N)"
            ));
        }
        if out.insert(name.clone(), amount).is_some() {
            return Err(format!("{name:?} is given twice"));
        }
    }
    if out.is_empty() {
        return Err("expected NAME=AMOUNT,… (e.g. cpu=64,memory_mb=131072) or none".into());
    }
    validate_resources(&out).map_err(|e| e.to_string())?;
    Ok(out)
}

fn dur(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

/// A byte size: a number, optionally with `KiB`, `MiB` or `GiB` (also `K`, `M`, `G`).
pub fn size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a number of bytes, e.g. 65536 or 1MiB"))?;
    let mult: usize = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use KiB, MiB or GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?}: too large"))
}

/// The default data directory: `$XDG_DATA_HOME/millrace` or `~/.local/share/millrace`.
pub fn default_data_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("millrace");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h).join(".local/share/millrace");
    }
    PathBuf::from(".millrace")
}

/// Timers both sides must agree on.
#[derive(Debug, Clone, Args)]
pub struct Timing {
    /// How long a disconnected executor's leases survive (M4, M5); also its self-fencing delay (E12).
    #[arg(long, env = "MILLRACE_RECONNECT_GRACE", default_value = "45s", value_parser = dur, help_heading = "Advanced")]
    pub reconnect_grace: Duration,
    /// No message for this long closes a session (M9).
    #[arg(long, env = "MILLRACE_SILENCE_TIMEOUT", default_value = "15s", value_parser = dur, help_heading = "Advanced")]
    pub silence_timeout: Duration,
    /// Executors snapshot at least this often; below silence_timeout / 2 (M9, E10).
    #[arg(long, env = "MILLRACE_SNAPSHOT_INTERVAL", default_value = "5s", value_parser = dur, help_heading = "Advanced")]
    pub snapshot_interval: Duration,
}

/// Mill-only settings.
#[derive(Debug, Clone, Args)]
pub struct MillTuning {
    /// How long one bid ask or commit attempt may take (M12, M17).
    #[arg(long, env = "MILLRACE_BID_TIMEOUT", default_value = "5s", value_parser = dur, help_heading = "Advanced")]
    pub bid_timeout: Duration,
    /// Executors asked in parallel per placement (M12).
    #[arg(
        long,
        env = "MILLRACE_TOP_K",
        default_value_t = 3,
        help_heading = "Advanced"
    )]
    pub top_k: usize,
    /// Place a job on the best executor with a free seat without a bid: publish its lease
    /// at once and send the reservation and the commit together (M35). `false`: always bid.
    #[arg(
        long,
        env = "MILLRACE_DIRECT_PLACEMENT",
        default_value_t = true,
        action = clap::ArgAction::Set,
        help_heading = "Advanced"
    )]
    pub direct_placement: bool,
    /// Late binding (M36): a job that finds no free seat waits on a full executor for its
    /// next free seat, and is taken back if a seat frees elsewhere first. Needs direct
    /// placement.
    #[arg(
        long,
        env = "MILLRACE_LATE_BINDING",
        default_value_t = true,
        action = clap::ArgAction::Set,
        help_heading = "Advanced"
    )]
    pub late_binding: bool,
    /// Most jobs waiting for placement; beyond it submits get 503 (M10).
    #[arg(
        long,
        env = "MILLRACE_MAX_PENDING",
        default_value_t = 10_000,
        help_heading = "Advanced"
    )]
    pub max_pending: usize,
    /// How long an executor has to ack a cancel (M26).
    #[arg(long, env = "MILLRACE_CANCEL_ACK_TIMEOUT", default_value = "10s", value_parser = dur, help_heading = "Advanced")]
    pub cancel_ack_timeout: Duration,
    /// How long an acked cancel may take to end the job (M26).
    #[arg(long, env = "MILLRACE_CANCEL_TEARDOWN_TIMEOUT", default_value = "10m", value_parser = dur, help_heading = "Advanced")]
    pub cancel_teardown_timeout: Duration,
    /// Default job timeout (M18).
    #[arg(long, env = "MILLRACE_JOB_TIMEOUT", default_value = "24h", value_parser = dur, help_heading = "Advanced")]
    pub job_timeout: Duration,
    /// A job no executor has taken this long after its submission ends failed, with why
    /// (for example "no executor offers engine docker").
    #[arg(long, env = "MILLRACE_QUEUE_TIMEOUT", default_value = "24h", value_parser = dur, help_heading = "Advanced")]
    pub queue_timeout: Duration,
    /// M32: after an executor is lost, a retry of its job waits `--reconnect-grace` (the
    /// executor fences itself off by then, E12) plus this, for the fenced run to stop.
    /// Must cover every executor's `--stop-grace`: an executor with a longer one is refused.
    #[arg(long, env = "MILLRACE_RETRY_FENCE", default_value = "30s", value_parser = dur, help_heading = "Advanced")]
    pub retry_fence: Duration,
    /// Violation closures in a row that quarantine an executor (M28).
    #[arg(
        long,
        env = "MILLRACE_QUARANTINE_STRIKES",
        default_value_t = 3,
        help_heading = "Advanced"
    )]
    pub quarantine_strikes: u32,
    /// Most executor sessions at once.
    #[arg(
        long,
        env = "MILLRACE_MAX_SESSIONS",
        default_value_t = 10_000,
        help_heading = "Advanced"
    )]
    pub max_sessions: usize,
    /// How long a new executor connection has to send its Hello before it is closed.
    #[arg(long, env = "MILLRACE_HELLO_TIMEOUT", default_value = "5s", value_parser = dur, help_heading = "Advanced")]
    pub hello_timeout: Duration,
    /// Executor connections waiting for their Hello at once, counted apart from sessions;
    /// when full, the oldest waiting one is closed.
    #[arg(
        long,
        env = "MILLRACE_MAX_PREAUTH_CONNECTIONS",
        default_value_t = 512,
        help_heading = "Advanced"
    )]
    pub max_preauth_connections: usize,
    /// An HTTP request head must arrive within this (also closes idle keep-alive connections).
    #[arg(long, env = "MILLRACE_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = dur, help_heading = "Advanced")]
    pub http_header_timeout: Duration,
    /// An HTTP request body must arrive within this.
    #[arg(long, env = "MILLRACE_HTTP_BODY_TIMEOUT", default_value = "30s", value_parser = dur, help_heading = "Advanced")]
    pub http_body_timeout: Duration,
    /// HTTP connections served at once; more wait in the listen backlog.
    #[arg(
        long,
        env = "MILLRACE_HTTP_MAX_CONNECTIONS",
        default_value_t = 1024,
        help_heading = "Advanced"
    )]
    pub http_max_connections: usize,
    /// How long a web UI login lasts (`/ui`; Log out ends it sooner).
    #[arg(long, env = "MILLRACE_UI_SESSION_TTL", default_value = "12h", value_parser = dur, help_heading = "Advanced")]
    pub ui_session_ttl: Duration,
    /// Web UI sessions held at once; a login past it ends the oldest.
    #[arg(
        long,
        env = "MILLRACE_UI_MAX_SESSIONS",
        default_value_t = 256,
        help_heading = "Advanced"
    )]
    pub ui_max_sessions: usize,
    /// The longest timeout a job may ask for (`timeout_secs`); longer ones get 400.
    #[arg(long, env = "MILLRACE_MAX_JOB_TIMEOUT", default_value = "168h", value_parser = dur, help_heading = "Advanced")]
    pub max_job_timeout: Duration,
    /// Finished jobs older than this (since they ended) are deleted with their status
    /// history and log, a small batch at a time: e.g. 30d, 12h, 90s. Unfinished jobs are
    /// never deleted.
    #[arg(long, env = "MILLRACE_RETENTION", default_value = "30d", value_parser = dur)]
    pub retention: Duration,
    /// Also keep at most this many finished jobs: the longest finished go first. Unset: no
    /// limit by count, only by age (--retention).
    #[arg(long, env = "MILLRACE_RETENTION_COUNT")]
    pub retention_count: Option<u64>,
    /// Live output the mill holds per running job for cursor reads (E15); older bytes are
    /// evicted and a reader below them gets an explicit gap. The stored log is not affected.
    /// Bytes, or with KiB/MiB/GiB.
    #[arg(long, env = "MILLRACE_LIVE_LOG_PER_JOB", default_value = "1MiB", value_parser = size, help_heading = "Advanced")]
    pub live_log_per_job: usize,
    /// Live output the mill holds across all jobs (E15); beyond it the oldest chunk of any
    /// job is evicted first.
    #[arg(long, env = "MILLRACE_LIVE_LOG_TOTAL", default_value = "64MiB", value_parser = size, help_heading = "Advanced")]
    pub live_log_total: usize,
}

impl MillTuning {
    /// Refuses settings that cannot work, naming the flag and the value.
    pub fn validate(&self) -> Result<(), String> {
        if self.hello_timeout.is_zero() {
            return Err(format!(
                "--hello-timeout {:?}: must be above zero",
                self.hello_timeout
            ));
        }
        if self.max_preauth_connections == 0 {
            return Err(format!(
                "--max-preauth-connections {}: must be at least 1",
                self.max_preauth_connections
            ));
        }
        for (flag, d) in [
            ("--queue-timeout", self.queue_timeout),
            ("--retry-fence", self.retry_fence),
            ("--http-header-timeout", self.http_header_timeout),
            ("--http-body-timeout", self.http_body_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{flag} {d:?}: must be above zero"));
            }
        }
        if self.job_timeout > self.max_job_timeout {
            return Err(format!(
                "--job-timeout {:?} exceeds --max-job-timeout {:?}",
                self.job_timeout, self.max_job_timeout
            ));
        }
        if self.retention < Duration::from_secs(1) {
            return Err(format!(
                "--retention {}ms: must be at least 1s",
                self.retention.as_millis()
            ));
        }
        if self.retention_count == Some(0) {
            return Err(
                "--retention-count 0: must be at least 1 (leave it unset for no limit by count)"
                    .to_string(),
            );
        }
        if self.http_max_connections == 0 {
            return Err(format!(
                "--http-max-connections {}: must be at least 1",
                self.http_max_connections
            ));
        }
        if self.ui_max_sessions == 0 {
            return Err("--ui-max-sessions 0: must be at least 1".to_string());
        }
        if self.ui_session_ttl < Duration::from_secs(60) {
            return Err(format!(
                "--ui-session-ttl {}s: must be at least 1m",
                self.ui_session_ttl.as_secs()
            ));
        }
        if self.live_log_per_job == 0 || self.live_log_per_job > self.live_log_total {
            return Err(format!(
                "--live-log-per-job {}: must be 1 byte to --live-log-total ({})",
                self.live_log_per_job, self.live_log_total
            ));
        }
        Ok(())
    }
}

impl Default for MillTuning {
    /// The same defaults as the flags (a test keeps the two equal).
    fn default() -> Self {
        MillTuning {
            bid_timeout: Duration::from_secs(5),
            top_k: 3,
            direct_placement: true,
            late_binding: true,
            max_pending: 10_000,
            cancel_ack_timeout: Duration::from_secs(10),
            cancel_teardown_timeout: Duration::from_secs(600),
            job_timeout: Duration::from_secs(86_400),
            queue_timeout: Duration::from_secs(86_400),
            retry_fence: Duration::from_secs(30),
            quarantine_strikes: 3,
            max_sessions: 10_000,
            hello_timeout: Duration::from_secs(5),
            max_preauth_connections: 512,
            http_header_timeout: Duration::from_secs(10),
            http_body_timeout: Duration::from_secs(30),
            http_max_connections: 1024,
            ui_session_ttl: crate::ui::DEFAULT_SESSION_TTL,
            ui_max_sessions: crate::ui::DEFAULT_MAX_SESSIONS,
            max_job_timeout: Duration::from_secs(7 * 86_400),
            retention: Duration::from_secs(30 * 86_400),
            retention_count: None,
            live_log_per_job: crate::live::DEFAULT_PER_JOB,
            live_log_total: crate::live::DEFAULT_TOTAL,
        }
    }
}

/// Executor-only settings.
#[derive(Debug, Clone, Args)]
pub struct ExecTuning {
    /// First reconnect delay (E11).
    #[arg(long, env = "MILLRACE_BACKOFF_MIN", default_value = "100ms", value_parser = dur, help_heading = "Advanced")]
    pub backoff_min: Duration,
    /// Largest reconnect delay (E11); below reconnect_grace.
    #[arg(long, env = "MILLRACE_BACKOFF_MAX", default_value = "10s", value_parser = dur, help_heading = "Advanced")]
    pub backoff_max: Duration,
    /// Time between SIGTERM and SIGKILL when a job is stopped.
    #[arg(long, env = "MILLRACE_STOP_GRACE", default_value = "10s", value_parser = dur, help_heading = "Advanced")]
    pub stop_grace: Duration,
    /// At shutdown, how long to wait for running jobs and the outbox.
    #[arg(long, env = "MILLRACE_DRAIN_TIMEOUT", default_value = "30s", value_parser = dur)]
    pub drain_timeout: Duration,
    /// Kill a job that runs longer than this on this executor, whatever the mill says (off by default).
    #[arg(long, env = "MILLRACE_JOB_HARD_CAP", value_parser = dur, help_heading = "Advanced")]
    pub job_hard_cap: Option<Duration>,
    /// Run jobs as this unprivileged user (needs the executor to run as root): jobs then
    /// cannot read the executor's data directory, its credential or its processes.
    #[arg(long, env = "MILLRACE_RUN_AS")]
    pub run_as: Option<String>,
    /// Where each job's supervisor keeps its socket, pid file and own log (default: the data
    /// directory). A tmpfs such as /run/millrace or /dev/shm/millrace spares the data disk
    /// five files and a directory per job; an exit record no executor takes over is still
    /// made durable in the data directory. Keep it the same across restarts while jobs run.
    #[arg(long, env = "MILLRACE_RUNTIME_DIR", value_name = "DIR")]
    pub runtime_dir: Option<PathBuf>,
    /// Live output forwarded to the mill per snapshot interval, across jobs; beyond it bytes
    /// are not forwarded and readers see them as a gap (E15). The job's log on this executor
    /// is whole either way. 0 turns live output off.
    #[arg(long, env = "MILLRACE_LIVE_LOG_BUDGET", default_value = "1MiB", value_parser = size, help_heading = "Advanced")]
    pub live_log_budget: usize,
    /// What this executor has in all, shared by its seats, as `NAME=AMOUNT,…` (M34, E2): a
    /// job is accepted only while the resources it asks for fit what its running jobs leave
    /// free, and one asking for more than the total is refused as incompatible. Default: the
    /// machine's `cpu` (CPUs) and `memory_mb`. Giving it replaces the defaults; `none`
    /// limits nothing. A resource not named here is not limited on this executor.
    #[arg(long, env = "MILLRACE_RESOURCES", value_name = "NAME=AMOUNT,…", value_parser = resource_list)]
    pub resources: Option<Resources>,
}

/// `millrace mill`.
#[derive(Debug, Clone, Args)]
pub struct MillArgs {
    /// Data directory (SQLite store, job logs, token).
    #[arg(long, env = "MILLRACE_DATA", default_value_os_t = default_data_dir())]
    pub data: PathBuf,
    /// Where the mill's durable state lives: `sqlite:DIR` (default: the --data directory)
    /// or `postgres://USER[:PASSWORD]@HOST[:PORT]/DB`, a database of its own that several
    /// mills may share (one leads, DESIGN §10). Job logs and credentials stay in --data.
    #[arg(
        long,
        env = "MILLRACE_STORE",
        value_name = "URL",
        hide_env_values = true
    )]
    pub store: Option<String>,
    /// The mill's config file (TOML): quota limits per owner and repo (`[quota.defaults.owner]`,
    /// `[quota.owner."alice"]`, …; see README "Quota"). Checked at start: a bad file stops the
    /// mill before it listens, naming the key and the value.
    #[arg(long, env = "MILLRACE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where executors connect.
    #[arg(
        long,
        env = "MILLRACE_EXECUTOR_LISTEN",
        default_value = "127.0.0.1:7071"
    )]
    pub executor_listen: String,
    /// Where the HTTP API listens.
    #[arg(long, env = "MILLRACE_HTTP_LISTEN", default_value = "127.0.0.1:7070")]
    pub http_listen: String,
    /// The executor credential (copy it to executor hosts); default DATA/token, made on first start.
    #[arg(long, env = "MILLRACE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// The API credential (submit, cancel, lift); default DATA/api-token, made on first start.
    /// Executors' credential is refused on the API.
    #[arg(long, env = "MILLRACE_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
    /// TLS: the mill's certificate chain (PEM, leaf first), served on the executor port and
    /// the HTTP API alike. Needs --tls-key.
    #[arg(
        long,
        env = "MILLRACE_TLS_CERT",
        requires = "tls_key",
        help_heading = "TLS"
    )]
    pub tls_cert: Option<PathBuf>,
    /// TLS: the private key of --tls-cert (PEM).
    #[arg(
        long,
        env = "MILLRACE_TLS_KEY",
        requires = "tls_cert",
        help_heading = "TLS"
    )]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS on the executor port: executors must present a certificate signed by this
    /// CA (PEM) whose DNS subject alternative name is their node id.
    #[arg(
        long,
        env = "MILLRACE_TLS_CLIENT_CA",
        requires = "tls_cert",
        help_heading = "TLS"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// High availability (a PostgreSQL --store): how long a won or renewed leadership lasts by
    /// the database's clock. The leader renews every third of it and steps down after 90 %
    /// without a renewal; a standby campaigns every third of it. A leader killed without
    /// resigning is replaced within about one lease.
    #[arg(long, env = "MILLRACE_LEADER_LEASE", default_value = "15s", value_parser = dur, help_heading = "High availability")]
    pub leader_lease: Duration,
    /// High availability: the executor address (host:port) written into the leader row, which
    /// standbys tell executors; it must be one of the executors' --mill addresses. Default:
    /// the bound --executor-listen address.
    #[arg(
        long,
        env = "MILLRACE_ADVERTISE_EXECUTOR",
        value_name = "HOST:PORT",
        help_heading = "High availability"
    )]
    pub advertise_executor: Option<String>,
    /// High availability: the HTTP address (host:port) written into the leader row, which
    /// standbys name in their 503 answers. Default: the bound --http-listen address.
    #[arg(
        long,
        env = "MILLRACE_ADVERTISE_HTTP",
        value_name = "HOST:PORT",
        help_heading = "High availability"
    )]
    pub advertise_http: Option<String>,
    /// Timers.
    #[command(flatten)]
    pub timing: Timing,
    /// Mill settings.
    #[command(flatten)]
    pub tuning: MillTuning,
}

/// `millrace executor`.
#[derive(Debug, Clone, Args)]
pub struct ExecutorArgs {
    /// The mills' executor addresses (host:port), comma separated: every mill that may lead,
    /// tried in order; a standby's redirect to one of them is followed (DESIGN §10).
    #[arg(long, env = "MILLRACE_MILL", default_value = "127.0.0.1:7071")]
    pub mill: String,
    /// This executor's name: 1-128 of A-Z a-z 0-9 . _ -
    #[arg(long, env = "MILLRACE_NODE_ID")]
    pub node_id: String,
    /// Labels this executor holds, comma separated.
    #[arg(long, env = "MILLRACE_LABELS", value_delimiter = ',')]
    pub labels: Vec<String>,
    /// Engine and seats: `shell` (one seat per CPU) or `shell:N`.
    #[arg(long, env = "MILLRACE_ENGINE", default_value = "shell")]
    pub engine: String,
    /// Data directory (outbox store, logs, job working directories).
    #[arg(long, env = "MILLRACE_DATA")]
    pub data: PathBuf,
    /// File holding the mill's token (else MILLRACE_TOKEN).
    #[arg(long, env = "MILLRACE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// TLS: dial the mill over TLS, trusting this CA (PEM) for the mill's certificate.
    #[arg(long, env = "MILLRACE_TLS_CA", help_heading = "TLS")]
    pub tls_ca: Option<PathBuf>,
    /// TLS: the name the mill's certificate must carry (default: the host of --mill).
    #[arg(
        long,
        env = "MILLRACE_TLS_SERVER_NAME",
        requires = "tls_ca",
        help_heading = "TLS"
    )]
    pub tls_server_name: Option<String>,
    /// Mutual TLS: this executor's certificate (PEM), naming its node id as a DNS subject
    /// alternative name. Needs --tls-key and --tls-ca.
    #[arg(
        long,
        env = "MILLRACE_TLS_CERT",
        requires_all = ["tls_key", "tls_ca"],
        help_heading = "TLS"
    )]
    pub tls_cert: Option<PathBuf>,
    /// Mutual TLS: the private key of --tls-cert (PEM).
    #[arg(
        long,
        env = "MILLRACE_TLS_KEY",
        requires = "tls_cert",
        help_heading = "TLS"
    )]
    pub tls_key: Option<PathBuf>,
    /// Timers until the mill's `Welcome` hands over its own, which the executor adopts.
    #[command(flatten)]
    pub timing: Timing,
    /// Executor settings.
    #[command(flatten)]
    pub tuning: ExecTuning,
}

/// `millrace standalone`.
#[derive(Debug, Clone, Args)]
pub struct StandaloneArgs {
    /// Data directory (mill store, credentials, the local executor's store under executor/).
    #[arg(long, env = "MILLRACE_DATA", default_value_os_t = default_data_dir())]
    pub data: PathBuf,
    /// The mill's config file (TOML): quota limits per owner and repo (`[quota.defaults.owner]`,
    /// `[quota.owner."alice"]`, …; see README "Quota"). Checked at start: a bad file stops the
    /// mill before it listens, naming the key and the value.
    #[arg(long, env = "MILLRACE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where the HTTP API listens.
    #[arg(long, env = "MILLRACE_HTTP_LISTEN", default_value = "127.0.0.1:7070")]
    pub http_listen: String,
    /// Where executors connect (the local one, and any others).
    #[arg(
        long,
        env = "MILLRACE_EXECUTOR_LISTEN",
        default_value = "127.0.0.1:7071"
    )]
    pub executor_listen: String,
    /// The local executor's name.
    #[arg(long, env = "MILLRACE_NODE_ID", default_value = "local")]
    pub node_id: String,
    /// The local executor's labels, comma separated.
    #[arg(long, env = "MILLRACE_LABELS", value_delimiter = ',')]
    pub labels: Vec<String>,
    /// The local executor's engine and seats: `shell` (one per CPU) or `shell:N`.
    #[arg(long, env = "MILLRACE_ENGINE", default_value = "shell")]
    pub engine: String,
    /// Timers.
    #[command(flatten)]
    pub timing: Timing,
    /// Mill settings.
    #[command(flatten)]
    pub tuning: MillTuning,
    /// Executor settings.
    #[command(flatten)]
    pub exec: ExecTuning,
}

/// `millrace demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Jobs to run.
    #[arg(long, default_value_t = 200)]
    pub jobs: usize,
    /// Local executors.
    #[arg(long, default_value_t = 4)]
    pub executors: usize,
    /// Seats per executor.
    #[arg(long, default_value_t = 4)]
    pub seats: u32,
    /// Each job's shell command, instead of the demo's own (which prints where it ran and
    /// sleeps 0–90 ms); `true` measures what millrace itself costs per job.
    #[arg(long)]
    pub command: Option<String>,
    /// The executors' `--runtime-dir`: `auto` (a fresh directory on /dev/shm when it is
    /// there, else none), `none` (supervisors' files in the data directory), or a path.
    #[arg(long, default_value = "auto", value_name = "auto|none|DIR")]
    pub runtime_dir: String,
}

/// Where the API is and how to authenticate.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The mill's HTTP API.
    #[arg(long, env = "MILLRACE_SERVER", default_value = "http://127.0.0.1:7070")]
    pub server: String,
    /// File holding the API token (else MILLRACE_API_TOKEN, else DATA/api-token).
    #[arg(long, env = "MILLRACE_API_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Data directory whose API token to use when neither of the above is given.
    #[arg(long, env = "MILLRACE_DATA", default_value_os_t = default_data_dir())]
    pub data: PathBuf,
    /// Speak https, trusting this CA (PEM) for the mill's certificate (--server https://…).
    #[arg(long, env = "MILLRACE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

/// `millrace submit`.
#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    /// Engine.
    #[arg(long, default_value = "shell")]
    pub engine: String,
    /// A label the executor must hold (repeatable).
    #[arg(long = "label")]
    pub labels: Vec<String>,
    /// Job timeout (e.g. 10m); default the mill's.
    #[arg(long, value_parser = dur)]
    pub timeout: Option<Duration>,
    /// Quota owner.
    #[arg(long, default_value = "default")]
    pub owner: String,
    /// Quota repo.
    #[arg(long, default_value = "default")]
    pub repo: String,
    /// Follow the job's output and exit with the job's own exit code: 0 on success, the
    /// job's code when it failed with one, 124 when it timed out, 125 when it ended
    /// without a code of its own (cancelled, executor lost, no executor, quota) or the
    /// mill could not be asked.
    #[arg(long)]
    pub wait: bool,
    /// Idempotency key (M31): a retry with the same key and spec answers the same job
    /// instead of making a second one; the same key with another spec is refused (409).
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,
    /// An environment variable for the job, `NAME=VALUE` (repeatable; values are never
    /// printed).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = env_pair)]
    pub env: Vec<(String, String)>,
    /// Attempts after the first when an attempt ends in a way `--retry-on` names (M32);
    /// at most 20. A retry after a lost executor waits until its run is surely stopped.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub retries: u32,
    /// Which ends retry, comma-separated: executor_lost, executor_restarted,
    /// no_longer_has_job, failed (the job's own non-zero exit). Default: the first three.
    #[arg(long, value_name = "CAUSES", value_delimiter = ',', value_parser = retry_on)]
    pub retry_on: Vec<millrace_core::job::RetryOn>,
    /// Among this owner's waiting jobs, higher goes first (M33); owners still take turns.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i32,
    /// Run only on this executor (M34): the job waits for that node (until its queue
    /// timeout) and fails if the node cannot run it.
    #[arg(long, value_name = "NODE")]
    pub node: Option<String>,
    /// A resource the job needs for its whole run, `NAME=AMOUNT` (repeatable), e.g.
    /// `--resource cpu=4 --resource memory_mb=2048`: an executor runs it only while that much
    /// is free (M34), and quotas count it (Q1).
    #[arg(long = "resource", value_name = "NAME=AMOUNT", value_parser = resource_pair)]
    pub resources: Vec<(String, u64)>,
    /// Server and token.
    #[command(flatten)]
    pub client: ClientArgs,
    /// The command, run with `sh -c`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Parses one `--retry-on` cause.
fn retry_on(s: &str) -> Result<millrace_core::job::RetryOn, String> {
    millrace_core::job::RetryOn::parse(s).ok_or_else(|| {
        let names: Vec<&str> = millrace_core::job::RetryOn::ALL
            .iter()
            .map(|r| r.name())
            .collect();
        format!("unknown cause {s:?}; one of {}", names.join(", "))
    })
}

/// A command about one job.
#[derive(Debug, Clone, Args)]
pub struct JobArgs {
    /// The job id.
    pub job: String,
    /// Server and token.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `millrace logs`.
#[derive(Debug, Clone, Args)]
pub struct LogsArgs {
    /// The job id.
    pub job: String,
    /// Follow by cursor until the job is done.
    #[arg(short, long)]
    pub follow: bool,
    /// Start at this byte offset of the job's output.
    #[arg(long, default_value_t = 0)]
    pub cursor: u64,
    /// Server and token.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `millrace jobs`.
#[derive(Debug, Clone, Args)]
pub struct JobsArgs {
    /// Only jobs in this state (queued, reserved, running, success, failed, timeout, cancelled, active, done).
    #[arg(long)]
    pub state: Option<String>,
    /// At most this many (per page with --all).
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Every job: follow the list's `next` cursor page by page.
    #[arg(long)]
    pub all: bool,
    /// Server and token.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `millrace quota`.
#[derive(Debug, Clone, Args)]
pub struct QuotaArgs {
    /// At most this many entries per list (overrides, scopes, waiting jobs); 1 to 1000.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Print the API's JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Server and token.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `millrace loadgen`.
#[derive(Debug, Clone, Args)]
pub struct LoadgenArgs {
    /// The mill's executor address.
    #[arg(long, default_value = "127.0.0.1:7071")]
    pub mill: String,
    /// Fake executor sessions.
    #[arg(long, default_value_t = 1000)]
    pub executors: usize,
    /// Seats per fake executor.
    #[arg(long, default_value_t = 4)]
    pub seats: u32,
    /// Token file.
    #[arg(long)]
    pub token_file: PathBuf,
    /// Snapshot interval of the fake executors.
    #[arg(long, default_value = "5s", value_parser = dur)]
    pub snapshot_interval: Duration,
    /// Stop after this long.
    #[arg(long, default_value = "60s", value_parser = dur)]
    pub duration: Duration,
}

/// `millrace bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Jobs to submit.
    #[arg(long, default_value_t = 20_000)]
    pub jobs: usize,
    /// Fake executors (in-process, over loopback TCP).
    #[arg(long, default_value_t = 10)]
    pub executors: usize,
    /// Seats per fake executor.
    #[arg(long, default_value_t = 64)]
    pub seats: u32,
    /// Concurrent HTTP submitters.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Submissions per second in all (0: as fast as the submitters go).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Jobs per request: 1 posts each job to `/v1/jobs`; more post them together to
    /// `/v1/jobs/batch` (at most 1,000), with `--rate` still counting jobs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub batch: u16,
    /// The mill's direct placement (M35); `false` places every job by bid (M12), for A/B runs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub direct_placement: bool,
    /// The mill's late binding (M36); `false` leaves a job with no free seat queued, for A/B
    /// runs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub late_binding: bool,
    /// The mill's store: a SQLite store on a temp dir (the default), or
    /// `postgres://USER[:PASSWORD]@HOST[:PORT]/DB` to measure the shared store (DESIGN §10);
    /// the database must be millrace's own, and no other mill may lead it.
    #[arg(long, value_name = "URL", hide_env_values = true)]
    pub store: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        tuning: MillTuning,
    }

    /// Completions and the man page come from the CLI itself: every visible subcommand and
    /// a flag of each shows up, for bash, zsh and fish (issue 18 item 4).
    #[test]
    fn completions_and_the_man_page_name_every_subcommand() {
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let mut out = Vec::new();
            completions(shell, &mut out);
            let text = String::from_utf8(out).unwrap();
            for word in [
                "mill",
                "executor",
                "standalone",
                "submit",
                "store",
                "retention",
                "reconnect-grace",
            ] {
                assert!(text.contains(word), "{shell:?} completion lacks {word}");
            }
        }
        let mut out = Vec::new();
        man(&mut out).unwrap();
        let page = String::from_utf8(out).unwrap();
        assert!(
            page.starts_with(".ie") || page.contains(".TH millrace"),
            "{}",
            &page[..200.min(page.len())]
        );
        for word in ["mill", "executor", "submit", "completions"] {
            assert!(page.contains(word), "man page lacks {word}");
        }
    }

    /// `MillTuning::default()` (used by `demo` and `bench`) is what the flags default to.
    #[test]
    fn mill_tuning_default_matches_the_flag_defaults() {
        let parsed = Wrap::try_parse_from(["millrace"]).unwrap();
        assert_eq!(
            format!("{:?}", parsed.tuning),
            format!("{:?}", MillTuning::default())
        );
    }

    /// M34: `--resources` parses a list, `none`, and names what is wrong otherwise.
    #[test]
    fn m34_resources_flag_parses_a_list_and_names_what_is_wrong() {
        let r = resource_list("cpu=64, memory_mb=131072").unwrap();
        assert_eq!(r.get("cpu"), Some(&64));
        assert_eq!(r.get("memory_mb"), Some(&131072));
        assert!(resource_list("none").unwrap().is_empty());
        for (bad, says) in [
            ("cpu", "expected NAME=AMOUNT"),
            ("cpu=x", "whole number"),
            ("cpu=-1", "whole number"),
            ("cpu=0", "cpu"),
            ("cpu=1,cpu=2", "twice"),
            ("jobs=3", "reserved"),
            ("seats=3", "reserved"),
            ("c pu=1", "c pu"),
            ("", "expected NAME=AMOUNT"),
        ] {
            let e = resource_list(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        let e = Exec::try_parse_from(["millrace", "--resources", "cpu=0"]).unwrap_err();
        assert!(e.to_string().contains("--resources"), "{e}");
    }

    #[derive(Debug, Parser)]
    struct Exec {
        #[command(flatten)]
        tuning: ExecTuning,
    }
}
