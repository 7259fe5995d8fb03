//! The system under test: engine-sims and `warmpath router` processes with Raft and
//! gossip, each on a host of the [`Net`], started, killed, paused and restarted through
//! their command lines and signals only.

use crate::net::Net;
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use warmpath_testkit::Proc;

/// The admin token, Raft peer token and gossip secret every router of the run shares.
pub const ADMIN_TOKEN: &str = "jepsen-admin-token";
const PEER_TOKEN: &str = "jepsen-raft-peer-token";
const GOSSIP_SECRET: &str = "jepsen-gossip-secret-0123456789abcdef";

/// libfaketime, preloaded directly into a router to skew its clocks (the `faketime`
/// wrapper forks, and killing it would leave the router running).
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// A process of the cluster, with what it takes to start it again.
#[derive(Debug)]
pub struct Member {
    /// Its host in the [`Net`].
    pub host: usize,
    /// `None` while killed or stopped.
    pub proc: Option<Proc>,
    args: Vec<String>,
    /// Extra environment (a skewed clock).
    env: Vec<(String, String)>,
    log: PathBuf,
    /// Its data port (completions) base URL.
    pub url: String,
    /// Its admin API base URL (routers).
    pub admin: String,
    /// Raft node id (routers).
    pub id: u64,
    /// Its Raft data directory (routers).
    pub raft_dir: Option<PathBuf>,
    /// Its metrics base URL (routers, with the cache tier).
    pub metrics: Option<String>,
    pub paused: bool,
    /// The size of the tmpfs its Raft directory is on, in a mount namespace of its own
    /// (a router whose disk the nemesis fills): each start mounts an empty one.
    pub small_disk: Option<u64>,
}

/// The engines and routers of one run.
#[derive(Debug)]
pub struct Cluster {
    pub net: Net,
    bin: PathBuf,
    pub engines: Vec<Member>,
    pub routers: Vec<Member>,
    /// A cache-agent beside each engine (same host), when the run has the cache tier.
    pub agents: Vec<Member>,
    /// The agents' shared L2, a real `redis-server`.
    pub redis: Option<Member>,
}

impl Cluster {
    /// Starts `engines` engine-sims and `routers` Raft voters on the hosts of `net`
    /// (engines first), writing logs and data under `dir`. With `small_raft_disk`, the
    /// last router's Raft directory is a tmpfs of that many bytes (see
    /// [`Member::small_disk`]).
    ///
    /// With `cache_tier` (namespaces only: fixed ports), each engine gets a cache-agent on
    /// its host (L1 in memory, L2 in one Redis on the host after the routers; the engine
    /// offloads to it and publishes its KV events to it), and every router follows every
    /// agent's residency over QUIC with mutual TLS.
    pub fn start(
        net: Net,
        bin: &Path,
        dir: &Path,
        engines: usize,
        routers: usize,
        cache_tier: bool,
        small_raft_disk: Option<u64>,
    ) -> Result<Cluster> {
        if cache_tier && !net.isolated_ports() {
            bail!("the cache tier needs network namespaces");
        }
        std::fs::create_dir_all(dir.join("logs"))?;
        let secret = |name: &str, value: &str| -> Result<String> {
            let p = dir.join(name);
            std::fs::write(&p, format!("{value}\n"))?;
            Ok(p.to_string_lossy().into_owned())
        };
        let admin_token = secret("admin.token", ADMIN_TOKEN)?;
        let peer_token = secret("raft-peer.token", PEER_TOKEN)?;
        let gossip_secret = secret("gossip.secret", GOSSIP_SECRET)?;
        // Fixed ports in namespaces (each host has its own); free loopback ports otherwise.
        let isolated = net.isolated_ports();
        let port = |fixed: u16| -> u16 {
            if isolated {
                fixed
            } else {
                warmpath_testkit::free_addr().port()
            }
        };
        let mut c = Cluster {
            bin: bin.to_path_buf(),
            engines: Vec::new(),
            routers: Vec::new(),
            agents: Vec::new(),
            redis: None,
            net,
        };
        let certs = dir.join("certs").to_string_lossy().into_owned();
        let agent_token = secret("agent.token", "jepsen-agent-token-0123456789")?;
        if cache_tier {
            let redis_host = engines + routers;
            let redis_ip = c.net.ip(redis_host);
            let mut gen = std::process::Command::new(bin);
            gen.args([
                "certs", "--out", &certs, "--agent", "agent", "--router", "router",
            ]);
            // Routers follow each agent by its address: the agent's certificate names it.
            for e in 0..engines {
                gen.args(["--san", &c.net.ip(e)]);
            }
            let out = gen.output()?;
            if !out.status.success() {
                bail!("warmpath certs: {}", String::from_utf8_lossy(&out.stderr));
            }
            // redis-server prints no address line: a shell prints it, then becomes Redis.
            let args = [
                "-c",
                "echo \"listening on redis://$0:6379\"; exec redis-server --port 6379 --bind \"$0\" \
                 --logfile \"$1\" --save '' --appendonly no --protected-mode no \
                 --maxmemory 64mb --maxmemory-policy allkeys-lru",
                &redis_ip,
                &dir.join("logs/redis-server.log").to_string_lossy(),
            ]
            .map(String::from)
            .to_vec();
            c.redis = Some(Member::new(redis_host, args, dir.join("logs/redis.log")));
            for e in 0..engines {
                let ip = c.net.ip(e);
                let args = [
                    "agent",
                    "--listen",
                    &format!("{ip}:7600"),
                    "--token-file",
                    &agent_token,
                    "--l1-bytes",
                    "64MiB",
                    "--l2",
                    &format!("redis://{redis_ip}:6379"),
                    "--kv-events",
                    &format!("http://{ip}:8100=tcp://{ip}:5557,tcp://{ip}:5558"),
                    "--residency-listen",
                    &format!("{ip}:7700"),
                    "--tls-dir",
                    &certs,
                    "--tls-name",
                    "agent",
                ]
                .map(String::from)
                .to_vec();
                c.agents.push(Member::new(
                    e,
                    args,
                    dir.join(format!("logs/agent-{}.log", e + 1)),
                ));
            }
        }
        for e in 0..engines {
            let ip = c.net.ip(e);
            let addr = format!("{ip}:{}", port(8100));
            let mut args = ["engine-sim", "--listen", &addr, "--speedup", "200"]
                .map(String::from)
                .to_vec();
            if cache_tier {
                args.extend(
                    [
                        "--kv-events",
                        &format!("tcp://{ip}:5557"),
                        "--kv-replay",
                        &format!("tcp://{ip}:5558"),
                        "--agent",
                        &format!("http://{ip}:7600"),
                        "--agent-token-file",
                        &agent_token,
                    ]
                    .map(String::from),
                );
            }
            c.engines.push(Member::new(
                e,
                args,
                dir.join(format!("logs/engine-{}.log", e + 1)),
            ));
        }
        let hosts: Vec<usize> = (engines..engines + routers).collect();
        let admin: Vec<String> = hosts
            .iter()
            .map(|&h| format!("{}:{}", c.net.ip(h), port(9000)))
            .collect();
        let gossip: Vec<String> = hosts
            .iter()
            .map(|&h| format!("{}:{}", c.net.ip(h), port(7946)))
            .collect();
        for (i, &h) in hosts.iter().enumerate() {
            let id = i as u64 + 1;
            let raft_dir = dir.join(format!("router-{id}"));
            let listen = format!("{}:{}", c.net.ip(h), port(8000));
            let mut args: Vec<String> = vec!["router".into(), "--listen".into(), listen];
            for e in &c.engines {
                args.extend(["--instance".into(), format!("http://{}", e.args[2])]);
            }
            let more = [
                "--node-id",
                &format!("r{id}"),
                "--gossip-listen",
                &gossip[i],
                "--seed",
                &gossip[0],
                "--gossip-secret-file",
                &gossip_secret,
                "--raft-node-id",
                &id.to_string(),
                "--raft-dir",
                &raft_dir.to_string_lossy(),
                "--admin-listen",
                &admin[i],
                "--admin-token-file",
                &admin_token,
                "--raft-peer-token-file",
                &peer_token,
            ]
            .map(String::from);
            args.extend(more);
            for (j, a) in admin.iter().enumerate() {
                args.extend(["--voter".into(), format!("{}=http://{a}", j + 1)]);
            }
            let mut metrics = None;
            if cache_tier {
                let listen = format!("{}:9100", c.net.ip(h));
                metrics = Some(format!("http://{listen}"));
                args.extend(["--metrics-listen".into(), listen]);
                for e in 0..engines {
                    args.extend(["--residency-agent".into(), format!("{}:7700", c.net.ip(e))]);
                }
                args.extend([
                    "--tls-dir".into(),
                    certs.clone(),
                    "--tls-name".into(),
                    "router".into(),
                ]);
            }
            let mut m = Member::new(h, args, dir.join(format!("logs/router-{id}.log")));
            m.id = id;
            m.admin = format!("http://{}", admin[i]);
            m.raft_dir = Some(raft_dir);
            m.metrics = metrics;
            if i + 1 == routers {
                m.small_disk = small_raft_disk;
            }
            c.routers.push(m);
        }
        if c.redis.is_some() {
            c.start_redis()?;
        }
        for i in 0..c.agents.len() {
            c.start_agent(i)?;
        }
        for i in 0..engines {
            c.start_engine(i)?;
        }
        for i in 0..routers {
            c.start_router(i)?;
        }
        Ok(c)
    }

    /// Starts Redis (again) and waits until it takes connections.
    pub fn start_redis(&mut self) -> Result<()> {
        let Some(m) = self.redis.as_mut() else {
            bail!("no redis in this run");
        };
        let mut cmd = self.net.command(m.host, Path::new("sh"));
        m.spawn(&mut cmd, 1)?;
        let addr = format!("{}:6379", self.net.ip(m.host));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(&addr).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "redis-server did not take connections at {addr}: {}",
                    m.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts the cache-agent of engine `i` (again): its block API and residency lines.
    pub fn start_agent(&mut self, i: usize) -> Result<()> {
        let m = &mut self.agents[i];
        let mut cmd = self.net.command(m.host, &self.bin);
        m.spawn(&mut cmd, 2)
    }

    pub fn start_engine(&mut self, i: usize) -> Result<()> {
        let m = &mut self.engines[i];
        let mut cmd = self.net.command(m.host, &self.bin);
        m.spawn(&mut cmd, 1)
    }

    /// Starts router `i` (again) and waits until it prints its admin address.
    pub fn start_router(&mut self, i: usize) -> Result<()> {
        let m = &mut self.routers[i];
        let mut cmd = match (m.small_disk, &m.raft_dir) {
            (Some(bytes), Some(dir)) => {
                std::fs::create_dir_all(dir)?;
                let mut c = self.net.command(m.host, Path::new("unshare"));
                c.args(warmpath_testkit::small_disk_args(dir, bytes, &self.bin));
                c
            }
            _ => self.net.command(m.host, &self.bin),
        };
        m.spawn(&mut cmd, 1)?;
        // After its address: its gossip and admin lines.
        let deadline = Instant::now() + Duration::from_secs(20);
        let proc = m.proc.as_mut().expect("just started");
        loop {
            let line = proc.read_line();
            if line.contains("admin on ") {
                return Ok(());
            }
            if line.is_empty() || Instant::now() > deadline {
                let why = m.log_tail();
                m.kill();
                bail!("router {} did not start Raft: {why}", i + 1);
            }
        }
    }

    /// Restarts router `i` with a clock running `rate` times as fast (libfaketime).
    pub fn restart_router_with_clock(&mut self, i: usize, rate: u32) -> Result<()> {
        if !Path::new(LIBFAKETIME).exists() {
            bail!("{LIBFAKETIME} is missing (apt-get install libfaketime)");
        }
        self.routers[i].kill();
        self.routers[i].env = vec![
            ("LD_PRELOAD".into(), LIBFAKETIME.into()),
            ("FAKETIME".into(), format!("+0 x{rate}")),
            ("FAKETIME_NO_CACHE".into(), "1".into()),
        ];
        let r = self.start_router(i);
        self.routers[i].env.clear();
        r
    }
}

impl Member {
    fn new(host: usize, args: Vec<String>, log: PathBuf) -> Member {
        Member {
            host,
            proc: None,
            args,
            env: Vec::new(),
            log,
            url: String::new(),
            admin: String::new(),
            id: 0,
            raft_dir: None,
            metrics: None,
            paused: false,
            small_disk: None,
        }
    }

    fn spawn(&mut self, cmd: &mut std::process::Command, lines: usize) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        cmd.args(&self.args).stderr(Stdio::from(log));
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let proc = Proc::try_spawn(
            cmd,
            lines,
            &std::env::var("JEPSEN_LOG").unwrap_or("warn".into()),
        )
        .map_err(|e| anyhow!("{e}: {}", self.log_tail()))?;
        self.url = proc.url.clone();
        self.proc = Some(proc);
        self.paused = false;
        Ok(())
    }

    /// The last lines of its log: why it stopped or did not start.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(3).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    pub fn running(&self) -> bool {
        self.proc.is_some()
    }

    fn signal(&self, sig: &str) -> Result<()> {
        let proc = self.proc.as_ref().ok_or_else(|| anyhow!("not running"))?;
        Ok(proc.try_signal(sig)?)
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            if self.paused {
                let _ = p.try_signal("-CONT");
            }
            p.kill();
        }
        self.paused = false;
    }

    /// SIGTERM, and wait for it to exit (a clean shutdown).
    pub fn terminate(&mut self) -> Result<()> {
        self.signal("-TERM")?;
        if let Some(mut p) = self.proc.take() {
            let _ = p.child.wait();
        }
        Ok(())
    }

    pub fn pause(&mut self) -> Result<()> {
        self.signal("-STOP")?;
        self.paused = true;
        Ok(())
    }

    pub fn resume(&mut self) -> Result<()> {
        self.signal("-CONT")?;
        self.paused = false;
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let all = self.routers.iter_mut().chain(self.engines.iter_mut());
        for m in all
            .chain(self.agents.iter_mut())
            .chain(self.redis.iter_mut())
        {
            m.kill();
        }
    }
}
