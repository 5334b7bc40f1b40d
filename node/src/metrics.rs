//! The mill's Prometheus metrics: counters fed by the driver from `Observed` outputs, job
//! updates and persisted cursors, and gauges read from the mill's read-only accessors when
//! `/metrics` is scraped.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use millrace_core::job::{JobState, TerminalStatus};
use millrace_core::mill::{LeaseState, Mill, ViolationKind};
use millrace_core::quota::Scope;
use millrace_core::{Epoch, NodeId, Seqno};

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A Prometheus histogram with fixed buckets.
#[derive(Debug, Default, Clone)]
pub struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        for (bound, c) in BUCKETS.iter().zip(self.counts.iter_mut()) {
            if s <= *bound {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += s;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (bound, c) in BUCKETS.iter().zip(self.counts.iter()) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Counters the mill driver keeps.
#[derive(Debug, Default)]
pub struct MillMetrics {
    /// Leases published (bids won).
    pub placed: u64,
    /// Jobs that ended without ever being placed (no compatible executor, quota denied, …).
    pub unplaced: u64,
    /// Queued → published.
    pub placement_latency: Histogram,
    /// One group commit (one SQLite transaction).
    pub commit_latency: Histogram,
    /// Persist batches written.
    pub batches: u64,
    /// Events applied, from the cursor advances persisted.
    pub events_applied: u64,
    /// Violation closures by kind.
    pub violations: BTreeMap<&'static str, u64>,
    /// Hellos refused.
    pub refused: u64,
    /// Attempts retried under their job's policy (M32).
    pub retried: u64,
    /// Nodes quarantined.
    pub quarantined: u64,
    /// Jobs accepted.
    pub submitted: u64,
    /// Submits answered with an existing job through their idempotency key (M31).
    pub submit_replays: u64,
    /// Jobs ended, by status.
    pub finished: BTreeMap<TerminalStatus, u64>,
    /// Live-log chunks dropped because the log writer was behind.
    pub live_log_dropped: u64,
    /// Messages dropped because a connection's queue was full (the connection is closed).
    pub send_overflows: u64,
    /// Cursors of old epochs forgotten (M23).
    pub cursors_forgotten: u64,
    /// Retention batches run (one transaction each).
    pub retention_batches: u64,
    /// Finished jobs deleted by retention.
    pub retention_jobs: u64,
    /// Status-history rows deleted by retention.
    pub retention_history_rows: u64,
    /// Job log files (logs and their completion markers) deleted by retention, as the log
    /// writer last reported.
    pub retention_log_files: u64,
    cursors: BTreeMap<(NodeId, Epoch), Seqno>,
}

impl MillMetrics {
    /// Starts the cursor mirror from the restored cursors, so that events applied count only
    /// this process's work.
    pub fn with_cursors(cursors: BTreeMap<(NodeId, Epoch), Seqno>) -> Self {
        MillMetrics {
            cursors,
            ..MillMetrics::default()
        }
    }

    /// A persisted cursor advance.
    pub fn cursor(&mut self, node: &NodeId, epoch: Epoch, seqno: Seqno) {
        let old = self
            .cursors
            .insert((node.clone(), epoch), seqno)
            .unwrap_or_default();
        self.events_applied += seqno.get().saturating_sub(old.get());
    }

    /// A cursor the mill forgot (an old epoch of a node, M23): the mirror drops it too, so
    /// it stays as bounded as the mill's.
    pub fn cursor_forgotten(&mut self, node: &NodeId, epoch: Epoch) {
        self.cursors.remove(&(node.clone(), epoch));
        self.cursors_forgotten += 1;
    }

    /// A job update the driver acted on.
    pub fn job_update(&mut self, state: &JobState) {
        if let JobState::Done(t) = state {
            *self.finished.entry(t.status).or_default() += 1;
            if t.lease.is_none() && t.status == TerminalStatus::Failed {
                self.unplaced += 1;
            }
        }
    }

    /// A violation closure, counted by the kind the core reports (never by its text).
    pub fn violation(&mut self, kind: ViolationKind) {
        *self.violations.entry(kind.name()).or_default() += 1;
    }

    /// Prometheus text exposition of everything, with gauges read from `mill`.
    pub fn render(&self, mill: &Mill) -> String {
        let mut out = String::with_capacity(8192);
        counter(
            &mut out,
            "millrace_placements_total",
            "Placement outcomes by result.",
        );
        let _ = writeln!(
            out,
            "millrace_placements_total{{result=\"placed\"}} {}",
            self.placed
        );
        let _ = writeln!(
            out,
            "millrace_placements_total{{result=\"unplaced\"}} {}",
            self.unplaced
        );
        self.placement_latency.render(
            &mut out,
            "millrace_placement_latency_seconds",
            "Time from queued to lease published.",
        );
        self.commit_latency.render(
            &mut out,
            "millrace_store_commit_seconds",
            "Time of one group commit (one SQLite transaction).",
        );
        counter(
            &mut out,
            "millrace_store_batches_total",
            "Persist batches written.",
        );
        let _ = writeln!(out, "millrace_store_batches_total {}", self.batches);

        let (mut connected, mut grace) = (0u64, 0u64);
        for (_, is_connected) in mill.sessions() {
            if is_connected {
                connected += 1;
            } else {
                grace += 1;
            }
        }
        gauge(&mut out, "millrace_sessions", "Executor sessions by state.");
        let _ = writeln!(out, "millrace_sessions{{state=\"connected\"}} {connected}");
        let _ = writeln!(out, "millrace_sessions{{state=\"grace\"}} {grace}");
        let _ = writeln!(
            out,
            "millrace_sessions{{state=\"quarantined\"}} {}",
            mill.quarantined().len()
        );

        let (mut reserved, mut running) = (0u64, 0u64);
        for (_, _, _, _, state, _) in mill.leases() {
            match state {
                LeaseState::Reserved => reserved += 1,
                LeaseState::Running => running += 1,
            }
        }
        gauge(&mut out, "millrace_leases", "Leases by state.");
        let _ = writeln!(out, "millrace_leases{{state=\"reserved\"}} {reserved}");
        let _ = writeln!(out, "millrace_leases{{state=\"running\"}} {running}");
        gauge(
            &mut out,
            "millrace_jobs_pending",
            "Jobs waiting for placement.",
        );
        let _ = writeln!(out, "millrace_jobs_pending {}", mill.pending());
        gauge(
            &mut out,
            "millrace_idempotency_keys",
            "Idempotency keys the mill holds (M31), until retention deletes their jobs.",
        );
        let _ = writeln!(out, "millrace_idempotency_keys {}", mill.key_count());

        counter(
            &mut out,
            "millrace_events_applied_total",
            "Executor events applied.",
        );
        let _ = writeln!(out, "millrace_events_applied_total {}", self.events_applied);

        counter(
            &mut out,
            "millrace_violations_total",
            "Sessions closed for a protocol violation, by kind.",
        );
        for (kind, n) in &self.violations {
            let _ = writeln!(out, "millrace_violations_total{{kind=\"{kind}\"}} {n}");
        }
        counter(&mut out, "millrace_hello_refused_total", "Hellos refused.");
        let _ = writeln!(out, "millrace_hello_refused_total {}", self.refused);
        counter(
            &mut out,
            "millrace_retries_total",
            "Attempts that ended and were retried under their job's policy (M32).",
        );
        let _ = writeln!(out, "millrace_retries_total {}", self.retried);
        counter(&mut out, "millrace_quarantines_total", "Nodes quarantined.");
        let _ = writeln!(out, "millrace_quarantines_total {}", self.quarantined);

        counter(&mut out, "millrace_jobs_submitted_total", "Jobs accepted.");
        let _ = writeln!(out, "millrace_jobs_submitted_total {}", self.submitted);
        counter(
            &mut out,
            "millrace_submit_replays_total",
            "Submits answered with the existing job of their idempotency key (M31).",
        );
        let _ = writeln!(out, "millrace_submit_replays_total {}", self.submit_replays);
        counter(
            &mut out,
            "millrace_jobs_finished_total",
            "Jobs ended, by status.",
        );
        for status in [
            TerminalStatus::Success,
            TerminalStatus::Failed,
            TerminalStatus::Timeout,
            TerminalStatus::Cancelled,
        ] {
            let n = self.finished.get(&status).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "millrace_jobs_finished_total{{status=\"{status}\"}} {n}"
            );
        }

        let mut usage: BTreeMap<(String, String, String), u64> = BTreeMap::new();
        for (_, identity, charge) in mill.quota().holds() {
            for scope in Scope::of(identity) {
                let (kind, name) = match scope {
                    Scope::Owner(n) => ("owner", n),
                    Scope::Repo(n) => ("repo", n),
                };
                for (resource, amount) in charge {
                    *usage
                        .entry((kind.to_string(), name.clone(), resource.clone()))
                        .or_default() += amount;
                }
            }
        }
        gauge(
            &mut out,
            "millrace_quota_usage",
            "Quota held, by scope and resource.",
        );
        for ((kind, name, resource), n) in usage {
            let _ = writeln!(
                out,
                "millrace_quota_usage{{scope=\"{kind}\",name=\"{}\",resource=\"{}\"}} {n}",
                escape(&name),
                escape(&resource)
            );
        }
        gauge(
            &mut out,
            "millrace_quota_waiting",
            "Jobs waiting for quota.",
        );
        let _ = writeln!(out, "millrace_quota_waiting {}", mill.quota().waiting());

        counter(
            &mut out,
            "millrace_live_log_dropped_total",
            "Live-log chunks dropped because the log writer was behind.",
        );
        let _ = writeln!(
            out,
            "millrace_live_log_dropped_total {}",
            self.live_log_dropped
        );
        counter(
            &mut out,
            "millrace_send_overflows_total",
            "Connections closed because their send queue was full.",
        );
        let _ = writeln!(out, "millrace_send_overflows_total {}", self.send_overflows);
        counter(
            &mut out,
            "millrace_retention_deleted_total",
            "Rows and files deleted by retention (--retention, --retention-count), by what.",
        );
        for (what, n) in [
            ("jobs", self.retention_jobs),
            ("history_rows", self.retention_history_rows),
            ("log_files", self.retention_log_files),
        ] {
            let _ = writeln!(
                out,
                "millrace_retention_deleted_total{{what=\"{what}\"}} {n}"
            );
        }
        counter(
            &mut out,
            "millrace_retention_batches_total",
            "Retention batches run (one bounded transaction each).",
        );
        let _ = writeln!(
            out,
            "millrace_retention_batches_total {}",
            self.retention_batches
        );
        counter(
            &mut out,
            "millrace_cursors_forgotten_total",
            "Event cursors of old executor epochs forgotten (M23).",
        );
        let _ = writeln!(
            out,
            "millrace_cursors_forgotten_total {}",
            self.cursors_forgotten
        );
        out
    }
}

fn counter(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} counter");
}

fn gauge(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
}

/// Escapes a label value (backslash, quote, newline).
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn m28_violations_are_counted_by_their_kind() {
        let mut m = MillMetrics::default();
        for _ in 0..3 {
            m.violation(ViolationKind::WrongEpoch);
        }
        for kind in ViolationKind::ALL {
            m.violation(kind);
        }
        assert_eq!(m.violations.get("wrong_epoch"), Some(&4));
        assert_eq!(m.violations.get("seqno_gap"), Some(&1));
        assert_eq!(m.violations.len(), ViolationKind::ALL.len());
    }
}
