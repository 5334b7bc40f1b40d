//! Fixtures shared by millrace's benchmarks.
#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use millrace_core::mill::{RankIndex, RankKey};
use millrace_core::NodeId;

/// A rank index of `n` executors offering `shell`, with spread-out loads; every tenth node
/// holds the label `gpu`.
pub fn fleet_index(n: usize) -> RankIndex {
    let mut idx = RankIndex::default();
    let plain = BTreeSet::new();
    let gpu: BTreeSet<String> = ["gpu".to_string()].into_iter().collect();
    for i in 0..n {
        let node = match NodeId::new(format!("exec-{i:05}")) {
            Ok(n) => n,
            Err(e) => panic!("fixture node id: {e}"),
        };
        // A deterministic spread of loads in 0..1.
        let a = ((i * 7919) % 1000) as f64 / 1000.0;
        let b = ((i * 104_729) % 1000) as f64 / 1000.0;
        let key = RankKey::new(node.clone(), [a, b].iter());
        let labels = if i % 10 == 0 { &gpu } else { &plain };
        idx.upsert(&node, labels, vec![("shell".to_string(), key)]);
    }
    idx
}

use std::collections::BTreeMap;
use std::time::Duration;

use millrace_core::job::JobSpec;
use millrace_core::mill::{Mill, MillConfig, MillInput, MillOutput};
use millrace_core::testkit;
use millrace_core::types::{ConnId, Epoch, JobId, LeaseId, Seqno, Time};
use millrace_core::wire::{ToExecutor, ToMill};

/// A mill with `n` connected, reconciled executors, each offering `shell` with many seats,
/// driven in-process through the public API only. Executors answer at once.
pub struct Fleet {
    /// The mill.
    pub mill: Mill,
    /// Simulated time.
    pub now: Time,
    seqnos: BTreeMap<ConnId, u64>,
    out: Vec<MillOutput>,
}

/// The job every fleet benchmark places.
pub fn job_spec() -> JobSpec {
    testkit::shell_job("acme", "true")
}

fn must<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: {e:?}"),
    }
}

impl Fleet {
    /// Builds the fleet: `n` executors with spread-out loads and `seats` seats each, placing
    /// by bid (M12), as the saved baselines of these benches did.
    pub fn new(n: usize, seats: u32) -> Self {
        Self::build(n, seats, false)
    }

    /// [`Fleet::new`] with direct placement (M35): a submit publishes its lease at once and
    /// sends `ReserveSeat{direct}` and `CommitLease` together.
    pub fn direct(n: usize, seats: u32) -> Self {
        Self::build(n, seats, true)
    }

    fn build(n: usize, seats: u32, direct: bool) -> Self {
        let now = Time::from_micros(1_000_000);
        let config = MillConfig {
            max_pending: 1_000_000,
            direct_placement: direct,
            ..MillConfig::default()
        };
        let mill = must(Mill::new(config, None, now), "mill");
        let mut f = Fleet {
            mill,
            now,
            seqnos: BTreeMap::new(),
            out: Vec::new(),
        };
        for i in 0..n {
            let conn = ConnId(i as u64 + 1);
            f.input(MillInput::Connected { conn });
            f.msg(
                conn,
                millrace_core::testkit::Hello::new(format!("exec-{i:05}"), Epoch(1)).build(),
            );
            let load = ((i * 7919) % 1000) as f64 / 1000.0;
            let engines = testkit::engine("shell", true, seats, "cpu", load);
            f.msg(conn, testkit::snapshot(1, engines, Vec::new(), Seqno(0)));
        }
        f
    }

    fn input(&mut self, input: MillInput) {
        self.mill.handle(self.now, input);
        self.collect();
    }

    /// Submits the benches' job spec; panics if the mill refuses it.
    pub fn submit(&mut self) -> JobId {
        let job = must(self.mill.submit(self.now, job_spec(), 0), "submit");
        self.collect();
        job
    }

    /// Submits the benches' job spec as `owner` (M33's fairness ranks owners).
    pub fn submit_as(&mut self, owner: &str) -> JobId {
        let mut spec = job_spec();
        spec.identity.owner = owner.to_string();
        spec.identity.repo = format!("{owner}/app");
        let job = must(self.mill.submit(self.now, spec, 0), "submit");
        self.collect();
        job
    }

    /// The asks (`ReserveSeat`) of the last step, with their connections.
    pub fn asks(&self) -> Vec<(ConnId, LeaseId)> {
        self.sends()
            .into_iter()
            .filter_map(|(c, m)| match m {
                ToExecutor::ReserveSeat { lease, .. } => Some((c, lease)),
                _ => None,
            })
            .collect()
    }

    /// Accepts `lease` on `conn` and answers its commit: the job runs.
    pub fn run_ask(&mut self, conn: ConnId, lease: LeaseId) {
        self.msg(conn, testkit::accept(lease, testkit::one_seat()));
        self.msg(conn, testkit::commit_result(lease, true));
    }

    /// Drops the last step's outputs and collects this step's.
    fn collect(&mut self) {
        self.consume();
        while let Some(o) = self.mill.poll_output() {
            self.out.push(o);
        }
    }

    /// Consumes the last step's outputs as a driver would: every write of a `Persist` is
    /// read (a store would write it), then everything is dropped. Benches that measure a step
    /// call this inside the measured region, so freeing the outputs is part of the cost.
    pub fn consume(&mut self) {
        for o in self.out.drain(..) {
            if let MillOutput::Persist(batch) = &o {
                for w in &batch.writes {
                    std::hint::black_box(w);
                }
            }
            std::hint::black_box(&o);
        }
    }

    fn msg(&mut self, conn: ConnId, msg: ToMill) {
        self.input(MillInput::Message { conn, msg });
    }

    fn sends(&self) -> Vec<(ConnId, ToExecutor)> {
        self.out
            .iter()
            .filter_map(|o| match o {
                MillOutput::Send { conn, msg } => Some((*conn, msg.clone())),
                _ => None,
            })
            .collect()
    }

    /// One full placement cycle: submit → reserve K → every ask accepted → losers released
    /// → commit → committed (running). Returns the running lease and its node's connection.
    /// With direct placement (M35) the submit's step holds the ask and its commit.
    pub fn place_one(&mut self) -> (ConnId, LeaseId) {
        self.submit();
        let asks: Vec<(ConnId, LeaseId)> = self
            .sends()
            .into_iter()
            .filter_map(|(c, m)| match m {
                ToExecutor::ReserveSeat { lease, .. } => Some((c, lease)),
                _ => None,
            })
            .collect();
        let mut commit = self.out.iter().find_map(|o| match o {
            MillOutput::Send {
                conn,
                msg: ToExecutor::CommitLease { lease, .. },
            } => Some((*conn, *lease)),
            _ => None,
        });
        for (conn, lease) in asks {
            self.msg(conn, testkit::accept(lease, testkit::one_seat()));
            for (c, m) in self.sends() {
                if let ToExecutor::CommitLease { lease, .. } = m {
                    commit = Some((c, lease));
                }
            }
        }
        let Some((conn, lease)) = commit else {
            panic!("no commit after every ask accepted");
        };
        self.msg(conn, testkit::commit_result(lease, true));
        (conn, lease)
    }

    /// A fleet of one executor with 2,000 seats running `jobs` placed jobs, the setup's
    /// outputs consumed: what the event-application benches feed one batch of terminals.
    /// Returns the executor's connection (`None` when `jobs` is 0) and the leases.
    pub fn running(jobs: usize) -> (Fleet, Option<ConnId>, Vec<LeaseId>) {
        let mut fleet = Fleet::new(1, 2_000);
        let mut leases = Vec::with_capacity(jobs);
        let mut conn = None;
        for _ in 0..jobs {
            let (c, l) = fleet.place_one();
            conn = Some(c);
            leases.push(l);
        }
        fleet.consume();
        (fleet, conn, leases)
    }

    /// Applies one batch of terminal events from `conn` for `leases` and consumes the
    /// outputs (one `Persist` with every write of the batch, the job updates, the ack).
    pub fn finish(&mut self, conn: ConnId, leases: &[LeaseId]) {
        self.finish_keeping(conn, leases);
        self.consume();
    }

    /// [`Fleet::finish`], keeping the step's outputs for [`Fleet::asks`].
    pub fn finish_keeping(&mut self, conn: ConnId, leases: &[LeaseId]) {
        let next = self.seqnos.entry(conn).or_insert(0);
        let events = leases
            .iter()
            .map(|lease| {
                *next += 1;
                testkit::success(Seqno(*next), *lease)
            })
            .collect();
        self.msg(conn, testkit::batch(Epoch(1), events));
    }

    /// Moves the clock (no deadlines are due in these benches' windows).
    pub fn advance(&mut self, d: Duration) {
        self.now = self.now.plus(d);
    }
}
