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

/// A free loopback address, below the kernel's ephemeral port range.
///
/// Tests start processes on these ports and, after a kill, start them again on the same
/// port. A port from the ephemeral range (what binding port 0 gives) can be taken in
/// between as the local port of any outgoing connection, which the tests make by the
/// thousand, and the restart then fails. So the ports come from below that range (read
/// from `/proc/sys/net/ipv4/ip_local_port_range`), in a window of this process's own,
/// each checked free by binding it, none handed out twice by one process.
pub fn free_addr() -> std::net::SocketAddr {
    free_port(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
}

/// A free loopback UDP address (a QUIC listener), by the same rule as [`free_addr`].
pub fn free_udp_addr() -> std::net::SocketAddr {
    free_port(|port| std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok())
}

/// Port 0 means the kernel's choice; `free` says whether a port can be bound now.
fn free_port(free: impl Fn(u16) -> bool) -> std::net::SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let loopback = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
    if ephemeral_low <= LOW + 1_000 {
        // No room below the range: the kernel's choice, as before.
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        return loopback(l.local_addr().expect("local address").port());
    }
    let span = ephemeral_low - LOW;
    let start = (u64::from(std::process::id()) * 997 % u64::from(span)) as u32;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (start + n) % span) as u16;
        if free(port) {
            return loopback(port);
        }
    }
    panic!("no free loopback port between {LOW} and {ephemeral_low}")
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
