//! A keyed timer table (quinn-proto's `TimerTable`, generalised to keys that carry ids).
//!
//! Each key has at most one deadline. Setting a key replaces its deadline; stopping it removes
//! it. So a timer is the *current* deadline of something that is live, and when that thing
//! ends its owner stops the timer: nothing that has ended leaves a deadline behind, and
//! [`TimerTable::next_deadline`] is `None` exactly when nothing is pending (STYLE 13).
//!
//! Both indexes are ordered (B-trees), so the order in which due timers fire — by time, then
//! by key — is part of the state machine's determinism.

use std::collections::{BTreeMap, BTreeSet};

use crate::types::Time;

/// Deadlines by key, and keys by deadline.
#[derive(Debug, Clone)]
pub struct TimerTable<K: Ord + Clone> {
    by_key: BTreeMap<K, Time>,
    by_time: BTreeSet<(Time, K)>,
}

impl<K: Ord + Clone> Default for TimerTable<K> {
    fn default() -> Self {
        TimerTable {
            by_key: BTreeMap::new(),
            by_time: BTreeSet::new(),
        }
    }
}

impl<K: Ord + Clone> TimerTable<K> {
    /// Sets `key` to fire at `at`, replacing any deadline it had.
    pub fn set(&mut self, key: K, at: Time) {
        match self.by_key.get_mut(&key) {
            Some(old) if *old == at => {}
            Some(old) => {
                let was = std::mem::replace(old, at);
                self.by_time.remove(&(was, key.clone()));
                self.by_time.insert((at, key));
            }
            None => {
                self.by_key.insert(key.clone(), at);
                self.by_time.insert((at, key));
            }
        }
        self.debug_check();
    }

    /// Stops `key`; returns the deadline it had.
    pub fn stop(&mut self, key: &K) -> Option<Time> {
        let at = self.by_key.remove(key)?;
        self.by_time.remove(&(at, key.clone()));
        self.debug_check();
        Some(at)
    }

    /// The deadline of `key`, if set.
    pub fn get(&self, key: &K) -> Option<Time> {
        self.by_key.get(key).copied()
    }

    /// The earliest deadline, `None` when no timer is set.
    pub fn next_deadline(&self) -> Option<Time> {
        self.by_time.first().map(|(t, _)| *t)
    }

    /// Removes and returns the earliest timer due at or before `now` (earliest first, then in
    /// key order).
    pub fn pop_due(&mut self, now: Time) -> Option<(Time, K)> {
        let (at, _) = self.by_time.first()?;
        if *at > now {
            return None;
        }
        let (at, key) = self.by_time.pop_first()?;
        self.by_key.remove(&key);
        self.debug_check();
        Some((at, key))
    }

    /// How many timers are set.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// True when no timer is set.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Every timer, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, Time)> + '_ {
        self.by_key.iter().map(|(k, t)| (k, *t))
    }

    /// The two indexes describe the same timers.
    fn debug_check(&self) {
        debug_assert_eq!(
            self.by_key.len(),
            self.by_time.len(),
            "timer indexes disagree"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::TimerTable;
    use crate::types::Time;

    fn t(us: u64) -> Time {
        Time::from_micros(us)
    }

    #[test]
    fn a_key_has_one_deadline_and_stopping_it_leaves_none() {
        let mut table = TimerTable::default();
        assert_eq!(table.next_deadline(), None);
        table.set("a", t(10));
        table.set("a", t(30));
        table.set("b", t(20));
        assert_eq!(table.len(), 2);
        assert_eq!(table.next_deadline(), Some(t(20)));
        assert_eq!(table.stop(&"b"), Some(t(20)));
        assert_eq!(table.stop(&"b"), None);
        assert_eq!(table.next_deadline(), Some(t(30)));
        assert_eq!(table.pop_due(t(29)), None);
        assert_eq!(table.pop_due(t(30)), Some((t(30), "a")));
        assert_eq!(table.next_deadline(), None);
        assert!(table.is_empty());
    }

    #[test]
    fn due_timers_pop_in_time_then_key_order() {
        let mut table = TimerTable::default();
        table.set(3, t(5));
        table.set(1, t(5));
        table.set(2, t(1));
        let mut fired = Vec::new();
        while let Some((at, key)) = table.pop_due(t(5)) {
            fired.push((at, key));
        }
        assert_eq!(fired, vec![(t(1), 2), (t(5), 1), (t(5), 3)]);
    }
}
