//! The load generator against a fake OpenAI server (streams whole, cut into small frames,
//! failing, malformed, hanging), and its pure parts: targets, tenant headers, request
//! bodies, schedules, and the text of workloads' requests.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::{Json, Router};
use serde_json::{json, Value};
use warmpath_index::text::{count_tokens, tokenize};

use super::*;
use crate::config::{schedule, Plan, Target};
use bytes::Bytes;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use std::time::Duration;
use warmpath_index::text::words;
use warmpath_sim::workload::mooncake::parse_mooncake;
use warmpath_sim::workload::synthetic::{
    generate, to_workload, SyntheticKind, SyntheticParams, SyntheticRequest,
};
use warmpath_sim::workload::ReadOptions;

/// Text chunks the fake server streams per response.
const CHUNKS: usize = 5;
/// Pause before each event the fake server sends.
const GAP: Duration = Duration::from_millis(2);
const PROMPT_TOKENS: u64 = 100;
const CACHED_TOKENS: u64 = 40;

/// Headers and bodies the fake server received.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(HeaderMap, Value)>>>);

fn usage() -> Value {
    json!({
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": CHUNKS,
        "total_tokens": PROMPT_TOKENS + CHUNKS as u64,
        "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}
    })
}

/// The SSE events of one streamed response, one string each.
fn events(chat: bool) -> Vec<String> {
    let mut out = Vec::new();
    if chat {
        // vLLM's first chat chunk carries the role and no content.
        out.push(json!({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}));
    }
    for i in 0..CHUNKS {
        out.push(if chat {
            json!({"choices": [{"index": 0, "delta": {"content": format!(" t{i}")}}], "usage": null})
        } else {
            json!({"choices": [{"index": 0, "text": format!(" t{i}")}], "usage": null})
        });
    }
    out.push(json!({"choices": [], "usage": usage()}));
    let mut events: Vec<String> = out.iter().map(|v| format!("data: {v}\n\n")).collect();
    events.push("data: [DONE]\n\n".to_string());
    events
}

/// A streamed response sending `pieces` as separate frames, `GAP` apart.
fn streamed(pieces: Vec<String>) -> Response {
    let stream = futures_util::stream::unfold(pieces.into_iter(), |mut it| async move {
        let next = it.next()?;
        tokio::time::sleep(GAP).await;
        Some((Ok::<_, Infallible>(Bytes::from(next)), it))
    });
    (
        [(CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn complete(
    State(seen): State<Seen>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let stream = body["stream"].as_bool().unwrap_or(false);
    let chat = body.get("messages").is_some();
    seen.0.lock().unwrap().push((headers, body));
    if stream {
        return streamed(events(chat));
    }
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": "t0 t1 t2 t3 t4"}})
    } else {
        json!({"index": 0, "text": "t0 t1 t2 t3 t4"})
    };
    Json(json!({"choices": [choice], "usage": usage()})).into_response()
}

/// Streams the same events cut into 7-byte frames, so events split across frames.
async fn split(Json(body): Json<Value>) -> Response {
    let all = events(body.get("messages").is_some()).concat();
    let pieces = all
        .as_bytes()
        .chunks(7)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    streamed(pieces)
}

async fn fail() -> Response {
    let body = format!("engine exploded {}", "x".repeat(300));
    (StatusCode::INTERNAL_SERVER_ERROR, body).into_response()
}

async fn malformed() -> Response {
    streamed(vec![
        "data: {\"choices\": [{\"text\": \"a\"}]}\n\n".into(),
        "data: {not json\n\n".into(),
    ])
}

async fn hang() -> Response {
    std::future::pending().await
}

/// Starts the fake server; returns its base URL and what it receives. Routes under the
/// base: `/v1/...` answers, `/split/v1/...` splits events across frames, `/fail/v1/...`
/// answers 500, `/bad/v1/...` streams malformed SSE, `/hang/v1/...` never answers.
async fn fake_server() -> (String, Seen) {
    let seen = Seen::default();
    let app = Router::new()
        .route("/v1/completions", post(complete))
        .route("/v1/chat/completions", post(complete))
        .route("/split/v1/completions", post(split))
        .route("/split/v1/chat/completions", post(split))
        .route("/fail/v1/completions", post(fail))
        .route("/bad/v1/completions", post(malformed))
        .route("/hang/v1/completions", post(hang))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // Without TCP_NODELAY small SSE frames wait for delayed ACKs (40 ms on Linux).
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

/// A base URL where nothing listens.
fn refused_target() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

fn live(n: usize, endpoint: Endpoint) -> Vec<LiveRequest> {
    (0..n)
        .map(|i| LiveRequest {
            at_us: 0,
            tenant: i as u32,
            endpoint,
            prompt: words(i as u64, 20),
            max_tokens: CHUNKS as u32,
        })
        .collect()
}

fn config(targets: Vec<String>, mode: Mode) -> LoadgenConfig {
    LoadgenConfig {
        mode,
        timeout: Duration::from_secs(10),
        ..LoadgenConfig::new(targets, "m")
    }
}

async fn run_ok(config: &LoadgenConfig, requests: &[LiveRequest]) -> LoadReport {
    match run(config, requests, &|_| {}).await {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

/// Checks the figures of `n` successful responses of the fake server.
fn check_success(r: &LoadReport, n: u64, streamed: bool) {
    assert_eq!((r.requests, r.ok, r.not_sent), (n, n, 0), "{r:#?}");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!((r.ttft_ms.count, r.e2e_ms.count), (n, n));
    assert!(
        r.ttft_ms.p50 <= r.e2e_ms.p50 && r.ttft_ms.max <= r.e2e_ms.max,
        "{r:#?}"
    );
    assert!(r.ttft_ms.p50 <= r.ttft_ms.p90 && r.ttft_ms.p90 <= r.ttft_ms.p99);
    let itl = if streamed { n * (CHUNKS as u64 - 1) } else { 0 };
    assert_eq!(r.itl_ms.count, itl);
    assert_eq!(r.prompt_tokens, n * PROMPT_TOKENS);
    assert_eq!(r.cached_tokens, n * CACHED_TOKENS);
    assert!((r.hit_rate - 0.4).abs() < 1e-9, "{}", r.hit_rate);
    assert_eq!(r.output_tokens, n * CHUNKS as u64);
    assert_eq!(r.without_usage, 0);
    assert!(r.wall_s > 0.0 && r.throughput_rps > 0.0 && r.output_tokens_per_s > 0.0);
}

#[tokio::test]
async fn streams_measure_ttft_itl_e2e_and_hit_rate() {
    let (base, seen) = fake_server().await;
    let mut requests = live(6, Endpoint::Completions);
    requests.extend(live(2, Endpoint::Chat));
    let mut c = config(vec![base], Mode::ClosedLoop { concurrency: 3 });
    c.tenant_header = TenantAuth::Header;
    let r = run_ok(&c, &requests).await;
    check_success(&r, 8, true);
    // Every event comes GAP after the previous one: a stream takes at least 7 gaps.
    assert!(r.ttft_ms.p50 >= 2.0 && r.e2e_ms.p50 >= 14.0, "{r:#?}");
    // Gaps add up to at least the server's pauses (one may come early after a late one).
    assert!(r.itl_ms.mean >= 1.0, "{r:#?}");

    let seen = seen.0.lock().unwrap();
    assert_eq!(seen.len(), 8);
    for (headers, body) in seen.iter() {
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["max_tokens"], CHUNKS);
        let tenant = headers[TENANT_HEADER].to_str().unwrap();
        let prompt = match body.get("messages") {
            Some(m) => {
                assert_eq!(m[0]["role"], "user");
                m[0]["content"].as_str().unwrap()
            }
            None => body["prompt"].as_str().unwrap(),
        };
        let i: u64 = tenant.strip_prefix("tenant-").unwrap().parse().unwrap();
        assert_eq!(prompt, words(i % 6, 20), "{tenant}");
    }
}

#[tokio::test]
async fn without_streaming_ttft_is_e2e() {
    let (base, _) = fake_server().await;
    let mut requests = live(3, Endpoint::Completions);
    requests.extend(live(2, Endpoint::Chat));
    let mut c = config(vec![base], Mode::OpenLoop { time_scale: 1.0 });
    c.stream = false;
    let r = run_ok(&c, &requests).await;
    check_success(&r, 5, false);
    assert_eq!(r.ttft_ms, r.e2e_ms);
}

#[tokio::test]
async fn events_split_across_frames_are_measured() {
    let (base, _) = fake_server().await;
    let mut requests = live(3, Endpoint::Completions);
    requests.extend(live(2, Endpoint::Chat));
    let c = config(
        vec![format!("{base}/split/")],
        Mode::Poisson {
            rate_per_s: 200.0,
            seed: 3,
        },
    );
    let r = run_ok(&c, &requests).await;
    check_success(&r, 5, true);
}

#[tokio::test]
async fn errors_are_counted_by_kind() {
    let (base, _) = fake_server().await;
    let targets = vec![
        base.clone(),
        format!("{base}/fail"),
        format!("{base}/bad"),
        refused_target(),
    ];
    let c = config(targets, Mode::ClosedLoop { concurrency: 2 });
    let r = run_ok(&c, &live(8, Endpoint::Completions)).await;
    assert_eq!((r.requests, r.ok), (8, 2), "{r:#?}");
    let expected: BTreeMap<String, u64> = [("connect", 2), ("malformed_sse", 2), ("status_500", 2)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    assert_eq!(r.errors, expected);
    assert_eq!(r.error_count(), 6);
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["errors"]["status_500"], 2);
    assert_eq!(json["ttft_ms"]["count"], 2);
    assert_eq!(r.error_samples.len(), ERROR_SAMPLES);
    let s500 = r
        .error_samples
        .iter()
        .find(|s| s.kind == "status_500")
        .unwrap();
    assert_eq!(s500.status, Some(500));
    assert_eq!(s500.detail.len(), ERROR_BODY_BYTES);
    assert!(s500.detail.starts_with("engine exploded"), "{s500:?}");
    // Only successful requests count in the latencies and the usage.
    assert_eq!(r.ttft_ms.count, 2);
    assert_eq!(r.prompt_tokens, 2 * PROMPT_TOKENS);
    let table = render_report(&r);
    for needle in ["status_500", "connect", "hit rate 40.0%", "ttft", "e.g. "] {
        assert!(table.contains(needle), "{needle}: {table}");
    }
}

#[tokio::test]
async fn timeouts_end_the_run() {
    let (base, _) = fake_server().await;
    let mut c = config(
        vec![format!("{base}/hang")],
        Mode::OpenLoop { time_scale: 1.0 },
    );
    c.timeout = Duration::from_millis(200);
    let calls = AtomicU64::new(0);
    let last = Mutex::new(Progress::default());
    let progress = |p: Progress| {
        calls.fetch_add(1, Ordering::Relaxed);
        *last.lock().unwrap() = p;
    };
    let started = std::time::Instant::now();
    let r = run(&c, &live(4, Endpoint::Completions), &progress)
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!((r.requests, r.ok), (4, 0));
    assert_eq!(r.errors.get("timeout"), Some(&4), "{r:?}");
    assert!(calls.load(Ordering::Relaxed) >= 1);
    let last = *last.lock().unwrap();
    assert_eq!(
        last,
        Progress {
            done: 4,
            total: 4,
            errors: 4,
            in_flight: 0
        }
    );
}

#[tokio::test]
async fn max_duration_and_max_requests_bound_the_run() {
    let (base, _) = fake_server().await;
    // Ten requests a second apart; the run may send for 300 ms only.
    let mut requests = live(10, Endpoint::Completions);
    for (i, r) in requests.iter_mut().enumerate() {
        r.at_us = i as u64 * 1_000_000;
    }
    let mut c = config(vec![base.clone()], Mode::OpenLoop { time_scale: 1.0 });
    c.max_duration = Some(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let r = run_ok(&c, &requests).await;
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!((r.requests, r.ok, r.not_sent), (1, 1, 9), "{r:?}");
    assert!(render_report(&r).contains("9 not sent"));

    // A closed loop with a time limit stops too.
    c.mode = Mode::ClosedLoop { concurrency: 2 };
    c.max_duration = Some(Duration::from_millis(100));
    let many = live(100_000, Endpoint::Completions);
    let r = run_ok(&c, &many).await;
    assert!(r.requests < 100_000 && r.requests == r.ok && r.requests + r.not_sent == 100_000);

    // max_requests keeps the first requests; the time scale replays faster.
    c.max_duration = None;
    c.max_requests = Some(3);
    c.mode = Mode::OpenLoop { time_scale: 20.0 };
    let started = std::time::Instant::now();
    let r = run_ok(&c, &requests).await;
    assert_eq!((r.requests, r.ok, r.not_sent), (3, 3, 0));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

#[test]
fn the_run_future_can_be_spawned() {
    fn send<T: Send>(_: &T) {}
    let c = config(
        vec!["http://127.0.0.1:1".into()],
        Mode::ClosedLoop { concurrency: 1 },
    );
    send(&run(&c, &[], &|_| {}));
}

#[tokio::test]
async fn bad_configurations_are_refused() {
    let base = "http://127.0.0.1:1".to_string();
    let cases: Vec<(LoadgenConfig, &str)> = vec![
        (
            config(vec![], Mode::ClosedLoop { concurrency: 1 }),
            "no target",
        ),
        (
            config(
                vec!["https://x:1".into()],
                Mode::ClosedLoop { concurrency: 1 },
            ),
            "https",
        ),
        (
            config(
                vec!["127.0.0.1:8080".into()],
                Mode::ClosedLoop { concurrency: 1 },
            ),
            "scheme",
        ),
        (
            config(
                vec!["http://a b".into()],
                Mode::ClosedLoop { concurrency: 1 },
            ),
            "not a URL",
        ),
        (
            config(vec![base.clone()], Mode::ClosedLoop { concurrency: 0 }),
            "concurrency",
        ),
        (
            config(vec![base.clone()], Mode::OpenLoop { time_scale: 0.0 }),
            "time scale",
        ),
        (
            config(
                vec![base.clone()],
                Mode::Poisson {
                    rate_per_s: f64::NAN,
                    seed: 1,
                },
            ),
            "rate",
        ),
        (
            LoadgenConfig {
                tenant_header: TenantAuth::ApiKey(vec![]),
                ..config(vec![base.clone()], Mode::ClosedLoop { concurrency: 1 })
            },
            "API keys",
        ),
        (
            LoadgenConfig {
                tenant_header: TenantAuth::ApiKey(vec!["a\nb".into()]),
                ..config(vec![base.clone()], Mode::ClosedLoop { concurrency: 1 })
            },
            "API key 0",
        ),
    ];
    for (c, expected) in cases {
        match run(&c, &[], &|_| {}).await {
            Err(e) => assert!(e.to_string().contains(expected), "{expected}: {e}"),
            Ok(r) => panic!("{expected}: ran: {r:?}"),
        }
    }
}

#[test]
fn targets_and_tenant_headers() {
    for base in [
        "http://h:1",
        "http://h:1/",
        "http://h:1/v1",
        " http://h:1/v1/ ",
    ] {
        let t = Target::parse(base).unwrap();
        assert_eq!(t.completions, "http://h:1/v1/completions", "{base}");
        assert_eq!(t.chat, "http://h:1/v1/chat/completions", "{base}");
    }
    let t = Target::parse("http://h:1/prefix").unwrap();
    assert_eq!(
        t.uri(Endpoint::Completions),
        "http://h:1/prefix/v1/completions"
    );

    let mut c = config(
        vec!["http://h:1".into()],
        Mode::ClosedLoop { concurrency: 1 },
    );
    assert_eq!(Plan::new(&c).unwrap().tenant_header(3), None);
    c.tenant_header = TenantAuth::Header;
    let (name, value) = Plan::new(&c).unwrap().tenant_header(3).unwrap();
    assert_eq!(
        (name.as_str(), value.to_str().unwrap()),
        (TENANT_HEADER, "tenant-3")
    );
    c.tenant_header = TenantAuth::ApiKey(vec!["k0".into(), "k1".into()]);
    let plan = Plan::new(&c).unwrap();
    let (name, value) = plan.tenant_header(3).unwrap();
    assert_eq!(
        (name, value.to_str().unwrap()),
        (AUTHORIZATION, "Bearer k1")
    );
}

#[test]
fn request_bodies() {
    let r = LiveRequest {
        at_us: 0,
        tenant: 0,
        endpoint: Endpoint::Completions,
        prompt: "hi".into(),
        max_tokens: 7,
    };
    let body = |r: &LiveRequest, stream| -> Value {
        serde_json::from_slice(&request_body(r, "m", stream)).unwrap()
    };
    assert_eq!(
        body(&r, true),
        json!({"model": "m", "prompt": "hi", "max_tokens": 7, "stream": true,
               "stream_options": {"include_usage": true}, "ignore_eos": true})
    );
    let chat = LiveRequest {
        endpoint: Endpoint::Chat,
        ..r
    };
    assert_eq!(
        body(&chat, false),
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 7, "stream": false, "ignore_eos": true})
    );
}

#[test]
fn schedules() {
    let mut requests = live(3, Endpoint::Completions);
    for (r, at) in requests.iter_mut().zip([0, 1_000_000, 3_000_000]) {
        r.at_us = at;
    }
    let open = schedule(&Mode::OpenLoop { time_scale: 2.0 }, &requests).unwrap();
    let ms: Vec<u128> = open.iter().map(|d| d.as_millis()).collect();
    assert_eq!(ms, vec![0, 500, 1500]);
    assert_eq!(
        schedule(&Mode::ClosedLoop { concurrency: 2 }, &requests),
        None
    );

    let many = live(4000, Endpoint::Completions);
    let poisson = |seed| {
        schedule(
            &Mode::Poisson {
                rate_per_s: 100.0,
                seed,
            },
            &many,
        )
        .unwrap()
    };
    let a = poisson(1);
    assert_eq!(a, poisson(1));
    assert_ne!(a, poisson(2));
    assert!(a.windows(2).all(|w| w[0] <= w[1]));
    let mean_gap = a.last().unwrap().as_secs_f64() / 4000.0;
    assert!((0.009..0.011).contains(&mean_gap), "{mean_gap}");
}

#[test]
fn mooncake_text_follows_hash_ids() {
    let trace = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]}
{"timestamp": 1, "input_length": 1536, "output_length": 3, "hash_ids": [7, 8, 10]}
{"timestamp": 2, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 11]}
{"timestamp": 3, "input_length": 300, "output_length": 0, "hash_ids": [12]}
{"timestamp": 4, "input_length": 512, "output_length": 1, "hash_ids": [8]}
"#;
    let (w, _) = parse_mooncake("t.jsonl", trace, &ReadOptions::default()).unwrap();
    let live = from_workload(&w, None, Endpoint::Completions);
    assert_eq!(live.len(), 5);
    for (l, r) in live.iter().zip(&w.requests) {
        assert_eq!(
            count_tokens(&l.prompt),
            r.prompt_tokens as usize,
            "{}",
            r.id
        );
        assert_eq!(
            (l.at_us, l.tenant, l.endpoint),
            (r.arrival_us, 0, Endpoint::Completions)
        );
        assert_eq!(l.max_tokens, r.output_tokens);
    }
    let shared = format!("{}{}", words(7, 512), words(8, 512));
    assert!(live[..3].iter().all(|l| l.prompt.starts_with(&shared)));
    assert_eq!(live[1].prompt, format!("{shared}{}", words(10, 512)));
    // Equal ids, equal tokens: the first 1024 token ids of the first three agree.
    let t: Vec<Vec<u32>> = live.iter().map(|l| tokenize(&l.prompt)).collect();
    assert_eq!(t[0][..1024], t[1][..1024]);
    assert_eq!(t[0][..1024], t[2][..1024]);
    // Partial last blocks are each request's own.
    assert_ne!(t[0][1024..], t[2][1024..]);
    assert_eq!(live[4].prompt, words(8, 512));
    // The same workload gives the same text.
    assert_eq!(live, from_workload(&w, None, Endpoint::Completions));
    assert!(from_workload(&w, None, Endpoint::Chat)
        .iter()
        .all(|l| l.endpoint == Endpoint::Chat));
}

#[test]
fn synthetic_requests_sharing_segments_share_text_prefixes() {
    let params = SyntheticParams {
        requests: 60,
        seed: 5,
        ..SyntheticParams::default()
    };
    let synthetic = generate(SyntheticKind::Chat, &params);
    let w = to_workload("chat", &synthetic, 64);
    let live = from_workload(&w, Some(&synthetic), Endpoint::Completions);
    assert_eq!(live.len(), synthetic.len());
    for ((l, s), r) in live.iter().zip(&synthetic).zip(&w.requests) {
        assert_eq!(l.prompt, segments_text(s));
        assert_eq!(count_tokens(&l.prompt), r.prompt_tokens as usize);
    }
    // Later turns of a conversation extend earlier turns' segments, and so their text.
    let mut extensions = 0;
    for i in 0..synthetic.len() {
        for j in i + 1..synthetic.len() {
            let (a, b) = (&synthetic[i].segments, &synthetic[j].segments);
            let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
            let prefix = segments_text(&SyntheticRequest {
                segments: a[..common].to_vec(),
                ..synthetic[i].clone()
            });
            assert!(live[i].prompt.starts_with(&prefix) && live[j].prompt.starts_with(&prefix));
            if common == a.len() {
                assert!(live[j].prompt.starts_with(&live[i].prompt));
                extensions += 1;
            }
        }
    }
    assert!(extensions > 0, "no conversation with two turns");
    // Without the segments, the keys name the text: equal keys, equal text.
    let by_keys = from_workload(&w, None, Endpoint::Completions);
    for (l, r) in by_keys.iter().zip(&w.requests) {
        assert_eq!(count_tokens(&l.prompt), r.prompt_tokens as usize);
        let head: String = r.keys.iter().map(|k| words(k.0, 64)).collect();
        assert!(l.prompt.starts_with(&head));
    }
}
