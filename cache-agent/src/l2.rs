//! L2: the remote tier shared by every host, behind one trait, [`L2Backend`].
//!
//! Backends store self-checking objects (`block.rs`) and return them raw; the agent checks
//! them, so a backend never decides what is served. Two backends:
//!
//! - [`DirL2`], the embedded default: a directory on local disk or a shared filesystem
//!   mount. A write goes to a temporary file in the same directory tree, then is renamed
//!   into place, so a reader sees a whole object or none (a crash leaves only temporary
//!   files, removed at the next start). Bounded in bytes with LRU by this agent's own
//!   ledger (the same policy code as L1); on a shared mount each agent bounds what it wrote
//!   and read, so give each agent its share of the volume. Objects other agents wrote are
//!   found by path and adopted into the ledger when read.
//! - [`RedisL2`]: a Redis or Valkey server, spoken to by our own small client (`resp.rs`,
//!   [record 0099](../../docs/decisions/0099-own-redis-client-for-l2.md)): a `SET` is one
//!   vectored write of the command's head, the object's header and the payload as L1 holds
//!   it, a `GET` reads the object straight into a buffer of its own. A pool of connections,
//!   one per operation in flight; a connection that died while idle (Redis restarted) is
//!   replaced on its next use. Bounded by the server's own `maxmemory` and eviction policy
//!   (`allkeys-lru` is what an operator wants here). At most 32 operations run at once (a
//!   get of a long chain waits its turn rather than opening a connection per block). Each
//!   operation has a deadline; after a failure to reach the server (or a refusal), or three
//!   deadline misses in a row, the backend answers "unavailable" at once for a back-off
//!   period instead of waiting on a dead server again, so a Redis outage costs errors,
//!   counted, and never a stalled engine, while one late answer costs only its operation.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

use tokio::io::AsyncWriteExt;

use crate::block::{encode_object, object_header, Block, HEADER_BYTES};
use crate::resp::{self, Reply, RespError};
use warmpath_tiers::{BlockId, Eviction, Ledger};

/// Why an L2 operation failed (a miss is not a failure).
#[derive(Debug, thiserror::Error)]
pub enum L2Error {
    #[error("l2 i/o: {0}")]
    Io(#[from] io::Error),
    #[error("l2 redis: {0}")]
    Redis(String),
    #[error("l2 unavailable after a recent failure (retrying in {0:?})")]
    Backoff(Duration),
    #[error("l2 object of {0} bytes does not fit the store's bound")]
    TooLarge(u64),
}

/// A remote tier holding self-checking objects by block id.
pub trait L2Backend: Send + Sync + 'static {
    /// Stores `object` (an encoded block) under `id`, replacing what was there. Answers
    /// the blocks this store evicted to make room, as far as it knows (Redis evicts by
    /// itself and tells nobody: none).
    fn put(
        &self,
        id: BlockId,
        object: Bytes,
    ) -> impl Future<Output = Result<Vec<BlockId>, L2Error>> + Send;
    /// Stores `block` under `id` as its self-checking object (`block.rs`). A backend that
    /// can send the object's header and payload without joining them in a new buffer first
    /// overrides this (Redis: one copy fewer of every block written).
    fn put_block(
        &self,
        id: BlockId,
        block: &Block,
    ) -> impl Future<Output = Result<Vec<BlockId>, L2Error>> + Send {
        self.put(id, encode_object(&id, block))
    }
    /// The object stored under `id`, if any.
    fn get(&self, id: BlockId) -> impl Future<Output = Result<Option<Bytes>, L2Error>> + Send;
    /// Whether each of `ids` is stored (one round trip where the backend allows).
    fn contains(&self, ids: &[BlockId]) -> impl Future<Output = Result<Vec<bool>, L2Error>> + Send;
    /// Drops what is stored under `id` (a damaged object, say).
    fn remove(&self, id: BlockId) -> impl Future<Output = Result<(), L2Error>> + Send;
    /// A short name for logs and metrics.
    fn name(&self) -> &'static str;
}

/// The backends an agent may run, chosen by configuration.
#[derive(Debug)]
pub enum AnyL2 {
    Dir(Box<DirL2>),
    Redis(Box<RedisL2>),
}

impl AnyL2 {
    /// Stores `block` under `id`: sealed under the cluster key and signed by the writer
    /// (decision 0106) when `seal` is given, as its plain self-checking object otherwise.
    /// Every L2 writer of the agent (its tiers, the HyperPod store) writes through here.
    pub async fn put_block_sealed(
        &self,
        id: BlockId,
        block: &Block,
        seal: Option<&(crate::block::SealKey, u64)>,
    ) -> Result<Vec<BlockId>, L2Error> {
        match seal {
            Some((key, writer)) => {
                self.put(id, crate::block::encode_sealed(&id, block, key, *writer))
                    .await
            }
            None => self.put_block(id, block).await,
        }
    }
}

impl L2Backend for AnyL2 {
    async fn put(&self, id: BlockId, object: Bytes) -> Result<Vec<BlockId>, L2Error> {
        match self {
            AnyL2::Dir(b) => b.put(id, object).await,
            AnyL2::Redis(b) => b.put(id, object).await,
        }
    }
    async fn put_block(&self, id: BlockId, block: &Block) -> Result<Vec<BlockId>, L2Error> {
        match self {
            AnyL2::Dir(b) => b.put_block(id, block).await,
            AnyL2::Redis(b) => b.put_block(id, block).await,
        }
    }
    async fn get(&self, id: BlockId) -> Result<Option<Bytes>, L2Error> {
        match self {
            AnyL2::Dir(b) => b.get(id).await,
            AnyL2::Redis(b) => b.get(id).await,
        }
    }
    async fn contains(&self, ids: &[BlockId]) -> Result<Vec<bool>, L2Error> {
        match self {
            AnyL2::Dir(b) => b.contains(ids).await,
            AnyL2::Redis(b) => b.contains(ids).await,
        }
    }
    async fn remove(&self, id: BlockId) -> Result<(), L2Error> {
        match self {
            AnyL2::Dir(b) => b.remove(id).await,
            AnyL2::Redis(b) => b.remove(id).await,
        }
    }
    fn name(&self) -> &'static str {
        match self {
            AnyL2::Dir(b) => b.name(),
            AnyL2::Redis(b) => b.name(),
        }
    }
}

/// The directory backend.
#[derive(Debug)]
pub struct DirL2 {
    root: PathBuf,
    /// What this agent knows to be stored, with sizes, bounding the directory's bytes.
    ledger: Mutex<Ledger>,
    tmp_seq: AtomicU64,
}

impl DirL2 {
    /// Opens (creating) `root`, bounded at `capacity_bytes`: removes temporary files a crash
    /// left and adopts the objects already there.
    pub fn open(root: &Path, capacity_bytes: u64) -> io::Result<DirL2> {
        // The owner's only (0700, objects 0600): blocks are tenants' KV. A root an older
        // release left open is closed again, which covers the objects inside it.
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root.join("tmp"))?;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))?;
        for e in std::fs::read_dir(root.join("tmp"))? {
            let _ = std::fs::remove_file(e?.path());
        }
        let mut ledger = Ledger::new(capacity_bytes, Eviction::Lru);
        let mut evicted = Vec::new();
        for layout_dir in std::fs::read_dir(root)? {
            let layout_dir = layout_dir?;
            let Some(layout) = parse_hex(&layout_dir.file_name()) else {
                continue;
            };
            for fan in std::fs::read_dir(layout_dir.path())? {
                let fan = fan?;
                if !fan.file_type()?.is_dir() {
                    continue;
                }
                for f in std::fs::read_dir(fan.path())? {
                    let f = f?;
                    let name = f.file_name();
                    let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".blk")) else {
                        continue;
                    };
                    let Some(key) = parse_hex(std::ffi::OsStr::new(stem)) else {
                        continue;
                    };
                    let len = f.metadata()?.len();
                    ledger
                        .insert(BlockId::new(layout, key), len, false, &mut evicted)
                        .ok();
                }
            }
        }
        let dir = DirL2 {
            root: root.to_path_buf(),
            ledger: Mutex::new(ledger),
            tmp_seq: AtomicU64::new(0),
        };
        for id in evicted {
            let _ = std::fs::remove_file(dir.path_of(&id));
        }
        Ok(dir)
    }

    fn path_of(&self, id: &BlockId) -> PathBuf {
        let key = format!("{:016x}", id.key.0);
        self.root
            .join(format!("{:016x}", id.layout))
            .join(&key[..2])
            .join(format!("{key}.blk"))
    }

    /// Bytes this agent counts as stored.
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn parse_hex(name: &std::ffi::OsStr) -> Option<u64> {
    let s = name.to_str()?;
    (s.len() == 16).then(|| u64::from_str_radix(s, 16).ok())?
}

impl L2Backend for DirL2 {
    async fn put(&self, id: BlockId, object: Bytes) -> Result<Vec<BlockId>, L2Error> {
        let len = object.len() as u64;
        let mut evicted = Vec::new();
        {
            let mut ledger = self.lock();
            if len > ledger.capacity_bytes() {
                return Err(L2Error::TooLarge(len));
            }
            // Re-putting replaces: drop the old entry so that its size is counted anew.
            ledger.remove(&id);
            ledger
                .insert(id, len, false, &mut evicted)
                .map_err(|_| L2Error::TooLarge(len))?;
        }
        for old in &evicted {
            let _ = tokio::fs::remove_file(self.path_of(old)).await;
        }
        let path = self.path_of(&id);
        let tmp = self.root.join("tmp").join(format!(
            "{}-{}.tmp",
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let written = async {
            if let Some(parent) = path.parent() {
                tokio::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)
                    .await?;
            }
            // Created 0600, never readable by others, not even before a chmod.
            let mut file = tokio::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .await?;
            tokio::io::AsyncWriteExt::write_all(&mut file, &object).await?;
            // tokio's File finishes a write in the background: wait for it before renaming.
            tokio::io::AsyncWriteExt::flush(&mut file).await?;
            drop(file);
            tokio::fs::rename(&tmp, &path).await
        }
        .await;
        if let Err(e) = written {
            let _ = tokio::fs::remove_file(&tmp).await;
            self.lock().remove(&id);
            return Err(e.into());
        }
        Ok(evicted)
    }

    async fn get(&self, id: BlockId) -> Result<Option<Bytes>, L2Error> {
        match tokio::fs::read(self.path_of(&id)).await {
            Ok(bytes) => {
                let mut ledger = self.lock();
                if !ledger.touch(&id) {
                    // Written by another agent on a shared mount: count it from now on.
                    let mut evicted = Vec::new();
                    ledger
                        .insert(id, bytes.len() as u64, false, &mut evicted)
                        .ok();
                    drop(ledger);
                    for old in &evicted {
                        let _ = std::fs::remove_file(self.path_of(old));
                    }
                }
                Ok(Some(Bytes::from(bytes)))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.lock().remove(&id);
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn contains(&self, ids: &[BlockId]) -> Result<Vec<bool>, L2Error> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let known = self.lock().contains(id);
            out.push(known || tokio::fs::try_exists(self.path_of(id)).await?);
        }
        Ok(out)
    }

    async fn remove(&self, id: BlockId) -> Result<(), L2Error> {
        self.lock().remove(&id);
        match tokio::fs::remove_file(self.path_of(&id)).await {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    fn name(&self) -> &'static str {
        "dir"
    }
}

/// The Redis backend.
pub struct RedisL2 {
    target: RedisTarget,
    /// Connections between operations, at most [`REDIS_IN_FLIGHT`]: one per operation in flight,
    /// so a 1 MiB `SET` never queues behind another on one socket.
    idle: Mutex<Vec<RedisConn>>,
    prefix: String,
    deadline: Duration,
    backoff: Duration,
    /// Until when operations fail at once after a failure.
    down_until: Mutex<Option<Instant>>,
    /// Operations in flight at most ([`REDIS_IN_FLIGHT`]): past it an operation waits for
    /// one to end, so a get of a long chain is not a storm of new connections.
    in_flight: tokio::sync::Semaphore,
    /// Operations in a row that ran out of their deadline on a server that answers.
    late_in_a_row: std::sync::atomic::AtomicU32,
}

/// Operations one backend runs at once (the L2 writer runs 8 writes at once, and gets and
/// prefetches come beside), and so the connections it holds: each is kept idle after its
/// operation, for the next.
const REDIS_IN_FLIGHT: usize = 32;
/// Deadline misses in a row that make the backend back off: one late answer from a server
/// that answers (a busy host, a large read) is an error for that operation only.
const LATE_TO_BACK_OFF: u32 = 3;
/// The longest object a `GET` reads back: a block the block API may carry, and its header.
const REDIS_MAX_OBJECT: usize = u32::MAX as usize + HEADER_BYTES;

/// Where the Redis server is and how to log in, from the URL.
#[derive(Clone, Debug)]
struct RedisTarget {
    addr: RedisAddr,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

#[derive(Clone, Debug)]
enum RedisAddr {
    Tcp(String, u16),
    Unix(PathBuf),
}

/// A Redis connection: writes go straight to the socket, replies come through the buffer.
type RedisConn = tokio::io::BufReader<Box<dyn RedisIo>>;

trait RedisIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + Sync {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + Sync> RedisIo for T {}

/// One operation of the Redis backend.
enum RedisOp<'a> {
    /// The object is written from its parts (a header and a payload, say) as they are.
    Set {
        key: String,
        object: [&'a [u8]; 2],
    },
    Get(String),
    Exists(Vec<String>),
    Del(String),
}

impl std::fmt::Debug for RedisL2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisL2")
            .field("addr", &self.target.addr)
            .field("db", &self.target.db)
            .field("prefix", &self.prefix)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

impl RedisL2 {
    /// A backend for the server at `url` (`redis://[USER:PASSWORD@]HOST:PORT[/DB]`, or a
    /// Unix socket as the `redis` crate's URLs name one), connected lazily: the agent starts
    /// whether or not Redis is up. Keys are `PREFIX{layout:016x}:{key:016x}`.
    pub fn new(url: &str, prefix: &str, deadline: Duration) -> Result<RedisL2, L2Error> {
        // The `redis` crate parses the URL (its forms, percent-decoding); our own client
        // below speaks to the server.
        let client = redis::Client::open(url).map_err(|e| L2Error::Redis(e.to_string()))?;
        let info = client.get_connection_info();
        let addr = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => RedisAddr::Tcp(host.clone(), *port),
            redis::ConnectionAddr::Unix(path) => RedisAddr::Unix(path.clone()),
            other => {
                return Err(L2Error::Redis(format!(
                    "{other} is not supported (TLS is not built in): use redis://"
                )))
            }
        };
        let settings = info.redis_settings();
        Ok(RedisL2 {
            target: RedisTarget {
                addr,
                username: settings.username().map(str::to_owned),
                password: settings.password().map(str::to_owned),
                db: settings.db(),
            },
            idle: Mutex::new(Vec::new()),
            prefix: prefix.to_string(),
            deadline,
            backoff: Duration::from_secs(1),
            down_until: Mutex::new(None),
            in_flight: tokio::sync::Semaphore::new(REDIS_IN_FLIGHT),
            late_in_a_row: std::sync::atomic::AtomicU32::new(0),
        })
    }

    fn key(&self, id: &BlockId) -> String {
        format!("{}{:016x}:{:016x}", self.prefix, id.layout, id.key.0)
    }

    /// A new connection, logged in and on its database.
    async fn connect(&self) -> Result<RedisConn, RespError> {
        let io: Box<dyn RedisIo> = match &self.target.addr {
            RedisAddr::Tcp(host, port) => {
                let s = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
            RedisAddr::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
        };
        let mut conn = tokio::io::BufReader::with_capacity(64 << 10, io);
        let mut setup = Vec::new();
        let mut replies = 0;
        if let Some(password) = &self.target.password {
            match &self.target.username {
                Some(user) => {
                    resp::command(&mut setup, &[b"AUTH", user.as_bytes(), password.as_bytes()])
                }
                None => resp::command(&mut setup, &[b"AUTH", password.as_bytes()]),
            }
            replies += 1;
        }
        if self.target.db != 0 {
            resp::command(
                &mut setup,
                &[b"SELECT", self.target.db.to_string().as_bytes()],
            );
            replies += 1;
        }
        if replies > 0 {
            conn.write_all(&setup).await?;
            for _ in 0..replies {
                match resp::read_reply(&mut conn, 0).await? {
                    Reply::Simple(_) => {}
                    Reply::Error(e) => return Err(RespError::Protocol(e)),
                    other => return Err(RespError::Protocol(format!("{other:?} to a login"))),
                }
            }
        }
        Ok(conn)
    }

    /// Sends `op` on `conn` and reads its answer(s).
    async fn exchange(conn: &mut RedisConn, op: &RedisOp<'_>) -> Result<Answer, RespError> {
        match op {
            RedisOp::Set { key, object } => {
                let len = object[0].len() + object[1].len();
                let head = resp::command_head(&[b"SET", key.as_bytes()], len);
                crate::io::write_all_vectored(conn, &[&head, object[0], object[1], resp::CRLF])
                    .await?;
                match resp::read_reply(conn, 0).await? {
                    Reply::Simple(_) => Ok(Answer::Done),
                    other => Ok(Answer::Refused(other)),
                }
            }
            RedisOp::Get(key) => {
                let mut cmd = Vec::new();
                resp::command(&mut cmd, &[b"GET", key.as_bytes()]);
                conn.write_all(&cmd).await?;
                match resp::read_reply(conn, REDIS_MAX_OBJECT).await? {
                    Reply::Bulk(b) => Ok(Answer::Object(b)),
                    other => Ok(Answer::Refused(other)),
                }
            }
            RedisOp::Exists(keys) => {
                // Pipelined: every EXISTS in one write, then the answers in order.
                let mut cmd = Vec::new();
                for k in keys {
                    resp::command(&mut cmd, &[b"EXISTS", k.as_bytes()]);
                }
                conn.write_all(&cmd).await?;
                let mut found = Vec::with_capacity(keys.len());
                let mut refused = None;
                for _ in keys {
                    match resp::read_reply(conn, 0).await? {
                        Reply::Integer(n) => found.push(n > 0),
                        other => {
                            // Read every answer, so the connection stays in step.
                            refused.get_or_insert(other);
                        }
                    }
                }
                Ok(refused.map_or(Answer::Found(found), Answer::Refused))
            }
            RedisOp::Del(key) => {
                let mut cmd = Vec::new();
                resp::command(&mut cmd, &[b"DEL", key.as_bytes()]);
                conn.write_all(&cmd).await?;
                match resp::read_reply(conn, 0).await? {
                    Reply::Integer(_) => Ok(Answer::Done),
                    other => Ok(Answer::Refused(other)),
                }
            }
        }
    }

    /// Runs `op` with the deadline and the back-off: on an idle connection when there is
    /// one (again on a new one if that one turns out dead: Redis restarted, or closed it),
    /// else on a new one. A connection goes back to the idle ones only after a whole answer.
    /// At most [`REDIS_IN_FLIGHT`] run at once (the deadline counts from the start of
    /// each). A server that cannot be reached, refuses a login or refuses the command
    /// makes the backend back off at once; deadline misses only [`LATE_TO_BACK_OFF`] in a
    /// row.
    async fn run(&self, op: RedisOp<'_>) -> Result<Answer, L2Error> {
        let down = || {
            let until = *self.down_until.lock().unwrap_or_else(|p| p.into_inner());
            until.and_then(|until| until.checked_duration_since(Instant::now()))
        };
        if let Some(left) = down() {
            return Err(L2Error::Backoff(left));
        }
        let _slot = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| L2Error::Redis("the backend is closed".into()))?;
        // It may have gone down while this operation waited.
        if let Some(left) = down() {
            return Err(L2Error::Backoff(left));
        }
        let attempt = async {
            let reused = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            if let Some(mut conn) = reused {
                match Self::exchange(&mut conn, &op).await {
                    Ok(answer) => return Ok((conn, answer)),
                    // Every command here may be sent twice (SET of the same bytes, reads).
                    Err(RespError::Io(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            let mut conn = self.connect().await?;
            let answer = Self::exchange(&mut conn, &op).await?;
            Ok((conn, answer))
        };
        let late = &self.late_in_a_row;
        let err = match tokio::time::timeout(self.deadline, attempt).await {
            Ok(Ok((conn, answer))) => {
                late.store(0, Ordering::Relaxed);
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                if idle.len() < REDIS_IN_FLIGHT {
                    idle.push(conn);
                }
                drop(idle);
                match answer {
                    Answer::Refused(reply) => {
                        L2Error::Redis(format!("redis refused the command: {reply:?}"))
                    }
                    answer => return Ok(answer),
                }
            }
            Ok(Err(e)) => L2Error::Redis(e.to_string()),
            Err(_) => {
                let err = L2Error::Redis(format!("no answer within {:?}", self.deadline));
                if late.fetch_add(1, Ordering::Relaxed) + 1 < LATE_TO_BACK_OFF {
                    return Err(err);
                }
                err
            }
        };
        late.store(0, Ordering::Relaxed);
        *self.down_until.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Instant::now() + self.backoff);
        Err(err)
    }
}

/// What an operation answered.
#[derive(Debug)]
enum Answer {
    Done,
    Object(Option<Bytes>),
    Found(Vec<bool>),
    /// A reply that is not the command's success (an error, say OOM).
    Refused(Reply),
}

fn unexpected(answer: Answer) -> L2Error {
    L2Error::Redis(format!("unexpected answer {answer:?}"))
}

impl L2Backend for RedisL2 {
    async fn put(&self, id: BlockId, object: Bytes) -> Result<Vec<BlockId>, L2Error> {
        match self
            .run(RedisOp::Set {
                key: self.key(&id),
                object: [&object, &[]],
            })
            .await?
        {
            Answer::Done => Ok(Vec::new()),
            other => Err(unexpected(other)),
        }
    }

    /// One vectored write of the command's head, the object's header and the payload as it
    /// is in L1: no copy in user space (the kernel's copy into the socket is the only one).
    async fn put_block(&self, id: BlockId, block: &Block) -> Result<Vec<BlockId>, L2Error> {
        let header = object_header(&id, block);
        match self
            .run(RedisOp::Set {
                key: self.key(&id),
                object: [&header, &block.payload],
            })
            .await?
        {
            Answer::Done => Ok(Vec::new()),
            other => Err(unexpected(other)),
        }
    }

    async fn get(&self, id: BlockId) -> Result<Option<Bytes>, L2Error> {
        match self.run(RedisOp::Get(self.key(&id))).await? {
            Answer::Object(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    async fn contains(&self, ids: &[BlockId]) -> Result<Vec<bool>, L2Error> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys = ids.iter().map(|id| self.key(id)).collect();
        match self.run(RedisOp::Exists(keys)).await? {
            Answer::Found(found) => Ok(found),
            other => Err(unexpected(other)),
        }
    }

    async fn remove(&self, id: BlockId) -> Result<(), L2Error> {
        match self.run(RedisOp::Del(self.key(&id))).await? {
            Answer::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{decode_object, encode_object, Block, Damage};

    #[test]
    fn dir_stores_bounds_and_survives_restarts() {
        let tmp = tempfile::tempdir().unwrap();
        crate::test_runtime().block_on(async {
            let id = |k| BlockId::new(1, k);
            let obj = |k: u64| encode_object(&id(k), &Block::new(Bytes::from(vec![k as u8; 64])));
            let size = obj(0).len() as u64;
            let dir = DirL2::open(tmp.path(), 3 * size).unwrap();
            for k in 0..3 {
                dir.put(id(k), obj(k)).await.unwrap();
            }
            assert_eq!(
                dir.contains(&[id(0), id(9)]).await.unwrap(),
                vec![true, false]
            );
            // Reading 0 makes 1 the least recently used; a fourth object evicts it.
            assert!(dir.get(id(0)).await.unwrap().is_some());
            dir.put(id(3), obj(3)).await.unwrap();
            assert_eq!(dir.get(id(1)).await.unwrap(), None);
            assert_eq!(dir.used_bytes(), 3 * size);
            // Bigger than the bound: refused.
            assert!(matches!(
                dir.put(id(9), Bytes::from(vec![0; 4 * size as usize]))
                    .await,
                Err(L2Error::TooLarge(_))
            ));
            // A stray temporary file and a restart: objects adopted, tmp cleaned.
            std::fs::write(tmp.path().join("tmp").join("crash.tmp"), b"half").unwrap();
            drop(dir);
            let dir = DirL2::open(tmp.path(), 3 * size).unwrap();
            assert_eq!(dir.used_bytes(), 3 * size);
            assert_eq!(
                std::fs::read_dir(tmp.path().join("tmp")).unwrap().count(),
                0
            );
            let got = dir.get(id(3)).await.unwrap().unwrap();
            assert!(decode_object(&id(3), got).is_ok());
            // A truncated object reads back raw; the check names it.
            let path = dir.path_of(&id(2));
            let raw = std::fs::read(&path).unwrap();
            std::fs::write(&path, &raw[..raw.len() - 5]).unwrap();
            let got = dir.get(id(2)).await.unwrap().unwrap();
            assert!(matches!(
                decode_object(&id(2), got),
                Err(Damage::Truncated { .. })
            ));
            dir.remove(id(2)).await.unwrap();
            assert_eq!(dir.get(id(2)).await.unwrap(), None);
        });
    }
}
