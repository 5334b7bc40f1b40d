//! Issue 18 item 2, the web UI's credential and headers through the real binary on loopback:
//! the login form sets an HttpOnly session cookie only for the right token; the cookie reads
//! the API; a cookie-authenticated write without `X-Millrace-UI: 1` is refused (CSRF) and
//! with it goes through; logout ends the session; bodies are bounded; every `/ui` answer has
//! its content type and the strict CSP, and no asset names an outside URL.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::path::Path;

use common::{Mill, Proc};
use serde_json::json;

fn start(root: &Path) -> (Mill, Proc) {
    common::start_mill_and_x1(root, &[], 0, 2)
}

/// An answer: status, headers we look at, body.
struct Answer {
    status: u16,
    set_cookie: Option<String>,
    location: Option<String>,
    content_type: Option<String>,
    csp: Option<String>,
    body: String,
}

/// A browser-like client: no redirects followed, no bearer token; `cookie` and extra
/// headers as given.
fn call(
    mill: &Mill,
    method: &str,
    path: &str,
    cookie: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<(&str, &str)>,
) -> Answer {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into();
    let url = format!("{}{path}", mill.api.base);
    let mut req = ureq::http::Request::builder().method(method).uri(url);
    if let Some(c) = cookie {
        req = req.header("Cookie", format!("millrace_session={c}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let (ctype, text) = body.unwrap_or(("text/plain", ""));
    let req = req
        .header("Content-Type", ctype)
        .body(text.to_string())
        .unwrap();
    let mut r = agent.run(req).unwrap();
    let h = |name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (set_cookie, location, content_type, csp) = (
        h("set-cookie"),
        h("location"),
        h("content-type"),
        h("content-security-policy"),
    );
    Answer {
        status: r.status().as_u16(),
        set_cookie,
        location,
        content_type,
        csp,
        body: r.body_mut().read_to_string().unwrap_or_default(),
    }
}

fn login(mill: &Mill, token: &str) -> Answer {
    let form = format!("token={}", token);
    call(
        mill,
        "POST",
        "/ui/login",
        None,
        &[],
        Some(("application/x-www-form-urlencoded", &form)),
    )
}

/// The session id a successful login set.
fn session_of(a: &Answer) -> String {
    let c = a.set_cookie.as_deref().expect("a Set-Cookie header");
    let value = c.split(';').next().unwrap();
    value.strip_prefix("millrace_session=").unwrap().to_string()
}

#[test]
fn ui_login_sets_a_cookie_only_for_the_right_token_and_logout_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mut mill, mut exec) = start(dir.path());
    let token = common::api_token(&mill.data);

    // Not logged in: the pages send the browser to the login form; the API refuses.
    let a = call(&mill, "GET", "/ui/jobs", None, &[], None);
    assert_eq!(a.status, 303);
    assert_eq!(a.location.as_deref(), Some("/ui/login"));
    let a = call(&mill, "GET", "/ui", None, &[], None);
    assert_eq!((a.status, a.location.as_deref()), (303, Some("/ui/jobs")));
    assert_eq!(call(&mill, "GET", "/v1/jobs", None, &[], None).status, 401);

    // A wrong token: the form again, no cookie.
    let a = login(&mill, "not-the-token");
    assert_eq!(a.status, 401);
    assert!(a.set_cookie.is_none(), "{:?}", a.set_cookie);
    assert!(a.body.contains("Wrong token."), "{}", a.body);
    let a = call(
        &mill,
        "POST",
        "/ui/login",
        None,
        &[],
        Some(("application/x-www-form-urlencoded", "password=x")),
    );
    assert_eq!(a.status, 400);
    assert!(a.set_cookie.is_none());

    // The right token: a session cookie, HttpOnly and SameSite=Strict, not the token.
    let a = login(&mill, &token);
    assert_eq!((a.status, a.location.as_deref()), (303, Some("/ui/jobs")));
    let cookie = a.set_cookie.clone().unwrap();
    for part in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(cookie.contains(part), "{cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    assert!(
        !cookie.contains(&token),
        "the cookie must not carry the token"
    );
    let session = session_of(&a);
    assert_eq!(session.len(), 64);

    // The cookie reads the API and the pages.
    let a = call(&mill, "GET", "/v1/jobs", Some(&session), &[], None);
    assert_eq!(a.status, 200, "{}", a.body);
    let a = call(&mill, "GET", "/ui/jobs", Some(&session), &[], None);
    assert_eq!(a.status, 200);
    assert!(a.body.contains(r#"data-page="jobs""#), "{}", a.body);
    // A forged session id reads nothing.
    let forged = "0".repeat(64);
    assert_eq!(
        call(&mill, "GET", "/v1/jobs", Some(&forged), &[], None).status,
        401
    );

    // CSRF: a cookie write without the header is refused and changes nothing; with it, the
    // cancel goes through.
    let id = mill.api.submit(&json!({"command": "sleep 60"}));
    mill.api.wait_state(id, |s| s == "running", "running");
    let cancel = format!("/v1/jobs/{id}/cancel");
    let a = call(&mill, "POST", &cancel, Some(&session), &[], None);
    assert_eq!(a.status, 403, "{}", a.body);
    assert!(a.body.contains("X-Millrace-UI"), "{}", a.body);
    let a = call(
        &mill,
        "POST",
        "/v1/jobs",
        Some(&session),
        &[],
        Some(("application/json", r#"{"command": "true"}"#)),
    );
    assert_eq!(
        a.status, 403,
        "a cookie submit without the header: {}",
        a.body
    );
    assert_eq!(mill.api.job(id).unwrap()["state"], "running");
    assert_eq!(
        common::all_jobs(&mill.api).len(),
        1,
        "nothing was submitted"
    );
    let a = call(
        &mill,
        "POST",
        &cancel,
        Some(&session),
        &[("X-Millrace-UI", "1")],
        None,
    );
    assert_eq!(a.status, 202, "{}", a.body);
    let done = mill.api.wait_done(id);
    assert_eq!(done["state"], "cancelled");

    // The quarantine lift is a write too: refused without the header; with it, it reaches
    // the mill (which has no quarantine for x1: 409).
    let lift = "/v1/nodes/x1/quarantine/lift";
    assert_eq!(
        call(&mill, "POST", lift, Some(&session), &[], None).status,
        403
    );
    let a = call(
        &mill,
        "POST",
        lift,
        Some(&session),
        &[("X-Millrace-UI", "1")],
        None,
    );
    assert_eq!(a.status, 409, "{}", a.body);

    // Logout needs the header too; then the session reads nothing.
    let a = call(&mill, "POST", "/ui/logout", Some(&session), &[], None);
    assert_eq!(a.status, 403);
    assert_eq!(
        call(&mill, "GET", "/v1/jobs", Some(&session), &[], None).status,
        200,
        "a refused logout leaves the session"
    );
    let a = call(
        &mill,
        "POST",
        "/ui/logout",
        Some(&session),
        &[("X-Millrace-UI", "1")],
        None,
    );
    assert_eq!(a.status, 204);
    assert!(a.set_cookie.unwrap().contains("Max-Age=0"));
    assert_eq!(
        call(&mill, "GET", "/v1/jobs", Some(&session), &[], None).status,
        401
    );
    let a = call(&mill, "GET", "/ui/nodes", Some(&session), &[], None);
    assert_eq!((a.status, a.location.as_deref()), (303, Some("/ui/login")));

    // The bearer token still works alone, and a wrong one is not rescued by a cookie.
    assert_eq!(mill.api.get("/v1/jobs").0, 200);
    let fresh = session_of(&login(&mill, &token));
    let a = call(
        &mill,
        "GET",
        "/v1/jobs",
        Some(&fresh),
        &[("Authorization", "Bearer wrong")],
        None,
    );
    assert_eq!(a.status, 401);

    exec.term();
    mill.proc.term();
}

#[test]
fn ui_answers_carry_their_types_and_the_csp_and_bound_their_bodies() {
    let dir = tempfile::tempdir().unwrap();
    let (mut mill, mut exec) = start(dir.path());
    let token = common::api_token(&mill.data);
    let session = session_of(&login(&mill, &token));

    let csp = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
               connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";
    let pages = [
        ("/ui/login", "text/html; charset=utf-8", "<form"),
        ("/ui/jobs", "text/html; charset=utf-8", "/ui/app.js"),
        (
            "/ui/jobs/1",
            "text/html; charset=utf-8",
            r#"data-page="job""#,
        ),
        (
            "/ui/nodes",
            "text/html; charset=utf-8",
            r#"data-page="nodes""#,
        ),
        (
            "/ui/app.js",
            "text/javascript; charset=utf-8",
            "X-Millrace-UI",
        ),
        ("/ui/style.css", "text/css; charset=utf-8", "pre.log"),
    ];
    for (path, ctype, holds) in pages {
        let a = call(&mill, "GET", path, Some(&session), &[], None);
        assert_eq!(a.status, 200, "{path}");
        assert_eq!(a.content_type.as_deref(), Some(ctype), "{path}");
        assert_eq!(a.csp.as_deref(), Some(csp), "{path}");
        assert!(a.body.contains(holds), "{path} lacks {holds}");
        // Everything is embedded: no asset names another origin, and no page has inline
        // script or style.
        for outside in [
            "http://", "https://", "//cdn", "<script>", "style=", "onclick",
        ] {
            assert!(!a.body.contains(outside), "{path} holds {outside:?}");
        }
    }

    // Bodies are bounded: a login form past 4 KiB is refused and sets nothing.
    let big = format!("token={}", "a".repeat(8 * 1024));
    let a = call(
        &mill,
        "POST",
        "/ui/login",
        None,
        &[],
        Some(("application/x-www-form-urlencoded", &big)),
    );
    assert_eq!(a.status, 413);
    assert!(a.set_cookie.is_none());
    // An unknown /ui path is a 404.
    assert_eq!(
        call(&mill, "GET", "/ui/bogus", Some(&session), &[], None).status,
        404
    );

    exec.term();
    mill.proc.term();
}
