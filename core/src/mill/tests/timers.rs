//! The timer table (STYLE 13): what ends leaves no deadline behind; an idle mill has none.

use super::*;

/// Every timer of `h`'s mill watches something live, and everything live has its timer.
fn audited(h: &H) {
    if let Err(e) = h.mill.check_timers() {
        panic!("timer table: {e}");
    }
}

#[test]
fn m18_a_job_that_ended_leaves_no_deadline_for_it() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let baseline = h.mill.timer_count();
    let idle_deadline = h.mill.next_deadline();
    let (job, lease) = h.run_on(conn, spec());
    assert!(
        h.mill.timer_count() > baseline,
        "a running job has its timeout"
    );
    h.events(conn, 1, vec![(1, lease, terminal(TerminalStatus::Success))]);
    assert_eq!(
        h.terminal_of(job).map(|t| t.status),
        Some(TerminalStatus::Success)
    );
    // Only the session's silence deadline is left: no 24 h timeout of the ended job.
    assert_eq!(h.mill.timer_count(), baseline);
    assert_eq!(h.mill.next_deadline(), idle_deadline);
    audited(&h);
}

#[test]
fn m26_a_cancelled_job_leaves_no_deadline_behind() {
    let mut h = H::new();
    let conn = h.ready("a", 0.1);
    let baseline = h.mill.timer_count();
    let (job, lease) = h.run_on(conn, spec());
    h.cancel_req(job, String::new()).unwrap();
    assert_eq!(h.cancels(conn), vec![lease]);
    audited(&h);
    h.msg(conn, ToMill::CancelAck { lease });
    audited(&h);
    h.events(
        conn,
        1,
        vec![(1, lease, terminal(TerminalStatus::Cancelled))],
    );
    assert_eq!(
        h.terminal_of(job).map(|t| t.status),
        Some(TerminalStatus::Cancelled)
    );
    assert_eq!(h.mill.timer_count(), baseline);
    audited(&h);
}

#[test]
fn m18_a_queued_job_cancelled_before_placement_leaves_an_idle_mill_with_no_deadline() {
    let mut h = H::new();
    assert_eq!(h.mill.next_deadline(), None, "a new mill waits for nothing");
    let job = h.submit(spec());
    assert!(
        h.mill.next_deadline().is_some(),
        "a queued job has its timeout"
    );
    h.cancel_req(job, String::new()).unwrap();
    assert_eq!(h.mill.next_deadline(), None);
    assert_eq!(h.mill.timer_count(), 0);
}

#[test]
fn m1_m5_an_idle_mill_has_no_deadline_once_connections_and_sessions_are_gone() {
    let mut h = H::new();
    // A connection that never says Hello, closed by its peer: its handshake deadline goes.
    let conn = ConnId(900);
    h.input(MillInput::Connected { conn }).unwrap();
    assert!(h.mill.next_deadline().is_some());
    h.input(MillInput::Disconnected { conn }).unwrap();
    assert_eq!(h.mill.next_deadline(), None);

    // A node that ran jobs and left: its session waits out grace, then nothing is pending.
    let conn = h.ready("a", 0.1);
    for seqno in 1..=3 {
        let (_, lease) = h.run_on(conn, spec());
        h.events(
            conn,
            1,
            vec![(seqno, lease, terminal(TerminalStatus::Success))],
        );
    }
    h.input(MillInput::Disconnected { conn }).unwrap();
    audited(&h);
    assert_eq!(
        h.mill.timer_count(),
        1,
        "only the grace of the session is pending"
    );
    h.advance(h.mill.config().reconnect_grace + SEC);
    assert_eq!(h.mill.sessions().count(), 0);
    assert_eq!(h.mill.next_deadline(), None);
    assert_eq!(h.mill.timer_count(), 0);
}

#[test]
fn m12_asks_that_lose_or_go_stray_leave_no_deadline_behind() {
    let mut h = H::new();
    let a = h.ready("a", 0.1);
    let b = h.ready("b", 0.2);
    let baseline = h.mill.timer_count();
    let job = h.submit(spec());
    let (asked_a, asked_b) = (h.asks(a), h.asks(b));
    assert_eq!((asked_a.len(), asked_b.len()), (1, 1));
    // The better-ranked node accepts; the other ask is released when it answers late.
    h.accept(a, asked_a[0], charge(&[("jobs", 1)]));
    audited(&h);
    h.accept(b, asked_b[0], charge(&[("jobs", 1)]));
    audited(&h);
    let lease = match h.mill.job_state(job) {
        Some(JobState::Reserved { lease, .. }) => lease,
        other => panic!("expected a published lease, got {other:?}"),
    };
    h.committed(a, lease);
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Success))]);
    assert!(h.terminal_of(job).is_some());
    assert_eq!(h.mill.timer_count(), baseline);
    audited(&h);
}

#[test]
fn m5_a_node_quarantined_or_lost_leaves_no_timer_for_it() {
    let mut cfg = config();
    cfg.quarantine_strikes = 1;
    let mut h = H::with(cfg);
    let conn = h.ready("a", 0.1);
    let (job, _) = h.run_on(conn, spec());
    // A second Hello is a violation; one strike quarantines.
    h.msg(
        conn,
        crate::testkit::Hello::new("a", Epoch(1))
            .token("secret")
            .build(),
    );
    assert!(h.mill.quarantined().contains(&node("a")));
    assert!(h.terminal_of(job).is_some());
    assert_eq!(h.mill.next_deadline(), None);
    audited(&h);
}
