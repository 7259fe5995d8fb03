//! A real `redis-server` for the cache-agent's tests and the fault harness.

use crate::ports::free_addr;
use std::process::{Child, Command, Stdio};

/// A real `redis-server` (the distribution's package) on a loopback port, without
/// persistence, killed when dropped; `tests/run` installs it.
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
        let child = Command::new(crate::tools::system_tool("redis-server"))
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
            .expect("redis-server starts");
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
