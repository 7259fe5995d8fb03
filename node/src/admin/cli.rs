//! `warmpath admin …`: a command-line client of the admin API.
//!
//! Prints aligned tables, or the raw JSON answer with `--json`. An HTTP error becomes one
//! `error:` line (through `anyhow`, so the process exits non-zero) carrying the API's own
//! message: the bad fields of a refused command, the current version of a conflict, or the
//! warning that a timed-out write may have been applied.
//!
//! `tenants put` is a read-modify-write: on an existing tenant the flags given change only
//! their fields (its keys, salt and temperature are kept, `--api-key` adds keys) and the write
//! is a compare-and-set on the version read, unless `--expected-version` names another.

use super::wire::PREFIX;
use anyhow::{anyhow, bail, Context, Result};
use axum::http::{header, HeaderMap, Method, StatusCode};
use bytes::Bytes;
use clap::{Args, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

/// Where the admin API listens by default.
pub const DEFAULT_URL: &str = "http://127.0.0.1:9090";
/// The one prefix of the environment variables this module reads.
pub const ENV_PREFIX: &str = "WARMPATH_";
/// Environment variable with the admin token, when `--token` is not given.
pub const ENV_ADMIN_TOKEN: &str = "WARMPATH_ADMIN_TOKEN";
/// How long one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Args, Clone)]
pub struct AdminArgs {
    /// Base URL of a router's admin API.
    #[arg(long, global = true, default_value = DEFAULT_URL)]
    pub url: String,
    /// Admin token (default: the WARMPATH_ADMIN_TOKEN environment variable).
    #[arg(long, global = true)]
    pub token: Option<String>,
    /// Print the raw JSON answer instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: AdminCommand,
}

impl std::fmt::Debug for AdminArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminArgs")
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("json", &self.json)
            .field("command", &self.command)
            .finish()
    }
}

#[derive(Subcommand, Debug, Clone)]
pub enum AdminCommand {
    /// Tenants: list, get, put (create or update), delete.
    #[command(subcommand)]
    Tenants(TenantsCommand),
    /// A tenant's API keys (stored as blake3 hashes only).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Instance pools, by model.
    #[command(subcommand)]
    Pools(PoolsCommand),
    /// Raft status (members, leader, term, applied index, lag) and gossip peers.
    Cluster,
    /// Block index statistics of the router.
    Index,
    /// Routing dry run: which instance a prompt would go to, and why.
    Explain(ExplainArgs),
}

#[derive(Subcommand, Debug, Clone)]
pub enum TenantsCommand {
    /// List every tenant.
    List,
    /// Show one tenant.
    Get { id: String },
    /// Create a tenant, or change the given fields of an existing one.
    Put(TenantPutArgs),
    /// Delete a tenant.
    Delete {
        id: String,
        /// Compare-and-set: fail unless the config is at this version.
        #[arg(long)]
        expected_version: Option<u64>,
    },
}

#[derive(Args, Debug, Clone)]
pub struct TenantPutArgs {
    pub id: String,
    /// round-robin, least-loaded, prefix-aware or kv-aware (new tenants: prefix-aware).
    #[arg(long)]
    pub strategy: Option<String>,
    /// Model name of the pool serving the tenant (required for a new tenant).
    #[arg(long)]
    pub pool: Option<String>,
    /// Prompt tokens used for prefix matching; 0 = the whole prompt.
    #[arg(long)]
    pub prefix_length: Option<u32>,
    /// In-flight requests at which the preferred instance is skipped; 0 = no limit.
    #[arg(long)]
    pub concurrency_threshold: Option<u32>,
    /// Tokens per KV block.
    #[arg(long)]
    pub block_tokens: Option<u32>,
    /// Requests per second allowed.
    #[arg(long)]
    pub rate_limit_rps: Option<f64>,
    /// A plain API key to add (repeatable); only its hash is stored.
    #[arg(long = "api-key")]
    pub api_keys: Vec<String>,
    /// Compare-and-set: fail unless the config is at this version.
    #[arg(long)]
    pub expected_version: Option<u64>,
}

#[derive(Subcommand, Debug, Clone)]
pub enum KeysCommand {
    /// Add a plain API key to a tenant; prints its hash.
    Add {
        tenant: String,
        key: String,
        #[arg(long)]
        expected_version: Option<u64>,
    },
    /// Remove a key from a tenant, by its hash.
    Remove {
        tenant: String,
        hash: String,
        #[arg(long)]
        expected_version: Option<u64>,
    },
}

#[derive(Subcommand, Debug, Clone)]
pub enum PoolsCommand {
    /// List every pool.
    List,
    /// Show one pool.
    Get { model: String },
    /// Create or replace the pool of a model.
    Put {
        model: String,
        /// Instance base URL, http://host:port (repeatable).
        #[arg(long = "instance")]
        instances: Vec<String>,
        #[arg(long)]
        expected_version: Option<u64>,
    },
    /// Delete a pool no tenant uses.
    Delete {
        model: String,
        #[arg(long)]
        expected_version: Option<u64>,
    },
    /// Add an instance to a pool.
    AddInstance {
        model: String,
        url: String,
        #[arg(long)]
        expected_version: Option<u64>,
    },
    /// Remove an instance from a pool.
    RemoveInstance {
        model: String,
        url: String,
        #[arg(long)]
        expected_version: Option<u64>,
    },
}

#[derive(Args, Debug, Clone)]
pub struct ExplainArgs {
    /// Tenant whose settings route the request.
    #[arg(long)]
    pub tenant: String,
    /// Prompt text of a completions request.
    #[arg(long)]
    pub prompt: String,
    /// Model of the request (default: the tenant's pool).
    #[arg(long)]
    pub model: Option<String>,
}

/// Runs one admin command and prints its answer.
pub fn run(args: AdminArgs) -> Result<()> {
    let env: HashMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    let token = resolve_token(args.token.clone(), &env)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let out = runtime.block_on(execute(&args, token))?;
    print!("{out}");
    Ok(())
}

/// The token from `--token`, else from the environment map.
pub fn resolve_token(flag: Option<String>, env: &HashMap<String, String>) -> Result<String> {
    flag.or_else(|| env.get(ENV_ADMIN_TOKEN).cloned())
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| anyhow!("no admin token: pass --token or set {ENV_ADMIN_TOKEN}"))
}

/// One answer of the API.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Response headers (the tests read `ETag`).
    #[cfg_attr(not(test), allow(dead_code))]
    pub headers: HeaderMap,
    /// The JSON body; a non-JSON body as a string; no body as null.
    pub body: Value,
}

/// A client of one router's admin API.
pub struct AdminClient {
    base: String,
    token: Option<String>,
    http: Client<HttpConnector, Full<Bytes>>,
}

impl std::fmt::Debug for AdminClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token stays out of logs.
        f.debug_struct("AdminClient")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl AdminClient {
    /// A client of the API at `base` (`http://host:port`).
    pub fn new(base: &str, token: Option<String>) -> Result<AdminClient> {
        let base = base.trim().trim_end_matches('/').to_string();
        if !base.starts_with("http://") {
            bail!("--url {base:?}: give http://host:port (the admin API speaks plain HTTP)");
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let http = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        Ok(AdminClient { base, token, http })
    }

    /// Sends a request to `path` (absolute, including [`PREFIX`]) and returns the answer,
    /// whatever its status.
    pub async fn send_raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        headers: &[(&str, String)],
    ) -> Result<Reply> {
        let uri = format!("{}{path}", self.base);
        let mut b = hyper::Request::builder().method(method).uri(&uri);
        if let Some(t) = &self.token {
            b = b.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        if body.is_some() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        for (k, v) in headers {
            b = b.header(*k, v.as_str());
        }
        let req = b
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .with_context(|| format!("building the request to {uri}"))?;
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, self.http.request(req))
            .await
            .map_err(|_| anyhow!("no answer from {uri} within {REQUEST_TIMEOUT:?}"))?
            .with_context(|| format!("cannot reach the admin API at {}", self.base))?;
        let (parts, body) = resp.into_parts();
        let bytes = tokio::time::timeout(REQUEST_TIMEOUT, body.collect())
            .await
            .map_err(|_| anyhow!("answer from {uri} not complete within {REQUEST_TIMEOUT:?}"))?
            .with_context(|| format!("reading the answer from {uri}"))?
            .to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        Ok(Reply {
            headers: parts.headers,
            status: parts.status.as_u16(),
            body,
        })
    }

    /// Calls `path` under [`PREFIX`]; a non-2xx answer is an error with the API's message.
    pub async fn call(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Value> {
        self.call_cas(method, path, body, None).await
    }

    /// Like [`AdminClient::call`], with `If-Match: expected` when given.
    pub async fn call_cas(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        expected: Option<u64>,
    ) -> Result<Value> {
        let headers: Vec<(&str, String)> = expected
            .map(|v| ("if-match", v.to_string()))
            .into_iter()
            .collect();
        let body = body.map(|b| serde_json::to_vec(b).unwrap_or_default());
        let r = self
            .send_raw(method, &format!("{PREFIX}{path}"), body, &headers)
            .await?;
        if (200..300).contains(&r.status) {
            Ok(r.body)
        } else {
            Err(anyhow!(describe_error(r.status, &r.body)))
        }
    }
}

/// One line for an HTTP error: status, reason and the API's message.
pub fn describe_error(status: u16, body: &Value) -> String {
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let message = match body.pointer("/error/message").and_then(Value::as_str) {
        Some(m) => m.to_string(),
        None => match body {
            Value::Null => "(no body)".to_string(),
            Value::String(s) => s.trim().replace('\n', " "),
            v => v.to_string(),
        },
    };
    format!("HTTP {status} {reason}: {message}")
}

/// Percent-encodes a path segment or query value.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Runs the command; the text to print.
async fn execute(args: &AdminArgs, token: String) -> Result<String> {
    let c = AdminClient::new(&args.url, Some(token))?;
    let (value, render): (Value, fn(&Value) -> String) = match &args.command {
        AdminCommand::Tenants(t) => match t {
            TenantsCommand::List => (c.call(Method::GET, "/tenants", None).await?, render_tenants),
            TenantsCommand::Get { id } => (
                c.call(Method::GET, &format!("/tenants/{}", encode(id)), None)
                    .await?,
                render_tenant,
            ),
            TenantsCommand::Put(a) => (tenant_put(&c, a).await?, render_write),
            TenantsCommand::Delete {
                id,
                expected_version,
            } => (
                c.call_cas(
                    Method::DELETE,
                    &format!("/tenants/{}", encode(id)),
                    None,
                    *expected_version,
                )
                .await?,
                render_write,
            ),
        },
        AdminCommand::Keys(k) => match k {
            KeysCommand::Add {
                tenant,
                key,
                expected_version,
            } => (
                c.call_cas(
                    Method::POST,
                    &format!("/tenants/{}/api-keys", encode(tenant)),
                    Some(&json!({ "key": key })),
                    *expected_version,
                )
                .await?,
                render_write,
            ),
            KeysCommand::Remove {
                tenant,
                hash,
                expected_version,
            } => (
                c.call_cas(
                    Method::DELETE,
                    &format!("/tenants/{}/api-keys/{}", encode(tenant), encode(hash)),
                    None,
                    *expected_version,
                )
                .await?,
                render_write,
            ),
        },
        AdminCommand::Pools(p) => match p {
            PoolsCommand::List => (c.call(Method::GET, "/pools", None).await?, render_pools),
            PoolsCommand::Get { model } => (
                c.call(Method::GET, &format!("/pools/{}", encode(model)), None)
                    .await?,
                render_pool,
            ),
            PoolsCommand::Put {
                model,
                instances,
                expected_version,
            } => (
                c.call_cas(
                    Method::PUT,
                    &format!("/pools/{}", encode(model)),
                    Some(&json!({ "instances": instances })),
                    *expected_version,
                )
                .await?,
                render_write,
            ),
            PoolsCommand::Delete {
                model,
                expected_version,
            } => (
                c.call_cas(
                    Method::DELETE,
                    &format!("/pools/{}", encode(model)),
                    None,
                    *expected_version,
                )
                .await?,
                render_write,
            ),
            PoolsCommand::AddInstance {
                model,
                url,
                expected_version,
            } => (
                c.call_cas(
                    Method::POST,
                    &format!("/pools/{}/instances", encode(model)),
                    Some(&json!({ "url": url })),
                    *expected_version,
                )
                .await?,
                render_write,
            ),
            PoolsCommand::RemoveInstance {
                model,
                url,
                expected_version,
            } => (
                c.call_cas(
                    Method::DELETE,
                    &format!("/pools/{}/instances?url={}", encode(model), encode(url)),
                    None,
                    *expected_version,
                )
                .await?,
                render_write,
            ),
        },
        AdminCommand::Cluster => (c.call(Method::GET, "/cluster", None).await?, render_cluster),
        AdminCommand::Index => (c.call(Method::GET, "/index", None).await?, render_index),
        AdminCommand::Explain(a) => {
            let model = match &a.model {
                Some(m) => m.clone(),
                None => {
                    let t = c
                        .call(
                            Method::GET,
                            &format!("/tenants/{}", encode(&a.tenant)),
                            None,
                        )
                        .await?;
                    t.pointer("/tenant/pool")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .ok_or_else(|| {
                            anyhow!("tenant {:?} names no pool; pass --model", a.tenant)
                        })?
                }
            };
            let body = json!({
                "tenant": a.tenant,
                "request": {"model": model, "prompt": a.prompt, "max_tokens": 1},
            });
            (
                c.call(Method::POST, "/route/explain", Some(&body)).await?,
                render_explain,
            )
        }
    };
    Ok(if args.json {
        format!(
            "{}\n",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        )
    } else {
        render(&value)
    })
}

/// Creates a tenant, or changes the given fields of an existing one (compare-and-set on the
/// version read).
async fn tenant_put(c: &AdminClient, a: &TenantPutArgs) -> Result<Value> {
    let path = format!("/tenants/{}", encode(&a.id));
    let current = c
        .send_raw(Method::GET, &format!("{PREFIX}{path}"), None, &[])
        .await?;
    let (mut body, read_version) = match current.status {
        200 => (
            current.body["tenant"].clone(),
            current.body["version"].as_u64(),
        ),
        404 => {
            if a.pool.is_none() {
                bail!("--pool is required to create tenant {:?}", a.id);
            }
            (json!({}), None)
        }
        s => bail!(describe_error(s, &current.body)),
    };
    let mut set = |k: &str, v: Value| body[k] = v;
    if let Some(v) = &a.strategy {
        set("strategy", json!(v));
    }
    if let Some(v) = &a.pool {
        set("pool", json!(v));
    }
    if let Some(v) = a.prefix_length {
        set("prefix_length", json!(v));
    }
    if let Some(v) = a.concurrency_threshold {
        set("concurrency_threshold", json!(v));
    }
    if let Some(v) = a.block_tokens {
        set("block_tokens", json!(v));
    }
    if let Some(v) = a.rate_limit_rps {
        set("rate_limit_rps", json!(v));
    }
    if !a.api_keys.is_empty() {
        set("api_keys", json!(a.api_keys));
    }
    c.call_cas(
        Method::PUT,
        &path,
        Some(&body),
        a.expected_version.or(read_version),
    )
    .await
}

/// An aligned table: columns separated by two spaces, no trailing blanks.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            } else {
                widths.push(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            s.push_str(c);
            let pad = widths[i].saturating_sub(c.chars().count());
            s.extend(std::iter::repeat_n(' ', pad));
        }
        format!("{}\n", s.trim_end())
    };
    let mut out = String::new();
    if !headers.is_empty() {
        out.push_str(&line(headers.to_vec()));
    }
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// A JSON value as one table cell.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        Value::Array(a) if a.iter().all(|x| !x.is_object() && !x.is_array()) => {
            if a.is_empty() {
                "-".to_string()
            } else {
                a.iter().map(cell).collect::<Vec<_>>().join(", ")
            }
        }
        other => other.to_string(),
    }
}

fn version_line(v: &Value) -> String {
    match v.get("version").and_then(Value::as_u64) {
        Some(n) => format!("config version {n}\n"),
        None => String::new(),
    }
}

/// `tenants list`.
pub fn render_tenants(v: &Value) -> String {
    let empty = serde_json::Map::new();
    let tenants = v["tenants"].as_object().unwrap_or(&empty);
    let rows: Vec<Vec<String>> = tenants
        .iter()
        .map(|(id, t)| {
            vec![
                id.clone(),
                cell(&t["strategy"]),
                cell(&t["pool"]),
                cell(&t["prefix_length"]),
                cell(&t["concurrency_threshold"]),
                cell(&t["block_tokens"]),
                cell(&t["rate_limit_rps"]),
                t["api_key_hashes"]
                    .as_array()
                    .map_or(0, Vec::len)
                    .to_string(),
            ]
        })
        .collect();
    let mut out = if rows.is_empty() {
        "no tenants\n".to_string()
    } else {
        table(
            &[
                "ID",
                "STRATEGY",
                "POOL",
                "PREFIX",
                "THRESHOLD",
                "BLOCK",
                "RPS",
                "KEYS",
            ],
            &rows,
        )
    };
    out.push_str(&version_line(v));
    out
}

/// `tenants get`.
pub fn render_tenant(v: &Value) -> String {
    let t = &v["tenant"];
    let mut rows = vec![vec!["id".to_string(), cell(&v["id"])]];
    for k in [
        "strategy",
        "pool",
        "prefix_length",
        "concurrency_threshold",
        "block_tokens",
        "temperature",
        "rate_limit_rps",
        "cache_salt",
    ] {
        rows.push(vec![k.to_string(), cell(&t[k])]);
    }
    let hashes = t["api_key_hashes"].as_array().cloned().unwrap_or_default();
    if hashes.is_empty() {
        rows.push(vec!["api_key_hashes".into(), "-".into()]);
    }
    for (i, h) in hashes.iter().enumerate() {
        let k = if i == 0 { "api_key_hashes" } else { "" };
        rows.push(vec![k.to_string(), cell(h)]);
    }
    let mut out = table(&[], &rows);
    out.push_str(&version_line(v));
    out
}

/// `pools list`.
pub fn render_pools(v: &Value) -> String {
    let empty = serde_json::Map::new();
    let pools = v["pools"].as_object().unwrap_or(&empty);
    let rows: Vec<Vec<String>> = pools
        .iter()
        .map(|(model, p)| {
            vec![
                model.clone(),
                p["instances"].as_array().map_or(0, Vec::len).to_string(),
                cell(&p["instances"]),
            ]
        })
        .collect();
    let mut out = if rows.is_empty() {
        "no pools\n".to_string()
    } else {
        table(&["MODEL", "INSTANCES", "URLS"], &rows)
    };
    out.push_str(&version_line(v));
    out
}

/// `pools get`.
pub fn render_pool(v: &Value) -> String {
    let urls = v["pool"]["instances"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let rows: Vec<Vec<String>> = urls.iter().map(|u| vec![cell(u)]).collect();
    let mut out = format!("model {}\n", cell(&v["model"]));
    if rows.is_empty() {
        out.push_str("no instances\n");
    } else {
        out.push_str(&table(&["INSTANCE"], &rows));
    }
    out.push_str(&version_line(v));
    out
}

/// Any write.
pub fn render_write(v: &Value) -> String {
    let mut out = match v.get("version").and_then(Value::as_u64) {
        Some(n) => format!("ok: config version {n}\n"),
        None => "ok\n".to_string(),
    };
    if let Some(h) = v.get("key_hash").and_then(Value::as_str) {
        out.push_str(&format!("key hash {h}\n"));
    }
    if let Some(hashes) = v
        .pointer("/tenant/api_key_hashes")
        .and_then(Value::as_array)
    {
        out.push_str(&format!("api keys {}\n", hashes.len()));
    }
    out
}

/// `cluster`: Raft status, its members, then the gossip view.
pub fn render_cluster(v: &Value) -> String {
    let r = &v["raft"];
    let leader = match (r["leader"].as_u64(), r["leader_url"].as_str()) {
        (Some(id), Some(url)) => format!("{id} ({url})"),
        (Some(id), None) => id.to_string(),
        _ => "none".to_string(),
    };
    let rows = vec![
        vec!["node".to_string(), cell(&r["node_id"])],
        vec![
            "role".into(),
            if r["quorum_lost"] == true {
                format!("{} (quorum lost: cut off)", cell(&r["role"]))
            } else {
                cell(&r["role"])
            },
        ],
        vec!["leader".into(), leader],
        vec!["term".into(), cell(&r["term"])],
        vec!["last log index".into(), cell(&r["last_log_index"])],
        vec!["applied index".into(), cell(&r["applied_index"])],
        vec!["config version".into(), cell(&r["config_version"])],
        vec![
            "ms since quorum ack".into(),
            cell(&r["millis_since_quorum_ack"]),
        ],
    ];
    let mut out = table(&[], &rows);
    let mut members = Vec::new();
    for (kind, key) in [("voter", "members"), ("learner", "learners")] {
        for (id, url) in r[key].as_object().into_iter().flatten() {
            let lag = r["replication_lag"][id.as_str()].clone();
            members.push(vec![id.clone(), kind.to_string(), cell(url), cell(&lag)]);
        }
    }
    if !members.is_empty() {
        out.push('\n');
        out.push_str(&table(&["ID", "KIND", "URL", "LAG"], &members));
    }
    if !v["gossip"].is_null() {
        out.push_str("\ngossip\n");
        out.push_str(&render_generic(&v["gossip"]));
    }
    out
}

/// `index`.
pub fn render_index(v: &Value) -> String {
    let mut out = render_generic(&v["index"]);
    out.push_str(&version_line(v));
    out
}

/// `explain`.
pub fn render_explain(v: &Value) -> String {
    let mut out = format!("tenant {}\n", cell(&v["tenant"]));
    out.push_str(&render_generic(&v["decision"]));
    out
}

/// Any JSON: an object as key/value rows (arrays of objects as their own tables), an array
/// of objects as a table of the union of their keys, anything else as one line.
pub fn render_generic(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut rows = Vec::new();
            let mut nested = String::new();
            for (k, x) in m {
                match x {
                    Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_object) => {
                        nested.push_str(&format!("\n{k}\n"));
                        nested.push_str(&render_generic(x));
                    }
                    _ => rows.push(vec![k.clone(), cell(x)]),
                }
            }
            let mut out = table(&[], &rows);
            out.push_str(&nested);
            out
        }
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_object) => {
            let mut cols: Vec<String> = Vec::new();
            for o in a.iter().filter_map(Value::as_object) {
                for k in o.keys() {
                    if !cols.contains(k) {
                        cols.push(k.clone());
                    }
                }
            }
            let rows: Vec<Vec<String>> = a
                .iter()
                .map(|o| cols.iter().map(|c| cell(&o[c.as_str()])).collect())
                .collect();
            let upper: Vec<String> = cols.iter().map(|c| c.to_uppercase()).collect();
            let headers: Vec<&str> = upper.iter().map(String::as_str).collect();
            table(&headers, &rows)
        }
        other => format!("{}\n", cell(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_as_tables() {
        let h = "ab".repeat(32);
        type Render = fn(&Value) -> String;
        let cases: Vec<(&str, Render, Value, &str)> = vec![
            (
                "tenants list",
                render_tenants,
                json!({"version": 7, "tenants": {
                    "acme": {"strategy": "prefix-aware", "pool": "llama", "prefix_length": 0,
                        "concurrency_threshold": 32, "block_tokens": 64, "rate_limit_rps": null,
                        "api_key_hashes": [h]},
                    "b": {"strategy": "round-robin", "pool": "m", "prefix_length": 128,
                        "concurrency_threshold": 0, "block_tokens": 16, "rate_limit_rps": 2.5,
                        "api_key_hashes": []},
                }}),
                "ID    STRATEGY      POOL   PREFIX  THRESHOLD  BLOCK  RPS  KEYS\n\
                 acme  prefix-aware  llama  0       32         64     -    1\n\
                 b     round-robin   m      128     0          16     2.5  0\n\
                 config version 7\n",
            ),
            (
                "no tenants",
                render_tenants,
                json!({"version": 0, "tenants": {}}),
                "no tenants\nconfig version 0\n",
            ),
            (
                "tenant get",
                render_tenant,
                json!({"version": 3, "id": "acme", "tenant": {"strategy": "kv-aware",
                    "pool": "m", "prefix_length": 0, "concurrency_threshold": 32,
                    "block_tokens": 64, "temperature": 0.5, "rate_limit_rps": null,
                    "cache_salt": "s", "api_key_hashes": ["h1", "h2"]}}),
                "id                     acme\n\
                 strategy               kv-aware\n\
                 pool                   m\n\
                 prefix_length          0\n\
                 concurrency_threshold  32\n\
                 block_tokens           64\n\
                 temperature            0.5\n\
                 rate_limit_rps         -\n\
                 cache_salt             s\n\
                 api_key_hashes         h1\n\
                 \x20                      h2\n\
                 config version 3\n",
            ),
            (
                "pools list",
                render_pools,
                json!({"version": 4, "pools": {
                    "llama": {"instances": ["http://a:1", "http://b:2"]},
                    "m": {"instances": []},
                }}),
                "MODEL  INSTANCES  URLS\n\
                 llama  2          http://a:1, http://b:2\n\
                 m      0          -\n\
                 config version 4\n",
            ),
            (
                "pool get",
                render_pool,
                json!({"version": 4, "model": "llama", "pool": {"instances": ["http://a:1"]}}),
                "model llama\nINSTANCE\nhttp://a:1\nconfig version 4\n",
            ),
            (
                "write with key",
                render_write,
                json!({"version": 9, "key_hash": "abc"}),
                "ok: config version 9\nkey hash abc\n",
            ),
            (
                "cluster",
                render_cluster,
                json!({"version": 5, "raft": {"node_id": 1, "role": "Leader", "leader": 1,
                    "leader_url": "http://r1:7000", "term": 2, "last_log_index": 5,
                    "applied_index": 5, "config_version": 5,
                    "members": {"1": "http://r1:7000", "2": "http://r2:7000"},
                    "learners": {"3": "http://r3:7000"},
                    "replication_lag": {"2": 0, "3": 4}, "millis_since_quorum_ack": 12},
                    "gossip": {"node_id": "r1", "peers": [{"id": "r2", "addr": "10.0.0.2:7100"}]}}),
                "node                 1\n\
                 role                 Leader\n\
                 leader               1 (http://r1:7000)\n\
                 term                 2\n\
                 last log index       5\n\
                 applied index        5\n\
                 config version       5\n\
                 ms since quorum ack  12\n\
                 \n\
                 ID  KIND     URL             LAG\n\
                 1   voter    http://r1:7000  -\n\
                 2   voter    http://r2:7000  0\n\
                 3   learner  http://r3:7000  4\n\
                 \n\
                 gossip\n\
                 node_id  r1\n\
                 \n\
                 peers\n\
                 ADDR           ID\n\
                 10.0.0.2:7100  r2\n",
            ),
            (
                "index",
                render_index,
                json!({"version": 2, "index": {"blocks": 10, "instances": 2}}),
                "blocks     10\ninstances  2\nconfig version 2\n",
            ),
        ];
        for (name, render, value, want) in cases {
            assert_eq!(render(&value), want, "case {name}");
        }
    }

    fn args(url: &str, json: bool, command: AdminCommand) -> AdminArgs {
        AdminArgs {
            url: url.to_string(),
            token: None,
            json,
            command,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cli_against_a_live_api() {
        use crate::admin::testing::{Harness, TOKEN};
        let h = Harness::start(false).await;
        let token = || TOKEN.to_string();
        let pool_put = AdminCommand::Pools(PoolsCommand::Put {
            model: "m".into(),
            instances: vec!["http://a:1".into()],
            expected_version: None,
        });
        let out = execute(&args(&h.base, false, pool_put), token()).await;
        assert!(
            out.as_ref()
                .is_ok_and(|o| o.starts_with("ok: config version ")),
            "{out:?}"
        );
        let put = |strategy: Option<&str>, pool: Option<&str>, key: Option<&str>| {
            AdminCommand::Tenants(TenantsCommand::Put(TenantPutArgs {
                id: "acme co".into(),
                strategy: strategy.map(str::to_string),
                pool: pool.map(str::to_string),
                prefix_length: None,
                concurrency_threshold: None,
                block_tokens: Some(16),
                rate_limit_rps: None,
                api_keys: key.map(str::to_string).into_iter().collect(),
                expected_version: None,
            }))
        };
        // A new tenant needs a pool; the id needs encoding (and is refused: tenant ids are
        // letters, digits, '.', '_' and '-').
        let e = execute(&args(&h.base, false, put(None, None, None)), token()).await;
        assert!(format!("{e:?}").contains("--pool is required"), "{e:?}");
        let e = execute(&args(&h.base, false, put(None, Some("m"), None)), token()).await;
        assert!(
            format!("{e:?}")
                .contains("HTTP 400 Bad Request: invalid tenant: tenant id \"acme co\""),
            "{e:?}"
        );
        let ok = |c: AdminCommand| {
            let a = args(&h.base, false, c);
            async move {
                execute(&a, token())
                    .await
                    .unwrap_or_else(|e| format!("{e:#}"))
            }
        };
        let put_acme = |strategy: Option<&str>, pool: Option<&str>, key: Option<&str>| match put(
            strategy, pool, key,
        ) {
            AdminCommand::Tenants(TenantsCommand::Put(mut p)) => {
                p.id = "acme".into();
                AdminCommand::Tenants(TenantsCommand::Put(p))
            }
            other => other,
        };
        let out = ok(put_acme(Some("kv-aware"), Some("m"), Some("sk-1"))).await;
        assert!(out.contains("api keys 1"), "{out}");
        // An update keeps the keys and block size and changes only the strategy.
        let out = ok(put_acme(Some("round-robin"), None, None)).await;
        assert!(out.contains("api keys 1"), "{out}");
        let list = ok(AdminCommand::Tenants(TenantsCommand::List)).await;
        let mut lines = list.lines();
        assert_eq!(
            lines.next(),
            Some("ID    STRATEGY     POOL  PREFIX  THRESHOLD  BLOCK  RPS  KEYS")
        );
        assert_eq!(
            lines.next(),
            Some("acme  round-robin  m     0       0          16     -    1")
        );
        let json_out = execute(
            &args(&h.base, true, AdminCommand::Pools(PoolsCommand::List)),
            token(),
        )
        .await
        .unwrap_or_default();
        let v: Value = serde_json::from_str(&json_out).unwrap_or_default();
        assert_eq!(v["pools"]["m"]["instances"], json!(["http://a:1"]));
        let stale = AdminCommand::Tenants(TenantsCommand::Delete {
            id: "acme".into(),
            expected_version: Some(1),
        });
        let e = ok(stale).await;
        assert!(e.starts_with("HTTP 409 Conflict: version conflict"), "{e}");
        let e = execute(&args(&h.base, false, AdminCommand::Index), "wrong".into()).await;
        assert!(
            format!("{e:?}").contains("HTTP 401 Unauthorized: wrong admin token"),
            "{e:?}"
        );
        h.stop().await;
    }

    #[test]
    fn errors_are_one_line() {
        let cases = [
            (
                409,
                json!({"error": {"message": "version conflict: the configuration is at version 7"},
                    "current_version": 7}),
                "HTTP 409 Conflict: version conflict: the configuration is at version 7",
            ),
            (
                400,
                json!({"error": {"message": "invalid tenant: a; b"}, "problems": ["a", "b"]}),
                "HTTP 400 Bad Request: invalid tenant: a; b",
            ),
            (
                502,
                json!("bad\ngateway"),
                "HTTP 502 Bad Gateway: bad gateway",
            ),
            (
                500,
                Value::Null,
                "HTTP 500 Internal Server Error: (no body)",
            ),
        ];
        for (status, body, want) in cases {
            assert_eq!(describe_error(status, &body), want);
        }
    }

    #[test]
    fn token_from_flag_or_env_map() {
        let env = HashMap::from([(ENV_ADMIN_TOKEN.to_string(), "from-env".to_string())]);
        let none = HashMap::new();
        assert_eq!(
            resolve_token(Some("flag".into()), &env).ok().as_deref(),
            Some("flag")
        );
        assert_eq!(resolve_token(None, &env).ok().as_deref(), Some("from-env"));
        assert!(resolve_token(None, &none).is_err());
        assert!(resolve_token(Some("  ".into()), &none).is_err());
    }

    #[test]
    fn encodes_path_segments() {
        assert_eq!(encode("acme"), "acme");
        assert_eq!(encode("a/b c"), "a%2Fb%20c");
        assert_eq!(encode("http://a:1"), "http%3A%2F%2Fa%3A1");
    }

    #[test]
    fn parses_the_command_line() {
        use clap::Parser;
        #[derive(Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            admin: AdminArgs,
        }
        let cli = Cli::try_parse_from([
            "admin",
            "tenants",
            "put",
            "acme",
            "--strategy",
            "kv-aware",
            "--pool",
            "m",
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--json",
        ]);
        let Ok(cli) = cli else {
            panic!("parse failed: {cli:?}");
        };
        assert!(cli.admin.json);
        assert_eq!(cli.admin.url, DEFAULT_URL);
        match cli.admin.command {
            AdminCommand::Tenants(TenantsCommand::Put(p)) => {
                assert_eq!(p.api_keys, ["k1", "k2"]);
                assert_eq!(p.strategy.as_deref(), Some("kv-aware"));
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(
            Cli::try_parse_from(["admin", "pools", "remove-instance", "m", "http://a:1"]).is_ok()
        );
        assert!(Cli::try_parse_from(["admin", "explain", "--tenant", "t"]).is_err());
    }
}
