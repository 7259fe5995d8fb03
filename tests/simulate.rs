//! `warmpath simulate` and `warmpath demo` end to end.

use crate::{scratch_dir, shared_trace, warmpath};

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn same_seed_same_json() {
    let args = [
        "simulate",
        "--workload",
        "chat",
        "--requests",
        "400",
        "--routers",
        "3",
        "--seed",
        "9",
        "--json",
    ];
    let (a, b) = (warmpath(&args), warmpath(&args));
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(stdout(&a), stdout(&b));
    let json: serde_json::Value = serde_json::from_str(&stdout(&a)).expect("valid JSON");
    let runs = json["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 4);
    for r in runs {
        assert_eq!(r["completed"], 400, "{r}");
    }
    let other = warmpath(&[
        "simulate",
        "--workload",
        "chat",
        "--requests",
        "400",
        "--routers",
        "3",
        "--seed",
        "10",
        "--json",
    ]);
    assert_ne!(stdout(&a), stdout(&other));
}

#[test]
fn trace_table_has_every_policy_and_the_bounds() {
    let trace = shared_trace("synthetic_trace.jsonl");
    let out = warmpath(&[
        "simulate",
        "--trace",
        trace.to_str().unwrap(),
        "--instances",
        "8",
        "--policy",
        "round-robin",
        "prefix-aware",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    for want in [
        "round-robin",
        "prefix-aware",
        "bounds: ideal hit rate",
        "3993 requests",
    ] {
        assert!(table.contains(want), "{want} missing from\n{table}");
    }
    assert!(!table.contains("kv-aware"), "only the named policies run");
}

/// A short `longdoc` run whose GPUs hold part of the working set, with a 1M-token L1 per host.
const LONGDOC_WITH_L1: &[&str] = &[
    "simulate",
    "--workload",
    "longdoc",
    "--requests",
    "300",
    "--rate",
    "3",
    "--gpu-kv-tokens",
    "250000",
    "--l1-kv-tokens",
    "1000000",
];

#[test]
fn a_tiered_run_says_what_the_tiers_bought_and_for_which_requests() {
    let base = [
        LONGDOC_WITH_L1,
        &["--policy", "round-robin", "prefix-aware"],
    ]
    .concat();
    let out = warmpath(&base);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    let by_source = table
        .split("ttft by where the prompt was found")
        .nth(1)
        .unwrap_or_else(|| panic!("no by-source table in\n{table}"));
    assert!(table.contains("with tiers against the same runs without them"));
    for policy in ["round-robin", "prefix-aware"] {
        let row = by_source
            .lines()
            .find(|l| l.starts_with(policy))
            .unwrap_or_else(|| panic!("{policy} missing from\n{by_source}"));
        // Without tiers no request loads: its l1/l2 cell starts at 0%.
        assert!(row.contains(" 0%→"), "{row}");
    }
    let json = warmpath(&[&base[..], &["--json"]].concat());
    let json: serde_json::Value = serde_json::from_str(&stdout(&json)).expect("valid JSON");
    for (runs, tiered) in [("runs", true), ("runs_without_tiers", false)] {
        for r in json[runs].as_array().expect("runs") {
            let s = &r["ttft_by_source"];
            let n = |k: &str| s[k]["requests"].as_u64().unwrap();
            assert_eq!(n("gpu") + n("tiers") + n("computed"), r["completed"], "{r}");
            assert_eq!(n("tiers") > 0, tiered, "{runs}: {s}");
        }
    }
}

#[test]
fn an_l2_written_through_serves_the_blocks_other_hosts_computed() {
    // Round-robin scatters each document's sessions over the hosts: a host finds what
    // another computed only in L2, and only once L1 has evicted it unless L2 is written
    // through.
    let base = [
        LONGDOC_WITH_L1,
        &[
            "--l2-kv-tokens",
            "8000000",
            "--policy",
            "round-robin",
            "--json",
        ],
    ]
    .concat();
    let run = |extra: &[&str]| {
        let out = warmpath(&[&base[..], extra].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str::<serde_json::Value>(&stdout(&out)).expect("valid JSON")
    };
    let (victim, through) = (run(&[]), run(&["--l2-write-through"]));
    assert_eq!(victim["cluster"].get("l2_write_through"), None);
    assert_eq!(through["cluster"]["l2_write_through"], true);
    let l2 = |v: &serde_json::Value| v["runs"][0]["hit_rate_l2"].as_f64().unwrap();
    let hit = |v: &serde_json::Value| v["runs"][0]["hit_rate"].as_f64().unwrap();
    assert!(
        l2(&through) > l2(&victim),
        "{} against {}",
        l2(&through),
        l2(&victim)
    );
    assert!(
        hit(&through) > hit(&victim),
        "{} against {}",
        hit(&through),
        hit(&victim)
    );
    // The runs without tiers are the same either way.
    assert_eq!(
        victim["runs_without_tiers"], through["runs_without_tiers"],
        "the untiered runs differ"
    );
}

#[test]
fn malformed_trace_line_names_file_and_line() {
    let dir = scratch_dir("bad-trace");
    let path = dir.join("bad.jsonl");
    let good = r#"{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}"#;
    std::fs::write(&path, format!("{good}\n{good}\nnot json\n{good}\n")).unwrap();
    let p = path.to_str().unwrap();
    let out = warmpath(&["simulate", "--trace", p]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("bad.jsonl") && err.contains(":3"), "{err}");
    let out = warmpath(&["simulate", "--trace", p, "--skip-bad-lines", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["workload"]["skipped_lines"], 1);
    assert_eq!(json["workload"]["requests"], 3);
}

#[test]
fn bad_arguments_are_clear_errors() {
    let dir = scratch_dir("bad-args");
    let empty = dir.join("empty-prompt.jsonl");
    std::fs::write(
        &empty,
        r#"{"timestamp": 0, "input_length": 0, "output_length": 4, "hash_ids": []}"#,
    )
    .unwrap();
    let long = dir.join("long-prompt.jsonl");
    std::fs::write(
        &long,
        r#"{"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": [1, 2, 3, 4]}"#,
    )
    .unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["simulate", "--workload", "chat", "--instances", "0"],
            "--instances must be at least 1",
        ),
        (
            &["simulate", "--workload", "chat", "--policy", "fastest"],
            "unknown routing strategy \"fastest\"",
        ),
        (
            &["simulate", "--workload", "poetry"],
            "unknown synthetic workload",
        ),
        (
            &["simulate", "--trace", "/nonexistent/trace.jsonl"],
            "/nonexistent/trace.jsonl",
        ),
        (&["simulate", "--trace", empty.to_str().unwrap()], "empty"),
        (
            &[
                "simulate",
                "--trace",
                long.to_str().unwrap(),
                "--max-prompt-tokens",
                "1000",
            ],
            "exceeds the maximum",
        ),
        (
            &["simulate", "--workload", "chat", "--l2-write-through"],
            "--l2-write-through writes to L2: give --l2-kv-tokens",
        ),
    ];
    for (args, want) in cases {
        let out = warmpath(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = stderr(&out);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

#[test]
fn demo_prints_the_comparison_table() {
    // The live demo: real router and engine-sim processes (fewer requests than the default).
    let out = warmpath(&["demo", "--requests", "150"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    for policy in ["round-robin", "least-loaded", "prefix-aware", "kv-aware"] {
        let row = table
            .lines()
            .find(|l| l.starts_with(policy))
            .unwrap_or_else(|| panic!("{policy} missing from\n{table}"));
        // Every request of every policy completed: the last column is the ok count.
        assert!(row.trim_end().ends_with(" 150"), "{row}");
    }
}

/// The processes whose parent is `pid` (from /proc), alive or not yet reaped.
fn children_of(pid: u32) -> Vec<u32> {
    let want = format!("PPid:\t{pid}");
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/status"))
                .is_ok_and(|s| s.lines().any(|l| l == want))
        })
        .collect()
}

/// Whether `pid` still runs (a zombie waiting for its reaper does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("State:"))
            .is_some_and(|state| !state.trim_start().starts_with('Z'))
    })
}

#[test]
fn a_demo_stopped_mid_run_leaves_no_process_behind() {
    use std::time::{Duration, Instant};
    // A run long enough to be stopped in: 1× speed, a request a second.
    let mut demo = std::process::Command::new(crate::warmpath_bin())
        .args(["demo", "--policy", "round-robin", "--requests", "600"])
        .args(["--rate", "1", "--speedup", "1"])
        .env("WARMPATH_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("warmpath demo starts");
    // Its 4 engine-sims and its router.
    let deadline = Instant::now() + Duration::from_secs(60);
    let children = loop {
        let children = children_of(demo.id());
        if children.len() >= 5 {
            break children;
        }
        assert!(Instant::now() < deadline, "the demo started {children:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    warmpath_testkit::signal_pid(demo.id(), "-TERM").expect("SIGTERM sent");
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(exit) = demo.try_wait().expect("wait") {
            break exit;
        }
        if Instant::now() > deadline {
            let _ = demo.kill();
            panic!("the demo did not stop on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Its children first: one left running would hold the stderr pipe open.
    let deadline = Instant::now() + Duration::from_secs(10);
    while children.iter().any(|&c| running(c)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = children.iter().copied().filter(|&c| running(c)).collect();
    for &pid in &left {
        let _ = warmpath_testkit::signal_pid(pid, "-KILL");
    }
    assert!(left.is_empty(), "left running: {left:?}");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut demo.stderr.take().expect("piped"), &mut err).unwrap();
    assert!(!exit.success(), "an interrupted demo fails: {err}");
    assert!(err.contains("interrupted"), "{err}");
}
