//! The mill's durable state in SQLite: a schema that mirrors `MillWrite` (M29).
//!
//! Jobs keep their spec (postcard) and latest state (JSON) forever, with a status history, so
//! the HTTP API can answer for terminal jobs; the snapshot loaded at start holds only jobs
//! that have not ended, as `MillSnapshot` wants. Every `Persist` of one driver step is applied
//! in one transaction ([`MillStore::apply`]), which is what makes the group commit atomic.

use std::path::{Path, PathBuf};

use millrace_core::job::{Fingerprint, IdempotencyKey, Identity, JobSpec, JobState};
use millrace_core::mill::{
    AttemptOutcome, CancelRecord, JobRecord, KeyRecord, LeaseRecord, LeaseState, MillBatch,
    MillSnapshot, MillWrite,
};
use millrace_core::{Epoch, JobId, LeaseId, NodeId, Resources, Seqno};
use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use crate::sqlite::{self, to_i64, to_u64, Opened, Schema, StoreError};

/// Schema 1: the first schema.
pub const SCHEMA_V1: &str = r"
        CREATE TABLE counters (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            next_job INTEGER NOT NULL,
            lease_floor INTEGER NOT NULL
        );
        CREATE TABLE jobs (
            id INTEGER PRIMARY KEY,
            spec BLOB NOT NULL,
            submitted_at_ms INTEGER NOT NULL,
            state TEXT NOT NULL,
            state_json TEXT NOT NULL,
            done INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL
        );
        CREATE INDEX jobs_by_state ON jobs (state, id);
        CREATE INDEX jobs_by_done ON jobs (done, id);
        CREATE TABLE job_history (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            job INTEGER NOT NULL,
            state TEXT NOT NULL,
            state_json TEXT NOT NULL,
            at_ms INTEGER NOT NULL
        );
        CREATE INDEX job_history_by_job ON job_history (job, seq);
        CREATE TABLE leases (
            lease INTEGER PRIMARY KEY,
            job INTEGER NOT NULL,
            node TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            state TEXT NOT NULL,
            resources TEXT NOT NULL
        );
        CREATE TABLE cursors (
            node TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            seqno INTEGER NOT NULL,
            PRIMARY KEY (node, epoch)
        );
        CREATE TABLE quota_holds (
            job INTEGER PRIMARY KEY,
            identity TEXT NOT NULL,
            charge TEXT NOT NULL
        );
        CREATE TABLE quarantine (
            node TEXT PRIMARY KEY
        );
    ";

/// Schema 2: a lease keeps the cancel the mill accepted for it (M26, M29), as JSON; NULL
/// when none. Existing leases have none.
pub const SCHEMA_V2: &str = r"
        ALTER TABLE leases ADD COLUMN cancel TEXT;
    ";

/// Schema 3: finished jobs by the time they ended, so that retention (issue 11 item 7)
/// finds the oldest ones without scanning every finished job.
pub const SCHEMA_V3: &str = r"
        CREATE INDEX jobs_done_by_age ON jobs (done, updated_at_ms, id);
    ";

/// Schema 4 (issue 13 items 1 and 6): idempotency keys (M31), each written in its job's
/// insert transaction and deleted in its job's retention transaction; and the encoding of
/// each job's spec (`spec_format`: 1 for specs written before `env` existed, 2 since).
pub const SCHEMA_V4: &str = r"
        CREATE TABLE idem_keys (
            key TEXT PRIMARY KEY,
            fingerprint BLOB NOT NULL,
            job INTEGER NOT NULL
        );
        CREATE INDEX idem_keys_by_job ON idem_keys (job);
        ALTER TABLE jobs ADD COLUMN spec_format INTEGER NOT NULL DEFAULT 1;
    ";

/// Schema 5 (issue 13 item 2, M32): each lease's attempt number (leases written before
/// count as attempt 1), and every attempt of every job: where it ran, when (wall clock of
/// the writes), how it ended and what became of the job (`final`, `retried`,
/// `retried_fenced`, `released`). Deleted with its job by retention.
pub const SCHEMA_V5: &str = r"
        ALTER TABLE leases ADD COLUMN attempt INTEGER NOT NULL DEFAULT 1;
        CREATE TABLE attempts (
            job INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            lease INTEGER NOT NULL,
            node TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            started_at_ms INTEGER NOT NULL,
            ended_at_ms INTEGER,
            status TEXT,
            cause TEXT,
            exit_code INTEGER,
            error TEXT,
            outcome TEXT,
            PRIMARY KEY (job, attempt)
        );
    ";

/// Schema 6 (issue 14, DESIGN §10, I13): the mill's leadership term. A SQLite store belongs
/// to one process at a time (its lock file), so each open takes the next term durably and
/// every mill start writes under a higher term than the last.
pub const SCHEMA_V6: &str = r"
        CREATE TABLE meta (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            term INTEGER NOT NULL
        );
        INSERT INTO meta (id, term) VALUES (1, 0);
    ";

/// Schema 7 (issue 15: fewer pages written per commit, so fewer WAL frames to write and
/// sync on the way from submit to a running job: 12.1 → 9.1 WAL frames for a job's
/// insert with its lease, 8.1 → 6.1 for its start, 11.3 → 10.3 for its end; a state
/// change that is not final no longer names `done`, which took a start from 9.1 to 8.1):
/// - finished jobs by age only index finished jobs (a partial index): a job's insert and
///   its non-final state changes no longer move an entry in it;
/// - `job_history` loses `AUTOINCREMENT`, whose `sqlite_sequence` row was one more page in
///   every commit that adds history. A rowid is still one above the largest, so a job's
///   history keeps its order (the rows of a job are only ever added after its others);
/// - `attempts` is keyed by (job, attempt) itself (`WITHOUT ROWID`), not by a rowid plus an
///   index of the same key.
///
/// Both tables are copied whole, once, when a store of schema 6 is first opened.
pub const SCHEMA_V7: &str = r"
        DROP INDEX jobs_done_by_age;
        CREATE INDEX jobs_done_by_age ON jobs (done, updated_at_ms, id) WHERE done = 1;
        CREATE TABLE job_history_v7 (
            seq INTEGER PRIMARY KEY,
            job INTEGER NOT NULL,
            state TEXT NOT NULL,
            state_json TEXT NOT NULL,
            at_ms INTEGER NOT NULL
        );
        INSERT INTO job_history_v7 (seq, job, state, state_json, at_ms)
            SELECT seq, job, state, state_json, at_ms FROM job_history;
        DROP TABLE job_history;
        ALTER TABLE job_history_v7 RENAME TO job_history;
        CREATE INDEX job_history_by_job ON job_history (job, seq);
        CREATE TABLE attempts_v7 (
            job INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            lease INTEGER NOT NULL,
            node TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            started_at_ms INTEGER NOT NULL,
            ended_at_ms INTEGER,
            status TEXT,
            cause TEXT,
            exit_code INTEGER,
            error TEXT,
            outcome TEXT,
            PRIMARY KEY (job, attempt)
        ) WITHOUT ROWID;
        INSERT INTO attempts_v7 (job, attempt, lease, node, epoch, started_at_ms, ended_at_ms,
                status, cause, exit_code, error, outcome)
            SELECT job, attempt, lease, node, epoch, started_at_ms, ended_at_ms, status, cause,
                exit_code, error, outcome FROM attempts;
        DROP TABLE attempts;
        ALTER TABLE attempts_v7 RENAME TO attempts;
    ";

/// The mill store's schema, by version.
pub const SCHEMA: Schema = Schema {
    kind: "mill",
    file: "mill.db",
    application_id: 0x4d52_4d31,
    migrations: &[
        SCHEMA_V1, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SCHEMA_V5, SCHEMA_V6, SCHEMA_V7,
    ],
    side: crate::syncs::Side::Mill,
};

/// How `attempts.outcome` names an [`AttemptOutcome`].
pub(crate) fn outcome_name(o: AttemptOutcome) -> &'static str {
    match o {
        AttemptOutcome::Final => "final",
        AttemptOutcome::Retried { fenced: false } => "retried",
        AttemptOutcome::Retried { fenced: true } => "retried_fenced",
        AttemptOutcome::Released => "released",
    }
}

/// The `spec_format` new rows are written in: postcard of today's `JobSpec` (3: with
/// `retry`, `priority` and `node`, issue 13 items 2–4).
pub(crate) const SPEC_FORMAT: i64 = 3;

/// A job spec as format 2 encoded it (before `retry`, `priority`, `node`).
#[derive(serde::Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct JobSpecV2 {
    engine: String,
    labels: std::collections::BTreeSet<String>,
    resources: Resources,
    identity: Identity,
    timeout: Option<std::time::Duration>,
    payload: Vec<u8>,
    env: std::collections::BTreeMap<String, String>,
}

impl From<JobSpecV2> for JobSpec {
    fn from(v2: JobSpecV2) -> Self {
        JobSpec {
            engine: v2.engine,
            labels: v2.labels,
            resources: v2.resources,
            identity: v2.identity,
            timeout: v2.timeout,
            payload: v2.payload,
            env: v2.env,
            retry: Default::default(),
            priority: 0,
            node: None,
        }
    }
}

/// A job spec as format 1 encoded it (before `env`), read only to upgrade old rows.
#[derive(serde::Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct JobSpecV1 {
    engine: String,
    labels: std::collections::BTreeSet<String>,
    resources: Resources,
    identity: Identity,
    timeout: Option<std::time::Duration>,
    payload: Vec<u8>,
}

/// Decodes a stored spec of `format`.
fn decode_spec(bytes: &[u8], format: i64) -> Result<JobSpec, String> {
    match format {
        1 => {
            let v1: JobSpecV1 = postcard::from_bytes(bytes).map_err(|e| e.to_string())?;
            Ok(JobSpecV2 {
                engine: v1.engine,
                labels: v1.labels,
                resources: v1.resources,
                identity: v1.identity,
                timeout: v1.timeout,
                payload: v1.payload,
                env: std::collections::BTreeMap::new(),
            }
            .into())
        }
        2 => {
            let v2: JobSpecV2 = postcard::from_bytes(bytes).map_err(|e| e.to_string())?;
            Ok(v2.into())
        }
        SPEC_FORMAT => postcard::from_bytes(bytes).map_err(|e| e.to_string()),
        other => Err(format!(
            "spec format {other} (this build reads 1 to {SPEC_FORMAT})"
        )),
    }
}

/// The SQL that finds the attempts of open jobs, in attempt order.
const LOAD_ATTEMPTS: &str = "SELECT a.job, a.attempt, a.outcome, a.lease, a.node FROM attempts a
     JOIN jobs j ON j.id = a.job WHERE j.done = 0 ORDER BY a.job, a.attempt";

/// A `leases` row as both backends store it.
pub(crate) struct LeaseRow {
    pub lease: i64,
    pub job: i64,
    pub node: String,
    pub epoch: i64,
    pub state: String,
    pub resources: String,
    pub cancel: Option<String>,
    pub attempt: i64,
}

/// Builds a [`MillSnapshot`] from stored rows, the same for every backend (M29); each
/// method answers what is corrupt about its row.
pub(crate) struct SnapshotRows(pub MillSnapshot);

impl SnapshotRows {
    pub fn new(next_job: i64, lease_floor: i64) -> Self {
        SnapshotRows(MillSnapshot {
            next_job: JobId(to_u64(next_job)),
            lease_floor: LeaseId(to_u64(lease_floor)),
            ..MillSnapshot::default()
        })
    }

    pub fn job(
        &mut self,
        id: i64,
        spec: &[u8],
        format: i64,
        at: i64,
        state: &str,
    ) -> Result<(), String> {
        let spec = decode_spec(spec, format).map_err(|e| format!("job {id}: spec: {e}"))?;
        let state: JobState =
            serde_json::from_str(state).map_err(|e| format!("job {id}: state: {e}"))?;
        self.0.jobs.insert(
            JobId(to_u64(id)),
            JobRecord {
                spec,
                submitted_at_ms: to_u64(at),
                state,
            },
        );
        Ok(())
    }

    pub fn lease(&mut self, row: LeaseRow) -> Result<(), String> {
        let lease = row.lease;
        let node = NodeId::new(row.node).map_err(|e| format!("lease {lease}: node: {e}"))?;
        let state = match row.state.as_str() {
            "reserved" => LeaseState::Reserved,
            "running" => LeaseState::Running,
            other => return Err(format!("lease {lease}: state {other:?}")),
        };
        let resources: Resources = serde_json::from_str(&row.resources)
            .map_err(|e| format!("lease {lease}: resources: {e}"))?;
        let cancel: Option<CancelRecord> = row
            .cancel
            .map(|c| serde_json::from_str(&c))
            .transpose()
            .map_err(|e| format!("lease {lease}: cancel: {e}"))?;
        let lease = LeaseId(to_u64(lease));
        self.0.leases.insert(
            lease,
            LeaseRecord {
                lease,
                job: JobId(to_u64(row.job)),
                node,
                epoch: Epoch(to_u64(row.epoch)),
                resources,
                state,
                cancel,
                attempt: u32::try_from(row.attempt).unwrap_or(u32::MAX),
            },
        );
        Ok(())
    }

    /// One attempt row of an open job; rows must come in attempt order.
    pub fn attempt(
        &mut self,
        job: i64,
        attempt: i64,
        outcome: Option<&str>,
        lease: i64,
        node: String,
    ) -> Result<(), String> {
        let tally = self.0.attempts.entry(JobId(to_u64(job))).or_default();
        tally.last = tally.last.max(u32::try_from(attempt).unwrap_or(u32::MAX));
        if matches!(outcome, Some("retried" | "retried_fenced")) {
            tally.retried = tally.retried.saturating_add(1);
        }
        // The latest attempt decides whether a fence is pending.
        tally.fence_pending = outcome == Some("retried_fenced");
        tally.fenced_run = match tally.fence_pending {
            true => Some((
                LeaseId(to_u64(lease)),
                NodeId::new(node).map_err(|e| format!("job {job} attempt: node: {e}"))?,
            )),
            false => None,
        };
        Ok(())
    }

    pub fn cursor(&mut self, node: String, epoch: i64, seqno: i64) -> Result<(), String> {
        let node = NodeId::new(node).map_err(|e| format!("cursor: node: {e}"))?;
        self.0
            .cursors
            .insert((node, Epoch(to_u64(epoch))), Seqno(to_u64(seqno)));
        Ok(())
    }

    pub fn quota_hold(&mut self, job: i64, identity: &str, charge: &str) -> Result<(), String> {
        let identity: Identity = serde_json::from_str(identity)
            .map_err(|e| format!("quota hold {job}: identity: {e}"))?;
        let charge: Resources =
            serde_json::from_str(charge).map_err(|e| format!("quota hold {job}: charge: {e}"))?;
        self.0
            .quota_holds
            .insert(JobId(to_u64(job)), (identity, charge));
        Ok(())
    }

    pub fn quarantined(&mut self, node: String) -> Result<(), String> {
        let node = NodeId::new(node).map_err(|e| format!("quarantine: {e}"))?;
        self.0.quarantined.insert(node);
        Ok(())
    }

    pub fn key(&mut self, key: String, fingerprint: &[u8], job: i64) -> Result<(), String> {
        let key =
            IdempotencyKey::new(key).map_err(|e| format!("idempotency key of job {job}: {e}"))?;
        let fingerprint = <[u8; 32]>::try_from(fingerprint).map_err(|_| {
            format!(
                "idempotency key of job {job}: fingerprint of {} bytes",
                fingerprint.len()
            )
        })?;
        self.0.keys.insert(
            key,
            KeyRecord {
                fingerprint: Fingerprint(fingerprint),
                job: JobId(to_u64(job)),
            },
        );
        Ok(())
    }
}

/// How a stored job row becomes a [`JobRow`] (both backends).
pub(crate) fn job_row(
    id: i64,
    spec: &[u8],
    format: i64,
    at: i64,
    state: &str,
    updated: i64,
) -> Result<JobRow, String> {
    Ok(JobRow {
        id: JobId(to_u64(id)),
        spec: decode_spec(spec, format).map_err(|e| format!("job {id}: spec: {e}"))?,
        submitted_at_ms: to_u64(at),
        state: serde_json::from_str(state).map_err(|e| format!("job {id}: state: {e}"))?,
        updated_at_ms: to_u64(updated),
    })
}

/// What one retention batch deleted from the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Purged {
    /// The finished jobs deleted, oldest first (their log files go next).
    pub jobs: Vec<JobId>,
    /// Their status-history rows.
    pub history_rows: u64,
    /// Their idempotency keys (M31).
    pub keys: u64,
}

/// The mill's store, owned by the mill driver.
pub struct MillStore {
    opened: Opened,
    term: u64,
}

impl MillStore {
    /// Opens (or creates) the store under `dir` and takes the next leadership term, durably
    /// (I13: every start of a mill on this store writes under a higher term than the last).
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let opened = sqlite::open(dir, &SCHEMA)?;
        let term: i64 = opened
            .conn
            .query_row(
                "UPDATE meta SET term = term + 1 WHERE id = 1 RETURNING term",
                [],
                |r| r.get(0),
            )
            .map_err(|source| StoreError::Sqlite {
                path: opened.path.clone(),
                source,
            })?;
        opened.committed();
        Ok(MillStore {
            opened,
            term: to_u64(term),
        })
    }

    /// The leadership term this store was opened under (DESIGN §10).
    pub fn term(&self) -> u64 {
        self.term
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.opened.path
    }

    fn corrupt(&self, reason: String) -> StoreError {
        StoreError::Corrupt {
            path: self.opened.path.clone(),
            reason,
        }
    }

    fn sq(&self) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
        |source| StoreError::Sqlite {
            path: self.opened.path.clone(),
            source,
        }
    }

    /// Everything the mill needs at restart (M29); `None` for a store that holds nothing yet.
    pub fn load(&self) -> Result<Option<MillSnapshot>, StoreError> {
        let conn = &self.opened.conn;
        let counters: Option<(i64, i64)> = conn
            .query_row(
                "SELECT next_job, lease_floor FROM counters WHERE id = 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(self.sq())?;
        let Some((next_job, lease_floor)) = counters else {
            return Ok(None);
        };
        let mut snap = SnapshotRows::new(next_job, lease_floor);
        let mut stmt = conn
            .prepare(
                "SELECT id, spec, submitted_at_ms, state_json, spec_format FROM jobs WHERE done = 0",
            )
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            })
            .map_err(self.sq())?;
        for row in rows {
            let (id, spec, at, state, format) = row.map_err(self.sq())?;
            snap.job(id, &spec, format, at, &state)
                .map_err(|e| self.corrupt(e))?;
        }
        let mut stmt = conn
            .prepare(
                "SELECT lease, job, node, epoch, state, resources, cancel, attempt FROM leases",
            )
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok(LeaseRow {
                    lease: r.get(0)?,
                    job: r.get(1)?,
                    node: r.get(2)?,
                    epoch: r.get(3)?,
                    state: r.get(4)?,
                    resources: r.get(5)?,
                    cancel: r.get(6)?,
                    attempt: r.get(7)?,
                })
            })
            .map_err(self.sq())?;
        for row in rows {
            snap.lease(row.map_err(self.sq())?)
                .map_err(|e| self.corrupt(e))?;
        }
        // M32: where the attempts of each open job stand.
        let mut stmt = conn.prepare(LOAD_ATTEMPTS).map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, Option<String>>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, String>(4)?,
                ))
            })
            .map_err(self.sq())?;
        for row in rows {
            let (job, attempt, outcome, lease, node) = row.map_err(self.sq())?;
            snap.attempt(job, attempt, outcome.as_deref(), lease, node)
                .map_err(|e| self.corrupt(e))?;
        }
        let mut stmt = conn
            .prepare("SELECT node, epoch, seqno FROM cursors")
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .map_err(self.sq())?;
        for row in rows {
            let (node, epoch, seqno) = row.map_err(self.sq())?;
            snap.cursor(node, epoch, seqno)
                .map_err(|e| self.corrupt(e))?;
        }
        let mut stmt = conn
            .prepare("SELECT job, identity, charge FROM quota_holds")
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(self.sq())?;
        for row in rows {
            let (job, identity, charge) = row.map_err(self.sq())?;
            snap.quota_hold(job, &identity, &charge)
                .map_err(|e| self.corrupt(e))?;
        }
        let mut stmt = conn
            .prepare("SELECT node FROM quarantine")
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(self.sq())?;
        for row in rows {
            snap.quarantined(row.map_err(self.sq())?)
                .map_err(|e| self.corrupt(e))?;
        }
        let mut stmt = conn
            .prepare("SELECT key, fingerprint, job FROM idem_keys")
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .map_err(self.sq())?;
        for row in rows {
            let (key, fingerprint, job) = row.map_err(self.sq())?;
            snap.key(key, &fingerprint, job)
                .map_err(|e| self.corrupt(e))?;
        }
        Ok(Some(snap.0))
    }

    /// Applies every batch of one driver step in one transaction (group commit).
    pub fn apply(&mut self, batches: &[MillBatch], now_ms: u64) -> Result<(), StoreError> {
        let path = self.opened.path.clone();
        let sq = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self.opened.conn.transaction().map_err(sq)?;
        for batch in batches {
            for write in &batch.writes {
                apply_write(&tx, write, now_ms).map_err(|e| match e {
                    WriteError::Sql(source) => StoreError::Sqlite {
                        path: path.clone(),
                        source,
                    },
                    WriteError::Encode(reason) => StoreError::Corrupt {
                        path: path.clone(),
                        reason,
                    },
                })?;
            }
        }
        tx.commit().map_err(sq)?;
        self.opened.committed();
        Ok(())
    }

    /// One retention batch (issue 11 item 7), in one transaction: deletes at most `limit`
    /// finished jobs, with their history, that ended before `cutoff_ms` (wall clock) or that
    /// are beyond the `keep` most recently finished. Only rows marked done (a terminal
    /// state) are candidates; `still_open` is asked about each and vetoes any job the mill
    /// still holds (never true for a done row: a terminal is final, I2).
    pub fn purge_finished(
        &mut self,
        cutoff_ms: u64,
        keep: Option<u64>,
        limit: usize,
        still_open: impl Fn(JobId) -> bool,
    ) -> Result<Purged, StoreError> {
        let path = self.opened.path.clone();
        let sq = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self.opened.conn.transaction().map_err(sq)?;
        // Age and count both cut a prefix of the finished jobs in the order they ended: the
        // batch is the longer of the two prefixes, at most `limit` long.
        let threshold: Option<(i64, i64)> = match keep {
            None => None,
            Some(n) => tx
                .prepare_cached(
                    "SELECT updated_at_ms, id FROM jobs WHERE done = 1
                     ORDER BY updated_at_ms DESC, id DESC LIMIT 1 OFFSET ?1",
                )
                .and_then(|mut st| {
                    // Saturating, not `to_i64`'s bit cast: a huge count must not wrap
                    // to a negative OFFSET (which SQLite reads as none, deleting all).
                    let n = i64::try_from(n).unwrap_or(i64::MAX);
                    st.query_row(params![n], |r| Ok((r.get(0)?, r.get(1)?)))
                        .optional()
                })
                .map_err(sq)?,
        };
        let oldest: Vec<(i64, i64)> = tx
            .prepare_cached(
                "SELECT id, updated_at_ms FROM jobs WHERE done = 1
                 ORDER BY updated_at_ms, id LIMIT ?1",
            )
            .and_then(|mut st| {
                st.query_map(params![i64::try_from(limit).unwrap_or(i64::MAX)], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()
            })
            .map_err(sq)?;
        let cutoff = i64::try_from(cutoff_ms).unwrap_or(i64::MAX);
        let mut purged = Purged::default();
        for (id, at) in oldest {
            let old = at < cutoff;
            let excess = threshold.is_some_and(|(t, tid)| (at, id) <= (t, tid));
            if !(old || excess) {
                break;
            }
            let job = JobId(to_u64(id));
            if still_open(job) {
                tracing::warn!(%job, "retention: the store marks the job done but the mill still holds it; kept");
                continue;
            }
            purged.history_rows += tx
                .prepare_cached("DELETE FROM job_history WHERE job = ?1")
                .and_then(|mut st| st.execute(params![id]))
                .map_err(sq)? as u64;
            tx.prepare_cached("DELETE FROM attempts WHERE job = ?1")
                .and_then(|mut st| st.execute(params![id]))
                .map_err(sq)?;
            tx.prepare_cached("DELETE FROM jobs WHERE id = ?1 AND done = 1")
                .and_then(|mut st| st.execute(params![id]))
                .map_err(sq)?;
            // Its idempotency key expires with it, in the same transaction (M31).
            purged.keys += tx
                .prepare_cached("DELETE FROM idem_keys WHERE job = ?1")
                .and_then(|mut st| st.execute(params![id]))
                .map_err(sq)? as u64;
            purged.jobs.push(job);
        }
        tx.commit().map_err(sq)?;
        self.opened.committed();
        Ok(purged)
    }

    /// Checkpoints the WAL and closes the store (clean shutdown).
    pub fn close(self) -> Result<(), StoreError> {
        self.opened.close()
    }
}

enum WriteError {
    Sql(rusqlite::Error),
    Encode(String),
}

impl From<rusqlite::Error> for WriteError {
    fn from(e: rusqlite::Error) -> Self {
        WriteError::Sql(e)
    }
}

fn json<T: Serialize>(v: &T) -> Result<String, WriteError> {
    serde_json::to_string(v).map_err(|e| WriteError::Encode(e.to_string()))
}

fn apply_write(tx: &Connection, write: &MillWrite, now_ms: u64) -> Result<(), WriteError> {
    let now = to_i64(now_ms);
    match write {
        MillWrite::Counters {
            next_job,
            lease_floor,
        } => {
            tx.prepare_cached(
                "INSERT INTO counters (id, next_job, lease_floor) VALUES (1, ?1, ?2)
                 ON CONFLICT (id) DO UPDATE SET
                   next_job = max(next_job, excluded.next_job),
                   lease_floor = max(lease_floor, excluded.lease_floor)",
            )
            .and_then(|mut st| {
                st.execute(params![to_i64(next_job.get()), to_i64(lease_floor.get())])
            })?;
        }
        MillWrite::JobInsert { job, record } => {
            let spec = postcard::to_allocvec(&record.spec)
                .map_err(|e| WriteError::Encode(e.to_string()))?;
            let state = json(&record.state)?;
            tx.prepare_cached(
                "INSERT INTO jobs (id, spec, submitted_at_ms, state, state_json, done, updated_at_ms,
                   spec_format)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)")
                .and_then(|mut st| st.execute(params![
                    to_i64(job.get()),
                    spec,
                    to_i64(record.submitted_at_ms),
                    record.state.name(),
                    state,
                    matches!(record.state, JobState::Done(_)),
                    now,
                    SPEC_FORMAT
                ]))?;
            tx.prepare_cached(
                "INSERT INTO job_history (job, state, state_json, at_ms) VALUES (?1, ?2, ?3, ?4)",
            )
            .and_then(|mut st| {
                st.execute(params![to_i64(job.get()), record.state.name(), state, now])
            })?;
        }
        MillWrite::KeyInsert { key, record } => {
            tx.prepare_cached("INSERT INTO idem_keys (key, fingerprint, job) VALUES (?1, ?2, ?3)")
                .and_then(|mut st| {
                    st.execute(params![
                        key.as_str(),
                        record.fingerprint.0.as_slice(),
                        to_i64(record.job.get())
                    ])
                })?;
        }
        MillWrite::JobState { job, state } => {
            let s = json(state)?;
            // `done` is set only by the final state (a job never leaves it): an UPDATE that
            // names a column rewrites every index holding it, changed or not (schema 7).
            let sql = if matches!(state, JobState::Done(_)) {
                "UPDATE jobs SET state = ?2, state_json = ?3, updated_at_ms = ?4, done = 1
                 WHERE id = ?1"
            } else {
                "UPDATE jobs SET state = ?2, state_json = ?3, updated_at_ms = ?4 WHERE id = ?1"
            };
            tx.prepare_cached(sql)
                .and_then(|mut st| st.execute(params![to_i64(job.get()), state.name(), s, now]))?;
            tx.prepare_cached(
                "INSERT INTO job_history (job, state, state_json, at_ms) VALUES (?1, ?2, ?3, ?4)",
            )
            .and_then(|mut st| st.execute(params![to_i64(job.get()), state.name(), s, now]))?;
        }
        MillWrite::LeaseUpsert(record) => {
            let state = match record.state {
                LeaseState::Reserved => "reserved",
                LeaseState::Running => "running",
            };
            let resources = json(&record.resources)?;
            let cancel = record.cancel.as_ref().map(json).transpose()?;
            tx.prepare_cached(
                "INSERT INTO leases (lease, job, node, epoch, state, resources, cancel, attempt)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                 ON CONFLICT (lease) DO UPDATE SET job = excluded.job, node = excluded.node,
                   epoch = excluded.epoch, state = excluded.state, resources = excluded.resources,
                   cancel = excluded.cancel, attempt = excluded.attempt",
            )
            .and_then(|mut st| {
                st.execute(params![
                    to_i64(record.lease.get()),
                    to_i64(record.job.get()),
                    record.node.as_str(),
                    to_i64(record.epoch.get()),
                    state,
                    resources,
                    cancel,
                    record.attempt
                ])
            })?;
            // The attempt starts with its lease's first write (M32); later upserts of the
            // lease leave it as it was.
            tx.prepare_cached(
                "INSERT OR IGNORE INTO attempts (job, attempt, lease, node, epoch, started_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    to_i64(record.job.get()),
                    record.attempt,
                    to_i64(record.lease.get()),
                    record.node.as_str(),
                    to_i64(record.epoch.get()),
                    now
                ])
            })?;
        }
        MillWrite::Attempt(end) => {
            tx.prepare_cached(
                "UPDATE attempts SET ended_at_ms = ?3, status = ?4, cause = ?5, exit_code = ?6,
                   error = ?7, outcome = ?8
                 WHERE job = ?1 AND attempt = ?2",
            )
            .and_then(|mut st| {
                st.execute(params![
                    to_i64(end.job.get()),
                    end.attempt,
                    now,
                    end.status.map(|s| s.to_string()),
                    end.cause.map(|c| c.name()),
                    end.exit_code,
                    end.error,
                    outcome_name(end.outcome)
                ])
            })?;
        }
        MillWrite::LeaseCancel { lease, cancel } => {
            let cancel = json(cancel)?;
            tx.prepare_cached("UPDATE leases SET cancel = ?2 WHERE lease = ?1")
                .and_then(|mut st| st.execute(params![to_i64(lease.get()), cancel]))?;
        }
        MillWrite::LeaseDelete { lease } => {
            tx.prepare_cached("DELETE FROM leases WHERE lease = ?1")
                .and_then(|mut st| st.execute(params![to_i64(lease.get())]))?;
        }
        MillWrite::Cursor { node, epoch, seqno } => {
            tx.prepare_cached(
                "INSERT INTO cursors (node, epoch, seqno) VALUES (?1, ?2, ?3)
                 ON CONFLICT (node, epoch) DO UPDATE SET seqno = excluded.seqno",
            )
            .and_then(|mut st| {
                st.execute(params![
                    node.as_str(),
                    to_i64(epoch.get()),
                    to_i64(seqno.get())
                ])
            })?;
        }
        MillWrite::CursorDelete { node, epoch } => {
            tx.prepare_cached("DELETE FROM cursors WHERE node = ?1 AND epoch = ?2")
                .and_then(|mut st| st.execute(params![node.as_str(), to_i64(epoch.get())]))?;
        }
        MillWrite::QuotaHold {
            job,
            identity,
            charge,
        } => {
            let (identity, charge) = (json(identity)?, json(charge)?);
            tx.prepare_cached(
                "INSERT INTO quota_holds (job, identity, charge) VALUES (?1, ?2, ?3)
                 ON CONFLICT (job) DO UPDATE SET identity = excluded.identity,
                   charge = excluded.charge",
            )
            .and_then(|mut st| st.execute(params![to_i64(job.get()), identity, charge]))?;
        }
        MillWrite::QuotaRelease { job } => {
            tx.prepare_cached("DELETE FROM quota_holds WHERE job = ?1")
                .and_then(|mut st| st.execute(params![to_i64(job.get())]))?;
        }
        MillWrite::Quarantine { node, quarantined } => {
            if *quarantined {
                tx.prepare_cached("INSERT OR IGNORE INTO quarantine (node) VALUES (?1)")
                    .and_then(|mut st| st.execute(params![node.as_str()]))?;
            } else {
                tx.prepare_cached("DELETE FROM quarantine WHERE node = ?1")
                    .and_then(|mut st| st.execute(params![node.as_str()]))?;
            }
        }
    }
    Ok(())
}

/// One job as the HTTP API shows it.
#[derive(Debug, Clone)]
pub struct JobRow {
    /// The job.
    pub id: JobId,
    /// What was submitted.
    pub spec: JobSpec,
    /// Wall-clock submission time.
    pub submitted_at_ms: u64,
    /// Latest state.
    pub state: JobState,
    /// When it last changed (wall clock).
    pub updated_at_ms: u64,
}

/// A u64 as a decimal string in JSON (read back from a string or a number).
mod u64_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Text(String),
            Number(u64),
        }
        match Either::deserialize(d)? {
            Either::Number(n) => Ok(n),
            Either::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Most attempts `GET /v1/jobs/{id}` lists (the latest ones).
pub const MAX_ATTEMPT_ROWS: i64 = 100;

/// One attempt of a job (M32), as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct AttemptRow {
    /// 1 for the first.
    pub attempt: u32,
    /// Its lease.
    pub lease: u64,
    /// The executor.
    pub node: String,
    /// The executor's store epoch, as a decimal string in JSON like `/v1/nodes` shows it: a
    /// random u64 exceeds what JSON numbers keep exactly in browsers and many clients.
    #[serde(with = "u64_text")]
    #[schema(value_type = String, pattern = "^[0-9]+$")]
    pub epoch: u64,
    /// When its lease was written (ms since the Unix epoch).
    pub started_at_ms: u64,
    /// When it ended, if it has.
    pub ended_at_ms: Option<u64>,
    /// How (`success`, `failed`, …; none when nothing ran).
    pub status: Option<String>,
    /// Why, as a stable name (`executor_lost`, `reported`, …).
    pub cause: Option<String>,
    /// The engine's exit code.
    pub exit_code: Option<i32>,
    /// Human text.
    pub error: Option<String>,
    /// What became of the job: `final`, `retried`, `retried_fenced` or `released`.
    pub outcome: Option<String>,
}

/// One status-history entry.
#[derive(Debug, Clone)]
pub struct HistoryRow {
    /// The state entered.
    pub state: JobState,
    /// When (wall clock).
    pub at_ms: u64,
}

/// Read-only queries for the HTTP API, on their own connection.
pub struct MillReader {
    conn: Connection,
    path: PathBuf,
}

impl MillReader {
    /// Opens a reader on the store file at `path` (the writer must have created it).
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Ok(MillReader {
            conn: sqlite::open_reader(path)?,
            path: path.to_path_buf(),
        })
    }

    fn err(&self, reason: String) -> StoreError {
        StoreError::Corrupt {
            path: self.path.clone(),
            reason,
        }
    }

    fn row(&self, r: RawRow) -> Result<JobRow, StoreError> {
        let (id, spec, at, state, updated, format) = r;
        job_row(id, &spec, format, at, &state, updated).map_err(|e| self.err(e))
    }

    /// One job, if it exists.
    pub fn job(&self, id: JobId) -> Result<Option<JobRow>, StoreError> {
        let raw = self
            .conn
            .query_row(
                &format!("{SELECT_JOB} WHERE id = ?1"),
                params![to_i64(id.get())],
                raw_row,
            )
            .optional()
            .map_err(|source| StoreError::Sqlite {
                path: self.path.clone(),
                source,
            })?;
        raw.map(|r| self.row(r)).transpose()
    }

    /// Whether `id` exists and has ended (a missing job has not).
    pub fn is_done(&self, id: JobId) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached("SELECT done FROM jobs WHERE id = ?1")
            .and_then(|mut s| {
                s.query_row(params![to_i64(id.get())], |r| r.get::<_, i64>(0))
                    .optional()
            })
            .map(|d| d.is_some_and(|d| d != 0))
            .map_err(|source| StoreError::Sqlite {
                path: self.path.clone(),
                source,
            })
    }

    /// A job's status history, oldest first.
    pub fn history(&self, id: JobId) -> Result<Vec<HistoryRow>, StoreError> {
        let sq = |source| StoreError::Sqlite {
            path: self.path.clone(),
            source,
        };
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT state_json, at_ms FROM job_history WHERE job = ?1 ORDER BY seq LIMIT 1000",
            )
            .map_err(sq)?;
        let rows = stmt
            .query_map(params![to_i64(id.get())], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
            })
            .map_err(sq)?;
        let mut out = Vec::new();
        for row in rows {
            let (state, at) = row.map_err(sq)?;
            out.push(HistoryRow {
                state: serde_json::from_str(&state)
                    .map_err(|e| self.err(format!("job {id} history: {e}")))?,
                at_ms: to_u64(at),
            });
        }
        Ok(out)
    }

    /// A job's attempts (M32), oldest first, at most the last [`MAX_ATTEMPT_ROWS`].
    pub fn attempts(&self, id: JobId) -> Result<Vec<AttemptRow>, StoreError> {
        let sq = |source| StoreError::Sqlite {
            path: self.path.clone(),
            source,
        };
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT attempt, lease, node, epoch, started_at_ms, ended_at_ms, status, cause,
                   exit_code, error, outcome
                 FROM attempts WHERE job = ?1 ORDER BY attempt DESC LIMIT ?2",
            )
            .map_err(sq)?;
        let rows = stmt
            .query_map(params![to_i64(id.get()), MAX_ATTEMPT_ROWS], |r| {
                Ok(AttemptRow {
                    attempt: r.get(0)?,
                    lease: to_u64(r.get(1)?),
                    node: r.get(2)?,
                    epoch: to_u64(r.get(3)?),
                    started_at_ms: to_u64(r.get(4)?),
                    ended_at_ms: r.get::<_, Option<i64>>(5)?.map(to_u64),
                    status: r.get(6)?,
                    cause: r.get(7)?,
                    exit_code: r.get(8)?,
                    error: r.get(9)?,
                    outcome: r.get(10)?,
                })
            })
            .map_err(sq)?;
        let mut out = rows.collect::<Result<Vec<_>, _>>().map_err(sq)?;
        out.reverse();
        Ok(out)
    }

    /// Jobs, newest first, optionally of one state name (`queued`, `running`, `success`, …,
    /// or `active` / `done`), only those with ids below `before` when given (the page
    /// cursor of `GET /v1/jobs?after=`). At most `limit`.
    pub fn jobs(
        &self,
        state: Option<&str>,
        before: Option<JobId>,
        limit: usize,
    ) -> Result<Vec<JobRow>, StoreError> {
        let sq = |source| StoreError::Sqlite {
            path: self.path.clone(),
            source,
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // Ids below the cursor; none given means every id (job ids are below i64::MAX).
        let below = before.map_or(i64::MAX, |b| to_i64(b.get()));
        let filter = match state {
            None => "",
            Some("active") => "AND done = 0",
            Some("done") => "AND done = 1",
            Some(_) => "AND state = ?3",
        };
        let sql = format!("{SELECT_JOB} WHERE id < ?2 {filter} ORDER BY id DESC LIMIT ?1");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(sq)?;
        let raw: Vec<RawRow> = match state {
            Some(s) if !matches!(s, "active" | "done") => stmt
                .query_map(params![limit, below, s], raw_row)
                .map_err(sq)?
                .collect::<Result<_, _>>()
                .map_err(sq)?,
            _ => stmt
                .query_map(params![limit, below], raw_row)
                .map_err(sq)?
                .collect::<Result<_, _>>()
                .map_err(sq)?,
        };
        raw.into_iter().map(|r| self.row(r)).collect()
    }
}

/// The columns of a [`JobRow`], in [`raw_row`]'s order.
const SELECT_JOB: &str =
    "SELECT id, spec, submitted_at_ms, state_json, updated_at_ms, spec_format FROM jobs";

type RawRow = (i64, Vec<u8>, i64, String, i64, i64);

fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
    ))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use millrace_core::job::{Terminal, TerminalStatus};
    use std::collections::BTreeSet;

    /// An attempt's epoch (a random u64) reaches JSON as an exact decimal string, and a
    /// string or a number reads back.
    #[test]
    fn an_attempts_epoch_is_exact_text_in_json() {
        let row = AttemptRow {
            attempt: 1,
            lease: 3,
            node: "x1".into(),
            epoch: 18_009_951_171_109_719_617,
            started_at_ms: 1,
            ended_at_ms: None,
            status: None,
            cause: None,
            exit_code: None,
            error: None,
            outcome: None,
        };
        let v = serde_json::to_value(&row).unwrap();
        assert_eq!(v["epoch"], "18009951171109719617");
        assert_eq!(serde_json::from_value::<AttemptRow>(v).unwrap(), row);
        let mut n = serde_json::to_value(&row).unwrap();
        n["epoch"] = serde_json::json!(7u64);
        assert_eq!(serde_json::from_value::<AttemptRow>(n).unwrap().epoch, 7);
    }

    pub(crate) fn spec() -> JobSpec {
        JobSpec {
            retry: Default::default(),
            priority: 0,
            node: None,
            engine: "shell".into(),
            labels: BTreeSet::new(),
            resources: Resources::new(),
            identity: Identity {
                owner: "o".into(),
                repo: "r".into(),
            },
            timeout: None,
            payload: b"echo hi".to_vec(),
            env: Default::default(),
        }
    }

    /// The write sequence every backend's M29 mirror test applies: every kind of write,
    /// with ids beyond i64 (bit-cast) and a job that ends.
    pub(crate) fn m29_batches() -> Vec<MillBatch> {
        let node = NodeId::new("n1").unwrap();
        vec![
            MillBatch {
                writes: vec![
                    MillWrite::Counters {
                        next_job: JobId(3),
                        lease_floor: LeaseId(1025),
                    },
                    MillWrite::JobInsert {
                        job: JobId(1),
                        record: Box::new(JobRecord {
                            spec: spec(),
                            submitted_at_ms: 5,
                            state: JobState::Queued,
                        }),
                    },
                    MillWrite::KeyInsert {
                        key: IdempotencyKey::new("build-1").unwrap(),
                        record: KeyRecord {
                            fingerprint: spec().fingerprint(),
                            job: JobId(1),
                        },
                    },
                    MillWrite::JobInsert {
                        job: JobId(2),
                        record: Box::new(JobRecord {
                            spec: JobSpec {
                                env: [("A".to_string(), "1".to_string())].into(),
                                ..spec()
                            },
                            submitted_at_ms: 6,
                            state: JobState::Queued,
                        }),
                    },
                ],
            },
            MillBatch {
                writes: vec![
                    MillWrite::LeaseUpsert(LeaseRecord {
                        attempt: 1,
                        lease: LeaseId(7),
                        job: JobId(1),
                        node: node.clone(),
                        epoch: Epoch(u64::MAX - 3),
                        resources: Resources::from([("jobs".to_string(), 1)]),
                        state: LeaseState::Running,
                        cancel: None,
                    }),
                    MillWrite::JobState {
                        job: JobId(1),
                        state: JobState::Running {
                            lease: LeaseId(7),
                            node: node.clone(),
                        },
                    },
                    MillWrite::JobState {
                        job: JobId(2),
                        state: JobState::Done(Terminal::by_mill(
                            TerminalStatus::Cancelled,
                            millrace_core::TerminalCause::Cancelled,
                            "x",
                        )),
                    },
                    MillWrite::LeaseCancel {
                        lease: LeaseId(7),
                        cancel: CancelRecord {
                            reason: "job timeout exceeded".into(),
                            status: TerminalStatus::Timeout,
                            cause: millrace_core::TerminalCause::Timeout,
                        },
                    },
                    MillWrite::Cursor {
                        node: node.clone(),
                        epoch: Epoch(u64::MAX - 3),
                        seqno: Seqno(4),
                    },
                    MillWrite::QuotaHold {
                        job: JobId(1),
                        identity: spec().identity,
                        charge: Resources::from([("jobs".to_string(), 1)]),
                    },
                    MillWrite::Quarantine {
                        node: NodeId::new("bad").unwrap(),
                        quarantined: true,
                    },
                ],
            },
            // Job 1's first attempt fails and is retried behind a fence (M32); what it
            // held goes; lower counters change nothing.
            MillBatch {
                writes: vec![
                    MillWrite::Attempt(Box::new(millrace_core::mill::AttemptEnd {
                        job: JobId(1),
                        attempt: 1,
                        lease: LeaseId(7),
                        node: node.clone(),
                        status: Some(TerminalStatus::Failed),
                        cause: Some(millrace_core::TerminalCause::ExecutorLost),
                        exit_code: Some(3),
                        error: Some("lost".into()),
                        outcome: AttemptOutcome::Retried { fenced: true },
                    })),
                    MillWrite::LeaseDelete { lease: LeaseId(7) },
                    MillWrite::QuotaRelease { job: JobId(1) },
                    MillWrite::JobState {
                        job: JobId(1),
                        state: JobState::Queued,
                    },
                    MillWrite::Cursor {
                        node: node.clone(),
                        epoch: Epoch(9),
                        seqno: Seqno(1),
                    },
                    MillWrite::CursorDelete {
                        node: node.clone(),
                        epoch: Epoch(u64::MAX - 3),
                    },
                    MillWrite::Quarantine {
                        node: NodeId::new("bad").unwrap(),
                        quarantined: false,
                    },
                    MillWrite::Quarantine {
                        node: NodeId::new("worse").unwrap(),
                        quarantined: true,
                    },
                    MillWrite::Counters {
                        next_job: JobId(2),
                        lease_floor: LeaseId(2049),
                    },
                ],
            },
        ]
    }

    /// M29 on any backend: `open` gives the same store each time (reopened, as a restart
    /// does); after [`m29_batches`] it loads exactly what `MillSnapshot::apply` holds, and
    /// terminal jobs stay queryable.
    pub(crate) fn check_mirror(open: &mut dyn FnMut() -> crate::store::Store) {
        let batches = m29_batches();
        let mut reference = MillSnapshot::default();
        for b in &batches {
            reference.apply(b);
        }
        assert!(
            reference.attempts[&JobId(1)].fence_pending,
            "the sequence reaches a fenced retry"
        );
        {
            let mut store = open();
            assert_eq!(store.load().unwrap(), None);
            store.apply(&batches, 1).unwrap();
            store.close().unwrap();
        }
        let mut store = open();
        assert_eq!(store.load().unwrap(), Some(reference));
        let mut reader = store.reader().unwrap();
        let done = reader.job(JobId(2)).unwrap().unwrap();
        assert_eq!(done.state.name(), "cancelled");
        assert_eq!(reader.history(JobId(1)).unwrap().len(), 3);
        assert_eq!(reader.jobs(Some("queued"), None, 10).unwrap().len(), 1);
        assert_eq!(reader.jobs(Some("done"), None, 10).unwrap().len(), 1);
        assert_eq!(reader.jobs(None, None, 10).unwrap().len(), 2);
        let attempts = reader.attempts(JobId(1)).unwrap();
        assert_eq!(attempts.len(), 1);
        assert_eq!(attempts[0].outcome.as_deref(), Some("retried_fenced"));
        store.close().unwrap();
    }

    /// The store must hold exactly what `MillSnapshot::apply` holds for the same batches (M29).
    #[test]
    fn m29_store_mirrors_the_reference_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        check_mirror(&mut || crate::store::open_sqlite(dir.path()).unwrap());
    }

    /// Issue 11 item 7: a retention batch deletes finished jobs (and their history) that
    /// ended before the cutoff or beyond the `keep` newest, oldest first, at most `limit`,
    /// and never a job that has not ended.
    #[test]
    fn retention_deletes_only_finished_jobs_oldest_first_within_the_batch() {
        let dir = tempfile::tempdir().unwrap();
        check_retention(crate::store::open_sqlite(dir.path()).unwrap());
    }

    /// The retention behaviour on any backend, on an empty store.
    pub(crate) fn check_retention(mut store: crate::store::Store) {
        let done = JobState::Done(Terminal::by_mill(
            TerminalStatus::Cancelled,
            millrace_core::TerminalCause::Cancelled,
            "x",
        ));
        // Jobs 1..=6 inserted at t=10; 1..=5 end at t=100+id; 6 stays queued.
        let insert = MillBatch {
            writes: std::iter::once(MillWrite::Counters {
                next_job: JobId(7),
                lease_floor: LeaseId(1),
            })
            .chain((1..=6).map(|id| MillWrite::JobInsert {
                job: JobId(id),
                record: Box::new(JobRecord {
                    spec: spec(),
                    submitted_at_ms: 1,
                    state: JobState::Queued,
                }),
            }))
            .collect(),
        };
        store.apply(&[insert], 10).unwrap();
        for id in 1..=5 {
            let end = MillBatch {
                writes: vec![MillWrite::JobState {
                    job: JobId(id),
                    state: done.clone(),
                }],
            };
            store.apply(&[end], 100 + id).unwrap();
        }
        let ids = |p: &Purged| p.jobs.iter().map(|j| j.get()).collect::<Vec<_>>();
        // By age: ended before 103 are jobs 1 and 2; the queued job is older but stays.
        let p = store.purge_finished(103, None, 500, |_| false).unwrap();
        assert_eq!(ids(&p), vec![1, 2]);
        assert_eq!(p.history_rows, 4, "insert and end of each");
        // By count: keep the newest 2 of 3, 4, 5; the batch bound applies first.
        let p = store.purge_finished(0, Some(2), 500, |_| false).unwrap();
        assert_eq!(ids(&p), vec![3]);
        // A job the mill still holds is vetoed.
        let p = store
            .purge_finished(u64::MAX, None, 500, |j| j == JobId(4))
            .unwrap();
        assert_eq!(ids(&p), vec![5]);
        // A count beyond every job keeps them all (no wrap to a negative OFFSET).
        let p = store
            .purge_finished(0, Some(u64::MAX), 500, |_| false)
            .unwrap();
        assert_eq!(ids(&p), Vec::<u64>::new());
        // Job 4's idempotency key goes with it, in the same transaction (M31).
        store
            .apply(
                &[MillBatch {
                    writes: vec![MillWrite::KeyInsert {
                        key: IdempotencyKey::new("k4").unwrap(),
                        record: KeyRecord {
                            fingerprint: spec().fingerprint(),
                            job: JobId(4),
                        },
                    }],
                }],
                200,
            )
            .unwrap();
        let keys = |store: &mut crate::store::Store| store.load().unwrap().unwrap().keys.len();
        assert_eq!(keys(&mut store), 1);
        let p = store.purge_finished(u64::MAX, None, 1, |_| false).unwrap();
        assert_eq!(ids(&p), vec![4]);
        assert_eq!(p.keys, 1, "m31: the key expires with its job");
        assert_eq!(keys(&mut store), 0);
        let mut reader = store.reader().unwrap();
        assert!(reader.job(JobId(4)).unwrap().is_none());
        assert!(reader.history(JobId(4)).unwrap().is_empty());
        assert_eq!(
            reader.job(JobId(6)).unwrap().unwrap().state,
            JobState::Queued
        );
        assert_eq!(
            reader.jobs(None, None, 10).unwrap().len(),
            1,
            "only the queued job is left"
        );
    }

    /// DESIGN §10 on SQLite: the store is one process's, so each open takes the next term
    /// durably, and every mill start writes under a higher term than the last.
    #[test]
    fn sqlite_each_open_takes_a_higher_term() {
        let dir = tempfile::tempdir().unwrap();
        let mut terms = Vec::new();
        for _ in 0..3 {
            // Another test's child process may hold the lock file's descriptor for a moment
            // between its fork and exec (flock follows the open file description).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let store = loop {
                match MillStore::open(dir.path()) {
                    Err(StoreError::Locked { .. }) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_millis(10))
                    }
                    other => break other.unwrap(),
                }
            };
            terms.push(store.term());
            store.close().unwrap();
        }
        assert_eq!(terms, vec![1, 2, 3]);
    }

    /// One job's life as the mill writes it with direct placement (M35): its insert with its
    /// lease and quota, its start, its end.
    fn life(job: u64, node: &NodeId) -> [MillBatch; 3] {
        let (id, lease) = (JobId(job), LeaseId(job));
        let upsert = |state| {
            MillWrite::LeaseUpsert(LeaseRecord {
                attempt: 1,
                lease,
                job: id,
                node: node.clone(),
                epoch: Epoch(9),
                resources: Resources::from([("jobs".to_string(), 1)]),
                state,
                cancel: None,
            })
        };
        let cursor = |seqno| MillWrite::Cursor {
            node: node.clone(),
            epoch: Epoch(9),
            seqno: Seqno(seqno),
        };
        let insert = vec![
            MillWrite::Counters {
                next_job: JobId(job + 1),
                lease_floor: LeaseId((job / 1024 + 1) * 1024),
            },
            MillWrite::JobInsert {
                job: id,
                record: Box::new(JobRecord {
                    spec: spec(),
                    submitted_at_ms: 5,
                    state: JobState::Queued,
                }),
            },
            MillWrite::QuotaHold {
                job: id,
                identity: spec().identity,
                charge: Resources::from([("jobs".to_string(), 1)]),
            },
            upsert(LeaseState::Reserved),
        ];
        let start = vec![
            upsert(LeaseState::Running),
            MillWrite::JobState {
                job: id,
                state: JobState::Running {
                    lease,
                    node: node.clone(),
                },
            },
            cursor(job * 2),
        ];
        let end = vec![
            MillWrite::Attempt(Box::new(millrace_core::mill::AttemptEnd {
                job: id,
                attempt: 1,
                lease,
                node: node.clone(),
                status: Some(TerminalStatus::Success),
                cause: None,
                exit_code: Some(0),
                error: None,
                outcome: AttemptOutcome::Final,
            })),
            MillWrite::LeaseDelete { lease },
            MillWrite::QuotaRelease { job: id },
            MillWrite::JobState {
                job: id,
                state: JobState::Done(Terminal::by_mill(
                    TerminalStatus::Success,
                    millrace_core::TerminalCause::Reported,
                    "",
                )),
            },
            cursor(job * 2 + 1),
        ];
        [insert, start, end].map(|writes| MillBatch { writes })
    }

    /// Issue 15 (schema 7): the pages a commit writes are WAL frames the commit must write
    /// and sync, two of them on the way from a submit to its running job. Over 300 jobs, a
    /// job's insert with its lease writes at most 10 frames on average (9.1; 12.1 on schema
    /// 6), its start at most 7 (6.1; 8.1), its end at most 11 (10.3; 11.3).
    #[test]
    fn issue15_a_jobs_insert_start_and_end_write_few_pages() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = MillStore::open(dir.path()).unwrap();
        let node = NodeId::new("n1").unwrap();
        // Frames in the WAL: a checkpoint right after each commit copies them all, so the
        // next commit starts the WAL again from its first frame.
        let frames = |store: &MillStore| -> i64 {
            store
                .opened
                .conn
                .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1))
                .unwrap()
        };
        frames(&store);
        let mut total = [0i64; 3];
        let jobs = 300;
        for job in 1..=jobs {
            for (i, batch) in life(job, &node).iter().enumerate() {
                store.apply(std::slice::from_ref(batch), job).unwrap();
                total[i] += frames(&store);
            }
        }
        let per = total.map(|t| t as f64 / jobs as f64);
        assert!(
            per[0] <= 10.0 && per[1] <= 7.0 && per[2] <= 11.0,
            "WAL frames per commit (insert, start, end): {per:?}"
        );
        let reader = MillReader::open(store.path()).unwrap();
        assert_eq!(reader.jobs(Some("done"), None, 1000).unwrap().len(), 300);
        assert_eq!(reader.history(JobId(7)).unwrap().len(), 3);
        store.close().unwrap();
    }

    /// Schema 7 copies `job_history` and `attempts`: a schema-6 store keeps every row, a
    /// job's history keeps its order with new rows after the old ones, and retention's
    /// queries use the index of finished jobs by age.
    #[test]
    fn a_schema_6_store_upgrades_to_7_and_keeps_history_and_attempts() {
        let dir = tempfile::tempdir().unwrap();
        let v6 = Schema {
            migrations: &SCHEMA.migrations[..6],
            ..SCHEMA
        };
        let node = NodeId::new("n1").unwrap();
        {
            let opened = sqlite::open(dir.path(), &v6).unwrap();
            let mut store = MillStore { opened, term: 1 };
            for job in 1..=3 {
                let [insert, start, end] = life(job, &node);
                store.apply(&[insert, start], 10 + job).unwrap();
                if job != 2 {
                    store.apply(&[end], 20 + job).unwrap();
                }
            }
            store.close().unwrap();
        }
        let mut store = MillStore::open(dir.path()).unwrap();
        let version: i64 = store
            .opened
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 7);
        let [_, _, end] = life(2, &node);
        store.apply(&[end], 99).unwrap();
        let reader = MillReader::open(store.path()).unwrap();
        let names = |job| -> Vec<&'static str> {
            reader
                .history(JobId(job))
                .unwrap()
                .iter()
                .map(|h| h.state.name())
                .collect()
        };
        assert_eq!(names(1), ["queued", "running", "success"]);
        assert_eq!(names(2), ["queued", "running", "success"], "new after old");
        let attempts = reader.attempts(JobId(3)).unwrap();
        assert_eq!(attempts.len(), 1);
        assert_eq!(attempts[0].outcome.as_deref(), Some("final"));
        for sql in [
            "SELECT updated_at_ms, id FROM jobs WHERE done = 1
             ORDER BY updated_at_ms DESC, id DESC LIMIT 1 OFFSET 1",
            "SELECT id, updated_at_ms FROM jobs WHERE done = 1 ORDER BY updated_at_ms, id LIMIT 5",
        ] {
            let plan: Vec<String> = store
                .opened
                .conn
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .unwrap()
                .query_map([], |r| r.get::<_, String>(3))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert!(
                plan.iter().any(|p| p.contains("jobs_done_by_age"))
                    && !plan.iter().any(|p| p.contains("TEMP B-TREE")),
                "{sql}: {plan:?}"
            );
        }
        store.close().unwrap();
    }

    /// A store written by the first schema (leases without a cancel column) opens, upgrades
    /// in place, and then keeps a lease's cancel across a reopen (M26, M29).
    #[test]
    fn m29_a_schema_1_store_opens_upgrades_and_keeps_cancels() {
        let dir = tempfile::tempdir().unwrap();
        let v1 = Schema {
            migrations: &[SCHEMA_V1],
            ..SCHEMA
        };
        let node = NodeId::new("n1").unwrap();
        let running = JobState::Running {
            lease: LeaseId(7),
            node: node.clone(),
        };
        {
            let opened = sqlite::open(dir.path(), &v1).unwrap();
            let c = &opened.conn;
            c.execute_batch(
                "INSERT INTO counters (id, next_job, lease_floor) VALUES (1, 2, 1025);",
            )
            .unwrap();
            c.execute(
                "INSERT INTO jobs (id, spec, submitted_at_ms, state, state_json, done, updated_at_ms)
                 VALUES (1, ?1, 5, 'running', ?2, 0, 5)",
                params![
                    // As format 1 wrote it: no env.
                    postcard::to_allocvec(&JobSpecV1 {
                        engine: spec().engine,
                        labels: spec().labels,
                        resources: spec().resources,
                        identity: spec().identity,
                        timeout: Some(std::time::Duration::from_secs(9)),
                        payload: spec().payload,
                    })
                    .unwrap(),
                    serde_json::to_string(&running).unwrap()
                ],
            )
            .unwrap();
            c.execute(
                "INSERT INTO leases (lease, job, node, epoch, state, resources)
                 VALUES (7, 1, 'n1', 3, 'running', '{}')",
                [],
            )
            .unwrap();
            opened.close().unwrap();
        }
        let mut store = MillStore::open(dir.path()).unwrap();
        let version: i64 = store
            .opened
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 7, "upgraded in place");
        let mut reference = store.load().unwrap().unwrap();
        let lease = &reference.leases[&LeaseId(7)];
        assert_eq!(lease.cancel, None, "an old lease has no cancel");
        assert_eq!(lease.state, LeaseState::Running);
        assert_eq!(reference.jobs[&JobId(1)].state, running);
        let old = &reference.jobs[&JobId(1)].spec;
        assert_eq!(
            (old.timeout, old.env.len(), old.payload.as_slice()),
            (Some(std::time::Duration::from_secs(9)), 0, &b"echo hi"[..]),
            "a format-1 spec reads back whole, with no env"
        );
        let batch = MillBatch {
            writes: vec![MillWrite::LeaseCancel {
                lease: LeaseId(7),
                cancel: CancelRecord {
                    reason: "stop it".into(),
                    status: TerminalStatus::Cancelled,
                    cause: millrace_core::TerminalCause::Cancelled,
                },
            }],
        };
        reference.apply(&batch);
        store.apply(std::slice::from_ref(&batch), 9).unwrap();
        store.close().unwrap();
        let store = MillStore::open(dir.path()).unwrap();
        let loaded = store.load().unwrap().unwrap();
        assert_eq!(loaded, reference);
        assert_eq!(
            loaded.leases[&LeaseId(7)]
                .cancel
                .as_ref()
                .map(|c| c.reason.as_str()),
            Some("stop it")
        );
    }
}
