//! Simulator speed: simulated requests per wall-clock second, per policy.
//!
//! Run with `cargo bench -p warmpath-sim`. Each policy simulates the default `bots`
//! workload (3,000 requests, 64-token blocks) on 8 instances and 4 routers, three times;
//! the figure is the median run.

use std::time::Instant;
use warmpath_index::cost::ModelProfile;
use warmpath_index::index::IndexConfig;
use warmpath_index::policy::{PolicyConfig, Strategy};
use warmpath_index::router::DECISION_BUDGET_KEYS_PER_S;
use warmpath_sim::cluster::{simulate, ClusterConfig, Sharing};
use warmpath_sim::engine::EngineConfig;
use warmpath_sim::workload::synthetic::{generate_workload, SyntheticKind, SyntheticParams};

fn main() {
    let started = Instant::now();
    let workload = generate_workload(SyntheticKind::Bots, &SyntheticParams::default(), 64);
    println!(
        "workload bots: {} requests, generated in {:.2} s",
        workload.requests.len(),
        started.elapsed().as_secs_f64()
    );
    for strategy in Strategy::ALL {
        let config = ClusterConfig {
            instances: 8,
            routers: 4,
            sharing: Sharing::Delayed(50_000),
            agent_feed_delay_us: Some(10_000),
            engine: EngineConfig {
                block_tokens: 64,
                gpu_blocks: 2_000,
                ..EngineConfig::default()
            },
            profile: ModelProfile::dynamo_default(),
            policy: PolicyConfig {
                concurrency_threshold: 0,
                ..PolicyConfig::new(strategy, 64)
            },
            gossip_budget_keys_per_s: DECISION_BUDGET_KEYS_PER_S,
            index: IndexConfig::default(),
            l2_blocks: 0,
            max_prompt_tokens: 1 << 20,
            seed: 1,
            prefetch: false,
            residency_followers: None,
            faults: Vec::new(),
            timeline_us: None,
        };
        let mut times: Vec<f64> = (0..3)
            .map(|_| {
                let t = Instant::now();
                let report =
                    simulate(&config, &workload, &mut |_| {}).expect("valid configuration");
                assert_eq!(report.completed as usize, workload.requests.len());
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let median = times[1];
        println!(
            "{:<13} {:>9.0} simulated requests/s (median of 3 runs: {:.3} s; min {:.3} s, max {:.3} s)",
            strategy.name(),
            workload.requests.len() as f64 / median,
            median,
            times[0],
            times[2]
        );
    }
}
