//! Routing policies: pure functions of the request, the index view, the load view and the
//! tenant's configuration.
//!
//! - `round-robin`: the next candidate in turn.
//! - `least-loaded`: fewest in-flight requests, ties broken at random.
//! - `prefix-aware` (SageMaker semantics, generalised): match up to `prefix_blocks` of the
//!   prompt and rank candidates by what their match is worth (see *Tiers* below: blocks on
//!   the GPU count whole, blocks in host memory (L1) or L2 count for the prefill their load
//!   saves), then by in-flight requests, then by how much cached data they hold. The best
//!   candidate wins unless it is *saturated* (below); then the request *spills* to the best candidate that is not. Among candidates that hold none
//!   of the prompt, the one holding the least cached data comes first (then the least
//!   loaded), so new prefixes spread over the fleet's memory, as the peers' radix trees
//!   send them to their smallest tree; saturation still keeps the load even.
//! - `kv-aware`: minimise the estimated time to first token: queue (pending prefill on
//!   the instance, in chunks of [`PREFILL_CHUNK_TOKENS`]), plus prefill of the uncached
//!   tokens, plus loading the tokens found in L1 or L2, with the model profile's costs;
//!   plus, on an instance whose cache is full, [`EVICTION_WEIGHT`] times the prefill of
//!   the uncached tokens, for the cached data computing them evicts (what a placement
//!   takes from the requests to come).
//!   Saturated candidates are skipped. A prompt no candidate holds any of goes where
//!   the least cached data is held, as under prefix-aware. With a temperature above zero
//!   it samples, favouring low estimates.
//!
//! # Saturation, judged against the fleet
//!
//! A fixed concurrency threshold suits one workload: too high and a hot prefix piles the
//! fleet onto its owner, too low and conversations lose their history to needless
//! spills. So a candidate is saturated when its in-flight count reaches
//!
//! ```text
//! max(min + BALANCE_SLACK + own_history_tokens / AFFINITY_TOKENS_PER_REQUEST,
//!     BALANCE_RATIO × min)
//! ```
//!
//! where `min` is the least loaded candidate's count, or when it reaches the tenant's
//! `concurrency_threshold` (SageMaker's knob, kept as an upper bound). The history term is
//! what the candidate holds of the request beyond its *shared* prefix (the deepest block
//! the index saw continued in several ways: a system prompt, a template, a repository):
//! a conversation keeps its owner while the owner is a few requests busier than the
//! fleet, since moving it recomputes its history, but a new session that matches only the
//! shared system prompt moves as soon as its owner is two requests busier than the least
//! loaded instance. That is the hot-prefix rule: a prefix whose owners are saturated gains
//! owners, and the spill ranks candidates holding the prefix (in GPU, host memory or L2)
//! first. One default serves every workload; `warmpath simulate` and
//! `bench/sim_targets.py` show it on each.
//!
//! # Tiers
//!
//! A block on the GPU is free to reuse; one in the host's memory (L1) or in L2 must be
//! loaded, which costs `profile.load_ms` against the prefill it saves. So every policy
//! ranks what a candidate holds by where it holds it: a match is worth its GPU tokens,
//! plus its L1 tokens times the share of their prefill that loading saves, plus its L2
//! tokens likewise ([`match_worth_tokens`]; with the default profile an L1 token is worth
//! about two thirds of a GPU token and an L2 token about a third). A session therefore
//! stays with the instance that holds it on the GPU unless that instance is saturated, and
//! an L1 or L2 copy draws a request only where loading it beats recomputing there, and only
//! to a candidate at most [`BALANCE_SLACK`] requests busier than the least loaded one:
//! past that, what a candidate holds beyond its GPU counts for nothing. A copy sits in host
//! memory because that host's GPU evicted it for room, so a busier host that holds a
//! session only there is likely still short of GPU memory, and a request drawn back to it
//! waits for room where a less loaded instance would have computed it (in the simulator,
//! conversation on GPUs holding a third of the working set: TTFT p99 with L1 over without,
//! geometric mean over 32 seeds, 1.44× → 1.04× for kv-aware at one router, 1.21× → 0.90× at
//! four; saturation's ratio term alone let such a host draw requests up to twice the least
//! loaded one's count). The
//! history that makes a candidate worth keeping (saturation's `own_tokens`) is its GPU
//! history only: a move loses a load, not a recompute, of what sits in host memory or L2.
//! kv-aware prices the same
//! loads in its estimate, and charges the eviction term for every token that must come
//! into GPU memory, loaded or computed. Without tiers, worth is the GPU depth and every
//! ranking is what it was before tiers were priced.
//!
//! Every decision can carry an [`Explanation`]: each candidate's matched blocks per tier,
//! load and score.

use crate::cost::{ModelProfile, Tier};
use crate::index::{InstanceMatch, MatchScratch, PrefixIndex};
use crate::keys::BlockKey;
use crate::load::{InstanceLoad, LoadView};
use crate::rng::Rng;
use crate::InstanceId;
use serde::{Deserialize, Serialize};
use std::str::FromStr;

/// Prefill chunk the queue estimate assumes (vLLM's default step budget).
pub const PREFILL_CHUNK_TOKENS: u64 = 8192;

/// In-flight requests a candidate may carry above the least loaded one before it counts
/// as saturated (see the module docs).
pub const BALANCE_SLACK: f64 = 2.0;
/// A candidate carrying this many times the least loaded one's requests is saturated.
pub const BALANCE_RATIO: f64 = 2.0;
/// Tokens of a request's own history on a candidate worth one more in-flight request of
/// slack there: moving the request would recompute them.
pub const AFFINITY_TOKENS_PER_REQUEST: f64 = 500.0;
/// What a placement on a full cache pays for the data it evicts, in multiples of the
/// prefill time of the tokens it computes: what it evicts (a template, a conversation's
/// history) would be reused several times. Chosen in the simulator: at 1, kv-aware still
/// gave way under scarce memory (bots on 4 × 60k-token caches at 20 requests/s, without
/// the agents' feed: 85.6% hit, TTFT p99 15 s); at 4, 88.8% and 1.9 s, and no workload
/// of `bench/sim_targets.py` lost more than half a point.
pub const EVICTION_WEIGHT: f64 = 4.0;
/// kv-aware estimates closer than this (ms) are treated as equal, and the tie goes to the
/// candidate with fewer requests in flight: pending prefill alone would pile new sessions
/// onto an instance busy decoding (in the simulator, 5 ms gave chat on 4 × 120k-token
/// caches at 20 requests/s 0.3–2 points more hits than 1 ms over four seeds).
pub const ESTIMATE_RESOLUTION_MS: f64 = 5.0;

/// A routing strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    RoundRobin,
    LeastLoaded,
    PrefixAware,
    KvAware,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::RoundRobin,
        Strategy::LeastLoaded,
        Strategy::PrefixAware,
        Strategy::KvAware,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::RoundRobin => "round-robin",
            Strategy::LeastLoaded => "least-loaded",
            Strategy::PrefixAware => "prefix-aware",
            Strategy::KvAware => "kv-aware",
        }
    }

    /// Whether the strategy reads the prefix index.
    pub fn uses_index(self) -> bool {
        matches!(self, Strategy::PrefixAware | Strategy::KvAware)
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown strategy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown routing strategy {0:?}; expected one of round-robin, least-loaded, prefix-aware, kv-aware")]
pub struct UnknownStrategy(pub String);

impl FromStr for Strategy {
    type Err = UnknownStrategy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownStrategy(s.to_string()))
    }
}

/// A tenant's routing configuration.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    pub strategy: Strategy,
    /// Blocks of the prompt used for matching (SageMaker's prefix length); 0 = all.
    pub prefix_blocks: u32,
    /// In-flight requests at which the preferred instance is skipped; 0 = no limit.
    pub concurrency_threshold: u32,
    /// kv-aware sampling temperature; 0 picks the lowest estimate.
    pub temperature: f64,
    /// Tokens per block of the keys the request carries.
    pub block_tokens: u32,
}

impl PolicyConfig {
    pub fn new(strategy: Strategy, block_tokens: u32) -> Self {
        PolicyConfig {
            strategy,
            prefix_blocks: 0,
            concurrency_threshold: 0,
            temperature: 0.0,
            block_tokens,
        }
    }

    fn over_threshold(&self, in_flight: u32) -> bool {
        self.concurrency_threshold > 0 && in_flight >= self.concurrency_threshold
    }
}

/// The fleet's load as saturation judges it (see the module docs).
#[derive(Clone, Copy, Debug)]
struct Balance {
    /// In-flight requests of the least loaded candidate.
    min: f64,
}

impl Balance {
    fn of(candidates: &[InstanceId], load: &LoadView) -> Balance {
        let min = candidates
            .iter()
            .map(|&c| load.get(c).in_flight)
            .min()
            .unwrap_or(0);
        Balance {
            min: f64::from(min),
        }
    }

    /// In-flight count at which a candidate holding `own_tokens` of the request beyond
    /// its shared prefix counts as saturated.
    fn limit(&self, own_tokens: f64) -> f64 {
        (self.min + BALANCE_SLACK + own_tokens / AFFINITY_TOKENS_PER_REQUEST)
            .max((BALANCE_RATIO * self.min).ceil())
    }

    fn saturated(&self, config: &PolicyConfig, in_flight: u32, own_tokens: f64) -> bool {
        f64::from(in_flight) >= self.limit(own_tokens) || config.over_threshold(in_flight)
    }

    /// `m` as a candidate with `in_flight` requests may count it: whole where the candidate
    /// is at most [`BALANCE_SLACK`] requests busier than the least loaded one, else its GPU
    /// part alone (see the module docs, *Tiers*).
    fn countable(&self, m: InstanceMatch, in_flight: u32) -> InstanceMatch {
        if f64::from(in_flight) <= self.min + BALANCE_SLACK {
            m
        } else {
            gpu_only(m)
        }
    }
}

/// `m` without what it holds in host memory or L2.
fn gpu_only(m: InstanceMatch) -> InstanceMatch {
    InstanceMatch {
        l1: m.gpu,
        l2: m.gpu,
        ..m
    }
}

/// What a policy needs to know of a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Prefix keys of the prompt's complete blocks.
    pub keys: &'a [BlockKey],
    pub prompt_tokens: u32,
}

/// The shared state a policy reads.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub index: &'a PrefixIndex,
    pub load: &'a LoadView,
    /// GPU KV capacity of each instance in tokens, by instance id (0 or absent: unknown).
    pub kv_capacity: &'a [u64],
    pub profile: &'a ModelProfile,
    /// Microseconds, on the index's clock.
    pub now: u64,
}

/// A router's mutable policy state: the round-robin cursor, the tie-breaking generator
/// and match buffers.
#[derive(Clone, Debug)]
pub struct PolicyState {
    next_rr: u64,
    rng: Rng,
    scratch: MatchScratch,
    kv: Vec<KvFigures>,
    /// kv-aware: the positions of the candidates holding some of the prompt beyond their
    /// GPU (a buffer).
    kv_tiered: Vec<u32>,
}

impl PolicyState {
    pub fn new(seed: u64) -> Self {
        PolicyState {
            next_rr: 0,
            rng: Rng::new(seed),
            scratch: MatchScratch::default(),
            kv: Vec::new(),
            kv_tiered: Vec::new(),
        }
    }
}

/// Why the chosen instance won.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    RoundRobin,
    LeastLoaded,
    /// It held the longest prefix and was not saturated.
    LongestPrefix,
    /// A better-matching instance was saturated.
    Spilled,
    /// No candidate held any of the prefix.
    NoMatch,
    /// Every candidate was saturated: the least loaded took it.
    AllSaturated,
    /// Lowest estimated time to first token.
    LowestCost,
}

impl Reason {
    /// The reason's name, as explanations and metrics label it.
    pub fn name(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round-robin",
            Reason::LeastLoaded => "least-loaded",
            Reason::LongestPrefix => "longest-prefix",
            Reason::Spilled => "spilled",
            Reason::NoMatch => "no-match",
            Reason::AllSaturated => "all-saturated",
            Reason::LowestCost => "lowest-cost",
        }
    }
}

/// One candidate as the policy saw it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub instance: InstanceId,
    /// Cumulative matched blocks per tier (see [`InstanceMatch`]).
    pub gpu_blocks: u32,
    pub l1_blocks: u32,
    pub l2_blocks: u32,
    pub in_flight: u32,
    pub pending_prefill_tokens: u64,
    /// kv-aware: the estimated time to first token, ms; prefix-aware: what the match is
    /// worth, in GPU-equivalent blocks, as the candidate may count it (see the module docs,
    /// *Tiers*: a busy candidate's blocks beyond its GPU count for nothing).
    pub score: f64,
}

/// A routing decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub instance: InstanceId,
    pub reason: Reason,
    /// Blocks of the prompt that were matched against the index.
    pub blocks_considered: u32,
    /// What the chosen instance was found to hold.
    pub matched: InstanceMatch,
    /// Prompt tokens the chosen instance is expected to compute (the prompt less what it
    /// holds in any tier): what the load view should count as its pending prefill.
    pub uncached_tokens: u32,
    /// Every candidate, when an explanation was asked for.
    pub candidates: Option<Vec<Candidate>>,
    /// When the decision was made (the view's `now`).
    pub decided_at: u64,
}

/// Why no decision could be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// The pool has no healthy instance.
    #[error("no healthy instance to route to")]
    NoCandidates,
}

/// Picks an instance among `candidates` for `req`. See the module docs.
pub fn route(
    config: &PolicyConfig,
    req: &RouteRequest<'_>,
    candidates: &[InstanceId],
    view: &View<'_>,
    state: &mut PolicyState,
    explain: bool,
) -> Result<Decision, RouteError> {
    if candidates.is_empty() {
        return Err(RouteError::NoCandidates);
    }
    let considered = match config.prefix_blocks {
        0 => req.keys,
        n => &req.keys[..req.keys.len().min(n as usize)],
    };
    if config.strategy.uses_index() {
        view.index.match_into(
            considered,
            config.block_tokens,
            view.now,
            &mut state.scratch,
        );
    }
    let (instance, reason, scores) = match config.strategy {
        Strategy::RoundRobin => {
            let i = (state.next_rr % candidates.len() as u64) as usize;
            state.next_rr = state.next_rr.wrapping_add(1);
            (candidates[i], Reason::RoundRobin, None)
        }
        Strategy::LeastLoaded => {
            let pick = pick_best(candidates, &mut state.rng, |i| {
                std::cmp::Reverse(view.load.get(i).in_flight)
            });
            (pick, Reason::LeastLoaded, None)
        }
        Strategy::PrefixAware => {
            let (pick, reason) = prefix_aware(config, req, candidates, view, state);
            (pick, reason, None)
        }
        Strategy::KvAware => {
            let (pick, reason, scores) = kv_aware(config, req, candidates, view, state, explain);
            (pick, reason, scores)
        }
    };
    let depths = |i: InstanceId| {
        if config.strategy.uses_index() {
            state.scratch.of(i)
        } else {
            InstanceMatch {
                instance: i,
                ..InstanceMatch::default()
            }
        }
    };
    let explanation = explain.then(|| {
        // prefix-aware's score is what it ranked: the match as the candidate may count it.
        let balance = Balance::of(candidates, view.load);
        candidates
            .iter()
            .enumerate()
            .map(|(pos, &i)| {
                let m = depths(i);
                let load = view.load.get(i);
                Candidate {
                    instance: i,
                    gpu_blocks: m.gpu,
                    l1_blocks: m.l1,
                    l2_blocks: m.l2,
                    in_flight: load.in_flight,
                    pending_prefill_tokens: load.pending_prefill_tokens,
                    score: scores.as_ref().map_or_else(
                        || {
                            let counted = balance.countable(m, load.in_flight);
                            match_worth_tokens(view.profile, config.block_tokens, &counted)
                                / f64::from(config.block_tokens.max(1))
                        },
                        |s: &Vec<f64>| s[pos],
                    ),
                }
            })
            .collect()
    });
    let matched = depths(instance);
    let cached = u64::from(matched.l2) * u64::from(config.block_tokens);
    let uncached_tokens = u64::from(req.prompt_tokens)
        .saturating_sub(cached)
        .max(1)
        .min(u64::from(req.prompt_tokens)) as u32;
    Ok(Decision {
        instance,
        reason,
        blocks_considered: considered.len() as u32,
        matched,
        uncached_tokens,
        candidates: explanation,
        decided_at: view.now,
    })
}

/// Of the candidates whose `figures` (one per candidate) are `eligible`, the one with the
/// greatest `rank`, ties broken uniformly at random: [`pick_best`] over those candidates.
fn pick_best_where<T, K: Ord>(
    candidates: &[InstanceId],
    figures: &[T],
    eligible: impl Fn(&T) -> bool,
    rng: &mut Rng,
    mut rank: impl FnMut(InstanceId, &T) -> K,
) -> InstanceId {
    let mut best: Option<(InstanceId, K)> = None;
    let mut ties = 1u64;
    for (&c, f) in candidates.iter().zip(figures).filter(|(_, f)| eligible(f)) {
        let r = rank(c, f);
        let Some((best_c, best_rank)) = &mut best else {
            best = Some((c, r));
            continue;
        };
        match r.cmp(best_rank) {
            std::cmp::Ordering::Greater => {
                (*best_c, *best_rank) = (c, r);
                ties = 1;
            }
            std::cmp::Ordering::Equal => {
                ties += 1;
                if rng.below(ties) == 0 {
                    *best_c = c;
                }
            }
            std::cmp::Ordering::Less => {}
        }
    }
    best.expect("some candidate is eligible").0
}

/// The candidate with the greatest `rank`, ties broken uniformly at random.
fn pick_best<K: Ord>(
    candidates: &[InstanceId],
    rng: &mut Rng,
    mut rank: impl FnMut(InstanceId) -> K,
) -> InstanceId {
    pick_best_where(candidates, candidates, |_| true, rng, |c, _| rank(c))
}

/// The share of the prefill of tokens `from..to` (after `from` cached ones) that loading
/// them from `tier` instead saves, in `[0, 1]`.
fn load_saves(profile: &ModelProfile, tier: Tier, from: u64, to: u64) -> f64 {
    if to <= from {
        return 0.0;
    }
    let compute = chunked_prefill_ms(profile, to) - chunked_prefill_ms(profile, from);
    if compute <= 0.0 {
        return 0.0;
    }
    (1.0 - profile.load_ms(tier, to - from) / compute).clamp(0.0, 1.0)
}

/// What a match is worth, in GPU-equivalent tokens: its GPU tokens, plus its L1 and L2
/// tokens each times the share of their prefill that loading them saves (see the module
/// docs, *Tiers*). Without L1 or L2 entries it is exactly `m.gpu × block_tokens`.
pub fn match_worth_tokens(profile: &ModelProfile, block_tokens: u32, m: &InstanceMatch) -> f64 {
    let bt = u64::from(block_tokens);
    let gpu = u64::from(m.gpu) * bt;
    let l1 = u64::from(m.l1.max(m.gpu)) * bt;
    let l2 = u64::from(m.l2.max(m.l1).max(m.gpu)) * bt;
    let mut worth = gpu as f64;
    if l1 > gpu {
        worth += (l1 - gpu) as f64 * load_saves(profile, Tier::L1, gpu, l1);
    }
    if l2 > l1 {
        worth += (l2 - l1) as f64 * load_saves(profile, Tier::L2, l1, l2);
    }
    worth
}

/// [`match_worth_tokens`] in thousandths of a token, for ranking: equal depths give equal
/// ranks, and distinct GPU-only depths keep their order.
fn worth_rank(view: &View<'_>, config: &PolicyConfig, m: &InstanceMatch) -> u64 {
    (match_worth_tokens(view.profile, config.block_tokens, m) * 1000.0).round() as u64
}

/// Tokens `instance` holds on its GPU of the last match beyond its shared prefix: the
/// request's own history there, which a move would recompute.
fn own_tokens(config: &PolicyConfig, scratch: &MatchScratch, instance: InstanceId) -> f64 {
    let m = scratch.of(instance);
    f64::from(m.gpu.saturating_sub(scratch.result.shared)) * f64::from(config.block_tokens)
}

fn prefix_aware(
    config: &PolicyConfig,
    req: &RouteRequest<'_>,
    candidates: &[InstanceId],
    view: &View<'_>,
    state: &mut PolicyState,
) -> (InstanceId, Reason) {
    use std::cmp::Reverse;
    let scratch = &state.scratch;
    let load = |i: InstanceId| view.load.get(i).in_flight;
    // Holders of the prefix: longest match, then least loaded, then least cached data.
    // Candidates holding none of it: least cached data first, so new prefixes spread over
    // the fleet's memory (saturation still keeps the load even).
    let every = view.index.reporting(config.block_tokens).base();
    // A match's worth depends on its depths alone, and most candidates share theirs with
    // the candidate before: it is figured again only when they change.
    let memo = std::cell::Cell::new(None::<((u32, u32, u32), u64)>);
    let worth_of = |m: &InstanceMatch| match memo.get() {
        Some((depths, worth)) if depths == (m.gpu, m.l1, m.l2) => worth,
        _ => {
            let worth = worth_rank(view, config, m);
            memo.set(Some(((m.gpu, m.l1, m.l2), worth)));
            worth
        }
    };
    let balance = Balance::of(candidates, view.load);
    let countable = |i: InstanceId| balance.countable(scratch.of(i), load(i));
    let rank_of = |m: InstanceMatch, i: InstanceId| {
        let held = view.index.held_blocks_of(i, every) as u64;
        let busy = u64::from(load(i));
        let worth = worth_of(&m);
        if m.l2 == 0 {
            (worth, m.l2, Reverse(held), Reverse(busy))
        } else {
            (worth, m.l2, Reverse(busy), Reverse(held))
        }
    };
    let rank = |i: InstanceId| rank_of(countable(i), i);
    let mut top = pick_best(candidates, &mut state.rng, rank);
    // A match that is partly in L1 or L2 is a reason to go there only where loading it
    // beats recomputing at the candidate the GPU alone would pick.
    let m = countable(top);
    if m.l2 > m.gpu {
        let gpu_rank = |i: InstanceId| rank_of(gpu_only(scratch.of(i)), i);
        let alt = pick_best(candidates, &mut state.rng, gpu_rank);
        let estimate = |m: InstanceMatch, i: InstanceId| {
            estimate_ttft_ms(
                view.profile,
                config.block_tokens,
                req.prompt_tokens,
                m,
                view.load.get(i),
            )
        };
        if alt != top && estimate(gpu_only(scratch.of(alt)), alt) < estimate(m, top) {
            top = alt;
        }
    }
    let top_load = load(top);
    if !balance.saturated(config, top_load, own_tokens(config, scratch, top)) {
        let reason = if scratch.of(top).l2 == 0 {
            Reason::NoMatch
        } else {
            Reason::LongestPrefix
        };
        return (top, reason);
    }
    // Spill: to the best candidate that is neither saturated nor as busy as the top.
    let open: Vec<InstanceId> = candidates
        .iter()
        .copied()
        .filter(|&i| load(i) < top_load && !balance.saturated(config, load(i), 0.0))
        .collect();
    if open.is_empty() {
        let pick = pick_best(candidates, &mut state.rng, |i| {
            (Reverse(load(i)), worth_of(&scratch.of(i)))
        });
        return (pick, Reason::AllSaturated);
    }
    (pick_best(&open, &mut state.rng, rank), Reason::Spilled)
}

/// Estimated milliseconds to prefill `tokens` in chunks of [`PREFILL_CHUNK_TOKENS`].
fn chunked_prefill_ms(profile: &ModelProfile, tokens: u64) -> f64 {
    let full = tokens / PREFILL_CHUNK_TOKENS;
    full as f64 * profile.prefill_ms(PREFILL_CHUNK_TOKENS)
        + profile.prefill_ms(tokens % PREFILL_CHUNK_TOKENS)
}

/// Estimated time to first token on an instance with `load` holding `m`.
pub fn estimate_ttft_ms(
    profile: &ModelProfile,
    block_tokens: u32,
    prompt_tokens: u32,
    m: InstanceMatch,
    load: InstanceLoad,
) -> f64 {
    MatchCost::of(profile, block_tokens, prompt_tokens, m).ttft_ms(profile, load)
}

/// The part of [`estimate_ttft_ms`] that depends on the match alone: the same for every
/// candidate with the same depths (those holding nothing of the prompt, or a prefix the
/// fleet holds everywhere), so a policy figures it once for them.
#[derive(Clone, Copy, Debug)]
struct MatchCost {
    /// Prefill of what is not cached.
    compute_ms: f64,
    /// Loading what is in host memory, then what is in L2.
    l1_ms: f64,
    l2_ms: f64,
}

impl MatchCost {
    fn of(profile: &ModelProfile, block_tokens: u32, prompt_tokens: u32, m: InstanceMatch) -> Self {
        let bt = u64::from(block_tokens);
        let gpu = u64::from(m.gpu) * bt;
        let l1 = u64::from(m.l1) * bt;
        let l2 = u64::from(m.l2) * bt;
        let prompt = u64::from(prompt_tokens).max(l2);
        // Even a fully cached prompt recomputes its last token to produce the first output.
        let uncached = (prompt - l2).max(1);
        MatchCost {
            compute_ms: chunked_prefill_ms(profile, uncached),
            l1_ms: profile.load_ms(Tier::L1, l1 - gpu),
            l2_ms: profile.load_ms(Tier::L2, l2 - l1),
        }
    }

    /// The estimate on an instance with `load` (the queue ahead, then this match).
    fn ttft_ms(&self, profile: &ModelProfile, load: InstanceLoad) -> f64 {
        chunked_prefill_ms(profile, load.pending_prefill_tokens)
            + self.compute_ms
            + self.l1_ms
            + self.l2_ms
    }
}

fn kv_aware(
    config: &PolicyConfig,
    req: &RouteRequest<'_>,
    candidates: &[InstanceId],
    view: &View<'_>,
    state: &mut PolicyState,
    explain: bool,
) -> (InstanceId, Reason, Option<Vec<f64>>) {
    let bt = u64::from(config.block_tokens);
    let profile = view.profile;
    let scratch = &state.scratch;
    // The match's part of an estimate depends on its depths alone, and most candidates
    // share theirs with the candidate before (none of the prompt, or a prefix the fleet
    // holds everywhere): it is figured again only when they change.
    let blank = scratch.of(InstanceId(u32::MAX));
    let priced = |m: InstanceMatch| {
        let incoming = u64::from(req.prompt_tokens).saturating_sub(u64::from(m.gpu) * bt);
        (
            (m.gpu, m.l1, m.l2),
            MatchCost::of(profile, config.block_tokens, req.prompt_tokens, m),
            chunked_prefill_ms(profile, incoming),
        )
    };
    let mut memo = priced(blank);
    let score_of = |i: InstanceId, load: InstanceLoad, cost: &MatchCost, incoming_ms: f64| {
        let ttft = cost.ttft_ms(profile, load);
        // On a full cache, what this request computes evicts as much cached data.
        let capacity = view.kv_capacity.get(i.0 as usize).copied().unwrap_or(0);
        if capacity == 0 {
            ttft
        } else {
            // GPU fullness: blocks it keeps in host memory alone take no GPU room.
            let held = view.index.gpu_holders_of(i) as f64 * bt as f64;
            let full = (held / capacity as f64).min(1.0);
            // Loaded blocks take GPU memory as computed ones do (`incoming_ms`).
            ttft + EVICTION_WEIGHT * full * incoming_ms
        }
    };
    // One pass for what each candidate is estimated at, its load and its own tokens, with
    // everything it holds. What a candidate holds beyond its GPU counts only within the
    // balance slack of the least loaded one ([`Balance::countable`]), known at the end of
    // the pass: the few candidates holding such copies are priced again after it where
    // they are busier. (A pass before it for the least load cost a route over 8,000
    // candidates 15%: `kv_aware_route_prefix_observed_on_8000` in the index benches.)
    let figures = &mut state.kv;
    figures.clear();
    let tiered = &mut state.kv_tiered;
    tiered.clear();
    let (mut min_in_flight, mut gpu_held) = (u32::MAX, false);
    for (pos, &i) in candidates.iter().enumerate() {
        let m = scratch.of(i);
        let load = view.load.get(i);
        if memo.0 != (m.gpu, m.l1, m.l2) {
            memo = priced(m);
        }
        let (_, cost, incoming_ms) = memo;
        min_in_flight = min_in_flight.min(load.in_flight);
        gpu_held |= m.gpu > 0;
        if m.l2 > m.gpu {
            tiered.push(pos as u32);
        }
        figures.push(KvFigures {
            score: score_of(i, load, &cost, incoming_ms),
            in_flight: load.in_flight,
            own_tokens: f64::from(m.gpu.saturating_sub(scratch.result.shared))
                * f64::from(config.block_tokens),
            open: false,
        });
    }
    // `route` never asks with no candidates, so the pass saw at least one load.
    let balance = Balance {
        min: f64::from(min_in_flight),
    };
    // Nothing held: no candidate may count any of the prompt. One holding nothing beyond
    // its GPU counts all it holds; the others what `countable` leaves them.
    let mut nothing_held = !gpu_held;
    for &pos in tiered.iter() {
        let (i, f) = (candidates[pos as usize], &mut figures[pos as usize]);
        let m = scratch.of(i);
        let counted = balance.countable(m, f.in_flight);
        if counted != m {
            let (_, cost, incoming_ms) = priced(counted);
            f.score = score_of(i, view.load.get(i), &cost, incoming_ms);
        }
        nothing_held &= counted.l2 == 0;
    }
    let mut any_open = false;
    for f in figures.iter_mut() {
        f.open = !balance.saturated(config, f.in_flight, f.own_tokens);
        any_open |= f.open;
    }
    let eligible = |f: &KvFigures| !any_open || f.open;
    let rng = &mut state.rng;
    // A prompt no candidate holds any of: spread it over the fleet's memory, as
    // prefix-aware does (least cached data, then least loaded, among the unsaturated).
    let pick = if nothing_held && config.temperature == 0.0 {
        pick_best_where(candidates, figures, eligible, rng, |i, f| {
            (
                std::cmp::Reverse(view.index.holders_of(i)),
                std::cmp::Reverse(f.in_flight),
            )
        })
    } else if config.temperature > 0.0 {
        let best = figures
            .iter()
            .filter(|f| eligible(f))
            .map(|f| f.score)
            .fold(f64::INFINITY, f64::min);
        // Boltzmann sampling on the estimate relative to the best one.
        let scale = config.temperature * best.max(1.0);
        let weights: Vec<f64> = figures
            .iter()
            .map(|f| {
                if eligible(f) {
                    (-(f.score - best) / scale).exp()
                } else {
                    0.0
                }
            })
            .collect();
        let total: f64 = weights.iter().sum();
        let mut target = rng.next_f64() * total;
        let mut chosen = candidates.len() - 1;
        for (p, w) in weights.iter().enumerate() {
            if *w > 0.0 {
                chosen = p;
                if target < *w {
                    break;
                }
                target -= w;
            }
        }
        candidates[chosen]
    } else {
        // Lowest estimate, then fewest in flight, then least cached data; estimates in
        // the same ESTIMATE_RESOLUTION_MS step are equal (they are estimates).
        pick_best_where(candidates, figures, eligible, rng, |i, f| {
            (
                std::cmp::Reverse((f.score / ESTIMATE_RESOLUTION_MS) as u64),
                std::cmp::Reverse(f.in_flight),
                std::cmp::Reverse(view.index.holders_of(i)),
            )
        })
    };
    let reason = if any_open {
        Reason::LowestCost
    } else {
        Reason::AllSaturated
    };
    (
        pick,
        reason,
        explain.then(|| figures.iter().map(|f| f.score).collect()),
    )
}

/// What kv-aware figures of one candidate (a buffer kept in [`PolicyState`]).
#[derive(Clone, Copy, Debug, Default)]
struct KvFigures {
    score: f64,
    in_flight: u32,
    /// Tokens it holds beyond the shared prefix (see [`own_tokens`]).
    own_tokens: f64,
    /// Not saturated.
    open: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexConfig;

    fn ids(n: u32) -> Vec<InstanceId> {
        (0..n).map(InstanceId).collect()
    }

    fn keys(ids: &[u64]) -> Vec<BlockKey> {
        ids.iter().map(|&i| BlockKey(i)).collect()
    }

    struct Case {
        strategy: Strategy,
        threshold: u32,
        prefix_blocks: u32,
        /// (prompt keys, instance) routed before.
        routed: &'static [(&'static [u64], u32)],
        /// in-flight count per instance.
        in_flight: &'static [u32],
        prompt: &'static [u64],
        /// GPU KV capacity of every instance, tokens (0: unknown).
        capacity: u64,
        want: u32,
        reason: Reason,
    }

    fn check(c: Case) {
        let mut index = PrefixIndex::new(IndexConfig::default());
        for (ks, i) in c.routed {
            index.record_route(&keys(ks), InstanceId(*i), 0);
        }
        let mut load = LoadView::new();
        for (i, n) in c.in_flight.iter().enumerate() {
            for _ in 0..*n {
                load.start(InstanceId(i as u32), 0);
            }
        }
        let profile = ModelProfile::dynamo_default();
        let capacity = vec![c.capacity; c.in_flight.len()];
        let view = View {
            index: &index,
            load: &load,
            kv_capacity: &capacity,
            profile: &profile,
            now: 1,
        };
        let config = PolicyConfig {
            concurrency_threshold: c.threshold,
            prefix_blocks: c.prefix_blocks,
            ..PolicyConfig::new(c.strategy, 64)
        };
        let ks = keys(c.prompt);
        let req = RouteRequest {
            keys: &ks,
            prompt_tokens: 64 * ks.len() as u32 + 10,
        };
        let d = route(
            &config,
            &req,
            &ids(c.in_flight.len() as u32),
            &view,
            &mut PolicyState::new(1),
            true,
        )
        .unwrap();
        assert_eq!(
            (d.instance.0, d.reason),
            (c.want, c.reason),
            "{:?}",
            d.candidates
        );
        assert_eq!(d.candidates.unwrap().len(), c.in_flight.len());
    }

    const BASE: Case = Case {
        strategy: Strategy::PrefixAware,
        threshold: 0,
        prefix_blocks: 0,
        routed: &[],
        in_flight: &[0, 0, 0],
        prompt: &[1, 2, 3],
        capacity: 0,
        want: 0,
        reason: Reason::NoMatch,
    };

    const LONG: &[u64] = &[
        1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
    ];

    #[test]
    fn prefix_aware_cases() {
        // Longest match wins while its owner is within the slack (2 requests above the
        // least loaded, plus one per 500 tokens of the request's own history there).
        check(Case {
            routed: &[(&[1, 2], 0), (&[1, 2, 3], 2)],
            in_flight: &[0, 0, 2],
            want: 2,
            reason: Reason::LongestPrefix,
            ..BASE
        });
        // Beyond it: spill to the best candidate that is not saturated.
        check(Case {
            routed: &[(&[1, 2], 0), (&[1, 2, 3], 2)],
            in_flight: &[0, 0, 3],
            want: 0,
            reason: Reason::Spilled,
            ..BASE
        });
        // A long history of its own keeps a conversation on its owner for longer
        // (20 blocks of 64 tokens: 2.56 more requests of slack).
        check(Case {
            routed: &[(LONG, 2)],
            in_flight: &[0, 0, 4],
            prompt: LONG,
            want: 2,
            reason: Reason::LongestPrefix,
            ..BASE
        });
        // A new session matching only a shared prefix (key 2 continues two ways) moves
        // as soon as its owner is two requests busier than the least loaded.
        check(Case {
            routed: &[(&[1, 2, 3], 2), (&[1, 2, 4], 2)],
            in_flight: &[1, 0, 2],
            prompt: &[1, 2, 5],
            want: 1,
            reason: Reason::Spilled,
            ..BASE
        });
        // With a second owner of the prefix, the less loaded owner takes it over a fresh
        // instance.
        check(Case {
            routed: &[(&[1, 2, 3], 2), (&[1, 2, 4], 2), (&[1, 2], 0)],
            in_flight: &[1, 0, 2],
            prompt: &[1, 2, 5],
            want: 0,
            reason: Reason::LongestPrefix,
            ..BASE
        });
        // The ratio term: at 6 in flight for the least loaded, the limit is 12, not 8.
        check(Case {
            routed: &[(&[1, 2, 3], 2)],
            in_flight: &[6, 6, 11],
            want: 2,
            reason: Reason::LongestPrefix,
            ..BASE
        });
        // concurrency_threshold stays an upper bound, whatever the history.
        check(Case {
            threshold: 2,
            routed: &[(LONG, 2)],
            in_flight: &[1, 0, 2],
            prompt: LONG,
            want: 1,
            reason: Reason::Spilled,
            ..BASE
        });
        // Everyone saturated: least loaded.
        check(Case {
            threshold: 1,
            routed: &[(&[1, 2, 3], 2)],
            in_flight: &[3, 1, 5],
            want: 1,
            reason: Reason::AllSaturated,
            ..BASE
        });
        // No match: least loaded ...
        check(Case {
            in_flight: &[2, 1, 3],
            want: 1,
            reason: Reason::NoMatch,
            ..BASE
        });
        // ... and among equals, the one holding the least cached data.
        check(Case {
            routed: &[(&[7, 8, 9], 0), (&[5], 1)],
            in_flight: &[0, 0, 0],
            want: 2,
            reason: Reason::NoMatch,
            ..BASE
        });
        // prefix_blocks limits what is compared: both match the first block, so load decides.
        check(Case {
            prefix_blocks: 1,
            routed: &[(&[1], 0), (&[1, 2, 3], 2)],
            in_flight: &[0, 1, 1],
            want: 0,
            reason: Reason::LongestPrefix,
            ..BASE
        });
    }

    #[test]
    fn simple_strategies() {
        check(Case {
            strategy: Strategy::LeastLoaded,
            in_flight: &[2, 0, 1],
            want: 1,
            reason: Reason::LeastLoaded,
            ..BASE
        });
        check(Case {
            strategy: Strategy::RoundRobin,
            routed: &[(&[1, 2, 3], 2)],
            want: 0,
            reason: Reason::RoundRobin,
            ..BASE
        });
    }

    #[test]
    fn kv_aware_cases() {
        let kv = Case {
            strategy: Strategy::KvAware,
            reason: Reason::LowestCost,
            ..BASE
        };
        // Cached prefix beats an idle instance with nothing ...
        check(Case {
            routed: &[(LONG, 1)],
            in_flight: &[0, 2, 0],
            prompt: LONG,
            want: 1,
            ..kv
        });
        // ... unless it saves under ESTIMATE_RESOLUTION_MS: then fewer in flight wins.
        check(Case {
            routed: &[(&[1, 2, 3], 1)],
            in_flight: &[1, 2, 0],
            want: 2,
            ..kv
        });
        // Saturated owner is skipped under a threshold.
        check(Case {
            threshold: 2,
            routed: &[(&[1, 2, 3], 1)],
            in_flight: &[1, 2, 0],
            want: 2,
            ..kv
        });
        check(Case {
            threshold: 1,
            routed: &[(&[1, 2, 3], 1)],
            in_flight: &[1, 2, 3],
            want: 0,
            reason: Reason::AllSaturated,
            ..kv
        });
        // An owner far busier than the fleet is saturated even below the threshold.
        check(Case {
            routed: &[(&[1, 2, 3], 1)],
            in_flight: &[0, 3, 0],
            want: 0,
            ..kv
        });
        // A full cache pays for what it would evict: the empty instance wins a new prompt.
        check(Case {
            routed: &[(&[10, 11, 12, 13], 0)],
            in_flight: &[0, 0],
            capacity: 256,
            want: 1,
            ..kv
        });
    }

    #[test]
    fn kv_aware_prefers_l1_over_recompute_and_queue() {
        let profile = ModelProfile::dynamo_default();
        let idle = InstanceLoad::default();
        let m = |gpu, l1, l2| InstanceMatch {
            instance: InstanceId(0),
            gpu,
            l1,
            l2,
            predicted_at: 0,
            observed_gpu: 0,
        };
        let none = estimate_ttft_ms(&profile, 64, 64 * 100, m(0, 0, 0), idle);
        let in_l1 = estimate_ttft_ms(&profile, 64, 64 * 100, m(0, 100, 100), idle);
        let in_l2 = estimate_ttft_ms(&profile, 64, 64 * 100, m(0, 0, 100), idle);
        let on_gpu = estimate_ttft_ms(&profile, 64, 64 * 100, m(100, 100, 100), idle);
        assert!(
            on_gpu < in_l1 && in_l1 < in_l2 && in_l2 < none,
            "{on_gpu} {in_l1} {in_l2} {none}"
        );
        let busy = InstanceLoad {
            in_flight: 10,
            pending_prefill_tokens: 64_000,
        };
        assert!(estimate_ttft_ms(&profile, 64, 6400, m(100, 100, 100), busy) > in_l1);
    }

    #[test]
    fn a_copy_in_host_memory_draws_a_request_only_within_the_slack() {
        // Instance 0 holds the whole prompt in host memory (L1), nobody holds it on a GPU.
        let prompt: Vec<BlockKey> = (1..=100).map(BlockKey).collect();
        let mut index = PrefixIndex::new(IndexConfig::default());
        for (d, &key) in prompt.iter().enumerate() {
            let parent = d.checked_sub(1).map(|p| prompt[p]);
            index.observe(InstanceId(0), key, parent, Tier::L1, true, 0);
        }
        let profile = ModelProfile::dynamo_default();
        let req = RouteRequest {
            keys: &prompt,
            prompt_tokens: 64 * 100 + 10,
        };
        for strategy in [Strategy::PrefixAware, Strategy::KvAware] {
            // The others run 6 requests each: saturation's ratio term alone would keep the
            // holder open up to 12.
            for (busy, drawn) in [(8, true), (9, false)] {
                let mut load = LoadView::new();
                for (i, n) in [busy, 6, 6].into_iter().enumerate() {
                    for _ in 0..n {
                        load.start(InstanceId(i as u32), 0);
                    }
                }
                let view = View {
                    index: &index,
                    load: &load,
                    kv_capacity: &[],
                    profile: &profile,
                    now: 1,
                };
                let d = route(
                    &PolicyConfig::new(strategy, 64),
                    &req,
                    &ids(3),
                    &view,
                    &mut PolicyState::new(1),
                    true,
                )
                .unwrap();
                // Its copy is worth a load where the holder is at most BALANCE_SLACK
                // requests busier than the least loaded; past that, the host whose GPU
                // evicted it is taken to be short of memory, and the copy draws nothing.
                assert_eq!(
                    d.instance == InstanceId(0),
                    drawn,
                    "{strategy:?} at {busy}: {d:?}"
                );
                assert_eq!(d.matched.l1, if drawn { 100 } else { 0 }, "{strategy:?}");
                // The explanation shows what the host holds, and prefix-aware's score what
                // the policy counted of it.
                let holder = &d.candidates.unwrap()[0];
                assert_eq!(holder.l1_blocks, 100);
                if strategy == Strategy::PrefixAware {
                    assert_eq!(holder.score > 0.0, drawn, "{holder:?}");
                }
            }
        }
    }

    #[test]
    fn ties_are_random_but_seeded() {
        let index = PrefixIndex::new(IndexConfig::default());
        let load = LoadView::new();
        let profile = ModelProfile::dynamo_default();
        let view = View {
            index: &index,
            load: &load,
            kv_capacity: &[],
            profile: &profile,
            now: 0,
        };
        let config = PolicyConfig::new(Strategy::LeastLoaded, 64);
        let req = RouteRequest {
            keys: &[],
            prompt_tokens: 1,
        };
        let run = |seed| {
            let mut st = PolicyState::new(seed);
            (0..64)
                .map(|_| {
                    route(&config, &req, &ids(8), &view, &mut st, false)
                        .unwrap()
                        .instance
                        .0
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        let picks = run(5);
        assert!((0..8).all(|i| picks.contains(&i)), "{picks:?}");
    }

    #[test]
    fn errors_and_names() {
        let index = PrefixIndex::new(IndexConfig::default());
        let load = LoadView::new();
        let profile = ModelProfile::dynamo_default();
        let view = View {
            index: &index,
            load: &load,
            kv_capacity: &[],
            profile: &profile,
            now: 0,
        };
        let req = RouteRequest {
            keys: &[],
            prompt_tokens: 1,
        };
        let err = route(
            &PolicyConfig::new(Strategy::KvAware, 64),
            &req,
            &[],
            &view,
            &mut PolicyState::new(0),
            false,
        );
        assert_eq!(err, Err(RouteError::NoCandidates));
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>(), Ok(s));
        }
        let e = "fastest".parse::<Strategy>().unwrap_err().to_string();
        assert!(e.contains("fastest") && e.contains("kv-aware"), "{e}");
    }
}
