//! The names of the metrics this crate exports: Raft's and gossip's. The one place each
//! name is written; the code, the dashboards' test and the alert rules' test use these.

pub const GOSSIP_BATCHES_PUBLISHED_TOTAL: &str = "warmpath_gossip_batches_published_total";
pub const GOSSIP_BATCHES_RECEIVED_TOTAL: &str = "warmpath_gossip_batches_received_total";
pub const GOSSIP_DECISIONS_DROPPED_TOTAL: &str = "warmpath_gossip_decisions_dropped_total";
pub const GOSSIP_DECISIONS_SHED_TOTAL: &str = "warmpath_gossip_decisions_shed_total";
pub const GOSSIP_DECISIONS_TRUNCATED_TOTAL: &str = "warmpath_gossip_decisions_truncated_total";
pub const GOSSIP_DECODE_ERRORS_TOTAL: &str = "warmpath_gossip_decode_errors_total";
pub const GOSSIP_LAGGING_ORIGINS_TOTAL: &str = "warmpath_gossip_lagging_origins_total";
pub const GOSSIP_PEERS: &str = "warmpath_gossip_peers";
pub const GOSSIP_RECEIVED_BYTES_TOTAL: &str = "warmpath_gossip_received_bytes_total";
pub const GOSSIP_SENT_BYTES_TOTAL: &str = "warmpath_gossip_sent_bytes_total";
pub const GOSSIP_UNAUTHENTICATED_DATAGRAMS_DROPPED_TOTAL: &str =
    "warmpath_gossip_unauthenticated_datagrams_dropped_total";
pub const RAFT_APPLIED_INDEX: &str = "warmpath_raft_applied_index";
pub const RAFT_IS_LEADER: &str = "warmpath_raft_is_leader";
pub const RAFT_LAST_LOG_INDEX: &str = "warmpath_raft_last_log_index";
pub const RAFT_LEADER_KNOWN: &str = "warmpath_raft_leader_known";
pub const RAFT_PRE_VOTES_TOTAL: &str = "warmpath_raft_pre_votes_total";
pub const RAFT_QUORUM_LOST: &str = "warmpath_raft_quorum_lost";
pub const RAFT_RUNNING: &str = "warmpath_raft_running";
pub const RAFT_STOPS_TOTAL: &str = "warmpath_raft_stops_total";
pub const RAFT_TERM: &str = "warmpath_raft_term";
pub const RAFT_UNAUTHORIZED_REQUESTS_TOTAL: &str = "warmpath_raft_unauthorized_requests_total";

/// Every name above.
pub const ALL: &[&str] = &[
    GOSSIP_BATCHES_PUBLISHED_TOTAL,
    GOSSIP_BATCHES_RECEIVED_TOTAL,
    GOSSIP_DECISIONS_DROPPED_TOTAL,
    GOSSIP_DECISIONS_SHED_TOTAL,
    GOSSIP_DECISIONS_TRUNCATED_TOTAL,
    GOSSIP_DECODE_ERRORS_TOTAL,
    GOSSIP_LAGGING_ORIGINS_TOTAL,
    GOSSIP_PEERS,
    GOSSIP_RECEIVED_BYTES_TOTAL,
    GOSSIP_SENT_BYTES_TOTAL,
    GOSSIP_UNAUTHENTICATED_DATAGRAMS_DROPPED_TOTAL,
    RAFT_APPLIED_INDEX,
    RAFT_IS_LEADER,
    RAFT_LAST_LOG_INDEX,
    RAFT_LEADER_KNOWN,
    RAFT_PRE_VOTES_TOTAL,
    RAFT_QUORUM_LOST,
    RAFT_RUNNING,
    RAFT_STOPS_TOTAL,
    RAFT_TERM,
    RAFT_UNAUTHORIZED_REQUESTS_TOTAL,
];
