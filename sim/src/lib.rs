//! warmpath-sim: engine model, workloads and the discrete-event cluster simulator.
pub mod engine;
pub mod profiles;
pub mod tiers;
pub mod workload;
