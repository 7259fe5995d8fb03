//! From engine KV events to residency changes: the agent recomputes warmpath block keys
//! from the events' token ids (engine hashes are never keys) and keeps, per engine, the
//! engine-hash → warmpath-key map that removals need. Pure: batches in, changes out.
//!
//! **Whose block is it.** A warmpath key is keyed by the tenant (`TenantKey(tenant,
//! cache_salt)`), so the agent must know each stored chain's tenant. vLLM hashes a request's
//! `cache_salt` into its first block and publishes it in that block's `extra_keys`; later
//! blocks name their parent. So: a block with a parent takes its parent's tenant; a first
//! block takes the tenant its salt resolves to ([`Tenants`]). The salt is the last string
//! of the first block's extra keys that is not the LoRA name (vLLM appends multimodal
//! hashes, then the LoRA name, then the salt). A chain whose tenant cannot be resolved, or
//! whose parent the agent never saw, is not reported (counted): a router then predicts
//! instead, which costs hits and never shares them across tenants.
//!
//! **What is not mapped.** Blocks of a LoRA adapter (warmpath keys do not include adapters
//! yet) and media other than `GPU` (GPU-resident) and `CPU` (an engine's own CPU offload,
//! reported as the host's L1) are skipped and counted.
//!
//! **Gaps.** A batch whose sequence number is not the previous one plus one means events
//! were lost. The subscriber first asks the engine's replay socket for the missing
//! batches (`kv_subscribe.rs`) and applies them in order; when it cannot (no replay
//! socket, or the batches are gone from the engine's buffer), this agent's view of that
//! engine may be wrong, so all of it is dropped (routers fall back to predictions for it)
//! and rebuilt from what follows.

use std::collections::HashMap;

use warmpath_index::keys::{BlockKey, TenantKey};

use crate::kv_events::{Decoded, EngineHash, KvEvent};
use warmpath_residency::{Change, Scope};

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

/// Counters, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    pub batches: u64,
    pub events: u64,
    pub gaps: u64,
    pub unknown: u64,
    pub unresolved: u64,
    pub orphans: u64,
    pub skipped: u64,
    pub malformed: u64,
}

#[derive(Debug, Default)]
struct EngineView {
    /// (engine hash, scope) → tenant slot and warmpath key: the same hash may be on the
    /// GPU and in the engine's CPU offload at once.
    blocks: HashMap<(EngineHash, Scope), Held>,
    last_seq: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    tenant: usize,
    key: BlockKey,
    scope: Scope,
}

/// The agent's view of its engines' caches.
#[derive(Debug)]
pub struct Ingest {
    tenants: Tenants,
    /// Salt → tenant id, from the routers; consulted after `tenants`' own table.
    learned: HashMap<String, String>,
    /// Whether a router ever sent a non-empty table.
    learned_any: bool,
    /// Tenant keys in use, by slot (blocks hold a slot, not a 32-byte key each).
    keys: Vec<TenantKey>,
    engines: Vec<EngineView>,
    pub stats: IngestStats,
}

impl Ingest {
    /// A view of `engines` engines (their order is `Scope::Gpu`'s index).
    pub fn new(tenants: Tenants, engines: usize) -> Self {
        Ingest {
            tenants,
            learned: HashMap::new(),
            learned_any: false,
            keys: Vec::new(),
            engines: (0..engines).map(|_| EngineView::default()).collect(),
            stats: IngestStats::default(),
        }
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

    fn slot(&mut self, key: TenantKey) -> usize {
        match self.keys.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                self.keys.push(key);
                self.keys.len() - 1
            }
        }
    }

    /// The sequence number of the last batch applied for `engine`.
    pub fn last_seq(&self, engine: usize) -> Option<u64> {
        self.engines.get(engine).and_then(|e| e.last_seq)
    }

    /// Blocks known for `engine`.
    pub fn len(&self, engine: usize) -> usize {
        self.engines.get(engine).map_or(0, |e| e.blocks.len())
    }

    /// Forgets everything of `engine` (a publisher restart, a lost connection), returning
    /// the removals to report.
    pub fn reset(&mut self, engine: usize) -> Vec<Change> {
        let Some(view) = self.engines.get_mut(engine) else {
            return Vec::new();
        };
        view.last_seq = None;
        let mut out: Vec<Change> = view
            .blocks
            .drain()
            .map(|(_, h)| Change {
                scope: h.scope,
                key: h.key.0,
                parent: None,
                present: false,
            })
            .collect();
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
                    let Some(scope) = scope_of(medium.as_deref(), engine) else {
                        self.stats.skipped += block_hashes.len() as u64;
                        continue;
                    };
                    if lora_name.is_some() || lora_id.is_some() {
                        self.stats.skipped += block_hashes.len() as u64;
                        continue;
                    }
                    let bs = *block_size as usize;
                    if token_ids.len() != block_hashes.len() * bs {
                        self.stats.malformed += 1;
                        continue;
                    }
                    // The chain so far: the parent's tenant and key, or a first block's.
                    let mut prev: Option<(usize, BlockKey)> = match parent {
                        Some(p) => match self.engines[engine]
                            .blocks
                            .get(&(p.clone(), scope))
                            .or_else(|| {
                                let other = if scope == Scope::L1 {
                                    Scope::Gpu(engine as u16)
                                } else {
                                    Scope::L1
                                };
                                self.engines[engine].blocks.get(&(p.clone(), other))
                            }) {
                            Some(h) => Some((h.tenant, h.key)),
                            None => {
                                self.stats.orphans += block_hashes.len() as u64;
                                continue;
                            }
                        },
                        None => None,
                    };
                    let mut bytes = Vec::with_capacity(bs * 4);
                    for (i, (hash, tokens)) in block_hashes
                        .iter()
                        .zip(token_ids.chunks_exact(bs))
                        .enumerate()
                    {
                        let tenant = match prev {
                            Some((t, _)) => t,
                            None => {
                                let candidates: Vec<&str> = extra_keys
                                    .get(i)
                                    .map(|k| {
                                        k.iter()
                                            .map(String::as_str)
                                            .filter(|s| Some(*s) != lora_name.as_deref())
                                            .collect()
                                    })
                                    .unwrap_or_default();
                                match self.resolve(&candidates) {
                                    Some(k) => self.slot(k),
                                    None => {
                                        self.stats.unresolved += (block_hashes.len() - i) as u64;
                                        break;
                                    }
                                }
                            }
                        };
                        warmpath_index::keys::token_block_bytes(tokens, &mut bytes);
                        let parent_key = prev.map(|(_, k)| k);
                        let key = self.keys[tenant].chain(parent_key, &bytes);
                        let held = Held { tenant, key, scope };
                        let view = &mut self.engines[engine];
                        if view.blocks.insert((hash.clone(), scope), held).is_none() {
                            out.push(Change {
                                scope,
                                key: key.0,
                                parent: parent_key.map(|k| k.0),
                                present: true,
                            });
                        }
                        prev = Some((tenant, key));
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
                    for hash in block_hashes {
                        if let Some(h) = self.engines[engine].blocks.remove(&(hash.clone(), scope))
                        {
                            out.push(Change {
                                scope: h.scope,
                                key: h.key.0,
                                parent: None,
                                present: false,
                            });
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
        // Tokens that do not fill the blocks are malformed; a LoRA block is skipped.
        let mut bad = stored(&[5, 6], None, 0..5, Some("salt-a"));
        assert!(ing.apply(0, 4, &batch(vec![bad.clone()])).is_empty());
        if let KvEvent::Stored {
            token_ids,
            lora_name,
            ..
        } = &mut bad
        {
            *token_ids = (0..8).collect();
            *lora_name = Some("adapter".into());
        }
        assert!(ing.apply(0, 5, &batch(vec![bad])).is_empty());
        assert_eq!((ing.stats.malformed, ing.stats.skipped), (1, 2));
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
}
