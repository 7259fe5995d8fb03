//! L1: a host's block payloads in memory, bounded in bytes by the tier policy's ledger.
//!
//! The store owns one allocation per block (the block API reads each payload of a frame
//! into a buffer of its own, from `pool`), or one sealed memfd an engine wrote and passed
//! (`sealed.rs`), so a block's bytes are what the ledger counts and evicting it frees them
//! (back to the pool, for the next put; a memfd's pages when the last descriptor closes);
//! a get hands out a reference-counted view, so an eviction during a send frees the bytes
//! only after the send. The bound is the ledger's: `used_bytes` never exceeds the
//! capacity, and the map holds exactly the ledger's blocks.
//!
//! Pure and synchronous: the agent wraps it in a mutex; nothing here blocks or allocates
//! beyond the payload copies.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use crate::block::Block;
use crate::pool::BufPool;
use crate::sealed::Sealed;
use warmpath_tiers::{BlockId, Eviction, LeaseId, Ledger, LedgerStats, Owner, Refused};

/// A block as L1 holds it: in the agent's memory, or in a sealed memfd an engine wrote.
#[derive(Clone, Debug)]
pub enum Stored {
    Memory(Block),
    Sealed(Arc<Sealed>),
}

impl Stored {
    pub fn len(&self) -> usize {
        match self {
            Stored::Memory(b) => b.payload.len(),
            Stored::Sealed(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The checksum, where known (a sealed block's is taken when first needed).
    pub fn known_checksum(&self) -> Option<u64> {
        match self {
            Stored::Memory(b) => Some(b.checksum),
            Stored::Sealed(s) => s.known_checksum(),
        }
    }

    /// The bytes in memory: a sealed block read once into a buffer from `pool` (a copy)
    /// with its checksum (taken now if it was not; refused if it no longer matches).
    pub fn to_block(&self, pool: &BufPool) -> std::io::Result<Block> {
        match self {
            Stored::Memory(b) => Ok(b.clone()),
            Stored::Sealed(s) => {
                let (payload, checksum) = s.read_checked(pool)?;
                Ok(Block { payload, checksum })
            }
        }
    }

    /// Whether a second put of the key brings the same bytes: equal lengths, and equal
    /// checksums and bytes where both are in memory. A sealed block is never read under the
    /// L1 lock: its checksum is compared where known (the agent takes both before a put of a
    /// held key, [`crate::agent`]), and where not (a put racing the first one) the held
    /// bytes stay either way and the put counts as a refresh.
    fn same_as(&self, other: &Stored) -> bool {
        if self.len() != other.len() {
            return false;
        }
        match (self, other) {
            (Stored::Memory(a), Stored::Memory(b)) => {
                a.checksum == b.checksum && a.payload == b.payload
            }
            _ => match (self.known_checksum(), other.known_checksum()) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            },
        }
    }
}

impl From<Block> for Stored {
    fn from(b: Block) -> Self {
        Stored::Memory(b)
    }
}

/// The L1 store.
#[derive(Debug)]
pub struct L1 {
    ledger: Ledger,
    blocks: HashMap<BlockId, Stored>,
    sealed: usize,
}

/// Blocks an insert evicted, with their payloads (for write-on-evict to L2).
pub type Evicted = Vec<(BlockId, Stored)>;

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
            sealed: 0,
        }
    }

    /// Stores `block` under `id`, pinned if `pin`; evicted blocks are appended to `evicted`.
    /// A block already held is refreshed (its payload kept: same id, same bytes).
    pub fn put(
        &mut self,
        id: BlockId,
        block: impl Into<Stored>,
        pin: bool,
        evicted: &mut Evicted,
    ) -> Result<(), Refused> {
        let block = block.into();
        let mut ids = Vec::new();
        let result = self.ledger.insert(id, block.len() as u64, pin, &mut ids);
        self.drop_evicted(ids, evicted);
        result?;
        self.hold(id, block);
        Ok(())
    }

    fn drop_evicted(&mut self, ids: Vec<BlockId>, evicted: &mut Evicted) {
        for old in ids {
            if let Some(b) = self.blocks.remove(&old) {
                if matches!(b, Stored::Sealed(_)) {
                    self.sealed -= 1;
                }
                evicted.push((old, b));
            }
        }
    }

    fn hold(&mut self, id: BlockId, block: Stored) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.blocks.entry(id) {
            if matches!(block, Stored::Sealed(_)) {
                self.sealed += 1;
            }
            e.insert(block);
        }
    }

    /// Sealed memfds held (each an open descriptor of the agent's).
    pub fn sealed_blocks(&self) -> usize {
        self.sealed
    }

    /// An engine's put: [`L1::put`], except that a key held with other bytes is a
    /// [`PutError::Conflict`] (the held bytes stay, untouched), and a pin is `owner`'s and
    /// refused when the pinned bytes would pass `pin_cap`.
    pub fn put_for(
        &mut self,
        id: BlockId,
        block: Stored,
        pin: Option<Owner>,
        pin_cap: u64,
        evicted: &mut Evicted,
    ) -> Result<(), PutError> {
        if let Some(held) = self.blocks.get(&id) {
            if !held.same_as(&block) {
                return Err(PutError::Conflict);
            }
        }
        if pin.is_some()
            && !self.ledger.is_pinned(&id)
            && self.ledger.pinned_bytes() + block.len() as u64 > pin_cap
        {
            return Err(PutError::PinCap);
        }
        let mut ids = Vec::new();
        let result = self
            .ledger
            .insert_for(id, block.len() as u64, pin, &mut ids);
        self.drop_evicted(ids, evicted);
        result.map_err(PutError::Tier)?;
        self.hold(id, block);
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

    /// The block under `id`, untouched; None when not held.
    pub fn peek(&self, id: &BlockId) -> Option<Stored> {
        self.blocks.get(id).cloned()
    }

    /// The block under `id`, touched; None when not held.
    pub fn get(&mut self, id: &BlockId) -> Option<Stored> {
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
        if dropped && matches!(self.blocks.remove(id), Some(Stored::Sealed(_))) {
            self.sealed -= 1;
        }
        dropped
    }

    pub fn stats(&self) -> LedgerStats {
        self.ledger.stats()
    }

    /// Bytes of the payloads held (equal to the ledger's count; checked by the tests).
    pub fn payload_bytes(&self) -> u64 {
        self.blocks.values().map(|b| b.len() as u64).sum()
    }
}

/// A payload copied into its own allocation, with its checksum.
pub fn own(payload: &[u8]) -> Block {
    Block::new(Bytes::copy_from_slice(payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn mem(s: &Stored) -> &[u8] {
        match s {
            Stored::Memory(b) => &b.payload,
            Stored::Sealed(_) => panic!("a block in memory"),
        }
    }

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
        assert_eq!(mem(&ev[0].1), b"aaaa");
        assert!(l1.get(&BlockId::new(1, 1)).is_none());
        assert_eq!(mem(&l1.get(&BlockId::new(1, 2)).unwrap()), b"bbbb");
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
