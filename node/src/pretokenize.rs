//! The OpenAI encodings' pre-tokenizers on ASCII text, without a regular expression.
//!
//! BPE works on pieces: runs of letters with a leading space or punctuation mark, up to
//! three digits, punctuation runs, whitespace runs. `bpe-openai` cuts them with
//! tiktoken's patterns through a lazy DFA, which was half of a router's tokenizing time
//! on fresh text (BENCHMARKS.md, "Router added latency with a real tokenizer"). On ASCII
//! text every Unicode class of those patterns is a byte class, so the patterns reduce to
//! the few rules below, written out in the order the patterns try them (leftmost-first,
//! greedy, as the regex engine matches). Text with any other byte keeps the regex. A test
//! holds the pieces equal to the regex's on random text built from every byte class the
//! rules tell apart.

/// Which encoding's pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    O200k,
    Cl100k,
}

/// tiktoken's o200k pattern, as a Hugging Face `tokenizer.json` writes it.
pub const O200K_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// tiktoken's cl100k pattern, which Llama 3's `tokenizer.json` also uses.
pub const CL100K_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Pattern {
    /// The pattern a `tokenizer.json` regex spells, if it is one of these.
    pub fn from_regex(regex: &str) -> Option<Pattern> {
        match regex {
            O200K_REGEX => Some(Pattern::O200k),
            CL100K_REGEX => Some(Pattern::Cl100k),
            _ => None,
        }
    }

    /// `bpe-openai`'s tokenizer with this pattern, whose regex cuts non-ASCII text.
    fn regex(self) -> &'static bpe_openai::Tokenizer {
        match self {
            Pattern::O200k => bpe_openai::o200k_base(),
            Pattern::Cl100k => bpe_openai::cl100k_base(),
        }
    }
}

fn is_space(b: u8) -> bool {
    // `\s` on ASCII: tab, line feed, vertical tab, form feed, carriage return, space.
    matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ')
}

fn is_newline(b: u8) -> bool {
    b == b'\r' || b == b'\n'
}

/// `[^\r\n\p{L}\p{N}]`: what may lead a word.
fn leads_word(b: u8) -> bool {
    !is_newline(b) && !b.is_ascii_alphanumeric()
}

/// `[^\s\p{L}\p{N}]`: punctuation and control bytes.
fn is_other(b: u8) -> bool {
    !is_space(b) && !b.is_ascii_alphanumeric()
}

fn run(t: &[u8], from: usize, class: impl Fn(u8) -> bool) -> usize {
    from + t[from..].iter().take_while(|&&b| class(b)).count()
}

/// End of `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` at `at`.
fn contraction(t: &[u8], at: usize) -> usize {
    if t.get(at) != Some(&b'\'') {
        return at;
    }
    let lower = |i: usize| t.get(at + i).map(u8::to_ascii_lowercase);
    match (lower(1), lower(2)) {
        (Some(b's' | b't' | b'm' | b'd'), _) => at + 2,
        (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => at + 3,
        _ => at,
    }
}

/// Length of the piece that starts `t` (ASCII, not empty).
fn piece_len(pattern: Pattern, t: &[u8]) -> usize {
    let lead = usize::from(leads_word(t[0]));
    match pattern {
        Pattern::O200k => {
            // [^\r\n\p{L}\p{N}]?[\p{Lu}…]*[\p{Ll}…]+(contraction)?
            let upper = run(t, lead, |b| b.is_ascii_uppercase());
            let lower = run(t, upper, |b| b.is_ascii_lowercase());
            if lower > upper {
                return contraction(t, lower);
            }
            // [^\r\n\p{L}\p{N}]?[\p{Lu}…]+[\p{Ll}…]*(contraction)?: no lowercase follows.
            if upper > lead {
                return contraction(t, upper);
            }
        }
        Pattern::Cl100k => {
            // (?i:'s|'t|'re|'ve|'m|'ll|'d)
            let c = contraction(t, 0);
            if c > 0 {
                return c;
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            let letters = run(t, lead, |b| b.is_ascii_alphabetic());
            if letters > lead {
                return letters;
            }
        }
    }
    // \p{N}{1,3}
    if t[0].is_ascii_digit() {
        return run(t, 0, |b| b.is_ascii_digit()).min(3);
    }
    // ' ?[^\s\p{L}\p{N}]+', then [\r\n/]* (o200k) or [\r\n]* (cl100k)
    let space = usize::from(t[0] == b' ');
    let other = run(t, space, is_other);
    if other > space {
        return match pattern {
            Pattern::O200k => run(t, other, |b| is_newline(b) || b == b'/'),
            Pattern::Cl100k => run(t, other, is_newline),
        };
    }
    let spaces = run(t, 0, is_space);
    // \s*[\r\n]+: the whitespace up to its last line break.
    if let Some(last) = t[..spaces].iter().rposition(|&b| is_newline(b)) {
        return last + 1;
    }
    // \s+$
    if spaces == t.len() {
        return spaces;
    }
    // \s+\s with its look-ahead character given back, else \s+ (one character).
    if spaces >= 2 {
        spaces - 1
    } else {
        spaces
    }
}

/// Calls `f` with each piece of `text`: cut by the rules above when it is ASCII, by the
/// pattern's regex otherwise.
pub fn for_each_piece<'t>(pattern: Pattern, text: &'t str, f: impl FnMut(&'t str)) {
    if text.is_ascii() {
        ascii_pieces(pattern, text).for_each(f);
    } else {
        pattern.regex().split(text).for_each(f);
    }
}

/// The pieces of `text`, which must be ASCII.
fn ascii_pieces(pattern: Pattern, text: &str) -> impl Iterator<Item = &str> {
    debug_assert!(text.is_ascii());
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let n = piece_len(pattern, rest.as_bytes());
        let (piece, tail) = rest.split_at(n);
        rest = tail;
        Some(piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_equal_the_regexs_on_random_ascii() {
        // Every byte class the rules tell apart, with the letters of the contractions.
        let alphabet: &[u8] = b"aZsStTrReEvVlLmMdDxQ079 \t\n\r\x0b\x0c'./!-\x01\x7f_";
        let mut rng = warmpath_index::rng::Rng::new(11);
        for (pattern, bpe) in [
            (Pattern::O200k, bpe_openai::o200k_base()),
            (Pattern::Cl100k, bpe_openai::cl100k_base()),
        ] {
            for case in 0..40_000 {
                let len = rng.below(24) as usize;
                let text: String = (0..len)
                    .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize] as char)
                    .collect();
                let ours: Vec<&str> = ascii_pieces(pattern, &text).collect();
                let theirs: Vec<&str> = bpe.split(&text).collect();
                assert_eq!(ours, theirs, "{pattern:?} case {case}: {text:?}");
            }
        }
    }

    #[test]
    fn known_patterns_are_recognised() {
        assert_eq!(Pattern::from_regex(O200K_REGEX), Some(Pattern::O200k));
        assert_eq!(Pattern::from_regex(CL100K_REGEX), Some(Pattern::Cl100k));
        assert_eq!(Pattern::from_regex("\\s+"), None);
        assert!(O200K_REGEX.contains(r"\p{N}{1,3}| ?[^\s"));
    }

    #[test]
    fn pieces_of_plain_text() {
        let cases: &[(Pattern, &str, &[&str])] = &[
            (
                Pattern::O200k,
                "Hello, WORLD's 12345 don't\n\n  x",
                &[
                    "Hello", ",", " WORLD's", " ", "123", "45", " don't", "\n\n", " ", " x",
                ],
            ),
            (
                Pattern::Cl100k,
                "Hello, WORLD's 12345 don't\n\n  x",
                &[
                    "Hello", ",", " WORLD", "'s", " ", "123", "45", " don", "'t", "\n\n", " ", " x",
                ],
            ),
            (Pattern::O200k, "a//b/\n", &["a", "//", "b", "/\n"]),
            (Pattern::O200k, "tail   ", &["tail", "   "]),
            // Non-ASCII text goes through the regex.
            (Pattern::O200k, "Grüße, 世界", &["Grüße", ",", " 世界"]),
        ];
        for (pattern, text, want) in cases {
            let mut got = Vec::new();
            for_each_piece(*pattern, text, |p| got.push(p));
            assert_eq!(&got, want, "{pattern:?} {text:?}");
        }
    }
}
