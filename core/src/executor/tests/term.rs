//! E13 term fencing and the mill address list (DESIGN §10): what an executor does with the
//! terms mills send, and where it dials next.

use super::*;
use crate::types::Term;

fn term_writes(outs: &[ExecutorOutput]) -> Vec<Term> {
    all_writes(outs)
        .into_iter()
        .filter_map(|w| match w {
            ExecutorWrite::Term(t) => Some(t),
            _ => None,
        })
        .collect()
}

fn dialed(outs: &[ExecutorOutput]) -> Vec<usize> {
    outs.iter()
        .filter_map(|o| match o {
            ExecutorOutput::Connect { mill } => Some(*mill),
            _ => None,
        })
        .collect()
}

fn two_mills() -> ExecutorConfig {
    let mut c = config();
    c.mills = vec!["mill-a:7071".into(), "mill-b:7071".into()];
    c
}

/// Ready on a mill of `term`.
fn ready_at(config: ExecutorConfig, term: Term) -> Harness {
    let (mut h, outs) = Harness::new(config);
    assert_eq!(dialed(&outs), [0]);
    let timers = h.config.session_timers();
    h.connect_as(Seqno(0), timers, term);
    h
}

#[test]
fn e13_a_welcome_of_a_higher_term_is_durable_before_anything_of_it_is_acted_on() {
    let (mut h, _) = Harness::new(config());
    let timers = h.config.session_timers();
    let outs = h.connect_as(Seqno(0), timers, Term(4));
    assert_eq!(term_writes(&outs), [Term(4)]);
    let persist = names(&outs).iter().position(|n| n == "persist");
    let snapshot = names(&outs).iter().position(|n| n == "send:Snapshot");
    assert!(
        persist.is_some() && persist < snapshot,
        "the term is persisted before the first snapshot: {:?}",
        names(&outs)
    );
    assert_eq!(h.store.term, Term(4));
    // A restart says it in its Hello.
    h.restart(secs(1));
    h.conns += 1;
    let outs = h.feed(ExecutorInput::Connected {
        conn: ConnId(h.conns),
    });
    match sent(&outs).as_slice() {
        [ToMill::Hello { term, .. }] => assert_eq!(*term, Term(4)),
        other => panic!("expected Hello, got {other:?}"),
    }
}

#[test]
fn e13_the_same_term_again_writes_nothing() {
    let mut h = ready_at(config(), Term(3));
    h.disconnect();
    h.until_deadline();
    let timers = h.config.session_timers();
    let outs = h.connect_as(Seqno(0), timers, Term(3));
    assert!(term_writes(&outs).is_empty());
    assert_eq!(sent(&outs).len(), 1, "a snapshot: {:?}", names(&outs));
}

#[test]
fn e13_a_command_of_a_lower_term_is_refused_before_any_side_effect() {
    let mut h = ready_at(config(), Term(5));
    let before = h.store.clone();
    let stale = [
        ToExecutor::ReserveSeat {
            term: Term(4),
            lease: L1,
            job: JobId(101),
            spec: Box::new(spec("shell")),
            ttl: secs(45),
            direct: false,
        },
        ToExecutor::CommitLease {
            term: Term(4),
            lease: L1,
            secrets: BTreeMap::new(),
        },
        ToExecutor::CancelAttempt {
            term: Term(4),
            lease: L1,
            reason: "stale".into(),
        },
        ToExecutor::ReleaseLease {
            term: Term(4),
            lease: L1,
        },
        ToExecutor::Ack {
            term: Term(4),
            epoch: EPOCH,
            up_to: Seqno(0),
        },
    ];
    for msg in stale {
        let outs = h.mill(msg.clone());
        assert_eq!(
            names(&outs),
            ["send:Stale", "close"],
            "{msg:?} is answered Stale and the connection closed, nothing else"
        );
        assert_eq!(sent(&outs), [ToMill::Stale { term: Term(5) }]);
        assert_eq!(h.store, before, "nothing written");
        assert!(h.exec.ready_conn().is_none(), "the session is gone");
        // Dial again and be welcomed by the term-5 mill.
        h.until_deadline();
        let timers = h.config.session_timers();
        h.connect_as(Seqno(0), timers, Term(5));
    }
    // The reservation was never made: the seat is free.
    let (accepted, ..) = reserve_result(&h.reserve_at(L2, Term(5)));
    assert!(accepted);
}

#[test]
fn e13_a_welcome_of_a_lower_term_is_answered_stale_and_the_next_mill_is_dialed() {
    let mut h = ready_at(two_mills(), Term(7));
    h.disconnect();
    let (_, outs) = h.until_deadline();
    assert_eq!(
        dialed(&outs),
        [0],
        "a session that was up dials its mill first"
    );
    let timers = h.config.session_timers();
    let outs = h.connect_as(Seqno(0), timers, Term(6));
    assert_eq!(names(&outs), ["send:Stale", "close"]);
    assert_eq!(h.store.term, Term(7));
    let (_, outs) = h.until_deadline();
    assert_eq!(
        dialed(&outs),
        [1],
        "the deposed mill's successor is elsewhere"
    );
}

#[test]
fn e13_a_higher_term_inside_a_session_closes_it_without_effect() {
    let mut h = ready_at(config(), Term(2));
    let before = h.store.clone();
    let outs = h.reserve_at(L1, Term(3));
    assert_eq!(names(&outs), ["close"], "only a Welcome raises the term");
    assert_eq!(h.store, before);
}

#[test]
fn e13_a_standby_redirect_to_a_known_mill_is_followed_at_once_once() {
    let (mut h, _) = Harness::new(two_mills());
    h.conns += 1;
    let conn = ConnId(h.conns);
    h.conn = Some(conn);
    h.feed(ExecutorInput::Connected { conn });
    let outs = h.mill(ToExecutor::Refused {
        reason: "standby".into(),
        leader: Some("mill-b:7071".into()),
    });
    assert_eq!(names(&outs), ["close"]);
    let outs = h.feed(ExecutorInput::Tick);
    assert_eq!(dialed(&outs), [1], "dialed the leader at once, no backoff");
    // The leader refuses too, naming the first: that redirect waits out the backoff.
    h.conns += 1;
    let conn = ConnId(h.conns);
    h.conn = Some(conn);
    h.feed(ExecutorInput::Connected { conn });
    h.mill(ToExecutor::Refused {
        reason: "standby".into(),
        leader: Some("mill-a:7071".into()),
    });
    assert!(dialed(&h.feed(ExecutorInput::Tick)).is_empty());
    let (gap, outs) = h.until_deadline();
    assert!(gap > Duration::ZERO);
    assert_eq!(dialed(&outs), [0]);
}

#[test]
fn e13_a_redirect_to_an_unknown_address_is_not_followed() {
    let (mut h, _) = Harness::new(two_mills());
    h.conns += 1;
    let conn = ConnId(h.conns);
    h.conn = Some(conn);
    h.feed(ExecutorInput::Connected { conn });
    h.mill(ToExecutor::Refused {
        reason: "standby".into(),
        leader: Some("evil:7071".into()),
    });
    assert!(dialed(&h.feed(ExecutorInput::Tick)).is_empty());
    let (_, outs) = h.until_deadline();
    assert_eq!(
        dialed(&outs),
        [1],
        "the next configured address, after the backoff"
    );
}

#[test]
fn e13_failed_connects_rotate_through_the_mills() {
    let (mut h, outs) = Harness::new(two_mills());
    assert_eq!(dialed(&outs), [0]);
    let mut order = Vec::new();
    for _ in 0..4 {
        h.feed(ExecutorInput::ConnectFailed);
        let (_, outs) = h.until_deadline();
        order.extend(dialed(&outs));
    }
    assert_eq!(order, [1, 0, 1, 0]);
}

#[test]
fn e13_mills_must_be_given() {
    let mut c = config();
    c.mills.clear();
    let e = c.validate().unwrap_err();
    assert_eq!(e.setting(), "mills");
    c.mills = vec![String::new()];
    assert_eq!(c.validate().unwrap_err().setting(), "mills");
}

impl Harness {
    fn reserve_at(&mut self, lease: LeaseId, term: Term) -> Vec<ExecutorOutput> {
        self.mill(ToExecutor::ReserveSeat {
            term,
            lease,
            job: JobId(lease.get() + 100),
            spec: Box::new(spec("shell")),
            ttl: secs(45),
            direct: false,
        })
    }
}
