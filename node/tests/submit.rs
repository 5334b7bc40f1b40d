//! Issue 13 items 1 and 6 through the real binary on loopback: idempotent submit (M31) with
//! the `Idempotency-Key` header and `millrace submit --key`, across a mill restart and
//! retention; a job's `env` reaching its process; `submit --wait` exiting with the job's
//! code; `GET /v1/jobs` pages and `millrace jobs --all`. Waits poll with a bound and assert
//! outcomes, never wall-clock durations.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::path::Path;

use common::{cli, start_mill, timing, wait_for, Mill, Proc};
use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Value};

fn start(root: &Path, extra: &[&str], n: usize) -> (Mill, Proc) {
    common::start_mill_and_x1(root, extra, n, 4)
}

/// POST `path` with an `Idempotency-Key` header.
fn post_keyed(mill: &Mill, path: &str, key: &str, body: &Value) -> (u16, Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let token = common::api_token(&mill.data);
    let mut r = agent
        .post(format!("{}{path}", mill.api.base))
        .header("Authorization", &format!("Bearer {token}"))
        .header("Idempotency-Key", key)
        .send_json(body)
        .unwrap();
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// POST /v1/jobs with an `Idempotency-Key` header.
fn submit_keyed(mill: &Mill, key: &str, body: &Value) -> (u16, Value) {
    post_keyed(mill, "/v1/jobs", key, body)
}

fn job_rows(mill: &Mill) -> i64 {
    let db = Connection::open_with_flags(
        mill.data.join("mill.db"),
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .unwrap();
    db.query_row("SELECT count(*) FROM jobs", [], |r| r.get(0))
        .unwrap()
}

/// M31: the same key and spec answer the same job (200, one row); another spec under the
/// key is a 409 naming it; a bad key is a 400 naming the header; after a mill restart the
/// key still maps, also through `millrace submit --key`.
#[test]
fn m31_idempotent_submit_survives_a_mill_restart() {
    let root = tempfile::tempdir().unwrap();
    let (mut mill, _exec) = start(root.path(), &[], 0);
    let spec = json!({"command": "echo once", "labels": []});
    let (s, first) = submit_keyed(&mill, "build-7", &spec);
    assert_eq!(s, 201, "{first}");
    let id = first["id"].as_u64().unwrap();
    let (s, again) = submit_keyed(&mill, "build-7", &spec);
    assert_eq!((s, again["id"].as_u64()), (200, Some(id)), "{again}");
    assert_eq!(again["existing"], true);
    assert_eq!(job_rows(&mill), 1, "nothing new was stored");

    let (s, conflict) = submit_keyed(&mill, "build-7", &json!({"command": "echo twice"}));
    assert_eq!(s, 409, "{conflict}");
    assert_eq!(conflict["field"], "Idempotency-Key");
    assert!(
        conflict["error"].as_str().unwrap().contains("build-7"),
        "{conflict}"
    );
    let (s, bad) = submit_keyed(&mill, &"k".repeat(257), &spec);
    assert_eq!(
        (s, &bad["field"]),
        (400, &json!("Idempotency-Key")),
        "{bad}"
    );
    assert_eq!(job_rows(&mill), 1);
    assert_eq!(mill.api.wait_done(id)["state"], "success");

    // A restart: the key is durable (M29).
    mill.proc.term();
    let mill = start_mill(root.path(), "127.0.0.1:0", &timing("5s", "2s"), "info", 1);
    let (s, after) = submit_keyed(&mill, "build-7", &spec);
    assert_eq!((s, after["id"].as_u64()), (200, Some(id)), "{after}");
    let (s, _) = submit_keyed(&mill, "build-7", &json!({"command": "echo twice"}));
    assert_eq!(s, 409);
    // The CLI's --key: the same spec answers the same id (the JSON body the CLI sends
    // is the spec above with the defaults spelled out).
    let out = cli(&mill, &["submit", "--key", "cli-1", "--", "echo", "cli"]);
    assert!(out.status.success(), "{out:?}");
    let cli_id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = cli(&mill, &["submit", "--key", "cli-1", "--", "echo", "cli"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), cli_id);
    let out = cli(&mill, &["submit", "--key", "cli-1", "--", "echo", "other"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Idempotency-Key"),
        "{out:?}"
    );
    assert_eq!(job_rows(&mill), 2);
}

/// M31: retention deletes a finished job's key with it; the key then makes a new job.
#[test]
fn m31_keys_expire_with_retention() {
    let root = tempfile::tempdir().unwrap();
    let (mill, _exec) = start(root.path(), &["--retention", "1s"], 0);
    let spec = json!({"command": "true"});
    let (s, v) = submit_keyed(&mill, "nightly", &spec);
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    mill.api.wait_done(id);
    wait_for("retention to delete the job", || {
        (mill.api.get(&format!("/v1/jobs/{id}")).0 == 404).then_some(())
    });
    let (s, v) = submit_keyed(&mill, "nightly", &spec);
    assert_eq!(s, 201, "an expired key makes a new job: {v}");
    assert_ne!(v["id"].as_u64(), Some(id));
}

/// Issue 13 item 6: `--env` reaches the job's process, bad names are a 400 naming `env`,
/// values never reach the logs, and `--wait` exits with the job's own code.
#[test]
fn env_reaches_the_job_and_wait_exits_with_its_code() {
    let root = tempfile::tempdir().unwrap();
    let (mill, exec) = start(root.path(), &[], 0);
    let out = cli(
        &mill,
        &[
            "submit",
            "--wait",
            "--env",
            "GREETING=hello world",
            "--env",
            "SECRET_VALUE=s3cr3t-v4lue",
            "--",
            r#"test "$GREETING" = "hello world" && test -n "$SECRET_VALUE" && echo "got $GREETING"; exit 7"#,
        ],
    );
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("got hello world"),
        "{out:?}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/log"), "says where the log is: {stderr}");
    let out = cli(&mill, &["submit", "--wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = cli(
        &mill,
        &["submit", "--wait", "--timeout", "1s", "--", "sleep 30"],
    );
    assert_eq!(out.status.code(), Some(124), "{out:?}");

    let (s, v) = mill.api.post(
        "/v1/jobs",
        &json!({"command": "true", "env": {"MILLRACE_JOB_ID": "1"}}).to_string(),
    );
    assert_eq!((s, &v["field"]), (400, &json!("env")), "{v}");
    let (s, v) = mill.api.post(
        "/v1/jobs",
        &json!({"command": "true", "env": {"1BAD": "x"}}).to_string(),
    );
    assert_eq!((s, &v["field"]), (400, &json!("env")), "{v}");
    // The status shows the names, never the values.
    let (s, list) = mill.api.get("/v1/jobs?limit=10");
    assert_eq!(s, 200);
    let text = list.to_string();
    assert!(
        text.contains("SECRET_VALUE") && !text.contains("s3cr3t-v4lue"),
        "{text}"
    );
    let logs = format!("{}{}", mill.proc.logs(), exec.logs());
    assert!(!logs.contains("s3cr3t-v4lue"), "an env value reached a log");
}

/// Issue 13 item 6: `GET /v1/jobs?after=&limit=` pages newest first with `next`, and
/// `millrace jobs --all` follows it to the end.
#[test]
fn job_list_pages_with_a_cursor() {
    let root = tempfile::tempdir().unwrap();
    let mill = start_mill(root.path(), "127.0.0.1:0", &[], "info", 0);
    // No executor: the jobs stay queued, which is all a list needs.
    let ids: Vec<u64> = (0..5)
        .map(|i| {
            mill.api
                .submit(&json!({"command": format!("echo page-{i}")}))
        })
        .collect();
    let mut seen = Vec::new();
    let mut path = "/v1/jobs?limit=2".to_string();
    loop {
        let (s, v) = mill.api.get(&path);
        assert_eq!(s, 200, "{v}");
        let page: Vec<u64> = v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_u64().unwrap())
            .collect();
        assert!(page.len() <= 2);
        seen.extend(page);
        match v["next"].as_u64() {
            Some(n) => path = format!("/v1/jobs?limit=2&after={n}"),
            None => break,
        }
    }
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(seen, newest_first, "every job once, newest first");
    let (s, v) = mill.api.get("/v1/jobs?after=nope");
    assert_eq!((s, &v["field"]), (400, &json!("after")), "{v}");

    let out = cli(&mill, &["jobs", "--all", "--limit", "2"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for i in 0..5 {
        assert!(text.contains(&format!("echo page-{i}")), "{text}");
    }
    let out = cli(&mill, &["jobs", "--limit", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 3, "header and one page: {text}");
}

/// Issue 15: `POST /v1/jobs/batch` stores a pipeline's jobs together and answers each in
/// its position; every job runs once with its own output; a bad job refuses the whole batch
/// naming `jobs[i].field` and stores nothing; a keyed batch sent again (M31, `<key>#<i>`)
/// answers the same ids as existing and stores nothing new, across a mill restart too.
#[test]
fn a_batch_submit_stores_its_jobs_together_and_a_keyed_retry_gets_the_same_ids() {
    let root = tempfile::tempdir().unwrap();
    let (mut mill, _exec) = start(root.path(), &[], 0);
    let jobs: Vec<Value> = (0..5)
        .map(|i| json!({"command": format!("echo batch-{i}")}))
        .collect();
    // A bad third job: nothing of the batch is stored.
    let mut bad = jobs.clone();
    bad[2] = json!({"command": "  "});
    let before = job_rows(&mill);
    let (s, v) = mill
        .api
        .post("/v1/jobs/batch", &json!({"jobs": bad}).to_string());
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["field"], "jobs[2].command", "{v}");
    assert_eq!(job_rows(&mill), before, "a refused batch stores nothing");
    let (s, v) = mill
        .api
        .post("/v1/jobs/batch", &json!({"jobs": []}).to_string());
    assert_eq!((s, v["field"].as_str()), (400, Some("jobs")), "{v}");

    let (s, v) = post_keyed(
        &mill,
        "/v1/jobs/batch",
        "pipeline-7",
        &json!({"jobs": jobs}),
    );
    assert_eq!(s, 200, "{v}");
    let ids: Vec<u64> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_u64().unwrap_or_else(|| panic!("no id in {a}")))
        .collect();
    assert_eq!(ids.len(), 5);
    assert_eq!(job_rows(&mill), before + 5);
    for (i, id) in ids.iter().enumerate() {
        let done = mill.api.wait_done(*id);
        assert_eq!(done["state"], "success", "{done}");
        let (s, log) = mill
            .api
            .get_raw(&format!("/v1/jobs/{id}/log?follow=false"), true);
        assert_eq!(s, 200);
        assert_eq!(
            log,
            format!("batch-{i}\n"),
            "job {id} ran its own command once"
        );
    }
    // The same keyed batch again, after a restart: the same ids, nothing new stored.
    mill.proc.term();
    let mill = start_mill(root.path(), "127.0.0.1:0", &timing("5s", "2s"), "info", 1);
    let (s, v) = post_keyed(
        &mill,
        "/v1/jobs/batch",
        "pipeline-7",
        &json!({"jobs": jobs}),
    );
    assert_eq!(s, 200, "{v}");
    let again: Vec<(u64, bool)> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["id"].as_u64().unwrap(), a["existing"] == true))
        .collect();
    assert_eq!(again, ids.iter().map(|&i| (i, true)).collect::<Vec<_>>());
    assert_eq!(job_rows(&mill), before + 5);
}
