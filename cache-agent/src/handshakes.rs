//! Connections that have not yet proven themselves, capped, oldest displaced: one
//! definition for every listener of the agent (the block API, the HyperPod API, `lm://`).
//!
//! A connection is *unproven* from its accept until it has done what its protocol asks
//! first (the block API's handshake with the token, a whole HTTP request head, a valid
//! `lm://` header). Unproven connections are capped overall and per source address (the
//! Unix socket is one source); one more **displaces the oldest** (of its source when that
//! cap is reached, else of all), counted in
//! `warmpath_agent_handshakes_displaced_total{api, scope}`. Refusing the newest instead
//! would let whoever holds the slots keep them; displacing the oldest means a flood of
//! silent connections costs a client at most a retry, and a flooder must open connections
//! faster than a client sends its first bytes to keep one out. A proven connection is never
//! displaced (its own protocol's limits bound it). Record 0106.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;

use metrics::counter;
use tokio::sync::oneshot;

/// The unproven connections of one listener, oldest first, overall and per source address.
/// Each holds the sender that closes it when a newer one displaces it.
pub(crate) struct Unproven {
    /// The listener's name in the displacement counter's `api` label.
    api: &'static str,
    max_all: usize,
    max_per_source: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    all: BTreeMap<u64, (Option<IpAddr>, oneshot::Sender<()>)>,
    by_source: HashMap<Option<IpAddr>, VecDeque<u64>>,
}

impl Unproven {
    pub(crate) fn new(api: &'static str, max_all: usize, max_per_source: usize) -> Self {
        for scope in ["source", "all"] {
            counter!(crate::metric_names::AGENT_HANDSHAKES_DISPLACED_TOTAL, "api" => api, "scope" => scope)
                .increment(0);
        }
        Unproven {
            api,
            max_all: max_all.max(1),
            max_per_source: max_per_source.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Admits a connection from `source`, displacing the oldest of its source, or of all,
    /// when a cap is reached; its number and the receiver that says it was displaced.
    pub(crate) fn admit(&self, source: Option<IpAddr>) -> (u64, oneshot::Receiver<()>) {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let oldest_of_source = p
            .by_source
            .get(&source)
            .filter(|q| q.len() >= self.max_per_source)
            .and_then(|q| q.front().copied());
        if let Some(old) = oldest_of_source {
            p.displace(old);
            counter!(crate::metric_names::AGENT_HANDSHAKES_DISPLACED_TOTAL, "api" => self.api, "scope" => "source")
                .increment(1);
        }
        if p.all.len() >= self.max_all {
            if let Some(old) = p.all.keys().next().copied() {
                p.displace(old);
                counter!(crate::metric_names::AGENT_HANDSHAKES_DISPLACED_TOTAL, "api" => self.api, "scope" => "all")
                    .increment(1);
            }
        }
        p.next += 1;
        let n = p.next;
        let (tx, rx) = oneshot::channel();
        p.all.insert(n, (source, tx));
        p.by_source.entry(source).or_default().push_back(n);
        (n, rx)
    }

    /// Connection `n` proved itself, or ended (either: it is no longer displaceable).
    pub(crate) fn done(&self, n: u64) {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        p.remove(n);
    }

    /// Unproven connections now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .all
            .len()
    }
}

impl Inner {
    fn remove(&mut self, n: u64) -> Option<oneshot::Sender<()>> {
        let (source, tx) = self.all.remove(&n)?;
        if let Some(q) = self.by_source.get_mut(&source) {
            q.retain(|&m| m != n);
            if q.is_empty() {
                self.by_source.remove(&source);
            }
        }
        Some(tx)
    }

    fn displace(&mut self, n: u64) {
        if let Some(tx) = self.remove(n) {
            let _ = tx.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn the_oldest_of_a_full_source_is_displaced_then_the_oldest_of_all() {
        let u = Unproven::new("test", 3, 2);
        let (_a, mut ra) = u.admit(ip(1));
        let (_b, mut rb) = u.admit(ip(1));
        // Source 1 is full: its oldest (a) goes.
        let (_c, mut rc) = u.admit(ip(1));
        assert!(ra.try_recv().is_ok());
        assert!(rb.try_recv().is_err());
        // All are full (b, c, d): the oldest of all (b) goes for e.
        let (_d, _rd) = u.admit(ip(2));
        let (_e, _re) = u.admit(ip(3));
        assert!(rb.try_recv().is_ok());
        assert!(rc.try_recv().is_err());
        assert_eq!(u.len(), 3);
    }

    #[test]
    fn a_proven_connection_is_never_displaced() {
        let u = Unproven::new("test", 1, 1);
        let (a, mut ra) = u.admit(ip(1));
        u.done(a);
        let (_b, _rb) = u.admit(ip(1));
        // a's sender was dropped when it proved itself: closed, never signalled.
        assert!(matches!(
            ra.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
        assert_eq!(u.len(), 1);
    }
}
