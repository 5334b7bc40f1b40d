//! M35: direct placement — a free seat the mill's accounting vouches for is taken without a
//! bid: quota for the standard charge (E2), the lease published in the step that takes the
//! job up, `ReserveSeat{direct}` and `CommitLease` back to back behind its `Persist`.

use super::*;
use crate::mill::store::AttemptOutcome;
use crate::quota::QuotaConfig;

fn direct_config() -> MillConfig {
    MillConfig {
        direct_placement: true,
        late_binding: false,
        ..config()
    }
}

/// One engine `shell` with `capacity` seats, all free, as a snapshot reports it.
pub(super) fn seats(capacity: u32) -> BTreeMap<String, EngineStatus> {
    let mut m = engines(true, 0.0);
    if let Some(s) = m.get_mut("shell") {
        s.capacity = capacity;
    }
    m
}

/// The messages of the last step to `conn`, named, in order.
pub(super) fn kinds(h: &H, conn: ConnId) -> Vec<(&'static str, LeaseId, bool)> {
    h.sent(conn)
        .into_iter()
        .filter_map(|m| match m {
            ToExecutor::ReserveSeat { lease, direct, .. } => Some(("reserve", lease, direct)),
            ToExecutor::CommitLease { lease, .. } => Some(("commit", lease, false)),
            ToExecutor::ReleaseLease { term: _, lease } => Some(("release", lease, false)),
            _ => None,
        })
        .collect()
}

/// Index in the last step's outputs of the first `Persist` and of the first send to `conn`.
fn persist_then_send(h: &H, conn: ConnId) -> (Option<usize>, Option<usize>) {
    let persist = h
        .out
        .iter()
        .position(|o| matches!(o, MillOutput::Persist(_)));
    let send = h
        .out
        .iter()
        .position(|o| matches!(o, MillOutput::Send { conn: c, .. } if *c == conn));
    (persist, send)
}

#[test]
fn m35_a_free_seat_is_taken_in_the_submit_step_with_reserve_and_commit_back_to_back_after_the_persist(
) {
    let mut h = H::with(direct_config());
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    let mut s = spec();
    s.resources = charge(&[("cpu_millis", 500)]);
    let job = h.submit(s.clone());
    let sent = kinds(&h, a);
    assert_eq!(sent.len(), 2, "{sent:?}");
    let lease = sent[0].1;
    assert_eq!(
        sent,
        vec![("reserve", lease, true), ("commit", lease, false)],
        "the best-ranked node gets the direct ask and its commit back to back"
    );
    assert!(h.sent(b).is_empty(), "no bid: nobody else is asked");
    // M16: the lease, its quota hold and the job's Reserved state are durable first.
    let (persist, send) = persist_then_send(&h, a);
    assert!(persist.is_some() && persist < send, "{:?}", h.out);
    let writes = h.writes();
    assert!(writes
        .iter()
        .any(|w| matches!(w, MillWrite::LeaseUpsert(r) if r.lease == lease && r.state == LeaseState::Reserved && r.resources == s.seat_charge())));
    assert_eq!(
        h.mill.job_state(job),
        Some(JobState::Reserved {
            lease,
            node: node("a")
        })
    );
    // The standard charge (E2) is what quota holds.
    assert_eq!(
        h.mill
            .quota()
            .usage(&crate::quota::Scope::Owner("acme".into())),
        charge(&[("cpu_millis", 500), ("jobs", 1)])
    );
    // The executor answers both in order.
    h.accept(a, lease, s.seat_charge());
    assert!(h.violations().is_empty(), "{:?}", h.violations());
    assert!(
        h.releases(a).is_empty(),
        "a direct acceptance is not released"
    );
    h.committed(a, lease);
    assert_eq!(
        h.mill.job_state(job),
        Some(JobState::Running {
            lease,
            node: node("a")
        })
    );
}

#[test]
fn m35_the_terminal_that_frees_the_only_seat_places_the_next_job_in_the_same_step() {
    let mut h = H::with(direct_config());
    let a = h.hello_as("a", 1, &[]);
    h.snapshot_with(a, seats(1), &[]);
    let first = h.submit(spec());
    let l1 = kinds(&h, a)[0].1;
    h.accept(a, l1, spec().seat_charge());
    h.committed(a, l1);
    let second = h.submit(spec());
    assert!(h.sent(a).is_empty(), "the only seat is held: the job waits");
    assert_eq!(h.mill.job_state(second), Some(JobState::Queued));
    h.events(a, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);
    assert_eq!(
        h.terminal_of(first).map(|t| t.status),
        Some(TerminalStatus::Success)
    );
    let sent = kinds(&h, a);
    assert_eq!(sent.len(), 2, "{sent:?}");
    let l2 = sent[0].1;
    assert_ne!(l1, l2);
    assert_eq!(sent, vec![("reserve", l2, true), ("commit", l2, false)]);
    let (persist, send) = persist_then_send(&h, a);
    assert!(persist.is_some() && persist < send);
}

#[test]
fn m35_a_refused_direct_ask_ends_its_lease_released_without_spending_a_retry_and_the_job_is_bid_for(
) {
    let mut h = H::with(direct_config());
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    let mut s = spec();
    s.retry.retries = 1;
    let job = h.submit(s);
    let lease = kinds(&h, a)[0].1;
    h.reject(a, lease, RejectKind::Transient, "busy: no free seat");
    assert!(h.rare(RarePath::DirectRefused));
    assert!(
        h.sent(a).is_empty(),
        "nothing decided before the commit's answer"
    );
    h.msg(a, crate::testkit::commit_result(lease, false));
    // Released: nothing ran, no retry spent, and the job is bid for (M12), never direct
    // again.
    let attempts: Vec<_> = h
        .writes()
        .into_iter()
        .filter_map(|w| match w {
            MillWrite::Attempt(end) => Some(*end),
            _ => None,
        })
        .collect();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].outcome, AttemptOutcome::Released);
    assert_eq!(attempts[0].lease, lease);
    let asked: Vec<_> = kinds(&h, a).into_iter().chain(kinds(&h, b)).collect();
    assert_eq!(asked.len(), 2, "a bid asks both: {asked:?}");
    assert!(asked
        .iter()
        .all(|(k, _, direct)| *k == "reserve" && !direct));
    assert!(h.commits(a).is_empty() && h.commits(b).is_empty());
    let la = kinds(&h, a)[0].1;
    h.accept(a, la, spec().seat_charge());
    h.committed(a, la);
    assert!(matches!(
        h.mill.job_state(job),
        Some(JobState::Running { .. })
    ));
    assert!(
        h.store.attempts.get(&job).is_some_and(|t| t.retried == 0),
        "{:?}",
        h.store.attempts.get(&job)
    );
}

#[test]
fn m35_an_incompatible_direct_refusal_keeps_the_job_off_that_node_while_another_can_take_it() {
    let mut h = H::with(direct_config());
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    h.submit(spec());
    let lease = kinds(&h, a)[0].1;
    h.reject(a, lease, RejectKind::Incompatible, "missing labels: gpu");
    h.msg(a, crate::testkit::commit_result(lease, false));
    assert!(h.asks(a).is_empty(), "a said never: not asked again (M13)");
    assert_eq!(h.asks(b).len(), 1);
}

#[test]
fn m35_a_direct_acceptance_naming_another_charge_is_an_m14_violation() {
    let mut h = H::with(direct_config());
    let a = h.ready("a", 0.0);
    h.submit(spec());
    let lease = kinds(&h, a)[0].1;
    h.accept(a, lease, charge(&[("jobs", 1), ("gpu", 1)]));
    assert_eq!(h.violation_kinds(), vec![ViolationKind::BadResources]);
    assert!(h.closed(a).is_some());
}

#[test]
fn m35_quota_is_asked_before_any_seat_and_a_grant_is_placed_directly() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        quota: QuotaConfig {
            owner_defaults: charge(&[("jobs", 1)]),
            ..QuotaConfig::default()
        },
        ..direct_config()
    });
    let a = h.ready("a", 0.0);
    h.submit(spec());
    let l1 = kinds(&h, a)[0].1;
    h.accept(a, l1, spec().seat_charge());
    h.committed(a, l1);
    let second = h.submit(spec());
    assert!(h.rare(RarePath::QuotaWait));
    assert!(
        h.sent(a).is_empty(),
        "no seat is asked while quota is short"
    );
    assert_eq!(h.mill.job_state(second), Some(JobState::Queued));
    h.events(a, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);
    let sent = kinds(&h, a);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[0].2, "the grant is used by a direct placement");
    assert_eq!(sent[1], ("commit", sent[0].1, false));
}

#[test]
fn m35_quota_denied_for_the_standard_charge_fails_the_job_without_touching_a_seat() {
    let mut h = H::with(MillConfig {
        quota: QuotaConfig {
            owner_defaults: charge(&[("cpu_millis", 100)]),
            ..QuotaConfig::default()
        },
        ..direct_config()
    });
    let a = h.ready("a", 0.0);
    let mut s = spec();
    s.resources = charge(&[("cpu_millis", 500)]);
    let job = h.submit(s);
    assert!(
        h.sent(a).is_empty(),
        "no seat asked for a charge quota can never hold"
    );
    let t = h.terminal_of(job).expect("ended");
    assert_eq!(t.cause, Some(crate::job::TerminalCause::QuotaDenied));
    assert!(t.error.unwrap_or_default().starts_with("quota denied"));
}
