//! `warmpath engine-sim`: the engine model served live over HTTP (see
//! `warmpath_engine_sim::server`), paced by the wall clock with a speed-up factor.

use anyhow::{bail, Context, Result};
use clap::Args;
use warmpath_cache_agent::client::AgentAddr;
use warmpath_engine_sim::hyperpod::{HyperPodSettings, DEFAULT_CHUNK_TOKENS};
use warmpath_engine_sim::offload::{layout_of, AgentSettings};
use warmpath_engine_sim::server::{serve, EngineSimConfig};
use warmpath_sim::engine::EngineConfig;

#[derive(Args, Debug, Clone)]
pub struct EngineSimArgs {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: String,
    /// Served model name.
    #[arg(long, default_value = "sim-llama")]
    pub model: String,
    /// Virtual time per wall time: 10 runs ten times faster than the model's timings.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// GPU KV-cache capacity, tokens.
    #[arg(long, default_value_t = 409_600)]
    pub gpu_kv_tokens: u64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// Host CPU-memory (L1) capacity, tokens; 0 = none.
    #[arg(long, default_value_t = 0)]
    pub l1_kv_tokens: u64,
    /// Output tokens when a request sets no limit.
    #[arg(long, default_value_t = 64)]
    pub default_max_tokens: u32,
    /// Model profile (builtin name).
    #[arg(long, default_value = "default")]
    pub profile: String,
    /// The host's cache-agent (HOST:PORT or unix:PATH): GPU evictions are offloaded to it
    /// as real payloads and a GPU miss loads the following blocks from it. With
    /// `--agent-protocol hyperpod`, its HyperPod API (HOST:PORT or http://HOST:PORT).
    #[arg(long)]
    pub agent: Option<AgentAddr>,
    /// How to speak to the agent: `blocks` (its block API) or `hyperpod` (its HyperPod
    /// daemon API, as LMCache's connector does: computed 256-token chunks stored, a GPU
    /// miss leases them and reads the agent's shared-memory segment).
    #[arg(long, value_enum, default_value_t = AgentProtocol::Blocks, requires = "agent")]
    pub agent_protocol: AgentProtocol,
    /// With `--agent-protocol hyperpod`: the agent's segment (its `--hyperpod-shm-name`),
    /// read at /dev/shm/NAME.
    #[arg(long)]
    pub hyperpod_shm_name: Option<String>,
    /// With `--agent-protocol hyperpod`: tokens per chunk (LMCache's `chunk_size`), a
    /// multiple of `--block-tokens`.
    #[arg(long, default_value_t = DEFAULT_CHUNK_TOKENS)]
    pub hyperpod_chunk_tokens: u32,
    /// File holding the agent's block API token.
    #[arg(long, requires = "agent")]
    pub agent_token_file: Option<std::path::PathBuf>,
    /// Publish KV events (vLLM's ZMQ/msgpack format) on this endpoint, e.g.
    /// tcp://127.0.0.1:5557.
    #[arg(long)]
    pub kv_events: Option<String>,
    /// Serve the replay of recent KV-event batches on this endpoint (vLLM's replay
    /// socket), e.g. tcp://127.0.0.1:5558.
    #[arg(long, requires = "kv_events")]
    pub kv_replay: Option<String>,
    /// Payload bytes per block = the profile's KV bytes per token × block tokens × this
    /// (1 moves real sizes; tests use less).
    #[arg(long, default_value_t = 1.0, requires = "agent")]
    pub agent_block_scale: f64,
    /// Tokenize prompts as an engine serving this model would: builtin (default),
    /// tiktoken:o200k_base, tiktoken:cl100k_base or hf:PATH (a tokenizer.json).
    #[arg(long, default_value = "builtin")]
    pub tokenizer: String,
    /// Render chat requests with this Jinja chat template (default: the built-in format).
    #[arg(long)]
    pub chat_template_file: Option<std::path::PathBuf>,
}

/// The protocol engine-sim speaks to its agent.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentProtocol {
    /// warmpath's block API (record 0074).
    Blocks,
    /// The HyperPod daemon API, as LMCache speaks it (record 0109).
    Hyperpod,
}

impl AgentProtocol {
    /// What a run's output says of it.
    pub fn describe(self) -> &'static str {
        match self {
            AgentProtocol::Blocks => "engines speak the agent's block API",
            AgentProtocol::Hyperpod => {
                "engines speak the agent's HyperPod API as LMCache does (256-token chunks, leases, a shared-memory segment)"
            }
        }
    }
}

/// The HyperPod link of `args`, when `--agent-protocol hyperpod`.
fn hyperpod_settings(
    args: &EngineSimArgs,
    kv_bytes_per_token: u64,
) -> Result<Option<HyperPodSettings>> {
    let hyperpod = args.agent_protocol == AgentProtocol::Hyperpod;
    if !hyperpod {
        if args.hyperpod_shm_name.is_some() {
            bail!("--hyperpod-shm-name goes with --agent-protocol hyperpod");
        }
        return Ok(None);
    }
    let url = match &args.agent {
        Some(AgentAddr::Tcp(a)) if a.starts_with("http://") => a.trim_end_matches('/').to_string(),
        Some(AgentAddr::Tcp(a)) => format!("http://{a}"),
        Some(AgentAddr::Unix(_)) => {
            bail!("--agent-protocol hyperpod speaks HTTP over TCP: give --agent HOST:PORT")
        }
        None => {
            bail!("--agent-protocol hyperpod needs --agent HOST:PORT (the agent's HyperPod API)")
        }
    };
    let Some(shm_name) = args.hyperpod_shm_name.clone() else {
        bail!("--agent-protocol hyperpod needs --hyperpod-shm-name (the agent's segment)");
    };
    if args.agent_token_file.is_some() {
        bail!("--agent-token-file is for the block API; the HyperPod API takes no token on loopback, and LMCache sends none");
    }
    let chunk = args.hyperpod_chunk_tokens;
    if chunk == 0 || !chunk.is_multiple_of(args.block_tokens) {
        bail!(
            "--hyperpod-chunk-tokens {chunk} must be a positive multiple of --block-tokens {}",
            args.block_tokens
        );
    }
    let bytes = kv_bytes_per_token as f64 * f64::from(args.block_tokens) * args.agent_block_scale;
    Ok(Some(HyperPodSettings {
        url,
        shm_name,
        model: args.model.clone(),
        layout: layout_of(&args.model, chunk),
        chunk_tokens: chunk,
        block_tokens: args.block_tokens,
        block_bytes: (bytes.round() as usize).max(1),
        timeout: std::time::Duration::from_secs(2),
    }))
}

pub fn run(args: EngineSimArgs) -> Result<()> {
    if args.block_tokens == 0 {
        bail!("--block-tokens must be at least 1");
    }
    let gpu_blocks = u32::try_from(args.gpu_kv_tokens / u64::from(args.block_tokens))
        .context("--gpu-kv-tokens is too large")?;
    if gpu_blocks < 2 {
        bail!(
            "--gpu-kv-tokens {} holds fewer than two {}-token blocks",
            args.gpu_kv_tokens,
            args.block_tokens
        );
    }
    if args.agent.is_some() && args.l1_kv_tokens > 0 {
        bail!("--l1-kv-tokens models an L1 inside the engine; with --agent the agent is the L1");
    }
    if !(args.agent_block_scale.is_finite() && args.agent_block_scale > 0.0) {
        bail!("--agent-block-scale must be a positive number");
    }
    let profile = warmpath_index::profiles::builtin(&args.profile)?;
    let hyperpod = hyperpod_settings(&args, profile.kv_bytes_per_token)?;
    let agent = match &args.agent {
        Some(_) if hyperpod.is_some() => None,
        Some(addr) => {
            let token = match &args.agent_token_file {
                Some(p) => {
                    warmpath_cache_agent::config::read_token(p).map_err(anyhow::Error::msg)?
                }
                None => String::new(),
            };
            let bytes = profile.kv_bytes_per_token as f64
                * f64::from(args.block_tokens)
                * args.agent_block_scale;
            Some(AgentSettings {
                addr: addr.clone(),
                token,
                layout: layout_of(&args.model, args.block_tokens),
                block_bytes: (bytes.round() as usize).max(1),
                timeout: std::time::Duration::from_secs(2),
            })
        }
        None => None,
    };
    let chat_template = match &args.chat_template_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("--chat-template-file {}", path.display()))?,
        None => String::new(),
    };
    let tokenizer = crate::prompt::PoolText::load(&args.tokenizer, &chat_template)
        .map_err(anyhow::Error::msg)?
        .into_tokenizer();
    let config = EngineSimConfig {
        model: args.model.clone(),
        engine: EngineConfig {
            block_tokens: args.block_tokens,
            gpu_blocks,
            l1_blocks: args.l1_kv_tokens / u64::from(args.block_tokens),
            ..EngineConfig::default()
        },
        profile,
        agent,
        hyperpod,
        kv_events: args.kv_events.clone(),
        kv_replay: args.kv_replay.clone(),
        tokenizer,
        speedup: args.speedup,
        default_max_tokens: args.default_max_tokens,
        ..EngineSimConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let addr = listener.local_addr()?;
        println!("warmpath engine-sim listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        serve(listener, config, crate::shutdown_signal())
            .await
            .context("engine-sim server failed")
    })
}
