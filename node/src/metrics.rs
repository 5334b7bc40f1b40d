//! The mill's Prometheus metrics: counters fed by the driver from `Observed` outputs, job
//! updates and persisted cursors, and gauges read from the mill's read-only accessors when
//! `/metrics` is scraped.

use std::collections::BTreeMap;

use millrace_core::job::{JobState, TerminalStatus};
use millrace_core::mill::{LeaseState, Mill, ViolationKind};
use millrace_core::quota::Scope;
use millrace_core::{Epoch, NodeId, Seqno};
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const QUOTA_USAGE: &str = "millrace_quota_usage";
const QUOTA_USAGE_HELP: &str = "Quota held, by scope and resource";

/// A family's label pairs, in the order they are exposed.
pub type Labels = Vec<(&'static str, String)>;

/// Counters the mill driver keeps, registered with the gauges read at scrape time in one
/// `prometheus-client` registry.
#[derive(Debug)]
pub struct MillMetrics {
    /// Placement outcomes: `placed` (leases published, bids won) and `unplaced` (jobs that
    /// ended without ever being placed: no compatible executor, quota denied, …).
    placements: Family<Labels, Counter>,
    /// Queued → published.
    pub placement_latency: Histogram,
    /// One group commit (one SQLite transaction).
    pub commit_latency: Histogram,
    /// Persist batches written.
    pub batches: Counter,
    /// Events applied, from the cursor advances persisted.
    pub events_applied: Counter,
    /// Violation closures by kind.
    violations: Family<Labels, Counter>,
    /// Hellos refused.
    pub refused: Counter,
    /// Attempts retried under their job's policy (M32).
    pub retried: Counter,
    /// Nodes quarantined.
    pub quarantined: Counter,
    /// Jobs accepted.
    pub submitted: Counter,
    /// Submits answered with an existing job through their idempotency key (M31).
    pub submit_replays: Counter,
    /// Jobs ended, by status.
    finished: Family<Labels, Counter>,
    /// Live-log chunks dropped because the log writer was behind.
    pub live_log_dropped: Counter,
    /// Messages dropped because a connection's queue was full (the connection is closed).
    pub send_overflows: Counter,
    /// Cursors of old epochs forgotten (M23).
    pub cursors_forgotten: Counter,
    /// Retention batches run (one transaction each).
    pub retention_batches: Counter,
    /// Rows and files deleted by retention, by what (`jobs`, `history_rows`, `log_files`).
    retention_deleted: Family<Labels, Counter>,
    sessions: Family<Labels, Gauge>,
    leases: Family<Labels, Gauge>,
    pending: Gauge,
    keys: Gauge,
    quota_usage: Family<Labels, Gauge>,
    quota_waiting: Gauge,
    registry: Registry,
    cursors: BTreeMap<(NodeId, Epoch), Seqno>,
}

impl Default for MillMetrics {
    fn default() -> Self {
        MillMetrics::with_cursors(BTreeMap::new())
    }
}

fn label(name: &'static str, value: &str) -> Labels {
    vec![(name, value.to_string())]
}

/// A gauge value from a count (saturating: a gauge is an `i64`).
fn level(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

impl MillMetrics {
    /// Starts the cursor mirror from the restored cursors, so that events applied count only
    /// this process's work.
    pub fn with_cursors(cursors: BTreeMap<(NodeId, Epoch), Seqno>) -> Self {
        let m = MillMetrics {
            placements: Family::default(),
            placement_latency: Histogram::new(BUCKETS),
            commit_latency: Histogram::new(BUCKETS),
            batches: Counter::default(),
            events_applied: Counter::default(),
            violations: Family::default(),
            refused: Counter::default(),
            retried: Counter::default(),
            quarantined: Counter::default(),
            submitted: Counter::default(),
            submit_replays: Counter::default(),
            finished: Family::default(),
            live_log_dropped: Counter::default(),
            send_overflows: Counter::default(),
            cursors_forgotten: Counter::default(),
            retention_batches: Counter::default(),
            retention_deleted: Family::default(),
            sessions: Family::default(),
            leases: Family::default(),
            pending: Gauge::default(),
            keys: Gauge::default(),
            quota_usage: Family::default(),
            quota_waiting: Gauge::default(),
            registry: Registry::default(),
            cursors,
        };
        // Series that exist at zero from the start (as the exposition always had them).
        for result in ["placed", "unplaced"] {
            m.placements
                .get_or_create(&label("result", result))
                .inc_by(0);
        }
        for status in [
            TerminalStatus::Success,
            TerminalStatus::Failed,
            TerminalStatus::Timeout,
            TerminalStatus::Cancelled,
        ] {
            m.finished
                .get_or_create(&label("status", &status.to_string()))
                .inc_by(0);
        }
        // Every violation kind too: `prometheus-client` writes no HELP/TYPE for a family
        // without series, and the family was always in the exposition (M28).
        for kind in ViolationKind::ALL {
            m.violations
                .get_or_create(&label("kind", kind.name()))
                .inc_by(0);
        }
        for what in ["jobs", "history_rows", "log_files"] {
            m.retention_deleted
                .get_or_create(&label("what", what))
                .inc_by(0);
        }
        m.register()
    }

    /// Registers every metric, in the order of the exposition. Counter names are given
    /// without `_total`: `prometheus-client` appends it to the samples, and [`render`]
    /// puts it on the `HELP`/`TYPE` lines too (text format 0.0.4 names the family as its
    /// samples).
    ///
    /// [`render`]: MillMetrics::render
    fn register(mut self) -> Self {
        let r = &mut self.registry;
        let m = [
            ("millrace_placements", "Placement outcomes by result"),
            (
                "millrace_placement_latency_seconds",
                "Time from queued to lease published",
            ),
            (
                "millrace_store_commit_seconds",
                "Time of one group commit (one SQLite transaction)",
            ),
            ("millrace_store_batches", "Persist batches written"),
            ("millrace_sessions", "Executor sessions by state"),
            ("millrace_leases", "Leases by state"),
            ("millrace_jobs_pending", "Jobs waiting for placement"),
            (
                "millrace_idempotency_keys",
                "Idempotency keys the mill holds (M31), until retention deletes their jobs",
            ),
            ("millrace_events_applied", "Executor events applied"),
            (
                "millrace_violations",
                "Sessions closed for a protocol violation, by kind",
            ),
            ("millrace_hello_refused", "Hellos refused"),
            (
                "millrace_retries",
                "Attempts that ended and were retried under their job's policy (M32)",
            ),
            ("millrace_quarantines", "Nodes quarantined"),
            ("millrace_jobs_submitted", "Jobs accepted"),
            (
                "millrace_submit_replays",
                "Submits answered with the existing job of their idempotency key (M31)",
            ),
            ("millrace_jobs_finished", "Jobs ended, by status"),
            (QUOTA_USAGE, QUOTA_USAGE_HELP),
            ("millrace_quota_waiting", "Jobs waiting for quota"),
            (
                "millrace_live_log_dropped",
                "Live-log chunks dropped because the log writer was behind",
            ),
            (
                "millrace_send_overflows",
                "Connections closed because their send queue was full",
            ),
            (
                "millrace_retention_deleted",
                "Rows and files deleted by retention (--retention, --retention-count), by what",
            ),
            (
                "millrace_retention_batches",
                "Retention batches run (one bounded transaction each)",
            ),
            (
                "millrace_cursors_forgotten",
                "Event cursors of old executor epochs forgotten (M23)",
            ),
        ];
        let [placements, placement_latency, commit, batches, sessions, leases, pending, keys, applied, violations, refused, retries, quarantines, submitted, replays, finished, usage, waiting, dropped, overflows, deleted, retention_batches, forgotten] =
            m;
        r.register(placements.0, placements.1, self.placements.clone());
        r.register(
            placement_latency.0,
            placement_latency.1,
            self.placement_latency.clone(),
        );
        r.register(commit.0, commit.1, self.commit_latency.clone());
        r.register(batches.0, batches.1, self.batches.clone());
        r.register(sessions.0, sessions.1, self.sessions.clone());
        r.register(leases.0, leases.1, self.leases.clone());
        r.register(pending.0, pending.1, self.pending.clone());
        r.register(keys.0, keys.1, self.keys.clone());
        r.register(applied.0, applied.1, self.events_applied.clone());
        r.register(violations.0, violations.1, self.violations.clone());
        r.register(refused.0, refused.1, self.refused.clone());
        r.register(retries.0, retries.1, self.retried.clone());
        r.register(quarantines.0, quarantines.1, self.quarantined.clone());
        r.register(submitted.0, submitted.1, self.submitted.clone());
        r.register(replays.0, replays.1, self.submit_replays.clone());
        r.register(finished.0, finished.1, self.finished.clone());
        r.register(usage.0, usage.1, self.quota_usage.clone());
        r.register(waiting.0, waiting.1, self.quota_waiting.clone());
        r.register(dropped.0, dropped.1, self.live_log_dropped.clone());
        r.register(overflows.0, overflows.1, self.send_overflows.clone());
        r.register(deleted.0, deleted.1, self.retention_deleted.clone());
        r.register(
            retention_batches.0,
            retention_batches.1,
            self.retention_batches.clone(),
        );
        r.register(forgotten.0, forgotten.1, self.cursors_forgotten.clone());
        self
    }

    /// A lease published (a bid won).
    pub fn placed(&self) {
        self.placements
            .get_or_create(&label("result", "placed"))
            .inc();
    }

    /// Leases published so far.
    pub fn placed_count(&self) -> u64 {
        self.placements
            .get_or_create(&label("result", "placed"))
            .get()
    }

    /// Retention deleted `n` of `what` (`jobs`, `history_rows`).
    pub fn retention_deleted(&self, what: &'static str, n: u64) {
        self.retention_deleted
            .get_or_create(&label("what", what))
            .inc_by(n);
    }

    /// The log writer's running total of log files retention deleted.
    pub fn retention_log_files(&self, total: u64) {
        let c = self
            .retention_deleted
            .get_or_create(&label("what", "log_files"));
        c.inc_by(total.saturating_sub(c.get()));
    }

    /// A persisted cursor advance.
    pub fn cursor(&mut self, node: &NodeId, epoch: Epoch, seqno: Seqno) {
        let old = self
            .cursors
            .insert((node.clone(), epoch), seqno)
            .unwrap_or_default();
        self.events_applied
            .inc_by(seqno.get().saturating_sub(old.get()));
    }

    /// A cursor the mill forgot (an old epoch of a node, M23): the mirror drops it too, so
    /// it stays as bounded as the mill's.
    pub fn cursor_forgotten(&mut self, node: &NodeId, epoch: Epoch) {
        self.cursors.remove(&(node.clone(), epoch));
        self.cursors_forgotten.inc();
    }

    /// A job update the driver acted on.
    pub fn job_update(&self, state: &JobState) {
        if let JobState::Done(t) = state {
            self.finished
                .get_or_create(&label("status", &t.status.to_string()))
                .inc();
            if t.lease.is_none() && t.status == TerminalStatus::Failed {
                self.placements
                    .get_or_create(&label("result", "unplaced"))
                    .inc();
            }
        }
    }

    /// A violation closure, counted by the kind the core reports (never by its text).
    pub fn violation(&self, kind: ViolationKind) {
        self.violations
            .get_or_create(&label("kind", kind.name()))
            .inc();
    }

    /// Prometheus text exposition (format 0.0.4) of everything, with gauges read from `mill`.
    pub fn render(&self, mill: &Mill) -> String {
        let (mut connected, mut grace) = (0u64, 0u64);
        for (_, is_connected) in mill.sessions() {
            if is_connected {
                connected += 1;
            } else {
                grace += 1;
            }
        }
        for (state, n) in [
            ("connected", level(connected)),
            ("grace", level(grace)),
            ("quarantined", level(mill.quarantined().len())),
        ] {
            self.sessions.get_or_create(&label("state", state)).set(n);
        }
        let (mut reserved, mut running) = (0u64, 0u64);
        for (_, _, _, _, state, _) in mill.leases() {
            match state {
                LeaseState::Reserved => reserved += 1,
                LeaseState::Running => running += 1,
            }
        }
        for (state, n) in [("reserved", reserved), ("running", running)] {
            self.leases
                .get_or_create(&label("state", state))
                .set(level(n));
        }
        self.pending.set(level(mill.pending()));
        self.keys.set(level(mill.key_count()));

        let mut usage: BTreeMap<Labels, u64> = BTreeMap::new();
        for (_, identity, charge) in mill.quota().holds() {
            for scope in Scope::of(identity) {
                let (kind, name) = match scope {
                    Scope::Owner(n) => ("owner", n),
                    Scope::Repo(n) => ("repo", n),
                };
                for (resource, amount) in charge {
                    let labels = vec![
                        ("scope", kind.to_string()),
                        ("name", name.clone()),
                        ("resource", resource.clone()),
                    ];
                    *usage.entry(labels).or_default() += amount;
                }
            }
        }
        // Holds come and go: the series are those of this scrape only.
        self.quota_usage.clear();
        for (labels, n) in &usage {
            self.quota_usage.get_or_create(labels).set(level(*n));
        }
        self.quota_waiting.set(level(mill.quota().waiting()));
        let mut text = encode(&self.registry);
        if usage.is_empty() {
            // `prometheus-client` writes nothing for a family without series; the exposition
            // always declared this one, and scrapers' checks look for its TYPE line.
            let at = text
                .find("# HELP millrace_quota_waiting ")
                .unwrap_or(text.len());
            text.insert_str(
                at,
                &format!("# HELP {QUOTA_USAGE} {QUOTA_USAGE_HELP}.\n# TYPE {QUOTA_USAGE} gauge\n"),
            );
        }
        text
    }
}

/// A registry in Prometheus text format 0.0.4: `prometheus-client` writes OpenMetrics, whose
/// counter families are named without `_total` (the samples have it) and which ends in
/// `# EOF`; the classic format names the family as its samples, so the `HELP` and `TYPE`
/// lines of counters get `_total` and nothing else changes.
pub fn encode(registry: &Registry) -> String {
    let mut om = String::with_capacity(8192);
    if let Err(e) = encode_registry(&mut om, registry) {
        tracing::error!(error = %e, "metrics encoding failed");
    }
    let counters: Vec<String> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .map(str::to_string)
        .collect();
    let mut out = String::with_capacity(om.len() + 16 * counters.len());
    for line in om.lines() {
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .iter()
                .any(|c| c == name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn m28_violations_are_counted_by_their_kind() {
        let m = MillMetrics::default();
        for _ in 0..3 {
            m.violation(ViolationKind::WrongEpoch);
        }
        for kind in ViolationKind::ALL {
            m.violation(kind);
        }
        let n = |kind: &'static str| m.violations.get_or_create(&label("kind", kind)).get();
        assert_eq!(n("wrong_epoch"), 4);
        assert_eq!(n("seqno_gap"), 1);
        let text = encode(&m.registry);
        let series = text
            .lines()
            .filter(|l| l.starts_with("millrace_violations_total{"))
            .count();
        assert_eq!(series, ViolationKind::ALL.len(), "{text}");
        assert!(
            text.contains("millrace_violations_total{kind=\"wrong_epoch\"} 4\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE millrace_violations_total counter\n"),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
    }
}
