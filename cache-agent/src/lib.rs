//! warmpath's cache-agent: one per GPU host. It keeps the host's L1 (KV blocks in CPU
//! memory) and talks to the shared L2 (a directory or Redis), and serves the engines' block
//! API (put, lookup-and-lease, get, release) over TCP and a Unix socket.
//!
//! A map of the crate, pure core first:
//!
//! - The tier policy (which blocks L1 and L2 hold, evict, or must keep) is
//!   `warmpath-tiers`' `Ledger`: no I/O, time passed in; the simulator's tiers use it too.
//! - [`block`]: checksums and the self-checking L2 object format.
//! - [`proto`]: the block API's wire format (handshake, frames), encode and decode only.
//! - [`kv_events`]: engines' KV events in vLLM's msgpack format, decode and encode.
//! - [`ingest`]: KV events to residency changes, warmpath keys recomputed from token ids.
//! - [`l1`]: the L1 store, payloads beside the ledger.
//! - [`pool`]: payload buffers used again instead of fresh pages for every block.
//! - [`config`]: `agent.toml` and its validation.
//! - [`resp`]: Redis's wire protocol, as much as the Redis backend speaks (commands
//!   written from borrowed slices, a reader that trusts no reply).
//! - [`l2`]: the L2 backend trait, the directory and Redis backends (I/O).
//! - [`io`]: vectored socket writes, shared by the server and the Redis backend.
//! - [`sealed`]: blocks as sealed memfds passed over the Unix socket (the block API's
//!   shared-memory data plane, record 0120), and the Unix stream that carries descriptors.
//! - [`agent`]: the service that answers requests from both tiers (I/O shell).
//! - [`kv_subscribe`]: the ZMQ subscriptions to the engines' KV events (I/O).
//! - What the agent reports to routers goes through `warmpath-residency` (the session,
//!   its QUIC and TLS shell), which the routers and the simulator use too.
//! - [`server`] and [`client`]: the listeners, and the engines' pipelined client;
//!   `handshakes`: the cap on connections not yet proven, shared by every listener.
//! - [`hyperpod`]: the HyperPod daemon API for LMCache's connector (HTTP control plane,
//!   objects in a shared-memory segment the agent owns; its bookkeeping is pure).

pub mod agent;
pub mod block;
pub mod client;
pub mod config;
pub(crate) mod handshakes;
pub mod hyperpod;
pub mod ingest;
pub mod io;
pub mod kv_events;
pub mod kv_subscribe;
pub mod l1;
pub mod l2;
pub mod metric_names;
pub mod pool;
pub mod proto;
pub mod resp;
pub mod sealed;
pub mod server;
pub mod zmtp;

/// A current-thread runtime for the unit tests that drive async code.
#[cfg(test)]
pub(crate) fn test_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a test runtime")
}
