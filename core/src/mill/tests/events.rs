//! M19–M25: sequenced event batches.

use super::*;
use crate::job::LogRef;

fn log_for(lease: LeaseId) -> LogRef {
    LogRef {
        path: LogRef::path_for(lease),
        hash: format!("sha256:{}", "0f".repeat(32)),
    }
}

#[test]
fn m19_a_batch_for_another_epoch_is_a_violation() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.events(a, 2, vec![(1, lease, terminal(TerminalStatus::Success))]);
    assert_eq!(h.violation_kinds(), vec![ViolationKind::WrongEpoch]);
    assert!(h.closed(a).is_some());
    assert!(h.terminal_of(job).is_none(), "nothing applied");
}

#[test]
fn m20_gap_in_seqnos_is_a_violation_and_nothing_is_applied() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (j1, l1) = h.run_on(a, spec());
    let (_, l2) = h.run_on(a, spec());
    h.events(
        a,
        1,
        vec![
            (1, l1, terminal(TerminalStatus::Success)),
            (3, l2, EventKind::Running),
        ],
    );
    assert_eq!(h.violation_kinds(), vec![ViolationKind::SeqnoGap]);
    assert!(h.terminal_of(j1).is_none());
    assert!(h
        .writes()
        .iter()
        .all(|w| !matches!(w, MillWrite::Cursor { .. })));
    assert_eq!(h.mill.cursor(&node("a"), Epoch(1)), Seqno(0));
}

#[test]
fn m20_seqnos_out_of_order_within_a_batch_are_a_violation() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (_, l1) = h.run_on(a, spec());
    h.events(
        a,
        1,
        vec![
            (1, l1, EventKind::Running),
            (2, l1, EventKind::Running),
            (1, l1, EventKind::Running),
        ],
    );
    assert_eq!(h.violation_kinds(), vec![ViolationKind::SeqnoOrder]);
}

#[test]
fn m20_a_replay_is_dropped_and_still_acked() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.events(a, 1, vec![(1, lease, EventKind::Running)]);
    h.events(a, 1, vec![(1, lease, EventKind::Running)]);
    assert_eq!(
        h.sent(a),
        vec![ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: Epoch(1),
            up_to: Seqno(1)
        }]
    );
    assert!(h.writes().is_empty());
    // A replay followed by new events applies only the new ones.
    h.events(
        a,
        1,
        vec![
            (1, lease, EventKind::Running),
            (2, lease, terminal(TerminalStatus::Success)),
        ],
    );
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Success);
    assert_eq!(h.mill.cursor(&node("a"), Epoch(1)), Seqno(2));
}

#[test]
fn m21_events_for_leases_the_node_does_not_hold_are_skipped_but_advance_the_cursor() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    let job = h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 1)]));
    h.committed(a, la);
    // b reports the lease that a holds, and one nobody holds.
    h.events(
        b,
        1,
        vec![
            (1, la, terminal(TerminalStatus::Success)),
            (2, LeaseId(4242), EventKind::Running),
        ],
    );
    assert!(h.violations().is_empty());
    assert!(h.terminal_of(job).is_none());
    assert_eq!(h.mill.cursor(&node("b"), Epoch(1)), Seqno(2));
    assert_eq!(
        h.sent(b),
        vec![ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: Epoch(1),
            up_to: Seqno(2)
        }]
    );
}

#[test]
fn m21_a_terminal_for_a_lease_the_mill_already_ended_is_skipped() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.cancel_req(job, "stop".into()).unwrap();
    h.msg(a, ToMill::CancelAck { lease });
    h.advance(601 * SEC); // teardown deadline: the mill ends it
    let _ = h.terminal_of(job).unwrap();
    let again = h.hello_as("a", 1, &[]);
    h.snapshot(again, 0.0, &[]);
    h.events(
        again,
        1,
        vec![(1, lease, terminal(TerminalStatus::Cancelled))],
    );
    assert!(h.violations().is_empty());
    assert!(
        h.updates().is_empty(),
        "the recorded terminal never changes (I2)"
    );
}

#[test]
fn m22_an_event_after_a_terminal_is_a_violation() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (_, lease) = h.run_on(a, spec());
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Success))]);
    assert!(h.violations().is_empty());
    h.events(a, 1, vec![(2, lease, EventKind::Running)]);
    assert_eq!(h.violation_kinds(), vec![ViolationKind::EventAfterTerminal]);
}

#[test]
fn m22_an_event_after_a_terminal_is_a_violation_on_a_later_connection_of_the_same_epoch() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (_, lease) = h.run_on(a, spec());
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Success))]);
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    // Same store (epoch), new connection: the memory is per (node, epoch), not per session.
    let again = h.hello_as("a", 1, &[]);
    h.snapshot(again, 0.0, &[]);
    h.events(again, 1, vec![(2, lease, EventKind::Running)]);
    assert_eq!(h.violation_kinds(), vec![ViolationKind::EventAfterTerminal]);
}

#[test]
fn m22_a_new_epoch_starts_a_new_stream_with_its_own_memory() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (_, lease) = h.run_on(a, spec());
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Success))]);
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    // A wiped store: its stream knows nothing of the old one; the lease is not held, so the
    // event is skipped (M21), not a violation.
    let wiped = h.hello_as("a", 2, &[]);
    h.snapshot(wiped, 0.0, &[]);
    h.events(wiped, 2, vec![(1, lease, EventKind::Running)]);
    assert!(h.violations().is_empty());
    assert_eq!(h.mill.cursor(&node("a"), Epoch(2)), Seqno(1));
}

#[test]
fn m22_an_event_after_a_terminal_in_the_same_batch_is_a_violation() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.events(
        a,
        1,
        vec![
            (1, lease, terminal(TerminalStatus::Success)),
            (2, lease, terminal(TerminalStatus::Failed)),
        ],
    );
    assert_eq!(h.violation_kinds(), vec![ViolationKind::EventAfterTerminal]);
    assert!(h.terminal_of(job).is_none());
}

#[test]
fn m23_a_batch_is_one_persist_followed_by_its_ack() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (j1, l1) = h.run_on(a, spec());
    let (j2, l2) = h.run_on(a, spec());
    h.events(
        a,
        1,
        vec![
            (1, l1, EventKind::Running),
            (2, l2, EventKind::Running),
            (3, l1, terminal(TerminalStatus::Success)),
            (4, l2, terminal(TerminalStatus::Failed)),
        ],
    );
    let persists: Vec<usize> = h
        .out
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o, MillOutput::Persist(_)))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(persists.len(), 1);
    let ack = h
        .out
        .iter()
        .position(|o| {
            matches!(
                o,
                MillOutput::Send {
                    msg: ToExecutor::Ack {
                        up_to: Seqno(4),
                        ..
                    },
                    ..
                }
            )
        })
        .unwrap();
    assert!(persists[0] < ack);
    let w = h.writes();
    assert!(w.contains(&MillWrite::Cursor {
        node: node("a"),
        epoch: Epoch(1),
        seqno: Seqno(4)
    }));
    assert!(w.contains(&MillWrite::LeaseDelete { lease: l1 }));
    assert!(w.contains(&MillWrite::LeaseDelete { lease: l2 }));
    assert_eq!(h.terminal_of(j1).unwrap().status, TerminalStatus::Success);
    assert_eq!(h.terminal_of(j2).unwrap().status, TerminalStatus::Failed);
}

#[test]
fn m24_a_terminal_records_the_status_releases_quota_and_wakes_placement() {
    let mut h = H::with(MillConfig {
        quota: crate::quota::QuotaConfig {
            owner_defaults: charge(&[("jobs", 1)]),
            ..Default::default()
        },
        ..config()
    });
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    let waiting = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    assert_eq!(h.mill.job_state(waiting), Some(JobState::Queued));
    h.events(
        a,
        1,
        vec![(
            1,
            lease,
            EventKind::Terminal {
                status: TerminalStatus::Success,
                exit_code: Some(0),
                error: None,
                log: Some(log_for(lease)),
                cause: crate::wire::EndCause::Engine,
            },
        )],
    );
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Success);
    assert_eq!(t.exit_code, Some(0));
    assert_eq!(t.log, Some(log_for(lease)));
    assert_eq!(t.node, Some(node("a")));
    assert!(h.writes().contains(&MillWrite::QuotaRelease { job }));
    assert_eq!(h.asks(a).len(), 1, "the waiting job bids again");
}

#[test]
fn m25_a_bad_log_reference_is_a_violation() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    let mut bad = log_for(lease);
    bad.path = "/etc/passwd".into();
    h.events(
        a,
        1,
        vec![(
            1,
            lease,
            EventKind::Terminal {
                status: TerminalStatus::Success,
                exit_code: Some(0),
                error: None,
                log: Some(bad),
                cause: crate::wire::EndCause::Engine,
            },
        )],
    );
    assert_eq!(h.violation_kinds(), vec![ViolationKind::BadLogRef]);
    assert!(h.terminal_of(job).is_none());
}

#[test]
fn e15_live_log_bytes_reach_clients_only_from_the_lease_holder_with_their_offset() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    let (job, lease) = h.run_on(a, spec());
    h.msg(
        b,
        ToMill::LiveLog {
            lease,
            offset: 0,
            bytes: b"forged".to_vec(),
        },
    );
    assert!(h.out.is_empty());
    h.msg(
        a,
        ToMill::LiveLog {
            lease,
            offset: 7,
            bytes: b"hello".to_vec(),
        },
    );
    assert_eq!(
        h.out,
        vec![MillOutput::LiveLog {
            job,
            lease,
            offset: 7,
            bytes: b"hello".to_vec()
        }]
    );
}

#[test]
fn m23_an_empty_batch_is_acked_so_executors_can_use_it_as_a_heartbeat() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    h.events(a, 1, vec![]);
    assert_eq!(
        h.sent(a),
        vec![ToExecutor::Ack {
            term: crate::types::Term(1),
            epoch: Epoch(1),
            up_to: Seqno(0)
        }]
    );
    assert!(h.writes().is_empty());
}

/// The executor's own verdicts arrive typed (protocol 2): a terminal's `EndCause` becomes the
/// recorded cause; its text stays the human reason.
fn executor_verdict(cause: crate::wire::EndCause, text: &str) -> crate::job::Terminal {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    let kind = EventKind::Terminal {
        status: TerminalStatus::Failed,
        exit_code: None,
        error: Some(text.into()),
        log: None,
        cause,
    };
    h.events(a, 1, vec![(1, lease, kind)]);
    h.terminal_of(job).unwrap()
}

#[test]
fn e9_an_executor_restart_is_recorded_by_cause() {
    let t = executor_verdict(crate::wire::EndCause::Restarted, "executor restarted");
    assert_eq!(t.status, TerminalStatus::Failed);
    assert_eq!(t.cause, Some(crate::job::TerminalCause::ExecutorRestarted));
    assert_eq!(t.error.as_deref(), Some("executor restarted"));
}

#[test]
fn e12_self_fencing_is_recorded_by_cause() {
    let t = executor_verdict(crate::wire::EndCause::LostContact, "any words");
    assert_eq!(t.cause, Some(crate::job::TerminalCause::LostContact));
    // The cause is the data; the text is not matched on.
    let t = executor_verdict(crate::wire::EndCause::Engine, "executor restarted");
    assert_eq!(t.cause, Some(crate::job::TerminalCause::Reported));
}

/// M26 with E9/E12: the executor's own verdict (it restarted, or fenced itself, before it
/// acted on the cancel) ends a job the mill was cancelling Cancelled, as grace expiry would
/// (M5): no engine result raced the cancel. The executor's text stays in the reason.
#[test]
fn m26_an_executor_verdict_on_a_job_being_cancelled_ends_it_cancelled() {
    for (cause, text) in [
        (crate::wire::EndCause::Restarted, "executor restarted"),
        (
            crate::wire::EndCause::LostContact,
            "executor lost contact with the mill",
        ),
    ] {
        let mut h = H::new();
        let a = h.ready("a", 0.0);
        let (job, lease) = h.run_on(a, spec());
        h.cancel_req(job, "stop it".into()).unwrap();
        let kind = EventKind::Terminal {
            status: TerminalStatus::Failed,
            exit_code: None,
            error: Some(text.into()),
            log: None,
            cause,
        };
        h.events(a, 1, vec![(1, lease, kind)]);
        let t = h.terminal_of(job).unwrap();
        assert_eq!(t.status, TerminalStatus::Cancelled, "{cause:?}");
        assert_eq!(t.cause, Some(crate::job::TerminalCause::Cancelled));
        assert_eq!(t.error, Some(format!("stop it ({text})")));
    }
    // The engine's own result still wins over a cancel it raced (I11).
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.cancel_req(job, "stop it".into()).unwrap();
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Failed))]);
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Failed);
}
