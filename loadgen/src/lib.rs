//! The load generator behind `warmpath loadgen`: OpenAI-style HTTP load against a warmpath
//! router or an engine (real or simulated), measuring what users feel.
//!
//! Three parts, from pure to I/O:
//!
//! - [`from_workload`] turns a [`Workload`] into [`LiveRequest`]s with deterministic text
//!   (built from [`words`]), so that requests sharing a prefix in the workload share a text
//!   prefix on the wire, and every prompt has the workload's token count under the built-in
//!   tokenizer.
//! - [`SseParser`] and [`parse_stream_data`] read a server-sent-event stream from body
//!   frames of any size, without I/O, so tests feed them bytes.
//! - [`run`] sends the requests (open loop at their times, Poisson arrivals, or a closed
//!   loop of N users) over one keep-alive HTTP/1.1 client pool and returns a [`LoadReport`]:
//!   time to first token (TTFT), inter-token latency (ITL), end-to-end latency (E2E),
//!   throughput, the prompt tokens the server reports as cached, and errors by kind.
//!   [`render_report`] prints it as a table.
//!
//! Latencies are measured from the moment a request is due: in the open-loop modes that is
//! its scheduled time, so a load generator that falls behind shows up in the figures
//! instead of hiding (no coordinated omission); in the closed loop it is the moment a user
//! sends. A run always ends: requests are bounded by [`LoadgenConfig::max_requests`], no
//! request is sent after [`LoadgenConfig::max_duration`], and each request is cut off at
//! [`LoadgenConfig::timeout`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio::task::{JoinError, JoinSet};
use tokio::time::{sleep_until, timeout_at, Instant, MissedTickBehavior};
use warmpath_index::rng::Rng;
use warmpath_index::text::words;

use warmpath_sim::workload::synthetic::SyntheticRequest;
use warmpath_sim::workload::Workload;

/// How often [`run`] reports [`Progress`].
pub const PROGRESS_EVERY: Duration = Duration::from_millis(250);
/// How many bytes of an error response body a report keeps.
pub const ERROR_BODY_BYTES: usize = 200;
/// How many [`ErrorSample`]s a report keeps (the first ones).
pub const ERROR_SAMPLES: usize = 5;
/// A server-sent event larger than this is malformed (a stream that never sends a blank
/// line would otherwise grow the buffer without bound).
pub const MAX_EVENT_BYTES: usize = 8 << 20;
/// A non-streamed response body larger than this is refused.
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// Latencies above this (one hour, in microseconds) are recorded as this.
pub const MAX_LATENCY_US: u64 = 3_600_000_000;
/// Header naming the tenant under [`TenantAuth::Header`].
pub const TENANT_HEADER: &str = "x-tenant-id";

// ---------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------

/// Which OpenAI endpoint a request goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/completions` with the prompt as is (keeps block alignment).
    #[default]
    Completions,
    /// `POST /v1/chat/completions` with the prompt as the single user message (the chat
    /// template shifts the text, so blocks no longer align with the workload's).
    Chat,
}

impl Endpoint {
    /// The path under a target's base URL.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// One request to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveRequest {
    /// Open-loop send time, in microseconds from the start of the run (before
    /// [`Mode::OpenLoop::time_scale`]).
    pub at_us: u64,
    /// Tenant index; [`LoadgenConfig::tenant_header`] says how it is named on the wire.
    pub tenant: u32,
    /// Where it goes.
    pub endpoint: Endpoint,
    /// The completions prompt, or the content of the single user message.
    pub prompt: String,
    /// Tokens to generate (sent with `ignore_eos`, so the server generates exactly these).
    pub max_tokens: u32,
}

/// Turns a workload into live requests with deterministic text, in the workload's order,
/// all for `endpoint`.
///
/// - With `synthetic` (the requests the workload was built from by
///   [`to_workload`](warmpath_sim::workload::synthetic::to_workload)), request `id` takes the
///   segments of the `id`-th synthetic request in arrival order, each segment becoming
///   `words(seed, tokens)`: requests sharing segments share text prefixes.
/// - Otherwise the keys are read as prefix names (a Mooncake trace's `hash_ids`): key `h`
///   becomes `words(h, block_tokens)` and the tokens past the complete blocks become
///   `words(s, remainder)` with `s` derived from the request id. Equal keys give equal
///   text, and since a key names a whole prefix, equal key prefixes give equal text
///   prefixes.
///
/// Either way the prompt has exactly `prompt_tokens` tokens under
/// [`warmpath_index::text::count_tokens`] (each pseudo-word is one token), and the whole
/// blocks of the workload are whole blocks of the text. A workload request whose id has no
/// synthetic request falls back to its keys.
pub fn from_workload(
    w: &Workload,
    synthetic: Option<&[SyntheticRequest]>,
    endpoint: Endpoint,
) -> Vec<LiveRequest> {
    // `to_workload` numbers requests in (stable) arrival order; follow the same order.
    let synthetic: Option<Vec<&SyntheticRequest>> = synthetic.map(|s| {
        let mut order: Vec<&SyntheticRequest> = s.iter().collect();
        order.sort_by_key(|r| r.arrival_us);
        order
    });
    w.requests
        .iter()
        .map(|r| {
            let from_segments = synthetic
                .as_ref()
                .and_then(|s| usize::try_from(r.id).ok().and_then(|i| s.get(i)));
            let prompt = match from_segments {
                Some(s) => segments_text(s),
                None => keys_text(
                    r.keys.iter().map(|k| k.0),
                    w.block_tokens,
                    r.prompt_tokens,
                    r.id,
                ),
            };
            LiveRequest {
                at_us: r.arrival_us,
                tenant: r.tenant,
                endpoint,
                prompt,
                max_tokens: r.output_tokens.max(1),
            }
        })
        .collect()
}

/// The text of a synthetic request: `words(seed, tokens)` per segment.
pub fn segments_text(r: &SyntheticRequest) -> String {
    let mut out = String::with_capacity(r.prompt_tokens() as usize * 7);
    for s in &r.segments {
        out.push_str(&words(s.seed, s.tokens as usize));
    }
    out
}

/// The text of a prompt named by prefix keys: `words(key, block_tokens)` per complete block,
/// then `words(seed of request_id, rest)` for the tokens past them.
pub fn keys_text(
    keys: impl ExactSizeIterator<Item = u64>,
    block_tokens: u32,
    prompt_tokens: u32,
    request_id: u64,
) -> String {
    let mut out = String::with_capacity(prompt_tokens as usize * 7);
    let whole = (keys.len() as u64).saturating_mul(u64::from(block_tokens));
    for k in keys {
        out.push_str(&words(k, block_tokens as usize));
    }
    let rest = u64::from(prompt_tokens).saturating_sub(whole);
    if rest > 0 {
        out.push_str(&words(tail_seed(request_id), rest as usize));
    }
    out
}

/// Seed of the text past a request's complete blocks: unique per request, and (being a
/// mixed 64-bit value) practically never one of a trace's small hash ids.
fn tail_seed(request_id: u64) -> u64 {
    const DOMAIN: u64 = 0x6c6f_6164_6765_6e00; // "loadgen\0"
    Rng::new(request_id ^ DOMAIN).next_u64()
}

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// When requests are sent.
#[derive(Clone, Debug, PartialEq)]
pub enum Mode {
    /// Each request at its `at_us / time_scale`, whether or not earlier ones have finished.
    OpenLoop {
        /// Speed-up: arrival times are divided by this (2.0 replays twice as fast).
        time_scale: f64,
    },
    /// Requests in order, with exponential gaps of mean `1 / rate_per_s` (their `at_us`
    /// is ignored), whether or not earlier ones have finished.
    Poisson {
        /// Mean arrivals per second.
        rate_per_s: f64,
        /// Fixes the gaps.
        seed: u64,
    },
    /// `concurrency` users, each sending the next request (in order) when its previous one
    /// has finished.
    ClosedLoop {
        /// Number of users (requests in flight).
        concurrency: u32,
    },
}

/// How tenant `i` is named on the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TenantAuth {
    /// Not at all (single-tenant targets).
    #[default]
    None,
    /// `x-tenant-id: tenant-{i}`.
    Header,
    /// `Authorization: Bearer {keys[i % keys.len()]}`.
    ApiKey(Vec<String>),
}

/// What [`run`] does.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadgenConfig {
    /// Base URLs like `http://127.0.0.1:8080` (plain HTTP; a trailing `/v1` is accepted);
    /// requests go to them round-robin in sending order.
    pub targets: Vec<String>,
    /// The `model` field of every request.
    pub model: String,
    /// When requests are sent.
    pub mode: Mode,
    /// Ask for streamed responses (server-sent events). Without streaming TTFT is E2E.
    pub stream: bool,
    /// Per request, from the moment it is due to the end of its response.
    pub timeout: Duration,
    /// How tenants are named.
    pub tenant_header: TenantAuth,
    /// Send at most this many requests (the first ones).
    pub max_requests: Option<usize>,
    /// Send no request after this long; requests in flight then still finish (or time
    /// out).
    pub max_duration: Option<Duration>,
}

impl LoadgenConfig {
    /// A configuration with the defaults: open loop in real time, streaming, a 60 s
    /// timeout, no tenant naming, no bounds beyond the requests given.
    pub fn new(targets: Vec<String>, model: impl Into<String>) -> Self {
        LoadgenConfig {
            targets,
            model: model.into(),
            mode: Mode::OpenLoop { time_scale: 1.0 },
            stream: true,
            timeout: Duration::from_secs(60),
            tenant_header: TenantAuth::None,
            max_requests: None,
            max_duration: None,
        }
    }
}

/// Why a load run could not start. Failures of single requests are not errors: they are
/// counted in the [`LoadReport`].
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    /// No target URL was given.
    #[error("no target: give at least one base URL such as http://127.0.0.1:8080")]
    NoTargets,
    /// A target URL that the load generator cannot send to.
    #[error("bad target `{target}`: {reason}")]
    BadTarget {
        /// The URL as given.
        target: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A setting outside its valid range.
    #[error("bad load generator setting: {0}")]
    BadConfig(String),
}

/// Where one target's endpoints are.
#[derive(Clone, Debug)]
struct Target {
    completions: Uri,
    chat: Uri,
}

impl Target {
    fn parse(base: &str) -> Result<Target, LoadgenError> {
        let bad = |reason: String| LoadgenError::BadTarget {
            target: base.to_string(),
            reason,
        };
        let trimmed = base.trim().trim_end_matches('/');
        let root = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        if !root.contains("://") {
            return Err(bad("no scheme: write http://host:port".to_string()));
        }
        let uri = |path: &str| -> Result<Uri, LoadgenError> {
            let uri: Uri = format!("{root}{path}")
                .parse()
                .map_err(|e| bad(format!("not a URL: {e}")))?;
            match uri.scheme_str() {
                Some("http") => {}
                Some(other) => {
                    return Err(bad(format!(
                    "scheme `{other}` is not supported: the load generator speaks plain HTTP/1.1"
                )))
                }
                None => return Err(bad("no scheme: write http://host:port".to_string())),
            }
            if uri.authority().is_none() {
                return Err(bad("no host".to_string()));
            }
            Ok(uri)
        };
        Ok(Target {
            completions: uri(Endpoint::Completions.path())?,
            chat: uri(Endpoint::Chat.path())?,
        })
    }

    fn uri(&self, endpoint: Endpoint) -> &Uri {
        match endpoint {
            Endpoint::Completions => &self.completions,
            Endpoint::Chat => &self.chat,
        }
    }
}

/// The configuration, checked and turned into what sending needs.
#[derive(Debug)]
struct Plan {
    targets: Vec<Target>,
    auth: Auth,
}

#[derive(Debug)]
enum Auth {
    None,
    Header,
    ApiKey(Vec<HeaderValue>),
}

impl Plan {
    fn new(config: &LoadgenConfig) -> Result<Plan, LoadgenError> {
        if config.targets.is_empty() {
            return Err(LoadgenError::NoTargets);
        }
        let targets = config
            .targets
            .iter()
            .map(|t| Target::parse(t))
            .collect::<Result<Vec<_>, _>>()?;
        let bad = |s: String| Err(LoadgenError::BadConfig(s));
        match config.mode {
            Mode::OpenLoop { time_scale } if !(time_scale.is_finite() && time_scale > 0.0) => {
                return bad(format!("time scale {time_scale} is not a positive number"))
            }
            Mode::Poisson { rate_per_s, .. } if !(rate_per_s.is_finite() && rate_per_s > 0.0) => {
                return bad(format!("rate {rate_per_s}/s is not a positive number"))
            }
            Mode::ClosedLoop { concurrency: 0 } => return bad("concurrency is 0".to_string()),
            _ => {}
        }
        if config.timeout.is_zero() {
            return bad("the request timeout is 0".to_string());
        }
        let auth = match &config.tenant_header {
            TenantAuth::None => Auth::None,
            TenantAuth::Header => Auth::Header,
            TenantAuth::ApiKey(keys) if keys.is_empty() => {
                return bad("no API keys given for the tenants".to_string())
            }
            TenantAuth::ApiKey(keys) => Auth::ApiKey(
                keys.iter()
                    .enumerate()
                    .map(|(i, k)| {
                        HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                            LoadgenError::BadConfig(format!(
                                "API key {i} has characters a header cannot carry"
                            ))
                        })
                    })
                    .collect::<Result<_, _>>()?,
            ),
        };
        Ok(Plan { targets, auth })
    }

    fn tenant_header(&self, tenant: u32) -> Option<(HeaderName, HeaderValue)> {
        match &self.auth {
            Auth::None => None,
            Auth::Header => HeaderValue::from_str(&format!("tenant-{tenant}"))
                .ok()
                .map(|v| (HeaderName::from_static(TENANT_HEADER), v)),
            Auth::ApiKey(keys) => Some((AUTHORIZATION, keys[tenant as usize % keys.len()].clone())),
        }
    }
}

/// When each request (by index) is due, from the start of the run; `None` for the closed
/// loop.
fn schedule(mode: &Mode, requests: &[LiveRequest]) -> Option<Vec<Duration>> {
    match *mode {
        Mode::OpenLoop { time_scale } => Some(
            requests
                .iter()
                .map(|r| Duration::from_secs_f64(r.at_us as f64 / 1e6 / time_scale))
                .collect(),
        ),
        Mode::Poisson { rate_per_s, seed } => {
            let mut rng = Rng::new(seed);
            let mut t = 0.0f64;
            Some(
                requests
                    .iter()
                    .map(|_| {
                        t += rng.exp(1.0 / rate_per_s);
                        Duration::from_secs_f64(t)
                    })
                    .collect(),
            )
        }
        Mode::ClosedLoop { .. } => None,
    }
}

// ---------------------------------------------------------------------------------------
// Request bodies
// ---------------------------------------------------------------------------------------

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<[WireMessage<'a>; 1]>,
    max_tokens: u32,
    stream: bool,
    // vLLM refuses stream_options on a request that does not stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    ignore_eos: bool,
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// The JSON body of `r`.
pub fn request_body(r: &LiveRequest, model: &str, stream: bool) -> Bytes {
    let wire = WireRequest {
        model,
        prompt: (r.endpoint == Endpoint::Completions).then_some(r.prompt.as_str()),
        messages: (r.endpoint == Endpoint::Chat).then_some([WireMessage {
            role: "user",
            content: &r.prompt,
        }]),
        max_tokens: r.max_tokens,
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
        ignore_eos: true,
    };
    // Serialising borrowed strings and integers into a Vec cannot fail.
    Bytes::from(serde_json::to_vec(&wire).unwrap_or_default())
}

// ---------------------------------------------------------------------------------------
// Server-sent events
// ---------------------------------------------------------------------------------------

/// An incremental server-sent-event parser: feed it body frames as they come, get the
/// `data` of each complete event. Lines end with `\n` or `\r\n`; an event ends at a blank
/// line; several `data:` lines of one event are joined with `\n`; comments (`:`) and other
/// fields (`event:`, `id:`, `retry:`) are ignored.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes not yet consumed: the start of an unfinished line.
    buf: Vec<u8>,
    /// How far `buf` is known to hold no line end.
    scanned: usize,
    /// Data of the event being read.
    data: Vec<u8>,
    /// Whether the event being read has a `data` field (possibly empty).
    has_data: bool,
}

/// Why an event stream is malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event grew past [`MAX_EVENT_BYTES`] without ending.
    #[error("an event exceeds {MAX_EVENT_BYTES} bytes")]
    TooLarge,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        SseParser::default()
    }

    /// Feeds the next bytes of the stream; returns the data of the events they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            let end = self.scanned + nl;
            let line_end = if end > start && self.buf[end - 1] == b'\r' {
                end - 1
            } else {
                end
            };
            let line = self.buf[start..line_end].to_vec();
            self.line(&line, &mut events);
            start = end + 1;
            self.scanned = start;
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        if self.buf.len() + self.data.len() > MAX_EVENT_BYTES {
            return Err(SseError::TooLarge);
        }
        Ok(events)
    }

    /// Ends the stream: the data of an event left unterminated by a blank line, if any.
    pub fn finish(&mut self) -> Option<String> {
        let mut events = Vec::new();
        if !self.buf.is_empty() {
            let line = std::mem::take(&mut self.buf);
            let line = line.strip_suffix(b"\r").unwrap_or(&line);
            self.line(line, &mut events);
        }
        self.scanned = 0;
        self.line(b"", &mut events);
        events.pop()
    }

    fn line(&mut self, line: &[u8], events: &mut Vec<String>) {
        if line.is_empty() {
            if self.has_data {
                events.push(String::from_utf8_lossy(&self.data).into_owned());
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
    }
}

/// Token counts a response reports. Lenient: missing fields are 0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct WireUsage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// `prompt_tokens_details`, where the cached prompt tokens are.
    #[serde(default)]
    pub prompt_tokens_details: Option<WireTokenDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct WireTokenDetails {
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl WireUsage {
    /// Cached prompt tokens (0 when not reported).
    pub fn cached_tokens(&self) -> u64 {
        self.prompt_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
    }
}

/// A streamed chunk, or a whole non-streamed response: the parts the load generator reads.
#[derive(Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct WireChoice {
    /// Completions.
    #[serde(default)]
    text: Option<String>,
    /// Streamed chat.
    #[serde(default)]
    delta: Option<WireContent>,
    /// Non-streamed chat.
    #[serde(default)]
    message: Option<WireContent>,
}

#[derive(Deserialize)]
struct WireContent {
    #[serde(default)]
    content: Option<String>,
}

/// What one event of a stream says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamData {
    /// `[DONE]`: the stream is complete.
    Done,
    /// A chunk: whether it carries generated text, and the usage if it reports it.
    Chunk {
        /// Some choice has non-empty `text` or `delta.content` / `message.content`.
        content: bool,
        /// `usage`, when present and not null.
        usage: Option<WireUsage>,
    },
    /// The server reported an error inside the stream.
    Error(String),
}

/// Reads the data of one event (or a whole non-streamed body); `Err` says why it is not a
/// response chunk.
pub fn parse_stream_data(data: &str) -> Result<StreamData, String> {
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(StreamData::Done);
    }
    let chunk: WireChunk =
        serde_json::from_str(data).map_err(|e| format!("not a response chunk: {e}"))?;
    if let Some(e) = chunk.error.filter(|e| !e.is_null()) {
        let message = e
            .get("message")
            .and_then(|m| m.as_str())
            .map_or_else(|| e.to_string(), str::to_string);
        return Ok(StreamData::Error(message));
    }
    let content = chunk.choices.iter().any(|c| {
        let non_empty = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());
        non_empty(&c.text)
            || c.delta.as_ref().is_some_and(|d| non_empty(&d.content))
            || c.message.as_ref().is_some_and(|m| non_empty(&m.content))
    });
    Ok(StreamData::Chunk {
        content,
        usage: chunk.usage,
    })
}

// ---------------------------------------------------------------------------------------
// One request
// ---------------------------------------------------------------------------------------

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A request ready to send.
#[derive(Debug)]
struct Job {
    uri: Uri,
    body: Bytes,
    tenant: Option<(HeaderName, HeaderValue)>,
}

/// How a request ended.
#[derive(Debug)]
enum Outcome {
    Ok(Success),
    Failed(Failure),
}

#[derive(Debug, Default)]
struct Success {
    ttft_us: u64,
    itl_us: Vec<u64>,
    e2e_us: u64,
    usage: Option<WireUsage>,
    content_chunks: u64,
}

#[derive(Debug)]
struct Failure {
    kind: String,
    status: Option<u16>,
    detail: String,
}

impl Failure {
    fn new(kind: &str, detail: impl Into<String>) -> Failure {
        Failure {
            kind: kind.to_string(),
            status: None,
            detail: detail.into(),
        }
    }
}

/// The error and its causes on one line.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let _ = write!(out, ": {s}");
        source = s.source();
    }
    out
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Sends `job`, due at `due`, and reads its response until `due + timeout`.
async fn execute(
    client: HttpClient,
    job: Job,
    due: Instant,
    timeout: Duration,
    stream: bool,
) -> Outcome {
    let deadline = due + timeout;
    let mut builder = Request::builder()
        .method(Method::POST)
        .uri(job.uri)
        .header(CONTENT_TYPE, "application/json");
    if let Some((name, value)) = job.tenant {
        builder = builder.header(name, value);
    }
    let request = match builder.body(Full::new(job.body)) {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(Failure::new("request", e.to_string())),
    };
    let response = match timeout_at(deadline, client.request(request)).await {
        Err(_) => return Outcome::Failed(Failure::new("timeout", "no response headers in time")),
        Ok(Err(e)) => {
            let kind = if e.is_connect() { "connect" } else { "request" };
            return Outcome::Failed(Failure::new(kind, error_chain(&e)));
        }
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    let sse = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    let mut body = response.into_body();
    if !status.is_success() {
        let head = read_head(&mut body, deadline, ERROR_BODY_BYTES).await;
        return Outcome::Failed(Failure {
            kind: format!("status_{}", status.as_u16()),
            status: Some(status.as_u16()),
            detail: String::from_utf8_lossy(&head).into_owned(),
        });
    }
    if stream && sse {
        read_stream(body, due, deadline).await
    } else {
        read_whole(body, due, deadline).await
    }
}

/// Up to `limit` bytes of the start of a body (fewer when it ends, fails or runs late).
async fn read_head(body: &mut Incoming, deadline: Instant, limit: usize) -> Vec<u8> {
    let mut head = Vec::new();
    while head.len() < limit {
        match timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    head.extend_from_slice(data);
                }
            }
            _ => break,
        }
    }
    head.truncate(limit);
    head
}

async fn read_whole(mut body: Incoming, due: Instant, deadline: Instant) -> Outcome {
    let mut bytes = Vec::new();
    loop {
        match timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Outcome::Failed(Failure::new(
                    "timeout",
                    "response body not complete in time",
                ))
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return Outcome::Failed(Failure::new("body", error_chain(&e))),
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    bytes.extend_from_slice(data);
                    if bytes.len() > MAX_BODY_BYTES {
                        return Outcome::Failed(Failure::new(
                            "bad_response",
                            format!("body larger than {MAX_BODY_BYTES} bytes"),
                        ));
                    }
                }
            }
        }
    }
    let e2e_us = micros(due);
    let text = String::from_utf8_lossy(&bytes);
    match parse_stream_data(&text) {
        Ok(StreamData::Chunk { content, usage }) => Outcome::Ok(Success {
            ttft_us: e2e_us,
            itl_us: Vec::new(),
            e2e_us,
            usage,
            content_chunks: u64::from(content),
        }),
        Ok(StreamData::Error(message)) => Outcome::Failed(Failure::new("stream_error", message)),
        Ok(StreamData::Done) => {
            Outcome::Failed(Failure::new("bad_response", "[DONE] as a whole body"))
        }
        Err(reason) => Outcome::Failed(Failure::new("bad_response", reason)),
    }
}

async fn read_stream(mut body: Incoming, due: Instant, deadline: Instant) -> Outcome {
    let mut parser = SseParser::new();
    let mut s = Success::default();
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    let mut done = false;
    // Reads until [DONE]; then the end of the body is still read (when it comes in time)
    // so that the connection goes back to the pool.
    loop {
        let frame = match timeout_at(deadline, body.frame()).await {
            Err(_) if done => break,
            Err(_) => {
                return Outcome::Failed(Failure::new("timeout", "stream not complete in time"))
            }
            Ok(None) => {
                if let Some(data) = parser.finish() {
                    if let Err(f) = on_event(&data, &mut s, &mut first, &mut last, &mut done) {
                        return Outcome::Failed(f);
                    }
                }
                break;
            }
            Ok(Some(Err(_))) if done => break,
            Ok(Some(Err(e))) => return Outcome::Failed(Failure::new("body", error_chain(&e))),
            Ok(Some(Ok(frame))) => frame,
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        if done {
            continue;
        }
        let events = match parser.push(data) {
            Ok(events) => events,
            Err(e) => return Outcome::Failed(Failure::new("malformed_sse", e.to_string())),
        };
        for event in events {
            if let Err(f) = on_event(&event, &mut s, &mut first, &mut last, &mut done) {
                return Outcome::Failed(f);
            }
            if done {
                s.e2e_us = micros(due);
                break;
            }
        }
    }
    if !done {
        s.e2e_us = micros(due);
    }
    // A stream without content (zero tokens asked or returned) first answered at its end.
    s.ttft_us = first.map_or(s.e2e_us, |t| micro_between(due, t));
    Outcome::Ok(s)
}

fn micro_between(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_micros()).unwrap_or(u64::MAX)
}

/// Applies one event's data to a stream's measurements.
fn on_event(
    data: &str,
    s: &mut Success,
    first: &mut Option<Instant>,
    last: &mut Option<Instant>,
    done: &mut bool,
) -> Result<(), Failure> {
    match parse_stream_data(data) {
        Ok(StreamData::Done) => *done = true,
        Ok(StreamData::Chunk { content, usage }) => {
            if content {
                let now = Instant::now();
                if first.is_none() {
                    *first = Some(now);
                }
                if let Some(prev) = *last {
                    s.itl_us.push(micro_between(prev, now));
                }
                *last = Some(now);
                s.content_chunks += 1;
            }
            if usage.is_some() {
                s.usage = usage;
            }
        }
        Ok(StreamData::Error(message)) => return Err(Failure::new("stream_error", message)),
        Err(reason) => return Err(Failure::new("malformed_sse", reason)),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------

/// Where a run stands, reported every [`PROGRESS_EVERY`] and once at the end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Progress {
    /// Requests finished (successfully or not).
    pub done: u64,
    /// Requests the run will send at most.
    pub total: u64,
    /// Requests that failed so far.
    pub errors: u64,
    /// Requests sent and not yet finished.
    pub in_flight: u64,
}

/// Counters the progress tick reads while the run updates them.
#[derive(Debug, Default)]
struct Counters {
    sent: AtomicU64,
    done: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    fn progress(&self, total: u64) -> Progress {
        let done = self.done.load(Ordering::Relaxed);
        Progress {
            done,
            total,
            errors: self.errors.load(Ordering::Relaxed),
            in_flight: self.sent.load(Ordering::Relaxed).saturating_sub(done),
        }
    }
}

/// Latency figures of one measure, in milliseconds (all 0 when nothing was measured).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    /// Samples measured.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
    /// Largest.
    pub max: f64,
}

impl Latency {
    fn of(h: &Histogram<u64>) -> Latency {
        if h.is_empty() {
            return Latency::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Latency {
            count: h.len(),
            p50: ms(h.value_at_quantile(0.5)),
            p90: ms(h.value_at_quantile(0.9)),
            p99: ms(h.value_at_quantile(0.99)),
            mean: h.mean() / 1000.0,
            max: ms(h.max()),
        }
    }
}

/// One failed request, kept as an example of its kind.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ErrorSample {
    /// The kind it is counted under in [`LoadReport::errors`].
    pub kind: String,
    /// The HTTP status, for `status_*` kinds.
    pub status: Option<u16>,
    /// The first [`ERROR_BODY_BYTES`] bytes of the error body, or the error message.
    pub detail: String,
}

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadReport {
    /// Requests sent.
    pub requests: u64,
    /// Requests not sent because [`LoadgenConfig::max_duration`] ran out.
    pub not_sent: u64,
    /// Requests answered with a complete 2xx response.
    pub ok: u64,
    /// Failed requests by kind: `connect` (refused or unreachable), `request` (failed while
    /// sending), `timeout`, `status_<code>` (non-2xx), `body` (the response broke off),
    /// `malformed_sse`, `stream_error` (an error event in the stream), `bad_response` (a
    /// body that is not a response), `internal` (a load generator task failed).
    pub errors: BTreeMap<String, u64>,
    /// The first [`ERROR_SAMPLES`] failures, with status and body or message.
    pub error_samples: Vec<ErrorSample>,
    /// Time to first token: from the moment a request is due to the first chunk with
    /// generated text (the whole response without streaming).
    pub ttft_ms: Latency,
    /// Gaps between successive chunks with generated text.
    pub itl_ms: Latency,
    /// From the moment a request is due to `[DONE]` (or the end of the body).
    pub e2e_ms: Latency,
    /// Successful requests per second of wall time.
    pub throughput_rps: f64,
    /// Generated tokens of successful requests (from usage, else text chunks).
    pub output_tokens: u64,
    /// `output_tokens` per second of wall time.
    pub output_tokens_per_s: f64,
    /// Prompt tokens reported in usage.
    pub prompt_tokens: u64,
    /// Prompt tokens reported as cached (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens` (0 without prompt tokens).
    pub hit_rate: f64,
    /// Successful responses that reported no usage.
    pub without_usage: u64,
    /// From the start of the run to the end of its last request, in seconds.
    pub wall_s: f64,
    /// TTFT (ms) at the quantiles 0, 0.01, …, 1, for plots (left out of `--json`); empty
    /// when nothing was measured.
    #[serde(skip)]
    pub ttft_cdf_ms: Vec<f64>,
}

impl LoadReport {
    /// Failed requests, all kinds together.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// The figures a run accumulates.
#[derive(Debug)]
struct Collector {
    ok: u64,
    errors: BTreeMap<String, u64>,
    samples: Vec<ErrorSample>,
    ttft: Histogram<u64>,
    itl: Histogram<u64>,
    e2e: Histogram<u64>,
    output_tokens: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    without_usage: u64,
}

fn histogram() -> Histogram<u64> {
    // Constant, valid bounds (1 <= low, 2 * low <= high, sigfig <= 5): cannot fail.
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("valid histogram bounds")
}

impl Collector {
    fn new() -> Collector {
        Collector {
            ok: 0,
            errors: BTreeMap::new(),
            samples: Vec::new(),
            ttft: histogram(),
            itl: histogram(),
            e2e: histogram(),
            output_tokens: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            without_usage: 0,
        }
    }

    fn record(&mut self, joined: Result<Outcome, JoinError>, counters: &Counters) {
        let outcome = joined.unwrap_or_else(|e| {
            Outcome::Failed(Failure::new(
                "internal",
                format!("request task failed: {e}"),
            ))
        });
        match outcome {
            Outcome::Ok(s) => {
                self.ok += 1;
                self.ttft.saturating_record(s.ttft_us);
                self.e2e.saturating_record(s.e2e_us);
                for &gap in &s.itl_us {
                    self.itl.saturating_record(gap);
                }
                match &s.usage {
                    Some(u) => {
                        self.prompt_tokens += u.prompt_tokens;
                        self.cached_tokens += u.cached_tokens();
                        self.output_tokens += u.completion_tokens;
                    }
                    None => {
                        self.without_usage += 1;
                        self.output_tokens += s.content_chunks;
                    }
                }
            }
            Outcome::Failed(f) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                *self.errors.entry(f.kind.clone()).or_insert(0) += 1;
                if self.samples.len() < ERROR_SAMPLES {
                    self.samples.push(ErrorSample {
                        kind: f.kind,
                        status: f.status,
                        detail: f.detail,
                    });
                }
            }
        }
        counters.done.fetch_add(1, Ordering::Relaxed);
    }

    fn report(self, sent: u64, total: u64, wall: Duration) -> LoadReport {
        let wall_s = wall.as_secs_f64();
        let per_s = |x: u64| if wall_s > 0.0 { x as f64 / wall_s } else { 0.0 };
        LoadReport {
            requests: sent,
            not_sent: total.saturating_sub(sent),
            ok: self.ok,
            errors: self.errors,
            error_samples: self.samples,
            ttft_ms: Latency::of(&self.ttft),
            itl_ms: Latency::of(&self.itl),
            e2e_ms: Latency::of(&self.e2e),
            throughput_rps: per_s(self.ok),
            output_tokens: self.output_tokens,
            output_tokens_per_s: per_s(self.output_tokens),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            hit_rate: if self.prompt_tokens == 0 {
                0.0
            } else {
                self.cached_tokens as f64 / self.prompt_tokens as f64
            },
            without_usage: self.without_usage,
            wall_s,
            ttft_cdf_ms: if self.ttft.is_empty() {
                Vec::new()
            } else {
                warmpath_sim::stats::cdf(|q| self.ttft.value_at_quantile(q) as f64 / 1000.0)
            },
        }
    }
}

/// What the sending loop shares with every request.
#[derive(Debug)]
struct Sender<'a> {
    config: &'a LoadgenConfig,
    plan: Plan,
    client: HttpClient,
}

impl Sender<'_> {
    /// Prepares the `seq`-th request sent (round-robin over the targets by `seq`).
    fn job(&self, seq: usize, r: &LiveRequest) -> Job {
        let target = &self.plan.targets[seq % self.plan.targets.len()];
        Job {
            uri: target.uri(r.endpoint).clone(),
            body: request_body(r, &self.config.model, self.config.stream),
            tenant: self.plan.tenant_header(r.tenant),
        }
    }

    fn spawn(&self, set: &mut JoinSet<Outcome>, job: Job, due: Instant, counters: &Counters) {
        counters.sent.fetch_add(1, Ordering::Relaxed);
        set.spawn(execute(
            self.client.clone(),
            job,
            due,
            self.config.timeout,
            self.config.stream,
        ));
    }
}

/// Sends `requests` (the first [`LoadgenConfig::max_requests`]) as `config` says and
/// measures the responses. Calls `progress` every [`PROGRESS_EVERY`] and once at the end.
/// Fails only on a configuration it cannot run; failed requests are counted in the report.
/// Must run inside a tokio runtime.
pub async fn run(
    config: &LoadgenConfig,
    requests: &[LiveRequest],
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<LoadReport, LoadgenError> {
    let plan = Plan::new(config)?;
    let requests = &requests[..config
        .max_requests
        .unwrap_or(usize::MAX)
        .min(requests.len())];
    let total = requests.len() as u64;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(connector);
    let sender = Sender {
        config,
        plan,
        client,
    };
    let counters = Counters::default();
    let start = Instant::now();
    let stop_at = config.max_duration.map(|d| start + d);

    let drive = drive(&sender, requests, start, stop_at, &counters);
    tokio::pin!(drive);
    let mut tick = tokio::time::interval_at(start + PROGRESS_EVERY, PROGRESS_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let collector = loop {
        tokio::select! {
            collector = &mut drive => break collector,
            _ = tick.tick() => progress(counters.progress(total)),
        }
    };
    let wall = start.elapsed();
    progress(counters.progress(total));
    Ok(collector.report(counters.sent.load(Ordering::Relaxed), total, wall))
}

/// The sending loop: spawns a task per request when it is due and collects the outcomes.
async fn drive(
    sender: &Sender<'_>,
    requests: &[LiveRequest],
    start: Instant,
    stop_at: Option<Instant>,
    counters: &Counters,
) -> Collector {
    let mut collector = Collector::new();
    let mut set: JoinSet<Outcome> = JoinSet::new();
    let past_stop = |t: Instant| stop_at.is_some_and(|s| t > s);
    match schedule(&sender.config.mode, requests) {
        Some(due) => {
            // Open loop: in order of due time (stable), never waiting for earlier requests.
            let mut order: Vec<usize> = (0..requests.len()).collect();
            order.sort_by_key(|&i| due[i]);
            for (seq, i) in order.into_iter().enumerate() {
                let at = start + due[i];
                if past_stop(at) {
                    break;
                }
                // Build the body while waiting, then collect finished requests until due.
                let job = sender.job(seq, &requests[i]);
                let sleep = sleep_until(at);
                tokio::pin!(sleep);
                loop {
                    tokio::select! {
                        biased;
                        _ = &mut sleep => break,
                        Some(joined) = set.join_next(), if !set.is_empty() => {
                            collector.record(joined, counters);
                        }
                    }
                }
                sender.spawn(&mut set, job, at, counters);
            }
        }
        None => {
            // Closed loop: keep `concurrency` requests in flight, in order.
            let concurrency = match sender.config.mode {
                Mode::ClosedLoop { concurrency } => concurrency.max(1) as usize,
                _ => 1,
            };
            let mut next = 0;
            loop {
                while set.len() < concurrency && next < requests.len() && !past_stop(Instant::now())
                {
                    let job = sender.job(next, &requests[next]);
                    sender.spawn(&mut set, job, Instant::now(), counters);
                    next += 1;
                }
                match set.join_next().await {
                    Some(joined) => collector.record(joined, counters),
                    None => break,
                }
            }
        }
    }
    while let Some(joined) = set.join_next().await {
        collector.record(joined, counters);
    }
    collector
}

// ---------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------

/// The report as a readable table.
pub fn render_report(r: &LoadReport) -> String {
    let mut out = String::new();
    let errors = r.error_count();
    let _ = writeln!(
        out,
        "requests   {} sent, {} ok, {} failed{}",
        r.requests,
        r.ok,
        errors,
        if r.not_sent > 0 {
            format!(", {} not sent (time limit)", r.not_sent)
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        out,
        "wall       {:.2} s, {:.2} req/s, {:.1} output tok/s ({} tokens)",
        r.wall_s, r.throughput_rps, r.output_tokens_per_s, r.output_tokens
    );
    let _ = writeln!(
        out,
        "prefix     {} of {} prompt tokens cached: hit rate {:.1}%{}",
        r.cached_tokens,
        r.prompt_tokens,
        r.hit_rate * 100.0,
        if r.without_usage > 0 {
            format!(" ({} responses without usage)", r.without_usage)
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        out,
        "\n{:<10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "ms", "count", "p50", "p90", "p99", "mean", "max"
    );
    for (name, l) in [("ttft", &r.ttft_ms), ("itl", &r.itl_ms), ("e2e", &r.e2e_ms)] {
        let _ = writeln!(
            out,
            "{:<10}{:>10}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}",
            name, l.count, l.p50, l.p90, l.p99, l.mean, l.max
        );
    }
    if !r.errors.is_empty() {
        let _ = writeln!(out, "\nerrors");
        for (kind, n) in &r.errors {
            let _ = writeln!(out, "  {kind:<20}{n:>8}");
        }
        for s in &r.error_samples {
            let detail: String = s.detail.chars().filter(|c| !c.is_control()).collect();
            let _ = writeln!(out, "  e.g. {}: {}", s.kind, detail);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
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
    use warmpath_sim::workload::mooncake::parse_mooncake;
    use warmpath_sim::workload::synthetic::{
        generate, to_workload, SyntheticKind, SyntheticParams,
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
        let expected: BTreeMap<String, u64> =
            [("connect", 2), ("malformed_sse", 2), ("status_500", 2)]
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

    /// Feeds `stream` to a parser cut at every position (and byte by byte); every way must
    /// give `expected`.
    fn check_sse(stream: &str, expected: &[&str]) {
        let bytes = stream.as_bytes();
        let mut cuts: Vec<Vec<&[u8]>> = (0..=bytes.len())
            .map(|i| vec![&bytes[..i], &bytes[i..]])
            .collect();
        cuts.push(bytes.chunks(1).collect());
        for pieces in cuts {
            let mut p = SseParser::new();
            let mut got = Vec::new();
            for piece in &pieces {
                got.extend(p.push(piece).unwrap());
            }
            got.extend(p.finish());
            assert_eq!(got, expected, "{stream:?} cut as {pieces:?}");
        }
    }

    #[test]
    fn sse_parser_cases() {
        check_sse("data: a\n\ndata: b\n\n", &["a", "b"]);
        check_sse("data: a\r\n\r\ndata:b\r\n\r\n", &["a", "b"]);
        check_sse("data: one\ndata: two\n\n", &["one\ntwo"]);
        check_sse(
            ": keep-alive\n\nevent: x\nid: 3\ndata: a\nretry: 5\n\n",
            &["a"],
        );
        check_sse("event: ping\n\n\n\ndata\n\n", &[""]);
        check_sse(
            "data: {\"a\": \"x: y\"}\n\ndata: [DONE]",
            &["{\"a\": \"x: y\"}", "[DONE]"],
        );
        check_sse("data:  two spaces\n\n", &[" two spaces"]);
        check_sse("", &[]);
    }

    #[test]
    fn sse_events_have_a_size_limit() {
        let mut p = SseParser::new();
        let big = vec![b'x'; MAX_EVENT_BYTES / 2 + 1];
        assert_eq!(p.push(b"data: "), Ok(vec![]));
        assert_eq!(p.push(&big), Ok(vec![]));
        assert_eq!(p.push(&big), Err(SseError::TooLarge));
    }

    #[test]
    fn stream_data_cases() {
        let chunk = |content, usage| Ok(StreamData::Chunk { content, usage });
        let with_cache = WireUsage {
            prompt_tokens: 10,
            completion_tokens: 2,
            prompt_tokens_details: Some(WireTokenDetails {
                cached_tokens: Some(4),
            }),
        };
        let cases: Vec<(&str, Result<StreamData, String>)> = vec![
            ("[DONE]", Ok(StreamData::Done)),
            (" [DONE] ", Ok(StreamData::Done)),
            (r#"{"choices":[{"text":"a"}]}"#, chunk(true, None)),
            (
                r#"{"choices":[{"text":""}],"usage":null}"#,
                chunk(false, None),
            ),
            (
                r#"{"choices":[{"delta":{"content":"a"}}]}"#,
                chunk(true, None),
            ),
            (
                r#"{"choices":[{"delta":{"role":"assistant"}}]}"#,
                chunk(false, None),
            ),
            (
                r#"{"choices":[{"delta":{"content":null}}]}"#,
                chunk(false, None),
            ),
            (
                r#"{"choices":[{"message":{"content":"a"}}]}"#,
                chunk(true, None),
            ),
            (
                r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":4}}}"#,
                chunk(false, Some(with_cache.clone())),
            ),
            (
                r#"{"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":null}}"#,
                chunk(
                    false,
                    Some(WireUsage {
                        prompt_tokens_details: None,
                        ..with_cache.clone()
                    }),
                ),
            ),
            (
                r#"{"error":{"message":"overloaded","type":"server_error"}}"#,
                Ok(StreamData::Error("overloaded".into())),
            ),
            (
                r#"{"error":"plain"}"#,
                Ok(StreamData::Error("\"plain\"".into())),
            ),
        ];
        for (data, expected) in cases {
            assert_eq!(parse_stream_data(data), expected, "{data}");
        }
        assert_eq!(with_cache.cached_tokens(), 4);
        assert_eq!(WireUsage::default().cached_tokens(), 0);
        for bad in ["{not json", "", "[1, 2]"] {
            assert!(parse_stream_data(bad).is_err(), "{bad}");
        }
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
}
