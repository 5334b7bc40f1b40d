//! The web page (`/ui`, issue 18 item 2): jobs, a job with its attempts and live log, and
//! nodes. Plain HTML, CSS and one script, embedded in the binary; the page reads the same
//! JSON API (`/v1/...`) a script would, with the browser's session cookie in place of the
//! bearer token.
//!
//! The credential: `POST /ui/login` takes the API token (compared in constant time) and sets
//! a cookie holding a random session id, never the token itself, so a leaked cookie jar
//! leaks a session that expires and can be logged out, not the token. The node keeps the
//! SHA-256 of each id (a lookup by hash leaks nothing useful by its timing) in a bounded map
//! (`--ui-max-sessions`, `--ui-session-ttl`). A cookie-authenticated request that changes state
//! must carry [`CSRF_HEADER`]: a cross-site form cannot set it, and a cross-site `fetch`
//! with it needs a CORS preflight the node never grants; `SameSite=Strict` alone does not
//! protect older browsers.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::rejection::FormRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::http::{constant_time_eq, Api, HttpLimits};

/// The session cookie's name.
pub const COOKIE: &str = "millrace_session";
/// The header a cookie-authenticated request that changes state must carry (value `1`).
pub const CSRF_HEADER: &str = "x-millrace-ui";
/// Default of `--ui-max-sessions`, the most sessions at once: a login past it ends the
/// oldest session (every login needs the token, so only its holders can push others out).
pub const DEFAULT_MAX_SESSIONS: usize = 256;
/// Default of `--ui-session-ttl`, how long a session lasts after its login: a working day.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Largest body of a login or logout.
const MAX_FORM: usize = 4 * 1024;

/// What every `/ui` answer carries: no script, style, image or connection but the node's
/// own, no inline script or style, no framing, no referrer.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

const SHELL: &str = include_str!("ui/shell.html");
const LOGIN: &str = include_str!("ui/login.html");
const APP_JS: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

/// Logged-in browsers: SHA-256 of the session id → when the session ends.
#[derive(Debug)]
pub struct Sessions {
    /// Set `Secure` on the cookie: the node serves TLS.
    secure: bool,
    /// How long a session lasts.
    ttl: Duration,
    /// Most sessions at once.
    max: usize,
    live: Mutex<BTreeMap<[u8; 32], Instant>>,
}

/// How a request's cookie stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CookieAuth {
    /// A live session, and a read or the [`CSRF_HEADER`].
    Admitted,
    /// A live session, but a request that changes state without the [`CSRF_HEADER`].
    NoCsrfHeader,
    /// No cookie, or no live session by its id.
    Missing,
}

/// Why a session could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The operating system gave no random bytes for the session id.
    #[error("no randomness for a session id: {0}")]
    Random(#[from] getrandom::Error),
}

fn digest(id: &str) -> [u8; 32] {
    Sha256::digest(id.as_bytes()).into()
}

impl Sessions {
    /// No sessions yet; `secure` when the HTTP listener serves TLS; each lasts `ttl`, at
    /// most `max` (at least 1) at once.
    pub fn new(secure: bool, ttl: Duration, max: usize) -> Self {
        Sessions {
            secure,
            ttl,
            max: max.max(1),
            live: Mutex::new(BTreeMap::new()),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<[u8; 32], Instant>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new session lasting its TTL from `now`: its id (64 hex digits). At the most
    /// sessions it first drops the ended sessions, then the one that ends soonest.
    pub fn open(&self, now: Instant) -> Result<String, SessionError> {
        let mut raw = [0u8; 32];
        getrandom::fill(&mut raw)?;
        let id: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let mut map = self.map();
        if map.len() >= self.max {
            map.retain(|_, until| *until > now);
        }
        if map.len() >= self.max {
            let oldest = map.iter().min_by_key(|(_, until)| **until).map(|(k, _)| *k);
            if let Some(k) = oldest {
                map.remove(&k);
                tracing::warn!(
                    max = self.max,
                    "web UI sessions full: a login ended the oldest session"
                );
            }
        }
        map.insert(digest(&id), now + self.ttl);
        debug_assert!(map.len() <= self.max);
        Ok(id)
    }

    /// Whether `id` names a session live at `now` (an ended one is dropped).
    pub fn live(&self, id: &str, now: Instant) -> bool {
        let key = digest(id);
        let mut map = self.map();
        match map.get(&key) {
            Some(until) if *until > now => true,
            Some(_) => {
                map.remove(&key);
                false
            }
            None => false,
        }
    }

    /// Ends the session `id`, if any.
    pub fn close(&self, id: &str) {
        self.map().remove(&digest(id));
    }

    /// Sessions held (ended ones included until pruned).
    pub fn count(&self) -> usize {
        self.map().len()
    }

    /// How the cookie of a request with `method` and `headers` stands.
    pub fn admit(&self, method: &Method, headers: &HeaderMap) -> CookieAuth {
        let Some(id) = cookie(headers) else {
            return CookieAuth::Missing;
        };
        if !self.live(id, Instant::now()) {
            return CookieAuth::Missing;
        }
        let reads = matches!(*method, Method::GET | Method::HEAD);
        if reads || csrf_header(headers) {
            CookieAuth::Admitted
        } else {
            CookieAuth::NoCsrfHeader
        }
    }

    fn set_cookie(&self, id: &str) -> String {
        let secure = if self.secure { "; Secure" } else { "" };
        format!(
            "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{secure}",
            self.ttl.as_secs()
        )
    }

    fn clear_cookie(&self) -> String {
        let secure = if self.secure { "; Secure" } else { "" };
        format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0{secure}")
    }
}

/// The session id in the request's `Cookie` headers, if any.
fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

fn csrf_header(headers: &HeaderMap) -> bool {
    headers
        .get(CSRF_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1")
}

/// The `/ui` routes. They sit outside the API's JSON error layer: their errors are pages.
pub fn routes(limits: &HttpLimits) -> Router<Api> {
    let app = Router::new()
        .route("/ui", get(to_jobs))
        .route("/ui/", get(to_jobs))
        .route("/ui/login", get(login_page).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/jobs", get(jobs_page))
        .route("/ui/jobs/{id}", get(job_page))
        .route("/ui/nodes", get(nodes_page))
        .route("/ui/app.js", get(app_js))
        .route("/ui/style.css", get(style))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_FORM));
    crate::http::with_body_timeout(app, limits.body_timeout)
        .layer(middleware::from_fn(guard_headers))
}

/// Every `/ui` answer: the CSP, no sniffing, no framing, no referrer, no caching.
async fn guard_headers(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn see_other(to: &'static str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

fn html(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body,
    )
        .into_response()
}

#[utoipa::path(
    get,
    path = "/ui",
    operation_id = "ui_root",
    tag = "web UI",
    summary = "Redirects to /ui/jobs",
    responses(
        (status = 303, description = "To /ui/jobs.", headers(("Location" = String))),
    ),
    security(())
)]
pub(crate) async fn to_jobs() -> Response {
    see_other("/ui/jobs")
}

/// The login form, with `message` (fixed text, never request data) above it.
fn login_form(status: StatusCode, message: &str) -> Response {
    html(status, LOGIN.replace("{{message}}", message))
}

#[utoipa::path(
    get,
    path = "/ui/login",
    operation_id = "ui_login_page",
    tag = "web UI",
    summary = "The login form",
    responses(
        (status = 200, description = "The form.", content_type = "text/html; charset=utf-8", body = String),
    ),
    security(())
)]
pub(crate) async fn login_page() -> Response {
    login_form(StatusCode::OK, "")
}

/// The login form's fields.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct LoginForm {
    /// The API token.
    pub token: String,
}

#[utoipa::path(
    post,
    path = "/ui/login",
    operation_id = "ui_login",
    tag = "web UI",
    summary = "Log in with the API token; sets an HttpOnly session cookie",
    request_body(content = LoginForm, content_type = "application/x-www-form-urlencoded"),
    responses(
        (status = 303, description = "Logged in: to /ui/jobs, with Set-Cookie.", headers(("Location" = String), ("Set-Cookie" = String))),
        (status = 400, description = "The form lacks `token`.", content_type = "text/html; charset=utf-8", body = String),
        (status = 401, description = "Wrong token.", content_type = "text/html; charset=utf-8", body = String),
        (status = 413, description = "The form is larger than 4 KiB.", content_type = "text/html; charset=utf-8", body = String),
        (status = 503, description = "No session id could be made.", content_type = "text/html; charset=utf-8", body = String),
    ),
    security(())
)]
pub(crate) async fn login(
    State(api): State<Api>,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    let form = match form {
        Ok(Form(form)) => form,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return login_form(
                StatusCode::PAYLOAD_TOO_LARGE,
                "The form is larger than a login needs (4 KiB).",
            )
        }
        Err(_) => {
            return login_form(
                StatusCode::BAD_REQUEST,
                "The form needs one field, token (application/x-www-form-urlencoded).",
            )
        }
    };
    if !constant_time_eq(form.token.as_bytes(), api.token.as_bytes()) {
        tracing::warn!("web UI login refused: wrong token");
        return login_form(StatusCode::UNAUTHORIZED, "Wrong token.");
    }
    match api.ui.open(Instant::now()) {
        Ok(id) => {
            tracing::info!(sessions = api.ui.count(), "web UI login");
            let mut resp = see_other("/ui/jobs");
            if let Ok(v) = HeaderValue::from_str(&api.ui.set_cookie(&id)) {
                resp.headers_mut().insert(header::SET_COOKIE, v);
            }
            resp
        }
        Err(e) => {
            tracing::error!(error = %e, "web UI login failed");
            login_form(
                StatusCode::SERVICE_UNAVAILABLE,
                "The node could not make a session id; see its log.",
            )
        }
    }
}

/// `POST /ui/logout` with the session cookie and [`CSRF_HEADER`]: ends the session.
#[utoipa::path(
    post,
    path = "/ui/logout",
    operation_id = "ui_logout",
    tag = "web UI",
    summary = "Ends the web UI session",
    responses(
        (status = 204, description = "Ended; the cookie is cleared."),
        (status = 403, description = "The X-Millrace-UI: 1 header is missing (CSRF guard).", content_type = "text/plain; charset=utf-8", body = String),
    ),
    security(())
)]
pub(crate) async fn logout(State(api): State<Api>, req: Request) -> Response {
    let headers = req.headers();
    if !csrf_header(headers) {
        return (
            StatusCode::FORBIDDEN,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "logout needs the header X-Millrace-UI: 1\n",
        )
            .into_response();
    }
    if let Some(id) = cookie(headers) {
        api.ui.close(id);
    }
    let mut resp = StatusCode::NO_CONTENT.into_response();
    if let Ok(v) = HeaderValue::from_str(&api.ui.clear_cookie()) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

/// The page `name` for a live session; the login form otherwise.
fn page(api: &Api, headers: &HeaderMap, name: &'static str) -> Response {
    match api.ui.admit(&Method::GET, headers) {
        CookieAuth::Admitted => html(StatusCode::OK, SHELL.replace("{{page}}", name)),
        CookieAuth::NoCsrfHeader | CookieAuth::Missing => see_other("/ui/login"),
    }
}

#[utoipa::path(
    get,
    path = "/ui/jobs",
    operation_id = "ui_jobs",
    tag = "web UI",
    summary = "The jobs page",
    responses(
        (status = 200, description = "The page (its data comes from the API by script).", content_type = "text/html; charset=utf-8", body = String),
        (status = 303, description = "To /ui/login without a session (or from /ui to /ui/jobs).", headers(("Location" = String))),
    ),
    security(())
)]
pub(crate) async fn jobs_page(State(api): State<Api>, headers: HeaderMap) -> Response {
    page(&api, &headers, "jobs")
}

#[utoipa::path(
    get,
    path = "/ui/jobs/{id}",
    operation_id = "ui_job",
    tag = "web UI",
    summary = "A job's page",
    params(
        ("id" = String, Path, description = "A job id."),
    ),
    responses(
        (status = 200, description = "The page (its data comes from the API by script).", content_type = "text/html; charset=utf-8", body = String),
        (status = 303, description = "To /ui/login without a session (or from /ui to /ui/jobs).", headers(("Location" = String))),
    ),
    security(())
)]
pub(crate) async fn job_page(State(api): State<Api>, headers: HeaderMap) -> Response {
    page(&api, &headers, "job")
}

#[utoipa::path(
    get,
    path = "/ui/nodes",
    operation_id = "ui_nodes",
    tag = "web UI",
    summary = "The nodes page",
    responses(
        (status = 200, description = "The page (its data comes from the API by script).", content_type = "text/html; charset=utf-8", body = String),
        (status = 303, description = "To /ui/login without a session (or from /ui to /ui/jobs).", headers(("Location" = String))),
    ),
    security(())
)]
pub(crate) async fn nodes_page(State(api): State<Api>, headers: HeaderMap) -> Response {
    page(&api, &headers, "nodes")
}

#[utoipa::path(
    get,
    path = "/ui/app.js",
    operation_id = "ui_app_js",
    tag = "web UI",
    summary = "The pages' script",
    responses(
        (status = 200, description = "JavaScript.", content_type = "text/javascript; charset=utf-8", body = String),
    ),
    security(())
)]
pub(crate) async fn app_js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        APP_JS,
    )
        .into_response()
}

#[utoipa::path(
    get,
    path = "/ui/style.css",
    operation_id = "ui_style",
    tag = "web UI",
    summary = "The pages' style sheet",
    responses(
        (status = 200, description = "CSS.", content_type = "text/css; charset=utf-8", body = String),
    ),
    security(())
)]
pub(crate) async fn style() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cookie(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn a_session_lives_until_its_ttl_and_until_logout() {
        let s = Sessions::new(false, DEFAULT_SESSION_TTL, DEFAULT_MAX_SESSIONS);
        let t0 = Instant::now();
        let id = s.open(t0).unwrap();
        assert_eq!(id.len(), 64);
        assert!(s.live(&id, t0 + DEFAULT_SESSION_TTL - Duration::from_secs(1)));
        assert!(!s.live(&id, t0 + DEFAULT_SESSION_TTL));
        assert_eq!(s.count(), 0, "an ended session is dropped when seen");
        let id = s.open(t0).unwrap();
        s.close(&id);
        assert!(!s.live(&id, t0));
    }

    #[test]
    fn sessions_are_bounded_and_the_oldest_goes_first() {
        let s = Sessions::new(false, DEFAULT_SESSION_TTL, 8);
        let t0 = Instant::now();
        let first = s.open(t0).unwrap();
        let ids: Vec<String> = (1..=8)
            .map(|i| s.open(t0 + Duration::from_secs(i)).unwrap())
            .collect();
        assert_eq!(s.count(), 8);
        let later = t0 + Duration::from_secs(9);
        assert!(!s.live(&first, later), "the oldest session was ended");
        assert!(ids.iter().all(|id| s.live(id, later)));
    }

    #[test]
    fn writes_by_cookie_need_the_csrf_header() {
        let s = Sessions::new(true, DEFAULT_SESSION_TTL, DEFAULT_MAX_SESSIONS);
        let id = s.open(Instant::now()).unwrap();
        let mut h = with_cookie(&format!("other=1; {COOKIE}={id}"));
        assert_eq!(s.admit(&Method::GET, &h), CookieAuth::Admitted);
        assert_eq!(s.admit(&Method::POST, &h), CookieAuth::NoCsrfHeader);
        h.insert(CSRF_HEADER, HeaderValue::from_static("1"));
        assert_eq!(s.admit(&Method::POST, &h), CookieAuth::Admitted);
        let forged = with_cookie(&format!("{COOKIE}={}", "0".repeat(64)));
        assert_eq!(s.admit(&Method::GET, &forged), CookieAuth::Missing);
        assert_eq!(
            s.admit(&Method::GET, &HeaderMap::new()),
            CookieAuth::Missing
        );
        assert!(s.set_cookie(&id).contains("; Secure"));
        assert!(s
            .set_cookie(&id)
            .contains("HttpOnly; SameSite=Strict; Path=/"));
    }
}
