//! Idempotency keys (M31): which job each client key created, and with which spec.
//!
//! The mill decides "new job or existing one" in the same step that would insert the job,
//! so two submits under one key can never both create a job, and the key is persisted in the
//! job's insert batch (M29: a crash keeps both or neither). Keys of finished jobs are kept
//! until the driver's retention deletes those jobs (it deletes their keys in the same store
//! transaction and tells the mill with [`super::Mill::forget_keys_of`]).

use std::collections::BTreeMap;

use super::KeyRecord;
use crate::job::IdempotencyKey;
use crate::types::JobId;

/// Keys by key, and by job for retention.
#[derive(Debug, Default)]
pub(super) struct Keys {
    by_key: BTreeMap<IdempotencyKey, KeyRecord>,
    by_job: BTreeMap<JobId, IdempotencyKey>,
}

impl Keys {
    pub(super) fn get(&self, key: &IdempotencyKey) -> Option<&KeyRecord> {
        self.by_key.get(key)
    }

    pub(super) fn insert(&mut self, key: IdempotencyKey, record: KeyRecord) {
        if let Some(old) = self.by_key.insert(key.clone(), record) {
            self.by_job.remove(&old.job);
        }
        self.by_job.insert(record.job, key);
        debug_assert_eq!(self.by_key.len(), self.by_job.len(), "M31: one key per job");
    }

    pub(super) fn forget_job(&mut self, job: JobId) {
        if let Some(key) = self.by_job.remove(&job) {
            self.by_key.remove(&key);
        }
    }

    /// Every key, for the store audit.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&IdempotencyKey, &KeyRecord)> + '_ {
        self.by_key.iter()
    }

    pub(super) fn len(&self) -> usize {
        self.by_key.len()
    }
}
