//! KV events checked with vLLM's own code (vLLM 0.33.0's `vllm/distributed/kv_events.py`,
//! loaded alone by `tests/clients/vllm_kv_events.py` from the venv of
//! tests/tools/setup-venv.sh): engine-sim's stream decodes with vLLM's types to the same
//! bytes, and what vLLM's `ZmqEventPublisher` sends (GPU blocks, the CPU offload's chunks,
//! LMCache's chunks, a LoRA block, removals, a clear) reaches a router through a real
//! agent, block for block.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use warmpath_cache_agent::client::{AgentAddr, AgentClient};
use warmpath_cache_agent::kv_events::{encode_batch, EngineHash, KvEvent, Shape};

use crate::router::{client, completion, get_text, long_prompt, metric, post, HttpClient};
use crate::{scratch_dir, Proc};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/clients/vllm_kv_events.py")
}

/// The venv's python and vLLM 0.33.0's kv_events.py.
fn vllm() -> (PathBuf, PathBuf) {
    let venv = crate::test_venv();
    let kv_events = venv.join("reference/vllm-0.33.0/kv_events.py");
    assert!(kv_events.exists(), "{} is missing", kv_events.display());
    (venv.join("bin/python"), kv_events)
}

fn python(args: &[&str]) -> Command {
    let (python, kv_events) = vllm();
    let mut c = Command::new(python);
    c.arg(script()).arg(kv_events).args(args);
    c
}

/// What vLLM 0.33's `KVEventBatch` decoder says of `batch`: `Ok` or its error.
fn vllm_decodes(batch: &[u8]) -> Result<(), String> {
    let hex: String = batch.iter().map(|b| format!("{b:02x}")).collect();
    let out = python(&["decode-hex", &hex]).output().expect("python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    match v["ok"].as_bool() {
        Some(true) => Ok(()),
        _ => Err(v["error"].as_str().unwrap_or_default().to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sim_publishes_what_vllm_033s_own_types_decode() {
    // The shape engine-sim sent before (events as tagged arrays, vLLM <= 0.23) is what
    // 0.33's types refuse; the one it sends now is what they read.
    let stored = KvEvent::Stored {
        block_hashes: vec![EngineHash(7u64.to_be_bytes().to_vec())],
        parent: None,
        token_ids: (0..16).collect(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: vec![vec!["salt".into()]],
    };
    let old = vllm_decodes(&encode_batch(
        0.5,
        std::slice::from_ref(&stored),
        Shape::Array,
    ));
    assert!(
        old.as_ref()
            .is_err_and(|e| e.contains("Expected `object`, got `array`")),
        "{old:?}"
    );
    assert_eq!(
        vllm_decodes(&encode_batch(0.5, &[stored], Shape::VllmMaps)),
        Ok(())
    );

    // engine-sim's real stream: every batch decodes with vLLM's types and encodes back to
    // the very bytes engine-sim sent.
    let events = format!("tcp://{}", crate::free_addr());
    let engine = crate::engine_sim("50", &["--kv-events", &events]);
    let mut decoder = python(&["decode", &events, "4", "60"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs");
    let http = client();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seed = 0;
    // A subscriber misses what was published before it joined: serve prompts until it has
    // its batches.
    while decoder.try_wait().expect("the decoder").is_none() {
        assert!(Instant::now() < deadline, "the decoder never finished");
        seed += 1;
        let r = post(
            &http,
            &engine.url,
            "/v1/completions",
            completion(&long_prompt(seed), 1, false),
            &[],
        )
        .await;
        assert_eq!(r.status, 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = decoder.wait_with_output().expect("its output");
    let report: Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    println!("engine-sim through vLLM 0.33's types: {report}");
    assert_eq!(report["errors"], json!([]), "{report}");
    assert_eq!(report["batches"], 4, "{report}");
    assert_eq!(report["equal"], 4, "re-encoded differently: {report}");
    assert!(
        report["events"]["BlockStored"].as_u64() > Some(0),
        "{report}"
    );
    assert!(
        report["ranks"].as_array().unwrap().iter().all(|r| r == 0),
        "{report}"
    );
    let first = &report["first_stored"];
    assert_eq!(first["medium"], "'GPU'", "{report}");
    assert_eq!(first["group_idx"], "0", "{report}");
}

/// vLLM's publisher, driven step by step.
struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The prompts' token ids and the block size, as the script printed them.
    plan: Value,
}

impl Publisher {
    fn start(endpoint_port: u16, replay: &str, salt: &str) -> Publisher {
        let bind = format!("tcp://*:{endpoint_port}");
        let mut child = python(&["publish", &bind, replay, salt])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python runs");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).expect("the plan");
        let plan = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        Publisher {
            child,
            stdin,
            stdout,
            plan,
        }
    }

    fn step(&mut self, step: &str) {
        writeln!(self.stdin, "{step}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), format!("ok {step}"));
    }

    fn prompt(&self, name: &str) -> Vec<u32> {
        self.plan[name]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The depths a router matched for a prompt of token ids to `model`: (GPU blocks an agent
/// reported, blocks in the GPU or the host's L1).
async fn matched(http: &HttpClient, router: &str, model: &str, tokens: &[u32]) -> (u64, u64) {
    let body = json!({"model": model, "prompt": tokens, "max_tokens": 1}).to_string();
    let r = post(
        http,
        router,
        "/v1/completions",
        body,
        &[("x-warmpath-explain", "1")],
    )
    .await;
    // engine-sim serves no adapter: it answers a request for one 404, which the router
    // passes on with its explanation.
    let answered = if model == "sim-llama" { 200 } else { 404 };
    assert_eq!(r.status, answered, "{:?}", String::from_utf8_lossy(&r.body));
    let e: Value = serde_json::from_slice(r.headers["x-warmpath-explain"].as_bytes()).unwrap();
    let m = &e["matched"];
    (
        m["gpu_observed"].as_u64().unwrap(),
        m["gpu_observed"].as_u64().unwrap() + m["l1_observed"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_publisher_lmcaches_chunks_and_lora_reach_a_router_block_for_block() {
    let dir = scratch_dir("kv-events-vllm");
    let certs = crate::make_certs(&dir, &["--agent", "agent", "--router", "router"]);
    let certs_s = certs.to_str().unwrap();
    // The instance the events are about (engine-sim answers the router's requests).
    let engine = crate::engine_sim("50", &[]);
    let salt = warmpath_index::keys::default_cache_salt("default");
    let events_port = crate::free_addr().port();
    let replay = format!("tcp://{}", crate::free_addr());
    let mut vllm = Publisher::start(events_port, &replay, &salt);
    assert_eq!(vllm.plan["block_tokens"], 16);
    let quic = warmpath_testkit::free_udp_addr().to_string();
    let metrics = crate::free_addr().to_string();
    let agent = Proc::start(&[
        "agent",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        &metrics,
        "--kv-events",
        &format!("{}=tcp://127.0.0.1:{events_port},{replay}", engine.url),
        "--kv-tenant",
        "default",
        // Block for block (record 0115's coarse residency is tested in agent.rs).
        "--residency-every-block",
        "--residency-listen",
        &quic,
        "--tls-dir",
        certs_s,
        "--tls-name",
        "agent",
    ]);
    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        format!(
            "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{}\"]\n\
             agents = [\"agent@{quic}\"]\nblock_tokens = 16\nadapters = [\"sql-lora\"]\n",
            engine.url
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
    // A subscriber misses what was published before it joined: a throwaway block until
    // the agent has it, then its removal.
    let deadline = Instant::now() + Duration::from_secs(20);
    while held().await != 1 {
        assert!(Instant::now() < deadline, "the agent never subscribed");
        vllm.step("probe");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    vllm.step("unprobe");
    let http = client();
    let (p, s, q, r) = (
        vllm.prompt("P"),
        vllm.prompt("S"),
        vllm.prompt("Q"),
        vllm.prompt("R"),
    );
    // Each step, the pool blocks the agent then reports, and what the router matches of
    // each prompt (GPU, GPU or L1), in 16-token blocks; "R@sql-lora" asks for R under the
    // pool's adapter, every other prompt for the base model.
    type Want<'a> = Vec<(&'a str, &'a [u32], (u64, u64))>;
    let steps: Vec<(&str, u64, Want)> = vec![
        // vLLM's GPU blocks: 4 of P, 1 of S, 2 of Q.
        (
            "gpu",
            7,
            vec![("P", &p, (4, 4)), ("S", &s, (1, 1)), ("Q", &q, (2, 2))],
        ),
        // vLLM 0.11's CPU chunk of 48 tokens under P's third GPU block: P's 3 first blocks
        // in L1 too (hidden behind the GPU's 4) ...
        ("vllm_cpu_48", 10, vec![("P", &p, (4, 4))]),
        // ... until the GPU evicts blocks 1 to 3: block 0 on the GPU, 0 to 2 in L1.
        ("evict_gpu", 7, vec![("P", &p, (1, 3))]),
        // vLLM 0.33's self-describing CPU chunk of S: three 16-token blocks in L1.
        ("vllm_cpu_self_describing", 10, vec![("S", &s, (1, 3))]),
        // LMCache's chunks of Q (256, 256, 88 tokens): 16 + 16 + 5 blocks in L1, the
        // tenant found through the GPU chain of Q's first block.
        ("lmcache", 47, vec![("Q", &q, (2, 37))]),
        // A LoRA block pair: keyed for the adapter, which a request for the adapter
        // matches and a base-model request never does.
        (
            "lora",
            49,
            vec![("R@sql-lora", &r, (2, 2)), ("R", &r, (0, 0))],
        ),
        // LMCache evicts its second chunk: the 16 blocks it alone covered go.
        ("remove_chunk", 33, vec![("Q", &q, (2, 16))]),
        // A prefix-cache reset: the engine's view is dropped.
        (
            "clear",
            0,
            vec![("P", &p, (0, 0)), ("Q", &q, (0, 0)), ("S", &s, (0, 0))],
        ),
    ];
    for (step, blocks, wants) in steps {
        vllm.step(step);
        crate::until(
            Duration::from_secs(10),
            &format!("{step}: the agent to hold {blocks} pool blocks"),
            move || async move { (held().await == blocks).then_some(()) },
        )
        .await;
        for (name, tokens, want) in wants {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let model = name.split_once('@').map_or("sim-llama", |(_, m)| m);
                let got = matched(&http, &router.url, model, tokens).await;
                if got == want {
                    println!("{step}: {name} matched {got:?} (GPU, GPU or L1)");
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{step}: the router matched {got:?} of {name}, not {want:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let s = c.stats().await.unwrap();
    assert_eq!(
        (s.kv_gaps, s.kv_malformed, s.kv_unresolved),
        (0, 0, 0),
        "{s:?}"
    );
    // The agent rebuilt its view when it started, from vLLM 0.33's replay socket, whose
    // answers carry the topic frame that vLLM 0.26 added.
    let text = get_text(&format!("http://{metrics}/metrics")).await;
    assert!(
        metric(&text, "warmpath_agent_kv_resyncs_total") >= 1.0,
        "no resync through vLLM's replay socket: {text}"
    );
}

/// An agent given the pool's block size (`--kv-block-tokens 16`) reports LMCache's CPU
/// chunks that came before any GPU store (an agent started while its engine kept serving,
/// whose resync replays them); one left to learn the size from a GPU store cannot cut them
/// and reports nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_given_the_pools_block_size_reports_cpu_chunks_before_any_gpu_store() {
    // LMCache's chunks of Q (256, 256, 88 tokens), published before any agent follows:
    // vLLM's replay socket keeps them.
    let events_port = crate::free_addr().port();
    let replay = format!("tcp://{}", crate::free_addr());
    let mut vllm = Publisher::start(events_port, &replay, "");
    vllm.step("lmcache");
    let events = format!("e0=tcp://127.0.0.1:{events_port},{replay}");
    // No --kv-tenant: every chain is the agent's fixed tenant, as LMCache's chunks carry no
    // salt and no GPU chain names one here.
    let agent = |extra: &[&str]| {
        let mut args = vec![
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--kv-events",
            &events,
            // Block for block: every block's key (residency_blocks counts reported ones).
            "--residency-every-block",
        ];
        args.extend_from_slice(extra);
        Proc::start(&args)
    };
    let (sized, learning) = (agent(&["--kv-block-tokens", "16"]), agent(&[]));
    let connect = |url: String| async move {
        AgentClient::connect(&AgentAddr::Tcp(url), "", Duration::from_secs(5))
            .await
            .expect("the agent")
    };
    let (sized_c, learning_c) = (
        connect(sized.url.clone()).await,
        connect(learning.url.clone()).await,
    );
    // 16 + 16 + 5 whole 16-token blocks.
    let s = crate::until(
        Duration::from_secs(20),
        "the sized agent to hold Q's 37 blocks",
        || async {
            let s = sized_c.stats().await.unwrap();
            (s.residency_blocks == 37).then_some(s)
        },
    )
    .await;
    assert_eq!(
        (s.kv_gaps, s.kv_malformed, s.kv_unresolved),
        (0, 0, 0),
        "{s:?}"
    );
    // The other agent applied the same batch and could cut none of it.
    let s = crate::until(
        Duration::from_secs(20),
        "the learning agent to apply the batch",
        || async {
            let s = learning_c.stats().await.unwrap();
            (s.kv_batches >= 1).then_some(s)
        },
    )
    .await;
    assert_eq!(s.residency_blocks, 0, "{s:?}");
}
