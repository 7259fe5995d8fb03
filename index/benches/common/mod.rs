//! What the index benchmarks share: the workload of an index at 1M blocks.

use warmpath_index::keys::BlockKey;
use warmpath_index::rng::Rng;

/// Prompts in the index: 32,768 of 32 blocks (1,048,576 blocks).
pub const PROMPTS: usize = 32_768;
pub const BLOCKS: usize = 32;

/// [`PROMPTS`] prompts of [`BLOCKS`] random keys; a quarter start with one of 256
/// eight-block system prompts, so shared nodes exist.
pub fn prompts(seed: u64) -> Vec<Vec<BlockKey>> {
    let mut rng = Rng::new(seed);
    let systems: Vec<Vec<BlockKey>> = (0..256)
        .map(|_| (0..8).map(|_| BlockKey(rng.next_u64())).collect())
        .collect();
    (0..PROMPTS)
        .map(|p| {
            let mut keys = if p.is_multiple_of(4) {
                systems[rng.below(256) as usize].clone()
            } else {
                Vec::new()
            };
            while keys.len() < BLOCKS {
                keys.push(BlockKey(rng.next_u64()));
            }
            keys
        })
        .collect()
}
