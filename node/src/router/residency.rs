//! The router's side of residency: one QUIC link per cache-agent (mutual TLS from the
//! cluster CA), each running the residency subscriber (`warmpath_residency::net::follow`),
//! and every outcome applied to the routing core as observed
//! state. An agent silent beyond the expiry has its observations dropped, and routing
//! falls back to predictions for what it covered.
//!
//! Which agents: those given with `--residency-agent` and those the pools of the current
//! configuration name (`agents`, so that a Raft change adds and removes them on every
//! router at once). An entry `dns:[NAME@]HOST:PORT` stands for every address HOST
//! resolves to, each followed as its own agent and checked by NAME (a Kubernetes headless
//! Service in front of a DaemonSet of agents), and is resolved again every
//! [`RESOLVE_EVERY`]: agents that appear are followed, those that leave are dropped; a
//! failed lookup keeps what was followed. An agent that leaves the configuration is no
//! longer followed and what it reported is withdrawn. Each link also sends the agent the
//! configuration's tenant salts, which it needs to key its engines' chains.
//!
//! Not every router follows every agent (decision 0105): with `--residency-followers F`
//! (default [`DEFAULT_FOLLOWERS`]), an agent is followed by the `F` live routers that
//! rendezvous hashing of (agent, router) ranks first (`warmpath_residency::follow`), over
//! this router and the peers gossip reports live, so an agent's outbound does not grow with
//! the routers and a router's inbound shrinks as routers are added. A router that does not
//! follow an agent routes to its engines on predictions and usage reports. The agent's name
//! in the hash is its entry as configured (one address of a `dns:` entry: that address), the
//! same on every router; a router alone, or with at most `F` routers, follows all.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use tokio::sync::{mpsc, oneshot, watch};
use warmpath_residency::net::{
    endpoint, follow, AgentTarget, PrefetchSent, Prefetchers, TenantTable,
};
use warmpath_residency::tls::TlsFiles;
use warmpath_residency::Outcome;

use super::state::RouterState;

/// How often a `dns:` agent entry is resolved again (and its addresses' followers chosen
/// again).
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// Routers that follow each agent unless `--residency-followers` says otherwise.
pub const DEFAULT_FOLLOWERS: usize = 4;

/// Which agents this router follows: those whose top `followers` routers include it.
#[derive(Debug)]
pub struct Followership {
    /// Routers following each agent; 0: every router follows every agent.
    followers: usize,
    /// This router's node id (its gossip name), and the live routers, this one included,
    /// sorted; None until gossip reported them (a router alone follows every agent). One
    /// lock: the two are read and written together.
    routers: Mutex<Option<(String, Vec<String>)>>,
}

impl Followership {
    pub fn new(followers: usize) -> Followership {
        Followership {
            followers,
            routers: Mutex::new(None),
        }
    }

    /// Whether this router follows the agent named `agent`.
    pub fn wants(&self, agent: &str) -> bool {
        let routers = self.routers.lock().unwrap_or_else(|e| e.into_inner());
        let Some((me, all)) = routers.as_ref() else {
            return true;
        };
        if self.followers == 0 || all.len() <= self.followers {
            return true;
        }
        let names: Vec<&str> = all.iter().map(String::as_str).collect();
        warmpath_residency::follow::follows(me, agent, &names, self.followers)
    }

    /// Sets this router's name and the live peers'; whether the set changed.
    fn set(&self, me: &str, peers: &[String]) -> bool {
        let mut all: Vec<String> = peers.to_vec();
        all.push(me.to_string());
        all.sort_unstable();
        all.dedup();
        let mut routers = self.routers.lock().unwrap_or_else(|e| e.into_inner());
        let changed = routers.as_ref().is_none_or(|(m, a)| m != me || *a != all);
        if changed {
            *routers = Some((me.to_string(), all));
        }
        changed
    }
}

/// An agent entry: one agent, or (`dns:`) every address its host resolves to.
fn parse_entry(entry: &str) -> Result<(bool, AgentTarget), String> {
    warmpath_spec::AgentAddress::parse(entry)
        .map(|a| (a.dns, AgentTarget::from(a)))
        .map_err(|e| format!("agent {entry:?}: {e}"))
}

/// The agents this router follows.
#[derive(Debug)]
pub struct Residency {
    quic: warmpath_residency::net::quinn::Endpoint,
    expiry: Duration,
    out: mpsc::Sender<Outcome>,
    /// Followed always (`--residency-agent`).
    fixed: Vec<String>,
    /// Address → the follower's stop (dropping it stops the follower).
    following: Mutex<HashMap<String, oneshot::Sender<()>>>,
    tenants: watch::Sender<Arc<TenantTable>>,
    /// Each followed agent's link for prefetch hints, by the instances it reports.
    prefetchers: Prefetchers,
    /// Which of the agents this router follows.
    followership: Arc<Followership>,
    /// The configured agents, as last set (to choose again when routers come and go).
    configured: Mutex<Vec<String>>,
}

impl Residency {
    /// Starts following `fixed` (HOST:PORT; the name in their certificates is HOST) and
    /// applying what every followed agent reports to the routing core `core`.
    /// `followers`: routers per agent (0: all, decision 0105).
    pub fn start(
        core: Arc<parking_lot::Mutex<RouterState>>,
        fixed: &[String],
        tls: &TlsFiles,
        expiry: Duration,
        followers: usize,
    ) -> Result<Arc<Residency>> {
        for a in fixed {
            parse_entry(a).map_err(|e| anyhow::anyhow!("--residency-agent: {e}"))?;
        }
        let client = tls.client_config().map_err(anyhow::Error::msg)?;
        let bind: SocketAddr = "0.0.0.0:0".parse()?;
        let quic = endpoint(bind, None, Some(client)).map_err(anyhow::Error::msg)?;
        let (out, rx) = mpsc::channel::<Outcome>(1024);
        // Its own thread, not a tokio task: a snapshot is milliseconds to seconds of
        // work under the routing lock (handed to requests between steps), which would
        // hold a runtime worker and the tasks queued on it for as long. The thread ends
        // when the last follower's sender is dropped.
        std::thread::Builder::new()
            .name("residency-apply".into())
            .spawn(move || apply(&core, rx))
            .map_err(|e| anyhow::anyhow!("starting the residency apply thread: {e}"))?;
        let residency = Arc::new(Residency {
            quic,
            expiry,
            out,
            fixed: fixed.to_vec(),
            following: Mutex::new(HashMap::new()),
            tenants: watch::Sender::new(Arc::new(TenantTable::default())),
            prefetchers: Prefetchers::default(),
            followership: Arc::new(Followership::new(followers)),
            configured: Mutex::new(Vec::new()),
        });
        residency.set_agents(&[]);
        Ok(residency)
    }

    /// Follows `configured` and the fixed agents, and no other: new ones are connected,
    /// departed ones dropped with what they reported. Addresses that do not parse were
    /// refused when the configuration was written.
    pub fn set_agents(&self, configured: &[String]) {
        *self.configured.lock().unwrap_or_else(|e| e.into_inner()) = configured.to_vec();
        // A `dns:` entry is kept: which of its addresses to follow is chosen per address.
        let wanted: BTreeSet<String> = self
            .fixed
            .iter()
            .chain(configured)
            .filter(|a| a.starts_with("dns:") || self.followership.wants(a))
            .cloned()
            .collect();
        let mut following = self.following.lock().unwrap_or_else(|e| e.into_inner());
        reconcile(&mut following, &wanted, |a| {
            let Ok((every_address, target)) = parse_entry(a) else {
                tracing::warn!(agent = %a, "not a [dns:][NAME@]HOST:PORT agent address; not followed");
                return None;
            };
            let (stop, stopped) = oneshot::channel();
            let (quic, out, tenants, prefetchers) = (
                self.quic.clone(),
                self.out.clone(),
                self.tenants.subscribe(),
                self.prefetchers.clone(),
            );
            if every_address {
                tokio::spawn(follow_each(
                    quic,
                    target,
                    self.expiry,
                    out,
                    stopped,
                    tenants,
                    (prefetchers, self.followership.clone()),
                ));
            } else {
                tokio::spawn(follow(
                    quic,
                    target,
                    self.expiry,
                    out,
                    stopped,
                    tenants,
                    prefetchers,
                ));
            }
            Some(stop)
        });
        metrics::gauge!(crate::metric_names::ROUTER_RESIDENCY_AGENTS).set(following.len() as f64);
    }

    /// This router's gossip name and its live peers': when they change, the agents it
    /// follows are chosen again (new ones followed, others dropped with what they
    /// reported; `dns:` entries at their next resolution).
    pub fn set_routers(&self, me: &str, peers: &[String]) {
        if self.followership.set(me, peers) {
            let configured = self
                .configured
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            self.set_agents(&configured);
        }
    }

    /// Asks the agent that reports `instance` (its URL) to promote `keys` from L2 into its
    /// L1 (a hint: see `warmpath_residency::Reply::Prefetch`), and counts what became of it.
    pub fn prefetch(&self, instance: &str, keys: Vec<u64>) -> PrefetchSent {
        let sent = self.prefetchers.send(instance, keys);
        metrics::counter!(crate::metric_names::ROUTER_PREFETCHES_TOTAL, "result" => sent.name())
            .increment(1);
        sent
    }

    /// The tenants' (cache salt, tenant id) of configuration `version`, sent to every
    /// agent now and on each change.
    pub fn set_tenants(&self, version: u64, mut salts: Vec<(String, String)>) {
        salts.sort_unstable();
        let table = TenantTable {
            version,
            tenants: salts,
        };
        self.tenants.send_if_modified(|t| {
            let changed = **t != table;
            if changed {
                *t = Arc::new(table);
            }
            changed
        });
    }
}

/// Follows every address `target`'s host resolves to, each as its own agent checked by
/// `target`'s name, resolving again every [`RESOLVE_EVERY`] until `stop` fires (then
/// every follower stops and what its agent reported is withdrawn).
async fn follow_each(
    quic: warmpath_residency::net::quinn::Endpoint,
    target: AgentTarget,
    expiry: Duration,
    out: mpsc::Sender<Outcome>,
    mut stop: oneshot::Receiver<()>,
    tenants: watch::Receiver<Arc<TenantTable>>,
    (prefetchers, followership): (Prefetchers, Arc<Followership>),
) {
    let mut following: HashMap<SocketAddr, oneshot::Sender<()>> = HashMap::new();
    let mut tick = tokio::time::interval(RESOLVE_EVERY);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {}
        }
        let addresses: BTreeSet<SocketAddr> = match tokio::net::lookup_host(&target.address).await {
            Ok(found) => found
                .filter(|a: &SocketAddr| followership.wants(&a.to_string()))
                .collect(),
            Err(error) => {
                tracing::warn!(agents = %target.address, %error, "cannot resolve the agents; following those found before");
                continue;
            }
        };
        reconcile(&mut following, &addresses, |&address| {
            let one = AgentTarget {
                address: address.to_string(),
                server_name: target.server_name.clone(),
            };
            let (stop_one, stopped) = oneshot::channel();
            tokio::spawn(follow(
                quic.clone(),
                one,
                expiry,
                out.clone(),
                stopped,
                tenants.clone(),
                prefetchers.clone(),
            ));
            Some(stop_one)
        });
    }
}

/// Makes `following` hold exactly `wanted`: drops the others (a follower stops when its
/// handle is dropped) and starts the new ones (`start` may refuse one: `None`). For the
/// configured agents and for the addresses of each `dns:` entry alike.
fn reconcile<K: Clone + Ord + std::hash::Hash, T>(
    following: &mut HashMap<K, T>,
    wanted: &BTreeSet<K>,
    mut start: impl FnMut(&K) -> Option<T>,
) {
    following.retain(|k, _| wanted.contains(k));
    for k in wanted {
        if !following.contains_key(k) {
            if let Some(handle) = start(k) {
                following.insert(k.clone(), handle);
            }
        }
    }
}

/// Applies every follower's outcomes to the routing core, on the thread it is given.
fn apply(core: &parking_lot::Mutex<RouterState>, mut rx: mpsc::Receiver<Outcome>) {
    while let Some(outcome) = rx.blocking_recv() {
        // Between a reset and the next snapshot an agent's engines are not observed: their
        // predictions then live out their time as without an agent.
        let (instances, changes, kind, observed) = match outcome {
            Outcome::Apply {
                instances,
                changes,
                sent_ms,
            } => {
                if let Some(sent) = sent_ms {
                    let lag_ms = warmpath_residency::net::unix_ms().saturating_sub(sent);
                    metrics::histogram!(crate::metric_names::ROUTER_RESIDENCY_LAG_SECONDS)
                        .record(lag_ms as f64 / 1e3);
                }
                (instances, changes, "apply", true)
            }
            Outcome::Reset {
                instances, removed, ..
            } => (instances, removed, "reset", false),
            Outcome::Nothing => continue,
        };
        // One hold of the routing core's lock for the whole outcome, handed to a waiting
        // request between steps (`warmpath_residency::steps`): a request waits for one
        // step, never for the rest of a snapshot or burst.
        let applied = {
            let mut core = core.lock();
            let engines = core.agent_engines(&instances);
            core.set_observed(&engines, observed);
            warmpath_residency::steps::apply_in_steps(&mut core, &changes, |core, step| {
                core.apply_residency(&engines, step)
            })
        };
        metrics::counter!(crate::metric_names::ROUTER_RESIDENCY_CHANGES_TOTAL, "kind" => kind)
            .increment(applied as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dns_entry_follows_exactly_the_addresses_found() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        let set = |v: &[&str]| v.iter().map(|s| addr(s)).collect::<BTreeSet<_>>();
        let mut following = HashMap::new();
        let mut started = Vec::new();
        let mut round = |found: &[&str], following: &mut HashMap<SocketAddr, u32>| {
            reconcile(following, &set(found), |&a| {
                started.push(a);
                Some(started.len() as u32)
            });
            let mut now: Vec<SocketAddr> = following.keys().copied().collect();
            now.sort();
            now
        };
        let two = round(&["10.0.0.1:7700", "10.0.0.2:7700"], &mut following);
        assert_eq!(two, vec![addr("10.0.0.1:7700"), addr("10.0.0.2:7700")]);
        // One leaves, one arrives: the one that stayed is not restarted.
        let next = round(&["10.0.0.2:7700", "10.0.0.3:7700"], &mut following);
        assert_eq!(next, vec![addr("10.0.0.2:7700"), addr("10.0.0.3:7700")]);
        assert_eq!(following[&addr("10.0.0.2:7700")], 2);
        assert!(round(&[], &mut following).is_empty());
        assert_eq!(started.len(), 3);
    }

    #[test]
    fn agent_entries_parse_with_and_without_dns() {
        let (every, t) = parse_entry("dns:agent@agents.llm.svc:7700").unwrap();
        assert!(every);
        assert_eq!(
            (t.address.as_str(), t.server_name.as_str()),
            ("agents.llm.svc:7700", "agent")
        );
        let (every, t) = parse_entry("gpu-1:7700").unwrap();
        assert!(!every);
        assert_eq!(t.server_name, "gpu-1");
        assert!(parse_entry("dns:agents.llm.svc").is_err());
    }
}
