//! The router's side of residency: one QUIC link per cache-agent (mutual TLS from the
//! cluster CA), each running the residency subscriber (`warmpath_cache_agent::
//! residency_net::follow`), and every outcome applied to the routing core as observed
//! state. An agent silent beyond the expiry has its observations dropped, and routing
//! falls back to predictions for what it covered.
//!
//! Which agents: those given with `--residency-agent` and those the pools of the current
//! configuration name (`agents`, so that a Raft change adds and removes them on every
//! router at once). An agent that leaves the configuration is no longer followed and what
//! it reported is withdrawn. Each link also sends the agent the configuration's tenant
//! salts, which it needs to key its engines' chains.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use tokio::sync::{mpsc, oneshot, watch};
use warmpath_cache_agent::residency::Outcome;
use warmpath_cache_agent::residency_net::{endpoint, follow, AgentTarget};
use warmpath_cache_agent::tls::TlsFiles;

use super::proxy::App;

/// Residency changes applied under one hold of the routing core's lock.
const APPLY_CHUNK: usize = 256;

/// The agents this router follows.
#[derive(Debug)]
pub struct Residency {
    quic: warmpath_cache_agent::residency_net::quinn::Endpoint,
    expiry: Duration,
    out: mpsc::Sender<Outcome>,
    /// Followed always (`--residency-agent`).
    fixed: Vec<String>,
    /// Address → the follower's stop (dropping it stops the follower).
    following: Mutex<HashMap<String, oneshot::Sender<()>>>,
    tenants: watch::Sender<Arc<Vec<(String, String)>>>,
}

impl Residency {
    /// Starts following `fixed` (HOST:PORT; the name in their certificates is HOST) and
    /// applying what every followed agent reports to `app`'s routing core.
    pub fn start(
        app: Arc<App>,
        fixed: &[String],
        tls: &TlsFiles,
        expiry: Duration,
    ) -> Result<Arc<Residency>> {
        for a in fixed {
            AgentTarget::parse(a).map_err(|e| anyhow::anyhow!("--residency-agent: {e}"))?;
        }
        let client = tls.client_config().map_err(anyhow::Error::msg)?;
        let bind: SocketAddr = "0.0.0.0:0".parse()?;
        let quic = endpoint(bind, None, Some(client)).map_err(anyhow::Error::msg)?;
        let (out, rx) = mpsc::channel::<Outcome>(1024);
        tokio::spawn(apply(app, rx));
        let residency = Arc::new(Residency {
            quic,
            expiry,
            out,
            fixed: fixed.to_vec(),
            following: Mutex::new(HashMap::new()),
            tenants: watch::Sender::new(Arc::new(Vec::new())),
        });
        residency.set_agents(&[]);
        Ok(residency)
    }

    /// Follows `configured` and the fixed agents, and no other: new ones are connected,
    /// departed ones dropped with what they reported. Addresses that do not parse were
    /// refused when the configuration was written.
    pub fn set_agents(&self, configured: &[String]) {
        let wanted: BTreeSet<&String> = self.fixed.iter().chain(configured).collect();
        let mut following = self.following.lock().unwrap_or_else(|e| e.into_inner());
        following.retain(|a, _| wanted.contains(a));
        for a in wanted {
            if following.contains_key(a) {
                continue;
            }
            let Ok(target) = AgentTarget::parse(a) else {
                tracing::warn!(agent = %a, "not a [NAME@]HOST:PORT agent address; not followed");
                continue;
            };
            let (stop, stopped) = oneshot::channel();
            tokio::spawn(follow(
                self.quic.clone(),
                target,
                self.expiry,
                self.out.clone(),
                stopped,
                self.tenants.subscribe(),
            ));
            following.insert(a.clone(), stop);
        }
        metrics::gauge!("warmpath_router_residency_agents").set(following.len() as f64);
    }

    /// The tenants' (cache salt, tenant id), sent to every agent now and on each change.
    pub fn set_tenants(&self, mut salts: Vec<(String, String)>) {
        salts.sort_unstable();
        self.tenants.send_if_modified(|t| {
            let changed = **t != salts;
            if changed {
                *t = Arc::new(salts);
            }
            changed
        });
    }
}

/// Applies every follower's outcomes to the routing core.
async fn apply(app: Arc<App>, mut rx: mpsc::Receiver<Outcome>) {
    while let Some(outcome) = rx.recv().await {
        // Between a reset and the next snapshot an agent's engines are not observed: their
        // predictions then live out their time as without an agent.
        let (instances, changes, kind, observed) = match outcome {
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
                (instances, changes, "apply", true)
            }
            Outcome::Reset {
                instances, removed, ..
            } => (instances, removed, "reset", false),
            Outcome::Nothing => continue,
        };
        // The routing core's lock is taken per chunk, not for a whole snapshot or burst:
        // requests routed meanwhile wait for at most one chunk.
        let mut applied = 0;
        app.core
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_observed(&instances, observed);
        for chunk in changes.chunks(APPLY_CHUNK) {
            applied += app
                .core
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .apply_residency(&instances, chunk);
        }
        metrics::counter!("warmpath_router_residency_changes_total", "kind" => kind)
            .increment(applied as u64);
    }
}
