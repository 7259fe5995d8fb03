//! `deploy/`: the Prometheus rules pass `promtool` (syntax and their unit tests), and a
//! real Prometheus (the distribution's package, installed by `.ci/run`) scrapes every
//! process of a running `warmpath demo --keep-running` cluster and evaluates the rules on
//! what they export.

use crate::router::{client, completion, post};
use crate::{free_addr, scratch_dir, warmpath_bin};
use http_body_util::BodyExt;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
}

/// Runs a tool of the Prometheus package; a missing one fails with how to install it.
fn run(tool: &str, args: &[&str]) -> std::process::Output {
    Command::new(tool).args(args).output().unwrap_or_else(|e| {
        panic!("{tool} did not run ({e}): install the distribution's `prometheus` package")
    })
}

#[test]
fn prometheus_rules_are_valid_and_their_unit_tests_pass() {
    let rules = deploy_dir().join("prometheus/rules.yml");
    let out = run("promtool", &["check", "rules", rules.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tests = deploy_dir().join("prometheus/rules_test.yml");
    let out = run("promtool", &["test", "rules", tests.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "promtool test rules: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A child process stopped with SIGTERM (so that it stops its own children) and reaped.
struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
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

/// Starts `warmpath demo --keep-running` on a small run and returns it with the base URLs
/// of the cluster it leaves running (routers first, then engines).
fn demo_cluster() -> (Stopped, Vec<String>, Vec<String>) {
    let mut child = Command::new(warmpath_bin())
        .args([
            "demo",
            "--requests",
            "24",
            "--policy",
            "prefix-aware",
            "--keep-running",
        ])
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
    let (mut routers, mut engines) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("the demo prints its running cluster in time");
        let url = |l: &str| l.split_whitespace().nth(1).unwrap_or_default().to_string();
        if line.trim_start().starts_with("router:") {
            routers.push(url(line.trim_start()));
        } else if line.trim_start().starts_with("engine:") {
            engines.push(url(line.trim_start()));
        } else if line.trim_start().starts_with("try:") {
            break;
        }
    }
    assert!(
        !routers.is_empty() && !engines.is_empty(),
        "{routers:?} {engines:?}"
    );
    (demo, routers, engines)
}

/// One Prometheus instant query's result vector.
async fn query(prometheus: &str, promql: &str) -> Vec<Value> {
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

fn value(sample: &Value) -> f64 {
    sample["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_demo_cluster_and_records() {
    let (_demo, routers, engines) = tokio::task::spawn_blocking(demo_cluster)
        .await
        .expect("demo");
    let dir = scratch_dir("deploy-prometheus");
    let targets: Vec<String> = routers
        .iter()
        .chain(&engines)
        .map(|u| format!("'{}'", u.trim_start_matches("http://")))
        .collect();
    let rules = deploy_dir().join("prometheus/rules.yml");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - '{}'\n\
         scrape_configs:\n  - job_name: warmpath\n    static_configs:\n      - targets: [{}]\n",
        rules.canonicalize().expect("rules.yml").display(),
        targets.join(", ")
    );
    std::fs::write(dir.join("prometheus.yml"), config).expect("write the config");
    let listen = free_addr();
    let prometheus = Command::new("prometheus")
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
    let _prometheus = Stopped(prometheus);
    let prom = format!("http://{listen}");
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
