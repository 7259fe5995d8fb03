//! `warmpath engine-sim`: the engine model served live over HTTP (see
//! `warmpath_sim::live::server`), paced by the wall clock with a speed-up factor.

use anyhow::{bail, Context, Result};
use clap::Args;
use warmpath_sim::engine::EngineConfig;
use warmpath_sim::live::server::{serve, EngineSimConfig};

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
    let config = EngineSimConfig {
        model: args.model.clone(),
        engine: EngineConfig {
            block_tokens: args.block_tokens,
            gpu_blocks,
            l1_blocks: args.l1_kv_tokens / u64::from(args.block_tokens),
            ..EngineConfig::default()
        },
        profile: warmpath_index::profiles::builtin(&args.profile)?,
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
