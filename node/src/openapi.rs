//! The HTTP API's OpenAPI 3.1 document (issue 18 item 1), derived by utoipa from the
//! handlers' `#[utoipa::path]` attributes and the request and answer types themselves, so
//! it cannot drift from what the code parses and writes. Served at `GET /v1/openapi.json`
//! (open, like `/health`: it says nothing about jobs, and client generators fetch it before
//! they hold a token); a copy is checked in at `docs/openapi.json`, which a test keeps equal
//! to this one (`millrace openapi > docs/openapi.json` rewrites it).

use axum::http::header;
use axum::response::{IntoResponse, Response};
use millrace_core::job::RetryOn;
use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{HttpMethod, RefOr};
use utoipa::{Modify, OpenApi};

use crate::http;
use crate::ui;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "millrace",
        description = "The mill's HTTP API: submit CI jobs, follow them and their output, see the executors and the quota ledger. Every route but /health, /v1/openapi.json and the /ui pages wants `Authorization: Bearer <api-token>` (the token in the mill's DATA/api-token) or the web UI's session cookie. Every error answer is JSON `{\"error\", \"field\"?}`, `field` naming what in the request was wrong. u64 values that exceed what JSON numbers keep exactly (store epochs) are decimal strings. A standby mill (DESIGN §10) answers /health with role `standby` and everything else with 503 naming the leader.",
        license(name = "MIT OR Apache-2.0"),
    ),
    paths(
        http::submit,
        http::list,
        http::submit_batch,
        http::status,
        http::cancel,
        http::log,
        http::nodes,
        http::quota,
        http::lift,
        http::metrics,
        http::health,
        openapi_json,
        ui::to_jobs,
        ui::login_page,
        ui::login,
        ui::logout,
        ui::jobs_page,
        ui::job_page,
        ui::nodes_page,
        ui::app_js,
        ui::style,
    ),
    components(schemas(http::ErrorBody)),
    modifiers(&Security, &Links),
    tags((name = "web UI", description = "The browser pages (issue 18 item 2): HTML, behind a login form; not for programs."))
)]
struct ApiDoc;

/// The two credentials the protected routes take.
struct Security;

impl Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The mill's API token (DATA/api-token)."))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "ui_session",
            SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
                crate::ui::COOKIE,
                "The web UI's session cookie (POST /ui/login); a request that changes state with it also needs the header X-Millrace-UI: 1.",
            ))),
        );
    }
}

/// OpenAPI links from the answers that name a job to the operations on it, so a client (and
/// schemathesis's stateful phase) can follow a submitted job: status, log, cancel.
struct Links;

impl Modify for Links {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let on_job = |id: &str| {
            [
                ("get_job", "GetJob"),
                ("job_log", "JobLog"),
                ("cancel_job", "CancelJob"),
            ]
            .map(|(op, name)| {
                let link = LinkBuilder::new()
                    .operation_id(op)
                    .parameter("id", id)
                    .build();
                (name.to_string(), RefOr::T(link))
            })
        };
        let targets = [
            ("/v1/jobs", HttpMethod::Post, "201", "$response.body#/id"),
            ("/v1/jobs", HttpMethod::Post, "200", "$response.body#/id"),
        ];
        for (path, method, status, id) in targets {
            let op = doc.paths.paths.get_mut(path).and_then(|item| match method {
                HttpMethod::Post => item.post.as_mut(),
                _ => item.get.as_mut(),
            });
            if let Some(RefOr::T(resp)) = op.and_then(|op| op.responses.responses.get_mut(status)) {
                resp.links.extend(on_job(id));
            }
        }
    }
}

/// `retry_on`: a set of the stable names of [`RetryOn`], taken from the type itself.
pub fn retry_on_set() -> impl Into<RefOr<Schema>> {
    let names: Vec<&str> = RetryOn::ALL.iter().map(|r| r.name()).collect();
    ArrayBuilder::new()
        .schema_type(utoipa::openapi::schema::SchemaType::from_iter([
            Type::Array,
            Type::Null,
        ]))
        .unique_items(true)
        .items(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(names)),
        )
        .description(Some(
            "Which ends retry; default executor_lost, executor_restarted, no_longer_has_job (M32).",
        ))
}

/// A label, engine or resource name (`valid_name` in core): 1 to 64 printable ASCII
/// characters.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, pattern = "^[!-~]{1,64}$")]
pub struct Name(#[allow(dead_code, reason = "a schema only")] String);

/// A resource amount (M14): 1 to 2^53.
#[derive(utoipa::ToSchema)]
#[schema(value_type = u64, minimum = 1, maximum = 9007199254740992_u64)]
pub struct Amount(#[allow(dead_code, reason = "a schema only")] u64);

/// An environment variable's name: `[A-Za-z_][A-Za-z0-9_]*`, at most 256 bytes, not starting
/// `MILLRACE_` (names millrace sets itself).
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, pattern = "^(?!MILLRACE_)[A-Za-z_][A-Za-z0-9_]{0,255}$")]
pub struct EnvName(#[allow(dead_code, reason = "a schema only")] String);

/// The document, as pretty JSON with a final newline (the form checked in).
pub fn document() -> String {
    let mut text = ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    operation_id = "openapi",
    summary = "This document; no token needed",
    responses((status = 200, description = "The OpenAPI 3.1 document.", content_type = "application/json", body = Object)),
    security(())
)]
pub(crate) async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document()).into_response()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    const CHECKED_IN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json");

    /// Issue 18 item 1: docs/openapi.json is the document the code generates.
    #[test]
    fn checked_in_document_is_the_generated_one() {
        let generated = document();
        let checked_in = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
        if std::env::var_os("MILLRACE_WRITE_OPENAPI").is_some() {
            std::fs::write(CHECKED_IN, &generated).unwrap();
            return;
        }
        assert!(
            checked_in == generated,
            "docs/openapi.json differs from the document the code generates; rewrite it with \
             `cargo run -p node -- openapi > docs/openapi.json` (or MILLRACE_WRITE_OPENAPI=1 \
             cargo test -p node openapi)"
        );
    }

    /// The `(method, path)` of every `.route(...)` in `source`, as axum spells them.
    fn routes_in(source: &str) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        for chunk in source.split(".route(\"").skip(1) {
            let Some((path, rest)) = chunk.split_once('"') else {
                continue;
            };
            let call = rest.split(".route(").next().unwrap_or(rest);
            let call = call.split(".layer(").next().unwrap_or(call);
            for method in ["get", "post", "put", "delete", "patch"] {
                let direct = format!(", {method}(");
                let chained = format!(".{method}(");
                if call.contains(&direct) || call.contains(&chained) {
                    out.insert((method.to_string(), path.to_string()));
                }
            }
        }
        out
    }

    /// Every route the router serves is in the document, and nothing else is: a new route
    /// without `#[utoipa::path]` fails here.
    #[test]
    fn every_route_is_documented() {
        let doc: serde_json::Value = serde_json::from_str(&document()).unwrap();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                documented.insert((method.clone(), path.clone()));
            }
        }
        let mut served = routes_in(include_str!("http.rs"));
        served.extend(routes_in(include_str!("ui.rs")));
        served.extend(routes_in(include_str!("node.rs")));
        // `/ui/` is `/ui` with a slash, the same handler.
        served.remove(&("get".to_string(), "/ui/".to_string()));
        assert!(served.len() >= 20, "found only {served:?}");
        assert_eq!(served, documented);
    }

    /// Values JSON numbers cannot keep (random u64 epochs) are strings in the document too.
    #[test]
    fn epochs_are_strings_and_errors_have_one_shape() {
        let doc: serde_json::Value = serde_json::from_str(&document()).unwrap();
        let schemas = &doc["components"]["schemas"];
        assert_eq!(
            schemas["AttemptRow"]["properties"]["epoch"]["type"],
            "string"
        );
        let node_epoch = &schemas["NodeView"]["properties"]["epoch"]["type"];
        assert!(node_epoch.to_string().contains("string"), "{node_epoch}");
        assert_eq!(doc["openapi"].as_str().map(|v| &v[..3]), Some("3.1"));
        // Every error status of every API operation answers the one error shape.
        for (path, item) in doc["paths"].as_object().unwrap() {
            if path.starts_with("/ui") {
                continue;
            }
            for (method, op) in item.as_object().unwrap() {
                for (status, resp) in op["responses"].as_object().unwrap() {
                    if status.starts_with('4') || status.starts_with('5') {
                        let schema = &resp["content"]["application/json"]["schema"]["$ref"];
                        assert_eq!(
                            schema, "#/components/schemas/ErrorBody",
                            "{method} {path} {status}"
                        );
                    }
                }
            }
        }
    }
}
