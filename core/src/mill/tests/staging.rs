//! M36: late binding — a queued job that finds no free seat is staged on a full node (a
//! direct ask the executor holds for its next free seat, E16), and withdrawn when a seat
//! elsewhere frees first or a job that goes before it (M33) arrives.

use super::direct::{kinds, seats};
use super::*;
use crate::mill::store::AttemptOutcome;

fn staging_config() -> MillConfig {
    MillConfig {
        direct_placement: true,
        late_binding: true,
        ..config()
    }
}

/// A node `name` with one seat, holding a running job; returns its connection, the job and
/// its lease.
fn one_seat_busy(h: &mut H, name: &str, s: JobSpec) -> (ConnId, JobId, LeaseId) {
    let conn = h.hello_as(name, 1, &[]);
    h.snapshot_with(conn, seats(1), &[]);
    let job = h.submit(s.clone());
    let lease = kinds(h, conn)[0].1;
    h.accept(conn, lease, s.seat_charge());
    h.committed(conn, lease);
    (conn, job, lease)
}

fn attempts(h: &H) -> Vec<crate::mill::store::AttemptEnd> {
    h.writes()
        .into_iter()
        .filter_map(|w| match w {
            MillWrite::Attempt(end) => Some(*end),
            _ => None,
        })
        .collect()
}

#[test]
fn m36_a_job_with_no_free_seat_is_staged_on_a_full_node_and_runs_when_its_commit_is_answered() {
    let mut h = H::with(staging_config());
    let (a, first, l1) = one_seat_busy(&mut h, "a", spec());
    let second = h.submit(spec());
    let sent = kinds(&h, a);
    assert_eq!(sent.len(), 2, "{sent:?}");
    let l2 = sent[0].1;
    assert_eq!(sent, vec![("reserve", l2, true), ("commit", l2, false)]);
    assert!(h.rare(RarePath::Staged));
    assert_eq!(
        h.mill.job_state(second),
        Some(JobState::Reserved {
            lease: l2,
            node: node("a")
        })
    );
    // A third job finds the node's one staged place taken: it waits in the queue.
    let third = h.submit(spec());
    assert!(h.sent(a).is_empty(), "{:?}", h.sent(a));
    assert_eq!(h.mill.job_state(third), Some(JobState::Queued));
    h.accept(a, l2, spec().seat_charge());
    // The commit is not answered while it waits; re-sending it would only repeat it.
    h.advance(Duration::from_secs(6));
    assert!(h.commits(a).is_empty(), "{:?}", h.sent(a));
    // The first job ends: the executor starts the staged one on its own, and says so.
    h.events(a, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);
    assert_eq!(
        h.terminal_of(first).map(|t| t.status),
        Some(TerminalStatus::Success)
    );
    assert!(
        h.asks(a).is_empty(),
        "the freed seat is the staged job's: nothing else is asked there"
    );
    h.committed(a, l2);
    assert_eq!(
        h.mill.job_state(second),
        Some(JobState::Running {
            lease: l2,
            node: node("a")
        })
    );
    // Its place in line is free again: the third job is staged behind it.
    let sent = kinds(&h, a);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[0].2, "{sent:?}");
}

#[test]
fn m36_a_seat_freed_elsewhere_withdraws_the_staged_lease_and_its_job_takes_that_seat() {
    let mut h = H::with(staging_config());
    let (a, _, la) = one_seat_busy(&mut h, "a", spec());
    let (b, on_b, lb) = one_seat_busy(&mut h, "b", spec());
    assert_eq!(
        h.mill.job_state(on_b),
        Some(JobState::Running {
            lease: lb,
            node: node("b")
        })
    );
    let job = h.submit(spec());
    let (staged_conn, other) = if kinds(&h, a).is_empty() {
        (b, a)
    } else {
        (a, b)
    };
    let staged = kinds(&h, staged_conn)[0].1;
    let (free_conn, free_lease, free_node) = if other == b {
        (b, lb, "b")
    } else {
        (a, la, "a")
    };
    h.events(
        free_conn,
        1,
        vec![(1, free_lease, terminal(TerminalStatus::Success))],
    );
    assert_eq!(kinds(&h, staged_conn), vec![("release", staged, false)]);
    assert!(
        h.asks(other).is_empty(),
        "nothing is placed before the answer"
    );
    // Not started there: it ends Released, no retry spent, and the job takes the free seat
    // directly.
    h.msg(staged_conn, crate::testkit::commit_result(staged, false));
    assert!(h.rare(RarePath::StagedWithdrawn));
    let ends = attempts(&h);
    assert_eq!(ends.len(), 1, "{ends:?}");
    assert_eq!(ends[0].outcome, AttemptOutcome::Released);
    let sent = kinds(&h, other);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[0].2, "placed directly again: {sent:?}");
    assert_eq!(
        h.mill.job_state(job),
        Some(JobState::Reserved {
            lease: sent[0].1,
            node: node(free_node)
        })
    );
}

#[test]
fn m36_a_withdrawn_lease_that_already_started_runs_where_it_is() {
    let mut h = H::with(staging_config());
    let (a, _, l1) = one_seat_busy(&mut h, "a", spec());
    let (b, _, lb) = one_seat_busy(&mut h, "b", spec());
    let job = h.submit(spec());
    let (staged_conn, free_conn, free_lease) = if kinds(&h, a).is_empty() {
        (b, a, l1)
    } else {
        (a, b, lb)
    };
    let staged = kinds(&h, staged_conn)[0].1;
    h.events(
        free_conn,
        1,
        vec![(1, free_lease, terminal(TerminalStatus::Success))],
    );
    assert_eq!(kinds(&h, staged_conn), vec![("release", staged, false)]);
    // The staged job's seat freed first: the executor started it before the release came
    // (E8: a release leaves a started job alone).
    h.committed(staged_conn, staged);
    assert!(matches!(
        h.mill.job_state(job),
        Some(JobState::Running { lease, .. }) if lease == staged
    ));
    assert!(attempts(&h).is_empty());
}

#[test]
fn m36_m33_a_higher_priority_job_takes_the_place_of_a_staged_lower_one() {
    let mut h = H::with(staging_config());
    let (a, _, l1) = one_seat_busy(&mut h, "a", spec());
    let low = h.submit(spec());
    let l_low = kinds(&h, a)[0].1;
    let mut urgent = spec();
    urgent.priority = 5;
    let high = h.submit(urgent);
    // M33: the later, higher-priority job goes first, so the staged one is asked back.
    assert_eq!(kinds(&h, a), vec![("release", l_low, false)]);
    assert_eq!(h.mill.job_state(high), Some(JobState::Queued));
    h.msg(a, crate::testkit::commit_result(l_low, false));
    let sent = kinds(&h, a);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(
        h.mill.job_state(high),
        Some(JobState::Reserved {
            lease: sent[0].1,
            node: node("a")
        })
    );
    assert_eq!(h.mill.job_state(low), Some(JobState::Queued));
    // A job of lower priority than the staged one changes nothing.
    let later = h.submit(spec());
    assert!(kinds(&h, a).is_empty(), "{:?}", kinds(&h, a));
    assert_eq!(h.mill.job_state(later), Some(JobState::Queued));
    // The seat frees: the urgent job starts, and the older of the two others is staged.
    h.events(a, 1, vec![(1, l1, terminal(TerminalStatus::Success))]);
    h.committed(a, sent[0].1);
    let next = kinds(&h, a);
    assert_eq!(next.len(), 2, "{next:?}");
    assert_eq!(
        h.mill.job_state(low),
        Some(JobState::Reserved {
            lease: next[0].1,
            node: node("a")
        })
    );
}

#[test]
fn m36_a_cancelled_staged_job_is_cancelled_on_its_node_and_ends_cancelled() {
    let mut h = H::with(staging_config());
    let (a, _, _) = one_seat_busy(&mut h, "a", spec());
    let job = h.submit(spec());
    let staged = kinds(&h, a)[0].1;
    h.cancel_req(job, "no longer wanted".into()).unwrap();
    // Its commit went out, so only a cancel stops it (E7, E8).
    assert_eq!(h.cancels(a), vec![staged]);
    assert_eq!(
        h.terminal_of(job).map(|t| t.status),
        Some(TerminalStatus::Cancelled)
    );
}

#[test]
fn m36_a_refused_staged_ask_leaves_the_node_unstaged_until_it_frees_something() {
    let mut h = H::with(staging_config());
    let (a, _, _) = one_seat_busy(&mut h, "a", spec());
    let job = h.submit(spec());
    let staged = kinds(&h, a)[0].1;
    h.reject(
        a,
        staged,
        RejectKind::Transient,
        "draining: the executor is shutting down",
    );
    h.msg(a, crate::testkit::commit_result(staged, false));
    assert_eq!(h.mill.job_state(job), Some(JobState::Queued));
    assert!(
        h.sent(a).is_empty(),
        "not staged there again: {:?}",
        h.sent(a)
    );
    let other = h.submit(spec());
    assert!(h.sent(a).is_empty(), "{:?}", h.sent(a));
    assert_eq!(h.mill.job_state(other), Some(JobState::Queued));
}
