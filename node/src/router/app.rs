//! The gateway's shared state, [`App`]: the configuration, the routing core behind its
//! mutex, the upstream client, the tenant table and the pools' tokenizers (both swapped
//! whole on a configuration change), and the handles of the background parts (gossip,
//! residency, the follow gate). The request path ([`super::proxy`]) reads it; the
//! configuration follower ([`super::tenancy`]), the gossip loop ([`super::cluster`]) and
//! residency's apply task write to it.

use super::config::{Pool, RouterConfig};
use super::ratelimit::PeerCount;
use super::residency::Residency;
use super::state::RouterState;
use super::tenants::{FollowGate, TenantTable};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Shared state of the gateway.
pub struct App {
    pub config: RouterConfig,
    /// The routing core; shared with residency's apply thread, which needs nothing else.
    /// parking_lot's mutex: that thread hands it to a waiting request between steps
    /// (`warmpath_residency::steps`), which std's cannot.
    pub core: Arc<parking_lot::Mutex<RouterState>>,
    pub client: HttpClient,
    /// The tenant table, swapped whole on every configuration change (Raft), read by
    /// every request (a read lock held for a clone of an `Arc`).
    tenants: std::sync::RwLock<Arc<TenantTable>>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Gossip with the other replicas, once started (absent when running alone).
    pub gossip: std::sync::OnceLock<Arc<warmpath_membership::gossip::Gossip>>,
    /// Each pool's tokenizer and chat template, by model and by adapter (absent: the
    /// built-in ones).
    tokenizers: std::sync::RwLock<Arc<HashMap<String, PoolTokenizer>>>,
    /// The pools' LoRA adapters: a request for one is keyed for the adapter, whose blocks
    /// its engines cache apart from the base model's.
    adapters: std::sync::RwLock<Arc<std::collections::HashSet<String>>>,
    /// The cache-agents this router follows, once started (absent without mutual TLS).
    pub residency: std::sync::OnceLock<Arc<Residency>>,
    /// Peer routers rate limits are shared among (see [`PeerCount`]).
    pub peers: std::sync::atomic::AtomicUsize,
    /// The peers gossip showed, and when: a cut-off router keeps counting them a while.
    pub peer_count: Mutex<PeerCount>,
    /// The live peers as the admin API shows them, refreshed by the gossip loop.
    pub peer_list: Mutex<Vec<serde_json::Value>>,
    /// Counts instances the health checks found down: requests waiting on an instance
    /// watch it, so a hung engine costs them a failover, not their timeouts.
    pub downs: tokio::sync::watch::Sender<u64>,
    /// Whether this router follows the cluster's configuration (always without Raft): a
    /// router that does not serves no tenant and is not ready.
    pub following: FollowGate,
}

/// A pool's loaded tokenizer and what it was loaded from (a change reloads it).
#[derive(Debug, Clone)]
struct PoolTokenizer {
    from: (String, String),
    tokenizer: warmpath_index::text::Tokenizer,
}

impl App {
    /// The tokenizer of `model`'s pool.
    pub fn tokenizer(&self, model: &str) -> warmpath_index::text::Tokenizer {
        self.tokenizers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(model)
            .map_or_else(warmpath_index::text::Tokenizer::builtin, |t| {
                t.tokenizer.clone()
            })
    }

    /// Whether `model` is one of the pools' LoRA adapters.
    pub fn is_adapter(&self, model: &str) -> bool {
        self.adapters
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(model)
    }

    /// Loads the pools' tokenizers and templates (at start and after every configuration
    /// change; unchanged ones are kept), and takes their adapters, which are tokenized as
    /// their pool's model is. One that does not load on this router (a
    /// tokenizer.json missing here) is logged and counted, and its pool is tokenized with
    /// the built-in tokenizer: its keys then miss the engines' blocks (fewer hits, never a
    /// wrong answer).
    pub fn set_tokenizers(&self, pools: &[Pool]) {
        let previous = self
            .tokenizers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut next = HashMap::new();
        let mut failed = 0;
        for p in pools {
            let from = (p.spec.tokenizer.clone(), p.spec.chat_template.clone());
            if from.0.is_empty() && from.1.is_empty() {
                continue;
            }
            if let Some(kept) = previous.get(&p.model).filter(|t| t.from == from) {
                for adapter in &p.spec.adapters {
                    next.insert(adapter.clone(), kept.clone());
                }
                next.insert(p.model.clone(), kept.clone());
                continue;
            }
            match crate::prompt::PoolText::load(&from.0, &from.1) {
                Ok(t) => {
                    let loaded = PoolTokenizer {
                        from,
                        tokenizer: t.into_tokenizer(),
                    };
                    for adapter in &p.spec.adapters {
                        next.insert(adapter.clone(), loaded.clone());
                    }
                    next.insert(p.model.clone(), loaded);
                }
                Err(error) => {
                    failed += 1;
                    tracing::error!(model = %p.model, %error, "the pool's tokenizer does not load on this router; its prompts are tokenized with the built-in tokenizer");
                }
            }
        }
        metrics::gauge!(crate::metric_names::ROUTER_TOKENIZER_ERRORS).set(f64::from(failed));
        *self.tokenizers.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
        let adapters = pools.iter().flat_map(|p| p.spec.adapters.iter().cloned());
        *self.adapters.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(adapters.collect());
    }

    /// Points residency at the configuration's agents and tenants (at start and after
    /// every configuration change).
    pub fn configure_residency(&self, pools: &[Pool]) {
        let agents: Vec<String> = pools.iter().flat_map(|p| p.spec.agents.clone()).collect();
        match self.residency.get() {
            Some(r) => {
                r.set_agents(&agents);
                let table = self.tenants();
                r.set_tenants(table.version(), table.salts());
            }
            None if !agents.is_empty() => tracing::warn!(
                agents = agents.len(),
                "the configuration names cache-agents, but this router has no --tls-dir and --tls-name: it does not follow them and routes on predictions only"
            ),
            None => {}
        }
    }
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("listen", &self.config.listen)
            .finish_non_exhaustive()
    }
}

impl App {
    pub fn new(
        config: RouterConfig,
        core: RouterState,
        metrics: metrics_exporter_prometheus::PrometheusHandle,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        let tenants = TenantTable::new(
            &config.tenants,
            &config.pools,
            config.default_tenant.clone(),
            0,
        );
        let tokenizers = std::sync::RwLock::new(Arc::new(HashMap::new()));
        let app = App {
            config,
            core: Arc::new(parking_lot::Mutex::new(core)),
            client,
            tenants: std::sync::RwLock::new(Arc::new(tenants)),
            metrics,
            gossip: std::sync::OnceLock::new(),
            residency: std::sync::OnceLock::new(),
            tokenizers,
            adapters: Default::default(),
            peers: std::sync::atomic::AtomicUsize::new(0),
            peer_count: Mutex::new(Default::default()),
            peer_list: Mutex::new(Vec::new()),
            downs: tokio::sync::watch::Sender::new(0),
            following: Default::default(),
        };
        app.set_tokenizers(&app.config.pools);
        app
    }

    pub(super) fn core(&self) -> parking_lot::MutexGuard<'_, RouterState> {
        // parking_lot's lock is not poisoned: a panic while holding it cannot leave the
        // routing state half-written in a way that matters more than stopping would.
        self.core.lock()
    }

    /// The current tenant table.
    pub fn tenants(&self) -> Arc<TenantTable> {
        self.tenants
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Swaps in a new tenant table (a configuration change).
    pub fn set_tenants(&self, table: TenantTable) {
        *self.tenants.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
    }
}
