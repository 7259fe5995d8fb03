//! The load generator behind `warmpath loadgen`: OpenAI-style HTTP load against a warmpath
//! router or an engine (real or simulated), measuring what users feel.
//!
//! Four parts, from pure to I/O:
//!
//! - `request`: [`from_workload`] turns a [`Workload`](warmpath_sim::workload::Workload)
//!   into [`LiveRequest`]s with deterministic text (built from
//!   [`words`](warmpath_index::text::words)), so that requests sharing a prefix in the
//!   workload share a text prefix on the wire, and every prompt has the workload's token
//!   count under the built-in tokenizer; [`request_body`] is the JSON each is sent with.
//! - `config`: [`LoadgenConfig`] (targets, [`Mode`], [`TenantAuth`], bounds), checked once
//!   before a run, and when each request is due.
//! - `report`: what a run measured, [`LoadReport`] (time to first token (TTFT),
//!   inter-token latency (ITL), end-to-end latency (E2E), throughput, the prompt tokens the
//!   server reports as cached, and errors by kind); [`render_report`] prints it as a table.
//! - `driver`: [`run`] sends the requests (open loop at their times, Poisson arrivals, or a
//!   closed loop of N users) over one keep-alive HTTP/1.1 client pool and returns the
//!   report.
//!
//! Responses are read with `warmpath_openai` (server-sent events from body frames of any
//! size, response chunks, `usage`), the definitions the router reads engines' answers
//! with too.
//!
//! Latencies are measured from the moment a request is due: in the open-loop modes that is
//! its scheduled time, so a load generator that falls behind shows up in the figures
//! instead of hiding (no coordinated omission); in the closed loop it is the moment a user
//! sends. A run always ends: requests are bounded by [`LoadgenConfig::max_requests`], no
//! request is sent after [`LoadgenConfig::max_duration`], and each request is cut off at
//! [`LoadgenConfig::timeout`].

mod config;
mod driver;
mod report;
mod request;

pub use config::{LoadgenConfig, LoadgenError, Mode, TenantAuth, TENANT_HEADER};
pub use driver::{run, Progress, MAX_BODY_BYTES, PROGRESS_EVERY};
pub use report::{
    render_report, ErrorSample, Latency, LoadReport, ERROR_BODY_BYTES, ERROR_SAMPLES,
    MAX_LATENCY_US,
};
pub use request::{from_workload, keys_text, request_body, segments_text, Endpoint, LiveRequest};

#[cfg(test)]
mod tests;
