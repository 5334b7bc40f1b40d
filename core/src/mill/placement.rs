//! Placement: candidate ranking (M11), bids (M12–M14), quota admission (M15), publish (M16)
//! and commit (M17).
//!
//! Ranking is an index, not a scan: every ready executor with a free seat of an engine sits in
//! that engine's ordered set under its [`RankKey`] (worst load, then load sum, then node id).
//! The top candidates of a placement are the first entries that hold the job's labels, so a
//! placement costs O(k log n) for unconstrained jobs however large the fleet, and allocates
//! only the k-sized candidate list. The index is updated when a node's snapshot, readiness or
//! seat count changes.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound::{Excluded, Unbounded};

use super::{
    reason, Lease, LeaseState, Mill, MillOutput, MillWrite, Observation, Phase, RarePath, Timer,
    ViolationKind,
};
use crate::job::{JobState, Terminal, TerminalCause, TerminalStatus};
use crate::quota::Acquire;
use crate::types::{validate_resources, JobId, LeaseId, NodeId, Resources};
use crate::wire::{RejectKind, ToExecutor};

/// Where an executor ranks for one engine: lower is better. Loads are in 0..=1 and finite,
/// so their IEEE bit patterns order like the numbers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RankKey {
    worst: u64,
    sum: u64,
    node: NodeId,
}

impl RankKey {
    /// The key of `node` reporting `load` (resource → 0..=1) for an engine.
    pub fn new<'a>(node: NodeId, load: impl IntoIterator<Item = &'a f64>) -> Self {
        let (mut worst, mut sum) = (0.0f64, 0.0f64);
        for &v in load {
            let v = if v.is_finite() {
                v.clamp(0.0, 1.0)
            } else {
                1.0
            };
            worst = worst.max(v);
            sum += v;
        }
        RankKey {
            worst: worst.to_bits(),
            sum: sum.to_bits(),
            node,
        }
    }

    /// The node this key ranks.
    pub fn node(&self) -> &NodeId {
        &self.node
    }
}

#[derive(Debug, Default, Clone)]
struct Entry {
    labels: BTreeSet<String>,
    keys: Vec<(String, RankKey)>,
}

/// Executors that can take work now, ordered per engine (M11).
///
/// Besides one ordered set per engine, the index keeps one per (engine, label), so a job that
/// requires labels walks only the holders of its rarest label instead of the whole fleet: a
/// label that 10 of 10,000 executors hold costs a walk of 10, wherever they rank. Both sets
/// are in the same key order, so the answer is the same as filtering the engine's set.
#[derive(Debug, Default, Clone)]
pub struct RankIndex {
    by_engine: BTreeMap<String, BTreeSet<RankKey>>,
    by_label: BTreeMap<String, BTreeMap<String, BTreeSet<RankKey>>>,
    nodes: BTreeMap<NodeId, Entry>,
}

/// Removes `key` from `sets[name]`, dropping the set once empty.
fn take_key(sets: &mut BTreeMap<String, BTreeSet<RankKey>>, name: &str, key: &RankKey) {
    if let Some(set) = sets.get_mut(name) {
        set.remove(key);
        if set.is_empty() {
            sets.remove(name);
        }
    }
}

/// Adds `key` to `sets[name]`, copying `name` only when its set is new.
fn put_key(sets: &mut BTreeMap<String, BTreeSet<RankKey>>, name: &str, key: &RankKey) {
    match sets.get_mut(name) {
        Some(set) => {
            set.insert(key.clone());
        }
        None => {
            sets.insert(name.to_owned(), BTreeSet::from([key.clone()]));
        }
    }
}

impl RankIndex {
    /// Puts `node` in the index with `labels`, offering each `(engine, key)`; replaces what
    /// it had.
    pub fn upsert(
        &mut self,
        node: &NodeId,
        labels: &BTreeSet<String>,
        keys: Vec<(String, RankKey)>,
    ) {
        // One search of the node map when the node is indexed already (the common case:
        // a seat count or a load changed).
        let entry = match self.nodes.get_mut(node) {
            Some(entry) => {
                if entry.keys == keys && &entry.labels == labels {
                    return;
                }
                entry
            }
            None if keys.is_empty() => return,
            None => self.nodes.entry(node.clone()).or_default(),
        };
        for (engine, key) in entry.keys.drain(..) {
            take_key(&mut self.by_engine, &engine, &key);
            if let Some(per_label) = self.by_label.get_mut(&engine) {
                for label in &entry.labels {
                    take_key(per_label, label, &key);
                }
                if per_label.is_empty() {
                    self.by_label.remove(&engine);
                }
            }
        }
        if &entry.labels != labels {
            entry.labels = labels.clone();
        }
        for (engine, key) in &keys {
            put_key(&mut self.by_engine, engine, key);
            if !labels.is_empty() {
                let per_label = match self.by_label.get_mut(engine.as_str()) {
                    Some(m) => m,
                    None => self.by_label.entry(engine.clone()).or_default(),
                };
                for label in labels {
                    put_key(per_label, label, key);
                }
            }
        }
        entry.keys = keys;
        if entry.keys.is_empty() {
            self.nodes.remove(node);
        }
    }

    /// Takes `node` out of the index.
    pub fn remove(&mut self, node: &NodeId) {
        self.upsert(node, &BTreeSet::new(), Vec::new());
    }

    /// Appends to `out` up to `limit` best-ranked nodes offering `engine` and holding every
    /// label in `labels`, best first.
    pub fn top(
        &self,
        engine: &str,
        labels: &BTreeSet<String>,
        limit: usize,
        out: &mut Vec<NodeId>,
    ) {
        let set = if labels.is_empty() {
            self.by_engine.get(engine)
        } else {
            // The rarest required label's holders; a label nobody offering `engine` holds
            // means nobody fits.
            let Some(per_label) = self.by_label.get(engine) else {
                return;
            };
            let mut rarest: Option<&BTreeSet<RankKey>> = None;
            for label in labels {
                let Some(set) = per_label.get(label) else {
                    return;
                };
                if rarest.is_none_or(|r| set.len() < r.len()) {
                    rarest = Some(set);
                }
            }
            rarest
        };
        let Some(set) = set else {
            return;
        };
        let start = out.len();
        for key in set {
            if out.len() - start >= limit {
                break;
            }
            let fits = labels.is_empty()
                || self
                    .nodes
                    .get(&key.node)
                    .is_some_and(|e| labels.is_subset(&e.labels));
            if fits {
                out.push(key.node.clone());
            }
        }
    }

    /// Whether `node` can take work now on `engine` and holds every label in `labels`: the
    /// candidate list of a job pinned to `node` (M34), in O(log n).
    pub fn offers(&self, node: &NodeId, engine: &str, labels: &BTreeSet<String>) -> bool {
        self.nodes.get(node).is_some_and(|e| {
            e.keys.iter().any(|(name, _)| name == engine) && labels.is_subset(&e.labels)
        })
    }

    /// Nodes in the index.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when no node can take work.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// A class of jobs that find the same candidates: engine, labels and pinned node (M34), and
/// — when its candidates were all passed over as full ([`resource_full`]) — the resources
/// asked for; empty otherwise, and then it covers every job of its engine, labels and node.
type Class = (String, BTreeSet<String>, Option<NodeId>, Resources);

/// M34: whether `node`'s latest snapshot shows a resource `asks` names (with a positive
/// amount) fully used on `engine`. Such a node cannot take the job until that changes, so
/// asking it would only earn a Transient refusal; a stale snapshot errs both ways, and the
/// executor's own check (E2) is what enforces.
fn resource_full(
    sessions: &BTreeMap<NodeId, super::session::Session>,
    node: &NodeId,
    engine: &str,
    asks: &Resources,
) -> bool {
    let Some((_, engines)) = sessions.get(node).and_then(|s| s.snapshot.as_ref()) else {
        return false;
    };
    let Some(status) = engines.get(engine) else {
        return false;
    };
    asks.iter()
        .any(|(r, &a)| a > 0 && status.load.get(r).is_some_and(|&l| l >= 1.0))
}

/// One ask of a bid.
#[derive(Debug)]
struct Ask {
    node: NodeId,
    rank: usize,
    deadline: crate::types::Time,
    /// `Some(charge)` once accepted.
    accepted: Option<Resources>,
}

/// A bid in progress for one job (M12).
#[derive(Debug)]
pub(super) struct BidRound {
    /// The job's engine: the seats its asks hold are of it, even after the job is gone.
    engine: String,
    candidates: Vec<NodeId>,
    next: usize,
    asks: BTreeMap<LeaseId, Ask>,
    incompatible: Vec<String>,
    soft_failure: bool,
}

impl BidRound {
    /// The deadline of `lease` if it is an ask of this round still waiting for an answer.
    pub(super) fn open_ask_deadline(&self, lease: LeaseId) -> Option<crate::types::Time> {
        self.asks
            .get(&lease)
            .filter(|a| a.accepted.is_none())
            .map(|a| a.deadline)
    }

    /// Asks of this round still waiting for an answer, with their deadlines.
    pub(super) fn open_asks(&self) -> impl Iterator<Item = (LeaseId, crate::types::Time)> + '_ {
        self.asks
            .iter()
            .filter(|(_, a)| a.accepted.is_none())
            .map(|(l, a)| (*l, a.deadline))
    }
}

impl Mill {
    /// Marks `node`'s place in the rank index as stale; [`Mill::flush_index`] recomputes it
    /// before the index is next read, so a batch of changes to one node costs one update.
    pub(super) fn reindex(&mut self, node: &NodeId) {
        if !self.index_dirty.contains(node) {
            self.index_dirty.insert(node.clone());
        }
    }

    /// Recomputes every stale node's place in the rank index from its session (M11, M27, I8).
    pub(super) fn flush_index(&mut self) {
        while let Some(node) = self.index_dirty.pop_first() {
            self.reindex_now(&node);
        }
    }

    fn reindex_now(&mut self, node: &NodeId) {
        let Some(s) = self.sessions.get(node) else {
            self.rank.remove(node);
            self.stage_slots.remove(node);
            return;
        };
        if !s.ready() || self.quarantined.contains(node) {
            self.rank.remove(node);
            self.stage_slots.remove(node);
            return;
        }
        let mut keys = Vec::new();
        let mut full = false;
        if let Some((_, engines)) = &s.snapshot {
            for (engine, status) in engines {
                let held = s.held.get(engine).copied().unwrap_or(0);
                full |= status.capacity > 0 && held >= status.capacity;
                if status.available && held < status.capacity {
                    // Seats the mill holds there since the snapshot count as load too, so
                    // that a burst of placements spreads instead of piling on one node.
                    let seats = f64::from(held) / f64::from(status.capacity);
                    let load = status.load.values().chain(std::iter::once(&seats));
                    keys.push((engine.clone(), RankKey::new(node.clone(), load)));
                }
            }
        }
        // M36: where a queued job may wait for the next free seat.
        let stageable = full
            && self.config.late_binding
            && self.config.direct_placement
            && s.conn.is_some()
            && !s.refuses_direct
            && s.stage_refused != Some(s.frees)
            && !self.staged.contains_key(node);
        self.rank.upsert(node, &s.labels, keys);
        if stageable {
            if !self.stage_slots.contains(node) {
                self.stage_slots.insert(node.clone());
            }
        } else {
            self.stage_slots.remove(node);
        }
    }

    fn seat_taken(&mut self, node: &NodeId, engine: &str) {
        if let Some(s) = self.sessions.get_mut(node) {
            match s.held.get_mut(engine) {
                Some(n) => *n += 1,
                None => {
                    s.held.insert(engine.to_string(), 1);
                }
            }
        }
        self.reindex(node);
    }

    /// A seat the mill held on `node` is free again.
    pub(super) fn seat_released(&mut self, node: &NodeId, engine: Option<&str>) {
        self.free_seq += 1;
        if let Some(s) = self.sessions.get_mut(node) {
            s.frees = self.free_seq;
            if let Some(engine) = engine {
                free_seat(&mut s.held, engine);
            }
        }
        self.reindex(node);
    }

    /// A seat the mill held on `node` for `job`'s engine is free again (nothing is freed if
    /// the job is gone, as with [`Mill::seat_released`] and no engine). Borrows the engine
    /// name from the job instead of copying it.
    pub(super) fn job_seat_released(&mut self, node: &NodeId, job: JobId) {
        self.free_seq += 1;
        if let Some(s) = self.sessions.get_mut(node) {
            s.frees = self.free_seq;
            if let Some(j) = self.jobs.get(&job) {
                free_seat(&mut s.held, &j.spec.engine);
            }
        }
        self.reindex(node);
    }

    /// Starts a bid for every queued job that has candidates (M11, M12), fairly (M33): owners
    /// are taken in `fair`'s order — fewest jobs bidding, waiting for quota or leased, then
    /// the priority and submit order of its first queued job — and an owner whose job starts
    /// a bid moves back by one. An owner's queue is in priority, then submit order. Within an
    /// owner, a job that cannot be placed now does not hide the owner's later jobs. Classes of
    /// job (engine, labels, pinned node) that found no candidate are not ranked again in the same pass.
    /// Each owner tried costs O(log owners), however long the queue. Jobs left without a
    /// free seat may then be staged on full nodes (M36).
    pub(super) fn place_pending(&mut self) {
        self.place_free();
        if self.config.late_binding && self.config.direct_placement {
            self.flush_index();
            self.stage_pending();
            self.withdraw_staged();
        }
    }

    /// M33's next owner after `cursor` (the first without one).
    fn fair_after(&self, cursor: Option<&super::FairKey>) -> Option<super::FairKey> {
        match cursor {
            None => self.fair.first().cloned(),
            Some(c) => self
                .fair
                .range((Excluded(c.clone()), Unbounded))
                .next()
                .cloned(),
        }
    }

    /// `owner`'s next queued job after `key`, in its order (M33).
    fn queued_after(&self, owner: &str, key: super::QueueKey) -> Option<super::QueueKey> {
        self.owners
            .get(owner)
            .and_then(|o| o.queued.range((Excluded(key), Unbounded)).next().copied())
    }

    /// [`Mill::place_pending`]'s placement on free seats.
    fn place_free(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        self.flush_index();
        if self.rank.is_empty() {
            return;
        }
        let mut exhausted: Vec<Class> = Vec::new();
        let limit = self.config.top_k + self.config.bid_fallbacks;
        let mut candidates = Vec::new();
        let mut cursor: Option<super::FairKey> = None;
        while let Some(key) = self.fair_after(cursor.as_ref()) {
            let (_, first, owner) = key.clone();
            cursor = Some(key);
            let mut at = Some(first);
            while let Some(key) = at {
                if self.try_place(key.job, &mut exhausted, limit, &mut candidates) {
                    break;
                }
                if self.rank.is_empty() {
                    return;
                }
                at = self.queued_after(&owner, key);
            }
            if self.rank.is_empty() {
                break;
            }
        }
    }

    /// [`Mill::place_pending`] for one queued job: starts its bid round if it has
    /// candidates; true when it did.
    fn try_place(
        &mut self,
        job: JobId,
        exhausted: &mut Vec<Class>,
        limit: usize,
        candidates: &mut Vec<NodeId>,
    ) -> bool {
        self.flush_index();
        if self.rank.is_empty() {
            return false;
        }
        let Some(j) = self.jobs.get(&job) else {
            return false;
        };
        if j.waits_for_change == Some(self.change_seq) {
            self.drop_rebid_hold(job);
            return false;
        }
        if exhausted.iter().any(|(e, l, n, r)| {
            e == &j.spec.engine
                && l == &j.spec.labels
                && n.as_ref() == j.spec.node.as_ref()
                && (r.is_empty() || r == &j.spec.resources)
        }) {
            self.drop_rebid_hold(job);
            return false;
        }
        candidates.clear();
        match &j.spec.node {
            None => self
                .rank
                .top(&j.spec.engine, &j.spec.labels, limit, candidates),
            // M34: a pinned job's only candidate is its node.
            Some(node) => {
                if self.rank.offers(node, &j.spec.engine, &j.spec.labels) {
                    candidates.push(node.clone());
                }
            }
        }
        let sessions = &self.sessions;
        let said_never = |n: &NodeId| {
            j.incompatible
                .get(n)
                .is_some_and(|c| sessions.get(n).and_then(|s| s.conn) == Some(*c))
        };
        if candidates.iter().any(|n| !said_never(n)) {
            candidates.retain(|n| !said_never(n));
        }
        // M34: a node that refused this job for a resource and has freed nothing since
        // would refuse again; the job waits for it (or for others) without a class-wide
        // pass-over, since the refusal was this job's.
        if !j.refused.is_empty() {
            candidates.retain(|n| {
                j.refused
                    .get(n)
                    .is_none_or(|&at| sessions.get(n).is_none_or(|s| s.frees != at))
            });
            if candidates.is_empty() {
                self.drop_rebid_hold(job);
                return false;
            }
        }
        // M34: nodes whose snapshot shows an asked-for resource fully used are passed over.
        // They rank last (a full resource is the worst load), so these are the fallbacks.
        let mut full = Resources::new();
        if !candidates.is_empty() && j.spec.resources.values().any(|&a| a > 0) {
            candidates.retain(|n| !resource_full(sessions, n, &j.spec.engine, &j.spec.resources));
            if candidates.is_empty() {
                full = j.spec.resources.clone();
            }
        }
        if candidates.is_empty() {
            exhausted.push((
                j.spec.engine.clone(),
                j.spec.labels.clone(),
                j.spec.node.clone(),
                full,
            ));
            self.drop_rebid_hold(job);
            return false;
        }
        // M35: the best candidate's free seat, which the mill's own accounting vouches for
        // (it is in the rank index), is taken without a bid — once per job.
        let direct = self.config.direct_placement
            && !j.direct_tried
            && j.quota_held
                .as_ref()
                .is_none_or(|held| *held == j.spec.seat_charge());
        if direct && self.place_direct(job, &candidates[0], false) {
            candidates.clear();
            return true;
        }
        let Some(j) = self.jobs.get(&job) else {
            return false;
        };
        let round = BidRound {
            engine: j.spec.engine.clone(),
            candidates: std::mem::take(candidates),
            next: 0,
            asks: BTreeMap::new(),
            incompatible: Vec::new(),
            soft_failure: false,
        };
        self.queue_remove(job);
        self.advance(job, round);
        true
    }

    /// M35: places queued `job` on `node` without a bid: quota for the standard charge
    /// (E2) first, then the lease is published with `ReserveSeat{direct}` and `CommitLease`
    /// behind it. True when the job left the queue (placed, failed for quota, or waiting for
    /// it); false when it should be bid for instead.
    fn place_direct(&mut self, job: JobId, node: &NodeId, staged: bool) -> bool {
        if !self
            .sessions
            .get(node)
            .is_some_and(|s| s.ready() && s.conn.is_some() && !s.refuses_direct)
        {
            return false;
        }
        let Some(j) = self.jobs.get_mut(&job) else {
            return false;
        };
        let charge = j.spec.seat_charge();
        // A grant held from a quota wait is for this charge (checked by the caller).
        if j.quota_held.take().is_none() {
            match self.quota.try_acquire(job, &j.spec.identity, &charge) {
                Ok(Acquire::Allowed) => {}
                Ok(Acquire::Denied { reason: why }) => {
                    self.queue_remove(job);
                    let t = Terminal::by_mill(
                        TerminalStatus::Failed,
                        TerminalCause::QuotaDenied,
                        reason(format!("quota denied: {why}")),
                    );
                    self.finish_job(job, t);
                    return true;
                }
                Ok(Acquire::Temporary) => {
                    // No seat was touched: the job waits for quota alone (M15, Q2).
                    self.queue_remove(job);
                    self.observe(Observation::Rare(RarePath::QuotaWait));
                    self.observe(Observation::QuotaWait { job });
                    if let Some(j) = self.jobs.get_mut(&job) {
                        j.phase = Phase::QuotaWait { charge };
                    }
                    return true;
                }
                Err(_) => return false,
            }
        } else {
            debug_assert!(
                self.quota.is_held(job),
                "M15: {job} re-placed with a grant the ledger does not hold"
            );
        }
        j.direct_tried = true;
        self.queue_remove(job);
        let lease = self.alloc_lease();
        self.publish(job, lease, node.clone(), charge, true, staged);
        true
    }

    /// M15, I9: a job granted quota for a re-bid that cannot start one now waits for the
    /// fleet like any other job, without the grant, which would stall jobs of its scopes
    /// that could run elsewhere. Waiters granted by the release are placed in this step.
    fn drop_rebid_hold(&mut self, job: JobId) {
        if self
            .jobs
            .get_mut(&job)
            .and_then(|j| j.quota_held.take())
            .is_some()
        {
            self.release_quota(job, false);
        }
    }

    /// Takes a job's bid round out of its phase, for `advance`.
    fn take_round(&mut self, job: JobId) -> Option<BidRound> {
        let j = self.jobs.get_mut(&job)?;
        match std::mem::replace(&mut j.phase, Phase::Queued) {
            Phase::Bidding(round) => Some(round),
            other => {
                j.phase = other;
                None
            }
        }
    }

    /// Moves a bid on: decide if the best acceptance can no longer be beaten, else keep
    /// `top_k` asks in flight while candidates remain, else end the round (M12, M13).
    fn advance(&mut self, job: JobId, mut round: BidRound) {
        let best = round
            .asks
            .iter()
            .filter(|(_, a)| a.accepted.is_some())
            .min_by_key(|(_, a)| a.rank)
            .map(|(id, a)| (*id, a.rank));
        if let Some((winner, rank)) = best {
            let better_in_flight = round
                .asks
                .values()
                .any(|a| a.accepted.is_none() && a.rank < rank);
            if !better_in_flight {
                return self.decide(job, round, winner);
            }
            return self.put_round(job, round);
        }
        let mut in_flight = round.asks.len();
        while in_flight < self.config.top_k && round.next < round.candidates.len() {
            let rank = round.next;
            round.next += 1;
            let node = round.candidates[rank].clone();
            if let Some((lease, ask)) = self.ask(job, node, rank) {
                round.asks.insert(lease, ask);
                in_flight += 1;
            }
        }
        if in_flight > 0 {
            return self.put_round(job, round);
        }
        // Nobody can take it now.
        if !round.soft_failure && !round.incompatible.is_empty() {
            let why = format!("no compatible executor: {}", round.incompatible.join("; "));
            let t = Terminal::by_mill(
                TerminalStatus::Failed,
                TerminalCause::NoCompatibleExecutor,
                reason(why),
            );
            return self.finish_job(job, t);
        }
        self.release_quota(job, false);
        if let Some(j) = self.jobs.get_mut(&job) {
            j.quota_held = None;
            j.waits_for_change = Some(self.change_seq);
        }
        self.requeue(job);
    }

    fn put_round(&mut self, job: JobId, round: BidRound) {
        match self.jobs.get_mut(&job) {
            Some(j) => j.phase = Phase::Bidding(round),
            None => self.abandon_round(round),
        }
    }

    /// Sends one ask (M12). Returns `None` if the node cannot be asked after all.
    fn ask(&mut self, job: JobId, node: NodeId, rank: usize) -> Option<(LeaseId, Ask)> {
        let conn = self.sessions.get(&node).filter(|s| s.ready())?.conn?;
        let spec = self.jobs.get(&job)?.spec.clone();
        let lease = self.alloc_lease();
        let deadline = self.now.plus(self.config.bid_timeout);
        self.seat_taken(&node, &spec.engine);
        self.send_ask(
            conn,
            lease,
            ToExecutor::ReserveSeat {
                term: self.config.term,
                lease,
                job,
                spec: Box::new(spec),
                ttl: self.config.reconnect_grace,
                direct: false,
            },
        );
        self.asks.insert(lease, job);
        self.arm(deadline, Timer::Ask(lease));
        Some((
            lease,
            Ask {
                node,
                rank,
                deadline,
                accepted: None,
            },
        ))
    }

    /// The ask of `lease` is over (answered, expired, or its round ended): its deadline goes.
    fn forget_ask(&mut self, lease: LeaseId) {
        self.asks.remove(&lease);
        self.disarm(&Timer::Ask(lease));
    }

    /// Takes a stray ask out, with its deadline.
    fn take_stray(&mut self, lease: LeaseId) -> Option<(NodeId, String)> {
        self.disarm(&Timer::Stray(lease));
        self.strays.remove(&lease)
    }

    /// Tells `node` to drop a reservation, if it is connected.
    fn release_remote(&mut self, node: &NodeId, lease: LeaseId) {
        if let Some(conn) = self.sessions.get(node).and_then(|s| s.conn) {
            self.send_release(conn, lease);
        }
    }

    /// The bid's round is over for this ask: release an acceptance at once, or remember an
    /// ask still in flight so its acceptance is released when it comes (M12).
    fn drop_ask(&mut self, engine: &str, lease: LeaseId, ask: Ask) {
        self.forget_ask(lease);
        match ask.accepted {
            Some(_) => {
                self.release_remote(&ask.node, lease);
                self.seat_released(&ask.node, Some(engine));
            }
            None => {
                self.strays.insert(lease, (ask.node, engine.to_string()));
                self.arm(ask.deadline, Timer::Stray(lease));
            }
        }
    }

    /// The job ended while bidding: let every ask go.
    pub(super) fn abandon_round(&mut self, round: BidRound) {
        for (lease, ask) in round.asks {
            self.drop_ask(&round.engine, lease, ask);
        }
    }

    pub(super) fn on_reserve_result(
        &mut self,
        node: &NodeId,
        lease: LeaseId,
        accepted: bool,
        reject: Option<RejectKind>,
        why: String,
        resources: Resources,
    ) {
        if why.len() > crate::wire::MAX_REASON {
            return self.violation(
                node,
                ViolationKind::Oversize,
                "ReserveResult reason exceeds 4096 bytes",
            );
        }
        if let Some(l) = self.leases.get(&lease).filter(|l| l.direct_answer_due) {
            if &l.node != node {
                let what = format!("ReserveResult for lease {lease} that was not asked of it");
                return self.violation(node, ViolationKind::UnaskedReserveResult, &what);
            }
            let answer = if accepted {
                Ok(resources)
            } else {
                Err((reject, why))
            };
            return self.on_direct_result(node, lease, answer);
        }
        if let Some((stray_node, engine)) = self.strays.get(&lease) {
            if stray_node == node {
                let engine = engine.clone();
                self.take_stray(lease);
                if accepted {
                    self.release_remote(node, lease);
                }
                self.seat_released(node, Some(&engine));
            }
            return;
        }
        let Some(&job) = self.asks.get(&lease) else {
            if accepted {
                // Late or unknown: make sure no seat stays held for it.
                self.release_remote(node, lease);
            }
            return;
        };
        let Some(mut round) = self.take_round(job) else {
            return;
        };
        let asked_here = round.asks.get(&lease).is_some_and(|a| &a.node == node);
        if !asked_here || round.asks.get(&lease).is_some_and(|a| a.accepted.is_some()) {
            self.put_round(job, round);
            let what = format!("ReserveResult for lease {lease} that was not asked of it");
            return self.violation(node, ViolationKind::UnaskedReserveResult, &what);
        }
        if accepted {
            if let Err(e) = validate_resources(&resources) {
                // M14: the bid counts as failed; the session closes, which fails the ask.
                self.put_round(job, round);
                let what = format!("invalid resource claim for lease {lease}: {e}");
                return self.violation(node, ViolationKind::BadResources, &what);
            }
            if let Some(a) = round.asks.get_mut(&lease) {
                a.accepted = Some(resources);
            }
            // Answered: its deadline no longer applies (M12).
            self.disarm(&Timer::Ask(lease));
        } else {
            round.asks.remove(&lease);
            self.forget_ask(lease);
            self.job_seat_released(node, job);
            match reject {
                Some(RejectKind::Incompatible) => {
                    round.incompatible.push(reason(format!("{node}: {why}")));
                }
                Some(RejectKind::Transient) | None => round.soft_failure = true,
            }
            self.remember_refusal(node, job, reject, &why);
        }
        self.advance(job, round);
    }

    /// What a refusal of `job` by `node` teaches, whether a bid's ask or a direct one (M35):
    /// an Incompatible node is not asked again while this session lasts and another can be
    /// (M13); a node lacking a resource is not asked again until it frees something (M34).
    fn remember_refusal(
        &mut self,
        node: &NodeId,
        job: JobId,
        reject: Option<RejectKind>,
        why: &str,
    ) {
        let Some(s) = self.sessions.get(node) else {
            return;
        };
        let (conn, frees) = (s.conn, s.frees);
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        match reject {
            Some(RejectKind::Incompatible) => {
                if let Some(conn) = conn {
                    j.incompatible.insert(node.clone(), conn);
                }
            }
            Some(RejectKind::Transient) | None => {
                // M34: a resource it lacks now stays lacking until it frees something.
                if why.starts_with("resource ") {
                    j.refused.insert(node.clone(), frees);
                }
            }
        }
    }

    /// M35: the answer to a direct ask. Its commit went out right behind it, so nothing is
    /// decided here but what a refusal teaches about the node (as for a bid, M13, M34); the
    /// commit's answer ends the lease (not committed → Released, the job is bid for) or runs
    /// it. An acceptance naming any charge but the published one is an M14 violation: the
    /// quota held is that charge (E2).
    fn on_direct_result(
        &mut self,
        node: &NodeId,
        lease: LeaseId,
        answer: Result<Resources, (Option<RejectKind>, String)>,
    ) {
        let Some(l) = self.leases.get_mut(&lease) else {
            return;
        };
        l.direct_answer_due = false;
        let job = l.job;
        let (reject, why) = match answer {
            Ok(resources) => {
                if resources == l.resources {
                    return;
                }
                let what = match validate_resources(&resources) {
                    Err(e) => format!("invalid resource claim for lease {lease}: {e}"),
                    Ok(()) => format!(
                        "direct acceptance of lease {lease} charges {resources:?}, not the standard charge {:?} it was published with (M35, E2)",
                        l.resources
                    ),
                };
                return self.violation(node, ViolationKind::BadResources, &what);
            }
            Err(refusal) => refusal,
        };
        self.observe(Observation::Rare(RarePath::DirectRefused));
        if why.starts_with("charge") {
            // It charges more than the standard charge (E2, M14): every direct ask to it
            // would be refused the same way, so this session is only bid for.
            if let Some(s) = self.sessions.get_mut(node) {
                s.refuses_direct = true;
            }
        }
        self.remember_refusal(node, job, reject, &why);
    }

    /// An ask got no answer within `bid_timeout`: it failed softly (M12).
    pub(super) fn ask_expired(&mut self, lease: LeaseId, fired: crate::types::Time) {
        let Some(&job) = self.asks.get(&lease) else {
            return;
        };
        let Some(mut round) = self.take_round(job) else {
            return;
        };
        let expired = round
            .asks
            .get(&lease)
            .is_some_and(|a| a.accepted.is_none() && a.deadline == fired);
        if expired {
            if let Some(ask) = round.asks.remove(&lease) {
                self.forget_ask(lease);
                self.release_remote(&ask.node, lease);
                self.job_seat_released(&ask.node, job);
                round.soft_failure = true;
            }
        }
        self.advance(job, round);
    }

    pub(super) fn stray_expired(&mut self, lease: LeaseId) {
        if let Some((node, engine)) = self.take_stray(lease) {
            self.release_remote(&node, lease);
            self.seat_released(&node, Some(&engine));
        }
    }

    /// Every ask to `node` fails (its session closed or was forgotten).
    pub(super) fn fail_asks_to(&mut self, node: &NodeId) {
        let strays: Vec<LeaseId> = self
            .strays
            .iter()
            .filter(|(_, (n, _))| n == node)
            .map(|(l, _)| *l)
            .collect();
        for lease in strays {
            if let Some((_, engine)) = self.take_stray(lease) {
                self.seat_released(node, Some(&engine));
            }
        }
        let jobs: BTreeSet<JobId> = self.asks.values().copied().collect();
        for job in jobs {
            let Some(mut round) = self.take_round(job) else {
                continue;
            };
            let lost: Vec<LeaseId> = round
                .asks
                .iter()
                .filter(|(_, a)| &a.node == node)
                .map(|(l, _)| *l)
                .collect();
            if lost.is_empty() {
                self.put_round(job, round);
                continue;
            }
            for lease in lost {
                round.asks.remove(&lease);
                self.forget_ask(lease);
                self.job_seat_released(node, job);
            }
            round.soft_failure = true;
            self.advance(job, round);
        }
    }

    /// The best acceptance won: let the others go and admit the winner (M12, M15).
    fn decide(&mut self, job: JobId, mut round: BidRound, winner: LeaseId) {
        let Some(win) = round.asks.remove(&winner) else {
            return self.put_round(job, round);
        };
        self.forget_ask(winner);
        for (lease, ask) in std::mem::take(&mut round.asks) {
            self.drop_ask(&round.engine, lease, ask);
        }
        let charge = win.accepted.unwrap_or_default();
        self.admit(job, winner, win.node, charge);
    }

    /// M15: quota before publishing.
    fn admit(&mut self, job: JobId, lease: LeaseId, node: NodeId, charge: Resources) {
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        if let Some(held) = j.quota_held.take() {
            if held == charge {
                return self.publish(job, lease, node, charge, false, false);
            }
            // The re-bid charges other resources than the quota holds: release both, retry.
            self.observe(Observation::Rare(RarePath::QuotaRebidChangedResources));
            self.release_remote(&node, lease);
            self.job_seat_released(&node, job);
            self.release_quota(job, false);
            return self.requeue(job);
        }
        match self.quota.try_acquire(job, &j.spec.identity, &charge) {
            Ok(Acquire::Allowed) => self.publish(job, lease, node, charge, false, false),
            Ok(Acquire::Denied { reason: why }) => {
                self.release_remote(&node, lease);
                self.job_seat_released(&node, job);
                let t = Terminal::by_mill(
                    TerminalStatus::Failed,
                    TerminalCause::QuotaDenied,
                    reason(format!("quota denied: {why}")),
                );
                self.finish_job(job, t);
            }
            Ok(Acquire::Temporary) => {
                // Never hold fleet capacity while waiting for quota.
                self.release_remote(&node, lease);
                self.job_seat_released(&node, job);
                self.observe(Observation::Rare(RarePath::QuotaWait));
                self.observe(Observation::QuotaWait { job });
                if let Some(j) = self.jobs.get_mut(&job) {
                    j.phase = Phase::QuotaWait { charge };
                }
            }
            Err(_) => {
                self.release_remote(&node, lease);
                self.job_seat_released(&node, job);
                self.release_quota(job, false);
                self.requeue(job);
            }
        }
    }

    /// Q2 → M15: a waiting job's quota was granted; it bids again holding that charge.
    pub(super) fn quota_granted(&mut self, job: JobId) {
        let Some(j) = self.jobs.get_mut(&job) else {
            // Nobody to use it.
            self.release_quota(job, false);
            return;
        };
        let Phase::QuotaWait { charge } = std::mem::replace(&mut j.phase, Phase::Queued) else {
            // Not waiting (should not happen): give the grant back.
            self.release_quota(job, false);
            return;
        };
        j.quota_held = Some(charge);
        j.waits_for_change = None;
        self.queue_insert(job);
        self.wake_placement();
    }

    /// M16: persist the lease (with its quota hold) before the commit goes out. A `direct`
    /// lease (M35) takes its seat here and its `ReserveSeat{direct}` goes just ahead of the
    /// commit, both behind the step's `Persist`. A `staged` lease (M36) is a direct one on a
    /// node whose seats are all taken: it waits there for the next free seat.
    fn publish(
        &mut self,
        job: JobId,
        lease: LeaseId,
        node: NodeId,
        charge: Resources,
        direct: bool,
        staged: bool,
    ) {
        let Some(epoch) = self.sessions.get(&node).map(|s| s.epoch) else {
            // The winner's session is gone: its seat with it.
            self.release_quota(job, false);
            return self.requeue(job);
        };
        if direct {
            match self.jobs.get(&job) {
                Some(j) => {
                    let engine = j.spec.engine.clone();
                    self.seat_taken(&node, &engine);
                }
                None => return,
            }
        }
        self.placed(job);
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        j.phase = Phase::Leased(lease);
        j.persisted_beyond_queued = true;
        j.attempt = j.attempt.saturating_add(1);
        let attempt = j.attempt;
        if let Some(old) = j.fenced_run.take() {
            self.fenced_runs.remove(&old);
        }
        let latency = self.now.since(j.queued_at);
        let identity = j.spec.identity.clone();
        self.add_lease(
            lease,
            Lease {
                job,
                node: node.clone(),
                epoch,
                resources: charge.clone(),
                state: LeaseState::Reserved,
                commit_sent: None,
                commit_out: false,
                cancel: None,
                attempt,
                direct_answer_due: direct,
                staged,
                withdrawn: false,
            },
        );
        if staged {
            debug_assert!(
                !self.staged.contains_key(&node),
                "M36: {node} holds two staged leases"
            );
            self.staged.insert(node.clone(), lease);
            self.stage_slots.remove(&node);
            self.reindex(&node);
            self.observe(Observation::Rare(RarePath::Staged));
        }
        if let Some(record) = self.lease_record(lease) {
            self.persist(MillWrite::LeaseUpsert(record));
        }
        if self.quota.is_held(job) {
            self.persist(MillWrite::QuotaHold {
                job,
                identity,
                charge,
            });
        }
        let state = JobState::Reserved {
            lease,
            node: node.clone(),
        };
        self.persist(MillWrite::JobState {
            job,
            state: state.clone(),
        });
        self.emit(MillOutput::JobUpdate { job, state });
        if direct {
            self.send_direct_ask(job, lease, &node);
        }
        self.observe(Observation::Placed {
            job,
            lease,
            node,
            latency,
        });
        self.send_commit(lease);
    }

    /// M35: the `ReserveSeat{direct}` of a lease published in this step, behind its
    /// `Persist` (never an early ask: the commit right behind it must wait anyway).
    fn send_direct_ask(&mut self, job: JobId, lease: LeaseId, node: &NodeId) {
        let conn = self
            .sessions
            .get(node)
            .filter(|s| s.ready())
            .and_then(|s| s.conn);
        let (Some(conn), Some(j)) = (conn, self.jobs.get(&job)) else {
            return;
        };
        let spec = Box::new(j.spec.clone());
        self.send(
            conn,
            ToExecutor::ReserveSeat {
                term: self.config.term,
                lease,
                job,
                spec,
                ttl: self.config.reconnect_grace,
                direct: true,
            },
        );
    }

    /// Sends `CommitLease` if the lease's node is ready; otherwise the commit waits (M17).
    pub(super) fn send_commit(&mut self, lease: LeaseId) {
        let Some(l) = self.leases.get_mut(&lease) else {
            return;
        };
        let conn = self
            .sessions
            .get(&l.node)
            .filter(|s| s.ready() && s.epoch == l.epoch)
            .and_then(|s| s.conn);
        let Some(conn) = conn else {
            // Not now: no commit is out, so `maybe_ready` sends it once the node is ready.
            l.commit_sent = None;
            self.disarm(&Timer::Commit(lease));
            return;
        };
        let due = self.now.plus(self.config.bid_timeout);
        let withdrawn = l.withdrawn;
        l.commit_sent = Some((conn, due));
        l.commit_out = true;
        self.arm(due, Timer::Commit(lease));
        if withdrawn {
            // M36: the withdrawal goes out again instead (the commit went out before); the
            // executor answers it not committed, or it won the race and runs.
            return self.send_release(conn, lease);
        }
        self.send(
            conn,
            ToExecutor::CommitLease {
                term: self.config.term,
                lease,
                secrets: BTreeMap::new(),
            },
        );
    }

    /// M17: a commit unanswered within `bid_timeout` on a live session is re-sent.
    pub(super) fn commit_check(&mut self, lease: LeaseId, fired: crate::types::Time) {
        let Some(l) = self.leases.get(&lease) else {
            return;
        };
        let Some((conn, due)) = l.commit_sent else {
            return;
        };
        if l.state != LeaseState::Reserved || due != fired {
            return;
        }
        let live = self.sessions.get(&l.node).and_then(|s| s.conn) == Some(conn);
        if live && l.staged && !l.withdrawn {
            // M36: a staged commit is answered when its seat frees, however long that
            // takes; only its deadline moves on.
            let due = self.now.plus(self.config.bid_timeout);
            if let Some(l) = self.leases.get_mut(&lease) {
                l.commit_sent = Some((conn, due));
            }
            return self.arm(due, Timer::Commit(lease));
        }
        if live {
            self.observe(Observation::Rare(RarePath::CommitResent));
            self.send_commit(lease);
        }
    }

    /// M17: committed → the lease runs; not committed → the executor has no such seat, so
    /// nothing runs and the job is placed again.
    pub(super) fn on_commit_result(&mut self, node: &NodeId, lease: LeaseId, committed: bool) {
        let epoch = self.sessions.get(node).map(|s| s.epoch);
        let Some(l) = self.leases.get(&lease) else {
            return;
        };
        if &l.node != node || Some(l.epoch) != epoch || l.state != LeaseState::Reserved {
            return;
        }
        if committed {
            return self.mark_running(lease);
        }
        let (job, staged, withdrawn) = (l.job, l.staged, l.withdrawn);
        if withdrawn {
            // M36: it never started there; it is placed again, directly if a seat is free.
            self.observe(Observation::Rare(RarePath::StagedWithdrawn));
            if let Some(j) = self.jobs.get_mut(&job) {
                j.direct_tried = false;
            }
        }
        self.end_lease(lease, None);
        if staged && !withdrawn {
            // M36: the node dropped or refused a staged lease (it drains, its outbox or
            // wait list is full, the ask expired): nothing more is staged there until it
            // frees something.
            if let Some(s) = self.sessions.get_mut(node) {
                s.stage_refused = Some(s.frees);
            }
            self.reindex(node);
        }
    }

    /// A reserved lease is now running (commit answered, or its Running event arrived).
    pub(super) fn mark_running(&mut self, lease: LeaseId) {
        let Some(l) = self.leases.get_mut(&lease) else {
            return;
        };
        if l.state == LeaseState::Running {
            return;
        }
        l.state = LeaseState::Running;
        l.commit_sent = None;
        let staged = std::mem::take(&mut l.staged);
        self.timers.stop(&Timer::Commit(lease));
        let (job, node) = (l.job, l.node.clone());
        if staged {
            self.unstage(&node, lease);
        }
        // I1: the mill never holds two committed leases for one job: the lease that runs is
        // the one the job's phase names.
        debug_assert!(
            self.jobs
                .get(&job)
                .is_none_or(|j| matches!(j.phase, Phase::Leased(l) if l == lease)),
            "I1: {job} runs under {lease}, which is not the lease it holds"
        );
        if let Some(record) = self.lease_record(lease) {
            self.persist(MillWrite::LeaseUpsert(record));
        }
        let state = JobState::Running { lease, node };
        self.persist(MillWrite::JobState {
            job,
            state: state.clone(),
        });
        self.emit(MillOutput::JobUpdate { job, state });
    }
}

/// M36: most queued jobs one staging pass looks at.
const STAGE_SCAN: usize = 256;
/// M36: most stage slots, or staged leases, looked at for one job.
const STAGE_WALK: usize = 64;
/// M36: most times one job's staged lease is withdrawn for a seat elsewhere; past it the
/// job waits where it is staged, so a seat a placement cannot use after all (a filter the
/// check missed, a quota wait) never turns withdrawals into a loop.
const MAX_WITHDRAWALS: u32 = 4;

impl Mill {
    /// M36: `node` no longer holds staged `lease` (it runs, or ended).
    pub(super) fn unstage(&mut self, node: &NodeId, lease: LeaseId) {
        if self.staged.get(node) == Some(&lease) {
            self.staged.remove(node);
            self.reindex(node);
            // Its place in line is open: a queued job may take it.
            self.placement_dirty = true;
        }
    }

    /// M36: stages queued jobs that found no free seat on full nodes, in M33's order: each
    /// goes to a stage slot it fits, or — when a node it fits is staged for a job that goes
    /// after it (M33) — that lease is withdrawn to make room for it. Looks at no more than
    /// `STAGE_SCAN` jobs, each at no more than `STAGE_WALK` nodes.
    fn stage_pending(&mut self) {
        if self.queue.is_empty() || (self.stage_slots.is_empty() && self.staged.is_empty()) {
            return;
        }
        let mut scanned = 0usize;
        let mut cursor: Option<super::FairKey> = None;
        while let Some(key) = self.fair_after(cursor.as_ref()) {
            let (_, first, owner) = key.clone();
            cursor = Some(key);
            debug_assert_eq!(
                self.owners.get(&*owner).and_then(|o| o.queued.first()),
                Some(&first),
                "M33: the fair order names each owner's first queued job"
            );
            // With no slot free, a job can only make a staged job of its owner that goes
            // after it yield: from the first of the owner's jobs that goes after all of
            // them, `try_stage` finds nothing for the rest. They are counted as looked at
            // without looking (the pass decides exactly what it did), which keeps a pass
            // over a long queue from costing its whole budget on every step.
            let last = self
                .stage_slots
                .is_empty()
                .then(|| self.last_staged_of(&owner));
            let mut tried = 0usize;
            let mut at = Some(first);
            while let Some(key) = at {
                if let Some(last) = last {
                    if last.is_none_or(|l| key >= l) {
                        #[cfg(debug_assertions)]
                        self.debug_check_none_yields(&owner, key);
                        let queued = self.owners.get(&*owner).map_or(0, |o| o.queued.len());
                        scanned += queued.saturating_sub(tried);
                        if scanned > STAGE_SCAN {
                            return;
                        }
                        break;
                    }
                }
                scanned += 1;
                tried += 1;
                if scanned > STAGE_SCAN {
                    return;
                }
                if self.try_stage(key.job) {
                    break;
                }
                at = self.queued_after(&owner, key);
            }
        }
    }

    /// Debug builds: the staging pass's shortcut skipped nothing `try_stage` could act on —
    /// no stage slot is free, and none of `owner`'s queued jobs from `from` on (the first 64)
    /// goes before a staged job that could still yield (M36, M33), judged by `goes_before`
    /// itself rather than the owner's latest staged key the shortcut compares with.
    #[cfg(debug_assertions)]
    fn debug_check_none_yields(&self, owner: &str, from: super::QueueKey) {
        debug_assert!(
            self.stage_slots.is_empty(),
            "M36: skipped with a stage slot free"
        );
        let Some(o) = self.owners.get(owner) else {
            return;
        };
        for k in o.queued.range(from..).take(STAGE_WALK) {
            let outranked = self.staged.values().find(|lease| {
                self.leases
                    .get(lease)
                    .is_some_and(|l| !l.withdrawn && self.goes_before(k.job, l.job))
            });
            debug_assert!(
                outranked.is_none(),
                "M36: the staging pass skipped {}, which goes before staged lease {:?}",
                k.job,
                outranked
            );
        }
    }

    /// The latest, in its owner's order (M33), of `owner`'s staged jobs that can still be
    /// made to yield (not withdrawn); `None` when it has none.
    fn last_staged_of(&self, owner: &str) -> Option<super::QueueKey> {
        self.staged
            .values()
            .filter_map(|lease| self.leases.get(lease))
            .filter(|l| !l.withdrawn)
            .filter_map(|l| {
                let j = self.jobs.get(&l.job)?;
                (*j.spec.identity.owner == *owner).then(|| super::QueueKey::of(l.job, &j.spec))
            })
            .max()
    }

    /// [`Mill::stage_pending`] for one queued job: true when it was staged, left the queue
    /// otherwise (quota), or a withdrawal was started for it.
    fn try_stage(&mut self, job: JobId) -> bool {
        let Some(j) = self.jobs.get(&job) else {
            return false;
        };
        // Staging is a direct placement: once per job, with the standard charge (M35).
        if j.direct_tried
            || j.quota_held
                .as_ref()
                .is_some_and(|held| *held != j.spec.seat_charge())
        {
            return false;
        }
        let pinned = j.spec.node.clone();
        let slot = match &pinned {
            Some(node) => self
                .stage_slots
                .contains(node)
                .then(|| node.clone())
                .filter(|n| self.fits_stage(j, n)),
            None => self
                .stage_slots
                .iter()
                .take(STAGE_WALK)
                .find(|n| self.fits_stage(j, n))
                .cloned(),
        };
        if let Some(node) = slot {
            return self.place_direct(job, &node, true);
        }
        // M33: a staged job that goes after this one gives its place up.
        if j.yielded {
            return false;
        }
        let victim = self
            .staged
            .iter()
            .filter(|(n, _)| pinned.as_ref().is_none_or(|p| p == *n))
            .take(STAGE_WALK)
            .find(|(n, lease)| {
                self.leases.get(lease).is_some_and(|l| {
                    !l.withdrawn && self.fits_stage(j, n) && self.goes_before(job, l.job)
                })
            })
            .map(|(_, lease)| *lease);
        match victim {
            Some(lease) => {
                self.withdraw(lease, true);
                true
            }
            None => false,
        }
    }

    /// M36: whether `j` could wait on `node` for its next seat: the node is ready, offers
    /// the job's engine with every seat of it held, holds its labels and is the node it is
    /// pinned to if any, and has not refused it (M13, M34) on this session.
    fn fits_stage(&self, j: &super::Job, node: &NodeId) -> bool {
        let Some(s) = self.sessions.get(node) else {
            return false;
        };
        let Some((_, engines)) = &s.snapshot else {
            return false;
        };
        let full = engines.get(&j.spec.engine).is_some_and(|e| {
            e.capacity > 0 && s.held.get(&j.spec.engine).copied().unwrap_or(0) >= e.capacity
        });
        full && s.ready()
            && s.conn.is_some()
            && j.spec.node.as_ref().is_none_or(|p| p == node)
            && j.spec.labels.is_subset(&s.labels)
            && j.incompatible.get(node).is_none_or(|c| s.conn != Some(*c))
            && j.refused.get(node).is_none_or(|&at| s.frees != at)
    }

    /// M33 between a queued job and a staged one of the same owner: priority, then submit
    /// order. Jobs of different owners never displace each other once staged: their order
    /// (M33's lease counts) moves with every lease that starts or ends, and displacing by it
    /// could chase staged leases round without end; it was judged when the lease was staged.
    fn goes_before(&self, job: JobId, staged: JobId) -> bool {
        let (Some(a), Some(b)) = (self.jobs.get(&job), self.jobs.get(&staged)) else {
            return false;
        };
        a.spec.identity.owner == b.spec.identity.owner
            && super::QueueKey::of(job, &a.spec) < super::QueueKey::of(staged, &b.spec)
    }

    /// M36: asks a staged lease back. The executor answers `CommitResult{false}` if it had
    /// not started it (the lease ends Released and the job is placed again); if it had, the
    /// job runs there and the withdrawal is moot. One withdrawn for a job that goes before
    /// it (`m33`) yields for good: its job never makes another staged job yield, so yields
    /// cannot chase each other round.
    fn withdraw(&mut self, lease: LeaseId, m33: bool) {
        let Some(l) = self.leases.get_mut(&lease) else {
            return;
        };
        debug_assert!(l.staged && !l.withdrawn, "M36: {lease} withdrawn twice");
        l.withdrawn = true;
        if let Some(j) = self.jobs.get_mut(&l.job) {
            j.yielded |= m33;
            j.withdrawn = j.withdrawn.saturating_add(1);
        }
        let node = l.node.clone();
        let epoch = l.epoch;
        let conn = self
            .sessions
            .get(&node)
            .filter(|s| s.ready() && s.epoch == epoch)
            .and_then(|s| s.conn);
        if let Some(conn) = conn {
            self.send_release(conn, lease);
        }
        // Otherwise the node is away: its commit (now the withdrawal, `send_commit`) goes
        // out again when it is back, or reconcile ends the lease.
    }

    /// M36, work conservation: while a node has a seat free that no queued job took, staged
    /// leases whose job could take it are withdrawn, oldest first, at most one per node
    /// with a free seat.
    fn withdraw_staged(&mut self) {
        if self.staged.is_empty() || self.rank.is_empty() {
            return;
        }
        let mut budget = self.rank.len();
        let mut staged: Vec<LeaseId> = self.staged.values().copied().collect();
        staged.sort_unstable();
        let mut top = Vec::new();
        for lease in staged {
            if budget == 0 {
                break;
            }
            let Some(l) = self.leases.get(&lease) else {
                continue;
            };
            if l.withdrawn {
                continue;
            }
            let Some(j) = self.jobs.get(&l.job) else {
                continue;
            };
            // A pinned job has no other node.
            if j.spec.node.is_some() || j.withdrawn >= MAX_WITHDRAWALS {
                continue;
            }
            top.clear();
            let limit = self.config.top_k + self.config.bid_fallbacks;
            self.rank
                .top(&j.spec.engine, &j.spec.labels, limit, &mut top);
            // A seat its placement would take (`try_place`'s filters): not one it was told
            // never (M13) or refused for a resource since (M34), nor a resource-full one.
            let sessions = &self.sessions;
            let free_elsewhere = top.iter().any(|n| {
                n != &l.node
                    && j.incompatible
                        .get(n)
                        .is_none_or(|c| sessions.get(n).and_then(|s| s.conn) != Some(*c))
                    && j.refused
                        .get(n)
                        .is_none_or(|&at| sessions.get(n).is_none_or(|s| s.frees != at))
                    && !resource_full(sessions, n, &j.spec.engine, &j.spec.resources)
            });
            if free_elsewhere {
                budget -= 1;
                self.withdraw(lease, false);
            }
        }
    }
}

/// One seat of `engine` fewer held on a node; engines with none held leave the map.
fn free_seat(held: &mut BTreeMap<String, u32>, engine: &str) {
    if let Some(n) = held.get_mut(engine) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            held.remove(engine);
        }
    }
}
