//! The residency session between an agent and a router: what blocks each tier of one host
//! holds, as a snapshot followed by sequenced deltas, and how a router notices it has
//! missed something. Sans-IO: messages and time in, messages and changes out. The agent,
//! the router and the simulator all drive these same two state machines; the QUIC shell
//! only moves the encoded messages.
//!
//! - The agent's [`Publisher`] owns an *epoch* (a fresh random-ish number per agent start)
//!   and a sequence number. Every change it records goes into the next [`Msg::Delta`]; a
//!   new subscriber, or one that asks, gets a [`Msg::Snapshot`] (in chunks, the last one
//!   marked) that ends at the current sequence number. With nothing to say it sends a
//!   [`Msg::Heartbeat`] so the router can tell quiet from dead.
//! - The router's [`Subscriber`] accepts a snapshot of any epoch, then only deltas of that
//!   epoch with the next sequence number. A gap, a different epoch, or a delta before any
//!   snapshot makes it drop what it observed from this agent and ask for a resync
//!   ([`Reply::Resync`]); a duplicate is ignored. An agent not heard from for `expiry` has
//!   its residency expire ([`Subscriber::poll`]): the router falls back to predictions.
//!
//! What a change names: a block key (with its parent, so the index can keep chains) in a
//! scope: one engine's GPU (by its index in the snapshot's instance list), the host's L1
//! (every engine on the host can load from it), or the global L2.
//!
//! **Coarse residency** (records 0115, 0117, 0122): a publisher sends only the blocks whose
//! keys [`Reporting::Tokens`] picks at their depth, one per
//! [`warmpath_index::keys::REPORT_TOKENS`] tokens of its pool's blocks for a chain's first
//! 4,096 tokens and fewer past them ([`Publisher::report_for_block_tokens`]; every block
//! until it knows their size), in deltas and snapshots alike, and without a parent: the
//! reported key before one is some blocks back, and an index that linked the two would see
//! a branch where the router's own chain continues (record 0115 measured it). A block's
//! depth is learned from the chain its GPU store names (a parent, or none: a chain's first
//! block); a put that names no chain (an L1 or L2 block the engine stored) takes the depth
//! its GPU store told, else the shallowest rate, which includes whatever a router expects.
//! Routers credit a reported key for the unreported blocks before it.
//! [`Publisher::reporting_every`]`(1)` reports every block with its parent, as publishers
//! did before.

use std::collections::{HashMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};
use warmpath_index::keys::{reported, BlockKey, Reporting};

/// Where a block is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Scope {
    /// The GPU of engine `n` of the snapshot's instance list.
    Gpu(u16),
    /// The host's L1.
    L1,
    /// The global L2.
    L2,
}

/// One block, held or no longer held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub scope: Scope,
    pub key: u64,
    pub parent: Option<u64>,
    pub present: bool,
}

/// Agent to router, version 1 (the QUIC stream carries postcard of [`Wire`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Part of a full state at `seq`; `last` ends it. `instances` names the engines whose
    /// GPUs `Scope::Gpu` indexes (the same list in every chunk).
    Snapshot {
        epoch: u64,
        seq: u64,
        instances: Vec<String>,
        blocks: Vec<(Scope, u64, Option<u64>)>,
        last: bool,
    },
    /// What changed since `seq - 1`, sent at `sent_ms` (the agent's wall clock, Unix
    /// milliseconds: routers on synchronised clocks measure the residency lag from it).
    Delta {
        epoch: u64,
        seq: u64,
        sent_ms: u64,
        changes: Vec<Change>,
    },
    /// Nothing changed; the agent is alive at `seq`.
    Heartbeat { epoch: u64, seq: u64 },
}

/// Router to agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Send me a snapshot (a new subscriber, or one that lost its place).
    Resync,
    /// The configuration's tenants as (cache salt, tenant id): what an agent needs to key
    /// the chains its engines report. Sent after each connect and on every change.
    Tenants(Vec<(String, String)>),
    /// Prefetch: a request was just routed to `instance`, whose host holds these blocks of
    /// its prompt (in chain order, at most [`MAX_PREFETCH_KEYS`]) only in the global L2;
    /// the agent promotes them into its L1 so that the engine loads them from host memory
    /// at admission. A hint: an agent may drop it, and an agent that predates it closes
    /// the link (upgrade agents before routers).
    Prefetch { instance: String, keys: Vec<u64> },
    /// As [`Reply::Tenants`], from configuration `version` (the Raft state's applied
    /// index; 0 for a router's static configuration). An agent keeps the table of the
    /// newest version any router sent, not the last one, so a router behind, or one
    /// replaying an old table, changes nothing; a table of more than
    /// [`MAX_TENANT_ENTRIES`] entries is refused. Routers send this one; agents still read
    /// [`Reply::Tenants`] (as version 0). An agent that predates it closes the link
    /// (upgrade agents before routers).
    TenantsAt {
        version: u64,
        tenants: Vec<(String, String)>,
    },
}

/// Most (cache salt, tenant id) entries an agent takes in one tenant table.
pub const MAX_TENANT_ENTRIES: usize = 1 << 16;

/// Most changes in one [`Msg::Delta`]: a change encodes in at most 25 bytes, so a delta
/// stays under 1.6 MiB, well within what a router reads (4 MiB); more changes go in the
/// deltas that follow ([`Publisher::next_all`]).
pub const DELTA_CHUNK: usize = 1 << 16;

/// Most keys one [`Reply::Prefetch`] carries (a 128k-token prompt in 16-token blocks).
pub const MAX_PREFETCH_KEYS: usize = 8192;

/// The versioned envelope on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Wire {
    V1Msg(Msg),
    V1Reply(Reply),
    /// A [`Msg::Delta`] whose changes name no parent, as runs (version 2 of the link, ALPN
    /// `warmpath-residency/2`: sent only to a router that offered it; record 0123).
    V2Delta(Runs),
}

/// A delta's changes as runs of one scope and presence, in order, each key in 8 bytes:
/// keys are uniform hashes, which postcard's varints spend 9 to 10 bytes on, and a change's
/// scope, presence and absent parent cost 4 more where a run names them once. About 8 bytes
/// a change instead of 13.5.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runs {
    pub epoch: u64,
    pub seq: u64,
    pub sent_ms: u64,
    pub runs: Vec<Run>,
}

/// Consecutive changes of one scope and presence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    pub scope: Scope,
    pub present: bool,
    /// Little-endian keys.
    pub keys: Vec<[u8; 8]>,
}

/// The highest version of the link this build speaks: 2 sends a delta without parents as
/// [`Wire::V2Delta`].
pub const LINK_VERSION: u8 = 2;

impl Wire {
    /// `msg` as a link of `version` carries it: a delta whose changes name no parent as
    /// [`Wire::V2Delta`] from version 2 on, anything else as [`Wire::V1Msg`].
    pub fn for_link(msg: Msg, version: u8) -> Wire {
        match msg {
            Msg::Delta {
                epoch,
                seq,
                sent_ms,
                changes,
            } if version >= 2 && changes.iter().all(|c| c.parent.is_none()) => {
                let mut runs: Vec<Run> = Vec::new();
                for c in changes {
                    match runs.last_mut() {
                        Some(r) if r.scope == c.scope && r.present == c.present => {
                            r.keys.push(c.key.to_le_bytes())
                        }
                        _ => runs.push(Run {
                            scope: c.scope,
                            present: c.present,
                            keys: vec![c.key.to_le_bytes()],
                        }),
                    }
                }
                Wire::V2Delta(Runs {
                    epoch,
                    seq,
                    sent_ms,
                    runs,
                })
            }
            msg => Wire::V1Msg(msg),
        }
    }

    /// The agent's message this carries, whichever version; `None` for a router's.
    pub fn into_msg(self) -> Option<Msg> {
        match self {
            Wire::V1Msg(m) => Some(m),
            Wire::V2Delta(r) => Some(Msg::Delta {
                epoch: r.epoch,
                seq: r.seq,
                sent_ms: r.sent_ms,
                changes: r
                    .runs
                    .into_iter()
                    .flat_map(|run| {
                        run.keys.into_iter().map(move |k| Change {
                            scope: run.scope,
                            key: u64::from_le_bytes(k),
                            parent: None,
                            present: run.present,
                        })
                    })
                    .collect(),
            }),
            Wire::V1Reply(_) => None,
        }
    }
}

/// Block depths a [`Publisher`] remembers: about what 16 engines' GPUs and an L1 of some
/// hundred GB hold in 16-token blocks (24 bytes each with the map's and the queue's share);
/// a depth forgotten costs only bandwidth (the block is reported at the shallowest rate).
pub const MAX_DEPTHS: usize = 1 << 20;

/// Blocks per snapshot chunk: keeps one message near 64 KiB.
pub const SNAPSHOT_CHUNK: usize = 2048;

/// The agent's side.
#[derive(Debug)]
pub struct Publisher {
    epoch: u64,
    seq: u64,
    instances: Vec<String>,
    /// Which keys are reported ([`Reporting`]).
    reporting: Reporting,
    /// Whether `reporting` was fixed by [`Publisher::reporting_every`] rather than by the
    /// pool's block size.
    fixed: bool,
    /// Blocks' places in their chains (1: a chain's first block), learned from the changes
    /// that name a parent: what [`Reporting::Tokens`] needs. At most [`MAX_DEPTHS`], the
    /// oldest forgotten first (`depth_order`); a block whose depth is not known is reported
    /// at the shallowest rate, which includes what any depth asks for.
    depths: HashMap<u64, u32>,
    depth_order: VecDeque<u64>,
    /// The reported blocks every tier holds now, with the parents they are reported with.
    held: HashMap<(Scope, u64), Option<u64>>,
    /// Changes of reported blocks not sent yet.
    pending: Vec<Change>,
}

impl Publisher {
    /// A publisher for this agent start; `epoch` must differ from every earlier start's
    /// (the agent uses its start time in nanoseconds mixed with its process id).
    pub fn new(epoch: u64, instances: Vec<String>) -> Self {
        Publisher {
            epoch,
            seq: 0,
            instances,
            reporting: Reporting::Every(1),
            fixed: false,
            depths: HashMap::new(),
            depth_order: VecDeque::new(),
            held: HashMap::new(),
            pending: Vec::new(),
        }
    }

    /// This publisher reports one key in `every` whatever the block size (1: every block,
    /// as `warmpath agent --residency-every-block` does; a router takes any publisher that
    /// reports at least its keys). Set before anything is recorded.
    pub fn reporting_every(self, every: u32) -> Self {
        self.reporting(Reporting::Every(every))
    }

    /// This publisher reports the keys `reporting` picks whatever the block size (the
    /// simulator gives it its routers' rule). Set before anything is recorded.
    pub fn reporting(mut self, reporting: Reporting) -> Self {
        debug_assert!(self.held.is_empty(), "set before recording");
        self.reporting = reporting;
        self.fixed = true;
        self
    }

    /// The pool's blocks are `block_tokens` tokens: report the keys the protocol picks of
    /// them ([`Reporting::Tokens`]: one in 4 of 16-token blocks, fewer deep in long chains)
    /// from now on, unless [`Publisher::reporting_every`] fixed the rate. Until it is called
    /// a publisher reports every block (it does not know how coarse to be; routers take
    /// more than they ask for). Blocks reported before keep being reported until they go.
    pub fn report_for_block_tokens(&mut self, block_tokens: u32) {
        if !self.fixed {
            self.reporting = Reporting::Tokens(block_tokens);
        }
    }

    /// Which keys this publisher reports now.
    pub fn rule(&self) -> Reporting {
        self.reporting
    }

    /// Block `change`'s place in its chain, if known: remembered, else its parent's plus
    /// one (a GPU block without a parent starts its chain; an L1 or L2 put names no chain),
    /// remembered when the change stores it.
    fn depth(&mut self, change: &Change) -> Option<u32> {
        if let Some(&d) = self.depths.get(&change.key) {
            return Some(d);
        }
        let d = match (change.parent, change.scope) {
            (Some(p), _) => self.depths.get(&p).map(|&d| d.saturating_add(1)),
            (None, Scope::Gpu(_)) => Some(1),
            (None, _) => None,
        }?;
        if change.present {
            if self.depth_order.len() >= MAX_DEPTHS {
                if let Some(old) = self.depth_order.pop_front() {
                    self.depths.remove(&old);
                }
            }
            self.depths.insert(change.key, d);
            self.depth_order.push_back(change.key);
        }
        Some(d)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Records a change (`parent`: the block before it in its chain, if known) of a block
    /// that is reported; others are dropped. Repeated or contradicting changes of one block
    /// before the next delta are all sent, in order (the subscriber applies them in order).
    pub fn record(&mut self, change: Change) {
        let k = (change.scope, change.key);
        let was = self.held.contains_key(&k);
        // A block reported at a finer rate before the block size was known is reported
        // until it goes.
        let goes = was && !change.present;
        let depth = match self.reporting {
            Reporting::Every(_) => None,
            Reporting::Tokens(_) => self.depth(&change),
        };
        let every = depth.map_or(self.reporting.base(), |d| self.reporting.every_at(d));
        if !goes && !reported(BlockKey(change.key), every) {
            return;
        }
        // A sampled block's parent is most likely not reported (record 0115).
        let mut change = change;
        if every > 1 {
            change.parent = None;
        }
        if change.present {
            self.held.insert(k, change.parent);
        } else {
            self.held.remove(&k);
        }
        if was != change.present {
            self.pending.push(change);
        }
    }

    /// Drops everything held in `scope` (an engine's "all blocks cleared").
    pub fn clear(&mut self, scope: Scope) {
        let gone: Vec<(Scope, u64)> = self
            .held
            .keys()
            .filter(|(s, _)| *s == scope)
            .copied()
            .collect();
        for (s, key) in gone {
            self.record(Change {
                scope: s,
                key,
                parent: None,
                present: false,
            });
        }
    }

    /// The next delta, stamped `now_ms`, if anything changed; else a heartbeat when
    /// `heartbeat` is true.
    /// At most [`DELTA_CHUNK`] changes go in one delta: the rest wait for the next call.
    pub fn next(&mut self, heartbeat: bool, now_ms: u64) -> Option<Msg> {
        if self.pending.is_empty() {
            return heartbeat.then_some(Msg::Heartbeat {
                epoch: self.epoch,
                seq: self.seq,
            });
        }
        self.seq += 1;
        let changes = if self.pending.len() > DELTA_CHUNK {
            let rest = self.pending.split_off(DELTA_CHUNK);
            std::mem::replace(&mut self.pending, rest)
        } else {
            std::mem::take(&mut self.pending)
        };
        Some(Msg::Delta {
            epoch: self.epoch,
            seq: self.seq,
            sent_ms: now_ms,
            changes,
        })
    }

    /// Every delta it takes to send all changes recorded, in order (none: a heartbeat when
    /// `heartbeat` is true).
    pub fn next_all(&mut self, heartbeat: bool, now_ms: u64) -> Vec<Msg> {
        let mut out: Vec<Msg> = self.next(heartbeat, now_ms).into_iter().collect();
        while !self.pending.is_empty() {
            out.extend(self.next(false, now_ms));
        }
        out
    }

    /// A full state for a new subscriber, at the current sequence number. Call [`next`]
    /// first so that no recorded change is in neither the snapshot nor a later delta.
    ///
    /// [`next`]: Publisher::next
    pub fn snapshot(&self) -> Vec<Msg> {
        debug_assert!(self.pending.is_empty(), "flush pending changes first");
        let mut blocks: Vec<(Scope, u64, Option<u64>)> =
            self.held.iter().map(|(&(s, k), &p)| (s, k, p)).collect();
        blocks.sort_unstable();
        let mut chunks: Vec<Msg> = blocks
            .chunks(SNAPSHOT_CHUNK)
            .map(|c| Msg::Snapshot {
                epoch: self.epoch,
                seq: self.seq,
                instances: self.instances.clone(),
                blocks: c.to_vec(),
                last: false,
            })
            .collect();
        if chunks.is_empty() {
            chunks.push(Msg::Snapshot {
                epoch: self.epoch,
                seq: self.seq,
                instances: self.instances.clone(),
                blocks: Vec::new(),
                last: false,
            });
        }
        if let Some(Msg::Snapshot { last, .. }) = chunks.last_mut() {
            *last = true;
        }
        chunks
    }

    /// Reported blocks held now: what a subscriber in sync holds (for metrics and tests).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// The L2 blocks an agent reports: those it wrote (or read back) and has not since seen
/// missing, the most recent `cap` of them. L2 is shared and bounded by its own eviction
/// (a directory's ledger, Redis's `maxmemory`), which tells no agent; so an agent claims
/// only what it saw lately, and withdraws the oldest claims beyond the cap. A claim that
/// outlived its block costs a router one L2 miss (the engine recomputes), never a wrong
/// answer.
#[derive(Debug)]
pub struct L2Window {
    cap: usize,
    order: std::collections::VecDeque<u64>,
    held: HashSet<u64>,
}

impl L2Window {
    pub fn new(cap: usize) -> Self {
        L2Window {
            cap,
            order: std::collections::VecDeque::new(),
            held: HashSet::new(),
        }
    }

    /// `key` is in L2: the changes to record (its claim, and any claims it pushed out).
    pub fn stored(&mut self, key: u64, parent: Option<u64>) -> Vec<Change> {
        let mut out = Vec::new();
        if self.cap == 0 || !self.held.insert(key) {
            return out;
        }
        self.order.push_back(key);
        if self.order.len() > 2 * self.cap.max(1024) {
            // Places left by `gone` (and repeats of keys stored again) are dropped.
            let mut seen = HashSet::new();
            let held = &self.held;
            self.order.retain(|k| held.contains(k) && seen.insert(*k));
        }
        out.push(Change {
            scope: Scope::L2,
            key,
            parent,
            present: true,
        });
        while self.held.len() > self.cap {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if self.held.remove(&old) {
                out.push(Change {
                    scope: Scope::L2,
                    key: old,
                    parent: None,
                    present: false,
                });
            }
        }
        out
    }

    /// `key` is no longer in L2 (evicted, found missing or damaged).
    pub fn gone(&mut self, key: u64) -> Option<Change> {
        // Its place in `order` is skipped when reached.
        self.held.remove(&key).then_some(Change {
            scope: Scope::L2,
            key,
            parent: None,
            present: false,
        })
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// What the router must do after a message or a poll.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Apply these changes to the index, in order (`instances` maps `Scope::Gpu`);
    /// `sent_ms` is when a delta left the agent (None for a snapshot).
    Apply {
        instances: Vec<String>,
        changes: Vec<Change>,
        sent_ms: Option<u64>,
    },
    /// Drop every observation from this agent (all of `held`, now removed) and, when
    /// `resync`, send [`Reply::Resync`].
    Reset {
        instances: Vec<String>,
        removed: Vec<Change>,
        resync: bool,
    },
    /// Nothing to do.
    Nothing,
}

/// The router's side, one per agent.
#[derive(Debug)]
pub struct Subscriber {
    expiry_us: u64,
    /// (epoch, seq) once a whole snapshot arrived.
    at: Option<(u64, u64)>,
    /// A snapshot being received: its epoch, seq and blocks so far.
    partial: Option<(u64, u64, Vec<Change>)>,
    instances: Vec<String>,
    held: HashSet<(Scope, u64)>,
    last_heard_us: Option<u64>,
    /// Resyncs asked, for metrics.
    pub resyncs: u64,
}

impl Subscriber {
    /// A subscriber whose agent expires after `expiry_us` of silence.
    pub fn new(expiry_us: u64) -> Self {
        Subscriber {
            expiry_us,
            at: None,
            partial: None,
            instances: Vec::new(),
            held: HashSet::new(),
            last_heard_us: None,
            resyncs: 0,
        }
    }

    /// Whether a whole snapshot has arrived and no gap has been seen since.
    pub fn in_sync(&self) -> bool {
        self.at.is_some()
    }

    /// Blocks observed from this agent now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Handles a message from the agent at `now_us`.
    pub fn handle(&mut self, now_us: u64, msg: Msg) -> Outcome {
        self.last_heard_us = Some(now_us);
        match msg {
            Msg::Snapshot {
                epoch,
                seq,
                instances,
                blocks,
                last,
            } => {
                let (pe, ps, mut acc) = self.partial.take().unwrap_or((epoch, seq, Vec::new()));
                if (pe, ps) != (epoch, seq) {
                    // A new snapshot began before the last ended: start over with it.
                    acc.clear();
                }
                acc.extend(blocks.into_iter().map(|(scope, key, parent)| Change {
                    scope,
                    key,
                    parent,
                    present: true,
                }));
                if !last {
                    self.partial = Some((epoch, seq, acc));
                    return Outcome::Nothing;
                }
                // Replace what was held with the snapshot: removals first, then additions.
                let mut changes = self.drop_all();
                for c in &acc {
                    self.held.insert((c.scope, c.key));
                }
                changes.extend(acc);
                self.instances = instances.clone();
                self.at = Some((epoch, seq));
                Outcome::Apply {
                    instances,
                    changes,
                    sent_ms: None,
                }
            }
            Msg::Delta {
                epoch,
                seq,
                sent_ms,
                changes,
            } => match self.at {
                Some((e, s)) if e == epoch && seq == s + 1 => {
                    for c in &changes {
                        if c.present {
                            self.held.insert((c.scope, c.key));
                        } else {
                            self.held.remove(&(c.scope, c.key));
                        }
                    }
                    self.at = Some((e, seq));
                    Outcome::Apply {
                        instances: self.instances.clone(),
                        changes,
                        sent_ms: Some(sent_ms),
                    }
                }
                Some((e, s)) if e == epoch && seq <= s => Outcome::Nothing,
                _ if self.partial.is_some() => Outcome::Nothing,
                _ => self.reset(true),
            },
            Msg::Heartbeat { epoch, seq } => match self.at {
                Some((e, s)) if e == epoch && s == seq => Outcome::Nothing,
                Some((e, s)) if e == epoch && seq < s => Outcome::Nothing,
                _ if self.partial.is_some() => Outcome::Nothing,
                _ => self.reset(true),
            },
        }
    }

    /// Expires the agent's residency after `expiry` of silence; call periodically.
    pub fn poll(&mut self, now_us: u64) -> Outcome {
        match self.last_heard_us {
            Some(t)
                if now_us.saturating_sub(t) > self.expiry_us
                    && (self.at.is_some() || !self.held.is_empty()) =>
            {
                self.reset(false)
            }
            _ => Outcome::Nothing,
        }
    }

    /// The router stops following this agent (it left the configuration): drop what it
    /// reported.
    pub fn forget(&mut self) -> Outcome {
        if self.held.is_empty() && self.at.is_none() {
            return Outcome::Nothing;
        }
        self.reset(false)
    }

    fn reset(&mut self, resync: bool) -> Outcome {
        self.at = None;
        self.partial = None;
        if resync {
            self.resyncs += 1;
        }
        Outcome::Reset {
            instances: self.instances.clone(),
            removed: self.drop_all(),
            resync,
        }
    }

    fn drop_all(&mut self) -> Vec<Change> {
        let mut removed: Vec<Change> = self
            .held
            .drain()
            .map(|(scope, key)| Change {
                scope,
                key,
                parent: None,
                present: false,
            })
            .collect();
        removed.sort_unstable_by_key(|c| (c.scope, c.key));
        removed
    }
}

/// Encodes a message for the wire.
pub fn encode(w: &Wire) -> Vec<u8> {
    postcard::to_stdvec(w).unwrap_or_default()
}

/// Decodes a message from the wire.
pub fn decode(bytes: &[u8]) -> Result<Wire, postcard::Error> {
    postcard::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(scope: Scope, key: u64, parent: Option<u64>) -> Change {
        Change {
            scope,
            key,
            parent,
            present: true,
        }
    }

    fn del(scope: Scope, key: u64) -> Change {
        Change {
            scope,
            key,
            parent: None,
            present: false,
        }
    }

    /// Applies outcomes to a plain set, as the router's index would.
    fn apply(view: &mut HashSet<(Scope, u64)>, o: &Outcome) -> bool {
        let changes = match o {
            Outcome::Apply { changes, .. } => changes,
            Outcome::Reset { removed, .. } => removed,
            Outcome::Nothing => return false,
        };
        for c in changes {
            if c.present {
                view.insert((c.scope, c.key));
            } else {
                view.remove(&(c.scope, c.key));
            }
        }
        matches!(o, Outcome::Reset { resync: true, .. })
    }

    /// What a router should hold: the reported blocks the publisher holds.
    fn truth(p: &Publisher) -> HashSet<(Scope, u64)> {
        p.held.keys().copied().collect()
    }

    /// A publisher that reports every block: the session's mechanics, whatever is sampled.
    fn full(epoch: u64, instances: Vec<String>) -> Publisher {
        Publisher::new(epoch, instances).reporting_every(1)
    }

    #[test]
    fn a_publisher_reports_reported_keys_only_and_without_parents() {
        let chain: Vec<u64> = (1000..1064).collect();
        let at: Vec<u64> = chain
            .iter()
            .copied()
            .filter(|&k| reported(BlockKey(k), 4))
            .collect();
        assert!(at.len() >= 8 && at[0] != chain[0], "{at:?}");
        let mut p = Publisher::new(1, vec!["e0".into()]).reporting_every(4);
        for (d, &key) in chain.iter().enumerate() {
            let parent = d.checked_sub(1).map(|d| chain[d]);
            p.record(add(Scope::Gpu(0), key, parent));
            // A put names a block, not its chain: reported or not, without a parent.
            p.record(add(Scope::L1, key, None));
        }
        let want: Vec<Change> = at
            .iter()
            .flat_map(|&k| [add(Scope::Gpu(0), k, None), add(Scope::L1, k, None)])
            .collect();
        let Some(Msg::Delta { changes, .. }) = p.next(false, 0) else {
            panic!("a delta");
        };
        assert_eq!(changes, want);
        assert_eq!(p.len(), 2 * at.len());
        // The snapshot carries the same blocks and parents.
        let mut snap: Vec<Change> = p
            .snapshot()
            .into_iter()
            .flat_map(|m| match m {
                Msg::Snapshot { blocks, .. } => blocks,
                _ => Vec::new(),
            })
            .map(|(scope, key, parent)| Change {
                scope,
                key,
                parent,
                present: true,
            })
            .collect();
        let mut want = want;
        snap.sort_unstable_by_key(|c| (c.scope, c.key));
        want.sort_unstable_by_key(|c| (c.scope, c.key));
        assert_eq!(snap, want);
        // Removing an unreported block sends nothing; a reported one, its removal.
        let unreported = *chain.iter().find(|k| !at.contains(k)).expect("one");
        p.record(del(Scope::Gpu(0), unreported));
        assert_eq!(p.next(false, 0), None);
        p.record(del(Scope::Gpu(0), at[1]));
        assert!(
            matches!(p.next(false, 0), Some(Msg::Delta { changes, .. }) if changes == [del(Scope::Gpu(0), at[1])])
        );
        // A clear withdraws the reported blocks only.
        p.clear(Scope::L1);
        let Some(Msg::Delta { changes, .. }) = p.next(false, 0) else {
            panic!("a delta");
        };
        let mut gone: Vec<u64> = changes.iter().map(|c| c.key).collect();
        gone.sort_unstable();
        assert_eq!(gone, at);
        // Every block reported, as before: each under its own parent.
        let mut p = full(2, vec!["e0".into()]);
        p.record(add(Scope::Gpu(0), chain[0], None));
        p.record(add(Scope::Gpu(0), chain[1], Some(chain[0])));
        let Some(Msg::Delta { changes, .. }) = p.next(false, 0) else {
            panic!("a delta");
        };
        assert_eq!(
            changes,
            [
                add(Scope::Gpu(0), chain[0], None),
                add(Scope::Gpu(0), chain[1], Some(chain[0]))
            ]
        );
    }

    #[test]
    fn a_publisher_reports_by_its_pools_block_size_once_it_knows_it() {
        let chain: Vec<u64> = (1..=64).collect();
        let at: Vec<u64> = chain
            .iter()
            .copied()
            .filter(|&k| reported(BlockKey(k), 4))
            .collect();
        let unreported: Vec<u64> = chain.iter().copied().filter(|k| !at.contains(k)).collect();
        let mut p = Publisher::new(1, vec!["e0".into()]);
        // Before the block size is known: every block.
        assert_eq!(p.rule(), Reporting::Every(1));
        p.record(add(Scope::L1, unreported[0], None));
        p.record(add(Scope::L1, unreported[1], None));
        assert!(matches!(p.next(false, 0), Some(Msg::Delta { changes, .. }) if changes.len() == 2));
        // 16-token blocks: one key in 4 (64 tokens); 512-token blocks would be every one.
        p.report_for_block_tokens(16);
        assert_eq!(p.rule(), Reporting::Tokens(16));
        for &key in &chain {
            p.record(add(Scope::Gpu(0), key, None));
        }
        let Some(Msg::Delta { changes, .. }) = p.next(false, 0) else {
            panic!("a delta");
        };
        assert_eq!(changes.iter().map(|c| c.key).collect::<Vec<_>>(), at);
        // What was reported before keeps being reported until it goes: its removal is sent.
        p.record(del(Scope::L1, unreported[0]));
        p.record(del(Scope::Gpu(0), unreported[2]));
        assert!(
            matches!(p.next(false, 0), Some(Msg::Delta { changes, .. }) if changes == [del(Scope::L1, unreported[0])])
        );
        // A fixed rate stays fixed.
        let mut fixed = full(2, vec!["e0".into()]);
        fixed.report_for_block_tokens(16);
        assert_eq!(fixed.rule(), Reporting::Every(1));
        let mut p = Publisher::new(3, vec!["e0".into()]);
        p.report_for_block_tokens(512);
        assert_eq!(p.rule().base(), 1);
    }

    #[test]
    fn a_publisher_thins_out_a_long_chain_by_depth_and_reports_puts_of_unknown_depth_densely() {
        // A 16k-token chain of 16-token blocks, stored on the GPU with its parents.
        let chain: Vec<u64> = (1..=1024u64).map(|k| k * 0x9e37_79b9).collect();
        let rule = Reporting::Tokens(16);
        let mut p = Publisher::new(1, vec!["e0".into()]);
        p.report_for_block_tokens(16);
        for (d, &key) in chain.iter().enumerate() {
            p.record(add(Scope::Gpu(0), key, d.checked_sub(1).map(|d| chain[d])));
        }
        let Some(Msg::Delta { changes, .. }) = p.next(false, 0) else {
            panic!("a delta");
        };
        let want: Vec<u64> = chain
            .iter()
            .enumerate()
            .filter(|&(d, &k)| rule.reported(BlockKey(k), Some(d as u32 + 1)))
            .map(|(_, &k)| k)
            .collect();
        assert_eq!(changes.iter().map(|c| c.key).collect::<Vec<_>>(), want);
        assert!(changes.iter().all(|c| c.parent.is_none()));
        // Fewer than one in 4 of the chain: 64 in its first 256 blocks, about 32 per
        // doubling after.
        assert!(want.len() < 160, "{}", want.len());
        // An L1 put of a block whose depth the GPU's chain told is sampled at that depth; a
        // put of a block never seen in a chain, at the shallowest rate.
        let deep = chain[900];
        let stranger = (0..)
            .find(|&k| reported(BlockKey(k), 4) && !reported(BlockKey(k), 64))
            .unwrap();
        p.record(add(Scope::L1, deep, None));
        p.record(add(Scope::L1, stranger, None));
        let sent: Vec<u64> = match p.next(false, 0) {
            Some(Msg::Delta { changes, .. }) => changes.iter().map(|c| c.key).collect(),
            _ => Vec::new(),
        };
        assert_eq!(sent.contains(&deep), want.contains(&deep));
        assert_eq!(
            sent,
            [deep, stranger]
                .into_iter()
                .filter(|k| *k == stranger || want.contains(k))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_version_2_link_carries_a_delta_without_parents_in_runs_of_8_byte_keys() {
        let keys: Vec<u64> = (1..=600u64)
            .map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let mut changes: Vec<Change> = keys[..500]
            .iter()
            .map(|&k| add(Scope::Gpu(3), k, None))
            .collect();
        changes.extend(keys[500..550].iter().map(|&k| del(Scope::Gpu(3), k)));
        changes.extend(keys[550..].iter().map(|&k| add(Scope::L1, k, None)));
        // Repeated and contradicting changes keep their order.
        changes.push(del(Scope::L1, keys[599]));
        changes.push(add(Scope::L1, keys[599], None));
        let delta = Msg::Delta {
            epoch: 7,
            seq: 9,
            sent_ms: 1_700_000_000_000,
            changes,
        };
        let v2 = Wire::for_link(delta.clone(), 2);
        let Wire::V2Delta(runs) = &v2 else {
            panic!("runs: {v2:?}");
        };
        assert_eq!(runs.runs.len(), 5);
        let back = decode(&encode(&v2)).unwrap().into_msg().unwrap();
        assert_eq!(back, delta);
        let (b1, b2) = (
            encode(&Wire::for_link(delta.clone(), 1)).len(),
            encode(&v2).len(),
        );
        assert!(b2 * 8 < b1 * 5, "version 2 {b2} B, version 1 {b1} B");
        assert!(b2 < 602 * 8 + 64, "{b2} B for 602 changes");
        // A change with a parent (every block reported), a snapshot and a heartbeat go as
        // version 1 on any link.
        let with_parent = Msg::Delta {
            epoch: 7,
            seq: 10,
            sent_ms: 0,
            changes: vec![add(Scope::Gpu(0), 2, Some(1))],
        };
        assert!(
            matches!(Wire::for_link(with_parent.clone(), 2), Wire::V1Msg(m) if m == with_parent)
        );
        let hb = Msg::Heartbeat { epoch: 7, seq: 10 };
        assert_eq!(Wire::for_link(hb.clone(), 2), Wire::V1Msg(hb.clone()));
        assert_eq!(Wire::V1Msg(hb.clone()).into_msg(), Some(hb));
        assert_eq!(Wire::V1Reply(Reply::Resync).into_msg(), None);
    }

    #[test]
    fn a_large_delta_is_split_within_what_a_router_reads() {
        let mut p = full(7, vec!["e0".into()]);
        let mut s = Subscriber::new(1_000_000);
        let mut view = HashSet::new();
        for m in p.snapshot() {
            apply(&mut view, &s.handle(0, m));
        }
        // The largest changes there are: ten-byte keys and parents.
        let n = 3 * DELTA_CHUNK + 5;
        for i in 0..n as u64 {
            p.record(add(Scope::Gpu(0), u64::MAX - i, Some(u64::MAX - i - 1)));
        }
        let msgs = p.next_all(true, u64::MAX);
        assert_eq!(msgs.len(), 4);
        for m in msgs {
            let bytes = encode(&Wire::V1Msg(m.clone()));
            assert!(bytes.len() < 2 << 20, "{} bytes", bytes.len());
            assert!(!apply(&mut view, &s.handle(1, m)));
        }
        assert_eq!(view, truth(&p));
        assert!(p.next_all(false, 0).is_empty());
    }

    #[test]
    fn the_tenant_table_of_a_version_keeps_its_variant_and_the_old_one_still_reads() {
        let old = Wire::V1Reply(Reply::Tenants(vec![("s".into(), "t".into())]));
        assert_eq!(decode(&encode(&old)).unwrap(), old);
        let new = Wire::V1Reply(Reply::TenantsAt {
            version: 42,
            tenants: vec![("s".into(), "t".into())],
        });
        assert_eq!(decode(&encode(&new)).unwrap(), new);
        // The variants before it keep their tags: what an older router sends reads the same.
        assert_eq!(encode(&Wire::V1Reply(Reply::Resync)), vec![1, 0]);
        assert_eq!(encode(&old)[..2], [1, 1]);
        assert_eq!(encode(&new)[..2], [1, 3]);
    }

    #[test]
    fn snapshot_then_deltas_converge() {
        let mut p = full(7, vec!["e0".into()]);
        p.record(add(Scope::Gpu(0), 1, None));
        p.record(add(Scope::L1, 1, None));
        let mut s = Subscriber::new(1_000_000);
        let mut view = HashSet::new();
        assert!(p.next(false, 0).is_some());
        for m in p.snapshot() {
            apply(&mut view, &s.handle(0, m));
        }
        assert_eq!(view, truth(&p));
        p.record(add(Scope::Gpu(0), 2, Some(1)));
        p.record(del(Scope::L1, 1));
        p.record(add(Scope::L2, 9, None));
        // Recording what is already so sends nothing.
        p.record(add(Scope::L2, 9, None));
        let d = p.next(false, 0).unwrap();
        apply(&mut view, &s.handle(10, d.clone()));
        assert_eq!(view, truth(&p));
        // A duplicate is ignored; a heartbeat at the same seq is fine.
        assert_eq!(s.handle(11, d), Outcome::Nothing);
        assert_eq!(s.handle(12, p.next(true, 0).unwrap()), Outcome::Nothing);
        assert!(p.next(false, 0).is_none());
        assert!(s.in_sync());
    }

    #[test]
    fn a_gap_or_a_new_epoch_resyncs() {
        let mut p = full(1, vec!["e0".into()]);
        let mut s = Subscriber::new(1_000_000);
        let mut view = HashSet::new();
        for m in p.snapshot() {
            apply(&mut view, &s.handle(0, m));
        }
        p.record(add(Scope::Gpu(0), 1, None));
        let lost = p.next(false, 0).unwrap();
        drop(lost);
        p.record(add(Scope::Gpu(0), 2, None));
        // Seq 2 after 0: a gap. Everything observed is dropped and a resync asked.
        assert!(apply(&mut view, &s.handle(5, p.next(false, 0).unwrap())));
        assert!(view.is_empty());
        assert_eq!(s.resyncs, 1);
        for m in p.snapshot() {
            apply(&mut view, &s.handle(6, m));
        }
        assert_eq!(view, truth(&p));
        // The agent restarts: a new epoch's delta resyncs too.
        let mut p2 = full(2, vec!["e0".into()]);
        p2.record(add(Scope::L1, 5, None));
        assert!(apply(&mut view, &s.handle(7, p2.next(false, 0).unwrap())));
        for m in p2.snapshot() {
            apply(&mut view, &s.handle(8, m));
        }
        assert_eq!(view, truth(&p2));
        // A delta before any snapshot asks for one.
        let mut fresh = Subscriber::new(1_000_000);
        p2.record(add(Scope::L1, 6, None));
        assert!(matches!(
            fresh.handle(0, p2.next(false, 0).unwrap()),
            Outcome::Reset { resync: true, .. }
        ));
    }

    #[test]
    fn chunked_snapshots_and_clears() {
        let mut p = full(3, vec!["a".into(), "b".into()]);
        for k in 0..(SNAPSHOT_CHUNK as u64 * 2 + 5) {
            p.record(add(Scope::Gpu((k % 2) as u16), k, k.checked_sub(2)));
        }
        p.next(false, 0);
        let chunks = p.snapshot();
        assert_eq!(chunks.len(), 3);
        let mut s = Subscriber::new(1_000_000);
        let mut view = HashSet::new();
        for (i, m) in chunks.into_iter().enumerate() {
            let o = s.handle(i as u64, m);
            assert_eq!(i == 2, matches!(o, Outcome::Apply { .. }));
            apply(&mut view, &o);
        }
        assert_eq!(view, truth(&p));
        p.clear(Scope::Gpu(1));
        apply(&mut view, &s.handle(10, p.next(false, 0).unwrap()));
        assert_eq!(view, truth(&p));
        assert!(view.iter().all(|(s, _)| *s == Scope::Gpu(0)));
    }

    #[test]
    fn silence_expires_the_agent() {
        let mut p = full(1, vec!["e0".into()]);
        p.record(add(Scope::Gpu(0), 1, None));
        p.next(false, 0);
        let mut s = Subscriber::new(500);
        let mut view = HashSet::new();
        for m in p.snapshot() {
            apply(&mut view, &s.handle(100, m));
        }
        assert_eq!(s.poll(600), Outcome::Nothing);
        let o = s.poll(601);
        assert!(matches!(o, Outcome::Reset { resync: false, .. }));
        apply(&mut view, &o);
        assert!(view.is_empty());
        assert_eq!(s.poll(10_000), Outcome::Nothing);
        // It comes back with a heartbeat of its epoch: the router asks for a snapshot.
        assert!(matches!(
            s.handle(20_000, p.next(true, 0).unwrap()),
            Outcome::Reset { resync: true, .. }
        ));
    }

    proptest::proptest! {
        /// Whatever is lost or duplicated on the way, a subscriber that answers resyncs
        /// with snapshots ends with exactly what the agent holds.
        #[test]
        fn lossy_links_converge(
            steps in proptest::collection::vec((0u8..3, 0u64..20, proptest::bool::ANY, 0u8..10), 1..200),
            every in proptest::sample::select(vec![1u32, 4]),
        ) {
            let mut p = Publisher::new(9, vec!["e0".into()]).reporting_every(every);
            let mut s = Subscriber::new(u64::MAX);
            let mut view = HashSet::new();
            let mut last_sent: Option<Msg> = None;
            for (i, (scope, key, present, fate)) in steps.into_iter().enumerate() {
                let scope = [Scope::Gpu(0), Scope::L1, Scope::L2][scope as usize];
                p.record(Change { scope, key, parent: None, present });
                let Some(m) = p.next(i % 7 == 0, 0) else { continue };
                let deliveries = match fate {
                    0 => vec![],                              // lost
                    1 => vec![m.clone(), m.clone()],          // duplicated
                    2 => last_sent.clone().into_iter().chain([m.clone()]).collect(), // stale replay
                    _ => vec![m.clone()],
                };
                last_sent = Some(m);
                for d in deliveries {
                    if apply(&mut view, &s.handle(i as u64, d)) {
                        for snap in p.snapshot() {
                            apply(&mut view, &s.handle(i as u64, snap));
                        }
                    }
                }
            }
            // A final heartbeat tells a subscriber that missed the tail.
            if let Some(m) = p.next(true, 0) {
                if apply(&mut view, &s.handle(u64::MAX - 1, m)) {
                    for snap in p.snapshot() {
                        apply(&mut view, &s.handle(u64::MAX - 1, snap));
                    }
                }
            }
            proptest::prop_assert_eq!(view, truth(&p));
        }
    }

    #[test]
    fn wire_round_trip() {
        let m = Wire::V1Msg(Msg::Delta {
            epoch: 1,
            seq: 2,
            sent_ms: 3,
            changes: vec![add(Scope::Gpu(3), 4, Some(5))],
        });
        assert_eq!(decode(&encode(&m)).unwrap(), m);
        assert!(decode(&[0xff, 0xff]).is_err());
    }

    #[test]
    fn the_l2_window_claims_the_latest_blocks_only() {
        let mut w = L2Window::new(2);
        assert_eq!(w.stored(1, None), vec![add(Scope::L2, 1, None)]);
        assert!(
            w.stored(1, None).is_empty(),
            "a second write claims nothing new"
        );
        assert_eq!(w.stored(2, Some(1)), vec![add(Scope::L2, 2, Some(1))]);
        // A third claim withdraws the oldest.
        assert_eq!(
            w.stored(3, Some(2)),
            vec![add(Scope::L2, 3, Some(2)), del(Scope::L2, 1)]
        );
        assert_eq!(w.gone(2), Some(del(Scope::L2, 2)));
        assert_eq!(w.gone(2), None);
        // 2's stale place in the order is skipped: 4 fits without withdrawing 3.
        assert_eq!(w.stored(4, None), vec![add(Scope::L2, 4, None)]);
        assert_eq!(w.len(), 2);
        assert!(L2Window::new(0).stored(1, None).is_empty());
    }
}
