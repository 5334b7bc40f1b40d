//! I9, liveness after the heal: exact about progress instead of one guessed wall.
//!
//! Two rules, checked on every sample once the faults have stopped:
//!
//! 1. **No idle seat while a job waits.** A job the mill holds queued (not waiting for quota)
//!    that a free seat of an honest, connected, unquarantined executor could run — its
//!    engine and labels, a free seat of that engine, and room in every resource the engine
//!    declares — must be taken off the queue within [`Allowances::place`]. An idle executor
//!    is the special case "every seat free" (the rule of DESIGN I9, "no job waits while a
//!    compatible executor is idle").
//! 2. **A per-job bound from the work actually ahead of it.** Each open job gets a deadline
//!    computed from the remaining work on the seats that can run it and in its quota scopes,
//!    plus the protocol's allowances (formula at [`Liveness::bounds`]). The deadline is
//!    re-evaluated on every sample and only ever tightened: every evaluation is a valid bound
//!    from the state at that moment, so the smallest is one too, and an engine run that
//!    starts replaces the longest possible duration by its real one.
//!
//! Once every job has ended, the system must go quiet (outboxes drained, misbehaving
//! executors quarantined) within [`Allowances::quiet`]; the driver reports what is left.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use millrace_core::job::{JobSpec, JobState};
use millrace_core::mill::MillConfig;
use millrace_core::quota::Scope;
use millrace_core::{JobId, NodeId};

use crate::scenario::Scenario;
use crate::trace::secs;
use crate::types::{Micros, Violation, SEC};
use crate::workload::{Arrival, LONG_JOBS};
use crate::world::{ExecProc, World};

/// The protocol's allowances, from the configuration (all in microseconds).
#[derive(Debug, Clone, Copy)]
pub struct Allowances {
    /// R: from the heal until every process is back and every fault's aftermath is over —
    /// `reconnect_grace + silence_timeout + 10 s (backoff) + connect timeout +
    /// cancel_ack_timeout + cancel_teardown_timeout + 40 s (a hung engine's late stop)`, plus
    /// the largest driver lag (3 s) when the seed's swarm has `driver-lag`.
    pub recovery: Micros,
    /// P: a free seat takes a waiting job within this long — the seat's release reaches the
    /// mill in the next snapshot (`snapshot_interval`), a bid round whose asks may time out
    /// (`bid_timeout`), the commit and its re-send (`bid_timeout`, M17), one more snapshot
    /// for a refusal that waits for a change, and 5 s of round trips and engine start.
    pub place: Micros,
    /// T: an engine's exit reaches the mill as a terminal: the next event batch
    /// (`snapshot_interval`) and 5 s of round trips and retries.
    pub report: Micros,
    /// D: the longest an engine runs a job not started yet (`LONG_JOBS × job_max`; a started
    /// run counts its real remaining time).
    pub longest: Micros,
    /// Q: from the last job's end until the system is quiet — R + D + 60 s (a misbehaving
    /// executor is quarantined when it next misbehaves; no work to measure here).
    pub quiet: Micros,
}

/// The largest lateness a lagging driver adds to a deadline (the `driver-lag` family, I12).
const LAG: Micros = 3 * SEC;
/// The connect timeout the simulated network gives an executor's dial.
const CONNECT: Micros = 3 * SEC;

fn dur(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Allowances {
    /// The allowances of `cfg` for `scenario`; `lag`: the seed's swarm has driver lag.
    pub fn new(cfg: &MillConfig, scenario: &Scenario, lag: bool) -> Allowances {
        let lag = if lag { LAG } else { 0 };
        let recovery = dur(cfg.reconnect_grace)
            + dur(cfg.silence_timeout)
            + 10 * SEC
            + CONNECT
            + dur(cfg.cancel_ack_timeout)
            + dur(cfg.cancel_teardown_timeout)
            + 40 * SEC
            + lag;
        let place = 2 * dur(cfg.bid_timeout) + 2 * dur(cfg.snapshot_interval) + 5 * SEC + lag;
        let report = dur(cfg.snapshot_interval) + 5 * SEC + lag;
        let longest = LONG_JOBS * scenario.job_max;
        Allowances {
            recovery,
            place,
            report,
            longest,
            quiet: recovery + longest + 60 * SEC,
        }
    }
}

/// Per engine of one executor: free seats, and what is left of each declared resource.
type FreeSeats<'a> = BTreeMap<&'a str, (u64, millrace_core::Resources)>;

/// An open job as the checker knows it.
#[derive(Debug, Clone, Copy)]
pub struct OpenJob {
    /// The job.
    pub job: JobId,
    /// Its arrival index (its spec).
    pub arrival: usize,
    /// An engine run of it has exited and the mill still holds its lease (its terminal is
    /// on its way to the mill).
    pub ran: bool,
    /// A retry of it waits out its fence until then (M32): it is not starving before.
    pub fenced_until: Option<Micros>,
    /// Its attempts that ended in a retry: a new one resets the bound kept for it.
    pub retried: u32,
}

/// Which seats and quota scopes a job competes for: its engine, the executors that could run
/// it, and its quota scopes when quota limits anything.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Class {
    engine: String,
    execs: Vec<usize>,
    scopes: Vec<Scope>,
}

impl Class {
    /// Whether jobs of `self` and `other` can hold up one another: a seat both can use, or a
    /// quota scope both are charged to.
    fn competes(&self, other: &Class) -> bool {
        if self == other {
            return true;
        }
        let seat =
            self.engine == other.engine && self.execs.iter().any(|x| other.execs.contains(x));
        seat || self.scopes.iter().any(|s| other.scopes.contains(s))
    }
}

/// The terms of a job's tightest bound, for the failure message.
#[derive(Debug, Clone, Copy, Default)]
struct Terms {
    /// When the bound was computed.
    at: Micros,
    /// The bound.
    deadline: Micros,
    /// Remaining engine time (plus T each) on its seats and of its quota scopes' runs.
    running: Micros,
    /// Competing jobs not started yet (itself included), each D + P + T.
    waiting: u64,
    /// Competing jobs whose run has ended but whose terminal is on its way, each T.
    reporting: u64,
}

/// I9's memory.
#[derive(Debug, Default)]
pub struct Liveness {
    starving_since: BTreeMap<JobId, Micros>,
    bound: BTreeMap<JobId, (Terms, u32)>,
    classes: Vec<Class>,
    class_ids: BTreeMap<Class, usize>,
    /// Class of each arrival, once computed.
    of_arrival: BTreeMap<usize, usize>,
    /// When the system must be quiet, once every job has ended.
    quiet_by: Option<Micros>,
}

/// `spec` may run on `p` at all: its engine, all its labels, resources within the
/// engine's totals, and the node it is pinned to (M34).
pub fn can_run(p: &ExecProc, spec: &JobSpec) -> bool {
    let Some(e) = p.cfg.engines.get(&spec.engine) else {
        return false;
    };
    spec.node.as_ref().is_none_or(|n| *n == p.cfg.node_id)
        && spec.labels.iter().all(|l| p.cfg.labels.contains(l))
        && e.resources
            .iter()
            .all(|(name, total)| spec.resources.get(name).copied().unwrap_or(0) <= *total)
}

fn spec_of(w: &World, arrival: usize) -> Option<&JobSpec> {
    match w.workload.arrivals.get(arrival).map(|a| &a.1) {
        Some(Arrival::Job { spec, .. }) => Some(spec),
        _ => None,
    }
}

impl Liveness {
    /// The class of arrival `k`.
    fn class(&mut self, w: &World, k: usize) -> Option<usize> {
        if let Some(&c) = self.of_arrival.get(&k) {
            return Some(c);
        }
        let spec = spec_of(w, k)?;
        let q = &w.mill_cfg.quota;
        let quota_on = !(q.owner_defaults.is_empty()
            && q.repo_defaults.is_empty()
            && q.owner_overrides.is_empty()
            && q.repo_overrides.is_empty());
        let class = Class {
            engine: spec.engine.clone(),
            execs: (0..w.execs.len())
                .filter(|&i| can_run(&w.execs[i], spec))
                .collect(),
            scopes: if quota_on {
                Scope::of(&spec.identity).to_vec()
            } else {
                Vec::new()
            },
        };
        let id = match self.class_ids.get(&class) {
            Some(&id) => id,
            None => {
                let id = self.classes.len();
                self.classes.push(class.clone());
                self.class_ids.insert(class, id);
                id
            }
        };
        self.of_arrival.insert(k, id);
        Some(id)
    }

    /// Both rules, on a sample after the heal. `open`: the jobs accepted and not ended;
    /// `accepted`: every accepted job's arrival index; `quarantined`: nodes the mill has
    /// quarantined (durably).
    pub fn check(
        &mut self,
        w: &World,
        a: &Allowances,
        open: &[OpenJob],
        accepted: &BTreeMap<JobId, usize>,
        quarantined: &BTreeSet<NodeId>,
    ) -> Result<(), Violation> {
        self.free_seats(w, a, open, accepted, quarantined)?;
        self.bounds(w, a, open)?;
        let resolved = w.arrivals_done >= w.workload.arrivals.len();
        if open.is_empty() && resolved {
            let by = w.now.max(w.heal_at + a.recovery) + a.quiet;
            self.quiet_by = Some(self.quiet_by.map_or(by, |q| q.min(by)));
        } else {
            self.quiet_by = None;
        }
        Ok(())
    }

    /// Every job ended, but the system is still not quiet past [`Allowances::quiet`].
    pub fn quiet_overdue(&self, now: Micros) -> bool {
        self.quiet_by.is_some_and(|q| now > q)
    }

    /// Rule 1: a queued job that a free seat could run is placed within P.
    fn free_seats(
        &mut self,
        w: &World,
        a: &Allowances,
        open: &[OpenJob],
        accepted: &BTreeMap<JobId, usize>,
        quarantined: &BTreeSet<NodeId>,
    ) -> Result<(), Violation> {
        let Some(mill) = &w.mill else {
            self.starving_since.clear();
            return Ok(());
        };
        // Seats in use per (executor, engine): what the executor reserved or runs, what its
        // engine still runs, and every lease the mill holds on the node (a lease of an older
        // epoch keeps its seat until grace expires, M5).
        let mut held: Vec<BTreeSet<millrace_core::LeaseId>> = vec![BTreeSet::new(); w.execs.len()];
        for (lease, _, node, ..) in mill.leases() {
            if let Some(i) = w.exec_of(node) {
                held[i].insert(lease);
            }
        }
        // Executors with room: (index, engine → (free seats, free resources)).
        let mut room: Vec<(usize, FreeSeats, bool)> = Vec::new();
        for (i, p) in w.execs.iter().enumerate() {
            let Some(x) = &p.exec else { continue };
            if !p.honest()
                || !x.is_ready()
                || quarantined.contains(&p.node)
                || mill.quarantined().contains(&p.node)
            {
                continue;
            }
            let mut leases = std::mem::take(&mut held[i]);
            leases.extend(x.reserved_leases());
            leases.extend(x.running_leases());
            leases.extend(p.engine.keys().copied());
            let mut free: FreeSeats = p
                .cfg
                .engines
                .iter()
                .map(|(name, e)| (name.as_str(), (u64::from(e.capacity), e.resources.clone())))
                .collect();
            for lease in &leases {
                let Some(info) = w.leases.get(lease) else {
                    continue;
                };
                let Some((seats, res)) = free.get_mut(info.engine.as_str()) else {
                    continue;
                };
                *seats = seats.saturating_sub(1);
                let spec = accepted.get(&info.job).and_then(|k| spec_of(w, *k));
                for (name, left) in res.iter_mut() {
                    let used = spec.and_then(|s| s.resources.get(name)).copied();
                    *left = left.saturating_sub(used.unwrap_or(0));
                }
            }
            if free.values().any(|(s, _)| *s > 0) {
                room.push((i, free, leases.is_empty()));
            }
        }
        let mut still = BTreeMap::new();
        if !room.is_empty() {
            for o in open {
                let job = o.job;
                if mill.job_state(job) != Some(JobState::Queued)
                    || mill.quota().is_waiting(job)
                    || o.fenced_until.is_some_and(|until| w.now < until)
                {
                    continue;
                }
                let Some(spec) = spec_of(w, o.arrival) else {
                    continue;
                };
                let seat = room.iter().find(|(i, free, _)| {
                    can_run(&w.execs[*i], spec)
                        && free.get(spec.engine.as_str()).is_some_and(|(s, res)| {
                            *s > 0
                                && res.iter().all(|(name, left)| {
                                    spec.resources.get(name).copied().unwrap_or(0) <= *left
                                })
                        })
                });
                let Some((i, _, idle)) = seat else { continue };
                let since = self.starving_since.get(&job).copied().unwrap_or(w.now);
                if w.now.saturating_sub(since) > a.place {
                    let how = if *idle {
                        "a compatible executor idles".to_string()
                    } else {
                        format!("x{i} has a free {} seat it fits", spec.engine)
                    };
                    return Err(Violation {
                        rule: "I9",
                        message: format!(
                            "{job} ({} {:?}) waits queued since {} while {how} (x{i}, allowance {})",
                            spec.engine,
                            spec.labels,
                            secs(since),
                            secs(a.place)
                        ),
                    });
                }
                still.insert(job, since);
            }
        }
        self.starving_since = still;
        Ok(())
    }

    /// Rule 2: every open job ends by its bound.
    ///
    /// For an open job J of class C (its engine; S(J), the executors that could run it; its
    /// quota scopes when quota is on), evaluated at time t after the heal H:
    ///
    /// ```text
    /// bound(J, t) = max(t, H + R)
    ///             + Σ over live engine runs ρ on a seat of S(J) with J's engine,
    ///                 or of an open job sharing a quota scope with J:  rem(ρ) + T
    ///             + Σ over competing jobs K not started (J itself included,
    ///                 and arrivals not yet submitted):                  D + P + T
    ///             + Σ over competing jobs whose run ended, terminal in flight:   T
    /// deadline(J) = min over every sample t of bound(J, t)
    /// ```
    ///
    /// where rem(ρ) is the run's real remaining time (the simulator scheduled its exit), K
    /// competes with J if some executor could run both with one engine or they share a quota
    /// scope, and R, P, T, D are [`Allowances`]. Every competitor is counted as if they ran
    /// one after another on a single seat: while J waits after the heal, some seat of S(J)
    /// (or some holder of J's quota) runs competing work, or a seat is free for at most P
    /// before the next competitor (or J) takes it (rule 1), so the sum bounds J's wait
    /// whatever the number of seats.
    fn bounds(&mut self, w: &World, a: &Allowances, open: &[OpenJob]) -> Result<(), Violation> {
        let now = w.now;
        // Classes of the open jobs and the arrivals still to come.
        let mut waiting: BTreeMap<usize, u64> = BTreeMap::new();
        let mut reporting: BTreeMap<usize, u64> = BTreeMap::new();
        let mut open_class = Vec::with_capacity(open.len());
        // Jobs whose engine run is the one the mill holds them by: that run is counted with
        // the seats' work. A run the mill no longer holds the job by — a fenced run left
        // behind by a retry (M32), which a slow engine may keep alive until the heal — does
        // not stand for the job's next run, so such a job counts as waiting (found by
        // cancel-while-fencing seed 777000053: its retry ran its whole duration after the
        // fence, past a bound that had counted neither).
        let current = |job: JobId| {
            w.mill.as_ref().map(|m| match m.job_state(job) {
                Some(JobState::Reserved { lease, .. } | JobState::Running { lease, .. }) => {
                    Some(lease)
                }
                _ => None,
            })
        };
        let mut live_jobs: BTreeSet<JobId> = BTreeSet::new();
        for p in &w.execs {
            for (lease, e) in &p.engine {
                match current(e.job) {
                    // The mill is down: nothing to tell the runs apart by.
                    None => {
                        live_jobs.insert(e.job);
                    }
                    Some(held) if held == Some(*lease) => {
                        live_jobs.insert(e.job);
                    }
                    Some(_) => {}
                }
            }
        }
        for o in open {
            let Some(c) = self.class(w, o.arrival) else {
                open_class.push(None);
                continue;
            };
            open_class.push(Some(c));
            if live_jobs.contains(&o.job) {
                continue; // counted with the runs
            }
            if o.ran {
                *reporting.entry(c).or_insert(0) += 1;
            } else {
                *waiting.entry(c).or_insert(0) += 1;
            }
        }
        if w.arrivals_done < w.workload.arrivals.len() {
            // Not submitted yet (or refused; counting those too only loosens the bound).
            for k in 0..w.workload.arrivals.len() {
                if w.job_of_arrival[k].is_none() {
                    if let Some(c) = self.class(w, k) {
                        *waiting.entry(c).or_insert(0) += 1;
                    }
                }
            }
        }
        // Remaining engine time per (executor, engine), and per quota scope (open jobs).
        let job_class: BTreeMap<JobId, usize> = open
            .iter()
            .zip(&open_class)
            .filter_map(|(o, c)| c.map(|c| (o.job, c)))
            .collect();
        let mut seat_work: BTreeMap<(usize, &str), Micros> = BTreeMap::new();
        let mut scope_work: BTreeMap<&Scope, Micros> = BTreeMap::new();
        for (i, p) in w.execs.iter().enumerate() {
            for (lease, e) in &p.engine {
                let rem = e.ends_at.map_or(a.recovery, |end| end.saturating_sub(now)) + a.report;
                if let Some(info) = w.leases.get(lease) {
                    *seat_work.entry((i, info.engine.as_str())).or_insert(0) += rem;
                }
                if let Some(&c) = job_class.get(&e.job) {
                    for s in &self.classes[c].scopes {
                        *scope_work.entry(s).or_insert(0) += rem;
                    }
                }
            }
        }
        // The bound of each class with an open job.
        let per_waiting = a.longest + a.place + a.report;
        let mut class_terms: BTreeMap<usize, Terms> = BTreeMap::new();
        for c in open_class.iter().flatten() {
            if class_terms.contains_key(c) {
                continue;
            }
            let me = &self.classes[*c];
            let mut running: Micros = me
                .execs
                .iter()
                .map(|&i| {
                    seat_work
                        .get(&(i, me.engine.as_str()))
                        .copied()
                        .unwrap_or(0)
                })
                .sum();
            running += me
                .scopes
                .iter()
                .map(|s| scope_work.get(s).copied().unwrap_or(0))
                .sum::<Micros>();
            let mut t = Terms {
                at: now,
                running,
                ..Terms::default()
            };
            for (d, n) in &waiting {
                if me.competes(&self.classes[*d]) {
                    t.waiting += n;
                }
            }
            for (d, n) in &reporting {
                if me.competes(&self.classes[*d]) {
                    t.reporting += n;
                }
            }
            t.deadline = now.max(w.heal_at + a.recovery)
                + t.running
                + t.waiting * per_waiting
                + t.reporting * a.report;
            class_terms.insert(*c, t);
        }
        let mut bound = BTreeMap::new();
        for (o, c) in open.iter().zip(&open_class) {
            let Some(c) = c else { continue };
            let mut fresh = class_terms[c];
            // A retry waiting out its fence (M32) starts its run only after it.
            fresh.deadline += o.fenced_until.map_or(0, |u| u.saturating_sub(now));
            let t = match self.bound.get(&o.job) {
                Some((old, retried)) if old.deadline <= fresh.deadline && *retried == o.retried => {
                    *old
                }
                _ => fresh,
            };
            if now > t.deadline {
                let spec = spec_of(w, o.arrival);
                let state = match w.mill.as_ref().and_then(|m| m.job_state(o.job)) {
                    Some(JobState::Queued) => "queued".to_string(),
                    Some(JobState::Reserved { lease, node }) => format!("reserved {lease}@{node}"),
                    Some(JobState::Running { lease, node }) => format!("running {lease}@{node}"),
                    Some(JobState::Done(_)) => "ended at the mill".to_string(),
                    None => "(mill down or unknown)".to_string(),
                };
                let class = &self.classes[*c];
                return Err(Violation {
                    rule: "I9",
                    message: format!(
                        "{} ({} {:?}, {state}) did not end by its liveness bound {}: computed at {} as max(t, heal {} + R {}) + remaining runs on its seats {:?} and quota scopes {} + {} competing jobs not started × (D {} + P {} + T {}) + {} terminals in flight × T",
                        o.job,
                        spec.map_or("?", |s| s.engine.as_str()),
                        spec.map(|s| &s.labels),
                        secs(t.deadline),
                        secs(t.at),
                        secs(w.heal_at),
                        secs(a.recovery),
                        class.execs.iter().map(|i| format!("x{i}")).collect::<Vec<_>>(),
                        secs(t.running),
                        t.waiting,
                        secs(a.longest),
                        secs(a.place),
                        secs(a.report),
                        t.reporting,
                    ),
                });
            }
            bound.insert(o.job, (t, o.retried));
        }
        self.bound = bound;
        Ok(())
    }
}
