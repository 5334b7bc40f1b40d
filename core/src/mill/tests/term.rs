//! E13 on the mill's side (DESIGN §10): the term rides in every message, and an executor that
//! has seen a higher term is refused and makes the mill doubt it leads.

use super::*;
use crate::types::Term;

fn at_term(term: u64) -> H {
    H::with(MillConfig {
        term: Term(term),
        ..config()
    })
}

fn hello_seen(h: &mut H, name: &str, seen: Term) -> ConnId {
    let conn = ConnId(900 + seen.get());
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(
        conn,
        crate::testkit::Hello::new(name, Epoch(1))
            .token("secret")
            .labels(&["linux"])
            .term(seen)
            .build(),
    );
    conn
}

fn deposed(h: &H) -> Vec<(Term, Term)> {
    h.out
        .iter()
        .filter_map(|o| match o {
            MillOutput::Observed(Observation::Deposed { ours, seen, .. }) => Some((*ours, *seen)),
            _ => None,
        })
        .collect()
}

#[test]
fn e13_every_message_to_an_executor_carries_the_mills_term() {
    let mut h = at_term(9);
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.events(a, 1, vec![(1, lease, EventKind::Running)]);
    h.cancel_req(job, "stop".into()).unwrap();
    h.msg(a, ToMill::CancelAck { lease });
    h.events(a, 1, vec![(2, lease, terminal(TerminalStatus::Cancelled))]);
    // A second job whose reservation is released (its bid lost to nothing: a cancel).
    let second = h.submit(spec());
    let ask = h.asks(a)[0];
    h.cancel_req(second, "stop".into()).unwrap();
    h.accept(a, ask, charge(&[("jobs", 1)]));
    assert_eq!(h.releases(a), [ask]);
    let mut kinds = BTreeSet::new();
    for o in &h.all {
        if let MillOutput::Send { msg, .. } = o {
            assert_eq!(msg.term(), Some(Term(9)), "{msg:?}");
            kinds.insert(
                format!("{msg:?}")
                    .split([' ', '{'])
                    .next()
                    .map(str::to_string),
            );
        }
    }
    assert_eq!(
        kinds.len(),
        6,
        "welcome, ask, commit, cancel, ack, release all seen"
    );
    let _ = ask;
}

#[test]
fn e13_a_mill_refuses_an_executor_that_has_seen_a_higher_term() {
    let mut h = at_term(4);
    let conn = hello_seen(&mut h, "a", Term(5));
    let why = h.refused(conn).expect("refused");
    assert!(why.contains("term 5") && why.contains("term 4"), "{why}");
    assert_eq!(deposed(&h), [(Term(4), Term(5))]);
    assert!(h.closed(conn).is_some());
    assert!(h.mill.sessions().next().is_none(), "no session opened");
}

#[test]
fn e13_an_executor_that_has_seen_this_term_or_lower_is_welcomed() {
    for seen in [0, 3, 4] {
        let mut h = at_term(4);
        let conn = hello_seen(&mut h, "a", Term(seen));
        assert!(h.refused(conn).is_none(), "seen {seen}");
        assert!(matches!(
            h.sent(conn).as_slice(),
            [ToExecutor::Welcome { term: Term(4), .. }]
        ));
        assert!(deposed(&h).is_empty());
    }
}

#[test]
fn e13_a_wrong_token_with_a_high_term_is_refused_for_the_token_and_deposes_nothing() {
    let mut h = at_term(4);
    let conn = ConnId(77);
    h.input(MillInput::Connected { conn }).unwrap();
    h.msg(
        conn,
        crate::testkit::Hello::new("a", Epoch(1))
            .token("wrong")
            .term(Term(u64::MAX))
            .build(),
    );
    assert!(h.refused(conn).unwrap().contains("token"));
    assert!(
        deposed(&h).is_empty(),
        "a stranger cannot make the mill doubt its term"
    );
}

#[test]
fn e13_stale_closes_the_session_keeps_its_leases_in_grace_and_says_deposed() {
    let mut h = at_term(2);
    let a = h.ready("a", 0.0);
    let (job, lease) = h.run_on(a, spec());
    h.msg(a, ToMill::Stale { term: Term(3) });
    assert_eq!(deposed(&h), [(Term(2), Term(3))]);
    assert!(h.closed(a).unwrap().contains("term 3"));
    assert!(h.ended(job).is_none(), "the lease waits out the grace (M4)");
    assert!(
        h.violations().is_empty(),
        "an honest answer, not a violation"
    );
    assert!(h.mill.lease_node(lease).is_some());
}

#[test]
fn e13_term_zero_is_not_a_term() {
    let c = MillConfig {
        term: Term(0),
        ..config()
    };
    assert_eq!(c.validate().unwrap_err().setting, "term");
}
