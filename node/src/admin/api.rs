//! The admin HTTP API: tenants, pools and instances in Raft, cluster and Raft status, index
//! statistics and route explain, under `/admin/v1`, JSON, bearer-token authenticated.
//!
//! Reads are linearizable (read-index through the leader) unless `?consistency=local`; every
//! read answer carries the config `version`, also sent as `ETag: "N"`. Every write is a
//! compare-and-set when the client sends `If-Match: N` or `?expected_version=N`.
//!
//! Errors are classified once, here ([`AdminError`]): a missing or wrong token 401, bad input
//! 400 with a message saying what is wrong (a refused command also lists every bad field in
//! `"problems"`), not found 404, a stale version 409 with `"current_version"`, a write sent
//! to a follower that names a leader 421 with `"leader_url"`, no leader or no quorum 503 with
//! `Retry-After`, and a write whose outcome is unknown 504 saying it MAY have been applied.
//! Error bodies have the gateway's OpenAI shape, `{"error": {"message", "type", "code"}}`.
//!
//! Plain API keys never reach Raft: they are hashed (blake3, lowercase hex) on arrival.

use super::openapi;
use super::wire::{ExplainInput, InstanceInput, KeyInput, TenantInput, PREFIX};
use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use warmpath_membership::raft::state::{
    canonical_instance_url, is_key_hash, Command, CommandResult, CommandV1, ConfigState, PoolSpec,
    MAX_WRITE_KEY_BYTES,
};
use warmpath_membership::raft::{RaftNode, ReadError, WriteError};

/// Seconds a client should wait before retrying a 503.
pub const RETRY_AFTER_S: u64 = 1;

/// What the admin API needs from the running router.
pub struct AdminDeps {
    pub raft: Arc<RaftNode>,
    /// blake3 of the admin token; requests must send `Authorization: Bearer <token>`.
    pub token_hash: [u8; 32],
    /// Router-side facts (implemented by the lead for the running router).
    pub router: Arc<dyn RouterInfo>,
}

impl std::fmt::Debug for AdminDeps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token hash stays out of logs.
        f.debug_struct("AdminDeps").finish_non_exhaustive()
    }
}

/// Facts only the running router knows.
pub trait RouterInfo: Send + Sync {
    fn index_stats(&self) -> serde_json::Value;
    /// A routing dry run for `tenant` and an OpenAI request body (completions or chat): the
    /// explained decision, or (status, message).
    fn explain(&self, tenant: &str, body: &[u8]) -> Result<serde_json::Value, (u16, String)>;
    /// Gossip peers and this router's node id, as JSON.
    fn cluster(&self) -> serde_json::Value;
}

/// The admin routes, all behind the bearer token.
pub fn routes(deps: Arc<AdminDeps>) -> Router {
    let p = |s: &str| format!("{PREFIX}{s}");
    Router::new()
        .route(&p("/openapi.json"), get(openapi_doc))
        .route(&p("/tenants"), get(list_tenants))
        .route(
            &p("/tenants/{id}"),
            get(get_tenant).put(put_tenant).delete(delete_tenant),
        )
        .route(&p("/tenants/{id}/api-keys"), post(add_key))
        .route(
            &p("/tenants/{id}/api-keys/{hash}"),
            axum::routing::delete(remove_key),
        )
        .route(&p("/pools"), get(list_pools))
        .route(
            &p("/pools/{model}"),
            get(get_pool).put(put_pool).delete(delete_pool),
        )
        .route(
            &p("/pools/{model}/instances"),
            post(add_instance).delete(remove_instance),
        )
        .route(&p("/cluster"), get(cluster))
        .route(
            &p("/cluster/learners/{id}"),
            axum::routing::delete(remove_learner),
        )
        .route(&p("/index"), get(index))
        .route(&p("/route/explain"), post(explain))
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(deps.clone(), require_token))
        .with_state(deps)
}

/// An error at the admin API's edge; [`AdminError::into_response`] is the one place that
/// turns it into a status code and body.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No or a wrong admin token.
    #[error("{0}")]
    Unauthorized(String),
    /// The request is malformed: bad JSON, header, path or query parameter.
    #[error("{0}")]
    BadRequest(String),
    /// The command was refused; each problem names its field.
    #[error("invalid {what}: {}", problems.join("; "))]
    Invalid {
        /// What was refused ("tenant", "pool", ...).
        what: &'static str,
        /// Every bad field.
        problems: Vec<String>,
    },
    /// The tenant, pool, instance, key or path does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// The path exists but not with this method.
    #[error("method {0} not allowed here")]
    MethodNotAllowed(String),
    /// The request body is over the limit.
    #[error("request body too large")]
    TooLarge,
    /// `If-Match` / `expected_version` is stale; nothing changed.
    #[error(
        "version conflict: the configuration is at version {current_version}, not the \
         expected one; nothing changed: re-read and retry"
    )]
    Conflict {
        /// The configuration's version now.
        current_version: u64,
    },
    /// The write reached a node that is not the leader; the leader is known.
    #[error("this node is not the raft leader; the leader is {leader_url}")]
    NotLeader {
        /// The leader's Raft base URL.
        leader_url: String,
    },
    /// No leader or no quorum now; retrying later may succeed.
    #[error("{0}; retry in {RETRY_AFTER_S} s")]
    Unavailable(String),
    /// A write was sent but not seen committed: it MAY have been applied.
    /// The second field says how to retry safely.
    #[error("{0}; the write MAY have been applied: never assume it was lost. {1}")]
    OutcomeUnknown(String, String),
    /// A read did not finish in time.
    #[error("{0}")]
    Timeout(String),
    /// The router refused an explain request with this status.
    #[error("{message}")]
    Router {
        /// HTTP status the router chose.
        status: u16,
        /// Its message.
        message: String,
    },
    /// Anything else (storage failed, Raft shut down).
    #[error("{0}")]
    Internal(String),
}

impl AdminError {
    fn status(&self) -> StatusCode {
        match self {
            AdminError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            AdminError::BadRequest(_) | AdminError::Invalid { .. } => StatusCode::BAD_REQUEST,
            AdminError::NotFound(_) => StatusCode::NOT_FOUND,
            AdminError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            AdminError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            AdminError::Conflict { .. } => StatusCode::CONFLICT,
            AdminError::NotLeader { .. } => StatusCode::MISDIRECTED_REQUEST,
            AdminError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            AdminError::OutcomeUnknown(..) | AdminError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            AdminError::Router { status, .. } => StatusCode::from_u16(*status)
                .ok()
                .filter(|s| s.is_client_error() || s.is_server_error())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            AdminError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI-style error type, and a finer machine-readable code.
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            AdminError::Unauthorized(_) => ("authentication_error", "unauthorized"),
            AdminError::BadRequest(_) => ("invalid_request_error", "bad_request"),
            AdminError::Invalid { .. } => ("invalid_request_error", "invalid"),
            AdminError::NotFound(_) => ("not_found_error", "not_found"),
            AdminError::MethodNotAllowed(_) => ("invalid_request_error", "method_not_allowed"),
            AdminError::TooLarge => ("invalid_request_error", "too_large"),
            AdminError::Conflict { .. } => ("conflict_error", "version_conflict"),
            AdminError::NotLeader { .. } => ("service_unavailable", "not_leader"),
            AdminError::Unavailable(_) => ("service_unavailable", "unavailable"),
            AdminError::OutcomeUnknown(..) => ("service_unavailable", "outcome_unknown"),
            AdminError::Timeout(_) => ("service_unavailable", "timeout"),
            AdminError::Router { status, .. } if *status < 500 => {
                ("invalid_request_error", "router")
            }
            AdminError::Router { .. } => ("service_unavailable", "router"),
            AdminError::Internal(_) => ("internal_error", "internal"),
        }
    }

    /// The JSON body of this error.
    pub fn body(&self) -> Value {
        let (kind, code) = self.kind();
        let mut v = json!({"error": {"message": self.to_string(), "type": kind, "code": code}});
        match self {
            AdminError::Invalid { problems, .. } => v["problems"] = json!(problems),
            AdminError::Conflict { current_version } => {
                v["current_version"] = json!(current_version)
            }
            AdminError::NotLeader { leader_url } => v["leader_url"] = json!(leader_url),
            _ => {}
        }
        v
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut resp = json_response(status, None, &self.body());
        let h = resp.headers_mut();
        match self {
            AdminError::Unauthorized(_) => {
                h.insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"warmpath-admin\""),
                );
            }
            AdminError::Unavailable(_) => {
                h.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
            }
            AdminError::Router { .. } if status == StatusCode::SERVICE_UNAVAILABLE => {
                h.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
            }
            _ => {}
        }
        resp
    }
}

/// Classifies a failed write.
/// Classifies a failed write (of the command keyed `key`, if it was keyed).
fn write_error(e: WriteError, key: Option<&str>) -> AdminError {
    match e {
        WriteError::NotLeader {
            leader_url: Some(ref u),
        } => AdminError::NotLeader {
            leader_url: u.clone(),
        },
        WriteError::NotLeader { leader_url: None }
        | WriteError::NoLeader { .. }
        | WriteError::NoQuorum { .. }
        | WriteError::LeaderUnreachable { .. }
        | WriteError::Stopped { .. }
        | WriteError::Late { .. } => AdminError::Unavailable(e.to_string()),
        WriteError::Timeout(_) | WriteError::Unknown(_) => {
            let how = match key {
                Some(k) => format!(
                    "Send it again with the header `Idempotency-Key: {k}`: it then applies at \
                     most once. Or re-read the configuration and retry with \
                     ?expected_version=V (the version you read), so that it applies only if \
                     nothing changed since"
                ),
                None => "Re-read the configuration before retrying".to_string(),
            };
            AdminError::OutcomeUnknown(e.to_string(), how)
        }
        WriteError::Failed(_) => AdminError::Internal(e.to_string()),
    }
}

/// Classifies a failed linearizable read.
fn read_error(e: ReadError) -> AdminError {
    match e {
        ReadError::NoLeader { .. }
        | ReadError::NoQuorum(_)
        | ReadError::NotLeader { .. }
        | ReadError::LeaderUnreachable { .. } => AdminError::Unavailable(format!(
            "{e}: this node cannot serve a linearizable read now \
             (`?consistency=local` reads its possibly stale copy)"
        )),
        ReadError::Timeout(_) => AdminError::Timeout(format!(
            "{e}; retry, or read with `?consistency=local` (possibly stale)"
        )),
        ReadError::Failed(_) => AdminError::Internal(e.to_string()),
    }
}

type ApiResult = Result<Response, AdminError>;

/// A JSON answer, with `ETag: "version"` when it is about the config.
fn json_response(status: StatusCode, version: Option<u64>, body: &Value) -> Response {
    let mut resp = Response::new(Body::from(serde_json::to_vec(body).unwrap_or_default()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(v) = version {
        if let Ok(etag) = HeaderValue::from_str(&format!("\"{v}\"")) {
            h.insert(header::ETAG, etag);
        }
    }
    resp
}

fn read_ok(version: u64, body: Value) -> ApiResult {
    Ok(json_response(StatusCode::OK, Some(version), &body))
}

fn write_ok(created: bool, version: u64, mut body: Value) -> ApiResult {
    body["version"] = json!(version);
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(json_response(status, Some(version), &body))
}

/// Checks `Authorization: Bearer <token>` against the token's hash, in constant time.
fn check_token(headers: &HeaderMap, token_hash: &[u8; 32]) -> Result<(), AdminError> {
    let unauthorized = |m: &str| AdminError::Unauthorized(m.to_string());
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(|| unauthorized("no admin token: send `Authorization: Bearer <token>`"))?;
    let value = value
        .to_str()
        .map_err(|_| unauthorized("the Authorization header is not text"))?;
    let (scheme, token) = value.split_once(' ').unwrap_or((value, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(unauthorized("Authorization must be `Bearer <token>`"));
    }
    let token = token.trim();
    if token.is_empty() {
        return Err(unauthorized("empty admin token"));
    }
    // blake3::Hash compares in constant time.
    if blake3::hash(token.as_bytes()) == blake3::Hash::from(*token_hash) {
        Ok(())
    } else {
        Err(unauthorized("wrong admin token"))
    }
}

async fn require_token(State(d): State<Arc<AdminDeps>>, req: Request, next: Next) -> Response {
    match check_token(req.headers(), &d.token_hash) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

async fn no_route(uri: Uri) -> AdminError {
    AdminError::NotFound(format!("path {:?}", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method) -> AdminError {
    AdminError::MethodNotAllowed(method.to_string())
}

/// The query parameters any endpoint knows; each endpoint says which it accepts.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    expected_version: Option<String>,
    consistency: Option<String>,
    url: Option<String>,
}

fn params(uri: &Uri, allowed: &[&str]) -> Result<Params, AdminError> {
    let p = Query::<Params>::try_from_uri(uri)
        .map(|q| q.0)
        .map_err(|e| AdminError::BadRequest(format!("query string: {}", e.body_text())))?;
    let given = [
        ("expected_version", p.expected_version.is_some()),
        ("consistency", p.consistency.is_some()),
        ("url", p.url.is_some()),
    ];
    for (name, present) in given {
        if present && !allowed.contains(&name) {
            return Err(AdminError::BadRequest(format!(
                "query parameter {name:?} is not accepted here"
            )));
        }
    }
    Ok(p)
}

/// The compare-and-set version of a write: `If-Match` or `?expected_version`.
/// The compare-and-set precondition of a write with no other query parameter.
/// The `Idempotency-Key` header: 1 to 128 visible ASCII characters.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, AdminError> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    match v.to_str() {
        Ok(k)
            if !k.is_empty()
                && k.len() <= MAX_WRITE_KEY_BYTES
                && k.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Ok(Some(k.to_string()))
        }
        _ => Err(AdminError::BadRequest(format!(
            "Idempotency-Key: give 1 to {MAX_WRITE_KEY_BYTES} visible ASCII characters"
        ))),
    }
}

fn precondition(uri: &Uri, headers: &HeaderMap) -> Result<Option<u64>, AdminError> {
    expected_version(headers, &params(uri, &["expected_version"])?)
}

fn expected_version(headers: &HeaderMap, p: &Params) -> Result<Option<u64>, AdminError> {
    let parse = |what: &str, s: &str| {
        s.parse::<u64>().map_err(|_| {
            AdminError::BadRequest(format!(
                "{what} {s:?}: give the config version, a non-negative integer"
            ))
        })
    };
    let from_header = match headers.get(header::IF_MATCH) {
        None => None,
        Some(v) => {
            let s = v
                .to_str()
                .map_err(|_| AdminError::BadRequest("If-Match: not text".into()))?
                .trim();
            if s == "*" {
                None
            } else {
                let bare = s.strip_prefix("W/").unwrap_or(s);
                let bare = bare
                    .strip_prefix('"')
                    .and_then(|b| b.strip_suffix('"'))
                    .unwrap_or(bare);
                Some(parse("If-Match", bare)?)
            }
        }
    };
    let from_query = match p.expected_version.as_deref() {
        None => None,
        Some(s) => Some(parse("expected_version", s)?),
    };
    match (from_header, from_query) {
        (Some(a), Some(b)) if a != b => Err(AdminError::BadRequest(format!(
            "If-Match ({a}) and expected_version ({b}) disagree"
        ))),
        (a, b) => Ok(a.or(b)),
    }
}

/// The configuration, linearizable unless `?consistency=local`.
async fn read_state(d: &AdminDeps, p: &Params) -> Result<ConfigState, AdminError> {
    match p.consistency.as_deref() {
        None | Some("linearizable") => d.raft.read_linearizable().await.map_err(read_error),
        Some("local") => Ok(d.raft.local_state()),
        Some(other) => Err(AdminError::BadRequest(format!(
            "consistency {other:?}: give linearizable (the default) or local"
        ))),
    }
}

/// Writes `cmd` through Raft under the request's `Idempotency-Key` (or a new key); the
/// new version when applied. A repeated key gets the first write's result.
async fn write(
    d: &AdminDeps,
    headers: &HeaderMap,
    what: &'static str,
    cmd: CommandV1,
) -> Result<u64, AdminError> {
    let key = match idempotency_key(headers)? {
        Some(k) => k,
        None => d.raft.write_key(),
    };
    let keyed = Command::Once {
        key: key.clone(),
        command: cmd,
    };
    match d
        .raft
        .write(keyed)
        .await
        .map_err(|e| write_error(e, Some(&key)))?
    {
        CommandResult::Applied { version } => Ok(version),
        CommandResult::Conflict { current_version } => {
            Err(AdminError::Conflict { current_version })
        }
        CommandResult::Invalid { problems } => Err(AdminError::Invalid { what, problems }),
        CommandResult::NotFound { what } => Err(AdminError::NotFound(what)),
    }
}

fn parse_body<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    what: &str,
) -> Result<T, AdminError> {
    decode_body(&received(body)?, what)
}

/// The body as read, or why it could not be.
fn received(body: Result<Bytes, BytesRejection>) -> Result<Bytes, AdminError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            AdminError::TooLarge
        } else {
            AdminError::BadRequest(format!("request body: {}", e.body_text()))
        }
    })
}

/// A JSON body as `T`, or a 400 naming `what` was expected.
pub(crate) fn decode_body<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T, AdminError> {
    if body.is_empty() {
        return Err(AdminError::BadRequest(format!(
            "empty request body: send {what} as JSON"
        )));
    }
    serde_json::from_slice(body)
        .map_err(|e| AdminError::BadRequest(format!("{what}: malformed JSON: {e}")))
}

/// A body for a stored type: parsed like [`parse_body`], but fields `T` does not have are
/// refused here, at the edge, with serde's words ("unknown field `x`, expected one of …").
/// The stored types themselves ignore unknown fields (a newer router may add one), and a
/// flattened input cannot refuse them through serde.
fn parse_strict<T: DeserializeOwned + Serialize + Default>(
    body: Result<Bytes, BytesRejection>,
    what: &str,
) -> Result<T, AdminError> {
    decode_strict(&received(body)?, what)
}

/// [`parse_strict`] of bytes already read.
pub(crate) fn decode_strict<T: DeserializeOwned + Serialize + Default>(
    body: &[u8],
    what: &str,
) -> Result<T, AdminError> {
    let value: Value = decode_body(body, what)?;
    let known = serde_json::to_value(T::default()).unwrap_or_default();
    let Some(object) = value.as_object() else {
        return Err(AdminError::BadRequest(format!(
            "{what}: send a JSON object"
        )));
    };
    if let Some(unknown) = object.keys().find(|k| known.get(k.as_str()).is_none()) {
        let expected: Vec<String> = known
            .as_object()
            .map(|o| o.keys().map(|k| format!("`{k}`")).collect())
            .unwrap_or_default();
        return Err(AdminError::BadRequest(format!(
            "{what}: unknown field `{unknown}`, expected one of {}",
            expected.join(", ")
        )));
    }
    serde_json::from_value(value).map_err(|e| AdminError::BadRequest(format!("{what}: {e}")))
}

fn path<T>(p: Result<Path<T>, PathRejection>) -> Result<T, AdminError> {
    p.map(|p| p.0)
        .map_err(|e| AdminError::BadRequest(format!("path: {}", e.body_text())))
}

/// The stored form of a plain API key (what the router compares).
pub use warmpath_membership::raft::state::api_key_hash as hash_key;
use warmpath_membership::raft::state::check_plain_key;

async fn openapi_doc() -> Response {
    json_response(StatusCode::OK, None, &openapi::document())
}

async fn list_tenants(State(d): State<Arc<AdminDeps>>, uri: Uri) -> ApiResult {
    let p = params(&uri, &["consistency"])?;
    let s = read_state(&d, &p).await?;
    read_ok(
        s.version,
        json!({"version": s.version, "tenants": s.tenants}),
    )
}

async fn get_tenant(
    State(d): State<Arc<AdminDeps>>,
    id: Result<Path<String>, PathRejection>,
    uri: Uri,
) -> ApiResult {
    let id = path(id)?;
    let p = params(&uri, &["consistency"])?;
    let s = read_state(&d, &p).await?;
    let t = s
        .tenants
        .get(&id)
        .ok_or_else(|| AdminError::NotFound(format!("tenant {id:?}")))?;
    read_ok(
        s.version,
        json!({"version": s.version, "id": id, "tenant": t}),
    )
}

async fn put_tenant(
    State(d): State<Arc<AdminDeps>>,
    id: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let id = path(id)?;
    let expected = precondition(&uri, &headers)?;
    if let Err(why) = warmpath_membership::raft::state::check_tenant_id(&id) {
        return Err(AdminError::Invalid {
            what: "tenant",
            problems: vec![why],
        });
    }
    let spec = parse_strict::<TenantInput>(body, "tenant")?
        .into_spec(&id)
        .map_err(|problems| AdminError::Invalid {
            what: "tenant",
            problems,
        })?;
    // Created or replaced, as far as this node had seen before the write.
    let created = !d.raft.local_state().tenants.contains_key(&id);
    let version = write(
        &d,
        &headers,
        "tenant",
        CommandV1::PutTenant {
            id: id.clone(),
            spec: spec.clone(),
            expected_version: expected,
        },
    )
    .await?;
    write_ok(created, version, json!({"id": id, "tenant": spec}))
}

async fn delete_tenant(
    State(d): State<Arc<AdminDeps>>,
    id: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
) -> ApiResult {
    let id = path(id)?;
    let expected_version = precondition(&uri, &headers)?;
    let version = write(
        &d,
        &headers,
        "tenant",
        CommandV1::DeleteTenant {
            id,
            expected_version,
        },
    )
    .await?;
    write_ok(false, version, json!({}))
}

async fn add_key(
    State(d): State<Arc<AdminDeps>>,
    id: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let tenant = path(id)?;
    let expected_version = precondition(&uri, &headers)?;
    let input: KeyInput = parse_body(body, "api key")?;
    check_plain_key(&input.key).map_err(|why| AdminError::Invalid {
        what: "api key",
        problems: vec![format!("key: {why}")],
    })?;
    let key_hash = hash_key(&input.key);
    let version = write(
        &d,
        &headers,
        "api key",
        CommandV1::AddApiKey {
            tenant,
            key_hash: key_hash.clone(),
            expected_version,
        },
    )
    .await?;
    write_ok(true, version, json!({"key_hash": key_hash}))
}

async fn remove_key(
    State(d): State<Arc<AdminDeps>>,
    ids: Result<Path<(String, String)>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
) -> ApiResult {
    let (tenant, hash) = path(ids)?;
    let expected_version = precondition(&uri, &headers)?;
    let key_hash = hash.to_ascii_lowercase();
    if !is_key_hash(&key_hash) {
        return Err(AdminError::BadRequest(
            "hash: give the key's blake3 hash, 64 hex digits (never the key itself)".into(),
        ));
    }
    let version = write(
        &d,
        &headers,
        "api key",
        CommandV1::RemoveApiKey {
            tenant,
            key_hash,
            expected_version,
        },
    )
    .await?;
    write_ok(false, version, json!({}))
}

async fn list_pools(State(d): State<Arc<AdminDeps>>, uri: Uri) -> ApiResult {
    let p = params(&uri, &["consistency"])?;
    let s = read_state(&d, &p).await?;
    read_ok(s.version, json!({"version": s.version, "pools": s.pools}))
}

async fn get_pool(
    State(d): State<Arc<AdminDeps>>,
    model: Result<Path<String>, PathRejection>,
    uri: Uri,
) -> ApiResult {
    let model = path(model)?;
    let p = params(&uri, &["consistency"])?;
    let s = read_state(&d, &p).await?;
    let pool = s
        .pools
        .get(&model)
        .ok_or_else(|| AdminError::NotFound(format!("pool {model:?}")))?;
    read_ok(
        s.version,
        json!({"version": s.version, "model": model, "pool": pool}),
    )
}

async fn put_pool(
    State(d): State<Arc<AdminDeps>>,
    model: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let model = path(model)?;
    let expected_version = precondition(&uri, &headers)?;
    let mut spec: PoolSpec = parse_strict(body, "pool")?;
    spec.instances = spec
        .instances
        .iter()
        .map(|u| canonical_instance_url(u))
        .collect();
    // The state machine checks the tokenizer's name; whether it loads (a tokenizer.json
    // here, a template that compiles) is checked on the router taking the write, so that a
    // typo is a 400 now rather than a pool tokenized with the built-in tokenizer later.
    if let Err(e) = crate::prompt::PoolText::load(&spec.tokenizer, &spec.chat_template) {
        return Err(AdminError::BadRequest(format!("pool: {e}")));
    }
    let created = !d.raft.local_state().pools.contains_key(&model);
    let version = write(
        &d,
        &headers,
        "pool",
        CommandV1::PutPool {
            model: model.clone(),
            spec: spec.clone(),
            expected_version,
        },
    )
    .await?;
    write_ok(created, version, json!({"model": model, "pool": spec}))
}

async fn delete_pool(
    State(d): State<Arc<AdminDeps>>,
    model: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
) -> ApiResult {
    let model = path(model)?;
    let expected_version = precondition(&uri, &headers)?;
    let version = write(
        &d,
        &headers,
        "pool",
        CommandV1::DeletePool {
            model,
            expected_version,
        },
    )
    .await?;
    write_ok(false, version, json!({}))
}

async fn add_instance(
    State(d): State<Arc<AdminDeps>>,
    model: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let model = path(model)?;
    let expected_version = precondition(&uri, &headers)?;
    let input: InstanceInput = parse_body(body, "instance")?;
    let version = write(
        &d,
        &headers,
        "instance",
        CommandV1::AddInstance {
            model,
            url: canonical_instance_url(&input.url),
            expected_version,
        },
    )
    .await?;
    write_ok(true, version, json!({}))
}

async fn remove_instance(
    State(d): State<Arc<AdminDeps>>,
    model: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
) -> ApiResult {
    let model = path(model)?;
    let p = params(&uri, &["expected_version", "url"])?;
    let expected_version = expected_version(&headers, &p)?;
    let Some(url) = p.url else {
        return Err(AdminError::BadRequest(
            "give the instance to remove as `?url=http://host:port`".into(),
        ));
    };
    let version = write(
        &d,
        &headers,
        "instance",
        CommandV1::RemoveInstance {
            model,
            url: canonical_instance_url(&url),
            expected_version,
        },
    )
    .await?;
    write_ok(false, version, json!({}))
}

async fn cluster(State(d): State<Arc<AdminDeps>>, uri: Uri) -> ApiResult {
    params(&uri, &[])?;
    let status = d.raft.status();
    let version = status.config_version;
    read_ok(
        version,
        json!({"version": version, "raft": status, "gossip": d.router.cluster()}),
    )
}

/// Removes a Raft learner (a router that joined, or anything that joined as one): it
/// stops receiving the log. Voters are changed otherwise.
async fn remove_learner(
    State(d): State<Arc<AdminDeps>>,
    id: Result<Path<u64>, PathRejection>,
    uri: Uri,
) -> ApiResult {
    params(&uri, &[])?;
    let id = path(id)?;
    match d.raft.remove_learner(id).await {
        Ok(true) => {
            let version = d.raft.local_state().version;
            write_ok(false, version, json!({"removed_learner": id}))
        }
        Ok(false) => Err(AdminError::NotFound(format!("learner {id}"))),
        Err(WriteError::Failed(why)) if why.contains("is a voter") => {
            Err(AdminError::BadRequest(why))
        }
        Err(e) => Err(write_error(e, None)),
    }
}

async fn index(State(d): State<Arc<AdminDeps>>, uri: Uri) -> ApiResult {
    params(&uri, &[])?;
    let version = d.raft.local_state().version;
    read_ok(
        version,
        json!({"version": version, "index": d.router.index_stats()}),
    )
}

async fn explain(
    State(d): State<Arc<AdminDeps>>,
    uri: Uri,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    params(&uri, &[])?;
    let input: ExplainInput = parse_body(body, "explain request")?;
    let mut problems = Vec::new();
    if input.tenant.is_empty() {
        problems.push("tenant: empty".to_string());
    }
    if !input.request.is_object() {
        problems.push("request: must be an OpenAI completions or chat request object".to_string());
    }
    if !problems.is_empty() {
        return Err(AdminError::Invalid {
            what: "explain request",
            problems,
        });
    }
    let request = serde_json::to_vec(&input.request).unwrap_or_default();
    let decision = d
        .router
        .explain(&input.tenant, &request)
        .map_err(|(status, message)| AdminError::Router { status, message })?;
    let version = d.raft.local_state().version;
    read_ok(
        version,
        json!({"version": version, "tenant": input.tenant, "decision": decision}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::cli::Reply;
    use crate::admin::testing::{Harness, TOKEN};
    use axum::http::Method;
    use std::time::Duration;

    /// How a case authenticates.
    #[derive(Clone, Copy)]
    enum Auth {
        Good,
        Missing,
        Wrong,
    }

    /// What a case checks at a JSON pointer of the answer.
    enum Expect {
        Eq(Value),
        Number,
        Contains(&'static str),
        Absent,
    }

    struct Case {
        name: &'static str,
        auth: Auth,
        method: Method,
        /// `{v}` is replaced by the last version seen.
        path: &'static str,
        headers: &'static [(&'static str, &'static str)],
        body: Option<&'static str>,
        status: u16,
        expect: Vec<(&'static str, Expect)>,
    }

    fn case(
        name: &'static str,
        method: Method,
        path: &'static str,
        body: Option<&'static str>,
        status: u16,
        expect: Vec<(&'static str, Expect)>,
    ) -> Case {
        Case {
            name,
            auth: Auth::Good,
            method,
            path,
            headers: &[],
            body,
            status,
            expect,
        }
    }

    async fn run_cases(h: &Harness, cases: Vec<Case>) {
        let good = h.client(Some(TOKEN));
        let missing = h.client(None);
        let wrong = h.client(Some("not-the-token"));
        let mut last_version = 0u64;
        for c in cases {
            let path = format!(
                "{PREFIX}{}",
                c.path.replace("{v}", &last_version.to_string())
            );
            let headers: Vec<(&str, String)> = c
                .headers
                .iter()
                .map(|(k, v)| (*k, v.replace("{v}", &last_version.to_string())))
                .collect();
            let client = match c.auth {
                Auth::Good => &good,
                Auth::Missing => &missing,
                Auth::Wrong => &wrong,
            };
            let body = c.body.map(|b| b.as_bytes().to_vec());
            let Reply { status, body, .. } = client
                .send_raw(c.method.clone(), &path, body, &headers)
                .await
                .unwrap_or_else(|e| panic!("case {}: {e:#}", c.name));
            assert_eq!(status, c.status, "case {}: body {body}", c.name);
            for (pointer, expect) in &c.expect {
                let got = body.pointer(pointer);
                let ok = match expect {
                    Expect::Eq(v) => got == Some(v),
                    Expect::Number => got.is_some_and(Value::is_u64),
                    Expect::Contains(s) => {
                        got.and_then(Value::as_str).is_some_and(|m| m.contains(s))
                    }
                    Expect::Absent => got.is_none(),
                };
                assert!(ok, "case {}: at {pointer}: got {got:?} in {body}", c.name);
            }
            if let Some(v) = body.get("version").and_then(Value::as_u64) {
                last_version = v;
            }
        }
    }

    fn eq(v: Value) -> Expect {
        Expect::Eq(v)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn admin_api_cases() {
        let h = Harness::start(false).await;
        use Expect::{Absent, Contains, Number};
        let cases = vec![
            Case {
                auth: Auth::Missing,
                ..case("no token", Method::GET, "/tenants", None, 401, vec![
                    ("/error/type", eq(json!("authentication_error"))),
                    ("/error/message", Contains("Bearer")),
                ])
            },
            Case {
                auth: Auth::Wrong,
                ..case("wrong token", Method::GET, "/tenants", None, 401, vec![
                    ("/error/message", Contains("wrong admin token")),
                ])
            },
            Case {
                auth: Auth::Missing,
                ..case("no token on openapi", Method::GET, "/openapi.json", None, 401, vec![])
            },
            case("empty tenants", Method::GET, "/tenants", None, 200, vec![
                ("/version", Number),
                ("/tenants", eq(json!({}))),
            ]),
            case("local read", Method::GET, "/tenants?consistency=local", None, 200, vec![
                ("/version", Number),
            ]),
            case("bad consistency", Method::GET, "/tenants?consistency=eventual", None, 400, vec![
                ("/error/message", Contains("linearizable")),
            ]),
            case("unknown query parameter", Method::GET, "/tenants?x=1", None, 400, vec![]),
            case("create pool", Method::PUT, "/pools/m", Some(r#"{"instances":["http://a:1"]}"#), 201, vec![
                ("/version", Number),
                ("/pool/instances", eq(json!(["http://a:1"]))),
            ]),
            case("replace pool", Method::PUT, "/pools/m", Some(r#"{"instances":["http://a:1","http://b:2"]}"#), 200, vec![
                ("/version", Number),
            ]),
            case("invalid pool", Method::PUT, "/pools/m2", Some(r#"{"instances":["ftp://x","http://a/v1"]}"#), 400, vec![
                ("/problems", eq(json!([
                    "instances[0] \"ftp://x\": must start with http://",
                    "instances[1] \"http://a/v1\": give http://host:port without path, query or user",
                ]))),
                ("/error/code", eq(json!("invalid"))),
            ]),
            case("pool with unknown field", Method::PUT, "/pools/m2", Some(r#"{"instance":[]}"#), 400, vec![
                ("/error/message", Contains("unknown field `instance`")),
            ]),
            case("tenant with unknown field", Method::PUT, "/tenants/acme", Some(r#"{"pool":"m","stratgy":"kv-aware"}"#), 400, vec![
                ("/error/message", Contains("unknown field `stratgy`, expected one of")),
            ]),
            case("add instance", Method::POST, "/pools/m/instances", Some(r#"{"url":"http://c:3"}"#), 201, vec![
                ("/version", Number),
            ]),
            case("get pool", Method::GET, "/pools/m", None, 200, vec![
                ("/pool/instances", eq(json!(["http://a:1", "http://b:2", "http://c:3"]))),
                ("/version", Number),
            ]),
            case("remove instance", Method::DELETE, "/pools/m/instances?url=http%3A%2F%2Fb%3A2", None, 200, vec![]),
            case("remove missing instance", Method::DELETE, "/pools/m/instances?url=http://z:9", None, 404, vec![
                ("/error/message", Contains("instance \"http://z:9\" in pool \"m\" not found")),
            ]),
            case("remove instance without url", Method::DELETE, "/pools/m/instances", None, 400, vec![
                ("/error/message", Contains("?url=")),
            ]),
            case("list pools", Method::GET, "/pools", None, 200, vec![
                ("/pools/m/instances", eq(json!(["http://a:1", "http://c:3"]))),
            ]),
            case("malformed JSON", Method::PUT, "/tenants/acme", Some(r#"{"pool": "m""#), 400, vec![
                ("/error/message", Contains("malformed JSON")),
            ]),
            case("empty body", Method::PUT, "/tenants/acme", None, 400, vec![
                ("/error/message", Contains("empty request body")),
            ]),
            case("invalid tenant lists each field", Method::PUT, "/tenants/acme",
                Some(r#"{"strategy":"fastest","block_tokens":0,"pool":"nope","rate_limit_rps":-1,"cache_salt":""}"#), 400, vec![
                ("/problems", eq(json!([
                    "strategy \"fastest\": not one of round-robin, least-loaded, prefix-aware, kv-aware",
                    "block_tokens: must be positive",
                    "rate_limit_rps -1: must be a finite positive number",
                    "pool: no pool serves model \"nope\"",
                ]))),
                ("/error/message", Contains("invalid tenant: strategy")),
            ]),
            case("bad plain key", Method::PUT, "/tenants/acme", Some(r#"{"pool":"m","api_keys":["a b"]}"#), 400, vec![
                ("/problems", eq(json!(["api_keys[0]: contains whitespace or control characters"]))),
            ]),
            case("create tenant with defaults", Method::PUT, "/tenants/acme",
                Some(r#"{"pool":"m","api_keys":["sk-first-key"]}"#), 201, vec![
                ("/version", Number),
                ("/tenant/strategy", eq(json!("prefix-aware"))),
                ("/tenant/block_tokens", eq(json!(64))),
                ("/tenant/api_key_hashes/0", eq(json!(hash_key("sk-first-key")))),
                ("/tenant/api_keys", Absent),
            ]),
            case("get tenant", Method::GET, "/tenants/acme", None, 200, vec![
                ("/id", eq(json!("acme"))),
                ("/tenant/pool", eq(json!("m"))),
            ]),
            Case {
                headers: &[("if-match", "\"{v}\"")],
                ..case("replace tenant with CAS", Method::PUT, "/tenants/acme",
                    Some(r#"{"pool":"m","strategy":"round-robin"}"#), 200, vec![("/version", Number)])
            },
            Case {
                headers: &[("if-match", "1")],
                ..case("stale If-Match", Method::DELETE, "/tenants/acme", None, 409, vec![
                    ("/current_version", Number),
                    ("/error/code", eq(json!("version_conflict"))),
                ])
            },
            case("stale expected_version", Method::PUT, "/pools/m?expected_version=1",
                Some(r#"{"instances":[]}"#), 409, vec![("/current_version", Number)]),
            case("bad expected_version", Method::DELETE, "/tenants/acme?expected_version=x", None, 400, vec![
                ("/error/message", Contains("non-negative integer")),
            ]),
            case("tenant not found", Method::GET, "/tenants/ghost", None, 404, vec![
                ("/error/message", eq(json!("tenant \"ghost\" not found"))),
            ]),
            case("delete missing tenant", Method::DELETE, "/tenants/ghost", None, 404, vec![]),
            case("add key", Method::POST, "/tenants/acme/api-keys", Some(r#"{"key":"sk-second-key"}"#), 201, vec![
                ("/key_hash", eq(json!(hash_key("sk-second-key")))),
            ]),
            case("add same key again", Method::POST, "/tenants/acme/api-keys", Some(r#"{"key":"sk-second-key"}"#), 400, vec![
                ("/problems/0", eq(json!("key_hash: the tenant already has this key"))),
            ]),
            case("add key to missing tenant", Method::POST, "/tenants/ghost/api-keys", Some(r#"{"key":"k"}"#), 404, vec![]),
            case("remove key by non-hash", Method::DELETE, "/tenants/acme/api-keys/sk-second-key", None, 400, vec![]),
            case("delete used pool", Method::DELETE, "/pools/m", None, 400, vec![
                ("/problems/0", eq(json!("model: pool \"m\" is used by tenants acme"))),
            ]),
            case("cluster", Method::GET, "/cluster", None, 200, vec![
                ("/raft/node_id", eq(json!(1))),
                ("/raft/role", eq(json!("Leader"))),
                ("/gossip/node_id", eq(json!("r1"))),
                ("/version", Number),
            ]),
            case("index", Method::GET, "/index", None, 200, vec![
                ("/index/blocks", eq(json!(3))),
                ("/version", Number),
            ]),
            case("explain", Method::POST, "/route/explain",
                Some(r#"{"tenant":"acme","request":{"model":"m","prompt":"hi"}}"#), 200, vec![
                ("/decision/instance", eq(json!("http://a:1"))),
                ("/tenant", eq(json!("acme"))),
            ]),
            case("explain refused by router", Method::POST, "/route/explain",
                Some(r#"{"tenant":"nobody","request":{"model":"m","prompt":"hi"}}"#), 404, vec![
                ("/error/message", Contains("unknown tenant")),
            ]),
            case("explain without request object", Method::POST, "/route/explain",
                Some(r#"{"tenant":"","request":"hi"}"#), 400, vec![
                ("/problems", eq(json!([
                    "tenant: empty",
                    "request: must be an OpenAI completions or chat request object",
                ]))),
            ]),
            case("unknown path", Method::GET, "/nothing", None, 404, vec![
                ("/error/type", eq(json!("not_found_error"))),
            ]),
            case("wrong method", Method::PATCH, "/tenants", None, 405, vec![
                ("/error/code", eq(json!("method_not_allowed"))),
            ]),
            case("delete tenant", Method::DELETE, "/tenants/acme", None, 200, vec![("/version", Number)]),
            case("delete pool", Method::DELETE, "/pools/m", None, 200, vec![]),
            case("pool gone", Method::GET, "/pools/m", None, 404, vec![]),
        ];
        run_cases(&h, cases).await;
        h.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn api_keys_reach_raft_only_hashed() {
        let h = Harness::start(false).await;
        let c = h.client(Some(TOKEN));
        let pool = json!({"instances": ["http://a:1"]});
        c.call(Method::PUT, "/pools/m", Some(&pool))
            .await
            .expect("pool");
        let tenant = json!({"pool": "m", "api_keys": ["sk-plain-one"]});
        c.call(Method::PUT, "/tenants/t", Some(&tenant))
            .await
            .expect("tenant");
        c.call(
            Method::POST,
            "/tenants/t/api-keys",
            Some(&json!({"key": "sk-plain-two"})),
        )
        .await
        .expect("key");
        let stored = serde_json::to_string(&h.raft.local_state()).unwrap_or_default();
        for plain in ["sk-plain-one", "sk-plain-two"] {
            assert!(!stored.contains(plain), "plain key {plain} stored");
            assert!(stored.contains(&hash_key(plain)), "hash of {plain} missing");
        }
        let hash = hash_key("sk-plain-one");
        c.call(Method::DELETE, &format!("/tenants/t/api-keys/{hash}"), None)
            .await
            .expect("remove key");
        let t = &h.raft.local_state().tenants["t"];
        assert_eq!(t.api_key_hashes, vec![hash_key("sk-plain-two")]);
        h.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_quorum_is_503_with_retry_after() {
        let h = Harness::start(true).await;
        let c = h.client(Some(TOKEN));
        for (method, path, body) in [
            (Method::GET, "/tenants", None),
            (
                Method::PUT,
                "/pools/m",
                Some(br#"{"instances":[]}"#.to_vec()),
            ),
        ] {
            let r = c
                .send_raw(method.clone(), &format!("{PREFIX}{path}"), body, &[])
                .await
                .expect("answer");
            assert_eq!(r.status, 503, "{method} {path}: {}", r.body);
            assert_eq!(
                r.headers
                    .get(header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()),
                Some("1")
            );
            assert!(r.body.pointer("/error/message").is_some(), "{}", r.body);
        }
        // A local read still answers.
        let r = c
            .send_raw(
                Method::GET,
                &format!("{PREFIX}/tenants?consistency=local"),
                None,
                &[],
            )
            .await
            .expect("answer");
        assert_eq!(r.status, 200, "{}", r.body);
        h.stop().await;
    }

    #[test]
    fn errors_classify_once() {
        let cases: Vec<(AdminError, u16, Option<&str>)> = vec![
            (
                write_error(
                    WriteError::NoLeader {
                        waited: Duration::from_secs(1),
                    },
                    None,
                ),
                503,
                Some("1"),
            ),
            (
                write_error(
                    WriteError::NotLeader {
                        leader_url: Some("http://l:1".into()),
                    },
                    None,
                ),
                421,
                None,
            ),
            (
                write_error(WriteError::NotLeader { leader_url: None }, None),
                503,
                Some("1"),
            ),
            (
                write_error(
                    WriteError::LeaderUnreachable {
                        leader_url: "http://l:1".into(),
                        message: "refused".into(),
                    },
                    None,
                ),
                503,
                Some("1"),
            ),
            (
                write_error(WriteError::Timeout(Duration::from_secs(5)), None),
                504,
                None,
            ),
            (
                write_error(WriteError::Unknown("reset".into()), None),
                504,
                None,
            ),
            (
                write_error(WriteError::Failed("disk".into()), None),
                500,
                None,
            ),
            (read_error(ReadError::NoQuorum("q".into())), 503, Some("1")),
            (
                read_error(ReadError::Timeout(Duration::from_secs(5))),
                504,
                None,
            ),
            (
                AdminError::Router {
                    status: 200,
                    message: "odd".into(),
                },
                500,
                None,
            ),
            (
                AdminError::Router {
                    status: 503,
                    message: "busy".into(),
                },
                503,
                Some("1"),
            ),
        ];
        for (e, status, retry) in cases {
            let msg = e.to_string();
            let resp = e.into_response();
            assert_eq!(resp.status().as_u16(), status, "{msg}");
            assert_eq!(
                resp.headers()
                    .get(header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()),
                retry,
                "{msg}"
            );
        }
        let unknown =
            write_error(WriteError::Timeout(Duration::from_secs(5)), Some("k-1")).to_string();
        assert!(unknown.contains("MAY have been applied"), "{unknown}");
        assert!(unknown.contains("`Idempotency-Key: k-1`"), "{unknown}");
        let unkeyed = write_error(WriteError::Unknown("reset".into()), None).to_string();
        assert!(!unkeyed.contains("Idempotency-Key"), "{unkeyed}");
        let body = write_error(
            WriteError::NotLeader {
                leader_url: Some("http://l:1".into()),
            },
            None,
        )
        .body();
        assert_eq!(body["leader_url"], json!("http://l:1"));
    }

    #[test]
    fn token_and_version_headers() {
        let hash = *blake3::hash(b"tok").as_bytes();
        let h = |pairs: &[(&'static str, &str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                if let Ok(v) = HeaderValue::from_str(v) {
                    m.insert(*k, v);
                }
            }
            m
        };
        for (headers, ok) in [
            (vec![("authorization", "Bearer tok")], true),
            (vec![("authorization", "bearer  tok ")], true),
            (vec![("authorization", "Bearer nope")], false),
            (vec![("authorization", "Basic tok")], false),
            (vec![("authorization", "Bearer ")], false),
            (vec![], false),
        ] {
            assert_eq!(check_token(&h(&headers), &hash).is_ok(), ok, "{headers:?}");
        }
        let none = Params::default();
        let q = |v: &str| Params {
            expected_version: Some(v.into()),
            ..Params::default()
        };
        for (headers, params, want) in [
            (vec![], &none, Some(None)),
            (vec![("if-match", "7")], &none, Some(Some(7))),
            (vec![("if-match", "\"7\"")], &none, Some(Some(7))),
            (vec![("if-match", "W/\"7\"")], &none, Some(Some(7))),
            (vec![("if-match", "*")], &none, Some(None)),
            (vec![("if-match", "x")], &none, None),
            (vec![], &q("8"), Some(Some(8))),
            (vec![("if-match", "8")], &q("8"), Some(Some(8))),
            (vec![("if-match", "7")], &q("8"), None),
            (vec![], &q("-1"), None),
        ] {
            assert_eq!(
                expected_version(&h(&headers), params).ok(),
                want,
                "{headers:?} {:?}",
                params.expected_version
            );
        }
    }
}
