//! The scenarios: a cluster shape, a nemesis schedule, the workloads and what is
//! promised under them. `run` sets up the network and processes, lets the clients and the
//! nemesis loose for the time limit, heals everything, takes final reads and checks the
//! history.

use crate::check::{self, Check, Expect, RateLimit, NEMESIS_ERROR};
use crate::client::{self, Clients, Targets, LIMITED_KEY, ROUTE_KEY};
use crate::cluster::Cluster;
use crate::history::{History, Recorder, F};
use crate::net::{Mode, Net};
use anyhow::{anyhow, bail, Context, Result};
use hyper::Method;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use warmpath_index::rng::Rng;

/// What the nemesis does, over and over until the time limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nemesis {
    /// Nothing: the baseline.
    None,
    /// SIGKILL the leader, restart it 6 s later.
    KillLeader,
    /// SIGSTOP the leader for 8 s.
    PauseLeader,
    /// Cut the leader off from the other routers for 10 s (minority side: the leader).
    PartitionLeader,
    /// Cut one follower off for 15 s, once, while its clients keep writing through it,
    /// then watch for 25 s: a write it forwarded before the cut sits in TCP
    /// retransmission and reaches the leader 7 to 13 s after the heal (defect 2).
    PartitionFollower,
    /// Drop what the followers send the leader (it still reaches them) for 10 s.
    OneWay,
    /// Drop 20% of the packets between routers for 15 s.
    Loss,
    /// SIGKILL every router, restart them 2 s later.
    KillAll,
    /// SIGTERM a follower, alter a tenant id in its store (same length), start it again;
    /// if it refuses, repair it as its error says (store moved aside).
    Bitrot,
    /// Run one follower's clocks 20× fast for 20 s (libfaketime).
    FastClock,
    /// SIGSTOP an engine for 10 s.
    EngineHang,
    /// SIGKILL an engine, restart it 5 s later.
    EngineKill,
    /// SIGKILL a cache-agent, restart it 8 s later (its engine and the routers that
    /// follow it carry on).
    AgentKill,
    /// SIGKILL the agents' Redis (L2), restart it 8 s later, empty.
    RedisKill,
    /// Cut the last router off from the other routers (gossip and Raft) for 10 s.
    PartitionRouter,
    /// Fill the last router's Raft disk (a 16 MiB tmpfs) for 10 s, then free it (issue
    /// 22: the router leaves service and comes back by itself).
    DiskFull,
    /// SIGTERM each router in turn, start it again, wait until it is ready, next (issue
    /// 22: a leader hands off before it stops).
    RollingRestart,
}

/// The size of the disk-full router's Raft tmpfs.
const SMALL_RAFT_DISK: u64 = 16 << 20;

#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: &'static str,
    pub about: &'static str,
    /// The issue 12 defect this scenario shows, if any.
    pub defect: Option<u8>,
    pub nemesis: Nemesis,
    pub needs_namespaces: bool,
    /// In the short suite `.ci/run` runs.
    pub short: bool,
    /// A tenant limited to 20 requests/s flooded through every router.
    pub flood_limited: bool,
    /// Cache-agents beside the engines, Redis as their L2, routers following them.
    pub cache_tier: bool,
    /// The shortest time limit that shows what the scenario is for (a longer one given
    /// wins).
    pub min_time_limit: Duration,
    pub expect: Expect,
}

const WRITE_BOUND_MS: f64 = 10_000.0;
/// Issue 12's target: writes succeed through the majority within 3 s of any single fault.
const HEALTHY_WRITES_MS: f64 = 3_000.0;
const LIMIT_RPS: f64 = 20.0;
/// What a rate limit may admit under a partition: its rate
/// (docs/decisions/0040-rate-limits.md: at most `rate` cluster-wide during the first 60 s
/// of a partition), plus 5% for the edges of a window measured at the clients.
const RATE_FACTOR: f64 = 1.05;

fn expect(healthy: bool, partition: bool, leaderless_ms: Option<f64>) -> Expect {
    Expect {
        initial: 1,
        write_bound_ms: WRITE_BOUND_MS,
        healthy_write_within_ms: healthy.then_some(HEALTHY_WRITES_MS),
        cut_off_leader_says_so_ms: partition.then_some(3_000.0),
        leaderless_at_most_ms: leaderless_ms,
        route_within_ms: Some(10_000.0),
        rate_limit: None,
    }
}

/// Every scenario, in the order the suite runs them.
pub fn all() -> Vec<Scenario> {
    let s = |name, about, defect, nemesis, needs_namespaces, short, expect| Scenario {
        name,
        about,
        defect,
        nemesis,
        needs_namespaces,
        short,
        flood_limited: false,
        cache_tier: false,
        min_time_limit: Duration::ZERO,
        expect,
    };
    let mut v = vec![
        s(
            "baseline",
            "no faults",
            None,
            Nemesis::None,
            false,
            true,
            expect(true, false, Some(5_000.0)),
        ),
        s(
            "kill-leader",
            "SIGKILL the Raft leader, restart it 6 s later",
            None,
            Nemesis::KillLeader,
            false,
            true,
            expect(true, false, Some(5_000.0)),
        ),
        s(
            "pause-leader",
            "SIGSTOP the Raft leader for 8 s",
            Some(3),
            Nemesis::PauseLeader,
            false,
            true,
            expect(true, false, Some(5_000.0)),
        ),
        s(
            "partition-leader",
            "cut the leader off from the other routers for 10 s",
            Some(7),
            Nemesis::PartitionLeader,
            true,
            true,
            expect(true, true, Some(5_000.0)),
        ),
        s(
            "partition-follower",
            "cut a follower off for 15 s while its clients write through it, then 25 s more",
            Some(2),
            Nemesis::PartitionFollower,
            true,
            true,
            expect(true, true, Some(5_000.0)),
        ),
        s(
            "one-way",
            "drop what the followers send the leader for 10 s",
            None,
            Nemesis::OneWay,
            true,
            false,
            expect(false, true, None),
        ),
        s(
            "loss",
            "drop 20% of the packets between routers for 15 s",
            None,
            Nemesis::Loss,
            true,
            false,
            expect(false, false, None),
        ),
        s(
            "kill-all",
            "SIGKILL every router, restart them 2 s later",
            None,
            Nemesis::KillAll,
            false,
            true,
            expect(false, false, None),
        ),
        s(
            "bitrot",
            "alter a follower's store after a clean shutdown, start it again",
            Some(1),
            Nemesis::Bitrot,
            false,
            true,
            expect(true, false, Some(5_000.0)),
        ),
        s(
            "fast-clock",
            "one follower's clocks 20x fast for 20 s",
            Some(6),
            Nemesis::FastClock,
            false,
            true,
            expect(false, false, Some(5_000.0)),
        ),
        s(
            "engine-hang",
            "SIGSTOP an engine for 10 s under streaming and plain requests",
            Some(5),
            Nemesis::EngineHang,
            false,
            true,
            expect(true, false, Some(5_000.0)),
        ),
        s(
            "engine-kill",
            "SIGKILL an engine, restart it 5 s later",
            None,
            Nemesis::EngineKill,
            false,
            false,
            expect(true, false, Some(5_000.0)),
        ),
    ];
    // The late delivery comes 7 to 13 s after the heal: 5 s quiet, 15 s cut, 25 s more.
    for pf in v
        .iter_mut()
        .filter(|s| s.nemesis == Nemesis::PartitionFollower)
    {
        pf.min_time_limit = Duration::from_secs(45);
    }
    for (name, about, nemesis) in [
        (
            "agent-kill",
            "SIGKILL a cache-agent, restart it 8 s later",
            Nemesis::AgentKill,
        ),
        (
            "redis-kill",
            "SIGKILL the agents' Redis, restart it empty 8 s later",
            Nemesis::RedisKill,
        ),
    ] {
        let mut c = s(
            name,
            about,
            None,
            nemesis,
            true,
            false,
            expect(true, false, Some(5_000.0)),
        );
        c.cache_tier = true;
        v.push(c);
    }
    v.push(s(
        "disk-full",
        "fill a router's Raft disk for 10 s, then free it",
        None,
        Nemesis::DiskFull,
        false,
        true,
        expect(true, false, Some(5_000.0)),
    ));
    v.push(s(
        "rolling-restart",
        "SIGTERM each router in turn and start it again once the last is ready",
        None,
        Nemesis::RollingRestart,
        false,
        true,
        expect(true, false, Some(5_000.0)),
    ));
    let mut rl = s(
        "rate-limit-partition",
        "cut one router off (gossip and Raft) for 10 s while a 20 rps tenant is flooded through all",
        Some(4),
        Nemesis::PartitionRouter,
        true,
        true,
        expect(false, true, None),
    );
    rl.flood_limited = true;
    rl.expect.rate_limit = Some(RateLimit {
        rps: LIMIT_RPS,
        factor: RATE_FACTOR,
    });
    v.push(rl);
    v
}

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub time_limit: Duration,
    pub seed: u64,
    pub bin: PathBuf,
    pub out: PathBuf,
    pub net: Mode,
}

/// What one run found.
#[derive(Debug)]
pub struct Outcome {
    pub scenario: Scenario,
    /// `Some(why)`: not run.
    pub skipped: Option<String>,
    pub checks: Vec<Check>,
    pub history: History,
    pub network: &'static str,
    pub took: Duration,
}

impl Outcome {
    /// Every exercised check passed.
    pub fn pass(&self) -> bool {
        self.skipped.is_none() && self.checks.iter().all(|c| c.pass != Some(false))
    }
}

const ENGINES: usize = 2;
const ROUTERS: usize = 3;

/// Runs `s`.
pub fn run(s: &Scenario, o: &Options) -> Result<Outcome> {
    let started = Instant::now();
    let dir = o.out.join(s.name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // One host more than the processes need: Redis, when the run has the cache tier.
    let net = Net::setup(ENGINES + ROUTERS + 1, o.net)?;
    let network = if net.isolated_ports() {
        "namespaces"
    } else {
        "loopback"
    };
    if s.needs_namespaces && !net.isolated_ports() {
        return Ok(Outcome {
            scenario: s.clone(),
            skipped: Some("needs network namespaces (root, iproute2, nftables)".into()),
            checks: Vec::new(),
            history: History::default(),
            network,
            took: started.elapsed(),
        });
    }
    let small_disk = (s.nemesis == Nemesis::DiskFull).then_some(SMALL_RAFT_DISK);
    let mut cluster = Cluster::start(
        net,
        &o.bin,
        &dir,
        ENGINES,
        ROUTERS,
        s.cache_tier,
        small_disk,
    )
    .context("starting the cluster")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let targets = Targets {
        admin: cluster.routers.iter().map(|r| r.admin.clone()).collect(),
        data: cluster.routers.iter().map(|r| r.url.clone()).collect(),
        metrics: cluster
            .routers
            .iter()
            .filter_map(|r| r.metrics.clone())
            .collect(),
    };
    rt.block_on(client::setup(&targets, s.expect.initial, LIMIT_RPS))?;
    let rec = Recorder::new();
    let clients = Clients::new(rec.clone(), targets.clone(), s.expect.initial);
    let mut tasks = Vec::new();
    for p in 0..6 {
        tasks.push(rt.spawn(clients.clone().register(p, o.seed)));
    }
    for p in 0..2 {
        tasks.push(rt.spawn(clients.clone().route(10 + p, F::Route, ROUTE_KEY, 50)));
    }
    if s.flood_limited {
        for p in 0..ROUTERS {
            tasks.push(rt.spawn(clients.clone().route(20 + p, F::Limited, LIMITED_KEY, 5)));
        }
    }
    tasks.push(rt.spawn(clients.clone().status()));

    let mut rng = Rng::new(o.seed);
    let deadline = Instant::now() + o.time_limit.max(s.min_time_limit);
    let nemesis = nemesis(
        s.nemesis,
        &mut cluster,
        &rt,
        &rec,
        &targets,
        &mut rng,
        deadline,
    );
    if let Err(e) = &nemesis {
        rec.fault(format!("{NEMESIS_ERROR}{e:#}"), &[], false);
    }
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Heal everything, stop the clients, let the cluster settle, read.
    recover(&mut cluster, &rec);
    clients
        .stop
        .store(true, std::sync::atomic::Ordering::Relaxed);
    rt.block_on(async {
        for t in tasks {
            if tokio::time::timeout(Duration::from_secs(15), t)
                .await
                .is_err()
            {
                eprintln!("warning: a client did not stop within 15 s");
            }
        }
    });
    rt.block_on(client::final_reads(&rec, &targets, Duration::from_secs(30)));
    let history = rec.history();
    std::fs::write(dir.join("history.jsonl"), history.to_jsonl())?;
    let checks = check::all(&history, &s.expect);
    rt.shutdown_timeout(Duration::from_secs(1));
    drop(cluster);
    Ok(Outcome {
        scenario: s.clone(),
        skipped: None,
        checks,
        history,
        network,
        took: started.elapsed(),
    })
}

/// The index of the router that reports itself leader with its quorum.
fn leader(rt: &tokio::runtime::Runtime, t: &Targets) -> Result<usize> {
    rt.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            for (i, base) in t.admin.iter().enumerate() {
                if let Ok((200, b)) = client::admin(base, Method::GET, "/cluster", None).await {
                    if b["raft"]["role"] == "Leader" && b["raft"]["quorum_lost"] != true {
                        return Ok(i);
                    }
                }
            }
            if tokio::time::Instant::now() > deadline {
                bail!("no router reported itself leader within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// Waits until the router at `url` answers `/readyz` 200 (at most 20 s).
fn wait_ready(rt: &tokio::runtime::Runtime, url: &str) -> Result<()> {
    rt.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !client::ready(url).await {
            if tokio::time::Instant::now() > deadline {
                bail!("{url} was not ready within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    })
}

/// Sleeps `d`, but not past `deadline`; false when the deadline is too close to start a
/// fault.
fn quiet(d: Duration, deadline: Instant) -> bool {
    let until = (Instant::now() + d).min(deadline);
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
    Instant::now() + Duration::from_secs(2) < deadline
}

/// Holds a fault for `d` (or until 1 s before the deadline).
fn hold(d: Duration, deadline: Instant) {
    let until = (Instant::now() + d).min(
        deadline
            .checked_sub(Duration::from_secs(1))
            .unwrap_or(deadline),
    );
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
}

fn nemesis(
    n: Nemesis,
    c: &mut Cluster,
    rt: &tokio::runtime::Runtime,
    rec: &Recorder,
    t: &Targets,
    rng: &mut Rng,
    deadline: Instant,
) -> Result<()> {
    let routers: Vec<usize> = (0..c.routers.len()).collect();
    let host = |c: &Cluster, i: usize| c.routers[i].host;
    // The hosts of every router but `except`.
    let others = |c: &Cluster, except: usize| -> Vec<usize> {
        (0..c.routers.len())
            .filter(|&i| i != except)
            .map(|i| c.routers[i].host)
            .collect()
    };
    while quiet(Duration::from_secs(3 + rng.below(3)), deadline) {
        match n {
            Nemesis::None => hold(Duration::from_secs(3600), deadline),
            Nemesis::KillLeader => {
                let l = leader(rt, t)?;
                rec.fault(format!("start kill router {}", l + 1), &[l], true);
                c.routers[l].kill();
                hold(Duration::from_secs(6), deadline);
                c.start_router(l)?;
                rec.fault(format!("stop kill router {}", l + 1), &[l], false);
            }
            Nemesis::PauseLeader => {
                let l = leader(rt, t)?;
                rec.fault(format!("start pause router {}", l + 1), &[l], true);
                c.routers[l].pause()?;
                hold(Duration::from_secs(8), deadline);
                c.routers[l].resume()?;
                rec.fault(format!("stop pause router {}", l + 1), &[l], false);
            }
            Nemesis::PartitionLeader | Nemesis::PartitionFollower | Nemesis::PartitionRouter => {
                let l = leader(rt, t)?;
                let (victim, secs) = match n {
                    Nemesis::PartitionLeader => (l, 10),
                    Nemesis::PartitionFollower => {
                        ((l + 1 + rng.below(2) as usize) % routers.len(), 15)
                    }
                    _ => (routers.len() - 1, 10),
                };
                let rest = others(c, victim);
                rec.fault(
                    format!("start partition router {} | the others", victim + 1),
                    &[victim],
                    true,
                );
                c.net.cut(&[&[host(c, victim)], &rest])?;
                hold(Duration::from_secs(secs), deadline);
                c.net.heal()?;
                rec.fault("stop partition healed", &[victim], false);
                if n == Nemesis::PartitionFollower {
                    // Once: what follows the heal is what this scenario watches.
                    hold(Duration::from_secs(3600), deadline);
                }
            }
            Nemesis::OneWay => {
                let l = leader(rt, t)?;
                let rest = others(c, l);
                rec.fault(
                    format!("start partition-one-way followers -> router {}", l + 1),
                    &[l],
                    true,
                );
                c.net.cut_one_way(&rest, &[host(c, l)])?;
                hold(Duration::from_secs(10), deadline);
                c.net.heal()?;
                rec.fault("stop partition-one-way healed", &[l], false);
            }
            Nemesis::Loss => {
                let hosts: Vec<usize> = routers.iter().map(|&i| host(c, i)).collect();
                rec.fault("start loss 20% between routers", &routers, true);
                c.net.lossy(&hosts, 20)?;
                hold(Duration::from_secs(15), deadline);
                c.net.heal()?;
                rec.fault("stop loss healed", &routers, false);
            }
            Nemesis::KillAll => {
                rec.fault("start kill-all routers", &routers, true);
                for r in &mut c.routers {
                    r.kill();
                }
                hold(Duration::from_secs(2), deadline);
                for i in routers.clone() {
                    c.start_router(i)?;
                }
                rec.fault("stop kill-all restarted", &routers, false);
            }
            Nemesis::Bitrot => {
                let l = leader(rt, t)?;
                let f = (l + 1 + rng.below(2) as usize) % routers.len();
                rec.fault(format!("start bitrot router {}", f + 1), &[f], true);
                c.routers[f].terminate()?;
                let altered = alter_store(
                    c.routers[f]
                        .raft_dir
                        .as_deref()
                        .ok_or_else(|| anyhow!("no raft dir"))?,
                )?;
                rec.fault(
                    format!("note altered {altered} in router {}'s store", f + 1),
                    &[f],
                    false,
                );
                if let Err(e) = c.start_router(f) {
                    let why = format!("{e:#}");
                    if !why.contains("aside") {
                        return Err(e);
                    }
                    // The repair its error names: the store moved aside, the node started empty.
                    rec.fault(
                        format!(
                            "note router {} refused its store; moved aside, restarted",
                            f + 1
                        ),
                        &[f],
                        false,
                    );
                    let dir = c.routers[f]
                        .raft_dir
                        .clone()
                        .ok_or_else(|| anyhow!("no raft dir"))?;
                    let aside = dir.with_extension(format!("corrupt-{}", rec.now_ms() as u64));
                    std::fs::rename(&dir, aside)?;
                    c.start_router(f)?;
                }
                rec.fault(format!("stop bitrot router {}", f + 1), &[f], false);
            }
            Nemesis::FastClock => {
                let l = leader(rt, t)?;
                let f = (l + 1) % routers.len();
                rec.fault(format!("start clock router {} x20", f + 1), &[f], true);
                c.restart_router_with_clock(f, 20)?;
                hold(Duration::from_secs(20), deadline);
                c.routers[f].kill();
                c.start_router(f)?;
                rec.fault(format!("stop clock router {}", f + 1), &[f], false);
            }
            Nemesis::EngineHang => {
                rec.fault("start pause engine 1", &[], true);
                c.engines[0].pause()?;
                hold(Duration::from_secs(10), deadline);
                c.engines[0].resume()?;
                rec.fault("stop pause engine 1", &[], false);
            }
            Nemesis::AgentKill => {
                rec.fault("start kill agent 1", &[], true);
                c.agents[0].kill();
                hold(Duration::from_secs(8), deadline);
                c.start_agent(0)?;
                rec.fault("stop kill agent 1", &[], false);
            }
            Nemesis::RedisKill => {
                rec.fault("start kill redis", &[], true);
                if let Some(r) = c.redis.as_mut() {
                    r.kill();
                }
                hold(Duration::from_secs(8), deadline);
                c.start_redis()?;
                rec.fault("stop kill redis", &[], false);
            }
            Nemesis::DiskFull => {
                let v = routers.len() - 1;
                let proc = c.routers[v]
                    .proc
                    .as_ref()
                    .ok_or_else(|| anyhow!("not running"))?;
                let dir = c.routers[v]
                    .raft_dir
                    .as_deref()
                    .ok_or_else(|| anyhow!("no raft dir"))?;
                let disk = warmpath_testkit::in_namespace_of(proc.pid(), dir);
                rec.fault(format!("start disk-full router {}", v + 1), &[v], true);
                warmpath_testkit::fill_disk(&disk)
                    .with_context(|| format!("filling {}", disk.display()))?;
                hold(Duration::from_secs(10), deadline);
                std::fs::remove_file(disk.join("filler"))?;
                rec.fault(
                    format!("stop disk-full router {} freed", v + 1),
                    &[v],
                    false,
                );
            }
            Nemesis::RollingRestart => {
                for i in routers.clone() {
                    rec.fault(format!("start restart router {}", i + 1), &[i], true);
                    c.routers[i].terminate()?;
                    c.start_router(i)?;
                    wait_ready(rt, &c.routers[i].url)?;
                    rec.fault(format!("stop restart router {} ready", i + 1), &[i], false);
                }
            }
            Nemesis::EngineKill => {
                rec.fault("start kill engine 1", &[], true);
                c.engines[0].kill();
                hold(Duration::from_secs(5), deadline);
                c.start_engine(0)?;
                rec.fault("stop kill engine 1", &[], false);
            }
        }
    }
    Ok(())
}

/// Alters, in place and at the same length, every copy of the newest set tenant id in a
/// stopped router's store: `js0…` becomes `js9…`, an id no client writes. Returns what it
/// altered.
fn alter_store(dir: &Path) -> Result<String> {
    let file = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "redb"))
        .ok_or_else(|| anyhow!("no .redb file in {}", dir.display()))?;
    let mut bytes = std::fs::read(&file)?;
    let id_at = |i: usize, b: &[u8]| {
        b[i..i + 2] == *b"js" && b[i + 2..i + 10].iter().all(u8::is_ascii_digit)
    };
    let newest = (0..bytes.len().saturating_sub(10))
        .filter(|&i| id_at(i, &bytes) && bytes[i + 2] == b'0')
        .max_by_key(|&i| &bytes[i..i + 10])
        .map(|i| bytes[i..i + 10].to_vec())
        .ok_or_else(|| anyhow!("no set tenant id in {}", file.display()))?;
    let mut n = 0;
    for i in 0..bytes.len().saturating_sub(10) {
        if bytes[i..i + 10] == newest[..] {
            bytes[i + 2] = b'9';
            n += 1;
        }
    }
    std::fs::write(&file, &bytes)?;
    Ok(format!(
        "{n} copies of {}",
        String::from_utf8_lossy(&newest)
    ))
}

/// Ends every fault: the network healed, paused processes resumed, dead ones restarted
/// (normal clocks).
fn recover(c: &mut Cluster, rec: &Recorder) {
    if let Err(e) = c.net.heal() {
        rec.fault(format!("note heal failed: {e:#}"), &[], false);
    }
    for i in 0..c.engines.len() {
        if c.engines[i].paused {
            let _ = c.engines[i].resume();
        }
        if !c.engines[i].running() {
            if let Err(e) = c.start_engine(i) {
                rec.fault(
                    format!("note engine {} did not restart: {e:#}", i + 1),
                    &[],
                    false,
                );
            }
        }
    }
    for i in 0..c.agents.len() {
        if !c.agents[i].running() {
            if let Err(e) = c.start_agent(i) {
                rec.fault(
                    format!("note agent {} did not restart: {e:#}", i + 1),
                    &[],
                    false,
                );
            }
        }
    }
    if c.redis.as_ref().is_some_and(|r| !r.running()) {
        if let Err(e) = c.start_redis() {
            rec.fault(format!("note redis did not restart: {e:#}"), &[], false);
        }
    }
    for i in 0..c.routers.len() {
        if c.routers[i].paused {
            let _ = c.routers[i].resume();
        }
        if !c.routers[i].running() {
            if let Err(e) = c.start_router(i) {
                rec.fault(
                    format!("note router {} did not restart: {e:#}", i + 1),
                    &[i],
                    false,
                );
            }
        }
    }
    rec.fault("note recovered: healed, resumed, restarted", &[], false);
}
