//! Connects a router to its peers through gossip (`warmpath_membership::gossip`):
//! publishes this router's routing decisions and load, applies the others'.
//!
//! Three loops share one task: every `tick` the outbox of new decisions is published as
//! one batch (so a decision waits at most one tick before it leaves), every `load_every`
//! the router's own per-instance load is published, and every `tick` the peers' new
//! batches and latest loads are applied. Routing never waits on any of this: a router
//! cut off from its peers keeps routing on its own view.

use super::app::App;
use super::state::{now_ms, SharedDecision};
use std::sync::Arc;
use std::time::Duration;
use warmpath_membership::decisions::Decision;
use warmpath_membership::gossip::{Cursor, Gossip};

/// Runs the cluster loops until the task is aborted.
pub async fn run(app: Arc<App>, gossip: Arc<Gossip>, tick: Duration, load_every: Duration) {
    app.core().enable_sharing();
    let mut cursor = Cursor::default();
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_load = tokio::time::Instant::now() - load_every;
    loop {
        ticker.tick().await;
        let ((outbox, since_ms), loads) = {
            let mut core = app.core();
            (core.take_outbox(), core.own_loads())
        };
        if !outbox.is_empty() {
            let count = outbox.len();
            let decisions: Vec<Decision> = outbox
                .into_iter()
                .map(|d| Decision {
                    instance: d.instance,
                    keys: d.keys,
                })
                .collect();
            gossip.publish_decisions(since_ms, decisions).await;
            metrics::counter!(crate::metric_names::CLUSTER_DECISIONS_SENT_TOTAL)
                .increment(count as u64);
        }
        if last_load.elapsed() >= load_every {
            last_load = tokio::time::Instant::now();
            gossip.publish_load(&loads).await;
        }
        let update = gossip.poll(&mut cursor).await;
        let now = now_ms();
        let mut shared = Vec::new();
        for (_origin, _seq, batch) in &update.batches {
            let warmpath_membership::decisions::BatchWire::V1 {
                made_at_ms,
                decisions,
            } = batch;
            metrics::histogram!(crate::metric_names::CLUSTER_DISSEMINATION_LAG_SECONDS)
                .record(now.saturating_sub(*made_at_ms) as f64 / 1e3);
            shared.extend(decisions.iter().map(|d| SharedDecision {
                instance: d.instance,
                keys: d.keys.clone(),
            }));
        }
        {
            let mut core = app.core();
            if !shared.is_empty() {
                let unknown = core.apply_shared(&shared);
                metrics::counter!(crate::metric_names::CLUSTER_DECISIONS_APPLIED_TOTAL)
                    .increment((shared.len() - unknown) as u64);
                metrics::counter!(crate::metric_names::CLUSTER_DECISIONS_UNKNOWN_INSTANCE_TOTAL)
                    .increment(unknown as u64);
            }
            core.set_peer_loads(update.loads);
        }
        let counted = app
            .peer_count
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .update(
                update.peers.iter().map(|p| p.node_id.as_str()),
                std::time::Instant::now(),
            );
        app.peers
            .store(counted, std::sync::atomic::Ordering::Relaxed);
        if let (Some(residency), Some(cluster)) = (app.residency.get(), &app.config.cluster) {
            let peers: Vec<String> = update.peers.iter().map(|p| p.node_id.clone()).collect();
            residency.set_routers(&cluster.node_id, &peers);
        }
        *app.peer_list.lock().unwrap_or_else(|e| e.into_inner()) = update
            .peers
            .iter()
            .map(|p| serde_json::json!({"node_id": p.node_id, "http": p.http_url, "gossip": p.gossip_addr.to_string()}))
            .collect();
        // Peers, bytes and decode errors are the gossip layer's own metrics.
        if !update.lagging.is_empty() {
            metrics::counter!(crate::metric_names::CLUSTER_DIGEST_MISMATCHES_TOTAL)
                .increment(update.lagging.len() as u64);
        }
    }
}

/// Starts gossip for this router (port 0 picks a free UDP port). Returns the gossip
/// handle and the address peers reach it at.
pub async fn start_gossip(
    settings: &super::config::ClusterSettings,
    http_url: &str,
    decision_ttl: Duration,
) -> anyhow::Result<(Arc<Gossip>, std::net::SocketAddr)> {
    use anyhow::Context;
    let config = warmpath_membership::gossip::GossipConfig {
        node_id: settings.node_id.clone(),
        cluster_id: "warmpath".into(),
        listen: settings.gossip_listen,
        advertise: settings.gossip_listen,
        seeds: settings.seeds.clone(),
        gossip_interval: settings.gossip_interval,
        http_url: http_url.to_string(),
        decision_ttl,
        secret: settings.secret.clone(),
        decision_keys_per_s: warmpath_membership::schema::DECISION_BUDGET_KEYS_PER_S,
        datagrams: None,
    };
    let gossip = Gossip::start(config).await.context("cannot start gossip")?;
    let addr = gossip.advertise_addr();
    Ok((Arc::new(gossip), addr))
}
