//! I5: quota usage and the ledger never exceed a limit; the charges each acquire makes. (moved
//! out of `checkers.rs` unchanged, issue 17 item 3).

use super::*;

impl Checker {
    /// I5: a new durable lease adds its charge to both of its job's scopes; none may pass
    /// its limit.
    pub(super) fn charge_quota(
        &mut self,
        w: &World,
        r: &millrace_core::mill::LeaseRecord,
    ) -> Result<Vec<(UsageKey, u64)>, Violation> {
        let cfg = &w.mill_cfg.quota;
        let limited = !(cfg.owner_defaults.is_empty()
            && cfg.repo_defaults.is_empty()
            && cfg.owner_overrides.is_empty()
            && cfg.repo_overrides.is_empty());
        if !limited {
            return Ok(Vec::new());
        }
        // The post-batch store may have lost the job already: a late Tick (I12) can fire a
        // bid's end (publishing the lease) and the job's timeout (ending it) in one step, so
        // one batch inserts the lease and ends its job. The job's identity then comes from
        // the arrival it was submitted as.
        let from_arrival = || match self
            .accepted
            .get(&r.job)
            .map(|k| &w.workload.arrivals[*k].1)
        {
            Some(crate::workload::Arrival::Job { spec, .. }) => Some(spec.identity.clone()),
            _ => None,
        };
        let Some(id) = w
            .mill_store
            .jobs
            .get(&r.job)
            .map(|j| j.spec.identity.clone())
            .or_else(from_arrival)
        else {
            return fail(
                "I5",
                format!("durable lease {} of unknown {}", r.lease, r.job),
            );
        };
        let id = &id;
        let mut charge = Vec::with_capacity(2 * r.resources.len());
        for (repo, scope) in [(false, id.owner.as_str()), (true, id.repo.as_str())] {
            let scope_id = self.tally.id(scope);
            for (name, amount) in &r.resources {
                let key = (repo, scope_id, self.tally.id(name));
                let used = self.tally.usage.entry(key).or_insert(0);
                *used += amount;
                let used = *used;
                charge.push((key, *amount));
                if let Some(limit) = self.tally.limit(cfg, key) {
                    if used > limit {
                        return fail(
                            "I5",
                            format!(
                                "{} {scope} uses {used} {name} through its leases (with {} of {}); limit {limit}",
                                if repo { "repo" } else { "owner" },
                                r.lease,
                                r.job
                            ),
                        );
                    }
                }
            }
        }
        Ok(charge)
    }

    /// I5: usage by the durable leases never exceeds a limit; nor does the ledger's.
    pub fn quota_within_limits(&self, w: &World) -> Result<(), Violation> {
        let cfg = &w.mill_cfg.quota;
        let limited = !(cfg.owner_defaults.is_empty()
            && cfg.repo_defaults.is_empty()
            && cfg.owner_overrides.is_empty()
            && cfg.repo_overrides.is_empty());
        if !limited {
            return Ok(());
        }
        // (is_repo, scope name, resource) → amount; a handful of entries, so a flat list.
        let mut usage: Vec<((bool, &str, &str), u64)> = Vec::new();
        for l in w.mill_store.leases.values() {
            let Some(job) = w.mill_store.jobs.get(&l.job) else {
                return fail(
                    "I5",
                    format!("durable lease {} of unknown {}", l.lease, l.job),
                );
            };
            let id = &job.spec.identity;
            for scope in [(false, id.owner.as_str()), (true, id.repo.as_str())] {
                for (name, amount) in &l.resources {
                    let key = (scope.0, scope.1, name.as_str());
                    match usage.iter_mut().find(|(k, _)| *k == key) {
                        Some((_, u)) => *u += amount,
                        None => usage.push((key, *amount)),
                    }
                }
            }
        }
        for ((repo, scope, name), amount) in usage {
            let scope = if repo {
                Scope::Repo(scope.to_string())
            } else {
                Scope::Owner(scope.to_string())
            };
            if let Some(limit) = cfg.limit(&scope, name) {
                if amount > limit {
                    return fail(
                        "I5",
                        format!("{scope} uses {amount} {name} through its leases; limit {limit}"),
                    );
                }
            }
        }
        Ok(())
    }

    /// I5 on the mill's ledger (volatile holds too).
    pub fn ledger_within_limits(&self, w: &World) -> Result<(), Violation> {
        let cfg = &w.mill_cfg.quota;
        let Some(mill) = &w.mill else {
            return Ok(());
        };
        let mut scopes: BTreeSet<Scope> = BTreeSet::new();
        for (_, identity, _) in mill.quota().holds() {
            scopes.extend(Scope::of(identity));
        }
        for scope in scopes {
            for (name, amount) in mill.quota().usage(&scope) {
                if let Some(limit) = cfg.limit(&scope, &name) {
                    if amount > limit {
                        return fail(
                            "I5",
                            format!("quota ledger: {scope} uses {amount} {name}; limit {limit}"),
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
