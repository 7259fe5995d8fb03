//! Seeded synthetic workloads for the four patterns prefix-aware routing serves.
//!
//! - [`SyntheticKind::Chat`]: multi-turn conversations. Each prompt is one of a few shared
//!   system prompts plus the whole history; each turn's prompt is the previous turn's
//!   prompt, the previous answer and a new user message.
//! - [`SyntheticKind::Bots`]: templated bots. A few long templates with Zipf popularity, each
//!   followed by a short user part of its own.
//! - [`SyntheticKind::Rag`]: retrieval-augmented generation. A fixed preamble, `k` documents
//!   retrieved from a corpus with Zipf popularity (in a canonical order), then a question.
//! - [`SyntheticKind::Code`]: code completion. A repository's large shared context, the
//!   head of the file being edited, then the edits made since the session began, which grow
//!   from one completion to the next.
//! - [`SyntheticKind::Conversation`]: an assistant product. One system prompt opens every
//!   request of every user; sessions run many turns, each prompt the previous one plus the
//!   answer and a new message, after a think time; sessions start in bursts (a calm rate
//!   and a burst rate that alternate). A prefix-aware router that trusts the longest match
//!   alone sends every new session to whoever holds the system prompt.
//! - [`SyntheticKind::Longdoc`]: questions about long documents. A few dozen documents of
//!   tens of thousands of tokens, with Zipf popularity, each read by many sessions; a
//!   session asks 4 to 21 questions about one document (the first, then 3 to 20 follow-ups),
//!   each prompt the previous one plus the answer and a new question, after a think time
//!   long enough for a busy engine to evict the session's history. What the tiers are for:
//!   a miss recomputes a whole document.
//!
//! A prompt is a list of [`Segment`]s, each a seed and a length: the token ids are drawn
//! from the seed, so the same content is the same segment wherever it appears, and
//! identical prefixes are identical segment lists that hash to identical keys in
//! [`to_workload`]. Content does not depend on the tenant: requests are spread over
//! [`SyntheticParams::tenants`] tenants with the same content, and the block keys (which
//! are keyed by tenant) still never match across tenants.
//!
//! Arrivals are Poisson at [`SyntheticParams::rate_per_s`] requests per second (for chat and
//! code, sessions start as a Poisson process at `rate_per_s / mean turns` and their
//! requests follow one another after exponential pauses), or taken from a trace with
//! [`with_arrivals`]. With the defaults (3,000 requests at 15/s, one tenant, 64-token
//! blocks) the patterns give (`default_workloads_sizes_and_hit_ratios` checks these):
//!
//! | pattern | duration | mean prompt tokens | prompts in 1k..=16k | ideal prefix-hit ratio |
//! |---|---:|---:|---:|---:|
//! | chat | ~270 s | ~4,400 | 100% | ~0.86 |
//! | bots | ~200 s | ~4,900 | 100% | ~0.93 |
//! | rag  | ~205 s | ~4,400 | 100% | ~0.74 |
//! | code | ~260 s | ~9,000 | 100% | ~0.97 |
//! | conversation | ~215 s | ~4,600 | 100% | ~0.90 |
//!
//! `longdoc` is outside the table (prompts of 16k to 64k tokens and more): with the
//! defaults (seed 42) 3,000 requests at 15/s span ~395 s, mean prompt ~41,000 tokens,
//! working set ~5.5M tokens, ideal prefix-hit ratio ~0.955; at 3/s, the rate
//! `bench/tiers.py` uses, ~1,260 s and ~0.96. Its defaults (120 documents, Zipf 0.8, 30 s
//! think times) were chosen so that 8 instances of 250k GPU tokens hold about 40% of the
//! working set and sessions lose their history to eviction while their users read.
//!
//! Chat, code, conversation and longdoc take longer than `requests / rate_per_s`: their request rate reaches
//! `rate_per_s` only once the sessions begun at the start have reached their later turns.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use warmpath_index::keys::{token_block_keys, TenantKey};
use warmpath_index::rng::Rng;

use super::{Request, Workload, WorkloadError};

/// Token ids are drawn uniformly from `[0, VOCAB)`.
pub const VOCAB: u32 = 32_000;

/// A run of prompt tokens whose content is fixed by its seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Seeds the token ids: equal seeds and lengths are equal content.
    pub seed: u64,
    /// Length in tokens.
    pub tokens: u32,
}

impl Segment {
    /// The segment's token ids, drawn in `[0, VOCAB)` from `Rng::new(seed)`.
    pub fn token_ids(&self) -> Vec<u32> {
        let mut rng = Rng::new(self.seed);
        (0..self.tokens)
            .map(|_| rng.below(u64::from(VOCAB)) as u32)
            .collect()
    }
}

/// A generated request, with its prompt as segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntheticRequest {
    /// Arrival in microseconds from the start of the workload.
    pub arrival_us: u64,
    /// Tenant index, in `[0, tenants)`.
    pub tenant: u32,
    /// The prompt, in order.
    pub segments: Vec<Segment>,
    /// Tokens to generate (at least 1).
    pub output_tokens: u32,
}

impl SyntheticRequest {
    /// Prompt length in tokens (saturating).
    pub fn prompt_tokens(&self) -> u32 {
        self.segments
            .iter()
            .fold(0u32, |sum, s| sum.saturating_add(s.tokens))
    }
}

/// An inclusive range of token counts; a draw is uniform in `[min, max]` (`min` when
/// `max < min`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRange {
    /// Smallest length.
    pub min: u32,
    /// Largest length.
    pub max: u32,
}

impl TokenRange {
    /// `[min, max]`.
    pub const fn new(min: u32, max: u32) -> Self {
        TokenRange { min, max }
    }

    fn draw(&self, rng: &mut Rng) -> u32 {
        rng.range(u64::from(self.min), u64::from(self.max)) as u32
    }
}

/// The four synthetic patterns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyntheticKind {
    /// Multi-turn conversations with shared system prompts.
    Chat,
    /// Templated bots: long shared templates, short user parts.
    Bots,
    /// Retrieval-augmented generation over a corpus with popular documents.
    Rag,
    /// Code completion over repositories with large shared contexts.
    Code,
    /// Long sessions behind one shared system prompt, starting in bursts.
    Conversation,
    /// Multi-turn questions about long shared documents.
    Longdoc,
}

impl SyntheticKind {
    /// Every kind, in a fixed order.
    pub const ALL: [SyntheticKind; 6] = [
        SyntheticKind::Chat,
        SyntheticKind::Bots,
        SyntheticKind::Rag,
        SyntheticKind::Code,
        SyntheticKind::Conversation,
        SyntheticKind::Longdoc,
    ];

    /// The valid names, as an error message lists them.
    pub const NAMES: &'static str = "chat, bots, rag, code, conversation, longdoc";

    /// The kind's name: `chat`, `bots`, `rag`, `code`, `conversation` or `longdoc`.
    pub fn name(self) -> &'static str {
        match self {
            SyntheticKind::Chat => "chat",
            SyntheticKind::Bots => "bots",
            SyntheticKind::Rag => "rag",
            SyntheticKind::Code => "code",
            SyntheticKind::Conversation => "conversation",
            SyntheticKind::Longdoc => "longdoc",
        }
    }
}

impl fmt::Display for SyntheticKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SyntheticKind {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SyntheticKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| WorkloadError::UnknownSynthetic {
                name: s.to_string(),
                valid: SyntheticKind::NAMES,
            })
    }
}

/// Parameters of [`SyntheticKind::Chat`].
#[derive(Clone, Debug, PartialEq)]
pub struct ChatParams {
    /// How many distinct system prompts conversations share (each picks one uniformly).
    pub system_prompts: u32,
    /// Length of each system prompt (fixed per prompt, drawn from its seed).
    pub system_prompt_tokens: TokenRange,
    /// The turns of each conversation.
    pub session: SessionParams,
}

impl Default for ChatParams {
    fn default() -> Self {
        ChatParams {
            system_prompts: 4,
            system_prompt_tokens: TokenRange::new(1000, 3000),
            session: SessionParams {
                mean_turns: 6.0,
                max_turns: 24,
                user_tokens: TokenRange::new(50, 500),
                answer_tokens: TokenRange::new(100, 800),
                mean_think_s: 15.0,
                max_prompt_tokens: 16_384,
            },
        }
    }
}

/// A session of growing turns (chat, conversation): each prompt is the previous one, its
/// answer and a new message, after a think time.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionParams {
    /// Mean turns per session (geometric, at least 1).
    pub mean_turns: f64,
    /// Most turns of one session.
    pub max_turns: u32,
    /// Length of each user message.
    pub user_tokens: TokenRange,
    /// Length of each answer (the request's output, appended to the next turn's prompt).
    pub answer_tokens: TokenRange,
    /// Mean pause between a turn and the next, in seconds (exponential).
    pub mean_think_s: f64,
    /// A session ends before its prompt would exceed this many tokens.
    pub max_prompt_tokens: u32,
}

/// Parameters of [`SyntheticKind::Bots`].
#[derive(Clone, Debug, PartialEq)]
pub struct BotsParams {
    /// How many bots (templates) there are.
    pub templates: u32,
    /// Length of each template (fixed per template, drawn from its seed).
    pub template_tokens: TokenRange,
    /// Zipf exponent of template popularity (rank `k` has weight `1 / (k + 1)^s`).
    pub zipf_s: f64,
    /// Length of the user part, unique to each request.
    pub user_tokens: TokenRange,
    /// Tokens to generate.
    pub output_tokens: TokenRange,
}

impl Default for BotsParams {
    fn default() -> Self {
        BotsParams {
            templates: 24,
            template_tokens: TokenRange::new(1500, 8000),
            zipf_s: 1.0,
            user_tokens: TokenRange::new(50, 600),
            output_tokens: TokenRange::new(50, 400),
        }
    }
}

/// Parameters of [`SyntheticKind::Rag`].
#[derive(Clone, Debug, PartialEq)]
pub struct RagParams {
    /// Documents in the corpus.
    pub documents: u32,
    /// Length of each document (fixed per document, drawn from its seed).
    pub document_tokens: TokenRange,
    /// Zipf exponent of document popularity.
    pub zipf_s: f64,
    /// Distinct documents retrieved per prompt (at most `documents`).
    pub docs_per_prompt: u32,
    /// Length of the instructions that open every prompt.
    pub preamble_tokens: u32,
    /// Length of the question, unique to each request, after the documents.
    pub question_tokens: TokenRange,
    /// Tokens to generate.
    pub output_tokens: TokenRange,
}

impl Default for RagParams {
    fn default() -> Self {
        RagParams {
            documents: 500,
            document_tokens: TokenRange::new(500, 2000),
            zipf_s: 1.3,
            docs_per_prompt: 3,
            preamble_tokens: 1000,
            question_tokens: TokenRange::new(20, 200),
            output_tokens: TokenRange::new(100, 500),
        }
    }
}

/// Parameters of [`SyntheticKind::Code`].
#[derive(Clone, Debug, PartialEq)]
pub struct CodeParams {
    /// Repositories.
    pub repositories: u32,
    /// Length of each repository's shared context (fixed per repository).
    pub repo_context_tokens: TokenRange,
    /// Zipf exponent of repository popularity.
    pub zipf_s: f64,
    /// Files per repository; a session edits one, picked uniformly.
    pub files_per_repo: u32,
    /// Length of a file's existing head (fixed per file).
    pub file_head_tokens: TokenRange,
    /// Mean completions per editing session (geometric, at least 1).
    pub mean_completions: f64,
    /// Most completions of one session.
    pub max_completions: u32,
    /// Tokens typed (or accepted) before each completion, appended to the file prefix.
    pub edit_tokens: TokenRange,
    /// Mean pause between completions of a session, in seconds (exponential).
    pub mean_gap_s: f64,
    /// Tokens to generate.
    pub output_tokens: TokenRange,
    /// A session ends before its prompt would exceed this many tokens.
    pub max_prompt_tokens: u32,
}

impl Default for CodeParams {
    fn default() -> Self {
        CodeParams {
            repositories: 12,
            repo_context_tokens: TokenRange::new(3000, 9000),
            zipf_s: 1.0,
            files_per_repo: 40,
            file_head_tokens: TokenRange::new(200, 3000),
            mean_completions: 10.0,
            max_completions: 50,
            edit_tokens: TokenRange::new(10, 200),
            mean_gap_s: 4.0,
            output_tokens: TokenRange::new(8, 128),
            max_prompt_tokens: 16_384,
        }
    }
}

/// Parameters of [`SyntheticKind::Conversation`].
#[derive(Clone, Debug, PartialEq)]
pub struct ConversationParams {
    /// Length of the one system prompt every request starts with.
    pub system_prompt_tokens: TokenRange,
    /// The turns of each session.
    pub session: SessionParams,
    /// Session starts during a burst come this many times faster than in calm periods.
    pub burst_factor: f64,
    /// Share of the time spent in bursts, in `(0, 1)`.
    pub burst_share: f64,
    /// Mean length of a burst, in seconds (exponential; calm periods last accordingly).
    pub mean_burst_s: f64,
}

impl Default for ConversationParams {
    fn default() -> Self {
        ConversationParams {
            system_prompt_tokens: TokenRange::new(1500, 2500),
            session: SessionParams {
                mean_turns: 8.0,
                max_turns: 40,
                user_tokens: TokenRange::new(20, 400),
                answer_tokens: TokenRange::new(50, 500),
                mean_think_s: 6.0,
                max_prompt_tokens: 16_384,
            },
            burst_factor: 4.0,
            burst_share: 0.25,
            mean_burst_s: 10.0,
        }
    }
}

/// Parameters of [`SyntheticKind::Longdoc`].
#[derive(Clone, Debug, PartialEq)]
pub struct LongdocParams {
    /// Documents sessions ask about.
    pub documents: u32,
    /// Length of each document (fixed per document, drawn from its seed).
    pub document_tokens: TokenRange,
    /// Zipf exponent of document popularity.
    pub zipf_s: f64,
    /// Length of the instructions that open every prompt, before the document.
    pub preamble_tokens: u32,
    /// Fewest questions of one session (the first and its follow-ups).
    pub min_turns: u32,
    /// Most questions of one session; the count is uniform in `[min_turns, max_turns]`.
    pub max_turns: u32,
    /// Length of each question.
    pub question_tokens: TokenRange,
    /// Length of each answer (the request's output, appended to the next turn's prompt).
    pub answer_tokens: TokenRange,
    /// Mean pause between an answer and the next question, in seconds (exponential).
    pub mean_think_s: f64,
}

impl Default for LongdocParams {
    fn default() -> Self {
        LongdocParams {
            documents: 120,
            document_tokens: TokenRange::new(16_000, 64_000),
            zipf_s: 0.8,
            preamble_tokens: 300,
            min_turns: 4,
            max_turns: 21,
            question_tokens: TokenRange::new(20, 200),
            answer_tokens: TokenRange::new(100, 600),
            mean_think_s: 30.0,
        }
    }
}

/// Parameters of every synthetic workload; each pattern reads its own section.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticParams {
    /// Mean request arrival rate, per second (Poisson).
    pub rate_per_s: f64,
    /// Requests to generate.
    pub requests: u32,
    /// Tenants the requests (or sessions) are spread over, uniformly; all see the same
    /// content.
    pub tenants: u32,
    /// Fixes content, arrivals and choices.
    pub seed: u64,
    /// [`SyntheticKind::Chat`] parameters.
    pub chat: ChatParams,
    /// [`SyntheticKind::Bots`] parameters.
    pub bots: BotsParams,
    /// [`SyntheticKind::Rag`] parameters.
    pub rag: RagParams,
    /// [`SyntheticKind::Code`] parameters.
    pub code: CodeParams,
    /// [`SyntheticKind::Conversation`] parameters.
    pub conversation: ConversationParams,
    /// [`SyntheticKind::Longdoc`] parameters.
    pub longdoc: LongdocParams,
}

impl Default for SyntheticParams {
    fn default() -> Self {
        SyntheticParams {
            rate_per_s: 15.0,
            requests: 3000,
            tenants: 1,
            seed: 1,
            chat: ChatParams::default(),
            bots: BotsParams::default(),
            rag: RagParams::default(),
            code: CodeParams::default(),
            conversation: ConversationParams::default(),
            longdoc: LongdocParams::default(),
        }
    }
}

impl SyntheticParams {
    /// Rejects parameters that describe no sensible workload. [`generate`] never fails: it
    /// reads a bad value as the nearest sensible one (a rate that is not positive as 1/s, 0
    /// tenants as 1, a count of 0 as 1, a mean below 1 as 1).
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |reason: String| Err(WorkloadError::BadParams { reason });
        if !(self.rate_per_s.is_finite() && self.rate_per_s > 0.0) {
            return bad(format!(
                "rate_per_s {} is not a positive number",
                self.rate_per_s
            ));
        }
        let counts = [
            ("tenants", self.tenants),
            ("chat.system_prompts", self.chat.system_prompts),
            ("chat.session.max_turns", self.chat.session.max_turns),
            ("bots.templates", self.bots.templates),
            ("rag.documents", self.rag.documents),
            ("code.repositories", self.code.repositories),
            ("code.files_per_repo", self.code.files_per_repo),
            ("code.max_completions", self.code.max_completions),
            (
                "conversation.session.max_turns",
                self.conversation.session.max_turns,
            ),
            ("longdoc.documents", self.longdoc.documents),
            ("longdoc.min_turns", self.longdoc.min_turns),
        ];
        for (name, n) in counts {
            if n == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if self.longdoc.min_turns > self.longdoc.max_turns {
            return bad(format!(
                "longdoc.min_turns {} exceeds longdoc.max_turns {}",
                self.longdoc.min_turns, self.longdoc.max_turns
            ));
        }
        if self.rag.docs_per_prompt > self.rag.documents {
            return bad(format!(
                "rag.docs_per_prompt {} exceeds rag.documents {}",
                self.rag.docs_per_prompt, self.rag.documents
            ));
        }
        let means = [
            ("chat.session.mean_turns", self.chat.session.mean_turns),
            ("code.mean_completions", self.code.mean_completions),
            (
                "conversation.session.mean_turns",
                self.conversation.session.mean_turns,
            ),
            ("conversation.burst_factor", self.conversation.burst_factor),
        ];
        for (name, m) in means {
            if !(m.is_finite() && m >= 1.0) {
                return bad(format!("{name} {m} is not a number of at least 1"));
            }
        }
        let non_negative = [
            ("chat.session.mean_think_s", self.chat.session.mean_think_s),
            ("code.mean_gap_s", self.code.mean_gap_s),
            ("bots.zipf_s", self.bots.zipf_s),
            ("rag.zipf_s", self.rag.zipf_s),
            ("code.zipf_s", self.code.zipf_s),
            (
                "conversation.session.mean_think_s",
                self.conversation.session.mean_think_s,
            ),
            ("conversation.mean_burst_s", self.conversation.mean_burst_s),
            ("longdoc.zipf_s", self.longdoc.zipf_s),
            ("longdoc.mean_think_s", self.longdoc.mean_think_s),
        ];
        for (name, x) in non_negative {
            if !(x.is_finite() && x >= 0.0) {
                return bad(format!("{name} {x} is not a non-negative number"));
            }
        }
        let ranges = [
            ("chat.system_prompt_tokens", self.chat.system_prompt_tokens),
            ("chat.session.user_tokens", self.chat.session.user_tokens),
            (
                "chat.session.answer_tokens",
                self.chat.session.answer_tokens,
            ),
            ("bots.template_tokens", self.bots.template_tokens),
            ("bots.user_tokens", self.bots.user_tokens),
            ("bots.output_tokens", self.bots.output_tokens),
            ("rag.document_tokens", self.rag.document_tokens),
            ("rag.question_tokens", self.rag.question_tokens),
            ("rag.output_tokens", self.rag.output_tokens),
            ("code.repo_context_tokens", self.code.repo_context_tokens),
            ("code.file_head_tokens", self.code.file_head_tokens),
            ("code.edit_tokens", self.code.edit_tokens),
            ("code.output_tokens", self.code.output_tokens),
            (
                "conversation.system_prompt_tokens",
                self.conversation.system_prompt_tokens,
            ),
            (
                "conversation.session.user_tokens",
                self.conversation.session.user_tokens,
            ),
            (
                "conversation.session.answer_tokens",
                self.conversation.session.answer_tokens,
            ),
            ("longdoc.document_tokens", self.longdoc.document_tokens),
            ("longdoc.question_tokens", self.longdoc.question_tokens),
            ("longdoc.answer_tokens", self.longdoc.answer_tokens),
        ];
        for (name, r) in ranges {
            if r.min > r.max {
                return bad(format!("{name} has min {} above max {}", r.min, r.max));
            }
        }
        let share = self.conversation.burst_share;
        if !(share.is_finite() && share > 0.0 && share < 1.0) {
            return bad(format!(
                "conversation.burst_share {share} is not a number between 0 and 1"
            ));
        }
        Ok(())
    }

    /// The rate, read as 1/s when it is not a positive number.
    fn rate(&self) -> f64 {
        if self.rate_per_s.is_finite() && self.rate_per_s > 0.0 {
            self.rate_per_s
        } else {
            1.0
        }
    }
}

/// Generates `params.requests` requests of `kind`, sorted (stably) by arrival.
pub fn generate(kind: SyntheticKind, params: &SyntheticParams) -> Vec<SyntheticRequest> {
    let mut g = Generator::new(kind, params);
    let mut out = match kind {
        SyntheticKind::Chat => g.chat(),
        SyntheticKind::Bots => g.bots(),
        SyntheticKind::Rag => g.rag(),
        SyntheticKind::Code => g.code(),
        SyntheticKind::Conversation => g.conversation(),
        SyntheticKind::Longdoc => g.longdoc(),
    };
    out.sort_by_key(|r| r.arrival_us);
    out.truncate(params.requests as usize);
    out
}

/// [`generate`], then [`to_workload`] with blocks of `block_tokens` tokens; the workload is
/// named after the kind.
pub fn generate_workload(
    kind: SyntheticKind,
    params: &SyntheticParams,
    block_tokens: u32,
) -> Workload {
    to_workload(kind.name(), &generate(kind, params), block_tokens)
}

/// Replaces the arrival times of `requests` (sorted by arrival) with `arrivals_us` (for
/// example an Azure trace's), matched in sorted order so that every request keeps its
/// place, and a chat turn still follows its previous turn. When there are fewer arrivals
/// than requests the last requests are dropped.
pub fn with_arrivals(
    mut requests: Vec<SyntheticRequest>,
    arrivals_us: &[u64],
) -> Vec<SyntheticRequest> {
    let mut arrivals = arrivals_us.to_vec();
    arrivals.sort_unstable();
    requests.sort_by_key(|r| r.arrival_us);
    requests.truncate(arrivals.len());
    for (r, at) in requests.iter_mut().zip(arrivals) {
        r.arrival_us = at;
    }
    requests
}

/// Materialises the token ids of every request and computes its block keys with the key of
/// tenant `tenant-{tenant}` (empty salt). Requests are sorted (stably) by arrival and
/// numbered from 0; outputs of 0 tokens become 1; `block_tokens` of 0 gives no keys.
pub fn to_workload(name: &str, requests: &[SyntheticRequest], block_tokens: u32) -> Workload {
    let mut order: Vec<&SyntheticRequest> = requests.iter().collect();
    order.sort_by_key(|r| r.arrival_us);
    let mut tenants: HashMap<u32, TenantKey> = HashMap::new();
    // Segments recur (system prompts, templates, chat history): draw each content once.
    let mut contents: HashMap<Segment, Vec<u32>> = HashMap::new();
    let mut tokens: Vec<u32> = Vec::new();
    let requests = order
        .into_iter()
        .enumerate()
        .map(|(id, r)| {
            tokens.clear();
            for s in &r.segments {
                tokens.extend_from_slice(contents.entry(*s).or_insert_with(|| s.token_ids()));
            }
            let tenant = tenants
                .entry(r.tenant)
                .or_insert_with(|| TenantKey::derive(&format!("tenant-{}", r.tenant), ""));
            Request {
                id: id as u64,
                arrival_us: r.arrival_us,
                tenant: r.tenant,
                keys: token_block_keys(tenant, &tokens, block_tokens as usize),
                prompt_tokens: r.prompt_tokens(),
                output_tokens: r.output_tokens.max(1),
            }
        })
        .collect();
    Workload {
        name: name.to_string(),
        block_tokens,
        requests,
    }
}

// Domains of fixed content, so that e.g. template 3 and document 3 differ.
const CHAT_SYSTEM: u64 = 1;
const BOT_TEMPLATE: u64 = 2;
const RAG_PREAMBLE: u64 = 3;
const RAG_DOCUMENT: u64 = 4;
const CODE_REPO: u64 = 5;
const CODE_FILE: u64 = 6;
const CONVERSATION_SYSTEM: u64 = 7;
const LONGDOC_PREAMBLE: u64 = 8;
const LONGDOC_DOCUMENT: u64 = 9;

/// One SplitMix64 step: the golden-ratio increment, then the finaliser.
fn mix64(x: u64) -> u64 {
    warmpath_index::rng::mix64(x.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// Seconds to microseconds (saturating; NaN is 0).
fn to_us(seconds: f64) -> u64 {
    (seconds * 1e6).round() as u64
}

/// A mean of at least 1 (a bad value reads as 1).
fn mean_at_least_one(m: f64) -> f64 {
    if m.is_finite() && m >= 1.0 {
        m
    } else {
        1.0
    }
}

/// A non-negative finite value (a bad value reads as 0).
fn non_negative(x: f64) -> f64 {
    if x.is_finite() && x >= 0.0 {
        x
    } else {
        0.0
    }
}

/// Whether sessions that start after `start_s` can no longer be among the first `wanted`
/// arrivals: `wanted` requests already arrive by then (all of a later session's requests
/// arrive after it starts). Without this, stopping at `wanted` generated requests would
/// leave the last arrivals to the sparse late turns of long sessions.
fn enough(out: &[SyntheticRequest], wanted: usize, start_s: f64) -> bool {
    out.len() >= wanted
        && out
            .iter()
            .filter(|r| r.arrival_us <= to_us(start_s))
            .count()
            >= wanted
}

/// Zipf sampling over `[0, n)` from a precomputed cumulative table (the generators draw
/// thousands of times from the same distribution).
struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    /// Rank `k` in `[0, n.max(1))` has weight `1 / (k + 1)^s`.
    fn new(n: u32, s: f64) -> Self {
        let s = non_negative(s);
        let mut total = 0.0;
        let cumulative = (0..n.max(1))
            .map(|k| {
                total += 1.0 / f64::from(k + 1).powf(s);
                total
            })
            .collect();
        Zipf { cumulative }
    }

    fn sample(&self, rng: &mut Rng) -> u32 {
        let total = self.cumulative.last().copied().unwrap_or(0.0);
        let x = rng.next_f64() * total;
        let k = self.cumulative.partition_point(|&c| c <= x);
        k.min(self.cumulative.len() - 1) as u32
    }
}

/// Shared state of one generation run.
struct Generator<'a> {
    p: &'a SyntheticParams,
    /// Arrivals and pauses.
    time: Rng,
    /// Every other choice, and the seeds of unique content.
    draws: Rng,
}

impl<'a> Generator<'a> {
    fn new(kind: SyntheticKind, p: &'a SyntheticParams) -> Self {
        let mut root = Rng::new(p.seed ^ mix64(kind as u64));
        let time = root.fork(1);
        let draws = root.fork(2);
        Generator { p, time, draws }
    }

    fn wanted(&self) -> usize {
        self.p.requests as usize
    }

    fn tenant(&mut self) -> u32 {
        self.draws.below(u64::from(self.p.tenants.max(1))) as u32
    }

    /// Content shared across requests: item `(a, b)` of `domain`, its length drawn from
    /// `len` by its own seed, so it is the same segment wherever it appears.
    fn fixed(&self, domain: u64, a: u64, b: u64, len: TokenRange) -> Segment {
        let seed = mix64(mix64(mix64(self.p.seed ^ mix64(domain)) ^ a) ^ b);
        let tokens = len.draw(&mut Rng::new(seed ^ 0x6c65_6e67_7468)); // "length"
        Segment { seed, tokens }
    }

    /// Content of one request only.
    fn unique(&mut self, len: TokenRange) -> Segment {
        let tokens = len.draw(&mut self.draws);
        Segment {
            seed: self.draws.next_u64(),
            tokens,
        }
    }

    /// Whether a session of geometric length with this mean goes on after a request.
    fn goes_on(&mut self, mean: f64) -> bool {
        self.draws.chance(1.0 - 1.0 / mean_at_least_one(mean))
    }

    fn chat(&mut self) -> Vec<SyntheticRequest> {
        let c = self.p.chat.clone();
        let mean_turns = mean_at_least_one(c.session.mean_turns);
        let mean_start_gap = mean_turns / self.p.rate();
        let mut out = Vec::with_capacity(self.wanted());
        let mut start = 0.0;
        while !enough(&out, self.wanted(), start) {
            start += self.time.exp(mean_start_gap);
            let tenant = self.tenant();
            let system = self.draws.below(u64::from(c.system_prompts.max(1)));
            let system = self.fixed(CHAT_SYSTEM, system, 0, c.system_prompt_tokens);
            self.session(&mut out, tenant, system, start, &c.session, false);
        }
        out
    }

    /// One session of growing turns after `system`, from `start` seconds: each prompt is
    /// the previous one, its answer and a new message, after a think time. It ends after a
    /// geometric number of turns, or before its next prompt would exceed the bound: surely
    /// (with the shortest message), or possibly (the longest) if `end_before_longest`.
    fn session(
        &mut self,
        out: &mut Vec<SyntheticRequest>,
        tenant: u32,
        system: Segment,
        start: f64,
        t: &SessionParams,
        end_before_longest: bool,
    ) {
        let mean_turns = mean_at_least_one(t.mean_turns);
        let mut segments = vec![system];
        let mut at = start;
        for turn in 1..=t.max_turns.max(1) {
            segments.push(self.unique(t.user_tokens));
            let output_tokens = t.answer_tokens.draw(&mut self.draws).max(1);
            out.push(SyntheticRequest {
                arrival_us: to_us(at),
                tenant,
                segments: segments.clone(),
                output_tokens,
            });
            if turn == t.max_turns || !self.goes_on(mean_turns) {
                break;
            }
            // The answer becomes history: the next prompt is this one, the answer and a
            // new message.
            segments.push(Segment {
                seed: self.draws.next_u64(),
                tokens: output_tokens,
            });
            let message = if end_before_longest {
                t.user_tokens.max
            } else {
                t.user_tokens.min
            };
            let next =
                segments.iter().map(|s| u64::from(s.tokens)).sum::<u64>() + u64::from(message);
            if next > u64::from(t.max_prompt_tokens) {
                break;
            }
            at += self.time.exp(non_negative(t.mean_think_s));
        }
    }

    fn bots(&mut self) -> Vec<SyntheticRequest> {
        let b = self.p.bots.clone();
        let zipf = Zipf::new(b.templates, b.zipf_s);
        let mean_gap = 1.0 / self.p.rate();
        let mut at = 0.0;
        (0..self.wanted())
            .map(|_| {
                at += self.time.exp(mean_gap);
                let tenant = self.tenant();
                let template = zipf.sample(&mut self.draws);
                let segments = vec![
                    self.fixed(BOT_TEMPLATE, u64::from(template), 0, b.template_tokens),
                    self.unique(b.user_tokens),
                ];
                let output_tokens = b.output_tokens.draw(&mut self.draws).max(1);
                SyntheticRequest {
                    arrival_us: to_us(at),
                    tenant,
                    segments,
                    output_tokens,
                }
            })
            .collect()
    }

    fn rag(&mut self) -> Vec<SyntheticRequest> {
        let r = self.p.rag.clone();
        let documents = r.documents.max(1);
        let k = r.docs_per_prompt.min(documents) as usize;
        let zipf = Zipf::new(documents, r.zipf_s);
        let preamble_len = TokenRange::new(r.preamble_tokens, r.preamble_tokens);
        let mean_gap = 1.0 / self.p.rate();
        let mut at = 0.0;
        (0..self.wanted())
            .map(|_| {
                at += self.time.exp(mean_gap);
                let tenant = self.tenant();
                let mut picked: Vec<u32> = Vec::with_capacity(k);
                // Distinct documents by popularity; rare repeated misses fall back to the
                // most popular documents not yet picked, so the loop always ends.
                for _ in 0..k * 64 {
                    if picked.len() == k {
                        break;
                    }
                    let d = zipf.sample(&mut self.draws);
                    if !picked.contains(&d) {
                        picked.push(d);
                    }
                }
                let mut next = 0;
                while picked.len() < k {
                    if !picked.contains(&next) {
                        picked.push(next);
                    }
                    next += 1;
                }
                // A canonical order (by rank), as a prompt builder that wants prefix reuse
                // would sort its retrieved documents.
                picked.sort_unstable();
                let mut segments = Vec::with_capacity(k + 2);
                segments.push(self.fixed(RAG_PREAMBLE, 0, 0, preamble_len));
                for d in picked {
                    segments.push(self.fixed(RAG_DOCUMENT, u64::from(d), 0, r.document_tokens));
                }
                segments.push(self.unique(r.question_tokens));
                let output_tokens = r.output_tokens.draw(&mut self.draws).max(1);
                SyntheticRequest {
                    arrival_us: to_us(at),
                    tenant,
                    segments,
                    output_tokens,
                }
            })
            .collect()
    }

    fn code(&mut self) -> Vec<SyntheticRequest> {
        let c = self.p.code.clone();
        let zipf = Zipf::new(c.repositories, c.zipf_s);
        let mean_completions = mean_at_least_one(c.mean_completions);
        let mean_start_gap = mean_completions / self.p.rate();
        let mut out = Vec::with_capacity(self.wanted());
        let mut start = 0.0;
        while !enough(&out, self.wanted(), start) {
            start += self.time.exp(mean_start_gap);
            let tenant = self.tenant();
            let repo = u64::from(zipf.sample(&mut self.draws));
            let file = self.draws.below(u64::from(c.files_per_repo.max(1)));
            let mut segments = vec![
                self.fixed(CODE_REPO, repo, 0, c.repo_context_tokens),
                self.fixed(CODE_FILE, repo, file, c.file_head_tokens),
            ];
            let mut at = start;
            for n in 1..=c.max_completions.max(1) {
                segments.push(self.unique(c.edit_tokens));
                let output_tokens = c.output_tokens.draw(&mut self.draws).max(1);
                out.push(SyntheticRequest {
                    arrival_us: to_us(at),
                    tenant,
                    segments: segments.clone(),
                    output_tokens,
                });
                if n == c.max_completions || !self.goes_on(mean_completions) {
                    break;
                }
                let next_max = segments.iter().map(|s| u64::from(s.tokens)).sum::<u64>()
                    + u64::from(c.edit_tokens.max);
                if next_max > u64::from(c.max_prompt_tokens) {
                    break;
                }
                at += self.time.exp(non_negative(c.mean_gap_s));
            }
        }
        out
    }

    fn longdoc(&mut self) -> Vec<SyntheticRequest> {
        let d = self.p.longdoc.clone();
        let zipf = Zipf::new(d.documents, d.zipf_s);
        let min_turns = d.min_turns.max(1);
        let max_turns = d.max_turns.max(min_turns);
        let mean_turns = f64::from(min_turns + max_turns) / 2.0;
        let mean_start_gap = mean_turns / self.p.rate();
        let preamble_len = TokenRange::new(d.preamble_tokens, d.preamble_tokens);
        let preamble = self.fixed(LONGDOC_PREAMBLE, 0, 0, preamble_len);
        let mut out = Vec::with_capacity(self.wanted());
        let mut start = 0.0;
        while !enough(&out, self.wanted(), start) {
            start += self.time.exp(mean_start_gap);
            let tenant = self.tenant();
            let doc = u64::from(zipf.sample(&mut self.draws));
            let turns = self.draws.range(u64::from(min_turns), u64::from(max_turns)) as u32;
            let mut segments = vec![
                preamble,
                self.fixed(LONGDOC_DOCUMENT, doc, 0, d.document_tokens),
            ];
            let mut at = start;
            for turn in 1..=turns {
                segments.push(self.unique(d.question_tokens));
                let output_tokens = d.answer_tokens.draw(&mut self.draws).max(1);
                out.push(SyntheticRequest {
                    arrival_us: to_us(at),
                    tenant,
                    segments: segments.clone(),
                    output_tokens,
                });
                if turn == turns {
                    break;
                }
                // The answer becomes history; the user reads it, then asks again.
                segments.push(Segment {
                    seed: self.draws.next_u64(),
                    tokens: output_tokens,
                });
                at += self.time.exp(non_negative(d.mean_think_s));
            }
        }
        out
    }

    fn conversation(&mut self) -> Vec<SyntheticRequest> {
        let c = self.p.conversation.clone();
        let mean_turns = mean_at_least_one(c.session.mean_turns);
        let system = self.fixed(CONVERSATION_SYSTEM, 0, 0, c.system_prompt_tokens);
        // Session starts: a Poisson process whose rate alternates between calm and burst
        // periods of exponential length, averaging `rate / mean turns`.
        let share = if c.burst_share.is_finite() && c.burst_share > 0.0 && c.burst_share < 1.0 {
            c.burst_share
        } else {
            0.25
        };
        let factor = mean_at_least_one(c.burst_factor);
        let mean_rate = self.p.rate() / mean_turns;
        let calm_rate = mean_rate / (share * factor + 1.0 - share);
        let mean_burst = non_negative(c.mean_burst_s).max(1e-3);
        let mean_calm = mean_burst * (1.0 - share) / share;
        let mut bursting = false;
        let mut period_end = self.time.exp(mean_calm);
        let mut out = Vec::with_capacity(self.wanted());
        let mut start = 0.0;
        while !enough(&out, self.wanted(), start) {
            let rate = if bursting {
                calm_rate * factor
            } else {
                calm_rate
            };
            let next = start + self.time.exp(1.0 / rate);
            if next > period_end {
                // Memoryless: restart the wait at the period's end, at the new rate.
                start = period_end;
                bursting = !bursting;
                period_end += self.time.exp(if bursting { mean_burst } else { mean_calm });
                continue;
            }
            start = next;
            let tenant = self.tenant();
            self.session(&mut out, tenant, system, start, &c.session, true);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use warmpath_index::keys::BlockKey;

    use super::*;

    const BLOCK: u32 = 64;

    fn small(seed: u64) -> SyntheticParams {
        SyntheticParams {
            requests: 300,
            seed,
            ..SyntheticParams::default()
        }
    }

    #[test]
    fn segment_content_is_fixed_by_its_seed() {
        let s = Segment {
            seed: 42,
            tokens: 1000,
        };
        let ids = s.token_ids();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|&t| t < VOCAB));
        assert_eq!(ids, s.token_ids());
        assert_ne!(
            ids,
            Segment {
                seed: 43,
                tokens: 1000
            }
            .token_ids()
        );
        assert_eq!(
            Segment {
                seed: 42,
                tokens: 10
            }
            .token_ids(),
            ids[..10]
        );
    }

    #[test]
    fn kinds_parse_by_name() {
        for kind in SyntheticKind::ALL {
            assert_eq!(kind.name().parse::<SyntheticKind>().ok(), Some(kind));
            assert_eq!(kind.to_string(), kind.name());
        }
        match "agents".parse::<SyntheticKind>() {
            Err(e @ WorkloadError::UnknownSynthetic { .. }) => {
                assert_eq!(
                    e.to_string(),
                    "unknown synthetic workload `agents` (valid: chat, bots, rag, code, conversation, \
                         longdoc)"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn same_seed_same_output_and_seeds_differ() {
        for kind in SyntheticKind::ALL {
            let a = generate(kind, &small(7));
            assert_eq!(a.len(), 300, "{kind}");
            assert!(
                a.windows(2).all(|p| p[0].arrival_us <= p[1].arrival_us),
                "{kind}"
            );
            assert_eq!(a, generate(kind, &small(7)), "{kind}");
            let b = generate(kind, &small(8));
            assert_ne!(a, b, "{kind}");
            // Shared content differs too, not only arrivals and unique parts.
            let firsts =
                |rs: &[SyntheticRequest]| rs.iter().map(|r| r.segments[0]).collect::<HashSet<_>>();
            assert!(firsts(&a).is_disjoint(&firsts(&b)), "{kind}");
        }
        let w = generate_workload(SyntheticKind::Bots, &small(7), BLOCK);
        assert_eq!(w, generate_workload(SyntheticKind::Bots, &small(7), BLOCK));
    }

    #[test]
    fn chat_turns_extend_their_previous_turn() {
        let requests = generate(SyntheticKind::Chat, &small(3));
        let w = to_workload("chat", &requests, BLOCK);
        let by_segments: HashMap<&[Segment], usize> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| (r.segments.as_slice(), i))
            .collect();
        let mut later_turns = 0;
        for (i, r) in requests.iter().enumerate() {
            if r.segments.len() < 4 {
                continue; // a first turn: system prompt and message
            }
            later_turns += 1;
            let prev = by_segments[&r.segments[..r.segments.len() - 2]];
            assert!(requests[prev].arrival_us <= r.arrival_us);
            assert_eq!(requests[prev].tenant, r.tenant);
            // The answer in the history is as long as the previous turn's output.
            assert_eq!(
                r.segments[r.segments.len() - 2].tokens,
                requests[prev].output_tokens
            );
            let (before, now) = (&w.requests[prev].keys, &w.requests[i].keys);
            assert!(now.len() >= before.len());
            assert_eq!(
                &now[..before.len()],
                &before[..],
                "turn {i} does not extend turn {prev}"
            );
        }
        assert!(later_turns > 100, "{later_turns}");
    }

    #[test]
    fn tenants_with_the_same_content_share_no_keys() {
        for kind in SyntheticKind::ALL {
            let params = SyntheticParams {
                requests: 200,
                tenants: 2,
                ..SyntheticParams::default()
            };
            let requests = generate(kind, &params);
            let w = to_workload(kind.name(), &requests, BLOCK);
            let mut keys: [HashSet<BlockKey>; 2] = [HashSet::new(), HashSet::new()];
            let mut content: [HashSet<Segment>; 2] = [HashSet::new(), HashSet::new()];
            for (r, s) in w.requests.iter().zip(&requests) {
                keys[r.tenant as usize].extend(r.keys.iter().copied());
                content[r.tenant as usize].insert(s.segments[0]);
            }
            assert!(
                !content[0].is_disjoint(&content[1]),
                "{kind}: the tenants see the same prompts"
            );
            assert!(!keys[0].is_empty() && !keys[1].is_empty(), "{kind}");
            assert!(
                keys[0].is_disjoint(&keys[1]),
                "{kind}: a key is shared across tenants"
            );
        }
    }

    #[test]
    fn default_workloads_sizes_and_hit_ratios() {
        // (kind, mean prompt tokens range, lowest ideal hit ratio)
        let expected = [
            (SyntheticKind::Chat, 4000.0..8000.0, 0.8),
            (SyntheticKind::Bots, 4000.0..6500.0, 0.8),
            (SyntheticKind::Rag, 3500.0..6000.0, 0.65),
            (SyntheticKind::Code, 6000.0..11000.0, 0.9),
            (SyntheticKind::Conversation, 3000.0..9000.0, 0.8),
        ];
        let params = SyntheticParams::default();
        assert!(params.validate().is_ok());
        for (kind, mean_prompt, min_hit) in expected {
            let w = generate_workload(kind, &params, BLOCK);
            let stats = w.stats();
            let in_range = w
                .requests
                .iter()
                .filter(|r| (1000..=16_384).contains(&r.prompt_tokens))
                .count();
            let in_range = in_range as f64 / w.requests.len() as f64;
            println!(
                "{kind}: {} requests over {:.0} s, mean prompt {:.0} tokens, mean output {:.0}, \
                 {:.1}% of prompts in 1k..=16k, {} blocks ({} unique), ideal hit ratio {:.3}",
                stats.requests,
                stats.duration_us as f64 / 1e6,
                stats.mean_prompt_tokens,
                stats.mean_output_tokens,
                in_range * 100.0,
                stats.blocks,
                stats.unique_blocks,
                stats.ideal_hit_ratio
            );
            assert_eq!(stats.requests, 3000, "{kind}");
            assert!(
                (120e6..300e6).contains(&(stats.duration_us as f64)),
                "{kind}: {}",
                stats.duration_us
            );
            assert!(
                mean_prompt.contains(&stats.mean_prompt_tokens),
                "{kind}: {}",
                stats.mean_prompt_tokens
            );
            assert!(in_range > 0.9, "{kind}: {in_range}");
            assert!(
                stats.ideal_hit_ratio > min_hit,
                "{kind}: {}",
                stats.ideal_hit_ratio
            );
            assert!(w
                .requests
                .iter()
                .all(|r| r.keys.len() as u32 == r.prompt_tokens / BLOCK));
        }
    }

    #[test]
    fn longdoc_sessions_ask_several_questions_about_long_documents() {
        let params = SyntheticParams {
            requests: 600,
            ..SyntheticParams::default()
        };
        let d = &params.longdoc;
        let requests = generate(SyntheticKind::Longdoc, &params);
        assert_eq!(requests.len(), 600);
        let mut documents = HashSet::new();
        let mut follow_ups = 0;
        for r in &requests {
            let doc = r.segments[1];
            assert!((d.document_tokens.min..=d.document_tokens.max).contains(&doc.tokens));
            documents.insert(doc);
            // preamble, document, then question (answer, question)*
            assert_eq!(r.segments.len() % 2, 1, "{r:?}");
            let turn = (r.segments.len() - 1) / 2;
            assert!(turn as u32 <= d.max_turns);
            follow_ups += usize::from(turn > 1);
        }
        // Many sessions share each popular document.
        assert!(documents.len() <= d.documents as usize);
        assert!(documents.len() >= 10, "{}", documents.len());
        assert!(follow_ups > 400, "{follow_ups}");
        let w = to_workload("longdoc", &requests, BLOCK);
        let stats = w.stats();
        assert!(
            (25_000.0..60_000.0).contains(&stats.mean_prompt_tokens),
            "{}",
            stats.mean_prompt_tokens
        );
        assert!(stats.ideal_hit_ratio > 0.8, "{}", stats.ideal_hit_ratio);
    }

    #[test]
    fn arrivals_can_come_from_a_trace() {
        let requests = generate(SyntheticKind::Chat, &small(5));
        let arrivals: Vec<u64> = (0..250u64).rev().map(|i| i * 1000).collect();
        let replaced = with_arrivals(requests.clone(), &arrivals);
        assert_eq!(replaced.len(), 250);
        for (i, (r, original)) in replaced.iter().zip(&requests).enumerate() {
            assert_eq!(r.arrival_us, i as u64 * 1000);
            assert_eq!(r.segments, original.segments, "order is kept");
        }
    }

    #[test]
    fn bad_params_are_reported_and_never_panic() {
        let mut p = SyntheticParams {
            requests: 20,
            ..SyntheticParams::default()
        };
        p.rate_per_s = 0.0;
        p.tenants = 0;
        p.chat.session.mean_turns = f64::NAN;
        p.chat.session.max_turns = 0;
        p.bots.templates = 0;
        p.rag.documents = 0;
        p.rag.docs_per_prompt = 9;
        p.code.repositories = 0;
        p.code.files_per_repo = 0;
        p.code.mean_gap_s = -1.0;
        p.code.edit_tokens = TokenRange::new(10, 5);
        p.conversation.burst_share = 1.5;
        p.conversation.session.mean_turns = 0.0;
        assert!(matches!(p.validate(), Err(WorkloadError::BadParams { .. })));
        for kind in SyntheticKind::ALL {
            let w = generate_workload(kind, &p, BLOCK);
            assert_eq!(w.requests.len(), 20, "{kind}");
            assert!(
                w.requests
                    .iter()
                    .all(|r| r.tenant == 0 && r.output_tokens >= 1),
                "{kind}"
            );
        }
        let none = SyntheticParams {
            requests: 0,
            ..SyntheticParams::default()
        };
        assert!(generate(SyntheticKind::Chat, &none).is_empty());
        assert!(to_workload("x", &[], 0).requests.is_empty());
    }
}
