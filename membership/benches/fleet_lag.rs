//! Dissemination lag and gossip bytes of shared routing decisions at fleet scale (issue 27,
//! part 1: what `fleet_gossip` left unmeasured): R production [`Gossip`] adapters
//! (chitchat, the MAC gate, the loopback relay, a cluster secret as in production) in one
//! process, each publishing its share of the fleet's decisions and polling its peers'
//! exactly as the router's cluster loop does (`node/src/router/cluster.rs`: one
//! `publish_decisions` and one `poll` every 25 ms tick; gossip every 50 ms; decision TTL
//! 120 s, the router's default `predicted_ttl_ms`).
//!
//! **Time is simulated, the network is real.** The runtime is tokio's single-threaded one
//! with its clock paused (as `jepsen/tests/sim.rs` runs it): the clock jumps to the next
//! timer whenever every task is idle, so CPU time is free and 128 routers on 2 shared cores
//! gossip as 128 machines would, never starved into being marked dead. The datagrams travel
//! over real UDP sockets on 127.0.0.1 (the adapter's own `datagrams: None` path): zero
//! network delay, the kernel's default socket buffers. `jepsen/tests/sim.rs`'s simulated
//! network lives in that test file, tied to its Raft transport, so it is not reused here.
//! What simulated time hides, the bench prints beside it: the process's CPU time per
//! simulated second divided by R, i.e. one router's gossip CPU in cores (an upper bound: it
//! includes generating the decisions), and the part of it spent in the adapter's `poll`.
//!
//! Per configuration (routers R, fleet rate, workload): start R routers (seeds: the first
//! three), wait until every one lists R − 1 live peers, measure 1 s idle (heartbeats and
//! digests only), then publish for `FLEET_LAG_SECONDS` (default 2) simulated seconds, then
//! let every router catch up for at most `FLEET_LAG_DRAIN` (default 2) more. Each router
//! makes rate / R decisions per second of the workload's size (random block keys, so they
//! do not compress: real keys are hashes). Lag is from the `publish_decisions` call to the
//! `poll` that returns the batch at each other router, per (batch, receiver) pair; a pair
//! never delivered counts as later than the run, so a percentile that falls among them
//! prints as `>` the run's length. Bytes are what the adapter counted on its gossip socket
//! (MACs included), per router per simulated second, during the publishing window.
//!
//! Run: `cargo bench -p warmpath-membership --bench fleet_lag`. Environment:
//! `FLEET_LAG_ROUTERS` (default `8,32,64,128`), `FLEET_LAG_RATES` (fleet requests/s,
//! default `10000,100000`), `FLEET_LAG_WORKLOADS` (`chat`, `conversation`, `longdoc`;
//! default `chat,longdoc`), `FLEET_LAG_SECONDS`, `FLEET_LAG_DRAIN`, `FLEET_LAG_TTL` (the
//! decision TTL in seconds, default the router's 120), `FLEET_DECISION_BUDGET` (the
//! cluster's decision budget in block keys per second, default the production one; 0: none, as
//! before record 0118; the `shed` column is the share of decisions it kept back),
//! `FLEET_LAG_WALL` (wall seconds after
//! which a configuration stops publishing early, default 90; the row says so). 128 routers
//! need about 16,500 file descriptors (one loopback shadow socket per peer per router):
//! raise `ulimit -n` if it is lower.

mod fleet_common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_common::{
    cpu_s, env_f64, env_list, kb, lag_bucket, machine, paused_runtime, publish_tick, quantile,
    rss_mb, start_routers, workload, Workload, BUCKETS, DECISION_TTL, TICK,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::time::Instant;
use warmpath_membership::gossip::{Cursor, Gossip, GossipStats, DEFAULT_GOSSIP_INTERVAL};

/// The decision TTL: the router's default, or `FLEET_LAG_TTL` seconds.
fn decision_ttl() -> Duration {
    Duration::from_secs_f64(env_f64("FLEET_LAG_TTL", DECISION_TTL.as_secs_f64()))
}

/// What the routers record while they run.
#[derive(Debug)]
struct Book {
    /// Per origin index: publish time (µs of simulated time since the start) of each seq.
    published: Vec<Vec<u64>>,
    /// Deliveries per lag bucket (the last bucket holds everything later).
    lag: Vec<u64>,
    /// Polls at which a router listed fewer than R − 1 live peers.
    short_polls: u64,
    /// Fewest live peers any router listed.
    min_peers: usize,
    /// Batches reported as expired before delivery (`Update::lagging`).
    lagging: u64,
    /// Encoded bytes and decisions of every batch published.
    batch_bytes: u64,
    decisions: u64,
    /// Wall (here: CPU, one thread) seconds spent in `poll`, all routers together.
    poll_s: f64,
}

struct Shared {
    origins: HashMap<String, usize>,
    book: Mutex<Book>,
    start: Instant,
    /// Publishing stops when set.
    stop_publishing: AtomicBool,
    /// Routers that have applied every peer's last batch since publishing stopped.
    caught_up: AtomicUsize,
    stop: AtomicBool,
}

impl Shared {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }
}

/// One router's cluster loop: publish this tick's decisions, poll, record.
async fn router(
    i: usize,
    gossips: Arc<Vec<Arc<Gossip>>>,
    shared: Arc<Shared>,
    per_tick: f64,
    keys: usize,
) {
    let me = &gossips[i];
    let routers = gossips.len();
    let mut rng = StdRng::seed_from_u64(0x5eed ^ i as u64);
    let mut cursor = Cursor::new();
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut owed = 0.0;
    let mut caught_up = false;
    while !shared.stop.load(Ordering::Relaxed) {
        ticker.tick().await;
        if !shared.stop_publishing.load(Ordering::Relaxed) {
            let at = shared.now_us();
            if let Some(p) = publish_tick(me, &mut rng, keys, &mut owed, per_tick, at).await {
                let mut book = shared.book();
                book.published[i].extend((p.first..=p.last).map(|_| at));
                book.batch_bytes += p.bytes;
                book.decisions += p.n as u64;
            }
        }
        let polled = std::time::Instant::now();
        let update = me.poll(&mut cursor).await;
        let poll_s = polled.elapsed().as_secs_f64();
        let now = shared.now_us();
        let mut book = shared.book();
        book.poll_s += poll_s;
        for (origin, seq, _) in &update.batches {
            let Some(&o) = shared.origins.get(origin) else {
                continue;
            };
            let Some(&at) = book.published[o].get(*seq as usize - 1) else {
                continue;
            };
            book.lag[lag_bucket(now.saturating_sub(at))] += 1;
        }
        if update.peers.len() + 1 < routers {
            book.short_polls += 1;
        }
        book.min_peers = book.min_peers.min(update.peers.len());
        book.lagging += update.lagging.len() as u64;
        if !caught_up && shared.stop_publishing.load(Ordering::Relaxed) {
            let all = gossips.iter().enumerate().all(|(j, g)| {
                j == i || cursor.applied(g.origin()) >= book.published[j].len() as u64
            });
            if all {
                caught_up = true;
                shared.caught_up.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One configuration's results.
#[derive(Debug, Default)]
struct Row {
    routers: usize,
    rate: f64,
    workload: &'static str,
    bytes_per_decision: f64,
    join_s: Option<f64>,
    idle_out: f64,
    out_mean: f64,
    out_max: f64,
    in_mean: f64,
    in_max: f64,
    p50: String,
    p99: String,
    max: String,
    undelivered: u64,
    pairs: u64,
    /// Of the decisions made, the share shed by the publishing routers' budgets.
    shed: f64,
    published_s: f64,
    cut_short: bool,
    drain_s: Option<f64>,
    short_polls: u64,
    min_peers: usize,
    lagging: u64,
    lost_datagrams: i64,
    decode_errors: u64,
    cpu_per_router: f64,
    poll_per_router: f64,
    /// (CPU, of which poll) per router in each whole simulated second of publishing.
    cpu_by_second: Vec<(f64, f64)>,
    rss_mb: f64,
    state_mb: f64,
}

fn sum_stats(gossips: &[Arc<Gossip>]) -> Vec<GossipStats> {
    gossips.iter().map(|g| g.stats()).collect()
}

async fn run(routers: usize, rate: f64, w: Workload, publish_s: f64, drain_s: f64) -> Row {
    let wall_budget = Duration::from_secs_f64(env_f64("FLEET_LAG_WALL", 90.0));
    let mut row = Row {
        routers,
        rate,
        workload: w.name,
        ..Row::default()
    };
    // Start the routers, staggered over one gossip interval as real starts are.
    let (gossips, _, join_s) = start_routers(routers, "fleet-lag", decision_ttl()).await;
    let gossips: Vec<Arc<Gossip>> = gossips.into_iter().map(Arc::new).collect();
    row.join_s = join_s;
    // Idle: heartbeats and digests only.
    let before = sum_stats(&gossips);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = sum_stats(&gossips);
    row.idle_out = before
        .iter()
        .zip(&after)
        .map(|(b, a)| (a.bytes_sent - b.bytes_sent) as f64)
        .sum::<f64>()
        / routers as f64;

    let shared = Arc::new(Shared {
        origins: gossips
            .iter()
            .enumerate()
            .map(|(i, g)| (g.origin().to_string(), i))
            .collect(),
        book: Mutex::new(Book {
            published: vec![Vec::new(); routers],
            lag: vec![0; BUCKETS],
            short_polls: 0,
            min_peers: routers,
            lagging: 0,
            batch_bytes: 0,
            decisions: 0,
            poll_s: 0.0,
        }),
        start: Instant::now(),
        stop_publishing: AtomicBool::new(false),
        caught_up: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    });
    let gossips = Arc::new(gossips);
    let per_tick = rate / routers as f64 * TICK.as_secs_f64();
    let before = sum_stats(&gossips);
    let wall = std::time::Instant::now();
    let cpu = cpu_s();
    let mut tasks = Vec::new();
    for i in 0..routers {
        tasks.push(tokio::spawn(router(
            i,
            gossips.clone(),
            shared.clone(),
            per_tick,
            w.keys,
        )));
    }
    let publish_end = shared.start + Duration::from_secs_f64(publish_s);
    // CPU per router over each simulated second of publishing: it grows with the batches
    // every router holds (all of them, for the decision TTL).
    let mut second = (shared.start + Duration::from_secs(1), cpu, 0.0);
    while Instant::now() < publish_end {
        tokio::time::sleep(TICK).await;
        if Instant::now() >= second.0 {
            let (now_cpu, now_poll) = (cpu_s(), shared.book().poll_s);
            row.cpu_by_second.push((
                (now_cpu - second.1) / routers as f64,
                (now_poll - second.2) / routers as f64,
            ));
            second = (second.0 + Duration::from_secs(1), now_cpu, now_poll);
        }
        if wall.elapsed() > wall_budget {
            row.cut_short = true;
            break;
        }
    }
    shared.stop_publishing.store(true, Ordering::Relaxed);
    let published_at = Instant::now();
    row.published_s = shared.start.elapsed().as_secs_f64();
    row.cpu_per_router = (cpu_s() - cpu) / row.published_s / routers as f64;
    let poll_s = shared.book().poll_s;
    row.poll_per_router = poll_s / row.published_s / routers as f64;
    let after = sum_stats(&gossips);
    let per_s = |f: &dyn Fn(&GossipStats) -> u64| -> Vec<f64> {
        before
            .iter()
            .zip(&after)
            .map(|(b, a)| (f(a) - f(b)) as f64 / row.published_s)
            .collect()
    };
    let out = per_s(&|s| s.bytes_sent);
    let inn = per_s(&|s| s.bytes_received);
    row.out_mean = out.iter().sum::<f64>() / routers as f64;
    row.out_max = out.iter().cloned().fold(0.0, f64::max);
    row.in_mean = inn.iter().sum::<f64>() / routers as f64;
    row.in_max = inn.iter().cloned().fold(0.0, f64::max);
    // Catch up.
    let drain_end = published_at + Duration::from_secs_f64(drain_s);
    let drain_wall = std::time::Instant::now();
    while Instant::now() < drain_end && shared.caught_up.load(Ordering::Relaxed) < routers {
        tokio::time::sleep(TICK).await;
        if drain_wall.elapsed() > wall_budget {
            break;
        }
    }
    if shared.caught_up.load(Ordering::Relaxed) == routers {
        row.drain_s = Some(published_at.elapsed().as_secs_f64());
    }
    shared.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let end = sum_stats(&gossips);
    row.lost_datagrams = end.iter().map(|s| s.datagrams_sent as i64).sum::<i64>()
        - end.iter().map(|s| s.datagrams_received as i64).sum::<i64>();
    row.decode_errors = end.iter().map(|s| s.decode_errors).sum();
    let shed: u64 = end.iter().map(|s| s.decisions_shed).sum();
    {
        let book = shared.book();
        row.shed = shed as f64 / book.decisions.max(1) as f64;
        let delivered: u64 = book.lag.iter().sum();
        let published: u64 = book.published.iter().map(|p| p.len() as u64).sum();
        row.pairs = published * (routers as u64 - 1);
        row.undelivered = row.pairs.saturating_sub(delivered);
        let run_s = shared.start.elapsed().as_secs_f64();
        row.p50 = quantile(&book.lag, row.undelivered, 0.50, run_s);
        row.p99 = quantile(&book.lag, row.undelivered, 0.99, run_s);
        row.max = quantile(&book.lag, row.undelivered, 1.0, run_s);
        row.bytes_per_decision = book.batch_bytes as f64 / book.decisions.max(1) as f64;
        row.short_polls = book.short_polls;
        row.min_peers = book.min_peers;
        row.lagging = book.lagging;
        // Every router holds every router's batches for the decision TTL.
        row.state_mb = book.batch_bytes as f64 * (1.0 - row.shed) / row.published_s
            * decision_ttl().as_secs_f64()
            / 1e6;
        row.rss_mb = rss_mb();
    }
    if let Ok(gossips) = Arc::try_unwrap(gossips) {
        for g in gossips {
            if let Ok(g) = Arc::try_unwrap(g) {
                g.shutdown().await;
            }
        }
    }
    row
}

fn main() {
    let routers: Vec<usize> = env_list("FLEET_LAG_ROUTERS", "8,32,64,128")
        .iter()
        .map(|s| s.parse().expect("router count"))
        .collect();
    let rates: Vec<f64> = env_list("FLEET_LAG_RATES", "10000,100000")
        .iter()
        .map(|s| s.parse().expect("fleet requests/s"))
        .collect();
    let workloads: Vec<Workload> = env_list("FLEET_LAG_WORKLOADS", "chat,longdoc")
        .iter()
        .map(|n| workload(n))
        .collect();
    let publish_s = env_f64("FLEET_LAG_SECONDS", 2.0);
    let drain_s = env_f64("FLEET_LAG_DRAIN", 2.0);
    println!(
        "fleet_lag: production Gossip adapters (chitchat 0.13, MAC, loopback relay), gossip every {} ms, \
         publish + poll every {} ms, decision TTL {} s; simulated time (tokio, paused clock, one thread), \
         real UDP on 127.0.0.1; {publish_s} s publishing + at most {drain_s} s catching up per row; {}",
        DEFAULT_GOSSIP_INTERVAL.as_millis(),
        TICK.as_millis(),
        decision_ttl().as_secs_f64(),
        machine()
    );
    println!(
        "| workload | fleet req/s | routers | decisions/s per router | B per decision | join | lag p50 | lag p99 | lag max | undelivered | shed | out per router (max) | in per router (max) | idle out | dead/short polls | lost datagrams | fleet state per router (TTL) | CPU per router (poll) | RSS |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for w in &workloads {
        for &rate in &rates {
            for &r in &routers {
                let rt = paused_runtime();
                let wall = std::time::Instant::now();
                let row = rt.block_on(run(r, rate, *w, publish_s, drain_s));
                drop(rt);
                println!(
                    "| {} | {} | {} | {:.0} | {:.0} (cited {}) | {} | {} | {} | {} | {} of {}{} | {:.1}% | {} ({}) | {} ({}) | {} | {} (min peers {}) | {} | {:.0} MB | {:.3} ({:.3}){} | {:.0} MB |",
                    row.workload,
                    row.rate,
                    row.routers,
                    row.rate / row.routers as f64,
                    row.bytes_per_decision,
                    w.measured_bytes,
                    row.join_s.map_or("never".into(), |s| format!("{s:.2} s")),
                    row.p50,
                    row.p99,
                    row.max,
                    row.undelivered,
                    row.pairs,
                    row.drain_s
                        .map_or(String::new(), |s| format!(", all in {s:.2} s after")),
                    row.shed * 100.0,
                    kb(row.out_mean),
                    kb(row.out_max),
                    kb(row.in_mean),
                    kb(row.in_max),
                    kb(row.idle_out),
                    row.short_polls,
                    row.min_peers,
                    row.lost_datagrams,
                    row.state_mb,
                    row.cpu_per_router,
                    row.poll_per_router,
                    if row.cut_short {
                        format!(", cut at {:.2} sim s", row.published_s)
                    } else {
                        String::new()
                    },
                    row.rss_mb,
                );
                if row.cpu_by_second.len() > 2 {
                    let series: Vec<String> = row
                        .cpu_by_second
                        .iter()
                        .map(|(c, p)| format!("{c:.3} ({p:.3})"))
                        .collect();
                    println!(
                        "  CPU per router (poll) in each second of publishing: {}",
                        series.join(", ")
                    );
                }
                if row.lagging > 0 || row.decode_errors > 0 {
                    println!(
                        "  ({} expired-before-delivery reports, {} decode errors)",
                        row.lagging, row.decode_errors
                    );
                }
                eprintln!(
                    "  [{} routers took {:.1} s wall]",
                    r,
                    wall.elapsed().as_secs_f64()
                );
            }
        }
    }
}
