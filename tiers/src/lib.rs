//! warmpath-tiers: which blocks a cache tier holds and which it gives up, as plain data
//! structures. The cache-agent keeps its L1 and L2 payloads beside a [`Ledger`]; the
//! simulator drives the same [`Ledger`] for its L1 and L2 and a [`BlockLru`] for each
//! engine's GPU free list, so that a simulated tier evicts exactly as a live one does.
//!
//! - [`list`]: the one doubly linked list of the crate, threaded by index through a `Vec`
//!   slab ([`list::Slab`], [`list::List`]): O(1) link, unlink and reuse, no `unsafe`.
//! - [`Ledger`] (`ledger.rs`): a byte-bounded tier under LRU or S3-FIFO ([`Eviction`]),
//!   with pins and leases that eviction must respect.
//! - [`BlockLru`] (`lru.rs`): a count-bounded set of block keys evicting the least
//!   recently used, with [`BlockLru::pop_lru`] for a caller that evicts on demand.
//!
//! Architecture invariant: no I/O and no clock. Time is passed in (microseconds) and only
//! leases read it; hash maps are never iterated, so hash order never leaks into results.

mod ledger;
pub mod list;
mod lru;

pub use ledger::{BlockId, Eviction, LeaseId, Ledger, LedgerStats, Owner, Refused};
pub use lru::BlockLru;
