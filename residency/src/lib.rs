//! The residency link between a host's cache-agent and the routers: what the agent holds
//! (the engines' GPU blocks, its L1 and L2), reported to every router that follows it.
//! The agent, the router and the simulator all depend on this crate, and not on each other,
//! to speak it.
//!
//! - The session (the crate root, `session.rs`): a snapshot, then sequenced deltas, resync
//!   and expiry, as two state machines ([`Publisher`] on the agent, [`Subscriber`] on a
//!   router). Pure: no I/O, time passed in; the simulator drives the same code.
//! - `net`: the session over QUIC (quinn), one bidirectional stream per router, and
//!   `net::AgentTarget`, where a router reaches an agent (the address syntax itself is
//!   `warmpath_spec::AgentAddress`).
//! - `tls`: mutual TLS from one cluster CA, and the development CA (`warmpath certs`).
//! - [`metric_names`]: the metrics the link exports, on both ends.
//! - [`follow`]: which routers follow an agent when not all do (decision 0105). Pure.
//! - [`steps`]: how a router applies residency beside its requests under one lock.
//!
//! Cargo feature `net` (on by default) builds `net` and `tls` and brings in tokio, quinn,
//! rustls, rcgen, metrics and tracing. The simulator turns it off (`default-features =
//! false`) and gets the session alone: serde, postcard and parking_lot, no runtime, no sockets.

mod session;

pub mod follow;

pub mod metric_names;
#[cfg(feature = "net")]
pub mod net;
pub mod steps;
#[cfg(feature = "net")]
pub mod tls;

pub use session::*;
