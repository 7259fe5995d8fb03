//! Tenant-configuration writes through the admin API of three router processes (Raft
//! voters on loopback, fsync per log append), and leader failover.
//!
//! Run with `cargo bench -p warmpath --bench raft`. Reported: write latency p50/p99 of
//! 200 sequential tenant PUTs to the leader and 200 to a follower (forwarded to the
//! leader), after 10 warm-up writes; then the leader is killed (SIGKILL) and a client
//! keeps writing through a follower: the time from the kill to the first acknowledged
//! write.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
mod common;

use common::{free_addr, percentile, start, Proc};
use std::time::{Duration, Instant};

const TOKEN: &str = "bench-admin-token-0123456789";

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn call(
    c: &HttpClient,
    method: &str,
    url: &str,
    body: Option<&str>,
) -> Result<(u16, serde_json::Value), String> {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or("").to_string())))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .map_err(|_| "timeout".to_string())?
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    ))
}

fn main() {
    let dir = std::env::temp_dir().join(format!("warmpath-raft-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let token = dir.join("token");
    std::fs::write(&token, TOKEN).expect("token file");
    let peer_token = dir.join("peer-token");
    std::fs::write(&peer_token, "bench-raft-peer-token").expect("token file");
    let admin: Vec<u16> = (0..3).map(|_| free_addr().port()).collect();
    let voters: Vec<String> = admin
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{}=http://127.0.0.1:{p}", i + 1))
        .collect();
    let mut routers: Vec<Option<Proc>> = Vec::new();
    for (i, port) in admin.iter().enumerate() {
        let mut args: Vec<String> = vec![
            "router".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            // The seeded pool; no request is routed in this benchmark.
            "--instance".into(),
            "http://127.0.0.1:9".into(),
            "--raft-node-id".into(),
            (i + 1).to_string(),
            "--raft-dir".into(),
            dir.join(format!("r{}", i + 1))
                .to_string_lossy()
                .into_owned(),
            "--admin-listen".into(),
            format!("127.0.0.1:{port}"),
            "--admin-token-file".into(),
            token.to_string_lossy().into_owned(),
            "--raft-peer-token-file".into(),
            peer_token.to_string_lossy().into_owned(),
        ];
        for v in &voters {
            args.extend(["--voter".into(), v.clone()]);
        }
        routers.push(Some(start(&args, 2)));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let c: HttpClient = Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new());
        let base = |i: usize| format!("http://127.0.0.1:{}/admin/v1", admin[i]);
        // Wait for a leader and the seeded configuration.
        let deadline = Instant::now() + Duration::from_secs(20);
        let leader = loop {
            if let Ok((200, v)) = call(&c, "GET", &format!("{}/cluster", base(0)), None).await {
                if let Some(l) = v["raft"]["leader"].as_u64() {
                    if v["version"].as_u64() > Some(0) {
                        break l as usize - 1;
                    }
                }
            }
            assert!(Instant::now() < deadline, "no leader");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let follower = (leader + 1) % 3;
        let body = r#"{"strategy": "prefix-aware", "pool": "sim-llama"}"#;
        let measure = |target: usize, prefix: &'static str| {
            let c = c.clone();
            let url = base(target);
            async move {
                for i in 0..10 {
                    call(&c, "PUT", &format!("{url}/tenants/{prefix}warm{i}"), Some(body)).await.expect("warm-up write");
                }
                let mut lat = Vec::new();
                for i in 0..200 {
                    let t = Instant::now();
                    let (status, _) = call(&c, "PUT", &format!("{url}/tenants/{prefix}{i}"), Some(body)).await.expect("write");
                    assert!(status == 200 || status == 201, "status {status}");
                    lat.push(t.elapsed().as_secs_f64() * 1e3);
                }
                lat.sort_by(f64::total_cmp);
                lat
            }
        };
        let on_leader = measure(leader, "l").await;
        let on_follower = measure(follower, "f").await;
        println!("tenant-config writes, 3 voters on loopback, fsync per append, 200 sequential PUTs each after 10 warm-up writes:");
        println!("  to the leader:   p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms   (target p99 < 20 ms)", percentile(&on_leader, 0.5), percentile(&on_leader, 0.99), on_leader[on_leader.len() - 1]);
        println!("  to a follower:   p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms   (forwarded to the leader)", percentile(&on_follower, 0.5), percentile(&on_follower, 0.99), on_follower[on_follower.len() - 1]);
        // Failover: kill the leader, keep writing through the follower.
        let killed = Instant::now();
        routers[leader] = None;
        let mut attempts = 0;
        loop {
            attempts += 1;
            if let Ok((200 | 201, _)) = call(&c, "PUT", &format!("{}/tenants/after{attempts}", base(follower)), Some(body)).await {
                break;
            }
            assert!(killed.elapsed() < Duration::from_secs(30), "no write succeeded after the leader died");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "  leader killed (SIGKILL) → first acknowledged write through a follower: {:.0} ms ({attempts} attempt(s); target: new leader under 3 s)",
            killed.elapsed().as_secs_f64() * 1e3
        );
    });
    drop(routers);
    let _ = std::fs::remove_dir_all(&dir);
}
