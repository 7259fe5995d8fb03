//! Server-sent events (the `text/event-stream` of a streamed OpenAI response) read from
//! body chunks as they arrive, cut at any byte: inside a line, between `\r` and `\n`, with
//! several events in one chunk or one event over many.

use std::fmt;

/// A server-sent event larger than this is malformed by default (a stream that never sends
/// a blank line would otherwise grow the buffer without bound).
pub const MAX_EVENT_BYTES: usize = 8 << 20;

/// An incremental server-sent-event reader: feed it body chunks as they come, get the
/// `data` of each complete event. Lines end with `\n` or `\r\n`; an event ends at a blank
/// line; several `data:` lines of one event are joined with `\n`; comments (`:`) and other
/// fields (`event:`, `id:`, `retry:`) are ignored. A line that arrives whole within one
/// chunk is read in place; only a line cut by a chunk boundary is copied.
#[derive(Debug)]
pub struct SseReader {
    /// The start of a line cut by the end of the last chunk.
    line: Vec<u8>,
    /// Data of the event being read.
    data: Vec<u8>,
    /// Whether the event being read has a `data` field (possibly empty).
    has_data: bool,
    /// Largest unfinished event, bytes.
    limit: usize,
}

/// Why an event stream is malformed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseError {
    /// An event grew past the reader's limit without ending.
    TooLarge {
        /// The limit, bytes.
        limit: usize,
    },
}

impl fmt::Display for SseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SseError::TooLarge { limit } => write!(f, "an event exceeds {limit} bytes"),
        }
    }
}

impl std::error::Error for SseError {}

impl Default for SseReader {
    fn default() -> Self {
        SseReader::with_limit(MAX_EVENT_BYTES)
    }
}

impl SseReader {
    /// A reader at the start of a stream, with the [`MAX_EVENT_BYTES`] limit.
    pub fn new() -> Self {
        SseReader::default()
    }

    /// A reader whose events may hold at most `limit` bytes.
    pub fn with_limit(limit: usize) -> Self {
        SseReader {
            line: Vec::new(),
            data: Vec::new(),
            has_data: false,
            limit,
        }
    }

    /// Feeds the next chunk of the stream; calls `on_event` with the data of each event it
    /// completes, in order. `Err` when the event being read grew past the limit (the events
    /// completed before it in this chunk have been delivered).
    pub fn push(&mut self, chunk: &[u8], mut on_event: impl FnMut(&[u8])) -> Result<(), SseError> {
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = (&rest[..nl], &rest[nl + 1..]);
            if self.line.is_empty() {
                self.line_done(head, &mut on_event);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                self.line_done(&line, &mut on_event);
                line.clear();
                self.line = line;
            }
            rest = tail;
        }
        self.line.extend_from_slice(rest);
        if self.line.len() + self.data.len() > self.limit {
            return Err(SseError::TooLarge { limit: self.limit });
        }
        Ok(())
    }

    /// Ends the stream: calls `on_event` with the data of an event left unterminated by a
    /// blank line, if any.
    pub fn finish(&mut self, mut on_event: impl FnMut(&[u8])) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, &mut on_event);
        }
        self.line_done(b"", &mut on_event);
    }

    /// One complete line, without its `\n` (a `\r` before it is dropped here).
    fn line_done(&mut self, line: &[u8], on_event: &mut impl FnMut(&[u8])) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            if self.has_data {
                on_event(&self.data);
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event of `pieces` fed in order, then the end of the stream.
    fn read(pieces: &[&[u8]]) -> Vec<String> {
        let mut r = SseReader::new();
        let mut got = Vec::new();
        let mut keep = |d: &[u8]| got.push(String::from_utf8_lossy(d).into_owned());
        for piece in pieces {
            r.push(piece, &mut keep).unwrap();
        }
        r.finish(&mut keep);
        got
    }

    /// Feeds `stream` cut at every position, at every pair of positions, and byte by byte;
    /// every way must give `expected`.
    fn check(stream: &str, expected: &[&str]) {
        let bytes = stream.as_bytes();
        let n = bytes.len();
        let mut cuts: Vec<Vec<&[u8]>> = Vec::new();
        for i in 0..=n {
            cuts.push(vec![&bytes[..i], &bytes[i..]]);
            for j in i..=n {
                cuts.push(vec![&bytes[..i], &bytes[i..j], &bytes[j..]]);
            }
        }
        cuts.push(bytes.chunks(1).collect());
        for pieces in cuts {
            assert_eq!(read(&pieces), expected, "{stream:?} cut as {pieces:?}");
        }
    }

    #[test]
    fn events_whatever_the_chunk_boundaries() {
        check("data: a\n\ndata: b\n\n", &["a", "b"]);
        // `\r\n` line ends, a boundary falling between `\r` and `\n` included.
        check("data: a\r\n\r\ndata:b\r\n\r\n", &["a", "b"]);
        check("data: one\ndata: two\n\n", &["one\ntwo"]);
        check(
            ": keep-alive\n\nevent: x\nid: 3\ndata: a\nretry: 5\n\n",
            &["a"],
        );
        check("event: ping\n\n\n\ndata\n\n", &[""]);
        // `[DONE]` is data like any other; a last event without its blank line ends with
        // the stream.
        check(
            "data: {\"a\": \"x: y\"}\n\ndata: [DONE]",
            &["{\"a\": \"x: y\"}", "[DONE]"],
        );
        check("data: [DONE]\n\n", &["[DONE]"]);
        check("data:  two spaces\n\n", &[" two spaces"]);
        check("", &[]);
    }

    #[test]
    fn several_events_in_one_chunk_come_in_order() {
        let stream = b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n";
        assert_eq!(read(&[stream]), ["1", "2", "[DONE]"]);
    }

    #[test]
    fn events_have_a_size_limit() {
        let mut r = SseReader::with_limit(16);
        let mut got = Vec::new();
        assert_eq!(r.push(b"data: ", |d| got.push(d.to_vec())), Ok(()));
        assert_eq!(r.push(b"0123456789", |d| got.push(d.to_vec())), Ok(()));
        let over = r.push(b"0123456789", |d| got.push(d.to_vec()));
        assert_eq!(over, Err(SseError::TooLarge { limit: 16 }));
        assert!(got.is_empty());
        assert_eq!(over.unwrap_err().to_string(), "an event exceeds 16 bytes");
        // The default limit.
        let mut r = SseReader::new();
        let big = vec![b'x'; MAX_EVENT_BYTES / 2 + 1];
        assert_eq!(r.push(b"data: ", |_| {}), Ok(()));
        assert_eq!(r.push(&big, |_| {}), Ok(()));
        assert!(r.push(&big, |_| {}).is_err());
    }
}
