//! Workloads: the requests a simulation or a load test replays.
//!
//! Every source (a Mooncake trace, Azure arrivals, the synthetic generators) produces the
//! same [`Workload`]: requests in arrival order, each with the prefix keys of its prompt's
//! complete blocks. The trace readers share [`ReadOptions`], [`ReadReport`] and
//! [`WorkloadError`]; [`Workload::stats`] gives the figures a report prints about a
//! workload, among them the ideal prefix-hit ratio (an infinite cache, no routing loss).

use std::collections::HashSet;
use std::path::PathBuf;

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

/// Summary figures of a [`Workload`], for reports and tests.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct WorkloadStats {
    /// Number of requests.
    pub requests: usize,
    /// Arrival time of the last request, in microseconds (the first arrives at or after 0).
    pub duration_us: u64,
    /// Mean prompt length in tokens (0 for an empty workload).
    pub mean_prompt_tokens: f64,
    /// Mean output length in tokens (0 for an empty workload).
    pub mean_output_tokens: f64,
    /// Complete blocks over all requests (the sum of `keys.len()`).
    pub blocks: u64,
    /// Distinct `(tenant, key)` pairs over all requests.
    pub unique_blocks: u64,
    /// Blocks that belong to the longest prefix of their request already seen in an earlier
    /// request of the same tenant, over all blocks: the hit ratio of one prefix cache with
    /// infinite capacity, no eviction and no routing loss (0 when there are no blocks).
    pub ideal_hit_ratio: f64,
}

impl Workload {
    /// Counts, means and the ideal prefix-hit ratio of this workload.
    pub fn stats(&self) -> WorkloadStats {
        // Keys are per tenant, so tenants never match each other's blocks.
        let (matched, unique) = self.ideal_matches();
        let hits: u64 = matched.iter().map(|&m| u64::from(m)).sum();
        let mut blocks = 0u64;
        let mut prompt_sum = 0u64;
        let mut output_sum = 0u64;
        for r in &self.requests {
            blocks += r.keys.len() as u64;
            prompt_sum += u64::from(r.prompt_tokens);
            output_sum += u64::from(r.output_tokens);
        }
        let n = self.requests.len();
        let mean = |sum: u64| if n == 0 { 0.0 } else { sum as f64 / n as f64 };
        WorkloadStats {
            requests: n,
            duration_us: self
                .requests
                .iter()
                .map(|r| r.arrival_us)
                .max()
                .unwrap_or(0),
            mean_prompt_tokens: mean(prompt_sum),
            mean_output_tokens: mean(output_sum),
            blocks,
            unique_blocks: unique as u64,
            ideal_hit_ratio: if blocks == 0 {
                0.0
            } else {
                hits as f64 / blocks as f64
            },
        }
    }

    /// With an infinite cache: per request, how many leading blocks an earlier request of
    /// the workload already held (keys name whole prefixes, so that is the run of leading
    /// keys already seen); and how many distinct blocks the workload has. The ideal bound
    /// (`bounds::ideal_hit_rate`) and [`Workload::stats`] both count from it.
    pub fn ideal_matches(&self) -> (Vec<u32>, usize) {
        let mut seen = HashSet::new();
        let matched = self
            .requests
            .iter()
            .map(|r| {
                let m = r.keys.iter().take_while(|k| seen.contains(*k)).count() as u32;
                seen.extend(r.keys.iter().copied());
                m
            })
            .collect();
        (matched, seen.len())
    }

    /// Per request, how many leading blocks are a whole earlier prompt (of the same tenant:
    /// keys are per tenant): the context a follow-up turn inherits from the turn before it.
    /// 0 for a request that follows no earlier one. Keys name whole prefixes, so an earlier
    /// request's last key at position `p` of a later prompt means the earlier prompt's
    /// complete blocks are the later one's first `p + 1`; the latest such position counts.
    pub fn follow_up_context(&self) -> Vec<u32> {
        let mut last_keys: HashSet<BlockKey> = HashSet::new();
        self.requests
            .iter()
            .map(|r| {
                let inherited = r
                    .keys
                    .iter()
                    .rposition(|k| last_keys.contains(k))
                    .map_or(0, |p| p as u32 + 1);
                if let Some(&last) = r.keys.last() {
                    last_keys.insert(last);
                }
                inherited
            })
            .collect()
    }
}

/// How the trace readers treat their input.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Skip a bad line (and count it in [`ReadReport::skipped`]) instead of failing with
    /// [`WorkloadError::BadLine`].
    pub skip_bad_lines: bool,
    /// A prompt longer than this many tokens makes its line bad; `None`: no limit.
    pub max_prompt_tokens: Option<u32>,
}

/// What a trace reader did with its input.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadReport {
    /// Data lines read: not blank, not the header (`requests + skipped`).
    pub lines: usize,
    /// Requests (or rows) produced.
    pub requests: usize,
    /// Bad lines skipped under [`ReadOptions::skip_bad_lines`].
    pub skipped: usize,
}

/// Why a workload could not be read or built.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The trace file could not be read (missing, unreadable, or not UTF-8).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line of a trace is not a valid request (and bad lines are not being skipped).
    #[error("{file}:{line}: {reason}")]
    BadLine {
        /// The file (or the name given to the parser).
        file: String,
        /// Line number, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A CSV trace does not start with the expected header line.
    #[error("{file}: expected the header `{expected}`, found `{found}`")]
    BadHeader {
        /// The file (or the name given to the parser).
        file: String,
        /// The header the format requires.
        expected: &'static str,
        /// The first line actually found (empty for an empty file).
        found: String,
    },
    /// A synthetic workload name that is not one of the known patterns.
    #[error("unknown synthetic workload `{name}` (valid: {valid})")]
    UnknownSynthetic {
        /// The name given.
        name: String,
        /// The valid names, comma-separated.
        valid: &'static str,
    },
    /// Synthetic workload parameters that cannot describe a workload.
    #[error("bad synthetic parameters: {reason}")]
    BadParams {
        /// Which parameter is wrong and why.
        reason: String,
    },
}

pub mod azure;
pub mod mooncake;
pub mod synthetic;

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: u64, keys: &[u64]) -> Request {
        Request {
            id,
            arrival_us: id,
            tenant: 0,
            keys: keys.iter().map(|&k| BlockKey(k)).collect(),
            prompt_tokens: keys.len() as u32 * 16 + 5,
            output_tokens: 1,
        }
    }

    #[test]
    fn a_follow_up_inherits_the_whole_latest_earlier_prompt_it_begins_with() {
        let w = Workload {
            name: "turns".into(),
            block_tokens: 16,
            requests: vec![
                request(0, &[1, 2]),
                // The next turn: all of request 0, then more.
                request(1, &[1, 2, 3, 4]),
                // Shares a first block only: no earlier prompt ends inside it.
                request(2, &[1, 9]),
                // The turn after request 1: its whole prompt, the latest one, counts.
                request(3, &[1, 2, 3, 4, 5, 6]),
                request(4, &[7]),
            ],
        };
        assert_eq!(w.follow_up_context(), vec![0, 2, 0, 4, 0]);
    }
}
