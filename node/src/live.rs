//! E15: the mill's live output buffers, read by cursor.
//!
//! A **cursor** is a byte offset into a job's output stream: the offset in the executor's
//! log of the attempt (the supervisor counts it, `LiveLog` carries it), shifted by where
//! earlier attempts of the job ended, so that it only moves forward and equals the offset in
//! the mill's stored log (`logs.rs`). Each job's bytes are kept in a bounded buffer (at most
//! `per_job` bytes) and all jobs together hold at most `total`; beyond either, the oldest
//! bytes are evicted (per job: its own oldest; in total: the job whose oldest held chunk
//! arrived first). A read below what is held gets an explicit [`Gap`] and continues from
//! the oldest byte held: nothing is spliced, and the bytes, the gaps and the cursors of a
//! reader's pieces account for every offset.

use std::collections::{BTreeMap, VecDeque};

use axum::body::Bytes;
use millrace_core::JobId;
use serde::Serialize;

/// Default per-job buffer: 1 MiB.
pub const DEFAULT_PER_JOB: usize = 1 << 20;
/// Default buffer across jobs: 64 MiB.
pub const DEFAULT_TOTAL: usize = 64 << 20;
/// Most job buffers held at once; a buffer leaves when its job's stored log is complete, so
/// this only bites if completions were lost; then the buffer held longest goes.
pub const MAX_LIVE_JOBS: usize = 16_384;

/// The buffer bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveLimits {
    /// Bytes held per job.
    pub per_job: usize,
    /// Bytes held across jobs.
    pub total: usize,
}

impl Default for LiveLimits {
    fn default() -> Self {
        LiveLimits {
            per_job: DEFAULT_PER_JOB,
            total: DEFAULT_TOTAL,
        }
    }
}

/// Why bytes of a job's output are not in a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum GapReason {
    /// The mill held them and evicted them from its bounded live buffer.
    Evicted,
    /// They never reached the mill (the executor's live-log budget, a disconnect, a full
    /// queue): a hole in the offsets.
    Dropped,
    /// Past the stored log's cap.
    Truncated,
}

/// Bytes a read skipped, `[from, to)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Gap {
    /// First offset missing (the cursor asked for).
    pub from: u64,
    /// First offset after the gap.
    pub to: u64,
    /// `to - from`.
    pub lost: u64,
    /// Why.
    pub reason: GapReason,
}

impl Gap {
    /// The gap `[from, to)`.
    pub fn new(from: u64, to: u64, reason: GapReason) -> Self {
        Gap {
            from,
            to,
            lost: to.saturating_sub(from),
            reason,
        }
    }
}

/// One answer to a read at a cursor: an optional gap, then contiguous bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// What was skipped before `bytes`, if anything.
    pub gap: Option<Gap>,
    /// Bytes starting at the gap's end (or the cursor).
    pub bytes: Bytes,
    /// The cursor of the next read.
    pub next: u64,
    /// The end of the output as far as the mill knows.
    pub end: u64,
    /// The job ended and `next` is the end: nothing more will come.
    pub done: bool,
}

#[derive(Debug)]
struct Chunk {
    at: u64,
    bytes: Bytes,
    /// Arrival order, for eviction across jobs.
    seq: u64,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.at + self.bytes.len() as u64
    }
}

#[derive(Debug, Default)]
struct JobBuf {
    /// Offsets below this were held and evicted (or predate this buffer: see `open`).
    evicted_to: u64,
    /// One past the last offset known (bytes or an end mark).
    end: u64,
    chunks: VecDeque<Chunk>,
    held: usize,
    done: bool,
}

/// Every job's live buffer; see the module docs.
#[derive(Debug)]
pub struct LiveLogs {
    limits: LiveLimits,
    jobs: BTreeMap<JobId, JobBuf>,
    /// Arrival seq of each job's oldest held chunk → the job (eviction across jobs).
    fronts: BTreeMap<u64, JobId>,
    held: usize,
    seq: u64,
}

impl LiveLogs {
    /// Empty buffers with these bounds (a bound of 0 is taken as 1).
    pub fn new(limits: LiveLimits) -> Self {
        LiveLogs {
            limits: LiveLimits {
                per_job: limits.per_job.max(1),
                total: limits.total.max(1),
            },
            jobs: BTreeMap::new(),
            fronts: BTreeMap::new(),
            held: 0,
            seq: 0,
        }
    }

    /// Bytes held across jobs.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held
    }

    /// Makes `job`'s buffer if it has none. `stored` is how far the job's stored log already
    /// reaches (a mill restarted mid-job): those bytes are not held, so a read below them is
    /// an evicted gap, never data made up.
    pub fn open(&mut self, job: JobId, stored: u64) {
        if self.jobs.contains_key(&job) {
            return;
        }
        if self.jobs.len() >= MAX_LIVE_JOBS {
            if let Some((_, oldest)) = self.fronts.pop_first() {
                self.remove(oldest);
            } else if let Some((&any, _)) = self.jobs.iter().next() {
                self.remove(any);
            }
            tracing::warn!(
                max = MAX_LIVE_JOBS,
                "live log buffers full; dropped the oldest"
            );
        }
        let buf = JobBuf {
            evicted_to: stored,
            end: stored,
            ..JobBuf::default()
        };
        self.jobs.insert(job, buf);
    }

    /// Adds bytes at stream offset `at` (an empty `bytes` only moves the known end). Bytes
    /// below the job's end are already accounted for and ignored. Then evicts down to both
    /// bounds.
    pub fn append(&mut self, job: JobId, at: u64, bytes: Bytes) {
        self.open(job, 0);
        let seq = self.seq;
        let Some(buf) = self.jobs.get_mut(&job) else {
            return;
        };
        let len = bytes.len() as u64;
        let new_end = at.saturating_add(len);
        if new_end <= buf.end {
            return;
        }
        let (at, bytes) = if at < buf.end {
            let skip = usize::try_from(buf.end - at).unwrap_or(usize::MAX);
            (buf.end, bytes.slice(skip.min(bytes.len())..))
        } else {
            (at, bytes)
        };
        buf.end = new_end;
        if bytes.is_empty() {
            return;
        }
        self.seq += 1;
        if buf.chunks.is_empty() {
            self.fronts.insert(seq, job);
        }
        buf.held += bytes.len();
        self.held += bytes.len();
        buf.chunks.push_back(Chunk { at, bytes, seq });
        self.evict_job(job);
        while self.held > self.limits.total {
            let Some((_, oldest)) = self.fronts.pop_first() else {
                break;
            };
            self.evict_front(oldest);
        }
        debug_assert_eq!(
            self.held,
            self.jobs.values().map(|b| b.held).sum::<usize>(),
            "held bytes out of step"
        );
    }

    /// The job ended: no bytes will come after `end` (a read at its end is done).
    pub fn finish(&mut self, job: JobId) {
        if let Some(buf) = self.jobs.get_mut(&job) {
            buf.done = true;
        }
    }

    /// Drops `job`'s buffer (its stored log is complete, or retention deleted it).
    pub fn remove(&mut self, job: JobId) {
        if let Some(buf) = self.jobs.remove(&job) {
            if let Some(front) = buf.chunks.front() {
                self.fronts.remove(&front.seq);
            }
            self.held -= buf.held;
        }
    }

    /// Per-job bound: trims the job's oldest bytes (a chunk partly, if need be).
    fn evict_job(&mut self, job: JobId) {
        let per_job = self.limits.per_job;
        let Some(buf) = self.jobs.get_mut(&job) else {
            return;
        };
        while buf.held > per_job {
            let over = buf.held - per_job;
            let Some(front) = buf.chunks.front_mut() else {
                break;
            };
            if front.bytes.len() > over {
                front.bytes = front.bytes.slice(over..);
                front.at += over as u64;
                buf.evicted_to = buf.evicted_to.max(front.at);
                buf.held -= over;
                self.held -= over;
            } else {
                let seq = front.seq;
                self.fronts.remove(&seq);
                drop_front(buf, &mut self.held);
                if let Some(next) = buf.chunks.front() {
                    self.fronts.insert(next.seq, job);
                }
            }
        }
    }

    /// Total bound: evicts `job`'s oldest chunk (its entry in `fronts` is already gone).
    fn evict_front(&mut self, job: JobId) {
        let Some(buf) = self.jobs.get_mut(&job) else {
            return;
        };
        drop_front(buf, &mut self.held);
        if let Some(next) = buf.chunks.front() {
            self.fronts.insert(next.seq, job);
        }
    }

    /// Reads at `cursor`, at most `max` bytes. `None` if the job has no buffer.
    pub fn read(&self, job: JobId, cursor: u64, max: usize) -> Option<Piece> {
        let buf = self.jobs.get(&job)?;
        let covering = buf.chunks.iter().position(|c| c.end() > cursor);
        let Some(first) = covering else {
            // Nothing held at or after the cursor.
            let (gap, next) = if cursor < buf.end {
                let reason = if cursor < buf.evicted_to {
                    GapReason::Evicted
                } else {
                    GapReason::Dropped
                };
                (Some(Gap::new(cursor, buf.end, reason)), buf.end)
            } else {
                (None, cursor)
            };
            return Some(Piece {
                gap,
                bytes: Bytes::new(),
                next,
                end: buf.end,
                done: buf.done && next >= buf.end,
            });
        };
        let start = buf.chunks[first].at.max(cursor);
        let gap = (start > cursor).then(|| {
            let reason = if cursor < buf.evicted_to {
                GapReason::Evicted
            } else {
                GapReason::Dropped
            };
            Gap::new(cursor, start, reason)
        });
        let mut out: Vec<u8> = Vec::new();
        let mut pos = start;
        for c in buf.chunks.iter().skip(first) {
            if c.at != pos && !(c.at < pos && c.end() > pos) {
                break; // a hole: the next read reports it
            }
            let from = usize::try_from(pos - c.at).unwrap_or(0);
            let room = max.saturating_sub(out.len());
            let take = (c.bytes.len() - from).min(room);
            out.extend_from_slice(&c.bytes[from..from + take]);
            pos += take as u64;
            if out.len() >= max {
                break;
            }
        }
        Some(Piece {
            gap,
            bytes: Bytes::from(out),
            next: pos,
            end: buf.end,
            done: buf.done && pos >= buf.end,
        })
    }
}

fn drop_front(buf: &mut JobBuf, held: &mut usize) {
    if let Some(c) = buf.chunks.pop_front() {
        buf.evicted_to = buf.evicted_to.max(c.end());
        buf.held -= c.bytes.len();
        *held -= c.bytes.len();
    }
}

/// The marker line printed for a gap of `lost` bytes (the text stream and `millrace logs`):
/// visible, on a line of its own, never mistaken for output that ran on.
pub fn gap_marker(lost: u64, reason: &str) -> String {
    format!("\n--- {lost} bytes lost ({reason}) ---\n")
}

/// Standard base64 with padding (RFC 4648 §4): how a read's bytes travel in JSON, whatever
/// they are (job output need not be UTF-8, and a chunk may split a character).
pub fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b = [
            group.first().copied().unwrap_or(0),
            group.get(1).copied().unwrap_or(0),
            group.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= group.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes [`base64_encode`]'s output; `None` for anything else.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(u32::from(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    }
    let bytes = text.as_bytes();
    if bytes.len() & 3 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for (i, quad) in bytes.chunks(4).enumerate() {
        let last = i + 1 == bytes.len() / 4;
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * pad as u32;
        let got = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&got[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const J: JobId = JobId(1);
    const K: JobId = JobId(2);

    fn logs(per_job: usize, total: usize) -> LiveLogs {
        LiveLogs::new(LiveLimits { per_job, total })
    }

    fn put(l: &mut LiveLogs, job: JobId, at: u64, text: &str) {
        l.append(job, at, Bytes::copy_from_slice(text.as_bytes()));
    }

    /// Reads everything from `cursor` as the CLI does: bytes and gaps in order.
    fn drain(l: &LiveLogs, job: JobId, mut cursor: u64, max: usize) -> (Vec<u8>, Vec<Gap>) {
        let (mut bytes, mut gaps) = (Vec::new(), Vec::new());
        loop {
            let p = l.read(job, cursor, max).unwrap();
            let from = p.gap.map_or(cursor, |g| g.to);
            if let Some(g) = p.gap {
                assert_eq!(g.from, cursor);
                gaps.push(g);
            }
            assert_eq!(p.next, from + p.bytes.len() as u64, "cursor arithmetic");
            bytes.extend_from_slice(&p.bytes);
            if p.next == cursor {
                return (bytes, gaps);
            }
            cursor = p.next;
        }
    }

    #[test]
    fn e15_a_read_below_the_per_job_bound_is_an_evicted_gap_then_the_oldest_byte_held() {
        let mut l = logs(8, 100);
        put(&mut l, J, 0, "0123456789abcdef");
        let (bytes, gaps) = drain(&l, J, 0, 3);
        assert_eq!(gaps, [Gap::new(0, 8, GapReason::Evicted)]);
        assert_eq!(bytes, b"89abcdef");
        assert_eq!(l.held(), 8);
    }

    #[test]
    fn e15_a_hole_in_the_offsets_is_a_dropped_gap() {
        let mut l = logs(100, 100);
        put(&mut l, J, 0, "abc");
        put(&mut l, J, 10, "xyz");
        l.append(J, 20, Bytes::new()); // the end mark
        l.finish(J);
        let (bytes, gaps) = drain(&l, J, 0, 100);
        assert_eq!(bytes, b"abcxyz");
        assert_eq!(
            gaps,
            [
                Gap::new(3, 10, GapReason::Dropped),
                Gap::new(13, 20, GapReason::Dropped)
            ]
        );
        let end = l.read(J, 20, 100).unwrap();
        assert!(end.done && end.gap.is_none() && end.bytes.is_empty());
    }

    #[test]
    fn e15_the_total_bound_evicts_the_oldest_chunk_across_jobs() {
        let mut l = logs(100, 10);
        put(&mut l, J, 0, "aaaa");
        put(&mut l, K, 0, "bbbb");
        put(&mut l, J, 4, "cccc"); // 12 > 10: J's first chunk (oldest) goes
        assert_eq!(l.held(), 8);
        assert_eq!(
            drain(&l, J, 0, 100),
            (b"cccc".to_vec(), vec![Gap::new(0, 4, GapReason::Evicted)])
        );
        assert_eq!(drain(&l, K, 0, 100), (b"bbbb".to_vec(), vec![]));
        put(&mut l, K, 4, "dddd"); // K's first chunk is now the oldest
        assert_eq!(drain(&l, K, 0, 100).1, [Gap::new(0, 4, GapReason::Evicted)]);
        l.remove(J);
        l.remove(K);
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn e15_overlapping_bytes_are_not_counted_twice() {
        let mut l = logs(100, 100);
        put(&mut l, J, 0, "abcd");
        put(&mut l, J, 2, "cdef");
        put(&mut l, J, 1, "b");
        assert_eq!(drain(&l, J, 0, 100), (b"abcdef".to_vec(), vec![]));
        assert_eq!(l.held(), 6);
    }

    #[test]
    fn e15_a_buffer_opened_over_a_stored_log_reports_the_stored_part_as_evicted() {
        let mut l = logs(100, 100);
        l.open(J, 50);
        put(&mut l, J, 50, "new");
        assert_eq!(
            drain(&l, J, 0, 100),
            (b"new".to_vec(), vec![Gap::new(0, 50, GapReason::Evicted)])
        );
    }

    #[test]
    fn e15_every_offset_is_bytes_or_gap_under_random_appends_and_bounds() {
        // A deterministic pseudo-random workload: holes, overlaps, two jobs, small bounds.
        let mut l = logs(37, 50);
        let mut x: u64 = 0x9e37_79b9;
        let mut end = [0u64; 2];
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let j = (x & 1) as usize;
            let job = [J, K][j];
            let skip = (x >> 8) % 4;
            let len = (x >> 16) % 20;
            let at = (end[j] + skip).saturating_sub((x >> 24) % 3);
            let bytes: Vec<u8> = (at..at + len).map(|o| (o % 251) as u8).collect();
            l.append(job, at, Bytes::from(bytes));
            end[j] = end[j].max(at + len);
            assert!(l.held() <= 50);
            // Read it all: every byte is the one written at its offset, and bytes + gaps
            // cover every offset up to the end.
            let (mut cursor, mut covered) = (0u64, 0u64);
            loop {
                let p = l.read(job, cursor, 7).unwrap();
                let from = p.gap.map_or(cursor, |g| g.to);
                covered += p.gap.map_or(0, |g| g.lost) + p.bytes.len() as u64;
                for (i, &b) in p.bytes.iter().enumerate() {
                    let at = from + i as u64;
                    assert_eq!(u64::from(b), at % 251, "byte at {at}");
                }
                if p.next == cursor {
                    break;
                }
                cursor = p.next;
            }
            assert_eq!(covered, end[j], "bytes + gaps cover every offset");
        }
    }

    #[test]
    fn base64_round_trips_every_length_and_refuses_garbage() {
        let data: Vec<u8> = (0..=255).collect();
        for n in 0..20 {
            let enc = base64_encode(&data[..n]);
            assert_eq!(base64_decode(&enc).as_deref(), Some(&data[..n]));
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_decode("Zm8"), None);
        assert_eq!(base64_decode("Z=8="), None);
        assert_eq!(base64_decode("Zm8*"), None);
    }
}
