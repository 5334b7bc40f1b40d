//! M31: idempotent submit. Same key and spec → the same job, nothing stored; same key and
//! another spec → a conflict naming the key; keys survive restarts (M29) and expire with
//! their jobs' retention.

use super::*;
use crate::job::IdempotencyKey;

fn key(s: &str) -> IdempotencyKey {
    IdempotencyKey::new(s).unwrap()
}

impl H {
    fn submit_keyed(&mut self, spec: JobSpec, k: &str) -> Result<Submitted, RequestError> {
        let r = self.mill.submit_keyed(self.now, spec, 0, Some(key(k)));
        self.drain();
        r
    }
}

#[test]
fn m31_same_key_and_spec_answers_the_same_job_and_stores_nothing() {
    let mut h = H::new();
    let first = h.submit_keyed(spec(), "build-1").unwrap();
    assert!(first.created);
    let writes = h.writes();
    let insert = writes
        .iter()
        .position(|w| matches!(w, MillWrite::JobInsert { job, .. } if *job == first.job))
        .expect("the job is inserted");
    assert!(
        matches!(&writes[insert + 1], MillWrite::KeyInsert { key: k, record }
            if k.as_str() == "build-1" && record.job == first.job
                && record.fingerprint == spec().fingerprint()),
        "the key follows its job's insert in the same batch: {writes:?}"
    );
    let again = h.submit_keyed(spec(), "build-1").unwrap();
    assert_eq!(
        again,
        Submitted {
            job: first.job,
            created: false
        }
    );
    assert!(h.out.is_empty(), "nothing stored or emitted: {:?}", h.out);
    assert_eq!(h.mill.pending(), 1, "one job, not two");
}

#[test]
fn m31_same_key_with_another_spec_is_a_conflict_naming_the_key() {
    let mut h = H::new();
    let first = h.submit_keyed(spec(), "build-1").unwrap();
    let mut other = spec();
    other.payload = b"rm -rf /".to_vec();
    let e = h.submit_keyed(other, "build-1").unwrap_err();
    assert_eq!(
        e,
        RequestError::KeyConflict {
            key: key("build-1"),
            job: first.job
        }
    );
    assert!(e.to_string().contains("build-1"), "{e}");
    assert!(h.out.is_empty(), "a refusal stores nothing: {:?}", h.out);
    // Another key is independent; no key at all always makes a new job.
    assert!(h.submit_keyed(spec(), "build-2").unwrap().created);
    assert_ne!(h.submit_req(spec()).unwrap(), first.job);
    assert_eq!(h.mill.pending(), 3);
}

#[test]
fn m31_a_retry_of_an_accepted_job_succeeds_even_when_the_queue_is_full() {
    let mut h = H::with(MillConfig {
        max_pending: 1,
        ..config()
    });
    let first = h.submit_keyed(spec(), "k").unwrap();
    assert!(matches!(
        h.submit_req(spec()),
        Err(RequestError::TooManyPending { .. })
    ));
    assert_eq!(h.submit_keyed(spec(), "k").unwrap().job, first.job);
}

#[test]
fn m31_keys_survive_a_restart_and_still_map_after_the_job_ended() {
    let mut h = H::new();
    let first = h.submit_keyed(spec(), "k1").unwrap();
    let ended = h.submit_keyed(spec(), "k2").unwrap();
    h.cancel_req(ended.job, "no".into()).unwrap();
    assert!(h.ended(ended.job).is_some());
    h.restart();
    assert_eq!(h.mill.key_job(&key("k1")), Some(first.job));
    assert_eq!(
        h.submit_keyed(spec(), "k1").unwrap(),
        Submitted {
            job: first.job,
            created: false
        }
    );
    // A finished job's key still answers it (until retention), and conflicts still do.
    assert_eq!(h.submit_keyed(spec(), "k2").unwrap().job, ended.job);
    let mut other = spec();
    other.labels.insert("gpu".into());
    assert!(matches!(
        h.submit_keyed(other, "k2"),
        Err(RequestError::KeyConflict { .. })
    ));
    assert_eq!(h.mill.pending(), 1, "only k1's job is active");
}

#[test]
fn m31_retention_forgets_keys_of_deleted_jobs_only() {
    let mut h = H::new();
    let active = h.submit_keyed(spec(), "active").unwrap();
    let done = h.submit_keyed(spec(), "done").unwrap();
    h.cancel_req(done.job, "no".into()).unwrap();
    // The driver's retention deleted the finished job (and its key row) from the store.
    h.store
        .forget_keys_of(&std::collections::BTreeSet::from([done.job]));
    h.mill.forget_keys_of(&[done.job, active.job]);
    assert_eq!(h.mill.key_job(&key("done")), None);
    assert_eq!(
        h.mill.key_job(&key("active")),
        Some(active.job),
        "an active job keeps its key"
    );
    let again = h.submit_keyed(spec(), "done").unwrap();
    assert!(again.created, "an expired key makes a new job");
    assert_ne!(again.job, done.job);
    h.restart();
    assert_eq!(h.mill.key_job(&key("done")), Some(again.job));
}

#[test]
fn m31_an_invalid_spec_is_refused_before_its_key_is_looked_at() {
    let mut h = H::new();
    h.submit_keyed(spec(), "k").unwrap();
    let mut bad = spec();
    bad.engine.clear();
    assert!(matches!(
        h.submit_keyed(bad, "k"),
        Err(RequestError::Spec(_))
    ));
}
