//! A mill on PostgreSQL (issue 14): `millrace mill --store postgres://…` and an executor run
//! shell jobs to success, and a restarted mill process still has them (M29) and takes up
//! work under a new term (DESIGN §10). The server is a throwaway one (`common::pg`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::pg::TestPg;
use common::{start_mill, start_ready_executor, strings, timing};
use serde_json::json;

#[test]
fn pg_mill_runs_jobs_and_keeps_them_across_a_restart() {
    let Some(pg) = TestPg::start("pg_mill_runs_jobs_and_keeps_them_across_a_restart") else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let port = common::pg::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut extra = strings(&["--store", &pg.url_of("postgres"), "--bid-timeout", "1s"]);
    extra.extend(timing("3s", "1s"));
    let mut mill = start_mill(root.path(), &listen, &extra, "info", 0);
    let _exec = start_ready_executor(root.path(), &mill, "e1", 2, &timing("3s", "1s"));
    let ids: Vec<u64> = (0..3)
        .map(|i| {
            mill.api
                .submit(&json!({"command": format!("echo run-{i}")}))
        })
        .collect();
    for id in &ids {
        let v = mill.api.wait_done(*id);
        assert_eq!(v["state"], "success", "{v}");
    }
    assert!(
        mill.proc.logs().contains("leading the mill's store"),
        "{}",
        mill.proc.logs()
    );
    assert!(mill.proc.term().success(), "{}", mill.proc.logs());
    assert!(
        !root.path().join("mill").join("mill.db").exists(),
        "the state went to PostgreSQL, not to a SQLite file"
    );

    let mill = start_mill(root.path(), &listen, &extra, "info", 1);
    for id in &ids {
        let v = mill.api.job(*id).unwrap();
        assert_eq!(v["state"], "success", "kept across the restart: {v}");
    }
    common::wait_for("e1 ready again", || mill.api.ready("e1").then_some(()));
    let next = mill.api.submit(&json!({"command": "echo after"}));
    assert!(next > *ids.iter().max().unwrap(), "job ids are not reused");
    assert_eq!(mill.api.wait_done(next)["state"], "success");
    let logs = mill.proc.logs();
    assert!(
        logs.contains("term=2") || logs.contains("\"term\":2"),
        "{logs}"
    );
}
