//! Issue 26's attacks on residency over QUIC, KV-event ingestion and the stores' file
//! modes (attacks 6 to 10), each against real `warmpath` processes: certificates carry
//! their role, so an agent serves routers only and a router follows agents only, by the
//! name it follows; an agent keeps the newest tenant table, bounded; a delta too large for
//! one message reaches routers in pieces; every store is its owner's only.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use warmpath_cache_agent::kv_events::{encode_batch, message, EngineHash, KvEvent, Shape};
use warmpath_residency::net::{endpoint, follow, AgentTarget, TenantTable};
use warmpath_residency::tls::TlsFiles;
use warmpath_residency::{decode, encode, Outcome, Reply, Wire};
use zeromq::{Socket, SocketSend, ZmqMessage};

use crate::router::{get_text, metric};
use crate::{make_certs, scratch_dir, until, Proc};

/// An agent serving residency with certificate `name` of `certs`: the process, its QUIC
/// address and its metrics URL.
pub(crate) fn residency_agent(certs: &Path, name: &str, extra: &[&str]) -> (Proc, String, String) {
    let mut args = vec![
        "agent",
        "--listen",
        "127.0.0.1:0",
        "--residency-listen",
        "127.0.0.1:0",
        "--tls-dir",
        certs.to_str().unwrap(),
        "--tls-name",
        name,
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let p = Proc::start_lines(&args, 3, "warn");
    let after = |what: &str| {
        p.lines
            .iter()
            .find_map(|l| l.split(what).nth(1))
            .unwrap_or_else(|| panic!("no {what:?} in {:?}", p.lines))
            .trim()
            .to_string()
    };
    let (quic, metrics) = (after("mutual TLS) on "), after("metrics on "));
    (p, quic, metrics)
}

/// A QUIC client endpoint presenting certificate `name` of `certs`.
fn client(certs: &Path, name: &str) -> warmpath_residency::net::quinn::Endpoint {
    let tls = TlsFiles::in_dir(certs, name).client_config().unwrap();
    endpoint("127.0.0.1:0".parse().unwrap(), None, Some(tls)).unwrap()
}

fn frame(w: &Wire) -> Vec<u8> {
    let body = encode(w);
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&body);
    f
}

/// Opens the residency stream to the agent at `quic` (certificate name `server`) as
/// `ep`, asks for a snapshot and sends `then`: whether the agent served a snapshot.
async fn served(
    ep: &warmpath_residency::net::quinn::Endpoint,
    quic: &str,
    server: &str,
    then: &[Reply],
) -> bool {
    let attempt = async {
        let conn = ep.connect(quic.parse().ok()?, server).ok()?.await.ok()?;
        let (mut send, mut recv) = conn.open_bi().await.ok()?;
        send.write_all(&frame(&Wire::V1Reply(Reply::Resync)))
            .await
            .ok()?;
        for r in then {
            send.write_all(&frame(&Wire::V1Reply(r.clone())))
                .await
                .ok()?;
        }
        let mut len = [0u8; 4];
        recv.read_exact(&mut len).await.ok()?;
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        recv.read_exact(&mut body).await.ok()?;
        let snapshot = matches!(
            decode(&body).ok()?,
            Wire::V1Msg(warmpath_residency::Msg::Snapshot { .. })
        );
        // Give the agent time to read what followed the request.
        tokio::time::sleep(Duration::from_millis(200)).await;
        conn.close(0u32.into(), b"done");
        Some(snapshot)
    };
    tokio::time::timeout(Duration::from_secs(3), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Follows `target` as a router does (its own code, `net::follow`) with certificate
/// `name`; the outcomes, until the returned stop is dropped.
fn follow_as(
    certs: &Path,
    name: &str,
    target: &str,
) -> (
    tokio::sync::mpsc::Receiver<Outcome>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let (_, tenants) = tokio::sync::watch::channel(Arc::new(TenantTable::default()));
    tokio::spawn(follow(
        client(certs, name),
        AgentTarget::parse(target).unwrap(),
        Duration::from_secs(30),
        tx,
        stopped,
        tenants,
        Default::default(),
    ));
    (rx, stop)
}

/// Whether a follower gets the agent's snapshot within `within`.
async fn snapshot_within(rx: &mut tokio::sync::mpsc::Receiver<Outcome>, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while let Ok(Some(o)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        if matches!(o, Outcome::Apply { sent_ms: None, .. }) {
            return true;
        }
    }
    false
}

/// Attack 7: an agent served its residency (every tenant's block keys) to a client
/// holding another agent's certificate, or its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_residency_to_router_certificates_only() {
    let dir = scratch_dir("tiers-agent-serves-routers");
    let certs = make_certs(&dir, &["--agent", "a1", "--agent", "a2", "--router", "r1"]);
    let (_agent, quic, metrics) = residency_agent(&certs, "a1", &[]);
    assert!(
        served(&client(&certs, "r1"), &quic, "a1", &[]).await,
        "a router's certificate is served"
    );
    for impostor in ["a2", "a1"] {
        assert!(
            !served(&client(&certs, impostor), &quic, "a1", &[]).await,
            "agent certificate {impostor} was served residency"
        );
    }
    // The agent counts a refusal in the connection's own task, which may end after the
    // client saw the handshake fail.
    until(Duration::from_secs(5), "both refusals counted", || async {
        let text = get_text(&metrics).await;
        (metric(&text, "warmpath_agent_residency_refused_total") >= 2.0).then_some(())
    })
    .await;
}

/// Issue 27: an agent serves residency to a bounded number of routers at once, whatever
/// the cluster's size or configuration; a router past the bound is refused and counted, and
/// follows once a place is free (its own reconnect, `net::follow`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_a_bounded_number_of_routers() {
    let dir = scratch_dir("tiers-agent-max-routers");
    let certs = make_certs(
        &dir,
        &[
            "--agent", "a1", "--router", "r1", "--router", "r2", "--router", "r3",
        ],
    );
    let (_agent, quic, metrics) = residency_agent(&certs, "a1", &["--residency-max-routers", "2"]);
    let target = format!("a1@{quic}");
    let (mut r1, stop1) = follow_as(&certs, "r1", &target);
    let (mut r2, _stop2) = follow_as(&certs, "r2", &target);
    assert!(
        snapshot_within(&mut r1, Duration::from_secs(10)).await,
        "r1 served"
    );
    assert!(
        snapshot_within(&mut r2, Duration::from_secs(10)).await,
        "r2 served"
    );
    let (mut r3, _stop3) = follow_as(&certs, "r3", &target);
    assert!(
        !snapshot_within(&mut r3, Duration::from_secs(2)).await,
        "a third router was served past the bound of 2"
    );
    let refused = "warmpath_agent_residency_routers_refused_total";
    assert!(metric(&get_text(&metrics).await, refused) >= 1.0);
    // r1 stops following: r3 gets its place.
    drop(stop1);
    assert!(
        snapshot_within(&mut r3, Duration::from_secs(20)).await,
        "r3 never served after r1 left"
    );
    assert_eq!(
        metric(
            &get_text(&metrics).await,
            "warmpath_agent_residency_subscribers"
        ),
        2.0
    );
}

/// Attack 9: a router following an agent by bare address took any cluster certificate
/// there, a router's included (every certificate had the loopback names). Now the
/// certificate must be an agent's, valid for the name followed; and no certificate has a
/// loopback name unless `warmpath certs --loopback` gave it one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_follows_only_an_agent_certificate_for_the_name_it_follows() {
    let dir = scratch_dir("tiers-router-follows-agents");
    let certs = make_certs(
        &dir,
        &[
            "--agent",
            "a1",
            "--router",
            "r1",
            "--router",
            "r2",
            "--loopback",
        ],
    );
    // A process holding a router's certificate stands where an agent is followed.
    let (_impostor, fake, _) = residency_agent(&certs, "r2", &[]);
    let (_genuine, real, _) = residency_agent(&certs, "a1", &[]);
    for target in [fake.clone(), format!("a1@{fake}"), format!("r2@{fake}")] {
        let (mut rx, _stop) = follow_as(&certs, "r1", &target);
        assert!(
            !snapshot_within(&mut rx, Duration::from_secs(3)).await,
            "followed {target}, which holds a router's certificate"
        );
    }
    for target in [real.clone(), format!("a1@{real}")] {
        let (mut rx, _stop) = follow_as(&certs, "r1", &target);
        assert!(
            snapshot_within(&mut rx, Duration::from_secs(5)).await,
            "did not follow the agent at {target}"
        );
    }
    // A real router following the impostor counts the refused links.
    let router = Proc::start(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--instance",
        "http://127.0.0.1:9",
        "--residency-agent",
        &fake,
        "--tls-dir",
        certs.to_str().unwrap(),
        "--tls-name",
        "r1",
    ]);
    until(
        Duration::from_secs(10),
        "the router to count refused links",
        || async {
            let text = get_text(&format!("{}/metrics", router.url)).await;
            (metric(&text, "warmpath_router_residency_disconnects_total") >= 2.0).then_some(())
        },
    )
    .await;

    // Without --loopback a certificate names only its name: the bare loopback address
    // names no agent, NAME@ does.
    let plain = make_certs(&dir.join("plain"), &["--agent", "a1", "--router", "r1"]);
    let (_agent, at, _) = residency_agent(&plain, "a1", &[]);
    let (mut rx, _stop) = follow_as(&plain, "r1", &at);
    assert!(!snapshot_within(&mut rx, Duration::from_secs(3)).await);
    let (mut rx, _stop) = follow_as(&plain, "r1", &format!("a1@{at}"));
    assert!(snapshot_within(&mut rx, Duration::from_secs(5)).await);
}

/// Attack 8: any cluster certificate could send an agent a tenant table, whoever spoke
/// last won, and a 180,000-entry table was taken. Now a table comes from a router's
/// certificate only, an older configuration version than the one held changes nothing,
/// and a table over the bound is refused, each refusal counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_keeps_the_newest_tenant_table_a_router_sent_within_a_bound() {
    let dir = scratch_dir("tiers-tenant-table");
    let certs = make_certs(&dir, &["--agent", "a1", "--agent", "a2", "--router", "r1"]);
    let (_agent, quic, metrics) = residency_agent(&certs, "a1", &[]);
    let table = |version: u64, entries: &[(&str, &str)]| Reply::TenantsAt {
        version,
        tenants: entries
            .iter()
            .map(|(s, t)| (s.to_string(), t.to_string()))
            .collect(),
    };
    let learned = || async {
        let text = get_text(&metrics).await;
        (
            metric(&text, "warmpath_agent_learned_tenants "),
            metric(&text, "warmpath_agent_learned_tenants_version"),
            metric(
                &text,
                "warmpath_agent_tenant_tables_refused_total{reason=\"stale\"}",
            ),
            metric(
                &text,
                "warmpath_agent_tenant_tables_refused_total{reason=\"too_large\"}",
            ),
        )
    };
    let router = client(&certs, "r1");
    // Another agent's certificate is not served, and its table is not read.
    let mallory = [table(100, &[("s", "mallory")])];
    assert!(!served(&client(&certs, "a2"), &quic, "a1", &mallory).await);
    assert!(
        served(
            &router,
            &quic,
            "a1",
            &[table(7, &[("s1", "acme"), ("s2", "beta")])]
        )
        .await
    );
    let wait = |want: (f64, f64, f64, f64)| {
        let learned = &learned;
        async move {
            until(
                Duration::from_secs(5),
                &format!("the agent at {want:?}"),
                || async {
                    let got = learned().await;
                    (got == want).then_some(())
                },
            )
            .await
        }
    };
    wait((2.0, 7.0, 0.0, 0.0)).await;
    // A router behind (version 3), and a router that predates versions (version 0).
    assert!(served(&router, &quic, "a1", &[table(3, &[("s", "mallory")])]).await);
    let old = Reply::Tenants(vec![("s".into(), "mallory".into())]);
    assert!(served(&router, &quic, "a1", &[old]).await);
    wait((2.0, 7.0, 2.0, 0.0)).await;
    // 70,000 entries: over the bound, whatever its version.
    let many: Vec<(String, String)> = (0..70_000)
        .map(|i| (format!("s{i}"), format!("t{i}")))
        .collect();
    let huge = Reply::TenantsAt {
        version: 8,
        tenants: many,
    };
    assert!(served(&router, &quic, "a1", &[huge]).await);
    wait((2.0, 7.0, 2.0, 1.0)).await;
    // A newer version replaces the table.
    assert!(served(&router, &quic, "a1", &[table(9, &[("s3", "gamma")])]).await);
    wait((1.0, 9.0, 2.0, 1.0)).await;
}

/// Attack 10, in part: one delta was never split, so past about 175,000 changes it
/// exceeded the 4 MiB a router reads and every router dropped the link (and took a new
/// snapshot). 250,000 blocks stored in one KV-event batch now reach a follower as deltas
/// on one link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_too_large_for_one_message_reaches_a_router_in_pieces() {
    const BLOCKS: u64 = 250_000;
    // One token a block: the batch decodes quickly even in a debug build.
    const BLOCK: u32 = 1;
    let dir = scratch_dir("tiers-split-delta");
    let certs = make_certs(&dir, &["--agent", "a1", "--router", "r1"]);
    let events = format!("tcp://{}", crate::free_addr());
    let mut engine = zeromq::PubSocket::new();
    engine.bind(&events).await.expect("bind the publisher");
    let kv = format!("http://engine={events}");
    // Every block reported: 250,000 changes, more than one delta carries (with one key in
    // 4 reported, as of 16-token blocks, records 0115 and 0117, they would fit in one).
    let (_agent, quic, _) = residency_agent(
        &certs,
        "a1",
        &["--kv-events", &kv, "--residency-every-block"],
    );
    let (mut rx, _stop) = follow_as(&certs, "r1", &format!("a1@{quic}"));
    assert!(snapshot_within(&mut rx, Duration::from_secs(5)).await);
    let stored = |first: u64, n: u64| KvEvent::Stored {
        block_hashes: (first..first + n)
            .map(|h| EngineHash(h.to_be_bytes().to_vec()))
            .collect(),
        parent: None,
        // Token ids under 128: one byte each in msgpack, so the batch stays under the
        // agent's 16 MiB.
        token_ids: (0..n * u64::from(BLOCK))
            .map(|t| (t % 100) as u32)
            .collect(),
        block_size: BLOCK,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: vec![],
    };
    let publish = |seq: u64, e: KvEvent| {
        let payload = encode_batch(0.0, &[e], Shape::Array);
        ZmqMessage::try_from(message(seq, Bytes::from(payload))).expect("frames")
    };
    // Until the agent is subscribed: one block, again, until a delta shows it.
    let mut seq = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    'joined: loop {
        assert!(Instant::now() < deadline, "the agent never applied a batch");
        let mut one = stored(1 << 40, 1);
        if let KvEvent::Stored { token_ids, .. } = &mut one {
            // A token the large batch has not: a block of its own.
            *token_ids = vec![127];
        }
        engine.send(publish(seq, one)).await.unwrap();
        seq += 1;
        let until = tokio::time::Instant::now() + Duration::from_millis(300);
        while let Ok(Some(o)) = tokio::time::timeout_at(until, rx.recv()).await {
            if matches!(&o, Outcome::Apply { sent_ms: Some(_), changes, .. } if !changes.is_empty())
            {
                break 'joined;
            }
        }
    }
    engine.send(publish(seq, stored(0, BLOCKS))).await.unwrap();
    let mut added = 0u64;
    let mut deltas = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while added < BLOCKS {
        let o = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{added} of {BLOCKS} blocks arrived"))
            .expect("the follower runs");
        match o {
            Outcome::Apply {
                sent_ms: Some(_),
                changes,
                ..
            } => {
                deltas += 1;
                added += changes.iter().filter(|c| c.present).count() as u64;
            }
            Outcome::Nothing => {}
            other => panic!(
                "the link was dropped after {added} blocks in {deltas} deltas: {}",
                match other {
                    Outcome::Apply { .. } => "a new snapshot",
                    _ => "a reset",
                }
            ),
        }
    }
    assert!(deltas >= 4, "{deltas} deltas");
}

/// Attack 10: one KV-event frame of 1 GiB was read whole before the agent's own bound
/// refused it (RSS 39 MB to 1.09 GB, and it stayed). An "engine" that announces such a
/// frame and sends 256 MiB of it now has its connection closed at the frame's header,
/// counted, and the agent's memory does not grow by what it sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_event_frame_over_the_bound_is_refused_before_it_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    let kv = format!("http://engine=tcp://{at}");
    let agent = Proc::start_lines(
        &[
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--kv-events",
            &kv,
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        2,
        "warn",
    );
    let metrics = agent.lines[1]
        .split("metrics on ")
        .nth(1)
        .expect("the metrics line")
        .trim()
        .to_string();
    let rss_kb = |pid: u32| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS")
    };
    // A ZMQ PUB as far as the agent can tell: greeting, READY, its subscription read.
    let (mut engine, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("the agent connects")
        .unwrap();
    let mut greeting = [0u8; 64];
    greeting[0] = 0xFF;
    greeting[9] = 0x7F;
    greeting[10] = 3;
    greeting[12..16].copy_from_slice(b"NULL");
    engine.write_all(&greeting).await.unwrap();
    let mut ready = vec![0x04, 0];
    ready.extend_from_slice(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
    ready[1] = (ready.len() - 2) as u8;
    engine.write_all(&ready).await.unwrap();
    let mut theirs = [0u8; 64];
    engine.read_exact(&mut theirs).await.unwrap();
    for _ in 0..2 {
        // Their READY, then their subscription: short frames.
        let mut head = [0u8; 2];
        engine.read_exact(&mut head).await.unwrap();
        let mut body = vec![0u8; head[1] as usize];
        engine.read_exact(&mut body).await.unwrap();
    }
    let before = rss_kb(agent.pid());
    // A frame of 1 GiB announced, and 256 MiB of it sent while the agent reads.
    let mut head = vec![0x02];
    head.extend_from_slice(&(1u64 << 30).to_be_bytes());
    engine.write_all(&head).await.unwrap();
    let chunk = vec![0u8; 1 << 20];
    let mut sent = 0;
    for _ in 0..256 {
        match tokio::time::timeout(Duration::from_secs(5), engine.write_all(&chunk)).await {
            Ok(Ok(())) => sent += 1,
            _ => break,
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown_mb = rss_kb(agent.pid()).saturating_sub(before) / 1024;
    assert!(
        grown_mb < 64,
        "the agent grew {grown_mb} MB on a refused frame ({sent} MiB sent)"
    );
    until(Duration::from_secs(5), "the refusal counted", || async {
        let text = get_text(&metrics).await;
        (metric(
            &text,
            "warmpath_agent_kv_batches_total{result=\"too_large\"}",
        ) >= 1.0)
            .then_some(())
    })
    .await;
}

/// Attack 6: the Raft directory was 0755 and `raft.redb` 0644 (API-key hashes and cache
/// salts readable by any local user), and so was the agent's directory L2. Now every store
/// warmpath writes is 0700 directories and 0600 files, and a store an older release left
/// open is closed at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_warmpath_writes_is_its_owners_only() {
    let dir = scratch_dir("tiers-file-modes");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let open =
        |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();

    // Certificates: the directory made 0700, keys 0600 even where an older key file was
    // 0644.
    let tls = make_certs(&dir, &["--agent", "a1", "--router", "r1"]);
    assert_eq!(mode(&tls), 0o700);
    open(&tls.join("a1.key"), 0o644);
    make_certs(&dir, &["--agent", "a1", "--router", "r1"]);
    for key in ["ca.key", "a1.key", "r1.key"] {
        assert_eq!(mode(&tls.join(key)), 0o600, "{key}");
    }

    // Raft: a single voter, then again over the store opened up as an older release left
    // it.
    let raft = dir.join("raft");
    let token = dir.join("admin.token");
    std::fs::write(&token, "t0ken-t0ken-t0ken-t0ken-t0ken-t0ken").unwrap();
    let router = || {
        let admin = crate::free_addr().to_string();
        let voter = format!("1=http://{admin}");
        Proc::start(&[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--raft-node-id",
            "1",
            "--raft-dir",
            raft.to_str().unwrap(),
            "--admin-listen",
            &admin,
            "--admin-token-file",
            token.to_str().unwrap(),
            "--voter",
            &voter,
            "--insecure-raft-without-peer-token",
        ])
    };
    let store = raft.join("raft.redb");
    {
        let _r = router();
        until(Duration::from_secs(10), "the Raft store", || async {
            store.exists().then_some(())
        })
        .await;
        assert_eq!((mode(&raft), mode(&store)), (0o700, 0o600));
    }
    open(&raft, 0o755);
    open(&store, 0o644);
    {
        let _r = router();
        until(
            Duration::from_secs(10),
            "the Raft store closed again",
            || async { (mode(&raft) == 0o700 && mode(&store) == 0o600).then_some(()) },
        )
        .await;
    }

    // The agent's directory L2: a block written through to it is the owner's only.
    let l2 = dir.join("l2");
    let (mut agent, addr) = {
        let l2_flag = format!("dir:{}", l2.display());
        let p = Proc::start(&[
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--l2",
            &l2_flag,
            "--l2-write",
            "through",
        ]);
        let addr = warmpath_cache_agent::client::AgentAddr::Tcp(p.url.clone());
        (p, addr)
    };
    let c = warmpath_cache_agent::client::AgentClient::connect(&addr, "", Duration::from_secs(5))
        .await
        .expect("the agent");
    let layout = 7;
    c.put(layout, vec![(1, Bytes::from_static(&[1u8; 4096]), false)])
        .await
        .expect("a put");
    let objects = until(Duration::from_secs(10), "the block in L2", || async {
        let found: Vec<PathBuf> = walk(&l2).into_iter().filter(|p| p.is_file()).collect();
        (!found.is_empty()).then_some(found)
    })
    .await;
    assert_eq!(mode(&l2), 0o700);
    for p in walk(&l2) {
        let want = if p.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode(&p), want, "{}", p.display());
    }
    assert!(!objects.is_empty());
    agent.kill();
}

/// Every path under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

/// What `tests/clients/residency_quic.py` (aioquic, in the tests' venv) saw connecting to
/// the agent at `target` (`NAME@HOST:PORT`) trusting `ca`, presenting `cert` (a
/// certificate and key of `warmpath certs`, or none) and offering `alpn`: its JSON line.
fn aioquic(target: &str, ca: &Path, cert: Option<(&Path, &str)>, alpn: &str) -> serde_json::Value {
    let python = crate::test_venv().join("bin/python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/clients/residency_quic.py");
    let (cert, key) = match cert {
        Some((dir, name)) => (
            dir.join(format!("{name}.pem")).display().to_string(),
            dir.join(format!("{name}.key")).display().to_string(),
        ),
        None => ("-".into(), "-".into()),
    };
    let out = tokio::task::block_in_place(|| {
        std::process::Command::new(python)
            .arg(script)
            .args([target, ca.to_str().unwrap(), &cert, &key, alpn])
            .output()
            .expect("the venv's python runs")
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"))
}

/// Attacks 7 and 9 again, by a QUIC implementation that is not the agent's own (quinn):
/// aioquic, which builds its own TLS 1.3. With a router's certificate it is served, and
/// decodes the snapshot frame (length prefix, postcard of `Wire::V1Msg(Msg::Snapshot)`)
/// itself. With another agent's certificate, the agent's own, none, or a router's of
/// another CA, aioquic finishes its side of the handshake (in TLS 1.3 a client is done
/// before the server checks the client's certificate) and the agent then fails it with a
/// TLS alert, in QUIC a CONNECTION_CLOSE of crypto error 0x100 + alert: it never confirms
/// the handshake, never accepts a stream, and not one byte of residency reaches the
/// client. A build that served any cluster certificate would fail at the agents'
/// certificates below (`served`, `confirmed`, and the `access_denied` alert).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_quic_implementation_is_served_with_a_router_certificate_only() {
    let dir = scratch_dir("tiers-aioquic");
    let certs = make_certs(&dir, &["--agent", "a1", "--agent", "a2", "--router", "r1"]);
    // A second CA, with a router certificate of the same name.
    let other = make_certs(&dir.join("other"), &["--router", "r1"]);
    let (agent, quic, metrics) = residency_agent(&certs, "a1", &[]);
    // One block in the agent's L1, for the snapshot to carry.
    // A key the agent reports at 16-token blocks' rate as at every block (records 0115,
    // 0117).
    const KEY: u64 = 0x00C1_0013;
    assert!(warmpath_index::keys::reported(
        warmpath_index::keys::BlockKey(KEY),
        warmpath_index::keys::report_every(16)
    ));
    let addr = warmpath_cache_agent::client::AgentAddr::Tcp(agent.url.clone());
    let c = warmpath_cache_agent::client::AgentClient::connect(&addr, "", Duration::from_secs(5))
        .await
        .expect("the agent");
    c.put(7, vec![(KEY, Bytes::from_static(&[7u8; 4096]), false)])
        .await
        .expect("a put");

    let target = format!("a1@{quic}");
    let ca = certs.join("ca.pem");
    let alpn = std::str::from_utf8(warmpath_residency::tls::ALPN).unwrap();

    // (a) A router's certificate: the handshake is confirmed and the first frame is a
    // whole snapshot, the block put above in it.
    let router = aioquic(&target, &ca, Some((&certs, "r1")), alpn);
    let frame = &router["frame"];
    assert!(
        router["served"] == true && router["confirmed"] == true && router["alpn"] == alpn,
        "{router}"
    );
    assert!(
        frame["well_formed"] == true && frame["kind"] == "snapshot" && frame["last"] == true,
        "{router}"
    );
    assert!(
        router["stream_bytes"].as_u64().unwrap() >= 4 + frame["length"].as_u64().unwrap(),
        "{router}"
    );
    assert_eq!(
        frame["blocks"],
        serde_json::json!([["L1", KEY, null]]),
        "{router}"
    );
    assert!(router["closed"].is_null(), "{router}");
    // A router that offers version 1 of the link only (an older build) gets version 1
    // (record 0123).
    assert!(
        metric(
            &get_text(&metrics).await,
            "warmpath_agent_residency_links_total{version=\"1\"}"
        ) >= 1.0
    );

    // The refusals: the agent closes the connection in the handshake, with `alert`.
    let refused = |seen: &serde_json::Value, alerts: &[&str], what: &str| {
        assert!(
            seen["served"] == false && seen["stream_bytes"] == 0 && seen["frame"].is_null(),
            "{what} was served residency: {seen}"
        );
        assert!(
            seen["confirmed"] == false,
            "{what}: the agent confirmed the handshake: {seen}"
        );
        let closed = &seen["closed"];
        assert_eq!(closed["by"], "peer", "{what}: {seen}");
        let alert = closed["tls_alert"][1].as_str().unwrap_or("none");
        assert!(
            alerts.contains(&alert),
            "{what}: alert {alert}, not one of {alerts:?}: {seen}"
        );
    };
    // (b), (c) Another agent's certificate, and the agent's own: of the cluster CA, so
    // the chain is good; the role is not a router's.
    for name in ["a2", "a1"] {
        let seen = aioquic(&target, &ca, Some((&certs, name)), alpn);
        assert!(seen["finished"] == true, "{seen}");
        refused(
            &seen,
            &["access_denied"],
            &format!("agent certificate {name}"),
        );
    }
    // (d) No certificate.
    let seen = aioquic(&target, &ca, None, alpn);
    refused(&seen, &["certificate_required"], "no certificate");
    // (e) A router's certificate of another CA. Both development CAs have one subject
    // name, so the agent finds "its" issuer by name and the signature fails
    // (decrypt_error); a CA of another name gives unknown_ca.
    let seen = aioquic(&target, &ca, Some((&other, "r1")), alpn);
    refused(
        &seen,
        &["decrypt_error", "unknown_ca"],
        "a router certificate of another CA",
    );
    // And a router's certificate offering another protocol: refused at its ClientHello.
    let seen = aioquic(&target, &ca, Some((&certs, "r1")), "h3");
    assert!(seen["finished"] == false, "{seen}");
    refused(&seen, &["no_application_protocol"], "ALPN h3");

    // Every refusal counted by the agent.
    until(Duration::from_secs(5), "five refusals counted", || async {
        let text = get_text(&metrics).await;
        (metric(&text, "warmpath_agent_residency_refused_total") >= 5.0).then_some(())
    })
    .await;
}
