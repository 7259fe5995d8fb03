//! Block keys: the one definition of how a prompt becomes a chain of prefix keys.
//!
//! A prompt is cut into complete blocks (token mode: `block_tokens` token ids, each
//! encoded as u32 LE; text mode: `block_bytes` UTF-8 bytes). Each block's key hashes the
//! previous key with the block's bytes, keyed by the tenant's key, so a key names a whole
//! prefix and two tenants never share a key:
//!
//! ```text
//! tenant_key = blake3::derive_key("warmpath 2026-11 tenant key v1", tenant_id ‖ 0x00 ‖ cache_salt)
//! key[0]     = u64_le(blake3::keyed_hash(tenant_key, 0u64_le ‖ block[0])[..8])
//! key[i]     = u64_le(blake3::keyed_hash(tenant_key, key[i-1]_le ‖ block[i])[..8])
//! ```
//!
//! Test vectors (tenant `"acme"`, empty salt; token mode with 4-token blocks, then text mode
//! with 8-byte blocks), cross-checked against the Python `blake3` reference package:
//!
//! ```
//! use warmpath_index::keys::{BlockKey, TenantKey, token_block_keys, text_block_keys};
//! let tenant = TenantKey::derive("acme", "");
//! let keys = token_block_keys(&tenant, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
//! assert_eq!(keys, vec![BlockKey(0xf481_0e24_0e69_4c64), BlockKey(0x8bee_465c_1c89_fbe5)]);
//! let text = text_block_keys(&tenant, b"hello world, hello", 8);
//! assert_eq!(text, vec![BlockKey(0x960d_a577_2f6b_f3a5), BlockKey(0xfbe7_7b93_573a_3b0b)]);
//! ```

use serde::{Deserialize, Serialize};

/// Context string for deriving a tenant's hashing key; changing it changes every key.
pub const TENANT_KEY_CONTEXT: &str = "warmpath 2026-11 tenant key v1";

/// Context string for deriving a LoRA adapter's hashing key from its tenant's; changing it
/// changes every adapter's keys.
pub const ADAPTER_KEY_CONTEXT: &str = "warmpath 2026-12 adapter key v1";

/// Agents report about one block key per `REPORT_TOKENS` tokens of a chain to routers
/// (coarse residency, records 0115 and 0117): one key in [`report_every`] of the pool's
/// block size, picked by [`reported`]. A protocol constant that agents and routers of one
/// build share. 64 is one key in 4 of vLLM's 16-token blocks, the rate record 0115 measured.
pub const REPORT_TOKENS: u32 = 64;

/// One key in how many is reported for a pool of `block_tokens`-token blocks: about one per
/// [`REPORT_TOKENS`] tokens, a power of two, at least 1 (blocks of 64 tokens or more: every
/// block). Reporting by tokens rather than by blocks keeps the router's resolution the same
/// at every block size: at one key in 4 of Mooncake's 512-token blocks a reported key would
/// stand for 2,048 tokens (record 0117).
pub fn report_every(block_tokens: u32) -> u32 {
    Reporting::Tokens(block_tokens).base()
}

/// Past `2 × REPORT_PRECISION × REPORT_TOKENS` tokens into a chain (4,096), reported keys
/// thin out with depth: about one per `1 / REPORT_PRECISION` of the depth (record 0122), so
/// each doubling of a chain's length adds about `REPORT_PRECISION` reported keys rather than
/// one per [`REPORT_TOKENS`] tokens. A key then vouches for its prefix to within about 3% of
/// its depth, where a miss costs that share of a long prefill.
pub const REPORT_PRECISION: u32 = 32;

/// Which keys of a chain an agent reports and a router expects to see reported (records
/// 0115, 0117, 0122): [`Reporting::every_at`] a depth, picked by [`reported`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reporting {
    /// One key in this many at every depth (1: every key; a fixed rate for comparisons,
    /// `warmpath agent --residency-every-block`, `simulate --residency-report-every`).
    Every(u32),
    /// The protocol's rate for a pool of blocks of this many tokens: one key per
    /// [`REPORT_TOKENS`] tokens (at least every block) of a chain's first 4,096 tokens, then
    /// a stride of the largest power of two at most `depth / REPORT_PRECISION` tokens.
    Tokens(u32),
}

impl Reporting {
    /// One key in how many is reported at `depth` (the block's place in its chain, 1 for
    /// the first block): a power of two, never less than at a shallower depth, so the keys
    /// reported at a depth are among those reported at any shallower one.
    pub fn every_at(self, depth: u32) -> u32 {
        match self {
            Reporting::Every(n) => n.max(1).next_power_of_two(),
            Reporting::Tokens(block_tokens) => {
                let block_tokens = u64::from(block_tokens.max(1));
                let tokens = u64::from(depth.max(1)) * block_tokens;
                let stride = (tokens / u64::from(REPORT_PRECISION)).max(u64::from(REPORT_TOKENS));
                let every = (floor_pow2(stride) / block_tokens).max(1);
                floor_pow2(every).min(1 << 31) as u32
            }
        }
    }

    /// One key in how many is reported at the start of a chain: the rate at which a key of
    /// unknown depth is reported (a superset of what any depth asks for).
    pub fn base(self) -> u32 {
        self.every_at(1)
    }

    /// Whether `key` at `depth` is reported; at an unknown depth, at the [`Reporting::base`]
    /// rate.
    pub fn reported(self, key: BlockKey, depth: Option<u32>) -> bool {
        reported(key, depth.map_or(self.base(), |d| self.every_at(d)))
    }
}

/// The largest power of two at most `n` (1 for 0).
fn floor_pow2(n: u64) -> u64 {
    1 << n.max(1).ilog2()
}

/// Whether a block of key `key` is one agents report when they report one key in `every`
/// (rounded up to a power of two; 0 and 1: every key). A pure function of the key, so an
/// L1 or L2 put (which names a block, not its depth in a chain) is sampled like a GPU
/// block, and any two parties agree on which keys of a prompt are reported. The key is
/// mixed first (splitmix64's finaliser): keys are uniform hashes in production but small
/// integers in traces and tests, and the index's own table hashes the low bits.
pub fn reported(key: BlockKey, every: u32) -> bool {
    if every <= 1 {
        return true;
    }
    let mask = u64::from(every.next_power_of_two()) - 1;
    crate::rng::mix64(key.0) & mask == 0
}

/// A prefix key: names the whole prompt prefix up to and including one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockKey(pub u64);

/// The per-tenant secret that keys every block hash of that tenant.
#[derive(Clone, PartialEq, Eq)]
pub struct TenantKey([u8; 32]);

impl std::fmt::Debug for TenantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a secret: a tenant must not learn another's hashes from logs.
        f.write_str("TenantKey(..)")
    }
}

impl TenantKey {
    /// Derives the key of `tenant_id` with its `cache_salt` (empty when unset).
    pub fn derive(tenant_id: &str, cache_salt: &str) -> Self {
        let mut material = Vec::with_capacity(tenant_id.len() + 1 + cache_salt.len());
        material.extend_from_slice(tenant_id.as_bytes());
        material.push(0);
        material.extend_from_slice(cache_salt.as_bytes());
        TenantKey(blake3::derive_key(TENANT_KEY_CONTEXT, &material))
    }

    /// The key of this tenant's blocks computed under LoRA adapter `adapter`: vLLM's
    /// `lora_name` in its KV events, the OpenAI `model` of a request that names the
    /// adapter (as vLLM serves `--lora-modules NAME=PATH`). Engines cache per adapter, so
    /// the same tokens under two adapters, or under an adapter and the base model, are
    /// different blocks with different keys:
    ///
    /// ```text
    /// adapter_key = blake3::derive_key("warmpath 2026-12 adapter key v1", tenant_key ‖ adapter)
    /// ```
    ///
    /// The base model's blocks keep the tenant key itself.
    pub fn for_adapter(&self, adapter: &str) -> TenantKey {
        let mut material = Vec::with_capacity(32 + adapter.len());
        material.extend_from_slice(&self.0);
        material.extend_from_slice(adapter.as_bytes());
        TenantKey(blake3::derive_key(ADAPTER_KEY_CONTEXT, &material))
    }

    /// The key of the block that follows `prev` (None for the first block).
    pub fn chain(&self, prev: Option<BlockKey>, block: &[u8]) -> BlockKey {
        let mut hasher = blake3::Hasher::new_keyed(&self.0);
        hasher.update(&prev.map_or(0, |k| k.0).to_le_bytes());
        hasher.update(block);
        let hash = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&hash.as_bytes()[..8]);
        BlockKey(u64::from_le_bytes(first))
    }
}

/// The cache salt of a tenant configured without one: derived from its id, so that every
/// router (and every cache-agent that maps an engine's `cache_salt` back to its tenant)
/// computes the same one. A tenant given its own salt keeps it secret instead.
pub fn default_cache_salt(tenant_id: &str) -> String {
    blake3::hash(format!("warmpath cache salt v1\0{tenant_id}").as_bytes()).to_hex()[..16]
        .to_string()
}

/// The bytes a block of token ids is keyed by: each id as 4 little-endian bytes. The one
/// encoding, for routers ([`token_block_keys`]) and for cache-agents recomputing keys
/// from an engine's KV events alike; `out` is cleared first (a buffer reused per block).
pub fn token_block_bytes(tokens: &[u32], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(tokens.len() * 4);
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
}

/// Keys of the complete `block_tokens`-sized blocks of `tokens` (a trailing partial block
/// has no key). `block_tokens` of 0 yields no keys.
pub fn token_block_keys(tenant: &TenantKey, tokens: &[u32], block_tokens: usize) -> Vec<BlockKey> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut keys = Vec::with_capacity(tokens.len() / block_tokens);
    let mut bytes = Vec::with_capacity(block_tokens * 4);
    let mut prev = None;
    for block in tokens.chunks_exact(block_tokens) {
        token_block_bytes(block, &mut bytes);
        let key = tenant.chain(prev, &bytes);
        keys.push(key);
        prev = Some(key);
    }
    keys
}

/// Keys of the complete `block_bytes`-sized blocks of a rendered prompt's UTF-8 bytes.
pub fn text_block_keys(tenant: &TenantKey, text: &[u8], block_bytes: usize) -> Vec<BlockKey> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let mut prev = None;
    text.chunks_exact(block_bytes)
        .map(|block| {
            let key = tenant.chain(prev, block);
            prev = Some(key);
            key
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_blocks_have_no_key() {
        let t = TenantKey::derive("t", "");
        assert_eq!(token_block_keys(&t, &[1, 2, 3], 4), vec![]);
        assert_eq!(token_block_keys(&t, &[1, 2, 3, 4, 5], 4).len(), 1);
        assert_eq!(token_block_keys(&t, &[1, 2], 0), vec![]);
        assert_eq!(text_block_keys(&t, b"abc", 4), vec![]);
    }

    #[test]
    fn keys_name_whole_prefixes() {
        let t = TenantKey::derive("t", "");
        let a = token_block_keys(&t, &[1, 2, 3, 4, 9, 9, 9, 9], 4);
        let b = token_block_keys(&t, &[5, 6, 7, 8, 9, 9, 9, 9], 4);
        // Same second block after different first blocks: different keys.
        assert_ne!(a[1], b[1]);
        let c = token_block_keys(&t, &[1, 2, 3, 4, 0, 0, 0, 0], 4);
        assert_eq!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
    }

    #[test]
    fn tenants_and_salts_never_share_keys() {
        let tokens: Vec<u32> = (0..64).collect();
        let cases = [("a", ""), ("b", ""), ("a", "salt"), ("a\0", ""), ("", "a")];
        let mut all: Vec<Vec<BlockKey>> = Vec::new();
        for (tenant, salt) in cases {
            all.push(token_block_keys(
                &TenantKey::derive(tenant, salt),
                &tokens,
                16,
            ));
        }
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert!(
                    all[i].iter().all(|k| !all[j].contains(k)),
                    "{:?} vs {:?}",
                    cases[i],
                    cases[j]
                );
            }
        }
    }

    #[test]
    fn adapters_never_share_keys_with_the_base_model_or_each_other() {
        let tokens: Vec<u32> = (0..32).collect();
        let t = TenantKey::derive("acme", "");
        let base = token_block_keys(&t, &tokens, 16);
        let a = token_block_keys(&t.for_adapter("sql-lora"), &tokens, 16);
        let b = token_block_keys(&t.for_adapter("chat-lora"), &tokens, 16);
        let other = token_block_keys(
            &TenantKey::derive("beta", "").for_adapter("sql-lora"),
            &tokens,
            16,
        );
        for (x, y) in [(&base, &a), (&a, &b), (&a, &other), (&base, &b)] {
            assert!(x.iter().all(|k| !y.contains(k)));
        }
        // Fixed: the agent and every router derive the same adapter keys.
        assert_eq!(
            a,
            token_block_keys(
                &TenantKey::derive("acme", "").for_adapter("sql-lora"),
                &tokens,
                16
            )
        );
    }

    #[test]
    fn about_one_key_in_every_is_reported_and_one_in_one_is_every_key() {
        for every in [2u32, 4, 16] {
            let n = (0..64_000u64)
                .filter(|&k| reported(BlockKey(k), every))
                .count();
            let want = 64_000 / every as usize;
            assert!(n.abs_diff(want) < want / 10, "{n} of 64,000 at {every}");
        }
        assert!((0..1000u64).all(|k| reported(BlockKey(k), 1) && reported(BlockKey(k), 0)));
        // Not a power of two: the next one up.
        let at = |every| {
            (0..1000u64)
                .filter(|&k| reported(BlockKey(k), every))
                .collect::<Vec<_>>()
        };
        assert_eq!(at(12), at(16));
        // Fixed: agents and routers of one protocol agree on which keys are reported.
        assert_eq!(&at(report_every(16))[..4], [0, 3, 4, 5]);
    }

    #[test]
    fn about_one_key_per_report_tokens_is_reported_at_any_block_size() {
        let every: Vec<u32> = [1, 4, 16, 24, 32, 48, 64, 128, 512]
            .iter()
            .map(|&b| report_every(b))
            .collect();
        assert_eq!(every, [64, 16, 4, 2, 2, 1, 1, 1, 1]);
        assert_eq!(report_every(0), 64);
    }

    #[test]
    fn reported_keys_thin_out_with_depth_past_the_dense_start() {
        // vLLM's 16-token blocks: one in 4 for the first 4,096 tokens (256 blocks), then
        // the stride doubles with the depth.
        let r = Reporting::Tokens(16);
        let every: Vec<u32> = [1, 255, 256, 511, 512, 1023, 1024, 2048, 4096]
            .iter()
            .map(|&d| r.every_at(d))
            .collect();
        assert_eq!(every, [4, 4, 8, 8, 16, 16, 32, 64, 128]);
        assert_eq!(r.base(), 4);
        // Blocks of 64 tokens: every block up to 4,096 tokens; 512-token blocks (Mooncake)
        // every block up to 32,768 tokens.
        assert_eq!(Reporting::Tokens(64).every_at(63), 1);
        assert_eq!(Reporting::Tokens(64).every_at(64), 2);
        assert_eq!(Reporting::Tokens(512).every_at(63), 1);
        assert_eq!(Reporting::Tokens(512).every_at(64), 2);
        // A fixed rate is the same at every depth.
        assert!([1, 100, 10_000]
            .iter()
            .all(|&d| Reporting::Every(4).every_at(d) == 4));
        assert_eq!(Reporting::Every(0).every_at(7), 1);
        // Never finer with depth, and what a depth reports is reported at every shallower
        // depth (so a key of unknown depth, reported at the base rate, is never missing).
        for b in [1, 16, 48, 64, 512] {
            let r = Reporting::Tokens(b);
            let mut prev = r.base();
            for d in 1..100_000 {
                let e = r.every_at(d);
                assert!(e >= prev && e.is_power_of_two(), "{b} {d}");
                prev = e;
            }
        }
        for k in 0..10_000u64 {
            let key = BlockKey(k);
            if r.reported(key, Some(4096)) {
                assert!(r.reported(key, Some(300)) && r.reported(key, None));
            }
        }
        // A 64k-token chain of 16-token blocks reports about 64 + 4 × 32 keys, not 1,000.
        let n = (1..=4000u32)
            .filter(|&d| r.reported(BlockKey(u64::from(d) * 7919), Some(d)))
            .count();
        assert!((150..260).contains(&n), "{n}");
    }

    #[test]
    fn token_mode_encodes_u32_le() {
        let t = TenantKey::derive("t", "s");
        let by_tokens = token_block_keys(&t, &[0x0403_0201, 0x0807_0605], 2);
        let by_bytes = text_block_keys(&t, &[1, 2, 3, 4, 5, 6, 7, 8], 8);
        assert_eq!(by_tokens, by_bytes);
    }
}
