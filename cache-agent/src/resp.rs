//! Redis's wire protocol (RESP2), as much of it as the Redis L2 backend speaks: commands
//! written from borrowed slices, and a reader for the four kinds of reply those commands
//! get (simple strings, errors, integers, bulk strings).
//!
//! Why our own: the `redis` crate builds each command in a buffer of its own and packs it
//! again for the socket, so every block written to Redis was copied three times in user
//! space (issue 24). Here a `SET`'s last argument is never joined: [`command_head`] writes
//! the bytes before it, and the caller sends the head, the block's header and its payload
//! as they are, in one vectored write ([`crate::io::write_all_vectored`]). A `GET`'s
//! bulk string is read straight into a buffer of its own, one copy out of the kernel.
//!
//! The reader trusts nothing it reads: a line is at most [`MAX_LINE`] bytes, a bulk string
//! at most the caller's limit (and memory for it grows as its bytes arrive beyond
//! [`PREALLOC_MAX`], so a declared length is not an allocation), and a reply of another
//! kind (arrays, RESP3 types: never an answer to these commands) is a [`RespError`], after
//! which the connection is dropped. Nothing a peer sends makes it panic (proptest below).
//!
//! Encoding and [`parse_head`] are pure; [`read_reply`] reads from any buffered reader.

use bytes::Bytes;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

/// The longest reply line accepted (type byte, text, CRLF).
pub const MAX_LINE: usize = 64 << 10;
/// The most memory a bulk string's declared length reserves before its bytes arrive.
pub const PREALLOC_MAX: usize = 64 << 20;

/// Why a reply was not read.
#[derive(Debug, thiserror::Error)]
pub enum RespError {
    #[error("redis connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("redis protocol: {0}")]
    Protocol(String),
    #[error("redis bulk string of {0} bytes is over the limit of {1}")]
    TooLong(u64, usize),
}

impl RespError {
    fn protocol(what: impl Into<String>) -> Self {
        RespError::Protocol(what.into())
    }
}

/// A reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `+OK` and the like.
    Simple(String),
    /// `-ERR …`: the server refused the command (the connection stays usable).
    Error(String),
    Integer(i64),
    /// A bulk string; None is Redis's null (`$-1`: no such key).
    Bulk(Option<Bytes>),
}

/// A reply's first line, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Head {
    Simple(String),
    Error(String),
    Integer(i64),
    /// A bulk string of this many bytes follows (then CRLF); None: null.
    Bulk(Option<u64>),
}

/// Appends the whole command `args` to `out` (pipelining: several commands may go into one
/// buffer and one write).
pub fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    array_len(out, args.len());
    for a in args {
        bulk_len(out, a.len());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// The bytes of a command of `args` and a last argument of `last_len` bytes, up to that
/// argument's bytes: the caller writes them, then [`CRLF`].
pub fn command_head(args: &[&[u8]], last_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    array_len(&mut out, args.len() + 1);
    for a in args {
        bulk_len(&mut out, a.len());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    bulk_len(&mut out, last_len);
    out
}

/// What ends a bulk argument.
pub const CRLF: &[u8] = b"\r\n";

fn array_len(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(CRLF);
}

fn bulk_len(out: &mut Vec<u8>, n: usize) {
    out.push(b'$');
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(CRLF);
}

/// Parses a reply's first line, `line` without its CRLF.
pub fn parse_head(line: &[u8]) -> Result<Head, RespError> {
    let Some((&kind, rest)) = line.split_first() else {
        return Err(RespError::protocol("empty reply line"));
    };
    let text = || {
        std::str::from_utf8(rest)
            .map(str::to_owned)
            .map_err(|_| RespError::protocol("reply line is not UTF-8"))
    };
    let int = || -> Result<i64, RespError> {
        std::str::from_utf8(rest)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .ok_or_else(|| RespError::protocol("integer expected"))
    };
    match kind {
        b'+' => Ok(Head::Simple(text()?)),
        b'-' => Ok(Head::Error(text()?)),
        b':' => Ok(Head::Integer(int()?)),
        b'$' => match int()? {
            -1 => Ok(Head::Bulk(None)),
            n if n < 0 => Err(RespError::protocol(format!("bulk length {n}"))),
            n => Ok(Head::Bulk(Some(n as u64))),
        },
        other => Err(RespError::protocol(format!(
            "unexpected reply type {:?}",
            other as char
        ))),
    }
}

/// Reads one reply; a bulk string longer than `max_bulk` bytes is refused unread (the
/// caller drops the connection: the stream is no longer in step).
pub async fn read_reply<R: AsyncBufRead + Unpin>(
    rd: &mut R,
    max_bulk: usize,
) -> Result<Reply, RespError> {
    let mut line = Vec::new();
    (&mut *rd)
        .take(MAX_LINE as u64)
        .read_until(b'\n', &mut line)
        .await?;
    if line.is_empty() {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    let Some(line) = line.strip_suffix(CRLF) else {
        return Err(RespError::protocol(if line.len() >= MAX_LINE {
            "reply line too long"
        } else {
            "reply line cut short"
        }));
    };
    match parse_head(line)? {
        Head::Simple(s) => Ok(Reply::Simple(s)),
        Head::Error(s) => Ok(Reply::Error(s)),
        Head::Integer(i) => Ok(Reply::Integer(i)),
        Head::Bulk(None) => Ok(Reply::Bulk(None)),
        Head::Bulk(Some(n)) => {
            if n > max_bulk as u64 {
                return Err(RespError::TooLong(n, max_bulk));
            }
            let n = n as usize;
            let mut buf = Vec::with_capacity(n.min(PREALLOC_MAX));
            while buf.len() < n {
                // Into spare capacity (never zeroed first); past the first reservation the
                // Vec grows as the bytes arrive.
                buf.reserve((n - buf.len()).min(PREALLOC_MAX));
                let want = (n - buf.len()) as u64;
                if (&mut *rd).take(want).read_buf(&mut buf).await? == 0 {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                }
            }
            let mut end = [0u8; 2];
            rd.read_exact(&mut end).await?;
            if end != *CRLF {
                return Err(RespError::protocol("bulk string not followed by CRLF"));
            }
            Ok(Reply::Bulk(Some(Bytes::from(buf))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read(bytes: &[u8], max_bulk: usize) -> Result<Reply, RespError> {
        crate::test_runtime().block_on(async {
            // A small buffer, so that lines and bulk strings cross buffer refills.
            let mut rd = tokio::io::BufReader::with_capacity(7, bytes);
            read_reply(&mut rd, max_bulk).await
        })
    }

    #[test]
    fn commands_are_written_as_redis_reads_them() {
        let mut out = Vec::new();
        command(&mut out, &[b"EXISTS", b"k1"]);
        command(&mut out, &[b"DEL", b""]);
        assert_eq!(
            out,
            b"*2\r\n$6\r\nEXISTS\r\n$2\r\nk1\r\n*2\r\n$3\r\nDEL\r\n$0\r\n\r\n"
        );
        let mut set = command_head(&[b"SET", b"key"], 5);
        set.extend_from_slice(b"va");
        set.extend_from_slice(b"lue");
        set.extend_from_slice(CRLF);
        let mut whole = Vec::new();
        command(&mut whole, &[b"SET", b"key", b"value"]);
        assert_eq!(set, whole);
    }

    #[test]
    fn replies_read_back() {
        let check = |bytes: &[u8], want: Reply| assert_eq!(read(bytes, 100).unwrap(), want);
        check(b"+OK\r\n", Reply::Simple("OK".into()));
        check(
            b"-OOM command not allowed\r\n",
            Reply::Error("OOM command not allowed".into()),
        );
        check(b":3\r\n", Reply::Integer(3));
        check(b":-2\r\n", Reply::Integer(-2));
        check(b"$-1\r\n", Reply::Bulk(None));
        check(b"$0\r\n\r\n", Reply::Bulk(Some(Bytes::new())));
        check(
            b"$12\r\nhello\r\nworld\r\n",
            Reply::Bulk(Some(Bytes::from_static(b"hello\r\nworld"))),
        );
    }

    #[test]
    fn bad_replies_are_errors() {
        let bad = |bytes: &[u8]| {
            let got = read(bytes, 100);
            assert!(got.is_err(), "{bytes:?} read as {got:?}");
        };
        bad(b"");
        bad(b"+OK");
        bad(b"+OK\n");
        bad(b"*1\r\n:1\r\n");
        bad(b"_\r\n");
        bad(b":x\r\n");
        bad(b":\r\n");
        bad(b"$-2\r\n");
        bad(b"$5\r\nabc");
        bad(b"$3\r\nabcde");
        bad(b"$101\r\n");
        bad(b"$99999999999999999999\r\n");
        bad(b"+\xff\r\n");
        let long = [b"+".as_slice(), &vec![b'a'; MAX_LINE], b"\r\n"].concat();
        bad(&long);
    }

    proptest! {
        /// Whatever a peer sends, the reader answers a reply or an error, never a panic,
        /// and never reads a bulk string over its limit.
        #[test]
        fn any_bytes_are_a_reply_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(Reply::Bulk(Some(b))) = read(&bytes, 16) {
                prop_assert!(b.len() <= 16);
            }
        }

        /// Replies built from RESP's own grammar, then cut or flipped anywhere: still no
        /// panic; whole ones read back as they were written.
        #[test]
        fn replies_cut_or_flipped(
            kind in 0u8..4,
            body in proptest::collection::vec(any::<u8>(), 0..40),
            n in any::<i64>(),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let text: String = body.iter().map(|b| (b'a' + b % 26) as char).collect();
            let (wire, want) = match kind {
                0 => (format!("+{text}\r\n").into_bytes(), Reply::Simple(text)),
                1 => (format!("-{text}\r\n").into_bytes(), Reply::Error(text)),
                2 => (format!(":{n}\r\n").into_bytes(), Reply::Integer(n)),
                _ => {
                    let mut w = format!("${}\r\n", body.len()).into_bytes();
                    w.extend_from_slice(&body);
                    w.extend_from_slice(CRLF);
                    (w, Reply::Bulk(Some(Bytes::from(body.clone()))))
                }
            };
            prop_assert_eq!(read(&wire, 64).unwrap(), want);
            let _ = read(&wire[..cut.index(wire.len())], 64);
            let mut flipped = wire.clone();
            let at = flip.index(flipped.len());
            flipped[at] ^= 0x5a;
            let _ = read(&flipped, 64);
        }
    }
}
