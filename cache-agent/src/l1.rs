//! L1: a host's block payloads in memory, bounded in bytes by the tier policy's ledger.
//!
//! The store owns one allocation per block (the block API reads each payload of a frame
//! into a buffer of its own, from `pool`), so a block's bytes are what the ledger counts
//! and evicting it frees them (back to the pool, for the next put); a get hands out a reference-counted view, so an eviction during a send frees
//! the bytes only after the send. The bound is the ledger's: `used_bytes` never exceeds the
//! capacity, and the map holds exactly the ledger's blocks.
//!
//! Pure and synchronous: the agent wraps it in a mutex; nothing here blocks or allocates
//! beyond the payload copies.

use std::collections::HashMap;

use bytes::Bytes;

use crate::block::Block;
use warmpath_tiers::{BlockId, Eviction, LeaseId, Ledger, LedgerStats, Owner, Refused};

/// The L1 store.
#[derive(Debug)]
pub struct L1 {
    ledger: Ledger,
    blocks: HashMap<BlockId, Block>,
}

/// Blocks an insert evicted, with their payloads (for write-on-evict to L2).
pub type Evicted = Vec<(BlockId, Block)>;

/// Why [`L1::put_for`] did not store a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutError {
    /// The tier's own refusal.
    Tier(Refused),
    /// The key is held with other bytes: the first bytes stay.
    Conflict,
    /// Pinning it would take the pinned blocks past their cap.
    PinCap,
}

impl L1 {
    pub fn new(capacity_bytes: u64, policy: Eviction) -> Self {
        L1 {
            ledger: Ledger::new(capacity_bytes, policy),
            blocks: HashMap::new(),
        }
    }

    /// Stores `block` under `id`, pinned if `pin`; evicted blocks are appended to `evicted`.
    /// A block already held is refreshed (its payload kept: same id, same bytes).
    pub fn put(
        &mut self,
        id: BlockId,
        block: Block,
        pin: bool,
        evicted: &mut Evicted,
    ) -> Result<(), Refused> {
        let mut ids = Vec::new();
        let result = self
            .ledger
            .insert(id, block.payload.len() as u64, pin, &mut ids);
        for old in ids {
            if let Some(b) = self.blocks.remove(&old) {
                evicted.push((old, b));
            }
        }
        result?;
        self.blocks.entry(id).or_insert(block);
        Ok(())
    }

    /// An engine's put: [`L1::put`], except that a key held with other bytes is a
    /// [`PutError::Conflict`] (the held bytes stay, untouched), and a pin is `owner`'s and
    /// refused when the pinned bytes would pass `pin_cap`.
    pub fn put_for(
        &mut self,
        id: BlockId,
        block: Block,
        pin: Option<Owner>,
        pin_cap: u64,
        evicted: &mut Evicted,
    ) -> Result<(), PutError> {
        if let Some(held) = self.blocks.get(&id) {
            if held.checksum != block.checksum || held.payload != block.payload {
                return Err(PutError::Conflict);
            }
        }
        if pin.is_some()
            && !self.ledger.is_pinned(&id)
            && self.ledger.pinned_bytes() + block.payload.len() as u64 > pin_cap
        {
            return Err(PutError::PinCap);
        }
        let mut ids = Vec::new();
        let result = self
            .ledger
            .insert_for(id, block.payload.len() as u64, pin, &mut ids);
        for old in ids {
            if let Some(b) = self.blocks.remove(&old) {
                evicted.push((old, b));
            }
        }
        result.map_err(PutError::Tier)?;
        self.blocks.entry(id).or_insert(block);
        Ok(())
    }

    /// (pins, leases) `owner` holds.
    pub fn holds_of(&self, owner: Owner) -> (usize, usize) {
        self.ledger.holds_of(owner)
    }

    /// Ends `owner`'s pins and leases; (pins, leases) ended.
    pub fn release_owner(&mut self, owner: Owner) -> (usize, usize) {
        self.ledger.release_owner(owner)
    }

    pub fn lease_for(
        &mut self,
        ids: &[BlockId],
        now_us: u64,
        ttl_us: u64,
        owner: Owner,
    ) -> LeaseId {
        self.ledger.lease_for(ids, now_us, ttl_us, owner)
    }

    pub fn lease_owner(&self, lease: LeaseId) -> Option<Owner> {
        self.ledger.lease_owner(lease)
    }

    pub fn unpin_for(&mut self, id: &BlockId, owner: Owner) -> bool {
        self.ledger.unpin_for(id, owner)
    }

    /// The block under `id`, touched; None when not held.
    pub fn get(&mut self, id: &BlockId) -> Option<Block> {
        let b = self.blocks.get(id)?.clone();
        self.ledger.touch(id);
        Some(b)
    }

    pub fn contains(&self, id: &BlockId) -> bool {
        self.blocks.contains_key(id)
    }

    /// Touches a chain's held blocks, last first.
    pub fn touch_chain(&mut self, ids: &[BlockId]) {
        self.ledger.touch_chain(ids);
    }

    pub fn lease(&mut self, ids: &[BlockId], now_us: u64, ttl_us: u64) -> LeaseId {
        self.ledger.lease(ids, now_us, ttl_us)
    }

    pub fn release(&mut self, lease: LeaseId) -> Option<usize> {
        self.ledger.release(lease)
    }

    pub fn expire(&mut self, now_us: u64) -> usize {
        self.ledger.expire(now_us)
    }

    pub fn unpin(&mut self, id: &BlockId) -> bool {
        self.ledger.unpin(id)
    }

    /// Drops a block unless it is held.
    pub fn remove(&mut self, id: &BlockId) -> bool {
        let dropped = self.ledger.remove(id);
        if dropped {
            self.blocks.remove(id);
        }
        dropped
    }

    pub fn stats(&self) -> LedgerStats {
        self.ledger.stats()
    }

    /// Bytes of the payloads held (equal to the ledger's count; checked by the tests).
    pub fn payload_bytes(&self) -> u64 {
        self.blocks.values().map(|b| b.payload.len() as u64).sum()
    }
}

/// A payload copied into its own allocation, with its checksum.
pub fn own(payload: &[u8]) -> Block {
    Block::new(Bytes::copy_from_slice(payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn evictions_hand_back_payloads() {
        let mut l1 = L1::new(10, Eviction::Lru);
        let mut ev = Vec::new();
        l1.put(BlockId::new(1, 1), own(b"aaaa"), false, &mut ev)
            .unwrap();
        l1.put(BlockId::new(1, 2), own(b"bbbb"), false, &mut ev)
            .unwrap();
        l1.put(BlockId::new(1, 3), own(b"cccc"), false, &mut ev)
            .unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].0, BlockId::new(1, 1));
        assert_eq!(&ev[0].1.payload[..], b"aaaa");
        assert!(l1.get(&BlockId::new(1, 1)).is_none());
        assert_eq!(&l1.get(&BlockId::new(1, 2)).unwrap().payload[..], b"bbbb");
        assert_eq!(l1.payload_bytes(), l1.stats().bytes);
    }

    /// L1 never exceeds its byte bound under concurrent puts: threads put blocks of random
    /// sizes (some pinned, some leased) while the bound and the accounting are checked
    /// after every operation, under the same lock the agent uses.
    #[test]
    fn the_bound_holds_under_concurrent_puts() {
        use proptest::test_runner::{Config, TestRunner};
        let mut runner = TestRunner::new(Config {
            cases: 16,
            ..Config::default()
        });
        runner
            .run(
                &(1u64..64, proptest::collection::vec(1usize..600, 40..120)),
                |(seed, sizes)| {
                    let capacity = 4096;
                    let l1 = Arc::new(Mutex::new(L1::new(
                        capacity,
                        if seed.is_multiple_of(2) {
                            Eviction::Lru
                        } else {
                            Eviction::S3Fifo
                        },
                    )));
                    let sizes = Arc::new(sizes);
                    let threads: Vec<_> = (0..4u64)
                        .map(|t| {
                            let (l1, sizes) = (l1.clone(), sizes.clone());
                            std::thread::spawn(move || {
                                for (i, &size) in sizes.iter().enumerate() {
                                    let id = BlockId::new(1, (t << 32) | (i as u64 % 50));
                                    let mut l = l1.lock().unwrap();
                                    let mut ev = Vec::new();
                                    let pin = (i as u64 + seed).is_multiple_of(17);
                                    let _ = l.put(id, own(&vec![t as u8; size]), pin, &mut ev);
                                    if i.is_multiple_of(5) {
                                        l.lease(&[id], i as u64, 3);
                                    }
                                    l.expire(i as u64);
                                    if i.is_multiple_of(7) {
                                        l.unpin(&id);
                                    }
                                    let s = l.stats();
                                    assert!(s.bytes <= capacity, "{} > {capacity}", s.bytes);
                                    assert_eq!(l.payload_bytes(), s.bytes);
                                    assert_eq!(l.blocks.len() as u64, s.blocks);
                                }
                            })
                        })
                        .collect();
                    for t in threads {
                        t.join().expect("a putting thread failed");
                    }
                    Ok(())
                },
            )
            .unwrap();
    }
}
