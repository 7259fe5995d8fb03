//! Index convergence across router replicas: 8 routers gossiping on loopback in front of
//! two engine-sims, 1,000 requests/s of prefix-sharing load spread across them for 10 s.
//!
//! Run with `cargo bench -p warmpath --bench cluster`. Reported: the dissemination lag
//! (from the moment a decision enters a router's outbox to the moment another router
//! applied it, per batch, from every router's `warmpath_cluster_dissemination_lag_seconds`
//! summary), the gossip bytes each router sent and received per second, and the share
//! of requests whose prefix a replica found placed by another replica.

mod common;

use common::{scrape, start, value, Proc};
use std::time::{Duration, Instant};
use warmpath_loadgen::{self as loadgen, Endpoint, LoadgenConfig, Mode};
use warmpath_sim::workload::synthetic::{generate, to_workload, SyntheticKind, SyntheticParams};

const ROUTERS: usize = 8;
const RATE: f64 = 1000.0;
const SECONDS: f64 = 10.0;

fn main() {
    let engines: Vec<Proc> = (0..2)
        .map(|_| {
            start(
                &[
                    "engine-sim",
                    "--listen",
                    "127.0.0.1:0",
                    "--speedup",
                    "1000000",
                ]
                .map(String::from),
                1,
            )
        })
        .collect();
    let mut routers: Vec<Proc> = Vec::new();
    let mut seed = String::new();
    for r in 0..ROUTERS {
        let mut args: Vec<String> = [
            "router",
            "--listen",
            "127.0.0.1:0",
            "--strategy",
            "prefix-aware",
            "--gossip-listen",
            "127.0.0.1:0",
        ]
        .map(String::from)
        .to_vec();
        args.extend(["--node-id".into(), format!("r{r}")]);
        for e in &engines {
            args.extend(["--instance".into(), e.url.clone()]);
        }
        if r > 0 {
            args.extend(["--seed".into(), seed.clone()]);
        }
        let p = start(&args, 2);
        if r == 0 {
            seed = p.lines[1]
                .split("gossip on ")
                .nth(1)
                .expect("gossip line")
                .trim()
                .to_string();
        }
        routers.push(p);
    }
    std::thread::sleep(Duration::from_secs(3)); // membership settles
    let before: Vec<(f64, f64)> = routers
        .iter()
        .map(|r| {
            let m = scrape(&r.url);
            (
                value(&m, "warmpath_gossip_sent_bytes_total"),
                value(&m, "warmpath_gossip_received_bytes_total"),
            )
        })
        .collect();
    // Chat-like sharing: conversations whose turns land on random routers.
    let params = SyntheticParams {
        rate_per_s: RATE,
        requests: (RATE * SECONDS) as u32,
        seed: 5,
        ..SyntheticParams::default()
    };
    let synthetic = generate(SyntheticKind::Bots, &params);
    let workload = to_workload("bots", &synthetic, 64);
    let requests = loadgen::from_workload(&workload, Some(&synthetic), Endpoint::Completions);
    let mut config =
        LoadgenConfig::new(routers.iter().map(|r| r.url.clone()).collect(), "sim-llama");
    config.mode = Mode::Poisson {
        rate_per_s: RATE,
        seed: 9,
    };
    config.stream = false;
    config.max_duration = Some(Duration::from_secs_f64(SECONDS + 5.0));
    // One output token each: the engines stay idle, the routers and gossip are measured.
    let requests: Vec<_> = requests
        .into_iter()
        .map(|mut r| {
            r.max_tokens = 1;
            r
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let t0 = Instant::now();
    let report = runtime
        .block_on(loadgen::run(&config, &requests, &|_| {}))
        .expect("load runs");
    let wall = t0.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(1));
    println!(
        "cluster convergence: {ROUTERS} routers, 2 engine-sims, {} requests ({} ok) at {RATE}/s Poisson over {wall:.1} s, bots workload, non-streaming",
        report.requests, report.ok
    );
    let (mut p50s, mut p99s, mut sent, mut recv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (r, (s0, r0)) in routers.iter().zip(&before) {
        let m = scrape(&r.url);
        p50s.push(
            value(
                &m,
                "warmpath_cluster_dissemination_lag_seconds{quantile=\"0.5\"}",
            ) * 1e3,
        );
        p99s.push(
            value(
                &m,
                "warmpath_cluster_dissemination_lag_seconds{quantile=\"0.99\"}",
            ) * 1e3,
        );
        sent.push((value(&m, "warmpath_gossip_sent_bytes_total") - s0) / wall / 1e3);
        recv.push((value(&m, "warmpath_gossip_received_bytes_total") - r0) / wall / 1e3);
    }
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let median = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    };
    println!(
        "  dissemination lag p50 per router (ms): {}  (median {:.0} ms)",
        show(&p50s),
        median(&p50s)
    );
    println!(
        "  dissemination lag p99 per router (ms): {}  (max {:.0} ms; target p99 < 500 ms)",
        show(&p99s),
        p99s.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "  gossip sent per router (KB/s):         {}  (max {:.0}; target < 100 KB/s)",
        show(&sent),
        sent.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "  gossip received per router (KB/s):     {}  (max {:.0})",
        show(&recv),
        recv.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "  hit rate reported by the engines: {:.1}%",
        report.hit_rate * 100.0
    );
}
