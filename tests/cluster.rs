//! Router replicas active-active: real `warmpath router` processes gossiping on loopback,
//! in front of real engine-sims.

use crate::router::{get_text, metric};
use crate::Proc;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new())
}

/// A router replica and its gossip address.
struct Replica {
    proc: Proc,
    gossip: String,
}

fn replica(name: &str, engines: &[&Proc], seeds: &[&str]) -> Replica {
    replica_with(name, engines, seeds, &[])
}

/// [`replica`] with further flags.
fn replica_with(name: &str, engines: &[&Proc], seeds: &[&str], extra: &[&str]) -> Replica {
    let mut args: Vec<String> = [
        "router",
        "--listen",
        "127.0.0.1:0",
        "--node-id",
        name,
        "--gossip-listen",
        "127.0.0.1:0",
        "--fault-injection",
        "--strategy",
        "prefix-aware",
        "--allow-explain",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for e in engines {
        args.push("--instance".into());
        args.push(e.url.clone());
    }
    for s in seeds {
        args.push("--seed".into());
        args.push(s.to_string());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut proc = Proc::start(&argv);
    let line = proc.read_line();
    let gossip = line
        .split("gossip on ")
        .nth(1)
        .unwrap_or_else(|| panic!("no gossip line: {line:?}"))
        .trim()
        .to_string();
    Replica { proc, gossip }
}

fn engine() -> Proc {
    crate::engine_sim("1000", &[])
}

/// Sends a completion with an explanation; `None` if the router could not be reached.
async fn explain(c: &HttpClient, router: &str, prompt: &str) -> Option<(u16, Value)> {
    let body = json!({"model": "sim-llama", "prompt": prompt, "max_tokens": 1}).to_string();
    let req = hyper::Request::post(format!("{router}/v1/completions"))
        .header("x-warmpath-explain", "1")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let why = resp
        .headers()
        .get("x-warmpath-explain")
        .and_then(|v| serde_json::from_slice(v.as_bytes()).ok())
        .unwrap_or(Value::Null);
    resp.into_body().collect().await.ok()?;
    Some((status, why))
}

/// The router's explained choice for `prompt`, without sending it or changing state.
async fn dry_run(c: &HttpClient, router: &str, prompt: &str) -> Option<(u16, Value)> {
    let body = json!({"model": "sim-llama", "prompt": prompt, "max_tokens": 1}).to_string();
    let req = hyper::Request::post(format!("{router}/debug/route"))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

/// Waits until `router` would route `prompt` to `instance` by its longest prefix. Polls
/// with dry runs, so the polling itself never teaches the router anything.
async fn wait_for_match(
    c: &HttpClient,
    router: &str,
    prompt: &str,
    instance: &str,
    within: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if let Some((200, why)) = dry_run(c, router, prompt).await {
            if why["reason"] == "longest-prefix"
                && why["instance"] == instance
                && why["matched"]["gpu"].as_u64() > Some(0)
            {
                return Some(start.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

fn prompt(seed: u64) -> String {
    warmpath_index::text::words(seed, 400)
}

async fn post_simple(c: &HttpClient, url: &str, path: &str) -> u16 {
    let req = hyper::Request::post(format!("{url}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    c.request(req)
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_routing_decisions() {
    let (e1, e2) = (engine(), engine());
    let a = replica("a", &[&e1, &e2], &[]);
    let b = replica("b", &[&e1, &e2], &[&a.gossip]);
    let c3 = replica("c", &[&e1, &e2], &[&a.gossip]);
    let c = client();
    for seed in 0..5 {
        let p = prompt(seed);
        let (status, why) = explain(&c, &a.proc.url, &p).await.unwrap();
        assert_eq!(status, 200);
        let owner = why["instance"].as_str().unwrap().to_string();
        // The other replicas learn the decision and send the prefix to the same instance.
        for other in [&b, &c3] {
            let took =
                wait_for_match(&c, &other.proc.url, &p, &owner, Duration::from_secs(5)).await;
            assert!(
                took.is_some(),
                "replica never learned prompt {seed}'s owner {owner}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_router_loses_no_request_for_a_retrying_client() {
    let e1 = engine();
    let mut a = replica("a", &[&e1], &[]);
    let b = replica("b", &[&e1], &[&a.gossip]);
    let c = client();
    let routers = [a.proc.url.clone(), b.proc.url.clone()];
    let mut ok = 0;
    let mut retried = 0;
    for i in 0..40u64 {
        if i == 20 {
            a.proc.kill();
        }
        // A client behind a plain load balancer: try the next router when one fails.
        let mut done = false;
        for attempt in 0..routers.len() {
            let router = &routers[(i as usize + attempt) % routers.len()];
            match explain(&c, router, &prompt(1000 + i)).await {
                Some((200, _)) => {
                    done = true;
                    retried += usize::from(attempt > 0);
                    break;
                }
                _ => continue,
            }
        }
        assert!(done, "request {i} was lost");
        ok += 1;
    }
    assert_eq!(ok, 40);
    assert!(
        retried > 0,
        "requests for the dead router were retried on the other"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_router_keeps_serving_and_converges_after_healing() {
    let (e1, e2) = (engine(), engine());
    let a = replica("a", &[&e1, &e2], &[]);
    let b = replica("b", &[&e1, &e2], &[&a.gossip]);
    let c = client();
    // Both know each other before the cut.
    let warm = prompt(1);
    let (_, why) = explain(&c, &a.proc.url, &warm).await.unwrap();
    assert!(wait_for_match(
        &c,
        &b.proc.url,
        &warm,
        why["instance"].as_str().unwrap(),
        Duration::from_secs(5)
    )
    .await
    .is_some());

    assert_eq!(post_simple(&c, &b.proc.url, "/debug/partition").await, 200);
    // During the partition: b keeps serving, and decisions made on a do not reach it.
    let mut owners = Vec::new();
    for seed in 10..16 {
        let (status, why) = explain(&c, &a.proc.url, &prompt(seed)).await.unwrap();
        assert_eq!(status, 200);
        owners.push((seed, why["instance"].as_str().unwrap().to_string()));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, _) = explain(&c, &b.proc.url, &prompt(99)).await.unwrap();
    assert_eq!(status, 200, "a partitioned router keeps serving");
    for (seed, _) in &owners {
        let (_, why) = dry_run(&c, &b.proc.url, &prompt(*seed)).await.unwrap();
        assert_eq!(
            why["reason"], "no-match",
            "b learned prompt {seed} through the partition: {why}"
        );
    }

    assert_eq!(post_simple(&c, &b.proc.url, "/debug/heal").await, 200);
    for (seed, owner) in owners {
        let took = wait_for_match(
            &c,
            &b.proc.url,
            &prompt(seed),
            &owner,
            Duration::from_secs(10),
        )
        .await;
        assert!(
            took.is_some(),
            "after healing, b never learned prompt {seed}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_router_catches_up() {
    let (e1, e2) = (engine(), engine());
    let a = replica("a", &[&e1, &e2], &[]);
    let c = client();
    let mut owners = Vec::new();
    for seed in 200..220 {
        let (_, why) = explain(&c, &a.proc.url, &prompt(seed)).await.unwrap();
        owners.push((seed, why["instance"].as_str().unwrap().to_string()));
    }
    // A router started after all those decisions learns them from its peers.
    let started = Instant::now();
    let late = replica("late", &[&e1, &e2], &[&a.gossip]);
    let mut slowest = Duration::ZERO;
    for (seed, owner) in &owners {
        let took = wait_for_match(
            &c,
            &late.proc.url,
            &prompt(*seed),
            owner,
            Duration::from_secs(10),
        )
        .await;
        assert!(took.is_some(), "the new router never learned prompt {seed}");
        slowest = slowest.max(started.elapsed());
    }
    println!(
        "new router matched all {} earlier prompts {:.0} ms after it started",
        owners.len(),
        slowest.as_secs_f64() * 1e3
    );
}

/// Starts a gossiping router with `extra` flags under an open-file limit of `files`; its
/// HTTP URL and gossip address.
fn gossiping_router(engine: &Proc, files: u32, extra: &[&str]) -> (Proc, String) {
    let mut args = vec![
        "router",
        "--listen",
        "127.0.0.1:0",
        "--node-id",
        "lone",
        "--gossip-listen",
        "127.0.0.1:0",
        "--instance",
        &engine.url,
    ];
    args.extend_from_slice(extra);
    let mut proc = Proc::start_with_file_limit(files, &args);
    let line = proc.read_line();
    let gossip = line
        .split("gossip on ")
        .nth(1)
        .unwrap_or_else(|| panic!("no gossip line: {line:?}"))
        .trim()
        .to_string();
    (proc, gossip)
}

/// With a cluster secret, an anonymous chitchat Syn gets no reply and is counted as dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_gossip_syn_gets_no_reply() {
    let e = engine();
    let dir = crate::scratch_dir("gossip-anonymous");
    let secret = dir.join("gossip.secret");
    std::fs::write(&secret, "a cluster secret of thirty-two bytes").unwrap();
    let (r, gossip) = gossiping_router(
        &e,
        4096,
        &["--gossip-secret-file", secret.to_str().unwrap()],
    );
    let spy = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    // A chitchat Syn is its magic number, a message kind and a digest: 16 bytes will do.
    let mut syn = 45_139u16.to_le_bytes().to_vec();
    syn.extend_from_slice(&[0u8; 14]);
    for _ in 0..5 {
        spy.send_to(&syn, &gossip).await.unwrap();
    }
    let mut buf = [0u8; 65_536];
    let reply = tokio::time::timeout(Duration::from_millis(800), spy.recv_from(&mut buf)).await;
    assert!(reply.is_err(), "an anonymous Syn was answered");
    let text = get_text(&format!("{}/metrics", r.url)).await;
    assert!(
        metric(
            &text,
            "warmpath_gossip_unauthenticated_datagrams_dropped_total"
        ) >= 5.0,
        "{text}"
    );
}

/// Without a secret (loopback only), 2,000 spoofed gossip sources leave a router under a
/// 1,024-file limit serving HTTP: per-source state is bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_gossip_sources_leave_the_http_port_serving() {
    let e = engine();
    let (r, gossip) = gossiping_router(&e, 1024, &[]);
    let mut syn = 45_139u16.to_le_bytes().to_vec();
    syn.extend_from_slice(&[0u8; 14]);
    for _ in 0..2000 {
        let spoof = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        spoof.send_to(&syn, &gossip).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = client();
    let req = hyper::Request::post(format!("{}/v1/completions", r.url))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            json!({"model": "sim-llama", "prompt": "still here?", "max_tokens": 1}).to_string(),
        )))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), c.request(req))
        .await
        .expect("an answer in time")
        .expect("an answer");
    assert_eq!(resp.status(), 200);
}

/// Issue 12, defect 4: a router cut off from the others saw no peers and admitted a
/// tenant's whole rate while they kept admitting their shares: a partition doubled the
/// limit. Now a router keeps counting the peers it lost for `PEER_MEMORY` (60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_does_not_double_a_tenants_rate() {
    let e = engine();
    let dir = crate::scratch_dir("cluster-rate");
    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        format!(
            "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{}\"]\n\
             [[tenants]]\nid = \"acme\"\napi_keys = [\"sk-acme\"]\npool = \"sim-llama\"\n\
             rate_limit_rps = 20\n",
            e.url
        ),
    )
    .expect("config written");
    let config = config.to_str().expect("utf-8 path");
    let a = replica_with("a", &[], &[], &["--config", config]);
    let b = replica_with("b", &[], &[&a.gossip], &["--config", config]);
    let c = client();
    let peers = |url: String| async move {
        metric(
            &get_text(&format!("{url}/metrics")).await,
            "warmpath_gossip_peers",
        )
    };
    let until = |url: String, want: f64, what: &'static str| {
        let peers = &peers;
        async move {
            let start = Instant::now();
            while peers(url.clone()).await != want {
                assert!(start.elapsed() < Duration::from_secs(30), "{what}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    until(a.proc.url.clone(), 1.0, "a never saw b").await;
    until(b.proc.url.clone(), 1.0, "b never saw a").await;
    assert_eq!(post_simple(&c, &b.proc.url, "/debug/partition").await, 200);
    until(a.proc.url.clone(), 0.0, "a never lost b").await;

    // Two seconds of requests on a: its half of 20/s is 10/s, with a burst of 10.
    let started = Instant::now();
    let (mut admitted, mut limited) = (0, 0);
    while started.elapsed() < Duration::from_secs(2) {
        let req = hyper::Request::post(format!("{}/v1/completions", a.proc.url))
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-acme")
            .body(Full::new(Bytes::from(
                json!({"model": "sim-llama", "prompt": "hi", "max_tokens": 1}).to_string(),
            )))
            .unwrap();
        match c.request(req).await.map(|r| r.status().as_u16()) {
            Ok(200) => admitted += 1,
            Ok(429) => limited += 1,
            other => panic!("{other:?}"),
        }
        // Far above the limit still, without starving the tests running beside this one.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("partitioned router: {admitted} admitted, {limited} limited in 2 s (limit 20/s over 2 routers)");
    assert!(limited > 0, "the limit applied");
    // 10 + 2 × 10 = 30 at its share; the whole rate would admit 20 + 2 × 20 = 60.
    assert!(
        admitted <= 40,
        "{admitted} admitted: the cut-off router took the whole rate"
    );
    drop(b);
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 27, decision 0105: with `--residency-followers 1`, each agent is followed by one
/// router of three (the one rendezvous hashing over the live routers names), so an agent's
/// outbound no longer grows with the routers; when that router dies, the survivors take
/// its agents over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_agent_is_followed_by_its_chosen_routers_only_and_survivors_take_over() {
    let dir = crate::scratch_dir("followers");
    let agents: Vec<String> = (0..6).map(|i| format!("a{i}")).collect();
    let routers = ["r0", "r1", "r2"];
    let mut cert_args: Vec<&str> = vec!["--loopback"];
    for a in &agents {
        cert_args.extend(["--agent", a.as_str()]);
    }
    for r in routers {
        cert_args.extend(["--router", r]);
    }
    let certs = crate::make_certs(&dir, &cert_args);
    let mut agent_procs = Vec::new();
    let mut entries = Vec::new();
    for a in &agents {
        let (p, quic, _) = crate::security_tiers::residency_agent(&certs, a, &[]);
        entries.push(format!("{a}@{quic}"));
        agent_procs.push(p);
    }
    let certs_s = certs.to_str().unwrap();
    let mut started: Vec<Replica> = Vec::new();
    for r in routers {
        let mut extra = vec![
            "--tls-dir",
            certs_s,
            "--tls-name",
            r,
            "--residency-followers",
            "1",
        ];
        for e in &entries {
            extra.extend(["--residency-agent", e.as_str()]);
        }
        let seeds: Vec<&str> = started.iter().map(|x| x.gossip.as_str()).collect();
        started.push(replica_with(r, &[], &seeds, &extra));
    }
    let gauge = |url: String, name: &'static str| async move {
        metric(&get_text(&format!("{url}/metrics")).await, name)
    };
    // What each router should follow, by the same hash, once all three see each other.
    let expect = |live: &[&str]| -> Vec<f64> {
        routers
            .iter()
            .map(|r| {
                entries
                    .iter()
                    .filter(|e| warmpath_residency::follow::follows(r, e, live, 1))
                    .count() as f64
            })
            .collect()
    };
    let urls: Vec<String> = started.iter().map(|x| x.proc.url.clone()).collect();
    let following = |of: Vec<usize>| {
        let urls: Vec<String> = of.iter().map(|&i| urls[i].clone()).collect();
        async move {
            let mut out = Vec::new();
            for u in urls {
                out.push(gauge(u, "warmpath_router_residency_agents").await);
            }
            out
        }
    };
    let want = expect(&routers);
    assert_eq!(want.iter().sum::<f64>(), 6.0);
    let start = Instant::now();
    while following(vec![0, 1, 2]).await != want {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "followed {:?}, want {want:?}",
            following(vec![0, 1, 2]).await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The router that follows the most agents dies: once the others see it gone, they
    // follow every agent between them.
    let dead = (0..3)
        .max_by(|&a, &b| want[a].total_cmp(&want[b]))
        .expect("three routers");
    assert!(want[dead] >= 2.0, "{want:?}");
    started[dead].proc.kill();
    let alive: Vec<usize> = (0..3).filter(|&i| i != dead).collect();
    let live: Vec<&str> = alive.iter().map(|&i| routers[i]).collect();
    let after: Vec<f64> = alive.iter().map(|&i| expect(&live)[i]).collect();
    assert_eq!(after.iter().sum::<f64>(), 6.0);
    let start = Instant::now();
    while following(alive.clone()).await != after {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "after {} died: followed {:?}, want {after:?}",
            routers[dead],
            following(alive.clone()).await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
