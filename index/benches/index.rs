//! Index benchmarks: insert and match on an index of 1M blocks over 256 instances.
//!
//! First a latency report (each call timed on its own, so p99 is real, not a mean), then
//! divan's statistics for the same operations. Run with `cargo bench -p warmpath-index`.
//!
//! The index holds 32,768 prompts of 32 blocks (1,048,576 blocks). A quarter of the
//! prompts share one of 256 eight-block system prompts, so shared nodes exist; each prompt
//! is routed to one instance, and a tenth also to a second one. Queries are 32-block
//! prompts that hit a whole cached prompt (the longest walk) or miss at the first block.

use std::sync::LazyLock;
use std::time::Instant;
use warmpath_index::cost::Tier;
use warmpath_index::index::{IndexConfig, MatchScratch, PrefixIndex};
use warmpath_index::keys::BlockKey;
mod common;
use common::{prompts, BLOCKS, PROMPTS};
use warmpath_index::rng::Rng;
use warmpath_index::InstanceId;

const INSTANCES: u64 = 256;
const NOW: u64 = 1_000;
/// vLLM's default block size, as the prompts are cut.
const BLOCK_TOKENS: u32 = 16;

struct Fixture {
    index: PrefixIndex,
    prompts: Vec<Vec<BlockKey>>,
}

fn build() -> Fixture {
    let prompts = prompts(1);
    let mut index = PrefixIndex::new(IndexConfig {
        capacity_blocks: 1 << 20,
        predicted_ttl_us: u64::MAX / 2,
        ..IndexConfig::default()
    });
    let mut rng = Rng::new(2);
    for keys in &prompts {
        index.record_route(keys, InstanceId(rng.below(INSTANCES) as u32), 0);
        if rng.chance(0.1) {
            // A second holder, observed by an agent, for a realistic mix of holder lists.
            let inst = InstanceId(rng.below(INSTANCES) as u32);
            let mut parent = None;
            for &k in keys {
                index.observe(inst, k, parent, Tier::Gpu, true, 0);
                parent = Some(k);
            }
        }
    }
    Fixture { index, prompts }
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(build);

fn percentile(sorted: &[u64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e3
}

fn latency_report() {
    let started = Instant::now();
    let f = &*FIXTURE;
    let build_s = started.elapsed().as_secs_f64();
    let stats = f.index.stats();
    println!(
        "index: {} entries, {} holders, {} bytes/entry, built in {:.2} s ({:.2} M blocks/s)",
        stats.entries,
        stats.holders,
        stats.bytes_per_entry,
        build_s,
        (PROMPTS * BLOCKS) as f64 / build_s / 1e6
    );
    let mut rng = Rng::new(3);
    let mut scratch = MatchScratch::default();
    let misses = prompts(99);
    for (label, hit) in [
        ("match 32 blocks, full hit", true),
        ("match 32 blocks, miss", false),
    ] {
        let mut samples = Vec::with_capacity(200_000);
        for _ in 0..200_000 {
            let i = rng.below(PROMPTS as u64) as usize;
            let keys = if hit { &f.prompts[i] } else { &misses[i] };
            let t = Instant::now();
            f.index.match_into(keys, BLOCK_TOKENS, NOW, &mut scratch);
            samples.push(t.elapsed().as_nanos() as u64);
            std::hint::black_box(&scratch.result);
        }
        samples.sort_unstable();
        println!(
            "{label}: p50 {:.2} µs, p90 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs over {} calls (target p99 < 5 µs)",
            percentile(&samples, 0.5),
            percentile(&samples, 0.9),
            percentile(&samples, 0.99),
            percentile(&samples, 0.999),
            samples.len()
        );
    }
    // Inserting a routing decision into a full index (evicts to stay at capacity).
    let mut index = build().index;
    let fresh = prompts(7);
    let mut samples = Vec::with_capacity(fresh.len());
    for (i, keys) in fresh.iter().enumerate() {
        let t = Instant::now();
        index.record_route(keys, InstanceId((i as u64 % INSTANCES) as u32), NOW);
        samples.push(t.elapsed().as_nanos() as u64);
    }
    samples.sort_unstable();
    println!(
        "record_route 32 blocks into a full index: p50 {:.2} µs, p99 {:.2} µs over {} calls; {} evictions",
        percentile(&samples, 0.5),
        percentile(&samples, 0.99),
        samples.len(),
        index.stats().evictions
    );
}

fn main() {
    latency_report();
    divan::main();
}

#[divan::bench]
fn match_full_hit(bencher: divan::Bencher) {
    let f = &*FIXTURE;
    let mut rng = Rng::new(5);
    let mut scratch = MatchScratch::default();
    bencher.bench_local(|| {
        let keys = &f.prompts[rng.below(PROMPTS as u64) as usize];
        f.index.match_into(keys, BLOCK_TOKENS, NOW, &mut scratch);
        scratch.result.instances.len()
    });
}

#[divan::bench]
fn record_route_existing(bencher: divan::Bencher) {
    let mut index = build().index;
    let prompts = prompts(1);
    let mut rng = Rng::new(6);
    bencher.bench_local(|| {
        let keys = &prompts[rng.below(PROMPTS as u64) as usize];
        index.record_route(keys, InstanceId(rng.below(INSTANCES) as u32), NOW);
    });
}

/// A fleet-wide system prompt as agents report it: 2,048 tokens (128 blocks of 16 tokens)
/// cached on all of 8,000 instances, each agent reporting one key in 4 (records 0115,
/// 0117), so every reported block has 8,000 observed holders; the query is the prompt and a
/// 1,024-token question. What a match costs when the fleet holds one prefix everywhere.
#[divan::bench]
fn match_prefix_observed_on_8000(bencher: divan::Bencher) {
    let (index, query) = observed_on_8000();
    let mut scratch = MatchScratch::default();
    bencher.bench_local(|| {
        index.match_into(&query, BLOCK_TOKENS, NOW, &mut scratch);
        scratch.result.instances.len()
    });
}

/// Recording a route of that query ([`match_prefix_observed_on_8000`]) on one of the 8,000
/// instances, as every decision does: each of its blocks' holder lists searched for it.
#[divan::bench]
fn record_route_prefix_observed_on_8000(bencher: divan::Bencher) {
    let (mut index, query) = observed_on_8000();
    let mut rng = Rng::new(9);
    bencher.bench_local(|| index.record_route(&query, InstanceId(rng.below(8_000) as u32), NOW));
}

/// kv-aware placing that query ([`match_prefix_observed_on_8000`]) over the 8,000
/// instances, each running 0 to 7 requests and holding 409,600 tokens of GPU KV: the match
/// and the policy's passes over every candidate, as a router's decision makes them.
#[divan::bench]
fn kv_aware_route_prefix_observed_on_8000(bencher: divan::Bencher) {
    use warmpath_index::cost::ModelProfile;
    use warmpath_index::load::LoadView;
    use warmpath_index::policy::{route, PolicyConfig, PolicyState, RouteRequest, Strategy, View};
    let (index, query) = observed_on_8000();
    let mut rng = Rng::new(10);
    let mut load = LoadView::new();
    for i in 0..8_000 {
        for _ in 0..rng.below(8) {
            load.start(InstanceId(i), 1_024);
        }
    }
    let capacity = vec![409_600u64; 8_000];
    let profile = ModelProfile::dynamo_default();
    let view = View {
        index: &index,
        load: &load,
        kv_capacity: &capacity,
        profile: &profile,
        now: NOW,
    };
    let candidates: Vec<InstanceId> = (0..8_000).map(InstanceId).collect();
    let config = PolicyConfig::new(Strategy::KvAware, BLOCK_TOKENS);
    let req = RouteRequest {
        keys: &query,
        prompt_tokens: query.len() as u32 * BLOCK_TOKENS,
    };
    let mut state = PolicyState::new(11);
    bencher.bench_local(|| {
        route(&config, &req, &candidates, &view, &mut state, false)
            .expect("a candidate")
            .instance
    });
}

/// The index and query of [`match_prefix_observed_on_8000`].
fn observed_on_8000() -> (PrefixIndex, Vec<BlockKey>) {
    const FLEET: u32 = 8_000;
    let mut rng = Rng::new(8);
    let every = warmpath_index::keys::report_every(BLOCK_TOKENS);
    let system: Vec<BlockKey> = (0..128).map(|_| BlockKey(rng.next_u64())).collect();
    let mut index = PrefixIndex::new(IndexConfig::default());
    for i in 0..FLEET {
        for &k in system
            .iter()
            .filter(|&&k| warmpath_index::keys::reported(k, every))
        {
            index.observe(InstanceId(i), k, None, Tier::Gpu, true, 0);
        }
    }
    let mut query = system;
    query.extend((0..64).map(|_| BlockKey(rng.next_u64())));
    (index, query)
}

/// A router of a large fleet applying its peers' loads, as the gossip loop does every tick
/// under the routing lock: 127 peers, each publishing its 512 busiest of 8,000 instances
/// (the most a load value carries, membership's `LOAD_MAX_ENTRIES`; a fleet of 100,000
/// requests/s over 128 routers with about two seconds in flight per request keeps about
/// 1,400 instances busy per router).
#[divan::bench]
fn set_peer_loads_127_peers_512_busy_of_8000(bencher: divan::Bencher) {
    use warmpath_index::cost::ModelProfile;
    use warmpath_index::load::InstanceLoad;
    use warmpath_index::router::{CoreConfig, CorePool, InstanceSpec, RouterCore};
    const FLEET: u32 = 8_000;
    let mut core = RouterCore::new(CoreConfig::default(), ModelProfile::dynamo_default());
    core.set_pools(&[CorePool {
        model: "m".into(),
        instances: (0..FLEET)
            .map(|i| InstanceSpec {
                name: format!("i{i}"),
                key: u64::from(i) + 1,
            })
            .collect(),
        ..CorePool::default()
    }]);
    let mut rng = Rng::new(8);
    let peers: Vec<(String, Vec<(u64, InstanceLoad)>)> = (0..127)
        .map(|p| {
            let mut busy: Vec<(u64, InstanceLoad)> = (0..512)
                .map(|_| {
                    let load = InstanceLoad {
                        in_flight: 1 + rng.below(3) as u32,
                        pending_prefill_tokens: rng.below(20_000),
                    };
                    (1 + rng.below(u64::from(FLEET)), load)
                })
                .collect();
            busy.sort_by_key(|(k, _)| *k);
            busy.dedup_by_key(|(k, _)| *k);
            (format!("router-{p}"), busy)
        })
        .collect();
    bencher
        .with_inputs(|| peers.clone())
        .bench_local_values(|peers| core.set_peer_loads(peers));
}

/// The built-in tokenizer on a 32 KB prompt of prose (pseudo-words with commas, full stops
/// and line breaks), what the router tokenizes before routing a long request.
#[divan::bench]
fn tokenize_32k_prose(bencher: divan::Bencher) {
    let mut text = String::new();
    let mut seed = 1;
    while text.len() < 32 * 1024 {
        text.push_str(&warmpath_index::text::words(seed, 12));
        text.push_str(if seed % 3 == 0 { ".\n" } else { "," });
        seed += 1;
    }
    bencher
        .counter(divan::counter::BytesCount::new(text.len()))
        .bench_local(|| warmpath_index::text::tokenize(divan::black_box(&text)));
}

/// A 32 KB prompt's block keys: 8,192 tokens in 64-token blocks, each key the tenant-keyed
/// blake3 of the previous key and the block.
#[divan::bench]
fn block_keys_8192_tokens(bencher: divan::Bencher) {
    let tenant = warmpath_index::keys::TenantKey::derive("bench", "");
    let tokens: Vec<u32> = (0..8192u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 50_000)
        .collect();
    bencher.bench_local(|| {
        warmpath_index::keys::token_block_keys(&tenant, divan::black_box(&tokens), 64)
    });
}
