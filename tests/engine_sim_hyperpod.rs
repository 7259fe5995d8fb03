//! engine-sim speaking to its agent as LMCache does (`--agent-protocol hyperpod`, record
//! 0109): real `warmpath agent` (HyperPod API, segment, KV events, residency), engine-sim
//! and router processes. Computed chunks land in the agent's segment, a later request's
//! admission leases them back and checks their bytes, the agent reports them to the
//! router as L1 through the chunks' CPU KV events (record 0108's join), and a killed agent
//! costs recomputes, never a failed request. Also the demo over the HyperPod API.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::router::{client, completion, get_text, long_prompt, metric, post};
use crate::{scratch_dir, Proc};

/// A segment name no other test or run uses (removed when dropped).
struct Shm(String);

impl Drop for Shm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(Path::new("/dev/shm").join(&self.0));
    }
}

/// The value of `name` (labels as written) at `url`'s `/metrics`.
async fn metric_at(url: &str, name: &str) -> f64 {
    metric(&get_text(&format!("{url}/metrics")).await, name)
}

fn objects(op: &str) -> String {
    format!("warmpath_engine_agent_objects_total{{model_name=\"sim-llama\",op=\"{op}\"}}")
}

fn blocks(op: &str) -> String {
    format!("warmpath_engine_agent_blocks_total{{model_name=\"sim-llama\",op=\"{op}\"}}")
}

/// Tokens of a prompt found in each tier (gpu, l1, l2), from engine-sim's usage.
fn tier_tokens(v: &Value) -> (u64, u64, u64) {
    let t = &v["usage"]["prompt_tokens_details"]["kv_tier_tokens"];
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    (n("gpu"), n("l1"), n("l2"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sim_stores_and_leases_chunks_over_the_hyperpod_api() {
    let dir = scratch_dir("engine-sim-hyperpod");
    let certs = crate::make_certs(
        &dir,
        &["--agent", "agent", "--router", "router", "--loopback"],
    );
    let shm = Shm(format!("wp-it-es-hp-{}", std::process::id()));
    // The agent names its engine by URL and the engine its agent: both addresses first.
    let (engine_at, hyperpod_at) = (crate::free_addr(), crate::free_addr());
    let engine_url = format!("http://{engine_at}");
    let events = format!("tcp://{}", crate::free_addr());
    let replay = format!("tcp://{}", crate::free_addr());
    let quic = warmpath_testkit::free_udp_addr().to_string();
    let (hyperpod_s, quic_s) = (hyperpod_at.to_string(), quic.clone());
    let kv_events = format!("{engine_url}={events},{replay}");
    let agent_args = [
        "agent",
        "--listen",
        "127.0.0.1:0",
        // Block for block (record 0115's coarse residency is tested in agent.rs).
        "--residency-every-block",
        "--residency-listen",
        &quic_s,
        "--tls-dir",
        certs.to_str().unwrap(),
        "--tls-name",
        "agent",
        "--metrics-listen",
        "127.0.0.1:0",
        "--hyperpod-listen",
        &hyperpod_s,
        "--hyperpod-shm-name",
        &shm.0,
        "--hyperpod-shm-bytes",
        "64MiB",
        "--kv-events",
        &kv_events,
        "--kv-block-tokens",
        "16",
    ];
    let mut agent = Proc::start_lines(&agent_args, 4, "warn");
    let agent_metrics = agent
        .lines
        .iter()
        .find_map(|l| l.split("metrics on ").nth(1))
        .map(|m| m.trim().trim_end_matches("/metrics").to_string())
        .unwrap_or_else(|| panic!("no metrics line in {:?}", agent.lines));
    // 64 GPU blocks of 16 tokens; a 600-word prompt is 37 blocks: LMCache's chunks of 16,
    // 16 and 5 blocks.
    let engine_s = engine_at.to_string();
    let engine = Proc::start(&[
        "engine-sim",
        "--listen",
        &engine_s,
        "--speedup",
        "50",
        "--gpu-kv-tokens",
        "1024",
        "--agent",
        &hyperpod_s,
        "--agent-protocol",
        "hyperpod",
        "--hyperpod-shm-name",
        &shm.0,
        "--agent-block-scale",
        "0.001",
        "--kv-events",
        &events,
        "--kv-replay",
        &replay,
    ]);
    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        format!(
            "version = 1\n[[pools]]\nmodel = \"sim-llama\"\ninstances = [\"{engine_url}\"]\n\
             agents = [\"agent@{quic}\"]\nblock_tokens = 16\n"
        ),
    )
    .unwrap();
    let router = crate::router_from_config(&config, &certs);
    let http = client();
    let ask = |seed: u64, explain: bool| {
        let (http, url) = (http.clone(), router.url.clone());
        async move {
            let headers: &[(&str, &str)] = if explain {
                &[("x-warmpath-explain", "1")]
            } else {
                &[]
            };
            let r = post(
                &http,
                &url,
                "/v1/completions",
                completion(&long_prompt(seed), 2, false),
                headers,
            )
            .await;
            assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
            let explained = explain.then(|| {
                serde_json::from_slice::<Value>(r.headers["x-warmpath-explain"].as_bytes()).unwrap()
            });
            (r.json(), explained)
        }
    };

    // The agent follows the engine's events and the router the agent: a prompt computed
    // on the GPU is matched there (its chunks are stored too: 3 objects).
    crate::until(
        Duration::from_secs(20),
        "the router to see the engine's GPU",
        || async {
            let (_, e) = ask(100, true).await;
            let e = e.unwrap();
            (e["matched"]["gpu_observed"].as_u64() > Some(0)).then_some(())
        },
    )
    .await;
    // Prompt 1, then four others that push it out of GPU memory. Every prompt's three
    // chunks are stored as they are computed (write-through, as LMCache stores).
    ask(1, false).await;
    for seed in 2..6 {
        ask(seed, false).await;
    }
    let url = engine.url.clone();
    crate::until(Duration::from_secs(10), "18 chunks stored", || {
        let url = url.clone();
        async move { (metric_at(&url, &objects("stored")).await == 18.0).then_some(()) }
    })
    .await;
    let am = agent_metrics.clone();
    crate::until(Duration::from_secs(10), "18 objects in the segment", || {
        let am = am.clone();
        async move {
            (metric_at(&am, "warmpath_agent_hyperpod_objects").await == 18.0).then_some(())
        }
    })
    .await;
    // Residency settles (the CPU BlockRemoved of each stored chunk, GPU evictions).
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Prompt 1 again: off the GPU, its 37 blocks are reported in L1 (the segment's
    // objects, keyed through the chunks' events), and its admission leases them back.
    let (v, explain) = ask(1, true).await;
    let explain = explain.unwrap();
    println!("routed: {explain}");
    assert_eq!(explain["matched"]["l1_observed"], 37, "{explain}");
    assert_eq!(explain["matched"]["gpu_observed"], 0, "{explain}");
    let (gpu, l1, l2) = tier_tokens(&v);
    assert_eq!((gpu, l1, l2), (0, 37 * 16, 0), "{v}");
    assert_eq!(metric_at(&engine.url, &objects("loaded")).await, 3.0);
    assert_eq!(metric_at(&engine.url, &blocks("fetched")).await, 37.0);
    assert_eq!(metric_at(&engine.url, &blocks("bad")).await, 0.0);
    // Loaded chunks are not stored again.
    assert_eq!(metric_at(&engine.url, &objects("stored")).await, 18.0);
    let leased = metric_at(
        &agent_metrics,
        "warmpath_agent_hyperpod_leases_total{result=\"granted\"}",
    )
    .await;
    assert!(leased >= 3.0, "{leased}");

    // The agent dies mid-run: requests in flight and after it complete, recomputed.
    let in_flight: Vec<_> = (10..13)
        .map(|seed| tokio::spawn(ask(seed, false)))
        .collect();
    agent.kill();
    for r in in_flight {
        r.await.unwrap();
    }
    let errors_before = metric_at(
        &engine.url,
        "warmpath_engine_agent_errors_total{model_name=\"sim-llama\"}",
    )
    .await;
    for seed in [2, 3, 20] {
        let started = std::time::Instant::now();
        let (v, _) = ask(seed, false).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(tier_tokens(&v).1, 0, "nothing comes from a dead agent: {v}");
    }
    let errors = metric_at(
        &engine.url,
        "warmpath_engine_agent_errors_total{model_name=\"sim-llama\"}",
    )
    .await;
    assert!(errors > errors_before, "no failed call counted: {errors}");
    assert!(metric_at(&engine.url, &blocks("dropped")).await > 0.0);
}

/// `warmpath demo --agent-protocol hyperpod`: every engine-sim speaks to its agent over
/// the HyperPod API, every request completes, and the output says which protocol ran.
#[test]
fn the_demo_runs_its_agents_over_the_hyperpod_api() {
    let out = crate::warmpath(&[
        "demo",
        "--requests",
        "60",
        "--policy",
        "prefix-aware",
        "--instances",
        "2",
        "--l1-kv-tokens",
        "100000",
        "--agent-protocol",
        "hyperpod",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    assert!(stdout.contains("HyperPod API"), "{stdout}");
    for label in ["prefix-aware ", "prefix-aware+agents"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("{label} missing from\n{stdout}"));
        assert!(row.trim_end().ends_with(" 60"), "{row}");
    }
}

/// Flags that cannot make a HyperPod link are refused at start, saying why.
#[test]
fn hyperpod_flags_that_cannot_work_are_refused() {
    fn es<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["engine-sim", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        args
    }
    let hp = ["--agent-protocol", "hyperpod"];
    for (args, want) in [
        (
            es(&[&["--agent", "127.0.0.1:9"][..], &hp].concat()),
            "needs --hyperpod-shm-name",
        ),
        (
            es(&[
                &["--agent", "unix:/tmp/a", "--hyperpod-shm-name", "x"][..],
                &hp,
            ]
            .concat()),
            "speaks HTTP over TCP",
        ),
        (
            es(&[
                &["--agent", "127.0.0.1:9", "--hyperpod-shm-name", "x"][..],
                &hp,
                &["--hyperpod-chunk-tokens", "100"],
            ]
            .concat()),
            "multiple of --block-tokens",
        ),
        (
            es(&["--agent", "127.0.0.1:9", "--hyperpod-shm-name", "x"]),
            "goes with --agent-protocol hyperpod",
        ),
        (
            vec!["demo", "--agent-protocol", "hyperpod"],
            "needs agents: give --l1-kv-tokens",
        ),
    ] {
        let out = crate::warmpath_exits_within(&args, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("{args:?} kept running"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
