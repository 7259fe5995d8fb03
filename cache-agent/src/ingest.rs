//! From engine KV events to residency changes: the agent recomputes warmpath block keys
//! from the events' token ids (engine hashes are never keys) and keeps, per engine, what
//! each engine hash stands for, which removals and later blocks need. Pure: batches in,
//! changes out.
//!
//! **Re-cut into the pool's blocks.** Routers key a prompt in blocks of the pool's size
//! (`PoolSpec::block_tokens`, the engines' GPU block size), but engines publish blocks of
//! other sizes too: vLLM's CPU offloading in its own chunk size (48 tokens over 16-token
//! GPU blocks in vLLM's tests), LMCache in 256-token chunks with a shorter last one. So an
//! event block is not one key: its tokens, after the tokens its parent left over, are cut
//! into whole pool blocks, each keyed after the one before; what is left over (less than a
//! pool block) waits for the next block of the chain. A block of `n` tokens thus *covers*
//! the pool blocks it completes: a 256-token chunk covers 16 blocks of 16 tokens, a last
//! chunk of 100 tokens covers 6 and leaves 4 over. The pool's block size is the one set
//! with [`Ingest::set_block_tokens`], else the engine's GPU block size (its first whole GPU
//! store); a block of another medium that arrives before either is known is not reported
//! (counted `no_block_size`), nor are its children.
//!
//! **What an engine hash stands for.** Each event block the engine announced is a
//! [`Node`]: its chain's tenant, the key of the last whole pool block up to its end, the
//! tokens left over after that key, and the pool blocks it covers. A block names its parent
//! by engine hash (a vLLM block hash, an LMCache chunk hash: any medium's), and is keyed
//! from the parent's node. Nodes stay while any medium holds the block, and
//! [`GHOSTS`] removed ones more per engine (a parent evicted just before its child is
//! stored still keys the child). A block whose parent the agent does not know (never
//! seen, forgotten, or before a gap) is not reported, nor are the rest of its event's
//! blocks (counted `orphans`): routers predict for it instead. At most [`MAX_BLOCKS`]
//! nodes per engine; past that new blocks are not reported (counted `capped`).
//!
//! **Removals.** A pool block is reported present in a scope while at least one held event
//! block covers it there (a count per scope and key: a pool block under two engines' CPU
//! chunks is one L1 block), and absent when the last goes. So a `BlockRemoved` of a chunk
//! removes the pool blocks it alone covered. A pool block that straddles two event blocks
//! belongs to the one that completed it. A hash the CPU tier announces twice (vLLM's
//! offloading re-announces a block shared by two chunks, once per chunk) needs two
//! removals; the GPU's re-announcements (of reused blocks, with no removal to match) do
//! not count.
//!
//! **Whose block is it.** A warmpath key is keyed by the tenant (`TenantKey(tenant,
//! cache_salt)`), so the agent must know each stored chain's tenant. vLLM hashes a request's
//! `cache_salt` into its first block and publishes it in that block's `extra_keys`; later
//! blocks name their parent. So: a block with a parent takes its parent's tenant; a first
//! block takes the tenant its salt resolves to ([`Tenants`]). The salt is the last string
//! of the first block's extra keys that is not the LoRA name (vLLM puts the LoRA name
//! first, then multimodal hashes, then the salt). A first block of another medium than the
//! GPU without extra keys (LMCache's chunks, vLLM 0.33's CPU offload) takes the tenant of
//! the GPU chain on the same engine whose first pool block has the same tokens and is held
//! now (none when several tenants' chains do: the agent does not guess). A chain
//! whose tenant cannot be resolved is not reported (counted `unresolved`): a router then
//! predicts instead, which costs hits and never shares them across tenants.
//!
//! **LoRA.** Engines cache per adapter, so a block stored under an adapter (`lora_name`) is
//! keyed with the tenant's key for that adapter ([`TenantKey::for_adapter`]): the keys a
//! router computes for a request whose `model` names the adapter. A block with a
//! `lora_id` and no name cannot be keyed (routers name adapters) and is skipped.
//!
//! **What is not mapped.** Media other than `GPU` (GPU-resident) and `CPU`/`cpu` (an
//! engine's own CPU offload or LMCache's CPU tier, reported as the host's L1), and blocks
//! without tokens, are skipped and counted. Of those, vLLM 0.11's `OffloadingConnector`
//! announces a CPU chunk by the hash of its last GPU block with the chunk's size: where
//! the agent knows that GPU block and the ones before it back to the chunk's start, the
//! chunk covers their pool blocks in L1. vLLM 0.33's placeholders (block size 0) name no
//! size and stay skipped.
//!
//! **Objects of the host's store.** LMCache stores its chunks in the agent's HyperPod
//! segment (`hyperpod/`) under names that carry the chunk hash its KV events carry, so an
//! object is mapped through the tokens of the event block of that hash: while the
//! segment holds it, the pool blocks that block covers are held in L1 (in L2 once it was
//! evicted there), counted with the events' own coverage, so that LMCache dropping its
//! CPU copy does not withdraw what the segment still holds ([`Ingest::object_held`],
//! [`Ingest::object_gone`]). An object stored before its event arrives waits, unmapped
//! (counted, [`Ingest::objects`]), and is reported when the event's block is keyed; when
//! the engine's view is dropped (a gap, a clear, a new tenant table), its objects wait
//! again for the rebuilt view, so that no key of the old view stays reported. At most
//! [`MAX_OBJECTS`] objects are followed (more are counted `objects_capped`).
//!
//! **From routers' keys back to the engine's blocks.** A router's prefetch hint names its
//! own keys; a block-API engine's blocks sit in L2 under the hashes its events gave them.
//! [`Ingest::engine_blocks`] reads a hinted chain back through the mapped objects (each
//! pool key to the object whose event block completed it, with the event blocks before it
//! that completed none, as when an engine's blocks are smaller than the pool's), so the
//! agent can read what the engine stored. For other hosts, whose agents never see these
//! events, each pool key L2 comes to hold is queued for an alias in L2 naming those blocks
//! ([`Ingest::take_aliases`], record 0126); blocks read through another host's alias are
//! followed as the keys it names ([`Ingest::adopt`]).
//!
//! **Gaps.** A batch whose sequence number is not the previous one plus one means events
//! were lost. The subscriber first asks the engine's replay socket for the missing
//! batches (`kv_subscribe.rs`) and applies them in order; when it cannot (no replay
//! socket, or the batches are gone from the engine's buffer), this agent's view of that
//! engine may be wrong, so all of it is dropped (routers fall back to predictions for it)
//! and rebuilt from what follows.

use std::collections::{HashMap, VecDeque};

use warmpath_index::keys::{BlockKey, TenantKey};

use crate::kv_events::{Decoded, EngineHash, KvEvent};
use warmpath_residency::{Change, Scope};

/// Event blocks one engine's view keeps at most (held, and removed ones kept as
/// [`GHOSTS`]); a node costs about 200 bytes with its map entry, plus 8 per pool block it
/// covers. An engine's GPU holds some 10⁴ to 10⁵ blocks, and a host's CPU tier of a few
/// hundred GB some 10⁵ more: the bound leaves room and caps a misbehaving publisher at
/// about 200 MB.
pub const MAX_BLOCKS: usize = 1 << 20;

/// Tenant keys in use (one per tenant and adapter whose chains the engines report) at
/// most: a chain that would need another is not reported (counted `capped`). Each costs
/// 32 bytes and a scan at each chain's start; engines can name any number of salts.
pub const MAX_SLOTS: usize = 1 << 12;

/// Why a router's tenant table was not taken ([`Ingest::learn_tenants_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableRefused {
    /// Of an older configuration version than the table held.
    Stale,
    /// More than [`warmpath_residency::MAX_TENANT_ENTRIES`] entries.
    TooLarge,
}

impl TableRefused {
    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            TableRefused::Stale => "stale",
            TableRefused::TooLarge => "too_large",
        }
    }
}

/// Objects of the host's store followed at most (mapped or waiting for their event); each
/// costs about 100 bytes plus 8 per pool block it covers.
pub const MAX_OBJECTS: usize = 1 << 20;

/// Where the host's store holds an object ([`Ingest::object_held`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectTier {
    /// In the HyperPod segment: the host's L1.
    L1,
    /// Evicted from the segment to the agent's L2.
    L2,
}

impl ObjectTier {
    fn scope(self) -> Scope {
        match self {
            ObjectTier::L1 => Scope::L1,
            ObjectTier::L2 => Scope::L2,
        }
    }
}

/// An object of the host's store, by chunk hash.
#[derive(Debug, Default)]
struct Object {
    l1: bool,
    l2: bool,
    /// The engine whose event block keyed it, the key before its first pool block and the
    /// pool blocks it covers (None: waiting for the event).
    mapped: Option<(usize, Option<BlockKey>, Box<[BlockKey]>)>,
}

/// Event blocks that complete no pool block read back before one that does
/// ([`Ingest::engine_blocks`]): a pool block of up to this many of the engine's blocks.
pub const MAX_FRAGMENTS: usize = 256;

/// The engine of an object adopted from another host's alias ([`Ingest::adopt`]): none of
/// this host's.
const ADOPTED: usize = usize::MAX;

/// Pool keys whose aliases wait for the agent's writer at most ([`Ingest::take_aliases`]);
/// past it the oldest are dropped (counted): an alias is a hint for other hosts.
pub const MAX_ALIASES_DUE: usize = 1 << 16;

/// Removed event blocks kept per engine for their chain ends (their children may follow).
pub const GHOSTS: usize = 1 << 16;

/// How a first block's salt names a tenant: the agent's own table (`--kv-tenant`) and
/// what the routers send ([`Ingest::learn_tenants`]: the configuration's tenants and
/// salts, over the residency link). Once routers have sent a table, a [`Tenants::Fixed`]
/// agent resolves by that table instead: its fixed tenant is for an engine served
/// without routers.
#[derive(Clone, Debug)]
pub enum Tenants {
    /// Every chain belongs to this tenant, keyed with the block's salt (engine-sim's
    /// convention, and a single-tenant fleet's).
    Fixed(String),
    /// Salt → tenant id; an unknown salt is unresolved.
    Table(HashMap<String, String>),
}

impl Tenants {
    fn resolve(&self, candidates: &[&str]) -> Option<TenantKey> {
        match self {
            Tenants::Fixed(id) => Some(TenantKey::derive(
                id,
                candidates.last().copied().unwrap_or(""),
            )),
            Tenants::Table(t) => candidates
                .iter()
                .rev()
                .find_map(|s| t.get(*s).map(|id| TenantKey::derive(id, s))),
        }
    }
}

/// Counters, for metrics. Block counts are of event blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    pub batches: u64,
    pub events: u64,
    pub gaps: u64,
    pub unknown: u64,
    pub unresolved: u64,
    pub orphans: u64,
    /// Blocks of unmapped media, placeholders, and LoRA blocks without a name.
    pub skipped: u64,
    pub malformed: u64,
    /// Blocks not reported because the pool's block size was not known yet.
    pub no_block_size: u64,
    /// Blocks not reported because the engine's view was full ([`MAX_BLOCKS`]), or their
    /// chain would have needed a tenant key past [`MAX_SLOTS`].
    pub capped: u64,
    /// Objects of the host's store not followed because [`MAX_OBJECTS`] were.
    pub objects_capped: u64,
    /// Aliases not written to L2 because [`MAX_ALIASES_DUE`] were waiting.
    pub aliases_dropped: u64,
    /// CPU chunks announced with parent 0 (LMCache's store of chunks after a prefix it
    /// already held) whose chain was found by their tokens on the engine's GPU chain.
    pub parents_by_tokens: u64,
}

/// One event block an engine announced.
#[derive(Debug)]
struct Node {
    /// Tenant (and adapter) slot of its chain.
    slot: u32,
    /// The block before it in its chain, and its own token count: a tokenless chunk
    /// announced by its last block's hash walks back through them.
    parent: Option<EngineHash>,
    len: u32,
    /// The key before the first pool block it covers (its first change's parent).
    before: Option<BlockKey>,
    /// The key of the last whole pool block up to its end (None: none yet).
    key: Option<BlockKey>,
    /// The tokens after `key` up to its end: fewer than a pool block.
    tail: Box<[u32]>,
    /// The pool blocks it completed, in order.
    covers: Box<[BlockKey]>,
    /// Whether the engine's GPU holds it; how many times its CPU tier (the host's L1)
    /// announced it and did not remove it yet: vLLM's offloading re-announces a block
    /// shared by two chunks once per chunk and asks consumers to count. The GPU's
    /// announcements are not counted: vLLM announces a reused GPU block again, without a
    /// removal to match.
    gpu: bool,
    l1: u16,
}

impl Node {
    fn held(&self) -> bool {
        self.gpu || self.l1 > 0
    }

    fn holds(&self, scope: Scope) -> bool {
        match scope {
            Scope::L1 => self.l1 > 0,
            _ => self.gpu,
        }
    }

    /// One more announcement in `scope`; whether it was not held there before.
    fn announce(&mut self, scope: Scope) -> bool {
        match scope {
            Scope::L1 => {
                self.l1 = self.l1.saturating_add(1);
                self.l1 == 1
            }
            _ => !std::mem::replace(&mut self.gpu, true),
        }
    }

    /// One removal in `scope`; whether that was the last one holding it there.
    fn retract(&mut self, scope: Scope) -> bool {
        match scope {
            Scope::L1 => {
                let was = self.l1;
                self.l1 = was.saturating_sub(1);
                was == 1
            }
            _ => std::mem::replace(&mut self.gpu, false),
        }
    }
}

/// Where a chain stands after a block: its slot, last whole key and leftover tokens.
type ChainEnd = (u32, Option<BlockKey>, Vec<u32>);

#[derive(Debug, Default)]
struct EngineView {
    /// Event blocks by engine hash: held ones, and removed ones listed in `ghosts`.
    blocks: HashMap<EngineHash, Node>,
    /// Chunks of the engine's CPU tier announced without tokens under the hash of their
    /// last GPU block (vLLM 0.11's `OffloadingConnector`): the pool blocks each covers in
    /// L1.
    offloaded: HashMap<EngineHash, Box<[BlockKey]>>,
    /// Removed blocks, oldest first (a hash stored again stays listed; it is kept while
    /// held when its turn comes).
    ghosts: VecDeque<EngineHash>,
    /// The engine's GPU block size, from its first whole GPU store.
    gpu_block_tokens: Option<u32>,
    last_seq: Option<u64>,
}

/// The agent's view of its engines' caches.
#[derive(Debug)]
pub struct Ingest {
    tenants: Tenants,
    /// Salt → tenant id, from the routers; consulted after `tenants`' own table.
    learned: HashMap<String, String>,
    /// Whether a router ever sent a non-empty table.
    learned_any: bool,
    /// The configuration version of `learned` (None: no router sent one yet).
    learned_version: Option<u64>,
    /// Tenant keys in use (with the adapter each is for), by slot: nodes hold a slot, not
    /// a 32-byte key each.
    keys: Vec<(TenantKey, Option<Box<str>>)>,
    engines: Vec<EngineView>,
    /// How many held event blocks cover each reported (scope, key).
    covered: HashMap<(Scope, u64), u32>,
    /// The pool's block size, when set; else each engine's GPU block size.
    block_tokens: Option<u32>,
    /// Objects the host's store holds, by the chunk hash their names carry.
    objects: HashMap<EngineHash, Object>,
    /// Each pool key a mapped object covers, to that object's hash (the last one mapped,
    /// where several cover it): the way back from a router's key ([`Ingest::engine_blocks`]).
    by_key: HashMap<u64, EngineHash>,
    /// Pool keys whose mapped object L2 came to hold, oldest first (at most
    /// [`MAX_ALIASES_DUE`]): their aliases are due in L2 ([`Ingest::take_aliases`]).
    aliases_due: VecDeque<u64>,
    pub stats: IngestStats,
}

impl Ingest {
    /// A view of `engines` engines (their order is `Scope::Gpu`'s index).
    pub fn new(tenants: Tenants, engines: usize) -> Self {
        Ingest {
            tenants,
            learned: HashMap::new(),
            learned_any: false,
            learned_version: None,
            keys: Vec::new(),
            engines: (0..engines).map(|_| EngineView::default()).collect(),
            covered: HashMap::new(),
            block_tokens: None,
            objects: HashMap::new(),
            by_key: HashMap::new(),
            aliases_due: VecDeque::new(),
            stats: IngestStats::default(),
        }
    }

    /// Sets the pool's block size (the routers' `block_tokens`), which event blocks are
    /// re-cut into; `None` (the default) takes each engine's GPU block size. Blocks
    /// already keyed keep their keys: set it before the first batch.
    pub fn set_block_tokens(&mut self, block_tokens: Option<u32>) {
        self.block_tokens = block_tokens.filter(|&b| b > 0);
    }

    /// Takes the table a router sent for configuration `version`, unless the table held is
    /// of a newer version (a router behind, or one replaying an old table) or it has more
    /// than [`warmpath_residency::MAX_TENANT_ENTRIES`] entries. Of one version, the last
    /// table sent is kept (routers of one version send the same one). What
    /// [`Ingest::learn_tenants`] returns, when taken.
    pub fn learn_tenants_at(
        &mut self,
        version: u64,
        table: Vec<(String, String)>,
    ) -> Result<bool, TableRefused> {
        if table.len() > warmpath_residency::MAX_TENANT_ENTRIES {
            return Err(TableRefused::TooLarge);
        }
        if self.learned_version.is_some_and(|held| version < held) {
            return Err(TableRefused::Stale);
        }
        self.learned_version = Some(version);
        Ok(self.learn_tenants(table.into_iter().collect()))
    }

    /// The tenants the routers' table holds (salt → tenant id entries).
    pub fn learned_tenants(&self) -> usize {
        self.learned.len()
    }

    /// Replaces the table the routers sent (salt → tenant id). Chains stored from now on
    /// resolve through it. Returns true, once, for a [`Tenants::Fixed`] agent's first
    /// non-empty table: every key it computed before is its fixed tenant's, which no router
    /// asks for, so the caller rebuilds the view (`kv_subscribe`'s resync from the engine's
    /// replay socket). Later tables change no key already reported: chains of a salt they
    /// add or move resolve by the new table when stored again.
    pub fn learn_tenants(&mut self, table: HashMap<String, String>) -> bool {
        let first = !self.learned_any && !table.is_empty();
        self.learned_any |= first;
        self.learned = table;
        first && matches!(self.tenants, Tenants::Fixed(_))
    }

    /// The tenant key of a first block with these salt `candidates` (last first).
    fn resolve(&self, candidates: &[&str]) -> Option<TenantKey> {
        let by_learned = || {
            candidates
                .iter()
                .rev()
                .find_map(|s| self.learned.get(*s).map(|id| TenantKey::derive(id, s)))
        };
        match &self.tenants {
            Tenants::Fixed(_) if !self.learned.is_empty() => by_learned(),
            own => own.resolve(candidates).or_else(by_learned),
        }
    }

    /// The slot of `tenant`'s key for `adapter` (the tenant's own key for none).
    /// None when it would be a new one past [`MAX_SLOTS`].
    fn slot(&mut self, tenant: TenantKey, adapter: Option<&str>) -> Option<u32> {
        let key = match adapter {
            Some(a) => tenant.for_adapter(a),
            None => tenant,
        };
        let i = match self.keys.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None if self.keys.len() >= MAX_SLOTS => return None,
            None => {
                self.keys.push((key, adapter.map(Box::from)));
                self.keys.len() - 1
            }
        };
        Some(i as u32)
    }

    /// The slot of the GPU chain on `engine` whose first pool block is `tokens`' first,
    /// under `adapter`; none when several tenants' chains start so (the agent does not
    /// guess between tenants).
    fn gpu_chain_slot(
        &self,
        engine: usize,
        tokens: &[u32],
        pool: usize,
        adapter: Option<&str>,
    ) -> Option<u32> {
        let first = tokens.get(..pool)?;
        let gpu = Scope::Gpu(u16::try_from(engine).ok()?);
        let mut bytes = Vec::with_capacity(pool * 4);
        warmpath_index::keys::token_block_bytes(first, &mut bytes);
        let mut found = self.keys.iter().enumerate().filter(|(_, (k, a))| {
            a.as_deref() == adapter && self.covered.contains_key(&(gpu, k.chain(None, &bytes).0))
        });
        match (found.next(), found.next()) {
            (Some((i, _)), None) => Some(i as u32),
            _ => None,
        }
    }

    /// The end of the engine's GPU chain that `tokens` continue, for a CPU chunk announced
    /// with parent 0 (LMCache's first chunk after a prefix it held already): the one GPU
    /// block whose chain, extended by the chunk's first pool block, names a pool block the
    /// engine's GPU holds. None when no block or more than one does. A scan of the
    /// engine's GPU blocks (at most [`MAX_BLOCKS`]), once per such chunk.
    fn gpu_chain_continued(
        &self,
        engine: usize,
        tokens: &[u32],
        pool: usize,
        adapter: Option<&str>,
    ) -> Option<ChainEnd> {
        let gpu = Scope::Gpu(u16::try_from(engine).ok()?);
        let mut bytes = Vec::with_capacity(pool * 4);
        let mut block = Vec::with_capacity(pool);
        let mut found: Option<ChainEnd> = None;
        for node in self.engines[engine].blocks.values() {
            if !node.gpu || self.keys[node.slot as usize].1.as_deref() != adapter {
                continue;
            }
            let Some(rest) = pool.checked_sub(node.tail.len()) else {
                continue;
            };
            let Some(first) = tokens.get(..rest) else {
                continue;
            };
            // The pool block that would follow the node: its tail, then the chunk's start.
            block.clear();
            block.extend_from_slice(&node.tail);
            block.extend_from_slice(first);
            warmpath_index::keys::token_block_bytes(&block, &mut bytes);
            let k = self.keys[node.slot as usize].0.chain(node.key, &bytes);
            if !self.covered.contains_key(&(gpu, k.0)) {
                continue;
            }
            let end = (node.slot, node.key, node.tail.to_vec());
            match &found {
                Some(f) if *f != end => return None,
                _ => found = Some(end),
            }
        }
        found
    }

    /// A chunk of `tokens` tokens in the engine's CPU tier announced without tokens, by
    /// the hash of its last GPU block (vLLM 0.11's `OffloadingConnector`): when that
    /// block and the blocks before it back to the chunk's start are known, the chunk
    /// covers their pool blocks in L1. Whether it was mapped.
    fn offload(
        &mut self,
        engine: usize,
        scope: Scope,
        hash: &EngineHash,
        tokens: usize,
        out: &mut Vec<Change>,
    ) -> bool {
        let view = &mut self.engines[engine];
        if scope != Scope::L1 || tokens == 0 || view.offloaded.contains_key(hash) {
            return view.offloaded.contains_key(hash);
        }
        // Walk back until the blocks span exactly the chunk.
        let (mut at, mut spanned, mut parts) = (Some(hash), 0usize, Vec::new());
        while spanned < tokens {
            let Some(node) = at.and_then(|h| view.blocks.get(h)) else {
                return false;
            };
            spanned += node.len as usize;
            parts.push(&node.covers[..]);
            at = node.parent.as_ref();
        }
        if spanned != tokens || view.offloaded.len() >= MAX_BLOCKS {
            return false;
        }
        let covers: Box<[BlockKey]> = parts.iter().rev().flat_map(|c| c.iter().copied()).collect();
        cover_keys(&mut self.covered, scope, None, &covers, out);
        view.offloaded.insert(hash.clone(), covers);
        true
    }

    /// The pool's block size, when known: set, or learned from an engine's first store.
    pub fn block_tokens(&self) -> Option<u32> {
        self.block_tokens
            .or_else(|| self.engines.iter().find_map(|e| e.gpu_block_tokens))
    }

    /// The pool's block size for `engine`, when known.
    fn pool_tokens(&self, engine: usize) -> Option<usize> {
        self.block_tokens
            .or(self.engines[engine].gpu_block_tokens)
            .map(|b| b as usize)
    }

    /// The host's store now holds the object of chunk hash `hash` in `tier` (stored or
    /// loaded back: L1; evicted to L2: L2, and no longer L1). Its pool blocks are
    /// reported there when an engine's event block of that hash is keyed, now or later.
    pub fn object_held(&mut self, hash: &EngineHash, tier: ObjectTier) -> Vec<Change> {
        self.held_in(hash, tier, true)
    }

    /// A block an engine put through the agent's block API is held in `tier`, named by a
    /// key that may be the hash its KV events gave it (record 0124). If an engine's event
    /// block of that hash is known (or a put of it was), it is followed as an object of the
    /// store, its pool blocks reported there, except that L1 and L2 hold it independently
    /// (a write to L2 leaves L1 as it is); `None` if not: the caller reports the key as it
    /// is (a client that puts the routers' own keys).
    pub fn block_put(&mut self, hash: &EngineHash, tier: ObjectTier) -> Option<Vec<Change>> {
        let known = self.objects.contains_key(hash)
            || self.engines.iter().any(|v| v.blocks.contains_key(hash));
        known.then(|| self.held_in(hash, tier, false))
    }

    /// A block put through the block API is no longer held in `tier`: what
    /// [`Ingest::block_put`] reported of it is withdrawn; `None` if it followed no such put.
    pub fn block_gone(&mut self, hash: &EngineHash, tier: ObjectTier) -> Option<Vec<Change>> {
        self.objects
            .contains_key(hash)
            .then(|| self.object_gone(hash, tier))
    }

    /// [`Ingest::object_held`] (`spill`: held in L2 means no longer in L1) and
    /// [`Ingest::block_put`].
    fn held_in(&mut self, hash: &EngineHash, tier: ObjectTier, spill: bool) -> Vec<Change> {
        let mut out = Vec::new();
        if !self.objects.contains_key(hash) {
            if self.objects.len() >= MAX_OBJECTS {
                self.stats.objects_capped += 1;
                return out;
            }
            let mapped = self
                .engines
                .iter()
                .enumerate()
                .find_map(|(e, v)| v.blocks.get(hash).map(|n| (e, n)))
                .map(|(e, n)| (e, n.before, n.covers.clone()));
            if let Some((_, _, covers)) = &mapped {
                index_keys(&mut self.by_key, hash, covers);
            }
            self.objects.insert(
                hash.clone(),
                Object {
                    mapped,
                    ..Object::default()
                },
            );
        }
        let Some(o) = self.objects.get_mut(hash) else {
            return out;
        };
        let (add, drop) = match tier {
            ObjectTier::L1 => (!std::mem::replace(&mut o.l1, true), false),
            ObjectTier::L2 => (
                !std::mem::replace(&mut o.l2, true),
                spill && std::mem::replace(&mut o.l1, false),
            ),
        };
        if let Some((_, before, covers)) = &o.mapped {
            if drop {
                uncover(&mut self.covered, Scope::L1, covers, &mut out);
            }
            if add {
                cover_keys(&mut self.covered, tier.scope(), *before, covers, &mut out);
                // An adopted object's alias is the other host's, already in L2.
                if tier == ObjectTier::L2 && o.mapped.as_ref().is_some_and(|m| m.0 != ADOPTED) {
                    due(&mut self.aliases_due, &mut self.stats, covers);
                }
            }
        }
        out
    }

    /// The host's store no longer holds the object of chunk hash `hash` in `tier`.
    pub fn object_gone(&mut self, hash: &EngineHash, tier: ObjectTier) -> Vec<Change> {
        let mut out = Vec::new();
        let Some(o) = self.objects.get_mut(hash) else {
            return out;
        };
        let held = match tier {
            ObjectTier::L1 => std::mem::replace(&mut o.l1, false),
            ObjectTier::L2 => std::mem::replace(&mut o.l2, false),
        };
        if let (true, Some((_, _, covers))) = (held, &o.mapped) {
            uncover(&mut self.covered, tier.scope(), covers, &mut out);
        }
        if !o.l1 && !o.l2 {
            if let Some(Object {
                mapped: Some((_, _, covers)),
                ..
            }) = self.objects.remove(hash)
            {
                unindex_keys(&mut self.by_key, hash, &covers);
            }
        }
        out
    }

    /// The engine's blocks that hold the chain of pool keys `keys` (a router's, in order),
    /// as the hashes of the mapped objects that cover them: for each key, the event blocks
    /// of its object's engine from just after the previous key's up to the one that
    /// completed it, each once. Stops at the first key no mapped object covers; returns
    /// the blocks and how many of `keys` were read back (0: none, the hint names no block
    /// of this store: a client that puts the routers' own keys).
    pub fn engine_blocks(&self, keys: &[u64]) -> (Vec<EngineHash>, usize) {
        let mut blocks: Vec<EngineHash> = Vec::new();
        let mut read = 0;
        for key in keys {
            let Some(hash) = self.by_key.get(key) else {
                break;
            };
            read += 1;
            if blocks.last() == Some(hash) {
                continue;
            }
            // The event blocks before it that completed no pool block, back to the one
            // that did (already listed, or not part of this hint).
            let engine = self
                .objects
                .get(hash)
                .and_then(|o| o.mapped.as_ref())
                .map(|(e, _, _)| *e);
            let view = engine.and_then(|e| self.engines.get(e));
            let mut before = Vec::new();
            let mut at = view
                .and_then(|v| v.blocks.get(hash))
                .and_then(|n| n.parent.as_ref());
            while let Some(parent) = at {
                let Some(node) = view.and_then(|v| v.blocks.get(parent)) else {
                    break;
                };
                // Bounded: an engine that names its blocks' parents in a loop stops here.
                if !node.covers.is_empty() || before.len() >= MAX_FRAGMENTS {
                    break;
                }
                before.push(parent.clone());
                at = node.parent.as_ref();
            }
            blocks.extend(before.into_iter().rev());
            blocks.push(hash.clone());
        }
        (blocks, read)
    }

    /// [`Ingest::engine_blocks`] with the blocks as the 8-byte keys they are put under (a
    /// block-API engine's); `None` where a block is no 8-byte key (a store's objects of
    /// other names).
    pub fn engine_block_keys(&self, keys: &[u64]) -> Option<(Vec<u64>, usize)> {
        let (blocks, read) = self.engine_blocks(keys);
        let blocks = blocks
            .iter()
            .map(EngineHash::as_u64)
            .collect::<Option<_>>()?;
        Some((blocks, read))
    }

    /// Follows block `hash` as an object of the store that covers pool keys `covers` (after
    /// `before`), as another host's agent named it in an L2 alias (record 0126): when this
    /// agent then holds it ([`Ingest::block_put`]), routers are told of those keys, not of
    /// the engine's hash that no router matches. A block already followed, or one an
    /// engine of this host announced, is left as it is.
    pub fn adopt(&mut self, hash: &EngineHash, before: Option<BlockKey>, covers: &[BlockKey]) {
        let known = self.objects.contains_key(hash)
            || self.engines.iter().any(|v| v.blocks.contains_key(hash));
        if known {
            return;
        }
        if self.objects.len() >= MAX_OBJECTS {
            self.stats.objects_capped += 1;
            return;
        }
        index_keys(&mut self.by_key, hash, covers);
        self.objects.insert(
            hash.clone(),
            Object {
                mapped: Some((ADOPTED, before, covers.into())),
                ..Object::default()
            },
        );
    }

    /// The aliases due in L2 (record 0126), at most `max`, oldest first: each pool key
    /// whose mapped object L2 came to hold, with the engine's blocks that hold it as
    /// [`Ingest::engine_blocks`] reads it back, as 8-byte keys. Another host's agent, told to
    /// prefetch that key, reads the alias and then the blocks. A key that no longer reads
    /// back (its object left both tiers since), or whose blocks are not 8-byte keys (a
    /// store's objects of other names), has none.
    pub fn take_aliases(&mut self, max: usize) -> Vec<(u64, Vec<u64>)> {
        let n = max.min(self.aliases_due.len());
        let keys: Vec<u64> = self.aliases_due.drain(..n).collect();
        keys.into_iter()
            .filter_map(|key| match self.engine_block_keys(&[key])? {
                (blocks, 1) => Some((key, blocks)),
                _ => None,
            })
            .collect()
    }

    /// Objects of the host's store followed, and of those the ones whose event block is
    /// not known yet (not reported).
    pub fn objects(&self) -> (usize, usize) {
        let unmapped = self.objects.values().filter(|o| o.mapped.is_none()).count();
        (self.objects.len(), unmapped)
    }

    /// An event block just keyed: an object of its hash that waited is reported now.
    fn map_object(
        &mut self,
        engine: usize,
        hash: &EngineHash,
        before: Option<BlockKey>,
        covers: &[BlockKey],
        out: &mut Vec<Change>,
    ) {
        // Called per new event block: one lookup when no object waits.
        let Some(o) = self.objects.get_mut(hash) else {
            return;
        };
        if o.mapped.is_some() {
            return;
        }
        o.mapped = Some((engine, before, covers.into()));
        index_keys(&mut self.by_key, hash, covers);
        for (held, scope) in [(o.l1, Scope::L1), (o.l2, Scope::L2)] {
            if held {
                cover_keys(&mut self.covered, scope, before, covers, out);
            }
        }
        if o.l2 {
            due(&mut self.aliases_due, &mut self.stats, covers);
        }
    }

    /// The sequence number of the last batch applied for `engine`.
    pub fn last_seq(&self, engine: usize) -> Option<u64> {
        self.engines.get(engine).and_then(|e| e.last_seq)
    }

    /// Event blocks held (in any medium) for `engine`.
    pub fn len(&self, engine: usize) -> usize {
        self.engines
            .get(engine)
            .map_or(0, |e| e.blocks.values().filter(|n| n.held()).count())
    }

    /// Forgets everything of `engine` (a publisher restart, a lost connection), returning
    /// the removals to report.
    pub fn reset(&mut self, engine: usize) -> Vec<Change> {
        let Some(view) = self.engines.get_mut(engine) else {
            return Vec::new();
        };
        view.last_seq = None;
        view.ghosts.clear();
        let nodes: Vec<Node> = view.blocks.drain().map(|(_, n)| n).collect();
        let offloaded: Vec<Box<[BlockKey]>> = view.offloaded.drain().map(|(_, c)| c).collect();
        let mut out = Vec::new();
        for covers in &offloaded {
            uncover(&mut self.covered, Scope::L1, covers, &mut out);
        }
        // Objects keyed by this view wait again: its rebuild (a replay, a new tenant table)
        // keys them anew, and keys of the old view are not reported on.
        for (hash, o) in self.objects.iter_mut() {
            if o.mapped.as_ref().is_some_and(|(e, _, _)| *e == engine) {
                if let Some((_, _, covers)) = o.mapped.take() {
                    unindex_keys(&mut self.by_key, hash, &covers);
                    for (held, scope) in [(o.l1, Scope::L1), (o.l2, Scope::L2)] {
                        if held {
                            uncover(&mut self.covered, scope, &covers, &mut out);
                        }
                    }
                }
            }
        }
        for n in &nodes {
            for scope in [Scope::Gpu(engine as u16), Scope::L1] {
                if n.holds(scope) {
                    uncover(&mut self.covered, scope, &n.covers, &mut out);
                }
            }
        }
        out.sort_unstable_by_key(|c| (c.scope, c.key));
        out
    }

    /// Applies batch `seq` of `engine`, returning the residency changes, in order.
    pub fn apply(&mut self, engine: usize, seq: u64, batch: &Decoded) -> Vec<Change> {
        let mut out = Vec::new();
        if engine >= self.engines.len() {
            return out;
        }
        self.stats.batches += 1;
        self.stats.unknown += batch.unknown;
        if let Some(last) = self.engines[engine].last_seq {
            if seq != last.wrapping_add(1) {
                self.stats.gaps += 1;
                out = self.reset(engine);
            }
        }
        self.engines[engine].last_seq = Some(seq);
        for event in &batch.events {
            self.stats.events += 1;
            match event {
                KvEvent::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size,
                    lora_name,
                    lora_id,
                    medium,
                    extra_keys,
                } => {
                    let n = block_hashes.len() as u64;
                    let Some(scope) = scope_of(medium.as_deref(), engine) else {
                        self.stats.skipped += n;
                        continue;
                    };
                    let bs = *block_size as usize;
                    if token_ids.is_empty() {
                        // vLLM offloading's tokenless chunks: routable only where they
                        // name a GPU block this agent knows.
                        for hash in block_hashes {
                            if !self.offload(engine, scope, hash, bs, &mut out) {
                                self.stats.skipped += 1;
                            }
                        }
                        continue;
                    }
                    // `n` blocks of `bs` tokens, the last one possibly shorter (LMCache's
                    // last chunk). LMCache 0.5.6 also sends one token more than its
                    // chunks (`convert_tokens_to_list` slices `start:end + 1`): the next
                    // chunk's first token, not part of this one; in the CPU tier only.
                    let len = token_ids.len();
                    let extra = usize::from(scope == Scope::L1);
                    if bs == 0
                        || n == 0
                        || len > n as usize * bs + extra
                        || len <= (n as usize - 1) * bs
                    {
                        self.stats.malformed += 1;
                        continue;
                    }
                    let token_ids = &token_ids[..len.min(n as usize * bs)];
                    let len = token_ids.len();
                    if scope != Scope::L1
                        && len == n as usize * bs
                        && self.engines[engine].gpu_block_tokens.is_none()
                    {
                        self.engines[engine].gpu_block_tokens = Some(*block_size);
                    }
                    let Some(pool) = self.pool_tokens(engine) else {
                        self.stats.no_block_size += n;
                        continue;
                    };
                    let adapter = match (lora_name, lora_id) {
                        (Some(name), _) => Some(name.as_str()),
                        (None, Some(_)) => {
                            self.stats.skipped += n;
                            continue;
                        }
                        (None, None) => None,
                    };
                    let mut prev_hash = parent.clone();
                    let mut prev: Option<ChainEnd> = match parent {
                        None => None,
                        Some(p) => match self.engines[engine].blocks.get(p) {
                            Some(node) => Some((node.slot, node.key, node.tail.to_vec())),
                            None => match (scope, p.is_zero()) {
                                // LMCache names parent 0 for the first chunk it stores
                                // after a prefix it already held: the chain is the GPU's
                                // that these tokens continue.
                                (Scope::L1, true) => {
                                    match self.gpu_chain_continued(engine, token_ids, pool, adapter)
                                    {
                                        Some(end) => {
                                            self.stats.parents_by_tokens += 1;
                                            prev_hash = None;
                                            Some(end)
                                        }
                                        None => {
                                            self.stats.orphans += n;
                                            continue;
                                        }
                                    }
                                }
                                _ => {
                                    self.stats.orphans += n;
                                    continue;
                                }
                            },
                        },
                    };
                    for (i, (hash, tokens)) in
                        block_hashes.iter().zip(token_ids.chunks(bs)).enumerate()
                    {
                        let left = n - i as u64;
                        // A block this engine announced before (in another medium, or
                        // again): its chain is known.
                        if let Some(node) = self.engines[engine].blocks.get_mut(hash) {
                            if node.announce(scope) {
                                cover(&mut self.covered, scope, node, &mut out);
                            }
                            prev = Some((node.slot, node.key, node.tail.to_vec()));
                            prev_hash = Some(hash.clone());
                            continue;
                        }
                        let (slot, before, mut buf) = match prev.take() {
                            Some(end) => end,
                            None => {
                                let candidates: Vec<&str> = extra_keys
                                    .get(i)
                                    .map(|k| {
                                        k.iter()
                                            .map(String::as_str)
                                            .filter(|s| Some(*s) != adapter)
                                            .collect()
                                    })
                                    .unwrap_or_default();
                                let by_gpu = match (candidates.is_empty(), scope) {
                                    (true, Scope::L1) => {
                                        self.gpu_chain_slot(engine, tokens, pool, adapter)
                                    }
                                    _ => None,
                                };
                                let slot = match by_gpu {
                                    Some(s) => Some(s),
                                    None => match self.resolve(&candidates) {
                                        Some(k) => match self.slot(k, adapter) {
                                            Some(s) => Some(s),
                                            None => {
                                                self.stats.capped += left;
                                                break;
                                            }
                                        },
                                        None => None,
                                    },
                                };
                                match slot {
                                    Some(s) => (s, None, Vec::new()),
                                    None => {
                                        self.stats.unresolved += left;
                                        break;
                                    }
                                }
                            }
                        };
                        if self.engines[engine].blocks.len() >= MAX_BLOCKS {
                            self.stats.capped += left;
                            break;
                        }
                        // Re-cut: the parent's leftover and this block's tokens, in whole
                        // pool blocks.
                        buf.extend_from_slice(tokens);
                        let whole = buf.len() / pool * pool;
                        let tenant = &self.keys[slot as usize].0;
                        let mut bytes = Vec::with_capacity(pool * 4);
                        let mut key = before;
                        let mut covers = Vec::with_capacity(whole / pool);
                        for block in buf[..whole].chunks_exact(pool) {
                            warmpath_index::keys::token_block_bytes(block, &mut bytes);
                            let k = tenant.chain(key, &bytes);
                            covers.push(k);
                            key = Some(k);
                        }
                        let tail = buf.split_off(whole);
                        let mut node = Node {
                            slot,
                            parent: prev_hash.replace(hash.clone()),
                            len: tokens.len() as u32,
                            before,
                            key,
                            tail: tail.clone().into_boxed_slice(),
                            covers: covers.into_boxed_slice(),
                            gpu: false,
                            l1: 0,
                        };
                        node.announce(scope);
                        cover(&mut self.covered, scope, &node, &mut out);
                        self.map_object(engine, hash, node.before, &node.covers, &mut out);
                        self.engines[engine].blocks.insert(hash.clone(), node);
                        prev = Some((slot, key, tail));
                    }
                }
                KvEvent::Removed {
                    block_hashes,
                    medium,
                } => {
                    let Some(scope) = scope_of(medium.as_deref(), engine) else {
                        self.stats.skipped += block_hashes.len() as u64;
                        continue;
                    };
                    let view = &mut self.engines[engine];
                    for hash in block_hashes {
                        if scope == Scope::L1 {
                            if let Some(covers) = view.offloaded.remove(hash) {
                                uncover(&mut self.covered, scope, &covers, &mut out);
                                continue;
                            }
                        }
                        let Some(node) = view.blocks.get_mut(hash) else {
                            continue;
                        };
                        if !node.holds(scope) {
                            continue;
                        }
                        if node.retract(scope) {
                            uncover(&mut self.covered, scope, &node.covers, &mut out);
                        }
                        if !node.held() {
                            view.ghosts.push_back(hash.clone());
                        }
                    }
                    while view.ghosts.len() > GHOSTS {
                        if let Some(h) = view.ghosts.pop_front() {
                            if view.blocks.get(&h).is_some_and(|n| !n.held()) {
                                view.blocks.remove(&h);
                            }
                        }
                    }
                }
                KvEvent::Cleared => {
                    let last = self.engines[engine].last_seq;
                    out.extend(self.reset(engine));
                    self.engines[engine].last_seq = last;
                }
            }
        }
        out
    }
}

/// Counts `node`'s pool blocks as covered once more in `scope`, reporting those no other
/// held block covered.
fn cover(
    covered: &mut HashMap<(Scope, u64), u32>,
    scope: Scope,
    node: &Node,
    out: &mut Vec<Change>,
) {
    cover_keys(covered, scope, node.before, &node.covers, out);
}

/// Counts `covers` (after the key `before`) as covered once more in `scope`, reporting
/// those no other held block covered.
fn cover_keys(
    covered: &mut HashMap<(Scope, u64), u32>,
    scope: Scope,
    before: Option<BlockKey>,
    covers: &[BlockKey],
    out: &mut Vec<Change>,
) {
    let mut parent = before;
    for k in covers {
        let n = covered.entry((scope, k.0)).or_insert(0);
        *n += 1;
        if *n == 1 {
            out.push(Change {
                scope,
                key: k.0,
                parent: parent.map(|p| p.0),
                present: true,
            });
        }
        parent = Some(*k);
    }
}

/// Queues the aliases of `covers` ([`Ingest::take_aliases`]), dropping the oldest past
/// [`MAX_ALIASES_DUE`].
fn due(queue: &mut VecDeque<u64>, stats: &mut IngestStats, covers: &[BlockKey]) {
    for k in covers {
        if queue.len() >= MAX_ALIASES_DUE {
            queue.pop_front();
            stats.aliases_dropped += 1;
        }
        queue.push_back(k.0);
    }
}

/// Points each of `covers` at the object `hash` ([`Ingest::engine_blocks`]).
fn index_keys(by_key: &mut HashMap<u64, EngineHash>, hash: &EngineHash, covers: &[BlockKey]) {
    for k in covers {
        by_key.insert(k.0, hash.clone());
    }
}

/// Forgets the keys of `covers` that point at the object `hash`.
fn unindex_keys(by_key: &mut HashMap<u64, EngineHash>, hash: &EngineHash, covers: &[BlockKey]) {
    for k in covers {
        if by_key.get(&k.0) == Some(hash) {
            by_key.remove(&k.0);
        }
    }
}

/// Counts `covers` as covered once less in `scope`, reporting those no held block covers
/// any more.
fn uncover(
    covered: &mut HashMap<(Scope, u64), u32>,
    scope: Scope,
    covers: &[BlockKey],
    out: &mut Vec<Change>,
) {
    for k in covers {
        if let std::collections::hash_map::Entry::Occupied(mut e) = covered.entry((scope, k.0)) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
                out.push(Change {
                    scope,
                    key: k.0,
                    parent: None,
                    present: false,
                });
            }
        }
    }
}

fn scope_of(medium: Option<&str>, engine: usize) -> Option<Scope> {
    match medium {
        None | Some("GPU") | Some("gpu") => Some(Scope::Gpu(u16::try_from(engine).ok()?)),
        Some("CPU") | Some("cpu") => Some(Scope::L1),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warmpath_index::keys::token_block_keys;

    fn h(n: u64) -> EngineHash {
        EngineHash(n.to_be_bytes().to_vec())
    }

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: std::ops::Range<u32>,
        salt: Option<&str>,
    ) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes.iter().map(|&n| h(n)).collect(),
            parent: parent.map(h),
            token_ids: tokens.collect(),
            block_size: 4,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: salt.map(|s| vec![vec![s.to_string()]]).unwrap_or_default(),
        }
    }

    /// `event` with blocks of `size` tokens.
    fn sized(event: KvEvent, size: u32) -> KvEvent {
        with(event, |e| {
            if let KvEvent::Stored { block_size, .. } = e {
                *block_size = size;
            }
        })
    }

    fn batch(events: Vec<KvEvent>) -> Decoded {
        Decoded {
            events,
            ..Decoded::default()
        }
    }

    #[test]
    fn keys_are_recomputed_from_tokens_and_match_the_routers() {
        let mut ing = Ingest::new(Tenants::Fixed("engine-sim".into()), 1);
        // Two blocks, then a third that names the second as parent.
        let c1 = ing.apply(0, 0, &batch(vec![stored(&[10, 11], None, 0..8, Some("s"))]));
        let c2 = ing.apply(0, 1, &batch(vec![stored(&[12], Some(11), 8..12, None)]));
        let want = token_block_keys(
            &TenantKey::derive("engine-sim", "s"),
            &(0..12).collect::<Vec<u32>>(),
            4,
        );
        let got: Vec<u64> = c1.iter().chain(&c2).map(|c| c.key).collect();
        assert_eq!(got, want.iter().map(|k| k.0).collect::<Vec<_>>());
        assert_eq!(c2[0].parent, Some(want[1].0));
        // Removal by engine hash; clearing drops the rest.
        let r = ing.apply(
            0,
            2,
            &batch(vec![KvEvent::Removed {
                block_hashes: vec![h(12), h(99)],
                medium: None,
            }]),
        );
        assert_eq!(r.len(), 1);
        assert!(!r[0].present && r[0].key == want[2].0);
        let cleared = ing.apply(0, 3, &batch(vec![KvEvent::Cleared]));
        assert_eq!(cleared.len(), 2);
        assert_eq!(ing.len(0), 0);
    }

    #[test]
    fn tenants_come_from_the_first_blocks_salt() {
        let table = Tenants::Table(HashMap::from([
            ("salt-a".to_string(), "a".to_string()),
            ("salt-b".to_string(), "b".to_string()),
        ]));
        let mut ing = Ingest::new(table, 1);
        // The same prompt under two tenants: different keys, never shared.
        let a = ing.apply(0, 0, &batch(vec![stored(&[1], None, 0..4, Some("salt-a"))]));
        let b = ing.apply(0, 1, &batch(vec![stored(&[2], None, 0..4, Some("salt-b"))]));
        assert_ne!(a[0].key, b[0].key);
        // An unknown salt and a missing parent are counted, not reported.
        assert!(ing
            .apply(0, 2, &batch(vec![stored(&[3], None, 0..4, Some("nope"))]))
            .is_empty());
        assert!(ing
            .apply(0, 3, &batch(vec![stored(&[4], Some(77), 0..4, None)]))
            .is_empty());
        assert_eq!((ing.stats.unresolved, ing.stats.orphans), (1, 1));
        // More tokens than the blocks hold, or too few to reach the last block, are
        // malformed; a LoRA id without a name is skipped.
        for (n, tokens) in [(1, 9..18), (2, 9..13)] {
            let bad = stored(&[5, 6], None, tokens, Some("salt-a"));
            assert!(ing.apply(0, 3 + n, &batch(vec![bad])).is_empty());
        }
        let mut unnamed = stored(&[5, 6], None, 0..8, Some("salt-a"));
        if let KvEvent::Stored { lora_id, .. } = &mut unnamed {
            *lora_id = Some(1);
        }
        assert!(ing.apply(0, 6, &batch(vec![unnamed])).is_empty());
        assert_eq!((ing.stats.malformed, ing.stats.skipped), (2, 2));
    }

    #[test]
    fn tenants_learned_from_routers_resolve_salts() {
        let mut ing = Ingest::new(Tenants::Fixed("engine-sim".into()), 1);
        let fixed = ing.apply(0, 0, &batch(vec![stored(&[1], None, 0..4, Some("s"))]));
        // The first table changes the keys of what the fixed tenant resolved: rebuild.
        assert!(ing.learn_tenants(HashMap::from([("s".to_string(), "acme".to_string())])));
        let learned = ing.apply(0, 1, &batch(vec![stored(&[2], None, 0..4, Some("s"))]));
        assert_eq!(
            learned[0].key,
            warmpath_index::keys::token_block_keys(
                &TenantKey::derive("acme", "s"),
                &[0, 1, 2, 3],
                4
            )[0]
            .0
        );
        assert_ne!(fixed[0].key, learned[0].key);
        // With a table from routers, an unknown salt no longer falls to the fixed tenant.
        assert!(ing
            .apply(0, 2, &batch(vec![stored(&[3], None, 0..4, Some("other"))]))
            .is_empty());
        // An agent's own table comes first; the learned one fills in.
        let own = Tenants::Table(HashMap::from([("s".to_string(), "own".to_string())]));
        let mut ing = Ingest::new(own, 1);
        // An agent with its own table: a first learned table only fills in.
        assert!(!ing.learn_tenants(HashMap::from([
            ("s".to_string(), "acme".to_string()),
            ("t".to_string(), "beta".to_string()),
        ])));
        assert_eq!(
            ing.apply(0, 0, &batch(vec![stored(&[1], None, 0..4, Some("s"))]))
                .len(),
            1
        );
        assert_eq!(
            ing.apply(0, 1, &batch(vec![stored(&[2], None, 0..4, Some("t"))]))
                .len(),
            1
        );
        assert_eq!(ing.stats.unresolved, 0);
    }

    #[test]
    fn only_a_fixed_agents_first_table_asks_for_a_rebuild() {
        let table = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(s, t)| (s.to_string(), t.to_string()))
                .collect::<HashMap<_, _>>()
        };
        let mut ing = Ingest::new(Tenants::Fixed("engine-sim".into()), 1);
        assert!(!ing.learn_tenants(table(&[])));
        assert!(ing.learn_tenants(table(&[("s", "acme")])));
        // Routers that disagree for a while (an empty table, a salt added or moved) do
        // not ask again.
        assert!(!ing.learn_tenants(table(&[])));
        assert!(!ing.learn_tenants(table(&[("s", "acme"), ("t", "beta")])));
        assert!(!ing.learn_tenants(table(&[("s", "beta")])));
    }

    #[test]
    fn a_sequence_gap_drops_the_engines_view() {
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 2);
        ing.apply(0, 5, &batch(vec![stored(&[1], None, 0..4, None)]));
        ing.apply(1, 0, &batch(vec![stored(&[1], None, 0..4, None)]));
        // Seq 7 after 5: engine 0's view is dropped (a removal reported), then rebuilt.
        let c = ing.apply(0, 7, &batch(vec![stored(&[2], None, 4..8, None)]));
        assert_eq!(c.iter().filter(|c| !c.present).count(), 1);
        assert_eq!(c.iter().filter(|c| c.present).count(), 1);
        assert_eq!(ing.stats.gaps, 1);
        assert_eq!((ing.len(0), ing.len(1)), (1, 1));
        // CPU medium is the host's L1.
        let mut cpu = stored(&[9], None, 0..4, None);
        if let KvEvent::Stored { medium, .. } = &mut cpu {
            *medium = Some("CPU".into());
        }
        let c = ing.apply(1, 1, &batch(vec![cpu]));
        assert_eq!(c[0].scope, Scope::L1);
    }

    fn with(event: KvEvent, f: impl FnOnce(&mut KvEvent)) -> KvEvent {
        let mut e = event;
        f(&mut e);
        e
    }

    /// LMCache's CPU chunk (medium "cpu", no extra keys, block size = its length).
    fn chunk(hash: u64, parent: Option<u64>, tokens: std::ops::Range<u32>) -> KvEvent {
        let len = tokens.len() as u32;
        with(stored(&[hash], parent, tokens, None), |e| {
            if let KvEvent::Stored {
                medium,
                block_size,
                extra_keys,
                ..
            } = e
            {
                *medium = Some("cpu".into());
                *block_size = len;
                *extra_keys = Vec::new();
            }
        })
    }

    fn present(changes: &[Change], scope: Scope) -> Vec<u64> {
        changes
            .iter()
            .filter(|c| c.present && c.scope == scope)
            .map(|c| c.key)
            .collect()
    }

    #[test]
    fn objects_of_the_hosts_store_are_mapped_through_their_chunks_events() {
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        ing.set_block_tokens(Some(4));
        let salted = |e: KvEvent| {
            with(e, |e| {
                if let KvEvent::Stored { extra_keys, .. } = e {
                    *extra_keys = vec![vec!["s".into()]];
                }
            })
        };
        let keys: Vec<u64> = token_block_keys(
            &TenantKey::derive("t", "s"),
            &(0..16).collect::<Vec<_>>(),
            4,
        )
        .iter()
        .map(|k| k.0)
        .collect();
        // Chunk 100 (8 tokens) announced, then its object stored: nothing new to report
        // (LMCache's CPU copy holds the keys already), but the object holds them too.
        let c = ing.apply(0, 0, &batch(vec![salted(chunk(100, None, 0..8))]));
        assert_eq!(present(&c, Scope::L1), keys[..2]);
        assert!(ing.object_held(&h(100), ObjectTier::L1).is_empty());
        // Object 101 stored before its event: it waits, then is reported with the event.
        assert!(ing.object_held(&h(101), ObjectTier::L1).is_empty());
        assert_eq!(ing.objects(), (2, 1));
        let c = ing.apply(0, 1, &batch(vec![chunk(101, Some(100), 8..16)]));
        assert_eq!(present(&c, Scope::L1), keys[2..4]);
        assert_eq!(ing.objects(), (2, 0));
        // LMCache drops its CPU copies: the segment still holds them, nothing withdrawn.
        let gone = KvEvent::Removed {
            block_hashes: vec![h(100), h(101)],
            medium: Some("cpu".into()),
        };
        assert!(ing.apply(0, 2, &batch(vec![gone])).is_empty());
        // Evicted to L2: withdrawn from L1, reported in L2; then gone from L2 as well.
        let c = ing.object_held(&h(100), ObjectTier::L2);
        assert_eq!(present(&c, Scope::L2), keys[..2]);
        assert_eq!(c.iter().filter(|c| !c.present).count(), 2);
        let c = ing.object_gone(&h(100), ObjectTier::L2);
        assert_eq!((c.len(), c.iter().any(|c| c.present)), (2, false));
        let c = ing.object_gone(&h(101), ObjectTier::L1);
        assert_eq!(c.len(), 2);
        assert_eq!(ing.objects(), (0, 0));
        // An object whose event never comes is counted, and goes without a trace.
        assert!(ing.object_held(&h(7), ObjectTier::L1).is_empty());
        assert!(ing.object_gone(&h(7), ObjectTier::L1).is_empty());
        assert_eq!(ing.objects(), (0, 0));
        // A dropped view (a gap, a new tenant table) withdraws the keys it gave an object,
        // which waits for the rebuilt view.
        let c = ing.apply(0, 3, &batch(vec![salted(chunk(300, None, 0..8))]));
        assert_eq!(present(&c, Scope::L1), keys[..2]);
        assert!(ing.object_held(&h(300), ObjectTier::L1).is_empty());
        let c = ing.reset(0);
        assert_eq!((c.len(), ing.objects()), (2, (1, 1)));
        let c = ing.apply(0, 0, &batch(vec![salted(chunk(300, None, 0..8))]));
        assert_eq!(present(&c, Scope::L1), keys[..2]);
        assert_eq!(ing.objects(), (1, 0));
    }

    #[test]
    fn blocks_put_through_the_block_api_are_reported_under_the_keys_their_events_gave() {
        // An engine (engine-sim) stores two GPU blocks of 4 tokens, hashes 10 and 11, then
        // puts them into the agent's L1 and L2 under those hashes (record 0124).
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        ing.set_block_tokens(Some(4));
        let keys: Vec<u64> =
            token_block_keys(&TenantKey::derive("t", "s"), &(0..8).collect::<Vec<_>>(), 4)
                .iter()
                .map(|k| k.0)
                .collect();
        let c = ing.apply(0, 0, &batch(vec![stored(&[10, 11], None, 0..8, Some("s"))]));
        assert_eq!(present(&c, Scope::Gpu(0)), keys);
        let c = ing.block_put(&h(10), ObjectTier::L1).unwrap();
        assert_eq!(present(&c, Scope::L1), keys[..1]);
        assert_eq!(c[0].parent, None);
        let c = ing.block_put(&h(11), ObjectTier::L1).unwrap();
        assert_eq!(
            (present(&c, Scope::L1), c[0].parent),
            (keys[1..].to_vec(), Some(keys[0]))
        );
        // Written to L2 as well: L1 keeps it (an object spilled to L2 would leave L1).
        let c = ing.block_put(&h(11), ObjectTier::L2).unwrap();
        assert_eq!((present(&c, Scope::L2), c.len()), (keys[1..].to_vec(), 1));
        // Evicted from the GPU, then from L1: the L2 copy stays reported.
        let gone = KvEvent::Removed {
            block_hashes: vec![h(10), h(11)],
            medium: Some("GPU".into()),
        };
        let c = ing.apply(0, 1, &batch(vec![gone]));
        assert_eq!(c.iter().filter(|c| c.scope == Scope::Gpu(0)).count(), 2);
        let c = ing.block_gone(&h(11), ObjectTier::L1).unwrap();
        assert_eq!((c.len(), c[0].scope, c[0].present), (1, Scope::L1, false));
        assert_eq!(ing.block_put(&h(11), ObjectTier::L2), Some(Vec::new()));
        // A key no event named is the caller's to report as it is.
        assert_eq!(ing.block_put(&h(99), ObjectTier::L1), None);
        assert_eq!(ing.block_gone(&h(99), ObjectTier::L1), None);
        assert_eq!(ing.objects(), (2, 0));
    }

    /// Pool blocks of 4 tokens; the engine's GPU blocks of 2 (hashes 10 to 15) stored, each
    /// pool block completed by every second one: the ingest, the chain's 3 pool keys and the
    /// engine's hashes.
    fn pool_blocks_of_two_engine_blocks() -> (Ingest, Vec<u64>, [u64; 6]) {
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        ing.set_block_tokens(Some(4));
        let keys: Vec<u64> = token_block_keys(
            &TenantKey::derive("t", "s"),
            &(0..12).collect::<Vec<_>>(),
            4,
        )
        .iter()
        .map(|k| k.0)
        .collect();
        let hashes = [10, 11, 12, 13, 14, 15];
        let small = sized(stored(&hashes, None, 0..12, Some("s")), 2);
        ing.apply(0, 0, &batch(vec![small]));
        (ing, keys, hashes)
    }

    #[test]
    fn a_routers_chain_reads_back_to_the_blocks_an_engine_put() {
        let (mut ing, keys, hashes) = pool_blocks_of_two_engine_blocks();
        // Nothing put yet: no key reads back (the hint is the caller's as it is).
        assert_eq!(ing.engine_blocks(&keys), (vec![], 0));
        for x in hashes {
            ing.block_put(&h(x), ObjectTier::L2).unwrap();
        }
        let all: Vec<EngineHash> = hashes.iter().map(|&x| h(x)).collect();
        assert_eq!(ing.engine_blocks(&keys), (all.clone(), 3));
        // From the second key on: only that key's own two blocks.
        assert_eq!(ing.engine_blocks(&keys[1..2]), (all[2..4].to_vec(), 1));
        // A key past the chain stops the reading there.
        assert_eq!(
            ing.engine_blocks(&[keys[0], 7, keys[2]]),
            (all[..2].to_vec(), 1)
        );
        // The block that completed the second key leaves both tiers: it no longer reads
        // back, and the chain stops before it.
        ing.block_gone(&h(13), ObjectTier::L2).unwrap();
        assert_eq!(ing.engine_blocks(&keys), (all[..2].to_vec(), 1));
        // A dropped view (a gap) forgets every mapping.
        ing.reset(0);
        assert_eq!(ing.engine_blocks(&keys), (vec![], 0));

        // Blocks larger than the pool's: one 8-token block covers two keys, listed once.
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        ing.set_block_tokens(Some(4));
        let large = sized(stored(&[20, 21], None, 0..16, Some("s")), 8);
        ing.apply(0, 0, &batch(vec![large]));
        ing.block_put(&h(20), ObjectTier::L2).unwrap();
        assert_eq!(ing.engine_blocks(&keys), (vec![h(20)], 2));
    }

    #[test]
    fn keys_l2_came_to_hold_get_aliases_naming_the_engines_blocks() {
        let (mut ing, keys, hashes) = pool_blocks_of_two_engine_blocks();
        // The first two put in L2, the rest in L1 alone: no reason for an alias.
        ing.block_put(&h(10), ObjectTier::L2).unwrap();
        ing.block_put(&h(11), ObjectTier::L2).unwrap();
        for x in &hashes[2..] {
            ing.block_put(&h(*x), ObjectTier::L1).unwrap();
        }
        assert_eq!(ing.take_aliases(10), vec![(keys[0], vec![10, 11])]);
        for x in &hashes[2..] {
            ing.block_put(&h(*x), ObjectTier::L2).unwrap();
        }
        // Each key once, with the blocks from the previous key's on; `max` bounds a take.
        assert_eq!(ing.take_aliases(1), vec![(keys[1], vec![12, 13])]);
        // A key whose object left both tiers since has none.
        ing.block_gone(&h(15), ObjectTier::L1).unwrap();
        ing.block_gone(&h(15), ObjectTier::L2).unwrap();
        assert_eq!(ing.take_aliases(10), vec![]);
        // Stored again: due again.
        ing.block_put(&h(15), ObjectTier::L2).unwrap();
        assert_eq!(ing.take_aliases(10), vec![(keys[2], vec![14, 15])]);
        assert_eq!(ing.take_aliases(10), vec![]);
    }

    #[test]
    fn blocks_adopted_from_another_hosts_alias_are_reported_under_its_keys() {
        // Another host's alias: pool keys 500 and 501, held by blocks 40 (a fragment) and
        // 41, and by 42. No engine of this host announced them.
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        ing.set_block_tokens(Some(4));
        let (k500, k501) = (BlockKey(500), BlockKey(501));
        ing.adopt(&h(40), None, &[]);
        ing.adopt(&h(41), None, &[k500]);
        ing.adopt(&h(42), Some(k500), &[k501]);
        assert_eq!(ing.engine_blocks(&[500, 501]), (vec![h(41), h(42)], 2));
        // Loaded into L1: reported as the routers' keys, in their chain.
        let mut changes = ing.block_put(&h(40), ObjectTier::L1).unwrap();
        changes.extend(ing.block_put(&h(41), ObjectTier::L1).unwrap());
        changes.extend(ing.block_put(&h(42), ObjectTier::L1).unwrap());
        assert_eq!(present(&changes, Scope::L1), vec![500, 501]);
        assert_eq!(changes[1].parent, Some(500));
        // Read from L2 too: reported there, and no alias of ours is due (it is theirs).
        let l2 = ing.block_put(&h(42), ObjectTier::L2).unwrap();
        assert_eq!(present(&l2, Scope::L2), vec![501]);
        assert_eq!(ing.take_aliases(10), vec![]);
        // Evicted from L1: withdrawn.
        let gone = ing.block_gone(&h(42), ObjectTier::L1).unwrap();
        assert_eq!((gone.len(), gone[0].key, gone[0].present), (1, 501, false));
        // A block this host follows already is left as it is.
        ing.adopt(&h(41), None, &[BlockKey(7)]);
        assert_eq!(ing.engine_blocks(&[7]), (vec![], 0));
    }

    #[test]
    fn chunks_are_recut_into_the_pools_blocks() {
        let table = Tenants::Table(HashMap::from([("s".to_string(), "acme".to_string())]));
        let mut ing = Ingest::new(table, 1);
        let tokens: Vec<u32> = (0..30).collect();
        let want: Vec<u64> = token_block_keys(&TenantKey::derive("acme", "s"), &tokens, 4)
            .iter()
            .map(|k| k.0)
            .collect();
        // The GPU holds the first two 4-token blocks (the pool's size, learned from them).
        let gpu = ing.apply(0, 0, &batch(vec![stored(&[1, 2], None, 0..8, Some("s"))]));
        assert_eq!(present(&gpu, Scope::Gpu(0)), want[..2]);
        // LMCache's 12-token chunks, the last one shorter: no extra keys, so the tenant is
        // the GPU chain's with the same first block; each chunk covers the whole blocks it
        // completes, the leftover tokens carried into the next.
        let c1 = ing.apply(0, 1, &batch(vec![chunk(100, None, 0..12)]));
        let c2 = ing.apply(0, 2, &batch(vec![chunk(101, Some(100), 12..24)]));
        let c3 = ing.apply(0, 3, &batch(vec![chunk(102, Some(101), 24..30)]));
        assert_eq!(present(&c1, Scope::L1), want[..3]);
        assert_eq!(present(&c2, Scope::L1), want[3..6]);
        assert_eq!(
            present(&c3, Scope::L1),
            want[6..7],
            "6 tokens: one whole block"
        );
        assert_eq!(c2[0].parent, Some(want[2]));
        // Unaligned chunks (6 tokens over 4-token blocks) straddle: the block is the
        // one's that completes it.
        let mut ing2 = Ingest::new(Tenants::Fixed("t".into()), 1);
        ing2.set_block_tokens(Some(4));
        let mut got = Vec::new();
        for (i, r) in [(0u64, 0..6), (1, 6..12), (2, 12..18)] {
            let c = chunk(200 + i, i.checked_sub(1).map(|p| 200 + p), r);
            let c = with(c, |e| {
                if let KvEvent::Stored { extra_keys, .. } = e {
                    *extra_keys = vec![vec!["x".into()]];
                }
            });
            got.extend(present(&ing2.apply(0, i, &batch(vec![c])), Scope::L1));
        }
        let whole = token_block_keys(
            &TenantKey::derive("t", "x"),
            &(0..18).collect::<Vec<_>>(),
            4,
        );
        assert_eq!(got, whole.iter().map(|k| k.0).collect::<Vec<_>>());
        // Removing the middle chunk removes the blocks it alone covered.
        let r = ing.apply(
            0,
            4,
            &batch(vec![KvEvent::Removed {
                block_hashes: vec![h(101)],
                medium: Some("cpu".into()),
            }]),
        );
        assert!(r.iter().all(|c| !c.present && c.scope == Scope::L1));
        assert_eq!(r.iter().map(|c| c.key).collect::<Vec<_>>(), want[3..6]);
        // Its node stays a while: a chunk stored after it again keys from it.
        let again = ing.apply(0, 5, &batch(vec![chunk(101, Some(100), 12..24)]));
        assert_eq!(present(&again, Scope::L1), want[3..6]);
    }

    /// What lmcache 0.5.6's own engine publishes (found by driving `LMCacheEngine.store`
    /// through vLLM 0.33's connector, tests/lmcache_e2e.rs): every chunk but a store's
    /// last carries the next chunk's first token too, and a store that starts after
    /// chunks LMCache holds names parent 0 for its first chunk.
    #[test]
    fn lmcaches_own_chunk_events_are_keyed() {
        let table = Tenants::Table(HashMap::from([("s".to_string(), "acme".to_string())]));
        let mut ing = Ingest::new(table, 1);
        let tokens: Vec<u32> = (0..36).collect();
        let want: Vec<u64> = token_block_keys(&TenantKey::derive("acme", "s"), &tokens, 4)
            .iter()
            .map(|k| k.0)
            .collect();
        // The GPU holds the whole prompt, in 4-token blocks (the pool's).
        let gpu_blocks: Vec<u64> = (1..=9).collect();
        let gpu = ing.apply(
            0,
            0,
            &batch(vec![stored(&gpu_blocks, None, 0..36, Some("s"))]),
        );
        assert_eq!(present(&gpu, Scope::Gpu(0)), want);
        // First store: chunks of 12 tokens, the first with 13 (its next chunk's first).
        let c1 = sized(chunk(100, None, 0..13), 12);
        let first = ing.apply(0, 1, &batch(vec![c1, chunk(101, Some(100), 12..24)]));
        assert_eq!(present(&first, Scope::L1), want[..6]);
        assert_eq!(ing.stats.malformed, 0);
        // A follow-up store of the chunk after them, under parent 0: its chain is the
        // GPU's that its tokens continue.
        let next = ing.apply(0, 2, &batch(vec![chunk(102, Some(0), 24..36)]));
        assert_eq!(present(&next, Scope::L1), want[6..9]);
        assert_eq!((ing.stats.parents_by_tokens, ing.stats.orphans), (1, 0));
        // Two more tokens than the chunk is malformed still; a parent 0 that no GPU
        // chain continues is an orphan.
        let bad = sized(chunk(103, None, 0..14), 12);
        assert!(ing.apply(0, 3, &batch(vec![bad])).is_empty());
        assert_eq!(ing.stats.malformed, 1);
        assert!(ing
            .apply(0, 4, &batch(vec![chunk(104, Some(0), 100..112)]))
            .is_empty());
        assert_eq!(ing.stats.orphans, 1);
    }

    #[test]
    fn a_chunk_two_tenants_gpu_chains_start_like_is_not_guessed() {
        let table = Tenants::Table(HashMap::from([
            ("sa".to_string(), "a".to_string()),
            ("sb".to_string(), "b".to_string()),
        ]));
        let mut ing = Ingest::new(table, 1);
        ing.apply(0, 0, &batch(vec![stored(&[1], None, 0..4, Some("sa"))]));
        assert_eq!(
            present(
                &ing.apply(0, 1, &batch(vec![chunk(9, None, 0..12)])),
                Scope::L1
            )
            .len(),
            3
        );
        ing.apply(0, 2, &batch(vec![stored(&[2], None, 0..4, Some("sb"))]));
        assert!(ing
            .apply(0, 3, &batch(vec![chunk(10, None, 0..12)]))
            .is_empty());
        assert_eq!(ing.stats.unresolved, 1);
    }

    #[test]
    fn one_pool_block_under_several_event_blocks_is_reported_once() {
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 2);
        ing.set_block_tokens(Some(4));
        let cpu = |hash| {
            with(stored(&[hash], None, 0..8, Some("s")), |e| {
                if let KvEvent::Stored {
                    medium, block_size, ..
                } = e
                {
                    *medium = Some("CPU".into());
                    *block_size = 8;
                }
            })
        };
        // Two engines' CPU chunks of the same tokens: the host's L1 holds two blocks once.
        assert_eq!(ing.apply(0, 0, &batch(vec![cpu(1)])).len(), 2);
        assert!(ing.apply(1, 0, &batch(vec![cpu(2)])).is_empty());
        let remove = |hash| KvEvent::Removed {
            block_hashes: vec![h(hash)],
            medium: Some("CPU".into()),
        };
        assert!(ing.apply(0, 1, &batch(vec![remove(1)])).is_empty());
        assert_eq!(ing.apply(1, 1, &batch(vec![remove(2)])).len(), 2);
    }

    #[test]
    fn cpu_announcements_are_counted_gpu_ones_are_not() {
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        ing.set_block_tokens(Some(4));
        let cpu = with(stored(&[1], None, 0..4, Some("s")), |e| {
            if let KvEvent::Stored { medium, .. } = e {
                *medium = Some("CPU".into());
            }
        });
        let removed = |medium: &str| KvEvent::Removed {
            block_hashes: vec![h(1)],
            medium: Some(medium.into()),
        };
        // vLLM's offloading announces a block shared by two chunks twice: it stays in L1
        // until both chunks are gone.
        assert_eq!(ing.apply(0, 0, &batch(vec![cpu.clone()])).len(), 1);
        assert!(ing.apply(0, 1, &batch(vec![cpu])).is_empty());
        assert!(ing.apply(0, 2, &batch(vec![removed("CPU")])).is_empty());
        assert_eq!(ing.apply(0, 3, &batch(vec![removed("CPU")])).len(), 1);
        // The GPU re-announces a reused block without a removal to match: one removal
        // ends it.
        let gpu = stored(&[1], None, 0..4, Some("s"));
        assert_eq!(ing.apply(0, 4, &batch(vec![gpu.clone()])).len(), 1);
        assert!(ing.apply(0, 5, &batch(vec![gpu])).is_empty());
        assert_eq!(ing.apply(0, 6, &batch(vec![removed("GPU")])).len(), 1);
        assert_eq!(ing.len(0), 0);
    }

    #[test]
    fn the_pools_block_size_must_be_known_and_placeholders_are_skipped() {
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        // A CPU chunk before any GPU block: no pool size yet, not reported.
        assert!(ing
            .apply(0, 0, &batch(vec![chunk(1, None, 0..12)]))
            .is_empty());
        assert_eq!(ing.stats.no_block_size, 1);
        // vLLM offloading's placeholder: block size 0, no tokens.
        let placeholder = with(chunk(2, None, 0..0), |e| {
            if let KvEvent::Stored { block_size, .. } = e {
                *block_size = 0;
            }
        });
        assert!(ing.apply(0, 1, &batch(vec![placeholder])).is_empty());
        assert_eq!(ing.stats.skipped, 1);
        assert_eq!(ing.stats.malformed, 0);
    }

    #[test]
    fn tokenless_offloaded_chunks_cover_the_gpu_blocks_they_end_with() {
        // vLLM 0.11's OffloadingConnector: a 12-token CPU chunk announced by the hash of
        // its last GPU block, without tokens or parent.
        let mut ing = Ingest::new(Tenants::Fixed("t".into()), 1);
        let gpu = ing.apply(
            0,
            0,
            &batch(vec![stored(&[1, 2, 3], None, 0..12, Some("s"))]),
        );
        let keys: Vec<u64> = gpu.iter().map(|c| c.key).collect();
        let offloaded = |hash: u64, size: u32| {
            with(chunk(hash, None, 0..0), |e| {
                if let KvEvent::Stored {
                    block_size, medium, ..
                } = e
                {
                    *block_size = size;
                    *medium = Some("CPU".into());
                }
            })
        };
        let c = ing.apply(0, 1, &batch(vec![offloaded(3, 12)]));
        assert_eq!(present(&c, Scope::L1), keys);
        // An 8-token chunk ending at block 2 covers blocks 1 and 2, already in L1.
        assert!(ing.apply(0, 2, &batch(vec![offloaded(2, 8)])).is_empty());
        // A chunk whose size does not end on known blocks, or names no known block, is
        // skipped.
        assert!(ing
            .apply(0, 3, &batch(vec![offloaded(1, 6), offloaded(77, 4)]))
            .is_empty());
        assert_eq!(ing.stats.skipped, 2);
        // Removing the 12-token chunk leaves what the 8-token one covers.
        let r = ing.apply(
            0,
            4,
            &batch(vec![KvEvent::Removed {
                block_hashes: vec![h(3)],
                medium: Some("CPU".into()),
            }]),
        );
        assert_eq!(r.len(), 1);
        assert!(!r[0].present && r[0].key == keys[2] && r[0].scope == Scope::L1);
    }

    #[test]
    fn lora_blocks_are_keyed_by_adapter() {
        let table = Tenants::Table(HashMap::from([("s".to_string(), "acme".to_string())]));
        let mut ing = Ingest::new(table, 1);
        let lora = |hashes: &[u64], parent, tokens, salt: Option<&str>| {
            with(stored(hashes, parent, tokens, None), |e| {
                if let KvEvent::Stored {
                    lora_name,
                    lora_id,
                    extra_keys,
                    ..
                } = e
                {
                    *lora_name = Some("sql-lora".into());
                    *lora_id = Some(1);
                    // vLLM: the LoRA name first, then the salt, on the first block.
                    *extra_keys = salt
                        .map(|s| vec![vec!["sql-lora".into(), s.into()]])
                        .unwrap_or_default();
                }
            })
        };
        let mut got = present(
            &ing.apply(0, 0, &batch(vec![lora(&[1, 2], None, 0..8, Some("s"))])),
            Scope::Gpu(0),
        );
        got.extend(present(
            &ing.apply(0, 1, &batch(vec![lora(&[3], Some(2), 8..12, None)])),
            Scope::Gpu(0),
        ));
        let tokens: Vec<u32> = (0..12).collect();
        let adapter = TenantKey::derive("acme", "s").for_adapter("sql-lora");
        let want = token_block_keys(&adapter, &tokens, 4);
        assert_eq!(got, want.iter().map(|k| k.0).collect::<Vec<_>>());
        // The base model's blocks of the same tokens are other blocks.
        let base = ing.apply(0, 2, &batch(vec![stored(&[9], None, 0..4, Some("s"))]));
        assert_ne!(base[0].key, want[0].0);
    }
}
