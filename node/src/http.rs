//! The HTTP JSON API (axum). Handlers only translate: requests become driver commands or
//! store reads, answers become JSON. Every route but `/health` wants `Authorization: Bearer
//! <token>`, compared in constant time. Errors are `{"error": "...", "field": "..."}`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use millrace_core::job::{
    IdempotencyKey, Identity, JobSpec, JobState, RetryOn, RetryPolicy, SpecError,
};
use millrace_core::mill::{RequestError, Submitted};
use millrace_core::{JobId, NodeId};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};
use utoipa::ToSchema;

use crate::live::{base64_encode, gap_marker, Gap, GapReason, LiveLogs, Piece};
use crate::logs::{read_stored, Ending, ReadError};
use crate::mill_driver::{HandleError, JobEvent, MillHandle};
use crate::mill_store::JobRow;
use crate::store::Reader;

/// Most jobs one list returns.
const MAX_LIMIT: usize = 1000;
/// Largest request body.
const MAX_BODY: usize = 512 * 1024;

/// What the handlers share.
#[derive(Clone)]
pub struct Api {
    /// The mill driver.
    pub mill: MillHandle,
    /// Store reads.
    pub reader: Arc<Mutex<Reader>>,
    /// The bearer token.
    pub token: Arc<String>,
    /// Job events, for log follow.
    pub events: broadcast::Sender<JobEvent>,
    /// The mill's data directory (job logs).
    pub data: PathBuf,
    /// Live output buffers (E15), filled by the log writer.
    pub live: Arc<Mutex<LiveLogs>>,
    /// Jobs whose stored log may still lack its last chunks (E15).
    pub ending: Arc<Ending>,
    /// The longest `timeout_secs` a job may ask for.
    pub max_job_timeout: Duration,
    /// The executor port's pre-`Hello` counters, for `/metrics`.
    pub preauth: Arc<crate::preauth::Preauth>,
    /// The term this mill leads under (E13, DESIGN §10), shown by `/health`.
    pub term: u64,
    /// Web UI sessions, whose cookie `auth` takes in place of the token (issue 18).
    pub ui: Arc<crate::ui::Sessions>,
}

/// A JSON error answer.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: String,
    field: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, error: impl Into<String>) -> Self {
        ApiError {
            status,
            error: error.into(),
            field: None,
        }
    }

    fn field(status: StatusCode, error: impl Into<String>, field: impl Into<String>) -> Self {
        ApiError {
            status,
            error: error.into(),
            field: Some(field.into()),
        }
    }

    fn unavailable() -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the mill is shutting down")
    }

    fn store(e: impl std::fmt::Display) -> Self {
        tracing::error!(error = %e, "store read failed");
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("store: {e}"))
    }
}

/// Every error answer of the API: what went wrong, for people, and the request field it
/// names (a body field such as `jobs[3].command`, a query parameter, a header, `body`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: String,
    /// The field of the request that was wrong, when one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.error,
            field: self.field,
        };
        (self.status, Json(body)).into_response()
    }
}

/// Longest request target (path and query) the API reads; longer ones get a JSON 414. (Far
/// longer ones, past hyper's own buffer, are refused by hyper with an empty 414/431.)
pub const MAX_URI: usize = 8 * 1024;

/// Bounds of the HTTP listener (issue 11): a slow or idle client holds at most one of
/// `max_connections` slots, for at most `header_timeout` per request head and `body_timeout`
/// per body.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// A request head (line and headers) must be in within this; it also closes idle
    /// keep-alive connections.
    pub header_timeout: Duration,
    /// A request body must be in within this.
    pub body_timeout: Duration,
    /// HTTP connections at once; further clients wait in the listen backlog.
    pub max_connections: usize,
}

/// Serves `app` on `listener` within `limits` until `shutdown`, then lets requests in flight
/// finish (bounded). Accept errors (out of descriptors) back off and retry; they never end
/// the listener. With `tls`, each connection first completes a TLS handshake inside its slot;
/// the handshake and the first request head share `header_timeout`, so a client that
/// stalls the handshake holds its slot no longer than one that stalls its headers.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: HttpLimits,
    fds: Arc<crate::net::FdBudget>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut failures = 0u64;
    let mut refused_for_fds = 0u64;
    // Failed handshakes, logged at powers of two with the count: a scanner must not flood
    // the log.
    let handshake_failures = Arc::new(std::sync::atomic::AtomicU64::new(0));
    loop {
        let permit = tokio::select! {
            biased;
            _ = shutdown.wait_for(|s| *s) => break,
            p = slots.clone().acquire_owned() => p,
        };
        let Ok(permit) = permit else { break };
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait_for(|s| *s) => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::warn!(error = %e, failures, "accepting an HTTP connection failed; retrying");
                }
                tokio::time::sleep(crate::node::ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Some(fd) = fds.take() else {
            drop(stream);
            refused_for_fds += 1;
            if refused_for_fds.is_power_of_two() {
                tracing::warn!(%peer, refused = refused_for_fds, connections = fds.max(), "HTTP connection closed at once: accepted connections hold every descriptor but those kept for the store and logs");
            }
            continue;
        };
        let permit = (permit, fd);
        // Small answers must not wait for Nagle and a delayed ACK.
        let _ = stream.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        match &tls {
            None => {
                let conn = graceful.watch(
                    connection(limits.header_timeout)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
                );
                tokio::spawn(async move {
                    let _ = conn.await;
                    drop(permit);
                });
            }
            Some(acceptor) => {
                let acceptor = acceptor.clone();
                let watcher = graceful.watcher();
                let header_timeout = limits.header_timeout;
                let failures = handshake_failures.clone();
                tokio::spawn(async move {
                    let started = tokio::time::Instant::now();
                    let accepted =
                        tokio::time::timeout(header_timeout, acceptor.accept(stream)).await;
                    let handshake = match accepted {
                        Ok(Ok(s)) => Ok(s),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err(format!(
                            "no handshake within {header_timeout:?} (--http-header-timeout)"
                        )),
                    };
                    let stream = match handshake {
                        Ok(s) => s,
                        Err(error) => {
                            let n = failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                            if n.is_power_of_two() {
                                tracing::warn!(%peer, %error, failures = n, "TLS handshake on the HTTP API failed (logged at powers of two of the count)");
                            }
                            return;
                        }
                    };
                    // The first head gets what the handshake left of the header timeout
                    // (later heads on this connection too; a handshake takes milliseconds).
                    let left = header_timeout
                        .saturating_sub(started.elapsed())
                        .max(Duration::from_millis(1));
                    let conn = watcher.watch(
                        connection(left)
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
                    );
                    let _ = conn.await;
                    drop(permit);
                });
            }
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
}

/// hyper's timer: tokio's in production; under madsim (issue 16) one on the simulated clock
/// (hyper-util's `TokioTimer` uses real tokio, which has no runtime there).
#[cfg(not(madsim))]
type Timer = hyper_util::rt::TokioTimer;
#[cfg(madsim)]
type Timer = sim_timer::SimTimer;

#[cfg(madsim)]
mod sim_timer {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::{Duration, Instant};

    /// hyper's timer on madsim's clock.
    #[derive(Debug, Clone, Default)]
    pub struct SimTimer;

    struct SimSleep(Pin<Box<tokio::time::Sleep>>);

    impl Future for SimSleep {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.0.as_mut().poll(cx)
        }
    }

    impl hyper::rt::Sleep for SimSleep {}

    impl hyper::rt::Timer for SimTimer {
        fn sleep(&self, d: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
            Box::pin(SimSleep(Box::pin(tokio::time::sleep(d))))
        }
        fn sleep_until(&self, at: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
            Box::pin(SimSleep(Box::pin(tokio::time::sleep_until(at.into()))))
        }
    }
}

/// One HTTP/1.1 connection's settings: keep-alive, and a request head must be in within
/// `header_timeout` (which also ends idle keep-alive connections).
fn connection(header_timeout: Duration) -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(Timer::default())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    builder
}

/// Turns every error answer that is not JSON yet (axum's rejections, 405, 413 from a
/// layer) into the documented `{"error": "..."}`.
async fn json_errors(req: Request, next: Next) -> Response {
    let uri_len = req.uri().to_string().len();
    if uri_len > MAX_URI {
        return ApiError::new(
            StatusCode::URI_TOO_LONG,
            format!("request target of {uri_len} bytes; at most {MAX_URI}"),
        )
        .into_response();
    }
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 16 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let text = if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("request refused")
            .to_string()
    } else {
        text
    };
    let mut out = ApiError::new(parts.status, text).into_response();
    if let Some(allow) = parts.headers.get(header::ALLOW) {
        out.headers_mut().insert(header::ALLOW, allow.clone());
    }
    out
}

/// The router: `/v1/...` behind the token, `/health` open.
pub fn router(api: Api, limits: &HttpLimits) -> Router {
    let protected = Router::new()
        .route("/v1/jobs", post(submit).get(list))
        .route("/v1/jobs/batch", post(submit_batch))
        .route("/v1/jobs/{id}", get(status))
        .route("/v1/jobs/{id}/cancel", post(cancel))
        .route("/v1/jobs/{id}/log", get(log))
        .route("/v1/nodes", get(nodes))
        .route("/v1/quota", get(quota))
        .route("/v1/nodes/{id}/quarantine/lift", post(lift))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(api.clone(), auth));
    let app = Router::new()
        .route("/health", get(health))
        .route("/v1/openapi.json", get(crate::openapi::openapi_json))
        .merge(protected)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY));
    with_body_timeout(app, limits.body_timeout)
        .layer(middleware::from_fn(json_errors))
        .merge(crate::ui::routes(limits))
        .with_state(api)
}

/// A request body must arrive within `timeout` (`--http-body-timeout`). Under madsim
/// (issue 16) tower-http's timer is real tokio's, which has no runtime there: the layer is
/// left out, and the suite does not send slow bodies.
pub fn with_body_timeout<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    timeout: Duration,
) -> Router<S> {
    #[cfg(not(madsim))]
    {
        router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(timeout))
    }
    #[cfg(madsim)]
    {
        let _ = timeout;
        router
    }
}

/// Compares secrets in time independent of where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    // `subtle` (issue 18 item 3): the time depends on the lengths, never on the bytes.
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

async fn auth(State(api): State<Api>, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // A bearer header is judged alone; without one, a web UI session cookie may stand in.
    let admitted = match given {
        Some(given) => constant_time_eq(given.as_bytes(), api.token.as_bytes()),
        None => match api.ui.admit(req.method(), req.headers()) {
            crate::ui::CookieAuth::Admitted => true,
            crate::ui::CookieAuth::NoCsrfHeader => {
                return ApiError::new(
                    StatusCode::FORBIDDEN,
                    "a request with the web UI's session cookie that changes state needs the header X-Millrace-UI: 1",
                )
                .into_response()
            }
            crate::ui::CookieAuth::Missing => false,
        },
    };
    if !admitted {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (Authorization: Bearer <token>)",
        )
        .into_response();
    }
    next.run(req).await
}

/// Open: a load balancer or a standby's operator asks it. A leading mill says so and its
/// term; a standby (`crate::standby`) answers `role: standby` and names the leader.
#[utoipa::path(
    get,
    path = "/health",
    operation_id = "health",
    summary = "Liveness and role; no token needed",
    responses(
        (status = 200, description = "A leading mill.", body = Health),
    ),
    security(())
)]
pub(crate) async fn health(State(api): State<Api>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        role: "leader".into(),
        term: api.term,
    })
}

async fn read<T: Send + 'static>(
    api: &Api,
    f: impl FnOnce(&mut Reader) -> Result<T, crate::sqlite::StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    let reader = api.reader.clone();
    tokio::task::spawn_blocking(move || {
        let mut guard = reader
            .lock()
            .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store reader poisoned"))?;
        f(&mut guard).map_err(ApiError::store)
    })
    .await
    .map_err(|_| ApiError::unavailable())?
}

/// The errors every route behind the token may answer (OpenAPI document, issue 18 item 1).
#[derive(utoipa::IntoResponses)]
#[allow(
    dead_code,
    reason = "a description of answers for the document, never built"
)]
pub(crate) enum AuthErrors {
    /// No or a wrong bearer token (or web UI session cookie).
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// A request with the web UI's session cookie that changes state lacks the header
    /// X-Millrace-UI: 1 (CSRF guard).
    #[response(status = 403)]
    NoCsrfHeader(ErrorBody),
    /// The request target is longer than 8 KiB.
    #[response(status = 414)]
    UriTooLong(ErrorBody),
    /// The mill is shutting down, or a store read failed.
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

/// The errors of reading a request body (OpenAPI document).
#[derive(utoipa::IntoResponses)]
#[allow(
    dead_code,
    reason = "a description of answers for the document, never built"
)]
pub(crate) enum BodyErrors {
    /// The body did not arrive within --http-body-timeout.
    #[response(status = 408)]
    Slow(ErrorBody),
    /// The body is larger than 512 KiB.
    #[response(status = 413)]
    TooLarge(ErrorBody),
}

/// A job submission.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitBody {
    /// Shell command (`sh -c`): not blank, no control characters but tab and line breaks.
    #[schema(
        min_length = 1,
        max_length = 262144,
        pattern = r"^[\t\n\r ]*[^\u0000-\u0020\u007f-\u009f][^\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f-\u009f]*$"
    )]
    pub command: String,
    /// Engine; default `shell`.
    #[serde(default = "default_engine")]
    #[schema(default = "shell", pattern = "^[!-~]{1,64}$")]
    pub engine: String,
    /// Labels the executor must hold (at most 32, each 1 to 64 printable ASCII characters).
    #[serde(default)]
    #[schema(value_type = Vec<crate::openapi::Name>, max_items = 32)]
    pub labels: BTreeSet<String>,
    /// Resources asked for: at most 32, each 1 to 2^53 (M14).
    #[serde(default)]
    #[schema(value_type = BTreeMap<crate::openapi::Name, crate::openapi::Amount>)]
    pub resources: BTreeMap<String, u64>,
    /// Quota owner; default `default`.
    #[serde(default = "default_scope")]
    #[schema(
        default = "default",
        pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]{1,256}$"
    )]
    pub owner: String,
    /// Quota repo; default `default`.
    #[serde(default = "default_scope")]
    #[schema(
        default = "default",
        pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]{1,256}$"
    )]
    pub repo: String,
    /// Timeout in seconds, at most the mill's `--max-job-timeout`; default its
    /// `--job-timeout`.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub timeout_secs: Option<u64>,
    /// Environment for the job's process (issue 13 item 6): at most 64 variables, names
    /// `[A-Za-z_][A-Za-z0-9_]*` not starting `MILLRACE_`, 32 KiB in all.
    #[serde(default)]
    #[schema(value_type = BTreeMap<crate::openapi::EnvName, String>)]
    pub env: BTreeMap<String, String>,
    /// Attempts after the first (M32); default 0, at most 20.
    #[serde(default)]
    #[schema(maximum = 20)]
    pub retries: u32,
    /// Which ends retry (`executor_lost`, `executor_restarted`, `no_longer_has_job`,
    /// `failed`); default the first three.
    #[serde(default)]
    #[schema(schema_with = crate::openapi::retry_on_set)]
    pub retry_on: Option<BTreeSet<RetryOn>>,
    /// Among the owner's waiting jobs, higher goes first (M33); default 0.
    #[serde(default)]
    pub priority: i32,
    /// The one executor (node id) it may run on (M34); default any.
    #[serde(default)]
    #[schema(pattern = "^[A-Za-z0-9._-]{1,128}$")]
    pub node: Option<String>,
}

fn default_engine() -> String {
    "shell".into()
}

fn default_scope() -> String {
    "default".into()
}

/// Parses a JSON body, naming the field that was wrong.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let msg = inner.to_string();
            let field = if inner.is_syntax() || inner.is_eof() {
                "body".to_string()
            } else if path.is_empty() || path == "." {
                backticked(&msg).unwrap_or_else(|| "body".to_string())
            } else {
                path
            };
            Err(ApiError::field(
                StatusCode::BAD_REQUEST,
                format!("malformed body: {msg}"),
                field,
            ))
        }
    }
}

/// The first name in backticks of a serde message ("missing field `command`").
fn backticked(msg: &str) -> Option<String> {
    let start = msg.find('`')?;
    let rest = msg.get(start + 1..)?;
    let end = rest.find('`')?;
    rest.get(..end).map(str::to_string)
}

fn spec_field(e: &SpecError) -> &'static str {
    match e.field() {
        "payload" => "command",
        "timeout" => "timeout_secs",
        other => other,
    }
}

/// Refuses NUL and other control characters in a text field, naming it: a NUL cannot reach
/// `sh -c` at all and would only fail later on the executor; other control characters in
/// names are mistakes or attempts to forge log lines. A command (`multiline`) may hold tabs
/// and line breaks.
fn no_control(field: &str, value: &str, multiline: bool) -> Result<(), ApiError> {
    let bad = value
        .char_indices()
        .find(|(_, c)| c.is_control() && !(multiline && matches!(c, '\t' | '\n' | '\r')));
    match bad {
        None => Ok(()),
        Some((at, c)) => Err(ApiError::field(
            StatusCode::BAD_REQUEST,
            format!(
                "{field} holds the control character U+{:04X} at byte {at}",
                u32::from(c)
            ),
            field,
        )),
    }
}

/// The body, or a JSON error when it cannot be read (too large: 413).
fn body_or_error(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| ApiError::field(e.status(), e.body_text(), "body"))
}

/// The `Idempotency-Key` header (M31), validated: a typed 400 naming the header otherwise.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, ApiError> {
    let mut values = headers.get_all(IdempotencyKey::FIELD).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let bad = |e: String| ApiError::field(StatusCode::BAD_REQUEST, e, IdempotencyKey::FIELD);
    if values.next().is_some() {
        return Err(bad(format!(
            "{}: give the header once",
            IdempotencyKey::FIELD
        )));
    }
    let text = value.to_str().map_err(|_| {
        bad(format!(
            "{}: must be printable ASCII",
            IdempotencyKey::FIELD
        ))
    })?;
    IdempotencyKey::new(text)
        .map(Some)
        .map_err(|e| bad(e.to_string()))
}

/// Checks a submission and builds its spec; errors name the field, behind `at` (`jobs[3].`
/// in a batch).
fn spec_of(api: &Api, b: SubmitBody, at: &str) -> Result<JobSpec, ApiError> {
    let field = |name: &str| format!("{at}{name}");
    if b.command.trim().is_empty() {
        return Err(ApiError::field(
            StatusCode::BAD_REQUEST,
            "command must not be empty",
            field("command"),
        ));
    }
    no_control(&field("command"), &b.command, true)?;
    no_control(&field("owner"), &b.owner, false)?;
    no_control(&field("repo"), &b.repo, false)?;
    if let Some(secs) = b.timeout_secs {
        let max = api.max_job_timeout.as_secs();
        if secs > max {
            return Err(ApiError::field(
                StatusCode::BAD_REQUEST,
                format!("timeout_secs {secs} exceeds the maximum of {max} (--max-job-timeout)"),
                field("timeout_secs"),
            ));
        }
    }
    let node = b.node.map(NodeId::new).transpose().map_err(|e| {
        ApiError::field(StatusCode::BAD_REQUEST, format!("node: {e}"), field("node"))
    })?;
    let retry = RetryPolicy {
        retries: b.retries,
        on: b.retry_on.unwrap_or_else(|| RetryPolicy::default().on),
    };
    let spec = JobSpec {
        retry,
        priority: b.priority,
        node,
        engine: b.engine,
        labels: b.labels,
        resources: b.resources,
        identity: Identity {
            owner: b.owner,
            repo: b.repo,
        },
        timeout: b.timeout_secs.map(Duration::from_secs),
        payload: b.command.into_bytes(),
        env: b.env,
    };
    if let Err(e) = spec.validate() {
        return Err(ApiError::field(
            StatusCode::BAD_REQUEST,
            e.to_string(),
            field(spec_field(&e)),
        ));
    }
    Ok(spec)
}

#[utoipa::path(
    post,
    path = "/v1/jobs",
    operation_id = "submit_job",
    summary = "Submit a job",
    request_body(content = SubmitBody, description = "The job."),
    params(
        ("Idempotency-Key" = Option<String>, Header, pattern = "^[!-~]{1,256}$", description = "Makes retries safe (M31): the same key and body answer the first job again; 1 to 256 printable ASCII characters (0x21-0x7e)."),
    ),
    responses(
        (status = 201, description = "Taken, durable before this answer (M1).", body = SubmitAnswer),
        (status = 200, description = "The Idempotency-Key named an earlier job: its id (M31).", body = SubmitAnswer),
        (status = 400, description = "A field is wrong (named in `field`).", body = ErrorBody),
        (status = 409, description = "The Idempotency-Key was used for a different job, or the mill refused it.", body = ErrorBody),
        BodyErrors,
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn submit(
    State(api): State<Api>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let body = body_or_error(body)?;
    let b: SubmitBody = parse_body(&body)?;
    let spec = spec_of(&api, b, "")?;
    match api.mill.submit_keyed(spec, key).await {
        Ok((s, warning)) => {
            let (status, body) = submitted(&s, warning);
            Ok((status, Json(body)).into_response())
        }
        Err(HandleError::Refused(e)) => Err(refused(e)),
        Err(HandleError::Unavailable) => Err(ApiError::unavailable()),
    }
}

/// How a job the mill took is answered: 201 with its id (and the unplaceable warning), or
/// 200 `existing` for an idempotency key's earlier job (M31: nothing new was stored).
fn submitted(s: &Submitted, warning: Option<String>) -> (StatusCode, SubmitAnswer) {
    let id = s.job.get();
    match warning {
        _ if !s.created => (
            StatusCode::OK,
            SubmitAnswer {
                id,
                existing: Some(true),
                warning: None,
            },
        ),
        warning => (
            StatusCode::CREATED,
            SubmitAnswer {
                id,
                existing: None,
                warning,
            },
        ),
    }
}

/// The answer to a job the mill took (`POST /v1/jobs`, and each taken job of a batch).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SubmitAnswer {
    /// The job's id.
    pub id: u64,
    /// `true` when an `Idempotency-Key` named an earlier job: that job's id, nothing new was
    /// stored (M31).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub existing: Option<bool>,
    /// Set when no executor the mill knows can run it (the job waits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// One job of a batch the mill refused (the jobs before it stand).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BatchRefusal {
    /// Why.
    pub error: String,
    /// The status `POST /v1/jobs` would have answered.
    pub status: u16,
    /// The field it names, if any.
    pub field: Option<String>,
}

/// One position of a batch answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum BatchItem {
    /// Taken (or an earlier job of its key).
    Submitted(SubmitAnswer),
    /// Refused.
    Refused(BatchRefusal),
}

/// `POST /v1/jobs/batch`'s answer: one item per job, in order.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BatchAnswer {
    /// The answers, in the order of the request's jobs.
    pub jobs: Vec<BatchItem>,
}

/// How a submit the mill refused is answered.
fn refused(e: RequestError) -> ApiError {
    match e {
        e @ RequestError::KeyConflict { .. } => {
            ApiError::field(StatusCode::CONFLICT, e.to_string(), IdempotencyKey::FIELD)
        }
        RequestError::Spec(e) => {
            ApiError::field(StatusCode::BAD_REQUEST, e.to_string(), spec_field(&e))
        }
        e @ RequestError::TooManyPending { .. } => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        e => ApiError::new(StatusCode::CONFLICT, e.to_string()),
    }
}

/// Most jobs in one batch submit.
pub const MAX_BATCH: usize = 1000;

/// A batch submission: jobs of one pipeline, durable together.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    /// The jobs, each as `POST /v1/jobs` takes it: 1 to 1000.
    #[schema(min_items = 1, max_items = 1000)]
    pub jobs: Vec<SubmitBody>,
}

/// `POST /v1/jobs/batch`: up to [`MAX_BATCH`] jobs in one request, all made durable in one
/// group commit before the answer (issue 15: one HTTP exchange and one trip to the driver
/// for a whole pipeline). Every job is checked first; one bad job refuses the batch with a
/// 400 naming `jobs[i].field`, and nothing is stored. Then each job is submitted in order and
/// answered in the same position: `{"id"}` (with `"warning"` if nothing connected could run
/// it), `{"id", "existing": true}` for a repeat, or `{"error", "status"}` if the mill refused
/// that one (e.g. 503 past `max_pending`: the jobs before it stand). An `Idempotency-Key`
/// header keys job `i` as `<key>#<i>` (M31), so a retried batch gets the same ids back.
#[utoipa::path(
    post,
    path = "/v1/jobs/batch",
    operation_id = "submit_batch",
    summary = "Submit up to 1000 jobs, durable together",
    request_body(content = BatchBody, description = "The jobs."),
    params(
        ("Idempotency-Key" = Option<String>, Header, pattern = "^[!-~]{1,256}$", description = "Makes retries safe (M31): the same key and body answer the first job again; 1 to 256 printable ASCII characters (0x21-0x7e)."),
    ),
    responses(
        (status = 200, description = "One answer per job, in order: taken (durable before this answer) or refused.", body = BatchAnswer),
        (status = 400, description = "A job's field is wrong (named `jobs[i].field`); nothing was stored.", body = ErrorBody),
        BodyErrors,
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn submit_batch(
    State(api): State<Api>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let body = body_or_error(body)?;
    let b: BatchBody = parse_body(&body)?;
    if b.jobs.is_empty() || b.jobs.len() > MAX_BATCH {
        return Err(ApiError::field(
            StatusCode::BAD_REQUEST,
            format!(
                "jobs: 1 to {MAX_BATCH} jobs per batch, got {}",
                b.jobs.len()
            ),
            "jobs",
        ));
    }
    let mut items = Vec::with_capacity(b.jobs.len());
    for (i, job) in b.jobs.into_iter().enumerate() {
        let spec = spec_of(&api, job, &format!("jobs[{i}]."))?;
        let key = match &key {
            None => None,
            Some(k) => Some(IdempotencyKey::new(format!("{k}#{i}")).map_err(|e| {
                ApiError::field(
                    StatusCode::BAD_REQUEST,
                    format!("{e} (job {i} of the batch is keyed `<key>#{i}`)"),
                    IdempotencyKey::FIELD,
                )
            })?),
        };
        items.push((spec, key));
    }
    let answers = api
        .mill
        .submit_batch(items)
        .await
        .map_err(|_| ApiError::unavailable())?;
    let jobs: Vec<BatchItem> = answers
        .into_iter()
        .map(|a| match a {
            Ok((s, warning)) => BatchItem::Submitted(submitted(&s, warning).1),
            Err(e) => {
                let e = refused(e);
                BatchItem::Refused(BatchRefusal {
                    error: e.error,
                    status: e.status.as_u16(),
                    field: e.field,
                })
            }
        })
        .collect();
    Ok((StatusCode::OK, Json(BatchAnswer { jobs })).into_response())
}

fn parse_job(id: &str) -> Result<JobId, ApiError> {
    id.strip_prefix('j')
        .unwrap_or(id)
        .parse::<u64>()
        .map(JobId)
        .map_err(|_| {
            ApiError::field(
                StatusCode::BAD_REQUEST,
                format!("{id:?} is not a job id"),
                "id",
            )
        })
}

/// A job as the API shows it.
#[derive(Debug, Serialize, Deserialize, Clone, ToSchema)]
pub struct JobView {
    /// Its id.
    pub id: u64,
    /// `queued`, `reserved`, `running`, `success`, `failed`, `timeout` or `cancelled`.
    pub state: String,
    /// Whether it has ended.
    pub done: bool,
    /// Engine.
    pub engine: String,
    /// Required labels.
    pub labels: Vec<String>,
    /// The command.
    pub command: String,
    /// Names of the job's environment variables (never their values).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Quota owner.
    pub owner: String,
    /// Quota repo.
    pub repo: String,
    /// Submission time (ms since the Unix epoch).
    pub submitted_at_ms: u64,
    /// Last change (ms since the Unix epoch).
    pub updated_at_ms: u64,
    /// The executor, once placed.
    pub node: Option<String>,
    /// The lease, once placed.
    pub lease: Option<u64>,
    /// Exit code, when a process ran.
    pub exit_code: Option<i32>,
    /// Why it did not succeed, for people.
    pub error: Option<String>,
    /// Why it ended, as a stable name (`reported`, `executor_lost`, `cancelled`, …): what
    /// scripts should match on instead of `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// The executor's log reference (path and sha256).
    pub log: Option<LogRefView>,
    /// Status history, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<HistoryView>,
    /// Attempts after the first its policy allows (M32).
    #[serde(default)]
    pub retries: u32,
    /// Which ends retry (M32).
    #[serde(default)]
    pub retry_on: Vec<String>,
    /// Its priority among its owner's jobs (M33).
    #[serde(default)]
    pub priority: i32,
    /// The one node it may run on, when pinned (M34).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<String>,
    /// Resources it asks for (M34, Q1).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub resources: BTreeMap<String, u64>,
    /// Every attempt, oldest first (the latest 100): node, epoch, lease, start, end, how it
    /// ended and what became of the job (M32).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<crate::mill_store::AttemptRow>,
    /// For a queued job that no executor known to the mill can take, or that waits for
    /// quota: why (`waiting: no executor offers engine docker`, `waiting for quota: owner
    /// "alice" jobs 10/10 in use (asks 1)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// For a job waiting for quota (M15, Q2): the scope and resource that hold it up, or the
    /// earlier waiter it is behind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota_wait: Option<crate::quota_view::BlockedView>,
}

/// Where the executor keeps a job's log, and its digest.
#[derive(Debug, Serialize, Deserialize, Clone, ToSchema)]
pub struct LogRefView {
    /// The path on the executor.
    pub path: String,
    /// `sha256:` and 64 lowercase hex digits.
    pub hash: String,
}

/// One status-history entry of a job.
#[derive(Debug, Serialize, Deserialize, Clone, ToSchema)]
pub struct HistoryView {
    /// The state entered.
    pub state: String,
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
}

fn view(row: &JobRow) -> JobView {
    let (node, lease, exit_code, error, log) = match &row.state {
        JobState::Queued => (None, None, None, None, None),
        JobState::Reserved { lease, node } | JobState::Running { lease, node } => {
            (Some(node.to_string()), Some(lease.get()), None, None, None)
        }
        JobState::Done(t) => (
            t.node.as_ref().map(ToString::to_string),
            t.lease.map(|l| l.get()),
            t.exit_code,
            t.error.clone(),
            t.log.as_ref().map(|l| LogRefView {
                path: l.path.clone(),
                hash: l.hash.clone(),
            }),
        ),
    };
    JobView {
        id: row.id.get(),
        state: row.state.name().to_string(),
        done: matches!(row.state, JobState::Done(_)),
        engine: row.spec.engine.clone(),
        labels: row.spec.labels.iter().cloned().collect(),
        command: String::from_utf8_lossy(&row.spec.payload).into_owned(),
        env: row.spec.env.keys().cloned().collect(),
        owner: row.spec.identity.owner.clone(),
        repo: row.spec.identity.repo.clone(),
        submitted_at_ms: row.submitted_at_ms,
        updated_at_ms: row.updated_at_ms,
        node,
        lease,
        exit_code,
        error,
        cause: match &row.state {
            JobState::Done(t) => t.cause.map(|c| c.name().to_string()),
            JobState::Queued | JobState::Reserved { .. } | JobState::Running { .. } => None,
        },
        log,
        history: Vec::new(),
        retries: row.spec.retry.retries,
        retry_on: row
            .spec
            .retry
            .on
            .iter()
            .map(|r| r.name().to_string())
            .collect(),
        priority: row.spec.priority,
        pinned: row.spec.node.as_ref().map(ToString::to_string),
        resources: row.spec.resources.clone(),
        attempts: Vec::new(),
        waiting: None,
        quota_wait: None,
    }
}

/// Why no executor the mill knows (connected, or in its reconnect grace) could take a job of
/// `engine` with `labels`; `None` when one could. Not an error: executors may connect later,
/// so the job stays queued (its timeout still ends it) and says why it waits.
pub fn unplaceable(
    engine: &str,
    labels: &BTreeSet<String>,
    pin: Option<&NodeId>,
    nodes: &[crate::mill_driver::NodeView],
) -> Option<String> {
    if let Some(pin) = pin {
        // M34: the pinned node is the only candidate.
        let Some(n) = nodes.iter().find(|n| n.node == pin.as_str()) else {
            return Some(format!(
                "waiting: pinned to node {pin}, which is not connected"
            ));
        };
        if n.state == "quarantined" {
            return Some(format!(
                "waiting: pinned to node {pin}, which is quarantined"
            ));
        }
        if !n.engines.iter().any(|e| e == engine) {
            return Some(format!(
                "waiting: pinned to node {pin}, which does not offer engine {engine}"
            ));
        }
        let missing: Vec<&str> = labels
            .iter()
            .filter(|l| !n.labels.contains(l))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Some(format!(
                "waiting: pinned to node {pin}, which does not hold the labels {}",
                missing.join(", ")
            ));
        }
        return None;
    }
    let live: Vec<_> = nodes.iter().filter(|n| n.state != "quarantined").collect();
    if live.is_empty() {
        return Some("waiting: no executor is connected".into());
    }
    let with_engine: Vec<_> = live
        .iter()
        .filter(|n| n.engines.iter().any(|e| e == engine))
        .collect();
    if with_engine.is_empty() {
        return Some(format!("waiting: no executor offers engine {engine}"));
    }
    if with_engine
        .iter()
        .any(|n| labels.iter().all(|l| n.labels.contains(l)))
    {
        return None;
    }
    let wanted: Vec<&str> = labels.iter().map(String::as_str).collect();
    Some(format!(
        "waiting: no executor with engine {engine} holds the labels {}",
        wanted.join(", ")
    ))
}

#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    operation_id = "get_job",
    summary = "A job: state, attempts, history, why it waits",
    params(
        ("id" = String, Path, pattern = "^j?[0-9]{1,19}$", description = "A job id: `j12` or `12`."),
    ),
    responses(
        (status = 200, description = "The job.", body = JobView),
        (status = 400, description = "`id` is not a job id.", body = ErrorBody),
        (status = 404, description = "No such job.", body = ErrorBody),
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn status(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let job = parse_job(&id)?;
    let (row, history, attempts) = read(&api, move |r| {
        Ok((r.job(job)?, r.history(job)?, r.attempts(job)?))
    })
    .await?;
    let Some(row) = row else {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("no job {id}")));
    };
    let mut v = view(&row);
    if matches!(row.state, JobState::Queued) {
        // M15: a job waiting for quota says which scope and resource hold it up; otherwise
        // a job no known executor can take says why.
        if let Some(wait) = api.mill.quota_wait(job).await {
            v.waiting = Some(format!("waiting for quota: {wait}"));
            v.quota_wait = Some(wait);
        } else if let Some(nodes) = api.mill.nodes().await {
            v.waiting = unplaceable(
                &row.spec.engine,
                &row.spec.labels,
                row.spec.node.as_ref(),
                &nodes,
            );
        }
    }
    v.attempts = attempts;
    v.history = history
        .iter()
        .map(|h| HistoryView {
            state: h.state.name().to_string(),
            at_ms: h.at_ms,
        })
        .collect();
    Ok(Json(v).into_response())
}

const STATES: [&str; 9] = [
    "queued",
    "reserved",
    "running",
    "success",
    "failed",
    "timeout",
    "cancelled",
    "active",
    "done",
];

#[utoipa::path(
    get,
    path = "/v1/jobs",
    operation_id = "list_jobs",
    summary = "List jobs, newest first",
    params(
        ("state" = Option<String>, Query, description = "Only jobs in this state: one of queued, reserved, running, success, failed, timeout, cancelled, active (not ended) or done (ended)."),
        ("limit" = Option<u64>, Query, description = "Jobs per page (default 100; clamped to 1..=1000)."),
        ("after" = Option<String>, Query, description = "Paging cursor: the `next` of the previous page (jobs older than this id)."),
    ),
    responses(
        (status = 200, description = "A page of jobs.", body = JobList),
        (status = 400, description = "A query parameter is wrong or unknown (named in `field`).", body = ErrorBody),
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn list(
    State(api): State<Api>,
    q: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::field(e.status(), e.body_text(), "query"))?;
    let mut state = None;
    let mut limit = 100usize;
    let mut after = None;
    for (k, v) in q {
        match k.as_str() {
            "after" => {
                after = Some(parse_job(&v).map_err(|_| {
                    ApiError::field(
                        StatusCode::BAD_REQUEST,
                        format!("after {v:?} is not a job id"),
                        "after",
                    )
                })?);
            }
            "state" => {
                if !STATES.contains(&v.as_str()) {
                    return Err(ApiError::field(
                        StatusCode::BAD_REQUEST,
                        format!("unknown state {v:?}; one of {}", STATES.join(", ")),
                        "state",
                    ));
                }
                state = Some(v);
            }
            "limit" => {
                limit = v.parse().map_err(|_| {
                    ApiError::field(
                        StatusCode::BAD_REQUEST,
                        format!("limit {v:?} is not a number"),
                        "limit",
                    )
                })?;
                limit = limit.clamp(1, MAX_LIMIT);
            }
            other => {
                return Err(ApiError::field(
                    StatusCode::BAD_REQUEST,
                    format!("unknown query parameter {other:?}"),
                    other,
                ))
            }
        }
    }
    // One row past the page says whether there are more (issue 13 item 6).
    let mut rows = read(&api, move |r| r.jobs(state.as_deref(), after, limit + 1)).await?;
    let more = rows.len() > limit;
    rows.truncate(limit);
    let jobs: Vec<JobView> = rows.iter().map(view).collect();
    let next = rows.last().filter(|_| more).map(|r| r.id.get());
    Ok(Json(JobList { jobs, next }).into_response())
}

/// `GET /v1/jobs`'s answer: a page of jobs, newest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct JobList {
    /// The page.
    pub jobs: Vec<JobView>,
    /// Present when there are more: pass it as `after` for the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<u64>,
}

/// `POST /v1/jobs/{id}/cancel`'s answer: the cancel is on its way (M20).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CancelAnswer {
    /// The job.
    pub id: u64,
    /// Always `true`.
    pub cancelling: bool,
}

/// `POST /v1/jobs/{id}/cancel`'s optional body.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelBody {
    /// Why, for the job's record (no control characters); default "cancelled through the
    /// API".
    #[serde(default)]
    #[schema(pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$")]
    pub reason: Option<String>,
}

/// `GET /v1/nodes`'s answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NodeList {
    /// Every executor the mill knows: connected, in grace or quarantined.
    pub nodes: Vec<crate::mill_driver::NodeView>,
}

/// `POST /v1/nodes/{id}/quarantine/lift`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LiftAnswer {
    /// The node.
    pub node: String,
    /// Always `false`.
    pub quarantined: bool,
}

/// `GET /health`'s answer from a leading mill.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
    /// `leader` (a standby answers `standby` with the leader it sees; DESIGN §10).
    pub role: String,
    /// The term this mill leads under (E13).
    pub term: u64,
}

#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/cancel",
    operation_id = "cancel_job",
    summary = "Cancel a job (M26)",
    request_body(content = Option<CancelBody>, description = "Optional: why."),
    params(
        ("id" = String, Path, pattern = "^j?[0-9]{1,19}$", description = "A job id: `j12` or `12`."),
    ),
    responses(
        (status = 202, description = "The cancel is on its way; the job ends `cancelled`.", body = CancelAnswer),
        (status = 400, description = "`id` is not a job id, or the body is wrong.", body = ErrorBody),
        (status = 404, description = "No such job.", body = ErrorBody),
        (status = 409, description = "The job already ended.", body = ErrorBody),
        BodyErrors,
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn cancel(
    State(api): State<Api>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_or_error(body)?;
    let job = parse_job(&id)?;
    let reason = if body.is_empty() {
        None
    } else {
        parse_body::<CancelBody>(&body)?.reason
    };
    if let Some(r) = &reason {
        no_control("reason", r, false)?;
    }
    let reason = reason.unwrap_or_else(|| "cancelled through the API".into());
    match api.mill.cancel(job, reason).await {
        Ok(()) => Ok((
            StatusCode::ACCEPTED,
            Json(CancelAnswer {
                id: job.get(),
                cancelling: true,
            }),
        )
            .into_response()),
        Err(HandleError::Refused(RequestError::JobNotActive { .. })) => {
            let row = read(&api, move |r| r.job(job)).await?;
            match row {
                None => Err(ApiError::new(StatusCode::NOT_FOUND, format!("no job {id}"))),
                Some(r) => Err(ApiError::new(
                    StatusCode::CONFLICT,
                    format!("job {id} already ended ({})", r.state.name()),
                )),
            }
        }
        Err(HandleError::Refused(e)) => Err(ApiError::new(StatusCode::CONFLICT, e.to_string())),
        Err(HandleError::Unavailable) => Err(ApiError::unavailable()),
    }
}

#[utoipa::path(
    get,
    path = "/v1/nodes",
    operation_id = "list_nodes",
    summary = "Executors: seats, load, epoch, grace, quarantine",
    responses(
        (status = 200, description = "Every executor the mill knows.", body = NodeList),
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn nodes(State(api): State<Api>) -> Result<Response, ApiError> {
    let nodes = api.mill.nodes().await.ok_or_else(ApiError::unavailable)?;
    Ok(Json(NodeList { nodes }).into_response())
}

/// `GET /v1/quota[?limit=N]`: the limits in force, what each scope that holds or waits uses,
/// and the jobs waiting for quota with what holds each up (§6, Q2, M15). Each list shows at
/// most `limit` entries (default 100, at most 1,000) and says when it was cut.
#[utoipa::path(
    get,
    path = "/v1/quota",
    operation_id = "get_quota",
    summary = "Quota limits, use and waiters (Q1-Q3, M15)",
    params(
        ("limit" = Option<u64>, Query, minimum = 1, maximum = 1000, description = "Entries per list (default 100)."),
    ),
    responses(
        (status = 200, description = "The quota ledger.", body = crate::quota_view::QuotaView),
        (status = 400, description = "`limit` is out of range, or an unknown query parameter.", body = ErrorBody),
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn quota(
    State(api): State<Api>,
    q: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::field(e.status(), e.body_text(), "query"))?;
    let mut limit = crate::quota_view::DEFAULT_LIMIT;
    for (k, v) in q {
        match k.as_str() {
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=crate::quota_view::MAX_LIMIT).contains(n))
                    .ok_or_else(|| {
                        ApiError::field(
                            StatusCode::BAD_REQUEST,
                            format!("limit {v:?}: must be 1 to {}", crate::quota_view::MAX_LIMIT),
                            "limit",
                        )
                    })?;
            }
            other => {
                return Err(ApiError::field(
                    StatusCode::BAD_REQUEST,
                    format!("unknown query parameter {other:?}"),
                    other,
                ))
            }
        }
    }
    let view = api
        .mill
        .quota(limit)
        .await
        .ok_or_else(ApiError::unavailable)?;
    Ok(Json(view).into_response())
}

#[utoipa::path(
    post,
    path = "/v1/nodes/{id}/quarantine/lift",
    operation_id = "lift_quarantine",
    summary = "Lift an executor's quarantine",
    params(
        ("id" = String, Path, pattern = "^[A-Za-z0-9._-]{1,128}$", description = "The node id."),
    ),
    responses(
        (status = 200, description = "Lifted.", body = LiftAnswer),
        (status = 400, description = "`id` is not a valid node id.", body = ErrorBody),
        (status = 409, description = "The node is not quarantined.", body = ErrorBody),
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn lift(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let node = NodeId::new(id)
        .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, e.to_string(), "id"))?;
    match api.mill.lift(node.clone()).await {
        Ok(()) => Ok(Json(LiftAnswer {
            node: node.to_string(),
            quarantined: false,
        })
        .into_response()),
        Err(HandleError::Refused(e)) => Err(ApiError::new(StatusCode::CONFLICT, e.to_string())),
        Err(HandleError::Unavailable) => Err(ApiError::unavailable()),
    }
}

#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    summary = "Prometheus metrics",
    responses(
        (status = 200, description = "Prometheus text exposition.", content_type = "text/plain; version=0.0.4; charset=utf-8", body = String),
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn metrics(State(api): State<Api>) -> Result<Response, ApiError> {
    let mut text = api.mill.metrics().await.ok_or_else(ApiError::unavailable)?;
    text.push_str(&api.preauth.render());
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// `GET /v1/jobs/{id}/log` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogQuery {
    /// Text stream: follow while the job runs (default true).
    pub follow: Option<bool>,
    /// E15: read by cursor (a byte offset in the job's output); the answer is JSON.
    pub cursor: Option<u64>,
    /// Most bytes in one cursor read (default 256 KiB, at most 1 MiB).
    pub max: Option<usize>,
    /// Seconds a cursor read may wait for bytes when there are none yet (default 0, at most
    /// 30): a long poll, so followers do not spin.
    pub wait: Option<u64>,
}

/// Default and largest bytes of one cursor read.
const READ_DEFAULT: usize = 256 * 1024;
const READ_MAX: usize = 1 << 20;
/// Longest long poll of a cursor read.
const WAIT_MAX: Duration = Duration::from_secs(30);
/// Bytes per piece of the text stream.
const STREAM_CHUNK: usize = 64 * 1024;

/// The line the text stream and `millrace logs` print for a gap (E15).
pub fn gap_line(g: &Gap) -> String {
    let reason = match g.reason {
        GapReason::Evicted => "evicted",
        GapReason::Dropped => "dropped",
        GapReason::Truncated => "truncated",
    };
    gap_marker(g.lost, reason)
}

#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/log",
    operation_id = "job_log",
    summary = "A job's output: a text stream, or a cursor read (E15)",
    params(
        ("id" = String, Path, pattern = "^j?[0-9]{1,19}$", description = "A job id: `j12` or `12`."),
        LogQuery,
    ),
    responses(
        (status = 200, description = "Without `cursor`: the output as text from offset 0 (following while the job runs unless follow=false), with a marker line per gap. With `cursor`: one JSON read.", content(
            (String = "text/plain; charset=utf-8"),
            (LogPiece = "application/json")
        )),
        (status = 400, description = "`id`, `cursor`, `max` or another query parameter is wrong (named in `field`).", body = ErrorBody),
        (status = 404, description = "No such job.", body = ErrorBody),
        AuthErrors,
    ),
    security(("bearer" = []), ("ui_session" = []))
)]
pub(crate) async fn log(
    State(api): State<Api>,
    Path(id): Path<String>,
    q: Result<Query<LogQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let job = parse_job(&id)?;
    let Query(q) = q.map_err(|e| ApiError::field(e.status(), e.body_text(), "query"))?;
    let exists = read(&api, move |r| r.job(job)).await?;
    if exists.is_none() {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("no job {id}")));
    }
    if let Some(cursor) = q.cursor {
        let max = q.max.unwrap_or(READ_DEFAULT);
        if max == 0 || max > READ_MAX {
            return Err(ApiError::field(
                StatusCode::BAD_REQUEST,
                format!("max {max}: must be 1 to {READ_MAX} bytes"),
                "max",
            ));
        }
        let wait = Duration::from_secs(q.wait.unwrap_or(0)).min(WAIT_MAX);
        return cursor_read(&api, job, cursor, max, wait).await;
    }
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let follow = q.follow.unwrap_or(true);
    let sub = api.events.subscribe();
    tokio::spawn(follow_log(api, job, follow, sub, tx));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response())
}

/// E15: one read at `cursor`: from the stored log once it is complete (the job is done in
/// the store and its `Done` reached the log writer, [`Ending`]), else from the job's live
/// buffer, else (no buffer: no output yet, or a restarted mill) from what is stored so far.
async fn read_piece(api: &Api, job: JobId, cursor: u64, max: usize) -> Result<Piece, ApiError> {
    // The store first: the driver marks a job as ending before the step that ends it is
    // durable, so once the store says done, `ending` tells whether the writer caught up.
    let done = read(api, move |r| r.is_done(job)).await?;
    let complete = done && !api.ending.pending(job);
    if !complete {
        let live = api
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .read(job, cursor, max);
        if let Some(piece) = live {
            return Ok(piece);
        }
    }
    let data = api.data.clone();
    let stored =
        tokio::task::spawn_blocking(move || read_stored(&data, job, cursor, max, complete))
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    match stored {
        Ok(piece) => Ok(piece),
        Err(e @ ReadError::PastEnd { .. }) => Err(ApiError::field(
            StatusCode::BAD_REQUEST,
            e.to_string(),
            "cursor",
        )),
        Err(ReadError::Io(e)) => {
            tracing::warn!(%job, error = %e, "reading a stored job log failed");
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("job log: {e}"),
            ))
        }
    }
}

/// Waits (at most `wait`) for news of `job`: its log grew, or its state changed.
async fn news(sub: &mut broadcast::Receiver<JobEvent>, job: JobId, wait: Duration) {
    let until = async {
        loop {
            match sub.recv().await {
                Ok(ev) if ev.job == job => return,
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Lagged(_)) => return,
                Err(broadcast::error::RecvError::Closed) => {
                    std::future::pending::<()>().await;
                }
            }
        }
    };
    let _ = tokio::time::timeout(wait, until).await;
}

/// The JSON answer of a cursor read: `{cursor, next, end, gap, data, len, done}`, where
/// `data` is base64 of the bytes at `gap.to` (or `cursor`) and `next = start + len`.
async fn cursor_read(
    api: &Api,
    job: JobId,
    cursor: u64,
    max: usize,
    wait: Duration,
) -> Result<Response, ApiError> {
    let mut sub = api.events.subscribe();
    let mut piece = read_piece(api, job, cursor, max).await?;
    if piece.gap.is_none() && piece.bytes.is_empty() && !piece.done && !wait.is_zero() {
        news(&mut sub, job, wait).await;
        piece = read_piece(api, job, cursor, max).await?;
    }
    let body = LogPiece {
        cursor,
        next: piece.next,
        end: piece.end,
        gap: piece.gap,
        data: base64_encode(&piece.bytes),
        len: piece.bytes.len(),
        done: piece.done,
    };
    Ok(Json(body).into_response())
}

/// A cursor read of a job's output (E15).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LogPiece {
    /// The cursor asked for.
    pub cursor: u64,
    /// Where the next read starts: `(gap.to or cursor) + len`.
    pub next: u64,
    /// The end of the output known so far.
    pub end: u64,
    /// Bytes skipped at `cursor`, if any.
    pub gap: Option<Gap>,
    /// Base64 of the bytes read.
    pub data: String,
    /// How many bytes `data` holds.
    pub len: usize,
    /// Whether the job has ended and this is the last of its output.
    pub done: bool,
}

/// The text stream: the job's output from offset 0, with a marker line for each gap
/// ([`gap_line`]); follows until the job is done unless `follow` is false.
async fn follow_log(
    api: Api,
    job: JobId,
    follow: bool,
    mut sub: broadcast::Receiver<JobEvent>,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let mut cursor = 0u64;
    loop {
        let piece = match read_piece(&api, job, cursor, STREAM_CHUNK).await {
            Ok(p) => p,
            Err(e) => {
                let _ = tx.send(Err(std::io::Error::other(e.error))).await;
                return;
            }
        };
        if let Some(g) = &piece.gap {
            if tx.send(Ok(Bytes::from(gap_line(g)))).await.is_err() {
                return;
            }
        }
        let progressed = piece.next != cursor;
        if !piece.bytes.is_empty() && tx.send(Ok(piece.bytes)).await.is_err() {
            return; // the client went away
        }
        cursor = piece.next;
        if piece.done {
            return;
        }
        if progressed {
            continue;
        }
        if !follow {
            return;
        }
        // Caught up: wait for news. A job deleted meanwhile (retention) ends the stream.
        news(&mut sub, job, Duration::from_millis(500)).await;
        let gone = read(&api, move |r| r.job(job))
            .await
            .ok()
            .flatten()
            .is_none();
        if gone {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_bodies_name_the_field() {
        let e = parse_body::<SubmitBody>(b"{}").unwrap_err();
        assert_eq!(e.field.as_deref(), Some("command"));
        let e = parse_body::<SubmitBody>(br#"{"command": 5}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("command"));
        let e = parse_body::<SubmitBody>(br#"{"command": "x", "labels": "a"}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("labels"));
        let e = parse_body::<SubmitBody>(br#"{"command": "x", "bogus": 1}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("bogus"));
        let e = parse_body::<SubmitBody>(br#"{"command": "x", "timeout_secs": -1}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("timeout_secs"));
        let e = no_control("owner", "a\0b", false).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("owner"));
        assert!(e.error.contains("U+0000"), "{}", e.error);
        assert!(no_control("command", "echo a\n\techo b", true).is_ok());
        assert!(no_control("command", "echo \u{1b}[2J", true).is_err());
        let e = parse_body::<SubmitBody>(b"{not json").unwrap_err();
        assert_eq!(e.field.as_deref(), Some("body"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn tokens_compare_equal_only_when_equal() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }

    /// M34: a pinned job's waiting reason names its node and what that node lacks.
    #[test]
    fn m34_a_pinned_jobs_waiting_reason_names_its_node() {
        let node = |name: &str, state: &'static str| crate::mill_driver::NodeView {
            node: name.into(),
            state,
            epoch: None,
            labels: vec!["gpu".into()],
            engines: vec!["shell".into()],
            capacity: 4,
            leases: 0,
            running: 0,
            grace_until_ms: None,
        };
        let nodes = [node("a", "ready"), node("q", "quarantined")];
        let pin = |n: &str| NodeId::new(n).unwrap();
        let none = BTreeSet::new();
        let why = |engine: &str, labels: &BTreeSet<String>, p: &str| {
            unplaceable(engine, labels, Some(&pin(p)), &nodes).unwrap_or_default()
        };
        assert_eq!(unplaceable("shell", &none, Some(&pin("a")), &nodes), None);
        assert!(why("shell", &none, "ghost").contains("ghost, which is not connected"));
        assert!(why("shell", &none, "q").contains("q, which is quarantined"));
        assert!(why("docker", &none, "a").contains("does not offer engine docker"));
        let labels: BTreeSet<String> = ["gpu".into(), "arm".into()].into();
        assert!(why("shell", &labels, "a").ends_with("does not hold the labels arm"));
    }
}
