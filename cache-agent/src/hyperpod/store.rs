//! What the shared-memory segment holds, and where: pure bookkeeping, no I/O, time passed
//! in (microseconds).
//!
//! Three parts, one job each:
//! - placement: `offset_allocator::Allocator` hands out runs of [`Layout::unit`]-byte units
//!   of the segment's data area (O(1) allocate and free, neighbours merged);
//! - policy: `warmpath-tiers`' [`Ledger`], the same LRU or S3-FIFO with pins and leases as
//!   the agent's L1, decides what to evict; an object being written is pinned, a leased one
//!   is held by its lease, and neither is ever evicted;
//! - names and leases: which object a name means, who holds which lease until when.
//!
//! A put is two steps. [`Store::begin_put`] reserves the object's place (evicting what the
//! policy chooses, handing each evicted object to a callback before its place is freed, so
//! that the shell can copy it to L2 first) and the name, not yet visible; the shell writes
//! the body; [`Store::commit_put`] makes it visible, or [`Store::abort_put`] drops it
//! (a body that stopped early). A lease names only committed objects: nothing half-written
//! is ever handed out.
//!
//! The ledger counts whole units, so its byte bound and the allocator's space agree. The
//! allocator can still fail where the ledger sees room (free units in runs too short for
//! the object); then objects are evicted in the ledger's order until a run is long enough.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use offset_allocator::{Allocation, Allocator};
use warmpath_tiers::{BlockId, Eviction, LeaseId, Ledger, LedgerStats, Refused};

use super::request::ObjectName;

/// Where objects may go in the segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Offset of the data area (after the segment's header).
    pub data_offset: u64,
    /// Bytes of the data area, a whole number of units.
    pub data_bytes: u64,
    /// The allocation unit: every object starts on one and takes whole ones.
    pub unit: u64,
}

/// Bounds on what clients may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest lease; longer asks are shortened to this.
    pub max_ttl_us: u64,
    /// Open leases at most, all clients together.
    pub max_leases: usize,
    /// Open leases of one client (one peer address) at most.
    pub max_leases_per_client: usize,
    /// Puts being written at once at most (each holds its reserved place).
    pub max_pending_puts: usize,
}

/// A reserved place for a put's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The put's handle for [`Store::commit_put`] and [`Store::abort_put`].
    pub seq: u64,
    /// Offset of the object in the segment.
    pub offset: u64,
    pub len: u64,
}

/// A granted lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub lease: LeaseId,
    pub offset: u64,
    pub len: u64,
    /// The lease's ttl after clamping.
    pub ttl_us: u64,
}

/// Why a put was not placed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PutError {
    #[error("{0} is already stored (or being stored)")]
    Exists(ObjectName),
    #[error("object of {len} bytes is larger than the segment's data area ({capacity} bytes)")]
    TooLarge { len: u64, capacity: u64 },
    #[error(
        "the segment is full of leased objects and objects being written; retry when leases end"
    )]
    Full,
    #[error("{0} puts are being written, the most this agent takes at once")]
    Busy(usize),
}

/// Why no lease was granted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("{0} is not stored")]
    Miss(ObjectName),
    #[error("{0} leases are open, the most this agent grants; release some")]
    TooMany(usize),
    #[error("client {client} holds {limit} leases, the most one client may; release some")]
    TooManyForClient { client: IpAddr, limit: usize },
}

/// Why a release did not end a lease.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseError {
    #[error("lease {0} is not open (released, or expired and collected)")]
    Unknown(LeaseId),
    #[error("lease {0} had expired; its object may have been evicted since")]
    Expired(LeaseId),
}

/// Occupancy, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Committed objects.
    pub objects: u64,
    /// Puts being written.
    pub pending: u64,
    /// Bytes of the data area taken (whole units, committed and pending).
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub leases: u64,
    /// Objects evicted since the start.
    pub evictions: u64,
}

/// An object's place; the allocation is the allocator's handle to free it.
struct Slot(Allocation<u32>);

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Slot({})", self.0.offset)
    }
}

#[derive(Debug)]
struct Entry {
    name: ObjectName,
    slot: Slot,
    offset: u64,
    len: u64,
    /// Committed: whole, and visible to leases.
    ready: bool,
}

#[derive(Clone, Copy, Debug)]
struct LeaseMeta {
    client: IpAddr,
    expires_us: u64,
}

/// The segment's bookkeeping.
#[derive(Debug)]
pub struct Store {
    layout: Layout,
    alloc: Allocator<u32>,
    /// The eviction policy over objects, by ledger id `(0, seq)`.
    ledger: Ledger,
    /// Name to the seq of its object (committed or pending).
    names: HashMap<ObjectName, u64>,
    entries: HashMap<u64, Entry>,
    next_seq: u64,
    pending: usize,
    leases: HashMap<LeaseId, LeaseMeta>,
    /// (expiry, lease): the order in which leases end.
    expiries: BTreeSet<(u64, LeaseId)>,
    per_client: HashMap<IpAddr, usize>,
    limits: Limits,
    evictions: u64,
}

/// The callback that sees each evicted object (its name, offset and length) before its
/// place is freed.
pub type Spill<'a> = &'a mut dyn FnMut(&ObjectName, u64, u64);

impl Store {
    /// An empty store over `layout`, evicting by `policy`.
    pub fn new(layout: Layout, policy: Eviction, limits: Limits) -> Store {
        let units = (layout.data_bytes / layout.unit).min(u64::from(u32::MAX - 2)) as u32;
        // One allocator node per object at most, and objects take a unit at least.
        let max_allocs = units.clamp(2, 1 << 20) + 2;
        Store {
            layout,
            alloc: Allocator::with_max_allocs(units, max_allocs),
            ledger: Ledger::new(u64::from(units) * layout.unit, policy),
            names: HashMap::new(),
            entries: HashMap::new(),
            next_seq: 1,
            pending: 0,
            leases: HashMap::new(),
            expiries: BTreeSet::new(),
            per_client: HashMap::new(),
            limits,
            evictions: 0,
        }
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The largest object that can ever fit.
    pub fn capacity_bytes(&self) -> u64 {
        self.ledger.capacity_bytes()
    }

    /// Whether `name` is committed.
    pub fn contains(&self, name: &ObjectName) -> bool {
        self.names
            .get(name)
            .is_some_and(|seq| self.entries.get(seq).is_some_and(|e| e.ready))
    }

    pub fn stats(&self) -> StoreStats {
        let LedgerStats { bytes, leases, .. } = self.ledger.stats();
        StoreStats {
            objects: (self.entries.len() - self.pending) as u64,
            pending: self.pending as u64,
            used_bytes: bytes,
            capacity_bytes: self.ledger.capacity_bytes(),
            leases,
            evictions: self.evictions,
        }
    }

    /// Reserves a place for `name`'s `len` bytes, evicting as the policy chooses; each
    /// evicted object goes through `spill` before its place is freed. The name is taken
    /// (a second put of it is refused) but no lease sees it until [`Store::commit_put`].
    pub fn begin_put(
        &mut self,
        name: ObjectName,
        len: u64,
        spill: Spill<'_>,
    ) -> Result<Placement, PutError> {
        if self.names.contains_key(&name) {
            return Err(PutError::Exists(name));
        }
        let capacity = self.capacity_bytes();
        if len > capacity {
            return Err(PutError::TooLarge { len, capacity });
        }
        if self.pending >= self.limits.max_pending_puts {
            return Err(PutError::Busy(self.pending));
        }
        let unit = self.layout.unit;
        let units = len.div_ceil(unit).max(1);
        let seq = self.next_seq;
        self.next_seq += 1;
        let id = BlockId::new(0, seq);
        let mut evicted = Vec::new();
        // Pinned while it is written: never evicted half-written.
        let inserted = self.ledger.insert(id, units * unit, true, &mut evicted);
        self.drop_evicted(&evicted, spill);
        if let Err(e) = inserted {
            return Err(match e {
                Refused::TooLarge { .. } => PutError::TooLarge { len, capacity },
                Refused::Full => PutError::Full,
            });
        }
        let alloc = match self.alloc.allocate(units as u32) {
            Some(a) => a,
            None => match self.defragment_for(units as u32, id, spill) {
                Some(a) => a,
                None => {
                    self.ledger.unpin(&id);
                    self.ledger.remove(&id);
                    return Err(PutError::Full);
                }
            },
        };
        let offset = self.layout.data_offset + u64::from(alloc.offset) * unit;
        self.entries.insert(
            seq,
            Entry {
                name: name.clone(),
                slot: Slot(alloc),
                offset,
                len,
                ready: false,
            },
        );
        self.names.insert(name, seq);
        self.pending += 1;
        Ok(Placement { seq, offset, len })
    }

    /// Frees places in the ledger's eviction order until `units` contiguous units can be
    /// allocated: free space in runs too short for the object.
    fn defragment_for(
        &mut self,
        units: u32,
        keep: BlockId,
        spill: Spill<'_>,
    ) -> Option<Allocation<u32>> {
        for victim in self.ledger.eviction_order() {
            if victim == keep || !self.ledger.remove(&victim) {
                continue;
            }
            self.drop_evicted(&[victim], spill);
            if let Some(a) = self.alloc.allocate(units) {
                return Some(a);
            }
        }
        None
    }

    fn drop_evicted(&mut self, ids: &[BlockId], spill: Spill<'_>) {
        for id in ids {
            let Some(e) = self.entries.remove(&id.key.0) else {
                continue;
            };
            self.names.remove(&e.name);
            if e.ready {
                spill(&e.name, e.offset, e.len);
            }
            self.alloc.free(e.slot.0);
            self.evictions += 1;
        }
    }

    /// Makes a written put visible; false when `seq` is not a pending put.
    pub fn commit_put(&mut self, seq: u64) -> bool {
        match self.entries.get_mut(&seq) {
            Some(e) if !e.ready => {
                e.ready = true;
                self.pending -= 1;
                self.ledger.unpin(&BlockId::new(0, seq));
                true
            }
            _ => false,
        }
    }

    /// Drops a pending put (its body did not arrive whole): its name and place are free
    /// again, and nothing of it was ever visible.
    pub fn abort_put(&mut self, seq: u64) {
        match self.entries.get(&seq) {
            Some(e) if !e.ready => {}
            _ => return,
        }
        let e = self.entries.remove(&seq).expect("checked above");
        self.pending -= 1;
        self.names.remove(&e.name);
        let id = BlockId::new(0, seq);
        self.ledger.unpin(&id);
        self.ledger.remove(&id);
        self.alloc.free(e.slot.0);
    }

    /// Leases `name` for `client` until released or `now_us + ttl_us` (ttl clamped to the
    /// limit): the object is not evicted meanwhile. A use, for the eviction policy.
    pub fn lease(
        &mut self,
        name: &ObjectName,
        client: IpAddr,
        ttl_us: u64,
        now_us: u64,
    ) -> Result<Grant, LeaseError> {
        let miss = || LeaseError::Miss(name.clone());
        let seq = *self.names.get(name).ok_or_else(miss)?;
        let e = self.entries.get(&seq).ok_or_else(miss)?;
        if !e.ready {
            return Err(miss());
        }
        if self.leases.len() >= self.limits.max_leases {
            return Err(LeaseError::TooMany(self.limits.max_leases));
        }
        let held = self.per_client.get(&client).copied().unwrap_or(0);
        if held >= self.limits.max_leases_per_client {
            return Err(LeaseError::TooManyForClient {
                client,
                limit: self.limits.max_leases_per_client,
            });
        }
        let (offset, len) = (e.offset, e.len);
        let ttl_us = ttl_us.clamp(1, self.limits.max_ttl_us.max(1));
        let id = BlockId::new(0, seq);
        self.ledger.touch(&id);
        let lease = self.ledger.lease(&[id], now_us, ttl_us);
        let expires_us = now_us.saturating_add(ttl_us);
        self.leases.insert(lease, LeaseMeta { client, expires_us });
        self.expiries.insert((expires_us, lease));
        *self.per_client.entry(client).or_insert(0) += 1;
        Ok(Grant {
            lease,
            offset,
            len,
            ttl_us,
        })
    }

    /// Ends `lease`. One past its expiry that was not yet collected ends too, and says so.
    pub fn release(&mut self, lease: LeaseId, now_us: u64) -> Result<(), ReleaseError> {
        let meta = self.end_lease(lease).ok_or(ReleaseError::Unknown(lease))?;
        if now_us >= meta.expires_us {
            return Err(ReleaseError::Expired(lease));
        }
        Ok(())
    }

    fn end_lease(&mut self, lease: LeaseId) -> Option<LeaseMeta> {
        let meta = self.leases.remove(&lease)?;
        self.expiries.remove(&(meta.expires_us, lease));
        self.ledger.release(lease);
        if let Some(n) = self.per_client.get_mut(&meta.client) {
            *n -= 1;
            if *n == 0 {
                self.per_client.remove(&meta.client);
            }
        }
        Some(meta)
    }

    /// Ends every lease that expired at or before `now_us`; returns how many. Their
    /// objects may be evicted from then on.
    pub fn expire(&mut self, now_us: u64) -> usize {
        let due: Vec<LeaseId> = self
            .expiries
            .range(..=(now_us, LeaseId::MAX))
            .map(|&(_, l)| l)
            .collect();
        for l in &due {
            self.end_lease(*l);
        }
        due.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UNIT: u64 = 4096;

    fn store(units: u64) -> Store {
        Store::new(
            Layout {
                data_offset: UNIT,
                data_bytes: units * UNIT,
                unit: UNIT,
            },
            Eviction::Lru,
            Limits {
                max_ttl_us: 60_000_000,
                max_leases: 8,
                max_leases_per_client: 4,
                max_pending_puts: 4,
            },
        )
    }

    fn n(key: &str) -> ObjectName {
        ObjectName {
            bucket: "lmcache".into(),
            key: key.into(),
        }
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    /// Puts and commits `key` of `len` bytes; returns its placement and what was evicted.
    fn put(s: &mut Store, key: &str, len: u64) -> Result<(Placement, Vec<String>), PutError> {
        let mut spilled = Vec::new();
        let p = s.begin_put(n(key), len, &mut |name, _, _| {
            spilled.push(name.key.clone())
        })?;
        assert!(s.commit_put(p.seq));
        Ok((p, spilled))
    }

    #[test]
    fn put_lease_release() {
        let mut s = store(4);
        let (p, _) = put(&mut s, "a", 100).unwrap();
        assert_eq!((p.offset, p.len), (UNIT, 100));
        assert_eq!(put(&mut s, "a", 100).unwrap_err(), PutError::Exists(n("a")));
        let g = s.lease(&n("a"), A, 1_000, 0).unwrap();
        assert_eq!((g.offset, g.len), (UNIT, 100));
        assert_eq!(s.release(g.lease, 10), Ok(()));
        assert_eq!(s.release(g.lease, 10), Err(ReleaseError::Unknown(g.lease)));
        assert_eq!(
            s.lease(&n("b"), A, 1_000, 0).unwrap_err(),
            LeaseError::Miss(n("b"))
        );
        assert_eq!(
            put(&mut s, "big", 4 * UNIT + 1).unwrap_err(),
            PutError::TooLarge {
                len: 4 * UNIT + 1,
                capacity: 4 * UNIT
            }
        );
    }

    #[test]
    fn pending_puts_are_invisible_and_aborts_leave_nothing() {
        let mut s = store(4);
        let p = s.begin_put(n("a"), 10, &mut |_, _, _| {}).unwrap();
        assert!(s.lease(&n("a"), A, 1_000, 0).is_err(), "half-written");
        assert!(!s.contains(&n("a")));
        // Its name is taken while it is written.
        assert!(matches!(
            s.begin_put(n("a"), 10, &mut |_, _, _| {}),
            Err(PutError::Exists(_))
        ));
        s.abort_put(p.seq);
        assert_eq!(
            s.stats(),
            StoreStats {
                capacity_bytes: 4 * UNIT,
                ..StoreStats::default()
            }
        );
        // The name and the place are free again.
        let (p2, _) = put(&mut s, "a", 10).unwrap();
        assert_eq!(p2.offset, p.offset);
        assert!(!s.commit_put(p2.seq), "committed once");
    }

    #[test]
    fn eviction_follows_the_ledger_and_spares_leased_objects() {
        let mut s = store(4);
        for k in ["a", "b", "c", "d"] {
            put(&mut s, k, UNIT).unwrap();
        }
        let g = s.lease(&n("a"), A, 1_000, 0).unwrap();
        // "a" is the least recently put but leased: "b" goes, then "c".
        let (_, spilled) = put(&mut s, "e", UNIT).unwrap();
        assert_eq!(spilled, ["b"]);
        let (_, spilled) = put(&mut s, "f", UNIT).unwrap();
        assert_eq!(spilled, ["c"]);
        assert!(s.contains(&n("a")));
        s.release(g.lease, 1).unwrap();
        let (_, spilled) = put(&mut s, "g", UNIT).unwrap();
        assert_eq!(spilled, ["d"], "a was used when leased: d is older");
        assert_eq!(s.stats().evictions, 3);
    }

    #[test]
    fn a_lease_never_released_expires_and_its_object_becomes_evictable() {
        let mut s = store(1);
        put(&mut s, "a", 10).unwrap();
        let g = s.lease(&n("a"), A, 5_000, 0).unwrap();
        assert_eq!(put(&mut s, "b", 10).unwrap_err(), PutError::Full);
        assert_eq!(s.expire(4_999), 0);
        assert_eq!(s.expire(5_000), 1);
        assert_eq!(s.stats().leases, 0);
        let (_, spilled) = put(&mut s, "b", 10).unwrap();
        assert_eq!(spilled, ["a"]);
        assert_eq!(
            s.release(g.lease, 6_000),
            Err(ReleaseError::Unknown(g.lease))
        );
        // Released late, before the collector ran: it ends, and says it had expired.
        let g = s.lease(&n("b"), A, 5_000, 10_000).unwrap();
        assert_eq!(
            s.release(g.lease, 15_000),
            Err(ReleaseError::Expired(g.lease))
        );
        assert_eq!(s.stats().leases, 0);
    }

    #[test]
    fn ttl_is_clamped_and_leases_are_bounded() {
        let mut s = store(4);
        put(&mut s, "a", 10).unwrap();
        let g = s.lease(&n("a"), A, u64::MAX, 0).unwrap();
        assert_eq!(g.ttl_us, 60_000_000);
        for _ in 1..4 {
            s.lease(&n("a"), A, 1_000, 0).unwrap();
        }
        let err = s.lease(&n("a"), A, 1_000, 0).unwrap_err();
        assert_eq!(
            err,
            LeaseError::TooManyForClient {
                client: A,
                limit: 4
            }
        );
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        for _ in 0..4 {
            s.lease(&n("a"), b, 1_000, 0).unwrap();
        }
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        assert_eq!(
            s.lease(&n("a"), c, 1_000, 0).unwrap_err(),
            LeaseError::TooMany(8)
        );
        assert_eq!(s.expire(1_000), 7);
        s.lease(&n("a"), c, 1_000, 0).unwrap();
    }

    #[test]
    fn fragmented_space_is_freed_in_eviction_order() {
        // Four one-unit objects; free the 1st and 3rd: two free units, not adjacent.
        let mut s = store(4);
        for k in ["a", "b", "c", "d"] {
            put(&mut s, k, UNIT).unwrap();
        }
        let gb = s.lease(&n("b"), A, 1_000, 0).unwrap();
        let gd = s.lease(&n("d"), A, 1_000, 0).unwrap();
        // A two-unit object: the ledger evicts "a" and "c" (unleased) for room, but the
        // units are not adjacent, and "b" and "d" are leased: refused, nothing half-done.
        assert_eq!(put(&mut s, "x", 2 * UNIT).unwrap_err(), PutError::Full);
        assert!(!s.contains(&n("x")));
        s.release(gb.lease, 1).unwrap();
        // Now "b" can go: a, b, c are adjacent.
        let (p, _) = put(&mut s, "x", 2 * UNIT).unwrap();
        assert!(p.offset < UNIT + 3 * UNIT);
        assert!(s.contains(&n("d")));
        s.release(gd.lease, 1).unwrap();
        assert_eq!(s.stats().pending, 0);
    }

    #[derive(Clone, Debug)]
    enum Step {
        Put { key: u8, units: u8, commit: bool },
        Lease { key: u8, ttl: u8 },
        Release { nth: u8 },
        Tick { us: u16 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..24, 1u8..6, proptest::bool::weighted(0.9))
                .prop_map(|(key, units, commit)| Step::Put { key, units, commit }),
            (0u8..24, 1u8..50).prop_map(|(key, ttl)| Step::Lease { key, ttl }),
            any::<u8>().prop_map(|nth| Step::Release { nth }),
            (0u16..2000).prop_map(|us| Step::Tick { us }),
        ]
    }

    proptest! {
        /// Whatever clients do: live objects never overlap and stay inside the data area,
        /// the bound holds, a leased object is never evicted, and what a lease points at is
        /// what was put under that name.
        #[test]
        fn placements_never_overlap_and_leases_hold(steps in proptest::collection::vec(step(), 1..200)) {
            let mut s = store(16);
            let mut now = 0u64;
            // name -> (offset, len) of committed objects, as clients last saw them.
            let mut live: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
            let mut leases: Vec<(LeaseId, String, u64)> = Vec::new();
            for st in steps {
                match st {
                    Step::Put { key, units, commit } => {
                        let name = n(&key.to_string());
                        let len = u64::from(units) * UNIT - 7;
                        let mut gone = Vec::new();
                        let r = s.begin_put(name.clone(), len, &mut |n, _, _| gone.push(n.key.clone()));
                        for g in &gone {
                            prop_assert!(
                                !leases.iter().any(|(_, k, exp)| k == g && *exp > now),
                                "leased {g} evicted"
                            );
                            live.remove(g);
                        }
                        if let Ok(p) = r {
                            prop_assert!(p.offset >= UNIT && p.offset + len <= UNIT + 16 * UNIT);
                            for (k, &(o, l)) in &live {
                                let (a, b) = (o, o + l.div_ceil(UNIT) * UNIT);
                                let (c, d) = (p.offset, p.offset + len);
                                prop_assert!(d <= a || c >= b, "{k} at {a}..{b} overlaps {c}..{d}");
                            }
                            if commit {
                                prop_assert!(s.commit_put(p.seq));
                                live.insert(key.to_string(), (p.offset, len));
                            } else {
                                s.abort_put(p.seq);
                            }
                        }
                    }
                    Step::Lease { key, ttl } => {
                        let ttl = u64::from(ttl) * 100;
                        match s.lease(&n(&key.to_string()), A, ttl, now) {
                            Ok(g) => {
                                let want = live.get(&key.to_string()).copied();
                                prop_assert_eq!(Some((g.offset, g.len)), want);
                                leases.push((g.lease, key.to_string(), now + ttl));
                            }
                            Err(LeaseError::Miss(_)) => {
                                prop_assert!(!live.contains_key(&key.to_string()));
                            }
                            Err(_) => {}
                        }
                    }
                    Step::Release { nth } => {
                        if !leases.is_empty() {
                            let (l, _, _) = leases.remove(usize::from(nth) % leases.len());
                            let _ = s.release(l, now);
                        }
                    }
                    Step::Tick { us } => {
                        now += u64::from(us);
                        s.expire(now);
                        leases.retain(|(_, _, exp)| *exp > now);
                    }
                }
                let st = s.stats();
                prop_assert!(st.used_bytes <= st.capacity_bytes);
                prop_assert_eq!(st.objects as usize, live.len());
            }
        }
    }

    #[test]
    fn pending_puts_are_bounded() {
        let mut s = store(16);
        for i in 0..4 {
            s.begin_put(n(&i.to_string()), 1, &mut |_, _, _| {})
                .unwrap();
        }
        assert_eq!(
            s.begin_put(n("x"), 1, &mut |_, _, _| {}).unwrap_err(),
            PutError::Busy(4)
        );
    }
}
