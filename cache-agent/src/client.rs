//! The engines' side of the block API: an async, pipelined client over TCP or a Unix socket.
//!
//! One connection carries many requests at once: each call gets a request id, its frame is
//! queued to a writer task, and a reader task hands each answer to the call waiting on its
//! id. When the connection dies every waiting call fails with [`ClientError::Closed`] and
//! the client stays dead; [`AgentLink`] reconnects for engines that must never stop on it.
//! Payloads a get returns are checked against their checksums here: a block whose bytes
//! do not match is reported missing, never handed to the engine.

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
    self, AgentStats, ErrorKind, Outgoing, ProtoError, PutItem, PutRefusal, Request, Response,
    StoreTier,
};
use crate::server::{read_body, write_frame, READ_BUFFER_BYTES};

/// Idle buffers a client keeps for the payloads gets bring back (see [`crate::pool`]).
pub const CLIENT_POOL_BYTES: u64 = 64 << 20;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("agent connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("agent handshake refused: {0}")]
    Refused(String),
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

type Answer = Result<(Response, Vec<Block>), ClientError>;
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
    /// Connects and shakes hands; `token` is sent as the agent's token (empty: none).
    pub async fn connect(
        addr: &AgentAddr,
        token: &str,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let deadline = tokio::time::timeout(timeout, async {
            match addr {
                AgentAddr::Tcp(a) => {
                    let s = tokio::net::TcpStream::connect(a).await?;
                    s.set_nodelay(true)?;
                    Self::handshake(s, token, timeout).await
                }
                AgentAddr::Unix(p) => {
                    let s = tokio::net::UnixStream::connect(p).await?;
                    Self::handshake(s, token, timeout).await
                }
            }
        });
        deadline.await.map_err(|_| ClientError::Timeout(timeout))?
    }

    async fn handshake<S>(mut s: S, token: &str, timeout: Duration) -> Result<Self, ClientError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        s.write_all(&proto::encode_hello(token.as_bytes())?).await?;
        let mut prefix = [0u8; 9];
        s.read_exact(&mut prefix).await?;
        let (_version, status, len) = proto::decode_welcome_prefix(&prefix)?;
        let mut msg = vec![0u8; len];
        s.read_exact(&mut msg).await?;
        if status != proto::HELLO_OK {
            return Err(ClientError::Refused(
                String::from_utf8_lossy(&msg).into_owned(),
            ));
        }
        Ok(Self::start(s, timeout))
    }

    fn start<S>(s: S, timeout: Duration) -> Self
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (rd, mut wr) = tokio::io::split(s);
        let (tx, mut rx) = mpsc::channel::<Outgoing>(256);
        let waiters: Waiters = Arc::default();
        let writer = tokio::spawn(async move {
            while let Some(out) = rx.recv().await {
                if write_frame(&mut wr, &out).await.is_err() {
                    return;
                }
                if rx.is_empty() && wr.flush().await.is_err() {
                    return;
                }
            }
        });
        let w = waiters.clone();
        let closed = Arc::new(AtomicBool::new(false));
        let closed_by_reader = closed.clone();
        let pool = BufPool::new(CLIENT_POOL_BYTES);
        let reader = tokio::spawn(async move {
            let limit = u64::from(u32::MAX);
            let mut rd = tokio::io::BufReader::with_capacity(READ_BUFFER_BYTES, rd);
            let get_lens = |r: &Response| match r {
                Response::Get { blocks } => {
                    Some(blocks.iter().flatten().map(|b| b.bytes).collect())
                }
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
                let answer = frame
                    .header
                    .map(|h| (h, frame.payloads))
                    .map_err(ClientError::from);
                let waiter = w.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(answer);
                    }
                    // An answer to id 0 is the agent's last word before it closes.
                    None => {
                        if let Ok((Response::Error { kind, message }, _)) = answer {
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
        }
    }

    /// Whether the connection can still carry calls.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed() || self.closed.load(Ordering::Acquire)
    }

    async fn call(&self, request: &Request, payloads: Vec<Bytes>) -> Answer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, tx);
        let out = proto::encode_frame(id, request, payloads);
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
            (Response::Error { kind, message }, _) => Err(ClientError::Agent { kind, message }),
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
        let payloads = blocks.into_iter().map(|(_, p, _)| p).collect();
        match self
            .call(
                &Request::Put {
                    layout,
                    blocks: items,
                },
                payloads,
            )
            .await?
        {
            (Response::Put { stored, refused }, _) => Ok(PutResult { stored, refused }),
            (other, _) => Err(unexpected(&other, "Put")),
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
            (Response::Lookup { lease, tiers }, _) => Ok((lease, tiers)),
            (other, _) => Err(unexpected(&other, "Lookup")),
        }
    }

    /// The blocks of `keys`, each checked against its checksum (a mismatch is a miss).
    pub async fn get(
        &self,
        layout: u64,
        keys: Vec<u64>,
    ) -> Result<Vec<Option<Fetched>>, ClientError> {
        let (blocks, payloads) = match self
            .call(&Request::Get { layout, keys }, Vec::new())
            .await?
        {
            (Response::Get { blocks }, payloads) => (blocks, payloads),
            (other, _) => return Err(unexpected(&other, "Get")),
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
            (Response::Released { blocks }, _) => Ok(blocks),
            (other, _) => Err(unexpected(&other, "Released")),
        }
    }

    pub async fn unpin(&self, layout: u64, keys: Vec<u64>) -> Result<u32, ClientError> {
        match self
            .call(&Request::Unpin { layout, keys }, Vec::new())
            .await?
        {
            (Response::Unpinned { blocks }, _) => Ok(blocks),
            (other, _) => Err(unexpected(&other, "Unpinned")),
        }
    }

    pub async fn stats(&self) -> Result<AgentStats, ClientError> {
        match self.call(&Request::Stats, Vec::new()).await? {
            (Response::Stats(s), _) => Ok(s),
            (other, _) => Err(unexpected(&other, "Stats")),
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

    /// Drops the current connection (after a call failed on it).
    pub fn reset(&self) {
        self.lock().client = None;
    }
}
