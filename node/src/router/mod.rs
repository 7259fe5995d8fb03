//! `warmpath router`: the OpenAI-compatible gateway.
//!
//! [`serve`] takes an already bound listener and a shutdown future, so tests start whole
//! routers on port 0 and stop them cleanly. The request path is in [`proxy`], the
//! routing state in [`state`], configuration in [`config`].

pub mod config;
pub mod proxy;
pub mod state;

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use config::{FileConfig, PoolSection, RouterConfig, TenantSection};
use proxy::App;
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
}

impl RouterArgs {
    /// The validated configuration: the file's, with flags layered on top.
    pub fn resolve(&self) -> Result<RouterConfig> {
        let mut file = match &self.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::parse("version = 1")?,
        };
        if let Some(listen) = &self.listen {
            file.router.listen = listen.clone();
        }
        if !self.instances.is_empty() {
            file.pools.push(PoolSection {
                model: self.model.clone(),
                instances: self.instances.clone(),
            });
        }
        if self.strategy.is_some()
            || self.concurrency_threshold.is_some()
            || self.prefix_length.is_some()
        {
            let id = file.router.default_tenant.clone();
            if !file.tenants.iter().any(|t| t.id == id) {
                file.tenants.push(TenantSection {
                    id: id.clone(),
                    api_keys: Vec::new(),
                    api_key_hashes: Vec::new(),
                    strategy: "prefix-aware".into(),
                    prefix_length: 0,
                    concurrency_threshold: 32,
                    block_tokens: 64,
                    temperature: 0.0,
                    cache_salt: None,
                });
            }
            let t = file
                .tenants
                .iter_mut()
                .find(|t| t.id == id)
                .expect("just ensured");
            if let Some(s) = &self.strategy {
                t.strategy = s.clone();
            }
            if let Some(c) = self.concurrency_threshold {
                t.concurrency_threshold = c;
            }
            if let Some(p) = self.prefix_length {
                t.prefix_length = p;
            }
        }
        file.validate()
    }
}

/// Prometheus recorder for this process (installed once).
pub fn metrics_handle() -> metrics_exporter_prometheus::PrometheusHandle {
    describe_metrics();
    use std::sync::OnceLock;
    static HANDLE: OnceLock<metrics_exporter_prometheus::PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = metrics_exporter_prometheus::PrometheusBuilder::new();
            match builder.install_recorder() {
                Ok(h) => h,
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
        "warmpath_router_requests_total",
        "Requests answered by an instance, by tenant and status."
    );
    describe_counter!(
        "warmpath_router_errors_total",
        "Requests the router answered with an error, by status."
    );
    describe_counter!(
        "warmpath_router_upstream_failures_total",
        "Attempts that failed before the first response byte."
    );
    describe_counter!(
        "warmpath_router_stream_breaks_total",
        "Streams an instance broke off mid-way."
    );
    describe_histogram!(
        "warmpath_router_overhead_seconds",
        Unit::Seconds,
        "From request arrival to the upstream send: body read, parse, tokenize, hash, route."
    );
    describe_gauge!("warmpath_index_entries", "Blocks in the prefix index.");
    describe_gauge!(
        "warmpath_index_bytes_per_entry",
        Unit::Bytes,
        "Estimated index memory per block."
    );
    describe_gauge!(
        "warmpath_router_instance_healthy",
        "1 when the instance passed its last health check."
    );
    describe_gauge!(
        "warmpath_router_instance_in_flight",
        "Requests this router has in flight on the instance."
    );
}

/// The gateway's routes.
pub fn app(config: RouterConfig) -> Result<Arc<App>> {
    let profile = warmpath_sim::profiles::builtin(&config.profile)?;
    let core = state::RouterState::new(&config, profile);
    Ok(Arc::new(App::new(config, core, metrics_handle())))
}

fn routes(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat))
        .route("/v1/models", get(models))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        // The gateway applies its own body limit, with an OpenAI-style 413.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(app)
}

async fn models(State(app): State<Arc<App>>) -> impl IntoResponse {
    let models = app.core.lock().unwrap_or_else(|e| e.into_inner()).models();
    let data: Vec<_> = models
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "owned_by": "warmpath"}))
        .collect();
    Json(serde_json::json!({"object": "list", "data": data}))
}

async fn readyz(State(app): State<Arc<App>>) -> impl IntoResponse {
    if app
        .core
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .any_healthy()
    {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no healthy instance")
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> impl IntoResponse {
    {
        let core = app.core.lock().unwrap_or_else(|e| e.into_inner());
        let stats = core.index_stats();
        metrics::gauge!("warmpath_index_entries").set(stats.entries as f64);
        metrics::gauge!("warmpath_index_bytes_per_entry").set(stats.bytes_per_entry as f64);
        for (i, inst) in core.instances().iter().enumerate() {
            metrics::gauge!("warmpath_router_instance_healthy", "instance" => inst.url.clone())
                .set(if inst.healthy { 1.0 } else { 0.0 });
            metrics::gauge!("warmpath_router_instance_in_flight", "instance" => inst.url.clone())
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

/// Checks every instance's `/health` each interval and marks it up or down.
async fn health_loop(app: Arc<App>) {
    let mut tick = tokio::time::interval(app.config.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let urls: Vec<String> = app
            .core
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .instances()
            .iter()
            .map(|i| i.url.clone())
            .collect();
        let checks = urls.iter().enumerate().map(|(i, url)| {
            let app = app.clone();
            let url = format!("{url}/health");
            async move {
                let req = hyper::Request::get(url).body(http_body_util::Full::new(bytes::Bytes::new()));
                let ok = match req {
                    Ok(req) => matches!(
                        tokio::time::timeout(app.config.health_interval.max(Duration::from_millis(200)), app.client.request(req)).await,
                        Ok(Ok(r)) if r.status().is_success()
                    ),
                    Err(_) => false,
                };
                (i, ok)
            }
        });
        for (i, ok) in futures_util::future::join_all(checks).await {
            let mut core = app.core.lock().unwrap_or_else(|e| e.into_inner());
            let was = core.instances()[i].healthy;
            if was != ok {
                tracing::info!(instance = %core.instances()[i].url, healthy = ok, "instance health changed");
            }
            core.set_healthy(InstanceId(i as u32), ok);
        }
    }
}

/// Serves the gateway on `listener` until `shutdown` resolves, then drains open streams.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let health = tokio::spawn(health_loop(app.clone()));
    use axum::serve::ListenerExt;
    // Streamed tokens are small writes: never hold them back for Nagle's algorithm.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let result = axum::serve(listener, routes(app))
        .with_graceful_shutdown(shutdown)
        .await;
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
        let app = app(config)?;
        println!("warmpath router listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        serve(listener, app, crate::shutdown_signal()).await
    })
}
