//! Router overhead: the same requests sent straight to an engine-sim and through each router
//! in front of it, interleaved in one run, so all see the same machine noise.
//!
//! Run with `cargo bench -p warmpath --bench overhead`. It starts real processes on
//! loopback: one engine-sim with a huge speed-up (so the engine's own time is near zero and
//! what remains is HTTP, parsing and tokenizing) and a warmpath router; and, when a Python
//! with the `smg` package is found (`WARMPATH_BENCH_PEER_PYTHON`, else the venv that
//! `bench/peers.py --install` makes at `target/peer-venv`), SMG's router as well
//! (`python -m smg launch --policy cache_aware --disable-tokenizer-autoload`). Each request
//! is a non-streaming completion with a 4 KB prompt and one output token.
//!
//! Reported per router: latency p50/p99 direct and through it, the added latency (p50 and
//! p99 of the per-request differences), saturated throughput (closed loop, 16 clients, 5 s)
//! with the router's CPU seconds, and its resident memory afterwards.

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
mod common;

use common::{cpu_seconds, percentile, send_completion, start};
use std::time::{Duration, Instant};

const PAIRS: usize = 3000;
const WARMUP: usize = 200;

/// A router under test: its name, URL and process id.
struct Under {
    name: &'static str,
    url: String,
    pid: u32,
}

/// SMG in front of `engine`, if a Python with the `smg` package is around.
fn start_smg(engine: &str) -> Option<std::process::Child> {
    let python = std::env::var("WARMPATH_BENCH_PEER_PYTHON").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/peer-venv/bin/python"
        )
        .to_string()
    });
    let has_smg = std::process::Command::new(&python)
        .args(["-c", "import smg"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_smg {
        println!("(SMG not measured: no Python with the smg package at {python}; run bench/peers.py --install)");
        return None;
    }
    let port = common::free_addr().port();
    let child = std::process::Command::new(&python)
        .args([
            "-m",
            "smg",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args([
            "--worker-urls",
            engine,
            "--policy",
            "cache_aware",
            "--disable-tokenizer-autoload",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    SMG_PORT.store(port, std::sync::atomic::Ordering::Relaxed);
    Some(child)
}

static SMG_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);

/// Resident memory of `pid` and its children, MiB (Linux).
fn rss_mib(pid: u32) -> f64 {
    let read = |pid: &str| -> f64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    (read(&pid.to_string()) + children.split_whitespace().map(read).sum::<f64>()) / 1024.0
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
    let mut smg = start_smg(&engine.url);
    let mut under = vec![Under {
        name: "warmpath prefix-aware",
        url: router.url.clone(),
        pid: router.child.id(),
    }];
    if let Some(child) = &smg {
        under.push(Under {
            name: "SMG cache_aware",
            url: format!(
                "http://127.0.0.1:{}",
                SMG_PORT.load(std::sync::atomic::Ordering::Relaxed)
            ),
            pid: child.id(),
        });
    }
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
        // Wait for every router to serve (SMG checks its workers first).
        for u in &under {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let req = hyper::Request::post(format!("{}/v1/completions", u.url))
                    .header("content-type", "application/json")
                    .body(Full::new(make(0)))
                    .expect("valid request");
                if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(2), client.request(req)).await {
                    if r.status().is_success() {
                        break;
                    }
                }
                assert!(Instant::now() < deadline, "{} did not come up", u.name);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        for i in 0..WARMUP {
            send_completion(&client, &engine.url, &make(i)).await;
            for u in &under {
                send_completion(&client, &u.url, &make(i)).await;
            }
        }
        let mut direct = Vec::new();
        let mut via: Vec<Vec<f64>> = vec![Vec::new(); under.len()];
        let mut diff: Vec<Vec<f64>> = vec![Vec::new(); under.len()];
        for i in 0..PAIRS {
            let body = make(WARMUP + i);
            // Rotate which goes first, so none always warms another's path.
            let n = under.len() + 1;
            let mut times = vec![Duration::ZERO; n];
            for k in 0..n {
                let who = (i + k) % n;
                let url = if who == 0 { &engine.url } else { &under[who - 1].url };
                times[who] = send_completion(&client, url, &body).await;
            }
            let d = times[0].as_secs_f64() * 1e6;
            direct.push(d);
            for (j, t) in times[1..].iter().enumerate() {
                via[j].push(t.as_secs_f64() * 1e6);
                diff[j].push(t.as_secs_f64() * 1e6 - d);
            }
        }
        direct.sort_by(f64::total_cmp);
        println!("router overhead, {PAIRS} interleaved rounds after {WARMUP} warm-up rounds, 4 KB prompt, 1 output token, one client connection each");
        println!("  direct to engine-sim:        p50 {:7.1} µs  p99 {:7.1} µs", percentile(&direct, 0.5), percentile(&direct, 0.99));
        for (j, u) in under.iter().enumerate() {
            via[j].sort_by(f64::total_cmp);
            diff[j].sort_by(f64::total_cmp);
            println!("  through {:<21} p50 {:7.1} µs  p99 {:7.1} µs", u.name, percentile(&via[j], 0.5), percentile(&via[j], 0.99));
            println!(
                "    added by it:               p50 {:7.1} µs  p99 {:7.1} µs",
                percentile(&diff[j], 0.5),
                percentile(&diff[j], 0.99)
            );
        }
        println!("  (targets for warmpath: added p50 < 100 µs, p99 < 500 µs)");

        // Saturated throughput: closed loop, 16 concurrent clients, 5 seconds per router.
        let mut rates = Vec::new();
        for u in &under {
            let cpu0 = cpu_seconds(u.pid);
            let t0 = Instant::now();
            let deadline = t0 + Duration::from_secs(5);
            let mut tasks = Vec::new();
            for w in 0..16 {
                let client = client.clone();
                let url = u.url.clone();
                let bodies: Vec<Bytes> = (0..64).map(|i| make(10_000 + w * 64 + i)).collect();
                tasks.push(tokio::spawn(async move {
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        send_completion(&client, &url, &bodies[n as usize % bodies.len()]).await;
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
            let cpu = cpu_seconds(u.pid) - cpu0;
            let rate = total as f64 / wall;
            rates.push(rate);
            println!(
                "  saturated {:<21} {:>7.0} requests/s over {wall:.1} s with 16 clients; its CPU {cpu:.2} s ({:.0} requests/s per core); RSS {:.0} MiB",
                u.name,
                rate,
                total as f64 / cpu.max(1e-9),
                rss_mib(u.pid)
            );
        }
        if rates.len() > 1 {
            println!("  warmpath / SMG saturated throughput: {:.2}x (target: at least 1.5x)", rates[0] / rates[1]);
        }
        println!("  (machine: {} cores, shared by the client, the routers and the engine-sim)", std::thread::available_parallelism().map_or(1, |n| n.get()));
    });
    if let Some(child) = &mut smg {
        let _ = child.kill();
        let _ = child.wait();
    }
}
