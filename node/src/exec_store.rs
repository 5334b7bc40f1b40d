//! The executor's durable state in SQLite: its epoch, outbox, committed jobs with the reason
//! each is being stopped, and the last contact with the mill, mirroring `ExecutorWrite` (E1,
//! E5, E7, E9, E12). The epoch is a random u64 made when the store is created. A store of an
//! older schema is upgraded in place.

use std::path::Path;

use millrace_core::executor::{
    ExecutorBatch, ExecutorSnapshot, ExecutorWrite, StopReason, StoredJob, LOST_CONTACT, RESTARTED,
};
use millrace_core::job::{LogRef, TerminalStatus};
use millrace_core::wire::{EndCause, Event, EventKind, SessionTimers};
use millrace_core::{Epoch, JobId, LeaseId, Resources, Seqno, Term, Time};
use rusqlite::{params, OptionalExtension};
use serde::{Deserialize, Serialize};

use crate::sqlite::{self, to_i64, to_u64, Opened, Schema, StoreError};

/// Schema 1: the first schema.
pub const SCHEMA_V1: &str = r"
        CREATE TABLE meta (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            epoch INTEGER NOT NULL,
            next_seqno INTEGER NOT NULL
        );
        CREATE TABLE outbox (
            seqno INTEGER PRIMARY KEY,
            event BLOB NOT NULL
        );
        CREATE TABLE jobs (
            lease INTEGER PRIMARY KEY,
            job BLOB NOT NULL
        );
    ";

/// Schema 2: a job keeps why it is being stopped (E7, E12), as JSON, NULL while it runs on;
/// outbox events record their encoding: 1 is protocol 1's event (no cause), 2 is
/// protocol 2's (a terminal carries its `EndCause`). Existing rows are format 1.
pub const SCHEMA_V2: &str = r"
        ALTER TABLE jobs ADD COLUMN stop TEXT;
        ALTER TABLE outbox ADD COLUMN format INTEGER NOT NULL DEFAULT 1;
    ";

/// Schema 3: the last time the executor heard the mill (E12), in the node clock's
/// microseconds since the Unix epoch; NULL until the first contact is written (and in a
/// store upgraded from schema 2, whose executor counts from its start, then writes it).
pub const SCHEMA_V3: &str = r"
        ALTER TABLE meta ADD COLUMN last_contact INTEGER;
    ";

/// Schema 4: the timers of the last mill that welcomed this executor (M1, E12), as JSON;
/// NULL until a `Welcome` carried timers other than the executor's flags.
pub const SCHEMA_V4: &str = r"
        ALTER TABLE meta ADD COLUMN timers TEXT;
    ";

/// Schema 5: the highest mill term this executor has seen (E13); 0 until a `Welcome` carried
/// one (every store upgraded from schema 4 has seen none).
pub const SCHEMA_V5: &str = r"
        ALTER TABLE meta ADD COLUMN term INTEGER NOT NULL DEFAULT 0;
    ";

/// The executor store's schema, by version.
pub const SCHEMA: Schema = Schema {
    kind: "executor",
    file: "executor.db",
    application_id: 0x4d52_4531,
    migrations: &[SCHEMA_V1, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SCHEMA_V5],
    side: crate::syncs::Side::Executor,
};

/// The outbox encoding this build writes.
const EVENT_FORMAT: i64 = 2;

/// A job row's blob: the first schema's layout, kept as is (the stop has its own column).
#[derive(Serialize, Deserialize)]
struct JobBlob {
    job: JobId,
    engine: String,
    resources: Resources,
}

/// An outbox event as protocol 1 encoded it (format 1), read only to upgrade a store.
#[derive(Serialize, Deserialize)]
struct EventV1 {
    seqno: Seqno,
    lease: LeaseId,
    kind: EventKindV1,
}

#[derive(Serialize, Deserialize)]
enum EventKindV1 {
    Running,
    Terminal {
        status: TerminalStatus,
        exit_code: Option<i32>,
        error: Option<String>,
        log: Option<LogRef>,
    },
}

impl EventV1 {
    /// The event as this build sends it. Protocol 1 carried the executor's own verdicts only
    /// as text, so the cause is read from the exact texts that build wrote (E9, E12); a
    /// Cancelled status came from a stop asked for (E7); anything else is the engine's.
    fn upgrade(self) -> Event {
        let kind = match self.kind {
            EventKindV1::Running => EventKind::Running,
            EventKindV1::Terminal {
                status,
                exit_code,
                error,
                log,
            } => {
                let cause = match (status, error.as_deref()) {
                    (TerminalStatus::Failed, Some(RESTARTED)) => EndCause::Restarted,
                    (TerminalStatus::Failed, Some(LOST_CONTACT)) => EndCause::LostContact,
                    (TerminalStatus::Cancelled, _) => EndCause::Cancelled,
                    _ => EndCause::Engine,
                };
                EventKind::Terminal {
                    status,
                    exit_code,
                    error,
                    log,
                    cause,
                }
            }
        };
        Event {
            seqno: self.seqno,
            lease: self.lease,
            kind,
        }
    }
}

/// The executor's store, owned by its driver.
pub struct ExecStore {
    opened: Opened,
    /// The connection commits with `synchronous=NORMAL` (the last group needed no sync, E5).
    lazy: bool,
}

impl ExecStore {
    /// Opens the store under `dir`, creating it (with a fresh random epoch) if needed, and
    /// loads what it holds.
    pub fn open(dir: &Path) -> Result<(Self, ExecutorSnapshot), StoreError> {
        let mut store = ExecStore {
            lazy: false,
            opened: sqlite::open(dir, &SCHEMA)?,
        };
        let snap = store.load()?;
        Ok((store, snap))
    }

    fn sq(&self) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
        |source| StoreError::Sqlite {
            path: self.opened.path.clone(),
            source,
        }
    }

    fn corrupt(&self, reason: String) -> StoreError {
        StoreError::Corrupt {
            path: self.opened.path.clone(),
            reason,
        }
    }

    fn load(&mut self) -> Result<ExecutorSnapshot, StoreError> {
        type Meta = (i64, i64, Option<i64>, Option<String>, i64);
        let meta: Option<Meta> = self
            .opened
            .conn
            .query_row(
                "SELECT epoch, next_seqno, last_contact, timers, term FROM meta WHERE id = 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .optional()
            .map_err(self.sq())?;
        let Some((epoch, next_seqno, last_contact, timers, term)) = meta else {
            // A new store is a new epoch (E1).
            let epoch = sqlite::random_u64().map_err(|source| StoreError::Io {
                path: self.opened.path.clone(),
                source,
            })?;
            let snap = ExecutorSnapshot::fresh(Epoch(epoch));
            self.opened
                .conn
                .execute(
                    "INSERT INTO meta (id, epoch, next_seqno) VALUES (1, ?1, ?2)",
                    params![to_i64(epoch), to_i64(snap.next_seqno.get())],
                )
                .map_err(self.sq())?;
            return Ok(snap);
        };
        let mut snap = ExecutorSnapshot::fresh(Epoch(to_u64(epoch)));
        snap.next_seqno = Seqno(to_u64(next_seqno));
        snap.last_contact = last_contact.map(|at| Time::from_micros(to_u64(at)));
        snap.term = Term(to_u64(term));
        if let Some(text) = timers {
            let t: SessionTimers = serde_json::from_str(&text)
                .map_err(|e| self.corrupt(format!("meta.timers {text:?}: {e}")))?;
            if let Some(problem) = t.problem() {
                return Err(self.corrupt(format!("meta.timers {text:?}: {problem}")));
            }
            snap.timers = Some(t);
        }
        let conn = &self.opened.conn;
        let mut stmt = conn
            .prepare("SELECT seqno, event, format FROM outbox ORDER BY seqno")
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .map_err(self.sq())?;
        for row in rows {
            let (seqno, event, format) = row.map_err(self.sq())?;
            let bad = |e: postcard::Error| self.corrupt(format!("outbox event {seqno}: {e}"));
            let event: Event = match format {
                1 => postcard::from_bytes::<EventV1>(&event)
                    .map_err(bad)?
                    .upgrade(),
                EVENT_FORMAT => postcard::from_bytes(&event).map_err(bad)?,
                other => {
                    return Err(self.corrupt(format!(
                    "outbox event {seqno}: format {other} (this build reads 1 and {EVENT_FORMAT})"
                )))
                }
            };
            snap.outbox.push_back(event);
        }
        let mut stmt = conn
            .prepare("SELECT lease, job, stop FROM jobs")
            .map_err(self.sq())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, Option<String>>(2)?,
                ))
            })
            .map_err(self.sq())?;
        for row in rows {
            let (lease, job, stop) = row.map_err(self.sq())?;
            let job: JobBlob = postcard::from_bytes(&job)
                .map_err(|e| self.corrupt(format!("job of lease {lease}: {e}")))?;
            let stop: Option<StopReason> = stop
                .map(|s| serde_json::from_str(&s))
                .transpose()
                .map_err(|e| self.corrupt(format!("job of lease {lease}: stop: {e}")))?;
            let job = StoredJob {
                job: job.job,
                engine: job.engine,
                resources: job.resources,
                stop,
            };
            snap.jobs.insert(LeaseId(to_u64(lease)), job);
        }
        snap.validate().map_err(|e| self.corrupt(e.to_string()))?;
        Ok(snap)
    }

    /// Applies every batch of one driver step in one transaction (group commit).
    pub fn apply(&mut self, batches: &[ExecutorBatch]) -> Result<(), StoreError> {
        let path = self.opened.path.clone();
        let sq = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let enc = |e: postcard::Error| StoreError::Corrupt {
            path: path.clone(),
            reason: format!("encode: {e}"),
        };
        fn json<T: Serialize>(value: &T, path: &std::path::Path) -> Result<String, StoreError> {
            serde_json::to_string(value).map_err(|e| StoreError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("encode: {e}"),
            })
        }
        // E5: a group of only trims and contact marks may be lost to a host crash, so it
        // does not wait for the disk (WAL with synchronous=NORMAL: written in order, synced
        // by the next commit that waits); anything else is synced before the step acts.
        let sync = batches.iter().any(ExecutorBatch::needs_sync);
        if sync == self.lazy {
            let mode = if sync { "FULL" } else { "NORMAL" };
            self.opened
                .conn
                .execute_batch(&format!("PRAGMA synchronous={mode};"))
                .map_err(sq)?;
            self.lazy = !sync;
        }
        let tx = self.opened.conn.transaction().map_err(sq)?;
        for batch in batches {
            for write in &batch.writes {
                match write {
                    ExecutorWrite::Append(event) => {
                        let blob = postcard::to_allocvec(event).map_err(enc)?;
                        tx.prepare_cached(
                            "INSERT OR REPLACE INTO outbox (seqno, event, format)
                             VALUES (?1, ?2, ?3)",
                        )
                        .and_then(|mut st| {
                            st.execute(params![to_i64(event.seqno.get()), blob, EVENT_FORMAT])
                        })
                        .map_err(sq)?;
                        tx.prepare_cached(
                            "UPDATE meta SET next_seqno = max(next_seqno, ?1) WHERE id = 1",
                        )
                        .and_then(|mut st| st.execute(params![to_i64(event.seqno.next().get())]))
                        .map_err(sq)?;
                    }
                    ExecutorWrite::Trim { up_to } => {
                        tx.prepare_cached("DELETE FROM outbox WHERE seqno <= ?1")
                            .and_then(|mut st| st.execute(params![to_i64(up_to.get())]))
                            .map_err(sq)?;
                    }
                    ExecutorWrite::JobCommitted { lease, job } => {
                        let blob = postcard::to_allocvec(&JobBlob {
                            job: job.job,
                            engine: job.engine.clone(),
                            resources: job.resources.clone(),
                        })
                        .map_err(enc)?;
                        let stop = job.stop.as_ref().map(|s| json(s, &path)).transpose()?;
                        tx.prepare_cached(
                            "INSERT OR REPLACE INTO jobs (lease, job, stop) VALUES (?1, ?2, ?3)",
                        )
                        .and_then(|mut st| st.execute(params![to_i64(lease.get()), blob, stop]))
                        .map_err(sq)?;
                    }
                    ExecutorWrite::JobStopping { lease, stop } => {
                        let stop = json(stop, &path)?;
                        tx.prepare_cached("UPDATE jobs SET stop = ?2 WHERE lease = ?1")
                            .and_then(|mut st| st.execute(params![to_i64(lease.get()), stop]))
                            .map_err(sq)?;
                    }
                    ExecutorWrite::JobEnded { lease } => {
                        tx.prepare_cached("DELETE FROM jobs WHERE lease = ?1")
                            .and_then(|mut st| st.execute(params![to_i64(lease.get())]))
                            .map_err(sq)?;
                    }
                    ExecutorWrite::Contact { at } => {
                        tx.prepare_cached("UPDATE meta SET last_contact = ?1 WHERE id = 1")
                            .and_then(|mut st| st.execute(params![to_i64(at.as_micros())]))
                            .map_err(sq)?;
                    }
                    ExecutorWrite::Term(t) => {
                        // Only ever up (E13), whatever order batches came in.
                        tx.prepare_cached("UPDATE meta SET term = max(term, ?1) WHERE id = 1")
                            .and_then(|mut st| st.execute(params![to_i64(t.get())]))
                            .map_err(sq)?;
                    }
                    ExecutorWrite::Timers(t) => {
                        let text = json(t, &path)?;
                        tx.prepare_cached("UPDATE meta SET timers = ?1 WHERE id = 1")
                            .and_then(|mut st| st.execute(params![text]))
                            .map_err(sq)?;
                    }
                }
            }
        }
        tx.commit().map_err(sq)?;
        if sync {
            self.opened.committed();
        }
        Ok(())
    }

    /// Checkpoints the WAL and closes the store.
    pub fn close(self) -> Result<(), StoreError> {
        self.opened.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use millrace_core::job::TerminalStatus;
    use millrace_core::wire::EventKind;
    use millrace_core::{JobId, Resources};
    use std::time::Duration;

    #[test]
    fn e1_a_new_store_gets_an_epoch_that_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let (store, first) = ExecStore::open(dir.path()).unwrap();
        store.close().unwrap();
        let (_store, again) = ExecStore::open(dir.path()).unwrap();
        assert_eq!(first.epoch, again.epoch);
        let other = tempfile::tempdir().unwrap();
        let (_s, wiped) = ExecStore::open(other.path()).unwrap();
        assert_ne!(wiped.epoch, first.epoch);
    }

    #[test]
    fn e5_store_mirrors_the_reference_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, fresh) = ExecStore::open(dir.path()).unwrap();
        let mut reference = fresh.clone();
        let ev = |n: u64, kind: EventKind| Event {
            seqno: Seqno(n),
            lease: LeaseId(9),
            kind,
        };
        let batches = vec![
            ExecutorBatch {
                writes: vec![
                    ExecutorWrite::JobCommitted {
                        lease: LeaseId(9),
                        job: StoredJob {
                            job: JobId(1),
                            engine: "shell".into(),
                            resources: Resources::new(),
                            stop: None,
                        },
                    },
                    ExecutorWrite::Append(ev(1, EventKind::Running)),
                    ExecutorWrite::Contact {
                        at: Time::from_micros(1_754_000_000_000_000),
                    },
                    ExecutorWrite::Term(Term(3)),
                ],
            },
            ExecutorBatch {
                writes: vec![
                    ExecutorWrite::Append(ev(
                        2,
                        EventKind::Terminal {
                            status: TerminalStatus::Success,
                            exit_code: Some(0),
                            error: None,
                            log: None,
                            cause: EndCause::Engine,
                        },
                    )),
                    ExecutorWrite::JobEnded { lease: LeaseId(9) },
                    ExecutorWrite::Trim { up_to: Seqno(1) },
                    ExecutorWrite::Contact {
                        at: Time::from_micros(1_754_000_005_000_000),
                    },
                    ExecutorWrite::Timers(SessionTimers {
                        silence_timeout: Duration::from_secs(4),
                        snapshot_interval: Duration::from_millis(1500),
                        reconnect_grace: Duration::from_secs(20),
                    }),
                    ExecutorWrite::Term(Term(5)),
                ],
            },
        ];
        for b in &batches {
            reference.apply(b);
        }
        store.apply(&batches).unwrap();
        store.close().unwrap();
        let (_store, loaded) = ExecStore::open(dir.path()).unwrap();
        assert_eq!(loaded, reference);
        assert_eq!(
            loaded.last_contact,
            Some(Time::from_micros(1_754_000_005_000_000)),
            "the last contact written wins (E12)"
        );
        assert_eq!(
            loaded.timers.map(|t| t.reconnect_grace),
            Some(Duration::from_secs(20)),
            "the adopted timers survive a restart (M1, E12)"
        );
        assert_eq!(loaded.term, Term(5), "the highest term seen survives (E13)");
    }

    /// A store written by the first schema (protocol 1 events, no stop column, no last
    /// contact) opens, upgrades in place through every migration, and reads as this build
    /// would have written it (E5, E9, E12).
    #[test]
    fn e9_a_schema_1_store_opens_and_upgrades() {
        let dir = tempfile::tempdir().unwrap();
        let v1 = Schema {
            migrations: &[SCHEMA_V1],
            ..SCHEMA
        };
        let old = |seqno: u64, error: Option<&str>| EventV1 {
            seqno: Seqno(seqno),
            lease: LeaseId(seqno),
            kind: EventKindV1::Terminal {
                status: TerminalStatus::Failed,
                exit_code: None,
                error: error.map(str::to_string),
                log: None,
            },
        };
        {
            let opened = sqlite::open(dir.path(), &v1).unwrap();
            let c = &opened.conn;
            c.execute(
                "INSERT INTO meta (id, epoch, next_seqno) VALUES (1, ?1, 4)",
                params![to_i64(77)],
            )
            .unwrap();
            for (seqno, error) in [(1, Some(RESTARTED)), (2, Some(LOST_CONTACT)), (3, None)] {
                let blob = postcard::to_allocvec(&old(seqno, error)).unwrap();
                c.execute(
                    "INSERT INTO outbox (seqno, event) VALUES (?1, ?2)",
                    params![to_i64(seqno), blob],
                )
                .unwrap();
            }
            let job = postcard::to_allocvec(&JobBlob {
                job: JobId(5),
                engine: "shell".into(),
                resources: Resources::new(),
            })
            .unwrap();
            c.execute("INSERT INTO jobs (lease, job) VALUES (9, ?1)", params![job])
                .unwrap();
            let version: i64 = c
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .unwrap();
            assert_eq!(version, 1);
            opened.close().unwrap();
        }
        let (mut store, loaded) = ExecStore::open(dir.path()).unwrap();
        let version: i64 = store
            .opened
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 5, "upgraded in place");
        assert_eq!(loaded.epoch, Epoch(77));
        assert_eq!(loaded.term, Term(0), "no mill term was ever seen (E13)");
        assert_eq!(loaded.last_contact, None, "no contact was ever written");
        assert_eq!(loaded.timers, None, "no mill timers were ever adopted");
        let causes: Vec<EndCause> = loaded
            .outbox
            .iter()
            .map(|e| match &e.kind {
                EventKind::Terminal { cause, .. } => *cause,
                EventKind::Running => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(
            causes,
            [EndCause::Restarted, EndCause::LostContact, EndCause::Engine]
        );
        let job = &loaded.jobs[&LeaseId(9)];
        assert_eq!((job.job, job.stop.clone()), (JobId(5), None));
        // New writes land beside the old rows and read back in order.
        let mut reference = loaded.clone();
        let batch = ExecutorBatch {
            writes: vec![
                ExecutorWrite::JobStopping {
                    lease: LeaseId(9),
                    stop: StopReason::Cancel("by alice".into()),
                },
                ExecutorWrite::Append(Event {
                    seqno: Seqno(4),
                    lease: LeaseId(9),
                    kind: EventKind::Running,
                }),
                ExecutorWrite::Contact {
                    at: Time::from_micros(1_754_000_000_000_000),
                },
            ],
        };
        reference.apply(&batch);
        store.apply(std::slice::from_ref(&batch)).unwrap();
        store.close().unwrap();
        let (_store, again) = ExecStore::open(dir.path()).unwrap();
        assert_eq!(again, reference);
        assert_eq!(
            again.jobs[&LeaseId(9)].stop,
            Some(StopReason::Cancel("by alice".into()))
        );
        assert_eq!(
            again.last_contact,
            Some(Time::from_micros(1_754_000_000_000_000))
        );
    }
}
