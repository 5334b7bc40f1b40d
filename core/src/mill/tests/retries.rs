//! M32: attempts and retries.

use super::*;
use crate::job::{RetryOn, RetryPolicy, TerminalCause};
use crate::mill::AttemptOutcome;

fn retrying(retries: u32, on: &[RetryOn]) -> JobSpec {
    JobSpec {
        retry: RetryPolicy {
            retries,
            on: on.iter().copied().collect(),
        },
        ..spec()
    }
}

fn attempt_ends(h: &H) -> Vec<crate::mill::AttemptEnd> {
    h.writes()
        .into_iter()
        .filter_map(|w| match w {
            MillWrite::Attempt(a) => Some(*a),
            _ => None,
        })
        .collect()
}

#[test]
fn m32_a_lost_executor_retries_elsewhere_only_after_e12s_bound_and_the_fence() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, retrying(1, &[RetryOn::ExecutorLost]));
    let b = h.ready("b", 0.0);
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    // M5 at 45 s: the attempt ends, the job is queued again, not ended.
    h.keep_alive(b, 50 * SEC, &[]);
    assert!(h.terminal_of(job).is_none(), "retried, not ended");
    assert_eq!(h.mill.job_state(job), Some(JobState::Queued));
    let ends = attempt_ends(&h);
    assert_eq!(ends.len(), 1);
    assert_eq!(ends[0].attempt, 1);
    assert_eq!(ends[0].lease, lease);
    assert_eq!(ends[0].cause, Some(TerminalCause::ExecutorLost));
    assert_eq!(ends[0].outcome, AttemptOutcome::Retried { fenced: true });
    assert!(h.store.attempts[&job].fence_pending);
    // The run on `a` may live until a has heard nothing for reconnect_grace (E12) and then
    // stopped it: nobody is asked before 45 s + 30 s after the lease ended.
    h.keep_alive(b, 65 * SEC, &[]);
    assert!(h.asks(b).is_empty(), "asked within the fence: {:?}", h.out);
    h.keep_alive(b, 15 * SEC, &[]);
    let asks = h.asks(b);
    assert!(!asks.is_empty(), "placed once the fence is over");
}

#[test]
fn m32_a_reported_end_retries_at_once_and_only_for_causes_the_policy_names() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    // `failed` named: the job's own failure is retried at once (the run is over).
    let (job, lease) = h.run_on(a, retrying(2, &[RetryOn::Failed]));
    h.events(a, 1, vec![(1, lease, terminal(TerminalStatus::Failed))]);
    assert!(h.terminal_of(job).is_none());
    assert_eq!(
        attempt_ends(&h)[0].outcome,
        AttemptOutcome::Retried { fenced: false }
    );
    assert_eq!(h.asks(a).len(), 1, "asked again at once");
    // Not named: the default policy never retries the job's own failure.
    let (other, l2) = {
        let mut h2 = H::new();
        let a2 = h2.ready("a", 0.0);
        let on: Vec<RetryOn> = RetryPolicy::default().on.into_iter().collect();
        let (j, l) = h2.run_on(a2, retrying(2, &on));
        h2.events(a2, 1, vec![(1, l, terminal(TerminalStatus::Failed))]);
        (h2.terminal_of(j), attempt_ends(&h2))
    };
    assert_eq!(other.map(|t| t.status), Some(TerminalStatus::Failed));
    assert_eq!(l2[0].outcome, AttemptOutcome::Final);
}

#[test]
fn m32_retries_run_out_and_the_last_attempt_ends_the_job() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, l1) = h.run_on(a, retrying(1, &[RetryOn::Failed]));
    h.events(a, 1, vec![(1, l1, terminal(TerminalStatus::Failed))]);
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    h.committed(a, l2);
    h.events(a, 1, vec![(2, l2, terminal(TerminalStatus::Failed))]);
    let t = h.terminal_of(job).expect("ended after its last retry");
    assert_eq!(t.status, TerminalStatus::Failed);
    assert_eq!(t.lease, Some(l2));
    assert_eq!(
        attempt_ends(&h).last().map(|e| e.outcome),
        Some(AttemptOutcome::Final)
    );
}

#[test]
fn m32_a_cancel_is_never_retried() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, _) = h.run_on(a, retrying(3, &RetryOn::ALL));
    h.cancel_req(job, "user".into()).unwrap();
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    h.advance(46 * SEC);
    let t = h
        .terminal_of(job)
        .expect("a pending cancel ends the job at grace expiry");
    assert_eq!(t.status, TerminalStatus::Cancelled);
}

#[test]
fn m32_a_restarted_mill_keeps_the_retry_count_and_waits_the_whole_fence_again() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, _) = h.run_on(a, retrying(1, &[RetryOn::ExecutorLost]));
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    h.advance(46 * SEC);
    assert_eq!(h.store.attempts[&job].retried, 1);
    h.restart();
    let b = h.ready("b", 0.0);
    h.keep_alive(b, 70 * SEC, &[]);
    assert!(
        h.asks(b).is_empty(),
        "the fence counts again from the restart"
    );
    h.advance(10 * SEC);
    h.snapshot(b, 0.0, &[]);
    let asks = h.asks(b);
    assert!(!asks.is_empty(), "placed after the fence");
    let ask = *asks.last().unwrap();
    h.accept(b, ask, charge(&[("jobs", 1)]));
    h.committed(b, ask);
    // Lost again: no retries left, so it ends.
    h.input(MillInput::Disconnected { conn: b }).unwrap();
    h.advance(46 * SEC);
    assert_eq!(
        h.terminal_of(job).and_then(|t| t.cause),
        Some(TerminalCause::ExecutorLost)
    );
}

#[test]
fn m32_a_snapshot_reporting_the_fenced_run_holds_the_retry() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, retrying(1, &[RetryOn::ExecutorLost]));
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    h.advance(46 * SEC);
    // `a` comes back and still runs the old attempt (a kill that did not take).
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[lease]);
    assert!(
        h.cancels(a2).contains(&lease),
        "the old run is cancelled (M8)"
    );
    h.msg(a2, ToMill::CancelAck { lease });
    // It keeps reporting it past the clock's fence: nobody is asked.
    h.keep_alive(a2, 120 * SEC, &[lease]);
    assert!(
        h.rare(RarePath::FencedRunReported),
        "the report held the fence"
    );
    assert!(h.asks(a2).is_empty(), "retried while the old run lives");
    assert_eq!(h.mill.job_state(job), Some(JobState::Queued));
    // It stops reporting it: the fence ends retry_fence later.
    h.keep_alive(a2, 35 * SEC, &[]);
    assert!(!h.asks(a2).is_empty());
}

#[test]
fn m32_hello_with_a_stop_grace_above_the_retry_fence_is_refused() {
    let mut h = H::new();
    let conn = ConnId(h.next_conn);
    h.next_conn += 1;
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(
        conn,
        crate::testkit::Hello::new("slow", Epoch(1))
            .token("secret")
            .stop_grace_ms(31_000)
            .build(),
    );
    let why = h.refused(conn).expect("refused");
    assert!(why.contains("retry fence"), "{why}");
}
