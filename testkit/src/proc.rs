//! A running `warmpath` process: the one definition the integration tests
//! (`tests/main.rs`) and the process-level benchmarks (`node/benches/common`) share.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};

/// A running `warmpath` process, killed when dropped.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    /// Base URL from its "listening on" line.
    pub url: String,
    /// The first lines it printed (the first names its address).
    pub lines: Vec<String>,
    /// Kept open so the process can still write to stdout.
    stdout: BufReader<ChildStdout>,
}

impl Proc {
    /// Starts `warmpath args…` with warnings logged and waits for its "listening on URL"
    /// line.
    pub fn start(args: &[&str]) -> Proc {
        Self::start_lines(args, 1, "warn")
    }

    /// Starts `warmpath args…` logging at `log` and waits for its first `lines` lines on
    /// stdout, the first of which names its address.
    pub fn start_lines(args: &[&str], lines: usize, log: &str) -> Proc {
        Self::spawn(
            Command::new(env!("CARGO_BIN_EXE_warmpath")).args(args),
            args,
            lines,
            log,
        )
    }

    /// [`Proc::start`] under an open-file limit of `files` (set by `sh`'s `ulimit -n`).
    pub fn start_with_file_limit(files: u32, args: &[&str]) -> Proc {
        let mut command = Command::new("sh");
        command
            .args(["-c", "ulimit -n \"$0\" && exec \"$@\""])
            .arg(files.to_string())
            .arg(env!("CARGO_BIN_EXE_warmpath"))
            .args(args);
        Self::spawn(&mut command, args, 1, "warn")
    }

    /// [`Proc::start`] with a small tmpfs mounted at `dir` in a mount namespace of its own
    /// (`unshare`, as the root of a user namespace): a disk that fills up, gone with the
    /// process.
    pub fn start_with_small_disk(dir: &std::path::Path, bytes: u64, args: &[&str]) -> Proc {
        let mut command = Command::new("unshare");
        command
            .args(["--map-root-user", "--mount", "sh", "-c"])
            .arg("mount -t tmpfs -o size=\"$0\" tmpfs \"$1\" && shift && exec \"$@\"")
            .arg(bytes.to_string())
            .arg(dir)
            .arg(env!("CARGO_BIN_EXE_warmpath"))
            .args(args);
        Self::spawn(&mut command, args, 1, "warn")
    }

    fn spawn(command: &mut Command, args: &[&str], lines: usize, log: &str) -> Proc {
        let mut child = command
            .env("WARMPATH_LOG", log)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the warmpath binary starts");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let mut first = Vec::new();
        for _ in 0..lines.max(1) {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("a line on stdout");
            first.push(line);
        }
        let url = match first[0].split("listening on ").nth(1) {
            Some(u) => u.trim().to_string(),
            None => panic!("{args:?} printed {:?} instead of its address", first[0]),
        };
        Proc {
            child,
            url,
            lines: first,
            stdout,
        }
    }

    /// The next line the process prints on stdout.
    pub fn read_line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("a line on stdout");
        line
    }

    /// Kills the process now (as a crash would).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}
