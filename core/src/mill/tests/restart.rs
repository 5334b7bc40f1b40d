//! M29, M30: restart from the durable store; and determinism.

use super::*;

#[test]
fn m29_restart_restores_running_leases_requeues_reserved_and_queued_jobs() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (running, lease) = h.run_on(a, spec());
    let reserved = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    let mut s = spec();
    s.engine = "docker".into();
    let queued = h.submit(s);

    h.restart();
    assert!(h.rare(RarePath::RestartWithRunningLeases));
    assert!(h.writes().contains(&MillWrite::LeaseDelete { lease: l2 }));
    assert!(
        matches!(h.mill.job_state(running), Some(JobState::Running { lease: l, .. }) if l == lease)
    );
    assert_eq!(h.mill.job_state(reserved), Some(JobState::Queued));
    assert_eq!(h.mill.job_state(queued), Some(JobState::Queued));

    // The node comes back, reports its running lease: it is claimed, and its result lands.
    let a2 = h.hello_as("a", 1, &[]);
    h.snapshot(a2, 0.0, &[lease]);
    assert_eq!(h.asks(a2).len(), 1, "the re-queued job is placed again");
    h.events(a2, 1, vec![(1, lease, terminal(TerminalStatus::Success))]);
    assert_eq!(
        h.terminal_of(running).unwrap().status,
        TerminalStatus::Success
    );
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
    h.restart();
    assert!(h.mill.quota().is_held(running));
    assert!(!h.mill.quota().is_held(reserved));
    assert!(h
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
    assert_eq!(h.sent(a2), vec![ToExecutor::Welcome { cursor: Seqno(1) }]);
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
    h.input(MillInput::Cancel {
        job: j1,
        reason: String::new(),
    })
    .unwrap();
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
    h.input(MillInput::Cancel {
        job: jobs[0],
        reason: "x".into(),
    })
    .unwrap();
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
