//! Reader for the Azure LLM inference traces 2023 (CSV of arrivals and token counts).
//!
//! The files are `TIMESTAMP,ContextTokens,GeneratedTokens` with absolute timestamps such as
//! `2023-11-16 18:15:46.6805900`. They carry no prefix information, so they give arrival
//! patterns and length distributions only: [`parse_azure`] turns them into [`AzureRow`]s,
//! and [`azure_workload`] makes a no-sharing baseline workload from them (every block of
//! every request gets a key of its own). The timestamps are parsed by hand, through a
//! days-from-civil conversion, so a trace that crosses midnight (or a month) stays ordered.

use std::path::Path;

use warmpath_index::keys::BlockKey;
use warmpath_index::rng::{mix64, Rng};

use super::{ReadOptions, ReadReport, Request, Workload, WorkloadError};

/// The header line the format requires.
pub const AZURE_HEADER: &str = "TIMESTAMP,ContextTokens,GeneratedTokens";

/// One request of an Azure trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AzureRow {
    /// Arrival in microseconds after the earliest row of the trace.
    pub arrival_us: u64,
    /// Prompt length in tokens (at least 1).
    pub context_tokens: u32,
    /// Generated tokens as written in the trace (may be 0; [`azure_workload`] makes it 1).
    pub generated_tokens: u32,
}

/// Reads an Azure trace file; rows come sorted (stably) by arrival.
pub fn read_azure(
    path: &Path,
    opts: &ReadOptions,
) -> Result<(Vec<AzureRow>, ReadReport), WorkloadError> {
    let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&path.display().to_string(), &text, opts)
}

/// Parses the text of an Azure trace; `name` names the errors. Rows come sorted (stably)
/// by arrival, with arrivals relative to the earliest row.
pub fn parse_azure(
    name: &str,
    text: &str,
    opts: &ReadOptions,
) -> Result<(Vec<AzureRow>, ReadReport), WorkloadError> {
    parse(name, text, opts)
}

fn parse(
    file: &str,
    text: &str,
    opts: &ReadOptions,
) -> Result<(Vec<AzureRow>, ReadReport), WorkloadError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let header = lines
        .next()
        .map(|(_, l)| l.trim().trim_start_matches('\u{feff}'));
    if !header.is_some_and(|h| h.eq_ignore_ascii_case(AZURE_HEADER)) {
        return Err(WorkloadError::BadHeader {
            file: file.to_string(),
            expected: AZURE_HEADER,
            found: header.unwrap_or("").chars().take(80).collect(),
        });
    }
    let mut report = ReadReport::default();
    // (absolute µs since 1970, context, generated)
    let mut rows: Vec<(i64, u32, u32)> = Vec::new();
    for (index, raw) in lines {
        report.lines += 1;
        match parse_row(raw.trim(), opts) {
            Ok(row) => rows.push(row),
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
    rows.sort_by_key(|r| r.0);
    let start = rows.first().map_or(0, |r| r.0);
    report.requests = rows.len();
    let rows = rows
        .into_iter()
        .map(|(at, context_tokens, generated_tokens)| AzureRow {
            // Non-negative after sorting; parse_timestamp bounds the years, so no overflow.
            arrival_us: u64::try_from(at - start).unwrap_or(0),
            context_tokens,
            generated_tokens,
        })
        .collect();
    Ok((rows, report))
}

/// One data row, or why it is bad.
fn parse_row(raw: &str, opts: &ReadOptions) -> Result<(i64, u32, u32), String> {
    let fields: Vec<&str> = raw.split(',').map(str::trim).collect();
    let [timestamp, context, generated] = fields[..] else {
        return Err(format!("expected 3 fields, found {}", fields.len()));
    };
    let at = parse_timestamp(timestamp).ok_or_else(|| {
        format!("`{timestamp}` is not a timestamp like 2023-11-16 18:15:46.6805900")
    })?;
    let context_tokens: u32 = context
        .parse()
        .map_err(|_| format!("ContextTokens `{context}` is not a token count"))?;
    let generated_tokens: u32 = generated
        .parse()
        .map_err(|_| format!("GeneratedTokens `{generated}` is not a token count"))?;
    if context_tokens == 0 {
        return Err("empty prompt (ContextTokens 0)".to_string());
    }
    if let Some(max) = opts.max_prompt_tokens {
        if context_tokens > max {
            return Err(format!(
                "prompt of {context_tokens} tokens exceeds the maximum {max}"
            ));
        }
    }
    Ok((at, context_tokens, generated_tokens))
}

/// Microseconds since 1970-01-01 00:00:00 of `YYYY-MM-DD HH:MM:SS[.fraction]` (a `T` may
/// separate date and time; fraction digits beyond microseconds are truncated).
fn parse_timestamp(s: &str) -> Option<i64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut date_parts = date.split('-');
    let year: i64 = digits(date_parts.next()?, 4)?;
    let month: i64 = digits(date_parts.next()?, 2)?;
    let day: i64 = digits(date_parts.next()?, 2)?;
    if date_parts.next().is_some() || !(1..=12).contains(&month) {
        return None;
    }
    if day < 1 || day > days_in_month(year, month) {
        return None;
    }
    let (hms, fraction) = match time.split_once('.') {
        Some((hms, f)) => (hms, Some(f)),
        None => (time, None),
    };
    let mut time_parts = hms.split(':');
    let hour: i64 = digits(time_parts.next()?, 2)?;
    let minute: i64 = digits(time_parts.next()?, 2)?;
    let second: i64 = digits(time_parts.next()?, 2)?;
    if time_parts.next().is_some() || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let micros = match fraction {
        None => 0,
        Some(f) => {
            if f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            // The first six digits are microseconds; pad short fractions with zeros.
            let mut us = 0i64;
            for i in 0..6 {
                us = us * 10 + f.as_bytes().get(i).map_or(0, |b| i64::from(b - b'0'));
            }
            us
        }
    };
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second;
    Some(seconds * 1_000_000 + micros)
}

/// An unsigned decimal of exactly `width` ASCII digits.
fn digits(s: &str, width: usize) -> Option<i64> {
    if s.len() != width || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12; // March is 0
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A workload from Azure rows in which no two blocks share a key (a no-sharing baseline):
/// each request gets `context_tokens / block_tokens` keys, all distinct across the whole
/// workload, drawn from `seed`. Requests are sorted stably by arrival; 0 generated tokens
/// become 1; `block_tokens` of 0 gives no keys.
pub fn azure_workload(name: &str, rows: &[AzureRow], block_tokens: u32, seed: u64) -> Workload {
    let mut rows = rows.to_vec();
    rows.sort_by_key(|r| r.arrival_us);
    let base = Rng::new(seed).next_u64();
    let mut counter = 0u64;
    let requests = rows
        .iter()
        .enumerate()
        .map(|(id, row)| {
            let blocks = row.context_tokens.checked_div(block_tokens).unwrap_or(0);
            let keys = (0..blocks)
                .map(|_| {
                    counter += 1;
                    // mix64 is a bijection, so distinct counters give distinct keys.
                    BlockKey(mix64(base.wrapping_add(counter)))
                })
                .collect();
            Request {
                id: id as u64,
                arrival_us: row.arrival_us,
                tenant: 0,
                keys,
                prompt_tokens: row.context_tokens,
                output_tokens: row.generated_tokens.max(1),
            }
        })
        .collect();
    Workload {
        name: name.to_string(),
        block_tokens,
        requests,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn parse_ok(text: &str, opts: &ReadOptions) -> (Vec<AzureRow>, ReadReport) {
        match parse_azure("a.csv", text, opts) {
            Ok(x) => x,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    #[test]
    fn timestamps_parse_by_hand() {
        let cases: [(&str, Option<i64>); 10] = [
            ("1970-01-01 00:00:00", Some(0)),
            ("1970-01-02 00:00:01.5", Some(86_401_500_000)),
            ("2023-11-16 18:15:46.6805900", Some(1_700_158_546_680_590)),
            ("2000-02-29T12:00:00", Some(951_825_600_000_000)),
            ("1969-12-31 23:59:59", Some(-1_000_000)),
            ("2023-02-29 00:00:00", None),
            ("2023-11-16 24:00:00", None),
            ("2023-11-16", None),
            ("2023-11-16 18:15:46.", None),
            ("23-11-16 18:15:46", None),
        ];
        for (s, expected) in cases {
            assert_eq!(parse_timestamp(s), expected, "{s}");
        }
    }

    #[test]
    fn rows_are_relative_to_the_earliest_and_cross_midnight() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n\
                    2023-11-16 23:59:59.9000000,100,5\r\n\
                    \r\n\
                    2023-11-17 00:00:00.1000000,200,0\r\n\
                    2023-11-16 23:59:59.5000000,300,7\r\n";
        let (rows, report) = parse_ok(text, &ReadOptions::default());
        assert_eq!(
            report,
            ReadReport {
                lines: 3,
                requests: 3,
                skipped: 0
            }
        );
        assert_eq!(
            rows,
            vec![
                AzureRow {
                    arrival_us: 0,
                    context_tokens: 300,
                    generated_tokens: 7
                },
                AzureRow {
                    arrival_us: 400_000,
                    context_tokens: 100,
                    generated_tokens: 5
                },
                AzureRow {
                    arrival_us: 600_000,
                    context_tokens: 200,
                    generated_tokens: 0
                },
            ]
        );
    }

    #[test]
    fn bad_rows_and_headers() {
        let cases: [(&str, &str); 6] = [
            ("2023-11-16 18:15:46,10", "expected 3 fields"),
            ("yesterday,10,1", "not a timestamp"),
            ("2023-11-16 18:15:46,ten,1", "ContextTokens"),
            ("2023-11-16 18:15:46,10,-1", "GeneratedTokens"),
            ("2023-11-16 18:15:46,0,1", "empty prompt"),
            (
                "2023-11-16 18:15:46,5000,1",
                "prompt of 5000 tokens exceeds the maximum 4096",
            ),
        ];
        let opts = ReadOptions {
            max_prompt_tokens: Some(4096),
            ..ReadOptions::default()
        };
        for (row, expected) in cases {
            let text = format!("{AZURE_HEADER}\n2023-11-16 18:15:40,10,1\n{row}\n");
            match parse_azure("a.csv", &text, &opts) {
                Err(WorkloadError::BadLine {
                    file,
                    line: 3,
                    reason,
                }) if file == "a.csv" => {
                    assert!(reason.contains(expected), "{row}: {reason}")
                }
                other => panic!("{row}: {other:?}"),
            }
            let skip = ReadOptions {
                skip_bad_lines: true,
                ..opts.clone()
            };
            assert_eq!(
                parse_ok(&text, &skip).1,
                ReadReport {
                    lines: 2,
                    requests: 1,
                    skipped: 1
                }
            );
        }
        for text in ["", "2023-11-16 18:15:40,10,1\n", "time,context\n"] {
            let err = parse_azure(
                "a.csv",
                text,
                &ReadOptions {
                    skip_bad_lines: true,
                    ..ReadOptions::default()
                },
            );
            assert!(
                matches!(err, Err(WorkloadError::BadHeader { .. })),
                "{text:?}: {err:?}"
            );
        }
    }

    #[test]
    fn workload_shares_no_keys() {
        let rows: Vec<AzureRow> = (0..50)
            .map(|i| AzureRow {
                arrival_us: 1000 * (50 - i),
                context_tokens: 100 + 37 * i as u32,
                generated_tokens: i as u32 % 3,
            })
            .collect();
        let w = azure_workload("azure", &rows, 16, 9);
        assert_eq!(w.requests.len(), 50);
        assert!(w
            .requests
            .windows(2)
            .all(|p| p[0].arrival_us <= p[1].arrival_us));
        assert!(w
            .requests
            .iter()
            .enumerate()
            .all(|(i, r)| r.id == i as u64 && r.output_tokens >= 1));
        let mut all = HashSet::new();
        for r in &w.requests {
            assert_eq!(r.keys.len() as u32, r.prompt_tokens / 16);
            for k in &r.keys {
                assert!(all.insert(*k), "key {k:?} repeated");
            }
        }
        assert_eq!(w.stats().ideal_hit_ratio, 0.0);
        assert_eq!(
            azure_workload("azure", &rows, 16, 9),
            w,
            "same seed, same keys"
        );
        assert_ne!(
            azure_workload("azure", &rows, 16, 10).requests[0].keys,
            w.requests[0].keys
        );
        assert!(azure_workload("azure", &rows, 0, 9)
            .requests
            .iter()
            .all(|r| r.keys.is_empty()));
    }

    #[test]
    fn reads_the_published_azure_traces() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
        for (file, count) in [
            ("AzureLLMInferenceTrace_code.csv", 8819),
            ("AzureLLMInferenceTrace_conv.csv", 19366),
        ] {
            let (rows, report) = match read_azure(&dir.join(file), &ReadOptions::default()) {
                Ok(x) => x,
                Err(e) => panic!("{e}"),
            };
            assert_eq!(
                report,
                ReadReport {
                    lines: count,
                    requests: count,
                    skipped: 0
                },
                "{file}"
            );
            let span_s = rows.last().map_or(0, |r| r.arrival_us) as f64 / 1e6;
            let mean_context = rows
                .iter()
                .map(|r| f64::from(r.context_tokens))
                .sum::<f64>()
                / rows.len() as f64;
            println!(
                "{file}: {count} rows over {span_s:.0} s, mean context {mean_context:.0} tokens"
            );
            assert!((1800.0..7200.0).contains(&span_s), "{file}: {span_s}");
        }
    }
}
