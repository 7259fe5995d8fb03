//! Tenant configuration in Raft, end to end: real `warmpath router` processes with Raft
//! and the admin API on loopback ports, in front of a real engine-sim, driven over HTTP.
//! Voters' admin addresses must be known before they start, so their ports are picked by
//! binding port 0 and closing it; everything else is polled with deadlines.

use crate::{free_addr, scratch_dir, until, Proc};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Method;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use warmpath::admin::cli::AdminClient;
use warmpath::admin::wire::PREFIX;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const TOKEN: &str = "it-admin-token";
const PEER_TOKEN: &str = "it-raft-peer-token";
const POOL: &str = "sim-llama";

fn client() -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new())
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

/// An admin API call with the right token, through the CLI's client: the one admin
/// client. `None` if the router could not be reached or did not answer. Writes may wait
/// out the 5 s Raft write timeout.
async fn admin(base: &str, method: Method, path: &str, body: Option<&Value>) -> Option<Reply> {
    let client = AdminClient::new(base, Some(TOKEN.to_string())).ok()?;
    let body = body.map(|b| b.to_string().into_bytes());
    let r = client
        .send_raw(method, &format!("{PREFIX}{path}"), body, &[])
        .await
        .ok()?;
    Some(Reply {
        status: r.status,
        headers: r.headers,
        body: r.body,
    })
}

fn tenant_body(strategy: &str) -> Value {
    json!({"pool": POOL, "strategy": strategy})
}

/// Creates round-robin tenant `id` through `router` (201 expected); returns the config
/// version the write made.
async fn create_tenant(router: &Router, id: &str) -> u64 {
    let reply = admin(
        &router.admin,
        Method::PUT,
        &format!("/tenants/{id}"),
        Some(&tenant_body("round-robin")),
    )
    .await
    .expect("the router answers");
    assert_eq!(reply.status, 201, "write {id}: {:?}", reply.body);
    reply.body["version"].as_u64().expect("version")
}

fn explain_body(tenant: &str) -> Value {
    json!({"tenant": tenant, "request": {"model": POOL, "prompt": "hello raft world", "max_tokens": 1}})
}

/// A router with Raft on.
#[derive(Debug)]
pub(crate) struct Router {
    pub(crate) proc: Proc,
    /// Its admin API (and Raft) base URL.
    admin: String,
    id: u64,
}

/// The scratch directory, token file, voter addresses and engine of one test's cluster;
/// the directory is removed on drop (after the routers, declared later, are dropped).
pub(crate) struct Setup {
    dir: PathBuf,
    token_file: String,
    peer_token_file: String,
    voters: Vec<(u64, SocketAddr)>,
    /// The voters' client addresses, fixed so that a restarted voter (and a load
    /// balancer in front) finds it where it was.
    clients: Vec<SocketAddr>,
    engine: Proc,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Setup {
    pub(crate) fn new(test: &str, voters: u64) -> Setup {
        let dir = scratch_dir(test);
        let token_file = dir.join("admin.token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token file");
        let peer_token_file = dir.join("peer.token");
        std::fs::write(&peer_token_file, format!("{PEER_TOKEN}\n")).expect("token file");
        Setup {
            token_file: token_file.to_str().expect("utf-8 path").to_string(),
            peer_token_file: peer_token_file.to_str().expect("utf-8 path").to_string(),
            voters: (1..=voters).map(|id| (id, free_addr())).collect(),
            clients: (1..=voters).map(|_| free_addr()).collect(),
            engine: crate::engine_sim("1000", &[]),
            dir,
        }
    }

    /// Starts router `id` with its admin API on `admin_listen`; `Err` with what it printed
    /// when it did not come up with Raft (e.g. the admin port is still taken).
    fn try_start(&self, id: u64, admin_listen: &str) -> Result<Router, String> {
        self.try_start_with(id, admin_listen, Proc::start)
    }

    /// [`Setup::try_start`], the process started by `spawn` from the command line.
    fn try_start_with(
        &self,
        id: u64,
        admin_listen: &str,
        spawn: impl FnOnce(&[&str]) -> Proc,
    ) -> Result<Router, String> {
        let args = self.args(id, admin_listen);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut proc = spawn(&argv);
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

    /// Router `id`'s data directory.
    fn raft_dir(&self, id: u64) -> PathBuf {
        self.dir.join(format!("node-{id}"))
    }

    /// The command line of router `id` with its admin API on `admin_listen`.
    fn args(&self, id: u64, admin_listen: &str) -> Vec<String> {
        let raft_dir = self.raft_dir(id);
        let listen = match self.clients.get((id as usize).wrapping_sub(1)) {
            Some(addr) => addr.to_string(),
            None => "127.0.0.1:0".to_string(),
        };
        let mut args: Vec<String> = vec![
            "router".into(),
            "--listen".into(),
            listen,
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
            "--raft-peer-token-file".into(),
            self.peer_token_file.clone(),
        ];
        for (vid, addr) in &self.voters {
            args.push("--voter".into());
            args.push(format!("{vid}=http://{addr}"));
        }
        args
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

    pub(crate) fn start_voters(&self) -> Vec<Router> {
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
pub(crate) async fn wait_seeded(routers: &[&Router]) {
    for r in routers {
        let base = &r.admin;
        until(
            Duration::from_secs(15),
            &format!("router {} applying the seeded config", r.id),
            move || async move {
                let reply = admin(
                    base,
                    Method::POST,
                    "/route/explain",
                    Some(&explain_body("default")),
                )
                .await?;
                // Version 0 is the config file's own table, before Raft's arrives.
                let from_raft = reply.body["decision"]["config_version"].as_u64() > Some(0);
                (reply.status == 200 && from_raft).then_some(())
            },
        )
        .await;
    }
}

/// The leader's node id as `router` sees it.
async fn leader_of(router: &Router) -> u64 {
    let base = &router.admin;
    until(
        Duration::from_secs(15),
        "a raft leader",
        move || async move {
            let reply = admin(base, Method::GET, "/cluster", None).await?;
            reply.body["raft"]["leader"].as_u64()
        },
    )
    .await
}

/// The index in `routers` of the one that reports itself the Raft leader.
async fn leader_index(routers: &[Router]) -> usize {
    until(
        Duration::from_secs(15),
        "a router reporting itself the raft leader",
        move || async move {
            for (i, r) in routers.iter().enumerate() {
                let reply = admin(&r.admin, Method::GET, "/cluster", None).await;
                if reply.is_some_and(|r| r.body["raft"]["role"] == "Leader") {
                    return Some(i);
                }
            }
            None
        },
    )
    .await
}

/// The tenant ids of a linearizable read, and the config version, once `router` can serve
/// one.
async fn linearizable_tenants(router: &Router) -> (BTreeSet<String>, u64) {
    let base = &router.admin;
    until(
        Duration::from_secs(20),
        "a linearizable read",
        move || async move {
            let reply = admin(base, Method::GET, "/tenants", None).await?;
            (reply.status == 200).then(|| tenant_ids(&reply.body))
        },
    )
    .await
}

/// The tenant ids and the config version of a `/tenants` answer.
fn tenant_ids(body: &Value) -> (BTreeSet<String>, u64) {
    let ids = body["tenants"]
        .as_object()
        .expect("tenants object")
        .keys()
        .cloned()
        .collect();
    (ids, body["version"].as_u64().expect("version"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_voters_and_two_learners_share_the_configuration() {
    let s = Setup::new("raft-learners", 3);
    let voters = s.start_voters();
    let learners = [s.start_learner(4), s.start_learner(5)];
    let all: Vec<&Router> = voters.iter().chain(learners.iter()).collect();
    wait_seeded(&all).await;
    // The learners have joined: they know the leader.
    for l in &learners {
        leader_of(l).await;
    }

    let started = Instant::now();
    let reply = admin(
        &learners[0].admin,
        Method::PUT,
        "/tenants/acme",
        Some(&json!({"pool": POOL, "strategy": "round-robin", "prefix_length": 7})),
    )
    .await
    .expect("the learner answers");
    assert_eq!(
        reply.status, 201,
        "write through a learner: {:?}",
        reply.body
    );
    let version = reply.body["version"].as_u64().expect("version");

    let mut seen = Vec::new();
    for r in &all {
        let base = &r.admin;
        let body = until(
            Duration::from_secs(10),
            &format!("router {} seeing tenant acme", r.id),
            move || async move {
                let reply =
                    admin(base, Method::GET, "/tenants/acme?consistency=local", None).await?;
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
    let (ids, v) = linearizable_tenants(&learners[1]).await;
    assert!(ids.contains("acme") && ids.contains("default"), "{ids:?}");
    assert_eq!(v, version);
    println!(
        "tenant written through a learner visible on all 5 routers at version {version} after {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    // The Raft gauges (deploy/prometheus/rules.yml alerts on them): one leader, which
    // holds its quorum, and every member applied at least the write.
    let gauge = |text: &str, name: &str| -> f64 {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing from /metrics"
        );
        crate::router::metric(text, name)
    };
    let mut leaders = 0.0;
    for r in &all {
        let text = crate::router::get_text(&format!("{}/metrics", r.proc.url)).await;
        leaders += gauge(&text, "warmpath_raft_is_leader");
        assert_eq!(
            gauge(&text, "warmpath_raft_quorum_lost"),
            0.0,
            "router {}",
            r.id
        );
        assert_eq!(
            gauge(&text, "warmpath_raft_leader_known"),
            1.0,
            "router {}",
            r.id
        );
        assert!(
            gauge(&text, "warmpath_raft_applied_index") >= version as f64,
            "router {}",
            r.id
        );
        assert!(gauge(&text, "warmpath_raft_term") >= 1.0, "router {}", r.id);
    }
    assert_eq!(leaders, 1.0, "exactly one router reports leading");
}

/// The strategy `router` reports for the `default` tenant, and the config version.
async fn explained_strategy(router: &Router) -> Option<(String, u64)> {
    let reply = admin(
        &router.admin,
        Method::POST,
        "/route/explain",
        Some(&explain_body("default")),
    )
    .await?;
    if reply.status != 200 {
        return None;
    }
    let d = &reply.body["decision"];
    Some((
        d["strategy"].as_str()?.to_string(),
        d["config_version"].as_u64()?,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_change_alters_routing_on_every_router_within_a_second() {
    let s = Setup::new("raft-routing-change", 3);
    let voters = s.start_voters();
    let learner = s.start_learner(4);
    let all: Vec<&Router> = voters.iter().chain([&learner]).collect();
    wait_seeded(&all).await;
    for r in &all {
        let (strategy, _) = explained_strategy(r).await.expect("explain answers");
        assert_eq!(
            strategy, "prefix-aware",
            "router {} before the change",
            r.id
        );
    }

    let started = Instant::now();
    let reply = admin(
        &voters[1].admin,
        Method::PUT,
        "/tenants/default",
        Some(&tenant_body("round-robin")),
    )
    .await
    .expect("the router answers");
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let acked = started.elapsed();
    let version = reply.body["version"].as_u64().expect("version");

    let waits = all.iter().map(|r| async move {
        loop {
            if let Some((strategy, v)) = explained_strategy(r).await {
                if strategy == "round-robin" {
                    assert_eq!(v, version, "router {} explains with a later config", r.id);
                    return (r.id, started.elapsed());
                }
            }
            if started.elapsed() > Duration::from_secs(5) {
                panic!("router {} still routes the old way after 5 s", r.id);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let took = futures_util::future::join_all(waits).await;
    let slowest = took.iter().map(|(_, t)| *t).max().unwrap_or_default();
    let each: Vec<String> = took
        .iter()
        .map(|(id, t)| format!("{id}: {:.0} ms", t.as_secs_f64() * 1e3))
        .collect();
    println!(
        "strategy change acknowledged after {:.0} ms; every router routes with it after {:.0} ms ({})",
        acked.as_secs_f64() * 1e3,
        slowest.as_secs_f64() * 1e3,
        each.join(", ")
    );
    assert!(
        slowest < Duration::from_secs(1),
        "routing changed everywhere only after {slowest:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_during_writes_loses_no_acknowledged_write() {
    let s = Setup::new("raft-leader-kill", 3);
    let mut voters = s.start_voters();
    wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
    let li = leader_index(&voters).await;
    let leader = voters[li].id;
    let fi = (li + 1) % voters.len();
    let target = voters[fi].admin.clone();

    let mut acked = Vec::new();
    let mut unavailable = Vec::new(); // 503: not submitted
    let mut unknown = Vec::new(); // 504: may have been applied
    let mut killed_at = None;
    let mut first_after_kill = None;
    for i in 0..40 {
        if i == 10 {
            voters[li].proc.kill();
            killed_at = Some(Instant::now());
        }
        let id = format!("t{i}");
        let reply = admin(
            &target,
            Method::PUT,
            &format!("/tenants/{id}"),
            Some(&tenant_body("least-loaded")),
        )
        .await
        .unwrap_or_else(|| panic!("write {id}: the follower did not answer"));
        match reply.status {
            200..=299 => {
                if let (Some(k), None) = (killed_at, first_after_kill) {
                    first_after_kill = Some(k.elapsed());
                }
                acked.push(id);
            }
            503 => {
                assert!(
                    reply.message().contains("retry") && reply.retry_after().is_some(),
                    "write {id}: 503 without a retry hint: {:?} {:?}",
                    reply.headers,
                    reply.body
                );
                unavailable.push(id);
            }
            504 => {
                assert!(
                    reply.message().contains("MAY have been applied"),
                    "write {id}: 504 without saying it may have been applied: {:?}",
                    reply.body
                );
                unknown.push(id);
            }
            other => panic!("write {id}: unexpected {other}: {:?}", reply.body),
        }
    }

    let (present, version) = linearizable_tenants(&voters[fi]).await;
    let lost: Vec<&String> = acked.iter().filter(|t| !present.contains(*t)).collect();
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    let applied_anyway: Vec<&String> = unavailable
        .iter()
        .filter(|t| present.contains(*t))
        .collect();
    assert!(
        applied_anyway.is_empty(),
        "writes answered 503 (\"not submitted\") were applied: {applied_anyway:?}"
    );
    let unknown_applied = unknown.iter().filter(|t| present.contains(*t)).count();
    let first = first_after_kill.expect("the survivors accept writes after the kill");
    println!(
        "leader {leader} killed after 10 of 40 writes: {} acknowledged (all present at version {version}), \
         {} answered 503 retry, {} answered 504 may-have-been-applied ({unknown_applied} of those applied); \
         first acknowledged write {:.0} ms after the kill",
        acked.len(),
        unavailable.len(),
        unknown.len(),
        first.as_secs_f64() * 1e3
    );
    assert!(
        acked.len() >= 30,
        "too few writes acknowledged: {}",
        acked.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_survives_restarting_every_voter() {
    let s = Setup::new("raft-restart", 3);
    let mut voters = s.start_voters();
    wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
    let mut version = 0;
    let written: Vec<String> = (0..5).map(|i| format!("kept{i}")).collect();
    for (i, id) in written.iter().enumerate() {
        version = create_tenant(&voters[i % 3], id).await;
    }

    for v in &mut voters {
        v.proc.kill();
    }
    let restarted_at = Instant::now();
    let voters = s.start_voters();
    for v in &voters {
        let (ids, v_version) = linearizable_tenants(v).await;
        for id in &written {
            assert!(
                ids.contains(id),
                "router {} lost tenant {id}: {ids:?}",
                v.id
            );
        }
        assert!(ids.contains("default"), "router {}: {ids:?}", v.id);
        assert_eq!(v_version, version, "router {} config version", v.id);
    }
    println!(
        "all 3 voters restarted: the {} tenants are back (version {version}) {:.0} ms after the restart began",
        written.len(),
        restarted_at.elapsed().as_secs_f64() * 1e3
    );
    // They route with it again too.
    wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
}

/// One minority check: kill two of three voters, leaving the leader (`keep_leader`) or a
/// follower; the survivor refuses writes and linearizable reads and still serves local
/// reads. Returns what it answered, for the report.
async fn minority_case(test: &str, keep_leader: bool) -> String {
    let s = Setup::new(test, 3);
    let mut voters = s.start_voters();
    wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
    let version = create_tenant(&voters[0], "before").await;
    let leader = leader_index(&voters).await;
    let keep = if keep_leader {
        leader
    } else {
        (leader + 1) % voters.len()
    };
    // The survivor has applied the write before the others go.
    let base = &voters[keep].admin;
    until(
        Duration::from_secs(10),
        "the survivor applying the write",
        move || async move {
            let r = admin(base, Method::GET, "/tenants/before?consistency=local", None).await?;
            (r.status == 200).then_some(())
        },
    )
    .await;
    for (i, v) in voters.iter_mut().enumerate() {
        if i != keep {
            v.proc.kill();
        }
    }
    let survivor = &voters[keep];
    let base = &survivor.admin;
    let started = Instant::now();

    let write = |path: &'static str, body: Value| async move {
        let r = admin(base, Method::PUT, path, Some(&body))
            .await
            .expect("the survivor answers");
        match r.status {
            503 => assert!(
                r.retry_after().is_some() && r.message().contains("retry"),
                "{path}: 503 without a retry hint: {:?}",
                r.body
            ),
            504 => assert!(
                r.message().contains("MAY have been applied"),
                "{path}: 504 without saying it may have been applied: {:?}",
                r.body
            ),
            other => panic!(
                "{path}: a minority answered a write with {other}: {:?}",
                r.body
            ),
        }
        r.status
    };
    let read = |path: &'static str| async move {
        let r = admin(base, Method::GET, path, None)
            .await
            .expect("the survivor answers");
        assert_ne!(
            r.status, 200,
            "{path}: a stale linearizable read: {:?}",
            r.body
        );
        assert_eq!(r.status, 503, "{path}: {:?}", r.body);
        assert!(r.retry_after().is_some(), "{path}: no Retry-After");
        r.status
    };
    let (w1, w2, r1, r2) = tokio::join!(
        write("/tenants/after", tenant_body("least-loaded")),
        write("/pools/other", json!({"instances": ["http://127.0.0.1:9"]})),
        read("/tenants"),
        read("/tenants/before"),
    );
    let local = admin(base, Method::GET, "/tenants?consistency=local", None)
        .await
        .expect("the survivor answers");
    assert_eq!(local.status, 200, "{:?}", local.body);
    assert!(
        local.body["tenants"]["before"].is_object(),
        "{:?}",
        local.body
    );
    assert_eq!(local.body["version"].as_u64(), Some(version));
    // Issue 12, defect 7: a cut-off leader says it has lost its quorum.
    let status = admin(base, Method::GET, "/cluster", None)
        .await
        .expect("the survivor answers");
    let lost = &status.body["raft"]["quorum_lost"];
    assert_eq!(lost, &json!(keep_leader), "{:?}", status.body["raft"]);
    format!(
        "survivor was {}: writes {w1}/{w2}, linearizable reads {r1}/{r2}, local read 200, in {:.1} s",
        if keep_leader { "leader" } else { "follower" },
        started.elapsed().as_secs_f64()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_rejects_writes_and_linearizable_reads() {
    let (a, b) = tokio::join!(
        minority_case("raft-minority-leader", true),
        minority_case("raft-minority-follower", false)
    );
    println!("minority: {a}; {b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_admin_requests() {
    let s = Setup::new("raft-bad-admin", 1);
    let voters = s.start_voters();
    let r = &voters[0];
    let c = &client();
    wait_seeded(&[r]).await;
    let url = format!("{}/admin/v1/tenants", r.admin);
    let within = Duration::from_secs(10);

    let none = send(c, Method::GET, &url, None, &[], within)
        .await
        .expect("answer");
    assert_eq!(none.status, 401, "{:?}", none.body);
    assert_eq!(none.body["error"]["type"], "authentication_error");
    assert!(none.headers.contains_key("www-authenticate"));
    let wrong = send(
        c,
        Method::GET,
        &url,
        None,
        &[("authorization", "Bearer not-the-token")],
        within,
    )
    .await
    .expect("answer");
    assert_eq!(wrong.status, 401, "{:?}", wrong.body);
    assert!(
        wrong.message().contains("wrong admin token"),
        "{:?}",
        wrong.body
    );
    // Writes are refused the same way, and change nothing.
    let unauth_write = send(
        c,
        Method::PUT,
        &format!("{url}/sneaky"),
        Some(&tenant_body("round-robin")),
        &[],
        within,
    )
    .await
    .expect("answer");
    assert_eq!(unauth_write.status, 401);

    let bad = admin(
        &r.admin,
        Method::PUT,
        "/tenants/bad",
        Some(&json!({"strategy": "fastest", "block_tokens": 0, "pool": "nope"})),
    )
    .await
    .expect("answer");
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    let problems: Vec<&str> = bad.body["problems"]
        .as_array()
        .expect("a problems array")
        .iter()
        .map(|p| p.as_str().expect("a problem is text"))
        .collect();
    assert_eq!(problems.len(), 3, "{problems:?}");
    for (field, needle) in [
        ("strategy", "fastest"),
        ("block_tokens", "positive"),
        ("pool", "nope"),
    ] {
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with(field) && p.contains(needle)),
            "no problem about {field}: {problems:?}"
        );
    }

    // A pool's tokenizer must load and its template compile on the router taking the
    // write; agents must be HOST:PORT; an adapter must be the pool's alone.
    for (pool, needle) in [
        (
            json!({"instances": [], "adapters": ["bad-pool"]}),
            "the pool's model itself",
        ),
        (
            json!({"instances": [], "adapters": ["sql-lora", POOL]}),
            "the model of another pool",
        ),
        (
            json!({"instances": [], "tokenizer": "tiktoken:p50k"}),
            "tiktoken:o200k_base",
        ),
        (
            json!({"instances": [], "tokenizer": "hf:/nonexistent/tokenizer.json"}),
            "/nonexistent/tokenizer.json",
        ),
        (
            json!({"instances": [], "chat_template": "{% for %}"}),
            "chat template",
        ),
        (
            json!({"instances": [], "agents": ["http://gpu-1:7700"]}),
            "HOST:PORT",
        ),
    ] {
        let bad = admin(&r.admin, Method::PUT, "/pools/bad-pool", Some(&pool))
            .await
            .expect("answer");
        assert_eq!(bad.status, 400, "{:?}", bad.body);
        assert!(
            bad.body.to_string().contains(needle),
            "{needle}: {:?}",
            bad.body
        );
    }

    let list = admin(&r.admin, Method::GET, "/tenants", None)
        .await
        .expect("answer");
    assert_eq!(list.status, 200);
    assert!(
        list.body["tenants"].get("bad").is_none() && list.body["tenants"].get("sneaky").is_none()
    );
    let v0 = list.body["version"].as_u64().expect("version");
    assert_eq!(
        list.headers.get("etag").and_then(|e| e.to_str().ok()),
        Some(format!("\"{v0}\"").as_str())
    );
    let auth = format!("Bearer {TOKEN}");
    let if_match = format!("\"{v0}\"");
    let cas = |strategy: &'static str| {
        let (url, auth, if_match) = (url.clone(), auth.clone(), if_match.clone());
        async move {
            send(
                c,
                Method::PUT,
                &format!("{url}/cas"),
                Some(&tenant_body(strategy)),
                &[("authorization", &auth), ("if-match", &if_match)],
                within,
            )
            .await
            .expect("answer")
        }
    };
    let first = cas("round-robin").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let v1 = first.body["version"].as_u64().expect("version");
    let stale = cas("least-loaded").await;
    assert_eq!(stale.status, 409, "{:?}", stale.body);
    assert_eq!(stale.body["current_version"].as_u64(), Some(v1));
    assert_eq!(stale.body["error"]["code"], "version_conflict");
    let now = admin(&r.admin, Method::GET, "/tenants/cas", None)
        .await
        .expect("answer");
    assert_eq!(
        now.body["tenant"]["strategy"], "round-robin",
        "the stale write changed nothing"
    );
}

/// Creates tenant `id` with a 2 rps rate limit and API key `key` on `r`, and waits until
/// the router routes for it.
pub(crate) async fn create_limited_tenant(r: &Router, id: &str, key: &str) {
    let reply = admin(
        &r.admin,
        Method::PUT,
        &format!("/tenants/{id}"),
        Some(&json!({"pool": POOL, "rate_limit_rps": 2.0, "api_keys": [key]})),
    )
    .await
    .expect("answer");
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    wait_routable(r, id).await;
}

/// Waits until `r` routes for tenant `id` (its explain knows it; explain takes no tokens).
async fn wait_routable(r: &Router, id: &str) {
    let (base, body) = (&r.admin, &explain_body(id));
    until(
        Duration::from_secs(10),
        "the router applying the tenant",
        move || async move {
            let r = admin(base, Method::POST, "/route/explain", Some(body)).await?;
            (r.status == 200).then_some(())
        },
    )
    .await;
}

/// One completion with API key `key`.
async fn completion(c: &HttpClient, r: &Router, key: &str) -> Reply {
    let auth = format!("Bearer {key}");
    let body = json!({"model": POOL, "prompt": "rate me", "max_tokens": 1});
    send(
        c,
        Method::POST,
        &format!("{}/v1/completions", r.proc.url),
        Some(&body),
        &[("authorization", &auth)],
        Duration::from_secs(10),
    )
    .await
    .expect("the router answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_answer_429_with_retry_after() {
    let s = Setup::new("raft-rate-limit", 1);
    let voters = s.start_voters();
    let r = &voters[0];
    let c = &client();
    wait_seeded(&[r]).await;
    let key = "sk-it-limited-1";
    create_limited_tenant(r, "limited", key).await;

    let started = Instant::now();
    let mut statuses = Vec::new();
    let mut limited = Vec::new();
    for _ in 0..6 {
        let reply = completion(c, r, key).await;
        statuses.push(reply.status);
        if reply.status == 429 {
            limited.push(reply);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let ok = statuses.iter().filter(|s| **s == 200).count();
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?} {:?}",
        completion(c, r, key).await.body
    );
    assert_eq!(statuses[0], 200, "{statuses:?}");
    // A burst of one second's worth (2), plus what refilled meanwhile.
    let allowed = 2 + (elapsed * 2.0).ceil() as usize;
    assert!(
        ok <= allowed,
        "{ok} admitted in {elapsed:.2} s at 2 rps: {statuses:?}"
    );
    assert!(
        !limited.is_empty(),
        "no 429 in a burst of 6 at 2 rps: {statuses:?}"
    );
    for reply in &limited {
        let retry = reply.retry_after().expect("Retry-After on 429");
        assert!((1..=2).contains(&retry), "Retry-After {retry}");
        assert_eq!(
            reply.body["error"]["type"], "rate_limit_error",
            "{:?}",
            reply.body
        );
        assert!(reply.message().contains("rate limit"), "{:?}", reply.body);
    }
    println!(
        "burst of 6 at 2 rps in {:.0} ms: {statuses:?}",
        elapsed * 1e3
    );
}

/// A configuration change (even to another tenant) must not refill a tenant's rate-limit
/// bucket: the router carries buckets over when it swaps in the new tenant table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_change_does_not_refill_rate_limits() {
    let s = Setup::new("raft-rate-limit-refill", 1);
    let voters = s.start_voters();
    let r = &voters[0];
    let c = &client();
    wait_seeded(&[r]).await;
    let key = "sk-it-limited-2";
    create_limited_tenant(r, "limited", key).await;
    let started = Instant::now();
    let mut statuses = Vec::new();
    for round in 0..4 {
        if round > 0 {
            // An unrelated change.
            let other = format!("other{round}");
            create_tenant(r, &other).await;
            wait_routable(r, &other).await;
        }
        for _ in 0..3 {
            statuses.push(completion(c, r, key).await.status);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let allowed = 2 + (elapsed * 2.0).ceil() as usize;
    assert!(
        ok <= allowed,
        "{ok} admitted in {elapsed:.2} s at 2 rps: {statuses:?}"
    );
}

/// Raft RPCs are refused without the peer token, before their body is read: garbage, an
/// oversized body and a well-formed forged vote or append all get 401, and the cluster's
/// term and leader do not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_rpcs_need_the_peer_token_before_the_body_is_read() {
    let s = Setup::new("raft-peer-auth", 3);
    let voters = s.start_voters();
    let all: Vec<&Router> = voters.iter().collect();
    let c = &client();
    wait_seeded(&all).await;
    let leader = leader_of(&voters[0]).await;
    let status = |r: &Router| {
        let base = r.admin.clone();
        async move {
            let reply = admin(&base, Method::GET, "/cluster?consistency=local", None)
                .await
                .expect("cluster status");
            (
                reply.body["raft"]["term"].as_u64(),
                reply.body["raft"]["leader"].as_u64(),
            )
        }
    };
    let before = status(&voters[0]).await;
    let raw = |path: &str, body: Bytes, auth: Option<&str>| {
        let mut req = hyper::Request::post(format!(
            "{}{path}",
            voters[1].admin.trim_end_matches("/admin/v1")
        ))
        .header("content-type", "application/json");
        if let Some(t) = auth {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req.body(Full::new(body)).expect("request");
        async move {
            let resp = tokio::time::timeout(Duration::from_secs(5), c.request(req))
                .await
                .expect("an answer in time")
                .expect("an answer");
            resp.status().as_u16()
        }
    };
    let forged_vote = json!({"vote": {"leader_id": {"term": 99, "node_id": 7}, "committed": false},
        "last_log_id": null});
    let forged_append = json!({"vote": {"leader_id": {"term": 99, "node_id": 7}, "committed": true},
        "prev_log_id": null, "entries": [], "leader_commit": null});
    // A 64 MiB body announced, 1 KiB sent: the answer comes before the rest is read.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let host = voters[1].admin.trim_start_matches("http://").to_string();
        let mut tcp = tokio::net::TcpStream::connect(&host)
            .await
            .expect("connect");
        let head = format!(
            "POST /raft/write HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            64u64 << 20
        );
        tcp.write_all(head.as_bytes()).await.expect("send the head");
        tcp.write_all(&[b'x'; 1024])
            .await
            .expect("send a little body");
        let mut answer = vec![0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut answer))
            .await
            .expect("an answer before the body is sent")
            .expect("read");
        let line = String::from_utf8_lossy(&answer[..n]).to_string();
        assert!(line.starts_with("HTTP/1.1 401"), "{line}");
    }
    for (path, body) in [
        ("/raft/write", Bytes::from_static(b"{not json")),
        ("/raft/vote", Bytes::from(forged_vote.to_string())),
        ("/raft/append", Bytes::from(forged_append.to_string())),
        (
            "/raft/pre-vote",
            Bytes::from(json!({"candidate": 7, "last_log_id": null}).to_string()),
        ),
        ("/raft/join", Bytes::from_static(b"{}")),
    ] {
        assert_eq!(
            raw(path, body.clone(), None).await,
            401,
            "{path} without a token"
        );
        assert_eq!(
            raw(path, body, Some("wrong")).await,
            401,
            "{path} with a wrong token"
        );
    }
    let after = status(&voters[0]).await;
    assert_eq!(before, after, "the forged vote and append changed nothing");
    assert_eq!(leader_of(&voters[2]).await, leader);
}

/// A router refuses to start Raft without peer credentials unless told, in so many words,
/// to run insecure; a security setting given twice differently is an error at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_refuses_to_start_without_peer_credentials() {
    let s = Setup::new("raft-no-peer-token", 1);
    let dir = s.dir.join("node-1");
    let addr = free_addr().to_string();
    let base: Vec<String> = vec![
        "router".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--raft-node-id".into(),
        "1".into(),
        "--raft-dir".into(),
        dir.to_str().expect("utf-8").into(),
        "--admin-listen".into(),
        addr.clone(),
        "--admin-token-file".into(),
        s.token_file.clone(),
        "--voter".into(),
        format!("1=http://{addr}"),
    ];
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        crate::warmpath(&args)
    };
    let out = run(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--raft-peer-token-file"), "{err}");
    assert!(err.contains("--insecure-raft-without-peer-token"), "{err}");
    // Both a token and the insecure switch: refused, not guessed.
    let out = run(&[
        "--raft-peer-token-file",
        &s.peer_token_file,
        "--insecure-raft-without-peer-token",
    ]);
    assert!(!out.status.success());
    // A token in the config file and another by flag: refused.
    let other = s.dir.join("other.token");
    std::fs::write(&other, "another-token").expect("token file");
    let file = s.dir.join("router.toml");
    std::fs::write(
        &file,
        format!(
            "version = 1\n[raft]\nnode_id = 1\ndata_dir = {dir:?}\nadmin_listen = {addr:?}\n\
             admin_token_file = {:?}\npeer_token_file = {:?}\n[raft.voters]\n1 = \"http://{addr}\"\n",
            s.token_file, s.peer_token_file
        ),
    )
    .expect("config file");
    let out = crate::warmpath(&[
        "router",
        "--config",
        file.to_str().expect("utf-8"),
        "--raft-peer-token-file",
        other.to_str().expect("utf-8"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("given twice"), "{err}");
    // A peer token for a router without Raft: refused, never dropped.
    let out = crate::warmpath(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--raft-peer-token-file",
        &s.peer_token_file,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("Raft is off"), "{err}");
}

/// A learner (a router that joined, or anything that got in as one) can be removed through
/// the admin API; voters cannot be removed that way.
/// The tenant ids a router serves from its own applied state, and its config version.
async fn local_tenants(router: &Router) -> (BTreeSet<String>, u64) {
    let reply = admin(
        &router.admin,
        Method::GET,
        "/tenants?consistency=local",
        None,
    )
    .await
    .expect("a local read");
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    tenant_ids(&reply.body)
}

/// Issue 12, defect 1: a follower's store edited on disk after a clean shutdown (same
/// length, valid JSON) was applied and served. Now every stored value carries a checksum:
/// the node refuses to start and says how to repair it, and repaired it converges on the
/// leader's content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_altered_after_a_clean_shutdown_is_refused_then_repaired_from_the_leader() {
    let s = Setup::new("raft-bitrot", 3);
    let mut voters = s.start_voters();
    wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
    let leader = leader_index(&voters).await;
    let version = create_tenant(&voters[leader], "rot-a1").await;
    let f = (leader + 1) % 3;
    let id = voters[f].id;
    until(
        Duration::from_secs(10),
        "the follower applying the write",
        || async {
            let (ids, v) = local_tenants(&voters[f]).await;
            (ids.contains("rot-a1") && v == version).then_some(())
        },
    )
    .await;

    // A clean shutdown, then the tenant's id altered in place wherever the file holds it.
    voters[f].proc.signal("-TERM");
    let _ = voters[f].proc.child.wait();
    let file = s.raft_dir(id).join("raft.redb");
    let mut bytes = std::fs::read(&file).expect("the store file");
    let mut altered = 0;
    for i in 0..bytes.len().saturating_sub(6) {
        if &bytes[i..i + 6] == b"rot-a1" {
            bytes[i + 5] = b'9';
            altered += 1;
        }
    }
    assert!(altered > 0, "the file holds the tenant id");
    std::fs::write(&file, &bytes).expect("the store file written");

    let addr = s.voters[f].1.to_string();
    let args = s.args(id, &addr);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = crate::warmpath_exits_within(&argv, Duration::from_secs(15))
        .expect("the node started on a store altered on disk");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a corrupt store must not serve: {err}"
    );
    assert!(err.contains("checksum") && err.contains("aside"), "{err}");

    // Repaired as the error says: the store moved aside, the node started again.
    std::fs::rename(s.raft_dir(id), s.dir.join(format!("node-{id}.corrupt")))
        .expect("the store moved aside");
    voters[f] = s.start(id, &addr);
    until(
        Duration::from_secs(20),
        "the repaired node catching up",
        || async {
            let (ids, v) = local_tenants(&voters[f]).await;
            (v >= version).then_some(ids)
        },
    )
    .await;
    let (ids, _) = local_tenants(&voters[f]).await;
    assert!(ids.contains("rot-a1") && !ids.contains("rot-a9"), "{ids:?}");
    println!(
        "altered {altered} copies; refused with: {}",
        err.lines().last().unwrap_or("")
    );
}

/// Issue 12, defect 3: a write forwarded to a leader that then froze (SIGSTOP) waited out
/// the 5 s write timeout and answered 504, though the majority elected a new leader in
/// about 2 s. Now the follower forwards it to the new leader as soon as it knows one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_does_not_stall_writes_through_the_majority() {
    let s = Setup::new("raft-paused-leader", 3);
    let voters = s.start_voters();
    wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
    let leader = leader_index(&voters).await;
    let f = (leader + 1) % 3;
    voters[leader].proc.signal("-STOP");
    let started = Instant::now();
    // The follower still takes the frozen node for the leader and forwards the write there.
    let reply = admin(
        &voters[f].admin,
        Method::PUT,
        "/tenants/after-pause",
        Some(&tenant_body("round-robin")),
    )
    .await
    .expect("the follower answers");
    let took = started.elapsed();
    voters[leader].proc.signal("-CONT");
    assert_eq!(reply.status, 201, "after {took:?}: {:?}", reply.body);
    let (ids, _) = linearizable_tenants(&voters[f]).await;
    assert!(ids.contains("after-pause"), "{ids:?}");
    println!("a write through the majority while the leader was frozen: 201 after {took:?}");
}

/// A client's `Idempotency-Key` makes a retried write apply once, through any router; the
/// same key for another write is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_retried_with_its_idempotency_key_applies_once() {
    let s = Setup::new("raft-idempotency", 3);
    let voters = s.start_voters();
    wait_seeded(&voters.iter().collect::<Vec<_>>()).await;
    let put = |router: usize, key: &'static str, prefix_length: u32| {
        let base = voters[router].admin.clone();
        async move {
            let client = AdminClient::new(&base, Some(TOKEN.to_string())).expect("a client");
            let body =
                json!({"pool": POOL, "strategy": "round-robin", "prefix_length": prefix_length});
            let r = client
                .send_raw(
                    Method::PUT,
                    &format!("{PREFIX}/tenants/idem"),
                    Some(body.to_string().into_bytes()),
                    &[("idempotency-key", key.to_string())],
                )
                .await
                .expect("the router answers");
            (r.status, r.body)
        }
    };
    let (status, first) = put(0, "it-key-1", 7).await;
    assert_eq!(status, 201, "{first}");
    let version = first["version"].as_u64().expect("version");
    // Another write moves the version on; the retry through another router must not.
    create_tenant(&voters[1], "between").await;
    let (status, again) = put(2, "it-key-1", 7).await;
    assert!(status == 200 || status == 201, "{again}");
    assert_eq!(again["version"].as_u64(), Some(version), "{again}");
    let (ids, now) = linearizable_tenants(&voters[2]).await;
    assert!(ids.contains("between") && now > version, "{ids:?} {now}");
    // The same key for another write: refused, nothing changed.
    let (status, other) = put(1, "it-key-1", 9).await;
    assert_eq!(status, 400, "{other}");
    assert!(other.to_string().contains("already used"), "{other}");
    let reply = admin(&voters[0].admin, Method::GET, "/tenants/idem", None)
        .await
        .expect("a read");
    assert_eq!(reply.body["tenant"]["prefix_length"], 7, "{:?}", reply.body);
    // A key that is not one.
    let (status, bad) = put(0, "", 7).await;
    assert_eq!(status, 400, "{bad}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learners_are_removable() {
    let s = Setup::new("raft-remove-learner", 3);
    let voters = s.start_voters();
    let learner = s.start_learner(4);
    let all: Vec<&Router> = voters.iter().chain(std::iter::once(&learner)).collect();
    wait_seeded(&all).await;
    leader_of(&learner).await;
    let learners = |r: &Router| {
        let base = r.admin.clone();
        async move {
            let reply = admin(&base, Method::GET, "/cluster", None).await?;
            reply.body["raft"]["learners"].as_object().map(|m| m.len())
        }
    };
    // Asks the voter that leads now: the first election on a loaded machine can move
    // the leadership after the test found it: a follower answers 421, a node between
    // leaders 503.
    let delete = |id: u64| {
        let voters = &voters;
        async move {
            until(
                Duration::from_secs(15),
                "an answer from the leader",
                || async move {
                    let leader = &voters[leader_index(voters).await];
                    let path = format!("/cluster/learners/{id}");
                    let reply = admin(&leader.admin, Method::DELETE, &path, None).await?;
                    (reply.status != 421 && reply.status != 503).then_some(reply)
                },
            )
            .await
        }
    };
    until(Duration::from_secs(10), "the learner joined", || async {
        learners(&voters[leader_index(&voters).await])
            .await
            .filter(|&n| n == 1)
    })
    .await;
    let gone = delete(4).await;
    assert_eq!(gone.status, 200, "{:?}", gone.body);
    until(Duration::from_secs(10), "the learner is gone", || async {
        learners(&voters[leader_index(&voters).await])
            .await
            .filter(|&n| n == 0)
    })
    .await;
    let voter = delete(1).await;
    assert_eq!(voter.status, 400, "{:?}", voter.body);
    let unknown = delete(99).await;
    assert_eq!(unknown.status, 404, "{:?}", unknown.body);
}

impl Setup {
    /// Starts voter `id` with its Raft data directory on a tmpfs of `bytes` in a mount
    /// namespace of its own (see [`Proc::start_with_small_disk`]); the test reaches the
    /// directory through `/proc/PID/root`.
    fn start_on_small_disk(&self, id: u64, bytes: u64) -> Router {
        let admin_listen = self
            .voters
            .iter()
            .find(|(vid, _)| *vid == id)
            .map(|(_, a)| a.to_string())
            .expect("a voter");
        let dir = self.raft_dir(id);
        std::fs::create_dir_all(&dir).expect("the mount point");
        self.try_start_with(id, &admin_listen, |argv| {
            Proc::start_with_small_disk(&dir, bytes, argv)
        })
        .unwrap_or_else(|line| panic!("router {id}: {line:?}"))
    }
}

/// `/readyz` of `r`: its status and body.
async fn readyz(c: &HttpClient, r: &Router) -> Option<(u16, String)> {
    let reply = send(
        c,
        Method::GET,
        &format!("{}/readyz", r.proc.url),
        None,
        &[],
        Duration::from_secs(2),
    )
    .await?;
    Some((reply.status, reply.body.as_str().unwrap_or("").to_string()))
}

/// Issue 22, 1 and 2: a router whose Raft disk fills stops following the cluster. It
/// must leave service at once (readyz 503 naming the cause, completions 503, so an API
/// key it has not seen is never served), answer writes sent to it with what happened
/// (forwarded to the healthy leader, or 503 with the cause, never "outcome unknown"),
/// and come back by itself once space returns: Raft started again from its store,
/// caught up, ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_whose_raft_disk_fills_leaves_service_and_comes_back_by_itself() {
    let s = Setup::new("raft-disk-full", 3);
    let r1 = s.start(1, &s.voters[0].1.to_string());
    let r2 = s.start(2, &s.voters[1].1.to_string());
    let r3 = s.start_on_small_disk(3, 16 << 20);
    wait_seeded(&[&r1, &r2, &r3]).await;
    let c = &client();
    until(Duration::from_secs(10), "router 3 ready", || async {
        (readyz(c, &r3).await?.0 == 200).then_some(())
    })
    .await;
    // No tenant has keys yet: any key is the default tenant's, on every router.
    assert_eq!(completion(c, &r3, "not-a-key").await.status, 200);

    let disk = warmpath_testkit::in_namespace_of(r3.proc.pid(), &s.raft_dir(3));
    warmpath_testkit::fill_disk(&disk).expect("the filler file");
    let filled = Instant::now();
    // Writes through the healthy routers until router 3's Raft fails to store one.
    let mut n = 0;
    let (status, why) = until(Duration::from_secs(60), "router 3 leaving service", || {
        n += 1;
        let id = format!("filler-{n}");
        let (r1, r3) = (&r1, &r3);
        async move {
            let _ = admin(
                &r1.admin,
                Method::PUT,
                &format!("/tenants/{id}"),
                Some(&tenant_body("round-robin")),
            )
            .await;
            let (status, body) = readyz(c, r3).await?;
            (status != 200).then_some((status, body))
        }
    })
    .await;
    let to_unready = filled.elapsed();
    assert_eq!(status, 503, "{why}");
    assert!(
        why.contains("raft stopped"),
        "readyz names the cause: {why}"
    );

    // A keyed tenant created through the healthy routers: they refuse unknown keys.
    let reply = admin(
        &r1.admin,
        Method::PUT,
        "/tenants/acme",
        Some(&json!({"pool": POOL, "api_keys": ["acme-key"]})),
    )
    .await
    .expect("an answer");
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    wait_routable(&r2, "acme").await;
    until(
        Duration::from_secs(5),
        "router 2 refusing unknown keys",
        || async { (completion(c, &r2, "not-a-key").await.status == 401).then_some(()) },
    )
    .await;
    // The stopped router serves no tenant at all, with the cause and a retry hint.
    let refused = completion(c, &r3, "not-a-key").await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert!(
        refused.message().contains("raft stopped"),
        "{:?}",
        refused.body
    );
    assert_eq!(refused.retry_after(), Some(1));
    assert_eq!(completion(c, &r3, "acme-key").await.status, 503);

    // A write sent to it is forwarded to the leader it knows, or refused with the cause:
    // never "outcome unknown" for a write that was not submitted.
    let reply = admin(
        &r3.admin,
        Method::PUT,
        "/tenants/via-stopped",
        Some(&tenant_body("round-robin")),
    )
    .await
    .expect("an answer");
    assert!(
        reply.status == 201 || (reply.status == 503 && reply.message().contains("stopped")),
        "{} {:?}",
        reply.status,
        reply.body
    );
    let forwarded = reply.status == 201;
    let status = admin(&r3.admin, Method::GET, "/cluster", None)
        .await
        .expect("an answer");
    assert_eq!(status.status, 200, "{:?}", status.body);

    // Space returns: Raft starts again from its store, catches up and the router is ready.
    std::fs::remove_file(disk.join("filler")).expect("the filler removed");
    let freed = Instant::now();
    until(Duration::from_secs(30), "router 3 ready again", || async {
        (readyz(c, &r3).await?.0 == 200).then_some(())
    })
    .await;
    let to_ready = freed.elapsed();
    wait_routable(&r3, "acme").await;
    assert_eq!(completion(c, &r3, "not-a-key").await.status, 401);
    assert_eq!(completion(c, &r3, "acme-key").await.status, 200);
    if forwarded {
        wait_routable(&r3, "via-stopped").await;
    }
    eprintln!(
        "raft disk full: {n} writes after the disk filled; disk full -> readyz 503 in {:.2} s; \
         space back -> ready and following in {:.2} s; write through the stopped router: {}",
        to_unready.as_secs_f64(),
        to_ready.as_secs_f64(),
        if forwarded {
            "forwarded to the leader"
        } else {
            "503"
        },
    );
}

/// nginx in front of the routers' client ports and their admin ports: the plain load
/// balancer of the README's cluster recipe. A refused connection or a 503 (a router
/// starting or not following) passes the request to the next router; nothing else does,
/// so a write whose outcome is unknown is never sent twice by the balancer.
struct Nginx {
    child: std::process::Child,
    /// Base URL of the client side.
    url: String,
    /// Base URL of the admin side.
    admin: String,
}

impl Nginx {
    fn start(dir: &std::path::Path, clients: &[SocketAddr], admins: &[SocketAddr]) -> Nginx {
        let (front, back) = (free_addr(), free_addr());
        let servers = |addrs: &[SocketAddr]| {
            addrs
                .iter()
                .map(|a| format!("server {a} max_fails=0;"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let d = dir.display();
        let conf = format!(
            "master_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log warn;\n\
             events {{ worker_connections 512; }}\n\
             http {{\n access_log off;\n\
             client_body_temp_path {d}/nginx-body; proxy_temp_path {d}/nginx-proxy;\n\
             fastcgi_temp_path {d}/nginx-fcgi; uwsgi_temp_path {d}/nginx-uwsgi; scgi_temp_path {d}/nginx-scgi;\n\
             upstream routers {{ {} keepalive 16; }}\n\
             upstream admins {{ {} keepalive 8; }}\n\
             server {{ listen {front}; location / {{ proxy_pass http://routers; proxy_http_version 1.1; \
             proxy_set_header Connection \"\"; proxy_buffering off; \
             proxy_next_upstream error http_503 non_idempotent; proxy_next_upstream_tries 3; }} }}\n\
             server {{ listen {back}; location / {{ proxy_pass http://admins; proxy_http_version 1.1; \
             proxy_set_header Connection \"\"; \
             proxy_next_upstream error http_503; proxy_next_upstream_tries 3; }} }}\n}}\n",
            servers(clients),
            servers(admins),
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).expect("nginx.conf");
        let child = std::process::Command::new(warmpath_testkit::system_tool("nginx"))
            .args(["-e", &format!("{d}/nginx-error.log"), "-p"])
            .arg(dir)
            .arg("-c")
            .arg(&path)
            .args(["-g", "daemon off;"])
            .spawn()
            .expect("nginx starts");
        Nginx {
            child,
            url: format!("http://{front}"),
            admin: format!("http://{back}"),
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issue 22, 3: a rolling restart of every router behind nginx, under completions (half
/// of them streamed) and an admin writer, fails no client request and no admin write.
/// Each router is stopped with SIGTERM (a leader hands off first) and started again on
/// the same ports and data directory, the next one once it is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_behind_nginx_fails_no_request_and_no_admin_write() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let s = Setup::new("raft-rolling", 3);
    let mut routers = s.start_voters();
    wait_seeded(&routers.iter().collect::<Vec<_>>()).await;
    let c = client();
    for r in &routers {
        until(Duration::from_secs(10), "router ready", || async {
            (readyz(&c, r).await?.0 == 200).then_some(())
        })
        .await;
    }
    let admins: Vec<SocketAddr> = s.voters.iter().map(|(_, a)| *a).collect();
    let nginx = Nginx::start(&s.dir, &s.clients, &admins);
    until(Duration::from_secs(10), "nginx up", || async {
        let url = format!("{}/readyz", nginx.url);
        let r = send(&c, Method::GET, &url, None, &[], Duration::from_secs(1)).await?;
        (r.status == 200).then_some(())
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut load = Vec::new();
    for worker in 0..2 {
        let (stop, failures, url, c) =
            (stop.clone(), failures.clone(), nginx.url.clone(), c.clone());
        load.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let stream = (n + worker).is_multiple_of(2);
                let body = json!({"model": POOL, "prompt": format!("rolling {worker} {n}"), "max_tokens": 4, "stream": stream});
                let reply = send(
                    &c,
                    Method::POST,
                    &format!("{url}/v1/completions"),
                    Some(&body),
                    &[],
                    Duration::from_secs(10),
                )
                .await;
                let ok = reply.as_ref().is_some_and(|r| {
                    r.status == 200
                        && (!stream || r.body.as_str().is_some_and(|t| t.contains("[DONE]")))
                });
                if !ok {
                    let what = reply.map(|r| format!("{} {}", r.status, r.body));
                    failures.lock().unwrap().push(format!("completion {worker}/{n}: {what:?}"));
                }
            }
            n
        }));
    }
    let acknowledged = Arc::new(Mutex::new(Vec::<String>::new()));
    let writer = {
        let (stop, failures, acknowledged, base) = (
            stop.clone(),
            failures.clone(),
            acknowledged.clone(),
            nginx.admin.clone(),
        );
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let id = format!("rolling-{n}");
                let reply = admin(
                    &base,
                    Method::PUT,
                    &format!("/tenants/{id}"),
                    Some(&tenant_body("round-robin")),
                )
                .await;
                match reply {
                    Some(r) if r.status == 201 || r.status == 200 => {
                        acknowledged.lock().unwrap().push(id)
                    }
                    other => failures.lock().unwrap().push(format!(
                        "admin write {id}: {:?}",
                        other.map(|r| (r.status, r.body))
                    )),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut downtime = Vec::new();
    for (router, (id, admin_listen)) in routers.iter_mut().zip(&s.voters) {
        let (id, admin_listen) = (*id, admin_listen.to_string());
        let stopping = Instant::now();
        router.proc.signal("-TERM");
        let _ = router.proc.child.wait();
        let stopped = stopping.elapsed();
        *router = s.start(id, &admin_listen);
        let r = &*router;
        until(
            Duration::from_secs(15),
            "the restarted router ready",
            || async { (readyz(&c, r).await?.0 == 200).then_some(()) },
        )
        .await;
        downtime.push((stopped, stopping.elapsed()));
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let mut completions = 0;
    for task in load {
        completions += task.await.expect("the load ran");
    }
    writer.await.expect("the writer ran");

    let failures = failures.lock().unwrap().clone();
    let acknowledged = acknowledged.lock().unwrap().clone();
    eprintln!(
        "rolling restart of 3 routers behind nginx: {completions} completions (half streamed), \
         {} admin writes acknowledged, {} failed; per router (stopped after, ready after): {:?}",
        acknowledged.len(),
        failures.len(),
        downtime
            .iter()
            .map(|(a, b)| format!("{:.2} s, {:.2} s", a.as_secs_f64(), b.as_secs_f64()))
            .collect::<Vec<_>>()
    );
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(
        acknowledged.len() > 10,
        "the writer wrote: {acknowledged:?}"
    );
    let (ids, _) = linearizable_tenants(&routers[0]).await;
    let lost: Vec<_> = acknowledged
        .iter()
        .filter(|id| !ids.contains(*id))
        .collect();
    assert!(lost.is_empty(), "acknowledged but lost: {lost:?}");
}
