//! warmpath's integration tests: they run the real `warmpath` binary as a separate
//! process and check what it prints and how it fails.
//!
//! One test crate (this file and its modules), built as the `integration` test target of
//! the `warmpath` package so that Cargo hands it the binary's path.

mod agent;
mod clients;
mod cluster;
mod raft;
mod router;
mod simulate;

mod proc;
pub use proc::Proc;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

/// An engine-sim on a free loopback port at `speedup`, with `extra` flags.
pub fn engine_sim(speedup: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "engine-sim",
        "--listen",
        "127.0.0.1:0",
        "--speedup",
        speedup,
    ];
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// Runs `warmpath` with `args` and returns its output.
pub fn warmpath(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_warmpath"))
        .args(args)
        .output()
        .expect("the warmpath binary runs")
}

/// Runs `warmpath` with `args` for at most `limit`: its output once it exits, or `None`
/// (the process killed) if it was still running, as a server that should have refused to
/// start would be.
pub fn warmpath_exits_within(args: &[&str], limit: std::time::Duration) -> Option<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_warmpath"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the warmpath binary runs");
    let until = std::time::Instant::now() + limit;
    while std::time::Instant::now() < until {
        if child.try_wait().expect("a child to wait on").is_some() {
            return Some(child.wait_with_output().expect("its output"));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A public trace from `../shared/traces`, beside the checkout.
pub fn shared_trace(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces")
        .join(name)
}

/// A scratch directory unique to one test.
pub fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warmpath-it-{}-{test}", std::process::id()));
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

/// A real `redis-server` (the distribution's package) on a loopback port, without
/// persistence, killed when dropped; `.ci/run` installs it.
#[derive(Debug)]
pub struct Redis {
    child: Child,
    pub port: u16,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_on(free_addr().port())
    }

    /// Starts on `port` (again, after a stop) and waits until it answers.
    pub fn start_on(port: u16) -> Redis {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .args(["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is installed (apt-get install redis-server; .ci/run does)");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Redis { child, port }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}
