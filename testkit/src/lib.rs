//! What warmpath's integration tests (`tests/`), process-level benchmarks
//! (`node/benches`) and fault harness (`jepsen/`) share: the one definition of a running
//! `warmpath` process, a real Redis, free loopback ports and scratch directories.
//!
//! Everything here drives processes through their public interfaces only (command line,
//! stdout, signals, sockets), so the harness tests the binary an operator runs.

mod proc;
mod redis;

pub use proc::{warmpath_bin, Proc};
pub use redis::Redis;

use std::path::PathBuf;

/// A scratch directory unique to this process and `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warmpath-it-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    dir
}

/// A free loopback address: bind port 0, note it, close.
pub fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local address")
}
