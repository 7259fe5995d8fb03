//! The history format and the checkers of warmpath's fault harness, shared by the
//! `warmpath-jepsen` binary (real processes in network namespaces) and the deterministic
//! simulation test (`tests/sim.rs`: the Raft group and the gossip adapter in one process,
//! on simulated time and a simulated network).

pub mod check;
pub mod history;
