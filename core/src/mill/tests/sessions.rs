//! M1–M9, M28: sessions.

use super::*;

#[test]
fn m1_welcome_carries_the_cursor_of_node_and_epoch() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (_, lease) = h.run_on(conn, spec());
    h.events(conn, 1, vec![(1, lease, EventKind::Running)]);
    h.input(MillInput::Disconnected { conn }).unwrap();
    let again = h.hello_as("a", 1, &[]);
    assert_eq!(h.sent(again), vec![welcome(1)]);
    let other_epoch = h.hello_as("b", 7, &[]);
    assert_eq!(h.sent(other_epoch), vec![welcome(0)]);
}

#[test]
fn m1_unsupported_version_is_refused() {
    let mut h = H::new();
    let conn = ConnId(99);
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(
        conn,
        crate::testkit::Hello::new("a", Epoch(1))
            .token("secret")
            .no_engines()
            .protocol_version(999)
            .build(),
    );
    assert!(h.refused(conn).unwrap().contains("version 999"));
    assert!(h.closed(conn).is_some());
}

#[test]
fn m1_invalid_node_ids_are_refused() {
    for bad in ["", "has space", "é", &"x".repeat(129)] {
        let mut h = H::new();
        let conn = h.hello_as(bad, 1, &[]);
        let why = h.refused(conn).expect("refused");
        assert!(why.contains("invalid node id"), "{bad:?}: {why}");
        assert!(h.closed(conn).is_some());
        assert_eq!(h.mill.sessions().count(), 0);
    }
}

#[test]
fn m1_wrong_token_is_refused() {
    let mut h = H::new();
    let conn = ConnId(5);
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(
        conn,
        crate::testkit::Hello::new("a", Epoch(1))
            .token("guess")
            .no_engines()
            .build(),
    );
    assert!(h.refused(conn).unwrap().contains("token not accepted"));
    assert_eq!(h.mill.sessions().count(), 0);
}

#[test]
fn m1_first_message_must_be_hello() {
    let mut h = H::new();
    let conn = ConnId(5);
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(conn, ToMill::CancelAck { lease: LeaseId(1) });
    assert!(h.closed(conn).unwrap().contains("Hello"));
}

#[test]
fn m1_connection_without_hello_is_closed_after_silence_timeout() {
    let mut h = H::new();
    let conn = ConnId(5);
    h.input(MillInput::Connected { conn }).unwrap();
    h.advance(16 * SEC);
    assert!(h.closed(conn).unwrap().contains("no Hello"));
}

#[test]
fn m2_second_hello_while_live_is_refused() {
    let mut h = H::new();
    let first = h.ready("a", 0.1);
    let second = h.hello_as("a", 1, &[]);
    assert!(h.refused(second).unwrap().contains("live session"));
    assert!(h.closed(first).is_none());
    // The first session still works.
    h.submit(spec());
    assert_eq!(h.asks(first).len(), 1);
}

#[test]
fn m2_hello_after_silence_replaces_the_old_session() {
    let mut h = H::new();
    let first = h.ready("a", 0.1);
    h.now = h.now.plus(15 * SEC); // silent, not yet closed by a tick
    let second = h.hello_as("a", 1, &[]);
    assert!(h.closed(first).unwrap().contains("replaced"));
    assert_eq!(h.sent(second), vec![welcome(0)]);
}

#[test]
fn m2_grace_deadline_carries_over_to_the_new_session() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, _) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(40 * SEC);
    // Reconnects but never reconciles: the grace started at the disconnect still ends at 45 s.
    let _again = h.hello_as("a", 1, &[]);
    h.advance(6 * SEC);
    let t = h.terminal_of(job).expect("failed at the carried deadline");
    assert_eq!(t.error.as_deref(), Some("executor lost"));
    assert_eq!(t.cause, Some(crate::job::TerminalCause::ExecutorLost));
}

#[test]
fn m3_new_session_takes_no_work_before_its_snapshot() {
    let mut h = H::new();
    let conn = h.hello_as("a", 1, &[]);
    let job = h.submit(spec());
    assert!(h.asks(conn).is_empty());
    assert_eq!(h.mill.job_state(job), Some(JobState::Queued));
    h.snapshot(conn, 0.1, &[]);
    assert_eq!(h.asks(conn).len(), 1);
}

#[test]
fn m4_disconnect_keeps_leases_during_grace() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, lease) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(44 * SEC);
    assert!(h.terminal_of(job).is_none());
    assert!(
        matches!(h.mill.job_state(job), Some(JobState::Running { lease: l, .. }) if l == lease)
    );
}

#[test]
fn m5_grace_expiry_fails_every_lease_executor_lost() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (j1, _) = h.run_on(conn, spec());
    let (j2, _) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(46 * SEC);
    for job in [j1, j2] {
        let t = h.terminal_of(job).unwrap();
        assert_eq!(t.status, TerminalStatus::Failed);
        assert_eq!(t.error.as_deref(), Some("executor lost"));
        assert_eq!(t.cause, Some(crate::job::TerminalCause::ExecutorLost));
    }
    assert_eq!(h.mill.sessions().count(), 0, "the session is forgotten");
    assert!(h.store.leases.is_empty());
}

#[test]
fn m5_grace_expiry_with_a_pending_cancel_ends_cancelled() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, _) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.cancel_req(job, "user said stop".into()).unwrap();
    h.advance(46 * SEC);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Cancelled);
    assert_eq!(t.error.as_deref(), Some("user said stop"));
    assert!(h.rare(RarePath::GraceExpiredWithPendingCancel));
}

#[test]
fn m6_events_applied_during_recovery_extend_grace() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, lease) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(40 * SEC);
    // Back, but without a snapshot the session is still recovering.
    let again = h.hello_as("a", 1, &[]);
    h.events(again, 1, vec![(1, lease, EventKind::Running)]);
    h.advance(10 * SEC); // past the original deadline
    assert!(h.terminal_of(job).is_none(), "grace was extended");
    h.advance(36 * SEC); // 40 + 46 from the event
    assert_eq!(
        h.terminal_of(job).unwrap().error.as_deref(),
        Some("executor lost")
    );
}

#[test]
fn m7_snapshot_seqno_regression_is_a_violation() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    h.msg(
        conn,
        crate::testkit::snapshot(1, engines(true, 0.1), vec![], Seqno(0)),
    );
    assert_eq!(h.violation_kinds(), vec![ViolationKind::SnapshotRegression]);
    assert!(h.closed(conn).is_some());
}

#[test]
fn m7_snapshot_with_load_outside_zero_to_one_is_a_violation() {
    let mut h = H::new();
    let conn = h.hello_as("a", 1, &[]);
    h.snapshot_with(conn, engines(true, 1.5), &[]);
    assert_eq!(h.violation_kinds(), vec![ViolationKind::BadSnapshot]);
    let b = h.hello_as("b", 1, &[]);
    h.snapshot_with(b, engines(true, f64::NAN), &[]);
    assert_eq!(h.violation_kinds(), vec![ViolationKind::BadSnapshot]);
}

#[test]
fn m8_reconcile_claims_reported_fails_missing_running_and_releases_missing_reserved() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (kept, kept_lease) = h.run_on(conn, spec());
    let (lost, _) = h.run_on(conn, spec());
    // A third job reserved but not committed when the connection drops.
    let requeued = h.submit(spec());
    let ask = h.asks(conn)[0];
    h.accept(conn, ask, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(conn), vec![ask]);
    h.input(MillInput::Disconnected { conn }).unwrap();

    let again = h.hello_as("a", 1, &[]);
    h.snapshot(again, 0.1, &[kept_lease]);
    assert!(h.terminal_of(kept).is_none());
    let t = h.terminal_of(lost).unwrap();
    assert_eq!(t.error.as_deref(), Some("executor no longer has the job"));
    assert_eq!(t.cause, Some(crate::job::TerminalCause::NoLongerHasJob));
    assert!(h.updates().contains(&(requeued, JobState::Queued)));
    // The re-queued job is bid again on the reconciled node.
    assert_eq!(h.asks(again).len(), 1);
}

#[test]
fn m8_reconcile_waits_for_the_events_up_to_outbox_high() {
    // The job finished while the link was down; the executor no longer holds its seat,
    // and its terminal (seqno 1) is resent after the snapshot (E6). Judging the lease on
    // the snapshot alone would fail a job whose result is in flight (I3).
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, lease) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    let again = h.hello_as("a", 1, &[]);
    h.snapshot_marked(again, engines(true, 0.0), &[], 1);
    assert!(h.rare(RarePath::ReconcileAwaitedEvents));
    assert!(h.terminal_of(job).is_none(), "judged before its events");
    let other = h.submit(spec());
    assert!(h.asks(again).is_empty(), "not ready before reconcile (M3)");
    h.events(
        again,
        1,
        vec![(1, lease, terminal(TerminalStatus::Success))],
    );
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Success);
    assert_eq!(h.asks(again).len(), 1, "{other} is placed once reconciled");
}

#[test]
fn m8_a_lease_missing_once_outbox_high_is_applied_is_failed() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, lease) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    let again = h.hello_as("a", 1, &[]);
    h.snapshot_marked(again, engines(true, 0.0), &[], 2);
    h.events(again, 1, vec![(1, lease, EventKind::Running)]);
    assert!(h.terminal_of(job).is_none(), "seqno 2 is still in flight");
    h.events(
        again,
        1,
        vec![(2, LeaseId(lease.0 + 77), EventKind::Running)],
    );
    assert_eq!(
        h.terminal_of(job).unwrap().error.as_deref(),
        Some("executor no longer has the job")
    );
}

#[test]
fn m8_an_outbox_high_at_or_below_the_cursor_reconciles_at_once() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, lease) = h.run_on(conn, spec());
    h.events(conn, 1, vec![(1, lease, EventKind::Running)]);
    h.input(MillInput::Disconnected { conn }).unwrap();
    let again = h.hello_as("a", 1, &[]);
    h.snapshot_marked(again, engines(true, 0.0), &[], 1);
    assert!(!h.rare(RarePath::ReconcileAwaitedEvents));
    assert_eq!(
        h.terminal_of(job).unwrap().error.as_deref(),
        Some("executor no longer has the job")
    );
}

#[test]
fn m8_reported_unknown_lease_gets_an_untracked_cancel_and_no_ack_closes_the_session() {
    let mut h = H::new();
    let conn = h.hello_as("a", 1, &[]);
    h.snapshot(conn, 0.1, &[LeaseId(777)]);
    assert_eq!(h.cancels(conn), vec![LeaseId(777)]);
    assert!(h.rare(RarePath::UntrackedCancel));
    h.submit(spec());
    assert!(h.asks(conn).is_empty(), "pending cancel blocks work (M27)");
    h.msg(
        conn,
        crate::testkit::snapshot(2, engines(true, 0.1), vec![], Seqno(0)),
    );
    h.advance(11 * SEC);
    assert!(h.closed(conn).unwrap().contains("not acked"));
}

#[test]
fn m8_untracked_cancel_acked_makes_the_node_ready() {
    let mut h = H::new();
    let conn = h.hello_as("a", 1, &[]);
    h.snapshot(conn, 0.1, &[LeaseId(777)]);
    h.submit(spec());
    h.msg(
        conn,
        ToMill::CancelAck {
            lease: LeaseId(777),
        },
    );
    assert_eq!(h.asks(conn).len(), 1);
}

#[test]
fn m9_silent_session_is_closed_and_enters_grace() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, _) = h.run_on(conn, spec());
    h.advance(14 * SEC);
    assert!(h.closed(conn).is_none());
    h.advance(2 * SEC);
    assert!(h.closed(conn).unwrap().contains("silent"));
    assert!(h.terminal_of(job).is_none(), "grace, not failure");
}

#[test]
fn m9_messages_keep_a_session_alive() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    for _ in 0..10 {
        h.advance(5 * SEC);
        h.snapshot(conn, 0.1, &[]);
    }
    assert!(h.closed(conn).is_none());
}

#[test]
fn m28_violations_in_a_row_quarantine_the_node_and_fail_its_leases() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, _) = h.run_on(conn, spec());
    for strike in 1..=3 {
        let c = if strike == 1 {
            conn
        } else {
            h.hello_as("a", 1, &[])
        };
        h.events(c, 2, vec![]); // wrong epoch
        assert!(h.closed(c).is_some());
    }
    assert!(h.mill.quarantined().contains(&node("a")));
    assert!(h.store.quarantined.contains(&node("a")));
    let t = h.terminal_of(job).unwrap();
    assert!(t.error.unwrap().contains("quarantined"));
    let c = h.hello_as("a", 1, &[]);
    assert!(h.refused(c).unwrap().contains("quarantined"));
}

#[test]
fn m28_a_node_that_closes_cleanly_after_each_violation_is_still_quarantined() {
    // The dodge: violate, come back, close an idle session cleanly, repeat. A clean close
    // that did no work breaks no run of strikes.
    let mut h = H::new();
    for strike in 1..=3 {
        let c = h.hello_as("a", 1, &[]);
        h.events(c, 2, vec![]);
        assert_eq!(h.violation_kinds(), vec![ViolationKind::WrongEpoch]);
        if strike < 3 {
            let c = h.hello_as("a", 1, &[]);
            h.snapshot(c, 0.1, &[]);
            h.input(MillInput::Disconnected { conn: c }).unwrap();
            assert!(h.mill.quarantined().is_empty());
        }
    }
    assert!(h.mill.quarantined().contains(&node("a")));
}

#[test]
fn m28_silence_after_a_violation_does_not_reset_the_strikes() {
    let mut h = H::new();
    for _ in 1..=2 {
        let c = h.hello_as("a", 1, &[]);
        h.events(c, 2, vec![]);
        let _idle = h.hello_as("a", 1, &[]);
        h.advance(h.mill.config().silence_timeout + SEC);
    }
    let c = h.hello_as("a", 1, &[]);
    h.events(c, 2, vec![]);
    assert!(h.mill.quarantined().contains(&node("a")));
}

#[test]
fn m28_a_violation_free_session_that_applied_an_event_resets_the_strikes() {
    let mut h = H::new();
    for _ in 0..5 {
        let c = h.hello_as("a", 1, &[]);
        h.events(c, 2, vec![]);
        assert_eq!(h.violation_kinds(), vec![ViolationKind::WrongEpoch]);
        // Two strikes; then a session that runs a job to its terminal and closes cleanly.
        let c = h.hello_as("a", 1, &[]);
        h.events(c, 2, vec![]);
        let c = h.hello_as("a", 1, &[]);
        h.snapshot(c, 0.1, &[]);
        let (job, lease) = h.run_on(c, spec());
        let seqno = h.mill.cursor(&node("a"), Epoch(1)).get() + 1;
        h.events(
            c,
            1,
            vec![(seqno, lease, terminal(TerminalStatus::Success))],
        );
        assert!(h.terminal_of(job).is_some());
        h.input(MillInput::Disconnected { conn: c }).unwrap();
    }
    assert!(h.mill.quarantined().is_empty());
}

#[test]
fn m28_lifting_quarantine_lets_the_node_back() {
    let mut h = H::with(MillConfig {
        quarantine_strikes: 1,
        ..config()
    });
    let c = h.hello_as("a", 1, &[]);
    h.events(c, 2, vec![]);
    assert!(h.mill.quarantined().contains(&node("a")));
    assert_eq!(
        h.lift_req(node("b")),
        Err(RequestError::NotQuarantined { node: node("b") })
    );
    h.lift_req(node("a")).unwrap();
    assert!(h.writes().contains(&MillWrite::Quarantine {
        node: node("a"),
        quarantined: false
    }));
    let c = h.hello_as("a", 1, &[]);
    assert_eq!(h.sent(c), vec![welcome(0)]);
}

#[test]
fn m28_quarantined_node_gets_no_work() {
    let mut h = H::with(MillConfig {
        quarantine_strikes: 1,
        ..config()
    });
    let bad = h.ready("bad", 0.0);
    let good = h.ready("good", 0.9);
    h.events(bad, 9, vec![]);
    h.submit(spec());
    assert_eq!(h.asks(good).len(), 1);
}

#[test]
fn m5_a_node_back_with_a_wiped_store_takes_work_and_its_old_leases_fail_after_grace() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (old_job, _) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(5 * SEC);
    let wiped = h.hello_as("a", 2, &[]);
    assert_eq!(h.sent(wiped), vec![welcome(0)]);
    h.snapshot(wiped, 0.1, &[]);
    assert!(
        h.terminal_of(old_job).is_none(),
        "the old process may still run it"
    );
    let (new_job, _) = h.run_on(wiped, spec());
    h.keep_alive(wiped, 41 * SEC, &[]);
    let t = h.terminal_of(old_job).expect("failed once grace ran out");
    assert_eq!(t.status, TerminalStatus::Failed);
    assert!(t.error.unwrap().starts_with("executor lost"));
    assert!(h.rare(RarePath::OldEpochLeaseFailed));
    assert!(matches!(
        h.mill.job_state(new_job),
        Some(JobState::Running { .. })
    ));
}

#[test]
fn m29_a_published_lease_of_a_replaced_store_fails_rather_than_runs_again() {
    // The commit went out to the old process, which may have started the job: when the
    // node comes back wiped and grace ends, the job fails like a running one (M29, I1).
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let job = h.submit(spec());
    let lease = h.asks(conn)[0];
    h.accept(conn, lease, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(conn), vec![lease]);
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(5 * SEC);
    let wiped = h.hello_as("a", 2, &[]);
    h.snapshot(wiped, 0.1, &[]);
    h.keep_alive(wiped, 41 * SEC, &[]);
    let t = h.terminal_of(job).expect("failed once grace ran out");
    assert_eq!(t.status, TerminalStatus::Failed);
    assert_eq!(
        t.error.as_deref(),
        Some("executor lost (its store was replaced)")
    );
    assert!(
        !h.updates().contains(&(job, JobState::Queued)),
        "a job whose commit went out is never queued again"
    );
}

#[test]
fn m5_a_lease_of_a_replaced_store_whose_commit_never_left_is_placed_again() {
    // A pending cancel (M27) holds the commit back when the bid is won; the node then
    // drops and returns wiped. Nothing of the job can have run: it is placed again.
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (first, l1) = h.run_on(conn, spec());
    let job = h.submit(spec());
    let lease = h.asks(conn)[0];
    h.cancel_req(first, "user".into()).unwrap();
    h.accept(conn, lease, charge(&[("jobs", 1)]));
    assert!(
        h.commits(conn).is_empty(),
        "the commit waits for the cancel's ack"
    );
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(5 * SEC);
    let wiped = h.hello_as("a", 2, &[]);
    h.snapshot(wiped, 0.1, &[]);
    // The cancel goes out again; the new process knows no such lease and acks it (E7).
    assert_eq!(h.cancels(wiped), vec![l1]);
    h.msg(wiped, ToMill::CancelAck { lease: l1 });
    let mut asked = Vec::new();
    for _ in 0..9 {
        h.keep_alive(wiped, 5 * SEC, &[]);
        asked.extend(h.asks(wiped));
    }
    assert!(h.terminal_of(job).is_none(), "{:?}", h.terminal_of(job));
    assert!(
        !asked.is_empty(),
        "the job is placed again after grace: {:?}",
        h.mill.job_state(job)
    );
}

#[test]
fn m5_grace_waits_for_events_a_reconnected_snapshot_announced() {
    // The node comes back just before its grace runs out; its snapshot announces a result
    // still in flight (outbox_high). Grace expiring before that batch lands must not record
    // "executor lost" for a job that finished (I3): the mill waits for the events (M6).
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, lease) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    let grace = h.mill.config().reconnect_grace;
    h.advance(grace - Duration::from_millis(100));
    let again = h.hello_as("a", 1, &[]);
    h.snapshot_marked(again, engines(true, 0.0), &[], 1);
    h.advance(Duration::from_millis(200));
    assert!(
        h.terminal_of(job).is_none(),
        "judged lost with its result in flight"
    );
    h.events(
        again,
        1,
        vec![(1, lease, terminal(TerminalStatus::Success))],
    );
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Success);
}

#[test]
fn m5_grace_waits_for_announced_events_at_most_twice_reconnect_grace() {
    // Events announced but never delivered do not keep the node's leases forever (I9).
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, _lease) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    let grace = h.mill.config().reconnect_grace;
    h.advance(grace - Duration::from_millis(100));
    let again = h.hello_as("a", 1, &[]);
    h.snapshot_marked(again, engines(true, 0.0), &[], 1);
    h.advance(grace + Duration::from_millis(200));
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.error.as_deref(), Some("executor lost"));
}

#[test]
fn m6_a_snapshot_awaiting_announced_events_extends_grace_so_the_result_lands() {
    // Back just before grace runs out, with a finished job's terminal in flight behind
    // its snapshot: grace may not expire between the snapshot and the events (I3).
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (job, lease) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    h.advance(44 * SEC);
    let again = h.hello_as("a", 1, &[]);
    h.snapshot_marked(again, engines(true, 0.0), &[], 1);
    assert!(h.rare(RarePath::ReconcileAwaitedEvents));
    h.advance(2 * SEC);
    assert!(
        h.terminal_of(job).is_none(),
        "grace ran out while the announced events were in flight"
    );
    h.events(
        again,
        1,
        vec![(1, lease, terminal(TerminalStatus::Success))],
    );
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Success);
}

/// Events 1..=2 of `lease` on `conn` (of `epoch`): running, then its success.
fn finish(h: &mut H, conn: ConnId, epoch: u64, lease: LeaseId) {
    h.events(
        conn,
        epoch,
        vec![
            (1, lease, EventKind::Running),
            (2, lease, terminal(TerminalStatus::Success)),
        ],
    );
}

fn forgets(h: &H, name: &str, epoch: u64) -> bool {
    h.writes().contains(&MillWrite::CursorDelete {
        node: node(name),
        epoch: Epoch(epoch),
    })
}

fn forgets_any(h: &H) -> bool {
    h.writes()
        .iter()
        .any(|w| matches!(w, MillWrite::CursorDelete { .. }))
}

/// A session of `name` on `epoch` that ran one job to its end (cursor 2).
fn worked(h: &mut H, name: &str, epoch: u64) -> ConnId {
    let conn = h.hello_as(name, epoch, &[]);
    h.snapshot(conn, 0.1, &[]);
    let (_, lease) = h.run_on(conn, spec());
    finish(h, conn, epoch, lease);
    assert_eq!(h.mill.cursor(&node(name), Epoch(epoch)), Seqno(2));
    conn
}

/// M23, retention (issue 11 item 7): a node greeted on a new epoch (a new store, E1) retires
/// its old epochs that hold no lease; the cursor of all but the most recently retired one is
/// dropped from memory and from the store, and stays dropped across a restart (M29). The
/// retired one is kept: a node id shared in turn by two processes (M2, twin seed 7000631)
/// finds its cursor when the first process comes back. A Hello of the current epoch keeps
/// everything.
#[test]
fn m23_old_epoch_cursors_are_forgotten_beyond_the_last_retired_one() {
    let mut h = H::new();
    let first = worked(&mut h, "a", 1);
    h.input(MillInput::Disconnected { conn: first }).unwrap();
    let same = h.hello_as("a", 1, &[]);
    assert!(!forgets_any(&h), "the current epoch is kept");
    assert_eq!(h.sent(same), vec![welcome(2)]);
    h.input(MillInput::Disconnected { conn: same }).unwrap();
    let second = worked(&mut h, "a", 2);
    assert!(!forgets_any(&h), "epoch 1 is the one retired epoch kept");
    h.input(MillInput::Disconnected { conn: second }).unwrap();
    // The process of epoch 1 is back on its intact store: its cursor is there.
    let back = h.hello_as("a", 1, &[]);
    assert_eq!(h.sent(back), vec![welcome(2)]);
    assert!(!forgets_any(&h));
    h.input(MillInput::Disconnected { conn: back }).unwrap();
    // A third store: epochs 1 and 2 are idle; the older retired one goes.
    let third = h.hello_as("a", 3, &[]);
    assert!(forgets(&h, "a", 2) ^ forgets(&h, "a", 1), "{:?}", h.out);
    assert!(
        forgets(&h, "a", 2),
        "epoch 1 was live last, epoch 2 retired before it"
    );
    assert_eq!(h.mill.cursor(&node("a"), Epoch(2)), Seqno(0));
    assert_eq!(h.mill.cursor(&node("a"), Epoch(1)), Seqno(2));
    assert!(!h.store.cursors.contains_key(&(node("a"), Epoch(2))));
    // The new epoch's stream runs from its own start.
    h.snapshot(third, 0.1, &[]);
    let (_, lease) = h.run_on(third, spec());
    h.events(third, 3, vec![(1, lease, EventKind::Running)]);
    assert_eq!(h.mill.cursor(&node("a"), Epoch(3)), Seqno(1));
    h.restart();
    assert_eq!(h.mill.cursor(&node("a"), Epoch(2)), Seqno(0));
    assert_eq!(h.mill.cursor(&node("a"), Epoch(1)), Seqno(2));
    assert_eq!(h.mill.cursor(&node("a"), Epoch(3)), Seqno(1));
}

/// M23 with M5: an epoch is retired only once no lease of it remains (its process may still
/// report it); the step that ends its last lease retires it, and the older retired epoch's
/// cursor is forgotten then (here grace expiry fails the lease, the node being recovered on
/// its new epoch).
#[test]
fn m23_an_epoch_is_retired_in_the_step_its_last_lease_ends() {
    let mut h = H::new();
    let oldest = worked(&mut h, "a", 5);
    h.input(MillInput::Disconnected { conn: oldest }).unwrap();
    let conn = worked(&mut h, "a", 1);
    let (old_job, _) = h.run_on(conn, spec());
    h.input(MillInput::Disconnected { conn }).unwrap();
    let wiped = h.hello_as("a", 2, &[]);
    assert!(
        !forgets_any(&h),
        "epoch 1 holds a lease; epoch 5 is the retired one"
    );
    h.snapshot(wiped, 0.1, &[]);
    let mut ended = false;
    for _ in 0..12 {
        h.keep_alive(wiped, 5 * SEC, &[]);
        let now_ended = h.terminal_of(old_job).is_some();
        assert!(!forgets(&h, "a", 1), "epoch 1 is the newest retired");
        if now_ended {
            assert!(forgets(&h, "a", 5), "forgotten in the step the lease ended");
            ended = true;
            break;
        }
        assert!(
            !forgets_any(&h),
            "nothing forgotten while epoch 1 holds a lease"
        );
    }
    assert!(ended, "grace expiry ended the old lease");
    assert_eq!(h.mill.cursor(&node("a"), Epoch(5)), Seqno(0));
    assert_eq!(h.mill.cursor(&node("a"), Epoch(1)), Seqno(2));
    assert!(!h.store.cursors.contains_key(&(node("a"), Epoch(5))));
}

/// M23 with M29: a restarted mill knows a node's epochs only from its restored leases; it
/// forgets nothing of the node until the node's Hello says which epoch is current.
#[test]
fn m23_a_restarted_mill_forgets_no_cursor_before_the_node_says_its_epoch() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let (_, lease) = h.run_on(conn, spec());
    h.events(conn, 1, vec![(1, lease, EventKind::Running)]);
    h.restart();
    // Grace from the restart fails the lease; nothing said the node moved on.
    h.advance(50 * SEC);
    assert!(!forgets(&h, "a", 1));
    assert_eq!(h.mill.cursor(&node("a"), Epoch(1)), Seqno(1));
    let back = h.hello_as("a", 1, &[]);
    assert_eq!(h.sent(back), vec![welcome(1)]);
}
