//! Per-tenant rate limits, enforced by every router on its share of the tenant's rate.
//!
//! A token bucket per tenant per router: it refills at `rate × share` tokens per second
//! and holds at most one second of that, where `share` is 1/N for the N routers this one
//! counts ([`PeerCount`]: those gossip shows live, and those it showed within the last
//! [`PEER_MEMORY`]). A load balancer spreading a tenant's requests evenly makes the
//! cluster admit about `rate` per second in all; a skewed one admits less than `rate`
//! (never more), which errs on the side of protecting the fleet. The answer to a request
//! over the limit is 429 with `Retry-After`.
//!
//! **Partitions.** A router cut off from the others cannot tell them from dead. It keeps
//! counting them for [`PEER_MEMORY`], so a partition shorter than that admits no more than
//! `rate` in all (it used to double at once: the cut-off side took the whole rate while
//! the rest kept their halves). Past it, each side assumes the others died and shares
//! `rate` among the routers it sees: the cluster then admits at most `rate` times the
//! number of sides, and routers that really died stop holding their shares.
//!
//! Pure: time is passed in.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a router that gossip stopped showing still counts in the rate shares.
pub const PEER_MEMORY: Duration = Duration::from_secs(60);

/// The other routers a share is counted over: live ones, and those seen within
/// [`PEER_MEMORY`].
#[derive(Debug, Default)]
pub struct PeerCount {
    last_seen: HashMap<String, Instant>,
}

impl PeerCount {
    /// Gossip shows `live` (node ids, this router's not among them) at `now`; returns how
    /// many other routers count.
    pub fn update<'a>(&mut self, live: impl IntoIterator<Item = &'a str>, now: Instant) -> usize {
        for id in live {
            match self.last_seen.get_mut(id) {
                Some(t) => *t = now,
                None => {
                    self.last_seen.insert(id.to_string(), now);
                }
            }
        }
        self.last_seen
            .retain(|_, seen| now.saturating_duration_since(*seen) <= PEER_MEMORY);
        self.last_seen.len()
    }
}

/// A token bucket.
#[derive(Debug)]
pub struct TokenBucket {
    /// The tenant's cluster-wide rate, requests per second.
    rate: f64,
    /// This router's share of it, in (0, 1].
    share: f64,
    tokens: f64,
    last: Option<Instant>,
}

impl TokenBucket {
    pub fn new(rate_per_s: f64) -> Self {
        TokenBucket {
            rate: rate_per_s.max(0.0),
            share: 1.0,
            tokens: rate_per_s.max(1.0),
            last: None,
        }
    }

    /// Sets this router's share of the rate (1 / live routers).
    pub fn set_share(&mut self, share: f64) {
        self.share = share.clamp(1e-6, 1.0);
    }

    fn per_s(&self) -> f64 {
        self.rate * self.share
    }

    /// Takes one token at `now`, or says how long until one is available.
    pub fn admit(&mut self, now: Instant) -> Result<(), Duration> {
        let per_s = self.per_s();
        let burst = per_s.max(1.0);
        if let Some(last) = self.last {
            self.tokens = (self.tokens + now.saturating_duration_since(last).as_secs_f64() * per_s)
                .min(burst);
        } else {
            self.tokens = self.tokens.min(burst);
        }
        self.last = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        // A tiny positive rate (1e-300 is valid input) would overflow a Duration: a wait is
        // capped at a day, which a client reads as "not today".
        const MAX_WAIT_S: f64 = 86_400.0;
        if per_s <= 0.0 {
            return Err(Duration::from_secs(60));
        }
        Err(Duration::from_secs_f64(
            ((1.0 - self.tokens) / per_s).min(MAX_WAIT_S),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_gossip_stops_showing_count_for_a_while() {
        let t0 = Instant::now();
        let mut peers = PeerCount::default();
        assert_eq!(peers.update(["b", "c"], t0), 2);
        // Cut off: gossip shows nobody, but b and c keep their shares for a while.
        assert_eq!(peers.update([], t0 + Duration::from_secs(5)), 2);
        assert_eq!(peers.update(["c"], t0 + PEER_MEMORY), 2);
        // Then they are taken for dead; c, still seen, stays.
        assert_eq!(
            peers.update([], t0 + PEER_MEMORY + Duration::from_secs(1)),
            1
        );
        assert_eq!(peers.update([], t0 + 3 * PEER_MEMORY), 0);
    }

    #[test]
    fn bucket_cases() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut b = TokenBucket::new(2.0);
        // A burst of up to one second's worth, then a wait.
        assert!(b.admit(at(0)).is_ok());
        assert!(b.admit(at(0)).is_ok());
        let wait = b.admit(at(0)).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-9, "{wait:?}");
        assert!(b.admit(at(500)).is_ok());
        // Half the share: half the rate.
        let mut half = TokenBucket::new(4.0);
        half.set_share(0.5);
        assert!(half.admit(at(0)).is_ok());
        assert!(half.admit(at(0)).is_ok());
        assert!(half.admit(at(0)).is_err());
        assert!(half.admit(at(499)).is_err());
        assert!(half.admit(at(500)).is_ok());
        // A zero rate admits nothing.
        let mut none = TokenBucket::new(0.0);
        assert!(
            none.admit(at(0)).is_ok(),
            "the first token of the minimum burst"
        );
        assert!(none.admit(at(10_000)).is_err());
        // A vanishing rate waits at most a day instead of overflowing.
        let mut tiny = TokenBucket::new(1e-300);
        assert!(tiny.admit(at(0)).is_ok());
        assert_eq!(tiny.admit(at(1)).unwrap_err(), Duration::from_secs(86_400));
    }
}
