//! warmpath's integration tests: they run the real `warmpath` binary as a separate
//! process and check what it prints and how it fails.
//!
//! One test crate (this file and its modules), built as the `integration` test target of
//! the `warmpath` package so that Cargo hands it the binary's path.

mod agent;
mod agent_attacks;
mod clients;
mod cluster;
mod compose;
mod deploy;
mod engine_sim_hyperpod;
mod helm;
mod house;
mod hyperpod;
mod kv_events;
mod lmcache_e2e;
mod raft;
mod readme;
mod report;
mod router;
mod security_tiers;
mod simulate;

pub use warmpath_testkit::{free_addr, scratch_dir, warmpath_bin, Proc, Redis};

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The venv of the tests' Python-packaged tools (tests/tools/requirements.txt: the openai
/// client, helm, kubernetes-validate): `WARMPATH_TEST_VENV`, or `target/test-venv` of the
/// workspace, made or brought up to date by `tests/tools/setup-venv.sh` (as `.ci/run` does).
pub fn test_venv() -> PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let venv = std::env::var_os("WARMPATH_TEST_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/test-venv"));
    let status = Command::new("sh")
        .arg(root.join("tests/tools/setup-venv.sh"))
        .arg(&venv)
        .status()
        .expect("sh runs");
    assert!(
        status.success(),
        "could not set up {} with the tests' tools (python3 with venv and pip, and PyPI, \
         are needed): run tests/tools/setup-venv.sh {0}",
        venv.display()
    );
    venv
}

/// An agent configuration file in `dir` that seals L2 objects under a cluster key (also in
/// `dir`; decision 0106): agents started with it share the key.
pub fn cluster_key_config(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::write(dir.join("cluster.key"), "a cluster secret of some length\n").unwrap();
    let toml = dir.join("keyed.toml");
    std::fs::write(
        &toml,
        format!(
            "version = 1\n[l2]\nkey_file = {:?}\n",
            dir.join("cluster.key").display().to_string()
        ),
    )
    .unwrap();
    toml
}

/// Runs `tests/clients/SCRIPT` with `python` (its warnings off) and `args`, prints what it
/// printed, and checks that it ended well and said `all checks passed`.
pub fn run_client_checks(python: &std::path::Path, script: &str, args: &[&str]) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/clients")
        .join(script);
    let out = Command::new(python)
        .args(["-W", "ignore"])
        .arg(script)
        .args(args)
        .output()
        .expect("the venv's python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}\n{stderr}");
}

/// Polls `f` until it gives a value; panics, naming `what`, after `within`.
pub async fn until<T, F, Fut>(within: std::time::Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A router's Raft and gossip status as `warmpath admin --json cluster` prints it, through
/// the admin API at `admin_url` with `token`; `None` while it does not answer.
pub fn cluster_status(admin_url: &str, token: &str) -> Option<serde_json::Value> {
    let out = warmpath(&[
        "admin", "--url", admin_url, "--token", token, "--json", "cluster",
    ]);
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

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
    Command::new(warmpath_bin())
        .args(args)
        .output()
        .expect("the warmpath binary runs")
}

/// Runs `warmpath` with `args` for at most `limit`: its output once it exits, or `None`
/// (the process killed) if it was still running, as a server that should have refused to
/// start would be.
pub fn warmpath_exits_within(args: &[&str], limit: std::time::Duration) -> Option<Output> {
    let mut child = Command::new(warmpath_bin())
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

/// `warmpath certs --out DIR/certs` with `args` (roles and names); the directory.
pub fn make_certs(dir: &std::path::Path, args: &[&str]) -> PathBuf {
    let out_dir = dir.join("certs");
    let mut all = vec!["certs", "--out", out_dir.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = warmpath(&all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out_dir
}

/// A router on a loopback port from the config file `config`, with the `router`
/// certificate of `certs` and explanations allowed.
pub fn router_from_config(config: &std::path::Path, certs: &std::path::Path) -> Proc {
    router_from_config_with(config, certs, &["--allow-explain"])
}

/// As [`router_from_config`], with `extra` flags instead of `--allow-explain`.
pub fn router_from_config_with(
    config: &std::path::Path,
    certs: &std::path::Path,
    extra: &[&str],
) -> Proc {
    let mut args = vec![
        "router",
        "--listen",
        "127.0.0.1:0",
        "--config",
        config.to_str().unwrap(),
        "--tls-dir",
        certs.to_str().unwrap(),
        "--tls-name",
        "router",
    ];
    args.extend_from_slice(extra);
    Proc::start(&args)
}
