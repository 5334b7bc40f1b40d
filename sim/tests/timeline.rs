//! `replay --html` in a real browser (issue 17 item 2): the page of a failing run (the
//! shrink test's breakage) is rendered by headless Chromium, and the DOM after its script
//! ran has a lane per process, the message arrows, the lease bars, the fault marks and the
//! failure line. Without Chromium the test says so and passes, except in CI (`CI=true`),
//! where ci/check installs it and a missing browser is a failure.
#![allow(clippy::expect_used)] // a test: a missing library file is a failure

use std::process::Command;

use sim::scenario::SimBug;
use sim::trace::Trace;

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

#[test]
fn the_timeline_of_a_failing_run_renders_in_headless_chromium() {
    let Some(browser) = chromium() else {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "CI=true but no chromium: ci/check installs it"
        );
        eprintln!("skipped: no chromium on PATH (apt-get install -y chromium)");
        return;
    };
    let (_, text) = sim::scenario_file::embedded_texts()
        .find(|(n, _)| *n == "crashes")
        .expect("crashes is in the library");
    let mut s = sim::scenario_file::load_str("scenarios/crashes.toml", text).expect("it loads");
    s.bug = Some(SimBug::DoubleStartAfterCrash);
    let o = sim::run(&s, 0, Trace::on(sim::timeline::MAX_LINES, None));
    let v = o.failure.clone().expect("the breakage fails seed 0");
    let page = sim::timeline::html(
        "crashes seed 0",
        &o.last_lines,
        o.trace_lines,
        Some((o.end as f64 / 1e6, format!("{}: {}", v.rule, v.message))),
    );
    let dir = std::env::temp_dir().join(format!("millrace-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("timeline.html");
    std::fs::write(&file, &page).expect("write the page");
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
        ])
        .arg(format!("file://{}", file.display()))
        .output()
        .expect("run chromium");
    let _ = std::fs::remove_dir_all(&dir);
    let dom = String::from_utf8_lossy(&out.stdout);
    let count = |needle: &str| dom.matches(needle).count();
    assert!(
        count("class=\"lname\"") >= 5,
        "a lane per process (mill, x0..x3)"
    );
    assert!(count("class=\"arrow") > 100, "message arrows drawn");
    assert!(count("class=\"lease") > 0, "lease bars drawn");
    assert!(count("class=\"faultmark\"") > 0, "fault marks drawn");
    assert_eq!(count("class=\"fail\""), 1, "the failure is marked once");
    assert!(dom.contains("I1: "), "the failing invariant is named");
}
