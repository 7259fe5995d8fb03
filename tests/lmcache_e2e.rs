//! Issue 25's end-to-end run, with real processes and the clients' own code: LMCache's
//! `SageMakerHyperPodConnector` (lmcache 0.5.6, on CPU) stores a prompt's chunks through
//! a real `warmpath agent` (HyperPod API, KV events), vLLM 0.33's `ZmqEventPublisher`
//! publishes what a vLLM + LMCache engine publishes for them (a GPU block, LMCache's CPU
//! `BlockStored` chunks), and the engine then drops its own copies, so that only the
//! agent's segment holds the prompt. A real `warmpath router` following the agent routes a
//! request for the prompt to the holder's instance on observed L1 residency (of two
//! engine-sims in the pool), and LMCache's connector gets the chunks back byte for byte.
//! The script is tests/clients/lmcache_e2e.py; it runs twice: with LMCache's chunk events
//! built in the shape of its `CacheStoreEvent` (`hand`), and as LMCache's own engine
//! (`LMCacheEngine.store` with `enable_kv_events`, its CPU and remote backends) makes them
//! and vLLM's own LMCache connector turns them into `BlockStored` (`engine`).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use warmpath_cache_agent::client::{AgentAddr, AgentClient};

use crate::router::{client, post};
use crate::{scratch_dir, Proc};

/// The engine's side: LMCache's connector and vLLM's publisher, driven step by step.
struct Engine {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The prompt and LMCache's chunk keys, as the script printed them.
    plan: Value,
}

impl Engine {
    fn start(
        venv: &Path,
        hyperpod: &str,
        shm: &str,
        events_port: u16,
        replay: &str,
        mode: &str,
    ) -> Engine {
        let kv_events = crate::test_venv().join("reference/vllm-0.33.0/kv_events.py");
        assert!(kv_events.exists(), "{} is missing", kv_events.display());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/clients/lmcache_e2e.py");
        let salt = warmpath_index::keys::default_cache_salt("default");
        let mut child = Command::new(venv.join("bin/python"))
            .args(["-W", "ignore"])
            .arg(script)
            .args([hyperpod, shm])
            .arg(kv_events)
            .arg(format!("tcp://*:{events_port}"))
            .args([replay, salt.as_str(), mode])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python runs");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut e = Engine {
            child,
            stdin,
            stdout,
            plan: Value::Null,
        };
        let line = e.line_starting("{");
        e.plan = serde_json::from_str(&line).unwrap_or_else(|err| panic!("{err}: {line:?}"));
        e
    }

    /// The next line that starts with `prefix` (LMCache logs to stdout too: the rest are
    /// printed).
    fn line_starting(&mut self, prefix: &str) -> String {
        loop {
            let mut line = String::new();
            let n = self
                .stdout
                .read_line(&mut line)
                .expect("the script's output");
            assert!(
                n > 0,
                "the script ended before {prefix:?} (its traceback is above)"
            );
            if line.starts_with(prefix) {
                return line.trim().to_string();
            }
            print!("script: {line}");
        }
    }

    fn step(&mut self, step: &str) {
        writeln!(self.stdin, "{step}").unwrap();
        let line = self.line_starting("ok ");
        assert_eq!(line, format!("ok {step}"));
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A segment name no other test or run uses (removed when dropped).
struct Shm(String);

impl Drop for Shm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(Path::new("/dev/shm").join(&self.0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_stores_through_the_agent_and_a_request_is_routed_to_the_holder() {
    run("hand", true).await;
}

/// LMCache 0.5.6's own engine stores the prompt through the agent (its LocalCPUBackend and
/// its RemoteBackend on the HyperPod connector), its events come out of vLLM 0.33's own
/// LMCache connector in the shape [`assert_lmcache_chunk_events`] pins (every chunk but a
/// store call's last carries `block_size + 1` tokens: lmcache/utils.py
/// `convert_tokens_to_list` slices `start..end + 1`), the agent keys them, the router sends
/// a request for the prompt to the holder, and, its CPU tier cleared, the engine retrieves
/// the chunks from the agent byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcaches_own_engine_events_route_a_request_to_the_holder() {
    run("engine", true).await;
}

/// The run with LMCache's chunk events from `mode` (the script's `hand` or `engine`);
/// `residency`: the agent's reports and the router's choice are checked too.
async fn run(mode: &str, residency: bool) {
    let Some(venv) = crate::hyperpod::lmcache_venv() else {
        println!("WARMPATH_SKIP_LMCACHE=1: the LMCache end-to-end run ({mode}) was not run");
        return;
    };
    let dir = scratch_dir("lmcache-e2e");
    let certs = crate::make_certs(
        &dir,
        &["--agent", "agent", "--router", "router", "--loopback"],
    );
    let certs_s = certs.to_str().unwrap();
    // Two engines in the pool; the agent is the holder's host's (its KV events are e0's).
    let (e0, e1) = (crate::engine_sim("50", &[]), crate::engine_sim("50", &[]));
    let shm = Shm(format!(
        "wp-it-e2e-{mode}-{}-{}",
        u8::from(residency),
        std::process::id()
    ));
    let events_port = crate::free_addr().port();
    let replay = format!("tcp://{}", crate::free_addr());
    let quic = warmpath_testkit::free_udp_addr().to_string();
    let kv_events = format!("{}=tcp://127.0.0.1:{events_port},{replay}", e0.url);
    let agent = Proc::start_lines(
        &[
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--hyperpod-listen",
            "127.0.0.1:0",
            "--hyperpod-shm-name",
            &shm.0,
            "--hyperpod-shm-bytes",
            "64MiB",
            "--kv-events",
            &kv_events,
            "--kv-tenant",
            "default",
            "--kv-block-tokens",
            "16",
            // Block for block (record 0115's coarse residency is tested in agent.rs).
            "--residency-every-block",
            "--residency-listen",
            &quic,
            "--tls-dir",
            certs_s,
            "--tls-name",
            "agent",
        ],
        3,
        "warn",
    );
    let hyperpod = agent
        .lines
        .iter()
        .find_map(|l| l.split("hyperpod API on ").nth(1))
        .and_then(|r| r.split(' ').next())
        .unwrap_or_else(|| panic!("no hyperpod line in {:?}", agent.lines))
        .to_string();
    let mut engine = Engine::start(&venv, &hyperpod, &shm.0, events_port, &replay, mode);
    let prompt: Vec<u32> = engine.plan["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let chunks = engine.plan["chunks"].as_array().unwrap().len() as u64;
    println!("LMCache's chunks: {}", engine.plan["chunks"]);
    // LMCache stores whole 256-token chunks by default: 600 tokens are 2 chunks, 32 pool
    // blocks of 16 tokens.
    assert_eq!(chunks, 2);
    let blocks = chunks * 256 / 16;

    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        format!(
            "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{}\", \"{}\"]\n\
             agents = [\"agent@{quic}\"]\nblock_tokens = 16\n",
            e0.url, e1.url
        ),
    )
    .unwrap();
    let router = crate::router_from_config(&config, &certs);

    let c = AgentClient::connect(
        &AgentAddr::Tcp(agent.url.clone()),
        "",
        Duration::from_secs(5),
    )
    .await
    .expect("the agent");
    let c = &c;
    let held = move || async move { c.stats().await.unwrap().residency_blocks };
    // A subscriber misses what was published before it joined.
    let deadline = Instant::now() + Duration::from_secs(30);
    while held().await != 1 {
        assert!(Instant::now() < deadline, "the agent never subscribed");
        engine.step("probe");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    engine.step("unprobe");
    crate::until(
        Duration::from_secs(10),
        "the probe's removal",
        move || async move { (held().await == 0).then_some(()) },
    )
    .await;

    // LMCache stores the chunks through the agent before any event names them: the agent
    // cannot key them yet, and reports nothing.
    engine.step("store");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(held().await, 0, "objects reported before their events");
    // The step's events: the GPU block (the tenant's salt), then LMCache's chunks: 1 GPU
    // block and the chunks' pool blocks in L1.
    if mode == "engine" {
        writeln!(engine.stdin, "events").unwrap();
        let line = engine.line_starting("events ");
        let events: Value = serde_json::from_str(&line["events ".len()..]).unwrap();
        println!("LMCache's chunk events, as vLLM publishes them: {events}");
        assert_lmcache_chunk_events(&events, &prompt);
        assert_eq!(engine.line_starting("ok "), "ok events");
    } else {
        engine.step("events");
    }
    let stats = move || async move { c.stats().await.unwrap() };
    let deadline = Instant::now() + Duration::from_secs(10);
    while residency && held().await != 1 + blocks {
        assert!(
            Instant::now() < deadline,
            "the agent holds {} blocks, not 1 + {blocks}: {:?}",
            held().await,
            stats().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The engine drops its own copies (GPU, LMCache's CPU tier): the agent's segment
    // still holds the chunks, so their blocks stay reported in L1. (LMCache 0.5.6's engine
    // publishes no removal of its CPU chunks, so in `engine` mode their events still
    // cover them too; the load below then comes from the agent all the same.)
    engine.step("drop_local");
    if residency {
        crate::until(
            Duration::from_secs(10),
            &format!("the agent to hold the segment's {blocks} blocks"),
            move || async move { (held().await == blocks).then_some(()) },
        )
        .await;
        routed_to_the_holder(&router.url, &prompt, blocks, &e0.url).await;
    }

    // The holder's LMCache loads the chunks from the agent: byte for byte.
    writeln!(engine.stdin, "get").unwrap();
    let got = engine.line_starting("got ");
    println!("{got}");
    assert!(got.ends_with("byte-equal"), "{got}");
    assert_eq!(engine.line_starting("ok "), "ok get");
    let s = stats().await;
    assert_eq!(s.kv_gaps, 0, "{s:?}");
    if residency {
        assert_eq!((s.kv_malformed, s.kv_unresolved), (0, 0), "{s:?}");
    }
}

/// A request for the prompt (from another engine's client) goes to the holder, on its
/// `blocks` pool blocks observed in L1.
async fn routed_to_the_holder(router: &str, prompt: &[u32], blocks: u64, holder: &str) {
    let http = client();
    let body = json!({"model": "sim-llama", "prompt": prompt, "max_tokens": 1}).to_string();
    let explain = crate::until(
        Duration::from_secs(45),
        "the router to match the prompt in the holder's L1",
        || async {
            let r = post(
                &http,
                router,
                "/v1/completions",
                body.clone(),
                &[("x-warmpath-explain", "1")],
            )
            .await;
            assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
            let e: Value =
                serde_json::from_slice(r.headers["x-warmpath-explain"].as_bytes()).unwrap();
            (e["matched"]["l1_observed"].as_u64() == Some(blocks)).then_some(e)
        },
    )
    .await;
    println!("routed: {explain}");
    assert_eq!(explain["matched"]["gpu_observed"], 0, "{explain}");
    assert_eq!(
        explain["instance"]
            .as_str()
            .map(|u| u.trim_end_matches('/')),
        Some(holder.trim_end_matches('/')),
        "not routed to the holder: {explain}"
    );
}

/// What LMCache 0.5.6's `LMCacheEngine.store` makes of the prompt's whole chunks and vLLM
/// 0.33's `LMCacheConnectorV1.get_kv_connector_kv_cache_events` publishes of it: one
/// `BlockStored` per chunk, `block_size` 256, parent the previous chunk (by index), medium
/// "cpu", no extra keys, LoRA or group; the chunk's tokens plus the next one but for the
/// store call's last chunk.
fn assert_lmcache_chunk_events(events: &Value, prompt: &[u32]) {
    let events = events.as_array().expect("a list");
    assert_eq!(events.len(), 2, "{events:?}");
    for (i, e) in events.iter().enumerate() {
        let start = i * 256;
        let tokens = if i + 1 < events.len() { 257 } else { 256 };
        let want = json!({
            "type": "BlockStored",
            "hashes": 1,
            "parent": if i == 0 { Value::Null } else { json!(i - 1) },
            "block_size": 256,
            "tokens": tokens,
            "first": prompt[start],
            "last": prompt[start + tokens - 1],
            "medium": "cpu",
            "extra_keys": null,
            "lora_name": null,
            "lora_id": null,
            "group_idx": null,
        });
        assert_eq!(e, &want, "chunk event {i}");
    }
}
