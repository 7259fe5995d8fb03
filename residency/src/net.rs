//! The residency session over QUIC (the I/O around the session, `session.rs`).
//!
//! One bidirectional stream per router connection. The router sends [`Reply::Resync`] to
//! start and whenever its subscriber asks; the agent answers each with a snapshot, then
//! streams every delta and heartbeat the publisher produces. Messages are a `u32`
//! little-endian length then postcard of [`Wire`], at most [`MAX_MESSAGE_BYTES`].
//!
//! The agent side: a task takes the publisher's next delta as soon as it is told something
//! changed (`changed`, notified by whoever records changes; changes recorded meanwhile
//! travel in the same delta), and a heartbeat after 500 ms without one, and broadcasts
//! it; a connection takes its snapshot and subscribes
//! to the broadcast under the publisher's lock, so nothing falls between the two. A
//! connection that falls more than the broadcast's capacity behind gets a new snapshot.
//!
//! The router side, [`follow`]: connects (mTLS), runs a [`Subscriber`], hands each outcome
//! to the caller, asks for a resync when the subscriber says so, expires the agent on
//! silence, and reconnects after a failure with a back-off.

use std::net::SocketAddr;

pub use quinn;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc};

use crate::{decode, encode, Msg, Outcome, Publisher, Reply, Subscriber, Wire, MAX_PREFETCH_KEYS};

/// Largest residency message accepted (a snapshot chunk of 2,048 blocks is about 40 KiB).
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// The agent sends a heartbeat after this long without a delta.
const HEARTBEAT: Duration = Duration::from_millis(500);
/// A router reconnects after this long without a message (three heartbeats missed).
const SILENCE: Duration = Duration::from_millis(1500);
/// Broadcast messages a slow connection may fall behind before it is resynced.
const BACKLOG: usize = 4096;

async fn write_msg(send: &mut quinn::SendStream, w: &Wire) -> Result<(), String> {
    let body = encode(w);
    metrics::counter!(crate::metric_names::RESIDENCY_BYTES_TOTAL).increment(4 + body.len() as u64);
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    send.write_all(&frame).await.map_err(|e| e.to_string())
}

async fn read_msg(recv: &mut quinn::RecvStream) -> Result<Wire, String> {
    let mut len = [0u8; 4];
    recv.read_exact(&mut len).await.map_err(|e| e.to_string())?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(format!(
            "residency message of {len} bytes is over the limit"
        ));
    }
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    decode(&body).map_err(|e| format!("malformed residency message: {e}"))
}

/// QUIC application error code with which an agent closes a router's connection past its
/// `max_routers`.
pub const ROUTERS_FULL: u32 = 2;

/// Serves residency on `endpoint` (a QUIC server endpoint with the agent's mTLS config)
/// until the endpoint closes, to at most `max_routers` routers at once: each agent is meant
/// to be followed by a few routers (record 0111), so its outbound stays bounded however many
/// routers a cluster runs or however they are configured; a router past the bound is closed
/// with [`ROUTERS_FULL`] and counted, and follows again after its back-off.
/// `from_routers` gets each tenant table and prefetch hint a router sends.
pub async fn serve(
    endpoint: quinn::Endpoint,
    residency: Arc<Mutex<Publisher>>,
    changed: Arc<tokio::sync::Notify>,
    from_routers: FromRouters,
    max_routers: usize,
) {
    let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (tx, _) = broadcast::channel::<Arc<Msg>>(BACKLOG);
    {
        let (tx, residency) = (tx.clone(), residency.clone());
        tokio::spawn(async move {
            let mut last_sent = Instant::now();
            loop {
                let _ = tokio::time::timeout(HEARTBEAT, changed.notified()).await;
                let heartbeat = last_sent.elapsed() >= HEARTBEAT;
                // Many changes go out as several deltas, none over what a router reads.
                let next = residency
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .next_all(heartbeat, unix_ms());
                for m in next {
                    last_sent = Instant::now();
                    let _ = tx.send(Arc::new(m));
                }
            }
        });
    }
    while let Some(incoming) = endpoint.accept().await {
        let (tx, residency, from_routers) = (tx.clone(), residency.clone(), from_routers.clone());
        let live = live.clone();
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    // A client without a certificate from the cluster CA ends here.
                    metrics::counter!(crate::metric_names::AGENT_RESIDENCY_REFUSED_TOTAL)
                        .increment(1);
                    tracing::debug!(error = %e, "residency connection refused");
                    return;
                }
            };
            if live.fetch_add(1, Ordering::AcqRel) >= max_routers {
                live.fetch_sub(1, Ordering::AcqRel);
                metrics::counter!(crate::metric_names::AGENT_RESIDENCY_ROUTERS_REFUSED_TOTAL)
                    .increment(1);
                tracing::warn!(
                    max_routers,
                    "a router was refused residency: this agent serves at most {max_routers} routers (--residency-max-routers)"
                );
                conn.close(
                    ROUTERS_FULL.into(),
                    b"this agent serves its maximum number of routers",
                );
                return;
            }
            metrics::gauge!(crate::metric_names::AGENT_RESIDENCY_SUBSCRIBERS).increment(1.0);
            if let Err(e) = session(conn, &tx, &residency, from_routers).await {
                tracing::debug!(error = %e, "residency session ended");
            }
            metrics::gauge!(crate::metric_names::AGENT_RESIDENCY_SUBSCRIBERS).decrement(1.0);
            live.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// The version of the link `conn`'s handshake settled on (its ALPN protocol): 2 where both
/// ends offered [`crate::tls::ALPN_V2`], else 1.
fn link_version(conn: &quinn::Connection) -> u8 {
    let protocol = conn
        .handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|h| h.protocol);
    if protocol.as_deref() == Some(crate::tls::ALPN_V2) {
        2
    } else {
        1
    }
}

async fn session(
    conn: quinn::Connection,
    tx: &broadcast::Sender<Arc<Msg>>,
    residency: &Mutex<Publisher>,
    from_routers: FromRouters,
) -> Result<(), String> {
    let version = link_version(&conn);
    metrics::counter!(
        crate::metric_names::AGENT_RESIDENCY_LINKS_TOTAL,
        "version" => version.to_string()
    )
    .increment(1);
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
    // The first message must be a resync request.
    match tokio::time::timeout(Duration::from_secs(5), read_msg(&mut recv)).await {
        Ok(Ok(Wire::V1Reply(Reply::Resync))) => {}
        Ok(Ok(other)) => return Err(format!("expected a resync request, got {other:?}")),
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err("no resync request in time".into()),
    }
    let (resync_tx, mut resync_rx) = mpsc::channel::<()>(4);
    tokio::spawn(async move {
        loop {
            match read_msg(&mut recv).await {
                Ok(Wire::V1Reply(Reply::Resync)) => {
                    if resync_tx.send(()).await.is_err() {
                        return;
                    }
                }
                // An older router's table, of no version: it never displaces a newer one.
                Ok(Wire::V1Reply(Reply::Tenants(table))) => (from_routers.tenants)(0, table),
                Ok(Wire::V1Reply(Reply::TenantsAt { version, tenants })) => {
                    (from_routers.tenants)(version, tenants)
                }
                Ok(Wire::V1Reply(Reply::Prefetch { instance, mut keys })) => {
                    keys.truncate(MAX_PREFETCH_KEYS);
                    (from_routers.prefetch)(instance, keys);
                }
                _ => return,
            }
        }
    });
    loop {
        // Snapshot and subscription under one lock: the broadcast carries exactly what
        // follows the snapshot (older messages are ignored by the subscriber by sequence).
        let (snapshot, mut rx) = {
            let mut p = residency.lock().unwrap_or_else(|p| p.into_inner());
            for m in p.next_all(false, unix_ms()) {
                let _ = tx.send(Arc::new(m));
            }
            (p.snapshot(), tx.subscribe())
        };
        for m in snapshot {
            write_msg(&mut send, &Wire::V1Msg(m)).await?;
        }
        metrics::counter!(crate::metric_names::AGENT_RESIDENCY_SNAPSHOTS_TOTAL).increment(1);
        loop {
            tokio::select! {
                m = rx.recv() => match m {
                    Ok(m) => write_msg(&mut send, &Wire::for_link((*m).clone(), version)).await?,
                    Err(broadcast::error::RecvError::Lagged(_)) => break,
                    Err(broadcast::error::RecvError::Closed) => return Ok(()),
                },
                r = resync_rx.recv() => match r {
                    Some(()) => break,
                    None => return Ok(()),
                },
            }
        }
    }
}

/// The tenant table a router sends its agents, current and changing.
pub type TenantsWatch = tokio::sync::watch::Receiver<Arc<TenantTable>>;

/// A router's tenant table: (cache salt, tenant id) pairs, and the configuration version
/// they come from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantTable {
    pub version: u64,
    pub tenants: Vec<(String, String)>,
}

/// What an agent does with a tenant table a router sent (its configuration version, and
/// (cache salt, tenant id) pairs). Only a router's certificate reaches it.
pub type OnTenants = Arc<dyn Fn(u64, Vec<(String, String)>) + Send + Sync>;

/// What an agent does with a prefetch hint a router sent (instance, keys in chain order; see
/// [`Reply::Prefetch`]). Called on the link's reader: it must not block.
pub type OnPrefetch = Arc<dyn Fn(String, Vec<u64>) + Send + Sync>;

/// What an agent does with what routers send besides resync requests.
#[derive(Clone)]
pub struct FromRouters {
    pub tenants: OnTenants,
    pub prefetch: OnPrefetch,
}

impl std::fmt::Debug for FromRouters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FromRouters").finish_non_exhaustive()
    }
}

/// Prefetch hints waiting for one agent's link: a link that is down or slow drops hints
/// beyond this many rather than queue stale ones.
const PREFETCH_BACKLOG: usize = 64;

/// Where a router's prefetch hints go: each instance's name to the link of the agent whose
/// snapshot names it. Filled by [`follow`]; cheap to clone (one shared table).
#[derive(Clone, Debug, Default)]
pub struct Prefetchers {
    routes: Arc<Mutex<HashMap<String, Route>>>,
    next_link: Arc<AtomicU64>,
}

/// An instance's prefetch route: the id of the link it goes to, and that link.
type Route = (u64, mpsc::Sender<Reply>);

/// What became of a prefetch hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchSent {
    /// Queued on the agent's link.
    Sent,
    /// No followed agent reports the instance.
    NoAgent,
    /// The agent's link is down or behind: dropped.
    Dropped,
}

impl PrefetchSent {
    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            PrefetchSent::Sent => "sent",
            PrefetchSent::NoAgent => "no_agent",
            PrefetchSent::Dropped => "dropped",
        }
    }
}

impl Prefetchers {
    /// Asks the agent that reports `instance` to promote `keys` (see [`Reply::Prefetch`]).
    /// Never waits.
    pub fn send(&self, instance: &str, keys: Vec<u64>) -> PrefetchSent {
        let link = self
            .routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(instance)
            .map(|(_, tx)| tx.clone());
        let Some(link) = link else {
            return PrefetchSent::NoAgent;
        };
        let instance = instance.to_string();
        match link.try_send(Reply::Prefetch { instance, keys }) {
            Ok(()) => PrefetchSent::Sent,
            Err(_) => PrefetchSent::Dropped,
        }
    }

    /// Routes `instances` to link `id` (and no other instance to it).
    fn route(&self, id: u64, instances: &[String], tx: &mpsc::Sender<Reply>) {
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        routes.retain(|_, (link, _)| *link != id);
        for i in instances {
            routes.insert(i.clone(), (id, tx.clone()));
        }
    }

    /// Routes nothing to link `id`.
    fn unroute(&self, id: u64) {
        self.route(id, &[], &mpsc::channel(1).0);
    }
}

/// One follower's prefetch link: its hints, and the instances its agent reported last.
struct PrefetchLink {
    id: u64,
    prefetchers: Prefetchers,
    tx: mpsc::Sender<Reply>,
    /// Shared by the follower's successive connections; the writer of the one up takes
    /// from it.
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Reply>>>,
    routed: Mutex<Vec<String>>,
}

impl PrefetchLink {
    fn new(prefetchers: Prefetchers) -> PrefetchLink {
        let (tx, rx) = mpsc::channel(PREFETCH_BACKLOG);
        PrefetchLink {
            id: prefetchers.next_link.fetch_add(1, Ordering::Relaxed),
            prefetchers,
            tx,
            rx: Arc::new(tokio::sync::Mutex::new(rx)),
            routed: Mutex::new(Vec::new()),
        }
    }

    /// Follows what the subscriber made of the agent's instances.
    fn observe(&self, outcome: &Outcome) {
        let instances: &[String] = match outcome {
            Outcome::Apply { instances, .. } => instances,
            Outcome::Reset { .. } => &[],
            Outcome::Nothing => return,
        };
        let mut routed = self.routed.lock().unwrap_or_else(|p| p.into_inner());
        if routed.as_slice() != instances {
            self.prefetchers.route(self.id, instances, &self.tx);
            *routed = instances.to_vec();
        }
    }
}

impl Drop for PrefetchLink {
    fn drop(&mut self) {
        self.prefetchers.unroute(self.id);
    }
}

/// Where a router reaches an agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentTarget {
    /// HOST:PORT, resolved at each connection attempt (an agent may move, as a pod does).
    pub address: String,
    /// The name in the agent's certificate.
    pub server_name: String,
}

impl AgentTarget {
    /// One agent's `[NAME@]HOST:PORT` (`[IPV6]:PORT` for an address), parsed by the one
    /// parser of agent addresses (`warmpath_spec::AgentAddress`); a `dns:` entry names
    /// many agents and is refused here (the router resolves it first).
    pub fn parse(target: &str) -> Result<AgentTarget, String> {
        match warmpath_spec::AgentAddress::parse(target) {
            Ok(a) if !a.dns => Ok(AgentTarget::from(a)),
            Ok(_) => Err(format!(
                "agent {target:?}: a dns: entry names every address its host resolves to; give [NAME@]HOST:PORT"
            )),
            Err(e) => Err(format!("agent {target:?}: {e}")),
        }
    }
}

impl From<warmpath_spec::AgentAddress> for AgentTarget {
    fn from(a: warmpath_spec::AgentAddress) -> AgentTarget {
        AgentTarget {
            address: a.address,
            server_name: a.server_name,
        }
    }
}

/// Follows one agent from `endpoint` (a QUIC client endpoint with the router's mTLS
/// config) until `out` is closed or `stop` fires (or its sender is dropped): every outcome
/// of the subscriber goes to `out`. On `stop`, what the agent reported is withdrawn (a
/// last [`Outcome::Reset`]). The instances the agent reports are routed in `prefetchers`
/// to this link while it follows them.
pub async fn follow(
    endpoint: quinn::Endpoint,
    target: AgentTarget,
    expiry: Duration,
    out: mpsc::Sender<Outcome>,
    stop: tokio::sync::oneshot::Receiver<()>,
    tenants: TenantsWatch,
    prefetchers: Prefetchers,
) {
    let prefetch = PrefetchLink::new(prefetchers);
    let start = Instant::now();
    let now_us = move || start.elapsed().as_micros() as u64;
    let subscriber = Arc::new(Mutex::new(Subscriber::new(expiry.as_micros() as u64)));
    // Expiry runs whether or not a connection is up.
    let expiry_task = {
        let (subscriber, out) = (subscriber.clone(), out.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let o = subscriber
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .poll(now_us());
                if o != Outcome::Nothing && out.send(o).await.is_err() {
                    return;
                }
            }
        })
    };
    tokio::select! {
        () = links(&endpoint, &target, &subscriber, &out, now_us, &tenants, &prefetch) => {}
        _ = stop => {}
    }
    expiry_task.abort();
    let last = subscriber
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .forget();
    if last != Outcome::Nothing {
        let _ = out.send(last).await;
    }
}

/// Connects, follows and reconnects with back-off until `out` closes.
async fn links(
    endpoint: &quinn::Endpoint,
    target: &AgentTarget,
    subscriber: &Mutex<Subscriber>,
    out: &mpsc::Sender<Outcome>,
    now_us: impl Fn() -> u64 + Copy,
    tenants: &TenantsWatch,
    prefetch: &PrefetchLink,
) {
    let mut backoff = Duration::from_millis(200);
    loop {
        if out.is_closed() {
            return;
        }
        match run_once(endpoint, target, subscriber, out, now_us, tenants, prefetch).await {
            Ok(()) => return,
            Err(e) => {
                metrics::counter!(crate::metric_names::ROUTER_RESIDENCY_DISCONNECTS_TOTAL)
                    .increment(1);
                tracing::debug!(agent = %target.address, error = %e, "residency link down; reconnecting");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn run_once(
    endpoint: &quinn::Endpoint,
    target: &AgentTarget,
    subscriber: &Mutex<Subscriber>,
    out: &mpsc::Sender<Outcome>,
    now_us: impl Fn() -> u64,
    tenants: &TenantsWatch,
    prefetch: &PrefetchLink,
) -> Result<(), String> {
    let addr = tokio::net::lookup_host(&target.address)
        .await
        .map_err(|e| format!("cannot resolve {}: {e}", target.address))?
        .next()
        .ok_or_else(|| format!("{} resolves to nothing", target.address))?;
    let conn = endpoint
        .connect(addr, &target.server_name)
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    write_msg(&mut send, &Wire::V1Reply(Reply::Resync)).await?;
    // One writer owns the send half: resync requests from the loop below, the tenant
    // table now and at every change, and prefetch hints.
    let (replies, mut to_send) = mpsc::channel::<Reply>(4);
    let mut tenants = tenants.clone();
    tenants.mark_changed();
    let hints = prefetch.rx.clone();
    let writer = tokio::spawn(async move {
        let mut hints = hints.lock().await;
        // A tenant table that can no longer change has been sent: stop watching it (but
        // go on sending the rest).
        let mut tenants_open = true;
        loop {
            let reply = tokio::select! {
                r = to_send.recv() => match r {
                    Some(r) => r,
                    None => return,
                },
                Some(hint) = hints.recv() => hint,
                c = tenants.changed(), if tenants_open => match c {
                    Ok(()) => {
                        let t = tenants.borrow_and_update().clone();
                        Reply::TenantsAt {
                            version: t.version,
                            tenants: t.tenants.clone(),
                        }
                    }
                    Err(_) => {
                        tenants_open = false;
                        continue;
                    }
                },
            };
            if write_msg(&mut send, &Wire::V1Reply(reply)).await.is_err() {
                return;
            }
        }
    });
    let result = read_loop(&mut recv, subscriber, out, now_us, &replies, prefetch).await;
    writer.abort();
    result
}

async fn read_loop(
    recv: &mut quinn::RecvStream,
    subscriber: &Mutex<Subscriber>,
    out: &mpsc::Sender<Outcome>,
    now_us: impl Fn() -> u64,
    replies: &mpsc::Sender<Reply>,
    prefetch: &PrefetchLink,
) -> Result<(), String> {
    loop {
        // The agent sends at least a heartbeat every 500 ms: a longer silence is a dead agent
        // or path (QUIC itself would wait for its idle timeout), so reconnect.
        let msg = tokio::time::timeout(SILENCE, read_msg(recv))
            .await
            .map_err(|_| format!("nothing from the agent for {SILENCE:?}"))??;
        let Some(msg) = msg.into_msg() else {
            return Err("an agent sent a router's message".into());
        };
        let outcome = subscriber
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .handle(now_us(), msg);
        prefetch.observe(&outcome);
        let resync = matches!(outcome, Outcome::Reset { resync: true, .. });
        if outcome != Outcome::Nothing && out.send(outcome).await.is_err() {
            return Ok(());
        }
        if resync {
            metrics::counter!(crate::metric_names::ROUTER_RESIDENCY_RESYNCS_TOTAL).increment(1);
            replies
                .send(Reply::Resync)
                .await
                .map_err(|_| "the residency link closed".to_string())?;
        }
    }
}

/// Wall-clock Unix milliseconds (deltas carry their send time).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A QUIC endpoint bound to `bind` for clients (routers) or, with `server`, for an agent.
pub fn endpoint(
    bind: SocketAddr,
    server: Option<quinn::ServerConfig>,
    client: Option<quinn::ClientConfig>,
) -> Result<quinn::Endpoint, String> {
    // Keep-alives and a short idle timeout: a dead peer is noticed in seconds, not QUIC's
    // default half minute.
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(Some(Duration::from_secs(1)));
    transport.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        5_000,
    ))));
    let transport = Arc::new(transport);
    let server = server.map(|mut s| {
        s.transport_config(transport.clone());
        s
    });
    let client = client.map(|mut c| {
        c.transport_config(transport.clone());
        c
    });
    let mut e = match server {
        Some(s) => quinn::Endpoint::server(s, bind),
        None => quinn::Endpoint::client(bind),
    }
    .map_err(|e| format!("cannot open a QUIC endpoint on {bind}: {e}"))?;
    if let Some(c) = client {
        e.set_default_client_config(c);
    }
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::AgentTarget;

    #[test]
    fn an_agent_target_names_its_certificate_by_host_or_by_a_given_name() {
        let by_host = AgentTarget::parse("gpu-7.example:7700").unwrap();
        assert_eq!(by_host.address, "gpu-7.example:7700");
        assert_eq!(by_host.server_name, "gpu-7.example");
        let v6 = AgentTarget::parse("[::1]:7700").unwrap();
        assert_eq!(
            (v6.address.as_str(), v6.server_name.as_str()),
            ("[::1]:7700", "::1")
        );
        let named = AgentTarget::parse("agent@10.0.3.17:7700").unwrap();
        assert_eq!(named.address, "10.0.3.17:7700");
        assert_eq!(named.server_name, "agent");
        for bad in [
            "10.0.3.17",
            "@10.0.3.17:7700",
            "agent@:7700",
            "agent@h:0",
            "h:x",
        ] {
            let e = AgentTarget::parse(bad).unwrap_err();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }
}
