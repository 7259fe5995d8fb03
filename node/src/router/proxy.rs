//! The gateway's request path: identify the tenant, parse and hash the prompt once, route,
//! forward with retries before the first response byte, and stream the answer back.
//!
//! Errors are classified once, at this edge ([`ProxyError::into_response`]): bad input is
//! 400 with a message saying what is wrong, an unknown model 404, a body over the limit
//! 413, no healthy instance 503 with `Retry-After`, an unreachable upstream 502, a
//! deadline 504. Every error body is OpenAI's `{"error": {"message", "type"}}`.

use super::app::App;
use super::state::{Chosen, NoRoute};
use super::tenants::{TenantCounters, TenantEntry};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use warmpath_index::keys::{token_block_keys, BlockKey, TenantKey};
use warmpath_index::openai::{ChatRequest, CompletionRequest, ErrorBody, PromptInput};
use warmpath_index::InstanceId;

/// Header that asks for the routing decision to be explained in the response.
pub const EXPLAIN_HEADER: &str = "x-warmpath-explain";
/// Response header carrying the configuration version the request was routed under.
pub const CONFIG_VERSION_HEADER: &str = "x-warmpath-config-version";
/// Header naming the tenant when no API key does (if allowed).
pub const TENANT_HEADER: &str = "x-tenant-id";

/// The tenant of a request:
/// - an `Authorization: Bearer <key>` naming a tenant's key selects that tenant; an
///   unknown key is refused (401), unless no tenant has any key, when every request is
///   the default tenant's (clients such as `openai` always send some key);
/// - otherwise `x-tenant-id`, only when `allow_tenant_header` is on, and only for a
///   tenant without API keys (a keyed tenant is never reachable without its key);
/// - otherwise the default tenant, if it has no API keys.
fn identify(app: &App, headers: &HeaderMap) -> Result<Arc<TenantEntry>, ProxyError> {
    if let Some(why) = app.following.refusal() {
        return Err(ProxyError::NotFollowing(why));
    }
    let table = app.tenants();
    if let Some(auth) = headers.get(axum::http::header::AUTHORIZATION) {
        let auth = auth
            .to_str()
            .map_err(|_| ProxyError::Unauthorized("the Authorization header is not text".into()))?;
        let key = auth.strip_prefix("Bearer ").ok_or_else(|| {
            ProxyError::Unauthorized("Authorization must be `Bearer <api key>`".into())
        })?;
        if let Some(entry) = table.by_api_key(key.trim()) {
            return Ok(entry.clone());
        }
        if table.keyed() {
            return Err(ProxyError::Unauthorized("unknown API key".into()));
        }
    }
    if let Some(id) = headers.get(TENANT_HEADER) {
        if !app.config.allow_tenant_header {
            return Err(ProxyError::Unauthorized(format!(
                "{TENANT_HEADER} is not accepted here: send `Authorization: Bearer <api key>`"
            )));
        }
        let id = id.to_str().unwrap_or_default();
        return table.keyless(id).ok_or_else(|| {
            ProxyError::Unauthorized(format!(
                "no tenant {id:?} without API keys: send `Authorization: Bearer <api key>`"
            ))
        });
    }
    match table.default_tenant().and_then(|d| table.keyless(d)) {
        Some(entry) => Ok(entry),
        None => Err(ProxyError::Unauthorized(
            "no API key: send `Authorization: Bearer <api key>`".into(),
        )),
    }
}

/// The request path's metric handles, each registered on first use. The macros build a key,
/// allocate its label values, hash it and look it up in the registry on every call: 2–3% of
/// the router's samples in a profile of the request path (decision 0104).
struct PathMetrics {
    tokenize: metrics::Histogram,
    overhead: metrics::Histogram,
    /// `warmpath_router_decisions_total` by `Reason` (a fieldless enum, by discriminant):
    /// registered when a reason is first chosen, so /metrics shows only reasons seen.
    decisions: [std::sync::OnceLock<metrics::Counter>; 16],
}

/// Registered at the first request, after the router installed its recorder (a handle
/// taken before would record nowhere).
fn path_metrics() -> &'static PathMetrics {
    static METRICS: std::sync::OnceLock<PathMetrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| PathMetrics {
        tokenize: metrics::histogram!(crate::metric_names::ROUTER_TOKENIZE_SECONDS),
        overhead: metrics::histogram!(crate::metric_names::ROUTER_OVERHEAD_SECONDS),
        decisions: Default::default(),
    })
}

fn count_decision(reason: warmpath_index::policy::Reason) {
    let name = reason.name();
    let new = || metrics::counter!(crate::metric_names::ROUTER_DECISIONS_TOTAL, "reason" => name);
    match path_metrics().decisions.get(reason as usize) {
        Some(slot) => slot.get_or_init(new).increment(1),
        None => new().increment(1),
    }
}

/// Which OpenAI endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// An error at the gateway's edge.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// No or a wrong API key.
    #[error("{0}")]
    Unauthorized(String),
    /// No pool serves the model.
    #[error("model {0:?} is not served here")]
    UnknownModel(String),
    /// The body is over the limit.
    #[error("request body over {0} bytes")]
    TooLarge(usize),
    /// The tenant is over its rate limit.
    #[error("rate limit of {rps} requests/s exceeded for tenant {tenant:?}; retry after {retry_after_s} s")]
    RateLimited {
        tenant: String,
        rps: f64,
        retry_after_s: u64,
    },
    /// No instance can take the request now.
    #[error("no healthy instance for model {model:?}; retry shortly")]
    NoHealthyInstance { model: String, retry_after_s: u64 },
    /// Every attempt failed to reach an instance.
    #[error("upstream failed after {attempts} attempt(s): {last}")]
    Upstream { attempts: u32, last: String },
    /// The request ran out of time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The client did not send its body in time.
    #[error("{0}")]
    SlowClient(String),
    /// The instance refused the body as too large (its limit is below the router's).
    #[error(
        "the request body ({0} bytes) is over the serving instance's limit; send a smaller one"
    )]
    UpstreamTooLarge(usize),
    /// This router cannot confirm it holds the cluster's configuration (its Raft stopped,
    /// or it has heard no leader within the bound): it serves no tenant, since a key
    /// revoked meanwhile must not work here.
    #[error("this router does not follow the cluster's configuration now ({0}); retry: another router serves")]
    NotFollowing(String),
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ProxyError::UnknownModel(_) => StatusCode::NOT_FOUND,
            ProxyError::TooLarge(_) | ProxyError::UpstreamTooLarge(_) => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            ProxyError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::NoHealthyInstance { .. } | ProxyError::NotFollowing(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::SlowClient(_) => StatusCode::REQUEST_TIMEOUT,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::BadRequest(_)
            | ProxyError::TooLarge(_)
            | ProxyError::UpstreamTooLarge(_)
            | ProxyError::SlowClient(_) => "invalid_request_error",
            ProxyError::Unauthorized(_) => "authentication_error",
            ProxyError::RateLimited { .. } => "rate_limit_error",
            ProxyError::UnknownModel(_) => "not_found_error",
            ProxyError::NoHealthyInstance { .. }
            | ProxyError::NotFollowing(_)
            | ProxyError::Upstream { .. }
            | ProxyError::Timeout(_) => "service_unavailable",
        }
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> axum::response::Response {
        let status = self.status();
        let body =
            serde_json::to_vec(&ErrorBody::new(self.kind(), self.to_string())).unwrap_or_default();
        let mut resp = Response::builder()
            .status(status)
            .header(axum::http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .unwrap_or_default();
        if let ProxyError::RateLimited { retry_after_s, .. }
        | ProxyError::NoHealthyInstance { retry_after_s, .. } = self
        {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(retry_after_s),
            );
        }
        if let ProxyError::NotFollowing(_) = self {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(1u64));
        }
        metrics::counter!(crate::metric_names::ROUTER_ERRORS_TOTAL, "status" => status.as_u16().to_string())
            .increment(1);
        resp
    }
}

/// The explained dry-run decision for `tenant` (by id) and an OpenAI request body.
pub fn explain_for(app: &App, tenant: &str, body: &[u8]) -> Result<serde_json::Value, ProxyError> {
    let table = app.tenants();
    let entry = table
        .get(tenant)
        .ok_or_else(|| ProxyError::BadRequest(format!("unknown tenant {tenant:?}")))?;
    explain_with(app, entry, body)
}

/// The explained decision for `entry`'s request `body`, changing no state.
fn explain_with(
    app: &App,
    entry: &TenantEntry,
    body: &[u8],
) -> Result<serde_json::Value, ProxyError> {
    let endpoint = if body.windows(10).any(|w| w == b"\"messages\"") {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let mut parsed = parse(endpoint, body, |m| app.tokenizer(m))?;
    let tokens = std::mem::take(&mut parsed.tokens);
    let keys = prompt_keys(
        app,
        &entry.key,
        &parsed.model,
        &tokens,
        entry.tenant.block_tokens,
    );
    // Bound first: the lock guard must be gone before `explanation` takes it again.
    let chosen = app
        .core()
        .dry_run(&entry.tenant, &parsed.model, &keys, tokens.len() as u32);
    match chosen {
        Ok(c) => {
            let mut v = explanation(app, &c);
            v["config_version"] = serde_json::json!(entry.config_version);
            v["strategy"] = serde_json::json!(entry.tenant.strategy.name());
            v["tokenizer"] = serde_json::json!(app.tokenizer(&parsed.model).0.name());
            v["block_tokens"] = serde_json::json!(entry.tenant.block_tokens);
            Ok(v)
        }
        Err(NoRoute::UnknownModel) => Err(ProxyError::UnknownModel(parsed.model)),
        Err(NoRoute::NoHealthyInstance) => Err(ProxyError::NoHealthyInstance {
            model: parsed.model,
            retry_after_s: app.config.retry_after_s,
        }),
    }
}

/// A prompt's block keys for a request to `model`: keyed for the adapter
/// ([`TenantKey::for_adapter`]) when `model` is a pool's LoRA adapter, as the agent reports
/// the blocks engines store under it; the tenant's own key for a base model. Either key
/// derives from the tenant's, so tenants still never share a hit.
fn prompt_keys(
    app: &App,
    key: &TenantKey,
    model: &str,
    tokens: &[u32],
    block_tokens: u32,
) -> Vec<BlockKey> {
    let block_tokens = block_tokens as usize;
    if app.is_adapter(model) {
        token_block_keys(&key.for_adapter(model), tokens, block_tokens)
    } else {
        token_block_keys(key, tokens, block_tokens)
    }
}

/// `POST /debug/route`: the explained decision for a completions or chat body, without
/// sending it anywhere or changing any state.
pub async fn dry_run(
    State(app): State<Arc<App>>,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    let (parts, body) = req.into_parts();
    let tenant = identify(&app, &parts.headers)?;
    let body = read_body(&app, body).await?;
    Ok(axum::Json(explain_with(&app, &tenant, &body)?).into_response())
}

/// The whole request body, within the size limit and the body read timeout.
async fn read_body(app: &App, body: Body) -> Result<Bytes, ProxyError> {
    let limit = app.config.max_body_bytes;
    let within = app.config.body_read_timeout;
    match tokio::time::timeout(within, Limited::new(body, limit).collect()).await {
        Err(_) => Err(ProxyError::SlowClient(format!(
            "the request body did not arrive within {} s",
            within.as_secs_f64()
        ))),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ProxyError::TooLarge(limit))
        }
        Ok(Err(e)) => Err(ProxyError::BadRequest(format!(
            "could not read the request body: {e}"
        ))),
        Ok(Ok(b)) => Ok(b.to_bytes()),
    }
}

pub async fn completions(
    State(app): State<Arc<App>>,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    handle(app, Endpoint::Completions, req).await
}

pub async fn chat(
    State(app): State<Arc<App>>,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    handle(app, Endpoint::Chat, req).await
}

/// What the router reads of a request body.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) model: String,
    /// The prompt as routing reads it: the text tokenized, or the client's own token ids.
    pub(crate) tokens: Vec<u32>,
    pub(crate) stream: bool,
    /// Whether the body has a `cache_salt` field of its own (a string or null).
    pub(crate) own_salt: bool,
}

/// Parses a completions or chat body; the prompt is tokenized by the tokenizer of the
/// model it names (`tokenizer_of`: the pool's, see [`App::tokenizer`]).
pub(crate) fn parse(
    endpoint: Endpoint,
    body: &[u8],
    tokenizer_of: impl Fn(&str) -> warmpath_index::text::Tokenizer,
) -> Result<Parsed, ProxyError> {
    let bad = |e: serde_json::Error| ProxyError::BadRequest(format!("invalid request body: {e}"));
    let bad_req = |e: warmpath_index::openai::RequestError| ProxyError::BadRequest(e.to_string());
    // JSON is UTF-8 throughout; serde skips the fields it ignores without checking them, and
    // the engine would refuse what the router forwarded.
    let body = std::str::from_utf8(body)
        .map_err(|e| ProxyError::BadRequest(format!("invalid request body: not UTF-8 ({e})")))?;
    match endpoint {
        Endpoint::Completions => {
            let r: CompletionRequest = serde_json::from_str(body).map_err(bad)?;
            let tokens = match r.prompt_input().map_err(bad_req)? {
                PromptInput::Text(t) => tokenizer_of(&r.model).0.completion(&t),
                PromptInput::Tokens(ids) => ids,
            };
            Ok(Parsed {
                model: r.model,
                tokens,
                stream: r.stream,
                own_salt: r.cache_salt.is_some(),
            })
        }
        Endpoint::Chat => {
            let r: ChatRequest = serde_json::from_str(body).map_err(bad)?;
            r.check().map_err(bad_req)?;
            let tokens = tokenizer_of(&r.model)
                .0
                .chat(&r.messages)
                .map_err(|e| ProxyError::BadRequest(format!("chat template: {e}")))?;
            Ok(Parsed {
                model: r.model,
                tokens,
                stream: r.stream,
                own_salt: r.cache_salt.is_some(),
            })
        }
    }
}

/// The body with the tenant's cache salt as the engine's `cache_salt`, so two tenants
/// never share an engine's prefix cache. A client's own salt is kept, after the tenant's.
pub(crate) fn with_cache_salt(
    body: &Bytes,
    salt: &str,
    has_own: bool,
) -> Result<Bytes, ProxyError> {
    if has_own {
        let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
            .map_err(|e| ProxyError::BadRequest(format!("invalid request body: {e}")))?;
        let salted = match v.get("cache_salt").and_then(|s| s.as_str()) {
            Some(own) => format!("{salt}:{own}"),
            None => salt.to_string(),
        };
        v.insert("cache_salt".into(), serde_json::Value::String(salted));
        return Ok(Bytes::from(serde_json::to_vec(&v).unwrap_or_default()));
    }
    // Splice the field in after the opening brace: no second parse on the hot path.
    let start = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(0);
    if body.get(start) != Some(&b'{') {
        return Err(ProxyError::BadRequest(
            "the request body must be a JSON object".into(),
        ));
    }
    let rest = &body[start + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let salt_json = serde_json::to_string(salt).unwrap_or_default();
    let mut out = Vec::with_capacity(body.len() + salt_json.len() + 16);
    out.extend_from_slice(b"{\"cache_salt\":");
    out.extend_from_slice(salt_json.as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Ok(Bytes::from(out))
}

async fn handle(
    app: Arc<App>,
    endpoint: Endpoint,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let tenant = identify(&app, &parts.headers)?;
    if let (Some(limiter), Some(rps)) = (&tenant.limiter, tenant.tenant.rate_limit_rps) {
        let peers = app.peers.load(std::sync::atomic::Ordering::Relaxed);
        let mut bucket = limiter.lock().unwrap_or_else(|e| e.into_inner());
        bucket.set_share(1.0 / (peers + 1) as f64);
        if let Err(wait) = bucket.admit(Instant::now()) {
            if let Some(refused) = &tenant.counters.rate_limited {
                refused.increment(1);
            }
            return Err(ProxyError::RateLimited {
                tenant: tenant.tenant.id.clone(),
                rps,
                retry_after_s: wait.as_secs_f64().ceil().max(1.0) as u64,
            });
        }
    }
    let config_version = tenant.config_version;
    let body = read_body(&app, body).await?;
    let parse_started = Instant::now();
    let mut parsed = parse(endpoint, &body, |m| app.tokenizer(m))?;
    path_metrics()
        .tokenize
        .record(parse_started.elapsed().as_secs_f64());
    // The prompt is tokenized and hashed once; every attempt reuses the keys.
    let tokens = std::mem::take(&mut parsed.tokens);
    let prompt_tokens = tokens.len() as u32;
    let keys = prompt_keys(
        &app,
        &tenant.key,
        &parsed.model,
        &tokens,
        tenant.tenant.block_tokens,
    );
    let upstream_body = with_cache_salt(&body, &tenant.tenant.cache_salt, parsed.own_salt)?;
    // Explanations name instances and their loads: only for tenants allowed to see them.
    let explain = tenant.tenant.allow_explain
        && parts
            .headers
            .get(EXPLAIN_HEADER)
            .is_some_and(|v| v.as_bytes() == b"1");
    let deadline = started + app.config.request_timeout;

    let mut tried: Vec<InstanceId> = Vec::new();
    let mut last_error = String::new();
    let attempts_allowed = app.config.retries + 1;
    for attempt in 0..attempts_allowed {
        let chosen = {
            let mut core = app.core();
            core.route(
                &tenant.tenant,
                &parsed.model,
                &keys,
                prompt_tokens,
                &tried,
                explain,
            )
        };
        let chosen = match chosen {
            Ok(c) => c,
            Err(NoRoute::UnknownModel) => return Err(ProxyError::UnknownModel(parsed.model)),
            Err(NoRoute::NoHealthyInstance) if attempt == 0 => {
                return Err(ProxyError::NoHealthyInstance {
                    model: parsed.model,
                    retry_after_s: app.config.retry_after_s,
                })
            }
            Err(NoRoute::NoHealthyInstance) => break,
        };
        if attempt == 0 {
            // Arrival to upstream send: body read, parse, tokenize, hash, route.
            path_metrics()
                .overhead
                .record(started.elapsed().as_secs_f64());
        }
        count_decision(chosen.decision.reason);
        prefetch(&app, &chosen, &keys);
        tried.push(chosen.instance);
        match attempt_once(
            &app,
            endpoint,
            &chosen,
            &tenant.counters,
            upstream_body.clone(),
            parsed.stream,
            deadline,
        )
        .await
        {
            Ok(mut resp) => {
                app.core().attempt_succeeded(chosen.instance);
                resp.headers_mut()
                    .insert(CONFIG_VERSION_HEADER, HeaderValue::from(config_version));
                if explain {
                    if let Ok(v) = HeaderValue::from_str(
                        &serde_json::to_string(&explanation(&app, &chosen)).unwrap_or_default(),
                    ) {
                        resp.headers_mut().insert(EXPLAIN_HEADER, v);
                    }
                }
                tenant.counters.answered(&tenant.tenant.id, resp.status());
                return Ok(resp);
            }
            Err(AttemptError::Failed(e)) => {
                tracing::warn!(instance = %chosen.url, attempt, error = %e, "upstream attempt failed");
                metrics::counter!(crate::metric_names::ROUTER_UPSTREAM_FAILURES_TOTAL).increment(1);
                app.core().attempt_failed(chosen.instance);
                last_error = e;
            }
            Err(AttemptError::Deadline) => {
                return Err(ProxyError::Timeout("the request deadline passed".into()))
            }
        }
    }
    if app.core().has_candidates(&parsed.model, &tried) {
        // Attempts ran out while other instances remain.
        return Err(ProxyError::Upstream {
            attempts: tried.len() as u32,
            last: last_error,
        });
    }
    // Every instance of the pool failed: the pool is down for now.
    tracing::warn!(model = %parsed.model, attempts = tried.len(), last = %last_error, "no instance answered");
    Err(ProxyError::NoHealthyInstance {
        model: parsed.model,
        retry_after_s: app.config.retry_after_s,
    })
}

/// When the chosen instance's host holds part of the prompt's prefix only in the global
/// L2 (past what its GPU and its host's L1 hold), asks the host's agent to promote those
/// blocks into L1 now, so that they load while the request queues and the engine reads
/// them from host memory at admission.
fn prefetch(app: &App, chosen: &Chosen, keys: &[BlockKey]) {
    let m = &chosen.decision.matched;
    let (from, to) = (m.l1 as usize, (m.l2 as usize).min(keys.len()));
    if from >= to {
        return;
    }
    let Some(residency) = app.residency.get() else {
        return;
    };
    let to = to.min(from + warmpath_residency::MAX_PREFETCH_KEYS);
    residency.prefetch(&chosen.url, keys[from..to].iter().map(|k| k.0).collect());
}

fn explanation(app: &App, chosen: &Chosen) -> serde_json::Value {
    let core = app.core();
    let url = |i: InstanceId| {
        core.instances()
            .get(i.0 as usize)
            .map(|x| x.name.clone())
            .unwrap_or_default()
    };
    serde_json::json!({
        "instance": chosen.url,
        "reason": chosen.decision.reason,
        "blocks_considered": chosen.decision.blocks_considered,
        "matched": {
            "gpu": chosen.decision.matched.gpu, "l1": chosen.decision.matched.l1, "l2": chosen.decision.matched.l2,
            // The source of every depth: of the GPU depth, what a cache-agent reported and
            // what is predicted from routing decisions; beyond it, host memory (L1) and the
            // global L2 are known only from agents.
            "gpu_observed": chosen.decision.matched.observed_gpu,
            "gpu_predicted": chosen.decision.matched.gpu.saturating_sub(chosen.decision.matched.observed_gpu),
            "l1_observed": chosen.decision.matched.l1.saturating_sub(chosen.decision.matched.gpu),
            "l2_observed": chosen.decision.matched.l2.saturating_sub(chosen.decision.matched.l1),
        },
        "candidates": chosen.decision.candidates.as_ref().map(|cs| cs.iter().map(|c| serde_json::json!({
            "instance": url(c.instance),
            "gpu_blocks": c.gpu_blocks, "l1_blocks": c.l1_blocks, "l2_blocks": c.l2_blocks,
            "in_flight": c.in_flight, "score": c.score,
        })).collect::<Vec<_>>()),
    })
}

enum AttemptError {
    /// Retry elsewhere.
    Failed(String),
    Deadline,
}

/// One attempt on one instance. Succeeds once the instance answered with a non-5xx
/// status; for a non-streaming request, once the whole body arrived (so a failure at any
/// point before the client sees a byte is retried elsewhere).
async fn attempt_once(
    app: &Arc<App>,
    endpoint: Endpoint,
    chosen: &Chosen,
    counters: &Arc<TenantCounters>,
    body: Bytes,
    stream: bool,
    deadline: Instant,
) -> Result<Response<Body>, AttemptError> {
    let prompt_tokens = chosen.pending_tokens();
    let body_len = body.len();
    let uri = format!("{}{}", chosen.url, endpoint.path());
    let request = Request::post(uri)
        .header(axum::http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| AttemptError::Failed(e.to_string()))?;
    let mut guard = LoadGuard {
        app: app.clone(),
        instance: chosen.instance,
        prompt_tokens,
        prefilled: false,
        done: false,
        decided_at: chosen.decision.decided_at,
        chosen: Some(chosen.clone()),
        stream_usage: warmpath_openai::UsageReader::new(),
        counters: counters.clone(),
    };
    let first_byte = deadline.min(Instant::now() + app.config.first_byte_timeout);
    let went_down =
        || AttemptError::Failed("the instance failed its health check before answering".into());
    // One watch of the instance's health for the whole attempt, headers, body or stream.
    let mut down = Box::pin(until_down(app.clone(), chosen.instance));
    let headers = tokio::time::timeout_at(first_byte.into(), app.client.request(request));
    let resp = tokio::select! {
        r = headers => match r {
            Err(_) if Instant::now() >= deadline => return Err(AttemptError::Deadline),
            Err(_) => return Err(AttemptError::Failed("no response headers in time".into())),
            Ok(Err(e)) => return Err(AttemptError::Failed(format!("{e}"))),
            Ok(Ok(r)) => r,
        },
        () = &mut down => return Err(went_down()),
    };
    let status = resp.status();
    if status.is_server_error() {
        return Err(AttemptError::Failed(format!("instance answered {status}")));
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        // Engines answer this in their own words (often plain text): say it in OpenAI's.
        guard.first_byte();
        guard.finish();
        return Ok(ProxyError::UpstreamTooLarge(body_len).into_response());
    }
    let (parts, incoming) = resp.into_parts();
    let mut builder = Response::builder().status(parts.status);
    for name in [
        axum::http::header::CONTENT_TYPE,
        axum::http::header::CACHE_CONTROL,
    ] {
        if let Some(v) = parts.headers.get(&name) {
            builder = builder.header(name, v);
        }
    }
    if !stream || !status.is_success() {
        let collected = tokio::select! {
            c = tokio::time::timeout_at(deadline.into(), incoming.collect()) => c,
            () = &mut down => return Err(went_down()),
        };
        let bytes = match collected {
            Err(_) => return Err(AttemptError::Deadline),
            Ok(Err(e)) => {
                return Err(AttemptError::Failed(format!(
                    "response body broke off: {e}"
                )))
            }
            Ok(Ok(b)) => b.to_bytes(),
        };
        if let Some(usage) = warmpath_openai::cached_usage(&bytes) {
            guard.usage(usage);
        }
        guard.first_byte();
        guard.finish();
        return Ok(builder.body(Body::from(bytes)).unwrap_or_default());
    }
    let idle = app.config.stream_idle_timeout;
    let body = Tracked {
        inner: incoming,
        guard,
        deadline: Box::pin(tokio::time::sleep_until(deadline.into())),
        idle: Box::pin(tokio::time::sleep(idle)),
        idle_for: idle,
        down,
        ended: false,
    };
    Ok(builder.body(Body::new(body)).unwrap_or_default())
}

/// Keeps the load view honest: the first response byte ends the prefill, and the end of
/// the response (complete, failed or abandoned by the client) ends the request.
struct LoadGuard {
    app: Arc<App>,
    instance: InstanceId,
    prompt_tokens: u32,
    prefilled: bool,
    done: bool,
    /// The decision, until the engine's `usage` has been checked against it.
    chosen: Option<Chosen>,
    /// Looks for the engine's `usage` in a streamed response.
    stream_usage: warmpath_openai::UsageReader,
    decided_at: u64,
    /// The tenant's counters, for the engine's account of prompt and cached tokens.
    counters: Arc<TenantCounters>,
}

impl LoadGuard {
    /// Reads the next chunk of a streamed response for the engine's `usage`, until found.
    fn stream_chunk(&mut self, chunk: &[u8]) {
        if self.chosen.is_none() {
            return;
        }
        if let Some(usage) = self.stream_usage.push(chunk) {
            self.usage(usage);
        }
    }

    /// The end of a streamed response: its last event may carry the `usage` unterminated.
    fn stream_end(&mut self) {
        if self.chosen.is_none() {
            return;
        }
        if let Some(usage) = self.stream_usage.finish() {
            self.usage(usage);
        }
    }

    /// Checks the engine's account of cached tokens against the prediction the request was
    /// routed on (once).
    fn usage(&mut self, usage: warmpath_openai::Usage) {
        let Some(chosen) = self.chosen.take() else {
            return;
        };
        let report = warmpath_index::router::CacheReport {
            prompt_tokens: usage.prompt_tokens,
            cached_tokens: usage.cached_tokens().unwrap_or(0),
        };
        // The engines' own account of what routing saved: hit rate per tenant and policy.
        let c = &self.counters;
        c.prompt_tokens.increment(u64::from(report.prompt_tokens));
        c.cached_tokens.increment(u64::from(report.cached_tokens));
        if self.app.core().report_cached(&chosen, report) {
            metrics::counter!(crate::metric_names::ROUTER_PREDICTIONS_CONTRADICTED_TOTAL)
                .increment(1);
        }
    }

    fn first_byte(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            self.app
                .core()
                .first_token(self.instance, self.prompt_tokens);
        }
    }

    fn finish(&mut self) {
        if !self.done {
            self.done = true;
            self.app.core().finish(
                self.instance,
                self.prompt_tokens,
                self.prefilled,
                self.decided_at,
            );
        }
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A streamed upstream body passed through frame by frame, without buffering. Dropping
/// it (the client went away) drops the upstream response, which closes that connection
/// and so cancels the request on the engine.
struct Tracked {
    inner: Incoming,
    guard: LoadGuard,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// Fires after `idle_for` without a chunk; reset by each one.
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_for: Duration,
    /// Ready once the health checks find the instance down.
    down: Pin<Box<dyn Future<Output = ()> + Send>>,
    ended: bool,
}

/// Returns once the health checks find `instance` down (never, while it is up). It was up
/// when routed to, so the routing lock is taken only when some instance goes down.
async fn until_down(app: Arc<App>, instance: InstanceId) {
    let mut downs = app.downs.subscribe();
    loop {
        if downs.changed().await.is_err() {
            // No health checks run any more: nothing will say it went down.
            std::future::pending::<()>().await;
        }
        let healthy = app
            .core()
            .instances()
            .get(instance.0 as usize)
            .is_some_and(|i| i.healthy);
        if !healthy {
            return;
        }
    }
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let stop = if self.deadline.as_mut().poll(cx).is_ready() {
            Some("the request deadline passed")
        } else if self.down.as_mut().poll(cx).is_ready() {
            Some("the instance failed its health check mid-stream; retry the request")
        } else if self.idle.as_mut().poll(cx).is_ready() {
            Some("the instance sent nothing for too long (stream_idle_timeout_ms); retry the request")
        } else {
            None
        };
        if let Some(why) = stop {
            tracing::warn!(instance_id = self.guard.instance.0, why, "ending a stream");
            metrics::counter!(crate::metric_names::ROUTER_STREAM_BREAKS_TOTAL).increment(1);
            self.ended = true;
            self.guard.finish();
            return Poll::Ready(Some(Ok(Frame::data(sse_error(why)))));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.guard.first_byte();
                    self.guard.stream_chunk(data);
                }
                let next = tokio::time::Instant::now() + self.idle_for;
                self.idle.as_mut().reset(next);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                // The instance failed mid-stream: tell the client plainly, then end.
                tracing::warn!(instance_id = self.guard.instance.0, error = %e, "upstream stream broke off");
                metrics::counter!(crate::metric_names::ROUTER_STREAM_BREAKS_TOTAL).increment(1);
                self.ended = true;
                self.guard.finish();
                Poll::Ready(Some(Ok(Frame::data(sse_error(
                    "the instance failed mid-stream; retry the request",
                )))))
            }
            Poll::Ready(None) => {
                self.ended = true;
                self.guard.stream_end();
                self.guard.finish();
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// An SSE event carrying an OpenAI error body, then `[DONE]`.
fn sse_error(message: &str) -> Bytes {
    let body =
        serde_json::to_string(&ErrorBody::new("upstream_error", message)).unwrap_or_default();
    Bytes::from(format!("data: {body}\n\ndata: [DONE]\n\n"))
}

use std::future::Future;

#[cfg(test)]
mod tests {
    use super::*;
    use warmpath_index::text::{render_chat, tokenize, ChatMessage, Tokenizer};

    fn builtin(_model: &str) -> Tokenizer {
        Tokenizer::builtin()
    }

    #[test]
    fn cache_salt_cases() {
        let cases: &[(&str, &str)] = &[
            (r#"{"model":"m"}"#, r#"{"cache_salt":"s","model":"m"}"#),
            (r#"  { "model":"m"}"#, r#"{"cache_salt":"s", "model":"m"}"#),
            (r#"{}"#, r#"{"cache_salt":"s"}"#),
            (r#"{ }"#, r#"{"cache_salt":"s" }"#),
        ];
        for (input, want) in cases {
            let got = with_cache_salt(&Bytes::from(*input), "s", false).unwrap();
            assert_eq!(std::str::from_utf8(&got).unwrap(), *want, "{input}");
        }
        let own = with_cache_salt(
            &Bytes::from(r#"{"model":"m","cache_salt":"mine"}"#),
            "s",
            true,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&own).unwrap();
        assert_eq!(v["cache_salt"], "s:mine");
        // A null salt is the client's field too: replaced, never left beside the tenant's
        // (an engine keeping the last duplicate key would read null and share the cache).
        let body = Bytes::from(r#"{"model":"m","prompt":"p","cache_salt":null}"#);
        let parsed = parse(Endpoint::Completions, &body, builtin).ok().unwrap();
        assert!(parsed.own_salt);
        let salted = with_cache_salt(&body, "s", parsed.own_salt).unwrap();
        assert_eq!(
            std::str::from_utf8(&salted).unwrap(),
            r#"{"cache_salt":"s","model":"m","prompt":"p"}"#
        );
        assert!(with_cache_salt(&Bytes::from("[1]"), "s", false).is_err());
    }

    #[test]
    fn parse_errors_say_what_is_wrong() {
        let err = |e: Endpoint, b: &str| match parse(e, b.as_bytes(), builtin) {
            Err(ProxyError::BadRequest(m)) => m,
            other => panic!("{b}: {:?}", other.map(|p| p.model)),
        };
        assert!(err(Endpoint::Completions, "{").contains("invalid request body"));
        assert!(err(Endpoint::Completions, r#"{"model":"m"}"#).contains("prompt"));
        assert!(err(Endpoint::Completions, r#"{"model":"m","prompt":""}"#).contains("empty"));
        assert!(err(Endpoint::Chat, r#"{"model":"m","messages":[]}"#).contains("messages"));
        let ok = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
            builtin,
        )
        .ok()
        .unwrap();
        assert!(
            ok.stream && ok.tokens == tokenize(&render_chat(&[ChatMessage::text("user", "hi")]))
        );
        let ids = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":[[7,8,9]]}"#,
            builtin,
        )
        .ok()
        .unwrap();
        assert_eq!(ids.tokens, vec![7, 8, 9]);
        assert!(
            err(Endpoint::Completions, r#"{"model":"m","prompt":[[1],[2]]}"#).contains("batch")
        );
        let parts = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
                {"role":"tool","tool_call_id":"c1","content":"42"}]}"#,
            builtin,
        );
        assert!(parts.is_ok());
    }
}
