//! warmpath-sim: engine model, workloads and the discrete-event cluster simulator.
pub mod bounds;
pub mod cluster;
pub mod engine;
pub mod faults;
pub mod stats;
pub mod tiers;
pub mod workload;
