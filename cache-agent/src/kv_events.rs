//! Engine KV events in vLLM's format (SGLang publishes the same): decoding what an engine
//! publishes, and encoding it (for engine-sim's publisher and the tests).
//!
//! On the wire (ZMQ PUB) a message is three frames: a topic, an 8-byte big-endian sequence
//! number, and a msgpack `EventBatch`. msgspec, which vLLM encodes with, gives two shapes
//! and releases have used both (read from each release's `vllm/distributed/kv_events.py`):
//!
//! - the batch is an array `[ts, events, data_parallel_rank?]` in every vLLM release
//!   (`array_like=True`; vLLM's `ZmqEventPublisher` fills in the rank, so it is there); a
//!   map `{"ts", "events", "data_parallel_rank"?}` is read too;
//! - each event is a tagged array `["BlockStored", block_hashes, parent_block_hash,
//!   token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, …]` in vLLM
//!   up to 0.23 (checked: 0.11.0, 0.22.1, 0.23.0), and a tagged map `{"type":
//!   "BlockStored", "block_hashes": …, …}` from 0.24 on (checked: 0.24.0, 0.26.0, 0.33.0:
//!   `KVCacheEvent` lost `array_like`); trailing fields with their default value are
//!   omitted in both. [`Shape::VllmMaps`] encodes what 0.33 sends, byte for byte.
//!
//! The replay socket's answers changed too ([`parse_replay`]): `[empty, sequence, batch]`
//! up to vLLM 0.25 (checked: 0.24.0, 0.25.1), `[empty, topic, sequence, batch]` from 0.26
//! (checked: 0.26.0 to 0.33.0).
//!
//! Events: `BlockStored` (block hashes, parent hash, token ids, block size, LoRA id and name,
//! medium, extra keys per block), `BlockRemoved` (block hashes, medium) and
//! `AllBlocksCleared`. A `BlockStored` of block size 0 without tokens is decoded: vLLM's
//! `OffloadingConnector` publishes such placeholders for chunks it cannot describe (0.33
//! without `self_describing_kv_events`), and refusing them would refuse the GPU events
//! batched with them; `ingest` skips them. A block hash is an integer or bytes (`ExternalBlockHash`); both
//! become [`EngineHash`] bytes, so they compare equal however they were sent. An unknown
//! event kind or field is counted in [`Decoded::unknown`] and skipped; a batch that is not
//! msgpack, or an event missing a field it needs, is a [`DecodeError`] (the whole batch:
//! a sequence of events must not be applied in part).
//!
//! Pure: bytes in, values out. Bounded: the decoder nests at most [`MAX_DEPTH`] deep and
//! never preallocates from a declared length (rmpv's reader), so a huge declared array
//! costs only the bytes actually sent; callers bound the message size.

use std::io::Cursor;

use rmpv::Value;

/// Deepest nesting accepted (a batch is 4 deep; extra keys add a few).
pub const MAX_DEPTH: usize = 16;

/// An engine's block hash, as bytes: an integer hash is its 8-byte big-endian form (two's
/// complement for a negative one), so an engine that switches between integer and 8-byte
/// hashes names the same block the same way. Never a warmpath key (DESIGN.md).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub Vec<u8>);

impl EngineHash {
    /// A 64-bit hash as the events carry it: its 8 bytes, big-endian. How engine-sim names
    /// its blocks in its events, and how the agent reads a block-API key (record 0124).
    pub fn of_u64(h: u64) -> Self {
        EngineHash(h.to_be_bytes().to_vec())
    }

    /// The 64-bit hash whose form it is ([`EngineHash::of_u64`]); `None` unless 8 bytes.
    pub fn as_u64(&self) -> Option<u64> {
        <[u8; 8]>::try_from(self.0.as_slice())
            .ok()
            .map(u64::from_be_bytes)
    }

    /// Whether it is the hash 0 (an int 0, or bytes of zeros): what LMCache 0.5.6 names as
    /// the parent of the first chunk of a store that starts after chunks it holds.
    pub fn is_zero(&self) -> bool {
        !self.0.is_empty() && self.0.iter().all(|b| *b == 0)
    }
}

/// One event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    Stored {
        block_hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
        /// Per block, the extra keys the engine hashed with it (multimodal hashes, LoRA
        /// name, cache salt on a chain's first block); strings only, others dropped.
        extra_keys: Vec<Vec<String>>,
    },
    Removed {
        block_hashes: Vec<EngineHash>,
        medium: Option<String>,
    },
    Cleared,
}

/// A decoded batch.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Decoded {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
    /// Events of unknown kinds and fields of unknown names, skipped.
    pub unknown: u64,
}

/// Why a batch was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    NotMsgpack(String),
    #[error("{0} bytes after the batch")]
    Trailing(usize),
    #[error("malformed batch: {0}")]
    Batch(String),
    #[error("malformed {kind} event: {why}")]
    Event { kind: &'static str, why: String },
}

/// A KV-event message's frames as vLLM's publisher sends them: the topic (empty, as
/// engines publish by default), the 8-byte big-endian sequence number, the batch.
pub fn message(seq: u64, batch: bytes::Bytes) -> Vec<bytes::Bytes> {
    vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
        batch,
    ]
}

/// The sequence number and batch of a message's frames, when they have the shape of
/// [`message`] (any topic).
pub fn parse_message(frames: &[bytes::Bytes]) -> Option<(u64, &bytes::Bytes)> {
    match frames {
        [_topic, seq, batch] => Some((u64::from_be_bytes(seq[..].try_into().ok()?), batch)),
        _ => None,
    }
}

/// The sequence number and batch of one answer from an engine's replay socket, as a
/// DEALER receives it: `[empty, sequence, batch]` (vLLM up to 0.25) or `[empty, topic,
/// sequence, batch]` (vLLM 0.26 on). The end marker is the sequence -1 (all ones) with an
/// empty batch.
pub fn parse_replay(frames: &[bytes::Bytes]) -> Option<(u64, &bytes::Bytes)> {
    match frames {
        [empty, seq, batch] | [empty, _, seq, batch] if empty.is_empty() => {
            Some((u64::from_be_bytes(seq[..].try_into().ok()?), batch))
        }
        _ => None,
    }
}

/// Decodes one `EventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<Decoded, DecodeError> {
    let mut rd = Cursor::new(payload);
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    let rest = payload.len() - rd.position() as usize;
    if rest > 0 {
        return Err(DecodeError::Trailing(rest));
    }
    let mut out = Decoded::default();
    let (ts, events, rank) = match value {
        Value::Array(mut a) => {
            if a.len() < 2 {
                return Err(DecodeError::Batch(format!("array of {} fields", a.len())));
            }
            let rank = if a.len() > 2 {
                Some(a.swap_remove(2))
            } else {
                None
            };
            let events = a.swap_remove(1);
            (a.swap_remove(0), events, rank)
        }
        Value::Map(m) => {
            let (mut ts, mut events, mut rank) = (None, None, None);
            for (k, v) in m {
                match k.as_str() {
                    Some("ts") => ts = Some(v),
                    Some("events") => events = Some(v),
                    Some("data_parallel_rank") => rank = Some(v),
                    _ => out.unknown += 1,
                }
            }
            (
                ts.ok_or_else(|| DecodeError::Batch("no ts".into()))?,
                events.ok_or_else(|| DecodeError::Batch("no events".into()))?,
                rank,
            )
        }
        other => {
            return Err(DecodeError::Batch(format!(
                "a batch is not {}",
                kind_of(&other)
            )))
        }
    };
    out.ts = ts
        .as_f64()
        .or_else(|| ts.as_i64().map(|i| i as f64))
        .ok_or_else(|| DecodeError::Batch("ts is not a number".into()))?;
    out.data_parallel_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| DecodeError::Batch("data_parallel_rank is not an integer".into()))?,
        ),
    };
    let Value::Array(events) = events else {
        return Err(DecodeError::Batch("events is not an array".into()));
    };
    for e in events {
        match decode_event(e, &mut out.unknown)? {
            Some(ev) => out.events.push(ev),
            None => out.unknown += 1,
        }
    }
    Ok(out)
}

/// The fields of an event by name, from either shape; None for an unknown kind.
fn decode_event(v: Value, unknown: &mut u64) -> Result<Option<KvEvent>, DecodeError> {
    const STORED: &[&str] = &[
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ];
    const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx"];
    let (tag, fields): (String, Vec<(String, Value)>) = match v {
        Value::Array(mut a) if !a.is_empty() => {
            let tag = a.remove(0);
            let tag = tag.as_str().unwrap_or_default().to_string();
            let names = match tag.as_str() {
                "BlockStored" => STORED,
                "BlockRemoved" => REMOVED,
                _ => &[][..],
            };
            if a.len() > names.len() {
                *unknown += (a.len() - names.len()) as u64;
            }
            let fields = names.iter().map(|n| n.to_string()).zip(a).collect();
            (tag, fields)
        }
        Value::Map(m) => {
            let mut tag = String::new();
            let mut fields = Vec::new();
            for (k, v) in m {
                match k.as_str() {
                    Some("type") => tag = v.as_str().unwrap_or_default().to_string(),
                    Some(name) => fields.push((name.to_string(), v)),
                    None => *unknown += 1,
                }
            }
            (tag, fields)
        }
        _ => return Ok(None),
    };
    let field = |name: &str| fields.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let known: &[&str] = match tag.as_str() {
        "BlockStored" => STORED,
        "BlockRemoved" => REMOVED,
        "AllBlocksCleared" => &[],
        _ => return Ok(None),
    };
    *unknown += fields
        .iter()
        .filter(|(n, _)| !known.contains(&n.as_str()))
        .count() as u64;
    let err = |kind: &'static str, why: &str| DecodeError::Event {
        kind,
        why: why.to_string(),
    };
    let opt_str = |name: &str| field(name).and_then(|v| v.as_str()).map(str::to_string);
    Ok(Some(match tag.as_str() {
        "BlockStored" => {
            let hashes =
                hashes(field("block_hashes")).ok_or_else(|| err("BlockStored", "block_hashes"))?;
            let parent = match field("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(v) => Some(hash(v).ok_or_else(|| err("BlockStored", "parent_block_hash"))?),
            };
            let token_ids = match field("token_ids") {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| err("BlockStored", "token_ids holds a non-token"))?,
                _ => return Err(err("BlockStored", "token_ids")),
            };
            let block_size = field("block_size")
                .and_then(|v| v.as_u64())
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| err("BlockStored", "block_size"))?;
            let extra_keys = match field("extra_keys") {
                Some(Value::Array(per_block)) => per_block
                    .iter()
                    .map(|k| match k {
                        Value::Array(items) => items
                            .iter()
                            .filter_map(|i| i.as_str().map(str::to_string))
                            .collect(),
                        _ => Vec::new(),
                    })
                    .collect(),
                _ => Vec::new(),
            };
            KvEvent::Stored {
                block_hashes: hashes,
                parent,
                token_ids,
                block_size,
                lora_id: field("lora_id").and_then(|v| v.as_i64()),
                medium: opt_str("medium"),
                lora_name: opt_str("lora_name"),
                extra_keys,
            }
        }
        "BlockRemoved" => KvEvent::Removed {
            block_hashes: hashes(field("block_hashes"))
                .ok_or_else(|| err("BlockRemoved", "block_hashes"))?,
            medium: opt_str("medium"),
        },
        _ => KvEvent::Cleared,
    }))
}

fn hash(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Binary(b) => Some(EngineHash(b.clone())),
        Value::Integer(i) => i
            .as_u64()
            .map(|u| EngineHash(u.to_be_bytes().to_vec()))
            .or_else(|| i.as_i64().map(|s| EngineHash(s.to_be_bytes().to_vec()))),
        _ => None,
    }
}

fn hashes(v: Option<&Value>) -> Option<Vec<EngineHash>> {
    match v? {
        Value::Array(a) => a.iter().map(hash).collect(),
        _ => None,
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}

/// Which of msgspec's shapes to encode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Batch and events as arrays (`array_like=True`).
    Array,
    /// Batch and events as maps, events tagged by `"type"`.
    Map,
    /// What vLLM 0.24 and later publish, byte for byte as 0.33's block pool and
    /// `ZmqEventPublisher` do: the batch an array `[ts, events, data_parallel_rank]`
    /// (rank 0), each event a map tagged by `"type"` with vLLM's field order and defaults
    /// omitted; `group_idx` 0 (a model with one KV-cache group); a block without extra
    /// keys has `nil` in `extra_keys`.
    VllmMaps,
}

/// Encodes a batch the way an engine publishes it.
pub fn encode_batch(ts: f64, events: &[KvEvent], shape: Shape) -> Vec<u8> {
    let hash_v = |h: &EngineHash| match <[u8; 8]>::try_from(h.0.as_slice()) {
        Ok(b) => Value::from(u64::from_be_bytes(b)),
        Err(_) => Value::Binary(h.0.clone()),
    };
    let opt_s = |s: &Option<String>| s.as_ref().map_or(Value::Nil, |s| Value::from(s.as_str()));
    let event = |e: &KvEvent| -> (&'static str, Vec<(&'static str, Value)>) {
        match e {
            KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
            } => {
                let mut f = vec![
                    (
                        "block_hashes",
                        Value::Array(block_hashes.iter().map(hash_v).collect()),
                    ),
                    (
                        "parent_block_hash",
                        parent.as_ref().map_or(Value::Nil, hash_v),
                    ),
                    (
                        "token_ids",
                        Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    ("block_size", Value::from(*block_size)),
                    ("lora_id", lora_id.map_or(Value::Nil, Value::from)),
                    ("medium", opt_s(medium)),
                    ("lora_name", opt_s(lora_name)),
                ];
                if !extra_keys.is_empty() {
                    f.push((
                        "extra_keys",
                        Value::Array(
                            extra_keys
                                .iter()
                                .map(|k| match shape {
                                    Shape::VllmMaps if k.is_empty() => Value::Nil,
                                    _ => Value::Array(
                                        k.iter().map(|s| Value::from(s.as_str())).collect(),
                                    ),
                                })
                                .collect(),
                        ),
                    ));
                }
                if shape == Shape::VllmMaps {
                    f.push(("group_idx", Value::from(0)));
                }
                ("BlockStored", f)
            }
            KvEvent::Removed {
                block_hashes,
                medium,
            } => {
                let mut f = vec![
                    (
                        "block_hashes",
                        Value::Array(block_hashes.iter().map(hash_v).collect()),
                    ),
                    ("medium", opt_s(medium)),
                ];
                if shape == Shape::VllmMaps {
                    f.push(("group_idx", Value::from(0)));
                }
                ("BlockRemoved", f)
            }
            KvEvent::Cleared => ("AllBlocksCleared", Vec::new()),
        }
    };
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    if shape == Shape::VllmMaps {
        // By hand, for msgspec's headers: it sizes a struct's map header by the fields the
        // type has, not by those written, so a `BlockStored` (15 fields and the tag) always
        // has a 16-bit map header, even with its defaults omitted.
        out.extend_from_slice(&[0x93, 0xcb]);
        out.extend_from_slice(&ts.to_bits().to_be_bytes());
        header(&mut out, [0x90, 0xdc, 0xdd], events.len());
        for e in events {
            let (tag, fields) = event(e);
            let n = fields.len() + 1;
            match tag {
                "BlockStored" => {
                    out.push(0xde);
                    out.extend_from_slice(&(n as u16).to_be_bytes());
                }
                _ => header(&mut out, [0x80, 0xde, 0xdf], n),
            }
            let _ = rmpv::encode::write_value(&mut out, &Value::from("type"));
            let _ = rmpv::encode::write_value(&mut out, &Value::from(tag));
            for (k, v) in fields {
                let _ = rmpv::encode::write_value(&mut out, &Value::from(k));
                let _ = rmpv::encode::write_value(&mut out, &v);
            }
        }
        out.push(0x00); // data_parallel_rank 0, which vLLM's publisher fills in
        return out;
    }
    let events = Value::Array(
        events
            .iter()
            .map(|e| {
                let (tag, fields) = event(e);
                match shape {
                    Shape::Array => Value::Array(
                        std::iter::once(Value::from(tag))
                            .chain(fields.into_iter().map(|(_, v)| v))
                            .collect(),
                    ),
                    _ => Value::Map(
                        std::iter::once((Value::from("type"), Value::from(tag)))
                            .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                            .collect(),
                    ),
                }
            })
            .collect(),
    );
    let batch = match shape {
        Shape::Array => Value::Array(vec![Value::F64(ts), events]),
        _ => Value::Map(vec![
            (Value::from("ts"), Value::F64(ts)),
            (Value::from("events"), events),
        ]),
    };
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// A msgpack array or map header for `n` items: `kinds` is the fix form's base, then the
/// 16-bit and 32-bit forms' markers.
fn header(out: &mut Vec<u8>, kinds: [u8; 3], n: usize) {
    if n < 16 {
        out.push(kinds[0] | n as u8);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(kinds[1]);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(kinds[2]);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> EngineHash {
        EngineHash(n.to_be_bytes().to_vec())
    }

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::Stored {
                block_hashes: vec![h(1), h(2)],
                parent: None,
                token_ids: (0..32).collect(),
                block_size: 16,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: vec![vec!["salt-a".into()], vec![]],
            },
            KvEvent::Stored {
                block_hashes: vec![EngineHash(vec![0xab; 32])],
                parent: Some(h(2)),
                token_ids: (32..48).collect(),
                block_size: 16,
                lora_id: Some(3),
                medium: None,
                lora_name: Some("adapter".into()),
                extra_keys: vec![],
            },
            KvEvent::Removed {
                block_hashes: vec![h(2)],
                medium: Some("GPU".into()),
            },
            KvEvent::Cleared,
        ]
    }

    #[test]
    fn both_shapes_round_trip() {
        for shape in [Shape::Array, Shape::Map, Shape::VllmMaps] {
            let bytes = encode_batch(12.5, &sample(), shape);
            let d = decode_batch(&bytes).unwrap();
            assert_eq!(d.events, sample(), "{shape:?}");
            assert_eq!(d.ts, 12.5);
            assert_eq!(d.unknown, 0);
        }
    }

    #[test]
    fn vllm_maps_are_what_vllm_033_sends() {
        // vLLM 0.33's msgspec bytes for `KVEventBatch(ts=1.0, events=[AllBlocksCleared()],
        // data_parallel_rank=0)` (shared/notes/lmcache-on-cpu, with the rank its publisher
        // fills in).
        let want = "93cb3ff000000000000091 81a474797065b0416c6c426c6f636b73436c656172656400";
        let want: Vec<u8> = (0..want.replace(' ', "").len() / 2)
            .map(|i| u8::from_str_radix(&want.replace(' ', "")[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        assert_eq!(
            encode_batch(1.0, &[KvEvent::Cleared], Shape::VllmMaps),
            want
        );
        let d = decode_batch(&want).unwrap();
        assert_eq!(
            (d.events, d.data_parallel_rank),
            (vec![KvEvent::Cleared], Some(0))
        );
    }

    #[test]
    fn placeholders_decode_and_replay_answers_of_both_eras_parse() {
        // The OffloadingConnector's placeholder: block size 0, no tokens.
        let placeholder = Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            ("block_hashes".into(), Value::Array(vec![9.into()])),
            ("parent_block_hash".into(), Value::Nil),
            ("token_ids".into(), Value::Array(vec![])),
            ("block_size".into(), 0.into()),
            ("lora_id".into(), Value::Nil),
            ("medium".into(), "CPU".into()),
            ("lora_name".into(), Value::Nil),
            ("group_idx".into(), 0.into()),
        ]);
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![placeholder])]);
        let d = decode_batch(&pack(&batch)).unwrap();
        assert!(matches!(
            d.events[..],
            [KvEvent::Stored { block_size: 0, .. }]
        ));
        let b = |s: &[u8]| bytes::Bytes::copy_from_slice(s);
        let seq = 7u64.to_be_bytes();
        let old = [b(b""), b(&seq), b(b"x")];
        let new = [b(b""), b(b"topic"), b(&seq), b(b"x")];
        for frames in [&old[..], &new[..]] {
            assert_eq!(
                parse_replay(frames).map(|(s, p)| (s, &p[..])),
                Some((7, &b"x"[..]))
            );
        }
        assert_eq!(parse_replay(&[b(b"x"), b(&seq), b(b"x")]), None);
        assert_eq!(parse_replay(&[b(b""), b(b"x")]), None);
    }

    fn pack(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn what_vllm_sends_today_decodes() {
        // A map-shaped event with vLLM's newer fields and one field nobody knows; an
        // unknown event kind; an array batch with a data-parallel rank.
        let stored = Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            (
                "block_hashes".into(),
                Value::Array(vec![Value::Binary(vec![7; 32])]),
            ),
            ("parent_block_hash".into(), Value::Nil),
            ("token_ids".into(), Value::Array(vec![1.into(), 2.into()])),
            ("block_size".into(), 2.into()),
            ("lora_id".into(), Value::Nil),
            ("medium".into(), "GPU".into()),
            ("lora_name".into(), Value::Nil),
            ("group_idx".into(), 0.into()),
            ("kv_cache_spec_kind".into(), "full_attention".into()),
            ("future_field".into(), 1.into()),
        ]);
        let odd = Value::Map(vec![("type".into(), "BlockMoved".into())]);
        let batch = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![stored, odd]),
            3.into(),
        ]);
        let d = decode_batch(&pack(&batch)).unwrap();
        assert_eq!(d.events.len(), 1);
        assert_eq!(d.unknown, 2, "future_field and BlockMoved");
        assert_eq!(d.data_parallel_rank, Some(3));
        // The same hash as an integer and as 8 bytes is one hash.
        assert_eq!(
            hash(&Value::from(5u64)),
            Some(EngineHash(5u64.to_be_bytes().to_vec()))
        );
    }

    #[test]
    fn bad_batches_are_refused_whole() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![0x92, 0xcb], "not msgpack"),
            (vec![0xdd, 0xff, 0xff, 0xff, 0xff], "not msgpack"),
            (pack(&Value::from(1)), "not an integer"),
            (pack(&Value::Array(vec![Value::F64(0.0)])), "array of 1"),
            (
                pack(&Value::Array(vec![Value::F64(0.0), 1.into()])),
                "events is not",
            ),
            (
                pack(&Value::Array(vec![
                    Value::F64(0.0),
                    Value::Array(vec![Value::Array(vec![
                        "BlockStored".into(),
                        Value::Array(vec![1.into()]),
                    ])]),
                ])),
                "token_ids",
            ),
            (
                pack(&Value::Array(vec![
                    Value::F64(0.0),
                    Value::Array(vec![Value::Array(vec!["BlockRemoved".into(), "x".into()])]),
                ])),
                "block_hashes",
            ),
            (
                [
                    pack(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])])),
                    vec![0],
                ]
                .concat(),
                "after",
            ),
        ];
        for (bytes, want) in cases {
            let e = decode_batch(&bytes).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        // Nesting beyond the limit.
        let mut deep = Value::Nil;
        for _ in 0..40 {
            deep = Value::Array(vec![deep]);
        }
        assert!(decode_batch(&pack(&deep)).is_err());
    }
}
