//! The tier policy: which blocks a byte-bounded tier holds, which it evicts, and which it
//! must keep (pinned or leased).
//!
//! A [`Ledger`] tracks block ids and their sizes, never their bytes: the agent's L1 and L2
//! keep the payloads beside it, the simulator keeps nothing else. Its queues are lists
//! through one [`Slab`](crate::list::Slab). Two eviction policies:
//!
//! - [`Eviction::Lru`]: least recently used first.
//! - [`Eviction::S3Fifo`]: S3-FIFO (Yang et al., SOSP 2023), scan-resistant. New blocks enter
//!   a small FIFO queue (a tenth of the bytes); a block used again before it leaves the small
//!   queue moves to the main queue, one that is not leaves and its id is remembered in a
//!   ghost list; a block that returns while remembered enters the main queue directly. The
//!   main queue is a FIFO with up to three second chances per block (a use adds one, a pass
//!   of the eviction hand takes one). A scan of blocks used once goes through the small
//!   queue without displacing the main queue's working set.
//!
//! A block with a hold (a pin, or one or more leases) is never evicted: the eviction hand
//! moves it back to the front of its queue and goes on. When the held blocks leave no room
//! for an insert, it is refused ([`Refused::Full`]) before anything is evicted; the bound is
//! never exceeded.
//!
//! Prefix order: a prefix's later blocks must go before its earlier ones, because a later
//! block is worthless without the blocks before it. The ledger knows no chains; callers
//! insert and touch a chain's blocks last block first ([`Ledger::insert_chain`],
//! [`Ledger::touch_chain`]), so that within a chain the first block is the most recently
//! used (LRU) or the last to leave a FIFO (S3-FIFO).
//!
//! Owners: a pin or a lease may name its owner (a plain id: the agent's block API gives each
//! connection one). [`Ledger::release_owner`] ends every pin and lease of an owner at once,
//! so holds end with the connection that took them; [`Ledger::holds_of`] counts them, for
//! per-owner quotas; [`Ledger::pinned_bytes`] is what a cap on the pinned share of the tier
//! reads. Owner 0 is nobody's: [`Ledger::insert`] and [`Ledger::lease`] hold for it.
//!
//! Pure: time is passed in (microseconds) and only leases read it. Every operation is O(1)
//! apart from an eviction's walk over held blocks and [`Ledger::expire`]'s over the leases
//! that expired.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use rustc_hash::FxHashMap;

use crate::list::{List, Slab};
use serde::{Deserialize, Serialize};
use warmpath_index::keys::BlockKey;

/// A block as the tiers address it: a layout (model, dtype, block size, parallelism: the
/// engine's choice of what a block's bytes mean) and the warmpath block key of its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId {
    pub layout: u64,
    pub key: BlockKey,
}

impl BlockId {
    pub fn new(layout: u64, key: u64) -> Self {
        BlockId {
            layout,
            key: BlockKey(key),
        }
    }
}

/// Which block a full tier evicts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Eviction {
    /// Least recently used first.
    #[default]
    Lru,
    /// S3-FIFO: a small probationary FIFO, a main FIFO with second chances, a ghost list.
    #[serde(rename = "s3fifo")]
    S3Fifo,
}

impl std::str::FromStr for Eviction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(Eviction::Lru),
            "s3fifo" | "s3-fifo" => Ok(Eviction::S3Fifo),
            other => Err(format!("unknown eviction policy {other:?}: lru or s3fifo")),
        }
    }
}

/// Why an insert was refused; the ledger is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The block is larger than the whole tier.
    #[error("block of {bytes} bytes is larger than the tier ({capacity} bytes)")]
    TooLarge { bytes: u64, capacity: u64 },
    /// Pinned and leased blocks fill the tier: nothing may be evicted to make room.
    #[error("tier full of pinned or leased blocks")]
    Full,
}

/// A lease's handle.
pub type LeaseId = u64;

/// Who holds a pin or a lease (0: nobody in particular).
pub type Owner = u64;

/// An owner's pins and leases.
#[derive(Clone, Debug, Default)]
struct Holds {
    /// Ordered sets: [`Ledger::release_owner`] walks them, and hash order must not leak.
    pins: BTreeSet<BlockId>,
    leases: BTreeSet<LeaseId>,
}

/// The queues: LRU keeps everything in MAIN; S3-FIFO uses both.
const SMALL: usize = 0;
const MAIN: usize = 1;
/// S3-FIFO's use counter saturates here.
const MAX_FREQ: u8 = 3;

/// A held block, in its slot of the slab.
#[derive(Clone, Debug)]
struct Node {
    id: BlockId,
    bytes: u64,
    /// The queue (SMALL or MAIN) whose list holds this slot.
    queue: usize,
    /// Uses since insertion (S3-FIFO), saturating at MAX_FREQ.
    freq: u8,
    pinned: bool,
    /// Who pinned it (0 when unpinned or pinned for nobody in particular).
    pin_owner: Owner,
    /// Leases holding this block.
    leases: u32,
}

impl Node {
    fn held(&self) -> bool {
        self.pinned || self.leases > 0
    }
}

#[derive(Clone, Debug)]
struct Lease {
    blocks: Vec<BlockId>,
    expires_us: u64,
    owner: Owner,
}

/// Occupancy and holds, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerStats {
    pub blocks: u64,
    pub bytes: u64,
    pub capacity_bytes: u64,
    pub pinned_blocks: u64,
    pub leased_blocks: u64,
    pub leases: u64,
}

/// The residency ledger of one byte-bounded tier.
#[derive(Clone, Debug)]
pub struct Ledger {
    capacity: u64,
    policy: Eviction,
    /// Block to its slot in `nodes`: lookups only, never iterated.
    slots: HashMap<BlockId, usize>,
    /// Every held block; `queues` thread through it.
    nodes: Slab<Node>,
    /// The small and main queues, front (newest) to back (next to evict).
    queues: [List; 2],
    /// Bytes of the blocks on each queue.
    queue_bytes: [u64; 2],
    /// S3-FIFO's ghost list: ids recently evicted from the small queue, oldest first,
    /// bounded in count by the number of blocks held.
    ghost: VecDeque<BlockId>,
    ghost_set: HashSet<BlockId>,
    /// By lease id. Ids are the ledger's own (a counter), never a client's choice, so a fast
    /// unkeyed hash is safe here; block ids come from clients and keep the keyed default.
    leases: FxHashMap<LeaseId, Lease>,
    /// Expiry time to the leases expiring then, for `expire`.
    expiries: BTreeMap<(u64, LeaseId), ()>,
    next_lease: LeaseId,
    pinned: u64,
    leased: u64,
    /// Blocks pinned or leased, and their bytes: what eviction cannot touch.
    held: u64,
    held_bytes: u64,
    /// Bytes of the pinned blocks.
    pinned_bytes: u64,
    /// Each owner's pins and leases (owner 0's are not listed), kept until
    /// [`Ledger::release_owner`] (the owner's connection closed) rather than dropped and made
    /// again on every lease: owners are the agent's own ids, one per connection.
    owners: FxHashMap<Owner, Holds>,
}

impl Ledger {
    /// An empty tier of `capacity_bytes` (0 holds nothing).
    pub fn new(capacity_bytes: u64, policy: Eviction) -> Self {
        Ledger {
            capacity: capacity_bytes,
            policy,
            slots: HashMap::new(),
            nodes: Slab::new(),
            queues: [List::new(); 2],
            queue_bytes: [0; 2],
            ghost: VecDeque::new(),
            ghost_set: HashSet::new(),
            leases: FxHashMap::default(),
            expiries: BTreeMap::new(),
            next_lease: 1,
            pinned: 0,
            leased: 0,
            held: 0,
            held_bytes: 0,
            pinned_bytes: 0,
            owners: FxHashMap::default(),
        }
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    pub fn policy(&self) -> Eviction {
        self.policy
    }

    /// Bytes of the blocks held now; never above the capacity.
    pub fn used_bytes(&self) -> u64 {
        self.queue_bytes[SMALL] + self.queue_bytes[MAIN]
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, id: &BlockId) -> bool {
        self.slots.contains_key(id)
    }

    /// The size of a held block.
    pub fn bytes_of(&self, id: &BlockId) -> Option<u64> {
        self.slots.get(id).map(|&s| self.nodes.get(s).bytes)
    }

    pub fn stats(&self) -> LedgerStats {
        LedgerStats {
            blocks: self.slots.len() as u64,
            bytes: self.used_bytes(),
            capacity_bytes: self.capacity,
            pinned_blocks: self.pinned,
            leased_blocks: self.leased,
            leases: self.leases.len() as u64,
        }
    }

    /// Records a use of `id`: most recently used (LRU) or one more chance (S3-FIFO). False
    /// when it is not held.
    pub fn touch(&mut self, id: &BlockId) -> bool {
        let Some(&slot) = self.slots.get(id) else {
            return false;
        };
        match self.policy {
            Eviction::Lru => {
                self.unlink(slot);
                self.link_front(MAIN, slot);
            }
            Eviction::S3Fifo => {
                let n = self.nodes.get_mut(slot);
                n.freq = (n.freq + 1).min(MAX_FREQ);
            }
        }
        true
    }

    /// Touches a chain's held blocks, last first, so that its first block is the last to go.
    pub fn touch_chain(&mut self, ids: &[BlockId]) {
        for id in ids.iter().rev() {
            self.touch(id);
        }
    }

    /// Holds `id` (`bytes` long), evicting what the policy chooses to make room; the evicted
    /// ids are pushed onto `evicted` in eviction order. A block already held is touched (and
    /// pinned if `pin`), whatever `bytes` says. Refused, nothing changes.
    pub fn insert(
        &mut self,
        id: BlockId,
        bytes: u64,
        pin: bool,
        evicted: &mut Vec<BlockId>,
    ) -> Result<(), Refused> {
        self.insert_for(id, bytes, pin.then_some(0), evicted)
    }

    /// [`Ledger::insert`], pinned for `pin`'s owner when it is `Some`. A block already
    /// pinned keeps its first owner.
    pub fn insert_for(
        &mut self,
        id: BlockId,
        bytes: u64,
        pin: Option<Owner>,
        evicted: &mut Vec<BlockId>,
    ) -> Result<(), Refused> {
        if let Some(&slot) = self.slots.get(&id) {
            self.touch(&id);
            if let Some(owner) = pin {
                if !self.nodes.get(slot).pinned {
                    self.update_hold(slot, |n| {
                        n.pinned = true;
                        n.pin_owner = owner;
                    });
                    self.own_pin(owner, id);
                }
            }
            return Ok(());
        }
        if bytes > self.capacity {
            return Err(Refused::TooLarge {
                bytes,
                capacity: self.capacity,
            });
        }
        // What eviction could free is everything not held: refuse before evicting anything.
        if self.held_bytes + bytes > self.capacity {
            return Err(Refused::Full);
        }
        while self.used_bytes() + bytes > self.capacity {
            if !self.evict_one(evicted) {
                return Err(Refused::Full);
            }
        }
        let queue = match self.policy {
            Eviction::Lru => MAIN,
            Eviction::S3Fifo => {
                if self.ghost_set.remove(&id) {
                    MAIN
                } else {
                    SMALL
                }
            }
        };
        let node = Node {
            id,
            bytes,
            queue,
            freq: 0,
            pinned: pin.is_some(),
            pin_owner: pin.unwrap_or(0),
            leases: 0,
        };
        let slot = self.nodes.alloc(node);
        self.slots.insert(id, slot);
        self.link_front(queue, slot);
        if let Some(owner) = pin {
            self.pinned += 1;
            self.pinned_bytes += bytes;
            self.held += 1;
            self.held_bytes += bytes;
            self.own_pin(owner, id);
        }
        Ok(())
    }

    fn own_pin(&mut self, owner: Owner, id: BlockId) {
        if owner != 0 {
            self.owners.entry(owner).or_default().pins.insert(id);
        }
    }

    /// Bytes of the pinned blocks.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }

    /// Whether `id` is held and pinned.
    pub fn is_pinned(&self, id: &BlockId) -> bool {
        self.slots
            .get(id)
            .is_some_and(|&s| self.nodes.get(s).pinned)
    }

    /// Which owner holds lease `lease`; None for an unknown one.
    pub fn lease_owner(&self, lease: LeaseId) -> Option<Owner> {
        self.leases.get(&lease).map(|l| l.owner)
    }

    /// (pins, leases) `owner` holds now.
    pub fn holds_of(&self, owner: Owner) -> (usize, usize) {
        self.owners
            .get(&owner)
            .map_or((0, 0), |h| (h.pins.len(), h.leases.len()))
    }

    /// Ends every pin and lease of `owner` (not 0); returns (pins, leases) ended.
    pub fn release_owner(&mut self, owner: Owner) -> (usize, usize) {
        if owner == 0 {
            return (0, 0);
        }
        let Some(h) = self.owners.remove(&owner) else {
            return (0, 0);
        };
        let mut pins = 0;
        for id in &h.pins {
            if let Some(&slot) = self.slots.get(id) {
                if self.nodes.get(slot).pinned && self.nodes.get(slot).pin_owner == owner {
                    self.update_hold(slot, |n| {
                        n.pinned = false;
                        n.pin_owner = 0;
                    });
                    pins += 1;
                }
            }
        }
        let mut leases = 0;
        for l in &h.leases {
            if self.release(*l).is_some() {
                leases += 1;
            }
        }
        (pins, leases)
    }

    /// Inserts a chain's blocks last first (see the module docs), each `bytes` long. Stops at
    /// the first refusal; returns how many were inserted, counted from the chain's end.
    pub fn insert_chain(
        &mut self,
        ids: &[(BlockId, u64)],
        evicted: &mut Vec<BlockId>,
    ) -> Result<usize, (usize, Refused)> {
        for (i, (id, bytes)) in ids.iter().rev().enumerate() {
            self.insert(*id, *bytes, false, evicted)
                .map_err(|e| (i, e))?;
        }
        Ok(ids.len())
    }

    /// Drops `id` unless it is held; true when it was dropped.
    pub fn remove(&mut self, id: &BlockId) -> bool {
        match self.slots.get(id) {
            Some(&slot) if !self.nodes.get(slot).held() => {
                self.drop_slot(slot);
                true
            }
            _ => false,
        }
    }

    /// Unpins `id`; false when it was not pinned.
    pub fn unpin(&mut self, id: &BlockId) -> bool {
        match self.slots.get(id) {
            Some(&slot) if self.nodes.get(slot).pinned => {
                let owner = self.nodes.get(slot).pin_owner;
                self.update_hold(slot, |n| {
                    n.pinned = false;
                    n.pin_owner = 0;
                });
                if let Some(h) = self.owners.get_mut(&owner) {
                    h.pins.remove(id);
                }
                true
            }
            _ => false,
        }
    }

    /// Unpins `id` if `owner` pinned it; false otherwise (another's pin stays).
    pub fn unpin_for(&mut self, id: &BlockId, owner: Owner) -> bool {
        match self.slots.get(id) {
            Some(&slot) if self.nodes.get(slot).pin_owner == owner => self.unpin(id),
            _ => false,
        }
    }

    /// Leases the held blocks among `ids` until released or `now_us + ttl_us`; blocks not
    /// held are skipped. A lease of nothing is still a valid handle.
    pub fn lease(&mut self, ids: &[BlockId], now_us: u64, ttl_us: u64) -> LeaseId {
        self.lease_for(ids, now_us, ttl_us, 0)
    }

    /// [`Ledger::lease`] held by `owner`, ended by [`Ledger::release_owner`] too.
    pub fn lease_for(
        &mut self,
        ids: &[BlockId],
        now_us: u64,
        ttl_us: u64,
        owner: Owner,
    ) -> LeaseId {
        let id = self.next_lease;
        self.next_lease += 1;
        let mut blocks = Vec::with_capacity(ids.len());
        for b in ids {
            if let Some(&slot) = self.slots.get(b) {
                self.update_hold(slot, |n| n.leases += 1);
                blocks.push(*b);
            }
        }
        let expires_us = now_us.saturating_add(ttl_us);
        self.expiries.insert((expires_us, id), ());
        self.leases.insert(
            id,
            Lease {
                blocks,
                expires_us,
                owner,
            },
        );
        if owner != 0 {
            self.owners.entry(owner).or_default().leases.insert(id);
        }
        id
    }

    /// Ends a lease; returns how many blocks it held, or None for an unknown (released or
    /// expired) lease.
    pub fn release(&mut self, lease: LeaseId) -> Option<usize> {
        let l = self.leases.remove(&lease)?;
        self.expiries.remove(&(l.expires_us, lease));
        if let Some(h) = self.owners.get_mut(&l.owner) {
            h.leases.remove(&lease);
        }
        for b in &l.blocks {
            if let Some(&slot) = self.slots.get(b) {
                self.update_hold(slot, |n| n.leases -= 1);
            }
        }
        Some(l.blocks.len())
    }

    /// Ends every lease that expired at or before `now_us`; returns how many.
    pub fn expire(&mut self, now_us: u64) -> usize {
        let due: Vec<LeaseId> = self
            .expiries
            .range(..=(now_us, LeaseId::MAX))
            .map(|(&(_, id), _)| id)
            .collect();
        for id in &due {
            self.release(*id);
        }
        due.len()
    }

    /// Evicts one unheld block chosen by the policy; false when every block is held (or the
    /// tier is empty).
    fn evict_one(&mut self, evicted: &mut Vec<BlockId>) -> bool {
        // Each held block is passed over at most once per queue before we give up, and each
        // S3-FIFO second chance costs the block one use, so the walk ends.
        let mut budget = 2 * self.slots.len() + 2 + 4 * self.slots.len();
        while budget > 0 {
            budget -= 1;
            let queue = match self.policy {
                Eviction::Lru => MAIN,
                Eviction::S3Fifo => {
                    let small_target = self.capacity / 10;
                    if !self.queues[SMALL].is_empty()
                        && (self.queue_bytes[SMALL] > small_target || self.queues[MAIN].is_empty())
                    {
                        SMALL
                    } else {
                        MAIN
                    }
                }
            };
            let Some(slot) = self.queues[queue].back() else {
                return false;
            };
            if self.all_held() {
                return false;
            }
            let n = self.nodes.get(slot);
            if n.held() {
                // Kept: back to the front of its queue.
                self.unlink(slot);
                self.link_front(queue, slot);
                continue;
            }
            match (self.policy, queue) {
                (Eviction::S3Fifo, SMALL) if n.freq > 0 => {
                    // Used again while on probation: into the main queue.
                    self.unlink(slot);
                    self.nodes.get_mut(slot).freq = 0;
                    self.link_front(MAIN, slot);
                }
                (Eviction::S3Fifo, SMALL) => {
                    let id = n.id;
                    self.drop_slot(slot);
                    self.remember_ghost(id);
                    evicted.push(id);
                    return true;
                }
                (Eviction::S3Fifo, _) if n.freq > 0 => {
                    self.nodes.get_mut(slot).freq -= 1;
                    self.unlink(slot);
                    self.link_front(MAIN, slot);
                }
                _ => {
                    let id = n.id;
                    self.drop_slot(slot);
                    evicted.push(id);
                    return true;
                }
            }
        }
        false
    }

    fn all_held(&self) -> bool {
        self.held as usize >= self.slots.len()
    }

    /// Applies `f` to a node's pin or lease count and keeps the hold counters in step.
    fn update_hold(&mut self, slot: usize, f: impl FnOnce(&mut Node)) {
        let n = self.nodes.get_mut(slot);
        let (pinned, leased, held) = (n.pinned, n.leases > 0, n.held());
        f(n);
        let n = self.nodes.get(slot);
        let bytes = n.bytes;
        match (pinned, n.pinned) {
            (false, true) => {
                self.pinned += 1;
                self.pinned_bytes += bytes;
            }
            (true, false) => {
                self.pinned -= 1;
                self.pinned_bytes -= bytes;
            }
            _ => {}
        }
        match (leased, n.leases > 0) {
            (false, true) => self.leased += 1,
            (true, false) => self.leased -= 1,
            _ => {}
        }
        match (held, n.held()) {
            (false, true) => {
                self.held += 1;
                self.held_bytes += bytes;
            }
            (true, false) => {
                self.held -= 1;
                self.held_bytes -= bytes;
            }
            _ => {}
        }
    }

    fn remember_ghost(&mut self, id: BlockId) {
        let bound = self.slots.len().max(64);
        while self.ghost.len() >= bound {
            if let Some(old) = self.ghost.pop_front() {
                self.ghost_set.remove(&old);
            }
        }
        if self.ghost_set.insert(id) {
            self.ghost.push_back(id);
        }
    }

    fn drop_slot(&mut self, slot: usize) {
        self.unlink(slot);
        // Only unheld blocks are dropped (remove and evict check), so no hold counter moves.
        let n = self.nodes.get(slot);
        debug_assert!(!n.held());
        self.slots.remove(&n.id);
        self.nodes.free(slot);
    }

    /// Takes `slot` off its queue.
    fn unlink(&mut self, slot: usize) {
        let Node { queue, bytes, .. } = *self.nodes.get(slot);
        self.nodes.unlink(&mut self.queues[queue], slot);
        self.queue_bytes[queue] -= bytes;
    }

    /// Links an unlinked `slot` at the front of `queue`.
    fn link_front(&mut self, queue: usize, slot: usize) {
        let n = self.nodes.get_mut(slot);
        n.queue = queue;
        let bytes = n.bytes;
        self.nodes.push_front(&mut self.queues[queue], slot);
        self.queue_bytes[queue] += bytes;
    }

    /// Held ids in eviction order as the policy stands now (the back of the small queue
    /// first, then the main queue's): O(len), for tests and debugging.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len());
        for q in [SMALL, MAIN] {
            out.extend(
                self.nodes
                    .iter_back_to_front(&self.queues[q])
                    .map(|(_, n)| n.id),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b(k: u64) -> BlockId {
        BlockId::new(7, k)
    }

    fn keys(ids: &[BlockId]) -> Vec<u64> {
        ids.iter().map(|i| i.key.0).collect()
    }

    /// Inserts `k` (bytes 1) and returns what it evicted.
    fn put(l: &mut Ledger, k: u64) -> Vec<u64> {
        let mut ev = Vec::new();
        l.insert(b(k), 1, false, &mut ev).unwrap();
        keys(&ev)
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        let mut l = Ledger::new(3, Eviction::Lru);
        for k in 1..=3 {
            assert!(put(&mut l, k).is_empty());
        }
        assert!(l.touch(&b(1)));
        assert_eq!(put(&mut l, 4), vec![2]);
        assert_eq!(keys(&l.eviction_order()), vec![3, 1, 4]);
        assert!(!l.touch(&b(2)));
    }

    #[test]
    fn sizes_are_bytes() {
        let mut l = Ledger::new(10, Eviction::Lru);
        let mut ev = Vec::new();
        l.insert(b(1), 4, false, &mut ev).unwrap();
        l.insert(b(2), 4, false, &mut ev).unwrap();
        l.insert(b(3), 6, false, &mut ev).unwrap();
        assert_eq!(keys(&ev), vec![1]);
        assert_eq!(l.used_bytes(), 10);
        l.insert(b(4), 7, false, &mut ev).unwrap();
        assert_eq!(keys(&ev), vec![1, 2, 3]);
        assert_eq!(l.used_bytes(), 7);
        assert_eq!(
            l.insert(b(5), 11, false, &mut ev),
            Err(Refused::TooLarge {
                bytes: 11,
                capacity: 10
            })
        );
        let mut none = Ledger::new(0, Eviction::Lru);
        assert!(none.insert(b(1), 1, false, &mut ev).is_err());
        assert!(none.is_empty());
    }

    /// An owner's pins and leases end together; another's stay, and a pin is the owner's
    /// to lift.
    #[test]
    fn holds_end_with_their_owner() {
        let mut l = Ledger::new(100, Eviction::Lru);
        let mut ev = Vec::new();
        l.insert_for(b(1), 10, Some(7), &mut ev).unwrap();
        l.insert_for(b(2), 10, Some(8), &mut ev).unwrap();
        l.insert(b(3), 10, false, &mut ev).unwrap();
        l.lease_for(&[b(3)], 0, 1_000, 7);
        l.lease_for(&[b(3)], 0, 1_000, 8);
        assert_eq!(l.pinned_bytes(), 20);
        assert_eq!(l.holds_of(7), (1, 1));
        assert!(!l.unpin_for(&b(2), 7), "8's pin is not 7's to lift");
        assert_eq!(l.release_owner(7), (1, 1));
        assert_eq!(l.holds_of(7), (0, 0));
        assert!(!l.is_pinned(&b(1)) && l.is_pinned(&b(2)));
        assert_eq!(l.pinned_bytes(), 10);
        assert_eq!(l.stats().leases, 1);
        assert!(l.unpin_for(&b(2), 8));
        assert_eq!(l.holds_of(8), (0, 1));
        assert_eq!(l.release_owner(8), (0, 1));
        assert_eq!(l.stats().leased_blocks, 0);
        assert_eq!(l.pinned_bytes(), 0);
    }

    #[test]
    fn pinned_and_leased_blocks_stay() {
        for policy in [Eviction::Lru, Eviction::S3Fifo] {
            let mut l = Ledger::new(3, policy);
            let mut ev = Vec::new();
            l.insert(b(1), 1, true, &mut ev).unwrap();
            put(&mut l, 2);
            put(&mut l, 3);
            let lease = l.lease(&[b(2), b(9)], 1_000, 500);
            // Only 3 can go.
            assert_eq!(put(&mut l, 4), vec![3], "{policy:?}");
            // 4 is the only unheld block; then nothing can go.
            assert_eq!(put(&mut l, 5), vec![4], "{policy:?}");
            l.lease(&[b(5)], 1_000, 10_000);
            let mut ev = Vec::new();
            assert_eq!(
                l.insert(b(6), 1, false, &mut ev),
                Err(Refused::Full),
                "{policy:?}"
            );
            assert_eq!(l.used_bytes(), 3);
            assert!(!l.remove(&b(2)), "a leased block cannot be removed");
            // Release 2's lease: it may go now.
            assert_eq!(l.release(lease), Some(1));
            assert_eq!(l.release(lease), None);
            assert_eq!(put(&mut l, 6), vec![2], "{policy:?}");
            // The other lease expires at 11_000.
            assert_eq!(l.expire(10_999), 0);
            assert_eq!(l.expire(11_000), 1);
            assert_eq!(l.stats().leased_blocks, 0);
            assert!(l.unpin(&b(1)));
            assert!(!l.unpin(&b(1)));
            assert_eq!(l.stats().pinned_blocks, 0);
        }
    }

    #[test]
    fn chains_lose_their_tails_first() {
        for policy in [Eviction::Lru, Eviction::S3Fifo] {
            let mut l = Ledger::new(4, policy);
            let chain: Vec<(BlockId, u64)> = (1..=4).map(|k| (b(k), 1)).collect();
            let mut ev = Vec::new();
            l.insert_chain(&chain, &mut ev).unwrap();
            l.insert(b(10), 1, false, &mut ev).unwrap();
            l.insert(b(11), 1, false, &mut ev).unwrap();
            assert_eq!(keys(&ev), vec![4, 3], "{policy:?}");
        }
    }

    #[test]
    fn s3fifo_resists_a_scan() {
        // A working set used often survives a long scan of blocks used once; under LRU the
        // scan flushes it.
        let run = |policy| {
            let mut l = Ledger::new(100, policy);
            for round in 0..3 {
                for k in 0..50 {
                    if !l.touch(&b(k)) {
                        put(&mut l, k);
                    }
                    let _ = round;
                }
            }
            for k in 1000..1500 {
                put(&mut l, k);
            }
            (0..50).filter(|&k| l.contains(&b(k))).count()
        };
        assert_eq!(run(Eviction::S3Fifo), 50);
        assert_eq!(run(Eviction::Lru), 0);
    }

    #[test]
    fn s3fifo_ghosts_return_to_main() {
        let mut l = Ledger::new(20, Eviction::S3Fifo);
        for k in 0..20 {
            put(&mut l, k);
        }
        // 0 leaves the small queue unused and is remembered.
        assert_eq!(put(&mut l, 20), vec![0]);
        put(&mut l, 0);
        assert_eq!(l.nodes.get(l.slots[&b(0)]).queue, MAIN);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Put(u8, u8, bool),
        Touch(u8),
        Lease(Vec<u8>),
        Release(u8),
        Expire,
        Remove(u8),
        Unpin(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..40, 1u8..20, proptest::bool::weighted(0.05)).prop_map(|(k, s, p)| Op::Put(k, s, p)),
            2 => (0u8..40).prop_map(Op::Touch),
            1 => proptest::collection::vec(0u8..40, 0..6).prop_map(Op::Lease),
            1 => (0u8..10).prop_map(Op::Release),
            1 => Just(Op::Expire),
            1 => (0u8..40).prop_map(Op::Remove),
            1 => (0u8..40).prop_map(Op::Unpin),
        ]
    }

    proptest! {
        /// The bound holds, the accounting adds up, and held blocks are never evicted.
        #[test]
        fn invariants_hold(ops in proptest::collection::vec(op(), 1..300), s3 in any::<bool>()) {
            let policy = if s3 { Eviction::S3Fifo } else { Eviction::Lru };
            let mut l = Ledger::new(60, policy);
            let mut now = 0u64;
            let mut leases: Vec<LeaseId> = Vec::new();
            for op in ops {
                now += 10;
                let mut ev = Vec::new();
                let held_before: HashSet<BlockId> = l.slots.iter()
                    .filter(|(_, &s)| l.nodes.get(s).held()).map(|(id, _)| *id).collect();
                match op {
                    Op::Put(k, s, p) => { let _ = l.insert(b(k.into()), s.into(), p, &mut ev); }
                    Op::Touch(k) => { l.touch(&b(k.into())); }
                    Op::Lease(ks) => {
                        let ids: Vec<BlockId> = ks.iter().map(|&k| b(k.into())).collect();
                        leases.push(l.lease(&ids, now, 50));
                    }
                    Op::Release(i) => if let Some(&id) = leases.get(i as usize) { l.release(id); },
                    Op::Expire => { l.expire(now); }
                    Op::Remove(k) => { l.remove(&b(k.into())); }
                    Op::Unpin(k) => { l.unpin(&b(k.into())); }
                }
                prop_assert!(l.used_bytes() <= l.capacity_bytes());
                for e in &ev { prop_assert!(!held_before.contains(e), "evicted held block {e:?}"); }
                let sum: u64 = l.slots.values().map(|&s| l.nodes.get(s).bytes).sum();
                prop_assert_eq!(sum, l.used_bytes());
                prop_assert_eq!(l.eviction_order().len(), l.len());
                let pinned = l.slots.values().filter(|&&s| l.nodes.get(s).pinned).count() as u64;
                let leased = l.slots.values().filter(|&&s| l.nodes.get(s).leases > 0).count() as u64;
                prop_assert_eq!(pinned, l.stats().pinned_blocks);
                prop_assert_eq!(leased, l.stats().leased_blocks);
                let held: Vec<u64> = l.slots.values().filter(|&&s| l.nodes.get(s).held())
                    .map(|&s| l.nodes.get(s).bytes).collect();
                prop_assert_eq!(held.len() as u64, l.held);
                prop_assert_eq!(held.iter().sum::<u64>(), l.held_bytes);
            }
        }
    }
}
