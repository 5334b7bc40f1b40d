//! The quota ledger (DESIGN §6, Q1–Q3).
//!
//! Scopes are owners and repos; every resource is a named counter with a per-scope limit
//! (a default for each scope kind, plus per-scope overrides). A resource with no limit is
//! unlimited. Usage is charged to both of a job's scopes at once.
//!
//! The ledger is usable on its own: the mill calls it for M15, and its holds are part of what
//! the mill persists.
//!
//! Invariant kept after every call: no waiter could be granted. A waiter is grantable when its
//! charge fits on top of the usage of both its scopes and no earlier waiter shares a scope with
//! it. `try_acquire` never breaks this (it only adds usage or waiters), and `release` restores
//! it with one pass over the waiters in arrival order, so a request is Temporary exactly when
//! it has to wait.
//!
//! The number of waiters is not bounded here: every waiter is a pending job of the mill, and
//! the mill already bounds those (`max_pending`, M10). A second bound in the ledger could only
//! disagree with that one.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::job::Identity;
use crate::types::{bounded_reason, JobId, Resources};

/// Longest `Denied` reason. Scope names (≤ 256) and resource names (≤ 64) are bounded by the
/// callers, so this only cuts a reason if a caller forgot to validate.
const MAX_DENIED_REASON: usize = 512;

/// Idle interned charges the ledger may keep however few charges are in use.
const IDLE_CHARGES: usize = 256;

/// A quota scope.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Scope {
    /// An owner, e.g. an organisation.
    Owner(String),
    /// A repository.
    Repo(String),
}

impl Scope {
    /// The two scopes a job of `identity` is charged to: its owner, then its repo.
    pub fn of(identity: &Identity) -> [Scope; 2] {
        [
            Scope::Owner(identity.owner.clone()),
            Scope::Repo(identity.repo.clone()),
        ]
    }

    /// The scope's kind and name, as the ledger's per-kind maps key it.
    fn parts(&self) -> (Kind, &str) {
        match self {
            Scope::Owner(name) => (Kind::Owner, name),
            Scope::Repo(name) => (Kind::Repo, name),
        }
    }
}

/// The kind of a scope: the index of the ledger's per-kind maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Owner = 0,
    Repo = 1,
}

/// The two scopes of `identity` by kind and borrowed name, owner first (the order of
/// [`Scope::of`]), so the ledger's hot paths look scopes up without building `Scope`s.
fn scopes_of(identity: &Identity) -> [(Kind, &str); 2] {
    [
        (Kind::Owner, identity.owner.as_str()),
        (Kind::Repo, identity.repo.as_str()),
    ]
}

/// The scope of `kind` named `name`.
fn scope_named(kind: Kind, name: &str) -> Scope {
    match kind {
        Kind::Owner => Scope::Owner(name.to_string()),
        Kind::Repo => Scope::Repo(name.to_string()),
    }
}

/// The union of two ascending key sequences, ascending, each key once.
fn merged_keys<'a>(
    a: impl Iterator<Item = &'a String>,
    b: impl Iterator<Item = &'a String>,
) -> impl Iterator<Item = &'a str> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x < y => a.next(),
            (Some(x), Some(y)) if y < x => b.next(),
            (Some(_), Some(_)) => {
                b.next();
                a.next()
            }
            (Some(_), None) => a.next(),
            (None, Some(_)) => b.next(),
            (None, None) => None,
        };
        next.map(String::as_str)
    })
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Owner(name) => write!(f, "owner {name:?}"),
            Scope::Repo(name) => write!(f, "repo {name:?}"),
        }
    }
}

/// Limits per scope: defaults for each kind of scope, plus overrides for named scopes.
///
/// An override replaces the default for the resources it names; other resources keep the
/// default. A resource limited nowhere is unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaConfig {
    /// Limits for every owner.
    pub owner_defaults: Resources,
    /// Limits for every repo.
    pub repo_defaults: Resources,
    /// Limits for named owners.
    pub owner_overrides: BTreeMap<String, Resources>,
    /// Limits for named repos.
    pub repo_overrides: BTreeMap<String, Resources>,
}

impl QuotaConfig {
    /// The limit of `resource` in `scope`: the scope's override if it names the resource,
    /// else the default for the scope's kind, else `None` (unlimited).
    pub fn limit(&self, scope: &Scope, resource: &str) -> Option<u64> {
        let (kind, name) = scope.parts();
        self.limit_of(kind, name, resource)
    }

    /// Every limit in force in `scope`: the defaults of its kind, with the resources its
    /// override names replaced. Resources absent are unlimited.
    pub fn limits(&self, scope: &Scope) -> Resources {
        let (kind, name) = scope.parts();
        let (defaults, overrides) = match kind {
            Kind::Owner => (&self.owner_defaults, &self.owner_overrides),
            Kind::Repo => (&self.repo_defaults, &self.repo_overrides),
        };
        let mut limits = defaults.clone();
        if let Some(o) = overrides.get(name) {
            limits.extend(o.iter().map(|(r, &l)| (r.clone(), l)));
        }
        limits
    }

    fn limit_of(&self, kind: Kind, name: &str, resource: &str) -> Option<u64> {
        let (defaults, overrides) = match kind {
            Kind::Owner => (&self.owner_defaults, &self.owner_overrides),
            Kind::Repo => (&self.repo_defaults, &self.repo_overrides),
        };
        overrides
            .get(name)
            .and_then(|o| o.get(resource))
            .or_else(|| defaults.get(resource))
            .copied()
    }
}

/// The answer to [`QuotaLedger::try_acquire`] (Q1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// Reserved now.
    Allowed,
    /// Does not fit now but would once holders release; the request waits (Q2) and is
    /// returned by a later [`QuotaLedger::release`] when granted.
    Temporary,
    /// Exceeds a limit on its own; it can never fit.
    Denied {
        /// Which scope and resource, with the numbers.
        reason: String,
    },
}

/// Misuse of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// The id is already held or waiting with a different charge (Q3).
    #[error("quota reservation {id} is already held with a different charge")]
    ConflictingCharge {
        /// The reservation.
        id: JobId,
    },
}

/// Why a waiter waits (Q2), for operators: the first thing that keeps it from being granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blocked {
    /// Its charge does not fit on top of what the scope's holders use now.
    Limit {
        /// The full scope: the owner before the repo, when both are full.
        scope: Scope,
        /// The resource that is full: the first in name order.
        resource: String,
        /// What the scope's holders use of it now (saturated to `u64`).
        used: u64,
        /// What the waiter asks of it.
        asks: u64,
        /// The scope's limit of it.
        limit: u64,
    },
    /// It would fit, but an earlier waiter shares a scope with it and goes first (Q2: FIFO
    /// per scope).
    Behind {
        /// The shared scope: the owner before the repo, when both are shared.
        scope: Scope,
        /// The earliest waiter of that scope.
        first: JobId,
    },
}

impl fmt::Display for Blocked {
    /// `owner "alice" jobs 10/10 in use (asks 1)`, or `behind j5 in owner "alice" (first come,
    /// first served)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Blocked::Limit {
                scope,
                resource,
                used,
                asks,
                limit,
            } => write!(f, "{scope} {resource} {used}/{limit} in use (asks {asks})"),
            Blocked::Behind { scope, first } => {
                write!(f, "behind {first} in {scope} (first come, first served)")
            }
        }
    }
}

/// One scope that holds or waits, as [`QuotaLedger::scopes`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeUse {
    /// The scope.
    pub scope: Scope,
    /// What its holders use (absent resources are zero; saturated to `u64`).
    pub used: Resources,
    /// How many waiters it has (Q2).
    pub waiting: usize,
}

/// What one reservation charges, held or waiting.
#[derive(Debug, PartialEq, Eq)]
struct Charge {
    identity: Identity,
    charge: Resources,
}

/// A reservation's charge, interned in `QuotaLedger::interned`: most jobs share an identity
/// and a charge with other jobs, so an entry takes a reference instead of copying both names
/// and the charge's map (allocated on acquire and freed on release, once per job).
type Entry = Arc<Charge>;

/// A request that waits (Q2).
#[derive(Debug, Clone)]
struct Waiter {
    /// Arrival number: the key of this waiter in `QuotaLedger::queue`.
    arrival: u64,
    entry: Entry,
}

/// The ledger: holds, usage per scope, and FIFO waiters per scope.
#[derive(Debug, Clone, Default)]
pub struct QuotaLedger {
    config: QuotaConfig,
    holds: BTreeMap<JobId, Entry>,
    /// Sum of the holds' charges per scope, by kind (`Kind` indexes it) then scope name, so
    /// that a hold's scopes are found by borrowed name without cloning them. Kept in `u128`
    /// so that the sum is exact whatever the number of holds (reported saturated to `u64`);
    /// zero entries and empty scopes are removed.
    usage: [BTreeMap<String, BTreeMap<String, u128>>; 2],
    /// Waiters by id.
    waiting: BTreeMap<JobId, Waiter>,
    /// Waiters in arrival order.
    queue: BTreeMap<u64, JobId>,
    /// How many waiters each scope has, by kind then name; scopes with none are absent.
    waiters_per_scope: [BTreeMap<String, usize>; 2],
    /// The arrival number of the next waiter.
    next_arrival: u64,
    /// The charges of holds and waiters by identity, then charge, each shared by its
    /// entries (the `Arc`'s count is the number of entries plus one, so releasing an entry
    /// only drops its reference). A charge whose last entry left stays (idle) for the next
    /// job of that identity and charge, so that a steady stream of one-at-a-time jobs does
    /// not build and free it every time. Idle charges are swept when a new charge would make
    /// `charges` exceed `sweep_at`, which is then set to twice what remains (at least
    /// `IDLE_CHARGES`): memory stays within twice the peak of charges in use, and each sweep
    /// is paid for by the new charges since the last one.
    interned: BTreeMap<Identity, BTreeMap<Resources, Entry>>,
    /// How many charges `interned` holds.
    charges: usize,
    /// When the next new charge sweeps idle ones (0 until the first: read as `IDLE_CHARGES`).
    sweep_at: usize,
}

impl QuotaLedger {
    /// An empty ledger.
    pub fn new(config: QuotaConfig) -> Self {
        QuotaLedger {
            config,
            ..QuotaLedger::default()
        }
    }

    /// A ledger holding `holds` (restored at restart; waiters are not durable).
    ///
    /// Holds are kept even where they exceed a limit that was lowered since they were granted;
    /// new requests in those scopes wait until enough of them are released. If an id appears
    /// twice, the last one is kept.
    pub fn restore(
        config: QuotaConfig,
        holds: impl IntoIterator<Item = (JobId, Identity, Resources)>,
    ) -> Self {
        let mut ledger = Self::new(config);
        for (id, identity, charge) in holds {
            ledger.remove_hold(id);
            let entry = ledger.intern(&identity, &charge);
            ledger.add_hold(id, entry);
        }
        ledger
    }

    /// Q1: reserve `charge` for `id` against both scopes of `identity`.
    ///
    /// Allowed when the charge fits on top of both scopes' usage and no earlier request waits
    /// in either scope; Denied (nothing stored) when the charge alone exceeds a limit;
    /// Temporary otherwise, and the request waits. Asking again for an id that is held or
    /// waiting with the same identity and charge repeats the answer without charging twice
    /// (Q3); with a different identity or charge it is an error.
    pub fn try_acquire(
        &mut self,
        id: JobId,
        identity: &Identity,
        charge: &Resources,
    ) -> Result<Acquire, QuotaError> {
        if let Some(held) = self.holds.get(&id) {
            return if held.identity == *identity && held.charge == *charge {
                Ok(Acquire::Allowed)
            } else {
                Err(QuotaError::ConflictingCharge { id })
            };
        }
        if let Some(waiter) = self.waiting.get(&id) {
            return if waiter.entry.identity == *identity && waiter.entry.charge == *charge {
                Ok(Acquire::Temporary)
            } else {
                Err(QuotaError::ConflictingCharge { id })
            };
        }
        if let Some(reason) = self.denial(identity, charge) {
            return Ok(Acquire::Denied { reason });
        }
        let entry = self.intern(identity, charge);
        // An empty charge takes nothing from anyone, so it never waits.
        let behind_waiters = scopes_of(identity)
            .iter()
            .any(|&(kind, name)| self.waiters_per_scope[kind as usize].contains_key(name));
        if charge.is_empty() || (!behind_waiters && self.fits(&entry)) {
            self.add_hold(id, entry);
            Ok(Acquire::Allowed)
        } else {
            self.add_waiter(id, entry);
            Ok(Acquire::Temporary)
        }
    }

    /// Q3: releases a hold or drops a waiter (idempotent), then grants waiters that now fit,
    /// FIFO per scope (Q2). Returns the ids granted, in grant order; they are now held.
    pub fn release(&mut self, id: JobId) -> Vec<JobId> {
        self.release_reporting(id).1
    }

    /// [`release`](Self::release), also telling whether `id` held a reservation (rather than
    /// waited, or neither): the mill persists only released holds, and asking
    /// [`is_held`](Self::is_held) first would search the holds twice.
    pub fn release_reporting(&mut self, id: JobId) -> (bool, Vec<JobId>) {
        let held = self.remove_hold(id);
        if !held && self.take_waiter(id).is_none() {
            // Nothing changed, so (by the ledger's invariant) nothing can be granted.
            return (false, Vec::new());
        }
        (held, self.grant_waiters())
    }

    /// True when `id` holds a reservation.
    pub fn is_held(&self, id: JobId) -> bool {
        self.holds.contains_key(&id)
    }

    /// The charge held for `id`, if held.
    pub fn held(&self, id: JobId) -> Option<(&Identity, &Resources)> {
        self.holds.get(&id).map(|e| (&e.identity, &e.charge))
    }

    /// True when `id` waits (Q2).
    pub fn is_waiting(&self, id: JobId) -> bool {
        self.waiting.contains_key(&id)
    }

    /// Current usage of `scope` (absent resources are zero).
    ///
    /// A sum beyond `u64::MAX` (only possible for an unlimited resource) reads as `u64::MAX`.
    pub fn usage(&self, scope: &Scope) -> Resources {
        let (kind, name) = scope.parts();
        self.usage[kind as usize]
            .get(name)
            .map(|used| {
                used.iter()
                    .map(|(name, &amount)| {
                        (name.clone(), u64::try_from(amount).unwrap_or(u64::MAX))
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The limit of `resource` in `scope`, or `None` if unlimited.
    pub fn limit(&self, scope: &Scope, resource: &str) -> Option<u64> {
        self.config.limit(scope, resource)
    }

    /// Every hold, in id order.
    pub fn holds(&self) -> impl Iterator<Item = (JobId, &Identity, &Resources)> + '_ {
        self.holds
            .iter()
            .map(|(&id, e)| (id, &e.identity, &e.charge))
    }

    /// How many requests wait.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Every waiter, in arrival order (the order in which Q2 considers them).
    pub fn waiters(&self) -> impl Iterator<Item = (JobId, &Identity, &Resources)> + '_ {
        self.queue.values().filter_map(move |id| {
            self.waiting
                .get(id)
                .map(|w| (*id, &w.entry.identity, &w.entry.charge))
        })
    }

    /// The limits in force.
    pub fn config(&self) -> &QuotaConfig {
        &self.config
    }

    /// Why `id` waits (Q2), or `None` if it does not wait. Costs one pass over the waiters
    /// that arrived before it.
    ///
    /// The first reason that holds, checked in this order: a limit of its owner, then of its
    /// repo, that its charge does not fit under now (resources in name order); else the
    /// earliest earlier waiter of its owner, then of its repo.
    pub fn blocked(&self, id: JobId) -> Option<Blocked> {
        let waiter = self.waiting.get(&id)?;
        if let Some(full) = self.overflow(&waiter.entry) {
            return Some(full);
        }
        // The owner's earliest waiter if it has an earlier one, else the repo's: as
        // `waiters_blocked` reports it.
        let mine = &waiter.entry.identity;
        let earlier = || {
            self.queue
                .range(..waiter.arrival)
                .filter_map(|(_, e)| self.waiting.get(e).map(|w| (*e, &w.entry.identity)))
        };
        let behind = earlier()
            .find(|(_, who)| who.owner == mine.owner)
            .map(|(first, _)| Blocked::Behind {
                scope: Scope::Owner(mine.owner.clone()),
                first,
            })
            .or_else(|| {
                earlier()
                    .find(|(_, who)| who.repo == mine.repo)
                    .map(|(first, _)| Blocked::Behind {
                        scope: Scope::Repo(mine.repo.clone()),
                        first,
                    })
            });
        // By the ledger's invariant a waiter that fits has an earlier waiter in a scope
        // (the random model checks it); a read for operators does not assert it, so that a
        // broken ledger shows up as a waiter without a reason rather than as a panic here.
        behind
    }

    /// Every waiter in arrival order, with why it waits ([`blocked`](Self::blocked)); one
    /// pass, so taking the first `n` costs `n` steps (and a map of the scopes seen).
    pub fn waiters_blocked(
        &self,
    ) -> impl Iterator<Item = (JobId, &Identity, &Resources, Option<Blocked>)> + '_ {
        // The earliest waiter of each scope seen so far, by kind then name.
        let mut first: [BTreeMap<&str, JobId>; 2] = [BTreeMap::new(), BTreeMap::new()];
        self.queue.values().filter_map(move |&id| {
            let w = self.waiting.get(&id)?;
            let scopes = scopes_of(&w.entry.identity);
            let blocked = self.overflow(&w.entry).or_else(|| {
                scopes.iter().find_map(|&(kind, name)| {
                    first[kind as usize]
                        .get(name)
                        .map(|&earlier| Blocked::Behind {
                            scope: scope_named(kind, name),
                            first: earlier,
                        })
                })
            });
            for (kind, name) in scopes {
                first[kind as usize].entry(name).or_insert(id);
            }
            Some((id, &w.entry.identity, &w.entry.charge, blocked))
        })
    }

    /// Every scope that holds or waits, owners then repos, each in name order, with its
    /// usage and its number of waiters.
    pub fn scopes(&self) -> impl Iterator<Item = ScopeUse> + '_ {
        [Kind::Owner, Kind::Repo].into_iter().flat_map(move |kind| {
            let used = &self.usage[kind as usize];
            let waiting = &self.waiters_per_scope[kind as usize];
            merged_keys(used.keys(), waiting.keys()).map(move |name| ScopeUse {
                scope: scope_named(kind, name),
                used: used
                    .get(name)
                    .map(|u| {
                        u.iter()
                            .map(|(r, &a)| (r.clone(), u64::try_from(a).unwrap_or(u64::MAX)))
                            .collect()
                    })
                    .unwrap_or_default(),
                waiting: waiting.get(name).copied().unwrap_or(0),
            })
        })
    }

    /// How many scopes [`scopes`](Self::scopes) lists.
    pub fn scope_count(&self) -> usize {
        [Kind::Owner, Kind::Repo]
            .into_iter()
            .map(|kind| {
                merged_keys(
                    self.usage[kind as usize].keys(),
                    self.waiters_per_scope[kind as usize].keys(),
                )
                .count()
            })
            .sum()
    }

    /// The first scope (owner first) and resource (name order) where `entry`'s charge does
    /// not fit on top of the usage now, with the numbers.
    fn overflow(&self, entry: &Entry) -> Option<Blocked> {
        scopes_of(&entry.identity).iter().find_map(|&(kind, name)| {
            let used = self.usage[kind as usize].get(name);
            entry.charge.iter().find_map(|(resource, &asks)| {
                let limit = self.config.limit_of(kind, name, resource)?;
                let current = used.and_then(|u| u.get(resource)).copied().unwrap_or(0);
                (current.saturating_add(u128::from(asks)) > u128::from(limit)).then(|| {
                    Blocked::Limit {
                        scope: scope_named(kind, name),
                        resource: resource.clone(),
                        used: u64::try_from(current).unwrap_or(u64::MAX),
                        asks,
                        limit,
                    }
                })
            })
        })
    }

    /// Why `charge` alone exceeds a limit of one of `identity`'s scopes, if it does. Scopes
    /// are checked owner first, resources in name order, so the reason is deterministic.
    fn denial(&self, identity: &Identity, charge: &Resources) -> Option<String> {
        scopes_of(identity).iter().find_map(|&(kind, name)| {
            charge.iter().find_map(|(resource, &amount)| {
                let limit = self.config.limit_of(kind, name, resource)?;
                (amount > limit).then(|| {
                    let scope = match kind {
                        Kind::Owner => Scope::Owner(name.to_string()),
                        Kind::Repo => Scope::Repo(name.to_string()),
                    };
                    bounded_reason(
                        format!("{scope}: charge {resource:?}={amount} exceeds the limit {limit}"),
                        MAX_DENIED_REASON,
                    )
                })
            })
        })
    }

    /// True when `entry`'s charge fits on top of the current usage of both its scopes.
    fn fits(&self, entry: &Entry) -> bool {
        scopes_of(&entry.identity).iter().all(|&(kind, name)| {
            let used = self.usage[kind as usize].get(name);
            entry.charge.iter().all(|(resource, &amount)| {
                let Some(limit) = self.config.limit_of(kind, name, resource) else {
                    return true;
                };
                let current = used.and_then(|u| u.get(resource)).copied().unwrap_or(0);
                current.saturating_add(u128::from(amount)) <= u128::from(limit)
            })
        })
    }

    /// Records a hold and its usage. The caller has removed any earlier hold of `id`.
    fn add_hold(&mut self, id: JobId, entry: Entry) {
        // Amounts are positive (validated by callers); skipping zeros keeps usage free of
        // zero entries and empty scopes either way.
        if entry.charge.values().any(|&amount| amount > 0) {
            for (kind, name) in scopes_of(&entry.identity) {
                let by_name = &mut self.usage[kind as usize];
                let used = match by_name.get_mut(name) {
                    Some(used) => used,
                    None => by_name.entry(name.to_string()).or_default(),
                };
                for (resource, &amount) in entry.charge.iter().filter(|(_, &a)| a > 0) {
                    match used.get_mut(resource.as_str()) {
                        Some(slot) => *slot = slot.saturating_add(u128::from(amount)),
                        None => {
                            used.insert(resource.clone(), u128::from(amount));
                        }
                    }
                }
            }
        }
        self.holds.insert(id, entry);
    }

    /// Removes the hold of `id`, if any, and its usage. True if there was one.
    fn remove_hold(&mut self, id: JobId) -> bool {
        let Some(entry) = self.holds.remove(&id) else {
            return false;
        };
        for (kind, name) in scopes_of(&entry.identity) {
            let by_name = &mut self.usage[kind as usize];
            let Some(used) = by_name.get_mut(name) else {
                continue;
            };
            for (resource, &amount) in &entry.charge {
                if let Some(slot) = used.get_mut(resource.as_str()) {
                    *slot = slot.saturating_sub(u128::from(amount));
                    if *slot == 0 {
                        used.remove(resource.as_str());
                    }
                }
            }
            if used.is_empty() {
                by_name.remove(name);
            }
        }
        true
    }

    /// The shared copy of `charge` for `identity`, counted once more.
    fn intern(&mut self, identity: &Identity, charge: &Resources) -> Entry {
        let by_charge = match self.interned.get_mut(identity) {
            Some(by_charge) => by_charge,
            None => self.interned.entry(identity.clone()).or_default(),
        };
        if let Some(shared) = by_charge.get(charge) {
            return Arc::clone(shared);
        }
        if self.charges >= self.sweep_at.max(IDLE_CHARGES) {
            self.sweep_idle();
            return self.intern(identity, charge);
        }
        let shared = Arc::new(Charge {
            identity: identity.clone(),
            charge: charge.clone(),
        });
        by_charge.insert(charge.clone(), Arc::clone(&shared));
        self.charges = self.charges.saturating_add(1);
        shared
    }

    /// Forgets the interned charges no entry uses.
    fn sweep_idle(&mut self) {
        self.interned.retain(|_, by_charge| {
            by_charge.retain(|_, shared| Arc::strong_count(shared) > 1);
            !by_charge.is_empty()
        });
        self.charges = self.interned.values().map(BTreeMap::len).sum();
        self.sweep_at = self.charges.saturating_mul(2).max(IDLE_CHARGES);
    }

    fn add_waiter(&mut self, id: JobId, entry: Entry) {
        if self.next_arrival == u64::MAX {
            self.renumber_queue();
        }
        let arrival = self.next_arrival;
        self.next_arrival = self.next_arrival.saturating_add(1);
        for (kind, name) in scopes_of(&entry.identity) {
            let count = self.waiters_per_scope[kind as usize]
                .entry(name.to_string())
                .or_insert(0);
            *count = count.saturating_add(1);
        }
        self.queue.insert(arrival, id);
        self.waiting.insert(id, Waiter { arrival, entry });
    }

    /// Removes the waiter `id`, if any, and returns what it asked for.
    fn take_waiter(&mut self, id: JobId) -> Option<Entry> {
        let waiter = self.waiting.remove(&id)?;
        self.queue.remove(&waiter.arrival);
        for (kind, name) in scopes_of(&waiter.entry.identity) {
            let counts = &mut self.waiters_per_scope[kind as usize];
            if let Some(count) = counts.get_mut(name) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    counts.remove(name);
                }
            }
        }
        if self.queue.is_empty() {
            self.next_arrival = 0;
        }
        Some(waiter.entry)
    }

    /// Gives the waiters arrival numbers 0, 1, … in the same order, so that numbering can go
    /// on without overflowing. Only reachable after 2^64 waiters with the queue never empty.
    fn renumber_queue(&mut self) {
        let ids: Vec<JobId> = self.queue.values().copied().collect();
        self.queue.clear();
        let mut next = 0u64;
        for id in ids {
            if let Some(waiter) = self.waiting.get_mut(&id) {
                waiter.arrival = next;
                self.queue.insert(next, id);
                next = next.saturating_add(1);
            }
        }
        self.next_arrival = next;
    }

    /// Q2: one pass over the waiters in arrival order. A waiter is granted when its charge fits
    /// and no earlier waiter still waits in either of its scopes; a waiter that stays blocks
    /// both its scopes for everyone after it. Granting only adds usage, so a waiter passed over
    /// cannot become grantable later in the same pass, and one pass reaches the fixpoint.
    fn grant_waiters(&mut self) -> Vec<JobId> {
        let mut granted = Vec::new();
        if self.queue.is_empty() {
            return granted;
        }
        let mut blocked: BTreeSet<Scope> = BTreeSet::new();
        let order: Vec<JobId> = self.queue.values().copied().collect();
        for id in order {
            let Some(waiter) = self.waiting.get(&id) else {
                continue;
            };
            let scopes = Scope::of(&waiter.entry.identity);
            let free = !scopes.iter().any(|s| blocked.contains(s));
            if free && self.fits(&waiter.entry) {
                if let Some(entry) = self.take_waiter(id) {
                    self.add_hold(id, entry);
                    granted.push(id);
                }
            } else {
                blocked.extend(scopes);
            }
        }
        granted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(owner: &str, repo: &str) -> Identity {
        Identity {
            owner: owner.into(),
            repo: repo.into(),
        }
    }

    fn res(pairs: &[(&str, u64)]) -> Resources {
        pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
    }

    fn owner(name: &str) -> Scope {
        Scope::Owner(name.into())
    }

    fn repo(name: &str) -> Scope {
        Scope::Repo(name.into())
    }

    /// Every owner may use 4 cpu; repos are unlimited.
    fn owner_cpu_4() -> QuotaLedger {
        QuotaLedger::new(QuotaConfig {
            owner_defaults: res(&[("cpu", 4)]),
            ..QuotaConfig::default()
        })
    }

    fn acquire(ledger: &mut QuotaLedger, id: u64, who: &Identity, charge: &Resources) -> Acquire {
        match ledger.try_acquire(JobId(id), who, charge) {
            Ok(answer) => answer,
            Err(e) => panic!("acquire j{id}: {e}"),
        }
    }

    #[test]
    fn q1_allowed_when_it_fits() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "acme/app");
        assert_eq!(
            acquire(&mut q, 1, &who, &res(&[("cpu", 3)])),
            Acquire::Allowed
        );
        assert!(q.is_held(JobId(1)));
        assert_eq!(q.held(JobId(1)), Some((&who, &res(&[("cpu", 3)]))));
        assert_eq!(q.waiting(), 0);
    }

    #[test]
    fn q3_released_holds_and_waiters_leave_no_identity_behind() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        acquire(&mut q, 1, &who, &res(&[("cpu", 3)]));
        assert_eq!(
            acquire(&mut q, 2, &who, &res(&[("cpu", 3)])),
            Acquire::Temporary
        );
        // Entries sharing the interned charge (the ledger's own reference not counted).
        let count = |q: &QuotaLedger| {
            q.interned
                .get(&who)
                .and_then(|c| c.get(&res(&[("cpu", 3)])))
                .map(|shared| Arc::strong_count(shared) - 1)
        };
        assert_eq!(count(&q), Some(2));
        q.release(JobId(2));
        q.release(JobId(2));
        assert_eq!(count(&q), Some(1));
        q.release(JobId(1));
        assert_eq!(count(&q), Some(0), "kept idle for the next job like it");
        acquire(&mut q, 3, &who, &res(&[("cpu", 3)]));
        assert_eq!(count(&q), Some(1));
        assert_eq!(q.charges, 1);
        q.release(JobId(3));
        // Idle charges of many identities are swept, so they stay bounded.
        for i in 0..2_000u64 {
            let other = ident("acme", &format!("r{i}"));
            acquire(&mut q, 10 + i, &other, &res(&[("cpu", 1)]));
            q.release(JobId(10 + i));
            let held: usize = q.interned.values().map(BTreeMap::len).sum();
            assert_eq!(held, q.charges);
            assert!(q.charges <= super::IDLE_CHARGES, "{} charges", q.charges);
        }
        assert_eq!(q.holds().count(), 0);
    }

    #[test]
    fn q1_allowed_charge_counts_in_owner_and_repo() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "acme/app");
        acquire(&mut q, 1, &who, &res(&[("cpu", 3), ("mem", 7)]));
        let expected = res(&[("cpu", 3), ("mem", 7)]);
        assert_eq!(q.usage(&owner("acme")), expected);
        assert_eq!(q.usage(&repo("acme/app")), expected);
        assert_eq!(q.usage(&owner("acme/app")), Resources::new());
        assert_eq!(q.usage(&repo("acme")), Resources::new());
    }

    #[test]
    fn q1_temporary_when_holders_must_release_first() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 3)]));
        let answer = acquire(&mut q, 2, &ident("acme", "b"), &res(&[("cpu", 2)]));
        assert_eq!(answer, Acquire::Temporary);
        assert!(q.is_waiting(JobId(2)));
        assert!(!q.is_held(JobId(2)));
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 3)]));
        assert_eq!(q.usage(&repo("b")), Resources::new());
    }

    #[test]
    fn q1_temporary_when_it_fits_but_an_earlier_waiter_waits_in_its_scope() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 3)]));
        acquire(&mut q, 2, &ident("acme", "a"), &res(&[("cpu", 2)]));
        // 3 + 1 fits, but job 2 asked first.
        let answer = acquire(&mut q, 3, &ident("acme", "c"), &res(&[("cpu", 1)]));
        assert_eq!(answer, Acquire::Temporary);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 3)]));
        assert_eq!(q.waiting(), 2);
    }

    #[test]
    fn q1_denied_when_charge_alone_exceeds_limit() {
        let mut q = owner_cpu_4();
        let answer = acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 5)]));
        let Acquire::Denied { reason } = answer else {
            panic!("expected Denied, got {answer:?}");
        };
        for part in ["owner", "\"acme\"", "\"cpu\"", "5", "limit 4"] {
            assert!(reason.contains(part), "{reason:?} lacks {part:?}");
        }
        assert!(!q.is_held(JobId(1)));
        assert!(!q.is_waiting(JobId(1)));
        assert_eq!(q.waiting(), 0);
        assert_eq!(q.holds().count(), 0);
        assert_eq!(q.usage(&owner("acme")), Resources::new());
    }

    #[test]
    fn q1_denied_reason_names_the_repo_when_the_repo_limit_is_exceeded() {
        let mut q = QuotaLedger::new(QuotaConfig {
            owner_defaults: res(&[("cpu", 8)]),
            repo_defaults: res(&[("cpu", 2)]),
            ..QuotaConfig::default()
        });
        let answer = acquire(&mut q, 1, &ident("acme", "acme/app"), &res(&[("cpu", 3)]));
        let Acquire::Denied { reason } = answer else {
            panic!("expected Denied, got {answer:?}");
        };
        assert!(reason.contains("repo \"acme/app\""), "{reason:?}");
        assert!(reason.contains("limit 2"), "{reason:?}");
    }

    #[test]
    fn q1_denied_even_while_usage_is_zero_and_others_wait() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 4)]));
        acquire(&mut q, 2, &ident("acme", "a"), &res(&[("cpu", 4)]));
        let answer = acquire(&mut q, 3, &ident("acme", "a"), &res(&[("cpu", 9)]));
        assert!(matches!(answer, Acquire::Denied { .. }), "{answer:?}");
        assert_eq!(q.waiting(), 1);
    }

    #[test]
    fn q1_empty_charge_is_always_allowed() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 4)]));
        acquire(&mut q, 2, &ident("acme", "a"), &res(&[("cpu", 1)]));
        let answer = acquire(&mut q, 3, &ident("acme", "a"), &Resources::new());
        assert_eq!(answer, Acquire::Allowed);
        assert_eq!(
            q.held(JobId(3)),
            Some((&ident("acme", "a"), &Resources::new()))
        );
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 4)]));
    }

    #[test]
    fn q2_waiters_are_granted_fifo() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        acquire(&mut q, 1, &who, &res(&[("cpu", 4)]));
        acquire(&mut q, 2, &who, &res(&[("cpu", 3)]));
        acquire(&mut q, 3, &who, &res(&[("cpu", 3)]));
        assert_eq!(q.release(JobId(1)), vec![JobId(2)]);
        assert!(q.is_held(JobId(2)));
        assert!(q.is_waiting(JobId(3)));
        assert_eq!(q.release(JobId(2)), vec![JobId(3)]);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 3)]));
        assert_eq!(q.waiting(), 0);
    }

    #[test]
    fn q2_release_grants_every_waiter_that_fits_in_arrival_order() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        acquire(&mut q, 1, &who, &res(&[("cpu", 4)]));
        acquire(&mut q, 7, &who, &res(&[("cpu", 1)]));
        acquire(&mut q, 5, &who, &res(&[("cpu", 2)]));
        acquire(&mut q, 3, &who, &res(&[("cpu", 1)]));
        assert_eq!(q.release(JobId(1)), vec![JobId(7), JobId(5), JobId(3)]);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 4)]));
    }

    #[test]
    fn q2_waiter_does_not_overtake_earlier_waiter_in_same_scope() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 2)]));
        acquire(&mut q, 2, &ident("acme", "a"), &res(&[("cpu", 2)]));
        acquire(&mut q, 3, &ident("acme", "a"), &res(&[("cpu", 3)]));
        acquire(&mut q, 4, &ident("acme", "b"), &res(&[("cpu", 1)]));
        // 2 cpu free: job 4 would fit, job 3 not; job 4 must not overtake job 3.
        assert_eq!(q.release(JobId(1)), Vec::<JobId>::new());
        assert!(q.is_waiting(JobId(4)));
        assert_eq!(q.release(JobId(2)), vec![JobId(3), JobId(4)]);
    }

    #[test]
    fn q2_earlier_waiter_blocks_later_ones_through_a_shared_repo() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 4)]));
        acquire(&mut q, 2, &ident("acme", "shared"), &res(&[("cpu", 3)]));
        // Owner zeta is idle, but job 2 waits in repo "shared".
        let answer = acquire(&mut q, 3, &ident("zeta", "shared"), &res(&[("cpu", 1)]));
        assert_eq!(answer, Acquire::Temporary);
        assert_eq!(q.release(JobId(1)), vec![JobId(2), JobId(3)]);
    }

    #[test]
    fn q2_waiter_in_other_scope_is_not_blocked() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 4)]));
        acquire(&mut q, 2, &ident("acme", "a"), &res(&[("cpu", 3)]));
        acquire(&mut q, 3, &ident("zeta", "z"), &res(&[("cpu", 4)]));
        acquire(&mut q, 4, &ident("zeta", "y"), &res(&[("cpu", 2)]));
        // Job 2 is earlier but shares no scope with job 4.
        assert_eq!(q.release(JobId(3)), vec![JobId(4)]);
        assert!(q.is_waiting(JobId(2)));
    }

    #[test]
    fn q2_dropping_a_waiter_unblocks_the_waiters_behind_it() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 3)]));
        acquire(&mut q, 2, &ident("acme", "a"), &res(&[("cpu", 3)]));
        acquire(&mut q, 3, &ident("acme", "b"), &res(&[("cpu", 1)]));
        assert_eq!(q.release(JobId(2)), vec![JobId(3)]);
        assert!(!q.is_waiting(JobId(2)));
        assert!(!q.is_held(JobId(2)));
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 4)]));
    }

    #[test]
    fn q3_release_is_idempotent() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        acquire(&mut q, 1, &who, &res(&[("cpu", 4)]));
        acquire(&mut q, 2, &who, &res(&[("cpu", 4)]));
        acquire(&mut q, 3, &who, &res(&[("cpu", 4)]));
        assert_eq!(q.release(JobId(1)), vec![JobId(2)]);
        assert_eq!(q.release(JobId(1)), Vec::<JobId>::new());
        assert_eq!(q.release(JobId(99)), Vec::<JobId>::new());
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 4)]));
        assert!(q.is_waiting(JobId(3)));
        assert_eq!(q.release(JobId(2)), vec![JobId(3)]);
        assert_eq!(q.release(JobId(3)), Vec::<JobId>::new());
        assert_eq!(q.release(JobId(3)), Vec::<JobId>::new());
        assert_eq!(q.usage(&owner("acme")), Resources::new());
        assert_eq!(q.usage(&repo("a")), Resources::new());
        assert_eq!(q.holds().count(), 0);
    }

    #[test]
    fn q3_reacquire_with_same_charge_is_idempotent() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        let charge = res(&[("cpu", 3)]);
        assert_eq!(acquire(&mut q, 1, &who, &charge), Acquire::Allowed);
        assert_eq!(acquire(&mut q, 1, &who, &charge), Acquire::Allowed);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 3)]));
        assert_eq!(q.holds().count(), 1);
    }

    #[test]
    fn q3_reasking_while_waiting_with_same_charge_is_idempotent() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        acquire(&mut q, 1, &who, &res(&[("cpu", 4)]));
        assert_eq!(
            acquire(&mut q, 2, &who, &res(&[("cpu", 2)])),
            Acquire::Temporary
        );
        acquire(&mut q, 3, &who, &res(&[("cpu", 2)]));
        // Asking again keeps job 2's place in front of job 3.
        assert_eq!(
            acquire(&mut q, 2, &who, &res(&[("cpu", 2)])),
            Acquire::Temporary
        );
        assert_eq!(q.waiting(), 2);
        assert_eq!(q.release(JobId(1)), vec![JobId(2), JobId(3)]);
    }

    #[test]
    fn q3_reacquire_with_different_charge_is_an_error() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        acquire(&mut q, 1, &who, &res(&[("cpu", 3)]));
        acquire(&mut q, 2, &who, &res(&[("cpu", 3)]));
        let conflict = |id| Err(QuotaError::ConflictingCharge { id: JobId(id) });
        assert_eq!(
            q.try_acquire(JobId(1), &who, &res(&[("cpu", 2)])),
            conflict(1)
        );
        assert_eq!(
            q.try_acquire(JobId(1), &ident("acme", "b"), &res(&[("cpu", 3)])),
            conflict(1)
        );
        assert_eq!(
            q.try_acquire(JobId(2), &who, &Resources::new()),
            conflict(2)
        );
        // Nothing changed.
        assert_eq!(q.held(JobId(1)), Some((&who, &res(&[("cpu", 3)]))));
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 3)]));
        assert!(q.is_waiting(JobId(2)));
        assert_eq!(q.waiting(), 1);
    }

    #[test]
    fn q2_blocked_names_the_full_scope_and_resource_with_the_numbers() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "a"), &res(&[("cpu", 3)]));
        acquire(
            &mut q,
            2,
            &ident("acme", "b"),
            &res(&[("cpu", 2), ("mem", 1)]),
        );
        let blocked = q.blocked(JobId(2));
        assert_eq!(
            blocked,
            Some(Blocked::Limit {
                scope: owner("acme"),
                resource: "cpu".into(),
                used: 3,
                asks: 2,
                limit: 4,
            })
        );
        let text = blocked.map(|b| b.to_string()).unwrap_or_default();
        assert_eq!(text, "owner \"acme\" cpu 3/4 in use (asks 2)");
        assert_eq!(q.blocked(JobId(1)), None, "a holder does not wait");
        assert_eq!(q.blocked(JobId(9)), None, "unknown");
    }

    #[test]
    fn q2_blocked_behind_an_earlier_waiter_names_it_and_the_shared_scope() {
        let mut q = owner_cpu_4();
        acquire(&mut q, 1, &ident("acme", "shared"), &res(&[("cpu", 3)]));
        acquire(&mut q, 2, &ident("acme", "shared"), &res(&[("cpu", 2)]));
        // Fits (3 + 1 <= 4), but job 2 asked first in owner acme.
        acquire(&mut q, 3, &ident("acme", "c"), &res(&[("cpu", 1)]));
        // Owner zeta is idle; job 2 waits in repo "shared".
        acquire(&mut q, 4, &ident("zeta", "shared"), &res(&[("cpu", 1)]));
        let behind = |scope, first| {
            Some(Blocked::Behind {
                scope,
                first: JobId(first),
            })
        };
        assert_eq!(q.blocked(JobId(3)), behind(owner("acme"), 2));
        assert_eq!(q.blocked(JobId(4)), behind(repo("shared"), 2));
        let listed: Vec<(JobId, Option<Blocked>)> =
            q.waiters_blocked().map(|(id, _, _, b)| (id, b)).collect();
        assert_eq!(listed.len(), 3);
        assert!(matches!(listed[0].1, Some(Blocked::Limit { .. })));
        assert_eq!(listed[1], (JobId(3), behind(owner("acme"), 2)));
        assert_eq!(listed[2], (JobId(4), behind(repo("shared"), 2)));
        assert_eq!(
            behind(owner("acme"), 2)
                .map(|b| b.to_string())
                .unwrap_or_default(),
            "behind j2 in owner \"acme\" (first come, first served)"
        );
    }

    #[test]
    fn scopes_list_holders_and_waiters_owners_first_in_name_order() {
        let mut q = QuotaLedger::new(QuotaConfig {
            repo_defaults: res(&[("cpu", 2)]),
            ..QuotaConfig::default()
        });
        acquire(&mut q, 1, &ident("zeta", "r"), &res(&[("cpu", 2)]));
        // Owner acme holds nothing but waits, behind repo r's limit.
        acquire(&mut q, 2, &ident("acme", "r"), &res(&[("cpu", 1)]));
        let scopes: Vec<ScopeUse> = q.scopes().collect();
        assert_eq!(
            scopes,
            vec![
                ScopeUse {
                    scope: owner("acme"),
                    used: Resources::new(),
                    waiting: 1,
                },
                ScopeUse {
                    scope: owner("zeta"),
                    used: res(&[("cpu", 2)]),
                    waiting: 0,
                },
                ScopeUse {
                    scope: repo("r"),
                    used: res(&[("cpu", 2)]),
                    waiting: 1,
                },
            ]
        );
        assert_eq!(q.scope_count(), 3);
        q.release(JobId(1));
        q.release(JobId(2));
        assert_eq!(q.scopes().count(), 0);
        assert_eq!(q.scope_count(), 0);
    }

    #[test]
    fn limits_of_a_scope_are_its_defaults_with_its_override_on_top() {
        let config = QuotaConfig {
            owner_defaults: res(&[("cpu", 4), ("jobs", 10)]),
            owner_overrides: [("big".to_string(), res(&[("jobs", 100), ("gpu", 1)]))].into(),
            ..QuotaConfig::default()
        };
        assert_eq!(
            config.limits(&owner("big")),
            res(&[("cpu", 4), ("gpu", 1), ("jobs", 100)])
        );
        assert_eq!(
            config.limits(&owner("small")),
            res(&[("cpu", 4), ("jobs", 10)])
        );
        assert_eq!(config.limits(&repo("big")), Resources::new());
    }

    #[test]
    fn overrides_replace_defaults_only_for_the_resources_they_name() {
        let mut q = QuotaLedger::new(QuotaConfig {
            owner_defaults: res(&[("cpu", 4), ("mem", 100)]),
            owner_overrides: [("acme".to_string(), res(&[("cpu", 10)]))].into(),
            ..QuotaConfig::default()
        });
        assert_eq!(q.limit(&owner("acme"), "cpu"), Some(10));
        assert_eq!(q.limit(&owner("acme"), "mem"), Some(100));
        assert_eq!(q.limit(&owner("zeta"), "cpu"), Some(4));
        assert_eq!(q.limit(&repo("acme"), "cpu"), None);
        let big = res(&[("cpu", 8)]);
        assert_eq!(
            acquire(&mut q, 1, &ident("acme", "a"), &big),
            Acquire::Allowed
        );
        assert!(matches!(
            acquire(&mut q, 2, &ident("zeta", "z"), &big),
            Acquire::Denied { .. }
        ));
    }

    #[test]
    fn override_may_lower_a_default() {
        let q = QuotaLedger::new(QuotaConfig {
            repo_defaults: res(&[("jobs", 5)]),
            repo_overrides: [("tiny".to_string(), res(&[("jobs", 1)]))].into(),
            ..QuotaConfig::default()
        });
        assert_eq!(q.limit(&repo("tiny"), "jobs"), Some(1));
        assert_eq!(q.limit(&repo("other"), "jobs"), Some(5));
        assert_eq!(q.limit(&owner("tiny"), "jobs"), None);
    }

    #[test]
    fn resources_limited_nowhere_are_unlimited() {
        let mut q = owner_cpu_4();
        let who = ident("acme", "a");
        let huge = res(&[("gpu", crate::types::MAX_RESOURCE_AMOUNT)]);
        assert_eq!(q.limit(&owner("acme"), "gpu"), None);
        for id in 0..4 {
            assert_eq!(acquire(&mut q, id, &who, &huge), Acquire::Allowed);
        }
        assert_eq!(
            q.usage(&owner("acme")),
            res(&[("gpu", 4 * crate::types::MAX_RESOURCE_AMOUNT)])
        );
    }

    #[test]
    fn restore_rebuilds_holds_and_usage() {
        let holds = vec![
            (JobId(1), ident("acme", "a"), res(&[("cpu", 1), ("mem", 5)])),
            (JobId(2), ident("acme", "b"), res(&[("cpu", 2)])),
            (JobId(3), ident("zeta", "b"), res(&[("cpu", 3)])),
        ];
        let q = QuotaLedger::restore(owner_cpu_4().config().clone(), holds.clone());
        let got: Vec<_> = q
            .holds()
            .map(|(id, who, charge)| (id, who.clone(), charge.clone()))
            .collect();
        assert_eq!(got, holds);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 3), ("mem", 5)]));
        assert_eq!(q.usage(&owner("zeta")), res(&[("cpu", 3)]));
        assert_eq!(q.usage(&repo("b")), res(&[("cpu", 5)]));
        assert_eq!(q.waiting(), 0);
    }

    #[test]
    fn restore_keeps_an_id_once() {
        let holds = vec![
            (JobId(1), ident("acme", "a"), res(&[("cpu", 1)])),
            (JobId(1), ident("acme", "a"), res(&[("cpu", 2)])),
        ];
        let q = QuotaLedger::restore(QuotaConfig::default(), holds);
        assert_eq!(q.holds().count(), 1);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 2)]));
    }

    #[test]
    fn restore_keeps_overage_above_a_lowered_limit_and_new_requests_wait() {
        let holds = vec![
            (JobId(1), ident("acme", "a"), res(&[("cpu", 3)])),
            (JobId(2), ident("acme", "a"), res(&[("cpu", 3)])),
        ];
        let mut q = QuotaLedger::restore(owner_cpu_4().config().clone(), holds);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 6)]));
        let answer = acquire(&mut q, 3, &ident("acme", "b"), &res(&[("cpu", 1)]));
        assert_eq!(answer, Acquire::Temporary);
        assert_eq!(q.release(JobId(1)), vec![JobId(3)]);
        assert_eq!(q.usage(&owner("acme")), res(&[("cpu", 4)]));
    }

    // ---- randomized model test -------------------------------------------------------------

    /// A tiny deterministic generator (xorshift64), so that a failing seed replays exactly.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// The Q rules written as plainly as possible: a list of waiters in arrival order and a
    /// release that grants the first grantable waiter until there is none.
    struct Model {
        config: QuotaConfig,
        holds: BTreeMap<JobId, (Identity, Resources)>,
        waiters: Vec<(JobId, Identity, Resources)>,
    }

    fn shares_scope(a: &Identity, b: &Identity) -> bool {
        a.owner == b.owner || a.repo == b.repo
    }

    impl Model {
        fn usage(&self, scope: &Scope) -> BTreeMap<String, u128> {
            let mut sum: BTreeMap<String, u128> = BTreeMap::new();
            for (who, charge) in self.holds.values() {
                if Scope::of(who).contains(scope) {
                    for (r, &a) in charge {
                        *sum.entry(r.clone()).or_insert(0) += u128::from(a);
                    }
                }
            }
            sum
        }

        fn fits(&self, who: &Identity, charge: &Resources) -> bool {
            Scope::of(who).iter().all(|scope| {
                let used = self.usage(scope);
                charge
                    .iter()
                    .all(|(r, &a)| match self.config.limit(scope, r) {
                        None => true,
                        Some(l) => {
                            used.get(r).copied().unwrap_or(0) + u128::from(a) <= u128::from(l)
                        }
                    })
            })
        }

        fn denied(&self, who: &Identity, charge: &Resources) -> bool {
            Scope::of(who).iter().any(|scope| {
                charge
                    .iter()
                    .any(|(r, &a)| self.config.limit(scope, r).is_some_and(|l| a > l))
            })
        }

        fn acquire(
            &mut self,
            id: JobId,
            who: &Identity,
            charge: &Resources,
        ) -> Result<Acquire, QuotaError> {
            if let Some((w, c)) = self.holds.get(&id) {
                return if w == who && c == charge {
                    Ok(Acquire::Allowed)
                } else {
                    Err(QuotaError::ConflictingCharge { id })
                };
            }
            if let Some((_, w, c)) = self.waiters.iter().find(|(i, _, _)| *i == id) {
                return if w == who && c == charge {
                    Ok(Acquire::Temporary)
                } else {
                    Err(QuotaError::ConflictingCharge { id })
                };
            }
            if self.denied(who, charge) {
                return Ok(Acquire::Denied {
                    reason: String::new(),
                });
            }
            let behind = self.waiters.iter().any(|(_, w, _)| shares_scope(w, who));
            if charge.is_empty() || (!behind && self.fits(who, charge)) {
                self.holds.insert(id, (who.clone(), charge.clone()));
                Ok(Acquire::Allowed)
            } else {
                self.waiters.push((id, who.clone(), charge.clone()));
                Ok(Acquire::Temporary)
            }
        }

        fn release(&mut self, id: JobId) -> Vec<JobId> {
            let was_held = self.holds.remove(&id).is_some();
            let before = self.waiters.len();
            self.waiters.retain(|(i, _, _)| *i != id);
            if !was_held && before == self.waiters.len() {
                return Vec::new();
            }
            let mut granted = Vec::new();
            loop {
                let next = (0..self.waiters.len()).find(|&i| {
                    let (_, who, charge) = &self.waiters[i];
                    let overtakes = self.waiters[..i]
                        .iter()
                        .any(|(_, w, _)| shares_scope(w, who));
                    !overtakes && self.fits(who, charge)
                });
                let Some(i) = next else { break };
                let (id, who, charge) = self.waiters.remove(i);
                self.holds.insert(id, (who, charge));
                granted.push(id);
            }
            granted
        }
    }

    const OWNERS: [&str; 2] = ["o0", "o1"];
    const REPOS: [&str; 3] = ["r0", "r1", "r2"];
    const RESOURCES: [&str; 3] = ["cpu", "mem", "jobs"];

    fn model_config() -> QuotaConfig {
        QuotaConfig {
            owner_defaults: res(&[("cpu", 8), ("jobs", 3)]),
            repo_defaults: res(&[("cpu", 5)]),
            owner_overrides: [("o1".to_string(), res(&[("cpu", 12), ("mem", 10)]))].into(),
            repo_overrides: [("r2".to_string(), res(&[("jobs", 1)]))].into(),
        }
    }

    /// Holds granted under higher limits: owner o0 uses 11 of 8 cpu, repo r2 2 of 1 jobs.
    fn restored_holds() -> Vec<(JobId, Identity, Resources)> {
        vec![
            (JobId(100), ident("o0", "r0"), res(&[("cpu", 5)])),
            (JobId(101), ident("o0", "r1"), res(&[("cpu", 5)])),
            (
                JobId(102),
                ident("o0", "r2"),
                res(&[("cpu", 1), ("jobs", 1)]),
            ),
            (
                JobId(103),
                ident("o1", "r2"),
                res(&[("jobs", 1), ("mem", 2)]),
            ),
        ]
    }

    fn random_request(rng: &mut XorShift) -> (Identity, Resources) {
        let who = ident(OWNERS[rng.below(2) as usize], REPOS[rng.below(3) as usize]);
        let mut charge = Resources::new();
        if rng.below(20) != 0 {
            for r in RESOURCES {
                if rng.below(2) == 0 {
                    let amount = match r {
                        "cpu" => 1 + rng.below(6),
                        "mem" => 1 + rng.below(4),
                        _ => 1,
                    };
                    charge.insert(r.to_string(), amount);
                }
            }
        }
        (who, charge)
    }

    #[derive(Default)]
    struct Seen {
        allowed: u32,
        temporary: u32,
        denied: u32,
        conflicts: u32,
        granted: u32,
        overage: u32,
    }

    /// Compares everything the ledger reports with the model, and checks I5: usage never
    /// exceeds a limit, except where it is made only of restored holds.
    fn check(q: &QuotaLedger, m: &Model, restored: &BTreeSet<JobId>, seen: &mut Seen, step: u32) {
        let holds: BTreeMap<JobId, (Identity, Resources)> = q
            .holds()
            .map(|(id, w, c)| (id, (w.clone(), c.clone())))
            .collect();
        assert_eq!(holds, m.holds, "holds at step {step}");
        let waiters: Vec<JobId> = q.waiters().map(|(id, _, _)| id).collect();
        let expected: Vec<JobId> = m.waiters.iter().map(|(id, _, _)| *id).collect();
        assert_eq!(waiters, expected, "waiters at step {step}");
        assert_eq!(q.waiting(), m.waiters.len());
        // Q2 for operators: every waiter says why it waits, the same one by one as in the
        // listing, and a full limit is full by the numbers the ledger reports.
        let listed: Vec<(JobId, Option<Blocked>)> =
            q.waiters_blocked().map(|(id, _, _, b)| (id, b)).collect();
        assert_eq!(
            listed.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            expected,
            "waiters_blocked order at step {step}"
        );
        for (id, blocked) in &listed {
            assert_eq!(blocked, &q.blocked(*id), "{id} at step {step}");
            match blocked {
                Some(Blocked::Limit {
                    scope,
                    resource,
                    used,
                    asks,
                    limit,
                }) => {
                    assert_eq!(q.usage(scope).get(resource).copied().unwrap_or(0), *used);
                    assert_eq!(q.limit(scope, resource), Some(*limit));
                    assert!(used.saturating_add(*asks) > *limit, "{id} at step {step}");
                }
                Some(Blocked::Behind { first, .. }) => {
                    assert!(q.is_waiting(*first), "{id} behind {first} at step {step}")
                }
                None => panic!("{id} waits for nothing at step {step}"),
            }
        }
        let listed_scopes: Vec<ScopeUse> = q.scopes().collect();
        assert_eq!(listed_scopes.len(), q.scope_count());
        for s in &listed_scopes {
            assert_eq!(s.used, q.usage(&s.scope), "{} at step {step}", s.scope);
            assert!(
                !s.used.is_empty() || s.waiting > 0,
                "{} listed idle",
                s.scope
            );
        }
        let scopes = OWNERS
            .iter()
            .map(|o| owner(o))
            .chain(REPOS.iter().map(|r| repo(r)));
        for scope in scopes {
            let used = q.usage(&scope);
            let sum = m.usage(&scope);
            let sum64: Resources = sum
                .iter()
                .filter(|(_, &a)| a > 0)
                .map(|(r, &a)| (r.clone(), u64::try_from(a).unwrap_or(u64::MAX)))
                .collect();
            assert_eq!(used, sum64, "usage of {scope} at step {step}");
            for (r, &amount) in &used {
                let Some(limit) = q.limit(&scope, r) else {
                    continue;
                };
                if amount > limit {
                    seen.overage += 1;
                    let from_restored: u64 = m
                        .holds
                        .iter()
                        .filter(|(id, (w, _))| {
                            restored.contains(id) && Scope::of(w).contains(&scope)
                        })
                        .filter_map(|(_, (_, c))| c.get(r))
                        .sum();
                    assert_eq!(
                        amount, from_restored,
                        "{scope} {r} is {amount} over limit {limit} at step {step}, \
                         but not only from restored holds"
                    );
                }
            }
        }
    }

    fn run_model(seed: u64, steps: u32, seen: &mut Seen) {
        let mut rng = XorShift(seed);
        let restored: BTreeSet<JobId> = restored_holds().iter().map(|(id, _, _)| *id).collect();
        let mut q = QuotaLedger::restore(model_config(), restored_holds());
        let mut m = Model {
            config: model_config(),
            holds: restored_holds()
                .into_iter()
                .map(|(id, w, c)| (id, (w, c)))
                .collect(),
            waiters: Vec::new(),
        };
        check(&q, &m, &restored, seen, 0);
        for step in 1..=steps {
            let roll = rng.below(100);
            if roll < 45 {
                let id = JobId(rng.below(48));
                let (who, charge) = random_request(&mut rng);
                let got = q.try_acquire(id, &who, &charge);
                let want = m.acquire(id, &who, &charge);
                match (&got, &want) {
                    (Ok(Acquire::Denied { reason }), Ok(Acquire::Denied { .. })) => {
                        assert!(!reason.is_empty());
                        seen.denied += 1;
                    }
                    _ => assert_eq!(got, want, "seed {seed} step {step}: acquire {id}"),
                }
                match got {
                    Ok(Acquire::Allowed) => seen.allowed += 1,
                    Ok(Acquire::Temporary) => seen.temporary += 1,
                    Ok(Acquire::Denied { .. }) => {}
                    Err(QuotaError::ConflictingCharge { .. }) => seen.conflicts += 1,
                }
            } else if roll < 55 {
                // Ask again for something held or waiting, with the same charge (Q3).
                let known: Vec<(JobId, Identity, Resources)> = q
                    .holds()
                    .chain(q.waiters())
                    .map(|(i, w, c)| (i, w.clone(), c.clone()))
                    .collect();
                if known.is_empty() {
                    continue;
                }
                let (id, who, charge) = &known[rng.below(known.len() as u64) as usize];
                let got = q.try_acquire(*id, who, charge);
                assert_eq!(got, m.acquire(*id, who, charge), "seed {seed} step {step}");
                assert!(matches!(got, Ok(Acquire::Allowed | Acquire::Temporary)));
            } else {
                let id = if rng.below(10) == 0 {
                    JobId(100 + rng.below(4))
                } else {
                    JobId(rng.below(48))
                };
                let got = q.release(id);
                let want = m.release(id);
                assert_eq!(got, want, "seed {seed} step {step}: release {id}");
                seen.granted += got.len() as u32;
            }
            check(&q, &m, &restored, seen, step);
        }
    }

    #[test]
    fn q1_q3_random_ops_match_the_plain_model_and_keep_usage_within_limits() {
        let mut seen = Seen::default();
        for seed in 1..=12u64 {
            run_model(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 3_000, &mut seen);
        }
        // The run reached every outcome it claims to check.
        assert!(seen.allowed > 100, "allowed {}", seen.allowed);
        assert!(seen.temporary > 100, "temporary {}", seen.temporary);
        assert!(seen.denied > 100, "denied {}", seen.denied);
        assert!(seen.conflicts > 10, "conflicts {}", seen.conflicts);
        assert!(seen.granted > 100, "granted {}", seen.granted);
        assert!(seen.overage > 0, "overage {}", seen.overage);
    }
}
