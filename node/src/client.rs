//! The HTTP API's command-line clients: submit, status, cancel, jobs, nodes, quota,
//! quarantine lift.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::cli::{ClientArgs, JobArgs, JobsArgs, LogsArgs, QuotaArgs, SubmitArgs};

/// A failed client command; the message is for the user.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ClientError(pub String);

/// Resolves the API token: `--token-file`, then `MILLRACE_API_TOKEN`, then `DATA/api-token`.
/// (The executor credential, `DATA/token`, is refused by the API.)
pub fn token(args: &ClientArgs) -> Result<String, ClientError> {
    if let Some(f) = &args.token_file {
        return read(f);
    }
    if let Ok(t) = std::env::var("MILLRACE_API_TOKEN") {
        if !t.trim().is_empty() {
            return Ok(t.trim().to_string());
        }
    }
    read(&crate::node::api_token_path(&args.data))
}

fn read(path: &Path) -> Result<String, ClientError> {
    let t = std::fs::read_to_string(path).map_err(|e| {
        ClientError(format!(
            "cannot read the token from {}: {e} (use --token-file, MILLRACE_API_TOKEN or --data)",
            path.display()
        ))
    })?;
    Ok(t.trim().to_string())
}

/// How long a resolved host name is reused before it is resolved again.
const RESOLVED_FOR: Duration = Duration::from_secs(10);

/// Names to addresses for the client (issue 15). ureq's own resolver, under a request
/// timeout, starts a thread for every request to resolve the host, even an IP literal on a
/// pooled keep-alive connection: on this VM that thread cost ~0.15 ms of every submit. An
/// IP literal is its own answer here; a name is resolved by ureq's resolver (its timeout
/// thread included) and kept for [`RESOLVED_FOR`], so a client issuing many requests (the
/// CLI's `--wait` polls, `bench`, `demo`) resolves its server once in a while, not per
/// request.
#[derive(Debug, Default)]
struct Resolver {
    inner: ureq::unversioned::resolver::DefaultResolver,
    /// The last name resolved: `host:port`, when, and its addresses.
    last: std::sync::Mutex<
        Option<(
            String,
            std::time::Instant,
            ureq::unversioned::resolver::ResolvedSocketAddrs,
        )>,
    >,
}

impl ureq::unversioned::resolver::Resolver for Resolver {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let port = uri.port_u16().or_else(|| match uri.scheme_str() {
            Some("http") => Some(80),
            Some("https") => Some(443),
            _ => None,
        });
        let (Some(host), Some(port)) = (uri.host(), port) else {
            return self.inner.resolve(uri, config, timeout);
        };
        // `[::1]` arrives with its brackets.
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
            let mut out = self.empty();
            out.push(std::net::SocketAddr::new(ip, port));
            return Ok(out);
        }
        let key = format!("{host}:{port}");
        let now = std::time::Instant::now();
        if let Ok(last) = self.last.lock() {
            if let Some((k, at, addrs)) = last.as_ref() {
                if *k == key && now.duration_since(*at) < RESOLVED_FOR {
                    return Ok(addrs.clone());
                }
            }
        }
        let addrs = self.inner.resolve(uri, config, timeout)?;
        if let Ok(mut last) = self.last.lock() {
            *last = Some((key, now, addrs.clone()));
        }
        Ok(addrs)
    }
}

/// A client for one server.
pub struct Client {
    base: String,
    auth: String,
    agent: ureq::Agent,
}

/// The base URL for `--server` and whether TLS is on: `https://…` needs `--tls-ca`, and
/// `--tls-ca` needs `https://…`; a bare `host:port` gets the scheme `--tls-ca` implies.
pub fn base_url(server: &str, tls_ca: bool) -> Result<String, ClientError> {
    let server = server.trim_end_matches('/');
    let lower = server.to_ascii_lowercase();
    if lower.starts_with("https://") {
        if !tls_ca {
            return Err(ClientError(format!(
                "--server {server} is https: give --tls-ca with the CA (PEM) that signed the mill's certificate"
            )));
        }
        Ok(server.to_string())
    } else if lower.starts_with("http://") {
        if tls_ca {
            return Err(ClientError(format!(
                "--tls-ca is set but --server {server} is plain http: use https://{}",
                server.get("http://".len()..).unwrap_or_default()
            )));
        }
        Ok(server.to_string())
    } else if server.contains("://") {
        Err(ClientError(format!(
            "--server {server}: only http:// and https:// are supported"
        )))
    } else if tls_ca {
        Ok(format!("https://{server}"))
    } else {
        Ok(format!("http://{server}"))
    }
}

/// ureq's TLS settings trusting only the CA file at `ca` (ring, handed in explicitly).
fn tls_config(ca: &Path) -> Result<ureq::tls::TlsConfig, ClientError> {
    let certs = crate::tls::load_ca("--tls-ca", ca).map_err(|e| ClientError(e.to_string()))?;
    let roots: Vec<ureq::tls::Certificate<'static>> = certs
        .iter()
        .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
        .collect();
    Ok(ureq::tls::TlsConfig::builder()
        .provider(ureq::tls::TlsProvider::Rustls)
        .root_certs(ureq::tls::RootCerts::new_with_certs(&roots))
        .unversioned_rustls_crypto_provider(crate::tls::provider())
        .build())
}

impl Client {
    /// A client for `args.server` with the resolved token (https with `--tls-ca`).
    pub fn new(args: &ClientArgs) -> Result<Self, ClientError> {
        let base = base_url(&args.server, args.tls_ca.is_some())?;
        let tls = args.tls_ca.as_deref().map(tls_config).transpose()?;
        let t = token(args)?;
        Ok(Client::build(&base, &t, tls))
    }

    /// A plain-http client for `server` with `token`.
    pub fn with_token(server: &str, token: &str) -> Self {
        Client::build(server, token, None)
    }

    fn build(server: &str, token: &str, tls: Option<ureq::tls::TlsConfig>) -> Self {
        let tls = tls.unwrap_or_default();
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .tls_config(tls)
            .build();
        let agent = ureq::Agent::with_parts(
            config,
            ureq::unversioned::transport::DefaultConnector::default(),
            Resolver::default(),
        );
        Client {
            base: server.trim_end_matches('/').to_string(),
            auth: format!("Bearer {token}"),
            agent,
        }
    }

    /// A transport failure, with a hint when plain http met something that is not HTTP (a
    /// TLS port, most likely).
    fn unreachable(&self, e: &ureq::Error) -> ClientError {
        let hint = if matches!(e, ureq::Error::Protocol(_))
            && self.base.to_ascii_lowercase().starts_with("http://")
        {
            " (if the mill serves TLS, use --server https://… with --tls-ca)"
        } else {
            ""
        };
        ClientError(format!("cannot reach the mill at {}: {e}{hint}", self.base))
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    fn answer(
        &self,
        r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<(u16, Value), ClientError> {
        let mut resp = r.map_err(|e| self.unreachable(&e))?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .read_to_string()
            .map_err(|e| ClientError(format!("reading the answer: {e}")))?;
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, v))
    }

    /// GET a JSON resource.
    pub fn get(&self, path: &str) -> Result<(u16, Value), ClientError> {
        let r = self
            .agent
            .get(self.url(path))
            .header("Authorization", &self.auth)
            .call();
        self.answer(r)
    }

    /// POST a JSON body.
    pub fn post(&self, path: &str, body: &Value) -> Result<(u16, Value), ClientError> {
        self.post_with(path, body, &[])
    }

    /// POST a JSON body with extra headers.
    pub fn post_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Result<(u16, Value), ClientError> {
        let mut req = self
            .agent
            .post(self.url(path))
            .header("Authorization", &self.auth);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        self.answer(req.send_json(body))
    }

    /// The API's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// E15: one cursor read of a job's output, waiting up to `wait_secs` for bytes.
    pub fn read_log(&self, job: u64, cursor: u64, wait_secs: u64) -> Result<LogPiece, ClientError> {
        let (status, v) = self.get(&format!(
            "/v1/jobs/{job}/log?cursor={cursor}&wait={wait_secs}"
        ))?;
        if status != 200 {
            return Err(fail(status, &v));
        }
        LogPiece::from_json(&v)
    }

    /// E15: prints a job's output from `cursor` to `out`, a marker line for each gap; with
    /// `follow`, until the job is done, else until caught up. Returns the last cursor.
    pub fn print_log(
        &self,
        job: u64,
        mut cursor: u64,
        follow: bool,
        out: &mut dyn Write,
    ) -> Result<u64, ClientError> {
        loop {
            let p = self.read_log(job, cursor, if follow { FOLLOW_WAIT_SECS } else { 0 })?;
            let write = |out: &mut dyn Write, b: &[u8]| {
                out.write_all(b)
                    .and_then(|()| out.flush())
                    .map_err(|e| ClientError(format!("writing the log: {e}")))
            };
            if let Some((lost, reason)) = &p.gap {
                write(out, crate::live::gap_marker(*lost, reason).as_bytes())?;
            }
            write(out, &p.bytes)?;
            let progressed = p.next != cursor;
            cursor = p.next;
            if p.done || (!progressed && !follow) {
                return Ok(cursor);
            }
        }
    }
}

/// How long one follow read waits for bytes (the server caps it at 30 s; the client's own
/// timeout is 30 s).
const FOLLOW_WAIT_SECS: u64 = 10;

/// One answer of `GET /v1/jobs/{id}/log?cursor=N`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogPiece {
    /// Bytes lost before `bytes`, and why.
    pub gap: Option<(u64, String)>,
    /// The bytes.
    pub bytes: Vec<u8>,
    /// The next cursor.
    pub next: u64,
    /// Nothing more will come.
    pub done: bool,
}

impl LogPiece {
    fn from_json(v: &Value) -> Result<LogPiece, ClientError> {
        let bad = || ClientError(format!("unexpected log answer: {v}"));
        let gap = match v.get("gap") {
            None | Some(Value::Null) => None,
            Some(g) => Some((
                g.get("lost").and_then(Value::as_u64).ok_or_else(bad)?,
                g.get("reason")
                    .and_then(Value::as_str)
                    .unwrap_or("lost")
                    .to_string(),
            )),
        };
        let data = v.get("data").and_then(Value::as_str).ok_or_else(bad)?;
        Ok(LogPiece {
            gap,
            bytes: crate::live::base64_decode(data).ok_or_else(bad)?,
            next: v.get("next").and_then(Value::as_u64).ok_or_else(bad)?,
            done: v.get("done").and_then(Value::as_bool).ok_or_else(bad)?,
        })
    }
}

/// `millrace logs [-f] JOB`.
pub fn logs(args: &LogsArgs) -> Result<(), ClientError> {
    let c = Client::new(&args.client)?;
    let job = job_id(&args.job);
    let job: u64 = job
        .parse()
        .map_err(|_| ClientError(format!("{}: not a job id", args.job)))?;
    let mut stdout = std::io::stdout();
    c.print_log(job, args.cursor, args.follow, &mut stdout)?;
    Ok(())
}

fn fail(status: u16, v: &Value) -> ClientError {
    let msg = v
        .get("error")
        .and_then(Value::as_str)
        .unwrap_or("request failed");
    match v.get("field").and_then(Value::as_str) {
        Some(f) => ClientError(format!("HTTP {status}: {msg} (field {f})")),
        None => ClientError(format!("HTTP {status}: {msg}")),
    }
}

fn job_id(s: &str) -> String {
    s.trim_start_matches('j').to_string()
}

/// `--wait`'s exit code for a job that ended mill-side without a code of its own
/// (cancelled, executor lost, no compatible executor, quota denied, queue timeout), or when
/// the mill could not be asked: docker run's "the error is with the runner itself".
pub const EXIT_MILL: u8 = 125;
/// `--wait`'s exit code for a job that timed out (as timeout(1) reports it).
pub const EXIT_TIMEOUT: u8 = 124;

/// The exit code `millrace submit --wait` gives for a finished job's status (issue 13 item
/// 6): 0 on success; the job's own code when it failed with one (1..=255; a code outside
/// that range, which no process exit gives, becomes 1); [`EXIT_TIMEOUT`] on a timeout,
/// whatever the killed process's code; [`EXIT_MILL`] when it ended without a code.
pub fn exit_code_for(state: &str, exit_code: Option<i64>) -> u8 {
    match (state, exit_code) {
        ("success", _) => 0,
        ("timeout", _) => EXIT_TIMEOUT,
        ("failed", Some(code)) => u8::try_from(code).ok().filter(|c| *c != 0).unwrap_or(1),
        _ => EXIT_MILL,
    }
}

/// `millrace submit`: prints the job id (`Ok(0)`); with `--wait` follows the job and
/// returns the exit code for how it ended ([`exit_code_for`]).
pub fn submit(args: &SubmitArgs) -> Result<u8, ClientError> {
    let c = Client::new(&args.client)?;
    let env: serde_json::Map<String, Value> = args
        .env
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    let mut body = json!({
        "command": args.command.join(" "),
        "engine": args.engine,
        "labels": args.labels,
        "owner": args.owner,
        "repo": args.repo,
        "env": env,
    });
    if let (Some(t), Some(obj)) = (args.timeout, body.as_object_mut()) {
        obj.insert("timeout_secs".into(), json!(t.as_secs().max(1)));
    }
    if let Some(obj) = body.as_object_mut() {
        if args.retries > 0 {
            obj.insert("retries".into(), json!(args.retries));
        }
        if !args.retry_on.is_empty() {
            let on: Vec<&str> = args.retry_on.iter().map(|r| r.name()).collect();
            obj.insert("retry_on".into(), json!(on));
        }
        if args.priority != 0 {
            obj.insert("priority".into(), json!(args.priority));
        }
        if let Some(node) = &args.node {
            obj.insert("node".into(), json!(node));
        }
        let mut resources = serde_json::Map::new();
        for (name, amount) in &args.resources {
            if resources.insert(name.clone(), json!(amount)).is_some() {
                return Err(ClientError(format!("--resource {name}: given twice")));
            }
        }
        if !resources.is_empty() {
            obj.insert("resources".into(), Value::Object(resources));
        }
    }
    let headers: Vec<(&str, &str)> = args
        .key
        .as_deref()
        .map(|k| ("Idempotency-Key", k))
        .into_iter()
        .collect();
    let (status, v) = c.post_with("/v1/jobs", &body, &headers)?;
    // 201: a new job; 200: the idempotency key's existing job (M31).
    if status != 201 && status != 200 {
        return Err(fail(status, &v));
    }
    let id = v
        .get("id")
        .and_then(Value::as_u64)
        .ok_or_else(|| ClientError(format!("unexpected answer: {v}")))?;
    if status == 200 {
        eprintln!("millrace: job {id} already submitted under this key");
    }
    if let Some(w) = v.get("warning").and_then(Value::as_str) {
        eprintln!("millrace: job {id}: {w}");
    }
    if !args.wait {
        println!("{id}");
        return Ok(0);
    }
    eprintln!("job {id} submitted; following its output");
    let mut stdout = std::io::stdout();
    if let Err(e) = c.print_log(id, 0, true, &mut stdout) {
        eprintln!("log stream ended: {e}");
    }
    wait_done(&c, id)
}

fn wait_done(c: &Client, id: u64) -> Result<u8, ClientError> {
    loop {
        let (status, v) = c.get(&format!("/v1/jobs/{id}"))?;
        if status != 200 {
            return Err(fail(status, &v));
        }
        if v.get("done").and_then(Value::as_bool) == Some(true) {
            let state = v.get("state").and_then(Value::as_str).unwrap_or("?");
            let code = v.get("exit_code").and_then(Value::as_i64);
            let mut line = format!("job {id}: {state}");
            if let Some(code) = code {
                line.push_str(&format!(" (exit {code})"));
            }
            if let Some(err) = v.get("error").and_then(Value::as_str) {
                line.push_str(&format!(": {err}"));
            }
            eprintln!("{line}");
            eprintln!(
                "log: {}/v1/jobs/{id}/log (the mill keeps it as logs/{id}.log in its data directory)",
                c.base()
            );
            return Ok(exit_code_for(state, code));
        }
        // The log stream ended before the job did (the mill went away): ask again shortly.
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `millrace status`.
pub fn status(args: &JobArgs) -> Result<(), ClientError> {
    let c = Client::new(&args.client)?;
    let (status, v) = c.get(&format!("/v1/jobs/{}", job_id(&args.job)))?;
    if status != 200 {
        return Err(fail(status, &v));
    }
    println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    Ok(())
}

/// `millrace cancel`.
pub fn cancel(args: &JobArgs) -> Result<(), ClientError> {
    let c = Client::new(&args.client)?;
    let (status, v) = c.post(
        &format!("/v1/jobs/{}/cancel", job_id(&args.job)),
        &json!({}),
    )?;
    if status != 202 {
        return Err(fail(status, &v));
    }
    println!("cancelling job {}", job_id(&args.job));
    Ok(())
}

/// Most pages `millrace jobs --all` follows (a bound, STYLE 6): 10,000 pages of up to
/// 1,000 jobs.
const MAX_PAGES: usize = 10_000;

/// `millrace jobs`; with `--all`, every page through the list's `next` cursor.
pub fn jobs(args: &JobsArgs) -> Result<(), ClientError> {
    let c = Client::new(&args.client)?;
    println!("{:>8}  {:<10} {:<16} COMMAND", "ID", "STATE", "NODE");
    let mut after: Option<u64> = None;
    for _ in 0..MAX_PAGES {
        let mut path = format!("/v1/jobs?limit={}", args.limit);
        if let Some(s) = &args.state {
            path.push_str(&format!("&state={s}"));
        }
        if let Some(a) = after {
            path.push_str(&format!("&after={a}"));
        }
        let (status, v) = c.get(&path)?;
        if status != 200 {
            return Err(fail(status, &v));
        }
        for j in v
            .get("jobs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let s = |k: &str| j.get(k).and_then(Value::as_str).unwrap_or("-").to_string();
            let cmd: String = s("command").chars().take(60).collect();
            println!(
                "{:>8}  {:<10} {:<16} {}",
                j.get("id").and_then(Value::as_u64).unwrap_or(0),
                s("state"),
                s("node"),
                cmd
            );
        }
        let next = v.get("next").and_then(Value::as_u64);
        match next {
            // A cursor that does not move on would loop forever.
            Some(n) if args.all && after.is_none_or(|a| n < a) => after = Some(n),
            _ => return Ok(()),
        }
    }
    Ok(())
}

/// `millrace nodes`.
pub fn nodes(args: &ClientArgs) -> Result<(), ClientError> {
    let c = Client::new(args)?;
    let (status, v) = c.get("/v1/nodes")?;
    if status != 200 {
        return Err(fail(status, &v));
    }
    println!(
        "{:<24} {:<12} {:>5} {:>7} {:>8}  LABELS",
        "NODE", "STATE", "SEATS", "LEASES", "RUNNING"
    );
    for n in v
        .get("nodes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let labels: Vec<&str> = n
            .get("labels")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        println!(
            "{:<24} {:<12} {:>5} {:>7} {:>8}  {}",
            n.get("node").and_then(Value::as_str).unwrap_or("-"),
            n.get("state").and_then(Value::as_str).unwrap_or("-"),
            n.get("capacity").and_then(Value::as_u64).unwrap_or(0),
            n.get("leases").and_then(Value::as_u64).unwrap_or(0),
            n.get("running").and_then(Value::as_u64).unwrap_or(0),
            labels.join(",")
        );
    }
    Ok(())
}

/// `millrace quota`: `GET /v1/quota` as tables (or its JSON with `--json`).
pub fn quota(args: &QuotaArgs) -> Result<(), ClientError> {
    let c = Client::new(&args.client)?;
    let (status, v) = c.get(&format!("/v1/quota?limit={}", args.limit))?;
    if status != 200 {
        return Err(fail(status, &v));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    let view: crate::quota_view::QuotaView = serde_json::from_value(v)
        .map_err(|e| ClientError(format!("unexpected answer from /v1/quota: {e}")))?;
    print!("{}", crate::quota_view::render(&view));
    Ok(())
}

/// `millrace quarantine lift`.
pub fn lift(node: &str, args: &ClientArgs) -> Result<(), ClientError> {
    let c = Client::new(args)?;
    let (status, v) = c.post(&format!("/v1/nodes/{node}/quarantine/lift"), &json!({}))?;
    if status != 200 {
        return Err(fail(status, &v));
    }
    println!("quarantine of {node} lifted");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 13 item 6: `--wait` exits like the job did, 124 on a timeout, 125 without a
    /// code of the job's own.
    #[test]
    fn wait_exit_codes_follow_the_job() {
        assert_eq!(exit_code_for("success", Some(0)), 0);
        assert_eq!(exit_code_for("failed", Some(3)), 3);
        assert_eq!(exit_code_for("failed", Some(255)), 255);
        assert_eq!(exit_code_for("failed", Some(0)), 1, "failed is never 0");
        assert_eq!(exit_code_for("failed", Some(-9)), 1);
        assert_eq!(exit_code_for("timeout", Some(143)), EXIT_TIMEOUT);
        assert_eq!(exit_code_for("timeout", None), EXIT_TIMEOUT);
        assert_eq!(exit_code_for("failed", None), EXIT_MILL);
        assert_eq!(exit_code_for("cancelled", None), EXIT_MILL);
    }

    /// Issue 15: an IP literal is resolved without ureq's per-request resolver thread. With a
    /// spent time budget that thread could only time out, so an answer proves it never ran;
    /// a name goes through ureq's resolver once and is then served from the cache.
    #[test]
    fn an_ip_literal_is_its_own_address_and_a_name_is_resolved_once() {
        use ureq::unversioned::resolver::Resolver as _;
        use ureq::unversioned::transport::time::Duration as UreqDuration;
        use ureq::unversioned::transport::NextTimeout;
        let r = Resolver::default();
        let config = ureq::config::Config::default();
        let spent = NextTimeout {
            after: UreqDuration::Exact(Duration::ZERO),
            ..NextTimeout::default()
        };
        for (url, want) in [
            ("http://127.0.0.1:8080/v1/jobs", "127.0.0.1:8080"),
            ("https://[::1]/v1/jobs", "[::1]:443"),
            ("http://10.1.2.3/health", "10.1.2.3:80"),
        ] {
            let uri: ureq::http::Uri = url.parse().unwrap();
            let got = r.resolve(&uri, &config, spent).expect(url);
            let got: Vec<String> = got.iter().map(ToString::to_string).collect();
            assert_eq!(got, vec![want.to_string()], "{url}");
        }
        assert!(r.last.lock().unwrap().is_none(), "literals are not cached");
        let uri: ureq::http::Uri = "http://localhost:8080/".parse().unwrap();
        let first = r
            .resolve(&uri, &config, NextTimeout::default())
            .expect("localhost resolves");
        assert!(first
            .iter()
            .all(|a| a.ip().is_loopback() && a.port() == 8080));
        let again = r
            .resolve(&uri, &config, spent)
            .expect("the second lookup is the cached one, no resolver thread");
        assert_eq!(first.as_ref(), again.as_ref());
        let other: ureq::http::Uri = "http://localhost:9090/".parse().unwrap();
        assert!(
            r.resolve(&other, &config, spent).is_err(),
            "another port is another name: resolved anew, so the spent budget fails it"
        );
    }

    #[test]
    fn https_and_tls_ca_go_together() {
        assert_eq!(base_url("https://m:1/", true).unwrap(), "https://m:1");
        assert_eq!(base_url("http://m:1", false).unwrap(), "http://m:1");
        assert_eq!(base_url("m:1", true).unwrap(), "https://m:1");
        assert_eq!(base_url("m:1", false).unwrap(), "http://m:1");
        let e = base_url("https://m:1", false).unwrap_err().0;
        assert!(e.contains("--tls-ca"), "{e}");
        let e = base_url("http://m:1", true).unwrap_err().0;
        assert!(e.contains("https://m:1"), "{e}");
        assert!(base_url("ftp://m:1", false).is_err());
    }
}
