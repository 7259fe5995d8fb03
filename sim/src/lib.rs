//! warmpath-sim: engine model, workloads and the discrete-event cluster simulator.
pub mod workload;
