//! The prefix index: which instance holds which prompt prefix, in which tier.
//!
//! Entries are keyed by [`BlockKey`] (a key names a whole prefix) and carry a parent link,
//! so the index is a radix tree of blocks stored as a map. Each entry records, per
//! instance, the tiers an agent *observed* holding the block (GPU, L1) and until when a
//! routing decision *predicts* the instance holds it in GPU memory; plus whether the
//! global L2 store holds it.
//!
//! [`PrefixIndex::match_prefix`] walks a prompt's keys and returns, per instance, the
//! length of the contiguous matched prefix per tier. Depths are cumulative: `gpu` blocks
//! are in GPU memory, `l1 >= gpu` blocks are in GPU or this host's CPU memory, `l2 >= l1`
//! blocks are in one of those or in the global L2 store. Instances that hold nothing are
//! not listed; their depths are `0, 0, global_l2`.
//!
//! Memory is bounded by `capacity_blocks` entries; at capacity the least recently written
//! *leaf* is evicted, so suffixes go before their prefixes. Predicted holdings expire
//! `predicted_ttl_us` after their last refresh unless an agent confirms them.
//!
//! Two per-instance switches act in O(1), without walking the index:
//!
//! - [`PrefixIndex::remove_instance`] bumps the instance's *generation*: holders written
//!   under an older generation are invisible from then on and are dropped lazily, when the
//!   expiry queue, an eviction or a later write reaches them. An instance failing or
//!   flapping therefore costs the request path nothing.
//! - [`PrefixIndex::forget_predictions_before`] sets the instance's *horizon*: predictions
//!   last refreshed at or before it stop matching. An engine that reports fewer cached
//!   tokens than predicted has evicted what it was sent then, and (its cache being LRU)
//!   everything it was sent earlier too.
//!
//! Statistics ([`PrefixIndex::stats`], [`PrefixIndex::holders_of`]) are kept as counters,
//! updated by every write: reading them walks nothing.
//!
//! Time is passed in as microseconds; nothing here reads a clock.

use crate::keys::{BlockKey, Reporting};
use crate::InstanceId;
use hashbrown::HashTable;
use std::collections::VecDeque;

/// Tier bit: the block is in the instance's GPU memory.
const GPU: u8 = 1;
/// Tier bit: the block is in the instance's host CPU memory (agent L1).
const L1: u8 = 2;
const NONE: u32 = u32::MAX;

/// Block keys are already uniform hashes (or, for traces, small integers): a multiply
/// and a fold spread them without the cost of SipHash.
fn hash_key(key: BlockKey) -> u64 {
    let x = key.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^ (x >> 29)
}

/// Near the start of a prompt every `SHARE_EVERY`-th key of a decision is shared with peer
/// routers; deeper, the stride doubles with the depth (see [`share_stride`]).
pub const SHARE_EVERY: usize = 4;

/// Depth (in blocks) up to which keys are shared every [`SHARE_EVERY`] blocks; past it the
/// stride is the largest power of two at most `depth / SHARE_PRECISION`.
pub const SHARE_DENSE_BLOCKS: usize = SHARE_EVERY * SHARE_PRECISION;

/// A shared key at depth `d` stands for its prefix to within about `d / SHARE_PRECISION`
/// blocks (1.6%).
pub const SHARE_PRECISION: usize = 64;

/// The stride of shared keys around depth `d` (0-based block index): [`SHARE_EVERY`] up to
/// [`SHARE_DENSE_BLOCKS`], then the largest power of two at most `d / SHARE_PRECISION`, so
/// each doubling of a prompt's length adds a constant number of shared keys (64) rather
/// than a quarter of its blocks.
pub fn share_stride(d: usize) -> usize {
    if d < SHARE_DENSE_BLOCKS {
        return SHARE_EVERY;
    }
    let s = d / SHARE_PRECISION;
    1 << (usize::BITS - 1 - s.leading_zeros())
}

/// The keys of `keys[known..]` a router tells its peers about: the key at every depth `d`
/// where `d + 1` is a multiple of [`share_stride`]`(d)`, and the last. A key names its whole
/// prefix and [`PrefixIndex::match_into`] credits a predicted key for all of it, so peers
/// match a shared prefix to within `SHARE_EVERY − 1` blocks in its first
/// [`SHARE_DENSE_BLOCKS`] and to within about 1.6% of its depth past them, while gossip
/// carries a quarter of a short prompt's keys and O(log n) of a long one's (a 42,000-token
/// document at 16-token blocks: 275 keys rather than 660).
pub fn sparse_keys(keys: &[BlockKey], known: usize) -> Vec<BlockKey> {
    let last = keys.len().saturating_sub(1);
    (known..keys.len())
        .filter(|&d| (d + 1) % share_stride(d) == 0 || d == last)
        .map(|d| keys[d])
        .collect()
}

/// Settings of one index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most entries (blocks) held; the least recently written leaves go first.
    pub capacity_blocks: usize,
    /// How long a routing decision's prediction lasts without an agent's confirmation.
    pub predicted_ttl_us: u64,
    /// Agents report one key in this many at every depth ([`crate::keys::reported`]); an
    /// observed run is credited from one reported key to the next (see
    /// [`PrefixIndex::match_into`]). `None` (the default): the protocol's rate for the
    /// queried pool's block size, [`Reporting::Tokens`], which thins out with depth.
    /// `Some(1)`: every key is reported, and an observed run needs every block.
    pub report_every: Option<u32>,
}

impl IndexConfig {
    /// Which keys agents report of a pool of `block_tokens`-token blocks: the configured
    /// [`IndexConfig::report_every`], else the protocol's rate.
    pub fn reporting(&self, block_tokens: u32) -> Reporting {
        self.report_every
            .map_or(Reporting::Tokens(block_tokens), Reporting::Every)
    }
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            capacity_blocks: 1 << 20,
            predicted_ttl_us: 120_000_000,
            report_every: None,
        }
    }
}

/// What one instance holds of one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    instance: u32,
    /// The instance's generation when this holder was written; a holder of an older
    /// generation is invisible (the instance was removed since).
    gen: u16,
    /// Tier bits an agent reported.
    observed: u8,
    /// Whether the expiry queue holds an entry for this holder.
    queued: bool,
    /// The prediction holds while `now < predicted_until`; 0 when there is none.
    predicted_until: u64,
}

/// Per-instance state of the index: generation, horizon, and counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InstanceMeta {
    gen: u16,
    /// Predictions expiring at or before this are dead: `horizon + predicted_ttl_us`.
    prediction_floor: u64,
    /// Live holders, of which predicted (queued) and observed (some tier bit).
    holders: usize,
    predicted: usize,
    observed: usize,
    /// Live holders in host memory only: observed in L1 alone, no prediction.
    host_only: usize,
}

/// Whether `h` holds its block in host memory (L1) only: observed there and nowhere else,
/// and not predicted on the GPU.
fn host_only(h: &Holder) -> bool {
    h.observed == L1 && !h.queued
}

impl InstanceMeta {
    fn live(&self, h: &Holder) -> bool {
        h.gen == self.gen
    }

    /// Whether `h`'s prediction holds at `now`.
    fn predicts(&self, h: &Holder, now: u64) -> bool {
        now < h.predicted_until && h.predicted_until > self.prediction_floor
    }

    /// Tier bits `h` holds at `now` (nothing for a stale holder).
    fn tiers(&self, h: &Holder, now: u64) -> u8 {
        if !self.live(h) {
            return 0;
        }
        h.observed | if self.predicts(h, now) { GPU } else { 0 }
    }

    /// Takes a live holder out of the counters.
    fn uncount(&mut self, h: &Holder) {
        if self.live(h) {
            self.holders -= 1;
            self.predicted -= usize::from(h.queued);
            self.observed -= usize::from(h.observed != 0);
            self.host_only -= usize::from(host_only(h));
        }
    }
}

/// One block. Aligned to a cache line: a match touches one line per block.
#[derive(Clone, Debug)]
#[repr(align(64))]
struct Node {
    key: BlockKey,
    parent: u32,
    children: u32,
    /// Holders, the first inline: most blocks live on one instance.
    first: Option<Holder>,
    /// Further holders, in the order they came, in `more[..more_len()]`; the rest of the
    /// boxed slice is room to grow. A block routed to thousands of instances (a fleet-wide
    /// system prompt) grows its list by doubling rather than reallocating and copying it on
    /// every new holder. A boxed slice and a length in the node's padding keep the node
    /// within one cache line.
    more: Box<[Holder]>,
    /// The overflow holders in use (the low 31 bits) and whether the global L2 store holds
    /// the block ([`IN_L2`]).
    len_l2: u32,
    /// The wrapping sum of [`holder_sig`] over the holders: equal sums say (but for a
    /// chance of 2^-32) that two nodes have the same holders in the same states, without
    /// reading either list (see [`PrefixIndex::match_into`]).
    sig: u32,
    /// Leaf LRU links (valid while `children == 0`).
    prev: u32,
    next: u32,
}

/// [`Node::len_l2`]'s bit for "in the global L2 store".
const IN_L2: u32 = 1 << 31;

/// A holder's contribution to [`Node::sig`]: a hash of everything a match reads of it.
fn holder_sig(h: &Holder) -> u32 {
    let low = u64::from(h.instance)
        | u64::from(h.gen) << 32
        | u64::from(h.observed) << 48
        | u64::from(h.queued) << 56;
    (crate::rng::mix64(low ^ crate::rng::mix64(h.predicted_until)) >> 32) as u32
}

impl Node {
    fn holders(&self) -> impl Iterator<Item = &Holder> {
        self.first.iter().chain(self.more().iter())
    }

    /// Whether `other` has the same holders in the same states (see [`Node::sig`]), and
    /// the same place in the global L2 store: what a match reads of a node.
    fn matches_like(&self, other: &Node) -> bool {
        self.sig == other.sig && self.len_l2 == other.len_l2 && self.first == other.first
    }

    /// What [`Node::matches_like`] estimates, read in full (for debug assertions).
    fn same_holders_as(&self, other: &Node) -> bool {
        let sorted = |n: &Node| {
            let mut hs: Vec<Holder> = n.holders().copied().collect();
            hs.sort_by_key(|h| h.instance);
            hs
        };
        sorted(self) == sorted(other)
    }

    fn more_len(&self) -> usize {
        (self.len_l2 & !IN_L2) as usize
    }

    fn set_more_len(&mut self, len: usize) {
        debug_assert!(len < IN_L2 as usize);
        self.len_l2 = (self.len_l2 & IN_L2) | len as u32;
    }

    fn in_l2(&self) -> bool {
        self.len_l2 & IN_L2 != 0
    }

    fn set_in_l2(&mut self, in_l2: bool) {
        self.len_l2 = (self.len_l2 & !IN_L2) | if in_l2 { IN_L2 } else { 0 };
    }

    /// The overflow holders in use.
    fn more(&self) -> &[Holder] {
        &self.more[..self.more_len()]
    }

    /// Where `instance`'s holder is: `Some(None)` inline, `Some(Some(i))` at `more[i]`,
    /// trying `more[hint]` before the scan.
    fn find(&self, instance: u32, hint: usize) -> Option<Option<usize>> {
        if self.first.is_some_and(|h| h.instance == instance) {
            Some(None)
        } else if self
            .more()
            .get(hint)
            .is_some_and(|h| h.instance == instance)
        {
            Some(Some(hint))
        } else {
            self.more_at(instance).map(Some)
        }
    }

    fn holder_at(&mut self, at: Option<usize>) -> &mut Holder {
        match at {
            None => self.first.as_mut().expect("found inline"),
            Some(i) => &mut self.more[i],
        }
    }

    /// Runs `f` on the holder of `instance`, if any, keeping [`Node::sig`] in step.
    fn update_holder<R>(&mut self, instance: u32, f: impl FnOnce(&mut Holder) -> R) -> Option<R> {
        let at = self.find(instance, usize::MAX)?;
        let holder = self.holder_at(at);
        let before = holder_sig(holder);
        let out = f(holder);
        let after = holder_sig(holder);
        self.sig = self.sig.wrapping_sub(before).wrapping_add(after);
        Some(out)
    }

    /// Where `instance`'s overflow holder is.
    fn more_at(&self, instance: u32) -> Option<usize> {
        self.more().iter().position(|h| h.instance == instance)
    }

    /// Appends an overflow holder, doubling the room when it is full; `extra` counts the
    /// overflow slots (what the lists take in memory).
    fn push_more(&mut self, holder: Holder, extra: &mut usize) -> &mut Holder {
        let len = self.more_len();
        if len == self.more.len() {
            let room = (2 * len).max(1);
            let mut grown = Vec::with_capacity(room);
            grown.extend_from_slice(&self.more[..len]);
            grown.resize(room, holder);
            *extra += room - len;
            self.more = grown.into_boxed_slice();
        }
        self.more[len] = holder;
        self.set_more_len(len + 1);
        &mut self.more[len]
    }

    /// Frees the overflow list (the node is being removed).
    fn clear_more(&mut self, extra: &mut usize) {
        *extra -= self.more.len();
        self.more = Box::default();
        self.set_more_len(0);
    }

    /// The live holder of `instance` (a stale one is revived empty), and whether it was
    /// created or revived. Keeps `meta`'s counters and `extra` (the count of overflow
    /// holders) up to date; the holder is out of [`Node::sig`] until the caller, having
    /// changed it, adds it back.
    fn holder_or_insert<'a>(
        &'a mut self,
        instance: u32,
        meta: &mut InstanceMeta,
        extra: &mut usize,
        hint: &mut usize,
    ) -> (&'a mut Holder, bool) {
        let fresh = Holder {
            instance,
            gen: meta.gen,
            observed: 0,
            queued: false,
            predicted_until: 0,
        };
        let pos = self.find(instance, *hint);
        // Where the instance is in this list is likely where it is in the next list that
        // has it, as a prompt's blocks (or its reported ones) gain their holders together.
        if let Some(Some(at)) = pos {
            *hint = at;
        }
        let holder = match pos {
            Some(at) => {
                // The caller changes it and adds it back to the node's signature.
                self.sig = self.sig.wrapping_sub(holder_sig(self.holder_at(at)));
                let h = self.holder_at(at);
                if meta.live(h) {
                    return (h, false);
                }
                // Written before the instance was removed: start over, keeping only the
                // expiry queue's entry (it is still in the queue).
                *h = Holder {
                    queued: h.queued,
                    ..fresh
                };
                h
            }
            None if self.first.is_none() => self.first.insert(fresh),
            None => self.push_more(fresh, extra),
        };
        meta.holders += 1;
        meta.predicted += usize::from(holder.queued);
        (holder, true)
    }

    /// Drops the holders that `keep` rejects, taking live ones out of `metas`' counters
    /// and overflow ones out of `extra`. Allocates only when a holder goes.
    fn retain_holders(
        &mut self,
        metas: &mut [InstanceMeta],
        extra: &mut usize,
        mut keep: impl FnMut(&Holder, &InstanceMeta) -> bool,
    ) {
        let mut sig = self.sig;
        let mut verdict = |h: &Holder| {
            let meta = &mut metas[h.instance as usize];
            let kept = keep(h, meta);
            if !kept {
                meta.uncount(h);
                sig = sig.wrapping_sub(holder_sig(h));
            }
            kept
        };
        // Compact the kept overflow holders to the front, in order.
        let len = self.more_len();
        let mut kept = 0;
        let first_kept = self.first.as_ref().is_none_or(&mut verdict);
        for i in 0..len {
            if verdict(&self.more[i]) {
                self.more[kept] = self.more[i];
                kept += 1;
            }
        }
        if !first_kept {
            self.first = if kept == 0 {
                None
            } else {
                let next = self.more[0];
                self.more.copy_within(1..kept, 0);
                kept -= 1;
                Some(next)
            };
        }
        self.sig = sig;
        self.set_more_len(kept);
        // Give memory back once a list is at most a quarter full.
        if kept * 4 <= self.more.len() && kept < len {
            let room = self.more.len();
            self.more = self.more[..kept].to_vec().into_boxed_slice();
            *extra -= room - kept;
        }
    }

    /// Drops holders that hold nothing at `now` and wait for no expiry, and stale ones.
    fn prune(&mut self, now: u64, metas: &mut [InstanceMeta], extra: &mut usize) {
        self.retain_holders(metas, extra, |h, meta| meta.tiers(h, now) != 0 || h.queued);
    }

    fn is_empty(&self) -> bool {
        self.first.is_none() && !self.in_l2() && self.children == 0
    }
}

/// Per-instance result of a match; depths are cumulative (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct InstanceMatch {
    pub instance: InstanceId,
    /// Leading blocks in this instance's GPU memory.
    pub gpu: u32,
    /// Leading blocks in its GPU or host memory.
    pub l1: u32,
    /// Leading blocks in its GPU or host memory or the global L2 store.
    pub l2: u32,
    /// Of `gpu`, the leading blocks an agent reported (observed); the rest of `gpu` is
    /// predicted from routing decisions.
    #[serde(default)]
    pub observed_gpu: u32,
    /// When the deepest block predicted on this instance was last routed there (0: no
    /// prediction counted). An engine reporting fewer cached tokens than predicted
    /// evicted what it was sent then (see [`PrefixIndex::forget_predictions_before`]).
    #[serde(skip)]
    pub predicted_at: u64,
}

/// Result of [`PrefixIndex::match_prefix`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MatchResult {
    /// Blocks asked about.
    pub blocks: u32,
    /// Leading blocks the global L2 store holds (what any instance can load).
    pub global_l2: u32,
    /// Leading blocks that are a *shared* prefix: the deepest block of the query that the
    /// index saw continued in two or more ways (a system prompt, a template, a repository
    /// context), or 0. What an instance holds beyond it is the request's own history.
    pub shared: u32,
    /// Instances that hold at least the first block somewhere, or that hold a later block
    /// reachable through L2, in order of first appearance.
    pub instances: Vec<InstanceMatch>,
}

impl MatchResult {
    /// Depths of `instance`, including those of instances not listed.
    pub fn of(&self, instance: InstanceId) -> InstanceMatch {
        self.instances
            .iter()
            .find(|m| m.instance == instance)
            .copied()
            .unwrap_or(InstanceMatch {
                instance,
                l2: self.global_l2,
                ..InstanceMatch::default()
            })
    }
}

/// Keys folded into the walk of an earlier one in [`PrefixIndex::match_into`]: every
/// depth that key raised to `at` is raised by `keys` more.
#[derive(Clone, Copy, Debug, Default)]
struct Fold {
    /// The depth the walked key raised its holders' runs to; 0: nothing folded.
    at: u32,
    keys: u32,
    /// The walked key's node, whose holders are the instances raised.
    node: u32,
    /// Whether the keys are in the global L2 store: then every instance's L2 run (and the
    /// global one) at `at` is raised too.
    in_l2: bool,
}

impl Fold {
    /// Folds the key at depth `d`, whose holders repeat those of the key before it, `prev`.
    fn extend(&mut self, d: u32, prev: u32, in_l2: bool) {
        if self.keys == 0 {
            *self = Fold {
                at: d,
                keys: 1,
                node: prev,
                in_l2,
            };
        } else {
            self.keys += 1;
        }
    }

    /// Raises the depths the folded keys extend; done before any other key is walked.
    fn flush(
        &mut self,
        nodes: &[Node],
        slot_of: &[u32],
        result: &mut MatchResult,
        chain: &mut Chain,
    ) {
        if self.keys == 0 {
            return;
        }
        if self.in_l2 {
            // It raises every instance's L2 depth: the chain's members first.
            chain.finish(result);
        }
        let (at, to) = (self.at, self.at + self.keys);
        let raise = |v: &mut u32| {
            if *v == at {
                *v = to;
            }
        };
        for h in nodes[self.node as usize].holders() {
            if let Some(&pos) = slot_of.get(h.instance as usize).filter(|&&p| p != NONE) {
                chain.touch(pos as usize, result);
                let m = &mut result.instances[pos as usize];
                raise(&mut m.gpu);
                raise(&mut m.l1);
                raise(&mut m.l2);
                raise(&mut m.observed_gpu);
            }
        }
        if self.in_l2 {
            for m in result.instances.iter_mut() {
                raise(&mut m.l2);
            }
            raise(&mut result.global_l2);
        }
        *self = Fold::default();
    }
}

/// Gate bits of a chain member ([`Chain`]): which of its depths the base key raised, and
/// how. `G_OBS`, `G_GPU`, `G_L1`, `G_L2`: a depth at least the key's `from` goes to its end;
/// `G_PRED`: a prediction, raising the GPU, L1 and L2 depths to the end whatever they were.
const G_OBS: u8 = 1;
const G_GPU: u8 = 2;
const G_L1: u8 = 4;
const G_L2: u8 = 8;
const G_PRED: u8 = 16;
/// The member's depths are still as the base key left them (the chain's folds not applied).
const G_LAZY: u8 = 128;

/// Reported keys folded into the walk of an earlier reported key (the base) across the
/// unreported keys between them, in [`PrefixIndex::match_into`]: where agents report one
/// key in several, a prefix observed on thousands of instances has the same holders on
/// each reported key, and other holders (or none) on the keys between.
///
/// A reported key `d` whose holders repeat the base's, and whose `from` is the end of the
/// chain's last key, raises each holder's gated depths that reach `from` to `d + 1`, as the
/// base did. A member nothing has touched since the base ("lazy") has its gated depths at
/// the base's end or below it, so the chain's folds compose into one: depths at least the
/// base's end go to the last folded key's end, applied when something reads the member or
/// the chain ends. A member a key between has read or moved is applied each fold at once
/// ("eager").
#[derive(Clone, Debug, Default)]
struct Chain {
    /// The base key's node (while [`Chain::active`]).
    base: u32,
    /// The base key's end, and the end of the last key folded (where a lazy member's depths
    /// at least `base_end` stand).
    base_end: u32,
    end: u32,
    /// Result positions of the instances the base key raised, and those touched since.
    members: Vec<u32>,
    eager: Vec<u32>,
    /// Gate bits ([`G_OBS`] …) by result position; 0 for non-members.
    gate: Vec<u8>,
    /// The base's prediction time of each [`G_PRED`] member, by result position.
    predicted_at: Vec<u64>,
}

impl Chain {
    fn active(&self) -> bool {
        !self.members.is_empty()
    }

    /// Starts a chain at the reported key walked at depth `d`; [`Chain::join`] then records
    /// what that walk raised.
    fn start(&mut self, node: u32, d: u32) {
        debug_assert!(self.members.is_empty());
        self.base = node;
        self.base_end = d + 1;
        self.end = d + 1;
    }

    /// The base's walk raised the depths in `gate` of the member at `pos`.
    fn join(&mut self, pos: usize, gate: u8, predicted_at: u64) {
        if self.gate.len() <= pos {
            self.gate.resize(pos + 1, 0);
            self.predicted_at.resize(pos + 1, 0);
        }
        if self.gate[pos] == 0 {
            self.members.push(pos as u32);
        }
        self.gate[pos] = gate | G_LAZY;
        self.predicted_at[pos] = predicted_at;
    }

    /// Brings the member at `pos`, if lazy, up to the chain's folds, before it is read or
    /// moved by anything else.
    fn touch(&mut self, pos: usize, result: &mut MatchResult) {
        let Some(g) = self.gate.get(pos).copied().filter(|g| g & G_LAZY != 0) else {
            return;
        };
        self.gate[pos] = g & !G_LAZY;
        self.eager.push(pos as u32);
        let (at, to) = (self.base_end, self.end);
        let m = &mut result.instances[pos];
        let raise = |v: &mut u32, on: bool| {
            if on && *v >= at {
                *v = to;
            }
        };
        raise(&mut m.observed_gpu, g & G_OBS != 0);
        raise(&mut m.gpu, g & (G_GPU | G_PRED) != 0);
        raise(&mut m.l1, g & (G_L1 | G_PRED) != 0);
        raise(&mut m.l2, g & (G_L2 | G_PRED) != 0);
    }

    /// Folds the reported key at depth `d` (whose `from` is `self.end`): the eager members
    /// as the walk would, the lazy ones by moving the chain's end.
    fn fold(&mut self, d: u32, result: &mut MatchResult) {
        let from = self.end;
        for &pos in &self.eager {
            let g = self.gate[pos as usize];
            let m = &mut result.instances[pos as usize];
            if g & G_OBS != 0 && m.observed_gpu >= from {
                m.observed_gpu = d + 1;
            }
            if g & G_PRED != 0 {
                m.predicted_at = self.predicted_at[pos as usize];
                m.gpu = m.gpu.max(d + 1);
                m.l1 = m.l1.max(d + 1);
                m.l2 = m.l2.max(d + 1);
                continue;
            }
            if g & G_GPU != 0 && m.gpu >= from {
                m.gpu = d + 1;
            }
            if g & G_L1 != 0 && m.l1 >= from {
                m.l1 = d + 1;
            }
            if g & G_L2 != 0 && m.l2 >= from {
                m.l2 = d + 1;
            }
        }
        self.end = d + 1;
    }

    /// Ends the chain, bringing every lazy member up to its folds.
    fn finish(&mut self, result: &mut MatchResult) {
        for i in 0..self.members.len() {
            let pos = self.members[i] as usize;
            self.touch(pos, result);
            self.gate[pos] = 0;
        }
        self.members.clear();
        self.eager.clear();
    }
}

/// Reusable buffers for matching without allocating on the request path.
#[derive(Clone, Debug, Default)]
pub struct MatchScratch {
    /// Position in `result.instances` of each instance's candidate, by instance id;
    /// `NONE` if absent.
    slot_of: Vec<u32>,
    /// `(depth, slot, from, tail)` of the query's keys found in the index, in depth order;
    /// `from`: the depth a run must reach for the key to extend it; `tail`: for a key
    /// agents do not report, the end of the query's previous reported key, else `NONE`
    /// (see [`PrefixIndex::match_into`]).
    path: Vec<(u32, u32, u32, u32)>,
    pub result: MatchResult,
    chain: Chain,
    /// Walk every key (tests compare it with the folded walk).
    #[cfg(test)]
    no_fold: bool,
}

impl MatchScratch {
    /// Depths of `instance` in the last match, including instances not listed.
    pub fn of(&self, instance: InstanceId) -> InstanceMatch {
        match self.slot_of.get(instance.0 as usize) {
            Some(&slot) if slot != NONE => self.result.instances[slot as usize],
            _ => InstanceMatch {
                instance,
                l2: self.result.global_l2,
                ..InstanceMatch::default()
            },
        }
    }
}

/// Counts that describe an index's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub struct IndexStats {
    pub entries: usize,
    pub capacity_blocks: usize,
    /// (instance, block) pairs currently recorded, observed or predicted.
    pub holders: usize,
    /// Holders with a prediction from a routing decision (this router's or a peer's) that
    /// has not been swept yet.
    pub predicted_holders: usize,
    /// Holders an agent observed in some tier.
    pub observed_holders: usize,
    pub l2_blocks: usize,
    pub evictions: u64,
    /// Estimated heap bytes per entry, map slot and holders included.
    pub bytes_per_entry: usize,
}

/// The prefix index. See the module docs.
#[derive(Debug)]
pub struct PrefixIndex {
    config: IndexConfig,
    /// Slot of each live key. The table stores only the slot number (4 bytes), so it is
    /// small enough to stay in cache; the key is compared in the node itself.
    slots: HashTable<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Leaf LRU: `lru_head` is the least recently written leaf.
    lru_head: u32,
    lru_tail: u32,
    /// (expiry, node, key, instance) of predicted holders, in expiry order (the TTL is
    /// fixed, so insertion order is expiry order).
    expiry: VecDeque<(u64, u32, BlockKey, u32)>,
    /// Generation, horizon and holder counters of each instance, by id (the index-wide
    /// counts are their sums).
    metas: Vec<InstanceMeta>,
    /// Slots of the overflow lists (`Node::more`), in use (stale holders included) or room
    /// to grow: what they take in memory.
    extra_holders: usize,
    l2_blocks: usize,
    evictions: u64,
}

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Self {
        PrefixIndex {
            config: IndexConfig {
                capacity_blocks: config.capacity_blocks.max(1),
                ..config
            },
            slots: HashTable::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            lru_head: NONE,
            lru_tail: NONE,
            expiry: VecDeque::new(),
            metas: Vec::new(),
            extra_holders: 0,
            l2_blocks: 0,
            evictions: 0,
        }
    }

    /// The state of `instance`, created on first use.
    fn meta_mut(&mut self, instance: u32) -> &mut InstanceMeta {
        let i = instance as usize;
        if i >= self.metas.len() {
            self.metas.resize(i + 1, InstanceMeta::default());
        }
        &mut self.metas[i]
    }

    /// Runs `f` on the holder of `instance` in node `idx` (created, or revived if stale)
    /// and keeps the instance's counters in step with what `f` changes. Returns `f`'s
    /// result and whether the holder is new.
    fn with_holder<R>(
        &mut self,
        idx: u32,
        instance: u32,
        hint: &mut usize,
        f: impl FnOnce(&mut Holder, &mut VecDeque<(u64, u32, BlockKey, u32)>) -> R,
    ) -> (R, bool) {
        self.meta_mut(instance);
        let meta = &mut self.metas[instance as usize];
        let node = &mut self.nodes[idx as usize];
        let (holder, created) =
            node.holder_or_insert(instance, meta, &mut self.extra_holders, hint);
        let (was_queued, was_observed) = (holder.queued, holder.observed != 0);
        let was_host_only = !created && host_only(holder);
        let out = f(holder, &mut self.expiry);
        let (queued, observed) = (holder.queued, holder.observed != 0);
        meta.predicted = meta.predicted + usize::from(queued) - usize::from(was_queued);
        meta.observed = meta.observed + usize::from(observed) - usize::from(was_observed);
        meta.host_only =
            meta.host_only + usize::from(host_only(holder)) - usize::from(was_host_only);
        let sig = holder_sig(holder);
        node.sig = node.sig.wrapping_add(sig);
        (out, created)
    }

    /// Drops holders of node `idx` that hold nothing at `now`, or are stale.
    fn prune_node(&mut self, idx: u32, now: u64) {
        self.nodes[idx as usize].prune(now, &mut self.metas, &mut self.extra_holders);
    }

    /// Live holders of `instance` (blocks it holds or is predicted to hold): how much of
    /// the cache routing has placed there. O(1).
    pub fn holders_of(&self, instance: InstanceId) -> usize {
        self.metas.get(instance.0 as usize).map_or(0, |m| m.holders)
    }

    /// About how many blocks `instance` holds or is predicted to hold when agents report
    /// one key in `every` (the [`Reporting::base`] rate of [`PrefixIndex::reporting`]): each
    /// block observed stands for `every` blocks of the engine's cache, the unreported ones
    /// around it (record 0115), so a cache seen through a sampling agent is not taken for
    /// `1 / every` of its size once the predictions that named the rest expire; the live
    /// holders when they say more (recent predictions, not yet observed). Deep in long
    /// chains a reported key stands for more than `every` blocks (record 0122), so such
    /// caches are still undercounted. O(1).
    pub fn held_blocks_of(&self, instance: InstanceId, every: u32) -> usize {
        self.metas.get(instance.0 as usize).map_or(0, |m| {
            m.holders
                .max(m.observed.saturating_mul(every.max(1) as usize))
        })
    }

    /// Of [`PrefixIndex::holders_of`], the blocks `instance` holds or is predicted to hold
    /// on its GPU: all but those observed in its host memory alone. O(1).
    pub fn gpu_holders_of(&self, instance: InstanceId) -> usize {
        self.metas
            .get(instance.0 as usize)
            .map_or(0, |m| m.holders - m.host_only)
    }

    /// Makes predictions on `instance` last refreshed at or before `t` stop matching (its
    /// engine evicted what it was sent then). O(1); the horizon only moves forward.
    pub fn forget_predictions_before(&mut self, instance: InstanceId, t: u64) {
        let ttl = self.config.predicted_ttl_us;
        let meta = self.meta_mut(instance.0);
        meta.prediction_floor = meta.prediction_floor.max(t.saturating_add(ttl));
    }

    pub fn config(&self) -> IndexConfig {
        self.config
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, key: BlockKey) -> bool {
        self.slot(key).is_some()
    }

    /// The slot of `key`, if the index holds it.
    fn slot(&self, key: BlockKey) -> Option<u32> {
        self.slots
            .find(hash_key(key), |&i| self.nodes[i as usize].key == key)
            .copied()
    }

    /// Records that `instance` was just sent a prompt with these keys: predicts it holds
    /// every block in GPU memory until `now + predicted_ttl_us`.
    ///
    /// Returns how many leading keys the index already knew `instance` to hold, with a
    /// prediction at least half its TTL from expiry (or an agent's observation): what a
    /// router needs to tell its peers is `keys[returned..]` (plus the key before it, to
    /// link the chain).
    pub fn record_route(&mut self, keys: &[BlockKey], instance: InstanceId, now: u64) -> usize {
        self.record(keys, instance, now, true)
    }

    /// Records a peer router's decision: `keys` are a sample of a prompt's keys (see
    /// [`sparse_keys`]), so they are not linked as parent and child: a sampled key's
    /// neighbour in the list is not its parent, and linking them would make the index
    /// see branches (shared prefixes) that are not there.
    pub fn record_shared(&mut self, keys: &[BlockKey], instance: InstanceId, now: u64) {
        self.record(keys, instance, now, false);
    }

    fn record(&mut self, keys: &[BlockKey], instance: InstanceId, now: u64, linked: bool) -> usize {
        let until = now.saturating_add(self.config.predicted_ttl_us);
        let fresh_after = now.saturating_add(self.config.predicted_ttl_us / 2);
        // A key names its whole prefix: what the deepest key known (and fresh) names is
        // known, even where a peer shared only a sample of the keys before it.
        let mut known = 0;
        let mut parent = NONE;
        let floor = self.meta_mut(instance.0).prediction_floor;
        let mut hint = usize::MAX;
        for (d, &key) in keys.iter().enumerate() {
            let idx = self.ensure(key, parent);
            let (was_known, created) =
                self.with_holder(idx, instance.0, &mut hint, |holder, expiry| {
                    let was_known = holder.observed & GPU != 0
                        || (holder.predicted_until > fresh_after && holder.predicted_until > floor);
                    holder.predicted_until = until;
                    if !holder.queued {
                        holder.queued = true;
                        expiry.push_back((until, idx, key, instance.0));
                    }
                    was_known
                });
            if !created && was_known {
                known = d + 1;
            }
            if linked {
                parent = idx;
            }
        }
        known
    }

    /// Applies an agent's observation: `instance` now holds (or no longer holds) `key` in
    /// `tier` (GPU or L1). `parent` is the key of the previous block of the prefix, if any.
    /// A removal from GPU also drops any prediction: the agent knows better.
    pub fn observe(
        &mut self,
        instance: InstanceId,
        key: BlockKey,
        parent: Option<BlockKey>,
        tier: crate::cost::Tier,
        present: bool,
        now: u64,
    ) {
        use crate::cost::Tier;
        let bit = match tier {
            Tier::Gpu => GPU,
            Tier::L1 => L1,
            Tier::L2 => return self.observe_l2(key, parent, present),
        };
        if present {
            let parent_idx = parent.and_then(|p| self.slot(p)).unwrap_or(NONE);
            let idx = self.ensure(key, parent_idx);
            let mut hint = usize::MAX;
            self.with_holder(idx, instance.0, &mut hint, |holder, _| {
                holder.observed |= bit
            });
        } else if let Some(idx) = self.slot(key) {
            self.meta_mut(instance.0);
            let meta = &mut self.metas[instance.0 as usize];
            self.nodes[idx as usize].update_holder(instance.0, |holder| {
                if holder.gen == meta.gen {
                    let was_observed = holder.observed != 0;
                    let was_host_only = host_only(holder);
                    holder.observed &= !bit;
                    if bit == GPU {
                        holder.predicted_until = 0;
                    }
                    let now_observed = holder.observed != 0;
                    meta.observed -= usize::from(was_observed && !now_observed);
                    meta.host_only = meta.host_only + usize::from(host_only(holder))
                        - usize::from(was_host_only);
                }
            });
            self.prune_node(idx, now);
            self.remove_if_empty(idx);
        }
    }

    /// Applies an observation of the global L2 store.
    pub fn observe_l2(&mut self, key: BlockKey, parent: Option<BlockKey>, present: bool) {
        if present {
            let parent_idx = parent.and_then(|p| self.slot(p)).unwrap_or(NONE);
            let idx = self.ensure(key, parent_idx);
            let node = &mut self.nodes[idx as usize];
            if !node.in_l2() {
                node.set_in_l2(true);
                self.l2_blocks += 1;
            }
        } else if let Some(idx) = self.slot(key) {
            let node = &mut self.nodes[idx as usize];
            if node.in_l2() {
                node.set_in_l2(false);
                self.l2_blocks -= 1;
            }
            self.remove_if_empty(idx);
        }
    }

    /// Forgets everything recorded for `instance` (it left the pool, failed or
    /// restarted). O(1): its generation moves on, so what it held stops matching at once
    /// and is dropped lazily (see the module docs).
    pub fn remove_instance(&mut self, instance: InstanceId) {
        let meta = self.meta_mut(instance.0);
        *meta = InstanceMeta {
            gen: meta.gen.wrapping_add(1),
            ..InstanceMeta::default()
        };
    }

    /// Drops predictions that expired at `now`, and entries left holding nothing.
    /// Cheap when nothing expired; call it before writes or periodically.
    pub fn expire(&mut self, now: u64) {
        while let Some(&(until, idx, key, instance)) = self.expiry.front() {
            if until > now {
                break;
            }
            self.expiry.pop_front();
            // The slot may have been freed, or reused by another key, since.
            if self.slot(key) != Some(idx) {
                continue;
            }
            let meta = &mut self.metas[instance as usize];
            let refreshed = self.nodes[idx as usize].update_holder(instance, |holder| {
                let live = meta.live(holder);
                if live && holder.predicted_until > now {
                    return Some(holder.predicted_until);
                }
                if live && holder.queued {
                    meta.predicted -= 1;
                    meta.host_only += usize::from(holder.observed == L1);
                }
                holder.queued = false;
                holder.predicted_until = 0;
                None
            });
            match refreshed {
                None => continue,
                Some(Some(until)) => {
                    // Refreshed since: wait for the new expiry.
                    self.expiry.push_back((until, idx, key, instance));
                    continue;
                }
                Some(None) => {}
            }
            self.prune_node(idx, now);
            self.remove_if_empty(idx);
        }
    }

    /// Per-instance matched depths of `keys` at `now`, into `scratch.result`.
    ///
    /// Observed blocks count only as a run from the first block, and agents report the keys
    /// [`PrefixIndex::reporting`] picks at each depth of the pool's `block_tokens` (records
    /// 0115, 0117, 0122: one in 4 of 16-token blocks, fewer deep in long chains):
    /// a block whose key is reported
    /// extends an instance's run when the run reaches the end of the query's previous
    /// reported key (or the query's start), so it is credited for the unreported blocks
    /// before it; any other observed block extends a run that reaches it. A reported key
    /// that is missing breaks the run. Past a run's last reported key, the unreported
    /// blocks this router sent the instance extend it even after their predictions retired
    /// (an observed engine's do, record 0088), up to the next reported key: no agent
    /// reports them, and without them a run would lose its tail. With every key reported
    /// this is a contiguous run, and an agent that reports every block (one predating
    /// 0115, or `--residency-every-block`) is matched as before. A predicted block counts
    /// for its whole prefix: the
    /// instance was sent a prompt with that prefix, and a key names its whole prefix. So
    /// predictions may be sparse (peers share only some keys of each decision) and still
    /// match: the walk goes on past missing keys.
    ///
    /// Cost: a key whose holders are those of the key before it, in the same states (a
    /// prompt's blocks are routed, refreshed and expire together), is not walked but
    /// folded into that key's walk (a signature of each node's holders tells, without
    /// reading either list), so a system prompt held by thousands of instances costs one
    /// walk of its holders per reported key rather than one per key.
    pub fn match_into(
        &self,
        keys: &[BlockKey],
        block_tokens: u32,
        now: u64,
        scratch: &mut MatchScratch,
    ) {
        let MatchScratch {
            slot_of,
            path,
            result,
            chain,
            ..
        } = scratch;
        #[cfg(test)]
        let folding = !scratch.no_fold;
        #[cfg(not(test))]
        let folding = true;
        let ttl = self.config.predicted_ttl_us;
        for m in &result.instances {
            slot_of[m.instance.0 as usize] = NONE;
        }
        result.instances.clear();
        result.blocks = keys.len() as u32;
        result.global_l2 = 0;
        result.shared = 0;
        // Resolve the path first: the lookups are independent, so the CPU overlaps their
        // cache misses instead of taking them one walk step at a time.
        path.clear();
        let reporting = self.reporting(block_tokens);
        // The end of the previous reported key of the query (0 before the first).
        let mut reported_end = 0;
        path.extend(keys.iter().enumerate().filter_map(|(d, &k)| {
            let d = d as u32;
            let (from, tail) = if reporting.reported(k, Some(d + 1)) {
                (std::mem::replace(&mut reported_end, d + 1), NONE)
            } else {
                (d, reported_end)
            };
            self.slot(k).map(|slot| (d, slot, from, tail))
        }));
        // Likewise load the overflow holder lists (hot prefixes have many holders) together.
        let warm = path.iter().fold(0, |acc, &(_, i, _, _)| {
            acc ^ self.nodes[i as usize]
                .more()
                .first()
                .map_or(0, |h| h.instance)
        });
        std::hint::black_box(warm);
        // Keys whose holders repeat the previous key's exactly (a prefix routed and evicted
        // as one: a system prompt on thousands of instances) extend exactly what that key
        // extended, so such a run is walked once and its depths raised together
        // (`Fold`): the same result, in time linear in the holders rather than in holders
        // times keys.
        let mut fold = Fold::default();
        // Reported keys whose holders repeat an earlier reported key's across unreported
        // keys (a prefix agents observe on thousands of instances): `Chain`.
        debug_assert!(!chain.active(), "every match finishes its chain");
        // A run (every depth below is at most `d` here) that reaches `from` extends to d + 1.
        for (j, &(d, idx, from, tail)) in path.iter().enumerate() {
            let node = &self.nodes[idx as usize];
            if node.children >= 2 {
                result.shared = d + 1;
            }
            let reported = tail == NONE;
            // An unreported key can fold into the key right before it: it extends only what
            // reaches its own depth (`from == d`), so what is at depth `d` after the key
            // before is exactly what that key extended, and this one extends the same.
            if folding && !reported && j > 0 {
                let (pd, pidx, _, _) = path[j - 1];
                let prev = &self.nodes[pidx as usize];
                if pd + 1 == d && node.matches_like(prev) {
                    debug_assert!(node.same_holders_as(prev), "signatures collided");
                    fold.extend(d, pidx, node.in_l2());
                    continue;
                }
            }
            // A reported key can fold into the chain whose last key is the query's previous
            // reported key, when its holders are the chain's base's.
            if folding && reported && chain.active() && from == chain.end {
                let base = &self.nodes[chain.base as usize];
                if node.matches_like(base) {
                    debug_assert!(node.same_holders_as(base), "signatures collided");
                    fold.flush(&self.nodes, slot_of, result, chain);
                    chain.fold(d, result);
                    continue;
                }
            }
            fold.flush(&self.nodes, slot_of, result, chain);
            // A reported key walked ends the chain; one not in L2 starts the next.
            if reported || node.in_l2() {
                chain.finish(result);
            }
            let base = folding && reported && !node.in_l2();
            if base {
                chain.start(idx, d);
            }
            for h in node.holders() {
                let meta = &self.metas[h.instance as usize];
                let tiers = meta.tiers(h, now);
                if tiers == 0 {
                    // The unreported tail of an observed run: a block this router sent the
                    // instance (its prediction retired because an agent observes it, and
                    // not expired) extends a run that observations brought to the last
                    // reported key before it. No agent reports the tail's blocks, nor
                    // their eviction; the next reported key must be observed again.
                    let inst = h.instance as usize;
                    if tail != NONE && meta.live(h) && now < h.predicted_until {
                        if let Some(&pos) = slot_of.get(inst).filter(|&&p| p != NONE) {
                            chain.touch(pos as usize, result);
                            let m = &mut result.instances[pos as usize];
                            if m.gpu == d && m.observed_gpu > 0 && m.observed_gpu >= tail {
                                m.gpu = d + 1;
                                m.l1 = m.l1.max(d + 1);
                                m.l2 = m.l2.max(d + 1);
                            }
                        }
                    }
                    continue;
                }
                let inst = h.instance as usize;
                if inst >= slot_of.len() {
                    slot_of.resize(inst + 1, NONE);
                }
                let pos = match slot_of[inst] {
                    NONE => {
                        slot_of[inst] = result.instances.len() as u32;
                        // A newcomer after the first block continues a run only through L2.
                        let l2 = if result.global_l2 >= from {
                            result.global_l2
                        } else {
                            0
                        };
                        result.instances.push(InstanceMatch {
                            instance: InstanceId(h.instance),
                            l2,
                            ..InstanceMatch::default()
                        });
                        result.instances.len() - 1
                    }
                    slot => {
                        chain.touch(slot as usize, result);
                        slot as usize
                    }
                };
                let m = &mut result.instances[pos];
                let observed_gpu = h.observed & GPU != 0;
                if observed_gpu && m.observed_gpu >= from {
                    m.observed_gpu = d + 1;
                }
                let obs = if observed_gpu { G_OBS } else { 0 };
                if meta.predicts(h, now) {
                    m.predicted_at = h.predicted_until.saturating_sub(ttl);
                    m.gpu = m.gpu.max(d + 1);
                    m.l1 = m.l1.max(d + 1);
                    m.l2 = m.l2.max(d + 1);
                    if base {
                        chain.join(pos, obs | G_PRED, m.predicted_at);
                    }
                    continue;
                }
                if tiers & GPU != 0 && m.gpu >= from {
                    m.gpu = d + 1;
                }
                if m.l1 >= from {
                    m.l1 = d + 1;
                }
                if m.l2 >= from {
                    m.l2 = d + 1;
                }
                if base {
                    let gpu = if tiers & GPU != 0 { G_GPU } else { 0 };
                    chain.join(pos, obs | gpu | G_L1 | G_L2, 0);
                }
            }
            if node.in_l2() {
                // Any instance can load this block from L2: it extends every run at `d`.
                for m in result.instances.iter_mut() {
                    if m.l2 >= from {
                        m.l2 = d + 1;
                    }
                }
                if result.global_l2 >= from {
                    result.global_l2 = d + 1;
                }
            }
        }
        fold.flush(&self.nodes, slot_of, result, chain);
        chain.finish(result);
    }

    /// Convenience form of [`PrefixIndex::match_into`] that allocates.
    pub fn match_prefix(&self, keys: &[BlockKey], block_tokens: u32, now: u64) -> MatchResult {
        let mut scratch = MatchScratch::default();
        self.match_into(keys, block_tokens, now, &mut scratch);
        scratch.result
    }

    /// Which keys agents report of a pool of `block_tokens`-token blocks
    /// ([`IndexConfig::reporting`]).
    pub fn reporting(&self, block_tokens: u32) -> Reporting {
        self.config.reporting(block_tokens)
    }

    pub fn stats(&self) -> IndexStats {
        let entries = self.slots.len();
        let extra_holders = self.extra_holders;
        let (mut holders, mut predicted_holders, mut observed_holders) = (0, 0, 0);
        for m in &self.metas {
            holders += m.holders;
            predicted_holders += m.predicted;
            observed_holders += m.observed;
        }
        let map_bytes = self.slots.capacity() * (std::mem::size_of::<u32>() + 1);
        let node_bytes = self.nodes.capacity() * std::mem::size_of::<Node>();
        let holder_bytes = extra_holders * std::mem::size_of::<Holder>();
        let expiry_bytes =
            self.expiry.capacity() * std::mem::size_of::<(u64, u32, BlockKey, u32)>();
        let total = map_bytes + node_bytes + holder_bytes + expiry_bytes;
        IndexStats {
            entries,
            capacity_blocks: self.config.capacity_blocks,
            holders,
            predicted_holders,
            observed_holders,
            l2_blocks: self.l2_blocks,
            evictions: self.evictions,
            bytes_per_entry: total.checked_div(entries).unwrap_or(0),
        }
    }

    /// The slot of `key`, created under `parent` (an index or `NONE`) if absent; either way
    /// it becomes the most recently written leaf, if a leaf.
    fn ensure(&mut self, key: BlockKey, parent: u32) -> u32 {
        if let Some(idx) = self.slot(key) {
            if self.nodes[idx as usize].children == 0 {
                self.lru_unlink(idx);
                self.lru_push_back(idx);
            }
            if parent != NONE && parent != idx && self.nodes[idx as usize].parent == NONE {
                // Created without its parent (an agent that samples reports none, a peer's
                // sample links none): a chain that names it adopts it, so the index sees
                // the branches there are and keeps the prefix while the block lives.
                self.link(idx, parent);
            }
            return idx;
        }
        let mut parent = parent;
        while self.slots.len() >= self.config.capacity_blocks {
            // The parent goes last: only when the capacity is below the prompt's length.
            if self.evict_one(parent) {
                continue;
            }
            if !self.evict_one(NONE) {
                break;
            }
            parent = NONE;
        }
        let node = Node {
            key,
            parent,
            children: 0,
            first: None,
            more: Box::default(),
            len_l2: 0,
            sig: 0,
            prev: NONE,
            next: NONE,
        };
        let idx = match self.free.pop() {
            Some(idx) => {
                self.nodes[idx as usize] = node;
                idx
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        let nodes = &self.nodes;
        self.slots
            .insert_unique(hash_key(key), idx, |&i| hash_key(nodes[i as usize].key));
        if parent != NONE {
            self.link(idx, parent);
        }
        self.lru_push_back(idx);
        idx
    }

    /// Makes `parent` the parent of the parentless `idx`.
    fn link(&mut self, idx: u32, parent: u32) {
        let p = &mut self.nodes[parent as usize];
        if p.children == 0 {
            self.lru_unlink(parent);
        }
        self.nodes[parent as usize].children += 1;
        self.nodes[idx as usize].parent = parent;
    }

    /// Evicts the least recently written leaf other than `keep`; false if none.
    fn evict_one(&mut self, keep: u32) -> bool {
        let mut victim = self.lru_head;
        if victim == keep && victim != NONE {
            // A parent freed by an eviction goes to the front, so `keep` can only be first.
            victim = self.nodes[victim as usize].next;
        }
        if victim == NONE {
            return false;
        }
        let node = &self.nodes[victim as usize];
        for h in node.holders() {
            self.metas[h.instance as usize].uncount(h);
        }
        if node.in_l2() {
            self.l2_blocks -= 1;
        }
        self.evictions += 1;
        self.remove_node(victim);
        true
    }

    fn remove_if_empty(&mut self, mut idx: u32) {
        while idx != NONE && self.nodes[idx as usize].is_empty() {
            let parent = self.nodes[idx as usize].parent;
            self.remove_node(idx);
            idx = parent;
        }
    }

    /// Unlinks a leaf from the map, its parent and the LRU, and frees its slot.
    fn remove_node(&mut self, idx: u32) {
        debug_assert_eq!(self.nodes[idx as usize].children, 0);
        self.lru_unlink(idx);
        let key = self.nodes[idx as usize].key;
        let parent = self.nodes[idx as usize].parent;
        let nodes = &self.nodes;
        if let Ok(entry) = self
            .slots
            .find_entry(hash_key(key), |&i| nodes[i as usize].key == key)
        {
            entry.remove();
        }
        let node = &mut self.nodes[idx as usize];
        node.clear_more(&mut self.extra_holders);
        node.first = None;
        node.len_l2 = 0;
        node.sig = 0;
        node.parent = NONE;
        self.free.push(idx);
        if parent != NONE {
            let p = &mut self.nodes[parent as usize];
            p.children -= 1;
            if p.children == 0 {
                // A parent whose suffixes are gone is the coldest leaf now.
                self.lru_push_front(parent);
            }
        }
    }

    fn lru_unlink(&mut self, idx: u32) {
        let (prev, next) = {
            let n = &self.nodes[idx as usize];
            (n.prev, n.next)
        };
        if prev == NONE && next == NONE && self.lru_head != idx {
            return; // not linked
        }
        match prev {
            NONE => self.lru_head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NONE => self.lru_tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
        let n = &mut self.nodes[idx as usize];
        n.prev = NONE;
        n.next = NONE;
    }

    fn lru_push_back(&mut self, idx: u32) {
        let tail = self.lru_tail;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = tail;
            n.next = NONE;
        }
        match tail {
            NONE => self.lru_head = idx,
            t => self.nodes[t as usize].next = idx,
        }
        self.lru_tail = idx;
    }

    fn lru_push_front(&mut self, idx: u32) {
        let head = self.lru_head;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = NONE;
            n.next = head;
        }
        match head {
            NONE => self.lru_tail = idx,
            h => self.nodes[h as usize].prev = idx,
        }
        self.lru_head = idx;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Tier;
    use proptest::prelude::*;

    /// vLLM's default block size: the protocol reports one key in 4 of it.
    const BT: u32 = 16;

    fn k(i: u64) -> BlockKey {
        BlockKey(i)
    }

    fn keys(ids: &[u64]) -> Vec<BlockKey> {
        ids.iter().map(|&i| k(i)).collect()
    }

    /// One step of building an index for a test case.
    enum Op {
        Route(&'static [u64], u32),
        Observe(u32, u64, Option<u64>, Tier, bool),
        RemoveInstance(u32),
        Expire(u64),
    }

    /// Applies `ops` at time 0 on an index with a 100-block capacity and a 1000 µs TTL, then
    /// matches `query` at `now` and compares `(instance, gpu, l1, l2)` rows and global L2.
    fn check(ops: &[Op], query: &[u64], now: u64, want: &[(u32, u32, u32, u32)], want_l2: u32) {
        let mut index = PrefixIndex::new(IndexConfig {
            capacity_blocks: 100,
            predicted_ttl_us: 1000,
            // Every key reported: these cases are written for contiguous runs (sampled
            // runs have their own cases below).
            report_every: Some(1),
        });
        for op in ops {
            match *op {
                Op::Route(ks, i) => {
                    index.record_route(&keys(ks), InstanceId(i), 0);
                }
                Op::Observe(i, key, parent, tier, present) => {
                    index.observe(InstanceId(i), k(key), parent.map(k), tier, present, 0)
                }
                Op::RemoveInstance(i) => index.remove_instance(InstanceId(i)),
                Op::Expire(t) => index.expire(t),
            }
        }
        let got = index.match_prefix(&keys(query), BT, now);
        let rows: Vec<_> = got
            .instances
            .iter()
            .map(|m| (m.instance.0, m.gpu, m.l1, m.l2))
            .collect();
        assert_eq!(rows, want, "instances");
        assert_eq!(got.global_l2, want_l2, "global l2");
        assert_eq!(got.blocks, query.len() as u32);
    }

    use Op::*;
    use Tier::{Gpu, L1 as HostL1, L2 as Remote};

    #[test]
    fn sparse_key_cases() {
        let ks = keys(&[0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(sparse_keys(&ks, 0), keys(&[3, 7, 8]));
        assert_eq!(sparse_keys(&ks, 4), keys(&[7, 8]));
        assert_eq!(sparse_keys(&ks, 9), keys(&[]));
        assert_eq!(sparse_keys(&keys(&[5]), 0), keys(&[5]));
        // Past the dense start the stride doubles with the depth.
        assert_eq!(share_stride(0), 4);
        assert_eq!(share_stride(511), 4);
        assert_eq!(share_stride(512), 8);
        assert_eq!(share_stride(1024), 16);
        assert_eq!(share_stride(2639), 32);
        let long: Vec<BlockKey> = (0..2640).map(BlockKey).collect();
        let shared = sparse_keys(&long, 0);
        assert_eq!(shared.len(), 128 + 64 + 64 + 19);
        assert_eq!(shared[..3], keys(&[3, 7, 11]));
        assert!(shared.contains(&BlockKey(519)) && !shared.contains(&BlockKey(515)));
        assert_eq!(shared.last(), Some(&BlockKey(2639)));
        // Every shared key stands for its prefix to within 1.6% of its depth.
        for w in shared.windows(2) {
            let gap = w[1].0 - w[0].0;
            assert!(
                gap <= 4 || gap as f64 <= w[1].0 as f64 / 64.0 + 1.0,
                "{w:?}"
            );
        }
    }

    #[test]
    fn a_decision_known_through_a_peers_sample_is_not_shared_again() {
        let mut index = PrefixIndex::new(IndexConfig::default());
        let ks: Vec<BlockKey> = (100..140).map(BlockKey).collect();
        // A peer shared its decision for instance 1: every fourth key and the last.
        index.record_shared(&sparse_keys(&ks, 0), InstanceId(1), 0);
        // This router sends the same prompt, one block longer, to instance 1: only what
        // follows the deepest key it knows is new.
        let mut longer = ks.clone();
        longer.push(BlockKey(140));
        assert_eq!(index.record_route(&longer, InstanceId(1), 1), 40);
        assert_eq!(sparse_keys(&longer, 40), keys(&[140]));
        // To another instance, all of it is new.
        assert_eq!(index.record_route(&longer, InstanceId(2), 1), 0);
    }

    #[test]
    fn sparse_predictions_match_their_whole_prefix() {
        // A peer shared only keys 2 and 5 of a six-block decision.
        check(
            &[Route(&[2, 5], 0)],
            &[1, 2, 3, 4, 5, 6],
            0,
            &[(0, 5, 5, 5)],
            0,
        );
        // A prompt that shares only the first three blocks still finds key 2.
        check(&[Route(&[2, 5], 0)], &[1, 2, 3, 9], 0, &[(0, 2, 2, 2)], 0);
        // Observed blocks stay contiguous: a gap stops them.
        check(
            &[
                Observe(1, 1, None, Gpu, true),
                Observe(1, 3, None, Gpu, true),
            ],
            &[1, 2, 3],
            0,
            &[(1, 1, 1, 1)],
            0,
        );
        // A prediction lifts an observed run past it.
        check(
            &[Route(&[2], 1), Observe(1, 3, Some(2), Gpu, true)],
            &[1, 2, 3, 4],
            0,
            &[(1, 3, 3, 3)],
            0,
        );
    }

    #[test]
    fn predicted_routes_match_longest_prefix() {
        check(
            &[Route(&[1, 2, 3], 0), Route(&[1, 2, 9], 1)],
            &[1, 2, 3, 4],
            0,
            &[(0, 3, 3, 3), (1, 2, 2, 2)],
            0,
        );
        // (Keys name whole prefixes: a prompt with another first block has other keys.)
        check(&[Route(&[1, 2, 3], 0)], &[5, 6, 7], 0, &[], 0);
        check(&[], &[1], 0, &[], 0);
        check(&[Route(&[1, 2], 0)], &[], 0, &[], 0);
    }

    #[test]
    fn predictions_expire() {
        check(&[Route(&[1, 2], 0)], &[1, 2], 999, &[(0, 2, 2, 2)], 0);
        check(&[Route(&[1, 2], 0)], &[1, 2], 1000, &[], 0);
        check(&[Route(&[1, 2], 0), Expire(1000)], &[1, 2], 0, &[], 0);
        // Observed blocks outlive the prediction.
        check(
            &[
                Route(&[1, 2], 0),
                Observe(0, 1, None, Gpu, true),
                Expire(5000),
            ],
            &[1, 2],
            5000,
            &[(0, 1, 1, 1)],
            0,
        );
    }

    #[test]
    fn tiers_are_cumulative() {
        let ops = [
            Observe(0, 1, None, Gpu, true),
            Observe(0, 2, Some(1), HostL1, true),
            Observe(0, 3, Some(2), Remote, true),
            Observe(1, 1, None, HostL1, true),
        ];
        check(&ops, &[1, 2, 3, 4], 0, &[(0, 1, 2, 3), (1, 0, 1, 1)], 0);
    }

    #[test]
    fn observed_gpu_depth_is_told_apart_from_predictions() {
        use crate::cost::Tier;
        let mut idx = PrefixIndex::new(IndexConfig::default());
        let keys: Vec<BlockKey> = (1..=4).map(BlockKey).collect();
        idx.record_route(&keys, InstanceId(0), 0);
        idx.observe(InstanceId(0), BlockKey(1), None, Tier::Gpu, true, 0);
        idx.observe(
            InstanceId(0),
            BlockKey(2),
            Some(BlockKey(1)),
            Tier::Gpu,
            true,
            0,
        );
        let m = idx.match_prefix(&keys, BT, 1).of(InstanceId(0));
        assert_eq!((m.gpu, m.observed_gpu), (4, 2));
        // Observed only: a gap stops the observed run. (With every key reported: where one
        // in `report_every` is, a reported key after a gap vouches for the prefix it names,
        // and key 3 is reported; see `a_sampled_run_is_credited_from_one_reported_key_to_the_next`.)
        let mut idx = PrefixIndex::new(IndexConfig {
            report_every: Some(1),
            ..IndexConfig::default()
        });
        idx.observe(InstanceId(1), BlockKey(1), None, Tier::Gpu, true, 0);
        idx.observe(
            InstanceId(1),
            BlockKey(3),
            Some(BlockKey(2)),
            Tier::Gpu,
            true,
            0,
        );
        let m = idx.match_prefix(&keys, BT, 1).of(InstanceId(1));
        assert_eq!((m.gpu, m.observed_gpu), (1, 1));
    }

    /// An index whose agents report one key in `every`.
    fn reporting_every(every: u32) -> PrefixIndex {
        PrefixIndex::new(IndexConfig {
            report_every: Some(every),
            ..IndexConfig::default()
        })
    }

    /// A chain of `n` keys and the depths of those reported at one in `every`.
    fn reported_chain(n: u64, every: u32) -> (Vec<BlockKey>, Vec<usize>) {
        let chain: Vec<BlockKey> = (1000..1000 + n).map(k).collect();
        let at = (0..chain.len())
            .filter(|&d| crate::keys::reported(chain[d], every))
            .collect();
        (chain, at)
    }

    #[test]
    fn a_sampled_run_is_credited_from_one_reported_key_to_the_next() {
        use crate::cost::Tier;
        let (chain, at) = reported_chain(64, 4);
        assert!(at.len() >= 6 && at[0] > 0, "{at:?}");
        let mut idx = reporting_every(4);
        // The agent reports the reported keys only, without parents.
        for &d in &at[..5] {
            idx.observe(InstanceId(0), chain[d], None, Tier::Gpu, true, 0);
            idx.observe(InstanceId(0), chain[d], None, Tier::L1, true, 0);
        }
        let m = idx.match_prefix(&chain, BT, 1).of(InstanceId(0));
        let run = at[4] as u32 + 1;
        assert_eq!((m.gpu, m.observed_gpu, m.l1, m.l2), (run, run, run, run));
        // A query that stops between reported keys is rounded down to the last one.
        let m = idx.match_prefix(&chain[..at[3]], BT, 1).of(InstanceId(0));
        assert_eq!(m.observed_gpu, at[2] as u32 + 1);
        // The global L2, reported the same way, extends every run and its own.
        let mut idx = reporting_every(4);
        for &d in &at[..3] {
            idx.observe_l2(chain[d], None, true);
        }
        idx.observe(InstanceId(1), chain[at[3]], None, Tier::Gpu, true, 0);
        let got = idx.match_prefix(&chain, BT, 1);
        assert_eq!(got.global_l2, at[2] as u32 + 1);
        let m = got.of(InstanceId(1));
        assert_eq!((m.gpu, m.l2), (0, at[3] as u32 + 1));
    }

    #[test]
    fn a_long_chain_reported_by_the_protocol_is_matched_to_its_last_reported_key() {
        use crate::cost::Tier;
        // The protocol's rule (record 0122): at 16-token blocks one key in 4 for 256 blocks,
        // then fewer as the chain grows. An agent reporting by it, a router expecting it.
        let rule = Reporting::Tokens(16);
        let chain: Vec<BlockKey> = (1..=2000u64).map(|i| k(i * 0x9e37_79b9)).collect();
        let at: Vec<usize> = (0..chain.len())
            .filter(|&d| rule.reported(chain[d], Some(d as u32 + 1)))
            .collect();
        assert!(at.len() < 2000 / 6, "{}", at.len());
        let mut idx = PrefixIndex::new(IndexConfig::default());
        for &d in &at {
            idx.observe(InstanceId(0), chain[d], None, Tier::Gpu, true, 0);
        }
        let last = *at.last().unwrap() as u32 + 1;
        let m = idx.match_prefix(&chain, 16, 1).of(InstanceId(0));
        assert_eq!((m.gpu, m.observed_gpu), (last, last));
        // A deep reported key missing (its block evicted) ends the run at the one before.
        let gone = at[at.len() - 3];
        idx.observe(InstanceId(0), chain[gone], None, Tier::Gpu, false, 0);
        let m = idx.match_prefix(&chain, 16, 1).of(InstanceId(0));
        assert_eq!(m.observed_gpu, at[at.len() - 4] as u32 + 1);
        // A router expecting one key in 4 everywhere (before 0122) stops at the first deep
        // key it misses: never more than the chain holds.
        let mut old = reporting_every(4);
        for &d in &at {
            old.observe(InstanceId(0), chain[d], None, Tier::Gpu, true, 0);
        }
        let m = old.match_prefix(&chain, 16, 1).of(InstanceId(0));
        assert!(
            m.observed_gpu >= 256 - 8 && m.observed_gpu < last,
            "{}",
            m.observed_gpu
        );
    }

    #[test]
    fn a_missing_reported_key_breaks_the_run() {
        use crate::cost::Tier;
        let (chain, at) = reported_chain(64, 4);
        let mut idx = reporting_every(4);
        for &d in at[..5].iter().filter(|&&d| d != at[2]) {
            idx.observe(InstanceId(0), chain[d], None, Tier::Gpu, true, 0);
        }
        // Another instance's report puts the missing key in the index: still missing here.
        idx.observe(InstanceId(1), chain[at[2]], None, Tier::Gpu, true, 0);
        let got = idx.match_prefix(&chain, BT, 1);
        assert_eq!(got.of(InstanceId(0)).observed_gpu, at[1] as u32 + 1);
        // Instance 1 holds nothing before its one key: not a run.
        assert_eq!(got.of(InstanceId(1)).gpu, 0);
        // An unreported block observed past a run's end does not extend it either.
        let past = (at[1] + 2..).find(|d| !at.contains(d)).expect("unreported");
        idx.observe(InstanceId(0), chain[past], None, Tier::Gpu, true, 0);
        assert_eq!(
            idx.match_prefix(&chain, BT, 1).of(InstanceId(0)).gpu,
            at[1] as u32 + 1
        );
    }

    #[test]
    fn a_retired_prediction_fills_the_unreported_tail_of_an_observed_run() {
        use crate::cost::Tier;
        let (chain, at) = reported_chain(64, 4);
        // Two reported keys with unreported blocks between them, after at least one.
        let i = (1..at.len() - 1)
            .find(|&i| at[i + 1] - at[i] >= 3)
            .expect("a gap");
        let (last, next) = (at[i], at[i + 1]);
        let observed = |route: bool| {
            let mut idx = reporting_every(4);
            if route {
                // This router sent the instance the chain up to just before `next`.
                idx.record_route(&chain[..next], InstanceId(0), 0);
            }
            // Its agent reports the reported keys up to `last`.
            for &d in at.iter().take_while(|&&d| d <= last) {
                idx.observe(InstanceId(0), chain[d], None, Tier::Gpu, true, 0);
            }
            // A request completed there: the predictions retire (record 0088).
            idx.forget_predictions_before(InstanceId(0), 10);
            idx
        };
        let m = observed(true)
            .match_prefix(&chain, BT, 20)
            .of(InstanceId(0));
        assert_eq!((m.gpu, m.observed_gpu), (next as u32, last as u32 + 1));
        // Without the router's own decision the run ends at the last reported key.
        let m = observed(false)
            .match_prefix(&chain, BT, 20)
            .of(InstanceId(0));
        assert_eq!(m.gpu, last as u32 + 1);
        // A retired prediction with no observed run under it credits nothing.
        let mut idx = reporting_every(4);
        idx.record_route(&chain[..next], InstanceId(0), 0);
        idx.forget_predictions_before(InstanceId(0), 10);
        assert_eq!(idx.match_prefix(&chain, BT, 20).of(InstanceId(0)).gpu, 0);
        // With every key reported there is no unreported tail: the run is what is observed.
        let mut idx = reporting_every(1);
        idx.record_route(&chain[..next], InstanceId(0), 0);
        for &key in &chain[..=last] {
            idx.observe(InstanceId(0), key, None, Tier::Gpu, true, 0);
        }
        idx.forget_predictions_before(InstanceId(0), 10);
        assert_eq!(
            idx.match_prefix(&chain, BT, 20).of(InstanceId(0)).gpu,
            last as u32 + 1
        );
    }

    #[test]
    fn an_agent_that_reports_every_block_is_matched_as_before() {
        use crate::cost::Tier;
        let (chain, at) = reported_chain(40, 4);
        // An unreported depth with a reported one after it, before 30.
        let hole = (1..30)
            .find(|d| !at.contains(d) && at.iter().any(|&r| r > *d && r < 30))
            .expect("a hole");
        for every in [1, 4] {
            let mut idx = reporting_every(every);
            for d in 0..30usize {
                let parent = d.checked_sub(1).map(|p| chain[p]);
                idx.observe(InstanceId(0), chain[d], parent, Tier::Gpu, true, 0);
            }
            assert_eq!(idx.match_prefix(&chain, BT, 1).of(InstanceId(0)).gpu, 30);
            // A hole at an unreported block ends the run when every key is reported; when
            // one in four is, the next reported key vouches for the prefix it names (an
            // agent that samples would not have reported the hole's block either).
            idx.observe(InstanceId(0), chain[hole], None, Tier::Gpu, false, 0);
            let want = if every == 1 { hole } else { 30 };
            assert_eq!(
                idx.match_prefix(&chain, BT, 1).of(InstanceId(0)).gpu,
                want as u32,
                "every {every}"
            );
        }
    }

    /// The observed GPU run of `observed` (depths of `chain`) on a query of `chain`, by
    /// definition: it ends after the deepest observed block `d` such that every reported
    /// block before `d` is observed and, if `d` is not reported, so is every block since
    /// the last reported one before it.
    fn reference_run(chain: &[BlockKey], observed: &[bool], every: u32) -> u32 {
        let rep = |d: usize| crate::keys::reported(chain[d], every);
        (0..chain.len())
            .filter(|&d| observed[d])
            .filter(|&d| (0..d).filter(|&r| rep(r)).all(|r| observed[r]))
            .filter(|&d| {
                rep(d) || {
                    let last = (0..d).rev().find(|&r| rep(r)).map_or(0, |r| r + 1);
                    (last..d).all(|u| observed[u])
                }
            })
            .map(|d| d as u32 + 1)
            .max()
            .unwrap_or(0)
    }

    proptest! {
        /// The index's observed run is the reference's, reported one key in 1, 2 or 4, for
        /// any set of observed blocks (an agent that samples, one that reports every block,
        /// one with holes); with every key reported, it is the contiguous run.
        #[test]
        fn observed_runs_match_the_reference(
            observed in prop::collection::vec(prop::collection::vec(proptest::bool::ANY, 24), 1..4),
            every in prop::sample::select(vec![1u32, 2, 4]),
        ) {
            let chain: Vec<BlockKey> = (500..524).map(k).collect();
            let mut idx = reporting_every(every);
            for (i, obs) in observed.iter().enumerate() {
                for d in (0..chain.len()).filter(|&d| obs[d]) {
                    idx.observe(InstanceId(i as u32), chain[d], None, Tier::Gpu, true, 0);
                }
            }
            let got = idx.match_prefix(&chain, BT, 1);
            for (i, obs) in observed.iter().enumerate() {
                let m = got.of(InstanceId(i as u32));
                let want = reference_run(&chain, obs, every);
                prop_assert_eq!((m.gpu, m.observed_gpu), (want, want));
                if every == 1 {
                    prop_assert_eq!(want as usize, obs.iter().take_while(|&&o| o).count());
                }
            }
        }
    }

    #[test]
    fn global_l2_extends_every_instance() {
        let ops = [
            Observe(0, 1, None, Remote, true),
            Observe(0, 2, Some(1), Remote, true),
            Observe(3, 2, Some(1), Gpu, true),
            Observe(3, 3, Some(2), Gpu, true),
        ];
        // Instance 3 holds blocks 2 and 3; blocks 1 and 2 are in L2: it can load 1, has 2, 3.
        check(&ops, &[1, 2, 3], 0, &[(3, 0, 0, 3)], 2);
    }

    #[test]
    fn removal_clears_observed_and_predicted() {
        check(
            &[Route(&[1, 2], 0), Observe(0, 2, Some(1), Gpu, false)],
            &[1, 2],
            0,
            &[(0, 1, 1, 1)],
            0,
        );
        check(
            &[Route(&[1, 2], 0), Route(&[1], 1), RemoveInstance(0)],
            &[1, 2],
            0,
            &[(1, 1, 1, 1)],
            0,
        );
        check(
            &[
                Observe(0, 1, None, Remote, true),
                Observe(0, 1, None, Remote, false),
            ],
            &[1],
            0,
            &[],
            0,
        );
    }

    #[test]
    fn record_route_reports_what_was_already_known() {
        let mut index = PrefixIndex::new(IndexConfig {
            capacity_blocks: 100,
            predicted_ttl_us: 1000,
            ..IndexConfig::default()
        });
        let i = InstanceId(0);
        assert_eq!(index.record_route(&keys(&[1, 2, 3]), i, 0), 0);
        assert_eq!(index.record_route(&keys(&[1, 2, 3, 4]), i, 100), 3);
        assert_eq!(index.record_route(&keys(&[1, 2, 5]), InstanceId(1), 100), 0);
        // Past half the TTL, a prediction is worth refreshing at the peers.
        assert_eq!(index.record_route(&keys(&[1, 2, 3, 4]), i, 700), 0);
        index.observe(InstanceId(2), k(1), None, Tier::Gpu, true, 0);
        assert_eq!(index.record_route(&keys(&[1, 9]), InstanceId(2), 5000), 1);
    }

    #[test]
    fn capacity_evicts_suffixes_first() {
        let mut index = PrefixIndex::new(IndexConfig {
            capacity_blocks: 4,
            predicted_ttl_us: 1000,
            ..IndexConfig::default()
        });
        index.record_route(&keys(&[1, 2, 3]), InstanceId(0), 0);
        index.record_route(&keys(&[7]), InstanceId(1), 0);
        index.record_route(&keys(&[8, 9]), InstanceId(1), 0);
        assert_eq!(index.len(), 4);
        // 3 was the coldest leaf, then 2 (its parent) joined the front: both go first.
        assert!(index.contains(k(1)) && !index.contains(k(2)) && !index.contains(k(3)));
        assert!(index.contains(k(7)) && index.contains(k(8)) && index.contains(k(9)));
        assert_eq!(index.stats().evictions, 2);
        assert_eq!(index.stats().holders, 4);
    }

    #[test]
    fn a_block_with_many_holders_finds_each_through_growth_and_removals() {
        let mut index = PrefixIndex::new(IndexConfig::default());
        let chain = [k(1)];
        // Routed there in descending order: 99 is the inline holder, the rest overflow.
        for i in (0..100).rev() {
            index.record_route(&chain, InstanceId(i), 0);
        }
        // A match lists the inline holder, then the overflow list in the order it came.
        let order = |index: &PrefixIndex| -> Vec<u32> {
            let got = index.match_prefix(&chain, BT, 1);
            got.instances.iter().map(|m| m.instance.0).collect()
        };
        let expect: Vec<u32> = (0..100).rev().collect();
        assert_eq!(order(&index), expect);
        assert_eq!(index.stats().holders, 100);
        // A second route to each finds its holder rather than adding one.
        for i in 0..100 {
            index.record_route(&chain, InstanceId(i), 0);
        }
        assert_eq!(index.stats().holders, 100);
        // Every even instance reports the block gone.
        for i in (0..100).step_by(2) {
            index.observe(InstanceId(i), k(1), None, Tier::Gpu, false, 1);
        }
        let expect: Vec<u32> = (1..100).rev().step_by(2).collect();
        assert_eq!(order(&index), expect);
        let (holders, _, _, extra, _) = recount(&index);
        assert_eq!(index.extra_holders, extra);
        assert_eq!(index.stats().holders, holders);
        // Observed holders outlive their predictions; once the rest expire (the inline
        // holder 99 among them, replaced by the earliest overflow one), the list is below a
        // quarter full and gives its room back. A new holder goes last.
        for i in (1..100).step_by(10) {
            index.observe(InstanceId(i), k(1), None, Tier::Gpu, true, 1);
        }
        let later = index.config().predicted_ttl_us + 10;
        index.expire(later);
        index.record_route(&chain, InstanceId(50), later);
        let expect = vec![91, 81, 71, 61, 51, 41, 31, 21, 11, 1, 50];
        assert_eq!(order(&index), expect);
        let (_, _, _, extra, _) = recount(&index);
        assert_eq!(index.extra_holders, extra);
        // Instance 91 is the inline holder; the list's room is at most four times its use.
        let listed = expect.len() - 1;
        assert!(
            extra <= 4 * listed,
            "the list kept {extra} slots for {listed} holders"
        );
    }

    #[test]
    fn a_node_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Node>(), 64);
    }

    #[test]
    fn stats_count_entries_and_holders() {
        let mut index = PrefixIndex::new(IndexConfig::default());
        index.record_route(&keys(&[1, 2, 3]), InstanceId(0), 0);
        index.record_route(&keys(&[1, 2]), InstanceId(1), 0);
        index.observe_l2(k(1), None, true);
        index.observe(InstanceId(1), k(1), None, Tier::L1, true, 0);
        let stats = index.stats();
        assert_eq!((stats.entries, stats.holders, stats.l2_blocks), (3, 5, 1));
        assert_eq!((stats.predicted_holders, stats.observed_holders), (5, 1));
        assert!(stats.bytes_per_entry > 0);
        index.expire(u64::MAX);
        // The observed holder outlives every prediction.
        let after = index.stats();
        assert_eq!(
            (
                after.entries,
                after.holders,
                after.predicted_holders,
                after.observed_holders
            ),
            (1, 1, 0, 1)
        );
    }

    /// Live holders in host memory only, per instance, recounted by walking every node.
    fn recount_host_only(index: &PrefixIndex) -> Vec<usize> {
        let mut per = vec![0; index.metas.len()];
        for (idx, node) in index.nodes.iter().enumerate() {
            if index.slot(node.key) != Some(idx as u32) {
                continue;
            }
            for h in node.holders() {
                if index.metas[h.instance as usize].live(h) && host_only(h) {
                    per[h.instance as usize] += 1;
                }
            }
        }
        per
    }

    /// The counters [`PrefixIndex::stats`] keeps, recounted by walking every node.
    fn recount(index: &PrefixIndex) -> (usize, usize, usize, usize, Vec<usize>) {
        let (mut holders, mut predicted, mut observed, mut extra) = (0, 0, 0, 0);
        let mut per = vec![0; index.metas.len()];
        for (idx, node) in index.nodes.iter().enumerate() {
            extra += node.more.len();
            if index.slot(node.key) != Some(idx as u32) {
                continue; // a free slot
            }
            let sig = node
                .holders()
                .fold(0u32, |s, h| s.wrapping_add(holder_sig(h)));
            assert_eq!(node.sig, sig, "a node's signature is its holders'");
            for h in node.holders() {
                if !index.metas[h.instance as usize].live(h) {
                    continue;
                }
                holders += 1;
                per[h.instance as usize] += 1;
                predicted += usize::from(h.queued);
                observed += usize::from(h.observed != 0);
            }
        }
        (holders, predicted, observed, extra, per)
    }

    #[test]
    fn a_cache_seen_through_a_sampling_agent_is_counted_at_its_size() {
        let mut index = PrefixIndex::new(IndexConfig {
            capacity_blocks: 1000,
            predicted_ttl_us: 1000,
            ..IndexConfig::default()
        });
        let (a, b) = (InstanceId(0), InstanceId(1));
        // `a` holds 5 reported keys, each standing for 4 blocks; no prediction is left.
        for key in 1..=5 {
            index.observe(a, k(key), None, Tier::Gpu, true, 0);
        }
        assert_eq!(index.holders_of(a), 5);
        assert_eq!(index.held_blocks_of(a, 4), 20);
        assert_eq!(index.held_blocks_of(a, 1), 5);
        // `b` was just sent 30 blocks, 2 of them observed: its live holders say more.
        let chain: Vec<u64> = (100..130).collect();
        index.record_route(&keys(&chain), b, 0);
        index.observe(b, k(100), None, Tier::Gpu, true, 0);
        index.observe(b, k(101), Some(k(100)), Tier::Gpu, true, 0);
        assert_eq!(index.held_blocks_of(b, 4), 30);
        assert_eq!(index.held_blocks_of(InstanceId(7), 4), 0);
    }

    #[test]
    fn removal_is_lazy_but_total() {
        let mut index = PrefixIndex::new(IndexConfig {
            capacity_blocks: 100,
            predicted_ttl_us: 1000,
            ..IndexConfig::default()
        });
        let a = InstanceId(0);
        index.record_route(&keys(&[1, 2, 3]), a, 0);
        index.observe(a, k(1), None, Tier::L1, true, 0);
        index.record_route(&keys(&[1, 2]), InstanceId(1), 0);
        assert_eq!(
            (index.holders_of(a), index.holders_of(InstanceId(1))),
            (3, 2)
        );
        index.remove_instance(a);
        assert_eq!(index.holders_of(a), 0);
        assert_eq!(index.stats().holders, 2);
        let got = index.match_prefix(&keys(&[1, 2, 3]), BT, 1);
        assert_eq!(got.instances.len(), 1);
        assert_eq!(got.instances[0].instance, InstanceId(1));
        // Routed again: only the new prediction counts, nothing of the old observation.
        index.record_route(&keys(&[1]), a, 2);
        assert_eq!(index.holders_of(a), 1);
        assert_eq!(index.match_prefix(&keys(&[1, 2, 3]), BT, 3).of(a).l1, 1);
        assert_eq!(recount(&index).0, index.stats().holders);
        // The stale holders go once their expiry comes.
        index.expire(5000);
        assert_eq!(index.len(), 0);
        assert_eq!(index.stats().holders, 0);
    }

    #[test]
    fn shared_depth_is_the_deepest_branch() {
        let mut index = PrefixIndex::new(IndexConfig::default());
        let a = InstanceId(0);
        // A system prompt (1, 2) continued by two sessions; session 3 goes on to 5.
        index.record_route(&keys(&[1, 2, 3, 5]), a, 0);
        index.record_route(&keys(&[1, 2, 4]), a, 0);
        assert_eq!(index.match_prefix(&keys(&[1, 2, 3, 5, 6]), BT, 1).shared, 2);
        assert_eq!(index.match_prefix(&keys(&[1, 2, 9]), BT, 1).shared, 2);
        assert_eq!(index.match_prefix(&keys(&[1]), BT, 1).shared, 0);
        // A peer's sampled keys are not linked: they make no branch.
        let mut peer = PrefixIndex::new(IndexConfig::default());
        peer.record_route(&keys(&[1, 2, 3, 4]), a, 0);
        peer.record_shared(&keys(&[2, 7]), InstanceId(1), 0);
        assert_eq!(peer.match_prefix(&keys(&[1, 2, 3, 4]), BT, 1).shared, 0);
        assert_eq!(
            peer.match_prefix(&keys(&[1, 2, 3, 7]), BT, 1)
                .of(InstanceId(1))
                .gpu,
            4
        );
    }

    #[test]
    fn a_horizon_kills_older_predictions_only() {
        let mut index = PrefixIndex::new(IndexConfig {
            capacity_blocks: 100,
            predicted_ttl_us: 1000,
            ..IndexConfig::default()
        });
        let a = InstanceId(0);
        index.record_route(&keys(&[1, 2]), a, 10);
        index.record_route(&keys(&[5, 6]), a, 20);
        index.observe(a, k(9), None, Tier::Gpu, true, 20);
        index.forget_predictions_before(a, 10);
        assert_eq!(index.match_prefix(&keys(&[1, 2]), BT, 30).instances, vec![]);
        assert_eq!(index.match_prefix(&keys(&[5, 6]), BT, 30).of(a).gpu, 2);
        assert_eq!(index.match_prefix(&keys(&[9]), BT, 30).of(a).gpu, 1);
        // A horizon never moves back; a new route revives the prefix.
        index.forget_predictions_before(a, 0);
        assert_eq!(index.match_prefix(&keys(&[1, 2]), BT, 30).instances, vec![]);
        assert_eq!(index.record_route(&keys(&[1, 2]), a, 40), 0);
        assert_eq!(index.match_prefix(&keys(&[1, 2]), BT, 50).of(a).gpu, 2);
    }

    /// A random operation on a small key space, for the properties below.
    fn op_strategy() -> impl Strategy<Value = (u8, Vec<u64>, u32, u64)> {
        (
            0u8..9,
            prop::collection::vec(0u64..6, 1..6),
            0u32..4,
            0u64..3000,
        )
    }

    proptest! {
        /// A match never claims more than was inserted, the capacity bound holds, and
        /// removing an instance leaves no trace of it.
        #[test]
        fn index_properties(ops in prop::collection::vec(op_strategy(), 1..60), cap in 1usize..12) {
            let mut index = PrefixIndex::new(IndexConfig { capacity_blocks: cap, predicted_ttl_us: 1000, ..IndexConfig::default() });
            // A key names its whole prefix (base-7 digits of the choices so far), as real keys do.
            let chain = |c: &[u64]| -> Vec<BlockKey> {
                c.iter().scan(0u64, |acc, x| { *acc = *acc * 7 + x + 1; Some(k(*acc)) }).collect()
            };
            let mut inserted: Vec<(u32, Vec<BlockKey>)> = Vec::new();
            let mut now = 0;
            for (kind, choice, inst, dt) in ops {
                now += dt;
                let ks = chain(&choice);
                match kind {
                    0 | 1 => {
                        index.record_route(&ks, InstanceId(inst), now);
                        inserted.push((inst, ks.clone()));
                    }
                    2 => index.remove_instance(InstanceId(inst)),
                    3 => index.expire(now),
                    4 => {
                        let last = ks.len() - 1;
                        let parent = last.checked_sub(1).map(|p| ks[p]);
                        index.observe(InstanceId(inst), ks[last], parent, Tier::Gpu, true, now);
                        inserted.push((inst, ks.clone()));
                    }
                    5 => index.observe(InstanceId(inst), ks[0], None, Tier::Gpu, false, now),
                    6 => index.forget_predictions_before(InstanceId(inst), now),
                    7 => {
                        let last = ks.len() - 1;
                        let parent = last.checked_sub(1).map(|p| ks[p]);
                        index.observe(InstanceId(inst), ks[last], parent, Tier::L1, true, now);
                        inserted.push((inst, ks.clone()));
                    }
                    _ => index.observe(InstanceId(inst), ks[0], None, Tier::L1, false, now),
                }
                // The counters agree with a full walk, whatever happened.
                let (holders, predicted, observed, extra, per) = recount(&index);
                let host = recount_host_only(&index);
                let stats = index.stats();
                prop_assert_eq!((stats.holders, stats.predicted_holders, stats.observed_holders), (holders, predicted, observed));
                prop_assert_eq!(index.extra_holders, extra);
                for (i, n) in per.iter().enumerate() {
                    prop_assert_eq!(index.holders_of(InstanceId(i as u32)), *n);
                    prop_assert_eq!(index.gpu_holders_of(InstanceId(i as u32)), *n - host[i]);
                }
                prop_assert!(index.len() <= cap);
                let got = index.match_prefix(&ks, BT, now);
                for m in &got.instances {
                    prop_assert!(m.gpu <= m.l1 && m.l1 <= m.l2 && m.l2 <= got.blocks);
                    // Everything matched was routed to that instance at some point.
                    let longest = inserted.iter().filter(|(i, _)| *i == m.instance.0)
                        .map(|(_, p)| p.iter().zip(&ks).take_while(|(a, b)| a == b).count() as u32)
                        .max().unwrap_or(0);
                    prop_assert!(m.l2 <= longest, "{m:?} longest {longest}");
                }
                if kind == 2 {
                    prop_assert!(got.instances.iter().all(|m| m.instance.0 != inst));
                    inserted.retain(|(i, _)| *i != inst);
                }
            }
            index.expire(u64::MAX);
            // Only observations outlive every prediction.
            prop_assert_eq!(index.stats().holders, index.stats().observed_holders);
        }
    }

    /// A prediction refreshed on a key between two reported keys (a peer's sampled
    /// decision) moves the instance's prediction time there; the reported key after it,
    /// folded into the chain, restores the time its own holder carries, as its walk does.
    #[test]
    fn a_chain_fold_restores_the_prediction_time_a_key_between_moved() {
        let (chain, at) = reported_chain(64, 4);
        let d = (0..at.len() - 1)
            .find(|&i| at[i + 1] > at[i] + 1)
            .map(|i| at[i + 1])
            .expect("two reported keys with unreported ones between");
        let mut index = reporting_every(4);
        for i in 0..3 {
            index.record_route(&chain[..=d], InstanceId(i), 0);
        }
        // A peer's sample names the key before `d` on instance 0, later.
        index.record_shared(&chain[d - 1..d], InstanceId(0), 500);
        let mut folded = MatchScratch::default();
        index.match_into(&chain[..=d], BT, 600, &mut folded);
        let mut walked = MatchScratch {
            no_fold: true,
            ..MatchScratch::default()
        };
        index.match_into(&chain[..=d], BT, 600, &mut walked);
        assert_eq!(folded.result, walked.result);
        assert_eq!(folded.result.of(InstanceId(0)).predicted_at, 0);
    }

    proptest! {
        /// Folding keys whose holders repeat the key before them changes no match: the
        /// folded walk equals the walk of every key, for routed prefixes shared by many
        /// instances, observations at any reporting rate, L2, expiry, forgotten
        /// predictions and removed instances.
        #[test]
        fn folded_matches_equal_walked_ones(
            ops in prop::collection::vec((0u8..9, 0u32..10, 0usize..2, 1usize..24, 0usize..24, 0u64..400), 1..80),
            queries in prop::collection::vec((0usize..2, 1usize..24, 0u64..1500), 1..6),
            every in prop::sample::select(vec![1u32, 2, 4]),
        ) {
            let mut index = PrefixIndex::new(IndexConfig {
                capacity_blocks: 64,
                predicted_ttl_us: 1000,
                report_every: Some(every),
            });
            // Two branches of 24 keys that share their first 8.
            let branch = |b: usize| -> Vec<BlockKey> {
                (0..24u64).map(|d| if d < 8 { k(d + 1) } else { k(100 * (b as u64 + 1) + d) }).collect()
            };
            let mut now = 0;
            for (kind, inst, b, len, from, dt) in ops {
                now += dt;
                let ks = branch(b);
                let i = InstanceId(inst);
                match kind {
                    0 => {
                        index.record_route(&ks[..len], i, now);
                    }
                    1 => index.record_shared(&sparse_keys(&ks[..len], from.min(len)), i, now),
                    2 | 3 => {
                        let tier = if kind == 2 { Tier::Gpu } else { Tier::L1 };
                        for d in from.min(len - 1)..len {
                            let parent = d.checked_sub(1).map(|p| ks[p]);
                            index.observe(i, ks[d], parent, tier, true, now);
                        }
                    }
                    4 => {
                        for d in from.min(len - 1)..len {
                            let parent = d.checked_sub(1).map(|p| ks[p]);
                            index.observe(i, ks[d], parent, Tier::L2, inst % 2 == 0, now);
                        }
                    }
                    5 => index.forget_predictions_before(i, now.saturating_sub(dt / 2)),
                    6 if inst == 0 => index.remove_instance(i),
                    6 => index.expire(now),
                    _ => {
                        // Agents of instances `inst..10` report the reported keys of a
                        // prefix (present, or evicted by the last of them), without parents:
                        // the same holders on every reported key, none between.
                        for j in inst..10 {
                            for &key in ks[..len].iter().filter(|&&key| crate::keys::reported(key, every)) {
                                let present = kind == 7 || j + 1 < 10;
                                index.observe(InstanceId(j), key, None, Tier::Gpu, present, now);
                            }
                        }
                    }
                }
            }
            for (b, len, later) in queries {
                let ks = branch(b);
                let at = now + later;
                let mut folded = MatchScratch::default();
                index.match_into(&ks[..len], BT, at, &mut folded);
                let mut walked = MatchScratch { no_fold: true, ..MatchScratch::default() };
                index.match_into(&ks[..len], BT, at, &mut walked);
                prop_assert_eq!(&folded.result, &walked.result);
            }
        }
    }
}
