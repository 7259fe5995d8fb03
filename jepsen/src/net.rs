//! Where the processes run and how the network between them fails.
//!
//! With root (and `ip`, `nft`), every host gets a network namespace of its own, joined by
//! veth pairs to a bridge in a hub namespace; the harness reaches them over one more veth
//! from its own namespace. Partitions are nftables rules on that bridge (bridge family,
//! forward hook) between host addresses: both ways, one way, or random loss
//! (`numgen random`). The harness's own link is never cut: clients always reach the
//! router they talk to, as in Jepsen. Without namespaces every host is loopback, and the
//! network nemeses are unavailable (the scenarios that need them say so and are skipped).

use anyhow::{bail, Context, Result};
use std::process::Command;

/// The network of one run.
#[derive(Debug)]
pub enum Net {
    Namespaces(Namespaces),
    Loopback,
}

#[derive(Debug)]
pub struct Namespaces {
    /// Name prefix of every namespace and interface of this run.
    prefix: String,
    /// Third octet of 10.77.X.0/24.
    subnet: u8,
    hosts: usize,
}

/// Runs `ip`/`nft` and fails with what it printed.
fn sh(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// How the harness should lay out its hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Namespaces if this machine allows them, else loopback (with a warning).
    Auto,
    Namespaces,
    Loopback,
}

impl Net {
    /// Sets up `hosts` hosts.
    pub fn setup(hosts: usize, mode: Mode) -> Result<Net> {
        match mode {
            Mode::Loopback => Ok(Net::Loopback),
            Mode::Namespaces => Ok(Net::Namespaces(Namespaces::setup(hosts)?)),
            Mode::Auto => match Namespaces::setup(hosts) {
                Ok(ns) => Ok(Net::Namespaces(ns)),
                Err(e) => {
                    eprintln!(
                        "warning: no network namespaces ({e:#}); running on loopback, where partitions and loss cannot be injected"
                    );
                    Ok(Net::Loopback)
                }
            },
        }
    }

    /// The address host `i` listens on.
    pub fn ip(&self, i: usize) -> String {
        match self {
            Net::Namespaces(ns) => ns.ip(i),
            Net::Loopback => "127.0.0.1".into(),
        }
    }

    /// A command that runs `program` on host `i`.
    pub fn command(&self, i: usize, program: &std::path::Path) -> Command {
        match self {
            Net::Namespaces(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.host(i)]).arg(program);
                c
            }
            Net::Loopback => Command::new(program),
        }
    }

    /// Whether each host has its own port space (fixed ports can be used).
    pub fn isolated_ports(&self) -> bool {
        matches!(self, Net::Namespaces(_))
    }

    fn namespaces(&self) -> Result<&Namespaces> {
        match self {
            Net::Namespaces(ns) => Ok(ns),
            Net::Loopback => bail!(
                "this fault needs network namespaces (run as root with iproute2 and nftables)"
            ),
        }
    }

    /// Drops everything between hosts `a` and `b`, both ways: a partition.
    pub fn cut(&self, groups: &[&[usize]]) -> Result<()> {
        let ns = self.namespaces()?;
        let mut rules = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            for h in groups.iter().skip(gi + 1) {
                for &a in *g {
                    for &b in *h {
                        rules.push(ns.drop_rule(a, b, ""));
                        rules.push(ns.drop_rule(b, a, ""));
                    }
                }
            }
        }
        ns.apply(&rules)
    }

    /// Drops what `from` sends to `to` only.
    pub fn cut_one_way(&self, from: &[usize], to: &[usize]) -> Result<()> {
        let ns = self.namespaces()?;
        let rules: Vec<String> = from
            .iter()
            .flat_map(|&a| to.iter().map(move |&b| (a, b)))
            .map(|(a, b)| ns.drop_rule(a, b, ""))
            .collect();
        ns.apply(&rules)
    }

    /// Drops `percent` of the packets between any two of `hosts`, at random.
    pub fn lossy(&self, hosts: &[usize], percent: u32) -> Result<()> {
        let ns = self.namespaces()?;
        let mut rules = Vec::new();
        for &a in hosts {
            for &b in hosts {
                if a != b {
                    rules.push(ns.drop_rule(a, b, &format!("numgen random mod 100 < {percent}")));
                }
            }
        }
        ns.apply(&rules)
    }

    /// Removes every network fault.
    pub fn heal(&self) -> Result<()> {
        match self {
            Net::Namespaces(ns) => ns.flush(),
            Net::Loopback => Ok(()),
        }
    }
}

impl Namespaces {
    /// This process's namespaces (one run per process): their names and subnet follow
    /// from its pid.
    fn of_this_process(hosts: usize) -> Namespaces {
        let subnet = (std::process::id() % 250 + 1) as u8;
        Namespaces {
            prefix: format!("wpj{subnet}"),
            subnet,
            hosts,
        }
    }

    fn setup(hosts: usize) -> Result<Namespaces> {
        // A crashed run's leftovers with the same prefix go first.
        let ns = Namespaces::of_this_process(hosts);
        ns.teardown();
        let hub = ns.hub();
        sh("ip", &["netns", "add", &hub])?;
        let steps = || -> Result<()> {
            sh("ip", &["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
            sh("ip", &["-n", &hub, "link", "set", "br0", "up"])?;
            for i in 0..hosts {
                let host = ns.host(i);
                let (a, b) = (format!("{}a{i}", ns.prefix), format!("{}b{i}", ns.prefix));
                sh("ip", &["netns", "add", &host])?;
                sh(
                    "ip",
                    &["link", "add", &a, "type", "veth", "peer", "name", &b],
                )?;
                sh("ip", &["link", "set", &a, "netns", &hub])?;
                sh("ip", &["link", "set", &b, "netns", &host])?;
                sh(
                    "ip",
                    &["-n", &hub, "link", "set", &a, "master", "br0", "up"],
                )?;
                let addr = format!("{}/24", ns.ip(i));
                sh("ip", &["-n", &host, "addr", "add", &addr, "dev", &b])?;
                sh("ip", &["-n", &host, "link", "set", &b, "up"])?;
                sh("ip", &["-n", &host, "link", "set", "lo", "up"])?;
            }
            // The harness's own link.
            let (c, d) = (format!("{}c", ns.prefix), format!("{}d", ns.prefix));
            sh(
                "ip",
                &["link", "add", &c, "type", "veth", "peer", "name", &d],
            )?;
            sh("ip", &["link", "set", &d, "netns", &hub])?;
            sh(
                "ip",
                &["-n", &hub, "link", "set", &d, "master", "br0", "up"],
            )?;
            sh(
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("10.77.{}.254/24", ns.subnet),
                    "dev",
                    &c,
                ],
            )?;
            sh("ip", &["link", "set", &c, "up"])?;
            ns.nft(&["add table bridge jepsen"])?;
            ns.nft(&["add chain bridge jepsen forward { type filter hook forward priority 0; policy accept; }"])?;
            Ok(())
        };
        if let Err(e) = steps() {
            ns.teardown();
            return Err(e);
        }
        Ok(ns)
    }

    fn hub(&self) -> String {
        format!("{}-hub", self.prefix)
    }

    fn host(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    fn ip(&self, i: usize) -> String {
        format!("10.77.{}.{}", self.subnet, i + 1)
    }

    fn drop_rule(&self, from: usize, to: usize, extra: &str) -> String {
        format!(
            "add rule bridge jepsen forward ip saddr {} ip daddr {} {extra} drop",
            self.ip(from),
            self.ip(to)
        )
    }

    /// Runs `nft ARGS…` in the hub namespace, where the bridge is.
    fn nft(&self, args: &[&str]) -> Result<()> {
        let hub = self.hub();
        let mut all = vec!["netns", "exec", hub.as_str(), "nft"];
        all.extend_from_slice(args);
        sh("ip", &all)
    }

    fn apply(&self, rules: &[String]) -> Result<()> {
        let script = rules.join("\n") + "\n";
        let path = std::env::temp_dir().join(format!("{}-rules.nft", self.prefix));
        std::fs::write(&path, script)?;
        self.nft(&["-f", path.to_str().unwrap_or_default()])
    }

    fn flush(&self) -> Result<()> {
        self.nft(&["flush chain bridge jepsen forward"])
    }

    fn teardown(&self) {
        for i in 0..self.hosts.max(8) {
            let _ = sh("ip", &["netns", "del", &self.host(i)]);
        }
        let _ = sh("ip", &["netns", "del", &self.hub()]);
        let _ = sh("ip", &["link", "del", &format!("{}c", self.prefix)]);
    }
}

/// What a harness stopped by a signal leaves behind: kills the processes in this run's
/// namespaces and removes the namespaces (a normal exit does both through `Drop`).
pub fn cleanup_after_signal() {
    // More hosts than any run sets up: removing one that is not there does nothing.
    let ns = Namespaces::of_this_process(8);
    for name in (0..ns.hosts).map(|i| ns.host(i)).chain([ns.hub()]) {
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
    }
    ns.teardown();
    // Keep `Drop` from running the teardown a second time on a value never set up.
    std::mem::forget(ns);
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        self.teardown();
    }
}
