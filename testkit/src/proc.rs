//! A running `warmpath` process: the one definition the integration tests
//! (`tests/main.rs`), the process-level benchmarks (`node/benches/common`) and the fault
//! harness (`jepsen/`) share.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};

/// The `warmpath` binary: `$WARMPATH_BIN` if set, else the one Cargo built beside the
/// running executable (a test or bench in `target/PROFILE/deps/`, the harness in
/// `target/PROFILE/`).
pub fn warmpath_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("WARMPATH_BIN") {
        return bin.into();
    }
    let exe = std::env::current_exe().expect("the running executable's path");
    let mut dir = exe.parent().expect("an executable lives in a directory");
    if dir.ends_with("deps") {
        dir = dir.parent().expect("deps/ has a parent");
    }
    dir.join("warmpath")
}

/// The arguments of `unshare` that run `program` (its own arguments follow) with a tmpfs
/// of `bytes` mounted at `dir` in a mount namespace of its own, as the root of a user
/// namespace: a disk that fills up, gone with the process. `unshare` and `sh` exec, so
/// the process id is the program's, and the disk is reached from outside through
/// `/proc/PID/root` + `dir` ([`fill_disk`]).
pub fn small_disk_args(
    dir: &std::path::Path,
    bytes: u64,
    program: &std::path::Path,
) -> Vec<std::ffi::OsString> {
    let mut v: Vec<std::ffi::OsString> = ["--map-root-user", "--mount", "sh", "-c"]
        .map(Into::into)
        .to_vec();
    v.push("mount -t tmpfs -o size=\"$0\" tmpfs \"$1\" && shift && exec \"$@\"".into());
    v.push(bytes.to_string().into());
    v.push(dir.into());
    v.push(program.into());
    v
}

/// `dir` of process `pid` as seen from outside its mount namespace.
pub fn in_namespace_of(pid: u32, dir: &std::path::Path) -> PathBuf {
    // A relative `dir` is the caller's, from its working directory: made absolute first,
    // or it would name a path under the namespace's root.
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    PathBuf::from(format!("/proc/{pid}/root")).join(dir.strip_prefix("/").unwrap_or(&dir))
}

/// Fills the filesystem at `dir` with `dir/filler` until it is full (to free the space
/// again, remove that file).
pub fn fill_disk(dir: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join("filler"))?;
    let chunk = vec![0u8; 64 << 10];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
    // The last partial chunk: byte by byte.
    while f.write_all(&[0]).is_ok() {}
    Ok(())
}

/// Sends process `pid` `signal` (as `kill` names it: `-STOP`, `-CONT`, `-TERM`).
pub fn signal_pid(pid: u32, signal: &str) -> std::io::Result<()> {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "kill {signal} {pid} exited with {status}"
        )))
    }
}

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
        Self::spawn(Command::new(warmpath_bin()).args(args), args, lines, log)
    }

    /// [`Proc::start`] under an open-file limit of `files` (set by `sh`'s `ulimit -n`).
    pub fn start_with_file_limit(files: u32, args: &[&str]) -> Proc {
        let mut command = Command::new("sh");
        command
            .args(["-c", "ulimit -n \"$0\" && exec \"$@\""])
            .arg(files.to_string())
            .arg(warmpath_bin())
            .args(args);
        Self::spawn(&mut command, args, 1, "warn")
    }

    /// [`Proc::start`] with a small tmpfs mounted at `dir` in a mount namespace of its own
    /// (`unshare`, as the root of a user namespace): a disk that fills up, gone with the
    /// process.
    pub fn start_with_small_disk(dir: &std::path::Path, bytes: u64, args: &[&str]) -> Proc {
        let mut command = Command::new(crate::tools::system_tool("unshare"));
        command
            .args(small_disk_args(dir, bytes, &warmpath_bin()))
            .args(args);
        Self::spawn(&mut command, args, 1, "warn")
    }

    fn spawn(command: &mut Command, args: &[&str], lines: usize, log: &str) -> Proc {
        Self::try_spawn(command, lines, log).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// Runs `command` (a `warmpath` command line, perhaps behind a wrapper such as
    /// `ip netns exec`) logging at `log`, and waits for its first `lines` stdout lines,
    /// the first of which names its address. `Err` says what it printed instead; the
    /// process is killed then. Its stderr goes where `command` says (inherited unless
    /// set).
    pub fn try_spawn(command: &mut Command, lines: usize, log: &str) -> Result<Proc, String> {
        let mut child = command
            .env("WARMPATH_LOG", log)
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{:?} did not start: {e}", command.get_program()))?;
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let mut first = Vec::new();
        for _ in 0..lines.max(1) {
            let mut line = String::new();
            let _ = stdout.read_line(&mut line);
            first.push(line);
        }
        let Some(url) = first[0].split("listening on ").nth(1) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("printed {:?} instead of its address", first[0]));
        };
        Ok(Proc {
            url: url.trim().to_string(),
            child,
            lines: first,
            stdout,
        })
    }

    /// Its process id (for signals).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends it `signal` (as `kill` names it: `-STOP`, `-CONT`, `-TERM`); panics if `kill`
    /// fails.
    pub fn signal(&self, signal: &str) {
        self.try_signal(signal)
            .unwrap_or_else(|e| panic!("kill {signal}: {e}"));
    }

    /// [`Proc::signal`], the failure returned.
    pub fn try_signal(&self, signal: &str) -> std::io::Result<()> {
        signal_pid(self.pid(), signal)
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
