//! A model of one vLLM-like inference engine on a virtual clock.
//!
//! The engine owns a paged GPU KV cache with prefix caching, the host's L1 tier, a FCFS
//! scheduler with a per-step token budget and chunked prefill, and preemption by
//! recomputation. A discrete-event simulator drives it: [`Engine::submit`] queues requests,
//! [`Engine::start_step`] plans one forward pass and says when it ends,
//! [`Engine::complete_step`] applies it at that time. Time is virtual microseconds passed
//! in; nothing here reads a clock, does I/O or panics on input. Step times come from the
//! shared cost model ([`ModelProfile`]), so routing and simulation agree on costs.
//!
//! # Blocks
//!
//! The GPU cache is `gpu_blocks` blocks of `block_tokens` tokens. A block holds either a
//! *named* prompt block (its [`BlockKey`], shareable by any request with that prefix) or
//! anonymous data (a prompt's partial tail, generated tokens, or a prompt block still being
//! computed). Blocks are counted, not addressed: a never-used or freed anonymous block is
//! "free"; a named block has a reference count, and while unreferenced it stays cached on
//! an LRU free list ("evictable"). Allocation takes a free block first, else evicts the
//! least recently used evictable block. A finished or preempted sequence releases its
//! named blocks last block first, so a prompt's tail is evicted before its head and the
//! cached set stays prefix-closed, as in vLLM.
//!
//! An evicted named block is offloaded: to this host's L1 when `l1_blocks > 0`
//! (`Removed{Gpu}`, `Stored{L1}`), and blocks that L1 evicts go to the global L2 when
//! `offload_to_l2` (`Removed{L1}`, `Stored{L2}`); without L1, GPU evictions go straight to
//! L2. With `l2_write_through` as well, every block the engine computes is also stored in L2
//! when its prefill ends (`Stored{L2}`), as LMCache stores each computed chunk in every one
//! of its backends at once (lmcache 0.5.6, `StorageManager.batched_put`): other hosts can
//! load it while this GPU still holds it, and an L2 that still holds it takes no second
//! copy when the GPU and L1 evict it later. L1 takes GPU evictions either way. Whatever L2
//! evicts to make room is reported as `Removed{L2}`. `Stored` is only
//! emitted when a block was not already resident in that tier (re-offloading a block that
//! is still there refreshes its recency silently), so replaying `Stored`/`Removed` per tier
//! reproduces exactly the resident sets.
//!
//! # Admission and hits
//!
//! Each step first serves running sequences, then admits from the head of the waiting
//! queue (strict FCFS: a head that does not fit blocks the queue) while the step still has
//! token budget, fewer than `max_running` sequences run, no preemption happened in this
//! step, and free plus evictable blocks cover every block of the prompt not already on the
//! GPU plus one block of headroom. All of a prompt's blocks are allocated at admission, so
//! prefill never needs more memory; decode grows a sequence one block at a time.
//!
//! Hits are counted at admission. The longest run of leading keys resident on the GPU is
//! reused (`gpu_hit_tokens`); from there, keys found in L1 (checked first) or L2 are loaded
//! (`l1_hit_tokens`, `l2_hit_tokens`; touched in their LRU, the copy stays there, and the
//! loaded blocks become named GPU blocks at once, `Stored{Gpu}`). The load takes
//! `profile.load_ms(tier, tokens)`. With `async_loads` (the default, as vLLM's KV
//! connectors load: the request waits for its blocks while the batch goes on) it runs on
//! the host link, one load after another, and the request's prefill starts in the first
//! step after its load has landed; an engine with nothing else to do waits in idle steps of
//! at most [`LOAD_WAIT_SLICE_US`], which count as neither steps nor busy time. Without
//! `async_loads` the load time is added to the admitting step. The first key in neither
//! tier ends the run; the rest is computed. As in vLLM, at least the prompt's last token is
//! always computed: only blocks that end before the last prompt token can hit, so a prompt
//! of exactly n blocks hits at most n − 1 of them. Keys beyond `prompt_tokens /
//! block_tokens` are ignored. A hit block that is also a later request's hit is shared,
//! not copied.
//!
//! # Outside lookups
//!
//! An engine whose tiers live in another process (engine-sim and its host's cache-agent)
//! turns on [`Engine::set_outside_lookups`]. Admission then works as above and, when the
//! prompt continues past what the GPU and the engine's own tiers hold into blocks that
//! could hit, it also asks for those blocks (up to the first one the GPU holds after the
//! gap, where a load from the engine's own tiers would stop too, and again when the answer
//! comes): it allocates all of the request's blocks,
//! queues a [`Lookup`] (the caller collects it with [`Engine::take_lookups`], asks the
//! store, and answers with [`Engine::answer_lookup`]) and parks the request, holding its
//! blocks, while the batch goes on and later requests are admitted, as vLLM parks a
//! request whose KV connector is loading. The answer's leading run of blocks becomes named
//! GPU blocks and counts as L1 or L2 hits; their load runs on the host link from the
//! admission on, as the engine's own loads do, and prefill starts once the answer has
//! come and the load has landed (always beside the batch, `async_loads` or not). A
//! request preempted or cancelled before its answer forgets it (`answer_lookup` says
//! false); an empty answer (the store failed or had nothing) costs a recompute. A caller
//! that asked the store while the request queued hands the answer over with
//! [`Engine::offer`]: admission then takes those blocks as its own tiers' (loading them
//! beside the batch) and asks nothing for the range answered, so the request is admitted
//! into the step at hand rather than parked until the next one. The simulator never
//! turns this on.
//!
//! # Prefetch
//!
//! A router that sends a request here while the global L2 holds the next blocks of its
//! prompt (past what this host's GPU and L1 hold) tells the host's agent, which reads them
//! into L1 while the request queues ([`Engine::prefetch`]). The reads run one after
//! another on the host's network link at the profile's L2 bandwidth, beside everything
//! else; a block lands in L1 (`Stored{L1}`, offloading what L1 evicts as usual) at the
//! first step that starts after its read ended, if L2 still holds it and the GPU and L1 do
//! not. An admission before that loads it from L2 as without prefetch.
//!
//! # Steps
//!
//! A step's budget is `max_batch_tokens`. Decoding sequences take one token each, oldest
//! admission first; the rest goes to prefill chunks of prefilling sequences in admission
//! order, newly admitted ones last. Step time is `prefill_ms(prefill tokens)` plus
//! `decode_step_ms(kv_usage)` if the step decodes (usage measured after the step's
//! allocations) plus, without `async_loads`, the admitted loads, rounded to whole microseconds and at least 1 µs.
//! When a sequence's last chunk completes, its computed complete prompt blocks become named
//! (`Stored{Gpu}`; if another sequence cached the same key meanwhile, the copy is freed and
//! the existing block shared) and it emits `FirstToken` at the step's end. Each later step
//! it decodes emits `Token`. A sequence of `S` tokens (prompt plus generated so far) holds
//! `ceil(S / block_tokens)` blocks while it decodes. `Finished` follows the
//! `output_tokens`-th token (FirstToken counts; 0 behaves as 1) in the same step, and
//! releases its blocks.
//!
//! # Preemption
//!
//! When a decoding sequence needs a block and none is free or evictable, the most recently
//! admitted running sequence (possibly itself) is preempted: its blocks are released, it
//! goes back to the head of the waiting queue, and on re-admission it recomputes its prompt
//! plus the tokens it already generated (prefix-cache and tier hits still shorten that, but
//! are not counted in the hit statistics again; its recompute ends with a `Token`, not a
//! second `FirstToken`).
//!
//! # Rejection
//!
//! A request is `Rejected` (at submission, reported by the next `start_step` or
//! `complete_step` with `at_us` = submission time) when it could never run to completion
//! alone: `ceil((prompt + output − 1) / block_tokens) + 1 > gpu_blocks`, i.e. its longest
//! recompute plus the headroom block exceeds the cache. For one output token this is "the
//! prompt needs more than `gpu_blocks − 1` blocks". Checking the whole length (as vLLM checks
//! `max_model_len`) guarantees progress: the oldest running sequence always finds a block by
//! preempting newer ones, and the head of the queue always fits an idle engine.
//!
//! # Statistics
//!
//! `prompt_tokens` and the three hit counters are counted at first admission;
//! `computed_prefill_tokens` counts every prefill token computed, recomputation included.
//! Once every admitted request has finished and no preemption happened,
//! `gpu_hit_tokens + l1_hit_tokens + l2_hit_tokens + computed_prefill_tokens ==
//! prompt_tokens`; with preemptions the left side is larger by the recomputed tokens.
//! `steps` and `busy_us` count completed steps. A cancelled request (see [`Engine::cancel`])
//! counts in `prompt_tokens` and the hits if it was admitted, but its uncomputed prefill
//! never counts, so with cancellations the left side can be smaller.
//!
//! # Determinism and cost
//!
//! Hash maps are only used for lookups; every order that matters comes from a `Vec`,
//! `VecDeque` or an LRU list. Planning a step costs O(running sequences) plus O(prompt
//! blocks) per admission and per prefill completion, never O(cache size).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};

use warmpath_index::cost::{ModelProfile, Tier};
use warmpath_index::keys::BlockKey;
use warmpath_tiers::BlockLru;

use crate::tiers::TierSet;

/// Longest idle step of an engine that only waits for loads, microseconds: an arrival
/// during the wait is admitted at the latest this much later.
pub const LOAD_WAIT_SLICE_US: u64 = 2_000;

/// Shape and limits of one engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block (= the workload's block size). 0 is treated as 1.
    pub block_tokens: u32,
    /// GPU KV cache capacity in blocks.
    pub gpu_blocks: u32,
    /// Token budget per step. 0 is treated as 1.
    pub max_batch_tokens: u32,
    /// Cap on running sequences. 0 is treated as 1.
    pub max_running: u32,
    /// Host CPU-memory tier capacity in blocks; 0 = no L1.
    pub l1_blocks: u64,
    /// Blocks evicted from L1 (or from GPU when there is no L1) go to the global L2 store.
    pub offload_to_l2: bool,
    /// With `offload_to_l2`, computed blocks are also stored in L2 when their prefill ends
    /// (LMCache's write to every backend); without, L2 takes only what L1 (or the GPU) evicts.
    pub l2_write_through: bool,
    /// Tier loads run beside the batch (vLLM's asynchronous KV-connector loads): an admitted
    /// request waits for its blocks while the other sequences go on, and the host link
    /// carries one load at a time. When false, each load is added to the step that admits
    /// it, stalling every sequence of that step.
    pub async_loads: bool,
}

impl Default for EngineConfig {
    /// vLLM's defaults on one 80 GB H100 serving Llama-3.1-8B: 16-token blocks; 25600 GPU
    /// blocks (≈ 54 GB of KV at 2 MiB per block, what is left of 90% of 80 GB after 16 GB of
    /// weights and activations); 8192 batched tokens; 256 sequences; no L1, no L2 offload.
    fn default() -> Self {
        EngineConfig {
            block_tokens: 16,
            gpu_blocks: 25_600,
            max_batch_tokens: 8192,
            max_running: 256,
            l1_blocks: 0,
            offload_to_l2: false,
            l2_write_through: false,
            async_loads: true,
        }
    }
}

/// One request as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    pub id: u64,
    /// Prefix keys of the prompt's complete blocks of `block_tokens` tokens.
    pub keys: Vec<BlockKey>,
    /// Prompt length in tokens; 0 is treated as 1.
    pub prompt_tokens: u32,
    /// Tokens to generate; 0 is treated as 1.
    pub output_tokens: u32,
    /// Blocks an outside store (the host's cache-agent) already handed over for this
    /// request: `keys[offered_from..offered_from + offered.len()]`, each with the tier it
    /// came from. At admission they extend the GPU hit like the engine's own tiers do (with
    /// their load time); a block the GPU lost in the meantime leaves a gap that ends the run.
    pub offered: Vec<Tier>,
    pub offered_from: usize,
}

/// A lookup in an outside store that admission asks for (see "Outside lookups").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// Names this lookup in [`Engine::answer_lookup`].
    pub ticket: u64,
    /// The request being admitted.
    pub id: u64,
    /// The prompt's blocks past what the GPU and the engine's own tiers hold, up to the
    /// last that can hit or the first the GPU holds after the gap, whichever comes first.
    pub keys: Vec<BlockKey>,
}

/// A request's lookup that has not been answered yet.
#[derive(Clone, Copy, Debug)]
struct Pending {
    ticket: u64,
    /// The lookup asked for `keys[from..to]` (`from` = the sequence's `named` at
    /// admission).
    from: usize,
    to: usize,
    /// When the request was admitted: its load may start then.
    admitted_us: u64,
    /// Whether this is the request's first admission (its hits are counted).
    first: bool,
}

/// What admission would take of a request's blocks ([`Engine::plan_hits`]).
#[derive(Clone, Copy, Debug)]
struct HitPlan {
    /// Blocks that can hit: those ending before the last prompt token.
    max_hit: usize,
    /// Leading blocks the GPU holds, of which `evictable_hits` unreferenced.
    gpu: usize,
    evictable_hits: u64,
    /// Past `gpu`, blocks the engine's own tiers hold or an outside store offered.
    loaded: usize,
}

/// What the engine reports; times are virtual microseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// Prefill finished and the first token came out at `at_us`; hit tokens say where the
    /// prompt's prefix was found when the request was first admitted (GPU prefix cache, this
    /// host's L1, global L2).
    FirstToken {
        id: u64,
        at_us: u64,
        gpu_hit_tokens: u32,
        l1_hit_tokens: u32,
        l2_hit_tokens: u32,
    },
    /// A later output token.
    Token { id: u64, at_us: u64 },
    /// The last output token came out; the request's blocks are released.
    Finished { id: u64, at_us: u64 },
    /// The request can never fit: its prompt plus output, plus one headroom block, needs
    /// more blocks than the whole GPU cache. `at_us` is when it was submitted.
    Rejected { id: u64, at_us: u64 },
    /// A block became resident in a tier (Gpu or L1: on this engine/host; L2: the global
    /// store).
    Stored { key: BlockKey, tier: Tier },
    /// A block stopped being resident in a tier.
    Removed { key: BlockKey, tier: Tier },
}

/// Counters since the engine was created.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Completed steps.
    pub steps: u64,
    /// Sum of completed step durations.
    pub busy_us: u64,
    /// Prompt tokens of admitted requests (counted at first admission).
    pub prompt_tokens: u64,
    /// Prompt tokens found in the GPU prefix cache at first admission.
    pub gpu_hit_tokens: u64,
    /// Prompt tokens loaded from L1 at first admission.
    pub l1_hit_tokens: u64,
    /// Prompt tokens loaded from L2 at first admission.
    pub l2_hit_tokens: u64,
    /// Prefill tokens computed, recomputation after preemption included.
    pub computed_prefill_tokens: u64,
    /// GPU time of the steps' prefill (the profile's prefill time of each step's prefill
    /// tokens), microseconds: the compute that cache hits save.
    pub prefill_us: u64,
    /// Time spent loading blocks from L1 or L2, microseconds.
    pub load_us: u64,
    /// Sequences preempted (one per preemption, a sequence may count several times).
    pub preemptions: u64,
    pub finished: u64,
    pub rejected: u64,
    /// Requests dropped by [`Engine::cancel`] while waiting or running.
    pub cancelled: u64,
    /// Blocks a prefetch brought from L2 into L1 ([`Engine::prefetch`]).
    pub prefetched_blocks: u64,
}

/// A request inside the engine, waiting or running.
#[derive(Clone, Debug)]
struct Seq {
    id: u64,
    /// Keys of the prompt's complete blocks (at most `prompt_tokens / block_tokens`).
    keys: Vec<BlockKey>,
    /// At least 1.
    prompt_tokens: u64,
    /// At least 1.
    output_tokens: u64,
    /// Tokens output so far, over all runs.
    generated: u64,
    /// Hit tokens (GPU, L1, L2) of the first admission; None before it.
    first_hits: Option<[u32; 3]>,
    /// See [`EngineRequest::offered`].
    offered: Vec<Tier>,
    offered_from: usize,
    /// The outside store was asked for `keys[offered_from..offered_to]` and handed over
    /// `offered`, its leading run ([`Engine::offer`]): admission asks no lookup inside it.
    offered_to: usize,
    // The current run: reset by preemption.
    /// With asynchronous loads, when this run's loaded blocks are all on the GPU; its
    /// prefill waits until then (0: nothing to wait for).
    ready_us: u64,
    /// This run's outside lookup, until it is answered; prefill waits for it.
    lookup: Option<Pending>,
    /// Tokens to be in the KV cache before this run's first output: prompt plus tokens
    /// generated before the run began.
    prefill_len: u64,
    /// Of `prefill_len`, tokens in the KV cache (hits plus computed chunks).
    prefilled: u64,
    /// `keys[..named]` are referenced named GPU blocks.
    named: usize,
    /// Anonymous GPU blocks held (prompt blocks being computed count here until named).
    anon: u64,
    // The planned step.
    /// Prefill tokens of this sequence in the running step.
    chunk: u64,
    /// Whether this sequence decodes in the running step.
    decode: bool,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.prefill_len > 0 && self.prefilled >= self.prefill_len
    }
}

/// The step being executed.
#[derive(Clone, Copy, Debug)]
struct Step {
    duration_us: u64,
    /// Nothing ran: the engine waited for a load to finish.
    idle: bool,
}

/// One engine: GPU cache, L1, scheduler. See the module doc for the model.
#[derive(Debug)]
pub struct Engine {
    /// Normalized: block_tokens, max_batch_tokens and max_running at least 1.
    config: EngineConfig,
    profile: ModelProfile,
    /// FCFS queue; preempted sequences return to the front.
    waiting: VecDeque<Seq>,
    /// Running sequences in admission order (newest last: the preemption victim).
    running: Vec<Seq>,
    /// Named GPU blocks and their reference counts (lookups only).
    resident: HashMap<BlockKey, u32>,
    /// Named GPU blocks with no reference, least recently used first: the eviction order.
    evictable: BlockLru,
    /// GPU blocks never used or holding freed anonymous data.
    free_blocks: u64,
    /// This host's CPU-memory tier.
    l1: TierSet,
    /// The step in flight, if any.
    step: Option<Step>,
    /// With asynchronous loads, when the host link is free for the next load.
    link_free_us: u64,
    /// Rejected at submission, not yet reported: (id, submitted at).
    rejects: Vec<(u64, u64)>,
    /// Whether admission asks an outside store (see "Outside lookups").
    outside: bool,
    /// Lookups asked and not yet taken by the caller.
    lookups: Vec<Lookup>,
    /// The next lookup's ticket.
    next_ticket: u64,
    /// When the host's network link to L2 is free for the next prefetch read.
    net_free_us: u64,
    /// Prefetched blocks on their way from L2 into L1, by landing time (ascending), and
    /// the same keys for lookups.
    promotions: VecDeque<(u64, BlockKey)>,
    promoting: HashSet<BlockKey>,
    stats: EngineStats,
}

impl Engine {
    pub fn new(config: EngineConfig, profile: ModelProfile) -> Engine {
        let config = EngineConfig {
            block_tokens: config.block_tokens.max(1),
            max_batch_tokens: config.max_batch_tokens.max(1),
            max_running: config.max_running.max(1),
            ..config
        };
        Engine {
            free_blocks: u64::from(config.gpu_blocks),
            l1: TierSet::lru(config.l1_blocks),
            config,
            profile,
            waiting: VecDeque::new(),
            running: Vec::new(),
            resident: HashMap::new(),
            evictable: BlockLru::new(u64::MAX),
            step: None,
            link_free_us: 0,
            rejects: Vec::new(),
            outside: false,
            lookups: Vec::new(),
            next_ticket: 0,
            net_free_us: 0,
            promotions: VecDeque::new(),
            promoting: HashSet::new(),
            stats: EngineStats::default(),
        }
    }

    /// A router's prefetch hint: a request for a prompt whose next blocks are `keys` (in
    /// chain order) was just sent here, and the global L2 holds them. The host reads them
    /// into L1 over its network link, one after another at the profile's L2 bandwidth,
    /// starting at `now_us`, so that an admission after they landed loads them from L1.
    /// Stops at the first block L2 lacks; skips blocks already on the GPU or in L1 or on
    /// their way; schedules nothing without an L1, or beyond what L1 could hold. Returns
    /// the blocks scheduled. A block lands only if L2 still holds it then.
    pub fn prefetch(&mut self, now_us: u64, keys: &[BlockKey], l2: &TierSet) -> usize {
        let room = usize::try_from(self.l1.capacity()).unwrap_or(usize::MAX);
        let read_us = (self
            .profile
            .load_ms(Tier::L2, u64::from(self.config.block_tokens))
            * 1000.0)
            .round() as u64;
        let mut scheduled = 0;
        for &key in keys {
            if self.promotions.len() >= room || !l2.contains(key) {
                break;
            }
            if self.resident.contains_key(&key)
                || self.l1.contains(key)
                || self.promoting.contains(&key)
            {
                continue;
            }
            self.net_free_us = self.net_free_us.max(now_us).saturating_add(read_us);
            self.promotions.push_back((self.net_free_us, key));
            self.promoting.insert(key);
            scheduled += 1;
        }
        scheduled
    }

    /// Puts the prefetched blocks that have landed by `now_us` into L1.
    fn land_promotions(&mut self, now_us: u64, l2: &mut TierSet, events: &mut Vec<EngineEvent>) {
        while let Some(&(at, key)) = self.promotions.front() {
            if at > now_us {
                break;
            }
            self.promotions.pop_front();
            self.promoting.remove(&key);
            if !self.resident.contains_key(&key) && !self.l1.contains(key) && l2.touch(key) {
                self.offload(key, l2, events);
                self.stats.prefetched_blocks += 1;
            }
        }
    }

    /// The configuration in use (after normalization).
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// This host's L1 tier.
    pub fn l1(&self) -> &TierSet {
        &self.l1
    }

    /// Queues a request (FCFS). One that can never fit is rejected; the next `start_step` or
    /// `complete_step` reports it.
    pub fn submit(&mut self, now_us: u64, req: EngineRequest) {
        let bt = u64::from(self.config.block_tokens);
        let prompt_tokens = u64::from(req.prompt_tokens.max(1));
        let output_tokens = u64::from(req.output_tokens.max(1));
        if !self.can_ever_fit(req.prompt_tokens, req.output_tokens) {
            self.stats.rejected += 1;
            self.rejects.push((req.id, now_us));
            return;
        }
        let mut keys = req.keys;
        keys.truncate(usize::try_from(prompt_tokens / bt).unwrap_or(usize::MAX));
        self.waiting.push_back(Seq {
            id: req.id,
            keys,
            prompt_tokens,
            output_tokens,
            generated: 0,
            first_hits: None,
            offered_to: req.offered_from + req.offered.len(),
            offered: req.offered,
            offered_from: req.offered_from,
            ready_us: 0,
            lookup: None,
            prefill_len: 0,
            prefilled: 0,
            named: 0,
            anon: 0,
            chunk: 0,
            decode: false,
        });
    }

    /// Makes admission ask an outside store for the blocks past what the GPU and the
    /// engine's own tiers hold (see "Outside lookups"); off by default.
    pub fn set_outside_lookups(&mut self, on: bool) {
        self.outside = on;
    }

    /// An outside store's answer for waiting request `id`, before its admission: asked for
    /// `keys[from..to]`, it handed over the leading blocks, from `tiers`. Admission takes
    /// them as it takes [`EngineRequest::offered`] (a block the GPU lost meanwhile ends the
    /// run) and asks no lookup of its own for blocks inside `from..to`, so a request whose
    /// store answered while it queued is admitted into the step at hand, as one whose
    /// engine holds its tiers itself. Returns false, changing nothing, when `id` is not
    /// waiting (admitted, cancelled or unknown) or the range is empty or past its keys.
    pub fn offer(&mut self, id: u64, from: usize, to: usize, tiers: &[Tier]) -> bool {
        let Some(seq) = self.waiting.iter_mut().find(|s| s.id == id) else {
            return false;
        };
        if from >= to || to > seq.keys.len() {
            return false;
        }
        seq.offered.clear();
        seq.offered
            .extend_from_slice(&tiers[..tiers.len().min(to - from)]);
        seq.offered_from = from;
        seq.offered_to = to;
        true
    }

    /// Moves the lookups asked since the last call into `out`, in the order asked.
    pub fn take_lookups(&mut self, out: &mut Vec<Lookup>) {
        out.append(&mut self.lookups);
    }

    /// The outside store's answer to lookup `ticket` at `now_us`: the tiers of the leading
    /// blocks of its keys that the store handed over (a shorter run than asked, or none,
    /// leaves the rest to be computed; extra entries are ignored). The blocks become
    /// named GPU blocks (`Stored{Gpu}`), the load is scheduled on the host link from the
    /// admission on, and the request's prefill may start once it has landed. Returns
    /// false, changing nothing, when no request waits for `ticket` (it was cancelled or
    /// preempted meanwhile, or the ticket is unknown).
    pub fn answer_lookup(
        &mut self,
        now_us: u64,
        ticket: u64,
        tiers: &[Tier],
        events: &mut Vec<EngineEvent>,
    ) -> bool {
        // The load is timed from the admission; the answer's time does not change it.
        let _ = now_us;
        let bt = u64::from(self.config.block_tokens);
        let Some(i) = self
            .running
            .iter()
            .position(|s| s.lookup.is_some_and(|p| p.ticket == ticket))
        else {
            return false;
        };
        let seq = &mut self.running[i];
        let Some(pending) = seq.lookup.take() else {
            return false;
        };
        // No more blocks than were asked for; as at admission, a block the GPU came to hold
        // meanwhile ends the run (the rest is computed).
        let asked = &seq.keys[pending.from..pending.to];
        let count = asked[..tiers.len().min(asked.len())]
            .iter()
            .position(|k| self.resident.contains_key(k))
            .unwrap_or(tiers.len().min(asked.len()));
        let arrived = asked[..count].to_vec();
        seq.anon -= count as u64;
        seq.named = pending.from + count;
        let l1_blocks = tiers[..count].iter().filter(|t| **t == Tier::L1).count() as u64;
        let l2_blocks = count as u64 - l1_blocks;
        for key in arrived {
            self.adopt(key, events);
        }
        let seq = &mut self.running[i];
        seq.prefilled = seq.named as u64 * bt;
        if pending.first {
            let tokens = |blocks: u64| u32::try_from(blocks * bt).unwrap_or(u32::MAX);
            let (l1, l2) = (tokens(l1_blocks), tokens(l2_blocks));
            self.stats.l1_hit_tokens += u64::from(l1);
            self.stats.l2_hit_tokens += u64::from(l2);
            if let Some(hits) = &mut seq.first_hits {
                hits[1] = hits[1].saturating_add(l1);
                hits[2] = hits[2].saturating_add(l2);
            }
        }
        let ms = self.profile.load_ms(Tier::L1, l1_blocks * bt)
            + self.profile.load_ms(Tier::L2, l2_blocks * bt);
        // Float-to-int casts saturate and map NaN to 0, so this cannot panic.
        let load_us = (ms * 1000.0).round() as u64;
        if load_us > 0 {
            self.stats.load_us += load_us;
            let landed = self
                .link_free_us
                .max(pending.admitted_us)
                .saturating_add(load_us);
            self.link_free_us = landed;
            seq.ready_us = seq.ready_us.max(landed);
        }
        true
    }

    /// If no step is running and there is work, plans the next step and returns its end
    /// time. Admission happens here, with its evictions, offloads and loads.
    pub fn start_step(
        &mut self,
        now_us: u64,
        l2: &mut TierSet,
        events: &mut Vec<EngineEvent>,
    ) -> Option<u64> {
        self.flush_rejects(events);
        self.land_promotions(now_us, l2, events);
        if self.step.is_some() || (self.waiting.is_empty() && self.running.is_empty()) {
            return None;
        }
        let bt = u64::from(self.config.block_tokens);
        let mut budget = u64::from(self.config.max_batch_tokens);
        let mut preempted = false;
        let mut decodes = 0u64;

        // Decodes, oldest admission first; each may need one more block.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if !self.running[i].decoding() {
                i += 1;
                continue;
            }
            let seq = &self.running[i];
            let need = (seq.prompt_tokens + seq.generated).div_ceil(bt);
            let mut victim_was_self = false;
            while self.held(i) < need {
                if self.available() > 0 {
                    self.take_block(l2, events);
                    self.running[i].anon += 1;
                } else {
                    let victim = self.running.len() - 1;
                    self.preempt_last();
                    preempted = true;
                    if victim == i {
                        victim_was_self = true;
                        break;
                    }
                }
            }
            if victim_was_self {
                break;
            }
            self.running[i].decode = true;
            decodes += 1;
            budget -= 1;
            i += 1;
        }

        // Prefill chunks of running sequences, in admission order (not those whose blocks
        // are still loading).
        let mut prefill = 0u64;
        for seq in &mut self.running {
            if budget == 0 {
                break;
            }
            if !seq.decoding() && seq.ready_us <= now_us && seq.lookup.is_none() {
                seq.chunk = (seq.prefill_len - seq.prefilled).min(budget);
                budget -= seq.chunk;
                prefill += seq.chunk;
            }
        }

        // Admission, FCFS, with the budget left.
        let mut load_ms = 0.0;
        while !preempted
            && budget > 0
            && self.running.len() < self.config.max_running as usize
            && !self.waiting.is_empty()
        {
            let Some(ms) = self.try_admit(now_us, l2, events) else {
                break;
            };
            // Float-to-int casts saturate and map NaN to 0, so this cannot panic.
            let load_us = (ms * 1000.0).round() as u64;
            self.stats.load_us += load_us;
            if self.config.async_loads && load_us > 0 {
                let ready = self.link_free_us.max(now_us).saturating_add(load_us);
                self.link_free_us = ready;
                if let Some(seq) = self.running.last_mut() {
                    seq.ready_us = ready;
                }
                continue;
            }
            load_ms += ms;
            if let Some(seq) = self.running.last_mut().filter(|s| s.lookup.is_none()) {
                seq.chunk = (seq.prefill_len - seq.prefilled).min(budget);
                budget -= seq.chunk;
                prefill += seq.chunk;
            }
        }

        if prefill == 0 && decodes == 0 {
            // Nothing to compute. Wait for the first load to land, if one is under way;
            // otherwise nothing could be scheduled (given the rejection rule, only while
            // outside lookups are unanswered: the answer starts the next step): do not
            // spin on empty steps.
            let ready = self
                .running
                .iter()
                .filter(|s| s.ready_us > now_us)
                .map(|s| s.ready_us)
                .min()?;
            // In short waits, so that an arrival meanwhile is admitted without waiting for
            // the whole load.
            let duration_us = (ready - now_us).min(LOAD_WAIT_SLICE_US);
            self.step = Some(Step {
                duration_us,
                idle: true,
            });
            return Some(now_us + duration_us);
        }
        let prefill_ms = self.profile.prefill_ms(prefill);
        self.stats.prefill_us += (prefill_ms * 1000.0).round() as u64;
        let mut ms = prefill_ms + load_ms;
        if decodes > 0 {
            ms += self.profile.decode_step_ms(self.kv_usage());
        }
        let duration_us = ((ms * 1000.0).round() as u64).max(1);
        self.step = Some(Step {
            duration_us,
            idle: false,
        });
        Some(now_us.saturating_add(duration_us))
    }

    /// Completes the running step at its end time (the value `start_step` returned),
    /// pushing the tokens, first tokens, finishes and block events it produced (with
    /// `l2_write_through`, the computed blocks stored in `l2` and what that evicted there).
    /// Does nothing (beyond reporting rejections) when no step is running.
    pub fn complete_step(&mut self, now_us: u64, l2: &mut TierSet, events: &mut Vec<EngineEvent>) {
        self.flush_rejects(events);
        let Some(step) = self.step.take() else { return };
        if step.idle {
            return;
        }
        self.stats.steps += 1;
        self.stats.busy_us += step.duration_us;
        let running = std::mem::take(&mut self.running);
        let mut still = Vec::with_capacity(running.len());
        for mut seq in running {
            let mut emitted = false;
            if seq.decode {
                emitted = true;
            } else if seq.chunk > 0 {
                seq.prefilled += seq.chunk;
                self.stats.computed_prefill_tokens += seq.chunk;
                if seq.prefilled >= seq.prefill_len {
                    self.name_prompt_blocks(&mut seq, l2, events);
                    emitted = true;
                }
            }
            seq.decode = false;
            seq.chunk = 0;
            if emitted {
                seq.generated += 1;
                let id = seq.id;
                match (seq.generated, seq.first_hits) {
                    (1, Some([gpu, l1, l2])) => events.push(EngineEvent::FirstToken {
                        id,
                        at_us: now_us,
                        gpu_hit_tokens: gpu,
                        l1_hit_tokens: l1,
                        l2_hit_tokens: l2,
                    }),
                    _ => events.push(EngineEvent::Token { id, at_us: now_us }),
                }
                if seq.generated >= seq.output_tokens {
                    self.release(&seq);
                    self.stats.finished += 1;
                    events.push(EngineEvent::Finished { id, at_us: now_us });
                    continue;
                }
            }
            still.push(seq);
        }
        self.running = still;
    }

    /// Drops request `id`, waiting or running, as when its client goes away. A running
    /// sequence releases its blocks exactly as a finish does (its named prompt blocks stay
    /// cached, tail first); a waiting one just leaves the queue. If a step is in flight it
    /// keeps its planned duration, but the request gets no more events. A request rejected
    /// at submission is not in the engine: cancelling it (or an unknown or finished id)
    /// does nothing. Returns whether the request was found. `now_us` is the time of the
    /// cancellation; the model does not need it yet.
    pub fn cancel(&mut self, now_us: u64, id: u64) -> bool {
        let _ = now_us;
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.release(&seq);
            self.stats.cancelled += 1;
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            // Waiting sequences hold no blocks (preempted ones released theirs).
            self.waiting.remove(i);
            self.stats.cancelled += 1;
            return true;
        }
        false
    }

    /// Whether a request of `prompt_tokens` and `output_tokens` (0 counts as 1) could ever
    /// run to completion alone; `submit` rejects those that cannot (see "Rejection").
    pub fn can_ever_fit(&self, prompt_tokens: u32, output_tokens: u32) -> bool {
        let bt = u64::from(self.config.block_tokens);
        let longest = u64::from(prompt_tokens.max(1)) + u64::from(output_tokens.max(1)) - 1;
        // Its blocks plus one block of headroom.
        longest.div_ceil(bt) < u64::from(self.config.gpu_blocks)
    }

    /// Sequences admitted and not finished (prefilling or decoding).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued for admission (preempted ones included).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn step_running(&self) -> bool {
        self.step.is_some()
    }

    /// Requests waiting plus running.
    pub fn in_flight(&self) -> u32 {
        u32::try_from(self.waiting.len() + self.running.len()).unwrap_or(u32::MAX)
    }

    /// Whether the GPU holds `key` now (referenced or cached).
    pub fn holds(&self, key: BlockKey) -> bool {
        self.resident.contains_key(&key)
    }

    /// Referenced GPU blocks / gpu_blocks (cached but unreferenced blocks count as free).
    pub fn kv_usage(&self) -> f64 {
        let total = u64::from(self.config.gpu_blocks);
        if total == 0 {
            return 0.0;
        }
        let used = total - self.free_blocks - self.evictable.len() as u64;
        used as f64 / total as f64
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The host's L1 is lost (its agent, which holds it, died) and replaced by an empty one
    /// of `capacity_blocks` (0 while no agent runs). Nothing is reported: a dead agent
    /// tells no one.
    pub fn replace_l1(&mut self, capacity_blocks: u64) {
        self.l1 = TierSet::lru(capacity_blocks);
    }

    /// Every block the GPU holds now, sorted: what the engine's KV-event replay gives an
    /// agent that starts after it (each one announced by a `Stored` event and not removed).
    pub fn gpu_keys(&self) -> Vec<BlockKey> {
        let mut keys: Vec<BlockKey> = self.resident.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    fn flush_rejects(&mut self, events: &mut Vec<EngineEvent>) {
        for (id, at_us) in self.rejects.drain(..) {
            events.push(EngineEvent::Rejected { id, at_us });
        }
    }

    /// GPU blocks the running sequence `i` holds.
    fn held(&self, i: usize) -> u64 {
        self.running[i].named as u64 + self.running[i].anon
    }

    /// Blocks an allocation can take now: free plus evictable.
    fn available(&self) -> u64 {
        self.free_blocks + self.evictable.len() as u64
    }

    /// The blocks of `keys` a request of `prefill_len` tokens would take at admission now:
    /// from the GPU, then from the engine's own tiers or what an outside store `offered`
    /// (`keys[offered_from..]`), up to the first block none of them has.
    fn plan_hits(
        &self,
        keys: &[BlockKey],
        prefill_len: u64,
        l2: &TierSet,
        offered: &[Tier],
        offered_from: usize,
    ) -> HitPlan {
        let bt = u64::from(self.config.block_tokens);
        // The last token is always computed: only blocks ending before it may hit.
        let max_hit = keys
            .len()
            .min(usize::try_from(prefill_len.saturating_sub(1) / bt).unwrap_or(usize::MAX));
        let mut gpu = 0;
        let mut evictable_hits = 0u64;
        while gpu < max_hit {
            match self.resident.get(&keys[gpu]) {
                Some(&refs) => evictable_hits += u64::from(refs == 0),
                None => break,
            }
            gpu += 1;
        }
        let mut loaded = gpu;
        while loaded < max_hit {
            let key = keys[loaded];
            let offer = loaded
                .checked_sub(offered_from)
                .and_then(|i| offered.get(i));
            if self.resident.contains_key(&key)
                || !(self.l1.contains(key) || l2.contains(key) || offer.is_some())
            {
                break;
            }
            loaded += 1;
        }
        HitPlan {
            max_hit,
            gpu,
            evictable_hits,
            loaded,
        }
    }

    /// Where an outside lookup from `loaded` ends: as for the engine's own tiers, a block
    /// the GPU holds after the gap ends the run, else the last block that can hit.
    fn outside_end(&self, keys: &[BlockKey], loaded: usize, max_hit: usize) -> usize {
        (loaded..max_hit)
            .find(|&i| self.resident.contains_key(&keys[i]))
            .unwrap_or(max_hit)
    }

    /// The keys of a request (`keys`, `prompt_tokens`) that admission would ask an outside
    /// store for if it were admitted now (see "Outside lookups"): past what the GPU and the
    /// engine's own tiers (and `l2`) hold, up to the last that can hit or the first the GPU
    /// holds after the gap. Empty when nothing could hit. What a caller asks the store
    /// before admission, to hand the answer over with [`Engine::offer`].
    pub fn outside_range(
        &self,
        keys: &[BlockKey],
        prompt_tokens: u32,
        l2: &TierSet,
    ) -> std::ops::Range<usize> {
        let plan = self.plan_hits(keys, u64::from(prompt_tokens.max(1)), l2, &[], 0);
        plan.loaded..self.outside_end(keys, plan.loaded, plan.max_hit)
    }

    /// Tries to admit the head of the waiting queue; on success pushes it onto `running`
    /// and returns the milliseconds of its tier loads.
    fn try_admit(
        &mut self,
        now_us: u64,
        l2: &mut TierSet,
        events: &mut Vec<EngineEvent>,
    ) -> Option<f64> {
        let bt = u64::from(self.config.block_tokens);
        let head = self.waiting.front()?;
        let prefill_len = head.prompt_tokens + head.generated;
        let total = prefill_len.div_ceil(bt);
        let HitPlan {
            max_hit,
            gpu,
            evictable_hits,
            loaded,
        } = self.plan_hits(
            &head.keys,
            prefill_len,
            l2,
            &head.offered,
            head.offered_from,
        );
        let new_blocks = total - gpu as u64;
        if new_blocks + 1 > self.available().saturating_sub(evictable_hits) {
            return None;
        }

        let mut seq = self.waiting.pop_front()?;
        for &key in &seq.keys[..gpu] {
            self.reference(key);
        }
        // Touch the blocks to load first, so that offloads made room for below do not push
        // them out of their tier before they are read.
        let (mut l1_blocks, mut l2_blocks) = (0u64, 0u64);
        for (i, &key) in seq.keys.iter().enumerate().take(loaded).skip(gpu) {
            if self.l1.touch(key) {
                l1_blocks += 1;
            } else if l2.touch(key) {
                l2_blocks += 1;
            } else {
                match i
                    .checked_sub(seq.offered_from)
                    .and_then(|i| seq.offered.get(i))
                {
                    Some(Tier::L1) => l1_blocks += 1,
                    _ => l2_blocks += 1,
                }
            }
        }
        for _ in 0..new_blocks {
            self.take_block(l2, events);
        }
        seq.anon = new_blocks;
        for &key in &seq.keys[gpu..loaded] {
            seq.anon -= 1;
            self.adopt(key, events);
        }
        seq.named = loaded;
        seq.prefill_len = prefill_len;
        seq.prefilled = loaded as u64 * bt;
        let first = seq.first_hits.is_none();
        if first {
            let tokens = |blocks: u64| u32::try_from(blocks * bt).unwrap_or(u32::MAX);
            let hits = [tokens(gpu as u64), tokens(l1_blocks), tokens(l2_blocks)];
            self.stats.prompt_tokens += seq.prompt_tokens;
            self.stats.gpu_hit_tokens += u64::from(hits[0]);
            self.stats.l1_hit_tokens += u64::from(hits[1]);
            self.stats.l2_hit_tokens += u64::from(hits[2]);
            seq.first_hits = Some(hits);
        }
        let to = match self.outside {
            true => self.outside_end(&seq.keys, loaded, max_hit),
            false => loaded,
        };
        // What the store already answered for this request needs no second asking.
        let answered = seq.offered_from <= loaded && to <= seq.offered_to;
        if loaded < to && !answered {
            let ticket = self.next_ticket;
            self.next_ticket += 1;
            self.lookups.push(Lookup {
                ticket,
                id: seq.id,
                keys: seq.keys[loaded..to].to_vec(),
            });
            seq.lookup = Some(Pending {
                ticket,
                from: loaded,
                to,
                admitted_us: now_us,
                first,
            });
        }
        self.running.push(seq);
        let ms = self.profile.load_ms(Tier::L1, l1_blocks * bt)
            + self.profile.load_ms(Tier::L2, l2_blocks * bt);
        Some(ms)
    }

    /// Adds a reference to a resident named block, taking it off the evictable list.
    fn reference(&mut self, key: BlockKey) {
        if let Some(refs) = self.resident.get_mut(&key) {
            if *refs == 0 {
                self.evictable.remove(key);
            }
            *refs += 1;
        }
    }

    /// The caller holds an anonymous block now containing `key`'s data: make it the named
    /// block `key` (`Stored{Gpu}`), or, when `key` is already resident, free the copy and
    /// reference the resident block.
    fn adopt(&mut self, key: BlockKey, events: &mut Vec<EngineEvent>) {
        match self.resident.entry(key) {
            Entry::Occupied(mut refs) => {
                if *refs.get() == 0 {
                    self.evictable.remove(key);
                }
                *refs.get_mut() += 1;
                self.free_blocks += 1;
            }
            Entry::Vacant(slot) => {
                slot.insert(1);
                events.push(EngineEvent::Stored {
                    key,
                    tier: Tier::Gpu,
                });
            }
        }
    }

    /// The last prefill chunk of `seq` completed: its computed complete prompt blocks become
    /// named, and with `l2_write_through` are stored in L2 too (the blocks it hit were named
    /// at admission: these are the ones it computed).
    fn name_prompt_blocks(
        &mut self,
        seq: &mut Seq,
        l2: &mut TierSet,
        events: &mut Vec<EngineEvent>,
    ) {
        let write_through = self.config.offload_to_l2 && self.config.l2_write_through;
        for index in seq.named..seq.keys.len() {
            seq.anon -= 1;
            self.adopt(seq.keys[index], events);
            if write_through {
                store_l2(seq.keys[index], l2, events);
            }
        }
        seq.named = seq.keys.len();
    }

    /// Takes one block for the caller (who counts it as anonymous): a free one, else the
    /// least recently used evictable one, which is offloaded. The caller checked that one
    /// is available; if none is, nothing is taken.
    fn take_block(&mut self, l2: &mut TierSet, events: &mut Vec<EngineEvent>) {
        if self.free_blocks > 0 {
            self.free_blocks -= 1;
            return;
        }
        if let Some(key) = self.evictable.pop_lru() {
            self.resident.remove(&key);
            events.push(EngineEvent::Removed {
                key,
                tier: Tier::Gpu,
            });
            self.offload(key, l2, events);
        }
    }

    /// A named block left the GPU: keep it in L1, or in L2 when there is no L1.
    fn offload(&mut self, key: BlockKey, l2: &mut TierSet, events: &mut Vec<EngineEvent>) {
        if self.l1.capacity() > 0 {
            let was_there = self.l1.contains(key);
            let mut evicted = Vec::new();
            self.l1.insert(key, &mut evicted);
            for old in evicted {
                events.push(EngineEvent::Removed {
                    key: old,
                    tier: Tier::L1,
                });
                if self.config.offload_to_l2 {
                    store_l2(old, l2, events);
                }
            }
            if !was_there {
                events.push(EngineEvent::Stored {
                    key,
                    tier: Tier::L1,
                });
            }
        } else if self.config.offload_to_l2 {
            store_l2(key, l2, events);
        }
    }

    /// Drops every block reference of `seq` (named ones stay cached, last block first so
    /// the tail is evicted before the head; anonymous ones become free).
    fn release(&mut self, seq: &Seq) {
        for &key in seq.keys[..seq.named].iter().rev() {
            if let Some(refs) = self.resident.get_mut(&key) {
                *refs = refs.saturating_sub(1);
                if *refs == 0 {
                    self.evictable.insert(key, &mut Vec::new());
                }
            }
        }
        self.free_blocks += seq.anon;
    }

    /// Preempts the most recently admitted running sequence: release its blocks and put it
    /// back at the head of the queue to be recomputed.
    fn preempt_last(&mut self) {
        let Some(mut seq) = self.running.pop() else {
            return;
        };
        self.release(&seq);
        seq.ready_us = 0;
        seq.lookup = None;
        seq.prefill_len = 0;
        seq.prefilled = 0;
        seq.named = 0;
        seq.anon = 0;
        seq.chunk = 0;
        seq.decode = false;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
    }
}

/// Puts `key` in the global L2, reporting what it displaced and, when new there, the store.
fn store_l2(key: BlockKey, l2: &mut TierSet, events: &mut Vec<EngineEvent>) {
    let was_there = l2.contains(key);
    let mut evicted = Vec::new();
    l2.insert(key, &mut evicted);
    for old in evicted {
        events.push(EngineEvent::Removed {
            key: old,
            tier: Tier::L2,
        });
    }
    if !was_there && l2.contains(key) {
        events.push(EngineEvent::Stored {
            key,
            tier: Tier::L2,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use warmpath_index::rng::Rng;

    use super::*;

    /// `blocks` keys of prompt family `tag`: two prompts share a prefix iff they share a tag
    /// (a real key chain would also differ after the first different block; tests that need
    /// divergence build keys by hand).
    fn keys(tag: u64, blocks: u64) -> Vec<BlockKey> {
        (0..blocks).map(|i| BlockKey(tag << 32 | i)).collect()
    }

    fn req(id: u64, keys: Vec<BlockKey>, prompt_tokens: u32, output_tokens: u32) -> EngineRequest {
        EngineRequest {
            id,
            keys,
            prompt_tokens,
            output_tokens,
            offered: Vec::new(),
            offered_from: 0,
        }
    }

    fn config(block_tokens: u32, gpu_blocks: u32) -> EngineConfig {
        EngineConfig {
            block_tokens,
            gpu_blocks,
            ..EngineConfig::default()
        }
    }

    fn us(ms: f64) -> u64 {
        ((ms * 1000.0).round() as u64).max(1)
    }

    /// What a drive produced.
    struct Run {
        engine: Engine,
        l2: TierSet,
        events: Vec<EngineEvent>,
        /// (start, end) of every step.
        steps: Vec<(u64, u64)>,
    }

    impl Run {
        /// Token events only (no block events).
        fn tokens(&self) -> Vec<EngineEvent> {
            let block = |e: &&EngineEvent| {
                matches!(e, EngineEvent::Stored { .. } | EngineEvent::Removed { .. })
            };
            self.events.iter().filter(|e| !block(e)).cloned().collect()
        }

        fn first_token(&self, id: u64) -> (u64, [u32; 3]) {
            for e in &self.events {
                if let EngineEvent::FirstToken {
                    id: i,
                    at_us,
                    gpu_hit_tokens,
                    l1_hit_tokens,
                    l2_hit_tokens,
                } = *e
                {
                    if i == id {
                        return (at_us, [gpu_hit_tokens, l1_hit_tokens, l2_hit_tokens]);
                    }
                }
            }
            panic!("no first token for {id}");
        }

        fn removed(&self, tier: Tier) -> Vec<BlockKey> {
            let pick = |e: &EngineEvent| match *e {
                EngineEvent::Removed { key, tier: t } if t == tier => Some(key),
                _ => None,
            };
            self.events.iter().filter_map(pick).collect()
        }

        fn step_starting_at(&self, t: u64) -> u64 {
            let (start, end) = self
                .steps
                .iter()
                .find(|s| s.0 == t)
                .copied()
                .expect("no step there");
            end - start
        }
    }

    /// Drives one engine over `arrivals` (sorted by time) until it is idle, checking the
    /// block accounting after every call and that the block events replay to the tiers'
    /// real contents.
    fn drive(config: EngineConfig, arrivals: Vec<(u64, EngineRequest)>, l2: TierSet) -> Run {
        let mut run = Run {
            engine: Engine::new(config, ModelProfile::dynamo_default()),
            l2,
            events: Vec::new(),
            steps: Vec::new(),
        };
        let mut replay = Replay::default();
        for k in run.l2.keys_lru_first() {
            replay.l2.insert(k);
        }
        let mut arrivals = arrivals.into_iter().peekable();
        let mut now = 0;
        let mut step_end: Option<u64> = None;
        for _ in 0..1_000_000 {
            while let Some((_, r)) = arrivals.next_if(|(t, _)| *t <= now) {
                run.engine.submit(now, r);
            }
            if step_end.is_none() {
                step_end = run.engine.start_step(now, &mut run.l2, &mut run.events);
                if let Some(end) = step_end {
                    assert!(end > now);
                    run.steps.push((now, end));
                }
                check_accounting(&run.engine);
            }
            let next_arrival = arrivals.peek().map(|(t, _)| *t);
            match (step_end, next_arrival) {
                (Some(end), a) if a.is_none() || a >= Some(end) => {
                    now = end;
                    run.engine.complete_step(now, &mut run.l2, &mut run.events);
                    step_end = None;
                    check_accounting(&run.engine);
                }
                (_, Some(a)) => now = a,
                (_, None) => {
                    run.engine.complete_step(now, &mut run.l2, &mut run.events);
                    assert_eq!(run.engine.in_flight(), 0, "stuck with work");
                    replay.apply(&run.events);
                    replay.check(&run.engine, &run.l2);
                    return run;
                }
            }
        }
        panic!("did not finish");
    }

    /// Resident sets rebuilt from Stored/Removed events.
    #[derive(Default)]
    struct Replay {
        gpu: BTreeSet<BlockKey>,
        l1: BTreeSet<BlockKey>,
        l2: BTreeSet<BlockKey>,
    }

    impl Replay {
        fn apply(&mut self, events: &[EngineEvent]) {
            for e in events {
                let (key, tier, stored) = match *e {
                    EngineEvent::Stored { key, tier } => (key, tier, true),
                    EngineEvent::Removed { key, tier } => (key, tier, false),
                    _ => continue,
                };
                let set = match tier {
                    Tier::Gpu => &mut self.gpu,
                    Tier::L1 => &mut self.l1,
                    Tier::L2 => &mut self.l2,
                };
                if stored {
                    assert!(set.insert(key), "stored twice: {e:?}");
                } else {
                    assert!(set.remove(&key), "removed while absent: {e:?}");
                }
            }
        }

        fn check(&self, engine: &Engine, l2: &TierSet) {
            let gpu: BTreeSet<BlockKey> = engine.resident.keys().copied().collect();
            assert_eq!(self.gpu, gpu);
            assert_eq!(self.l1, engine.l1.keys_lru_first().into_iter().collect());
            assert_eq!(self.l2, l2.keys_lru_first().into_iter().collect());
        }
    }

    /// Every GPU block is free, evictable, referenced or anonymous, exactly once; reference
    /// counts match the running sequences.
    fn check_accounting(e: &Engine) {
        let mut refs: HashMap<BlockKey, u32> = HashMap::new();
        let mut anon = 0;
        for s in &e.running {
            for k in &s.keys[..s.named] {
                *refs.entry(*k).or_default() += 1;
            }
            anon += s.anon;
        }
        for s in &e.waiting {
            assert_eq!((s.named, s.anon), (0, 0), "waiting sequences hold nothing");
        }
        let mut referenced = 0;
        for (k, &r) in &e.resident {
            assert_eq!(r, refs.get(k).copied().unwrap_or(0), "{k:?}");
            assert_eq!(r == 0, e.evictable.contains(*k), "{k:?}");
            referenced += u64::from(r > 0);
        }
        assert!(refs.keys().all(|k| e.resident.contains_key(k)));
        assert_eq!(e.evictable.len(), e.resident.len() - referenced as usize);
        let total = e.free_blocks + e.evictable.len() as u64 + referenced + anon;
        assert_eq!(total, u64::from(e.config.gpu_blocks));
    }

    /// One request after another, each arriving when the previous has long finished.
    fn one_by_one(requests: Vec<EngineRequest>) -> Vec<(u64, EngineRequest)> {
        requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| (i as u64 * 10_000_000, r))
            .collect()
    }

    #[test]
    fn repeated_prompts_hit_the_gpu_cache() {
        let shared = |tail: u64| vec![BlockKey(1), BlockKey(2), BlockKey(tail), BlockKey(tail + 1)];
        // (first prompt, second prompt, second's gpu hit tokens), 16-token blocks.
        let cases = [
            ((keys(1, 4), 70), (keys(1, 4), 70), 64),
            // A prompt of exactly n blocks recomputes its last token, so its last block.
            ((keys(1, 4), 64), (keys(1, 4), 64), 48),
            ((keys(1, 4), 70), (keys(2, 4), 70), 0),
            ((shared(10), 70), (shared(20), 70), 32),
            ((keys(1, 4), 70), (keys(1, 2), 40), 32),
            ((keys(1, 2), 40), (keys(1, 4), 70), 32),
            ((vec![], 10), (vec![], 10), 0),
        ];
        for (i, ((ka, ta), (kb, tb), want)) in cases.into_iter().enumerate() {
            let run = drive(
                config(16, 1000),
                one_by_one(vec![req(0, ka, ta, 2), req(1, kb, tb, 2)]),
                TierSet::lru(0),
            );
            assert_eq!(run.first_token(0).1, [0, 0, 0], "case {i}");
            assert_eq!(run.first_token(1).1, [want, 0, 0], "case {i}");
            let s = run.engine.stats();
            assert_eq!(s.gpu_hit_tokens, u64::from(want), "case {i}");
            assert_eq!(
                s.computed_prefill_tokens + s.gpu_hit_tokens,
                s.prompt_tokens,
                "case {i}"
            );
        }
    }

    #[test]
    fn evicts_least_recently_used_free_blocks_tail_first() {
        // 4-token blocks, 6 GPU blocks; each prompt is 2 named blocks and a 1-token tail.
        // After A and B: evictable [A1, A0, B1, B0] (released tail first), 2 free. C takes
        // the 2 free blocks and evicts A1; A again hits A0 and evicts B1 for its new blocks.
        let p = |tag| req(tag, keys(tag, 2), 9, 1);
        let run = drive(
            config(4, 6),
            one_by_one(vec![p(1), p(2), p(3), p(1)]),
            TierSet::lru(0),
        );
        assert_eq!(run.removed(Tier::Gpu), vec![keys(1, 2)[1], keys(2, 2)[1]]);
        let hits: Vec<u32> = run
            .tokens()
            .iter()
            .filter_map(|e| match e {
                EngineEvent::FirstToken { gpu_hit_tokens, .. } => Some(*gpu_hit_tokens),
                _ => None,
            })
            .collect();
        assert_eq!(hits, vec![0, 0, 0, 4]);
    }

    #[test]
    fn chunked_prefill_then_decode() {
        let d = ModelProfile::dynamo_default();
        let cfg = EngineConfig {
            max_batch_tokens: 100,
            ..config(16, 1000)
        };
        let run = drive(cfg, vec![(0, req(7, keys(1, 15), 250, 3))], TierSet::lru(0));
        // 250 tokens in chunks of 100, 100, 50; then two decode steps holding 16 blocks.
        let u = 16.0 / 1000.0;
        let want = [
            d.prefill_ms(100),
            d.prefill_ms(100),
            d.prefill_ms(50),
            d.decode_step_ms(u),
            d.decode_step_ms(u),
        ];
        let got: Vec<u64> = run.steps.iter().map(|(s, e)| e - s).collect();
        assert_eq!(got, want.map(us).to_vec());
        let ends: Vec<u64> = run.steps.iter().map(|s| s.1).collect();
        let first = EngineEvent::FirstToken {
            id: 7,
            at_us: ends[2],
            gpu_hit_tokens: 0,
            l1_hit_tokens: 0,
            l2_hit_tokens: 0,
        };
        let want = vec![
            first,
            EngineEvent::Token {
                id: 7,
                at_us: ends[3],
            },
            EngineEvent::Token {
                id: 7,
                at_us: ends[4],
            },
            EngineEvent::Finished {
                id: 7,
                at_us: ends[4],
            },
        ];
        assert_eq!(run.tokens(), want);
        // The 15 complete blocks are named when the prefill completes, not before.
        let stored = run
            .events
            .iter()
            .position(|e| matches!(e, EngineEvent::Stored { .. }))
            .unwrap();
        assert_eq!(stored, 0);
        assert_eq!(run.events.len(), 4 + 15);
        assert_eq!(run.engine.stats().steps, 5);
        assert_eq!(run.engine.stats().busy_us, ends[4]);
    }

    #[test]
    fn step_time_follows_the_cost_model() {
        let d = ModelProfile::dynamo_default();
        // A (10 tokens) prefills alone; B arrives during that step and is prefilled while A
        // decodes; A holds 1 block and B 2 of 100, so usage is 3%.
        let run = drive(
            config(16, 100),
            vec![(0, req(0, vec![], 10, 3)), (1, req(1, keys(2, 1), 20, 1))],
            TierSet::lru(0),
        );
        let got: Vec<u64> = run.steps.iter().map(|(s, e)| e - s).collect();
        let want = [
            d.prefill_ms(10),
            d.prefill_ms(20) + d.decode_step_ms(0.03),
            d.decode_step_ms(0.01),
        ];
        assert_eq!(got, want.map(us).to_vec());
    }

    #[test]
    fn preemption_under_a_tiny_cache_still_finishes_everything() {
        // (gpu blocks, requests as (keys, prompt, output)), 4-token blocks; all arrive at 0.
        type Case = (u32, Vec<(Vec<BlockKey>, u32, u32)>);
        let cases: Vec<Case> = vec![
            (8, (1..=4).map(|t| (keys(t, 2), 8, 12)).collect()),
            (8, (1..=6).map(|_| (keys(1, 2), 9, 15)).collect()),
            (6, (1..=5).map(|t| (keys(t, 1), 5, 9)).collect()),
        ];
        for (i, (gpu, reqs)) in cases.into_iter().enumerate() {
            let n = reqs.len() as u64;
            let outputs: Vec<u32> = reqs.iter().map(|r| r.2).collect();
            let arrivals = reqs
                .into_iter()
                .enumerate()
                .map(|(id, (k, p, o))| (0, req(id as u64, k, p, o)))
                .collect();
            let run = drive(config(4, gpu), arrivals, TierSet::lru(0));
            let s = run.engine.stats();
            assert!(s.preemptions > 0, "case {i}: no preemption");
            assert_eq!((s.finished, s.rejected), (n, 0), "case {i}");
            for (id, &out) in outputs.iter().enumerate() {
                let id = id as u64;
                let count = |f: fn(&EngineEvent, u64) -> bool| {
                    run.events.iter().filter(|e| f(e, id)).count()
                };
                let firsts =
                    count(|e, id| matches!(e, EngineEvent::FirstToken { id: i, .. } if *i == id));
                let tokens =
                    count(|e, id| matches!(e, EngineEvent::Token { id: i, .. } if *i == id));
                let finished =
                    count(|e, id| matches!(e, EngineEvent::Finished { id: i, .. } if *i == id));
                assert_eq!(
                    (firsts, firsts + tokens, finished),
                    (1, out as usize, 1),
                    "case {i} id {id}"
                );
            }
            assert!(
                s.gpu_hit_tokens + s.computed_prefill_tokens > s.prompt_tokens,
                "case {i}: recompute"
            );
        }
    }

    #[test]
    fn tiers_catch_evicted_blocks_and_load_them_back() {
        let d = ModelProfile::dynamo_default();
        // 16-token blocks, 7 GPU blocks. A (4 blocks + 1 token) finishes; B evicts A's last
        // two blocks (A3, then A2); A again finds A0, A1 on the GPU and A2, A3 wherever the
        // offload put them. (l1 blocks, offload to L2, A's second hits as gpu/l1/l2 tokens).
        let cases = [
            (100, false, [32, 32, 0]),
            (0, true, [32, 0, 32]),
            (0, false, [32, 0, 0]),
            // L1 holds one block: A2 pushes A3 on to L2.
            (1, true, [32, 16, 16]),
            (1, false, [32, 16, 0]),
        ];
        for (i, (l1_blocks, offload_to_l2, want)) in cases.into_iter().enumerate() {
            for async_loads in [false, true] {
                let cfg = EngineConfig {
                    l1_blocks,
                    offload_to_l2,
                    async_loads,
                    ..config(16, 7)
                };
                let workload = one_by_one(vec![
                    req(0, keys(1, 4), 65, 1),
                    req(1, keys(2, 4), 65, 1),
                    req(2, keys(1, 4), 65, 1),
                ]);
                let run = drive(cfg, workload.clone(), TierSet::lru(1000));
                assert_eq!(run.first_token(2).1, want, "case {i}");
                // B evicts A3, A2; A's return evicts B3, B2 for the blocks it loads or computes.
                let evicted = [1 << 32 | 3, 1 << 32 | 2, 2 << 32 | 3, 2 << 32 | 2].map(BlockKey);
                assert_eq!(run.removed(Tier::Gpu), evicted, "case {i}");
                let s = run.engine.stats();
                let hits = [s.gpu_hit_tokens, s.l1_hit_tokens, s.l2_hit_tokens];
                assert_eq!(hits, want.map(u64::from), "case {i}");
                assert_eq!(
                    hits.iter().sum::<u64>() + s.computed_prefill_tokens,
                    s.prompt_tokens,
                    "case {i}"
                );
                let computed = 65 - want.iter().sum::<u32>();
                let load_ms = d.load_ms(Tier::L1, u64::from(want[1]))
                    + d.load_ms(Tier::L2, u64::from(want[2]));
                let submitted = workload[2].0;
                if !async_loads || load_ms == 0.0 {
                    // The admitting step computes the rest and pays for the loads.
                    let ms = d.prefill_ms(u64::from(computed)) + load_ms;
                    assert_eq!(run.step_starting_at(submitted), us(ms), "case {i}");
                } else {
                    // The engine waits for the load (it has nothing else to do), then computes
                    // the rest; the wait is not busy time.
                    let loaded_at = submitted + us(load_ms);
                    assert_eq!(run.step_starting_at(submitted), us(load_ms), "case {i}");
                    assert_eq!(
                        run.first_token(2).0,
                        loaded_at + us(d.prefill_ms(u64::from(computed))),
                        "case {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn prefetched_blocks_land_in_l1_after_their_reads_and_load_from_there() {
        let d = ModelProfile::dynamo_default();
        let read_us = us(d.load_ms(Tier::L2, 16));
        let mut l2 = TierSet::lru(100);
        let mut events = Vec::new();
        // L2 holds A0..A3 and B0, not B1.
        for k in keys(1, 4).into_iter().chain(keys(2, 1)) {
            l2.insert(k, &mut Vec::new());
        }
        let mut e = Engine::new(
            EngineConfig {
                l1_blocks: 100,
                offload_to_l2: true,
                ..config(16, 16)
            },
            d.clone(),
        );
        // B stops at the block L2 lacks; A is read block after block on the host's link.
        assert_eq!(e.prefetch(0, &keys(2, 3), &l2), 1);
        assert_eq!(e.prefetch(0, &keys(1, 4), &l2), 4);
        // Asked again while on their way: nothing more to read.
        assert_eq!(e.prefetch(0, &keys(1, 4), &l2), 0);
        // Before the last read ends, three of A's blocks and B's are in L1.
        assert_eq!(e.start_step(4 * read_us, &mut l2, &mut events), None);
        assert_eq!(e.stats().prefetched_blocks, 4);
        assert!(!e.l1().contains(keys(1, 4)[3]));
        assert_eq!(e.start_step(5 * read_us, &mut l2, &mut events), None);
        assert_eq!(e.stats().prefetched_blocks, 5);
        assert!(keys(1, 4).iter().all(|&k| e.l1().contains(k)));
        // A request for A now loads all four from L1.
        e.submit(5 * read_us, req(0, keys(1, 4), 65, 1));
        e.start_step(5 * read_us, &mut l2, &mut events);
        assert_eq!(e.stats().l1_hit_tokens, 64);
        assert_eq!(e.stats().l2_hit_tokens, 0);
    }

    #[test]
    fn l2_evictions_are_reported() {
        // No L1, an L2 of one block: A3 then A2 go to L2, A2 displaces A3.
        let cfg = EngineConfig {
            offload_to_l2: true,
            ..config(16, 7)
        };
        let workload = one_by_one(vec![req(0, keys(1, 4), 65, 1), req(1, keys(2, 4), 65, 1)]);
        let run = drive(cfg, workload, TierSet::lru(1));
        assert_eq!(run.removed(Tier::L2), vec![BlockKey(1 << 32 | 3)]);
        assert_eq!(run.l2.keys_lru_first(), vec![BlockKey(1 << 32 | 2)]);
    }

    #[test]
    fn computed_blocks_are_written_through_to_l2_once() {
        // A GPU of 7 blocks and an L1 of 1: B's prompt pushes some of A's blocks out, through
        // L1, towards L2.
        for write_through in [false, true] {
            let cfg = EngineConfig {
                l1_blocks: 1,
                offload_to_l2: true,
                l2_write_through: write_through,
                ..config(16, 7)
            };
            let workload = one_by_one(vec![req(0, keys(1, 4), 65, 1), req(1, keys(2, 4), 65, 1)]);
            let run = drive(cfg, workload, TierSet::lru(100));
            let stores = |key: BlockKey| {
                let store = EngineEvent::Stored {
                    key,
                    tier: Tier::L2,
                };
                run.events.iter().filter(|&e| *e == store).count()
            };
            let computed: Vec<BlockKey> = keys(1, 4).into_iter().chain(keys(2, 4)).collect();
            if write_through {
                // Every computed block is in L2, B's while its GPU still holds them, stored
                // once though some of A's were evicted from the GPU and L1 afterwards.
                for &key in &computed {
                    assert_eq!(stores(key), 1, "{key:?}");
                    assert!(run.l2.contains(key), "{key:?}");
                }
                assert!(!run.removed(Tier::L1).is_empty());
            } else {
                // L2 has only what L1 evicted: none of B's blocks.
                for key in keys(2, 4) {
                    assert_eq!(stores(key), 0, "{key:?}");
                    assert!(!run.l2.contains(key), "{key:?}");
                }
            }
        }
    }

    #[test]
    fn requests_that_can_never_fit_are_rejected() {
        // (gpu blocks, prompt tokens, output tokens, rejected), 16-token blocks.
        let cases = [
            (4, 48, 1, false),
            (4, 49, 1, true),
            (4, 40, 9, false),
            (4, 40, 10, true),
            (0, 1, 1, true),
            (1, 1, 1, true),
            (2, 0, 0, false),
            (2, u32::MAX, u32::MAX, true),
        ];
        for (i, (gpu, prompt, output, rejected)) in cases.into_iter().enumerate() {
            let run = drive(
                config(16, gpu),
                vec![(5, req(9, keys(1, 100), prompt, output))],
                TierSet::lru(0),
            );
            let want = if rejected {
                vec![EngineEvent::Rejected { id: 9, at_us: 5 }]
            } else {
                vec![EngineEvent::Finished {
                    id: 9,
                    at_us: run.steps.last().unwrap().1,
                }]
            };
            let last: Vec<EngineEvent> = run.tokens().into_iter().rev().take(1).collect();
            assert_eq!(last, want, "case {i}");
            let s = run.engine.stats();
            assert_eq!(
                (s.rejected, s.finished),
                (u64::from(rejected), u64::from(!rejected)),
                "case {i}"
            );
        }
    }

    #[test]
    fn zero_lengths_behave_as_one() {
        let run = drive(
            config(16, 10),
            vec![(0, req(3, vec![], 0, 0))],
            TierSet::lru(0),
        );
        let end = run.steps[0].1;
        let first = EngineEvent::FirstToken {
            id: 3,
            at_us: end,
            gpu_hit_tokens: 0,
            l1_hit_tokens: 0,
            l2_hit_tokens: 0,
        };
        assert_eq!(
            run.tokens(),
            vec![first, EngineEvent::Finished { id: 3, at_us: end }]
        );
        assert_eq!(run.engine.stats().computed_prefill_tokens, 1);
        assert_eq!(end, us(ModelProfile::dynamo_default().prefill_ms(1)));
    }

    #[test]
    fn max_running_caps_admission() {
        let cfg = EngineConfig {
            max_running: 1,
            ..config(16, 100)
        };
        let run = drive(
            cfg,
            vec![(0, req(0, vec![], 10, 2)), (0, req(1, vec![], 10, 2))],
            TierSet::lru(0),
        );
        let ids: Vec<u64> = run
            .tokens()
            .iter()
            .map(|e| match *e {
                EngineEvent::FirstToken { id, .. }
                | EngineEvent::Token { id, .. }
                | EngineEvent::Finished { id, .. } => id,
                _ => u64::MAX,
            })
            .collect();
        assert_eq!(ids, vec![0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn cancel_frees_blocks_like_a_finish() {
        let mut l2 = TierSet::lru(0);
        let mut events = Vec::new();
        let cfg = EngineConfig {
            max_running: 1,
            ..config(16, 100)
        };
        let mut e = Engine::new(cfg, ModelProfile::dynamo_default());
        // A: 4 named blocks + 6 tokens, decodes for a long time; B waits behind it.
        e.submit(0, req(1, keys(1, 4), 70, 1000));
        e.submit(0, req(2, keys(2, 1), 20, 5));
        let end = e.start_step(0, &mut l2, &mut events).unwrap();
        e.complete_step(end, &mut l2, &mut events);
        let end = e.start_step(end, &mut l2, &mut events).unwrap();
        check_accounting(&e);
        assert_eq!((e.num_running(), e.num_waiting()), (1, 1));
        // Cancel the waiting B, then A in the middle of its decode step.
        assert!(e.cancel(end - 1, 2));
        assert!(e.cancel(end - 1, 1));
        assert!(!e.cancel(end - 1, 1), "already gone");
        assert!(!e.cancel(end - 1, 99), "unknown");
        check_accounting(&e);
        assert_eq!((e.num_running(), e.num_waiting(), e.in_flight()), (0, 0, 0));
        assert_eq!(e.kv_usage(), 0.0);
        let before = events.len();
        e.complete_step(end, &mut l2, &mut events);
        assert_eq!(events.len(), before, "a cancelled request gets no events");
        assert_eq!(e.start_step(end, &mut l2, &mut events), None);
        assert_eq!((e.stats().cancelled, e.stats().finished), (2, 0));
        // A's prompt blocks stayed cached: the same prompt hits them.
        e.submit(end, req(3, keys(1, 4), 70, 1));
        let end2 = e.start_step(end, &mut l2, &mut events).unwrap();
        e.complete_step(end2, &mut l2, &mut events);
        check_accounting(&e);
        assert!(events.contains(&EngineEvent::FirstToken {
            id: 3,
            at_us: end2,
            gpu_hit_tokens: 64,
            l1_hit_tokens: 0,
            l2_hit_tokens: 0,
        }));
        assert!(e.can_ever_fit(16 * 98, 1));
        assert!(!e.can_ever_fit(16 * 99 + 1, 1));
    }

    #[test]
    fn an_answer_offered_before_admission_admits_into_the_step_at_hand() {
        let d = ModelProfile::dynamo_default();
        let (mut l2, mut events, mut lookups) = (TierSet::lru(0), Vec::new(), Vec::new());
        let mut e = Engine::new(config(16, 100), d.clone());
        e.set_outside_lookups(true);
        // A (6 blocks + 4 tokens): the store answered while it queued that it has none of
        // the 6: no lookup, and its prefill runs in the first step.
        e.submit(0, req(1, keys(1, 6), 100, 2));
        assert!(e.offer(1, 0, 6, &[]));
        assert!(!e.offer(9, 0, 6, &[]), "no such request");
        assert!(!e.offer(1, 3, 9, &[]), "past its keys");
        let end = e.start_step(0, &mut l2, &mut events).expect("a step");
        e.take_lookups(&mut lookups);
        assert!(lookups.is_empty(), "answered already: {lookups:?}");
        e.complete_step(end, &mut l2, &mut events);
        check_accounting(&e);
        assert!(events.contains(&EngineEvent::FirstToken {
            id: 1,
            at_us: end,
            gpu_hit_tokens: 0,
            l1_hit_tokens: 0,
            l2_hit_tokens: 0,
        }));
        assert!(!e.offer(1, 0, 6, &[]), "admitted: nothing to offer to");
        // A' (the same shape): the answer held blocks 0 and 1, from L1 and L2; they count
        // as hits and load, and nothing is asked at admission.
        let mut e = Engine::new(config(16, 100), d.clone());
        e.set_outside_lookups(true);
        e.submit(0, req(3, keys(3, 6), 100, 2));
        assert!(e.offer(3, 0, 6, &[Tier::L1, Tier::L2]));
        let mut now = 0;
        events.clear();
        while e.in_flight() > 0 {
            if let Some(end) = e.start_step(now, &mut l2, &mut events) {
                e.take_lookups(&mut lookups);
                assert!(lookups.is_empty(), "answered already: {lookups:?}");
                e.complete_step(end, &mut l2, &mut events);
                now = end;
            }
        }
        check_accounting(&e);
        assert!(events.iter().any(|ev| matches!(
            ev,
            EngineEvent::FirstToken {
                id: 3,
                gpu_hit_tokens: 0,
                l1_hit_tokens: 16,
                l2_hit_tokens: 16,
                ..
            }
        )));
        // B (4 blocks + 4 tokens): the answer covered blocks 0..2 only (the GPU held
        // block 2 then; it lost it since): admission asks for the rest itself.
        let mut e = Engine::new(config(16, 100), d);
        e.set_outside_lookups(true);
        e.submit(0, req(2, keys(5, 4), 68, 1));
        assert!(e.offer(2, 0, 2, &[]));
        assert_eq!(
            e.start_step(0, &mut l2, &mut events),
            None,
            "B waits for its lookup"
        );
        e.take_lookups(&mut lookups);
        assert_eq!(lookups.len(), 1);
        assert_eq!(lookups[0].keys, keys(5, 4));
    }

    #[test]
    fn outside_lookups_are_asked_at_admission_while_the_batch_goes_on() {
        let d = ModelProfile::dynamo_default();
        let mut l2 = TierSet::lru(0);
        let mut events = Vec::new();
        let mut lookups = Vec::new();
        let mut e = Engine::new(config(16, 100), d.clone());
        e.set_outside_lookups(true);
        // A (4 blocks + 6 tokens) is admitted, asks for its 4 blocks and waits: no step.
        e.submit(0, req(1, keys(1, 4), 70, 20));
        assert_eq!(e.start_step(0, &mut l2, &mut events), None);
        check_accounting(&e);
        e.take_lookups(&mut lookups);
        let a = Lookup {
            ticket: 0,
            id: 1,
            keys: keys(1, 4),
        };
        assert_eq!(lookups, [a]);
        // The store has none of them: A computes its whole prompt.
        assert!(e.answer_lookup(100, 0, &[], &mut events));
        assert!(!e.answer_lookup(100, 0, &[], &mut events), "answered once");
        let mut now = 100;
        let step = |e: &mut Engine, now: &mut u64, events: &mut Vec<EngineEvent>| {
            let end = e.start_step(*now, &mut TierSet::lru(0), events).unwrap();
            e.complete_step(end, &mut TierSet::lru(0), events);
            check_accounting(e);
            *now = end;
        };
        step(&mut e, &mut now, &mut events);
        assert_eq!(
            events.last(),
            Some(&EngineEvent::FirstToken {
                id: 1,
                at_us: now,
                gpu_hit_tokens: 0,
                l1_hit_tokens: 0,
                l2_hit_tokens: 0,
            })
        );
        // B arrives while A decodes; its blocks 1..3 (past the GPU's B0, which A0's
        // family does not share) are asked for, and A goes on decoding meanwhile.
        let b_keys = vec![BlockKey(1 << 32), BlockKey(9), BlockKey(10), BlockKey(11)];
        e.submit(now, req(2, b_keys.clone(), 64, 1));
        let admitted = now;
        step(&mut e, &mut now, &mut events);
        lookups.clear();
        e.take_lookups(&mut lookups);
        // Only blocks that end before the last prompt token can hit: B0..B2, B0 from the GPU.
        assert_eq!(lookups[0].keys, b_keys[1..3]);
        let ticket = lookups[0].ticket;
        for _ in 0..3 {
            events.clear();
            step(&mut e, &mut now, &mut events);
            assert_eq!(
                events,
                [EngineEvent::Token { id: 1, at_us: now }],
                "A decodes"
            );
        }
        // The answer: both blocks, from L1 (a longer answer is cut to what was asked).
        events.clear();
        assert!(e.answer_lookup(now, ticket, &[Tier::L1; 5], &mut events));
        let stored = b_keys[1..3].iter().map(|&key| EngineEvent::Stored {
            key,
            tier: Tier::Gpu,
        });
        assert_eq!(events, stored.collect::<Vec<_>>());
        check_accounting(&e);
        // Its load ran from the admission on and has landed (A's decode steps took
        // longer): B's prefill is in the next step.
        assert!(admitted + us(d.load_ms(Tier::L1, 32)) < now);
        events.clear();
        step(&mut e, &mut now, &mut events);
        assert!(events.contains(&EngineEvent::FirstToken {
            id: 2,
            at_us: now,
            gpu_hit_tokens: 16,
            l1_hit_tokens: 32,
            l2_hit_tokens: 0,
        }));
        let s = e.stats();
        assert_eq!(
            (s.gpu_hit_tokens, s.l1_hit_tokens, s.l2_hit_tokens),
            (16, 32, 0)
        );
        assert_eq!(s.load_us, us(d.load_ms(Tier::L1, 32)));

        // C is cancelled while its lookup is out: the answer finds no one.
        e.submit(now, req(3, keys(3, 4), 70, 1));
        step(&mut e, &mut now, &mut events);
        lookups.clear();
        e.take_lookups(&mut lookups);
        assert_eq!(lookups[0].id, 3);
        assert!(e.cancel(now, 3));
        check_accounting(&e);
        assert!(!e.answer_lookup(now, lookups[0].ticket, &[Tier::L2], &mut events));
        assert!(
            !e.answer_lookup(now, 99, &[], &mut events),
            "unknown ticket"
        );
    }

    #[test]
    fn a_request_preempted_before_its_answer_asks_again() {
        let mut e = Engine::new(config(16, 6), ModelProfile::dynamo_default());
        e.set_outside_lookups(true);
        let (mut l2, mut events, mut lookups) = (TierSet::lru(0), Vec::new(), Vec::new());
        let mut now = 0;
        // A (2 blocks, growing to 5) then B (3 blocks): A's decode needs B's blocks while
        // B waits for its answer, and preempts it.
        e.submit(0, req(1, keys(1, 1), 30, 40));
        e.submit(0, req(2, keys(2, 3), 48, 1));
        let mut asked = Vec::new();
        while e.in_flight() > 0 {
            if let Some(end) = e.start_step(now, &mut l2, &mut events) {
                e.complete_step(end, &mut l2, &mut events);
                now = end;
            }
            check_accounting(&e);
            e.take_lookups(&mut lookups);
            for l in lookups.drain(..) {
                asked.push(l.id);
                if l.id == 2 && e.stats().preemptions == 0 {
                    // B's answer comes only after it was preempted.
                    while e.stats().preemptions == 0 {
                        let end = e.start_step(now, &mut l2, &mut events).unwrap();
                        e.complete_step(end, &mut l2, &mut events);
                        now = end;
                        check_accounting(&e);
                    }
                    assert!(!e.answer_lookup(now, l.ticket, &[Tier::L1; 2], &mut events));
                } else {
                    assert!(e.answer_lookup(now, l.ticket, &[], &mut events));
                }
            }
        }
        // A asked once, B at each admission.
        assert_eq!(asked, [1, 2, 2]);
        let s = e.stats();
        assert_eq!((s.finished, s.preemptions, s.l1_hit_tokens), (2, 1, 0));
    }

    #[test]
    fn an_outside_lookup_stops_at_a_block_the_gpu_holds() {
        let mut e = Engine::new(config(16, 100), ModelProfile::dynamo_default());
        e.set_outside_lookups(true);
        let (mut l2, mut events, mut lookups) = (TierSet::lru(0), Vec::new(), Vec::new());
        let k = |i: u64| BlockKey(100 + i);
        // The GPU holds k2 (a one-block prompt, which asks for nothing) but not k0, k1: as
        // for the engine's own tiers, the run to load ends at k2 and the rest is computed.
        let mut now = 0;
        for (id, keys, tokens) in [(1, vec![k(2)], 16), (2, (0..4).map(k).collect(), 70)] {
            e.submit(now, req(id, keys, tokens, 1));
            while e.in_flight() > 0 {
                if let Some(end) = e.start_step(now, &mut l2, &mut events) {
                    e.complete_step(end, &mut l2, &mut events);
                    now = end;
                }
                e.take_lookups(&mut lookups);
                for l in &lookups {
                    e.answer_lookup(now, l.ticket, &[Tier::L2; 4], &mut events);
                }
                check_accounting(&e);
            }
        }
        let asked: Vec<_> = lookups.iter().map(|l| l.keys.clone()).collect();
        assert_eq!(asked, [vec![k(0), k(1)]]);
        assert_eq!(e.stats().l2_hit_tokens, 32);
    }

    #[test]
    fn without_outside_lookups_nothing_is_asked() {
        let mut run = drive(config(16, 200), mixed_workload(3, 40, 4), TierSet::lru(0));
        let mut lookups = Vec::new();
        run.engine.take_lookups(&mut lookups);
        assert!(lookups.is_empty());
    }

    /// `n` requests with shared prefixes from a few families, arriving every ~20 ms.
    fn mixed_workload(seed: u64, n: u64, families: u64) -> Vec<(u64, EngineRequest)> {
        let mut rng = Rng::new(seed);
        (0..n)
            .map(|id| {
                let blocks = rng.range(0, 40);
                let tail = rng.range(0, 15) as u32;
                let family = rng.below(families);
                let at = id * 20_000 + rng.below(20_000);
                let prompt = blocks as u32 * 16 + tail;
                (
                    at,
                    req(id, keys(family, blocks), prompt, rng.range(1, 60) as u32),
                )
            })
            .collect()
    }

    #[test]
    fn stats_add_up() {
        // (prompt families, gpu blocks, l1 blocks, offload to L2, preemptions expected)
        let cases = [
            (6, 20_000, 0, false, false),
            (40, 1200, 50, true, false),
            (6, 120, 60, true, true),
            (6, 60, 0, false, true),
        ];
        for (i, (families, gpu, l1_blocks, offload_to_l2, preempts)) in
            cases.into_iter().enumerate()
        {
            let cfg = EngineConfig {
                l1_blocks,
                offload_to_l2,
                ..config(16, gpu)
            };
            let workload = mixed_workload(i as u64, 300, families);
            let submitted_tokens: u64 = workload
                .iter()
                .map(|(_, r)| u64::from(r.prompt_tokens.max(1)))
                .sum();
            let run = drive(cfg, workload, TierSet::lru(300));
            let s = run.engine.stats().clone();
            assert_eq!(s.preemptions > 0, preempts, "case {i}: {s:?}");
            assert_eq!(s.finished + s.rejected, 300, "case {i}");
            assert_eq!(s.rejected, 0, "case {i}");
            assert_eq!(s.prompt_tokens, submitted_tokens, "case {i}");
            let hits = s.gpu_hit_tokens + s.l1_hit_tokens + s.l2_hit_tokens;
            if preempts {
                assert!(
                    hits + s.computed_prefill_tokens > s.prompt_tokens,
                    "case {i}: {s:?}"
                );
            } else {
                assert_eq!(
                    hits + s.computed_prefill_tokens,
                    s.prompt_tokens,
                    "case {i}: {s:?}"
                );
            }
            assert!(s.gpu_hit_tokens > 0, "case {i}: {s:?}");
            assert_eq!(s.l1_hit_tokens > 0, l1_blocks > 0, "case {i}: {s:?}");
            assert_eq!(s.l2_hit_tokens > 0, offload_to_l2, "case {i}: {s:?}");
            assert_eq!(
                s.busy_us,
                run.steps.iter().map(|(a, b)| b - a).sum::<u64>(),
                "case {i}"
            );
            assert_eq!(run.engine.kv_usage(), 0.0, "case {i}");
        }
    }

    #[test]
    fn runs_are_deterministic() {
        let cfg = EngineConfig {
            l1_blocks: 60,
            offload_to_l2: true,
            ..config(16, 120)
        };
        let a = drive(cfg.clone(), mixed_workload(7, 200, 6), TierSet::lru(300));
        let b = drive(cfg, mixed_workload(7, 200, 6), TierSet::lru(300));
        assert_eq!(a.events, b.events);
        assert_eq!(a.steps, b.steps);
    }
}
