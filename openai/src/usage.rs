//! OpenAI's `usage`: the token counts a response reports, in its body or (with
//! `stream_options.include_usage`) in the last streamed chunk, and the prompt tokens the
//! engine found cached (`prompt_tokens_details.cached_tokens`; vLLM reports them only
//! with `--enable-prompt-tokens-details`).

use crate::sse::SseReader;
use serde::{Deserialize, Serialize};

/// `usage.prompt_tokens_details`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache; `None` when not reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
}

/// `usage` of a response (and of the last streamed chunk). Read leniently: a count that is
/// missing reads as 0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u32,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u32,
    /// Both.
    #[serde(default)]
    pub total_tokens: u32,
    /// Where the cached prompt tokens are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// Cached prompt tokens, when the response reports them.
    pub fn cached_tokens(&self) -> Option<u32> {
        self.prompt_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
    }
}

/// What a response must contain for its usage to say anything about caching: a cheap test
/// before any JSON is parsed.
const NEEDLE: &[u8] = b"\"cached_tokens\"";

fn mentions_cache(bytes: &[u8]) -> bool {
    bytes.windows(NEEDLE.len()).any(|w| w == NEEDLE)
}

/// The usage of one JSON object, if it reports cached tokens.
fn with_cached_tokens(json: &[u8]) -> Option<Usage> {
    #[derive(Deserialize)]
    struct WithUsage {
        usage: Option<Usage>,
    }
    serde_json::from_slice::<WithUsage>(json)
        .ok()
        .and_then(|w| w.usage)
        .filter(|u| u.cached_tokens().is_some())
}

/// The `usage` of a whole response that says how many prompt tokens were cached: a JSON
/// body, or a complete event stream (read by [`UsageReader`]). `None` when there is none.
pub fn cached_usage(body: &[u8]) -> Option<Usage> {
    if !mentions_cache(body) {
        return None;
    }
    let json = body.trim_ascii_start();
    if json.first() == Some(&b'{') {
        return with_cached_tokens(json);
    }
    let mut reader = UsageReader::new();
    reader.push(body).or_else(|| reader.finish())
}

/// Finds the usage that reports cached tokens in a streamed response, fed chunk by chunk
/// as they pass (cut anywhere). Only events that mention `cached_tokens` are parsed.
#[derive(Debug)]
pub struct UsageReader {
    sse: SseReader,
    /// Set once the usage was found, or the stream was malformed: nothing more to read.
    done: bool,
}

impl Default for UsageReader {
    fn default() -> Self {
        UsageReader::new()
    }
}

impl UsageReader {
    /// Largest event it reads: a usage chunk is a few hundred bytes, and an event over this
    /// ends the search (the stream itself passes on untouched).
    pub const MAX_EVENT_BYTES: usize = 1 << 20;

    /// A reader at the start of a stream.
    pub fn new() -> Self {
        UsageReader {
            sse: SseReader::with_limit(Self::MAX_EVENT_BYTES),
            done: false,
        }
    }

    /// Whether the reader has stopped: the usage was found, or the stream is not one it
    /// can read.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feeds the next chunk; the usage, the first time an event carrying it completes.
    pub fn push(&mut self, chunk: &[u8]) -> Option<Usage> {
        if self.done {
            return None;
        }
        let mut found = None;
        let read = self.sse.push(chunk, |data| {
            if found.is_none() && mentions_cache(data) {
                found = with_cached_tokens(data.trim_ascii());
            }
        });
        self.done = found.is_some() || read.is_err();
        found
    }

    /// Ends the stream: the usage, if an event left unterminated carries it.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.done {
            return None;
        }
        self.done = true;
        let mut found = None;
        self.sse.finish(|data| {
            if mentions_cache(data) {
                found = with_cached_tokens(data.trim_ascii());
            }
        });
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(prompt: u32, cached: u32) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: 2,
            total_tokens: prompt + 2,
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: Some(cached),
            }),
        }
    }

    const STREAM: &str = "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\ndata: [DONE]\n\n";

    #[test]
    fn cached_usage_cases() {
        let cases: &[(&str, Option<Usage>)] = &[
            (
                r#"{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":4}}}"#,
                Some(usage(10, 4)),
            ),
            (STREAM, Some(usage(9, 8))),
            (&STREAM.replace('\n', "\r\n"), Some(usage(9, 8))),
            // No details, details without the count, no usage, not JSON: nothing to learn.
            (
                r#"{"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}"#,
                None,
            ),
            (
                r#"{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":null}}}"#,
                None,
            ),
            ("data: {\"choices\":[]}\n\n", None),
            ("data: \"cached_tokens\" {\n\n", None),
        ];
        for (input, want) in cases {
            assert_eq!(&cached_usage(input.as_bytes()), want, "{input}");
        }
    }

    #[test]
    fn a_stream_cut_anywhere_gives_its_usage_once() {
        let bytes = STREAM.as_bytes();
        for i in 0..=bytes.len() {
            for j in i..=bytes.len() {
                let mut r = UsageReader::new();
                let mut found = Vec::new();
                for chunk in [&bytes[..i], &bytes[i..j], &bytes[j..]] {
                    found.extend(r.push(chunk));
                }
                found.extend(r.finish());
                assert_eq!(found, vec![usage(9, 8)], "cut at {i} and {j}");
                assert!(r.is_done());
            }
        }
        // The usage event last, without its blank line: found at the end of the stream.
        let unterminated = STREAM.trim_end_matches("data: [DONE]\n\n").trim_end();
        let mut r = UsageReader::new();
        assert_eq!(r.push(unterminated.as_bytes()), None);
        assert_eq!(r.finish(), Some(usage(9, 8)));
    }

    #[test]
    fn a_stream_with_an_oversized_event_stops_the_search() {
        let mut r = UsageReader::new();
        assert_eq!(r.push(b"data: "), None);
        assert_eq!(r.push(&vec![b'x'; UsageReader::MAX_EVENT_BYTES + 1]), None);
        assert!(r.is_done());
        assert_eq!(r.push(STREAM.as_bytes()), None);
    }

    #[test]
    fn usage_reads_leniently_and_writes_what_it_holds() {
        let u: Usage = serde_json::from_str(r#"{"prompt_tokens":3}"#).unwrap();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens()),
            (3, 0, None)
        );
        assert_eq!(
            serde_json::to_value(usage(10, 4)).unwrap(),
            serde_json::json!({"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,
                "prompt_tokens_details":{"cached_tokens":4}})
        );
    }
}
