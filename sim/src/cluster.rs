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
//!
//! How a run reads: [`simulate`] pops events in time order from an `EventQueue` and hands
//! each to the run's state, `Run`, which has one method per kind of event (`arrival`,
//! which routes and shares the decision; `step_end`; `residency`); `Run::account` then
//! turns what the stepped engine produced into figures, router load and the agent's next
//! delta (`publish`), and `Run::report` sums the figures up.

use crate::engine::{Engine, EngineConfig, EngineEvent, EngineRequest};
use crate::faults::{Fault, FaultError, FaultSummary, Timeline};
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
use warmpath_index::load::{InstanceLoad, LoadView};
use warmpath_index::policy::{Decision, PolicyConfig, RouteRequest};
use warmpath_index::rng::Rng;
use warmpath_index::router::{
    CacheReport, CoreConfig, CorePool, InstanceSpec, PublishBudget, RouterCore, SharedDecision,
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
    /// Routers that follow each agent (decision 0105: the top `F` of rendezvous hashing,
    /// `warmpath_residency::follow`); `None`: every router follows every agent. A router
    /// that does not follow an agent routes to its engines on predictions.
    pub residency_followers: Option<u32>,
    pub engine: EngineConfig,
    pub profile: ModelProfile,
    pub policy: PolicyConfig,
    /// The cluster's budget for shared decisions, block keys per second, each router
    /// spending its share as the gossip adapter does ([`PublishBudget`], record 0118; 0:
    /// none). Only `Sharing::Delayed` publishes through it.
    pub gossip_budget_keys_per_s: u64,
    pub index: IndexConfig,
    /// Capacity of the global L2 store in blocks; 0 = no L2.
    pub l2_blocks: u64,
    /// Prompts longer than this are refused before the run.
    pub max_prompt_tokens: u32,
    pub seed: u64,
    /// Routers send prefetch hints: a request routed to an instance whose host holds part
    /// of its prefix only in L2 has those blocks read into the host's L1 while it queues
    /// ([`Engine::prefetch`]), as live routers ask the host's agent.
    pub prefetch: bool,
    /// What goes wrong during the run, and when ([`crate::faults`]).
    pub faults: Vec<Fault>,
    /// Record the hit rate over time in windows of this many microseconds
    /// ([`RunReport::timeline`]) and, with faults, what each cost ([`RunReport::faults`]).
    pub timeline_us: Option<u64>,
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
    /// A fault that does not fit the cluster.
    #[error(transparent)]
    Fault(#[from] FaultError),
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
    /// GPU seconds of prefill per completed request: the profile's prefill time of the
    /// tokens actually computed (recomputation after preemption included), what cache
    /// hits save.
    pub prefill_gpu_s_per_request: f64,
    /// Seconds of tier loads (L1 and L2) per completed request.
    pub load_s_per_request: f64,
    /// Blocks prefetch hints brought from L2 into the hosts' L1s.
    pub prefetched_blocks: u64,
    /// Of the decisions the routers shared, the fraction their gossip budgets shed.
    pub shared_decisions_shed: f64,
    /// Simulated seconds from the first arrival to the last completion.
    pub makespan_s: f64,
    /// Follow-up turns: how much of the context each inherits from an earlier turn was
    /// found cached, and where.
    pub follow_ups: FollowUps,
    /// TTFT of the requests by where their prompt was found (see [`TtftBySource`]).
    pub ttft_by_source: TtftBySource,
    /// What reports plot (long arrays, left out of `--json`).
    #[serde(skip)]
    pub curves: Curves,
    /// The hit rate over time, when asked for ([`ClusterConfig::timeline_us`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// What each fault cost, read off the timeline (empty without faults or timeline).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<FaultSummary>,
}

/// Follow-up turns of a run: requests whose prompt begins with a whole earlier prompt
/// ([`Workload::follow_up_context`]), such as a conversation's next turn. Their inherited
/// context is what the engine may have evicted during the user's think time; the tiers are
/// to bring it back rather than have it recomputed.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FollowUps {
    /// Follow-up requests that got their first token.
    pub requests: u64,
    /// Their inherited context, in tokens (complete blocks).
    pub context_tokens: u64,
    /// Share of that context found cached in any tier at admission.
    pub hit_rate: f64,
    /// The parts found on the GPU, in L1 and in L2 (GPU first, as the engine finds them).
    pub hit_rate_gpu: f64,
    pub hit_rate_l1: f64,
    pub hit_rate_l2: f64,
}

/// TTFT by where a request's prompt was found at its first admission: which requests a
/// tier can speed up at all. A request whose prompt is on its GPU waits only for the steps
/// it joins; one the tiers serve waits for the loads too; one that computes more than
/// [`COMPUTED_SHARE`] of its prompt waits for that prefill. The run's TTFT p50 falls with
/// tiers only as far as requests leave `computed` for `tiers` across the median.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct TtftBySource {
    /// Computed at most [`COMPUTED_SHARE`] of the prompt, and found at least the rest of
    /// it on the GPU.
    pub gpu: TtftPart,
    /// Computed at most [`COMPUTED_SHARE`], and loaded more than that from L1 or L2.
    pub tiers: TtftPart,
    /// Computed more than [`COMPUTED_SHARE`] of the prompt.
    pub computed: TtftPart,
}

impl TtftBySource {
    /// The classes in [`ttft_source`]'s order: `gpu`, `tiers`, `computed`.
    pub fn parts(&self) -> [&TtftPart; 3] {
        [&self.gpu, &self.tiers, &self.computed]
    }
}

/// Above this share of its prompt computed, a request counts as `computed` in
/// [`TtftBySource`].
pub const COMPUTED_SHARE: f64 = 0.1;

/// One class of [`TtftBySource`]: its requests and their TTFT.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct TtftPart {
    pub requests: u64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p90: f64,
}

impl TtftPart {
    fn of(mut samples: Samples) -> TtftPart {
        TtftPart {
            requests: samples.len() as u64,
            ttft_ms_p50: samples.quantile(0.5),
            ttft_ms_p90: samples.quantile(0.9),
        }
    }
}

/// Which class of [`TtftBySource`] a prompt of `prompt_tokens` with `hits` (GPU, L1, L2)
/// falls in: 0 `gpu`, 1 `tiers`, 2 `computed`.
fn ttft_source(prompt_tokens: u32, hits: [u32; 3]) -> usize {
    let prompt = f64::from(prompt_tokens.max(1));
    let cached: u32 = hits.iter().sum();
    if f64::from(prompt_tokens.saturating_sub(cached)) > COMPUTED_SHARE * prompt {
        2
    } else if f64::from(hits[1] + hits[2]) > COMPUTED_SHARE * prompt {
        1
    } else {
        0
    }
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
    /// Replica `from`'s routing decisions reach the others (`to`: those listed; `None`:
    /// every other replica, in order).
    Decisions {
        from: u32,
        to: Option<Vec<u32>>,
        /// What the deciding replica shared (sampled keys, as the live routers share).
        batch: Rc<Vec<SharedDecision>>,
    },
    /// A residency message of `host`'s agent reaches `router`, over the router's residency
    /// link number `link` (a restarted router's links are new: messages on the old die).
    Residency {
        router: u32,
        host: u32,
        msg: Rc<Msg>,
        link: u32,
    },
    /// Fault number `n` of the configuration strikes.
    Fault(usize),
    /// Routers poll the silent agents of fault `n` (every 100 ms, as a live router's
    /// expiry task does).
    ExpiryTick(usize),
    /// The agents of fault `n` start again.
    AgentsBack(usize),
    /// The started agents of fault `n` are connected: their followers take a snapshot.
    AgentsResync(usize),
    /// Restarted `router`'s residency links are up: its agents send their snapshots.
    RouterResync(u32),
    /// Restarted `router` has caught up with gossip: its peers' live decisions reach it.
    RouterCatchUp(u32),
    /// A partition heals.
    Heal,
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
    /// The start of its router that routed it (a router restarted since never hears of
    /// it).
    start: u32,
}

/// The model name the simulated pool serves.
const MODEL: &str = "sim";

/// A live router's expiry task polls its agents' views this often.
const EXPIRY_POLL_US: u64 = 100_000;

/// Runs `workload` on a cluster and reports the figures. `progress` is called now and
/// then with the completed count.
pub fn simulate(
    config: &ClusterConfig,
    workload: &Workload,
    progress: &mut dyn FnMut(Progress),
) -> Result<RunReport, SimError> {
    validate(config, workload)?;
    let mut run = Run::new(config, workload);
    let mut handled = 0u64;
    while let Some((now, event)) = run.queue.pop() {
        run.advance_clock(now);
        let Some(event) = event else {
            continue;
        };
        handled += 1;
        if handled.is_multiple_of(20_000) {
            progress(run.progress());
        }
        if let Some(host) = run.handle(now, event) {
            run.account(now, host);
        }
    }
    progress(run.progress());
    Ok(run.report())
}

/// The pending events of a run, earliest first; ties in insertion order.
#[derive(Debug, Default)]
struct EventQueue {
    /// (time, insertion number, index in `events`).
    heap: BinaryHeap<Reverse<(u64, u64, usize)>>,
    /// The pending events, by slot; a popped event's slot is reused.
    events: Vec<Option<Event>>,
    /// Slots free for the next pushes.
    free: Vec<usize>,
    /// Insertion number of the next push: breaks ties between events at the same time.
    seq: u64,
}

impl EventQueue {
    fn push(&mut self, at: u64, event: Event) {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.events[slot] = Some(event);
                slot
            }
            None => {
                self.events.push(Some(event));
                self.events.len() - 1
            }
        };
        self.heap.push(Reverse((at, self.seq, slot)));
        self.seq += 1;
    }

    /// The earliest event and its time.
    fn pop(&mut self) -> Option<(u64, Option<Event>)> {
        let Reverse((at, _, slot)) = self.heap.pop()?;
        self.free.push(slot);
        Some((at, self.events[slot].take()))
    }
}

/// The agents' residency feed: one [`Publisher`] per host, and per replica a
/// [`Subscriber`] following each host.
#[derive(Debug)]
struct Feed {
    /// Host to its agent's session.
    publishers: Vec<Publisher>,
    /// Host to its agent's state (all up unless a fault says otherwise).
    agents: Vec<Agent>,
    /// Agent starts so far, to give each started agent an epoch of its own.
    starts: u64,
    /// Router, then host: whether the router follows the host's agent.
    follows: Vec<Vec<bool>>,
    /// Router, then host, to the router's view of that agent.
    subscribers: Vec<Vec<Subscriber>>,
    /// Router to the number of its residency links (a restart makes new ones) and whether
    /// they are up (not between a restart and its agents' snapshots).
    links: Vec<(u32, bool)>,
    /// How long a router keeps a silent agent's residency (only polled for agents a fault
    /// kills: the simulated agents are never silent otherwise).
    expiry_us: u64,
    /// Parent of each key of the workload, for the changes' chains (the index keeps trees).
    parent_of: HashMap<BlockKey, BlockKey>,
}

/// An agent's state, as far as faults go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Agent {
    /// Running, its followers connected.
    Up,
    /// Dead: it records and sends nothing (its engine keeps serving).
    Down,
    /// Started again, its followers not yet connected: it records, and sends nothing yet.
    Starting,
}

/// A host's residency publisher, reporting at the routers' rate for the engines' block size
/// ([`IndexConfig::reporting`]): a simulated agent knows its block size from the start.
fn publisher(config: &ClusterConfig, epoch: u64, instances: Vec<String>) -> Publisher {
    Publisher::new(epoch, instances).reporting(config.index.reporting(config.engine.block_tokens))
}

impl Feed {
    /// One agent per host, every replica following each from its (empty) first snapshot;
    /// nothing is lost on the way, so an agent expires only when a fault kills it.
    fn new(config: &ClusterConfig, workload: &Workload, follows: Vec<Vec<bool>>) -> Self {
        let publishers: Vec<Publisher> = (0..config.instances)
            .map(|i| publisher(config, u64::from(i) + 1, vec![format!("i{i}")]))
            .collect();
        let expiry_us = config
            .faults
            .iter()
            .filter_map(|f| match f {
                Fault::AgentsLost { expiry_us, .. } => Some(*expiry_us),
                _ => None,
            })
            .min()
            .unwrap_or(u64::MAX);
        let subscribers = (0..config.routers)
            .map(|_| {
                publishers
                    .iter()
                    .map(|p| {
                        let mut s = Subscriber::new(expiry_us);
                        for m in p.snapshot() {
                            s.handle(0, m);
                        }
                        s
                    })
                    .collect()
            })
            .collect();
        let mut parent_of = HashMap::new();
        for r in &workload.requests {
            for w in r.keys.windows(2) {
                parent_of.insert(w[1], w[0]);
            }
        }
        Feed {
            publishers,
            agents: vec![Agent::Up; config.instances as usize],
            starts: 0,
            follows,
            subscribers,
            links: vec![(0, true); config.routers as usize],
            expiry_us,
            parent_of,
        }
    }

    /// Whether `router` takes `host`'s messages now.
    fn delivers(&self, router: u32, host: u32) -> bool {
        self.follows[router as usize][host as usize] && self.links[router as usize].1
    }
}

/// Per-request latencies and counts, for the report.
#[derive(Debug)]
struct Tally {
    /// TTFT samples by [`ttft_source`] (the run's TTFT is all of them).
    ttft_by_source: [Samples; 3],
    itl: Samples,
    e2e: Samples,
    completed: u64,
    rejected: u64,
    /// Output tokens produced, the first of each request included.
    output_tokens: u64,
    /// Follow-up turns: requests, inherited context tokens and the tokens of it found on
    /// the GPU, in L1 and in L2.
    follow_ups: u64,
    follow_up_context: u64,
    follow_up_hits: [u64; 3],
    /// Decisions the routers shared, and of them those their budgets shed.
    shared: u64,
    shed: u64,
}

/// Each instance's load over the run (see [`Curves::load`]).
#[derive(Debug)]
struct LoadSampler {
    first_us: u64,
    every_us: u64,
    next_us: u64,
    samples: Vec<(f64, Vec<u32>)>,
}

impl LoadSampler {
    fn new(workload: &Workload) -> Self {
        let first_us = workload.requests.first().map_or(0, |r| r.arrival_us);
        let arrivals_us = workload
            .requests
            .last()
            .map_or(0, |r| r.arrival_us.saturating_sub(first_us));
        LoadSampler {
            first_us,
            every_us: (arrivals_us / LOAD_SAMPLES).max(1),
            next_us: first_us,
            samples: Vec::new(),
        }
    }

    /// Samples the engines' load at every sampling time up to `now`.
    fn advance(&mut self, now: u64, engines: &[Engine]) {
        while now >= self.next_us && self.samples.len() < 4 * LOAD_SAMPLES as usize {
            let at_s = (self.next_us - self.first_us) as f64 / 1e6;
            self.samples
                .push((at_s, engines.iter().map(Engine::in_flight).collect()));
            self.next_us += self.every_us;
        }
    }
}

/// The name under which a replica is handed its peers' loads: all of them, summed (a
/// router adds its peers' views into one, so the sum routes exactly as the views would).
const PEERS: &str = "peers";

/// Each replica's own load, as its [`RouterCore`] counts it (the same [`LoadView`] calls
/// with the same arguments), and their sum over the cluster. A replica's peers' load is
/// then the sum less its own: one pass over the instances per route, where asking every
/// replica for its loads was one pass per replica (most of a 128-router run's time).
///
/// In a partition, each side sees the other's load as it was at the cut (the last one
/// published across it), so the sums are also kept per side.
#[derive(Debug)]
struct Loads {
    own: Vec<LoadView>,
    total: LoadView,
    /// In a partition: the first router of the cut-off side, each side's sum now, and each
    /// side's sum at the cut.
    cut: Option<(u32, [LoadView; 2], [LoadView; 2])>,
}

impl Loads {
    fn new(routers: u32) -> Self {
        Loads {
            own: vec![LoadView::new(); routers as usize],
            total: LoadView::new(),
            cut: None,
        }
    }

    /// The views that count replica `r`'s load: the total and, in a partition, its side's.
    fn sums_of(&mut self, r: u32) -> impl Iterator<Item = &mut LoadView> {
        let side = self
            .cut
            .as_mut()
            .map(|(first, now, _)| &mut now[usize::from(r >= *first)]);
        std::iter::once(&mut self.own[r as usize])
            .chain(std::iter::once(&mut self.total))
            .chain(side)
    }

    /// Replica `r` sent a request with `pending` tokens to prefill to `instance`.
    fn start(&mut self, r: u32, instance: InstanceId, pending: u32) {
        for v in self.sums_of(r) {
            v.start(instance, u64::from(pending));
        }
    }

    fn first_token(&mut self, r: u32, instance: InstanceId, pending: u32) {
        for v in self.sums_of(r) {
            v.first_token(instance, u64::from(pending));
        }
    }

    fn finish(&mut self, r: u32, instance: InstanceId, pending: u32, prefilled: bool) {
        for v in self.sums_of(r) {
            v.finish(instance, u64::from(pending), prefilled);
        }
    }

    /// The sum of the replicas in `routers`.
    fn sum(&self, routers: std::ops::Range<usize>) -> LoadView {
        let mut sum = LoadView::new();
        for v in &self.own[routers] {
            sum.add(v);
        }
        sum
    }

    /// Replica `r` restarted: it has no request in flight (its peers see none from it).
    fn restart(&mut self, r: u32) {
        self.own[r as usize] = LoadView::new();
        self.total = self.sum(0..self.own.len());
        if let Some(first) = self.cut.as_ref().map(|c| c.0 as usize) {
            let sides = [self.sum(0..first), self.sum(first..self.own.len())];
            if let Some((_, now, _)) = &mut self.cut {
                *now = sides;
            }
        }
    }

    /// Routers from `first` on are cut off from the others.
    fn cut(&mut self, first: u32) {
        let first_us = first as usize;
        let sides = [self.sum(0..first_us), self.sum(first_us..self.own.len())];
        self.cut = Some((first, sides.clone(), sides));
    }

    fn heal(&mut self) {
        self.cut = None;
    }

    /// The load of every other replica, summed, by instance key (the simulated instances'
    /// keys are their indices).
    /// In a partition: its side's replicas now, and the other side's as at the cut.
    fn peers_of(&self, r: u32, instances: u32) -> Vec<(u64, InstanceLoad)> {
        let own = &self.own[r as usize];
        let (all, other) = match &self.cut {
            None => (&self.total, None),
            Some((first, now, then)) => {
                let side = usize::from(r >= *first);
                (&now[side], Some(&then[1 - side]))
            }
        };
        (0..instances)
            .map(|i| {
                let i = InstanceId(i);
                let (all, mine) = (all.get(i), own.get(i));
                let across = other.map_or(InstanceLoad::default(), |v| v.get(i));
                let others = InstanceLoad {
                    in_flight: all.in_flight - mine.in_flight + across.in_flight,
                    pending_prefill_tokens: all.pending_prefill_tokens
                        - mine.pending_prefill_tokens
                        + across.pending_prefill_tokens,
                };
                (u64::from(i.0), others)
            })
            .collect()
    }
}

/// One run's state: the cluster, its pending events and what it measured so far. Each
/// kind of event has its method; [`Run::account`] then handles what the engine did.
struct Run<'a> {
    config: &'a ClusterConfig,
    workload: &'a Workload,
    /// The load balancer's choice of replica.
    lb_rng: Rng,
    /// The router replicas, by index.
    replicas: Vec<RouterCore>,
    /// Each replica's share of the gossip budget.
    budgets: Vec<PublishBudget>,
    /// Tenant index to the name the replicas know it by (made on first use).
    tenant_names: HashMap<u32, String>,
    /// One engine per instance (and host).
    engines: Vec<Engine>,
    /// The global L2 store.
    l2: TierSet,
    /// Whether replicas see each other's load (every mode but isolated).
    shared_load: bool,
    /// Every replica's own load and their sum, kept beside the replicas' (see [`Loads`]).
    loads: Loads,
    queue: EventQueue,
    feed: Feed,
    /// Per request: where it went and how far it got.
    tracks: Vec<Track>,
    /// What the last engine call produced; drained by `account`.
    engine_events: Vec<EngineEvent>,
    tally: Tally,
    load: LoadSampler,
    /// The time of the latest event.
    last_us: u64,
    /// Per request, the blocks of context it inherits from an earlier turn (0: none).
    follow_up_context: Vec<u32>,
    /// What faults did to the routers.
    faulted: RouterFaults,
    /// The hit rate over time, when asked for.
    timeline: Option<Timeline>,
}

/// What faults changed about the routers ([`crate::faults`]).
#[derive(Debug)]
struct RouterFaults {
    /// Per router, its starts so far less one (a request routed before a restart is unknown
    /// to the router after it).
    starts: Vec<u32>,
    /// Per router, until when decisions reaching it are left to its catch-up (it restarted
    /// and has not caught up with gossip yet).
    catching_up: Vec<Option<u64>>,
    /// Every batch shared, when and by whom, while a restart is to come: the batches alive
    /// in gossip, which a restarted router catches up with. Dropped after the last catch-up.
    shared: Option<Vec<Shared>>,
    /// When the last restarted router catches up (the log is kept until then).
    last_catch_up_us: u64,
    /// The partition in force.
    cut: Option<Cut>,
}

/// A batch of decisions as shared: when, by which replica.
type Shared = (u64, u32, Rc<Vec<SharedDecision>>);

/// A partition: routers from `first` on are cut off from the others until `heal_us`;
/// decisions held back arrive `catch_up_us` after it.
#[derive(Clone, Copy, Debug)]
struct Cut {
    first: u32,
    heal_us: u64,
    catch_up_us: u64,
}

impl RouterFaults {
    fn new(config: &ClusterConfig, workload: &Workload) -> Self {
        let first_us = workload.requests.first().map_or(0, |r| r.arrival_us);
        let last_catch_up_us = config
            .faults
            .iter()
            .filter_map(|f| match *f {
                Fault::RouterRestart {
                    at_us, catch_up_us, ..
                } => Some(first_us + at_us + catch_up_us),
                _ => None,
            })
            .max();
        RouterFaults {
            starts: vec![0; config.routers as usize],
            catching_up: vec![None; config.routers as usize],
            shared: last_catch_up_us.map(|_| Vec::new()),
            last_catch_up_us: last_catch_up_us.unwrap_or(0),
            cut: None,
        }
    }
}

impl Cut {
    /// Whether a decision between routers `a` and `b` crosses the cut at `now`.
    fn separates(&self, now: u64, a: u32, b: u32) -> bool {
        now < self.heal_us && (a >= self.first) != (b >= self.first)
    }
}

impl<'a> Run<'a> {
    /// The cluster at time 0, every arrival queued.
    fn new(config: &'a ClusterConfig, workload: &'a Workload) -> Self {
        let mut queue = EventQueue::default();
        for (i, r) in workload.requests.iter().enumerate() {
            queue.push(r.arrival_us, Event::Arrival(i));
        }
        let router_names: Vec<String> =
            (0..config.routers).map(|r| format!("router-{r}")).collect();
        let follows = follower_matrix(config, &router_names);
        let mut run = Run {
            config,
            workload,
            lb_rng: Rng::new(config.seed).fork(1),
            replicas: replicas(config, &follows),
            tenant_names: HashMap::new(),
            engines: (0..config.instances)
                .map(|_| Engine::new(config.engine.clone(), config.profile.clone()))
                .collect(),
            l2: TierSet::lru(config.l2_blocks),
            shared_load: !matches!(config.sharing, Sharing::Isolated),
            loads: Loads::new(config.routers),
            queue,
            feed: Feed::new(config, workload, follows),
            tracks: vec![Track::default(); workload.requests.len()],
            engine_events: Vec::new(),
            tally: Tally {
                ttft_by_source: Default::default(),
                itl: Samples::new(),
                e2e: Samples::new(),
                completed: 0,
                rejected: 0,
                output_tokens: 0,
                follow_ups: 0,
                follow_up_context: 0,
                follow_up_hits: [0; 3],
                shared: 0,
                shed: 0,
            },
            budgets: vec![
                PublishBudget::new(config.gossip_budget_keys_per_s);
                config.routers as usize
            ],
            load: LoadSampler::new(workload),
            last_us: 0,
            follow_up_context: workload.follow_up_context(),
            faulted: RouterFaults::new(config, workload),
            timeline: config.timeline_us.map(Timeline::new),
        };
        let first_us = run.load.first_us;
        for (n, f) in config.faults.iter().enumerate() {
            run.queue.push(first_us + f.at_us(), Event::Fault(n));
        }
        run
    }

    fn progress(&self) -> Progress {
        Progress {
            done: self.tally.completed + self.tally.rejected,
            total: self.workload.requests.len() as u64,
        }
    }

    /// Moves the clock to `now`, sampling the load on the way.
    fn advance_clock(&mut self, now: u64) {
        self.last_us = self.last_us.max(now);
        self.load.advance(now, &self.engines);
    }

    /// Handles one event; returns the engine it stepped, whose events are then to account.
    fn handle(&mut self, now: u64, event: Event) -> Option<u32> {
        match event {
            Event::Arrival(i) => Some(self.arrival(now, i)),
            Event::StepEnd(inst) => {
                self.step_end(now, inst);
                Some(inst)
            }
            Event::Decisions { from, to, batch } => {
                self.decisions(now, from, to, batch);
                None
            }
            Event::Residency {
                router,
                host,
                msg,
                link,
            } => {
                // Messages on a link that died with a restart are lost with it.
                if link == self.feed.links[router as usize].0 {
                    self.residency(now, router, host, &msg);
                }
                None
            }
            Event::Fault(n) => {
                self.fault(now, n);
                None
            }
            Event::ExpiryTick(n) => {
                self.expiry_tick(now, n);
                None
            }
            Event::AgentsBack(n) => {
                self.agents_back(now, n);
                None
            }
            Event::AgentsResync(n) => {
                self.agents_resync(now, n);
                None
            }
            Event::RouterResync(r) => {
                self.router_resync(now, r);
                None
            }
            Event::RouterCatchUp(r) => {
                self.router_catch_up(now, r);
                None
            }
            Event::Heal => {
                self.faulted.cut = None;
                self.loads.heal();
                None
            }
        }
    }

    /// Replica `from`'s `batch` of decisions reaches `to` (`None`: every other replica),
    /// except a replica still to catch up after a restart (the catch-up brings it) and, in
    /// a partition, those across the cut, which get it once it heals.
    fn decisions(
        &mut self,
        now: u64,
        from: u32,
        to: Option<Vec<u32>>,
        batch: Rc<Vec<SharedDecision>>,
    ) {
        let to = to.unwrap_or_else(|| (0..self.config.routers).filter(|&o| o != from).collect());
        let mut held_back = Vec::new();
        for o in to {
            if self.faulted.catching_up[o as usize].is_some_and(|until| now < until) {
                continue;
            }
            if let Some(cut) = self.faulted.cut.filter(|c| c.separates(now, from, o)) {
                held_back.push((o, cut.heal_us + cut.catch_up_us));
                continue;
            }
            self.replicas[o as usize].apply_shared(&batch, now);
        }
        if let Some(&(_, at)) = held_back.first() {
            let to = Some(held_back.into_iter().map(|(o, _)| o).collect());
            self.queue.push(at, Event::Decisions { from, to, batch });
        }
    }

    /// Fault number `n` strikes now.
    fn fault(&mut self, now: u64, n: usize) {
        let config = self.config;
        match config.faults[n] {
            Fault::AgentsLost {
                share,
                back_after_us,
                ..
            } => {
                let delay = config.agent_feed_delay_us.unwrap_or(0);
                for h in 0..Fault::hosts_lost(share, config.instances) {
                    // Its last heartbeat (a live agent sends one every 500 ms): its
                    // followers' expiry runs from there.
                    self.heartbeat(now, h, delay);
                    self.feed.agents[h as usize] = Agent::Down;
                    // The L1 lived in the agent: gone, and none while it is down.
                    self.engines[h as usize].replace_l1(0);
                }
                self.queue.push(now + EXPIRY_POLL_US, Event::ExpiryTick(n));
                if let Some(back) = back_after_us {
                    self.queue.push(now + back, Event::AgentsBack(n));
                }
            }
            Fault::RouterRestart {
                router,
                catch_up_us,
                resync_us,
                ..
            } => {
                let r = router.unwrap_or(config.routers - 1);
                let pool = pool(config);
                self.replicas[r as usize] = replica(config, r, &pool, |_| false);
                self.faulted.starts[r as usize] += 1;
                self.faulted.catching_up[r as usize] = Some(now + catch_up_us);
                self.loads.restart(r);
                let (link, _) = self.feed.links[r as usize];
                self.feed.links[r as usize] = (link + 1, false);
                let expiry = self.feed.expiry_us;
                for s in &mut self.feed.subscribers[r as usize] {
                    *s = Subscriber::new(expiry);
                }
                self.queue.push(now + resync_us, Event::RouterResync(r));
                self.queue.push(now + catch_up_us, Event::RouterCatchUp(r));
            }
            Fault::Partition {
                share,
                for_us,
                catch_up_us,
                ..
            } => {
                let first = config.routers - Fault::routers_cut(share, config.routers);
                self.faulted.cut = Some(Cut {
                    first,
                    heal_us: now + for_us,
                    catch_up_us,
                });
                self.loads.cut(first);
                self.queue.push(now + for_us, Event::Heal);
            }
        }
    }

    /// The hosts fault `n` hits (agents lost).
    fn hosts_of(&self, n: usize) -> u32 {
        match self.config.faults[n] {
            Fault::AgentsLost { share, .. } => Fault::hosts_lost(share, self.config.instances),
            _ => 0,
        }
    }

    /// The routers that followed fault `n`'s dead agents poll their views, as a live
    /// router's expiry task does: a view silent past the expiry drops what it reported.
    /// Polls again until every such view has expired (or its agent is back).
    fn expiry_tick(&mut self, now: u64, n: usize) {
        let mut waiting = false;
        for h in 0..self.hosts_of(n) {
            if self.feed.agents[h as usize] != Agent::Down {
                continue;
            }
            for r in 0..self.config.routers {
                if !self.feed.delivers(r, h) {
                    continue;
                }
                let view = &mut self.feed.subscribers[r as usize][h as usize];
                let outcome = view.poll(now);
                waiting |= outcome == Outcome::Nothing && (view.in_sync() || !view.is_empty());
                self.apply_outcome(now, r, h, outcome);
            }
        }
        if waiting {
            self.queue.push(now + EXPIRY_POLL_US, Event::ExpiryTick(n));
        }
    }

    /// Fault `n`'s agents start again: a new epoch, an empty L1, the GPU's blocks from the
    /// engine's replay; their followers connect `resync` later.
    fn agents_back(&mut self, now: u64, n: usize) {
        let Fault::AgentsLost { resync_us, .. } = self.config.faults[n] else {
            return;
        };
        for h in 0..self.hosts_of(n) {
            self.feed.agents[h as usize] = Agent::Starting;
            self.engines[h as usize].replace_l1(self.config.engine.l1_blocks);
            self.feed.starts += 1;
            let epoch = (self.feed.starts << 32) | (u64::from(h) + 1);
            let mut publisher = publisher(self.config, epoch, vec![format!("i{h}")]);
            // Parents first, as an engine's replay goes: a block's depth is its chain's
            // length back through `parent_of`.
            let depth = |mut k: BlockKey| {
                let mut d = 1u32;
                while let Some(&p) = self.feed.parent_of.get(&k) {
                    (d, k) = (d + 1, p);
                }
                d
            };
            let mut keys = self.engines[h as usize].gpu_keys();
            keys.sort_by_cached_key(|&k| (depth(k), k));
            for key in keys {
                publisher.record(Change {
                    scope: Scope::Gpu(0),
                    key: key.0,
                    parent: self.feed.parent_of.get(&key).map(|p| p.0),
                    present: true,
                });
            }
            // Nobody follows it yet: its snapshot will carry these.
            publisher.next_all(false, now / 1000);
            self.feed.publishers[h as usize] = publisher;
        }
        self.queue.push(now + resync_us, Event::AgentsResync(n));
    }

    /// Fault `n`'s started agents are connected: each follower takes a snapshot.
    fn agents_resync(&mut self, now: u64, n: usize) {
        for h in 0..self.hosts_of(n) {
            if self.feed.agents[h as usize] != Agent::Starting {
                continue;
            }
            self.feed.agents[h as usize] = Agent::Up;
            for r in 0..self.config.routers {
                if self.feed.delivers(r, h) {
                    self.snapshot_to(now, r, h);
                }
            }
        }
    }

    /// Restarted router `r`'s residency links are up: each agent it follows sends it a
    /// snapshot.
    fn router_resync(&mut self, now: u64, r: u32) {
        self.feed.links[r as usize].1 = true;
        for h in 0..self.config.instances {
            if self.feed.delivers(r, h) && self.feed.agents[h as usize] == Agent::Up {
                self.snapshot_to(now, r, h);
            }
        }
    }

    /// Restarted router `r` has caught up with gossip: every batch its peers shared that is
    /// still alive (within the decision TTL) and that reached the others before now.
    fn router_catch_up(&mut self, now: u64, r: u32) {
        self.faulted.catching_up[r as usize] = None;
        let Sharing::Delayed(d) = self.config.sharing else {
            return;
        };
        let ttl = self.config.index.predicted_ttl_us;
        if let Some(log) = &self.faulted.shared {
            for (sent, from, batch) in log {
                if *from != r && sent + ttl >= now && sent + d < now {
                    self.replicas[r as usize].apply_shared(batch, now);
                }
            }
        }
        if now >= self.faulted.last_catch_up_us {
            self.faulted.shared = None;
        }
    }

    /// Request `i` arrives: a replica routes it, shares the decision, and the chosen engine
    /// takes it. Returns that engine.
    fn arrival(&mut self, now: u64, i: usize) -> u32 {
        let workload = self.workload;
        let req = &workload.requests[i];
        let r = self.lb_rng.below(u64::from(self.config.routers)) as u32;
        let decision = self.route(now, r, i);
        let inst = decision.instance.0;
        if self.config.policy.strategy.uses_index() {
            self.share(now, r, inst, &req.keys);
        }
        let m = decision.matched;
        let (from, to) = (m.l1 as usize, (m.l2 as usize).min(req.keys.len()));
        if self.config.prefetch && from < to {
            self.engines[inst as usize].prefetch(now, &req.keys[from..to], &self.l2);
        }
        self.tracks[i] = Track {
            router: r,
            instance: inst,
            first_token_us: None,
            last_token_us: now,
            pending: decision.uncached_tokens,
            decided_at: decision.decided_at,
            decision: Some(decision),
            start: self.faulted.starts[r as usize],
        };
        let engine = &mut self.engines[inst as usize];
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
            if let Some(end) = engine.start_step(now, &mut self.l2, &mut self.engine_events) {
                self.queue.push(end, Event::StepEnd(inst));
            }
        }
        inst
    }

    /// Replica `r` decides where request `i` goes.
    fn route(&mut self, now: u64, r: u32, i: usize) -> Decision {
        let config = self.config;
        let req = &self.workload.requests[i];
        if self.shared_load && config.routers > 1 {
            // Every replica routes on the exact cluster-wide load: the others' loads, summed.
            let peers = self.loads.peers_of(r, config.instances);
            self.replicas[r as usize].set_peer_loads(vec![(PEERS.to_string(), peers)]);
        }
        let tenant = self
            .tenant_names
            .entry(req.tenant)
            .or_insert_with(|| format!("tenant-{}", req.tenant));
        let rr = RouteRequest {
            keys: &req.keys,
            prompt_tokens: req.prompt_tokens,
        };
        let decision = self.replicas[r as usize]
            .route(tenant, &config.policy, MODEL, &rr, &[], false, now)
            .expect("the simulated pool is never empty or down");
        self.loads
            .start(r, decision.instance, decision.uncached_tokens);
        decision
    }

    /// Replica `r`'s decision to send `keys` to `inst` reaches the others as `Sharing` says.
    fn share(&mut self, now: u64, r: u32, inst: u32, keys: &[BlockKey]) {
        match self.config.sharing {
            Sharing::Isolated => {}
            Sharing::Perfect => {
                let whole = [SharedDecision {
                    instance: u64::from(inst),
                    keys: keys.to_vec(),
                }];
                for (o, other) in self.replicas.iter_mut().enumerate() {
                    if o as u32 != r {
                        other.apply_shared(&whole, now);
                    }
                }
            }
            // As the live routers do: what the core queued for its peers.
            Sharing::Delayed(d) => {
                let (batch, _) = self.replicas[r as usize].take_outbox();
                if batch.is_empty() {
                    return;
                }
                self.tally.shared += batch.len() as u64;
                let keys = batch.iter().map(|d| d.keys.len()).sum();
                let routers = self.config.routers as usize;
                if !self.budgets[r as usize].take(now / 1000, routers, keys) {
                    self.tally.shed += batch.len() as u64;
                    return;
                }
                let batch = Rc::new(batch);
                if let Some(log) = &mut self.faulted.shared {
                    log.push((now, r, batch.clone()));
                }
                let event = Event::Decisions {
                    from: r,
                    to: None,
                    batch,
                };
                self.queue.push(now + d, event);
            }
        }
    }

    /// Engine `inst` ends a step and starts the next, if it has work.
    fn step_end(&mut self, now: u64, inst: u32) {
        let engine = &mut self.engines[inst as usize];
        engine.complete_step(now, &mut self.l2, &mut self.engine_events);
        if let Some(end) = engine.start_step(now, &mut self.l2, &mut self.engine_events) {
            self.queue.push(end, Event::StepEnd(inst));
        }
    }

    /// A residency message of `host`'s agent reaches `router`, whose index learns the
    /// changes.
    fn residency(&mut self, now: u64, router: u32, host: u32, msg: &Msg) {
        let subscriber = &mut self.feed.subscribers[router as usize][host as usize];
        let outcome = subscriber.handle(now, msg.clone());
        self.apply_outcome(now, router, host, outcome);
    }

    /// What `router`'s view of `host`'s agent says to do, done as the live router does:
    /// the engine is observed after a snapshot or delta and not after a reset, whose
    /// removals drop what the agent reported; a resync asked is answered with a snapshot.
    fn apply_outcome(&mut self, now: u64, router: u32, host: u32, outcome: Outcome) {
        let (changes, observed, resync) = match outcome {
            Outcome::Apply { changes, .. } => (changes, true, false),
            Outcome::Reset {
                removed, resync, ..
            } => (removed, false, resync),
            Outcome::Nothing => return,
        };
        let replica = &mut self.replicas[router as usize];
        replica.set_observed(InstanceId(host), observed);
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
        if resync && self.feed.agents[host as usize] == Agent::Up {
            let delay = self.config.agent_feed_delay_us.unwrap_or(0);
            self.snapshot_to(now + delay, router, host);
        }
    }

    /// `host`'s agent sends `router` its snapshot at `now` (changes not yet sent go first to
    /// the routers already following it, so that the snapshot ends where its deltas go on).
    fn snapshot_to(&mut self, now: u64, router: u32, host: u32) {
        let Some(delay) = self.config.agent_feed_delay_us else {
            return;
        };
        let publisher = &mut self.feed.publishers[host as usize];
        let mut msgs = publisher.next_all(false, now / 1000);
        let flushed = msgs.len();
        msgs.extend(publisher.snapshot());
        for (n, msg) in msgs.into_iter().enumerate() {
            let msg = Rc::new(msg);
            for o in 0..self.config.routers {
                let to_router = o == router;
                if to_router != (n >= flushed) || !self.feed.delivers(o, host) {
                    continue;
                }
                let link = self.feed.links[o as usize].0;
                let event = Event::Residency {
                    router: o,
                    host,
                    msg: msg.clone(),
                    link,
                };
                self.queue.push(now + delay, event);
            }
        }
    }

    /// Accounts for what engine `host` just produced: tokens and completions to the tally
    /// and the routers' load, block changes to its agent, whose next delta goes out.
    fn account(&mut self, now: u64, host: u32) {
        let mut observed = false;
        let mut events = std::mem::take(&mut self.engine_events);
        for e in events.drain(..) {
            match e {
                EngineEvent::FirstToken {
                    id,
                    at_us,
                    gpu_hit_tokens,
                    l1_hit_tokens,
                    l2_hit_tokens,
                } => {
                    let hits = [gpu_hit_tokens, l1_hit_tokens, l2_hit_tokens];
                    self.first_token(id as usize, at_us, hits);
                }
                EngineEvent::Token { id, at_us } => {
                    let t = &mut self.tracks[id as usize];
                    self.tally.itl.push((at_us - t.last_token_us) as f64 / 1e3);
                    t.last_token_us = at_us;
                    self.tally.output_tokens += 1;
                }
                EngineEvent::Finished { id, at_us } => {
                    let i = id as usize;
                    self.tally.completed += 1;
                    let arrival_us = self.workload.requests[i].arrival_us;
                    self.tally.e2e.push((at_us - arrival_us) as f64 / 1e3);
                    self.finish(i, true);
                }
                EngineEvent::Rejected { id, .. } => {
                    self.tally.rejected += 1;
                    self.finish(id as usize, false);
                }
                EngineEvent::Stored { key, tier } | EngineEvent::Removed { key, tier }
                    if self.config.agent_feed_delay_us.is_some()
                        && self.feed.agents[host as usize] != Agent::Down =>
                {
                    self.feed.publishers[host as usize].record(Change {
                        scope: scope_of(tier),
                        key: key.0,
                        parent: self.feed.parent_of.get(&key).map(|p| p.0),
                        present: matches!(e, EngineEvent::Stored { .. }),
                    });
                    observed = true;
                }
                EngineEvent::Stored { .. } | EngineEvent::Removed { .. } => {}
            }
        }
        // Hand the (empty) buffer back, to keep its capacity.
        self.engine_events = events;
        if let (Some(delay), true) = (self.config.agent_feed_delay_us, observed) {
            self.publish(now, host, delay);
        }
    }

    /// Request `i`'s first token, at `at_us`, after the engine found `hits` prompt tokens
    /// cached on the GPU, in L1 and in L2.
    fn first_token(&mut self, i: usize, at_us: u64, hits: [u32; 3]) {
        let cached = hits.iter().sum();
        let req = &self.workload.requests[i];
        let context = u64::from(self.follow_up_context[i]) * u64::from(self.workload.block_tokens);
        if context > 0 {
            self.tally.follow_ups += 1;
            self.tally.follow_up_context += context;
            // The engine's hits are a prefix, GPU first, then the loaded blocks.
            let mut left = context;
            for (sum, &h) in self.tally.follow_up_hits.iter_mut().zip(&hits) {
                let part = u64::from(h).min(left);
                *sum += part;
                left -= part;
            }
        }
        if let Some(timeline) = &mut self.timeline {
            let since = req.arrival_us.saturating_sub(self.load.first_us);
            timeline.add(since, u64::from(req.prompt_tokens), u64::from(cached));
        }
        let t = &mut self.tracks[i];
        t.first_token_us = Some(at_us);
        t.last_token_us = at_us;
        self.tally.output_tokens += 1;
        self.tally.ttft_by_source[ttft_source(req.prompt_tokens, hits)]
            .push((at_us - req.arrival_us) as f64 / 1e3);
        if t.start != self.faulted.starts[t.router as usize] {
            return;
        }
        let replica = &mut self.replicas[t.router as usize];
        replica.first_token(InstanceId(t.instance), t.pending);
        self.loads
            .first_token(t.router, InstanceId(t.instance), t.pending);
        // The engine's usage reports what it found cached, as a live one does.
        if let Some(decision) = t.decision.take() {
            replica.report_cached(
                &decision,
                self.workload.block_tokens,
                req.prompt_tokens,
                CacheReport {
                    prompt_tokens: req.prompt_tokens,
                    cached_tokens: cached,
                },
            );
        }
    }

    /// Request `i` leaves its engine, completed or (not `prefilled`) rejected.
    fn finish(&mut self, i: usize, prefilled: bool) {
        let t = &self.tracks[i];
        if t.start != self.faulted.starts[t.router as usize] {
            return;
        }
        self.replicas[t.router as usize].finish(
            InstanceId(t.instance),
            t.pending,
            prefilled,
            t.decided_at,
        );
        self.loads
            .finish(t.router, InstanceId(t.instance), t.pending, prefilled);
    }

    /// `host`'s agent sends what it recorded; every router gets it `delay` later.
    fn publish(&mut self, now: u64, host: u32, delay: u64) {
        let Some(msg) = self.feed.publishers[host as usize].next(false, now / 1000) else {
            return;
        };
        // An agent started again sends nothing until its followers connect (its snapshot
        // then carries what it recorded meanwhile).
        if self.feed.agents[host as usize] != Agent::Up {
            return;
        }
        let msg = Rc::new(msg);
        for router in 0..self.config.routers {
            if !self.feed.delivers(router, host) {
                continue;
            }
            let event = Event::Residency {
                router,
                host,
                msg: msg.clone(),
                link: self.feed.links[router as usize].0,
            };
            self.queue.push(now + delay, event);
        }
    }

    /// `host`'s agent tells its followers it is alive, as it does when it has nothing to
    /// send (the simulated agents send only this one, before they die: no router polls a
    /// live agent's expiry).
    fn heartbeat(&mut self, now: u64, host: u32, delay: u64) {
        let Some(msg) = self.feed.publishers[host as usize].next(true, now / 1000) else {
            return;
        };
        let msg = Rc::new(msg);
        for router in 0..self.config.routers {
            if self.feed.delivers(router, host) {
                let event = Event::Residency {
                    router,
                    host,
                    msg: msg.clone(),
                    link: self.feed.links[router as usize].0,
                };
                self.queue.push(now + delay, event);
            }
        }
    }

    /// The figures of the finished run.
    fn report(self) -> RunReport {
        let config = self.config;
        let Tally {
            ttft_by_source,
            mut itl,
            mut e2e,
            completed,
            rejected,
            output_tokens,
            follow_ups,
            follow_up_context,
            follow_up_hits,
            shared,
            shed,
        } = self.tally;
        let mut ttft = Samples::merged(&ttft_by_source);
        let mut busy = Vec::new();
        let (mut prompt_tokens, mut gpu_hits, mut l1_hits, mut l2_hits, mut preemptions) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let (mut prefill_us, mut load_us, mut prefetched_blocks) = (0u64, 0u64, 0u64);
        for e in &self.engines {
            let s = e.stats();
            busy.push(s.busy_us as f64);
            prompt_tokens += s.prompt_tokens;
            gpu_hits += s.gpu_hit_tokens;
            l1_hits += s.l1_hit_tokens;
            l2_hits += s.l2_hit_tokens;
            preemptions += s.preemptions;
            prefill_us += s.prefill_us;
            load_us += s.load_us;
            prefetched_blocks += s.prefetched_blocks;
        }
        let per_request = |us: u64| us as f64 / 1e6 / completed.max(1) as f64;
        let mean_busy = busy.iter().sum::<f64>() / busy.len() as f64;
        let max_busy = busy.iter().copied().fold(0.0, f64::max);
        let makespan_s = (self.last_us.saturating_sub(self.load.first_us)) as f64 / 1e6;
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
        RunReport {
            policy: config.policy.strategy.name().to_string(),
            requests: self.workload.requests.len() as u64,
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
            prefill_gpu_s_per_request: per_request(prefill_us),
            load_s_per_request: per_request(load_us),
            prefetched_blocks,
            shared_decisions_shed: if shared > 0 {
                shed as f64 / shared as f64
            } else {
                0.0
            },
            makespan_s,
            follow_ups: {
                let of_context = |x: u64| {
                    if follow_up_context == 0 {
                        0.0
                    } else {
                        x as f64 / follow_up_context as f64
                    }
                };
                FollowUps {
                    requests: follow_ups,
                    context_tokens: follow_up_context,
                    hit_rate: of_context(follow_up_hits.iter().sum()),
                    hit_rate_gpu: of_context(follow_up_hits[0]),
                    hit_rate_l1: of_context(follow_up_hits[1]),
                    hit_rate_l2: of_context(follow_up_hits[2]),
                }
            },
            ttft_by_source: {
                let [gpu, tiers, computed] = ttft_by_source.map(TtftPart::of);
                TtftBySource {
                    gpu,
                    tiers,
                    computed,
                }
            },
            curves: Curves {
                ttft_cdf_ms: if ttft.is_empty() {
                    Vec::new()
                } else {
                    crate::stats::cdf(|q| ttft.quantile(q))
                },
                load: self.load.samples,
            },
            faults: match &self.timeline {
                Some(t) => config
                    .faults
                    .iter()
                    .map(|f| crate::faults::summarize(f, t, None))
                    .collect(),
                None => Vec::new(),
            },
            timeline: self.timeline,
        }
    }
}

/// Router, then host: whether the router follows the host's agent (every router every
/// agent, unless `residency_followers` bounds them). Names as the live shells use them:
/// the router's (`routers`, by index) and the agent's, hashed by `warmpath_residency::follow`.
fn follower_matrix(config: &ClusterConfig, routers: &[String]) -> Vec<Vec<bool>> {
    let names: Vec<&str> = routers.iter().map(String::as_str).collect();
    let mut follows =
        vec![vec![config.residency_followers.is_none(); config.instances as usize]; names.len()];
    if let Some(f) = config.residency_followers {
        for host in 0..config.instances {
            for chosen in
                warmpath_residency::follow::followers(&format!("agent-{host}"), &names, f as usize)
            {
                let r = names
                    .iter()
                    .position(|n| *n == chosen)
                    .expect("one of the routers");
                follows[r][host as usize] = true;
            }
        }
    }
    follows
}

/// The router replicas of a run, each serving the one pool of every instance.
/// `follows`: [`follower_matrix`]'s, which the feed sends by.
fn replicas(config: &ClusterConfig, follows: &[Vec<bool>]) -> Vec<RouterCore> {
    let pool = pool(config);
    (0..config.routers)
        .map(|r| {
            // With the agent feed, a router sees the caches of the engines whose agents it
            // follows.
            replica(config, r, &pool, |i| {
                config.agent_feed_delay_us.is_some() && follows[r as usize][i as usize]
            })
        })
        .collect()
}

/// The one pool of every instance.
fn pool(config: &ClusterConfig) -> [CorePool; 1] {
    [CorePool {
        model: MODEL.to_string(),
        instances: (0..config.instances)
            .map(|i| InstanceSpec {
                name: format!("instance-{i}"),
                key: u64::from(i),
            })
            .collect(),
        ..CorePool::default()
    }]
}

/// Replica `r` as it starts, seeing the caches of the instances `observed` says.
fn replica(
    config: &ClusterConfig,
    r: u32,
    pool: &[CorePool],
    observed: impl Fn(u32) -> bool,
) -> RouterCore {
    let mut core = RouterCore::new(
        CoreConfig {
            index: config.index,
            seed: config.seed ^ (u64::from(r) + 1).wrapping_mul(0x9e37_79b9),
            ..CoreConfig::default()
        },
        config.profile.clone(),
    );
    core.set_pools(pool);
    let capacity = u64::from(config.engine.gpu_blocks) * u64::from(config.engine.block_tokens);
    for i in 0..config.instances {
        core.set_kv_capacity(InstanceId(i), capacity);
        core.set_observed(InstanceId(i), observed(i));
    }
    if matches!(config.sharing, Sharing::Delayed(_)) {
        core.enable_sharing();
    }
    core
}

fn validate(config: &ClusterConfig, workload: &Workload) -> Result<(), SimError> {
    if config.instances == 0 {
        return Err(SimError::NoInstances);
    }
    if config.routers == 0 {
        return Err(SimError::NoRouters);
    }
    for f in &config.faults {
        f.check(config.routers)?;
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
    use warmpath_index::keys::reported;
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
            gossip_budget_keys_per_s: warmpath_index::router::DECISION_BUDGET_KEYS_PER_S,
            index: IndexConfig::default(),
            l2_blocks: 0,
            max_prompt_tokens: 1 << 20,
            seed: 7,
            prefetch: false,
            residency_followers: None,
            faults: Vec::new(),
            timeline_us: None,
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
    fn ttft_is_split_by_where_the_prompt_was_found() {
        // (prompt, GPU / L1 / L2 hits, class): 0 gpu, 1 tiers, 2 computed.
        let cases = [
            (1000, [1000, 0, 0], 0),
            (1000, [900, 50, 50], 0),
            (1000, [900, 0, 0], 0),
            (1000, [899, 0, 0], 2),
            (1000, [500, 450, 0], 1),
            (1000, [0, 0, 950], 1),
            (1000, [0, 0, 0], 2),
            (0, [0, 0, 0], 0),
        ];
        for (prompt, hits, want) in cases {
            assert_eq!(ttft_source(prompt, hits), want, "{prompt} {hits:?}");
        }
        // A run: every first token falls in one class, and only tiers fill `tiers`.
        let w = small(SyntheticKind::Conversation, 400);
        let mut c = config(Strategy::LeastLoaded, 4, 1, 200);
        let parts = |r: &RunReport| r.ttft_by_source.parts().map(|p| p.requests);
        let without = run(&c, &w);
        c.engine.l1_blocks = 2_000;
        let with = run(&c, &w);
        for r in [&without, &with] {
            assert_eq!(parts(r).iter().sum::<u64>(), r.completed, "{:?}", parts(r));
            for p in r.ttft_by_source.parts() {
                assert!(p.requests == 0 || p.ttft_ms_p50 <= p.ttft_ms_p90, "{p:?}");
            }
        }
        assert_eq!(parts(&without)[1], 0);
        assert!(parts(&with)[1] > 0, "{:?}", parts(&with));
    }

    #[test]
    fn one_unbounded_instance_reaches_the_ideal() {
        for kind in SyntheticKind::ALL {
            let w = small(kind, 300);
            let r = run(&config(Strategy::RoundRobin, 1, 1, 10_000_000), &w);
            let ideal = ideal_hit_rate(&w);
            assert_eq!(r.completed, 300);
            // A longdoc session that opens while another still prefills its document
            // computes it too (an engine hits only computed blocks): a little below.
            let slack = if kind == SyntheticKind::Longdoc {
                0.01
            } else {
                1e-9
            };
            assert!(
                r.hit_rate <= ideal + 1e-9 && ideal - r.hit_rate < slack,
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

    /// The cluster's state once every event up to `until_us` has been handled.
    fn run_until<'a>(config: &'a ClusterConfig, w: &'a Workload, until_us: u64) -> Run<'a> {
        validate(config, w).expect("valid run");
        let mut run = Run::new(config, w);
        while run.queue.heap.peek().is_some_and(|e| e.0 .0 <= until_us) {
            let (now, event) = run.queue.pop().expect("peeked");
            run.advance_clock(now);
            if let Some(host) = event.and_then(|e| run.handle(now, e)) {
                run.account(now, host);
            }
        }
        run
    }

    /// 100 requests of distinct prompts (no two share a block), 10 per second from 0: all
    /// routed and answered well before the faults of the tests below strike at 30 s.
    fn distinct_prompts() -> Workload {
        let rows: Vec<AzureRow> = (0..100)
            .map(|i| AzureRow {
                arrival_us: i * 100_000,
                context_tokens: 1024 + (i as u32 % 5) * 64,
                generated_tokens: 4,
            })
            .collect();
        azure_workload("distinct", &rows, 64, 5)
    }

    /// 4 routers sharing decisions after 50 ms, each agent followed by 2 of them.
    fn four_routers(faults: &str) -> ClusterConfig {
        let mut c = config(Strategy::PrefixAware, 8, 4, 10_000);
        c.sharing = Sharing::Delayed(50_000);
        c.residency_followers = Some(2);
        c.faults = faults
            .split(',')
            .filter(|f| !f.is_empty())
            .map(|f| f.parse().expect("a fault"))
            .collect();
        c.timeline_us = Some(1_000_000);
        c
    }

    /// Blocks of `keys` router `r` thinks `instance` holds, in any tier, at `now`.
    fn held(run: &mut Run<'_>, r: u32, instance: u32, keys: &[BlockKey], now: u64) -> u32 {
        let decision = run.replicas[r as usize]
            .dry_run(
                "tenant-0",
                &run.config.policy,
                MODEL,
                &RouteRequest {
                    keys,
                    prompt_tokens: keys.len() as u32 * 64,
                },
                now,
            )
            .expect("a pool");
        let candidates = decision.candidates.expect("explained");
        let c = candidates
            .iter()
            .find(|c| c.instance.0 == instance)
            .expect("every instance is a candidate");
        c.gpu_blocks.max(c.l1_blocks).max(c.l2_blocks)
    }

    /// Each router's observed holders are exactly what its views of the agents it follows
    /// hold (the workload is over: nothing else changes them).
    fn observed_match_views(run: &Run<'_>) {
        for (r, replica) in run.replicas.iter().enumerate() {
            let views: usize = run.feed.subscribers[r].iter().map(Subscriber::len).sum();
            assert_eq!(replica.index_stats().observed_holders, views, "router {r}");
        }
    }

    #[test]
    fn lost_agents_expire_at_their_followers_and_come_back_from_the_replay() {
        let w = distinct_prompts();
        let mut c = four_routers("agents-lost@30s:0.25:for=10s:expiry=3s:resync=500ms");
        // Sampled, as agents of 16-token pools report (these blocks are larger: every one
        // would be reported at the protocol's rate, record 0117).
        c.index.report_every = Some(4);
        let lost = Fault::hosts_lost(0.25, 8);
        assert_eq!(lost, 2);
        let followed = |run: &Run<'_>, h: u32| -> Vec<u32> {
            (0..4)
                .filter(|&r| run.feed.follows[r as usize][h as usize])
                .collect()
        };
        // Before: every follower observes the engines of hosts 0 and 1.
        let before = run_until(&c, &w, 29_000_000);
        observed_match_views(&before);
        for h in 0..lost {
            assert_eq!(followed(&before, h).len(), 2);
            for r in followed(&before, h) {
                assert!(before.replicas[r as usize].instances()[h as usize].observed);
                assert!(!before.feed.subscribers[r as usize][h as usize].is_empty());
            }
        }
        // Silent for less than the expiry: still held.
        let silent = run_until(&c, &w, 32_000_000);
        for h in 0..lost {
            for r in followed(&silent, h) {
                assert!(!silent.feed.subscribers[r as usize][h as usize].is_empty());
            }
        }
        // Past the expiry: the followers dropped what those agents reported, and only that.
        let expired = run_until(&c, &w, 33_500_000);
        observed_match_views(&expired);
        for h in 0..c.instances {
            for r in followed(&expired, h) {
                let dead = h < lost;
                assert_eq!(
                    expired.replicas[r as usize].instances()[h as usize].observed,
                    !dead,
                    "router {r}, host {h}"
                );
                assert_eq!(
                    expired.feed.subscribers[r as usize][h as usize].is_empty(),
                    dead,
                    "router {r}, host {h}"
                );
            }
        }
        // The engines kept their GPU caches.
        for h in 0..lost {
            assert!(!expired.engines[h as usize].gpu_keys().is_empty());
        }
        // Back at 40 s, connected at 40.5 s: a new epoch's snapshot of the engine's blocks
        // (those of reported keys, record 0115).
        let back = run_until(&c, &w, 40_600_000);
        observed_match_views(&back);
        for h in 0..lost {
            let gpu = back.engines[h as usize].gpu_keys();
            let reported = gpu.iter().filter(|&&k| reported(k, 4)).count();
            assert!(
                reported > 0 && reported < gpu.len() / 2,
                "{reported} of {}",
                gpu.len()
            );
            assert_eq!(back.feed.publishers[h as usize].len(), reported);
            for r in followed(&back, h) {
                assert!(back.replicas[r as usize].instances()[h as usize].observed);
                assert_eq!(
                    back.feed.subscribers[r as usize][h as usize].len(),
                    reported
                );
            }
        }
    }

    #[test]
    fn a_partition_holds_decisions_back_until_it_heals() {
        let w = distinct_prompts();
        // No feed: what a router holds is what was routed. Router 3 is cut off from 0..3
        // from 2 s to 5 s; held-back decisions arrive 1 s after the heal.
        let mut c = four_routers("partition@2s:0.25:for=3s:catch-up=1s");
        c.agent_feed_delay_us = None;
        let mut run = run_until(&c, &w, 4_500_000);
        let (mut across, mut within) = (0, 0);
        for (i, req) in w.requests.iter().enumerate() {
            // Decided inside the partition, shared by now.
            if !(2_000_000..4_400_000).contains(&req.arrival_us) {
                continue;
            }
            let (from, inst) = (run.tracks[i].router, run.tracks[i].instance);
            for o in (0..4).filter(|&o| o != from) {
                let n = held(&mut run, o, inst, &req.keys, 4_500_000);
                if (o == 3) != (from == 3) {
                    assert_eq!(n, 0, "request {i} from router {from} reached {o}");
                    across += 1;
                } else {
                    assert!(n > 0, "request {i} from router {from} missing at {o}");
                    within += 1;
                }
            }
        }
        assert!(
            across > 10 && within > 10,
            "{across} across, {within} within"
        );
        // After the heal and its catch-up, every router has every decision.
        let mut healed = run_until(&c, &w, 6_100_000);
        for (i, req) in w.requests.iter().enumerate() {
            if req.arrival_us >= 6_000_000 {
                break;
            }
            let (from, inst) = (healed.tracks[i].router, healed.tracks[i].instance);
            for o in (0..4).filter(|&o| o != from) {
                assert!(
                    held(&mut healed, o, inst, &req.keys, 6_100_000) > 0,
                    "{i} at {o}"
                );
            }
        }
    }

    #[test]
    fn a_restarted_router_starts_empty_and_catches_up() {
        let w = distinct_prompts();
        let c = four_routers("router-restart@30s:router=1:resync=300ms:catch-up=800ms");
        let before = run_until(&c, &w, 29_000_000);
        assert!(before.replicas[1].index_stats().holders > 0);
        // Restarted: nothing in its index, nothing observed.
        let restarted = run_until(&c, &w, 30_000_000);
        let fresh = &restarted.replicas[1];
        assert_eq!(fresh.index_stats().holders, 0);
        assert!(fresh.instances().iter().all(|i| !i.observed));
        assert_eq!(restarted.faulted.starts[1], 1);
        // Its agents' snapshots (at 30.3 s, 10 ms on the way): observed again, no decision
        // yet.
        let resynced = run_until(&c, &w, 30_400_000);
        observed_match_views(&resynced);
        let r1 = &resynced.replicas[1];
        assert!(r1.index_stats().observed_holders > 0);
        assert_eq!(r1.index_stats().predicted_holders, 0);
        for h in 0..c.instances {
            assert_eq!(
                r1.instances()[h as usize].observed,
                resynced.feed.follows[1][h as usize]
            );
        }
        // Caught up at 30.8 s: its peers' decisions, all of them still alive.
        let mut caught_up = run_until(&c, &w, 30_900_000);
        assert!(caught_up.replicas[1].index_stats().predicted_holders > 0);
        let mut checked = 0;
        for (i, req) in w.requests.iter().enumerate() {
            let (from, inst) = (caught_up.tracks[i].router, caught_up.tracks[i].instance);
            if from != 1 {
                assert!(
                    held(&mut caught_up, 1, inst, &req.keys, 30_900_000) > 0,
                    "{i}"
                );
                checked += 1;
            }
        }
        assert!(checked > 50, "{checked}");
    }

    #[test]
    fn faults_report_a_timeline_and_their_cost_and_replay_the_same() {
        let w = small(SyntheticKind::Conversation, 600);
        let mut c = config(Strategy::KvAware, 8, 4, 400);
        c.sharing = Sharing::Delayed(20_000);
        c.residency_followers = Some(2);
        c.timeline_us = Some(1_000_000);
        c.faults = [
            "agents-lost@20s:0.5:for=10s",
            "router-restart@25s",
            "partition@30s:0.25:for=5s",
        ]
        .iter()
        .map(|f| f.parse().unwrap())
        .collect();
        let r = run(&c, &w);
        assert_eq!(r, run(&c, &w));
        let t = r.timeline.as_ref().expect("a timeline");
        assert!(t.windows.len() >= 50, "{}", t.windows.len());
        let prompt: u64 = t.windows.iter().map(|w| w.prompt_tokens).sum();
        assert_eq!(
            prompt,
            w.requests
                .iter()
                .map(|r| u64::from(r.prompt_tokens))
                .sum::<u64>()
        );
        assert_eq!(r.faults.len(), 3);
        assert_eq!(r.faults[0].fault, "agents-lost@20s:0.5:for=10s");
        assert!(r
            .faults
            .iter()
            .all(|f| f.before.is_some() && f.dip.is_some()));
        // Without faults or timeline the report is as before.
        c.faults.clear();
        c.timeline_us = None;
        let plain = run(&c, &w);
        assert!(plain.timeline.is_none() && plain.faults.is_empty());
    }

    #[test]
    fn a_fault_that_does_not_fit_the_cluster_is_an_error() {
        let w = small(SyntheticKind::Chat, 20);
        let mut c = config(Strategy::KvAware, 2, 2, 1000);
        c.faults = vec!["router-restart@1s:router=2".parse().unwrap()];
        assert_eq!(
            simulate(&c, &w, &mut |_| {}).unwrap_err(),
            SimError::Fault(FaultError::NoSuchRouter {
                router: 2,
                routers: 2
            })
        );
    }
}
