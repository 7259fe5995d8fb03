//! What the router reads of its engines besides their answers: the GPU KV capacity,
//! from the Prometheus text an engine serves on `/metrics`.
//!
//! - vLLM (and `warmpath engine-sim`): `vllm:cache_config_info`, a gauge whose labels carry
//!   the cache configuration; capacity = `num_gpu_blocks` × `block_size` tokens.
//! - SGLang: `sglang:max_total_num_tokens`, the token capacity of its KV pool.
//!
//! Without either, the capacity stays unknown and kv-aware routing does not price
//! evictions for that instance.

/// The GPU KV capacity in tokens that `metrics` (Prometheus text) reports, if any.
pub fn kv_capacity_tokens(metrics: &str) -> Option<u64> {
    for line in metrics.lines() {
        if let Some(rest) = line.strip_prefix("vllm:cache_config_info{") {
            let labels = rest.split_once('}')?.0;
            let blocks: u64 = label(labels, "num_gpu_blocks")?.parse().ok()?;
            let size: u64 = label(labels, "block_size")?.parse().ok()?;
            return blocks.checked_mul(size).filter(|&t| t > 0);
        }
        if let Some(rest) = line.strip_prefix("sglang:max_total_num_tokens") {
            let value = rest.rsplit(' ').next()?;
            let tokens = value.parse::<f64>().ok()?;
            return (tokens.is_finite() && tokens >= 1.0).then_some(tokens as u64);
        }
    }
    None
}

/// The value of label `name` in `a="1",b="2"` (values without escaped quotes).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_cases() {
        let cases: &[(&str, Option<u64>)] = &[
            (
                "# HELP x\nvllm:cache_config_info{model_name=\"m\",block_size=\"16\",num_gpu_blocks=\"1000\",enable_prefix_caching=\"True\"} 1\n",
                Some(16_000),
            ),
            (
                "sglang:max_total_num_tokens{model_name=\"m\"} 500000.0\n",
                Some(500_000),
            ),
            ("vllm:cache_config_info{block_size=\"16\"} 1\n", None),
            ("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n", None),
            ("vllm:num_requests_running 3\n", None),
            ("", None),
        ];
        for (text, want) in cases {
            assert_eq!(kv_capacity_tokens(text), *want, "{text}");
        }
    }
}
