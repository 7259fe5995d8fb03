//! Which routers follow an agent when not every router follows every agent (decision
//! 0105): rendezvous hashing of (agent, router) over the live routers, the top `f` win.
//! Pure and deterministic: every router and agent computes the same set from the same
//! membership, and a router joining or leaving moves only the agents whose top `f` it
//! enters or leaves. Routers choose with it (`--residency-followers`, record 0111), and the
//! simulator's feed too (`simulate --residency-followers`).

use warmpath_index::rng::mix64;

/// FNV-1a of `s`, then splitmix64: a stable 64-bit name for a node.
fn name_hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// The routers of `routers` (by name) that follow `agent`: the `f` with the highest
/// rendezvous weight, highest first (all of them when there are at most `f`). Duplicate
/// names count once.
pub fn followers<'a>(agent: &str, routers: &[&'a str], f: usize) -> Vec<&'a str> {
    let a = name_hash(agent);
    let mut weighted: Vec<(u64, &'a str)> = routers
        .iter()
        .map(|r| (mix64(a ^ name_hash(r)), *r))
        .collect();
    weighted.sort_unstable_by(|x, y| y.cmp(x));
    weighted.dedup_by(|x, y| x.1 == y.1);
    weighted.into_iter().take(f).map(|(_, r)| r).collect()
}

/// Whether `router` is among `agent`'s followers (see [`followers`]).
pub fn follows(router: &str, agent: &str, routers: &[&str], f: usize) -> bool {
    followers(agent, routers, f).contains(&router)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}-{i}")).collect()
    }

    #[test]
    fn every_agent_gets_f_followers_and_load_spreads() {
        let routers = names("router", 128);
        let r: Vec<&str> = routers.iter().map(String::as_str).collect();
        let agents = names("agent", 1000);
        let mut per_router = std::collections::HashMap::new();
        for a in &agents {
            let f = followers(a, &r, 4);
            assert_eq!(f.len(), 4);
            for x in f {
                *per_router.entry(x).or_insert(0usize) += 1;
            }
        }
        // 4 × 1000 / 128 ≈ 31 agents per router on average.
        let max = per_router.values().copied().max().unwrap_or(0);
        assert_eq!(per_router.values().sum::<usize>(), 4000);
        assert!(max <= 60, "most agents on one router: {max}");
    }

    #[test]
    fn a_router_leaving_moves_only_its_agents() {
        let routers = names("router", 32);
        let all: Vec<&str> = routers.iter().map(String::as_str).collect();
        let fewer: Vec<&str> = all.iter().copied().filter(|r| *r != "router-7").collect();
        for a in names("agent", 300) {
            let before = followers(&a, &all, 3);
            let after = followers(&a, &fewer, 3);
            if !before.contains(&"router-7") {
                assert_eq!(before, after, "{a} moved without cause");
            } else {
                let kept: Vec<&str> = before.into_iter().filter(|r| *r != "router-7").collect();
                assert_eq!(&after[..2], &kept[..], "{a} reordered its other followers");
            }
        }
    }

    #[test]
    fn small_sets_and_duplicates() {
        assert_eq!(followers("a", &[], 4), Vec::<&str>::new());
        assert_eq!(followers("a", &["r1", "r1"], 4), vec!["r1"]);
        assert_eq!(followers("a", &["r1", "r2"], 4).len(), 2);
        assert!(follows("r1", "a", &["r1"], 1));
    }
}
