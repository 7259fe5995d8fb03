//! What warmpath's integration tests (`tests/`), process-level benchmarks
//! (`node/benches`) and fault harness (`jepsen/`) share: the one definition of a running
//! `warmpath` process, a real Redis, free loopback ports and scratch directories.
//!
//! Everything here drives processes through their public interfaces only (command line,
//! stdout, signals, sockets), so the harness tests the binary an operator runs.

mod ports;
mod proc;
mod redis;
mod tools;

pub use ports::{free_addr, free_udp_addr};
pub use proc::{fill_disk, in_namespace_of, small_disk_args, warmpath_bin, Proc};
pub use redis::Redis;
pub use tools::{package_of, system_tool};

use std::path::PathBuf;

/// A scratch directory unique to this process and `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warmpath-it-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    dir
}
