//! Request synthesis: a workload's requests as [`LiveRequest`]s with deterministic text
//! (built from [`words`]), so that requests sharing a prefix in the workload share a text
//! prefix on the wire and every prompt has the workload's token count under the built-in
//! tokenizer; and the JSON body each one is sent with. Pure: no I/O.

use bytes::Bytes;
use serde::Serialize;
use warmpath_index::rng::Rng;
use warmpath_index::text::words;
use warmpath_sim::workload::synthetic::SyntheticRequest;
use warmpath_sim::workload::Workload;

/// Which OpenAI endpoint a request goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/completions` with the prompt as is (keeps block alignment).
    #[default]
    Completions,
    /// `POST /v1/chat/completions` with the prompt as the single user message (the chat
    /// template shifts the text, so blocks no longer align with the workload's).
    Chat,
}

impl Endpoint {
    /// The path under a target's base URL.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// One request to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveRequest {
    /// Open-loop send time, in microseconds from the start of the run (before
    /// [`Mode::OpenLoop::time_scale`]).
    pub at_us: u64,
    /// Tenant index; [`LoadgenConfig::tenant_header`] says how it is named on the wire.
    pub tenant: u32,
    /// Where it goes.
    pub endpoint: Endpoint,
    /// The completions prompt, or the content of the single user message.
    pub prompt: String,
    /// Tokens to generate (sent with `ignore_eos`, so the server generates exactly these).
    pub max_tokens: u32,
}

/// Turns a workload into live requests with deterministic text, in the workload's order,
/// all for `endpoint`.
///
/// - With `synthetic` (the requests the workload was built from by
///   [`to_workload`](warmpath_sim::workload::synthetic::to_workload)), request `id` takes the
///   segments of the `id`-th synthetic request in arrival order, each segment becoming
///   `words(seed, tokens)`: requests sharing segments share text prefixes.
/// - Otherwise the keys are read as prefix names (a Mooncake trace's `hash_ids`): key `h`
///   becomes `words(h, block_tokens)` and the tokens past the complete blocks become
///   `words(s, remainder)` with `s` derived from the request id. Equal keys give equal
///   text, and since a key names a whole prefix, equal key prefixes give equal text
///   prefixes.
///
/// Either way the prompt has exactly `prompt_tokens` tokens under
/// [`warmpath_index::text::count_tokens`] (each pseudo-word is one token), and the whole
/// blocks of the workload are whole blocks of the text. A workload request whose id has no
/// synthetic request falls back to its keys.
pub fn from_workload(
    w: &Workload,
    synthetic: Option<&[SyntheticRequest]>,
    endpoint: Endpoint,
) -> Vec<LiveRequest> {
    // `to_workload` numbers requests in (stable) arrival order; follow the same order.
    let synthetic: Option<Vec<&SyntheticRequest>> = synthetic.map(|s| {
        let mut order: Vec<&SyntheticRequest> = s.iter().collect();
        order.sort_by_key(|r| r.arrival_us);
        order
    });
    w.requests
        .iter()
        .map(|r| {
            let from_segments = synthetic
                .as_ref()
                .and_then(|s| usize::try_from(r.id).ok().and_then(|i| s.get(i)));
            let prompt = match from_segments {
                Some(s) => segments_text(s),
                None => keys_text(
                    r.keys.iter().map(|k| k.0),
                    w.block_tokens,
                    r.prompt_tokens,
                    r.id,
                ),
            };
            LiveRequest {
                at_us: r.arrival_us,
                tenant: r.tenant,
                endpoint,
                prompt,
                max_tokens: r.output_tokens.max(1),
            }
        })
        .collect()
}

/// The text of a synthetic request: `words(seed, tokens)` per segment.
pub fn segments_text(r: &SyntheticRequest) -> String {
    let mut out = String::with_capacity(r.prompt_tokens() as usize * 7);
    for s in &r.segments {
        out.push_str(&words(s.seed, s.tokens as usize));
    }
    out
}

/// The text of a prompt named by prefix keys: `words(key, block_tokens)` per complete block,
/// then `words(seed of request_id, rest)` for the tokens past them.
pub fn keys_text(
    keys: impl ExactSizeIterator<Item = u64>,
    block_tokens: u32,
    prompt_tokens: u32,
    request_id: u64,
) -> String {
    let mut out = String::with_capacity(prompt_tokens as usize * 7);
    let whole = (keys.len() as u64).saturating_mul(u64::from(block_tokens));
    for k in keys {
        out.push_str(&words(k, block_tokens as usize));
    }
    let rest = u64::from(prompt_tokens).saturating_sub(whole);
    if rest > 0 {
        out.push_str(&words(tail_seed(request_id), rest as usize));
    }
    out
}

/// Seed of the text past a request's complete blocks: unique per request, and (being a
/// mixed 64-bit value) practically never one of a trace's small hash ids.
fn tail_seed(request_id: u64) -> u64 {
    const DOMAIN: u64 = 0x6c6f_6164_6765_6e00; // "loadgen\0"
    Rng::new(request_id ^ DOMAIN).next_u64()
}

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<[WireMessage<'a>; 1]>,
    max_tokens: u32,
    stream: bool,
    // vLLM refuses stream_options on a request that does not stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    ignore_eos: bool,
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// The JSON body of `r`.
pub fn request_body(r: &LiveRequest, model: &str, stream: bool) -> Bytes {
    let wire = WireRequest {
        model,
        prompt: (r.endpoint == Endpoint::Completions).then_some(r.prompt.as_str()),
        messages: (r.endpoint == Endpoint::Chat).then_some([WireMessage {
            role: "user",
            content: &r.prompt,
        }]),
        max_tokens: r.max_tokens,
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
        ignore_eos: true,
    };
    // Serialising borrowed strings and integers into a Vec cannot fail.
    Bytes::from(serde_json::to_vec(&wire).unwrap_or_default())
}
