//! The one home of what an operator configures: a tenant ([`TenantSpec`]) and a pool
//! ([`PoolSpec`], [`Pool`]), their validators, the instance-URL rule ([`instance_url`])
//! and the cache-agent address syntax ([`AgentAddress`]). The config file, the Raft state
//! machine, the admin API, the router and the agent's residency client all read them
//! here, so a value one of them takes every other takes too.
//!
//! Pure: plain data and functions, no I/O, no clock. The state machine applies these
//! rules while it replays its log, so a rule only ever accepts more over time, never
//! less (a stored entry that an older build accepted must replay the same).

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Strategies a tenant may name (the names of `warmpath_index::policy::Strategy`).
pub const STRATEGIES: [&str; 4] = ["round-robin", "least-loaded", "prefix-aware", "kv-aware"];

/// Longest tenant id or model name, bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// Longest instance URL or cache salt, bytes.
pub const MAX_VALUE_BYTES: usize = 512;
/// Most instances in one pool.
pub const MAX_POOL_INSTANCES: usize = 4096;
/// Most API keys per tenant.
pub const MAX_TENANT_KEYS: usize = 1024;
/// A tenant: the one definition. It is what Raft stores, what the admin API takes and
/// returns, and what the config file's `[[tenants]]` hold (beside the tenant's `id` and
/// plain `api_keys`, which are hashed before they go anywhere). [`validate_tenant`] is its
/// one validator; the router compiles it for the request path.
///
/// Every field has a default, so input may leave any out (a new tenant's `pool` must still
/// be named unless the config file supplies its first pool; an empty `cache_salt` is
/// derived from the id, see [`TenantSpec::complete`]). Unknown fields are ignored when
/// read, so a rolling upgrade that adds a field does not stop older routers from applying
/// the log; input surfaces (the file, the admin API) reject them with
/// [`TenantSpec::unknown_fields`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(
    description = "A tenant. Every field is optional and takes its default; unknown fields are refused on input."
)]
#[serde(default)]
pub struct TenantSpec {
    /// Routing strategy: round-robin, least-loaded, prefix-aware (the default) or kv-aware.
    #[schema(example = "prefix-aware")]
    pub strategy: String,
    /// Prompt tokens used for prefix matching (SageMaker's prefix length); 0 = the whole
    /// prompt.
    pub prefix_length: u32,
    /// In-flight requests at which an instance is always skipped: an upper bound, since
    /// saturation is otherwise judged against the fleet's load; 0 (the default) = none.
    pub concurrency_threshold: u32,
    /// Tokens per block of this tenant's keys; positive (default 64).
    #[schema(minimum = 1, example = 64)]
    pub block_tokens: u32,
    /// kv-aware sampling temperature; finite and non-negative; 0 = the lowest estimate.
    pub temperature: f64,
    /// Model name of the pool serving this tenant; the pool must exist.
    pub pool: String,
    /// blake3 digests of the tenant's API keys, 64 lowercase hex digits each.
    pub api_key_hashes: Vec<String>,
    /// Salt of this tenant's block keys and engine prefix caches; empty = derived from the
    /// tenant id.
    pub cache_salt: String,
    /// Requests per second allowed across all routers; null = unlimited; otherwise finite
    /// and positive.
    pub rate_limit_rps: Option<f64>,
    /// Whether this tenant's clients may ask for routing explanations
    /// (`x-warmpath-explain: 1`), which name instances and their loads; off by default.
    pub allow_explain: bool,
}

impl TenantSpec {
    /// The cache salt a tenant gets when none is given (the same formula as the file config).
    pub fn default_cache_salt(tenant_id: &str) -> String {
        warmpath_index::keys::default_cache_salt(tenant_id)
    }

    /// A tenant with every default, served by `pool`.
    pub fn with_defaults(tenant_id: &str, pool: &str) -> TenantSpec {
        TenantSpec {
            pool: pool.into(),
            ..TenantSpec::default()
        }
        .complete(tenant_id)
    }

    /// Fills in what input may leave out: the cache salt derived from the id.
    pub fn complete(mut self, tenant_id: &str) -> TenantSpec {
        if self.cache_salt.is_empty() {
            self.cache_salt = TenantSpec::default_cache_salt(tenant_id);
        }
        self
    }

    /// The keys of `object` that are not fields of a tenant nor in `extra`: what input
    /// surfaces refuse (stored tenants ignore them instead).
    pub fn unknown_fields<'a>(
        object: impl IntoIterator<Item = &'a String>,
        extra: &[&str],
    ) -> Vec<String> {
        let known = serde_json::to_value(TenantSpec::default()).unwrap_or_default();
        object
            .into_iter()
            .filter(|k| known.get(k.as_str()).is_none() && !extra.contains(&k.as_str()))
            .cloned()
            .collect()
    }
}

impl Default for TenantSpec {
    /// The defaults every input surface applies to a field left out.
    fn default() -> Self {
        TenantSpec {
            strategy: "prefix-aware".into(),
            prefix_length: 0,
            concurrency_threshold: 0,
            block_tokens: 64,
            temperature: 0.0,
            pool: String::new(),
            api_key_hashes: Vec::new(),
            cache_salt: String::new(),
            rate_limit_rps: None,
            allow_explain: false,
        }
    }
}

/// Why `id` cannot name a new tenant: tenant ids are 1 to 64 characters of ASCII letters,
/// digits, `.`, `_` and `-`, starting with a letter or digit. They travel in headers, logs,
/// metric labels and URLs, where anything else needs quoting. Enforced where tenants are
/// made (the config file, the admin API), not when the log is replayed, so that a log
/// written before the rule still applies the same way.
pub fn check_tenant_id(id: &str) -> Result<(), String> {
    let ok_start = id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    let ok_chars = id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if id.is_empty() || id.len() > 64 || !ok_start || !ok_chars {
        return Err(format!(
            "tenant id {id:?}: use 1 to 64 ASCII letters, digits, '.', '_' or '-', \
             starting with a letter or digit"
        ));
    }
    Ok(())
}

/// The stored form of a plain API key: its blake3 digest in lowercase hex.
pub fn api_key_hash(key: &str) -> String {
    blake3::hash(key.as_bytes()).to_hex().to_string()
}

/// Why a plain API key cannot be used; the key itself is never echoed.
pub fn check_plain_key(key: &str) -> Result<(), &'static str> {
    if key.is_empty() {
        Err("empty")
    } else if key.len() > MAX_VALUE_BYTES {
        Err("longer than 512 bytes")
    } else if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Err("contains whitespace or control characters")
    } else {
        Ok(())
    }
}

/// A cache-agent's residency address as written: `[dns:][NAME@]HOST:PORT`
/// (`[IPV6]:PORT`), no scheme. The one parser of that syntax: the config file, the state
/// machine, the router's `--residency-agent` and its follower of each agent use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentAddress {
    /// `dns:`: every address HOST resolves to, each its own agent (a headless Service).
    pub dns: bool,
    /// `HOST:PORT` as written (brackets kept around an IPv6 address), resolved at each
    /// connection attempt.
    pub address: String,
    /// The name checked in the agent's certificate: NAME, or HOST when none is given (a
    /// NAME lets agents that share one certificate be reached by address).
    pub server_name: String,
}

impl AgentAddress {
    pub fn parse(a: &str) -> Result<AgentAddress, &'static str> {
        if a.len() > MAX_VALUE_BYTES {
            return Err("longer than 512 bytes");
        }
        if a.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("contains whitespace or control characters");
        }
        let (dns, rest) = match a.strip_prefix("dns:") {
            Some(rest) => (true, rest),
            None => (false, a),
        };
        let (name, address) = match rest.split_once('@') {
            Some(("", _)) => return Err("the NAME before @ is empty"),
            Some((name, address)) => (Some(name), address),
            None => (None, rest),
        };
        let Some((host, port)) = address.rsplit_once(':') else {
            return Err("give [dns:][NAME@]HOST:PORT");
        };
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if host.is_empty() || host.contains("://") || host.contains('/') {
            return Err("give [dns:][NAME@]HOST:PORT, no scheme or path");
        }
        if port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err("the port must be 1 to 65535");
        }
        Ok(AgentAddress {
            dns,
            address: address.to_string(),
            server_name: name.unwrap_or(host).to_string(),
        })
    }
}

/// Whether `a` is a cache-agent address ([`AgentAddress`]).
pub fn check_agent_address(a: &str) -> Result<(), &'static str> {
    AgentAddress::parse(a).map(|_| ())
}

/// The instances serving one model. Unknown fields are ignored when read (see
/// [`TenantSpec`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(description = "The instances serving one model.")]
pub struct PoolSpec {
    /// Base URLs, `http://host:port`, no path, no duplicates.
    #[schema(example = json!(["http://10.0.0.1:8000"]))]
    pub instances: Vec<String>,
    /// The cache-agents of the pool's hosts, `[NAME@]HOST:PORT` of their residency (QUIC)
    /// listeners, no duplicates: every router follows them (mutual TLS; NAME, or HOST when
    /// none is given, is the name checked in the agent's certificate). `dns:` before an
    /// entry makes it every address HOST resolves to (a headless Service of agents).
    /// Empty: routers use predictions only.
    #[serde(default)]
    #[schema(example = json!(["gpu-host-1:7700"]))]
    pub agents: Vec<String>,
    /// The engines' tokenizer, so that routers cut blocks where the engines do: `builtin`
    /// (the default, engine-sim's), `tiktoken:o200k_base`, `tiktoken:cl100k_base`, or
    /// `hf:PATH` (a Hugging Face tokenizer.json present at PATH on every router).
    #[serde(default)]
    #[schema(example = "tiktoken:o200k_base")]
    pub tokenizer: String,
    /// The model's chat template (Jinja, as in its tokenizer_config.json); empty: chat
    /// requests are rendered in the built-in format.
    #[serde(default)]
    pub chat_template: String,
    /// The engines' KV block size in tokens; it replaces the `block_tokens` of the
    /// tenants of this pool. 0: each tenant's own.
    #[serde(default)]
    pub block_tokens: u32,
    /// The LoRA adapters the engines serve (vLLM's `--lora-modules` names): a request
    /// whose `model` is one of them goes to this pool and is keyed for the adapter, as the
    /// engines cache its blocks apart from the base model's (record 0097). Each name is
    /// the pool's alone: no other pool's model or adapter. Absent in entries written
    /// before it (read as none).
    #[serde(default)]
    #[schema(example = json!(["sql-lora"]))]
    pub adapters: Vec<String>,
}

/// A pool with the model it serves: what a router runs on, from its config file or from
/// the Raft state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    pub model: String,
    pub spec: PoolSpec,
}

/// The largest chat template a pool may carry, in bytes.
pub const MAX_CHAT_TEMPLATE_BYTES: usize = 64 * 1024;

/// Whether `t` names a tokenizer a pool may use (the file of `hf:PATH` is checked by the
/// router that loads it, not here).
pub fn check_tokenizer(t: &str) -> Result<(), String> {
    match t {
        "" | "builtin" | "tiktoken:o200k_base" | "tiktoken:cl100k_base" => Ok(()),
        _ if t.strip_prefix("hf:").is_some_and(|p| !p.is_empty() && p.len() <= 4096) => Ok(()),
        _ => Err(format!(
            "{t:?}: builtin, tiktoken:o200k_base, tiktoken:cl100k_base or hf:PATH (a Hugging Face tokenizer.json)"
        )),
    }
}

pub fn check_name(field: &str, name: &str, problems: &mut Vec<String>) {
    if name.is_empty() {
        problems.push(format!("{field}: empty"));
    } else if name.len() > MAX_NAME_BYTES {
        problems.push(format!("{field}: longer than {MAX_NAME_BYTES} bytes"));
    } else if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        problems.push(format!(
            "{field} {name:?}: contains whitespace or control characters"
        ));
    }
}

/// Every problem of a tenant spec that can be seen without the rest of the state.
pub fn validate_tenant(spec: &TenantSpec) -> Vec<String> {
    let mut problems = Vec::new();
    if !STRATEGIES.contains(&spec.strategy.as_str()) {
        problems.push(format!(
            "strategy {:?}: not one of {}",
            spec.strategy,
            STRATEGIES.join(", ")
        ));
    }
    if spec.block_tokens == 0 {
        problems.push("block_tokens: must be positive".to_string());
    }
    if !(spec.temperature.is_finite() && spec.temperature >= 0.0) {
        problems.push(format!(
            "temperature {}: must be a finite non-negative number",
            spec.temperature
        ));
    }
    if spec.pool.is_empty() {
        problems.push("pool: empty".to_string());
    }
    if spec.api_key_hashes.len() > MAX_TENANT_KEYS {
        problems.push(format!(
            "api_key_hashes: {} keys, at most {MAX_TENANT_KEYS}",
            spec.api_key_hashes.len()
        ));
    }
    let mut seen = BTreeSet::new();
    for (i, h) in spec.api_key_hashes.iter().enumerate() {
        if !is_key_hash(h) {
            problems.push(format!("api_key_hashes[{i}]: not 64 lowercase hex digits"));
        } else if !seen.insert(h) {
            problems.push(format!("api_key_hashes[{i}]: listed twice"));
        }
    }
    if spec.cache_salt.is_empty() {
        problems.push("cache_salt: empty".to_string());
    } else if spec.cache_salt.len() > MAX_VALUE_BYTES {
        problems.push(format!("cache_salt: longer than {MAX_VALUE_BYTES} bytes"));
    }
    if let Some(rps) = spec.rate_limit_rps {
        if !(rps.is_finite() && rps > 0.0) {
            problems.push(format!(
                "rate_limit_rps {rps}: must be a finite positive number"
            ));
        }
    }
    problems
}

/// Whether `s` is a blake3 digest in lowercase hex.
pub fn is_key_hash(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// What is wrong with pool `model` as `spec` gives it; empty when the state machine
/// takes it. The one validator of a pool: the config file's pools are checked by it too,
/// so a file that validates seeds a cluster that accepts it.
pub fn pool_problems(model: &str, spec: &PoolSpec) -> Vec<String> {
    let mut problems = Vec::new();
    check_name("model", model, &mut problems);
    list_problems(
        "instances",
        &spec.instances,
        check_instance_url,
        &mut problems,
    );
    if let Err(e) = check_tokenizer(&spec.tokenizer) {
        problems.push(format!("tokenizer: {e}"));
    }
    if spec.chat_template.len() > MAX_CHAT_TEMPLATE_BYTES {
        problems.push(format!(
            "chat_template: {} bytes, at most {MAX_CHAT_TEMPLATE_BYTES}",
            spec.chat_template.len()
        ));
    }
    if spec.block_tokens > 65_536 {
        problems.push("block_tokens: at most 65536".to_string());
    }
    list_problems("agents", &spec.agents, check_agent_address, &mut problems);
    list_problems(
        "adapters",
        &spec.adapters,
        |a| check_adapter(model, a),
        &mut problems,
    );
    problems
}

/// Whether `adapter` may be an adapter of pool `model`: a model name (as [`check_name`]
/// has it), not the model itself.
fn check_adapter(model: &str, adapter: &str) -> Result<(), String> {
    if adapter.is_empty() {
        Err("empty".into())
    } else if adapter.len() > MAX_NAME_BYTES {
        Err(format!("longer than {MAX_NAME_BYTES} bytes"))
    } else if adapter.chars().any(|c| c.is_control() || c.is_whitespace()) {
        Err("contains whitespace or control characters".into())
    } else if adapter == model {
        Err("the pool's model itself".into())
    } else {
        Ok(())
    }
}

/// What pool `model` (as `spec` gives it) clashes with among `others` (the other pools,
/// by model; an entry for `model` itself is skipped): a request's `model` must name one
/// pool, so no name is both a model and an adapter, or two pools' adapter.
pub fn pool_clashes<'a>(
    model: &str,
    spec: &PoolSpec,
    others: impl IntoIterator<Item = (&'a str, &'a PoolSpec)>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (other, o) in others {
        if other == model {
            continue;
        }
        if o.adapters.iter().any(|a| a == model) {
            problems.push(format!("model: {model:?} is an adapter of pool {other:?}"));
        }
        for (i, a) in spec.adapters.iter().enumerate() {
            if a == other {
                problems.push(format!("adapters[{i}] {a:?}: the model of another pool"));
            } else if o.adapters.contains(a) {
                problems.push(format!(
                    "adapters[{i}] {a:?}: already an adapter of pool {other:?}"
                ));
            }
        }
    }
    problems
}

/// The problems of a pool's list `field` (instances, agents): at most
/// [`MAX_POOL_INSTANCES`] entries, each passing `check`, none twice.
fn list_problems<E: std::fmt::Display>(
    field: &str,
    items: &[String],
    check: impl Fn(&str) -> Result<(), E>,
    problems: &mut Vec<String>,
) {
    if items.len() > MAX_POOL_INSTANCES {
        problems.push(format!(
            "{field}: {} {field}, at most {MAX_POOL_INSTANCES}",
            items.len()
        ));
    }
    let mut seen = BTreeSet::new();
    for (i, item) in items.iter().enumerate() {
        if let Err(e) = check(item) {
            problems.push(format!("{field}[{i}] {item:?}: {e}"));
        }
        if !seen.insert(item) {
            problems.push(format!("{field}[{i}] {item:?}: listed twice"));
        }
    }
}

/// The one rule for an instance's base URL, wherever one is given (the config file, the
/// admin API, `--instance`, a Raft voter): `http://`, a host (a DNS name, an IPv4 address
/// or a bracketed IPv6 one), an optional port (80 when none is given), nothing after it
/// but an optional `/`. Returns the canonical form, `http://host:port`, the one stored,
/// compared and keyed on.
pub fn instance_url(url: &str) -> Result<String, String> {
    if url.len() > MAX_VALUE_BYTES {
        return Err(format!("longer than {MAX_VALUE_BYTES} bytes"));
    }
    let Some(rest) = url.strip_prefix("http://") else {
        return Err("must start with http://".into());
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#', '@']) {
        return Err("give http://host:port without path, query or user".into());
    }
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let Some((h, after)) = v6.split_once(']') else {
            return Err("an IPv6 host must be [addr] or [addr]:port".into());
        };
        if h.is_empty()
            || !h
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
        {
            return Err("bad IPv6 address".into());
        }
        let port = match after {
            "" => None,
            p => match p.strip_prefix(':') {
                Some(p) => Some(p),
                None => return Err("an IPv6 host must be [addr] or [addr]:port".into()),
            },
        };
        (format!("[{h}]"), port)
    } else {
        let (h, port) = match rest.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (rest, None),
        };
        if h.is_empty()
            || !h
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        {
            return Err("bad host".into());
        }
        (h.to_string(), port)
    };
    let port = match port {
        None => 80,
        Some(p) => match p.parse::<u16>() {
            Ok(0) => return Err("port 0".into()),
            Ok(n) if !p.starts_with('0') => n,
            _ => return Err(format!("bad port {p:?}")),
        },
    };
    Ok(format!("http://{host}:{port}"))
}

/// `url` in its canonical form ([`instance_url`]), or as given when it is not an instance
/// URL, for [`pool_problems`] (or the state machine) to refuse with its reason: how every
/// input surface normalises before it validates.
pub fn canonical_instance_url(url: &str) -> String {
    instance_url(url).unwrap_or_else(|_| url.to_string())
}

/// Checks that `url` is an instance URL in its canonical form ([`instance_url`]), as the
/// state machine stores it: callers normalise first. (The URLs this accepts are exactly
/// those earlier builds accepted, so every stored log replays the same.)
pub fn check_instance_url(url: &str) -> Result<(), String> {
    match instance_url(url)? {
        c if c == url => Ok(()),
        c => Err(format!("write it as {c:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_urls_have_one_canonical_form() {
        for (given, canonical) in [
            ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
            ("http://10.0.0.1:8000/", "http://10.0.0.1:8000"),
            ("http://gpu-1.example", "http://gpu-1.example:80"),
            ("http://gpu-1/", "http://gpu-1:80"),
            ("http://[::1]:8000", "http://[::1]:8000"),
            ("http://[fd00::1]", "http://[fd00::1]:80"),
        ] {
            assert_eq!(instance_url(given).as_deref(), Ok(canonical), "{given}");
            // The state machine takes the canonical form only, and says which it is.
            assert_eq!(check_instance_url(canonical), Ok(()));
            if given != canonical {
                assert!(check_instance_url(given).unwrap_err().contains(canonical));
            }
        }
        for bad in [
            "https://a:1",
            "http://a:1/v1",
            "http://u@a:1",
            "http://a:0",
            "http://a:01",
            "http://a:99999",
            "http://:80",
            "http://[::1",
            "http://[::1]x",
            "http://a b:1",
        ] {
            assert!(instance_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn agent_addresses_may_name_the_certificate() {
        for ok in [
            "gpu-1:7700",
            "[::1]:7700",
            "agent@10.0.3.17:7700",
            "dns:agent@agents.llm.svc:7700",
            "dns:agents.llm.svc:7700",
            "agent@[::1]:7700",
        ] {
            assert_eq!(check_agent_address(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("@10.0.3.17:7700", "NAME before @ is empty"),
            ("agent@10.0.3.17", "[NAME@]HOST:PORT"),
            ("agent@http://h:1", "no scheme"),
            ("agent@h:0", "1 to 65535"),
            ("dns:@h:7700", "NAME before @ is empty"),
        ] {
            let e = check_agent_address(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    /// One pool's adapters, and a second pool's, and the problems found: each name routes
    /// to one pool.
    #[test]
    fn adapters_are_names_of_one_pool_alone() {
        let pool = |adapters: &[&str]| PoolSpec {
            adapters: adapters.iter().map(|a| a.to_string()).collect(),
            ..PoolSpec::default()
        };
        let check = |adapters: &[&str], other: (&str, &[&str]), want: &[&str]| {
            let spec = pool(adapters);
            let (other_model, other_spec) = (other.0, pool(other.1));
            let mut got = pool_problems("llama", &spec);
            got.extend(pool_clashes(
                "llama",
                &spec,
                [
                    ("llama", &pool(&["ignored-self"])),
                    (other_model, &other_spec),
                ],
            ));
            assert_eq!(got, want, "{adapters:?} next to {other:?}");
        };
        check(&["sql-lora", "chat-lora"], ("qwen", &["qwen-lora"]), &[]);
        check(&[], ("qwen", &[]), &[]);
        check(
            &["sql-lora", "", "llama", "a b", "sql-lora"],
            ("qwen", &[]),
            &[
                "adapters[1] \"\": empty",
                "adapters[2] \"llama\": the pool's model itself",
                "adapters[3] \"a b\": contains whitespace or control characters",
                "adapters[4] \"sql-lora\": listed twice",
            ],
        );
        check(
            &["qwen", "sql-lora"],
            ("qwen", &["sql-lora", "llama"]),
            &[
                "model: \"llama\" is an adapter of pool \"qwen\"",
                "adapters[0] \"qwen\": the model of another pool",
                "adapters[1] \"sql-lora\": already an adapter of pool \"qwen\"",
            ],
        );
    }
}
