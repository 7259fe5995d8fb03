//! The engine-facing block API on the wire, version 2: a handshake, then length-prefixed
//! binary frames with request ids, pipelined (a client may send many requests before reading
//! an answer; answers carry the request's id and may come back in any order).
//!
//! # Handshake
//!
//! ```text
//! client: "WPKV" | version u16 LE | token length u16 LE | token bytes
//! server: "WPKV" | version u16 LE | status u8 | message length u16 LE | message (UTF-8)
//! ```
//!
//! The server answers with the version it speaks. Status 0 is accepted; 1 an unsupported
//! version and 2 a missing or wrong token are followed by the server closing the connection,
//! and the message says what is wrong. The token is compared before any frame is read.
//!
//! Versions: 2 added [`PutRefusal::Conflict`] and [`PutRefusal::PinLimit`]; 3 added sealed
//! blocks on the Unix socket ([`Request::PutSealed`], [`Request::GetSealed`],
//! [`Response::GetSealed`]: payloads as memfd descriptors passed with the frame, see
//! `sealed.rs`). An agent speaks 1 to 3 ([`MIN_VERSION`]..=[`VERSION`]) and tells a
//! version-1 client either refusal of version 2 as [`PutRefusal::Full`] (not stored, which
//! is all a version-1 client can act on), so engines of older releases keep working against
//! a newer agent; a client learns the agent's version from its welcome, and one that an
//! older agent refused connects again speaking the version the refusal names.
//!
//! # Frames
//!
//! ```text
//! body length u32 LE | request id u64 LE | header length u32 LE | header | payloads
//! ```
//!
//! The header is a [`Request`] or [`Response`] in postcard; the payloads are block bytes
//! back to back, as many and as long as the header says, outside postcard so that they are
//! never copied to decode (a payload is a slice of the frame). A sealed frame has no
//! payloads: its blocks' descriptors come with its first byte (`SCM_RIGHTS`), one per
//! block of a put, one per found block of an answer, in order. A body longer than the
//! receiver's limit, a header that does not decode or payload lengths that do not add up are
//! [`ProtoError`]s: the server answers them with an error and, where the stream can no
//! longer be trusted, closes the connection.
//!
//! Pure: encoding and decoding only; `server.rs` and `client.rs` move the bytes.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use warmpath_tiers::LedgerStats;

/// The protocol version this build speaks.
pub const VERSION: u16 = 3;

/// The first version with sealed blocks ([`Request::PutSealed`], [`Request::GetSealed`]).
pub const SEALED_VERSION: u16 = 3;
/// The oldest version an agent still serves.
pub const MIN_VERSION: u16 = 1;
pub const MAGIC: &[u8; 4] = b"WPKV";
/// The longest token a handshake carries.
pub const MAX_TOKEN_BYTES: usize = 1024;
/// Bytes of a frame before its header: body length, request id, header length.
pub const FRAME_PREFIX: usize = 4 + 8 + 4;

/// One block of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutItem {
    pub key: u64,
    /// Payload length; the payloads follow the header in order.
    pub bytes: u32,
    /// Kept in L1 until unpinned.
    pub pin: bool,
}

/// Where a block was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StoreTier {
    /// This host's memory.
    L1,
    /// The shared remote store.
    L2,
}

impl StoreTier {
    pub fn name(self) -> &'static str {
        match self {
            StoreTier::L1 => "l1",
            StoreTier::L2 => "l2",
        }
    }
}

/// What an engine asks. Every block is named by (layout, warmpath block key).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Store blocks in L1 (and, per the agent's write policy, L2). The payloads follow.
    Put { layout: u64, blocks: Vec<PutItem> },
    /// How many leading blocks of `keys` (a chain, first block first) are available, and
    /// where; the L1 ones are leased for `lease_ms` or until released.
    Lookup {
        layout: u64,
        keys: Vec<u64>,
        lease_ms: u32,
    },
    /// The payloads of `keys`, from L1 then L2 (a block read from L2 is also put into L1
    /// where the agent's `l2_promote_reads` is on).
    Get { layout: u64, keys: Vec<u64> },
    /// Ends a lease.
    Release { lease: u64 },
    /// Unpins blocks.
    Unpin { layout: u64, keys: Vec<u64> },
    /// The agent's counters.
    Stats,
    /// A [`Request::Put`] whose payloads are sealed memfds passed with the frame, one per
    /// block in order, each exactly `bytes` long (version 3, Unix socket only).
    PutSealed { layout: u64, blocks: Vec<PutItem> },
    /// A [`Request::Get`] answered with [`Response::GetSealed`] (version 3, Unix socket only).
    GetSealed { layout: u64, keys: Vec<u64> },
}

impl Request {
    /// The block layout it names, if any.
    pub fn layout(&self) -> Option<u64> {
        match self {
            Request::Put { layout, .. }
            | Request::Lookup { layout, .. }
            | Request::Get { layout, .. }
            | Request::Unpin { layout, .. }
            | Request::PutSealed { layout, .. }
            | Request::GetSealed { layout, .. } => Some(*layout),
            Request::Release { .. } | Request::Stats => None,
        }
    }
}

/// Why a block of a put was not stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PutRefusal {
    /// Larger than the agent's maximum block size.
    TooLarge,
    /// L1 is full of pinned or leased blocks.
    Full,
    /// The key is held with other bytes; the first bytes stay (version 2).
    Conflict,
    /// A pin past this connection's quota or past the pinned share of L1 (version 2).
    PinLimit,
}

impl PutRefusal {
    /// The label of `warmpath_agent_put_refused_total`.
    pub fn name(self) -> &'static str {
        match self {
            PutRefusal::TooLarge => "too_large",
            PutRefusal::Full => "full",
            PutRefusal::Conflict => "conflict",
            PutRefusal::PinLimit => "pin_limit",
        }
    }
}

impl Response {
    /// This answer as a client of `version` reads it (see the module docs).
    pub fn for_version(self, version: u16) -> Response {
        match self {
            Response::Put { stored, refused } if version < 2 => Response::Put {
                stored,
                refused: refused
                    .into_iter()
                    .map(|(i, r)| match r {
                        PutRefusal::Conflict | PutRefusal::PinLimit => (i, PutRefusal::Full),
                        r => (i, r),
                    })
                    .collect(),
            },
            r => r,
        }
    }
}

/// A block of a get's answer; its payload follows in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GotBlock {
    pub bytes: u32,
    /// xxh3-64 of the payload, for the engine to check.
    pub checksum: u64,
    pub tier: StoreTier,
}

/// The agent's counters, for `Stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStats {
    pub l1: LedgerStats,
    pub l1_hits: u64,
    pub l2_hits: u64,
    pub misses: u64,
    pub l2_errors: u64,
    pub l2_damaged: u64,
    /// Blocks the agent reports to routers (engines' GPUs from KV events, its own L1 and
    /// L2): of the blocks it holds, those of reported keys (record 0115), every block with
    /// `--residency-every-block`.
    pub residency_blocks: u64,
    /// KV-event batches applied, sequence gaps seen, batches refused, blocks whose tenant
    /// was not known.
    pub kv_batches: u64,
    pub kv_gaps: u64,
    pub kv_malformed: u64,
    pub kv_unresolved: u64,
}

/// Classes of errors, for clients to act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The frame could not be decoded.
    Malformed,
    /// Valid but not acceptable (too many keys, an unknown lease).
    BadRequest,
    /// The agent failed (not the client's fault).
    Internal,
}

/// The agent's answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// `stored` blocks were stored; the rest are listed by index in the put.
    Put {
        stored: u32,
        refused: Vec<(u32, PutRefusal)>,
    },
    /// The leading available blocks of the chain, a tier each (empty: the first block is
    /// nowhere); the L1 ones are held by `lease`.
    Lookup {
        lease: u64,
        tiers: Vec<StoreTier>,
    },
    /// One entry per key asked; payloads follow for the found ones.
    Get {
        blocks: Vec<Option<GotBlock>>,
    },
    Released {
        blocks: u32,
    },
    Unpinned {
        blocks: u32,
    },
    Stats(AgentStats),
    Error {
        kind: ErrorKind,
        message: String,
    },
    /// A [`Response::Get`] whose found blocks that L1 holds sealed come as their memfds,
    /// passed with the frame in order (`true` beside the block); the others' payloads
    /// follow the header in order, as a get's do.
    GetSealed {
        blocks: Vec<Option<(GotBlock, bool)>>,
    },
}

/// Why bytes on the wire were not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("not a warmpath block API peer (bad magic)")]
    BadMagic,
    #[error("unsupported protocol version {0} (this agent speaks {VERSION})")]
    Version(u16),
    #[error("token of {0} bytes is longer than {MAX_TOKEN_BYTES}")]
    TokenTooLong(usize),
    #[error("frame of {0} bytes is over the limit of {1}")]
    TooLong(u64, u64),
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// A client's handshake, in this build's version.
pub fn encode_hello(token: &[u8]) -> Result<Vec<u8>, ProtoError> {
    encode_hello_version(token, VERSION)
}

/// A client's handshake in `version` (an older agent's, which refused this build's).
pub fn encode_hello_version(token: &[u8], version: u16) -> Result<Vec<u8>, ProtoError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(ProtoError::TokenTooLong(token.len()));
    }
    let mut out = Vec::with_capacity(8 + token.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(token);
    Ok(out)
}

/// The fixed part of a client's handshake: (version, token length).
pub fn decode_hello_prefix(prefix: &[u8; 8]) -> Result<(u16, usize), ProtoError> {
    if &prefix[..4] != MAGIC {
        return Err(ProtoError::BadMagic);
    }
    let version = u16::from_le_bytes([prefix[4], prefix[5]]);
    let len = u16::from_le_bytes([prefix[6], prefix[7]]) as usize;
    if len > MAX_TOKEN_BYTES {
        return Err(ProtoError::TokenTooLong(len));
    }
    Ok((version, len))
}

/// Handshake statuses.
pub const HELLO_OK: u8 = 0;
pub const HELLO_VERSION: u8 = 1;
pub const HELLO_TOKEN: u8 = 2;

/// A server's handshake answer.
pub fn encode_welcome(status: u8, message: &str) -> Vec<u8> {
    let msg = &message.as_bytes()[..message.len().min(u16::MAX as usize)];
    let mut out = Vec::with_capacity(9 + msg.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(status);
    out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    out.extend_from_slice(msg);
    out
}

/// The fixed part of a server's answer: (version, status, message length).
pub fn decode_welcome_prefix(prefix: &[u8; 9]) -> Result<(u16, u8, usize), ProtoError> {
    if &prefix[..4] != MAGIC {
        return Err(ProtoError::BadMagic);
    }
    Ok((
        u16::from_le_bytes([prefix[4], prefix[5]]),
        prefix[6],
        u16::from_le_bytes([prefix[7], prefix[8]]) as usize,
    ))
}

/// A frame to send: the bytes before the payloads, then the payloads (written as they are,
/// never copied into one buffer).
#[derive(Debug)]
pub struct Outgoing {
    pub head: Bytes,
    pub payloads: Vec<Bytes>,
    /// Sealed blocks whose descriptors go with the frame's first byte (Unix socket only).
    pub fds: Vec<std::sync::Arc<crate::sealed::Sealed>>,
}

impl Outgoing {
    pub fn len(&self) -> usize {
        self.head.len() + self.payloads.iter().map(Bytes::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Encodes a frame of request id `id` with `header` and `payloads`.
pub fn encode_frame<H: Serialize>(id: u64, header: &H, payloads: Vec<Bytes>) -> Outgoing {
    let header = postcard::to_stdvec(header).unwrap_or_default();
    let payload_len: usize = payloads.iter().map(Bytes::len).sum();
    let body = 8 + 4 + header.len() + payload_len;
    let mut head = BytesMut::with_capacity(FRAME_PREFIX + header.len());
    head.put_u32_le(u32::try_from(body).unwrap_or(u32::MAX));
    head.put_u64_le(id);
    head.put_u32_le(header.len() as u32);
    head.put_slice(&header);
    Outgoing {
        head: head.freeze(),
        payloads,
        fds: Vec::new(),
    }
}

/// The body length a frame's first four bytes announce, checked against `limit`.
pub fn frame_len(prefix: [u8; 4], limit: u64) -> Result<usize, ProtoError> {
    let len = u64::from(u32::from_le_bytes(prefix));
    if len > limit {
        return Err(ProtoError::TooLong(len, limit));
    }
    if len < 12 {
        return Err(ProtoError::Malformed(format!(
            "body of {len} bytes is shorter than its id and header length"
        )));
    }
    Ok(len as usize)
}

/// A decoded frame body: its id, header and the payload bytes after it.
#[derive(Debug)]
pub struct Incoming<H> {
    pub id: u64,
    pub header: H,
    pub payloads: Bytes,
}

/// The request id of a body, when it has one (to answer a frame whose header is bad).
pub fn frame_id(body: &[u8]) -> Option<u64> {
    body.get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
}

/// Decodes a frame body (what follows the length prefix).
pub fn decode_body<H: for<'de> Deserialize<'de>>(
    mut body: Bytes,
) -> Result<Incoming<H>, ProtoError> {
    if body.len() < 12 {
        return Err(ProtoError::Malformed("body shorter than 12 bytes".into()));
    }
    let id = body.get_u64_le();
    let header_len = body.get_u32_le() as usize;
    if header_len > body.len() {
        return Err(ProtoError::Malformed(format!(
            "header of {header_len} bytes in a body of {}",
            body.len()
        )));
    }
    let header_bytes = body.split_to(header_len);
    let header = postcard::from_bytes(&header_bytes)
        .map_err(|e| ProtoError::Malformed(format!("header: {e}")))?;
    Ok(Incoming {
        id,
        header,
        payloads: body,
    })
}

/// Splits `payloads` into pieces of `lens` bytes; they must add up exactly.
pub fn split_payloads(
    mut payloads: Bytes,
    lens: impl IntoIterator<Item = u32>,
) -> Result<Vec<Bytes>, ProtoError> {
    let mut out = Vec::new();
    for len in lens {
        let len = len as usize;
        if len > payloads.len() {
            return Err(ProtoError::Malformed(format!(
                "payload of {len} bytes where {} remain",
                payloads.len()
            )));
        }
        out.push(payloads.split_to(len));
    }
    if !payloads.is_empty() {
        return Err(ProtoError::Malformed(format!(
            "{} bytes after the last payload",
            payloads.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(o: &Outgoing) -> Bytes {
        let mut all = o.head.to_vec();
        for p in &o.payloads {
            all.extend_from_slice(p);
        }
        Bytes::from(all)
    }

    #[test]
    fn frames_round_trip() {
        let req = Request::Put {
            layout: 5,
            blocks: vec![
                PutItem {
                    key: 1,
                    bytes: 3,
                    pin: false,
                },
                PutItem {
                    key: 2,
                    bytes: 0,
                    pin: true,
                },
            ],
        };
        let out = encode_frame(42, &req, vec![Bytes::from_static(b"abc"), Bytes::new()]);
        let all = wire(&out);
        assert_eq!(out.len(), all.len());
        let len = frame_len(all[..4].try_into().unwrap(), 1 << 20).unwrap();
        assert_eq!(len, all.len() - 4);
        let got: Incoming<Request> = decode_body(all.slice(4..)).unwrap();
        assert_eq!(got.id, 42);
        assert_eq!(got.header, req);
        let parts = split_payloads(got.payloads, [3, 0]).unwrap();
        assert_eq!(parts, vec![Bytes::from_static(b"abc"), Bytes::new()]);
    }

    #[test]
    fn bad_frames_are_errors() {
        assert_eq!(
            frame_len(100u32.to_le_bytes(), 99),
            Err(ProtoError::TooLong(100, 99))
        );
        assert!(frame_len(3u32.to_le_bytes(), 99).is_err());
        assert!(decode_body::<Request>(Bytes::from_static(b"short")).is_err());
        // A header length past the end.
        let mut body = 7u64.to_le_bytes().to_vec();
        body.extend_from_slice(&100u32.to_le_bytes());
        assert!(decode_body::<Request>(Bytes::from(body.clone())).is_err());
        assert_eq!(frame_id(&body), Some(7));
        // A header that is not a request.
        let mut body = 7u64.to_le_bytes().to_vec();
        body.extend_from_slice(&1u32.to_le_bytes());
        body.push(0xff);
        assert!(matches!(
            decode_body::<Request>(Bytes::from(body)),
            Err(ProtoError::Malformed(_))
        ));
        assert!(split_payloads(Bytes::from_static(b"ab"), [3]).is_err());
        assert!(split_payloads(Bytes::from_static(b"abcd"), [3]).is_err());
    }

    #[test]
    fn handshakes() {
        let hello = encode_hello(b"secret").unwrap();
        let (v, n) = decode_hello_prefix(hello[..8].try_into().unwrap()).unwrap();
        assert_eq!((v, n), (VERSION, 6));
        assert_eq!(&hello[8..], b"secret");
        assert_eq!(decode_hello_prefix(b"HTTP/1.1"), Err(ProtoError::BadMagic));
        assert!(encode_hello(&[0; 2000]).is_err());
        let w = encode_welcome(HELLO_VERSION, "speak 1");
        assert_eq!(
            decode_welcome_prefix(w[..9].try_into().unwrap()),
            Ok((VERSION, HELLO_VERSION, 7))
        );
    }
}
