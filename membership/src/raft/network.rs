//! Raft RPCs over HTTP between routers: the axum routes a node serves under `/raft/`, and
//! openraft's peer connections, which call peers through [`super::client`] (hyper-util's
//! pooled HTTP/1 client, or a simulated network). The paths and bodies are in
//! [`super::wire`].
//!
//! Bodies are JSON. Peer RPCs (`append`, `vote`, `snapshot`) carry openraft's own request
//! types and answer `Result<response, RaftError>`; `pre-vote` is warmpath's own (see
//! [`super::elect`]); leader-only operations (`write`,
//! `read-index`, `join`) run in `super::leader` and answer a [`LeaderReply`]. A node that
//! has shut down answers 503.
//!
//! Client errors are classified once, here, into openraft's [`RPCError`] kinds: refused
//! connections and 503 are `Unreachable` (openraft backs off), an expired deadline is
//! `Timeout`, an error decoded from the peer is `RemoteError`, anything else (bad status,
//! undecodable body, broken connection) is `Network`.

use super::client::{HttpClient, HttpError};
use super::clock::unix_ms;
use super::elect::{answer, PreVoteRequest, PATH_PRE_VOTE};
use super::leader::{
    current, leader_join, leader_read_index, leader_write, ServerCell, ServerState,
};
use super::state::{Command, CommandResult};
use super::store::{self, NodeId, TypeConfig};
use super::wire::{
    JoinRequest, LeaderReply, MAX_BODY_BYTES, PATH_APPEND, PATH_JOIN, PATH_READ_INDEX,
    PATH_SNAPSHOT, PATH_STAND, PATH_VOTE, PATH_WRITE, WRITE_DEADLINE_HEADER,
};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable,
};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RPCTypes, RaftNetwork, RaftNetworkFactory};
use serde::{de::DeserializeOwned, Serialize};

/// Creates a [`PeerConnection`] per target for openraft.
#[derive(Debug, Clone)]
pub struct NetworkFactory {
    /// This node's id, for timeout errors.
    pub node_id: NodeId,
    /// The shared client.
    pub client: HttpClient,
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerConnection {
        PeerConnection {
            node_id: self.node_id,
            target,
            url: node.addr.clone(),
            client: self.client.clone(),
        }
    }
}

/// openraft's view of one peer.
#[derive(Debug, Clone)]
pub struct PeerConnection {
    node_id: NodeId,
    target: NodeId,
    url: String,
    client: HttpClient,
}

impl PeerConnection {
    async fn call<Req, Resp, E>(
        &self,
        path: &str,
        action: RPCTypes,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let ttl = option.hard_ttl();
        let got: Result<Result<Resp, RaftError<NodeId, E>>, HttpError> =
            self.client.post_json(&self.url, path, req, ttl).await;
        match got {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(remote)) => Err(RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                BasicNode::new(&self.url),
                remote,
            ))),
            Err(HttpError::Timeout { .. }) => Err(RPCError::Timeout(Timeout {
                action,
                id: self.node_id,
                target: self.target,
                timeout: ttl,
            })),
            Err(e) if e.is_unreachable() => Err(RPCError::Unreachable(Unreachable::new(&e))),
            Err(e) => Err(RPCError::Network(NetworkError::new(&e))),
        }
    }
}

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(PATH_APPEND, RPCTypes::AppendEntries, &rpc, &option)
            .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call(PATH_SNAPSHOT, RPCTypes::InstallSnapshot, &rpc, &option)
            .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(PATH_VOTE, RPCTypes::Vote, &rpc, &option).await
    }
}

/// The `/raft/…` routes of one node. The peer token is checked by a layer that runs
/// before any handler, so an unauthenticated request is refused before its body is read
/// or parsed.
pub(crate) fn router(state: ServerCell) -> Router {
    Router::new()
        .route(PATH_APPEND, post(append))
        .route(PATH_VOTE, post(vote))
        .route(PATH_PRE_VOTE, post(pre_vote))
        .route(PATH_SNAPSHOT, post(snapshot))
        .route(PATH_WRITE, post(write))
        .route(PATH_READ_INDEX, post(read_index))
        .route(PATH_JOIN, post(join))
        .route(PATH_STAND, post(stand))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_peer_token,
        ))
        .with_state(state)
}

/// Refuses a request without the peer token before anything reads its body.
async fn require_peer_token(
    State(cell): State<ServerCell>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let s = current(&cell);
    if !authorized(&s, request.headers()) {
        metrics::counter!(crate::metric_names::RAFT_UNAUTHORIZED_REQUESTS_TOTAL).increment(1);
        return unauthorized();
    }
    next.run(request).await
}

fn authorized(state: &ServerState, headers: &HeaderMap) -> bool {
    let Some(expected) = &state.auth_hash else {
        return true;
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Comparing digests keeps the comparison independent of where the strings differ.
    blake3::hash(given.as_bytes()) == *expected
}

fn unauthorized() -> Response {
    (StatusCode::UNAUTHORIZED, "missing or wrong raft token").into_response()
}

/// Answers a peer RPC; a stopped node answers 503 so that callers see it as unreachable.
fn rpc_reply<T: Serialize, E: std::error::Error + Serialize>(
    r: Result<T, RaftError<NodeId, E>>,
) -> Response {
    match r {
        Err(RaftError::Fatal(f)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("raft stopped: {f}"),
        )
            .into_response(),
        other => Json(other).into_response(),
    }
}

async fn append(
    State(cell): State<ServerCell>,
    Json(rpc): Json<AppendEntriesRequest<TypeConfig>>,
) -> Response {
    let s = current(&cell);
    let r = s.raft.append_entries(rpc).await;
    // Anything but a higher vote means the sender leads this node's term.
    if matches!(&r, Ok(resp) if !matches!(resp, AppendEntriesResponse::HigherVote(_))) {
        s.contact.touch();
    }
    rpc_reply(r)
}

async fn vote(State(cell): State<ServerCell>, Json(rpc): Json<VoteRequest<NodeId>>) -> Response {
    let s = current(&cell);
    rpc_reply(s.raft.vote(rpc).await)
}

async fn snapshot(
    State(cell): State<ServerCell>,
    Json(rpc): Json<InstallSnapshotRequest<TypeConfig>>,
) -> Response {
    let s = current(&cell);
    let vote = rpc.vote;
    let r = s.raft.install_snapshot(rpc).await;
    if matches!(&r, Ok(resp) if resp.vote == vote) {
        s.contact.touch();
    }
    rpc_reply(r)
}

/// Answers a pre-vote from what this node has heard and stored; changes nothing.
async fn pre_vote(State(cell): State<ServerCell>, Json(req): Json<PreVoteRequest>) -> Response {
    let s = current(&cell);
    if let Some(r) = stopped(&s) {
        return r;
    }
    let leading = {
        let m = s.raft.metrics();
        let m = m.borrow();
        m.state == openraft::ServerState::Leader
            && m.millis_since_quorum_ack
                .is_none_or(|ms| ms <= s.lease.as_millis() as u64)
    };
    let Some(db) = s.db.upgrade() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "raft stopped").into_response();
    };
    let mine = match store::last_log_id(&db).await {
        Ok(last) => last,
        Err(e) => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot read the last log id: {e}"),
            )
                .into_response()
        }
    };
    Json(answer(&req, mine, s.contact.silence(), s.lease, leading)).into_response()
}

/// A stopped node takes no leader work: 503 tells the caller nothing was submitted.
fn stopped(s: &ServerState) -> Option<Response> {
    let m = s.raft.metrics();
    let stopped = m.borrow().running_state.is_err();
    stopped.then(|| (StatusCode::SERVICE_UNAVAILABLE, "raft stopped").into_response())
}

async fn write(
    State(cell): State<ServerCell>,
    headers: HeaderMap,
    Json(cmd): Json<Command>,
) -> Response {
    let s = current(&cell);
    if let Some(r) = stopped(&s) {
        return r;
    }
    let deadline = headers
        .get(WRITE_DEADLINE_HEADER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(deadline) = deadline {
        let now = unix_ms();
        if now > deadline {
            let late: LeaderReply<CommandResult> = LeaderReply::Late {
                late_ms: now - deadline,
            };
            return Json(late).into_response();
        }
    }
    let r: LeaderReply<CommandResult> = leader_write(&s, cmd, s.write_timeout).await;
    Json(r).into_response()
}

async fn read_index(State(cell): State<ServerCell>) -> Response {
    let s = current(&cell);
    if let Some(r) = stopped(&s) {
        return r;
    }
    Json(leader_read_index(&s.raft, s.write_timeout).await).into_response()
}

async fn join(State(cell): State<ServerCell>, Json(req): Json<JoinRequest>) -> Response {
    let s = current(&cell);
    if let Some(r) = stopped(&s) {
        return r;
    }
    Json(leader_join(&s.raft, req, s.write_timeout).await).into_response()
}

/// The leader asks this voter to take over: it stands for election as soon as it has not
/// heard the leader for the lease (openraft's voters refuse a vote inside it), without a
/// pre-vote. Answers at once; the election runs in the background.
async fn stand(State(cell): State<ServerCell>) -> Response {
    let s = current(&cell);
    if let Some(r) = stopped(&s) {
        return r;
    }
    tokio::spawn(super::elect::stand_after_lease(
        s.raft.clone(),
        s.contact.clone(),
        s.lease,
    ));
    Json(LeaderReply::<()>::Ok(())).into_response()
}
