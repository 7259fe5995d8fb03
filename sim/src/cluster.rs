//! The discrete-event cluster simulator: router replicas, engines, agents' residency
//! feed, on a virtual clock.
//!
//! A load balancer spreads requests across `routers` replicas at random. Each replica is
//! a [`RouterCore`], the live router's own decision path, called on the virtual clock; the
//! chosen engine (an [`Engine`], one per instance, one instance per host) runs the
//! request. What a replica learns of other replicas' decisions depends on [`Sharing`];
//! what it learns of real cache contents comes from the agents' feed, when enabled: each
//! host's agent records its engine's block events in the residency session's
//! [`Publisher`], every replica follows every agent with a [`Subscriber`] (the same state
//! machines the live agent and router run), and each delta reaches the replicas
//! `agent_feed_delay_us` after the engine step that produced it. Load is exact per
//! replica for its own requests; in shared modes replicas also see the others' (the
//! cluster publishes it), in isolated mode they do not.
//!
//! Same configuration, same workload, same seed: same report, bit for bit. Event ties are
//! broken by insertion order, never by a hash map's iteration order.

use crate::engine::{Engine, EngineConfig, EngineEvent, EngineRequest};
use crate::stats::Samples;
use crate::tiers::TierSet;
use crate::workload::Workload;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::rc::Rc;
use warmpath_index::cost::{ModelProfile, Tier};
use warmpath_index::index::IndexConfig;
use warmpath_index::keys::BlockKey;
use warmpath_index::policy::{Decision, PolicyConfig, RouteRequest};
use warmpath_index::rng::Rng;
use warmpath_index::router::{
    CacheReport, CoreConfig, CorePool, InstanceSpec, RouterCore, SharedDecision,
};
use warmpath_index::InstanceId;
use warmpath_residency::{Change, Msg, Outcome, Publisher, Scope, Subscriber};

/// How router replicas learn each other's routing decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sharing {
    /// Each replica knows only its own decisions.
    Isolated,
    /// Each decision reaches the other replicas after this many microseconds.
    Delayed(u64),
    /// Every replica sees every decision at once (one shared index).
    Perfect,
}

/// Everything a simulation run needs besides the workload.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub instances: u32,
    pub routers: u32,
    pub sharing: Sharing,
    /// Delay of the agents' residency feed to every router; `None` disables the feed, so
    /// routers know only predicted entries (SageMaker-style approximate routing).
    pub agent_feed_delay_us: Option<u64>,
    pub engine: EngineConfig,
    pub profile: ModelProfile,
    pub policy: PolicyConfig,
    pub index: IndexConfig,
    /// Capacity of the global L2 store in blocks; 0 = no L2.
    pub l2_blocks: u64,
    /// Prompts longer than this are refused before the run.
    pub max_prompt_tokens: u32,
    pub seed: u64,
}

/// Why a run could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// A cluster needs at least one instance.
    #[error("the cluster has no instances: give at least one")]
    NoInstances,
    /// A cluster needs at least one router.
    #[error("the cluster has no routers: give at least one")]
    NoRouters,
    /// A request with an empty prompt.
    #[error("request {id} has an empty prompt")]
    EmptyPrompt { id: u64 },
    /// A request whose prompt is longer than allowed.
    #[error("request {id} has a prompt of {tokens} tokens, over the maximum of {max}")]
    PromptTooLong { id: u64, tokens: u32, max: u32 },
    /// The workload's block size differs from the engines'.
    #[error("the workload uses {workload}-token blocks but the engines use {engine}")]
    BlockSizeMismatch { workload: u32, engine: u32 },
}

/// Figures of one run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunReport {
    pub policy: String,
    pub requests: u64,
    pub completed: u64,
    pub rejected: u64,
    /// Token-weighted share of prompt tokens found cached, all tiers.
    pub hit_rate: f64,
    pub hit_rate_gpu: f64,
    pub hit_rate_l1: f64,
    pub hit_rate_l2: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p90: f64,
    pub ttft_ms_p99: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    pub e2e_ms_p50: f64,
    pub throughput_rps: f64,
    pub throughput_tokens_per_s: f64,
    /// Max over mean of per-instance busy time.
    pub imbalance: f64,
    pub preemptions: u64,
    /// Simulated seconds from the first arrival to the last completion.
    pub makespan_s: f64,
    /// What reports plot (long arrays, left out of `--json`).
    #[serde(skip)]
    pub curves: Curves,
}

/// A run's curves: the TTFT distribution and each instance's load over time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Curves {
    /// TTFT (ms) at the quantiles 0, 0.01, …, 1: its CDF. Empty when nothing completed.
    pub ttft_cdf_ms: Vec<f64>,
    /// Requests on each instance (index = instance: waiting or running, as
    /// [`Engine::in_flight`] counts them), sampled at seconds since the first arrival:
    /// about [`LOAD_SAMPLES`] evenly spaced over the arrivals, and on at the same pace
    /// while the queues drain, up to 4× as many.
    pub load: Vec<(f64, Vec<u32>)>,
}

/// Load samples over a run's arrivals (see [`Curves::load`]).
pub const LOAD_SAMPLES: u64 = 200;

/// Progress of a run, for a progress bar.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

#[derive(Debug)]
enum Event {
    Arrival(usize),
    StepEnd(u32),
    /// Another replica's routing decisions reach `router`.
    Decisions {
        router: u32,
        /// What the deciding replica shared (sampled keys, as the live routers share).
        batch: Rc<Vec<SharedDecision>>,
    },
    /// A residency message of `host`'s agent reaches `router`.
    Residency {
        router: u32,
        host: u32,
        msg: Rc<Msg>,
    },
}

/// The residency scope of an engine event's tier (one engine per host: its GPU is the
/// agent's engine 0).
fn scope_of(tier: Tier) -> Scope {
    match tier {
        Tier::Gpu => Scope::Gpu(0),
        Tier::L1 => Scope::L1,
        Tier::L2 => Scope::L2,
    }
}

fn tier_of(scope: Scope) -> Tier {
    match scope {
        Scope::Gpu(_) => Tier::Gpu,
        Scope::L1 => Tier::L1,
        Scope::L2 => Tier::L2,
    }
}

#[derive(Clone, Debug, Default)]
struct Track {
    router: u32,
    instance: u32,
    first_token_us: Option<u64>,
    last_token_us: u64,
    /// Prefill tokens the load views count for it (the policy's uncached estimate).
    pending: u32,
    /// The routing decision, for the engine's account of what it found cached.
    decision: Option<Decision>,
    /// When it was decided.
    decided_at: u64,
}

/// The model name the simulated pool serves.
const MODEL: &str = "sim";

/// Runs `workload` on a cluster and reports the figures. `progress` is called now and
/// then with the completed count.
pub fn simulate(
    config: &ClusterConfig,
    workload: &Workload,
    progress: &mut dyn FnMut(Progress),
) -> Result<RunReport, SimError> {
    validate(config, workload)?;
    let mut rng = Rng::new(config.seed);
    let mut lb_rng = rng.fork(1);
    let pool = [CorePool {
        model: MODEL.to_string(),
        instances: (0..config.instances)
            .map(|i| InstanceSpec {
                name: format!("instance-{i}"),
                key: u64::from(i),
            })
            .collect(),
    }];
    let mut replicas: Vec<RouterCore> = (0..config.routers)
        .map(|r| {
            let mut core = RouterCore::new(
                CoreConfig {
                    index: config.index,
                    seed: config.seed ^ (u64::from(r) + 1).wrapping_mul(0x9e37_79b9),
                    ..CoreConfig::default()
                },
                config.profile.clone(),
            );
            core.set_pools(&pool);
            let capacity =
                u64::from(config.engine.gpu_blocks) * u64::from(config.engine.block_tokens);
            for i in 0..config.instances {
                core.set_kv_capacity(InstanceId(i), capacity);
                // With the agent feed, every router sees every engine's cache.
                core.set_observed(InstanceId(i), config.agent_feed_delay_us.is_some());
            }
            if matches!(config.sharing, Sharing::Delayed(_)) {
                core.enable_sharing();
            }
            core
        })
        .collect();
    let router_names: Vec<String> = (0..config.routers).map(|r| format!("router-{r}")).collect();
    let mut tenant_names: HashMap<u32, String> = HashMap::new();
    let mut engines: Vec<Engine> = (0..config.instances)
        .map(|_| Engine::new(config.engine.clone(), config.profile.clone()))
        .collect();
    let mut l2 = TierSet::lru(config.l2_blocks);
    // Parent of each key, for placing observed blocks in the index tree.
    let mut parent_of: HashMap<BlockKey, BlockKey> = HashMap::new();
    for r in &workload.requests {
        for w in r.keys.windows(2) {
            parent_of.insert(w[1], w[0]);
        }
    }
    let shared_load = !matches!(config.sharing, Sharing::Isolated);

    let mut queue: BinaryHeap<Reverse<(u64, u64, usize)>> = BinaryHeap::new();
    let mut events: Vec<Option<Event>> = Vec::new();
    let mut seq = 0u64;
    let mut push = |queue: &mut BinaryHeap<Reverse<(u64, u64, usize)>>,
                    events: &mut Vec<Option<Event>>,
                    at: u64,
                    e: Event| {
        events.push(Some(e));
        queue.push(Reverse((at, seq, events.len() - 1)));
        seq += 1;
    };
    for (i, r) in workload.requests.iter().enumerate() {
        push(&mut queue, &mut events, r.arrival_us, Event::Arrival(i));
    }

    // One agent per host, every replica following each from its (empty) first snapshot;
    // nothing is lost on the way, so an agent never expires.
    let mut publishers: Vec<Publisher> = (0..config.instances)
        .map(|i| Publisher::new(u64::from(i) + 1, vec![format!("i{i}")]))
        .collect();
    let mut subscribers: Vec<Vec<Subscriber>> = (0..config.routers)
        .map(|_| {
            publishers
                .iter()
                .map(|p| {
                    let mut s = Subscriber::new(u64::MAX);
                    for m in p.snapshot() {
                        s.handle(0, m);
                    }
                    s
                })
                .collect()
        })
        .collect();

    let mut tracks = vec![Track::default(); workload.requests.len()];
    let (mut ttft, mut itl, mut e2e) = (Samples::new(), Samples::new(), Samples::new());
    let (mut completed, mut rejected, mut output_tokens) = (0u64, 0u64, 0u64);
    let mut engine_events = Vec::new();
    let total = workload.requests.len() as u64;
    let mut last_us = 0u64;
    let mut handled = 0u64;
    let first_us = workload.requests.first().map_or(0, |r| r.arrival_us);
    let arrivals_us = workload
        .requests
        .last()
        .map_or(0, |r| r.arrival_us.saturating_sub(first_us));
    let sample_every_us = (arrivals_us / LOAD_SAMPLES).max(1);
    let mut next_sample_us = first_us;
    let mut load = Vec::new();

    while let Some(Reverse((now, _, slot))) = queue.pop() {
        last_us = last_us.max(now);
        while now >= next_sample_us && load.len() < 4 * LOAD_SAMPLES as usize {
            let at_s = (next_sample_us - first_us) as f64 / 1e6;
            load.push((at_s, engines.iter().map(Engine::in_flight).collect()));
            next_sample_us += sample_every_us;
        }
        let Some(event) = events[slot].take() else {
            continue;
        };
        // The engine whose events this iteration produces (block events name no engine).
        let mut stepped = 0u32;
        handled += 1;
        if handled.is_multiple_of(20_000) {
            progress(Progress {
                done: completed + rejected,
                total,
            });
        }
        match event {
            Event::Arrival(i) => {
                let req = &workload.requests[i];
                let r = lb_rng.below(u64::from(config.routers)) as u32;
                if shared_load && config.routers > 1 {
                    // Every replica routes on the exact cluster-wide load.
                    let peers = (0..config.routers)
                        .filter(|&o| o != r)
                        .map(|o| {
                            (
                                router_names[o as usize].clone(),
                                replicas[o as usize].own_loads(),
                            )
                        })
                        .collect();
                    replicas[r as usize].set_peer_loads(peers);
                }
                let tenant = tenant_names
                    .entry(req.tenant)
                    .or_insert_with(|| format!("tenant-{}", req.tenant));
                let rr = RouteRequest {
                    keys: &req.keys,
                    prompt_tokens: req.prompt_tokens,
                };
                let decision = replicas[r as usize]
                    .route(tenant, &config.policy, MODEL, &rr, &[], false, now)
                    .expect("the simulated pool is never empty or down");
                let inst = decision.instance;
                if config.policy.strategy.uses_index() {
                    match config.sharing {
                        Sharing::Isolated => {}
                        Sharing::Perfect => {
                            let whole = [SharedDecision {
                                instance: u64::from(inst.0),
                                keys: req.keys.clone(),
                            }];
                            for (o, other) in replicas.iter_mut().enumerate() {
                                if o as u32 != r {
                                    other.apply_shared(&whole, now);
                                }
                            }
                        }
                        // As the live routers do: what the core queued for its peers.
                        Sharing::Delayed(d) => {
                            let (batch, _) = replicas[r as usize].take_outbox();
                            if !batch.is_empty() {
                                let batch = Rc::new(batch);
                                for o in 0..config.routers {
                                    if o != r {
                                        push(
                                            &mut queue,
                                            &mut events,
                                            now + d,
                                            Event::Decisions {
                                                router: o,
                                                batch: batch.clone(),
                                            },
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
                let pending = decision.uncached_tokens;
                let decided_at = decision.decided_at;
                tracks[i] = Track {
                    router: r,
                    instance: inst.0,
                    first_token_us: None,
                    last_token_us: now,
                    pending,
                    decision: Some(decision),
                    decided_at,
                };
                stepped = inst.0;
                let engine = &mut engines[inst.0 as usize];
                engine.submit(
                    now,
                    EngineRequest {
                        id: i as u64,
                        keys: req.keys.clone(),
                        prompt_tokens: req.prompt_tokens,
                        output_tokens: req.output_tokens,
                        offered: Vec::new(),
                        offered_from: 0,
                    },
                );
                if !engine.step_running() {
                    if let Some(end) = engine.start_step(now, &mut l2, &mut engine_events) {
                        push(&mut queue, &mut events, end, Event::StepEnd(inst.0));
                    }
                }
            }
            Event::StepEnd(inst) => {
                stepped = inst;
                let engine = &mut engines[inst as usize];
                engine.complete_step(now, &mut l2, &mut engine_events);
                if let Some(end) = engine.start_step(now, &mut l2, &mut engine_events) {
                    push(&mut queue, &mut events, end, Event::StepEnd(inst));
                }
            }
            Event::Decisions { router, batch } => {
                replicas[router as usize].apply_shared(&batch, now);
            }
            Event::Residency { router, host, msg } => {
                let subscriber = &mut subscribers[router as usize][host as usize];
                let changes = match subscriber.handle(now, (*msg).clone()) {
                    Outcome::Apply { changes, .. } => changes,
                    Outcome::Reset { removed, .. } => removed,
                    Outcome::Nothing => Vec::new(),
                };
                let replica = &mut replicas[router as usize];
                for c in changes {
                    replica.observe(
                        InstanceId(host),
                        BlockKey(c.key),
                        c.parent.map(BlockKey),
                        tier_of(c.scope),
                        c.present,
                        now,
                    );
                }
            }
        }

        // Account for what the engines produced.
        let mut observed = false;
        for e in engine_events.drain(..) {
            match e {
                EngineEvent::FirstToken {
                    id,
                    at_us,
                    gpu_hit_tokens,
                    l1_hit_tokens,
                    l2_hit_tokens,
                } => {
                    let i = id as usize;
                    let t = &mut tracks[i];
                    t.first_token_us = Some(at_us);
                    t.last_token_us = at_us;
                    output_tokens += 1;
                    ttft.push((at_us - workload.requests[i].arrival_us) as f64 / 1e3);
                    let replica = &mut replicas[t.router as usize];
                    replica.first_token(InstanceId(t.instance), t.pending);
                    // The engine's usage reports what it found cached, as a live one does.
                    if let Some(decision) = t.decision.take() {
                        let prompt = workload.requests[i].prompt_tokens;
                        let cached = gpu_hit_tokens + l1_hit_tokens + l2_hit_tokens;
                        replica.report_cached(
                            &decision,
                            workload.block_tokens,
                            prompt,
                            CacheReport {
                                prompt_tokens: prompt,
                                cached_tokens: cached,
                            },
                        );
                    }
                }
                EngineEvent::Token { id, at_us } => {
                    let t = &mut tracks[id as usize];
                    itl.push((at_us - t.last_token_us) as f64 / 1e3);
                    t.last_token_us = at_us;
                    output_tokens += 1;
                }
                EngineEvent::Finished { id, at_us } => {
                    let i = id as usize;
                    let t = &tracks[i];
                    completed += 1;
                    e2e.push((at_us - workload.requests[i].arrival_us) as f64 / 1e3);
                    replicas[t.router as usize].finish(
                        InstanceId(t.instance),
                        t.pending,
                        true,
                        t.decided_at,
                    );
                }
                EngineEvent::Rejected { id, .. } => {
                    let i = id as usize;
                    let t = &tracks[i];
                    rejected += 1;
                    replicas[t.router as usize].finish(
                        InstanceId(t.instance),
                        t.pending,
                        false,
                        t.decided_at,
                    );
                }
                EngineEvent::Stored { key, tier } | EngineEvent::Removed { key, tier }
                    if config.agent_feed_delay_us.is_some() =>
                {
                    publishers[stepped as usize].record(Change {
                        scope: scope_of(tier),
                        key: key.0,
                        parent: parent_of.get(&key).map(|p| p.0),
                        present: matches!(e, EngineEvent::Stored { .. }),
                    });
                    observed = true;
                }
                EngineEvent::Stored { .. } | EngineEvent::Removed { .. } => {}
            }
        }
        if let (Some(delay), true) = (config.agent_feed_delay_us, observed) {
            if let Some(msg) = publishers[stepped as usize].next(false, now / 1000) {
                let msg = Rc::new(msg);
                for router in 0..config.routers {
                    push(
                        &mut queue,
                        &mut events,
                        now + delay,
                        Event::Residency {
                            router,
                            host: stepped,
                            msg: msg.clone(),
                        },
                    );
                }
            }
        }
    }
    progress(Progress {
        done: completed + rejected,
        total,
    });

    let mut busy = Vec::new();
    let (mut prompt_tokens, mut gpu_hits, mut l1_hits, mut l2_hits, mut preemptions) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    for e in &engines {
        let s = e.stats();
        busy.push(s.busy_us as f64);
        prompt_tokens += s.prompt_tokens;
        gpu_hits += s.gpu_hit_tokens;
        l1_hits += s.l1_hit_tokens;
        l2_hits += s.l2_hit_tokens;
        preemptions += s.preemptions;
    }
    let mean_busy = busy.iter().sum::<f64>() / busy.len() as f64;
    let max_busy = busy.iter().copied().fold(0.0, f64::max);
    let makespan_s = (last_us.saturating_sub(first_us)) as f64 / 1e6;
    let frac = |x: u64| {
        if prompt_tokens == 0 {
            0.0
        } else {
            x as f64 / prompt_tokens as f64
        }
    };
    let per_s = |x: f64| {
        if makespan_s > 0.0 {
            x / makespan_s
        } else {
            0.0
        }
    };
    Ok(RunReport {
        policy: config.policy.strategy.name().to_string(),
        requests: total,
        completed,
        rejected,
        hit_rate: frac(gpu_hits + l1_hits + l2_hits),
        hit_rate_gpu: frac(gpu_hits),
        hit_rate_l1: frac(l1_hits),
        hit_rate_l2: frac(l2_hits),
        ttft_ms_p50: ttft.quantile(0.5),
        ttft_ms_p90: ttft.quantile(0.9),
        ttft_ms_p99: ttft.quantile(0.99),
        itl_ms_p50: itl.quantile(0.5),
        itl_ms_p99: itl.quantile(0.99),
        e2e_ms_p50: e2e.quantile(0.5),
        throughput_rps: per_s(completed as f64),
        throughput_tokens_per_s: per_s((prompt_tokens + output_tokens) as f64),
        imbalance: if mean_busy > 0.0 {
            max_busy / mean_busy
        } else {
            1.0
        },
        preemptions,
        makespan_s,
        curves: Curves {
            ttft_cdf_ms: if ttft.is_empty() {
                Vec::new()
            } else {
                crate::stats::cdf(|q| ttft.quantile(q))
            },
            load,
        },
    })
}

fn validate(config: &ClusterConfig, workload: &Workload) -> Result<(), SimError> {
    if config.instances == 0 {
        return Err(SimError::NoInstances);
    }
    if config.routers == 0 {
        return Err(SimError::NoRouters);
    }
    if workload.block_tokens != config.engine.block_tokens {
        return Err(SimError::BlockSizeMismatch {
            workload: workload.block_tokens,
            engine: config.engine.block_tokens,
        });
    }
    for r in &workload.requests {
        if r.prompt_tokens == 0 {
            return Err(SimError::EmptyPrompt { id: r.id });
        }
        if r.prompt_tokens > config.max_prompt_tokens {
            return Err(SimError::PromptTooLong {
                id: r.id,
                tokens: r.prompt_tokens,
                max: config.max_prompt_tokens,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bounds::ideal_hit_rate;
    use crate::workload::azure::{azure_workload, AzureRow};
    use crate::workload::synthetic::{generate_workload, SyntheticKind, SyntheticParams};
    use warmpath_index::policy::Strategy;

    fn config(strategy: Strategy, instances: u32, routers: u32, gpu_blocks: u32) -> ClusterConfig {
        ClusterConfig {
            instances,
            routers,
            sharing: Sharing::Perfect,
            agent_feed_delay_us: Some(10_000),
            engine: EngineConfig {
                block_tokens: 64,
                gpu_blocks,
                ..EngineConfig::default()
            },
            profile: ModelProfile::dynamo_default(),
            policy: PolicyConfig {
                concurrency_threshold: 0,
                ..PolicyConfig::new(strategy, 64)
            },
            index: IndexConfig::default(),
            l2_blocks: 0,
            max_prompt_tokens: 1 << 20,
            seed: 7,
        }
    }

    fn small(kind: SyntheticKind, requests: u32) -> Workload {
        let params = SyntheticParams {
            requests,
            rate_per_s: 10.0,
            seed: 3,
            ..SyntheticParams::default()
        };
        generate_workload(kind, &params, 64)
    }

    fn run(config: &ClusterConfig, w: &Workload) -> RunReport {
        simulate(config, w, &mut |_| {}).expect("valid run")
    }

    #[test]
    fn no_sharing_no_hits() {
        let rows: Vec<AzureRow> = (0..200)
            .map(|i| AzureRow {
                arrival_us: i * 50_000,
                context_tokens: 1000 + (i as u32 % 7) * 100,
                generated_tokens: 20,
            })
            .collect();
        let w = azure_workload("azure", &rows, 64, 1);
        let r = run(&config(Strategy::RoundRobin, 4, 1, 100_000), &w);
        assert_eq!((r.completed, r.hit_rate), (200, 0.0));
    }

    #[test]
    fn curves_hold_the_ttft_cdf_and_each_instances_load() {
        let w = small(SyntheticKind::Chat, 300);
        let r = run(&config(Strategy::LeastLoaded, 4, 1, 100_000), &w);
        let cdf = &r.curves.ttft_cdf_ms;
        assert_eq!(cdf.len(), 101);
        assert!(cdf.windows(2).all(|p| p[0] <= p[1]), "{cdf:?}");
        assert_eq!((cdf[50], cdf[99]), (r.ttft_ms_p50, r.ttft_ms_p99));
        let load = &r.curves.load;
        // One sample per 1/LOAD_SAMPLES of the arrivals, more while the queues drain.
        assert!(load.len() as u64 >= LOAD_SAMPLES && load.len() as u64 <= 4 * LOAD_SAMPLES);
        assert!(load.windows(2).all(|p| p[0].0 < p[1].0));
        assert!(load.iter().all(|(_, v)| v.len() == 4));
        let most = load
            .iter()
            .map(|(_, v)| v.iter().sum::<u32>())
            .max()
            .unwrap();
        assert!(most > 0 && most <= 300, "{most}");
    }

    #[test]
    fn one_unbounded_instance_reaches_the_ideal() {
        for kind in SyntheticKind::ALL {
            let w = small(kind, 300);
            let r = run(&config(Strategy::RoundRobin, 1, 1, 10_000_000), &w);
            let ideal = ideal_hit_rate(&w);
            assert_eq!(r.completed, 300);
            assert!(
                (r.hit_rate - ideal).abs() < 1e-9,
                "{kind}: {} vs ideal {ideal}",
                r.hit_rate
            );
        }
    }

    #[test]
    fn prefix_aware_beats_round_robin_under_pressure() {
        let w = small(SyntheticKind::Bots, 600);
        let rr = run(&config(Strategy::RoundRobin, 4, 2, 600), &w);
        let pa = run(&config(Strategy::PrefixAware, 4, 2, 600), &w);
        assert!(
            pa.hit_rate > rr.hit_rate + 0.1,
            "prefix-aware {} vs round-robin {}",
            pa.hit_rate,
            rr.hit_rate
        );
        assert!(pa.ttft_ms_p50 < rr.ttft_ms_p50);
    }

    #[test]
    fn same_seed_same_report() {
        let w = small(SyntheticKind::Chat, 300);
        let mut c = config(Strategy::KvAware, 3, 3, 2000);
        c.sharing = Sharing::Delayed(20_000);
        c.policy.temperature = 0.5;
        assert_eq!(run(&c, &w), run(&c, &w));
    }

    #[test]
    fn bad_configurations_are_errors() {
        let w = small(SyntheticKind::Rag, 20);
        let err = |c: ClusterConfig| simulate(&c, &w, &mut |_| {}).unwrap_err();
        assert_eq!(
            err(config(Strategy::RoundRobin, 0, 1, 100)),
            SimError::NoInstances
        );
        assert_eq!(
            err(config(Strategy::RoundRobin, 1, 0, 100)),
            SimError::NoRouters
        );
        let mut c = config(Strategy::RoundRobin, 1, 1, 100);
        c.max_prompt_tokens = 10;
        assert!(matches!(err(c), SimError::PromptTooLong { max: 10, .. }));
        let mut c = config(Strategy::RoundRobin, 1, 1, 100);
        c.engine.block_tokens = 16;
        assert_eq!(
            err(c),
            SimError::BlockSizeMismatch {
                workload: 64,
                engine: 16
            }
        );
        let mut empty = w.clone();
        empty.requests[3].prompt_tokens = 0;
        let e = simulate(
            &config(Strategy::RoundRobin, 1, 1, 100),
            &empty,
            &mut |_| {},
        )
        .unwrap_err();
        assert_eq!(
            e,
            SimError::EmptyPrompt {
                id: empty.requests[3].id
            }
        );
    }
}
