//! The cache-agent's tiers against the plain tools that bound them, side by side in one run:
//!
//! - L1 put and get through the block API (a real `warmpath agent` process, the crate's
//!   client, 4 requests in flight) for 1 MiB and 16 MiB blocks: as sealed memfds on the
//!   Unix socket (`memfd`, the client's default there, record 0120), through the Unix
//!   socket (`unix`) and through loopback TCP (`tcp`), on a full L1 (steady state: every put evicts), against a plain memcpy
//!   of the same sizes in this process, both into one hot block and into 256 MiB of
//!   distinct blocks.
//! - lookup-and-lease of a 64-key chain held in L1: p50 and p99, one call at a time.
//! - L2 Redis: the agent's Redis backend putting and getting 1 MiB objects, against
//!   `redis-benchmark` SET and GET of 1 MiB values on the same server (one connection,
//!   no pipelining, as the backend's one call at a time), its SET both of one key (its
//!   default) and of as many keys as the backend writes (`-r`); both after an unmeasured
//!   round, so that every measured SET replaces a value (steady state).
//! - L2 directory: the agent's directory backend writing and reading 16 MiB objects,
//!   against `dd` writing and reading the same sizes on the same filesystem (page cache,
//!   no sync, as the backend).
//!
//! Run with `cargo bench -p warmpath --bench agent`; `-- l1`, `-- lookup`, `-- redis` or
//! `-- dir` runs only those sections (to profile one). It needs `redis-server` and
//! `redis-benchmark` (Debian's redis-server and redis-tools); without them the Redis rows
//! are skipped, said so. Each figure is the median of 5 rounds.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{free_addr, percentile, start};
use warmpath_cache_agent::block::{encode_object, Block};
use warmpath_cache_agent::client::{AgentAddr, AgentClient};
use warmpath_cache_agent::l2::{DirL2, L2Backend, RedisL2};
use warmpath_tiers::BlockId;

const ROUNDS: usize = 5;
/// The agent's L1: smaller than what a size's rounds put, so that the measured rounds run
/// on a full L1 (every put evicts), as a cache does in steady state.
const L1_BYTES: &str = "512MiB";
const MIB: usize = 1 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// memcpy of `total` bytes in `size` pieces, GB/s: into one preallocated block (`hot`: a
/// 1 MiB block stays in cache, the best case) and into `total` bytes of distinct,
/// preallocated blocks (`spread`: what a store writes, memory-bound).
fn memcpy(size: usize, total: usize) -> (f64, f64) {
    let src = vec![7u8; size];
    let mut dst = vec![0u8; size];
    let t = Instant::now();
    for _ in 0..total / size {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    let hot = gbps(total, t.elapsed());
    let mut spread: Vec<Vec<u8>> = (0..total / size).map(|_| vec![1u8; size]).collect();
    let t = Instant::now();
    for d in &mut spread {
        d.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(d);
    }
    (hot, gbps(total, t.elapsed()))
}

/// Puts then gets `total` bytes of `size`-byte blocks through the agent, 4 in flight.
async fn l1_round(c: &Arc<AgentClient>, size: usize, total: usize, round: usize) -> (f64, f64) {
    let n = total / size;
    let payload = Bytes::from(vec![round as u8; size]);
    let base = (round as u64) << 32 | (size as u64) << 8;
    let run = |get: bool| {
        let c = c.clone();
        let payload = payload.clone();
        async move {
            let t = Instant::now();
            let mut set = tokio::task::JoinSet::new();
            for i in 0..n {
                let (c, payload) = (c.clone(), payload.clone());
                set.spawn(async move {
                    let key = base + i as u64;
                    if get {
                        let got = c.get(1, vec![key]).await.expect("get");
                        assert!(got[0].is_some(), "block {key} in L1");
                    } else {
                        c.put(1, vec![(key, payload, false)]).await.expect("put");
                    }
                });
                while set.len() >= 4 {
                    set.join_next().await;
                }
            }
            while set.join_next().await.is_some() {}
            gbps(total, t.elapsed())
        }
    };
    let put = run(false).await;
    let get = run(true).await;
    (put, get)
}

/// `redis-benchmark` SET and GET (GB/s). By default it writes one key over and over (one
/// value, hot in cache); with `keys`, SET only, of random keys among `keys` (`-r`), as the
/// agent's backend round writes `keys` blocks.
fn redis_benchmark(port: u16, n: usize, size: usize, keys: Option<usize>) -> Option<(f64, f64)> {
    let distinct = keys.is_some();
    let mut cmd = Command::new("redis-benchmark");
    cmd.args(["-p", &port.to_string(), "-n", &n.to_string()])
        .args(["-d", &size.to_string(), "-c", "1", "-P", "1", "--csv"]);
    if let Some(keys) = keys {
        cmd.args(["-t", "set", "-r", &keys.to_string()]);
    } else {
        cmd.args(["-t", "set,get"]);
    }
    let out = cmd.output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = |name: &str| -> Option<f64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("\"{name}\"")))?;
        line.split(',').nth(1)?.trim_matches('"').parse().ok()
    };
    Some((
        rps("SET")? * size as f64 / 1e9,
        if distinct {
            f64::NAN
        } else {
            rps("GET")? * size as f64 / 1e9
        },
    ))
}

/// Puts then gets `n` blocks of `size` bytes through a backend, one call at a time: blocks
/// `0..n` of layout `layout` (a layout already written: every put replaces a value).
async fn backend_round<B: L2Backend>(
    b: &B,
    size: usize,
    n: usize,
    round: usize,
    layout: u64,
) -> (f64, f64) {
    let block = Block::new(Bytes::from(vec![round as u8; size]));
    let ids: Vec<BlockId> = (0..n).map(|i| BlockId::new(layout, i as u64)).collect();
    let object_len = encode_object(&ids[0], &block).len();
    // As the agent's L2 writer does: the block, encoded by the backend.
    let t = Instant::now();
    for id in &ids {
        b.put_block(*id, &block).await.expect("l2 put");
    }
    let put = gbps(n * size, t.elapsed());
    let t = Instant::now();
    for id in &ids {
        let got = b.get(*id).await.expect("l2 get").expect("stored");
        assert_eq!(got.len(), object_len);
    }
    let get = gbps(n * size, t.elapsed());
    (put, get)
}

fn dd(dir: &std::path::Path, size: usize, n: usize) -> (f64, f64) {
    let file = dir.join("dd.bin");
    let bs = format!("bs={size}");
    let count = format!("count={n}");
    let t = Instant::now();
    let w = Command::new("dd")
        .args([
            "if=/dev/zero",
            &format!("of={}", file.display()),
            &bs,
            &count,
        ])
        .output()
        .expect("dd runs");
    assert!(w.status.success());
    let write = gbps(n * size, t.elapsed());
    let t = Instant::now();
    let r = Command::new("dd")
        .args([&format!("if={}", file.display()), "of=/dev/null", &bs])
        .output()
        .expect("dd runs");
    assert!(r.status.success());
    let read = gbps(n * size, t.elapsed());
    let _ = std::fs::remove_file(file);
    (write, read)
}

fn main() {
    // `cargo bench` passes `--bench`; any other argument names the sections to run.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let run = |section: &str| only.is_empty() || only.iter().any(|o| o == section);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("a temp dir");
    let sock = dir.path().join("agent.sock");
    let _agent = start(
        &[
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--unix",
            sock.to_str().expect("utf-8 path"),
            "--l1-bytes",
            L1_BYTES,
            "--max-block-bytes",
            "32MiB",
        ],
        2,
    );
    println!(
        "cache-agent benchmark: {} cores, median of {ROUNDS} rounds; agent = release `warmpath agent`",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let tcp = AgentAddr::Tcp(_agent.url.clone());
    rt.block_on(async {
        let c = Arc::new(
            AgentClient::connect(&AgentAddr::Unix(sock.clone()), "", Duration::from_secs(30))
                .await
                .expect("connect"),
        );
        let unix_copy = Arc::new(
            AgentClient::connect(&AgentAddr::Unix(sock.clone()), "", Duration::from_secs(30))
                .await
                .expect("connect")
                .without_sealed(),
        );
        assert!(c.is_sealed(), "the Unix client passes sealed memfds");
        let over_tcp = Arc::new(
            AgentClient::connect(&tcp, "", Duration::from_secs(30))
                .await
                .expect("connect over tcp"),
        );
        if run("l1") {
        println!(
            "\nL1 through the block API vs memcpy (GB/s); L1 {L1_BYTES}, 256 MiB per round, 4 in flight, \
             after one unmeasured round that fills L1 (steady state: puts evict)"
        );
        println!(
            "{:>8} {:>5} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
            "block", "via", "cpy hot", "cpy 256M", "put", "put/hot", "put/256M", "get", "get/hot", "get/256M"
        );
        for (via, c) in [("memfd", &c), ("unix", &unix_copy), ("tcp", &over_tcp)] {
        for size in [MIB, 16 * MIB] {
            let total = 256 * MIB;
            let (mut h, mut m, mut p, mut g) = (vec![], vec![], vec![], vec![]);
            l1_round(c, size, total, ROUNDS + 1).await;
            for round in 0..ROUNDS {
                let (hot, spread) = memcpy(size, total);
                h.push(hot);
                m.push(spread);
                let (put, get) = l1_round(c, size, total, round).await;
                p.push(put);
                g.push(get);
            }
            let (h, m, p, g) = (median(h), median(m), median(p), median(g));
            println!(
                "{:>6}Mi {via:>5} {h:>9.2} {m:>9.2} {p:>8.2} {:>8.3} {:>8.3} {g:>8.2} {:>8.3} {:>8.3}",
                size / MIB,
                p / h,
                p / m,
                g / h,
                g / m
            );
        }
        }
        }

        if run("lookup") {
        // lookup-and-lease of a 64-key chain, all in L1.
        let keys: Vec<u64> = (0..64).map(|k| 1u64 << 40 | k).collect();
        let blocks = keys
            .iter()
            .map(|&k| (k, Bytes::from(vec![1u8; 4096]), false))
            .collect();
        c.put(2, blocks).await.expect("put the chain");
        let mut lat = Vec::new();
        for _ in 0..ROUNDS * 2000 {
            let t = Instant::now();
            let (lease, tiers) = c
                .lookup(2, keys.clone(), Duration::from_secs(5))
                .await
                .expect("lookup");
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(tiers.len(), 64);
            c.release(lease).await.expect("release");
        }
        lat.sort_by(f64::total_cmp);
        println!(
            "\nlookup-and-lease, 64-key chain in L1, Unix socket, {} calls: p50 {:.1} µs, p99 {:.1} µs",
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99)
        );
        }

        if run("redis") {
        // L2 Redis.
        let port = free_addr().port();
        let redis = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"])
            .stdout(std::process::Stdio::null())
            .spawn();
        match redis {
            Err(e) => println!("\nL2 Redis: skipped, redis-server does not start ({e})"),
            Ok(mut redis) => {
                let deadline = Instant::now() + Duration::from_secs(10);
                while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                    assert!(Instant::now() < deadline, "redis-server did not start");
                    std::thread::sleep(Duration::from_millis(20));
                }
                let backend = RedisL2::new(
                    &format!("redis://127.0.0.1:{port}"),
                    "bench:",
                    Duration::from_secs(5),
                )
                .expect("redis backend");
                let (mut bp, mut bg, mut rp, mut rg, mut rd) =
                    (vec![], vec![], vec![], vec![], vec![]);
                let n = 200;
                // Unmeasured, once: the keys both write are created, so that every measured
                // SET replaces a value (Redis frees the old one and takes its memory for the
                // new, as a full Redis that evicts does: steady state, as the L1 rows).
                backend_round(&backend, MIB, n, ROUNDS, 0).await;
                redis_benchmark(port, 4 * n, MIB, Some(n));
                for round in 0..ROUNDS {
                    let (p, g) = backend_round(&backend, MIB, n, round, 0).await;
                    bp.push(p);
                    bg.push(g);
                    if let Some((p, g)) = redis_benchmark(port, n, MIB, None) {
                        rp.push(p);
                        rg.push(g);
                    }
                    if let Some((p, _)) = redis_benchmark(port, n, MIB, Some(n)) {
                        rd.push(p);
                    }
                }
                println!("\nL2 Redis, 1 MiB objects, one connection, one call at a time (GB/s)");
                if rp.is_empty() {
                    println!("  redis-benchmark missing: agent put {:.2}, get {:.2}", median(bp), median(bg));
                } else {
                    let (bp, bg, rp, rg) = (median(bp), median(bg), median(rp), median(rg));
                    let rd = if rd.is_empty() { f64::NAN } else { median(rd) };
                    println!("  {:>28} {:>10} {:>10}", "", "put/SET", "get/GET");
                    println!("  {:>28} {bp:>10.2} {bg:>10.2}", format!("agent backend ({n} keys)"));
                    println!("  {:>28} {rp:>10.2} {rg:>10.2}", "redis-benchmark (one key)");
                    println!("  {:>28} {rd:>10.2} {:>10}", format!("redis-benchmark ({n} keys)"), "-");
                    println!("  {:>28} {:>10.3} {:>10.3}", "ratio to one key", bp / rp, bg / rg);
                    println!("  {:>28} {:>10.3} {:>10}", format!("ratio to {n} keys"), bp / rd, "-");
                }
                let _ = redis.kill();
                let _ = redis.wait();
            }
        }
        }

        if run("dir") {
        // L2 directory on this machine's temp filesystem.
        let l2dir = dir.path().join("l2");
        let backend = DirL2::open(&l2dir, 8 << 30).expect("dir backend");
        let (mut bp, mut bg, mut dw, mut dr) = (vec![], vec![], vec![], vec![]);
        let n = 16;
        for round in 0..ROUNDS {
            let (p, g) = backend_round(&backend, 16 * MIB, n, round, round as u64).await;
            bp.push(p);
            bg.push(g);
            let (w, r) = dd(dir.path(), 16 * MIB, n);
            dw.push(w);
            dr.push(r);
        }
        let (bp, bg, dw, dr) = (median(bp), median(bg), median(dw), median(dr));
        println!(
            "\nL2 directory ({}), 16 MiB objects, page cache (GB/s)",
            l2dir.display()
        );
        println!("  {:>16} {:>10} {:>10}", "", "write", "read");
        println!("  {:>16} {bp:>10.2} {bg:>10.2}", "agent backend");
        println!("  {:>16} {dw:>10.2} {dr:>10.2}", "dd");
        println!("  {:>16} {:>10.3} {:>10.3}", "ratio", bp / dw, bg / dr);
        }
    });
}
