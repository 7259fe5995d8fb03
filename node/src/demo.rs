//! `warmpath demo`: the main job on an embedded default.
//!
//! Starts on loopback, once per policy, a router and four engine-sims (real processes of
//! this binary), drives a prefix-heavy synthetic workload (`bots`: templated bots sharing
//! long system prompts) through the router with the load generator, and prints one
//! comparison table: hit rate, TTFT p50 and p99, throughput, and the router's own
//! overhead. Each policy gets fresh engines, so no policy inherits another's cache.
//!
//! The engines run `--speedup` times faster than the model's timings so the demo takes
//! well under two minutes; TTFT and throughput are reported in model time (wall time ×
//! speed-up), router overhead in wall time. `--keep-running` then leaves a prefix-aware
//! cluster up and prints its URLs.

use crate::engine_sim::AgentProtocol;
use crate::loadgen::execute;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use warmpath_index::policy::Strategy;
use warmpath_loadgen::{self as loadgen, Endpoint, LoadReport, LoadgenConfig, Mode};
use warmpath_sim::workload::synthetic::{generate, to_workload, SyntheticKind, SyntheticParams};

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Requests per policy.
    #[arg(long, default_value_t = 600)]
    pub requests: u32,
    /// Arrival rate in model time, requests/s.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// How much faster than the model's timings the engines run. Each run sends the
    /// workload over its model duration divided by this (at least a minute); the
    /// processes' own wall time counts this many times over in the model-time figures.
    #[arg(long, default_value_t = 10.0)]
    pub speedup: f64,
    /// Engine-sims behind the router.
    #[arg(long, default_value_t = 4)]
    pub instances: u32,
    /// GPU KV-cache capacity of each engine-sim, tokens.
    #[arg(long, default_value_t = 120_000)]
    pub gpu_kv_tokens: u64,
    /// Synthetic workload: chat, bots, rag, code, conversation or longdoc.
    #[arg(long, default_value = "bots")]
    pub workload: String,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Router replicas, gossiping with each other; the load is spread across them.
    #[arg(long, default_value_t = 1)]
    pub routers: u32,
    /// Replicas do not gossip: each knows only its own decisions and load.
    #[arg(long)]
    pub isolated: bool,
    /// Policies to compare (default: all four).
    #[arg(long, num_args = 1..)]
    pub policy: Vec<String>,
    /// Leave a prefix-aware cluster running afterwards and print its URLs.
    #[arg(long)]
    pub keep_running: bool,
    /// Start a cache-agent per simulated host (one per engine-sim), holding this many
    /// tokens' worth of KV blocks in its L1; 0 runs without agents. Each policy then runs
    /// twice, without and with the agents, and the table shows both.
    #[arg(long, default_value_t = 0)]
    pub l1_kv_tokens: u64,
    /// The agents' shared L2: none, dir (a directory in a temp dir) or redis (a
    /// redis-server started for the demo).
    #[arg(long, default_value = "none")]
    pub l2: String,
    /// How the engine-sims speak to their agents (with `--l1-kv-tokens`): `blocks`, the
    /// agent's block API (GPU evictions offloaded), or `hyperpod`, the agent's HyperPod
    /// daemon API as LMCache's connector speaks it (computed 256-token chunks stored in the
    /// agent's shared-memory segment, which holds the L1's tokens, and leased back).
    #[arg(long, value_enum, default_value_t = AgentProtocol::Blocks)]
    pub agent_protocol: AgentProtocol,
    /// Size of the L2 in tokens' worth of KV blocks (dir: the agents' bound; redis: its
    /// maxmemory).
    #[arg(long, default_value_t = 2_000_000)]
    pub l2_kv_tokens: u64,
    /// The agents write what they store to L2 at once (`agent --l2-write through`), not
    /// when L1 evicts it. With `--agent-protocol hyperpod` that is what LMCache does with
    /// its remote backend: each computed chunk reaches the other hosts as it is stored.
    #[arg(long)]
    pub l2_write_through: bool,
    /// Block payloads are the profile's KV bytes × this (1/256 keeps a demo's memory small;
    /// load times are modeled from the real sizes either way).
    #[arg(long, default_value_t = 1.0 / 256.0)]
    pub agent_block_scale: f64,
    /// Routers see what the engines' caches hold: each engine publishes KV events, a
    /// cache-agent per host follows them and serves residency over QUIC (mutual TLS,
    /// certificates made for the run), and every router follows every agent. Without it,
    /// routers know only their own predictions.
    #[arg(long)]
    pub residency: bool,
    /// The routers cut prompts into blocks of this many tokens (the pool's block size);
    /// 0 keeps the default tenant's 64. `--residency` sets the engines' 16, so that the
    /// agents' keys are the routers'; give 16 without it to compare like with like.
    #[arg(long, default_value_t = 0)]
    pub router_block_tokens: u32,
    /// Also write an HTML report with plots (hit rate per policy and tier, TTFT CDFs, each
    /// engine's requests over time, sampled from its /metrics) to DIR/report.html.
    #[arg(long, value_name = "DIR")]
    pub report: Option<PathBuf>,
}

/// The engines' block size in the demo (vLLM's default); routers cut blocks the same way
/// when they follow residency, so the agents' keys are theirs.
const ENGINE_BLOCK_TOKENS: u32 = 16;

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The bytes a demo agent holds for `tokens` tokens of KV (default profile, 16-token blocks,
/// scaled like the payloads).
fn kv_bytes(tokens: u64, scale: f64) -> u64 {
    let profile = warmpath_index::cost::ModelProfile::dynamo_default();
    (tokens as f64 * profile.kv_bytes_per_token as f64 * scale).ceil() as u64
}

/// A child process of this binary, killed when dropped.
struct Proc {
    /// Held to be killed when dropped.
    _child: Child,
    url: String,
    /// Where its metrics are served, when not at `url` (a cache-agent's metrics port).
    metrics: Option<String>,
    /// A cache-agent's HyperPod segment, removed when dropped (agents leave theirs).
    segment: Option<Segment>,
}

/// `/dev/shm/NAME` of a demo agent's HyperPod API: a name of this run, removed at its end.
struct Segment(String);

impl Segment {
    fn new() -> Segment {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Segment(format!("warmpath-demo-{}-{n}", std::process::id()))
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(std::path::Path::new("/dev/shm").join(&self.0));
    }
}

async fn spawn(args: &[String]) -> Result<Proc> {
    Ok(spawn_with_lines(args, 1).await?.0)
}

/// Starts `warmpath args…` and returns it with its first `lines` stdout lines.
async fn spawn_with_lines(args: &[String], lines_wanted: usize) -> Result<(Proc, Vec<String>)> {
    let exe = std::env::current_exe().context("cannot find this binary")?;
    let mut child = Command::new(exe)
        .args(args)
        .env("WARMPATH_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start warmpath {}", args.join(" ")))?;
    let stdout = child.stdout.take().context("stdout is piped")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut first = Vec::new();
    for _ in 0..lines_wanted {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .context("a child took over 20 s to start")??
            .with_context(|| format!("warmpath {} exited before listening", args.join(" ")))?;
        first.push(line);
    }
    let url = first[0]
        .split("listening on ")
        .nth(1)
        .with_context(|| format!("unexpected first line {:?}", first[0]))?
        .trim()
        .to_string();
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((
        Proc {
            _child: child,
            url,
            metrics: None,
            segment: None,
        },
        first,
    ))
}

struct Cluster {
    routers: Vec<Proc>,
    engines: Vec<Proc>,
    agents: Vec<Proc>,
    /// The routers' config and a `--residency` run's certificates, removed when dropped.
    _run_dir: tempfile::TempDir,
    /// The L2 store of this run (a temp dir or a redis-server), removed when dropped.
    _l2: Option<L2Store>,
}

/// The agents' shared L2 for one run.
enum L2Store {
    Dir(tempfile::TempDir),
    /// The server (killed when dropped) and its port.
    Redis {
        _server: tokio::process::Child,
        port: u16,
    },
}

impl L2Store {
    async fn start(kind: &str, bytes: u64) -> Result<Option<L2Store>> {
        match kind {
            "none" => Ok(None),
            "dir" => Ok(Some(L2Store::Dir(
                tempfile::tempdir().context("cannot make the L2 directory")?,
            ))),
            "redis" => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")?
                    .local_addr()?
                    .port();
                let child = Command::new("redis-server")
                    .args([
                        "--port",
                        &port.to_string(),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                    ])
                    .args(["--appendonly", "no", "--maxmemory", &bytes.to_string()])
                    .args(["--maxmemory-policy", "allkeys-lru"])
                    .stdout(Stdio::null())
                    .kill_on_drop(true)
                    .spawn()
                    .context("--l2 redis needs redis-server (apt-get install redis-server)")?;
                let deadline = Instant::now() + Duration::from_secs(10);
                while tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_err()
                {
                    if Instant::now() > deadline {
                        bail!("redis-server did not start on port {port}");
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(Some(L2Store::Redis {
                    _server: child,
                    port,
                }))
            }
            other => bail!("--l2 {other:?}: none, dir or redis"),
        }
    }

    fn flag(&self) -> String {
        match self {
            L2Store::Dir(d) => format!("dir:{}", d.path().display()),
            L2Store::Redis { port, .. } => format!("redis://127.0.0.1:{port}"),
        }
    }
}

/// One simulated host: its engine-sim and, with agents or residency, its cache-agent (and
/// the agent's residency address).
async fn start_host(
    args: &DemoArgs,
    certs: Option<&String>,
    l2: Option<&L2Store>,
) -> Result<(Proc, Option<Proc>, Option<String>)> {
    let mut agent_proc = None;
    let mut quic_addr = None;
    // With residency the engine's address is chosen first: an agent names its engine by
    // URL. (Another process may take the port meanwhile: the caller then tries again.)
    let engine_url = if args.residency {
        format!("http://127.0.0.1:{}", free_port()?)
    } else {
        "http://127.0.0.1:0".to_string()
    };
    let mut engine_args: Vec<String> = vec![
        "engine-sim".into(),
        "--listen".into(),
        engine_url.trim_start_matches("http://").to_string(),
        "--speedup".into(),
        args.speedup.to_string(),
        "--gpu-kv-tokens".into(),
        args.gpu_kv_tokens.to_string(),
        "--block-tokens".into(),
        ENGINE_BLOCK_TOKENS.to_string(),
    ];
    if args.l1_kv_tokens > 0 || args.residency {
        let l1_tokens = if args.l1_kv_tokens > 0 {
            args.l1_kv_tokens
        } else {
            u64::from(ENGINE_BLOCK_TOKENS)
        };
        let mut agent_args: Vec<String> = vec![
            "agent".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
            "--l1-bytes".into(),
            kv_bytes(l1_tokens, args.agent_block_scale).to_string(),
        ];
        if let Some(certs) = &certs {
            let events = format!("tcp://127.0.0.1:{}", free_port()?);
            let replay = format!("tcp://127.0.0.1:{}", free_port()?);
            engine_args.extend([
                "--kv-events".into(),
                events.clone(),
                "--kv-replay".into(),
                replay.clone(),
            ]);
            agent_args.extend([
                "--kv-events".into(),
                format!("{engine_url}={events},{replay}"),
                "--residency-listen".into(),
                "127.0.0.1:0".into(),
                "--tls-dir".into(),
                certs.to_string(),
                "--tls-name".into(),
                "agent".into(),
            ]);
        }
        if let Some(l2) = l2 {
            agent_args.extend(["--l2".into(), l2.flag()]);
            if args.l2_write_through {
                agent_args.extend(["--l2-write".into(), "through".into()]);
            }
            if let L2Store::Dir(_) = l2 {
                // The agents share the directory: each bounds its share of it.
                let share =
                    kv_bytes(args.l2_kv_tokens, args.agent_block_scale) / u64::from(args.instances);
                agent_args.extend(["--l2-bytes".into(), share.max(1).to_string()]);
            }
        }
        let hyperpod = args.l1_kv_tokens > 0 && args.agent_protocol == AgentProtocol::Hyperpod;
        let segment = hyperpod.then(Segment::new);
        if let Some(segment) = &segment {
            // The segment holds the L1's tokens; the block API's L1 stays unused.
            agent_args.extend([
                "--hyperpod-listen".into(),
                "127.0.0.1:0".into(),
                "--hyperpod-shm-name".into(),
                segment.0.clone(),
                "--hyperpod-shm-bytes".into(),
                kv_bytes(l1_tokens, args.agent_block_scale)
                    .max(1 << 20)
                    .to_string(),
            ]);
        }
        // Its lines: the block API's address, the residency address (with residency),
        // the metrics port's, then the HyperPod API's (with it).
        let wanted = 2 + usize::from(args.residency) + usize::from(hyperpod);
        let (mut agent, lines) = spawn_with_lines(&agent_args, wanted).await?;
        agent.segment = segment;
        let after = |marker: &str| {
            lines
                .iter()
                .find_map(|l| l.split(marker).nth(1))
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_string)
        };
        agent.metrics = after("metrics on ");
        if args.residency {
            let quic = lines[1]
                .rsplit(" on ")
                .next()
                .context("the agent's residency line")?
                .trim();
            // Followed by its certificate's name: the demo's certificates carry no
            // loopback name.
            quic_addr = Some(format!("agent@{quic}"));
        }
        if hyperpod {
            let api = after("hyperpod API on ").context("the agent's HyperPod API line")?;
            engine_args.extend([
                "--agent".into(),
                api,
                "--agent-protocol".into(),
                "hyperpod".into(),
                "--hyperpod-shm-name".into(),
                agent
                    .segment
                    .as_ref()
                    .map(|s| s.0.clone())
                    .unwrap_or_default(),
                "--agent-block-scale".into(),
                args.agent_block_scale.to_string(),
            ]);
        } else if args.l1_kv_tokens > 0 {
            engine_args.extend([
                "--agent".into(),
                agent.url.clone(),
                "--agent-block-scale".into(),
                args.agent_block_scale.to_string(),
            ]);
        }
        agent_proc = Some(agent);
    }
    let engine = spawn(&engine_args).await?;
    Ok((engine, agent_proc, quic_addr))
}

async fn start_cluster(args: &DemoArgs, strategy: Strategy) -> Result<Cluster> {
    let l2 = if args.l1_kv_tokens > 0 {
        L2Store::start(
            &args.l2,
            kv_bytes(args.l2_kv_tokens, args.agent_block_scale),
        )
        .await?
    } else {
        None
    };
    let run_dir = tempfile::tempdir().context("cannot make the run's directory")?;
    let certs = if args.residency {
        let certs = run_dir.path().join("certs");
        use warmpath_residency::tls::Role;
        warmpath_residency::tls::generate(
            &certs,
            &[
                ("agent".to_string(), Role::Agent),
                ("router".to_string(), Role::Router),
            ],
            &[],
            false,
        )
        .map_err(anyhow::Error::msg)?;
        Some(certs.display().to_string())
    } else {
        None
    };
    let mut engines = Vec::new();
    let mut agents = Vec::new();
    let mut residency_agents = Vec::new();
    for _ in 0..args.instances {
        let mut tries = 0;
        let (engine, agent, quic) = loop {
            tries += 1;
            match start_host(args, certs.as_ref(), l2.as_ref()).await {
                Ok(host) => break host,
                Err(e) if args.residency && tries < 3 => {
                    tracing::warn!(error = %e, "a simulated host did not start; trying again");
                }
                Err(e) => return Err(e),
            }
        };
        engines.push(engine);
        agents.extend(agent);
        residency_agents.extend(quic);
    }
    // The routers' pool: the engines, their agents, and the block size routers cut.
    let config = run_dir.path().join("router.toml");
    let quote = |v: &[String]| {
        v.iter()
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let block_tokens = if args.residency {
        ENGINE_BLOCK_TOKENS
    } else {
        args.router_block_tokens
    };
    std::fs::write(
        &config,
        format!(
            "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [{}]\nagents = [{}]\nblock_tokens = {block_tokens}\n",
            quote(&urls),
            quote(&residency_agents)
        ),
    )?;
    let config = config.display().to_string();
    let mut routers = Vec::new();
    let mut seed: Option<String> = None;
    for r in 0..args.routers.max(1) {
        let mut router_args: Vec<String> = vec![
            "router".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--strategy".into(),
            strategy.name().into(),
            // The demo's routers are on loopback and the demo is about seeing decisions.
            "--allow-explain".into(),
        ];
        router_args.extend(["--config".into(), config.clone()]);
        if let Some(certs) = &certs {
            router_args.extend([
                "--tls-dir".into(),
                certs.clone(),
                "--tls-name".into(),
                "router".into(),
            ]);
        }
        let gossip = args.routers > 1 && !args.isolated;
        if gossip {
            router_args.extend([
                "--node-id".into(),
                format!("router-{}", r + 1),
                "--gossip-listen".into(),
                "127.0.0.1:0".into(),
            ]);
            if let Some(s) = &seed {
                router_args.extend(["--seed".into(), s.clone()]);
            }
        }
        let (router, lines) = spawn_with_lines(&router_args, if gossip { 2 } else { 1 }).await?;
        if gossip && seed.is_none() {
            seed = lines[1]
                .split("gossip on ")
                .nth(1)
                .map(|s| s.trim().to_string());
        }
        routers.push(router);
    }
    Ok(Cluster {
        routers,
        engines,
        agents,
        _run_dir: run_dir,
        _l2: l2,
    })
}

/// The value of the first sample in `text` whose line starts with `prefix`.
fn metric_value(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}

/// The `/metrics` text of the process at `url`.
async fn metrics_text(url: &str) -> Result<String> {
    use http_body_util::BodyExt;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let resp = client.get(format!("{url}/metrics").parse()?).await?;
    Ok(String::from_utf8_lossy(&resp.into_body().collect().await?.to_bytes()).to_string())
}

/// Each of `series` (a line's start in the metrics text) summed over the `/metrics` of the
/// processes at `urls`; 0 where one has no such line.
async fn summed<const N: usize>(urls: &[&str], series: [String; N]) -> Result<[f64; N]> {
    let mut sums = [0.0; N];
    for url in urls {
        let text = metrics_text(url).await?;
        for (sum, s) in sums.iter_mut().zip(&series) {
            *sum += metric_value(&text, s).unwrap_or(0.0);
        }
    }
    Ok(sums)
}

/// The processes' URLs.
fn urls(procs: &[Proc]) -> Vec<&str> {
    procs.iter().map(|p| p.url.as_str()).collect()
}

/// Prefill GPU-seconds (model time) the engines spent, from their `/metrics`.
async fn prefill_gpu_seconds(engines: &[Proc]) -> Result<f64> {
    use warmpath_engine_sim::metric_names::ENGINE_PREFILL_GPU_SECONDS_TOTAL;
    let [total] = summed(
        &urls(engines),
        [format!("{ENGINE_PREFILL_GPU_SECONDS_TOTAL}{{")],
    )
    .await?;
    Ok(total)
}

/// Prompt tokens the engines found in each tier (gpu, l1, l2) over all prompt tokens, from
/// their `/metrics`.
async fn tier_hit_rates(engines: &[Proc]) -> Result<[f64; 3]> {
    let (mut hits, mut prompt) = ([0.0; 3], 0.0);
    for e in engines {
        let text = metrics_text(&e.url).await?;
        let value = |prefix: &str| metric_value(&text, prefix).unwrap_or(0.0);
        for (i, tier) in ["gpu", "l1", "l2"].iter().enumerate() {
            hits[i] += value(&format!(
                "{}{{model_name=\"sim-llama\",tier=\"{tier}\"}}",
                warmpath_engine_sim::metric_names::ENGINE_PREFIX_HIT_TOKENS_TOTAL
            ));
        }
        prompt += value("vllm:prompt_tokens_total{");
    }
    Ok(hits.map(|h| if prompt > 0.0 { h / prompt } else { 0.0 }))
}

/// Counters of the agents' `/metrics`, summed over them: the blocks of routers' prefetch
/// hints they loaded from L2, found already in L1, missed and dropped; then the L2 aliases
/// (record 0126) they wrote, read and found missing.
async fn agent_prefetches(agents: &[Proc]) -> Result<[f64; 7]> {
    use warmpath_cache_agent::metric_names::{AGENT_ALIASES_TOTAL, AGENT_PREFETCH_BLOCKS_TOTAL};
    let series = [
        (AGENT_PREFETCH_BLOCKS_TOTAL, "loaded"),
        (AGENT_PREFETCH_BLOCKS_TOTAL, "in_l1"),
        (AGENT_PREFETCH_BLOCKS_TOTAL, "miss"),
        (AGENT_PREFETCH_BLOCKS_TOTAL, "dropped"),
        (AGENT_ALIASES_TOTAL, "written"),
        (AGENT_ALIASES_TOTAL, "read"),
        (AGENT_ALIASES_TOTAL, "missing"),
    ]
    .map(|(name, result)| format!("{name}{{result=\"{result}\"}}"));
    // The agent prints its metrics' whole URL.
    let at: Vec<&str> = agents
        .iter()
        .map(|a| {
            a.metrics
                .as_deref()
                .map_or(a.url.as_str(), |m| m.trim_end_matches("/metrics"))
        })
        .collect();
    summed(&at, series).await
}

/// Blocks the engines exchanged with their agents (offloaded, fetched, bad, dropped
/// offloads) and their failed calls to them, summed over the engines' `/metrics`.
async fn engine_agent_blocks(engines: &[Proc]) -> Result<[f64; 5]> {
    use warmpath_engine_sim::metric_names::{ENGINE_AGENT_BLOCKS_TOTAL, ENGINE_AGENT_ERRORS_TOTAL};
    let block =
        |op: &str| format!("{ENGINE_AGENT_BLOCKS_TOTAL}{{model_name=\"sim-llama\",op=\"{op}\"}}");
    let series = [
        block("offloaded"),
        block("fetched"),
        block("bad"),
        block("dropped"),
        format!("{ENGINE_AGENT_ERRORS_TOTAL}{{model_name=\"sim-llama\"}}"),
    ];
    summed(&urls(engines), series).await
}

/// The router's index holders by source (observed, predicted), from its `/metrics`.
async fn index_holders(url: &str) -> Result<(f64, f64)> {
    let text = metrics_text(url).await?;
    let value = |source: &str| {
        metric_value(
            &text,
            &format!(
                "{}{{source=\"{source}\"}}",
                crate::metric_names::INDEX_HOLDERS
            ),
        )
        .unwrap_or(0.0)
    };
    Ok((value("observed"), value("predicted")))
}

/// p50 and p99 of the router's overhead summary, in µs.
async fn router_overhead_us(url: &str) -> Result<(f64, f64)> {
    let text = metrics_text(url).await?;
    let quantile = |q: &str| {
        metric_value(
            &text,
            &format!("warmpath_router_overhead_seconds{{quantile=\"{q}\"}}"),
        )
        .map_or(f64::NAN, |s| s * 1e6)
    };
    Ok((quantile("0.5"), quantile("0.99")))
}

struct Row {
    strategy: Strategy,
    /// With `--l1-kv-tokens`: whether this run had the agents (each policy runs with and
    /// without them).
    agents: bool,
    report: LoadReport,
    overhead_us: (f64, f64),
    /// Engine-side hit rate per tier: GPU, L1, L2.
    tiers: [f64; 3],
    /// Prefill GPU-seconds (model time) per answered request.
    prefill_s: f64,
    /// With `--report`: each engine's requests (running and waiting) at seconds of wall
    /// time since the load began.
    load: Vec<(f64, Vec<f64>)>,
}

/// How often `--report` samples the engines' queues.
const LOAD_SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Samples each engine's requests (vLLM's running + waiting gauges) every
/// [`LOAD_SAMPLE_EVERY`] until `stop` fires; an engine that does not answer counts 0.
async fn sample_load(
    engines: Vec<String>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<(f64, Vec<f64>)> {
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(LOAD_SAMPLE_EVERY);
    loop {
        tokio::select! {
            _ = &mut stop => return samples,
            _ = tick.tick() => {}
        }
        let at = started.elapsed().as_secs_f64();
        let mut loads = Vec::with_capacity(engines.len());
        for url in &engines {
            let text = metrics_text(url).await.unwrap_or_default();
            let value = |prefix: &str| metric_value(&text, prefix).unwrap_or(0.0);
            loads.push(value("vllm:num_requests_running{") + value("vllm:num_requests_waiting{"));
        }
        samples.push((at, loads));
    }
}

pub fn run(args: DemoArgs) -> Result<()> {
    if args.instances == 0 {
        bail!("--instances must be at least 1");
    }
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        bail!("--speedup must be positive");
    }
    if args.l2 != "none" && args.l1_kv_tokens == 0 {
        bail!("--l2 {} needs agents: give --l1-kv-tokens", args.l2);
    }
    if args.l2_write_through && args.l2 == "none" {
        bail!("--l2-write-through writes to L2: give --l2 dir or --l2 redis");
    }
    if !(args.agent_block_scale.is_finite() && args.agent_block_scale > 0.0) {
        bail!("--agent-block-scale must be positive");
    }
    if args.agent_protocol == AgentProtocol::Hyperpod && args.l1_kv_tokens == 0 {
        bail!("--agent-protocol hyperpod needs agents: give --l1-kv-tokens");
    }
    if args.residency && ![0, ENGINE_BLOCK_TOKENS].contains(&args.router_block_tokens) {
        bail!("--residency cuts blocks as the engines do ({ENGINE_BLOCK_TOKENS} tokens): drop --router-block-tokens");
    }
    if let Some(dir) = &args.report {
        crate::report::prepare(dir)?;
    }
    let kind: SyntheticKind = args.workload.parse()?;
    let params = SyntheticParams {
        rate_per_s: args.rate,
        requests: args.requests,
        seed: args.seed,
        ..SyntheticParams::default()
    };
    params.validate()?;
    let synthetic = generate(kind, &params);
    let workload = to_workload(kind.name(), &synthetic, 64);
    let requests = loadgen::from_workload(&workload, Some(&synthetic), Endpoint::Completions);
    let stats = workload.stats();
    println!(
        "warmpath demo: {} engine-sims ({} GPU KV tokens each, {}× speed-up) behind {} router(s){}, on loopback",
        args.instances,
        args.gpu_kv_tokens,
        args.speedup,
        args.routers.max(1),
        if args.routers > 1 && args.isolated { " that do not gossip" } else if args.routers > 1 { " gossiping with each other" } else { "" }
    );
    if args.residency {
        println!(
            "routers follow observed residency: each engine publishes KV events to its host's cache-agent, which every router follows over QUIC (mutual TLS); routers cut {ENGINE_BLOCK_TOKENS}-token blocks as the engines do"
        );
    }
    if args.l1_kv_tokens > 0 {
        println!(
            "a cache-agent per engine-sim: L1 of {} KV tokens, L2 {}{}{}; payloads at {}× the real KV bytes; {}",
            args.l1_kv_tokens,
            args.l2,
            if args.l2 == "none" { String::new() } else { format!(" of {} KV tokens", args.l2_kv_tokens) },
            if args.l2_write_through { ", written through" } else { "" },
            args.agent_block_scale,
            args.agent_protocol.describe()
        );
    }
    println!(
        "workload {}: {} requests over {:.0} s of model time, mean prompt {:.0} tokens, ideal hit rate {:.1}%\n",
        kind.name(),
        stats.requests,
        stats.duration_us as f64 / 1e6,
        stats.mean_prompt_tokens,
        stats.ideal_hit_ratio * 100.0
    );
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // Set once every run is done and the cluster is kept running for the user: a signal then
    // ends the demo as asked, not as an interruption.
    let serving = std::cell::Cell::new(false);
    let work = async {
        let mut rows = Vec::new();
        let strategies: Vec<Strategy> = if args.policy.is_empty() {
            Strategy::ALL.to_vec()
        } else {
            args.policy
                .iter()
                .map(|p| p.parse::<Strategy>())
                .collect::<Result<_, _>>()?
        };
        // With agents, each policy also runs without them: what the tiers buy, side by side.
        let mut runs: Vec<(Strategy, bool)> = Vec::new();
        for &strategy in &strategies {
            if args.l1_kv_tokens > 0 {
                runs.push((strategy, false));
            }
            runs.push((strategy, args.l1_kv_tokens > 0));
        }
        for (strategy, agents) in runs {
            let without = DemoArgs {
                l1_kv_tokens: 0,
                l2: "none".into(),
                ..args.clone()
            };
            let run_args = if agents || args.l1_kv_tokens == 0 {
                &args
            } else {
                &without
            };
            let cluster = start_cluster(run_args, strategy).await?;
            let targets = cluster.routers.iter().map(|r| r.url.clone()).collect();
            let mut config = LoadgenConfig::new(targets, "sim-llama");
            config.mode = Mode::OpenLoop {
                time_scale: args.speedup,
            };
            config.timeout = Duration::from_secs(60);
            config.max_duration = Some(send_window(stats.duration_us, args.speedup));
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let sampler = args.report.as_ref().map(|_| {
                let urls = cluster.engines.iter().map(|e| e.url.clone()).collect();
                tokio::spawn(sample_load(urls, stopped))
            });
            let report = execute(&config, &requests, false).await?;
            let _ = stop.send(());
            let load = match sampler {
                Some(task) => task.await?,
                None => Vec::new(),
            };
            let overhead_us = router_overhead_us(&cluster.routers[0].url)
                .await
                .unwrap_or((f64::NAN, f64::NAN));
            let tiers = tier_hit_rates(&cluster.engines)
                .await
                .unwrap_or([f64::NAN; 3]);
            let prefill_s = prefill_gpu_seconds(&cluster.engines)
                .await
                .unwrap_or(f64::NAN)
                / report.ok.max(1) as f64;
            let label = row_label(strategy, agents);
            println!(
                "  {label:<20} done at {:5.1} s: {} ok, {} errors",
                started.elapsed().as_secs_f64(),
                report.ok,
                report.error_count()
            );
            if agents {
                let [offloaded, fetched, bad, dropped, failed] =
                    engine_agent_blocks(&cluster.engines)
                        .await
                        .unwrap_or([f64::NAN; 5]);
                println!("  {:<13} engines' blocks with their agents: {offloaded} offloaded, {fetched} fetched, {bad} bad, {dropped} offloads dropped; {failed} failed calls", "");
            }
            if args.residency {
                let (observed, predicted) = index_holders(&cluster.routers[0].url)
                    .await
                    .unwrap_or((f64::NAN, f64::NAN));
                println!("  {:<13} router index at the end: {observed} observed (instance, block) holders, {predicted} predicted", "");
                if agents {
                    let [loaded, in_l1, miss, dropped, written, read, missing] =
                        agent_prefetches(&cluster.agents)
                            .await
                            .unwrap_or([f64::NAN; 7]);
                    println!("  {:<13} prefetch hints' blocks: {loaded} loaded from L2, {in_l1} already in L1, {miss} missed, {dropped} dropped", "");
                    println!("  {:<13} L2 aliases: {written} written, {read} read, {missing} lookups found none", "");
                }
            }
            use std::io::Write;
            let _ = std::io::stdout().flush();
            rows.push(Row {
                strategy,
                agents,
                report,
                overhead_us,
                tiers,
                prefill_s,
                load,
            });
            drop(cluster);
        }
        print!("{}", render(&rows, args.speedup));
        println!(
            "\ntotal {:.1} s of wall time",
            started.elapsed().as_secs_f64()
        );
        if let Some(dir) = &args.report {
            let path = write_report(dir, &args, &rows, &stats)?;
            println!("report: {}", path.display());
        }
        if args.keep_running {
            let cluster = start_cluster(&args, Strategy::PrefixAware).await?;
            println!("\ncluster running (prefix-aware); Ctrl-C stops it");
            for r in &cluster.routers {
                println!("  router:  {}  (metrics: {}/metrics)", r.url, r.url);
            }
            for e in &cluster.engines {
                println!("  engine:  {}  (metrics: {}/metrics)", e.url, e.url);
            }
            for a in &cluster.agents {
                println!(
                    "  agent:   {}  (block API{}; metrics: {})",
                    a.url,
                    a.segment
                        .as_ref()
                        .map(|s| format!(", HyperPod API, segment /dev/shm/{}", s.0))
                        .unwrap_or_default(),
                    a.metrics.as_deref().unwrap_or("none")
                );
            }
            println!(
                "  try: curl -s {}/v1/completions -H 'x-warmpath-explain: 1' -d '{{\"model\":\"sim-llama\",\"prompt\":\"hello\",\"max_tokens\":8}}'",
                cluster.routers[0].url
            );
            serving.set(true);
            // Until the signal below: the cluster lives as long as this never returns.
            std::future::pending::<()>().await;
        }
        Ok::<(), anyhow::Error>(())
    };
    // A signal drops the work in flight, and with it every process, temporary directory and
    // shared-memory segment the demo started (each ends when dropped): none outlives it.
    runtime.block_on(async {
        tokio::select! {
            done = work => done,
            () = crate::shutdown_signal() => {
                if serving.get() {
                    Ok(())
                } else {
                    bail!("interrupted: the demo's processes are stopped")
                }
            }
        }
    })
}

/// A row's name: the policy, and `+agents` for a run with agents when runs without them
/// stand beside it.
fn row_label(strategy: Strategy, agents: bool) -> String {
    if agents {
        format!("{}+agents", strategy.name())
    } else {
        strategy.name().to_string()
    }
}

/// How long the load generator sends: the workload's model duration at the speed-up, and
/// ten seconds more, but at least a minute. A slow speed-up (closer to the model's own
/// timing, so the processes' own wall time weighs less in model time) then still sends
/// every request, where a fixed minute cut it short.
fn send_window(duration_us: u64, speedup: f64) -> Duration {
    Duration::from_secs_f64((duration_us as f64 / 1e6 / speedup + 10.0).max(60.0))
}

fn render(rows: &[Row], speedup: f64) -> String {
    let mut s = String::new();
    s += &format!(
        "\n{:<20} {:>6} {:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>8} {:>9} {:>7} {:>8} {:>8} {:>8}\n",
        "policy",
        "hit%",
        "gpu%",
        "l1%",
        "l2%",
        "ttft p50",
        "ttft p99",
        "ttft/rr",
        "prefill",
        "req/s",
        "errors",
        "ovh p50",
        "ovh p99",
        "ok"
    );
    let rr = rows
        .iter()
        .find(|r| r.strategy == Strategy::RoundRobin && !r.agents)
        .map(|r| r.report.ttft_ms.p50);
    for r in rows {
        let rep = &r.report;
        s += &format!(
            "{:<20} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>10.1} {:>10.1} {:>10} {:>8.3} {:>9.2} {:>7} {:>8.0} {:>8.0} {:>8}\n",
            row_label(r.strategy, r.agents),
            rep.hit_rate * 100.0,
            r.tiers[0] * 100.0,
            r.tiers[1] * 100.0,
            r.tiers[2] * 100.0,
            rep.ttft_ms.p50 * speedup,
            rep.ttft_ms.p99 * speedup,
            rr.filter(|v| *v > 0.0)
                .map_or("-".to_string(), |v| format!("{:.2}x", rep.ttft_ms.p50 / v)),
            r.prefill_s,
            rep.throughput_rps / speedup,
            rep.error_count(),
            r.overhead_us.0,
            r.overhead_us.1,
            rep.ok,
        );
    }
    s += "hit% = cached tokens the clients saw; gpu%/l1%/l2% = prompt tokens the engines found in each tier\n";
    if rows.iter().any(|r| r.agents) {
        s += "+agents = the same policy with a cache-agent per engine (L1, and L2 when given); ttft/rr against round-robin without agents\n";
    }
    s += "ttft in ms of model time (wall × speed-up); req/s in model time; ovh = router overhead per request\n";
    s += "(arrival to upstream send: parse, tokenize, hash, route), µs of wall time; prefill = the engines'\n";
    s += "prefill GPU-seconds (model time) per answered request\n";
    let pairs: Vec<(&Row, &Row)> = rows
        .iter()
        .filter(|r| r.agents)
        .filter_map(|w| {
            rows.iter()
                .find(|n| !n.agents && n.strategy == w.strategy)
                .map(|n| (w, n))
        })
        .collect();
    if !pairs.is_empty() {
        use crate::report::ratio;
        s += "\nwith agents against the same policy without them:\n";
        s += &format!(
            "{:<13} {:>11} {:>9} {:>9} {:>8}\n",
            "policy", "hit% no→on", "ttft p50", "ttft p99", "prefill"
        );
        for (w, n) in pairs {
            s += &format!(
                "{:<13} {:>5.1}→{:<5.1} {:>9} {:>9} {:>8}\n",
                w.strategy.name(),
                n.report.hit_rate * 100.0,
                w.report.hit_rate * 100.0,
                ratio(w.report.ttft_ms.p50, n.report.ttft_ms.p50),
                ratio(w.report.ttft_ms.p99, n.report.ttft_ms.p99),
                ratio(w.prefill_s, n.prefill_s),
            );
        }
    }
    s
}

/// Writes `demo --report DIR`: what the live run measured, as plots (times in model time:
/// wall × speed-up).
fn write_report(
    dir: &std::path::Path,
    args: &DemoArgs,
    rows: &[Row],
    stats: &warmpath_sim::workload::WorkloadStats,
) -> Result<PathBuf> {
    use crate::report;
    let conditions = vec![
        (
            "cluster".to_string(),
            format!(
                "{} engine-sims × {} GPU KV tokens, {}× speed-up, {} router(s){}{}; real processes on loopback",
                args.instances,
                args.gpu_kv_tokens,
                args.speedup,
                args.routers.max(1),
                if args.residency { ", routers following residency over QUIC" } else { "" },
                if args.l1_kv_tokens > 0 {
                    format!(", a cache-agent per engine (L1 {} KV tokens, L2 {}; {})", args.l1_kv_tokens, args.l2, args.agent_protocol.describe())
                } else {
                    String::new()
                }
            ),
        ),
        (
            "workload".to_string(),
            format!(
                "{}: {} requests at {} req/s of model time, mean prompt {:.0} tokens, ideal hit rate {:.1}%, seed {}",
                args.workload,
                stats.requests,
                args.rate,
                stats.mean_prompt_tokens,
                stats.ideal_hit_ratio * 100.0,
                args.seed
            ),
        ),
        (
            "made by".to_string(),
            format!(
                "warmpath {} demo: measured live on this machine (wall-clock, so not \
                 repeatable to the digit)",
                env!("CARGO_PKG_VERSION")
            ),
        ),
    ];
    let runs: Vec<report::Run> = rows
        .iter()
        .map(|r| report::Run {
            policy: row_label(r.strategy, r.agents),
            tiers: r.tiers,
            ttft_cdf_ms: r
                .report
                .ttft_cdf_ms
                .iter()
                .map(|ms| ms * args.speedup)
                .collect(),
            load: r
                .load
                .iter()
                .map(|(t, v)| (t * args.speedup, v.clone()))
                .collect(),
        })
        .collect();
    let figures = report::figures(
        &runs,
        &report::Provenance {
            hit_rates: "from the engines' /metrics".into(),
            ttft: "ms of model time, as the clients measured it".into(),
            ttft_axis: "TTFT (ms, model time)".into(),
            load: format!(
                "from each engine's /metrics every {} ms of wall time, over model time",
                LOAD_SAMPLE_EVERY.as_millis()
            ),
        },
    )?;
    report::write(
        dir,
        &format!("warmpath demo: {}", args.workload),
        &conditions,
        &render(rows, args.speedup),
        &figures,
    )
}
