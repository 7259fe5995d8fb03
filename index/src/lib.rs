//! warmpath-index: the pure core of warmpath.
//!
//! - [`keys`]: block keys, the one definition of how a prompt becomes prefix keys.
//! - [`index`]: the prefix index (which instance holds which prefix, in which tier).
//! - [`load`]: the load view (in-flight requests and pending prefill per instance).
//! - [`policy`]: the routing policies and their explanations.
//! - [`cost`]: the model profile that kv-aware routing and the simulator share.
//! - [`profiles`]: the built-in model profiles, JSON data under `profiles/`.
//! - [`router`]: the router core, the whole decision path of one router replica.
//! - [`rng`]: the seeded generator behind every random choice.
//! - [`openai`]: OpenAI requests as routing reads them, and the error body.
//! - [`text`]: the built-in tokenizer and chat rendering shared by router and engine-sim.
//!
//! **Architecture invariant:** this crate does no I/O. No tokio, no sockets, no clock
//! reads: time is passed in (microseconds), so the simulator and the router run the same
//! code and tests can drive it on a fake clock.

pub mod cost;
pub mod index;
pub mod keys;
pub mod load;
pub mod openai;
pub mod policy;
pub mod profiles;
pub mod rng;
pub mod router;
pub mod text;

/// A dense instance number, assigned by whoever owns the instance list (router, simulator).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct InstanceId(pub u32);
