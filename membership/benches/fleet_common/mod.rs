//! What the fleet gossip benches (`fleet_lag`, `fleet_faults`) share: R production
//! [`Gossip`] adapters started in one process, on tokio's paused clock, over real UDP on
//! 127.0.0.1; the workloads' decision sizes; a lag histogram; the machine's description.
//! Lives in a folder (`fleet_common/mod.rs`) so that cargo does not take it for a bench.

#![allow(dead_code)] // each bench uses its own subset

use std::net::SocketAddr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;
use tokio::time::Instant;
use warmpath_index::keys::BlockKey;
use warmpath_membership::decisions::{encode, BatchWire, Decision};
use warmpath_membership::gossip::{Gossip, GossipConfig, DEFAULT_GOSSIP_INTERVAL};
use warmpath_membership::schema::DECISION_BUDGET_KEYS_PER_S;

/// The router's cluster tick (`node/src/router/mod.rs`: `cluster::run(.., 25 ms, ..)`).
pub const TICK: Duration = Duration::from_millis(25);
/// The router's default decision TTL (`predicted_ttl_ms`).
pub const DECISION_TTL: Duration = Duration::from_secs(120);
/// Lag histogram resolution and range.
pub const BUCKET_US: u64 = 1_000;
pub const BUCKETS: usize = 120_000;
/// Longest wait for membership to converge at start.
pub const JOIN_LIMIT: Duration = Duration::from_secs(30);

/// A workload: block keys per decision, chosen so that one decision encodes to the bytes per
/// routed request that BENCHMARKS.md's fleet-scale section measured for it.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub name: &'static str,
    pub keys: usize,
    pub measured_bytes: u32,
}

pub const WORKLOADS: [Workload; 3] = [
    Workload {
        name: "chat",
        keys: 16,
        measured_bytes: 189,
    },
    Workload {
        name: "conversation",
        keys: 9,
        measured_bytes: 110,
    },
    Workload {
        name: "longdoc",
        keys: 306,
        measured_bytes: 3_285,
    },
];

/// The workload named `name` (panics on an unknown one: a bench's input error).
pub fn workload(name: &str) -> Workload {
    *WORKLOADS
        .iter()
        .find(|w| w.name == name)
        .expect("workload: chat, conversation or longdoc")
}

pub fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

pub fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A decision with random block keys (they do not compress: real keys are hashes).
pub fn random_decision(rng: &mut StdRng, keys: usize) -> Decision {
    Decision {
        instance: rng.gen(),
        keys: (0..keys).map(|_| BlockKey(rng.gen())).collect(),
    }
}

/// What one tick of a router's publishing sent: decisions `first..=last` of its own
/// sequence, `n` of them, in one batch of `bytes` encoded.
pub struct Published {
    pub n: usize,
    pub first: u64,
    pub last: u64,
    pub bytes: u64,
}

/// One tick of a router's publishing at `per_tick` decisions a tick (the fraction carried
/// in `owed`): the decisions it owes, random over `keys` keys, published as one batch made
/// at `at_us`. None when it owes none this tick.
pub async fn publish_tick(
    me: &Gossip,
    rng: &mut StdRng,
    keys: usize,
    owed: &mut f64,
    per_tick: f64,
    at_us: u64,
) -> Option<Published> {
    *owed += per_tick;
    let n = *owed as usize;
    *owed -= n as f64;
    if n == 0 {
        return None;
    }
    let decisions: Vec<Decision> = (0..n).map(|_| random_decision(rng, keys)).collect();
    let bytes = encode(&BatchWire::V1 {
        made_at_ms: 1_764_000_000_000,
        decisions: decisions.clone(),
    })
    .len() as u64;
    let first = me.published_seq() + 1;
    let last = me.publish_decisions(at_us / 1000, decisions).await;
    Some(Published {
        n,
        first,
        last,
        bytes,
    })
}

/// Router `i`'s gossip configuration, as production builds it: a cluster secret (so every
/// datagram carries a MAC), the default gossip interval, the given decision TTL, the
/// production decision budget.
pub fn gossip_config(
    i: usize,
    listen: SocketAddr,
    seeds: &[SocketAddr],
    cluster_id: &str,
    decision_ttl: Duration,
) -> GossipConfig {
    GossipConfig {
        node_id: format!("router-{i:03}"),
        cluster_id: cluster_id.into(),
        listen,
        advertise: listen,
        seeds: seeds.iter().map(|a| a.to_string()).collect(),
        gossip_interval: DEFAULT_GOSSIP_INTERVAL,
        http_url: format!("http://10.0.{}.{}:8080", i / 250, i % 250 + 1),
        decision_ttl,
        secret: Some(b"fleet-lag bench secret".to_vec()),
        // `FLEET_DECISION_BUDGET` (keys/s for the cluster, 0: none) for comparing.
        decision_keys_per_s: env_f64("FLEET_DECISION_BUDGET", DECISION_BUDGET_KEYS_PER_S as f64)
            as u64,
        datagrams: None,
    }
}

/// Any free port on loopback.
pub fn loopback_any() -> SocketAddr {
    ([127, 0, 0, 1], 0).into()
}

/// Starts `routers` adapters (the first three are every router's seeds), staggered over one
/// gossip interval as real starts are, and waits until every one lists R − 1 live peers.
/// Returns them with the simulated seconds membership took to converge (`None`: not within
/// [`JOIN_LIMIT`]).
pub async fn start_routers(
    routers: usize,
    cluster_id: &str,
    decision_ttl: Duration,
) -> (Vec<Gossip>, Vec<SocketAddr>, Option<f64>) {
    let mut gossips: Vec<Gossip> = Vec::with_capacity(routers);
    let mut seeds = Vec::new();
    for i in 0..routers {
        let g = Gossip::start(gossip_config(
            i,
            loopback_any(),
            &seeds,
            cluster_id,
            decision_ttl,
        ))
        .await
        .expect("gossip starts");
        if seeds.len() < 3 {
            seeds.push(g.gossip_addr());
        }
        gossips.push(g);
        tokio::time::sleep(DEFAULT_GOSSIP_INTERVAL / routers as u32).await;
    }
    let t0 = Instant::now();
    loop {
        let mut all = true;
        for g in &gossips {
            if g.live_peers().await.len() + 1 < routers {
                all = false;
                break;
            }
        }
        if all {
            return (gossips, seeds, Some(t0.elapsed().as_secs_f64()));
        }
        if t0.elapsed() > JOIN_LIMIT {
            return (gossips, seeds, None);
        }
        tokio::time::sleep(TICK).await;
    }
}

/// The histogram bucket of a lag in µs (the last bucket holds everything later).
pub fn lag_bucket(lag_us: u64) -> usize {
    ((lag_us / BUCKET_US) as usize).min(BUCKETS - 1)
}

/// The lag at quantile `q` over delivered and undelivered pairs (undelivered last).
pub fn quantile(lag: &[u64], undelivered: u64, q: f64, run_s: f64) -> String {
    let total: u64 = lag.iter().sum::<u64>() + undelivered;
    if total == 0 {
        return "-".into();
    }
    let want = ((total as f64 * q).ceil() as u64).max(1);
    let mut seen = 0;
    for (b, n) in lag.iter().enumerate() {
        seen += n;
        if seen >= want {
            if b == BUCKETS - 1 {
                return format!("> {} s", BUCKETS as u64 * BUCKET_US / 1_000_000);
            }
            return fmt_ms((b as u64 + 1) * BUCKET_US / 1000);
        }
    }
    format!("> {run_s:.1} s")
}

pub fn fmt_ms(ms: u64) -> String {
    if ms >= 1000 {
        format!("{:.2} s", ms as f64 / 1000.0)
    } else {
        format!("{ms} ms")
    }
}

pub fn kb(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e6 {
        format!("{:.2} MB/s", bytes_per_s / 1e6)
    } else {
        format!("{:.0} KB/s", bytes_per_s / 1e3)
    }
}

pub fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// CPU seconds (user + system) this process has used.
pub fn cpu_s() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit(')').next()?.split_whitespace().collect::<Vec<_>>();
            // Fields 14 and 15 (utime, stime), counted after the command name (field 2).
            let user: f64 = rest.get(11)?.parse().ok()?;
            let system: f64 = rest.get(12)?.parse().ok()?;
            Some((user + system) / 100.0)
        })
        .unwrap_or(0.0)
}

/// Cores, CPU model and load average.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} × {cpu}, load average {}", load_average())
}

/// The 1, 5 and 15 minute load averages.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The single-threaded runtime on a paused clock that every fleet bench runs in.
pub fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
}
