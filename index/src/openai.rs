//! The request side of OpenAI's completions and chat-completions wire format, and its error
//! body. Requests keep unknown fields out of the way (serde ignores them): the router
//! forwards the client's original bytes and only needs the model, the prompt and the
//! stream flag; the engine simulator also reads the generation limits. What warmpath reads
//! of responses (event streams, `usage`) is the `warmpath-openai` crate.

use crate::text::{render_chat, ChatMessage};
use serde::{Deserialize, Serialize};

/// `prompt` of a completions request: a string, token ids, or a list of either (a batch is
/// not supported by warmpath; a one-element list is accepted).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// A prompt as routing and the engine model read it: text to tokenize, or the client's own
/// token ids (hashed as they are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    /// Forces exactly `max_tokens` tokens (vLLM's extension; the simulator always does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// vLLM's salt isolating prefix caches; the router prepends the tenant's. `Some(None)`
    /// when the field is there but null: it is still the client's field to replace.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub cache_salt: Option<Option<String>>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// vLLM's salt isolating prefix caches; the router prepends the tenant's. `Some(None)`
    /// when the field is there but null: it is still the client's field to replace.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub cache_salt: Option<Option<String>>,
}

/// A field that is present, even as null (serde's `Option` alone reads null as absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

/// Why a request body is not a usable request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A completions request with several prompts.
    #[error("a batch of {0} prompts is not supported: send one prompt per request")]
    Batch(usize),
    /// A chat request without messages.
    #[error("`messages` is empty")]
    NoMessages,
    /// The model name is empty.
    #[error("`model` is empty")]
    NoModel,
}

impl CompletionRequest {
    /// The prompt: text, or token ids.
    pub fn prompt_input(&self) -> Result<PromptInput, RequestError> {
        if self.model.is_empty() {
            return Err(RequestError::NoModel);
        }
        let input = match &self.prompt {
            Prompt::Text(t) => PromptInput::Text(t.clone()),
            Prompt::Texts(ts) if ts.len() == 1 => PromptInput::Text(ts[0].clone()),
            Prompt::Texts(ts) if ts.is_empty() => return Err(RequestError::EmptyPrompt),
            Prompt::Texts(ts) => return Err(RequestError::Batch(ts.len())),
            Prompt::Tokens(ids) => PromptInput::Tokens(ids.clone()),
            Prompt::TokenLists(ls) if ls.len() == 1 => PromptInput::Tokens(ls[0].clone()),
            Prompt::TokenLists(ls) => return Err(RequestError::Batch(ls.len())),
        };
        match &input {
            PromptInput::Text(t) if t.is_empty() => Err(RequestError::EmptyPrompt),
            PromptInput::Tokens(ids) if ids.is_empty() => Err(RequestError::EmptyPrompt),
            _ => Ok(input),
        }
    }
}

impl ChatRequest {
    /// The rendered prompt text (see [`render_chat`]).
    pub fn prompt_text(&self) -> Result<String, RequestError> {
        self.check()?;
        Ok(render_chat(&self.messages))
    }

    /// Whether the request names a model and has messages.
    pub fn check(&self) -> Result<(), RequestError> {
        if self.model.is_empty() {
            return Err(RequestError::NoModel);
        }
        if self.messages.is_empty() {
            return Err(RequestError::NoMessages);
        }
        Ok(())
    }

    /// The generation limit, whichever field carries it.
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// OpenAI's error body: `{"error": {"message", "type", "code"}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
}

impl ErrorBody {
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_string(),
                code: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms() {
        let req = |p: Prompt| CompletionRequest {
            model: "m".into(),
            prompt: p,
            max_tokens: None,
            stream: false,
            ignore_eos: None,
            cache_salt: None,
        };
        let text = |t: &str| Ok(PromptInput::Text(t.into()));
        assert_eq!(req(Prompt::Text("hi".into())).prompt_input(), text("hi"));
        assert_eq!(
            req(Prompt::Texts(vec!["hi".into()])).prompt_input(),
            text("hi")
        );
        assert_eq!(
            req(Prompt::Texts(vec![])).prompt_input(),
            Err(RequestError::EmptyPrompt)
        );
        assert_eq!(
            req(Prompt::Text(String::new())).prompt_input(),
            Err(RequestError::EmptyPrompt)
        );
        assert_eq!(
            req(Prompt::Texts(vec!["a".into(), "b".into()])).prompt_input(),
            Err(RequestError::Batch(2))
        );
        // Token ids, as OpenAI's clients send them.
        let parsed = |json: &str| {
            serde_json::from_str::<CompletionRequest>(json)
                .expect("parses")
                .prompt_input()
        };
        assert_eq!(
            parsed(r#"{"model":"m","prompt":[1,2,3]}"#),
            Ok(PromptInput::Tokens(vec![1, 2, 3]))
        );
        assert_eq!(
            parsed(r#"{"model":"m","prompt":[[4,5]]}"#),
            Ok(PromptInput::Tokens(vec![4, 5]))
        );
        assert_eq!(
            parsed(r#"{"model":"m","prompt":[[4],[5]]}"#),
            Err(RequestError::Batch(2))
        );
        assert_eq!(
            parsed(r#"{"model":"m","prompt":[]}"#),
            Err(RequestError::EmptyPrompt)
        );
    }

    #[test]
    fn chat_limits_and_rendering() {
        let mut chat = ChatRequest {
            model: "m".into(),
            messages: vec![ChatMessage::text("user", "hi")],
            max_tokens: Some(5),
            max_completion_tokens: None,
            stream: true,
            ignore_eos: None,
            cache_salt: None,
        };
        assert_eq!(chat.max_tokens(), Some(5));
        chat.max_completion_tokens = Some(7);
        assert_eq!(chat.max_tokens(), Some(7));
        assert_eq!(chat.prompt_text().unwrap(), "<|user|>\nhi\n<|assistant|>\n");
        chat.messages.clear();
        assert_eq!(chat.prompt_text(), Err(RequestError::NoMessages));
    }
}
