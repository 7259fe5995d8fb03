//! Faults of a simulated fleet (issue 27): a rack of agents lost at once, a router
//! restarted and catching up, a partition of the routers; and the hit rate over time that
//! shows what each costs and how long the fleet takes to recover.
//!
//! A [`Fault`] is data: when it strikes and what it hits. The cluster simulator
//! ([`crate::cluster`]) plays it with the production cores, as a live fleet would meet it:
//!
//! - **agents lost**: the agents of the first `share` of the hosts (a rack: hosts are
//!   numbered in order) die at `at`. Their L1 (host memory) is gone, they send nothing more,
//!   and each router that followed one notices it as a live router does: its residency
//!   [`Subscriber`](warmpath_residency::Subscriber) expires after `expiry` of silence
//!   (`router --residency-expiry-ms`, default 3 s) and what the agent reported is dropped
//!   from the index; its engines go back to predictions there. The engines keep their GPU
//!   caches and keep serving. With `for`, each agent starts again that much later: a new
//!   epoch, an empty L1, the GPU's blocks from the engine's replay (record 0081), and its
//!   followers take its snapshot `resync` after it starts.
//! - **router restart**: router `router` (default the last) loses its whole state at `at`: a
//!   fresh [`RouterCore`](warmpath_index::router::RouterCore), its residency links and the
//!   requests it had in flight (engines finish them; it never hears of them). Its followed
//!   agents' snapshots reach it `resync` later; its peers' decisions, every batch still
//!   alive (the decision TTL, the index's prediction TTL), reach it `catch-up` after the
//!   restart (gossip's catch-up, measured 0.7–0.8 s: BENCHMARKS.md, "Gossip faults"), and
//!   those in flight meanwhile with them.
//! - **partition**: from `at` for `for`, the last `share` of the routers (the seeds, the
//!   first, stay in the majority, as in `fleet_faults`) and the rest exchange nothing:
//!   decisions across the cut wait and arrive `catch-up` after the heal (chitchat delivers
//!   what it holds once the sides meet again: 1.0–1.1 s after the heal, measured), and each
//!   side routes on the other side's load as last published before the cut. Residency is
//!   unaffected.
//!
//! Syntax (`warmpath simulate --fault`), durations in `s` or `ms`:
//! `agents-lost@60s:0.125[:for=30s][:expiry=3s][:resync=0.63s]`,
//! `router-restart@60s[:router=N][:catch-up=0.8s][:resync=0.63s]`,
//! `partition@60s:0.25:for=5s[:catch-up=1s]`. Times count from the first arrival.

use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// How long a router keeps a silent agent's residency (`router --residency-expiry-ms`).
pub const DEFAULT_EXPIRY_US: u64 = 3_000_000;
/// From an agent's (or a router's) start to its followers holding its snapshot: a restarted
/// agent's holders were back at the routers 0.63 s after it started (BENCHMARKS.md, "Faults
/// an operator meets").
pub const DEFAULT_RESYNC_US: u64 = 630_000;
/// A restarted router has its peers' decisions back this long after it starts (gossip,
/// `fleet_faults`: 0.7–0.8 s at 8–128 routers).
pub const DEFAULT_RESTART_CATCH_UP_US: u64 = 800_000;
/// After a partition heals, the decisions held back arrive this much later (gossip,
/// `fleet_faults`: reconverged 1.0–1.1 s after the heal).
pub const DEFAULT_HEAL_CATCH_UP_US: u64 = 1_000_000;

/// One fault of a run. Times are microseconds from the first arrival.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Fault {
    /// The agents of the first `share` of the hosts die at `at_us`.
    AgentsLost {
        at_us: u64,
        share: f64,
        /// They start again, empty, this much later; `None`: never.
        back_after_us: Option<u64>,
        /// A router drops a silent agent's residency after this long.
        expiry_us: u64,
        /// A started agent's snapshot reaches its followers this much later.
        resync_us: u64,
    },
    /// Router `router` (`None`: the last) restarts at `at_us`.
    RouterRestart {
        at_us: u64,
        router: Option<u32>,
        /// Its peers' decisions reach it again this long after the restart.
        catch_up_us: u64,
        /// Its followed agents' snapshots reach it this long after the restart.
        resync_us: u64,
    },
    /// The last `share` of the routers are cut off from the others from `at_us` for
    /// `for_us`.
    Partition {
        at_us: u64,
        share: f64,
        for_us: u64,
        /// Decisions held back arrive this long after the heal.
        catch_up_us: u64,
    },
}

impl Fault {
    /// When it strikes.
    pub fn at_us(&self) -> u64 {
        match *self {
            Fault::AgentsLost { at_us, .. }
            | Fault::RouterRestart { at_us, .. }
            | Fault::Partition { at_us, .. } => at_us,
        }
    }

    /// When the fault itself is over (agents back, router caught up, partition healed);
    /// `None`: agents that never come back.
    pub fn over_us(&self) -> Option<u64> {
        match *self {
            Fault::AgentsLost {
                at_us,
                back_after_us,
                resync_us,
                ..
            } => back_after_us.map(|b| at_us + b + resync_us),
            Fault::RouterRestart {
                at_us,
                catch_up_us,
                resync_us,
                ..
            } => Some(at_us + catch_up_us.max(resync_us)),
            Fault::Partition {
                at_us,
                for_us,
                catch_up_us,
                ..
            } => Some(at_us + for_us + catch_up_us),
        }
    }

    /// The hosts whose agents die: the first `share` of `instances`, at least one.
    pub fn hosts_lost(share: f64, instances: u32) -> u32 {
        ((share * f64::from(instances)).ceil() as u32).clamp(1, instances)
    }

    /// The routers cut off: the last `share` of `routers`, at least one, never all.
    pub fn routers_cut(share: f64, routers: u32) -> u32 {
        ((share * f64::from(routers)).ceil() as u32).clamp(1, routers.saturating_sub(1))
    }

    /// Whether the fault fits a cluster of `instances` and `routers`.
    pub fn check(&self, routers: u32) -> Result<(), FaultError> {
        match *self {
            Fault::RouterRestart {
                router: Some(r), ..
            } if r >= routers => Err(FaultError::NoSuchRouter { router: r, routers }),
            Fault::Partition { .. } if routers < 2 => Err(FaultError::PartitionOfOne),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |us: u64| format!("{}s", us as f64 / 1e6);
        match *self {
            Fault::AgentsLost {
                at_us,
                share,
                back_after_us,
                ..
            } => {
                write!(f, "agents-lost@{}:{share}", s(at_us))?;
                if let Some(b) = back_after_us {
                    write!(f, ":for={}", s(b))?;
                }
                Ok(())
            }
            Fault::RouterRestart { at_us, router, .. } => {
                write!(f, "router-restart@{}", s(at_us))?;
                if let Some(r) = router {
                    write!(f, ":router={r}")?;
                }
                Ok(())
            }
            Fault::Partition {
                at_us,
                share,
                for_us,
                ..
            } => write!(f, "partition@{}:{share}:for={}", s(at_us), s(for_us)),
        }
    }
}

/// Why a fault could not be read or does not fit the cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultError {
    /// Not `KIND@TIME…`.
    #[error("a fault reads KIND@TIME[:...], e.g. agents-lost@60s:0.125, router-restart@60s, partition@60s:0.25:for=5s; got {0:?}")]
    Form(String),
    /// An unknown kind.
    #[error("unknown fault {0:?}: agents-lost, router-restart or partition")]
    Kind(String),
    /// A duration that does not parse.
    #[error("{what}: {value:?} is not a duration (e.g. 60s, 800ms, 0.8s)")]
    Duration { what: &'static str, value: String },
    /// A share out of range.
    #[error("{what}: {value:?} is not a share in (0, 1]")]
    Share { what: &'static str, value: String },
    /// A router that does not parse.
    #[error("router: {0:?} is not a router number")]
    Router(String),
    /// An option the kind does not take, or one given twice.
    #[error("{kind} takes no option {option:?} here (it takes {takes})")]
    Option {
        kind: &'static str,
        option: String,
        takes: &'static str,
    },
    /// A required part missing.
    #[error("{kind} needs {what}")]
    Missing {
        kind: &'static str,
        what: &'static str,
    },
    /// A partition that leaves no router on one side.
    #[error("a partition needs at least 2 routers")]
    PartitionOfOne,
    /// A restart of a router the cluster does not have.
    #[error("router-restart: router {router} does not exist (routers are 0..{routers})")]
    NoSuchRouter { router: u32, routers: u32 },
}

/// Parses `60s`, `800ms`, `0.8s` into microseconds.
fn duration(what: &'static str, v: &str) -> Result<u64, FaultError> {
    let bad = || FaultError::Duration {
        what,
        value: v.to_string(),
    };
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e6)
    } else {
        return Err(bad());
    };
    let x: f64 = num.parse().map_err(|_| bad())?;
    if !x.is_finite() || x < 0.0 {
        return Err(bad());
    }
    Ok((x * scale).round() as u64)
}

fn share(what: &'static str, v: &str) -> Result<f64, FaultError> {
    match v.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(FaultError::Share {
            what,
            value: v.to_string(),
        }),
    }
}

impl FromStr for Fault {
    type Err = FaultError;

    fn from_str(s: &str) -> Result<Self, FaultError> {
        let (kind, rest) = s
            .split_once('@')
            .ok_or_else(|| FaultError::Form(s.to_string()))?;
        let mut parts = rest.split(':');
        let at_us = duration("the fault's time", parts.next().unwrap_or_default())?;
        // Positional parts first, then NAME=VALUE options.
        let mut positional = Vec::new();
        let mut options: Vec<(&str, &str)> = Vec::new();
        for p in parts {
            match p.split_once('=') {
                Some((k, v)) => {
                    if options.iter().any(|(o, _)| *o == k) {
                        return Err(FaultError::Form(s.to_string()));
                    }
                    options.push((k, v));
                }
                None if options.is_empty() => positional.push(p),
                None => return Err(FaultError::Form(s.to_string())),
            }
        }
        let take = |kind: &'static str, takes: &'static str, allowed: &[&str]| match options
            .iter()
            .find(|(k, _)| !allowed.contains(k))
        {
            Some((k, _)) => Err(FaultError::Option {
                kind,
                option: (*k).to_string(),
                takes,
            }),
            None => Ok(()),
        };
        let opt = |k: &str| options.iter().find(|(o, _)| *o == k).map(|(_, v)| *v);
        let dur_or = |k: &'static str, default: u64| opt(k).map_or(Ok(default), |v| duration(k, v));
        match kind {
            "agents-lost" => {
                take(
                    "agents-lost",
                    "for, expiry, resync",
                    &["for", "expiry", "resync"],
                )?;
                let [sh] = positional[..] else {
                    return Err(FaultError::Missing {
                        kind: "agents-lost",
                        what: "one share of the hosts, e.g. agents-lost@60s:0.125",
                    });
                };
                Ok(Fault::AgentsLost {
                    at_us,
                    share: share("share of the hosts", sh)?,
                    back_after_us: opt("for").map(|v| duration("for", v)).transpose()?,
                    expiry_us: dur_or("expiry", DEFAULT_EXPIRY_US)?,
                    resync_us: dur_or("resync", DEFAULT_RESYNC_US)?,
                })
            }
            "router-restart" => {
                take(
                    "router-restart",
                    "router, catch-up, resync",
                    &["router", "catch-up", "resync"],
                )?;
                if !positional.is_empty() {
                    return Err(FaultError::Form(s.to_string()));
                }
                let router = opt("router")
                    .map(|v| {
                        v.parse::<u32>()
                            .map_err(|_| FaultError::Router(v.to_string()))
                    })
                    .transpose()?;
                Ok(Fault::RouterRestart {
                    at_us,
                    router,
                    catch_up_us: dur_or("catch-up", DEFAULT_RESTART_CATCH_UP_US)?,
                    resync_us: dur_or("resync", DEFAULT_RESYNC_US)?,
                })
            }
            "partition" => {
                take("partition", "for, catch-up", &["for", "catch-up"])?;
                let [sh] = positional[..] else {
                    return Err(FaultError::Missing {
                        kind: "partition",
                        what: "one share of the routers, e.g. partition@60s:0.25:for=5s",
                    });
                };
                let for_us = opt("for")
                    .ok_or(FaultError::Missing {
                        kind: "partition",
                        what: "a duration, e.g. for=5s",
                    })
                    .and_then(|v| duration("for", v))?;
                Ok(Fault::Partition {
                    at_us,
                    share: share("share of the routers", sh)?,
                    for_us,
                    catch_up_us: dur_or("catch-up", DEFAULT_HEAL_CATCH_UP_US)?,
                })
            }
            other => Err(FaultError::Kind(other.to_string())),
        }
    }
}

/// Prompt tokens and tokens found cached of the requests that arrived in one window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Window {
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
}

/// The hit rate over time: requests by arrival, in windows of `window_us` from the first
/// arrival (a request counts once its first token came, with what its engine found).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Timeline {
    pub window_us: u64,
    pub windows: Vec<Window>,
}

impl Timeline {
    pub fn new(window_us: u64) -> Self {
        Timeline {
            window_us: window_us.max(1),
            windows: Vec::new(),
        }
    }

    /// A request that arrived `since_first_us` after the first found `hit` of `prompt`.
    pub fn add(&mut self, since_first_us: u64, prompt: u64, hit: u64) {
        let w = (since_first_us / self.window_us) as usize;
        if self.windows.len() <= w {
            self.windows.resize(w + 1, Window::default());
        }
        self.windows[w].prompt_tokens += prompt;
        self.windows[w].hit_tokens += hit;
    }

    /// Hit rate of the requests that arrived in `[from_us, to_us)` (whole windows: those
    /// that start in it); `None` when none did.
    pub fn hit_rate(&self, from_us: u64, to_us: u64) -> Option<f64> {
        let (p, h) = self.sums(from_us, to_us);
        (p > 0).then(|| h as f64 / p as f64)
    }

    fn sums(&self, from_us: u64, to_us: u64) -> (u64, u64) {
        let first = from_us.div_ceil(self.window_us) as usize;
        let end = (to_us.div_ceil(self.window_us) as usize).min(self.windows.len());
        self.windows
            .get(first..end.max(first))
            .unwrap_or_default()
            .iter()
            .fold((0, 0), |(p, h), w| (p + w.prompt_tokens, h + w.hit_tokens))
    }

    /// Each window's hit rate (`None`: nothing arrived in it).
    pub fn rates(&self) -> Vec<Option<f64>> {
        self.windows
            .iter()
            .map(|w| (w.prompt_tokens > 0).then(|| w.hit_tokens as f64 / w.prompt_tokens as f64))
            .collect()
    }
}

/// Windows the "before" hit rate spans: up to 30 s before the fault.
pub const BEFORE_US: u64 = 30_000_000;
/// The rolling hit rate that must come back: over 5 s.
pub const ROLLING_US: u64 = 5_000_000;
/// Back means within this of the reference (1 point).
pub const WITHIN: f64 = 0.01;
/// The dip is looked for from the fault until this long after it is over.
pub const HORIZON_US: u64 = 30_000_000;

/// What a fault cost one run, read from its [`Timeline`] and, when given, that of the same
/// run without the fault (same workload and seed: the same arrivals, so a window's
/// difference is the fault's doing, give or take the routing choices it changed).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FaultSummary {
    pub fault: String,
    /// When it struck, seconds from the first arrival.
    pub at_s: f64,
    /// Hit rate of the requests that arrived in the 30 s before the fault (fewer when the
    /// run had not been going that long).
    pub before: Option<f64>,
    /// The lowest hit rate of one window from the fault until 30 s after it was over, and
    /// when that window began (seconds after the fault).
    pub dip: Option<f64>,
    pub dip_at_s: Option<f64>,
    /// Seconds from the fault until the rolling hit rate (5 s) was back within 1 point of
    /// the reference for good (the end of the last rolling span below it, up to 30 s after
    /// the fault is over): the run without the fault over the same span when given, else
    /// `before`. 0 when it never fell below; `None` when it was still below 30 s after the
    /// fault was over (or at the end of the arrivals).
    pub recovered_after_s: Option<f64>,
    /// Hit rate of the requests that arrived from the fault to its recovery (at least 5 s;
    /// to the end when it did not recover): `span_s` seconds.
    pub during: Option<f64>,
    pub span_s: f64,
    /// Against the run without the fault: the largest shortfall of one window (in hit
    /// rate, 0.02 = 2 points) over the dip's windows, and when that window began (seconds
    /// after the fault).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worst: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worst_at_s: Option<f64>,
    /// The run without the fault: its hit rate before and over the same span.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub without_before: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub without_during: Option<f64>,
}

/// Reads `fault`'s cost off `timeline` (whose last window ends at the last arrival), against
/// `without`, the same run's without the fault, when given.
pub fn summarize(fault: &Fault, timeline: &Timeline, without: Option<&Timeline>) -> FaultSummary {
    let at = fault.at_us();
    let w = timeline.window_us;
    let before = timeline.hit_rate(at.saturating_sub(BEFORE_US), at);
    let first = at.div_ceil(w) as usize;
    // Windows from the fault until 30 s after it is over (or the end of the arrivals).
    let horizon = (fault.over_us().unwrap_or(at) + HORIZON_US).div_ceil(w) as usize;
    let n = timeline.windows.len().min(horizon);
    let (mut dip, mut dip_at_s) = (None, None);
    let (mut worst, mut worst_at_s) = (None, None);
    if let Some(b) = without {
        for i in first..n {
            let (lo, hi) = (i as u64 * w, (i as u64 + 1) * w);
            if let (Some(x), Some(y)) = (timeline.hit_rate(lo, hi), b.hit_rate(lo, hi)) {
                if worst.is_none_or(|d| y - x > d) {
                    worst = Some(y - x);
                    worst_at_s = Some(lo.saturating_sub(at) as f64 / 1e6);
                }
            }
        }
    }
    for (i, r) in timeline.rates().iter().enumerate().take(n).skip(first) {
        if let Some(r) = *r {
            if dip.is_none_or(|d| r < d) {
                dip = Some(r);
                dip_at_s = Some((i as u64 * w).saturating_sub(at) as f64 / 1e6);
            }
        }
    }
    // Rolling spans of ROLLING_US ending at each window's end, from the fault on.
    let span = (ROLLING_US / w).max(1) as usize;
    let mut last_below: Option<usize> = None;
    for end in first + 1..=n {
        let from = end.saturating_sub(span).max(first);
        let (lo, hi) = (from as u64 * w, end as u64 * w);
        let reference = match without {
            Some(b) => b.hit_rate(lo, hi),
            None => before,
        };
        if let (Some(now), Some(reference)) = (timeline.hit_rate(lo, hi), reference) {
            if now < reference - WITHIN {
                last_below = Some(end);
            }
        }
    }
    let recovered_after_s = match last_below {
        None => Some(0.0),
        Some(end) if end >= n => None,
        Some(end) => Some((end as u64 * w).saturating_sub(at) as f64 / 1e6),
    };
    let until = match last_below {
        None => at + ROLLING_US,
        Some(end) => (end as u64 * w).max(at + ROLLING_US),
    };
    FaultSummary {
        fault: fault.to_string(),
        at_s: at as f64 / 1e6,
        before,
        dip,
        dip_at_s,
        recovered_after_s,
        during: timeline.hit_rate(at, until),
        span_s: (until - at) as f64 / 1e6,
        worst,
        worst_at_s,
        without_before: without.and_then(|b| b.hit_rate(at.saturating_sub(BEFORE_US), at)),
        without_during: without.and_then(|b| b.hit_rate(at, until)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_with_defaults_and_options() {
        let ok = |s: &str| s.parse::<Fault>().unwrap();
        assert_eq!(
            ok("agents-lost@60s:0.125"),
            Fault::AgentsLost {
                at_us: 60_000_000,
                share: 0.125,
                back_after_us: None,
                expiry_us: DEFAULT_EXPIRY_US,
                resync_us: DEFAULT_RESYNC_US,
            }
        );
        assert_eq!(
            ok("agents-lost@1.5s:1:for=30s:expiry=500ms"),
            Fault::AgentsLost {
                at_us: 1_500_000,
                share: 1.0,
                back_after_us: Some(30_000_000),
                expiry_us: 500_000,
                resync_us: DEFAULT_RESYNC_US,
            }
        );
        assert_eq!(
            ok("router-restart@60s:router=3:catch-up=0.7s"),
            Fault::RouterRestart {
                at_us: 60_000_000,
                router: Some(3),
                catch_up_us: 700_000,
                resync_us: DEFAULT_RESYNC_US,
            }
        );
        assert_eq!(
            ok("partition@60s:0.25:for=5s"),
            Fault::Partition {
                at_us: 60_000_000,
                share: 0.25,
                for_us: 5_000_000,
                catch_up_us: DEFAULT_HEAL_CATCH_UP_US,
            }
        );
        assert_eq!(
            ok("partition@60s:0.25:for=5s").to_string(),
            "partition@60s:0.25:for=5s"
        );
    }

    #[test]
    fn bad_faults_say_what_is_wrong() {
        let err = |s: &str| s.parse::<Fault>().unwrap_err().to_string();
        for (input, says) in [
            ("agents-lost", "KIND@TIME"),
            ("meteor@60s", "unknown fault \"meteor\""),
            ("agents-lost@soon:0.1", "not a duration"),
            ("agents-lost@60:0.1", "not a duration"),
            ("agents-lost@60s", "needs one share of the hosts"),
            ("agents-lost@60s:1.5", "not a share in (0, 1]"),
            ("agents-lost@60s:0", "not a share"),
            (
                "agents-lost@60s:0.1:catch-up=1s",
                "takes no option \"catch-up\"",
            ),
            ("agents-lost@60s:0.1:for=-3s", "not a duration"),
            ("router-restart@60s:router=x", "not a router number"),
            ("router-restart@60s:0.25", "KIND@TIME"),
            ("partition@60s:0.25", "needs a duration"),
            ("partition@60s:for=5s", "needs one share of the routers"),
            ("partition@60s:0.25:for=5s:for=6s", "KIND@TIME"),
        ] {
            let e = err(input);
            assert!(e.contains(says), "{input}: {e}");
        }
        let restart = "router-restart@1s:router=4".parse::<Fault>().unwrap();
        assert_eq!(
            restart.check(4),
            Err(FaultError::NoSuchRouter {
                router: 4,
                routers: 4
            })
        );
        let cut = "partition@1s:0.5:for=1s".parse::<Fault>().unwrap();
        assert_eq!(cut.check(1), Err(FaultError::PartitionOfOne));
        assert_eq!(cut.check(2), Ok(()));
    }

    #[test]
    fn shares_round_up_and_leave_a_majority() {
        assert_eq!(Fault::hosts_lost(0.125, 1000), 125);
        assert_eq!(Fault::hosts_lost(0.001, 10), 1);
        assert_eq!(Fault::hosts_lost(1.0, 10), 10);
        assert_eq!(Fault::routers_cut(0.25, 128), 32);
        assert_eq!(Fault::routers_cut(0.25, 2), 1);
        assert_eq!(Fault::routers_cut(1.0, 8), 7);
    }

    /// A timeline of 1-s windows with these hit rates (100 tokens each).
    fn timeline(rates: &[f64]) -> Timeline {
        let mut t = Timeline::new(1_000_000);
        for (i, r) in rates.iter().enumerate() {
            t.add(i as u64 * 1_000_000 + 10, 100, (r * 100.0).round() as u64);
        }
        t
    }

    #[test]
    fn a_summary_reads_before_the_dip_and_the_recovery() {
        let fault: Fault = "partition@10s:0.25:for=2s".parse().unwrap();
        // 10 s at 0.8, a dip to 0.5 at 11 s, back to 0.8 from 14 s.
        let mut rates = vec![0.8; 10];
        rates.extend([0.7, 0.5, 0.6, 0.7]);
        rates.extend(vec![0.8; 20]);
        let s = summarize(&fault, &timeline(&rates), None);
        assert_eq!(s.before, Some(0.8));
        assert_eq!((s.dip, s.dip_at_s), (Some(0.5), Some(1.0)));
        // Rolling 5 s spans ending at 11 s..18 s hold a window below 0.8 and average below
        // 0.79; the one ending at 19 s (14..19) is the first all back.
        assert_eq!(s.recovered_after_s, Some(8.0));
        let never = summarize(&fault, &timeline(&[0.8; 30]), None);
        assert_eq!(never.recovered_after_s, Some(0.0));
        // A window below 30 s after the fault was over (13 s) is no longer its doing.
        let mut late = rates.clone();
        late.extend(vec![0.8; 30]);
        late[50] = 0.5;
        assert_eq!(late.len(), 64);
        let s = summarize(&fault, &timeline(&late), None);
        assert_eq!((s.dip, s.recovered_after_s), (Some(0.5), Some(8.0)));
        assert_eq!(s.dip_at_s, Some(1.0));
        let still_down = summarize(
            &fault,
            &timeline(&[0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.5, 0.5]),
            None,
        );
        assert_eq!(still_down.recovered_after_s, None);
    }

    #[test]
    fn against_the_run_without_the_fault_drift_is_not_a_cost() {
        let fault: Fault = "router-restart@10s".parse().unwrap();
        // The workload's hit rate climbs from 0.6 to 0.9; the fault costs 0.2 at 10-11 s.
        let base: Vec<f64> = (0..30).map(|i| 0.6 + 0.01 * f64::from(i)).collect();
        let mut hit = base.clone();
        hit[10] -= 0.2;
        hit[11] -= 0.2;
        let s = summarize(&fault, &timeline(&hit), Some(&timeline(&base)));
        // Rolling spans ending at 11..16 s hold a hit window; 12..17 s is the first clear.
        assert_eq!(s.recovered_after_s, Some(6.0));
        assert_eq!((s.dip, s.dip_at_s), (Some(0.5), Some(0.0)));
        assert!(s.without_during.unwrap() - s.during.unwrap() > 0.05);
        let worst = s.worst.unwrap();
        assert!(
            (worst - 0.2).abs() < 1e-9 && s.worst_at_s == Some(0.0),
            "{s:?}"
        );
        // Against `before` alone, the climb would hide it from 14 s on.
        let alone = summarize(&fault, &timeline(&hit), None);
        assert!(alone.recovered_after_s < s.recovered_after_s, "{alone:?}");
        let same = summarize(&fault, &timeline(&base), Some(&timeline(&base)));
        assert_eq!(same.recovered_after_s, Some(0.0));
    }
}
