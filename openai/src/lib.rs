//! What warmpath reads of OpenAI-style responses, in one place: the router (checking an
//! engine's account of cached prompt tokens against its routing prediction), the load
//! generator (measuring what users see) and engine-sim (writing `usage`) share these
//! definitions instead of each parsing the wire on its own.
//!
//! - [`sse`]: [`SseReader`], server-sent events from body chunks cut anywhere, without
//!   I/O, so tests feed it bytes.
//! - [`usage`]: [`Usage`] (`prompt_tokens`, `completion_tokens`,
//!   `prompt_tokens_details.cached_tokens`), and the readers that find the one carrying
//!   cached tokens in a whole body ([`cached_usage`]) or a stream ([`UsageReader`]).
//! - [`response`]: what one response chunk (or a whole non-streamed response) says:
//!   generated text or not, its usage, an error, or `[DONE]`.
//!
//! **Architecture invariant:** no I/O, no async runtime, no clock: bytes in, values out.
//! The request side of the format (what routing reads of a request) is
//! `warmpath_index::openai`, next to the chat rendering it depends on.

pub mod response;
pub mod sse;
pub mod usage;

pub use response::{parse_stream_data, StreamData};
pub use sse::{SseError, SseReader, MAX_EVENT_BYTES};
pub use usage::{cached_usage, PromptTokensDetails, Usage, UsageReader};
