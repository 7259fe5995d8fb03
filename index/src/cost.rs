//! The cost model that kv-aware routing and the engine simulator share.
//!
//! A [`ModelProfile`] is data (JSON files under `index/profiles/`), not code: prefill time of a
//! forward pass as a quadratic in the uncached tokens it computes, decode step time as a
//! quadratic in KV-cache usage, the KV bytes one token occupies, and the bandwidth of each
//! tier from which a cached block can be loaded instead of recomputed. The defaults are
//! the published coefficients of NVIDIA Dynamo's mocker engine model.

use serde::{Deserialize, Serialize};

/// Where a cached block lives, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The engine's own GPU KV cache: free to reuse.
    Gpu,
    /// The host's CPU memory (cache-agent L1): loaded over the host link.
    L1,
    /// Remote storage shared by all hosts (cache-agent L2): loaded over the network.
    L2,
}

/// Time of one engine forward pass that prefills `T` tokens: `a·T² + b·T + c` ms.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillCurve {
    pub a: f64,
    pub b: f64,
    pub c: f64,
}

/// Time of one decode step at KV usage `u` in `[0, 1]`: `max(floor, a·u² + b·u + c)` ms.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeCurve {
    pub a: f64,
    pub b: f64,
    pub c: f64,
    pub floor: f64,
}

/// Performance profile of one model on one accelerator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    /// Profile name, as given to `--profile`.
    pub name: String,
    /// Bytes of KV cache one token occupies (all layers, K and V).
    pub kv_bytes_per_token: u64,
    pub prefill_ms: PrefillCurve,
    pub decode_ms: DecodeCurve,
    /// Host memory to GPU bandwidth for L1 loads, bytes per second.
    pub l1_bytes_per_s: f64,
    /// Remote store to GPU bandwidth for L2 loads, bytes per second.
    pub l2_bytes_per_s: f64,
}

impl ModelProfile {
    /// Dynamo's mocker coefficients with Llama-3.1-8B's KV size (128 KiB per token), an
    /// L1 link of 25 GB/s (PCIe Gen5 in practice) and an L2 link of 12.5 GB/s (a 100 Gb/s RDMA
    /// network, as Mooncake's store uses). With them, loading an 8B model's KV from L1 costs
    /// about a third of recomputing it, and from L2 about two thirds.
    pub fn dynamo_default() -> Self {
        ModelProfile {
            name: "default".into(),
            kv_bytes_per_token: 131_072,
            prefill_ms: PrefillCurve {
                a: 4.209989e-7,
                b: 1.518344e-2,
                c: 16.50142,
            },
            decode_ms: DecodeCurve {
                a: -25.74,
                b: 54.01,
                c: 5.74,
                floor: 1.0,
            },
            l1_bytes_per_s: 25e9,
            l2_bytes_per_s: 12.5e9,
        }
    }

    /// Milliseconds of a forward pass that prefills `tokens` tokens (0 for none).
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        let p = self.prefill_ms;
        p.a * t * t + p.b * t + p.c
    }

    /// Milliseconds of one decode step at KV usage `usage` (clamped to `[0, 1]`).
    pub fn decode_step_ms(&self, usage: f64) -> f64 {
        let u = usage.clamp(0.0, 1.0);
        let d = self.decode_ms;
        (d.a * u * u + d.b * u + d.c).max(d.floor)
    }

    /// Milliseconds to load `tokens` tokens of KV cache from `tier` (GPU is free).
    pub fn load_ms(&self, tier: Tier, tokens: u64) -> f64 {
        let bytes = (tokens * self.kv_bytes_per_token) as f64;
        match tier {
            Tier::Gpu => 0.0,
            Tier::L1 => bytes / self.l1_bytes_per_s * 1e3,
            Tier::L2 => bytes / self.l2_bytes_per_s * 1e3,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamo_curves() {
        let p = ModelProfile::dynamo_default();
        assert_eq!(p.prefill_ms(0), 0.0);
        let check = |t: u64, want: f64| assert!((p.prefill_ms(t) - want).abs() < 1e-6, "{t}");
        check(1, 4.209989e-7 + 1.518344e-2 + 16.50142);
        check(1000, 0.4209989 + 15.18344 + 16.50142);
        assert_eq!(p.decode_step_ms(0.0), 5.74);
        assert_eq!(p.decode_step_ms(2.0), p.decode_step_ms(1.0));
        assert!((p.decode_step_ms(0.5) - (-25.74 * 0.25 + 27.005 + 5.74)).abs() < 1e-9);
    }

    #[test]
    fn loads_cost_bytes_over_bandwidth() {
        let p = ModelProfile::dynamo_default();
        assert_eq!(p.load_ms(Tier::Gpu, 1_000_000), 0.0);
        // 1000 tokens × 128 KiB = 131 MB: 5.24 ms at 25 GB/s, 10.5 ms at 12.5 GB/s.
        assert!((p.load_ms(Tier::L1, 1000) - 5.24288).abs() < 1e-9);
        assert!((p.load_ms(Tier::L2, 1000) - 10.48576).abs() < 1e-9);
        // Loading from L1 beats recomputing for long prefixes.
        assert!(p.load_ms(Tier::L1, 8000) < p.prefill_ms(8000));
    }
}
