//! The gossip key schema: every key a router writes into its own chitchat node state,
//! with typed accessors, so that no other code parses raw gossip strings.
//!
//! | key | value | written |
//! |---|---|---|
//! | `role` | `router` | at start |
//! | `version` | the crate version, e.g. `0.1.0` | at start |
//! | `http` | the router's HTTP base URL | at start |
//! | `load` | [`LoadWire`], encoded | at most once per gossip interval, when it changed |
//! | `applied` | [`AppliedWire`], encoded: the index digest (origin → highest batch seq applied) | on every poll, when it changed |
//! | `d:` + 12-digit zero-padded seq | [`BatchWire`], encoded: one batch of routing decisions | per batch; deleted after the decision TTL |
//!
//! Zero padding makes chitchat's sorted prefix scan return batches in seq order. Seqs start
//! at 1 for every router incarnation; an incarnation is named by its *origin*, `node_id` +
//! `#` + chitchat generation id ([`origin`]), so a restarted router is a new origin and its
//! restarted seqs are never mistaken for old ones.
//!
//! Size budget per node (values are base64, so 4/3 of their postcard size):
//! - `role`, `version`, `http`: under 200 bytes together.
//! - `load`: idle instances are left out; about 14 bytes per busy instance (a 10-byte
//!   varint instance key, in-flight and pending-prefill varints) before base64, so about
//!   4.8 KiB for 256 busy instances; capped at [`LOAD_MAX_ENTRIES`] (the busiest kept),
//!   at most about 10 KiB.
//! - `applied`: about 30 bytes per origin; origins that left the cluster state are pruned,
//!   and at most [`APPLIED_MAX_ORIGINS`] are published.
//! - decision batches: at most [`BATCH_MAX_BYTES`] (8 KiB) each, which
//!   [`crate::gossip::Gossip::publish_decisions`] enforces by splitting with a
//!   [`crate::decisions::Batcher`]; a 32-block decision costs about 360 bytes, so a
//!   full batch holds about 22 such decisions. Batches live only for the decision TTL, so a
//!   router publishing `r` batches per second keeps at most `r × TTL × 8 KiB` of them.
//!
//! Chitchat carries deltas of at most 64 KiB per datagram, so a node that falls far behind
//! catches up over several gossip rounds.

use chitchat::NodeState;

use crate::decisions::{decode, encode, AppliedWire, BatchWire, LoadWire, WireError};

/// Key of the node's role.
pub const ROLE: &str = "role";
/// The role every router publishes.
pub const ROLE_ROUTER: &str = "router";
/// Key of the node's software version.
pub const VERSION: &str = "version";
/// Key of the router's HTTP base URL.
pub const HTTP: &str = "http";
/// Key of the router's encoded [`LoadWire`].
pub const LOAD: &str = "load";
/// Key of the router's encoded [`AppliedWire`] (its index digest).
pub const APPLIED: &str = "applied";
/// Prefix of the decision batch keys.
pub const DECISION_PREFIX: &str = "d:";
/// Digits of the zero-padded seq in a decision batch key.
pub const DECISION_SEQ_DIGITS: usize = 12;
/// Largest seq a decision key can carry (12 digits).
pub const MAX_SEQ: u64 = 999_999_999_999;

/// The cluster's budget for routing decisions in gossip (record 0118), defined with the
/// router core's [`warmpath_index::router::PublishBudget`] so that the simulator spends the
/// same one.
pub use warmpath_index::router::DECISION_BUDGET_KEYS_PER_S;

/// Budget of one decision batch value, in bytes (encoded).
pub const BATCH_MAX_BYTES: usize = 8 * 1024;
/// Most load entries one router publishes.
pub const LOAD_MAX_ENTRIES: usize = 512;
/// Most origins one router publishes in its `applied` digest.
pub const APPLIED_MAX_ORIGINS: usize = 256;

/// The software version routers publish under [`VERSION`].
pub const CRATE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The key of decision batch `seq`: `d:` and 12 zero-padded digits.
pub fn decision_key(seq: u64) -> String {
    format!(
        "{DECISION_PREFIX}{seq:0width$}",
        width = DECISION_SEQ_DIGITS
    )
}

/// The seq of a decision batch key; `None` for any other key or a malformed one.
pub fn parse_decision_key(key: &str) -> Option<u64> {
    let digits = key.strip_prefix(DECISION_PREFIX)?;
    if digits.len() != DECISION_SEQ_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The origin name of a router incarnation: `node_id#generation`.
pub fn origin(node_id: &str, generation_id: u64) -> String {
    format!("{node_id}#{generation_id}")
}

/// The key-values a router starts with.
pub fn initial_key_values(http_url: &str) -> Vec<(String, String)> {
    vec![
        (ROLE.to_string(), ROLE_ROUTER.to_string()),
        (VERSION.to_string(), CRATE_VERSION.to_string()),
        (HTTP.to_string(), http_url.to_string()),
    ]
}

/// Read access to one node's gossiped state.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a>(pub &'a NodeState);

impl<'a> NodeView<'a> {
    /// The node's role, if published.
    pub fn role(&self) -> Option<&'a str> {
        self.0.get(ROLE)
    }

    /// The node's software version, if published.
    pub fn version(&self) -> Option<&'a str> {
        self.0.get(VERSION)
    }

    /// The router's HTTP base URL, if published.
    pub fn http_url(&self) -> Option<&'a str> {
        self.0.get(HTTP)
    }

    /// The raw `load` value with its version, if published (decode with [`decode_load`]): a
    /// new version each time its router sets a different value.
    pub fn load_versioned(&self) -> Option<(u64, &'a str)> {
        self.0
            .get_versioned(LOAD)
            .filter(|v| !v.is_deleted())
            .map(|v| (v.version, v.value.as_str()))
    }

    /// The raw `applied` value, if published (decode with [`decode_applied`]).
    pub fn applied_raw(&self) -> Option<&'a str> {
        self.0.get(APPLIED)
    }

    /// The decision batches with a seq above `after`, in seq order, as `(seq, raw value)`
    /// (decode with [`decode_batch`]). Keys under the prefix that are not well-formed are
    /// skipped.
    pub fn decisions_after(&self, after: u64) -> impl Iterator<Item = (u64, &'a str)> + 'a {
        self.0
            .iter_prefix(DECISION_PREFIX)
            .filter_map(|(k, v)| Some((parse_decision_key(k)?, v.value.as_str())))
            .filter(move |(seq, _)| *seq > after)
    }

    /// The highest decision batch seq the node still holds, if any.
    pub fn latest_decision_seq(&self) -> Option<u64> {
        self.0
            .iter_prefix(DECISION_PREFIX)
            .filter_map(|(k, _)| parse_decision_key(k))
            .max()
    }
}

/// Write access to this node's own gossiped state.
#[derive(Debug)]
pub struct OwnState<'a>(pub &'a mut NodeState);

impl OwnState<'_> {
    /// Publishes this router's load (the busiest [`LOAD_MAX_ENTRIES`] when there are more,
    /// idle entries are the caller's to leave out). An unchanged value is not re-gossiped.
    pub fn set_load(&mut self, load: &LoadWire) {
        self.0.set(LOAD, encode(load));
    }

    /// Publishes this router's index digest. An unchanged value is not re-gossiped.
    pub fn set_applied(&mut self, applied: &AppliedWire) {
        self.0.set(APPLIED, encode(applied));
    }

    /// Publishes decision batch `seq`, scheduled for deletion after the decision TTL
    /// (chitchat's marked-for-deletion grace period).
    pub fn set_decision_batch(&mut self, seq: u64, batch: &BatchWire) {
        self.0.set_with_ttl(decision_key(seq), encode(batch));
    }
}

/// Decodes a `load` value.
pub fn decode_load(raw: &str) -> Result<LoadWire, WireError> {
    decode(raw)
}

/// Decodes an `applied` value.
pub fn decode_applied(raw: &str) -> Result<AppliedWire, WireError> {
    decode(raw)
}

/// Decodes a decision batch value.
pub fn decode_batch(raw: &str) -> Result<BatchWire, WireError> {
    decode(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_keys_sort_by_seq() {
        let seqs = [1u64, 9, 10, 11, 99, 100, 123_456, MAX_SEQ];
        let keys: Vec<String> = seqs.iter().map(|&s| decision_key(s)).collect();
        assert_eq!(keys[0], "d:000000000001");
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(sorted, keys);
        for (k, s) in keys.iter().zip(seqs) {
            assert_eq!(parse_decision_key(k), Some(s));
        }
    }

    #[test]
    fn malformed_decision_keys_are_rejected() {
        for bad in [
            "d:1",
            "d:0000000000001",
            "d:00000000000x",
            "d:+00000000001",
            "x:000000000001",
            "load",
            "",
            "d:",
        ] {
            assert_eq!(parse_decision_key(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn origins_name_incarnations() {
        assert_eq!(origin("router-1", 17), "router-1#17");
        assert_ne!(origin("router-1", 17), origin("router-1", 18));
    }

    #[test]
    fn initial_values() {
        let kv = initial_key_values("http://127.0.0.1:8080");
        assert!(kv.contains(&(ROLE.into(), ROLE_ROUTER.into())));
        assert!(kv.contains(&(HTTP.into(), "http://127.0.0.1:8080".into())));
        assert!(kv.contains(&(VERSION.into(), CRATE_VERSION.into())));
    }
}
