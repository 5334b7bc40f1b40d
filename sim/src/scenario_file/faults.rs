//! `[faults]` of a scenario file: families on and swarmed, intensities, the fault window, and
//! each scripted fault built and checked against the processes it names (issue 17 item 3:
//! split out of `build()` and moved out of `scenario_file.rs` unchanged).

use super::*;

/// What `[faults]` gives the scenario.
pub(super) struct FaultsParts {
    pub(super) modes: [Mode; Family::COUNT],
    pub(super) intensity: [Option<f64>; Family::COUNT],
    pub(super) script: Vec<(Micros, Fault)>,
    pub(super) fault_window: Micros,
}

/// `[faults]`: families on and swarmed, intensities, the script (processes named by
/// `names`) and the window.
pub(super) fn build_faults(
    cx: &Ctx<'_>,
    fd: FaultsDoc,
    names: &[String],
) -> Result<FaultsParts, LoadError> {
    let mut modes = [Mode::Off; Family::COUNT];
    for (k, f) in fd.on.iter().enumerate() {
        if f.get_ref() == "all" {
            // "all": the families the library's seed plans were fixed with; the late
            // ones (hang, lose) are named explicitly.
            for fam in Family::ALL.into_iter().filter(|f| !f.late()) {
                modes[fam as usize] = Mode::On;
            }
        } else {
            modes[family(cx, f, &format!("faults.on[{k}]"))? as usize] = Mode::On;
        }
    }
    for (k, f) in fd.swarm.iter().enumerate() {
        if f.get_ref() == "all" {
            for fam in Family::ALL.into_iter().filter(|f| !f.late()) {
                modes[fam as usize] = Mode::Swarm;
            }
        } else {
            let fam = family(cx, f, &format!("faults.swarm[{k}]"))?;
            if modes[fam as usize] == Mode::On {
                return Err(cx.err(
                    Some(&f.span()),
                    format!("faults.swarm[{k}]"),
                    format!("{:?} is already in `on`", f.get_ref()),
                ));
            }
            modes[fam as usize] = Mode::Swarm;
        }
    }
    let mut intensity = [None; Family::COUNT];
    for (fam, v) in &fd.intensity {
        let field = format!("faults.intensity.{fam}");
        let spanned = Spanned::new(v.span(), fam.clone());
        let f = family(cx, &spanned, &field)?;
        let x = cx.share(v, &field)?;
        if x <= 0.0 {
            return Err(cx.err(Some(&v.span()), field, "an intensity is above 0"));
        }
        intensity[f as usize] = Some(x);
    }
    let mut script = Vec::new();
    let mut last_end: Micros = 0;
    for (k, f) in fd.script.iter().enumerate() {
        let span = f.span();
        let faults = build_fault(cx, k, f.get_ref(), &span, names)?;
        for (at, fault) in faults {
            last_end = last_end.max(fault_end(at, &fault));
            script.push((at, fault));
        }
    }
    script.sort_by_key(|(t, _)| *t);
    let any_family = modes.iter().any(|m| *m != Mode::Off);
    let fault_window = match &fd.window {
        Some(w) => {
            let w_val = w.get_ref().0;
            for (k, f) in fd.script.iter().enumerate() {
                let at = f.get_ref().at.get_ref().0;
                let end = build_fault(cx, k, f.get_ref(), &f.span(), names)?
                    .iter()
                    .map(|(at, fault)| fault_end(*at, fault))
                    .max()
                    .unwrap_or(at);
                if at < w_val && end > w_val {
                    return Err(cx.err(
                        Some(&f.span()),
                        format!("faults.script[{k}]"),
                        format!(
                            "lasts until {}, after the end of the fault window ({}): the heal \
                             would cut it short",
                            format_micros(end),
                            format_micros(w_val)
                        ),
                    ));
                }
                if at >= w_val {
                    return Err(cx.err(
                        Some(&f.get_ref().at.span()),
                        format!("faults.script[{k}].at"),
                        format!(
                            "{} is after the end of the fault window ({}): the network heals then",
                            format_micros(at),
                            format_micros(w_val)
                        ),
                    ));
                }
            }
            w_val
        }
        None if any_family => {
            return Err(cx.err(
                fd.on
                    .iter()
                    .chain(&fd.swarm)
                    .next()
                    .map(Spanned::span)
                    .as_ref(),
                "faults.window",
                "missing: families in `on` or `swarm` need a window to act in",
            ))
        }
        None if script.is_empty() => 0,
        None => last_end + 10 * SEC,
    };
    Ok(FaultsParts {
        modes,
        intensity,
        script,
        fault_window,
    })
}

pub(super) fn fault_end(at: Micros, f: &Fault) -> Micros {
    match f {
        Fault::Partition { until, .. }
        | Fault::Clog { until, .. }
        | Fault::Spike { until, .. }
        | Fault::Lag { until, .. }
        | Fault::Hang { until, .. }
        | Fault::Twin { until, .. } => *until,
        Fault::PauseMill { until } => *until,
        Fault::CutMillStore => at + crate::scenario::LEADER_LEASE,
        Fault::Reset { .. } | Fault::Lose { .. } => at,
        Fault::CrashExec { down, .. } | Fault::CrashMill { down, .. } => at + down,
    }
}

pub(super) fn build_fault(
    cx: &Ctx<'_>,
    k: usize,
    f: &FaultDoc,
    span: &Range<usize>,
    names: &[String],
) -> Result<Vec<(Micros, Fault)>, LoadError> {
    let field = |x: &str| format!("faults.script[{k}].{x}");
    let exec = |n: &Spanned<String>, x: &str| -> Result<usize, LoadError> {
        names.iter().position(|m| m == n.get_ref()).ok_or_else(|| {
            let shown: Vec<&str> = names.iter().take(8).map(String::as_str).collect();
            cx.err(
                Some(&n.span()),
                field(x),
                format!(
                    "unknown executor {:?}; the fleet has {}{}",
                    n.get_ref(),
                    shown.join(", "),
                    if names.len() > 8 { ", …" } else { "" }
                ),
            )
        })
    };
    let actions = [
        f.partition.is_some(),
        f.clog.is_some(),
        f.spike.is_some(),
        f.reset.is_some(),
        f.crash.is_some(),
        f.wipe.is_some(),
        f.flap.is_some(),
        f.lag.is_some(),
        f.hang.is_some(),
        f.lose.is_some(),
        f.twin.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if actions != 1 {
        return Err(cx.err(
            Some(span),
            format!("faults.script[{k}]"),
            format!(
                "name exactly one of partition, clog, spike, reset, crash, wipe, flap, lag, hang, lose, twin ({actions} given)"
            ),
        ));
    }
    let at = f.at.get_ref().0;
    let length = |what: &str| -> Result<Micros, LoadError> {
        match &f.for_ {
            Some(d) if d.get_ref().0 > 0 => Ok(d.get_ref().0),
            Some(d) => Err(cx.err(Some(&d.span()), field("for"), "must be positive")),
            None => Err(cx.err(
                Some(span),
                field("for"),
                format!("missing field `for`: how long the {what} lasts"),
            )),
        }
    };
    let silent = f.silent.unwrap_or(false);
    if let Some(side) = &f.partition {
        if side.is_empty() {
            return Err(cx.err(Some(span), field("partition"), "name at least one executor"));
        }
        let mut idx = Vec::new();
        for (j, n) in side.iter().enumerate() {
            idx.push(exec(n, &format!("partition[{j}]"))?);
        }
        idx.sort_unstable();
        idx.dedup();
        let until = at + length("partition")?;
        return Ok(vec![(
            at,
            Fault::Partition {
                side: idx,
                one_way: f.one_way.unwrap_or(false),
                until,
            },
        )]);
    }
    if let Some(n) = &f.clog {
        let exec = exec(n, "clog")?;
        let to_mill = match &f.direction {
            None => true,
            Some(d) => match d.get_ref().as_str() {
                "to-mill" => true,
                "from-mill" => false,
                other => {
                    return Err(cx.err(
                        Some(&d.span()),
                        field("direction"),
                        format!("unknown direction {other:?}; known: to-mill, from-mill"),
                    ))
                }
            },
        };
        let until = at + length("clog")?;
        return Ok(vec![(
            at,
            Fault::Clog {
                exec,
                to_mill,
                until,
            },
        )]);
    }
    if let Some(extra) = f.spike {
        let until = at + length("latency spike")?;
        return Ok(vec![(
            at,
            Fault::Spike {
                extra: extra.0,
                until,
            },
        )]);
    }
    if let Some(n) = &f.reset {
        return Ok(vec![(
            at,
            Fault::Reset {
                exec: exec(n, "reset")?,
            },
        )]);
    }
    if let Some(n) = &f.crash {
        let down = f.restart_after.map_or(5 * SEC, |d| d.0.max(MS));
        if n.get_ref() == "mill" {
            if f.at_commit.is_some() {
                return Err(cx.err(
                    Some(span),
                    field("at_commit"),
                    "only an executor's crash can wait for a commit",
                ));
            }
            return Ok(vec![(at, Fault::CrashMill { down, silent })]);
        }
        return Ok(vec![(
            at,
            Fault::CrashExec {
                exec: exec(n, "crash")?,
                wipe: false,
                down,
                silent,
                at_commit: f.at_commit.unwrap_or(false),
            },
        )]);
    }
    if let Some(n) = &f.lag {
        let proc = if n.get_ref() == "mill" {
            Proc::Mill
        } else {
            Proc::Exec(exec(n, "lag")?)
        };
        let until = at + length("driver lag")?;
        let max_delay = match &f.max_delay {
            None => 2 * SEC,
            Some(d) if d.get_ref().0 > 0 => d.get_ref().0,
            Some(d) => return Err(cx.err(Some(&d.span()), field("max_delay"), "must be positive")),
        };
        let max_inputs = match &f.max_inputs {
            None => 1000,
            Some(k) if *k.get_ref() > 0 => *k.get_ref(),
            Some(k) => return Err(cx.err(Some(&k.span()), field("max_inputs"), "at least 1")),
        };
        return Ok(vec![(
            at,
            Fault::Lag {
                proc,
                until,
                max_delay,
                max_inputs,
            },
        )]);
    }
    if let Some(n) = &f.hang {
        let exec = exec(n, "hang")?;
        let until = at + length("hang")?;
        return Ok(vec![(at, Fault::Hang { exec, until })]);
    }
    if let Some(n) = &f.twin {
        let exec = exec(n, "twin")?;
        let until = at + length("twin")?;
        return Ok(vec![(at, Fault::Twin { exec, until })]);
    }
    if let Some(n) = &f.lose {
        return Ok(vec![(
            at,
            Fault::Lose {
                exec: exec(n, "lose")?,
            },
        )]);
    }
    if let Some(n) = &f.wipe {
        let down = f.restart_after.map_or(SEC, |d| d.0.max(MS));
        return Ok(vec![(
            at,
            Fault::CrashExec {
                exec: exec(n, "wipe")?,
                wipe: true,
                down,
                silent,
                at_commit: false,
            },
        )]);
    }
    if let Some(n) = &f.flap {
        let x = exec(n, "flap")?;
        let total = length("flapping")?;
        let period = match &f.period {
            None => 10 * SEC,
            Some(p) if p.get_ref().0 >= 2 * MS => p.get_ref().0,
            Some(p) => return Err(cx.err(Some(&p.span()), field("period"), "at least 2ms")),
        };
        let down = f.down.map_or(period / 2, |d| d.0).clamp(MS, period - MS);
        // Each period: the connection resets and the link stays cut for `down`.
        let mut out = Vec::new();
        let mut t = at;
        while t < at + total {
            out.push((t, Fault::Reset { exec: x }));
            out.push((
                t,
                Fault::Partition {
                    side: vec![x],
                    one_way: false,
                    until: t + down,
                },
            ));
            t += period;
        }
        return Ok(out);
    }
    Err(cx.err(Some(span), format!("faults.script[{k}]"), "no fault named"))
}
