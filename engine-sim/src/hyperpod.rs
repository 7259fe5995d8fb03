//! engine-sim's side of the agent's HyperPod daemon API (`warmpath engine-sim --agent-protocol
//! hyperpod`): the engine speaks to its host's agent as LMCache's
//! `SageMakerHyperPodConnector` does (lmcache 0.5.6; record 0109), so that the demo and the
//! tests drive the protocol real vLLM + LMCache pods use, not only warmpath's block API.
//!
//! - **Chunks, as LMCache cuts them.** A prompt's complete blocks are cut into chunks of
//!   `chunk_tokens` (LMCache's `chunk_size`, 256 by default; a multiple of the block size),
//!   the last one shorter. Each chunk's hash chains the previous one's as LMCache's
//!   `ChunkedTokenDatabase` does where vLLM's hashing cannot be imported: Python's builtin
//!   `hash((prefix_hash, tuple(tokens), ()))`, from `NONE_HASH = 0` ([`chunk_hash`]: CPython's
//!   tuple and int hashes, which are the same in every process for ints). So the hashes, and
//!   the keys, are the ones LMCache computes for the same tokens.
//! - **Stores, as LMCache stores.** A chunk is stored once the engine has computed it (when
//!   its last block becomes resident on the GPU), write-through, not at a GPU eviction:
//!   `PUT /v1/kv/lmcache/{key}` with the key `CacheEngineKey.to_string()`
//!   (`model@1@0@{hash:x}@bfloat16`) percent-encoded as `urllib.parse.quote(key, safe="")`
//!   writes it, and the body the 28-byte `RemoteMetadata` header (payload length, format
//!   KV_2LTD, dtype bfloat16, shape `[2, 1, tokens, hidden]`) then the payload. 200 and 409
//!   (stored already) count as stored, as they do for LMCache. Puts go through a bounded
//!   queue to a task of their own: the engine never waits, and a full queue, a failed put
//!   or a dead agent drops the chunk, counted, as the block API's offloads are.
//! - **Loads at admission.** When the engine admits a request whose prompt continues past
//!   the GPU's prefix, the chunks covering the blocks asked for are leased one after the
//!   other (`POST …/leases?timeout_ms=&ttl_s=`), read from the agent's shared-memory
//!   segment (`/dev/shm/NAME`, opened read-only, read with `pread` at the lease's offsets:
//!   mapping it would need `unsafe`), checked byte for byte and released
//!   (`POST /v1/leases/{id}/release`, not waited for). The first miss, wrong byte or error
//!   ends the run; the rest is recomputed. The whole lookup is bounded by the call deadline.
//! - **Payloads** are the chunk's blocks' bytes (`offload::payload` of the chunk hash, the
//!   block API's payload length per block), so a chunk read back is checked as a block is.
//!
//! The KV events of the chunks (LMCache's CPU `BlockStored`, and its `BlockRemoved` once
//! its copy is gone) are published by the engine loop through `kv_publish`, from what
//! [`ChunkPlan`] and the put task tell it.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tokio::sync::mpsc;
use tokio::time::Instant;
use warmpath_cache_agent::hyperpod::request::{
    cache_engine_key, encode_key, remote_metadata, Meta, LMCACHE_BUCKET,
};
use warmpath_cache_agent::hyperpod::METADATA_BYTES;
use warmpath_index::cost::Tier;
use warmpath_index::keys::BlockKey;

use crate::offload::{payload, AgentCounters};

/// LMCache's chunk size by default (`chunk_size`).
pub const DEFAULT_CHUNK_TOKENS: u32 = 256;
/// The dtype the keys name (`CacheEngineKey`'s `bfloat16`) and its `RemoteMetadata` code.
const DTYPE: &str = "bfloat16";
const DTYPE_CODE: i32 = 3;
/// `MemoryFormat.KV_2LTD`: `[2, layers, tokens, hidden]`.
const FMT_KV_2LTD: i32 = 1;
/// The lease ttl asked (LMCache's adapter's default).
const LEASE_TTL_S: f64 = 30.0;
/// Chunks queued for a put at most; more are dropped, counted.
const PUT_QUEUE: usize = 1024;
/// Longest answer body read from the API (a lease's JSON, an error).
const ANSWER_BYTES: usize = 64 << 10;
/// Hashes of chunks just loaded that are not stored again, at most.
const JUST_FETCHED: usize = 4096;

/// How engine-sim reaches its agent's HyperPod API.
#[derive(Clone, Debug, PartialEq)]
pub struct HyperPodSettings {
    /// The API's base URL, `http://HOST:PORT`.
    pub url: String,
    /// The agent's segment, `/dev/shm/NAME`.
    pub shm_name: String,
    /// The model name the keys carry.
    pub model: String,
    /// Payloads are a function of this and the chunk hash (`offload::layout_of`).
    pub layout: u64,
    /// Tokens per chunk, a multiple of `block_tokens`.
    pub chunk_tokens: u32,
    /// The engine's block size.
    pub block_tokens: u32,
    /// Payload bytes per block.
    pub block_bytes: usize,
    /// Deadline of a put, and of a whole lookup.
    pub timeout: Duration,
}

impl HyperPodSettings {
    /// Blocks per whole chunk.
    pub fn chunk_blocks(&self) -> usize {
        (self.chunk_tokens / self.block_tokens.max(1)).max(1) as usize
    }
}

// ---------------------------------------------------------------------------------------
// LMCache's chunks (pure)

/// CPython's hash of an int (`hash(v)` for `v` in i64): `v mod 2**61 - 1`, signed as `v`,
/// and -1 (an error code in C) becomes -2.
fn py_int_hash(v: i64) -> i64 {
    const MODULUS: u64 = (1 << 61) - 1;
    let m = (v.unsigned_abs() % MODULUS) as i64;
    let h = if v < 0 { -m } else { m };
    if h == -1 {
        -2
    } else {
        h
    }
}

/// CPython's (3.8 and later) hash of a tuple whose items hash to `lanes` (xxHash's mixing).
fn py_tuple_hash(lanes: impl ExactSizeIterator<Item = i64>) -> i64 {
    const P1: u64 = 11_400_714_785_074_694_791;
    const P2: u64 = 14_029_467_366_897_019_727;
    const P5: u64 = 2_870_177_450_012_600_261;
    let len = lanes.len() as u64;
    let mut acc = P5;
    for lane in lanes {
        acc = acc.wrapping_add((lane as u64).wrapping_mul(P2));
        acc = acc.rotate_left(31);
        acc = acc.wrapping_mul(P1);
    }
    acc = acc.wrapping_add(len ^ (P5 ^ 3_527_539));
    if acc == u64::MAX {
        1_546_275_796
    } else {
        acc as i64
    }
}

/// The hash LMCache gives a chunk of `tokens` after a chunk hashed `prefix` (`NONE_HASH`,
/// 0, for the first): `hash((prefix, tuple(tokens), ()))` with Python's builtin hash.
pub fn chunk_hash(prefix: i64, tokens: &[u32]) -> i64 {
    let tokens = py_tuple_hash(tokens.iter().map(|&t| py_int_hash(i64::from(t))));
    let no_extra = py_tuple_hash(std::iter::empty());
    py_tuple_hash([py_int_hash(prefix), tokens, no_extra].into_iter())
}

/// One chunk of a prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunk {
    pub hash: i64,
    /// The previous chunk's hash (none for the first).
    pub parent: Option<i64>,
    /// The prompt's blocks it holds.
    pub blocks: Range<usize>,
    pub tokens: Vec<u32>,
}

/// A prompt cut into LMCache's chunks.
#[derive(Debug, PartialEq)]
pub struct Prompt {
    /// The prompt's block keys (complete blocks).
    pub keys: Vec<BlockKey>,
    pub chunks: Vec<Chunk>,
    chunk_blocks: usize,
}

impl Prompt {
    /// Cuts the complete blocks of `tokens` (`keys`, `block_tokens` each) into chunks of
    /// `chunk_blocks` blocks, the last one shorter.
    pub fn new(
        keys: Vec<BlockKey>,
        tokens: &[u32],
        block_tokens: usize,
        chunk_blocks: usize,
    ) -> Self {
        let chunk_blocks = chunk_blocks.max(1);
        let n = keys.len().min(tokens.len() / block_tokens.max(1));
        let mut chunks = Vec::with_capacity(n.div_ceil(chunk_blocks));
        let mut parent = None;
        for start in (0..n).step_by(chunk_blocks) {
            let end = (start + chunk_blocks).min(n);
            let tokens = tokens[start * block_tokens..end * block_tokens].to_vec();
            let hash = chunk_hash(parent.unwrap_or(0), &tokens);
            chunks.push(Chunk {
                hash,
                parent,
                blocks: start..end,
                tokens,
            });
            parent = Some(hash);
        }
        Prompt {
            keys,
            chunks,
            chunk_blocks,
        }
    }

    /// The chunk holding block `i`.
    pub fn chunk_of(&self, i: usize) -> usize {
        i / self.chunk_blocks
    }
}

/// The engine loop's bookkeeping of chunks (pure): the prompts of live requests, which
/// block completes which chunk, which chunks are being stored (their CPU `BlockStored`
/// published, no `BlockRemoved` yet) and which were just loaded (not stored again).
#[derive(Debug, Default)]
pub struct ChunkPlan {
    live: HashMap<u64, Arc<Prompt>>,
    /// A chunk's last block → (a prompt holding the chunk, its index, live prompts that do).
    ends: HashMap<BlockKey, (Arc<Prompt>, usize, u32)>,
    storing: HashSet<i64>,
    just_fetched: HashSet<i64>,
}

impl ChunkPlan {
    /// Request `id` was queued with `prompt`.
    pub fn submitted(&mut self, id: u64, prompt: Arc<Prompt>) {
        for (c, chunk) in prompt.chunks.iter().enumerate() {
            let Some(&end) = prompt.keys.get(chunk.blocks.end - 1) else {
                continue;
            };
            self.ends
                .entry(end)
                .or_insert_with(|| (prompt.clone(), c, 0))
                .2 += 1;
        }
        self.live.insert(id, prompt);
    }

    /// Request `id` finished or was cancelled.
    pub fn finished(&mut self, id: u64) {
        let Some(prompt) = self.live.remove(&id) else {
            return;
        };
        for chunk in &prompt.chunks {
            let Some(end) = prompt.keys.get(chunk.blocks.end - 1) else {
                continue;
            };
            if let Some(e) = self.ends.get_mut(end) {
                e.2 -= 1;
                if e.2 == 0 {
                    self.ends.remove(end);
                }
            }
        }
    }

    /// Block `key` became resident on the GPU: the chunk it completes, to be stored, unless
    /// it is being stored or was just loaded from the agent. The caller tells
    /// [`ChunkPlan::storing`] whether the put was queued.
    pub fn stored(&mut self, key: BlockKey) -> Option<(Arc<Prompt>, usize)> {
        let (prompt, c, _) = self.ends.get(&key)?;
        let hash = prompt.chunks[*c].hash;
        if self.just_fetched.remove(&hash) || self.storing.contains(&hash) {
            return None;
        }
        Some((prompt.clone(), *c))
    }

    /// The put of chunk `hash` was queued.
    pub fn storing(&mut self, hash: i64) {
        self.storing.insert(hash);
    }

    /// The put of chunk `hash` ended (stored or not): its staging copy is gone.
    pub fn put_done(&mut self, hash: i64) {
        self.storing.remove(&hash);
    }

    /// Where request `id`'s lookup of `keys` starts: its prompt and the index of `keys[0]`.
    pub fn lookup(&self, id: u64, keys: &[BlockKey]) -> Option<(Arc<Prompt>, usize)> {
        let prompt = self.live.get(&id)?;
        let first = keys.first()?;
        let from = prompt.keys.iter().position(|k| k == first)?;
        Some((prompt.clone(), from))
    }

    /// Chunks `hashes` were loaded from the agent: their blocks' GPU stores that follow
    /// store nothing.
    pub fn fetched(&mut self, hashes: &[i64]) {
        if self.just_fetched.len() + hashes.len() > JUST_FETCHED {
            self.just_fetched.clear();
        }
        self.just_fetched.extend(hashes);
    }

    /// Live requests followed.
    pub fn live(&self) -> usize {
        self.live.len()
    }
}

// ---------------------------------------------------------------------------------------
// The link (I/O)

/// Objects exchanged with the agent, by outcome (the `/metrics` of engine-sim).
#[derive(Debug, Default)]
pub struct ObjectCounters {
    /// Puts answered 200.
    pub stored: AtomicU64,
    /// Puts answered 409: stored already, which counts as stored.
    pub existed: AtomicU64,
    /// Leases granted whose bytes were checked and used.
    pub loaded: AtomicU64,
    /// Leases answered 404.
    pub missed: AtomicU64,
}

/// A chunk to store.
#[derive(Clone, Copy, Debug)]
pub struct ChunkPut {
    pub hash: i64,
    /// Its blocks (its payload is this many blocks' bytes).
    pub blocks: usize,
}

/// The lease's answer (`{"id", "offsets": [{"offset", "len"}], "ttl_s"}`).
#[derive(serde::Deserialize)]
struct Lease {
    id: String,
    offsets: Vec<Span>,
}

#[derive(serde::Deserialize)]
struct Span {
    offset: u64,
    len: u64,
}

type Http = Client<HttpConnector, Full<Bytes>>;

/// The live link to the agent's HyperPod API.
#[derive(Debug)]
pub struct HyperPodSide {
    settings: HyperPodSettings,
    http: Http,
    /// The segment, opened read-only at the first load (the agent keeps its inode across
    /// restarts, so one open serves the engine's life).
    segment: Mutex<Option<Arc<File>>>,
    puts: mpsc::Sender<ChunkPut>,
    pub counters: Arc<AgentCounters>,
    pub objects: Arc<ObjectCounters>,
}

impl HyperPodSide {
    /// Starts the put task (inside a tokio runtime); the hash of each chunk whose put
    /// ended, stored or not, is sent on `done`.
    pub fn start(settings: HyperPodSettings, done: mpsc::UnboundedSender<i64>) -> Arc<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(settings.timeout));
        let http = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        let (tx, rx) = mpsc::channel(PUT_QUEUE);
        let side = Arc::new(HyperPodSide {
            settings,
            http,
            segment: Mutex::new(None),
            puts: tx,
            counters: Arc::new(AgentCounters::default()),
            objects: Arc::new(ObjectCounters::default()),
        });
        tokio::spawn(put_task(side.clone(), rx, done));
        side
    }

    pub fn settings(&self) -> &HyperPodSettings {
        &self.settings
    }

    /// Queues a chunk's put; never waits. False when the queue is full: the chunk is
    /// dropped, counted.
    pub fn offload(&self, put: ChunkPut) -> bool {
        if self.puts.try_send(put).is_err() {
            self.counters
                .dropped_offloads
                .fetch_add(put.blocks as u64, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The `n` blocks of `prompt` from block `from` on that the agent has, chunk by chunk,
    /// leased, read from the segment and checked: their tiers (leading run only), and the
    /// hashes of the chunks loaded. Within the call deadline in all; a load still going at
    /// the deadline runs on in its own task, so that its lease is released.
    pub async fn fetch(
        self: &Arc<Self>,
        prompt: &Prompt,
        from: usize,
        n: usize,
    ) -> (Vec<Tier>, Vec<i64>) {
        let end = (from + n).min(prompt.keys.len());
        let deadline = Instant::now() + self.settings.timeout;
        let mut covered = from;
        let mut loaded = Vec::new();
        let mut c = prompt.chunk_of(from);
        while covered < end {
            let Some(chunk) = prompt.chunks.get(c) else {
                break;
            };
            let (side, owned) = (self.clone(), chunk.clone());
            let load = tokio::spawn(async move { side.load(&owned).await });
            let answer = tokio::time::timeout_at(deadline, load)
                .await
                .map(|joined| joined.unwrap_or_else(|e| Err(e.to_string())));
            match answer {
                Ok(Ok(true)) => {
                    loaded.push(chunk.hash);
                    covered = chunk.blocks.end.min(end);
                }
                Ok(Ok(false)) => break,
                Ok(Err(error)) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%error, "hyperpod load failed; recomputing");
                    break;
                }
                Err(_) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("hyperpod load timed out; recomputing");
                    break;
                }
            }
            c += 1;
        }
        let blocks = covered - from;
        self.counters
            .fetched_blocks
            .fetch_add(blocks as u64, Ordering::Relaxed);
        (vec![Tier::L1; blocks], loaded)
    }

    /// Leases `chunk`, reads and checks it, releases the lease: true when its bytes are
    /// right, false on a miss or other bytes (counted), an error otherwise.
    async fn load(&self, chunk: &Chunk) -> Result<bool, String> {
        let s = &self.settings;
        let uri = format!(
            "{}/leases?timeout_ms={}&ttl_s={LEASE_TTL_S}",
            self.object_uri(chunk.hash),
            s.timeout.as_millis()
        );
        let (status, body) = self.call(Method::POST, &uri, Bytes::new()).await?;
        if status == StatusCode::NOT_FOUND {
            self.objects.missed.fetch_add(1, Ordering::Relaxed);
            return Ok(false);
        }
        if status != StatusCode::OK {
            return Err(format!("lease answered {status}"));
        }
        let lease: Lease =
            serde_json::from_slice(&body).map_err(|e| format!("lease answer: {e}"))?;
        let want = payload(
            s.layout,
            BlockKey(chunk.hash as u64),
            chunk.blocks.len() * s.block_bytes,
        );
        let read = self
            .read(lease.offsets, METADATA_BYTES as usize + want.len())
            .await;
        // Released whatever was read; not waited for.
        let release = format!("{}/v1/leases/{}/release", s.url, lease.id);
        let (http, timeout) = (self.http.clone(), s.timeout);
        tokio::spawn(async move {
            let req = empty_post(&release);
            let _ = tokio::time::timeout(timeout, http.request(req)).await;
        });
        let bytes = read?;
        let header_len = i32::from_le_bytes(bytes[..4].try_into().unwrap_or([0; 4]));
        if i64::from(header_len) != want.len() as i64
            || bytes[METADATA_BYTES as usize..] != want[..]
        {
            self.counters
                .bad_blocks
                .fetch_add(chunk.blocks.len() as u64, Ordering::Relaxed);
            tracing::warn!(
                hash = chunk.hash,
                "hyperpod object holds other bytes; recomputing"
            );
            return Ok(false);
        }
        self.objects.loaded.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// The bytes at `spans` of the segment, which must add up to `len`.
    async fn read(&self, spans: Vec<Span>, len: usize) -> Result<Vec<u8>, String> {
        let total: u64 = spans.iter().map(|s| s.len).sum();
        if total != len as u64 {
            return Err(format!("lease of {total} bytes, the object has {len}"));
        }
        let file = self.segment()?;
        tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::FileExt;
            let mut out = vec![0u8; len];
            let mut at = 0;
            for s in spans {
                let part = &mut out[at..at + s.len as usize];
                file.read_exact_at(part, s.offset)
                    .map_err(|e| format!("reading the segment at {}: {e}", s.offset))?;
                at += s.len as usize;
            }
            Ok(out)
        })
        .await
        .map_err(|e| e.to_string())?
    }

    fn segment(&self) -> Result<Arc<File>, String> {
        let mut seg = self.segment.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = &*seg {
            return Ok(f.clone());
        }
        let path = format!("/dev/shm/{}", self.settings.shm_name);
        let f = Arc::new(File::open(&path).map_err(|e| format!("{path}: {e}"))?);
        *seg = Some(f.clone());
        Ok(f)
    }

    /// `{url}/v1/kv/lmcache/{key}` of a chunk hash.
    fn object_uri(&self, hash: i64) -> String {
        let s = &self.settings;
        let key = cache_engine_key(&s.model, 1, 0, hash, DTYPE);
        format!("{}/v1/kv/{LMCACHE_BUCKET}/{}", s.url, encode_key(&key))
    }

    /// One request; its status and (bounded) body.
    async fn call(
        &self,
        method: Method,
        uri: &str,
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), String> {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header(hyper::header::CONTENT_LENGTH, body.len())
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let resp = self.http.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }

    /// Stores one chunk: true when stored (200) or stored already (409).
    async fn put(&self, put: ChunkPut) -> Result<bool, String> {
        let s = &self.settings;
        let data = payload(
            s.layout,
            BlockKey(put.hash as u64),
            put.blocks * s.block_bytes,
        );
        let tokens = put.blocks * s.block_tokens as usize;
        let mut body = BytesMut::with_capacity(METADATA_BYTES as usize + data.len());
        body.put_slice(&metadata(data.len(), tokens));
        body.put_slice(&data);
        let uri = self.object_uri(put.hash);
        let (status, answer) = self.call(Method::PUT, &uri, body.freeze()).await?;
        match status {
            StatusCode::OK => {
                self.objects.stored.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            StatusCode::CONFLICT => {
                self.objects.existed.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            other => Err(format!(
                "put answered {other}: {}",
                String::from_utf8_lossy(&answer[..answer.len().min(200)])
            )),
        }
    }
}

/// LMCache's `RemoteMetadata` for a payload of `len` bytes over `tokens` tokens: length,
/// format KV_2LTD, dtype bfloat16, shape `[2, 1, tokens, hidden]` (hidden: what the
/// payload's bytes give at 2 bytes a value; the agent reads only the length).
fn metadata(len: usize, tokens: usize) -> [u8; METADATA_BYTES as usize] {
    let hidden = len / (2 * 2 * tokens.max(1));
    let meta = Meta {
        fmt: FMT_KV_2LTD,
        dtype: DTYPE_CODE,
        shape: [2, 1, tokens as i32, hidden as i32],
    };
    remote_metadata(len as u32, meta)
}

fn empty_post(uri: &str) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(Bytes::new()));
    *req.method_mut() = Method::POST;
    if let Ok(u) = uri.parse() {
        *req.uri_mut() = u;
    }
    req.headers_mut().insert(
        hyper::header::CONTENT_LENGTH,
        hyper::header::HeaderValue::from(0),
    );
    req
}

/// Stores queued chunks one after the other; tells `done` of each.
async fn put_task(
    side: Arc<HyperPodSide>,
    mut rx: mpsc::Receiver<ChunkPut>,
    done: mpsc::UnboundedSender<i64>,
) {
    while let Some(put) = rx.recv().await {
        let outcome = tokio::time::timeout(side.settings.timeout, side.put(put))
            .await
            .unwrap_or_else(|_| Err("put timed out".into()));
        let c = &side.counters;
        match outcome {
            Ok(_) => {
                c.offloaded_blocks
                    .fetch_add(put.blocks as u64, Ordering::Relaxed);
            }
            Err(error) => {
                c.errors.fetch_add(1, Ordering::Relaxed);
                c.dropped_offloads
                    .fetch_add(put.blocks as u64, Ordering::Relaxed);
                tracing::debug!(%error, "hyperpod put failed");
            }
        }
        if done.send(put.hash).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_hashes_are_lmcache_builtin_hashes() {
        // Python 3.11: hash((0, (1, 2, 3), ())), then that chained over tokens 100..356.
        let h0 = chunk_hash(0, &[1, 2, 3]);
        assert_eq!(h0, 7_754_693_342_585_032_853);
        let tokens: Vec<u32> = (100..356).collect();
        assert_eq!(chunk_hash(h0, &tokens), -8_111_776_335_910_957_595);
        // hash((-5, (7,), ())), hash(-1), hash(2**61 - 1), hash(2**61), hash(-2**63).
        assert_eq!(chunk_hash(-5, &[7]), -1_989_423_217_090_194_049);
        assert_eq!(py_int_hash(-1), -2);
        assert_eq!(py_int_hash((1 << 61) - 1), 0);
        assert_eq!(py_int_hash(1 << 61), 1);
        assert_eq!(py_int_hash(i64::MIN), -4);
    }

    #[test]
    fn prompts_are_cut_into_chained_chunks_the_last_shorter() {
        let tokens: Vec<u32> = (0..100).collect();
        let keys: Vec<BlockKey> = (0..6).map(BlockKey).collect(); // 6 blocks of 16
        let p = Prompt::new(keys, &tokens, 16, 4);
        assert_eq!(p.chunks.len(), 2);
        assert_eq!(p.chunks[0].blocks, 0..4);
        assert_eq!(p.chunks[1].blocks, 4..6);
        assert_eq!(p.chunks[1].tokens, (64..96).collect::<Vec<u32>>());
        assert_eq!(p.chunks[0].hash, chunk_hash(0, &tokens[..64]));
        assert_eq!(p.chunks[1].parent, Some(p.chunks[0].hash));
        assert_eq!(
            p.chunks[1].hash,
            chunk_hash(p.chunks[0].hash, &tokens[64..96])
        );
        assert_eq!(p.chunk_of(5), 1);
    }

    #[test]
    fn a_chunk_is_stored_once_when_its_last_block_lands() {
        let tokens: Vec<u32> = (0..128).collect();
        let keys: Vec<BlockKey> = (10..18).map(BlockKey).collect();
        let p = Arc::new(Prompt::new(keys, &tokens, 16, 4));
        let mut plan = ChunkPlan::default();
        plan.submitted(1, p.clone());
        plan.submitted(2, p.clone());
        assert!(plan.stored(BlockKey(10)).is_none(), "not a chunk's end");
        let (_, c) = plan.stored(BlockKey(13)).expect("block 3 ends chunk 0");
        assert_eq!(c, 0);
        plan.storing(p.chunks[0].hash);
        assert!(plan.stored(BlockKey(13)).is_none(), "being stored");
        plan.put_done(p.chunks[0].hash);
        plan.fetched(&[p.chunks[1].hash]);
        assert!(plan.stored(BlockKey(17)).is_none(), "just loaded");
        assert!(plan.stored(BlockKey(17)).is_some(), "computed again later");
        assert_eq!(plan.lookup(2, &[BlockKey(15), BlockKey(16)]).unwrap().1, 5);
        plan.finished(1);
        assert!(
            plan.stored(BlockKey(13)).is_some(),
            "request 2 still holds it"
        );
        plan.finished(2);
        assert!(plan.stored(BlockKey(13)).is_none());
        assert!(plan.lookup(2, &[BlockKey(15)]).is_none());
        assert_eq!(plan.live(), 0);
    }

    #[test]
    fn metadata_is_seven_little_endian_ints() {
        let m = metadata(4096, 16);
        let ints: Vec<i32> = m
            .chunks(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(ints, [4096, 1, 3, 2, 1, 16, 64]);
    }
}
