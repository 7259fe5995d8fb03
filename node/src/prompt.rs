//! Real tokenizers and chat templates, so that a pool's block boundaries, hence its block
//! keys, equal those its engines make (and those an agent derives from their KV events).
//!
//! A pool names its tokenizer:
//! - `builtin` (the default): warmpath's own ([`warmpath_index::text::tokenize`]), what
//!   engine-sim uses;
//! - `tiktoken:o200k_base` or `tiktoken:cl100k_base`: OpenAI's encodings through the
//!   `bpe-openai` crate, whose vocabularies are built into the binary (nothing is
//!   downloaded at run time). Their special tokens written in the text (`<|endoftext|>`…)
//!   encode as their ids, as a Hugging Face tokenizer does with its added tokens;
//! - `hf:PATH`: a Hugging Face `tokenizer.json`, read from PATH on each router. A
//!   completions prompt is encoded with the tokenizer's special tokens added (a BOS), as
//!   vLLM does; a rendered chat without (its template writes them). A
//!   `tokenizer_config.json` beside it gives the template's `bos_token` and `eos_token`.
//!
//! and its chat template (Jinja, rendered by minijinja with Python's string methods, as
//! engines render the model's template with `messages`, `add_generation_prompt`,
//! `bos_token` and `eos_token`); with none, chat requests are rendered in the built-in
//! format.
//!
//! **Cost: the fast path.** OpenAI's encodings, and a Hugging Face byte-level BPE whose
//! pre-tokenizer is o200k's or cl100k's pattern (Llama 3's is cl100k's) with no normalizer,
//! are encoded by warmpath piece by piece ([`Fast`]): [`crate::pretokenize`] cuts the
//! pieces (without a regex on ASCII text), and only a piece not in the caches goes to the
//! BPE (`bpe-openai`'s, or the tokenizer's own model on the piece's byte-level spelling).
//! A `tokenizer.json` takes the fast path only if warmpath's ids equal the `tokenizers`
//! crate's on a probe text at load; otherwise the crate encodes the whole text (about
//! 350 µs per KB here, docs/decisions/0090-tokenizer-fast-path.md). Two caches per thread
//! and tokenizer, both exact (tests hold the ids equal to the uncached encoders'):
//! - pieces: BPE works on each pre-tokenized piece (a word, a number, a punctuation run)
//!   alone, so the ids of each piece seen before are kept, in a direct-mapped table of
//!   [`PIECE_CACHE_SLOTS`] one-cache-line slots (a piece of up to 22 bytes and 8 ids; a new
//!   piece replaces the one in its slot): prompts repeat their words;
//! - segments: a text cut where the pre-tokenizer would cut anyway (a space between two
//!   ASCII letters) encodes as its parts do, so a prompt is cut about every 512 bytes and
//!   the ids of each segment are kept under a hash of all the text before its end
//!   ([`SEGMENT_CACHE_ENTRIES`] at most): a shared prefix (a system prompt, a document, a
//!   conversation so far) is neither split nor encoded again.
//!
//! BENCHMARKS.md ("Router added latency with a real tokenizer") has the figures.

use crate::pretokenize::{self, Pattern};
use warmpath_index::text::{render_chat, tokenize, ChatMessage, Tokenize, Tokenizer};

/// The largest chat template a pool may carry.
pub const MAX_TEMPLATE_BYTES: usize = 64 * 1024;

enum Model {
    Builtin,
    /// Pieces cut and cached by warmpath (see the module docs).
    Fast(Fast),
    /// A Hugging Face tokenizer off the fast path, encoded by the `tokenizers` crate whole.
    Hf(Box<tokenizers::Tokenizer>),
}

/// A byte-pair encoding whose pieces warmpath cuts ([`crate::pretokenize`]) and caches:
/// one of OpenAI's encodings, or a Hugging Face byte-level BPE with one of their patterns.
struct Fast {
    bpe: Bpe,
    pattern: Pattern,
    /// Names its caches in every thread.
    cache: u64,
    specials: Specials,
    /// Ids a completions prompt starts and ends with (a post-processor's BOS, say).
    open: Vec<u32>,
    close: Vec<u32>,
}

/// What encodes one piece.
enum Bpe {
    OpenAi(&'static bpe_openai::Tokenizer),
    /// The tokenizer's own model, on the piece's bytes in the byte-level alphabet.
    Hf(Box<tokenizers::Tokenizer>),
}

/// Tokens written in the text that encode as one id.
enum Specials {
    /// OpenAI's: all start with [`SPECIAL_OPENER`].
    OpenAi(&'static [(&'static str, u32)]),
    /// A tokenizer.json's added tokens, found leftmost-longest as `tokenizers` finds them.
    Added {
        finder: aho_corasick::AhoCorasick,
        ids: Vec<u32>,
    },
}

/// [`Fast::cache`] of OpenAI's encodings: every pool naming one shares its caches.
const O200K_CACHE: u64 = 0;
const CL100K_CACHE: u64 = 1;

/// [`Fast::cache`] of a `tokenizer.json`: a hash of its text, so that pools naming the same
/// file, and a reload of an unchanged one, share warm caches.
fn cache_name_of(tokenizer_json: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(tokenizer_json.as_bytes()) | 1 << 63
}

/// `tiktoken`'s special tokens of each encoding.
const O200K_SPECIALS: &[(&str, u32)] = &[("<|endoftext|>", 199_999), ("<|endofprompt|>", 200_018)];
const CL100K_SPECIALS: &[(&str, u32)] = &[
    ("<|endoftext|>", 100_257),
    ("<|fim_prefix|>", 100_258),
    ("<|fim_middle|>", 100_259),
    ("<|fim_suffix|>", 100_260),
    ("<|endofprompt|>", 100_276),
];

/// How one pool's prompts become token ids.
pub struct PoolText {
    name: String,
    model: Model,
    template: Option<minijinja::Environment<'static>>,
    /// What a chat template's `bos_token` and `eos_token` render as.
    specials: TemplateTokens,
}

/// A model's `bos_token` and `eos_token` spellings, as its `tokenizer_config.json` gives
/// them (engines pass them to its chat template); empty where unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TemplateTokens {
    pub bos_token: String,
    pub eos_token: String,
}

impl TemplateTokens {
    /// Read from the `tokenizer_config.json` beside a `tokenizer.json`, if there is one
    /// (each token a string or an object with `content`); an unreadable file is an error.
    fn beside(tokenizer_json: &str) -> Result<TemplateTokens, String> {
        let path = std::path::Path::new(tokenizer_json).with_file_name("tokenizer_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let token = |key: &str| {
            let v = &json[key];
            v.as_str()
                .or_else(|| v["content"].as_str())
                .unwrap_or_default()
                .to_string()
        };
        Ok(TemplateTokens {
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
        })
    }
}

impl std::fmt::Debug for PoolText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolText")
            .field("tokenizer", &self.name)
            .field("chat_template", &self.template.is_some())
            .finish()
    }
}

impl PoolText {
    /// Loads a pool's tokenizer (see the module docs) and compiles its chat template ("":
    /// none). The error says what is wrong, for the admin API and the config file.
    pub fn load(tokenizer: &str, chat_template: &str) -> Result<PoolText, String> {
        let model = match tokenizer {
            "" | "builtin" => Model::Builtin,
            "tiktoken:o200k_base" => Model::Fast(Fast::openai(
                bpe_openai::o200k_base(),
                Pattern::O200k,
                O200K_CACHE,
                O200K_SPECIALS,
            )),
            "tiktoken:cl100k_base" => Model::Fast(Fast::openai(
                bpe_openai::cl100k_base(),
                Pattern::Cl100k,
                CL100K_CACHE,
                CL100K_SPECIALS,
            )),
            t => match t.strip_prefix("hf:") {
                Some(path) if !path.is_empty() => load_hf(path)?,
                _ => {
                    return Err(format!(
                        "tokenizer {t:?}: builtin, tiktoken:o200k_base, tiktoken:cl100k_base \
                         or hf:PATH (a Hugging Face tokenizer.json)"
                    ))
                }
            },
        };
        let template = match chat_template {
            "" => None,
            t if t.len() > MAX_TEMPLATE_BYTES => {
                return Err(format!(
                    "chat template of {} bytes, at most {MAX_TEMPLATE_BYTES}",
                    t.len()
                ))
            }
            t => {
                let mut env = minijinja::Environment::new();
                minijinja_contrib::add_to_environment(&mut env);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_function(
                    "raise_exception",
                    |msg: String| -> Result<String, minijinja::Error> {
                        Err(minijinja::Error::new(
                            minijinja::ErrorKind::InvalidOperation,
                            msg,
                        ))
                    },
                );
                env.add_template_owned("chat", t.to_string())
                    .map_err(|e| format!("chat template: {e}"))?;
                Some(env)
            }
        };
        let name = if tokenizer.is_empty() {
            "builtin".to_string()
        } else {
            tokenizer.to_string()
        };
        let specials = match tokenizer.strip_prefix("hf:") {
            Some(path) => TemplateTokens::beside(path)?,
            None => TemplateTokens::default(),
        };
        Ok(PoolText {
            name,
            model,
            template,
            specials,
        })
    }

    /// As a shared [`Tokenizer`].
    pub fn into_tokenizer(self) -> Tokenizer {
        Tokenizer(std::sync::Arc::new(self))
    }

    /// Whether its pieces are cut and cached by warmpath (false: the built-in tokenizer,
    /// or a Hugging Face tokenizer encoded whole by the `tokenizers` crate).
    pub fn fast(&self) -> bool {
        matches!(self.model, Model::Fast(_))
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        match &self.model {
            Model::Builtin => tokenize(text),
            Model::Fast(f) => f.encode(text, add_special_tokens),
            Model::Hf(t) => hf_encode(t, text, add_special_tokens),
        }
    }
}

fn hf_encode(t: &tokenizers::Tokenizer, text: &str, add_special_tokens: bool) -> Vec<u32> {
    t.encode_fast(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .unwrap_or_default()
}

/// Loads a Hugging Face `tokenizer.json`: on the fast path when it is a byte-level BPE
/// that warmpath cuts exactly ([`fast_hf`]), else whole through the `tokenizers` crate.
fn load_hf(path: &str) -> Result<Model, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("tokenizer {path}: {e}"))?;
    let tokenizer: tokenizers::Tokenizer =
        text.parse().map_err(|e| format!("tokenizer {path}: {e}"))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("tokenizer {path}: {e}"))?;
    match fast_hf(&json, &tokenizer, cache_name_of(&text)) {
        Ok(fast) => Ok(Model::Fast(fast)),
        Err(why) => {
            tracing::info!(
                path,
                why,
                "the tokenizer is encoded whole by the tokenizers crate (slower: BENCHMARKS.md)"
            );
            Ok(Model::Hf(Box::new(tokenizer)))
        }
    }
}

/// The fast path for a `tokenizer.json`, or why not: no
/// normalizer; a `Split` of one of [`Pattern`]'s regexes, isolated, then `ByteLevel`
/// without its own regex; a BPE model; added tokens matched as written (no stripping,
/// not single words); and the same ids as the `tokenizers` crate on a probe text that
/// exercises every kind of piece.
fn fast_hf(
    json: &serde_json::Value,
    tokenizer: &tokenizers::Tokenizer,
    cache: u64,
) -> Result<Fast, String> {
    if !json["normalizer"].is_null() {
        return Err("it has a normalizer".into());
    }
    if json["model"]["type"] != "BPE" {
        return Err("its model is not BPE".into());
    }
    let pre = &json["pre_tokenizer"];
    let steps = pre["pretokenizers"].as_array().map(Vec::as_slice);
    let (split, byte_level) = match (pre["type"].as_str(), steps) {
        (Some("Sequence"), Some([split, byte_level])) => (split, byte_level),
        _ => return Err("its pre-tokenizer is not Split then ByteLevel".into()),
    };
    let pattern =
        (split["type"] == "Split" && split["behavior"] == "Isolated" && split["invert"] == false)
            .then(|| split["pattern"]["Regex"].as_str())
            .flatten()
            .and_then(Pattern::from_regex)
            .ok_or("its Split is not an isolated o200k or cl100k pattern")?;
    if byte_level["type"] != "ByteLevel"
        || byte_level["use_regex"] != false
        || byte_level["add_prefix_space"] == true
    {
        return Err("its ByteLevel step has a regex or adds a space".into());
    }
    // As the tokenizers crate numbers them (a file's ids outside the model's vocabulary
    // are renumbered on load).
    let mut added: Vec<(String, u32)> = Vec::new();
    for (id, t) in tokenizer.get_added_tokens_decoder() {
        if t.lstrip || t.rstrip || t.single_word {
            return Err("an added token strips spaces or must be a word".into());
        }
        added.push((t.content, id));
    }
    added.sort_by_key(|&(_, id)| id);
    let finder = aho_corasick::AhoCorasick::builder()
        .match_kind(aho_corasick::MatchKind::LeftmostLongest)
        .build(added.iter().map(|(c, _)| c))
        .map_err(|e| format!("its added tokens: {e}"))?;
    // What its post-processor puts around a completions prompt.
    let probe = "warmpath probe";
    let bare = hf_encode(tokenizer, probe, false);
    let full = hf_encode(tokenizer, probe, true);
    let at = (0..=full.len().saturating_sub(bare.len()))
        .find(|&i| full[i..].starts_with(&bare))
        .filter(|_| !bare.is_empty())
        .ok_or("its post-processor changes the prompt's own ids")?;
    let fast = Fast {
        bpe: Bpe::Hf(Box::new(tokenizer.clone())),
        pattern,
        cache,
        specials: Specials::Added {
            finder,
            ids: added.iter().map(|&(_, id)| id).collect(),
        },
        open: full[..at].to_vec(),
        close: full[at + bare.len()..].to_vec(),
    };
    let mut probe = String::from(
        "Hello, WORLD's 12345 don't\n\n  x\ttabs\r\n// code(); ünïcödé 世界 🦀 'LL  end  ",
    );
    if let Some((content, _)) = added.first() {
        probe.push_str(content);
        probe.push_str(" after");
    }
    for special in [true, false] {
        if fast.encode(&probe, special) != hf_encode(tokenizer, &probe, special) {
            return Err("warmpath's pieces give other ids than the tokenizers crate".into());
        }
    }
    Ok(fast)
}

/// Slots of a thread's piece cache, per encoding: a power of two, 64 bytes each (2 MiB).
pub const PIECE_CACHE_SLOTS: usize = 1 << 15;
/// The longest piece a slot holds, in bytes, and the most ids.
const SLOT_BYTES: usize = 22;
const SLOT_IDS: usize = 8;

/// One piece and its ids, in one cache line: a lookup reads one line of memory, where a
/// hash map of boxed strings read three (the router's caches are cold between requests on
/// a busy host).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Slot {
    hash: u64,
    /// 0: empty (pieces are never empty).
    len: u8,
    n: u8,
    bytes: [u8; SLOT_BYTES],
    ids: [u32; SLOT_IDS],
}

const EMPTY_SLOT: Slot = Slot {
    hash: 0,
    len: 0,
    n: 0,
    bytes: [0; SLOT_BYTES],
    ids: [0; SLOT_IDS],
};

/// A direct-mapped cache of pieces → ids: a new piece replaces the one in its slot.
/// Pieces longer than a slot are encoded every time.
struct PieceCache(Box<[Slot]>);

impl PieceCache {
    fn new() -> Self {
        PieceCache(vec![EMPTY_SLOT; PIECE_CACHE_SLOTS].into_boxed_slice())
    }

    /// The slot for `piece` and the piece's hash.
    fn slot(&mut self, piece: &[u8]) -> (&mut Slot, u64) {
        use std::hash::Hasher;
        let mut h = rustc_hash::FxHasher::default();
        h.write(piece);
        let hash = h.finish();
        // FxHash mixes into the high bits.
        let at = (hash >> (64 - PIECE_CACHE_SLOTS.trailing_zeros())) as usize;
        (&mut self.0[at], hash)
    }

    /// Appends the ids of `piece` to `out`, encoding it with `bpe` unless cached.
    fn encode(&mut self, bpe: &Bpe, piece: &str, out: &mut Vec<u32>) {
        let bytes = piece.as_bytes();
        if bytes.len() > SLOT_BYTES {
            out.extend(bpe.encode(bytes));
            return;
        }
        let (slot, hash) = self.slot(bytes);
        if slot.hash == hash
            && usize::from(slot.len) == bytes.len()
            && &slot.bytes[..bytes.len()] == bytes
        {
            out.extend_from_slice(&slot.ids[..usize::from(slot.n)]);
            return;
        }
        let ids = bpe.encode(bytes);
        out.extend_from_slice(&ids);
        if ids.len() <= SLOT_IDS {
            slot.hash = hash;
            slot.len = bytes.len() as u8;
            slot.n = ids.len() as u8;
            slot.bytes[..bytes.len()].copy_from_slice(bytes);
            slot.ids[..ids.len()].copy_from_slice(&ids);
        }
    }
}

impl Bpe {
    fn encode(&self, piece: &[u8]) -> Vec<u32> {
        match self {
            Bpe::OpenAi(t) => t.bpe.encode_via_backtracking(piece),
            Bpe::Hf(t) => {
                use tokenizers::Model as _;
                let spelled: String = piece.iter().map(|&b| byte_level_char(b)).collect();
                t.get_model()
                    .tokenize(&spelled)
                    .map(|tokens| tokens.iter().map(|t| t.id).collect())
                    .unwrap_or_default()
            }
        }
    }
}

/// The character byte-level BPE vocabularies (GPT-2's, and the `tokenizer.json` files of
/// models since) write byte `b` as: printable Latin-1 bytes as themselves, the others as
/// the characters from U+0100 on, in byte order.
pub fn byte_level_char(b: u8) -> char {
    static CHARS: std::sync::OnceLock<[char; 256]> = std::sync::OnceLock::new();
    CHARS.get_or_init(|| {
        let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
        let mut chars = ['\0'; 256];
        let mut next = 256;
        for b in 0..=255u8 {
            chars[usize::from(b)] = if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(next - 1).expect("below U+0200")
            };
        }
        chars
    })[usize::from(b)]
}

/// One [`Fast`] tokenizer's caches in one thread.
struct Caches {
    name: u64,
    pieces: PieceCache,
    segments: SegmentIds,
}

/// Tokenizers a thread keeps caches for, at most (each up to about 5 MiB): pools naming
/// the same encoding or file share one.
const CACHED_TOKENIZERS: usize = 8;

thread_local! {
    /// Made on first use, most recently used last; the least recently used goes when one
    /// more tokenizer comes.
    static CACHES: std::cell::RefCell<Vec<Caches>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Bytes between the cut points of the segment cache (each cut moved back to the nearest
/// exact boundary).
const SEGMENT_BYTES: usize = 512;

/// Segments a thread keeps, at most (each the ids of about `SEGMENT_BYTES` of text).
pub const SEGMENT_CACHE_ENTRIES: usize = 4096;

/// Chained hash of the text up to a segment's end → (the segment's length, its ids). The
/// hash names the whole text before the cut, so a segment is found again only after the
/// same preceding text: a shared prefix.
type SegmentIds = std::collections::HashMap<u64, (usize, Box<[u32]>)>;

/// Where `text` may be cut without changing its encoding: a space between two ASCII
/// letters. Both patterns end a letter run at a space and start the next piece there
/// (` word`), so the pieces, hence the ids, of the two sides are those of the whole.
fn is_cut(text: &[u8], at: usize) -> bool {
    at > 0
        && at + 1 < text.len()
        && text[at] == b' '
        && text[at - 1].is_ascii_alphabetic()
        && text[at + 1].is_ascii_alphabetic()
}

impl Fast {
    fn openai(
        bpe: &'static bpe_openai::Tokenizer,
        pattern: Pattern,
        cache: u64,
        specials: &'static [(&'static str, u32)],
    ) -> Fast {
        Fast {
            bpe: Bpe::OpenAi(bpe),
            pattern,
            cache,
            specials: Specials::OpenAi(specials),
            open: Vec::new(),
            close: Vec::new(),
        }
    }

    /// `text` encoded, each special token in it as its id, between [`Fast::open`] and
    /// [`Fast::close`] when `add_special_tokens`.
    fn encode(&self, mut text: &str, add_special_tokens: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        if add_special_tokens {
            out.extend_from_slice(&self.open);
        }
        CACHES.with(|all| {
            let mut all = all.borrow_mut();
            let at = match all.iter().position(|c| c.name == self.cache) {
                Some(at) => {
                    // Most recently used last (a no-op for the usual single tokenizer).
                    all[at..].rotate_left(1);
                    all.len() - 1
                }
                None => {
                    if all.len() >= CACHED_TOKENIZERS {
                        all.remove(0);
                    }
                    all.push(Caches {
                        name: self.cache,
                        pieces: PieceCache::new(),
                        segments: SegmentIds::new(),
                    });
                    all.len() - 1
                }
            };
            let caches = &mut all[at];
            while let Some((at, len, id)) = self.next_special(text) {
                self.encode_segments(&text[..at], caches, &mut out);
                out.push(id);
                text = &text[at + len..];
            }
            self.encode_segments(text, caches, &mut out);
        });
        if add_special_tokens {
            out.extend_from_slice(&self.close);
        }
        out
    }

    /// The first special token in `text`: (its offset, its length, its id).
    fn next_special(&self, text: &str) -> Option<(usize, usize, u32)> {
        match &self.specials {
            Specials::OpenAi(specials) => {
                memchr::memmem::find_iter(text.as_bytes(), SPECIAL_OPENER).find_map(|at| {
                    specials
                        .iter()
                        .find(|(s, _)| text[at..].starts_with(s))
                        .map(|&(s, id)| (at, s.len(), id))
                })
            }
            Specials::Added { finder, ids } => finder
                .find(text)
                .map(|m| (m.start(), m.len(), ids[m.pattern().as_usize()])),
        }
    }

    /// `text` encoded through the segment cache, then the piece cache: the text is cut
    /// about every [`SEGMENT_BYTES`] at exact boundaries, the leading segments found in the
    /// cache are taken as they are, and the rest is encoded and kept segment by segment. A
    /// shared prefix (a system prompt, a document, a conversation so far) is then not split
    /// or encoded again.
    fn encode_segments(&self, text: &str, caches: &mut Caches, out: &mut Vec<u32>) {
        let bytes = text.as_bytes();
        let mut cuts = Vec::new();
        let mut target = SEGMENT_BYTES;
        while target < bytes.len() {
            let floor = cuts.last().copied().unwrap_or(0);
            if let Some(at) = (floor + 1..=target)
                .rev()
                .take(64)
                .find(|&at| is_cut(bytes, at))
            {
                cuts.push(at);
            }
            target += SEGMENT_BYTES;
        }
        // Chained hashes: each cut's names the whole text before it.
        let mut keys = Vec::with_capacity(cuts.len());
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut from = 0;
        for &at in &cuts {
            h.update(&bytes[from..at]);
            keys.push(h.digest());
            from = at;
        }
        let mut start = 0;
        let mut found = 0;
        for (i, &at) in cuts.iter().enumerate() {
            match caches.segments.get(&keys[i]) {
                Some((len, ids)) if *len == at - start => {
                    out.extend_from_slice(ids);
                    start = at;
                    found += 1;
                }
                _ => break,
            }
        }
        for i in found..cuts.len() {
            let at = cuts[i];
            let before = out.len();
            self.encode_pieces(&text[start..at], &mut caches.pieces, out);
            if caches.segments.len() >= SEGMENT_CACHE_ENTRIES {
                caches.segments.clear();
            }
            caches
                .segments
                .insert(keys[i], (at - start, out[before..].into()));
            start = at;
        }
        self.encode_pieces(&text[start..], &mut caches.pieces, out);
    }

    /// `text` encoded piece by piece through the piece cache (the encodings do not
    /// normalize).
    fn encode_pieces(&self, text: &str, pieces: &mut PieceCache, out: &mut Vec<u32>) {
        pretokenize::for_each_piece(self.pattern, text, |piece| {
            pieces.encode(&self.bpe, piece, out)
        });
    }
}

/// Every special token of the OpenAI encodings starts so: one scan finds them all.
const SPECIAL_OPENER: &[u8] = b"<|";

impl Tokenize for PoolText {
    fn name(&self) -> &str {
        &self.name
    }

    fn completion(&self, text: &str) -> Vec<u32> {
        self.encode(text, true)
    }

    fn chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        let text = match &self.template {
            None => render_chat(messages),
            Some(env) => env
                .get_template("chat")
                .and_then(|t| {
                    t.render(minijinja::context! {
                        messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                        add_generation_prompt => true,
                        bos_token => &self.specials.bos_token,
                        eos_token => &self.specials.eos_token,
                    })
                })
                .map_err(|e| e.to_string())?,
        };
        Ok(self.encode(&text, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_encodings_give_tiktokens_ids() {
        let o200k = PoolText::load("tiktoken:o200k_base", "").unwrap();
        assert_eq!(o200k.completion("Hello, world!"), vec![13225, 11, 2375, 0]);
        let cl100k = PoolText::load("tiktoken:cl100k_base", "").unwrap();
        assert_eq!(cl100k.completion("Hello, world!"), vec![9906, 11, 1917, 0]);
        // A special token in the text is its id, not its spelling's pieces.
        let t = cl100k.completion("Hi<|endoftext|>Hi");
        assert_eq!(t, vec![13347, 100_257, 13347]);
        // A "<|" that opens no special token is text; the next one still counts.
        let plain = bpe_openai::cl100k_base().encode("a<|b ");
        let mut want = plain.clone();
        want.extend([100_276, 13347]);
        assert_eq!(cl100k.completion("a<|b <|endofprompt|>Hi"), want);
        for (s, _) in O200K_SPECIALS.iter().chain(CL100K_SPECIALS) {
            assert!(s.as_bytes().starts_with(SPECIAL_OPENER), "{s}");
        }
        assert_eq!(o200k.name(), "tiktoken:o200k_base");
        // The piece cache changes nothing: a long text, twice (the second time from the
        // cache), equals the crate's own uncached encoding.
        let text: String = (0..PIECE_CACHE_SLOTS / 4 + 10)
            .map(|i| format!("w{i} {}, ", warmpath_index::text::words(i as u64, 3)))
            .collect();
        let plain = bpe_openai::o200k_base().encode(text.as_str());
        assert_eq!(o200k.completion(&text), plain);
        assert_eq!(o200k.completion(&text), plain);
    }

    #[test]
    fn cached_segments_of_a_shared_prefix_change_no_id() {
        // Prompts sharing prefixes of every length, with text that tempts a wrong cut
        // (spaces runs, digits, punctuation, contractions, non-ASCII letters, newlines).
        let prefix: String = (0..400)
            .map(|i| match i % 7 {
                0 => format!("word{i} "),
                1 => "it's  done, ".to_string(),
                2 => "naïve café ".to_string(),
                3 => "x\n\n  y ".to_string(),
                4 => format!("{} ", i * 12345),
                5 => "Hello World ".to_string(),
                _ => "a b ".to_string(),
            })
            .collect();
        for encoding in ["tiktoken:o200k_base", "tiktoken:cl100k_base"] {
            let t = PoolText::load(encoding, "").unwrap();
            let plain = |s: &str| match encoding {
                "tiktoken:o200k_base" => bpe_openai::o200k_base().encode(s),
                _ => bpe_openai::cl100k_base().encode(s),
            };
            for (cut, tail) in [
                (prefix.len(), " tail one"),
                (3000, " other tail"),
                (1200, "zz"),
                (prefix.len(), " tail two"),
            ] {
                let mut end = cut.min(prefix.len());
                while !prefix.is_char_boundary(end) {
                    end -= 1;
                }
                let text = format!("{}{tail}", &prefix[..end]);
                assert_eq!(t.completion(&text), plain(&text), "{encoding}, cut {end}");
            }
        }
    }

    #[test]
    fn chat_templates_render_as_engines_do() {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}\
                      {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = PoolText::load("builtin", chatml).unwrap();
        let messages = [
            ChatMessage::text("system", "Be brief. "),
            ChatMessage::text("user", "Hi"),
        ];
        assert_eq!(
            t.chat(&messages).unwrap(),
            tokenize("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        );
        // Python string methods, as model templates call them.
        let py = PoolText::load("builtin", "{{ messages[0].content.strip().upper() }}").unwrap();
        assert_eq!(py.chat(&messages).unwrap(), tokenize("BE BRIEF."));
        // A template that refuses a conversation is an error, not a guess.
        let strict = PoolText::load(
            "builtin",
            "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}",
        )
        .unwrap();
        assert!(strict.chat(&messages).unwrap_err().contains("user first"));
        // No template: the built-in format.
        let plain = PoolText::load("", "").unwrap();
        assert_eq!(
            plain.chat(&messages).unwrap(),
            tokenize(&render_chat(&messages))
        );
    }

    #[test]
    fn bad_tokenizers_and_templates_are_clear_errors() {
        assert!(PoolText::load("tiktoken:p50k", "")
            .unwrap_err()
            .contains("tiktoken:o200k_base"));
        assert!(PoolText::load("hf:", "").is_err());
        assert!(PoolText::load("hf:/nonexistent/tokenizer.json", "")
            .unwrap_err()
            .contains("/nonexistent/tokenizer.json"));
        assert!(PoolText::load("", "{% for %}")
            .unwrap_err()
            .contains("chat template"));
        let huge = "x".repeat(MAX_TEMPLATE_BYTES + 1);
        assert!(PoolText::load("", &huge).unwrap_err().contains("at most"));
    }

    #[test]
    fn hugging_face_tokenizer_json_from_a_file() {
        // A word-level tokenizer.json with a BOS added by its post-processor, as Llama's.
        let json = r#"{
          "version": "1.0",
          "added_tokens": [
            {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 5, "content": "<|eot|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
          ],
          "normalizer": null,
          "pre_tokenizer": {"type": "Whitespace"},
          "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
          },
          "decoder": null,
          "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3, "user": 4, "<|eot|>": 5}, "unk_token": "<unk>"}
        }"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let t = PoolText::load(
            &format!("hf:{}", path.display()),
            "{% for m in messages %}{{ m.role }} {{ m.content }}<|eot|>{% endfor %}",
        )
        .unwrap();
        // Completions get the BOS; a rendered chat does not, and its added token is one id.
        assert_eq!(t.completion("hello world"), vec![0, 2, 3]);
        assert_eq!(
            t.chat(&[ChatMessage::text("user", "hello")]).unwrap(),
            vec![4, 2, 5]
        );
        assert!(!t.fast(), "a word-level tokenizer is encoded whole");
        // A template that writes bos_token gets the model's, from tokenizer_config.json.
        let template =
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}";
        let spec = format!("hf:{}", path.display());
        let t = PoolText::load(&spec, template).unwrap();
        assert_eq!(
            t.chat(&[ChatMessage::text("user", "hello")]).unwrap(),
            vec![2]
        );
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "<|eot|>"}"#,
        )
        .unwrap();
        let t = PoolText::load(&spec, template).unwrap();
        assert_eq!(
            t.chat(&[ChatMessage::text("user", "hello")]).unwrap(),
            vec![0, 2, 5]
        );
        std::fs::write(dir.path().join("tokenizer_config.json"), "{").unwrap();
        let err = PoolText::load(&spec, template).unwrap_err();
        assert!(err.contains("tokenizer_config.json"), "{err}");
    }

    /// A small byte-level BPE `tokenizer.json` with `pattern`, a BOS from its
    /// post-processor and two added tokens; `normalizer` as given.
    fn byte_level_bpe(pattern: &str, normalizer: serde_json::Value) -> String {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(byte_level_char(b).to_string(), b.into());
        }
        let spell = |s: &str| s.bytes().map(byte_level_char).collect::<String>();
        let merges = [
            ("h", "e"),
            ("l", "l"),
            ("he", "ll"),
            (" ", "w"),
            ("o", "r"),
            (" w", "or"),
            ("1", "2"),
        ];
        for (i, (a, b)) in merges.iter().enumerate() {
            vocab.insert(spell(&format!("{a}{b}")), (256 + i).into());
        }
        let merges: Vec<_> = merges.iter().map(|(a, b)| [spell(a), spell(b)]).collect();
        let added = |id: u32, content: &str| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        };
        serde_json::json!({
            "version": "1.0",
            "added_tokens": [added(263, "<|begin|>"), added(264, "<|eot_id|>")],
            "normalizer": normalizer,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
            ]},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|begin|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {"<|begin|>": {"id": "<|begin|>", "ids": [263], "tokens": ["<|begin|>"]}}
            },
            "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    #[test]
    fn byte_level_bpe_tokenizer_json_on_the_fast_path() {
        let dir = tempfile::tempdir().unwrap();
        let load = |name: &str, json: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, json).unwrap();
            let spec = format!("hf:{}", path.display());
            let whole = tokenizers::Tokenizer::from_file(&path).unwrap();
            (PoolText::load(&spec, "").unwrap(), whole)
        };
        let mut rng = warmpath_index::rng::Rng::new(5);
        let words = [
            "hello",
            " world",
            "12",
            "345",
            "  ",
            "\n",
            "Ünï",
            " 世界",
            "<|eot_id|>",
            "'ll",
            "HELLO",
            "\t",
            "//",
        ];
        let texts: Vec<String> = (0..300)
            .map(|_| {
                (0..rng.below(40))
                    .map(|_| words[rng.below(words.len() as u64) as usize])
                    .collect()
            })
            .collect();
        for (name, pattern) in [
            ("o200k.json", crate::pretokenize::O200K_REGEX),
            ("llama3.json", crate::pretokenize::CL100K_REGEX),
        ] {
            let (fast, whole) = load(name, byte_level_bpe(pattern, serde_json::Value::Null));
            assert!(fast.fast(), "{name}");
            // The fast path's ids are the tokenizers crate's: BOS, merges, added tokens.
            assert_eq!(
                fast.completion("hello world"),
                vec![263, 258, 111, 261, 108, 100]
            );
            for text in &texts {
                for special in [true, false] {
                    assert_eq!(
                        fast.encode(text, special),
                        hf_encode(&whole, text, special),
                        "{name} {text:?}"
                    );
                }
            }
        }
        // A normalizer, or another pattern, keeps the tokenizer off the fast path.
        let nfc = serde_json::json!({"type": "NFC"});
        let (t, _) = load(
            "nfc.json",
            byte_level_bpe(crate::pretokenize::O200K_REGEX, nfc),
        );
        assert!(!t.fast());
        let (t, whole) = load(
            "other.json",
            byte_level_bpe("\\s+|\\S+", serde_json::Value::Null),
        );
        assert!(!t.fast());
        assert_eq!(
            t.completion("hello world"),
            hf_encode(&whole, "hello world", true)
        );
    }
}
