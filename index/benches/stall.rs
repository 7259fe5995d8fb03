//! Does anything stall the request path? Routing latency through the router core, behind
//! one mutex as in the live router, while another thread keeps failing and restoring an
//! instance and a third reads the statistics `/metrics` serves ten times a second.
//!
//! Run with `cargo bench -p warmpath-index --bench stall`. The core's index holds 1M
//! blocks over 256 instances (32,768 prompts of 32 blocks, a quarter behind one of 256
//! shared system prompts). For 5 s:
//! - the routing thread routes 32-block prompts (half repeat a cached prompt, half are
//!   new), each timed from before taking the lock to after the decision is recorded;
//! - the flapping thread, every 20 ms, fails an attempt on one instance (ejection, which
//!   forgets what it held) and marks another down, then up again;
//! - the metrics thread, every 100 ms, reads the index statistics and every instance's
//!   load under the lock, as `/metrics` does.
//!
//! Printed: routing latency percentiles and the longest time the other two held the lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use warmpath_index::cost::ModelProfile;
use warmpath_index::index::IndexConfig;
use warmpath_index::keys::BlockKey;
mod common;
use common::{prompts, BLOCKS, PROMPTS};
use warmpath_index::policy::{PolicyConfig, RouteRequest, Strategy};
use warmpath_index::rng::Rng;
use warmpath_index::router::{CoreConfig, CorePool, InstanceSpec, RouterCore};
use warmpath_index::InstanceId;

const INSTANCES: u32 = 256;
const RUN: Duration = Duration::from_secs(5);

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let policy = PolicyConfig {
        concurrency_threshold: 0,
        ..PolicyConfig::new(Strategy::PrefixAware, 64)
    };
    let mut core = RouterCore::new(
        CoreConfig {
            index: IndexConfig {
                capacity_blocks: PROMPTS * BLOCKS,
                predicted_ttl_us: 3_600_000_000,
                ..IndexConfig::default()
            },
            ..CoreConfig::default()
        },
        ModelProfile::dynamo_default(),
    );
    core.set_pools(&[CorePool {
        model: "m".into(),
        instances: (0..INSTANCES)
            .map(|i| InstanceSpec {
                name: format!("http://10.0.{}.{}:8000", i / 256, i % 256),
                key: u64::from(i),
            })
            .collect(),
        ..CorePool::default()
    }]);
    let cached = prompts(7);
    let route = |core: &mut RouterCore, keys: &[BlockKey], now: u64| {
        let request = RouteRequest {
            keys,
            prompt_tokens: (keys.len() * 64) as u32,
        };
        if let Ok(d) = core.route("t", &policy, "m", &request, &[], false, now) {
            core.first_token(d.instance, d.uncached_tokens);
            core.finish(d.instance, d.uncached_tokens, true, d.decided_at);
        }
    };
    let t0 = Instant::now();
    for keys in &cached {
        route(&mut core, keys, 1);
    }
    let stats = core.index_stats();
    println!(
        "router core: {} blocks, {} holders over {INSTANCES} instances (filled in {:.1} s)",
        stats.entries,
        stats.holders,
        t0.elapsed().as_secs_f64()
    );

    let core = Arc::new(Mutex::new(core));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let now_us = move || started.elapsed().as_micros() as u64 + 2;

    let flapper = {
        let (core, stop) = (core.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut longest, mut flaps) = (Duration::ZERO, 0u32);
            while !stop.load(Ordering::Relaxed) {
                let victim = InstanceId(flaps % INSTANCES);
                let other = InstanceId((flaps + 128) % INSTANCES);
                let t = Instant::now();
                {
                    let mut c = core.lock().unwrap_or_else(|e| e.into_inner());
                    c.attempt_failed(victim, now_us());
                    c.set_healthy(other, false);
                }
                longest = longest.max(t.elapsed());
                std::thread::sleep(Duration::from_millis(10));
                let t = Instant::now();
                {
                    let mut c = core.lock().unwrap_or_else(|e| e.into_inner());
                    c.attempt_succeeded(victim);
                    c.set_healthy(other, true);
                }
                longest = longest.max(t.elapsed());
                flaps += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            (flaps, longest)
        })
    };
    let scraper = {
        let (core, stop) = (core.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut longest, mut scrapes) = (Duration::ZERO, 0u32);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                {
                    let c = core.lock().unwrap_or_else(|e| e.into_inner());
                    let stats = c.index_stats();
                    let mut sum = stats.holders as u64;
                    for id in c.active_instances() {
                        sum += u64::from(c.cluster_in_flight(id)) + u64::from(c.in_flight(id));
                    }
                    std::hint::black_box(sum);
                }
                longest = longest.max(t.elapsed());
                scrapes += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            (scrapes, longest)
        })
    };

    let mut latencies = Vec::new();
    let mut fresh = Rng::new(99);
    let mut i = 0usize;
    while started.elapsed() < RUN {
        let keys: Vec<BlockKey> = if i.is_multiple_of(2) {
            cached[fresh.below(PROMPTS as u64) as usize].clone()
        } else {
            (0..BLOCKS).map(|_| BlockKey(fresh.next_u64())).collect()
        };
        let t = Instant::now();
        {
            let mut c = core.lock().unwrap_or_else(|e| e.into_inner());
            route(&mut c, &keys, now_us());
        }
        latencies.push(t.elapsed().as_secs_f64() * 1e6);
        i += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let (flaps, flap_hold) = flapper.join().expect("flapper");
    let (scrapes, scrape_hold) = scraper.join().expect("scraper");
    latencies.sort_by(f64::total_cmp);
    println!(
        "routing, {} decisions in {:.1} s, while {flaps} flaps and {scrapes} /metrics reads ran:",
        latencies.len(),
        RUN.as_secs_f64()
    );
    println!(
        "  p50 {:.1} µs  p99 {:.1} µs  p99.9 {:.1} µs  max {:.1} µs",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        percentile(&latencies, 0.999),
        latencies[latencies.len() - 1]
    );
    println!(
        "  longest lock hold: flap {:.1} µs, /metrics read {:.1} µs",
        flap_hold.as_secs_f64() * 1e6,
        scrape_hold.as_secs_f64() * 1e6
    );
    println!(
        "  (machine: {} cores, shared by the three threads)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
}
