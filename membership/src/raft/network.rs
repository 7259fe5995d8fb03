//! Raft RPCs over HTTP between routers: the axum routes a node serves under `/raft/`, and
//! the client side openraft uses to reach peers (hyper-util's pooled HTTP/1 client, or a
//! simulated network: [`PeerTransport`]).
//!
//! Bodies are JSON. Peer RPCs (`append`, `vote`, `snapshot`) carry openraft's own request
//! types and answer `Result<response, RaftError>`; `pre-vote` is warmpath's own (see
//! [`super::elect`]); leader-only operations (`write`,
//! `read-index`, `join`) answer a [`LeaderReply`]. A node that has shut down answers 503.
//!
//! Client errors are classified once, here, into openraft's [`RPCError`] kinds: refused
//! connections and 503 are `Unreachable` (openraft backs off), an expired deadline is
//! `Timeout`, an error decoded from the peer is `RemoteError`, anything else (bad status,
//! undecodable body, broken connection) is `Network`.

use super::elect::{answer, Contact, PreVoteRequest, PATH_PRE_VOTE};
use super::state::{Command, CommandResult};
use super::store::{self, NodeId, TypeConfig};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable,
};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RPCTypes, Raft, RaftNetwork, RaftNetworkFactory};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

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

/// What a failed HTTP call to a peer ran into.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HttpError {
    /// No connection could be made (refused, unresolvable, connect timeout).
    #[error("cannot connect to {url}: {message}")]
    Connect {
        /// The URL called.
        url: String,
        /// The cause.
        message: String,
    },
    /// The deadline passed before a full answer arrived.
    #[error("{url}: no answer within {timeout:?}")]
    Timeout {
        /// The URL called.
        url: String,
        /// The deadline.
        timeout: Duration,
    },
    /// The peer answered with a non-success status.
    #[error("{url}: status {status}: {body}")]
    Status {
        /// The URL called.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The connection broke, or the body was too large or not the expected JSON.
    #[error("{url}: {message}")]
    Transport {
        /// The URL called.
        url: String,
        /// The cause.
        message: String,
    },
}

impl HttpError {
    /// Whether the peer is down or refusing work (the caller should back off).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, HttpError::Connect { .. })
            || matches!(self, HttpError::Status { status, .. } if *status == 503)
    }
}

/// What a [`PeerTransport`] could not do.
#[derive(Debug, Clone)]
pub enum SendError {
    /// No connection could be made: nothing was delivered.
    Connect(String),
    /// The request went out but no whole answer came back: it may have been delivered.
    Broken(String),
}

/// The future a [`PeerTransport`] returns: the answer's status and body.
pub type SendFuture = Pin<Box<dyn Future<Output = Result<(u16, Bytes), SendError>> + Send>>;

/// How peer calls travel. Production uses [`HyperTransport`] (HTTP/1 over TCP); the
/// deterministic simulation test hands every node a simulated network instead, which
/// delivers the same requests to the same `/raft/` handlers with seeded delay, loss and
/// partitions.
pub trait PeerTransport: Send + Sync + std::fmt::Debug + 'static {
    /// Sends one request and returns the answer's status and (at most
    /// [`MAX_BODY_BYTES`]) body.
    fn send(&self, req: hyper::Request<Bytes>) -> SendFuture;
}

/// Peer calls over TCP: hyper-util's pooled HTTP/1 client.
#[derive(Debug, Clone)]
pub struct HyperTransport {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl HyperTransport {
    /// A client that gives up connecting after `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> HyperTransport {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        HyperTransport { client }
    }
}

impl PeerTransport for HyperTransport {
    fn send(&self, req: hyper::Request<Bytes>) -> SendFuture {
        let sent = self.client.request(req.map(Full::new));
        Box::pin(async move {
            let resp = sent.await.map_err(|e| {
                if e.is_connect() {
                    SendError::Connect(e.to_string())
                } else {
                    SendError::Broken(e.to_string())
                }
            })?;
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map_err(|e| SendError::Broken(format!("body: {e}")))?
                .to_bytes();
            Ok((status, body))
        })
    }
}

/// A client for peer calls: JSON bodies, the peer bearer token, deadlines, and errors
/// classified into [`HttpError`], over any [`PeerTransport`].
#[derive(Debug, Clone)]
pub struct HttpClient {
    transport: Arc<dyn PeerTransport>,
    auth_token: Option<String>,
}

impl HttpClient {
    /// A client over TCP that gives up connecting after `connect_timeout` and sends
    /// `auth_token`, if any, as a bearer token.
    pub fn new(connect_timeout: Duration, auth_token: Option<String>) -> HttpClient {
        HttpClient::over(Arc::new(HyperTransport::new(connect_timeout)), auth_token)
    }

    /// A client over `transport`.
    pub fn over(transport: Arc<dyn PeerTransport>, auth_token: Option<String>) -> HttpClient {
        HttpClient {
            transport,
            auth_token,
        }
    }

    /// POSTs `body` as JSON to `base + path` and decodes the JSON answer, all within
    /// `timeout`.
    pub async fn post_json<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        base: &str,
        path: &str,
        body: &Req,
        timeout: Duration,
    ) -> Result<Resp, HttpError> {
        let url = format!("{}{path}", base.trim_end_matches('/'));
        match tokio::time::timeout(timeout, self.post_inner(&url, body, None)).await {
            Ok(r) => r,
            Err(_) => Err(HttpError::Timeout { url, timeout }),
        }
    }

    /// Forwards a write to the leader at `base`, which must not submit it after
    /// `deadline_ms` (its wall clock, ms since the Unix epoch; see [`WRITE_DEADLINE_HEADER`]).
    pub async fn post_write(
        &self,
        base: &str,
        cmd: &Command,
        deadline_ms: u64,
        timeout: Duration,
    ) -> Result<LeaderReply<CommandResult>, HttpError> {
        let url = format!("{}{PATH_WRITE}", base.trim_end_matches('/'));
        let deadline = Some((WRITE_DEADLINE_HEADER, deadline_ms.to_string()));
        match tokio::time::timeout(timeout, self.post_inner(&url, cmd, deadline)).await {
            Ok(r) => r,
            Err(_) => Err(HttpError::Timeout { url, timeout }),
        }
    }

    async fn post_inner<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        url: &str,
        body: &Req,
        header: Option<(&str, String)>,
    ) -> Result<Resp, HttpError> {
        let transport = |message: String| HttpError::Transport {
            url: url.to_string(),
            message,
        };
        let bytes = serde_json::to_vec(body).map_err(|e| transport(format!("encode: {e}")))?;
        let mut req = hyper::Request::post(url).header("content-type", "application/json");
        if let Some(t) = &self.auth_token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if let Some((name, value)) = header {
            req = req.header(name, value);
        }
        let req = req
            .body(Bytes::from(bytes))
            .map_err(|e| transport(format!("request: {e}")))?;
        let (status, body) = self.transport.send(req).await.map_err(|e| match e {
            SendError::Connect(message) => HttpError::Connect {
                url: url.to_string(),
                message,
            },
            SendError::Broken(message) => transport(message),
        })?;
        if !(200..300).contains(&status) {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
            return Err(HttpError::Status {
                url: url.to_string(),
                status,
                body: text,
            });
        }
        serde_json::from_slice(&body).map_err(|e| transport(format!("decode: {e}")))
    }
}

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
/// (see `RaftNode`'s keeper): every request reads the current one.
pub(crate) type ServerCell = Arc<std::sync::RwLock<ServerState>>;

/// The current state of `cell`.
pub(crate) fn current(cell: &ServerCell) -> ServerState {
    cell.read().unwrap_or_else(|e| e.into_inner()).clone()
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
        let now = super::unix_ms();
        if now > deadline {
            let late: LeaderReply<CommandResult> = LeaderReply::Late {
                late_ms: now - deadline,
            };
            return Json(late).into_response();
        }
    }
    let r: LeaderReply<CommandResult> = super::leader_write(&s, cmd, s.write_timeout).await;
    Json(r).into_response()
}

async fn read_index(State(cell): State<ServerCell>) -> Response {
    let s = current(&cell);
    if let Some(r) = stopped(&s) {
        return r;
    }
    Json(super::leader_read_index(&s.raft, s.write_timeout).await).into_response()
}

async fn join(State(cell): State<ServerCell>, Json(req): Json<JoinRequest>) -> Response {
    let s = current(&cell);
    if let Some(r) = stopped(&s) {
        return r;
    }
    Json(super::leader_join(&s.raft, req, s.write_timeout).await).into_response()
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
