//! Router configuration: a versioned TOML file (unknown fields rejected), validated into
//! typed settings. Flags can stand in for a file in small setups.
//!
//! ```toml
//! version = 1
//!
//! [router]
//! listen = "127.0.0.1:8080"
//!
//! [[pools]]
//! model = "sim-llama"
//! instances = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
//! adapters = ["sql-lora"]         # LoRA adapters the instances serve (optional)
//!
//! [[tenants]]
//! id = "acme"
//! api_keys = ["sk-acme-1"]        # or api_key_hashes = ["<blake3 hex>"]
//! strategy = "prefix-aware"
//! prefix_length = 0              # tokens used for matching; 0 = the whole prompt
//! concurrency_threshold = 0      # an upper bound on in-flight requests; 0 = none
//! ```

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;
use warmpath_index::policy::Strategy;
pub use warmpath_membership::raft::state::Pool;
use warmpath_membership::raft::state::{
    api_key_hash, canonical_instance_url, check_plain_key, check_tenant_id, instance_url,
    pool_clashes, pool_problems, validate_tenant, PoolSpec, TenantSpec,
};

/// The only config file version this build reads.
pub const CONFIG_VERSION: u32 = 1;

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub version: u32,
    #[serde(default)]
    pub router: RouterSection,
    #[serde(default)]
    pub pools: Vec<PoolSection>,
    #[serde(default)]
    pub tenants: Vec<TenantSection>,
    /// Router replicas: gossip with peers (absent: this router runs alone).
    #[serde(default)]
    pub cluster: Option<ClusterSection>,
    /// Tenant configuration in Raft, and the admin API (absent: tenants and pools come
    /// from this file and cannot change without a restart).
    #[serde(default)]
    pub raft: Option<RaftSection>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct RaftSection {
    /// This router's Raft node id; stable across restarts.
    pub node_id: u64,
    /// Where the Raft log, vote and snapshots live.
    pub data_dir: String,
    /// Address of the admin API (and of the Raft RPCs between routers).
    pub admin_listen: String,
    /// File holding the admin API's bearer token.
    pub admin_token_file: String,
    /// The voters (3 or 5), node id → admin base URL; a router not listed joins as a learner.
    pub voters: BTreeMap<String, String>,
    /// File holding the token routers send each other on Raft RPCs; required unless
    /// `insecure_without_peer_token` is set.
    #[serde(default)]
    pub peer_token_file: Option<String>,
    /// Serve and send Raft RPCs without a peer token: anyone who reaches an admin port can
    /// then rewrite the configuration. For tests on a private machine only; warned at start.
    #[serde(default)]
    pub insecure_without_peer_token: bool,
}

/// Validated Raft settings.
#[derive(Debug, Clone)]
pub struct RaftSettings {
    pub node_id: u64,
    pub data_dir: std::path::PathBuf,
    pub admin_listen: SocketAddr,
    pub admin_token: String,
    pub voters: BTreeMap<u64, String>,
    pub peer_token: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// This router's name in the cluster; unique per replica.
    pub node_id: String,
    /// UDP address for gossip; port 0 picks a free one.
    pub gossip_listen: String,
    /// Gossip addresses (`host:port`) of other routers to join through.
    #[serde(default)]
    pub seeds: Vec<String>,
    #[serde(default = "default_gossip_interval_ms")]
    pub gossip_interval_ms: u64,
    /// File holding the cluster secret that authenticates every gossip datagram (all
    /// routers need the same one); required when gossip listens on a non-loopback address,
    /// unless `insecure_without_secret` is set.
    #[serde(default)]
    pub secret_file: Option<String>,
    /// Gossip without a secret on a non-loopback address: anyone who can send UDP there
    /// can join, read every router's address and load, and steer routing. Warned at start.
    #[serde(default)]
    pub insecure_without_secret: bool,
}

fn default_gossip_interval_ms() -> u64 {
    50
}

/// Validated cluster settings.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    pub node_id: String,
    pub gossip_listen: SocketAddr,
    pub seeds: Vec<String>,
    pub gossip_interval: Duration,
    pub secret: Option<Vec<u8>>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields, default)]
pub struct RouterSection {
    pub listen: String,
    /// Largest request body accepted, bytes (larger: 413).
    pub max_body_bytes: usize,
    pub connect_timeout_ms: u64,
    /// Time allowed for an instance's response headers; past it the attempt is retried.
    pub first_byte_timeout_ms: u64,
    /// Longest silence of a streaming response between two chunks; past it the stream
    /// ends with an error event. (An instance found down ends it at once.)
    pub stream_idle_timeout_ms: u64,
    /// Time allowed for a whole request, streaming included.
    pub request_timeout_ms: u64,
    /// Longest wait for a request's headers, and for the next request on an idle
    /// keep-alive connection, ms.
    pub header_read_timeout_ms: u64,
    /// Longest wait for a request's whole body, ms.
    pub body_read_timeout_ms: u64,
    /// Most client connections served at once (beyond: 503 and close); 0 = the soft
    /// open-file limit less 256.
    pub max_connections: usize,
    /// Address of a separate `/metrics` listener, for Prometheus on a private network.
    pub metrics_listen: Option<String>,
    /// Whether the client port serves `/metrics` (which names instances, their loads and
    /// tenants). Default: only when it listens on loopback and no `metrics_listen` is set.
    pub client_metrics: Option<bool>,
    /// Further instances tried after a failure before the first response byte.
    pub retries: u32,
    pub health_interval_ms: u64,
    /// First passive ejection of a failing instance; doubles per consecutive failure.
    pub eject_base_ms: u64,
    pub eject_max_ms: u64,
    /// Whether `x-tenant-id` may name the tenant when no API key does (only tenants
    /// without API keys; off by default).
    pub allow_tenant_header: bool,
    /// Tenant used when a request names none; empty: such requests get 401.
    pub default_tenant: String,
    /// Capacity of the prefix index, blocks.
    pub index_capacity_blocks: usize,
    /// Lifetime of a routing prediction, ms.
    pub predicted_ttl_ms: u64,
    /// Model profile for kv-aware cost estimates.
    pub profile: String,
    /// Seconds `Retry-After` suggests on 503 and 429.
    pub retry_after_s: u64,
}

impl Default for RouterSection {
    fn default() -> Self {
        RouterSection {
            listen: "127.0.0.1:8080".into(),
            max_body_bytes: 8 << 20,
            connect_timeout_ms: 2_000,
            first_byte_timeout_ms: 60_000,
            stream_idle_timeout_ms: 60_000,
            request_timeout_ms: 600_000,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            max_connections: 0,
            metrics_listen: None,
            client_metrics: None,
            retries: 2,
            health_interval_ms: 1_000,
            eject_base_ms: 1_000,
            eject_max_ms: 30_000,
            allow_tenant_header: false,
            default_tenant: "default".into(),
            index_capacity_blocks: 1 << 20,
            predicted_ttl_ms: 120_000,
            profile: "default".into(),
            retry_after_s: 1,
        }
    }
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    /// Model name clients ask for.
    pub model: String,
    /// Base URLs of the instances serving it (`http://host:port`).
    pub instances: Vec<String>,
    /// The cache-agents of its hosts (`[NAME@]HOST:PORT` of their residency listeners;
    /// NAME, the one in the agent's certificate, defaults to HOST; `dns:` before an entry:
    /// every address HOST resolves to, each its own agent).
    #[serde(default)]
    pub agents: Vec<String>,
    /// The engines' tokenizer: builtin, tiktoken:o200k_base, tiktoken:cl100k_base or
    /// hf:PATH (see `crate::prompt`).
    #[serde(default)]
    pub tokenizer: String,
    /// The model's chat template, inline (Jinja)…
    #[serde(default)]
    pub chat_template: String,
    /// …or read from this file at start.
    #[serde(default)]
    pub chat_template_file: Option<std::path::PathBuf>,
    /// The engines' KV block size in tokens (0: each tenant's `block_tokens`).
    #[serde(default)]
    pub block_tokens: u32,
    /// The LoRA adapters its engines serve: requests naming one come to this pool, keyed
    /// for the adapter (see [`PoolSpec::adapters`]).
    #[serde(default)]
    pub adapters: Vec<String>,
}

/// A tenant in the config file: its id, plain API keys (hashed at once, never stored),
/// and its [`TenantSpec`], the one definition of a tenant, flattened into the same table.
/// `pool` may be left out: the file's tenants then serve its first pool. Unknown fields
/// are refused by [`FileConfig::parse`] (serde cannot refuse them through a flatten).
#[derive(Deserialize, Debug, Clone)]
pub struct TenantSection {
    pub id: String,
    #[serde(default)]
    pub api_keys: Vec<String>,
    #[serde(flatten)]
    pub spec: TenantSpec,
}

impl TenantSection {
    /// A tenant with every setting at its default.
    pub fn with_defaults(id: &str) -> Self {
        TenantSection {
            id: id.to_string(),
            api_keys: Vec::new(),
            spec: TenantSpec::default(),
        }
    }
}

/// A tenant as the request path reads it: compiled once from its [`TenantSpec`]
/// ([`Tenant::compile`]), with the strategy parsed and the key hashes as bytes.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub id: String,
    pub api_key_hashes: Vec<[u8; 32]>,
    pub strategy: Strategy,
    pub prefix_length: u32,
    pub concurrency_threshold: u32,
    pub block_tokens: u32,
    pub temperature: f64,
    pub cache_salt: String,
    /// Requests per second across all routers; `None`: unlimited.
    pub rate_limit_rps: Option<f64>,
    /// Whether `x-warmpath-explain: 1` is answered for this tenant.
    pub allow_explain: bool,
}

impl Tenant {
    /// The request path's view of tenant `id`. Specs are validated before they are stored,
    /// so a strategy this build does not know can only come from a newer router during a
    /// rolling upgrade: the tenant then keeps serving with the default strategy (and a
    /// warning), never disappears.
    pub fn compile(id: &str, spec: &TenantSpec) -> Tenant {
        let strategy = spec.strategy.parse::<Strategy>().unwrap_or_else(|e| {
            tracing::warn!(tenant_id = %id, error = %e, "unknown strategy; routing with prefix-aware");
            metrics::counter!(crate::metric_names::ROUTER_TENANT_STRATEGY_FALLBACKS_TOTAL).increment(1);
            Strategy::PrefixAware
        });
        Tenant {
            id: id.to_string(),
            api_key_hashes: spec
                .api_key_hashes
                .iter()
                .filter_map(|h| parse_hex32(h))
                .collect(),
            strategy,
            prefix_length: spec.prefix_length,
            concurrency_threshold: spec.concurrency_threshold,
            block_tokens: spec.block_tokens.max(1),
            temperature: spec.temperature,
            cache_salt: spec.cache_salt.clone(),
            rate_limit_rps: spec.rate_limit_rps,
            allow_explain: spec.allow_explain,
        }
    }
}

/// Validated router settings.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub max_connections: usize,
    pub metrics_listen: Option<SocketAddr>,
    /// Whether the client port serves `/metrics`.
    pub client_metrics: bool,
    pub connect_timeout: Duration,
    pub first_byte_timeout: Duration,
    pub stream_idle_timeout: Duration,
    pub request_timeout: Duration,
    pub retries: u32,
    pub health_interval: Duration,
    pub eject_base: Duration,
    pub eject_max: Duration,
    pub allow_tenant_header: bool,
    pub default_tenant: Option<String>,
    pub index_capacity_blocks: usize,
    pub predicted_ttl: Duration,
    pub profile: String,
    pub retry_after_s: u64,
    pub pools: Vec<Pool>,
    /// Every tenant, validated and complete (pool and cache salt filled in).
    pub tenants: Vec<(String, TenantSpec)>,
    pub cluster: Option<ClusterSettings>,
    pub raft: Option<RaftSettings>,
}

/// blake3 of an API key, as stored.
pub fn hash_api_key(key: &str) -> [u8; 32] {
    *blake3::hash(key.as_bytes()).as_bytes()
}

/// 64 hex digits as 32 bytes (an API key hash as stored).
pub fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        let hex = std::str::from_utf8(chunk).ok()?;
        out[i] = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("invalid config {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<FileConfig> {
        let config: FileConfig = toml::from_str(text)?;
        // Tenants flatten their spec, so serde cannot refuse unknown fields there.
        let raw: toml::Table = toml::from_str(text)?;
        if let Some(toml::Value::Array(tenants)) = raw.get("tenants") {
            for (i, t) in tenants.iter().enumerate() {
                if let toml::Value::Table(t) = t {
                    let unknown = TenantSpec::unknown_fields(t.keys(), &["id", "api_keys"]);
                    if !unknown.is_empty() {
                        bail!("tenants[{i}]: unknown field(s) {}", unknown.join(", "));
                    }
                }
            }
        }
        if config.version != CONFIG_VERSION {
            bail!(
                "config version {} is not supported; this build reads version {CONFIG_VERSION}",
                config.version
            );
        }
        Ok(config)
    }

    /// Checks every field and returns the typed settings, or every problem found.
    pub fn validate(&self) -> Result<RouterConfig> {
        let mut problems = Vec::new();
        let r = &self.router;
        let listen = match r.listen.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(e) => {
                problems.push(format!("router.listen {:?}: {e}", r.listen));
                None
            }
        };
        let metrics_listen = match &r.metrics_listen {
            None => None,
            Some(a) => match a.parse::<SocketAddr>() {
                Ok(a) => Some(a),
                Err(e) => {
                    problems.push(format!("router.metrics_listen {a:?}: {e}"));
                    None
                }
            },
        };
        if r.max_body_bytes == 0 {
            problems.push("router.max_body_bytes must be positive".into());
        }
        for (name, v) in [
            ("connect_timeout_ms", r.connect_timeout_ms),
            ("first_byte_timeout_ms", r.first_byte_timeout_ms),
            ("stream_idle_timeout_ms", r.stream_idle_timeout_ms),
            ("request_timeout_ms", r.request_timeout_ms),
            ("header_read_timeout_ms", r.header_read_timeout_ms),
            ("body_read_timeout_ms", r.body_read_timeout_ms),
            ("health_interval_ms", r.health_interval_ms),
            ("eject_base_ms", r.eject_base_ms),
            ("predicted_ttl_ms", r.predicted_ttl_ms),
        ] {
            if v == 0 {
                problems.push(format!("router.{name} must be positive"));
            }
        }
        if warmpath_index::profiles::builtin(&r.profile).is_err() {
            problems.push(format!(
                "router.profile {:?} is not a builtin profile ({})",
                r.profile,
                warmpath_index::profiles::builtin_names().join(", ")
            ));
        }
        let mut models = HashSet::new();
        let mut pools = Vec::new();
        for (i, p) in self.pools.iter().enumerate() {
            if !models.insert(p.model.clone()) {
                problems.push(format!("pools[{i}].model {:?} is listed twice", p.model));
            }
            let chat_template = match &p.chat_template_file {
                Some(path) if p.chat_template.is_empty() => std::fs::read_to_string(path)
                    .unwrap_or_else(|e| {
                        problems.push(format!(
                            "pools[{i}].chat_template_file {}: {e}",
                            path.display()
                        ));
                        String::new()
                    }),
                Some(_) => {
                    problems.push(format!(
                        "pools[{i}]: chat_template and chat_template_file both given; give one"
                    ));
                    String::new()
                }
                None => p.chat_template.clone(),
            };
            if let Err(e) = crate::prompt::PoolText::load(&p.tokenizer, &chat_template) {
                problems.push(format!("pools[{i}]: {e}"));
            }
            // Instance URLs in their canonical form, then the state machine's own pool
            // validator (which says what is wrong with a URL that has none): a file that
            // validates here seeds a cluster that accepts it.
            let spec = PoolSpec {
                instances: p
                    .instances
                    .iter()
                    .map(|u| canonical_instance_url(u))
                    .collect(),
                agents: p.agents.clone(),
                tokenizer: p.tokenizer.clone(),
                chat_template,
                block_tokens: p.block_tokens,
                adapters: p.adapters.clone(),
            };
            for problem in pool_problems(&p.model, &spec) {
                problems.push(format!("pools[{i}].{problem}"));
            }
            // Each pair once: this pool against the ones before it.
            let before = pools.iter().map(|b: &Pool| (b.model.as_str(), &b.spec));
            for problem in pool_clashes(&p.model, &spec, before) {
                problems.push(format!("pools[{i}].{problem}"));
            }
            pools.push(Pool {
                model: p.model.clone(),
                spec,
            });
        }
        // The default tenant exists implicitly, with default settings, unless listed.
        let default_tenant = (!r.default_tenant.is_empty()).then(|| r.default_tenant.clone());
        let implicit = default_tenant
            .as_ref()
            .filter(|d| !self.tenants.iter().any(|t| &t.id == *d))
            .map(|d| TenantSection::with_defaults(d));
        // Tenants: the state machine's own validator, so a file that validates here seeds
        // a cluster that accepts it.
        let first_pool = pools.first().map(|p| p.model.clone()).unwrap_or_default();
        let mut ids = HashSet::new();
        let mut keys: BTreeMap<String, String> = BTreeMap::new();
        let mut tenants = Vec::new();
        for (i, t) in self.tenants.iter().chain(implicit.iter()).enumerate() {
            let at = format!("tenants[{i}] ({:?})", t.id);
            if let Err(why) = check_tenant_id(&t.id) {
                problems.push(format!("tenants[{i}].id: {why}"));
            }
            if !ids.insert(t.id.clone()) {
                problems.push(format!("{at}: id listed twice"));
            }
            let mut spec = t.spec.clone().complete(&t.id);
            if spec.pool.is_empty() {
                spec.pool = first_pool.clone();
            }
            spec.api_key_hashes = spec
                .api_key_hashes
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect();
            for (j, k) in t.api_keys.iter().enumerate() {
                match check_plain_key(k) {
                    Ok(()) => spec.api_key_hashes.push(api_key_hash(k)),
                    Err(why) => problems.push(format!("{at}.api_keys[{j}]: {why}")),
                }
            }
            for problem in validate_tenant(&spec) {
                // A router without pools has no pool for its tenants to name.
                if !(models.is_empty() && problem.starts_with("pool:")) {
                    problems.push(format!("{at}.{problem}"));
                }
            }
            if !spec.pool.is_empty() && !models.is_empty() && !models.contains(&spec.pool) {
                problems.push(format!("{at}.pool: no pool serves model {:?}", spec.pool));
            }
            for h in &spec.api_key_hashes {
                if let Some(other) = keys.insert(h.clone(), t.id.clone()) {
                    if other != t.id {
                        problems.push(format!("{at}: an API key is also {other:?}'s"));
                    }
                }
            }
            tenants.push((t.id.clone(), spec));
        }
        let cluster = self.cluster.as_ref().and_then(|c| {
            let mut ok = true;
            if c.node_id.is_empty() {
                problems.push("cluster.node_id is empty".into());
                ok = false;
            }
            let listen = match c.gossip_listen.parse::<SocketAddr>() {
                Ok(a) => Some(a),
                Err(e) => {
                    problems.push(format!("cluster.gossip_listen {:?}: {e}", c.gossip_listen));
                    None
                }
            };
            if c.gossip_interval_ms == 0 {
                problems.push("cluster.gossip_interval_ms must be positive".into());
                ok = false;
            }
            let secret = match &c.secret_file {
                None => Some(None),
                Some(path) => match std::fs::read(path) {
                    Ok(bytes) if bytes.len() >= 16 => Some(Some(bytes)),
                    Ok(_) => {
                        problems.push(format!(
                            "cluster.secret_file {path:?} holds fewer than 16 bytes"
                        ));
                        None
                    }
                    Err(e) => {
                        problems.push(format!("cluster.secret_file {path:?}: {e}"));
                        None
                    }
                },
            };
            if let (Some(addr), Some(None)) = (listen, &secret) {
                if !addr.ip().is_loopback() && !c.insecure_without_secret {
                    problems.push(format!(
                        "cluster: gossip on {addr}, beyond loopback, needs a cluster secret: \
                         give --gossip-secret-file FILE (cluster.secret_file), the same file \
                         on every router, or --insecure-gossip-without-secret"
                    ));
                }
            }
            if c.secret_file.is_some() && c.insecure_without_secret {
                problems.push(
                    "cluster: a secret and insecure_without_secret are both given; choose one"
                        .into(),
                );
            }
            match (ok, listen, secret) {
                (true, Some(gossip_listen), Some(secret)) => Some(ClusterSettings {
                    node_id: c.node_id.clone(),
                    gossip_listen,
                    seeds: c.seeds.clone(),
                    gossip_interval: Duration::from_millis(c.gossip_interval_ms),
                    secret,
                }),
                _ => None,
            }
        });
        let raft = self.raft.as_ref().and_then(|r| {
            let read_token =
                |what: &str, path: &str, problems: &mut Vec<String>| match std::fs::read_to_string(
                    path,
                ) {
                    Ok(t) if !t.trim().is_empty() => Some(t.trim().to_string()),
                    Ok(_) => {
                        problems.push(format!("raft.{what} {path:?} is empty"));
                        None
                    }
                    Err(e) => {
                        problems.push(format!("raft.{what} {path:?}: {e}"));
                        None
                    }
                };
            let admin_token = read_token("admin_token_file", &r.admin_token_file, &mut problems);
            let peer_token = match (&r.peer_token_file, r.insecure_without_peer_token) {
                (Some(_), true) => {
                    problems.push(
                        "raft: a peer token and insecure_without_peer_token are both given; \
                         choose one"
                            .into(),
                    );
                    None
                }
                (Some(p), false) => Some(read_token("peer_token_file", p, &mut problems)?),
                (None, true) => None,
                (None, false) => {
                    problems.push(
                        "raft: Raft RPCs need a peer token: give --raft-peer-token-file FILE \
                         (raft.peer_token_file), the same file on every router, or \
                         --insecure-raft-without-peer-token to run them unauthenticated"
                            .into(),
                    );
                    None
                }
            };
            let admin_listen = match r.admin_listen.parse::<SocketAddr>() {
                Ok(a) => Some(a),
                Err(e) => {
                    problems.push(format!("raft.admin_listen {:?}: {e}", r.admin_listen));
                    None
                }
            };
            let mut voters = BTreeMap::new();
            for (id, url) in &r.voters {
                match (id.parse::<u64>(), instance_url(url)) {
                    (Ok(id), Ok(url)) => {
                        voters.insert(id, url);
                    }
                    (Err(_), _) => {
                        problems.push(format!("raft.voters: node id {id:?} is not a number"))
                    }
                    (_, Err(e)) => problems.push(format!("raft.voters.{id} {url:?}: {e}")),
                }
            }
            if voters.is_empty() {
                problems.push("raft.voters is empty: list the 3 or 5 voters".into());
            }
            Some(RaftSettings {
                node_id: r.node_id,
                data_dir: r.data_dir.clone().into(),
                admin_listen: admin_listen?,
                admin_token: admin_token?,
                voters,
                peer_token,
            })
        });
        if !problems.is_empty() {
            bail!(
                "{} problem(s):\n  - {}",
                problems.len(),
                problems.join("\n  - ")
            );
        }
        Ok(RouterConfig {
            listen: listen.expect("no problems means it parsed"),
            max_body_bytes: r.max_body_bytes,
            header_read_timeout: Duration::from_millis(r.header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(r.body_read_timeout_ms),
            max_connections: match r.max_connections {
                0 => super::listener::default_max_connections(),
                n => n,
            },
            metrics_listen,
            client_metrics: r.client_metrics.unwrap_or_else(|| {
                metrics_listen.is_none() && listen.is_some_and(|l| l.ip().is_loopback())
            }),
            connect_timeout: Duration::from_millis(r.connect_timeout_ms),
            first_byte_timeout: Duration::from_millis(r.first_byte_timeout_ms),
            stream_idle_timeout: Duration::from_millis(r.stream_idle_timeout_ms),
            request_timeout: Duration::from_millis(r.request_timeout_ms),
            retries: r.retries,
            health_interval: Duration::from_millis(r.health_interval_ms),
            eject_base: Duration::from_millis(r.eject_base_ms),
            eject_max: Duration::from_millis(r.eject_max_ms.max(r.eject_base_ms)),
            allow_tenant_header: r.allow_tenant_header,
            default_tenant,
            index_capacity_blocks: r.index_capacity_blocks.max(1),
            predicted_ttl: Duration::from_millis(r.predicted_ttl_ms),
            profile: r.profile.clone(),
            retry_after_s: r.retry_after_s.max(1),
            pools,
            tenants,
            cluster,
            raft,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_config_parses_and_validates() {
        let c = FileConfig::parse(
            r#"
            version = 1
            [router]
            listen = "127.0.0.1:0"
            retries = 3
            [[pools]]
            model = "m"
            instances = ["http://127.0.0.1:9001/", "http://localhost:9002"]
            [[tenants]]
            id = "acme"
            api_keys = ["k1"]
            strategy = "kv-aware"
            concurrency_threshold = 4
            "#,
        )
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(
            c.pools[0].spec.instances,
            vec!["http://127.0.0.1:9001", "http://localhost:9002"]
        );
        assert_eq!(c.retries, 3);
        let (id, acme) = &c.tenants[0];
        assert_eq!(id, "acme");
        assert_eq!(
            (
                acme.strategy.as_str(),
                acme.concurrency_threshold,
                acme.block_tokens,
                acme.pool.as_str()
            ),
            ("kv-aware", 4, 64, "m")
        );
        assert_eq!(acme.api_key_hashes, vec![api_key_hash("k1")]);
        assert_eq!(c.tenants[1].0, "default");
        assert_ne!(acme.cache_salt, c.tenants[1].1.cache_salt);
        let compiled = Tenant::compile(id, acme);
        assert_eq!(compiled.strategy, Strategy::KvAware);
        assert_eq!(compiled.api_key_hashes, vec![hash_api_key("k1")]);
    }

    #[test]
    fn unknown_tenant_fields_are_refused_and_strategies_never_drop_a_tenant() {
        let e = FileConfig::parse("version = 1\n[[tenants]]\nid = \"a\"\nstratgy = \"kv-aware\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("stratgy"), "{e}");
        // A stored strategy this build does not know (a newer router's) still serves.
        let spec = TenantSpec {
            strategy: "from-the-future".into(),
            ..TenantSpec::with_defaults("a", "m")
        };
        assert_eq!(Tenant::compile("a", &spec).strategy, Strategy::PrefixAware);
    }

    #[test]
    fn each_adapter_names_one_pool() {
        let check = |pools: &str, want: &[&str]| {
            let got = FileConfig::parse(&format!("version = 1\n{pools}"))
                .unwrap()
                .validate()
                .map(|c| {
                    let adapters = c.pools.iter().map(|p| p.spec.adapters.clone());
                    adapters.collect::<Vec<_>>()
                })
                .map_err(|e| e.to_string());
            match want {
                [] => assert!(got.is_ok(), "{pools}: {got:?}"),
                _ => {
                    let e = got.unwrap_err();
                    for w in want {
                        assert!(e.contains(w), "{pools}: {w:?} not in {e}");
                    }
                }
            }
        };
        let ok = "[[pools]]\nmodel = \"m\"\ninstances = [\"http://a:1\"]\n\
                  adapters = [\"sql-lora\", \"chat-lora\"]\n\
                  [[pools]]\nmodel = \"q\"\ninstances = [\"http://b:1\"]\n";
        check(ok, &[]);
        check(
            "[[pools]]\nmodel = \"m\"\ninstances = [\"http://a:1\"]\n\
             adapters = [\"m\", \"x y\", \"sql-lora\", \"sql-lora\"]\n",
            &[
                "pools[0].adapters[0] \"m\": the pool's model itself",
                "pools[0].adapters[1] \"x y\": contains whitespace",
                "pools[0].adapters[3] \"sql-lora\": listed twice",
            ],
        );
        check(
            "[[pools]]\nmodel = \"m\"\ninstances = [\"http://a:1\"]\nadapters = [\"lora\"]\n\
             [[pools]]\nmodel = \"lora\"\ninstances = [\"http://b:1\"]\nadapters = [\"m\"]\n\
             [[pools]]\nmodel = \"q\"\ninstances = [\"http://c:1\"]\nadapters = [\"lora\"]\n",
            &[
                "pools[1].model: \"lora\" is an adapter of pool \"m\"",
                "pools[1].adapters[0] \"m\": the model of another pool",
                "pools[2].adapters[0] \"lora\": the model of another pool",
                "pools[2].adapters[0] \"lora\": already an adapter of pool \"m\"",
            ],
        );
    }

    #[test]
    fn every_bad_field_is_listed() {
        let err = FileConfig::parse(
            r#"
            version = 1
            [router]
            listen = "nowhere"
            request_timeout_ms = 0
            [[pools]]
            model = "m"
            instances = ["https://x:1", "http://y:2/v1"]
            [[tenants]]
            id = "a"
            strategy = "fastest"
            block_tokens = 0
            api_key_hashes = ["zz"]
            "#,
        )
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
        for want in [
            "router.listen",
            "request_timeout_ms",
            "instances[0]",
            "instances[1]",
            "fastest",
            "block_tokens",
            "api_key_hashes",
        ] {
            assert!(err.contains(want), "{want} missing in {err}");
        }
    }

    #[test]
    fn unknown_fields_and_versions_are_rejected() {
        assert!(FileConfig::parse("version = 1\nbogus = 2").is_err());
        let e = FileConfig::parse("version = 2").unwrap_err().to_string();
        assert!(e.contains("version 2"), "{e}");
    }
}
