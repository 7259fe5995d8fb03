//! The `warmpath` library: everything the binary runs, one module per role, so that the
//! fuzz targets (`fuzz/`) and benches reach the same code as the binary.

pub mod admin;
pub mod agent;
pub mod certs;
pub mod demo;
pub mod engine_sim;
/// The fuzzing harness, for the fuzz targets (`fuzz/`, feature `fuzzing`) and the test that
/// replays their corpus; not in the shipped binary.
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod loadgen;
pub mod metric_names;
pub mod pretokenize;
pub mod prompt;
pub mod report;
pub mod router;
pub mod simulate;

/// Resolves on SIGINT or SIGTERM: the start of a graceful shutdown.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: draining open requests");
}
