//! Tenant configuration in Raft, as the router uses it: starting the Raft node, seeding an
//! empty cluster from the config file, following every applied change (tenant table and
//! pools swapped in place, no restart), and the router facts the admin API serves.

use super::app::App;
use super::config::{hash_api_key, Pool, RaftSettings};
use super::tenants::TenantTable;
use anyhow::{Context, Result};
use std::sync::Arc;
use std::time::Duration;
use warmpath_membership::raft::state::{
    Command, CommandResult, CommandV1, ConfigState, PoolSpec, TenantSpec,
};
use warmpath_membership::raft::{NodeConfig, RaftNode};

/// How long a router may go without hearing the Raft leader (or, leading, a quorum) and
/// still serve its copy of the configuration. Past it, and whenever its Raft is stopped,
/// it serves no tenant (503) and is not ready, so a key revoked through the leader stops
/// working on every ready router within this bound. Five elections' worth: an election
/// takes about a second, so a leader change never trips it.
pub const FOLLOW_BOUND: Duration = Duration::from_secs(5);

/// How often [`watch_following`] looks.
const FOLLOW_CHECK: Duration = Duration::from_millis(100);

/// Keeps `app.following` up to date with the Raft node (see [`FOLLOW_BOUND`]) until the
/// task is aborted.
pub async fn watch_following(app: Arc<App>, raft: Arc<RaftNode>) {
    metrics::describe_gauge!(
        crate::metric_names::ROUTER_CONFIG_FOLLOWED,
        "1 while this router follows the cluster's configuration (Raft runs, a leader heard within the bound); 0: it serves no tenant and is not ready."
    );
    let check = move || raft.following(FOLLOW_BOUND).map_err(|e| e.to_string());
    let gate = &app.following;
    let check = gate.check.get_or_init(|| Box::new(check));
    let mut tick = tokio::time::interval(FOLLOW_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        gate.set(check());
    }
}

/// Starts this router's Raft node.
pub async fn start(settings: &RaftSettings, admin_url: &str) -> Result<Arc<RaftNode>> {
    let mut config = NodeConfig::new(
        settings.node_id,
        admin_url,
        settings.data_dir.clone(),
        settings.voters.clone(),
    );
    config.auth_token = settings.peer_token.clone();
    let node = RaftNode::start(config)
        .await
        .context("cannot start the Raft node")?;
    Ok(Arc::new(node))
}

/// The pools as the state machine stores them.
fn pool_specs(pools: Vec<Pool>) -> Vec<(String, PoolSpec)> {
    pools.into_iter().map(|p| (p.model, p.spec)).collect()
}

/// The command that seeds an empty cluster with a config file's tenants and pools.
fn seed_command(tenants: &[(String, TenantSpec)], pools: &[(String, PoolSpec)]) -> CommandV1 {
    CommandV1::Seed {
        pools: pools.to_vec(),
        tenants: tenants.to_vec(),
    }
}

/// The router's tenants and pools for a Raft configuration state: the stored specs as
/// they are (the tenant table compiles them), every tenant kept.
pub fn from_state(state: &ConfigState) -> (Vec<(String, TenantSpec)>, Vec<Pool>) {
    let pools = state
        .pools
        .iter()
        .map(|(model, spec)| Pool {
            model: model.clone(),
            spec: spec.clone(),
        })
        .collect();
    let tenants = state
        .tenants
        .iter()
        .map(|(id, t)| (id.clone(), t.clone()))
        .collect();
    (tenants, pools)
}

/// Applies every configuration change to the running router until the task is aborted.
pub async fn follow(app: Arc<App>, raft: Arc<RaftNode>, default_tenant: Option<String>) {
    let mut rx = raft.subscribe();
    loop {
        let state = rx.borrow_and_update().clone();
        // Until the cluster holds a configuration (version 0: not seeded yet), the config
        // file's tenants and pools keep serving.
        if state.version == 0 {
            if rx.changed().await.is_err() {
                return;
            }
            continue;
        }
        let (tenants, pools) = from_state(&state);
        app.core().set_pools(&pools);
        app.set_tokenizers(&pools);
        // Rate-limit buckets carry over: a configuration change must not refill them.
        let table = TenantTable::next(
            Some(&app.tenants()),
            &tenants,
            &pools,
            default_tenant.clone(),
            state.version,
        );
        app.set_tenants(table);
        app.configure_residency(&pools);
        metrics::gauge!(crate::metric_names::CONFIG_VERSION).set(state.version as f64);
        tracing::info!(
            config_version = state.version,
            tenants = tenants.len(),
            pools = pools.len(),
            "configuration applied"
        );
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Seeds an empty cluster with the config file's pools and tenants (validated and complete:
/// a tenant that named no pool serves the first), in one command that applies all or
/// nothing and only to an empty state (`CommandV1::Seed`), so that no router ever serves a
/// half-seeded table. Every voter may try; only one seeding wins. A voter that finds the
/// cluster already configured puts only what is missing from it, so a seeding never
/// overwrites what an operator changed since.
pub async fn seed(raft: Arc<RaftNode>, tenants: Vec<(String, TenantSpec)>, pools: Vec<Pool>) {
    if tenants.is_empty() && pools.is_empty() {
        return;
    }
    let pools = pool_specs(pools);
    // Wait for a leader (or someone else's seeding).
    for _ in 0..600 {
        if raft.local_state().version > 0 || raft.status().leader.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if raft.local_state().version == 0 {
        let seed = seed_command(&tenants, &pools);
        match write_retrying(&raft, seed).await {
            Some(CommandResult::Applied { .. }) => {
                tracing::info!("seeded the tenant configuration from the config file");
                return;
            }
            Some(CommandResult::Conflict { current_version }) => {
                // Let this node apply what the conflict reported, then fill in.
                for _ in 0..100 {
                    if raft.local_state().version >= current_version {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Some(other) => {
                tracing::warn!(?other, "seeding from the config file: refused");
                return;
            }
            None => return,
        }
    }
    // Already configured: put only what is missing (puts are idempotent).
    let missing = pools
        .into_iter()
        .map(|(model, spec)| CommandV1::PutPool {
            model,
            spec,
            expected_version: None,
        })
        .chain(tenants.into_iter().map(|(id, spec)| CommandV1::PutTenant {
            id,
            spec,
            expected_version: None,
        }));
    for cmd in missing {
        let state = raft.local_state();
        let present = match &cmd {
            CommandV1::PutPool { model, .. } => state.pools.contains_key(model),
            CommandV1::PutTenant { id, .. } => state.tenants.contains_key(id),
            _ => true,
        };
        if present {
            continue;
        }
        match write_retrying(&raft, cmd).await {
            Some(CommandResult::Applied { .. }) => {}
            Some(other) => {
                tracing::warn!(
                    ?other,
                    "seeding from the config file: a command was refused"
                )
            }
            None => return,
        }
    }
}

/// Writes `cmd`, retrying errors (leader changes, timeouts) for about 10 s; `None` when
/// it never got an answer (logged).
async fn write_retrying(raft: &RaftNode, cmd: CommandV1) -> Option<CommandResult> {
    for tried in 1.. {
        match raft.write(Command::V1(cmd.clone())).await {
            Ok(result) => return Some(result),
            Err(error) if tried < 50 => {
                tracing::warn!(%error, "seeding from the config file: retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => {
                tracing::warn!(%error, "seeding from the config file failed; the cluster stays as it is");
                return None;
            }
        }
    }
    None
}

/// The router facts the admin API serves.
pub struct Info {
    pub app: Arc<App>,
}

impl std::fmt::Debug for Info {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Info").finish_non_exhaustive()
    }
}

impl crate::admin::RouterInfo for Info {
    fn index_stats(&self) -> serde_json::Value {
        let stats = self.app.core().index_stats();
        serde_json::to_value(stats).unwrap_or_default()
    }

    fn explain(&self, tenant: &str, body: &[u8]) -> Result<serde_json::Value, (u16, String)> {
        super::proxy::explain_for(&self.app, tenant, body)
            .map_err(|e| (e.status().as_u16(), e.to_string()))
    }

    fn cluster(&self) -> serde_json::Value {
        let peers = self
            .app
            .peer_list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        serde_json::json!({
            "node_id": self.app.config.cluster.as_ref().map(|c| c.node_id.clone()),
            "peers": peers,
        })
    }
}

/// blake3 of the admin token, as the admin API compares it.
pub fn token_hash(token: &str) -> [u8; 32] {
    hash_api_key(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::config::FileConfig;
    use warmpath_membership::raft::state::{Command, CommandResult, ConfigState};

    /// Every instance URL form the config file takes seeds a cluster: the file and the
    /// state machine read URLs by one rule (`instance_url`), so a file that validates is
    /// never refused when it seeds Raft.
    #[test]
    fn every_instance_url_the_file_takes_seeds_the_state_machine() {
        let forms = [
            ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
            ("http://10.0.0.2:8000/", "http://10.0.0.2:8000"),
            ("http://gpu-3", "http://gpu-3:80"),
            ("http://gpu-4.example/", "http://gpu-4.example:80"),
            ("http://[fd00::5]:8000", "http://[fd00::5]:8000"),
            ("http://[fd00::6]", "http://[fd00::6]:80"),
        ];
        let given: Vec<&str> = forms.iter().map(|(g, _)| *g).collect();
        let text = format!(
            "version = 1\n[[pools]]\nmodel = \"m\"\ninstances = {given:?}\nagents = [\"gpu-3:7700\"]\n"
        );
        let config = FileConfig::parse(&text).unwrap().validate().unwrap();
        let seed = seed_command(&config.tenants, &pool_specs(config.pools));
        let mut state = ConfigState::default();
        assert_eq!(
            state.apply(1, &Command::V1(seed)),
            CommandResult::Applied { version: 1 }
        );
        let stored: Vec<&str> = state.pools["m"]
            .instances
            .iter()
            .map(String::as_str)
            .collect();
        let canonical: Vec<&str> = forms.iter().map(|(_, c)| *c).collect();
        assert_eq!(stored, canonical);
    }
}
