//! One function per section of a scenario file (`[topology]` with its fleet, `[workload]`,
//! `[config]`, `[expect]`, and the top-level `about`), each validating its section and naming
//! the field of any error; `build` in `mod.rs` puts them together (issue 17 item 3: the
//! 360-line `build()` split by section, its checks unchanged and in the same order).

use super::*;

/// The top-level `about`: one non-empty line.
pub(super) fn build_about(cx: &Ctx<'_>, about_doc: &Spanned<String>) -> Result<String, LoadError> {
    let about = about_doc.get_ref().trim().to_string();
    if about.is_empty() || about.contains('\n') {
        return Err(cx.err(
            Some(&about_doc.span()),
            "about",
            "must be one non-empty line",
        ));
    }
    Ok(about)
}

/// What `[topology]` gives the scenario.
pub(super) struct Topology {
    pub(super) seats: (u32, u32),
    pub(super) executors: usize,
    pub(super) fleet: Option<Vec<ExecTemplate>>,
    pub(super) names: Vec<String>,
    pub(super) codec_fraction: f64,
}

/// `[topology]`: seats, the executor count or the explicit fleet, the codec share.
pub(super) fn build_topology(
    cx: &Ctx<'_>,
    topology: Spanned<TopologyDoc>,
) -> Result<Topology, LoadError> {
    let topo_span = topology.span();
    let topo = topology.into_inner();
    let seats = match &topo.seats {
        Some(s) => {
            let (lo, hi) = *s.get_ref();
            if lo == 0 || lo > hi {
                return Err(cx.err(
                    Some(&s.span()),
                    "topology.seats",
                    format!("[{lo}, {hi}] is not a seat range (lowest >= 1, lowest <= highest)"),
                ));
            }
            (lo, hi)
        }
        None => (1, 4),
    };
    let (executors, fleet) =
        match (&topo.executors, topo.executor.is_empty()) {
            (Some(n), true) => {
                if *n.get_ref() == 0 {
                    return Err(cx.err(
                        Some(&n.span()),
                        "topology.executors",
                        "at least one executor",
                    ));
                }
                (*n.get_ref(), None)
            }
            (None, false) => {
                let fleet = build_fleet(cx, &topo.executor)?;
                (fleet.len(), Some(fleet))
            }
            (Some(n), false) => return Err(cx.err(
                Some(&n.span()),
                "topology.executors",
                "give either a count (`executors = N`) or `[[topology.executor]]` groups, not both",
            )),
            (None, true) => {
                return Err(cx.err(
                    Some(&topo_span),
                    "topology",
                    "missing field `executors` (a count) or `[[topology.executor]]` groups",
                ))
            }
        };
    let names: Vec<String> = match &fleet {
        Some(f) => f.iter().map(|t: &ExecTemplate| t.name.clone()).collect(),
        None => (0..executors).map(|i| format!("x{i}")).collect(),
    };
    let codec_fraction = match &topo.codec_fraction {
        Some(v) => cx.share(v, "topology.codec_fraction")?,
        None => 1.0,
    };
    Ok(Topology {
        seats,
        executors,
        fleet,
        names,
        codec_fraction,
    })
}

/// What `[workload]` gives the scenario.
pub(super) struct WorkloadParts {
    pub(super) jobs: usize,
    pub(super) job_mean: Micros,
    pub(super) job_max: Micros,
    pub(super) knobs: Knobs,
    pub(super) arrival: Micros,
}

/// `[workload]`: jobs, durations, arrivals and the knobs; `fleet` is the explicit fleet, if
/// any (a required label set must have an honest holder, M13).
pub(super) fn build_workload(
    cx: &Ctx<'_>,
    wl: WorkloadDoc,
    fleet: &Option<Vec<ExecTemplate>>,
) -> Result<WorkloadParts, LoadError> {
    if *wl.jobs.get_ref() == 0 {
        return Err(cx.err(
            Some(&wl.jobs.span()),
            "workload.jobs",
            "at least one job: a scenario without jobs checks nothing",
        ));
    }
    let job_mean = wl.duration.mean.get_ref().0;
    let job_max = wl.duration.max.get_ref().0;
    if job_mean == 0 || job_mean > job_max {
        return Err(cx.err(
            Some(&wl.duration.mean.span()),
            "workload.duration.mean",
            format!(
                "{} must be positive and at most max ({})",
                format_micros(job_mean),
                format_micros(job_max)
            ),
        ));
    }
    let mut knobs = Knobs::default();
    if let Some(v) = &wl.burst {
        knobs.burst = Some(cx.share(v, "workload.burst")?);
    }
    if let Some(v) = &wl.cancel_rate {
        knobs.cancel_rate = Some(cx.share(v, "workload.cancel_rate")?);
    }
    knobs.cancel_within = wl.cancel_within.map(|d| d.0.max(1));
    if let Some(v) = &wl.invalid_rate {
        knobs.invalid_rate = Some(cx.share(v, "workload.invalid_rate")?);
    }
    if let Some(v) = &wl.retry_rate {
        knobs.retry_rate = Some(cx.share(v, "workload.retry_rate")?);
    }
    if let Some(v) = &wl.pinned {
        knobs.pinned = Some(cx.share(v, "workload.pinned")?);
    }
    if let Some(v) = &wl.whole_engine {
        knobs.whole_engine = Some(cx.share(v, "workload.whole_engine")?);
    }
    if let Some(v) = &wl.priorities {
        if *v.get_ref() > 1_000_000 {
            return Err(cx.err(
                Some(&v.span()),
                "workload.priorities",
                "at most 1000000 (jobs draw a priority in -n..=n)",
            ));
        }
        knobs.priorities = Some(*v.get_ref());
    }
    if let Some(v) = &wl.owners {
        if *v.get_ref() == 0 {
            return Err(cx.err(Some(&v.span()), "workload.owners", "at least one owner"));
        }
        knobs.owners = Some(*v.get_ref());
    }
    if let Some(v) = &wl.max_pending {
        if *v.get_ref() == 0 {
            return Err(cx.err(Some(&v.span()), "workload.max_pending", "at least 1"));
        }
        knobs.max_pending = Some(*v.get_ref());
    }
    if let Some(v) = &wl.cpu_millis {
        let (lo, hi) = *v.get_ref();
        if lo == 0 || lo >= hi {
            return Err(cx.err(
                Some(&v.span()),
                "workload.cpu_millis",
                format!("[{lo}, {hi}] is not a range (0 < lowest < highest)"),
            ));
        }
        knobs.cpu_millis = Some((lo, hi));
    }
    knobs.quota = wl.quota.map(|q| QuotaConfig {
        owner_defaults: q.owner,
        repo_defaults: q.repo,
        owner_overrides: q.owners,
        repo_overrides: q.repos,
    });
    for (k, r) in wl.require.iter().enumerate() {
        let share = cx.share(&r.share, &format!("workload.require[{k}].share"))?;
        let holders = fleet.as_ref().map(|f: &Vec<ExecTemplate>| {
            f.iter()
                .filter(|t| t.byzantine.is_none() && r.labels.is_subset(&t.labels))
                .count()
        });
        if holders == Some(0) {
            return Err(cx.err(
                Some(&r.share.span()),
                format!("workload.require[{k}].labels"),
                format!(
                    "no honest executor holds all of {:?}: such jobs would wait forever (M13)",
                    r.labels
                ),
            ));
        }
        knobs.require.push((r.labels.clone(), share));
    }
    let arrival = wl.arrivals.get_ref().0;
    Ok(WorkloadParts {
        jobs: *wl.jobs.get_ref(),
        job_mean,
        job_max,
        knobs,
        arrival,
    })
}

/// `[config]`: the preset and the mill's overrides; also whether the preset is `tight` and
/// the section's span (for a config the mill refuses).
pub(super) fn build_config(
    cx: &Ctx<'_>,
    config_doc: Option<Spanned<ConfigDoc>>,
) -> Result<(ConfigOverrides, bool, Option<Range<usize>>), LoadError> {
    let mut config = ConfigOverrides::default();
    let mut tight = false;
    let mut config_span = None;
    if let Some(c) = config_doc {
        config_span = Some(c.span());
        let c = c.into_inner();
        if let Some(p) = &c.preset {
            match p.get_ref().as_str() {
                "tight" => tight = true,
                "production" => {}
                other => {
                    return Err(cx.err(
                        Some(&p.span()),
                        "config.preset",
                        format!("unknown preset {other:?}; known: tight, production"),
                    ))
                }
            }
        }
        let d = |x: Option<Dur>| x.map(|d| Duration::from_micros(d.0));
        config = ConfigOverrides {
            reconnect_grace: d(c.reconnect_grace),
            silence_timeout: d(c.silence_timeout),
            snapshot_interval: d(c.snapshot_interval),
            bid_timeout: d(c.bid_timeout),
            cancel_ack_timeout: d(c.cancel_ack_timeout),
            cancel_teardown_timeout: d(c.cancel_teardown_timeout),
            job_timeout: d(c.job_timeout),
            queue_timeout: d(c.queue_timeout),
            quarantine_strikes: c.quarantine_strikes,
            max_sessions: c.max_sessions,
            direct_placement: c.direct_placement,
            late_binding: c.late_binding,
        };
    }
    Ok((config, tight, config_span))
}

/// `[expect]`: invariants checked, the liveness bound, rare paths to reach, seeds.
pub(super) fn build_expect(cx: &Ctx<'_>, ed: ExpectDoc) -> Result<Expect, LoadError> {
    let invariants = match &ed.invariants {
        None => None,
        Some(list) => {
            let mut set = BTreeSet::new();
            for (k, r) in list.iter().enumerate() {
                let rule = r.get_ref().as_str();
                if rule == "all" {
                    return Err(cx.err(
                        Some(&r.span()),
                        format!("expect.invariants[{k}]"),
                        "leave `invariants` out to check them all",
                    ));
                }
                if !RULES.contains(&rule) {
                    return Err(cx.err(
                        Some(&r.span()),
                        format!("expect.invariants[{k}]"),
                        format!("unknown invariant {rule:?}; known: {}", RULES.join(", ")),
                    ));
                }
                set.insert(rule.to_string());
            }
            Some(set)
        }
    };
    let mut reach = Vec::new();
    for (k, r) in ed.reach.iter().enumerate() {
        let p = Path::from_key(r.get_ref()).ok_or_else(|| {
            let known: Vec<&str> = Path::ALL.iter().map(|p| p.key()).collect();
            cx.err(
                Some(&r.span()),
                format!("expect.reach[{k}]"),
                format!(
                    "unknown rare-path counter {:?}; known: {}",
                    r.get_ref(),
                    known.join(", ")
                ),
            )
        })?;
        reach.push(p);
    }
    Ok(Expect {
        invariants,
        liveness_bound: ed.liveness_bound.map(|d| d.0),
        reach,
        seeds: ed.seeds.unwrap_or(Expect::default().seeds),
    })
}

pub(super) fn build_fleet(
    cx: &Ctx<'_>,
    groups: &[GroupDoc],
) -> Result<Vec<ExecTemplate>, LoadError> {
    let mut fleet: Vec<ExecTemplate> = Vec::new();
    for (k, g) in groups.iter().enumerate() {
        let field = |f: &str| format!("topology.executor[{k}].{f}");
        let mut engines = BTreeMap::new();
        for (ename, e) in &g.engines {
            if *e.seats.get_ref() == 0 {
                return Err(cx.err(
                    Some(&e.seats.span()),
                    field(&format!("engines.{ename}.seats")),
                    "seats = 0: an engine needs at least one seat",
                ));
            }
            engines.insert(
                ename.clone(),
                EngineConfig {
                    capacity: *e.seats.get_ref(),
                    resources: e.resources.clone(),
                },
            );
        }
        if engines.is_empty() {
            engines.insert(
                "shell".to_string(),
                EngineConfig {
                    capacity: 2,
                    resources: Resources::from([("cpu_millis".to_string(), 8000)]),
                },
            );
        }
        let byzantine = match &g.byzantine {
            None => None,
            Some(b) => Some(
                ByzKind::NAMED
                    .into_iter()
                    .find(|x| x.name() == b.get_ref())
                    .ok_or_else(|| {
                        let known: Vec<&str> = ByzKind::NAMED.iter().map(|x| x.name()).collect();
                        cx.err(
                            Some(&b.span()),
                            field("byzantine"),
                            format!(
                                "unknown misbehaviour {:?}; known: {}",
                                b.get_ref(),
                                known.join(", ")
                            ),
                        )
                    })?,
            ),
        };
        let extra_charge = match &g.extra_charge {
            None => None,
            Some(m) => {
                if m.get_ref().len() != 1 {
                    return Err(cx.err(
                        Some(&m.span()),
                        field("extra_charge"),
                        "name exactly one resource, like { disk_mb = 2 }",
                    ));
                }
                m.get_ref().iter().next().map(|(r, a)| (r.clone(), *a))
            }
        };
        let names: Vec<String> = match &g.count {
            None => vec![g.name.get_ref().clone()],
            Some(c) if *c.get_ref() == 0 => {
                return Err(cx.err(Some(&c.span()), field("count"), "at least 1"));
            }
            Some(c) => (0..*c.get_ref())
                .map(|j| format!("{}-{j}", g.name.get_ref()))
                .collect(),
        };
        for n in names {
            if millrace_core::NodeId::new(n.clone()).is_err() || n == "mill" {
                return Err(cx.err(
                    Some(&g.name.span()),
                    field("name"),
                    format!("{n:?} is not a valid node id"),
                ));
            }
            if fleet.iter().any(|t| t.name == n) {
                return Err(cx.err(
                    Some(&g.name.span()),
                    field("name"),
                    format!("executor {n:?} is defined twice"),
                ));
            }
            fleet.push(ExecTemplate {
                name: n,
                labels: g.labels.clone(),
                engines: engines.clone(),
                byzantine,
                slow_stop: g.slow_stop,
                extra_charge: extra_charge.clone(),
            });
        }
    }
    if fleet.iter().all(|t| t.byzantine.is_some()) {
        return Err(cx.err(
            groups.first().map(|g| g.name.span()).as_ref(),
            "topology.executor",
            "at least one executor must be honest (it runs the workload)",
        ));
    }
    Ok(fleet)
}
