//! M33 checked from outside the mill: a job's first ask must not pass over an earlier never-
//! asked job of the same owner and class (moved out of `checkers.rs` unchanged, issue 17 item
//! 3).

use super::*;

/// What makes two jobs interchangeable for placement: the same candidates, the same fit
/// (engine, labels, resources, pinned node).
pub(super) type PlaceClass = (String, BTreeSet<String>, Resources, Option<NodeId>);

/// A job's place in its owner's queue (M33): higher priority first, then submit order.
pub(super) type OwnerKey = (std::cmp::Reverse<i32>, JobId);

/// M33 checked from outside the mill: the first `ReserveSeat` of a job that was never asked
/// for must not pass over a job of the same owner and class that was never asked for either
/// and comes first in the owner's order (priority, then submit order). Only never-asked jobs
/// are compared: a job whose earlier round failed may rightly wait (it waits for a change
/// of the fleet, or its candidates said incompatible), and a later ask of a round started
/// before another job arrived is not a choice between them.
#[derive(Debug, Default)]
pub(super) struct FreshOrder {
    pub(super) jobs: BTreeMap<JobId, (PlaceClass, String, OwnerKey)>,
    /// Per (class, owner), in the owner's order.
    pub(super) by_owner: BTreeMap<(PlaceClass, String), BTreeSet<OwnerKey>>,
    /// Per class, in submit order: the owner of each job.
    pub(super) by_class: BTreeMap<PlaceClass, BTreeMap<JobId, String>>,
    /// First asks that passed over an older never-asked job of the owner with a lower
    /// priority (coverage: priority decided).
    pub(super) priority_overtakes: u64,
    /// First asks that passed over an older never-asked job of the same class of another
    /// owner (coverage: M33's owner order decided, not submit order).
    pub(super) owner_overtakes: u64,
    /// Jobs first asked for ahead of their insert (M12: an early ask leads its step's
    /// `Persist`), judged then from the spec the ask carried; their insert adds nothing.
    pub(super) asked_early: BTreeSet<JobId>,
}

impl FreshOrder {
    pub(super) fn inserted(&mut self, job: JobId, spec: &JobSpec) {
        if self.asked_early.remove(&job) {
            return;
        }
        self.register(job, spec);
    }

    pub(super) fn register(&mut self, job: JobId, spec: &JobSpec) {
        let class: PlaceClass = (
            spec.engine.clone(),
            spec.labels.clone(),
            spec.resources.clone(),
            spec.node.clone(),
        );
        let owner = spec.identity.owner.clone();
        let key = (std::cmp::Reverse(spec.priority), job);
        self.by_owner
            .entry((class.clone(), owner.clone()))
            .or_default()
            .insert(key);
        self.by_class
            .entry(class.clone())
            .or_default()
            .insert(job, owner.clone());
        self.jobs.insert(job, (class, owner, key));
    }

    pub(super) fn forget(&mut self, job: JobId) -> Option<(PlaceClass, String, OwnerKey)> {
        let (class, owner, key) = self.jobs.remove(&job)?;
        let slot = (class, owner);
        if let Some(set) = self.by_owner.get_mut(&slot) {
            set.remove(&key);
            if set.is_empty() {
                self.by_owner.remove(&slot);
            }
        }
        let (class, owner) = slot;
        if let Some(m) = self.by_class.get_mut(&class) {
            m.remove(&job);
            if m.is_empty() {
                self.by_class.remove(&class);
            }
        }
        Some((class, owner, key))
    }

    pub(super) fn ended(&mut self, job: JobId) {
        self.forget(job);
    }

    /// A `ReserveSeat` for `job` went out; `inserted` says whether its insert is durable.
    pub(super) fn asked(
        &mut self,
        job: JobId,
        spec: &JobSpec,
        inserted: bool,
    ) -> Result<(), Violation> {
        if !inserted && self.asked_early.insert(job) {
            // M12: the ask leads its job's insert in the same step; judge it as a first ask.
            self.register(job, spec);
        }
        let Some((class, owner, key)) = self.jobs.get(&job).cloned() else {
            return Ok(());
        };
        let slot = (class, owner);
        if let Some(set) = self.by_owner.get(&slot) {
            if let Some(first) = set.first().filter(|f| **f < key) {
                return fail(
                    "I9",
                    format!(
                        "M33: {job} (priority {}) asked for while {} (priority {}) of the same \
                         owner {} and class waited, never asked, ahead of it in the owner's order",
                        key.0 .0, first.1, first.0 .0, slot.1
                    ),
                );
            }
            if set.iter().any(|k| k.1 < job && k.0 > key.0) {
                self.priority_overtakes += 1;
            }
        }
        if let Some(m) = self.by_class.get(&slot.0) {
            if m.iter()
                .next()
                .is_some_and(|(k, o)| *k < job && *o != slot.1)
            {
                self.owner_overtakes += 1;
            }
        }
        self.forget(job);
        Ok(())
    }
}
