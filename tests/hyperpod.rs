//! The agent as the node's HyperPod daemon: real `warmpath agent` processes with the
//! HyperPod API on, driven by LMCache's own `SageMakerHyperPodConnector` (the published
//! lmcache 0.5.6, on CPU, from `target/lmcache-venv`: tests/tools/setup-lmcache-venv.sh)
//! and by hand-written HTTP for what that client never sends (bad keys, short bodies,
//! forged leases), and restarted to show that clients then see misses, never stale bytes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{scratch_dir, Proc};

/// A segment name no other test or run uses (removed when dropped).
struct Shm(String);

impl Shm {
    fn new(tag: &str) -> Shm {
        Shm(format!("wp-it-{tag}-{}", std::process::id()))
    }
    fn path(&self) -> PathBuf {
        Path::new("/dev/shm").join(&self.0)
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
    }
}

/// An agent with the HyperPod API on `shm` of `bytes`; `extra` flags after. Returns it and
/// the API's HOST:PORT (its metrics URL is `lines[1]`'s when `--metrics-listen` is given).
fn agent(shm: &Shm, bytes: &str, extra: &[&str]) -> (Proc, String) {
    agent_on("127.0.0.1:0", shm, bytes, extra)
}

/// [`agent`] with the HyperPod API on `listen`.
fn agent_on(listen: &str, shm: &Shm, bytes: &str, extra: &[&str]) -> (Proc, String) {
    let mut args = vec![
        "agent",
        "--listen",
        "127.0.0.1:0",
        "--hyperpod-listen",
        listen,
        "--hyperpod-shm-name",
        &shm.0,
        "--hyperpod-shm-bytes",
        bytes,
    ];
    args.extend_from_slice(extra);
    let lines = 2
        + usize::from(extra.contains(&"--metrics-listen"))
        + usize::from(extra.contains(&"--lm-listen"));
    let p = Proc::start_lines(&args, lines, "warn");
    let addr = printed_addr(&p, "hyperpod API on ");
    (p, addr)
}

/// The address after `after` in the lines `p` printed.
fn printed_addr(p: &Proc, after: &str) -> String {
    p.lines
        .iter()
        .find_map(|l| l.split(after).nth(1))
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no {after:?} line in {:?}", p.lines))
        .to_string()
}

/// An agent with the HyperPod API and `lm://` on loopback: (agent, HyperPod API address,
/// lm:// address, metrics URL).
fn agent_with_lm(shm: &Shm, bytes: &str, extra: &[&str]) -> (Proc, String, String, String) {
    let mut args = vec![
        "--lm-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let (p, hp) = agent(shm, bytes, &args);
    let lm = printed_addr(&p, "lm:// on ");
    let metrics = metrics_url(&p);
    (p, hp, lm, metrics)
}

/// The metrics URL (`http://HOST:PORT`) of an agent started with `--metrics-listen`.
fn metrics_url(p: &Proc) -> String {
    format!(
        "http://{}",
        printed_addr(p, "metrics on http://").trim_end_matches("/metrics")
    )
}

/// One HTTP/1.1 exchange on a fresh connection: (status, body).
fn http(addr: &str, method: &str, path: &str, headers: &[&str], body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("the HyperPod API accepts");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for h in headers {
        req += h;
        req += "\r\n";
    }
    req += "\r\n";
    s.write_all(req.as_bytes()).unwrap();
    let _ = s.write_all(body);
    read_answer(s)
}

fn read_answer(mut s: TcpStream) -> (u16, String) {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

/// An object as LMCache sends it: the 28-byte RemoteMetadata header, then `payload`.
fn object(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    for x in [
        payload.len() as i32,
        1,
        3,
        payload.len() as i32 / 2,
        1,
        0,
        0,
    ] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.extend_from_slice(payload);
    v
}

fn put(addr: &str, key: &str, body: &[u8]) -> (u16, String) {
    let len = format!("Content-Length: {}", body.len());
    http(addr, "PUT", &format!("/v1/kv/lmcache/{key}"), &[&len], body)
}

fn lease(addr: &str, key: &str, ttl_s: f64) -> (u16, serde_json::Value) {
    let (status, body) = http(
        addr,
        "POST",
        &format!("/v1/kv/lmcache/{key}/leases?timeout_ms=2000&ttl_s={ttl_s}"),
        &["Content-Length: 0"],
        b"",
    );
    (status, serde_json::from_str(&body).expect("a JSON answer"))
}

fn release(addr: &str, id: &str) -> (u16, String) {
    http(
        addr,
        "POST",
        &format!("/v1/leases/{id}/release"),
        &["Content-Length: 0"],
        b"",
    )
}

/// What a lease's offsets point at in the segment.
fn leased_bytes(shm: &Shm, grant: &serde_json::Value) -> Vec<u8> {
    let seg = std::fs::read(shm.path()).expect("the segment is readable");
    let mut out = Vec::new();
    for o in grant["offsets"].as_array().expect("offsets") {
        let (at, len) = (
            o["offset"].as_u64().unwrap() as usize,
            o["len"].as_u64().unwrap() as usize,
        );
        out.extend_from_slice(&seg[at..at + len]);
    }
    out
}

fn metric(url: &str, line_start: &str) -> f64 {
    let out = Command::new("curl")
        .args(["-s", &format!("{url}/metrics")])
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The venv with lmcache 0.5.6 (`WARMPATH_LMCACHE_VENV`, or `target/lmcache-venv`), made
/// by tests/tools/setup-lmcache-venv.sh when missing; None when WARMPATH_SKIP_LMCACHE=1.
pub fn lmcache_venv() -> Option<PathBuf> {
    if std::env::var_os("WARMPATH_SKIP_LMCACHE").is_some_and(|v| v == "1") {
        return None;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let venv = std::env::var_os("WARMPATH_LMCACHE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/lmcache-venv"));
    let status = Command::new("sh")
        .arg(root.join("tests/tools/setup-lmcache-venv.sh"))
        .arg(&venv)
        .status()
        .expect("sh runs");
    assert!(
        status.success(),
        "could not set up {} with lmcache 0.5.6 (python3 with venv and pip, PyPI, about \
         6 GB of disk): run tests/tools/setup-lmcache-venv.sh {0}, or set \
         WARMPATH_SKIP_LMCACHE=1 to leave this test out",
        venv.display()
    );
    Some(venv)
}

#[test]
fn lmcaches_own_hyperpod_connector_stores_and_loads_through_the_agent() {
    let Some(venv) = lmcache_venv() else {
        println!("WARMPATH_SKIP_LMCACHE=1: LMCache's connector was not run");
        return;
    };
    let shm = Shm::new("lmcache");
    let (agent, addr) = agent(&shm, "64MiB", &["--metrics-listen", "127.0.0.1:0"]);
    let metrics = metrics_url(&agent);
    crate::run_client_checks(
        &venv.join("bin/python"),
        "lmcache_hyperpod.py",
        &[&addr, &shm.0],
    );
    // What the agent counted of it: 1 + 4 objects stored, the second put a conflict, the
    // misses the script asked for, the lease the script never released expired.
    for (name, want) in [
        ("warmpath_agent_hyperpod_puts_total{result=\"stored\"}", 5.0),
        ("warmpath_agent_hyperpod_conflicts_total", 1.0),
        ("warmpath_agent_hyperpod_lease_expiries_total", 1.0),
        ("warmpath_agent_hyperpod_leases ", 0.0),
        ("warmpath_agent_hyperpod_objects", 5.0),
    ] {
        assert_eq!(metric(&metrics, name), want, "{name}");
    }
    assert!(metric(&metrics, "warmpath_agent_hyperpod_misses_total") >= 3.0);
}

#[test]
fn hyperpod_api_refuses_bad_input_with_clear_errors_and_shows_nothing_half_written() {
    // Room for one two-page object (a header page, then two data pages).
    let shm = Shm::new("bad");
    let (_agent, addr) = agent(&shm, "12288", &[]);
    let a = object(&[7u8; 5000]);

    // Keys that are not what a client's quoting gives, or too long.
    for (key, want) in [
        ("a|b", "not URL-safe"),
        ("a%zzb", "not URL-safe"),
        ("a%00b", "control character"),
        (&"k".repeat(1025), "longer than 1024"),
    ] {
        let (status, body) = put(&addr, key, &a);
        assert_eq!(status, 400, "{key}: {body}");
        assert!(body.contains(want), "{key}: {body}");
    }
    // Larger than the segment: refused before a byte of body is read.
    let (status, body) = http(
        &addr,
        "PUT",
        "/v1/kv/lmcache/big",
        &["Content-Length: 9000"],
        b"",
    );
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("larger than the segment"), "{body}");
    // No length: refused.
    let (status, body) = http(
        &addr,
        "PUT",
        "/v1/kv/lmcache/chunked",
        &["Transfer-Encoding: chunked"],
        b"0\r\n\r\n",
    );
    assert_eq!(status, 411, "{body}");
    // A header that disagrees with the body: refused, nothing stored.
    let mut lying = a.clone();
    lying[..4].copy_from_slice(&9999i32.to_le_bytes());
    let (status, body) = put(&addr, "lying", &lying);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("RemoteMetadata header says 9999"), "{body}");
    assert_eq!(lease(&addr, "lying", 5.0).0, 404);

    // A body that stops early: the connection closes half-way; nothing is visible, and the
    // name and the place are free again.
    let mut s = TcpStream::connect(&addr).unwrap();
    let head = format!(
        "PUT /v1/kv/lmcache/a HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        a.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&a[..2000]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let (status, body) = read_answer(s);
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("body ended after 2000 of 5028 bytes"),
        "{body}"
    );
    let (status, miss) = lease(&addr, "a", 5.0);
    assert_eq!(status, 404, "a half-written object is never leased: {miss}");

    // Stored, then a second put of the same key: 409, the first bytes stay.
    assert_eq!(put(&addr, "a", &a).0, 200);
    let (status, body) = put(&addr, "a", &object(&[9u8; 5000]));
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("already stored"), "{body}");

    // Lease ids: malformed, forged, released twice.
    let (status, grant) = lease(&addr, "a", 5.0);
    assert_eq!(status, 200, "{grant}");
    assert_eq!(
        leased_bytes(&shm, &grant),
        a,
        "the lease points at the object"
    );
    let id = grant["id"].as_str().unwrap().to_string();
    let (status, body) = release(&addr, "not-a-lease");
    assert_eq!(status, 400, "{body}");
    let forged = format!("{}{:016x}{}", &id[..16], 999_999, &id[32..]);
    let (status, body) = release(&addr, &forged);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("not issued by this agent"), "{body}");
    assert_eq!(release(&addr, &id).0, 200);
    let (status, body) = release(&addr, &id);
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("released, or expired"), "{body}");

    // A client that never releases: its lease (ttl clamped by the client's ask, 0.3 s)
    // keeps the object until it expires; then the object is evictable like any other.
    let (status, grant) = lease(&addr, "a", 0.3);
    assert_eq!(status, 200, "{grant}");
    let b = object(&[8u8; 5000]);
    let (status, body) = put(&addr, "b", &b);
    assert_eq!(status, 507, "a leased object is never evicted: {body}");
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        put(&addr, "b", &b).0,
        200,
        "the expired lease no longer holds a"
    );
    assert_eq!(lease(&addr, "a", 5.0).0, 404, "a was evicted for b");
    let (status, grant_b) = lease(&addr, "b", 1e9);
    assert_eq!(status, 200);
    assert_eq!(grant_b["ttl_s"], 60.0, "ttl clamped to the agent's maximum");
    assert_eq!(leased_bytes(&shm, &grant_b), b);
}

#[test]
fn a_restarted_agent_answers_misses_never_stale_bytes() {
    let shm = Shm::new("restart");
    let (mut first, addr) = agent(&shm, "1MiB", &[]);
    let a = object(&[1u8; 10_000]);
    assert_eq!(put(&addr, "a", &a).0, 200);
    let (status, grant) = lease(&addr, "a", 30.0);
    assert_eq!(status, 200);
    assert_eq!(leased_bytes(&shm, &grant), a);
    let old_id = grant["id"].as_str().unwrap().to_string();
    use std::os::unix::fs::MetadataExt;
    let inode = std::fs::metadata(shm.path()).unwrap().ino();

    // While it runs, a second agent cannot take the segment.
    let out = Command::new(crate::warmpath_bin())
        .args([
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--hyperpod-listen",
            "127.0.0.1:0",
        ])
        .args([
            "--hyperpod-shm-name",
            &shm.0,
            "--hyperpod-shm-bytes",
            "1MiB",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another running agent"), "{err}");

    first.kill();
    let (_second, addr) = agent(&shm, "1MiB", &[]);
    // The same inode (a client's mapping stays the segment), a new generation, no objects.
    assert_eq!(std::fs::metadata(shm.path()).unwrap().ino(), inode);
    assert_eq!(lease(&addr, "a", 30.0).0, 404, "after a restart: a miss");
    let (status, body) = release(&addr, &old_id);
    assert_eq!(status, 410, "{body}");
    assert!(body.contains("earlier run of the agent"), "{body}");
    // New bytes under the same key: a lease points at them, not at the old ones.
    let a2 = object(&[2u8; 10_000]);
    assert_eq!(put(&addr, "a", &a2).0, 200);
    let (status, grant) = lease(&addr, "a", 30.0);
    assert_eq!(status, 200);
    assert_eq!(leased_bytes(&shm, &grant), a2);
}

#[test]
fn hyperpod_api_off_loopback_needs_a_token() {
    let dir = scratch_dir("hyperpod-token");
    let out = Command::new(crate::warmpath_bin())
        .args([
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--hyperpod-listen",
            "0.0.0.0:0",
        ])
        .args(["--hyperpod-shm-name", "wp-it-never-created"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs a token"), "{err}");
    assert!(!Path::new("/dev/shm/wp-it-never-created").exists());
}

/// Polls a lease on `key` at `addr` until it is granted (an L2 write runs in the background).
fn lease_when_there(addr: &str, key: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, grant) = lease(addr, key, 5.0);
        if status == 200 {
            return grant;
        }
        assert_eq!(status, 404, "{grant}");
        assert!(
            std::time::Instant::now() < deadline,
            "{key} never came from L2"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn objects_evicted_from_the_segment_go_to_l2_and_a_lease_loads_them_back() {
    // Room for one object: each put evicts the other to the directory L2.
    let shm = Shm::new("l2");
    let dir = scratch_dir("hyperpod-l2");
    let l2 = format!("dir:{}", dir.join("l2").display());
    let (_agent, addr) = agent(&shm, "12288", &["--l2", &l2]);
    let a = object(&[3u8; 5000]);
    let b = object(&[4u8; 5000]);
    assert_eq!(put(&addr, "a", &a).0, 200);
    assert_eq!(put(&addr, "b", &b).0, 200, "a leaves the segment for L2");
    // The copy to L2 runs in the background: a lease finds a there once it landed.
    let grant = lease_when_there(&addr, "a");
    assert_eq!(leased_bytes(&shm, &grant), a, "loaded back byte for byte");
    release(&addr, grant["id"].as_str().unwrap());
    // b went to L2 to make room for a, and comes back the same way.
    let grant = lease_when_there(&addr, "b");
    assert_eq!(leased_bytes(&shm, &grant), b);
    assert_eq!(
        lease(&addr, "never-put", 5.0).0,
        404,
        "in neither tier: a miss"
    );
}

#[test]
fn objects_written_through_reach_other_hosts_while_their_segment_holds_them() {
    // Two hosts' agents share a directory L2; each segment holds everything put into it.
    let dir = scratch_dir("hyperpod-l2-through");
    let l2 = format!("dir:{}", dir.join("l2").display());
    let obj = object(&[7u8; 5000]);
    for write in ["on-evict", "through"] {
        let (shm_a, shm_b) = (
            Shm::new(&format!("{write}-a")),
            Shm::new(&format!("{write}-b")),
        );
        let (_a, a) = agent(&shm_a, "1MiB", &["--l2", &l2, "--l2-write", write]);
        let (_b, b) = agent(&shm_b, "1MiB", &["--l2", &l2, "--l2-write", write]);
        assert_eq!(put(&a, write, &obj).0, 200);
        if write == "through" {
            // Stored on host A, found by host B in L2: LMCache's store to every backend.
            let grant = lease_when_there(&b, write);
            assert_eq!(leased_bytes(&shm_b, &grant), obj, "byte for byte");
        } else {
            // A still holds it and never evicted it: nothing went to L2.
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(lease(&b, write, 5.0).0, 404, "only A's segment has it");
        }
    }
}

#[test]
fn an_object_written_through_is_not_copied_again_when_evicted() {
    // Room for one object: b's put evicts a, whose copy is in L2 already.
    let shm = Shm::new("through-evict");
    let dir = scratch_dir("hyperpod-l2-through-evict");
    let l2 = format!("dir:{}", dir.join("l2").display());
    let (agent, addr) = agent(
        &shm,
        "12288",
        &[
            "--l2",
            &l2,
            "--l2-write",
            "through",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let metrics = metrics_url(&agent);
    let out = r#"warmpath_agent_hyperpod_bytes_total{direction="l2_out"}"#;
    let written = |at_least: f64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let n = metric(&metrics, out);
            if n >= at_least {
                return n;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{n} bytes to L2, want {at_least}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let (a, b) = (object(&[3u8; 5000]), object(&[4u8; 5000]));
    assert_eq!(put(&addr, "a", &a).0, 200);
    let one = written(1.0);
    assert_eq!(put(&addr, "b", &b).0, 200, "a leaves the segment");
    written(2.0 * one);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        metric(&metrics, out),
        2.0 * one,
        "a and b written once each"
    );
    let grant = lease_when_there(&addr, "a");
    assert_eq!(leased_bytes(&shm, &grant), a, "a comes back from L2");
}

#[test]
fn hyperpod_api_off_loopback_takes_the_agents_token_before_any_body() {
    let dir = scratch_dir("hyperpod-token-on");
    let token = dir.join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let shm = Shm::new("token");
    // On every address (not loopback): the agent's token is required.
    let (_agent, addr) = agent_on(
        "0.0.0.0:0",
        &shm,
        "1MiB",
        &["--token-file", token.to_str().unwrap()],
    );
    let addr = addr.replace("0.0.0.0", "127.0.0.1");
    let a = object(&[5u8; 100]);
    let len = format!("Content-Length: {}", a.len());
    let (status, body) = http(&addr, "PUT", "/v1/kv/lmcache/a", &[&len], &a);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("Authorization: Bearer"), "{body}");
    let (status, body) = http(
        &addr,
        "PUT",
        "/v1/kv/lmcache/a",
        &[&len, "Authorization: Bearer wrong"],
        &a,
    );
    assert_eq!(status, 401, "{body}");
    let (status, body) = http(
        &addr,
        "PUT",
        "/v1/kv/lmcache/a",
        &[&len, "Authorization: Bearer s3cret"],
        &a,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(lease(&addr, "a", 1.0).0, 401, "leases need it too");
}

/// An lm:// header as LMCache's `ClientMetaMessage` packs it (command, length, fmt, dtype,
/// location, shape[4], the key padded to 150 bytes).
fn lm_header(command: i32, length: i32, key: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(186);
    for v in [command, length, 1, 3, 0, 2, 2, 16, 32] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    let mut k = key.as_bytes().to_vec();
    k.resize(150, b' ');
    b.extend_from_slice(&k);
    b
}

/// One lm:// command on `s` that has a reply: (code, length).
fn lm_ask(s: &mut TcpStream, command: i32, key: &str) -> (i32, i32) {
    s.write_all(&lm_header(command, 0, key)).unwrap();
    let mut r = [0u8; 36];
    s.read_exact(&mut r).unwrap();
    let code = i32::from_le_bytes(r[..4].try_into().unwrap());
    let len = i32::from_le_bytes(r[4..8].try_into().unwrap());
    (code, len)
}

fn lm_connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Whether the agent closed `s` (a read sees the end, or a reset).
fn closed_by_agent(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn lmcaches_own_lm_connector_stores_and_loads_through_the_agent() {
    let Some(venv) = lmcache_venv() else {
        println!("WARMPATH_SKIP_LMCACHE=1: LMCache's lm:// connector was not run");
        return;
    };
    let shm = Shm::new("lm");
    let (_agent, hp, lm, metrics) = agent_with_lm(&shm, "64MiB", &[]);
    crate::run_client_checks(
        &venv.join("bin/python"),
        "lmcache_lm.py",
        &[&lm, &hp, &shm.0],
    );
    // What the agent counted: five objects stored through lm:// (one more through the
    // HyperPod API), the second writer of key 1 a conflict, its bytes dropped.
    let lm_metric = |command: &str, result: &str| {
        metric(
            &metrics,
            &format!(
                "warmpath_agent_lm_requests_total{{command=\"{command}\",result=\"{result}\"}}"
            ),
        )
    };
    assert_eq!(lm_metric("put", "stored"), 5.0);
    assert_eq!(lm_metric("put", "conflict"), 1.0);
    assert_eq!(lm_metric("list", "refused"), 1.0);
    assert_eq!(lm_metric("health", "ok"), 1.0);
    assert_eq!(
        metric(&metrics, "warmpath_agent_hyperpod_conflicts_total"),
        1.0
    );
    // The gauges are refreshed every 100 ms.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(metric(&metrics, "warmpath_agent_hyperpod_objects"), 6.0);
    assert_eq!(
        metric(&metrics, "warmpath_agent_hyperpod_leases "),
        0.0,
        "every get's lease ended"
    );
}

#[test]
fn lm_closes_on_what_it_cannot_serve_and_shows_nothing_half_written() {
    // Room for one two-page object (a header page, then two data pages).
    let shm = Shm::new("lm-bad");
    let (_agent, _hp, lm, metrics) = agent_with_lm(&shm, "12288", &[]);
    // An unknown command: closed.
    let mut s = lm_connect(&lm);
    s.write_all(&lm_header(9, 0, "k")).unwrap();
    assert!(
        closed_by_agent(&mut s),
        "an unknown command closes the connection"
    );
    // A put larger than the segment: closed before its body is read; nothing stored.
    let mut s = lm_connect(&lm);
    s.write_all(&lm_header(1, 1 << 20, "big")).unwrap();
    assert!(
        closed_by_agent(&mut s),
        "a put larger than the segment closes it"
    );
    // A put whose body stops early (the client goes away): nothing visible.
    let mut s = lm_connect(&lm);
    s.write_all(&lm_header(1, 4000, "short")).unwrap();
    s.write_all(&[7u8; 1000]).unwrap();
    drop(s);
    let mut s = lm_connect(&lm);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        lm_ask(&mut s, 3, "short"),
        (400, 0),
        "a put cut short is not visible"
    );
    assert_eq!(lm_ask(&mut s, 2, "short"), (400, 0), "nor can it be read");
    assert_eq!(lm_ask(&mut s, 3, "big"), (400, 0));
    // A whole put on the same connection afterwards is stored and read back.
    s.write_all(&lm_header(1, 4000, "whole")).unwrap();
    s.write_all(&[9u8; 4000]).unwrap();
    assert_eq!(lm_ask(&mut s, 2, "whole"), (200, 4000));
    let mut body = vec![0u8; 4000];
    s.read_exact(&mut body).unwrap();
    assert_eq!(body, vec![9u8; 4000]);
    // A key that is not text: closed.
    let mut bad = lm_header(2, 0, "k");
    bad[40] = 0xff;
    s.write_all(&bad).unwrap();
    assert!(
        closed_by_agent(&mut s),
        "a key that is not UTF-8 closes the connection"
    );
    assert!(
        metric(
            &metrics,
            "warmpath_agent_lm_requests_total{command=\"put\",result=\"closed\"}"
        ) >= 2.0
    );
    // lm:// carries no credentials: off loopback it is refused at start.
    let out = Command::new(crate::warmpath_bin())
        .args([
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--hyperpod-listen",
            "127.0.0.1:0",
            "--hyperpod-shm-name",
            "wp-it-never-created",
            "--lm-listen",
            "0.0.0.0:0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("loopback only"), "{err}");
}

/// Issue 26's first attack against both fronts of the HyperPod store: 500 connections to
/// each that never send a byte (twice the cap on unproven ones) do not keep a client out, and a silent HTTP
/// connection is closed at its first-request deadline.
#[test]
fn silent_connection_floods_keep_no_client_of_either_front_out() {
    let shm = Shm::new("lm-flood");
    let (_agent, hp, lm, metrics) = agent_with_lm(&shm, "8MiB", &[]);
    let mut silent = Vec::new();
    for _ in 0..500 {
        silent.push(TcpStream::connect(&lm).unwrap());
        silent.push(TcpStream::connect(&hp).unwrap());
    }
    // A client of each front that speaks at once is served.
    let mut s = lm_connect(&lm);
    s.write_all(&lm_header(1, 100, "after-flood")).unwrap();
    s.write_all(&[5u8; 100]).unwrap();
    assert_eq!(lm_ask(&mut s, 3, "after-flood"), (200, 0));
    assert_eq!(lm_ask(&mut s, 5, "x"), (200, 0), "health");
    let (status, body) = put(&hp, "after-flood-hp", &object(&[6u8; 100]));
    assert_eq!(status, 200, "{body}");
    for api in ["lm", "hyperpod"] {
        let displaced = metric(
            &metrics,
            &format!("warmpath_agent_handshakes_displaced_total{{api=\"{api}\",scope=\"source\"}}"),
        );
        assert!(displaced >= 200.0, "{api}: {displaced} displaced");
    }
    drop(silent);
    // A silent HTTP connection ends at the first-request deadline (5 s).
    let mut quiet = TcpStream::connect(&hp).unwrap();
    quiet
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let started = std::time::Instant::now();
    assert!(closed_by_agent(&mut quiet));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(15),
        "closed after {waited:?}"
    );
}

/// With the cluster key, objects the HyperPod store evicts to L2 are sealed: an agent of
/// the cluster loads them back, an agent without the key (or a host that wrote unsealed
/// objects) gets a counted miss.
#[test]
fn hyperpod_objects_in_l2_are_sealed_under_the_cluster_key() {
    let dir = scratch_dir("hyperpod-seal");
    let l2 = format!("dir:{}", dir.join("l2").display());
    let toml = crate::cluster_key_config(&dir);
    // Room for one object: each put evicts the other to L2.
    let shm = Shm::new("seal-a");
    let (keyed, addr) = agent(
        &shm,
        "12288",
        &["--config", toml.to_str().unwrap(), "--l2", &l2],
    );
    let a = object(&[3u8; 5000]);
    assert_eq!(put(&addr, "a", &a).0, 200);
    assert_eq!(put(&addr, "b", &object(&[4u8; 5000])).0, 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let grant = loop {
        let (status, grant) = lease(&addr, "a", 5.0);
        if status == 200 {
            break grant;
        }
        assert!(std::time::Instant::now() < deadline, "a never came back");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        leased_bytes(&shm, &grant),
        a,
        "sealed and loaded back by its cluster"
    );
    release(&addr, grant["id"].as_str().unwrap());
    // a and b are both in L2 now (b left the segment for a), each sealed (WPB2).
    fn blocks(dir: &Path, found: &mut Vec<Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                blocks(&path, found);
            } else if path.extension().is_some_and(|x| x == "blk") {
                found.push(std::fs::read(path).unwrap());
            }
        }
    }
    let l2_objects = || {
        let mut found = Vec::new();
        blocks(&dir.join("l2"), &mut found);
        found
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while l2_objects().len() < 2 {
        assert!(std::time::Instant::now() < deadline, "b never reached L2");
        std::thread::sleep(Duration::from_millis(50));
    }
    for bytes in l2_objects() {
        assert_eq!(&bytes[..4], b"WPB2", "an L2 object not sealed");
    }
    drop(keyed);
    // An agent without the key on the same L2 serves none of them: a miss, counted.
    let shm_b = Shm::new("seal-b");
    let (keyless, addr_b) = agent(
        &shm_b,
        "12288",
        &["--l2", &l2, "--metrics-listen", "127.0.0.1:0"],
    );
    let metrics = format!(
        "http://{}",
        printed_addr(&keyless, "metrics on http://").trim_end_matches("/metrics")
    );
    assert_eq!(
        lease(&addr_b, "b", 5.0).0,
        404,
        "a sealed object without the key"
    );
    assert_eq!(
        metric(
            &metrics,
            "warmpath_agent_l2_damaged_total{kind=\"hyperpod\"}"
        ),
        1.0
    );
}
