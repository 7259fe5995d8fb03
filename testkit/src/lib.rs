//! What warmpath's integration tests (`tests/`), process-level benchmarks
//! (`node/benches`) and fault harness (`jepsen/`) share: the one definition of a running
//! `warmpath` process, a real Redis, free loopback ports and scratch directories.
//!
//! Everything here drives processes through their public interfaces only (command line,
//! stdout, signals, sockets), so the harness tests the binary an operator runs.

mod proc;
mod redis;

pub use proc::{fill_disk, in_namespace_of, small_disk_args, warmpath_bin, Proc};
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

/// The commands the tests run that a fresh machine may lack, and their Debian packages:
/// `tests/tools/packages.txt`, which `tests/run` installs from.
const PACKAGES: &str = include_str!("../../tests/tools/packages.txt");

/// The Debian package that provides `tool` (a command or an absolute path), from
/// `tests/tools/packages.txt`.
pub fn package_of(tool: &str) -> Option<&'static str> {
    PACKAGES
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(char::is_whitespace))
        .find(|(t, _)| *t == tool)
        .map(|(_, p)| p.trim())
}

/// `tool`, found on `PATH` (or at its absolute path); panics naming its package and the
/// command that installs it when it is missing, so that no test passes by skipping. A
/// search by hand: six lines where a crate (`which`) would add a dependency for one call.
pub fn system_tool(tool: &str) -> PathBuf {
    let found = if tool.starts_with('/') {
        Some(PathBuf::from(tool)).filter(|p| p.exists())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(tool))
                .find(|p| p.is_file())
        })
    };
    found.unwrap_or_else(|| {
        let package = package_of(tool).unwrap_or("(not in tests/tools/packages.txt)");
        panic!(
            "`{tool}` is missing (Debian package {package}): run tests/run, which installs \
             what the tests need, or: sudo apt-get install -y {package}"
        )
    })
}
