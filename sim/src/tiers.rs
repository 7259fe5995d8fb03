//! The residency model of the cache tiers below the GPU, and the GPU's own free list.
//!
//! A [`TierSet`] stands for a host's L1 (CPU memory next to one engine) or the global L2
//! store shared by all hosts in a simulation: the cache-agent's own tier policy
//! (`warmpath_cache_agent::policy::Ledger`) with every block one unit long, so that the
//! simulator evicts exactly as a live agent does. It only tracks *which* blocks are
//! resident; what a load costs is the cost model's business
//! (`warmpath_index::cost::ModelProfile::load_ms`).
//!
//! A [`BlockLru`] is the engine model's unbounded GPU free list of cached blocks, evicting
//! with [`BlockLru::pop_lru`] (vLLM's free block queue, not a tier policy).
//!
//! Every operation is O(1): a `HashMap` from key to slot for lookups, and a doubly linked
//! list threaded through a `Vec` slab by index (no `unsafe`, no pointer juggling). The map
//! is never iterated, so hash order never leaks into results.

use std::collections::HashMap;

use warmpath_cache_agent::policy::{BlockId, Eviction, Ledger};
use warmpath_index::keys::BlockKey;

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

/// Slab index meaning "no slot".
const NIL: usize = usize::MAX;

#[derive(Clone, Debug)]
struct Node {
    key: BlockKey,
    /// Towards the most recently used end.
    newer: usize,
    /// Towards the least recently used end.
    older: usize,
}

/// A bounded set of block keys that evicts the least recently used key when full.
#[derive(Clone, Debug)]
pub struct BlockLru {
    /// Most keys held at once: 0 holds nothing, `u64::MAX` is unbounded.
    capacity: u64,
    /// Key to its slot in `nodes`: lookups only, never iterated.
    slots: HashMap<BlockKey, usize>,
    /// Slab of list nodes; slots listed in `vacant` are unused.
    nodes: Vec<Node>,
    /// Unused slots of `nodes`, reused before the slab grows.
    vacant: Vec<usize>,
    /// Most recently used slot, or NIL when empty.
    newest: usize,
    /// Least recently used slot (next to evict), or NIL when empty.
    oldest: usize,
}

impl BlockLru {
    /// An empty set holding at most `capacity_blocks` keys (0 = disabled, `u64::MAX` =
    /// unbounded).
    pub fn new(capacity_blocks: u64) -> Self {
        BlockLru {
            capacity: capacity_blocks,
            slots: HashMap::new(),
            nodes: Vec::new(),
            vacant: Vec::new(),
            newest: NIL,
            oldest: NIL,
        }
    }

    /// Most keys held at once.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, key: BlockKey) -> bool {
        self.slots.contains_key(&key)
    }

    /// Marks `key` most recently used; false (and no change) when it is not held.
    pub fn touch(&mut self, key: BlockKey) -> bool {
        match self.slots.get(&key) {
            Some(&slot) => {
                self.unlink(slot);
                self.link_newest(slot);
                true
            }
            None => false,
        }
    }

    /// Inserts `key` as most recently used (or refreshes it when already held), pushing onto
    /// `evicted` the least recently used keys it displaced, oldest first. With capacity 0 it
    /// does nothing: a disabled tier holds nothing and so evicts nothing.
    pub fn insert(&mut self, key: BlockKey, evicted: &mut Vec<BlockKey>) {
        if self.touch(key) || self.capacity == 0 {
            return;
        }
        while self.slots.len() as u64 >= self.capacity {
            match self.pop_lru() {
                Some(old) => evicted.push(old),
                None => break,
            }
        }
        let node = Node {
            key,
            newer: NIL,
            older: NIL,
        };
        let slot = match self.vacant.pop() {
            Some(slot) => {
                self.nodes[slot] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.slots.insert(key, slot);
        self.link_newest(slot);
    }

    /// Removes `key`; false when it was not held.
    pub fn remove(&mut self, key: BlockKey) -> bool {
        match self.slots.remove(&key) {
            Some(slot) => {
                self.unlink(slot);
                self.vacant.push(slot);
                true
            }
            None => false,
        }
    }

    /// The least recently used key (the next to be evicted), if any.
    pub fn lru(&self) -> Option<BlockKey> {
        (self.oldest != NIL).then(|| self.nodes[self.oldest].key)
    }

    /// Removes and returns the least recently used key, if any.
    pub fn pop_lru(&mut self) -> Option<BlockKey> {
        let key = self.lru()?;
        self.remove(key);
        Some(key)
    }

    /// Detaches `slot` from the recency list (it stays in `slots`).
    fn unlink(&mut self, slot: usize) {
        let Node { newer, older, .. } = self.nodes[slot];
        if newer == NIL {
            self.newest = older;
        } else {
            self.nodes[newer].older = older;
        }
        if older == NIL {
            self.oldest = newer;
        } else {
            self.nodes[older].newer = newer;
        }
        self.nodes[slot].newer = NIL;
        self.nodes[slot].older = NIL;
    }

    /// Attaches a detached `slot` at the most recently used end.
    fn link_newest(&mut self, slot: usize) {
        self.nodes[slot].older = self.newest;
        self.nodes[slot].newer = NIL;
        if self.newest == NIL {
            self.oldest = slot;
        } else {
            self.nodes[self.newest].newer = slot;
        }
        self.newest = slot;
    }

    /// Keys from least to most recently used (O(len); for tests and debugging).
    pub fn keys_lru_first(&self) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(self.len());
        let mut slot = self.oldest;
        while slot != NIL {
            out.push(self.nodes[slot].key);
            slot = self.nodes[slot].newer;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One operation of a script; keys are small integers.
    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// Insert; expect these keys evicted, oldest first.
        Ins(u64, &'static [u64]),
        /// Touch; expect whether it was held.
        Touch(u64, bool),
        /// Remove; expect whether it was held.
        Rm(u64, bool),
        /// Pop the LRU key; expect it.
        Pop(Option<u64>),
    }
    use Op::*;

    /// Runs `ops` on a set of `capacity` and checks its final contents, LRU first.
    fn check(capacity: u64, ops: &[Op], want_lru_first: &[u64]) {
        let mut lru = BlockLru::new(capacity);
        for (i, op) in ops.iter().enumerate() {
            let mut evicted = Vec::new();
            match *op {
                Ins(k, want) => {
                    lru.insert(BlockKey(k), &mut evicted);
                    let want: Vec<BlockKey> = want.iter().map(|&k| BlockKey(k)).collect();
                    assert_eq!(evicted, want, "op {i}: {op:?}");
                }
                Touch(k, want) => assert_eq!(lru.touch(BlockKey(k)), want, "op {i}: {op:?}"),
                Rm(k, want) => assert_eq!(lru.remove(BlockKey(k)), want, "op {i}: {op:?}"),
                Pop(want) => assert_eq!(lru.pop_lru(), want.map(BlockKey), "op {i}: {op:?}"),
            }
            assert!(lru.len() as u64 <= capacity, "op {i}: over capacity");
            assert_eq!(
                lru.keys_lru_first().len(),
                lru.len(),
                "op {i}: list and map disagree"
            );
        }
        let got: Vec<u64> = lru.keys_lru_first().iter().map(|k| k.0).collect();
        assert_eq!(got, want_lru_first);
        for &k in want_lru_first {
            assert!(lru.contains(BlockKey(k)));
        }
        assert_eq!(lru.is_empty(), want_lru_first.is_empty());
        assert_eq!(lru.lru().map(|k| k.0), want_lru_first.first().copied());
    }

    #[test]
    fn evicts_least_recently_used() {
        check(2, &[Ins(1, &[]), Ins(2, &[]), Ins(3, &[1])], &[2, 3]);
        // A touch saves 1 and dooms 2.
        check(
            2,
            &[Ins(1, &[]), Ins(2, &[]), Touch(1, true), Ins(3, &[2])],
            &[1, 3],
        );
        // Re-inserting refreshes without evicting.
        check(
            2,
            &[Ins(1, &[]), Ins(2, &[]), Ins(1, &[]), Ins(3, &[2])],
            &[1, 3],
        );
        check(1, &[Ins(1, &[]), Ins(2, &[1]), Ins(3, &[2])], &[3]);
        check(
            3,
            &[
                Ins(1, &[]),
                Ins(2, &[]),
                Ins(3, &[]),
                Touch(2, true),
                Ins(4, &[1]),
            ],
            &[3, 2, 4],
        );
    }

    #[test]
    fn disabled_holds_nothing() {
        check(
            0,
            &[Ins(1, &[]), Touch(1, false), Rm(1, false), Pop(None)],
            &[],
        );
    }

    #[test]
    fn unbounded_never_evicts() {
        let ops: Vec<Op> = (0..1000).map(|k| Ins(k, &[])).collect();
        let want: Vec<u64> = (0..1000).collect();
        check(u64::MAX, &ops, &want);
    }

    #[test]
    fn remove_and_pop_relink() {
        // Removing the middle, the newest and the oldest keeps the list whole.
        let fill = [Ins(1, &[]), Ins(2, &[]), Ins(3, &[]), Ins(4, &[])];
        check(
            4,
            &[&fill[..], &[Rm(2, true), Rm(2, false)]].concat(),
            &[1, 3, 4],
        );
        check(
            4,
            &[&fill[..], &[Rm(4, true), Ins(5, &[])]].concat(),
            &[1, 2, 3, 5],
        );
        check(
            4,
            &[&fill[..], &[Pop(Some(1)), Pop(Some(2)), Ins(6, &[])]].concat(),
            &[3, 4, 6],
        );
        check(
            4,
            &[
                &fill[..],
                &[
                    Pop(Some(1)),
                    Pop(Some(2)),
                    Pop(Some(3)),
                    Pop(Some(4)),
                    Pop(None),
                ],
            ]
            .concat(),
            &[],
        );
        // Freed slots are reused and still evict in order.
        check(
            2,
            &[
                Ins(1, &[]),
                Rm(1, true),
                Ins(2, &[]),
                Ins(3, &[]),
                Ins(4, &[2]),
            ],
            &[3, 4],
        );
        check(
            2,
            &[Touch(9, false), Ins(1, &[]), Touch(1, true), Touch(1, true)],
            &[1],
        );
    }
}
