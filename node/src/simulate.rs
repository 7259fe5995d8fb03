//! `warmpath simulate`: runs the cluster simulator once per policy on one workload and
//! prints a comparison table (or JSON), with the workload's hit-rate bounds.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use warmpath_index::index::IndexConfig;
use warmpath_index::policy::{PolicyConfig, Strategy};
use warmpath_index::profiles;
use warmpath_sim::bounds::{ideal_hit_rate, pooled_hit_rate};
use warmpath_sim::cluster::{simulate, ClusterConfig, Progress, RunReport, Sharing};
use warmpath_sim::engine::EngineConfig;
use warmpath_sim::faults::{summarize, Fault};
use warmpath_sim::workload::synthetic::{generate_workload, SyntheticKind, SyntheticParams};
use warmpath_sim::workload::{mooncake, ReadOptions, Workload, WorkloadStats};

/// How replicas share routing decisions in the simulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SharingArg {
    Isolated,
    Delayed,
    Perfect,
}

#[derive(Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Mooncake-format JSONL trace (`hash_ids` are 512-token prefix blocks).
    #[arg(
        long,
        conflicts_with = "workload",
        required_unless_present = "workload"
    )]
    pub trace: Option<PathBuf>,
    /// Synthetic workload: chat, bots, rag, code, conversation or longdoc.
    #[arg(long)]
    pub workload: Option<String>,
    /// Inference instances (one per host).
    #[arg(long, default_value_t = 8)]
    pub instances: u32,
    /// Router replicas behind a random load balancer.
    #[arg(long, default_value_t = 1)]
    pub routers: u32,
    /// Policies to compare: `all`, or names (round-robin, least-loaded, prefix-aware, kv-aware).
    #[arg(long, num_args = 1.., default_values_t = vec!["all".to_string()])]
    pub policy: Vec<String>,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// How replicas learn each other's routing decisions.
    #[arg(long, value_enum, default_value_t = SharingArg::Delayed)]
    pub sharing: SharingArg,
    /// Dissemination delay of routing decisions with `--sharing delayed`, ms. The default
    /// is the median lag measured across 8 live routers (`cargo bench -p warmpath --bench
    /// cluster`: p50 64 ms, p99 79 ms at 1,000 requests/s).
    #[arg(long, default_value_t = 64.0)]
    pub share_delay_ms: f64,
    /// Delay of the cache-agents' residency feed to the routers, ms.
    #[arg(long, default_value_t = 10.0)]
    pub agent_feed_ms: f64,
    /// Turn the agents' residency feed off: routers know only their predictions.
    #[arg(long)]
    pub no_agent_feed: bool,
    /// Routers that follow each agent's residency (decision 0105: chosen by rendezvous
    /// hashing, as live routers choose with `--residency-followers`); by default every
    /// router follows every agent.
    #[arg(long)]
    pub residency_followers: Option<u32>,
    /// The cluster's budget for shared decisions, block keys per second, each router
    /// spending its share (budget / routers) as the gossip adapter does (record 0118; 0:
    /// none). Binds only at fleet rates: 500,000 keys/s is about 5.5 MB/s of gossip.
    #[arg(long, default_value_t = warmpath_index::router::DECISION_BUDGET_KEYS_PER_S)]
    pub gossip_budget_keys: u64,
    /// Agents report one block key in this many at every depth and routers credit each
    /// reported key for the blocks before it (records 0115 and 0117, coarse residency; a
    /// power of two, else the next one up); 1: every block, as before 0115. Default: the
    /// protocol's, one key per 64 tokens of the workload's blocks (one in 4 of 16-token
    /// blocks, every one of the Mooncake trace's 512-token blocks) up to 4,096 tokens into
    /// a chain, then about one per 1/32 of the depth (record 0122).
    #[arg(long)]
    pub residency_report_every: Option<u32>,
    /// Tier loads stall the step that admits them, instead of running beside the batch as
    /// vLLM's KV connectors load (the model before issue 24).
    #[arg(long)]
    pub blocking_loads: bool,
    /// Routers send no prefetch hints (by default a request routed to an instance whose
    /// host holds part of its prefix only in L2 has those blocks read into the host's L1
    /// while it queues, as live routers ask the host's agent).
    #[arg(long)]
    pub no_prefetch: bool,
    /// GPU KV-cache capacity of each instance, tokens.
    #[arg(long, default_value_t = 400_000)]
    pub gpu_kv_tokens: u64,
    /// Host CPU-memory (L1) capacity of each host, tokens; 0 = no L1.
    #[arg(long, default_value_t = 0)]
    pub l1_kv_tokens: u64,
    /// Global L2 store capacity, tokens; 0 = no L2.
    #[arg(long, default_value_t = 0)]
    pub l2_kv_tokens: u64,
    /// Store every block an engine computes in L2 when its prefill ends, as LMCache writes
    /// each computed chunk to all its backends (needs --l2-kv-tokens); without, L2 takes
    /// only what L1 evicts.
    #[arg(long)]
    pub l2_write_through: bool,
    /// Model profile (builtin name).
    #[arg(long, default_value = "default")]
    pub profile: String,
    /// Tokens of the prompt used for prefix matching (SageMaker's prefix length); 0 = all.
    #[arg(long, default_value_t = 0)]
    pub prefix_tokens: u32,
    /// In-flight requests at which the preferred instance is always skipped (an upper
    /// bound; saturation is otherwise judged against the fleet's load); 0 = none.
    #[arg(long, default_value_t = 0)]
    pub concurrency_threshold: u32,
    /// kv-aware sampling temperature; 0 = always the lowest estimate.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Block size of synthetic workloads, tokens (traces bring their own).
    #[arg(long, default_value_t = 64)]
    pub block_tokens: u32,
    /// Requests of a synthetic workload.
    #[arg(long, default_value_t = 3000)]
    pub requests: u32,
    /// Arrival rate of a synthetic workload, requests/s.
    #[arg(long, default_value_t = 15.0)]
    pub rate: f64,
    /// Tenants of a synthetic workload (same content, separate keys).
    #[arg(long, default_value_t = 1)]
    pub tenants: u32,
    /// Longest prompt accepted, tokens.
    #[arg(long, default_value_t = 262_144)]
    pub max_prompt_tokens: u32,
    /// Skip malformed trace lines (and count them) instead of failing.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Also write an HTML report with plots (hit rate per policy and tier, TTFT CDFs,
    /// each instance's load over time) to DIR/report.html.
    #[arg(long, value_name = "DIR")]
    pub report: Option<PathBuf>,
    /// A fault to play, repeatable (times from the first arrival; durations in s or ms):
    /// `agents-lost@60s:0.125[:for=30s][:expiry=3s][:resync=0.63s]` (a rack: the agents of
    /// the first 12.5% of the hosts die; back after `for`), `router-restart@60s[:router=N]
    /// [:catch-up=0.8s][:resync=0.63s]` (default: the last router),
    /// `partition@60s:0.25:for=5s[:catch-up=1s]` (the last quarter of the routers cut off).
    /// Each policy also runs without the faults, to compare.
    #[arg(long = "fault", value_name = "FAULT")]
    pub faults: Vec<Fault>,
    /// Record the hit rate over time in windows of this many ms (`timeline` in --json);
    /// with --fault, on at 1000 ms unless given.
    #[arg(long)]
    pub timeline_ms: Option<f64>,
}

/// Everything `simulate --json` prints.
#[derive(Serialize, Debug)]
pub struct SimulationOutput {
    pub workload: WorkloadSummary,
    pub cluster: ClusterSummary,
    pub bounds: Bounds,
    pub runs: Vec<RunReport>,
    /// With L1 or L2 on: the same runs without tiers, in the same order, to show what the
    /// tiers buy (empty without tiers).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs_without_tiers: Vec<RunReport>,
    /// With faults: the same runs without them, in the same order (empty without faults).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs_without_faults: Vec<RunReport>,
}

#[derive(Serialize, Debug)]
pub struct WorkloadSummary {
    pub name: String,
    pub block_tokens: u32,
    pub skipped_lines: usize,
    #[serde(flatten)]
    pub stats: WorkloadStats,
    /// Distinct prompt tokens in complete blocks: what all caches would need to hold.
    pub working_set_tokens: u64,
}

#[derive(Serialize, Debug)]
pub struct ClusterSummary {
    pub instances: u32,
    pub routers: u32,
    pub sharing: Sharing,
    pub agent_feed_ms: Option<f64>,
    /// Routers following each agent; None: all.
    pub residency_followers: Option<u32>,
    /// Agents report one key in this many at a chain's start (1: every block).
    pub residency_report_every: u32,
    pub gpu_kv_tokens_per_instance: u64,
    pub l1_kv_tokens_per_host: u64,
    pub l2_kv_tokens: u64,
    /// Computed blocks stored in L2 at once (`--l2-write-through`); absent when not.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub l2_write_through: bool,
    /// The fleet's GPU capacity over the working set.
    pub gpu_capacity_over_working_set: f64,
    pub profile: String,
    pub prefix_tokens: u32,
    pub concurrency_threshold: u32,
    pub seed: u64,
    /// The faults played, as given.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<Fault>,
}

#[derive(Serialize, Debug)]
pub struct Bounds {
    /// Infinite cache, no routing loss.
    pub ideal_hit_rate: f64,
    /// One LRU cache with the fleet's whole GPU capacity.
    pub pooled_hit_rate: f64,
}

/// Parses `--policy` values.
pub fn parse_policies(names: &[String]) -> Result<Vec<Strategy>> {
    let mut out = Vec::new();
    for n in names {
        if n == "all" {
            out.extend(Strategy::ALL);
        } else {
            out.push(n.parse::<Strategy>()?);
        }
    }
    out.dedup();
    Ok(out)
}

/// Loads the workload the arguments name.
pub fn load_workload(args: &SimulateArgs) -> Result<(Workload, usize)> {
    if let Some(path) = &args.trace {
        let opts = ReadOptions {
            skip_bad_lines: args.skip_bad_lines,
            max_prompt_tokens: Some(args.max_prompt_tokens),
        };
        let (w, report) = mooncake::read_mooncake(path, &opts)?;
        return Ok((w, report.skipped));
    }
    let name = args
        .workload
        .as_deref()
        .context("give --trace PATH or --workload NAME")?;
    let kind: SyntheticKind = name.parse()?;
    if args.block_tokens == 0 {
        bail!("--block-tokens must be at least 1");
    }
    let params = SyntheticParams {
        rate_per_s: args.rate,
        requests: args.requests,
        tenants: args.tenants.max(1),
        seed: args.seed,
        ..SyntheticParams::default()
    };
    params.validate()?;
    Ok((generate_workload(kind, &params, args.block_tokens), 0))
}

/// Runs the simulation the arguments describe.
pub fn execute(args: &SimulateArgs, show_progress: bool) -> Result<SimulationOutput> {
    let strategies = parse_policies(&args.policy)?;
    if args.instances == 0 {
        bail!("--instances must be at least 1");
    }
    if args.routers == 0 {
        bail!("--routers must be at least 1");
    }
    let profile = profiles::builtin(&args.profile)?;
    let (workload, skipped) = load_workload(args)?;
    if workload.requests.is_empty() {
        bail!("the workload {} has no requests", workload.name);
    }
    let bt = workload.block_tokens;
    let gpu_blocks = u32::try_from(args.gpu_kv_tokens / u64::from(bt))
        .context("--gpu-kv-tokens is too large")?;
    if gpu_blocks == 0 {
        bail!(
            "--gpu-kv-tokens {} holds no {bt}-token block",
            args.gpu_kv_tokens
        );
    }
    if args.l2_write_through && args.l2_kv_tokens == 0 {
        bail!("--l2-write-through writes to L2: give --l2-kv-tokens");
    }
    let stats = workload.stats();
    let working_set_tokens = stats.unique_blocks * u64::from(bt);
    let sharing = match args.sharing {
        SharingArg::Isolated => Sharing::Isolated,
        SharingArg::Perfect => Sharing::Perfect,
        SharingArg::Delayed => Sharing::Delayed((args.share_delay_ms * 1e3) as u64),
    };
    let agent_feed_delay_us = (!args.no_agent_feed).then_some((args.agent_feed_ms * 1e3) as u64);
    let engine = EngineConfig {
        block_tokens: bt,
        gpu_blocks,
        l1_blocks: args.l1_kv_tokens / u64::from(bt),
        offload_to_l2: args.l2_kv_tokens > 0,
        l2_write_through: args.l2_write_through,
        async_loads: !args.blocking_loads,
        ..EngineConfig::default()
    };
    let tiered = engine.l1_blocks > 0 || engine.offload_to_l2;
    let timeline_ms = match args.timeline_ms {
        Some(ms) if ms.is_finite() && ms >= 1.0 => Some(ms),
        Some(ms) => bail!("--timeline-ms must be at least 1 ms, got {ms}"),
        None => (!args.faults.is_empty()).then_some(1000.0),
    };
    let index = IndexConfig {
        report_every: args.residency_report_every,
        ..IndexConfig::default()
    };
    let configs: Vec<ClusterConfig> = strategies
        .iter()
        .map(|&s| ClusterConfig {
            instances: args.instances,
            routers: args.routers,
            sharing,
            agent_feed_delay_us,
            residency_followers: args.residency_followers,
            engine: engine.clone(),
            profile: profile.clone(),
            gossip_budget_keys_per_s: args.gossip_budget_keys,
            policy: PolicyConfig {
                prefix_blocks: args.prefix_tokens.div_ceil(bt),
                concurrency_threshold: args.concurrency_threshold,
                temperature: args.temperature,
                ..PolicyConfig::new(s, bt)
            },
            index,
            l2_blocks: args.l2_kv_tokens / u64::from(bt),
            max_prompt_tokens: args.max_prompt_tokens,
            seed: args.seed,
            prefetch: !args.no_prefetch,
            faults: args.faults.clone(),
            timeline_us: timeline_ms.map(|ms| (ms * 1e3) as u64),
        })
        .collect();
    // With tiers, each policy also runs without them, in the same batch.
    let mut all = configs.clone();
    if tiered {
        all.extend(configs.iter().map(|c| ClusterConfig {
            engine: EngineConfig {
                l1_blocks: 0,
                offload_to_l2: false,
                ..c.engine.clone()
            },
            l2_blocks: 0,
            ..c.clone()
        }));
    }
    // With faults, each policy also runs without them.
    let faulted = !args.faults.is_empty();
    if faulted {
        all.extend(configs.iter().map(|c| ClusterConfig {
            faults: Vec::new(),
            ..c.clone()
        }));
    }
    let mut runs = run_all(&all, &workload, show_progress)?;
    let runs_without_faults = if faulted {
        runs.split_off(runs.len() - configs.len())
    } else {
        Vec::new()
    };
    let runs_without_tiers = runs.split_off(configs.len());
    // Each fault's cost against the same run without the faults.
    for (with, without) in runs.iter_mut().zip(&runs_without_faults) {
        if let (Some(t), Some(b)) = (&with.timeline, &without.timeline) {
            with.faults = args
                .faults
                .iter()
                .map(|f| summarize(f, t, Some(b)))
                .collect();
        }
    }
    let fleet_blocks = u64::from(gpu_blocks) * u64::from(args.instances);
    Ok(SimulationOutput {
        bounds: Bounds {
            ideal_hit_rate: ideal_hit_rate(&workload),
            pooled_hit_rate: pooled_hit_rate(&workload, fleet_blocks),
        },
        cluster: ClusterSummary {
            instances: args.instances,
            routers: args.routers,
            sharing,
            agent_feed_ms: (!args.no_agent_feed).then_some(args.agent_feed_ms),
            residency_followers: args.residency_followers,
            residency_report_every: index.reporting(bt).base(),
            gpu_kv_tokens_per_instance: u64::from(gpu_blocks) * u64::from(bt),
            l1_kv_tokens_per_host: args.l1_kv_tokens,
            l2_kv_tokens: args.l2_kv_tokens,
            l2_write_through: args.l2_write_through,
            gpu_capacity_over_working_set: (fleet_blocks * u64::from(bt)) as f64
                / working_set_tokens.max(1) as f64,
            profile: profile.name.clone(),
            prefix_tokens: args.prefix_tokens,
            concurrency_threshold: args.concurrency_threshold,
            seed: args.seed,
            faults: args.faults.clone(),
        },
        workload: WorkloadSummary {
            name: workload.name.clone(),
            block_tokens: bt,
            skipped_lines: skipped,
            stats,
            working_set_tokens,
        },
        runs,
        runs_without_tiers,
        runs_without_faults,
    })
}

/// Runs every configuration, in parallel on the available cores, in a fixed output order.
fn run_all(
    configs: &[ClusterConfig],
    workload: &Workload,
    show_progress: bool,
) -> Result<Vec<RunReport>> {
    let total = workload.requests.len() as u64 * configs.len() as u64;
    let done: Vec<AtomicU64> = configs.iter().map(|_| AtomicU64::new(0)).collect();
    let started = Instant::now();
    // Progress bar on stderr for runs longer than a couple of seconds.
    let mut shown = false;
    let outcomes = on_every_cpu(
        configs,
        |i, config| {
            let mut progress = |p: Progress| done[i].store(p.done, Ordering::Relaxed);
            simulate(config, workload, &mut progress)
        },
        || {
            if show_progress && started.elapsed() > Duration::from_secs(2) {
                let d: u64 = done.iter().map(|d| d.load(Ordering::Relaxed)).sum();
                draw_progress(d, total, started.elapsed());
                shown = true;
            }
        },
    );
    if shown {
        eprint!("\r{:78}\r", "");
    }
    let mut reports = Vec::with_capacity(outcomes.len());
    for outcome in outcomes {
        match outcome {
            Ok(r) => reports.push(r),
            Err(e) => bail!(e.to_string()),
        }
    }
    Ok(reports)
}

/// Runs `f` on each of `items` (with its position) on as many threads as there are CPUs,
/// at most one per item, calling `tick` on this thread every 100 ms while any runs; the
/// results come back in the items' order. A panic in `f` is a panic here once every
/// thread has ended.
pub fn on_every_cpu<T: Sync, R: Send>(
    items: &[T],
    f: impl Fn(usize, &T) -> R + Sync,
    mut tick: impl FnMut(),
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new(items.iter().map(|_| None).collect());
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len())
        .max(1);
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let r = f(i, item);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                })
            })
            .collect();
        while threads.iter().any(|t| !t.is_finished()) {
            std::thread::sleep(Duration::from_millis(100));
            tick();
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.expect("every item ran: a thread that panicked ends the scope in a panic"))
        .collect()
}

fn draw_progress(done: u64, total: u64, elapsed: Duration) {
    let frac = if total == 0 {
        1.0
    } else {
        done as f64 / total as f64
    };
    let width = 40;
    let filled = (frac * width as f64) as usize;
    eprint!(
        "\r[{}{}] {:5.1}% {done}/{total} requests, {:.0}s",
        "#".repeat(filled),
        "-".repeat(width - filled),
        frac * 100.0,
        elapsed.as_secs_f64()
    );
    let _ = std::io::stderr().flush();
}

/// How L2 is filled, after its size: nothing when it takes what L1 evicts (the default).
fn write_through(c: &ClusterSummary) -> &'static str {
    if c.l2_write_through {
        " (computed blocks written through)"
    } else {
        ""
    }
}

/// Renders the comparison table.
pub fn render_table(out: &SimulationOutput) -> String {
    let w = &out.workload;
    let c = &out.cluster;
    let mut s = String::new();
    s += &format!(
        "workload {}: {} requests over {:.0} s, mean prompt {:.0} tokens, {}-token blocks, working set {} tokens{}\n",
        w.name,
        w.stats.requests,
        w.stats.duration_us as f64 / 1e6,
        w.stats.mean_prompt_tokens,
        w.block_tokens,
        w.working_set_tokens,
        if w.skipped_lines > 0 { format!(", {} bad lines skipped", w.skipped_lines) } else { String::new() }
    );
    s += &format!(
        "cluster: {} instances × {} GPU KV tokens ({:.0}% of the working set), L1 {} tokens/host, L2 {} tokens{}; {} router(s), sharing {}, agent feed {}; profile {}, threshold {}, seed {}\n",
        c.instances,
        c.gpu_kv_tokens_per_instance,
        c.gpu_capacity_over_working_set * 100.0,
        c.l1_kv_tokens_per_host,
        c.l2_kv_tokens,
        write_through(c),
        c.routers,
        match c.sharing {
            Sharing::Isolated => "isolated".to_string(),
            Sharing::Perfect => "perfect".to_string(),
            Sharing::Delayed(us) => format!("after {} ms", us as f64 / 1e3),
        },
        match (c.agent_feed_ms, c.residency_followers) {
            (None, _) => "off".to_string(),
            (Some(ms), None) => format!("{ms} ms, 1 key in {}", c.residency_report_every),
            (Some(ms), Some(f)) => format!(
                "{ms} ms, 1 key in {}, {f} router(s) per agent",
                c.residency_report_every
            ),
        },
        c.profile,
        c.concurrency_threshold,
        c.seed,
    );
    s += &format!(
        "bounds: ideal hit rate {:.1}% (infinite cache), pooled {:.1}% (one LRU cache of the fleet's GPU capacity)\n\n",
        out.bounds.ideal_hit_rate * 100.0,
        out.bounds.pooled_hit_rate * 100.0
    );
    s += &format!(
        "{:<13} {:>6} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>7} {:>9} {:>6} {:>7} {:>8}\n",
        "policy", "hit%", "gpu%", "l1%", "l2%", "ttft p50", "ttft p90", "ttft p99", "itl p50", "itl p99", "e2e p50", "req/s", "tok/s", "imbal", "ttft/rr", "prefill"
    );
    let rr = out
        .runs
        .iter()
        .find(|r| r.policy == "round-robin")
        .map(|r| r.ttft_ms_p50);
    for r in &out.runs {
        s += &format!(
            "{:<13} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>9.1} {:>9.1} {:>9.1} {:>8.1} {:>8.1} {:>9.1} {:>7.2} {:>9.0} {:>6.2} {:>7} {:>8.3}\n",
            r.policy,
            r.hit_rate * 100.0,
            r.hit_rate_gpu * 100.0,
            r.hit_rate_l1 * 100.0,
            r.hit_rate_l2 * 100.0,
            r.ttft_ms_p50,
            r.ttft_ms_p90,
            r.ttft_ms_p99,
            r.itl_ms_p50,
            r.itl_ms_p99,
            r.e2e_ms_p50,
            r.throughput_rps,
            r.throughput_tokens_per_s,
            r.imbalance,
            rr.filter(|v| *v > 0.0).map_or("-".to_string(), |v| format!("{:.2}x", r.ttft_ms_p50 / v)),
            r.prefill_gpu_s_per_request,
        );
        if r.rejected > 0 {
            s += &format!(
                "  ({} requests rejected: prompt larger than an instance's GPU cache)\n",
                r.rejected
            );
        }
    }
    s +=
        "times in ms; hit% is token-weighted over all tiers; imbal = max/mean instance busy time; \
          prefill = prefill GPU-seconds per request\n";
    s += &follow_ups_table(&out.runs, &out.runs_without_tiers);
    if !out.runs_without_tiers.is_empty() {
        s += &tiers_table(&out.runs, &out.runs_without_tiers);
        s += &by_source_table(&out.runs, &out.runs_without_tiers);
    }
    if !out.runs_without_faults.is_empty() {
        s += &faults_table(&out.runs);
    }
    s
}

/// What each fault cost each policy: the hit rate before it, its dip, how long until it was
/// back, and the hit rate over that span against the same run without the faults.
fn faults_table(with: &[RunReport]) -> String {
    let pct = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{:.1}%", x * 100.0));
    let window_s = with
        .iter()
        .find_map(|r| r.timeline.as_ref())
        .map_or(1.0, |t| t.window_us as f64 / 1e6);
    let mut s = format!(
        "\nfaults: hit rate of the requests by arrival time; before: the 30 s before the fault; \
         dip: the lowest {window_s} s window from the fault to 30 s after it is over; worst: the \
         largest shortfall of a window against the same run without the faults, in points; back: \
         until the rolling 5 s hit rate stays within 1 point of that run; during: the fault to \
         that (at least 5 s), with and without the faults\n"
    );
    s += &format!(
        "{:<13} {:<36} {:>7} {:>16} {:>16} {:>8} {:>7} {:>7} {:>8} {:>7}\n",
        "policy",
        "fault",
        "before",
        "dip (after)",
        "worst (after)",
        "back",
        "span",
        "during",
        "without",
        "cost"
    );
    for r in with {
        for f in &r.faults {
            let cost = match (f.during, f.without_during) {
                (Some(a), Some(b)) => format!("{:.1} pt", (b - a) * 100.0),
                _ => "-".to_string(),
            };
            s += &format!(
                "{:<13} {:<36} {:>7} {:>16} {:>16} {:>8} {:>7} {:>7} {:>8} {:>7}\n",
                r.policy,
                f.fault,
                pct(f.before),
                format!(
                    "{} ({})",
                    pct(f.dip),
                    f.dip_at_s.map_or("-".to_string(), |t| format!("+{t:.0} s"))
                ),
                match (f.worst, f.worst_at_s) {
                    (Some(d), Some(t)) => format!("{:.1} pt (+{t:.0} s)", d * 100.0),
                    _ => "-".to_string(),
                },
                f.recovered_after_s
                    .map_or("not yet".to_string(), |t| format!("{t:.0} s")),
                format!("{:.0} s", f.span_s),
                pct(f.during),
                pct(f.without_during),
                cost,
            );
        }
    }
    s
}

/// Turn over turn: how much of the context follow-up turns inherit was found cached, per
/// policy (and without tiers, when those runs were made). Empty when no request follows
/// another.
fn follow_ups_table(with: &[RunReport], without: &[RunReport]) -> String {
    let Some(first) = with.first().filter(|r| r.follow_ups.requests > 0) else {
        return String::new();
    };
    let f = &first.follow_ups;
    let mut s = format!(
        "\nfollow-up turns: {} requests, {:.0} tokens of inherited context each on average; share of it found cached:\n",
        f.requests,
        f.context_tokens as f64 / f.requests as f64
    );
    s += &format!(
        "{:<13} {:>7} {:>6} {:>6} {:>6}{}\n",
        "policy",
        "cached%",
        "gpu%",
        "l1%",
        "l2%",
        if without.is_empty() {
            ""
        } else {
            "  cached% without tiers"
        }
    );
    for (i, r) in with.iter().enumerate() {
        let f = &r.follow_ups;
        s += &format!(
            "{:<13} {:>7.1} {:>6.1} {:>6.1} {:>6.1}{}\n",
            r.policy,
            f.hit_rate * 100.0,
            f.hit_rate_gpu * 100.0,
            f.hit_rate_l1 * 100.0,
            f.hit_rate_l2 * 100.0,
            without.get(i).map_or(String::new(), |n| format!(
                "  {:>22.1}",
                n.follow_ups.hit_rate * 100.0
            )),
        );
    }
    s
}

/// What the tiers buy: each policy with tiers over the same policy without them.
fn tiers_table(with: &[RunReport], without: &[RunReport]) -> String {
    use crate::report::ratio;
    let mut s = String::from("\nwith tiers against the same runs without them:\n");
    s += &format!(
        "{:<13} {:>11} {:>9} {:>9} {:>9} {:>15} {:>7}\n",
        "policy", "hit% no→on", "ttft p50", "ttft p90", "ttft p99", "prefill no→on", "saved"
    );
    for (t, n) in with.iter().zip(without) {
        let saved = if n.prefill_gpu_s_per_request > 0.0 {
            format!(
                "{:.0}%",
                (1.0 - t.prefill_gpu_s_per_request / n.prefill_gpu_s_per_request) * 100.0
            )
        } else {
            "-".to_string()
        };
        s += &format!(
            "{:<13} {:>5.1}→{:<5.1} {:>9} {:>9} {:>9} {:>7.3}→{:<7.3} {:>7}\n",
            t.policy,
            n.hit_rate * 100.0,
            t.hit_rate * 100.0,
            ratio(t.ttft_ms_p50, n.ttft_ms_p50),
            ratio(t.ttft_ms_p90, n.ttft_ms_p90),
            ratio(t.ttft_ms_p99, n.ttft_ms_p99),
            n.prefill_gpu_s_per_request,
            t.prefill_gpu_s_per_request,
            saved,
        );
    }
    s += "ttft columns: with tiers over without (below 1.00x is faster); saved = prefill \
          GPU-seconds the tiers save\n";
    s
}

/// TTFT by where each request's prompt was found (`RunReport::ttft_by_source`), without
/// tiers and with them: which requests the tiers sped up, and which they could not.
fn by_source_table(with: &[RunReport], without: &[RunReport]) -> String {
    use warmpath_sim::cluster::TtftPart;
    let cell = |n: &TtftPart, t: &TtftPart, nt: u64, tt: u64| {
        let share = |p: &TtftPart, total: u64| p.requests as f64 * 100.0 / total.max(1) as f64;
        let p50 = |p: &TtftPart| {
            if p.requests == 0 {
                "-".to_string()
            } else {
                format!("{:.0}", p.ttft_ms_p50)
            }
        };
        format!(
            "{:.0}%→{:.0}% {}→{}",
            share(n, nt),
            share(t, tt),
            p50(n),
            p50(t)
        )
    };
    let mut s = format!(
        "\nttft by where the prompt was found (share of requests, p50 in ms), without tiers → with: \
         gpu = at most {:.0}% computed, the rest on the GPU; l1/l2 = at most that computed, more \
         loaded; computed = more computed\n",
        warmpath_sim::cluster::COMPUTED_SHARE * 100.0
    );
    s += &format!(
        "{:<13} {:>24} {:>24} {:>24}\n",
        "policy", "gpu", "l1/l2", "computed"
    );
    for (t, n) in with.iter().zip(without) {
        let (tp, np) = (t.ttft_by_source.parts(), n.ttft_by_source.parts());
        let total = |ps: &[&TtftPart; 3]| ps.iter().map(|p| p.requests).sum::<u64>();
        let (tt, nt) = (total(&tp), total(&np));
        s += &format!(
            "{:<13} {:>24} {:>24} {:>24}\n",
            t.policy,
            cell(np[0], tp[0], nt, tt),
            cell(np[1], tp[1], nt, tt),
            cell(np[2], tp[2], nt, tt)
        );
    }
    s
}

pub fn run(args: SimulateArgs) -> Result<()> {
    if let Some(dir) = &args.report {
        crate::report::prepare(dir)?;
    }
    let out = execute(&args, std::io::stderr().is_terminal())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", render_table(&out));
    }
    if let Some(dir) = &args.report {
        let path = write_report(dir, &out)?;
        eprintln!("report: {}", path.display());
    }
    Ok(())
}

/// Writes `simulate --report DIR`: the runs' hit rates per tier, TTFT CDFs and each
/// instance's requests in flight over simulated time.
pub fn write_report(dir: &std::path::Path, out: &SimulationOutput) -> Result<PathBuf> {
    use crate::report;
    let w = &out.workload;
    let c = &out.cluster;
    let conditions = vec![
        (
            "workload".to_string(),
            format!(
                "{}: {} requests over {:.0} s, mean prompt {:.0} tokens, {}-token blocks",
                w.name,
                w.stats.requests,
                w.stats.duration_us as f64 / 1e6,
                w.stats.mean_prompt_tokens,
                w.block_tokens
            ),
        ),
        (
            "cluster".to_string(),
            format!(
                "{} instances × {} GPU KV tokens ({:.0}% of the working set), L1 {} tokens/host, \
                 L2 {} tokens{}, {} router(s)",
                c.instances,
                c.gpu_kv_tokens_per_instance,
                c.gpu_capacity_over_working_set * 100.0,
                c.l1_kv_tokens_per_host,
                c.l2_kv_tokens,
                write_through(c),
                c.routers
            ),
        ),
        (
            "bounds".to_string(),
            format!(
                "ideal hit rate {:.1}% (infinite cache), pooled {:.1}% (one LRU of the fleet's GPU memory)",
                out.bounds.ideal_hit_rate * 100.0,
                out.bounds.pooled_hit_rate * 100.0
            ),
        ),
        ("seed".to_string(), c.seed.to_string()),
        (
            "made by".to_string(),
            format!("warmpath {} simulate (a discrete-event simulation: same seed, same report)", env!("CARGO_PKG_VERSION")),
        ),
    ];
    let runs: Vec<report::Run> = out
        .runs
        .iter()
        .map(|r| report::Run {
            policy: r.policy.clone(),
            tiers: [r.hit_rate_gpu, r.hit_rate_l1, r.hit_rate_l2],
            ttft_cdf_ms: r.curves.ttft_cdf_ms.clone(),
            load: r
                .curves
                .load
                .iter()
                .map(|(t, v)| (*t, v.iter().map(|n| f64::from(*n)).collect()))
                .collect(),
        })
        .collect();
    let figures = report::figures(
        &runs,
        &report::Provenance {
            hit_rates: "token-weighted over the run".into(),
            ttft: "simulated ms".into(),
            ttft_axis: "TTFT (ms)".into(),
            load: "over simulated time".into(),
        },
    )?;
    report::write(
        dir,
        &format!("warmpath simulate: {}", w.name),
        &conditions,
        &render_table(out),
        &figures,
    )
}
