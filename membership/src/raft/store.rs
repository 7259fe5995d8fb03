//! Durable Raft storage in redb: the log, the vote, the committed pointer and the latest
//! snapshot live in one embedded database file; the tenant-config state machine lives in
//! memory and is rebuilt on start from the snapshot plus the committed log.
//!
//! Every write that Raft must see persisted (log appends, truncations, purges, votes,
//! snapshots) is a redb transaction committed with [`redb::Durability::Immediate`], i.e.
//! fsynced before the call returns, and so is the committed pointer: openraft 0.9 restarts
//! a node that led before its crash as leader at once, without a new entry of its own term,
//! and answers its read-index requests with that pointer. Written without fsync, the
//! pointer went back on a crash (redb drops non-durable commits when it recovers), and
//! after every router was killed the restarted leader served a linearizable read older
//! than an acknowledged write (found by the fault harness's `kill-all` scenario). Config
//! writes are rare; the extra fsync per commit does not matter.
//! Blocking database work runs on two storage threads of its own (`blocking`), never on a
//! reactor thread and never on tokio's blocking pool, which name lookups share.
//!
//! openraft 0.9 is built here without its `storage-v2` feature, so [`Store`] implements the
//! combined [`RaftStorage`] trait and is split into log store and state machine by
//! [`openraft::storage::Adaptor`]. Values are JSON: the log is small, and JSON keeps it
//! readable and independent of field order.

use super::state::{CommandResult, ConfigState};
use openraft::storage::{Adaptor, LogState, RaftLogReader, RaftSnapshotBuilder, Snapshot};
use openraft::{
    AnyError, BasicNode, Entry, EntryPayload, LogId, RaftStorage, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership, Vote,
};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{de::DeserializeOwned, Serialize};
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

openraft::declare_raft_types!(
    /// The openraft type configuration of warmpath's tenant-config cluster.
    pub TypeConfig:
        D = super::state::Command,
        R = CommandResult,
        NodeId = u64,
        Node = BasicNode,
        Entry = Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// Node ids of the tenant-config cluster.
pub type NodeId = u64;
/// Storage errors as openraft wants them.
pub type StoreResult<T> = Result<T, StorageError<NodeId>>;

/// The log: index → JSON of the entry.
const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_logs");
/// Small records: vote, committed pointer, last purged log id, the snapshot.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_LAST_PURGED: &str = "last_purged";
const KEY_SNAPSHOT_META: &str = "snapshot_meta";
const KEY_SNAPSHOT_DATA: &str = "snapshot_data";

/// Why the store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The data directory could not be created.
    #[error("cannot create data dir {path}: {source}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// redb refused to open or initialise the database file.
    #[error("cannot open raft database {path}: {message}")]
    Open {
        /// The database file.
        path: PathBuf,
        /// redb's error.
        message: String,
    },
    /// The stored snapshot does not decode.
    #[error("stored snapshot is corrupt: {0}")]
    CorruptSnapshot(String),
    /// A stored value fails its checksum: the node must not serve what it holds.
    #[error(
        "raft store {path}: {what}. This node will not serve a configuration it cannot trust. \
         To repair it from the leader: stop it, move {dir} aside, and start it again while \
         the other voters are up; it rejoins with an empty store and the leader sends it \
         the log and a snapshot. Repair one node at a time."
    )]
    Corrupt {
        /// The database file.
        path: PathBuf,
        /// Its data directory.
        dir: PathBuf,
        /// Which value, and what is wrong with it.
        what: String,
    },
    /// Making earlier commits durable failed.
    #[error("cannot flush raft database: {0}")]
    Flush(String),
}

/// The in-memory state machine.
#[derive(Debug, Clone, Default)]
struct StateMachine {
    /// Last log id applied, from an entry or a snapshot.
    last_applied: Option<LogId<NodeId>>,
    /// Last membership applied.
    membership: StoredMembership<NodeId, BasicNode>,
    /// The tenant configuration.
    state: ConfigState,
}

/// The redb-backed Raft storage of one node.
#[derive(Debug)]
pub struct Store {
    /// The database file; shared with log readers and snapshot builders.
    db: Arc<Database>,
    /// The applied state, rebuilt on start.
    sm: StateMachine,
    /// Publishes the config after every applied batch and installed snapshot.
    state_tx: watch::Sender<ConfigState>,
    /// Makes snapshot ids unique within this process.
    snapshot_seq: Arc<AtomicU64>,
}

/// Reads the log for replication tasks.
#[derive(Debug, Clone)]
pub struct LogReader {
    db: Arc<Database>,
}

/// Builds a snapshot from a copy of the state machine.
#[derive(Debug)]
pub struct SnapshotBuilder {
    db: Arc<Database>,
    sm: StateMachine,
    snapshot_seq: Arc<AtomicU64>,
}

fn any<E: std::fmt::Display>(e: E) -> AnyError {
    AnyError::error(e.to_string())
}

/// First byte of a checksummed value: no JSON text starts with it.
const SEALED_V1: u8 = 0x01;
/// Bytes in front of a sealed value's JSON: the tag and an xxh3-64 of the JSON.
const SEAL_BYTES: usize = 9;

/// `json` as it is stored: `[SEALED_V1][xxh3-64 of json, little-endian][json]`, so that a
/// value altered on disk (bit rot, a stray write) is found on read, whatever redb checks.
fn seal(json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(SEAL_BYTES + json.len());
    out.push(SEALED_V1);
    out.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(json).to_le_bytes());
    out.extend_from_slice(json);
    out
}

/// A stored value fails its checksum, or is in no known format.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unsealed(&'static str);

/// The JSON of stored value `b`. A value written before checksums (plain JSON, from a
/// store older than this format) is taken as it is; [`Store::open`] seals those.
fn unseal(b: &[u8]) -> Result<&[u8], Unsealed> {
    match b.first() {
        Some(&SEALED_V1) if b.len() >= SEAL_BYTES => {
            let (head, json) = b.split_at(SEAL_BYTES);
            let sum = u64::from_le_bytes(head[1..].try_into().expect("eight bytes"));
            if xxhash_rust::xxh3::xxh3_64(json) == sum {
                Ok(json)
            } else {
                Err(Unsealed(
                    "it fails its checksum: the file was altered on disk",
                ))
            }
        }
        Some(b'{' | b'[' | b'"' | b'n' | b't' | b'f' | b'-' | b'0'..=b'9') => Ok(b),
        _ => Err(Unsealed(
            "it is in no known format: the file was altered on disk",
        )),
    }
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, AnyError> {
    serde_json::to_vec(v).map(|json| seal(&json)).map_err(any)
}

fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, AnyError> {
    serde_json::from_slice(unseal(b).map_err(any)?).map_err(any)
}

/// Checks every stored value, and seals those written before checksums. The first value
/// that fails is named in the error.
fn verify_and_seal(db: &Database) -> Result<(), String> {
    let txn = write_txn(db, Durability::Immediate).map_err(|e| e.to_string())?;
    {
        let mut logs = txn.open_table(LOGS).map_err(|e| e.to_string())?;
        let mut legacy = Vec::new();
        for item in logs.iter().map_err(|e| e.to_string())? {
            let (k, v) = item.map_err(|e| e.to_string())?;
            let stored = v.value();
            unseal(stored).map_err(|e| format!("log entry {}: {e}", k.value()))?;
            if stored.first() != Some(&SEALED_V1) {
                legacy.push((k.value(), seal(stored)));
            }
        }
        for (k, v) in legacy {
            logs.insert(k, v.as_slice()).map_err(|e| e.to_string())?;
        }
        let mut meta = txn.open_table(META).map_err(|e| e.to_string())?;
        let mut legacy = Vec::new();
        for item in meta.iter().map_err(|e| e.to_string())? {
            let (k, v) = item.map_err(|e| e.to_string())?;
            let stored = v.value();
            unseal(stored).map_err(|e| format!("record {:?}: {e}", k.value()))?;
            if stored.first() != Some(&SEALED_V1) {
                legacy.push((k.value().to_string(), seal(stored)));
            }
        }
        for (k, v) in legacy {
            meta.insert(k.as_str(), v.as_slice())
                .map_err(|e| e.to_string())?;
        }
    }
    txn.commit().map_err(|e| e.to_string())
}

/// A storage job for the storage threads.
type Job = Box<dyn FnOnce() + Send>;

/// Threads that run the store's blocking database work, and nothing else. They are not
/// tokio's blocking pool: that pool also runs name lookups (every HTTP connection to a
/// host name resolves there), and thousands of slow lookups queued on it once kept Raft's
/// storage waiting until every router lost its leader.
struct StorageThreads {
    jobs: std::sync::Mutex<std::sync::mpsc::Sender<Job>>,
}

/// How many storage threads run (redb takes one writer at a time and many readers).
const STORAGE_THREADS: usize = 2;

fn storage_threads() -> &'static StorageThreads {
    static THREADS: std::sync::OnceLock<StorageThreads> = std::sync::OnceLock::new();
    THREADS.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Arc::new(std::sync::Mutex::new(rx));
        for n in 0..STORAGE_THREADS {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("raft-store-{n}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(guard) => guard.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start a raft storage thread");
            }
        }
        StorageThreads {
            jobs: std::sync::Mutex::new(tx),
        }
    })
}

thread_local! {
    /// Set by [`run_storage_inline`]: this thread runs database work itself.
    static INLINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Makes the calling thread run every storage job itself instead of handing it to the
/// storage threads. For the deterministic simulation: on a single-threaded runtime with
/// paused time, work on another thread lets the clock jump ahead while a write is still
/// in flight, and the order of events would depend on the host's scheduler.
pub fn run_storage_inline() {
    INLINE.with(|i| i.set(true));
}

/// Runs blocking database work on the storage threads, off the async reactor and off
/// tokio's blocking pool.
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, AnyError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, AnyError> + Send + 'static,
{
    if INLINE.with(|i| i.get()) {
        return f();
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
    });
    let sent = storage_threads()
        .jobs
        .lock()
        .map_err(|_| any("storage threads poisoned"))?
        .send(job);
    sent.map_err(|_| any("storage threads stopped"))?;
    rx.await
        .map_err(|_| any("storage task failed: it panicked"))?
}

fn write_txn(db: &Database, durability: Durability) -> Result<redb::WriteTransaction, AnyError> {
    let mut txn = db.begin_write().map_err(any)?;
    txn.set_durability(durability).map_err(any)?;
    Ok(txn)
}

fn put_meta(
    db: &Database,
    key: &'static str,
    value: Vec<u8>,
    durability: Durability,
) -> Result<(), AnyError> {
    let txn = write_txn(db, durability)?;
    {
        let mut t = txn.open_table(META).map_err(any)?;
        t.insert(key, value.as_slice()).map_err(any)?;
    }
    txn.commit().map_err(any)
}

/// The last purged and the last stored log ids, as read from the database (what this node
/// would vote with; the pre-vote answers with it too).
pub(crate) fn log_state(db: &Database) -> Result<LogState<TypeConfig>, AnyError> {
    let last_purged: Option<LogId<NodeId>> = get_meta(db, KEY_LAST_PURGED)?
        .map(|b| decode(&b))
        .transpose()?;
    let txn = db.begin_read().map_err(any)?;
    let t = txn.open_table(LOGS).map_err(any)?;
    let last = match t.last().map_err(any)? {
        Some((_, v)) => Some(decode::<Entry<TypeConfig>>(v.value())?.log_id),
        None => last_purged,
    };
    Ok(LogState {
        last_purged_log_id: last_purged,
        last_log_id: last,
    })
}

/// This node's last stored log id, read on a storage thread.
pub(crate) async fn last_log_id(db: &Arc<Database>) -> Result<Option<LogId<NodeId>>, AnyError> {
    let db = db.clone();
    Ok(blocking(move || log_state(&db)).await?.last_log_id)
}

fn get_meta(db: &Database, key: &'static str) -> Result<Option<Vec<u8>>, AnyError> {
    let txn = db.begin_read().map_err(any)?;
    let t = txn.open_table(META).map_err(any)?;
    let v = t.get(key).map_err(any)?;
    Ok(v.map(|g| g.value().to_vec()))
}

fn read_entries(
    db: &Database,
    range: (Bound<u64>, Bound<u64>),
) -> Result<Vec<Entry<TypeConfig>>, AnyError> {
    let txn = db.begin_read().map_err(any)?;
    let t = txn.open_table(LOGS).map_err(any)?;
    let mut out = Vec::new();
    for item in t.range::<u64>(range).map_err(any)? {
        let (_, v) = item.map_err(any)?;
        out.push(decode(v.value())?);
    }
    Ok(out)
}

/// A stored snapshot: its meta and its data (JSON of the [`ConfigState`]).
type StoredSnapshot = (SnapshotMeta<NodeId, BasicNode>, Vec<u8>);

fn read_snapshot(db: &Database) -> Result<Option<StoredSnapshot>, AnyError> {
    let txn = db.begin_read().map_err(any)?;
    let t = txn.open_table(META).map_err(any)?;
    let meta = t.get(KEY_SNAPSHOT_META).map_err(any)?;
    let data = t.get(KEY_SNAPSHOT_DATA).map_err(any)?;
    match (meta, data) {
        (Some(m), Some(d)) => Ok(Some((
            decode(m.value())?,
            unseal(d.value()).map_err(any)?.to_vec(),
        ))),
        _ => Ok(None),
    }
}

fn write_snapshot(
    db: &Database,
    meta: &SnapshotMeta<NodeId, BasicNode>,
    data: &[u8],
) -> Result<(), AnyError> {
    let meta = encode(meta)?;
    let data = seal(data);
    let txn = write_txn(db, Durability::Immediate)?;
    {
        let mut t = txn.open_table(META).map_err(any)?;
        t.insert(KEY_SNAPSHOT_META, meta.as_slice()).map_err(any)?;
        t.insert(KEY_SNAPSHOT_DATA, data.as_slice()).map_err(any)?;
    }
    txn.commit().map_err(any)
}

impl Store {
    /// Opens (or creates) the store in `data_dir/raft.redb` and restores the state machine
    /// from the stored snapshot; openraft then re-applies the committed log on top.
    pub fn open(data_dir: &Path) -> Result<Store, StoreError> {
        Store::open_publishing(data_dir, None)
    }

    /// [`Store::open`], publishing the applied configuration into `state_tx` when given:
    /// a Raft node started again in the same process keeps its subscribers. A state older
    /// than the one `state_tx` holds is not published (the restarted node re-applies its
    /// log from the snapshot up, and no subscriber may see the configuration go back).
    pub fn open_publishing(
        data_dir: &Path,
        state_tx: Option<watch::Sender<ConfigState>>,
    ) -> Result<Store, StoreError> {
        // The store holds API-key hashes and cache salts: the directory is 0700 and the file
        // 0600, made so and, when an older release left them readable, made so again.
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
        let private = |mode: u32| std::fs::Permissions::from_mode(mode);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(data_dir)
            .and_then(|()| std::fs::set_permissions(data_dir, private(0o700)))
            .map_err(|source| StoreError::DataDir {
                path: data_dir.to_path_buf(),
                source,
            })?;
        let path = data_dir.join("raft.redb");
        let open_err = |message: String| StoreError::Open {
            path: path.clone(),
            message,
        };
        // redb initialises an empty file as a new database.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .and_then(|f| f.set_permissions(private(0o600)))
            .map_err(|e| open_err(e.to_string()))?;
        let db = Database::create(&path).map_err(|e| open_err(e.to_string()))?;
        let init = || -> Result<(), AnyError> {
            let txn = write_txn(&db, Durability::Immediate)?;
            txn.open_table(LOGS).map_err(any)?;
            txn.open_table(META).map_err(any)?;
            txn.commit().map_err(any)
        };
        init().map_err(|e| open_err(e.to_string()))?;
        verify_and_seal(&db).map_err(|what| StoreError::Corrupt {
            path: path.clone(),
            dir: data_dir.to_path_buf(),
            what,
        })?;
        let mut sm = StateMachine::default();
        if let Some((meta, data)) = read_snapshot(&db).map_err(|e| open_err(e.to_string()))? {
            sm.state = decode(&data).map_err(|e| StoreError::CorruptSnapshot(e.to_string()))?;
            sm.last_applied = meta.last_log_id;
            sm.membership = meta.last_membership;
        }
        let state_tx = state_tx.unwrap_or_else(|| watch::channel(sm.state.clone()).0);
        let store = Store {
            db: Arc::new(db),
            sm,
            state_tx,
            snapshot_seq: Arc::new(AtomicU64::new(0)),
        };
        store.publish();
        Ok(store)
    }

    /// A receiver of the applied configuration, updated after every applied batch.
    pub fn subscribe(&self) -> watch::Receiver<ConfigState> {
        self.state_tx.subscribe()
    }

    /// A handle on the database, to [`flush`] it at shutdown.
    pub fn database(&self) -> Arc<Database> {
        self.db.clone()
    }

    /// Splits the store into openraft's log store and state machine.
    pub fn into_parts(self) -> (Adaptor<TypeConfig, Store>, Adaptor<TypeConfig, Store>) {
        Adaptor::new(self)
    }

    fn publish(&self) {
        let state = &self.sm.state;
        self.state_tx.send_if_modified(|current| {
            let newer = state.version >= current.version;
            if newer {
                *current = state.clone();
            }
            newer
        });
    }
}

/// Makes every earlier non-durable commit (the committed pointer) durable.
pub fn flush(db: &Database) -> Result<(), StoreError> {
    let txn = write_txn(db, Durability::Immediate).map_err(|e| StoreError::Flush(e.to_string()))?;
    txn.commit().map_err(|e| StoreError::Flush(e.to_string()))
}

impl RaftLogReader<TypeConfig> for LogReader {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> StoreResult<Vec<Entry<TypeConfig>>> {
        let range = (range.start_bound().cloned(), range.end_bound().cloned());
        let db = self.db.clone();
        blocking(move || read_entries(&db, range))
            .await
            .map_err(|e| StorageIOError::read_logs(e).into())
    }
}

impl RaftLogReader<TypeConfig> for Store {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> StoreResult<Vec<Entry<TypeConfig>>> {
        LogReader {
            db: self.db.clone(),
        }
        .try_get_log_entries(range)
        .await
    }
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> StoreResult<Snapshot<TypeConfig>> {
        let data = encode(&self.sm.state).map_err(StorageIOError::read_state_machine)?;
        let seq = self.snapshot_seq.fetch_add(1, Ordering::Relaxed);
        let snapshot_id = match &self.sm.last_applied {
            Some(l) => format!(
                "{}-{}-{}-{seq}",
                l.leader_id.term, l.leader_id.node_id, l.index
            ),
            None => format!("none-{seq}"),
        };
        let meta = SnapshotMeta {
            last_log_id: self.sm.last_applied,
            last_membership: self.sm.membership.clone(),
            snapshot_id,
        };
        let db = self.db.clone();
        let (m, d) = (meta.clone(), data.clone());
        blocking(move || write_snapshot(&db, &m, &d))
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), e))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStorage<TypeConfig> for Store {
    type LogReader = LogReader;
    type SnapshotBuilder = SnapshotBuilder;

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> StoreResult<()> {
        let db = self.db.clone();
        let v = encode(vote).map_err(StorageIOError::write_vote)?;
        blocking(move || put_meta(&db, KEY_VOTE, v, Durability::Immediate))
            .await
            .map_err(|e| StorageIOError::write_vote(e).into())
    }

    async fn read_vote(&mut self) -> StoreResult<Option<Vote<NodeId>>> {
        let db = self.db.clone();
        blocking(move || get_meta(&db, KEY_VOTE)?.map(|b| decode(&b)).transpose())
            .await
            .map_err(|e| StorageIOError::read_vote(e).into())
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> StoreResult<()> {
        let db = self.db.clone();
        let v = encode(&committed).map_err(StorageIOError::write)?;
        // Fsynced: see the module docs.
        blocking(move || put_meta(&db, KEY_COMMITTED, v, Durability::Immediate))
            .await
            .map_err(|e| StorageIOError::write(e).into())
    }

    async fn read_committed(&mut self) -> StoreResult<Option<LogId<NodeId>>> {
        let db = self.db.clone();
        blocking(move || {
            Ok(get_meta(&db, KEY_COMMITTED)?
                .map(|b| decode::<Option<LogId<NodeId>>>(&b))
                .transpose()?
                .flatten())
        })
        .await
        .map_err(|e| StorageIOError::read(e).into())
    }

    async fn get_log_state(&mut self) -> StoreResult<LogState<TypeConfig>> {
        let db = self.db.clone();
        blocking(move || log_state(&db))
            .await
            .map_err(|e| StorageIOError::read_logs(e).into())
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        LogReader {
            db: self.db.clone(),
        }
    }

    async fn append_to_log<I>(&mut self, entries: I) -> StoreResult<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
    {
        let mut rows = Vec::new();
        for e in entries {
            let b = encode(&e).map_err(|err| StorageIOError::write_log_entry(e.log_id, err))?;
            rows.push((e.log_id.index, b));
        }
        let db = self.db.clone();
        blocking(move || {
            let txn = write_txn(&db, Durability::Immediate)?;
            {
                let mut t = txn.open_table(LOGS).map_err(any)?;
                for (i, b) in &rows {
                    t.insert(*i, b.as_slice()).map_err(any)?;
                }
            }
            txn.commit().map_err(any)
        })
        .await
        .map_err(|e| StorageIOError::write_logs(e).into())
    }

    async fn delete_conflict_logs_since(&mut self, log_id: LogId<NodeId>) -> StoreResult<()> {
        let db = self.db.clone();
        blocking(move || {
            let txn = write_txn(&db, Durability::Immediate)?;
            {
                let mut t = txn.open_table(LOGS).map_err(any)?;
                t.retain_in::<u64, _>(log_id.index.., |_, _| false)
                    .map_err(any)?;
            }
            txn.commit().map_err(any)
        })
        .await
        .map_err(|e| StorageIOError::write_logs(e).into())
    }

    async fn purge_logs_upto(&mut self, log_id: LogId<NodeId>) -> StoreResult<()> {
        let db = self.db.clone();
        let purged = encode(&Some(log_id)).map_err(StorageIOError::write_logs)?;
        blocking(move || {
            let txn = write_txn(&db, Durability::Immediate)?;
            {
                let mut m = txn.open_table(META).map_err(any)?;
                m.insert(KEY_LAST_PURGED, purged.as_slice()).map_err(any)?;
                let mut t = txn.open_table(LOGS).map_err(any)?;
                t.retain_in::<u64, _>(..=log_id.index, |_, _| false)
                    .map_err(any)?;
            }
            txn.commit().map_err(any)
        })
        .await
        .map_err(|e| StorageIOError::write_logs(e).into())
    }

    async fn last_applied_state(
        &mut self,
    ) -> StoreResult<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>)> {
        Ok((self.sm.last_applied, self.sm.membership.clone()))
    }

    async fn apply_to_state_machine(
        &mut self,
        entries: &[Entry<TypeConfig>],
    ) -> StoreResult<Vec<CommandResult>> {
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            self.sm.last_applied = Some(e.log_id);
            let r = match &e.payload {
                EntryPayload::Blank => CommandResult::Applied {
                    version: self.sm.state.version,
                },
                EntryPayload::Normal(cmd) => self.sm.state.apply(e.log_id.index, cmd),
                EntryPayload::Membership(m) => {
                    self.sm.membership = StoredMembership::new(Some(e.log_id), m.clone());
                    CommandResult::Applied {
                        version: self.sm.state.version,
                    }
                }
            };
            if let CommandResult::Applied { version } = &r {
                if *version == e.log_id.index {
                    tracing::info!(config_version = version, "tenant config changed");
                }
            }
            out.push(r);
        }
        if !entries.is_empty() {
            self.publish();
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            db: self.db.clone(),
            sm: self.sm.clone(),
            snapshot_seq: self.snapshot_seq.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> StoreResult<Box<Cursor<Vec<u8>>>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> StoreResult<()> {
        let data = snapshot.into_inner();
        let state: ConfigState =
            decode(&data).map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), e))?;
        let db = self.db.clone();
        let m = meta.clone();
        blocking(move || write_snapshot(&db, &m, &data))
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), e))?;
        self.sm = StateMachine {
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
            state,
        };
        self.publish();
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> StoreResult<Option<Snapshot<TypeConfig>>> {
        let db = self.db.clone();
        let got = blocking(move || read_snapshot(&db))
            .await
            .map_err(|e| StorageIOError::read_snapshot(None, e))?;
        Ok(got.map(|(meta, data)| Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        }))
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Temporary directories for the tests: `tempfile`'s, named for what uses them.

    pub use tempfile::TempDir;

    /// A fresh directory under the system temp dir, removed on drop.
    pub fn temp_dir(tag: &str) -> TempDir {
        tempfile::Builder::new()
            .prefix(&format!("warmpath-{tag}-"))
            .tempdir()
            .expect("create temp dir")
    }
}

#[cfg(test)]
mod tests {
    // openraft's storage API fixes the (large) error type of these tests.
    #![allow(clippy::result_large_err)]

    use super::testutil::{temp_dir, TempDir};
    use super::*;
    use crate::raft::state::{Command, CommandV1, PoolSpec};
    use openraft::storage::{RaftLogStorage, RaftStateMachine};
    use openraft::testing::{StoreBuilder, Suite};
    use openraft::CommittedLeaderId;

    struct Builder;

    impl StoreBuilder<TypeConfig, Adaptor<TypeConfig, Store>, Adaptor<TypeConfig, Store>, TempDir>
        for Builder
    {
        async fn build(
            &self,
        ) -> StoreResult<(
            TempDir,
            Adaptor<TypeConfig, Store>,
            Adaptor<TypeConfig, Store>,
        )> {
            let dir = temp_dir("raft-suite");
            let store = Store::open(dir.path()).map_err(|e| StorageIOError::read(any(e)))?;
            let (log, sm) = store.into_parts();
            Ok((dir, log, sm))
        }
    }

    #[test]
    fn the_store_is_readable_by_its_owner_only_even_when_an_older_release_made_it() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = temp_dir("modes");
        let dir = tmp.path().join("raft");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        drop(Store::open(&dir).expect("a new store"));
        assert_eq!((mode(&dir), mode(&dir.join("raft.redb"))), (0o700, 0o600));
        let open = std::fs::Permissions::from_mode;
        std::fs::set_permissions(&dir, open(0o755)).unwrap();
        std::fs::set_permissions(dir.join("raft.redb"), open(0o644)).unwrap();
        drop(Store::open(&dir).expect("the store again"));
        assert_eq!((mode(&dir), mode(&dir.join("raft.redb"))), (0o700, 0o600));
    }

    #[test]
    fn openraft_storage_suite() -> StoreResult<()> {
        Suite::test_all(Builder)
    }

    fn log_id(term: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    fn normal(term: u64, index: u64, model: &str) -> Entry<TypeConfig> {
        Entry {
            log_id: log_id(term, index),
            payload: EntryPayload::Normal(Command::V1(CommandV1::PutPool {
                model: model.into(),
                spec: PoolSpec {
                    instances: vec!["http://a:1".into()],
                    ..PoolSpec::default()
                },
                expected_version: None,
            })),
        }
    }

    #[tokio::test]
    async fn log_vote_and_snapshot_survive_reopen() -> StoreResult<()> {
        let dir = temp_dir("raft-reopen");
        {
            let store = Store::open(dir.path()).map_err(|e| StorageIOError::read(any(e)))?;
            let (mut log, mut sm) = store.into_parts();
            log.save_vote(&Vote::new(3, 1)).await?;
            let entries: Vec<_> = (1..=4).map(|i| normal(3, i, &format!("m{i}"))).collect();
            RaftStorage::append_to_log(&mut *log.storage_mut().await, entries.clone()).await?;
            let r = sm.apply(entries[..2].to_vec()).await?;
            assert_eq!(r[1], CommandResult::Applied { version: 2 });
            let snap = sm.get_snapshot_builder().await.build_snapshot().await?;
            assert_eq!(snap.meta.last_log_id, Some(log_id(3, 2)));
            log.save_committed(Some(log_id(3, 4))).await?;
            flush(&log.storage().await.database()).map_err(|e| StorageIOError::write(any(e)))?;
        }
        let store = Store::open(dir.path()).map_err(|e| StorageIOError::read(any(e)))?;
        let rx = store.subscribe();
        // The snapshot restored the state machine up to index 2.
        assert_eq!(rx.borrow().version, 2);
        let (mut log, mut sm) = store.into_parts();
        assert_eq!(log.read_vote().await?, Some(Vote::new(3, 1)));
        assert_eq!(log.read_committed().await?, Some(log_id(3, 4)));
        assert_eq!(sm.applied_state().await?.0, Some(log_id(3, 2)));
        let st = log.get_log_state().await?;
        assert_eq!(st.last_log_id, Some(log_id(3, 4)));
        let got = log.try_get_log_entries(3..5).await?;
        assert_eq!(got.len(), 2);
        // openraft re-applies the committed rest at start; so does this.
        sm.apply(got).await?;
        assert_eq!(rx.borrow().pools.len(), 4);
        assert_eq!(rx.borrow().version, 4);
        Ok(())
    }

    /// Replaces the stored value of log entry `index` with `f` of it, in place.
    fn alter_entry(dir: &Path, index: u64, f: impl Fn(&[u8]) -> Vec<u8>) {
        let db = Database::create(dir.join("raft.redb")).expect("the file opens");
        let txn = db.begin_write().expect("a write");
        {
            let mut t = txn.open_table(LOGS).expect("the log");
            let old = t
                .get(index)
                .expect("a read")
                .expect("the entry")
                .value()
                .to_vec();
            t.insert(index, f(&old).as_slice()).expect("a write");
        }
        txn.commit().expect("a commit");
    }

    #[tokio::test]
    async fn a_value_altered_on_disk_keeps_the_store_closed() -> StoreResult<()> {
        let dir = temp_dir("raft-rot");
        {
            let store = Store::open(dir.path()).map_err(|e| StorageIOError::read(any(e)))?;
            let (log, _sm) = store.into_parts();
            let entries: Vec<_> = (1..=3).map(|i| normal(1, i, &format!("m{i}"))).collect();
            RaftStorage::append_to_log(&mut *log.storage_mut().await, entries).await?;
        }
        // One byte of entry 2's JSON changes, its length does not: "m2" becomes "m9".
        alter_entry(dir.path(), 2, |old| {
            let at = old
                .windows(4)
                .position(|w| w == b"\"m2\"")
                .expect("the model");
            let mut new = old.to_vec();
            new[at + 2] = b'9';
            new
        });
        let err = Store::open(dir.path()).expect_err("a corrupt store does not open");
        let text = err.to_string();
        assert!(
            text.contains("log entry 2") && text.contains("checksum"),
            "{text}"
        );
        assert!(text.contains("move") && text.contains("aside"), "{text}");
        Ok(())
    }

    #[tokio::test]
    async fn values_from_before_checksums_are_read_and_sealed() -> StoreResult<()> {
        let dir = temp_dir("raft-legacy");
        let entry = normal(1, 1, "old");
        {
            let store = Store::open(dir.path()).map_err(|e| StorageIOError::read(any(e)))?;
            let (log, _sm) = store.into_parts();
            RaftStorage::append_to_log(&mut *log.storage_mut().await, vec![entry.clone()]).await?;
        }
        // As the previous format stored it: the JSON alone.
        alter_entry(dir.path(), 1, |old| unseal(old).expect("sealed").to_vec());
        {
            let store = Store::open(dir.path()).map_err(|e| StorageIOError::read(any(e)))?;
            let (mut log, _sm) = store.into_parts();
            let got = log.try_get_log_entries(1..2).await?;
            assert_eq!(got[0].log_id, entry.log_id);
        }
        // Opening sealed it.
        alter_entry(dir.path(), 1, |old| {
            assert_eq!(old[0], SEALED_V1);
            old.to_vec()
        });
        Ok(())
    }

    #[tokio::test]
    async fn corrupt_log_entry_is_an_error_not_a_panic() -> StoreResult<()> {
        let dir = temp_dir("raft-corrupt");
        let store = Store::open(dir.path()).map_err(|e| StorageIOError::read(any(e)))?;
        let db = store.database();
        {
            let txn = db
                .begin_write()
                .map_err(|e| StorageIOError::write(any(e)))?;
            {
                let mut t = txn
                    .open_table(LOGS)
                    .map_err(|e| StorageIOError::write(any(e)))?;
                t.insert(1, b"not json".as_slice())
                    .map_err(|e| StorageIOError::write(any(e)))?;
            }
            txn.commit().map_err(|e| StorageIOError::write(any(e)))?;
        }
        let (mut log, _sm) = store.into_parts();
        assert!(log.try_get_log_entries(0..5).await.is_err());
        assert!(log.get_log_state().await.is_err());
        Ok(())
    }
}
