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
pub use proc::{fill_disk, in_namespace_of, signal_pid, small_disk_args, warmpath_bin, Proc};
pub use redis::Redis;
pub use tools::{package_of, system_tool};

use std::path::PathBuf;

/// A new scratch directory, `name` saying whose: unique to this process and this call, so
/// that tests running side by side never share one (two runs of one helper once shared a
/// certificate directory and each overwrote the other's CA).
pub fn scratch_dir(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("warmpath-it-{}-{n}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    dir
}
