//! A count-bounded set of block keys that evicts the least recently used: the engine
//! model's GPU free list of cached blocks (vLLM's free block queue), which its owner
//! evicts on demand with [`BlockLru::pop_lru`], and the pooled-cache bound of the
//! simulator's reports. Not a tier policy: a tier is a [`Ledger`](crate::Ledger).
//!
//! O(1) per operation: a `HashMap` from key to slot for lookups (never iterated) and one
//! recency [`List`] through a [`Slab`], front the most recently used.

use std::collections::HashMap;

use crate::list::{List, Slab};
use warmpath_index::keys::BlockKey;

/// A bounded set of block keys that evicts the least recently used key when full.
#[derive(Clone, Debug)]
pub struct BlockLru {
    /// Most keys held at once: 0 holds nothing, `u64::MAX` is unbounded.
    capacity: u64,
    /// Key to its slot in `keys`: lookups only, never iterated.
    slots: HashMap<BlockKey, usize>,
    /// The held keys.
    keys: Slab<BlockKey>,
    /// Recency: the front most recently used, the back next to evict.
    recency: List,
}

impl BlockLru {
    /// An empty set holding at most `capacity_blocks` keys (0 = disabled, `u64::MAX` =
    /// unbounded).
    pub fn new(capacity_blocks: u64) -> Self {
        BlockLru {
            capacity: capacity_blocks,
            slots: HashMap::new(),
            keys: Slab::new(),
            recency: List::new(),
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
                self.keys.move_to_front(&mut self.recency, slot);
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
        let slot = self.keys.alloc(key);
        self.slots.insert(key, slot);
        self.keys.push_front(&mut self.recency, slot);
    }

    /// Removes `key`; false when it was not held.
    pub fn remove(&mut self, key: BlockKey) -> bool {
        match self.slots.remove(&key) {
            Some(slot) => {
                self.keys.unlink(&mut self.recency, slot);
                self.keys.free(slot);
                true
            }
            None => false,
        }
    }

    /// The least recently used key (the next to be evicted), if any.
    pub fn lru(&self) -> Option<BlockKey> {
        self.recency.back().map(|slot| *self.keys.get(slot))
    }

    /// Removes and returns the least recently used key, if any.
    pub fn pop_lru(&mut self) -> Option<BlockKey> {
        let key = self.lru()?;
        self.remove(key);
        Some(key)
    }

    /// Keys from least to most recently used (O(len); for tests and debugging).
    pub fn keys_lru_first(&self) -> Vec<BlockKey> {
        self.keys
            .iter_back_to_front(&self.recency)
            .map(|(_, &key)| key)
            .collect()
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

    /// The free list and the ledger under LRU with one-unit blocks are one LRU: the same
    /// inserts and touches evict the same keys in the same order.
    #[test]
    fn agrees_with_the_ledgers_lru() {
        use crate::{BlockId, Eviction, Ledger};
        let mut lru = BlockLru::new(5);
        let mut ledger = Ledger::new(5, Eviction::Lru);
        let mut state = 7u64;
        for _ in 0..2000 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = BlockKey((state >> 33) % 12);
            let id = BlockId { layout: 0, key };
            if (state >> 20).is_multiple_of(3) {
                assert_eq!(lru.touch(key), ledger.touch(&id));
            } else {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                lru.insert(key, &mut a);
                ledger.insert(id, 1, false, &mut b).unwrap();
                assert_eq!(a, b.iter().map(|i| i.key).collect::<Vec<_>>());
            }
            let order: Vec<BlockKey> = ledger.eviction_order().iter().map(|i| i.key).collect();
            assert_eq!(lru.keys_lru_first(), order);
        }
    }
}
