//! Hit-rate bounds of a workload, to judge a policy's hit rate against.
//!
//! - *Ideal*: one prefix cache with infinite capacity, no eviction and no routing loss: a
//!   request's hit is the longest prefix of its blocks seen in any earlier request.
//! - *Pooled*: one prefix cache holding the fleet's whole GPU capacity, with LRU eviction
//!   of blocks (a block is used when it is hit or stored). No router can do better than a
//!   cache that pools every instance's memory, short of larger memory.
//!
//! Both are token-weighted: hit tokens (whole blocks) over prompt tokens.

use crate::workload::Workload;
use warmpath_tiers::BlockLru;

/// Token-weighted hit ratio with an infinite cache.
pub fn ideal_hit_rate(workload: &Workload) -> f64 {
    let (matched, _) = workload.ideal_matches();
    let hit: u64 = matched
        .iter()
        .map(|&m| u64::from(m) * u64::from(workload.block_tokens))
        .sum();
    let total: u64 = workload
        .requests
        .iter()
        .map(|r| u64::from(r.prompt_tokens))
        .sum();
    ratio(hit, total)
}

/// Token-weighted hit ratio of one LRU prefix cache of `capacity_blocks` blocks.
pub fn pooled_hit_rate(workload: &Workload, capacity_blocks: u64) -> f64 {
    let mut cache = BlockLru::new(capacity_blocks);
    let mut evicted = Vec::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in &workload.requests {
        let matched = r.keys.iter().take_while(|k| cache.contains(**k)).count() as u64;
        hit += matched * u64::from(workload.block_tokens);
        total += u64::from(r.prompt_tokens);
        for k in &r.keys {
            cache.insert(*k, &mut evicted);
        }
        evicted.clear();
    }
    ratio(hit, total)
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Request;
    use warmpath_index::keys::BlockKey;

    fn workload(prompts: &[&[u64]]) -> Workload {
        let requests = prompts
            .iter()
            .enumerate()
            .map(|(i, ks)| Request {
                id: i as u64,
                arrival_us: i as u64,
                tenant: 0,
                keys: ks.iter().map(|&k| BlockKey(k)).collect(),
                prompt_tokens: 10 * ks.len() as u32,
                output_tokens: 1,
            })
            .collect();
        Workload {
            name: "t".into(),
            block_tokens: 10,
            requests,
        }
    }

    #[test]
    fn bounds_cases() {
        let w = workload(&[&[1, 2, 3], &[1, 2, 4], &[5], &[1, 2, 3]]);
        // Hits: 0 + 2 + 0 + 3 blocks of 10 blocks.
        assert_eq!(ideal_hit_rate(&w), 0.5);
        assert_eq!(pooled_hit_rate(&w, 1000), 0.5);
        // With 3 blocks: after [5], the cache holds 2, 4, 5 (1 was least recently used).
        assert_eq!(pooled_hit_rate(&w, 3), 0.2);
        assert_eq!(pooled_hit_rate(&w, 0), 0.0);
        assert_eq!(ideal_hit_rate(&workload(&[])), 0.0);
    }
}
