//! The built-in tokenizer and prompt rendering, shared by the router and the engine
//! simulator so that one prompt gives the same token ids, hence the same block keys, on
//! both sides.
//!
//! Tokenizer: the text is cut into pieces, each piece a run of ASCII spaces followed by
//! either a run of alphanumeric characters (any script) or a single other character
//! (punctuation, a newline, an emoji). Trailing spaces form their own piece. A piece's id
//! is the 32-bit FNV-1a hash of its UTF-8 bytes modulo [`VOCAB`]. So `"Hello, world"` is
//! `["Hello", ",", " world"]`: English prose gives about one token per word, like a real
//! BPE vocabulary within a factor of 1.5, and the same text always gives the same ids.
//!
//! Chat rendering: each message becomes `<|role|>\n{content}\n`, and a final
//! `<|assistant|>\n` asks for the answer. Real engines apply the model's own template;
//! warmpath renders chat requests this way when it hashes them in text or token mode.
//!
//! [`words`] produces deterministic pseudo-words (one token each) for load generators:
//! equal seeds, equal text.

use crate::rng::Rng;

/// Size of the built-in vocabulary: ids are in `[0, VOCAB)`.
pub const VOCAB: u32 = 50_000;

/// FNV-1a's offset basis and prime (32-bit), the hash of a piece.
const FNV_OFFSET: u32 = 0x811c_9dc5;
const FNV_PRIME: u32 = 0x0100_0193;

/// One FNV-1a step: the hash `h` of a piece so far, then `byte`.
#[inline(always)]
fn fnv_step(h: u32, byte: u8) -> u32 {
    (h ^ u32::from(byte)).wrapping_mul(FNV_PRIME)
}

/// Token ids of `text` under the built-in tokenizer.
///
/// The router runs this on every prompt; [`for_each_piece`] is the plain definition, and
/// tests hold both paths equal to it. ASCII text (most prompts) takes [`tokenize_ascii`];
/// any other text one pass over the bytes that hashes each piece as it finds its end.
pub fn tokenize(text: &str) -> Vec<u32> {
    if text.is_ascii() {
        return tokenize_ascii(text.as_bytes());
    }
    tokenize_utf8(text)
}

/// Class bits of an ASCII byte for [`tokenize_ascii`]: alphanumeric (bit 0), space (bit 1).
const ALNUM: u8 = 1;
const SPACE: u8 = 2;
const ASCII_CLASS: [u8; 256] = {
    let mut class = [0u8; 256];
    let mut c = 0;
    while c < 256 {
        let byte = c as u8;
        class[c] = if byte.is_ascii_alphanumeric() {
            ALNUM
        } else if byte == b' ' {
            SPACE
        } else {
            0
        };
        c += 1;
    }
    class
};

/// [`tokenize`] of ASCII text, in two passes so that the CPU overlaps the pieces' hashes:
/// first where each piece starts (no branch per byte), then each piece's FNV-1a, for pieces
/// of up to 8 bytes with a fixed number of steps (no branch on its length). In one pass
/// every piece ended in a mispredicted branch, and the next piece's hash waited for it.
fn tokenize_ascii(b: &[u8]) -> Vec<u32> {
    /// Piece starts found per round: the buffer stays in the L1 cache.
    const ROUND: usize = 1024;
    let n = b.len();
    let mut ids = Vec::with_capacity(n / 4 + 1);
    if n == 0 {
        return ids;
    }
    // A piece starts at 0, and at i > 0 unless the byte before is a space (spaces lead the
    // piece after them) or both bytes are alphanumeric (one run). `starts[..count]` are the
    // starts not yet hashed; the last of them begins the piece still open.
    let mut starts = [0u32; ROUND + 1];
    let mut count = 1;
    let mut prev = ASCII_CLASS[usize::from(b[0])];
    let mut i = 1;
    while i < n {
        // Each byte adds at most one start: stop before the buffer could overflow.
        let stop = (i + ROUND - count).min(n);
        for (at, &c) in b[i..stop].iter().enumerate() {
            let class = ASCII_CLASS[usize::from(c)];
            starts[count] = (i + at) as u32;
            // Not a start after a space, nor inside an alphanumeric run.
            let joined = (prev & SPACE) >> 1 | (prev & class & ALNUM);
            count += usize::from(joined ^ 1);
            prev = class;
        }
        i = stop;
        hash_pieces(b, &starts[..count], &mut ids);
        starts[0] = starts[count - 1];
        count = 1;
    }
    starts[1] = n as u32;
    hash_pieces(b, &starts[..2], &mut ids);
    ids
}

/// Pushes the id of each piece `bounds[k]..bounds[k + 1]` of `b`.
fn hash_pieces(b: &[u8], bounds: &[u32], ids: &mut Vec<u32>) {
    for w in bounds.windows(2) {
        let (start, end) = (w[0] as usize, w[1] as usize);
        let h = match b.get(start..start + 8) {
            // Up to 8 bytes in 8 steps, each kept only before the piece's end: the same
            // work for every short piece, so nothing waits on a branch.
            Some(eight) if end - start <= 8 => {
                let word = u64::from_le_bytes(eight.try_into().expect("8 bytes"));
                let mut h = FNV_OFFSET;
                for j in 0..8 {
                    let next = fnv_step(h, (word >> (8 * j)) as u8);
                    h = if j < end - start { next } else { h };
                }
                h
            }
            _ => b[start..end]
                .iter()
                .fold(FNV_OFFSET, |h, &byte| fnv_step(h, byte)),
        };
        ids.push(h % VOCAB);
    }
}

/// [`tokenize`] of any UTF-8 text: one pass over the bytes.
fn tokenize_utf8(text: &str) -> Vec<u32> {
    const OFFSET: u32 = FNV_OFFSET;
    let step = fnv_step;
    let b = text.as_bytes();
    let n = b.len();
    let mut ids = Vec::with_capacity(n / 4 + 1);
    let mut i = 0;
    let mut h = OFFSET;
    while i < n {
        while i < n && b[i] == b' ' {
            h = step(h, b' ');
            i += 1;
        }
        if i == n {
            ids.push(h % VOCAB);
            break;
        }
        let (alnum, width) = char_at(text, i);
        for &byte in &b[i..i + width] {
            h = step(h, byte);
        }
        i += width;
        if alnum {
            while i < n {
                let byte = b[i];
                if byte < 0x80 {
                    if !byte.is_ascii_alphanumeric() {
                        break;
                    }
                    h = step(h, byte);
                    i += 1;
                } else {
                    let (alnum, width) = char_at(text, i);
                    if !alnum {
                        break;
                    }
                    for &byte in &b[i..i + width] {
                        h = step(h, byte);
                    }
                    i += width;
                }
            }
        }
        ids.push(h % VOCAB);
        h = OFFSET;
    }
    ids
}

/// Number of tokens of `text`, without allocating the ids.
pub fn count_tokens(text: &str) -> usize {
    let mut n = 0;
    for_each_piece(text, |_| n += 1);
    n
}

/// The id of one piece: FNV-1a 32 modulo [`VOCAB`] (the definition [`tokenize`] follows).
#[cfg(test)]
fn piece_id(piece: &str) -> u32 {
    piece.bytes().fold(FNV_OFFSET, fnv_step) % VOCAB
}

fn for_each_piece<'t>(text: &'t str, mut f: impl FnMut(&'t str)) {
    // Byte-wise with an ASCII fast path: prompts are mostly ASCII, and decoding every
    // character was most of the router's per-request work.
    let b = text.as_bytes();
    let n = b.len();
    let mut start = 0;
    let mut i = 0;
    while i < n {
        // Leading spaces join the piece that follows them.
        while i < n && b[i] == b' ' {
            i += 1;
        }
        if i == n {
            f(&text[start..]);
            return;
        }
        let (first_alnum, width) = char_at(text, i);
        i += width;
        if first_alnum {
            while i < n {
                let (alnum, width) = char_at(text, i);
                if !alnum {
                    break;
                }
                i += width;
            }
        }
        f(&text[start..i]);
        start = i;
    }
}

/// Whether the character at byte `i` is alphanumeric, and its UTF-8 width.
#[inline]
fn char_at(text: &str, i: usize) -> (bool, usize) {
    let byte = text.as_bytes()[i];
    if byte < 0x80 {
        return (byte.is_ascii_alphanumeric(), 1);
    }
    match text[i..].chars().next() {
        Some(c) => (c.is_alphanumeric(), c.len_utf8()),
        None => (false, 1),
    }
}

/// One message of a chat request, as OpenAI's clients send it: `content` a string, a list
/// of parts (`{"type": "text", "text": …}`, images and others) or null (an assistant
/// message that only calls tools); `tool_calls` on assistant messages, `tool_call_id` on
/// tool results, an optional `name`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A message's `content`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    /// Parts, each an object with a `type`; text parts carry `text`.
    Parts(Vec<serde_json::Value>),
}

impl ChatMessage {
    /// A message with text content.
    pub fn text(role: &str, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: Some(Content::Text(content.into())),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// The prompt text of a chat request (see the module docs). Text parts render as their
/// text; any other part (an image, audio) as its type and its canonical JSON, so two
/// different images never render alike; tool calls and tool results render with their
/// ids and arguments.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::with_capacity(256);
    for m in messages {
        out.push_str("<|");
        out.push_str(&m.role);
        if let Some(name) = &m.name {
            out.push(' ');
            out.push_str(name);
        }
        if let Some(id) = &m.tool_call_id {
            out.push_str(" tool_call_id=");
            out.push_str(id);
        }
        out.push_str("|>\n");
        match &m.content {
            None => {}
            Some(Content::Text(t)) => out.push_str(t),
            Some(Content::Parts(parts)) => {
                for part in parts {
                    match (part.get("type").and_then(|t| t.as_str()), part.get("text")) {
                        (Some("text"), Some(serde_json::Value::String(t))) => out.push_str(t),
                        (kind, _) => {
                            out.push_str("<|");
                            out.push_str(kind.unwrap_or("part"));
                            out.push_str("|>");
                            out.push_str(&part.to_string());
                        }
                    }
                }
            }
        }
        for call in m.tool_calls.iter().flatten() {
            out.push_str("\n<|tool_call|>");
            out.push_str(&call.to_string());
        }
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    out
}

/// How prompts become token ids: the built-in tokenizer and chat rendering, or a model's
/// own (a router's pool naming its engines' tokenizer and chat template; engine-sim acting
/// as such an engine). Completions and chat differ as engines make them differ: a chat
/// request is rendered by a template first, and a tokenizer may add special tokens (a BOS)
/// to a completions prompt but not to a rendered chat, whose template writes its own.
pub trait Tokenize: Send + Sync {
    /// What it is, for logs and explanations (`builtin`, `tiktoken:o200k_base`, …).
    fn name(&self) -> &str;
    /// Token ids of a completions prompt.
    fn completion(&self, text: &str) -> Vec<u32>;
    /// Token ids of a chat request's messages, rendered; an error when the template fails
    /// on them (a template may refuse a conversation, as engines' templates do).
    fn chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String>;
}

/// The built-in tokenizer ([`tokenize`]) and chat format ([`render_chat`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Builtin;

impl Tokenize for Builtin {
    fn name(&self) -> &str {
        "builtin"
    }
    fn completion(&self, text: &str) -> Vec<u32> {
        tokenize(text)
    }
    fn chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        Ok(tokenize(&render_chat(messages)))
    }
}

/// A shared [`Tokenize`], compared and shown by name.
#[derive(Clone)]
pub struct Tokenizer(pub std::sync::Arc<dyn Tokenize>);

impl Tokenizer {
    /// The built-in one: one shared instance, so that asking for it (a router does, for
    /// every request of a pool without a tokenizer of its own) allocates nothing.
    pub fn builtin() -> Self {
        static BUILTIN: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
        BUILTIN
            .get_or_init(|| Tokenizer(std::sync::Arc::new(Builtin)))
            .clone()
    }
}

impl Default for Tokenizer {
    fn default() -> Self {
        Tokenizer::builtin()
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Tokenizer").field(&self.0.name()).finish()
    }
}

impl PartialEq for Tokenizer {
    fn eq(&self, other: &Self) -> bool {
        self.0.name() == other.0.name()
    }
}

const SYLLABLES: [&str; 32] = [
    "ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pa", "do", "fe", "gu", "ha", "ji", "ko",
    "la", "mo", "nu", "pi", "qua", "ri", "so", "tu", "va", "we", "xi", "yo", "ze", "bra", "cre",
    "dro",
];

/// `n` pseudo-words drawn from `seed`, each with a leading space, so each is one token.
pub fn words(seed: u64, n: usize) -> String {
    let mut rng = Rng::new(seed);
    let mut out = String::with_capacity(n * 7);
    for _ in 0..n {
        out.push(' ');
        for _ in 0..rng.range(1, 3) {
            out.push_str(SYLLABLES[rng.below(SYLLABLES.len() as u64) as usize]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for_each_piece(text, |p| out.push(p));
        out
    }

    #[test]
    fn pieces_cases() {
        let cases: &[(&str, &[&str])] = &[
            ("Hello, world", &["Hello", ",", " world"]),
            ("  two  spaces ", &["  two", "  spaces", " "]),
            ("a\nb", &["a", "\n", "b"]),
            ("", &[]),
            ("   ", &["   "]),
            ("naïve 東京 ok!", &["naïve", " 東京", " ok", "!"]),
            ("x1 y2", &["x1", " y2"]),
        ];
        for (text, want) in cases {
            assert_eq!(pieces(text), *want, "{text:?}");
            assert_eq!(count_tokens(text), want.len());
            // Pieces cover the text exactly.
            assert_eq!(pieces(text).concat(), *text);
        }
    }

    /// The ids of `text` by the definition: each piece of [`for_each_piece`], hashed.
    fn reference(text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        for_each_piece(text, |p| ids.push(piece_id(p)));
        ids
    }

    #[test]
    fn fast_tokenize_matches_the_definition() {
        let mut rng = Rng::new(11);
        let alphabet = [
            "a", "Z", "9", " ", "  ", ",", "\n", "é", "東", "🙂", "x1", "-", "ß", "\t",
        ];
        for _ in 0..2000 {
            let len = rng.below(30) as usize;
            let text: String = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize])
                .collect();
            let want = reference(&text);
            assert_eq!(tokenize(&text), want, "{text:?}");
        }
    }

    #[test]
    fn both_paths_match_the_definition_on_ascii_and_beyond() {
        let mut rng = Rng::new(12);
        let ascii = [
            "a",
            "Z",
            "9",
            " ",
            "  ",
            ",",
            "\n",
            "x1",
            "-",
            "\t",
            "abcdefghij",
            "0123456789ab",
            "The",
            " quick",
            ".",
            "!?",
        ];
        for round in 0..4000 {
            let len = rng.below(40) as usize;
            let mut text: String = (0..len)
                .map(|_| ascii[rng.below(ascii.len() as u64) as usize])
                .collect();
            if round % 2 == 1 {
                text.push('é');
            }
            let want = reference(&text);
            assert_eq!(tokenize(&text), want, "{text:?}");
            assert_eq!(tokenize_utf8(&text), want, "{text:?}");
        }
        // Long texts cross the ASCII path's rounds of piece starts.
        for len in [1023, 1024, 1025, 3000, 20_000] {
            let text: String = (0..len)
                .map(|_| ascii[rng.below(ascii.len() as u64) as usize])
                .collect();
            let want = reference(&text);
            assert_eq!(tokenize(&text), want, "{len} pieces");
        }
        let one_piece = "x".repeat(5000) + " ";
        let want = reference(&one_piece);
        assert_eq!(tokenize(&one_piece), want);
    }

    #[test]
    fn ids_are_stable() {
        // FNV-1a 32 of "Hello" is 0xf55c314b, of " world" 0x208795dd (Python reference).
        assert_eq!(
            tokenize("Hello world"),
            vec![0xf55c_314b % VOCAB, 0x2087_95dd % VOCAB]
        );
        assert_eq!(tokenize("Hello world"), tokenize("Hello world"));
        assert_ne!(tokenize("Hello world"), tokenize("Hello  world"));
        assert!(tokenize("some text here").iter().all(|&t| t < VOCAB));
    }

    #[test]
    fn words_are_one_token_each_and_seeded() {
        let w = words(7, 100);
        assert_eq!(count_tokens(&w), 100);
        assert_eq!(w, words(7, 100));
        assert_ne!(w, words(8, 100));
        // Concatenated word runs tokenize as the sum of their parts.
        let joined = format!("{}{}", words(1, 10), words(2, 5));
        assert_eq!(
            tokenize(&joined),
            [tokenize(&words(1, 10)), tokenize(&words(2, 5))].concat()
        );
    }

    #[test]
    fn chat_rendering() {
        let m = ChatMessage::text;
        assert_eq!(
            render_chat(&[m("system", "be brief"), m("user", "hi")]),
            "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
        );
        assert_eq!(render_chat(&[]), "<|assistant|>\n");
        // Parts, a tool call with null content, and its result, as OpenAI's clients send.
        let parsed: Vec<ChatMessage> = serde_json::from_str(
            r#"[{"role":"user","content":[{"type":"text","text":"look: "},
                  {"type":"image_url","image_url":{"url":"http://x/a.png"}}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                  "function":{"name":"f","arguments":"{}"}}]},
                {"role":"tool","tool_call_id":"c1","content":"42"}]"#,
        )
        .expect("parses");
        let text = render_chat(&parsed);
        assert!(text.starts_with("<|user|>\nlook: <|image_url|>{"), "{text}");
        assert!(text.contains("http://x/a.png"), "{text}");
        assert!(text.contains("<|assistant|>\n\n<|tool_call|>{"), "{text}");
        assert!(text.contains("<|tool tool_call_id=c1|>\n42\n"), "{text}");
        // Plain text and a single text part render alike.
        let part: Vec<ChatMessage> =
            serde_json::from_str(r#"[{"role":"user","content":[{"type":"text","text":"hi"}]}]"#)
                .expect("parses");
        assert_eq!(render_chat(&part), render_chat(&[m("user", "hi")]));
    }
}
