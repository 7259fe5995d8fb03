//! The load view: what each instance is busy with, as a router sees it.
//!
//! A router knows its own requests exactly (it sent them and sees their first tokens and
//! ends); the cluster layer adds the other routers' last published counts with
//! [`LoadView::add`]. Policies read it; nothing here reads a clock.

use crate::InstanceId;
use serde::{Deserialize, Serialize};

/// Load of one instance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceLoad {
    /// Requests sent and not yet finished.
    pub in_flight: u32,
    /// Prompt tokens of in-flight requests that have not produced their first token.
    pub pending_prefill_tokens: u64,
}

/// Per-instance load, indexed by [`InstanceId`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadView {
    loads: Vec<InstanceLoad>,
}

impl LoadView {
    pub fn new() -> Self {
        Self::default()
    }

    /// Load of `instance` (zero for one never seen).
    pub fn get(&self, instance: InstanceId) -> InstanceLoad {
        self.loads
            .get(instance.0 as usize)
            .copied()
            .unwrap_or_default()
    }

    fn slot(&mut self, instance: InstanceId) -> &mut InstanceLoad {
        let i = instance.0 as usize;
        if i >= self.loads.len() {
            self.loads.resize(i + 1, InstanceLoad::default());
        }
        &mut self.loads[i]
    }

    /// A request with `prompt_tokens` to prefill was sent to `instance`.
    pub fn start(&mut self, instance: InstanceId, prompt_tokens: u64) {
        let s = self.slot(instance);
        s.in_flight += 1;
        s.pending_prefill_tokens += prompt_tokens;
    }

    /// That request's first token arrived: its prefill is done.
    pub fn first_token(&mut self, instance: InstanceId, prompt_tokens: u64) {
        let s = self.slot(instance);
        s.pending_prefill_tokens = s.pending_prefill_tokens.saturating_sub(prompt_tokens);
    }

    /// That request ended (finished, failed or cancelled); `prefilled` says whether its
    /// first token had arrived.
    pub fn finish(&mut self, instance: InstanceId, prompt_tokens: u64, prefilled: bool) {
        let s = self.slot(instance);
        s.in_flight = s.in_flight.saturating_sub(1);
        if !prefilled {
            s.pending_prefill_tokens = s.pending_prefill_tokens.saturating_sub(prompt_tokens);
        }
    }

    /// Replaces the load of `instance` (a peer's published figure).
    pub fn set(&mut self, instance: InstanceId, load: InstanceLoad) {
        *self.slot(instance) = load;
    }

    /// Adds `other` into this view, instance by instance (own counts + peers' counts).
    /// Adds `load` to `instance`'s (one peer's entry into a combined view).
    pub fn add_one(&mut self, instance: InstanceId, load: InstanceLoad) {
        let s = self.slot(instance);
        s.in_flight += load.in_flight;
        s.pending_prefill_tokens += load.pending_prefill_tokens;
    }

    pub fn add(&mut self, other: &LoadView) {
        for (i, l) in other.iter() {
            self.add_one(i, l);
        }
    }

    /// Instances with any recorded load, as `(instance, load)`.
    pub fn iter(&self) -> impl Iterator<Item = (InstanceId, InstanceLoad)> + '_ {
        self.loads
            .iter()
            .enumerate()
            .map(|(i, l)| (InstanceId(i as u32), *l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lifecycle() {
        let mut v = LoadView::new();
        let i = InstanceId(3);
        v.start(i, 100);
        v.start(i, 50);
        assert_eq!(
            v.get(i),
            InstanceLoad {
                in_flight: 2,
                pending_prefill_tokens: 150
            }
        );
        v.first_token(i, 100);
        v.finish(i, 100, true);
        assert_eq!(
            v.get(i),
            InstanceLoad {
                in_flight: 1,
                pending_prefill_tokens: 50
            }
        );
        v.finish(i, 50, false);
        assert_eq!(v.get(i), InstanceLoad::default());
        // Unbalanced calls never underflow.
        v.finish(i, 50, false);
        assert_eq!(v.get(i), InstanceLoad::default());
        assert_eq!(v.get(InstanceId(99)), InstanceLoad::default());
    }

    #[test]
    fn add_sums_views() {
        let mut own = LoadView::new();
        own.start(InstanceId(0), 10);
        let mut peer = LoadView::new();
        peer.set(
            InstanceId(0),
            InstanceLoad {
                in_flight: 2,
                pending_prefill_tokens: 5,
            },
        );
        peer.set(
            InstanceId(2),
            InstanceLoad {
                in_flight: 1,
                pending_prefill_tokens: 0,
            },
        );
        own.add(&peer);
        assert_eq!(
            own.get(InstanceId(0)),
            InstanceLoad {
                in_flight: 3,
                pending_prefill_tokens: 15
            }
        );
        assert_eq!(own.get(InstanceId(2)).in_flight, 1);
    }
}
