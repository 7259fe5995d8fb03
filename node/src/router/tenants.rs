//! The tenant table the request path reads: each tenant compiled once per configuration
//! (its key material, rate-limit bucket and labelled counters resolved ahead of requests),
//! found by id or by API key; and the gate that says whether this router serves any tenant
//! at all (it follows the cluster's configuration). [`super::app::App`] holds both;
//! [`super::tenancy`] swaps in a new table on every configuration change and keeps the
//! gate up to date.

use super::config::{hash_api_key, Pool, Tenant};
use super::ratelimit::TokenBucket;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use warmpath_index::keys::TenantKey;
use warmpath_membership::raft::state::TenantSpec;

/// One tenant as requests see it, compiled for one configuration version.
pub struct TenantEntry {
    pub tenant: Tenant,
    /// The tenant's key material for block keys, derived once.
    pub(super) key: TenantKey,
    /// Admission for the tenant's rate limit on this router.
    /// Shared with the next table while the tenant's rate is unchanged, so a
    /// configuration change never refills a bucket.
    pub(super) limiter: Option<Arc<Mutex<TokenBucket>>>,
    /// The configuration version of the table holding this entry (responses carry it).
    pub(super) config_version: u64,
    /// Its counters, resolved once per table: no label lookup or copy of the id per
    /// request, and one reference count for each attempt that holds them.
    pub(super) counters: Arc<TenantCounters>,
}

/// A tenant's labelled counters.
pub(super) struct TenantCounters {
    /// Prompt tokens of its answered requests as the engines counted them (by strategy).
    pub(super) prompt_tokens: metrics::Counter,
    /// Of those, tokens the engines found cached.
    pub(super) cached_tokens: metrics::Counter,
    /// Requests its rate limit refused; only a limited tenant has one. Registered with
    /// the table, so it is exported (at 0) before the first refusal.
    pub(super) rate_limited: Option<metrics::Counter>,
    /// Its requests answered 200, registered at the first: the request path counts every
    /// answer, and the macro would allocate the labels and look the series up each time.
    answered_ok: std::sync::OnceLock<metrics::Counter>,
}

impl TenantCounters {
    fn new(t: &Tenant) -> TenantCounters {
        let strategy = t.strategy.name();
        TenantCounters {
            prompt_tokens: metrics::counter!(crate::metric_names::ROUTER_PROMPT_TOKENS_TOTAL, "tenant" => t.id.clone(), "strategy" => strategy),
            cached_tokens: metrics::counter!(crate::metric_names::ROUTER_CACHED_TOKENS_TOTAL, "tenant" => t.id.clone(), "strategy" => strategy),
            rate_limited: t.rate_limit_rps.map(|_| {
                metrics::counter!(crate::metric_names::ROUTER_RATE_LIMITED_TOTAL, "tenant" => t.id.clone())
            }),
            answered_ok: std::sync::OnceLock::new(),
        }
    }

    /// Counts an answer of `status` to tenant `id` in `warmpath_router_requests_total`.
    pub(super) fn answered(&self, id: &str, status: axum::http::StatusCode) {
        let counter = |status: String| metrics::counter!(crate::metric_names::ROUTER_REQUESTS_TOTAL, "tenant" => id.to_string(), "status" => status);
        if status == axum::http::StatusCode::OK {
            self.answered_ok
                .get_or_init(|| counter("200".into()))
                .increment(1);
        } else {
            counter(status.as_u16().to_string()).increment(1);
        }
    }
}

impl std::fmt::Debug for TenantEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantEntry")
            .field("tenant", &self.tenant.id)
            .finish_non_exhaustive()
    }
}

/// Tenants by id and by API key, with their key material derived once; each entry carries
/// the configuration version it comes from.
pub struct TenantTable {
    /// The configuration version the table was compiled from (sent to agents with the
    /// salts, so that they keep the newest table).
    version: u64,
    by_id: HashMap<String, Arc<TenantEntry>>,
    by_key: HashMap<[u8; 32], String>,
    default_tenant: Option<String>,
}

impl std::fmt::Debug for TenantTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantTable")
            .field("tenants", &self.by_id.len())
            .field("default_tenant", &self.default_tenant)
            .finish_non_exhaustive()
    }
}

impl TenantTable {
    /// Whether any tenant has an API key: without any, every request is the default
    /// tenant's whatever key it sends (as vLLM without `--api-key` behaves).
    pub(super) fn keyed(&self) -> bool {
        !self.by_key.is_empty()
    }

    /// The tenant holding API key `key`.
    pub(super) fn by_api_key(&self, key: &str) -> Option<&Arc<TenantEntry>> {
        self.by_key
            .get(&hash_api_key(key))
            .and_then(|id| self.by_id.get(id))
    }

    /// Tenant `id`, if it has no API keys (only such a tenant is reachable without a key).
    pub(super) fn keyless(&self, id: &str) -> Option<Arc<TenantEntry>> {
        self.by_id
            .get(id)
            .filter(|e| e.tenant.api_key_hashes.is_empty())
            .cloned()
    }

    /// The tenant of requests that name none (one that exists in this table).
    pub(super) fn default_tenant(&self) -> Option<&str> {
        self.default_tenant.as_deref()
    }

    /// The configuration version the table comes from.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every tenant's (cache salt, id): what agents need to key their engines' chains.
    pub fn salts(&self) -> Vec<(String, String)> {
        self.by_id
            .values()
            .map(|e| (e.tenant.cache_salt.clone(), e.tenant.id.clone()))
            .collect()
    }
}

impl TenantTable {
    pub fn new(
        tenants: &[(String, TenantSpec)],
        pools: &[Pool],
        default_tenant: Option<String>,
        version: u64,
    ) -> Self {
        Self::next(None, tenants, pools, default_tenant, version)
    }

    /// The table after a configuration change, keeping `previous`'s rate-limit buckets of
    /// tenants whose rate did not change. Each tenant is compiled once, here.
    /// A pool that names its engines' block size sets its tenants' `block_tokens`.
    pub fn next(
        previous: Option<&TenantTable>,
        tenants: &[(String, TenantSpec)],
        pools: &[Pool],
        default_tenant: Option<String>,
        version: u64,
    ) -> Self {
        let mut by_id = HashMap::new();
        let mut by_key = HashMap::new();
        for (id, spec) in tenants {
            let mut t = Tenant::compile(id, spec);
            if let Some(p) = pools
                .iter()
                .find(|p| p.model == spec.pool && p.spec.block_tokens > 0)
            {
                t.block_tokens = p.spec.block_tokens;
            }
            let t = &t;
            for h in &t.api_key_hashes {
                by_key.insert(*h, t.id.clone());
            }
            let kept = previous
                .and_then(|p| p.by_id.get(&t.id))
                .filter(|e| e.tenant.rate_limit_rps == t.rate_limit_rps)
                .and_then(|e| e.limiter.clone());
            let limiter = kept.or_else(|| {
                t.rate_limit_rps
                    .map(|rps| Arc::new(Mutex::new(TokenBucket::new(rps))))
            });
            by_id.insert(
                t.id.clone(),
                Arc::new(TenantEntry {
                    key: TenantKey::derive(&t.id, &t.cache_salt),
                    tenant: t.clone(),
                    limiter,
                    config_version: version,
                    counters: Arc::new(TenantCounters::new(t)),
                }),
            );
        }
        let default_tenant = default_tenant.filter(|d| by_id.contains_key(d));
        TenantTable {
            version,
            by_id,
            by_key,
            default_tenant,
        }
    }

    pub fn get(&self, id: &str) -> Option<&Arc<TenantEntry>> {
        self.by_id.get(id)
    }
}

/// Whether the router follows the cluster's configuration: read on every request (one
/// atomic load while it does), set by [`super::tenancy::watch_following`]. While it
/// refuses, each refusal asks the Raft node again, so a router that has just caught up
/// serves at once rather than at the watcher's next look.
#[derive(Default)]
pub struct FollowGate {
    /// Set while the router does not follow.
    refusing: std::sync::atomic::AtomicBool,
    /// Why, while it does not.
    cause: std::sync::Mutex<String>,
    /// Asks the Raft node now (absent without Raft).
    pub(super) check: std::sync::OnceLock<Box<dyn Fn() -> Result<(), String> + Send + Sync>>,
}

impl std::fmt::Debug for FollowGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FollowGate")
            .field("refusal", &self.refusal())
            .finish()
    }
}

impl FollowGate {
    /// Why the router does not follow, while it does not.
    pub fn refusal(&self) -> Option<String> {
        use std::sync::atomic::Ordering;
        if !self.refusing.load(Ordering::Acquire) {
            return None;
        }
        if let Some(check) = self.check.get() {
            let now = check();
            let why = now.clone().err();
            self.set(now);
            return why;
        }
        Some(self.cause.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Refuses from now on, without a log line: a router whose Raft is starting.
    pub fn refuse_quietly(&self, cause: &str) {
        *self.cause.lock().unwrap_or_else(|e| e.into_inner()) = cause.to_string();
        self.refusing
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Records whether the router follows (`Err`: why not), in its gauge, and logs each
    /// change.
    pub(super) fn set(&self, state: Result<(), String>) {
        use std::sync::atomic::Ordering;
        let refusing = state.is_err();
        metrics::gauge!(crate::metric_names::ROUTER_CONFIG_FOLLOWED).set(if refusing {
            0.0
        } else {
            1.0
        });
        if let Err(cause) = &state {
            *self.cause.lock().unwrap_or_else(|e| e.into_inner()) = cause.clone();
        }
        if self.refusing.swap(refusing, Ordering::AcqRel) == refusing {
            return;
        }
        match state {
            Err(why) => {
                tracing::error!(%why, "this router no longer follows the cluster's configuration: it serves no tenant and is not ready")
            }
            Ok(()) => {
                tracing::info!("this router follows the cluster's configuration again: ready")
            }
        }
    }
}
