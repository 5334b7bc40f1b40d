//! Connection tasks: they only frame bytes. A reader turns bytes into messages for its
//! driver; a writer turns the driver's messages into frames. A frame over the limit or a
//! malformed one closes that connection only, and the driver hears `Disconnected` once.
//!
//! A connection is plain TCP or TLS over TCP ([`Transport`]). The loops are generic and
//! monomorphised per transport, so plain TCP keeps its lock-free owned halves; a TLS stream
//! is split with `tokio::io::split` (its two directions share one rustls session anyway).

use std::future::Future;
use std::time::Duration;

use millrace_core::codec::{encode_into, CodecError, FrameDecoder};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
#[cfg(not(madsim))]
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Descriptors this process may spend on accepted connections, both listeners together:
/// the soft `RLIMIT_NOFILE` less a reserve kept for the store, job logs and the runtime. A
/// connection beyond it is closed as soon as it is accepted, so a flood ends in refused
/// connections, never in a store that cannot open its files (EMFILE).
#[derive(Debug)]
pub struct FdBudget {
    live: std::sync::atomic::AtomicUsize,
    max: usize,
}

/// One accepted connection's share of an [`FdBudget`], given back when dropped.
#[derive(Debug)]
pub struct FdGuard(std::sync::Arc<FdBudget>);

impl FdBudget {
    /// A budget of `limit - reserve` connections (at least 1).
    pub fn new(limit: u64, reserve: u64) -> std::sync::Arc<FdBudget> {
        let max = usize::try_from(limit.saturating_sub(reserve).max(1)).unwrap_or(usize::MAX);
        std::sync::Arc::new(FdBudget {
            live: std::sync::atomic::AtomicUsize::new(0),
            max,
        })
    }

    /// A slot for one more connection, or `None` when the budget is spent.
    pub fn take(self: &std::sync::Arc<Self>) -> Option<FdGuard> {
        use std::sync::atomic::Ordering;
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| FdGuard(self.clone()))
    }

    /// The most connections at once.
    pub fn max(&self) -> usize {
        self.max
    }
}

impl Drop for FdGuard {
    fn drop(&mut self) {
        self.0
            .live
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Messages queued towards one connection, at most. A peer that falls this far behind is
/// disconnected rather than buffered without bound.
pub const OUT_QUEUE: usize = 8192;

/// Bytes read from a socket at once.
const READ_CHUNK: usize = 16 * 1024;

/// Frames written in one `write_all`, at most.
const WRITE_BATCH: usize = 256;

/// What a driver asks of a connection's writer.
#[derive(Debug)]
pub enum ConnOut<M> {
    /// Frame and send a message.
    Send(M),
    /// Send what is queued, then close.
    Close(String),
}

/// How a connection ended, for the logs.
#[derive(Debug)]
pub enum Ended {
    /// The peer closed it.
    PeerClosed,
    /// The driver closed it.
    Closed(String),
    /// The driver dropped it (gone, or the queue overflowed).
    Dropped,
    /// A bad frame (too large or malformed).
    Codec(CodecError),
    /// A socket error.
    Io(std::io::Error),
    /// The driver is gone.
    DriverGone,
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::PeerClosed => f.write_str("peer closed the connection"),
            Ended::Closed(r) => write!(f, "closed: {r}"),
            Ended::Dropped => f.write_str("dropped by the driver"),
            Ended::Codec(e) => write!(f, "bad frame: {e}"),
            Ended::Io(e) => write!(f, "socket error: {e}"),
            Ended::DriverGone => f.write_str("driver stopped"),
        }
    }
}

/// A byte stream a connection runs on: plain TCP, or TLS over TCP (either side).
pub trait Transport: Send + 'static {
    /// The reading half.
    type Read: AsyncRead + Unpin + Send + 'static;
    /// The writing half.
    type Write: AsyncWrite + Unpin + Send + 'static;
    /// The TCP socket underneath.
    fn tcp(&self) -> &TcpStream;
    /// Splits into halves the reader and the writer own.
    fn split(self) -> (Self::Read, Self::Write);
}

#[cfg(not(madsim))]
impl Transport for TcpStream {
    type Read = OwnedReadHalf;
    type Write = OwnedWriteHalf;
    fn tcp(&self) -> &TcpStream {
        self
    }
    fn split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }
}

/// madsim's stream has no owned halves: the shared split (issue 16's build only).
#[cfg(madsim)]
impl Transport for TcpStream {
    type Read = ReadHalf<Self>;
    type Write = WriteHalf<Self>;
    fn tcp(&self) -> &TcpStream {
        self
    }
    fn split(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

impl Transport for tokio_rustls::server::TlsStream<TcpStream> {
    type Read = ReadHalf<Self>;
    type Write = WriteHalf<Self>;
    fn tcp(&self) -> &TcpStream {
        self.get_ref().0
    }
    fn split(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

impl Transport for tokio_rustls::client::TlsStream<TcpStream> {
    type Read = ReadHalf<Self>;
    type Write = WriteHalf<Self>;
    fn tcp(&self) -> &TcpStream {
        self.get_ref().0
    }
    fn split(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

/// Runs one connection until either side ends it; returns how it ended. The caller reports
/// `Disconnected` to its driver afterwards, exactly once.
pub async fn run<S, In, Out, D, Fut>(
    stream: S,
    out: mpsc::Receiver<ConnOut<Out>>,
    decode: fn(&mut FrameDecoder) -> Result<Option<In>, CodecError>,
    deliver: D,
) -> Ended
where
    S: Transport,
    Out: Serialize + Send + 'static,
    D: FnMut(In) -> Fut,
    Fut: Future<Output = bool>,
{
    let _ = stream.tcp().set_nodelay(true);
    let (rd, wr) = stream.split();
    let mut writer = tokio::spawn(write_loop(wr, out));
    let reader = read_loop(rd, decode, deliver);
    tokio::select! {
        biased;
        ended = reader => {
            writer.abort();
            ended
        }
        ended = &mut writer => ended.unwrap_or(Ended::Dropped),
    }
}

async fn read_loop<R: AsyncRead + Unpin, In, D, Fut>(
    mut rd: R,
    decode: fn(&mut FrameDecoder) -> Result<Option<In>, CodecError>,
    mut deliver: D,
) -> Ended
where
    D: FnMut(In) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut buf = vec![0u8; READ_CHUNK];
    let mut decoder = FrameDecoder::new();
    loop {
        let n = match rd.read(&mut buf).await {
            Ok(0) => return Ended::PeerClosed,
            Ok(n) => n,
            Err(e) => return Ended::Io(e),
        };
        decoder.push(buf.get(..n).unwrap_or_default());
        loop {
            match decode(&mut decoder) {
                Ok(Some(msg)) => {
                    if !deliver(msg).await {
                        return Ended::DriverGone;
                    }
                }
                Ok(None) => break,
                Err(e) => return Ended::Codec(e),
            }
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin, Out: Serialize>(
    mut wr: W,
    mut out: mpsc::Receiver<ConnOut<Out>>,
) -> Ended {
    let mut frames = Vec::new();
    loop {
        let Some(first) = out.recv().await else {
            let _ = wr.shutdown().await;
            return Ended::Dropped;
        };
        let mut close = None;
        let mut next = Some(first);
        let mut n = 0;
        while let Some(item) = next.take() {
            match item {
                ConnOut::Send(msg) => {
                    if let Err(e) = encode_into(&msg, &mut frames) {
                        // Our own message does not fit a frame: nothing sane to send.
                        return Ended::Codec(e);
                    }
                }
                ConnOut::Close(reason) => {
                    close = Some(reason);
                    break;
                }
            }
            n += 1;
            if n < WRITE_BATCH {
                next = out.try_recv().ok();
            }
        }
        if !frames.is_empty() {
            if let Err(e) = wr.write_all(&frames).await {
                return Ended::Io(e);
            }
            // A no-op on plain TCP; TLS may hold the last record until flushed.
            if let Err(e) = wr.flush().await {
                return Ended::Io(e);
            }
            frames.clear();
            if frames.capacity() > 4 * 1024 * 1024 {
                frames = Vec::new();
            }
        }
        if let Some(reason) = close {
            // Give the peer a moment to read what was sent (a Refused) before the close.
            let _ = tokio::time::timeout(Duration::from_secs(1), wr.shutdown()).await;
            return Ended::Closed(reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FdBudget;

    #[test]
    fn an_fd_budget_refuses_beyond_its_size_and_takes_back_dropped_slots() {
        let budget = FdBudget::new(130, 128);
        assert_eq!(budget.max(), 2);
        let a = budget.take().expect("first");
        let _b = budget.take().expect("second");
        assert!(budget.take().is_none(), "spent");
        drop(a);
        assert!(budget.take().is_some(), "a dropped slot is free again");
        assert_eq!(FdBudget::new(10, 128).max(), 1, "at least one");
    }
}
