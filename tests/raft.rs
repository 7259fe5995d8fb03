//! Tenant configuration in Raft, end to end: real `warmpath router` processes with Raft
//! and the admin API on loopback ports, in front of a real engine-sim, driven over HTTP.
//! Voters' admin addresses must be known before they start, so their ports are picked by
//! binding port 0 and closing it; everything else is polled with deadlines.

use crate::{scratch_dir, Proc};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Method;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const TOKEN: &str = "it-admin-token";
const POOL: &str = "sim-llama";

fn client() -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new())
}

/// A free loopback address: bind port 0, note it, close.
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local address")
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: hyper::HeaderMap,
    body: Value,
}

impl Reply {
    fn message(&self) -> &str {
        self.body["error"]["message"].as_str().unwrap_or("")
    }
    fn retry_after(&self) -> Option<u64> {
        self.headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }
}

/// One HTTP exchange; `None` if the server could not be reached or did not answer within
/// `within`. A body that is not JSON comes back as a JSON string.
async fn send(
    c: &HttpClient,
    method: Method,
    url: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
    within: Duration,
) -> Option<Reply> {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Bytes::from(b.to_string())
        }
        None => Bytes::new(),
    };
    let req = req.body(Full::new(body)).expect("a valid request");
    let exchange = async {
        let resp = c.request(req).await.ok()?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.ok()?.to_bytes();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Some(Reply {
            status,
            headers,
            body,
        })
    };
    tokio::time::timeout(within, exchange).await.ok().flatten()
}

/// An admin API call with the right token. Writes may wait out the 5 s Raft write timeout.
async fn admin(
    c: &HttpClient,
    base: &str,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Option<Reply> {
    let auth = format!("Bearer {TOKEN}");
    send(
        c,
        method,
        &format!("{base}/admin/v1{path}"),
        body,
        &[("authorization", &auth)],
        Duration::from_secs(15),
    )
    .await
}

/// Polls `f` until it gives a value; panics after `within`.
async fn until<T, F, Fut>(within: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn tenant_body(strategy: &str) -> Value {
    json!({"pool": POOL, "strategy": strategy})
}

fn explain_body(tenant: &str) -> Value {
    json!({"tenant": tenant, "request": {"model": POOL, "prompt": "hello raft world", "max_tokens": 1}})
}

/// A router with Raft on.
#[derive(Debug)]
struct Router {
    proc: Proc,
    /// Its admin API (and Raft) base URL.
    admin: String,
    id: u64,
}

/// The scratch directory, token file, voter addresses and engine of one test's cluster;
/// the directory is removed on drop (after the routers, declared later, are dropped).
struct Setup {
    dir: PathBuf,
    token_file: String,
    voters: Vec<(u64, SocketAddr)>,
    engine: Proc,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Setup {
    fn new(test: &str, voters: u64) -> Setup {
        let dir = scratch_dir(test);
        let token_file = dir.join("admin.token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token file");
        Setup {
            token_file: token_file.to_str().expect("utf-8 path").to_string(),
            voters: (1..=voters).map(|id| (id, free_addr())).collect(),
            engine: Proc::start(&["engine-sim", "--listen", "127.0.0.1:0", "--speedup", "1000"]),
            dir,
        }
    }

    /// Starts router `id` with its admin API on `admin_listen`; `Err` with what it printed
    /// when it did not come up with Raft (e.g. the admin port is still taken).
    fn try_start(&self, id: u64, admin_listen: &str) -> Result<Router, String> {
        let raft_dir = self.dir.join(format!("node-{id}"));
        let mut args: Vec<String> = vec![
            "router".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--instance".into(),
            self.engine.url.clone(),
            "--raft-node-id".into(),
            id.to_string(),
            "--raft-dir".into(),
            raft_dir.to_str().expect("utf-8 path").into(),
            "--admin-listen".into(),
            admin_listen.into(),
            "--admin-token-file".into(),
            self.token_file.clone(),
        ];
        for (vid, addr) in &self.voters {
            args.push("--voter".into());
            args.push(format!("{vid}=http://{addr}"));
        }
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut proc = Proc::start(&argv);
        let line = proc.read_line();
        match line
            .split("admin on ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
        {
            Some(url) => Ok(Router {
                admin: url.to_string(),
                proc,
                id,
            }),
            None => {
                proc.kill();
                Err(line)
            }
        }
    }

    /// Starts router `id`, retrying for a while if its admin port is not free yet.
    fn start(&self, id: u64, admin_listen: &str) -> Router {
        let start = Instant::now();
        loop {
            match self.try_start(id, admin_listen) {
                Ok(r) => return r,
                Err(line) => {
                    assert!(
                        start.elapsed() < Duration::from_secs(10),
                        "router {id} did not start on {admin_listen}: {line:?}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn start_voters(&self) -> Vec<Router> {
        self.voters
            .iter()
            .map(|(id, addr)| self.start(*id, &addr.to_string()))
            .collect()
    }

    /// A router not in the voter list: it joins as a learner.
    fn start_learner(&self, id: u64) -> Router {
        self.start(id, "127.0.0.1:0")
    }
}

/// Waits until every router has applied the configuration seeded from the config file (the
/// `default` tenant and the `sim-llama` pool) and routes with it.
async fn wait_seeded(c: &HttpClient, routers: &[&Router]) {
    for r in routers {
        let base = &r.admin;
        until(
            Duration::from_secs(15),
            &format!("router {} applying the seeded config", r.id),
            move || async move {
                let reply = admin(
                    c,
                    base,
                    Method::POST,
                    "/route/explain",
                    Some(&explain_body("default")),
                )
                .await?;
                (reply.status == 200).then_some(())
            },
        )
        .await;
    }
}

/// The leader's node id as `router` sees it.
async fn leader_of(c: &HttpClient, router: &Router) -> u64 {
    let base = &router.admin;
    until(Duration::from_secs(15), "a raft leader", move || async move {
        let reply = admin(c, base, Method::GET, "/cluster", None).await?;
        reply.body["raft"]["leader"].as_u64()
    })
    .await
}

/// The tenant ids of a linearizable read, and the config version, once `router` can serve
/// one.
async fn linearizable_tenants(c: &HttpClient, router: &Router) -> (BTreeSet<String>, u64) {
    let base = &router.admin;
    until(
        Duration::from_secs(20),
        "a linearizable read",
        move || async move {
            let reply = admin(c, base, Method::GET, "/tenants", None).await?;
            if reply.status != 200 {
                return None;
            }
            let ids = reply.body["tenants"]
                .as_object()
                .expect("tenants object")
                .keys()
                .cloned()
                .collect();
            Some((ids, reply.body["version"].as_u64().expect("version")))
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_voters_and_two_learners_share_the_configuration() {
    let s = Setup::new("raft-learners", 3);
    let voters = s.start_voters();
    let learners = [s.start_learner(4), s.start_learner(5)];
    let all: Vec<&Router> = voters.iter().chain(learners.iter()).collect();
    let c = &client();
    wait_seeded(c, &all).await;
    // The learners have joined: they know the leader.
    for l in &learners {
        leader_of(c, l).await;
    }

    let started = Instant::now();
    let reply = admin(
        c,
        &learners[0].admin,
        Method::PUT,
        "/tenants/acme",
        Some(&json!({"pool": POOL, "strategy": "round-robin", "prefix_length": 7})),
    )
    .await
    .expect("the learner answers");
    assert_eq!(reply.status, 201, "write through a learner: {:?}", reply.body);
    let version = reply.body["version"].as_u64().expect("version");

    let mut seen = Vec::new();
    for r in &all {
        let base = &r.admin;
        let body = until(
            Duration::from_secs(10),
            &format!("router {} seeing tenant acme", r.id),
            move || async move {
                let reply = admin(
                    c,
                    base,
                    Method::GET,
                    "/tenants/acme?consistency=local",
                    None,
                )
                .await?;
                (reply.status == 200 && reply.body["version"].as_u64() == Some(version))
                    .then_some(reply.body)
            },
        )
        .await;
        seen.push((r.id, body));
    }
    let took = started.elapsed();
    for (id, body) in &seen {
        assert_eq!(body["tenant"], seen[0].1["tenant"], "router {id}");
        assert_eq!(body["tenant"]["strategy"], "round-robin", "router {id}");
        assert_eq!(body["tenant"]["prefix_length"], 7, "router {id}");
    }
    // And a linearizable read through the other learner agrees.
    let (ids, v) = linearizable_tenants(c, &learners[1]).await;
    assert!(ids.contains("acme") && ids.contains("default"), "{ids:?}");
    assert_eq!(v, version);
    println!(
        "tenant written through a learner visible on all 5 routers at version {version} after {:.0} ms",
        took.as_secs_f64() * 1e3
    );
}
