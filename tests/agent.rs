//! The cache-agent end to end: real `warmpath agent` processes, a real `redis-server`, real
//! engine-sims offloading to the agent, and the block API spoken over real TCP and Unix
//! sockets by the crate's own client (and by hand, for the bad input).

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warmpath_cache_agent::client::{AgentAddr, AgentClient};
use warmpath_cache_agent::proto::{self, PutRefusal, Request, Response, StoreTier};
use warmpath_cache_agent::resp;

use crate::router::{client, completion, get_text, long_prompt, post};
use crate::{scratch_dir, Proc, Redis};

pub(crate) const LAYOUT: u64 = 7;
pub(crate) const TIMEOUT: Duration = Duration::from_secs(5);

/// Starts an agent with `extra` flags on a loopback port; returns it and its address.
pub(crate) fn agent(extra: &[&str]) -> (Proc, AgentAddr) {
    let mut args = vec!["agent", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let p = Proc::start(&args);
    let addr = AgentAddr::Tcp(p.url.clone());
    (p, addr)
}

/// An agent on a Unix socket in a scratch directory named `name` as well as on TCP, serving
/// metrics, with `extra` flags: it, its TCP address, its socket's path and its metrics URL.
fn agent_on_unix(name: &str, extra: &[&str]) -> (Proc, AgentAddr, std::path::PathBuf, String) {
    let sock = scratch_dir(name).join("agent.sock");
    let mut args = vec!["--unix", sock.to_str().expect("a UTF-8 path")];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--metrics-listen", "127.0.0.1:0"]);
    let (mut p, addr) = agent(&args);
    let unix_line = p.read_line();
    assert!(unix_line.contains("unix:"), "{unix_line}");
    let metrics_url = metrics_url_of(&mut p);
    (p, addr, sock, metrics_url)
}

/// An engine-sim (50× speed-up) of 64 GPU blocks of 16 tokens (a prompt of 600 words holds
/// about 40) offloading to the agent at `agent_at`, its blocks' bytes scaled by `scale`.
fn offloading_engine(agent_at: &str, scale: &str) -> Proc {
    crate::engine_sim(
        "50",
        &[
            "--gpu-kv-tokens",
            "1024",
            "--agent",
            agent_at,
            "--agent-block-scale",
            scale,
        ],
    )
}

/// The metrics address an agent started with `--metrics-listen` prints next.
fn metrics_url_of(agent: &mut Proc) -> String {
    agent
        .read_line()
        .split("metrics on ")
        .nth(1)
        .expect("the metrics address")
        .trim()
        .to_string()
}

async fn connect(addr: &AgentAddr) -> AgentClient {
    AgentClient::connect(addr, "", TIMEOUT)
        .await
        .expect("the agent accepts a connection")
}

/// A block's payload: its key, repeated.
pub(crate) fn payload(key: u64, len: usize) -> Bytes {
    key.to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(len)
        .collect()
}

async fn put_chain(c: &AgentClient, keys: std::ops::Range<u64>, len: usize) {
    let blocks = keys.map(|k| (k, payload(k, len), false)).collect();
    let r = c.put(LAYOUT, blocks).await.expect("put");
    assert!(r.refused.is_empty(), "{r:?}");
}

/// Posts a completion of `long_prompt(seed)` for `max_tokens` tokens to `url`; it must
/// succeed.
async fn complete_long(
    http: &crate::router::HttpClient,
    url: &str,
    seed: u64,
    max_tokens: u32,
) -> crate::router::Reply {
    let body = completion(&long_prompt(seed), max_tokens, false);
    let r = post(http, url, "/v1/completions", body, &[]).await;
    assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    r
}

/// Posts a fresh completion (`long_prompt(seed)`, one token) to `url`; it must succeed.
async fn post_fresh(http: &crate::router::HttpClient, url: &str, seed: u64) {
    complete_long(http, url, seed, 1).await;
}

/// The prefetch tests' prompt `seed`: about 530 tokens, 33 of the 64 GPU blocks of an
/// engine from [`Residency::start_offloading`].
fn short_prompt(seed: u64) -> String {
    warmpath_index::text::words(seed, 300)
}

/// Completes [`short_prompt`] `seed` through the router at `url`; it must succeed.
async fn complete_short(http: &crate::router::HttpClient, url: &str, seed: u64) {
    let body = completion(&short_prompt(seed), 1, false);
    let done = post(http, url, "/v1/completions", body, &[]).await;
    assert_eq!(done.status, 200, "{}", String::from_utf8_lossy(&done.body));
}

/// What the router at `url` (started with `--fault-injection`) would do with
/// [`short_prompt`] `seed`, without doing it: a dry run changes nothing and sends no hint.
async fn dry_route(http: &crate::router::HttpClient, url: &str, seed: u64) -> Value {
    let body = completion(&short_prompt(seed), 1, false);
    let dry = post(http, url, "/debug/route", body, &[]).await;
    assert_eq!(dry.status, 200);
    serde_json::from_slice(&dry.body).expect("explain JSON")
}

/// Prompt 1 through the router at `feeder`, then others, until the router at `router` sees
/// it in L2 only (an offloading engine's GPU and its agent's small L1 have let it go).
async fn into_l2_only(http: &crate::router::HttpClient, feeder: &str, router: &str) {
    complete_short(http, feeder, 1).await;
    let wait = Duration::from_secs(30);
    eventually_within(
        wait,
        "prompt 1 in L2 only, as the router sees it",
        || async {
            for seed in 2..6 {
                complete_short(http, feeder, seed).await;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            let m = &dry_route(http, router, 1).await["matched"];
            m["l2_observed"].as_u64().unwrap_or(0) >= 16
                && m["l1_observed"].as_u64().unwrap_or(0) == 0
        },
    )
    .await;
}

/// The agent's counter `name{result="RESULT"}`, from its metrics at `url`.
async fn agent_counter(url: &str, name: &str, result: &str) -> f64 {
    let series = format!("{name}{{result=\"{result}\"}}");
    crate::router::metric(&get_text(url).await, &series)
}

/// Blocks of routers' prefetch hints the agent at `url` counted as `result` (`loaded`,
/// `in_l1`, `miss`, `dropped`).
async fn prefetch_blocks(url: &str, result: &str) -> f64 {
    use warmpath_cache_agent::metric_names::AGENT_PREFETCH_BLOCKS_TOTAL;
    agent_counter(url, AGENT_PREFETCH_BLOCKS_TOTAL, result).await
}

/// Hinted blocks the agent at `url` found: read from L2, or already in L1 (loaded there
/// by an earlier hint, or offloaded there by an engine).
async fn prefetch_found(url: &str) -> f64 {
    prefetch_blocks(url, "loaded").await + prefetch_blocks(url, "in_l1").await
}

/// An agent writing through to the Redis at `redis` with an L1 of about 30 of an offloading
/// engine's 2 KiB blocks (the latest prompt's), reporting every block, with its metrics.
fn small_l1_over_redis(redis: &str) -> [&str; 9] {
    [
        "--l1-bytes",
        "64KiB",
        "--l2",
        redis,
        "--l2-write",
        "through",
        "--residency-every-block",
        "--metrics-listen",
        "127.0.0.1:0",
    ]
}

/// The (instance, block) pairs the router at `url` holds as observed (from agents).
async fn observed_holders(url: &str) -> f64 {
    crate::router::metric(
        &get_text(&format!("{url}/metrics")).await,
        "warmpath_index_holders{source=\"observed\"}",
    )
}

/// Sends fresh prompts (`long_prompt(base + 1)`, `base + 2`, …) through `ask` until the
/// agent behind `c` has stored one (its residency grew), for at most 15 s; returns that
/// prompt. A KV-event publisher drops what it sends before its subscriber joined, so the
/// first prompts may go unseen.
async fn first_stored_prompt<F, Fut>(c: &AgentClient, base: u64, mut ask: F) -> String
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    for seed in base + 1.. {
        let p = long_prompt(seed);
        let before = c.stats().await.unwrap().residency_blocks;
        ask(p.clone()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        if c.stats().await.unwrap().residency_blocks > before {
            return p;
        }
        assert!(Instant::now() < deadline, "the agent never saw a store");
    }
    unreachable!()
}

async fn eventually<F, Fut>(what: &str, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_within(Duration::from_secs(10), what, f).await
}

/// Waits (within `within`) until `value` holds still for 300 ms: until what is under way
/// (offloads, lookups) has landed.
async fn settled<F, Fut>(within: Duration, what: &str, mut value: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let deadline = Instant::now() + within;
    let mut last = value().await;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = value().await;
        if now == last {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        last = now;
    }
}

/// [`eventually`], within `within`: for a wait of several steps through several processes.
async fn eventually_within<F, Fut>(within: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_go_through_l1_and_redis_over_tcp_and_unix() {
    let redis = Redis::start();
    let (_agent, addr, sock, metrics_url) = agent_on_unix(
        "agent-tiers",
        &["--l1-bytes", "64KiB", "--l2", &redis.url()],
    );

    let c = connect(&addr).await;
    // Eight 16 KiB blocks into a 64 KiB L1: four stay, four go to Redis when evicted.
    put_chain(&c, 1..9, 16 << 10).await;
    let keys: Vec<u64> = (1..9).collect();
    eventually("evicted blocks written to redis", || async {
        let (lease, tiers) = c.lookup(LAYOUT, keys.clone(), TIMEOUT).await.unwrap();
        c.release(lease).await.unwrap();
        tiers.len() == 8
    })
    .await;
    let (lease, tiers) = c.lookup(LAYOUT, keys.clone(), TIMEOUT).await.unwrap();
    assert_eq!(tiers.iter().filter(|t| **t == StoreTier::L1).count(), 4);
    // The chain's head outlives its tail in L1: the first blocks were written last.
    assert_eq!(tiers[..4], [StoreTier::L1; 4], "{tiers:?}");
    assert_eq!(c.release(lease).await.unwrap(), 4);

    let got = c.get(LAYOUT, keys.clone()).await.unwrap();
    for (k, g) in keys.iter().zip(&got) {
        let g = g.as_ref().expect("every block is served");
        assert_eq!(g.payload, payload(*k, 16 << 10), "block {k}");
    }
    assert!(got.iter().flatten().any(|g| g.tier == StoreTier::L2));
    // A block nobody stored is a miss.
    assert_eq!(c.get(LAYOUT, vec![99]).await.unwrap(), vec![None]);

    // The same agent over its Unix socket.
    let u = connect(&AgentAddr::Unix(sock.clone())).await;
    let got = u.get(LAYOUT, vec![1]).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap().payload, payload(1, 16 << 10));
    let stats = u.stats().await.unwrap();
    assert!(stats.l2_hits >= 4 && stats.l1_hits >= 1, "{stats:?}");
    assert!(stats.l1.bytes <= 64 << 10, "{stats:?}");

    let text = get_text(&metrics_url).await;
    for want in [
        "warmpath_agent_hits_total{tier=\"l2\"}",
        "warmpath_agent_occupancy_bytes{tier=\"l1\"}",
        "warmpath_agent_evictions_total{tier=\"l1\"}",
        "warmpath_agent_op_duration_seconds_bucket{op=\"get\",le=\"0.001\"}",
    ] {
        assert!(text.contains(want), "{want} missing from\n{text}");
    }
    drop(redis);
}

/// The tiers a lookup of `keys` finds them in (its lease released).
async fn tiers_of(c: &AgentClient, keys: &[u64]) -> Vec<StoreTier> {
    let (lease, tiers) = c.lookup(LAYOUT, keys.to_vec(), TIMEOUT).await.unwrap();
    c.release(lease).await.unwrap();
    tiers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_l2_read_goes_into_l1_only_where_the_agent_promotes_reads() {
    let keys: Vec<u64> = (1..9).collect();
    let (l1, l2) = ([StoreTier::L1; 4], [StoreTier::L2; 4]);
    for (promote, name) in [(false, "agent-no-promote"), (true, "agent-promote")] {
        let redis = Redis::start();
        let url = redis.url();
        let mut args = vec!["--l1-bytes", "64KiB", "--l2", &url];
        if promote {
            args.push("--l2-promote-reads");
        }
        let (_agent, addr, _sock, _metrics) = agent_on_unix(name, &args);
        let c = connect(&addr).await;
        // Eight 16 KiB blocks into a 64 KiB L1: the head stays, the tail goes to Redis.
        put_chain(&c, 1..9, 16 << 10).await;
        eventually("evicted blocks written to redis", || async {
            tiers_of(&c, &keys).await.len() == 8
        })
        .await;
        assert_eq!(tiers_of(&c, &keys).await, [l1, l2].concat());
        let got = c.get(LAYOUT, keys[4..].to_vec()).await.unwrap();
        assert!(got
            .iter()
            .all(|g| g.as_ref().unwrap().tier == StoreTier::L2));
        // Promoted, the tail displaces the head from L1 (which goes to Redis); else the
        // read leaves L1 as it was.
        let want = if promote { [l2, l1] } else { [l1, l2] };
        eventually("the tiers after the read", || async {
            tiers_of(&c, &keys).await == want.concat()
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_costs_counted_errors_and_l2_comes_back() {
    let mut redis = Redis::start();
    let port = redis.port;
    let (_agent, addr) = agent(&["--l1-bytes", "32KiB", "--l2", &redis.url()]);
    let c = connect(&addr).await;
    put_chain(&c, 1..5, 16 << 10).await;
    eventually("blocks 3 and 4 in redis", || async {
        let (lease, tiers) = c.lookup(LAYOUT, vec![1, 2, 3, 4], TIMEOUT).await.unwrap();
        c.release(lease).await.unwrap();
        tiers.len() == 4
    })
    .await;

    redis.stop();
    // L1 goes on serving; what only Redis had is a fast, counted miss.
    let started = Instant::now();
    let got = c.get(LAYOUT, vec![1, 2, 3, 4]).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let served: Vec<bool> = got.iter().map(Option::is_some).collect();
    assert_eq!(served.iter().filter(|s| **s).count(), 2, "{served:?}");
    put_chain(&c, 10..12, 16 << 10).await;
    let stats = c.stats().await.unwrap();
    assert!(stats.l2_errors > 0, "{stats:?}");

    // Redis returns (empty: no persistence); after the back-off, L2 works again.
    let _redis = Redis::start_on(port);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut next = 20;
    eventually("l2 writes and reads after redis came back", || {
        let c = &c;
        next += 4;
        let keys = next..next + 4;
        async move {
            put_chain(c, keys.clone(), 16 << 10).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            let got = c.get(LAYOUT, keys.collect()).await.unwrap();
            got.iter().flatten().any(|g| g.tier == StoreTier::L2)
        }
    })
    .await;
}

/// Sends `args` to the Redis server at `port` on a connection of its own (after `auth`, if
/// given) and returns the reply.
async fn redis_raw(port: u16, auth: Option<&str>, args: &[&[u8]]) -> resp::Reply {
    let mut s = tokio::io::BufReader::new(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap(),
    );
    let mut cmd = Vec::new();
    if let Some(password) = auth {
        resp::command(&mut cmd, &[b"AUTH", password.as_bytes()]);
    }
    resp::command(&mut cmd, args);
    s.write_all(&cmd).await.unwrap();
    if auth.is_some() {
        resp::read_reply(&mut s, 1 << 20).await.unwrap();
    }
    resp::read_reply(&mut s, 1 << 20).await.unwrap()
}

/// Issue 24's own Redis client (record 0099): it logs in with the URL's password, works in
/// the URL's database, reads back what it wrote byte for byte, and when Redis closes its
/// idle connections (a restart, a `timeout`, an operator's `CLIENT KILL`) the next
/// operation goes through on a new connection, without an error; a wrong password is an
/// error and then the back-off, never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_backend_logs_in_keeps_to_its_database_and_outlives_killed_connections() {
    use warmpath_cache_agent::block::{decode_object, Block};
    use warmpath_cache_agent::l2::{L2Backend, L2Error, RedisL2};
    use warmpath_tiers::BlockId;

    let redis = Redis::start();
    let port = redis.port;
    let set = redis_raw(port, None, &[b"CONFIG", b"SET", b"requirepass", b"s3cret"]).await;
    assert_eq!(set, resp::Reply::Simple("OK".into()));
    let url = |auth: &str, db: u32| format!("redis://:{auth}@127.0.0.1:{port}/{db}");
    let deadline = Duration::from_secs(2);
    let l2 = RedisL2::new(&url("s3cret", 3), "t:", deadline).unwrap();

    let ids: Vec<BlockId> = (0..8).map(|k| BlockId::new(LAYOUT, k)).collect();
    let blocks: Vec<Block> = (0..8u64)
        .map(|k| Block::new(payload(k, 100_000 + k as usize)))
        .collect();
    let puts = ids.iter().zip(&blocks).map(|(id, b)| l2.put_block(*id, b));
    for r in futures_util::future::join_all(puts).await {
        r.unwrap();
    }
    for (id, b) in ids.iter().zip(&blocks) {
        let got = l2.get(*id).await.unwrap().expect("stored");
        assert_eq!(decode_object(id, got).unwrap(), *b);
    }
    let missing = BlockId::new(LAYOUT, 99);
    assert_eq!(l2.get(missing).await.unwrap(), None);
    assert_eq!(
        l2.contains(&[ids[0], missing, ids[7]]).await.unwrap(),
        vec![true, false, true]
    );
    // In database 3: database 0 does not hold them.
    let key = format!("t:{LAYOUT:016x}:{:016x}", 0);
    let in_db0 = redis_raw(port, Some("s3cret"), &[b"EXISTS", key.as_bytes()]).await;
    assert_eq!(in_db0, resp::Reply::Integer(0));

    // Redis drops every other client's connection: the pooled ones are dead.
    let killed = redis_raw(
        port,
        Some("s3cret"),
        &[b"CLIENT", b"KILL", b"TYPE", b"normal"],
    )
    .await;
    assert!(
        matches!(killed, resp::Reply::Integer(n) if n > 0),
        "{killed:?}"
    );
    l2.remove(ids[0]).await.unwrap();
    assert_eq!(l2.get(ids[0]).await.unwrap(), None);
    assert!(l2.get(ids[1]).await.unwrap().is_some());

    // A wrong password: an error, and the back-off after it.
    let wrong = RedisL2::new(&url("wrong", 3), "t:", deadline).unwrap();
    let started = Instant::now();
    assert!(matches!(wrong.get(ids[1]).await, Err(L2Error::Redis(_))));
    assert!(matches!(wrong.get(ids[1]).await, Err(L2Error::Backoff(_))));
    assert!(started.elapsed() < deadline);
    drop(redis);
}

/// A burst of L2 operations (an engine's get of a long chain that L1 lacks) shares a
/// bounded set of connections: the backend runs at most 32 at once, the rest wait their
/// turn, and every one succeeds. Before, each opened a connection of its own, and on a
/// loaded host hundreds at once ran past their deadline and put L2 in back-off (the live
/// `longdoc` demo's lost prefetches, record 0127). And one late answer costs only its own
/// operation: L2 backs off after three in a row (or at once when the server cannot be
/// reached).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_l2_reads_shares_a_bounded_set_of_connections() {
    use warmpath_cache_agent::block::Block;
    use warmpath_cache_agent::l2::{L2Backend, RedisL2};
    use warmpath_tiers::BlockId;

    let redis = Redis::start();
    let connections = || async {
        let info = redis_raw(redis.port, None, &[b"INFO", b"stats"]).await;
        let resp::Reply::Bulk(Some(text)) = info else {
            panic!("{info:?}")
        };
        String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .expect("total_connections_received")
    };
    let l2 = RedisL2::new(&redis.url(), "t:", Duration::from_secs(5)).unwrap();
    let ids: Vec<BlockId> = (0..600).map(|k| BlockId::new(LAYOUT, k)).collect();
    let block = Block::new(payload(1, 8 << 10));
    let before = connections().await;
    let puts = futures_util::future::join_all(ids.iter().map(|id| l2.put_block(*id, &block))).await;
    assert!(puts.iter().all(Result::is_ok));
    let gets = futures_util::future::join_all(ids.iter().map(|id| l2.get(*id))).await;
    assert!(gets.iter().all(|g| matches!(g, Ok(Some(_)))));
    // Our INFO calls are a connection each.
    let opened = connections().await - before - 1;
    assert!(opened <= 32, "{opened} connections for 1,200 operations");

    // One late answer (the server busy for a second in a script) fails that operation
    // alone: the next one, as soon as the script ends (within the second of back-off one
    // late answer used to cost), goes through.
    let quick = RedisL2::new(&redis.url(), "t:", Duration::from_millis(300)).unwrap();
    let port = redis.port;
    let busy = tokio::spawn(async move {
        let script: &[u8] = b"local t = redis.call('TIME') \
            local t0 = t[1] * 1000000 + t[2] \
            while true do \
              local n = redis.call('TIME') \
              if n[1] * 1000000 + n[2] - t0 > 1000000 then break end \
            end \
            return 1";
        redis_raw(port, None, &[b"EVAL", script, b"0"]).await
    });
    // The script runs once a PING goes unanswered (on a loaded machine the spawn may
    // take a while).
    eventually("the server busy in the script", || async {
        let ping = redis_raw(port, None, &[b"PING"]);
        tokio::time::timeout(Duration::from_millis(50), ping)
            .await
            .is_err()
    })
    .await;
    let late = quick.get(ids[1]).await;
    assert!(
        matches!(&late, Err(warmpath_cache_agent::l2::L2Error::Redis(m)) if m.contains("no answer")),
        "{late:?}"
    );
    assert_eq!(busy.await.unwrap(), resp::Reply::Integer(1));
    assert!(quick.get(ids[2]).await.unwrap().is_some());
}

/// Runs a raw handshake and returns (status, message).
async fn raw_hello(addr: &str, hello: &[u8]) -> (u8, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(hello).await.unwrap();
    let mut prefix = [0u8; 9];
    s.read_exact(&mut prefix).await.unwrap();
    let (_, status, len) = proto::decode_welcome_prefix(&prefix).unwrap();
    let mut msg = vec![0u8; len];
    s.read_exact(&mut msg).await.unwrap();
    (status, String::from_utf8(msg).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_never_wrong_bytes() {
    let dir = scratch_dir("agent-bad-input");
    let l2 = dir.join("l2");
    let token = dir.join("token");
    std::fs::write(&token, "block-token\n").unwrap();
    let (_agent, addr) = agent(&[
        "--l1-bytes",
        "32KiB",
        "--l2",
        &format!("dir:{}", l2.display()),
        "--max-block-bytes",
        "20KiB",
        "--token-file",
        token.to_str().unwrap(),
    ]);
    let AgentAddr::Tcp(tcp) = &addr else {
        unreachable!()
    };

    // Not the protocol, another version, no token, a wrong token.
    let (status, msg) = raw_hello(tcp, b"GET / HTTP/1.1\r\n\r\n").await;
    assert_eq!(status, proto::HELLO_VERSION);
    assert!(msg.contains("bad magic"), "{msg}");
    let mut v9 = proto::encode_hello(b"block-token").unwrap();
    v9[4] = 9;
    let (status, msg) = raw_hello(tcp, &v9).await;
    assert_eq!(status, proto::HELLO_VERSION);
    assert!(msg.contains("unsupported protocol version 9"), "{msg}");
    let (status, _) = raw_hello(tcp, &proto::encode_hello(b"").unwrap()).await;
    assert_eq!(status, proto::HELLO_TOKEN);
    let err = AgentClient::connect(&addr, "guess", TIMEOUT)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("token"), "{err}");

    let c = AgentClient::connect(&addr, "block-token", TIMEOUT)
        .await
        .unwrap();
    // A payload over the maximum is refused, the rest stored.
    let r = c
        .put(
            LAYOUT,
            vec![
                (1, payload(1, 30 << 10), false),
                (2, payload(2, 1000), false),
            ],
        )
        .await
        .unwrap();
    assert_eq!(r.stored, 1);
    assert_eq!(r.refused, vec![(0, PutRefusal::TooLarge)]);
    // The agents' own layout (their L2 aliases, record 0126) is no client's to write.
    let alias = warmpath_cache_agent::agent::ALIAS_LAYOUT;
    let err = c
        .put(alias, vec![(1, payload(1, 1000), false)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("aliases"), "{err}");

    // A malformed frame is answered with an error for its id; the connection goes on.
    let mut s = tokio::net::TcpStream::connect(tcp).await.unwrap();
    s.write_all(&proto::encode_hello(b"block-token").unwrap())
        .await
        .unwrap();
    let mut welcome = [0u8; 9];
    s.read_exact(&mut welcome).await.unwrap();
    let mut bad = Vec::new();
    bad.extend_from_slice(&13u32.to_le_bytes());
    bad.extend_from_slice(&77u64.to_le_bytes());
    bad.extend_from_slice(&1u32.to_le_bytes());
    bad.push(0xee);
    s.write_all(&bad).await.unwrap();
    let (id, answer) = read_response(&mut s).await;
    assert_eq!(id, 77);
    assert!(
        matches!(&answer, Response::Error { message, .. } if message.contains("malformed")),
        "{answer:?}"
    );
    let stats = proto::encode_frame(78, &Request::Stats, Vec::new());
    s.write_all(&stats.head).await.unwrap();
    let (id, answer) = read_response(&mut s).await;
    assert_eq!(id, 78);
    assert!(matches!(answer, Response::Stats(_)), "{answer:?}");
    // A frame over the limit: an error, then the agent hangs up.
    s.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    let (_, answer) = read_response(&mut s).await;
    assert!(
        matches!(&answer, Response::Error { message, .. } if message.contains("over the limit")),
        "{answer:?}"
    );
    let mut rest = Vec::new();
    let n = tokio::time::timeout(TIMEOUT, s.read_to_end(&mut rest))
        .await
        .expect("the agent closes the connection")
        .unwrap_or(0);
    assert_eq!(n, 0);

    // Damaged L2 objects: a flipped byte, a truncation, another block's object under this
    // name. Each is a counted miss; the intact one is served.
    put_chain(&c, 10..14, 16 << 10).await;
    put_chain(&c, 20..24, 16 << 10).await;
    // Block 2 of the put above may be there too: only this chain's files are damaged.
    let files: Vec<_> = eventually_files(&l2, 5)
        .await
        .into_iter()
        .filter(|f| {
            let stem = f.file_stem().unwrap().to_str().unwrap();
            let key = u64::from_str_radix(stem, 16).unwrap();
            (10..24).contains(&key)
        })
        .collect();
    assert!(files.len() >= 4, "{files:?}");
    let mut damaged = 0;
    for (i, f) in files.iter().take(3).enumerate() {
        let mut bytes = std::fs::read(f).unwrap();
        match i {
            0 => *bytes.last_mut().unwrap() ^= 0xff,
            1 => bytes.truncate(bytes.len() - 100),
            _ => bytes = std::fs::read(&files[3]).unwrap(),
        }
        std::fs::write(f, bytes).unwrap();
        damaged += 1;
    }
    let all: Vec<u64> = (10..14).chain(20..24).collect();
    let got = c.get(LAYOUT, all.clone()).await.unwrap();
    for (k, g) in all.iter().zip(&got) {
        if let Some(g) = g {
            assert_eq!(
                g.payload,
                payload(*k, 16 << 10),
                "block {k}: wrong bytes served"
            );
        }
    }
    assert_eq!(got.iter().filter(|g| g.is_none()).count(), damaged);
    let stats = c.stats().await.unwrap();
    assert_eq!(stats.l2_damaged, damaged as u64, "{stats:?}");
}

/// The L2 directory's block files, once there are `n`.
async fn eventually_files(root: &std::path::Path, n: usize) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while files.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} block files in L2",
            files.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        files = walk(root)
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "blk"))
            .collect();
    }
    files.sort();
    files
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

pub(crate) async fn read_response(s: &mut tokio::net::TcpStream) -> (u64, Response) {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).await.unwrap();
    let frame = proto::decode_body::<Response>(Bytes::from(body)).unwrap();
    (frame.id, frame.header)
}

/// Tokens of a prompt's KV found in each tier, from engine-sim's usage.
fn tier_tokens(v: &Value) -> (u64, u64, u64) {
    let t = &v["usage"]["prompt_tokens_details"]["kv_tier_tokens"];
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    (n("gpu"), n("l1"), n("l2"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sim_offloads_to_its_agent_and_survives_the_agent_restarting() {
    let (mut agent_proc, addr) = agent(&["--l1-bytes", "4MiB"]);
    let agent_at = addr.to_string();
    let engine = offloading_engine(&agent_at, "0.001");
    let http = client();
    let ask = |seed: u64| {
        let http = http.clone();
        let url = engine.url.clone();
        async move { complete_long(&http, &url, seed, 2).await.json() }
    };
    // Prompt 1, then others that push it out of GPU memory, then prompt 1 again: loaded
    // from the agent's L1.
    ask(1).await;
    for seed in 2..5 {
        ask(seed).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let loaded = loop {
        let loaded = tier_tokens(&ask(1).await);
        if loaded.1 > 0 {
            break loaded;
        }
        assert!(Instant::now() < deadline, "prompt 1 never loaded from L1");
        // Push it out again while the offloads land.
        ask(2).await;
        ask(3).await;
    };
    assert_eq!(loaded.2, 0, "no L2 configured: {loaded:?}");
    let metrics = get_text(&format!("{}/metrics", engine.url)).await;
    assert!(
        metrics.contains(
            "warmpath_engine_prefix_hit_tokens_total{model_name=\"sim-llama\",tier=\"l1\"}"
        ),
        "{metrics}"
    );

    // The agent dies: the engine recomputes and answers every request.
    agent_proc.kill();
    for seed in [1, 2, 3, 1] {
        let v = ask(seed).await;
        assert_eq!(tier_tokens(&v).1, 0, "nothing comes from a dead agent");
    }
    // A new agent on the same address: the engine reconnects, offloads and loads again.
    let (_agent2, _) = agent_on(&agent_at);
    eventually_loaded_from_l1("loads from the restarted agent", &engine).await;
}

/// Asks `engine` for prompts 2 to 4 (pushing prompt 1 out of its GPU), then prompt 1 again,
/// until prompt 1 is loaded from the agent's L1 (`what` names the wait).
async fn eventually_loaded_from_l1(what: &str, engine: &Proc) {
    let http = client();
    let ask = |seed: u64| {
        let (http, url) = (http.clone(), engine.url.clone());
        async move { complete_long(&http, &url, seed, 2).await.json() }
    };
    eventually(what, || {
        let ask = &ask;
        async move {
            for seed in 2..5 {
                ask(seed).await;
            }
            tier_tokens(&ask(1).await).1 > 0
        }
    })
    .await;
}

/// The value of `name` (with its labels, as written) on an engine's `/metrics`.
async fn engine_metric(engine: &Proc, name: &str) -> f64 {
    crate::router::metric(&get_text(&format!("{}/metrics", engine.url)).await, name)
}

/// Blocks the engine dropped instead of offloading, from its `/metrics`.
async fn dropped_offloads(engine: &Proc) -> f64 {
    engine_metric(
        engine,
        "warmpath_engine_agent_blocks_total{model_name=\"sim-llama\",op=\"dropped\"}",
    )
    .await
}

/// Issue 24: offload never blocks the engine. An agent stopped (SIGSTOP: connected, reading
/// nothing) and then killed: every request still completes within the agent call deadline
/// (2 s) plus its own time, and the blocks the engine could not hand over are counted as
/// dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_or_killed_agent_costs_dropped_offloads_never_a_stuck_engine() {
    let (mut agent_proc, addr) = agent(&["--l1-bytes", "4MiB"]);
    let engine = offloading_engine(&addr.to_string(), "0.001");
    let http = client();
    let mut seed = 0;
    let mut ask = || {
        seed += 1;
        let (http, url) = (http.clone(), engine.url.clone());
        async move {
            let started = Instant::now();
            complete_long(&http, &url, seed, 2).await;
            started.elapsed()
        }
    };
    // Offloads land while the agent runs.
    for _ in 0..4 {
        ask().await;
    }
    for (what, stop) in [("stopped", true), ("killed", false)] {
        if stop {
            agent_proc.signal("-STOP");
        } else {
            agent_proc.signal("-CONT");
            agent_proc.kill();
        }
        let before = dropped_offloads(&engine).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            // Each prompt evicts the last one's blocks from the 64-block GPU: offloads.
            let took = ask().await;
            assert!(
                took < Duration::from_secs(5),
                "a request took {took:?} with the agent {what}"
            );
            if dropped_offloads(&engine).await > before {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no offload counted as dropped with the agent {what}"
            );
        }
    }
}

/// A failed call resets the engine's link to its agent; the offloads queued behind it wait
/// for the link to come back (within a call deadline) rather than being dropped at once.
/// Here calls fail while the agent is stopped, and the blocks the next request evicts while
/// the link connects again are offloaded: none is dropped. Before, every block queued while
/// the link connected again was dropped (12,360 of 460,000 offloads in a 300-request
/// `longdoc` demo, after 3 failed calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloads_wait_out_the_reconnect_after_a_failed_call() {
    let (agent_proc, addr) = agent(&["--l1-bytes", "4MiB"]);
    let engine = offloading_engine(&addr.to_string(), "0.001");
    let http = client();
    let offloaded_series =
        "warmpath_engine_agent_blocks_total{model_name=\"sim-llama\",op=\"offloaded\"}";
    let errors_series = "warmpath_engine_agent_errors_total{model_name=\"sim-llama\"}";
    for seed in 1..=4 {
        complete_long(&http, &engine.url, seed, 2).await;
    }
    // Every offload so far has landed (the count holds still): none is in flight when the
    // agent stops.
    settled(Duration::from_secs(20), "offloads to settle", || {
        engine_metric(&engine, offloaded_series)
    })
    .await;
    let errors = engine_metric(&engine, errors_series).await;
    agent_proc.signal("-STOP");
    // A new prompt: the engine asks the stopped agent at arrival, and offloads the last
    // prompt's blocks as admission evicts them; both calls miss their deadline (2 s), the
    // put's blocks are dropped, and the link resets.
    complete_long(&http, &engine.url, 100, 2).await;
    eventually_within(
        Duration::from_secs(20),
        "the calls to the stopped agent to fail",
        || async { engine_metric(&engine, errors_series).await > errors },
    )
    .await;
    settled(Duration::from_secs(20), "the failed put's drops", || {
        dropped_offloads(&engine)
    })
    .await;
    agent_proc.signal("-CONT");
    // The next prompt's blocks are evicted while the link connects again: they wait for it.
    let (dropped, offloaded) = (
        dropped_offloads(&engine).await,
        engine_metric(&engine, offloaded_series).await,
    );
    complete_long(&http, &engine.url, 101, 2).await;
    eventually_within(
        Duration::from_secs(20),
        "offloads after the agent ran again",
        || async { engine_metric(&engine, offloaded_series).await > offloaded },
    )
    .await;
    assert_eq!(
        dropped_offloads(&engine).await,
        dropped,
        "offloads were dropped while the link to the agent came back"
    );
}

/// An engine-sim of 128 GPU blocks of 16 tokens (builtin words are one token each) and its
/// agent with a 4 MiB L1: the stage of the tests of what a queued request finds.
struct QueueBench {
    _agent: Proc,
    engine: Proc,
    http: crate::router::HttpClient,
}

impl QueueBench {
    fn start() -> QueueBench {
        let (agent, addr) = agent(&["--l1-bytes", "4MiB"]);
        let engine = crate::engine_sim(
            "1",
            &[
                "--gpu-kv-tokens",
                "2048",
                "--agent",
                &addr.to_string(),
                "--agent-block-scale",
                "0.001",
            ],
        );
        QueueBench {
            _agent: agent,
            engine,
            http: client(),
        }
    }

    /// Sends a completion of `words` at once; the task answers its JSON body (a 200).
    fn send(&self, words: String, max_tokens: u32) -> tokio::task::JoinHandle<Value> {
        let (http, url) = (self.http.clone(), self.engine.url.clone());
        tokio::spawn(async move {
            let body = completion(&words, max_tokens, false);
            let r = post(&http, &url, "/v1/completions", body, &[]).await;
            assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
            r.json()
        })
    }

    async fn metric(&self, name: &str) -> f64 {
        engine_metric(&self.engine, name).await
    }
}

/// Issue 24: engine-sim asks its agent for a request's blocks when it admits the request,
/// not only when the request arrives. Prompt P is cached on the GPU, unreferenced, and
/// nothing has been offloaded yet when B (P again) arrives and queues behind C2 (the GPU
/// holds all of P: nothing to ask at arrival); C2's admission then evicts P to the agent.
/// B, admitted after C2, loads P from the agent's L1, where a lookup at its arrival would
/// have found nothing. No timing is tight: C1 decodes for seconds at the model's
/// own speed while the test needs milliseconds, and C2 decodes for about a second after
/// evicting P, while the offload takes milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_offloaded_while_a_request_waits_are_loaded_at_its_admission() {
    let bench = QueueBench::start();
    let send = |words: String, max_tokens: u32| bench.send(words, max_tokens);
    let gauge = |name: &'static str| bench.metric(name);
    let offloaded = "warmpath_engine_agent_blocks_total{model_name=\"sim-llama\",op=\"offloaded\"}";
    // A computes P (37 blocks), which stays cached on the GPU.
    let p = warmpath_index::text::words(1, 600);
    send(p.clone(), 1).await.unwrap();
    // C1 (18 blocks, growing to 35) decodes for about 4 s beside it.
    let c1 = send(warmpath_index::text::words(2, 300), 250);
    eventually("C1 to run", || async {
        gauge("vllm:num_requests_running").await == 1.0
    })
    .await;
    // C2 (113 blocks) cannot be admitted beside C1; once it is, it must evict P.
    let c2 = send(warmpath_index::text::words(3, 1800), 30);
    eventually("C2 to wait", || async {
        gauge("vllm:num_requests_waiting").await == 1.0
    })
    .await;
    let b = send(p, 1);
    eventually("B to wait", || async {
        gauge("vllm:num_requests_waiting").await == 2.0
    })
    .await;
    assert_eq!(
        gauge(offloaded).await,
        0.0,
        "P must still be on the GPU only when B arrives"
    );
    let b = b.await.unwrap();
    let (gpu, l1, l2) = tier_tokens(&b);
    assert!(
        gpu == 0 && l1 >= 16 * 30 && l2 == 0,
        "B found P: gpu {gpu}, l1 {l1}, l2 {l2} tokens"
    );
    for c in [c1, c2] {
        c.await.unwrap();
    }
    let l1_hits =
        gauge("warmpath_engine_prefix_hit_tokens_total{model_name=\"sim-llama\",tier=\"l1\"}")
            .await;
    assert_eq!(l1_hits, l1 as f64);
    assert!(gauge(offloaded).await >= 37.0);
}

/// Issue 24: a request that queues has its blocks looked up while it waits, so its
/// admission asks nothing and it prefills in the step it is admitted in. P is computed,
/// then pushed off the GPU to the agent by E; B (P again) queues behind D, which cannot be
/// admitted beside C1's long decode. B's lookup at arrival is answered while it waits
/// (`warmpath_engine_agent_arrival_lookups_total{outcome="in_time"}`), and B finds P in
/// the agent's L1. No timing is tight: C1 decodes for seconds, the lookup takes
/// milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_is_looked_up_while_it_waits() {
    let bench = QueueBench::start();
    let send = |words: String, max_tokens: u32| bench.send(words, max_tokens);
    let gauge = |name: &'static str| bench.metric(name);
    let arrival = |outcome: &str| {
        format!("warmpath_engine_agent_arrival_lookups_total{{model_name=\"sim-llama\",outcome=\"{outcome}\"}}")
    };
    let offloaded = "warmpath_engine_agent_blocks_total{model_name=\"sim-llama\",op=\"offloaded\"}";
    // A computes P (37 blocks); E (113 blocks) then needs most of the GPU and evicts P.
    let p = warmpath_index::text::words(1, 600);
    send(p.clone(), 1).await.unwrap();
    send(warmpath_index::text::words(4, 1800), 1).await.unwrap();
    eventually("P offloaded", || async { gauge(offloaded).await >= 20.0 }).await;
    // C1 (18 blocks, growing to 35) decodes for about 4 s; D (113 blocks) waits for it.
    let c1 = send(warmpath_index::text::words(2, 300), 250);
    eventually("C1 to run", || async {
        gauge("vllm:num_requests_running").await == 1.0
    })
    .await;
    let d = send(warmpath_index::text::words(3, 1800), 30);
    eventually("D to wait", || async {
        gauge("vllm:num_requests_waiting").await == 1.0
    })
    .await;
    // D's own lookup is answered while it waits (milliseconds): count from after it.
    let in_time_name = arrival("in_time");
    settled(Duration::from_secs(10), "D's lookup to be answered", || {
        bench.metric(&in_time_name)
    })
    .await;
    let asked = bench.metric(&arrival("asked")).await;
    let in_time = bench.metric(&arrival("in_time")).await;
    let b = send(p, 1);
    // `in_time` counts an answer that found its request still queued (not yet admitted):
    // the proof that B was looked up while it waited, whatever the queue holds by the time
    // this test reads it (on a loaded machine C1 may have finished by then).
    eventually("B's lookup answered while it waits", || {
        let (bench, name) = (&bench, arrival("in_time"));
        async move { bench.metric(&name).await > in_time }
    })
    .await;
    assert_eq!(bench.metric(&arrival("asked")).await, asked + 1.0);
    let b = b.await.unwrap();
    let (_, l1, l2) = tier_tokens(&b);
    assert!(
        l1 >= 16 * 10 && l2 == 0,
        "B found P in L1: l1 {l1}, l2 {l2} tokens"
    );
    for c in [c1, d] {
        c.await.unwrap();
    }
}

fn agent_on(at: &str) -> (Proc, AgentAddr) {
    let p = Proc::start(&["agent", "--listen", at, "--l1-bytes", "4MiB"]);
    (p, AgentAddr::Tcp(at.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_costs_counted_l2_errors_and_no_half_written_block() {
    let dir = scratch_dir("agent-full-disk");
    let l2 = dir.join("l2");
    std::fs::create_dir_all(&l2).unwrap();
    // A 256 KiB disk under an L2 bound of 10 MiB: the disk fills first.
    let agent = Proc::start_with_small_disk(
        &l2,
        256 << 10,
        &[
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--l1-bytes",
            "32KiB",
            "--l2",
            &format!("dir:{}", l2.display()),
            "--l2-bytes",
            "10MiB",
        ],
    );
    let c = connect(&AgentAddr::Tcp(agent.url.clone())).await;
    // 40 blocks of 16 KiB: 38 are evicted towards a disk that holds about 15.
    for start in (0..40).step_by(4) {
        put_chain(&c, start..start + 4, 16 << 10).await;
    }
    let keys: Vec<u64> = (0..40).collect();
    eventually("l2 write errors counted", || async {
        c.stats().await.unwrap().l2_errors > 0
    })
    .await;
    // What is served is right; what did not fit is a miss; the agent goes on.
    let got = c.get(LAYOUT, keys.clone()).await.unwrap();
    let served = got.iter().flatten().count();
    for (k, g) in keys.iter().zip(&got) {
        if let Some(g) = g {
            assert_eq!(g.payload, payload(*k, 16 << 10), "block {k}");
        }
    }
    assert!(served > 2 && served < 40, "{served} of 40 served");
    let stats = c.stats().await.unwrap();
    assert_eq!(
        stats.l2_damaged, 0,
        "a half-written block was visible: {stats:?}"
    );
    put_chain(&c, 100..102, 1000).await;
}

/// The engine's prompt tokens in `usage`.
fn prompt_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_follows_an_engines_kv_events() {
    let kv = format!("tcp://{}", crate::free_addr());
    let engine = crate::engine_sim("50", &["--kv-events", &kv]);
    // Every block reported: the agent must hold exactly the prompts' blocks (what it reports
    // of them, one key per 64 tokens, is `a_router_learns_a_sampled_chain_…`'s subject).
    let (_agent, addr) = agent(&[
        "--kv-events",
        &format!("e0={kv}"),
        "--residency-every-block",
    ]);
    let c = connect(&addr).await;
    let http = client();
    // A publisher drops what it sends before a subscriber has joined: warm up with fresh
    // prompts until the agent has seen a batch.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seed = 1000;
    while c.stats().await.unwrap().kv_batches == 0 {
        assert!(
            Instant::now() < deadline,
            "the agent never received a KV event"
        );
        seed += 1;
        post_fresh(&http, &engine.url, seed).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = c.stats().await.unwrap().residency_blocks;
    // Three prompts that share nothing: the agent must come to hold exactly their blocks
    // more.
    let mut blocks = 0;
    for seed in 1..4 {
        let body = completion(&long_prompt(seed), 1, false);
        let r = post(&http, &engine.url, "/v1/completions", body, &[]).await;
        assert_eq!(r.status, 200);
        blocks += prompt_tokens(&r.json()) / 16;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = c.stats().await.unwrap();
        if s.residency_blocks == before + blocks {
            assert_eq!(
                (s.kv_gaps, s.kv_malformed, s.kv_unresolved),
                (0, 0, 0),
                "{s:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent holds {} blocks, not {before} + {blocks}: {s:?}",
            s.residency_blocks
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_kv_events_are_counted_and_gaps_drop_the_view() {
    use warmpath_cache_agent::kv_events::{encode_batch, Shape};
    use zeromq::{Socket, SocketSend, ZmqMessage};
    let kv = format!("tcp://{}", crate::free_addr());
    let mut publisher = zeromq::PubSocket::new();
    publisher.bind(&kv).await.unwrap();
    // Every block reported: one block stored is one block counted.
    let (mut agent_proc, addr) = agent(&[
        "--kv-events",
        &format!("e0={kv}"),
        "--residency-every-block",
    ]);
    let c = connect(&addr).await;
    let (stored, frames) = (stored_event, kv_message);
    // The subscription takes a moment: publish until the first good batch lands.
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.stats().await.unwrap().residency_blocks != 1 {
        assert!(Instant::now() < deadline, "the agent never subscribed");
        let _ = publisher
            .send(frames(
                0,
                encode_batch(0.0, &[stored(1, 0..16)], Shape::Map),
            ))
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Garbage, a huge declared array, a two-frame message, an unknown event kind.
    publisher
        .send(frames(1, vec![0xc1, 0xff, 0x00]))
        .await
        .unwrap();
    publisher
        .send(frames(1, vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]))
        .await
        .unwrap();
    publisher
        .send(ZmqMessage::try_from(vec![Bytes::new(), Bytes::from_static(b"x")]).unwrap())
        .await
        .unwrap();
    // The next good batch (seq 1) still follows seq 0; then seq 5 is a gap: the view is
    // dropped and rebuilt from that batch.
    publisher
        .send(frames(
            1,
            encode_batch(0.1, &[stored(2, 16..32)], Shape::Array),
        ))
        .await
        .unwrap();
    publisher
        .send(frames(
            5,
            encode_batch(0.2, &[stored(3, 32..48)], Shape::Array),
        ))
        .await
        .unwrap();
    eventually("the gap is seen", || async {
        let s = c.stats().await.unwrap();
        s.kv_gaps == 1 && s.residency_blocks == 1
    })
    .await;
    let s = c.stats().await.unwrap();
    assert!(s.kv_malformed >= 2, "{s:?}");
    // A publisher restart starts again at 0: another gap, handled the same way.
    drop(publisher);
    // The dropped socket lets go of its port in the background: bind again until it has.
    let mut publisher = zeromq::PubSocket::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = publisher.bind(&kv).await {
        assert!(Instant::now() < deadline, "rebinding {kv}: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.stats().await.unwrap().kv_gaps != 2 {
        assert!(
            Instant::now() < deadline,
            "the restarted publisher was not followed"
        );
        let _ = publisher
            .send(frames(
                0,
                encode_batch(0.0, &[stored(7, 0..16)], Shape::Map),
            ))
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        agent_proc.child.try_wait().unwrap().is_none(),
        "the agent is still running"
    );
}

/// vLLM's BlockStored event of one block (engine hash `hash`) with no parent and no salt.
fn stored_event(
    hash: u64,
    tokens: std::ops::Range<u32>,
) -> warmpath_cache_agent::kv_events::KvEvent {
    warmpath_cache_agent::kv_events::KvEvent::Stored {
        block_hashes: vec![warmpath_cache_agent::kv_events::EngineHash(
            hash.to_be_bytes().to_vec(),
        )],
        parent: None,
        token_ids: tokens.collect(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: vec![],
    }
}

/// A KV-event message as vLLM publishes it: topic (empty), sequence, batch.
fn kv_message(seq: u64, payload: Vec<u8>) -> zeromq::ZmqMessage {
    zeromq::ZmqMessage::try_from(warmpath_cache_agent::kv_events::message(
        seq,
        Bytes::from(payload),
    ))
    .unwrap()
}

/// A gap in an engine's KV events is filled from its replay socket (vLLM's protocol),
/// instead of dropping the engine's view; and engine-sim serves that replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_gaps_are_filled_from_the_replay_socket() {
    use warmpath_cache_agent::kv_events::{encode_batch, Shape};
    use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};
    let stored = |hash: u64, tokens: std::ops::Range<u32>| {
        encode_batch(0.0, &[stored_event(hash, tokens)], Shape::Array)
    };
    let frames = kv_message;
    let (kv, replay) = (
        format!("tcp://{}", crate::free_addr()),
        format!("tcp://{}", crate::free_addr()),
    );
    let mut publisher = zeromq::PubSocket::new();
    publisher.bind(&kv).await.unwrap();
    // The engine's replay socket keeps batches 1 and 2, which the subscriber will miss,
    // once the engine has published them (`sent`: one past the last sequence published).
    let mut router = zeromq::RouterSocket::new();
    router.bind(&replay).await.unwrap();
    let replays = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (served, published) = (replays.clone(), sent.clone());
    tokio::spawn(async move {
        use std::sync::atomic::Ordering::Relaxed;
        while let Ok(request) = router.recv().await {
            let f = request.into_vec();
            let start = u64::from_be_bytes(f.last().unwrap()[..].try_into().unwrap());
            // The agent's resync when it starts asks from 0; a gap asks from where it is.
            if start > 0 {
                served.fetch_add(1, Relaxed);
            }
            let kept = [(1u64, stored(10, 16..32)), (2, stored(11, 32..48))];
            let end = (u64::MAX, Vec::new());
            let upto = published.load(Relaxed);
            let kept = kept.into_iter().filter(|(s, _)| *s >= start && *s < upto);
            for (seq, payload) in kept.chain([end]) {
                let reply = vec![
                    f[0].clone(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload),
                ];
                router
                    .send(ZmqMessage::try_from(reply).unwrap())
                    .await
                    .unwrap();
            }
        }
    });
    // Every block reported: one block stored is one block counted.
    let (_agent, addr) = agent(&[
        "--kv-events",
        &format!("e0={kv},{replay}"),
        "--residency-every-block",
    ]);
    let c = connect(&addr).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.stats().await.unwrap().residency_blocks != 1 {
        assert!(Instant::now() < deadline, "the agent never subscribed");
        let _ = publisher.send(frames(0, stored(1, 0..16))).await;
        sent.store(1, std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Batch 3 arrives; 1 and 2 were missed: the agent asks for them and keeps its view.
    sent.store(4, std::sync::atomic::Ordering::Relaxed);
    publisher.send(frames(3, stored(12, 48..64))).await.unwrap();
    eventually("the missed batches replayed", || async {
        c.stats().await.unwrap().residency_blocks == 4
    })
    .await;
    let s = c.stats().await.unwrap();
    assert_eq!(s.kv_gaps, 0, "{s:?}");
    assert_eq!(replays.load(std::sync::atomic::Ordering::Relaxed), 1);
    // Batch 9: the replay no longer has 4 to 8, so the gap drops the view, as without one.
    sent.store(10, std::sync::atomic::Ordering::Relaxed);
    publisher.send(frames(9, stored(13, 64..80))).await.unwrap();
    eventually("the unfillable gap seen", || async {
        let s = c.stats().await.unwrap();
        s.kv_gaps == 1 && s.residency_blocks == 1
    })
    .await;

    // engine-sim keeps what it publishes and answers as vLLM 0.33 does (the replay above
    // answers as vLLM up to 0.25 did, without the topic frame: the agent reads both).
    let (events, replay) = (
        format!("tcp://{}", crate::free_addr()),
        format!("tcp://{}", crate::free_addr()),
    );
    let engine = crate::engine_sim("50", &["--kv-events", &events, "--kv-replay", &replay]);
    let r = post(
        &client(),
        &engine.url,
        "/v1/completions",
        completion(&long_prompt(3), 1, false),
        &[],
    )
    .await;
    assert_eq!(r.status, 200);
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&replay).await.unwrap();
    let mut seqs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seqs.is_empty() {
        assert!(Instant::now() < deadline, "engine-sim replayed nothing");
        let ask = vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())];
        dealer
            .send(ZmqMessage::try_from(ask).unwrap())
            .await
            .unwrap();
        loop {
            let f = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
                .await
                .expect("a replay answer")
                .unwrap()
                .into_vec();
            // vLLM 0.33's answer, as a DEALER receives it: the topic (empty) after the
            // delimiter, for every batch and for the end marker.
            assert_eq!(f.len(), 4, "[empty, topic, sequence, batch]");
            assert!(f[0].is_empty() && f[1].is_empty(), "{f:?}");
            if f[3].is_empty() {
                assert_eq!(f[2][..], (-1i64).to_be_bytes()[..], "the end marker");
                break;
            }
            let batch = warmpath_cache_agent::kv_events::decode_batch(&f[3]).expect("a batch");
            assert!(!batch.events.is_empty());
            seqs.push(u64::from_be_bytes(f[2][..].try_into().unwrap()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seqs[0], 0, "{seqs:?}");
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
}

/// A free UDP port on loopback.
fn free_udp() -> String {
    warmpath_testkit::free_udp_addr().to_string()
}

/// An engine-sim publishing KV events, an agent following it and serving residency over
/// mutual TLS, and the cluster's certificates (`agent`, `router`) in `certs`.
struct Residency {
    dir: std::path::PathBuf,
    certs: std::path::PathBuf,
    engine: Proc,
    agent: Proc,
    /// The agent's flags, to start it again.
    agent_args: Vec<String>,
    addr: AgentAddr,
    /// The agent's QUIC address.
    quic: String,
}

impl Residency {
    fn start(test: &str, engine_extra: &[&str], agent_extra: &[&str]) -> Residency {
        Residency::launch(test, false, None, engine_extra, agent_extra)
    }

    /// As [`Residency::start`], the engine (16-token blocks, o200k, 64 GPU blocks, small
    /// payloads) offloading what its GPU evicts to the agent over the agent's Unix socket.
    fn start_offloading(test: &str, agent_extra: &[&str]) -> Residency {
        Residency::offloading(test, None, agent_extra)
    }

    /// Another host as [`Residency::start_offloading`]'s, of the same cluster (this one's
    /// certificates).
    fn another_offloading_host(&self, test: &str, agent_extra: &[&str]) -> Residency {
        Residency::offloading(test, Some(&self.certs), agent_extra)
    }

    fn offloading(test: &str, certs: Option<&std::path::Path>, agent_extra: &[&str]) -> Residency {
        let sock = scratch_dir(&format!("{test}-sock")).join("agent.sock");
        let sock_s = sock.to_str().unwrap().to_string();
        let engine_agent = format!("unix:{sock_s}");
        let mut agent_args = vec!["--unix", sock_s.as_str()];
        agent_args.extend_from_slice(agent_extra);
        Residency::launch(
            test,
            false,
            certs,
            &[
                "--block-tokens",
                "16",
                "--tokenizer",
                "tiktoken:o200k_base",
                // 64 GPU blocks: two prompts of 33 blocks push the first out.
                "--gpu-kv-tokens",
                "1024",
                "--agent",
                &engine_agent,
                "--agent-block-scale",
                "0.001",
            ],
            &agent_args,
        )
    }

    /// As [`Residency::start`], the engine serving vLLM's replay socket and the agent told
    /// where it is.
    fn start_replaying(test: &str, engine_extra: &[&str], agent_extra: &[&str]) -> Residency {
        Residency::launch(test, true, None, engine_extra, agent_extra)
    }

    /// Starts the engine and its agent, with new certificates or the given ones.
    fn launch(
        test: &str,
        replay: bool,
        certs: Option<&std::path::Path>,
        engine_extra: &[&str],
        agent_extra: &[&str],
    ) -> Residency {
        let dir = scratch_dir(test);
        let certs = certs.map(std::path::Path::to_path_buf).unwrap_or_else(|| {
            crate::make_certs(
                &dir,
                &["--agent", "agent", "--router", "router", "--loopback"],
            )
        });
        let certs_s = certs.to_str().unwrap().to_string();
        let kv = format!("tcp://{}", crate::free_addr());
        let replay_at = format!("tcp://{}", crate::free_addr());
        let mut engine_args = vec!["--kv-events", kv.as_str()];
        if replay {
            engine_args.extend(["--kv-replay", replay_at.as_str()]);
        }
        engine_args.extend_from_slice(engine_extra);
        let engine = crate::engine_sim("50", &engine_args);
        let quic = free_udp();
        let kv_events = match replay {
            true => format!("{}={kv},{replay_at}", engine.url),
            false => format!("{}={kv}", engine.url),
        };
        let mut agent_args: Vec<String> = [
            "--kv-events",
            &kv_events,
            "--residency-listen",
            &quic,
            "--tls-dir",
            &certs_s,
            "--tls-name",
            "agent",
        ]
        .map(String::from)
        .to_vec();
        agent_args.extend(agent_extra.iter().map(|a| a.to_string()));
        let (agent_proc, addr) = Residency::start_agent(&agent_args);
        Residency {
            dir,
            certs,
            engine,
            agent: agent_proc,
            agent_args,
            addr,
            quic,
        }
    }

    fn start_agent(args: &[String]) -> (Proc, AgentAddr) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (mut p, addr) = agent(&args);
        let mut line = p.read_line();
        // With `--unix`, its socket's line comes first.
        if line.contains("unix:") {
            line = p.read_line();
        }
        assert!(line.contains("residency"), "{line}");
        (p, addr)
    }

    /// Kills the agent (SIGKILL) and starts it again with the same flags.
    fn restart_agent(&mut self) {
        self.agent.kill();
        (self.agent, self.addr) = Residency::start_agent(&self.agent_args);
    }

    /// Follows the agent as a router does, in this process (the router's certificate, the
    /// router's follower), until the returned handle is dropped; returns once its first
    /// snapshot arrived (so `prefetchers` routes to the agent's instances).
    async fn follow_as_router(
        &self,
        prefetchers: &warmpath_residency::net::Prefetchers,
    ) -> tokio::sync::oneshot::Sender<()> {
        use warmpath_residency::net::{endpoint, follow, AgentTarget};
        use warmpath_residency::tls::TlsFiles;
        let files = TlsFiles::in_dir(&self.certs, "router");
        let ep = endpoint(
            "127.0.0.1:0".parse().unwrap(),
            None,
            Some(files.client_config().unwrap()),
        )
        .unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let target = AgentTarget::parse(&self.quic).expect("target");
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (_tenants, tenants) =
            tokio::sync::watch::channel(std::sync::Arc::new(Default::default()));
        tokio::spawn(follow(
            ep,
            target,
            Duration::from_secs(5),
            tx,
            stopped,
            tenants,
            prefetchers.clone(),
        ));
        let first = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("a snapshot");
        assert!(
            matches!(first, Some(warmpath_residency::Outcome::Apply { .. })),
            "{first:?}"
        );
        // Keep the outcomes flowing (the follower stops when nobody reads them).
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        stop
    }

    /// A router configuration written to `name` in the test's directory: one pool of
    /// `instances` that names this agent and the engine's tokenizer (o200k).
    fn pool_config(&self, name: &str, instances: &[&str], block_tokens: u32) -> std::path::PathBuf {
        let path = self.dir.join(name);
        let list: Vec<String> = instances.iter().map(|i| format!("\"{i}\"")).collect();
        std::fs::write(
            &path,
            format!(
                "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [{}]\n\
                 agents = [\"{}\"]\ntokenizer = \"tiktoken:o200k_base\"\n\
                 block_tokens = {block_tokens}\n",
                list.join(", "),
                self.quic
            ),
        )
        .unwrap();
        path
    }

    /// A router in front of the engine, following the agent.
    fn router(&self, extra: &[&str]) -> Proc {
        let certs = self.certs.to_str().unwrap();
        let mut args = vec![
            "router",
            "--listen",
            "127.0.0.1:0",
            "--instance",
            &self.engine.url,
            "--residency-agent",
            &self.quic,
            "--tls-dir",
            certs,
            "--tls-name",
            "router",
        ];
        args.extend_from_slice(extra);
        Proc::start(&args)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routers_see_the_agents_residency_over_mutual_tls() {
    use warmpath_residency::net::endpoint;
    use warmpath_residency::tls::TlsFiles;
    let mut r = Residency::start("residency-tls", &[], &[]);
    let (dir, certs, quic, addr) = (&r.dir, &r.certs, &r.quic, &r.addr);
    let start_router = || r.router(&["--residency-expiry-ms", "1000"]);
    let router = start_router();
    let c = connect(addr).await;
    let http = client();
    // Requests through the router until the agent holds blocks and the router observes
    // exactly as many.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seed = 0;
    loop {
        seed += 1;
        post_fresh(&http, &router.url, seed).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let held = c.stats().await.unwrap().residency_blocks;
        let seen = observed_holders(&router.url).await;
        if held > 0 && seen == held as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "router observes {seen}, agent holds {held}"
        );
    }

    // The router measures how old the deltas are when it applies them (a snapshot has no
    // send time: serve new prompts until a delta arrives).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = get_text(&format!("{}/metrics", router.url)).await;
        if text.contains("warmpath_router_residency_lag_seconds") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no residency lag measured: {text}"
        );
        seed += 1;
        post_fresh(&http, &router.url, seed).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A client whose certificate another CA signed is refused in the handshake.
    let rogue = dir.join("rogue");
    let out = crate::warmpath(&[
        "certs",
        "--out",
        rogue.to_str().unwrap(),
        "--router",
        "router",
    ]);
    assert!(out.status.success());
    let files = TlsFiles {
        ca: certs.join("ca.pem"),
        cert: rogue.join("router.pem"),
        key: rogue.join("router.key"),
    };
    let ep = endpoint(
        "127.0.0.1:0".parse().unwrap(),
        None,
        Some(files.client_config().unwrap()),
    )
    .unwrap();
    let conn = ep
        .connect(quic.parse().unwrap(), "localhost")
        .unwrap()
        .await;
    let refused = match conn {
        Err(_) => true,
        Ok(conn) => match conn.open_bi().await {
            Err(_) => true,
            Ok((mut send, mut recv)) => {
                let _ = send.write_all(&[0, 0, 0, 0]).await;
                let mut b = [0u8; 1];
                tokio::time::timeout(Duration::from_secs(3), recv.read_exact(&mut b))
                    .await
                    .map_or(true, |r| r.is_err())
            }
        },
    };
    assert!(refused, "a certificate from another CA was accepted");
    // The router's own follower with the right files still works alongside.
    let _follower = r.follow_as_router(&Default::default()).await;

    // A router restarted mid-stream gets a snapshot and converges.
    drop(router);
    let router = start_router();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let held = c.stats().await.unwrap().residency_blocks as f64;
        let seen = observed_holders(&router.url).await;
        if held > 0.0 && seen == held {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted router observes {seen}, the agent holds {held}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The agent dies: within the expiry the router drops what it observed.
    r.agent.kill();
    let deadline = Instant::now() + Duration::from_secs(5);
    while observed_holders(&router.url).await > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the dead agent's residency never expired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 24: a router's prefetch hint over the residency link. Blocks only Redis holds
/// (written through, then pushed out of a small L1) are read back into L1 by the agent
/// when a router names them, before any engine asks; blocks that are gone are a counted
/// miss, and the blocks after a gap are not loaded (the engine could not use them). A key
/// another host's agent wrote an alias for reads the blocks it names; an alias naming more
/// than a key can take is none (record 0126).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_hint_brings_l2_blocks_into_l1_and_gone_ones_are_counted_misses() {
    use warmpath_residency::net::{PrefetchSent, Prefetchers};
    let redis = Redis::start();
    let mut r = Residency::start(
        "residency-prefetch",
        &[],
        &[
            "--l1-bytes",
            "256KiB",
            "--l2",
            &redis.url(),
            "--l2-write",
            "through",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let metrics_url = metrics_url_of(&mut r.agent);
    let prefetched = |result: &'static str| prefetch_blocks(&metrics_url, result);
    let c = connect(&r.addr).await;
    // Eight 16 KiB blocks, written through to Redis; then sixteen others fill the 256 KiB
    // L1.
    put_chain(&c, 1..9, 16 << 10).await;
    put_chain(&c, 100..116, 16 << 10).await;
    let tiers_of = |keys: Vec<u64>| {
        let c = &c;
        async move {
            let (lease, tiers) = c.lookup(LAYOUT, keys, TIMEOUT).await.unwrap();
            c.release(lease).await.unwrap();
            tiers
        }
    };
    eventually("blocks 1 to 8 only in redis", || async {
        tiers_of((1..9).collect()).await == vec![StoreTier::L2; 8]
    })
    .await;

    let prefetchers = Prefetchers::default();
    let _following = r.follow_as_router(&prefetchers).await;
    assert_eq!(
        prefetchers.send("http://not-followed:1", vec![1]),
        PrefetchSent::NoAgent
    );
    assert_eq!(
        prefetchers.send(&r.engine.url, (1..9).collect()),
        PrefetchSent::Sent
    );
    eventually("the prefetched blocks in L1", || async {
        tiers_of((1..9).collect()).await == vec![StoreTier::L1; 8]
    })
    .await;
    eventually("eight blocks counted loaded", || async {
        prefetched("loaded").await == 8.0
    })
    .await;
    // The engine's own read finds them in L1 now.
    let got = c.get(LAYOUT, (1..9).collect()).await.unwrap();
    assert!(
        got.iter()
            .all(|g| g.as_ref().map(|g| g.tier) == Some(StoreTier::L1)),
        "{got:?}"
    );

    // Blocks that are gone: 200 was never stored, so 200 and the block after it (101,
    // which L2 holds) are misses, not loads; 300, just put, is already in L1.
    put_chain(&c, 300..304, 16 << 10).await;
    assert_eq!(
        prefetchers.send(&r.engine.url, vec![300, 200, 101]),
        PrefetchSent::Sent
    );
    eventually(
        "the gone block and the one after it counted misses",
        || async { prefetched("miss").await == 2.0 },
    )
    .await;
    assert_eq!(prefetched("loaded").await, 8.0);

    // Record 0126's aliases, as another host's agent writes them to the shared L2: key 700
    // names blocks 1 to 3 (in L1 since the hint above); key 701 names more blocks than a key
    // can take, and is no alias (its key read as it is: a miss).
    use warmpath_cache_agent::agent::{Alias, ALIAS_LAYOUT};
    use warmpath_cache_agent::block::Block;
    use warmpath_cache_agent::l2::{L2Backend, RedisL2};
    let shared = RedisL2::new(
        &redis.url(),
        warmpath_cache_agent::config::DEFAULT_REDIS_PREFIX,
        TIMEOUT,
    )
    .unwrap();
    for (key, blocks) in [(700, vec![1, 2, 3]), (701, (1000..1300).collect())] {
        let id = warmpath_tiers::BlockId::new(ALIAS_LAYOUT, key);
        let alias = Block::new(Alias::V1 { blocks }.encode());
        shared.put_block(id, &alias).await.unwrap();
    }
    let aliases = |result: &'static str| {
        let url = metrics_url.clone();
        async move { agent_counter(&url, "warmpath_agent_aliases_total", result).await }
    };
    let (in_l1, missed, missing) = (
        prefetched("in_l1").await,
        prefetched("miss").await,
        aliases("missing").await,
    );
    assert_eq!(
        prefetchers.send(&r.engine.url, vec![700]),
        PrefetchSent::Sent
    );
    eventually("the alias's three blocks found in L1", || async {
        prefetched("in_l1").await == in_l1 + 3.0
    })
    .await;
    assert_eq!(
        prefetchers.send(&r.engine.url, vec![701]),
        PrefetchSent::Sent
    );
    eventually("the oversized alias refused", || async {
        aliases("missing").await == missing + 1.0 && prefetched("miss").await == missed + 1.0
    })
    .await;
    assert_eq!(prefetched("loaded").await, 8.0);
}

/// Issue 22: an agent killed while its engine keeps serving, then started again. The
/// router drops the dead agent's residency at its expiry; the new agent rebuilds its view
/// from the engine's replay socket (it has no `--kv-tenant`: it keys by the table the
/// router sends, so the rebuild waits for nothing and is redone when the table comes), and
/// within 10 s the router observes again everything the engine holds, under the keys a
/// router that never saw the prompts matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_reports_again_what_its_serving_engine_holds() {
    // Every block reported: the first prompt seen must give the new router a run of two
    // blocks or more, which an 11-block prompt with one key in 4 need not give.
    let mut r = Residency::start_replaying(
        "residency-restart",
        &["--block-tokens", "64"],
        &["--residency-every-block"],
    );
    let router = r.router(&["--residency-expiry-ms", "1000", "--allow-explain"]);
    let http = client();
    let c = connect(&r.addr).await;
    // Prompts until the agent holds blocks of several and the router observes them all.
    let stored = first_stored_prompt(&c, 900, |p| {
        let (http, url) = (http.clone(), router.url.clone());
        async move {
            explained(&http, &url, &p).await;
        }
    })
    .await;
    for seed in 950..956 {
        post_fresh(&http, &router.url, seed).await;
    }
    eventually("the router to observe what the agent holds", || async {
        let held = c.stats().await.unwrap().residency_blocks as f64;
        held > 0.0 && observed_holders(&router.url).await == held
    })
    .await;
    let before = observed_holders(&router.url).await;

    // SIGKILL the agent; the engine keeps serving (two more prompts) while it is gone.
    r.agent.kill();
    let killed = Instant::now();
    eventually("the router to drop the dead agent's residency", || async {
        observed_holders(&router.url).await == 0.0
    })
    .await;
    let dropped = killed.elapsed();
    for seed in 960..962 {
        post_fresh(&http, &router.url, seed).await;
    }
    let during = observed_holders(&router.url).await;

    // The agent again, same flags: the router reconnects, the agent resyncs.
    r.restart_agent();
    let restarted = Instant::now();
    let c = connect(&r.addr).await;
    eventually(
        "the router to observe what the engine still holds",
        || async {
            let held = c.stats().await.unwrap().residency_blocks as f64;
            held >= before && observed_holders(&router.url).await == held
        },
    )
    .await;
    let back = restarted.elapsed();
    let after = observed_holders(&router.url).await;
    println!(
        "agent restart: router's observed holders before {before}, {:.2} s after SIGKILL {during}, \
         {:.2} s after the restart {after}",
        dropped.as_secs_f64(),
        back.as_secs_f64()
    );
    let s = c.stats().await.unwrap();
    assert_eq!(s.kv_unresolved, 0, "{s:?}");
    // A router that never routed the first prompt finds it on the engine through the new
    // agent: the rebuilt keys are the routers' keys.
    let fresh = r.router(&["--allow-explain"]);
    eventually("a new router to catch up with the agent", || async {
        observed_holders(&fresh.url).await == after
    })
    .await;
    let e = explained(&http, &fresh.url, &stored).await;
    assert!(
        e["matched"]["gpu_observed"].as_u64().unwrap_or(0) >= 2,
        "the rebuilt view misses the first prompt: {e}"
    );
}

/// The explain header of a completion through `router`.
async fn explained(http: &crate::router::HttpClient, router: &str, prompt: &str) -> Value {
    let r = post(
        http,
        router,
        "/v1/completions",
        completion(prompt, 1, false),
        &[("x-warmpath-explain", "1")],
    )
    .await;
    assert_eq!(r.status, 200);
    let h = r
        .headers
        .get("x-warmpath-explain")
        .expect("an explain header");
    serde_json::from_slice(h.as_bytes()).expect("explain JSON")
}

/// Routers that find their agent in the pool configuration (no `--residency-agent`) and
/// send it their tenants (the agent has no `--kv-tenant`): the agent's keys, recomputed
/// from the engine's tokens, are the routers' keys, and what its own L1 and L2 hold
/// reaches them too. The engine tokenizes with o200k, as an engine serving an OpenAI-
/// tokenizer model would, and the pool names that tokenizer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_never_saw_a_prompt_finds_it_cached_through_the_agent() {
    // The engine's blocks are the routers' (64 tokens, the tenant default).
    let l2 = scratch_dir("residency-exact-l2");
    let l2_arg = format!("dir:{}", l2.display());
    // The engine tokenizes as a real engine serving an OpenAI-tokenizer model would, and
    // the pool names the same tokenizer: the router's blocks are the engine's.
    let r = Residency::start(
        "residency-exact",
        &["--block-tokens", "64", "--tokenizer", "tiktoken:o200k_base"],
        // Every block reported: the three blocks put and the prompt's are counted one by
        // one (coarse residency: `a_router_learns_a_sampled_chain_…`).
        &[
            "--l2",
            &l2_arg,
            "--l2-write",
            "through",
            "--residency-every-block",
        ],
    );
    let addr = &r.addr;
    let config = r.pool_config("router.toml", &[&r.engine.url], 64);
    let router = || crate::router_from_config(&config, &r.certs);
    let (a, b) = (router(), router());
    let c = connect(addr).await;
    let http = client();

    // The agent's own tiers: three blocks put into L1, written through to L2.
    put_chain(&c, 1..4, 4096).await;
    eventually("router B to see the agent's L1 and L2", || async {
        let m = get_text(&format!("{}/metrics", b.url)).await;
        observed_holders(&b.url).await == 3.0
            && crate::router::metric(&m, "warmpath_index_l2_blocks") == 3.0
    })
    .await;
    assert_eq!(c.stats().await.unwrap().residency_blocks, 6);

    // Router A serves prompts until the agent has seen the engine store one.
    let prompt = first_stored_prompt(&c, 500, |p| {
        let (http, url) = (http.clone(), a.url.clone());
        async move {
            explained(&http, &url, &p).await;
        }
    })
    .await;
    // Router B never routed it: what it knows of this prompt can only come from the agent.
    // Wait until B observes everything the agent holds (its L2 blocks are not holders),
    // then ask once (a second request would find B's own prediction from the first).
    eventually("router B to catch up with the agent", || async {
        let held = c.stats().await.unwrap().residency_blocks as f64 - 3.0;
        observed_holders(&b.url).await == held
    })
    .await;
    let e = explained(&http, &b.url, &prompt).await;
    let blocks = e["matched"]["gpu"].as_u64().unwrap_or(0);
    assert!(
        blocks >= 2,
        "router B matched {blocks} blocks of the prompt: {e}"
    );
    // The explanation names the source: all of it observed, none predicted.
    assert_eq!(e["matched"]["gpu_observed"].as_u64(), Some(blocks), "{e}");
    assert_eq!(e["matched"]["gpu_predicted"].as_u64(), Some(0), "{e}");
    let s = c.stats().await.unwrap();
    assert_eq!(s.kv_unresolved, 0, "{s:?}");
}

/// Record 0124: engine-sim offloads what its GPU evicts to its agent through the block API,
/// under the hashes its KV events gave those blocks; the agent reports them in L1 as the
/// routers' keys those events were keyed to, so a router that never saw the prompt finds
/// its evicted blocks in the engine's host memory (before, they were reported under the
/// engine's own keys, which no router computes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_finds_what_an_engine_offloaded_to_l1_under_its_own_keys() {
    const BLOCK_TOKENS: u32 = 16;
    let r = Residency::start_offloading(
        "residency-offloaded",
        &["--l1-bytes", "4MiB", "--residency-every-block"],
    );
    let config = r.pool_config("router.toml", &[&r.engine.url], BLOCK_TOKENS);
    let feeder = crate::router_from_config(&config, &r.certs);
    let router = crate::router_from_config(&config, &r.certs);
    let c = connect(&r.addr).await;
    let http = client();
    // About 530 tokens: 33 of the GPU's 64 blocks.
    let prompt = |seed: u64| warmpath_index::text::words(seed, 300);
    // Prompt 1 through the feeder (router B sees none of it), then others until the engine
    // has offloaded blocks to L1 and the agent reports some under the routers' keys.
    let ask = |seed: u64| {
        let (http, url) = (http.clone(), feeder.url.clone());
        async move {
            let done = post(
                &http,
                &url,
                "/v1/completions",
                completion(&prompt(seed), 1, false),
                &[],
            )
            .await;
            assert_eq!(done.status, 200, "{}", String::from_utf8_lossy(&done.body));
        }
    };
    eventually("prompt 1 offloaded to L1 and reported", || async {
        ask(1).await;
        for seed in 2..5 {
            ask(seed).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let held = c.stats().await.unwrap().residency_blocks as f64;
        // Router B has caught up with the agent, whose L1 holds blocks.
        held > 0.0 && observed_holders(&router.url).await == held && {
            let l1 = c.stats().await.unwrap().l1.blocks;
            l1 > 0
        }
    })
    .await;
    // Push prompt 1 out of the GPU once more, wait for B to catch up, then ask B once.
    for seed in 5..8 {
        ask(seed).await;
    }
    eventually("router B to catch up with the agent", || async {
        let held = c.stats().await.unwrap().residency_blocks as f64;
        observed_holders(&router.url).await == held
    })
    .await;
    let e = explained(&http, &router.url, &prompt(1)).await;
    let l1 = e["matched"]["l1_observed"].as_u64().unwrap_or(0);
    assert!(l1 >= 4, "router B found {l1} blocks of prompt 1 in L1: {e}");
}

/// Issue 24, prefetch for a block-API engine: engine-sim puts what its GPU evicts into its
/// agent under its own hashes (written through to Redis, pushed out of a small L1), and the
/// agent reports them under the routers' keys (record 0124). A router that never saw the
/// prompt finds it in L2 on that engine and hints its keys; the agent reads them back to
/// the engine's blocks and loads those from Redis into L1 (before, it looked the routers'
/// keys up in L2 and counted every block a miss).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_hint_finds_what_an_engine_put_under_its_own_hashes() {
    const BLOCK_TOKENS: u32 = 16;
    let redis = Redis::start();
    let redis_url = redis.url();
    let mut r = Residency::start_offloading(
        "residency-prefetch-engine",
        &small_l1_over_redis(&redis_url),
    );
    let metrics_url = metrics_url_of(&mut r.agent);
    let config = r.pool_config("router.toml", &[&r.engine.url], BLOCK_TOKENS);
    let feeder = crate::router_from_config(&config, &r.certs);
    // Router B serves dry runs (`/debug/route`), which send no hint.
    let router = crate::router_from_config_with(&config, &r.certs, &["--fault-injection"]);
    let http = client();
    into_l2_only(&http, &feeder.url, &router.url).await;
    assert_eq!(prefetch_blocks(&metrics_url, "loaded").await, 0.0);
    // Router B routes prompt 1: it hints the blocks past L1, and the agent loads the
    // engine's own blocks of them from Redis.
    complete_short(&http, &router.url, 1).await;
    eventually("the engine's blocks of prompt 1 prefetched", || async {
        prefetch_found(&metrics_url).await >= 16.0
    })
    .await;
}

/// Record 0126: a block another host's engine stored in the shared L2 is found by its
/// alias. Host A's engine stores a prompt, which leaves its GPU and L1 for Redis; its
/// agent writes an alias for each pool key of it. Host A's engine then goes away, a router
/// that never saw the prompt routes it to host B with a prefetch hint, and B's agent, which
/// never saw an event of those blocks, reads the aliases and finds A's blocks in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_hint_finds_another_hosts_blocks_by_their_aliases() {
    const BLOCK_TOKENS: u32 = 16;
    let redis = Redis::start();
    let redis_url = redis.url();
    let agent_args = small_l1_over_redis(&redis_url);
    let mut a = Residency::start_offloading("residency-alias-a", &agent_args);
    let mut b = a.another_offloading_host("residency-alias-b", &agent_args);
    let (metrics_a, metrics_b) = (metrics_url_of(&mut a.agent), metrics_url_of(&mut b.agent));
    let feeder_config = a.pool_config("feeder.toml", &[&a.engine.url], BLOCK_TOKENS);
    let feeder = crate::router_from_config(&feeder_config, &a.certs);
    let config = a.dir.join("router.toml");
    std::fs::write(
        &config,
        format!(
            "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{}\", \"{}\"]\n\
             agents = [\"{}\", \"{}\"]\ntokenizer = \"tiktoken:o200k_base\"\n\
             block_tokens = {BLOCK_TOKENS}\n",
            a.engine.url, b.engine.url, a.quic, b.quic
        ),
    )
    .unwrap();
    // The router serves dry runs (`/debug/route`), which send no hint.
    let router = crate::router_from_config_with(&config, &a.certs, &["--fault-injection"]);
    let http = client();
    // Prompt 1 on host A, until it has left A's GPU and L1 for Redis.
    into_l2_only(&http, &feeder.url, &router.url).await;
    eventually("host A's aliases written", || async {
        agent_counter(&metrics_a, "warmpath_agent_aliases_total", "written").await >= 16.0
    })
    .await;
    // Host A's engine goes; the router sends host B other prompts (B's engine offloads
    // some: its agent learns the layout it stores) until it routes prompt 1 there.
    // B's agent must have taken a put (it prefetches only the layouts its engines store).
    a.engine.kill();
    let b_agent = connect(&b.addr).await;
    let wait = Duration::from_secs(30);
    eventually_within(wait, "the router routes prompt 1 to host B", || async {
        for seed in 10..13 {
            complete_short(&http, &router.url, seed).await;
        }
        let stored = b_agent.stats().await.unwrap().l1.blocks > 0;
        stored
            && dry_route(&http, &router.url, 1).await["instance"].as_str()
                == Some(b.engine.url.as_str())
    })
    .await;
    // The hint resolves the router's keys through A's aliases, then reads what B's L1
    // lacks into it; a block it did not find would count as a miss.
    let before = prefetch_found(&metrics_b).await;
    complete_short(&http, &router.url, 1).await;
    eventually_within(
        wait,
        "host A's blocks of prompt 1 found by B's prefetch",
        || async { prefetch_found(&metrics_b).await >= before + 16.0 },
    )
    .await;
    assert!(agent_counter(&metrics_b, "warmpath_agent_aliases_total", "read").await >= 16.0);
}

/// Records 0115, 0117 and 0122, coarse residency: an agent in its default mode reports one
/// key per 64 tokens of what its engine stores (one in 4 of these 16-token blocks, as of
/// vLLM's default size) for a chain's first 4,096 tokens and fewer past them, and a router
/// that never saw the prompt credits
/// each reported key for the blocks before it: it matches the prompt's stored chain (to
/// its last reported key), all of it observed, far deeper than the blocks it was told of,
/// and routes the prompt to that engine rather than to the other one of the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_learns_a_sampled_chain_from_a_real_agent_and_routes_on_it() {
    const BLOCK_TOKENS: u32 = 16;
    let engine_args = ["--block-tokens", "16", "--tokenizer", "tiktoken:o200k_base"];
    let mut r = Residency::start(
        "residency-sampled",
        &engine_args,
        &["--metrics-listen", "127.0.0.1:0"],
    );
    let metrics_url = metrics_url_of(&mut r.agent);
    let other = crate::engine_sim("50", &engine_args);
    let config = r.pool_config("router.toml", &[&r.engine.url, &other.url], BLOCK_TOKENS);
    // A router whose pool is the agent's engine alone feeds it prompts (a router adds the
    // tenant's cache salt, by which the agent knows whose blocks they are).
    let feeder_config = r.pool_config("feeder.toml", &[&r.engine.url], BLOCK_TOKENS);
    let feeder = crate::router_from_config(&feeder_config, &r.certs);
    let router = crate::router_from_config(&config, &r.certs);
    let c = connect(&r.addr).await;
    let http = client();
    // Long prompts to the agent's engine through the feeder (the router under test sees
    // none) until the agent reports blocks of one: the prompt's reported blocks are what
    // its count grew by.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (prompt, blocks, reported) = 'found: {
        for seed in 1100.. {
            // Long enough to pass 4,096 tokens, past which reported keys thin out with
            // depth (record 0122).
            let prompt = warmpath_index::text::words(seed, 24_000);
            let before = c.stats().await.unwrap().residency_blocks;
            let body = completion(&prompt, 1, false);
            let done = post(&http, &feeder.url, "/v1/completions", body, &[]).await;
            assert_eq!(done.status, 200);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let after = c.stats().await.unwrap().residency_blocks;
            if after > before {
                break 'found (
                    prompt,
                    prompt_tokens(&done.json()) / u64::from(BLOCK_TOKENS),
                    after - before,
                );
            }
            assert!(
                Instant::now() < deadline,
                "the agent never reported a store: {:?}",
                c.stats().await.unwrap()
            );
        }
        unreachable!()
    };
    // One key in 4 for the first 256 blocks, then fewer: far fewer than one in 4 of a
    // chain this long.
    assert!(blocks >= 512, "{blocks} blocks");
    assert!(
        reported * 5 < blocks,
        "{reported} of {blocks} blocks reported"
    );
    eventually("the router to observe what the agent reports", || async {
        let held = c.stats().await.unwrap().residency_blocks as f64;
        observed_holders(&router.url).await == held
    })
    .await;
    let e = explained(&http, &router.url, &prompt).await;
    assert_eq!(e["instance"], r.engine.url.as_str(), "{e}");
    let gpu = e["matched"]["gpu"].as_u64().unwrap_or(0);
    assert_eq!(e["matched"]["gpu_observed"].as_u64(), Some(gpu), "{e}");
    // Credited for the unreported blocks before each reported key: the run is many times
    // the blocks reported, and never past what the engine stored.
    assert!(
        gpu > 2 * reported && gpu <= blocks,
        "matched {gpu} of {blocks} blocks, {reported} reported: {e}"
    );
    // Both routers follow the agent over version 2 of the link (record 0123).
    let links = |version: &str| {
        let url = metrics_url.clone();
        let name = format!("warmpath_agent_residency_links_total{{version=\"{version}\"}}");
        async move { crate::router::metric(&get_text(&url).await, &name) }
    };
    assert!(links("2").await >= 2.0 && links("1").await == 0.0);
    println!("sampled residency: {blocks} blocks stored, {reported} reported, {gpu} matched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_with_the_same_prompt_never_see_each_others_residency() {
    let r = Residency::start(
        "residency-tenants",
        &["--block-tokens", "64"],
        // Every block reported: tenant a's 11-block prompt must match two blocks or more.
        &[
            "--kv-tenant",
            "a",
            "--kv-tenant",
            "b",
            "--residency-every-block",
        ],
    );
    let addr = &r.addr;
    let config = r.dir.join("router.toml");
    std::fs::write(
        &config,
        "version = 1\n[[tenants]]\nid = \"a\"\napi_keys = [\"key-a\"]\nallow_explain = true\n\
         [[tenants]]\nid = \"b\"\napi_keys = [\"key-b\"]\nallow_explain = true\n",
    )
    .unwrap();
    let config_s = config.to_str().unwrap();
    let (ra, rb) = (
        r.router(&["--config", config_s]),
        r.router(&["--config", config_s]),
    );
    let c = connect(addr).await;
    let http = client();
    let ask = |url: String, key: &'static str, prompt: String| {
        let http = http.clone();
        async move {
            let r = post(
                &http,
                &url,
                "/v1/completions",
                completion(&prompt, 1, false),
                &[("authorization", key), ("x-warmpath-explain", "1")],
            )
            .await;
            assert_eq!(r.status, 200);
            serde_json::from_slice::<Value>(r.headers.get("x-warmpath-explain").unwrap().as_bytes())
                .unwrap()
        }
    };
    // Tenant a's prompt through router A, until the agent has seen a store of it.
    let prompt = first_stored_prompt(&c, 700, |p| {
        let url = ra.url.clone();
        let ask = &ask;
        async move {
            ask(url, "Bearer key-a", p).await;
        }
    })
    .await;
    eventually("router B to catch up with the agent", || async {
        observed_holders(&rb.url).await == c.stats().await.unwrap().residency_blocks as f64
    })
    .await;
    // The same prompt as tenant b finds nothing; as tenant a, what the agent reported.
    let as_b = ask(rb.url.clone(), "Bearer key-b", prompt.clone()).await;
    assert_eq!(as_b["matched"]["gpu"].as_u64(), Some(0), "{as_b}");
    let as_a = ask(rb.url.clone(), "Bearer key-a", prompt).await;
    assert!(
        as_a["matched"]["gpu_observed"].as_u64().unwrap_or(0) >= 2,
        "{as_a}"
    );
    let s = c.stats().await.unwrap();
    assert_eq!(s.kv_unresolved, 0, "{s:?}");
}

/// A hand-written Unix client (std, blocking): shakes hands, then sends frames whose first
/// byte carries `fds` (`SCM_RIGHTS`), as a sealed put does, and reads the answers.
struct RawUnix(std::os::unix::net::UnixStream);

impl RawUnix {
    fn connect(sock: &std::path::Path) -> RawUnix {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.write_all(&proto::encode_hello(b"").unwrap()).unwrap();
        let mut prefix = [0u8; 9];
        s.read_exact(&mut prefix).unwrap();
        let (version, status, len) = proto::decode_welcome_prefix(&prefix).unwrap();
        assert_eq!((version, status, len), (proto::VERSION, proto::HELLO_OK, 0));
        RawUnix(s)
    }

    fn send(&mut self, id: u64, request: &Request, fds: &[std::os::fd::BorrowedFd<'_>]) {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let frame = proto::encode_frame(id, request, Vec::new());
        let mut space =
            vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len().max(1)))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        }
        let n = rustix::net::sendmsg(
            &self.0,
            &[std::io::IoSlice::new(&frame.head)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        assert_eq!(n, frame.head.len());
    }

    /// The next answer, or None when the agent closed the connection.
    fn answer(&mut self) -> Option<(u64, Response)> {
        use std::io::Read;
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len).ok()?;
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        self.0.read_exact(&mut body).ok()?;
        let frame = proto::decode_body::<Response>(Bytes::from(body)).unwrap();
        Some((frame.id, frame.header))
    }
}

/// A memfd holding `bytes`, unsealed (what a careless or hostile engine might pass).
fn memfd_of(bytes: &[u8]) -> std::fs::File {
    use std::os::unix::fs::FileExt;
    let fd = rustix::fs::memfd_create("test-block", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    let f = std::fs::File::from(fd);
    f.write_all_at(bytes, 0).unwrap();
    f
}

/// Sealed blocks (record 0120) through a real agent: the crate's client on the Unix socket
/// puts and gets memfds; they come back byte for byte over the socket too, through L1's
/// eviction into Redis and back, and from blocks that were put through the socket; a second
/// writer of other bytes is refused and the first bytes stay; the writer cannot change a
/// block it passed (the agent sealed it); and descriptors that are not a block of the
/// announced length (a pipe, a short memfd), none at all, or on TCP, are clear errors that
/// store nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_blocks_cross_the_unix_socket_as_memfds_and_nothing_else_does() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    let redis = Redis::start();
    let (agent, addr, sock, metrics_url) = agent_on_unix(
        "agent-sealed",
        &["--l1-bytes", "1MiB", "--l2", &redis.url()],
    );
    const LEN: usize = 256 << 10;
    let u = AgentClient::connect(&AgentAddr::Unix(sock.clone()), "", TIMEOUT)
        .await
        .unwrap();
    assert!(
        u.is_sealed(),
        "a Unix client of a version-3 agent passes memfds"
    );
    let t = connect(&addr).await;
    assert!(!t.is_sealed());

    // Six blocks into an L1 of four: two are evicted into Redis (read out of their memfds).
    put_chain(&u, 1..7, LEN).await;
    let keys: Vec<u64> = (1..7).collect();
    eventually("evicted sealed blocks written to redis", || async {
        let (lease, tiers) = u.lookup(LAYOUT, keys.clone(), TIMEOUT).await.unwrap();
        u.release(lease).await.unwrap();
        tiers.len() == 6
    })
    .await;
    // L1 holds the four it has room for as memfds, and says so.
    eventually("four sealed blocks counted", || async {
        let text = get_text(&metrics_url).await;
        text.lines()
            .find(|l| l.starts_with("warmpath_agent_sealed_blocks "))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            == Some(4.0)
    })
    .await;
    // Sealed gets (L1's memfds as they are, L2's blocks as payloads) and socket gets (L1's
    // memfds read into memory) bring back the same bytes.
    for c in [&u, &t] {
        eventually("every block in L1 or L2", || async {
            let (lease, tiers) = u.lookup(LAYOUT, keys.clone(), TIMEOUT).await.unwrap();
            u.release(lease).await.unwrap();
            tiers.len() == 6
        })
        .await;
        let got = c.get(LAYOUT, keys.clone()).await.unwrap();
        for (k, g) in keys.iter().zip(&got) {
            let g = g.as_ref().unwrap_or_else(|| panic!("block {k} is served"));
            assert_eq!(g.payload, payload(*k, LEN), "block {k}");
        }
        assert!(got.iter().flatten().any(|g| g.tier == StoreTier::L2));
    }
    // A block put through the socket comes back with the sealed ones, as a payload.
    let plain = AgentClient::connect(&AgentAddr::Unix(sock.clone()), "", TIMEOUT)
        .await
        .unwrap()
        .without_sealed();
    put_chain(&plain, 100..101, LEN).await;
    let got = u.get(LAYOUT, vec![100]).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap().payload, payload(100, LEN));

    // First writer wins: other bytes under a held key are refused, the same bytes refresh.
    let other = u
        .put(LAYOUT, vec![(100, payload(7, LEN), false)])
        .await
        .unwrap();
    assert_eq!(other.refused, vec![(0, PutRefusal::Conflict)]);
    let same = u
        .put(LAYOUT, vec![(100, payload(100, LEN), false)])
        .await
        .unwrap();
    assert_eq!((same.stored, same.refused.len()), (1, 0));
    assert_eq!(
        t.get(LAYOUT, vec![100]).await.unwrap()[0]
            .as_ref()
            .unwrap()
            .payload,
        payload(100, LEN)
    );

    // By hand: a memfd passed unsealed is sealed by the agent, and its writer can no longer
    // change it.
    let mut raw = RawUnix::connect(&sock);
    let item = |key, bytes| proto::PutItem {
        key,
        bytes,
        pin: false,
    };
    let mine = memfd_of(&payload(200, LEN));
    raw.send(
        1,
        &Request::PutSealed {
            layout: LAYOUT,
            blocks: vec![item(200, LEN as u32)],
        },
        &[mine.as_fd()],
    );
    assert!(matches!(
        raw.answer(),
        Some((1, Response::Put { stored: 1, .. }))
    ));
    assert!(
        mine.write_all_at(b"changed", 0).is_err(),
        "a sealed block cannot be written"
    );
    assert_eq!(
        t.get(LAYOUT, vec![200]).await.unwrap()[0]
            .as_ref()
            .unwrap()
            .payload,
        payload(200, LEN)
    );

    // A pipe is no block; nor is a memfd shorter than announced: the put stores nothing,
    // and the connection goes on.
    let (pipe_r, _pipe_w) = rustix::pipe::pipe().unwrap();
    raw.send(
        2,
        &Request::PutSealed {
            layout: LAYOUT,
            blocks: vec![item(201, 16)],
        },
        &[pipe_r.as_fd()],
    );
    match raw.answer() {
        Some((2, Response::Error { kind, message })) => {
            assert_eq!(kind, proto::ErrorKind::BadRequest);
            assert!(message.contains("not a sealable memfd"), "{message}");
        }
        other => panic!("a pipe's put answered {other:?}"),
    }
    let short = memfd_of(&payload(202, 100));
    raw.send(
        3,
        &Request::PutSealed {
            layout: LAYOUT,
            blocks: vec![item(202, LEN as u32)],
        },
        &[short.as_fd()],
    );
    match raw.answer() {
        Some((3, Response::Error { kind, message })) => {
            assert_eq!(kind, proto::ErrorKind::BadRequest);
            assert!(message.contains("were announced"), "{message}");
        }
        other => panic!("a short memfd's put answered {other:?}"),
    }
    assert_eq!(
        t.get(LAYOUT, vec![201, 202]).await.unwrap(),
        vec![None, None]
    );
    // A sealed put with no descriptor is out of step: an error, then the connection ends.
    raw.send(
        4,
        &Request::PutSealed {
            layout: LAYOUT,
            blocks: vec![item(203, 16)],
        },
        &[],
    );
    match raw.answer() {
        Some((4, Response::Error { kind, message })) => {
            assert_eq!(kind, proto::ErrorKind::Malformed);
            assert!(message.contains("0 descriptors"), "{message}");
        }
        other => panic!("a put without its descriptors answered {other:?}"),
    }
    assert!(raw.answer().is_none(), "the connection ends");

    // Over TCP there are no descriptors: a sealed request is refused, the connection stays.
    let mut tcp = tokio::net::TcpStream::connect(match &addr {
        AgentAddr::Tcp(a) => a.clone(),
        AgentAddr::Unix(_) => unreachable!(),
    })
    .await
    .unwrap();
    tcp.write_all(&proto::encode_hello(b"").unwrap())
        .await
        .unwrap();
    let mut welcome = [0u8; 9];
    tcp.read_exact(&mut welcome).await.unwrap();
    let frame = proto::encode_frame(
        9,
        &Request::GetSealed {
            layout: LAYOUT,
            keys: vec![1],
        },
        Vec::new(),
    );
    tcp.write_all(&frame.head).await.unwrap();
    let mut len = [0u8; 4];
    tcp.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    tcp.read_exact(&mut body).await.unwrap();
    match proto::decode_body::<Response>(Bytes::from(body))
        .unwrap()
        .header
    {
        Response::Error { kind, message } => {
            assert_eq!(kind, proto::ErrorKind::BadRequest);
            assert!(message.contains("Unix socket only"), "{message}");
        }
        other => panic!("a sealed get over TCP answered {other:?}"),
    }
    let stats = t.stats().await.unwrap();
    assert!(stats.l1.bytes <= 1 << 20, "{stats:?}");
    // L1's memfds are open descriptors: the agent raised its soft limit to the hard one.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", agent.pid())).unwrap();
    let files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a limit on open files")
        .split_whitespace()
        .collect();
    assert_eq!(files[3], files[4], "soft and hard limits: {files:?}");
    drop(redis);
}

/// engine-sim on the agent's Unix socket: its offloads (blocks of about 100 KiB here) go as
/// sealed memfds, which the agent keeps as L1 blocks, and a prompt pushed out of the GPU
/// comes back from them byte for byte (engine-sim checks every block it loads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sim_offloads_sealed_blocks_over_the_unix_socket() {
    let (_agent, _, sock, metrics_url) =
        agent_on_unix("agent-sealed-engine", &["--l1-bytes", "32MiB"]);
    // Blocks of about 100 KiB: past the 64 KiB from which puts go as memfds.
    let engine = offloading_engine(&format!("unix:{}", sock.display()), "0.05");
    complete_long(&client(), &engine.url, 1, 2).await;
    eventually_loaded_from_l1("prompt 1 loaded from sealed L1 blocks", &engine).await;
    // The agent publishes its L1 gauges every 100 ms.
    eventually("L1 holding the engine's blocks as memfds", || async {
        crate::router::metric(
            &get_text(&metrics_url).await,
            "warmpath_agent_sealed_blocks",
        ) > 0.0
    })
    .await;
    let text = get_text(&format!("{}/metrics", engine.url)).await;
    let name = |op: &str| {
        format!("warmpath_engine_agent_blocks_total{{model_name=\"sim-llama\",op=\"{op}\"}}")
    };
    assert!(text.contains(&name("bad")), "{text}");
    assert_eq!(
        crate::router::metric(&text, &name("bad")),
        0.0,
        "every block loaded back is the one offloaded"
    );
    assert!(
        crate::router::metric(&text, &name("fetched")) > 0.0,
        "{text}"
    );
}
