//! The agent's service: answers block API requests from L1 and L2, writes L2 in the
//! background, loads prefetch hints (and, where configured, engines' L2 reads) into L1,
//! expires leases, and counts everything.
//!
//! The L1 mutex is held for one request's L1 work (a put's inserts, a lookup's walk over its
//! keys, a get's copies of reference-counted payload handles): never across an await, never
//! over the whole store. L2 calls run outside it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::join_all;
use metrics::{counter, gauge, histogram};
use tokio::sync::mpsc;

use crate::block::{decode_with, Block};
use crate::config::{AgentConfig, L2Config, WritePolicy};
use crate::hyperpod::request::ObjectName;
use crate::hyperpod::ObjectEvent;
use crate::ingest::{Ingest, ObjectTier, Tenants};
use crate::kv_events::EngineHash;
use crate::l1::{Evicted, PutError, Stored, L1};
use crate::l2::{AnyL2, DirL2, L2Backend, L2Error, RedisL2};
use crate::pool::BufPool;
use crate::proto::{
    AgentStats, ErrorKind, GotBlock, PutItem, PutRefusal, Request, Response, StoreTier,
};
use crate::sealed::Sealed;
use warmpath_residency::{Change, L2Window, Publisher, Scope};
use warmpath_tiers::{BlockId, Owner, Refused};

/// Counters kept here as well as in metrics, for `Stats` and the tests.
#[derive(Debug, Default)]
struct Counters {
    l1_hits: AtomicU64,
    l2_hits: AtomicU64,
    misses: AtomicU64,
    l2_errors: AtomicU64,
    l2_damaged: AtomicU64,
}

/// One agent.
#[derive(Debug)]
pub struct Agent {
    config: AgentConfig,
    l1: Mutex<L1>,
    l2: Option<Arc<AnyL2>>,
    /// Background L2 writes; full means dropped (counted), never a stalled put.
    l2_writes: Option<mpsc::Sender<(BlockId, Stored)>>,
    /// Lease times are microseconds since this instant.
    epoch: Instant,
    /// Shared with the background L2 writer, which counts its failures here too.
    counters: Arc<Counters>,
    /// The engines' caches as their KV events tell them, and what is reported to routers.
    ingest: Arc<Mutex<Ingest>>,
    /// Bumped when a tenant table changes keys already reported: the KV-event subscribers
    /// then rebuild their views (`kv_subscribe`'s resync).
    resyncs: tokio::sync::watch::Sender<u64>,
    report: Arc<Report>,
    /// The buffers payloads are read into, used again when blocks leave L1.
    pool: BufPool,
    /// Sealed memfds L1 may hold (each an open descriptor): past it a sealed put is read
    /// into memory instead ([`sealed_fd_budget`]).
    sealed_cap: usize,
    /// Prefetches running (at most [`PREFETCHES_IN_FLIGHT`]; more are dropped).
    prefetch_slots: Arc<tokio::sync::Semaphore>,
    /// The layouts of the latest puts, newest first (at most [`PREFETCH_LAYOUTS`]): a
    /// router's prefetch hint names keys, and these are the layouts its engines store.
    layouts: Mutex<Vec<u64>>,
}

/// Prefetches an agent runs at once; a hint beyond them is dropped (counted): it is a
/// hint, and an agent busy reading L2 for earlier ones would serve it late anyway.
const PREFETCHES_IN_FLIGHT: usize = 4;
/// Layouts a prefetch tries, newest first (engines of one host store one or a few).
const PREFETCH_LAYOUTS: usize = 4;
/// L2 reads a prefetch has in flight at once.
const PREFETCH_READS: usize = 16;

/// The layout of the L2 aliases agents write (record 0126): a pool key's alias is stored
/// as `BlockId { layout: ALIAS_LAYOUT, key }`, and the block API refuses the layout.
pub const ALIAS_LAYOUT: u64 = u64::from_be_bytes(*b"wp-alias");
/// Aliases the writer takes from the ingest each round, and how often it looks.
const ALIASES_PER_ROUND: usize = 512;
const ALIAS_ROUND: Duration = Duration::from_millis(100);

/// An L2 alias's payload (postcard): the keys of the blocks an engine stored a pool
/// key's tokens in, in chain order. Versioned, as every binary format of ours.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Alias {
    V1 { blocks: Vec<u64> },
}

impl Alias {
    /// Its bytes, as an alias object's payload.
    pub fn encode(&self) -> Bytes {
        Bytes::from(postcard::to_stdvec(self).unwrap_or_default())
    }

    /// The alias in `payload`, if it is one.
    pub fn decode(payload: &[u8]) -> Option<Alias> {
        postcard::from_bytes(payload).ok()
    }
}

/// What routers are told: the engines' caches (recorded by the KV-event subscribers) and
/// this agent's own L1 and L2 (recorded here), in one residency publisher.
#[derive(Debug)]
struct Report {
    residency: Arc<Mutex<Publisher>>,
    l2: Mutex<L2Window>,
    /// Notified when residency changed, so that the next delta goes out at once.
    changed: Arc<tokio::sync::Notify>,
    /// With engines' KV events followed: a block an engine put under the hash its events
    /// gave it is reported as the routers' keys those events were keyed to (record 0124);
    /// any other put, and every put without the events, as the key it names.
    ingest: Option<Arc<Mutex<Ingest>>>,
}

impl Report {
    fn record(&self, changes: impl IntoIterator<Item = Change>) {
        let mut any = false;
        {
            let mut p = self.residency.lock().unwrap_or_else(|e| e.into_inner());
            for c in changes {
                p.record(c);
                any = true;
            }
        }
        if any {
            self.changed.notify_one();
        }
    }

    /// L1 now holds `stored` and no longer holds `evicted`. Parents are not known here (a
    /// put names blocks, not chains); the index keeps the parents the GPU events gave.
    fn l1(&self, stored: impl Iterator<Item = BlockId>, evicted: impl Iterator<Item = BlockId>) {
        let change = |id: BlockId, present| Change {
            scope: Scope::L1,
            key: id.key.0,
            parent: None,
            present,
        };
        self.record_mapped(
            stored
                .map(|id| change(id, true))
                .chain(evicted.map(|id| change(id, false))),
        );
    }

    /// Records changes of blocks named as the puts name them: as the keys the engines'
    /// events gave the blocks where those events named them, else as they are (mapped
    /// under the ingest's lock, recorded after it, as the KV-event subscribers do).
    fn record_mapped(&self, changes: impl IntoIterator<Item = Change>) {
        let Some(ingest) = &self.ingest else {
            return self.record(changes);
        };
        let mapped: Vec<Change> = {
            let mut ingest = ingest.lock().unwrap_or_else(|p| p.into_inner());
            let mut out = Vec::new();
            for c in changes {
                let tier = match c.scope {
                    Scope::L2 => ObjectTier::L2,
                    _ => ObjectTier::L1,
                };
                // The engine's hash of the block, as its events carry it.
                let hash = EngineHash::of_u64(c.key);
                let mapped = match c.present {
                    true => ingest.block_put(&hash, tier),
                    false => ingest.block_gone(&hash, tier),
                };
                match mapped {
                    Some(changes) => out.extend(changes),
                    None => out.push(c),
                }
            }
            out
        };
        self.record(mapped);
    }

    /// L2 now holds `stored`, and its store evicted `evicted` to make room.
    fn l2_stored(&self, stored: BlockId, evicted: &[BlockId]) {
        let changes = {
            let mut w = self.l2.lock().unwrap_or_else(|e| e.into_inner());
            // Aliases (record 0126) name no block of their own; what writing one evicted
            // is reported as any eviction.
            let mut c = match stored.layout {
                ALIAS_LAYOUT => Vec::new(),
                _ => w.stored(stored.key.0, None),
            };
            c.extend(
                evicted
                    .iter()
                    .filter(|id| id.layout != ALIAS_LAYOUT)
                    .filter_map(|id| w.gone(id.key.0)),
            );
            c
        };
        self.record_mapped(changes);
    }

    /// L2 was found not to hold `id`.
    fn l2_gone(&self, id: BlockId) {
        if id.layout == ALIAS_LAYOUT {
            return;
        }
        let change = self
            .l2
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .gone(id.key.0);
        self.record_mapped(change);
    }
}

impl Agent {
    /// Builds the agent and, with an L2, starts its background writer (call inside a tokio
    /// runtime). A directory L2 is opened here; Redis is connected lazily.
    pub fn start(config: AgentConfig) -> Result<Arc<Agent>, L2Error> {
        describe_metrics();
        let l2 = match &config.l2 {
            L2Config::None => None,
            L2Config::Dir { path, bytes } => {
                Some(Arc::new(AnyL2::Dir(Box::new(DirL2::open(path, *bytes)?))))
            }
            L2Config::Redis { url, prefix } => Some(Arc::new(AnyL2::Redis(Box::new(
                RedisL2::new(url, prefix, config.l2_deadline)?,
            )))),
        };
        let counters = Arc::new(Counters::default());
        let mut publisher = Publisher::new(
            new_epoch(),
            config.kv_events.iter().map(|(n, _)| n.clone()).collect(),
        );
        if config.residency_every_block {
            publisher = publisher.reporting_every(1);
        } else if config.kv_block_tokens > 0 {
            // Else it reports every block until the engines' first store tells the size.
            publisher.report_for_block_tokens(config.kv_block_tokens);
        }
        let tenants = if config.kv_tenants.is_empty() {
            Tenants::Fixed("engine-sim".into())
        } else {
            Tenants::Table(
                config
                    .kv_tenants
                    .iter()
                    .map(|(id, salt)| (salt.clone(), id.clone()))
                    .collect(),
            )
        };
        let mut ingest = Ingest::new(tenants, config.kv_events.len());
        // The pool's block size, when given: before the first batch, so every key is cut
        // to it, and CPU-tier blocks that come before any GPU store are reported.
        ingest.set_block_tokens(Some(config.kv_block_tokens));
        let ingest = Arc::new(Mutex::new(ingest));
        let report = Arc::new(Report {
            residency: Arc::new(Mutex::new(publisher)),
            l2: Mutex::new(L2Window::new(config.residency_l2_blocks)),
            changed: Arc::new(tokio::sync::Notify::new()),
            ingest: (!config.kv_events.is_empty()).then(|| ingest.clone()),
        });
        let pool = BufPool::new(pool_bytes(config.l1_bytes));
        let l2_writes = l2.as_ref().map(|l2| {
            let (tx, rx) = mpsc::channel(config.l2_write_queue.max(1));
            let seal = seal_of(&config);
            tokio::spawn(write_l2(
                l2.clone(),
                rx,
                counters.clone(),
                report.clone(),
                seal,
                pool.clone(),
            ));
            tx
        });
        if let (Some(l2), false) = (&l2, config.kv_events.is_empty()) {
            tokio::spawn(write_aliases(
                l2.clone(),
                Arc::downgrade(&ingest),
                seal_of(&config),
                report.clone(),
            ));
        }
        let agent = Arc::new(Agent {
            l1: Mutex::new(L1::new(config.l1_bytes, config.l1_eviction)),
            config,
            l2,
            l2_writes,
            epoch: Instant::now(),
            counters,
            ingest,
            resyncs: tokio::sync::watch::Sender::new(0),
            report,
            pool,
            sealed_cap: sealed_fd_budget(),
            prefetch_slots: Arc::new(tokio::sync::Semaphore::new(PREFETCHES_IN_FLIGHT)),
            layouts: Mutex::new(Vec::new()),
        });
        for (i, (_, endpoint)) in agent.config.kv_events.iter().enumerate() {
            tokio::spawn(crate::kv_subscribe::subscribe(
                i,
                endpoint.clone(),
                agent.ingest.clone(),
                agent.report.residency.clone(),
                agent.report.changed.clone(),
                agent.resyncs.subscribe(),
            ));
        }
        // Counters of lookups and of rare events are exported from the start, at 0: rates,
        // alerts and dashboards work before the first event.
        for tier in ["l1", "l2"] {
            counter!(crate::metric_names::AGENT_HITS_TOTAL, "tier" => tier).increment(0);
        }
        counter!(crate::metric_names::AGENT_MISSES_TOTAL).increment(0);
        counter!(crate::metric_names::AGENT_EVICTIONS_TOTAL, "tier" => "l1").increment(0);
        if !matches!(agent.config.l2, L2Config::None) {
            for op in ["contains", "get", "put"] {
                counter!(crate::metric_names::AGENT_L2_ERRORS_TOTAL, "op" => op).increment(0);
            }
        }
        gauge!(crate::metric_names::AGENT_CAPACITY_BYTES, "tier" => "l1")
            .set(agent.config.l1_bytes as f64);
        if let L2Config::Dir { bytes, .. } = &agent.config.l2 {
            gauge!(crate::metric_names::AGENT_CAPACITY_BYTES, "tier" => "l2").set(*bytes as f64);
        }
        // Leases end on time even when no request comes; the occupancy gauges are refreshed
        // here too, every 100 ms, rather than by every request (which would take the L1 lock
        // a second time per request).
        let weak = Arc::downgrade(&agent);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let Some(agent) = weak.upgrade() else { return };
                let now = agent.now_us();
                let expired = agent.lock_l1().expire(now);
                if expired > 0 {
                    counter!(crate::metric_names::AGENT_LEASES_TOTAL, "result" => "expired")
                        .increment(expired as u64);
                }
                agent.publish_l1();
            }
        });
        Ok(agent)
    }

    /// What the agent reports to routers (the residency session's publisher).
    pub fn residency(&self) -> (Arc<Mutex<Publisher>>, Arc<tokio::sync::Notify>) {
        (self.report.residency.clone(), self.report.changed.clone())
    }

    /// Takes the tenant table a router sent for configuration `version` ((cache salt,
    /// tenant id) pairs), unless it is older than the one held or too large (counted).
    pub fn learn_tenants(&self, version: u64, salts: Vec<(String, String)>) {
        let mut ingest = self.ingest.lock().unwrap_or_else(|p| p.into_inner());
        match ingest.learn_tenants_at(version, salts) {
            Ok(rekeyed) => {
                gauge!(crate::metric_names::AGENT_LEARNED_TENANTS)
                    .set(ingest.learned_tenants() as f64);
                gauge!(crate::metric_names::AGENT_LEARNED_TENANTS_VERSION).set(version as f64);
                drop(ingest);
                if rekeyed {
                    self.resyncs.send_modify(|n| *n += 1);
                }
            }
            Err(why) => {
                counter!(crate::metric_names::AGENT_TENANT_TABLES_REFUSED_TOTAL, "reason" => why.name())
                    .increment(1);
                tracing::debug!(version, reason = why.name(), "tenant table refused");
            }
        }
    }

    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    /// The L2 store, shared with the HyperPod daemon API (`crate::hyperpod`), which evicts
    /// its objects to it and loads them back.
    pub fn l2(&self) -> Option<Arc<AnyL2>> {
        self.l2.clone()
    }

    /// The cluster key L2 objects are sealed under and this agent's writer id, when
    /// `[l2] key_file` is configured (decision 0106): the HyperPod store seals its L2
    /// objects with it as the block API does.
    pub fn l2_seal(&self) -> Option<(crate::block::SealKey, u64)> {
        seal_of(&self.config)
    }

    /// The buffers the block API reads payloads into.
    pub fn pool(&self) -> &BufPool {
        &self.pool
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn lock_l1(&self) -> MutexGuard<'_, L1> {
        self.l1.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answers one request; `payloads` are the blocks after its header, each in a buffer of
    /// its own with the checksum computed as it arrived (`server::read_body`). The answer's
    /// payloads follow its header on the wire.
    /// `owner` is the connection's: its pins and leases are its own, counted against its
    /// quotas, and end with it ([`Agent::connection_closed`]).
    /// A sealed put's descriptors (`sealed.rs`) come in `fds`, one per block in order; a
    /// sealed get's answer carries its blocks' descriptors in the third part.
    pub async fn handle(
        &self,
        owner: Owner,
        request: Request,
        payloads: Vec<Block>,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> (Response, Vec<Bytes>, Vec<Arc<Sealed>>) {
        let started = Instant::now();
        let mut sealed = Vec::new();
        if request.layout() == Some(ALIAS_LAYOUT) {
            let why = format!("layout {ALIAS_LAYOUT:#x} is the agents' own (L2 aliases)");
            return (error(ErrorKind::BadRequest, why).0, Vec::new(), sealed);
        }
        let (op, answer) = match request {
            Request::Put { layout, blocks } => ("put", self.put(owner, layout, &blocks, payloads)),
            Request::PutSealed { layout, blocks } => {
                ("put", self.put_sealed(owner, layout, &blocks, fds))
            }
            Request::GetSealed { layout, keys } => {
                let (answer, fds) = self.get_sealed(layout, &keys).await;
                sealed = fds;
                ("get", answer)
            }
            Request::Lookup {
                layout,
                keys,
                lease_ms,
            } => ("lookup", self.lookup(owner, layout, &keys, lease_ms).await),
            Request::Get { layout, keys } => ("get", self.get(layout, &keys).await),
            Request::Release { lease } => ("release", self.release(owner, lease)),
            Request::Unpin { layout, keys } => ("unpin", self.unpin(owner, layout, &keys)),
            Request::Stats => ("stats", (Response::Stats(self.stats()), Vec::new())),
        };
        histogram!(crate::metric_names::AGENT_OP_DURATION_SECONDS, "op" => op)
            .record(started.elapsed().as_secs_f64());
        if let Response::Error { kind, .. } = &answer.0 {
            counter!(crate::metric_names::AGENT_REQUEST_ERRORS_TOTAL, "op" => op, "kind" => error_label(*kind))
                .increment(1);
        }
        (answer.0, answer.1, sealed)
    }

    /// Ends the pins and leases of a block API connection that closed (counted).
    pub fn connection_closed(&self, owner: Owner) {
        let (pins, leases) = self.lock_l1().release_owner(owner);
        if pins > 0 {
            counter!(crate::metric_names::AGENT_PINS_ENDED_TOTAL).increment(pins as u64);
        }
        if leases > 0 {
            counter!(crate::metric_names::AGENT_LEASES_TOTAL, "result" => "closed")
                .increment(leases as u64);
        }
    }

    fn too_many(&self, n: usize) -> Option<(Response, Vec<Bytes>)> {
        (n > self.config.max_keys).then(|| {
            error(
                ErrorKind::BadRequest,
                format!(
                    "{n} blocks in one request; at most {}",
                    self.config.max_keys
                ),
            )
        })
    }

    fn put(
        &self,
        owner: Owner,
        layout: u64,
        items: &[PutItem],
        payloads: Vec<Block>,
    ) -> (Response, Vec<Bytes>) {
        if let Some(e) = self.too_many(items.len()) {
            return e;
        }
        let lens_match = payloads.len() == items.len()
            && items
                .iter()
                .zip(&payloads)
                .all(|(i, p)| p.payload.len() == i.bytes as usize);
        if !lens_match {
            return error(
                ErrorKind::Malformed,
                "payloads do not match the put's blocks".into(),
            );
        }
        let mut refused = Vec::new();
        // Each payload arrived in a buffer of its own (so no block keeps its neighbours'
        // bytes alive) with its checksum: stored as it is, no copy.
        let owned: Vec<Option<Stored>> = items
            .iter()
            .zip(payloads)
            .enumerate()
            .map(|(i, (item, p))| {
                if u64::from(item.bytes) > self.config.max_block_bytes {
                    refused.push((i as u32, PutRefusal::TooLarge));
                    None
                } else {
                    Some(Stored::Memory(p))
                }
            })
            .collect();
        self.store(owner, layout, items, owned, refused)
    }

    /// A put whose payloads are sealed memfds (`sealed.rs`): each is sealed here, its length
    /// checked against its item, and kept as the L1 block (no copy; its checksum taken when
    /// first needed, here only for a key L1 holds already), or read into memory when L1
    /// holds its share of the open-file limit in memfds. A
    /// descriptor that is not a sealable memfd of its item's length fails the whole put
    /// (nothing stored): the engine is out of step or not one.
    fn put_sealed(
        &self,
        owner: Owner,
        layout: u64,
        items: &[PutItem],
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> (Response, Vec<Bytes>) {
        if let Some(e) = self.too_many(items.len()) {
            return e;
        }
        if fds.len() != items.len() {
            return error(
                ErrorKind::Malformed,
                format!(
                    "{} descriptors for a put of {} blocks",
                    fds.len(),
                    items.len()
                ),
            );
        }
        // The blocks L1 holds already under these keys: a second put must be compared, so
        // both checksums are taken here, outside the lock.
        let (keep, held): (bool, Vec<Option<Stored>>) = {
            let l1 = self.lock_l1();
            let keep = l1.sealed_blocks() + items.len() <= self.sealed_cap;
            let held = items
                .iter()
                .map(|i| l1.peek(&BlockId::new(layout, i.key)))
                .collect();
            (keep, held)
        };
        let mut refused = Vec::new();
        let mut owned = Vec::with_capacity(items.len());
        for (i, ((item, fd), held)) in items.iter().zip(fds).zip(held).enumerate() {
            if u64::from(item.bytes) > self.config.max_block_bytes {
                refused.push((i as u32, PutRefusal::TooLarge));
                owned.push(None);
                continue;
            }
            let sealed = match Sealed::adopt(fd, u64::from(item.bytes)) {
                Ok(s) => Arc::new(s),
                Err(e) => {
                    counter!(crate::metric_names::AGENT_PROTOCOL_ERRORS_TOTAL).increment(1);
                    return error(ErrorKind::BadRequest, format!("block {i}: {e}"));
                }
            };
            if let Some(held) = held {
                let taken = sealed.checksum().and_then(|_| match &held {
                    Stored::Sealed(h) => h.checksum().map(|_| ()),
                    Stored::Memory(_) => Ok(()),
                });
                if let Err(e) = taken {
                    return error(ErrorKind::Internal, format!("block {i}: {e}"));
                }
            }
            let stored = Stored::Sealed(sealed);
            owned.push(Some(if keep {
                stored
            } else {
                match stored.to_block(&self.pool) {
                    Ok(b) => Stored::Memory(b),
                    Err(e) => return error(ErrorKind::Internal, format!("block {i}: {e}")),
                }
            }));
        }
        self.store(owner, layout, items, owned, refused)
    }

    /// A put's blocks into L1 (`None`: refused already, listed in `refused`), reported,
    /// counted and queued for L2 per the write policy.
    fn store(
        &self,
        owner: Owner,
        layout: u64,
        items: &[PutItem],
        owned: Vec<Option<Stored>>,
        mut refused: Vec<(u32, PutRefusal)>,
    ) -> (Response, Vec<Bytes>) {
        self.saw_layout(layout);
        let mut evicted: Evicted = Vec::new();
        let mut stored_blocks = Vec::new();
        {
            let mut l1 = self.lock_l1();
            let pin_cap = self.config.pin_cap_bytes();
            let mut pins_left = self
                .config
                .max_pins_per_connection
                .saturating_sub(l1.holds_of(owner).0);
            // Last block first: within a chain the first block is the last to be evicted.
            for (i, (item, block)) in items.iter().zip(owned).enumerate().rev() {
                let Some(block) = block else { continue };
                let id = BlockId::new(layout, item.key);
                if item.pin && pins_left == 0 {
                    refused.push((i as u32, PutRefusal::PinLimit));
                    continue;
                }
                let pin = item.pin.then_some(owner);
                match l1.put_for(id, block.clone(), pin, pin_cap, &mut evicted) {
                    Ok(()) => {
                        if item.pin {
                            pins_left -= 1;
                        }
                        stored_blocks.push((id, block))
                    }
                    Err(PutError::Tier(Refused::TooLarge { .. })) => {
                        refused.push((i as u32, PutRefusal::TooLarge))
                    }
                    Err(PutError::Tier(Refused::Full)) => {
                        refused.push((i as u32, PutRefusal::Full))
                    }
                    Err(PutError::Conflict) => refused.push((i as u32, PutRefusal::Conflict)),
                    Err(PutError::PinCap) => refused.push((i as u32, PutRefusal::PinLimit)),
                }
            }
        }
        refused.sort_unstable();
        self.report.l1(
            stored_blocks.iter().map(|(id, _)| *id),
            evicted.iter().map(|(id, _)| *id),
        );
        let bytes_in: u64 = stored_blocks.iter().map(|(_, b)| b.len() as u64).sum();
        counter!(crate::metric_names::AGENT_BYTES_TOTAL, "tier" => "l1", "direction" => "in")
            .increment(bytes_in);
        counter!(crate::metric_names::AGENT_EVICTIONS_TOTAL, "tier" => "l1")
            .increment(evicted.len() as u64);
        for (_, why) in &refused {
            counter!(crate::metric_names::AGENT_PUT_REFUSED_TOTAL, "reason" => why.name())
                .increment(1);
        }
        match self.config.l2_write {
            WritePolicy::Through => self.queue_l2(stored_blocks.iter().cloned()),
            WritePolicy::OnEvict => {}
        }
        self.queue_l2_evicted(evicted);
        (
            Response::Put {
                stored: stored_blocks.len() as u32,
                refused,
            },
            Vec::new(),
        )
    }

    /// Blocks L1 evicted go to L2 under write-on-evict; under write-through they are there.
    fn queue_l2_evicted(&self, evicted: Evicted) {
        if self.config.l2_write == WritePolicy::OnEvict {
            self.queue_l2(evicted.into_iter());
        }
    }

    fn queue_l2(&self, blocks: impl Iterator<Item = (BlockId, Stored)>) {
        let Some(tx) = &self.l2_writes else { return };
        for (id, block) in blocks {
            if tx.try_send((id, block)).is_err() {
                counter!(crate::metric_names::AGENT_L2_WRITE_DROPPED_TOTAL).increment(1);
            }
        }
    }

    /// A lookup that finds nothing in L1 takes no lease (lease 0), nor does one past the
    /// connection's lease quota (counted `refused`): its blocks are reported, not held.
    async fn lookup(
        &self,
        owner: Owner,
        layout: u64,
        keys: &[u64],
        lease_ms: u32,
    ) -> (Response, Vec<Bytes>) {
        if let Some(e) = self.too_many(keys.len()) {
            return e;
        }
        let ids: Vec<BlockId> = keys.iter().map(|&k| BlockId::new(layout, k)).collect();
        let in_l1: Vec<bool> = {
            let l1 = self.lock_l1();
            ids.iter().map(|id| l1.contains(id)).collect()
        };
        let first_gap = in_l1.iter().position(|&h| !h).unwrap_or(ids.len());
        // Only what L1 lacks after the leading run is asked of L2, in one round trip.
        let mut in_l2 = vec![false; ids.len()];
        if first_gap < ids.len() {
            if let Some(l2) = &self.l2 {
                let ask: Vec<usize> = (first_gap..ids.len()).filter(|&i| !in_l1[i]).collect();
                let asked: Vec<BlockId> = ask.iter().map(|&i| ids[i]).collect();
                // An error is counted and the lookup falls back to L1 alone.
                if let Ok(found) = self.timed_l2("contains", l2.contains(&asked)).await {
                    for (i, f) in ask.into_iter().zip(found) {
                        in_l2[i] = f;
                        if !f {
                            self.report.l2_gone(ids[i]);
                        }
                    }
                }
            }
        }
        let ttl_us = (u64::from(lease_ms) * 1000).min(self.config.max_lease.as_micros() as u64);
        let now = self.now_us();
        let mut tiers = Vec::new();
        let lease = {
            let mut l1 = self.lock_l1();
            // L1 may have changed while L2 answered: what left it counts only if L2 has it.
            for (i, id) in ids.iter().enumerate() {
                if l1.contains(id) {
                    tiers.push(StoreTier::L1);
                } else if in_l2[i] {
                    tiers.push(StoreTier::L2);
                } else {
                    break;
                }
            }
            let leased: Vec<BlockId> = ids[..tiers.len()]
                .iter()
                .zip(&tiers)
                .filter(|(_, t)| **t == StoreTier::L1)
                .map(|(id, _)| *id)
                .collect();
            l1.touch_chain(&leased);
            if leased.is_empty() {
                None
            } else if l1.holds_of(owner).1 >= self.config.max_leases_per_connection {
                Some(None)
            } else {
                Some(Some(l1.lease_for(&leased, now, ttl_us, owner)))
            }
        };
        let lease = match lease {
            None => 0,
            Some(None) => {
                counter!(crate::metric_names::AGENT_LEASES_TOTAL, "result" => "refused")
                    .increment(1);
                0
            }
            Some(Some(lease)) => {
                counter!(crate::metric_names::AGENT_LEASES_TOTAL, "result" => "granted")
                    .increment(1);
                lease
            }
        };
        for t in &tiers {
            counter!(crate::metric_names::AGENT_LOOKUP_BLOCKS_TOTAL, "tier" => t.name())
                .increment(1);
        }
        if tiers.len() < ids.len() {
            counter!(crate::metric_names::AGENT_LOOKUP_BLOCKS_TOTAL, "tier" => "miss")
                .increment((ids.len() - tiers.len()) as u64);
        }
        (Response::Lookup { lease, tiers }, Vec::new())
    }

    async fn get(&self, layout: u64, keys: &[u64]) -> (Response, Vec<Bytes>) {
        if let Some(e) = self.too_many(keys.len()) {
            return e;
        }
        let found = self.find(layout, keys).await;
        let mut blocks = Vec::with_capacity(found.len());
        let mut payloads = Vec::new();
        for f in found {
            // A sealed block goes out over the socket read into memory (a copy).
            let block = f.and_then(|(stored, tier)| match stored.to_block(&self.pool) {
                Ok(b) => Some((b, tier)),
                Err(e) => {
                    tracing::warn!(error = %e, "a sealed L1 block could not be read");
                    None
                }
            });
            match block {
                Some((block, tier)) => {
                    self.count_hit(tier, block.payload.len());
                    blocks.push(Some(GotBlock {
                        bytes: block.payload.len() as u32,
                        checksum: block.checksum,
                        tier,
                    }));
                    payloads.push(block.payload);
                }
                None => {
                    self.count_miss();
                    blocks.push(None);
                }
            }
        }
        (Response::Get { blocks }, payloads)
    }

    /// A get whose blocks L1 holds sealed are answered with their memfds as they are (no
    /// copy here; the engine reads each once); the others (in memory, or read from L2)
    /// follow as payloads, as a get's do. No descriptor is made for an answer: every one
    /// sent is L1's own, so what answers hold open is bounded by what L1 holds.
    async fn get_sealed(
        &self,
        layout: u64,
        keys: &[u64],
    ) -> ((Response, Vec<Bytes>), Vec<Arc<Sealed>>) {
        if let Some(e) = self.too_many(keys.len()) {
            return (e, Vec::new());
        }
        if keys.len() > crate::sealed::MAX_FDS_PER_FRAME {
            return (
                error(
                    ErrorKind::BadRequest,
                    format!(
                        "{} keys in a sealed get; at most {}",
                        keys.len(),
                        crate::sealed::MAX_FDS_PER_FRAME
                    ),
                ),
                Vec::new(),
            );
        }
        let found = self.find(layout, keys).await;
        let mut blocks = Vec::with_capacity(found.len());
        let (mut payloads, mut fds) = (Vec::new(), Vec::new());
        for f in found {
            match f {
                Some((Stored::Sealed(s), tier)) => {
                    self.count_hit(tier, s.len());
                    // Its checksum where known (0 where not: the engine reads sealed
                    // bytes as they were sealed, and does not check them).
                    let got = GotBlock {
                        bytes: s.len() as u32,
                        checksum: s.known_checksum().unwrap_or(0),
                        tier,
                    };
                    blocks.push(Some((got, true)));
                    fds.push(s);
                }
                Some((Stored::Memory(b), tier)) => {
                    self.count_hit(tier, b.payload.len());
                    let got = GotBlock {
                        bytes: b.payload.len() as u32,
                        checksum: b.checksum,
                        tier,
                    };
                    blocks.push(Some((got, false)));
                    payloads.push(b.payload);
                }
                None => {
                    self.count_miss();
                    blocks.push(None);
                }
            }
        }
        ((Response::GetSealed { blocks }, payloads), fds)
    }

    fn count_hit(&self, tier: StoreTier, bytes: usize) {
        let c = match tier {
            StoreTier::L1 => &self.counters.l1_hits,
            StoreTier::L2 => &self.counters.l2_hits,
        };
        c.fetch_add(1, Ordering::Relaxed);
        counter!(crate::metric_names::AGENT_HITS_TOTAL, "tier" => tier.name()).increment(1);
        counter!(crate::metric_names::AGENT_BYTES_TOTAL, "tier" => tier.name(), "direction" => "out")
            .increment(bytes as u64);
    }

    fn count_miss(&self) {
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        counter!(crate::metric_names::AGENT_MISSES_TOTAL).increment(1);
    }

    /// The blocks of `keys` from L1, then what L1 lacks from L2 (promoted into L1 where
    /// `l2_promote_reads`).
    async fn find(&self, layout: u64, keys: &[u64]) -> Vec<Option<(Stored, StoreTier)>> {
        let ids: Vec<BlockId> = keys.iter().map(|&k| BlockId::new(layout, k)).collect();
        let mut found: Vec<Option<(Stored, StoreTier)>> = {
            let mut l1 = self.lock_l1();
            ids.iter()
                .map(|id| l1.get(id).map(|b| (b, StoreTier::L1)))
                .collect()
        };
        if let Some(l2) = &self.l2 {
            let missing: Vec<usize> = (0..ids.len()).filter(|&i| found[i].is_none()).collect();
            let reads = join_all(missing.iter().map(|&i| self.read_l2(l2, ids[i]))).await;
            let promote = self.config.l2_promote_reads;
            let mut promoted = Vec::new();
            for (i, got) in missing.into_iter().zip(reads) {
                if let Some(block) = got {
                    if promote {
                        promoted.push((ids[i], block.clone()));
                    }
                    found[i] = Some((Stored::Memory(block), StoreTier::L2));
                }
            }
            self.promote(&promoted);
        }
        found
    }

    /// Puts blocks read from L2 into L1 (last first, so that a chain's head is evicted
    /// last) and reports them.
    fn promote(&self, promoted: &[(BlockId, Block)]) {
        if promoted.is_empty() {
            return;
        }
        let mut evicted = Vec::new();
        {
            let mut l1 = self.lock_l1();
            for (id, block) in promoted.iter().rev() {
                let _ = l1.put(*id, block.clone(), false, &mut evicted);
            }
        }
        self.report.l1(
            promoted.iter().map(|(id, _)| *id),
            evicted.iter().map(|(id, _)| *id),
        );
        counter!(crate::metric_names::AGENT_EVICTIONS_TOTAL, "tier" => "l1")
            .increment(evicted.len() as u64);
        counter!(crate::metric_names::AGENT_PROMOTIONS_TOTAL).increment(promoted.len() as u64);
        self.queue_l2_evicted(evicted);
    }

    /// Remembers that an engine stores blocks of `layout` (see `layouts`).
    fn saw_layout(&self, layout: u64) {
        let mut layouts = self.layouts.lock().unwrap_or_else(|p| p.into_inner());
        if layouts.first() != Some(&layout) {
            layouts.retain(|&l| l != layout);
            layouts.insert(0, layout);
            layouts.truncate(PREFETCH_LAYOUTS);
        }
    }

    /// A router's prefetch hint (`warmpath_residency::Reply::Prefetch`): a request for
    /// `keys` (a chain, in order) is queued on one of this host's engines, and L2 holds
    /// them. Reads them from L2 into L1 in the background, in chain order and stopping at
    /// the first block L2 lacks (what follows a gap cannot be used), so that the engine's
    /// lookup at admission finds them in host memory. The keys are the routers'; where
    /// they read back to blocks an engine put under its own hashes (record 0124's
    /// mapping), those blocks are read instead ([`Agent::stored_keys`]). Never waits: with
    /// [`PREFETCHES_IN_FLIGHT`] running, or no L2, the hint is dropped. Each block is
    /// counted once by what became of it: `loaded`, `in_l1` (already there), `miss` (not in
    /// L2, after a gap, or a router's key past the ones that read back), `dropped`.
    pub fn prefetch(self: &Arc<Self>, keys: Vec<u64>) {
        let count = |result: &'static str, n: usize| {
            counter!(crate::metric_names::AGENT_PREFETCH_BLOCKS_TOTAL, "result" => result)
                .increment(n as u64);
        };
        let (stored, unread) = self.stored_keys(keys);
        if stored.is_empty() && unread.is_empty() {
            return;
        }
        let layouts = self
            .layouts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (Some(l2), false) = (self.l2.clone(), layouts.is_empty()) else {
            count("dropped", stored.len() + unread.len());
            return;
        };
        let Ok(slot) = self.prefetch_slots.clone().try_acquire_owned() else {
            count("dropped", stored.len() + unread.len());
            return;
        };
        let agent = self.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // The routers' keys that did not read back here: blocks another host's engine
            // stored, named by the aliases its agent wrote (record 0126). Where none of the
            // chain read back and its first key has no alias, the keys are taken as they
            // are (a client that puts the routers' own keys).
            let mut keys = stored;
            let (resolved, missed) = agent.alias_blocks(&l2, &unread).await;
            if keys.is_empty() && resolved.is_empty() {
                keys = unread;
            } else {
                agent.adopt(&resolved);
                keys.extend(resolved.into_iter().flat_map(|(_, blocks)| blocks));
                count("miss", missed);
            }
            if keys.is_empty() {
                return;
            }
            // The layout that holds the chain's first block (one model per engine: the
            // others would be a wasted L2 round trip each).
            let mut chosen = None;
            for &layout in &layouts {
                let first = BlockId::new(layout, keys[0]);
                if agent.lock_l1().contains(&first) {
                    chosen = Some(layout);
                    break;
                }
                if let Ok(found) = agent.timed_l2("contains", l2.contains(&[first])).await {
                    if found.first() == Some(&true) {
                        chosen = Some(layout);
                        break;
                    }
                }
            }
            let Some(layout) = chosen else {
                count("miss", keys.len());
                return;
            };
            let mut accounted = 0;
            let ids: Vec<BlockId> = keys.iter().map(|&k| BlockId::new(layout, k)).collect();
            for chunk in ids.chunks(PREFETCH_READS) {
                let in_l1: Vec<bool> = {
                    let l1 = agent.lock_l1();
                    chunk.iter().map(|id| l1.contains(id)).collect()
                };
                let reads = join_all(
                    chunk
                        .iter()
                        .zip(&in_l1)
                        .filter(|(_, &there)| !there)
                        .map(|(id, _)| agent.read_l2(&l2, *id)),
                )
                .await;
                let mut reads = reads.into_iter();
                let (mut promoted, mut already) = (Vec::new(), 0);
                let mut gap = false;
                for (id, &there) in chunk.iter().zip(&in_l1) {
                    if there {
                        already += 1;
                    } else if let Some(block) = reads.next().flatten() {
                        promoted.push((*id, block));
                    } else {
                        gap = true;
                        break;
                    }
                }
                count("in_l1", already);
                count("loaded", promoted.len());
                agent.promote(&promoted);
                accounted += already + promoted.len();
                if gap {
                    break;
                }
            }
            count("miss", ids.len() - accounted);
        });
    }

    /// The keys the blocks of a router's chain `keys` are stored under, as far as this
    /// agent knows them, and the router's keys past those (the chain's end): where the agent
    /// follows KV events and the chain's first key reads back to blocks an engine put under
    /// the hashes its events gave them ([`Ingest::engine_blocks`]), those blocks' keys, up
    /// to the first key that does not, and the rest; where none reads back, nothing and
    /// every key (another host's blocks, or a client that puts the routers' own keys:
    /// [`Agent::prefetch`] tells which); without KV events, `keys` as they are.
    fn stored_keys(&self, keys: Vec<u64>) -> (Vec<u64>, Vec<u64>) {
        let Some(ingest) = &self.report.ingest else {
            return (keys, Vec::new());
        };
        let stored = ingest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .engine_block_keys(&keys);
        match stored {
            Some((stored, read)) if read > 0 => (stored, keys[read..].to_vec()),
            Some(_) => (Vec::new(), keys),
            None => (keys, Vec::new()),
        }
    }

    /// Follows the blocks of aliases read for a hint (`(key, blocks)`, in chain order) as
    /// the keys they hold ([`Ingest::adopt`]), so that the blocks the prefetch loads are
    /// reported under the routers' keys.
    fn adopt(&self, resolved: &[(u64, Vec<u64>)]) {
        let Some(ingest) = &self.report.ingest else {
            return;
        };
        let mut ingest = ingest.lock().unwrap_or_else(|p| p.into_inner());
        let mut before = None;
        for (key, blocks) in resolved {
            let Some((last, fragments)) = blocks.split_last() else {
                continue;
            };
            // The blocks before the one that completed the key complete none.
            for &f in fragments {
                ingest.adopt(&EngineHash::of_u64(f), None, &[]);
            }
            let key = warmpath_index::keys::BlockKey(*key);
            ingest.adopt(&EngineHash::of_u64(*last), before, &[key]);
            before = Some(key);
        }
    }

    /// The blocks the aliases of the routers' keys `keys` name (record 0126), each key's in
    /// chain order, up to the first key without a valid alias in L2, and how many keys that
    /// left.
    /// An alias naming more blocks than one key can take (the block that completed it and
    /// [`crate::ingest::MAX_FRAGMENTS`] before it) is no valid one, and the whole stays
    /// within [`warmpath_residency::MAX_PREFETCH_KEYS`] blocks, so that what L2 holds cannot
    /// make a hint's reads unbounded.
    async fn alias_blocks(&self, l2: &AnyL2, keys: &[u64]) -> (Vec<(u64, Vec<u64>)>, usize) {
        let count = |result: &'static str, n: usize| {
            counter!(crate::metric_names::AGENT_ALIASES_TOTAL, "result" => result)
                .increment(n as u64);
        };
        let mut blocks = Vec::new();
        let (mut resolved, mut named_blocks) = (0, 0);
        for chunk in keys.chunks(PREFETCH_READS) {
            let reads = join_all(chunk.iter().map(|&key| async move {
                let block = self.read_l2(l2, BlockId::new(ALIAS_LAYOUT, key)).await?;
                match Alias::decode(&block.payload)? {
                    Alias::V1 { blocks } if blocks.len() <= crate::ingest::MAX_FRAGMENTS + 1 => {
                        Some(blocks)
                    }
                    Alias::V1 { .. } => None,
                }
            }))
            .await;
            for (&key, read) in chunk.iter().zip(reads) {
                let room = warmpath_residency::MAX_PREFETCH_KEYS.saturating_sub(named_blocks);
                let Some(named) = read.filter(|named| named.len() <= room) else {
                    count("read", resolved);
                    count("missing", 1);
                    return (blocks, keys.len() - resolved);
                };
                named_blocks += named.len();
                blocks.push((key, named));
                resolved += 1;
            }
        }
        count("read", resolved);
        (blocks, 0)
    }

    /// One block from L2, checked; damage and errors are counted misses.
    async fn read_l2(&self, l2: &AnyL2, id: BlockId) -> Option<Block> {
        let Some(raw) = self.timed_l2("get", l2.get(id)).await.ok()? else {
            self.report.l2_gone(id);
            return None;
        };
        let len = raw.len() as u64;
        match decode_with(&id, raw, self.config.l2_key.as_ref()) {
            Ok((block, _writer)) => {
                counter!(crate::metric_names::AGENT_BYTES_TOTAL, "tier" => "l2", "direction" => "in")
                    .increment(len);
                // Written by another host, perhaps: this agent has now seen it there.
                self.report.l2_stored(id, &[]);
                Some(block)
            }
            Err(damage) => {
                self.counters.l2_damaged.fetch_add(1, Ordering::Relaxed);
                let kind = match damage {
                    crate::block::Damage::NotABlock => "not_a_block",
                    crate::block::Damage::Foreign(_) => "foreign",
                    crate::block::Damage::Truncated { .. } => "truncated",
                    crate::block::Damage::Checksum => "checksum",
                    crate::block::Damage::Unsealed => "unsealed",
                };
                counter!(crate::metric_names::AGENT_L2_DAMAGED_TOTAL, "kind" => kind).increment(1);
                tracing::warn!(layout = id.layout, key = id.key.0, %damage, "l2 block damaged; dropped");
                let _ = l2.remove(id).await;
                self.report.l2_gone(id);
                None
            }
        }
    }

    async fn timed_l2<T>(
        &self,
        op: &'static str,
        f: impl std::future::Future<Output = Result<T, L2Error>>,
    ) -> Result<T, L2Error> {
        let started = Instant::now();
        let r = f.await;
        histogram!(crate::metric_names::AGENT_L2_OP_DURATION_SECONDS, "op" => op)
            .record(started.elapsed().as_secs_f64());
        if let Err(e) = &r {
            self.counters.l2_errors.fetch_add(1, Ordering::Relaxed);
            counter!(crate::metric_names::AGENT_L2_ERRORS_TOTAL, "op" => op).increment(1);
            tracing::debug!(op, error = %e, "l2 operation failed");
        }
        r
    }

    /// Lease 0 (none was taken) releases nothing; another connection's lease is unknown
    /// to this one.
    fn release(&self, owner: Owner, lease: u64) -> (Response, Vec<Bytes>) {
        if lease == 0 {
            return (Response::Released { blocks: 0 }, Vec::new());
        }
        let released = {
            let mut l1 = self.lock_l1();
            match l1.lease_owner(lease) {
                Some(o) if o == owner => l1.release(lease),
                _ => None,
            }
        };
        match released {
            Some(n) => {
                counter!(crate::metric_names::AGENT_LEASES_TOTAL, "result" => "released")
                    .increment(1);
                (Response::Released { blocks: n as u32 }, Vec::new())
            }
            None => error(
                ErrorKind::BadRequest,
                format!("lease {lease} is unknown (released or expired)"),
            ),
        }
    }

    /// Unpins this connection's pins among `keys`; another's stay.
    fn unpin(&self, owner: Owner, layout: u64, keys: &[u64]) -> (Response, Vec<Bytes>) {
        if let Some(e) = self.too_many(keys.len()) {
            return e;
        }
        let mut l1 = self.lock_l1();
        let n = keys
            .iter()
            .filter(|&&k| l1.unpin_for(&BlockId::new(layout, k), owner))
            .count();
        (Response::Unpinned { blocks: n as u32 }, Vec::new())
    }

    pub fn stats(&self) -> AgentStats {
        let kv = self
            .ingest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stats
            .clone();
        AgentStats {
            residency_blocks: self
                .report
                .residency
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len() as u64,
            kv_batches: kv.batches,
            kv_gaps: kv.gaps,
            kv_malformed: kv.malformed,
            kv_unresolved: kv.unresolved,
            l1: self.lock_l1().stats(),
            l1_hits: self.counters.l1_hits.load(Ordering::Relaxed),
            l2_hits: self.counters.l2_hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            l2_errors: self.counters.l2_errors.load(Ordering::Relaxed),
            l2_damaged: self.counters.l2_damaged.load(Ordering::Relaxed),
        }
    }

    fn publish_l1(&self) {
        let (s, sealed) = {
            let l1 = self.lock_l1();
            (l1.stats(), l1.sealed_blocks())
        };
        gauge!(crate::metric_names::AGENT_SEALED_BLOCKS).set(sealed as f64);
        gauge!(crate::metric_names::AGENT_OCCUPANCY_BYTES, "tier" => "l1").set(s.bytes as f64);
        gauge!(crate::metric_names::AGENT_BLOCKS, "tier" => "l1").set(s.blocks as f64);
        gauge!(crate::metric_names::AGENT_LEASES).set(s.leases as f64);
        gauge!(crate::metric_names::AGENT_LEASED_BLOCKS).set(s.leased_blocks as f64);
        gauge!(crate::metric_names::AGENT_PINNED_BLOCKS).set(s.pinned_blocks as f64);
        if let Some(AnyL2::Dir(d)) = self.l2.as_deref() {
            gauge!(crate::metric_names::AGENT_OCCUPANCY_BYTES, "tier" => "l2")
                .set(d.used_bytes() as f64);
        }
    }

    /// An object of the HyperPod segment was stored, evicted to L2 or evicted: the pool
    /// blocks its chunk's KV events keyed are reported (or withdrawn) in L1 or L2, now or
    /// when the event arrives (`Ingest::object_held`). A name without a chunk hash (not a
    /// `CacheEngineKey`) is stored and served, not reported.
    pub fn hyperpod_object(&self, name: &ObjectName, event: ObjectEvent) {
        let Some(hash) = name.chunk_hash() else {
            tracing::debug!(%name, "hyperpod object without a chunk hash: not reported");
            return;
        };
        let changes = {
            let mut ingest = self.ingest.lock().unwrap_or_else(|p| p.into_inner());
            match event {
                ObjectEvent::Stored => ingest.object_held(&hash, ObjectTier::L1),
                ObjectEvent::Spilled => ingest.object_held(&hash, ObjectTier::L2),
                ObjectEvent::Evicted => ingest.object_gone(&hash, ObjectTier::L1),
            }
        };
        self.report.record(changes);
    }
}

/// Idle payload buffers the agent keeps for reuse: an eighth of L1, at most 1 GiB. In a
/// full L1 each put evicts about what it stores, so a few blocks' worth is what is used.
fn pool_bytes(l1_bytes: u64) -> u64 {
    (l1_bytes / 8).min(1 << 30)
}

/// An epoch no earlier start of this agent used: the start time in nanoseconds, mixed with
/// the process id (two starts within a clock tick are different processes).
fn new_epoch() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 48)
}

/// Sealed memfds L1 may hold: half of the open-file limit left after 4,096 for
/// connections, L2 and the rest and the block API's unsettled descriptors
/// ([`crate::sealed::MAX_UNSETTLED_FDS`]), the soft limit first raised to the hard one (a
/// memfd is an open descriptor for as long as L1 holds the block).
fn sealed_fd_budget() -> usize {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    // No limit reads as None; the kernel caps descriptors at 2^20 by default anyway.
    const CAP: u64 = 1 << 20;
    let limit = getrlimit(Resource::Nofile);
    let (current, maximum) = (limit.current.unwrap_or(CAP), limit.maximum.unwrap_or(CAP));
    let raised = Rlimit {
        current: Some(maximum.min(CAP)),
        maximum: limit.maximum,
    };
    let n = if current < maximum && setrlimit(Resource::Nofile, raised).is_ok() {
        maximum.min(CAP)
    } else {
        current.min(CAP)
    };
    (n as usize).saturating_sub(4096 + crate::sealed::MAX_UNSETTLED_FDS) / 2
}

fn error(kind: ErrorKind, message: String) -> (Response, Vec<Bytes>) {
    (Response::Error { kind, message }, Vec::new())
}

fn error_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Malformed => "malformed",
        ErrorKind::BadRequest => "bad_request",
        ErrorKind::Internal => "internal",
    }
}

/// Writes queued blocks to L2, a few at a time; failures are counted, never retried (the
/// block may still be in L1, and a later eviction writes it again).
/// This agent's identity in the L2 objects it seals: its host name and block API address,
/// hashed (who wrote a block, for an operator chasing a bad one; the MAC says it was a
/// holder of the cluster key).
/// The cluster key and this agent's writer id, when `[l2] key_file` is configured.
fn seal_of(config: &AgentConfig) -> Option<(crate::block::SealKey, u64)> {
    config.l2_key.clone().map(|k| (k, writer_id(config)))
}

fn writer_id(config: &AgentConfig) -> u64 {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let h = blake3::hash(format!("{}\0{}", host.trim(), config.listen).as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8]))
}

/// Writes the aliases the ingest has due (record 0126) to L2, a round every
/// [`ALIAS_ROUND`], until the agent is gone. An alias is a hint for other hosts' agents: one
/// that fails is counted and not retried.
async fn write_aliases(
    l2: Arc<AnyL2>,
    ingest: std::sync::Weak<Mutex<Ingest>>,
    seal: Option<(crate::block::SealKey, u64)>,
    report: Arc<Report>,
) {
    let count = |result: &'static str, n: usize| {
        counter!(crate::metric_names::AGENT_ALIASES_TOTAL, "result" => result).increment(n as u64);
    };
    let mut tick = tokio::time::interval(ALIAS_ROUND);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(ingest) = ingest.upgrade() else {
            return;
        };
        let due = ingest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_aliases(ALIASES_PER_ROUND);
        drop(ingest);
        for chunk in due.chunks(PREFETCH_READS) {
            let writes = join_all(chunk.iter().map(|(key, blocks)| {
                let id = BlockId::new(ALIAS_LAYOUT, *key);
                let alias = Alias::V1 {
                    blocks: blocks.clone(),
                };
                let block = Block::new(alias.encode());
                let (l2, seal, report) = (&l2, &seal, &report);
                async move {
                    let evicted = l2.put_block_sealed(id, &block, seal.as_ref()).await?;
                    // A directory L2 may have made room for it.
                    report.l2_stored(id, &evicted);
                    Ok::<_, L2Error>(())
                }
            }))
            .await;
            let failed = writes.iter().filter(|w| w.is_err()).count();
            count("written", writes.len() - failed);
            count("failed", failed);
        }
    }
}

async fn write_l2(
    l2: Arc<AnyL2>,
    mut rx: mpsc::Receiver<(BlockId, Stored)>,
    counters: Arc<Counters>,
    report: Arc<Report>,
    seal: Option<(crate::block::SealKey, u64)>,
    pool: BufPool,
) {
    const CONCURRENT: usize = 8;
    let mut in_flight = tokio::task::JoinSet::new();
    // The same block queued twice while a write is in flight is written once.
    let mut pending: HashMap<BlockId, ()> = HashMap::new();
    while let Some((id, stored)) = rx.recv().await {
        while in_flight.len() >= CONCURRENT {
            if let Some(Ok(done)) = in_flight.join_next().await {
                pending.remove(&done);
            }
        }
        while let Some(Ok(done)) = in_flight.try_join_next() {
            pending.remove(&done);
        }
        if pending.insert(id, ()).is_some() {
            continue;
        }
        let (l2, counters, report) = (l2.clone(), counters.clone(), report.clone());
        let (seal, pool) = (seal.clone(), pool.clone());
        in_flight.spawn(async move {
            let started = Instant::now();
            let len = stored.len() as u64;
            // A sealed block is read into memory for the write (a copy).
            let block = match stored.to_block(&pool) {
                Ok(b) => b,
                Err(e) => {
                    counters.l2_errors.fetch_add(1, Ordering::Relaxed);
                    counter!(crate::metric_names::AGENT_L2_ERRORS_TOTAL, "op" => "put").increment(1);
                    tracing::debug!(error = %e, "a sealed block could not be read for l2");
                    return id;
                }
            };
            match l2.put_block_sealed(id, &block, seal.as_ref()).await {
                Ok(evicted) => {
                    report.l2_stored(id, &evicted);
                    counter!(crate::metric_names::AGENT_BYTES_TOTAL, "tier" => "l2", "direction" => "out")
                        .increment(len);
                }
                Err(e) => {
                    counters.l2_errors.fetch_add(1, Ordering::Relaxed);
                    counter!(crate::metric_names::AGENT_L2_ERRORS_TOTAL, "op" => "put").increment(1);
                    tracing::debug!(error = %e, "l2 write failed");
                }
            }
            histogram!(crate::metric_names::AGENT_L2_OP_DURATION_SECONDS, "op" => "put")
                .record(started.elapsed().as_secs_f64());
            id
        });
    }
}

/// Declares every agent metric once.
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        crate::metric_names::AGENT_HITS_TOTAL,
        "Blocks served by a get, by tier."
    );
    describe_counter!(
        crate::metric_names::AGENT_MISSES_TOTAL,
        "Blocks a get found in no tier."
    );
    describe_counter!(
        crate::metric_names::AGENT_LOOKUP_BLOCKS_TOTAL,
        "Blocks of looked-up chains, by the tier that holds them (miss: none, or after a gap)."
    );
    describe_counter!(
        crate::metric_names::AGENT_BYTES_TOTAL,
        Unit::Bytes,
        "Payload bytes into and out of each tier."
    );
    describe_counter!(
        crate::metric_names::AGENT_EVICTIONS_TOTAL,
        "Blocks evicted, by tier."
    );
    describe_counter!(
        crate::metric_names::AGENT_PREFETCH_BLOCKS_TOTAL,
        "Blocks of routers' prefetch hints, by what became of them: loaded (read from L2 into L1), in_l1 (already there), miss (not in L2, past a block it lacks, or a router's key past those that read back to an engine's blocks), dropped (no L2, or the agent was already running its most prefetches)."
    );
    describe_counter!(
        crate::metric_names::AGENT_ALIASES_TOTAL,
        "L2 aliases (record 0126: a pool key to the blocks an engine stored its tokens in, for other hosts' prefetches), by what became of them: written and failed (this agent's, as L2 came to hold its engines' blocks), read and missing (looked up for a prefetch hint's keys that did not read back here; a lookup stops at the first missing)."
    );
    describe_counter!(
        crate::metric_names::AGENT_PROMOTIONS_TOTAL,
        "Blocks read from L2 and put into L1: prefetch hints' loads, and engines' reads where --l2-promote-reads."
    );
    describe_counter!(
        crate::metric_names::AGENT_PUT_REFUSED_TOTAL,
        "Blocks of puts not stored, by reason (conflict: the key is held with other bytes)."
    );
    describe_counter!(
        crate::metric_names::AGENT_PINS_ENDED_TOTAL,
        "Pins ended because the block API connection that took them closed."
    );
    describe_counter!(
        crate::metric_names::AGENT_HANDSHAKES_DISPLACED_TOTAL,
        "Connections closed before they proved themselves (the block API's handshake, a first HTTP request, a first lm:// header) to make room for a newer one, by api (block, hyperpod, lm) and scope (source or all)."
    );
    describe_counter!(
        crate::metric_names::AGENT_FRAMES_REFUSED_TOTAL,
        "Frames refused from their length, over a connection's in-flight budget."
    );
    describe_counter!(
        crate::metric_names::AGENT_L2_ERRORS_TOTAL,
        "Failed L2 operations, by operation."
    );
    describe_counter!(
        crate::metric_names::AGENT_L2_DAMAGED_TOTAL,
        "L2 objects read back damaged (never served), by kind."
    );
    describe_counter!(
        crate::metric_names::AGENT_L2_WRITE_DROPPED_TOTAL,
        "Background L2 writes dropped because the queue was full."
    );
    describe_counter!(
        crate::metric_names::AGENT_LEASES_TOTAL,
        "Leases granted, released and expired."
    );
    describe_counter!(
        crate::metric_names::AGENT_REQUEST_ERRORS_TOTAL,
        "Requests answered with an error."
    );
    describe_gauge!(
        crate::metric_names::AGENT_OCCUPANCY_BYTES,
        Unit::Bytes,
        "Bytes held, by tier."
    );
    describe_gauge!(
        crate::metric_names::AGENT_CAPACITY_BYTES,
        Unit::Bytes,
        "Byte bound, by tier."
    );
    describe_gauge!(crate::metric_names::AGENT_BLOCKS, "Blocks held, by tier.");
    describe_gauge!(crate::metric_names::AGENT_LEASES, "Open leases.");
    describe_gauge!(
        crate::metric_names::AGENT_LEASED_BLOCKS,
        "L1 blocks held by a lease."
    );
    describe_gauge!(
        crate::metric_names::AGENT_PINNED_BLOCKS,
        "L1 blocks pinned."
    );
    describe_gauge!(
        crate::metric_names::AGENT_SEALED_BLOCKS,
        "L1 blocks held as sealed memfds an engine passed on the Unix socket (each an open descriptor)."
    );
    describe_gauge!(
        crate::metric_names::AGENT_LEARNED_TENANTS,
        "Tenants in the routers' table held: the newest configuration version's (cache salt to tenant)."
    );
    describe_gauge!(
        crate::metric_names::AGENT_LEARNED_TENANTS_VERSION,
        "Configuration version of the routers' tenant table held."
    );
    describe_counter!(
        crate::metric_names::AGENT_TENANT_TABLES_REFUSED_TOTAL,
        "Tenant tables from routers not taken, by reason (stale: older than the one held; too_large)."
    );
    describe_histogram!(
        crate::metric_names::AGENT_OP_DURATION_SECONDS,
        Unit::Seconds,
        "Block API request handling time, by operation."
    );
    describe_histogram!(
        crate::metric_names::AGENT_L2_OP_DURATION_SECONDS,
        Unit::Seconds,
        "L2 operation time, by operation."
    );
}
