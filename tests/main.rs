//! warmpath's integration tests: they run the real `warmpath` binary as a separate
//! process and check what it prints and how it fails.
//!
//! One test crate (this file and its modules), built as the `integration` test target of
//! the `warmpath` package so that Cargo hands it the binary's path.

mod simulate;

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `warmpath` with `args` and returns its output.
pub fn warmpath(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_warmpath"))
        .args(args)
        .output()
        .expect("the warmpath binary runs")
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
