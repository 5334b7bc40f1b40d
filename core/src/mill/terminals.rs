//! The recent-terminals memory of one (node, epoch) event stream (M22): the last `bound` distinct leases whose
//! terminal the node's stream delivered, forgotten oldest first.

use std::collections::VecDeque;

use crate::types::LeaseId;

/// A bounded FIFO of distinct lease ids with an exact membership test.
///
/// Two deques of the same ids: `order` in arrival order (for forgetting the oldest) and
/// `sorted` in id order (for binary search). Lease ids are issued in increasing order and a
/// node's terminals arrive roughly in issue order, so a new id belongs near the back of
/// `sorted` and the oldest near its front, and `VecDeque::insert`/`remove` shift the shorter
/// side: a handful of ids in the common case, and at most half of `bound` in any order an
/// executor could send. This replaced a `BTreeSet`, whose node allocations and rebalancing
/// cost about ten times as much per terminal.
#[derive(Debug, Default)]
pub(super) struct TerminalMemory {
    order: VecDeque<LeaseId>,
    sorted: VecDeque<LeaseId>,
}

impl TerminalMemory {
    /// True if `lease`'s terminal is remembered.
    pub(super) fn contains(&self, lease: LeaseId) -> bool {
        self.sorted.binary_search(&lease).is_ok()
    }

    /// How many terminals are remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    /// True when nothing is remembered.
    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Makes room for up to `more` terminals (at most `bound` in all) at once.
    pub(super) fn reserve(&mut self, more: usize, bound: usize) {
        let room = bound.saturating_sub(self.order.len()).min(more);
        self.order.reserve(room);
        self.sorted.reserve(room);
    }

    /// Remembers `lease` (if not yet remembered), then forgets the oldest beyond `bound`.
    pub(super) fn remember(&mut self, lease: LeaseId, bound: usize) {
        // The common case, an id above every remembered one, skips the search.
        let at = match self.sorted.back() {
            Some(&last) if last < lease => self.sorted.len(),
            None => 0,
            Some(_) => match self.sorted.binary_search(&lease) {
                Ok(_) => return,
                Err(at) => at,
            },
        };
        self.sorted.insert(at, lease);
        self.order.push_back(lease);
        while self.order.len() > bound {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Ok(i) = self.sorted.binary_search(&old) {
                self.sorted.remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, VecDeque};

    use super::TerminalMemory;
    use crate::types::LeaseId;

    /// The structure this replaced, as the model.
    #[derive(Default)]
    struct Model {
        set: BTreeSet<LeaseId>,
        order: VecDeque<LeaseId>,
    }

    impl Model {
        fn remember(&mut self, lease: LeaseId, bound: usize) {
            if self.set.insert(lease) {
                self.order.push_back(lease);
                while self.order.len() > bound {
                    if let Some(old) = self.order.pop_front() {
                        self.set.remove(&old);
                    }
                }
            }
        }
    }

    /// A small deterministic generator (no randomness in core, even in tests).
    fn next(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        *state >> 33
    }

    #[test]
    fn m22_terminal_memory_matches_a_bounded_set_in_any_order() {
        for (seed, bound, spread) in [(1, 1, 4), (2, 7, 3), (3, 64, 200), (4, 64, 40), (5, 300, 5)]
        {
            let mut state = seed;
            let mut memory = TerminalMemory::default();
            let mut model = Model::default();
            let mut base = 0u64;
            for step in 0..5_000u64 {
                // Mostly increasing ids with jitter, some repeats, some far-back ids.
                let lease = match next(&mut state) % 10 {
                    0 => LeaseId(next(&mut state) % (base + 1)),
                    _ => {
                        base += next(&mut state) % 3;
                        LeaseId(base.saturating_sub(next(&mut state) % spread))
                    }
                };
                if step % 7 == 0 {
                    memory.reserve(5, bound);
                }
                memory.remember(lease, bound);
                model.remember(lease, bound);
                assert_eq!(memory.len(), model.order.len(), "seed {seed} step {step}");
                for probe in [lease.0, next(&mut state) % (base + 2), base + 1] {
                    let probe = LeaseId(probe);
                    assert_eq!(
                        memory.contains(probe),
                        model.set.contains(&probe),
                        "seed {seed} step {step} probe {probe}"
                    );
                }
            }
            assert_eq!(
                memory.order.iter().collect::<Vec<_>>(),
                model.order.iter().collect::<Vec<_>>()
            );
            assert!(memory
                .sorted
                .iter()
                .zip(memory.sorted.iter().skip(1))
                .all(|(a, b)| a < b));
        }
    }
}
