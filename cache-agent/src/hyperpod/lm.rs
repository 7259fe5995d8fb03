//! LMCache's `lm://` server protocol (lmcache 0.5.6: `lmcache/v1/protocol.py`, its
//! client `LMCServerConnector`, `remote_url: lm://HOST:PORT`), served as a second front to
//! the HyperPod store: an object put through either front is read through both, reported
//! to routers the same way (record 0108), evicted to the same L2. Record 0110.
//!
//! The wire, as LMCache's own `struct` formats give it (native byte order, little-endian
//! on every machine LMCache runs on):
//!
//! | message | bytes |
//! |---|---|
//! | client header | 9 × i32: command (1 put, 2 get, 3 exist, 4 list, 5 health), length, fmt, dtype, location, shape[4]; then the key, `CacheEngineKey.to_string()` padded with spaces to 150 bytes |
//! | put | the header, then `length` payload bytes; no answer |
//! | server reply (get, exist, health) | 9 × i32: code (200 success, 400 fail), length, fmt, dtype, shape[4], location; a successful get is followed by `length` payload bytes |
//!
//! An object is stored as the HyperPod API stores it: LMCache's 28-byte `RemoteMetadata`
//! header of one group (length, fmt, dtype, shape[4]) and the payload, under the bucket
//! [`LMCACHE_BUCKET`], LMCache's default HyperPod bucket, so the two fronts share names.
//!
//! What the protocol cannot say, and what the agent does instead (each counted in
//! `warmpath_agent_lm_requests_total{command, result}`):
//! - a put of a key already stored: its body is read and dropped, the first writer's bytes
//!   stay (`conflict`); a put the segment cannot take now (leased full, too many puts being
//!   written) is read and dropped (`full`, `busy`): LMCache's put has no answer to carry a
//!   refusal, and the engine keeps its own copy;
//! - a put larger than the segment, an unknown command, a header that does not decode, a
//!   body or header that stalls for [`STALL_TIMEOUT`]: the connection is closed (nothing
//!   of a half-read put is visible); LMCache's connector does not reconnect, so its engine
//!   then goes on without this store;
//! - `list` is answered as a failure: LMCache's server does not implement it, and listing
//!   would show one engine another's keys.
//!
//! Bounds (issue 26): connections at most `max_connections`; a connection is unproven until
//! its first valid header, and unproven ones are capped with the oldest displaced
//! (`crate::handshakes`). There is no deadline for the first header: LMCache's connector
//! connects when the engine starts and sends its first command at its first store, which
//! may be minutes later; displacement bounds what silent connections cost instead. A get
//! holds a lease (the store's per-client and overall caps) only while its bytes are sent,
//! within [`STALL_TIMEOUT`] per piece; a connection reads one put at a time into the
//! place the store reserved for it, through one reused buffer. The protocol carries no
//! credentials: the address must be loopback unless `--insecure-no-token`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Semaphore;

use super::request::{
    i32_at, le_ints, parse_remote_metadata, remote_metadata, Meta, ObjectName, LMCACHE_BUCKET,
};
use super::store::{LeaseError, PutError};
use super::{HyperPod, ObjectEvent, Pending, METADATA_BYTES};
use crate::handshakes::Unproven;
use crate::metric_names as names;

/// Bytes of the key field (LMCache's `MAX_KEY_LENGTH`).
pub const KEY_FIELD_BYTES: usize = 150;
/// Bytes of a client header.
pub const HEADER_BYTES: usize = 9 * 4 + KEY_FIELD_BYTES;
/// Bytes of a server reply.
pub const REPLY_BYTES: usize = 9 * 4;
/// The reply codes (LMCache's `ServerReturnCode`).
pub const SUCCESS: i32 = 200;
pub const FAIL: i32 = 400;
/// Longest wait for the rest of a header once its first byte came, for the next piece of
/// a body, and for a reply's piece to be taken by the client.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a get's lease may last at most (it is released as soon as the bytes are sent).
const GET_LEASE: Duration = Duration::from_secs(60);
/// The buffer a connection copies payloads through.
const COPY_BYTES: usize = 256 << 10;

/// A client's command (LMCache's `ClientCommand`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Put,
    Get,
    Exist,
    List,
    Health,
}

impl Command {
    /// Its name in `warmpath_agent_lm_requests_total`, and its `op` in the HyperPod API's
    /// duration histogram.
    fn labels(self) -> (&'static str, &'static str) {
        match self {
            Command::Put => ("put", "lm_put"),
            Command::Get => ("get", "lm_get"),
            Command::Exist => ("exist", "lm_exist"),
            Command::List => ("list", "lm_list"),
            Command::Health => ("health", "lm_health"),
        }
    }
}

/// A client header, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub command: Command,
    /// Payload bytes that follow a put (0 for the other commands).
    pub length: u32,
    pub meta: Meta,
    pub key: String,
}

/// Why a header does not decode; each says what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadHeader {
    #[error("unknown command {0} (1 put, 2 get, 3 exist, 4 list, 5 health)")]
    Command(i32),
    #[error("negative length {0}")]
    Length(i32),
    #[error("the key is not UTF-8 text without control characters")]
    KeyNotText,
    #[error("the key is empty")]
    KeyEmpty,
}

/// Decodes a client header. The key is LMCache's padded field with the padding stripped
/// (its server strips surrounding whitespace); `location` is not used.
pub fn decode_header(b: &[u8; HEADER_BYTES]) -> Result<Header, BadHeader> {
    let command = match i32_at(b, 0) {
        1 => Command::Put,
        2 => Command::Get,
        3 => Command::Exist,
        4 => Command::List,
        5 => Command::Health,
        c => return Err(BadHeader::Command(c)),
    };
    let length = i32_at(b, 1);
    let length = u32::try_from(length).map_err(|_| BadHeader::Length(length))?;
    let meta = Meta {
        fmt: i32_at(b, 2),
        dtype: i32_at(b, 3),
        shape: [i32_at(b, 5), i32_at(b, 6), i32_at(b, 7), i32_at(b, 8)],
    };
    let key = std::str::from_utf8(&b[36..]).map_err(|_| BadHeader::KeyNotText)?;
    let key = key.trim_matches(|c: char| c.is_ascii_whitespace());
    if key.is_empty() {
        return Err(BadHeader::KeyEmpty);
    }
    if key.chars().any(char::is_control) {
        return Err(BadHeader::KeyNotText);
    }
    Ok(Header {
        command,
        length,
        meta,
        key: key.to_string(),
    })
}

/// Encodes a client header as LMCache's `ClientMetaMessage.serialize` does (tests and
/// tools; a key longer than the field is cut, as LMCache refuses to send one).
pub fn encode_header(h: &Header) -> [u8; HEADER_BYTES] {
    let mut b = [b' '; HEADER_BYTES];
    let command = match h.command {
        Command::Put => 1,
        Command::Get => 2,
        Command::Exist => 3,
        Command::List => 4,
        Command::Health => 5,
    };
    let [fmt, dtype, s0, s1, s2, s3] = h.meta.ints();
    let ints = [command, h.length as i32, fmt, dtype, 0, s0, s1, s2, s3];
    b[..36].copy_from_slice(&le_ints::<36>(&ints));
    let key = &h.key.as_bytes()[..h.key.len().min(KEY_FIELD_BYTES)];
    b[36..36 + key.len()].copy_from_slice(key);
    b
}

/// A server reply (LMCache's `ServerMetaMessage`; location 0).
pub fn encode_reply(code: i32, length: u32, meta: Meta) -> [u8; REPLY_BYTES] {
    let [fmt, dtype, s0, s1, s2, s3] = meta.ints();
    le_ints(&[code, length as i32, fmt, dtype, s0, s1, s2, s3, 0])
}

/// A failure reply, as LMCache's server sends one (fmt 1, dtype float16, no shape).
fn fail_reply() -> [u8; REPLY_BYTES] {
    encode_reply(FAIL, 0, fail_reply_meta())
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
enum Ended {
    #[error("displaced by a newer connection before its first header")]
    Displaced,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("stalled for {STALL_TIMEOUT:?}")]
    Stalled,
    #[error("bad header: {0}")]
    Header(#[from] BadHeader),
    #[error("{0}")]
    Refused(String),
}

fn counted(command: &'static str, result: &'static str) {
    counter!(names::AGENT_LM_REQUESTS_TOTAL, "command" => command, "result" => result).increment(1);
}

impl HyperPod {
    /// Serves `lm://` on `listener` until `shutdown` resolves.
    pub async fn serve_lm(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let places = Arc::new(Semaphore::new(self.max_connections));
        let unproven = Arc::new(Unproven::new("lm", self.max_unproven, self.max_unproven));
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                a = super::accept_placed(&listener, &places, "lm") => a,
                _ = &mut shutdown => return,
            };
            let Some((tcp, peer, place)) = accepted else {
                continue;
            };
            let (hp, unproven) = (self.clone(), unproven.clone());
            tokio::spawn(async move {
                if let Err(error) = hp.lm_connection(&unproven, peer, tcp).await {
                    tracing::debug!(%error, %peer, "lm connection ended");
                }
                drop(place);
            });
        }
    }

    async fn lm_connection(
        self: &Arc<Self>,
        unproven: &Unproven,
        peer: SocketAddr,
        tcp: tokio::net::TcpStream,
    ) -> Result<(), Ended> {
        let (mut rd, mut wr) = tcp.into_split();
        let mut buf = Vec::new();
        let (n, displaced) = unproven.admit(Some(peer.ip()));
        let first = tokio::select! {
            h = read_header(&mut rd) => h,
            // Only a newer connection sends; the sender is dropped only by `done`, below.
            _ = displaced => Err(Ended::Displaced),
        };
        unproven.done(n);
        let mut next = first?;
        while let Some(header) = next {
            let started = Instant::now();
            let (command, op) = header.command.labels();
            let result = self.lm_request(header, peer.ip(), &mut rd, &mut wr, &mut buf);
            match result.await {
                Ok(r) => counted(command, r),
                Err(e) => {
                    counted(command, "closed");
                    return Err(e);
                }
            }
            metrics::histogram!(names::AGENT_HYPERPOD_OP_DURATION_SECONDS, "op" => op)
                .record(started.elapsed().as_secs_f64());
            next = read_header(&mut rd).await?;
        }
        Ok(())
    }

    /// Answers one request; the result label, or why the connection must close.
    async fn lm_request(
        self: &Arc<Self>,
        h: Header,
        client: IpAddr,
        rd: &mut OwnedReadHalf,
        wr: &mut OwnedWriteHalf,
        buf: &mut Vec<u8>,
    ) -> Result<&'static str, Ended> {
        let name = ObjectName {
            bucket: LMCACHE_BUCKET.to_string(),
            key: h.key,
        };
        match h.command {
            Command::Put => self.lm_put(name, h.length, h.meta, rd, buf).await,
            Command::Get => self.lm_get(name, client, wr, buf).await,
            Command::Exist => {
                let held = self.lock_current().contains(&name) || self.load_from_l2(&name).await;
                let code = if held { SUCCESS } else { FAIL };
                send(wr, &encode_reply(code, 0, fail_reply_meta())).await?;
                Ok(if held { "hit" } else { "miss" })
            }
            Command::Health => {
                send(wr, &encode_reply(SUCCESS, 0, fail_reply_meta())).await?;
                Ok("ok")
            }
            Command::List => {
                send(wr, &fail_reply()).await?;
                Ok("refused")
            }
        }
    }

    async fn lm_put(
        self: &Arc<Self>,
        name: ObjectName,
        length: u32,
        meta: Meta,
        rd: &mut OwnedReadHalf,
        buf: &mut Vec<u8>,
    ) -> Result<&'static str, Ended> {
        let len = METADATA_BYTES + u64::from(length);
        let p = match self.place(name.clone(), len) {
            Ok(p) => p,
            Err(e @ PutError::TooLarge { .. }) => return Err(Ended::Refused(e.to_string())),
            Err(e) => {
                let result = match e {
                    PutError::Exists(_) => {
                        counter!(names::AGENT_HYPERPOD_CONFLICTS_TOTAL).increment(1);
                        "conflict"
                    }
                    PutError::Busy(_) => "busy",
                    _ => "full",
                };
                copy_body(rd, u64::from(length), buf, |_, _| Ok(())).await?;
                return Ok(result);
            }
        };
        // The place is this put's until committed; dropped (an error, a closed
        // connection), the put is aborted and nothing of it is visible.
        let guard = Pending {
            store: &self.store,
            seq: Some(p.seq),
        };
        self.segment
            .write_at(&remote_metadata(length, meta), p.offset)?;
        let body_at = p.offset + METADATA_BYTES;
        copy_body(rd, u64::from(length), buf, |piece, at| {
            self.segment.write_at(piece, body_at + at)
        })
        .await?;
        self.copy_through(&name, p.offset, p.len);
        guard.commit();
        self.tell(&name, ObjectEvent::Stored);
        counter!(names::AGENT_HYPERPOD_BYTES_TOTAL, "direction" => "in").increment(len);
        Ok("stored")
    }

    async fn lm_get(
        self: &Arc<Self>,
        name: ObjectName,
        client: IpAddr,
        wr: &mut OwnedWriteHalf,
        buf: &mut Vec<u8>,
    ) -> Result<&'static str, Ended> {
        let grant = match self
            .grant(&name, client, GET_LEASE.as_micros() as u64)
            .await
        {
            Ok(g) => g,
            Err(e) => {
                send(wr, &fail_reply()).await?;
                return Ok(match e {
                    LeaseError::Miss(_) => {
                        counter!(names::AGENT_HYPERPOD_MISSES_TOTAL).increment(1);
                        "miss"
                    }
                    _ => "refused",
                });
            }
        };
        // Released when the bytes are sent, or when this ends early.
        let _lease = Leased {
            hp: self,
            lease: grant.lease,
        };
        let mut head = [0u8; METADATA_BYTES as usize];
        self.segment.read_at(&mut head, grant.offset)?;
        let length = grant.len - METADATA_BYTES;
        let reply = encode_reply(SUCCESS, length as u32, parse_remote_metadata(&head));
        send(wr, &reply).await?;
        if buf.len() < COPY_BYTES {
            buf.resize(COPY_BYTES, 0);
        }
        let mut sent = 0u64;
        while sent < length {
            let n = (length - sent).min(COPY_BYTES as u64) as usize;
            self.segment
                .read_at(&mut buf[..n], grant.offset + METADATA_BYTES + sent)?;
            send(wr, &buf[..n]).await?;
            sent += n as u64;
        }
        counter!(names::AGENT_HYPERPOD_BYTES_TOTAL, "direction" => "out").increment(grant.len);
        Ok("hit")
    }
}

/// The metadata of replies without an object (as LMCache's server sends them).
fn fail_reply_meta() -> Meta {
    Meta {
        fmt: 1,
        dtype: 2,
        shape: [0; 4],
    }
}

/// A get's lease, released when dropped.
struct Leased<'a> {
    hp: &'a HyperPod,
    lease: warmpath_tiers::LeaseId,
}

impl Drop for Leased<'_> {
    fn drop(&mut self) {
        let now = self.hp.now_us();
        let _ = self.hp.lock().release(self.lease, now);
    }
}

/// The next header, or None when the client closed between requests. The first byte may
/// take as long as the client likes (an idle engine); the rest must follow within
/// [`STALL_TIMEOUT`].
async fn read_header(rd: &mut OwnedReadHalf) -> Result<Option<Header>, Ended> {
    let mut b = [0u8; HEADER_BYTES];
    let n = rd.read(&mut b).await?;
    if n == 0 {
        return Ok(None);
    }
    tokio::time::timeout(STALL_TIMEOUT, rd.read_exact(&mut b[n..]))
        .await
        .map_err(|_| Ended::Stalled)??;
    Ok(Some(decode_header(&b)?))
}

/// Reads `length` body bytes through `buf`, handing each piece and its offset to `sink`.
async fn copy_body(
    rd: &mut OwnedReadHalf,
    length: u64,
    buf: &mut Vec<u8>,
    mut sink: impl FnMut(&[u8], u64) -> std::io::Result<()>,
) -> Result<(), Ended> {
    if buf.len() < COPY_BYTES {
        buf.resize(COPY_BYTES, 0);
    }
    let mut done = 0u64;
    while done < length {
        let want = (length - done).min(COPY_BYTES as u64) as usize;
        let n = tokio::time::timeout(STALL_TIMEOUT, rd.read(&mut buf[..want]))
            .await
            .map_err(|_| Ended::Stalled)??;
        if n == 0 {
            return Err(Ended::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        sink(&buf[..n], done)?;
        done += n as u64;
    }
    Ok(())
}

async fn send(wr: &mut OwnedWriteHalf, bytes: &[u8]) -> Result<(), Ended> {
    tokio::time::timeout(STALL_TIMEOUT, wr.write_all(bytes))
        .await
        .map_err(|_| Ended::Stalled)??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(command: Command, length: u32, key: &str) -> Header {
        Header {
            command,
            length,
            meta: Meta {
                fmt: 1,
                dtype: 3,
                shape: [2, 32, 256, 1024],
            },
            key: key.to_string(),
        }
    }

    #[test]
    fn a_header_decodes_as_encoded_with_its_padding_stripped() {
        let h = header(Command::Put, 4096, "m@1@0@-1a2b@bfloat16");
        let b = encode_header(&h);
        assert_eq!(&b[36 + h.key.len()..], &[b' '; 150 - 20][..]);
        assert_eq!(decode_header(&b), Ok(h));
    }

    #[test]
    fn bad_headers_say_what_is_wrong() {
        let mut b = encode_header(&header(Command::Get, 0, "k"));
        b[..4].copy_from_slice(&9i32.to_le_bytes());
        assert_eq!(decode_header(&b), Err(BadHeader::Command(9)));
        let mut b = encode_header(&header(Command::Put, 0, "k"));
        b[4..8].copy_from_slice(&(-1i32).to_le_bytes());
        assert_eq!(decode_header(&b), Err(BadHeader::Length(-1)));
        let b = encode_header(&header(Command::Get, 0, "   "));
        assert_eq!(decode_header(&b), Err(BadHeader::KeyEmpty));
        let b = encode_header(&header(Command::Get, 0, "a\u{1}b"));
        assert_eq!(decode_header(&b), Err(BadHeader::KeyNotText));
        let mut b = encode_header(&header(Command::Get, 0, "k"));
        b[40] = 0xff;
        assert_eq!(decode_header(&b), Err(BadHeader::KeyNotText));
    }

    #[test]
    fn the_stored_metadata_is_a_one_group_remote_metadata() {
        let meta = Meta {
            fmt: 1,
            dtype: 3,
            shape: [2, 32, 256, 1024],
        };
        let head = remote_metadata(4096, meta);
        assert_eq!(i32_at(&head, 0), 4096);
        assert_eq!(parse_remote_metadata(&head), meta);
        let reply = encode_reply(SUCCESS, 4096, meta);
        assert_eq!(
            (i32_at(&reply, 0), i32_at(&reply, 1), i32_at(&reply, 8)),
            (200, 4096, 0)
        );
    }
}
