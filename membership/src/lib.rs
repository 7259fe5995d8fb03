//! warmpath-membership: the router cluster's shared state.
//!
//! - Gossip (chitchat): router discovery and liveness, cluster-wide load, and the shared
//!   routing decisions.
//! - Raft (openraft): tenant configuration.

pub mod decisions;
pub mod gossip;
pub mod metric_names;
pub mod raft;
pub mod schema;
