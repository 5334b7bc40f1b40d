//! The mill's durable state in PostgreSQL (issue 14): the same tables as the SQLite store,
//! mirroring `MillSnapshot::apply` write for write (M29), plus the leadership row of
//! DESIGN §10.
//!
//! Several mills may point at one database; one leads. [`PgLeadership`] holds the store-side
//! primitives (`campaign`, `renew`, `resign`, `leader`), judged by the database's clock. A
//! [`PgStore`] is opened under the term its mill won, and every write transaction first
//! takes a share lock on the leader row and checks that term (I13): a campaign waits for the
//! writes in flight, and once the term has moved on a deposed mill's writes fail with
//! [`StoreError::Deposed`], leaving nothing. The sync `postgres` client fits the committer,
//! a plain thread; it must never be used (or dropped) inside an async task.
//!
//! Start refuses, naming `user@host:port/db` but never the password, an unreachable server,
//! a database that holds tables that are not millrace's or lacks millrace's marker, and a
//! store written by a newer schema; an older one is migrated in place by versioned steps.

use std::time::Duration;

use millrace_core::job::JobState;
use millrace_core::mill::{LeaseState, MillBatch, MillSnapshot, MillWrite};
use millrace_core::JobId;
use postgres::types::ToSql;
use postgres::{Client, NoTls, Statement, Transaction};

use crate::mill_store::{
    job_row, AttemptRow, HistoryRow, JobRow, LeaseRow, Purged, SnapshotRows, MAX_ATTEMPT_ROWS,
};
use crate::sqlite::{to_i64, to_u64, StoreError};
use crate::store::PgUrl;

/// What `millrace_schema_version.kind` says in a mill store.
const KIND: &str = "millrace mill";

/// Schema 1: the SQLite store's schema 6 in PostgreSQL types, the version marker and the
/// leadership row (DESIGN §10).
const PG_SCHEMA_V1: &str = r"
    CREATE TABLE millrace_schema_version (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        kind TEXT NOT NULL,
        version INTEGER NOT NULL
    );
    CREATE TABLE millrace_leader (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        term BIGINT NOT NULL,
        holder TEXT NOT NULL,
        address TEXT NOT NULL,
        expires_at TIMESTAMPTZ NOT NULL
    );
    CREATE TABLE counters (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        next_job BIGINT NOT NULL,
        lease_floor BIGINT NOT NULL
    );
    CREATE TABLE jobs (
        id BIGINT PRIMARY KEY,
        spec BYTEA NOT NULL,
        spec_format BIGINT NOT NULL,
        submitted_at_ms BIGINT NOT NULL,
        state TEXT NOT NULL,
        state_json TEXT NOT NULL,
        done BOOLEAN NOT NULL,
        updated_at_ms BIGINT NOT NULL
    );
    CREATE INDEX jobs_by_state ON jobs (state, id);
    CREATE INDEX jobs_by_done ON jobs (done, id);
    CREATE INDEX jobs_done_by_age ON jobs (done, updated_at_ms, id);
    CREATE TABLE job_history (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        job BIGINT NOT NULL,
        state TEXT NOT NULL,
        state_json TEXT NOT NULL,
        at_ms BIGINT NOT NULL
    );
    CREATE INDEX job_history_by_job ON job_history (job, seq);
    CREATE TABLE leases (
        lease BIGINT PRIMARY KEY,
        job BIGINT NOT NULL,
        node TEXT NOT NULL,
        epoch BIGINT NOT NULL,
        state TEXT NOT NULL,
        resources TEXT NOT NULL,
        cancel TEXT,
        attempt BIGINT NOT NULL
    );
    CREATE TABLE attempts (
        job BIGINT NOT NULL,
        attempt BIGINT NOT NULL,
        lease BIGINT NOT NULL,
        node TEXT NOT NULL,
        epoch BIGINT NOT NULL,
        started_at_ms BIGINT NOT NULL,
        ended_at_ms BIGINT,
        status TEXT,
        cause TEXT,
        exit_code INTEGER,
        error TEXT,
        outcome TEXT,
        PRIMARY KEY (job, attempt)
    );
    CREATE TABLE cursors (
        node TEXT NOT NULL,
        epoch BIGINT NOT NULL,
        seqno BIGINT NOT NULL,
        PRIMARY KEY (node, epoch)
    );
    CREATE TABLE quota_holds (
        job BIGINT PRIMARY KEY,
        identity TEXT NOT NULL,
        charge TEXT NOT NULL
    );
    CREATE TABLE quarantine (
        node TEXT PRIMARY KEY
    );
    CREATE TABLE idem_keys (
        key TEXT PRIMARY KEY,
        fingerprint BYTEA NOT NULL,
        job BIGINT NOT NULL
    );
    CREATE INDEX idem_keys_by_job ON idem_keys (job);
";

/// Schema 2: the leader row also says where the leader's HTTP API listens, so a standby can
/// tell API clients where to go (issue 14 item 2).
const PG_SCHEMA_V2: &str = r"
    ALTER TABLE millrace_leader ADD COLUMN http_address TEXT NOT NULL DEFAULT '';
";

/// Migration `i` takes the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[PG_SCHEMA_V1, PG_SCHEMA_V2];

/// Every table some version of this build's schema has; any other table makes the database
/// foreign.
const TABLES: &[&str] = &[
    "millrace_schema_version",
    "millrace_leader",
    "counters",
    "jobs",
    "job_history",
    "leases",
    "attempts",
    "cursors",
    "quota_holds",
    "quarantine",
    "idem_keys",
];

/// Serialises migrations of concurrent openers (`pg_advisory_xact_lock` key: "MRMI").
const MIGRATE_LOCK: i64 = 0x4d52_4d49;

/// How long connecting may take unless the URL says (`connect_timeout=`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// I13, §10: how long a session may sit idle inside a transaction before PostgreSQL ends it
/// (`idle_in_transaction_session_timeout`, unless the URL sets `options`). A mill paused in
/// the middle of a group commit (SIGSTOP, a stalled VM) holds the share lock its term check
/// took on the leader row, and a standby's campaign waits for that lock: without a bound, a
/// paused leader blocked the takeover until it resumed (node/tests/failover.rs, i13 SIGSTOP,
/// under CI load). The mill's own statements follow each other at once, so only a paused or
/// cut-off client is ever this idle; its commit then fails and it steps down.
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// A connected, schema-checked client and what to call its database.
struct Conn {
    client: Client,
    target: String,
}

/// `user@host:port/db` of `config`, never its password.
fn target_of(config: &postgres::Config) -> String {
    let hosts = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            postgres::config::Host::Tcp(name) => name.clone(),
            postgres::config::Host::Unix(dir) => dir.display().to_string(),
        })
        .collect::<Vec<_>>();
    let host = if hosts.is_empty() {
        "localhost".to_string()
    } else {
        hosts.join(",")
    };
    let port = config
        .get_ports()
        .first()
        .map_or_else(|| "5432".to_string(), u16::to_string);
    let user = config.get_user().unwrap_or("(default user)");
    let db = config.get_dbname().unwrap_or(user);
    format!("{user}@{host}:{port}/{db}")
}

/// Connects to `url` and checks (and, with `migrate`, creates or upgrades) the schema.
fn connect(url: &PgUrl, migrate: bool) -> Result<Conn, StoreError> {
    let mut config: postgres::Config =
        url.secret()
            .parse()
            .map_err(|e: postgres::Error| StoreError::BadLocation {
                given: url.to_string(),
                reason: e.to_string(),
            })?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("millrace");
    }
    if config.get_options().is_none() {
        config.options(&format!(
            "-c idle_in_transaction_session_timeout={}",
            IDLE_IN_TRANSACTION.as_millis()
        ));
    }
    let target = target_of(&config);
    let client = config.connect(NoTls).map_err(|e| {
        let mut reason = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            reason.push_str(&format!(": {c}"));
            cause = c.source();
        }
        StoreError::Unreachable {
            target: target.clone(),
            reason,
        }
    })?;
    let mut conn = Conn { client, target };
    conn.check_schema(migrate)?;
    Ok(conn)
}

impl Conn {
    fn pg(&self) -> impl Fn(postgres::Error) -> StoreError + '_ {
        |source| StoreError::Postgres {
            target: self.target.clone(),
            source,
        }
    }

    fn foreign(&self, reason: String) -> StoreError {
        StoreError::ForeignDatabase {
            target: self.target.clone(),
            reason,
        }
    }

    /// Refuses a foreign or newer database; migrates an empty or older one when `migrate`.
    fn check_schema(&mut self, migrate: bool) -> Result<(), StoreError> {
        let target = self.target.clone();
        let pg = |source| StoreError::Postgres {
            target: target.clone(),
            source,
        };
        let known = i64::try_from(MIGRATIONS.len()).unwrap_or(i64::MAX);
        let mut tx = self.client.transaction().map_err(pg)?;
        if migrate {
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATE_LOCK])
                .map_err(pg)?;
        }
        let tables: Vec<String> = tx
            .query(
                "SELECT tablename::text FROM pg_catalog.pg_tables
                 WHERE schemaname = current_schema() ORDER BY tablename",
                &[],
            )
            .map_err(pg)?
            .iter()
            .map(|r| r.try_get::<_, String>(0))
            .collect::<Result<_, _>>()
            .map_err(pg)?;
        let version = if tables.is_empty() {
            0
        } else if !tables.iter().any(|t| t == "millrace_schema_version") {
            drop(tx);
            return Err(self.foreign(format!(
                "it has tables ({}) but no millrace_schema_version",
                shown(&tables)
            )));
        } else {
            let marker = tx
                .query_opt(
                    "SELECT kind, version::bigint FROM millrace_schema_version WHERE id = 1",
                    &[],
                )
                .map_err(pg)?;
            let Some(marker) = marker else {
                drop(tx);
                return Err(self.foreign("millrace_schema_version is empty".into()));
            };
            let kind: String = marker.try_get(0).map_err(pg)?;
            let version: i64 = marker.try_get(1).map_err(pg)?;
            if kind != KIND {
                drop(tx);
                return Err(self.foreign(format!("its marker says {kind:?}, not {KIND:?}")));
            }
            if version > known {
                drop(tx);
                return Err(StoreError::NewerDatabase {
                    target: self.target.clone(),
                    found: version,
                    known,
                });
            }
            let others: Vec<String> = tables
                .iter()
                .filter(|t| !TABLES.contains(&t.as_str()))
                .cloned()
                .collect();
            if !others.is_empty() {
                drop(tx);
                return Err(self.foreign(format!(
                    "it also has tables that are not millrace's: {}",
                    shown(&others)
                )));
            }
            version
        };
        if version == known {
            return tx.commit().map_err(pg);
        }
        if !migrate {
            drop(tx);
            return Err(self.foreign(format!(
                "schema version {version}, not {known}: start the mill first, which migrates it"
            )));
        }
        for (from, sql) in MIGRATIONS.iter().enumerate() {
            let from = i64::try_from(from).unwrap_or(i64::MAX);
            if from < version {
                continue;
            }
            tx.batch_execute(sql).map_err(pg)?;
            let to = i32::try_from(from + 1).unwrap_or(i32::MAX);
            tx.execute(
                "INSERT INTO millrace_schema_version (id, kind, version) VALUES (1, $1, $2)
                 ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                &[&KIND, &to],
            )
            .map_err(pg)?;
        }
        tx.commit().map_err(pg)?;
        tracing::info!(store = %self.target, from = version, to = known, "migrated the PostgreSQL store");
        Ok(())
    }
}

/// At most a few names, for messages.
fn shown(names: &[String]) -> String {
    let mut s = names.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 5 {
        s.push_str(&format!(" and {} more", names.len() - 5));
    }
    s
}

/// A lease in milliseconds for SQL, saturating.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Who leads a store, as the database sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderInfo {
    /// The leader's term.
    pub term: u64,
    /// Its name.
    pub holder: String,
    /// Where its executors connect.
    pub address: String,
    /// Where its HTTP API listens (empty if it never said).
    pub http_address: String,
    /// Until its lease runs out by the database's clock (zero once it has).
    pub expires_in: Duration,
}

/// The store-side leadership primitives of DESIGN §10 on their own connection, judged by
/// the database's clock (`now()`), never the mill's.
pub struct PgLeadership {
    conn: Conn,
    url: PgUrl,
}

impl PgLeadership {
    /// Connects to the store at `url`, creating or upgrading its schema.
    pub fn connect(url: &PgUrl) -> Result<Self, StoreError> {
        Ok(PgLeadership {
            conn: connect(url, true)?,
            url: url.clone(),
        })
    }

    /// Takes leadership, with a new term one above the last, when no mill has held it, when
    /// the holder's lease has expired, or when `holder` itself holds it (a restart of the
    /// same mill still gets a new term; only [`PgLeadership::renew`] keeps one). `None`:
    /// another mill holds a live lease. The row lock makes it wait for write transactions
    /// in flight under the old term (I13).
    pub fn campaign(
        &mut self,
        holder: &str,
        address: &str,
        http_address: &str,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        let row = self
            .conn
            .client
            .query_opt(
                "INSERT INTO millrace_leader (id, term, holder, address, http_address, expires_at)
                 VALUES (1, 1, $1, $2, $4, now() + $3::bigint * interval '1 millisecond')
                 ON CONFLICT (id) DO UPDATE SET term = millrace_leader.term + 1,
                   holder = excluded.holder, address = excluded.address,
                   http_address = excluded.http_address, expires_at = excluded.expires_at
                 WHERE millrace_leader.expires_at <= now()
                   OR millrace_leader.holder = excluded.holder
                 RETURNING term",
                &[&holder, &address, &millis(lease), &http_address],
            )
            .map_err(self.conn.pg())?;
        row.map(|r| r.try_get::<_, i64>(0).map(to_u64))
            .transpose()
            .map_err(self.conn.pg())
    }

    /// Extends `holder`'s lease under `term`; false when the term moved on or the lease had
    /// already expired (then the mill must step down: another may have taken it).
    pub fn renew(&mut self, holder: &str, term: u64, lease: Duration) -> Result<bool, StoreError> {
        let n = self
            .conn
            .client
            .execute(
                "UPDATE millrace_leader
                 SET expires_at = now() + $3::bigint * interval '1 millisecond'
                 WHERE id = 1 AND holder = $1 AND term = $2 AND expires_at > now()",
                &[&holder, &to_i64(term), &millis(lease)],
            )
            .map_err(self.conn.pg())?;
        Ok(n == 1)
    }

    /// Gives up leadership under `term` at once (the lease ends now; the term stays, so the
    /// next campaign's is higher). False when `holder` no longer held `term`.
    pub fn resign(&mut self, holder: &str, term: u64) -> Result<bool, StoreError> {
        let n = self
            .conn
            .client
            .execute(
                "UPDATE millrace_leader SET expires_at = now()
                 WHERE id = 1 AND holder = $1 AND term = $2 AND expires_at > now()",
                &[&holder, &to_i64(term)],
            )
            .map_err(self.conn.pg())?;
        Ok(n == 1)
    }

    /// Who leads, if any mill ever has.
    pub fn leader(&mut self) -> Result<Option<LeaderInfo>, StoreError> {
        let row = self
            .conn
            .client
            .query_opt(
                "SELECT term, holder, address,
                   GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - now())) * 1000))::bigint,
                   http_address
                 FROM millrace_leader WHERE id = 1",
                &[],
            )
            .map_err(self.conn.pg())?;
        let Some(r) = row else { return Ok(None) };
        let info = (|| {
            Ok::<_, postgres::Error>(LeaderInfo {
                term: to_u64(r.try_get(0)?),
                holder: r.try_get(1)?,
                address: r.try_get(2)?,
                http_address: r.try_get(4)?,
                expires_in: Duration::from_millis(
                    u64::try_from(r.try_get::<_, i64>(3)?).unwrap_or(0),
                ),
            })
        })()
        .map_err(self.conn.pg())?;
        Ok(Some(info))
    }

    /// `user@host:port/db`.
    pub fn target(&self) -> &str {
        &self.conn.target
    }

    /// Where it connects.
    pub fn url(&self) -> &PgUrl {
        &self.url
    }
}

/// Every write statement, prepared once per connection.
struct Writes {
    term: Statement,
    counters: Statement,
    job_insert: Statement,
    history: Statement,
    key_insert: Statement,
    job_state: Statement,
    lease_upsert: Statement,
    attempt_start: Statement,
    attempt_end: Statement,
    lease_cancel: Statement,
    lease_delete: Statement,
    cursor: Statement,
    cursor_delete: Statement,
    quota_hold: Statement,
    quota_release: Statement,
    quarantine_add: Statement,
    quarantine_remove: Statement,
    purge_threshold: Statement,
    purge_oldest: Statement,
    purge_history: Statement,
    purge_attempts: Statement,
    purge_job: Statement,
    purge_keys: Statement,
}

impl Writes {
    fn prepare(c: &mut Client) -> Result<Self, postgres::Error> {
        Ok(Writes {
            term: c.prepare("SELECT term FROM millrace_leader WHERE id = 1 FOR SHARE")?,
            counters: c.prepare(
                "INSERT INTO counters (id, next_job, lease_floor) VALUES (1, $1, $2)
                 ON CONFLICT (id) DO UPDATE SET
                   next_job = GREATEST(counters.next_job, excluded.next_job),
                   lease_floor = GREATEST(counters.lease_floor, excluded.lease_floor)",
            )?,
            job_insert: c.prepare(
                "INSERT INTO jobs (id, spec, submitted_at_ms, state, state_json, done,
                   updated_at_ms, spec_format)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )?,
            history: c.prepare(
                "INSERT INTO job_history (job, state, state_json, at_ms) VALUES ($1, $2, $3, $4)",
            )?,
            key_insert: c
                .prepare("INSERT INTO idem_keys (key, fingerprint, job) VALUES ($1, $2, $3)")?,
            job_state: c.prepare(
                "UPDATE jobs SET state = $2, state_json = $3, done = $4, updated_at_ms = $5
                 WHERE id = $1",
            )?,
            lease_upsert: c.prepare(
                "INSERT INTO leases (lease, job, node, epoch, state, resources, cancel, attempt)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                 ON CONFLICT (lease) DO UPDATE SET job = excluded.job, node = excluded.node,
                   epoch = excluded.epoch, state = excluded.state,
                   resources = excluded.resources, cancel = excluded.cancel,
                   attempt = excluded.attempt",
            )?,
            attempt_start: c.prepare(
                "INSERT INTO attempts (job, attempt, lease, node, epoch, started_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (job, attempt) DO NOTHING",
            )?,
            attempt_end: c.prepare(
                "UPDATE attempts SET ended_at_ms = $3, status = $4, cause = $5, exit_code = $6,
                   error = $7, outcome = $8
                 WHERE job = $1 AND attempt = $2",
            )?,
            lease_cancel: c.prepare("UPDATE leases SET cancel = $2 WHERE lease = $1")?,
            lease_delete: c.prepare("DELETE FROM leases WHERE lease = $1")?,
            cursor: c.prepare(
                "INSERT INTO cursors (node, epoch, seqno) VALUES ($1, $2, $3)
                 ON CONFLICT (node, epoch) DO UPDATE SET seqno = excluded.seqno",
            )?,
            cursor_delete: c.prepare("DELETE FROM cursors WHERE node = $1 AND epoch = $2")?,
            quota_hold: c.prepare(
                "INSERT INTO quota_holds (job, identity, charge) VALUES ($1, $2, $3)
                 ON CONFLICT (job) DO UPDATE SET identity = excluded.identity,
                   charge = excluded.charge",
            )?,
            quota_release: c.prepare("DELETE FROM quota_holds WHERE job = $1")?,
            quarantine_add: c.prepare(
                "INSERT INTO quarantine (node) VALUES ($1) ON CONFLICT (node) DO NOTHING",
            )?,
            quarantine_remove: c.prepare("DELETE FROM quarantine WHERE node = $1")?,
            purge_threshold: c.prepare(
                "SELECT updated_at_ms, id FROM jobs WHERE done
                 ORDER BY updated_at_ms DESC, id DESC LIMIT 1 OFFSET $1",
            )?,
            purge_oldest: c.prepare(
                "SELECT id, updated_at_ms FROM jobs WHERE done
                 ORDER BY updated_at_ms, id LIMIT $1",
            )?,
            purge_history: c.prepare("DELETE FROM job_history WHERE job = $1")?,
            purge_attempts: c.prepare("DELETE FROM attempts WHERE job = $1")?,
            purge_job: c.prepare("DELETE FROM jobs WHERE id = $1 AND done")?,
            purge_keys: c.prepare("DELETE FROM idem_keys WHERE job = $1")?,
        })
    }
}

/// The mill's PostgreSQL store, owned by the committer thread; writes under one term.
pub struct PgStore {
    conn: Conn,
    url: PgUrl,
    writes: Writes,
    term: u64,
}

/// Why one write failed: the database, or encoding a value.
enum WriteError {
    Pg(postgres::Error),
    Encode(String),
}

impl From<postgres::Error> for WriteError {
    fn from(e: postgres::Error) -> Self {
        WriteError::Pg(e)
    }
}

fn json<T: serde::Serialize>(v: &T) -> Result<String, WriteError> {
    serde_json::to_string(v).map_err(|e| WriteError::Encode(e.to_string()))
}

impl PgStore {
    /// Opens the store at `url` (creating or upgrading its schema) to write under `term`,
    /// the term its mill won with [`PgLeadership::campaign`].
    pub fn open(url: &PgUrl, term: u64) -> Result<Self, StoreError> {
        let mut conn = connect(url, true)?;
        let writes = Writes::prepare(&mut conn.client).map_err(conn.pg())?;
        Ok(PgStore {
            conn,
            url: url.clone(),
            writes,
            term,
        })
    }

    /// The term this store writes under.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// `user@host:port/db`.
    pub fn target(&self) -> &str {
        &self.conn.target
    }

    /// The URL it was opened with (for readers).
    pub fn url(&self) -> &PgUrl {
        &self.url
    }

    fn pg(target: &str) -> impl Fn(postgres::Error) -> StoreError + '_ {
        move |source| StoreError::Postgres {
            target: target.to_string(),
            source,
        }
    }

    /// Everything the mill needs at restart (M29), in one snapshot-consistent read;
    /// `None` for a store that holds nothing yet.
    pub fn load(&mut self) -> Result<Option<MillSnapshot>, StoreError> {
        let target = self.conn.target.clone();
        let pg = Self::pg(&target);
        let corrupt = |reason: String| StoreError::ForeignDatabase {
            target: target.clone(),
            reason: format!("corrupt row: {reason}"),
        };
        let mut tx = self
            .conn
            .client
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(&pg)?;
        let Some(counters) = tx
            .query_opt(
                "SELECT next_job, lease_floor FROM counters WHERE id = 1",
                &[],
            )
            .map_err(&pg)?
        else {
            return Ok(None);
        };
        let mut snap = SnapshotRows::new(
            counters.try_get(0).map_err(&pg)?,
            counters.try_get(1).map_err(&pg)?,
        );
        for r in tx
            .query(
                "SELECT id, spec, submitted_at_ms, state_json, spec_format FROM jobs WHERE NOT done",
                &[],
            )
            .map_err(&pg)?
        {
            let spec: Vec<u8> = r.try_get(1).map_err(&pg)?;
            let state: String = r.try_get(3).map_err(&pg)?;
            snap.job(
                r.try_get(0).map_err(&pg)?,
                &spec,
                r.try_get(4).map_err(&pg)?,
                r.try_get(2).map_err(&pg)?,
                &state,
            )
            .map_err(corrupt)?;
        }
        for r in tx
            .query(
                "SELECT lease, job, node, epoch, state, resources, cancel, attempt FROM leases",
                &[],
            )
            .map_err(&pg)?
        {
            let row = LeaseRow {
                lease: r.try_get(0).map_err(&pg)?,
                job: r.try_get(1).map_err(&pg)?,
                node: r.try_get(2).map_err(&pg)?,
                epoch: r.try_get(3).map_err(&pg)?,
                state: r.try_get(4).map_err(&pg)?,
                resources: r.try_get(5).map_err(&pg)?,
                cancel: r.try_get(6).map_err(&pg)?,
                attempt: r.try_get(7).map_err(&pg)?,
            };
            snap.lease(row).map_err(corrupt)?;
        }
        for r in tx
            .query(
                "SELECT a.job, a.attempt, a.outcome, a.lease, a.node FROM attempts a
                 JOIN jobs j ON j.id = a.job WHERE NOT j.done ORDER BY a.job, a.attempt",
                &[],
            )
            .map_err(&pg)?
        {
            let outcome: Option<String> = r.try_get(2).map_err(&pg)?;
            snap.attempt(
                r.try_get(0).map_err(&pg)?,
                r.try_get(1).map_err(&pg)?,
                outcome.as_deref(),
                r.try_get(3).map_err(&pg)?,
                r.try_get(4).map_err(&pg)?,
            )
            .map_err(corrupt)?;
        }
        for r in tx
            .query("SELECT node, epoch, seqno FROM cursors", &[])
            .map_err(&pg)?
        {
            snap.cursor(
                r.try_get(0).map_err(&pg)?,
                r.try_get(1).map_err(&pg)?,
                r.try_get(2).map_err(&pg)?,
            )
            .map_err(corrupt)?;
        }
        for r in tx
            .query("SELECT job, identity, charge FROM quota_holds", &[])
            .map_err(&pg)?
        {
            let identity: String = r.try_get(1).map_err(&pg)?;
            let charge: String = r.try_get(2).map_err(&pg)?;
            snap.quota_hold(r.try_get(0).map_err(&pg)?, &identity, &charge)
                .map_err(corrupt)?;
        }
        for r in tx.query("SELECT node FROM quarantine", &[]).map_err(&pg)? {
            snap.quarantined(r.try_get(0).map_err(&pg)?)
                .map_err(corrupt)?;
        }
        for r in tx
            .query("SELECT key, fingerprint, job FROM idem_keys", &[])
            .map_err(&pg)?
        {
            let fingerprint: Vec<u8> = r.try_get(1).map_err(&pg)?;
            snap.key(
                r.try_get(0).map_err(&pg)?,
                &fingerprint,
                r.try_get(2).map_err(&pg)?,
            )
            .map_err(corrupt)?;
        }
        tx.commit().map_err(&pg)?;
        Ok(Some(snap.0))
    }

    /// Fails with [`StoreError::Deposed`] unless the leader row, share-locked for the rest
    /// of `tx`, still holds `term` (I13).
    fn check_term(
        tx: &mut Transaction<'_>,
        stmt: &Statement,
        term: u64,
        target: &str,
    ) -> Result<(), StoreError> {
        let current = tx
            .query_opt(stmt, &[])
            .map_err(Self::pg(target))?
            .map(|r| r.try_get::<_, i64>(0).map(to_u64))
            .transpose()
            .map_err(Self::pg(target))?;
        if current == Some(term) {
            Ok(())
        } else {
            Err(StoreError::Deposed {
                held: term,
                current,
            })
        }
    }

    /// Applies every batch of one group commit in one transaction, under this store's term
    /// (I13); a deposed store writes nothing.
    pub fn apply(&mut self, batches: &[MillBatch], now_ms: u64) -> Result<(), StoreError> {
        let target = &self.conn.target;
        let w = &self.writes;
        let mut tx = self.conn.client.transaction().map_err(Self::pg(target))?;
        Self::check_term(&mut tx, &w.term, self.term, target)?;
        for batch in batches {
            for write in &batch.writes {
                apply_write(&mut tx, w, write, now_ms).map_err(|e| match e {
                    WriteError::Pg(source) => StoreError::Postgres {
                        target: target.clone(),
                        source,
                    },
                    WriteError::Encode(reason) => StoreError::ForeignDatabase {
                        target: target.clone(),
                        reason: format!("cannot encode a write: {reason}"),
                    },
                })?;
            }
        }
        tx.commit().map_err(Self::pg(target))?;
        crate::syncs::add(crate::syncs::Side::Mill, 1);
        Ok(())
    }

    /// One retention batch in one transaction, under this store's term; the same selection
    /// as [`crate::mill_store::MillStore::purge_finished`].
    pub fn purge_finished(
        &mut self,
        cutoff_ms: u64,
        keep: Option<u64>,
        limit: usize,
        still_open: impl Fn(JobId) -> bool,
    ) -> Result<Purged, StoreError> {
        let target = &self.conn.target;
        let pg = Self::pg(target);
        let w = &self.writes;
        let mut tx = self.conn.client.transaction().map_err(&pg)?;
        Self::check_term(&mut tx, &w.term, self.term, target)?;
        let threshold: Option<(i64, i64)> = match keep {
            None => None,
            Some(n) => {
                let n = i64::try_from(n).unwrap_or(i64::MAX);
                tx.query_opt(&w.purge_threshold, &[&n])
                    .map_err(&pg)?
                    .map(|r| Ok::<_, postgres::Error>((r.try_get(0)?, r.try_get(1)?)))
                    .transpose()
                    .map_err(&pg)?
            }
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let oldest: Vec<(i64, i64)> = tx
            .query(&w.purge_oldest, &[&limit])
            .map_err(&pg)?
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<_, postgres::Error>>()
            .map_err(&pg)?;
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
            purged.history_rows += tx.execute(&w.purge_history, &[&id]).map_err(&pg)?;
            tx.execute(&w.purge_attempts, &[&id]).map_err(&pg)?;
            tx.execute(&w.purge_job, &[&id]).map_err(&pg)?;
            // Its idempotency key expires with it, in the same transaction (M31).
            purged.keys += tx.execute(&w.purge_keys, &[&id]).map_err(&pg)?;
            purged.jobs.push(job);
        }
        tx.commit().map_err(&pg)?;
        crate::syncs::add(crate::syncs::Side::Mill, 1);
        Ok(purged)
    }

    /// Closes the connection (clean shutdown).
    pub fn close(self) -> Result<(), StoreError> {
        let target = self.conn.target.clone();
        self.conn
            .client
            .close()
            .map_err(|source| StoreError::Postgres { target, source })
    }
}

fn exec(
    tx: &mut Transaction<'_>,
    st: &Statement,
    params: &[&(dyn ToSql + Sync)],
) -> Result<(), postgres::Error> {
    tx.execute(st, params).map(|_| ())
}

/// Exactly what `mill_store::apply_write` does in SQLite, in PostgreSQL (M29).
fn apply_write(
    tx: &mut Transaction<'_>,
    w: &Writes,
    write: &MillWrite,
    now_ms: u64,
) -> Result<(), WriteError> {
    let now = to_i64(now_ms);
    match write {
        MillWrite::Counters {
            next_job,
            lease_floor,
        } => exec(
            tx,
            &w.counters,
            &[&to_i64(next_job.get()), &to_i64(lease_floor.get())],
        )?,
        MillWrite::JobInsert { job, record } => {
            let spec = postcard::to_allocvec(&record.spec)
                .map_err(|e| WriteError::Encode(e.to_string()))?;
            let state = json(&record.state)?;
            let id = to_i64(job.get());
            let done = matches!(record.state, JobState::Done(_));
            exec(
                tx,
                &w.job_insert,
                &[
                    &id,
                    &spec,
                    &to_i64(record.submitted_at_ms),
                    &record.state.name(),
                    &state,
                    &done,
                    &now,
                    &crate::mill_store::SPEC_FORMAT,
                ],
            )?;
            exec(tx, &w.history, &[&id, &record.state.name(), &state, &now])?;
        }
        MillWrite::KeyInsert { key, record } => exec(
            tx,
            &w.key_insert,
            &[
                &key.as_str(),
                &record.fingerprint.0.as_slice(),
                &to_i64(record.job.get()),
            ],
        )?,
        MillWrite::JobState { job, state } => {
            let s = json(state)?;
            let id = to_i64(job.get());
            let done = matches!(state, JobState::Done(_));
            exec(tx, &w.job_state, &[&id, &state.name(), &s, &done, &now])?;
            exec(tx, &w.history, &[&id, &state.name(), &s, &now])?;
        }
        MillWrite::LeaseUpsert(record) => {
            let state = match record.state {
                LeaseState::Reserved => "reserved",
                LeaseState::Running => "running",
            };
            let resources = json(&record.resources)?;
            let cancel = record.cancel.as_ref().map(json).transpose()?;
            let (lease, job) = (to_i64(record.lease.get()), to_i64(record.job.get()));
            let epoch = to_i64(record.epoch.get());
            let attempt = i64::from(record.attempt);
            exec(
                tx,
                &w.lease_upsert,
                &[
                    &lease,
                    &job,
                    &record.node.as_str(),
                    &epoch,
                    &state,
                    &resources,
                    &cancel,
                    &attempt,
                ],
            )?;
            // The attempt starts with its lease's first write (M32).
            exec(
                tx,
                &w.attempt_start,
                &[&job, &attempt, &lease, &record.node.as_str(), &epoch, &now],
            )?;
        }
        MillWrite::Attempt(end) => exec(
            tx,
            &w.attempt_end,
            &[
                &to_i64(end.job.get()),
                &i64::from(end.attempt),
                &now,
                &end.status.map(|s| s.to_string()),
                &end.cause.map(|c| c.name()),
                &end.exit_code,
                &end.error,
                &crate::mill_store::outcome_name(end.outcome),
            ],
        )?,
        MillWrite::LeaseCancel { lease, cancel } => {
            exec(tx, &w.lease_cancel, &[&to_i64(lease.get()), &json(cancel)?])?
        }
        MillWrite::LeaseDelete { lease } => exec(tx, &w.lease_delete, &[&to_i64(lease.get())])?,
        MillWrite::Cursor { node, epoch, seqno } => exec(
            tx,
            &w.cursor,
            &[&node.as_str(), &to_i64(epoch.get()), &to_i64(seqno.get())],
        )?,
        MillWrite::CursorDelete { node, epoch } => exec(
            tx,
            &w.cursor_delete,
            &[&node.as_str(), &to_i64(epoch.get())],
        )?,
        MillWrite::QuotaHold {
            job,
            identity,
            charge,
        } => exec(
            tx,
            &w.quota_hold,
            &[&to_i64(job.get()), &json(identity)?, &json(charge)?],
        )?,
        MillWrite::QuotaRelease { job } => exec(tx, &w.quota_release, &[&to_i64(job.get())])?,
        MillWrite::Quarantine { node, quarantined } => {
            let st = match quarantined {
                true => &w.quarantine_add,
                false => &w.quarantine_remove,
            };
            exec(tx, st, &[&node.as_str()])?;
        }
    }
    Ok(())
}

/// Read statements of the HTTP API, prepared once.
struct Reads {
    job: Statement,
    is_done: Statement,
    history: Statement,
    attempts: Statement,
    jobs_all: Statement,
    jobs_active: Statement,
    jobs_done: Statement,
    jobs_state: Statement,
}

/// The columns of a [`JobRow`].
const SELECT_JOB: &str =
    "SELECT id, spec, submitted_at_ms, state_json, updated_at_ms, spec_format FROM jobs";

/// Read-only queries for the HTTP API, on their own connection. Its methods block: call
/// them from a blocking thread (`spawn_blocking`), never inside an async task.
pub struct PgReader {
    conn: Option<Conn>,
    reads: Reads,
    target: String,
}

impl PgReader {
    /// Connects a reader to the store at `url` (the mill must have created its schema).
    pub fn open(url: &PgUrl) -> Result<Self, StoreError> {
        let mut conn = connect(url, false)?;
        let target = conn.target.clone();
        let c = &mut conn.client;
        let reads = (|| {
            Ok::<_, postgres::Error>(Reads {
                job: c.prepare(&format!("{SELECT_JOB} WHERE id = $1"))?,
                is_done: c.prepare("SELECT done FROM jobs WHERE id = $1")?,
                history: c.prepare(
                    "SELECT state_json, at_ms FROM job_history WHERE job = $1
                     ORDER BY seq LIMIT 1000",
                )?,
                attempts: c.prepare(
                    "SELECT attempt, lease, node, epoch, started_at_ms, ended_at_ms, status,
                       cause, exit_code, error, outcome
                     FROM attempts WHERE job = $1 ORDER BY attempt DESC LIMIT $2",
                )?,
                jobs_all: c.prepare(&format!(
                    "{SELECT_JOB} WHERE id < $2 ORDER BY id DESC LIMIT $1"
                ))?,
                jobs_active: c.prepare(&format!(
                    "{SELECT_JOB} WHERE id < $2 AND NOT done ORDER BY id DESC LIMIT $1"
                ))?,
                jobs_done: c.prepare(&format!(
                    "{SELECT_JOB} WHERE id < $2 AND done ORDER BY id DESC LIMIT $1"
                ))?,
                jobs_state: c.prepare(&format!(
                    "{SELECT_JOB} WHERE id < $2 AND state = $3 ORDER BY id DESC LIMIT $1"
                ))?,
            })
        })()
        .map_err(conn.pg())?;
        Ok(PgReader {
            conn: Some(conn),
            reads,
            target,
        })
    }

    fn client(&mut self) -> Result<&mut Client, StoreError> {
        match self.conn.as_mut() {
            Some(c) => Ok(&mut c.client),
            None => Err(StoreError::ForeignDatabase {
                target: self.target.clone(),
                reason: "the reader is closed".into(),
            }),
        }
    }

    fn pg(&self) -> impl Fn(postgres::Error) -> StoreError + '_ {
        |source| StoreError::Postgres {
            target: self.target.clone(),
            source,
        }
    }

    fn job_rows(&self, rows: Vec<postgres::Row>) -> Result<Vec<JobRow>, StoreError> {
        rows.iter()
            .map(|r| {
                let spec: Vec<u8> = r.try_get(1).map_err(self.pg())?;
                let state: String = r.try_get(3).map_err(self.pg())?;
                job_row(
                    r.try_get(0).map_err(self.pg())?,
                    &spec,
                    r.try_get(5).map_err(self.pg())?,
                    r.try_get(2).map_err(self.pg())?,
                    &state,
                    r.try_get(4).map_err(self.pg())?,
                )
                .map_err(|reason| StoreError::ForeignDatabase {
                    target: self.target.clone(),
                    reason: format!("corrupt row: {reason}"),
                })
            })
            .collect()
    }

    /// One job, if it exists.
    pub fn job(&mut self, id: JobId) -> Result<Option<JobRow>, StoreError> {
        let st = self.reads.job.clone();
        let rows = self
            .client()?
            .query(&st, &[&to_i64(id.get())])
            .map_err(self.pg())?;
        Ok(self.job_rows(rows)?.into_iter().next())
    }

    /// Whether `id` exists and has ended (a missing job has not).
    pub fn is_done(&mut self, id: JobId) -> Result<bool, StoreError> {
        let st = self.reads.is_done.clone();
        let row = self
            .client()?
            .query_opt(&st, &[&to_i64(id.get())])
            .map_err(self.pg())?;
        row.map(|r| r.try_get::<_, bool>(0))
            .transpose()
            .map(|d| d.unwrap_or(false))
            .map_err(self.pg())
    }

    /// A job's status history, oldest first.
    pub fn history(&mut self, id: JobId) -> Result<Vec<HistoryRow>, StoreError> {
        let st = self.reads.history.clone();
        let rows = self
            .client()?
            .query(&st, &[&to_i64(id.get())])
            .map_err(self.pg())?;
        rows.iter()
            .map(|r| {
                let state: String = r.try_get(0).map_err(self.pg())?;
                Ok(HistoryRow {
                    state: serde_json::from_str(&state).map_err(|e| {
                        StoreError::ForeignDatabase {
                            target: self.target.clone(),
                            reason: format!("corrupt row: job {id} history: {e}"),
                        }
                    })?,
                    at_ms: to_u64(r.try_get(1).map_err(self.pg())?),
                })
            })
            .collect()
    }

    /// A job's attempts (M32), oldest first, at most the last [`MAX_ATTEMPT_ROWS`].
    pub fn attempts(&mut self, id: JobId) -> Result<Vec<AttemptRow>, StoreError> {
        let st = self.reads.attempts.clone();
        let rows = self
            .client()?
            .query(&st, &[&to_i64(id.get()), &MAX_ATTEMPT_ROWS])
            .map_err(self.pg())?;
        let mut out = rows
            .iter()
            .map(|r| {
                Ok::<_, postgres::Error>(AttemptRow {
                    attempt: u32::try_from(r.try_get::<_, i64>(0)?).unwrap_or(u32::MAX),
                    lease: to_u64(r.try_get(1)?),
                    node: r.try_get(2)?,
                    epoch: to_u64(r.try_get(3)?),
                    started_at_ms: to_u64(r.try_get(4)?),
                    ended_at_ms: r.try_get::<_, Option<i64>>(5)?.map(to_u64),
                    status: r.try_get(6)?,
                    cause: r.try_get(7)?,
                    exit_code: r.try_get(8)?,
                    error: r.try_get(9)?,
                    outcome: r.try_get(10)?,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(self.pg())?;
        out.reverse();
        Ok(out)
    }

    /// Jobs, newest first, as [`crate::mill_store::MillReader::jobs`] answers them.
    pub fn jobs(
        &mut self,
        state: Option<&str>,
        before: Option<JobId>,
        limit: usize,
    ) -> Result<Vec<JobRow>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let below = before.map_or(i64::MAX, |b| to_i64(b.get()));
        let rows = match state {
            None => {
                let st = self.reads.jobs_all.clone();
                self.client()?.query(&st, &[&limit, &below])
            }
            Some("active") => {
                let st = self.reads.jobs_active.clone();
                self.client()?.query(&st, &[&limit, &below])
            }
            Some("done") => {
                let st = self.reads.jobs_done.clone();
                self.client()?.query(&st, &[&limit, &below])
            }
            Some(s) => {
                let st = self.reads.jobs_state.clone();
                self.client()?.query(&st, &[&limit, &below, &s])
            }
        }
        .map_err(self.pg())?;
        self.job_rows(rows)
    }
}

impl Drop for PgReader {
    /// The client runs its own runtime, which must not be dropped inside an async task
    /// (where the HTTP API's reader may be dropped at shutdown): drop it on a thread.
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            let _ = std::thread::Builder::new()
                .name("pg-reader-close".into())
                .spawn(move || drop(conn));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mill_store::tests::{check_mirror, check_retention, m29_batches, spec};
    use crate::store::{Reader, Store, StoreLocation};
    use crate::test_pg::TestPg;
    use millrace_core::mill::JobRecord;

    fn url(s: &str) -> PgUrl {
        match StoreLocation::parse(s).unwrap() {
            StoreLocation::Postgres(u) => u,
            other => panic!("not postgres: {other}"),
        }
    }

    /// Campaigns as `holder` and opens the store under the won term.
    fn open_as(u: &PgUrl, holder: &str) -> PgStore {
        let mut l = PgLeadership::connect(u).unwrap();
        let term = l
            .campaign(
                holder,
                "127.0.0.1:7071",
                "http-127.0.0.1:7071",
                Duration::from_secs(60),
            )
            .unwrap()
            .unwrap();
        PgStore::open(u, term).unwrap()
    }

    fn insert(job: u64) -> MillBatch {
        MillBatch {
            writes: vec![
                MillWrite::Counters {
                    next_job: JobId(job + 1),
                    lease_floor: millrace_core::LeaseId(1),
                },
                MillWrite::JobInsert {
                    job: JobId(job),
                    record: Box::new(JobRecord {
                        spec: spec(),
                        submitted_at_ms: 1,
                        state: JobState::Queued,
                    }),
                },
            ],
        }
    }

    #[test]
    fn m29_pg_store_mirrors_the_reference_snapshot() {
        let Some(pg) = TestPg::start("m29_pg_store_mirrors_the_reference_snapshot") else {
            return;
        };
        let u = url(&pg.url_of("postgres"));
        check_mirror(&mut || Store::Postgres(Box::new(open_as(&u, "mill-a"))));
    }

    #[test]
    fn pg_retention_deletes_only_finished_jobs_oldest_first_within_the_batch() {
        let Some(pg) = TestPg::start("pg_retention") else {
            return;
        };
        let u = url(&pg.url_of("postgres"));
        check_retention(Store::Postgres(Box::new(open_as(&u, "mill-a"))));
    }

    /// DESIGN §10 (I13's store side): one holder at a time, terms only grow, a deposed
    /// store's writes fail and leave nothing, and a campaign waits for a write in flight.
    #[test]
    fn pg_one_term_writes_at_a_time_and_a_deposed_mill_writes_nothing() {
        let Some(pg) = TestPg::start("pg_one_term_writes_at_a_time") else {
            return;
        };
        let u = url(&pg.url_of("postgres"));
        let lease = Duration::from_secs(60);
        let mut a = PgLeadership::connect(&u).unwrap();
        let mut b = PgLeadership::connect(&u).unwrap();
        assert_eq!(a.leader().unwrap(), None);
        let t1 = a
            .campaign("a", "addr-a", "http-addr-a", lease)
            .unwrap()
            .unwrap();
        assert_eq!(
            b.campaign("b", "addr-b", "http-addr-b", lease).unwrap(),
            None,
            "a holds it"
        );
        let info = b.leader().unwrap().unwrap();
        assert_eq!(
            (
                info.term,
                info.holder.as_str(),
                info.address.as_str(),
                info.http_address.as_str()
            ),
            (t1, "a", "addr-a", "http-addr-a")
        );
        assert!(info.expires_in > Duration::from_secs(50), "{info:?}");
        assert!(a.renew("a", t1, lease).unwrap());
        assert!(!b.renew("b", t1, lease).unwrap(), "b does not hold it");
        let mut store_a = PgStore::open(&u, t1).unwrap();
        store_a.apply(&[insert(1)], 5).unwrap();

        // A restart of the same holder takes a new term; the old term's writes fail.
        let t2 = a
            .campaign("a", "addr-a", "http-addr-a", lease)
            .unwrap()
            .unwrap();
        assert!(t2 > t1);
        let err = store_a.apply(&[insert(2)], 6).unwrap_err();
        assert!(
            matches!(err, StoreError::Deposed { held, current: Some(c) } if held == t1 && c == t2),
            "{err}"
        );
        assert!(
            !a.renew("a", t1, lease).unwrap(),
            "an old term is not renewed"
        );

        // Resigning ends the lease but keeps the term: b's is higher.
        assert!(a.resign("a", t2).unwrap());
        let t3 = b
            .campaign("b", "addr-b", "http-addr-b", lease)
            .unwrap()
            .unwrap();
        assert!(t3 > t2);
        assert_eq!(
            a.campaign("a", "addr-a", "http-addr-a", lease).unwrap(),
            None,
            "b holds it"
        );
        let mut store_b = PgStore::open(&u, t3).unwrap();
        let snap = store_b.load().unwrap().unwrap_or_default();
        assert_eq!(
            snap.jobs.keys().copied().collect::<Vec<_>>(),
            vec![JobId(1)],
            "the deposed write left nothing"
        );

        // An expired lease (by the database's clock) may be taken over.
        assert!(b.renew("b", t3, Duration::ZERO).unwrap());
        assert!(
            !b.renew("b", t3, lease).unwrap(),
            "the lease already expired"
        );
        let t4 = a
            .campaign("a", "addr-a", "http-addr-a", lease)
            .unwrap()
            .unwrap();
        assert!(t4 > t3);
        let err = store_b
            .purge_finished(u64::MAX, None, 10, |_| false)
            .unwrap_err();
        assert!(matches!(err, StoreError::Deposed { .. }), "{err}");

        // A campaign during a write transaction waits for it: the write that took the row
        // lock first commits under the old term, then the term moves on.
        let mut store_a = PgStore::open(&u, t4).unwrap();
        let mut blocker = postgres::Client::connect(&pg.url_of("postgres"), NoTls).unwrap();
        let mut watch = postgres::Client::connect(&pg.url_of("postgres"), NoTls).unwrap();
        let wait_until = |watch: &mut postgres::Client, n: i64| {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let waiting: i64 = watch
                    .query_one("SELECT count(*) FROM pg_locks WHERE NOT granted", &[])
                    .unwrap()
                    .get(0);
                if waiting >= n {
                    return;
                }
                assert!(std::time::Instant::now() < deadline, "no {n} waiting locks");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let mut a2 = PgLeadership::connect(&u).unwrap();
        assert!(a2.renew("a", t4, Duration::ZERO).unwrap());
        let mut hold = blocker.transaction().unwrap();
        hold.batch_execute("LOCK TABLE quarantine IN EXCLUSIVE MODE")
            .unwrap();
        let writer = std::thread::spawn(move || {
            let r = store_a.apply(
                &[MillBatch {
                    writes: vec![MillWrite::Quarantine {
                        node: millrace_core::NodeId::new("n10").unwrap(),
                        quarantined: true,
                    }],
                }],
                8,
            );
            (r, store_a)
        });
        wait_until(&mut watch, 1); // the writer holds the leader row, waits on quarantine
        let u2 = u.clone();
        let campaigner = std::thread::spawn(move || {
            let mut b = PgLeadership::connect(&u2).unwrap();
            b.campaign("b", "addr-b", "http-addr-b", Duration::from_secs(60))
        });
        wait_until(&mut watch, 2); // the campaign waits behind the writer's share lock
        assert!(!campaigner.is_finished(), "the campaign did not wait");
        hold.commit().unwrap();
        let (r, mut store_a) = writer.join().unwrap();
        r.unwrap();
        let t5 = campaigner.join().unwrap().unwrap().unwrap();
        assert!(t5 > t4);
        let quarantined = store_b_load(&u, t5);
        assert!(quarantined.contains(&millrace_core::NodeId::new("n10").unwrap()));
        let err = store_a.apply(&[insert(3)], 9).unwrap_err();
        assert!(matches!(err, StoreError::Deposed { .. }), "{err}");
    }

    /// I13, §10: a mill paused inside a write transaction (SIGSTOP between its term check
    /// and its commit) holds the leader row's share lock; PostgreSQL ends its session once
    /// it idles there for `IDLE_IN_TRANSACTION`, so a standby's campaign goes through
    /// instead of waiting for the paused mill to resume, and the paused write never lands.
    #[test]
    fn i13_pg_a_writer_paused_inside_its_transaction_does_not_block_the_takeover() {
        let Some(pg) = TestPg::start("i13_pg_a_writer_paused_inside_its_transaction") else {
            return;
        };
        let u = url(&pg.url_of("postgres"));
        let mut a = PgLeadership::connect(&u).unwrap();
        let t1 = a
            .campaign("a", "addr-a", "http-a", Duration::from_secs(60))
            .unwrap()
            .unwrap();
        let mut paused = connect(&u, false).unwrap();
        let shown: String = paused
            .client
            .query_one("SHOW idle_in_transaction_session_timeout", &[])
            .unwrap()
            .get(0);
        assert_eq!(shown, "5s");
        let mut tx = paused.client.transaction().unwrap();
        let term: i64 = tx
            .query_one(
                "SELECT term FROM millrace_leader WHERE id = 1 FOR SHARE",
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(to_u64(term), t1);
        // The lease ends while the writer sits paused holding the row.
        assert!(a.renew("a", t1, Duration::ZERO).unwrap());
        let u2 = u.clone();
        let campaigner = std::thread::spawn(move || {
            let mut b = PgLeadership::connect(&u2).unwrap();
            b.campaign("b", "addr-b", "http-b", Duration::from_secs(60))
        });
        // A liveness guard, not a speed check: without the bound it waits forever.
        let guard = std::time::Instant::now() + Duration::from_secs(120);
        while !campaigner.is_finished() {
            assert!(
                std::time::Instant::now() < guard,
                "the campaign never got the row"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let t2 = campaigner.join().unwrap().unwrap().unwrap();
        assert!(t2 > t1);
        // The paused writer resumes: its session is gone, so nothing it wrote lands.
        let resumed = tx
            .batch_execute("UPDATE counters SET next_job = next_job WHERE id = 1")
            .and_then(|()| tx.commit());
        assert!(resumed.is_err(), "the paused transaction survived");
    }

    fn store_b_load(u: &PgUrl, term: u64) -> std::collections::BTreeSet<millrace_core::NodeId> {
        let mut s = PgStore::open(u, term).unwrap();
        s.load().unwrap().unwrap_or_default().quarantined
    }

    #[test]
    fn pg_an_unreachable_store_is_named_without_its_password() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let u = url(&format!("postgres://mill:s3cret@127.0.0.1:{port}/millrace"));
        let err = PgStore::open(&u, 1).err().unwrap();
        let text = err.to_string();
        assert!(matches!(err, StoreError::Unreachable { .. }), "{text}");
        assert!(
            text.contains(&format!("mill@127.0.0.1:{port}/millrace")),
            "{text}"
        );
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[test]
    fn pg_a_foreign_or_newer_database_is_refused_and_left_alone() {
        let Some(pg) = TestPg::start("pg_a_foreign_or_newer_database_is_refused") else {
            return;
        };
        let other = pg.create_db("other_app");
        pg.sql(
            "other_app",
            "CREATE TABLE customers (id INT); INSERT INTO customers VALUES (1);",
        );
        let err = PgLeadership::connect(&url(&other)).err().unwrap();
        assert!(matches!(err, StoreError::ForeignDatabase { .. }), "{err}");
        assert!(err.to_string().contains("customers"), "{err}");
        let mut c = postgres::Client::connect(&other, NoTls).unwrap();
        let tables: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()",
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(tables, 1, "nothing was created");

        // A millrace store with someone else's table beside it.
        let mixed = pg.create_db("mixed");
        drop(PgLeadership::connect(&url(&mixed)).unwrap());
        pg.sql("mixed", "CREATE TABLE invoices (id INT)");
        let err = PgStore::open(&url(&mixed), 1).err().unwrap();
        assert!(err.to_string().contains("invoices"), "{err}");

        // A newer schema.
        let newer = pg.create_db("newer");
        drop(PgLeadership::connect(&url(&newer)).unwrap());
        pg.sql("newer", "UPDATE millrace_schema_version SET version = 99");
        let err = PgStore::open(&url(&newer), 1).err().unwrap();
        assert!(
            matches!(
                err,
                StoreError::NewerDatabase {
                    found: 99,
                    known: 2,
                    ..
                }
            ),
            "{err}"
        );
    }

    /// The HTTP API's reads answer the same on PostgreSQL as on SQLite for the same writes.
    #[test]
    fn pg_readers_answer_as_sqlite_readers_do() {
        let Some(pg) = TestPg::start("pg_readers_answer_as_sqlite_readers_do") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let mut sqlite = crate::store::open_sqlite(dir.path()).unwrap();
        let u = url(&pg.url_of("postgres"));
        let mut pgs = Store::Postgres(Box::new(open_as(&u, "mill-a")));
        for (i, b) in m29_batches().iter().enumerate() {
            let at = 100 + i as u64;
            sqlite.apply(std::slice::from_ref(b), at).unwrap();
            pgs.apply(std::slice::from_ref(b), at).unwrap();
        }
        let (mut r1, mut r2) = (sqlite.reader().unwrap(), pgs.reader().unwrap());
        let show = |r: &mut Reader| {
            let mut out = Vec::new();
            for id in [1, 2, 3] {
                let id = JobId(id);
                out.push(format!("{:?}", r.job(id).unwrap()));
                out.push(format!("{:?}", r.is_done(id).unwrap()));
                out.push(format!("{:?}", r.history(id).unwrap()));
                out.push(format!("{:?}", r.attempts(id).unwrap()));
            }
            for state in [
                None,
                Some("active"),
                Some("done"),
                Some("queued"),
                Some("cancelled"),
            ] {
                for before in [None, Some(JobId(2))] {
                    out.push(format!("{:?}", r.jobs(state, before, 10).unwrap()));
                }
            }
            out
        };
        let (a, b) = (show(&mut r1), show(&mut r2));
        assert_eq!(a, b);
        assert!(a.iter().any(|l| l.contains("retried_fenced")));
    }
}
