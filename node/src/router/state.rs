//! The router's routing state: the prefix index, the load view, per-tenant policy state
//! and instance health, behind one mutex that is held for microseconds per request and
//! never across an await.

use super::config::{RouterConfig, Tenant};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use warmpath_index::cost::ModelProfile;
use warmpath_index::index::{IndexConfig, IndexStats, PrefixIndex};
use warmpath_index::keys::BlockKey;
use warmpath_index::load::LoadView;
use warmpath_index::policy::{route, Decision, PolicyConfig, PolicyState, RouteRequest, View};
use warmpath_index::InstanceId;

/// What the router knows of one instance.
#[derive(Debug, Clone)]
pub struct InstanceInfo {
    pub url: String,
    /// Result of the last active health check (instances start healthy).
    pub healthy: bool,
    /// Consecutive failed attempts (passive checks).
    pub failures: u32,
    /// Skipped until then after failures (passive ejection with backoff).
    pub ejected_until: Option<Instant>,
}

/// Why no instance could be chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoRoute {
    /// No pool serves the model.
    UnknownModel,
    /// The pool has no healthy instance left to try.
    NoHealthyInstance,
}

/// An instance chosen for one attempt.
#[derive(Debug, Clone)]
pub struct Chosen {
    pub instance: InstanceId,
    pub url: String,
    pub decision: Decision,
}

#[derive(Debug)]
pub struct RouterState {
    index: PrefixIndex,
    load: LoadView,
    policies: HashMap<String, PolicyState>,
    instances: Vec<InstanceInfo>,
    pools: HashMap<String, Vec<InstanceId>>,
    profile: ModelProfile,
    started: Instant,
    eject_base: Duration,
    eject_max: Duration,
    candidates: Vec<InstanceId>,
}

impl RouterState {
    pub fn new(config: &RouterConfig, profile: ModelProfile) -> Self {
        let mut instances = Vec::new();
        let mut pools: HashMap<String, Vec<InstanceId>> = HashMap::new();
        for pool in &config.pools {
            for url in &pool.instances {
                let id = InstanceId(instances.len() as u32);
                instances.push(InstanceInfo {
                    url: url.clone(),
                    healthy: true,
                    failures: 0,
                    ejected_until: None,
                });
                pools.entry(pool.model.clone()).or_default().push(id);
            }
        }
        RouterState {
            index: PrefixIndex::new(IndexConfig {
                capacity_blocks: config.index_capacity_blocks,
                predicted_ttl_us: config.predicted_ttl.as_micros() as u64,
            }),
            load: LoadView::new(),
            policies: HashMap::new(),
            instances,
            pools,
            profile,
            started: Instant::now(),
            eject_base: config.eject_base,
            eject_max: config.eject_max,
            candidates: Vec::new(),
        }
    }

    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// Chooses an instance for a request of `tenant` to `model`, skipping `tried`, and
    /// records the decision (prediction and load).
    pub fn route(
        &mut self,
        tenant: &Tenant,
        model: &str,
        keys: &[BlockKey],
        prompt_tokens: u32,
        tried: &[InstanceId],
        explain: bool,
    ) -> Result<Chosen, NoRoute> {
        let now = Instant::now();
        let now_us = self.now_us();
        let pool = self.pools.get(model).ok_or(NoRoute::UnknownModel)?;
        self.candidates.clear();
        for &id in pool {
            let info = &self.instances[id.0 as usize];
            let ejected = info.ejected_until.is_some_and(|t| t > now);
            if info.healthy && !ejected && !tried.contains(&id) {
                self.candidates.push(id);
            }
        }
        if self.candidates.is_empty() {
            return Err(NoRoute::NoHealthyInstance);
        }
        self.index.expire(now_us);
        let config = PolicyConfig {
            strategy: tenant.strategy,
            prefix_blocks: tenant.prefix_length.div_ceil(tenant.block_tokens),
            concurrency_threshold: tenant.concurrency_threshold,
            temperature: tenant.temperature,
            block_tokens: tenant.block_tokens,
        };
        let policy = self
            .policies
            .entry(tenant.id.clone())
            .or_insert_with(|| PolicyState::new(seed_of(&tenant.id)));
        let view = View {
            index: &self.index,
            load: &self.load,
            profile: &self.profile,
            now: now_us,
        };
        let request = RouteRequest {
            keys,
            prompt_tokens,
        };
        let decision = route(&config, &request, &self.candidates, &view, policy, explain)
            .map_err(|_| NoRoute::NoHealthyInstance)?;
        let instance = decision.instance;
        if tenant.strategy.uses_index() {
            self.index.record_route(keys, instance, now_us);
        }
        self.load.start(instance, u64::from(prompt_tokens));
        Ok(Chosen {
            instance,
            url: self.instances[instance.0 as usize].url.clone(),
            decision,
        })
    }

    /// The request's first byte of response arrived: its prefill is done.
    pub fn first_token(&mut self, instance: InstanceId, prompt_tokens: u32) {
        self.load.first_token(instance, u64::from(prompt_tokens));
    }

    /// The request left the instance.
    pub fn finish(&mut self, instance: InstanceId, prompt_tokens: u32, prefilled: bool) {
        self.load
            .finish(instance, u64::from(prompt_tokens), prefilled);
    }

    /// An attempt failed before its first byte: eject the instance for a while, longer
    /// for each consecutive failure, and forget what it held (it may have restarted).
    pub fn attempt_failed(&mut self, instance: InstanceId) {
        let base = self.eject_base;
        let max = self.eject_max;
        let info = &mut self.instances[instance.0 as usize];
        info.failures = info.failures.saturating_add(1);
        let backoff = base
            .saturating_mul(1 << (info.failures - 1).min(16))
            .min(max);
        info.ejected_until = Some(Instant::now() + backoff);
        self.index.remove_instance(instance);
    }

    pub fn attempt_succeeded(&mut self, instance: InstanceId) {
        let info = &mut self.instances[instance.0 as usize];
        info.failures = 0;
        info.ejected_until = None;
    }

    /// Result of an active health check.
    pub fn set_healthy(&mut self, instance: InstanceId, healthy: bool) {
        let info = &mut self.instances[instance.0 as usize];
        if info.healthy && !healthy {
            self.index.remove_instance(instance);
        }
        self.instances[instance.0 as usize].healthy = healthy;
    }

    /// Whether `model`'s pool has an instance that is up and not in `tried`.
    pub fn has_candidates(&self, model: &str, tried: &[InstanceId]) -> bool {
        let now = Instant::now();
        self.pools.get(model).is_some_and(|pool| {
            pool.iter().any(|id| {
                let i = &self.instances[id.0 as usize];
                i.healthy && i.ejected_until.is_none_or(|t| t <= now) && !tried.contains(id)
            })
        })
    }

    pub fn instances(&self) -> &[InstanceInfo] {
        &self.instances
    }

    /// Models with at least one instance, sorted.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> = self.pools.keys().cloned().collect();
        m.sort();
        m
    }

    pub fn any_healthy(&self) -> bool {
        let now = Instant::now();
        self.instances
            .iter()
            .any(|i| i.healthy && i.ejected_until.is_none_or(|t| t <= now))
    }

    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }

    pub fn in_flight(&self, instance: InstanceId) -> u32 {
        self.load.get(instance).in_flight
    }
}

/// A tenant's tie-breaking seed: stable across restarts.
fn seed_of(tenant: &str) -> u64 {
    let h = blake3::hash(tenant.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}
