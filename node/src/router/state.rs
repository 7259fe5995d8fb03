//! The live router's routing state: a [`RouterCore`] (the pure decision path, shared with
//! the simulator) on the wall clock, plus what only the live router needs: each
//! instance's URL and the conversion of core times to wall-clock milliseconds for gossip.
//! It sits behind one mutex, never held across an await.

use super::config::{Pool, RouterConfig, Tenant};
use std::time::Instant;
use warmpath_index::cost::ModelProfile;
use warmpath_index::index::{IndexConfig, IndexStats};
use warmpath_index::keys::BlockKey;
use warmpath_index::load::InstanceLoad;
use warmpath_index::policy::{Decision, PolicyConfig, RouteRequest};
use warmpath_index::router::{
    CacheReport, CoreConfig, CorePool, InstanceSpec, InstanceState, RouterCore,
};
use warmpath_index::InstanceId;

pub use warmpath_index::router::{NoRoute, SharedDecision};

/// An instance chosen for one attempt.
#[derive(Debug, Clone)]
pub struct Chosen {
    pub instance: InstanceId,
    pub url: String,
    pub decision: Decision,
    /// The tenant's block size and the prompt's length in the router's tokens, for
    /// checking the engine's account of what it found cached.
    pub block_tokens: u32,
    pub prompt_tokens: u32,
}

impl Chosen {
    /// Prefill tokens the load view counts for this request until its first byte.
    pub fn pending_tokens(&self) -> u32 {
        self.decision.uncached_tokens
    }
}

#[derive(Debug)]
pub struct RouterState {
    core: RouterCore,
    /// The core's clock starts here.
    started: Instant,
}

/// A tenant's routing configuration, as the policies read it.
pub fn policy_config(tenant: &Tenant) -> PolicyConfig {
    PolicyConfig {
        strategy: tenant.strategy,
        prefix_blocks: tenant.prefix_length.div_ceil(tenant.block_tokens),
        concurrency_threshold: tenant.concurrency_threshold,
        temperature: tenant.temperature,
        block_tokens: tenant.block_tokens,
    }
}

impl RouterState {
    pub fn new(config: &RouterConfig, profile: ModelProfile) -> Self {
        let core = RouterCore::new(
            CoreConfig {
                index: IndexConfig {
                    capacity_blocks: config.index_capacity_blocks,
                    predicted_ttl_us: config.predicted_ttl.as_micros() as u64,
                    ..IndexConfig::default()
                },
                eject_base_us: config.eject_base.as_micros() as u64,
                eject_max_us: config.eject_max.as_micros() as u64,
                seed: 0,
            },
            profile,
        );
        let mut state = RouterState {
            core,
            started: Instant::now(),
        };
        state.set_pools(&config.pools);
        state
    }

    /// Replaces the pools (a config change): new instances get new ids (ids are never
    /// reused), instances no longer in any pool leave the pools and the index.
    pub fn set_pools(&mut self, pools: &[Pool]) {
        let specs: Vec<CorePool> = pools
            .iter()
            .map(|p| CorePool {
                model: p.model.clone(),
                instances: p
                    .spec
                    .instances
                    .iter()
                    .map(|url| InstanceSpec {
                        name: url.clone(),
                        key: instance_key(url),
                    })
                    .collect(),
                adapters: p.spec.adapters.clone(),
            })
            .collect();
        self.core.set_pools(&specs);
    }

    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    fn chosen(&self, decision: Decision, tenant: &Tenant, prompt_tokens: u32) -> Chosen {
        Chosen {
            instance: decision.instance,
            url: self.url(decision.instance).to_string(),
            decision,
            block_tokens: tenant.block_tokens,
            prompt_tokens,
        }
    }

    /// The base URL of `instance`.
    pub fn url(&self, instance: InstanceId) -> &str {
        self.core
            .instances()
            .get(instance.0 as usize)
            .map_or("", |i| i.name.as_str())
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
        let request = RouteRequest {
            keys,
            prompt_tokens,
        };
        let now = self.now_us();
        let decision = self.core.route(
            &tenant.id,
            &policy_config(tenant),
            model,
            &request,
            tried,
            explain,
            now,
        )?;
        Ok(self.chosen(decision, tenant, prompt_tokens))
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
        let request = RouteRequest {
            keys,
            prompt_tokens,
        };
        let now = self.now_us();
        let decision =
            self.core
                .dry_run(&tenant.id, &policy_config(tenant), model, &request, now)?;
        Ok(self.chosen(decision, tenant, prompt_tokens))
    }

    /// The engine's `usage` for `chosen`'s request: a report of fewer cached tokens than
    /// predicted retires the instance's older predictions. Returns whether it did.
    pub fn report_cached(&mut self, chosen: &Chosen, report: CacheReport) -> bool {
        self.core.report_cached(
            &chosen.decision,
            chosen.block_tokens,
            chosen.prompt_tokens,
            report,
        )
    }

    /// The GPU KV capacity of `instance` in tokens, as last read (0: unknown).
    pub fn kv_capacity(&self, instance: InstanceId) -> u64 {
        self.core.kv_capacity(instance)
    }

    /// The GPU KV capacity of `instance` in tokens, as its engine's metrics say.
    pub fn set_kv_capacity(&mut self, instance: InstanceId, tokens: u64) {
        self.core.set_kv_capacity(instance, tokens);
    }

    /// The request's first byte of response arrived: its prefill is done. `prompt_tokens`
    /// is what [`Chosen::pending_tokens`] said when it was routed.
    pub fn first_token(&mut self, instance: InstanceId, prompt_tokens: u32) {
        self.core.first_token(instance, prompt_tokens);
    }

    /// The request left the instance.
    pub fn finish(
        &mut self,
        instance: InstanceId,
        prompt_tokens: u32,
        prefilled: bool,
        decided_at: u64,
    ) {
        self.core
            .finish(instance, prompt_tokens, prefilled, decided_at);
    }

    /// The ids of an agent's engines, named by URL as the agent reports them (`None`: an
    /// engine this router does not serve). Ids are never reused, so they stay right across
    /// configuration changes for as long as they are held.
    pub fn agent_engines(&self, instances: &[String]) -> Vec<Option<InstanceId>> {
        instances
            .iter()
            .map(|url| self.core.instance_by_key(instance_key(url)))
            .collect()
    }

    /// Marks an agent's engines ([`Self::agent_engines`]) as observed, or no longer.
    pub fn set_observed(&mut self, engines: &[Option<InstanceId>], observed: bool) {
        for &id in engines.iter().flatten() {
            self.core.set_observed(id, observed);
        }
    }

    /// Starts collecting decisions for the other routers.
    pub fn enable_sharing(&mut self) {
        self.core.enable_sharing();
    }

    /// Decisions made since the last call, and the wall-clock ms of the oldest (batches
    /// carry it, so the lag peers measure includes the wait for the next publish).
    pub fn take_outbox(&mut self) -> (Vec<SharedDecision>, u64) {
        let now = self.now_us();
        let (decisions, since) = self.core.take_outbox();
        let age_ms = since.map_or(0, |s| now.saturating_sub(s) / 1000);
        (decisions, now_ms().saturating_sub(age_ms))
    }

    /// Applies other routers' decisions; decisions naming instances this router does not
    /// know are skipped (their count is returned).
    pub fn apply_shared(&mut self, decisions: &[SharedDecision]) -> usize {
        let now = self.now_us();
        self.core.apply_shared(decisions, now)
    }

    /// Applies an agent's residency changes (`warmpath_residency`): `ids` are the agent's
    /// engines ([`Self::agent_engines`]), which `Scope::Gpu` indexes and whose host L1
    /// `Scope::L1` means. Engines this router does not serve are skipped; returns how many
    /// changes applied.
    pub fn apply_residency(
        &mut self,
        ids: &[Option<InstanceId>],
        changes: &[warmpath_residency::Change],
    ) -> usize {
        use warmpath_index::cost::Tier;
        use warmpath_residency::Scope;
        let now = self.now_us();
        let mut applied = 0;
        for c in changes {
            let (key, parent) = (BlockKey(c.key), c.parent.map(BlockKey));
            match c.scope {
                Scope::Gpu(i) => {
                    if let Some(Some(id)) = ids.get(i as usize) {
                        self.core
                            .observe(*id, key, parent, Tier::Gpu, c.present, now);
                        applied += 1;
                    }
                }
                Scope::L1 => {
                    for id in ids.iter().flatten() {
                        self.core
                            .observe(*id, key, parent, Tier::L1, c.present, now);
                        applied += 1;
                    }
                }
                Scope::L2 => {
                    // L2 is global: the instance is not used.
                    self.core
                        .observe(InstanceId(0), key, parent, Tier::L2, c.present, now);
                    applied += 1;
                }
            }
        }
        applied
    }

    /// This router's own load, by stable instance key, for publishing.
    pub fn own_loads(&self) -> Vec<(u64, InstanceLoad)> {
        self.core.own_loads()
    }

    /// Replaces the peers' loads (`origin → (instance key, load)`), dropping peers not
    /// listed (departed), and recomputes the combined view.
    pub fn set_peer_loads(&mut self, peers: Vec<(String, Vec<(u64, InstanceLoad)>)>) {
        self.core.set_peer_loads(peers);
    }

    /// In-flight requests of `instance` across the cluster (own + peers').
    pub fn cluster_in_flight(&self, instance: InstanceId) -> u32 {
        self.core.cluster_in_flight(instance)
    }

    /// An attempt failed before its first byte: eject the instance for a while, longer
    /// for each consecutive failure, and forget what it held (it may have restarted).
    pub fn attempt_failed(&mut self, instance: InstanceId) {
        let now = self.now_us();
        self.core.attempt_failed(instance, now);
    }

    pub fn attempt_succeeded(&mut self, instance: InstanceId) {
        self.core.attempt_succeeded(instance);
    }

    /// Result of an active health check.
    pub fn set_healthy(&mut self, instance: InstanceId, healthy: bool) {
        self.core.set_healthy(instance, healthy);
    }

    /// Whether `model`'s pool has an instance that is up and not in `tried`.
    pub fn has_candidates(&self, model: &str, tried: &[InstanceId]) -> bool {
        self.core.has_candidates(model, tried, self.now_us())
    }

    /// Ids and URLs of the instances in some pool now.
    pub fn active_instances(&self) -> Vec<(InstanceId, String)> {
        self.core
            .active_instances()
            .into_iter()
            .map(|id| (id, self.url(id).to_string()))
            .collect()
    }

    /// Every instance ever seen, by id.
    pub fn instances(&self) -> &[InstanceState] {
        self.core.instances()
    }

    /// Models with at least one instance, sorted.
    pub fn models(&self) -> Vec<String> {
        self.core.models()
    }

    pub fn any_healthy(&self) -> bool {
        self.core.any_healthy(self.now_us())
    }

    pub fn index_stats(&self) -> IndexStats {
        self.core.index_stats()
    }

    /// This router's own in-flight requests on `instance`.
    pub fn in_flight(&self, instance: InstanceId) -> u32 {
        self.core.in_flight(instance)
    }
}

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
            ..Default::default()
        });
        let config = file.validate().unwrap();
        let (id, spec) = &config.tenants[0];
        let tenant = Tenant::compile(id, spec);
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
