//! The engines' side of the block API: an async, pipelined client over TCP or a Unix socket.
//!
//! One connection carries many requests at once: each call gets a request id, its frame is
//! queued to a writer task, and a reader task hands each answer to the call waiting on its
//! id. When the connection dies every waiting call fails with [`ClientError::Closed`] and
//! the client stays dead; [`AgentLink`] reconnects for engines that must never stop on it.
//! Payloads a get returns are checked against their checksums here: a block whose bytes
//! do not match is reported missing, never handed to the engine.
//!
//! On a Unix socket to an agent of version 3 or later, puts whose blocks are all of at least
//! [`SEALED_MIN_BYTES`] go as sealed memfds, and gets are sealed gets, whose blocks L1 holds
//! as memfds come back as them (`sealed.rs`, record 0120): one copy each way instead of two
//! through the socket. [`AgentClient::without_sealed`] turns that off (the benchmark's copy
//! rows).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use crate::block::Block;
use crate::pool::BufPool;
use crate::proto::{
    self, AgentStats, ErrorKind, GotBlock, Outgoing, ProtoError, PutItem, PutRefusal, Request,
    Response, StoreTier,
};
use crate::sealed::{FdStream, Fds, Sealed, MAX_FDS_PER_FRAME, SEALED_MIN_BYTES};
use crate::server::{read_body, write_frames, READ_BUFFER_BYTES};

/// Idle buffers a client keeps for the payloads gets bring back (see [`crate::pool`]).
pub const CLIENT_POOL_BYTES: u64 = 64 << 20;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("agent connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("agent handshake refused: {0}")]
    Refused(String),
    #[error("agent speaks protocol version {agent}: {message}")]
    Version { agent: u16, message: String },
    #[error("agent protocol: {0}")]
    Proto(#[from] ProtoError),
    #[error("agent connection closed")]
    Closed,
    #[error("agent answered {kind:?}: {message}")]
    Agent { kind: ErrorKind, message: String },
    #[error("agent answered {0} where {1} was expected")]
    Unexpected(&'static str, &'static str),
    #[error("agent did not answer within {0:?}")]
    Timeout(Duration),
}

/// Where an agent listens: `unix:PATH`, or `HOST:PORT` for TCP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentAddr {
    Tcp(String),
    Unix(std::path::PathBuf),
}

impl std::str::FromStr for AgentAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.strip_prefix("unix:") {
            Some(p) if !p.is_empty() => Ok(AgentAddr::Unix(p.into())),
            Some(_) => Err("unix: needs a path".into()),
            None if s.contains(':') => Ok(AgentAddr::Tcp(s.to_string())),
            None => Err(format!("{s:?} is not HOST:PORT or unix:PATH")),
        }
    }
}

impl std::fmt::Display for AgentAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentAddr::Tcp(a) => write!(f, "{a}"),
            AgentAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// An answer: its header, the payloads that followed it, the descriptors that came with it.
type Answer = Result<(Response, Vec<Block>, Vec<std::os::fd::OwnedFd>), ClientError>;
type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Answer>>>>;

/// A connection to an agent.
#[derive(Debug)]
pub struct AgentClient {
    tx: mpsc::Sender<Outgoing>,
    waiters: Waiters,
    next_id: AtomicU64,
    timeout: Duration,
    /// Set when the reader saw the connection end, or a call went unanswered past its
    /// deadline (a stalled agent: later calls go elsewhere at once instead of waiting too).
    closed: Arc<AtomicBool>,
    /// The connection's reader and writer tasks, ended with the client: a writer blocked on
    /// an agent that stopped reading must not outlive the client that gave up on it.
    tasks: [tokio::task::AbortHandle; 2],
    /// Whether puts and gets go as sealed memfds (a Unix socket to an agent of version 3).
    sealed: bool,
    /// Buffers for the payloads gets bring back (see [`crate::pool`]).
    pool: BufPool,
}

impl Drop for AgentClient {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A block a get returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    pub payload: Bytes,
    pub tier: StoreTier,
}

/// What a put did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutResult {
    pub stored: u32,
    pub refused: Vec<(u32, PutRefusal)>,
}

impl AgentClient {
    /// Connects and shakes hands; `token` is sent as the agent's token (empty: none). An
    /// agent of an older version refuses this build's and says its own: the client connects
    /// again speaking that one (and so sends no sealed blocks), so that engines may be
    /// upgraded before their agents.
    pub async fn connect(
        addr: &AgentAddr,
        token: &str,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let attempt = |version: u16| async move {
            match addr {
                AgentAddr::Tcp(a) => {
                    let s = tokio::net::TcpStream::connect(a).await?;
                    s.set_nodelay(true)?;
                    Self::handshake(s, token, timeout, None, version).await
                }
                AgentAddr::Unix(p) => {
                    let (s, fds) = FdStream::new(tokio::net::UnixStream::connect(p).await?);
                    Self::handshake(s, token, timeout, Some(fds), version).await
                }
            }
        };
        let deadline = tokio::time::timeout(timeout, async {
            match attempt(proto::VERSION).await {
                Err(ClientError::Version { agent, .. })
                    if (proto::MIN_VERSION..proto::VERSION).contains(&agent) =>
                {
                    attempt(agent).await
                }
                other => other,
            }
        });
        deadline.await.map_err(|_| ClientError::Timeout(timeout))?
    }

    /// Sends puts and gets through the socket even where sealed memfds could carry them.
    pub fn without_sealed(mut self) -> Self {
        self.sealed = false;
        self
    }

    /// Whether puts and gets go as sealed memfds.
    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    async fn handshake<S>(
        mut s: S,
        token: &str,
        timeout: Duration,
        fds: Option<Arc<Fds>>,
        speak: u16,
    ) -> Result<Self, ClientError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        s.write_all(&proto::encode_hello_version(token.as_bytes(), speak)?)
            .await?;
        let mut prefix = [0u8; 9];
        s.read_exact(&mut prefix).await?;
        let (version, status, len) = proto::decode_welcome_prefix(&prefix)?;
        let mut msg = vec![0u8; len];
        s.read_exact(&mut msg).await?;
        let message = String::from_utf8_lossy(&msg).into_owned();
        if status == proto::HELLO_VERSION {
            return Err(ClientError::Version {
                agent: version,
                message,
            });
        }
        if status != proto::HELLO_OK {
            return Err(ClientError::Refused(message));
        }
        // Sealed blocks need the Unix socket and an agent and a connection of version 3.
        let fds = fds.filter(|_| version.min(speak) >= proto::SEALED_VERSION);
        Ok(Self::start(s, timeout, fds))
    }

    fn start<S>(s: S, timeout: Duration, fds: Option<Arc<Fds>>) -> Self
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (rd, wr) = tokio::io::split(s);
        let (tx, rx) = mpsc::channel::<Outgoing>(256);
        let waiters: Waiters = Arc::default();
        let writer = tokio::spawn(write_frames(wr, rx, fds.clone()));
        let w = waiters.clone();
        let closed = Arc::new(AtomicBool::new(false));
        let closed_by_reader = closed.clone();
        let pool = BufPool::new(CLIENT_POOL_BYTES);
        let sealed = fds.is_some();
        let reader_pool = pool.clone();
        let reader = tokio::spawn(async move {
            let pool = reader_pool;
            let limit = u64::from(u32::MAX);
            let mut rd = tokio::io::BufReader::with_capacity(READ_BUFFER_BYTES, rd);
            let get_lens = |r: &Response| match r {
                Response::Get { blocks } => {
                    Some(blocks.iter().flatten().map(|b| b.bytes).collect())
                }
                Response::GetSealed { blocks } => Some(
                    blocks
                        .iter()
                        .flatten()
                        .filter(|(_, sealed)| !sealed)
                        .map(|(b, _)| b.bytes)
                        .collect(),
                ),
                _ => None,
            };
            loop {
                let mut len = [0u8; 4];
                if rd.read_exact(&mut len).await.is_err() {
                    break;
                }
                let Ok(len) = proto::frame_len(len, limit) else {
                    break;
                };
                let Ok(frame) = read_body::<_, Response>(&mut rd, len, &pool, get_lens).await
                else {
                    break;
                };
                let id = frame.id;
                let answer = match frame.header {
                    // Its found blocks' descriptors came with the frame's first byte.
                    Ok(Response::GetSealed { blocks }) => {
                        let n = blocks
                            .iter()
                            .flatten()
                            .filter(|(_, sealed)| *sealed)
                            .count();
                        let Some(got) = fds.as_ref().and_then(|f| f.take(n)) else {
                            break;
                        };
                        Ok((
                            Response::GetSealed { blocks },
                            frame.payloads,
                            got.split().0,
                        ))
                    }
                    Ok(h) => Ok((h, frame.payloads, Vec::new())),
                    Err(e) => Err(ClientError::from(e)),
                };
                let waiter = w.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(answer);
                    }
                    // An answer to id 0 is the agent's last word before it closes.
                    None => {
                        if let Ok((Response::Error { kind, message }, _, _)) = answer {
                            tracing::warn!(?kind, %message, "agent closed the connection");
                        }
                    }
                }
            }
            // Dead: fail everything still waiting.
            closed_by_reader.store(true, Ordering::Release);
            let pending: Vec<_> = w
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .drain()
                .collect();
            for (_, tx) in pending {
                let _ = tx.send(Err(ClientError::Closed));
            }
        });
        AgentClient {
            tx,
            waiters,
            next_id: AtomicU64::new(1),
            timeout,
            closed,
            tasks: [writer.abort_handle(), reader.abort_handle()],
            sealed,
            pool,
        }
    }

    /// Whether the connection can still carry calls.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed() || self.closed.load(Ordering::Acquire)
    }

    async fn call(&self, request: &Request, payloads: Vec<Bytes>) -> Answer {
        self.call_with(request, payloads, Vec::new()).await
    }

    /// A call whose frame carries `fds` (sealed blocks; Unix socket only).
    async fn call_with(
        &self,
        request: &Request,
        payloads: Vec<Bytes>,
        fds: Vec<Arc<Sealed>>,
    ) -> Answer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, tx);
        let mut out = proto::encode_frame(id, request, payloads);
        out.fds = fds;
        // One deadline for queueing the frame and for its answer: a stalled agent fills the
        // socket and then the queue, and a call must not wait on that longer than on a reply.
        let answer = tokio::time::timeout(self.timeout, async {
            if self.tx.send(out).await.is_err() {
                return Err(ClientError::Closed);
            }
            rx.await.unwrap_or(Err(ClientError::Closed))
        })
        .await
        .unwrap_or_else(|_| {
            self.closed.store(true, Ordering::Release);
            Err(ClientError::Timeout(self.timeout))
        });
        if answer.is_err() {
            self.waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
        match answer? {
            (Response::Error { kind, message }, _, _) => Err(ClientError::Agent { kind, message }),
            ok => Ok(ok),
        }
    }

    /// Stores blocks `(key, payload, pin)` of `layout`.
    pub async fn put(
        &self,
        layout: u64,
        blocks: Vec<(u64, Bytes, bool)>,
    ) -> Result<PutResult, ClientError> {
        let items = blocks
            .iter()
            .map(|(key, p, pin)| PutItem {
                key: *key,
                bytes: p.len() as u32,
                pin: *pin,
            })
            .collect();
        let payloads: Vec<Bytes> = blocks.into_iter().map(|(_, p, _)| p).collect();
        let sealed = self.sealed
            && payloads.len() <= MAX_FDS_PER_FRAME
            && payloads.iter().all(|p| p.len() >= SEALED_MIN_BYTES);
        // Each payload copied once, into a memfd sealed here; where that fails (no memfd
        // left, say), the put goes through the socket.
        let memfds = if sealed {
            let bytes = payloads.iter().map(Bytes::len).sum();
            blocking(bytes, || {
                payloads
                    .iter()
                    .map(|p| Sealed::copy_of(p).map(Arc::new))
                    .collect::<std::io::Result<Vec<_>>>()
            })
            .ok()
        } else {
            None
        };
        let answer = match memfds {
            Some(fds) => {
                self.call_with(
                    &Request::PutSealed {
                        layout,
                        blocks: items,
                    },
                    Vec::new(),
                    fds,
                )
                .await?
            }
            None => {
                self.call(
                    &Request::Put {
                        layout,
                        blocks: items,
                    },
                    payloads,
                )
                .await?
            }
        };
        match answer {
            (Response::Put { stored, refused }, _, _) => Ok(PutResult { stored, refused }),
            (other, _, _) => Err(unexpected(&other, "Put")),
        }
    }

    /// The leading available blocks of a chain and their tiers, the L1 ones leased.
    pub async fn lookup(
        &self,
        layout: u64,
        keys: Vec<u64>,
        lease: Duration,
    ) -> Result<(u64, Vec<StoreTier>), ClientError> {
        let lease_ms = lease.as_millis().min(u32::MAX as u128) as u32;
        match self
            .call(
                &Request::Lookup {
                    layout,
                    keys,
                    lease_ms,
                },
                Vec::new(),
            )
            .await?
        {
            (Response::Lookup { lease, tiers }, _, _) => Ok((lease, tiers)),
            (other, _, _) => Err(unexpected(&other, "Lookup")),
        }
    }

    /// The blocks of `keys`, each checked against its checksum (a mismatch is a miss).
    pub async fn get(
        &self,
        layout: u64,
        keys: Vec<u64>,
    ) -> Result<Vec<Option<Fetched>>, ClientError> {
        let request = if self.sealed && keys.len() <= MAX_FDS_PER_FRAME {
            Request::GetSealed { layout, keys }
        } else {
            Request::Get { layout, keys }
        };
        let (blocks, payloads) = match self.call(&request, Vec::new()).await? {
            (Response::Get { blocks }, payloads, _) => (blocks, payloads),
            // Each found block's descriptor, read here (the calls in flight read at once,
            // not one after another in the reader), as sealed: not checksummed again.
            (Response::GetSealed { blocks }, inline, fds) => {
                let bytes = blocks.iter().flatten().map(|(b, _)| b.bytes as usize).sum();
                let read = blocking(bytes, || {
                    let (mut inline, mut fds) = (inline.into_iter(), fds.into_iter());
                    let mut payloads = Vec::new();
                    for (b, sealed) in blocks.iter().flatten() {
                        let part = if *sealed {
                            fds.next().map(|fd| read_sealed(fd, b, &self.pool))
                        } else {
                            inline.next()
                        };
                        payloads.extend(part);
                    }
                    payloads
                });
                (
                    blocks.into_iter().map(|b| b.map(|(b, _)| b)).collect(),
                    read,
                )
            }
            (other, _, _) => return Err(unexpected(&other, "Get")),
        };
        // The reader read each payload into its own buffer and checksummed it on arrival.
        let mut parts = payloads.into_iter();
        Ok(blocks
            .into_iter()
            .map(|b| {
                let b = b?;
                let part = parts.next()?;
                (part.checksum == b.checksum).then_some(Fetched {
                    payload: part.payload,
                    tier: b.tier,
                })
            })
            .collect())
    }

    pub async fn release(&self, lease: u64) -> Result<u32, ClientError> {
        match self.call(&Request::Release { lease }, Vec::new()).await? {
            (Response::Released { blocks }, _, _) => Ok(blocks),
            (other, _, _) => Err(unexpected(&other, "Released")),
        }
    }

    pub async fn unpin(&self, layout: u64, keys: Vec<u64>) -> Result<u32, ClientError> {
        match self
            .call(&Request::Unpin { layout, keys }, Vec::new())
            .await?
        {
            (Response::Unpinned { blocks }, _, _) => Ok(blocks),
            (other, _, _) => Err(unexpected(&other, "Unpinned")),
        }
    }

    pub async fn stats(&self) -> Result<AgentStats, ClientError> {
        match self.call(&Request::Stats, Vec::new()).await? {
            (Response::Stats(s), _, _) => Ok(s),
            (other, _, _) => Err(unexpected(&other, "Stats")),
        }
    }
}

/// Bytes of sealed copies or reads a call makes in place; past it, its worker hands its
/// other tasks on first. About half a millisecond of `pwrite` here: handing off costs a
/// thread wake-up, which measured 10–20% of a 1 MiB put's throughput (BENCHMARKS.md).
const IN_PLACE_BYTES: usize = 2 << 20;

/// Runs `f`, `bytes` of `pwrite` or `pread` (milliseconds for a 16 MiB block), so that it
/// blocks no other task for long: past [`IN_PLACE_BYTES`] on a multi-threaded runtime the
/// worker hands its other tasks on first (`block_in_place`); else, or on a current-thread
/// runtime (no other worker to hand them to), in place.
fn blocking<T>(bytes: usize, f: impl FnOnce() -> T) -> T {
    let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
    match flavor {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) if bytes > IN_PLACE_BYTES => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// A sealed block a get's answer passed, read once into a buffer from `pool`. Sealed bytes
/// are the bytes that were sealed (nobody can write them), so they are not checksummed
/// again; one that is not what the agent announced (not sealed, another length, a read
/// error) comes back with a checksum that cannot match: a miss, as a damaged block over the
/// socket is.
fn read_sealed(fd: std::os::fd::OwnedFd, b: &GotBlock, pool: &BufPool) -> Block {
    match Sealed::received(fd, u64::from(b.bytes)).and_then(|s| s.read(pool)) {
        Ok(payload) => Block {
            payload,
            checksum: b.checksum,
        },
        Err(e) => {
            tracing::warn!(error = %e, "a sealed block from the agent could not be read");
            Block {
                payload: Bytes::new(),
                checksum: !b.checksum,
            }
        }
    }
}

fn unexpected(r: &Response, want: &'static str) -> ClientError {
    let got = match r {
        Response::Put { .. } => "Put",
        Response::Lookup { .. } => "Lookup",
        Response::Get { .. } => "Get",
        Response::Released { .. } => "Released",
        Response::Unpinned { .. } => "Unpinned",
        Response::Stats(_) => "Stats",
        Response::Error { .. } => "Error",
        Response::GetSealed { .. } => "GetSealed",
    };
    ClientError::Unexpected(got, want)
}

/// A client that reconnects: an engine holds one per agent and never fails or waits on it.
/// While there is no live connection, [`AgentLink::client`] answers None at once and, at
/// most once per `retry` interval, starts a connection attempt in the background; a call
/// waits only on a connection that was live when it started, and at most its deadline.
#[derive(Debug)]
pub struct AgentLink {
    addr: AgentAddr,
    token: String,
    timeout: Duration,
    retry: Duration,
    state: Arc<Mutex<LinkState>>,
}

#[derive(Debug, Default)]
struct LinkState {
    client: Option<Arc<AgentClient>>,
    last_try: Option<Instant>,
    connecting: bool,
}

impl AgentLink {
    pub fn new(addr: AgentAddr, token: String, timeout: Duration) -> Self {
        AgentLink {
            addr,
            token,
            timeout,
            retry: Duration::from_millis(500),
            state: Arc::default(),
        }
    }

    pub fn addr(&self) -> &AgentAddr {
        &self.addr
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live client, or None at once (starting a connection attempt if it is time to
    /// try; call inside a tokio runtime).
    pub fn client(&self) -> Option<Arc<AgentClient>> {
        let mut st = self.lock();
        if let Some(c) = &st.client {
            if !c.is_closed() {
                return Some(c.clone());
            }
            st.client = None;
        }
        if st.connecting || st.last_try.is_some_and(|t| t.elapsed() < self.retry) {
            return None;
        }
        st.last_try = Some(Instant::now());
        st.connecting = true;
        let (addr, token, timeout) = (self.addr.clone(), self.token.clone(), self.timeout);
        let state = self.state.clone();
        tokio::spawn(async move {
            let got = AgentClient::connect(&addr, &token, timeout).await;
            let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
            st.connecting = false;
            match got {
                Ok(c) => {
                    tracing::info!(agent = %addr, "connected to the cache agent");
                    st.client = Some(Arc::new(c));
                }
                Err(e) => tracing::debug!(agent = %addr, error = %e, "cache agent unreachable"),
            }
        });
        None
    }

    /// The live client, waiting up to `within` for it while the link connects again (for a
    /// background task that may wait, as an engine's offloads; an engine's own calls take
    /// [`AgentLink::client`]'s answer at once).
    pub async fn client_within(&self, within: Duration) -> Option<Arc<AgentClient>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(client) = self.client() {
                return Some(client);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Drops the current connection (after a call failed on it).
    pub fn reset(&self) {
        self.lock().client = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent of version 2 (hand-written: it refuses any other version, saying its own, as
    /// such an agent does) and an engine of this build: the client connects again speaking
    /// version 2, sends no sealed blocks on the Unix socket, and its calls work.
    #[test]
    fn a_client_speaks_an_older_agents_version() {
        crate::test_runtime().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("v2.sock");
            let listener = tokio::net::UnixListener::bind(&path).unwrap();
            let agent = tokio::spawn(async move {
                let mut versions = Vec::new();
                loop {
                    let (mut s, _) = listener.accept().await.unwrap();
                    let mut prefix = [0u8; 8];
                    s.read_exact(&mut prefix).await.unwrap();
                    let (version, token_len) = proto::decode_hello_prefix(&prefix).unwrap();
                    let mut token = vec![0u8; token_len];
                    s.read_exact(&mut token).await.unwrap();
                    versions.push(version);
                    let welcome = |status, msg: &str| {
                        let mut w = proto::encode_welcome(status, msg);
                        w[4..6].copy_from_slice(&2u16.to_le_bytes());
                        w
                    };
                    if version != 2 {
                        let refusal = welcome(proto::HELLO_VERSION, "this agent speaks 2");
                        s.write_all(&refusal).await.unwrap();
                        continue;
                    }
                    s.write_all(&welcome(proto::HELLO_OK, "")).await.unwrap();
                    // One Stats call, answered as a version-2 agent answers it.
                    let mut len = [0u8; 4];
                    s.read_exact(&mut len).await.unwrap();
                    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
                    s.read_exact(&mut body).await.unwrap();
                    let frame = proto::decode_body::<Request>(Bytes::from(body)).unwrap();
                    assert_eq!(frame.header, Request::Stats);
                    let answer = proto::encode_frame(
                        frame.id,
                        &Response::Stats(AgentStats::default()),
                        Vec::new(),
                    );
                    s.write_all(&answer.head).await.unwrap();
                    return versions;
                }
            });
            let c = AgentClient::connect(&AgentAddr::Unix(path), "", Duration::from_secs(5))
                .await
                .unwrap();
            assert!(!c.is_sealed(), "no sealed blocks to a version-2 agent");
            assert_eq!(c.stats().await.unwrap(), AgentStats::default());
            assert_eq!(agent.await.unwrap(), vec![proto::VERSION, 2]);
        });
    }
}
