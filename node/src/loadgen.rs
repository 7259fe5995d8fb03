//! `warmpath loadgen`: open- or closed-loop HTTP load against an OpenAI-compatible
//! endpoint (a warmpath router, an engine-sim, vLLM), replaying a trace or a synthetic
//! workload, with TTFT, inter-token latency, end-to-end latency, throughput, hit rate and
//! errors. The library is `warmpath_loadgen`.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;
use warmpath_loadgen::{
    self as loadgen, Endpoint, LiveRequest, LoadReport, LoadgenConfig, Mode, Progress, TenantAuth,
};
use warmpath_sim::workload::synthetic::{generate, to_workload, SyntheticKind, SyntheticParams};
use warmpath_sim::workload::{mooncake, ReadOptions};

#[derive(Args, Debug, Clone)]
pub struct LoadgenArgs {
    /// Base URL to send to, repeatable (requests alternate between them).
    #[arg(long = "target", required = true)]
    pub targets: Vec<String>,
    /// Mooncake-format JSONL trace to replay (hash ids become deterministic text).
    #[arg(long, conflicts_with = "workload")]
    pub trace: Option<PathBuf>,
    /// Synthetic workload: chat, bots, rag, code or conversation.
    #[arg(long, default_value = "bots")]
    pub workload: String,
    /// Requests to send (synthetic: generated; trace: the first N).
    #[arg(long, default_value_t = 500)]
    pub requests: usize,
    /// Synthetic arrival rate (requests/s of model time) when replaying timestamps.
    #[arg(long, default_value_t = 15.0)]
    pub rate: f64,
    /// Replay arrival times this many times faster (match the engines' --speedup).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Poisson arrivals at this rate (requests/s of wall time) instead of the workload's times.
    #[arg(long, conflicts_with = "concurrency")]
    pub poisson: Option<f64>,
    /// Closed loop with this many concurrent clients instead of timed arrivals.
    #[arg(long)]
    pub concurrency: Option<u32>,
    #[arg(long, default_value = "sim-llama")]
    pub model: String,
    /// Send chat completions instead of completions.
    #[arg(long)]
    pub chat: bool,
    /// Do not stream (TTFT is then the whole response time).
    #[arg(long)]
    pub no_stream: bool,
    /// Tenants of a synthetic workload, named with `x-tenant-id: tenant-N`.
    #[arg(long, default_value_t = 1)]
    pub tenants: u32,
    /// API keys for tenants (tenant N uses key N mod count) instead of `x-tenant-id`.
    #[arg(long = "api-key")]
    pub api_keys: Vec<String>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 120.0)]
    pub timeout_s: f64,
    /// Stop sending after this many seconds.
    #[arg(long)]
    pub max_duration_s: Option<f64>,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The requests the arguments describe.
pub fn requests(args: &LoadgenArgs) -> Result<Vec<LiveRequest>> {
    let endpoint = if args.chat {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    if let Some(path) = &args.trace {
        let (mut w, _) = mooncake::read_mooncake(path, &ReadOptions::default())?;
        w.requests.truncate(args.requests);
        return Ok(loadgen::from_workload(&w, None, endpoint));
    }
    let kind: SyntheticKind = args.workload.parse()?;
    let params = SyntheticParams {
        rate_per_s: args.rate,
        requests: u32::try_from(args.requests).context("--requests is too large")?,
        tenants: args.tenants.max(1),
        seed: args.seed,
        ..SyntheticParams::default()
    };
    params.validate()?;
    let synthetic = generate(kind, &params);
    let workload = to_workload(kind.name(), &synthetic, 64);
    Ok(loadgen::from_workload(
        &workload,
        Some(&synthetic),
        endpoint,
    ))
}

/// The load generator configuration the arguments describe.
pub fn config(args: &LoadgenArgs) -> Result<LoadgenConfig> {
    if !(args.timeout_s.is_finite() && args.timeout_s > 0.0) {
        bail!("--timeout-s must be positive");
    }
    let mode = match (args.poisson, args.concurrency) {
        (Some(rate), _) => Mode::Poisson {
            rate_per_s: rate,
            seed: args.seed,
        },
        (None, Some(c)) => Mode::ClosedLoop { concurrency: c },
        (None, None) => Mode::OpenLoop {
            time_scale: args.time_scale,
        },
    };
    let mut config = LoadgenConfig::new(args.targets.clone(), args.model.clone());
    config.mode = mode;
    config.stream = !args.no_stream;
    config.timeout = Duration::from_secs_f64(args.timeout_s);
    config.max_duration = args.max_duration_s.map(Duration::from_secs_f64);
    config.tenant_header = if !args.api_keys.is_empty() {
        TenantAuth::ApiKey(args.api_keys.clone())
    } else if args.tenants > 1 {
        TenantAuth::Header
    } else {
        TenantAuth::None
    };
    Ok(config)
}

/// A one-line progress bar for stderr.
pub fn draw_progress(p: Progress) {
    let frac = if p.total == 0 {
        1.0
    } else {
        p.done as f64 / p.total as f64
    };
    let filled = (frac * 30.0) as usize;
    eprint!(
        "\r[{}{}] {}/{} done, {} in flight, {} errors ",
        "#".repeat(filled),
        "-".repeat(30 - filled),
        p.done,
        p.total,
        p.in_flight,
        p.errors
    );
    let _ = std::io::stderr().flush();
}

/// Runs the load and returns the report.
pub async fn execute(
    config: &LoadgenConfig,
    requests: &[LiveRequest],
    show_progress: bool,
) -> Result<LoadReport> {
    let progress = move |p: Progress| {
        if show_progress {
            draw_progress(p);
        }
    };
    let report = loadgen::run(config, requests, &progress).await?;
    if show_progress {
        eprint!("\r{:80}\r", "");
    }
    Ok(report)
}

pub fn run(args: LoadgenArgs) -> Result<()> {
    let requests = requests(&args)?;
    let config = config(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(execute(&config, &requests, std::io::stderr().is_terminal()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", loadgen::render_report(&report));
    }
    Ok(())
}
