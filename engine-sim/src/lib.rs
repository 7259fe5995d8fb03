//! engine-sim: warmpath's stand-in for a vLLM server, for tests, demos and benchmarks on
//! machines without a GPU. It serves one `warmpath_sim::engine::Engine` (the simulator's
//! engine model) over an OpenAI-compatible HTTP API, paced by the wall clock with a speed-up
//! factor, and speaks to the host's cache-agent and routers as a real engine would.
//!
//! - [`server`]: `warmpath engine-sim`, the HTTP server and the engine loop.
//! - [`offload`]: its link to the host's cache-agent (the agent's block API).
//! - [`hyperpod`]: the same link over the agent's HyperPod daemon API, spoken as LMCache's
//!   connector speaks it (chunks, leases, the shared-memory segment).
//! - [`kv_publish`]: its KV events, published as vLLM publishes them (ZMQ, msgpack), with
//!   vLLM's replay socket.
//! - [`metric_names`]: the metrics it exports beside vLLM's.

pub mod hyperpod;
pub mod kv_publish;
pub mod metric_names;
pub mod offload;
pub mod server;
