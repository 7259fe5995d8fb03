//! What a HyperPod API request says, read from its method, raw path and query: pure
//! parsing and the lease-id codec, no I/O.
//!
//! Keys arrive as LMCache writes them, `urllib.parse.quote(CacheEngineKey.to_string(),
//! safe="")`, then as aiohttp's URL library normalises them: `%40` goes out as `@`, `%2F`
//! stays. So a key segment is what RFC 3986 allows in a path segment: unreserved
//! characters, sub-delimiters, `:`, `@` and `%XX` escapes. Anything else (a space, a
//! quote, `<`, a `%` without two hex digits, a byte over 127) is refused, as is a key that
//! decodes to invalid UTF-8, to a control character, or to more than [`MAX_KEY_BYTES`].
//!
//! Lease ids are 48 hex digits: the segment's generation, the lease's number and a keyed
//! blake3 tag over both. The tag's key is drawn at start, so an id cannot be guessed or
//! forged, and one from an earlier run of the agent (another generation) is told apart from
//! one that was never issued.

use std::fmt;

use crate::kv_events::EngineHash;

/// The longest key accepted, decoded (LMCache's keys are a model name and a few numbers).
pub const MAX_KEY_BYTES: usize = 1024;
/// The longest bucket name accepted.
pub const MAX_BUCKET_BYTES: usize = 64;

/// An object's name: its bucket and its decoded key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName {
    pub bucket: String,
    pub key: String,
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.bucket, self.key)
    }
}

impl ObjectName {
    /// The LMCache chunk hash this object's key names, as KV events carry it: a key is
    /// `CacheEngineKey.to_string()`, `model@world_size@worker_id@chunk_hash_hex@dtype`
    /// (a layer key adds `@layer_id`, tags add `@k%v` fields). An int hash is printed
    /// `{:x}` (maybe negative) and arrives in events as a msgpack integer, a bytes hash as
    /// its hex: both read here as [`EngineHash`] reads them in events. None when the key
    /// is not of that shape.
    pub fn chunk_hash(&self) -> Option<EngineHash> {
        let fields: Vec<&str> = self.key.split('@').filter(|f| !f.contains('%')).collect();
        let n = fields.len();
        if n < 5 {
            return None;
        }
        // A layer key ends in a layer number after the dtype.
        let at = if fields[n - 1].bytes().all(|b| b.is_ascii_digit()) {
            n - 3
        } else {
            n - 2
        };
        hash_from_hex(fields.get(at)?)
    }
}

/// `CacheEngineKey.to_string()` of an int chunk hash, as LMCache writes it:
/// `model@world_size@worker_id@{chunk_hash:x}@dtype`, a negative hash (Python's builtin
/// `hash` gives those) printed with a leading `-`. [`ObjectName::chunk_hash`] reads it back.
pub fn cache_engine_key(
    model: &str,
    world_size: u32,
    worker_id: u32,
    chunk_hash: i64,
    dtype: &str,
) -> String {
    let sign = if chunk_hash < 0 { "-" } else { "" };
    let hex = chunk_hash.unsigned_abs();
    format!("{model}@{world_size}@{worker_id}@{sign}{hex:x}@{dtype}")
}

/// What `urllib.parse.quote(s, safe="")` leaves as it is: letters, digits and `_.-~`.
const QUOTE_KEEPS: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'_')
    .remove(b'.')
    .remove(b'-')
    .remove(b'~');

/// A key as LMCache's connector puts it in a path, `urllib.parse.quote(key, safe="")`:
/// every byte but letters, digits and `_.-~` escaped (`@` as `%40`). [`decode_key`] reads
/// it back.
pub fn encode_key(key: &str) -> String {
    percent_encoding::utf8_percent_encode(key, QUOTE_KEEPS).to_string()
}

/// `chunk_hash_hex` back to the bytes events carry: an int that fits 64 bits as its
/// big-endian bytes (unsigned or, negative, two's complement), a longer even-length hex
/// as its bytes.
fn hash_from_hex(hex: &str) -> Option<EngineHash> {
    if let Some(neg) = hex.strip_prefix('-') {
        let v = u64::from_str_radix(neg, 16).ok()?;
        let v = i64::try_from(v)
            .ok()
            .or((v == 1 << 63).then_some(i64::MIN))?;
        return Some(EngineHash((v.wrapping_neg()).to_be_bytes().to_vec()));
    }
    if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    if hex.len() <= 16 {
        return Some(EngineHash(
            u64::from_str_radix(hex, 16).ok()?.to_be_bytes().to_vec(),
        ));
    }
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect::<Option<Vec<u8>>>()
        .map(EngineHash)
}

/// Bytes of LMCache's `RemoteMetadata` header at the start of every object.
pub const METADATA_BYTES: u64 = 28;

/// LMCache's default HyperPod bucket (`sagemaker_hyperpod_bucket`): `lm://` stores its
/// objects under it, and engine-sim's HyperPod mode puts there, as LMCache does.
pub const LMCACHE_BUCKET: &str = "lmcache";

/// What an object's `RemoteMetadata` says besides its length: memory format, dtype code,
/// shape (LMCache's codes, passed through as they came).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub fmt: i32,
    pub dtype: i32,
    pub shape: [i32; 4],
}

impl Meta {
    /// Its fields in their order on the wire: fmt, dtype, shape.
    pub fn ints(&self) -> [i32; 6] {
        let [s0, s1, s2, s3] = self.shape;
        [self.fmt, self.dtype, s0, s1, s2, s3]
    }
}

/// The `RemoteMetadata` header of one group that starts every object (7 little-endian
/// i32: payload length, fmt, dtype, shape): what LMCache's connector writes, and what the
/// `lm://` front writes for it.
pub fn remote_metadata(length: u32, meta: Meta) -> [u8; METADATA_BYTES as usize] {
    let [fmt, dtype, s0, s1, s2, s3] = meta.ints();
    le_ints(&[length as i32, fmt, dtype, s0, s1, s2, s3])
}

/// The metadata of a stored object's header (its length is the store's).
pub fn parse_remote_metadata(b: &[u8; METADATA_BYTES as usize]) -> Meta {
    Meta {
        fmt: i32_at(b, 1),
        dtype: i32_at(b, 2),
        shape: [i32_at(b, 3), i32_at(b, 4), i32_at(b, 5), i32_at(b, 6)],
    }
}

/// The `i`-th little-endian i32 of `b` (LMCache's `struct` formats).
pub(crate) fn i32_at(b: &[u8], i: usize) -> i32 {
    i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

/// `ints` as consecutive little-endian i32s (`N` = 4 × ints).
pub(crate) fn le_ints<const N: usize>(ints: &[i32]) -> [u8; N] {
    let mut b = [0u8; N];
    for (i, v) in ints.iter().enumerate() {
        b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    b
}

/// The operations of the API.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `PUT /v1/kv/{bucket}/{key}`.
    Put(ObjectName),
    /// `POST /v1/kv/{bucket}/{key}/leases?ttl_s=`: `ttl_s` as given, if given.
    Lease {
        name: ObjectName,
        ttl_s: Option<f64>,
    },
    /// `POST /v1/leases/{id}/release`.
    Release(String),
    /// `GET /v1/health`: the segment's name, size and generation.
    Health,
}

/// Why a request names no operation; each says what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    #[error("no such route: {0}")]
    NoRoute(String),
    #[error("{path} does not take {method}")]
    Method { method: String, path: String },
    #[error("bucket {0:?} is not 1 to 64 of A-Z a-z 0-9 . _ -")]
    Bucket(String),
    #[error(
        "key segment {0:?} is not URL-safe: a key is percent-encoded, leaving only what a \
         URL path segment allows (A-Z a-z 0-9 - . _ ~ ! $ & ' ( ) * + , ; = : @)"
    )]
    KeyNotUrlSafe(String),
    #[error("key decodes to invalid UTF-8 or a control character")]
    KeyNotText,
    #[error("key is empty")]
    KeyEmpty,
    #[error("key of {0} bytes is longer than {MAX_KEY_BYTES}")]
    KeyTooLong(usize),
    #[error("ttl_s {0:?} is not a positive number of seconds")]
    Ttl(String),
}

/// Reads the operation from a request's method and raw (still percent-encoded) path and
/// query.
pub fn parse(method: &str, path: &str, query: Option<&str>) -> Result<Op, BadRequest> {
    let segs: Vec<&str> = path.split('/').collect();
    let wrong_method = || BadRequest::Method {
        method: method.to_string(),
        path: path.to_string(),
    };
    match segs.as_slice() {
        ["", "v1", "kv", bucket, key] => {
            if method != "PUT" {
                return Err(wrong_method());
            }
            Ok(Op::Put(name(bucket, key)?))
        }
        ["", "v1", "kv", bucket, key, "leases"] => {
            if method != "POST" {
                return Err(wrong_method());
            }
            let name = name(bucket, key)?;
            let mut ttl_s = None;
            for pair in query.unwrap_or("").split('&') {
                if let Some(v) = pair.strip_prefix("ttl_s=") {
                    let t: f64 = v.parse().map_err(|_| BadRequest::Ttl(v.to_string()))?;
                    if !(t.is_finite() && t > 0.0) {
                        return Err(BadRequest::Ttl(v.to_string()));
                    }
                    ttl_s = Some(t);
                }
                // timeout_ms is how long the client itself waits: nothing for the agent.
            }
            Ok(Op::Lease { name, ttl_s })
        }
        ["", "v1", "leases", id, "release"] => {
            if method != "POST" {
                return Err(wrong_method());
            }
            Ok(Op::Release((*id).to_string()))
        }
        ["", "v1", "health"] => {
            if method != "GET" {
                return Err(wrong_method());
            }
            Ok(Op::Health)
        }
        _ => Err(BadRequest::NoRoute(path.chars().take(200).collect())),
    }
}

fn name(bucket: &str, key: &str) -> Result<ObjectName, BadRequest> {
    let bucket_ok = !bucket.is_empty()
        && bucket.len() <= MAX_BUCKET_BYTES
        && bucket
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !bucket_ok {
        return Err(BadRequest::Bucket(bucket.chars().take(80).collect()));
    }
    Ok(ObjectName {
        bucket: bucket.to_string(),
        key: decode_key(key)?,
    })
}

/// A key path segment, decoded; see the module docs for what is refused.
pub fn decode_key(raw: &str) -> Result<String, BadRequest> {
    let b = raw.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len()
                && b[i + 1].is_ascii_hexdigit()
                && b[i + 2].is_ascii_hexdigit() =>
            {
                i += 3
            }
            c if is_pchar(c) => i += 1,
            _ => return Err(BadRequest::KeyNotUrlSafe(raw.chars().take(80).collect())),
        }
    }
    if raw.is_empty() {
        return Err(BadRequest::KeyEmpty);
    }
    let bytes: Vec<u8> = percent_encoding::percent_decode_str(raw).collect();
    if bytes.len() > MAX_KEY_BYTES {
        return Err(BadRequest::KeyTooLong(bytes.len()));
    }
    let key = String::from_utf8(bytes).map_err(|_| BadRequest::KeyNotText)?;
    if key.chars().any(char::is_control) {
        return Err(BadRequest::KeyNotText);
    }
    Ok(key)
}

/// A byte a path segment may hold as it is (RFC 3986 `pchar` less `%`): unreserved
/// characters, sub-delimiters, `:` and `@`. aiohttp (yarl) sends LMCache's `%40` as `@`.
fn is_pchar(c: u8) -> bool {
    c.is_ascii_alphanumeric()
        || matches!(
            c,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'@'
        )
}

/// Issues and checks lease ids (see the module docs).
#[derive(Clone)]
pub struct LeaseIds {
    generation: u64,
    key: [u8; 32],
}

impl fmt::Debug for LeaseIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseIds")
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// Why a lease id names no lease of this run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadLeaseId {
    #[error("{0:?} is not a lease id (48 hex digits)")]
    Malformed(String),
    #[error("lease id of an earlier run of the agent (segment generation {got}; this run is {want}): its objects are gone")]
    OtherGeneration { got: u64, want: u64 },
    #[error("lease id was not issued by this agent")]
    Forged,
}

impl LeaseIds {
    /// Ids for segment generation `generation`, tagged with `key` (secret, random).
    pub fn new(generation: u64, key: [u8; 32]) -> Self {
        LeaseIds { generation, key }
    }

    fn tag(&self, lease: u64) -> u64 {
        let mut m = [0u8; 16];
        m[..8].copy_from_slice(&self.generation.to_le_bytes());
        m[8..].copy_from_slice(&lease.to_le_bytes());
        let h = blake3::keyed_hash(&self.key, &m);
        u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
    }

    /// The id of lease number `lease`.
    pub fn encode(&self, lease: u64) -> String {
        format!(
            "{:016x}{:016x}{:016x}",
            self.generation,
            lease,
            self.tag(lease)
        )
    }

    /// The lease number `id` names, if this run issued it.
    pub fn decode(&self, id: &str) -> Result<u64, BadLeaseId> {
        let malformed = || BadLeaseId::Malformed(id.chars().take(64).collect());
        if id.len() != 48 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(malformed());
        }
        let part = |i: usize| u64::from_str_radix(&id[i * 16..(i + 1) * 16], 16);
        let (Ok(generation), Ok(lease), Ok(tag)) = (part(0), part(1), part(2)) else {
            return Err(malformed());
        };
        if generation != self.generation {
            return Err(BadLeaseId::OtherGeneration {
                got: generation,
                want: self.generation,
            });
        }
        // Compared as blake3 hashes (constant time), as the block API compares tokens.
        let want = self.tag(lease);
        if blake3::hash(&want.to_le_bytes()) != blake3::hash(&tag.to_le_bytes()) {
            return Err(BadLeaseId::Forged);
        }
        Ok(lease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_written_as_lmcache_writes_them_read_back() {
        // Python: f"{-8111776335910957595:x}" == "-7092d1997764721b".
        let key = cache_engine_key("org/m", 1, 0, -8111776335910957595, "bfloat16");
        assert_eq!(key, "org/m@1@0@-7092d1997764721b@bfloat16");
        assert_eq!(
            cache_engine_key("m", 2, 1, 0x6b9e34824ade1095, "half"),
            "m@2@1@6b9e34824ade1095@half"
        );
        // quote(key, safe=""): "org%2Fm%401%400%40-7092d1997764721b%40bfloat16".
        let encoded = encode_key(&key);
        assert_eq!(encoded, "org%2Fm%401%400%40-7092d1997764721b%40bfloat16");
        assert_eq!(decode_key(&encoded).unwrap(), key);
        for h in [i64::MIN, -1, 0, 1, i64::MAX] {
            let name = n("lmcache", &cache_engine_key("m", 1, 0, h, "bfloat16"));
            assert_eq!(
                name.chunk_hash(),
                Some(EngineHash(h.to_be_bytes().to_vec())),
                "{h}"
            );
        }
    }

    #[test]
    fn keys_name_the_chunk_hash_events_carry() {
        let hash = |key: &str| n("b", key).chunk_hash();
        let be = |v: u64| Some(EngineHash(v.to_be_bytes().to_vec()));
        assert_eq!(hash("org/model@1@0@1f@bfloat16"), be(0x1f));
        assert_eq!(hash("m@2@1@ffffffffffffffff@half@tag%x"), be(u64::MAX));
        assert_eq!(
            hash("m@1@0@-5@bfloat16"),
            Some(EngineHash((-5i64).to_be_bytes().to_vec()))
        );
        // A layer key, and a bytes hash longer than 64 bits.
        assert_eq!(hash("m@1@0@2a@bfloat16@3"), be(0x2a));
        assert_eq!(
            hash("m@1@0@000102030405060708090a0b0c0d0e0f10@half"),
            Some(EngineHash((0u8..=16).collect()))
        );
        for bad in ["plain", "m@1@0@zz@half", "m@1@0@@half", "m@1@0@abc"] {
            assert_eq!(hash(bad), None, "{bad}");
        }
    }

    fn n(bucket: &str, key: &str) -> ObjectName {
        ObjectName {
            bucket: bucket.into(),
            key: key.into(),
        }
    }

    #[test]
    fn routes() {
        let key = "m%401%400%401234abcd%40half";
        for (method, path, query, want) in [
            (
                "PUT",
                format!("/v1/kv/lmcache/{key}"),
                None,
                Ok(Op::Put(n("lmcache", "m@1@0@1234abcd@half"))),
            ),
            (
                "POST",
                format!("/v1/kv/lmcache/{key}/leases"),
                Some("timeout_ms=2000&ttl_s=10.0"),
                Ok(Op::Lease {
                    name: n("lmcache", "m@1@0@1234abcd@half"),
                    ttl_s: Some(10.0),
                }),
            ),
            (
                "POST",
                format!("/v1/kv/b/{key}/leases"),
                None,
                Ok(Op::Lease {
                    name: n("b", "m@1@0@1234abcd@half"),
                    ttl_s: None,
                }),
            ),
            (
                "POST",
                "/v1/leases/abc/release".into(),
                None,
                Ok(Op::Release("abc".into())),
            ),
            ("GET", "/v1/health".into(), None, Ok(Op::Health)),
            (
                "GET",
                format!("/v1/kv/lmcache/{key}"),
                None,
                Err("does not take GET"),
            ),
            ("POST", "/v1/kv".into(), None, Err("no such route")),
            (
                "PUT",
                "/v1/kv/lmcache/m@1@0@1234abcd@half".into(),
                None,
                Ok(Op::Put(n("lmcache", "m@1@0@1234abcd@half"))),
            ),
            (
                "PUT",
                "/v1/kv/lmcache/a b".into(),
                None,
                Err("not URL-safe"),
            ),
            (
                "PUT",
                "/v1/kv/lmcache/a\"b".into(),
                None,
                Err("not URL-safe"),
            ),
            (
                "PUT",
                "/v1/kv/lmcache/a<b".into(),
                None,
                Err("not URL-safe"),
            ),
            (
                "PUT",
                "/v1/kv/lmcache/caf\u{e9}".into(),
                None,
                Err("not URL-safe"),
            ),
            (
                "PUT",
                "/v1/kv/lmcache/a%2".into(),
                None,
                Err("not URL-safe"),
            ),
            (
                "PUT",
                "/v1/kv/lmcache/a%zz".into(),
                None,
                Err("not URL-safe"),
            ),
            ("PUT", "/v1/kv/lmcache/".into(), None, Err("key is empty")),
            ("PUT", "/v1/kv/lmcache/a%0Ab".into(), None, Err("control")),
            (
                "PUT",
                "/v1/kv/lmcache/%FF".into(),
                None,
                Err("invalid UTF-8"),
            ),
            ("PUT", format!("/v1/kv/lm%40c/{key}"), None, Err("bucket")),
            (
                "PUT",
                format!("/v1/kv/lmcache/{}", "a".repeat(MAX_KEY_BYTES + 1)),
                None,
                Err("longer than"),
            ),
            (
                "POST",
                format!("/v1/kv/lmcache/{key}/leases"),
                Some("ttl_s=-1"),
                Err("positive"),
            ),
            (
                "POST",
                format!("/v1/kv/lmcache/{key}/leases"),
                Some("ttl_s=nan"),
                Err("positive"),
            ),
        ] {
            let got = parse(method, &path, query);
            match want {
                Ok(op) => assert_eq!(got, Ok(op), "{method} {path}"),
                Err(text) => {
                    let e = got.expect_err(&path).to_string();
                    assert!(e.contains(text), "{method} {path}: {e}");
                }
            }
        }
        // A model name with a slash arrives as %2F and decodes back.
        assert_eq!(
            decode_key("meta-llama%2FLlama-3%401").unwrap(),
            "meta-llama/Llama-3@1"
        );
    }

    #[test]
    fn lease_ids() {
        let ids = LeaseIds::new(7, [3; 32]);
        let id = ids.encode(42);
        assert_eq!(id.len(), 48);
        assert_eq!(ids.decode(&id), Ok(42));
        // Another number with the first one's tag: forged.
        let forged = format!("{}{:016x}{}", &id[..16], 43, &id[32..]);
        assert_eq!(ids.decode(&forged), Err(BadLeaseId::Forged));
        // Same number, another key: forged.
        assert_eq!(
            LeaseIds::new(7, [4; 32]).decode(&id),
            Err(BadLeaseId::Forged)
        );
        // An earlier run's id.
        assert_eq!(
            LeaseIds::new(8, [3; 32]).decode(&id),
            Err(BadLeaseId::OtherGeneration { got: 7, want: 8 })
        );
        for bad in ["", "xyz", &id[..47], &format!("{}g", &id[..47])] {
            assert!(
                matches!(ids.decode(bad), Err(BadLeaseId::Malformed(_))),
                "{bad}"
            );
        }
    }
}
