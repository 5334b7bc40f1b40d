//! The quota ledger as operators see it (issue 13 item 5): `GET /v1/quota`, `millrace quota`
//! and the "waiting for quota" of a job's status. Built on the mill driver's thread from the
//! core's read-only ledger (§6, Q1–Q3, M15); every list is cut at a bound the caller picks,
//! and says when it was cut and how long it was.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use millrace_core::quota::{Blocked, QuotaLedger, Scope};
use millrace_core::{JobId, Resources};
use serde::{Deserialize, Serialize};

/// Entries of each list `GET /v1/quota` shows unless `?limit=` says otherwise.
pub const DEFAULT_LIMIT: usize = 100;
/// Most entries of each list one answer shows.
pub const MAX_LIMIT: usize = 1000;

/// `GET /v1/quota`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct QuotaView {
    /// The limits in force, shaped like the config file's `[quota]`.
    pub limits: LimitsView,
    /// Scopes that hold or wait: owners, then repos, each in name order.
    pub scopes: Vec<ScopeView>,
    /// How many scopes hold or wait in all.
    pub scopes_total: usize,
    /// `scopes` was cut at the limit.
    pub scopes_truncated: bool,
    /// Jobs waiting for quota, in arrival order (the order Q2 grants them in).
    pub waiters: Vec<WaiterView>,
    /// How many jobs wait in all.
    pub waiters_total: usize,
    /// `waiters` was cut at the limit.
    pub waiters_truncated: bool,
}

/// The configured limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LimitsView {
    /// Limits for every owner and every repo.
    pub defaults: DefaultsView,
    /// Per-owner overrides (name order), each replacing the defaults it names.
    pub owner: BTreeMap<String, Resources>,
    /// Per-repo overrides (name order).
    pub repo: BTreeMap<String, Resources>,
    /// How many owner overrides there are in all.
    pub owner_total: usize,
    /// How many repo overrides there are in all.
    pub repo_total: usize,
    /// `owner` or `repo` was cut at the limit.
    pub truncated: bool,
}

/// `[quota.defaults]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DefaultsView {
    /// `[quota.defaults.owner]`.
    pub owner: Resources,
    /// `[quota.defaults.repo]`.
    pub repo: Resources,
}

/// One scope that holds or waits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScopeView {
    /// `owner` or `repo`.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// What its holders use.
    pub used: Resources,
    /// Its limits in force (defaults with its override on top); absent resources are
    /// unlimited.
    pub limits: Resources,
    /// Jobs waiting in it.
    pub waiting: usize,
}

/// One job waiting for quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WaiterView {
    /// The job.
    pub job: u64,
    /// Its owner.
    pub owner: String,
    /// Its repo.
    pub repo: String,
    /// What it asks for (its seat's charge).
    pub asks: Resources,
    /// What holds it up.
    pub blocked: Option<BlockedView>,
}

/// What holds a waiting job up (Q2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BlockedView {
    /// A scope's limit of a resource is used up.
    Limit {
        /// `owner` or `repo`.
        scope: String,
        /// The scope's name.
        name: String,
        /// The resource.
        resource: String,
        /// What its holders use now.
        used: u64,
        /// What the job asks.
        asks: u64,
        /// The limit.
        limit: u64,
    },
    /// An earlier waiter of a scope it shares goes first (FIFO per scope).
    Behind {
        /// `owner` or `repo`.
        scope: String,
        /// The scope's name.
        name: String,
        /// The earliest waiter of that scope.
        job: u64,
    },
}

impl BlockedView {
    /// The view of a core [`Blocked`].
    pub fn of(b: &Blocked) -> Self {
        match b {
            Blocked::Limit {
                scope,
                resource,
                used,
                asks,
                limit,
            } => {
                let (scope, name) = parts(scope);
                BlockedView::Limit {
                    scope,
                    name,
                    resource: resource.clone(),
                    used: *used,
                    asks: *asks,
                    limit: *limit,
                }
            }
            Blocked::Behind { scope, first } => {
                let (scope, name) = parts(scope);
                BlockedView::Behind {
                    scope,
                    name,
                    job: first.get(),
                }
            }
        }
    }
}

impl std::fmt::Display for BlockedView {
    /// As the core says it: `owner "alice" jobs 10/10 in use (asks 1)`, `behind j5 in owner
    /// "alice" (first come, first served)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlockedView::Limit {
                scope,
                name,
                resource,
                used,
                asks,
                limit,
            } => write!(
                f,
                "{scope} {name:?} {resource} {used}/{limit} in use (asks {asks})"
            ),
            BlockedView::Behind { scope, name, job } => {
                write!(
                    f,
                    "behind j{job} in {scope} {name:?} (first come, first served)"
                )
            }
        }
    }
}

fn parts(scope: &Scope) -> (String, String) {
    match scope {
        Scope::Owner(n) => ("owner".to_string(), n.clone()),
        Scope::Repo(n) => ("repo".to_string(), n.clone()),
    }
}

/// The ledger for `GET /v1/quota`, each list cut at `limit` entries (the caller bounds it
/// by [`MAX_LIMIT`]).
pub fn view(ledger: &QuotaLedger, limit: usize) -> QuotaView {
    let config = ledger.config();
    let first = |m: &BTreeMap<String, Resources>| -> BTreeMap<String, Resources> {
        m.iter()
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let limits = LimitsView {
        defaults: DefaultsView {
            owner: config.owner_defaults.clone(),
            repo: config.repo_defaults.clone(),
        },
        owner: first(&config.owner_overrides),
        repo: first(&config.repo_overrides),
        owner_total: config.owner_overrides.len(),
        repo_total: config.repo_overrides.len(),
        truncated: config.owner_overrides.len() > limit || config.repo_overrides.len() > limit,
    };
    let scopes: Vec<ScopeView> = ledger
        .scopes()
        .take(limit)
        .map(|s| {
            let (kind, name) = parts(&s.scope);
            ScopeView {
                limits: config.limits(&s.scope),
                kind,
                name,
                used: s.used,
                waiting: s.waiting,
            }
        })
        .collect();
    let scopes_total = ledger.scope_count();
    let waiters: Vec<WaiterView> = ledger
        .waiters_blocked()
        .take(limit)
        .map(|(job, who, asks, blocked)| WaiterView {
            job: job.get(),
            owner: who.owner.clone(),
            repo: who.repo.clone(),
            asks: asks.clone(),
            blocked: blocked.as_ref().map(BlockedView::of),
        })
        .collect();
    let waiters_total = ledger.waiting();
    QuotaView {
        limits,
        scopes_truncated: scopes_total > scopes.len(),
        scopes,
        scopes_total,
        waiters_truncated: waiters_total > waiters.len(),
        waiters,
        waiters_total,
    }
}

/// What holds `job` up, if it waits for quota.
pub fn job_wait(ledger: &QuotaLedger, job: JobId) -> Option<BlockedView> {
    ledger.blocked(job).as_ref().map(BlockedView::of)
}

/// `name=amount` pairs, comma separated (`-` for none).
fn pairs(r: &Resources) -> String {
    if r.is_empty() {
        return "-".to_string();
    }
    r.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `millrace quota`'s tables.
pub fn render(v: &QuotaView) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "LIMITS (a resource not listed is unlimited)");
    let _ = writeln!(out, "{:<32} {:<20} {:>16}", "SCOPE", "RESOURCE", "LIMIT");
    let mut any = false;
    let defaults = [
        ("every owner", &v.limits.defaults.owner),
        ("every repo", &v.limits.defaults.repo),
    ];
    let overrides = v
        .limits
        .owner
        .iter()
        .map(|(n, r)| (format!("owner {n:?}"), r))
        .chain(
            v.limits
                .repo
                .iter()
                .map(|(n, r)| (format!("repo {n:?}"), r)),
        );
    for (scope, limits) in defaults
        .into_iter()
        .map(|(s, r)| (s.to_string(), r))
        .chain(overrides)
    {
        for (resource, limit) in limits {
            any = true;
            let _ = writeln!(out, "{scope:<32} {resource:<20} {limit:>16}");
        }
    }
    if !any {
        let _ = writeln!(out, "(no limits: start the mill with --config FILE)");
    }
    if v.limits.truncated {
        let _ = writeln!(
            out,
            "(overrides cut: {} shown of {} owner and {} repo; use --limit)",
            v.limits.owner.len() + v.limits.repo.len(),
            v.limits.owner_total,
            v.limits.repo_total
        );
    }

    let _ = writeln!(out, "\nUSAGE");
    let _ = writeln!(
        out,
        "{:<32} {:<20} {:>16} {:>8}",
        "SCOPE", "RESOURCE", "USED/LIMIT", "WAITING"
    );
    for s in &v.scopes {
        let scope = format!("{} {:?}", s.kind, s.name);
        let mut resources: Vec<&String> = s.used.keys().chain(s.limits.keys()).collect();
        resources.sort();
        resources.dedup();
        if resources.is_empty() {
            let _ = writeln!(out, "{scope:<32} {:<20} {:>16} {:>8}", "-", "-", s.waiting);
        }
        for (i, r) in resources.into_iter().enumerate() {
            let used = s.used.get(r).copied().unwrap_or(0);
            let limit = s
                .limits
                .get(r)
                .map_or_else(|| "-".to_string(), u64::to_string);
            let waiting = if i == 0 {
                s.waiting.to_string()
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "{scope:<32} {r:<20} {:>16} {waiting:>8}",
                format!("{used}/{limit}")
            );
        }
    }
    if v.scopes.is_empty() {
        let _ = writeln!(out, "(nothing held or waiting)");
    }
    if v.scopes_truncated {
        let _ = writeln!(
            out,
            "({} of {} scopes shown; use --limit)",
            v.scopes.len(),
            v.scopes_total
        );
    }

    let _ = writeln!(
        out,
        "\nWAITING FOR QUOTA (first come, first served per scope)"
    );
    let _ = writeln!(
        out,
        "{:>8}  {:<16} {:<24} {:<20} WHY",
        "JOB", "OWNER", "REPO", "ASKS"
    );
    for w in &v.waiters {
        let why = w
            .blocked
            .as_ref()
            .map_or_else(|| "-".to_string(), ToString::to_string);
        let _ = writeln!(
            out,
            "{:>8}  {:<16} {:<24} {:<20} {why}",
            w.job,
            w.owner,
            w.repo,
            pairs(&w.asks)
        );
    }
    if v.waiters.is_empty() {
        let _ = writeln!(out, "(no job waits for quota)");
    }
    if v.waiters_truncated {
        let _ = writeln!(
            out,
            "({} of {} waiting jobs shown; use --limit)",
            v.waiters.len(),
            v.waiters_total
        );
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use millrace_core::quota::{Acquire, QuotaConfig};
    use millrace_core::Identity;

    fn res(pairs: &[(&str, u64)]) -> Resources {
        pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
    }

    fn who(owner: &str, repo: &str) -> Identity {
        Identity {
            owner: owner.into(),
            repo: repo.into(),
        }
    }

    /// Owner alice may run one job at a time; two owner overrides, one repo override.
    fn ledger() -> QuotaLedger {
        let mut q = QuotaLedger::new(QuotaConfig {
            owner_defaults: res(&[("jobs", 1)]),
            repo_defaults: res(&[("jobs", 50)]),
            owner_overrides: [
                ("bob".to_string(), res(&[("jobs", 3)])),
                ("carol".to_string(), res(&[("cpu", 2)])),
            ]
            .into(),
            repo_overrides: [("org/big".to_string(), res(&[("jobs", 200)]))].into(),
        });
        let jobs1 = res(&[("jobs", 1)]);
        // j2 does not fit in alice's one job; j3 (owner dave) would fit, but j2 waits
        // before it in repo r.
        for (id, owner, want) in [
            (1, "alice", Acquire::Allowed),
            (2, "alice", Acquire::Temporary),
            (3, "dave", Acquire::Temporary),
        ] {
            let got = q.try_acquire(JobId(id), &who(owner, "r"), &jobs1).unwrap();
            assert_eq!(got, want, "j{id}");
        }
        q
    }

    #[test]
    fn q2_the_view_lists_limits_usage_and_waiters_with_what_blocks_them() {
        let v = view(&ledger(), DEFAULT_LIMIT);
        assert_eq!(v.limits.defaults.owner, res(&[("jobs", 1)]));
        assert_eq!(v.limits.owner.len(), 2);
        assert!(!v.limits.truncated);
        assert_eq!(v.scopes_total, 3, "owners alice and dave, repo r");
        assert_eq!(
            v.scopes[0],
            ScopeView {
                kind: "owner".into(),
                name: "alice".into(),
                used: res(&[("jobs", 1)]),
                limits: res(&[("jobs", 1)]),
                waiting: 1,
            }
        );
        assert_eq!(
            (v.scopes[1].name.as_str(), v.scopes[1].waiting),
            ("dave", 1)
        );
        assert_eq!(v.scopes[1].used, Resources::new());
        assert_eq!(v.scopes[2].kind, "repo");
        assert_eq!(v.scopes[2].limits, res(&[("jobs", 50)]));
        assert_eq!(v.scopes[2].waiting, 2);
        assert_eq!(v.waiters_total, 2);
        assert_eq!(
            v.waiters[0].blocked,
            Some(BlockedView::Limit {
                scope: "owner".into(),
                name: "alice".into(),
                resource: "jobs".into(),
                used: 1,
                asks: 1,
                limit: 1,
            })
        );
        assert_eq!(
            v.waiters[1].blocked,
            Some(BlockedView::Behind {
                scope: "repo".into(),
                name: "r".into(),
                job: 2,
            })
        );
        // The JSON round-trips (the CLI reads it back typed).
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["waiters"][0]["blocked"]["kind"], "limit");
        assert_eq!(serde_json::from_value::<QuotaView>(json).unwrap(), v);
    }

    #[test]
    fn every_list_is_cut_at_the_limit_and_says_so() {
        let v = view(&ledger(), 1);
        assert_eq!(
            (v.scopes.len(), v.scopes_total, v.scopes_truncated),
            (1, 3, true)
        );
        assert_eq!(
            (v.waiters.len(), v.waiters_total, v.waiters_truncated),
            (1, 2, true)
        );
        assert_eq!(v.limits.owner.len(), 1);
        assert_eq!(v.limits.owner_total, 2);
        assert!(v.limits.truncated);
        let text = render(&v);
        assert!(
            text.contains("(1 of 3 scopes shown; use --limit)"),
            "{text}"
        );
        assert!(
            text.contains("(1 of 2 waiting jobs shown; use --limit)"),
            "{text}"
        );
        assert!(text.contains("overrides cut"), "{text}");
    }

    #[test]
    fn a_job_waiting_for_quota_says_which_scope_and_resource() {
        let q = ledger();
        let wait = job_wait(&q, JobId(2)).unwrap();
        assert_eq!(wait.to_string(), "owner \"alice\" jobs 1/1 in use (asks 1)");
        assert_eq!(
            job_wait(&q, JobId(3)).unwrap().to_string(),
            "behind j2 in repo \"r\" (first come, first served)"
        );
        assert_eq!(job_wait(&q, JobId(1)), None, "a holder does not wait");
    }

    #[test]
    fn the_table_shows_limits_usage_and_waiters() {
        let text = render(&view(&ledger(), DEFAULT_LIMIT));
        for line in [
            "every owner",
            "owner \"bob\"",
            "repo \"org/big\"",
            "1/1",
            "owner \"alice\" jobs 1/1 in use (asks 1)",
        ] {
            assert!(text.contains(line), "{line:?} missing from\n{text}");
        }
        let empty = render(&view(&QuotaLedger::new(QuotaConfig::default()), 10));
        assert!(empty.contains("no limits"), "{empty}");
        assert!(empty.contains("no job waits for quota"), "{empty}");
    }
}
