//! The gateway end to end: real `warmpath router` and `warmpath engine-sim` processes on
//! loopback ports chosen by the OS, driven over HTTP.

use crate::{scratch_dir, Proc};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};
use std::time::Duration;

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn client() -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new())
}

fn engine(speedup: &str) -> Proc {
    crate::engine_sim(speedup, &[])
}

/// A router over `engines`, with extra flags.
fn router(engines: &[&Proc], extra: &[&str]) -> Proc {
    let mut args = vec!["router", "--listen", "127.0.0.1:0"];
    for e in engines {
        args.push("--instance");
        args.push(&e.url);
    }
    args.extend_from_slice(extra);
    Proc::start(&args)
}

pub(crate) struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    fn explain(&self) -> Value {
        serde_json::from_slice(
            self.headers
                .get("x-warmpath-explain")
                .expect("explain header")
                .as_bytes(),
        )
        .expect("explain JSON")
    }
}

pub(crate) async fn post(
    client: &HttpClient,
    url: &str,
    path: &str,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> Reply {
    let mut req =
        hyper::Request::post(format!("{url}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .expect("the router answers");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("a whole body")
        .to_bytes();
    Reply {
        status,
        headers,
        body,
    }
}

pub(crate) fn completion(prompt: &str, max_tokens: u32, stream: bool) -> String {
    json!({"model": "sim-llama", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        .to_string()
}

pub(crate) fn long_prompt(seed: u64) -> String {
    warmpath_index::text::words(seed, 600)
}

/// SSE events with the per-response fields (`id`, `created`) blanked.
fn normalised_events(body: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(body);
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or(e);
            match serde_json::from_str::<Value>(data) {
                Ok(mut v) => {
                    v["id"] = json!("-");
                    v["created"] = json!(0);
                    v.to_string()
                }
                Err(_) => data.to_string(),
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_bytes_through_the_router_equal_the_direct_ones() {
    let e = engine("1000");
    let r = router(&[&e], &[]);
    let c = client();
    for (path, body) in [
        ("/v1/completions", completion(&long_prompt(1), 12, true)),
        (
            "/v1/chat/completions",
            json!({"model": "sim-llama", "messages": [{"role": "user", "content": long_prompt(2)}], "max_tokens": 7, "stream": true}).to_string(),
        ),
    ] {
        let direct = post(&c, &e.url, path, body.clone(), &[]).await;
        let routed = post(&c, &r.url, path, body.clone(), &[]).await;
        assert_eq!((direct.status, routed.status), (200, 200));
        assert_eq!(routed.headers.get("content-type"), direct.headers.get("content-type"));
        let (d, v) = (normalised_events(&direct.body), normalised_events(&routed.body));
        assert!(d.len() >= 8 && d.last().map(String::as_str) == Some("[DONE]"), "{d:?}");
        // The router's salt changes the cache, not the text: events match one for one.
        assert_eq!(d, v, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors() {
    let e = engine("1000");
    let dir = scratch_dir("router-limits");
    let config = dir.join("router.toml");
    std::fs::write(&config, "version = 1\n[router]\nmax_body_bytes = 2000\n").unwrap();
    let r = router(&[&e], &["--config", config.to_str().unwrap()]);
    let c = client();
    let cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "invalid request body"),
        (json!({"model": "sim-llama"}).to_string(), 400, "prompt"),
        (
            json!({"model": "sim-llama", "prompt": ""}).to_string(),
            400,
            "empty",
        ),
        (
            json!({"model": "gpt-9", "prompt": "hi"}).to_string(),
            404,
            "gpt-9",
        ),
        (completion(&"x ".repeat(2000), 1, false), 413, "2000 bytes"),
    ];
    for (body, status, needle) in cases {
        let reply = post(&c, &r.url, "/v1/completions", body.clone(), &[]).await;
        assert_eq!(reply.status, status, "{body:.60}");
        let err = reply.json();
        let message = err["error"]["message"].as_str().expect("OpenAI error body");
        assert!(message.contains(needle), "{message}");
        assert!(err["error"]["type"].is_string());
    }
    let reply = post(
        &c,
        &r.url,
        "/v1/completions",
        completion("hi", 1, false),
        &[("authorization", "Bearer not json")],
    )
    .await;
    // No tenant has keys here, so any key is the default tenant's (as vLLM without
    // --api-key); a malformed Authorization header is still refused.
    assert_eq!(reply.status, 200);
    let reply = post(
        &c,
        &r.url,
        "/v1/completions",
        completion("hi", 1, false),
        &[("authorization", "Basic abc")],
    )
    .await;
    assert_eq!(reply.status, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_instance_is_503_with_retry_after() {
    // An address nothing listens on.
    let dead = crate::free_addr();
    let url = format!("http://{dead}");
    let r = Proc::start(&["router", "--listen", "127.0.0.1:0", "--instance", &url]);
    let c = client();
    for _ in 0..2 {
        let reply = post(
            &c,
            &r.url,
            "/v1/completions",
            completion("hello", 1, false),
            &[],
        )
        .await;
        assert_eq!(
            reply.status,
            503,
            "{:?}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(reply.headers.contains_key("retry-after"));
        assert!(reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no healthy instance"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_share_cache_hits() {
    let e = engine("1000");
    let dir = scratch_dir("router-tenants");
    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        "version = 1\n[[tenants]]\nid = \"a\"\napi_keys = [\"key-a\"]\n[[tenants]]\nid = \"b\"\napi_keys = [\"key-b\"]\n",
    )
    .unwrap();
    let r = router(&[&e], &["--config", config.to_str().unwrap()]);
    let c = client();
    let body = completion(&long_prompt(9), 2, false);
    let cached = |reply: &Reply| {
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let a1 = post(
        &c,
        &r.url,
        "/v1/completions",
        body.clone(),
        &[("authorization", "Bearer key-a")],
    )
    .await;
    let a2 = post(
        &c,
        &r.url,
        "/v1/completions",
        body.clone(),
        &[("authorization", "Bearer key-a")],
    )
    .await;
    let b1 = post(
        &c,
        &r.url,
        "/v1/completions",
        body.clone(),
        &[("authorization", "Bearer key-b")],
    )
    .await;
    let b2 = post(
        &c,
        &r.url,
        "/v1/completions",
        body.clone(),
        &[("authorization", "Bearer key-b")],
    )
    .await;
    assert_eq!(
        (a1.status, a2.status, b1.status, b2.status),
        (200, 200, 200, 200)
    );
    assert_eq!(cached(&a1), 0);
    assert!(
        cached(&a2) > 500,
        "a's second request hits a's cache: {}",
        cached(&a2)
    );
    assert_eq!(cached(&b1), 0, "b must not hit a's blocks");
    assert!(cached(&b2) > 500, "b hits its own cache");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_threshold_spills_to_the_next_instance() {
    let e1 = engine("1");
    let e2 = engine("1");
    let r = router(
        &[&e1, &e2],
        &[
            "--strategy",
            "prefix-aware",
            "--concurrency-threshold",
            "1",
            "--allow-explain",
        ],
    );
    let c = client();
    let prompt = long_prompt(3);
    let explain = [("x-warmpath-explain", "1")];
    // Warm one instance with the prompt.
    let first = post(
        &c,
        &r.url,
        "/v1/completions",
        completion(&prompt, 1, false),
        &explain,
    )
    .await;
    let owner = first.explain()["instance"].as_str().unwrap().to_string();
    // Hold a long stream open on the owner: it is now at the threshold.
    let req = hyper::Request::post(format!("{}/v1/completions", r.url))
        .header("x-warmpath-explain", "1")
        .body(Full::new(Bytes::from(completion(&prompt, 5000, true))))
        .unwrap();
    let held = c.request(req).await.unwrap();
    let held_at: Value =
        serde_json::from_slice(held.headers()["x-warmpath-explain"].as_bytes()).unwrap();
    assert_eq!(held_at["instance"], owner.as_str());
    assert_eq!(held_at["reason"], "longest-prefix");
    // The same prompt now spills to the other instance.
    let spilled = post(
        &c,
        &r.url,
        "/v1/completions",
        completion(&prompt, 1, false),
        &explain,
    )
    .await;
    assert_eq!(spilled.status, 200);
    let why = spilled.explain();
    assert_ne!(why["instance"], owner.as_str(), "{why}");
    assert_eq!(why["reason"], "spilled", "{why}");
    drop(held);
}

/// Sends `n` completions of `tokens` output tokens each through `router` (every other one
/// streaming), runs `fault` once they are in flight, and checks what clients got: every
/// non-streaming request answered in full (retried until a byte reaches the client), and
/// every stream either complete or ended by an error event the client can retry on.
/// Returns (answered, streams ended).
async fn requests_through_a_fault(
    router: &Proc,
    n: u64,
    tokens: u32,
    fault: impl FnOnce(),
) -> (usize, usize) {
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..n {
        let c = c.clone();
        let url = router.url.clone();
        let stream = i % 2 == 1;
        tasks.push(tokio::spawn(async move {
            let body = completion(&long_prompt(100 + i), tokens, stream);
            (stream, post(&c, &url, "/v1/completions", body, &[]).await)
        }));
    }
    // The fault comes once every request is on an instance and has had time to send its
    // first bytes (a fixed wait was too short on a loaded machine: the requests failed
    // over before their first byte and no stream had anything to end).
    let text = wait_for_metrics(&c, &router.url, |t| {
        metric(t, "warmpath_router_instance_in_flight") >= n as f64
    })
    .await;
    assert!(
        metric(&text, "warmpath_router_instance_in_flight") >= n as f64,
        "not every request in flight:\n{text}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    fault();
    let (mut answered, mut ended) = (0, 0);
    for t in tasks {
        let (stream, reply) = t.await.unwrap();
        let text = String::from_utf8_lossy(&reply.body).to_string();
        if !stream {
            assert_eq!(reply.status, 200, "{text}");
            assert_eq!(reply.json()["usage"]["completion_tokens"], tokens);
            answered += 1;
        } else if reply.status == 200 && !text.contains("upstream_error") {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text:.200}");
            answered += 1;
        } else {
            assert!(
                text.contains("retry the request") || reply.status >= 500,
                "{text:.300}"
            );
            assert!(text.ends_with("data: [DONE]\n\n") || reply.status >= 500);
            ended += 1;
        }
    }
    (answered, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_loses_no_request() {
    // At speed-up 2 each request takes about 0.7 s: all are in flight at the kill.
    let mut e1 = engine("2");
    let e2 = engine("2");
    let r = router(&[&e1, &e2], &["--strategy", "round-robin"]);
    let (answered, ended) = requests_through_a_fault(&r, 40, 200, || e1.kill()).await;
    assert_eq!(answered + ended, 40);
    assert!(ended > 0, "streams on the killed instance were cut");
    // After the failure the dead instance is ejected: new requests all succeed.
    let c = client();
    for i in 0..6 {
        let reply = post(
            &c,
            &r.url,
            "/v1/completions",
            completion(&long_prompt(900 + i), 2, false),
            &[],
        )
        .await;
        assert_eq!(reply.status, 200);
    }
}

/// Issue 12, defect 5: requests on an engine that hangs (SIGSTOP: its port accepts, it
/// answers nothing) waited out the 60 s first-byte timeout, and streams had no bound. Now
/// the health checks that find it down (three timed-out checks in a row, about three
/// seconds) fail over the requests it has not answered and end its streams with an error
/// event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_instance_costs_a_failover_not_the_timeout() {
    let e1 = engine("2");
    let e2 = engine("2");
    let r = router(&[&e1, &e2], &["--strategy", "round-robin"]);
    let started = std::time::Instant::now();
    let (answered, ended) = requests_through_a_fault(&r, 20, 400, || e1.signal("-STOP")).await;
    let waited = started.elapsed();
    e1.signal("-CONT");
    assert_eq!(answered + ended, 20);
    assert!(
        ended > 0,
        "streams on the hung instance ended with an error event"
    );
    // Not a speed figure: the difference between a failover and the 60 s timeout.
    assert!(
        waited < Duration::from_secs(30),
        "requests waited {waited:?} on a hung instance"
    );
    println!("hung instance: {answered} answered, {ended} streams ended, all within {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    let e = engine("1000");
    let r = router(&[&e], &[]);
    let c = client();
    let get = |path: &str| {
        let c = c.clone();
        let url = format!("{}{path}", r.url);
        async move {
            let resp = c.get(url.parse().unwrap()).await.unwrap();
            let status = resp.status().as_u16();
            (
                status,
                String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes())
                    .to_string(),
            )
        }
    };
    let (s, models) = get("/v1/models").await;
    assert_eq!(s, 200);
    assert!(models.contains("sim-llama"), "{models}");
    assert_eq!(get("/healthz").await.0, 200);
    assert_eq!(get("/readyz").await.0, 200);
    post(
        &c,
        &r.url,
        "/v1/completions",
        completion("hello world", 1, false),
        &[],
    )
    .await;
    let (s, metrics) = get("/metrics").await;
    assert_eq!(s, 200);
    for name in [
        "warmpath_router_requests_total",
        "warmpath_index_entries",
        "warmpath_router_instance_healthy",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
}

/// Polls `url/metrics` until `pred` holds for the text, for at most ten seconds.
async fn wait_for_metrics(c: &HttpClient, url: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let resp = c
            .get(format!("{url}/metrics").parse().unwrap())
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes())
            .to_string();
        if pred(&text) || tokio::time::Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status of a GET of `url`; `None` while nothing answers.
pub(crate) async fn get_status(url: &str) -> Option<u16> {
    let resp = client().get(url.parse().expect("a URL")).await.ok()?;
    Some(resp.status().as_u16())
}

/// The body of a GET of `url` as text (a `/metrics` page).
pub(crate) async fn get_text(url: &str) -> String {
    let resp = client()
        .get(url.parse().expect("a URL"))
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let body = resp.into_body().collect().await.expect("a body").to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

pub(crate) fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_cancels_the_upstream_request() {
    let e = engine("1");
    let r = router(&[&e], &[]);
    let c = client();
    let req = hyper::Request::post(format!("{}/v1/completions", r.url))
        .body(Full::new(Bytes::from(completion(
            "a long answer please",
            50_000,
            true,
        ))))
        .unwrap();
    let mut resp = c.request(req).await.unwrap();
    // Wait for the first streamed bytes: the engine is generating.
    let first = resp.body_mut().frame().await.unwrap().unwrap();
    assert!(first.is_data());
    let running = wait_for_metrics(&c, &e.url, |m| {
        metric(m, "vllm:num_requests_running") >= 1.0
    })
    .await;
    assert_eq!(metric(&running, "vllm:num_requests_running"), 1.0);
    drop(resp);
    let after = wait_for_metrics(&c, &e.url, |m| {
        metric(m, "vllm:num_requests_running") == 0.0
    })
    .await;
    assert_eq!(
        metric(&after, "vllm:num_requests_running"),
        0.0,
        "the engine still runs the abandoned request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_open_streams() {
    let e = engine("4");
    let r = router(&[&e], &[]);
    let c = client();
    let req = hyper::Request::post(format!("{}/v1/completions", r.url))
        .body(Full::new(Bytes::from(completion(
            "tell me a story",
            150,
            true,
        ))))
        .unwrap();
    let mut resp = c.request(req).await.unwrap();
    let first = resp.body_mut().frame().await.unwrap().unwrap();
    assert!(first.is_data());
    // SIGTERM the router mid-stream: it stops accepting but finishes the stream.
    r.signal("-TERM");
    let rest = resp
        .into_body()
        .collect()
        .await
        .expect("the stream completes")
        .to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.ends_with("data: [DONE]\n\n"), "{text:.300}");
    assert!(!text.contains("upstream_error"));
    // And new connections are refused once it has exited.
    let refused = c.get(format!("{}/healthz", r.url).parse().unwrap()).await;
    assert!(refused.is_err());
}

/// `x-tenant-id` never reaches a tenant that has API keys, and is refused unless enabled;
/// with no API keys configured at all, any key (clients such as `openai` always send one)
/// or none is the default tenant, as vLLM behaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_header_never_stands_in_for_an_api_key() {
    let e = engine("1000");
    let dir = scratch_dir("router-tenant-header");
    let config = |allow: bool| {
        let path = dir.join(format!("router-{allow}.toml"));
        std::fs::write(
            &path,
            format!(
                "version = 1\n[router]\nallow_tenant_header = {allow}\n\
                 [[tenants]]\nid = \"a\"\napi_keys = [\"key-a\"]\n\
                 [[tenants]]\nid = \"open\"\n"
            ),
        )
        .unwrap();
        path
    };
    let c = client();
    let body = completion("hello there", 1, false);
    let allowed = config(true);
    let r = router(&[&e], &["--config", allowed.to_str().unwrap()]);
    let status = |headers: &'static [(&'static str, &'static str)]| {
        let (c, url, body) = (c.clone(), r.url.clone(), body.clone());
        async move {
            post(&c, &url, "/v1/completions", body, headers)
                .await
                .status
        }
    };
    assert_eq!(
        status(&[("x-tenant-id", "a")]).await,
        401,
        "a keyed tenant by header"
    );
    assert_eq!(
        status(&[("x-tenant-id", "open")]).await,
        200,
        "a keyless tenant by header"
    );
    assert_eq!(status(&[("authorization", "Bearer key-a")]).await, 200);
    assert_eq!(status(&[("authorization", "Bearer not-a-key")]).await, 401);
    drop(r);
    let refused = config(false);
    let r = router(&[&e], &["--config", refused.to_str().unwrap()]);
    let reply = post(
        &c,
        &r.url,
        "/v1/completions",
        body.clone(),
        &[("x-tenant-id", "open")],
    )
    .await;
    assert_eq!(reply.status, 401, "the header is off by default");
    drop(r);
    // No keys anywhere: any key, or none, is the default tenant.
    let r = router(&[&e], &[]);
    // Explanations name instances: not answered unless the tenant may see them.
    let reply = post(
        &c,
        &r.url,
        "/v1/completions",
        body.clone(),
        &[("x-warmpath-explain", "1")],
    )
    .await;
    assert_eq!(reply.status, 200);
    assert!(
        reply.headers.get("x-warmpath-explain").is_none(),
        "explained to anyone"
    );
    for headers in [&[("authorization", "Bearer sk-anything")][..], &[][..]] {
        let reply = post(&c, &r.url, "/v1/completions", body.clone(), headers).await;
        assert_eq!(
            reply.status,
            200,
            "{:?}",
            String::from_utf8_lossy(&reply.body)
        );
    }
}

/// The client port is bounded: a half-sent request line and an idle connection are closed
/// after the header read timeout, a body that does not arrive is answered 408, and 1,100
/// idle connections against a router limited to 1,024 open files leave it answering (503
/// with Retry-After for connections over its limit, then serving once the idle ones time
/// out) instead of unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_idle_clients_cannot_take_the_client_port() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = engine("1000");
    let dir = scratch_dir("router-bounded");
    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        "version = 1\n[router]\nheader_read_timeout_ms = 1500\nbody_read_timeout_ms = 1500\n",
    )
    .unwrap();
    let args = [
        "router",
        "--listen",
        "127.0.0.1:0",
        "--instance",
        &e.url,
        "--config",
        config.to_str().unwrap(),
    ];
    let r = Proc::start_with_file_limit(1024, &args);
    let host = r.url.trim_start_matches("http://").to_string();
    // Reads until the server closes the connection; what it sent, or None on a timeout.
    let drain = |mut tcp: tokio::net::TcpStream, within: Duration| async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        tokio::time::timeout(within, async {
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await
        .ok()
        .map(|_| String::from_utf8_lossy(&got).to_string())
    };
    // Half a request line: closed after the header timeout.
    let mut half = tokio::net::TcpStream::connect(&host).await.unwrap();
    half.write_all(b"POST /v1/compl").await.unwrap();
    let closed = drain(half, Duration::from_secs(5)).await;
    assert!(closed.is_some(), "a half request line kept its connection");
    // A body that never comes: 408 after the body timeout.
    let mut slow = tokio::net::TcpStream::connect(&host).await.unwrap();
    slow.write_all(
        format!("POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"model\"").as_bytes(),
    )
    .await
    .unwrap();
    let answer = drain(slow, Duration::from_secs(5))
        .await
        .expect("an answer");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    // 1,100 idle connections under a 1,024-file limit.
    let mut idle = Vec::new();
    for _ in 0..1100 {
        match tokio::net::TcpStream::connect(&host).await {
            Ok(t) => idle.push(t),
            Err(e) => panic!("connect failed: {e}"),
        }
    }
    let c = client();
    let body = completion("hello", 1, false);
    let during = tokio::time::timeout(
        Duration::from_secs(3),
        post(&c, &r.url, "/v1/completions", body.clone(), &[]),
    )
    .await
    .expect("an answer while flooded");
    assert!(
        during.status == 200
            || (during.status == 503 && during.headers.contains_key("retry-after")),
        "{} {:?}",
        during.status,
        String::from_utf8_lossy(&during.body)
    );
    // The idle connections time out; the router serves again.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let after = post(&c, &r.url, "/v1/completions", body, &[]).await;
    assert_eq!(
        after.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&after.body)
    );
    drop(idle);
}

/// `/metrics` names instances, loads and tenants: a client port beyond loopback does not
/// serve it; `--metrics-listen` serves it on a port of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_stay_off_a_public_client_port() {
    let e = engine("1000");
    let mut r = Proc::start(&[
        "router",
        "--listen",
        "0.0.0.0:0",
        "--instance",
        &e.url,
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let metrics_line = r.read_line();
    let metrics_url = metrics_line
        .split("metrics on ")
        .nth(1)
        .expect("a metrics line")
        .trim()
        .to_string();
    let c = client();
    let get = |url: String| {
        let c = c.clone();
        async move {
            let resp = c.get(url.parse().unwrap()).await.expect("an answer");
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).to_string())
        }
    };
    let client_port = r.url.replace("0.0.0.0", "127.0.0.1");
    assert_eq!(get(format!("{client_port}/metrics")).await.0, 404);
    let (status, text) = get(metrics_url).await;
    assert_eq!(status, 200);
    assert!(text.contains("warmpath_router_instance_healthy"), "{text}");
}

/// A body the router accepts but the engine refuses (between their limits) comes back as
/// an OpenAI-style 413 from the router, not the engine's own words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_engines_limit_gets_an_openai_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // An engine whose body limit is tiny: every POST gets a plain-text 413; GETs are healthy.
    // It reads the whole request first: answering and closing while the router still
    // sends the body would make the router see a failed send (and retry), not the 413.
    let fake = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake_url = format!("http://{}", fake.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = fake.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                let complete = |head: &[u8]| {
                    let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") else {
                        return false;
                    };
                    let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
                    let length = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    head.len() >= end + 4 + length
                };
                while !complete(&head) {
                    match tcp.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer: &[u8] = if head.starts_with(b"GET") {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                } else {
                    b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\ncontent-length: 9\r\n\r\ntoo large"
                };
                let _ = tcp.write_all(answer).await;
            });
        }
    });
    let r = Proc::start(&["router", "--listen", "127.0.0.1:0", "--instance", &fake_url]);
    let c = client();
    // On a loaded machine a health check of the fake engine can time out: the router then
    // answers 503 with Retry-After for a moment, and a client retries, as this one does.
    let started = std::time::Instant::now();
    let reply = loop {
        let reply = post(
            &c,
            &r.url,
            "/v1/completions",
            completion("hello", 1, false),
            &[],
        )
        .await;
        if reply.status != 503 || started.elapsed() > Duration::from_secs(10) {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        reply.status,
        413,
        "{:?}",
        String::from_utf8_lossy(&reply.body)
    );
    let err = reply.json();
    assert_eq!(err["error"]["type"], "invalid_request_error");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("over the serving instance's limit"),
        "{err}"
    );
}
