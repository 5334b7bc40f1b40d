//! Frame codec: u32 big-endian length + postcard body, 1 MiB maximum (DESIGN §3).
//!
//! Pure: the driver reads bytes from its transport and [`FrameDecoder::push`]es them in
//! whatever pieces arrive; the decoder hands back whole messages. Writing goes through
//! [`encode`] or [`encode_into`]. Nothing here panics on input from the network: every
//! failure is a [`CodecError`], after which the driver closes the connection (a violation,
//! M28).
//!
//! Bounds: a body is at most [`MAX_FRAME`] bytes, and a length prefix above it is refused as
//! soon as its four bytes arrive, before any of the body is buffered. The decoder never holds
//! more than [`MAX_BUFFERED`] unconsumed bytes.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::wire::{ToMill, PROTOCOL_VERSION};

/// Largest frame body, in bytes (DESIGN §3: 1 MiB).
pub const MAX_FRAME: usize = 1 << 20;

/// Bytes in the length prefix.
pub const PREFIX_LEN: usize = 4;

/// Most unconsumed bytes a [`FrameDecoder`] holds: room for two maximal frames.
///
/// A driver that calls `next_frame` until it returns `Ok(None)` after every push holds at most
/// one incomplete frame (under `PREFIX_LEN + MAX_FRAME` bytes), so any single push of up to
/// `PREFIX_LEN + MAX_FRAME` bytes — far more than one socket read — is always accepted. A push
/// that would take the decoder past this bound is [`CodecError::BufferFull`].
pub const MAX_BUFFERED: usize = 2 * (PREFIX_LEN + MAX_FRAME);

/// Why a frame could not be encoded or decoded. After any of these the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// A frame body (encoded, or announced by a length prefix) exceeds [`MAX_FRAME`].
    #[error("frame body of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The body length, as encoded or as announced.
        len: usize,
        /// The bound, [`MAX_FRAME`].
        max: usize,
    },
    /// The peer's bytes are not one message of the expected type: postcard failed, or bytes
    /// were left in the frame body after the message.
    #[error("malformed frame: {reason}")]
    Malformed {
        /// What postcard reported, or how many bytes were left over.
        reason: String,
    },
    /// A `Hello` announced a protocol version this build does not speak (M1).
    #[error("protocol version {got} is not supported; this build speaks {supported}")]
    UnsupportedVersion {
        /// The version the peer announced.
        got: u32,
        /// [`PROTOCOL_VERSION`].
        supported: u32,
    },
    /// More bytes were pushed than the decoder holds unconsumed (see [`MAX_BUFFERED`]).
    #[error("decoder would hold {buffered} unconsumed bytes; at most {max} are allowed")]
    BufferFull {
        /// Unconsumed bytes there would have been after the push.
        buffered: usize,
        /// The bound, [`MAX_BUFFERED`].
        max: usize,
    },
    /// postcard could not serialize a message (a type this codec cannot express).
    #[error("cannot encode message: {reason}")]
    Encode {
        /// What postcard reported.
        reason: String,
    },
}

/// Encodes `msg` as one frame: length prefix and postcard body.
pub fn encode<T: Serialize + ?Sized>(msg: &T) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::new();
    encode_into(msg, &mut out)?;
    Ok(out)
}

/// Appends one frame holding `msg` to `out`, for drivers that batch several frames per write.
///
/// On error `out` is left as it was. The size is checked before anything is written, so an
/// oversized message is refused without buffering its body.
pub fn encode_into<T: Serialize + ?Sized>(msg: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
    let size = postcard::experimental::serialized_size(msg).map_err(encode_error)?;
    let prefix = frame_prefix(size)?;
    let original = out.len();
    out.reserve(PREFIX_LEN.saturating_add(size));
    out.extend_from_slice(&prefix);
    let written = postcard::to_extend(msg, Appender(out)).map(|_| ());
    let body_len = out
        .len()
        .saturating_sub(original.saturating_add(PREFIX_LEN));
    // A Serialize impl that writes something else the second time (it should not) must not
    // produce a frame whose prefix lies.
    let result = match written {
        Err(e) => Err(encode_error(e)),
        Ok(()) if body_len != size => Err(CodecError::Encode {
            reason: format!("serialized {body_len} bytes after sizing {size}"),
        }),
        Ok(()) => Ok(()),
    };
    if result.is_err() {
        out.truncate(original);
    }
    result
}

/// Decodes one frame body as a `T`; bytes left over after the message are [`CodecError::Malformed`].
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, CodecError> {
    let (msg, rest) = postcard::take_from_bytes::<T>(body).map_err(|e| CodecError::Malformed {
        reason: e.to_string(),
    })?;
    if !rest.is_empty() {
        return Err(CodecError::Malformed {
            reason: format!("{} trailing bytes after the message", rest.len()),
        });
    }
    Ok(msg)
}

/// Decodes one frame body from an executor, checking a `Hello`'s version first (M1).
///
/// A body that starts with the `Hello` tag and a version other than [`PROTOCOL_VERSION`] is
/// [`CodecError::UnsupportedVersion`] whatever follows the version, because another version's
/// `Hello` may carry other fields; the peer deserves to hear "wrong version", not "malformed".
pub fn decode_to_mill(body: &[u8]) -> Result<ToMill, CodecError> {
    if let Some(got) = hello_version(body) {
        if got != PROTOCOL_VERSION {
            return Err(CodecError::UnsupportedVersion {
                got,
                supported: PROTOCOL_VERSION,
            });
        }
    }
    decode(body)
}

/// Reassembles frames from bytes pushed in arbitrary pieces.
///
/// Feed it with [`push`](Self::push) and drain it with [`next_frame`](Self::next_frame) (or
/// [`next_to_mill`](Self::next_to_mill) on the mill) until `Ok(None)`. The first error is
/// sticky: every later call returns it again, pushes are ignored and the buffer is freed,
/// because the connection is to be closed. The decoder holds at most [`MAX_BUFFERED`]
/// unconsumed bytes and drops consumed ones at the next push.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    /// Bytes received; `buf[start..]` is not yet consumed.
    buf: Vec<u8>,
    /// Where the first unconsumed frame begins.
    start: usize,
    /// Where the first frame whose length prefix has not been checked begins (≥ `start`).
    unchecked: usize,
    /// The first error, repeated until the decoder is dropped.
    failed: Option<CodecError>,
}

impl FrameDecoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Unconsumed bytes held: the part of the next frames received so far.
    pub fn buffered(&self) -> usize {
        self.buf.len().saturating_sub(self.start)
    }

    /// The error the decoder stopped on, if any.
    pub fn error(&self) -> Option<&CodecError> {
        self.failed.as_ref()
    }

    /// Takes bytes as they arrive; pieces need not line up with frames.
    ///
    /// Length prefixes are checked here, as soon as their four bytes are in: an oversized one
    /// stops the decoder before any of its body is stored. Errors (that one, or
    /// [`CodecError::BufferFull`]) are reported by the next `next_frame` call.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        self.compact();
        let buffered = self.buffered().saturating_add(bytes.len());
        if buffered > MAX_BUFFERED {
            self.fail(CodecError::BufferFull {
                buffered,
                max: MAX_BUFFERED,
            });
            return;
        }
        let mut rest = bytes;
        while !rest.is_empty() {
            // Store only up to the end of the next unchecked prefix, check it, go on.
            let in_body = self.buf.len() < self.unchecked;
            let boundary = if in_body {
                self.unchecked
            } else {
                self.unchecked.saturating_add(PREFIX_LEN)
            };
            let want = boundary.saturating_sub(self.buf.len()).min(rest.len());
            if want == 0 {
                // Unreachable (`buf` never runs past an unchecked prefix); never spin.
                self.fail(CodecError::Malformed {
                    reason: "decoder lost track of frame boundaries".into(),
                });
                return;
            }
            let (head, tail) = rest.split_at_checked(want).unwrap_or((rest, &[]));
            self.buf.extend_from_slice(head);
            rest = tail;
            if !in_body && self.buf.len() == boundary {
                let Some(len) = self.buf.get(self.unchecked..boundary).and_then(body_len) else {
                    // Unreachable: the slice is exactly PREFIX_LEN bytes. Stop rather than guess.
                    self.fail(CodecError::Malformed {
                        reason: "length prefix could not be read".into(),
                    });
                    return;
                };
                if len > MAX_FRAME {
                    self.fail(CodecError::TooLarge {
                        len,
                        max: MAX_FRAME,
                    });
                    return;
                }
                self.unchecked = boundary.saturating_add(len);
            }
        }
    }

    /// The next whole message, `Ok(None)` if more bytes are needed.
    pub fn next_frame<T: DeserializeOwned>(&mut self) -> Result<Option<T>, CodecError> {
        self.take_frame(decode::<T>)
    }

    /// The next message from an executor, with `Hello`'s version checked as in
    /// [`decode_to_mill`]; `Ok(None)` if more bytes are needed.
    pub fn next_to_mill(&mut self) -> Result<Option<ToMill>, CodecError> {
        self.take_frame(decode_to_mill)
    }

    fn take_frame<R>(
        &mut self,
        decode_body: impl FnOnce(&[u8]) -> Result<R, CodecError>,
    ) -> Result<Option<R>, CodecError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        // Only frames whose prefix `push` has checked are taken.
        let body_start = self.start.saturating_add(PREFIX_LEN);
        if body_start > self.unchecked {
            return Ok(None);
        }
        let Some(len) = self.buf.get(self.start..body_start).and_then(body_len) else {
            return Ok(None);
        };
        let body_end = body_start.saturating_add(len);
        let Some(body) = self.buf.get(body_start..body_end) else {
            return Ok(None);
        };
        let decoded = decode_body(body);
        self.start = body_end;
        if self.start >= self.buf.len() {
            self.buf.clear();
            self.start = 0;
            self.unchecked = 0;
        }
        match decoded {
            Ok(msg) => Ok(Some(msg)),
            Err(e) => {
                self.fail(e.clone());
                Err(e)
            }
        }
    }

    /// Drops consumed bytes from the front of the buffer.
    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.drain(..self.start.min(self.buf.len()));
            self.unchecked = self.unchecked.saturating_sub(self.start);
            self.start = 0;
        }
    }

    fn fail(&mut self, e: CodecError) {
        self.failed = Some(e);
        self.buf = Vec::new();
        self.start = 0;
        self.unchecked = 0;
    }
}

/// Lets postcard append to a borrowed `Vec` (`to_extend` takes its writer by value).
struct Appender<'a>(&'a mut Vec<u8>);

impl Extend<u8> for Appender<'_> {
    fn extend<I: IntoIterator<Item = u8>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

fn encode_error(e: postcard::Error) -> CodecError {
    CodecError::Encode {
        reason: e.to_string(),
    }
}

/// The length prefix for a body of `len` bytes, or `TooLarge`.
fn frame_prefix(len: usize) -> Result<[u8; PREFIX_LEN], CodecError> {
    let too_large = CodecError::TooLarge {
        len,
        max: MAX_FRAME,
    };
    if len > MAX_FRAME {
        return Err(too_large);
    }
    u32::try_from(len)
        .map(u32::to_be_bytes)
        .map_err(|_| too_large)
}

/// The body length announced by a 4-byte prefix.
fn body_len(prefix: &[u8]) -> Option<usize> {
    let bytes: [u8; PREFIX_LEN] = prefix.try_into().ok()?;
    Some(usize::try_from(u32::from_be_bytes(bytes)).unwrap_or(usize::MAX))
}

/// If `body` starts with the `Hello` tag and a well-formed varint, the version it announces.
fn hello_version(body: &[u8]) -> Option<u32> {
    let (tag, rest) = take_varint_u32(body)?;
    if tag != 0 {
        return None;
    }
    take_varint_u32(rest).map(|(version, _)| version)
}

/// A postcard varint u32 (LEB128, at most 5 bytes, the last holding at most 4 bits), as
/// postcard itself reads enum tags and `u32` fields.
fn take_varint_u32(bytes: &[u8]) -> Option<(u32, &[u8])> {
    const MAX_BYTES: usize = 5;
    let mut out: u32 = 0;
    for (i, &byte) in bytes.iter().take(MAX_BYTES).enumerate() {
        out |= u32::from(byte & 0x7F) << (7 * i);
        if byte & 0x80 == 0 {
            if i == MAX_BYTES - 1 && byte > 0x0F {
                return None;
            }
            return Some((out, bytes.get(i + 1..)?));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::fmt::Debug;
    use std::time::Duration;

    use serde::de::DeserializeOwned;

    use super::*;
    use crate::job::{Identity, JobSpec, LogRef, TerminalStatus};
    use crate::types::{Epoch, JobId, LeaseId, Resources, Seqno};
    use crate::wire::{EngineStatus, Event, EventKind, RejectKind, ToExecutor};

    /// splitmix64: deterministic test randomness without a crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform-ish in `0..n` (`n` > 0).
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn bytes(&mut self, len: usize) -> Vec<u8> {
            (0..len).map(|_| self.next() as u8).collect()
        }
    }

    fn resources(pairs: &[(&str, u64)]) -> Resources {
        pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
    }

    fn hello(version: u32) -> ToMill {
        ToMill::Hello {
            term: crate::types::Term(0),
            stop_grace_ms: 10_000,
            protocol_version: version,
            node_id: "exec-1.rack_2".into(),
            epoch: Epoch(7),
            token: "s3cret".into(),
            labels: vec!["linux".into(), "x86_64".into()],
            engines: vec!["shell".into(), "docker".into()],
        }
    }

    /// Position of each `ToMill` variant; a new variant fails to compile here until it is
    /// given a sample in `to_mill_samples`.
    const TO_MILL_VARIANTS: usize = 8;
    fn to_mill_index(m: &ToMill) -> usize {
        match m {
            ToMill::Hello { .. } => 0,
            ToMill::Snapshot { .. } => 1,
            ToMill::ReserveResult { .. } => 2,
            ToMill::CommitResult { .. } => 3,
            ToMill::EventBatch { .. } => 4,
            ToMill::CancelAck { .. } => 5,
            ToMill::LiveLog { .. } => 6,
            ToMill::Stale { .. } => 7,
        }
    }

    const TO_EXECUTOR_VARIANTS: usize = 7;
    fn to_executor_index(m: &ToExecutor) -> usize {
        match m {
            ToExecutor::Welcome { .. } => 0,
            ToExecutor::Refused { .. } => 1,
            ToExecutor::ReserveSeat { .. } => 2,
            ToExecutor::CommitLease { .. } => 3,
            ToExecutor::ReleaseLease { .. } => 4,
            ToExecutor::CancelAttempt { .. } => 5,
            ToExecutor::Ack { .. } => 6,
        }
    }

    fn to_mill_samples() -> Vec<ToMill> {
        let mut engines = BTreeMap::new();
        engines.insert(
            "shell".to_string(),
            EngineStatus {
                available: true,
                capacity: 4,
                load: [("cpu".to_string(), 0.25), ("memory".to_string(), 1.0)]
                    .into_iter()
                    .collect(),
            },
        );
        engines.insert(
            "docker".to_string(),
            EngineStatus {
                available: false,
                capacity: 1,
                load: BTreeMap::new(),
            },
        );
        vec![
            hello(PROTOCOL_VERSION),
            ToMill::Snapshot {
                seqno: 300,
                engines,
                active_leases: vec![LeaseId(1), LeaseId(u64::MAX)],
                outbox_high: Seqno(u64::MAX),
            },
            ToMill::ReserveResult {
                lease: LeaseId(9),
                accepted: false,
                reject: Some(RejectKind::Incompatible),
                reason: "no docker here — sorry".into(),
                resources: resources(&[("cpu_millis", 2000), ("jobs", 1)]),
            },
            ToMill::CommitResult {
                lease: LeaseId(9),
                committed: true,
            },
            ToMill::EventBatch {
                epoch: Epoch(7),
                events: vec![
                    Event {
                        seqno: Seqno(1),
                        lease: LeaseId(9),
                        kind: EventKind::Running,
                    },
                    Event {
                        seqno: Seqno(2),
                        lease: LeaseId(9),
                        kind: EventKind::Terminal {
                            status: TerminalStatus::Failed,
                            exit_code: Some(-9),
                            error: Some("killed".into()),
                            log: Some(LogRef {
                                path: LogRef::path_for(LeaseId(9)),
                                hash: format!("sha256:{}", "ab".repeat(32)),
                            }),
                            cause: crate::wire::EndCause::Engine,
                        },
                    },
                    Event {
                        seqno: Seqno(3),
                        lease: LeaseId(10),
                        kind: EventKind::Terminal {
                            status: TerminalStatus::Success,
                            exit_code: None,
                            error: None,
                            log: None,
                            cause: crate::wire::EndCause::Engine,
                        },
                    },
                ],
            },
            ToMill::CancelAck { lease: LeaseId(11) },
            ToMill::LiveLog {
                lease: LeaseId(12),
                offset: 1 << 40,
                bytes: (0..=255).collect(),
            },
            ToMill::Stale {
                term: crate::types::Term(u64::MAX),
            },
        ]
    }

    fn to_executor_samples() -> Vec<ToExecutor> {
        vec![
            ToExecutor::Welcome {
                term: crate::types::Term(1),
                cursor: Seqno(41),
                timers: crate::wire::SessionTimers {
                    silence_timeout: Duration::from_secs(15),
                    snapshot_interval: Duration::from_secs(5),
                    reconnect_grace: Duration::from_secs(45),
                },
            },
            ToExecutor::Refused {
                leader: None,
                reason: "node is quarantined".into(),
            },
            ToExecutor::ReserveSeat {
                term: crate::types::Term(1),
                lease: LeaseId(13),
                job: JobId(5),
                spec: Box::new(JobSpec {
                    retry: Default::default(),
                    priority: 0,
                    node: None,
                    engine: "shell".into(),
                    labels: ["linux", "gpu"].iter().map(|s| s.to_string()).collect(),
                    resources: resources(&[("cpu_millis", 500), ("memory_mb", 1024)]),
                    identity: Identity {
                        owner: "acme".into(),
                        repo: "acme/app".into(),
                    },
                    timeout: Some(Duration::new(3600, 5)),
                    payload: b"cargo test --workspace".to_vec(),
                    env: [("RUST_LOG", "debug"), ("EMPTY", "")]
                        .iter()
                        .map(|&(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                }),
                ttl: Duration::from_millis(30_500),
                direct: true,
            },
            ToExecutor::CommitLease {
                term: crate::types::Term(1),
                lease: LeaseId(13),
                secrets: [("TOKEN", "abc"), ("EMPTY", "")]
                    .iter()
                    .map(|&(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            },
            ToExecutor::ReleaseLease {
                term: crate::types::Term(1),
                lease: LeaseId(14),
            },
            ToExecutor::CancelAttempt {
                term: crate::types::Term(1),
                lease: LeaseId(13),
                reason: "cancelled by user".into(),
            },
            ToExecutor::Ack {
                term: crate::types::Term(1),
                epoch: Epoch(7),
                up_to: Seqno(u64::MAX),
            },
        ]
    }

    fn frame(msg: &impl Serialize) -> Vec<u8> {
        encode(msg).unwrap_or_else(|e| panic!("encoding a sample failed: {e}"))
    }

    fn frames(msgs: &[impl Serialize]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in msgs {
            encode_into(m, &mut out).unwrap_or_else(|e| panic!("encoding a sample failed: {e}"));
        }
        out
    }

    /// Pushes `bytes` in pieces of `piece` bytes and drains after each push.
    fn decode_all<T: DeserializeOwned>(bytes: &[u8], piece: usize) -> Vec<T> {
        let mut decoder = FrameDecoder::new();
        let mut out = Vec::new();
        for chunk in bytes.chunks(piece) {
            decoder.push(chunk);
            while let Some(m) = decoder
                .next_frame::<T>()
                .unwrap_or_else(|e| panic!("decoding a valid stream failed: {e}"))
            {
                out.push(m);
            }
        }
        assert_eq!(decoder.buffered(), 0, "bytes left over");
        out
    }

    fn assert_round_trips<T>(samples: &[T])
    where
        T: Serialize + DeserializeOwned + PartialEq + Debug,
    {
        for m in samples {
            let bytes = frame(m);
            let whole = decode_all::<T>(&bytes, bytes.len());
            assert_eq!(whole.iter().collect::<Vec<_>>(), [m]);
            let bytewise = decode_all::<T>(&bytes, 1);
            assert_eq!(
                bytewise.iter().collect::<Vec<_>>(),
                [m],
                "one byte at a time"
            );
        }
        let all = frames(samples);
        assert_eq!(decode_all::<T>(&all, all.len()), samples, "all in one push");
        assert_eq!(decode_all::<T>(&all, 1), samples, "all, one byte at a time");
        assert_eq!(decode_all::<T>(&all, 7), samples, "all, in odd pieces");
    }

    #[test]
    fn every_to_mill_variant_round_trips() {
        let samples = to_mill_samples();
        let covered: BTreeSet<usize> = samples.iter().map(to_mill_index).collect();
        assert_eq!(covered, (0..TO_MILL_VARIANTS).collect());
        assert_round_trips(&samples);

        let all = frames(&samples);
        let mut decoder = FrameDecoder::new();
        decoder.push(&all);
        for m in &samples {
            assert_eq!(decoder.next_to_mill(), Ok(Some(m.clone())));
        }
        assert_eq!(decoder.next_to_mill(), Ok(None));
    }

    #[test]
    fn every_to_executor_variant_round_trips() {
        let samples = to_executor_samples();
        let covered: BTreeSet<usize> = samples.iter().map(to_executor_index).collect();
        assert_eq!(covered, (0..TO_EXECUTOR_VARIANTS).collect());
        assert_round_trips(&samples);
    }

    #[test]
    fn frame_is_big_endian_length_then_postcard_body() {
        let msg = ToMill::CancelAck { lease: LeaseId(3) };
        let bytes = frame(&msg);
        // Tag 5 (CancelAck), varint 3.
        assert_eq!(bytes, [0, 0, 0, 2, 5, 3]);
    }

    #[test]
    fn encode_into_appends_and_leaves_output_alone_on_error() {
        let mut out = vec![0xAA];
        let small = ToMill::CancelAck { lease: LeaseId(3) };
        assert_eq!(encode_into(&small, &mut out), Ok(()));
        assert_eq!(out, [0xAA, 0, 0, 0, 2, 5, 3]);
        let huge = ToMill::LiveLog {
            lease: LeaseId(1),
            offset: 0,
            bytes: vec![0; MAX_FRAME],
        };
        assert!(matches!(
            encode_into(&huge, &mut out),
            Err(CodecError::TooLarge { .. })
        ));
        assert_eq!(out, [0xAA, 0, 0, 0, 2, 5, 3]);
    }

    #[test]
    fn encoding_an_oversized_message_is_too_large() {
        let msg = ToMill::LiveLog {
            lease: LeaseId(1),
            offset: 0,
            bytes: vec![7; MAX_FRAME + 1],
        };
        match encode(&msg) {
            Err(CodecError::TooLarge { len, max }) => {
                assert_eq!(max, MAX_FRAME);
                assert!(len > MAX_FRAME, "len {len}");
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    /// Issue 13 item 6: the largest spec a submit can pass (payload, 64 env variables
    /// filling 32 KiB, 32 labels and resources at their bounds) still fits one frame in a
    /// `ReserveSeat`, so a valid job can always be offered.
    #[test]
    fn a_maximal_job_spec_fits_a_reserve_seat_frame() {
        use crate::job::{MAX_ENV_BYTES, MAX_ENV_VARS, MAX_LABELS, MAX_PAYLOAD, MAX_SCOPE_NAME};
        let value = "v".repeat(MAX_ENV_BYTES / MAX_ENV_VARS - 4);
        let spec = JobSpec {
            retry: Default::default(),
            priority: 0,
            node: None,
            engine: "e".repeat(crate::types::MAX_NAME_LEN),
            labels: (0..MAX_LABELS).map(|i| format!("{i:0>64}")).collect(),
            resources: (0..crate::types::MAX_RESOURCES)
                .map(|i| (format!("{i:0>64}"), 1u64 << 53))
                .collect(),
            identity: Identity {
                owner: "o".repeat(MAX_SCOPE_NAME),
                repo: "r".repeat(MAX_SCOPE_NAME),
            },
            timeout: Some(Duration::MAX),
            payload: vec![b'x'; MAX_PAYLOAD],
            env: (0..MAX_ENV_VARS)
                .map(|i| (format!("V{i:03}"), value.clone()))
                .collect(),
        };
        assert_eq!(spec.validate(), Ok(()));
        let msg = ToExecutor::ReserveSeat {
            term: crate::types::Term(1),
            lease: LeaseId(u64::MAX),
            job: JobId(u64::MAX),
            spec: Box::new(spec),
            ttl: Duration::MAX,
            direct: true,
        };
        let bytes = frame(&msg);
        assert!(
            bytes.len() < PREFIX_LEN + MAX_FRAME,
            "{} bytes",
            bytes.len()
        );
        assert_eq!(decode_all::<ToExecutor>(&bytes, 64 * 1024), [msg]);
    }

    #[test]
    fn a_body_of_exactly_max_frame_is_accepted() {
        // LiveLog: tag (1) + lease varint (1) + offset varint (1) + length varint (3) + bytes.
        let msg = ToMill::LiveLog {
            lease: LeaseId(1),
            offset: 0,
            bytes: vec![7; MAX_FRAME - 6],
        };
        let bytes = frame(&msg);
        assert_eq!(bytes.len(), PREFIX_LEN + MAX_FRAME);
        assert_eq!(decode_all::<ToMill>(&bytes, 64 * 1024), [msg]);
    }

    #[test]
    fn oversized_length_prefix_is_rejected_before_the_body() {
        let too_big = u32::try_from(MAX_FRAME + 1).unwrap_or(u32::MAX);
        let mut decoder = FrameDecoder::new();
        decoder.push(&too_big.to_be_bytes()[..3]);
        assert_eq!(decoder.next_frame::<ToMill>(), Ok(None));
        decoder.push(&too_big.to_be_bytes()[3..]);
        let expected = CodecError::TooLarge {
            len: MAX_FRAME + 1,
            max: MAX_FRAME,
        };
        assert_eq!(decoder.next_frame::<ToMill>(), Err(expected.clone()));
        assert_eq!(decoder.buffered(), 0);
        // Sticky, and nothing more is buffered.
        decoder.push(&[0; 1000]);
        assert_eq!(decoder.buffered(), 0);
        assert_eq!(decoder.next_frame::<ToMill>(), Err(expected));
    }

    #[test]
    fn oversized_prefix_behind_a_valid_frame_is_rejected_at_push() {
        // A valid frame and then a huge prefix with some body, all in one push: the huge
        // prefix is refused in `push`, and its body never stored.
        let mut bytes = frame(&ToMill::CancelAck { lease: LeaseId(3) });
        bytes.extend_from_slice(&u32::MAX.to_be_bytes());
        bytes.extend_from_slice(&[0; 4096]);
        let mut decoder = FrameDecoder::new();
        decoder.push(&bytes);
        assert_eq!(decoder.buffered(), 0);
        assert_eq!(
            decoder.error(),
            Some(&CodecError::TooLarge {
                len: u32::MAX as usize,
                max: MAX_FRAME
            })
        );
    }

    #[test]
    fn pushing_past_the_buffer_bound_is_buffer_full() {
        // Empty frames (a zero length prefix each) pushed without draining.
        let mut decoder = FrameDecoder::new();
        decoder.push(&vec![0; MAX_BUFFERED]);
        assert_eq!(decoder.error(), None);
        assert_eq!(decoder.buffered(), MAX_BUFFERED);
        decoder.push(&[0]);
        assert_eq!(
            decoder.next_frame::<ToMill>(),
            Err(CodecError::BufferFull {
                buffered: MAX_BUFFERED + 1,
                max: MAX_BUFFERED
            })
        );
        assert_eq!(decoder.buffered(), 0);
    }

    #[test]
    fn a_draining_driver_can_push_a_whole_frame_on_top_of_an_incomplete_one() {
        let big = frame(&ToMill::LiveLog {
            lease: LeaseId(1),
            offset: 0,
            bytes: vec![7; MAX_FRAME - 6],
        });
        let mut stream = big.clone();
        stream.extend_from_slice(&big);
        let mut decoder = FrameDecoder::new();
        let (first, second) = stream.split_at(big.len() - 1);
        decoder.push(first);
        assert_eq!(decoder.next_frame::<ToMill>(), Ok(None));
        decoder.push(second);
        assert!(matches!(decoder.next_frame::<ToMill>(), Ok(Some(_))));
        assert!(matches!(decoder.next_frame::<ToMill>(), Ok(Some(_))));
        assert_eq!(decoder.next_frame::<ToMill>(), Ok(None));
    }

    #[test]
    fn consumed_bytes_do_not_accumulate() {
        let one = frame(&ToMill::CancelAck { lease: LeaseId(3) });
        let mut stream = Vec::new();
        for _ in 0..10_000 {
            stream.extend_from_slice(&one);
        }
        let mut decoder = FrameDecoder::new();
        let mut decoded = 0;
        // Pieces that never line up with frames, so the buffer is rarely empty.
        for chunk in stream.chunks(one.len() + 1) {
            decoder.push(chunk);
            while let Ok(Some(_)) = decoder.next_frame::<ToMill>() {
                decoded += 1;
            }
            assert!(
                decoder.buf.len() <= 2 * one.len() + 1,
                "{}",
                decoder.buf.len()
            );
        }
        assert_eq!(decoded, 10_000);
        assert_eq!(decoder.error(), None);
    }

    /// A frame with `body` as its body, whatever it holds.
    fn raw_frame(body: &[u8]) -> Vec<u8> {
        let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
        let mut out = len.to_be_bytes().to_vec();
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn trailing_bytes_in_a_frame_body_are_malformed() {
        let mut body = postcard::to_allocvec(&ToMill::CancelAck { lease: LeaseId(3) })
            .unwrap_or_else(|e| panic!("{e}"));
        body.push(0);
        let mut decoder = FrameDecoder::new();
        decoder.push(&raw_frame(&body));
        assert!(matches!(
            decoder.next_frame::<ToMill>(),
            Err(CodecError::Malformed { reason }) if reason.contains("1 trailing")
        ));
        let mut decoder = FrameDecoder::new();
        decoder.push(&raw_frame(&body));
        assert!(matches!(
            decoder.next_to_mill(),
            Err(CodecError::Malformed { .. })
        ));
    }

    #[test]
    fn m1_hello_with_another_version_is_unsupported() {
        let mut decoder = FrameDecoder::new();
        decoder.push(&frame(&hello(1)));
        assert_eq!(
            decoder.next_to_mill(),
            Err(CodecError::UnsupportedVersion {
                got: 1,
                supported: PROTOCOL_VERSION
            })
        );
        // A large version, multi-byte varint.
        let mut decoder = FrameDecoder::new();
        decoder.push(&frame(&hello(u32::MAX)));
        assert!(matches!(
            decoder.next_to_mill(),
            Err(CodecError::UnsupportedVersion { got: u32::MAX, .. })
        ));
    }

    #[test]
    fn m1_hello_with_another_version_and_other_fields_is_still_unsupported() {
        // Tag 0, version 1 (the protocol before terminal causes), then bytes that are no Hello of this version.
        let body = [0x00, 0x01, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF];
        assert!(decode::<ToMill>(&body).is_err());
        let mut decoder = FrameDecoder::new();
        decoder.push(&raw_frame(&body));
        assert_eq!(
            decoder.next_to_mill(),
            Err(CodecError::UnsupportedVersion {
                got: 1,
                supported: PROTOCOL_VERSION
            })
        );
        // Just the tag and the version.
        assert_eq!(
            decode_to_mill(&[0x00, 0x01]),
            Err(CodecError::UnsupportedVersion {
                got: 1,
                supported: PROTOCOL_VERSION
            })
        );
    }

    #[test]
    fn hello_with_this_version_but_garbage_is_malformed() {
        let body = [0x00, PROTOCOL_VERSION as u8, 0xFF];
        assert!(matches!(
            decode_to_mill(&body),
            Err(CodecError::Malformed { .. })
        ));
        // A version whose varint is cut off is malformed too, not unsupported.
        assert!(matches!(
            decode_to_mill(&[0x00, 0x82]),
            Err(CodecError::Malformed { .. })
        ));
    }

    #[test]
    fn varint_reader_matches_postcard() {
        for v in [0, 1, 127, 128, 300, 16_383, 16_384, u32::MAX - 1, u32::MAX] {
            let bytes = postcard::to_allocvec(&v).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(take_varint_u32(&bytes), Some((v, &[][..])), "{v}");
        }
        // Six bytes, or a fifth byte with more than 4 bits, is not a u32.
        assert_eq!(take_varint_u32(&[0xFF, 0xFF, 0xFF, 0xFF, 0x10]), None);
        assert_eq!(take_varint_u32(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x00]), None);
        assert_eq!(take_varint_u32(&[0x80]), None);
        assert_eq!(take_varint_u32(&[]), None);
    }

    /// What feeding some bytes to a decoder came to.
    #[derive(Debug, Default)]
    struct Outcomes {
        messages: usize,
        pending: usize,
        errors: BTreeMap<&'static str, usize>,
    }

    impl Outcomes {
        /// Pushes `bytes` in random pieces, draining with `next_to_mill` or `next_frame`, and
        /// checks that an error is sticky.
        fn feed(&mut self, rng: &mut Rng, bytes: &[u8], as_mill: bool) {
            let mut decoder = FrameDecoder::new();
            let mut rest = bytes;
            let mut error = None;
            while !rest.is_empty() && error.is_none() {
                let (chunk, tail) = rest.split_at(1 + rng.below(rest.len()));
                rest = tail;
                decoder.push(chunk);
                loop {
                    let next = if as_mill {
                        decoder.next_to_mill().map(|m| m.is_some())
                    } else {
                        decoder.next_frame::<ToExecutor>().map(|m| m.is_some())
                    };
                    match next {
                        Ok(true) => self.messages += 1,
                        Ok(false) => break,
                        Err(e) => {
                            error = Some(e);
                            break;
                        }
                    }
                }
            }
            match error {
                None => self.pending += 1,
                Some(e) => {
                    let kind = match &e {
                        CodecError::TooLarge { .. } => "too large",
                        CodecError::Malformed { .. } => "malformed",
                        CodecError::UnsupportedVersion { .. } => "unsupported version",
                        CodecError::BufferFull { .. } => "buffer full",
                        CodecError::Encode { .. } => "encode",
                    };
                    *self.errors.entry(kind).or_default() += 1;
                    decoder.push(b"more");
                    assert_eq!(decoder.next_frame::<ToMill>(), Err(e.clone()));
                    assert_eq!(decoder.next_to_mill(), Err(e));
                }
            }
        }

        fn errors(&self, kind: &str) -> usize {
            self.errors.get(kind).copied().unwrap_or(0)
        }
    }

    #[test]
    fn random_garbage_never_panics() {
        let mut rng = Rng(0x5EED_0001);
        let mut outcomes = Outcomes::default();
        for i in 0..10_000 {
            let len = rng.below(64);
            let mut bytes = rng.bytes(len);
            // Half the cases get a plausible length prefix so that bodies are decoded.
            if i % 2 == 0 && bytes.len() > PREFIX_LEN {
                let body = u32::try_from(rng.below(bytes.len() - PREFIX_LEN + 1)).unwrap_or(0);
                bytes[..PREFIX_LEN].copy_from_slice(&body.to_be_bytes());
            }
            outcomes.feed(&mut rng, &bytes, i % 4 < 2);
        }
        assert!(outcomes.errors("too large") > 0, "{outcomes:?}");
        assert!(outcomes.errors("malformed") > 0, "{outcomes:?}");
        assert!(outcomes.pending > 0, "{outcomes:?}");
        assert_eq!(outcomes.errors("buffer full"), 0, "{outcomes:?}");
        assert_eq!(outcomes.errors("encode"), 0, "{outcomes:?}");
    }

    #[test]
    fn truncated_frames_only_ever_wait_for_more() {
        let mut rng = Rng(0x5EED_0002);
        let to_mill: Vec<Vec<u8>> = to_mill_samples().iter().map(frame).collect();
        let to_executor: Vec<Vec<u8>> = to_executor_samples().iter().map(frame).collect();
        for i in 0..10_000 {
            let as_mill = i % 2 == 0;
            let pool = if as_mill { &to_mill } else { &to_executor };
            let whole = &pool[rng.below(pool.len())];
            let cut = &whole[..rng.below(whole.len())];
            let mut outcomes = Outcomes::default();
            outcomes.feed(&mut rng, cut, as_mill);
            assert_eq!(outcomes.messages, 0, "{outcomes:?}");
            assert!(outcomes.errors.is_empty(), "{outcomes:?}");
        }
    }

    #[test]
    fn corrupted_frames_never_panic() {
        let mut rng = Rng(0x5EED_0003);
        let to_mill: Vec<Vec<u8>> = to_mill_samples().iter().map(frame).collect();
        let to_executor: Vec<Vec<u8>> = to_executor_samples().iter().map(frame).collect();
        let mut outcomes = Outcomes::default();
        for i in 0..10_000 {
            let as_mill = i % 2 == 0;
            let pool = if as_mill { &to_mill } else { &to_executor };
            let mut bytes = pool[rng.below(pool.len())].clone();
            let at = rng.below(bytes.len());
            bytes[at] ^= 1 + rng.below(255) as u8;
            // Sometimes truncated as well.
            if rng.below(4) == 0 {
                bytes.truncate(rng.below(bytes.len() + 1));
            }
            outcomes.feed(&mut rng, &bytes, as_mill);
        }
        assert!(outcomes.messages > 0, "{outcomes:?}");
        assert!(outcomes.pending > 0, "{outcomes:?}");
        assert!(outcomes.errors("malformed") > 0, "{outcomes:?}");
        assert!(outcomes.errors("too large") > 0, "{outcomes:?}");
        assert!(outcomes.errors("unsupported version") > 0, "{outcomes:?}");
    }
}
