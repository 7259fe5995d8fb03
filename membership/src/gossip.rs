//! The chitchat adapter: router membership, cluster-wide load and shared routing
//! decisions over gossip, with the key schema of [`crate::schema`].
//!
//! Each router writes only its own keys: its role, version and HTTP URL, its own
//! per-instance load, its index digest (`applied`), and its routing decisions in batches
//! under `d:<seq>` keys that chitchat deletes after the decision TTL. Scuttlebutt
//! reconciliation does the rest: a router started late, or cut off by a partition, receives
//! every batch still alive when it next gossips with anyone who has it. A router names
//! its own incarnation by chitchat's generation id (its start time in ms), so a router
//! restarted under the same node id is a new origin whose seqs start again at 1, and its old
//! incarnation's state is never confused with the new one.
//!
//! **Transport.** Chitchat's wire serialization is crate-private, so this module wraps
//! chitchat's own public UDP socket rather than reimplementing it: chitchat serializes
//! every message into a private socket on 127.0.0.1, which sends it to a per-peer *shadow*
//! socket (also on loopback, connected to it); the adapter takes the bytes from there,
//! counts them, appends a MAC when a cluster secret is set, and sends them from the real
//! gossip socket. Inbound, a datagram from peer P is checked (MAC, partition switch) and
//! handed to chitchat through P's shadow, and the reply address is mapped back to P. The
//! cost is two loopback hops per datagram, a few microseconds, at about 20 datagrams per
//! second per peer. The real gossip socket is a [`Datagrams`]: the deterministic
//! simulation test replaces it with a simulated network (the loopback relay stays real).
//!
//! **Authentication.** With `secret` set, every datagram carries a 32-byte keyed blake3
//! MAC (key `blake3::derive_key("warmpath 2026-11 gossip mac v1", secret)`) over all its
//! other bytes; datagrams whose MAC does not verify are dropped and counted. A chitchat
//! message too large to carry the MAC in one datagram (chitchat fills datagrams up to
//! 65,507 bytes) is sent as authenticated fragments and reassembled. This is
//! authentication, not confidentiality: gossip travels in clear. Replayed datagrams are
//! harmless, as scuttlebutt ignores versions it already has.
//!
//! **Partitions.** [`Gossip::block_peers`] drops every datagram to and from the given
//! gossip addresses, for fault-injection tests and the fault harness.
//!
//! Metrics (described once in [`describe_metrics`]): `warmpath_gossip_peers`,
//! `warmpath_gossip_sent_bytes_total`, `warmpath_gossip_received_bytes_total`,
//! `warmpath_gossip_decode_errors_total`,
//! `warmpath_gossip_unauthenticated_datagrams_dropped_total`,
//! `warmpath_gossip_batches_published_total`, `warmpath_gossip_batches_received_total`,
//! `warmpath_gossip_decisions_truncated_total`, `warmpath_gossip_decisions_dropped_total`,
//! `warmpath_gossip_lagging_origins_total`.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket, Transport};
use chitchat::{
    spawn_chitchat, Chitchat, ChitchatConfig, ChitchatEnvelope, ChitchatHandle, ChitchatId,
    FailureDetectorConfig, ProtocolVersion,
};
use tracing::{debug, warn};
use warmpath_index::load::InstanceLoad;
use warmpath_index::router::PublishBudget;

use crate::decisions::{AppliedWire, BatchWire, Decision, LoadWire};
use crate::schema::{self, NodeView, OwnState};

/// Context string of the gossip MAC key derivation.
pub const MAC_KEY_CONTEXT: &str = "warmpath 2026-11 gossip mac v1";
/// Bytes of the MAC appended to every datagram when a secret is set.
pub const MAC_LEN: usize = 32;
/// Largest UDP payload over IPv4, which chitchat also uses as its datagram limit.
const MAX_DATAGRAM: usize = 65_507;
/// Magic of an authenticated fragment (chitchat's own messages start with 0x53 0xb0).
const FRAGMENT_MAGIC: [u8; 4] = *b"WPF1";
/// Fragment header: magic, message id (u32 LE), index, count.
const FRAGMENT_HEADER: usize = 4 + 4 + 1 + 1;
/// Most fragments one message may have (two always suffice).
const MAX_FRAGMENTS: u8 = 4;
/// First two bytes of every chitchat datagram (its magic number, LE).
const CHITCHAT_MAGIC: [u8; 2] = 45_139u16.to_le_bytes();
/// Most peers with a shadow socket (one open file each) at once; the least recently used
/// is closed first. A cluster's routers are far fewer; the bound keeps spoofed sources
/// (possible only without a cluster secret: with one, unauthenticated datagrams are dropped
/// before any shadow exists) from taking the process's file descriptors.
pub const MAX_SHADOWS: usize = 256;
/// Most fragmented messages being reassembled at once.
const MAX_REASSEMBLIES: usize = 64;
/// How long the adapter waits for chitchat's serialized datagram on loopback.
const LOOPBACK_TIMEOUT: Duration = Duration::from_secs(1);
/// Least time between two publications of this router's `applied` digest: it changes on
/// nearly every poll under load, and each change is re-gossiped to every peer.
pub const APPLIED_PUBLISH_INTERVAL: Duration = Duration::from_secs(1);
/// How long a dead router's state is kept before chitchat forgets it.
const DEAD_NODE_GRACE_PERIOD: Duration = Duration::from_secs(3600);

/// Configuration of a router's gossip.
#[derive(Clone)]
pub struct GossipConfig {
    /// This router's id, unique in the cluster (e.g. `router-1`).
    pub node_id: String,
    /// Routers only gossip with routers of the same cluster id.
    pub cluster_id: String,
    /// UDP gossip address to bind (port 0: any free port, see [`Gossip::gossip_addr`]).
    pub listen: SocketAddr,
    /// Address peers should gossip to, usually `listen` (port 0: the bound port).
    pub advertise: SocketAddr,
    /// `host:port` of other routers' gossip addresses (DNS names are re-resolved).
    pub seeds: Vec<String>,
    /// Time between gossip rounds. 50 ms is the default ([`DEFAULT_GOSSIP_INTERVAL`]): a
    /// round reaches 3 peers, so a decision reaches 8 routers in 2 to 3 rounds, well
    /// within the 500 ms convergence target, for a few KB/s of digests per router.
    pub gossip_interval: Duration,
    /// This router's HTTP base URL, published under `http`.
    pub http_url: String,
    /// Decision batch keys are deleted this long after they are published.
    pub decision_ttl: Duration,
    /// Cluster secret: when set, every datagram is authenticated with it.
    pub secret: Option<Vec<u8>>,
    /// The whole cluster's budget for published decisions, block keys per second, of which
    /// this router takes its share (`budget / routers`, [`PublishBudget`]; 0: no budget).
    /// Production: [`schema::DECISION_BUDGET_KEYS_PER_S`].
    pub decision_keys_per_s: u64,
    /// Where datagrams go; `None` binds a UDP socket on `listen`. The deterministic
    /// simulation passes its simulated network here (and `listen` is then only a name).
    pub datagrams: Option<Arc<dyn Datagrams>>,
}

/// What [`Datagrams::send_to`] returns: the bytes sent.
pub type SendDatagram<'a> = Pin<Box<dyn Future<Output = std::io::Result<usize>> + Send + 'a>>;
/// What [`Datagrams::recv_from`] returns: the datagram's length and sender.
pub type RecvDatagram<'a> =
    Pin<Box<dyn Future<Output = std::io::Result<(usize, SocketAddr)>> + Send + 'a>>;

/// Sends and receives gossip datagrams for one router: a UDP socket, or a simulated
/// network. Receiving must be cancel-safe (it runs in a `select!`).
pub trait Datagrams: Send + Sync + 'static {
    /// Sends one datagram to `to`.
    fn send_to<'a>(&'a self, buf: &'a [u8], to: SocketAddr) -> SendDatagram<'a>;
    /// Receives one datagram into `buf`: its length and sender.
    fn recv_from<'a>(&'a self, buf: &'a mut [u8]) -> RecvDatagram<'a>;
}

impl Datagrams for tokio::net::UdpSocket {
    fn send_to<'a>(&'a self, buf: &'a [u8], to: SocketAddr) -> SendDatagram<'a> {
        Box::pin(tokio::net::UdpSocket::send_to(self, buf, to))
    }
    fn recv_from<'a>(&'a self, buf: &'a mut [u8]) -> RecvDatagram<'a> {
        Box::pin(tokio::net::UdpSocket::recv_from(self, buf))
    }
}

impl std::fmt::Debug for GossipConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GossipConfig")
            .field("node_id", &self.node_id)
            .field("cluster_id", &self.cluster_id)
            .field("listen", &self.listen)
            .field("advertise", &self.advertise)
            .field("seeds", &self.seeds)
            .field("gossip_interval", &self.gossip_interval)
            .field("http_url", &self.http_url)
            .field("decision_ttl", &self.decision_ttl)
            .field("decision_keys_per_s", &self.decision_keys_per_s)
            // The secret is never logged.
            .field("secret", &self.secret.as_ref().map(|_| ".."))
            .field("simulated", &self.datagrams.is_some())
            .finish()
    }
}

/// The default gossip interval (see [`GossipConfig::gossip_interval`]).
pub const DEFAULT_GOSSIP_INTERVAL: Duration = Duration::from_millis(50);

/// Why gossip could not start.
#[derive(Debug, thiserror::Error)]
pub enum GossipError {
    /// The configuration is unusable.
    #[error("invalid gossip configuration: {0}")]
    Config(String),
    /// The UDP gossip address could not be bound.
    #[error("cannot bind the gossip address {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// Chitchat failed to start.
    #[error("chitchat failed to start: {0}")]
    Chitchat(String),
}

/// A live router peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its node id.
    pub node_id: String,
    /// Its HTTP base URL, once its state has reached us.
    pub http_url: Option<String>,
    /// Its gossip address.
    pub gossip_addr: SocketAddr,
}

/// Counters of this router's gossip since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GossipStats {
    /// Bytes sent on the gossip socket (MACs included).
    pub bytes_sent: u64,
    /// Bytes received on the gossip socket (before any check).
    pub bytes_received: u64,
    /// Datagrams sent.
    pub datagrams_sent: u64,
    /// Datagrams received.
    pub datagrams_received: u64,
    /// Datagrams dropped because their MAC did not verify.
    pub datagrams_dropped_unauthenticated: u64,
    /// Gossip values or datagrams from peers that failed to decode.
    pub decode_errors: u64,
    /// Decisions not published: this router's share of the cluster's budget was spent.
    pub decisions_shed: u64,
    /// Peers' load values decoded (each new version once).
    pub loads_decoded: u64,
}

/// Where a router is in applying the others' decision batches: per origin (a router
/// incarnation, `node_id#generation`), the highest seq applied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    applied: HashMap<String, u64>,
    /// Per live peer incarnation, its latest `load` value's version and the loads decoded
    /// from it: a load republished unchanged, or not republished since the last poll, is
    /// not decoded again (routers poll every 25 ms and publish loads less often).
    loads: HashMap<String, (u64, Vec<(u64, InstanceLoad)>)>,
}

impl Cursor {
    /// A cursor that has applied nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The highest seq applied from `origin` (0: none).
    pub fn applied(&self, origin: &str) -> u64 {
        self.applied.get(origin).copied().unwrap_or(0)
    }

    /// `(origin, highest seq applied)` for every origin, sorted by origin.
    pub fn entries(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self.applied.iter().map(|(k, s)| (k.clone(), *s)).collect();
        v.sort();
        v
    }
}

/// A live peer's load as [`Gossip::poll`] reads it under the lock: its node id, its
/// origin, and its raw value with the value's version when that changed since the cursor.
type PeerLoad = (String, String, Option<(u64, String)>);

/// Everything new since a [`Cursor`], from [`Gossip::poll`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Update {
    /// Other routers' decision batches not applied before, as `(origin, seq, batch)`, in
    /// seq order per origin.
    pub batches: Vec<(String, u64, BatchWire)>,
    /// The latest published load of every live peer, as `(node id, loads by instance
    /// key)`; instances left out have no load from that peer.
    pub loads: Vec<(String, Vec<(u64, InstanceLoad)>)>,
    /// The live peers (this router excluded).
    pub peers: Vec<Peer>,
    /// Origins whose batches between the cursor and the oldest one still gossiped expired
    /// before this router saw them (it started late, or was cut off for longer than the
    /// decision TTL): `(origin, their latest seq, seq applied before this poll)`. Those
    /// decisions are lost to this router's index; a stale index costs hits, not
    /// correctness.
    pub lagging: Vec<(String, u64, u64)>,
}

/// Counters shared by the adapter and its transport.
#[derive(Debug, Default)]
struct Counters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    datagrams_sent: AtomicU64,
    datagrams_received: AtomicU64,
    unauthenticated: AtomicU64,
    decode_errors: AtomicU64,
    decisions_shed: AtomicU64,
    loads_decoded: AtomicU64,
}

/// State shared by the [`Gossip`] handle and its socket.
#[derive(Debug)]
struct Shared {
    mac_key: Option<[u8; 32]>,
    blocked: Mutex<HashSet<SocketAddr>>,
    counters: Counters,
}

impl Shared {
    fn is_blocked(&self, addr: &SocketAddr) -> bool {
        self.blocked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(addr)
    }

    fn unauthenticated(&self) {
        self.counters
            .unauthenticated
            .fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metric_names::GOSSIP_UNAUTHENTICATED_DATAGRAMS_DROPPED_TOTAL)
            .increment(1);
    }

    fn decode_error(&self) {
        self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metric_names::GOSSIP_DECODE_ERRORS_TOTAL).increment(1);
    }
}

/// Describes the gossip metrics to the installed recorder (idempotent).
pub fn describe_metrics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use metrics::{describe_counter, describe_gauge, Unit};
        describe_gauge!(
            crate::metric_names::GOSSIP_PEERS,
            Unit::Count,
            "live router peers seen over gossip, this router excluded"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_SENT_BYTES_TOTAL,
            Unit::Bytes,
            "bytes sent on the gossip socket, MACs included"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_RECEIVED_BYTES_TOTAL,
            Unit::Bytes,
            "bytes received on the gossip socket"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_DECODE_ERRORS_TOTAL,
            Unit::Count,
            "gossip values or datagrams from peers that failed to decode"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_UNAUTHENTICATED_DATAGRAMS_DROPPED_TOTAL,
            Unit::Count,
            "gossip datagrams dropped because their MAC did not verify"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_BATCHES_PUBLISHED_TOTAL,
            Unit::Count,
            "decision batches this router published (each within the 8 KiB batch budget)"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_DECISIONS_TRUNCATED_TOTAL,
            Unit::Count,
            "decisions cut to their first keys to fit a gossip batch on their own"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_DECISIONS_DROPPED_TOTAL,
            Unit::Count,
            "decisions with no key that fits a gossip batch, not published"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_DECISIONS_SHED_TOTAL,
            Unit::Count,
            "decisions not published because this router's share of the cluster's gossip budget was spent"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_BATCHES_RECEIVED_TOTAL,
            Unit::Count,
            "other routers' decision batches delivered by poll"
        );
        describe_counter!(
            crate::metric_names::GOSSIP_LAGGING_ORIGINS_TOTAL,
            Unit::Count,
            "polls that found decision batches expired before this router saw them"
        );
    });
}

/// A router's membership in the gossip cluster.
pub struct Gossip {
    handle: ChitchatHandle,
    chitchat: Arc<tokio::sync::Mutex<Chitchat>>,
    chitchat_id: ChitchatId,
    node_id: String,
    origin: String,
    bound: SocketAddr,
    /// Seq of the next decision batch; only read and bumped under the chitchat lock, so
    /// that seq order is version order.
    next_seq: AtomicU64,
    /// When `applied` was last published (tokio's clock, as chitchat's own timers, so
    /// that a simulation on a paused clock publishes it at the production cadence).
    applied_published_at: Mutex<Option<tokio::time::Instant>>,
    /// This router's share of the cluster's decision budget, on tokio's clock from
    /// `started` (a simulation on a paused clock spends it at the production rate).
    budget: Mutex<PublishBudget>,
    started: tokio::time::Instant,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Gossip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gossip")
            .field("chitchat_id", &self.chitchat_id)
            .field("bound", &self.bound)
            .field("next_seq", &self.next_seq.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A generation id: the start time in ms, strictly increasing within the process.
fn next_generation() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(last + 1);
        match LAST.compare_exchange(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

impl Gossip {
    /// Binds the gossip socket and joins the cluster through the seeds.
    pub async fn start(config: GossipConfig) -> Result<Gossip, GossipError> {
        describe_metrics();
        if config.node_id.is_empty() {
            return Err(GossipError::Config("node_id is empty".into()));
        }
        if config.gossip_interval.is_zero() {
            return Err(GossipError::Config("gossip_interval is zero".into()));
        }
        if config.decision_ttl.is_zero() {
            return Err(GossipError::Config("decision_ttl is zero".into()));
        }
        if config.advertise.ip().is_unspecified() {
            return Err(GossipError::Config(format!(
                "advertise address {} is unspecified: peers cannot reach it",
                config.advertise
            )));
        }
        let (prebound, bound) = match &config.datagrams {
            Some(d) => (Prebound::Simulated(d.clone()), config.listen),
            None => {
                let socket = std::net::UdpSocket::bind(config.listen)
                    .and_then(|s| s.set_nonblocking(true).map(|()| s))
                    .map_err(|source| GossipError::Bind {
                        addr: config.listen,
                        source,
                    })?;
                let bound = socket.local_addr().map_err(|source| GossipError::Bind {
                    addr: config.listen,
                    source,
                })?;
                (Prebound::Udp(socket), bound)
            }
        };
        let mut advertise = config.advertise;
        if advertise.port() == 0 {
            advertise.set_port(bound.port());
        }
        let generation = next_generation();
        let chitchat_id = ChitchatId::new(config.node_id.clone(), generation, advertise);
        let shared = Arc::new(Shared {
            mac_key: config
                .secret
                .as_ref()
                .map(|s| blake3::derive_key(MAC_KEY_CONTEXT, s)),
            blocked: Mutex::new(HashSet::new()),
            counters: Counters::default(),
        });
        let transport = WarmTransport {
            prebound: Mutex::new(Some(prebound)),
            shared: shared.clone(),
        };
        // Heartbeats are observed about once per gossip interval; a threshold of 1 s worth
        // of intervals (at least chitchat's default 8) keeps a router that is briefly
        // starved of CPU from flapping dead and alive, yet detects a dead one in ~1 s.
        let phi_threshold = (1.0 / config.gossip_interval.as_secs_f64()).max(8.0);
        let chitchat_config = ChitchatConfig {
            chitchat_id: chitchat_id.clone(),
            cluster_id: config.cluster_id.clone(),
            gossip_interval: config.gossip_interval,
            listen_addr: bound,
            seed_nodes: config.seeds.clone(),
            failure_detector_config: FailureDetectorConfig {
                phi_threshold,
                initial_interval: config.gossip_interval * 2,
                dead_node_grace_period: DEAD_NODE_GRACE_PERIOD,
                ..FailureDetectorConfig::default()
            },
            marked_for_deletion_grace_period: config.decision_ttl,
            catchup_callback: None,
            extra_liveness_predicate: None,
            // Every router runs the same chitchat: the compressed digest format is safe.
            protocol_version: ProtocolVersion::V1,
        };
        let handle = spawn_chitchat(
            chitchat_config,
            schema::initial_key_values(&config.http_url),
            &transport,
        )
        .await
        .map_err(|e| GossipError::Chitchat(format!("{e:#}")))?;
        let chitchat = handle.chitchat();
        debug!(node_id = %config.node_id, generation, %bound, %advertise, "gossip started");
        Ok(Gossip {
            handle,
            chitchat,
            origin: schema::origin(&config.node_id, generation),
            node_id: config.node_id,
            chitchat_id,
            bound,
            next_seq: AtomicU64::new(1),
            applied_published_at: Mutex::new(None),
            budget: Mutex::new(PublishBudget::new(config.decision_keys_per_s)),
            started: tokio::time::Instant::now(),
            shared,
        })
    }

    /// This router's node id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// This router incarnation's origin name (`node_id#generation`), as other routers'
    /// [`Update::batches`] and cursors name it.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The address the gossip socket is bound to.
    pub fn gossip_addr(&self) -> SocketAddr {
        self.bound
    }

    /// The address peers gossip to (the advertised one).
    pub fn advertise_addr(&self) -> SocketAddr {
        self.chitchat_id.gossip_advertise_addr
    }

    /// Publishes this router's own load per instance key, replacing the previous value.
    /// Idle instances are left out (absent means zero), and above
    /// [`schema::LOAD_MAX_ENTRIES`] only the busiest are kept. Call it at most once per
    /// gossip interval: every change is a new version to gossip.
    pub async fn publish_load(&self, entries: &[(u64, InstanceLoad)]) {
        let mut busy: Vec<(u64, InstanceLoad)> = entries
            .iter()
            .filter(|(_, l)| l.in_flight > 0 || l.pending_prefill_tokens > 0)
            .copied()
            .collect();
        if busy.len() > schema::LOAD_MAX_ENTRIES {
            busy.sort_by_key(|(k, l)| {
                (
                    std::cmp::Reverse(l.in_flight),
                    std::cmp::Reverse(l.pending_prefill_tokens),
                    *k,
                )
            });
            busy.truncate(schema::LOAD_MAX_ENTRIES);
        }
        busy.sort_by_key(|(k, _)| *k);
        let wire = LoadWire::from_loads(&busy);
        let mut chitchat = self.chitchat.lock().await;
        OwnState(chitchat.self_node_state()).set_load(&wire);
    }

    /// Publishes `decisions` in batches of at most [`schema::BATCH_MAX_BYTES`] encoded
    /// bytes each (split by a [`crate::decisions::Batcher`]; a decision too large for a
    /// batch alone keeps its first keys), each under the next `d:` key, marked for deletion
    /// after the decision TTL, while this router's share of the cluster's decision budget
    /// lasts ([`GossipConfig::decision_keys_per_s`]); the batches past it are shed,
    /// counted. Returns the seq of the last batch written (0 if none).
    pub async fn publish_decisions(&self, made_at_ms: u64, decisions: Vec<Decision>) -> u64 {
        let mut batcher = crate::decisions::Batcher::new(schema::BATCH_MAX_BYTES, 0);
        for d in decisions {
            batcher.push(made_at_ms, d);
        }
        let batches = batcher.take_all();
        metrics::counter!(crate::metric_names::GOSSIP_DECISIONS_TRUNCATED_TOTAL)
            .increment(batcher.truncated());
        metrics::counter!(crate::metric_names::GOSSIP_DECISIONS_DROPPED_TOTAL)
            .increment(batcher.dropped());
        let routers = {
            let chitchat = self.chitchat.lock().await;
            1 + chitchat
                .live_nodes()
                .filter(|id| **id != self.chitchat_id)
                .count()
        };
        let now_ms = self.started.elapsed().as_millis() as u64;
        let batches: Vec<Vec<Decision>> = {
            let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
            let (kept, shed): (Vec<_>, Vec<_>) = batches
                .into_iter()
                .partition(|b| budget.take(now_ms, routers, b.iter().map(|d| d.keys.len()).sum()));
            let shed = shed.iter().map(Vec::len).sum::<usize>() as u64;
            self.shared
                .counters
                .decisions_shed
                .fetch_add(shed, Ordering::Relaxed);
            metrics::counter!(crate::metric_names::GOSSIP_DECISIONS_SHED_TOTAL).increment(shed);
            kept
        };
        let mut last = 0;
        for decisions in batches {
            let batch = BatchWire::V1 {
                made_at_ms,
                decisions,
            };
            debug_assert!(crate::decisions::encode(&batch).len() <= schema::BATCH_MAX_BYTES);
            let mut chitchat = self.chitchat.lock().await;
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let mut own = OwnState(chitchat.self_node_state());
            own.set_decision_batch(seq, &batch);
            drop(chitchat);
            metrics::counter!(crate::metric_names::GOSSIP_BATCHES_PUBLISHED_TOTAL).increment(1);
            last = seq;
        }
        last
    }

    /// Everything new since the cursor: other nodes' decision batches with seq above what
    /// the cursor applied (in seq order per origin; batches that fail to decode are counted
    /// and skipped), the latest load of every live peer, the live peers; also publishes the
    /// cursor's applied map as this node's `applied` key (at most once per
    /// [`APPLIED_PUBLISH_INTERVAL`]). The cursor is advanced past every batch returned.
    pub async fn poll(&self, cursor: &mut Cursor) -> Update {
        let mut raw_batches: Vec<(String, Vec<(u64, String)>)> = Vec::new();
        let mut raw_loads: Vec<PeerLoad> = Vec::new();
        let mut lagging = Vec::new();
        let peers;
        {
            let mut chitchat = self.chitchat.lock().await;
            let live: HashSet<ChitchatId> = chitchat.live_nodes().cloned().collect();
            let mut present = HashSet::new();
            for (id, state) in chitchat.node_states() {
                if *id == self.chitchat_id {
                    continue;
                }
                let origin = schema::origin(&id.node_id, id.generation_id);
                let view = NodeView(state);
                let applied = cursor.applied(&origin);
                let new: Vec<(u64, String)> = view
                    .decisions_after(applied)
                    .map(|(seq, v)| (seq, v.to_string()))
                    .collect();
                if let (Some(first), Some(last)) = (new.first(), new.last()) {
                    if first.0 > applied + 1 {
                        lagging.push((origin.clone(), last.0, applied));
                    }
                    cursor.applied.insert(origin.clone(), last.0);
                    raw_batches.push((origin.clone(), new));
                }
                present.insert(origin);
            }
            // Forget origins chitchat itself has forgotten (dead for the grace period).
            cursor.applied.retain(|origin, _| present.contains(origin));
            let peer_ids = self.live_peer_ids(&chitchat, &live);
            let mut list = Vec::with_capacity(peer_ids.len());
            for id in &peer_ids {
                let view = chitchat.node_state(id).map(NodeView);
                if let Some((version, raw)) = view.and_then(|v| v.load_versioned()) {
                    let origin = schema::origin(&id.node_id, id.generation_id);
                    let known = cursor.loads.get(&origin).map(|(v, _)| *v);
                    let new = (known != Some(version)).then(|| (version, raw.to_string()));
                    raw_loads.push((id.node_id.to_string(), origin, new));
                }
                list.push(Peer {
                    node_id: id.node_id.to_string(),
                    http_url: view.and_then(|v| v.http_url()).map(str::to_string),
                    gossip_addr: id.gossip_advertise_addr,
                });
            }
            peers = list;
            if self.applied_due() {
                let mut entries = cursor.entries();
                if entries.len() > schema::APPLIED_MAX_ORIGINS {
                    // Keep the most advanced origins, which are most likely the live ones.
                    entries.sort_by_key(|(o, s)| (std::cmp::Reverse(*s), o.clone()));
                    entries.truncate(schema::APPLIED_MAX_ORIGINS);
                    entries.sort();
                }
                OwnState(chitchat.self_node_state())
                    .set_applied(&AppliedWire::V1 { applied: entries });
            }
        }
        metrics::gauge!(crate::metric_names::GOSSIP_PEERS).set(peers.len() as f64);
        if !lagging.is_empty() {
            metrics::counter!(crate::metric_names::GOSSIP_LAGGING_ORIGINS_TOTAL)
                .increment(lagging.len() as u64);
        }
        let mut batches = Vec::new();
        for (origin, list) in raw_batches {
            for (seq, raw) in list {
                match schema::decode_batch(&raw) {
                    Ok(batch) => batches.push((origin.clone(), seq, batch)),
                    Err(error) => {
                        self.shared.decode_error();
                        warn!(%origin, seq, %error, "skipping undecodable decision batch");
                    }
                }
            }
        }
        metrics::counter!(crate::metric_names::GOSSIP_BATCHES_RECEIVED_TOTAL)
            .increment(batches.len() as u64);
        let mut loads = Vec::with_capacity(raw_loads.len());
        let mut live_origins = HashSet::with_capacity(raw_loads.len());
        for (node_id, origin, new) in raw_loads {
            if let Some((version, raw)) = new {
                match schema::decode_load(&raw) {
                    Ok(wire) => {
                        self.shared
                            .counters
                            .loads_decoded
                            .fetch_add(1, Ordering::Relaxed);
                        cursor
                            .loads
                            .insert(origin.clone(), (version, wire.into_loads()));
                    }
                    Err(error) => {
                        self.shared.decode_error();
                        warn!(%node_id, %error, "ignoring undecodable load");
                        cursor.loads.remove(&origin);
                    }
                }
            }
            if let Some((_, l)) = cursor.loads.get(&origin) {
                loads.push((node_id, l.clone()));
            }
            live_origins.insert(origin);
        }
        // Peers no longer live (or restarted as a new incarnation) are forgotten.
        cursor
            .loads
            .retain(|origin, _| live_origins.contains(origin));
        Update {
            batches,
            loads,
            peers,
            lagging,
        }
    }

    /// Whether `applied` may be published now (at most once per
    /// [`APPLIED_PUBLISH_INTERVAL`]); if so, records that it is.
    fn applied_due(&self) -> bool {
        let mut last = self
            .applied_published_at
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let now = tokio::time::Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < APPLIED_PUBLISH_INTERVAL) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// Live peers' chitchat ids: this router's node id excluded (its own earlier
    /// incarnations too), one incarnation per node id (the newest).
    fn live_peer_ids(&self, chitchat: &Chitchat, live: &HashSet<ChitchatId>) -> Vec<ChitchatId> {
        let mut newest: HashMap<&str, &ChitchatId> = HashMap::new();
        for id in live {
            if *id.node_id == *self.node_id {
                continue;
            }
            if chitchat.node_state(id).is_none() {
                continue;
            }
            let slot = newest.entry(&id.node_id).or_insert(id);
            if id.generation_id > slot.generation_id {
                *slot = id;
            }
        }
        let mut ids: Vec<ChitchatId> = newest.into_values().cloned().collect();
        ids.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        ids
    }

    /// The live peers (this router excluded), sorted by node id.
    pub async fn live_peers(&self) -> Vec<Peer> {
        let chitchat = self.chitchat.lock().await;
        let live: HashSet<ChitchatId> = chitchat.live_nodes().cloned().collect();
        let peers: Vec<Peer> = self
            .live_peer_ids(&chitchat, &live)
            .into_iter()
            .map(|id| Peer {
                http_url: chitchat
                    .node_state(&id)
                    .and_then(|s| NodeView(s).http_url())
                    .map(str::to_string),
                node_id: id.node_id.to_string(),
                gossip_addr: id.gossip_advertise_addr,
            })
            .collect();
        metrics::gauge!(crate::metric_names::GOSSIP_PEERS).set(peers.len() as f64);
        peers
    }

    /// Every live peer's published index digest, as `(node id, [(origin, applied seq)])`;
    /// with this router's own latest seq ([`Gossip::published_seq`]) it tells how far
    /// each peer is behind on this router's decisions.
    pub async fn applied_digests(&self) -> Vec<(String, Vec<(String, u64)>)> {
        let chitchat = self.chitchat.lock().await;
        let live: HashSet<ChitchatId> = chitchat.live_nodes().cloned().collect();
        let mut out = Vec::new();
        for id in self.live_peer_ids(&chitchat, &live) {
            let Some(raw) = chitchat
                .node_state(&id)
                .and_then(|s| NodeView(s).applied_raw())
            else {
                continue;
            };
            match schema::decode_applied(raw) {
                Ok(AppliedWire::V1 { applied }) => out.push((id.node_id.to_string(), applied)),
                Err(error) => {
                    self.shared.decode_error();
                    warn!(node_id = %id.node_id, %error, "ignoring undecodable applied digest");
                }
            }
        }
        out
    }

    /// The seq of the last decision batch this router published (0: none).
    pub fn published_seq(&self) -> u64 {
        self.next_seq.load(Ordering::Relaxed).saturating_sub(1)
    }

    /// Counters since start.
    pub fn stats(&self) -> GossipStats {
        let c = &self.shared.counters;
        GossipStats {
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            datagrams_sent: c.datagrams_sent.load(Ordering::Relaxed),
            datagrams_received: c.datagrams_received.load(Ordering::Relaxed),
            datagrams_dropped_unauthenticated: c.unauthenticated.load(Ordering::Relaxed),
            decode_errors: c.decode_errors.load(Ordering::Relaxed),
            decisions_shed: c.decisions_shed.load(Ordering::Relaxed),
            loads_decoded: c.loads_decoded.load(Ordering::Relaxed),
        }
    }

    /// Fault injection: drops every datagram to and from these gossip addresses (added to
    /// those already blocked) until [`Gossip::heal`]. Routing on this router goes on; its
    /// view of the blocked peers just stops changing.
    pub fn block_peers(&self, addrs: &[SocketAddr]) {
        let mut blocked = self
            .shared
            .blocked
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        blocked.extend(addrs.iter().copied());
    }

    /// Ends every [`Gossip::block_peers`].
    pub fn heal(&self) {
        self.shared
            .blocked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Leaves the cluster: stops gossiping and closes the socket. Peers see this router
    /// dead after their failure detection timeout (about a second).
    pub async fn shutdown(self) {
        if let Err(error) = self.handle.shutdown().await {
            warn!(node_id = %self.node_id, error = %format!("{error:#}"), "gossip stopped with an error");
        }
    }
}

/// The transport handed to chitchat: opens [`WarmSocket`]s.
struct WarmTransport {
    /// The gossip socket, bound by [`Gossip::start`] (so port 0 works and the bound port is
    /// known before chitchat starts), or the simulated network.
    prebound: Mutex<Option<Prebound>>,
    shared: Arc<Shared>,
}

/// What [`Gossip::start`] prepared for the transport.
enum Prebound {
    Udp(std::net::UdpSocket),
    Simulated(Arc<dyn Datagrams>),
}

impl WarmTransport {
    async fn open_socket(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let prebound = self
            .prebound
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let std_socket = match prebound {
            Some(Prebound::Simulated(d)) => return self.wrap(d, listen_addr).await,
            Some(Prebound::Udp(s)) => s,
            None => {
                let s = std::net::UdpSocket::bind(listen_addr)
                    .with_context(|| format!("failed to bind {listen_addr}/udp for gossip"))?;
                s.set_nonblocking(true)?;
                s
            }
        };
        let public = tokio::net::UdpSocket::from_std(std_socket)?;
        let local_addr = public.local_addr()?;
        self.wrap(Arc::new(public), local_addr).await
    }

    /// The socket chitchat gets: `public` behind the loopback relay.
    async fn wrap(
        &self,
        public: Arc<dyn Datagrams>,
        local_addr: SocketAddr,
    ) -> anyhow::Result<Box<dyn Socket>> {
        let inner = chitchat::transport::UdpSocket::open(([127, 0, 0, 1], 0).into()).await?;
        let inner_addr = inner.local_addr()?;
        Ok(Box::new(WarmSocket {
            shared: self.shared.clone(),
            public,
            local_addr,
            inner: Box::new(inner),
            inner_addr,
            shadows: HashMap::new(),
            by_shadow: HashMap::new(),
            recv_buf: vec![0u8; MAX_DATAGRAM + 1],
            send_buf: vec![0u8; MAX_DATAGRAM + 1],
            next_message_id: 0,
            gate: DatagramGate::new(self.shared.mac_key),
        }))
    }
}

impl Transport for WarmTransport {
    // The trait is declared with `#[async_trait]`; this is its expansion, written out so
    // that this crate does not need the macro.
    fn open<'life0, 'async_trait>(
        &'life0 self,
        listen_addr: SocketAddr,
    ) -> Pin<Box<dyn Future<Output = anyhow::Result<Box<dyn Socket>>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.open_socket(listen_addr))
    }
}

/// A loopback socket standing for one peer towards chitchat's private socket.
struct Shadow {
    socket: tokio::net::UdpSocket,
    addr: SocketAddr,
    last_used: Instant,
}

/// A fragmented message being reassembled.
struct Reassembly {
    message_id: u32,
    parts: Vec<Option<Vec<u8>>>,
}

/// The gossip socket chitchat uses (see the module docs for the loopback relay).
struct WarmSocket {
    shared: Arc<Shared>,
    public: Arc<dyn Datagrams>,
    local_addr: SocketAddr,
    inner: Box<dyn Socket>,
    inner_addr: SocketAddr,
    /// Peer address → its shadow.
    shadows: HashMap<SocketAddr, Shadow>,
    /// Shadow address → peer address.
    by_shadow: HashMap<SocketAddr, SocketAddr>,
    recv_buf: Vec<u8>,
    send_buf: Vec<u8>,
    next_message_id: u32,
    gate: DatagramGate,
}

fn is_transient(err: &std::io::Error) -> bool {
    matches!(
        err.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::OutOfMemory
            | std::io::ErrorKind::Interrupted
    )
}

impl WarmSocket {
    /// The shadow of `peer`, created (and connected to chitchat's socket) if needed.
    async fn shadow_addr(&mut self, peer: SocketAddr) -> anyhow::Result<SocketAddr> {
        if let Some(shadow) = self.shadows.get_mut(&peer) {
            shadow.last_used = Instant::now();
            return Ok(shadow.addr);
        }
        if self.shadows.len() >= MAX_SHADOWS {
            if let Some(oldest) = self
                .shadows
                .iter()
                .min_by_key(|(_, s)| s.last_used)
                .map(|(p, _)| *p)
            {
                if let Some(s) = self.shadows.remove(&oldest) {
                    self.by_shadow.remove(&s.addr);
                }
            }
        }
        let socket = tokio::net::UdpSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        socket.connect(self.inner_addr).await?;
        let addr = socket.local_addr()?;
        self.by_shadow.insert(addr, peer);
        self.shadows.insert(
            peer,
            Shadow {
                socket,
                addr,
                last_used: Instant::now(),
            },
        );
        Ok(addr)
    }

    async fn send_envelope(
        &mut self,
        to: SocketAddr,
        envelope: ChitchatEnvelope,
    ) -> anyhow::Result<SendOutcome> {
        if self.shared.is_blocked(&to) {
            return Ok(SendOutcome { num_bytes_sent: 0 });
        }
        let shadow_addr = self.shadow_addr(to).await?;
        self.inner.send(shadow_addr, envelope).await?;
        let shadow = self.shadows.get(&to).context("shadow socket vanished")?;
        let n = tokio::time::timeout(LOOPBACK_TIMEOUT, shadow.socket.recv(&mut self.send_buf))
            .await
            .context("chitchat's datagram did not arrive on loopback")??;
        self.next_message_id = self.next_message_id.wrapping_add(1);
        let frames = self.gate.seal(&self.send_buf[..n], self.next_message_id);
        let mut sent = 0;
        for frame in &frames {
            sent += self
                .public
                .send_to(frame, to)
                .await
                .context("failed to send a gossip datagram")?;
        }
        let c = &self.shared.counters;
        c.bytes_sent.fetch_add(sent as u64, Ordering::Relaxed);
        c.datagrams_sent
            .fetch_add(frames.len() as u64, Ordering::Relaxed);
        metrics::counter!(crate::metric_names::GOSSIP_SENT_BYTES_TOTAL).increment(sent as u64);
        Ok(SendOutcome {
            num_bytes_sent: sent,
        })
    }

    /// Checks a datagram from the network and hands it to chitchat through the sender's
    /// shadow.
    async fn on_datagram(&mut self, len: usize, from: SocketAddr) {
        if self.shared.is_blocked(&from) {
            return;
        }
        let c = &self.shared.counters;
        c.bytes_received.fetch_add(len as u64, Ordering::Relaxed);
        c.datagrams_received.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metric_names::GOSSIP_RECEIVED_BYTES_TOTAL).increment(len as u64);
        let payload = match self.gate.accept(from, &self.recv_buf[..len]) {
            Ok(Some(payload)) => payload,
            Ok(None) => return,
            Err(Rejected::Unauthenticated) => {
                self.shared.unauthenticated();
                debug!(%from, len, "dropping unauthenticated gossip datagram");
                return;
            }
            Err(Rejected::Malformed) => {
                self.shared.decode_error();
                debug!(%from, len, "dropping a datagram that is not chitchat");
                return;
            }
        };
        let shadow_addr = match self.shadow_addr(from).await {
            Ok(addr) => addr,
            Err(error) => {
                warn!(%from, error = %format!("{error:#}"), "cannot relay a gossip datagram");
                return;
            }
        };
        if let Some(shadow) = self.shadows.get(&from) {
            debug_assert_eq!(shadow.addr, shadow_addr);
            if let Err(error) = shadow.socket.send(&payload).await {
                warn!(%from, %error, "cannot relay a gossip datagram");
            }
        }
    }

    async fn recv_envelope(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            tokio::select! {
                biased;
                outcome = self.inner.recv() => {
                    let outcome = outcome?;
                    match self.by_shadow.get(&outcome.from_addr) {
                        Some(&peer) => {
                            return Ok(RecvOutcome { from_addr: peer, ..outcome });
                        }
                        // Written straight to chitchat's loopback socket by someone else
                        // on this host: never from a peer we checked.
                        None => self.shared.unauthenticated(),
                    }
                }
                got = self.public.recv_from(&mut self.recv_buf) => match got {
                    Ok((len, from)) => self.on_datagram(len, from).await,
                    Err(error) if is_transient(&error) => {
                        debug!(%error, "transient gossip recv error");
                    }
                    Err(error) => return Err(error).context("fatal gossip recv error"),
                },
            }
        }
    }
}

impl Socket for WarmSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.local_addr)
    }

    fn send<'life0, 'async_trait>(
        &'life0 mut self,
        to: SocketAddr,
        envelope: ChitchatEnvelope,
    ) -> Pin<Box<dyn Future<Output = anyhow::Result<SendOutcome>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.send_envelope(to, envelope))
    }

    fn recv<'life0, 'async_trait>(
        &'life0 mut self,
    ) -> Pin<Box<dyn Future<Output = anyhow::Result<RecvOutcome>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.recv_envelope())
    }
}

/// Why [`DatagramGate::accept`] refused a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejected {
    /// Its MAC does not verify (or it has none while the cluster has a secret).
    Unauthenticated,
    /// Authenticated, but not a well-formed fragment or chitchat message.
    Malformed,
}

/// The check every gossip datagram passes before chitchat sees it, and the framing of
/// what this node sends: pure (no sockets), so the fuzz targets drive this very code.
pub struct DatagramGate {
    key: Option<[u8; 32]>,
    reassembly: HashMap<SocketAddr, Reassembly>,
}

impl std::fmt::Debug for DatagramGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs.
        f.debug_struct("DatagramGate")
            .field("authenticated", &self.key.is_some())
            .field("reassemblies", &self.reassembly.len())
            .finish()
    }
}

impl DatagramGate {
    /// A gate for the cluster's MAC key (`None`: no secret, nothing authenticated).
    pub fn new(key: Option<[u8; 32]>) -> Self {
        DatagramGate {
            key,
            reassembly: HashMap::new(),
        }
    }

    /// The datagrams that carry `payload` (see [`seal`]).
    pub fn seal(&self, payload: &[u8], message_id: u32) -> Vec<Vec<u8>> {
        seal(self.key.as_ref(), payload, message_id)
    }

    /// The chitchat message a datagram from `from` completes: `Ok(None)` while a
    /// fragmented message is incomplete.
    pub fn accept(
        &mut self,
        from: SocketAddr,
        datagram: &[u8],
    ) -> Result<Option<Vec<u8>>, Rejected> {
        let payload = match self.key.as_ref() {
            None => datagram.to_vec(),
            Some(key) => match open(key, datagram) {
                None => return Err(Rejected::Unauthenticated),
                Some(body) if body.starts_with(&FRAGMENT_MAGIC) => {
                    match reassemble(&mut self.reassembly, from, body) {
                        Ok(Some(whole)) => whole,
                        Ok(None) => return Ok(None),
                        Err(()) => return Err(Rejected::Malformed),
                    }
                }
                Some(body) => body.to_vec(),
            },
        };
        if payload.starts_with(&CHITCHAT_MAGIC) {
            Ok(Some(payload))
        } else {
            Err(Rejected::Malformed)
        }
    }
}

/// The MAC of `bytes`.
fn mac(key: &[u8; 32], bytes: &[u8]) -> blake3::Hash {
    blake3::keyed_hash(key, bytes)
}

/// The datagrams that carry `payload`: itself when there is no key; with a key, itself
/// followed by its MAC, or, when that would not fit in one datagram, authenticated
/// fragments (header, part, MAC).
fn seal(key: Option<&[u8; 32]>, payload: &[u8], message_id: u32) -> Vec<Vec<u8>> {
    let Some(key) = key else {
        return vec![payload.to_vec()];
    };
    if payload.len() + MAC_LEN <= MAX_DATAGRAM {
        let mut frame = Vec::with_capacity(payload.len() + MAC_LEN);
        frame.extend_from_slice(payload);
        frame.extend_from_slice(mac(key, payload).as_bytes());
        return vec![frame];
    }
    let chunk = MAX_DATAGRAM - FRAGMENT_HEADER - MAC_LEN;
    let count = payload.len().div_ceil(chunk);
    payload
        .chunks(chunk)
        .enumerate()
        .map(|(i, part)| {
            let mut frame = Vec::with_capacity(FRAGMENT_HEADER + part.len() + MAC_LEN);
            frame.extend_from_slice(&FRAGMENT_MAGIC);
            frame.extend_from_slice(&message_id.to_le_bytes());
            // At most 65,507 bytes in chunks of 65,465: two fragments.
            frame.push(i as u8);
            frame.push(count as u8);
            frame.extend_from_slice(part);
            let tag = mac(key, &frame);
            frame.extend_from_slice(tag.as_bytes());
            frame
        })
        .collect()
}

/// The body of an authenticated datagram, or `None` when its MAC does not verify.
fn open<'a>(key: &[u8; 32], datagram: &'a [u8]) -> Option<&'a [u8]> {
    let split = datagram.len().checked_sub(MAC_LEN)?;
    let (body, tag) = datagram.split_at(split);
    let tag: [u8; MAC_LEN] = tag.try_into().ok()?;
    // blake3::Hash compares in constant time.
    (mac(key, body) == blake3::Hash::from_bytes(tag)).then_some(body)
}

/// Adds an authenticated fragment; returns the whole message once every part arrived.
/// `Err` for a malformed fragment.
fn reassemble(
    pending: &mut HashMap<SocketAddr, Reassembly>,
    from: SocketAddr,
    frame: &[u8],
) -> Result<Option<Vec<u8>>, ()> {
    if frame.len() < FRAGMENT_HEADER || frame[..4] != FRAGMENT_MAGIC {
        return Err(());
    }
    let message_id = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
    let (index, count) = (frame[8], frame[9]);
    if count == 0 || count > MAX_FRAGMENTS || index >= count {
        return Err(());
    }
    if pending.len() >= MAX_REASSEMBLIES && !pending.contains_key(&from) {
        pending.clear();
    }
    let entry = pending.entry(from).or_insert_with(|| Reassembly {
        message_id,
        parts: vec![None; count as usize],
    });
    if entry.message_id != message_id || entry.parts.len() != count as usize {
        // A newer message replaces an incomplete older one (UDP lost a fragment).
        *entry = Reassembly {
            message_id,
            parts: vec![None; count as usize],
        };
    }
    entry.parts[index as usize] = Some(frame[FRAGMENT_HEADER..].to_vec());
    if entry.parts.iter().any(Option::is_none) {
        return Ok(None);
    }
    let whole = entry.parts.iter().flatten().flatten().copied().collect();
    pending.remove(&from);
    Ok(Some(whole))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decisions::Decision;
    use warmpath_index::keys::BlockKey;

    const DEADLINE: Duration = Duration::from_secs(10);
    const TTL: Duration = Duration::from_secs(60);

    fn config(node_id: &str, seeds: &[SocketAddr], secret: Option<&[u8]>) -> GossipConfig {
        let any: SocketAddr = ([127, 0, 0, 1], 0).into();
        GossipConfig {
            node_id: node_id.to_string(),
            cluster_id: "test".to_string(),
            listen: any,
            advertise: any,
            seeds: seeds.iter().map(|a| a.to_string()).collect(),
            gossip_interval: DEFAULT_GOSSIP_INTERVAL,
            http_url: format!("http://{node_id}.test:8080"),
            decision_ttl: TTL,
            secret: secret.map(<[u8]>::to_vec),
            decision_keys_per_s: schema::DECISION_BUDGET_KEYS_PER_S,
            datagrams: None,
        }
    }

    async fn start(node_id: &str, seeds: &[SocketAddr]) -> Gossip {
        Gossip::start(config(node_id, seeds, None)).await.unwrap()
    }

    /// Polls `check` every 10 ms until it returns `Some`, failing after [`DEADLINE`].
    async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let start = Instant::now();
        loop {
            if let Some(v) = check().await {
                return v;
            }
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn peer_ids(peers: &[Peer]) -> Vec<String> {
        let mut ids: Vec<String> = peers.iter().map(|p| p.node_id.clone()).collect();
        ids.sort();
        ids
    }

    async fn wait_peers(node: &Gossip, want: &[&str]) {
        let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        eventually(&format!("{} to see {want:?}", node.node_id()), || {
            let want = want.clone();
            async move { (peer_ids(&node.live_peers().await) == want).then_some(()) }
        })
        .await;
    }

    fn decision(instance: u64, keys: &[u64]) -> Decision {
        Decision {
            instance,
            keys: keys.iter().map(|&k| BlockKey(k)).collect(),
        }
    }

    /// `n` decisions of `blocks` uniformly random keys (real block keys are hashes, so
    /// they do not compress), to different instances.
    fn random_decisions(batch: u64, n: u64, blocks: u64) -> Vec<Decision> {
        let word = |x: u64, y: u64, z: u64| {
            let mut input = [0u8; 24];
            input[..8].copy_from_slice(&x.to_le_bytes());
            input[8..16].copy_from_slice(&y.to_le_bytes());
            input[16..].copy_from_slice(&z.to_le_bytes());
            let h = blake3::hash(&input);
            u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8]))
        };
        (0..n)
            .map(|d| Decision {
                instance: word(batch, d, u64::MAX),
                keys: (0..blocks).map(|k| BlockKey(word(batch, d, k))).collect(),
            })
            .collect()
    }

    /// Polls `node` until `cursor` has received batches up to `seq` from `origin`; returns
    /// every batch received on the way, as `(origin, seq)`.
    async fn receive_until(
        node: &Gossip,
        cursor: &mut Cursor,
        origin: &str,
        seq: u64,
    ) -> Vec<(String, u64, BatchWire)> {
        let mut got = Vec::new();
        let start = Instant::now();
        while cursor.applied(origin) < seq {
            got.extend(node.poll(cursor).await.batches);
            assert!(
                start.elapsed() < DEADLINE,
                "{} timed out waiting for {origin} seq {seq}",
                node.node_id()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        got
    }

    async fn three(prefix: &str) -> (Gossip, Gossip, Gossip) {
        let a = start(&format!("{prefix}-a"), &[]).await;
        let seed = [a.gossip_addr()];
        let b = start(&format!("{prefix}-b"), &seed).await;
        let c = start(&format!("{prefix}-c"), &seed).await;
        (a, b, c)
    }

    #[test]
    fn seal_and_open() {
        let key = blake3::derive_key(MAC_KEY_CONTEXT, b"secret");
        let other = blake3::derive_key(MAC_KEY_CONTEXT, b"other");
        let payload = b"\x53\xb0hello".to_vec();
        assert_eq!(seal(None, &payload, 0), vec![payload.clone()]);
        let frames = seal(Some(&key), &payload, 0);
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].len(), payload.len() + MAC_LEN);
        assert_eq!(open(&key, &frames[0]), Some(&payload[..]));
        assert_eq!(open(&other, &frames[0]), None);
        let mut flipped = frames[0].clone();
        flipped[2] ^= 1;
        assert_eq!(open(&key, &flipped), None);
        assert_eq!(open(&key, &frames[0][..10]), None);
        assert_eq!(open(&key, b""), None);
    }

    #[test]
    fn large_messages_are_fragmented_and_reassembled() {
        let key = blake3::derive_key(MAC_KEY_CONTEXT, b"secret");
        let from: SocketAddr = ([127, 0, 0, 1], 9).into();
        for len in [
            MAX_DATAGRAM - MAC_LEN,
            MAX_DATAGRAM - MAC_LEN + 1,
            MAX_DATAGRAM,
        ] {
            let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let frames = seal(Some(&key), &payload, 7);
            let want_frames = if len + MAC_LEN <= MAX_DATAGRAM { 1 } else { 2 };
            assert_eq!(frames.len(), want_frames, "{len}");
            assert!(frames.iter().all(|f| f.len() <= MAX_DATAGRAM));
            if want_frames == 1 {
                continue;
            }
            let mut pending = HashMap::new();
            // Out of order, with a stale fragment of another message first.
            let stale = seal(Some(&key), &payload, 6);
            let body = open(&key, &stale[0]).unwrap();
            assert_eq!(reassemble(&mut pending, from, body), Ok(None));
            let second = open(&key, &frames[1]).unwrap();
            assert_eq!(reassemble(&mut pending, from, second), Ok(None));
            let first = open(&key, &frames[0]).unwrap();
            assert_eq!(reassemble(&mut pending, from, first), Ok(Some(payload)));
            assert!(pending.is_empty());
        }
        let mut pending = HashMap::new();
        for bad in [
            &b"WPF1"[..],
            b"WPF1\0\0\0\0\x02\x02",
            b"WPF1\0\0\0\0\0\0",
            b"XXXX\0\0\0\0\0\x01",
        ] {
            assert_eq!(reassemble(&mut pending, from, bad), Err(()), "{bad:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_nodes_discover_each_other_from_one_seed() {
        let (a, b, c) = three("disc").await;
        wait_peers(&a, &["disc-b", "disc-c"]).await;
        wait_peers(&b, &["disc-a", "disc-c"]).await;
        wait_peers(&c, &["disc-a", "disc-b"]).await;
        let peers = b.live_peers().await;
        let pa = peers.iter().find(|p| p.node_id == "disc-a").unwrap();
        assert_eq!(pa.gossip_addr, a.gossip_addr());
        let bref = &b;
        eventually("http urls", || async move {
            let peers = bref.live_peers().await;
            peers
                .iter()
                .all(|p| p.http_url.as_deref() == Some(&*format!("http://{}.test:8080", p.node_id)))
                .then_some(())
        })
        .await;
        for n in [a, b, c] {
            n.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_outbox_is_split_within_the_batch_budget() {
        let (a, b, c) = three("split").await;
        wait_peers(&a, &["split-b", "split-c"]).await;
        // 100 decisions of 32 random keys: about 36 KiB, over four times the budget.
        let sent = random_decisions(1, 100, 32);
        let last = a.publish_decisions(1, sent.clone()).await;
        assert!(last >= 5, "{last} batches");
        let mut cursor = Cursor::new();
        let got = receive_until(&b, &mut cursor, a.origin(), last).await;
        let mut received = Vec::new();
        for (_, _, batch) in &got {
            assert!(crate::decisions::encode(batch).len() <= schema::BATCH_MAX_BYTES);
            let BatchWire::V1 { decisions, .. } = batch;
            received.extend(decisions.iter().cloned());
        }
        assert_eq!(received, sent);
        for n in [a, b, c] {
            n.shutdown().await;
        }
    }

    /// Record 0118: a router publishes its share of the cluster's decision budget and sheds
    /// the rest, counted; what it publishes reaches its peers as before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decisions_past_the_routers_budget_share_are_shed_and_counted() {
        let lone = config("shed-a", &[], None);
        // 240 keys a second for the cluster, a quarter second of a router's share in its
        // bucket.
        let a = Gossip::start(GossipConfig {
            decision_keys_per_s: 240,
            ..lone
        })
        .await
        .unwrap();
        let b = start("shed-b", &[a.gossip_addr()]).await;
        wait_peers(&a, &["shed-b"]).await;
        // Two routers now: 120 keys a second each, a bucket of 30. A batch of 400 keys goes
        // (the bucket is not empty) and leaves it in debt for over 3 s.
        let fits = a.publish_decisions(1, vec![decision(1, &[1; 400])]).await;
        assert_eq!(fits, 1);
        let shed = a.publish_decisions(2, vec![decision(2, &[2; 10])]).await;
        assert_eq!(shed, 0, "past the share: nothing published");
        assert_eq!(a.stats().decisions_shed, 1);
        assert_eq!(a.published_seq(), 1);
        let mut cursor = Cursor::new();
        let got = receive_until(&b, &mut cursor, a.origin(), 1).await;
        assert_eq!(got.len(), 1);
        for n in [a, b] {
            n.shutdown().await;
        }
    }

    /// A peer's load is decoded once per version it publishes, and every poll still
    /// returns it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peers_load_is_decoded_once_per_version() {
        let a = start("loadv-a", &[]).await;
        let b = start("loadv-b", &[a.gossip_addr()]).await;
        wait_peers(&b, &["loadv-a"]).await;
        let busy = |n| {
            vec![(
                7,
                InstanceLoad {
                    in_flight: n,
                    pending_prefill_tokens: 10,
                },
            )]
        };
        async fn seen(b: &Gossip, cursor: &mut Cursor, want: Vec<(u64, InstanceLoad)>) {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let update = b.poll(cursor).await;
                if update
                    .loads
                    .iter()
                    .any(|(n, l)| n == "loadv-a" && *l == want)
                {
                    return;
                }
                assert!(Instant::now() < deadline, "{:?}", update.loads);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let mut cursor = Cursor::new();
        a.publish_load(&busy(3)).await;
        seen(&b, &mut cursor, busy(3)).await;
        let decoded = b.stats().loads_decoded;
        assert_eq!(decoded, 1);
        // Polled again, republished unchanged: still returned, not decoded again.
        a.publish_load(&busy(3)).await;
        for _ in 0..5 {
            let update = b.poll(&mut cursor).await;
            assert_eq!(update.loads, vec![("loadv-a".to_string(), busy(3))]);
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        assert_eq!(b.stats().loads_decoded, 1);
        // A new value: decoded once more.
        a.publish_load(&busy(4)).await;
        seen(&b, &mut cursor, busy(4)).await;
        assert_eq!(b.stats().loads_decoded, 2);
        for n in [a, b] {
            n.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_reach_every_peer_exactly_once_and_loads_propagate() {
        let (a, b, c) = three("batch").await;
        wait_peers(&a, &["batch-b", "batch-c"]).await;
        let published = Instant::now();
        let s1 = a
            .publish_decisions(1, vec![decision(7, &[1, 2, 3]), decision(8, &[1, 9])])
            .await;
        let s2 = a.publish_decisions(2, vec![decision(7, &[4])]).await;
        assert_eq!((s1, s2), (1, 2));
        assert_eq!(a.published_seq(), 2);
        a.publish_load(&[
            (
                7,
                InstanceLoad {
                    in_flight: 3,
                    pending_prefill_tokens: 100,
                },
            ),
            (8, InstanceLoad::default()),
        ])
        .await;
        let mut reached = Vec::new();
        for node in [&b, &c] {
            let mut cursor = Cursor::new();
            let got = receive_until(node, &mut cursor, a.origin(), 2).await;
            reached.push(published.elapsed());
            let seqs: Vec<(String, u64)> = got.iter().map(|(o, s, _)| (o.clone(), *s)).collect();
            assert_eq!(
                seqs,
                vec![(a.origin().to_string(), 1), (a.origin().to_string(), 2)]
            );
            let BatchWire::V1 {
                made_at_ms,
                decisions,
            } = &got[0].2;
            assert_eq!(*made_at_ms, 1);
            assert_eq!(
                decisions,
                &vec![decision(7, &[1, 2, 3]), decision(8, &[1, 9])]
            );
            // Nothing twice.
            for _ in 0..5 {
                assert!(node.poll(&mut cursor).await.batches.is_empty());
            }
            // A fresh cursor sees both again.
            let mut fresh = Cursor::new();
            assert_eq!(node.poll(&mut fresh).await.batches.len(), 2);
            // Loads: only the busy instance.
            let loads = eventually("loads", || {
                let mut cursor = cursor.clone();
                async move {
                    let update = node.poll(&mut cursor).await;
                    update
                        .loads
                        .into_iter()
                        .find(|(n, l)| n == "batch-a" && !l.is_empty())
                }
            })
            .await;
            assert_eq!(
                loads.1,
                vec![(
                    7,
                    InstanceLoad {
                        in_flight: 3,
                        pending_prefill_tokens: 100
                    }
                )]
            );
        }
        eprintln!(
            "batch reached b after {:?}, c after {:?}",
            reached[0], reached[1]
        );
        // The applied digests come back to a (published by b and c's polls, at most once
        // per APPLIED_PUBLISH_INTERVAL).
        let (aref, bref, cref) = (&a, &b, &c);
        eventually("applied digests", || async move {
            for node in [bref, cref] {
                node.poll(&mut Cursor::new()).await;
            }
            let digests = aref.applied_digests().await;
            (digests.len() == 2
                && digests
                    .iter()
                    .all(|(_, d)| d.contains(&(aref.origin().to_string(), 2))))
            .then_some(())
        })
        .await;
        let stats = a.stats();
        assert!(
            stats.bytes_sent > 0 && stats.bytes_received > 0,
            "{stats:?}"
        );
        assert!(stats.datagrams_sent > 0 && stats.datagrams_received > 0);
        for n in [a, b, c] {
            n.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shut_down_node_leaves_the_live_set() {
        let (a, b, c) = three("kill").await;
        wait_peers(&b, &["kill-a", "kill-c"]).await;
        c.shutdown().await;
        let gone = Instant::now();
        wait_peers(&a, &["kill-b"]).await;
        wait_peers(&b, &["kill-a"]).await;
        eprintln!("dead after {:?}", gone.elapsed());
        a.shutdown().await;
        b.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_partitioned_node_catches_up_after_healing() {
        let (a, b, c) = three("part").await;
        wait_peers(&a, &["part-b", "part-c"]).await;
        wait_peers(&b, &["part-a", "part-c"]).await;
        wait_peers(&c, &["part-a", "part-b"]).await;
        let mut cursor_a = Cursor::new();
        a.block_peers(&[b.gossip_addr(), c.gossip_addr()]);
        // Cut off, a keeps working locally: it publishes, and polls without error.
        let sa = a.publish_decisions(1, vec![decision(1, &[10])]).await;
        let mut last_b = 0;
        for i in 0..5 {
            last_b = b.publish_decisions(i, vec![decision(2, &[20 + i])]).await;
        }
        // c gets b's batches; a does not, and loses its peers.
        let mut cursor_c = Cursor::new();
        receive_until(&c, &mut cursor_c, b.origin(), last_b).await;
        wait_peers(&a, &[]).await;
        let update = a.poll(&mut cursor_a).await;
        assert!(update.batches.iter().all(|(o, _, _)| o != b.origin()));
        assert_eq!(cursor_a.applied(b.origin()), 0);
        assert_eq!(cursor_c.applied(a.origin()), 0);
        a.heal();
        let got = receive_until(&a, &mut cursor_a, b.origin(), last_b).await;
        let from_b: Vec<u64> = got
            .iter()
            .filter(|(o, _, _)| o == b.origin())
            .map(|(_, s, _)| *s)
            .collect();
        assert_eq!(from_b, (1..=last_b).collect::<Vec<_>>());
        receive_until(&c, &mut cursor_c, a.origin(), sa).await;
        wait_peers(&a, &["part-b", "part-c"]).await;
        for n in [a, b, c] {
            n.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_node_catches_up_and_a_restart_is_a_new_origin() {
        let a = start("late-a", &[]).await;
        let b = start("late-b", &[a.gossip_addr()]).await;
        let mut last = 0;
        for i in 0..20 {
            last = a
                .publish_decisions(i, vec![decision(i, &[i, i + 1, i + 2])])
                .await;
        }
        let old_b_origin = b.origin().to_string();
        b.publish_decisions(0, vec![decision(5, &[5])]).await;
        let mut cursor_a = Cursor::new();
        receive_until(&a, &mut cursor_a, &old_b_origin, 1).await;
        // c joins after everything was published, through b only.
        let c = start("late-c", &[b.gossip_addr()]).await;
        let mut cursor = Cursor::new();
        let got = receive_until(&c, &mut cursor, a.origin(), last).await;
        let seqs: Vec<u64> = got
            .iter()
            .filter(|(o, _, _)| o == a.origin())
            .map(|(_, s, _)| *s)
            .collect();
        assert_eq!(seqs, (1..=last).collect::<Vec<_>>());
        // b restarts under the same node id: a new origin, seqs from 1 again, and its
        // old incarnation's batch is not mistaken for the new one's.
        b.shutdown().await;
        let b2 = start("late-b", &[a.gossip_addr()]).await;
        assert_ne!(b2.origin(), old_b_origin);
        assert_eq!(b2.publish_decisions(0, vec![decision(6, &[6])]).await, 1);
        let got = receive_until(&a, &mut cursor_a, b2.origin(), 1).await;
        let BatchWire::V1 { decisions, .. } =
            &got.iter().find(|(o, _, _)| o == b2.origin()).unwrap().2;
        assert_eq!(decisions, &vec![decision(6, &[6])]);
        assert_eq!(cursor_a.applied(&old_b_origin), 1);
        wait_peers(&a, &["late-b", "late-c"]).await;
        for n in [a, b2, c] {
            n.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expired_batches_are_reported_as_lagging() {
        let ttl = Duration::from_millis(1000);
        let mut cfg = config("ttl-a", &[], None);
        cfg.decision_ttl = ttl;
        let a = Gossip::start(cfg).await.unwrap();
        for i in 0..3 {
            a.publish_decisions(i, vec![decision(1, &[i])]).await;
        }
        // Let chitchat's gc (run every gossip round) drop them.
        tokio::time::sleep(ttl + Duration::from_millis(300)).await;
        let last = a.publish_decisions(3, vec![decision(1, &[3])]).await;
        let mut cfg = config("ttl-b", &[a.gossip_addr()], None);
        cfg.decision_ttl = ttl;
        let b = Gossip::start(cfg).await.unwrap();
        let mut cursor = Cursor::new();
        let started = Instant::now();
        let (batches, lagging) = loop {
            let update = b.poll(&mut cursor).await;
            if !update.batches.is_empty() {
                break (update.batches, update.lagging);
            }
            assert!(
                started.elapsed() < DEADLINE,
                "timed out waiting for the surviving batch"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0].1, last);
        assert_eq!(lagging, vec![(a.origin().to_string(), last, 0)]);
        a.shutdown().await;
        b.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_with_another_secret_never_joins() {
        let a = Gossip::start(config("sec-a", &[], Some(b"right")))
            .await
            .unwrap();
        let seed = [a.gossip_addr()];
        let b = Gossip::start(config("sec-b", &seed, Some(b"right")))
            .await
            .unwrap();
        let x = Gossip::start(config("sec-x", &seed, Some(b"wrong")))
            .await
            .unwrap();
        let y = start("sec-y", &seed).await;
        wait_peers(&a, &["sec-b"]).await;
        wait_peers(&b, &["sec-a"]).await;
        let seq = a.publish_decisions(1, vec![decision(1, &[1])]).await;
        let mut cursor = Cursor::new();
        receive_until(&b, &mut cursor, a.origin(), seq).await;
        let aref = &a;
        eventually("unauthenticated datagrams counted", || async move {
            (aref.stats().datagrams_dropped_unauthenticated >= 4).then_some(())
        })
        .await;
        // Long enough for many gossip rounds: x and y stay out, and see nobody.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(peer_ids(&a.live_peers().await), vec!["sec-b"]);
        assert_eq!(peer_ids(&b.live_peers().await), vec!["sec-a"]);
        assert!(x.live_peers().await.is_empty());
        assert!(y.live_peers().await.is_empty());
        let mut cursor = Cursor::new();
        assert!(x.poll(&mut cursor).await.batches.is_empty());
        assert!(x.stats().bytes_sent > 0);
        assert_eq!(b.stats().decode_errors, 0);
        for n in [a, b, x, y] {
            n.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_node_catches_up_on_more_than_a_datagram_with_a_secret() {
        // 24 batches of ~7 KB of random keys: ~170 KB of state, so chitchat sends full
        // 64 KiB deltas, which need fragmenting to carry their MAC.
        let secret = Some(&b"s3cret"[..]);
        let a = Gossip::start(config("big-a", &[], secret)).await.unwrap();
        let mut last = 0;
        for i in 0..24 {
            last = a.publish_decisions(i, random_decisions(i, 20, 32)).await;
        }
        let started = Instant::now();
        let b = Gossip::start(config("big-b", &[a.gossip_addr()], secret))
            .await
            .unwrap();
        let mut cursor = Cursor::new();
        let got = receive_until(&b, &mut cursor, a.origin(), last).await;
        eprintln!(
            "caught up on {last} batches in {:?}; a sent {} B in {} datagrams",
            started.elapsed(),
            a.stats().bytes_sent,
            a.stats().datagrams_sent
        );
        assert_eq!(got.len() as u64, last);
        for (i, (_, seq, batch)) in got.iter().enumerate() {
            assert_eq!(*seq, i as u64 + 1);
            let BatchWire::V1 { decisions, .. } = batch;
            assert_eq!(decisions, &random_decisions(i as u64, 20, 32));
        }
        assert_eq!(a.stats().datagrams_dropped_unauthenticated, 0);
        assert_eq!(b.stats().decode_errors, 0);
        a.shutdown().await;
        b.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_datagrams_are_dropped_and_bytes_per_batch_measured() {
        let (a, b, c) = three("bytes").await;
        wait_peers(&a, &["bytes-b", "bytes-c"]).await;
        wait_peers(&b, &["bytes-a", "bytes-c"]).await;
        // Junk to a's socket: counted, ignored, and a keeps working.
        let junk = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        junk.send_to(b"not chitchat", a.gossip_addr()).unwrap();
        let aref = &a;
        eventually("junk counted", || async move {
            (aref.stats().decode_errors >= 1).then_some(())
        })
        .await;
        // Idle cost, then the cost of 20 batches of 20 decisions of 32 blocks.
        let idle_window = Duration::from_secs(1);
        let before = a.stats();
        tokio::time::sleep(idle_window).await;
        let idle = a.stats().bytes_sent - before.bytes_sent;
        let before = (a.stats(), b.stats(), c.stats());
        let started = Instant::now();
        let mut last = 0;
        for i in 0..20u64 {
            last = a.publish_decisions(i, random_decisions(i, 20, 32)).await;
        }
        let mut cb = Cursor::new();
        let mut cc = Cursor::new();
        receive_until(&b, &mut cb, a.origin(), last).await;
        receive_until(&c, &mut cc, a.origin(), last).await;
        let took = started.elapsed();
        let after = (a.stats(), b.stats(), c.stats());
        let sent = (after.0.bytes_sent - before.0.bytes_sent)
            + (after.1.bytes_sent - before.1.bytes_sent)
            + (after.2.bytes_sent - before.2.bytes_sent);
        let encoded = crate::decisions::encode(&BatchWire::V1 {
            made_at_ms: 0,
            decisions: random_decisions(0, 20, 32),
        })
        .len();
        eprintln!(
            "idle: a sent {idle} B/s; 20 batches of {encoded} B each reached 2 peers in {took:?}, \
             all 3 nodes sent {sent} B ({} B per batch)",
            sent / 20
        );
        assert!(sent > 0);
        for n in [a, b, c] {
            n.shutdown().await;
        }
    }
}
