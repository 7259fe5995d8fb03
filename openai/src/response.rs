//! What one response chunk says: a streamed event's data, or a whole non-streamed response
//! (they share a shape: `choices`, `usage`, or `error`).

use crate::usage::Usage;
use serde::Deserialize;

/// A streamed chunk, or a whole non-streamed response: the parts warmpath reads.
#[derive(Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<Usage>,
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
        usage: Option<Usage>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::PromptTokensDetails;

    #[test]
    fn stream_data_cases() {
        let chunk = |content, usage| Ok(StreamData::Chunk { content, usage });
        let with_cache = Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            total_tokens: 12,
            prompt_tokens_details: Some(PromptTokensDetails {
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
                    Some(Usage {
                        total_tokens: 0,
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
        assert_eq!(with_cache.cached_tokens(), Some(4));
        assert_eq!(Usage::default().cached_tokens(), None);
        for bad in ["{not json", "", "[1, 2]"] {
            assert!(parse_stream_data(bad).is_err(), "{bad}");
        }
    }
}
