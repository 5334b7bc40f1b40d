//! M29, M30: restart from the durable store; and determinism.

use super::*;
use crate::job::TerminalCause;

/// A running lease, a published (Reserved, commit out) one and a queued job, then a restart.
fn restart_with_running_and_published(h: &mut H) -> (JobId, LeaseId, JobId, LeaseId) {
    let a = h.ready("a", 0.0);
    let (running, lease) = h.run_on(a, spec());
    let reserved = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![l2], "published and committing");
    h.restart();
    (running, lease, reserved, l2)
}

#[test]
fn m29_restart_keeps_running_and_published_leases_unclaimed() {
    let mut h = H::new();
    let mut s = spec();
    s.engine = "docker".into();
    let (running, lease, reserved, l2) = restart_with_running_and_published(&mut h);
    assert!(h.rare(RarePath::RestartWithRunningLeases));
    assert!(h.rare(RarePath::RestartWithPublishedLeases));
    assert!(!h.writes().contains(&MillWrite::LeaseDelete { lease: l2 }));
    let queued = h.submit(s);
    assert!(
        matches!(h.mill.job_state(running), Some(JobState::Running { lease: l, .. }) if l == lease)
    );
    assert!(
        matches!(h.mill.job_state(reserved), Some(JobState::Reserved { lease: l, .. }) if l == l2),
        "a published lease survives the restart (M29): {:?}",
        h.mill.job_state(reserved)
    );
    assert_eq!(h.mill.job_state(queued), Some(JobState::Queued));

    // The node comes back and reports both: both are claimed, the commit goes out again
    // (idempotent at the executor, E4), and nothing is placed twice.
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[lease, l2]);
    assert_eq!(
        h.commits(a2),
        vec![l2],
        "the commit is re-sent on the claim"
    );
    assert!(h.asks(a2).is_empty(), "no job was re-queued: {:?}", h.out);
    h.msg(a2, crate::testkit::commit_result(l2, true));
    assert!(
        matches!(h.mill.job_state(reserved), Some(JobState::Running { lease: l, .. }) if l == l2)
    );
    h.events(a2, 1, vec![(1, lease, terminal(TerminalStatus::Success))]);
    assert_eq!(
        h.terminal_of(running).unwrap().status,
        TerminalStatus::Success
    );
}

#[test]
fn m29_restart_releases_a_published_lease_its_node_does_not_report() {
    let mut h = H::new();
    let (running, lease, reserved, l2) = restart_with_running_and_published(&mut h);
    let a2 = h.hello_as("a", 1, &[]);
    // The commit never reached the executor (or its reservation expired): nothing ran.
    h.snapshot(a2, 0.0, &[lease]);
    assert!(h.writes().contains(&MillWrite::LeaseDelete { lease: l2 }));
    assert!(h.commits(a2).is_empty());
    let asks = h.asks(a2);
    assert_eq!(
        asks.len(),
        1,
        "the released job is placed again: {:?}",
        h.out
    );
    assert_ne!(asks[0], l2, "a fresh lease id (M30)");
    assert!(h.terminal_of(reserved).is_none());
    assert!(h.terminal_of(running).is_none());
}

#[test]
fn m29_a_published_lease_fails_at_grace_expiry_like_a_running_one() {
    let mut h = H::new();
    let (running, _, reserved, _) = restart_with_running_and_published(&mut h);
    h.advance(44 * SEC);
    assert!(h.terminal_of(reserved).is_none());
    h.advance(2 * SEC);
    for job in [running, reserved] {
        assert_eq!(
            h.terminal_of(job).unwrap().error.as_deref(),
            Some("executor lost"),
            "its job may have run: it is not queued again (M29, I1)"
        );
    }
}

#[test]
fn m29_a_restored_lease_fails_after_grace_if_its_node_never_returns() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, _) = h.run_on(a, spec());
    h.restart();
    h.advance(44 * SEC);
    assert!(h.terminal_of(job).is_none());
    h.advance(2 * SEC);
    assert_eq!(
        h.terminal_of(job).unwrap().error.as_deref(),
        Some("executor lost")
    );
}

#[test]
fn m29_quota_holds_survive_with_their_leases_only() {
    let mut h = H::with(MillConfig {
        quota: crate::quota::QuotaConfig {
            owner_defaults: charge(&[("jobs", 5)]),
            ..Default::default()
        },
        ..config()
    });
    let a = h.ready("a", 0.0);
    let (running, _) = h.run_on(a, spec());
    let reserved = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    let queued = h.submit(spec());
    h.restart();
    assert!(h.mill.quota().is_held(running));
    assert!(
        h.mill.quota().is_held(reserved),
        "a published lease keeps its hold"
    );
    assert!(!h.mill.quota().is_held(queued));
    assert!(!h
        .writes()
        .contains(&MillWrite::QuotaRelease { job: reserved }));
}

#[test]
fn m29_cursors_and_quarantine_survive_a_restart() {
    let mut h = H::with(MillConfig {
        quarantine_strikes: 1,
        ..config()
    });
    let a = h.ready("a", 0.0);
    let (_, lease) = h.run_on(a, spec());
    h.events(a, 1, vec![(1, lease, EventKind::Running)]);
    let b = h.hello_as("b", 1, &[]);
    h.events(b, 3, vec![]);
    h.restart();
    let a2 = h.hello_as("a", 1, &[]);
    assert_eq!(h.sent(a2), vec![welcome(1)]);
    let b2 = h.hello_as("b", 1, &[]);
    assert!(h.refused(b2).unwrap().contains("quarantined"));
}

#[test]
fn m30_lease_ids_never_repeat_across_restarts() {
    let mut h = H::new();
    let mut seen = BTreeSet::new();
    let mut total = 0;
    for round in 0..3 {
        let a = h.ready(&format!("n{round}"), 0.0);
        for _ in 0..3 {
            h.submit(spec());
        }
        let _ = a;
        for o in &h.all {
            if let MillOutput::Send {
                msg: ToExecutor::ReserveSeat { lease, .. },
                ..
            } = o
            {
                total += 1;
                assert!(seen.insert(*lease), "lease {lease} repeated");
            }
        }
        h.restart();
    }
    assert!(total >= 9, "{total} asks");
}

#[test]
fn m30_job_ids_never_repeat_across_restarts() {
    let mut h = H::new();
    let j1 = h.submit(spec());
    h.cancel_req(j1, String::new()).unwrap();
    h.restart();
    let j2 = h.submit(spec());
    assert!(j2 > j1);
}

/// One script of inputs: sessions, bids, events, a disconnect, cancels, timeouts.
fn script() -> Vec<MillOutput> {
    let mut h = H::new();
    let a = h.ready("a", 0.2);
    let b = h.ready("b", 0.1);
    let mut jobs = Vec::new();
    for i in 0..6 {
        let mut s = spec();
        s.payload = vec![i];
        jobs.push(h.submit(s));
        for conn in [a, b] {
            for lease in h.asks(conn) {
                h.accept(conn, lease, charge(&[("jobs", 1)]));
            }
            for lease in h.commits(conn) {
                h.committed(conn, lease);
            }
        }
    }
    h.cancel_req(jobs[0], "x".into()).unwrap();
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    h.advance(60 * SEC);
    h.all
}

#[test]
fn determinism_one_input_sequence_gives_one_output_sequence() {
    let first = script();
    let second = script();
    assert!(first.len() > 30);
    assert_eq!(first, second);
}

/// A running job on `a` cancelled by a client, the cancel sent, then a restart.
fn cancel_then_restart(h: &mut H) -> (JobId, LeaseId) {
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.cancel_req(job, "stop it".into()).unwrap();
    assert_eq!(h.cancels(a), vec![lease]);
    h.restart();
    (job, lease)
}

#[test]
fn m26_an_accepted_cancel_is_durable_before_its_cancel_attempt() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.cancel_req(job, "stop it".into()).unwrap();
    let persist = h
        .out
        .iter()
        .position(|o| {
            matches!(o, MillOutput::Persist(b) if b.writes.iter().any(|w| matches!(
                w,
                MillWrite::LeaseCancel { lease: l, cancel }
                    if *l == lease
                        && cancel.status == TerminalStatus::Cancelled
                        && cancel.cause == TerminalCause::Cancelled
                        && cancel.reason == "stop it"
            )))
        })
        .expect("the cancel is persisted");
    let sent = h
        .out
        .iter()
        .position(|o| {
            matches!(o, MillOutput::Send { msg: ToExecutor::CancelAttempt { lease: l, .. }, .. } if *l == lease)
        })
        .expect("the cancel is sent");
    assert!(persist < sent, "persist before send (M26, M29)");
    assert_eq!(
        h.store.leases[&lease].cancel.as_ref().map(|c| c.status),
        Some(TerminalStatus::Cancelled)
    );
}

#[test]
fn m29_a_restored_cancel_is_sent_again_and_its_teardown_deadline_rearmed() {
    let mut h = H::new();
    let (job, lease) = cancel_then_restart(&mut h);
    assert!(h.terminal_of(job).is_none());
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[lease]);
    assert_eq!(h.cancels(a2), vec![lease], "re-sent on reconcile (M26)");
    assert!(
        h.asks(a2).is_empty(),
        "a pending cancel keeps the node busy (M27)"
    );
    h.msg(a2, ToMill::CancelAck { lease });
    // The ack re-arms the teardown deadline: no terminal comes, the mill ends the job.
    h.keep_alive(a2, 595 * SEC, &[lease]);
    assert!(h.terminal_of(job).is_none());
    h.keep_alive(a2, 10 * SEC, &[lease]);
    let t = h.terminal_of(job).expect("ended at the teardown deadline");
    assert_eq!(t.status, TerminalStatus::Cancelled);
    assert_eq!(t.cause, Some(TerminalCause::TeardownExceeded));
    assert!(
        t.error.as_deref().unwrap_or("").starts_with("stop it"),
        "{t:?}"
    );
}

#[test]
fn m29_a_restored_cancel_decides_the_status_of_the_executors_terminal() {
    let mut h = H::new();
    let (job, lease) = cancel_then_restart(&mut h);
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[lease]);
    h.msg(a2, ToMill::CancelAck { lease });
    h.events(a2, 1, vec![(1, lease, terminal(TerminalStatus::Cancelled))]);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Cancelled);
    assert_eq!(t.cause, Some(TerminalCause::Cancelled));
}

#[test]
fn m29_a_restored_cancel_ends_the_job_cancelled_when_its_node_never_returns() {
    let mut h = H::new();
    let (job, _) = cancel_then_restart(&mut h);
    h.advance(46 * SEC);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Cancelled, "{t:?}");
    assert_eq!(
        t.error.as_deref(),
        Some("stop it"),
        "M5: the cancel's reason"
    );
}

#[test]
fn m29_a_restored_cancel_ends_the_job_cancelled_when_its_node_no_longer_has_it() {
    let mut h = H::new();
    let (job, _) = cancel_then_restart(&mut h);
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[]);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(
        t.status,
        TerminalStatus::Cancelled,
        "M8 with the cancel: {t:?}"
    );
}

#[test]
fn m29_a_restored_timeout_cancel_still_ends_timeout() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let mut s = spec();
    s.timeout = Some(60 * SEC);
    let (job, lease) = h.run_on(a, s);
    h.keep_alive(a, 60 * SEC, &[lease]);
    assert_eq!(h.cancels(a), vec![lease]);
    h.restart();
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[lease]);
    assert_eq!(h.cancels(a2), vec![lease]);
    h.msg(a2, ToMill::CancelAck { lease });
    h.events(a2, 1, vec![(1, lease, terminal(TerminalStatus::Cancelled))]);
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Timeout);
    assert_eq!(t.cause, Some(TerminalCause::Timeout));
}

#[test]
fn m29_a_cancelled_queued_job_stays_ended_after_a_restart() {
    let mut h = H::new();
    let job = h.submit(spec());
    h.cancel_req(job, "never mind".into()).unwrap();
    assert!(
        !h.store.jobs.contains_key(&job),
        "its terminal is durable at once"
    );
    h.restart();
    assert_eq!(h.mill.job_state(job), None);
    let a = h.ready("a", 0.0);
    assert!(h.asks(a).is_empty(), "nothing is placed");
}
