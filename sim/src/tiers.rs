//! The residency model of the cache tiers below the GPU.
//!
//! A [`TierSet`] stands for a host's L1 (CPU memory next to one engine) or the global L2
//! store shared by all hosts in a simulation: the cache-agent's own tier policy
//! ([`warmpath_tiers::Ledger`]) with every block one unit long and one layout, so that the
//! simulator evicts exactly as a live agent does. It only tracks *which* blocks are
//! resident; what a load costs is the cost model's business
//! (`warmpath_index::cost::ModelProfile::load_ms`). The GPU's own free list is a
//! [`warmpath_tiers::BlockLru`], held by the engine model.

use warmpath_index::keys::BlockKey;
use warmpath_tiers::{BlockId, Eviction, Ledger};

/// A tier's resident blocks under the cache-agent's policy, counted in blocks.
#[derive(Clone, Debug)]
pub struct TierSet {
    ledger: Ledger,
}

impl TierSet {
    /// An empty tier of `capacity_blocks` (0 holds nothing) evicting by `policy`.
    pub fn new(capacity_blocks: u64, policy: Eviction) -> Self {
        TierSet {
            ledger: Ledger::new(capacity_blocks, policy),
        }
    }

    /// An LRU tier: the agent's default.
    pub fn lru(capacity_blocks: u64) -> Self {
        Self::new(capacity_blocks, Eviction::Lru)
    }

    pub fn capacity(&self) -> u64 {
        self.ledger.capacity_bytes()
    }

    pub fn len(&self) -> usize {
        self.ledger.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ledger.is_empty()
    }

    pub fn contains(&self, key: BlockKey) -> bool {
        self.ledger.contains(&id(key))
    }

    /// Records a use; false when `key` is not held.
    pub fn touch(&mut self, key: BlockKey) -> bool {
        self.ledger.touch(&id(key))
    }

    /// Holds `key`, pushing what the policy evicted onto `evicted` (a disabled tier holds
    /// and evicts nothing).
    pub fn insert(&mut self, key: BlockKey, evicted: &mut Vec<BlockKey>) {
        let mut ids = Vec::new();
        let _ = self.ledger.insert(id(key), 1, false, &mut ids);
        evicted.extend(ids.into_iter().map(|i| i.key));
    }

    /// Keys in eviction order (O(len); for tests).
    pub fn keys_lru_first(&self) -> Vec<BlockKey> {
        self.ledger
            .eviction_order()
            .into_iter()
            .map(|i| i.key)
            .collect()
    }
}

fn id(key: BlockKey) -> BlockId {
    BlockId { layout: 0, key }
}
