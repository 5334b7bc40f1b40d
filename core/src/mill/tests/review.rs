//! Adversarial review: each test names the rule it defends and reproduces a bug that was
//! found and fixed, through inputs and outputs only. The randomized test at the end feeds
//! well-typed but hostile executor traffic and checks that everything drains at quiescence.

use super::*;
use crate::quota::QuotaConfig;

fn cancel(h: &mut H, job: JobId) {
    h.input(MillInput::Cancel {
        job,
        reason: "user".into(),
    })
    .unwrap();
}

/// A connected executor offering only `engine`, with one snapshot (so it is ready).
fn ready_with(h: &mut H, name: &str, engine: &str, capacity: u32) -> ConnId {
    let conn = ConnId(h.next_conn);
    h.next_conn += 1;
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(
        conn,
        ToMill::Hello {
            protocol_version: crate::wire::PROTOCOL_VERSION,
            node_id: name.into(),
            epoch: Epoch(1),
            token: "secret".into(),
            labels: Vec::new(),
            engines: vec![engine.into()],
        },
    );
    h.snapshot_with(conn, one_engine(engine, true, capacity), &[]);
    conn
}

fn one_engine(engine: &str, available: bool, capacity: u32) -> BTreeMap<String, EngineStatus> {
    [(
        engine.to_string(),
        EngineStatus {
            available,
            capacity,
            load: BTreeMap::new(),
        },
    )]
    .into_iter()
    .collect()
}

#[test]
fn m12_a_job_ended_while_bidding_gives_back_every_seat_it_asked_for() {
    // Two nodes with four seats each; each round ends by a cancel while one ask is accepted
    // (b) and a better one is still in flight (a). Both seats must come back, or after four
    // rounds neither node is ever asked again.
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    for _ in 0..4 {
        let job = h.submit(spec());
        let (la, lb) = (h.asks(a)[0], h.asks(b)[0]);
        h.accept(b, lb, charge(&[("jobs", 1)]));
        cancel(&mut h, job);
        assert_eq!(h.releases(b), vec![lb]);
        h.accept(a, la, charge(&[("jobs", 1)]));
        assert_eq!(h.releases(a), vec![la]);
    }
    h.submit(spec());
    assert_eq!(h.asks(a).len(), 1, "a's seats leaked: {:?}", h.out);
    assert_eq!(h.asks(b).len(), 1, "b's seats leaked: {:?}", h.out);
}

#[test]
fn m17_commit_is_resent_after_a_pending_cancel_briefly_made_the_node_busy() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (first, l1) = h.run_on(a, spec());
    h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![l2]);
    // The commit goes unanswered; meanwhile a cancel makes the node take no new work (M27)
    // just when the commit is due again.
    cancel(&mut h, first);
    assert_eq!(h.cancels(a), vec![l1]);
    h.keep_alive(a, 6 * SEC, &[l1, l2]);
    h.msg(a, ToMill::CancelAck { lease: l1 });
    let mut resent = h.commits(a);
    h.keep_alive(a, 20 * SEC, &[l1, l2]);
    resent.extend(h.commits(a));
    assert!(
        resent.contains(&l2),
        "the commit of {l2} was never sent again"
    );
}

#[test]
fn m5_i3_grace_expiring_while_a_cancel_ack_is_in_flight_does_not_fail_reported_leases() {
    // After a mill restart the node comes back just before grace ends, reports its running
    // lease and one the restart dropped (reserved, commit out); the mill cancels the latter.
    // Grace must not fail the reported lease while that ack is on its way.
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, l1) = h.run_on(a, spec());
    h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    h.restart();
    h.advance(44 * SEC);
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[l1, l2]);
    assert_eq!(h.cancels(a2), vec![l2]);
    h.advance(2 * SEC);
    assert!(
        h.terminal_of(job).is_none(),
        "a reported lease failed at grace expiry: {:?}",
        h.terminal_of(job)
    );
    h.msg(a2, ToMill::CancelAck { lease: l2 });
    h.events(a2, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Success);
}

#[test]
fn m5_a_cancel_never_acked_after_grace_still_fails_the_nodes_leases() {
    // The other side of the test above: grace is only stretched to the ack deadline.
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, l1) = h.run_on(a, spec());
    h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    h.restart();
    h.advance(44 * SEC);
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[l1, l2]);
    h.keep_alive(a2, 15 * SEC, &[l1, l2]);
    assert!(h.closed(a2).is_some());
    assert_eq!(
        h.terminal_of(job).unwrap().error.as_deref(),
        Some("executor lost")
    );
}

#[test]
fn m15_i9_a_quota_grant_is_not_held_while_the_job_cannot_bid() {
    // Owner quota of one job. Job 2 waits for quota on a shell node; when job 1 ends the
    // grant goes to job 2, but no shell seat is offered any more. A docker job of the same
    // owner must not wait behind that grant while its docker node sits idle.
    let mut h = H::with(MillConfig {
        top_k: 1,
        quota: QuotaConfig {
            owner_defaults: charge(&[("jobs", 1)]),
            ..QuotaConfig::default()
        },
        ..config()
    });
    let a = h.ready("a", 0.0);
    let (_, l1) = h.run_on(a, spec());
    let _second = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    assert_eq!(h.releases(a), vec![l2], "waits for quota without the seat");
    h.snapshot_with(a, engines(false, 1.0), &[l1]);
    h.events(a, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);

    let d = ready_with(&mut h, "d", "docker", 1);
    let mut s = spec();
    s.engine = "docker".into();
    let third = h.submit(s);
    let l3 = h.asks(d)[0];
    h.accept(d, l3, charge(&[("jobs", 1)]));
    assert_eq!(
        h.commits(d),
        vec![l3],
        "the docker job waits behind a grant no shell node can use"
    );
    assert!(matches!(
        h.mill.job_state(third),
        Some(JobState::Reserved { .. })
    ));
}

#[test]
fn m26_i1_cancel_of_a_reserved_lease_whose_commit_went_out_before_a_reconnect_stops_it() {
    // The commit reached the node, which started the job, but the connection broke before
    // the answer came back. On reconnect the node reports the lease; a cancel still pending
    // from the outage keeps it busy, so the commit is not re-sent yet. A user cancel now
    // must stop the job: a release never stops a running one (E8).
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (first, l0) = h.run_on(a, spec());
    let job = h.submit(spec());
    let l1 = h.asks(a)[0];
    h.accept(a, l1, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![l1]);
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    cancel(&mut h, first);
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[l0, l1]);
    assert_eq!(h.cancels(a2), vec![l0], "the cancel that waited goes out");
    cancel(&mut h, job);
    assert_eq!(
        h.terminal_of(job).unwrap().status,
        TerminalStatus::Cancelled
    );
    assert!(
        h.cancels(a2).contains(&l1),
        "only a release was sent for a lease whose commit may have started it: {:?}",
        h.sent(a2)
    );
}
