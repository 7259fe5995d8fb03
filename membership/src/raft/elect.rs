//! Elections with a pre-vote (Raft thesis, section 9.6): a node stands for election only
//! after a majority of the voters say they have heard from no leader either.
//!
//! openraft 0.9 has no pre-vote. A follower that misses heartbeats (a clock running fast, a
//! one-way partition, a long pause) stands on its own: it raises its term, its vote requests
//! are refused by the peers that still hear the leader, and its answers to the leader's
//! heartbeats then carry the higher term, which makes the healthy leader step down. One
//! router whose clock ran 20 times fast kept the group leaderless for 15 to 30 s this way.
//!
//! So openraft's own election timer is switched off (`enable_elect: false`) and
//! [`Elections`] drives it: when this voter has heard from no leader for its standing time
//! (the leader lease plus a random part of the election range), it asks the other voters
//! [`PATH_PRE_VOTE`]; only if a majority of every configuration grants does it call
//! openraft's `trigger().elect()`. A voter grants ([`answer`]) when it has heard from no
//! leader for longer than the leader lease (openraft's own lease: its vote handler refuses
//! a real vote inside it, so a pre-vote granted under that rule is not refused later), is
//! not itself a leader with a live quorum, and holds no longer log than the candidate.

use super::client::HttpClient;
use super::store::{self, NodeId, TypeConfig};
use futures_util::stream::{FuturesUnordered, StreamExt};
use openraft::{LogId, Raft, ServerState};
use rand::rngs::StdRng;
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Path of the pre-vote RPC.
pub const PATH_PRE_VOTE: &str = "/raft/pre-vote";

/// "Would you vote for me if I stood now?" It changes nothing on the node asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreVoteRequest {
    /// The node that would stand.
    pub candidate: NodeId,
    /// Its last stored log id.
    pub last_log_id: Option<LogId<NodeId>>,
}

/// The answer to a [`PreVoteRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PreVoteAnswer {
    /// It would vote for the candidate.
    Granted,
    /// It heard from a leader this long ago, within the leader lease.
    LeaderHeard {
        /// Milliseconds since the leader was last heard.
        ms_ago: u64,
    },
    /// It leads, and a quorum acknowledged it within the lease.
    Leading,
    /// Its log is longer than the candidate's.
    LogBehind {
        /// Its own last log id.
        mine: Option<LogId<NodeId>>,
    },
}

/// When this node last heard from a leader: a successful AppendEntries or snapshot.
#[derive(Debug, Clone)]
pub(crate) struct Contact(Arc<Mutex<Heard>>);

/// What [`Contact`] holds.
#[derive(Debug, Clone, Copy)]
struct Heard {
    /// The last time a leader was heard, or the start.
    at: Instant,
    /// Whether a leader was heard at all since the start.
    ever: bool,
}

impl Contact {
    /// Counts from now: a starting node waits a whole standing time before it stands.
    pub(crate) fn new() -> Contact {
        Contact(Arc::new(Mutex::new(Heard {
            at: Instant::now(),
            ever: false,
        })))
    }

    /// A leader was heard.
    pub(crate) fn touch(&self) {
        if let Ok(mut t) = self.0.lock() {
            *t = Heard {
                at: Instant::now(),
                ever: true,
            };
        }
    }

    /// How long since a leader was last heard (or since the start, when none was).
    pub(crate) fn silence(&self) -> Duration {
        self.0.lock().map_or(Duration::ZERO, |t| t.at.elapsed())
    }

    /// How long since a leader was last heard; `None` when none was since the start.
    pub(crate) fn last_heard(&self) -> Option<Duration> {
        self.0
            .lock()
            .ok()
            .filter(|t| t.ever)
            .map(|t| t.at.elapsed())
    }
}

/// How a voter answers a pre-vote: `mine` is its last stored log id, `silence` the time
/// since it heard a leader, `lease` the leader lease, `leading` whether it leads with a
/// quorum heard within the lease.
pub(crate) fn answer(
    req: &PreVoteRequest,
    mine: Option<LogId<NodeId>>,
    silence: Duration,
    lease: Duration,
    leading: bool,
) -> PreVoteAnswer {
    if leading {
        PreVoteAnswer::Leading
    } else if silence <= lease {
        PreVoteAnswer::LeaderHeard {
            ms_ago: silence.as_millis() as u64,
        }
    } else if req.last_log_id < mine {
        PreVoteAnswer::LogBehind { mine }
    } else {
        PreVoteAnswer::Granted
    }
}

/// Whether `granted` holds a majority of every configuration (two during a joint change).
fn wins(granted: &BTreeSet<NodeId>, configs: &[BTreeSet<NodeId>]) -> bool {
    configs
        .iter()
        .all(|c| c.intersection(granted).count() * 2 > c.len())
}

/// Who this node would ask, when it may stand.
struct Ballot {
    /// The other voters' base URLs.
    others: Vec<(NodeId, String)>,
    /// The voter sets a winner needs a majority of.
    configs: Vec<BTreeSet<NodeId>>,
}

/// What [`Elections::ballot`] found.
enum Standing {
    /// A voter that does not lead: it may stand.
    May(Ballot),
    /// A leader or a learner: nothing to do.
    Not,
    /// Raft has stopped.
    Stopped,
}

/// The election timer of one node; [`Elections::run`] until Raft stops.
pub(crate) struct Elections {
    /// The local Raft node.
    pub(crate) raft: Raft<TypeConfig>,
    /// For the pre-vote calls.
    pub(crate) client: HttpClient,
    /// When a leader was last heard (touched by the `/raft/` handlers).
    pub(crate) contact: Contact,
    /// The store, for this node's last log id.
    pub(crate) db: Arc<redb::Database>,
    /// This node.
    pub(crate) node_id: NodeId,
    /// Set once this node hands its leadership off to stop (`RaftNode::hand_off`): from
    /// then on it never stands. Right after a hand-off the other voters may not have
    /// heard the new leader yet (the old one stopped its heartbeats), so a pre-vote of the
    /// stopping node could win and take the leadership back just before it exits.
    pub(crate) stopping: Arc<std::sync::atomic::AtomicBool>,
    /// How often the timer looks.
    pub(crate) tick: Duration,
    /// The election timeout range; its top is the leader lease.
    pub(crate) timeout: (Duration, Duration),
    /// Draws the standing times and retry pauses.
    pub(crate) rng: StdRng,
}

impl Elections {
    /// Watches for a silent leader and stands after a won pre-vote, until Raft stops.
    pub(crate) async fn run(mut self) {
        let (lo, hi) = self.timeout;
        let mut stand_after = self.standing_time();
        let mut not_before = Instant::now();
        loop {
            tokio::time::sleep(self.tick).await;
            self.touch_while_leading();
            let silence = self.contact.silence();
            if Instant::now() < not_before || silence < stand_after {
                continue;
            }
            if self.stopping.load(std::sync::atomic::Ordering::Acquire) {
                continue;
            }
            let ballot = match self.ballot() {
                Standing::May(b) => b,
                Standing::Not => continue,
                Standing::Stopped => return,
            };
            if self.pre_vote(ballot).await {
                tracing::info!(
                    node_id = self.node_id,
                    silence_ms = silence.as_millis() as u64,
                    "no raft leader heard and a majority agrees: standing for election"
                );
                if self.raft.trigger().elect().await.is_err() {
                    return;
                }
            }
            stand_after = self.standing_time();
            not_before = Instant::now() + self.rng.gen_range(lo..=hi);
        }
    }

    /// A leader that a quorum acknowledged within the lease has heard a leader: itself.
    /// So a leader that steps down counts its silence from then, not from before it led,
    /// which would read as a leader silent for as long as it led (`RaftNode::following`
    /// then took the router out of service at every change of leader).
    fn touch_while_leading(&self) {
        let m = self.raft.metrics();
        let m = m.borrow();
        let lease_ms = self.timeout.1.as_millis() as u64;
        if m.state == ServerState::Leader
            && m.millis_since_quorum_ack.is_some_and(|ms| ms <= lease_ms)
        {
            self.contact.touch();
        }
    }

    /// How long without a leader before this node stands: the lease (the top of the
    /// election range) and a random part of the range.
    fn standing_time(&mut self) -> Duration {
        let (lo, hi) = self.timeout;
        hi + self.rng.gen_range(Duration::ZERO..=hi - lo)
    }

    fn ballot(&self) -> Standing {
        let m = self.raft.metrics();
        let m = m.borrow();
        if m.running_state.is_err() {
            return Standing::Stopped;
        }
        if m.state == ServerState::Leader {
            return Standing::Not;
        }
        let membership = m.membership_config.membership();
        if !membership.voter_ids().any(|id| id == self.node_id) {
            return Standing::Not;
        }
        let others = membership
            .voter_ids()
            .filter(|&id| id != self.node_id)
            .filter_map(|id| Some((id, membership.get_node(&id)?.addr.clone())))
            .collect();
        Standing::May(Ballot {
            others,
            configs: membership.get_joint_config().clone(),
        })
    }

    /// Asks the other voters; true once a majority of every configuration (this node
    /// included) grants.
    async fn pre_vote(&self, ballot: Ballot) -> bool {
        let mine = match store::last_log_id(&self.db).await {
            Ok(last) => last,
            Err(e) => {
                tracing::warn!(node_id = self.node_id, error = %e, "pre-vote: cannot read the last log id");
                return false;
            }
        };
        let req = PreVoteRequest {
            candidate: self.node_id,
            last_log_id: mine,
        };
        let mut granted = BTreeSet::from([self.node_id]);
        if wins(&granted, &ballot.configs) {
            return true;
        }
        let mut calls: FuturesUnordered<_> = ballot
            .others
            .iter()
            .map(|(id, url)| async {
                let r = self
                    .client
                    .post_json::<_, PreVoteAnswer>(url, PATH_PRE_VOTE, &req, self.timeout.0)
                    .await;
                (*id, r)
            })
            .collect();
        while let Some((id, r)) = calls.next().await {
            match r {
                Ok(PreVoteAnswer::Granted) => {
                    granted.insert(id);
                    if wins(&granted, &ballot.configs) {
                        metrics::counter!(crate::metric_names::RAFT_PRE_VOTES_TOTAL, "outcome" => "won")
                            .increment(1);
                        return true;
                    }
                }
                Ok(refused) => {
                    tracing::debug!(
                        node_id = self.node_id,
                        peer = id,
                        ?refused,
                        "pre-vote refused"
                    )
                }
                Err(e) => {
                    tracing::debug!(node_id = self.node_id, peer = id, error = %e, "pre-vote unanswered")
                }
            }
        }
        metrics::counter!(crate::metric_names::RAFT_PRE_VOTES_TOTAL, "outcome" => "lost")
            .increment(1);
        false
    }
}

/// Stands for election once no leader has been heard for `lease` (and a little more, for
/// the voters' clocks), at most two leases from now: the hand-off a stopping leader asks
/// for (see `RaftNode::hand_off`). A leader heard meanwhile from a newer term ends it.
pub(crate) async fn stand_after_lease(raft: Raft<TypeConfig>, contact: Contact, lease: Duration) {
    let margin = Duration::from_millis(20);
    let give_up = Instant::now() + lease * 2;
    let term = raft.metrics().borrow().current_term;
    loop {
        let silence = contact.silence();
        if silence >= lease + margin {
            break;
        }
        if Instant::now() >= give_up || raft.metrics().borrow().current_term > term {
            return;
        }
        tokio::time::sleep(lease + margin - silence).await;
    }
    tracing::info!("the leader handed its leadership off to this node: standing for election");
    let _ = raft.trigger().elect().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;

    fn log_id(term: u64, index: u64) -> Option<LogId<NodeId>> {
        Some(LogId::new(CommittedLeaderId::new(term, 1), index))
    }

    fn req(last: Option<LogId<NodeId>>) -> PreVoteRequest {
        PreVoteRequest {
            candidate: 2,
            last_log_id: last,
        }
    }

    const LEASE: Duration = Duration::from_millis(600);

    #[test]
    fn a_voter_that_hears_its_leader_refuses() {
        let a = answer(
            &req(log_id(3, 9)),
            log_id(3, 9),
            Duration::from_millis(120),
            LEASE,
            false,
        );
        assert_eq!(a, PreVoteAnswer::LeaderHeard { ms_ago: 120 });
        let a = answer(&req(log_id(3, 9)), log_id(3, 9), LEASE, LEASE, false);
        assert!(matches!(a, PreVoteAnswer::LeaderHeard { .. }));
    }

    #[test]
    fn a_leader_with_its_quorum_refuses_even_when_no_other_leader_is_heard() {
        let a = answer(&req(log_id(3, 9)), log_id(3, 9), LEASE * 10, LEASE, true);
        assert_eq!(a, PreVoteAnswer::Leading);
    }

    #[test]
    fn a_longer_log_refuses_and_an_equal_or_shorter_one_grants() {
        let silent = LEASE + Duration::from_millis(1);
        let a = answer(&req(log_id(3, 8)), log_id(3, 9), silent, LEASE, false);
        assert_eq!(a, PreVoteAnswer::LogBehind { mine: log_id(3, 9) });
        // A later term wins over a higher index, as in Raft's comparison.
        let a = answer(&req(log_id(4, 2)), log_id(3, 9), silent, LEASE, false);
        assert_eq!(a, PreVoteAnswer::Granted);
        assert_eq!(
            answer(&req(log_id(3, 9)), log_id(3, 9), silent, LEASE, false),
            PreVoteAnswer::Granted
        );
        assert_eq!(
            answer(&req(None), None, silent, LEASE, false),
            PreVoteAnswer::Granted
        );
        assert!(matches!(
            answer(&req(None), log_id(1, 1), silent, LEASE, false),
            PreVoteAnswer::LogBehind { .. }
        ));
    }

    #[test]
    fn a_win_needs_a_majority_of_every_configuration() {
        let old: BTreeSet<NodeId> = [1, 2, 3].into();
        let new: BTreeSet<NodeId> = [3, 4, 5].into();
        assert!(wins(&[1, 2].into(), std::slice::from_ref(&old)));
        assert!(!wins(&[1].into(), std::slice::from_ref(&old)));
        assert!(!wins(&[1, 2].into(), &[old.clone(), new.clone()]));
        assert!(wins(&[2, 3, 4].into(), &[old, new]));
        assert!(wins(&[1].into(), &[[1].into()]));
    }
}
