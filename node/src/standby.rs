//! Leadership of a shared PostgreSQL store (DESIGN §10; issue 14 items 2 and 4).
//!
//! A mill started with `--store postgres://…` campaigns for the store's leader row. One that
//! loses stands by on its own listeners: `/health` says it is a standby and who leads, every
//! other route answers 503 naming the leader, and an executor's `Hello` is answered with
//! `Refused{leader}` carrying the leader's executor address (which the executor follows when
//! it is in its `--mill` list). It campaigns again every third of the lease; on a win it
//! hands its listeners (the same sockets, so nothing queued in their backlogs is lost) to
//! the leading mill, which restores from the store (M29) and is fail-closed until each node
//! reported (M29's restore).
//!
//! The leader renews its lease every third of it on a connection of its own ([`Watchdog`])
//! and steps down at once when a renewal finds the term moved on, or when no renewal has
//! succeeded for 90 % of the lease by its own monotonic clock. The lease in the row is
//! judged by the database's clock from the moment a renewal reaches it, always after the
//! renewal was sent, so the leader's own deadline falls first. Safety does not rest on
//! these timers: every write is conditional on the term (I13) and every executor refuses a
//! term lower than one it has seen (E13); the timers bound how long a deposed leader talks.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use millrace_core::wire::ToExecutor;
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::pg_store::{LeaderInfo, PgLeadership};
use crate::sqlite::StoreError;
use crate::store::PgUrl;

/// The default leader lease (`--leader-lease`).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(15);

/// Shortest and longest `--leader-lease`.
pub const LEASE_RANGE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(600));

/// Leadership settings of a mill on a shared store.
#[derive(Debug, Clone)]
pub struct HaSettings {
    /// How long a won or renewed leadership lasts by the database's clock.
    pub lease: Duration,
    /// The executor address written into the leader row (what standbys tell executors);
    /// `None`: the executor listener's bound address.
    pub advertise_executor: Option<String>,
    /// The HTTP address written into the leader row (what standbys tell API clients);
    /// `None`: the HTTP listener's bound address.
    pub advertise_http: Option<String>,
}

impl Default for HaSettings {
    fn default() -> Self {
        HaSettings {
            lease: DEFAULT_LEASE,
            advertise_executor: None,
            advertise_http: None,
        }
    }
}

impl HaSettings {
    /// Names the setting and the value when the lease is out of range.
    pub fn validate(&self) -> Result<(), String> {
        if self.lease < LEASE_RANGE.0 || self.lease > LEASE_RANGE.1 {
            return Err(format!(
                "--leader-lease {:?} is out of range: it must be between {:?} and {:?}",
                self.lease, LEASE_RANGE.0, LEASE_RANGE.1
            ));
        }
        for (name, v) in [
            ("--advertise-executor", &self.advertise_executor),
            ("--advertise-http", &self.advertise_http),
        ] {
            if let Some(v) = v {
                if v.is_empty() || v.len() > 256 || !v.contains(':') {
                    return Err(format!(
                        "{name} {v:?} is not an address: give host:port (1-256 bytes)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// How often a leader renews and a standby campaigns.
    pub fn period(&self) -> Duration {
        self.lease / 3
    }

    /// How long a leader goes without a successful renewal before it steps down.
    pub fn deadline(&self) -> Duration {
        self.lease - self.lease / 10
    }
}

/// What a mill puts in the leader row.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Its name (stable across restarts, distinct between mills).
    pub holder: String,
    /// Where its executors connect.
    pub executor: String,
    /// Where its HTTP API listens.
    pub http: String,
}

/// A won leadership, before the mill starts leading.
pub struct Won {
    /// The term won.
    pub term: u64,
    leadership: PgLeadership,
    /// When the winning campaign was sent: the lease runs from no earlier.
    sent: Instant,
}

impl Won {
    /// Campaigns once on a new connection: the win, or (while another mill's lease is live)
    /// the connection back with who leads.
    pub fn try_campaign(
        url: &PgUrl,
        who: &Candidate,
        lease: Duration,
    ) -> Result<Result<Won, (PgLeadership, Option<LeaderInfo>)>, StoreError> {
        let leadership = PgLeadership::connect(url)?;
        campaign_on(leadership, who, lease)
    }
}

/// One campaign on `leadership`: the win, or the connection back with who leads.
#[allow(clippy::type_complexity)]
fn campaign_on(
    mut leadership: PgLeadership,
    who: &Candidate,
    lease: Duration,
) -> Result<Result<Won, (PgLeadership, Option<LeaderInfo>)>, StoreError> {
    let sent = Instant::now();
    match leadership.campaign(&who.holder, &who.executor, &who.http, lease)? {
        Some(term) => Ok(Ok(Won {
            term,
            leadership,
            sent,
        })),
        None => {
            let leader = leadership.leader()?;
            Ok(Err((leadership, leader)))
        }
    }
}

/// Why a leader stopped leading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SteppedDown(pub String);

/// The leader's renewals, on a thread of their own (the sync client blocks).
pub struct Watchdog {
    /// Milliseconds since `base` of the last successful renewal's sending.
    last_ok: Arc<AtomicU64>,
    base: Instant,
    deadline: Duration,
    term: u64,
    reason: watch::Receiver<Option<SteppedDown>>,
    stop: std::sync::mpsc::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Starts renewing `won` every `ha.period()`.
    pub fn spawn(won: Won, holder: String, ha: &HaSettings) -> std::io::Result<Watchdog> {
        let base = won.sent;
        let last_ok = Arc::new(AtomicU64::new(0));
        let (reason_tx, reason) = watch::channel(None);
        let (stop, stop_rx) = std::sync::mpsc::channel::<()>();
        let term = won.term;
        let lease = ha.lease;
        let period = ha.period();
        let thread = {
            let last_ok = last_ok.clone();
            std::thread::Builder::new()
                .name("millrace-leader".into())
                .spawn(move || {
                    let mut leadership = won.leadership;
                    loop {
                        match stop_rx.recv_timeout(period) {
                            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                            _ => {
                                // A clean stop: the last commit is done; let a standby
                                // take over now rather than at the lease's end.
                                match leadership.resign(&holder, term) {
                                    Ok(true) => tracing::info!(term, "resigned the leadership"),
                                    Ok(false) => {}
                                    Err(e) => {
                                        tracing::warn!(term, error = %e, "could not resign the leadership; a standby takes over when the lease ends")
                                    }
                                }
                                return;
                            }
                        }
                        let sent = Instant::now();
                        match leadership.renew(&holder, term, lease) {
                            Ok(true) => {
                                let ms = u64::try_from(sent.duration_since(base).as_millis())
                                    .unwrap_or(u64::MAX);
                                last_ok.store(ms, Ordering::Release);
                            }
                            Ok(false) => {
                                let now = leadership.leader().ok().flatten();
                                let why = match now {
                                    Some(l) => format!(
                                        "the lease of term {term} was lost: {} leads term {} at {}",
                                        l.holder, l.term, l.address
                                    ),
                                    None => format!("the lease of term {term} was lost"),
                                };
                                let _ = reason_tx.send(Some(SteppedDown(why)));
                                return;
                            }
                            Err(e) => {
                                tracing::warn!(term, error = %e, "renewing the leadership failed; retrying");
                                if let Err(e) = reconnect(&mut leadership) {
                                    tracing::warn!(term, error = %e, "reconnecting for renewals failed");
                                }
                            }
                        }
                    }
                })?
        };
        Ok(Watchdog {
            last_ok,
            base,
            deadline: ha.deadline(),
            term,
            reason,
            stop,
            thread: Some(thread),
        })
    }

    /// `Some` once this mill must stop leading: a renewal found the term moved on, or none
    /// has succeeded within the deadline (a pause, a cut from the store).
    pub fn stepped_down(&self) -> Option<SteppedDown> {
        if let Some(r) = self.reason.borrow().clone() {
            return Some(r);
        }
        let last = Duration::from_millis(self.last_ok.load(Ordering::Acquire));
        let since = self.base.elapsed().saturating_sub(last);
        (since >= self.deadline).then(|| {
            SteppedDown(format!(
                "no renewal of term {} succeeded for {since:?} (the lease is judged by the store's clock; stepping down before it can end)",
                self.term
            ))
        })
    }

    /// Resigns (after the mill's last commit) and waits for the renewal thread, bounded.
    pub async fn resign(mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::task::spawn_blocking(move || t.join()),
            )
            .await;
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Dropped without `resign` (an error path): the thread, if still renewing, resigns;
        // the resign is conditional on holder and term, so after a step-down it is a no-op.
        let _ = self.stop.send(());
    }
}

/// Replaces a dead connection (a restarted server) with a new one.
fn reconnect(leadership: &mut PgLeadership) -> Result<(), StoreError> {
    let url = leadership.url().clone();
    *leadership = PgLeadership::connect(&url)?;
    Ok(())
}

/// What a standby knows of the leader, shared with its servers.
type View = Arc<Mutex<Option<LeaderInfo>>>;

fn leader_json(l: &LeaderInfo) -> serde_json::Value {
    json!({
        "holder": l.holder,
        "term": l.term,
        "executor_address": l.address,
        "http_address": l.http_address,
        "lease_ends_in_ms": u64::try_from(l.expires_in.as_millis()).unwrap_or(u64::MAX),
    })
}

fn view_of(view: &View) -> Option<LeaderInfo> {
    view.lock().map(|v| v.clone()).unwrap_or(None)
}

async fn standby_health(State(view): State<View>) -> Json<serde_json::Value> {
    let leader = view_of(&view);
    Json(json!({
        "status": "ok",
        "role": "standby",
        "leader": leader.as_ref().map(leader_json),
    }))
}

async fn standby_elsewhere(State(view): State<View>) -> Response {
    let leader = view_of(&view);
    let error = match &leader {
        Some(l) if !l.http_address.is_empty() => format!(
            "this mill is a standby: {} leads (term {}); send API requests to http(s)://{}",
            l.holder, l.term, l.http_address
        ),
        Some(l) => format!(
            "this mill is a standby: {} leads (term {})",
            l.holder, l.term
        ),
        None => "this mill is a standby and no mill leads yet".to_string(),
    };
    let body = json!({"error": error, "leader": leader.as_ref().map(leader_json)});
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
        Json(body),
    )
        .into_response()
}

/// The standby's HTTP routes: `/health` and a 503 naming the leader for everything else.
fn standby_router(view: View) -> Router {
    Router::new()
        .route("/health", get(standby_health))
        .fallback(standby_elsewhere)
        .with_state(view)
}

/// What the standby's servers need from the mill's settings.
pub struct StandbyServe {
    /// The executors' credential (a standby answers only an authenticated `Hello`).
    pub preauth: crate::preauth::PreauthConfig,
    /// HTTP bounds.
    pub limits: crate::http::HttpLimits,
    /// TLS, as the leader would serve it.
    pub tls: Option<crate::tls::MillTls>,
    /// Accepted-connection budget.
    pub fds: Arc<crate::net::FdBudget>,
}

/// Both listeners as std sockets, so a standby's servers can take copies and the leader
/// the originals.
pub struct Listeners {
    /// The executor listener.
    pub executor: std::net::TcpListener,
    /// The HTTP listener.
    pub http: std::net::TcpListener,
}

impl Listeners {
    /// Binds both.
    pub async fn bind(executor: &str, http: &str) -> Result<Listeners, crate::node::NodeError> {
        let io = |what: String| move |source| crate::node::NodeError::Io { what, source };
        let e = TcpListener::bind(executor)
            .await
            .map_err(io(format!("executor listener {executor}")))?;
        let h = TcpListener::bind(http)
            .await
            .map_err(io(format!("HTTP listener {http}")))?;
        // HA over PostgreSQL is not simulated (issue 16: the madsim build has no such store).
        #[cfg(madsim)]
        {
            let _ = (e, h);
            return Err(io("standby listeners".to_string())(std::io::Error::other(
                "standing by is not simulated",
            )));
        }
        #[cfg(not(madsim))]
        Ok(Listeners {
            executor: e.into_std().map_err(io("executor listener".to_string()))?,
            http: h.into_std().map_err(io("HTTP listener".to_string()))?,
        })
    }

    /// Bound addresses.
    pub fn addrs(&self) -> std::io::Result<(SocketAddr, SocketAddr)> {
        Ok((self.executor.local_addr()?, self.http.local_addr()?))
    }

    fn copies(&self) -> std::io::Result<(TcpListener, TcpListener)> {
        let e = self.executor.try_clone()?;
        let h = self.http.try_clone()?;
        e.set_nonblocking(true)?;
        h.set_nonblocking(true)?;
        #[cfg(madsim)]
        return Err(std::io::Error::other("standing by is not simulated"));
        #[cfg(not(madsim))]
        Ok((TcpListener::from_std(e)?, TcpListener::from_std(h)?))
    }
}

/// Stands by until this mill wins the store's leadership (`Some`) or `stop` fires (`None`).
/// Fails at once for a store it cannot use (unreachable at start, foreign, newer); later
/// connection failures are retried every period.
pub async fn stand_by(
    url: &PgUrl,
    who: &Candidate,
    ha: &HaSettings,
    listeners: &Listeners,
    serve: StandbyServe,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Option<Won>, crate::node::NodeError> {
    let (u, w, lease) = (url.clone(), who.clone(), ha.lease);
    let first = tokio::task::spawn_blocking(move || Won::try_campaign(&u, &w, lease))
        .await
        .map_err(|e| crate::node::NodeError::Config(format!("campaigning: {e}")))??;
    let (mut leadership, leader) = match first {
        Ok(won) => return Ok(Some(won)),
        Err(lost) => lost,
    };
    let view: View = Arc::new(Mutex::new(leader.clone()));
    log_leader(None, leader.as_ref());
    let (shutdown, shutdown_rx) = watch::channel(false);
    let (exec_l, http_l) = listeners
        .copies()
        .map_err(|source| crate::node::NodeError::Io {
            what: "standby listeners".into(),
            source,
        })?;
    let tls = serve.tls;
    let tasks = [
        tokio::spawn(refuse_executors(
            exec_l,
            Arc::new(crate::preauth::Preauth::new(serve.preauth)),
            serve.fds.clone(),
            tls.as_ref()
                .map(|t| tokio_rustls::TlsAcceptor::from(t.executor.clone())),
            view.clone(),
            shutdown_rx.clone(),
        )),
        tokio::spawn(crate::http::serve(
            http_l,
            standby_router(view.clone()),
            serve.limits,
            serve.fds,
            tls.as_ref()
                .map(|t| tokio_rustls::TlsAcceptor::from(t.http.clone())),
            shutdown_rx,
        )),
    ];
    tokio::pin!(stop);
    let won = loop {
        tokio::select! {
            biased;
            () = &mut stop => break None,
            () = tokio::time::sleep(ha.period()) => {}
        }
        let w = who.clone();
        let (back, round) = tokio::task::spawn_blocking(move || {
            match campaign_on(leadership, &w, lease) {
                Ok(Ok(won)) => (None, Round::Won(Box::new(won))),
                Ok(Err((l, leader))) => (Some(l), Round::Lost(leader)),
                // The connection may be dead (a restarted server): a fresh one next time.
                Err(e) => (None, Round::Failed(e)),
            }
        })
        .await
        .map_err(|e| crate::node::NodeError::Config(format!("campaigning: {e}")))?;
        match round {
            Round::Won(won) => break Some(*won),
            Round::Lost(now) => {
                let before = view_of(&view);
                log_leader(before.as_ref(), now.as_ref());
                if let Ok(mut v) = view.lock() {
                    *v = now;
                }
            }
            Round::Failed(e) => {
                tracing::warn!(error = %e, "campaigning for the store's leadership failed; retrying");
            }
        }
        leadership = match back {
            Some(l) => l,
            None => continue_connect(url, ha).await,
        };
    };
    let _ = shutdown.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    if let Some(w) = &won {
        tracing::info!(term = w.term, holder = %who.holder, "won the store's leadership: restoring and taking over");
    }
    Ok(won)
}

/// One campaign's outcome.
enum Round {
    Won(Box<Won>),
    Lost(Option<LeaderInfo>),
    Failed(StoreError),
}

/// Connects until it works, one attempt per period.
async fn continue_connect(url: &PgUrl, ha: &HaSettings) -> PgLeadership {
    loop {
        let u = url.clone();
        match tokio::task::spawn_blocking(move || PgLeadership::connect(&u)).await {
            Ok(Ok(l)) => return l,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "reconnecting to the store failed; retrying");
            }
            Err(e) => tracing::warn!(error = %e, "reconnecting to the store failed; retrying"),
        }
        tokio::time::sleep(ha.period()).await;
    }
}

fn log_leader(before: Option<&LeaderInfo>, now: Option<&LeaderInfo>) {
    let same = |a: &LeaderInfo, b: &LeaderInfo| a.term == b.term && a.holder == b.holder;
    match (before, now) {
        (Some(b), Some(n)) if same(b, n) => {}
        (_, Some(n)) => tracing::info!(
            leader = %n.holder,
            term = n.term,
            executor_address = %n.address,
            http_address = %n.http_address,
            "standing by: another mill leads the store"
        ),
        (_, None) => tracing::info!("standing by: no mill leads the store yet"),
    }
}

/// The standby's executor port: an authenticated `Hello` is answered with `Refused` naming
/// the leader's executor address, then closed.
async fn refuse_executors(
    listener: TcpListener,
    preauth: Arc<crate::preauth::Preauth>,
    fds: Arc<crate::net::FdBudget>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    view: View,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait_for(|s| *s) => return,
            a = listener.accept() => a,
        };
        let Ok((stream, peer)) = accepted else {
            tokio::time::sleep(crate::node::ACCEPT_BACKOFF).await;
            continue;
        };
        let Some(fd) = fds.take() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let preauth = preauth.clone();
        let view = view.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _fd = fd;
            let leader = view_of(&view);
            let msg = ToExecutor::Refused {
                reason: match &leader {
                    Some(l) => format!(
                        "not leader: this mill is a standby; {} leads term {} at {}",
                        l.holder, l.term, l.address
                    ),
                    None => "not leader: this mill is a standby and no mill leads yet".into(),
                },
                leader: leader.map(|l| l.address).filter(|a| !a.is_empty()),
            };
            match tls {
                None => {
                    if let Ok((s, _)) = preauth.admit(async { Ok((stream, None)) }).await {
                        refuse(s, &msg).await;
                    }
                }
                Some(acceptor) => {
                    if let Ok((s, _)) = preauth
                        .admit(crate::node::tls_accept(acceptor, stream, peer))
                        .await
                    {
                        refuse(s, &msg).await;
                    }
                }
            }
        });
    }
}

async fn refuse<S: tokio::io::AsyncWrite + Unpin>(mut stream: S, msg: &ToExecutor) {
    let mut frame = Vec::new();
    if millrace_core::codec::encode_into(msg, &mut frame).is_ok() {
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            stream.write_all(&frame).await?;
            stream.flush().await?;
            stream.shutdown().await
        })
        .await;
    }
}
