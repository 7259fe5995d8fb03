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
//! and never serves. The checksum is xxh3-64: integrity at memory speed, not authentication
//! (whoever may write the store may write a valid block; the block API and the stores are
//! authenticated on their own).

use bytes::{BufMut, Bytes, BytesMut};

use warmpath_tiers::BlockId;

/// The checksum of a payload.
pub fn checksum(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
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
    let u64_at = |at: usize| u64::from_le_bytes(object[at..at + 8].try_into().unwrap_or([0; 8]));
    let found = BlockId::new(u64_at(4), u64_at(12));
    if found != *id {
        return Err(Damage::Foreign(found));
    }
    let want = u64_at(20);
    let sum = u64_at(28);
    let got = (object.len() - HEADER_BYTES) as u64;
    if got != want {
        return Err(Damage::Truncated { got, want });
    }
    let block = Block {
        payload: object.slice(HEADER_BYTES..),
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
        // An empty payload is a block too.
        let empty = Block::new(Bytes::new());
        assert_eq!(
            decode_object(&id, encode_object(&id, &empty)),
            Ok(empty.clone())
        );
    }
}
