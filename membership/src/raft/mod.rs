//! Tenant configuration in Raft: every router holds the same tenant table.
//!
//! - [`state`]: the pure state machine (tenants, pools, API key hashes, config version).
//! - [`store`]: the durable log, vote and snapshot in redb; the openraft type config.
//! - [`wire`]: the `/raft/…` HTTP contract (paths, limits, warmpath's own bodies).
//! - [`client`]: the peer client, over TCP or a simulated network.
//! - `leader`: what a node does as the leader (writes, read indexes, joins) and what the
//!   `/raft/…` handlers share of the running Raft.
//! - [`network`]: Raft RPCs over HTTP (`/raft/…` routes and openraft's peer connections).
//! - [`clock`]: the wall clock that bounds forwarded writes ([`unix_ms`]).
//! - [`elect`]: the election timer and its pre-vote.
//! - this module: [`RaftNode`], the handle the router uses.
//!
//! Writes go to the leader: a follower or learner forwards a write over HTTP (one hop, at
//! most three tries while leadership moves) and returns the leader's answer, so a client may
//! send a write to any router. [`WriteError::NotLeader`] only appears when the node it was
//! forwarded to was itself not the leader and named no other. A write that timed out has an
//! unknown outcome (it may still commit); the error says so.
//!
//! Linearizable reads use the read-index protocol: the leader confirms its leadership with a
//! quorum and returns its commit point, and the reading node waits until it has applied that
//! far before answering from its local state. A node cut off from a quorum fails the read.
//!
//! Timing: heartbeats every 100 ms, election timeout 300–600 ms. Elections go through a
//! pre-vote ([`elect`]): a voter stands only after it has heard no leader for the leader
//! lease (600 ms) plus a random 0–300 ms and a majority agrees it has heard none either, so
//! a node with a fast clock or a one-way partition cannot depose a healthy leader. A lost
//! leader is replaced in about one second, well inside the 3 s target.

pub mod client;
pub mod clock;
pub mod elect;
mod leader;
pub mod network;
pub mod state;
pub mod store;
pub mod wire;

#[cfg(test)]
mod tests;

use client::{HttpClient, HttpError, PeerTransport};
pub use clock::unix_ms;
use leader::{leader_read_index, leader_write, ServerState};
use network::NetworkFactory;
use openraft::error::{ClientWriteError, InitializeError, RaftError};
use openraft::{BasicNode, ChangeMembers, Raft, SnapshotPolicy};
use serde::{Deserialize, Serialize};
use state::{Command, CommandResult, ConfigState};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::{NodeId, Store, TypeConfig};
use tokio::sync::watch;
use tokio::time::Instant;
use wire::{normalise_base, JoinRequest, LeaderReply};

/// For the deterministic simulation, called on the thread that runs it, inside its
/// single-threaded runtime with paused time: storage work runs on this thread (see
/// [`store::run_storage_inline`]) and the wall clock that bounds forwarded writes follows
/// tokio's simulated clock, so a message held for seconds of simulated time arrives late
/// by those seconds.
pub fn enter_simulation() {
    store::run_storage_inline();
    clock::follow_tokio();
}

/// A leader that has heard from no quorum for this long refuses writes at once (twice the
/// longest election timeout: by then the others have elected a new leader).
const STALE_QUORUM_MS: u64 = 2_000;
/// How long a write whose connection to the leader broke, or that found the leader
/// unreachable, waits for a new leader before it is sent again to the same one.
const RETRY_PAUSE: Duration = Duration::from_millis(300);
/// Attempts of one write at most (its deadline ends it first: 5 s of 300 ms pauses).
const MAX_WRITE_ATTEMPTS: usize = 32;

/// Whether a leader that a quorum last acknowledged `millis_since_quorum_ack` ago is cut
/// off (see [`RaftStatus::quorum_lost`]).
fn quorum_lost(millis_since_quorum_ack: Option<u64>) -> bool {
    millis_since_quorum_ack.is_some_and(|ms| ms > STALE_QUORUM_MS)
}

/// Declares the Raft gauges (see [`publish_metrics`]).
fn describe_metrics() {
    use metrics::describe_gauge;
    describe_gauge!(
        crate::metric_names::RAFT_TERM,
        "This node's current Raft term."
    );
    describe_gauge!(
        crate::metric_names::RAFT_IS_LEADER,
        "1 while this node leads the tenant-config group."
    );
    describe_gauge!(
        crate::metric_names::RAFT_LEADER_KNOWN,
        "1 while this node knows a leader (itself or another)."
    );
    describe_gauge!(
        crate::metric_names::RAFT_QUORUM_LOST,
        "1 while this node leads but no quorum has acknowledged it for over 2 s (it refuses writes)."
    );
    describe_gauge!(
        crate::metric_names::RAFT_LAST_LOG_INDEX,
        "Index of the last entry in this node's log."
    );
    describe_gauge!(
        crate::metric_names::RAFT_APPLIED_INDEX,
        "Index of the last entry applied to this node's tenant config."
    );
}

/// Publishes this node's Raft state as gauges, on every change and at least every second
/// (losing the quorum is a matter of time passing), until Raft stops.
async fn publish_metrics(raft: Raft<TypeConfig>) {
    use metrics::gauge;
    let mut rx = raft.metrics();
    loop {
        {
            let m = rx.borrow_and_update();
            if m.running_state.is_err() {
                return;
            }
            let flag = |b: bool| if b { 1.0 } else { 0.0 };
            gauge!(crate::metric_names::RAFT_TERM).set(m.current_term as f64);
            gauge!(crate::metric_names::RAFT_IS_LEADER)
                .set(flag(m.state == openraft::ServerState::Leader));
            gauge!(crate::metric_names::RAFT_LEADER_KNOWN).set(flag(m.current_leader.is_some()));
            gauge!(crate::metric_names::RAFT_QUORUM_LOST)
                .set(flag(quorum_lost(m.millis_since_quorum_ack)));
            gauge!(crate::metric_names::RAFT_LAST_LOG_INDEX)
                .set(m.last_log_index.unwrap_or(0) as f64);
            gauge!(crate::metric_names::RAFT_APPLIED_INDEX)
                .set(m.last_applied.map_or(0, |l| l.index) as f64);
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// How a node joins and runs in the tenant-config cluster.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's id; stable across restarts.
    pub node_id: NodeId,
    /// This node's base URL as peers reach it (`http://host:port`); the `/raft/` routes
    /// from [`RaftNode::router`] must be served there.
    pub http_addr: String,
    /// Where the Raft database lives.
    pub data_dir: PathBuf,
    /// The initial voters, id → base URL. Voters initialize an empty cluster with exactly
    /// this set; a node not in it joins as a learner. Later membership changes go through
    /// Raft, not through this map.
    pub voters: BTreeMap<NodeId, String>,
    /// Name of the cluster, in logs.
    pub cluster_name: String,
    /// Leader heartbeat interval.
    pub heartbeat_interval: Duration,
    /// Election timeout range; a follower that hears no leader for a random time in it
    /// stands for election.
    pub election_timeout: (Duration, Duration),
    /// Time allowed to connect to a peer.
    pub connect_timeout: Duration,
    /// Time a write (and a linearizable read) may take in all, forwarding included.
    pub write_timeout: Duration,
    /// A snapshot is taken every this many applied entries.
    pub snapshot_every: u64,
    /// Log entries kept after a snapshot, so that slightly lagging peers need no snapshot.
    pub logs_kept_after_snapshot: u64,
    /// Bearer token peers must send on `/raft/` calls; `None` accepts any caller.
    pub auth_token: Option<String>,
    /// How peer calls travel; `None` is HTTP over TCP. The deterministic simulation
    /// passes its simulated network here.
    pub transport: Option<Arc<dyn PeerTransport>>,
    /// Seed of the election timer's randomness; `None` draws one from the OS.
    pub election_seed: Option<u64>,
}

impl NodeConfig {
    /// A config with the default timings.
    pub fn new(
        node_id: NodeId,
        http_addr: impl Into<String>,
        data_dir: impl Into<PathBuf>,
        voters: BTreeMap<NodeId, String>,
    ) -> NodeConfig {
        NodeConfig {
            node_id,
            http_addr: http_addr.into(),
            data_dir: data_dir.into(),
            voters,
            cluster_name: "warmpath-tenant-config".into(),
            heartbeat_interval: Duration::from_millis(100),
            // A voter stands after the lease (the top of this range) plus a random part
            // of the range without a leader, and a won pre-vote: 600–900 ms, so a leader
            // that died under writes is replaced within issue 12's 3 s, three heartbeats
            // and more above the 100 ms heartbeat.
            election_timeout: (Duration::from_millis(300), Duration::from_millis(600)),
            connect_timeout: Duration::from_millis(500),
            write_timeout: Duration::from_secs(5),
            snapshot_every: 1000,
            logs_kept_after_snapshot: 1000,
            auth_token: None,
            transport: None,
            election_seed: None,
        }
    }
}

/// Why a node did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A field of [`NodeConfig`] is wrong; each problem names its field.
    #[error("invalid raft node config: {}", .0.join("; "))]
    Config(Vec<String>),
    /// The store could not be opened.
    #[error(transparent)]
    Store(#[from] store::StoreError),
    /// openraft refused to start.
    #[error("raft did not start: {0}")]
    Raft(String),
}

/// Why a write failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WriteError {
    /// No leader was known before the deadline (an election is running, or this node is
    /// cut off from a quorum). The write was not submitted.
    #[error("no raft leader known after {waited:?}; the write was not submitted")]
    NoLeader {
        /// How long this node waited for one.
        waited: Duration,
    },
    /// This node leads but has heard from no quorum for a while (it is cut off): the
    /// write was not submitted.
    #[error(
        "this leader has not heard from a quorum for {since_ms} ms; the write was not submitted"
    )]
    NoQuorum {
        /// Milliseconds since a quorum last acknowledged this leader.
        since_ms: u64,
    },
    /// The node the write was forwarded to is not the leader and named no other.
    #[error("not the leader; leader: {}", leader_url.as_deref().unwrap_or("unknown"))]
    NotLeader {
        /// The leader's base URL, when known.
        leader_url: Option<String>,
    },
    /// The leader could not be reached; the write was not submitted.
    #[error("raft leader {leader_url} unreachable: {message}")]
    LeaderUnreachable {
        /// The leader's base URL.
        leader_url: String,
        /// The cause.
        message: String,
    },
    /// The write was submitted but not seen committed in time; it may still commit.
    #[error("write not acknowledged within {0:?}; outcome unknown")]
    Timeout(Duration),
    /// The leader or the connection to it failed after the write was sent; it may still
    /// commit.
    #[error("write outcome unknown: {0}")]
    Unknown(String),
    /// Anything else: the node is shut down, storage failed, the peer answered garbage.
    #[error("write failed: {0}")]
    Failed(String),
    /// This node's Raft is stopped (see [`RaftNode::following`]) and it knew no other
    /// leader to forward the write to, or that leader said it no longer leads: the write
    /// was not submitted.
    #[error(
        "this node's raft is stopped ({cause}) and no leader took the write; it was not submitted"
    )]
    Stopped {
        /// Why Raft stopped.
        cause: String,
    },
    /// The forwarded write reached the leader after its deadline; it was not submitted.
    #[error(
        "the write reached the raft leader {late_ms} ms after its deadline; it was not submitted"
    )]
    Late {
        /// How far past the deadline, ms.
        late_ms: u64,
    },
}

/// Why a linearizable read failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReadError {
    /// No leader was known before the deadline.
    #[error("no raft leader known after {waited:?}")]
    NoLeader {
        /// How long this node waited for one.
        waited: Duration,
    },
    /// The leader could not confirm it still leads a quorum (it is partitioned).
    #[error("raft leader cannot reach a quorum: {0}")]
    NoQuorum(String),
    /// The node asked is not the leader and named no other.
    #[error("not the leader; leader: {}", leader_url.as_deref().unwrap_or("unknown"))]
    NotLeader {
        /// The leader's base URL, when known.
        leader_url: Option<String>,
    },
    /// The leader could not be reached.
    #[error("raft leader {leader_url} unreachable: {message}")]
    LeaderUnreachable {
        /// The leader's base URL.
        leader_url: String,
        /// The cause.
        message: String,
    },
    /// The read did not complete in time.
    #[error("linearizable read not done within {0:?}")]
    Timeout(Duration),
    /// Anything else (shut down, bad answer).
    #[error("read failed: {0}")]
    Failed(String),
}

/// A snapshot of a node's Raft status, for the admin API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RaftStatus {
    /// This node.
    pub node_id: NodeId,
    /// Leader, Follower, Candidate, Learner or Shutdown.
    pub role: String,
    /// The leader this node knows of.
    pub leader: Option<NodeId>,
    /// Its base URL.
    pub leader_url: Option<String>,
    /// Current term.
    pub term: u64,
    /// Last log index held.
    pub last_log_index: Option<u64>,
    /// Last log index applied to the state machine.
    pub applied_index: Option<u64>,
    /// Version of the applied tenant config.
    pub config_version: u64,
    /// Voters, id → base URL.
    pub members: BTreeMap<NodeId, String>,
    /// Learners, id → base URL.
    pub learners: BTreeMap<NodeId, String>,
    /// On the leader: entries each other member is behind the leader's last log.
    pub replication_lag: Option<BTreeMap<NodeId, u64>>,
    /// On the leader: ms since a quorum last acknowledged it.
    pub millis_since_quorum_ack: Option<u64>,
    /// On the leader: no quorum has acknowledged it for over `STALE_QUORUM_MS` (2 s), so it
    /// is cut off (openraft 0.9 keeps such a node in the leader role): it refuses writes
    /// and linearizable reads, and another leader may already be serving the majority.
    pub quorum_lost: bool,
}

/// A running member (voter or learner) of the tenant-config cluster.
///
/// Its Raft may stop underneath it: openraft's core quits on a storage error (a full
/// disk) and takes no further part in the cluster. The node's keeper then says so
/// ([`RaftNode::following`] fails, naming the cause), and starts Raft again from its store
/// once the data directory takes writes again; the new Raft catches up from the leader.
/// Subscribers ([`RaftNode::subscribe`]) and the `/raft/` routes carry over.
pub struct RaftNode {
    /// This node's id.
    node_id: NodeId,
    /// Client for forwarding writes, reads and joins.
    client: HttpClient,
    /// The applied configuration (one channel across restarts of Raft).
    state_rx: watch::Receiver<ConfigState>,
    /// The running Raft and what the `/raft/` handlers need of it; swapped on a restart.
    server: leader::ServerCell,
    /// The tasks of the running Raft, and its database.
    running: Arc<Mutex<Running>>,
    /// Deadline of writes and reads.
    write_timeout: Duration,
    /// [`Keeper`]: watches for a stop and starts Raft again; stopped at shutdown.
    keeper: tokio::task::JoinHandle<()>,
}

/// The tasks that live as long as one start of Raft.
#[derive(Default)]
struct Running {
    /// The database, flushed at shutdown; the `/raft/` handlers hold it weakly, so that
    /// it closes when this start's Raft is done with it.
    db: Option<Arc<redb::Database>>,
    /// A learner's background join.
    join_task: Option<tokio::task::JoinHandle<()>>,
    /// The election timer ([`elect::Elections`]).
    elections: Option<tokio::task::JoinHandle<()>>,
    /// [`publish_metrics`].
    gauges: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops the tasks and lets go of the database.
    async fn stop(&mut self) {
        for task in [
            self.join_task.take(),
            self.elections.take(),
            self.gauges.take(),
        ]
        .into_iter()
        .flatten()
        {
            task.abort();
            let _ = task.await;
        }
    }
}

/// Why a node does not follow the committed configuration ([`RaftNode::following`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NotFollowing {
    /// Its Raft stopped (a storage error); it is started again when the data directory
    /// takes writes.
    #[error("raft stopped ({cause}); it starts again from its store once the data directory takes writes")]
    Stopped {
        /// openraft's error.
        cause: String,
    },
    /// It has heard no leader since its Raft started.
    #[error("no raft leader heard since raft started")]
    NoLeaderYet,
    /// It has heard no leader for longer than the bound.
    #[error("no raft leader heard for {silent_ms} ms (the bound is {bound_ms} ms)")]
    LeaderSilent {
        /// Milliseconds since a leader was last heard.
        silent_ms: u64,
        /// The bound it was held to.
        bound_ms: u64,
    },
    /// It leads, but no quorum has acknowledged it for longer than the bound: another
    /// leader may serve the majority.
    #[error(
        "this leader has not heard from a quorum for {since_ms} ms (the bound is {bound_ms} ms)"
    )]
    QuorumSilent {
        /// Milliseconds since a quorum last acknowledged it.
        since_ms: u64,
        /// The bound it was held to.
        bound_ms: u64,
    },
}

impl std::fmt::Debug for RaftNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftNode")
            .field("node_id", &self.node_id)
            .finish()
    }
}

fn check_config(c: &NodeConfig) -> Vec<String> {
    let mut problems = Vec::new();
    let me = normalise_base(&c.http_addr);
    if let Err(e) = state::check_instance_url(&me) {
        problems.push(format!("http_addr {:?}: {e}", c.http_addr));
    }
    if c.voters.is_empty() {
        problems.push("voters: empty".into());
    }
    for (id, url) in &c.voters {
        let u = normalise_base(url);
        if let Err(e) = state::check_instance_url(&u) {
            problems.push(format!("voters[{id}] {url:?}: {e}"));
        }
        if *id == c.node_id && u != me {
            problems.push(format!(
                "voters[{id}] is {url:?} but http_addr is {:?}",
                c.http_addr
            ));
        }
    }
    let (lo, hi) = c.election_timeout;
    if c.heartbeat_interval.is_zero() || lo <= c.heartbeat_interval || hi <= lo {
        problems
            .push("election_timeout: need heartbeat_interval < election min < election max".into());
    }
    if c.write_timeout.is_zero() {
        problems.push("write_timeout: must be positive".into());
    }
    problems
}

/// How long the keeper waits between attempts to start a stopped Raft again.
const RESTART_PAUSE: Duration = Duration::from_secs(1);
/// Bytes the keeper writes (and removes) in the data directory before it starts a
/// stopped Raft again: room for a few log batches, so that a disk with a few bytes free
/// does not stop the new start at once.
const RESTART_PROBE_BYTES: usize = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens the store (publishing into `state_tx`), starts Raft, joins the cluster (a voter
/// initializes an empty one; a learner asks the voters in the background) and starts the
/// election timer and the gauges.
async fn launch(
    config: &NodeConfig,
    client: &HttpClient,
    state_tx: &watch::Sender<ConfigState>,
) -> Result<(ServerState, Running), StartError> {
    let me = normalise_base(&config.http_addr);
    let voters: BTreeMap<NodeId, BasicNode> = config
        .voters
        .iter()
        .map(|(id, u)| (*id, BasicNode::new(normalise_base(u))))
        .collect();
    let dir = config.data_dir.clone();
    let tx = state_tx.clone();
    let store = store::blocking(move || Ok(Store::open_publishing(&dir, Some(tx))))
        .await
        .map_err(|e| StartError::Raft(format!("store open task: {e}")))??;
    let db = store.database();
    let (log_store, state_machine) = store.into_parts();
    let raft_config = openraft::Config {
        cluster_name: config.cluster_name.clone(),
        heartbeat_interval: config.heartbeat_interval.as_millis() as u64,
        election_timeout_min: config.election_timeout.0.as_millis() as u64,
        election_timeout_max: config.election_timeout.1.as_millis() as u64,
        install_snapshot_timeout: 5_000,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(config.snapshot_every.max(1)),
        snapshot_max_chunk_size: 512 * 1024,
        max_in_snapshot_log_to_keep: config.logs_kept_after_snapshot,
        // [`elect::Elections`] stands for election, after a pre-vote.
        enable_elect: false,
        ..Default::default()
    }
    .validate()
    .map_err(|e| StartError::Raft(e.to_string()))?;
    let factory = NetworkFactory {
        node_id: config.node_id,
        client: client.clone(),
    };
    let raft = Raft::new(
        config.node_id,
        Arc::new(raft_config),
        factory,
        log_store,
        state_machine,
    )
    .await
    .map_err(|e| StartError::Raft(e.to_string()))?;
    let initialized = raft
        .is_initialized()
        .await
        .map_err(|e| StartError::Raft(e.to_string()))?;
    let mut join_task = None;
    if !initialized {
        if voters.contains_key(&config.node_id) {
            match raft.initialize(voters.clone()).await {
                Ok(()) => tracing::info!(node_id = config.node_id, "raft cluster initialized"),
                Err(RaftError::APIError(InitializeError::NotAllowed(_))) => {}
                Err(e) => return Err(StartError::Raft(e.to_string())),
            }
        } else {
            let req = JoinRequest {
                node_id: config.node_id,
                url: me.clone(),
            };
            let urls: Vec<String> = voters.values().map(|n| n.addr.clone()).collect();
            join_task = Some(tokio::spawn(join_loop(
                client.clone(),
                urls,
                req,
                config.write_timeout,
            )));
        }
    }
    let gauges = tokio::spawn(publish_metrics(raft.clone()));
    let contact = elect::Contact::new();
    let handing_off: Arc<std::sync::atomic::AtomicBool> = Default::default();
    let elections = tokio::spawn(
        elect::Elections {
            raft: raft.clone(),
            client: client.clone(),
            contact: contact.clone(),
            db: db.clone(),
            node_id: config.node_id,
            stopping: handing_off.clone(),
            tick: config.heartbeat_interval / 2,
            timeout: config.election_timeout,
            rng: rand::SeedableRng::seed_from_u64(
                config.election_seed.unwrap_or_else(rand::random),
            ),
        }
        .run(),
    );
    let server = ServerState {
        raft,
        auth_hash: config
            .auth_token
            .as_deref()
            .map(|t| blake3::hash(t.as_bytes())),
        write_timeout: config.write_timeout,
        contact,
        lease: config.election_timeout.1,
        handing_off,
        db: Arc::downgrade(&db),
    };
    let running = Running {
        db: Some(db),
        join_task,
        elections: Some(elections),
        gauges: Some(gauges),
    };
    Ok((server, running))
}

/// Watches a node's Raft; when it stops (openraft's core quits on a storage error), says
/// so and starts it again from its store once the data directory takes writes.
struct Keeper {
    config: NodeConfig,
    client: HttpClient,
    state_tx: watch::Sender<ConfigState>,
    server: leader::ServerCell,
    running: Arc<Mutex<Running>>,
}

impl Keeper {
    async fn run(self) {
        let node_id = self.config.node_id;
        metrics::describe_counter!(
            crate::metric_names::RAFT_STOPS_TOTAL,
            "Times this node's Raft stopped on an error (a storage error: a full disk) and left the cluster until started again."
        );
        metrics::describe_gauge!(
            crate::metric_names::RAFT_RUNNING,
            "1 while this node's Raft runs; 0 from a stop until its restart from the store."
        );
        metrics::counter!(crate::metric_names::RAFT_STOPS_TOTAL).increment(0);
        loop {
            metrics::gauge!(crate::metric_names::RAFT_RUNNING).set(1.0);
            let raft = leader::current(&self.server).raft;
            let cause = stopped_cause(&raft).await;
            metrics::counter!(crate::metric_names::RAFT_STOPS_TOTAL).increment(1);
            metrics::gauge!(crate::metric_names::RAFT_RUNNING).set(0.0);
            tracing::error!(node_id, %cause, "raft stopped: this node no longer follows the cluster's configuration; it starts raft again from its store once the data directory takes writes");
            // The stopped Raft stays in the cell until the new one replaces it: its
            // metrics keep saying why (`RaftNode::stop_cause`). Tasks first, then Raft:
            // the database closes once nothing holds it.
            let mut running = std::mem::take(&mut *lock(&self.running));
            running.stop().await;
            let _ = raft.shutdown().await;
            drop(raft);
            drop(running);
            let mut failures = 0u32;
            loop {
                tokio::time::sleep(RESTART_PAUSE).await;
                let restarted = match probe_writable(&self.config.data_dir).await {
                    Err(e) => Err(format!("the data directory takes no writes yet: {e}")),
                    Ok(()) => launch(&self.config, &self.client, &self.state_tx)
                        .await
                        .map_err(|e| e.to_string()),
                };
                match restarted {
                    Ok((server, running)) => {
                        *self.server.write().unwrap_or_else(|e| e.into_inner()) = server;
                        *lock(&self.running) = running;
                        tracing::warn!(node_id, "raft started again from its store; it follows the cluster once it hears the leader");
                        break;
                    }
                    Err(why) => {
                        // Once a minute while it lasts, not every second.
                        if failures.is_multiple_of(60) {
                            tracing::warn!(node_id, %why, "raft stays stopped");
                        }
                        failures += 1;
                    }
                }
            }
        }
    }
}

/// Waits until `raft` stops and returns why.
async fn stopped_cause(raft: &Raft<TypeConfig>) -> String {
    let mut rx = raft.metrics();
    loop {
        if let Err(fatal) = &rx.borrow_and_update().running_state {
            return fatal.to_string();
        }
        if rx.changed().await.is_err() {
            return "raft's core ended".to_string();
        }
    }
}

/// Writes [`RESTART_PROBE_BYTES`] to a file in `dir`, syncs it and removes it.
async fn probe_writable(dir: &std::path::Path) -> std::io::Result<()> {
    let path = dir.join(".warmpath-write-probe");
    let write = {
        let path = path.clone();
        move || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&path)?;
            f.write_all(&vec![0u8; RESTART_PROBE_BYTES])?;
            f.sync_all()
        }
    };
    let result = tokio::task::spawn_blocking(write)
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
    let _ = std::fs::remove_file(&path);
    result
}

impl RaftNode {
    /// Opens the store in `data_dir`, starts Raft, and joins the cluster: a voter
    /// initializes an empty cluster with `voters` (every voter does the same, which is safe);
    /// any other node asks the leader, in the background, to add it as a learner.
    pub async fn start(config: NodeConfig) -> Result<RaftNode, StartError> {
        let problems = check_config(&config);
        if !problems.is_empty() {
            return Err(StartError::Config(problems));
        }
        let client = match &config.transport {
            Some(t) => HttpClient::over(t.clone(), config.auth_token.clone()),
            None => HttpClient::new(config.connect_timeout, config.auth_token.clone()),
        };
        let (state_tx, state_rx) = watch::channel(ConfigState::default());
        describe_metrics();
        let (server, running) = launch(&config, &client, &state_tx).await?;
        let server = Arc::new(std::sync::RwLock::new(server));
        let running = Arc::new(Mutex::new(running));
        let keeper = tokio::spawn(
            Keeper {
                config: config.clone(),
                client: client.clone(),
                state_tx,
                server: server.clone(),
                running: running.clone(),
            }
            .run(),
        );
        Ok(RaftNode {
            node_id: config.node_id,
            client,
            state_rx,
            server,
            running,
            write_timeout: config.write_timeout,
            keeper,
        })
    }

    /// The running Raft (the one started last, which may have stopped).
    fn raft(&self) -> Raft<TypeConfig> {
        leader::current(&self.server).raft
    }

    /// Why this node's Raft is stopped, while it is: the stopped Raft's metrics say so
    /// until the keeper has started a new one.
    fn stop_cause(&self) -> Option<String> {
        match &self.raft().metrics().borrow().running_state {
            Err(fatal) => Some(fatal.to_string()),
            Ok(()) => None,
        }
    }

    /// Whether this node follows the committed configuration: its Raft runs, and it has
    /// heard a leader (or, leading, a quorum) within `bound`. A node whose Raft started
    /// again after a stop follows only once it has heard a leader since.
    pub fn following(&self, bound: Duration) -> Result<(), NotFollowing> {
        let bound_ms = bound.as_millis() as u64;
        let server = leader::current(&self.server);
        let metrics = server.raft.metrics();
        let m = metrics.borrow();
        if let Err(fatal) = &m.running_state {
            return Err(NotFollowing::Stopped {
                cause: fatal.to_string(),
            });
        }
        if m.state == openraft::ServerState::Leader {
            // A lone voter is its own quorum (openraft then counts no acknowledgements).
            let alone = m
                .membership_config
                .membership()
                .voter_ids()
                .all(|id| id == self.node_id);
            if alone {
                return Ok(());
            }
            return match m.millis_since_quorum_ack {
                Some(since_ms) if since_ms > bound_ms => {
                    Err(NotFollowing::QuorumSilent { since_ms, bound_ms })
                }
                _ => Ok(()),
            };
        }
        match server.contact.last_heard() {
            None => Err(NotFollowing::NoLeaderYet),
            Some(silent) if silent > bound => Err(NotFollowing::LeaderSilent {
                silent_ms: silent.as_millis() as u64,
                bound_ms,
            }),
            Some(_) => Ok(()),
        }
    }

    /// The `/raft/…` routes peers call; serve them at this node's `http_addr`.
    pub fn router(&self) -> axum::Router {
        network::router(self.server.clone())
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// Applies `cmd` through the leader and returns what applying it did. See the module
    /// docs for forwarding and for what a timeout means.
    pub async fn write(&self, cmd: Command) -> Result<CommandResult, WriteError> {
        // Every write is keyed, so that sending it again (to a new leader, or after a
        // connection broke) applies it at most once: the state machine answers a repeated
        // key with the first application's result.
        let cmd = match cmd {
            Command::V1(command) => Command::Once {
                key: self.write_key(),
                command,
            },
            keyed @ Command::Once { .. } => keyed,
        };
        // A leader that went silent with the write may still apply it: once it was left
        // with one, no error may say the write was not submitted.
        let mut abandoned: Option<String> = None;
        let result = self.write_attempts(cmd, &mut abandoned).await;
        match (result, abandoned) {
            (Ok(r), _) => Ok(r),
            (Err(e), None) => Err(e),
            (Err(e @ (WriteError::Timeout(_) | WriteError::Unknown(_))), Some(_)) => Err(e),
            (Err(e), Some(first)) => Err(WriteError::Unknown(format!(
                "the write went first to leader {first}, which stopped answering and may \
                 have applied it; then: {e}"
            ))),
        }
    }

    /// A key no other write of this cluster uses: this node's id, the wall clock in
    /// nanoseconds and a per-process counter.
    pub fn write_key(&self) -> String {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("n{}-{nanos:x}-{n}", self.node_id)
    }

    /// [`RaftNode::write`]'s attempts; `abandoned` names the first leader a forwarded
    /// write was left with, if any.
    async fn write_attempts(
        &self,
        cmd: Command,
        abandoned: &mut Option<String>,
    ) -> Result<CommandResult, WriteError> {
        let start = Instant::now();
        let deadline = start + self.write_timeout;
        let mut hint: Option<String> = None;
        let mut last_err = None;
        // Bounded by the deadline; the count only stops a loop that would spin.
        for _ in 0..MAX_WRITE_ATTEMPTS {
            // Out of time after an attempt that surely failed (the leader unreachable, no
            // leader change before the deadline): say so, rather than send the write again
            // with no time left and report a timeout, whose outcome would read "unknown".
            if Instant::now() >= deadline {
                if let Some(e) = last_err {
                    return Err(e);
                }
            }
            let target = match hint.take() {
                Some(url) => Target::Remote(url),
                None => match self.wait_leader(deadline).await {
                    Some(t) => t,
                    None => {
                        if let Some(cause) = self.stop_cause() {
                            return Err(WriteError::Stopped { cause });
                        }
                        return Err(last_err.unwrap_or(WriteError::NoLeader {
                            waited: start.elapsed(),
                        }));
                    }
                },
            };
            // A stopped Raft's metrics stay as they were: it may still name itself leader,
            // but it takes no write. (It forwards to another leader it names.)
            if matches!(target, Target::Local) {
                if let Some(cause) = self.stop_cause() {
                    return Err(WriteError::Stopped { cause });
                }
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            let reply = match &target {
                Target::Local => {
                    // openraft 0.9 keeps a cut-off leader leading: refuse at once rather
                    // than let the write wait out its timeout with an unknown outcome.
                    let since = self.raft().metrics().borrow().millis_since_quorum_ack;
                    if let Some(since_ms) = since.filter(|&ms| ms > STALE_QUORUM_MS) {
                        return Err(WriteError::NoQuorum { since_ms });
                    }
                    leader_write(&leader::current(&self.server), cmd.clone(), remaining).await
                }
                Target::Remote(url) => {
                    // The leader must not submit it once this node has answered.
                    let deadline_ms = unix_ms() + remaining.as_millis() as u64;
                    let forwarded = self.client.post_write(url, &cmd, deadline_ms, remaining);
                    // A paused or cut-off leader answers nothing: once a new leader
                    // becomes known, the write goes there instead of waiting out the
                    // timeout. (New: neither `url` nor the one known now, as a hint may
                    // name a leader this node has not heard of yet.)
                    let known = self.leader_url();
                    let answer = tokio::select! {
                        r = forwarded => Some(r),
                        () = self.wait_new_leader(url, known.as_deref(), deadline) => None,
                    };
                    let Some(answer) = answer else {
                        if Instant::now() >= deadline {
                            return Err(WriteError::Timeout(self.write_timeout));
                        }
                        tracing::info!(leader = %url, "the raft leader changed while it held a forwarded write; forwarding it to the new one");
                        abandoned.get_or_insert_with(|| url.clone());
                        continue;
                    };
                    match answer {
                        Ok(r) => r,
                        Err(HttpError::Timeout { .. }) => {
                            return Err(WriteError::Timeout(self.write_timeout))
                        }
                        Err(e) if e.is_unreachable() => {
                            // Not submitted: wait for the next leader and try again.
                            // A leader restarting (a rolling restart) is back in a
                            // fraction of a second, in the same term: try it again after
                            // a pause unless another leader is known first.
                            last_err = Some(WriteError::LeaderUnreachable {
                                leader_url: url.clone(),
                                message: e.to_string(),
                            });
                            let soon = (Instant::now() + RETRY_PAUSE).min(deadline);
                            self.wait_leader_change(url, soon).await;
                            continue;
                        }
                        Err(e @ HttpError::Transport { .. }) => {
                            // The connection broke after the write went out: the leader
                            // may have it. Being keyed, it can be sent again (to whoever
                            // leads by then) and applies at most once.
                            last_err = Some(WriteError::Unknown(e.to_string()));
                            abandoned.get_or_insert_with(|| url.clone());
                            let soon = (Instant::now() + RETRY_PAUSE).min(deadline);
                            self.wait_leader_change(url, soon).await;
                            continue;
                        }
                        Err(e) => return Err(WriteError::Failed(e.to_string())),
                    }
                }
            };
            match reply {
                // Keyed: whichever copy applied first, this is what applying it did.
                LeaderReply::Ok(r) => return Ok(r),
                LeaderReply::NotLeader { leader_url, .. } => {
                    last_err = Some(WriteError::NotLeader {
                        leader_url: leader_url.clone(),
                    });
                    let tried = self.url_of(&target);
                    if leader_url.is_none() || leader_url == tried {
                        // The node it went to stepped down and names no other (an
                        // election, as when a partitioned node rejoins with a higher
                        // term): not submitted, so wait for the election's leader rather
                        // than refuse a write the majority can take in a second.
                        self.wait_next_leader(tried.as_deref(), deadline).await;
                        if Instant::now() >= deadline {
                            break;
                        }
                    } else {
                        hint = leader_url;
                    }
                }
                LeaderReply::Timeout => return Err(WriteError::Timeout(self.write_timeout)),
                LeaderReply::Unknown(m) => {
                    // The leader lost its leadership with the write: send it again to the
                    // next one (keyed, it applies at most once).
                    last_err = Some(WriteError::Unknown(m));
                    let tried = self.url_of(&target);
                    abandoned.get_or_insert_with(|| tried.clone().unwrap_or_default());
                    self.wait_next_leader(tried.as_deref(), deadline).await;
                    if Instant::now() >= deadline {
                        break;
                    }
                }
                LeaderReply::NoQuorum(m) | LeaderReply::Failed(m) => {
                    return Err(WriteError::Failed(m))
                }
                LeaderReply::Late { late_ms } => return Err(WriteError::Late { late_ms }),
            }
        }
        Err(last_err.unwrap_or(WriteError::NoLeader {
            waited: start.elapsed(),
        }))
    }

    /// The configuration as of a point after this call started: confirmed with the leader
    /// and a quorum, then served from the local state once it has caught up.
    pub async fn read_linearizable(&self) -> Result<ConfigState, ReadError> {
        let start = Instant::now();
        let deadline = start + self.write_timeout;
        let Some(target) = self.wait_leader(deadline).await else {
            return Err(ReadError::NoLeader {
                waited: start.elapsed(),
            });
        };
        let remaining = deadline.saturating_duration_since(Instant::now());
        let reply = match &target {
            Target::Local => leader_read_index(&self.raft(), remaining).await,
            Target::Remote(url) => match self
                .client
                .post_json::<(), LeaderReply<u64>>(url, wire::PATH_READ_INDEX, &(), remaining)
                .await
            {
                Ok(r) => r,
                Err(HttpError::Timeout { .. }) => {
                    return Err(ReadError::Timeout(self.write_timeout))
                }
                Err(e) if e.is_unreachable() => {
                    return Err(ReadError::LeaderUnreachable {
                        leader_url: url.clone(),
                        message: e.to_string(),
                    })
                }
                Err(e) => return Err(ReadError::Failed(e.to_string())),
            },
        };
        let index = match reply {
            LeaderReply::Ok(i) => i,
            LeaderReply::NotLeader { leader_url, .. } => {
                return Err(ReadError::NotLeader { leader_url })
            }
            LeaderReply::NoQuorum(m) => return Err(ReadError::NoQuorum(m)),
            LeaderReply::Timeout => return Err(ReadError::Timeout(self.write_timeout)),
            LeaderReply::Unknown(m) | LeaderReply::Failed(m) => return Err(ReadError::Failed(m)),
            LeaderReply::Late { late_ms } => {
                return Err(ReadError::Failed(format!("late by {late_ms} ms")))
            }
        };
        let remaining = deadline.saturating_duration_since(Instant::now());
        self.raft()
            .wait(Some(remaining))
            .applied_index_at_least(Some(index), "linearizable read")
            .await
            .map_err(|_| ReadError::Timeout(self.write_timeout))?;
        Ok(self.local_state())
    }

    /// The locally applied configuration (for routing; may lag the leader).
    pub fn local_state(&self) -> ConfigState {
        self.state_rx.borrow().clone()
    }

    /// A receiver that sees every applied change of the configuration.
    pub fn subscribe(&self) -> watch::Receiver<ConfigState> {
        self.state_rx.clone()
    }

    /// This node's view of the cluster.
    pub fn status(&self) -> RaftStatus {
        let m = self.raft().metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voter_ids: BTreeSet<NodeId> = membership.voter_ids().collect();
        let mut members = BTreeMap::new();
        let mut learners = BTreeMap::new();
        for (id, node) in membership.nodes() {
            if voter_ids.contains(id) {
                members.insert(*id, node.addr.clone());
            } else {
                learners.insert(*id, node.addr.clone());
            }
        }
        let last = m.last_log_index.unwrap_or(0);
        let replication_lag = m.replication.as_ref().map(|r| {
            r.iter()
                .filter(|(id, _)| **id != self.node_id)
                .map(|(id, matched)| {
                    (
                        *id,
                        last.saturating_sub(matched.map(|l| l.index).unwrap_or(0)),
                    )
                })
                .collect()
        });
        RaftStatus {
            node_id: self.node_id,
            role: format!("{:?}", m.state),
            leader: m.current_leader,
            leader_url: m
                .current_leader
                .and_then(|l| membership.get_node(&l).map(|n| n.addr.clone())),
            term: m.current_term,
            last_log_index: m.last_log_index,
            applied_index: m.last_applied.map(|l| l.index),
            config_version: self.state_rx.borrow().version,
            members,
            learners,
            replication_lag,
            millis_since_quorum_ack: m.millis_since_quorum_ack,
            quorum_lost: quorum_lost(m.millis_since_quorum_ack),
        }
    }

    /// Makes the given nodes the voters (they must already be members, e.g. joined
    /// learners); runs on the leader only.
    pub async fn change_voters(&self, voters: BTreeSet<NodeId>) -> Result<(), WriteError> {
        let raft = self.raft();
        match leader::membership_change(self.write_timeout, || {
            raft.change_membership(ChangeMembers::ReplaceAllVoters(voters.clone()), true)
        })
        .await
        {
            Err(_) => Err(WriteError::Timeout(self.write_timeout)),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                Err(WriteError::NotLeader {
                    leader_url: f.leader_node.map(|n| n.addr),
                })
            }
            Ok(Err(e)) => Err(WriteError::Failed(e.to_string())),
        }
    }

    /// Removes learner `id` from the group (it stops receiving the log); runs on the leader
    /// only. `Ok(false)` when `id` is no learner; a voter is refused (change the voters
    /// first).
    pub async fn remove_learner(&self, id: NodeId) -> Result<bool, WriteError> {
        {
            let m = self.raft().metrics().borrow().clone();
            let membership = m.membership_config.membership();
            if membership.voter_ids().any(|v| v == id) {
                return Err(WriteError::Failed(format!(
                    "node {id} is a voter: change the voters before removing it"
                )));
            }
            if membership.get_node(&id).is_none() {
                return Ok(false);
            }
        }
        let raft = self.raft();
        match leader::membership_change(self.write_timeout, || {
            raft.change_membership(ChangeMembers::RemoveNodes(BTreeSet::from([id])), false)
        })
        .await
        {
            Err(_) => Err(WriteError::Timeout(self.write_timeout)),
            Ok(Ok(_)) => {
                tracing::info!(node_id = id, "raft learner removed");
                Ok(true)
            }
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                Err(WriteError::NotLeader {
                    leader_url: f.leader_node.map(|n| n.addr),
                })
            }
            Ok(Err(e)) => Err(WriteError::Failed(e.to_string())),
        }
    }

    /// A leader about to stop hands its leadership to the most up-to-date other voter,
    /// as etcd does: it takes no more writes (they wait for the next leader), stops its
    /// heartbeats and asks that voter to stand as soon as its lease runs out, then waits
    /// (at most `within`) until a newer leader is known. Returns whether one is. A node
    /// that does not lead, or leads alone, does nothing.
    pub async fn hand_off(&self, within: Duration) -> bool {
        let server = leader::current(&self.server);
        let m = server.raft.metrics().borrow().clone();
        if m.state != openraft::ServerState::Leader || m.running_state.is_err() {
            return false;
        }
        let membership = m.membership_config.membership();
        let last = m.last_log_index;
        // Among the other voters, the one that has matched most of this leader's log.
        let target = membership
            .voter_ids()
            .filter(|id| *id != self.node_id)
            .filter_map(|id| {
                let matched = m
                    .replication
                    .as_ref()?
                    .get(&id)
                    .copied()
                    .flatten()
                    .map(|l| l.index);
                Some((matched, id))
            })
            .max()
            .and_then(|(matched, id)| Some((matched, membership.get_node(&id)?.addr.clone())));
        let Some((matched, url)) = target else {
            return false;
        };
        server
            .handing_off
            .store(true, std::sync::atomic::Ordering::Release);
        server.raft.runtime_config().heartbeat(false);
        let deadline = Instant::now() + within;
        // Entries already proposed still replicate; the target must hold them all.
        if matched < last {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::info!(node_id = self.node_id, to = %url, "stopping: handing the raft leadership off");
        if let Err(e) = self
            .client
            .post_json::<(), LeaderReply<()>>(&url, wire::PATH_STAND, &(), within)
            .await
        {
            tracing::warn!(to = %url, error = %e, "the leadership hand-off was not taken; the voters elect a leader themselves");
        }
        let term = m.current_term;
        let mut rx = server.raft.metrics();
        loop {
            {
                let now = rx.borrow_and_update();
                if now.current_term > term && now.current_leader.is_some_and(|l| l != self.node_id)
                {
                    tracing::info!(node_id = self.node_id, leader = ?now.current_leader, "raft leadership handed off");
                    return true;
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }

    /// Stops Raft (peers then see this node as unreachable) and makes the store durable.
    pub async fn shutdown(&self) {
        self.keeper.abort();
        let mut running = std::mem::take(&mut *lock(&self.running));
        running.stop().await;
        if let Err(e) = self.raft().shutdown().await {
            tracing::warn!(node_id = self.node_id, error = %e, "raft shutdown failed");
        }
        let Some(db) = running.db.take() else {
            return;
        };
        match store::blocking(move || Ok(store::flush(&db))).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(node_id = self.node_id, error = %e, "raft store flush failed")
            }
            Err(e) => {
                tracing::warn!(node_id = self.node_id, error = %e, "raft store flush task failed")
            }
        }
    }

    /// Waits until a leader is known; `None` at the deadline.
    async fn wait_leader(&self, deadline: Instant) -> Option<Target> {
        let mut rx = self.raft().metrics();
        loop {
            {
                let m = rx.borrow_and_update();
                if let Some(l) = m.current_leader {
                    if l == self.node_id {
                        return Some(Target::Local);
                    }
                    if let Some(n) = m.membership_config.membership().get_node(&l) {
                        return Some(Target::Remote(n.addr.clone()));
                    }
                }
                if m.running_state.is_err() {
                    return None;
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    /// The base URL of `target` (this node's own when it leads).
    fn url_of(&self, target: &Target) -> Option<String> {
        match target {
            Target::Local => self.leader_url(),
            Target::Remote(url) => Some(url.clone()),
        }
    }

    /// The base URL of the leader this node knows of.
    fn leader_url(&self) -> Option<String> {
        leader_url_of(&self.raft().metrics().borrow())
    }

    /// Waits until the leader is no longer `url` (or the deadline).
    async fn wait_leader_change(&self, url: &str, deadline: Instant) {
        self.wait_leader_url(|current, _| current != Some(url), deadline)
            .await
    }

    /// Waits until a leader other than `url` and than `known` (the one known when the
    /// write went to `url`) is known, or the deadline.
    async fn wait_new_leader(&self, url: &str, known: Option<&str>, deadline: Instant) {
        self.wait_leader_url(
            |current, _| current.is_some_and(|c| c != url) && current != known,
            deadline,
        )
        .await
    }

    /// Waits until a leader is known that is not `tried` or was elected in a later term
    /// than the current one (or the deadline).
    async fn wait_next_leader(&self, tried: Option<&str>, deadline: Instant) {
        let term = self.raft().metrics().borrow().current_term;
        self.wait_leader_url(
            |current, now| current.is_some() && (current != tried || now > term),
            deadline,
        )
        .await
    }

    /// Waits until `done` holds of the leader's base URL this node knows of and the
    /// current term (or the deadline).
    ///
    /// A stopped Raft's metrics no longer change (their channel closes): that is no
    /// change of leader, so the wait then lasts to the deadline.
    async fn wait_leader_url(&self, done: impl Fn(Option<&str>, u64) -> bool, deadline: Instant) {
        let mut rx = self.raft().metrics();
        loop {
            {
                let m = rx.borrow_and_update();
                if done(leader_url_of(&m).as_deref(), m.current_term) {
                    return;
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return tokio::time::sleep_until(deadline).await,
                Err(_) => return,
            }
        }
    }
}

/// The base URL of the leader `m` names, if its membership knows it.
fn leader_url_of(m: &openraft::RaftMetrics<NodeId, BasicNode>) -> Option<String> {
    m.current_leader.and_then(|l| {
        m.membership_config
            .membership()
            .get_node(&l)
            .map(|n| n.addr.clone())
    })
}

/// Where a leader-only operation runs.
enum Target {
    /// Here: this node leads.
    Local,
    /// At the leader's base URL.
    Remote(String),
}

/// A learner asks the voters, in turn, to add it, until one (the leader) does.
async fn join_loop(client: HttpClient, voters: Vec<String>, req: JoinRequest, timeout: Duration) {
    if voters.is_empty() {
        return;
    }
    let mut next: Option<String> = None;
    let mut i = 0usize;
    loop {
        let url = match next.take() {
            Some(u) => u,
            None => {
                let u = voters[i % voters.len()].clone();
                i += 1;
                u
            }
        };
        match client
            .post_json::<_, LeaderReply<()>>(&url, wire::PATH_JOIN, &req, timeout)
            .await
        {
            Ok(LeaderReply::Ok(())) => {
                tracing::info!(node_id = req.node_id, leader = %url, "joined raft cluster as learner");
                return;
            }
            Ok(LeaderReply::NotLeader {
                leader_url: Some(l),
                ..
            }) if l != url => {
                next = Some(l);
                continue;
            }
            Ok(other) => tracing::debug!(node_id = req.node_id, %url, ?other, "raft join refused"),
            Err(e) => tracing::debug!(node_id = req.node_id, %url, error = %e, "raft join failed"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
