//! The quota ledger (DESIGN §6, Q1–Q3).
//!
//! Scopes are owners and repos; every resource is a named counter with a per-scope limit
//! (a default for each scope kind, plus per-scope overrides). A resource with no limit is
//! unlimited. Usage is charged to both of a job's scopes at once.
//!
//! The ledger is usable on its own: the mill calls it for M15, and its holds are part of what
//! the mill persists.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::job::Identity;
use crate::types::{JobId, Resources};

/// A quota scope.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Scope {
    /// An owner, e.g. an organisation.
    Owner(String),
    /// A repository.
    Repo(String),
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

/// The ledger: holds, usage per scope, and FIFO waiters per scope.
#[derive(Debug, Clone, Default)]
pub struct QuotaLedger {
    config: QuotaConfig,
}

impl QuotaLedger {
    /// An empty ledger.
    pub fn new(config: QuotaConfig) -> Self {
        QuotaLedger { config }
    }

    /// A ledger holding `holds` (restored at restart; waiters are not durable).
    pub fn restore(
        config: QuotaConfig,
        holds: impl IntoIterator<Item = (JobId, Identity, Resources)>,
    ) -> Self {
        let _ = holds;
        Self::new(config)
    }

    /// Q1: reserve `charge` for `id` against both scopes of `identity`.
    pub fn try_acquire(
        &mut self,
        id: JobId,
        identity: &Identity,
        charge: &Resources,
    ) -> Result<Acquire, QuotaError> {
        let _ = (id, identity, charge, &self.config);
        todo!()
    }

    /// Q3: releases a hold or drops a waiter (idempotent), then grants waiters that now fit,
    /// FIFO per scope (Q2). Returns the ids granted, in grant order; they are now held.
    pub fn release(&mut self, id: JobId) -> Vec<JobId> {
        let _ = id;
        todo!()
    }

    /// True when `id` holds a reservation.
    pub fn is_held(&self, id: JobId) -> bool {
        let _ = id;
        todo!()
    }

    /// The charge held for `id`, if held.
    pub fn held(&self, id: JobId) -> Option<(&Identity, &Resources)> {
        let _ = id;
        todo!()
    }

    /// True when `id` waits (Q2).
    pub fn is_waiting(&self, id: JobId) -> bool {
        let _ = id;
        todo!()
    }

    /// Current usage of `scope` (absent resources are zero).
    pub fn usage(&self, scope: &Scope) -> Resources {
        let _ = scope;
        todo!()
    }

    /// The limit of `resource` in `scope`, or `None` if unlimited.
    pub fn limit(&self, scope: &Scope, resource: &str) -> Option<u64> {
        let _ = (scope, resource);
        todo!()
    }

    /// Every hold, in id order.
    pub fn holds(&self) -> impl Iterator<Item = (JobId, &Identity, &Resources)> + '_ {
        std::iter::empty()
    }

    /// How many requests wait.
    pub fn waiting(&self) -> usize {
        0
    }
}
