//! Routing decisions and the other values routers gossip, as wire types, plus the batcher
//! that groups decisions into bounded gossip values. Pure: no I/O, no clock reads (time is
//! passed in as milliseconds).
//!
//! Every value is a versioned enum (new variants are only ever appended, so an old router
//! fails to decode a newer variant instead of misreading it), serialized with postcard and
//! then base64 (standard alphabet, no padding), because chitchat values are strings.
//! Decoding never panics: garbage, truncated or oversized input is a [`WireError`].
//!
//! Block keys inside a [`Decision`] travel as fixed 8-byte little-endian words (the keys
//! are uniformly random 64-bit hashes, for which postcard's varints would take 9 to 10
//! bytes). A decision therefore costs `varint(instance) + varint(8·k) + 8·k` bytes before
//! base64, which the [`Batcher`] uses to keep every batch within its byte budget.

use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use warmpath_index::keys::BlockKey;
use warmpath_index::load::InstanceLoad;

/// Largest encoded value [`decode`] accepts, in bytes (a chitchat datagram is at most
/// 64 KiB, so nothing legitimate comes close).
pub const MAX_DECODE_BYTES: usize = 1 << 20;

/// Stable across routers: the first 8 bytes (LE) of blake3 of the instance's base URL.
///
/// Routers number instances densely and privately ([`warmpath_index::InstanceId`]); on the
/// wire an instance is named by this key, which every router computes the same way from
/// the URL it has configured for the instance.
pub fn instance_key(url: &str) -> u64 {
    let hash = blake3::hash(url.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// One routing decision: `instance` (an [`instance_key`]) was sent a prompt whose prefix
/// keys are `keys`, in prompt order (so the receiver can rebuild the prefix chain).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The instance chosen, as an [`instance_key`].
    pub instance: u64,
    /// The prompt's prefix keys, first block first.
    #[serde(with = "fixed_keys")]
    pub keys: Vec<BlockKey>,
}

/// A batch of decisions, the value of one `d:` gossip key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BatchWire {
    /// First version.
    V1 {
        /// When the publishing router closed the batch (its wall clock, ms since the Unix
        /// epoch); receivers use it for convergence measurements only.
        made_at_ms: u64,
        /// The decisions, in the order they were made.
        decisions: Vec<Decision>,
    },
}

/// A router's own in-flight load per instance, the value of its `load` gossip key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoadWire {
    /// First version.
    V1 {
        /// `(instance key, in_flight, pending_prefill_tokens)`; instances left out have
        /// no load from this router.
        entries: Vec<(u64, u32, u64)>,
    },
}

impl LoadWire {
    /// The wire form of `entries`.
    pub fn from_loads(entries: &[(u64, InstanceLoad)]) -> Self {
        LoadWire::V1 {
            entries: entries
                .iter()
                .map(|(k, l)| (*k, l.in_flight, l.pending_prefill_tokens))
                .collect(),
        }
    }

    /// The loads this value carries.
    pub fn into_loads(self) -> Vec<(u64, InstanceLoad)> {
        match self {
            LoadWire::V1 { entries } => entries
                .into_iter()
                .map(|(k, in_flight, pending_prefill_tokens)| {
                    (
                        k,
                        InstanceLoad {
                            in_flight,
                            pending_prefill_tokens,
                        },
                    )
                })
                .collect(),
        }
    }
}

/// A router's index digest, the value of its `applied` gossip key: for each origin (a
/// router incarnation), the highest decision batch seq it has applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AppliedWire {
    /// First version.
    V1 {
        /// `(origin, highest applied seq)`, sorted by origin.
        applied: Vec<(String, u64)>,
    },
}

/// Why a gossiped value could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// The value is longer than [`MAX_DECODE_BYTES`].
    #[error("encoded value of {0} bytes exceeds the {MAX_DECODE_BYTES}-byte limit")]
    TooLarge(usize),
    /// The value is not valid base64 (standard alphabet, no padding).
    #[error("invalid base64: {0}")]
    Base64(String),
    /// The bytes are not a valid postcard encoding of the expected type (also: an unknown,
    /// newer variant).
    #[error("invalid postcard payload: {0}")]
    Postcard(String),
    /// The payload decoded but bytes were left over.
    #[error("{0} trailing bytes after the payload")]
    Trailing(usize),
}

/// Serializes `v` with postcard, then base64.
pub fn encode<T: Serialize>(v: &T) -> String {
    // Serializing plain data into a Vec cannot fail (no maps with non-string keys, no
    // sequences of unknown length); an empty string would then fail to decode, never panic.
    let bytes = postcard::to_allocvec(v).unwrap_or_default();
    STANDARD_NO_PAD.encode(bytes)
}

/// Decodes a value written by [`encode`]. Never panics on any input.
pub fn decode<T: DeserializeOwned>(s: &str) -> Result<T, WireError> {
    if s.len() > MAX_DECODE_BYTES {
        return Err(WireError::TooLarge(s.len()));
    }
    let bytes = STANDARD_NO_PAD
        .decode(s.as_bytes())
        .map_err(|e| WireError::Base64(e.to_string()))?;
    let (value, rest) =
        postcard::take_from_bytes::<T>(&bytes).map_err(|e| WireError::Postcard(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Trailing(rest.len()));
    }
    Ok(value)
}

/// Length of `n` bytes once base64-encoded without padding.
pub fn base64_len(n: usize) -> usize {
    (n * 4).div_ceil(3)
}

/// Bytes of the postcard varint encoding of `v`.
fn varint_len(v: u64) -> usize {
    (64 - v.max(1).leading_zeros() as usize).div_ceil(7)
}

/// Postcard size (before base64) of a decision with `keys` keys for `instance`.
fn decision_raw_len(instance: u64, keys: usize) -> usize {
    varint_len(instance) + varint_len(8 * keys as u64) + 8 * keys
}

/// Upper bound on the postcard bytes of a [`BatchWire::V1`] around its decisions: variant
/// tag (1), `made_at_ms` varint (at most 10), decision count varint (at most 5).
const BATCH_HEADER_RAW: usize = 1 + 10 + 5;

/// Collects decisions into batches whose encoded [`BatchWire`] stays within `max_bytes`
/// (the base64 string's length, as stored in gossip), closing a batch when the next
/// decision would not fit, or once its first decision is `max_delay_ms` old.
///
/// Bounds: a decision too large to fit in an empty batch on its own is truncated to its
/// first keys (a prefix of a prompt is still a valid prefix chain, and matching walks from
/// the first block); a decision that cannot fit even one key, or has no keys, is dropped.
/// [`Batcher::truncated`] and [`Batcher::dropped`] count both.
#[derive(Debug)]
pub struct Batcher {
    max_bytes: usize,
    max_delay_ms: u64,
    /// Batches closed because they were full, oldest first.
    ready: Vec<Vec<Decision>>,
    pending: Vec<Decision>,
    /// Postcard bytes of `pending`'s decisions.
    pending_raw: usize,
    /// When `pending`'s first decision was pushed.
    opened_at_ms: u64,
    truncated: u64,
    dropped: u64,
}

impl Batcher {
    /// A batcher for batches of at most `max_bytes` encoded bytes, closed at the latest
    /// `max_delay_ms` after their first decision.
    pub fn new(max_bytes: usize, max_delay_ms: u64) -> Self {
        Batcher {
            max_bytes,
            max_delay_ms,
            ready: Vec::new(),
            pending: Vec::new(),
            pending_raw: 0,
            opened_at_ms: 0,
            truncated: 0,
            dropped: 0,
        }
    }

    /// Whether `raw` decision bytes fit in one batch.
    fn fits(&self, raw: usize) -> bool {
        base64_len(BATCH_HEADER_RAW + raw) <= self.max_bytes
    }

    /// Adds a decision made at `now_ms`.
    pub fn push(&mut self, now_ms: u64, mut decision: Decision) {
        let mut raw = decision_raw_len(decision.instance, decision.keys.len());
        if !self.fits(raw) {
            // Alone it does not fit: keep the longest prefix of its keys that does.
            let mut keep = decision.keys.len();
            while keep > 0 && !self.fits(decision_raw_len(decision.instance, keep)) {
                // Each key is 8 bytes: jump close to the answer, then step.
                let over = base64_len(BATCH_HEADER_RAW + decision_raw_len(decision.instance, keep))
                    .saturating_sub(self.max_bytes);
                keep = keep.saturating_sub((over * 3 / 4 / 8).max(1));
            }
            decision.keys.truncate(keep);
            raw = decision_raw_len(decision.instance, keep);
            self.truncated += 1;
        }
        if decision.keys.is_empty() {
            self.dropped += 1;
            return;
        }
        if !self.fits(self.pending_raw + raw) {
            self.ready.push(std::mem::take(&mut self.pending));
            self.pending_raw = 0;
        }
        if self.pending.is_empty() {
            self.opened_at_ms = now_ms;
        }
        self.pending_raw += raw;
        self.pending.push(decision);
    }

    /// A batch to publish now, if any: a full one first, else the open one once its first
    /// decision is `max_delay_ms` old.
    pub fn take_due(&mut self, now_ms: u64) -> Option<Vec<Decision>> {
        if !self.ready.is_empty() {
            return Some(self.ready.remove(0));
        }
        if !self.pending.is_empty() && now_ms.saturating_sub(self.opened_at_ms) >= self.max_delay_ms
        {
            self.pending_raw = 0;
            return Some(std::mem::take(&mut self.pending));
        }
        None
    }

    /// Every batch held, full or not (each within `max_bytes`), oldest first; used at
    /// shutdown.
    pub fn take_all(&mut self) -> Vec<Vec<Decision>> {
        let mut all = std::mem::take(&mut self.ready);
        if !self.pending.is_empty() {
            all.push(std::mem::take(&mut self.pending));
        }
        self.pending_raw = 0;
        all
    }

    /// When the open batch falls due (ms), if one is open; full batches are due at once.
    pub fn next_due_ms(&self) -> Option<u64> {
        if !self.ready.is_empty() {
            return Some(0);
        }
        (!self.pending.is_empty()).then(|| self.opened_at_ms.saturating_add(self.max_delay_ms))
    }

    /// Whether no decision is held.
    pub fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.pending.is_empty()
    }

    /// Decisions cut to their first keys so far.
    pub fn truncated(&self) -> u64 {
        self.truncated
    }

    /// Decisions dropped so far (no key, or not even one key fits).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// Serde for `Vec<BlockKey>` as one byte string of 8-byte little-endian words.
mod fixed_keys {
    use super::BlockKey;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(keys: &[BlockKey], s: S) -> Result<S::Ok, S::Error> {
        let mut bytes = Vec::with_capacity(keys.len() * 8);
        for k in keys {
            bytes.extend_from_slice(&k.0.to_le_bytes());
        }
        bytes.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BlockKey>, D::Error> {
        let bytes = Vec::<u8>::deserialize(d)?;
        if bytes.len() % 8 != 0 {
            return Err(serde::de::Error::invalid_length(
                bytes.len(),
                &"a multiple of 8 bytes",
            ));
        }
        Ok(bytes
            .chunks_exact(8)
            .map(|c| {
                let mut w = [0u8; 8];
                w.copy_from_slice(c);
                BlockKey(u64::from_le_bytes(w))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys(n: u64) -> Vec<BlockKey> {
        (0..n)
            .map(|i| BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef))
            .collect()
    }

    fn decision(instance: u64, n: u64) -> Decision {
        Decision {
            instance,
            keys: keys(n),
        }
    }

    #[test]
    fn instance_key_is_stable() {
        let a = instance_key("http://10.0.0.1:8000");
        assert_eq!(a, instance_key("http://10.0.0.1:8000"));
        assert_ne!(a, instance_key("http://10.0.0.2:8000"));
        let hash = blake3::hash(b"http://10.0.0.1:8000");
        assert_eq!(a.to_le_bytes(), hash.as_bytes()[..8]);
    }

    #[test]
    fn values_round_trip() {
        let batch = BatchWire::V1 {
            made_at_ms: 1_790_000_000_123,
            decisions: vec![decision(u64::MAX, 3), decision(7, 0), decision(0, 40)],
        };
        assert_eq!(decode::<BatchWire>(&encode(&batch)), Ok(batch));
        let loads = [
            (
                1u64,
                InstanceLoad {
                    in_flight: 3,
                    pending_prefill_tokens: 900,
                },
            ),
            (u64::MAX, InstanceLoad::default()),
        ];
        let load = LoadWire::from_loads(&loads);
        let back: LoadWire = decode(&encode(&load)).unwrap();
        assert_eq!(back.into_loads(), loads.to_vec());
        let applied = AppliedWire::V1 {
            applied: vec![("router-1#17".into(), 4), (String::new(), u64::MAX)],
        };
        assert_eq!(decode::<AppliedWire>(&encode(&applied)), Ok(applied));
    }

    #[test]
    fn keys_cost_eight_bytes_each() {
        // A 32-block prompt: 256 bytes of keys + 2 length + 10 instance + 16 header.
        let batch = BatchWire::V1 {
            made_at_ms: u64::MAX,
            decisions: vec![decision(u64::MAX, 32)],
        };
        let raw = postcard::to_allocvec(&batch).unwrap().len();
        assert!(raw <= BATCH_HEADER_RAW + 256 + 2 + 10, "{raw}");
        assert_eq!(encode(&batch).len(), base64_len(raw));
    }

    #[test]
    fn garbage_is_an_error() {
        type Case<'a> = (&'a str, fn(&WireError) -> bool);
        let cases: &[Case] = &[
            ("", |e| matches!(e, WireError::Postcard(_))),
            ("!!!!", |e| matches!(e, WireError::Base64(_))),
            ("AAAA=", |e| matches!(e, WireError::Base64(_))),
            // Variant 1 does not exist.
            ("AQ", |e| matches!(e, WireError::Postcard(_))),
            // V1 with made_at 0, one decision whose key bytes are not a multiple of 8.
            (&STANDARD_NO_PAD.encode([0u8, 0, 1, 5, 3, 1, 2, 3]), |e| {
                matches!(e, WireError::Postcard(_))
            }),
            // A valid empty batch followed by a stray byte.
            (&STANDARD_NO_PAD.encode([0u8, 0, 0, 9]), |e| {
                matches!(e, WireError::Trailing(1))
            }),
            // Claims 2^32 decisions, has none.
            (
                &STANDARD_NO_PAD.encode([0u8, 0, 0xff, 0xff, 0xff, 0xff, 0x0f]),
                |e| matches!(e, WireError::Postcard(_)),
            ),
        ];
        for (input, want) in cases {
            let err = decode::<BatchWire>(input).unwrap_err();
            assert!(want(&err), "{input:?}: {err:?}");
        }
        let huge = "A".repeat(MAX_DECODE_BYTES + 1);
        assert_eq!(
            decode::<BatchWire>(&huge),
            Err(WireError::TooLarge(MAX_DECODE_BYTES + 1))
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let s = STANDARD_NO_PAD.encode(&bytes);
            let _ = decode::<BatchWire>(&s);
            let _ = decode::<LoadWire>(&s);
            let _ = decode::<AppliedWire>(&s);
            let raw = String::from_utf8_lossy(&bytes);
            let _ = decode::<BatchWire>(&raw);
        }

        #[test]
        fn batches_stay_within_budget(
            max_bytes in 16usize..2048,
            sizes in proptest::collection::vec((any::<u64>(), 0u64..300), 0..40),
        ) {
            let mut b = Batcher::new(max_bytes, 1_000);
            let mut pushed = 0u64;
            for (i, (instance, n)) in sizes.iter().enumerate() {
                b.push(i as u64, decision(*instance, *n));
                pushed += 1;
            }
            let mut out = 0u64;
            for batch in b.take_all() {
                prop_assert!(!batch.is_empty());
                out += batch.len() as u64;
                let s = encode(&BatchWire::V1 { made_at_ms: u64::MAX, decisions: batch });
                prop_assert!(s.len() <= max_bytes, "{} > {}", s.len(), max_bytes);
            }
            prop_assert_eq!(out + b.dropped(), pushed);
        }
    }

    #[test]
    fn batcher_closes_on_delay_and_size() {
        // Per row: (max_bytes, max_delay_ms, pushes as (now_ms, keys), take_due at, batch
        // sizes expected from successive take_due calls at that time).
        type Row = (usize, u64, &'static [(u64, u64)], u64, &'static [usize]);
        let rows: &[Row] = &[
            // Not due before the delay, due at it.
            (8192, 10, &[(0, 4), (5, 4)], 9, &[]),
            (8192, 10, &[(0, 4), (5, 4)], 10, &[2]),
            // The delay counts from the first decision of the batch.
            (8192, 10, &[(100, 4)], 109, &[]),
            // Each decision (32 keys) is ~270 raw bytes, ~360 encoded: 3 fit in 1100
            // bytes, the fourth opens a new batch, which is due only after the delay.
            (1100, 10, &[(0, 32), (0, 32), (0, 32), (0, 32)], 0, &[3]),
            (1100, 10, &[(0, 32), (0, 32), (0, 32), (0, 32)], 10, &[3, 1]),
            // Empty decisions are dropped.
            (8192, 0, &[(0, 0)], 0, &[]),
        ];
        for (max_bytes, delay, pushes, at, want) in rows {
            let mut b = Batcher::new(*max_bytes, *delay);
            for (now, n) in *pushes {
                b.push(*now, decision(1, *n));
            }
            let mut got = Vec::new();
            while let Some(batch) = b.take_due(*at) {
                got.push(batch.len());
            }
            assert_eq!(&got, want, "row {max_bytes} {delay} {pushes:?} at {at}");
        }
    }

    #[test]
    fn oversized_decision_is_truncated_to_its_first_keys() {
        let mut b = Batcher::new(300, 0);
        b.push(0, decision(5, 1000));
        let batch = b.take_due(0).unwrap();
        assert_eq!(batch.len(), 1);
        let kept = batch[0].keys.len();
        assert!(kept > 0 && kept < 1000);
        assert_eq!(batch[0].keys, keys(1000)[..kept]);
        let encoded = encode(&BatchWire::V1 {
            made_at_ms: u64::MAX,
            decisions: batch.clone(),
        });
        assert!(encoded.len() <= 300);
        // One more key would not have fitted.
        let mut longer = batch;
        longer[0].keys = keys(kept as u64 + 1);
        let encoded = encode(&BatchWire::V1 {
            made_at_ms: u64::MAX,
            decisions: longer,
        });
        // (The estimate reserves 4 header bytes the encoding did not need here.)
        assert!(encoded.len() > 290, "{}", encoded.len());
        assert_eq!(b.truncated(), 1);
        // A budget too small for a single key drops the decision.
        let mut tiny = Batcher::new(24, 0);
        tiny.push(0, decision(u64::MAX, 3));
        assert_eq!(tiny.take_all(), Vec::<Vec<Decision>>::new());
        assert_eq!(tiny.dropped(), 1);
    }
}
