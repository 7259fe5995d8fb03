//! What a run measured: each request's [`Outcome`], the [`Collector`] that accumulates them
//! into HDR histograms and counts, the [`LoadReport`] it yields, and [`render_report`], the
//! report as a table. Pure: no I/O.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;
use warmpath_openai::Usage;

/// How many bytes of an error response body a report keeps.
pub const ERROR_BODY_BYTES: usize = 200;
/// How many [`ErrorSample`]s a report keeps (the first ones).
pub const ERROR_SAMPLES: usize = 5;
/// Latencies above this (one hour, in microseconds) are recorded as this.
pub const MAX_LATENCY_US: u64 = 3_600_000_000;

/// How a request ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    Ok(Success),
    Failed(Failure),
}

#[derive(Debug, Default)]
pub(crate) struct Success {
    pub(crate) ttft_us: u64,
    pub(crate) itl_us: Vec<u64>,
    pub(crate) e2e_us: u64,
    pub(crate) usage: Option<Usage>,
    pub(crate) content_chunks: u64,
}

#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) kind: String,
    pub(crate) status: Option<u16>,
    pub(crate) detail: String,
}

impl Failure {
    pub(crate) fn new(kind: &str, detail: impl Into<String>) -> Failure {
        Failure {
            kind: kind.to_string(),
            status: None,
            detail: detail.into(),
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
pub(crate) struct Collector {
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
    pub(crate) fn new() -> Collector {
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

    /// Adds one request's outcome; whether it failed.
    pub(crate) fn record(&mut self, outcome: Outcome) -> bool {
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
                        self.prompt_tokens += u64::from(u.prompt_tokens);
                        self.cached_tokens += u64::from(u.cached_tokens().unwrap_or(0));
                        self.output_tokens += u64::from(u.completion_tokens);
                    }
                    None => {
                        self.without_usage += 1;
                        self.output_tokens += s.content_chunks;
                    }
                }
                false
            }
            Outcome::Failed(f) => {
                *self.errors.entry(f.kind.clone()).or_insert(0) += 1;
                if self.samples.len() < ERROR_SAMPLES {
                    self.samples.push(ErrorSample {
                        kind: f.kind,
                        status: f.status,
                        detail: f.detail,
                    });
                }
                true
            }
        }
    }

    pub(crate) fn report(self, sent: u64, total: u64, wall: Duration) -> LoadReport {
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
