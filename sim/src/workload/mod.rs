//! Workloads: the requests a simulation or a load test replays.
//!
//! Every source (a Mooncake trace, Azure arrivals, the synthetic generators) produces the
//! same [`Workload`]: requests in arrival order, each with the prefix keys of its prompt's
//! complete blocks.

use warmpath_index::keys::BlockKey;

/// One request to replay.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Position in the workload, from 0.
    pub id: u64,
    /// Arrival time in microseconds from the start of the workload.
    pub arrival_us: u64,
    /// Tenant index (0 for single-tenant workloads).
    pub tenant: u32,
    /// Prefix keys of the prompt's complete blocks of `Workload::block_tokens` tokens.
    pub keys: Vec<BlockKey>,
    /// Prompt length in tokens (at least `keys.len() * block_tokens`).
    pub prompt_tokens: u32,
    /// Tokens to generate (at least 1).
    pub output_tokens: u32,
}

/// A replayable sequence of requests.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// Where it came from, for reports (`synthetic_trace.jsonl`, `chat`, ...).
    pub name: String,
    /// Tokens per block of every request's `keys`.
    pub block_tokens: u32,
    /// Requests sorted by `arrival_us`.
    pub requests: Vec<Request>,
}

pub mod azure;
pub mod mooncake;
pub mod synthetic;
