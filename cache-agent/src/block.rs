//! A stored block: its payload with the checksum that travels with it, and the self-checking
//! form in which L2 backends keep it.
//!
//! An L2 object is a 36-byte header then the payload:
//!
//! ```text
//! "WPB1" | layout u64 LE | key u64 LE | payload length u64 LE | xxh3-64 of payload u64 LE | payload
//! ```
//!
//! Reading one back checks all of it against the id it was asked for: another block's
//! object (a foreign block, say a key collision on a shared store or a renamed file), a
//! short or long object (a truncated write, a full disk) and a payload whose checksum
//! differs (bit rot, a torn write) are each a [`Damage`], which the agent counts as a miss
//! and never serves. The checksum is xxh3-64: integrity at memory speed, not authentication.
//!
//! With a cluster key (`l2.key_file`, shared by the agents of a cluster), objects are
//! sealed: a 76-byte header that adds the writer's identity and a MAC, a BLAKE3 keyed hash
//! under the key of the header before it and the payload:
//!
//! ```text
//! "WPB2" | layout | key | payload length | xxh3-64 | writer u64 LE | MAC (32 bytes) | payload
//! ```
//!
//! An agent with a key serves sealed objects whose MAC checks and nothing else: an object
//! written by a host without the key (a `WPB1` object, or a `WPB2` under another key) is a
//! [`Damage::Unsealed`], a counted miss. Decision 0106.

use bytes::{BufMut, Bytes, BytesMut};

use warmpath_tiers::BlockId;

/// The checksum of a payload.
pub fn checksum(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// [`checksum`] of a payload taken a piece at a time, as it arrives or is read.
#[derive(Default)]
pub struct Checksum(xxhash_rust::xxh3::Xxh3);

impl std::fmt::Debug for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Checksum").field(&self.digest()).finish()
    }
}

impl Checksum {
    pub fn update(&mut self, piece: &[u8]) {
        self.0.update(piece);
    }

    /// The checksum of every piece so far, in order: [`checksum`] of their concatenation.
    pub fn digest(&self) -> u64 {
        self.0.digest()
    }
}

/// A payload and its checksum, computed once when it entered the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub payload: Bytes,
    pub checksum: u64,
}

impl Block {
    pub fn new(payload: Bytes) -> Self {
        let checksum = checksum(&payload);
        Block { payload, checksum }
    }

    /// Whether the payload still matches its checksum.
    pub fn verify(&self) -> bool {
        checksum(&self.payload) == self.checksum
    }
}

const MAGIC: &[u8; 4] = b"WPB1";
/// Bytes before the payload in an L2 object.
pub const HEADER_BYTES: usize = 36;

/// Why an object read back from L2 is not served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Damage {
    #[error("not a warmpath block (bad magic or shorter than a header)")]
    NotABlock,
    #[error("object of another block ({0:?})")]
    Foreign(BlockId),
    #[error("payload of {got} bytes where the header says {want}")]
    Truncated { got: u64, want: u64 },
    #[error("payload checksum mismatch")]
    Checksum,
    /// Not sealed under this agent's cluster key (or sealed where this agent has none).
    #[error("object not sealed under the cluster key")]
    Unsealed,
}

/// The cluster key L2 objects are sealed under (decision 0106).
#[derive(Clone, PartialEq, Eq)]
pub struct SealKey(pub [u8; 32]);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(..)")
    }
}

impl SealKey {
    /// The key derived from a key file's contents (surrounding whitespace ignored).
    pub fn from_secret(secret: &[u8]) -> SealKey {
        let trimmed = secret.trim_ascii();
        SealKey(blake3::derive_key("warmpath 2026-12 l2 seal v1", trimmed))
    }
}

const SEALED_MAGIC: &[u8; 4] = b"WPB2";
/// Bytes before the payload in a sealed object.
pub const SEALED_HEADER_BYTES: usize = HEADER_BYTES + 8 + 32;

fn mac(key: &SealKey, head: &[u8], payload: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(&key.0);
    h.update(head);
    h.update(payload);
    *h.finalize().as_bytes()
}

/// The sealed object for `id` holding `block`, written by `writer`.
pub fn encode_sealed(id: &BlockId, block: &Block, key: &SealKey, writer: u64) -> Bytes {
    let mut out = BytesMut::with_capacity(SEALED_HEADER_BYTES + block.payload.len());
    out.put_slice(SEALED_MAGIC);
    out.put_slice(&object_header(id, block)[4..]);
    out.put_u64_le(writer);
    let m = mac(key, &out, &block.payload);
    out.put_slice(&m);
    out.put_slice(&block.payload);
    out.freeze()
}

/// The block in an L2 object read back for `id`, checked, and sealed under `key` when this
/// agent has one; with it, the writer's identity.
pub fn decode_with(
    id: &BlockId,
    object: Bytes,
    key: Option<&SealKey>,
) -> Result<(Block, Option<u64>), Damage> {
    let sealed = object.len() >= 4 && &object[..4] == SEALED_MAGIC;
    let Some(key) = key else {
        return if sealed {
            Err(Damage::Unsealed)
        } else {
            decode_object(id, object).map(|b| (b, None))
        };
    };
    if !sealed {
        return match decode_object(id, object) {
            Ok(_) => Err(Damage::Unsealed),
            Err(e) => Err(e),
        };
    }
    if object.len() < SEALED_HEADER_BYTES {
        return Err(Damage::NotABlock);
    }
    let head = &object[..HEADER_BYTES + 8];
    let payload = &object[SEALED_HEADER_BYTES..];
    let want: [u8; 32] = object[HEADER_BYTES + 8..SEALED_HEADER_BYTES]
        .try_into()
        .map_err(|_| Damage::NotABlock)?;
    // blake3's Hash equality is constant-time.
    if blake3::Hash::from(mac(key, head, payload)) != blake3::Hash::from(want) {
        return Err(Damage::Unsealed);
    }
    let writer = u64::from_le_bytes(
        object[HEADER_BYTES..HEADER_BYTES + 8]
            .try_into()
            .unwrap_or([0; 8]),
    );
    // The rest as an unsealed object: the same header fields, the payload after the MAC.
    let mut plain = BytesMut::with_capacity(HEADER_BYTES);
    plain.put_slice(MAGIC);
    plain.put_slice(&object[4..HEADER_BYTES]);
    check_fields(id, &plain, object.slice(SEALED_HEADER_BYTES..)).map(|b| (b, Some(writer)))
}

/// The header of the L2 object for `id` holding `block` (the payload follows it).
pub fn object_header(id: &BlockId, block: &Block) -> [u8; HEADER_BYTES] {
    let mut out = [0u8; HEADER_BYTES];
    let mut w = &mut out[..];
    w.put_slice(MAGIC);
    w.put_u64_le(id.layout);
    w.put_u64_le(id.key.0);
    w.put_u64_le(block.payload.len() as u64);
    w.put_u64_le(block.checksum);
    out
}

/// The L2 object for `id` holding `block`.
pub fn encode_object(id: &BlockId, block: &Block) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_BYTES + block.payload.len());
    out.put_slice(&object_header(id, block));
    out.put_slice(&block.payload);
    out.freeze()
}

/// The block in an L2 object read back for `id`, checked.
pub fn decode_object(id: &BlockId, object: Bytes) -> Result<Block, Damage> {
    if object.len() < HEADER_BYTES || &object[..4] != MAGIC {
        return Err(Damage::NotABlock);
    }
    check_fields(id, &object[..HEADER_BYTES], object.slice(HEADER_BYTES..))
}

/// Checks a 36-byte header (magic checked) against `id` and `payload`.
fn check_fields(id: &BlockId, header: &[u8], payload: Bytes) -> Result<Block, Damage> {
    let u64_at = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap_or([0; 8]));
    let found = BlockId::new(u64_at(4), u64_at(12));
    if found != *id {
        return Err(Damage::Foreign(found));
    }
    let want = u64_at(20);
    let sum = u64_at(28);
    let got = payload.len() as u64;
    if got != want {
        return Err(Damage::Truncated { got, want });
    }
    let block = Block {
        payload,
        checksum: sum,
    };
    if !block.verify() {
        return Err(Damage::Checksum);
    }
    Ok(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checksum_taken_in_pieces_is_the_checksum_of_the_whole() {
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for piece in [1, 4096, 65_536, 300_000] {
            let mut sum = Checksum::default();
            payload.chunks(piece).for_each(|p| sum.update(p));
            assert_eq!(sum.digest(), checksum(&payload), "pieces of {piece}");
        }
    }

    #[test]
    fn objects_round_trip_and_damage_is_named() {
        let id = BlockId::new(3, 99);
        let block = Block::new(Bytes::from_static(b"kv bytes of one block"));
        let obj = encode_object(&id, &block);
        assert_eq!(decode_object(&id, obj.clone()), Ok(block.clone()));

        let check = |obj: Bytes, want: Damage| assert_eq!(decode_object(&id, obj), Err(want));
        check(
            obj.slice(..obj.len() - 1),
            Damage::Truncated { got: 20, want: 21 },
        );
        check(obj.slice(..10), Damage::NotABlock);
        check(Bytes::new(), Damage::NotABlock);
        let mut flipped = obj.to_vec();
        *flipped.last_mut().unwrap() ^= 1;
        check(flipped.into(), Damage::Checksum);
        let other = encode_object(&BlockId::new(3, 100), &block);
        check(other, Damage::Foreign(BlockId::new(3, 100)));
        let mut longer = obj.to_vec();
        longer.push(0);
        check(longer.into(), Damage::Truncated { got: 22, want: 21 });
        // Sealed: served under the key, a counted miss without it or under another, and
        // an unsealed object is a miss where there is a key.
        let key = SealKey::from_secret(b"cluster secret\n");
        let sealed = encode_sealed(&id, &block, &key, 42);
        assert_eq!(
            decode_with(&id, sealed.clone(), Some(&key)),
            Ok((block.clone(), Some(42)))
        );
        assert_eq!(
            decode_with(&id, sealed.clone(), None),
            Err(Damage::Unsealed)
        );
        let other_key = SealKey::from_secret(b"another");
        assert_eq!(
            decode_with(&id, sealed.clone(), Some(&other_key)),
            Err(Damage::Unsealed)
        );
        assert_eq!(
            decode_with(&id, obj.clone(), Some(&key)),
            Err(Damage::Unsealed)
        );
        let mut forged = sealed.to_vec();
        *forged.last_mut().unwrap() ^= 1;
        assert_eq!(
            decode_with(&id, forged.into(), Some(&key)),
            Err(Damage::Unsealed)
        );
        assert_eq!(
            decode_with(&id, sealed.slice(..50), Some(&key)),
            Err(Damage::NotABlock)
        );
        // An empty payload is a block too.
        let empty = Block::new(Bytes::new());
        assert_eq!(
            decode_object(&id, encode_object(&id, &empty)),
            Ok(empty.clone())
        );
    }
}
