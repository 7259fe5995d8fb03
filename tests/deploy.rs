//! `deploy/`: the Prometheus rules pass `promtool` (syntax and their unit tests); a real
//! Prometheus (the distribution's package, installed by `tests/run`) scrapes every process
//! of a running `warmpath demo --keep-running` cluster and evaluates the rules on what they
//! export; every metric the Grafana dashboard and the rules name is exported by a live
//! process; and the systemd units verify, are hardened and pass real flags. (The Helm
//! chart's tests are in `helm.rs`, the compose file's in `compose.rs`.)

use crate::router::{client, completion, get_text, post};
use crate::{free_addr, scratch_dir, warmpath_bin};
use http_body_util::BodyExt;
use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
}

/// Runs a tool of a distribution package (`promtool`: prometheus; `systemd-analyze`:
/// systemd) and asserts that it succeeds, showing what it printed when it does not.
pub(crate) fn succeeds(tool: &str, args: &[&str]) {
    let out = Command::new(warmpath_testkit::system_tool(tool))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{tool} did not run: {e}"));
    assert!(
        out.status.success(),
        "{tool} {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn prometheus_rules_are_valid_and_their_unit_tests_pass() {
    let rules = deploy_dir().join("prometheus/rules.yml");
    succeeds("promtool", &["check", "rules", rules.to_str().unwrap()]);
    let tests = deploy_dir().join("prometheus/rules_test.yml");
    succeeds("promtool", &["test", "rules", tests.to_str().unwrap()]);
}

/// A child process stopped with SIGTERM (so that it stops its own children) and reaped.
pub(crate) struct Stopped(pub(crate) Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = warmpath_testkit::signal_pid(self.0.id(), "-TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running `warmpath demo --keep-running` cluster: the demo process (stopping it stops
/// the cluster), its routers' base URLs and every process's metrics URL.
struct Demo {
    _demo: Stopped,
    routers: Vec<String>,
    metrics: Vec<String>,
}

/// Starts `warmpath demo --keep-running` on a small prefix-aware run with `extra` flags
/// and reads the cluster it leaves running from what it prints.
fn demo_cluster(extra: &[&str]) -> Demo {
    let mut child = Command::new(warmpath_bin())
        .args(["demo", "--requests", "24", "--policy", "prefix-aware"])
        .args(extra)
        .arg("--keep-running")
        .env("WARMPATH_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("warmpath demo starts");
    let stdout = child.stdout.take().expect("piped");
    let demo = Stopped(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let (mut routers, mut metrics) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("the demo prints its running cluster in time");
        let line = line.trim_start();
        if line.starts_with("try:") {
            break;
        }
        // "router:  URL  (metrics: URL/metrics)", the same for engines and agents.
        if let Some(m) = line.split("metrics: ").nth(1) {
            metrics.push(m.trim_end_matches(')').trim().to_string());
        }
        if line.starts_with("router:") {
            routers.push(
                line.split_whitespace()
                    .nth(1)
                    .unwrap_or_default()
                    .to_string(),
            );
        }
    }
    assert!(!routers.is_empty(), "no router in the demo's output");
    Demo {
        _demo: demo,
        routers,
        metrics,
    }
}

/// A real Prometheus (the distribution's package) with `config` as its configuration
/// file, its data and log in `dir`, on a free loopback port: the process and its base URL.
pub(crate) fn start_prometheus(dir: &Path, config: &str) -> (Stopped, String) {
    std::fs::write(dir.join("prometheus.yml"), config).expect("write the config");
    let listen = free_addr();
    let prometheus = Command::new(warmpath_testkit::system_tool("prometheus"))
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={listen}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("log file"))
        .spawn()
        .expect("prometheus runs: install the distribution's `prometheus` package");
    (Stopped(prometheus), format!("http://{listen}"))
}

/// One Prometheus instant query's result vector.
pub(crate) async fn query(prometheus: &str, promql: &str) -> Vec<Value> {
    let url = format!(
        "{prometheus}/api/v1/query?query={}",
        promql
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    );
    let Ok(resp) = client().get(url.parse().expect("a query URL")).await else {
        return Vec::new();
    };
    let body = resp.into_body().collect().await.expect("a body").to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

pub(crate) fn value(sample: &Value) -> f64 {
    sample["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_demo_cluster_and_records() {
    let demo = tokio::task::spawn_blocking(|| demo_cluster(&[]))
        .await
        .expect("demo");
    let routers = &demo.routers;
    let dir = scratch_dir("deploy-prometheus");
    let targets: Vec<String> = demo
        .metrics
        .iter()
        .map(|u| {
            let host = u.trim_start_matches("http://").trim_end_matches("/metrics");
            format!("'{host}'")
        })
        .collect();
    let rules = deploy_dir().join("prometheus/rules.yml");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - '{}'\n\
         scrape_configs:\n  - job_name: warmpath\n    static_configs:\n      - targets: [{}]\n",
        rules.canonicalize().expect("rules.yml").display(),
        targets.join(", ")
    );
    let (_prometheus, prom) = start_prometheus(&dir, &config);
    let http = client();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut n = 0;
    let (up, recorded, hit_ratio) = loop {
        // Traffic through the demo's router, so that its counters move.
        for _ in 0..5 {
            n += 1;
            // A long shared prefix: the engines find it cached after the first request.
            let prefix = "You are a support bot for warmpath, a gateway that routes prompts \
                          to warm caches. "
                .repeat(12);
            let prompt = format!("{prefix}Ticket {n}: hello");
            let r = post(
                &http,
                &routers[0],
                "/v1/completions",
                completion(&prompt, 4, false),
                &[],
            )
            .await;
            assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
        }
        let up = query(&prom, "up").await;
        let recorded = query(&prom, "warmpath:router_requests:rate1m").await;
        let hit_ratio = query(&prom, "warmpath:prefix_hit_ratio:rate5m").await;
        let all_up = up.len() == targets.len() && up.iter().all(|s| value(s) == 1.0);
        let moving = recorded.iter().any(|s| value(s) > 0.0);
        let hits = hit_ratio.iter().any(|s| value(s) > 0.0);
        if (all_up && moving && hits) || Instant::now() > deadline {
            break (up, recorded, hit_ratio);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(up.len(), targets.len(), "every process scraped: {up:?}");
    assert!(up.iter().all(|s| value(s) == 1.0), "{up:?}");
    assert!(
        recorded.iter().any(|s| value(s) > 0.0),
        "the recording rule has a value: {recorded:?}"
    );
    assert!(
        hit_ratio.iter().all(|s| (0.0..=1.0).contains(&value(s))),
        "{hit_ratio:?}"
    );
    assert!(
        hit_ratio.iter().any(|s| value(s) > 0.0),
        "the engines report cached prompt tokens and the hit ratio records them: {hit_ratio:?}"
    );
    println!("up: {up:?}\nrequests: {recorded:?}\nhit ratio: {hit_ratio:?}");
}

/// Every metric name in `text` (PromQL or YAML): `warmpath_…` and `vllm:…`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        let starts = rest.starts_with("warmpath_") || rest.starts_with("vllm:");
        let boundary = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        if starts && boundary {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            names.insert(rest[..end].to_string());
            i += end;
        } else {
            i += 1;
        }
    }
    names
}

/// The dashboard and the rules name only metrics the crates define (their `metric_names`
/// modules, where each name is written once): a metric renamed in the code fails here at
/// once, without a cluster. The live check below then proves each is exported.
#[test]
fn the_dashboard_and_rules_name_only_metrics_the_crates_define() {
    let defined: BTreeSet<&str> = [
        warmpath::metric_names::ALL,
        warmpath_cache_agent::metric_names::ALL,
        warmpath_residency::metric_names::ALL,
        warmpath_membership::metric_names::ALL,
        warmpath_engine_sim::metric_names::ALL,
    ]
    .concat()
    .into_iter()
    .collect();
    let mut text =
        std::fs::read_to_string(deploy_dir().join("grafana/warmpath.json")).expect("the dashboard");
    text.push_str(
        &std::fs::read_to_string(deploy_dir().join("prometheus/rules.yml")).expect("the rules"),
    );
    let named = metric_names(&text);
    let unknown: Vec<&String> = named
        .iter()
        .filter(|n| !n.starts_with("vllm:"))
        .filter(|n| {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n);
            !defined.contains(n.as_str()) && !defined.contains(base)
        })
        .collect();
    assert!(named.len() >= 30, "{named:?}");
    assert!(unknown.is_empty(), "named but defined nowhere: {unknown:?}");
}

/// The names of the series in a Prometheus text exposition.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// The dashboard's queries and the rules name only metrics that the processes export:
/// checked against the live `/metrics` of a demo cluster with two gossiping routers,
/// cache-agents with both tiers and residency, and a Raft router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_rules_name_only_metrics_the_processes_export() {
    let dashboard =
        std::fs::read_to_string(deploy_dir().join("grafana/warmpath.json")).expect("the dashboard");
    let json: Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let mut wanted = BTreeSet::new();
    let mut panels = 0;
    for p in json["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            wanted.extend(metric_names(t["expr"].as_str().expect("an expr")));
            panels += 1;
        }
    }
    let rules =
        std::fs::read_to_string(deploy_dir().join("prometheus/rules.yml")).expect("the rules");
    wanted.extend(metric_names(&rules));
    assert!(
        panels >= 20 && wanted.len() >= 30,
        "{panels} queries, {wanted:?}"
    );

    let demo = tokio::task::spawn_blocking(|| {
        demo_cluster(&[
            "--routers",
            "2",
            "--l1-kv-tokens",
            "4096",
            "--l2",
            "dir",
            "--residency",
        ])
    })
    .await
    .expect("demo");
    let raft = crate::raft::Setup::new("deploy-raft-metrics", 1);
    let voters = raft.start_voters();
    crate::raft::wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
    // A rate-limited tenant, whose refusals are counted.
    crate::raft::create_limited_tenant(&voters[0], "limited", "sk-deploy-limited").await;
    // Traffic through both routers (decisions to gossip, KV events to follow), and one
    // request for a model nobody serves (an error the router answers itself).
    let http = client();
    for n in 0..40 {
        let prefix = "A shared system prompt for every ticket of this test run. ".repeat(10);
        let body = completion(&format!("{prefix}Ticket {}", n % 5), 4, n % 2 == 0);
        let router = &demo.routers[n % demo.routers.len()];
        let r = post(&http, router, "/v1/completions", body, &[]).await;
        assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    }
    let unknown = r#"{"model":"no-such-model","prompt":"hi","max_tokens":1}"#;
    let r = post(&http, &demo.routers[0], "/v1/completions", unknown, &[]).await;
    assert_eq!(r.status, 404);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut sources = demo.metrics.clone();
    sources.push(format!("{}/metrics", voters[0].proc.url));
    let mut have = BTreeSet::new();
    for url in &sources {
        have.extend(exported(&get_text(url).await));
    }
    let missing: Vec<&String> = wanted.iter().filter(|n| !have.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "named in deploy/ but exported by none of {} processes: {missing:?}",
        sources.len()
    );
    println!(
        "{panels} dashboard queries and the rules name {} metrics; all exported by {} live processes",
        wanted.len(),
        sources.len()
    );
}

/// The systemd units pass `systemd-analyze verify`, are hardened (an offline exposure of
/// at most 2.0 of 10 in `systemd-analyze security`), and pass only flags the binary has.
#[test]
fn systemd_units_verify_are_hardened_and_pass_real_flags() {
    let dir = scratch_dir("deploy-systemd");
    for (unit, command) in [
        ("warmpath-router.service", "router"),
        ("warmpath-agent.service", "agent"),
    ] {
        let text =
            std::fs::read_to_string(deploy_dir().join("systemd").join(unit)).expect("the unit");
        // The binary where the unit expects it: this build's.
        let here = text.replace("/usr/local/bin/warmpath", warmpath_bin().to_str().unwrap());
        let path = dir.join(unit);
        std::fs::write(&path, here).expect("write the unit");
        let path = path.to_str().unwrap();
        succeeds("systemd-analyze", &["verify", "--man=no", path]);
        // An exposure of at most 2.0 of 10.
        succeeds(
            "systemd-analyze",
            &["security", "--offline=true", "--threshold=20", path],
        );
        // Every flag of the ExecStart line (with its continuations) is one the command
        // takes.
        let exec: String = text
            .split("ExecStart=")
            .nth(1)
            .expect("an ExecStart")
            .split_inclusive('\n')
            .scan(true, |more, line| {
                let keep = *more;
                *more = line.trim_end().ends_with('\\');
                keep.then_some(line)
            })
            .collect();
        assert_real_flags(unit, command, &exec);
    }
}

/// Every `--flag` in `words` (a command line of `warmpath COMMAND`; `--flag=value` too) is
/// one `warmpath COMMAND --help` lists; `what` names where the line comes from.
pub(crate) fn assert_real_flags(what: &str, command: &str, words: &str) {
    let help = crate::warmpath(&[command, "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    let flags: Vec<&str> = words
        .split_whitespace()
        .map(|w| w.trim_matches('"'))
        .filter(|w| w.starts_with("--"))
        .map(|w| w.split('=').next().unwrap_or(w))
        .collect();
    assert!(flags.len() >= 3, "{what}: {words}");
    for flag in flags {
        assert!(
            help.split_whitespace()
                .any(|w| w.trim_end_matches(',') == flag),
            "{what} passes {flag}, which `warmpath {command}` does not take"
        );
    }
}
