//! Live mode: the engine model served over HTTP on the wall clock, and the load generator
//! that drives such servers (or real vLLM ones) from outside.
//!
//! - [`server`]: `warmpath engine-sim`, an OpenAI-compatible server around one
//!   [`crate::engine::Engine`], paced by the wall clock with a speed-up factor.
//! - [`offload`]: engine-sim's link to the host's cache-agent.
//! - [`kv_publish`]: engine-sim's KV events, published as vLLM publishes them.
//! - [`loadgen`]: the load generator.

pub mod kv_publish;
pub mod loadgen;
pub mod offload;
pub mod server;
