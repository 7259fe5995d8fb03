//! engine-sim's KV events (`warmpath engine-sim --kv-events tcp://HOST:PORT`): the engine
//! model's GPU stores, evictions and resets published exactly as vLLM 0.33 publishes them
//! (ZMQ PUB, frames topic / 8-byte big-endian sequence / msgpack `KVEventBatch`: the batch
//! an array with the data-parallel rank, each event a map tagged by `"type"`;
//! [`Shape::VllmMaps`]), so that a consumer built on vLLM 0.33's own types reads
//! engine-sim (checked in tests/kv_events.rs by decoding the stream with vLLM's
//! `kv_events.py` and encoding it back to the same bytes).
//!
//! A stored block's event carries its token ids, its parent's hash and, for a chain's first
//! block, the request's `cache_salt` in its extra keys (`nil` for a block without extra
//! keys), as vLLM's do. Block hashes are 64-bit integers, as vLLM publishes them by default
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`). engine-sim's own block hash is the warmpath
//! key it computes for its prefix cache; the agent never uses it as a key (it recomputes
//! keys from the tokens), only to match removals.
//!
//! The engine loop hands each step's events to [`KvPublisher::publish`], which never waits:
//! batches go through a bounded queue to a task that owns the socket (a full queue drops
//! the batch, which the subscriber sees as a sequence gap).
//!
//! With a replay endpoint (`--kv-replay tcp://HOST:PORT`), the last [`REPLAY_BATCHES`]
//! batches are kept and served as vLLM 0.33's replay socket serves them
//! (`ZmqEventPublisher._service_replay`): a ROUTER socket takes a request `[identity,
//! empty, start]` (a DEALER's or REQ's empty delimiter, then the 8-byte big-endian
//! sequence number to start from; any other shape is ignored, as vLLM logs and drops it),
//! and answers each kept batch from there as `[identity, empty, topic, sequence, payload]`,
//! then an end marker `[identity, empty, empty, -1, empty]` (the sequence -1 as a signed
//! 8-byte number; the topic frame empty). A DEALER peer sees `[empty, topic, sequence,
//! payload]`. vLLM up to 0.25 answered without the topic frame; the agent reads both
//! (`kv_events::parse_replay`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::mpsc;
use warmpath_cache_agent::kv_events::{encode_batch, EngineHash, KvEvent, Shape};
use warmpath_index::keys::BlockKey;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Batches kept for replay (vLLM's default buffer is 10,000 steps).
pub const REPLAY_BATCHES: usize = 10_000;

type Kept = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// What engine-sim knows of a block it may store: its parent, tokens and the salt of its
/// chain's first block.
#[derive(Clone, Debug)]
pub struct BlockInfo {
    pub parent: Option<BlockKey>,
    pub tokens: Vec<u32>,
    pub salt: Option<String>,
}

/// The engine loop's side of the publisher.
#[derive(Debug)]
pub struct KvPublisher {
    tx: mpsc::Sender<Vec<u8>>,
    /// Blocks of submitted requests, until the GPU evicts them (bounded by pruning).
    info: HashMap<BlockKey, BlockInfo>,
    block_tokens: u32,
    pending: Vec<KvEvent>,
    /// Batches dropped because the queue was full.
    pub dropped: u64,
}

impl KvPublisher {
    /// Binds a PUB socket at `endpoint` (`tcp://HOST:PORT`), and a replay socket at
    /// `replay` if given, and starts the sending task; returns the bound endpoint (port 0
    /// picks one).
    pub async fn bind(
        endpoint: &str,
        replay: Option<&str>,
        block_tokens: u32,
    ) -> Result<(KvPublisher, String), String> {
        let mut socket = zeromq::PubSocket::new();
        let bound = socket
            .bind(endpoint)
            .await
            .map_err(|e| format!("cannot publish KV events on {endpoint}: {e}"))?;
        let kept: Option<Kept> = match replay {
            Some(at) => {
                let mut router = zeromq::RouterSocket::new();
                router
                    .bind(at)
                    .await
                    .map_err(|e| format!("cannot serve KV-event replay on {at}: {e}"))?;
                let kept = Kept::default();
                tokio::spawn(serve_replay(router, kept.clone()));
                Some(kept)
            }
            None => None,
        };
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(1024);
        tokio::spawn(async move {
            let mut seq: u64 = 0;
            while let Some(payload) = rx.recv().await {
                let payload = Bytes::from(payload);
                if let Some(kept) = &kept {
                    let mut k = kept.lock().unwrap_or_else(|e| e.into_inner());
                    if k.len() >= REPLAY_BATCHES {
                        k.pop_front();
                    }
                    k.push_back((seq, payload.clone()));
                }
                let frames = warmpath_cache_agent::kv_events::message(seq, payload);
                seq += 1;
                if let Ok(msg) = ZmqMessage::try_from(frames) {
                    if let Err(e) = socket.send(msg).await {
                        tracing::debug!(error = %e, "kv event publish failed");
                    }
                }
            }
        });
        Ok((
            KvPublisher {
                tx,
                info: HashMap::new(),
                block_tokens,
                pending: Vec::new(),
                dropped: 0,
            },
            bound.to_string(),
        ))
    }

    /// Remembers the blocks of a submitted request (`keys` over `tokens`), so their stores
    /// can be published with tokens. `resident` says whether a key is on the GPU now, for
    /// pruning what was never stored.
    pub fn note_request(
        &mut self,
        keys: &[BlockKey],
        tokens: &[u32],
        salt: Option<&str>,
        limit: usize,
        resident: impl Fn(BlockKey) -> bool,
    ) {
        if self.info.len() > limit {
            self.info.retain(|k, _| resident(*k));
        }
        let bt = self.block_tokens as usize;
        for (i, key) in keys.iter().enumerate() {
            self.info.entry(*key).or_insert_with(|| BlockInfo {
                parent: i.checked_sub(1).map(|p| keys[p]),
                tokens: tokens[i * bt..(i + 1) * bt].to_vec(),
                salt: if i == 0 {
                    salt.filter(|s| !s.is_empty()).map(str::to_string)
                } else {
                    None
                },
            });
        }
    }

    /// A block became resident on the GPU.
    pub fn stored(&mut self, key: BlockKey) {
        let Some(info) = self.info.get(&key) else {
            return;
        };
        self.pending.push(KvEvent::Stored {
            block_hashes: vec![hash(key)],
            parent: info.parent.map(hash),
            token_ids: info.tokens.clone(),
            block_size: self.block_tokens,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: vec![info.salt.clone().into_iter().collect()],
        });
    }

    /// A block left the GPU.
    pub fn removed(&mut self, key: BlockKey) {
        self.pending.push(KvEvent::Removed {
            block_hashes: vec![hash(key)],
            medium: Some("GPU".into()),
        });
    }

    /// LMCache stored a chunk in its CPU tier (engine-sim in HyperPod mode,
    /// `hyperpod.rs`): a `BlockStored` with medium `"cpu"` as LMCache publishes it, the
    /// chunk hash an int (the one its key prints), its parent the previous chunk's hash,
    /// `block_size` the chunk's length, no extra keys. A negative hash goes out as the
    /// unsigned int of the same 8 bytes (`encode_batch` writes 8-byte hashes unsigned),
    /// which the agent reads as it reads the key's `-hex`.
    pub fn stored_chunk(&mut self, hash: i64, parent: Option<i64>, tokens: &[u32]) {
        self.pending.push(KvEvent::Stored {
            block_hashes: vec![int_hash(hash)],
            parent: parent.map(int_hash),
            token_ids: tokens.to_vec(),
            block_size: tokens.len() as u32,
            lora_id: None,
            medium: Some(CPU.into()),
            lora_name: None,
            extra_keys: Vec::new(),
        });
    }

    /// LMCache's CPU copy of a chunk is gone.
    pub fn removed_chunk(&mut self, hash: i64) {
        self.pending.push(KvEvent::Removed {
            block_hashes: vec![int_hash(hash)],
            medium: Some(CPU.into()),
        });
    }

    /// Sends what was recorded since the last flush as one batch at `ts` (seconds).
    pub fn flush(&mut self, ts: f64) {
        if self.pending.is_empty() {
            return;
        }
        let payload = encode_batch(ts, &self.pending, Shape::VllmMaps);
        self.pending.clear();
        if self.tx.try_send(payload).is_err() {
            self.dropped += 1;
        }
    }
}

/// Answers replay requests from the kept batches until the socket fails.
async fn serve_replay(mut router: zeromq::RouterSocket, kept: Kept) {
    loop {
        let Ok(request) = router.recv().await else {
            return;
        };
        // [identity, empty delimiter, start sequence], as vLLM 0.33 requires.
        let [identity, _, start] = &request.into_vec()[..] else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = kept
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let end = (u64::MAX, Bytes::new()); // -1 as a signed 8-byte number
        for (seq, payload) in batches.into_iter().chain(std::iter::once(end)) {
            // vLLM 0.33 answers `[identity, empty, topic, sequence, batch]` (its end
            // marker's topic is empty too; engine-sim publishes under the empty topic).
            let mut reply = vec![identity.clone(), Bytes::new()];
            reply.extend(warmpath_cache_agent::kv_events::message(seq, payload));
            let Ok(msg) = ZmqMessage::try_from(reply) else {
                break;
            };
            if router.send(msg).await.is_err() {
                break;
            }
        }
    }
}

fn hash(key: BlockKey) -> EngineHash {
    EngineHash::of_u64(key.0)
}

/// LMCache's medium for its CPU tier.
const CPU: &str = "cpu";

/// An LMCache chunk hash (a Python int, maybe negative) as the events carry it: its 8
/// big-endian bytes, which is what the agent makes of the int in an event and of the hex
/// in an object's key (`ObjectName::chunk_hash`).
fn int_hash(h: i64) -> EngineHash {
    EngineHash(h.to_be_bytes().to_vec())
}
