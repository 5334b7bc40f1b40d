//! Opening a store: one SQLite file under a data directory, owned by one live process,
//! in WAL mode with `synchronous=FULL`, migrated by versioned steps.
//!
//! Start refuses, naming the path and the reason, a store written by a newer version, a
//! corrupt store, a file that is not a millrace store of this kind, and a store another live
//! process holds (an OS lock on `<file>.lock`, released by the kernel when that process dies).

use std::fs::File;
use std::path::{Path, PathBuf};

use rusqlite::Connection;

/// Why a store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another live process holds the store.
    #[error("store {path} is held by another live process (lock file {lock}); stop it or use another --data directory")]
    Locked {
        /// The database file.
        path: PathBuf,
        /// The lock file.
        lock: PathBuf,
    },
    /// A newer millrace wrote the store.
    #[error("store {path} has schema version {found}, newer than the {known} this build knows; run a newer millrace or use another --data directory")]
    Newer {
        /// The database file.
        path: PathBuf,
        /// Its `user_version`.
        found: i64,
        /// The newest this build knows.
        known: i64,
    },
    /// The file is damaged or not a database.
    #[error("store {path} is corrupt: {reason}")]
    Corrupt {
        /// The database file.
        path: PathBuf,
        /// What SQLite or the loader reported.
        reason: String,
    },
    /// The file is a database, but not a millrace store of this kind.
    #[error("store {path} is not a millrace {kind} store (application_id {found:#x})")]
    Foreign {
        /// The database file.
        path: PathBuf,
        /// `mill` or `executor`.
        kind: &'static str,
        /// Its `application_id`.
        found: i64,
    },
    /// A file system operation failed.
    #[error("store {path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// SQLite failed.
    #[error("store {path}: {source}")]
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// The error.
        source: rusqlite::Error,
    },
    /// `--store` is not a store this build knows.
    #[error("--store {given:?}: {reason} (expected sqlite:DIR or postgres://USER@HOST:PORT/DB)")]
    BadLocation {
        /// What was given, with any password removed.
        given: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The PostgreSQL server could not be reached or refused the connection.
    #[error("cannot reach the PostgreSQL store {target}: {reason}")]
    Unreachable {
        /// `user@host:port/db`, never the password.
        target: String,
        /// The client's error with its causes (`error connecting to server: Connection
        /// refused`).
        reason: String,
    },
    /// A PostgreSQL statement failed.
    #[error("PostgreSQL store {target}: {}", pg_detail(source))]
    Postgres {
        /// `user@host:port/db`, never the password.
        target: String,
        /// The client's error.
        source: postgres::Error,
    },
    /// The PostgreSQL database holds something that is not a millrace mill store; nothing
    /// was changed.
    #[error("PostgreSQL database {target} is not a millrace mill store ({reason}); refusing to touch it: use an empty database")]
    ForeignDatabase {
        /// `user@host:port/db`.
        target: String,
        /// What was found.
        reason: String,
    },
    /// A newer millrace wrote the PostgreSQL store.
    #[error("PostgreSQL store {target} has schema version {found}, newer than the {known} this build knows; run a newer millrace")]
    NewerDatabase {
        /// `user@host:port/db`.
        target: String,
        /// Its `millrace_schema_version.version`.
        found: i64,
        /// The newest this build knows.
        known: i64,
    },
    /// The store's leadership term moved on (DESIGN §10, I13): this mill was deposed, and the
    /// write was rolled back.
    #[error("deposed: this mill writes under term {held}, but the store's leader term is {}", current.map_or_else(|| "unset".to_string(), |c| c.to_string()))]
    Deposed {
        /// The term the store was opened under.
        held: u64,
        /// The term in the store now (`None`: no leader row).
        current: Option<u64>,
    },
    /// Another mill holds the leadership of the PostgreSQL store.
    #[error("another mill leads store {target}: {holder} at {address} (term {term}, lease ends in {expires_in:?}); start this one when it stops or its lease expires")]
    NotLeader {
        /// `user@host:port/db`.
        target: String,
        /// The leader's name.
        holder: String,
        /// Where it listens.
        address: String,
        /// Its term.
        term: u64,
        /// Until its lease runs out.
        expires_in: std::time::Duration,
    },
}

/// What kind of store, its file name and schema.
pub struct Schema {
    /// `mill` or `executor`, for messages.
    pub kind: &'static str,
    /// The file under the data directory.
    pub file: &'static str,
    /// SQLite `application_id` marking the kind.
    pub application_id: i64,
    /// Migration `i` takes the schema from version `i` to `i + 1`.
    pub migrations: &'static [&'static str],
    /// Whose syncs its commits are (issue 15 item 4).
    pub side: crate::syncs::Side,
}

/// Checkpoints the WAL from its own connection and thread, so that the writer's commits
/// never pay for a checkpoint (the writer's automatic checkpoints are off).
pub struct Checkpointer {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How often the WAL is checkpointed.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

impl Checkpointer {
    #[cfg_attr(madsim, allow(dead_code))]
    fn start(path: &Path, side: crate::syncs::Side) -> Result<Self, StoreError> {
        let conn = Connection::open(path).map_err(|source| StoreError::Sqlite {
            path: path.to_path_buf(),
            source,
        })?;
        let (stop, rx) = std::sync::mpsc::channel::<()>();
        let shown = path.display().to_string();
        let thread = std::thread::Builder::new()
            .name("wal-checkpoint".into())
            .spawn(move || {
                let _ = conn.execute_batch("PRAGMA busy_timeout=1000;");
                // (frames in the WAL, frames checkpointed) after the last checkpoint: both
                // columns are totals for the current WAL, so only growth means copying.
                let mut last = (0i64, 0i64);
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    rx.recv_timeout(CHECKPOINT_EVERY)
                {
                    let row = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
                        Ok((r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
                    });
                    match row {
                        Ok(now) => {
                            // A WAL that restarted from its start counts from zero again.
                            let copied = if now.0 < last.0 || now.1 < last.1 {
                                now.1
                            } else {
                                now.1 - last.1
                            };
                            if copied > 0 {
                                // Copying frames syncs the WAL, then the database file.
                                crate::syncs::add(side, 2);
                            }
                            last = now;
                        }
                        Err(e) => {
                            tracing::warn!(store = %shown, error = %e, "WAL checkpoint failed");
                        }
                    }
                }
            })
            .map_err(|source| StoreError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Checkpointer {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An open store: the connection and the lock that keeps other processes out.
pub struct Opened {
    /// The write connection.
    pub conn: Connection,
    /// Checkpoints the WAL off the commit path; stop it before the final checkpoint.
    pub checkpointer: Option<Checkpointer>,
    /// Held for the life of the store.
    pub lock: File,
    /// The database file.
    pub path: PathBuf,
    /// Whose syncs its commits are.
    pub side: crate::syncs::Side,
}

impl Opened {
    /// Counts the WAL sync of one committed write transaction.
    pub fn committed(&self) {
        crate::syncs::add(self.side, 1);
    }

    /// Stops the checkpointer, checkpoints the WAL and closes the connection; the lock goes
    /// last, so no other process opens the store before it is clean.
    pub fn close(mut self) -> Result<(), StoreError> {
        drop(self.checkpointer.take());
        let path = self.path.clone();
        self.conn
            .execute_batch("PRAGMA wal_checkpoint(TRUNCATE);")
            .map_err(|source| StoreError::Sqlite {
                path: path.clone(),
                source,
            })?;
        self.conn
            .close()
            .map_err(|(_, source)| StoreError::Sqlite { path, source })?;
        drop(self.lock);
        Ok(())
    }
}

/// Opens (creating if needed) the store of `schema` under `dir`.
pub fn open(dir: &Path, schema: &Schema) -> Result<Opened, StoreError> {
    std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(schema.file);
    let lock_path = dir.join(format!("{}.lock", schema.file));
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|source| StoreError::Io {
            path: lock_path.clone(),
            source,
        })?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StoreError::Locked {
                path,
                lock: lock_path,
            })
        }
        Err(std::fs::TryLockError::Error(source)) => {
            return Err(StoreError::Io {
                path: lock_path,
                source,
            })
        }
    }
    let created = !path.exists();
    let sq = |source| StoreError::Sqlite {
        path: path.clone(),
        source,
    };
    let conn = Connection::open(&path).map_err(sq)?;
    // The first read tells a damaged or foreign file apart from a database.
    let app_id: i64 = conn
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(|e| corrupt_or(&path, e))?;
    let check: String = conn
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(|e| corrupt_or(&path, e))?;
    if check != "ok" {
        return Err(StoreError::Corrupt {
            path,
            reason: check,
        });
    }
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(sq)?;
    let known = i64::try_from(schema.migrations.len()).unwrap_or(i64::MAX);
    if app_id != schema.application_id && (app_id != 0 || version != 0) {
        return Err(StoreError::Foreign {
            path,
            kind: schema.kind,
            found: app_id,
        });
    }
    if version > known {
        return Err(StoreError::Newer {
            path,
            found: version,
            known,
        });
    }
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(sq)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Corrupt {
            path,
            reason: format!("could not switch to WAL (journal_mode is {mode})"),
        });
    }
    conn.execute_batch(
        "PRAGMA synchronous=FULL; PRAGMA busy_timeout=5000; PRAGMA wal_autocheckpoint=0;",
    )
    .map_err(sq)?;
    let mut conn = conn;
    for (from, sql) in schema.migrations.iter().enumerate() {
        let from = i64::try_from(from).unwrap_or(i64::MAX);
        if from < version {
            continue;
        }
        let tx = conn.transaction().map_err(sq)?;
        tx.execute_batch(sql).map_err(sq)?;
        tx.execute_batch(&format!(
            "PRAGMA application_id={}; PRAGMA user_version={};",
            schema.application_id,
            from + 1
        ))
        .map_err(sq)?;
        tx.commit().map_err(sq)?;
    }
    if created {
        tracing::info!(store = %path.display(), kind = schema.kind, "created a new store");
    }
    // Under madsim (issue 16) no system thread may start: the WAL is checkpointed at close
    // only, which a simulated run's few thousand commits never miss.
    #[cfg(not(madsim))]
    let checkpointer = Some(Checkpointer::start(&path, schema.side)?);
    #[cfg(madsim)]
    let checkpointer = None;
    Ok(Opened {
        conn,
        checkpointer,
        lock,
        path,
        side: schema.side,
    })
}

/// Opens a read-only connection to an open store (for queries beside the writer; WAL lets
/// readers see every committed transaction without blocking it).
pub fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|source| StoreError::Sqlite {
        path: path.to_path_buf(),
        source,
    })?;
    conn.execute_batch("PRAGMA busy_timeout=5000;")
        .map_err(|source| StoreError::Sqlite {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(conn)
}

fn corrupt_or(path: &Path, e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) | Some(rusqlite::ErrorCode::DatabaseCorrupt) => {
            StoreError::Corrupt {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }
        }
        _ => StoreError::Sqlite {
            path: path.to_path_buf(),
            source: e,
        },
    }
}

/// SQLite integers are i64; ids and epochs are u64. Stored bit for bit.
pub fn to_i64(v: u64) -> i64 {
    i64::from_ne_bytes(v.to_ne_bytes())
}

/// The inverse of [`to_i64`].
pub fn to_u64(v: i64) -> u64 {
    u64::from_ne_bytes(v.to_ne_bytes())
}

/// Eight random bytes from the OS, for epochs, tokens and backoff seeds.
pub fn random_u64() -> std::io::Result<u64> {
    // Under madsim (issue 16) from the seed: the getrandom crate reaches the OS past
    // madsim's interposition, and epochs and backoff seeds must follow the seed.
    #[cfg(madsim)]
    return Ok(madsim::rand::random::<u64>());
    // The operating system's generator through `getrandom` (issue 18 item 3).
    #[cfg(not(madsim))]
    let mut buf = [0u8; 8];
    #[cfg(not(madsim))]
    getrandom::fill(&mut buf).map_err(|e| std::io::Error::other(e.to_string()))?;
    #[cfg(not(madsim))]
    Ok(u64::from_ne_bytes(buf))
}

/// Group commit's first move: takes a step's outputs apart into the `Persist` batches, to be
/// written in one transaction, and the rest, to be acted on in order after the commit.
pub fn split_persists<O, B>(
    outs: &mut Vec<O>,
    persist: impl Fn(O) -> Split<B, O>,
) -> (Vec<B>, Vec<O>) {
    let mut batches = Vec::new();
    let mut rest = Vec::with_capacity(outs.len());
    for o in outs.drain(..) {
        match persist(o) {
            Split::Persist(b) => batches.push(b),
            Split::Other(other) => rest.push(other),
        }
    }
    (batches, rest)
}

/// One output, as [`split_persists`] sorts it.
pub enum Split<B, O> {
    /// A durable batch.
    Persist(B),
    /// Anything else.
    Other(O),
}

/// A PostgreSQL client error with what the server said: the client's own `Display` of a
/// server error is just "db error".
pub fn pg_detail(e: &postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} {}: {}", db.severity(), db.code().code(), db.message());
    }
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA: Schema = Schema {
        kind: "test",
        file: "t.db",
        application_id: 0x1234,
        migrations: &["CREATE TABLE a (x INTEGER);", "CREATE TABLE b (y INTEGER);"],
        side: crate::syncs::Side::Executor,
    };

    #[test]
    fn a_store_held_by_another_opener_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = open(dir.path(), &SCHEMA).unwrap();
        let err = open(dir.path(), &SCHEMA).err().unwrap();
        assert!(matches!(err, StoreError::Locked { .. }), "{err}");
        assert!(err.to_string().contains("t.db"));
        drop(first);
        open(dir.path(), &SCHEMA).unwrap();
    }

    #[test]
    fn a_newer_store_is_refused_with_its_version() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = open(dir.path(), &SCHEMA).unwrap();
            s.conn.execute_batch("PRAGMA user_version=7").unwrap();
        }
        let err = open(dir.path(), &SCHEMA).err().unwrap();
        assert!(
            matches!(
                err,
                StoreError::Newer {
                    found: 7,
                    known: 2,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_corrupt_store_is_refused_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("t.db"), vec![0x5a; 8192]).unwrap();
        let err = open(dir.path(), &SCHEMA).err().unwrap();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("t.db"), "{err}");
    }

    #[test]
    fn ids_round_trip_through_sqlite_integers() {
        for v in [0, 1, u64::MAX, 1 << 63] {
            assert_eq!(to_u64(to_i64(v)), v);
        }
    }
}
