//! Router overhead: the same requests sent straight to an engine-sim and through a router
//! in front of it, interleaved in one run, so both see the same machine noise.
//!
//! Run with `cargo bench -p warmpath --bench overhead`. It starts real processes (the
//! `warmpath` binary) on loopback: one engine-sim with a huge speed-up (so the engine's
//! own time is near zero and what remains is HTTP, parsing and tokenizing) and one router.
//! Each request is a non-streaming completion with a 4 KB prompt and one output token.
//!
//! Reported: latency p50/p99 direct and via the router, the added latency (p50 and p99
//! of the per-pair differences), and the router's throughput per core: closed-loop load
//! through the router for a few seconds, divided by the router process's CPU seconds.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
mod common;

use common::{cpu_seconds, percentile, start};
use std::time::{Duration, Instant};

const PAIRS: usize = 3000;
const WARMUP: usize = 200;

async fn send(client: &Client<HttpConnector, Full<Bytes>>, url: &str, body: &Bytes) -> Duration {
    let req = hyper::Request::post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .expect("valid request");
    let t = Instant::now();
    let resp = client.request(req).await.expect("request succeeds");
    assert!(resp.status().is_success(), "status {}", resp.status());
    resp.into_body().collect().await.expect("body");
    t.elapsed()
}

fn main() {
    let engine = start(
        &[
            "engine-sim",
            "--listen",
            "127.0.0.1:0",
            "--speedup",
            "1000000",
        ],
        1,
    );
    let router = start(
        &[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--instance",
            &engine.url,
            "--strategy",
            "prefix-aware",
        ],
        1,
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client: Client<HttpConnector, Full<Bytes>> = Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new());
        // A 4 KB prompt: pseudo-words, shared prefix across requests plus a unique tail.
        let prefix = warmpath_index::text::words(1, 560);
        let make = |i: usize| {
            let prompt = format!("{prefix}{}", warmpath_index::text::words(1000 + i as u64, 40));
            let prompt = &prompt[..prompt.len().min(4096)];
            Bytes::from(serde_json::json!({"model": "sim-llama", "prompt": prompt, "max_tokens": 1}).to_string())
        };
        for i in 0..WARMUP {
            send(&client, &engine.url, &make(i)).await;
            send(&client, &router.url, &make(i)).await;
        }
        let (mut direct, mut via, mut diff) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..PAIRS {
            let body = make(WARMUP + i);
            // Alternate which goes first, so neither always warms the other's path.
            let (d, r) = if i % 2 == 0 {
                let d = send(&client, &engine.url, &body).await;
                (d, send(&client, &router.url, &body).await)
            } else {
                let r = send(&client, &router.url, &body).await;
                (send(&client, &engine.url, &body).await, r)
            };
            direct.push(d.as_secs_f64() * 1e6);
            via.push(r.as_secs_f64() * 1e6);
            diff.push((r.as_secs_f64() - d.as_secs_f64()) * 1e6);
        }
        for v in [&mut direct, &mut via, &mut diff] {
            v.sort_by(f64::total_cmp);
        }
        println!("router overhead, {PAIRS} interleaved pairs after {WARMUP} warm-up pairs, 4 KB prompt, 1 output token, one client connection each");
        println!("  direct to engine-sim: p50 {:7.1} µs  p99 {:7.1} µs", percentile(&direct, 0.5), percentile(&direct, 0.99));
        println!("  through the router:   p50 {:7.1} µs  p99 {:7.1} µs", percentile(&via, 0.5), percentile(&via, 0.99));
        println!(
            "  added by the router:  p50 {:7.1} µs  p99 {:7.1} µs   (targets: p50 < 100 µs, p99 < 500 µs)",
            percentile(&diff, 0.5),
            percentile(&diff, 0.99)
        );

        // Throughput per router core: closed loop, 16 concurrent clients, 5 seconds.
        let pid = router.child.id();
        let cpu0 = cpu_seconds(pid);
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(5);
        let mut tasks = Vec::new();
        for w in 0..16 {
            let client = client.clone();
            let url = router.url.clone();
            let bodies: Vec<Bytes> = (0..64).map(|i| make(10_000 + w * 64 + i)).collect();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    send(&client, &url, &bodies[n as usize % bodies.len()]).await;
                    n += 1;
                }
                n
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.expect("worker");
        }
        let wall = t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds(pid) - cpu0;
        println!(
            "  throughput: {:.0} requests/s through the router over {wall:.1} s with 16 clients; router CPU {cpu:.2} s → {:.0} requests/s per router core",
            total as f64 / wall,
            total as f64 / cpu.max(1e-9)
        );
        println!("  (machine: {} cores, shared by the client, the router and the engine-sim)", std::thread::available_parallelism().map_or(1, |n| n.get()));
    });
}
