//! Where the mill's durable state lives (issue 14 item 1): SQLite under a directory (the
//! default) or a PostgreSQL database, behind one set of batch semantics (DESIGN §2, M29).
//!
//! Enum dispatch, not a trait object: the two backends are known at compile time, so a
//! commit costs one `match` (never a virtual call per row), every caller handles both by
//! name, and the committer and the driver stay free of generic parameters.

use std::path::{Path, PathBuf};

use millrace_core::mill::{MillBatch, MillSnapshot};
use millrace_core::JobId;

use crate::mill_store::{AttemptRow, HistoryRow, JobRow, MillReader, MillStore, Purged};
use crate::pg_store::{PgReader, PgStore};
use crate::sqlite::StoreError;

/// Where `--store` points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// `sqlite:DIR`: `DIR/mill.db`, held by one process.
    Sqlite(PathBuf),
    /// `postgres://…` (or `postgresql://…`): a database several mills may share.
    Postgres(PgUrl),
}

/// A PostgreSQL connection URL. Its `Debug` and `Display` never show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct PgUrl(String);

impl PgUrl {
    /// The URL itself, for the client only.
    pub fn secret(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for PgUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PgUrl({})", redact(&self.0))
    }
}

impl std::fmt::Display for PgUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

/// `url` with the password of its user-info part (`user:PASSWORD@`) and any `password=`
/// parameter replaced by `***`.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, url),
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let authority = match authority.rsplit_once('@') {
        Some((user, host)) => match user.split_once(':') {
            Some((name, _)) => format!("{name}:***@{host}"),
            None => format!("{user}@{host}"),
        },
        None => authority.to_string(),
    };
    let tail = tail
        .split('&')
        .map(|part| match part.find("password=") {
            Some(i) => format!("{}password=***", &part[..i]),
            None => part.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    match scheme {
        Some(s) => format!("{s}://{authority}{tail}"),
        None => format!("{authority}{tail}"),
    }
}

impl StoreLocation {
    /// Parses `--store`: `sqlite:DIR`, `postgres://…` or `postgresql://…`.
    pub fn parse(given: &str) -> Result<Self, StoreError> {
        if let Some(dir) = given.strip_prefix("sqlite:") {
            if dir.is_empty() {
                return Err(StoreError::BadLocation {
                    given: given.to_string(),
                    reason: "sqlite: needs a directory".into(),
                });
            }
            return Ok(StoreLocation::Sqlite(PathBuf::from(dir)));
        }
        if given.starts_with("postgres://") || given.starts_with("postgresql://") {
            return Ok(StoreLocation::Postgres(PgUrl(given.to_string())));
        }
        Err(StoreError::BadLocation {
            given: redact(given),
            reason: "unknown kind of store".into(),
        })
    }
}

impl std::fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreLocation::Sqlite(dir) => write!(f, "sqlite:{}", dir.display()),
            StoreLocation::Postgres(url) => url.fmt(f),
        }
    }
}

/// The mill's store, on either backend, with the same batch semantics: [`Store::apply`]
/// writes every batch of a group commit in one transaction, or none of them.
pub enum Store {
    /// SQLite, exclusive to this process.
    Sqlite(MillStore),
    /// PostgreSQL, written under a leadership term (DESIGN §10).
    Postgres(Box<PgStore>),
}

impl Store {
    /// Everything the mill needs at restart (M29); `None` for a store that holds nothing yet.
    pub fn load(&mut self) -> Result<Option<MillSnapshot>, StoreError> {
        match self {
            Store::Sqlite(s) => s.load(),
            Store::Postgres(s) => s.load(),
        }
    }

    /// Applies every batch of one group commit in one transaction. On PostgreSQL it fails
    /// with [`StoreError::Deposed`], writing nothing, once the store's term has moved on.
    pub fn apply(&mut self, batches: &[MillBatch], now_ms: u64) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(s) => s.apply(batches, now_ms),
            Store::Postgres(s) => s.apply(batches, now_ms),
        }
    }

    /// One retention batch in one transaction (see [`MillStore::purge_finished`]).
    pub fn purge_finished(
        &mut self,
        cutoff_ms: u64,
        keep: Option<u64>,
        limit: usize,
        still_open: impl Fn(JobId) -> bool,
    ) -> Result<Purged, StoreError> {
        match self {
            Store::Sqlite(s) => s.purge_finished(cutoff_ms, keep, limit, still_open),
            Store::Postgres(s) => s.purge_finished(cutoff_ms, keep, limit, still_open),
        }
    }

    /// The leadership term this store writes under.
    pub fn term(&self) -> u64 {
        match self {
            Store::Sqlite(s) => s.term(),
            Store::Postgres(s) => s.term(),
        }
    }

    /// Where it is, for logs (never a password).
    pub fn describe(&self) -> String {
        match self {
            Store::Sqlite(s) => s.path().display().to_string(),
            Store::Postgres(s) => s.target().to_string(),
        }
    }

    /// A reader for the HTTP API on its own connection.
    pub fn reader(&self) -> Result<Reader, StoreError> {
        match self {
            Store::Sqlite(s) => Ok(Reader::Sqlite(MillReader::open(s.path())?)),
            Store::Postgres(s) => Ok(Reader::Postgres(Box::new(PgReader::open(s.url())?))),
        }
    }

    /// Closes the store cleanly.
    pub fn close(self) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(s) => s.close(),
            Store::Postgres(s) => s.close(),
        }
    }
}

/// The HTTP API's read-only queries, on either backend.
pub enum Reader {
    /// On the SQLite file.
    Sqlite(MillReader),
    /// On its own PostgreSQL connection.
    Postgres(Box<PgReader>),
}

impl Reader {
    /// One job, if it exists.
    pub fn job(&mut self, id: JobId) -> Result<Option<JobRow>, StoreError> {
        match self {
            Reader::Sqlite(r) => r.job(id),
            Reader::Postgres(r) => r.job(id),
        }
    }

    /// Whether `id` exists and has ended.
    pub fn is_done(&mut self, id: JobId) -> Result<bool, StoreError> {
        match self {
            Reader::Sqlite(r) => r.is_done(id),
            Reader::Postgres(r) => r.is_done(id),
        }
    }

    /// A job's status history, oldest first.
    pub fn history(&mut self, id: JobId) -> Result<Vec<HistoryRow>, StoreError> {
        match self {
            Reader::Sqlite(r) => r.history(id),
            Reader::Postgres(r) => r.history(id),
        }
    }

    /// A job's attempts (M32), oldest first.
    pub fn attempts(&mut self, id: JobId) -> Result<Vec<AttemptRow>, StoreError> {
        match self {
            Reader::Sqlite(r) => r.attempts(id),
            Reader::Postgres(r) => r.attempts(id),
        }
    }

    /// Jobs, newest first (see [`MillReader::jobs`]).
    pub fn jobs(
        &mut self,
        state: Option<&str>,
        before: Option<JobId>,
        limit: usize,
    ) -> Result<Vec<JobRow>, StoreError> {
        match self {
            Reader::Sqlite(r) => r.jobs(state, before, limit),
            Reader::Postgres(r) => r.jobs(state, before, limit),
        }
    }
}

/// Opens the SQLite store under `dir`; it takes its own next term.
pub fn open_sqlite(dir: &Path) -> Result<Store, StoreError> {
    Ok(Store::Sqlite(MillStore::open(dir)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_locations_parse_and_never_show_a_password() {
        assert_eq!(
            StoreLocation::parse("sqlite:/var/lib/m").unwrap(),
            StoreLocation::Sqlite("/var/lib/m".into())
        );
        let pg = StoreLocation::parse("postgres://mill:s3cret@db:5433/millrace").unwrap();
        assert_eq!(pg.to_string(), "postgres://mill:***@db:5433/millrace");
        assert!(!format!("{pg:?}").contains("s3cret"));
        assert_eq!(
            redact("postgresql://u@h/db?sslmode=disable&password=s3cret"),
            "postgresql://u@h/db?sslmode=disable&password=***"
        );
        let err = StoreLocation::parse("mysql://u:s3cret@h/db").unwrap_err();
        assert!(matches!(err, StoreError::BadLocation { .. }), "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(StoreLocation::parse("sqlite:").is_err());
    }
}
