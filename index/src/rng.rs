//! A small seeded pseudo-random generator (xoshiro256** seeded by SplitMix64).
//!
//! Policies break ties and sample with it, and the simulator draws workloads from it. It is
//! ours rather than a crate's so that one seed gives the same output on every platform and
//! every release: simulator results are reproducible with `--seed`.

/// SplitMix64's finaliser: a bijection on u64 that scatters consecutive inputs. The one
/// definition, for seeding [`Rng`], sampling keys ([`crate::keys::reported`]), choosing
/// followers and deriving the simulator's keys.
pub fn mix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xoshiro256** with SplitMix64 seeding.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix64(x)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// A generator for a named sub-stream, so that adding draws to one part of a run does
    /// not shift another part's.
    pub fn fork(&mut self, stream: u64) -> Rng {
        Rng::new(self.next_u64() ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, n)`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `[lo, hi]` (inclusive); `lo` when `hi <= lo`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.below(hi - lo + 1)
    }

    /// Exponentially distributed with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next_f64()).ln()
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.next_f64() < p
    }

    /// Zipf-like pick in `[0, n)`: rank `k` has weight `1 / (k + 1)^s` (rejection-free
    /// inverse over a precomputable table is not worth it for our sizes).
    pub fn zipf(&mut self, n: u64, s: f64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let total: f64 = (0..n).map(|k| 1.0 / ((k + 1) as f64).powf(s)).sum();
        let mut target = self.next_f64() * total;
        for k in 0..n {
            target -= 1.0 / ((k + 1) as f64).powf(s);
            if target <= 0.0 {
                return k;
            }
        }
        n - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn draws_stay_in_range() {
        let mut r = Rng::new(1);
        for _ in 0..1000 {
            assert!(r.below(10) < 10);
            let x = r.range(5, 7);
            assert!((5..=7).contains(&x));
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
            assert!(r.zipf(20, 1.1) < 20);
            assert!(r.exp(3.0) >= 0.0);
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(r.range(4, 2), 4);
    }
}
