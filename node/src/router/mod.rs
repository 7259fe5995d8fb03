//! `warmpath router`: the OpenAI-compatible gateway.
//!
//! [`serve`] takes an already bound listener and a shutdown future, so tests start whole
//! routers on port 0 and stop them cleanly. The request path is in [`proxy`], the shared
//! state it reads in [`app`], the tenant table in [`tenants`], the routing state in
//! [`state`], configuration in [`config`].

pub mod app;
pub mod cluster;
pub mod config;
pub mod engines;
pub mod listener;
pub mod proxy;
pub mod ratelimit;
pub mod residency;
pub mod state;
pub mod tenancy;
pub mod tenants;

use anyhow::{Context, Result};
use app::App;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use config::{FileConfig, PoolSection, RouterConfig, TenantSection};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use warmpath_index::InstanceId;

#[derive(Args, Debug, Clone)]
pub struct RouterArgs {
    /// Versioned TOML config file (see `node/src/router/config.rs`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on (overrides the file); port 0 picks a free port.
    #[arg(long)]
    pub listen: Option<String>,
    /// Serve `/metrics` on this address of its own (for Prometheus on a private network)
    /// instead of the client port.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// A cache-agent to learn residency from, over QUIC ([NAME@]HOST:PORT, NAME being the
    /// one in its certificate, HOST by default; `dns:` before it: every address HOST
    /// resolves to, each its own agent; repeatable); needs --tls-dir and --tls-name.
    #[arg(long = "residency-agent")]
    pub residency_agents: Vec<String>,
    /// Directory of the cluster's TLS files (`warmpath certs`): ca.pem, NAME.pem, NAME.key.
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// This process's name in --tls-dir.
    #[arg(long)]
    pub tls_name: Option<String>,
    /// An agent silent this long has its observed residency dropped, in ms.
    #[arg(long, default_value_t = 3000)]
    pub residency_expiry_ms: u64,
    /// Routers that follow each agent (decision 0105: the first F by rendezvous hashing
    /// over the live routers); 0: every router follows every agent.
    #[arg(long, default_value_t = residency::DEFAULT_FOLLOWERS)]
    pub residency_followers: usize,
    /// Model served by the `--instance` URLs (when no config file names pools).
    #[arg(long, default_value = "sim-llama")]
    pub model: String,
    /// Instance base URL, repeatable (adds a pool for `--model`).
    #[arg(long = "instance")]
    pub instances: Vec<String>,
    /// Strategy of the default tenant.
    #[arg(long)]
    pub strategy: Option<String>,
    /// Concurrency threshold of the default tenant.
    #[arg(long)]
    pub concurrency_threshold: Option<u32>,
    /// Prefix length (tokens) of the default tenant.
    #[arg(long)]
    pub prefix_length: Option<u32>,
    /// Answer `x-warmpath-explain: 1` for the default tenant (explanations name instances
    /// and their loads; off by default).
    #[arg(long)]
    pub allow_explain: bool,
    /// This router's node id in a cluster of replicas (turns gossip on).
    #[arg(long, requires = "gossip_listen")]
    pub node_id: Option<String>,
    /// UDP address for gossip with the other replicas; port 0 picks a free one.
    #[arg(long, requires = "node_id")]
    pub gossip_listen: Option<String>,
    /// Gossip address of another replica to join through, repeatable.
    #[arg(long = "seed")]
    pub seeds: Vec<String>,
    /// File with the cluster secret that authenticates gossip (the same on every router);
    /// required when gossip listens beyond loopback.
    #[arg(long)]
    pub gossip_secret_file: Option<String>,
    /// Gossip without a secret on a non-loopback address. Anyone who can send UDP there
    /// can join and steer routing: never on a shared network.
    #[arg(long)]
    pub insecure_gossip_without_secret: bool,
    /// Raft node id: turns on tenant configuration in Raft and the admin API.
    #[arg(long, requires_all = ["raft_dir", "admin_listen", "admin_token_file"])]
    pub raft_node_id: Option<u64>,
    /// Directory of this router's Raft log and snapshots.
    #[arg(long)]
    pub raft_dir: Option<String>,
    /// Address of the admin API and of Raft between routers.
    #[arg(long)]
    pub admin_listen: Option<String>,
    /// File holding the admin API's bearer token.
    #[arg(long)]
    pub admin_token_file: Option<String>,
    /// A Raft voter as `ID=http://host:port` (its admin address), repeatable.
    #[arg(long = "voter")]
    pub voters: Vec<String>,
    /// File holding the token routers send each other on Raft RPCs (the same on every
    /// router); required with Raft.
    #[arg(long)]
    pub raft_peer_token_file: Option<String>,
    /// Serve and send Raft RPCs without a peer token. Anyone who reaches an admin port
    /// can then rewrite the configuration: never on a shared network.
    #[arg(long)]
    pub insecure_raft_without_peer_token: bool,
    /// Serve `POST /debug/partition` and `/debug/heal` (cut this router's gossip off and
    /// back) and `/debug/route` (an explained dry run, unauthenticated), for fault tests.
    /// Never in production.
    #[arg(long)]
    pub fault_injection: bool,
}

impl RouterArgs {
    /// The validated configuration: the file's, with flags layered on top, one way. A flag
    /// sets what the file leaves out and overrides its plain settings (addresses, ids,
    /// voters). A security setting (a token or secret file, an insecure switch) is never
    /// dropped: one given by the file or a flag is kept whatever else the flags replace,
    /// the same one given twice differently is an error, and one given for a feature that
    /// is off is an error too.
    pub fn resolve(&self) -> Result<RouterConfig> {
        let mut file = match &self.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::parse("version = 1")?,
        };
        if let Some(listen) = &self.listen {
            file.router.listen = listen.clone();
        }
        if let Some(metrics) = &self.metrics_listen {
            file.router.metrics_listen = Some(metrics.clone());
        }
        if let (Some(node_id), Some(listen)) = (&self.node_id, &self.gossip_listen) {
            let section = file.cluster.get_or_insert_with(|| config::ClusterSection {
                node_id: node_id.clone(),
                gossip_listen: listen.clone(),
                seeds: Vec::new(),
                gossip_interval_ms: 50,
                secret_file: None,
                insecure_without_secret: false,
            });
            section.node_id = node_id.clone();
            section.gossip_listen = listen.clone();
        }
        if let (Some(id), Some(dir), Some(admin), Some(token)) = (
            self.raft_node_id,
            &self.raft_dir,
            &self.admin_listen,
            &self.admin_token_file,
        ) {
            let mut voters = std::collections::BTreeMap::new();
            for v in &self.voters {
                let (vid, url) = v
                    .split_once('=')
                    .with_context(|| format!("--voter {v:?}: expected ID=URL"))?;
                voters.insert(vid.to_string(), url.to_string());
            }
            let section = file.raft.get_or_insert_with(|| config::RaftSection {
                node_id: id,
                data_dir: dir.clone(),
                admin_listen: admin.clone(),
                admin_token_file: token.clone(),
                voters: voters.clone(),
                peer_token_file: None,
                insecure_without_peer_token: false,
            });
            section.node_id = id;
            section.data_dir = dir.clone();
            section.admin_listen = admin.clone();
            if !voters.is_empty() {
                section.voters = voters;
            }
            if section.admin_token_file != *token {
                anyhow::bail!(
                    "the admin token file is given twice, differently: {:?} in the config \
                     file and {token:?} by --admin-token-file; give it once",
                    section.admin_token_file
                );
            }
        }
        match &mut file.raft {
            Some(section) => {
                merge_security(
                    "the Raft peer token file (raft.peer_token_file, --raft-peer-token-file)",
                    &mut section.peer_token_file,
                    &self.raft_peer_token_file,
                )?;
                section.insecure_without_peer_token |= self.insecure_raft_without_peer_token;
            }
            None => {
                if self.raft_peer_token_file.is_some() || self.insecure_raft_without_peer_token {
                    anyhow::bail!(
                        "a Raft peer setting is given but Raft is off: add --raft-node-id, \
                         --raft-dir, --admin-listen and --admin-token-file (or a [raft] section)"
                    );
                }
            }
        }
        match &mut file.cluster {
            Some(section) => {
                section.seeds.extend(self.seeds.iter().cloned());
                merge_security(
                    "the gossip secret file (cluster.secret_file, --gossip-secret-file)",
                    &mut section.secret_file,
                    &self.gossip_secret_file,
                )?;
                section.insecure_without_secret |= self.insecure_gossip_without_secret;
            }
            None => {
                if self.gossip_secret_file.is_some() || self.insecure_gossip_without_secret {
                    anyhow::bail!(
                        "a gossip security setting is given but gossip is off: add --node-id \
                         and --gossip-listen (or a [cluster] section)"
                    );
                }
            }
        }
        if !self.instances.is_empty() {
            file.pools.push(PoolSection {
                model: self.model.clone(),
                instances: self.instances.clone(),
                ..PoolSection::default()
            });
        }
        if self.strategy.is_some()
            || self.concurrency_threshold.is_some()
            || self.prefix_length.is_some()
            || self.allow_explain
        {
            let id = file.router.default_tenant.clone();
            if !file.tenants.iter().any(|t| t.id == id) {
                file.tenants.push(TenantSection::with_defaults(&id));
            }
            let t = file
                .tenants
                .iter_mut()
                .find(|t| t.id == id)
                .expect("just ensured");
            if let Some(s) = &self.strategy {
                t.spec.strategy = s.clone();
            }
            if let Some(c) = self.concurrency_threshold {
                t.spec.concurrency_threshold = c;
            }
            if let Some(p) = self.prefix_length {
                t.spec.prefix_length = p;
            }
            t.spec.allow_explain |= self.allow_explain;
        }
        file.validate()
    }
}

/// A security setting given by the config file (`file`) and by a flag (`flag`): either alone
/// is kept (the flag's is written into `file`); both must agree.
fn merge_security(what: &str, file: &mut Option<String>, flag: &Option<String>) -> Result<()> {
    match (file.as_deref(), flag) {
        (Some(f), Some(g)) if f != g => anyhow::bail!(
            "{what} is given twice, differently: {f:?} in the config file and {g:?} by flag; \
             give it once"
        ),
        (_, Some(g)) => *file = Some(g.clone()),
        _ => {}
    }
    Ok(())
}

/// Prometheus recorder for this process (installed once).
pub fn metrics_handle() -> metrics_exporter_prometheus::PrometheusHandle {
    describe_metrics();
    use std::sync::OnceLock;
    static HANDLE: OnceLock<metrics_exporter_prometheus::PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            // The cache-agent's operation times are Prometheus histograms (buckets from
            // 10 µs to 10 s), so that they aggregate across agents; the router's summaries
            // keep their quantiles.
            let builder = metrics_exporter_prometheus::PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Prefix("warmpath_agent_".into()),
                    &[
                        1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                        5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    ],
                )
                .unwrap_or_else(|_| metrics_exporter_prometheus::PrometheusBuilder::new());
            match builder.install_recorder() {
                Ok(h) => {
                    // Counters of rare events are exported from the start, at 0: their
                    // rates and alerts then work before the first event, and dashboards
                    // and rules can be checked against a fresh process.
                    for name in [
                        crate::metric_names::ROUTER_UPSTREAM_FAILURES_TOTAL,
                        crate::metric_names::ROUTER_STREAM_BREAKS_TOTAL,
                        crate::metric_names::ROUTER_PREDICTIONS_CONTRADICTED_TOTAL,
                        crate::metric_names::ROUTER_TENANT_STRATEGY_FALLBACKS_TOTAL,
                    ] {
                        metrics::counter!(name).increment(0);
                    }
                    h
                }
                Err(_) => metrics_exporter_prometheus::PrometheusBuilder::new()
                    .build_recorder()
                    .handle(),
            }
        })
        .clone()
}

/// Declares every router metric once, with its description and unit.
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        crate::metric_names::ROUTER_REQUESTS_TOTAL,
        "Requests answered by an instance, by tenant and status."
    );
    describe_counter!(
        crate::metric_names::ROUTER_ERRORS_TOTAL,
        "Requests the router answered with an error, by status."
    );
    describe_counter!(
        crate::metric_names::ROUTER_UPSTREAM_FAILURES_TOTAL,
        "Attempts that failed before the first response byte."
    );
    describe_counter!(
        crate::metric_names::ROUTER_STREAM_BREAKS_TOTAL,
        "Streams an instance broke off mid-way."
    );
    describe_counter!(
        crate::metric_names::ROUTER_DECISIONS_TOTAL,
        "Routing decisions (attempts) by reason: longest-prefix, spilled, no-match, all-saturated, lowest-cost, round-robin, least-loaded."
    );
    describe_counter!(
        crate::metric_names::ROUTER_TENANT_STRATEGY_FALLBACKS_TOTAL,
        "Tenants compiled with prefix-aware because their stored strategy is unknown to this build (a newer router's, during a rolling upgrade)."
    );
    describe_counter!(
        crate::metric_names::ROUTER_PROMPT_TOKENS_TOTAL,
        "Prompt tokens of answered requests as the engines counted them (usage), by tenant and strategy."
    );
    describe_counter!(
        crate::metric_names::ROUTER_CACHED_TOKENS_TOTAL,
        "Of those, tokens the engines found cached (usage.prompt_tokens_details.cached_tokens), by tenant and strategy: cached / prompt is the hit rate."
    );
    describe_counter!(
        crate::metric_names::ROUTER_PREDICTIONS_CONTRADICTED_TOTAL,
        "Answers whose usage reported fewer cached tokens than the routing prediction: the instance's older predictions were retired."
    );
    describe_histogram!(
        crate::metric_names::ROUTER_OVERHEAD_SECONDS,
        Unit::Seconds,
        "From request arrival to the upstream send: body read, parse, tokenize, hash, route."
    );
    describe_histogram!(
        crate::metric_names::ROUTER_TOKENIZE_SECONDS,
        Unit::Seconds,
        "Parsing a request body and tokenizing its prompt with the pool's tokenizer and chat template (part of the overhead)."
    );
    describe_gauge!(
        crate::metric_names::INDEX_ENTRIES,
        "Blocks in the prefix index."
    );
    describe_gauge!(
        crate::metric_names::INDEX_L2_BLOCKS,
        "Blocks the index knows in the global L2 (reported by agents)."
    );
    describe_gauge!(
        crate::metric_names::ROUTER_RESIDENCY_AGENTS,
        "Agent entries this router follows (flags and the pools' agents; a dns: entry counts once, however many agents it resolves to)."
    );
    describe_counter!(
        crate::metric_names::ROUTER_PREFETCHES_TOTAL,
        "Prefetch hints: a request went to an instance whose host held part of its prefix only in the global L2, and the router asked that host's agent to promote it into L1 (sent, no_agent: no followed agent reports the instance, dropped: the agent's link was down or behind)."
    );
    describe_gauge!(crate::metric_names::INDEX_HOLDERS, "(instance, block) pairs in the index, by source: predicted (routing decisions, own and peers') or observed (agents).");
    describe_gauge!(
        crate::metric_names::INDEX_BYTES_PER_ENTRY,
        Unit::Bytes,
        "Estimated index memory per block."
    );
    describe_gauge!(
        crate::metric_names::ROUTER_INSTANCE_HEALTHY,
        "1 when the instance passed its last health check."
    );
    describe_gauge!(
        crate::metric_names::ROUTER_INSTANCE_IN_FLIGHT,
        "Requests this router has in flight on the instance."
    );
}

/// The gateway's routes.
pub fn app(config: RouterConfig) -> Result<Arc<App>> {
    let profile = warmpath_index::profiles::builtin(&config.profile)?;
    let core = state::RouterState::new(&config, profile);
    Ok(Arc::new(App::new(config, core, metrics_handle())))
}

fn routes(app: Arc<App>, fault_injection: bool) -> Router {
    let router = if fault_injection {
        Router::new()
            .route("/debug/partition", post(partition))
            .route("/debug/heal", post(heal))
            .route("/debug/route", post(proxy::dry_run))
    } else {
        Router::new()
    };
    // /metrics names instances, their loads and tenants: on the client port only where
    // that port is private (loopback) or the operator said so (see RouterSection).
    let router = if app.config.client_metrics {
        router.route("/metrics", get(metrics_text))
    } else {
        router
    };
    router
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat))
        .route("/v1/models", get(models))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        // The gateway applies its own body limit, with an OpenAI-style 413.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(app)
}

/// Fault injection: drops all gossip to and from every peer this router knows.
async fn partition(State(app): State<Arc<App>>) -> impl IntoResponse {
    let Some(gossip) = app.gossip.get() else {
        return (
            StatusCode::CONFLICT,
            "this router runs alone: nothing to partition".to_string(),
        );
    };
    let mut addrs: Vec<std::net::SocketAddr> = gossip
        .live_peers()
        .await
        .into_iter()
        .map(|p| p.gossip_addr)
        .collect();
    if let Some(cluster) = &app.config.cluster {
        addrs.extend(
            cluster
                .seeds
                .iter()
                .filter_map(|s| s.parse::<std::net::SocketAddr>().ok()),
        );
    }
    gossip.block_peers(&addrs);
    tracing::warn!(peers = addrs.len(), "fault injection: gossip partitioned");
    (StatusCode::OK, format!("blocked {} peers", addrs.len()))
}

/// Fault injection: lifts [`partition`].
async fn heal(State(app): State<Arc<App>>) -> impl IntoResponse {
    match app.gossip.get() {
        Some(gossip) => {
            gossip.heal();
            tracing::warn!("fault injection: gossip healed");
            (StatusCode::OK, "healed")
        }
        None => (StatusCode::CONFLICT, "this router runs alone"),
    }
}

async fn models(State(app): State<Arc<App>>) -> impl IntoResponse {
    let models = app.core().models();
    let data: Vec<_> = models
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "owned_by": "warmpath"}))
        .collect();
    Json(serde_json::json!({"object": "list", "data": data}))
}

async fn readyz(State(app): State<Arc<App>>) -> impl IntoResponse {
    if let Some(why) = app.following.refusal() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not following the cluster's configuration: {why}"),
        );
    }
    if app.core().any_healthy() {
        (StatusCode::OK, "ready".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy instance".to_string(),
        )
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> impl IntoResponse {
    {
        let core = app.core();
        let stats = core.index_stats();
        metrics::gauge!(crate::metric_names::INDEX_ENTRIES).set(stats.entries as f64);
        metrics::gauge!(crate::metric_names::INDEX_BYTES_PER_ENTRY)
            .set(stats.bytes_per_entry as f64);
        metrics::gauge!(crate::metric_names::INDEX_HOLDERS, "source" => "predicted")
            .set(stats.predicted_holders as f64);
        metrics::gauge!(crate::metric_names::INDEX_HOLDERS, "source" => "observed")
            .set(stats.observed_holders as f64);
        metrics::gauge!(crate::metric_names::INDEX_L2_BLOCKS).set(stats.l2_blocks as f64);
        for (i, inst) in core.instances().iter().enumerate() {
            metrics::gauge!(crate::metric_names::ROUTER_INSTANCE_HEALTHY, "instance" => inst.name.clone())
                .set(if inst.healthy { 1.0 } else { 0.0 });
            metrics::gauge!(crate::metric_names::ROUTER_INSTANCE_CLUSTER_IN_FLIGHT, "instance" => inst.name.clone())
                .set(f64::from(core.cluster_in_flight(InstanceId(i as u32))));
            metrics::gauge!(crate::metric_names::ROUTER_INSTANCE_IN_FLIGHT, "instance" => inst.name.clone())
                .set(f64::from(core.in_flight(InstanceId(i as u32))));
        }
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        app.metrics.render(),
    )
}

/// How long a stopping leader waits for the voter it hands off to to lead.
const HAND_OFF_WITHIN: Duration = Duration::from_secs(2);
/// How long a stopping router lets open admin requests (writes waiting on Raft: at most
/// their 5 s deadline) finish.
const ADMIN_DRAIN: Duration = Duration::from_secs(6);

/// Consecutive health checks that must time out before an instance that answers nothing
/// is marked down. A refused connection or an error status marks it down at once; a check
/// that is only slow (a busy host, a router starved of CPU) is not proof of death, and
/// marking a live instance down ends the streams it is serving.
const SLOW_CHECKS_TO_DOWN: u32 = 3;

/// Checks every instance's `/health` each interval and marks it up or down; reads the
/// GPU KV capacity from an instance's `/metrics` while it is unknown, and again whenever
/// the instance comes back up (it may have restarted with another configuration).
async fn health_loop(app: Arc<App>) {
    let mut tick = tokio::time::interval(app.config.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = app.config.health_interval.max(Duration::from_millis(200));
    // Consecutive timed-out checks per instance index.
    let mut slow: Vec<u32> = Vec::new();
    loop {
        tick.tick().await;
        let urls: Vec<(InstanceId, String, bool)> = {
            let core = app.core();
            core.active_instances()
                .into_iter()
                .map(|(id, url)| {
                    let known = core.kv_capacity(id) > 0;
                    (id, url, known)
                })
                .collect()
        };
        let checks = urls.into_iter().map(|(id, url, known)| {
            let i = id.0 as usize;
            let app = app.clone();
            async move {
                let check = fetch(&app, &format!("{url}/health"), timeout).await;
                let timed_out = matches!(check, Fetched::TimedOut);
                let ok = matches!(check, Fetched::Answered(true, _));
                let capacity = if ok && !known {
                    match fetch(&app, &format!("{url}/metrics"), timeout).await {
                        Fetched::Answered(_, body) => {
                            engines::kv_capacity_tokens(&String::from_utf8_lossy(&body))
                        }
                        _ => None,
                    }
                } else {
                    None
                };
                (i, ok, timed_out, capacity)
            }
        });
        // Bounded: a pool of thousands of instances named by host name would otherwise
        // queue thousands of name lookups on the runtime's blocking pool at once.
        use futures_util::StreamExt;
        let results: Vec<_> = futures_util::stream::iter(checks)
            .buffer_unordered(HEALTH_CHECK_CONCURRENCY)
            .collect()
            .await;
        for (i, ok, timed_out, capacity) in results {
            if slow.len() <= i {
                slow.resize(i + 1, 0);
            }
            slow[i] = if timed_out { slow[i] + 1 } else { 0 };
            let mut core = app.core();
            let was = core.instances()[i].healthy;
            // Up stays up through fewer than SLOW_CHECKS_TO_DOWN slow checks in a row.
            let ok = ok || (was && timed_out && slow[i] < SLOW_CHECKS_TO_DOWN);
            if was != ok {
                tracing::info!(instance = %core.instances()[i].name, healthy = ok, "instance health changed");
            }
            let went_down = was && !ok;
            if ok && !was {
                // Back up, perhaps restarted: read its capacity again next time.
                core.set_kv_capacity(InstanceId(i as u32), 0);
            }
            if let Some(tokens) = capacity {
                core.set_kv_capacity(InstanceId(i as u32), tokens);
            }
            core.set_healthy(InstanceId(i as u32), ok);
            drop(core);
            if went_down {
                // Requests waiting on it fail over (or end their streams) now.
                app.downs.send_modify(|n| *n += 1);
            }
        }
    }
}

/// Health checks in flight at once.
const HEALTH_CHECK_CONCURRENCY: usize = 32;

/// What a GET of an instance's endpoint gave.
#[derive(Debug)]
enum Fetched {
    /// It answered: whether with 2xx, and the body (at most 1 MiB).
    Answered(bool, bytes::Bytes),
    /// No complete answer within the timeout.
    TimedOut,
    /// The connection or the request failed (refused, reset, a bad URL, an oversized body).
    Failed,
}

/// GET `url` within `timeout`.
async fn fetch(app: &App, url: &str, timeout: Duration) -> Fetched {
    use http_body_util::BodyExt;
    let Ok(req) = hyper::Request::get(url).body(http_body_util::Full::new(bytes::Bytes::new()))
    else {
        return Fetched::Failed;
    };
    let fetch = async {
        let Ok(resp) = app.client.request(req).await else {
            return Fetched::Failed;
        };
        let ok = resp.status().is_success();
        match http_body_util::Limited::new(resp.into_body(), 1 << 20)
            .collect()
            .await
        {
            Ok(body) => Fetched::Answered(ok, body.to_bytes()),
            Err(_) => Fetched::Failed,
        }
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .unwrap_or(Fetched::TimedOut)
}

/// Serves the gateway on `listener` until `shutdown` resolves, then drains open streams.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    fault_injection: bool,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let health = tokio::spawn(health_loop(app.clone()));
    let limits = listener::Limits {
        header_read_timeout: app.config.header_read_timeout,
        max_connections: app.config.max_connections,
    };
    let result = listener::serve(listener, routes(app, fault_injection), limits, shutdown).await;
    health.abort();
    result.context("router server failed")
}

/// `warmpath router`.
pub fn run(args: RouterArgs) -> Result<()> {
    let config = args.resolve()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = listener.local_addr()?;
        let cluster = config.cluster.clone();
        let decision_ttl = config.predicted_ttl;
        let app = app(config)?;
        println!("warmpath router listening on http://{addr}");
        let limits = listener::Limits {
            header_read_timeout: app.config.header_read_timeout,
            max_connections: app.config.max_connections,
        };
        let mut metrics_task = None;
        if let Some(at) = app.config.metrics_listen {
            let metrics_listener = tokio::net::TcpListener::bind(at)
                .await
                .with_context(|| format!("cannot listen on {at} (metrics)"))?;
            println!("warmpath router metrics on http://{}/metrics", metrics_listener.local_addr()?);
            let metrics_app = Router::new()
                .route("/metrics", get(metrics_text))
                .with_state(app.clone());
            metrics_task = Some(tokio::spawn(listener::serve(
                metrics_listener,
                metrics_app,
                limits,
                std::future::pending(),
            )));
        } else if !app.config.client_metrics {
            tracing::warn!("no /metrics: the client port is not on loopback; give --metrics-listen ADDR (or router.client_metrics = true)");
        }
        match (&args.tls_dir, &args.tls_name) {
            (Some(dir), Some(name)) => {
                let tls = warmpath_residency::tls::TlsFiles::in_dir(dir, name);
                let r = residency::Residency::start(
                    app.core.clone(),
                    &args.residency_agents,
                    &tls,
                    Duration::from_millis(args.residency_expiry_ms),
                    args.residency_followers,
                )?;
                let _ = app.residency.set(r);
            }
            (None, None) if args.residency_agents.is_empty() => {}
            _ => anyhow::bail!("residency needs both --tls-dir and --tls-name: it runs over mutual TLS only"),
        }
        app.configure_residency(&app.config.pools);
        let mut cluster_task = None;
        if let Some(settings) = cluster {
            let (gossip, gossip_addr) =
                cluster::start_gossip(&settings, &format!("http://{addr}"), decision_ttl).await?;
            if settings.secret.is_none() && !settings.gossip_listen.ip().is_loopback() {
                tracing::warn!(gossip = %settings.gossip_listen, "gossip runs WITHOUT a cluster secret (--insecure-gossip-without-secret): anyone who can send UDP there can join and steer routing");
            }
            println!(
                "warmpath router {} gossip on {gossip_addr}",
                settings.node_id
            );
            let _ = app.gossip.set(gossip.clone());
            cluster_task = Some(tokio::spawn(cluster::run(
                app.clone(),
                gossip,
                Duration::from_millis(25),
                Duration::from_millis(100),
            )));
        }
        let mut raft_tasks = Vec::new();
        let mut raft_node = None;
        // The admin server (and Raft's RPCs) drains after the client port, so that a
        // stopping leader can hand its leadership off first.
        let admin_stop = tokio::sync::watch::Sender::new(false);
        let mut admin_task = None;
        if let Some(settings) = app.config.raft.clone() {
            let admin_listener = tokio::net::TcpListener::bind(settings.admin_listen)
                .await
                .with_context(|| format!("cannot listen on {} (admin)", settings.admin_listen))?;
            let admin_addr = admin_listener.local_addr()?;
            let admin_url = format!("http://{admin_addr}");
            if settings.peer_token.is_none() {
                tracing::warn!("Raft RPCs run WITHOUT a peer token (--insecure-raft-without-peer-token): anyone who reaches {admin_url} can rewrite the configuration");
            }
            // Not following until Raft has heard its leader.
            app.following.refuse_quietly("raft is starting");
            let raft = tenancy::start(&settings, &admin_url).await?;
            println!(
                "warmpath router admin on {admin_url} (raft node {})",
                settings.node_id
            );
            let deps = Arc::new(crate::admin::AdminDeps {
                raft: raft.clone(),
                token_hash: tenancy::token_hash(&settings.admin_token),
                router: Arc::new(tenancy::Info { app: app.clone() }),
            });
            let admin_app = crate::admin::routes(deps).merge(raft.router());
            let mut stop = admin_stop.subscribe();
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            admin_task = Some(tokio::spawn(async move {
                let served = listener::serve(admin_listener, admin_app, limits, stopped).await;
                if let Err(error) = served {
                    tracing::error!(%error, "admin server failed");
                }
            }));
            raft_tasks.push(tokio::spawn(tenancy::watch_following(
                app.clone(),
                raft.clone(),
            )));
            raft_tasks.push(tokio::spawn(tenancy::follow(
                app.clone(),
                raft.clone(),
                app.config.default_tenant.clone(),
            )));
            if settings.voters.contains_key(&settings.node_id) {
                raft_tasks.push(tokio::spawn(tenancy::seed(
                    raft.clone(),
                    app.config.tenants.clone(),
                    app.config.pools.clone(),
                )));
            }
            raft_node = Some(raft);
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let result = serve(
            listener,
            app,
            args.fault_injection,
            crate::shutdown_signal(),
        )
        .await;
        if let Some(task) = cluster_task {
            task.abort();
        }
        if let Some(task) = metrics_task {
            task.abort();
        }
        if let Some(raft) = &raft_node {
            raft.hand_off(HAND_OFF_WITHIN).await;
        }
        admin_stop.send_replace(true);
        if let Some(task) = admin_task {
            if tokio::time::timeout(ADMIN_DRAIN, task).await.is_err() {
                tracing::warn!("admin requests still open after {ADMIN_DRAIN:?}: closing them");
            }
        }
        for task in raft_tasks {
            task.abort();
        }
        if let Some(raft) = raft_node {
            raft.shutdown().await;
        }
        result
    })
}
