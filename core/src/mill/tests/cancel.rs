//! M18, M26, M27: cancels and timeouts.

use super::*;
use crate::job::TerminalCause;

fn cancel(h: &mut H, job: JobId) {
    h.cancel_req(job, "user".into()).unwrap();
}

#[test]
fn m18_job_timeout_cancels_it_and_its_terminal_is_timeout() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let mut s = spec();
    s.timeout = Some(60 * SEC);
    let (job, lease) = h.run_on(a, s);
    h.keep_alive(a, 59 * SEC, &[lease]);
    assert!(h.cancels(a).is_empty());
    h.keep_alive(a, SEC, &[lease]);
    assert_eq!(h.cancels(a), vec![lease]);
    h.msg(a, ToMill::CancelAck { lease });
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Cancelled))]);
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Timeout);
}

#[test]
fn m18_a_queued_job_times_out_at_once() {
    let mut h = H::new();
    let mut s = spec();
    s.timeout = Some(10 * SEC);
    let job = h.submit(s);
    h.advance(10 * SEC);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Timeout);
}

#[test]
fn m26_cancel_of_a_queued_job_ends_it_cancelled() {
    let mut h = H::new();
    let job = h.submit(spec());
    cancel(&mut h, job);
    assert_eq!(
        h.terminal_of(job).unwrap().status,
        TerminalStatus::Cancelled
    );
    assert_eq!(
        h.cancel_req(job, String::new()),
        Err(RequestError::JobNotActive { job })
    );
}

#[test]
fn m26_cancel_of_a_reserved_lease_releases_it_and_ends_cancelled() {
    // The lease is published while a cancel keeps the node busy (M27), so its commit never
    // went out: a release is enough. (A commit that went out needs a cancel, E8.)
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (first, _) = h.run_on(a, spec());
    let job = h.submit(spec());
    let la = h.asks(a)[0];
    cancel(&mut h, first);
    h.accept(a, la, charge(&[("jobs", 1)]));
    assert!(h.commits(a).is_empty(), "the commit waits for the node");
    cancel(&mut h, job);
    assert_eq!(
        h.terminal_of(job).unwrap().status,
        TerminalStatus::Cancelled
    );
    assert!(h.writes().contains(&MillWrite::LeaseDelete { lease: la }));
    assert_eq!(h.releases(a), vec![la]);
    assert!(h.cancels(a).is_empty());
}

#[test]
fn m26_cancel_of_a_reserved_lease_whose_commit_is_out_sends_a_cancel() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let job = h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 1)]));
    cancel(&mut h, job);
    assert_eq!(
        h.terminal_of(job).unwrap().status,
        TerminalStatus::Cancelled
    );
    assert_eq!(
        h.cancels(a),
        vec![la],
        "a release would not stop a started job (E8)"
    );
}

#[test]
fn m26_cancel_of_a_running_lease_waits_for_the_ack_then_the_terminal() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    cancel(&mut h, job);
    assert_eq!(h.cancels(a), vec![lease]);
    assert!(h.terminal_of(job).is_none());
    h.msg(a, ToMill::CancelAck { lease });
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Cancelled))]);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Cancelled);
    assert_eq!(t.node, Some(node("a")));
}

#[test]
fn m26_an_unacked_cancel_closes_the_session() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, _) = h.run_on(a, spec());
    cancel(&mut h, job);
    h.advance(5 * SEC);
    h.snapshot(a, 0.0, &[]);
    h.advance(6 * SEC);
    assert!(h.closed(a).unwrap().contains("not acked"));
}

#[test]
fn m26_no_terminal_within_teardown_ends_the_job_cancelled_without_the_node() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    cancel(&mut h, job);
    h.msg(a, ToMill::CancelAck { lease });
    h.keep_alive(a, 599 * SEC, &[lease]);
    assert!(h.terminal_of(job).is_none());
    h.keep_alive(a, 2 * SEC, &[lease]);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Cancelled);
    assert!(t.error.unwrap().contains("node teardown exceeded"));
    assert!(h.rare(RarePath::TeardownDeadline));
}

#[test]
fn m26_a_cancel_for_a_disconnected_node_is_sent_when_its_session_is_ready() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    cancel(&mut h, job);
    assert!(h.out.iter().all(|o| !matches!(o, MillOutput::Send { .. })));
    let a2 = h.hello_as("a", 1, &[]);
    assert!(h.cancels(a2).is_empty());
    h.snapshot(a2, 0.0, &[lease]);
    assert_eq!(h.cancels(a2), vec![lease]);
}

#[test]
fn m27_a_session_with_a_pending_cancel_takes_no_new_work() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    cancel(&mut h, job);
    let next = h.submit(spec());
    assert!(h.asks(a).is_empty());
    assert_eq!(h.mill.job_state(next), Some(JobState::Queued));
    h.msg(a, ToMill::CancelAck { lease });
    assert_eq!(h.asks(a).len(), 1);
}

#[test]
fn m16_a_lease_ended_in_the_step_that_published_it_is_never_committed() {
    // A late Tick (I12) fires a bid's end and the job's timeout (M18) together: the lease is
    // published and ended in one step, so its deletion is in the very batch that holds it,
    // and its CommitLease must not go out (the job has already ended).
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    let bid = h.mill.config().bid_timeout;
    let mut s = spec();
    s.timeout = Some(bid * 2);
    let job = h.submit(s);
    let lb = h.asks(b)[0];
    assert_eq!(h.asks(a).len(), 1);
    h.accept(b, lb, charge(&[("jobs", 1)]));
    assert!(h.commits(b).is_empty(), "a better-ranked ask is still open");
    // One Tick, late: past the ask's deadline (b wins, M12) and past the job's timeout.
    h.now = h.now.plus(bid * 3);
    h.input(MillInput::Tick).unwrap();
    let all = h.all.clone();
    let committed = all.iter().any(|o| {
        matches!(o, MillOutput::Send { msg: ToExecutor::CommitLease { lease, .. }, .. } if *lease == lb)
    });
    assert!(!committed, "{:?}", h.out);
    assert!(!h.store.leases.contains_key(&lb));
    assert_eq!(h.terminal_of(job).unwrap().status, TerminalStatus::Timeout);
}

/// Issue 11 item 6: a job no lease takes within `queue_timeout` ends Failed (cause
/// `QueueTimeout`), and its error says why no executor took it.
#[test]
fn a_job_nobody_takes_ends_at_its_queue_timeout_saying_why() {
    let mut h = H::with(MillConfig {
        queue_timeout: 30 * SEC,
        ..config()
    });
    let a = h.ready("a", 0.0);
    let mut s = spec();
    s.engine = "docker".into();
    let job = h.submit(s);
    h.keep_alive(a, 29 * SEC, &[]);
    assert_eq!(h.ended(job), None, "still within its queue timeout");
    h.keep_alive(a, SEC, &[]);
    let t = h.ended(job).expect("ended by the queue timeout");
    assert_eq!(t.status, TerminalStatus::Failed);
    assert_eq!(t.cause, Some(TerminalCause::QueueTimeout));
    let error = t.error.unwrap_or_default();
    assert!(
        error.contains("queue_timeout 30s") && error.contains("no executor offers engine docker"),
        "{error}"
    );
}

/// A job a lease took before its queue timeout is not ended by it (only M18 bounds it),
/// and no timer is left for it.
#[test]
fn a_placed_job_keeps_no_queue_timeout() {
    let mut h = H::with(MillConfig {
        queue_timeout: 30 * SEC,
        ..config()
    });
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.keep_alive(a, 60 * SEC, &[lease]);
    assert_eq!(h.ended(job), None);
    assert!(h.cancels(a).is_empty());
}

/// A queued job with no executor at all says so; after a mill restart its queue timeout
/// runs again (M29: restored jobs re-arm their deadlines).
#[test]
fn a_queued_job_times_out_after_a_restart_too() {
    let cfg = MillConfig {
        queue_timeout: 30 * SEC,
        ..config()
    };
    let mut h = H::with(cfg);
    let job = h.submit(spec());
    h.advance(10 * SEC);
    h.restart();
    h.advance(29 * SEC);
    assert_eq!(h.ended(job), None);
    h.advance(SEC);
    let t = h.ended(job).expect("ended by the queue timeout");
    assert_eq!(t.cause, Some(TerminalCause::QueueTimeout));
    assert!(
        t.error
            .unwrap_or_default()
            .contains("no executor is connected"),
        "{job}"
    );
}
