//! The HyperPod daemon API's data path against memcpy, side by side in one run:
//!
//! - PUT: objects of 1 MiB and 16 MiB (a 28-byte RemoteMetadata header, then the payload)
//!   sent to a real `warmpath agent --hyperpod-listen` over loopback HTTP/1.1 with
//!   Content-Length, 4 in flight (LMCache's connector sends puts concurrently), 256 MiB per
//!   round into a 512 MiB segment: after one unmeasured round every put evicts, as a cache
//!   does in steady state. The agent writes each body into the segment with pwrite.
//! - lease + read + release: what LMCache's `get` does for each object: `POST …/leases`,
//!   copy the object out of the segment at the lease's offset into a buffer of this
//!   process, `POST /v1/leases/{id}/release`; one at a time. LMCache copies from its mapping
//!   of the segment; this benchmark reads the segment's file with pread (one kernel copy,
//!   a memcpy's work) because the workspace forbids the `unsafe` a mapping needs.
//! - the copy alone (pread of the segment at a leased offset, no HTTP) and memcpy of the
//!   same sizes: into one hot buffer, and into 256 MiB of distinct buffers.
//! - the copy as LMCache makes it: the same objects (leased) read through Python's
//!   `SharedMemory` mapping with a memoryview copy, as the connector's
//!   `_copy_bytes_from_offsets` does (needs `python3`; skipped, said so, without it).
//!
//! Run with `cargo bench -p warmpath --bench hyperpod`. Each figure is the median of 5
//! rounds; it prints the machine's core count and what it ran.

mod common;

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{percentile, start, HttpClient};
use http_body_util::{BodyExt, Full};

const ROUNDS: usize = 5;
const MIB: usize = 1 << 20;
const TOTAL: usize = 256 * MIB;
const SEGMENT: &str = "512MiB";
const IN_FLIGHT: usize = 4;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// memcpy of TOTAL bytes in `size` pieces, GB/s: into one hot buffer, and spread over
/// TOTAL bytes of distinct preallocated buffers.
fn memcpy(size: usize) -> (f64, f64) {
    let src = vec![7u8; size];
    let mut dst = vec![0u8; size];
    let t = Instant::now();
    for _ in 0..TOTAL / size {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    let hot = gbps(TOTAL, t.elapsed());
    let mut spread: Vec<Vec<u8>> = (0..TOTAL / size).map(|_| vec![1u8; size]).collect();
    let t = Instant::now();
    for d in &mut spread {
        d.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(d);
    }
    (hot, gbps(TOTAL, t.elapsed()))
}

fn object(size: usize, fill: u8) -> Bytes {
    let mut v = Vec::with_capacity(28 + size);
    for x in [size as i32, 1, 3, 1, 1, size as i32, 0] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.resize(28 + size, fill);
    Bytes::from(v)
}

async fn send(c: &HttpClient, method: &str, url: String, body: Bytes) -> (u16, Bytes) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-length", body.len())
        .body(Full::new(body))
        .expect("a request");
    let resp = c.request(req).await.expect("the agent answers");
    let status = resp.status().as_u16();
    (
        status,
        resp.into_body().collect().await.expect("a body").to_bytes(),
    )
}

/// Puts TOTAL bytes of `size`-byte objects named `round-i`, IN_FLIGHT at once: GB/s.
async fn put_round(c: &HttpClient, base: &str, size: usize, round: usize) -> f64 {
    let body = object(size, round as u8);
    let t = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..TOTAL / size {
        let (c, body) = (c.clone(), body.clone());
        let url = format!("{base}/v1/kv/bench/s{size}-r{round}-{i}");
        set.spawn(async move {
            let (status, b) = send(&c, "PUT", url, body).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        });
        while set.len() >= IN_FLIGHT {
            set.join_next().await;
        }
    }
    while set.join_next().await.is_some() {}
    gbps(TOTAL, t.elapsed())
}

/// Leases, copies out and releases every object of a round, one at a time (what one of
/// LMCache's gets does), into a buffer reused and already touched (as memcpy's are): GB/s,
/// the lease round trips' latencies (µs), and the copies' GB/s alone.
async fn read_round(
    c: &HttpClient,
    base: &str,
    seg: &std::fs::File,
    buf: &mut [u8],
    size: usize,
    round: usize,
) -> (f64, Vec<f64>, f64) {
    let t = Instant::now();
    let mut lat = Vec::new();
    let mut copy_s = 0.0;
    for i in 0..TOTAL / size {
        let url =
            format!("{base}/v1/kv/bench/s{size}-r{round}-{i}/leases?timeout_ms=5000&ttl_s=10");
        let t = Instant::now();
        let (status, body) = send(c, "POST", url, Bytes::new()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        let grant: serde_json::Value = serde_json::from_slice(&body).expect("json");
        let o = &grant["offsets"][0];
        let (at, len) = (
            o["offset"].as_u64().unwrap(),
            o["len"].as_u64().unwrap() as usize,
        );
        let t = Instant::now();
        seg.read_exact_at(&mut buf[..len], at).expect("pread");
        copy_s += t.elapsed().as_secs_f64();
        assert_eq!(buf[28], round as u8);
        let id = grant["id"].as_str().unwrap();
        let (status, _) = send(
            c,
            "POST",
            format!("{base}/v1/leases/{id}/release"),
            Bytes::new(),
        )
        .await;
        assert_eq!(status, 200);
    }
    (gbps(TOTAL, t.elapsed()), lat, TOTAL as f64 / copy_s / 1e9)
}

/// Copies the objects at `offsets` out of the segment as LMCache's connector does: Python's
/// `multiprocessing.shared_memory.SharedMemory(name)` mapping, a memoryview slice assigned
/// into a buffer (memcpy), the buffer reused and touched. Two passes: the first also faults
/// the mapping's pages in (a client's first read of a place), the second finds them mapped.
/// GB/s of each, or None without python3.
fn mapped_read(name: &str, offsets: &[(u64, usize)]) -> Option<(f64, f64)> {
    let script = r#"
import sys, time
from multiprocessing import shared_memory, resource_tracker
name = sys.argv[1]
offs = [tuple(map(int, l.split())) for l in sys.stdin.read().split("\n") if l.strip()]
shm = shared_memory.SharedMemory(name=name, create=False)
resource_tracker.unregister(shm._name, "shared_memory")  # the agent owns it
view = memoryview(shm.buf)
dst = bytearray(max(n for _, n in offs))
dst[:] = b"\1" * len(dst)
out = []
for _ in range(2):
    t = time.perf_counter()
    for at, n in offs:
        dst[:n] = view[at:at + n]
    out.append(sum(n for _, n in offs) / (time.perf_counter() - t) / 1e9)
print(*out)
view.release()
shm.close()
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script, name])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    let list: String = offsets.iter().map(|(a, n)| format!("{a} {n}\n")).collect();
    use std::io::Write;
    child.stdin.take()?.write_all(list.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut v = text.split_whitespace().filter_map(|x| x.parse().ok());
    Some((v.next()?, v.next()?))
}

/// The segment's file, removed when the benchmark ends, a failed one too.
struct Segment(String);

impl Drop for Segment {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

fn main() {
    let name = format!("wp-bench-hyperpod-{}", std::process::id());
    let _segment = Segment(name.clone());
    let agent = start(
        &[
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--hyperpod-listen",
            "127.0.0.1:0",
            "--hyperpod-shm-name",
            &name,
            "--hyperpod-shm-bytes",
            SEGMENT,
        ],
        2,
    );
    let addr = agent.lines[1]
        .split("hyperpod API on ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .expect("the hyperpod line")
        .to_string();
    let base = format!("http://{addr}");
    let seg = std::fs::File::open(format!("/dev/shm/{name}")).expect("the segment");
    let mut buf = vec![1u8; 16 * MIB + 28];
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "HyperPod API data path: {} cores, median of {ROUNDS} rounds of {} MiB; agent = release \
         `warmpath agent`, segment {SEGMENT} (steady state: puts evict), loopback HTTP/1.1, \
         puts {IN_FLIGHT} in flight, lease+read+release one at a time; reads copy out of the segment \
         with pread into a reused buffer (GB/s = 1e9 B/s)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        TOTAL / MIB
    );
    println!(
        "{:>6} {:>8} {:>8} {:>7} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8}",
        "object",
        "cpy hot",
        "cpy 256M",
        "put",
        "put/hot",
        "put/256M",
        "lease+read",
        "read/256M",
        "copy only",
        "lease p50/p99"
    );
    rt.block_on(async {
        let client: HttpClient =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_max_idle_per_host(IN_FLIGHT * 2)
                .build_http();
        let mut mapped = Vec::new();
        for size in [MIB, 16 * MIB] {
            // One unmeasured round fills the segment.
            put_round(&client, &base, size, ROUNDS + size / MIB).await;
            let (mut h, mut m, mut p, mut r, mut cp, mut lat) =
                (vec![], vec![], vec![], vec![], vec![], vec![]);
            for round in 0..ROUNDS {
                let (hot, spread) = memcpy(size);
                h.push(hot);
                m.push(spread);
                p.push(put_round(&client, &base, size, round).await);
                let (read, l, copy) = read_round(&client, &base, &seg, &mut buf, size, round).await;
                r.push(read);
                cp.push(copy);
                lat.extend(l);
            }
            lat.sort_by(f64::total_cmp);
            let (h, m, p, r, cp) = (median(h), median(m), median(p), median(r), median(cp));
            println!(
                "{:>4}Mi {h:>8.2} {m:>8.2} {p:>7.2} {:>8.3} {:>8.3} {r:>10.2} {:>9.3} {cp:>9.2} {:>6.0}/{:.0} µs",
                size / MIB,
                p / h,
                p / m,
                r / m,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99)
            );
            // The same objects read through a mapping, as LMCache does, leases held.
            let mut offsets = Vec::new();
            let mut ids = Vec::new();
            for i in 0..TOTAL / size {
                let url = format!("{base}/v1/kv/bench/s{size}-r{}-{i}/leases?ttl_s=60", ROUNDS - 1);
                let (status, body) = send(&client, "POST", url, Bytes::new()).await;
                assert_eq!(status, 200);
                let g: serde_json::Value = serde_json::from_slice(&body).expect("json");
                let o = &g["offsets"][0];
                offsets.push((o["offset"].as_u64().unwrap(), o["len"].as_u64().unwrap() as usize));
                ids.push(g["id"].as_str().unwrap().to_string());
            }
            mapped.push((size, mapped_read(&name, &offsets), m));
            for id in ids {
                send(&client, "POST", format!("{base}/v1/leases/{id}/release"), Bytes::new()).await;
            }
        }
        println!(
            "\nreads through a mapping of the segment, as LMCache's connector does (Python's \
             SharedMemory, memoryview copy into a reused bytearray), GB/s and against memcpy 256M:"
        );
        for (size, got, m) in mapped {
            match got {
                Some((cold, warm)) => println!(
                    "{:>4}Mi first pass (maps pages in) {cold:.2} ({:.2}x), second pass {warm:.2} ({:.2}x)",
                    size / MIB,
                    cold / m,
                    warm / m
                ),
                None => println!("{:>4}Mi skipped: python3 did not run", size / MIB),
            }
        }
    });
    drop(agent);
}
