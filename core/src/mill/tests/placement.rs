//! M10–M17: placement, bids, quota admission, publish and commit.

use super::*;
use crate::quota::QuotaConfig;

#[test]
fn m10_submit_beyond_max_pending_is_refused_and_nothing_is_stored() {
    let mut h = H::with(MillConfig {
        max_pending: 2,
        ..config()
    });
    h.submit(spec());
    h.submit(spec());
    let r = h.submit_req(spec());
    assert_eq!(r, Err(RequestError::TooManyPending { pending: 2, max: 2 }));
    assert!(h.out.is_empty(), "nothing stored or sent");
    assert_eq!(h.store.jobs.len(), 2);
}

#[test]
fn m10_invalid_spec_is_refused_naming_the_field() {
    let mut h = H::new();
    let mut s = spec();
    s.engine = String::new();
    let r = h.submit_req(s);
    match r {
        Err(RequestError::Spec(e)) => assert_eq!(e.field(), "engine"),
        other => panic!("{other:?}"),
    }
    assert!(h.out.is_empty());
}

#[test]
fn m11_rank_by_worst_load_then_sum_then_node_id() {
    let mut idx = RankIndex::default();
    let none = BTreeSet::new();
    let key = |n: &str, loads: &[f64]| ("shell".to_string(), RankKey::new(node(n), loads.iter()));
    idx.upsert(&node("d"), &none, vec![key("d", &[0.5, 0.5])]);
    idx.upsert(&node("c"), &none, vec![key("c", &[0.5, 0.1])]);
    idx.upsert(&node("b"), &none, vec![key("b", &[0.9, 0.0])]);
    idx.upsert(&node("a"), &none, vec![key("a", &[0.5, 0.1])]);
    let mut out = Vec::new();
    idx.top("shell", &none, 10, &mut out);
    assert_eq!(out, vec![node("a"), node("c"), node("d"), node("b")]);
    out.clear();
    idx.top("shell", &none, 2, &mut out);
    assert_eq!(out, vec![node("a"), node("c")]);
    // Updating replaces the old key.
    idx.upsert(&node("a"), &none, vec![key("a", &[0.95])]);
    out.clear();
    idx.top("shell", &none, 10, &mut out);
    assert_eq!(out.last(), Some(&node("a")));
    idx.remove(&node("a"));
    out.clear();
    idx.top("shell", &none, 10, &mut out);
    assert_eq!(out.len(), 3);
}

/// M11: the per-label sets give exactly what filtering the engine's whole ranking would,
/// through upserts that change loads, labels and engines, and removals (a deterministic
/// pseudo-random model check).
#[test]
fn m11_label_constrained_top_matches_a_filter_of_the_whole_ranking() {
    let mut idx = RankIndex::default();
    // What the index should hold: node -> (labels, engine -> loads).
    type Entry = (BTreeSet<String>, Vec<(String, f64)>);
    let mut model: BTreeMap<String, Entry> = BTreeMap::new();
    let pool = ["gpu", "linux", "arm", "big"];
    let engines = ["shell", "docker"];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for step in 0..3_000 {
        let name = format!("n{:02}", next(40));
        if next(10) == 0 {
            idx.remove(&node(&name));
            model.remove(&name);
        } else {
            let labels: BTreeSet<String> = pool
                .iter()
                .filter(|_| next(3) == 0)
                .map(|l| l.to_string())
                .collect();
            let mut keys = Vec::new();
            let mut loads = Vec::new();
            for e in engines {
                if next(3) != 0 {
                    let load = next(8) as f64 / 8.0;
                    keys.push((e.to_string(), RankKey::new(node(&name), [load].iter())));
                    loads.push((e.to_string(), load));
                }
            }
            idx.upsert(&node(&name), &labels, keys);
            if loads.is_empty() {
                model.remove(&name);
            } else {
                model.insert(name, (labels, loads));
            }
        }
        if step % 10 != 0 {
            continue;
        }
        for e in engines {
            let want_labels: BTreeSet<String> = pool
                .iter()
                .filter(|_| next(4) == 0)
                .map(|l| l.to_string())
                .collect();
            let mut expected: Vec<(RankKey, NodeId)> = model
                .iter()
                .filter(|(_, (labels, _))| want_labels.is_subset(labels))
                .filter_map(|(n, (_, loads))| {
                    loads
                        .iter()
                        .find(|(engine, _)| engine == e)
                        .map(|(_, l)| (RankKey::new(node(n), [*l].iter()), node(n)))
                })
                .collect();
            expected.sort();
            let expected: Vec<NodeId> = expected.into_iter().map(|(_, n)| n).take(5).collect();
            let mut got = Vec::new();
            idx.top(e, &want_labels, 5, &mut got);
            assert_eq!(
                got, expected,
                "step {step}, engine {e}, labels {want_labels:?}"
            );
        }
    }
}

#[test]
fn m11_candidates_hold_the_engine_and_every_label() {
    let mut h = H::new();
    let plain = h.ready("plain", 0.0);
    let gpu = h.hello_as("gpu", 1, &["gpu", "linux"]);
    h.snapshot(gpu, 0.9, &[]);
    let mut s = spec();
    s.labels = ["gpu".to_string()].into_iter().collect();
    h.submit(s);
    assert!(h.asks(plain).is_empty());
    assert_eq!(h.asks(gpu).len(), 1);
    let mut s = spec();
    s.engine = "docker".into();
    let job = h.submit(s);
    assert!(h.asks(plain).is_empty() && h.asks(gpu).is_empty());
    assert_eq!(h.mill.job_state(job), Some(JobState::Queued));
}

#[test]
fn m12_bid_asks_top_k_in_parallel_and_the_best_acceptance_wins() {
    let mut h = H::new();
    let conns: Vec<ConnId> = (0..5)
        .map(|i| h.ready(&format!("n{i}"), 0.1 * i as f64))
        .collect();
    let job = h.submit(spec());
    let asked: Vec<usize> = (0..5).filter(|&i| !h.asks(conns[i]).is_empty()).collect();
    assert_eq!(asked, vec![0, 1, 2], "the three least loaded");
    let lease = |h: &H, i: usize| h.asks(conns[i])[0];
    let (l0, l1, l2) = (lease(&h, 0), lease(&h, 1), lease(&h, 2));
    assert!(l0 != l1 && l1 != l2, "fresh lease id per ask");
    // n2 and n1 accept first; the best-ranked (n0) is still out, so no decision yet.
    h.accept(conns[2], l2, charge(&[("jobs", 1)]));
    h.accept(conns[1], l1, charge(&[("jobs", 1)]));
    assert!(h.commits(conns[1]).is_empty());
    h.accept(conns[0], l0, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(conns[0]), vec![l0]);
    assert_eq!(h.releases(conns[1]), vec![l1]);
    assert_eq!(h.releases(conns[2]), vec![l2]);
    assert!(matches!(h.mill.job_state(job), Some(JobState::Reserved { lease, .. }) if lease == l0));
}

/// M12, M30: an ask whose lease id an earlier step made durable leads its step's
/// `Persist` (it goes out while the job's insert is made durable); an ask that raises the
/// floor stays behind it, after a restart too (the floor is raised again first).
#[test]
fn m12_an_ask_with_a_durable_lease_id_goes_out_ahead_of_its_steps_persist() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    let kinds = |h: &H| -> Vec<&'static str> {
        h.out
            .iter()
            .filter_map(|o| match o {
                MillOutput::Persist(_) => Some("persist"),
                MillOutput::Send {
                    msg: ToExecutor::ReserveSeat { .. },
                    ..
                } => Some("ask"),
                _ => None,
            })
            .collect()
    };
    let a = h.ready("a", 0.0);
    // The first ask raises the lease floor: its id is durable only with the step's write.
    h.submit(spec());
    assert_eq!(kinds(&h), ["persist", "ask"]);
    assert_eq!(h.asks(a).len(), 1);
    // The next ask's id lies below the durable floor: it leads the job's insert.
    let second = h.submit(spec());
    assert_eq!(kinds(&h), ["ask", "persist"]);
    assert!(h
        .writes()
        .iter()
        .any(|w| matches!(w, MillWrite::JobInsert { job, .. } if *job == second)));
    // A restarted mill resumes above the last durable block: its first asks (the restored
    // jobs', once `a` is back) raise the floor again and wait for that write.
    h.restart();
    h.advance(SEC);
    let a = h.ready("a", 0.0);
    assert!(
        !h.asks(a).is_empty(),
        "the restored jobs are asked for again"
    );
    let k = kinds(&h);
    let first_ask = k.iter().position(|k| *k == "ask");
    let persist = k.iter().position(|k| *k == "persist");
    assert!(
        matches!((persist, first_ask), (Some(p), Some(a)) if p < a),
        "after a restart no ask leads the write of its lease floor: {k:?}"
    );
}

#[test]
fn m12_best_ranked_acceptance_decides_without_waiting_for_worse_asks() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    h.submit(spec());
    let (la, lb) = (h.asks(a)[0], h.asks(b)[0]);
    h.accept(a, la, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![la]);
    // b's late acceptance is released at once.
    h.accept(b, lb, charge(&[("jobs", 1)]));
    assert_eq!(h.releases(b), vec![lb]);
}

#[test]
fn m12_a_failed_ask_lets_the_next_candidate_be_asked() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    h.submit(spec());
    let la = h.asks(a)[0];
    assert!(h.asks(b).is_empty());
    h.reject(a, la, RejectKind::Transient, "busy");
    assert_eq!(h.asks(b).len(), 1);
}

#[test]
fn m12_an_ask_unanswered_within_bid_timeout_fails_and_its_seat_is_released() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    h.submit(spec());
    let la = h.asks(a)[0];
    h.advance(5 * SEC);
    assert_eq!(h.releases(a), vec![la]);
    assert_eq!(h.asks(b).len(), 1);
}

#[test]
fn m13_every_answer_incompatible_fails_the_job_with_the_reasons() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.1);
    let job = h.submit(spec());
    let (la, lb) = (h.asks(a)[0], h.asks(b)[0]);
    h.reject(a, la, RejectKind::Incompatible, "no such image");
    h.reject(b, lb, RejectKind::Incompatible, "arm only");
    let t = h.terminal_of(job).unwrap();
    assert_eq!(t.status, TerminalStatus::Failed);
    let e = t.error.unwrap();
    assert!(e.starts_with("no compatible executor"), "{e}");
    assert!(e.contains("no such image") && e.contains("arm only"), "{e}");
}

#[test]
fn m13_a_busy_fleet_makes_the_job_wait_and_retry_on_change_never_by_polling() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.1);
    let job = h.submit(spec());
    let (la, lb) = (h.asks(a)[0], h.asks(b)[0]);
    h.reject(a, la, RejectKind::Incompatible, "nope");
    h.reject(b, lb, RejectKind::Transient, "busy");
    assert_eq!(h.mill.job_state(job), Some(JobState::Queued));
    assert!(h.asks(a).is_empty() && h.asks(b).is_empty());
    // Time alone does not retry it.
    h.advance(SEC);
    assert!(h.asks(a).is_empty() && h.asks(b).is_empty());
    // A snapshot (a change) does; a, which can never run it, is not asked again.
    h.snapshot(b, 0.2, &[]);
    assert_eq!(h.asks(b).len(), 1);
    assert!(h.asks(a).is_empty());
}

#[test]
fn m13_a_node_that_said_incompatible_is_not_asked_again_while_another_can_be() {
    // Found by the simulator (byzantine seed 5910): an older job kept re-asking the only
    // free seat of a node that could never run it, so a younger job that node could run
    // waited while it idled (I9).
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.1);
    let old = h.submit(spec());
    let (la, lb) = (h.asks(a)[0], h.asks(b)[0]);
    h.reject(a, la, RejectKind::Incompatible, "not this image");
    h.reject(b, lb, RejectKind::Transient, "busy");
    let young = h.submit(spec());
    let to_a: Vec<JobId> = h
        .sent(a)
        .into_iter()
        .filter_map(|m| match m {
            ToExecutor::ReserveSeat { job, .. } => Some(job),
            _ => None,
        })
        .collect();
    assert_eq!(to_a, vec![young], "only the job a can run is asked there");
    let old_at_b = h.sent(b).into_iter().find_map(|m| match m {
        ToExecutor::ReserveSeat { lease, job, .. } if job == old => Some(lease),
        _ => None,
    });
    h.reject(b, old_at_b.unwrap(), RejectKind::Transient, "busy");
    assert_eq!(h.mill.job_state(old), Some(JobState::Queued));
    // A new session of a may run another config: then it is asked again.
    let ask_of = |h: &H, conn: ConnId, wanted: JobId| {
        h.sent(conn).into_iter().find_map(|m| match m {
            ToExecutor::ReserveSeat { lease, job, .. } if job == wanted => Some(lease),
            _ => None,
        })
    };
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    let again_at_b = ask_of(&h, b, old).unwrap();
    let a2 = h.ready("a", 0.0);
    h.reject(b, again_at_b, RejectKind::Transient, "busy");
    h.snapshot(a2, 0.0, &[]);
    let asked_again = ask_of(&h, a2, old).is_some();
    assert!(asked_again, "{:?}", h.out);
}

#[test]
fn m14_an_invalid_resource_claim_is_a_violation_and_the_bid_fails() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.5);
    h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("cpu", 0)]));
    assert_eq!(h.violation_kinds(), vec![ViolationKind::BadResources]);
    assert!(h.closed(a).is_some());
    assert_eq!(h.asks(b).len(), 1, "the next candidate is asked");
}

fn quota_config(jobs_limit: u64) -> MillConfig {
    MillConfig {
        top_k: 1,
        quota: QuotaConfig {
            owner_defaults: charge(&[("jobs", jobs_limit)]),
            ..QuotaConfig::default()
        },
        ..config()
    }
}

#[test]
fn m15_quota_denied_releases_the_seat_and_fails_the_job() {
    let mut h = H::with(quota_config(1));
    let a = h.ready("a", 0.0);
    let job = h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 2)]));
    assert_eq!(h.releases(a), vec![la]);
    let t = h.terminal_of(job).unwrap();
    assert!(t.error.unwrap().starts_with("quota denied"));
}

#[test]
fn m15_quota_temporary_releases_the_seat_waits_and_rebids_when_granted() {
    let mut h = H::with(quota_config(1));
    let a = h.ready("a", 0.0);
    let (first, first_lease) = h.run_on(a, spec());
    let second = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    assert_eq!(
        h.releases(a),
        vec![l2],
        "no fleet capacity held while waiting"
    );
    assert!(h.rare(RarePath::QuotaWait));
    assert_eq!(h.mill.job_state(second), Some(JobState::Queued));
    // The first job ends: quota is granted to the second, which bids again.
    h.events(
        a,
        1,
        vec![(1, first_lease, terminal(TerminalStatus::Success))],
    );
    assert_eq!(
        h.terminal_of(first).unwrap().status,
        TerminalStatus::Success
    );
    let l3 = h.asks(a)[0];
    h.accept(a, l3, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![l3]);
    assert_eq!(
        h.mill
            .quota()
            .usage(&crate::quota::Scope::Owner("acme".into())),
        charge(&[("jobs", 1)])
    );
}

/// M15, Q2: a job waiting for quota is visible in the ledger with what holds it up, and a
/// queue timeout while it waits says which scope and resource (issue 13 item 5).
#[test]
fn m15_a_quota_wait_names_the_full_scope_and_its_queue_timeout_says_so() {
    let mut h = H::with(MillConfig {
        queue_timeout: 30 * SEC,
        ..quota_config(1)
    });
    let a = h.ready("a", 0.0);
    let (_, first_lease) = h.run_on(a, spec());
    let second = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 1)]));
    let blocked = h.mill.quota().blocked(second);
    assert_eq!(
        blocked,
        Some(crate::quota::Blocked::Limit {
            scope: crate::quota::Scope::Owner("acme".into()),
            resource: "jobs".into(),
            used: 1,
            asks: 1,
            limit: 1,
        })
    );
    h.keep_alive(a, 31 * SEC, &[first_lease]);
    let t = h.terminal_of(second).expect("ended by its queue timeout");
    assert_eq!(t.cause, Some(crate::job::TerminalCause::QueueTimeout));
    let error = t.error.unwrap_or_default();
    assert!(
        error.contains("waiting for quota: owner \"acme\" jobs 1/1 in use (asks 1)"),
        "{error}"
    );
    assert!(!h.mill.quota().is_waiting(second), "its wait is dropped");
}

#[test]
fn m15_a_rebid_charging_other_resources_releases_both_and_retries() {
    let mut h = H::with(quota_config(2));
    let a = h.ready("a", 0.0);
    let (_, first_lease) = h.run_on(a, spec());
    let second = h.submit(spec());
    let l2 = h.asks(a)[0];
    h.accept(a, l2, charge(&[("jobs", 2)])); // 1 + 2 > 2: wait
    h.events(
        a,
        1,
        vec![(1, first_lease, terminal(TerminalStatus::Success))],
    );
    let l3 = h.asks(a)[0];
    h.accept(a, l3, charge(&[("jobs", 1)])); // a different charge than the quota holds
    assert!(h.rare(RarePath::QuotaRebidChangedResources));
    assert_eq!(h.releases(a), vec![l3]);
    // It retries from scratch, and this time the charge fits.
    let l4 = h.asks(a)[0];
    h.accept(a, l4, charge(&[("jobs", 1)]));
    assert_eq!(h.commits(a), vec![l4]);
    assert!(matches!(
        h.mill.job_state(second),
        Some(JobState::Reserved { .. })
    ));
}

#[test]
fn m16_the_lease_and_its_quota_are_persisted_before_the_commit_is_sent() {
    let mut h = H::with(quota_config(5));
    let a = h.ready("a", 0.0);
    let job = h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 1)]));
    let persist_at = h
        .out
        .iter()
        .position(|o| matches!(o, MillOutput::Persist(_)))
        .unwrap();
    let commit_at = h
        .out
        .iter()
        .position(|o| {
            matches!(
                o,
                MillOutput::Send {
                    msg: ToExecutor::CommitLease { .. },
                    ..
                }
            )
        })
        .unwrap();
    assert!(persist_at < commit_at);
    let w = h.writes();
    assert!(w.iter().any(|w| matches!(w, MillWrite::LeaseUpsert(r) if r.lease == la && r.state == LeaseState::Reserved && r.job == job)));
    assert!(w
        .iter()
        .any(|w| matches!(w, MillWrite::QuotaHold { job: j, .. } if *j == job)));
}

#[test]
fn m17_committed_persists_running() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 1)]));
    h.committed(a, la);
    assert!(h
        .writes()
        .iter()
        .any(|w| matches!(w, MillWrite::LeaseUpsert(r) if r.state == LeaseState::Running)));
    assert_eq!(h.store.leases[&la].state, LeaseState::Running);
}

#[test]
fn m17_an_unanswered_commit_is_resent_on_a_live_session() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 1)]));
    h.snapshot(a, 0.0, &[la]);
    h.advance(5 * SEC);
    assert_eq!(h.commits(a), vec![la]);
    assert!(h.rare(RarePath::CommitResent));
}

#[test]
fn m17_the_commit_waits_out_a_disconnect_and_goes_out_when_the_node_is_back() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let job = h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 1)]));
    h.input(MillInput::Disconnected { conn: a }).unwrap();
    h.advance(10 * SEC);
    let again = h.hello_as("a", 1, &[]);
    assert!(h.commits(again).is_empty(), "not before reconcile");
    h.snapshot(again, 0.0, &[la]);
    assert_eq!(h.commits(again), vec![la]);
    h.committed(again, la);
    assert!(matches!(
        h.mill.job_state(job),
        Some(JobState::Running { .. })
    ));
}

#[test]
fn m17_not_committed_means_nothing_runs_and_the_job_is_placed_again() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let job = h.submit(spec());
    let la = h.asks(a)[0];
    h.accept(a, la, charge(&[("jobs", 1)]));
    h.msg(a, crate::testkit::commit_result(la, false));
    assert!(h.writes().contains(&MillWrite::LeaseDelete { lease: la }));
    assert!(h.updates().contains(&(job, JobState::Queued)));
    assert_eq!(h.asks(a).len(), 1);
}

fn owned(owner: &str) -> JobSpec {
    let mut s = spec();
    s.identity.owner = owner.into();
    s.identity.repo = format!("{owner}/app");
    s
}

/// The jobs of the `ReserveSeat`s sent to `conn` in the last step, in the order sent.
fn asked_jobs(h: &H, conn: ConnId) -> Vec<JobId> {
    h.sent(conn)
        .into_iter()
        .filter_map(|m| match m {
            ToExecutor::ReserveSeat { job, .. } => Some(job),
            _ => None,
        })
        .collect()
}

/// M33: among waiting jobs, the next placement goes to the owner with the fewest leases,
/// ties by submit order — an owner with a running job and a backlog goes after an owner
/// with none, however much older its backlog is.
#[test]
fn m33_the_owner_with_fewest_leases_is_placed_first() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (_a1, _lease) = h.run_on(a, owned("alice"));
    // The node says it is full: the backlog waits.
    h.snapshot_with(a, engines(false, 1.0), &[_lease]);
    let backlog: Vec<JobId> = (0..4).map(|_| h.submit(owned("alice"))).collect();
    let b1 = h.submit(owned("bob"));
    assert!(
        asked_jobs(&h, a).is_empty(),
        "nothing is asked while the node is full"
    );
    // A seat frees: bob (no lease) goes before alice's older backlog (one lease).
    h.snapshot_with(a, engines(true, 0.25), &[_lease]);
    let asked = asked_jobs(&h, a);
    assert_eq!(
        asked.first(),
        Some(&b1),
        "asked {asked:?}; alice's backlog {backlog:?}"
    );
    // Then alternation by lease count, and within an owner submit order.
    assert!(asked.len() >= 2, "asked {asked:?}");
    assert_eq!(asked[1], backlog[0], "{asked:?}");
    h.mill.check_fairness_index().unwrap();
}

/// M33 with no leases anywhere: equal loads tie by submit order, so a lone owner is still
/// served oldest first and two owners alternate.
#[test]
fn m33_equal_loads_alternate_owners_oldest_first() {
    let mut h = H::new();
    let a = h.hello_as("a", 1, &[]);
    let x: Vec<JobId> = (0..3).map(|_| h.submit(owned("xena"))).collect();
    let y: Vec<JobId> = (0..3).map(|_| h.submit(owned("yuri"))).collect();
    h.snapshot(a, 0.0, &[]);
    let asked = asked_jobs(&h, a);
    // The first pass asks as many as it may (top_k); the order is what M33 decides.
    let want = [x[0], y[0], x[1], y[1], x[2], y[2]];
    assert!(asked.len() >= 2, "asked {asked:?}");
    assert_eq!(asked[..], want[..asked.len()], "asked {asked:?}");
    h.mill.check_fairness_index().unwrap();
}

fn prioritised(owner: &str, priority: i32) -> JobSpec {
    let mut s = owned(owner);
    s.priority = priority;
    s
}

/// M33: within one owner, a higher priority job goes before older ones; equal priorities
/// keep submit order.
#[test]
fn m33_an_owners_higher_priority_job_goes_first() {
    let mut h = H::new();
    let a = h.hello_as("a", 1, &[]);
    let low = h.submit(prioritised("alice", -1));
    let old = h.submit(prioritised("alice", 0));
    let urgent = h.submit(prioritised("alice", 5));
    let newer = h.submit(prioritised("alice", 0));
    h.snapshot(a, 0.0, &[]);
    let asked = asked_jobs(&h, a);
    let want = [urgent, old, newer, low];
    assert!(asked.len() >= 2, "asked {asked:?}");
    assert_eq!(asked[..], want[..asked.len()], "asked {asked:?}");
    h.mill.check_fairness_index().unwrap();
}

/// M33: between owners with equal loads, the one whose next job has the higher priority
/// goes first; lease counts still come before priority, so a high priority never lets an
/// owner with leases overtake one without.
#[test]
fn m33_priority_breaks_ties_between_owners_but_not_lease_counts() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let (_c1, lease) = h.run_on(a, owned("carol"));
    h.snapshot_with(a, engines(false, 1.0), &[lease]);
    let carol_urgent = h.submit(prioritised("carol", 100));
    let dave = h.submit(prioritised("dave", 0));
    let erin = h.submit(prioritised("erin", 3));
    assert!(asked_jobs(&h, a).is_empty(), "the node is full");
    h.snapshot_with(a, engines(true, 0.25), &[lease]);
    let asked = asked_jobs(&h, a);
    // dave and erin hold no lease; erin's job has the higher priority. carol has one lease
    // already, so her priority 100 job waits behind both.
    let want = [erin, dave, carol_urgent];
    assert!(asked.len() >= 2, "asked {asked:?}");
    assert_eq!(asked[..], want[..asked.len()], "asked {asked:?}");
    h.mill.check_fairness_index().unwrap();
}

fn pinned(to: &str) -> JobSpec {
    let mut s = spec();
    s.node = Some(node(to));
    s
}

/// M34: a pinned job's only candidate is its node, however badly it ranks; the better
/// ranked nodes are not asked.
#[test]
fn m34_a_pinned_job_is_asked_only_of_its_node() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let b = h.ready("b", 0.1);
    let c = h.ready("c", 0.9);
    let job = h.submit(pinned("c"));
    assert_eq!(asked_jobs(&h, c), [job]);
    assert!(asked_jobs(&h, a).is_empty());
    assert!(asked_jobs(&h, b).is_empty());
}

/// M34: a job pinned to a node that is not connected waits for it (it is not failed as
/// having no compatible executor, and unpinned jobs behind it are placed), and is asked of
/// that node once it is ready.
#[test]
fn m34_a_job_pinned_to_an_absent_node_waits_for_it_without_holding_up_others() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let waiting = h.submit(pinned("late"));
    assert!(asked_jobs(&h, a).is_empty(), "a is not the pinned node");
    let free = h.submit(spec());
    assert_eq!(
        asked_jobs(&h, a),
        [free],
        "an unpinned job goes past the waiting one"
    );
    assert_eq!(h.ended(waiting), None, "the pinned job still waits");
    let late = h.ready("late", 0.5);
    assert_eq!(asked_jobs(&h, late), [waiting]);
}

/// M34: a pinned job whose node refuses it as incompatible (it lacks the engine or labels
/// after all) fails with no compatible executor instead of waiting for ever.
#[test]
fn m34_a_pinned_job_its_node_refuses_fails_as_having_no_compatible_executor() {
    let mut h = H::new();
    let a = h.ready("a", 0.0);
    let job = h.submit(pinned("a"));
    let lease = h.asks(a)[0];
    h.reject(a, lease, RejectKind::Incompatible, "missing labels: gpu");
    let t = h.ended(job).expect("ended");
    assert_eq!(t.status, TerminalStatus::Failed);
    assert_eq!(
        t.cause,
        Some(crate::job::TerminalCause::NoCompatibleExecutor)
    );
}

/// M34, M11: the ranking uses every resource load an executor reports, not just its seats:
/// of two nodes with the same free seats, the one whose CPUs are nearly all taken is asked
/// last.
#[test]
fn m34_ranking_uses_resource_loads_not_only_seats() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    let with_cpu = |cpu: f64| {
        let mut e = engines(true, 0.25);
        if let Some(s) = e.get_mut("shell") {
            s.load.insert("cpu".to_string(), cpu);
        }
        e
    };
    let busy = h.hello_as("a-busy", 1, &[]);
    h.snapshot_with(busy, with_cpu(0.95), &[]);
    let idle = h.hello_as("b-idle", 1, &[]);
    h.snapshot_with(idle, with_cpu(0.05), &[]);
    let job = h.submit(spec());
    assert_eq!(asked_jobs(&h, idle), [job]);
    assert!(
        asked_jobs(&h, busy).is_empty(),
        "top_k 1: only the best is asked"
    );
}

/// M34: a node whose snapshot shows a resource fully used is not asked for a job that asks
/// for that resource (it would only refuse, Transient), even when it ranks first for it
/// otherwise or is the job's pinned node; a job asking nothing of it is still asked there,
/// in the same pass: passing a class over for its resources does not pass over the class.
#[test]
fn m34_a_node_whose_resource_is_full_is_not_asked_for_a_job_needing_it() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    let with_cpu = |cpu: f64, seats: f64| {
        let mut e = engines(true, seats);
        if let Some(s) = e.get_mut("shell") {
            s.load.insert("cpu".to_string(), cpu);
        }
        e
    };
    // `full` ranks first by seats but has no cpu left; `spare` is busier but has cpu.
    let full = h.hello_as("a-full", 1, &[]);
    h.snapshot_with(full, with_cpu(1.0, 0.0), &[]);
    let spare = h.hello_as("b-spare", 1, &[]);
    h.snapshot_with(spare, with_cpu(0.0, 0.5), &[]);
    let mut big = spec();
    big.resources.insert("cpu".into(), 4);
    let big = h.submit(big);
    assert_eq!(
        asked_jobs(&h, spare),
        [big],
        "the node with cpu free is asked"
    );
    assert!(
        asked_jobs(&h, full).is_empty(),
        "the full node is not asked"
    );

    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    // Both wait for a node; its first snapshot places them in one pass.
    let mut big = spec();
    big.resources.insert("cpu".into(), 4);
    let big = h.submit(big);
    let small = h.submit(spec());
    let full = h.hello_as("a-full", 1, &[]);
    h.snapshot_with(full, with_cpu(1.0, 0.0), &[]);
    assert_eq!(
        asked_jobs(&h, full),
        [small],
        "the cpu job waits for cpu; the job asking no cpu, of the same class, is asked"
    );
    let mut pin = pinned("a-full");
    pin.resources.insert("cpu".into(), 4);
    let pin = h.submit(pin);
    assert!(
        asked_jobs(&h, full).is_empty(),
        "the pinned cpu job waits too"
    );
    // Its cpu frees up: both are asked.
    h.snapshot_with(full, with_cpu(0.0, 0.0), &[]);
    let mut asked = asked_jobs(&h, full);
    asked.sort();
    assert_eq!(asked, [big, pin], "asked once cpu is free");
}

/// M34: a node that refused a job Transient for a resource is not asked for it again until
/// it frees something — other wake-ups (a new job asked of it) do not re-ask it —
/// and is asked again after its next snapshot; a busy refusal (not a resource) is retried
/// on the next wake-up as before.
#[test]
fn m34_a_node_that_refused_a_job_for_a_resource_is_asked_again_only_after_it_frees_something() {
    let mut h = H::with(MillConfig {
        top_k: 1,
        ..config()
    });
    let mut half = engines(true, 0.0);
    if let Some(s) = half.get_mut("shell") {
        s.load.insert("cpu".to_string(), 0.5);
    }
    let x = h.hello_as("x", 1, &[]);
    h.snapshot_with(x, half.clone(), &[]);
    let mut big = spec();
    big.resources.insert("cpu".into(), 64);
    let big = h.submit(big);
    let lease = match h.asks(x).as_slice() {
        [l] => *l,
        other => panic!("one ask, got {other:?}"),
    };
    h.reject(
        x,
        lease,
        RejectKind::Transient,
        "resource cpu: asks for 64, 32 of 64 free",
    );
    // A new job wakes placement and is asked of x (a seat taken frees nothing): x is not
    // asked again for the big job.
    let small = h.submit(spec());
    assert_eq!(
        asked_jobs(&h, x),
        [small],
        "x refused the big job for cpu and freed nothing since"
    );
    // x's next snapshot shows cpu freed: it is asked again.
    if let Some(s) = half.get_mut("shell") {
        s.load.insert("cpu".to_string(), 0.0);
    }
    h.snapshot_with(x, half, &[]);
    assert_eq!(asked_jobs(&h, x), [big], "asked again after x's snapshot");
}
