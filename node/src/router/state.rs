//! The router's routing state: the prefix index, the load view, per-tenant policy state
//! and instance health, behind one mutex that is held for microseconds per request and
//! never across an await.

use super::config::{RouterConfig, Tenant};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use warmpath_index::cost::ModelProfile;
use warmpath_index::index::{IndexConfig, IndexStats, PrefixIndex};
use warmpath_index::keys::BlockKey;
use warmpath_index::load::{InstanceLoad, LoadView};
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

impl Chosen {
    /// Prefill tokens the load view counts for this request until its first byte.
    pub fn pending_tokens(&self) -> u32 {
        self.decision.uncached_tokens
    }
}

/// A routing decision to tell the other routers: `keys` now predicted on the instance
/// whose stable key (a hash of its URL, the same on every router) is `instance`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDecision {
    pub instance: u64,
    pub keys: Vec<BlockKey>,
}

#[derive(Debug)]
pub struct RouterState {
    index: PrefixIndex,
    /// This router's own requests, exact.
    own_load: LoadView,
    /// The latest load each peer router published, by peer node id.
    peer_loads: HashMap<String, LoadView>,
    /// `own_load` plus every peer's: what policies route on.
    load: LoadView,
    /// Stable instance keys (hash of the URL), by instance id, and back.
    instance_keys: Vec<u64>,
    by_instance_key: HashMap<u64, InstanceId>,
    /// Decisions not yet handed to the gossip layer; `None` when running alone.
    outbox: Option<Vec<SharedDecision>>,
    /// Wall-clock ms of the oldest decision in the outbox (batches carry it, so the lag
    /// peers measure includes the wait for the next publish).
    outbox_since_ms: Option<u64>,
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
        let mut state = RouterState {
            index: PrefixIndex::new(IndexConfig {
                capacity_blocks: config.index_capacity_blocks,
                predicted_ttl_us: config.predicted_ttl.as_micros() as u64,
            }),
            own_load: LoadView::new(),
            peer_loads: HashMap::new(),
            load: LoadView::new(),
            instance_keys: Vec::new(),
            by_instance_key: HashMap::new(),
            outbox: None,
            outbox_since_ms: None,
            policies: HashMap::new(),
            instances: Vec::new(),
            pools: HashMap::new(),
            profile,
            started: Instant::now(),
            eject_base: config.eject_base,
            eject_max: config.eject_max,
            candidates: Vec::new(),
        };
        state.set_pools(&config.pools);
        state
    }

    /// Replaces the pools (a config change): new instances get new ids (ids are never
    /// reused), instances no longer in any pool leave the pools and the index.
    pub fn set_pools(&mut self, pools: &[super::config::Pool]) {
        let mut next: HashMap<String, Vec<InstanceId>> = HashMap::new();
        for pool in pools {
            for url in &pool.instances {
                let key = instance_key(url);
                let id = match self.by_instance_key.get(&key) {
                    Some(&id) => id,
                    None => {
                        let id = InstanceId(self.instances.len() as u32);
                        self.instances.push(InstanceInfo {
                            url: url.clone(),
                            healthy: true,
                            failures: 0,
                            ejected_until: None,
                        });
                        self.instance_keys.push(key);
                        self.by_instance_key.insert(key, id);
                        id
                    }
                };
                let members = next.entry(pool.model.clone()).or_default();
                if !members.contains(&id) {
                    members.push(id);
                }
            }
        }
        let kept: std::collections::HashSet<InstanceId> =
            next.values().flatten().copied().collect();
        for old in self.pools.values().flatten() {
            if !kept.contains(old) {
                self.index.remove_instance(*old);
            }
        }
        self.pools = next;
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
        self.decide(tenant, model, keys, prompt_tokens, tried, explain, false)
    }

    /// What [`RouterState::route`] would choose now, explained, changing nothing: no
    /// prediction, no load, no round-robin turn.
    pub fn dry_run(
        &mut self,
        tenant: &Tenant,
        model: &str,
        keys: &[BlockKey],
        prompt_tokens: u32,
    ) -> Result<Chosen, NoRoute> {
        self.decide(tenant, model, keys, prompt_tokens, &[], true, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn decide(
        &mut self,
        tenant: &Tenant,
        model: &str,
        keys: &[BlockKey],
        prompt_tokens: u32,
        tried: &[InstanceId],
        explain: bool,
        dry_run: bool,
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
        // Look up before inserting: `entry` would allocate the tenant id on every request.
        if !self.policies.contains_key(&tenant.id) {
            self.policies
                .insert(tenant.id.clone(), PolicyState::new(seed_of(&tenant.id)));
        }
        let policy = self
            .policies
            .get_mut(&tenant.id)
            .expect("inserted just above");
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
        let mut scratch_policy;
        let policy = if dry_run {
            scratch_policy = policy.clone();
            &mut scratch_policy
        } else {
            policy
        };
        let decision = route(&config, &request, &self.candidates, &view, policy, explain)
            .map_err(|_| NoRoute::NoHealthyInstance)?;
        let instance = decision.instance;
        if dry_run {
            return Ok(Chosen {
                instance,
                url: self.instances[instance.0 as usize].url.clone(),
                decision,
            });
        }
        if tenant.strategy.uses_index() {
            let known = self.index.record_route(keys, instance, now_us);
            if let Some(outbox) = &mut self.outbox {
                if known < keys.len() {
                    if outbox.is_empty() {
                        self.outbox_since_ms = Some(now_ms());
                    }
                    outbox.push(SharedDecision {
                        instance: self.instance_keys[instance.0 as usize],
                        keys: sparse_keys(keys, known),
                    });
                }
            }
        }
        // Pending prefill counts what the instance must compute, not what it holds.
        let pending = u64::from(decision.uncached_tokens);
        self.own_load.start(instance, pending);
        self.load.start(instance, pending);
        Ok(Chosen {
            instance,
            url: self.instances[instance.0 as usize].url.clone(),
            decision,
        })
    }

    /// The request's first byte of response arrived: its prefill is done. `prompt_tokens`
    /// is what [`Chosen::pending_tokens`] said when it was routed.
    pub fn first_token(&mut self, instance: InstanceId, prompt_tokens: u32) {
        self.own_load
            .first_token(instance, u64::from(prompt_tokens));
        self.load.first_token(instance, u64::from(prompt_tokens));
    }

    /// The request left the instance.
    pub fn finish(&mut self, instance: InstanceId, prompt_tokens: u32, prefilled: bool) {
        self.own_load
            .finish(instance, u64::from(prompt_tokens), prefilled);
        self.load
            .finish(instance, u64::from(prompt_tokens), prefilled);
    }

    /// Starts collecting decisions for the other routers.
    pub fn enable_sharing(&mut self) {
        self.outbox.get_or_insert_with(Vec::new);
    }

    /// Decisions made since the last call, and the wall-clock ms of the oldest.
    pub fn take_outbox(&mut self) -> (Vec<SharedDecision>, u64) {
        let since = self.outbox_since_ms.take().unwrap_or(0);
        (
            self.outbox.as_mut().map(std::mem::take).unwrap_or_default(),
            since,
        )
    }

    /// Applies other routers' decisions; decisions naming instances this router does not
    /// know are skipped (their count is returned).
    pub fn apply_shared(&mut self, decisions: &[SharedDecision]) -> usize {
        let now_us = self.now_us();
        self.index.expire(now_us);
        let mut unknown = 0;
        for d in decisions {
            match self.by_instance_key.get(&d.instance) {
                Some(&id) => {
                    self.index.record_route(&d.keys, id, now_us);
                }
                None => unknown += 1,
            }
        }
        unknown
    }

    /// This router's own load, by stable instance key, for publishing.
    pub fn own_loads(&self) -> Vec<(u64, InstanceLoad)> {
        self.own_load
            .iter()
            .filter(|(i, _)| (i.0 as usize) < self.instance_keys.len())
            .map(|(i, l)| (self.instance_keys[i.0 as usize], l))
            .collect()
    }

    /// Replaces the peers' loads (`origin → (instance key, load)`), dropping peers not
    /// listed (departed), and recomputes the combined view.
    pub fn set_peer_loads(&mut self, peers: Vec<(String, Vec<(u64, InstanceLoad)>)>) {
        self.peer_loads.clear();
        for (origin, entries) in peers {
            let mut view = LoadView::new();
            for (key, load) in entries {
                if let Some(&id) = self.by_instance_key.get(&key) {
                    view.set(id, load);
                }
            }
            self.peer_loads.insert(origin, view);
        }
        let mut combined = self.own_load.clone();
        for view in self.peer_loads.values() {
            combined.add(view);
        }
        self.load = combined;
    }

    /// In-flight requests of `instance` across the cluster (own + peers').
    pub fn cluster_in_flight(&self, instance: InstanceId) -> u32 {
        self.load.get(instance).in_flight
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

    /// Ids and URLs of the instances in some pool now.
    pub fn active_instances(&self) -> Vec<(InstanceId, String)> {
        let mut ids: Vec<InstanceId> = self.pools.values().flatten().copied().collect();
        ids.sort();
        ids.dedup();
        ids.into_iter()
            .map(|id| (id, self.instances[id.0 as usize].url.clone()))
            .collect()
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

    /// This router's own in-flight requests on `instance`.
    pub fn in_flight(&self, instance: InstanceId) -> u32 {
        self.own_load.get(instance).in_flight
    }
}

/// A tenant's tie-breaking seed: stable across restarts.
fn seed_of(tenant: &str) -> u64 {
    let h = blake3::hash(tenant.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

pub use warmpath_index::index::sparse_keys;

/// Wall-clock milliseconds since the Unix epoch (decision batches carry it, so receivers
/// can measure dissemination lag on hosts with synchronised clocks).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub use warmpath_membership::decisions::instance_key;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::config::FileConfig;

    fn state(instances: &[&str]) -> (RouterState, Tenant) {
        let mut file = FileConfig::parse("version = 1").unwrap();
        file.pools.push(crate::router::config::PoolSection {
            model: "m".into(),
            instances: instances.iter().map(|s| s.to_string()).collect(),
        });
        let config = file.validate().unwrap();
        let tenant = config.tenants[0].clone();
        (
            RouterState::new(&config, ModelProfile::dynamo_default()),
            tenant,
        )
    }

    fn keys(ids: &[u64]) -> Vec<BlockKey> {
        ids.iter().map(|&i| BlockKey(i)).collect()
    }

    #[test]
    fn decisions_are_shared_once_and_applied_by_peers() {
        let urls = ["http://a:1", "http://b:2"];
        let (mut one, tenant) = state(&urls);
        let (mut two, _) = state(&urls);
        one.enable_sharing();
        let chosen = one
            .route(&tenant, "m", &keys(&[1, 2, 3]), 200, &[], false)
            .unwrap();
        let (out, _) = one.take_outbox();
        assert_eq!(
            out,
            vec![SharedDecision {
                instance: instance_key(&chosen.url),
                keys: keys(&[3])
            }]
        );
        // The same prefix again, on the same instance: nothing new to share.
        let again = one
            .route(&tenant, "m", &keys(&[1, 2, 3]), 200, &[], false)
            .unwrap();
        assert_eq!(again.instance, chosen.instance);
        assert!(one.take_outbox().0.is_empty());
        // A longer prompt shares only (a sample of) the new blocks.
        one.route(
            &tenant,
            "m",
            &keys(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
            700,
            &[],
            false,
        )
        .unwrap();
        assert_eq!(one.take_outbox().0[0].keys, keys(&[4, 8, 10]));
        // The peer applies it and routes the prefix to the same instance.
        assert_eq!(two.apply_shared(&out), 0);
        let there = two
            .route(&tenant, "m", &keys(&[1, 2, 3]), 200, &[], false)
            .unwrap();
        assert_eq!(there.url, chosen.url);
        assert_eq!(
            two.apply_shared(&[SharedDecision {
                instance: 42,
                keys: keys(&[9])
            }]),
            1
        );
    }

    #[test]
    fn peers_load_adds_to_own() {
        let urls = ["http://a:1", "http://b:2"];
        let (mut s, tenant) = state(&urls);
        let a = InstanceId(0);
        let load = |n| InstanceLoad {
            in_flight: n,
            pending_prefill_tokens: 0,
        };
        s.set_peer_loads(vec![
            ("r2".into(), vec![(instance_key(urls[0]), load(5))]),
            (
                "r3".into(),
                vec![(instance_key(urls[0]), load(2)), (7, load(9))],
            ),
        ]);
        assert_eq!((s.cluster_in_flight(a), s.in_flight(a)), (7, 0));
        // Least-loaded sees the cluster: instance b wins.
        let t = Tenant {
            strategy: warmpath_index::policy::Strategy::LeastLoaded,
            ..tenant
        };
        assert_eq!(
            s.route(&t, "m", &[], 10, &[], false).unwrap().instance,
            InstanceId(1)
        );
        let routed = InstanceLoad {
            in_flight: 1,
            pending_prefill_tokens: 10,
        };
        assert_eq!(
            s.own_loads(),
            vec![
                (instance_key(urls[0]), InstanceLoad::default()),
                (instance_key(urls[1]), routed)
            ]
        );
        // A departed peer's load goes away.
        s.set_peer_loads(vec![]);
        assert_eq!(s.cluster_in_flight(a), 0);
    }
}
