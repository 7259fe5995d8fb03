//! Gossip faults at fleet scale (issue 27, "Faults", the routers' half): what a partition of a
//! quarter of the routers and a router restart cost the shared routing decisions, with the
//! setup of `fleet_lag` (R production [`Gossip`] adapters in one process on tokio's paused
//! clock, real UDP on 127.0.0.1, each router publishing and polling every 25 ms tick as the
//! router's cluster loop does; see `fleet_lag.rs` for why simulated time).
//!
//! **partition**: the fleet publishes for `FLEET_FAULTS_WARM` (default 1) simulated seconds;
//! then the last quarter of the routers (the seeds, the first three, stay in the majority)
//! and the rest drop every datagram from each other ([`Gossip::block_peers`], the router's
//! own fault injection) for `FLEET_FAULTS_PARTITION` (default 5) seconds; then every router
//! heals ([`Gossip::heal`]) and the fleet keeps publishing until every router has applied
//! every batch published before the heal (reconvergence), every router lists R − 1 live
//! peers again, and 0.5 s more (at most `FLEET_FAULTS_RECOVER`, default 10 s). Lag is from
//! `publish_decisions` to the `poll` that returns the batch at a receiver, split by when the
//! batch was published (before, during, after the partition) and, during it, by whether the
//! receiver was across the cut.
//!
//! **restart**: the fleet publishes for `FLEET_FAULTS_WARM` seconds; the last router's
//! adapter shuts down; `FLEET_FAULTS_DOWN` (default 2) seconds later a new adapter starts with
//! the same node id and gossip address (a new generation, as a restarted process gets, with an
//! empty cursor) and the run goes on until it has applied, from every live peer, every batch
//! that peer had published when it started (catch-up), everyone lists everyone, and 0.5 s
//! more. Bytes pulled are what the new adapter's socket received until then, MACs included.
//! What it pulls is every batch still alive: `FLEET_FAULTS_WARM` seconds of the fleet's
//! decisions here, the whole decision TTL's worth (120 s) in a fleet that has run longer.
//!
//! Peer counts are each router's `Update::peers` at every poll; "marked dead" means a router
//! listed fewer live peers than it should.
//!
//! Run: `cargo bench -p warmpath-membership --bench fleet_faults`. Environment:
//! `FLEET_FAULTS_ROUTERS` (default `32,128`), `FLEET_FAULTS_SCENARIOS` (default
//! `partition,restart`), `FLEET_FAULTS_RATE` (fleet requests/s, default 10000: chat converges
//! there, see `fleet_lag`), `FLEET_FAULTS_WORKLOAD` (default `chat`), `FLEET_FAULTS_TTL`
//! (decision TTL in seconds, default the router's 120), the durations above, and
//! `FLEET_FAULTS_WALL` (wall seconds after which a run ends its current phase early and says
//! so, default 900). 128 routers need about 16,500 file descriptors and as many loopback
//! ports: two 128-router runs at once exhaust Linux's default ephemeral range (28,232 ports)
//! and the restarted adapter then fails to bind.

mod fleet_common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_common::{
    env_f64, env_list, gossip_config, kb, lag_bucket, load_average, machine, paused_runtime,
    publish_tick, quantile, start_routers, workload, Workload, BUCKETS, DECISION_TTL, TICK,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use warmpath_membership::gossip::{Cursor, Gossip, GossipStats, DEFAULT_GOSSIP_INTERVAL};

const CLUSTER: &str = "fleet-faults";
/// No peer-count sample in a tick (a router that is down).
const NO_SAMPLE: u16 = u16::MAX;
/// What the run keeps going after everything has recovered.
const SETTLE: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Partition,
    Restart,
}

// Delivery categories. Partition:
/// Published before the partition.
const BEFORE: usize = 0;
/// Published during the partition, receiver on the same side.
const SAME_SIDE: usize = 1;
/// Published during the partition, receiver across the cut.
const ACROSS: usize = 2;
/// Published after the heal.
const AFTER: usize = 3;
// Restart:
/// Anything not below.
const NORMAL: usize = 0;
/// To the restarted router: a peer's batch published before it started.
const BACKLOG: usize = 1;
/// To the restarted router: its own former incarnation's batch.
const OWN_OLD: usize = 2;
/// To the restarted router: a peer's batch published after it started.
const TO_RESTARTED: usize = 3;
/// From the restarted router to its peers.
const FROM_RESTARTED: usize = 4;
const CATEGORIES: usize = 5;

/// One router incarnation's publications.
#[derive(Debug)]
struct Origin {
    slot: usize,
    incarnation: usize,
    /// Publish time (µs since the start) of each seq (index seq − 1).
    published: Vec<u64>,
    /// Encoded batch bytes published up to and including each seq.
    cum_bytes: Vec<u64>,
}

/// What a router must have applied (origin, seq), and which router incarnations must.
#[derive(Debug)]
struct Goal {
    targets: Vec<(String, u64)>,
    required: Vec<(usize, usize)>,
}

#[derive(Debug)]
struct Book {
    origins: HashMap<String, usize>,
    list: Vec<Origin>,
    /// Deliveries per category per lag bucket.
    lag: Vec<Vec<u64>>,
    /// Partition: deliveries across the cut of batches published during it, by time after
    /// the heal.
    since_heal: Vec<u64>,
    /// Peer count per tick per slot ([`NO_SAMPLE`]: none).
    peers: Vec<Vec<u16>>,
    lagging: u64,
    unknown_origins: u64,
    goal: Option<Goal>,
    /// (slot, incarnation) → (µs when the goal was reached, bytes it had received by then).
    reached: HashMap<(usize, usize), (u64, u64)>,
}

impl Book {
    fn register(&mut self, origin: &str, slot: usize, incarnation: usize) -> usize {
        let idx = self.list.len();
        self.list.push(Origin {
            slot,
            incarnation,
            published: Vec::new(),
            cum_bytes: Vec::new(),
        });
        self.origins.insert(origin.to_string(), idx);
        idx
    }
}

#[derive(Debug)]
struct Shared {
    scenario: Scenario,
    routers: usize,
    /// Partition: whether each slot is in the minority quarter.
    minority: Vec<bool>,
    /// Restart: the restarted slot.
    restarted: usize,
    /// Fault start and end (µs since the start; u64::MAX: not yet): partition block and
    /// heal; restart: the old incarnation's stop and the new one's start.
    fault_at: AtomicU64,
    recover_at: AtomicU64,
    start: Instant,
    stop_publishing: AtomicBool,
    stop: AtomicBool,
    book: Mutex<Book>,
}

impl Shared {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// The category of a delivery of a batch of `origin` published at `at` to router
    /// (`slot`, `incarnation`).
    fn classify(&self, origin: &Origin, at: u64, slot: usize, incarnation: usize) -> usize {
        let fault = self.fault_at.load(Ordering::Relaxed);
        let recover = self.recover_at.load(Ordering::Relaxed);
        match self.scenario {
            Scenario::Partition => {
                if at < fault {
                    BEFORE
                } else if at >= recover {
                    AFTER
                } else if self.minority[origin.slot] == self.minority[slot] {
                    SAME_SIDE
                } else {
                    ACROSS
                }
            }
            Scenario::Restart => {
                if slot == self.restarted && incarnation == 1 {
                    if origin.slot == self.restarted {
                        OWN_OLD
                    } else if at < recover {
                        BACKLOG
                    } else {
                        TO_RESTARTED
                    }
                } else if origin.slot == self.restarted && origin.incarnation == 1 {
                    FROM_RESTARTED
                } else {
                    NORMAL
                }
            }
        }
    }
}

/// One router incarnation's cluster loop: publish this tick's decisions, poll, record.
#[allow(clippy::too_many_arguments)]
async fn router(
    slot: usize,
    incarnation: usize,
    me: Arc<Gossip>,
    shared: Arc<Shared>,
    per_tick: f64,
    keys: usize,
    own_stop: Arc<AtomicBool>,
) {
    let origin = me.origin().to_string();
    let mine = shared.book().register(&origin, slot, incarnation);
    let mut rng = StdRng::seed_from_u64(0x5eed ^ slot as u64 ^ ((incarnation as u64) << 32));
    let mut cursor = Cursor::new();
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut owed = 0.0;
    let mut reached = false;
    loop {
        ticker.tick().await;
        if shared.stop.load(Ordering::Relaxed) || own_stop.load(Ordering::Relaxed) {
            break;
        }
        if !shared.stop_publishing.load(Ordering::Relaxed) {
            let at = shared.now_us();
            if let Some(p) = publish_tick(&me, &mut rng, keys, &mut owed, per_tick, at).await {
                let mut book = shared.book();
                let o = &mut book.list[mine];
                let base = o.cum_bytes.last().copied().unwrap_or(0);
                for seq in p.first..=p.last {
                    o.published.push(at);
                    o.cum_bytes
                        .push(base + if seq == p.last { p.bytes } else { 0 });
                }
            }
        }
        let update = me.poll(&mut cursor).await;
        let now = shared.now_us();
        let mut book = shared.book();
        let heal = shared.recover_at.load(Ordering::Relaxed);
        for (name, seq, _) in &update.batches {
            let Some(&o) = book.origins.get(name) else {
                book.unknown_origins += 1;
                continue;
            };
            let Some(&at) = book.list[o].published.get(*seq as usize - 1) else {
                continue;
            };
            let cat = shared.classify(&book.list[o], at, slot, incarnation);
            book.lag[cat][lag_bucket(now.saturating_sub(at))] += 1;
            if shared.scenario == Scenario::Partition && cat == ACROSS {
                book.since_heal[lag_bucket(now.saturating_sub(heal))] += 1;
            }
        }
        let tick = (now / TICK.as_micros() as u64) as usize;
        let routers = shared.routers;
        while book.peers.len() <= tick {
            book.peers.push(vec![NO_SAMPLE; routers]);
        }
        book.peers[tick][slot] = update.peers.len() as u16;
        book.lagging += update.lagging.len() as u64;
        if !reached {
            let done = book.goal.as_ref().is_some_and(|g| {
                g.required.contains(&(slot, incarnation))
                    && g.targets
                        .iter()
                        .all(|(o, seq)| *o == origin || cursor.applied(o) >= *seq)
            });
            if done {
                reached = true;
                let received = me.stats().bytes_received;
                book.reached.insert((slot, incarnation), (now, received));
            }
        }
    }
}

fn stats(gossips: &[Arc<Gossip>]) -> Vec<GossipStats> {
    gossips.iter().map(|g| g.stats()).collect()
}

/// Sleeps in ticks until `until` returns true, `limit` has passed, or the wall budget is
/// spent (returns false then).
async fn wait_until(
    limit: Duration,
    wall: &std::time::Instant,
    budget: Duration,
    mut until: impl FnMut() -> bool,
) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if until() {
            return true;
        }
        if wall.elapsed() > budget {
            return false;
        }
        tokio::time::sleep(TICK).await;
    }
    true
}

/// What one run measured.
#[derive(Debug, Default)]
struct Outcome {
    routers: usize,
    join_s: Option<f64>,
    cut_short: bool,
    sim_s: f64,
    wall_s: f64,
    lag: Vec<Vec<u64>>,
    since_heal: Vec<u64>,
    /// Pairs (batch, receiver) that should have been delivered, per category.
    pairs: Vec<u64>,
    peers: Vec<Vec<u16>>,
    fault_us: u64,
    recover_us: u64,
    reached: HashMap<(usize, usize), (u64, u64)>,
    lagging: u64,
    unknown_origins: u64,
    /// Partition: bytes received per router during the partition and from the heal until
    /// reconverged, (minority, majority) means.
    received_during: (f64, f64),
    received_after: (f64, f64),
    /// Restart: backlog batches and their encoded bytes; whether the old address was reused.
    backlog_batches: u64,
    backlog_bytes: u64,
    same_address: bool,
    lost_datagrams: i64,
    decode_errors: u64,
}

impl Outcome {
    fn delivered(&self, cat: usize) -> u64 {
        self.lag[cat].iter().sum()
    }
    fn undelivered(&self, cat: usize) -> u64 {
        self.pairs[cat].saturating_sub(self.delivered(cat))
    }
    fn q(&self, cat: usize, q: f64) -> String {
        quantile(&self.lag[cat], self.undelivered(cat), q, self.sim_s)
    }
    /// First tick at or after `from_us` at which `ok(slot, peers)` holds for every slot with
    /// a sample; seconds after `from_us`.
    fn first_all(&self, from_us: u64, ok: impl Fn(usize, u16) -> bool) -> Option<f64> {
        let tick_us = TICK.as_micros() as u64;
        let first = from_us.div_ceil(tick_us) as usize;
        (first..self.peers.len())
            .find(|&t| {
                let row = &self.peers[t];
                row.iter().any(|&p| p != NO_SAMPLE)
                    && row
                        .iter()
                        .enumerate()
                        .all(|(s, &p)| p == NO_SAMPLE || ok(s, p))
            })
            .map(|t| (t as u64 * tick_us).saturating_sub(from_us) as f64 / 1e6)
    }
    /// Fewest peers listed by the slots `which` in ticks [from_us, to_us).
    fn min_peers(&self, from_us: u64, to_us: u64, which: impl Fn(usize) -> bool) -> u16 {
        let tick_us = TICK.as_micros() as u64;
        let (a, b) = ((from_us / tick_us) as usize, (to_us / tick_us) as usize);
        self.peers
            .iter()
            .enumerate()
            .filter(|(t, _)| *t >= a && *t < b)
            .flat_map(|(_, row)| row.iter().enumerate())
            .filter(|(s, p)| which(*s) && **p != NO_SAMPLE)
            .map(|(_, p)| *p)
            .min()
            .unwrap_or(NO_SAMPLE)
    }
    /// Peer counts at every tick where they change: `t: min–max (routers short of R − 1)`.
    fn timeline(&self) -> String {
        let full = (self.routers - 1) as u16;
        let mut last = None;
        let mut out = Vec::new();
        for (t, row) in self.peers.iter().enumerate() {
            let seen: Vec<u16> = row.iter().copied().filter(|&p| p != NO_SAMPLE).collect();
            let (Some(&min), Some(&max)) = (seen.iter().min(), seen.iter().max()) else {
                continue;
            };
            let short = seen.iter().filter(|&&p| p < full).count();
            if last == Some((min, max, short)) {
                continue;
            }
            last = Some((min, max, short));
            out.push(format!(
                "{:.3}: {min}{} ({short})",
                t as f64 * TICK.as_secs_f64(),
                if max != min {
                    format!("–{max}")
                } else {
                    String::new()
                }
            ));
        }
        out.join(", ")
    }
}

fn new_shared(scenario: Scenario, routers: usize) -> Shared {
    let minority_size = routers / 4;
    Shared {
        scenario,
        routers,
        minority: (0..routers).map(|i| i >= routers - minority_size).collect(),
        restarted: routers - 1,
        fault_at: AtomicU64::new(u64::MAX),
        recover_at: AtomicU64::new(u64::MAX),
        start: Instant::now(),
        stop_publishing: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        book: Mutex::new(Book {
            origins: HashMap::new(),
            list: Vec::new(),
            lag: vec![vec![0; BUCKETS]; CATEGORIES],
            since_heal: vec![0; BUCKETS],
            peers: Vec::new(),
            lagging: 0,
            unknown_origins: 0,
            goal: None,
            reached: HashMap::new(),
        }),
    }
}

/// Parameters common to both scenarios.
#[derive(Clone, Copy, Debug)]
struct Params {
    rate: f64,
    workload: Workload,
    ttl: Duration,
    warm: Duration,
    partition: Duration,
    down: Duration,
    recover: Duration,
    wall: Duration,
}

async fn run(scenario: Scenario, routers: usize, p: Params) -> Outcome {
    let wall = std::time::Instant::now();
    let mut out = Outcome {
        routers,
        ..Outcome::default()
    };
    let (gossips, seeds, join_s) = start_routers(routers, CLUSTER, p.ttl).await;
    out.join_s = join_s;
    let mut gossips: Vec<Arc<Gossip>> = gossips.into_iter().map(Arc::new).collect();
    let shared = Arc::new(new_shared(scenario, routers));
    let per_tick = p.rate / routers as f64 * TICK.as_secs_f64();
    let spawn = |slot: usize, inc: usize, g: Arc<Gossip>, stop: Arc<AtomicBool>| {
        tokio::spawn(router(
            slot,
            inc,
            g,
            shared.clone(),
            per_tick,
            p.workload.keys,
            stop,
        ))
    };
    let stops: Vec<Arc<AtomicBool>> = (0..routers)
        .map(|_| Arc::new(AtomicBool::new(false)))
        .collect();
    let mut tasks: Vec<JoinHandle<()>> = (0..routers)
        .map(|i| spawn(i, 0, gossips[i].clone(), stops[i].clone()))
        .collect();
    if !wait_until(p.warm, &wall, p.wall, || false).await {
        out.cut_short = true;
    }
    let fleet_done = |shared: &Shared, required: usize| {
        let book = shared.book();
        book.reached.len() >= required
    };
    match scenario {
        Scenario::Partition => {
            let addrs: Vec<SocketAddr> = gossips.iter().map(|g| g.gossip_addr()).collect();
            let side = |m: bool| -> Vec<SocketAddr> {
                (0..routers)
                    .filter(|&i| shared.minority[i] == m)
                    .map(|i| addrs[i])
                    .collect()
            };
            let (minority, majority) = (side(true), side(false));
            for (i, g) in gossips.iter().enumerate() {
                g.block_peers(if shared.minority[i] {
                    &majority
                } else {
                    &minority
                });
            }
            shared.fault_at.store(shared.now_us(), Ordering::Relaxed);
            let at_block = stats(&gossips);
            if !wait_until(p.partition, &wall, p.wall, || false).await {
                out.cut_short = true;
            }
            for g in &gossips {
                g.heal();
            }
            let heal_us = shared.now_us();
            let at_heal = stats(&gossips);
            {
                let mut book = shared.book();
                book.goal = Some(Goal {
                    targets: gossips
                        .iter()
                        .map(|g| (g.origin().to_string(), g.published_seq()))
                        .collect(),
                    required: (0..routers).map(|i| (i, 0)).collect(),
                });
            }
            shared.recover_at.store(heal_us, Ordering::Relaxed);
            let mut reconverged: Option<Vec<GossipStats>> = None;
            let ok = wait_until(p.recover, &wall, p.wall, || {
                if reconverged.is_none() && fleet_done(&shared, routers) {
                    reconverged = Some(stats(&gossips));
                }
                let book = shared.book();
                let all_back = book.peers.last().is_some_and(|row| {
                    row.iter()
                        .all(|&n| n == NO_SAMPLE || n as usize + 1 == routers)
                });
                reconverged.is_some() && all_back
            })
            .await;
            out.cut_short |= !ok;
            let mean = |from: &[GossipStats], to: &[GossipStats], m: bool| -> f64 {
                let v: Vec<f64> = (0..routers)
                    .filter(|&i| shared.minority[i] == m)
                    .map(|i| (to[i].bytes_received - from[i].bytes_received) as f64)
                    .collect();
                v.iter().sum::<f64>() / v.len().max(1) as f64
            };
            out.received_during = (
                mean(&at_block, &at_heal, true),
                mean(&at_block, &at_heal, false),
            );
            if let Some(r) = &reconverged {
                out.received_after = (mean(&at_heal, r, true), mean(&at_heal, r, false));
            }
        }
        Scenario::Restart => {
            let k = shared.restarted;
            stops[k].store(true, Ordering::Relaxed);
            let _ = (&mut tasks[k]).await;
            let addr = gossips[k].gossip_addr();
            // A placeholder until the new incarnation starts.
            let placeholder = gossips[0].clone();
            if let Some(old) = Arc::into_inner(std::mem::replace(&mut gossips[k], placeholder)) {
                old.shutdown().await;
            }
            shared.fault_at.store(shared.now_us(), Ordering::Relaxed);
            if !wait_until(p.down, &wall, p.wall, || false).await {
                out.cut_short = true;
            }
            // The same node id and, as a restarted process would, the same address.
            let mut started = None;
            for _ in 0..20 {
                if let Ok(g) = Gossip::start(gossip_config(k, addr, &seeds, CLUSTER, p.ttl)).await {
                    started = Some(g);
                    out.same_address = true;
                    break;
                }
                tokio::time::sleep(TICK).await;
            }
            let new = match started {
                Some(g) => g,
                None => Gossip::start(gossip_config(
                    k,
                    fleet_common::loopback_any(),
                    &seeds,
                    CLUSTER,
                    p.ttl,
                ))
                .await
                .expect("gossip restarts"),
            };
            let new = Arc::new(new);
            gossips[k] = new.clone();
            {
                let mut book = shared.book();
                let mut targets = Vec::new();
                for (i, g) in gossips.iter().enumerate() {
                    if i == k {
                        continue;
                    }
                    let seq = g.published_seq();
                    targets.push((g.origin().to_string(), seq));
                    let o = &book.list[book.origins[g.origin()]];
                    out.backlog_batches += seq;
                    out.backlog_bytes += (seq as usize)
                        .checked_sub(1)
                        .and_then(|i| o.cum_bytes.get(i))
                        .copied()
                        .unwrap_or(0);
                }
                book.goal = Some(Goal {
                    targets,
                    required: vec![(k, 1)],
                });
            }
            shared.recover_at.store(shared.now_us(), Ordering::Relaxed);
            let stop = Arc::new(AtomicBool::new(false));
            tasks[k] = spawn(k, 1, new, stop);
            let ok = wait_until(p.recover, &wall, p.wall, || {
                let book = shared.book();
                let all_back = book.peers.last().is_some_and(|row| {
                    row.iter()
                        .all(|&n| n == NO_SAMPLE || n as usize + 1 == routers)
                }) && book.peers.last().is_some_and(|row| row[k] != NO_SAMPLE);
                drop(book);
                fleet_done(&shared, 1) && all_back
            })
            .await;
            out.cut_short |= !ok;
        }
    }
    // Let the last batches arrive, then stop.
    wait_until(SETTLE, &wall, p.wall + SETTLE.mul_f64(4.0), || false).await;
    shared.stop_publishing.store(true, Ordering::Relaxed);
    wait_until(SETTLE, &wall, p.wall + SETTLE.mul_f64(8.0), || false).await;
    shared.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    out.sim_s = shared.start.elapsed().as_secs_f64();
    let end = stats(&gossips);
    out.lost_datagrams = end.iter().map(|s| s.datagrams_sent as i64).sum::<i64>()
        - end.iter().map(|s| s.datagrams_received as i64).sum::<i64>();
    out.decode_errors = end.iter().map(|s| s.decode_errors).sum();
    out.fault_us = shared.fault_at.load(Ordering::Relaxed);
    out.recover_us = shared.recover_at.load(Ordering::Relaxed);
    {
        let mut book = shared.book();
        out.pairs = vec![0; CATEGORIES];
        for o in &book.list {
            for &at in &o.published {
                match scenario {
                    Scenario::Partition => {
                        for r in (0..routers).filter(|&r| r != o.slot) {
                            out.pairs[shared.classify(o, at, r, 0)] += 1;
                        }
                    }
                    Scenario::Restart => {
                        if o.slot == shared.restarted && o.incarnation == 1 {
                            out.pairs[FROM_RESTARTED] += routers as u64 - 1;
                        } else if o.slot != shared.restarted && at >= out.recover_us {
                            out.pairs[TO_RESTARTED] += 1;
                        }
                    }
                }
            }
        }
        out.pairs[BACKLOG] = out.backlog_batches;
        out.lag = std::mem::take(&mut book.lag);
        out.since_heal = std::mem::take(&mut book.since_heal);
        out.peers = std::mem::take(&mut book.peers);
        out.reached = std::mem::take(&mut book.reached);
        out.lagging = book.lagging;
        out.unknown_origins = book.unknown_origins;
    }
    drop(shared);
    for g in gossips {
        if let Some(g) = Arc::into_inner(g) {
            g.shutdown().await;
        }
    }
    out.wall_s = wall.elapsed().as_secs_f64();
    out
}

fn secs(s: Option<f64>) -> String {
    s.map_or("never".into(), |s| format!("{s:.2} s"))
}

fn mb(bytes: f64) -> String {
    format!("{:.1} MB", bytes / 1e6)
}

fn partition_row(o: &Outcome, p: &Params) -> (String, String) {
    let r = o.routers;
    let m = r / 4;
    let minority = |s: usize| s >= r - m;
    let own_side = |s: usize| if minority(s) { m - 1 } else { r - m - 1 } as u16;
    let reconverged = (0..r)
        .map(|i| o.reached.get(&(i, 0)).map(|(at, _)| *at))
        .collect::<Option<Vec<u64>>>()
        .map(|v| {
            v.into_iter()
                .max()
                .unwrap_or(0)
                .saturating_sub(o.recover_us) as f64
                / 1e6
        });
    let tick_us = TICK.as_micros() as u64;
    let any_short = (o.fault_us.div_ceil(tick_us) as usize..o.peers.len())
        .find(|&t| {
            o.peers[t]
                .iter()
                .any(|&p| p != NO_SAMPLE && (p as usize) + 1 < r)
        })
        .map(|t| (t as u64 * tick_us).saturating_sub(o.fault_us) as f64 / 1e6);
    let all_split = o.first_all(o.fault_us, |s, p| p == own_side(s));
    let back = o.first_all(o.recover_us, |_, p| (p as usize) + 1 == r);
    // From the first router short of R − 1 until every router lists R − 1 again.
    let dead_for = match (any_short, back) {
        (Some(a), Some(b)) => Some((o.recover_us - o.fault_us) as f64 / 1e6 - a + b),
        _ => None,
    };
    let min_minority = o.min_peers(o.fault_us, o.recover_us, minority);
    let min_majority = o.min_peers(o.fault_us, o.recover_us, |s| !minority(s));
    let flaps_before = o.min_peers(0, o.fault_us, |_| true);
    let after_back = back.map_or(NO_SAMPLE, |b| {
        o.min_peers(
            o.recover_us + (b * 1e6) as u64,
            (o.sim_s * 1e6) as u64,
            |_| true,
        )
    });
    let row = format!(
        "| {r} | {m} | {:.0} | {} / {} / {} | {} / {} / {} | {} / {} | {} / {} | {}{} | {} · {} | {} · {} | {} | {} | {} | {} | {} |",
        p.rate,
        o.q(ACROSS, 0.5),
        o.q(ACROSS, 0.99),
        o.q(ACROSS, 1.0),
        quantile(&o.since_heal, o.undelivered(ACROSS), 0.5, o.sim_s),
        quantile(&o.since_heal, o.undelivered(ACROSS), 0.99, o.sim_s),
        quantile(&o.since_heal, o.undelivered(ACROSS), 1.0, o.sim_s),
        o.q(SAME_SIDE, 0.5),
        o.q(SAME_SIDE, 0.99),
        o.q(AFTER, 0.5),
        o.q(AFTER, 0.99),
        secs(reconverged),
        if o.cut_short { " (cut short)" } else { "" },
        mb(o.received_after.0),
        mb(o.received_after.1),
        kb(o.received_during.0 / p.partition.as_secs_f64()),
        kb(o.received_during.1 / p.partition.as_secs_f64()),
        secs(any_short),
        secs(all_split),
        secs(back),
        secs(dead_for),
        if min_minority + 1 >= m as u16 && min_majority as usize + m + 1 >= r {
            "none".to_string()
        } else {
            format!("min {min_minority} of {} · {min_majority} of {}", m - 1, r - m - 1)
        },
    );
    let mut notes = format!(
        "  {r} routers: before the partition lag p50 {} p99 {}, min peers {flaps_before}; after \
         back, min peers {}; undelivered across the cut {} of {}; expired before delivery \
         {}; lost datagrams {}; decode errors {}; unknown origins {}; join {}; {:.1} sim s in \
         {:.0} wall s\n  peers where they change (s: min–max (routers short of R − 1)): {}",
        o.q(BEFORE, 0.5),
        o.q(BEFORE, 0.99),
        if after_back == NO_SAMPLE {
            "-".to_string()
        } else {
            after_back.to_string()
        },
        o.undelivered(ACROSS),
        o.pairs[ACROSS],
        o.lagging,
        o.lost_datagrams,
        o.decode_errors,
        o.unknown_origins,
        secs(o.join_s),
        o.sim_s,
        o.wall_s,
        o.timeline(),
    );
    if o.cut_short {
        notes.push_str("\n  (a phase was cut short by the wall-time budget)");
    }
    (row, notes)
}

fn restart_row(o: &Outcome, p: &Params) -> (String, String) {
    let r = o.routers;
    let k = r - 1;
    let others_see_dead = o.first_all(o.fault_us, |s, p| s == k || (p as usize) + 2 == r);
    let others_back = o.first_all(o.recover_us, |s, p| s == k || (p as usize) + 1 == r);
    let tick_us = TICK.as_micros() as u64;
    let it_lists_all = (o.recover_us.div_ceil(tick_us) as usize..o.peers.len())
        .find(|&t| o.peers[t][k] != NO_SAMPLE && (o.peers[t][k] as usize) + 1 == r)
        .map(|t| (t as u64 * tick_us).saturating_sub(o.recover_us) as f64 / 1e6);
    let caught = o.reached.get(&(k, 1));
    let row = format!(
        "| {r} | {:.0} | {:.1} s | {} | {} · {} | {}{} | {} | {} | {} | {} | {} / {} | {} / {} |",
        p.rate,
        p.down.as_secs_f64(),
        secs(others_see_dead),
        o.backlog_batches,
        mb(o.backlog_bytes as f64),
        secs(caught.map(|(at, _)| at.saturating_sub(o.recover_us) as f64 / 1e6)),
        if o.cut_short { " (cut short)" } else { "" },
        caught.map_or("-".into(), |(_, b)| mb(*b as f64)),
        o.delivered(OWN_OLD),
        secs(it_lists_all),
        secs(others_back),
        o.q(FROM_RESTARTED, 0.5),
        o.q(FROM_RESTARTED, 0.99),
        o.q(TO_RESTARTED, 0.5),
        o.q(TO_RESTARTED, 0.99),
    );
    let mut notes = format!(
        "  {r} routers: lag elsewhere p50 {} p99 {}; backlog batches applied {} of {}; same \
         gossip address {}; expired before delivery {}; lost datagrams {}; decode errors {}; \
         unknown origins {}; join {}; {:.1} sim s in {:.0} wall s\n  peers where they \
         change (s: min–max (routers short of R − 1)): {}",
        o.q(NORMAL, 0.5),
        o.q(NORMAL, 0.99),
        o.delivered(BACKLOG),
        o.backlog_batches,
        o.same_address,
        o.lagging,
        o.lost_datagrams,
        o.decode_errors,
        o.unknown_origins,
        secs(o.join_s),
        o.sim_s,
        o.wall_s,
        o.timeline(),
    );
    if o.cut_short {
        notes.push_str("\n  (a phase was cut short by the wall-time budget)");
    }
    (row, notes)
}

fn main() {
    let routers: Vec<usize> = env_list("FLEET_FAULTS_ROUTERS", "32,128")
        .iter()
        .map(|s| s.parse().expect("router count"))
        .collect();
    assert!(
        routers.iter().all(|&r| r >= 8),
        "at least 8 routers (a quarter of them, at least 2, is partitioned)"
    );
    let scenarios: Vec<Scenario> = env_list("FLEET_FAULTS_SCENARIOS", "partition,restart")
        .iter()
        .map(|s| match s.as_str() {
            "partition" => Scenario::Partition,
            "restart" => Scenario::Restart,
            other => panic!("unknown scenario {other}: partition or restart"),
        })
        .collect();
    let p = Params {
        rate: env_f64("FLEET_FAULTS_RATE", 10_000.0),
        workload: workload(&std::env::var("FLEET_FAULTS_WORKLOAD").unwrap_or("chat".into())),
        ttl: Duration::from_secs_f64(env_f64("FLEET_FAULTS_TTL", DECISION_TTL.as_secs_f64())),
        warm: Duration::from_secs_f64(env_f64("FLEET_FAULTS_WARM", 1.0)),
        partition: Duration::from_secs_f64(env_f64("FLEET_FAULTS_PARTITION", 5.0)),
        down: Duration::from_secs_f64(env_f64("FLEET_FAULTS_DOWN", 2.0)),
        recover: Duration::from_secs_f64(env_f64("FLEET_FAULTS_RECOVER", 10.0)),
        wall: Duration::from_secs_f64(env_f64("FLEET_FAULTS_WALL", 900.0)),
    };
    println!(
        "fleet_faults: production Gossip adapters (chitchat 0.13, MAC, loopback relay), gossip every {} ms, \
         publish + poll every {} ms, decision TTL {} s; {} at {:.0} fleet requests/s; simulated time \
         (tokio, paused clock, one thread), real UDP on 127.0.0.1; {:.1} s publishing before each fault; {}",
        DEFAULT_GOSSIP_INTERVAL.as_millis(),
        TICK.as_millis(),
        p.ttl.as_secs_f64(),
        p.workload.name,
        p.rate,
        p.warm.as_secs_f64(),
        machine()
    );
    for &scenario in &scenarios {
        let mut notes = Vec::new();
        match scenario {
            Scenario::Partition => {
                println!(
                    "\npartition: the last quarter of the routers cut off for {:.1} s, then healed",
                    p.partition.as_secs_f64()
                );
                println!(
                    "| routers | cut off | fleet req/s | lag across the cut, published during it: p50 / p99 / max | delivered after the heal: p50 / p99 / max | same side p50 / p99 | published after the heal p50 / p99 | every router has every batch, after the heal | pulled after the heal per router, minority · majority | in during the cut per router, minority · majority | first router short of R − 1 after the cut | all list only their side after | all list R − 1 again after the heal | peers across the cut listed dead for | marked dead within its own side |"
                );
                println!("|---:|---:|---:|---|---|---|---|---:|---|---|---:|---:|---:|---:|---|");
            }
            Scenario::Restart => {
                println!(
                    "\nrestart: the last router's adapter stopped, a new one started {:.1} s later with the same node id and address",
                    p.down.as_secs_f64()
                );
                println!(
                    "| routers | fleet req/s | down | all peers list R − 2 after the stop | backlog at restart: batches · encoded | caught up after the start | bytes pulled until then | own former batches applied | it lists R − 1 after | all list R − 1 after | its batches to peers p50 / p99 | peers' new batches to it p50 / p99 |"
                );
                println!("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|");
            }
        }
        for &r in &routers {
            let rt = paused_runtime();
            let o = rt.block_on(run(scenario, r, p));
            drop(rt);
            let (row, note) = match scenario {
                Scenario::Partition => partition_row(&o, &p),
                Scenario::Restart => restart_row(&o, &p),
            };
            println!("{row}");
            notes.push(note);
            eprintln!(
                "  [{scenario:?}, {r} routers: {:.0} s wall, load average {}]",
                o.wall_s,
                load_average()
            );
        }
        for n in notes {
            println!("{n}");
        }
    }
}
