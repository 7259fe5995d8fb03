//! The checkers: each reads the recorded [`History`] only, and says pass, fail (with the
//! operations that show it) or skipped (the scenario did not exercise it).

pub mod linear;

use crate::history::{History, Op, Outcome, F};
use std::collections::{BTreeMap, BTreeSet};

/// One checker's verdict.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    pub name: &'static str,
    /// `None`: not exercised by this scenario.
    pub pass: Option<bool>,
    pub summary: String,
    /// The operations or samples that show a failure (at most a few dozen).
    pub details: Vec<String>,
}

impl Check {
    fn new(name: &'static str, failures: Vec<String>, summary: String) -> Check {
        Check {
            name,
            pass: Some(failures.is_empty()),
            summary,
            details: failures.into_iter().take(40).collect(),
        }
    }
    fn skipped(name: &'static str, why: &str) -> Check {
        Check {
            name,
            pass: None,
            summary: why.to_string(),
            details: Vec::new(),
        }
    }
}

/// What a scenario promises, and so what is checked.
#[derive(Debug, Clone, Copy)]
pub struct Expect {
    /// The register's value before the history began.
    pub initial: u64,
    /// How long after its invocation an unanswered write may still take effect, ms.
    pub write_bound_ms: f64,
    /// Writes through routers no fault touches succeed within this of the operation's
    /// start or the last fault event, ms (`None`: not checked).
    pub healthy_write_within_ms: Option<f64>,
    /// A cut-off leader must say it lost its quorum within this, ms.
    pub cut_off_leader_says_so_ms: Option<f64>,
    /// Longest time the group may go without a leader, ms.
    pub leaderless_at_most_ms: Option<f64>,
    /// Every routed request answers within this, ms.
    pub route_within_ms: Option<f64>,
    /// A rate-limited tenant's admitted requests per second, at most, over the whole run.
    pub rate_limit: Option<RateLimit>,
}

#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    pub rps: f64,
    /// The documented factor the limit may be exceeded by under a partition.
    pub factor: f64,
}

/// How a nemesis that could not inject its fault says so in the history.
pub const NEMESIS_ERROR: &str = "note nemesis error: ";

/// Every checker, in report order.
pub fn all(h: &History, e: &Expect) -> Vec<Check> {
    vec![
        faults_injected(h),
        linearizable(h, e),
        lost_writes(h),
        not_applied_invisible(h),
        unknown_creates_settle(h, e),
        converged(h),
        gossip_reconverged(h),
        residency_followed(h),
        healthy_writes(h, e),
        cut_off_leader(h, e),
        leaderless(h, e),
        routes_accounted(h, e),
        rate_limited(h, e),
    ]
}

/// The nemesis injected its fault: a scenario whose fault failed to start checked nothing
/// about it, and must not pass as if it had.
fn faults_injected(h: &History) -> Check {
    let name = "the nemesis injected its faults";
    let failures: Vec<String> = h
        .faults
        .iter()
        .filter(|f| f.what.starts_with(NEMESIS_ERROR))
        .map(|f| format!("at {:.1} s: {}", f.at_ms / 1e3, f.what))
        .collect();
    let started = h.faults.iter().filter(|f| f.begins).count();
    Check::new(name, failures, format!("{started} faults started"))
}

fn show(o: &Op) -> String {
    format!(
        "{:?} {} via router {} [{:.0}–{:.0} ms] {:?}: {}",
        o.f,
        o.value.map_or("-".into(), |v| v.to_string()),
        o.node + 1,
        o.invoke_ms,
        o.complete_ms,
        o.outcome,
        o.detail
    )
}

/// The register (tenant `reg`'s `prefix_length`) is linearizable.
fn linearizable(h: &History, e: &Expect) -> Check {
    let name = "linearizable register";
    let mut ops = Vec::new();
    for (i, o) in h.ops.iter().enumerate() {
        let kind = match (o.f, o.outcome) {
            (F::Read, Outcome::Ok) => linear::Kind::Read(o.value),
            (F::Write, Outcome::Ok | Outcome::Info) => linear::Kind::Write(o.value.unwrap_or(0)),
            _ => continue,
        };
        let optional = o.outcome == Outcome::Info;
        ops.push(linear::RegOp {
            id: i,
            call: o.invoke_ms,
            ret: if optional {
                o.invoke_ms + e.write_bound_ms
            } else {
                o.complete_ms
            },
            kind,
            optional,
        });
    }
    if ops.is_empty() {
        return Check::skipped(name, "no register operations");
    }
    let summary = format!(
        "{} operations ({} unanswered writes, each may take effect up to {:.0} ms after its call)",
        ops.len(),
        ops.iter().filter(|o| o.optional).count(),
        e.write_bound_ms
    );
    match linear::check(&ops, Some(e.initial), 20_000_000) {
        linear::Verdict::Linearizable => Check::new(name, vec![], summary),
        linear::Verdict::NotLinearizable {
            stuck,
            state,
            placed,
        } => {
            let o = &h.ops[stuck];
            Check::new(
                name,
                vec![format!(
                    "no order places {} (after {placed} placed, the register held {state:?})",
                    show(o)
                )],
                summary,
            )
        }
        linear::Verdict::Unknown { steps } => Check {
            name,
            pass: None,
            summary: format!("{summary}; search gave up after {steps} steps"),
            details: Vec::new(),
        },
    }
}

/// The final reads of one kind (`linearizable`, `residency`, `gossip`), per router.
fn finals<'h>(h: &'h History, kind: &str) -> Vec<&'h Op> {
    h.ops
        .iter()
        .filter(|o| o.f == F::FinalRead && o.detail == kind)
        .collect()
}

/// The final linearizable reads that answered, per router: the tenant ids seen.
fn final_reads(h: &History) -> Vec<&Op> {
    let mut reads = finals(h, "linearizable");
    reads.retain(|o| o.outcome == Outcome::Ok);
    reads
}

/// Every tenant whose creation was acknowledged is in every router's final read.
fn lost_writes(h: &History) -> Check {
    let name = "no acknowledged write lost";
    let finals = final_reads(h);
    if finals.is_empty() {
        return Check::new(
            name,
            vec!["no router answered a final read".into()],
            String::new(),
        );
    }
    let acked: Vec<&Op> = h
        .ops
        .iter()
        .filter(|o| o.f == F::Create && o.outcome == Outcome::Ok)
        .collect();
    let mut lost = Vec::new();
    for f in &finals {
        let ids: BTreeSet<&str> = f
            .seen
            .iter()
            .flat_map(|s| s.0.iter())
            .map(String::as_str)
            .collect();
        for o in &acked {
            if !ids.contains(set_id(o.value.unwrap_or(0)).as_str()) {
                lost.push(format!("router {} lost {}", f.node + 1, show(o)));
            }
        }
    }
    let summary = format!(
        "{} acknowledged creates, {} final reads",
        acked.len(),
        finals.len()
    );
    Check::new(name, lost, summary)
}

/// The tenant id of set element `v`.
pub fn set_id(v: u64) -> String {
    format!("js{v:08}")
}

/// No write answered "not applied" is visible later, and nothing never written is.
fn not_applied_invisible(h: &History) -> Check {
    let name = "no refused write visible";
    let finals = final_reads(h);
    let mut tried: BTreeMap<String, &Op> = BTreeMap::new();
    for o in h.ops.iter().filter(|o| o.f == F::Create) {
        tried.insert(set_id(o.value.unwrap_or(0)), o);
    }
    let mut bad = Vec::new();
    for f in &finals {
        for id in f.seen.iter().flat_map(|s| s.0.iter()) {
            if !id.starts_with("js") {
                continue;
            }
            match tried.get(id) {
                Some(o) if o.outcome == Outcome::Fail => bad.push(format!(
                    "router {} shows {id}, answered {}",
                    f.node + 1,
                    show(o)
                )),
                None => bad.push(format!(
                    "router {} shows {id}, which no client wrote",
                    f.node + 1
                )),
                _ => {}
            }
        }
    }
    let refused = tried
        .values()
        .filter(|o| o.outcome == Outcome::Fail)
        .count();
    Check::new(
        name,
        bad,
        format!("{refused} creates answered as not applied"),
    )
}

/// After the faults heal, every router serves the same tenants with the same content at
/// the same version (its local state, not only its version number).
fn converged(h: &History) -> Check {
    let name = "routers converge (content)";
    let locals: Vec<&Op> = h
        .ops
        .iter()
        .filter(|o| o.f == F::FinalRead && o.detail.starts_with("local"))
        .collect();
    if locals.is_empty() {
        return Check::new(name, vec!["no final local reads".into()], String::new());
    }
    let mut bad = Vec::new();
    let first = locals[0];
    for o in &locals {
        if o.outcome != Outcome::Ok {
            bad.push(format!(
                "router {} did not answer its final read: {}",
                o.node + 1,
                o.detail
            ));
        } else if o.detail != first.detail || o.seen != first.seen {
            bad.push(format!(
                "router {} serves {} (version {:?}) where router {} serves {} (version {:?})",
                o.node + 1,
                o.detail,
                o.seen.as_ref().map(|s| s.1),
                first.node + 1,
                first.detail,
                first.seen.as_ref().map(|s| s.1)
            ));
        }
    }
    Check::new(name, bad, format!("{} routers compared", locals.len()))
}

/// A creation answered "unknown" takes effect within its bound or never: once a
/// linearizable read invoked after the bound misses it, no later read may show it (issue
/// 12, defect 2: a 504'd write, read as absent, applied seconds after the heal).
fn unknown_creates_settle(h: &History, e: &Expect) -> Check {
    let name = "unknown writes settle within their bound";
    let reads: Vec<&Op> = h
        .ops
        .iter()
        .filter(|o| matches!(o.f, F::SetRead | F::FinalRead) && o.outcome == Outcome::Ok)
        .filter(|o| o.f == F::SetRead || o.detail == "linearizable")
        .collect();
    // Ids in a read are sorted (the API's map is ordered; set reads sort them).
    let has = |r: &Op, id: &str| {
        r.seen
            .as_ref()
            .is_some_and(|s| s.0.binary_search_by(|x| x.as_str().cmp(id)).is_ok())
    };
    let mut bad = Vec::new();
    let unknown: Vec<&Op> = h
        .ops
        .iter()
        .filter(|o| o.f == F::Create && o.outcome == Outcome::Info)
        .collect();
    for c in &unknown {
        let id = set_id(c.value.unwrap_or(0));
        let bound = c.invoke_ms + e.write_bound_ms;
        let Some(miss) = reads.iter().find(|r| r.invoke_ms > bound && !has(r, &id)) else {
            continue;
        };
        if let Some(late) = reads
            .iter()
            .find(|r| r.invoke_ms > miss.complete_ms && has(r, &id))
        {
            bad.push(format!(
                "{id} ({}) absent from a read at {:.1} s, present in one at {:.1} s",
                show(c),
                miss.invoke_ms / 1e3,
                late.invoke_ms / 1e3
            ));
        }
    }
    Check::new(
        name,
        bad,
        format!(
            "{} unknown creates, {} set reads, bound {:.0} ms",
            unknown.len(),
            reads.len(),
            e.write_bound_ms
        ),
    )
}

/// With the cache tier, every router heard residency changes from the agents (the tier
/// was exercised, and killing an agent or Redis did not stop it).
fn residency_followed(h: &History) -> Check {
    let name = "routers follow the cache-agents";
    let views = finals(h, "residency");
    if views.is_empty() {
        return Check::skipped(name, "no cache tier in this scenario");
    }
    let bad = views
        .iter()
        .filter(|o| o.outcome != Outcome::Ok || o.value.unwrap_or(0) == 0)
        .map(|o| {
            format!(
                "router {}: {:?} residency changes heard",
                o.node + 1,
                o.value
            )
        })
        .collect();
    let counts: Vec<u64> = views.iter().filter_map(|o| o.value).collect();
    Check::new(
        name,
        bad,
        format!("residency changes heard per router: {counts:?}"),
    )
}

/// After the heal every router's gossip lists every other router as a live peer.
fn gossip_reconverged(h: &History) -> Check {
    let name = "gossip reconverges";
    let views = finals(h, "gossip");
    let routers = views.len() as u64;
    let bad = views
        .iter()
        .filter(|o| o.value.unwrap_or(0) + 1 < routers)
        .map(|o| {
            format!(
                "router {} sees peers {:?} after {:.1} s",
                o.node + 1,
                o.seen.as_ref().map(|s| &s.0),
                (o.complete_ms - o.invoke_ms) / 1e3
            )
        })
        .collect();
    Check::new(
        name,
        bad,
        format!("{routers} routers' peer lists after the heal"),
    )
}

/// The routers a fault touched at any time within `[from, to]`.
fn touched(h: &History, from: f64, to: f64) -> BTreeSet<usize> {
    let mut active: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for f in &h.faults {
        if f.at_ms > to {
            break;
        }
        let key = f.what.split_whitespace().nth(1).unwrap_or("").to_string();
        if f.begins {
            active.insert(key, f.nodes.clone());
            if f.at_ms >= from {
                out.extend(f.nodes.iter().copied());
            }
        } else if let Some(nodes) = active.remove(&key) {
            if f.at_ms >= from {
                out.extend(nodes);
            }
        }
    }
    for nodes in active.values() {
        out.extend(nodes.iter().copied());
    }
    out
}

/// How long after a fault ends its routers count as rejoining, ms.
const REJOIN_MS: f64 = 1_000.0;

/// Writes through routers no fault touched succeed within the budget of their start or
/// the last fault event (issue 12, defect 3: 3 s).
fn healthy_writes(h: &History, e: &Expect) -> Check {
    let name = "writes through the majority succeed in time";
    let Some(budget) = e.healthy_write_within_ms else {
        return Check::skipped(name, "not promised under this scenario's faults");
    };
    let mut bad = Vec::new();
    let mut n = 0;
    for o in h.ops.iter().filter(|o| matches!(o.f, F::Write | F::Create)) {
        // A router a fault touched up to a second before is still rejoining (a leader
        // cut off until the heal learns the new term from the next heartbeat); it is not
        // the majority the target speaks of.
        if touched(h, o.invoke_ms - REJOIN_MS, o.complete_ms).contains(&o.node) {
            continue;
        }
        n += 1;
        let last_event = h
            .faults
            .iter()
            .map(|f| f.at_ms)
            .filter(|&t| t <= o.complete_ms)
            .fold(o.invoke_ms, f64::max);
        let late = o.complete_ms - last_event;
        if o.outcome != Outcome::Ok || late > budget {
            bad.push(format!(
                "{:.0} ms after its start or the last fault: {}",
                late,
                show(o)
            ));
        }
    }
    Check::new(
        name,
        bad,
        format!("{n} writes through untouched routers, budget {budget:.0} ms"),
    )
}

/// A leader cut off from its quorum says so (issue 12, defect 7).
fn cut_off_leader(h: &History, e: &Expect) -> Check {
    let name = "a cut-off leader says so";
    let Some(grace) = e.cut_off_leader_says_so_ms else {
        return Check::skipped(name, "no partition in this scenario");
    };
    let mut bad = Vec::new();
    let mut cut = 0;
    for s in &h.status {
        let Some(since) = isolated_since(h, s.node, s.at_ms) else {
            continue;
        };
        cut += 1;
        if s.role.as_deref() == Some("Leader") && !s.quorum_lost && s.at_ms - since > grace {
            bad.push(format!(
                "router {} reported itself leader with its quorum, {:.0} ms into its isolation",
                s.node + 1,
                s.at_ms - since
            ));
        }
    }
    Check::new(
        name,
        bad,
        format!("{cut} status samples of cut-off routers, grace {grace:.0} ms"),
    )
}

/// When router `node` was cut off by the partition active at `at`, if it is.
fn isolated_since(h: &History, node: usize, at: f64) -> Option<f64> {
    let mut since = None;
    for f in h
        .faults
        .iter()
        .filter(|f| f.at_ms <= at && f.what.contains("partition"))
    {
        if f.begins && f.nodes.contains(&node) {
            since = Some(f.at_ms);
        } else if !f.begins {
            since = None;
        }
    }
    since
}

/// The longest stretch with no router reporting a leader that has its quorum.
fn leaderless(h: &History, e: &Expect) -> Check {
    let name = "elections settle";
    let Some(limit) = e.leaderless_at_most_ms else {
        return Check::skipped(name, "not measured in this scenario");
    };
    // Each router's latest answer holds until its next; a moment is led when some
    // router's latest answer says it leads with its quorum.
    let mut samples: Vec<_> = h.status.iter().collect();
    samples.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let mut latest: BTreeMap<usize, bool> = BTreeMap::new();
    let (mut worst, mut worst_at, mut since) = (0.0f64, 0.0f64, None::<f64>);
    for s in &samples {
        latest.insert(
            s.node,
            s.role.as_deref() == Some("Leader") && !s.quorum_lost,
        );
        let led = latest.values().any(|&l| l);
        match (led, since) {
            (false, None) => since = Some(s.at_ms),
            (true, Some(from)) => {
                if s.at_ms - from > worst {
                    (worst, worst_at) = (s.at_ms - from, from);
                }
                since = None;
            }
            _ => {}
        }
    }
    if let (Some(from), Some(last)) = (since, samples.last()) {
        if last.at_ms - from > worst {
            (worst, worst_at) = (last.at_ms - from, from);
        }
    }
    let bad = if worst > limit {
        vec![format!(
            "no leader with a quorum for {worst:.0} ms from {:.1} s",
            worst_at / 1e3
        )]
    } else {
        vec![]
    };
    Check::new(
        name,
        bad,
        format!("longest leaderless stretch {worst:.0} ms, limit {limit:.0} ms"),
    )
}

/// Every routed request through a router no fault touched was answered, or failed with a
/// clear error, in time; none hung or vanished.
fn routes_accounted(h: &History, e: &Expect) -> Check {
    let name = "routed requests accounted for";
    let routes: Vec<&Op> = h.ops.iter().filter(|o| o.f == F::Route).collect();
    if routes.is_empty() {
        return Check::skipped(name, "no routing clients in this scenario");
    }
    let limit = e.route_within_ms.unwrap_or(f64::INFINITY);
    let mut bad = Vec::new();
    // A router a fault touched (killed, paused, restarted) is one a load balancer routes
    // around: what its clients saw then is the balancer's business, not a lost request.
    let routes: Vec<&Op> = routes
        .into_iter()
        .filter(|o| !touched(h, o.invoke_ms, o.complete_ms).contains(&o.node))
        .collect();
    for o in &routes {
        let slow = o.complete_ms - o.invoke_ms > limit;
        if o.outcome == Outcome::Info || slow {
            bad.push(show(o));
        }
    }
    let ok = routes.iter().filter(|o| o.outcome == Outcome::Ok).count();
    let failed = routes.iter().filter(|o| o.outcome == Outcome::Fail).count();
    Check::new(
        name,
        bad,
        format!(
            "{} requests: {ok} answered, {failed} clear errors, limit {limit:.0} ms",
            routes.len()
        ),
    )
}

/// A rate-limited tenant was admitted at most the documented factor over its limit.
fn rate_limited(h: &History, e: &Expect) -> Check {
    let name = "rate limit held cluster-wide";
    let Some(limit) = e.rate_limit else {
        return Check::skipped(name, "no rate-limited tenant in this scenario");
    };
    let limited: Vec<&Op> = h.ops.iter().filter(|o| o.f == F::Limited).collect();
    let (Some(first), Some(last)) = (
        limited.iter().map(|o| o.invoke_ms).reduce(f64::min),
        limited.iter().map(|o| o.complete_ms).reduce(f64::max),
    ) else {
        return Check::skipped(name, "no requests for the limited tenant");
    };
    let secs = (last - first) / 1e3;
    let admitted = limited.iter().filter(|o| o.outcome == Outcome::Ok).count() as f64;
    // One second's burst on top of the rate, times the factor.
    let allowed = limit.factor * limit.rps * (secs + 1.0);
    let bad = if admitted > allowed {
        vec![format!(
            "{admitted:.0} admitted in {secs:.1} s at {} rps (allowed {allowed:.0}: factor {} with one second of burst)",
            limit.rps, limit.factor
        )]
    } else {
        vec![]
    };
    Check::new(
        name,
        bad,
        format!(
            "{admitted:.0} of {} admitted in {secs:.1} s at {} rps, factor {}",
            limited.len(),
            limit.rps,
            limit.factor
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Fault;

    fn op(f: F, node: usize, value: Option<u64>, span: (f64, f64), outcome: Outcome) -> Op {
        Op {
            process: node,
            node,
            f,
            value,
            invoke_ms: span.0,
            complete_ms: span.1,
            outcome,
            detail: String::new(),
            seen: None,
        }
    }

    fn set_read(at: f64, ids: &[u64]) -> Op {
        let mut o = op(F::SetRead, 0, None, (at, at + 5.0), Outcome::Ok);
        o.seen = Some((ids.iter().map(|&v| set_id(v)).collect(), 0));
        o
    }

    fn expect() -> Expect {
        Expect {
            initial: 1,
            write_bound_ms: 10_000.0,
            healthy_write_within_ms: Some(3_000.0),
            cut_off_leader_says_so_ms: Some(3_000.0),
            leaderless_at_most_ms: Some(5_000.0),
            route_within_ms: Some(10_000.0),
            rate_limit: Some(RateLimit {
                rps: 10.0,
                factor: 1.0,
            }),
        }
    }

    fn verdict(c: Check) -> Option<bool> {
        c.pass
    }

    #[test]
    fn an_unknown_create_may_appear_within_its_bound_not_after_a_miss() {
        let create = op(F::Create, 0, Some(7), (0.0, 5_000.0), Outcome::Info);
        // Seen before its bound: fine.
        let h = History {
            ops: vec![
                create.clone(),
                set_read(6_000.0, &[7]),
                set_read(20_000.0, &[7]),
            ],
            ..History::default()
        };
        assert_eq!(verdict(unknown_creates_settle(&h, &expect())), Some(true));
        // Never seen: fine (it did not take effect).
        let h = History {
            ops: vec![
                create.clone(),
                set_read(12_000.0, &[]),
                set_read(20_000.0, &[]),
            ],
            ..History::default()
        };
        assert_eq!(verdict(unknown_creates_settle(&h, &expect())), Some(true));
        // Missed after its bound, seen later: applied late (defect 2).
        let h = History {
            ops: vec![create, set_read(12_000.0, &[]), set_read(20_000.0, &[7])],
            ..History::default()
        };
        assert_eq!(verdict(unknown_creates_settle(&h, &expect())), Some(false));
    }

    #[test]
    fn writes_through_untouched_routers_must_succeed_in_time() {
        let fault = |at: f64, what: &str, begins: bool| Fault {
            at_ms: at,
            what: what.into(),
            nodes: vec![2],
            begins,
        };
        let faults = vec![
            fault(1_000.0, "start pause router 3", true),
            fault(9_000.0, "stop pause router 3", false),
        ];
        // Router 1 stalls 5 s during router 3's pause: a failure. Router 3's own stall
        // is the fault's.
        let h = History {
            ops: vec![
                op(F::Write, 0, Some(2), (1_100.0, 6_100.0), Outcome::Info),
                op(F::Write, 2, Some(3), (1_100.0, 6_100.0), Outcome::Info),
            ],
            faults: faults.clone(),
            ..History::default()
        };
        let c = healthy_writes(&h, &expect());
        assert_eq!(c.pass, Some(false));
        assert_eq!(c.details.len(), 1, "{:?}", c.details);
        // Within 3 s of the fault's start: fine.
        let h = History {
            ops: vec![op(F::Write, 0, Some(2), (1_100.0, 3_500.0), Outcome::Ok)],
            faults,
            ..History::default()
        };
        assert_eq!(verdict(healthy_writes(&h, &expect())), Some(true));
    }

    #[test]
    fn a_rate_limit_is_held_to_its_rate_and_one_second_of_burst() {
        let limited = |n: usize| History {
            ops: (0..n)
                .map(|i| op(F::Limited, i % 3, None, (i as f64, 10_000.0), Outcome::Ok))
                .collect(),
            ..History::default()
        };
        // 10 s at 10/s plus a second of burst: 110.
        assert_eq!(verdict(rate_limited(&limited(110), &expect())), Some(true));
        assert_eq!(verdict(rate_limited(&limited(111), &expect())), Some(false));
    }

    #[test]
    fn lost_and_phantom_creates_are_found_in_the_final_reads() {
        let mut final_read = op(F::FinalRead, 1, None, (30_000.0, 30_000.0), Outcome::Ok);
        final_read.detail = "linearizable".into();
        final_read.seen = Some((vec![set_id(2), set_id(9)], 10));
        let h = History {
            ops: vec![
                op(F::Create, 0, Some(1), (0.0, 10.0), Outcome::Ok),
                op(F::Create, 0, Some(2), (20.0, 30.0), Outcome::Fail),
                final_read,
            ],
            ..History::default()
        };
        // js00000001 acknowledged and missing; js00000002 refused and present; js00000009
        // never written.
        assert_eq!(verdict(lost_writes(&h)), Some(false));
        assert_eq!(not_applied_invisible(&h).details.len(), 2);
    }
}
