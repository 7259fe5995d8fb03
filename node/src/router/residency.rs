//! The router's side of residency: one QUIC link per cache-agent (mutual TLS from the
//! cluster CA), each running the residency subscriber (`warmpath_cache_agent::
//! residency_net::follow`), and every outcome applied to the routing core as observed
//! state. An agent silent beyond the expiry has its observations dropped, and routing
//! falls back to predictions for what it covered.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::sync::mpsc;
use warmpath_cache_agent::residency::Outcome;
use warmpath_cache_agent::residency_net::{endpoint, follow, AgentTarget};
use warmpath_cache_agent::tls::TlsFiles;

use super::proxy::App;

/// Starts following `agents` (HOST:PORT, the name in their certificates is the host).
pub fn start(app: Arc<App>, agents: &[String], tls: &TlsFiles, expiry: Duration) -> Result<()> {
    let client = tls.client_config().map_err(anyhow::Error::msg)?;
    let bind: SocketAddr = "0.0.0.0:0".parse()?;
    let quic = endpoint(bind, None, Some(client)).map_err(anyhow::Error::msg)?;
    let (tx, mut rx) = mpsc::channel::<Outcome>(1024);
    for a in agents {
        let (host, _) = a
            .rsplit_once(':')
            .with_context(|| format!("--residency-agent {a:?}: give HOST:PORT"))?;
        let addr = std::net::ToSocketAddrs::to_socket_addrs(a)
            .with_context(|| format!("--residency-agent {a:?}"))?
            .next()
            .with_context(|| format!("--residency-agent {a:?} resolves to nothing"))?;
        let target = AgentTarget {
            addr,
            server_name: host.trim_matches(|c| c == '[' || c == ']').to_string(),
        };
        tokio::spawn(follow(quic.clone(), target, expiry, tx.clone()));
    }
    drop(tx);
    tokio::spawn(async move {
        while let Some(outcome) = rx.recv().await {
            let (instances, changes, kind) = match outcome {
                Outcome::Apply {
                    instances,
                    changes,
                    sent_ms,
                } => {
                    if let Some(sent) = sent_ms {
                        let lag_ms =
                            warmpath_cache_agent::residency_net::unix_ms().saturating_sub(sent);
                        metrics::histogram!("warmpath_router_residency_lag_seconds")
                            .record(lag_ms as f64 / 1e3);
                    }
                    (instances, changes, "apply")
                }
                Outcome::Reset {
                    instances, removed, ..
                } => (instances, removed, "reset"),
                Outcome::Nothing => continue,
            };
            let applied = app
                .core
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .apply_residency(&instances, &changes);
            metrics::counter!("warmpath_router_residency_changes_total", "kind" => kind)
                .increment(applied as u64);
        }
    });
    Ok(())
}
