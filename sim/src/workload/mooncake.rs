//! Reader for Mooncake FAST'25 traces (JSON Lines with prefix-block hashes).
//!
//! Each line is one request: `{"timestamp": ms, "input_length": n, "output_length": n,
//! "hash_ids": [...]}` (extra fields are ignored; the timestamp may be an integer or a
//! float). Blocks are [`BLOCK_TOKENS`] tokens and the `hash_ids` already name whole
//! prefixes, so they become [`BlockKey`]s directly (one tenant), one per complete block:
//! the first `input_length / 512` ids. When `input_length` is not a multiple of 512 the
//! last id names a partial block and is dropped, as warmpath counts complete blocks only.

use std::path::Path;

use serde::Deserialize;
use warmpath_index::keys::BlockKey;

use super::{ReadOptions, ReadReport, Request, Workload, WorkloadError};

/// Tokens per block of the Mooncake traces.
pub const BLOCK_TOKENS: u32 = 512;

/// One line of the trace as it is written.
#[derive(Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake trace file; the workload is named after the file.
pub fn read_mooncake(
    path: &Path,
    opts: &ReadOptions,
) -> Result<(Workload, ReadReport), WorkloadError> {
    let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    parse(&name, &path.display().to_string(), &text, opts)
}

/// Parses the text of a Mooncake trace; `name` names the workload and the errors.
pub fn parse_mooncake(
    name: &str,
    text: &str,
    opts: &ReadOptions,
) -> Result<(Workload, ReadReport), WorkloadError> {
    parse(name, name, text, opts)
}

fn parse(
    name: &str,
    file: &str,
    text: &str,
    opts: &ReadOptions,
) -> Result<(Workload, ReadReport), WorkloadError> {
    let mut report = ReadReport::default();
    let mut requests = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        report.lines += 1;
        match parse_line(raw, opts) {
            Ok(request) => requests.push(request),
            Err(_) if opts.skip_bad_lines => report.skipped += 1,
            Err(reason) => {
                return Err(WorkloadError::BadLine {
                    file: file.to_string(),
                    line: index + 1,
                    reason,
                })
            }
        }
    }
    // Stable: requests with the same timestamp keep their order in the file.
    requests.sort_by_key(|r: &Request| r.arrival_us);
    for (id, r) in requests.iter_mut().enumerate() {
        r.id = id as u64;
    }
    report.requests = requests.len();
    Ok((
        Workload {
            name: name.to_string(),
            block_tokens: BLOCK_TOKENS,
            requests,
        },
        report,
    ))
}

/// One request from one non-blank line, or why the line is bad.
fn parse_line(raw: &str, opts: &ReadOptions) -> Result<Request, String> {
    let line: Line =
        serde_json::from_str(raw).map_err(|e| format!("not a Mooncake request: {e}"))?;
    if !line.timestamp.is_finite() || line.timestamp < 0.0 {
        return Err(format!(
            "timestamp {} is not a non-negative number",
            line.timestamp
        ));
    }
    if line.input_length == 0 {
        return Err("empty prompt (input_length 0)".to_string());
    }
    let prompt_tokens = u32::try_from(line.input_length)
        .map_err(|_| format!("input_length {} is too large", line.input_length))?;
    if let Some(max) = opts.max_prompt_tokens {
        if prompt_tokens > max {
            return Err(format!(
                "prompt of {prompt_tokens} tokens exceeds the maximum {max}"
            ));
        }
    }
    let complete = (prompt_tokens / BLOCK_TOKENS) as usize;
    if line.hash_ids.len() < complete {
        return Err(format!(
            "{} hash_ids for {complete} complete blocks of {BLOCK_TOKENS} tokens",
            line.hash_ids.len()
        ));
    }
    let output_tokens = u32::try_from(line.output_length.max(1)).unwrap_or(u32::MAX);
    // Milliseconds to microseconds; the cast saturates for absurdly large timestamps.
    let arrival_us = (line.timestamp * 1000.0).round() as u64;
    Ok(Request {
        id: 0,
        arrival_us,
        tenant: 0,
        keys: line.hash_ids[..complete]
            .iter()
            .map(|&h| BlockKey(h))
            .collect(),
        prompt_tokens,
        output_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(text: &str, opts: &ReadOptions) -> (Workload, ReadReport) {
        match parse_mooncake("t.jsonl", text, opts) {
            Ok(x) => x,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    /// The reason of the bad line, checking its line number.
    fn bad_line(text: &str, opts: &ReadOptions, expected_line: usize) -> String {
        match parse_mooncake("t.jsonl", text, opts) {
            Err(WorkloadError::BadLine { file, line, reason }) => {
                assert_eq!(file, "t.jsonl");
                assert_eq!(line, expected_line, "{reason}");
                reason
            }
            other => panic!("expected a bad line, got {other:?}"),
        }
    }

    #[test]
    fn keys_are_the_complete_blocks_hash_ids() {
        let text = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]}
{"timestamp": 1.5, "input_length": 1024, "output_length": 0, "hash_ids": [7, 8], "extra": {"a": 1}}
{"timestamp": 2, "input_length": 100, "output_length": 3, "hash_ids": [4]}
"#;
        let (w, report) = parse_ok(text, &ReadOptions::default());
        assert_eq!(
            report,
            ReadReport {
                lines: 3,
                requests: 3,
                skipped: 0
            }
        );
        assert_eq!(w.name, "t.jsonl");
        assert_eq!(w.block_tokens, 512);
        let keys: Vec<Vec<u64>> = w
            .requests
            .iter()
            .map(|r| r.keys.iter().map(|k| k.0).collect())
            .collect();
        assert_eq!(keys, vec![vec![7, 8], vec![7, 8], vec![]]);
        assert_eq!(w.requests[0].prompt_tokens, 1100);
        assert_eq!(w.requests[1].arrival_us, 1500);
        assert_eq!(w.requests[1].output_tokens, 1, "output 0 becomes 1");
        assert_eq!(w.requests[2].arrival_us, 2000);
    }

    #[test]
    fn sorted_stably_by_arrival_with_ids_in_order() {
        let text = r#"{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}
{"timestamp": 3, "input_length": 20, "output_length": 1, "hash_ids": [2]}

{"timestamp": 5, "input_length": 30, "output_length": 1, "hash_ids": [3]}
{"timestamp": 3, "input_length": 40, "output_length": 1, "hash_ids": [4]}
"#;
        let (w, report) = parse_ok(text, &ReadOptions::default());
        assert_eq!(report.lines, 4, "blank lines are not data lines");
        let order: Vec<(u64, u64, u32)> = w
            .requests
            .iter()
            .map(|r| (r.id, r.arrival_us, r.prompt_tokens))
            .collect();
        assert_eq!(
            order,
            vec![(0, 3000, 20), (1, 3000, 40), (2, 5000, 10), (3, 5000, 30)]
        );
    }

    #[test]
    fn bad_lines_name_their_line_and_reason() {
        let good =
            r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#;
        let cases: [(&str, &str); 7] = [
            ("not json", "not a Mooncake request"),
            (
                r#"{"timestamp": 0, "input_length": 600, "output_length": 1}"#,
                "hash_ids",
            ),
            (
                r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#,
                "empty prompt",
            ),
            (
                r#"{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1]}"#,
                "complete blocks",
            ),
            (
                r#"{"timestamp": -1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#,
                "timestamp",
            ),
            (
                r#"{"timestamp": "x", "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#,
                "not a Mooncake",
            ),
            (
                r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [-1, 2]}"#,
                "not a Mooncake",
            ),
        ];
        for (line, expected) in cases {
            let text = format!("{good}\n\n{line}\n{good}\n");
            let reason = bad_line(&text, &ReadOptions::default(), 3);
            assert!(reason.contains(expected), "{line}: {reason}");
        }
    }

    #[test]
    fn skip_bad_lines_counts_them() {
        let text = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}
garbage
{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}
{"timestamp": 2, "input_length": 700, "output_length": 1, "hash_ids": [1, 3]}
"#;
        let opts = ReadOptions {
            skip_bad_lines: true,
            ..ReadOptions::default()
        };
        let (w, report) = parse_ok(text, &opts);
        assert_eq!(
            report,
            ReadReport {
                lines: 4,
                requests: 2,
                skipped: 2
            }
        );
        assert_eq!(
            w.requests.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![0, 1]
        );
    }

    #[test]
    fn max_prompt_tokens_makes_long_prompts_bad() {
        let text = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}
{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 4]}
"#;
        let opts = ReadOptions {
            max_prompt_tokens: Some(1000),
            ..ReadOptions::default()
        };
        let reason = bad_line(text, &opts, 2);
        assert_eq!(reason, "prompt of 2000 tokens exceeds the maximum 1000");
        let skip = ReadOptions {
            skip_bad_lines: true,
            max_prompt_tokens: Some(1000),
        };
        assert_eq!(
            parse_ok(text, &skip).1,
            ReadReport {
                lines: 2,
                requests: 1,
                skipped: 1
            }
        );
    }

    #[test]
    fn empty_input_is_an_empty_workload() {
        let (w, report) = parse_ok("\n  \n", &ReadOptions::default());
        assert!(w.requests.is_empty());
        assert_eq!(report, ReadReport::default());
    }

    #[test]
    fn missing_file_is_an_io_error() {
        let err = read_mooncake(
            Path::new("/nonexistent/trace.jsonl"),
            &ReadOptions::default(),
        );
        assert!(matches!(err, Err(WorkloadError::Io { .. })), "{err:?}");
    }

    #[test]
    fn reads_the_published_synthetic_trace() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/synthetic_trace.jsonl");
        let (w, report) = match read_mooncake(&path, &ReadOptions::default()) {
            Ok(x) => x,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(
            report,
            ReadReport {
                lines: 3993,
                requests: 3993,
                skipped: 0
            }
        );
        assert_eq!(w.name, "synthetic_trace.jsonl");
        let stats = w.stats();
        println!("synthetic_trace.jsonl: {stats:?}");
        // The README's 0.640 counts partial last blocks too; complete blocks only differ a bit.
        assert!(
            (0.60..0.68).contains(&stats.ideal_hit_ratio),
            "{}",
            stats.ideal_hit_ratio
        );
        assert!(
            (1_015_000_000..1_030_000_000).contains(&stats.duration_us),
            "{}",
            stats.duration_us
        );
        assert!((15_000.0..15_700.0).contains(&stats.mean_prompt_tokens));
        assert!(w
            .requests
            .windows(2)
            .all(|p| p[0].arrival_us <= p[1].arrival_us));
    }
}
