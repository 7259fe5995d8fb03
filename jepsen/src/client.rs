//! The clients: each records every operation it invokes, with the outcome it saw, into
//! the [`Recorder`]. They talk to routers through the admin API (the CLI's client, the one
//! admin client) and the OpenAI-style data port, nothing else.
//!
//! Outcomes follow what warmpath promises: 2xx is applied; 4xx and 503 are "not applied"
//! (the API's 503s are refusals before submission: no leader, not leader, no quorum, late
//! at the leader); a connection never made is not applied; 504, a timeout or a
//! connection broken after the request went out is unknown.

use crate::check::set_id;
use crate::cluster::ADMIN_TOKEN;
use crate::history::{Op, Outcome, Recorder, Status, F};
use hyper::Method;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use warmpath::admin::cli::AdminClient;
use warmpath::admin::wire::PREFIX;
use warmpath_index::rng::Rng;

/// The register: this tenant's `prefix_length`.
pub const REGISTER: &str = "reg";
/// The pool every tenant of the run routes to (the engine-sims' model).
pub const POOL: &str = "sim-llama";
/// The routing clients' tenant and key.
pub const ROUTE_TENANT: &str = "route";
pub const ROUTE_KEY: &str = "sk-jepsen-route";
/// The rate-limited tenant and key.
pub const LIMITED_TENANT: &str = "limited";
pub const LIMITED_KEY: &str = "sk-jepsen-limited";

/// How long a client waits for any answer before calling the operation unknown: longer
/// than the 5 s Raft write timeout, so a router's own answer normally arrives.
const OP_TIMEOUT: Duration = Duration::from_secs(10);

/// The routers the clients reach: admin and data base URLs, and metrics base URLs when
/// the run has the cache tier.
#[derive(Debug, Clone)]
pub struct Targets {
    pub admin: Vec<String>,
    pub data: Vec<String>,
    pub metrics: Vec<String>,
}

/// One exchange with a router: status and body, or the transport error.
async fn call(
    base: &str,
    token: &str,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), String> {
    let client = AdminClient::new(base, Some(token.to_string())).map_err(|e| e.to_string())?;
    let body = body.map(|b| b.to_string().into_bytes());
    match tokio::time::timeout(OP_TIMEOUT, client.send_raw(method, path, body, &[])).await {
        Ok(Ok(r)) => Ok((r.status, r.body)),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(_) => Err(format!("no answer within {OP_TIMEOUT:?}")),
    }
}

/// An admin API call with the run's token.
pub async fn admin(
    base: &str,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), String> {
    call(base, ADMIN_TOKEN, method, &format!("{PREFIX}{path}"), body).await
}

/// Whether the router whose data port is at `base` answers `/readyz` 200.
pub async fn ready(base: &str) -> bool {
    matches!(
        call(base, ADMIN_TOKEN, Method::GET, "/readyz", None).await,
        Ok((200, _))
    )
}

fn message(status: u16, body: &Value) -> String {
    let m = body["error"]["message"]
        .as_str()
        .map_or_else(|| body.to_string(), str::to_string);
    let mut m = format!("{status} {m}");
    m.truncate(160);
    m
}

/// What a write's answer means.
fn write_outcome(r: &Result<(u16, Value), String>) -> (Outcome, String) {
    match r {
        Ok((s, b)) if (200..300).contains(s) => (Outcome::Ok, s.to_string()),
        Ok((s, b)) if *s == 504 || *s >= 500 && *s != 503 => (Outcome::Info, message(*s, b)),
        Ok((s, b)) => (Outcome::Fail, message(*s, b)),
        // No connection, no request: it surely did not take effect.
        Err(e) if e.contains("(Connect)") => (Outcome::Fail, e.clone()),
        Err(e) => (Outcome::Info, e.clone()),
    }
}

fn tenant(prefix_length: u64) -> Value {
    json!({"pool": POOL, "strategy": "round-robin", "prefix_length": prefix_length})
}

/// Creates the register and the routing tenants through router 0, retrying until a
/// leader takes them; the register starts at `initial`.
pub async fn setup(t: &Targets, initial: u64, limit_rps: f64) -> anyhow::Result<()> {
    let tenants = [
        (REGISTER, tenant(initial)),
        (
            ROUTE_TENANT,
            json!({"pool": POOL, "strategy": "prefix-aware", "api_keys": [ROUTE_KEY]}),
        ),
        (
            LIMITED_TENANT,
            json!({"pool": POOL, "strategy": "round-robin", "api_keys": [LIMITED_KEY], "rate_limit_rps": limit_rps}),
        ),
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for (id, body) in tenants {
        loop {
            let r = admin(
                &t.admin[0],
                Method::PUT,
                &format!("/tenants/{id}"),
                Some(&body),
            )
            .await;
            match r {
                Ok((s, _)) if (200..300).contains(&s) => break,
                other if tokio::time::Instant::now() > deadline => {
                    anyhow::bail!("creating tenant {id}: {other:?}")
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
    // Every router serves them before the history starts.
    for base in &t.admin {
        loop {
            let r = admin(
                base,
                Method::GET,
                &format!("/tenants/{LIMITED_TENANT}?consistency=local"),
                None,
            )
            .await;
            if matches!(r, Ok((200, _))) {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("{base} did not apply the setup: {r:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// The shared state of a run's clients.
#[derive(Debug, Clone)]
pub struct Clients {
    pub rec: Recorder,
    pub targets: Targets,
    pub stop: Arc<AtomicBool>,
    next_value: Arc<AtomicU64>,
}

impl Clients {
    pub fn new(rec: Recorder, targets: Targets, initial: u64) -> Clients {
        Clients {
            rec,
            targets,
            stop: Arc::new(AtomicBool::new(false)),
            next_value: Arc::new(AtomicU64::new(initial + 1)),
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Client `process`: reads the register (35%) and the set (5%), writes the register
    /// (30%) and creates set tenants (30%) through router `process % n`, until stopped.
    pub async fn register(self, process: usize, seed: u64) {
        let mut rng = Rng::new(seed ^ (process as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let node = process % self.targets.admin.len();
        let base = self.targets.admin[node].clone();
        while !self.stopped() {
            let roll = rng.below(100);
            let invoke_ms = self.rec.now_ms();
            let (f, value, outcome, detail) = if roll < 35 {
                let r = admin(&base, Method::GET, &format!("/tenants/{REGISTER}"), None).await;
                match r {
                    Ok((200, b)) => (
                        F::Read,
                        b["tenant"]["prefix_length"].as_u64(),
                        Outcome::Ok,
                        "200".into(),
                    ),
                    Ok((s, b)) => (F::Read, None, Outcome::Fail, message(s, &b)),
                    Err(e) => (F::Read, None, Outcome::Fail, e),
                }
            } else if roll < 40 {
                let r = admin(&base, Method::GET, "/tenants", None).await;
                let complete_ms = self.rec.now_ms();
                let (outcome, seen, detail) = match r {
                    Ok((200, b)) => {
                        let mut ids: Vec<String> = b["tenants"]
                            .as_object()
                            .map(|m| m.keys().filter(|k| k.starts_with("js")).cloned().collect())
                            .unwrap_or_default();
                        ids.sort();
                        (
                            Outcome::Ok,
                            Some((ids, b["version"].as_u64().unwrap_or(0))),
                            "200".into(),
                        )
                    }
                    Ok((s, b)) => (Outcome::Fail, None, message(s, &b)),
                    Err(e) => (Outcome::Fail, None, e),
                };
                self.rec.op(Op {
                    process,
                    node,
                    f: F::SetRead,
                    value: None,
                    invoke_ms,
                    complete_ms,
                    outcome,
                    detail,
                    seen,
                });
                tokio::time::sleep(Duration::from_millis(20 + rng.below(30))).await;
                continue;
            } else if roll < 70 {
                let v = self.next_value.fetch_add(1, Ordering::Relaxed);
                let r = admin(
                    &base,
                    Method::PUT,
                    &format!("/tenants/{REGISTER}"),
                    Some(&tenant(v)),
                )
                .await;
                let (o, d) = write_outcome(&r);
                (F::Write, Some(v), o, d)
            } else {
                let v = self.next_value.fetch_add(1, Ordering::Relaxed);
                let body = json!({"pool": POOL, "strategy": "round-robin"});
                let r = admin(
                    &base,
                    Method::PUT,
                    &format!("/tenants/{}", set_id(v)),
                    Some(&body),
                )
                .await;
                let (o, d) = write_outcome(&r);
                (F::Create, Some(v), o, d)
            };
            let complete_ms = self.rec.now_ms();
            self.rec.op(Op {
                process,
                node,
                f,
                value,
                invoke_ms,
                complete_ms,
                outcome,
                detail,
                seen: None,
            });
            tokio::time::sleep(Duration::from_millis(20 + rng.below(30))).await;
        }
    }

    /// A routing client: completions for `tenant` (key `key`) through router
    /// `process % n`'s data port, recorded as `f`, `pause_ms` apart.
    pub async fn route(self, process: usize, f: F, key: &'static str, pause_ms: u64) {
        let node = process % self.targets.data.len();
        let base = self.targets.data[node].clone();
        let mut n = 0u64;
        while !self.stopped() {
            n += 1;
            let body = json!({
                "model": POOL,
                "messages": [{"role": "user", "content": format!("jepsen client {process} request {n}: say something")}],
                "max_tokens": 8,
                "stream": n % 2 == 0,
            });
            let invoke_ms = self.rec.now_ms();
            let r = call(
                &base,
                key,
                Method::POST,
                "/v1/chat/completions",
                Some(&body),
            )
            .await;
            let complete_ms = self.rec.now_ms();
            let (outcome, detail) = match &r {
                Ok((200, b)) if !stream_failed(b) => (Outcome::Ok, "200".to_string()),
                Ok((200, b)) => (
                    Outcome::Fail,
                    format!("200, the stream ended with an error: {}", truncate(b)),
                ),
                // A clear error: a status and an OpenAI-style message.
                Ok((s, b)) if b["error"]["message"].is_string() => (Outcome::Fail, message(*s, b)),
                Ok((s, b)) => (
                    Outcome::Info,
                    format!("{s} without an error message: {}", truncate(b)),
                ),
                // No connection, no request: a clear failure (a router not running).
                Err(e) if e.contains("(Connect)") => (Outcome::Fail, e.clone()),
                Err(e) => (Outcome::Info, e.clone()),
            };
            self.rec.op(Op {
                process,
                node,
                f,
                value: None,
                invoke_ms,
                complete_ms,
                outcome,
                detail,
                seen: None,
            });
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        }
    }

    /// Samples every router's Raft status every 250 ms, until stopped.
    pub async fn status(self) {
        while !self.stopped() {
            for (node, base) in self.targets.admin.iter().enumerate() {
                let at_ms = self.rec.now_ms();
                let r = tokio::time::timeout(
                    Duration::from_millis(500),
                    admin(base, Method::GET, "/cluster", None),
                )
                .await;
                let raft = match r {
                    Ok(Ok((200, b))) => Some(b["raft"].clone()),
                    _ => None,
                };
                self.rec.status(Status {
                    at_ms,
                    node,
                    role: raft
                        .as_ref()
                        .and_then(|r| r["role"].as_str().map(String::from)),
                    leader: raft.as_ref().and_then(|r| r["leader"].as_u64()),
                    quorum_lost: raft.as_ref().is_some_and(|r| r["quorum_lost"] == true),
                    term: raft.as_ref().and_then(|r| r["term"].as_u64()),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// A streamed answer's body comes back as text; an error event in it is a failure.
fn stream_failed(b: &Value) -> bool {
    b.as_str().is_some_and(|s| s.contains("\"error\""))
}

fn truncate(b: &Value) -> String {
    let mut s = b.to_string();
    s.truncate(120);
    s
}

/// After the faults: every router's view of the tenants, linearizable and local, and of
/// its gossip peers, recorded as final reads. Waits up to `within` for each router to
/// answer, for their local states to agree and for each to see every other as a peer.
pub async fn final_reads(rec: &Recorder, t: &Targets, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    // Local reads until every router serves the same content (or the deadline).
    let mut locals;
    loop {
        locals = Vec::new();
        for base in &t.admin {
            locals.push(admin(base, Method::GET, "/tenants?consistency=local", None).await);
        }
        let same = locals.iter().all(|r| matches!(r, Ok((200, _))))
            && locals.windows(2).all(|w| w[0] == w[1]);
        if same || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for (node, r) in locals.iter().enumerate() {
        let at = rec.now_ms();
        rec.op(final_op(node, at, r, "local"));
    }
    // Residency: what each router heard from the cache-agents over the run.
    for (node, base) in t.metrics.iter().enumerate() {
        let at = rec.now_ms();
        let text = match call(base, "", Method::GET, "/metrics", None).await {
            Ok((200, Value::String(text))) => text,
            other => format!("{other:?}"),
        };
        let changes = text
            .lines()
            .find(|l| l.starts_with("warmpath_router_residency_changes_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok());
        rec.op(Op {
            process: usize::MAX,
            node,
            f: F::FinalRead,
            value: changes.map(|c| c as u64),
            invoke_ms: at,
            complete_ms: rec.now_ms(),
            outcome: if changes.is_some() {
                Outcome::Ok
            } else {
                Outcome::Fail
            },
            detail: "residency".into(),
            seen: None,
        });
    }
    // Gossip: every router lists every other as a live peer again.
    for (node, base) in t.admin.iter().enumerate() {
        let invoke = rec.now_ms();
        let peers = |b: &Value| -> Vec<String> {
            b["gossip"]["peers"]
                .as_array()
                .map(|p| {
                    p.iter()
                        .filter_map(|x| x["node_id"].as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut seen = Vec::new();
        loop {
            if let Ok((200, b)) = admin(base, Method::GET, "/cluster", None).await {
                seen = peers(&b);
            }
            if seen.len() + 1 >= t.admin.len() || tokio::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        seen.sort();
        rec.op(Op {
            process: usize::MAX,
            node,
            f: F::FinalRead,
            value: Some(seen.len() as u64),
            invoke_ms: invoke,
            complete_ms: rec.now_ms(),
            outcome: Outcome::Ok,
            detail: "gossip".into(),
            seen: Some((seen, 0)),
        });
    }
    for (node, base) in t.admin.iter().enumerate() {
        let invoke = rec.now_ms();
        let mut r = admin(base, Method::GET, "/tenants", None).await;
        while !matches!(r, Ok((200, _))) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(250)).await;
            r = admin(base, Method::GET, "/tenants", None).await;
        }
        rec.op(final_op(node, invoke, &r, "linearizable"));
    }
}

fn final_op(node: usize, invoke_ms: f64, r: &Result<(u16, Value), String>, kind: &str) -> Op {
    let (outcome, seen, detail) = match r {
        Ok((200, b)) => {
            let ids: Vec<String> = b["tenants"]
                .as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            let version = b["version"].as_u64().unwrap_or(0);
            // The content itself, not only the version: a digest of the canonical JSON.
            let digest = xxhash_rust::xxh3::xxh3_64(b["tenants"].to_string().as_bytes());
            let detail = if kind == "local" {
                format!("local {digest:016x}")
            } else {
                kind.to_string()
            };
            (Outcome::Ok, Some((ids, version)), detail)
        }
        Ok((s, b)) => (Outcome::Fail, None, format!("{kind}: {}", message(*s, b))),
        Err(e) => (Outcome::Fail, None, format!("{kind}: {e}")),
    };
    Op {
        process: usize::MAX,
        node,
        f: F::FinalRead,
        value: seen.as_ref().map(|s| s.0.len() as u64),
        invoke_ms,
        complete_ms: invoke_ms,
        outcome,
        detail,
        seen,
    }
}
