//! The `/raft/` HTTP contract between routers, beyond openraft's own RPC types: the paths,
//! the forwarded write's deadline header, the body size limit, and the bodies of warmpath's
//! leader-only operations ([`LeaderReply`], [`JoinRequest`]). The server
//! ([`super::network`]) and the client ([`super::client`]) both read it here; the pre-vote's
//! own path and bodies are the election's ([`super::elect`]).

use super::store::NodeId;
use serde::{Deserialize, Serialize};

/// Path of the AppendEntries RPC.
pub const PATH_APPEND: &str = "/raft/append";
/// Path of the RequestVote RPC.
pub const PATH_VOTE: &str = "/raft/vote";
/// Path of the InstallSnapshot RPC (chunked by openraft).
pub const PATH_SNAPSHOT: &str = "/raft/snapshot";
/// Path of a write forwarded to the leader.
pub const PATH_WRITE: &str = "/raft/write";
/// On a forwarded write: the leader's wall-clock time (ms since the Unix epoch) after which
/// it must not submit the write. The forwarding node has answered its client by then, so a
/// request delivered late (held in a partition, say) is refused, not applied behind an
/// answer the client already acted on. Routers' clocks are assumed within a second or so
/// of each other (NTP); a skew shifts the window by as much.
pub const WRITE_DEADLINE_HEADER: &str = "x-warmpath-write-deadline-ms";
/// Path of a linearizable read-index request to the leader.
pub const PATH_READ_INDEX: &str = "/raft/read-index";
/// Path of a learner's request to join.
pub const PATH_JOIN: &str = "/raft/join";
/// Path of the leader's hand-off request: "stand for election as soon as my lease has
/// run out" (Raft's TimeoutNow, thesis section 3.10).
pub const PATH_STAND: &str = "/raft/stand";

/// Largest request or response body, bytes (snapshot chunks are 512 KiB before JSON).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// The answer of a leader-only operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum LeaderReply<T> {
    /// Done.
    Ok(T),
    /// This node is not the leader; the leader it knows of, if any.
    NotLeader {
        /// Id of the leader.
        leader_id: Option<NodeId>,
        /// Base URL of the leader.
        leader_url: Option<String>,
    },
    /// The leader could not confirm its leadership with a quorum.
    NoQuorum(String),
    /// The leader accepted the write but did not see it committed in time: outcome unknown.
    Timeout,
    /// The leader failed after accepting the write (e.g. it stopped): outcome unknown.
    Unknown(String),
    /// Anything else (shutting down, storage failure, bad request).
    Failed(String),
    /// A forwarded write reached the leader after its deadline: it was not submitted.
    Late {
        /// How far past the deadline, ms.
        late_ms: u64,
    },
}

/// A learner's request to be added to the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    /// The learner's node id.
    pub node_id: NodeId,
    /// The learner's base URL.
    pub url: String,
}

/// A peer's base URL as the cluster stores it: no trailing `/`, `http://` when it names
/// no scheme.
pub(crate) fn normalise_base(url: &str) -> String {
    let u = url.trim_end_matches('/');
    if u.contains("://") {
        u.to_string()
    } else {
        format!("http://{u}")
    }
}
