//! The trace: one line per event (time, process, what went in or came out), hashed into a
//! stable digest (I10), optionally written to a file, and the last lines kept for reports.
//!
//! Lines are formatted by hand, never with `{:?}`, so that the hash does not depend on how a
//! compiler version prints a type. When tracing is off nothing is formatted at all: fuzzing
//! runs without it and re-runs a failing seed with it.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::Write as _;

use millrace_core::executor::{ExecutorInput, ExecutorOutput, ExecutorWrite, StopReason};
use millrace_core::job::{JobSpec, JobState, Terminal};
use millrace_core::mill::{MillInput, MillOutput, MillWrite, Observation};
use millrace_core::wire::{EndCause, EventKind, ToExecutor, ToMill};
use millrace_core::JobId;
use sha2::{Digest, Sha256};

use crate::scenario::{Micros, MS, SEC};

/// Where trace lines go.
pub struct Trace {
    on: bool,
    hasher: Sha256,
    lines: VecDeque<String>,
    keep: usize,
    file: Option<std::io::BufWriter<std::fs::File>>,
    count: u64,
    buf: String,
}

impl Trace {
    /// A trace that records nothing.
    pub fn off() -> Self {
        Trace {
            on: false,
            hasher: Sha256::new(),
            lines: VecDeque::new(),
            keep: 0,
            file: None,
            count: 0,
            buf: String::new(),
        }
    }

    /// A trace that hashes every line, keeps the last `keep` and writes all to `file`.
    pub fn on(keep: usize, file: Option<std::fs::File>) -> Self {
        Trace {
            on: true,
            keep,
            file: file.map(std::io::BufWriter::new),
            ..Trace::off()
        }
    }

    /// Whether lines are recorded.
    pub fn enabled(&self) -> bool {
        self.on
    }

    /// Records one line: `time process text`, where `f` writes the text.
    pub fn line(&mut self, now: Micros, process: &str, f: impl FnOnce(&mut String)) {
        if !self.on {
            return;
        }
        self.buf.clear();
        let _ = write!(
            self.buf,
            "{:>5}.{:06} {:<4} ",
            now / SEC,
            now % SEC,
            process
        );
        f(&mut self.buf);
        self.buf.push('\n');
        self.hasher.update(self.buf.as_bytes());
        self.count += 1;
        if let Some(file) = &mut self.file {
            let _ = file.write_all(self.buf.as_bytes());
        }
        if self.keep > 0 {
            if self.lines.len() == self.keep {
                self.lines.pop_front();
            }
            self.lines.push_back(self.buf.trim_end().to_string());
        }
    }

    /// The hex digest of every line so far.
    pub fn hash(&self) -> String {
        let digest = self.hasher.clone().finalize();
        let mut s = String::with_capacity(64);
        for b in digest {
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// Lines recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The last lines kept.
    pub fn last_lines(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }

    /// Flushes the file, if any.
    pub fn finish(&mut self) {
        if let Some(f) = &mut self.file {
            let _ = f.flush();
        }
    }
}

/// Seconds with milliseconds, for summaries.
pub fn secs(m: Micros) -> String {
    format!("{}.{:03}s", m / SEC, (m % SEC) / MS)
}

fn state(s: &mut String, st: &JobState) {
    match st {
        JobState::Queued => s.push_str("queued"),
        JobState::Reserved { lease, node } => {
            let _ = write!(s, "reserved {lease}@{node}");
        }
        JobState::Running { lease, node } => {
            let _ = write!(s, "running {lease}@{node}");
        }
        JobState::Done(t) => terminal(s, t),
    }
}

/// Writes a terminal: status, exit code, error, node and lease.
pub fn terminal(s: &mut String, t: &Terminal) {
    let _ = write!(s, "{}", t.status);
    if let Some(c) = t.exit_code {
        let _ = write!(s, " exit={c}");
    }
    if let Some(e) = &t.error {
        let _ = write!(s, " error={e:?}");
    }
    if let (Some(l), Some(n)) = (t.lease, &t.node) {
        let _ = write!(s, " {l}@{n}");
    }
}

fn event_kind(s: &mut String, k: &EventKind) {
    match k {
        EventKind::Running => s.push_str("running"),
        EventKind::Terminal {
            status,
            exit_code,
            error,
            log,
            cause,
        } => {
            let _ = write!(s, "{status}");
            if *cause != EndCause::Engine {
                let _ = write!(s, "/{cause:?}");
            }
            if let Some(c) = exit_code {
                let _ = write!(s, "/{c}");
            }
            if let Some(e) = error {
                let _ = write!(s, "/{e:?}");
            }
            if log.is_some() {
                s.push_str("/log");
            }
        }
    }
}

/// Summarises an executor → mill message.
pub fn to_mill(s: &mut String, m: &ToMill) {
    match m {
        ToMill::Hello {
            node_id,
            epoch,
            term,
            ..
        } => {
            let _ = write!(s, "Hello {node_id} {epoch}");
            if term.get() > 1 {
                let _ = write!(s, " seen={term}");
            }
        }
        ToMill::Stale { term } => {
            let _ = write!(s, "Stale {term}");
        }
        ToMill::Snapshot {
            seqno,
            engines,
            active_leases,
            outbox_high,
        } => {
            let _ = write!(s, "Snapshot #{seqno} high={outbox_high} [");
            for (name, e) in engines {
                let _ = write!(
                    s,
                    "{name}:{}/{}{} ",
                    if e.available { "open" } else { "full" },
                    e.capacity,
                    e.load
                        .get("seats")
                        .map(|l| format!("@{l:.2}"))
                        .unwrap_or_default()
                );
            }
            s.push_str("] active=");
            for l in active_leases {
                let _ = write!(s, "{l},");
            }
        }
        ToMill::ReserveResult {
            lease,
            accepted,
            reject,
            resources,
            ..
        } => {
            if *accepted {
                let _ = write!(s, "ReserveResult {lease} accepted ");
                for (k, v) in resources {
                    let _ = write!(s, "{k}={v},");
                }
            } else {
                let _ = write!(
                    s,
                    "ReserveResult {lease} rejected {}",
                    match reject {
                        Some(millrace_core::wire::RejectKind::Transient) => "transient",
                        Some(millrace_core::wire::RejectKind::Incompatible) => "incompatible",
                        None => "-",
                    }
                );
            }
        }
        ToMill::CommitResult { lease, committed } => {
            let _ = write!(s, "CommitResult {lease} {committed}");
        }
        ToMill::EventBatch { epoch, events } => {
            let _ = write!(s, "EventBatch {epoch} [");
            for e in events {
                let _ = write!(s, "{}:{}:", e.seqno, e.lease);
                event_kind(s, &e.kind);
                s.push(' ');
            }
            s.push(']');
        }
        ToMill::CancelAck { lease } => {
            let _ = write!(s, "CancelAck {lease}");
        }
        ToMill::LiveLog {
            lease,
            offset,
            bytes,
        } => {
            let _ = write!(s, "LiveLog {lease} @{offset} {}B", bytes.len());
        }
    }
}

/// Summarises a mill → executor message.
pub fn to_exec(s: &mut String, m: &ToExecutor) {
    // E13: the term, once a mill has taken over (term 1 is every single-mill run's).
    if let Some(t) = m.term().filter(|t| t.get() > 1) {
        let _ = write!(s, "{t} ");
    }
    match m {
        ToExecutor::Welcome { cursor, timers, .. } => {
            let _ = write!(
                s,
                "Welcome cursor={cursor} grace={:?}",
                timers.reconnect_grace
            );
        }
        ToExecutor::Refused { leader: _, reason } => {
            let _ = write!(s, "Refused {reason:?}");
        }
        ToExecutor::ReserveSeat {
            lease, job, spec, ..
        } => {
            let _ = write!(s, "ReserveSeat {lease} {job} {}", spec.engine);
        }
        ToExecutor::CommitLease { lease, .. } => {
            let _ = write!(s, "CommitLease {lease}");
        }
        ToExecutor::ReleaseLease { term: _, lease } => {
            let _ = write!(s, "ReleaseLease {lease}");
        }
        ToExecutor::CancelAttempt {
            term: _,
            lease,
            reason,
        } => {
            let _ = write!(s, "CancelAttempt {lease} {reason:?}");
        }
        ToExecutor::Ack {
            term: _,
            epoch,
            up_to,
        } => {
            let _ = write!(s, "Ack {epoch} {up_to}");
        }
    }
}

/// Summarises a mill input.
pub fn mill_input(s: &mut String, i: &MillInput) {
    match i {
        MillInput::Connected { conn } => {
            let _ = write!(s, "< connected {conn}");
        }
        MillInput::Message { conn, msg } => {
            let _ = write!(s, "< {conn} ");
            to_mill(s, msg);
        }
        MillInput::Disconnected { conn } => {
            let _ = write!(s, "< disconnected {conn}");
        }
        MillInput::Tick => s.push_str("< tick"),
        _ => s.push_str("< (an input this simulator does not know)"),
    }
}

/// Summarises a client's submit.
pub fn mill_submit(s: &mut String, spec: &JobSpec) {
    let _ = write!(
        s,
        "< submit {} labels={} res={} owner={}",
        spec.engine,
        spec.labels.len(),
        spec.resources.len(),
        spec.identity.owner
    );
}

/// Summarises a user's cancel.
pub fn mill_cancel(s: &mut String, job: JobId) {
    let _ = write!(s, "< cancel {job}");
}

fn mill_write(s: &mut String, w: &MillWrite) {
    match w {
        MillWrite::Counters {
            next_job,
            lease_floor,
        } => {
            let _ = write!(s, "counters({next_job},{lease_floor})");
        }
        MillWrite::JobInsert { job, .. } => {
            let _ = write!(s, "insert({job})");
        }
        MillWrite::KeyInsert { key, record } => {
            let _ = write!(s, "key({key} {})", record.job);
        }
        MillWrite::JobState { job, state: st } => {
            let _ = write!(s, "state({job} ");
            state(s, st);
            s.push(')');
        }
        MillWrite::LeaseUpsert(r) => {
            let _ = write!(
                s,
                "lease({} {} #{} {} {:?})",
                r.lease, r.job, r.attempt, r.node, r.state
            );
        }
        MillWrite::Attempt(a) => {
            let _ = write!(
                s,
                "attempt({} #{} {} {:?} {:?} {:?})",
                a.job, a.attempt, a.lease, a.status, a.cause, a.outcome
            );
        }
        MillWrite::LeaseCancel { lease, cancel } => {
            let _ = write!(s, "cancel({lease} {})", cancel.status);
        }
        MillWrite::LeaseDelete { lease } => {
            let _ = write!(s, "delete({lease})");
        }
        MillWrite::Cursor { node, epoch, seqno } => {
            let _ = write!(s, "cursor({node} {epoch} {seqno})");
        }
        MillWrite::CursorDelete { node, epoch } => {
            let _ = write!(s, "forget-cursor({node} {epoch})");
        }
        MillWrite::QuotaHold { job, .. } => {
            let _ = write!(s, "hold({job})");
        }
        MillWrite::QuotaRelease { job } => {
            let _ = write!(s, "release({job})");
        }
        MillWrite::Quarantine { node, quarantined } => {
            let _ = write!(s, "quarantine({node} {quarantined})");
        }
    }
}

/// Summarises a mill output.
pub fn mill_output(s: &mut String, o: &MillOutput) {
    match o {
        MillOutput::Send { conn, msg } => {
            let _ = write!(s, "> {conn} ");
            to_exec(s, msg);
        }
        MillOutput::Close { conn, reason } => {
            let _ = write!(s, "> close {conn} {reason:?}");
        }
        MillOutput::Persist(b) => {
            s.push_str("> persist ");
            for w in &b.writes {
                mill_write(s, w);
                s.push(' ');
            }
        }
        MillOutput::JobUpdate { job, state: st } => {
            let _ = write!(s, "> job {job} ");
            state(s, st);
        }
        MillOutput::LiveLog {
            job, offset, bytes, ..
        } => {
            let _ = write!(s, "> livelog {job} @{offset} {}B", bytes.len());
        }
        MillOutput::Observed(obs) => {
            s.push_str("> observed ");
            match obs {
                Observation::Placed {
                    job,
                    lease,
                    node,
                    latency,
                } => {
                    let _ = write!(
                        s,
                        "placed {job} {lease}@{node} after {}",
                        secs(latency.as_micros() as u64)
                    );
                }
                Observation::Violation { node, kind, reason } => {
                    let _ = write!(s, "violation {node} {kind} {reason:?}");
                }
                Observation::Quarantined { node } => {
                    let _ = write!(s, "quarantined {node}");
                }
                Observation::QuotaWait { job } => {
                    let _ = write!(s, "quota-wait {job}");
                }
                Observation::Deposed { node, ours, seen } => {
                    let _ = write!(s, "deposed? {node} has seen {seen} above {ours}");
                }
                Observation::Retried {
                    job,
                    attempt,
                    cause,
                    fenced,
                } => {
                    let _ = write!(
                        s,
                        "retried {job} after #{attempt} {cause:?} fenced={fenced}"
                    );
                }
                Observation::Refused { conn, reason } => {
                    let _ = write!(s, "refused {conn} {reason:?}");
                }
                Observation::Applied {
                    conn,
                    epoch,
                    first,
                    last,
                    events,
                } => {
                    let _ = write!(s, "applied {conn} {epoch} {first}..={last} ({events})");
                }
                Observation::Rare(p) => {
                    let _ = write!(s, "rare {}", crate::coverage::rare_name(*p));
                }
            }
        }
    }
}

/// Summarises an executor input.
pub fn exec_input(s: &mut String, i: &ExecutorInput) {
    match i {
        ExecutorInput::Connected { conn } => {
            let _ = write!(s, "< connected {conn}");
        }
        ExecutorInput::ConnectFailed => s.push_str("< connect failed"),
        ExecutorInput::Message { conn, msg } => {
            let _ = write!(s, "< {conn} ");
            to_exec(s, msg);
        }
        ExecutorInput::Disconnected { conn } => {
            let _ = write!(s, "< disconnected {conn}");
        }
        ExecutorInput::JobStarted { lease } => {
            let _ = write!(s, "< started {lease}");
        }
        ExecutorInput::JobExited {
            lease,
            status,
            exit_code,
            ..
        } => {
            let _ = write!(s, "< exited {lease} {status} {exit_code:?}");
        }
        ExecutorInput::JobLog {
            lease,
            offset,
            bytes,
        } => {
            let _ = write!(s, "< log {lease} @{offset} {}B", bytes.len());
        }
        ExecutorInput::JobLost { lease } => {
            let _ = write!(s, "< lost {lease}");
        }
        ExecutorInput::Drain => s.push_str("< drain"),
        ExecutorInput::Tick => s.push_str("< tick"),
        _ => s.push_str("< (an input this simulator does not know)"),
    }
}

/// Summarises an executor output.
pub fn exec_output(s: &mut String, o: &ExecutorOutput) {
    match o {
        ExecutorOutput::Connect { .. } => s.push_str("> connect"),
        ExecutorOutput::Send { conn, msg } => {
            let _ = write!(s, "> {conn} ");
            to_mill(s, msg);
        }
        ExecutorOutput::Close { conn, reason } => {
            let _ = write!(s, "> close {conn} {reason:?}");
        }
        ExecutorOutput::Persist(b) => {
            s.push_str("> persist ");
            for w in &b.writes {
                match w {
                    ExecutorWrite::Append(e) => {
                        let _ = write!(s, "append({} {} ", e.seqno, e.lease);
                        event_kind(s, &e.kind);
                        s.push_str(") ");
                    }
                    ExecutorWrite::Trim { up_to } => {
                        let _ = write!(s, "trim({up_to}) ");
                    }
                    ExecutorWrite::Term(t) => {
                        let _ = write!(s, "term({t}) ");
                    }
                    ExecutorWrite::JobCommitted { lease, job } => {
                        let _ = write!(s, "committed({lease} {}) ", job.job);
                    }
                    ExecutorWrite::JobStopping { lease, stop } => {
                        let why = match stop {
                            StopReason::Cancel(_) => "cancel",
                            StopReason::Fence => "fence",
                        };
                        let _ = write!(s, "stopping({lease} {why}) ");
                    }
                    ExecutorWrite::JobEnded { lease } => {
                        let _ = write!(s, "ended({lease}) ");
                    }
                    ExecutorWrite::Contact { at } => {
                        let _ = write!(s, "contact({at}) ");
                    }
                    ExecutorWrite::Timers(t) => {
                        let _ = write!(s, "timers(grace {:?}) ", t.reconnect_grace);
                    }
                }
            }
        }
        ExecutorOutput::StartJob { lease, job, .. } => {
            let _ = write!(s, "> start {lease} {job}");
        }
        ExecutorOutput::AdoptJob { lease, job } => {
            let _ = write!(s, "> adopt {lease} {job}");
        }
        ExecutorOutput::StopJob { lease, grace } => {
            let _ = write!(s, "> stop {lease} grace={}", secs(grace.as_micros() as u64));
        }
    }
}
