//! `millrace`: the production node. A thin tokio shell around the sans-IO core
//! (`millrace_core`): TCP transport, SQLite stores, the shell engine, the HTTP API and the
//! CLI. The shell only routes (STYLE habit 10): one driver thread per state machine feeds
//! inputs, group-commits its `Persist` outputs, then acts on the rest in order.
#![deny(unsafe_code)]
#![deny(missing_docs)]
// Under madsim (issue 16) `spawn_blocking` runs its closure as a task of the simulated node:
// the store reads it carries are short and deterministic there.
#![cfg_attr(madsim, allow(deprecated))]
// The shell engine compiles under madsim but the simulated one runs.
#![cfg_attr(madsim, allow(dead_code))]

mod cli;
mod client;
mod clock;
mod config_file;
mod demo;
mod exec_driver;
mod exec_store;
mod http;
mod live;
mod loadgen;
mod logs;
#[cfg(all(test, madsim))]
mod madsim_tests;
mod metrics;
mod mill_commit;
mod mill_driver;
mod mill_store;
mod net;
mod node;
mod openapi;
mod pg_store;
mod preauth;
mod quota_view;
mod rt;
mod shell;
#[cfg(madsim)]
mod sim_engine;
mod sqlite;
mod standby;
mod store;
mod supervisor;
mod syncs;
#[cfg(test)]
#[path = "../tests/common/pg.rs"]
mod test_pg;
mod tls;
mod ui;

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use cli::{Cli, Cmd, LogFormat, QuarantineCmd};
use clock::Clock;
use node::{ExecOptions, MillOptions};

fn init_logs(format: LogFormat, default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Pretty => builder.init(),
    }
}

fn main() -> ExitCode {
    // A job's supervisor (E14): a hidden mode, handled before the CLI parser so that it is
    // neither listed nor subject to the user-facing commands' flags.
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == supervisor::SUBCOMMAND)
    {
        if std::env::args_os()
            .nth(2)
            .is_some_and(|a| a == supervisor::ZYGOTE)
        {
            return supervisor::zygote_main();
        }
        return supervisor::main();
    }
    let cli = Cli::parse();
    let quiet = matches!(
        cli.cmd,
        Cmd::Submit(_)
            | Cmd::Status(_)
            | Cmd::Cancel(_)
            | Cmd::Jobs(_)
            | Cmd::Logs(_)
            | Cmd::Nodes(_)
            | Cmd::Quota(_)
            | Cmd::Quarantine { .. }
            | Cmd::Demo(_)
            | Cmd::Completions { .. }
            | Cmd::Man
            | Cmd::Openapi
    );
    if !quiet || std::env::var_os("RUST_LOG").is_some() {
        // A bench prints its own results; the mill's per-job lines would only cost time
        // in the measured process (issue 15).
        let default = if matches!(cli.cmd, Cmd::Bench(_)) {
            "warn"
        } else {
            "info"
        };
        init_logs(cli.log_format, default);
    }
    let client = |r: Result<(), client::ClientError>| match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("millrace: {e}");
            ExitCode::from(2)
        }
    };
    match cli.cmd {
        Cmd::Submit(a) => match client::submit(&a) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("millrace: {e}");
                // With --wait the exit code is the job's: millrace's own failures get 125
                // (docker run's convention), so they never pass for a job's exit 2.
                ExitCode::from(if a.wait { client::EXIT_MILL } else { 2 })
            }
        },
        Cmd::Status(a) => client(client::status(&a)),
        Cmd::Cancel(a) => client(client::cancel(&a)),
        Cmd::Jobs(a) => client(client::jobs(&a)),
        Cmd::Logs(a) => client(client::logs(&a)),
        Cmd::Nodes(a) => client(client::nodes(&a)),
        Cmd::Quota(a) => client(client::quota(&a)),
        Cmd::Quarantine {
            cmd: QuarantineCmd::Lift { node, client: c },
        } => client(client::lift(&node, &c)),
        Cmd::Completions { shell } => {
            cli::completions(shell, &mut std::io::stdout().lock());
            ExitCode::SUCCESS
        }
        Cmd::Man => match cli::man(&mut std::io::stdout().lock()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("millrace: writing the man page: {e}");
                ExitCode::from(2)
            }
        },
        Cmd::Openapi => {
            print!("{}", openapi::document());
            ExitCode::SUCCESS
        }
        cmd => serve(cmd),
    }
}

/// Raises the soft descriptor limit to the hard one: every connection is a descriptor, and a
/// low soft limit (1024 is common) would make `accept` fail long before the caps on
/// connections (`--max-sessions`, `--max-preauth-connections`, `--http-max-connections`)
/// are reached.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the descriptor limit"),
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "could not raise the descriptor limit")
            }
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "could not read the descriptor limit"),
    }
}

fn serve(cmd: Cmd) -> ExitCode {
    raise_fd_limit();
    // Store, logs, credentials and job directories are the operator's alone (issue 11).
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("millrace: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = rt.block_on(async move {
        match cmd {
            Cmd::Mill(a) => run_mill(a).await,
            Cmd::Executor(a) => run_executor(a).await,
            Cmd::Standalone(a) => run_standalone(a).await,
            Cmd::Demo(a) => match demo::demo(a).await {
                Ok(true) => Ok(()),
                Ok(false) => Err("some jobs did not succeed".to_string()),
                Err(e) => Err(e),
            },
            Cmd::Loadgen(a) => loadgen::loadgen(a).await,
            Cmd::Bench(a) => loadgen::bench(a).await,
            _ => Err("not a server command".to_string()),
        }
    });
    #[cfg(not(madsim))]
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "millrace stopped");
            eprintln!("millrace: {e}");
            ExitCode::from(1)
        }
    }
}

/// The `--config` file's quota limits (none without one), checked before anything is made
/// or bound: a bad file stops the start naming the key and the value.
fn quota_config(
    file: Option<&std::path::Path>,
) -> Result<millrace_core::quota::QuotaConfig, String> {
    let Some(path) = file else {
        return Ok(Default::default());
    };
    let loaded = config_file::load(path).map_err(|e| e.to_string())?;
    let q = &loaded.quota;
    tracing::info!(
        config = %path.display(),
        owner_defaults = ?q.owner_defaults,
        repo_defaults = ?q.repo_defaults,
        owner_overrides = q.owner_overrides.len(),
        repo_overrides = q.repo_overrides.len(),
        "quota limits loaded (Q1-Q3, M15)"
    );
    Ok(loaded.quota)
}

async fn run_mill(a: cli::MillArgs) -> Result<(), String> {
    let quota = quota_config(a.config.as_deref())?;
    let token = match &a.token_file {
        Some(f) => node::read_token(f),
        None => node::ensure_token(&node::executor_token_path(&a.data)),
    }
    .map_err(|e| e.to_string())?;
    let api_token = match &a.api_token_file {
        Some(f) => node::read_token(f),
        None => node::ensure_token(&node::api_token_path(&a.data)),
    }
    .map_err(|e| e.to_string())?;
    let store = a
        .store
        .as_deref()
        .map(store::StoreLocation::parse)
        .transpose()
        .map_err(|e| e.to_string())?;
    let opts = MillOptions {
        data: a.data.clone(),
        store,
        executor_listen: a.executor_listen.clone(),
        http_listen: a.http_listen.clone(),
        token,
        api_token,
        timing: a.timing.clone(),
        tuning: a.tuning.clone(),
        tls: mill_tls(&a)?,
        quota,
        ha: standby::HaSettings {
            lease: a.leader_lease,
            advertise_executor: a.advertise_executor.clone(),
            advertise_http: a.advertise_http.clone(),
        },
    };
    // On a PostgreSQL store this stands by while another mill leads (DESIGN §10).
    let Some(mill) = node::start_or_stand_by(opts, Clock::start(), node::signalled())
        .await
        .map_err(|e| e.to_string())?
    else {
        tracing::info!("stopped while standing by");
        return Ok(());
    };
    wait_or_fail(|| mill.driver_finished() || mill.stepped_down().is_some()).await;
    if let Some(why) = mill.stepped_down() {
        step_down(&why.0);
    }
    tracing::info!("shutting down: no new connections; committing and closing the store");
    let stopped = mill.stop().await.map_err(|e| e.to_string());
    if let Err(e) = &stopped {
        if e.contains("deposed:") {
            step_down(e);
        }
    }
    stopped
}

/// A leader that lost its store's leadership stops at once, exit code 3, without another
/// write or message: its supervisor restarts it as a standby (DESIGN §10).
fn step_down(why: &str) -> ! {
    tracing::error!(reason = %why, "stepped down: this mill no longer leads its store");
    eprintln!("millrace: stepped down: {why}");
    std::process::exit(3)
}

/// The mill's TLS files: none, or a certificate with its key (and maybe a client CA).
fn mill_tls(a: &cli::MillArgs) -> Result<Option<tls::MillTlsFiles>, String> {
    match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Ok(Some(tls::MillTlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: a.tls_client_ca.clone(),
        })),
        (None, None) if a.tls_client_ca.is_none() => Ok(None),
        (None, None) => Err("--tls-client-ca needs --tls-cert and --tls-key".into()),
        (Some(_), None) => Err("--tls-cert needs --tls-key".into()),
        (None, Some(_)) => Err("--tls-key needs --tls-cert".into()),
    }
}

/// The executor's TLS files: none, a CA to trust, and maybe a client certificate.
fn exec_tls(a: &cli::ExecutorArgs) -> Result<Option<tls::ExecTlsFiles>, String> {
    let client = match (&a.tls_cert, &a.tls_key) {
        (Some(c), Some(k)) => Some((c.clone(), k.clone())),
        (None, None) => None,
        (Some(_), None) => return Err("--tls-cert needs --tls-key".into()),
        (None, Some(_)) => return Err("--tls-key needs --tls-cert".into()),
    };
    match &a.tls_ca {
        Some(ca) => Ok(Some(tls::ExecTlsFiles {
            ca: ca.clone(),
            client,
            server_name: a.tls_server_name.clone(),
        })),
        None if client.is_some() => {
            Err("--tls-cert needs --tls-ca (the CA of the mill's certificate)".into())
        }
        None if a.tls_server_name.is_some() => Err("--tls-server-name needs --tls-ca".into()),
        None => Ok(None),
    }
}

/// Waits for a signal, or for a driver that stopped by itself (a failed commit).
async fn wait_or_fail(finished: impl Fn() -> bool) {
    let watch = async {
        loop {
            if finished() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    };
    tokio::select! {
        biased;
        () = node::signalled() => {}
        () = watch => {}
    }
}

async fn run_executor(a: cli::ExecutorArgs) -> Result<(), String> {
    let token = match &a.token_file {
        Some(f) => node::read_token(f).map_err(|e| e.to_string())?,
        None => std::env::var("MILLRACE_TOKEN")
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .ok_or("an executor needs the mill's token: --token-file F or MILLRACE_TOKEN")?,
    };
    let exec = node::start_executor(
        ExecOptions {
            mill: a.mill.clone(),
            node_id: a.node_id.clone(),
            labels: a.labels.clone(),
            engine: a.engine.clone(),
            data: a.data.clone(),
            token,
            timing: a.timing.clone(),
            tuning: a.tuning.clone(),
            tls: exec_tls(&a)?,
        },
        Clock::start(),
        tokio::runtime::Handle::current(),
    )
    .map_err(|e| e.to_string())?;
    wait_or_fail(|| exec.finished()).await;
    tracing::info!("shutting down: draining");
    exec.stop().await.map_err(|e| e.to_string())
}

async fn run_standalone(a: cli::StandaloneArgs) -> Result<(), String> {
    if std::env::var_os("MILLRACE_STORE")
        .is_some_and(|s| !s.to_string_lossy().starts_with("sqlite:"))
    {
        return Err("MILLRACE_STORE is set, but standalone keeps its store in SQLite under --data; run `millrace mill --store postgres://…` and an executor instead".into());
    }
    let quota = quota_config(a.config.as_deref())?;
    let token =
        node::ensure_token(&node::executor_token_path(&a.data)).map_err(|e| e.to_string())?;
    let api_token =
        node::ensure_token(&node::api_token_path(&a.data)).map_err(|e| e.to_string())?;
    let clock = Clock::start();
    let mill = node::start_mill(
        MillOptions {
            data: a.data.clone(),
            store: None,
            executor_listen: a.executor_listen.clone(),
            http_listen: a.http_listen.clone(),
            token: token.clone(),
            api_token,
            timing: a.timing.clone(),
            tuning: a.tuning.clone(),
            // Standalone listens on loopback by default; TLS is for `mill` across machines.
            tls: None,
            quota,
            ha: Default::default(),
        },
        clock,
    )
    .await
    .map_err(|e| e.to_string())?;
    let exec = node::start_executor(
        ExecOptions {
            mill: mill.executor_addr.to_string(),
            node_id: a.node_id.clone(),
            labels: a.labels.clone(),
            engine: a.engine.clone(),
            data: a.data.join("executor"),
            token: token.clone(),
            timing: a.timing.clone(),
            tuning: a.exec.clone(),
            tls: None,
        },
        clock,
        tokio::runtime::Handle::current(),
    );
    let exec = match exec {
        Ok(e) => e,
        Err(e) => {
            let _ = mill.stop().await;
            return Err(e.to_string());
        }
    };
    println!(
        "millrace standalone: API on http://{}  (API token in {})",
        mill.http_addr,
        node::api_token_path(&a.data).display()
    );
    println!("try: millrace submit --wait -- echo hello");
    wait_or_fail(|| exec.finished() || mill.driver_finished()).await;
    tracing::info!("shutting down: draining the local executor, then the mill");
    let e = exec.stop().await;
    let m = mill.stop().await;
    e.map_err(|e| e.to_string())?;
    m.map_err(|e| e.to_string())
}
