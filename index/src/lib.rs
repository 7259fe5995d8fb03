//! warmpath-index: the pure core of warmpath.
pub mod cost;
pub mod keys;
pub mod rng;
