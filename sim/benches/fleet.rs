//! Fleet-scale growth of residency, gossip and the index (issue 27, part 1), measured with
//! the production cores and multiplied out to fleets that do not fit on one machine.
//!
//! Run with `cargo bench -p warmpath --bench fleet` (environment: `FLEET_WORKLOADS`, a
//! comma-separated list of synthetic workloads, default `chat,conversation,longdoc`;
//! `FLEET_SECONDS`, simulated seconds of arrivals per host sample, default 10;
//! `FLEET_REPS`, repetitions of the latency measurements, default 3;
//! `FLEET_POLICY`, the routers' strategy, default `kv-aware`;
//! `FLEET_SHARED_OBSERVED`, if set, the routing measurements' cores also have the
//! workload's shared prefixes observed on every instance, as agents report them (a system
//! prompt cached fleet-wide);
//! `FLEET_REPORT_EVERY`, the agent reports one block key in this many at every depth;
//! unset, the protocol's rule for its 16-token blocks ([`Reporting::Tokens`], records
//! 0115, 0117 and 0122: one key in 4 for a chain's first 4,096 tokens, fewer past them);
//! 1: every block, as before them);
//! `FLEET_LINK_VERSION`, the residency link's version the stream is encoded for, default
//! the newest (2: deltas as runs of 8-byte keys, record 0123; 1: as before it)).
//!
//! What is measured, and what is multiplied:
//!
//! 1. **One host**, 8 engines of `warmpath_sim`'s engine model (vLLM defaults: 16-token
//!    blocks, 25,600 GPU blocks each, no L1), fed a synthetic workload at the host's share
//!    of the fleet rate (R / hosts) and placed on its engines by a production
//!    [`RouterCore`] (kv-aware, observing the engines exactly). Every `Stored`/`Removed`
//!    block event goes into the production residency [`Publisher`] as the agent records
//!    it, one delta per engine step (the agent sends a delta as soon as its engines report
//!    a batch), each encoded with [`warmpath_residency::encode`] as the QUIC stream carries
//!    it. Measured: block events/s, the changes the publisher reports of them (one key in
//!    `FLEET_REPORT_EVERY`), deltas/s and encoded bytes/s of one agent's stream, and the
//!    blocks the host holds at the end.
//! 2. **Residency, multiplied**: with every router following every agent, a router's
//!    inbound = hosts × one agent's stream, its changes applied/s = hosts × reported
//!    changes/s, and an agent's outbound = routers × its stream (the same bytes on each
//!    link); with each agent followed by 4 routers (record 0111, the default), a router's
//!    inbound is that × 4 / routers and an agent's outbound 4 streams.
//! 3. **Gossip**: one production [`RouterCore`] with sharing on routes the workload; its
//!    outbox, every 50 ms of simulated time, goes through the production [`Batcher`]
//!    (8 KiB batches) and [`BatchWire`] encoding (postcard + base64, as stored in
//!    chitchat). Measured: encoded bytes per routed request. Multiplied: a router
//!    publishes R / routers requests' worth; chitchat must deliver every other router's
//!    values to it, so its inbound is at least (routers − 1) / routers × R × bytes, and
//!    what it forwards of others' state makes its outbound about the same on average; on
//!    top, each gossip round (50 ms) sends a digest of every node (about 60 bytes per
//!    node) to 3 peers and gets one back: 2 × 3 × 20/s × 60 B × routers.
//! 4. **Index memory**: one [`RouterCore`] with 8 × hosts instances whose index is filled
//!    to its capacity (the default, 2^20 blocks) with observed chains spread over the
//!    instances; `bytes_per_entry` is the index's own estimate (the figure behind
//!    `warmpath_index_bytes_per_entry`). Multiplied: the blocks the fleet holds (hosts ×
//!    a host's blocks from 1.) × bytes per entry is what an index of every block needs.
//! 5. **Routing latency**: on that filled core (a fresh copy for every measurement: routes
//!    leave predictions and applies evict), route calls timed one by one, each taking the
//!    core's lock: alone, interleaved on the same thread with `observe` calls at the ratio
//!    a router of the fleet sees (events applied/s ÷ its requests/s, capped), and beside a
//!    second thread that applies events as the router's residency task does
//!    (a batch every 1 ms, the lock handed to a waiting route between steps,
//!    [`apply_in_steps`]) at 0, the worst row's rate and about 1 M/s,
//!    with the routes back to back (the lock always busy with them) and paced at half that
//!    rate (busy half the time, as the capacity model sizes routers);
//!    medians of `FLEET_REPS` repetitions of p50/p99, and of the p99 of each route's wait
//!    for the lock alone. Also the cost of one `observe`, hence the share of a core that
//!    applying the fleet's residency takes. `FLEET_PIN=1` runs the routes on CPU 0 and the
//!    applier on CPU 1 (`sched_setaffinity`), so that the two threads share the lock and
//!    memory but not a core: what the lock costs, apart from two threads on two cores
//!    shared with everything else. `FLEET_LOCK=std` puts the core behind std's
//!    mutex taken for 256 events at a time, as the router did before it handed the lock over.
//!
//! Nothing here asserts a timing: it prints what it measured, on what, and how often.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::io::Write as _;
use warmpath_index::cost::{ModelProfile, Tier};
use warmpath_index::index::IndexConfig;
use warmpath_index::keys::{BlockKey, Reporting};
use warmpath_index::policy::{PolicyConfig, RouteRequest, Strategy};
use warmpath_index::rng::Rng;
use warmpath_index::router::{CoreConfig, CorePool, InstanceSpec, RouterCore};
use warmpath_index::InstanceId;
use warmpath_residency::steps::{apply_in_steps, APPLY_STEP, SHARE};
use warmpath_residency::{encode, Change, Msg, Publisher, Scope, Wire, LINK_VERSION};
use warmpath_sim::engine::{Engine, EngineConfig, EngineEvent, EngineRequest};
use warmpath_sim::tiers::TierSet;
use warmpath_sim::workload::synthetic::{generate_workload, SyntheticKind, SyntheticParams};
use warmpath_sim::workload::Workload;

const ENGINES_PER_HOST: u32 = 8;
const BLOCK_TOKENS: u32 = 16;
const ROUTERS: [u64; 4] = [8, 32, 64, 128];
const HOSTS: [u64; 3] = [100, 300, 1000];
const FLEET_RATES: [f64; 2] = [10_000.0, 100_000.0];
const MODEL: &str = "m";
/// Routers following each agent (record 0111's default).
const FOLLOWERS: f64 = 4.0;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn kind_of(name: &str) -> SyntheticKind {
    match name {
        "chat" => SyntheticKind::Chat,
        "bots" => SyntheticKind::Bots,
        "rag" => SyntheticKind::Rag,
        "code" => SyntheticKind::Code,
        "conversation" => SyntheticKind::Conversation,
        "longdoc" => SyntheticKind::Longdoc,
        other => panic!("unknown workload {other}"),
    }
}

fn workload(kind: SyntheticKind, rate: f64, seconds: f64, seed: u64) -> Workload {
    let params = SyntheticParams {
        rate_per_s: rate,
        requests: (rate * seconds).ceil().max(1.0) as u32,
        seed,
        ..SyntheticParams::default()
    };
    generate_workload(kind, &params, BLOCK_TOKENS)
}

fn core(instances: u32, sharing: bool) -> RouterCore {
    let mut core = RouterCore::new(
        CoreConfig {
            index: IndexConfig::default(),
            seed: 7,
            ..CoreConfig::default()
        },
        ModelProfile::dynamo_default(),
    );
    core.set_pools(&[CorePool {
        model: MODEL.into(),
        instances: (0..instances)
            .map(|i| InstanceSpec {
                name: format!("i{i}"),
                key: u64::from(i) + 1,
            })
            .collect(),
        ..CorePool::default()
    }]);
    let engine = EngineConfig::default();
    for i in 0..instances {
        core.set_kv_capacity(
            InstanceId(i),
            u64::from(engine.gpu_blocks) * u64::from(engine.block_tokens),
        );
        core.set_observed(InstanceId(i), true);
    }
    if sharing {
        core.enable_sharing();
    }
    core
}

/// The routers' policy: `FLEET_POLICY` (a strategy's name), kv-aware by default.
fn policy() -> PolicyConfig {
    static STRATEGY: std::sync::OnceLock<Strategy> = std::sync::OnceLock::new();
    let strategy = *STRATEGY.get_or_init(|| {
        std::env::var("FLEET_POLICY")
            .ok()
            .map(|s| s.parse().expect("FLEET_POLICY names a strategy"))
            .unwrap_or(Strategy::KvAware)
    });
    PolicyConfig::new(strategy, BLOCK_TOKENS)
}

/// One agent's stream, measured on one host of 8 engines.
#[derive(Clone, Copy, Debug, Default)]
struct HostSample {
    host_rate: f64,
    completed: u64,
    stored_per_s: f64,
    removed_per_s: f64,
    /// Of the block events, the changes the publisher reported (stores, removals).
    reported_stored_per_s: f64,
    reported_removed_per_s: f64,
    deltas_per_s: f64,
    bytes_per_s: f64,
    /// Bytes per reported change, deltas' headers included.
    bytes_per_event: f64,
    /// Blocks the host's engines hold at the end.
    held: usize,
}

impl HostSample {
    /// Changes and bytes per second of the agent's stream in steady state: every block
    /// stored is removed again, so a host's changes are at least twice its stores (the short
    /// sample fills caches that have not begun to evict).
    fn steady_stream(&self) -> (f64, f64) {
        let changes = (self.reported_stored_per_s + self.reported_removed_per_s)
            .max(2.0 * self.reported_stored_per_s);
        (changes, changes * self.bytes_per_event)
    }
}

/// The sample taken at host rate `host_rate`.
fn sample_at(samples: &[HostSample], host_rate: f64) -> HostSample {
    *samples
        .iter()
        .find(|s| (s.host_rate - host_rate).abs() < 1e-9)
        .expect("sampled")
}

/// Runs one host's engines on `w` for `seconds` of simulated time.
fn sample_host(
    w: &Workload,
    host_rate: f64,
    seconds: f64,
    rule: Reporting,
    link: u8,
) -> HostSample {
    let cfg = EngineConfig::default();
    let profile = ModelProfile::dynamo_default();
    let mut engines: Vec<Engine> = (0..ENGINES_PER_HOST)
        .map(|_| Engine::new(cfg.clone(), profile.clone()))
        .collect();
    let mut router = core(ENGINES_PER_HOST, false);
    let mut l2 = TierSet::lru(0);
    let mut publisher =
        Publisher::new(1, (0..ENGINES_PER_HOST).map(|i| format!("i{i}")).collect()).reporting(rule);
    let parents: std::collections::HashMap<BlockKey, BlockKey> = w
        .requests
        .iter()
        .flat_map(|r| r.keys.windows(2).map(|p| (p[1], p[0])))
        .collect();
    // (time, engine) of step ends; arrivals are walked in order beside it.
    let mut steps: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
    let end_us = (seconds * 1e6) as u64;
    let mut next_arrival = 0usize;
    let mut events = Vec::new();
    let mut pending: Vec<(u32, u32, u64)> = vec![(0, 0, 0); w.requests.len()];
    let (mut stored, mut removed, mut deltas, mut bytes, mut completed) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut reported_stored, mut reported_removed) = (0u64, 0u64);
    loop {
        let arrival = w.requests.get(next_arrival).map(|r| r.arrival_us);
        let step = steps.peek().map(|Reverse((t, _))| *t);
        let take_arrival = match (arrival, step) {
            (Some(a), Some(s)) => a <= s,
            (Some(_), None) => true,
            (None, _) => false,
        };
        let (now, inst) = match (arrival, step) {
            (Some(a), _) if take_arrival => {
                let i = next_arrival;
                next_arrival += 1;
                let req = &w.requests[i];
                let rr = RouteRequest {
                    keys: &req.keys,
                    prompt_tokens: req.prompt_tokens,
                };
                let d = router
                    .route("t", &policy(), MODEL, &rr, &[], false, a)
                    .expect("pool has instances");
                let inst = d.instance.0;
                pending[i] = (inst, d.uncached_tokens, d.decided_at);
                let e = &mut engines[inst as usize];
                e.submit(
                    a,
                    EngineRequest {
                        id: i as u64,
                        keys: req.keys.clone(),
                        prompt_tokens: req.prompt_tokens,
                        output_tokens: req.output_tokens,
                        offered: Vec::new(),
                        offered_from: 0,
                    },
                );
                if !e.step_running() {
                    if let Some(t) = e.start_step(a, &mut l2, &mut events) {
                        steps.push(Reverse((t, inst)));
                    }
                }
                (a, inst)
            }
            (_, Some(_)) => {
                let Reverse((t, inst)) = steps.pop().expect("peeked");
                let e = &mut engines[inst as usize];
                e.complete_step(t, &mut l2, &mut events);
                if let Some(next) = e.start_step(t, &mut l2, &mut events) {
                    steps.push(Reverse((next, inst)));
                }
                (t, inst)
            }
            _ => break,
        };
        if now > end_us {
            break;
        }
        let mut changed = false;
        for ev in events.drain(..) {
            match ev {
                EngineEvent::Stored { key, tier } | EngineEvent::Removed { key, tier } => {
                    let present = matches!(ev, EngineEvent::Stored { .. });
                    let scope = match tier {
                        Tier::Gpu => Scope::Gpu(inst as u16),
                        Tier::L1 => Scope::L1,
                        Tier::L2 => Scope::L2,
                    };
                    if present {
                        stored += 1;
                    } else {
                        removed += 1;
                    }
                    publisher.record(Change {
                        scope,
                        key: key.0,
                        parent: parents.get(&key).map(|p| p.0),
                        present,
                    });
                    router.observe(
                        InstanceId(inst),
                        key,
                        parents.get(&key).copied(),
                        tier,
                        present,
                        now,
                    );
                    changed = true;
                }
                EngineEvent::FirstToken { id, .. } => {
                    let (i, p, _) = pending[id as usize];
                    router.first_token(InstanceId(i), p);
                }
                EngineEvent::Finished { id, .. } | EngineEvent::Rejected { id, .. } => {
                    let (i, p, at) = pending[id as usize];
                    router.finish(
                        InstanceId(i),
                        p,
                        matches!(ev, EngineEvent::Finished { .. }),
                        at,
                    );
                    completed += 1;
                }
                EngineEvent::Token { .. } => {}
            }
        }
        if changed {
            for m in publisher.next_all(false, now / 1000) {
                if let Msg::Delta { changes, .. } = &m {
                    let n = changes.iter().filter(|c| c.present).count() as u64;
                    reported_stored += n;
                    reported_removed += changes.len() as u64 - n;
                }
                deltas += 1;
                bytes += encode(&Wire::for_link(m, link)).len() as u64;
            }
        }
    }
    HostSample {
        host_rate,
        completed,
        stored_per_s: stored as f64 / seconds,
        removed_per_s: removed as f64 / seconds,
        reported_stored_per_s: reported_stored as f64 / seconds,
        reported_removed_per_s: reported_removed as f64 / seconds,
        deltas_per_s: deltas as f64 / seconds,
        bytes_per_s: bytes as f64 / seconds,
        bytes_per_event: bytes as f64 / (reported_stored + reported_removed).max(1) as f64,
        held: (stored - removed) as usize,
    }
}

/// What one router's outbox holds for its peers, as (arrival µs, instance key, keys) per
/// shared decision, written to `path` for `cargo bench -p warmpath-membership --bench
/// fleet_gossip`, which encodes them with the production batcher. Returns the share of
/// requests that shared a decision and the mean keys per shared decision.
fn record_outbox(w: &Workload, path: &str) -> (f64, f64) {
    let mut router = core(64, true);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).expect("writable"));
    let (mut shared, mut keys) = (0u64, 0u64);
    let mut inflight: VecDeque<(u32, u32, u64)> = VecDeque::new();
    for r in &w.requests {
        let rr = RouteRequest {
            keys: &r.keys,
            prompt_tokens: r.prompt_tokens,
        };
        let d = router
            .route("t", &policy(), MODEL, &rr, &[], false, r.arrival_us)
            .expect("pool has instances");
        for sd in router.take_outbox().0 {
            shared += 1;
            keys += sd.keys.len() as u64;
            let ks: Vec<String> = sd.keys.iter().map(|k| k.0.to_string()).collect();
            writeln!(out, "{} {} {}", r.arrival_us, sd.instance, ks.join(",")).expect("written");
        }
        inflight.push_back((d.instance.0, d.uncached_tokens, d.decided_at));
        if inflight.len() > 256 {
            let (i, p, at) = inflight.pop_front().expect("non-empty");
            router.finish(InstanceId(i), p, true, at);
        }
    }
    let n = w.requests.len().max(1) as f64;
    (shared as f64 / n, keys as f64 / shared.max(1) as f64)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A core of `instances` whose index is filled to capacity with observed chains of 32
/// blocks on random instances; returns it and the index's bytes per entry.
fn filled_core(instances: u32, rng: &mut Rng) -> (RouterCore, usize, usize) {
    let mut c = core(instances, true);
    let cap = IndexConfig::default().capacity_blocks;
    let mut n = 0usize;
    while n < cap {
        let inst = InstanceId(rng.below(u64::from(instances)) as u32);
        let mut parent = None;
        for _ in 0..32 {
            let key = BlockKey(rng.next_u64());
            c.observe(inst, key, parent, Tier::Gpu, true, 0);
            parent = Some(key);
            n += 1;
        }
    }
    let s = c.index_stats();
    (c, s.bytes_per_entry, s.entries)
}

/// The prefixes several of `w`'s requests share (a system prompt, a template): for each first
/// block, the longest prefix two or more requests starting with it have in common.
fn shared_prefixes(w: &Workload) -> Vec<Vec<BlockKey>> {
    let mut by_first: std::collections::BTreeMap<BlockKey, Vec<&[BlockKey]>> = Default::default();
    for r in &w.requests {
        if let Some(&first) = r.keys.first() {
            by_first.entry(first).or_default().push(&r.keys);
        }
    }
    by_first
        .values()
        .filter(|group| group.len() >= 2)
        .map(|group| {
            let common = group[1..].iter().fold(group[0].len(), |n, ks| {
                n.min(ks.iter().zip(group[0]).take_while(|(a, b)| a == b).count())
            });
            group[0][..common].to_vec()
        })
        .collect()
}

/// The routing core behind the router's lock: parking_lot's mutex, which the residency
/// task holds through a batch and hands to a waiting route between steps of
/// [`APPLY_STEP`] events ([`apply_in_steps`]). `FLEET_LOCK=std`: the router's lock before that, std's
/// mutex taken for [`STD_CHUNK`] events at a time and let go without a hand-over, so the
/// applier often takes it straight back before the route it woke runs.
enum CoreLock {
    Std(std::sync::Mutex<RouterCore>),
    Router(parking_lot::Mutex<RouterCore>),
}

/// Events per hold of the lock under `FLEET_LOCK=std`, as the router applied them then.
const STD_CHUNK: usize = 256;

enum CoreGuard<'a> {
    Std(std::sync::MutexGuard<'a, RouterCore>),
    Router(parking_lot::MutexGuard<'a, RouterCore>),
}

impl CoreLock {
    fn new(core: RouterCore) -> CoreLock {
        if std_lock() {
            CoreLock::Std(std::sync::Mutex::new(core))
        } else {
            CoreLock::Router(parking_lot::Mutex::new(core))
        }
    }

    fn lock(&self) -> CoreGuard<'_> {
        match self {
            CoreLock::Std(m) => CoreGuard::Std(m.lock().unwrap_or_else(|e| e.into_inner())),
            CoreLock::Router(m) => CoreGuard::Router(m.lock()),
        }
    }

    /// Applies `events` as the router's residency task applies a batch of changes.
    fn apply(&self, events: &[(InstanceId, BlockKey)]) {
        let observe = |core: &mut RouterCore, step: &[(InstanceId, BlockKey)]| {
            for &(inst, key) in step {
                core.observe(inst, key, None, Tier::Gpu, true, 1_000_000);
            }
        };
        match self {
            CoreLock::Std(m) => {
                for chunk in events.chunks(STD_CHUNK) {
                    observe(&mut m.lock().unwrap_or_else(|e| e.into_inner()), chunk);
                }
            }
            CoreLock::Router(m) => {
                apply_in_steps(&mut m.lock(), events, |core, step| {
                    observe(core, step);
                    step.len()
                });
            }
        }
    }
}

fn std_lock() -> bool {
    std::env::var("FLEET_LOCK").as_deref() == Ok("std")
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = RouterCore;
    fn deref(&self) -> &RouterCore {
        match self {
            CoreGuard::Std(g) => g,
            CoreGuard::Router(g) => g,
        }
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut RouterCore {
        match self {
            CoreGuard::Std(g) => g,
            CoreGuard::Router(g) => g,
        }
    }
}

/// Route latencies (µs) on `c`: medians over the repetitions of p50, p99 and the p99 of
/// the wait for the lock alone.
struct Latency {
    p50: f64,
    p99: f64,
    wait_p99: f64,
}

/// [`Latency`] of route calls on `c`, each preceded by `applies` observe calls, and ns per
/// observe. Each route takes `c`'s lock as the router's request path does, and its time
/// includes the wait for it (see [`route_latency_beside`]). Back to back, or one every
/// `pace` (a router's requests arrive with gaps between them, in which others may hold
/// the lock).
fn route_latency(
    c: &CoreLock,
    w: &Workload,
    instances: u32,
    applies: usize,
    pace: Option<Duration>,
    reps: usize,
    rng: &mut Rng,
) -> (Latency, f64) {
    let lock = || c.lock();
    let routes = if applies > 0 { 1500 } else { 5000 };
    let (mut p50s, mut p99s, mut per_apply) = (Vec::new(), Vec::new(), Vec::new());
    let mut wait_p99s = Vec::new();
    let mut now = 1_000_000u64;
    for _ in 0..reps {
        let mut lat = Vec::with_capacity(routes);
        let mut waits = Vec::with_capacity(routes);
        let mut apply_ns = 0f64;
        let mut inflight: VecDeque<(u32, u32, u64)> = VecDeque::new();
        let start = Instant::now();
        for i in 0..routes {
            if let Some(pace) = pace {
                let at = start + pace * i as u32;
                while let Some(left) = at.checked_duration_since(Instant::now()) {
                    if left > Duration::from_micros(200) {
                        std::thread::sleep(left - Duration::from_micros(100));
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
            let r = &w.requests[i % w.requests.len()];
            now += 100;
            if applies > 0 {
                let t = Instant::now();
                let mut c = lock();
                for _ in 0..applies {
                    let inst = InstanceId(rng.below(u64::from(instances)) as u32);
                    let key = BlockKey(rng.next_u64());
                    c.observe(inst, key, None, Tier::Gpu, true, now);
                }
                apply_ns += t.elapsed().as_nanos() as f64;
            }
            let rr = RouteRequest {
                keys: &r.keys,
                prompt_tokens: r.prompt_tokens,
            };
            let t = Instant::now();
            let mut core = lock();
            waits.push(t.elapsed().as_nanos() as f64 / 1e3);
            let d = core
                .route("t", &policy(), MODEL, &rr, &[], false, now)
                .expect("pool has instances");
            drop(core);
            lat.push(t.elapsed().as_nanos() as f64 / 1e3);
            inflight.push_back((d.instance.0, d.uncached_tokens, d.decided_at));
            if inflight.len() > 512 {
                let (i, p, at) = inflight.pop_front().expect("non-empty");
                lock().finish(InstanceId(i), p, true, at);
            }
        }
        let _ = lock().take_outbox();
        lat.sort_by(f64::total_cmp);
        waits.sort_by(f64::total_cmp);
        p50s.push(percentile(&lat, 0.5));
        p99s.push(percentile(&lat, 0.99));
        wait_p99s.push(percentile(&waits, 0.99));
        per_apply.push(apply_ns / (routes * applies.max(1)) as f64);
    }
    let latency = Latency {
        p50: median(p50s),
        p99: median(p99s),
        wait_p99: median(wait_p99s),
    };
    (latency, median(per_apply))
}

/// Runs the calling thread on `cpu` alone where `FLEET_PIN=1` (and the machine has it).
fn pin_to(cpu: usize) {
    if std::env::var("FLEET_PIN").as_deref() != Ok("1") {
        return;
    }
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        eprintln!("FLEET_PIN: cannot pin to CPU {cpu}: {e}");
    }
}

/// [`route_latency`] on one thread while another applies `events_per_s` residency events
/// to `c` as the router's residency task does ([`CoreLock::apply`]), in a batch every 1 ms. Returns the routes' [`Latency`] and the events applied per second.
fn route_latency_beside(
    c: &CoreLock,
    w: &Workload,
    instances: u32,
    events_per_s: f64,
    pace: Option<Duration>,
    reps: usize,
    rng: &mut Rng,
) -> (Latency, f64) {
    let stop = AtomicBool::new(false);
    let applied = AtomicU64::new(0);
    let started = Instant::now();
    let latency = std::thread::scope(|s| {
        s.spawn(|| {
            pin_to(1);
            let mut rng = Rng::new(99);
            let mut owed = 0.0;
            let mut step = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                owed += events_per_s * step.elapsed().as_secs_f64();
                step = Instant::now();
                let n = owed as usize;
                let events: Vec<(InstanceId, BlockKey)> = (0..n)
                    .map(|_| {
                        let inst = InstanceId(rng.below(u64::from(instances)) as u32);
                        (inst, BlockKey(rng.next_u64()))
                    })
                    .collect();
                c.apply(&events);
                owed -= n as f64;
                applied.fetch_add(n as u64, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let (latency, _) = route_latency(c, w, instances, 0, pace, reps, rng);
        stop.store(true, Ordering::Relaxed);
        latency
    });
    let rate = applied.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    (latency, rate)
}

fn kb(b: f64) -> String {
    if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} KB", b / 1e3)
    }
}

fn main() {
    let workloads: String = env_or("FLEET_WORKLOADS", "chat,conversation,longdoc".to_string());
    let seconds: f64 = env_or("FLEET_SECONDS", 10.0);
    let reps: usize = env_or("FLEET_REPS", 3);
    let rule = std::env::var("FLEET_REPORT_EVERY")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Reporting::Tokens(BLOCK_TOKENS), Reporting::Every);
    let link: u8 = env_or("FLEET_LINK_VERSION", LINK_VERSION);
    let every = match rule {
        Reporting::Every(n) => format!("one key in {n}"),
        Reporting::Tokens(_) => format!(
            "the protocol's keys (one in {} for a chain's first 4,096 tokens, fewer past them)",
            rule.base()
        ),
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "fleet bench: {cores} CPUs visible, load average {}, {} simulated s per host sample, {reps} latency repetitions",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        seconds
    );
    println!(
        "engine model: {ENGINES_PER_HOST} engines per host, vLLM defaults ({BLOCK_TOKENS}-token blocks, 25,600 GPU blocks, no L1), kv-aware placement inside the host; agents report {every}, encoded as version {link} of the link carries them"
    );
    let mut lat_workload = None;
    let mut worst: Option<(String, f64, f64)> = None;
    for name in workloads.split(',').filter(|s| !s.is_empty()) {
        let kind = kind_of(name);
        println!("\n## workload {name}");
        // Host rates: the fleet rates spread over the host counts.
        let mut host_rates: Vec<f64> = FLEET_RATES
            .iter()
            .flat_map(|r| HOSTS.iter().map(move |h| r / *h as f64))
            .collect();
        host_rates.sort_by(f64::total_cmp);
        host_rates.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
        let mut samples = Vec::new();
        println!("\n### one agent (8 engines), measured");
        println!("| host req/s | completed | stored/s | removed/s | reported stored/s | reported removed/s | deltas/s | bytes/s | B/reported | blocks held | wall s |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for &hr in &host_rates {
            let w = workload(kind, hr, seconds, 5);
            let t = Instant::now();
            let s = sample_host(&w, hr, seconds, rule, link);
            println!(
                "| {hr:.0} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.1} | {} | {:.1} |",
                s.completed,
                s.stored_per_s,
                s.removed_per_s,
                s.reported_stored_per_s,
                s.reported_removed_per_s,
                s.deltas_per_s,
                kb(s.bytes_per_s),
                s.bytes_per_event,
                s.held,
                t.elapsed().as_secs_f64()
            );
            samples.push(s);
        }
        let w = workload(kind, 1000.0, 5.0, 9);
        let path = format!("{}/fleet-outbox-{name}.txt", std::env::temp_dir().display());
        let (shared, mean_keys) = record_outbox(&w, &path);
        let gossip_b: f64 = env_or(&format!("FLEET_GOSSIP_BYTES_{}", name.to_uppercase()), 0.0);
        println!(
            "\ngossip: {:.0}% of {} requests shared a decision, {mean_keys:.1} keys each; outbox written to {path}; encoded bytes per request (from `cargo bench -p warmpath-membership --bench fleet_gossip`, given as FLEET_GOSSIP_BYTES_{}): {gossip_b:.1}",
            shared * 100.0,
            w.requests.len(),
            name.to_uppercase()
        );
        println!(
            "\n### per router and per agent, multiplied out (every router follows every agent)"
        );
        println!("| fleet req/s | hosts | routers | residency in / router | events applied/s / router | agent out | gossip out / router (own) | gossip in / router (≥) | digests / router |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for &rate in &FLEET_RATES {
            for &hosts in &HOSTS {
                let s = sample_at(&samples, rate / hosts as f64);
                for &routers in &ROUTERS {
                    let n = routers as f64;
                    let (host_events, host_bytes) = s.steady_stream();
                    let res_in = hosts as f64 * host_bytes;
                    let events = hosts as f64 * host_events;
                    let agent_out = n * host_bytes;
                    let own = rate / n * gossip_b;
                    let gin = (n - 1.0) / n * rate * gossip_b;
                    let digests = 2.0 * 3.0 * 20.0 * 60.0 * n;
                    println!(
                        "| {rate:.0} | {hosts} | {routers} | {}/s | {:.2} M | {}/s | {}/s | {}/s | {}/s |",
                        kb(res_in),
                        events / 1e6,
                        kb(agent_out),
                        kb(own),
                        kb(gin),
                        kb(digests)
                    );
                    let ratio = events / (rate / n);
                    if worst.as_ref().is_none_or(|(_, _, r)| ratio > *r) {
                        worst = Some((
                            format!("{name} {rate:.0} req/s, {hosts} hosts, {routers} routers"),
                            events,
                            ratio,
                        ));
                    }
                }
            }
        }
        println!(
            "\n### residency with each agent followed by {FOLLOWERS} routers (record 0111's default), multiplied out"
        );
        println!("| fleet req/s | hosts | in / router at 8 · 32 · 64 · 128 routers | changes applied/s / router at 128 | agent out (any router count) |");
        println!("|---:|---:|---|---:|---:|");
        for &rate in &FLEET_RATES {
            for &hosts in &HOSTS {
                let (host_events, host_bytes) =
                    sample_at(&samples, rate / hosts as f64).steady_stream();
                let share = |routers: u64| hosts as f64 * FOLLOWERS / routers as f64;
                let ins: Vec<String> = ROUTERS
                    .iter()
                    .map(|&r| format!("{:.2} MB/s", share(r) * host_bytes / 1e6))
                    .collect();
                println!(
                    "| {rate:.0} | {hosts} | {} | {:.3} M | {}/s |",
                    ins.join(" · "),
                    share(128) * host_events / 1e6,
                    kb(FOLLOWERS * host_bytes)
                );
            }
        }
        let s = samples.last().copied().unwrap_or_default();
        println!("\nindex of every block: at {} hosts a router indexes {:.1} M (instance, block) pairs (hosts × {} blocks per host)", 1000, 1000.0 * s.held as f64 / 1e6, s.held);
        if lat_workload.is_none() {
            lat_workload = Some(workload(kind, 1000.0, 5.0, 13));
        }
    }
    let w = lat_workload.expect("one workload");
    println!(
        "\n## index memory and routing latency ({}, index filled to its default capacity of 2^20 blocks)",
        policy().strategy
    );
    println!("| instances | entries | bytes/entry | index MB | observe ns | route p50 µs | route p99 µs | applies per route | p50 µs loaded | p99 µs loaded | cores to apply the worst row's events |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let (_, worst_events, ratio) = worst.clone().expect("rows");
    // Every measurement starts from the same filled index and routes the same requests: a
    // route leaves predictions behind and an apply evicts, so a core measured twice is not
    // the same core twice.
    let observed_everywhere = std::env::var_os("FLEET_SHARED_OBSERVED").is_some();
    let shared = shared_prefixes(&w);
    if observed_everywhere {
        println!(
            "(FLEET_SHARED_OBSERVED: the workload's {} shared prefixes, {} blocks in all, observed on every instance, {every}, as agents report them)",
            shared.len(),
            shared.iter().map(Vec::len).sum::<usize>()
        );
    }
    let fresh = |instances| {
        let (mut c, bpe, entries) = filled_core(instances, &mut Rng::new(11));
        if observed_everywhere {
            for prefix in &shared {
                let reported = prefix
                    .iter()
                    .enumerate()
                    .filter(|&(d, &k)| rule.reported(k, Some(d as u32 + 1)));
                for (_, &key) in reported {
                    for i in 0..instances {
                        c.observe(InstanceId(i), key, None, Tier::Gpu, true, 0);
                    }
                }
            }
        }
        (CoreLock::new(c), bpe, entries)
    };
    let mut alone = Vec::new();
    for hosts in HOSTS {
        let instances = (hosts * u64::from(ENGINES_PER_HOST)) as u32;
        let (c, bpe, entries) = fresh(instances);
        let (Latency { p50, p99, .. }, _) =
            route_latency(&c, &w, instances, 0, None, reps, &mut Rng::new(12));
        // The worst ratio of events applied per routed request among the rows, capped so
        // a repetition stays within seconds.
        let applies = (ratio.round() as usize).clamp(1, 200);
        let (c, _, _) = fresh(instances);
        let (loaded, ns) = route_latency(&c, &w, instances, applies, None, reps, &mut Rng::new(12));
        let (lp50, lp99) = (loaded.p50, loaded.p99);
        println!(
            "| {instances} | {entries} | {bpe} | {:.0} | {ns:.0} | {p50:.1} | {p99:.1} | {applies} | {lp50:.1} | {lp99:.1} | {:.2} cores |",
            (entries * bpe) as f64 / 1e6,
            worst_events * ns * 1e-9
        );
        alone.push((instances, p50, p99));
    }
    // As a router runs them: the residency task on its own thread, handing the routing
    // lock to a waiting route between steps (apply_in_steps), beside the routes (0 events/s: the
    // harness alone).
    let pinned = std::env::var("FLEET_PIN").as_deref() == Ok("1");
    println!(
        "\n## routing beside a residency task on another thread ({}{})",
        if std_lock() {
            format!("FLEET_LOCK=std: std's mutex, {STD_CHUNK} events per hold, no hand-over")
        } else {
            format!("the router's lock: handed to a waiting route between steps of {APPLY_STEP} events, the applier keeping at least 1/{} of it", SHARE + 1)
        },
        if pinned {
            "; routes on CPU 0, the applier on CPU 1"
        } else {
            ""
        }
    );
    println!("Routes back to back (the lock busy with routes, as a saturated router's is) and paced at half that rate (busy half the time: the capacity model's sizing).");
    println!("| instances | routes | events applied/s | route p50 µs | route p99 µs | lock wait p99 µs | alone p50 µs | alone p99 µs | p99 beside / alone |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    pin_to(0);
    for &(instances, p50, _) in &alone {
        for (routes, pace) in [
            ("back to back", None),
            ("paced", Some(Duration::from_secs_f64(2.0 * p50 * 1e-6))),
        ] {
            // Alone again here, pinned and paced as the routes beside the applier are.
            let (c, _, _) = fresh(instances);
            let (solo, _) = route_latency(&c, &w, instances, 0, pace, reps, &mut Rng::new(12));
            for events in [0.0, worst_events.min(1e6), 1e6] {
                let (c, _, _) = fresh(instances);
                let (beside, rate) =
                    route_latency_beside(&c, &w, instances, events, pace, reps, &mut Rng::new(12));
                println!(
                    "| {instances} | {routes} | {:.2} M | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
                    rate / 1e6,
                    beside.p50,
                    beside.p99,
                    beside.wait_p99,
                    solo.p50,
                    solo.p99,
                    beside.p99 / solo.p99
                );
            }
        }
    }
    if let Some((row, events, ratio)) = worst {
        println!("\nworst events applied per routed request: {ratio:.0} ({row}, {:.2} M events/s into one router); the loaded runs cap it at 200 per route", events / 1e6);
    }
}
