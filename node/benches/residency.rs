//! Residency from an engine's KV events to a router, over real processes and sockets:
//! this benchmark publishes vLLM-format KV events on ZMQ at a fixed rate (as an engine
//! would), a real `warmpath agent` subscribes, derives warmpath keys and serves residency
//! over QUIC with mutual TLS, and an in-process router-side follower (the router's own
//! code, `residency_net::follow`) receives it. Reported: the delay from publishing a
//! block's event to the follower applying it (p50, p99), the agent's residency bytes per
//! second, and, after the agent is killed and restarted (a new epoch), the time until the
//! follower holds the new agent's snapshot.
//!
//! Run with `cargo bench -p warmpath --bench residency` (about 25 s).

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{percentile, start};
use warmpath_cache_agent::kv_events::{encode_batch, message, EngineHash, KvEvent, Shape};
use warmpath_index::keys::TenantKey;
use warmpath_residency::net::{endpoint, follow, AgentTarget};
use warmpath_residency::tls::TlsFiles;
use warmpath_residency::Outcome;
use zeromq::{Socket, SocketSend, ZmqMessage};

const RATE: u64 = 10_000; // block events per second
const PER_BATCH: u64 = 10; // one batch per millisecond
const SECONDS: u64 = 10;
const WARMUP: u64 = 1;
const BLOCK: u32 = 16;
/// Blocks kept stored; older ones are removed, so the agent's set stays bounded.
const WINDOW: u64 = 20_000;

fn tokens(n: u64) -> Vec<u32> {
    (0..BLOCK)
        .map(|i| (n as u32).wrapping_mul(BLOCK) + i)
        .collect()
}

fn key_of(n: u64) -> u64 {
    let mut bytes = Vec::new();
    for t in tokens(n) {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    TenantKey::derive("engine-sim", "").chain(None, &bytes).0
}

fn stored(n: u64) -> KvEvent {
    KvEvent::Stored {
        block_hashes: vec![EngineHash(n.to_be_bytes().to_vec())],
        parent: None,
        token_ids: tokens(n),
        block_size: BLOCK,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: vec![],
    }
}

fn agent_bytes(metrics_url: &str) -> f64 {
    let out = std::process::Command::new("curl")
        .args(["-s", metrics_url])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    out.lines()
        .filter(|l| l.starts_with("warmpath_residency_bytes_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let certs = dir.path().join("certs");
    let status = std::process::Command::new(warmpath_testkit::warmpath_bin())
        .args([
            "certs",
            "--out",
            certs.to_str().expect("utf-8"),
            "--agent",
            "agent",
            "--router",
            "router",
        ])
        .output()
        .expect("warmpath certs");
    assert!(status.status.success());
    let kv_port = common::free_addr().port();
    let kv = format!("tcp://127.0.0.1:{kv_port}");
    let quic = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("udp port");
    let agent_args = |quic: std::net::SocketAddr| {
        vec![
            "agent".to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--kv-events".into(),
            format!("http://engine={kv}"),
            "--residency-listen".into(),
            quic.to_string(),
            "--tls-dir".into(),
            certs.to_str().expect("utf-8").into(),
            "--tls-name".into(),
            "agent".into(),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
        ]
    };
    rt.block_on(async {
        let mut publisher = zeromq::PubSocket::new();
        publisher.bind(&kv).await.expect("bind the publisher");
        let agent = start(&agent_args(quic), 3);
        let metrics_url = agent.lines[2]
            .split("metrics on ")
            .nth(1)
            .expect("metrics line")
            .trim()
            .to_string();
        let tls = TlsFiles::in_dir(&certs, "router");
        let ep = endpoint("127.0.0.1:0".parse().expect("addr"), None, Some(tls.client_config().expect("tls"))).expect("endpoint");
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Outcome>(65_536);
        let target = AgentTarget::parse(&format!("agent@{quic}")).expect("target");
        let (_stop, stopped) = tokio::sync::oneshot::channel();
        let (_tenants, tenants) = tokio::sync::watch::channel(std::sync::Arc::new(Default::default()));
        tokio::spawn(follow(ep, target, Duration::from_secs(5), tx, stopped, tenants, Default::default()));

        // Publish at RATE; remember when each block's event left.
        let sent: std::sync::Arc<std::sync::Mutex<HashMap<u64, Instant>>> = Default::default();
        let sent_pub = sent.clone();
        let publishing = tokio::spawn(async move {
            let mut seq = 0u64;
            let mut n = 0u64;
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(SECONDS + WARMUP) {
                tick.tick().await;
                let mut events: Vec<KvEvent> = (n..n + PER_BATCH).map(stored).collect();
                if n >= WINDOW {
                    events.push(KvEvent::Removed {
                        block_hashes: (n - WINDOW..n - WINDOW + PER_BATCH)
                            .map(|k| EngineHash(k.to_be_bytes().to_vec()))
                            .collect(),
                        medium: Some("GPU".into()),
                    });
                }
                let now = Instant::now();
                {
                    let mut s = sent_pub.lock().expect("lock");
                    for k in n..n + PER_BATCH {
                        s.insert(key_of(k), now);
                    }
                }
                let payload = encode_batch(0.0, &events, Shape::Array);
                let msg = ZmqMessage::try_from(message(seq, Bytes::from(payload))).expect("frames");
                let _ = publisher.send(msg).await;
                seq += 1;
                n += PER_BATCH;
            }
            (publisher, n)
        });
        let t0 = Instant::now();
        let bytes0 = agent_bytes(&metrics_url);
        let mut lat = Vec::new();
        let mut bytes_at_warm = None;
        while t0.elapsed() < Duration::from_secs(SECONDS + WARMUP + 1) {
            let Ok(Some(o)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await else {
                continue;
            };
            if let Outcome::Apply { changes, .. } = o {
                let now = Instant::now();
                let s = sent.lock().expect("lock");
                for c in changes.iter().filter(|c| c.present) {
                    if let Some(at) = s.get(&c.key) {
                        if t0.elapsed() > Duration::from_secs(WARMUP) {
                            lat.push(now.duration_since(*at).as_secs_f64() * 1e3);
                        }
                    }
                }
            }
            if bytes_at_warm.is_none() && t0.elapsed() > Duration::from_secs(WARMUP) {
                bytes_at_warm = Some((Instant::now(), agent_bytes(&metrics_url)));
            }
        }
        let (mut publisher, published) = publishing.await.expect("publisher");
        let (warm_at, warm_bytes) = bytes_at_warm.unwrap_or((t0, bytes0));
        let bytes_per_s = (agent_bytes(&metrics_url) - warm_bytes) / warm_at.elapsed().as_secs_f64();
        lat.sort_by(f64::total_cmp);
        println!(
            "residency benchmark: {} cores; {RATE} block events/s from a ZMQ publisher for {SECONDS} s (after {WARMUP} s warm-up), real agent process, QUIC + mutual TLS on loopback",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!(
            "delta latency, event published to change applied by the follower: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} of {} blocks measured)",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            lat.last().copied().unwrap_or(f64::NAN),
            lat.len(),
            published
        );
        println!("agent residency bytes: {:.0} KB/s to one router", bytes_per_s / 1e3);

        // Restart: a new epoch; time until the follower applies the new agent's snapshot.
        drop(agent);
        let restarted = Instant::now();
        let _agent = start(&agent_args(quic), 3);
        // Give the new agent something to hold so its snapshot is not empty.
        let _ = publisher
            .send(
                ZmqMessage::try_from(message(
                    0,
                    Bytes::from(encode_batch(0.0, &[stored(u64::MAX / 2)], Shape::Array)),
                ))
                .expect("frames"),
            )
            .await;
        let want = key_of(u64::MAX / 2);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut resynced = None;
        while Instant::now() < deadline {
            let mut retry = false;
            match tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
                Ok(Some(Outcome::Apply { changes, .. })) if changes.iter().any(|c| c.present && c.key == want) => {
                    resynced = Some(restarted.elapsed());
                    break;
                }
                Ok(Some(_)) => {}
                _ => retry = true,
            }
            if retry {
                // The subscription may not have been up for the first event: publish again.
                let _ = publisher
                    .send(
                        ZmqMessage::try_from(message(
                            1,
                            Bytes::from(encode_batch(0.0, &[stored(u64::MAX / 2)], Shape::Array)),
                        ))
                        .expect("frames"),
                    )
                    .await;
            }
        }
        match resynced {
            Some(d) => println!(
                "agent restart (new epoch) to the follower holding its new state: {:.0} ms (process start, subscription, QUIC reconnect with back-off, snapshot)",
                d.as_secs_f64() * 1e3
            ),
            None => println!("agent restart: the follower did not resync within 20 s"),
        }
    });
}
