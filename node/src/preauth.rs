//! The executor port before `Hello`: what a peer that has not yet shown a token may cost.
//!
//! A fresh connection is not the mill driver's business until it has sent a `Hello` with the
//! executor token. Until then its connection task alone handles it, within four bounds:
//!
//! - **frame size**: the first frame may announce at most [`PREAUTH_MAX_FRAME`] bytes (a
//!   `Hello` at every wire bound fits in about 7 KiB), checked on the 4-byte prefix before
//!   any body byte is buffered, and the body buffer is exactly the announced length;
//! - **deadline**: the TLS handshake (when TLS is on) and the `Hello` together must be in
//!   within `--hello-timeout` (default 5 s), so a slow handshake holds a slot no longer than a
//!   slow `Hello`;
//! - **budget**: at most `--max-preauth-connections` (default 512) connections wait for their
//!   `Hello` at once, counted apart from sessions (`--max-sessions`) so tokenless peers never
//!   crowd executors out. When the budget is full the *oldest* waiting connection is closed
//!   to make room: an honest executor sends its `Hello` right after connecting, so it is
//!   never the oldest for long, while a flood has to outpace its own arrivals to keep a slot;
//! - **logs**: rejections are counted per reason (`millrace_preauth_rejected_total`) and
//!   logged at most once per [`LOG_EVERY`] per reason, with how many were not logged.
//!
//! A `Hello` with a wrong token is answered with `Refused` here, so the executor still hears
//! why; the mill's own check (M1) stays as a second line. With mutual TLS, a `Hello` whose
//! node id the client certificate does not name is refused here too (issue 11 item 4; the
//! rule is in `tls`): the certificate binds the connection to one node id.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;

use crate::metrics::Labels;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use millrace_core::codec::{decode_to_mill, encode_into, CodecError, PREFIX_LEN};
use std::future::Future;

use millrace_core::wire::{ToExecutor, ToMill};
use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;

/// Largest first frame a peer may announce before it has authenticated. A `Hello` at every
/// wire bound (128-byte node id, 1 KiB token, 64 labels and 16 engines of 64 bytes) is about
/// 7 KiB.
pub const PREAUTH_MAX_FRAME: usize = 16 * 1024;

/// At most one log line per reason this often.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// Settings of the pre-`Hello` phase.
#[derive(Debug, Clone)]
pub struct PreauthConfig {
    /// How long a new connection has to deliver its `Hello`.
    pub hello_timeout: Duration,
    /// Connections waiting for their `Hello` at once, at most.
    pub max_connections: usize,
    /// The executor token a `Hello` must carry.
    pub token: String,
}

/// Why a connection was closed before its `Hello` was accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reject {
    /// No complete `Hello` within the deadline.
    Timeout,
    /// Closed to make room for a newer connection (the budget was full).
    Evicted,
    /// The first frame announced more than [`PREAUTH_MAX_FRAME`] bytes.
    TooLarge,
    /// The first frame was not a decodable message.
    Malformed,
    /// The first message was not a `Hello`.
    NotHello,
    /// The `Hello` spoke another protocol version.
    Version,
    /// The `Hello` carried a wrong token.
    Token,
    /// The peer closed or the socket failed before the `Hello` was in.
    Closed,
    /// The TLS handshake failed (wrong CA, no or bad client certificate, not TLS at all).
    Handshake,
    /// With mutual TLS: the `Hello`'s node id is not the one the client certificate names.
    Identity,
    /// Accepting it would have eaten into the descriptors kept for the store and the logs
    /// ([`crate::net::FdBudget`]).
    FdReserve,
}

impl Reject {
    /// Every reason, for metrics.
    pub const ALL: [Reject; REASONS] = [
        Reject::Timeout,
        Reject::Evicted,
        Reject::TooLarge,
        Reject::Malformed,
        Reject::NotHello,
        Reject::Version,
        Reject::Token,
        Reject::Closed,
        Reject::Handshake,
        Reject::Identity,
        Reject::FdReserve,
    ];

    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            Reject::Timeout => "timeout",
            Reject::Evicted => "evicted",
            Reject::TooLarge => "too_large",
            Reject::Malformed => "malformed",
            Reject::NotHello => "not_hello",
            Reject::Version => "version",
            Reject::Token => "token",
            Reject::Closed => "closed",
            Reject::Handshake => "tls_handshake",
            Reject::Identity => "identity",
            Reject::FdReserve => "fd_reserve",
        }
    }

    fn index(self) -> usize {
        match self {
            Reject::Timeout => 0,
            Reject::Evicted => 1,
            Reject::TooLarge => 2,
            Reject::Malformed => 3,
            Reject::NotHello => 4,
            Reject::Version => 5,
            Reject::Token => 6,
            Reject::Closed => 7,
            Reject::Handshake => 8,
            Reject::Identity => 9,
            Reject::FdReserve => 10,
        }
    }
}

/// How many reasons there are.
const REASONS: usize = 11;

/// A connection turned away before `Hello`, with what to tell the log.
#[derive(Debug)]
pub struct Rejected {
    /// The reason, as counted.
    pub kind: Reject,
    /// Details for the log line.
    pub detail: String,
}

/// One log gate per reason: the first line of each window is logged with how many were
/// suppressed since the previous one.
#[derive(Debug, Default)]
struct Gate {
    last: Option<Instant>,
    suppressed: u64,
}

/// The shared pre-`Hello` state: the budget and the counters.
#[derive(Debug)]
pub struct Preauth {
    config: PreauthConfig,
    waiting: Mutex<Waiting>,
    admitted: Counter,
    rejected: Family<Labels, Counter>,
    waiting_gauge: Gauge,
    registry: Registry,
    gates: Mutex<[Gate; REASONS]>,
}

#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    /// Oldest first; dropping a sender closes that connection.
    slots: BTreeMap<u64, oneshot::Sender<()>>,
}

/// A slot in the pre-`Hello` budget; freed when dropped.
pub struct Slot<'a> {
    owner: &'a Preauth,
    id: u64,
    evicted: oneshot::Receiver<()>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Ok(mut w) = self.owner.waiting.lock() {
            w.slots.remove(&self.id);
        }
    }
}

impl Preauth {
    /// A fresh budget.
    pub fn new(config: PreauthConfig) -> Self {
        let admitted: Counter = Counter::default();
        let rejected: Family<Labels, Counter> = Family::default();
        let waiting_gauge: Gauge = Gauge::default();
        for r in Reject::ALL {
            rejected
                .get_or_create(&vec![("reason", r.name().to_string())])
                .inc_by(0);
        }
        let mut registry = Registry::default();
        registry.register(
            "millrace_preauth_waiting",
            "Executor connections waiting for their Hello",
            waiting_gauge.clone(),
        );
        registry.register(
            "millrace_preauth_admitted",
            "Connections whose Hello (with a valid token) went to the mill",
            admitted.clone(),
        );
        registry.register(
            "millrace_preauth_rejected",
            "Connections closed before their Hello was accepted, by reason",
            rejected.clone(),
        );
        Preauth {
            config,
            waiting: Mutex::new(Waiting::default()),
            admitted,
            rejected,
            waiting_gauge,
            registry,
            gates: Mutex::new(Default::default()),
        }
    }

    /// Takes a slot, closing the oldest waiting connection if the budget is full.
    fn slot(&self) -> Slot<'_> {
        let (tx, rx) = oneshot::channel();
        let mut w = self
            .waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while w.slots.len() >= self.config.max_connections.max(1) {
            // Sending wakes the owner, which closes its connection; dropping would too.
            match w.slots.pop_first() {
                Some((_, old)) => {
                    let _ = old.send(());
                }
                None => break,
            }
        }
        let id = w.next;
        w.next = w.next.wrapping_add(1);
        w.slots.insert(id, tx);
        Slot {
            owner: self,
            id,
            evicted: rx,
        }
    }

    /// Connections waiting for their `Hello` now.
    pub fn waiting(&self) -> usize {
        self.waiting.lock().map(|w| w.slots.len()).unwrap_or(0)
    }

    /// Runs the connection's first phase within the deadline and the budget: `handshake`
    /// (TLS, or nothing for plain TCP) yields the stream and, with mutual TLS, the verified
    /// client certificate; then the first frame is read and checked. `Ok` carries the stream
    /// and the `Hello` (token and identity checked); an `Err` has been counted and logged
    /// (rate-limited), and the connection should be dropped.
    pub async fn admit<S, H>(&self, handshake: H) -> Result<(S, ToMill), Rejected>
    where
        S: AsyncRead + AsyncWrite + Unpin,
        H: Future<Output = Result<(S, Option<CertificateDer<'static>>), Rejected>>,
    {
        let mut slot = self.slot();
        let first = async {
            let (mut stream, cert) = handshake.await?;
            let msg = read_first(&mut stream).await;
            Ok::<_, Rejected>((stream, cert, msg))
        };
        let read = tokio::time::timeout(self.config.hello_timeout, first);
        let r = tokio::select! {
            biased;
            r = read => match r {
                Ok(r) => r,
                Err(_) => Err(Rejected {
                    kind: Reject::Timeout,
                    detail: format!(
                        "no TLS handshake and Hello within {:?} (--hello-timeout)",
                        self.config.hello_timeout
                    ),
                }),
            },
            _ = &mut slot.evicted => Err(Rejected {
                kind: Reject::Evicted,
                detail: format!(
                    "{} connections were waiting for their Hello (--max-preauth-connections)",
                    self.config.max_connections
                ),
            }),
        };
        drop(slot);
        let (mut stream, cert, msg) = match r {
            Ok(x) => x,
            Err(rej) => {
                self.count(&rej);
                return Err(rej);
            }
        };
        match msg.and_then(|msg| self.check(msg, cert.as_ref())) {
            Ok(hello) => {
                self.admitted.inc();
                Ok((stream, hello))
            }
            Err(rej) => {
                if matches!(rej.kind, Reject::Token | Reject::Version | Reject::Identity) {
                    // Tell the peer why, bounded in time (it may not read).
                    let mut frame = Vec::new();
                    let msg = ToExecutor::Refused {
                        leader: None,
                        reason: rej.detail.clone(),
                    };
                    if encode_into(&msg, &mut frame).is_ok() {
                        let _ = tokio::time::timeout(Duration::from_secs(1), async {
                            stream.write_all(&frame).await?;
                            stream.flush().await?;
                            stream.shutdown().await
                        })
                        .await;
                    }
                }
                self.count(&rej);
                Err(rej)
            }
        }
    }

    /// The token rule, then (mutual TLS: `cert` is the verified client certificate) the
    /// identity rule.
    fn check(&self, msg: ToMill, cert: Option<&CertificateDer<'_>>) -> Result<ToMill, Rejected> {
        match &msg {
            ToMill::Hello { node_id, token, .. } => {
                let node: String = node_id.chars().take(128).collect();
                if !crate::http::constant_time_eq(token.as_bytes(), self.config.token.as_bytes()) {
                    return Err(Rejected {
                        kind: Reject::Token,
                        detail: format!("node {node:?}: token not accepted"),
                    });
                }
                match cert.map(|c| crate::tls::cert_names_node(c, node_id)) {
                    None | Some(Ok(())) => Ok(msg),
                    Some(Err(why)) => Err(Rejected {
                        kind: Reject::Identity,
                        detail: why,
                    }),
                }
            }
            ToMill::Snapshot { .. }
            | ToMill::ReserveResult { .. }
            | ToMill::CommitResult { .. }
            | ToMill::EventBatch { .. }
            | ToMill::CancelAck { .. }
            | ToMill::Stale { .. }
            | ToMill::LiveLog { .. } => Err(Rejected {
                kind: Reject::NotHello,
                detail: "the first message was not a Hello".into(),
            }),
        }
    }

    /// A connection closed at once because the descriptor budget was spent.
    pub fn refused_for_fds(&self, detail: String) {
        self.count(&Rejected {
            kind: Reject::FdReserve,
            detail,
        });
    }

    fn count(&self, rej: &Rejected) {
        let i = rej.kind.index();
        self.rejected
            .get_or_create(&vec![("reason", rej.kind.name().to_string())])
            .inc();
        let now = Instant::now();
        let mut gates = self
            .gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(g) = gates.get_mut(i) else { return };
        if g.last.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            g.suppressed += 1;
            return;
        }
        let suppressed = std::mem::take(&mut g.suppressed);
        g.last = Some(now);
        drop(gates);
        tracing::warn!(
            reason = rej.kind.name(),
            detail = %rej.detail,
            suppressed,
            "executor connection closed before Hello (at most one such line per reason every {LOG_EVERY:?}; suppressed counts the others)"
        );
    }

    /// Prometheus text (format 0.0.4) for the pre-`Hello` phase.
    pub fn render(&self) -> String {
        self.waiting_gauge
            .set(i64::try_from(self.waiting()).unwrap_or(i64::MAX));
        crate::metrics::encode(&self.registry)
    }
}

/// Reads exactly one frame (prefix checked against [`PREAUTH_MAX_FRAME`] first) and decodes
/// it; nothing past it is read, so the session's reader starts at the next frame.
async fn read_first<S: AsyncRead + Unpin>(stream: &mut S) -> Result<ToMill, Rejected> {
    let closed = |e: std::io::Error| Rejected {
        kind: Reject::Closed,
        detail: format!("before Hello: {e}"),
    };
    let mut prefix = [0u8; PREFIX_LEN];
    stream.read_exact(&mut prefix).await.map_err(closed)?;
    let len = usize::try_from(u32::from_be_bytes(prefix)).unwrap_or(usize::MAX);
    if len > PREAUTH_MAX_FRAME {
        return Err(Rejected {
            kind: Reject::TooLarge,
            detail: format!(
                "first frame announces {len} bytes; at most {PREAUTH_MAX_FRAME} before Hello"
            ),
        });
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await.map_err(closed)?;
    decode_to_mill(&body).map_err(|e| match e {
        CodecError::UnsupportedVersion { .. } => Rejected {
            kind: Reject::Version,
            detail: e.to_string(),
        },
        other => Rejected {
            kind: Reject::Malformed,
            detail: other.to_string(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preauth(max: usize) -> Preauth {
        Preauth::new(PreauthConfig {
            hello_timeout: Duration::from_secs(5),
            max_connections: max,
            token: "t".into(),
        })
    }

    #[test]
    fn a_full_budget_evicts_the_oldest_waiting_connection() {
        let p = preauth(2);
        let mut a = p.slot();
        let mut b = p.slot();
        assert_eq!(p.waiting(), 2);
        let mut c = p.slot();
        assert_eq!(p.waiting(), 2);
        assert!(a.evicted.try_recv().is_ok(), "the oldest was not evicted");
        assert!(b.evicted.try_recv().is_err());
        assert!(c.evicted.try_recv().is_err());
        drop(b);
        assert_eq!(p.waiting(), 1);
        drop(a);
        drop(c);
        assert_eq!(p.waiting(), 0);
    }

    fn hello(node: &str, token: &str) -> ToMill {
        millrace_core::testkit::Hello::new(node, millrace_core::Epoch(1))
            .token(token)
            .no_engines()
            .build()
    }

    /// Issue 11 item 4: with mutual TLS the token is not enough; the certificate must name
    /// the Hello's node id. Without a certificate (no mTLS) only the token counts.
    #[test]
    fn mtls_hello_for_another_node_than_the_certificate_is_refused() {
        let p = preauth(2);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["exec-a".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .der()
            .clone();
        assert!(p.check(hello("exec-a", "t"), Some(&cert)).is_ok());
        let rej = p.check(hello("exec-b", "t"), Some(&cert)).unwrap_err();
        assert_eq!(rej.kind, Reject::Identity);
        assert!(rej.detail.contains("exec-b"), "{}", rej.detail);
        // The token is checked first: a wrong token is a token rejection either way.
        let rej = p.check(hello("exec-a", "wrong"), Some(&cert)).unwrap_err();
        assert_eq!(rej.kind, Reject::Token);
        assert!(p.check(hello("exec-b", "t"), None).is_ok());
    }

    #[test]
    fn rejections_are_counted_per_reason() {
        let p = preauth(2);
        for _ in 0..3 {
            p.count(&Rejected {
                kind: Reject::TooLarge,
                detail: String::new(),
            });
        }
        let text = p.render();
        assert!(
            text.contains("millrace_preauth_rejected_total{reason=\"too_large\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("millrace_preauth_rejected_total{reason=\"timeout\"} 0\n"),
            "{text}"
        );
        let gates = p.gates.lock().unwrap();
        assert_eq!(gates[Reject::TooLarge.index()].suppressed, 2);
    }
}
