//! The client side of the `/raft/` RPCs: [`HttpClient`] (JSON bodies, the peer bearer
//! token, deadlines, errors classified into [`HttpError`]) over a [`PeerTransport`]:
//! hyper-util's pooled HTTP/1 client ([`HyperTransport`]) in production, a simulated
//! network in the deterministic simulation. openraft's peer connections
//! ([`super::network`]), the election's pre-vote ([`super::elect`]) and [`super::RaftNode`]'s
//! forwarding all call peers through it.

use super::state::{Command, CommandResult};
use super::wire::{LeaderReply, MAX_BODY_BYTES, PATH_WRITE, WRITE_DEADLINE_HEADER};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{de::DeserializeOwned, Serialize};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

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
