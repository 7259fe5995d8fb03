//! What a node does as the leader, for itself and for the peers that forward to it: a
//! write ([`leader_write`]), a read index ([`leader_read_index`]) and a learner's join
//! ([`leader_join`]), each answered as a [`LeaderReply`]; and [`ServerState`], what the
//! `/raft/` handlers ([`super::network`]) and the node ([`super::RaftNode`]) share of the
//! running Raft.

use super::elect::Contact;
use super::state::{self, Command, CommandResult};
use super::store::{NodeId, TypeConfig};
use super::wire::{normalise_base, JoinRequest, LeaderReply};
use openraft::error::{ChangeMembershipError, CheckIsLeaderError, ClientWriteError, RaftError};
use openraft::raft::ClientWriteResponse;
use openraft::{BasicNode, Raft};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// What the HTTP handlers need.
#[derive(Clone)]
pub(crate) struct ServerState {
    /// The local Raft node.
    pub(crate) raft: Raft<TypeConfig>,
    /// blake3 of the expected bearer token, when one is required.
    pub(crate) auth_hash: Option<blake3::Hash>,
    /// How long a forwarded write may wait for its commit.
    pub(crate) write_timeout: Duration,
    /// When a leader was last heard; the append and snapshot handlers touch it.
    pub(crate) contact: Contact,
    /// The leader lease (the top of the election range), for pre-vote answers.
    pub(crate) lease: Duration,
    /// Set while this leader hands its leadership off before it stops: it takes no write
    /// (a write then waits for the next leader).
    pub(crate) handing_off: Arc<std::sync::atomic::AtomicBool>,
    /// The store, for this node's last log id in pre-vote answers; weak, so that a
    /// stopped Raft's database closes (the node's keeper opens it again).
    pub(crate) db: std::sync::Weak<redb::Database>,
}

impl std::fmt::Debug for ServerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerState")
            .field("auth", &self.auth_hash.is_some())
            .field("write_timeout", &self.write_timeout)
            .finish()
    }
}

/// The handlers' [`ServerState`], swapped whole when the node's Raft is started again
/// (see [`super::RaftNode`]'s keeper): every request reads the current one.
pub(crate) type ServerCell = Arc<std::sync::RwLock<ServerState>>;

/// The current state of `cell`.
pub(crate) fn current(cell: &ServerCell) -> ServerState {
    cell.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// What openraft answers a membership change.
pub(crate) type MembershipReply =
    Result<ClientWriteResponse<TypeConfig>, RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>>;

/// Runs the membership change `change` within `within`, again each time openraft refuses
/// it because an earlier change is not yet committed. That is passing: a leader elected
/// with an earlier leader's change in its log commits it with its first entry, and the
/// change an operator asked for should then go through rather than fail.
pub(crate) async fn membership_change<F, Fut>(
    within: Duration,
    mut change: F,
) -> Result<MembershipReply, tokio::time::error::Elapsed>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = MembershipReply>,
{
    tokio::time::timeout(within, async {
        loop {
            match change().await {
                Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(
                    ChangeMembershipError::InProgress(pending),
                ))) => {
                    tracing::debug!(%pending, "a membership change waits for the one before");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                reply => return reply,
            }
        }
    })
    .await
}

fn not_leader<E>(f: &openraft::error::ForwardToLeader<NodeId, BasicNode>) -> LeaderReply<E> {
    LeaderReply::NotLeader {
        leader_id: f.leader_id,
        leader_url: f.leader_node.as_ref().map(|n| n.addr.clone()),
    }
}

/// Proposes `cmd` on this node, which should be the leader. A leader handing its
/// leadership off (see [`super::RaftNode::hand_off`]) takes no write: it answers "not the
/// leader" naming none, so the writer waits for the next leader, as in an election.
pub(crate) async fn leader_write(
    server: &ServerState,
    cmd: Command,
    timeout: Duration,
) -> LeaderReply<CommandResult> {
    if server
        .handing_off
        .load(std::sync::atomic::Ordering::Acquire)
    {
        return LeaderReply::NotLeader {
            leader_id: None,
            leader_url: None,
        };
    }
    match tokio::time::timeout(timeout, server.raft.client_write(cmd)).await {
        Err(_) => LeaderReply::Timeout,
        Ok(Ok(resp)) => LeaderReply::Ok(resp.data),
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => not_leader(&f),
        Ok(Err(RaftError::APIError(e))) => LeaderReply::Failed(e.to_string()),
        // Raft stopped or failed with the write possibly in its log.
        Ok(Err(RaftError::Fatal(f))) => LeaderReply::Unknown(f.to_string()),
    }
}

/// Confirms leadership with a quorum and returns the index a reader must have applied.
pub(crate) async fn leader_read_index(
    raft: &Raft<TypeConfig>,
    timeout: Duration,
) -> LeaderReply<u64> {
    match tokio::time::timeout(timeout, raft.get_read_log_id()).await {
        Err(_) => LeaderReply::Timeout,
        Ok(Ok((read_log_id, _))) => LeaderReply::Ok(read_log_id.map(|l| l.index).unwrap_or(0)),
        Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => not_leader(&f),
        Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(q)))) => {
            LeaderReply::NoQuorum(q.to_string())
        }
        Ok(Err(e)) => LeaderReply::Failed(e.to_string()),
    }
}

/// Adds a learner on this node, which should be the leader.
pub(crate) async fn leader_join(
    raft: &Raft<TypeConfig>,
    req: JoinRequest,
    timeout: Duration,
) -> LeaderReply<()> {
    let url = normalise_base(&req.url);
    if let Err(e) = state::check_instance_url(&url) {
        return LeaderReply::Failed(format!("url {:?}: {e}", req.url));
    }
    {
        let m = raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        if let Some(n) = membership.get_node(&req.node_id) {
            if n.addr == url {
                return LeaderReply::Ok(());
            }
            if membership.voter_ids().any(|v| v == req.node_id) {
                return LeaderReply::Failed(format!(
                    "node {} is a voter at {}; refusing to move it to {url}",
                    req.node_id, n.addr
                ));
            }
        }
    }
    match membership_change(timeout, || {
        raft.add_learner(req.node_id, BasicNode::new(&url), false)
    })
    .await
    {
        Err(_) => LeaderReply::Timeout,
        Ok(Ok(_)) => {
            tracing::info!(node_id = req.node_id, %url, "raft learner added");
            LeaderReply::Ok(())
        }
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => not_leader(&f),
        Ok(Err(e)) => LeaderReply::Failed(e.to_string()),
    }
}
