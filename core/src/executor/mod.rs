//! The executor's protocol state machine (DESIGN §5, E1–E12).
//!
//! An [`Executor`] holds seats for jobs the mill bids on, starts committed jobs through its
//! driver's engine, and streams their Running/Terminal events to the mill through a durable,
//! sequenced outbox that survives disconnects and restarts. Like the mill it is sans-IO: the
//! driver feeds [`ExecutorInput`]s with the current time, drains [`ExecutorOutput`]s in order,
//! and calls `handle(now, Tick)` at or after [`Executor::next_deadline`].
//!
//! Durability is expressed in output order: a [`ExecutorOutput::Persist`] must be durably
//! applied before the driver acts on any output after it. The executor changes its durable
//! state only through such batches, applying each to its own copy ([`Executor::durable`]),
//! so `ExecutorSnapshot::apply` over every persisted batch rebuilds exactly what it holds.
//!
//! Rooms: `config` (settings and defaults), `store` (durable state and writes), `seats`
//! (reservations, running jobs, admission), `session` (connection, Welcome, Ack, snapshots,
//! silence), `outbox` (appending and sending events), `leases` (mill commands and engine
//! reports), `backoff` (reconnect delays).

mod adopt;
mod backoff;
mod config;
mod leases;
mod outbox;
mod seats;
mod session;
mod store;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::job::{JobSpec, LogRef, TerminalStatus};
use crate::timers::TimerTable;
use crate::types::{ConnId, Epoch, JobId, LeaseId, NodeId, Time};
use crate::wire::{SessionTimers, ToExecutor, ToMill};

pub use config::{
    ConfigError, EngineConfig, ExecutorConfig, DEFAULT_BACKOFF_MAX, DEFAULT_BACKOFF_MIN,
    DEFAULT_LIVE_LOG_BUDGET, DEFAULT_LIVE_LOG_CHUNK, DEFAULT_OUTBOX_CAPACITY,
    DEFAULT_RECONNECT_GRACE, DEFAULT_SILENCE_TIMEOUT, DEFAULT_SNAPSHOT_INTERVAL,
    DEFAULT_STOP_GRACE, MAX_LIVE_LOG_CHUNK, SEAT_LOAD, SEAT_RESOURCE,
};
pub use store::{
    ExecutorBatch, ExecutorSnapshot, ExecutorWrite, StopReason, StoreError, StoredJob,
};

use backoff::Backoff;
use seats::Seats;
use session::Link;

/// The terminal error of a job whose supervisor was gone when the executor restarted (E9).
pub const RESTARTED: &str = "executor restarted";
/// The terminal error of a job stopped by self-fencing (E12).
pub const LOST_CONTACT: &str = "executor lost contact with the mill";

/// Something that happened to the executor.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ExecutorInput {
    /// The connection asked for by [`ExecutorOutput::Connect`] is up.
    Connected {
        /// The driver's number for it.
        conn: ConnId,
    },
    /// The connection asked for by [`ExecutorOutput::Connect`] could not be made.
    ConnectFailed,
    /// A message from the mill.
    Message {
        /// The connection it came on.
        conn: ConnId,
        /// The message.
        msg: ToExecutor,
    },
    /// A connection closed (either side, or the network).
    Disconnected {
        /// The connection.
        conn: ConnId,
    },
    /// The engine started the job of `lease`.
    JobStarted {
        /// The lease.
        lease: LeaseId,
    },
    /// Answer to [`ExecutorOutput::AdoptJob`]: the job is gone and its supervisor recorded
    /// no status (it died with the previous process): it ends Failed "executor restarted"
    /// (E9). A job that still runs is answered with `JobStarted`; one that ended while the
    /// executor was down, with `JobExited` and the status its supervisor recorded (E14).
    JobLost {
        /// The lease.
        lease: LeaseId,
    },
    /// The engine's job under `lease` ended (ran out, failed to start, or was stopped).
    JobExited {
        /// The lease.
        lease: LeaseId,
        /// How the engine says it ended (a requested stop overrides it).
        status: TerminalStatus,
        /// The process exit code, if one ran.
        exit_code: Option<i32>,
        /// Why it failed, if it did.
        error: Option<String>,
        /// Its log; must satisfy M25 or it is left out.
        log: Option<LogRef>,
    },
    /// Output of a running job, forwarded best effort as `LiveLog` (E15).
    JobLog {
        /// The lease.
        lease: LeaseId,
        /// Position of the first byte in the job's output (its log file): the engine's count,
        /// which goes on across executor restarts (E14), so bytes nobody forwarded show as
        /// a hole.
        offset: u64,
        /// Raw bytes.
        bytes: Vec<u8>,
    },
    /// The process is shutting down: take no new seats; running jobs go on.
    Drain,
    /// A deadline passed (see [`Executor::next_deadline`]).
    Tick,
}

/// Something the driver must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecutorOutput {
    /// Open a connection to `config.mills[mill]`; answer with `Connected` or
    /// `ConnectFailed`.
    Connect {
        /// Index into [`ExecutorConfig::mills`].
        mill: usize,
    },
    /// Send a message on a connection.
    Send {
        /// The connection.
        conn: ConnId,
        /// The message.
        msg: ToMill,
    },
    /// Close a connection.
    Close {
        /// The connection.
        conn: ConnId,
        /// Why, for logs.
        reason: String,
    },
    /// Apply these writes atomically before acting on any later output.
    Persist(ExecutorBatch),
    /// Start a committed job; report `JobStarted`, then `JobExited`.
    StartJob {
        /// The lease it runs under.
        lease: LeaseId,
        /// The job.
        job: JobId,
        /// What to run.
        spec: JobSpec,
        /// Secrets for its environment (never persisted).
        secrets: BTreeMap<String, String>,
    },
    /// Re-attach to a job a previous process of this executor started, through its
    /// supervisor (E9, E14); never start it again. Answer `JobStarted` if it still runs (its
    /// output follows as `JobLog`, its end as `JobExited`), `JobExited` with the status its
    /// supervisor recorded if it ended while the executor was down, or `JobLost` if nothing
    /// of it is left. Emitted only by [`Executor::new`], before any other output.
    AdoptJob {
        /// The lease it runs under.
        lease: LeaseId,
        /// The job.
        job: JobId,
    },
    /// Stop a job politely, kill it after `grace`, then report `JobExited`.
    StopJob {
        /// The lease.
        lease: LeaseId,
        /// Time before the kill.
        grace: Duration,
    },
}

/// Why the executor could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    /// The loaded store is inconsistent.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// One deadline of the executor, keyed in its timer table.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// A reservation's ttl (E3); stopped when the seat is committed, released or cancelled.
    Expire(LeaseId),
    /// Self-fencing (E12); set only while a running job would be stopped by it.
    Fence,
    /// Making the last contact durable (E12), when no other batch carried it within a
    /// `snapshot_interval`; set only while jobs run and the store's contact is behind.
    Contact,
    /// The connection's next step: dial, give up on a silent peer, or the periodic snapshot
    /// (E10, E11). Always set: an executor always has a next thing to do about its link.
    Link,
}

/// Live-log budget per `snapshot_interval` window.
#[derive(Debug, Clone)]
struct LiveLogWindow {
    start: Time,
    used: usize,
}

/// The executor state machine. See the module docs.
#[derive(Debug)]
pub struct Executor {
    config: ExecutorConfig,
    /// What is durable: changed only through `persist`.
    durable: ExecutorSnapshot,
    seats: Seats,
    /// Every deadline, keyed (STYLE 13): nothing that ended keeps one.
    timers: TimerTable<Timer>,
    link: Link,
    /// Which of `config.mills` the link dials (or dialed) — DESIGN §10.
    mill: usize,
    /// A standby's redirect was followed at once since the last `Welcome`: the next one waits
    /// out the backoff, so two standbys naming each other cannot spin the executor.
    redirected: bool,
    backoff: Backoff,
    /// When the mill last said something we accepted (E12, silence). At start, the store's
    /// last contact (the fence clock survives restarts, E12/I1), or the start if it has none.
    last_heard: Time,
    /// Last snapshot seqno sent; strictly increasing for the life of the process (E10, M7).
    snapshot_seqno: u64,
    draining: bool,
    live_log: LiveLogWindow,
    /// Adopted jobs whose stop was asked for before the restart (E7, E12): the re-attached
    /// run is asked to stop again when the driver reports it still running (E14).
    restop: BTreeSet<LeaseId>,
    outputs: VecDeque<ExecutorOutput>,
}

impl Executor {
    /// Starts an executor on `store` (use [`ExecutorSnapshot::fresh`] for a new store).
    ///
    /// `config` should have passed [`ExecutorConfig::validate`] (or use [`Executor::try_new`]);
    /// an invalid one never panics but may, for instance, spin on zero intervals.
    /// Jobs the store still holds were started by a previous process under supervisors that
    /// outlive it: each is held as running and re-adopted (`AdoptJob`, E9/E14); only a job
    /// whose supervisor is gone ends Failed "executor restarted". Then it dials the mill.
    ///
    /// The fence clock (E12) starts at the store's last contact with the mill, never later
    /// than `now`, so restarts do not extend `reconnect_grace`: adopted jobs of a process
    /// started after that much silence are fenced at once. `now` must be on the same clock
    /// as the previous processes' (DESIGN §2).
    pub fn new(config: ExecutorConfig, store: ExecutorSnapshot, now: Time) -> Self {
        let backoff = Backoff::new(config.backoff_min, config.backoff_max, config.backoff_seed);
        let last_heard = store.last_contact.map_or(now, |at| at.min(now));
        let mut executor = Executor {
            config,
            durable: store,
            seats: Seats::default(),
            timers: TimerTable::default(),
            link: Link::Down { retry_at: now },
            mill: 0,
            redirected: false,
            backoff,
            last_heard,
            snapshot_seqno: 0,
            draining: false,
            live_log: LiveLogWindow {
                start: now,
                used: 0,
            },
            restop: BTreeSet::new(),
            outputs: VecDeque::new(),
        };
        executor.adopt_jobs_of_previous_process();
        executor.run_timers(now);
        executor.persist_contact_if_due(now);
        executor.sync_timers();
        executor
    }

    /// [`Executor::new`] after checking the config and the store.
    pub fn try_new(
        config: ExecutorConfig,
        store: ExecutorSnapshot,
        now: Time,
    ) -> Result<Self, StartError> {
        config.validate()?;
        store.validate()?;
        Ok(Self::new(config, store, now))
    }

    /// Feeds one input at `now`. Deadlines that passed are handled first, so the outcome
    /// depends only on the sequence of (time, input).
    pub fn handle(&mut self, now: Time, input: ExecutorInput) {
        self.run_timers(now);
        match input {
            ExecutorInput::Connected { conn } => self.on_connected(now, conn),
            ExecutorInput::ConnectFailed => self.on_connect_failed(now),
            ExecutorInput::Message { conn, msg } => self.on_message(now, conn, msg),
            ExecutorInput::Disconnected { conn } => self.on_disconnected(now, conn),
            ExecutorInput::JobStarted { lease } => self.on_job_started(lease),
            ExecutorInput::JobLost { lease } => self.on_job_lost(lease),
            ExecutorInput::JobExited {
                lease,
                status,
                exit_code,
                error,
                log,
            } => self.on_job_exited(lease, status, exit_code, error, log),
            ExecutorInput::JobLog {
                lease,
                offset,
                bytes,
            } => self.on_job_log(now, lease, offset, bytes),
            ExecutorInput::Drain => {
                self.draining = true;
                // E16: a draining executor starts nothing new, so what waits goes back.
                self.drop_all_waiting();
            }
            ExecutorInput::Tick => {}
        }
        self.fill_seats();
        self.persist_contact_if_due(now);
        self.snapshot_if_availability_changed();
        self.sync_timers();
    }

    /// The next thing the driver must do, in order.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<ExecutorOutput> {
        self.outputs.pop_front()
    }

    /// When to call `handle(now, Tick)` next.
    pub fn next_deadline(&self) -> Option<Time> {
        self.timers.next_deadline()
    }

    /// How many timers are set: one per reservation, the link's, and while a job runs
    /// self-fencing's and (when the store's last contact is behind) its durable clock's.
    /// Read-only, for benches and tests.
    pub fn timer_count(&self) -> usize {
        self.timers.len()
    }

    /// Checks the timer table against the state; `Err` names the first mismatch: a
    /// reservation without its ttl, a ttl of no reservation, or a fence, contact or link
    /// deadline other than the state implies.
    pub fn check_timers(&self) -> Result<(), String> {
        for (key, at) in self.timers.iter() {
            let live = match key {
                Timer::Expire(lease) => self.expiry(*lease),
                Timer::Fence => self.fence_deadline(),
                Timer::Contact => self.contact_deadline(),
                Timer::Link => self.link_deadline(),
            };
            if live != Some(at) {
                return Err(format!("timer {key:?} at {at:?}, the state says {live:?}"));
            }
        }
        for (lease, r) in &self.seats.reserved {
            if self.timers.get(&Timer::Expire(*lease)) != Some(r.expires) {
                return Err(format!("reservation {lease} has no ttl timer"));
            }
        }
        for (lease, w) in &self.seats.waiting {
            let want = w.secrets.is_none().then_some(w.reservation.expires);
            if self.timers.get(&Timer::Expire(*lease)) != want {
                return Err(format!("waiting lease {lease}: ttl timer, want {want:?}"));
            }
        }
        for (key, want) in [
            (Timer::Fence, self.fence_deadline()),
            (Timer::Contact, self.contact_deadline()),
            (Timer::Link, self.link_deadline()),
        ] {
            if self.timers.get(&key) != want {
                return Err(format!(
                    "{key:?}: timer {:?}, state {want:?}",
                    self.timers.get(&key)
                ));
            }
        }
        Ok(())
    }

    /// Sets the derived deadlines (fence, contact, link) from the state after each input;
    /// the reservations' ttls are set and stopped with their seats.
    fn sync_timers(&mut self) {
        for (key, at) in [
            (Timer::Fence, self.fence_deadline()),
            (Timer::Contact, self.contact_deadline()),
            (Timer::Link, self.link_deadline()),
        ] {
            match at {
                Some(at) => self.timers.set(key, at),
                None => {
                    self.timers.stop(&key);
                }
            }
        }
        if cfg!(debug_assertions) && self.timers.len() <= 512 {
            if let Err(e) = self.check_timers() {
                panic!("executor timer table out of step: {e}");
            }
        }
    }

    /// Holds a seat for `lease` until its ttl (E3).
    fn hold_reservation(&mut self, lease: LeaseId, reservation: seats::Reservation) {
        self.timers.set(Timer::Expire(lease), reservation.expires);
        self.seats.reserved.insert(lease, reservation);
    }

    /// E16: holds `lease` waiting for a seat, with its ttl until its commit comes (E3).
    fn hold_waiting(&mut self, lease: LeaseId, reservation: seats::Reservation) {
        self.timers.set(Timer::Expire(lease), reservation.expires);
        let waiting = seats::Waiting {
            reservation,
            secrets: None,
        };
        self.seats.waiting.insert(lease, waiting);
    }

    /// When `lease`'s ttl ends, if it holds one: a reservation, or a lease waiting for a seat
    /// whose commit has not come (E3, E16).
    fn expiry(&self, lease: LeaseId) -> Option<Time> {
        match self.seats.reserved.get(&lease) {
            Some(r) => Some(r.expires),
            None => self
                .seats
                .waiting
                .get(&lease)
                .filter(|w| w.secrets.is_none())
                .map(|w| w.reservation.expires),
        }
    }

    /// Lets a reservation go (committed, released, cancelled or expired), with its ttl.
    fn take_reservation(&mut self, lease: LeaseId) -> Option<seats::Reservation> {
        self.timers.stop(&Timer::Expire(lease));
        self.seats.reserved.remove(&lease)
    }

    /// This executor's name.
    pub fn node_id(&self) -> &NodeId {
        &self.config.node_id
    }

    /// The id of its durable store (E1).
    pub fn epoch(&self) -> Epoch {
        self.durable.epoch
    }

    /// The settings in force.
    pub fn config(&self) -> &ExecutorConfig {
        &self.config
    }

    /// The session timers this executor runs on: the last welcoming mill's, durable in its
    /// store, else its configured ones (M1, E12).
    pub fn timers(&self) -> SessionTimers {
        self.durable
            .timers
            .unwrap_or_else(|| self.config.session_timers())
    }

    /// The connection of the welcomed session, if one is up (drivers and checkers).
    pub fn session_conn(&self) -> Option<ConnId> {
        self.ready_conn()
    }

    /// What the executor holds as durable (everything persisted so far, applied).
    pub fn durable(&self) -> &ExecutorSnapshot {
        &self.durable
    }

    /// Leases holding a seat but not committed.
    pub fn reserved_leases(&self) -> impl Iterator<Item = LeaseId> + '_ {
        self.seats.reserved.keys().copied()
    }

    /// Leases waiting for a seat (E16): accepted direct asks, committed or not, that hold no
    /// seat yet.
    pub fn queued_leases(&self) -> impl Iterator<Item = LeaseId> + '_ {
        self.seats.waiting.keys().copied()
    }

    /// Leases whose job is running (committed and not yet reported ended).
    pub fn running_leases(&self) -> impl Iterator<Item = LeaseId> + '_ {
        self.seats.running.keys().copied()
    }

    /// Whether a session with the mill is established (welcomed).
    pub fn is_ready(&self) -> bool {
        matches!(self.link, Link::Ready(_))
    }

    /// Draining and nothing left: no seats held and every event acked.
    pub fn is_drained(&self) -> bool {
        self.draining
            && self.seats.reserved.is_empty()
            && self.seats.running.is_empty()
            && self.seats.waiting.is_empty()
            && self.durable.outbox.is_empty()
    }

    fn emit(&mut self, output: ExecutorOutput) {
        self.outputs.push_back(output);
    }

    /// Applies `writes` to the durable copy and asks the driver to persist them; every
    /// output emitted after this one depends on them being durable. A last contact newer
    /// than the store's rides along (E12): no batch of its own while batches are written.
    fn persist(&mut self, mut writes: Vec<ExecutorWrite>) {
        if writes.is_empty() {
            return;
        }
        if self.contact_is_behind() {
            writes.push(ExecutorWrite::Contact {
                at: self.last_heard,
            });
        }
        self.write_batch(writes);
    }

    /// `persist` without the contact riding along: for the contact's own batch.
    fn write_batch(&mut self, writes: Vec<ExecutorWrite>) {
        let batch = ExecutorBatch { writes };
        self.durable.apply(&batch);
        self.emit(ExecutorOutput::Persist(batch));
    }

    /// Everything time-driven, at `now`: reservation ttl (E3), self-fencing (E12), and the
    /// connection's timers (E10, E11, silence). The fence clock's own write is judged after
    /// the input instead (`persist_contact_if_due`), so that a batch the input writes anyway
    /// carries it.
    fn run_timers(&mut self, now: Time) {
        // Reservation ttls fire from the table; fence and link are judged from the state
        // (their timers are only re-set after the input, by `sync_timers`).
        let mut due = Vec::new();
        while let Some((_, key)) = self.timers.pop_due(now) {
            due.push(key);
        }
        for key in due {
            match key {
                Timer::Expire(lease) => {
                    let r = self
                        .seats
                        .reserved
                        .remove(&lease)
                        .or_else(|| self.seats.waiting.remove(&lease).map(|w| w.reservation));
                    debug_assert!(r.is_none_or(|r| r.expires <= now), "early ttl of {lease}");
                }
                Timer::Fence | Timer::Contact | Timer::Link => {}
            }
        }
        if self.fence_deadline().is_some_and(|d| now >= d) {
            self.fence();
        }
        self.run_link_timers(now);
    }

    /// Why new seats are refused right now, if they are.
    fn closed_reason(&self) -> Option<String> {
        if self.draining {
            return Some("draining: the executor is shutting down".to_string());
        }
        let owed = self.seats.events_owed();
        let held = self.durable.outbox.len();
        if held.saturating_add(owed).saturating_add(2) > self.config.outbox_capacity {
            return Some(format!(
                "outbox full: {held} unacked events and {owed} owed to seats in use, bound {}",
                self.config.outbox_capacity
            ));
        }
        None
    }
}
