//! `warmpath engine-sim`: the engine model served live over HTTP, so that a router and a
//! load generator can drive it like a real vLLM server.
//!
//! One tokio task, the *engine loop*, owns the [`Engine`] and the L2 store ([`TierSet`]);
//! HTTP handlers talk to it only through a command channel and get their tokens back on a
//! per-request channel, so no lock is ever held across an await. The loop is a
//! discrete-event simulation chasing the wall clock: virtual time is the wall time since
//! start multiplied by `speedup`; a step planned at virtual `s` ending at `e` completes at
//! exactly `e` once the wall clock has reached it, and the next step starts at `e` (the
//! engine stays busy back to back, even when the loop wakes late: timer granularity delays
//! token delivery a little but never distorts the model's timeline). Requests are
//! submitted at the virtual time they arrive, after every step that ended before it.
//!
//! With the host's cache-agent (`offload.rs`), the loop asks it for a request's blocks past
//! the GPU's prefix when the request arrives; an answer that comes while the request queues
//! is handed to the engine (`Engine::offer`), and admission asks nothing for the range it
//! covers, so the request is admitted into the step at hand. Admission asks for what the
//! arrival did not cover, e.g. blocks the GPU evicted meanwhile
//! (`Engine::set_outside_lookups`): the loop starts the fetch in a task of its own (or waits
//! for the arrival's, when it asked the same), the request holds its GPU blocks and waits
//! while the batch goes on, and the answer comes back to the loop on a channel of its own
//! (empty when the agent failed or missed the deadline: a recompute).
//!
//! The HTTP surface is the part of vLLM's that warmpath uses:
//!
//! - `POST /v1/completions` and `POST /v1/chat/completions`, non-streaming and streaming
//!   (SSE, `data: {json}` events then `data: [DONE]`), with `usage` (and
//!   `prompt_tokens_details.cached_tokens`) in full responses and, when asked with
//!   `stream_options.include_usage`, in a last streamed chunk with empty `choices`. The
//!   engine behaves as if `ignore_eos`: exactly `max_tokens` tokens
//!   (`max_completion_tokens` for chat) come out, finish reason `length`. Output tokens
//!   are pseudo-words seeded by the prompt's token ids and the position, so the same
//!   prompt always gives the same text (like greedy decoding), streamed or not.
//! - Prompts are tokenized with [`text::tokenize`] (a token-id prompt is used as it is,
//!   chat messages are rendered by [`text::render_chat`]); the prefix-cache keys are
//!   [`token_block_keys`] under the tenant [`ENGINE_TENANT`] with the request's optional
//!   `cache_salt` (vLLM's field), so equal prompts with different salts share nothing.
//! - `GET /v1/models`, `GET /health`, and `GET /metrics` with vLLM's metric names.
//!
//! A client that goes away (drops a stream or a pending non-streaming request) cancels its
//! request in the engine: each request holds a guard that sends a cancel command when
//! dropped before the last token, and the loop also cancels a request whose token channel
//! is closed.
//!
//! Errors are classified once, at the edge (`error`): bad input is a 400 with OpenAI's
//! error body saying what is wrong, an unknown model a 404, a request the engine could
//! never fit a 400, and a stopped engine loop a 503.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use warmpath_index::cost::{ModelProfile, Tier};
use warmpath_index::keys::{token_block_keys, BlockKey, TenantKey};
use warmpath_index::openai::{
    ChatRequest, CompletionRequest, ErrorBody, PromptInput, RequestError,
};
use warmpath_index::text;
use warmpath_openai::{PromptTokensDetails, Usage};

use warmpath_sim::engine::{Engine, EngineConfig, EngineEvent, EngineRequest, EngineStats, Lookup};
use warmpath_sim::tiers::TierSet;

use crate::hyperpod::{ChunkPlan, ChunkPut, HyperPodSettings, HyperPodSide, Prompt};
use crate::kv_publish::KvPublisher;
use crate::offload::{AgentCounters, AgentSettings, AgentSide};

/// Tenant id under which the engine derives its block keys (with the request's
/// `cache_salt`). Engines hash their own way; this one hashes warmpath's way.
pub const ENGINE_TENANT: &str = "engine-sim";

/// Upper bounds of the `vllm:time_to_first_token_seconds` buckets: vLLM's.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// Upper bounds of the `vllm:inter_token_latency_seconds` buckets: vLLM's.
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// How one engine-sim server behaves.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSimConfig {
    /// Served model name; requests naming another model get a 404.
    pub model: String,
    /// Shape of the engine (block size, GPU blocks, batch budget, L1, offload to L2).
    pub engine: EngineConfig,
    /// Step timings and tier bandwidths.
    pub profile: ModelProfile,
    /// Virtual time per wall time: 1.0 is the model's real speed, 10.0 ten times faster.
    /// Must be finite and positive.
    pub speedup: f64,
    /// Output tokens of a request that sets no limit.
    pub default_max_tokens: u32,
    /// Longer prompts (in tokens of the built-in tokenizer) are a 400.
    pub max_prompt_tokens: u32,
    /// Capacity in blocks of the L2 store the engine offloads to (when
    /// `engine.offload_to_l2`) and loads from; 0 = none. This server's own store: in live
    /// mode L2 is not shared between engine-sim processes.
    pub l2_blocks: u64,
    /// The host's cache-agent: GPU evictions are offloaded to it and a GPU miss asks it for
    /// the following blocks (`offload.rs`). Set `engine.l1_blocks` and `l2_blocks` to 0
    /// with it: the agent is the L1 and L2.
    pub agent: Option<AgentSettings>,
    /// The host's cache-agent over its HyperPod daemon API, spoken as LMCache speaks it
    /// (`hyperpod.rs`): computed chunks stored, a GPU miss leases the following chunks.
    /// Not with `agent`.
    pub hyperpod: Option<HyperPodSettings>,
    /// Where to publish KV events (`tcp://HOST:PORT`, vLLM's format; `kv_publish.rs`).
    pub kv_events: Option<String>,
    /// Where to serve the replay of recent KV-event batches (vLLM's replay socket).
    pub kv_replay: Option<String>,
    /// How prompts become tokens (the built-in tokenizer by default; a real one to act as
    /// an engine serving that model).
    pub tokenizer: text::Tokenizer,
}

impl Default for EngineSimConfig {
    /// Model `sim-llama` on vLLM's defaults for Llama-3.1-8B on one H100 (16-token blocks),
    /// Dynamo's timings at real speed, 64 output tokens unless asked, prompts up to
    /// Llama-3.1's 131072-token context, no L2.
    fn default() -> Self {
        EngineSimConfig {
            model: "sim-llama".into(),
            engine: EngineConfig::default(),
            profile: ModelProfile::dynamo_default(),
            speedup: 1.0,
            default_max_tokens: 64,
            max_prompt_tokens: 131_072,
            l2_blocks: 0,
            agent: None,
            hyperpod: None,
            kv_events: None,
            kv_replay: None,
            tokenizer: text::Tokenizer::builtin(),
        }
    }
}

/// Serves `config`'s engine on `listener` until `shutdown` resolves, then stops accepting
/// and returns once in-flight requests (streams included) have finished.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: EngineSimConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if !(config.speedup.is_finite() && config.speedup > 0.0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "speedup must be a positive finite number, not {}",
                config.speedup
            ),
        ));
    }
    let addr = listener.local_addr()?;
    let mut engine = Engine::new(config.engine.clone(), config.profile.clone());
    let block_tokens = engine.config().block_tokens as usize;
    let (commands, inbox) = mpsc::unbounded_channel();
    if config.agent.is_some() && config.hyperpod.is_some() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "one agent link: the block API or the HyperPod API, not both",
        ));
    }
    let agent = config.agent.clone().map(AgentSide::start);
    let (put_done, puts_done) = mpsc::unbounded_channel();
    let hyperpod = config
        .hyperpod
        .clone()
        .map(|s| HyperPodSide::start(s, put_done));
    // With an agent, admission asks it for the blocks past the GPU's prefix.
    engine.set_outside_lookups(agent.is_some() || hyperpod.is_some());
    let (fetched, fetches) = mpsc::unbounded_channel();
    let kv = match &config.kv_events {
        Some(endpoint) => {
            let (publisher, bound) =
                KvPublisher::bind(endpoint, config.kv_replay.as_deref(), block_tokens as u32)
                    .await
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::AddrInUse, e))?;
            tracing::info!(endpoint = %bound, "publishing KV events");
            Some(publisher)
        }
        None => None,
    };
    let wants_tokens = kv.is_some() || hyperpod.is_some();
    let engine_loop = EngineLoop {
        agent: agent.clone(),
        plan: hyperpod.as_ref().map(|_| ChunkPlan::default()),
        hyperpod: hyperpod.clone(),
        kv,
        engine,
        l2: TierSet::lru(config.l2_blocks),
        clock: Clock {
            start: Instant::now(),
            speedup: config.speedup,
        },
        step_end: None,
        last_us: 0,
        routes: HashMap::new(),
        events: Vec::new(),
        lookups: Vec::new(),
        fetched,
        early: HashMap::new(),
        ttft: Histogram::new(TTFT_BUCKETS),
        itl: Histogram::new(ITL_BUCKETS),
        generation_tokens: 0,
    };
    // The loop ends when the last command sender is dropped, i.e. after the server stops.
    tokio::spawn(engine_loop.run(inbox, fetches, puts_done));
    let shared = Arc::new(Shared {
        model: config.model.clone(),
        block_tokens,
        default_max_tokens: config.default_max_tokens,
        max_prompt_tokens: config.max_prompt_tokens,
        created: unix_now(),
        commands,
        next_id: AtomicU64::new(1),
        agent,
        hyperpod,
        wants_tokens,
        tokenizer: config.tokenizer.clone(),
    });
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(shared);
    tracing::info!(%addr, model = %config.model, speedup = config.speedup, "engine-sim serving");
    use axum::serve::ListenerExt;
    // Streamed tokens are small writes: never hold them back for Nagle's algorithm.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

// ---------------------------------------------------------------------------------------
// Shared state and messages

/// What every handler needs; immutable except the id counter.
#[derive(Debug)]
struct Shared {
    /// Served model name.
    model: String,
    /// Tokens per KV block, after the engine's normalization: the key block size.
    block_tokens: usize,
    default_max_tokens: u32,
    max_prompt_tokens: u32,
    /// Unix seconds at start, reported as the model's `created`.
    created: u64,
    /// Commands to the engine loop, the only owner of the engine.
    commands: mpsc::UnboundedSender<Command>,
    /// Next engine request id.
    next_id: AtomicU64,
    /// The host's cache-agent, when there is one.
    agent: Option<Arc<AgentSide>>,
    /// The host's cache-agent over its HyperPod API, when that is the link.
    hyperpod: Option<Arc<HyperPodSide>>,
    /// Whether submissions carry their tokens (for KV events, or LMCache's chunks).
    wants_tokens: bool,
    tokenizer: text::Tokenizer,
}

/// What handlers ask of the engine loop.
#[derive(Debug)]
enum Command {
    /// Queue a request; the loop answers on `updates` with `Accepted` or `Rejected`, then
    /// one `First` and `output_tokens − 1` `Token`s.
    Submit {
        req: EngineRequest,
        updates: mpsc::UnboundedSender<Update>,
        /// The prompt's tokens and cache salt, when KV events are published or the link
        /// is the HyperPod API.
        blocks: Option<(Vec<u32>, Option<String>)>,
    },
    /// The client went away: drop the request (no-op when it has finished).
    Cancel { id: u64 },
    /// A copy of what `/metrics` shows.
    Metrics { reply: oneshot::Sender<Snapshot> },
}

/// The agent's answer to a lookup: an admission's (`Engine::answer_lookup`) or one
/// asked at arrival (`Engine::offer`).
#[derive(Debug)]
struct Fetched {
    asked: Asked,
    /// Tiers of the leading blocks that arrived whole.
    tiers: Vec<Tier>,
    /// Over the HyperPod API: the hashes of the chunks loaded.
    loaded: Vec<i64>,
}

/// Who asked the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// Admission, for the lookup with this ticket.
    Admission(u64),
    /// Arrival, for the request with this id.
    Arrival(u64),
}

/// A lookup asked at a request's arrival, not yet answered.
#[derive(Clone, Copy, Debug)]
struct Early {
    /// It asked for `keys[from..to]` of the request's keys; `first` is `keys[from]`.
    from: usize,
    to: usize,
    first: BlockKey,
    /// An admission lookup of this request that waits for this answer instead of asking
    /// again: its ticket and how many keys it asked for.
    admission: Option<(u64, usize)>,
}

/// Most lookups asked at arrival and not yet answered; past it, requests are looked up at
/// admission only. Each runs within the agent call deadline, so they end.
const MAX_EARLY_LOOKUPS: usize = 64;

/// What the engine loop tells one request's handler.
#[derive(Debug)]
enum Update {
    /// Queued in the engine.
    Accepted,
    /// The engine can never run it; says why.
    Rejected(String),
    /// The first output token; `hits` are the prompt's hit tokens from the GPU, L1 and L2
    /// (their sum is `cached_tokens`).
    First { hits: Hits },
    /// A later output token.
    Token,
}

/// Prompt tokens found in the GPU prefix cache, loaded from L1, loaded from L2.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Hits([u32; 3]);

impl Hits {
    fn total(self) -> u32 {
        self.0.iter().fold(0u32, |a, &b| a.saturating_add(b))
    }
}

/// Sends a cancel for request `id` when dropped while armed: the client went away before
/// the last token (a dropped stream or a dropped non-streaming handler).
#[derive(Debug)]
struct CancelGuard {
    id: u64,
    commands: mpsc::UnboundedSender<Command>,
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!(request_id = self.id, "client went away, cancelling");
            let _ = self.commands.send(Command::Cancel { id: self.id });
        }
    }
}

// ---------------------------------------------------------------------------------------
// The engine loop

/// Virtual time: wall time since `start` times `speedup`, in microseconds.
#[derive(Debug)]
struct Clock {
    start: Instant,
    speedup: f64,
}

impl Clock {
    fn now_us(&self) -> u64 {
        // Float-to-int casts saturate: no overflow panic.
        (self.start.elapsed().as_secs_f64() * 1e6 * self.speedup) as u64
    }

    /// The wall instant at which virtual time reaches `us` (far future on overflow).
    fn instant_of(&self, us: u64) -> Instant {
        let far = || Instant::now() + Duration::from_secs(86_400 * 365);
        Duration::try_from_secs_f64(us as f64 / 1e6 / self.speedup)
            .ok()
            .and_then(|d| self.start.checked_add(d))
            .unwrap_or_else(far)
    }
}

/// A request the loop routes tokens to.
#[derive(Debug)]
struct Route {
    updates: mpsc::UnboundedSender<Update>,
    /// Virtual time of submission, for time to first token.
    arrived_us: u64,
    /// Virtual time of the last token out, for inter-token latency.
    last_token_us: u64,
}

/// Owner of the engine; see the module docs.
#[derive(Debug)]
struct EngineLoop {
    engine: Engine,
    /// Where GPU evictions are offloaded, when there is an agent.
    agent: Option<Arc<AgentSide>>,
    /// Where computed chunks are stored, when the agent is reached over its HyperPod API.
    hyperpod: Option<Arc<HyperPodSide>>,
    /// The chunks of live requests, with `hyperpod`.
    plan: Option<ChunkPlan>,
    /// Where GPU stores and evictions are published, when asked.
    kv: Option<KvPublisher>,
    /// This server's L2 store.
    l2: TierSet,
    clock: Clock,
    /// Virtual end of the step in flight.
    step_end: Option<u64>,
    /// Latest virtual time handed to the engine: keeps time monotonic.
    last_us: u64,
    /// Requests in the engine, by id.
    routes: HashMap<u64, Route>,
    /// Reused event buffer.
    events: Vec<EngineEvent>,
    /// Reused buffer of the lookups admission asked for.
    lookups: Vec<Lookup>,
    /// Where a fetch task sends the agent's answer to a lookup.
    fetched: mpsc::UnboundedSender<Fetched>,
    /// Lookups asked at arrival (block API), by request id, until answered.
    early: HashMap<u64, Early>,
    /// Virtual seconds from submission to first token.
    ttft: Histogram,
    /// Virtual seconds between a request's consecutive output tokens.
    itl: Histogram,
    /// Output tokens delivered (first tokens included).
    generation_tokens: u64,
}

impl EngineLoop {
    async fn run(
        mut self,
        mut inbox: mpsc::UnboundedReceiver<Command>,
        mut fetches: mpsc::UnboundedReceiver<Fetched>,
        mut puts_done: mpsc::UnboundedReceiver<i64>,
    ) {
        loop {
            let now = self.now();
            self.advance(now);
            let wake = self.step_end.map(|end| self.clock.instant_of(end));
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
                command = inbox.recv() => {
                    let Some(command) = command else { return };
                    let now = self.now();
                    self.advance(now);
                    self.handle(now, command);
                }
                // Never closed: the loop holds a sender.
                Some(fetched) = fetches.recv() => {
                    let now = self.now();
                    self.advance(now);
                    let Fetched { asked, tiers, loaded } = fetched;
                    if let Some(plan) = &mut self.plan {
                        plan.fetched(&loaded);
                    }
                    self.answer(now, asked, &tiers);
                    self.route_events();
                    // Start a step at once if the engine was idle, waiting for this answer.
                    self.advance(now);
                }
                // Never closed while the put task runs; without HyperPod, never sent.
                Some(hash) = puts_done.recv() => {
                    self.put_done(hash);
                    while let Ok(hash) = puts_done.try_recv() {
                        self.put_done(hash);
                    }
                    if let Some(kv) = &mut self.kv {
                        kv.flush(self.last_us as f64 / 1e6);
                    }
                }
            }
        }
    }

    /// Current virtual time, never earlier than what the engine has seen.
    fn now(&mut self) -> u64 {
        self.last_us = self.last_us.max(self.clock.now_us());
        self.last_us
    }

    /// Completes every step that ended by `now`, starting each next one at the previous
    /// one's end, then starts a step at `now` if the engine is idle with work.
    fn advance(&mut self, now: u64) {
        loop {
            match self.step_end {
                Some(end) if end <= now => {
                    self.engine
                        .complete_step(end, &mut self.l2, &mut self.events);
                    self.route_events();
                    self.step_end = self.engine.start_step(end, &mut self.l2, &mut self.events);
                    self.route_events();
                    self.start_fetches();
                }
                Some(_) => return,
                None => {
                    self.step_end = self.engine.start_step(now, &mut self.l2, &mut self.events);
                    self.route_events();
                    self.start_fetches();
                    if self.step_end.is_none() {
                        return;
                    }
                }
            }
        }
    }

    /// Starts the agent fetches that admission asked for; each answers on `fetched`,
    /// an empty answer when the agent failed, so that no request waits on the agent
    /// longer than the fetch deadline.
    fn start_fetches(&mut self) {
        self.engine.take_lookups(&mut self.lookups);
        for Lookup { ticket, id, keys } in self.lookups.drain(..) {
            // The arrival's lookup still under way asked for these keys: wait for it.
            if let Some(early) = self.early.get_mut(&id) {
                if early.admission.is_none()
                    && keys.first() == Some(&early.first)
                    && keys.len() <= early.to - early.from
                {
                    early.admission = Some((ticket, keys.len()));
                    continue;
                }
            }
            let (agent, fetched) = (self.agent.clone(), self.fetched.clone());
            let hyperpod = match (&self.hyperpod, &self.plan) {
                (Some(h), Some(plan)) => Some((h.clone(), plan.lookup(id, &keys))),
                _ => None,
            };
            tokio::spawn(async move {
                let (tiers, loaded) = match (agent, hyperpod) {
                    (Some(agent), _) => (agent.fetch(&keys).await, Vec::new()),
                    (_, Some((h, Some((prompt, from))))) => {
                        h.fetch(&prompt, from, keys.len()).await
                    }
                    _ => (Vec::new(), Vec::new()),
                };
                let _ = fetched.send(Fetched {
                    asked: Asked::Admission(ticket),
                    tiers,
                    loaded,
                });
            });
        }
    }

    /// Asks the agent (block API) at once for the blocks of `req` that admission would
    /// ask for now: past the GPU's prefix, up to the last that can hit or the first the GPU
    /// holds after the gap. The answer reaches the engine before admission if it comes
    /// first (`Engine::offer`), so the round trip runs while the request queues instead of
    /// parking it past the step it is admitted in; if admission comes first, its lookup
    /// waits for this answer rather than asking again (`start_fetches`).
    fn ask_at_arrival(&mut self, req: &EngineRequest) {
        let Some(agent) = &self.agent else { return };
        if self.early.len() >= MAX_EARLY_LOOKUPS {
            return;
        }
        let std::ops::Range {
            start: from,
            end: to,
        } = self
            .engine
            .outside_range(&req.keys, req.prompt_tokens, &self.l2);
        if from >= to {
            return;
        }
        let keys = req.keys[from..to].to_vec();
        self.early.insert(
            req.id,
            Early {
                from,
                to,
                first: keys[0],
                admission: None,
            },
        );
        agent.counters.early_lookups.fetch_add(1, Ordering::Relaxed);
        let (agent, fetched, id) = (agent.clone(), self.fetched.clone(), req.id);
        tokio::spawn(async move {
            let tiers = agent.fetch(&keys).await;
            let _ = fetched.send(Fetched {
                asked: Asked::Arrival(id),
                tiers,
                loaded: Vec::new(),
            });
        });
    }

    /// Hands the agent's answer to the engine: to the admission that asked, or, for an
    /// arrival's, to the admission waiting for it or to the request still queued.
    fn answer(&mut self, now: u64, asked: Asked, tiers: &[Tier]) {
        match asked {
            Asked::Admission(ticket) => {
                self.engine
                    .answer_lookup(now, ticket, tiers, &mut self.events);
            }
            Asked::Arrival(id) => {
                let Some(early) = self.early.remove(&id) else {
                    return;
                };
                match early.admission {
                    Some((ticket, asked)) => {
                        let n = tiers.len().min(asked);
                        self.engine
                            .answer_lookup(now, ticket, &tiers[..n], &mut self.events);
                    }
                    None => {
                        if self.engine.offer(id, early.from, early.to, tiers) {
                            if let Some(agent) = &self.agent {
                                agent.counters.early_answers.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }
        }
    }

    /// A chunk's put ended: LMCache's staging copy is gone (its CPU `BlockRemoved`); the
    /// agent's object, if stored, keeps its blocks reported (record 0108).
    fn put_done(&mut self, hash: i64) {
        if let Some(plan) = &mut self.plan {
            plan.put_done(hash);
        }
        if let Some(kv) = &mut self.kv {
            kv.removed_chunk(hash);
        }
    }

    /// Block `key` became resident on the GPU: with HyperPod, the chunk it completes is
    /// stored (its CPU `BlockStored` published once the put is queued).
    fn chunk_stored(&mut self, key: BlockKey) {
        let (Some(plan), Some(hyperpod)) = (&mut self.plan, &self.hyperpod) else {
            return;
        };
        let Some((prompt, c)) = plan.stored(key) else {
            return;
        };
        let chunk = &prompt.chunks[c];
        let put = ChunkPut {
            hash: chunk.hash,
            blocks: chunk.blocks.len(),
        };
        if hyperpod.offload(put) {
            plan.storing(chunk.hash);
            if let Some(kv) = &mut self.kv {
                kv.stored_chunk(chunk.hash, chunk.parent, &chunk.tokens);
            }
        }
    }

    fn handle(&mut self, now: u64, command: Command) {
        match command {
            Command::Submit {
                req,
                updates,
                blocks,
            } => {
                let tokens = blocks.map(|(tokens, salt)| {
                    if let Some(kv) = &mut self.kv {
                        let limit = 4 * self.engine.config().gpu_blocks as usize;
                        let engine = &self.engine;
                        kv.note_request(&req.keys, &tokens, salt.as_deref(), limit, |k| {
                            engine.holds(k)
                        });
                    }
                    tokens
                });
                if !self
                    .engine
                    .can_ever_fit(req.prompt_tokens, req.output_tokens)
                {
                    let _ = updates.send(Update::Rejected(self.too_large(&req)));
                    return;
                }
                if updates.send(Update::Accepted).is_err() {
                    return; // The client is already gone.
                }
                if let (Some(plan), Some(h), Some(tokens)) =
                    (&mut self.plan, &self.hyperpod, tokens)
                {
                    let s = h.settings();
                    let prompt = Prompt::new(
                        req.keys.clone(),
                        &tokens,
                        s.block_tokens as usize,
                        s.chunk_blocks(),
                    );
                    plan.submitted(req.id, Arc::new(prompt));
                }
                self.routes.insert(
                    req.id,
                    Route {
                        updates,
                        arrived_us: now,
                        last_token_us: now,
                    },
                );
                self.ask_at_arrival(&req);
                self.engine.submit(now, req);
                // Start a step at once if the engine was idle.
                self.advance(now);
            }
            Command::Cancel { id } => self.cancel(now, id),
            Command::Metrics { reply } => {
                let _ = reply.send(Snapshot {
                    gpu_blocks: self.engine.config().gpu_blocks,
                    block_tokens: self.engine.config().block_tokens,
                    running: self.engine.num_running(),
                    waiting: self.engine.num_waiting(),
                    kv_usage: self.engine.kv_usage(),
                    stats: self.engine.stats().clone(),
                    generation_tokens: self.generation_tokens,
                    ttft: self.ttft.clone(),
                    itl: self.itl.clone(),
                });
            }
        }
    }

    fn cancel(&mut self, now: u64, id: u64) {
        self.early.remove(&id);
        if let Some(plan) = &mut self.plan {
            plan.finished(id);
        }
        if self.routes.remove(&id).is_some() && self.engine.cancel(now, id) {
            tracing::debug!(request_id = id, "request cancelled");
        }
    }

    /// Why the engine can never run `req`.
    fn too_large(&self, req: &EngineRequest) -> String {
        let c = self.engine.config();
        let longest = u64::from(req.prompt_tokens.max(1)) + u64::from(req.output_tokens.max(1)) - 1;
        let need = longest.div_ceil(u64::from(c.block_tokens)) + 1;
        format!(
            "the prompt ({} tokens) plus max_tokens ({}) needs {need} KV-cache blocks of {} tokens \
             (one for headroom), more than this engine's {}: shorten the prompt or lower max_tokens",
            req.prompt_tokens, req.output_tokens, c.block_tokens, c.gpu_blocks
        )
    }

    /// Sends the buffered events' tokens to their requests; cancels those whose client is
    /// gone.
    fn route_events(&mut self) {
        let mut events = std::mem::take(&mut self.events);
        let mut gone = Vec::new();
        let mut evicted = Vec::new();
        for event in events.drain(..) {
            let (id, update) = match event {
                EngineEvent::FirstToken {
                    id,
                    at_us,
                    gpu_hit_tokens,
                    l1_hit_tokens,
                    l2_hit_tokens,
                } => {
                    if let Some(route) = self.routes.get_mut(&id) {
                        let ttft_s = at_us.saturating_sub(route.arrived_us) as f64 / 1e6;
                        self.ttft.observe(ttft_s);
                        route.last_token_us = at_us;
                    }
                    let hits = Hits([gpu_hit_tokens, l1_hit_tokens, l2_hit_tokens]);
                    (id, Update::First { hits })
                }
                EngineEvent::Token { id, at_us } => {
                    if let Some(route) = self.routes.get_mut(&id) {
                        let itl_s = at_us.saturating_sub(route.last_token_us) as f64 / 1e6;
                        self.itl.observe(itl_s);
                        route.last_token_us = at_us;
                    }
                    (id, Update::Token)
                }
                EngineEvent::Finished { id, .. } => {
                    self.routes.remove(&id);
                    if let Some(plan) = &mut self.plan {
                        plan.finished(id);
                    }
                    continue;
                }
                EngineEvent::Rejected { id, .. } => {
                    // Not expected: submissions are checked with `can_ever_fit` first.
                    if let Some(plan) = &mut self.plan {
                        plan.finished(id);
                    }
                    if let Some(route) = self.routes.remove(&id) {
                        let msg = "the engine rejected the request: it can never fit".into();
                        let _ = route.updates.send(Update::Rejected(msg));
                    }
                    continue;
                }
                EngineEvent::Removed {
                    key,
                    tier: Tier::Gpu,
                } => {
                    if let Some(kv) = &mut self.kv {
                        kv.removed(key);
                    }
                    evicted.push(key);
                    continue;
                }
                EngineEvent::Stored {
                    key,
                    tier: Tier::Gpu,
                } => {
                    if let Some(kv) = &mut self.kv {
                        kv.stored(key);
                    }
                    self.chunk_stored(key);
                    continue;
                }
                // Block residency is not published by the live server (yet).
                EngineEvent::Stored { .. } | EngineEvent::Removed { .. } => continue,
            };
            self.generation_tokens += 1;
            if let Some(route) = self.routes.get(&id) {
                if route.updates.send(update).is_err() {
                    gone.push(id);
                }
            }
        }
        self.events = events;
        if let Some(kv) = &mut self.kv {
            kv.flush(self.last_us as f64 / 1e6);
        }
        if let (Some(agent), false) = (&self.agent, evicted.is_empty()) {
            agent.offload(evicted);
        }
        let now = self.last_us;
        for id in gone {
            self.cancel(now, id);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Metrics

/// A Prometheus histogram over fixed bounds ([`TTFT_BUCKETS`], [`ITL_BUCKETS`]).
#[derive(Clone, Debug)]
struct Histogram {
    /// Upper bounds of the buckets.
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); beyond the last bound only in `count`.
    buckets: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: vec![0; bounds.len()],
            count: 0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, value: f64) {
        self.count += 1;
        self.sum += value;
        if let Some(i) = self.bounds.iter().position(|&le| value <= le) {
            self.buckets[i] += 1;
        }
    }

    /// Its Prometheus text: cumulative `_bucket` lines, `_sum` and `_count`.
    fn render(&self, out: &mut String, name: &str, help: &str, label: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (le, n) in self.bounds.iter().zip(&self.buckets) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{{label},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{label}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{label}}} {}", self.count);
    }
}

/// What `/metrics` shows, copied out of the engine loop.
#[derive(Debug)]
struct Snapshot {
    /// GPU KV cache: blocks and tokens per block (vLLM's `cache_config_info` labels).
    gpu_blocks: u32,
    block_tokens: u32,
    running: usize,
    waiting: usize,
    kv_usage: f64,
    stats: EngineStats,
    generation_tokens: u64,
    ttft: Histogram,
    itl: Histogram,
}

/// Prometheus text exposition of `s` with vLLM's metric names.
/// The agent link's counters, for `/metrics`: the block API's, or the HyperPod API's with
/// its objects.
#[derive(Clone, Copy)]
enum AgentView<'a> {
    Blocks(&'a AgentCounters),
    HyperPod(&'a HyperPodSide),
}

impl<'a> AgentView<'a> {
    fn of(shared: &'a Shared) -> Option<Self> {
        match (&shared.agent, &shared.hyperpod) {
            (Some(a), _) => Some(AgentView::Blocks(&a.counters)),
            (_, Some(h)) => Some(AgentView::HyperPod(h)),
            _ => None,
        }
    }

    fn counters(self) -> &'a AgentCounters {
        match self {
            AgentView::Blocks(c) => c,
            AgentView::HyperPod(h) => &h.counters,
        }
    }
}

fn render_metrics(model: &str, s: &Snapshot, agent: Option<AgentView<'_>>) -> String {
    let label = format!("model_name=\"{}\"", escape_label(model));
    let mut out = String::with_capacity(4096);
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, String)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (extra, value) in samples {
            let _ = writeln!(out, "{name}{{{label}{extra}}} {value}");
        }
    };
    let stats = &s.stats;
    metric(
        crate::metric_names::ENGINE_PREFIX_HIT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens not computed, by where they were found: the GPU prefix cache, or loaded from L1 or L2.",
        &[
            (",tier=\"gpu\"", stats.gpu_hit_tokens.to_string()),
            (",tier=\"l1\"", stats.l1_hit_tokens.to_string()),
            (",tier=\"l2\"", stats.l2_hit_tokens.to_string()),
        ],
    );
    metric(
        crate::metric_names::ENGINE_PREFILL_GPU_SECONDS_TOTAL,
        "counter",
        "GPU seconds of prefill, model time: the profile's prefill time of the tokens computed (what cache hits save).",
        &[("", (stats.prefill_us as f64 / 1e6).to_string())],
    );
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed).to_string();
    if let Some(AgentView::HyperPod(h)) = agent {
        let o = &h.objects;
        metric(
            crate::metric_names::ENGINE_AGENT_OBJECTS_TOTAL,
            "counter",
            "Chunks exchanged with the host's cache-agent over its HyperPod API: stored (200), existed (409, stored already), loaded (leased, read from the segment, checked), missed (404).",
            &[
                (",op=\"stored\"", get(&o.stored)),
                (",op=\"existed\"", get(&o.existed)),
                (",op=\"loaded\"", get(&o.loaded)),
                (",op=\"missed\"", get(&o.missed)),
            ],
        );
    }
    if let Some(agent) = agent {
        let c = agent.counters();
        metric(
            crate::metric_names::ENGINE_AGENT_BLOCKS_TOTAL,
            "counter",
            "Blocks exchanged with the host's cache-agent: offloaded, fetched, bad (other bytes, recomputed), dropped (offload queue full or agent down).",
            &[
                (",op=\"offloaded\"", get(&c.offloaded_blocks)),
                (",op=\"fetched\"", get(&c.fetched_blocks)),
                (",op=\"bad\"", get(&c.bad_blocks)),
                (",op=\"dropped\"", get(&c.dropped_offloads)),
            ],
        );
        metric(
            crate::metric_names::ENGINE_AGENT_ERRORS_TOTAL,
            "counter",
            "Failed calls to the host's cache-agent (the engine recomputed instead).",
            &[("", get(&c.errors))],
        );
        metric(
            crate::metric_names::ENGINE_AGENT_ARRIVAL_LOOKUPS_TOTAL,
            "counter",
            "Lookups asked of the host's cache-agent when a request arrived: asked, and answered in time (before admission, which then asked nothing).",
            &[
                (",outcome=\"asked\"", get(&c.early_lookups)),
                (",outcome=\"in_time\"", get(&c.early_answers)),
            ],
        );
    }
    metric(
        "vllm:cache_config_info",
        "gauge",
        "Information of the KV cache config (labels).",
        &[(
            &format!(
                ",block_size=\"{}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"True\"",
                s.block_tokens, s.gpu_blocks
            ),
            "1".to_string(),
        )],
    );
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &[("", s.running.to_string())],
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &[("", s.waiting.to_string())],
    );
    metric(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        &[("", s.kv_usage.to_string())],
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &[("", stats.prompt_tokens.to_string())],
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens (GPU prefix cache).",
        &[("", stats.gpu_hit_tokens.to_string())],
    );
    metric(
        "vllm:external_prefix_cache_queries_total",
        "counter",
        "External prefix cache queries (L1 and L2 tiers), in terms of number of queried tokens.",
        &[(
            "",
            stats
                .prompt_tokens
                .saturating_sub(stats.gpu_hit_tokens)
                .to_string(),
        )],
    );
    metric(
        "vllm:external_prefix_cache_hits_total",
        "counter",
        "External prefix cache hits (L1 and L2 tiers), in terms of number of loaded tokens.",
        &[("", (stats.l1_hit_tokens + stats.l2_hit_tokens).to_string())],
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &[("", stats.prompt_tokens.to_string())],
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &[("", s.generation_tokens.to_string())],
    );
    metric(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemptions from the engine.",
        &[("", stats.preemptions.to_string())],
    );
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of finished requests, by finish reason (abort: the client went away).",
        &[
            (",finished_reason=\"length\"", stats.finished.to_string()),
            (",finished_reason=\"abort\"", stats.cancelled.to_string()),
        ],
    );
    s.ttft.render(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds of model time (wall time times the \
         speed-up).",
        &label,
    );
    s.itl.render(
        &mut out,
        "vllm:inter_token_latency_seconds",
        "Histogram of the time between a request's consecutive output tokens in seconds of \
         model time (wall time times the speed-up).",
        &label,
    );
    out
}

/// A Prometheus label value with `\`, `"` and newlines escaped.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

// ---------------------------------------------------------------------------------------
// Handlers

/// Which endpoint a generation came from: decides the response shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Fields vLLM reads that warmpath's request types leave out.
#[derive(Debug, Default, Deserialize)]
struct Extras {
    /// Isolates a tenant's prefix cache: blocks are only shared under equal salts.
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// A parsed, validated-enough generation request.
#[derive(Debug)]
struct Generation {
    kind: Kind,
    /// The prompt's tokens: the text tokenized, or the client's own token ids.
    tokens: Vec<u32>,
    max_tokens: Option<u32>,
    stream: bool,
    extras: Extras,
}

async fn completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let (req, extras) = match parse::<CompletionRequest>(&body) {
        Ok(parsed) => parsed,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    if let Some(resp) = check_model(&shared, &req.model) {
        return resp;
    }
    let tokens = match req.prompt_input() {
        Ok(PromptInput::Text(t)) => shared.tokenizer.0.completion(&t),
        Ok(PromptInput::Tokens(ids)) => ids,
        Err(e) => return request_error(&e),
    };
    let generation = Generation {
        kind: Kind::Completion,
        tokens,
        max_tokens: req.max_tokens,
        stream: req.stream,
        extras,
    };
    generate(shared, generation).await
}

async fn chat_completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let (req, extras) = match parse::<ChatRequest>(&body) {
        Ok(parsed) => parsed,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    if let Some(resp) = check_model(&shared, &req.model) {
        return resp;
    }
    if let Err(e) = req.check() {
        return request_error(&e);
    }
    let tokens = match shared.tokenizer.0.chat(&req.messages) {
        Ok(tokens) => tokens,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("chat template: {e}")),
    };
    let generation = Generation {
        kind: Kind::Chat,
        tokens,
        max_tokens: req.max_tokens(),
        stream: req.stream,
        extras,
    };
    generate(shared, generation).await
}

/// The body as `T` plus the extra fields, or what is wrong with it.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<(T, Extras), String> {
    let invalid = |e: serde_json::Error| {
        if e.is_syntax() || e.is_eof() {
            format!("the request body is not valid JSON: {e}")
        } else {
            format!("invalid request: {e}")
        }
    };
    let req = serde_json::from_slice::<T>(body).map_err(invalid)?;
    let extras = serde_json::from_slice::<Extras>(body).map_err(invalid)?;
    Ok((req, extras))
}

/// A 404 when the request names a model this server does not serve (an empty name is the
/// request types' own 400).
fn check_model(shared: &Shared, model: &str) -> Option<Response> {
    if model.is_empty() || model == shared.model {
        return None;
    }
    let mut body = ErrorBody::new(
        "invalid_request_error",
        format!(
            "the model `{model}` does not exist: this server serves `{}`",
            shared.model
        ),
    );
    body.error.code = Some("model_not_found".into());
    Some((StatusCode::NOT_FOUND, Json(body)).into_response())
}

fn request_error(e: &RequestError) -> Response {
    error(StatusCode::BAD_REQUEST, e.to_string())
}

/// OpenAI's error body with `status`; the one place statuses are chosen for errors.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    (status, Json(ErrorBody::new(kind, message))).into_response()
}

fn engine_stopped() -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
}

async fn generate(shared: Arc<Shared>, mut g: Generation) -> Response {
    let tokens = std::mem::take(&mut g.tokens);
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    if prompt_tokens > shared.max_prompt_tokens {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "the prompt has {prompt_tokens} tokens, more than this server's limit of {}",
                shared.max_prompt_tokens
            ),
        );
    }
    let output_tokens = g.max_tokens.unwrap_or(shared.default_max_tokens);
    if output_tokens == 0 {
        return error(StatusCode::BAD_REQUEST, "`max_tokens` must be at least 1");
    }
    let salt = g.extras.cache_salt.as_deref().unwrap_or("");
    let keys = token_block_keys(
        &TenantKey::derive(ENGINE_TENANT, salt),
        &tokens,
        shared.block_tokens,
    );
    let tokens_for_events = if shared.wants_tokens {
        tokens.clone()
    } else {
        Vec::new()
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let (updates, mut rx) = mpsc::unbounded_channel();
    // From here on, dropping this future (the client went away) cancels the request.
    let mut guard = CancelGuard {
        id,
        commands: shared.commands.clone(),
        armed: true,
    };
    let req = EngineRequest {
        id,
        keys,
        prompt_tokens,
        output_tokens,
        // The agent is asked at admission (`Engine::set_outside_lookups`), not here.
        offered: Vec::new(),
        offered_from: 0,
    };
    let blocks = shared
        .wants_tokens
        .then(|| (tokens_for_events, g.extras.cache_salt.clone()));
    if shared
        .commands
        .send(Command::Submit {
            req,
            updates,
            blocks,
        })
        .is_err()
    {
        guard.armed = false;
        return engine_stopped();
    }
    match rx.recv().await {
        Some(Update::Accepted) => {}
        Some(Update::Rejected(msg)) => {
            guard.armed = false;
            return error(StatusCode::BAD_REQUEST, msg);
        }
        _ => {
            guard.armed = false;
            return engine_stopped();
        }
    }
    let prefix = match g.kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let reply = Reply {
        kind: g.kind,
        id: format!("{prefix}-sim-{id}"),
        created: unix_now(),
        model: shared.model.clone(),
        prompt_tokens,
        output_tokens,
        seed: prompt_seed(&tokens),
    };
    if g.stream {
        let include_usage = g
            .extras
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        stream_response(reply, rx, guard, include_usage)
    } else {
        full_response(reply, rx, guard).await
    }
}

/// Collects every token, then answers with the whole text.
async fn full_response(
    reply: Reply,
    mut rx: mpsc::UnboundedReceiver<Update>,
    mut guard: CancelGuard,
) -> Response {
    let mut text = String::new();
    let mut cached = Hits::default();
    for pos in 0..reply.output_tokens {
        match rx.recv().await {
            Some(Update::First { hits }) => cached = hits,
            Some(Update::Token) => {}
            _ => return engine_stopped(),
        }
        text.push_str(&reply.word(pos));
    }
    guard.armed = false;
    Json(reply.full(&text, cached)).into_response()
}

/// Where a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Tokens,
    Usage,
    Done,
    End,
}

/// State of one SSE stream; dropping it (client gone) drops the guard.
#[derive(Debug)]
struct StreamState {
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Update>,
    guard: CancelGuard,
    include_usage: bool,
    /// Tokens sent so far.
    sent: u32,
    cached: Hits,
    phase: Phase,
}

fn stream_response(
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Update>,
    guard: CancelGuard,
    include_usage: bool,
) -> Response {
    let state = StreamState {
        reply,
        rx,
        guard,
        include_usage,
        sent: 0,
        cached: Hits::default(),
        phase: Phase::Tokens,
    };
    let body = Body::from_stream(futures_util::stream::unfold(state, next_event));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| engine_stopped())
}

/// The next SSE event of a stream.
async fn next_event(mut st: StreamState) -> Option<(Result<Bytes, Infallible>, StreamState)> {
    let event = match st.phase {
        Phase::Tokens => {
            match st.rx.recv().await {
                Some(Update::First { hits }) => st.cached = hits,
                Some(Update::Token) => {}
                // The engine stopped: end the stream without [DONE], so the client sees
                // it was cut short.
                _ => return None,
            }
            let pos = st.sent;
            st.sent += 1;
            let last = st.sent >= st.reply.output_tokens;
            if last {
                st.guard.armed = false;
                st.phase = if st.include_usage {
                    Phase::Usage
                } else {
                    Phase::Done
                };
            }
            sse(&st.reply.chunk(pos, last))
        }
        Phase::Usage => {
            st.phase = Phase::Done;
            sse(&st.reply.usage_chunk(st.cached))
        }
        Phase::Done => {
            st.phase = Phase::End;
            Bytes::from_static(b"data: [DONE]\n\n")
        }
        Phase::End => return None,
    };
    Some((Ok(event), st))
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// What every response body of one request shares.
#[derive(Debug)]
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    output_tokens: u32,
    /// Seeds the output words: a function of the prompt's tokens.
    seed: u64,
}

impl Reply {
    /// Output token `pos`: one pseudo-word with a leading space (one token).
    fn word(&self, pos: u32) -> String {
        let seed = self.seed ^ (u64::from(pos) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        text::words(seed, 1)
    }

    /// OpenAI's usage, plus where the cached tokens came from
    /// (`prompt_tokens_details.kv_tier_tokens`: gpu, l1, l2), which clients ignore.
    fn usage(&self, cached: Hits) -> Value {
        let usage = Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.output_tokens,
            total_tokens: self.prompt_tokens.saturating_add(self.output_tokens),
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: Some(cached.total()),
            }),
        };
        let mut v = serde_json::to_value(usage).unwrap_or(Value::Null);
        let [gpu, l1, l2] = cached.0;
        v["prompt_tokens_details"]["kv_tier_tokens"] = json!({"gpu": gpu, "l1": l1, "l2": l2});
        v
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// The non-streaming response.
    fn full(&self, text: &str, cached: Hits) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": "length",
            }),
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": "length",
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(cached),
        })
    }

    /// The streamed chunk of token `pos`; the last carries the finish reason. A chat
    /// stream's first delta also carries the role.
    fn chunk(&self, pos: u32, last: bool) -> Value {
        let word = self.word(pos);
        let finish = if last { json!("length") } else { Value::Null };
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": word, "logprobs": null, "finish_reason": finish,
            }),
            Kind::Chat => {
                let delta = if pos == 0 {
                    json!({"role": "assistant", "content": word})
                } else {
                    json!({"content": word})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The last chunk of a stream that asked for usage.
    fn usage_chunk(&self, cached: Hits) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(cached),
        })
    }
}

/// FNV-1a 64 over the token ids: the output-text seed of a prompt.
fn prompt_seed(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": shared.model,
            "object": "model",
            "created": shared.created,
            "owned_by": "warmpath",
        }],
    }))
    .into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let (reply, answer) = oneshot::channel();
    if shared.commands.send(Command::Metrics { reply }).is_err() {
        return engine_stopped();
    }
    let Ok(snapshot) = answer.await else {
        return engine_stopped();
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render_metrics(&shared.model, &snapshot, AgentView::of(&shared)),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use http_body_util::{BodyExt, Full};
    use hyper::body::Incoming;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};
    use warmpath_index::text::{render_chat, ChatMessage};

    use super::*;

    /// Fast and small: 1000× speed-up, 8 tokens by default, prompts up to 2000 tokens,
    /// 4096 GPU blocks of 16 tokens.
    fn config() -> EngineSimConfig {
        EngineSimConfig {
            speedup: 1000.0,
            default_max_tokens: 8,
            max_prompt_tokens: 2000,
            engine: EngineConfig {
                gpu_blocks: 4096,
                ..EngineConfig::default()
            },
            ..EngineSimConfig::default()
        }
    }

    /// A server on 127.0.0.1:0 and a client for it.
    struct TestServer {
        addr: SocketAddr,
        client: Client<HttpConnector, Full<Bytes>>,
        stop: Option<oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<std::io::Result<()>>,
    }

    impl TestServer {
        async fn start(config: EngineSimConfig) -> TestServer {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (stop, stopped) = oneshot::channel::<()>();
            let shutdown = async move {
                let _ = stopped.await;
            };
            let task = tokio::spawn(serve(listener, config, shutdown));
            let client = Client::builder(TokioExecutor::new()).build_http();
            TestServer {
                addr,
                client,
                stop: Some(stop),
                task,
            }
        }

        async fn send(&self, method: &str, path: &str, body: &str) -> hyper::Response<Incoming> {
            let req = hyper::Request::builder()
                .method(method)
                .uri(format!("http://{}{path}", self.addr))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap();
            self.client.request(req).await.unwrap()
        }

        async fn text(&self, method: &str, path: &str, body: &str) -> (StatusCode, String) {
            let resp = self.send(method, path, body).await;
            let status = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(bytes.to_vec()).unwrap())
        }

        async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
            let (status, text) = self.text("POST", path, &body.to_string()).await;
            let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            (status, value)
        }

        /// Posts a streaming request and returns its SSE events.
        async fn stream(&self, path: &str, body: &Value) -> Events {
            let resp = self.send("POST", path, &body.to_string()).await;
            assert_eq!(resp.status(), StatusCode::OK);
            let content_type = resp.headers()[header::CONTENT_TYPE].to_str().unwrap();
            assert_eq!(content_type, "text/event-stream");
            Events {
                body: resp.into_body(),
                buf: String::new(),
            }
        }

        /// The value of one sample of `/metrics`, by its name and extra labels.
        async fn metric(&self, name: &str, extra_labels: &str) -> f64 {
            let (status, text) = self.text("GET", "/metrics", "").await;
            assert_eq!(status, StatusCode::OK);
            let prefix = format!("{name}{{model_name=\"sim-llama\"{extra_labels}}} ");
            let line = text
                .lines()
                .find(|l| l.starts_with(&prefix))
                .unwrap_or_else(|| panic!("no {prefix:?} in\n{text}"));
            line[prefix.len()..].parse().unwrap()
        }

        /// (running, waiting, aborted) from `/metrics`.
        async fn load(&self) -> (f64, f64, f64) {
            (
                self.metric("vllm:num_requests_running", "").await,
                self.metric("vllm:num_requests_waiting", "").await,
                self.metric("vllm:request_success_total", ",finished_reason=\"abort\"")
                    .await,
            )
        }

        /// Polls `/metrics` until `(running, waiting, aborted)` is `want` (up to 10 s).
        async fn wait_for_load(&self, want: (f64, f64, f64)) {
            for _ in 0..2000 {
                if self.load().await == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            panic!("load never became {want:?}: {:?}", self.load().await);
        }
    }

    /// The SSE events of a streaming response, read as they come.
    struct Events {
        body: Incoming,
        buf: String,
    }

    impl Events {
        /// The next event's data, or None at the end of the body.
        async fn next(&mut self) -> Option<String> {
            loop {
                if let Some(end) = self.buf.find("\n\n") {
                    let event: String = self.buf.drain(..end + 2).collect();
                    let data = event.trim_end().strip_prefix("data: ");
                    return Some(data.unwrap_or_else(|| panic!("{event:?}")).to_string());
                }
                let frame = self.body.frame().await?.unwrap();
                if let Ok(data) = frame.into_data() {
                    self.buf.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
        }

        async fn all(mut self) -> Vec<String> {
            let mut out = Vec::new();
            while let Some(event) = self.next().await {
                out.push(event);
            }
            assert!(self.buf.is_empty(), "trailing bytes {:?}", self.buf);
            out
        }
    }

    fn completion(prompt: &str, max_tokens: u32) -> Value {
        json!({"model": "sim-llama", "prompt": prompt, "max_tokens": max_tokens})
    }

    fn cached_tokens(response: &Value) -> u64 {
        response["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    }

    #[tokio::test]
    async fn completion_returns_max_tokens_and_usage() {
        let s = TestServer::start(config()).await;
        let prompt = text::words(1, 40);
        let (status, v) = s.post("/v1/completions", &completion(&prompt, 7)).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["model"], "sim-llama");
        assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        let out = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(text::count_tokens(out), 7, "{out:?}");
        let usage = json!({
            "prompt_tokens": 40,
            "completion_tokens": 7,
            "total_tokens": 47,
            "prompt_tokens_details": {
                "cached_tokens": 0,
                "kv_tier_tokens": {"gpu": 0, "l1": 0, "l2": 0},
            },
        });
        assert_eq!(v["usage"], usage);
        // Without max_tokens: the default.
        let body = json!({"model": "sim-llama", "prompt": text::words(2, 5)});
        let (status, v) = s.post("/v1/completions", &body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["usage"]["completion_tokens"], 8);
        let out = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(text::count_tokens(out), 8);
    }

    #[tokio::test]
    async fn repeated_prompts_report_cached_tokens_per_salt() {
        let s = TestServer::start(config()).await;
        // 100 tokens: 6 complete blocks of 16, all of which can hit (the last token, in
        // the partial 7th block, is always computed).
        let prompt = text::words(3, 100);
        // (cache_salt, cached tokens reported)
        let cases = [
            (None, 0),
            (None, 96),
            (Some("a"), 0),
            (Some("a"), 96),
            (Some("b"), 0),
            (Some(""), 96),
        ];
        for (i, (salt, want)) in cases.into_iter().enumerate() {
            let mut body = completion(&prompt, 2);
            if let Some(salt) = salt {
                body["cache_salt"] = json!(salt);
            }
            let (status, v) = s.post("/v1/completions", &body).await;
            assert_eq!(status, StatusCode::OK, "case {i}: {v}");
            assert_eq!(cached_tokens(&v), want, "case {i}");
        }
    }

    #[tokio::test]
    async fn streams_concatenate_to_the_full_text() {
        let s = TestServer::start(config()).await;
        let messages = json!([{"role": "user", "content": text::words(4, 30)}]);
        let cases = [
            (
                "/v1/completions",
                json!({"model": "sim-llama", "prompt": text::words(4, 30), "max_tokens": 5}),
            ),
            (
                "/v1/chat/completions",
                json!({"model": "sim-llama", "messages": messages, "max_tokens": 5}),
            ),
        ];
        for (path, body) in cases {
            let chat = path.contains("chat");
            let (status, full) = s.post(path, &body).await;
            assert_eq!(status, StatusCode::OK, "{full}");
            let want = if chat {
                full["choices"][0]["message"]["content"].clone()
            } else {
                full["choices"][0]["text"].clone()
            };
            for include_usage in [false, true] {
                let mut streaming = body.clone();
                streaming["stream"] = json!(true);
                if include_usage {
                    streaming["stream_options"] = json!({"include_usage": true});
                }
                let events = s.stream(path, &streaming).await.all().await;
                let n = 5 + usize::from(include_usage);
                assert_eq!(events.len(), n + 1, "{path}: {events:?}");
                assert_eq!(events[n], "[DONE]");
                let chunks: Vec<Value> = events[..n]
                    .iter()
                    .map(|e| serde_json::from_str(e).unwrap())
                    .collect();
                let mut text = String::new();
                for (i, chunk) in chunks[..5].iter().enumerate() {
                    let object = if chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    assert_eq!(chunk["object"], object, "{chunk}");
                    assert_eq!(chunk["model"], "sim-llama");
                    assert_eq!(chunk["id"], chunks[0]["id"]);
                    assert!(chunk.get("usage").is_none(), "{chunk}");
                    let choice = &chunk["choices"][0];
                    assert_eq!(choice["index"], 0);
                    let finish = if i == 4 { json!("length") } else { Value::Null };
                    assert_eq!(choice["finish_reason"], finish, "{chunk}");
                    if chat {
                        let role = if i == 0 {
                            json!("assistant")
                        } else {
                            Value::Null
                        };
                        assert_eq!(choice["delta"]["role"], role, "{chunk}");
                        text.push_str(choice["delta"]["content"].as_str().unwrap());
                    } else {
                        text.push_str(choice["text"].as_str().unwrap());
                    }
                }
                assert_eq!(json!(text), want, "{path}");
                if include_usage {
                    let last = &chunks[5];
                    assert_eq!(last["choices"], json!([]));
                    let usage = &last["usage"];
                    assert_eq!(usage["prompt_tokens"], full["usage"]["prompt_tokens"]);
                    assert_eq!(usage["completion_tokens"], 5);
                    // The non-streaming request cached the prompt's complete blocks.
                    assert!(cached_tokens(last) > 0, "{last}");
                }
            }
        }
    }

    #[tokio::test]
    async fn chat_completion() {
        let s = TestServer::start(config()).await;
        let messages = vec![
            ChatMessage::text("system", "be brief"),
            ChatMessage::text("user", text::words(5, 20)),
        ];
        let body = json!({
            "model": "sim-llama",
            "messages": messages,
            "max_tokens": 3,
            "max_completion_tokens": 6,
        });
        let (status, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(v["object"], "chat.completion");
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        let choice = &v["choices"][0];
        assert_eq!(choice["message"]["role"], "assistant");
        assert_eq!(choice["finish_reason"], "length");
        let out = choice["message"]["content"].as_str().unwrap();
        assert_eq!(text::count_tokens(out), 6);
        let prompt_tokens = text::count_tokens(&render_chat(&messages));
        assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
        assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 6);
    }

    #[tokio::test]
    async fn token_id_prompts_and_structured_messages_are_served() {
        let s = TestServer::start(config()).await;
        let ids: Vec<u32> = (1..=40).collect();
        for prompt in [json!(ids), json!([ids])] {
            let body = json!({"model": "sim-llama", "prompt": prompt, "max_tokens": 2});
            let (status, v) = s.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["usage"]["prompt_tokens"], 40);
        }
        let body = json!({"model": "sim-llama", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is here?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "look", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
        ]});
        let (status, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{v}");
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 10);
    }

    #[tokio::test]
    async fn bad_requests_get_openai_error_bodies() {
        let s = TestServer::start(config()).await;
        let long = text::words(6, 2001);
        // (path, body, status, part of the message)
        let cases = [
            ("/v1/completions", "{".to_string(), 400, "not valid JSON"),
            ("/v1/completions", "[]".to_string(), 400, "invalid request"),
            (
                "/v1/completions",
                r#"{"model": "sim-llama"}"#.to_string(),
                400,
                "missing field `prompt`",
            ),
            (
                "/v1/completions",
                completion("", 4).to_string(),
                400,
                "the prompt is empty",
            ),
            (
                "/v1/completions",
                json!({"model": "sim-llama", "prompt": ["a", "b"]}).to_string(),
                400,
                "batch of 2 prompts",
            ),
            (
                "/v1/completions",
                completion(&long, 4).to_string(),
                400,
                "2001 tokens, more than this server's limit of 2000",
            ),
            (
                "/v1/completions",
                completion("hi", 0).to_string(),
                400,
                "`max_tokens` must be at least 1",
            ),
            (
                // 4096 blocks of 16 tokens cannot hold 70000 tokens.
                "/v1/completions",
                completion("hi", 70_000).to_string(),
                400,
                "more than this engine's 4096",
            ),
            (
                "/v1/completions",
                json!({"model": "sim-llama", "prompt": "hi", "cache_salt": 5}).to_string(),
                400,
                "invalid request",
            ),
            (
                "/v1/completions",
                json!({"model": "", "prompt": "hi"}).to_string(),
                400,
                "`model` is empty",
            ),
            (
                "/v1/completions",
                json!({"model": "gpt-9", "prompt": "hi"}).to_string(),
                404,
                "the model `gpt-9` does not exist",
            ),
            (
                "/v1/chat/completions",
                json!({"model": "sim-llama", "messages": []}).to_string(),
                400,
                "`messages` is empty",
            ),
            (
                "/v1/chat/completions",
                json!({"model": "sim-llama"}).to_string(),
                400,
                "missing field `messages`",
            ),
            (
                "/v1/chat/completions",
                json!({"model": "other", "messages": [{"role": "user", "content": "x"}]})
                    .to_string(),
                404,
                "does not exist",
            ),
        ];
        for (i, (path, body, status, message)) in cases.into_iter().enumerate() {
            let (got, text) = s.text("POST", path, &body).await;
            assert_eq!(got.as_u16(), status, "case {i}: {text}");
            let error: ErrorBody =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("case {i}: {e}: {text}"));
            assert_eq!(error.error.kind, "invalid_request_error", "case {i}");
            assert!(
                error.error.message.contains(message),
                "case {i}: {:?}",
                error.error.message
            );
        }
        // Nothing reached the engine's counters, and nothing is left in it.
        assert_eq!(s.metric("vllm:prefix_cache_queries_total", "").await, 0.0);
        assert_eq!(s.load().await, (0.0, 0.0, 0.0));
    }

    #[tokio::test]
    async fn models_and_health() {
        let s = TestServer::start(config()).await;
        let (status, body) = s.text("GET", "/health", "").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, ""));
        let (status, body) = s.text("GET", "/v1/models", "").await;
        assert_eq!(status, StatusCode::OK);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"].as_array().unwrap().len(), 1);
        assert_eq!(v["data"][0]["id"], "sim-llama");
        assert_eq!(v["data"][0]["object"], "model");
        assert_eq!(v["data"][0]["owned_by"], "warmpath");
    }

    #[tokio::test]
    async fn metrics_use_vllm_names_and_count_tokens() {
        let s = TestServer::start(config()).await;
        let (status, text) = s.text("GET", "/metrics", "").await;
        assert_eq!(status, StatusCode::OK);
        for (name, kind) in [
            ("vllm:num_requests_running", "gauge"),
            ("vllm:num_requests_waiting", "gauge"),
            ("vllm:gpu_cache_usage_perc", "gauge"),
            ("vllm:prefix_cache_queries_total", "counter"),
            ("vllm:prefix_cache_hits_total", "counter"),
            ("vllm:time_to_first_token_seconds", "histogram"),
            ("vllm:inter_token_latency_seconds", "histogram"),
        ] {
            assert!(text.contains(&format!("# HELP {name} ")), "{name}");
            assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{name}");
        }
        let prompt = text::words(7, 100);
        // (queries, hits, first tokens so far) after each request of the same prompt.
        for (i, want) in [(100.0, 0.0, 1.0), (200.0, 96.0, 2.0)]
            .into_iter()
            .enumerate()
        {
            let (status, _) = s.post("/v1/completions", &completion(&prompt, 3)).await;
            assert_eq!(status, StatusCode::OK);
            let got = (
                s.metric("vllm:prefix_cache_queries_total", "").await,
                s.metric("vllm:prefix_cache_hits_total", "").await,
                s.metric("vllm:time_to_first_token_seconds_count", "").await,
            );
            assert_eq!(got, want, "request {i}");
            let inf = ",le=\"+Inf\"";
            let bucket = s.metric("vllm:time_to_first_token_seconds_bucket", inf);
            assert_eq!(bucket.await, want.2);
            // A first token takes at least the 16.5 ms constant of a prefill.
            let under_10ms = ",le=\"0.01\"";
            let fast = s.metric("vllm:time_to_first_token_seconds_bucket", under_10ms);
            assert_eq!(fast.await, 0.0);
            let gen = s.metric("vllm:generation_tokens_total", "").await;
            assert_eq!(gen, 3.0 * (i + 1) as f64);
            // Three output tokens: two gaps between them each time.
            let gaps = s.metric("vllm:inter_token_latency_seconds_count", "").await;
            assert_eq!(gaps, 2.0 * (i + 1) as f64);
            assert_eq!(s.load().await, (0.0, 0.0, 0.0));
            assert_eq!(s.metric("vllm:gpu_cache_usage_perc", "").await, 0.0);
        }
    }

    #[tokio::test]
    async fn concurrent_requests_are_batched_and_all_complete() {
        let s = Arc::new(TestServer::start(config()).await);
        let tasks: Vec<_> = (0..16u32)
            .map(|i| {
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let body = completion(&text::words(100 + u64::from(i % 4), 40), 3 + i);
                    s.post("/v1/completions", &body).await
                })
            })
            .collect();
        for (i, task) in tasks.into_iter().enumerate() {
            let (status, v) = task.await.unwrap();
            assert_eq!(status, StatusCode::OK, "{v}");
            let out = v["choices"][0]["text"].as_str().unwrap();
            assert_eq!(text::count_tokens(out), 3 + i, "request {i}");
        }
        assert_eq!(s.load().await, (0.0, 0.0, 0.0));
        let gen = s.metric("vllm:generation_tokens_total", "").await;
        assert_eq!(gen, (0..16).map(|i| 3.0 + f64::from(i)).sum::<f64>());
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut ttft = Histogram::new(TTFT_BUCKETS);
        for v in [0.0005, 0.003, 0.003, 3000.0] {
            ttft.observe(v);
        }
        let snapshot = Snapshot {
            gpu_blocks: 100,
            block_tokens: 16,
            running: 1,
            waiting: 2,
            kv_usage: 0.5,
            stats: EngineStats::default(),
            generation_tokens: 0,
            ttft,
            itl: Histogram::new(ITL_BUCKETS),
        };
        let text = render_metrics("m\"x", &snapshot, None);
        let name = "vllm:time_to_first_token_seconds";
        let label = "model_name=\"m\\\"x\"";
        // (le, cumulative count)
        let cases = [
            ("0.001", 1),
            ("0.005", 3),
            ("0.01", 3),
            ("2560", 3),
            ("+Inf", 4),
        ];
        for (le, want) in cases {
            let line = format!("{name}_bucket{{{label},le=\"{le}\"}} {want}\n");
            assert!(text.contains(&line), "{line:?} not in\n{text}");
        }
        assert!(text.contains(&format!("{name}_count{{{label}}} 4\n")));
        assert!(text.contains(&format!("vllm:num_requests_waiting{{{label}}} 2\n")));
        assert!(text.contains(&format!("vllm:gpu_cache_usage_perc{{{label}}} 0.5\n")));
    }

    /// Real speed and a very long output: the request could not finish during the test.
    fn slow_config() -> EngineSimConfig {
        EngineSimConfig {
            speedup: 1.0,
            ..config()
        }
    }

    #[tokio::test]
    async fn a_client_dropping_its_stream_cancels_the_request() {
        let s = TestServer::start(slow_config()).await;
        let mut body = completion(&text::words(8, 50), 50_000);
        body["stream"] = json!(true);
        let mut events = s.stream("/v1/completions", &body).await;
        for _ in 0..3 {
            let event = events.next().await.unwrap();
            assert!(event.starts_with('{'), "{event}");
        }
        assert_eq!(s.load().await, (1.0, 0.0, 0.0));
        drop(events);
        s.wait_for_load((0.0, 0.0, 1.0)).await;
        let finished = ",finished_reason=\"length\"";
        assert_eq!(s.metric("vllm:request_success_total", finished).await, 0.0);
        assert_eq!(s.metric("vllm:gpu_cache_usage_perc", "").await, 0.0);
    }

    #[tokio::test]
    async fn a_client_closing_before_the_response_cancels_the_request() {
        let s = TestServer::start(slow_config()).await;
        let body = completion(&text::words(9, 50), 50_000).to_string();
        let mut conn = TcpStream::connect(s.addr).await.unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(body.as_bytes()).await.unwrap();
        s.wait_for_load((1.0, 0.0, 0.0)).await;
        drop(conn);
        s.wait_for_load((0.0, 0.0, 1.0)).await;
    }

    #[tokio::test]
    async fn shutdown_lets_in_flight_streams_finish() {
        let mut s = TestServer::start(slow_config()).await;
        let mut body = completion(&text::words(10, 20), 20);
        body["stream"] = json!(true);
        let mut events = s.stream("/v1/completions", &body).await;
        events.next().await.unwrap();
        s.stop.take().unwrap().send(()).unwrap();
        let rest = events.all().await;
        assert_eq!(rest.len(), 20, "{rest:?}");
        assert_eq!(rest.last().unwrap(), "[DONE]");
        s.task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn speedup_must_be_positive() {
        for speedup in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let config = EngineSimConfig {
                speedup,
                ..config()
            };
            let err = serve(listener, config, async {}).await.unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        }
    }
}
