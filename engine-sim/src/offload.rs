//! engine-sim's side of the host's cache-agent (`warmpath engine-sim --agent ADDR`).
//!
//! Blocks the engine model evicts from GPU memory are offloaded to the agent as real
//! payloads, in batches, by a background task; when a request arrives, and again when the
//! engine admits it for what the arrival's answer did not cover, whose prompt continues
//! past what the GPU holds, the engine loop asks the agent for the following blocks
//! (lookup-and-lease, then get) in a task of its own and hands the engine model the ones
//! that arrived whole, which it loads at the profile's tier bandwidth instead of
//! recomputing them; a request admitted before its answer waits for it, the batch does not.
//!
//! A payload is `block_bytes` long (the profile's KV bytes per token × block tokens × a
//! scale factor, so that tests stay small) and its content is a function of its id, so a
//! block read back is checked byte for byte: a block with other bytes is counted
//! (`bad_blocks`) and recomputed, never used. An unreachable agent costs recomputation: the
//! link reconnects in the background and no request waits on a dead agent longer than
//! the call timeout. Offloads never wait on the agent: they queue without blocking, and
//! while the agent is slow, stopped or gone they are dropped and counted
//! (`warmpath_engine_agent_blocks_total{op="dropped"}`): the queue is full, there is no
//! live connection within a call deadline, or a put missed its deadline.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::mpsc;
use warmpath_cache_agent::client::{AgentAddr, AgentLink};
use warmpath_cache_agent::proto::StoreTier;
use warmpath_index::cost::Tier;
use warmpath_index::keys::BlockKey;

/// How engine-sim reaches its agent.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSettings {
    pub addr: AgentAddr,
    pub token: String,
    /// The layout id under which this engine's blocks are stored (engines of one model and
    /// shape share it, and so share blocks through L2).
    pub layout: u64,
    /// Payload bytes per block.
    pub block_bytes: usize,
    /// Deadline of each agent call.
    pub timeout: Duration,
}

/// Counters the engine-sim's `/metrics` shows.
#[derive(Debug, Default)]
pub struct AgentCounters {
    pub offloaded_blocks: AtomicU64,
    pub fetched_blocks: AtomicU64,
    pub bad_blocks: AtomicU64,
    pub errors: AtomicU64,
    pub dropped_offloads: AtomicU64,
    /// Lookups asked when a request arrived (before its admission).
    pub early_lookups: AtomicU64,
    /// Of those, answers that reached the request while it still queued, so that its
    /// admission asked nothing.
    pub early_answers: AtomicU64,
}

/// The live link to the agent.
#[derive(Debug)]
pub struct AgentSide {
    settings: AgentSettings,
    link: Arc<AgentLink>,
    offloads: mpsc::Sender<Vec<BlockKey>>,
    pub counters: Arc<AgentCounters>,
}

/// Blocks per offload put.
const OFFLOAD_BATCH: usize = 64;

impl AgentSide {
    /// Connects lazily and starts the offload task (inside a tokio runtime).
    pub fn start(settings: AgentSettings) -> Arc<AgentSide> {
        let link = Arc::new(AgentLink::new(
            settings.addr.clone(),
            settings.token.clone(),
            settings.timeout,
        ));
        let counters = Arc::new(AgentCounters::default());
        let (tx, rx) = mpsc::channel(1024);
        tokio::spawn(offload_task(
            link.clone(),
            settings.clone(),
            counters.clone(),
            rx,
        ));
        Arc::new(AgentSide {
            settings,
            link,
            offloads: tx,
            counters,
        })
    }

    /// Queues blocks the GPU evicted for the agent; never waits (a full queue drops them,
    /// counted: the cost is a later recomputation).
    pub fn offload(&self, keys: Vec<BlockKey>) {
        let n = keys.len() as u64;
        if self.offloads.try_send(keys).is_err() {
            self.counters
                .dropped_offloads
                .fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The blocks of `keys` (the part of a prompt past the GPU's prefix) that the agent has,
    /// from the first on, fetched and checked: their tiers, leading run only. Within the
    /// call deadline in all (lookup and get): a slow agent costs a recompute, not more
    /// waiting. The lease is released without waiting for the answer.
    pub async fn fetch(&self, keys: &[BlockKey]) -> Vec<Tier> {
        if keys.is_empty() {
            return Vec::new();
        }
        let Some(client) = self.link.client() else {
            return Vec::new();
        };
        let layout = self.settings.layout;
        let raw: Vec<u64> = keys.iter().map(|k| k.0).collect();
        let result = tokio::time::timeout(self.settings.timeout, async {
            let (lease, tiers) = client.lookup(layout, raw, Duration::from_secs(10)).await?;
            let wanted: Vec<u64> = keys[..tiers.len()].iter().map(|k| k.0).collect();
            let got = if wanted.is_empty() {
                Vec::new()
            } else {
                client.get(layout, wanted).await?
            };
            let client = client.clone();
            tokio::spawn(async move {
                let _ = client.release(lease).await;
            });
            Ok::<_, warmpath_cache_agent::client::ClientError>(got)
        })
        .await
        .unwrap_or_else(|_| {
            Err(warmpath_cache_agent::client::ClientError::Timeout(
                self.settings.timeout,
            ))
        });
        let got = match result {
            Ok(g) => g,
            Err(e) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "cache agent fetch failed; recomputing");
                self.link.reset();
                return Vec::new();
            }
        };
        let mut tiers = Vec::new();
        for (key, block) in keys.iter().zip(got) {
            let Some(block) = block else { break };
            if block.payload != payload(layout, *key, self.settings.block_bytes) {
                self.counters.bad_blocks.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = key.0, "cache agent returned other bytes; recomputing");
                break;
            }
            tiers.push(match block.tier {
                StoreTier::L1 => Tier::L1,
                StoreTier::L2 => Tier::L2,
            });
        }
        self.counters
            .fetched_blocks
            .fetch_add(tiers.len() as u64, Ordering::Relaxed);
        tiers
    }
}

async fn offload_task(
    link: Arc<AgentLink>,
    settings: AgentSettings,
    counters: Arc<AgentCounters>,
    mut rx: mpsc::Receiver<Vec<BlockKey>>,
) {
    let mut batch: Vec<BlockKey> = Vec::new();
    while let Some(keys) = rx.recv().await {
        batch.extend(keys);
        while let Ok(more) = rx.try_recv() {
            batch.extend(more);
        }
        // Once the link could not come back within a call deadline, the rest of the batch
        // is dropped without waiting again.
        let mut reachable = true;
        for chunk in batch.chunks(OFFLOAD_BATCH) {
            let client = if reachable {
                // Only this task waits, never the engine: what the engine evicts meanwhile
                // queues. Taking no for an answer at once dropped every block queued behind
                // one failed call (record 0128).
                link.client_within(settings.timeout).await
            } else {
                link.client()
            };
            let Some(client) = client else {
                reachable = false;
                counters
                    .dropped_offloads
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                continue;
            };
            let blocks = chunk
                .iter()
                .map(|k| {
                    (
                        k.0,
                        payload(settings.layout, *k, settings.block_bytes),
                        false,
                    )
                })
                .collect();
            match client.put(settings.layout, blocks).await {
                Ok(r) => {
                    counters
                        .offloaded_blocks
                        .fetch_add(u64::from(r.stored), Ordering::Relaxed);
                }
                Err(e) => {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    counters
                        .dropped_offloads
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    tracing::debug!(error = %e, "cache agent offload failed");
                    link.reset();
                }
            }
        }
        batch.clear();
    }
}

/// The bytes of block `key`: its layout and key repeated, `len` long.
pub fn payload(layout: u64, key: BlockKey, len: usize) -> Bytes {
    let mut pattern = [0u8; 16];
    pattern[..8].copy_from_slice(&layout.to_le_bytes());
    pattern[8..].copy_from_slice(&key.0.to_le_bytes());
    let mut out = BytesMut::with_capacity(len);
    while out.len() + 16 <= len {
        out.put_slice(&pattern);
    }
    out.put_slice(&pattern[..len - out.len()]);
    out.freeze()
}

/// A layout id for a model name and block size: engines that agree on both share blocks.
pub fn layout_of(model: &str, block_tokens: u32) -> u64 {
    let h = blake3::hash(format!("{model}\0{block_tokens}").as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_name_their_block() {
        let a = payload(1, BlockKey(2), 40);
        assert_eq!(a.len(), 40);
        assert_eq!(a, payload(1, BlockKey(2), 40));
        assert_ne!(a, payload(1, BlockKey(3), 40));
        assert_eq!(payload(1, BlockKey(2), 0).len(), 0);
        assert_ne!(layout_of("m", 16), layout_of("m", 32));
    }
}
