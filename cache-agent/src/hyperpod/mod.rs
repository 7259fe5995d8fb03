//! The HyperPod daemon API: the agent as the node's tiered-storage daemon for an unmodified
//! vLLM + LMCache pod. LMCache's `SageMakerHyperPodConnector` (lmcache 0.5.6,
//! `remote_url: sagemaker-hyperpod://HOST:PORT`) speaks HTTP/1.1 to it, and reads objects
//! out of a POSIX shared-memory segment the agent owns. Record 0098 gives the reasons.
//!
//! | request | answer |
//! |---|---|
//! | `PUT /v1/kv/{bucket}/{key}`, body: a 28-byte `RemoteMetadata` header (7 LE int32: payload length, format, dtype, shape[4]) then the payload, with `Content-Length` | 200; 409 when the key is stored (or being stored); 411 without a length; 413 larger than the segment; 400 when the body stops early or its header's length disagrees (nothing is visible then); 507 when leased objects fill the segment |
//! | `POST /v1/kv/{bucket}/{key}/leases?timeout_ms=&ttl_s=` | 200 `application/json` `{"id", "offsets": [{"offset", "len"}], "ttl_s"}`: header and payload at that offset of the segment, not evicted until released or `ttl_s` (clamped to the configured maximum) has passed; 404 on a miss; 429 over the lease bounds |
//! | `POST /v1/leases/{id}/release` | 200; 400 not an id; 403 an id this agent never issued; 410 an id of an earlier run, or one that had expired; 404 released already |
//! | `GET /v1/health` | 200 with the segment's name, size and generation |
//!
//! Every error answer is JSON `{"error": "..."}` saying what is wrong. Keys are
//! `CacheEngineKey.to_string()` percent-encoded ([`request`]).
//!
//! Parts: [`request`] (what a request says: routes, keys, lease ids; pure), [`store`]
//! (which object is where, eviction by `warmpath-tiers`' `Ledger`, leases; pure, time
//! passed in), [`segment`] (the shared-memory file; I/O), and this module's [`HyperPod`],
//! the shell: HTTP in, body bytes into the segment, L2 behind it, a timer for leases.
//!
//! L2: with the agent's L2 configured, an object evicted from the segment is copied to it
//! (in the background; dropped, counted, when the queue is full), and a lease on an object
//! found only there loads it back into the segment first. With `[l2] write = "through"`
//! every stored object is copied to L2 as it is stored (read from its place before the put
//! commits, so no other put can have overwritten it), as LMCache stores each chunk in all
//! its backends: other hosts' agents lease it from L2 while this segment still holds it,
//! and its eviction copies nothing again (record 0132). An L2 object is the agent's
//! self-checking block (`block.rs`) whose payload starts with the object's name, so a hash
//! collision or another agent's object reads as a miss, never as wrong bytes; with the
//! cluster key (`[l2] key_file`) it is sealed, and an object not sealed under that key is a
//! counted miss (decision 0106), as the block API's are.
//!
//! Security: off loopback the API needs the agent's token as `Authorization: Bearer`,
//! checked before a body is read (LMCache's connector sends none: such an address serves
//! only clients that add it); on loopback it is open, as the block API is without a token.
//! The segment's file mode limits who maps it. A new connection is unproven until its
//! first request arrives ([`FIRST_REQUEST_TIMEOUT`]); unproven connections are capped and
//! the oldest displaced (`crate::handshakes`), so silent connections cannot keep clients
//! out. Leases end at their ttl (clamped to `max_lease`) and are capped overall and per
//! client address; puts being written are capped; a body is bounded by its
//! `Content-Length`, checked against the segment before it is read. A second put of a
//! stored key is refused (409) and counted, whatever its bytes: the first writer's bytes
//! stay, and an engine never loads bytes that changed under it.
//!
//! [`lm`] serves LMCache's `lm://` protocol as a second front to the same store.

pub mod lm;
pub mod request;
pub mod segment;
pub mod store;

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use metrics::{counter, gauge, histogram};
use tokio::sync::{mpsc, Semaphore};

use crate::block::{decode_with, Block, SealKey};
use crate::config::HyperPodConfig;
use crate::handshakes::Unproven;
use crate::l2::{AnyL2, L2Backend};
use crate::metric_names as names;
use request::{BadLeaseId, BadRequest, LeaseIds, ObjectName, Op};
use segment::{Segment, SegmentError};
use store::{Layout, LeaseError, Limits, Placement, PutError, ReleaseError, Store};
use warmpath_tiers::{BlockId, Eviction};

pub use request::METADATA_BYTES;
/// The lease ttl when a request names none (LMCache's connector's default).
pub const DEFAULT_TTL_S: f64 = 10.0;
/// Longest wait for the next piece of a body.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a request's headers (and between requests on a kept-alive connection).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a new connection's first request: until then it is unproven
/// (`crate::handshakes`), and a flood of silent connections displaces only its own kind.
/// LMCache's aiohttp client sends its request as soon as it has connected.
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often expired leases are collected and the gauges refreshed.
const TICK: Duration = Duration::from_millis(100);
/// Objects queued for L2 at most; more are dropped, counted.
const L2_QUEUE: usize = 256;
/// The derive-key context of L2 ids of HyperPod objects.
const L2_CONTEXT: &str = "warmpath 2026-12 hyperpod object v1";

/// What happened to an object of the segment, for the residency routers are told
/// ([`HyperPod::follow`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectEvent {
    /// Committed to the segment (a put, or loaded back from L2).
    Stored,
    /// Evicted from the segment and queued for L2.
    Spilled,
    /// Evicted from the segment, not kept anywhere.
    Evicted,
}

/// Told of each object event, after the store's lock is released.
pub type ObjectSink = Arc<dyn Fn(&ObjectName, ObjectEvent) + Send + Sync>;

/// The sink, once set.
#[derive(Default)]
struct Follower(std::sync::OnceLock<ObjectSink>);

impl std::fmt::Debug for Follower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "Follower(set)"
        } else {
            "Follower(none)"
        })
    }
}

/// The HyperPod daemon of one agent.
#[derive(Debug)]
pub struct HyperPod {
    segment: Segment,
    store: Mutex<Store>,
    ids: LeaseIds,
    /// Lease times are microseconds since this instant.
    epoch: Instant,
    /// The token a request must present, when its address is not loopback.
    token: Option<String>,
    /// The agent's L2, and the queue of objects evicted (or written through) to it.
    l2: Option<Arc<AnyL2>>,
    l2_writes: Option<mpsc::Sender<(BlockId, Block)>>,
    /// `[l2] write = "through"`: each stored object is copied to L2 when it is stored, as
    /// LMCache stores a chunk in every one of its backends, not when the segment evicts it.
    write_through: bool,
    /// Objects whose copy to L2 was queued when they were stored (or that were loaded from
    /// L2): their eviction copies nothing again. At most the segment's objects: an entry
    /// leaves with its object.
    in_l2: Mutex<HashSet<ObjectName>>,
    /// The cluster key and this agent's writer id: L2 objects are sealed under it and only
    /// sealed ones are served back (decision 0106), as the block API's are.
    seal: Option<(SealKey, u64)>,
    max_connections: usize,
    /// Connections not yet proven (no request yet) at most, per listener (loopback clients
    /// are one source, so one number caps both).
    max_unproven: usize,
    /// Who is told of objects stored and evicted (the agent, which reports them to routers).
    follower: Follower,
}

/// A failure the client is told about: status and message.
type Answer = Response<Full<Bytes>>;

impl HyperPod {
    /// Sets up the segment (creating or taking it over with a new generation) and starts
    /// the lease timer and, with `l2`, its writer (call inside a tokio runtime). `token`:
    /// what requests must present (`Authorization: Bearer`), None for none. `seal`: the
    /// cluster key and writer id L2 objects are sealed with (`Agent::l2_seal`).
    /// `write_through`: copy each stored object to `l2` at once, not at its eviction.
    pub fn start(
        config: &HyperPodConfig,
        eviction: Eviction,
        token: Option<String>,
        l2: Option<Arc<AnyL2>>,
        seal: Option<(SealKey, u64)>,
        write_through: bool,
    ) -> Result<Arc<HyperPod>, SegmentError> {
        describe_metrics();
        let segment = Segment::create(&config.shm_name, config.shm_bytes, config.shm_mode)?;
        let (data_offset, data_bytes) = segment.data_area();
        let layout = Layout {
            data_offset,
            data_bytes,
            unit: segment::UNIT_BYTES,
        };
        let limits = Limits {
            max_ttl_us: config.max_lease.as_micros() as u64,
            max_leases: config.max_leases,
            max_leases_per_client: config.max_leases_per_client,
            max_pending_puts: config.max_pending_puts,
        };
        let ids = LeaseIds::new(segment.generation(), random_key());
        let l2_writes = l2.as_ref().map(|l2| {
            let (tx, rx) = mpsc::channel(L2_QUEUE);
            tokio::spawn(write_l2(l2.clone(), rx, seal.clone()));
            tx
        });
        let hp = Arc::new(HyperPod {
            store: Mutex::new(Store::new(layout, eviction, limits)),
            segment,
            ids,
            epoch: Instant::now(),
            token,
            l2,
            l2_writes,
            write_through,
            in_l2: Mutex::new(HashSet::new()),
            seal,
            max_connections: config.max_connections,
            max_unproven: config.max_unproven,
            follower: Follower::default(),
        });
        for result in ["stored", "too_large", "full", "truncated", "bad_header"] {
            counter!(names::AGENT_HYPERPOD_PUTS_TOTAL, "result" => result).increment(0);
        }
        for c in [
            names::AGENT_HYPERPOD_CONFLICTS_TOTAL,
            names::AGENT_HYPERPOD_MISSES_TOTAL,
            names::AGENT_HYPERPOD_LEASE_EXPIRIES_TOTAL,
            names::AGENT_HYPERPOD_EVICTIONS_TOTAL,
        ] {
            counter!(c).increment(0);
        }
        gauge!(names::AGENT_HYPERPOD_CAPACITY_BYTES).set(data_bytes as f64);
        let weak = Arc::downgrade(&hp);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            let mut evictions = 0;
            loop {
                tick.tick().await;
                let Some(hp) = weak.upgrade() else { return };
                let now = hp.now_us();
                let (expired, stats) = {
                    let mut s = hp.lock();
                    (s.expire(now), s.stats())
                };
                counter!(names::AGENT_HYPERPOD_LEASE_EXPIRIES_TOTAL).increment(expired as u64);
                counter!(names::AGENT_HYPERPOD_EVICTIONS_TOTAL)
                    .increment(stats.evictions - evictions);
                evictions = stats.evictions;
                gauge!(names::AGENT_HYPERPOD_OBJECTS).set(stats.objects as f64);
                gauge!(names::AGENT_HYPERPOD_OCCUPANCY_BYTES).set(stats.used_bytes as f64);
                gauge!(names::AGENT_HYPERPOD_LEASES).set(stats.leases as f64);
            }
        });
        Ok(hp)
    }

    /// The segment's generation (a new one each start).
    pub fn generation(&self) -> u64 {
        self.segment.generation()
    }

    /// What the store holds now.
    pub fn stats(&self) -> store::StoreStats {
        self.lock_current().stats()
    }

    /// Tells `sink` of every object stored and evicted from now on (the agent's residency;
    /// set once, later calls are ignored).
    pub fn follow(&self, sink: ObjectSink) {
        let _ = self.follower.0.set(sink);
    }

    fn tell(&self, name: &ObjectName, event: ObjectEvent) {
        if let Some(sink) = self.follower.0.get() {
            sink(name, event);
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The store with the leases due by now ended: a lease ends on time even when the
    /// timer runs late (a loaded machine), so what it held is evictable when it should be.
    fn lock_current(&self) -> MutexGuard<'_, Store> {
        let mut s = self.lock();
        let expired = s.expire(self.now_us());
        if expired > 0 {
            counter!(names::AGENT_HYPERPOD_LEASE_EXPIRIES_TOTAL).increment(expired as u64);
        }
        s
    }

    /// Serves the API on `listener` until `shutdown` resolves.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let permits = Arc::new(Semaphore::new(self.max_connections));
        let unproven = Arc::new(Unproven::new(
            "hyperpod",
            self.max_unproven,
            self.max_unproven,
        ));
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .keep_alive(true);
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                a = accept_placed(&listener, &permits, "hyperpod") => a,
                _ = &mut shutdown => return,
            };
            let Some((tcp, peer, permit)) = accepted else {
                continue;
            };
            let hp = self.clone();
            let client = peer.ip();
            // Unproven until its first request arrives: displaced by newer silent ones
            // when the cap is reached, closed at FIRST_REQUEST_TIMEOUT.
            let (n, mut displaced) = unproven.admit(Some(client));
            let proven = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (u, p) = (unproven.clone(), proven.clone());
            let service = hyper::service::service_fn(move |req| {
                if !p.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    u.done(n);
                }
                let hp = hp.clone();
                async move { Ok::<_, Infallible>(hp.handle(req, client).await) }
            });
            let conn = http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
            let unproven = unproven.clone();
            tokio::spawn(async move {
                tokio::pin!(conn);
                let first = tokio::time::sleep(FIRST_REQUEST_TIMEOUT);
                tokio::pin!(first);
                let mut watching = true;
                loop {
                    tokio::select! {
                        _ = &mut conn => break,
                        d = &mut displaced, if watching => match d {
                            Ok(()) => break, // displaced: the connection is dropped
                            Err(_) => watching = false, // proven: never displaced
                        },
                        _ = &mut first, if watching => {
                            if !proven.load(std::sync::atomic::Ordering::Relaxed) {
                                counter!(names::AGENT_HYPERPOD_REQUEST_ERRORS_TOTAL, "op" => "connect", "status" => "timeout")
                                    .increment(1);
                                break;
                            }
                            watching = false;
                        }
                    }
                }
                unproven.done(n);
                drop(permit);
            });
        }
    }

    /// Answers one request from `client`.
    pub async fn handle(self: &Arc<Self>, req: Request<Incoming>, client: IpAddr) -> Answer {
        let started = Instant::now();
        if let Some(want) = &self.token {
            let got = req
                .headers()
                .get(hyper::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            // Compared as blake3 hashes (constant time), as the block API compares tokens.
            if blake3::hash(want.as_bytes()) != blake3::hash(got.as_bytes()) {
                return self.fail(
                    "auth",
                    StatusCode::UNAUTHORIZED,
                    "this API needs the agent's token as Authorization: Bearer TOKEN".into(),
                );
            }
        }
        let op = request::parse(req.method().as_str(), req.uri().path(), req.uri().query());
        let (label, answer) = match op {
            Err(e) => {
                let status = match e {
                    BadRequest::NoRoute(_) => StatusCode::NOT_FOUND,
                    BadRequest::Method { .. } => StatusCode::METHOD_NOT_ALLOWED,
                    _ => StatusCode::BAD_REQUEST,
                };
                (
                    "bad_request",
                    self.fail("bad_request", status, e.to_string()),
                )
            }
            Ok(Op::Put(name)) => ("put", self.put(name, req).await),
            Ok(Op::Lease { name, ttl_s }) => ("lease", self.lease(name, ttl_s, client).await),
            Ok(Op::Release(id)) => ("release", self.release(&id)),
            Ok(Op::Health) => ("health", self.health()),
        };
        histogram!(names::AGENT_HYPERPOD_OP_DURATION_SECONDS, "op" => label)
            .record(started.elapsed().as_secs_f64());
        answer
    }

    fn fail(&self, op: &'static str, status: StatusCode, message: String) -> Answer {
        counter!(names::AGENT_HYPERPOD_REQUEST_ERRORS_TOTAL, "op" => op, "status" => status.as_str().to_string())
            .increment(1);
        tracing::debug!(op, status = status.as_u16(), %message, "hyperpod request refused");
        json(status, &serde_json::json!({ "error": message }))
    }

    async fn put(self: &Arc<Self>, name: ObjectName, req: Request<Incoming>) -> Answer {
        let put_result =
            |r: &'static str| counter!(names::AGENT_HYPERPOD_PUTS_TOTAL, "result" => r);
        let headers = req.headers();
        let chunked = headers.get(hyper::header::TRANSFER_ENCODING).is_some();
        let len = headers
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let Some(len) = len.filter(|_| !chunked) else {
            put_result("bad_request").increment(1);
            return self.fail(
                "put",
                StatusCode::LENGTH_REQUIRED,
                "a put needs Content-Length (the object is placed before its body is read)".into(),
            );
        };
        if len < METADATA_BYTES {
            put_result("bad_header").increment(1);
            return self.fail(
                "put",
                StatusCode::BAD_REQUEST,
                format!("body of {len} bytes is shorter than the {METADATA_BYTES}-byte RemoteMetadata header"),
            );
        }
        let placed = self.place(name.clone(), len);
        let p = match placed {
            Ok(p) => p,
            Err(e) => {
                let (status, result) = match &e {
                    PutError::Exists(_) => {
                        counter!(names::AGENT_HYPERPOD_CONFLICTS_TOTAL).increment(1);
                        // Read the body to its end, so that the client hears the 409 on a
                        // connection it can use again rather than a reset mid-send; a body
                        // larger than any object is not read (the connection closes).
                        if len <= self.lock().capacity_bytes() {
                            drain(req.into_body(), len).await;
                        }
                        return json(
                            StatusCode::CONFLICT,
                            &serde_json::json!({ "error": e.to_string() }),
                        );
                    }
                    PutError::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
                    PutError::Full => (StatusCode::INSUFFICIENT_STORAGE, "full"),
                    PutError::Busy(_) => (StatusCode::SERVICE_UNAVAILABLE, "busy"),
                };
                put_result(result).increment(1);
                return self.fail("put", status, e.to_string());
            }
        };
        // From here the place is this put's: the guard gives it back unless committed,
        // also when hyper drops this future (the connection went away).
        let guard = Pending {
            store: &self.store,
            seq: Some(p.seq),
        };
        let (offset, placed_len) = (p.offset, p.len);
        match self.write_body(req.into_body(), p).await {
            Ok(()) => {
                self.copy_through(&name, offset, placed_len);
                guard.commit();
                self.tell(&name, ObjectEvent::Stored);
                put_result("stored").increment(1);
                counter!(names::AGENT_HYPERPOD_BYTES_TOTAL, "direction" => "in").increment(len);
                json(StatusCode::OK, &serde_json::json!({ "stored": len }))
            }
            Err((status, result, message)) => {
                drop(guard);
                put_result(result).increment(1);
                self.fail(
                    "put",
                    status,
                    format!("{name}: {message}; nothing was stored"),
                )
            }
        }
    }

    /// Reserves a place; objects evicted for it are copied for L2 first.
    fn place(&self, name: ObjectName, len: u64) -> Result<Placement, PutError> {
        let mut spilled = Vec::new();
        let placed = {
            let mut s = self.lock_current();
            let mut spill = |n: &ObjectName, offset: u64, len: u64| {
                let in_l2 = self.write_through && self.in_l2().remove(n);
                let obj = match (&self.l2_writes, in_l2) {
                    (Some(_), false) => self.read_for_l2(n, offset, len),
                    _ => None,
                };
                spilled.push((n.clone(), obj, in_l2));
            };
            s.begin_put(name, len, &mut spill)
        };
        for (n, obj, in_l2) in spilled {
            let kept = in_l2 || obj.is_some_and(|obj| self.queue_l2(obj));
            let event = match kept {
                true => ObjectEvent::Spilled,
                false => ObjectEvent::Evicted,
            };
            self.tell(&n, event);
        }
        placed
    }

    /// With write-through, queues the copy of `name` (`len` bytes at `offset`) to L2: called
    /// once its bytes are written and before its put commits, while its place is still the
    /// put's (no other put can evict it and write there meanwhile). A full queue drops the
    /// copy, counted; the segment's eviction then copies it as without write-through.
    fn copy_through(&self, name: &ObjectName, offset: u64, len: u64) {
        if !self.write_through || self.l2_writes.is_none() {
            return;
        }
        if self
            .read_for_l2(name, offset, len)
            .is_some_and(|obj| self.queue_l2(obj))
        {
            self.in_l2().insert(name.clone());
        }
    }

    /// Hands `obj` to the L2 writer; false (counted) when its queue is full or there is no L2.
    fn queue_l2(&self, obj: (BlockId, Block)) -> bool {
        let Some(tx) = &self.l2_writes else {
            return false;
        };
        let sent = tx.try_send(obj).is_ok();
        if !sent {
            counter!(names::AGENT_L2_WRITE_DROPPED_TOTAL).increment(1);
        }
        sent
    }

    fn in_l2(&self) -> MutexGuard<'_, HashSet<ObjectName>> {
        self.in_l2.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An evicted object as its L2 block: its name, then its bytes.
    fn read_for_l2(&self, name: &ObjectName, offset: u64, len: u64) -> Option<(BlockId, Block)> {
        let prefix = name_prefix(name);
        let mut buf = vec![0u8; prefix.len() + len as usize];
        buf[..prefix.len()].copy_from_slice(&prefix);
        if let Err(error) = self.segment.read_at(&mut buf[prefix.len()..], offset) {
            tracing::warn!(%error, %name, "cannot read an evicted object for l2");
            return None;
        }
        Some((l2_id(name), Block::new(Bytes::from(buf))))
    }

    /// Writes a body into its place; the RemoteMetadata header must announce what follows.
    async fn write_body(
        &self,
        mut body: Incoming,
        p: Placement,
    ) -> Result<(), (StatusCode, &'static str, String)> {
        let mut written = 0u64;
        let mut header = [0u8; METADATA_BYTES as usize];
        loop {
            let frame = match tokio::time::timeout(BODY_IDLE_TIMEOUT, body.frame()).await {
                Err(_) => {
                    return Err((
                        StatusCode::REQUEST_TIMEOUT,
                        "truncated",
                        format!("body stalled after {written} of {} bytes", p.len),
                    ))
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err((
                        StatusCode::BAD_REQUEST,
                        "truncated",
                        format!("body ended after {written} of {} bytes ({e})", p.len),
                    ))
                }
                Ok(Some(Ok(f))) => f,
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers: nothing to store
            };
            if written + data.len() as u64 > p.len {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("body is longer than its Content-Length {}", p.len),
                ));
            }
            if written < METADATA_BYTES {
                let n = (METADATA_BYTES - written).min(data.len() as u64) as usize;
                header[written as usize..written as usize + n].copy_from_slice(&data[..n]);
            }
            if let Err(e) = self.segment.write_at(&data, p.offset + written) {
                return Err((
                    StatusCode::INSUFFICIENT_STORAGE,
                    "error",
                    format!("cannot write the segment: {e}"),
                ));
            }
            written += data.len() as u64;
        }
        if written < p.len {
            return Err((
                StatusCode::BAD_REQUEST,
                "truncated",
                format!("body ended after {written} of {} bytes", p.len),
            ));
        }
        let announced = i32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
        if i64::from(announced) != (p.len - METADATA_BYTES) as i64 {
            return Err((
                StatusCode::BAD_REQUEST,
                "bad_header",
                format!(
                    "its RemoteMetadata header says {announced} payload bytes, the body has {}",
                    p.len - METADATA_BYTES
                ),
            ));
        }
        Ok(())
    }

    async fn lease(
        self: &Arc<Self>,
        name: ObjectName,
        ttl_s: Option<f64>,
        client: IpAddr,
    ) -> Answer {
        let ttl_us = (ttl_s.unwrap_or(DEFAULT_TTL_S) * 1e6).min(u64::MAX as f64) as u64;
        match self.grant(&name, client, ttl_us).await {
            Ok(g) => {
                counter!(names::AGENT_HYPERPOD_LEASES_TOTAL, "result" => "granted").increment(1);
                counter!(names::AGENT_HYPERPOD_BYTES_TOTAL, "direction" => "out").increment(g.len);
                json(
                    StatusCode::OK,
                    &serde_json::json!({
                        "id": self.ids.encode(g.lease),
                        "offsets": [{ "offset": g.offset, "len": g.len }],
                        "ttl_s": g.ttl_us as f64 / 1e6,
                    }),
                )
            }
            Err(e @ LeaseError::Miss(_)) => {
                counter!(names::AGENT_HYPERPOD_MISSES_TOTAL).increment(1);
                json(
                    StatusCode::NOT_FOUND,
                    &serde_json::json!({ "error": e.to_string() }),
                )
            }
            Err(e) => {
                counter!(names::AGENT_HYPERPOD_LEASES_TOTAL, "result" => "refused").increment(1);
                self.fail("lease", StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
        }
    }

    /// A lease on `name` for `client`, loading it from L2 first on a miss in the segment.
    async fn grant(
        &self,
        name: &ObjectName,
        client: IpAddr,
        ttl_us: u64,
    ) -> Result<store::Grant, LeaseError> {
        let granted = self
            .lock_current()
            .lease(name, client, ttl_us, self.now_us());
        if matches!(granted, Err(LeaseError::Miss(_))) && self.load_from_l2(name).await {
            return self
                .lock_current()
                .lease(name, client, ttl_us, self.now_us());
        }
        granted
    }

    /// Loads `name` from L2 into the segment; true when it is there now.
    async fn load_from_l2(&self, name: &ObjectName) -> bool {
        let Some(l2) = &self.l2 else { return false };
        let id = l2_id(name);
        let raw = match l2.get(id).await {
            Ok(Some(raw)) => raw,
            Ok(None) => return false,
            Err(error) => {
                counter!(names::AGENT_L2_ERRORS_TOTAL, "op" => "get").increment(1);
                tracing::debug!(%error, "hyperpod l2 read failed");
                return false;
            }
        };
        let Ok((block, _writer)) = decode_with(&id, raw, self.seal.as_ref().map(|(k, _)| k)) else {
            // Damaged, another agent's, or not sealed under this cluster's key: a miss.
            counter!(names::AGENT_L2_DAMAGED_TOTAL, "kind" => "hyperpod").increment(1);
            let _ = l2.remove(id).await;
            return false;
        };
        let prefix = name_prefix(name);
        if !block.payload.starts_with(&prefix) {
            return false; // another object under a colliding id: a miss
        }
        let body = &block.payload[prefix.len()..];
        let p = match self.place(name.clone(), body.len() as u64) {
            Ok(p) => p,
            Err(PutError::Exists(_)) => return true, // loaded meanwhile by another lease
            Err(_) => return false,
        };
        let guard = Pending {
            store: &self.store,
            seq: Some(p.seq),
        };
        if self.segment.write_at(body, p.offset).is_err() {
            return false;
        }
        if self.write_through {
            // Its L2 copy is where it was just read from.
            self.in_l2().insert(name.clone());
        }
        guard.commit();
        self.tell(name, ObjectEvent::Stored);
        counter!(names::AGENT_HYPERPOD_BYTES_TOTAL, "direction" => "l2_in")
            .increment(body.len() as u64);
        true
    }

    fn release(&self, id: &str) -> Answer {
        let released =
            |r: &'static str| counter!(names::AGENT_HYPERPOD_LEASES_TOTAL, "result" => r);
        let lease = match self.ids.decode(id) {
            Ok(l) => l,
            Err(e) => {
                let status = match e {
                    BadLeaseId::Malformed(_) => StatusCode::BAD_REQUEST,
                    BadLeaseId::Forged => StatusCode::FORBIDDEN,
                    BadLeaseId::OtherGeneration { .. } => StatusCode::GONE,
                };
                released("unknown").increment(1);
                return self.fail("release", status, e.to_string());
            }
        };
        match self.lock().release(lease, self.now_us()) {
            Ok(()) => {
                released("released").increment(1);
                json(StatusCode::OK, &serde_json::json!({ "released": true }))
            }
            Err(e) => {
                let status = match e {
                    ReleaseError::Unknown(_) => StatusCode::NOT_FOUND,
                    ReleaseError::Expired(_) => StatusCode::GONE,
                };
                released("unknown").increment(1);
                self.fail("release", status, e.to_string())
            }
        }
    }

    fn health(&self) -> Answer {
        let s = self.stats();
        json(
            StatusCode::OK,
            &serde_json::json!({
                "segment": self.segment.name(),
                "bytes": self.segment.size(),
                "generation": self.segment.generation(),
                "objects": s.objects,
                "used_bytes": s.used_bytes,
                "leases": s.leases,
            }),
        )
    }
}

/// The next connection of `listener` with its place among `places`, for the listener
/// named `api`: None when accepting failed (counted, after a pause: fds may be exhausted)
/// or no place is free (counted; the connection is dropped).
async fn accept_placed(
    listener: &tokio::net::TcpListener,
    places: &Arc<Semaphore>,
    api: &'static str,
) -> Option<(
    tokio::net::TcpStream,
    std::net::SocketAddr,
    tokio::sync::OwnedSemaphorePermit,
)> {
    let (tcp, peer) = match listener.accept().await {
        Ok(c) => c,
        Err(error) => {
            counter!(names::AGENT_ACCEPT_ERRORS_TOTAL).increment(1);
            tracing::debug!(%error, api, "accept failed");
            tokio::time::sleep(Duration::from_millis(50)).await;
            return None;
        }
    };
    let Ok(place) = places.clone().try_acquire_owned() else {
        counter!(names::AGENT_CONNECTIONS_REFUSED_TOTAL).increment(1);
        return None;
    };
    let _ = tcp.set_nodelay(true);
    Some((tcp, peer, place))
}

/// A reserved place not yet committed: dropped, the put is aborted.
struct Pending<'a> {
    store: &'a Mutex<Store>,
    seq: Option<u64>,
}

impl Pending<'_> {
    fn commit(mut self) {
        if let Some(seq) = self.seq.take() {
            self.store
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .commit_put(seq);
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(seq) = self.seq.take() {
            self.store
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .abort_put(seq);
        }
    }
}

/// Reads and drops up to `len` bytes of a body, within the idle timeout per piece.
async fn drain(mut body: Incoming, len: u64) {
    let mut seen = 0u64;
    while seen < len {
        match tokio::time::timeout(BODY_IDLE_TIMEOUT, body.frame()).await {
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    seen += d.len() as u64;
                }
            }
            _ => return,
        }
    }
}

fn json(status: StatusCode, value: &serde_json::Value) -> Answer {
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(value.to_string())))
        .expect("a valid response")
}

/// The L2 id of a HyperPod object: a layout of its own, and a hash of its name.
fn l2_id(name: &ObjectName) -> BlockId {
    let layout = blake3::derive_key(L2_CONTEXT, b"layout");
    let mut h = blake3::Hasher::new_derive_key(L2_CONTEXT);
    h.update(name.bucket.as_bytes());
    h.update(&[0]);
    h.update(name.key.as_bytes());
    let key = h.finalize();
    BlockId::new(
        u64::from_le_bytes(layout[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(key.as_bytes()[..8].try_into().expect("8 bytes")),
    )
}

/// What an L2 object's payload starts with: the name's length (u32 LE), then the name.
fn name_prefix(name: &ObjectName) -> Vec<u8> {
    let text = format!("{}\0{}", name.bucket, name.key);
    let mut out = Vec::with_capacity(4 + text.len());
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

/// A key for the lease-id tags, from the kernel's random source.
fn random_key() -> [u8; 32] {
    use std::io::Read;
    let mut key = [0u8; 32];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        if f.read_exact(&mut key).is_ok() {
            return key;
        }
    }
    // No /dev/urandom: the time and the process id, hashed (guessable, and logged so).
    tracing::warn!("no /dev/urandom: hyperpod lease ids are guessable");
    let seed = format!("{:?} {}", std::time::SystemTime::now(), std::process::id());
    *blake3::hash(seed.as_bytes()).as_bytes()
}

/// Writes evicted objects to L2, one at a time; failures are counted, never retried.
async fn write_l2(
    l2: Arc<AnyL2>,
    mut rx: mpsc::Receiver<(BlockId, Block)>,
    seal: Option<(SealKey, u64)>,
) {
    while let Some((id, block)) = rx.recv().await {
        let len = block.payload.len() as u64;
        match l2.put_block_sealed(id, &block, seal.as_ref()).await {
            Ok(_) => {
                counter!(names::AGENT_HYPERPOD_BYTES_TOTAL, "direction" => "l2_out").increment(len)
            }
            Err(error) => {
                counter!(names::AGENT_L2_ERRORS_TOTAL, "op" => "put").increment(1);
                tracing::debug!(%error, "hyperpod l2 write failed");
            }
        }
    }
}

fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        names::AGENT_HYPERPOD_PUTS_TOTAL,
        "HyperPod API puts, by result (stored, or why not)."
    );
    describe_counter!(
        names::AGENT_HYPERPOD_CONFLICTS_TOTAL,
        "HyperPod API puts of a key already stored (409)."
    );
    describe_counter!(
        names::AGENT_HYPERPOD_LEASES_TOTAL,
        "HyperPod API leases granted, refused (bounds), released and unknown at release."
    );
    describe_counter!(
        names::AGENT_HYPERPOD_MISSES_TOTAL,
        "HyperPod API lease requests for objects in neither the segment nor L2."
    );
    describe_counter!(
        names::AGENT_HYPERPOD_LEASE_EXPIRIES_TOTAL,
        "HyperPod API leases that ended at their ttl, never released."
    );
    describe_counter!(
        names::AGENT_HYPERPOD_BYTES_TOTAL,
        Unit::Bytes,
        "HyperPod object bytes: put (in), leased (out), evicted to L2 (l2_out), loaded back (l2_in)."
    );
    describe_counter!(
        names::AGENT_HYPERPOD_EVICTIONS_TOTAL,
        "HyperPod objects evicted from the shared-memory segment."
    );
    describe_counter!(
        names::AGENT_HYPERPOD_REQUEST_ERRORS_TOTAL,
        "HyperPod API requests answered with an error, by operation and status."
    );
    describe_gauge!(
        names::AGENT_HYPERPOD_OBJECTS,
        "Objects in the HyperPod segment."
    );
    describe_gauge!(
        names::AGENT_HYPERPOD_OCCUPANCY_BYTES,
        Unit::Bytes,
        "Bytes of the HyperPod segment's data area taken."
    );
    describe_gauge!(
        names::AGENT_HYPERPOD_CAPACITY_BYTES,
        Unit::Bytes,
        "Bytes of the HyperPod segment's data area."
    );
    describe_gauge!(names::AGENT_HYPERPOD_LEASES, "Open HyperPod leases.");
    describe_counter!(
        names::AGENT_LM_REQUESTS_TOTAL,
        "lm:// requests by command and result (stored, conflict, full, busy, hit, miss, refused, ok; closed: the connection was closed for it)."
    );
    describe_histogram!(
        names::AGENT_HYPERPOD_OP_DURATION_SECONDS,
        Unit::Seconds,
        "HyperPod API request handling time, body included, by operation."
    );
}
