//! Issue 26, attacks 1 to 5: the agent's block API as an attacker uses it, against a real
//! `warmpath agent`, over raw sockets and the crate's own client. Each test failed on the
//! agent before the fix (the issue says how) and shows what it does now.

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warmpath_cache_agent::client::{AgentAddr, AgentClient};
use warmpath_cache_agent::proto::{self, PutItem, PutRefusal, Request, Response};

use crate::agent::{agent, payload, read_response, LAYOUT, TIMEOUT};
use crate::scratch_dir;

const MIB: usize = 1 << 20;

fn tcp(addr: &AgentAddr) -> String {
    match addr {
        AgentAddr::Tcp(a) => a.clone(),
        AgentAddr::Unix(_) => unreachable!("the tests' agents listen on TCP"),
    }
}

async fn connect(addr: &AgentAddr, token: &str) -> AgentClient {
    AgentClient::connect(addr, token, TIMEOUT)
        .await
        .expect("the agent serves an engine with the token")
}

/// Polls `f` every 50 ms for up to 20 s (a loaded machine: generous).
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    crate::until(Duration::from_secs(20), what, || {
        let fut = f();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// The agent's resident memory, from /proc.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

/// Attack 1: 1,000 connections that never send the handshake, held open, then 1,000 more
/// while an engine works. Before: 256 of them took every place (`max_connections`) for 5 s
/// and the engine's connection was closed at accept. Now each waits at most 2 s, at most 16
/// per source are kept (a newer one displaces the oldest), and only an authenticated
/// connection takes a place: the engine connects at once and is served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_never_lock_an_engine_out() {
    let dir = scratch_dir("agent-attack-silent");
    let token = dir.join("token");
    std::fs::write(&token, "engine-token\n").unwrap();
    let (_agent, addr) = agent(&[
        "--l1-bytes",
        "16MiB",
        "--token-file",
        token.to_str().unwrap(),
    ]);
    let host = tcp(&addr);
    let mut silent = Vec::new();
    for _ in 0..1000 {
        silent.push(tokio::net::TcpStream::connect(&host).await.unwrap());
    }
    let c = connect(&addr, "engine-token").await;
    let r = c
        .put(LAYOUT, vec![(1, payload(1, 4096), false)])
        .await
        .unwrap();
    assert_eq!(r.stored, 1);
    for _ in 0..1000 {
        silent.push(tokio::net::TcpStream::connect(&host).await.unwrap());
    }
    // The authenticated connection is not displaced by the second flood, and another
    // engine still gets in.
    let got = c.get(LAYOUT, vec![1]).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap().payload, payload(1, 4096));
    let other = connect(&addr, "engine-token").await;
    assert!(other.stats().await.is_ok());
    // A silent connection is closed by the agent, displaced or at its deadline.
    let last = silent.last_mut().unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(20), last.read(&mut buf))
        .await
        .expect("the agent closes a silent connection");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
}

/// Attack 2: an engine pins all of L1 and leaves. Before: every block stayed pinned for
/// good and every other put was refused. Now pins are the connection's: at most half of L1
/// (`max_pinned_percent`), another engine cannot lift them, and they end when it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_are_their_connections_and_never_take_more_than_their_share() {
    let (_agent, addr) = agent(&["--l1-bytes", "8MiB", "--max-block-bytes", "1MiB"]);
    let a = connect(&addr, "").await;
    let r = a
        .put(LAYOUT, (0..8).map(|k| (k, payload(k, MIB), true)).collect())
        .await
        .unwrap();
    assert_eq!(r.stored, 4, "{r:?}");
    assert!(
        r.refused
            .iter()
            .all(|(_, why)| *why == PutRefusal::PinLimit),
        "{r:?}"
    );
    let b = connect(&addr, "").await;
    let r = b
        .put(
            LAYOUT,
            (100..104).map(|k| (k, payload(k, MIB), false)).collect(),
        )
        .await
        .unwrap();
    assert_eq!(r.stored, 4, "the unpinned half of L1 stays usable: {r:?}");
    assert_eq!(b.unpin(LAYOUT, (0..8).collect()).await.unwrap(), 0);
    assert_eq!(b.stats().await.unwrap().l1.pinned_blocks, 4);
    drop(a);
    eventually("the pins end with their connection", || async {
        b.stats().await.unwrap().l1.pinned_blocks == 0
    })
    .await;
    let r = b
        .put(
            LAYOUT,
            (200..208).map(|k| (k, payload(k, MIB), false)).collect(),
        )
        .await
        .unwrap();
    assert_eq!(r.stored, 8, "all of L1 is usable again: {r:?}");
}

/// Attack 3: 20,000 lookups of zero keys made 20,198 live leases. Now a lookup that holds
/// nothing takes no lease (lease 0), a connection holds at most 1,024, and they end with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_of_nothing_take_no_lease_and_leases_end_with_their_connection() {
    let (_agent, addr) = agent(&["--l1-bytes", "8MiB"]);
    let a = connect(&addr, "").await;
    let r = a
        .put(LAYOUT, vec![(1, payload(1, 4096), false)])
        .await
        .unwrap();
    assert_eq!(r.stored, 1);
    let lease = Duration::from_secs(30);
    for chunk in 0..(20_000 / 250) {
        let calls = (0..250).map(|i| {
            let keys = if (chunk + i) % 2 == 0 {
                vec![]
            } else {
                vec![999]
            };
            a.lookup(LAYOUT, keys, lease)
        });
        for r in join_all(calls).await {
            assert_eq!(
                r.unwrap().0,
                0,
                "a lookup that holds nothing takes no lease"
            );
        }
    }
    assert_eq!(a.stats().await.unwrap().l1.leases, 0);
    for _ in 0..(3_000 / 250) {
        let calls = (0..250).map(|_| a.lookup(LAYOUT, vec![1], lease));
        for r in join_all(calls).await {
            r.unwrap();
        }
    }
    let leases = a.stats().await.unwrap().l1.leases;
    assert_eq!(leases, 1024, "one connection's leases are bounded");
    // Another connection cannot release them.
    let b = connect(&addr, "").await;
    assert!(b.release(1).await.is_err());
    drop(a);
    eventually("the leases end with their connection", || async {
        b.stats().await.unwrap().l1.leases == 0
    })
    .await;
}

/// Attack 4: 20 connections announce a 1 GiB frame each and send 8 MiB of it. Before: the
/// frame limit was 1 GiB (16 blocks of the default 64 MiB) and the agent's RSS grew by
/// 160 MB. Now a frame is bounded by the connection's in-flight budget (128 MiB by default)
/// and refused from its length, before any of its body is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_frames_are_refused_before_their_body_is_read() {
    let (agent_proc, addr) = agent(&["--l1-bytes", "64MiB"]);
    let host = tcp(&addr);
    // Warm up: the first client and its buffers.
    let c = connect(&addr, "").await;
    c.stats().await.unwrap();
    let before = rss_bytes(agent_proc.pid());
    let chunk = vec![0x5au8; MIB];
    let mut conns = Vec::new();
    for _ in 0..20 {
        let mut s = tokio::net::TcpStream::connect(&host).await.unwrap();
        s.write_all(&proto::encode_hello(b"").unwrap())
            .await
            .unwrap();
        let mut welcome = [0u8; 9];
        s.read_exact(&mut welcome).await.unwrap();
        let item = PutItem {
            key: 1,
            bytes: (1 << 30) - 64,
            pin: false,
        };
        let frame = proto::encode_frame(
            1,
            &Request::Put {
                layout: LAYOUT,
                blocks: vec![item],
            },
            Vec::new(),
        );
        // The frame as announced: its header, then a 1 GiB body that is mostly to come.
        let mut head = frame.head.to_vec();
        let body = (head.len() - 4) as u64 + u64::from(item.bytes);
        head[..4].copy_from_slice(&(body as u32).to_le_bytes());
        // The agent may hang up while the body is still coming: that is the point.
        if s.write_all(&head).await.is_ok() {
            for _ in 0..8 {
                let w = tokio::time::timeout(Duration::from_secs(5), s.write_all(&chunk)).await;
                if !matches!(w, Ok(Ok(()))) {
                    break;
                }
            }
        }
        conns.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = rss_bytes(agent_proc.pid()).saturating_sub(before);
    assert!(
        grown < 48 * MIB as u64,
        "the agent's RSS grew by {} MiB",
        grown >> 20
    );
    let (_, answer) = tokio::time::timeout(TIMEOUT, read_response(&mut conns[0]))
        .await
        .expect("an answer to the announced frame");
    assert!(
        matches!(&answer, Response::Error { message, .. } if message.contains("over the limit")),
        "{answer:?}"
    );
    // The agent serves on.
    let r = c
        .put(LAYOUT, vec![(2, payload(2, MIB), false)])
        .await
        .unwrap();
    assert_eq!(r.stored, 1);
}

/// Attack 5: first writer wins, silently. Before: a put of a held key with other bytes was
/// answered `stored=1` (and the first bytes kept). Now it is a `Conflict` refusal (counted);
/// the same bytes again are stored as before, and a version-1 client hears the conflict as
/// `Full` (not stored), the only refusal it knows that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_of_a_key_gets_a_conflict_and_the_first_bytes_stay() {
    let (_agent, addr) = agent(&["--l1-bytes", "8MiB"]);
    let first = payload(5, 4096);
    let other = Bytes::from(vec![0xab; 4096]);
    let a = connect(&addr, "").await;
    assert_eq!(
        a.put(LAYOUT, vec![(5, first.clone(), false)])
            .await
            .unwrap()
            .stored,
        1
    );
    let b = connect(&addr, "").await;
    let r = b
        .put(LAYOUT, vec![(5, other.clone(), false)])
        .await
        .unwrap();
    assert_eq!(r.stored, 0);
    assert_eq!(r.refused, vec![(0, PutRefusal::Conflict)]);
    let r = b
        .put(LAYOUT, vec![(5, first.clone(), false)])
        .await
        .unwrap();
    assert_eq!(r.stored, 1, "the same bytes again are a refresh");
    let got = b.get(LAYOUT, vec![5]).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap().payload, first);

    // A version-1 engine.
    let mut s = tokio::net::TcpStream::connect(tcp(&addr)).await.unwrap();
    let mut hello = proto::encode_hello(b"").unwrap();
    hello[4..6].copy_from_slice(&1u16.to_le_bytes());
    s.write_all(&hello).await.unwrap();
    let mut welcome = [0u8; 9];
    s.read_exact(&mut welcome).await.unwrap();
    assert_eq!(welcome[6], proto::HELLO_OK, "version 1 is still served");
    let put = proto::encode_frame(
        9,
        &Request::Put {
            layout: LAYOUT,
            blocks: vec![PutItem {
                key: 5,
                bytes: other.len() as u32,
                pin: false,
            }],
        },
        vec![other],
    );
    s.write_all(&put.head).await.unwrap();
    s.write_all(&put.payloads[0]).await.unwrap();
    let (id, answer) = read_response(&mut s).await;
    assert_eq!(id, 9);
    assert_eq!(
        answer,
        Response::Put {
            stored: 0,
            refused: vec![(0, PutRefusal::Full)]
        }
    );
}

/// Attack 5, across hosts: agents that share an L2 and a cluster key (`l2.key_file`) seal
/// what they write; an object written by a host without the key is a counted miss for them,
/// and what they sealed is served to each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_l2_object_from_a_host_without_the_cluster_key_is_a_counted_miss() {
    let dir = scratch_dir("agent-attack-l2-seal");
    let l2 = format!("dir:{}", dir.join("l2").display());
    let toml = crate::cluster_key_config(&dir);
    let keyed = |_: ()| {
        agent(&[
            "--config",
            toml.to_str().unwrap(),
            "--l1-bytes",
            "8MiB",
            "--l2",
            &l2,
            "--l2-write",
            "through",
        ])
    };
    let (_a, a_addr) = keyed(());
    let (_c, c_addr) = keyed(());
    let (_b, b_addr) = agent(&["--l1-bytes", "8MiB", "--l2", &l2, "--l2-write", "through"]);
    let (a, b, c) = (
        connect(&a_addr, "").await,
        connect(&b_addr, "").await,
        connect(&c_addr, "").await,
    );
    // The keyless host writes block 1; a keyed agent will not serve it.
    assert_eq!(
        b.put(LAYOUT, vec![(1, payload(1, 4096), false)])
            .await
            .unwrap()
            .stored,
        1
    );
    eventually("the keyless write reaches L2", || async {
        std::fs::read_dir(dir.join("l2"))
            .map(|d| d.count() > 0)
            .unwrap_or(false)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = a.get(LAYOUT, vec![1]).await.unwrap();
    assert!(got[0].is_none(), "an unsealed object is not served");
    assert!(a.stats().await.unwrap().l2_damaged >= 1);
    // A keyed agent's block is served to another keyed agent from L2.
    assert_eq!(
        a.put(LAYOUT, vec![(2, payload(2, 4096), false)])
            .await
            .unwrap()
            .stored,
        1
    );
    eventually("a sealed block is served across hosts", || async {
        let got = c.get(LAYOUT, vec![2]).await.unwrap();
        got[0]
            .as_ref()
            .is_some_and(|f| f.payload == payload(2, 4096))
    })
    .await;
}
