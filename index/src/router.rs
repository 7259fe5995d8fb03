//! The router core: the whole decision path of one router replica, without I/O.
//!
//! [`RouterCore`] owns everything a routing decision reads or changes: the prefix index,
//! the load view (this router's exact counts plus the peers' last published ones), the
//! instances with their health and ejection, the pools by model, each tenant's policy
//! state, and the outbox of decisions to share with peer routers. The live router holds
//! one behind a mutex and calls it with the wall clock turned into microseconds; every
//! replica of the simulator is one, called on the virtual clock. Nothing else decides where
//! a request goes, so a result from `warmpath simulate` is a result about the router.
//!
//! A request's life, as the core sees it:
//!
//! 1. [`RouterCore::route`]: expire predictions, gather the pool's healthy candidates
//!    (not ejected, not tried already), run the tenant's policy, record the prediction in
//!    the index, queue the new keys for peers, and count the request as in flight with its
//!    uncached tokens as pending prefill.
//! 2. [`RouterCore::first_token`]: its prefill is done.
//! 3. [`RouterCore::finish`]: it left the instance (done, failed or abandoned).
//!
//! Failures eject an instance with exponential backoff ([`RouterCore::attempt_failed`]);
//! active health checks mark it up or down ([`RouterCore::set_healthy`]). Peers' decisions
//! arrive through [`RouterCore::apply_shared`] and their loads through
//! [`RouterCore::set_peer_loads`]; agents' observations through [`RouterCore::observe`].
//!
//! Time is `now`, microseconds on the caller's clock, passed into every call that needs it.

use crate::cost::{ModelProfile, Tier};
use crate::index::{sparse_keys, IndexConfig, IndexStats, PrefixIndex};
use crate::keys::BlockKey;
use crate::load::{InstanceLoad, LoadView};
use crate::policy::{route, Decision, PolicyConfig, PolicyState, RouteRequest, View};
use crate::InstanceId;
use std::collections::{HashMap, HashSet};

/// A prediction younger than this when it was contradicted proves nothing: the request
/// that placed it may still have been computing its blocks (an engine caches a prompt's
/// blocks only once they are computed).
pub const CONTRADICTION_GRACE_US: u64 = 2_000_000;

/// What an engine said of a request's prompt in its answer's `usage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheReport {
    /// `usage.prompt_tokens`: the prompt as the engine counted it.
    pub prompt_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u32,
}

/// Settings of one router core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoreConfig {
    pub index: IndexConfig,
    /// Ejection after the first consecutive failure; doubles with each further one.
    pub eject_base_us: u64,
    /// Longest ejection.
    pub eject_max_us: u64,
    /// Mixed into every tenant's tie-breaking seed (simulated replicas differ by it).
    pub seed: u64,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            index: IndexConfig::default(),
            eject_base_us: 1_000_000,
            eject_max_us: 30_000_000,
            seed: 0,
        }
    }
}

/// One instance to serve, as a pool lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceSpec {
    /// What the caller calls it (the live router: its base URL).
    pub name: String,
    /// Its stable key, the same on every router (peers name instances by it).
    pub key: u64,
}

/// The instances serving one model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CorePool {
    pub model: String,
    pub instances: Vec<InstanceSpec>,
    /// The LoRA adapters the instances serve: a request for one is routed among them as
    /// one for `model` is (its keys are the caller's: keyed per adapter, they match only
    /// the adapter's blocks).
    pub adapters: Vec<String>,
}

/// What the core knows of one instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceState {
    pub name: String,
    pub key: u64,
    /// Result of the last active health check (instances start healthy).
    pub healthy: bool,
    /// Consecutive failed attempts (passive checks).
    pub failures: u32,
    /// Skipped while `now` is before this, after failures; 0 when not ejected.
    pub ejected_until: u64,
    /// An agent reports this instance's GPU cache (its KV events reach this router).
    pub observed: bool,
}

impl InstanceState {
    /// Whether the instance may be routed to at `now`.
    pub fn available(&self, now: u64) -> bool {
        self.healthy && self.ejected_until <= now
    }
}

/// Why no instance could be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoute {
    /// No pool serves the model.
    UnknownModel,
    /// The pool has no healthy instance left to try.
    NoHealthyInstance,
}

/// A routing decision to tell the other routers: `keys` are now predicted on the instance
/// whose stable key is `instance`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDecision {
    pub instance: u64,
    pub keys: Vec<BlockKey>,
}

/// The cluster's budget for shared decisions, block keys per second, which routers share
/// equally ([`PublishBudget`], record 0118): 500,000 keys are about 5.5 MB/s on the wire (8
/// bytes a key, 10.7 once base64-encoded, and a few a decision), three quarters of what
/// chitchat carries into one router (7.2 MB/s measured at 8 to 128 routers), leaving room
/// for loads, digests and a restarted router's catch-up. What a router decides beyond its share is not published (counted in
/// `warmpath_gossip_decisions_shed_total`).
pub const DECISION_BUDGET_KEYS_PER_S: u64 = 500_000;

/// The most a router's [`PublishBudget`] holds, in seconds of its share: five gossip rounds,
/// so that routers back from idle together do not flood their peers at once.
pub const PUBLISH_BURST_S: f64 = 0.25;

/// How many shared decisions' keys one router may publish: its share of a budget for the
/// whole cluster, `fleet_keys_per_s / routers`, as a token bucket holding at most
/// [`PUBLISH_BURST_S`] of it (full at start). Every router takes in about the whole cluster's shared
/// decisions, and gossip carries a bounded rate into each (about 7 MB/s through chitchat,
/// BENCHMARKS.md; a key is 10.7 bytes on the wire): past it the backlog and the lag grow
/// without end. Shedding at the source keeps what is published arriving within a few
/// gossip rounds; what is shed a peer learns later from the instances' agents, or not at
/// all (record 0118). Keys rather than bytes, so that the simulator, which never encodes,
/// spends it as the gossip adapter does. Pure: time in ms.
#[derive(Debug, Clone)]
pub struct PublishBudget {
    fleet_keys_per_s: u64,
    tokens: f64,
    last_ms: u64,
}

impl PublishBudget {
    /// A budget of `fleet_keys_per_s` shared keys for the whole cluster (0: no budget).
    pub fn new(fleet_keys_per_s: u64) -> Self {
        PublishBudget {
            fleet_keys_per_s,
            tokens: f64::INFINITY,
            last_ms: 0,
        }
    }

    /// Whether decisions of `keys` keys in all may be published at `now_ms` by one of
    /// `routers` routers (this one and its live peers): whenever the bucket holds any; they
    /// are then taken from it, which may leave it in debt.
    pub fn take(&mut self, now_ms: u64, routers: usize, keys: usize) -> bool {
        if self.fleet_keys_per_s == 0 {
            return true;
        }
        let share = self.fleet_keys_per_s as f64 / routers.max(1) as f64;
        let elapsed_s = now_ms.saturating_sub(self.last_ms) as f64 / 1e3;
        self.last_ms = self.last_ms.max(now_ms);
        // The bucket holds PUBLISH_BURST_S of the share; the share follows the cluster's size.
        self.tokens = (self.tokens + elapsed_s * share).min(share * PUBLISH_BURST_S);
        // A batch goes out whenever the bucket is not empty, and may leave it in debt: a
        // batch larger than the bucket (a small share, in a large cluster) is delayed, never
        // shed for good, and the rate still averages out to the share.
        if self.tokens <= 0.0 {
            return false;
        }
        self.tokens -= keys as f64;
        true
    }
}

/// The decision path of one router replica. See the module docs.
#[derive(Debug)]
pub struct RouterCore {
    index: PrefixIndex,
    /// This router's own requests, exact.
    own_load: LoadView,
    /// `own_load` plus every peer's latest: what policies route on.
    load: LoadView,
    /// Every instance ever seen, by id (ids are never reused).
    instances: Vec<InstanceState>,
    /// Instance ids by stable key. foldhash rather than SipHash: every peer's load names
    /// its busy instances by key on every gossip tick (up to ~180,000 lookups a tick at 128
    /// routers); the keys come from configuration, lookups of unknown ones insert nothing.
    by_key: hashbrown::HashMap<u64, InstanceId>,
    pools: HashMap<String, Vec<InstanceId>>,
    /// Decisions not yet handed to the gossip layer; `None` when running alone.
    outbox: Option<Vec<SharedDecision>>,
    /// When the oldest decision in the outbox was made.
    outbox_since: Option<u64>,
    /// Per-tenant round-robin cursor, tie-breaking generator and match buffers.
    policies: HashMap<String, PolicyState>,
    profile: ModelProfile,
    config: CoreConfig,
    /// Reused candidate list (no allocation per decision).
    candidates: Vec<InstanceId>,
    /// GPU KV capacity of each instance in tokens, by id (0: unknown).
    kv_capacity: Vec<u64>,
}

impl RouterCore {
    pub fn new(config: CoreConfig, profile: ModelProfile) -> Self {
        RouterCore {
            index: PrefixIndex::new(config.index),
            own_load: LoadView::new(),
            load: LoadView::new(),
            instances: Vec::new(),
            by_key: hashbrown::HashMap::new(),
            pools: HashMap::new(),
            outbox: None,
            outbox_since: None,
            policies: HashMap::new(),
            profile,
            config,
            candidates: Vec::new(),
            kv_capacity: Vec::new(),
        }
    }

    /// The GPU KV capacity of `instance` in tokens, as last set (0: unknown).
    pub fn kv_capacity(&self, instance: InstanceId) -> u64 {
        self.kv_capacity
            .get(instance.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    /// The GPU KV capacity of `instance`, in tokens, as its engine reports it.
    pub fn set_kv_capacity(&mut self, instance: InstanceId, tokens: u64) {
        let i = instance.0 as usize;
        if i >= self.kv_capacity.len() {
            self.kv_capacity.resize(i + 1, 0);
        }
        self.kv_capacity[i] = tokens;
    }

    /// Replaces the pools (a configuration change). New instances get new ids (ids are
    /// never reused); instances no longer in any pool leave the pools and the index. Each
    /// adapter names its pool's instances (a name that is already a model keeps its own:
    /// configurations are validated so that none is).
    pub fn set_pools(&mut self, pools: &[CorePool]) {
        let mut next: HashMap<String, Vec<InstanceId>> = HashMap::new();
        for pool in pools {
            for spec in &pool.instances {
                let id = match self.by_key.get(&spec.key) {
                    Some(&id) => id,
                    None => {
                        let id = InstanceId(self.instances.len() as u32);
                        self.instances.push(InstanceState {
                            name: spec.name.clone(),
                            key: spec.key,
                            healthy: true,
                            failures: 0,
                            ejected_until: 0,
                            observed: false,
                        });
                        self.by_key.insert(spec.key, id);
                        id
                    }
                };
                let members = next.entry(pool.model.clone()).or_default();
                if !members.contains(&id) {
                    members.push(id);
                }
            }
            // An adapter's requests go where its base model's do (a pool without instances
            // serves neither: both are unknown models).
            if let Some(members) = next.get(&pool.model).cloned() {
                for adapter in &pool.adapters {
                    next.entry(adapter.clone()).or_insert(members.clone());
                }
            }
        }
        let kept: HashSet<InstanceId> = next.values().flatten().copied().collect();
        for old in self.pools.values().flatten() {
            if !kept.contains(old) {
                self.index.remove_instance(*old);
            }
        }
        self.pools = next;
    }

    /// Chooses an instance for a request of `tenant` (configured by `policy`) to `model`,
    /// skipping `tried`, and records the decision: the prediction in the index, the keys
    /// for peers, and the request as in flight.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &mut self,
        tenant: &str,
        policy: &PolicyConfig,
        model: &str,
        request: &RouteRequest<'_>,
        tried: &[InstanceId],
        explain: bool,
        now: u64,
    ) -> Result<Decision, NoRoute> {
        let decision = self.decide(tenant, policy, model, request, tried, explain, false, now)?;
        let instance = decision.instance;
        if policy.strategy.uses_index() {
            let known = self.index.record_route(request.keys, instance, now);
            if let Some(outbox) = &mut self.outbox {
                if known < request.keys.len() {
                    if outbox.is_empty() {
                        self.outbox_since = Some(now);
                    }
                    outbox.push(SharedDecision {
                        instance: self.instances[instance.0 as usize].key,
                        keys: sparse_keys(request.keys, known),
                    });
                }
            }
        }
        // Pending prefill counts what the instance must compute, not what it holds.
        let pending = u64::from(decision.uncached_tokens);
        self.own_load.start(instance, pending);
        self.load.start(instance, pending);
        Ok(decision)
    }

    /// What [`RouterCore::route`] would choose at `now`, explained, changing nothing: no
    /// prediction, no load, no round-robin turn.
    pub fn dry_run(
        &mut self,
        tenant: &str,
        policy: &PolicyConfig,
        model: &str,
        request: &RouteRequest<'_>,
        now: u64,
    ) -> Result<Decision, NoRoute> {
        self.decide(tenant, policy, model, request, &[], true, true, now)
    }

    #[allow(clippy::too_many_arguments)]
    fn decide(
        &mut self,
        tenant: &str,
        policy: &PolicyConfig,
        model: &str,
        request: &RouteRequest<'_>,
        tried: &[InstanceId],
        explain: bool,
        dry_run: bool,
        now: u64,
    ) -> Result<Decision, NoRoute> {
        let pool = self.pools.get(model).ok_or(NoRoute::UnknownModel)?;
        self.candidates.clear();
        for &id in pool {
            if self.instances[id.0 as usize].available(now) && !tried.contains(&id) {
                self.candidates.push(id);
            }
        }
        if self.candidates.is_empty() {
            return Err(NoRoute::NoHealthyInstance);
        }
        self.index.expire(now);
        // Look up before inserting: `entry` would allocate the tenant id on every request.
        if !self.policies.contains_key(tenant) {
            self.policies.insert(
                tenant.to_string(),
                PolicyState::new(seed_of(tenant) ^ self.config.seed),
            );
        }
        let state = self.policies.get_mut(tenant).expect("inserted just above");
        let mut scratch_state;
        let state = if dry_run {
            scratch_state = state.clone();
            &mut scratch_state
        } else {
            state
        };
        let view = View {
            index: &self.index,
            load: &self.load,
            kv_capacity: &self.kv_capacity,
            profile: &self.profile,
            now,
        };
        route(policy, request, &self.candidates, &view, state, explain)
            .map_err(|_| NoRoute::NoHealthyInstance)
    }

    /// The request's first response byte arrived: its prefill is done. `pending` is the
    /// decision's `uncached_tokens`.
    pub fn first_token(&mut self, instance: InstanceId, pending: u32) {
        self.own_load.first_token(instance, u64::from(pending));
        self.load.first_token(instance, u64::from(pending));
    }

    /// The request routed at `decided_at` left the instance; `prefilled` says whether its
    /// first token came.
    ///
    /// A prefilled request also tells what the instance's cache now holds, where an agent
    /// reports it: the engine's KV events have said by now what that prefill stored and
    /// what it evicted; so every prediction on the instance made up to this decision
    /// retires, and only what is observed (and the predictions of requests routed since,
    /// which may still be queued) attracts requests. Without an agent, predictions live out
    /// their time-to-live. Engines admit requests in arrival order, so those routed before
    /// this one have been prefilled too.
    pub fn finish(&mut self, instance: InstanceId, pending: u32, prefilled: bool, decided_at: u64) {
        self.own_load
            .finish(instance, u64::from(pending), prefilled);
        self.load.finish(instance, u64::from(pending), prefilled);
        let observed = self
            .instances
            .get(instance.0 as usize)
            .is_some_and(|i| i.observed);
        if prefilled && observed {
            self.index.forget_predictions_before(instance, decided_at);
        }
    }

    /// The engine's account of a request routed by `decision` (for a tenant with
    /// `block_tokens`-token blocks and a prompt of `prompt_tokens` as the router counted
    /// it). If the engine found less cached than was predicted, by more than two blocks
    /// and as a share of the prompt (engines count tokens their own way), the instance
    /// evicted what it was sent when the deepest predicted block was last routed there,
    /// and (its cache being LRU) everything before: those predictions stop attracting
    /// requests. Returns whether the report contradicted a prediction.
    pub fn report_cached(
        &mut self,
        decision: &Decision,
        block_tokens: u32,
        prompt_tokens: u32,
        report: CacheReport,
    ) -> bool {
        let m = decision.matched;
        if m.predicted_at == 0
            || prompt_tokens == 0
            || report.prompt_tokens == 0
            || decision.decided_at.saturating_sub(m.predicted_at) < CONTRADICTION_GRACE_US
        {
            return false;
        }
        let router_prompt = f64::from(prompt_tokens);
        let predicted = f64::from(m.gpu) * f64::from(block_tokens) / router_prompt;
        let slack = 2.0 * f64::from(block_tokens) / router_prompt;
        let found = f64::from(report.cached_tokens) / f64::from(report.prompt_tokens);
        if found + slack >= predicted {
            return false;
        }
        self.index
            .forget_predictions_before(decision.instance, m.predicted_at);
        true
    }

    /// An attempt failed before its first byte: eject the instance for a while, longer
    /// for each consecutive failure, and forget what it held (it may have restarted).
    pub fn attempt_failed(&mut self, instance: InstanceId, now: u64) {
        let (base, max) = (self.config.eject_base_us, self.config.eject_max_us);
        let info = &mut self.instances[instance.0 as usize];
        info.failures = info.failures.saturating_add(1);
        let backoff = base
            .saturating_mul(1 << (info.failures - 1).min(16))
            .min(max);
        info.ejected_until = now.saturating_add(backoff);
        self.index.remove_instance(instance);
    }

    pub fn attempt_succeeded(&mut self, instance: InstanceId) {
        let info = &mut self.instances[instance.0 as usize];
        info.failures = 0;
        info.ejected_until = 0;
    }

    /// Result of an active health check; an instance going down forgets what it held.
    pub fn set_healthy(&mut self, instance: InstanceId, healthy: bool) {
        let info = &mut self.instances[instance.0 as usize];
        let went_down = info.healthy && !healthy;
        info.healthy = healthy;
        if went_down {
            self.index.remove_instance(instance);
        }
    }

    /// Applies an agent's observation of `instance`'s `tier` (see [`PrefixIndex::observe`]).
    pub fn observe(
        &mut self,
        instance: InstanceId,
        key: BlockKey,
        parent: Option<BlockKey>,
        tier: Tier,
        present: bool,
        now: u64,
    ) {
        self.index
            .observe(instance, key, parent, tier, present, now);
    }

    /// Whether an agent now reports `instance`'s GPU cache (a snapshot arrived), or no
    /// longer does (it expired or left): see [`RouterCore::finish`].
    pub fn set_observed(&mut self, instance: InstanceId, observed: bool) {
        if let Some(info) = self.instances.get_mut(instance.0 as usize) {
            info.observed = observed;
        }
    }

    /// Starts collecting decisions for the other routers.
    pub fn enable_sharing(&mut self) {
        self.outbox.get_or_insert_with(Vec::new);
    }

    /// Decisions made since the last call, and when the oldest of them was made.
    pub fn take_outbox(&mut self) -> (Vec<SharedDecision>, Option<u64>) {
        (
            self.outbox.as_mut().map(std::mem::take).unwrap_or_default(),
            self.outbox_since.take(),
        )
    }

    /// Applies other routers' decisions at `now`; decisions naming instances this router
    /// does not know are skipped (their count is returned).
    pub fn apply_shared(&mut self, decisions: &[SharedDecision], now: u64) -> usize {
        self.index.expire(now);
        let mut unknown = 0;
        for d in decisions {
            match self.by_key.get(&d.instance) {
                Some(&id) => self.index.record_shared(&d.keys, id, now),
                None => unknown += 1,
            }
        }
        unknown
    }

    /// This router's own load, by stable instance key, for publishing.
    pub fn own_loads(&self) -> Vec<(u64, InstanceLoad)> {
        self.own_load
            .iter()
            .filter_map(|(i, l)| self.instances.get(i.0 as usize).map(|s| (s.key, l)))
            .collect()
    }

    /// Replaces the peers' loads (`origin → (instance key, load)`; peers not listed have
    /// departed) and recomputes the combined view: this router's own load plus each peer's
    /// latest entry per instance. The gossip loop calls this every tick under the routing
    /// lock, so it costs the peers' busy entries (they publish no idle instance), not
    /// peers × instances: the entries are added straight into the combined view.
    pub fn set_peer_loads(&mut self, peers: Vec<(String, Vec<(u64, InstanceLoad)>)>) {
        let mut combined = self.own_load.clone();
        // A peer listed twice (a restart seen under both generations) counts once: its
        // later listing.
        let mut seen = HashSet::new();
        for (origin, mut entries) in peers.into_iter().rev() {
            if !seen.insert(origin) {
                continue;
            }
            // A peer's later entry for an instance replaces its earlier one. Peers send
            // their entries sorted by key, once each: only other input pays for a sort.
            if !entries.windows(2).all(|w| w[0].0 < w[1].0) {
                entries.reverse();
                entries.sort_by_key(|&(key, _)| key);
                entries.dedup_by_key(|&mut (key, _)| key);
            }
            for (key, load) in entries {
                if let Some(&id) = self.by_key.get(&key) {
                    combined.add_one(id, load);
                }
            }
        }
        self.load = combined;
    }

    /// The id of the instance with stable key `key`, if known.
    pub fn instance_by_key(&self, key: u64) -> Option<InstanceId> {
        self.by_key.get(&key).copied()
    }

    /// Every instance ever seen, by id.
    pub fn instances(&self) -> &[InstanceState] {
        &self.instances
    }

    /// Whether `model`'s pool has an instance that is up at `now` and not in `tried`.
    pub fn has_candidates(&self, model: &str, tried: &[InstanceId], now: u64) -> bool {
        self.pools.get(model).is_some_and(|pool| {
            pool.iter()
                .any(|id| self.instances[id.0 as usize].available(now) && !tried.contains(id))
        })
    }

    /// Ids of the instances in some pool now, sorted.
    pub fn active_instances(&self) -> Vec<InstanceId> {
        let mut ids: Vec<InstanceId> = self.pools.values().flatten().copied().collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Models with at least one instance, and their pools' adapters (as vLLM lists its LoRA
    /// modules), sorted.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> = self.pools.keys().cloned().collect();
        m.sort();
        m
    }

    /// Whether any known instance is up at `now`.
    pub fn any_healthy(&self, now: u64) -> bool {
        self.instances.iter().any(|i| i.available(now))
    }

    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }

    /// This router's own in-flight requests on `instance`.
    pub fn in_flight(&self, instance: InstanceId) -> u32 {
        self.own_load.get(instance).in_flight
    }

    /// In-flight requests of `instance` across the cluster (own + peers').
    pub fn cluster_in_flight(&self, instance: InstanceId) -> u32 {
        self.load.get(instance).in_flight
    }
}

/// A tenant's tie-breaking seed: stable across restarts.
fn seed_of(tenant: &str) -> u64 {
    let h = blake3::hash(tenant.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Reason, Strategy};

    #[test]
    fn a_router_publishes_its_share_of_the_clusters_budget() {
        // 32,000 keys/s for a cluster of 4 routers: 8,000 each, 2,000 (a quarter second)
        // in the bucket at most.
        let mut b = PublishBudget::new(32_000);
        assert!(b.take(0, 4, 1_500));
        // The bucket holds 500: a batch of 1,000 goes, in debt; then nothing until repaid.
        assert!(b.take(0, 4, 1_000));
        assert!(!b.take(0, 4, 1), "in debt");
        // An eighth of a second refills 1,000 keys: 500 after the debt.
        assert!(b.take(125, 4, 600));
        assert!(!b.take(125, 4, 1));
        // Idle for long: the bucket holds a quarter second, not more.
        assert!(b.take(60_000, 4, 2_000));
        assert!(!b.take(60_000, 4, 1));
        // Twice the routers, half the share each: 4,000 a second.
        assert!(b.take(60_250, 8, 5_000), "1,000 in the bucket");
        assert!(!b.take(61_250, 8, 1), "the debt of 4,000 just repaid");
        assert!(b.take(61_251, 8, 4));
        // A clock that steps back refills nothing and takes nothing away.
        assert!(!b.take(10_000, 8, 1));
        // No budget: everything goes.
        let mut free = PublishBudget::new(0);
        assert!((0..1000).all(|_| free.take(0, 128, 1 << 20)));
    }

    fn pool(model: &str, names: &[&str]) -> CorePool {
        CorePool {
            model: model.into(),
            instances: names
                .iter()
                .enumerate()
                .map(|(i, n)| InstanceSpec {
                    name: n.to_string(),
                    key: 100 + i as u64,
                })
                .collect(),
            adapters: Vec::new(),
        }
    }

    fn core(names: &[&str]) -> RouterCore {
        let mut c = RouterCore::new(CoreConfig::default(), ModelProfile::dynamo_default());
        c.set_pools(&[pool("m", names)]);
        c
    }

    fn keys(ids: &[u64]) -> Vec<BlockKey> {
        ids.iter().map(|&i| BlockKey(i)).collect()
    }

    const PREFIX: PolicyConfig = PolicyConfig {
        strategy: Strategy::PrefixAware,
        prefix_blocks: 0,
        concurrency_threshold: 0,
        temperature: 0.0,
        block_tokens: 64,
    };

    fn send(
        c: &mut RouterCore,
        ks: &[u64],
        tried: &[InstanceId],
        now: u64,
    ) -> Result<u32, NoRoute> {
        let ks = keys(ks);
        let req = RouteRequest {
            keys: &ks,
            prompt_tokens: 64 * ks.len() as u32 + 1,
        };
        c.route("t", &PREFIX, "m", &req, tried, false, now)
            .map(|d| d.instance.0)
    }

    #[test]
    fn an_adapter_is_routed_among_its_pools_instances() {
        let mut c = RouterCore::new(CoreConfig::default(), ModelProfile::dynamo_default());
        let with_adapter = CorePool {
            adapters: vec!["sql-lora".into()],
            ..pool("m", &["a", "b"])
        };
        let mut other = pool("q", &["c"]);
        other.instances[0].key = 200;
        c.set_pools(&[with_adapter, other]);
        let ks = keys(&[1, 2]);
        let req = RouteRequest {
            keys: &ks,
            prompt_tokens: 129,
        };
        let route = |c: &mut RouterCore, model: &str, now: u64| {
            c.route("t", &PREFIX, model, &req, &[], false, now)
                .map(|d| c.instances()[d.instance.0 as usize].name.clone())
        };
        // The adapter's first request lands on one of the pool's instances; the next
        // follows its prediction there.
        let first = route(&mut c, "sql-lora", 0).unwrap();
        assert!(first == "a" || first == "b", "{first}");
        assert_eq!(route(&mut c, "sql-lora", 1).as_ref(), Ok(&first));
        assert_eq!(route(&mut c, "q", 2).as_deref(), Ok("c"));
        assert_eq!(c.models(), ["m", "q", "sql-lora"]);
        // A pool that no longer lists it: the adapter is an unknown model.
        c.set_pools(&[pool("m", &["a", "b"])]);
        assert_eq!(route(&mut c, "sql-lora", 3), Err(NoRoute::UnknownModel));
        assert!(route(&mut c, "m", 4).is_ok());
        // A pool without instances: its adapter is as unknown as its model.
        let empty = CorePool {
            adapters: vec!["sql-lora".into()],
            ..pool("m", &[])
        };
        c.set_pools(&[empty]);
        assert_eq!(route(&mut c, "sql-lora", 5), Err(NoRoute::UnknownModel));
        assert_eq!(route(&mut c, "m", 6), Err(NoRoute::UnknownModel));
    }

    #[test]
    fn routes_record_predictions_and_load() {
        let mut c = core(&["a", "b"]);
        let first = send(&mut c, &[1, 2, 3], &[], 0).unwrap();
        assert_eq!(c.in_flight(InstanceId(first)), 1);
        // The same prefix follows its prediction, even when busier.
        assert_eq!(send(&mut c, &[1, 2, 3, 4], &[], 1).unwrap(), first);
        // A tried instance is skipped; with every instance tried there is no route.
        let other = send(&mut c, &[1, 2, 3], &[InstanceId(first)], 2).unwrap();
        assert_ne!(other, first);
        assert_eq!(
            send(&mut c, &[1], &[InstanceId(0), InstanceId(1)], 3),
            Err(NoRoute::NoHealthyInstance)
        );
        let ks = keys(&[1]);
        let req = RouteRequest {
            keys: &ks,
            prompt_tokens: 65,
        };
        assert_eq!(
            c.route("t", &PREFIX, "other", &req, &[], false, 0),
            Err(NoRoute::UnknownModel)
        );
        c.first_token(InstanceId(first), 1);
        c.finish(InstanceId(first), 1, true, 0);
        c.finish(InstanceId(first), 1, false, 0);
        assert_eq!(c.in_flight(InstanceId(first)), 0);
    }

    #[test]
    fn a_finished_request_retires_predictions_only_where_an_agent_reports() {
        let matched = |c: &RouterCore, i: InstanceId, ks: &[u64], now| {
            c.index.match_prefix(&keys(ks), 16, now).of(i).gpu
        };
        let mut c = core(&["a", "b"]);
        let a = InstanceId(send(&mut c, &[1, 2, 3], &[], 10).unwrap());
        // No agent: the prediction lives on after the request completes.
        c.finish(a, 0, true, 10);
        assert_eq!(matched(&c, a, &[1, 2, 3], 20), 3);
        // An agent reports a: what the engine stored is observed (here blocks 1 and 2;
        // it evicted 3), and a completed request retires the predictions made up to its
        // decision, not those of requests routed since.
        c.set_observed(a, true);
        c.observe(a, BlockKey(1), None, Tier::Gpu, true, 30);
        c.observe(a, BlockKey(2), Some(BlockKey(1)), Tier::Gpu, true, 30);
        assert_eq!(send(&mut c, &[1, 2, 3, 4], &[b_of(a)], 50), Ok(a.0));
        c.finish(a, 0, true, 10);
        assert_eq!(
            matched(&c, a, &[1, 2, 3, 4], 60),
            4,
            "routed at 50, still queued"
        );
        c.finish(a, 0, true, 50);
        assert_eq!(
            matched(&c, a, &[1, 2, 3, 4], 60),
            2,
            "only what the agent reported"
        );
        // The agent gone, predictions live their time again.
        c.set_observed(a, false);
        assert_eq!(send(&mut c, &[1, 2, 3, 4], &[b_of(a)], 70), Ok(a.0));
        c.finish(a, 0, true, 70);
        assert_eq!(matched(&c, a, &[1, 2, 3, 4], 80), 4);
    }

    fn b_of(a: InstanceId) -> InstanceId {
        InstanceId(1 - a.0)
    }

    #[test]
    fn dry_run_changes_nothing() {
        let mut c = core(&["a", "b"]);
        let ks = keys(&[7, 8]);
        let req = RouteRequest {
            keys: &ks,
            prompt_tokens: 200,
        };
        let d = c.dry_run("t", &PREFIX, "m", &req, 0).unwrap();
        assert_eq!(d.reason, Reason::NoMatch);
        assert_eq!(d.candidates.map(|c| c.len()), Some(2));
        assert_eq!(c.in_flight(d.instance), 0);
        assert_eq!(c.index_stats().entries, 0);
    }

    #[test]
    fn failures_eject_with_backoff_and_forget() {
        let mut c = core(&["a", "b"]);
        let a = InstanceId(send(&mut c, &[1, 2], &[], 0).unwrap());
        let b = InstanceId(1 - a.0);
        c.attempt_failed(a, 10);
        // Ejected for the base backoff (1 s), then its predictions are gone.
        assert_eq!(send(&mut c, &[1, 2], &[], 20).unwrap(), b.0);
        assert!(!c.has_candidates("m", &[b], 1_000_009));
        assert!(c.has_candidates("m", &[b], 1_000_010));
        c.attempt_failed(a, 2_000_000);
        assert!(!c.has_candidates("m", &[b], 3_999_999));
        assert!(c.has_candidates("m", &[b], 4_000_000));
        c.attempt_succeeded(a);
        assert!(c.has_candidates("m", &[b], 2_000_001));
        // A health check marks it down, then up.
        c.set_healthy(a, false);
        assert!(!c.has_candidates("m", &[b], 5_000_000) && c.any_healthy(5_000_000));
        c.set_healthy(a, true);
        assert!(c.has_candidates("m", &[b], 5_000_000));
    }

    #[test]
    fn pools_change_in_place() {
        let mut c = core(&["a", "b"]);
        send(&mut c, &[1, 2], &[], 0).unwrap();
        // b stays (same key, same id); a leaves and takes its predictions along; c is new.
        let mut next = pool("m", &["b", "c"]);
        next.instances[0].key = 101;
        next.instances[1].key = 102;
        c.set_pools(&[next, pool("n", &["a"])]);
        assert_eq!(c.models(), vec!["m".to_string(), "n".to_string()]);
        assert_eq!(c.instance_by_key(101), Some(InstanceId(1)));
        assert_eq!(c.instance_by_key(102), Some(InstanceId(2)));
        assert_eq!(
            c.active_instances(),
            vec![InstanceId(0), InstanceId(1), InstanceId(2)]
        );
    }

    #[test]
    fn decisions_and_loads_are_shared() {
        let mut one = core(&["a", "b"]);
        let mut two = core(&["a", "b"]);
        one.enable_sharing();
        let first = send(&mut one, &[1, 2, 3, 4, 5], &[], 10).unwrap();
        let (out, since) = one.take_outbox();
        assert_eq!(since, Some(10));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].keys, keys(&[4, 5]));
        assert_eq!(two.apply_shared(&out, 20), 0);
        assert_eq!(send(&mut two, &[1, 2, 3, 4, 5, 6], &[], 30).unwrap(), first);
        let unknown = SharedDecision {
            instance: 9,
            keys: keys(&[1]),
        };
        assert_eq!(two.apply_shared(&[unknown], 40), 1);
        // Loads: the peer's published counts add to the own ones, and go when it does.
        two.set_peer_loads(vec![("one".into(), one.own_loads())]);
        assert_eq!(two.cluster_in_flight(InstanceId(first)), 2);
        assert_eq!(two.in_flight(InstanceId(first)), 1);
        two.set_peer_loads(vec![]);
        assert_eq!(two.cluster_in_flight(InstanceId(first)), 1);
    }
}
