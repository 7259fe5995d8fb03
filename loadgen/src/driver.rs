//! The HTTP driver: sends the requests over one keep-alive HTTP/1.1 client pool (open loop
//! at their times, Poisson arrivals, or a closed loop of N users), reads each response
//! (whole, or as server-sent events through `warmpath_openai`) into an [`Outcome`], and
//! hands the outcomes to the report's [`Collector`].

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use tokio::task::{JoinError, JoinSet};
use tokio::time::{sleep_until, timeout_at, Instant, MissedTickBehavior};
use warmpath_openai::{parse_stream_data, SseReader, StreamData};

use crate::config::{schedule, LoadgenConfig, LoadgenError, Mode, Plan};
use crate::report::{Collector, Failure, LoadReport, Outcome, Success, ERROR_BODY_BYTES};
use crate::request::{request_body, LiveRequest};

/// How often [`run`] reports [`Progress`].
pub const PROGRESS_EVERY: Duration = Duration::from_millis(250);
/// A non-streamed response body larger than this is refused.
pub const MAX_BODY_BYTES: usize = 64 << 20;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A request ready to send.
#[derive(Debug)]
struct Job {
    uri: Uri,
    body: Bytes,
    tenant: Option<(HeaderName, HeaderValue)>,
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
    let mut parser = SseReader::new();
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
                let mut last_event = None;
                parser.finish(|d| last_event = Some(String::from_utf8_lossy(d).into_owned()));
                if let Some(data) = last_event {
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
        let mut events = Vec::new();
        if let Err(e) = parser.push(data, |d| {
            events.push(String::from_utf8_lossy(d).into_owned());
        }) {
            return Outcome::Failed(Failure::new("malformed_sse", e.to_string()));
        }
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

/// Records a finished request task's outcome, and counts it for the progress reports.
fn record(collector: &mut Collector, joined: Result<Outcome, JoinError>, counters: &Counters) {
    let outcome = joined.unwrap_or_else(|e| {
        Outcome::Failed(Failure::new(
            "internal",
            format!("request task failed: {e}"),
        ))
    });
    if collector.record(outcome) {
        counters.errors.fetch_add(1, Ordering::Relaxed);
    }
    counters.done.fetch_add(1, Ordering::Relaxed);
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
                            record(&mut collector, joined, counters);
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
                    Some(joined) => record(&mut collector, joined, counters),
                    None => break,
                }
            }
        }
    }
    while let Some(joined) = set.join_next().await {
        record(&mut collector, joined, counters);
    }
    collector
}
