//! The names of the metrics this crate exports: the cache-agent's, and the router-side
//! residency link's (it runs in this crate). The one place each name is written; the code,
//! the dashboards' test and the alert rules' test use these.

pub const AGENT_ACCEPT_ERRORS_TOTAL: &str = "warmpath_agent_accept_errors_total";
pub const AGENT_BLOCKS: &str = "warmpath_agent_blocks";
pub const AGENT_BYTES_TOTAL: &str = "warmpath_agent_bytes_total";
pub const AGENT_CAPACITY_BYTES: &str = "warmpath_agent_capacity_bytes";
pub const AGENT_CONNECTIONS_REFUSED_TOTAL: &str = "warmpath_agent_connections_refused_total";
pub const AGENT_EVICTIONS_TOTAL: &str = "warmpath_agent_evictions_total";
pub const AGENT_HYPERPOD_BYTES_TOTAL: &str = "warmpath_agent_hyperpod_bytes_total";
pub const AGENT_HYPERPOD_CAPACITY_BYTES: &str = "warmpath_agent_hyperpod_capacity_bytes";
pub const AGENT_HYPERPOD_CONFLICTS_TOTAL: &str = "warmpath_agent_hyperpod_conflicts_total";
pub const AGENT_HYPERPOD_EVICTIONS_TOTAL: &str = "warmpath_agent_hyperpod_evictions_total";
pub const AGENT_HYPERPOD_LEASE_EXPIRIES_TOTAL: &str =
    "warmpath_agent_hyperpod_lease_expiries_total";
pub const AGENT_HYPERPOD_LEASES: &str = "warmpath_agent_hyperpod_leases";
pub const AGENT_HYPERPOD_LEASES_TOTAL: &str = "warmpath_agent_hyperpod_leases_total";
pub const AGENT_HYPERPOD_MISSES_TOTAL: &str = "warmpath_agent_hyperpod_misses_total";
pub const AGENT_HYPERPOD_OBJECTS: &str = "warmpath_agent_hyperpod_objects";
pub const AGENT_HYPERPOD_OCCUPANCY_BYTES: &str = "warmpath_agent_hyperpod_occupancy_bytes";
pub const AGENT_HYPERPOD_OP_DURATION_SECONDS: &str = "warmpath_agent_hyperpod_op_duration_seconds";
pub const AGENT_HYPERPOD_PUTS_TOTAL: &str = "warmpath_agent_hyperpod_puts_total";
pub const AGENT_HYPERPOD_REQUEST_ERRORS_TOTAL: &str =
    "warmpath_agent_hyperpod_request_errors_total";
pub const AGENT_HITS_TOTAL: &str = "warmpath_agent_hits_total";
pub const AGENT_KV_BATCHES_TOTAL: &str = "warmpath_agent_kv_batches_total";
pub const AGENT_KV_EVENTS_TOTAL: &str = "warmpath_agent_kv_events_total";
pub const AGENT_KV_REPLAYS_TOTAL: &str = "warmpath_agent_kv_replays_total";
pub const AGENT_KV_RESYNCS_TOTAL: &str = "warmpath_agent_kv_resyncs_total";
pub const AGENT_L2_DAMAGED_TOTAL: &str = "warmpath_agent_l2_damaged_total";
pub const AGENT_L2_ERRORS_TOTAL: &str = "warmpath_agent_l2_errors_total";
pub const AGENT_L2_OP_DURATION_SECONDS: &str = "warmpath_agent_l2_op_duration_seconds";
pub const AGENT_L2_WRITE_DROPPED_TOTAL: &str = "warmpath_agent_l2_write_dropped_total";
pub const AGENT_LEARNED_TENANTS: &str = "warmpath_agent_learned_tenants";
pub const AGENT_LEARNED_TENANTS_VERSION: &str = "warmpath_agent_learned_tenants_version";
pub const AGENT_LEASED_BLOCKS: &str = "warmpath_agent_leased_blocks";
pub const AGENT_LEASES: &str = "warmpath_agent_leases";
pub const AGENT_LEASES_TOTAL: &str = "warmpath_agent_leases_total";
pub const AGENT_LOOKUP_BLOCKS_TOTAL: &str = "warmpath_agent_lookup_blocks_total";
pub const AGENT_MISSES_TOTAL: &str = "warmpath_agent_misses_total";
pub const AGENT_OCCUPANCY_BYTES: &str = "warmpath_agent_occupancy_bytes";
pub const AGENT_OP_DURATION_SECONDS: &str = "warmpath_agent_op_duration_seconds";
pub const AGENT_PINNED_BLOCKS: &str = "warmpath_agent_pinned_blocks";
pub const AGENT_SEALED_BLOCKS: &str = "warmpath_agent_sealed_blocks";
pub const AGENT_PINS_ENDED_TOTAL: &str = "warmpath_agent_pins_ended_total";
pub const AGENT_LM_REQUESTS_TOTAL: &str = "warmpath_agent_lm_requests_total";
pub const AGENT_HANDSHAKES_DISPLACED_TOTAL: &str = "warmpath_agent_handshakes_displaced_total";
pub const AGENT_FRAMES_REFUSED_TOTAL: &str = "warmpath_agent_frames_refused_total";
pub const AGENT_PREFETCH_BLOCKS_TOTAL: &str = "warmpath_agent_prefetch_blocks_total";
pub const AGENT_ALIASES_TOTAL: &str = "warmpath_agent_aliases_total";
pub const AGENT_PROMOTIONS_TOTAL: &str = "warmpath_agent_promotions_total";
pub const AGENT_PROTOCOL_ERRORS_TOTAL: &str = "warmpath_agent_protocol_errors_total";
pub const AGENT_PUT_REFUSED_TOTAL: &str = "warmpath_agent_put_refused_total";
pub const AGENT_REQUEST_ERRORS_TOTAL: &str = "warmpath_agent_request_errors_total";
pub const AGENT_TENANT_TABLES_REFUSED_TOTAL: &str = "warmpath_agent_tenant_tables_refused_total";

/// Every name above.
pub const ALL: &[&str] = &[
    AGENT_ACCEPT_ERRORS_TOTAL,
    AGENT_BLOCKS,
    AGENT_BYTES_TOTAL,
    AGENT_CAPACITY_BYTES,
    AGENT_CONNECTIONS_REFUSED_TOTAL,
    AGENT_EVICTIONS_TOTAL,
    AGENT_HYPERPOD_BYTES_TOTAL,
    AGENT_HYPERPOD_CAPACITY_BYTES,
    AGENT_HYPERPOD_CONFLICTS_TOTAL,
    AGENT_HYPERPOD_EVICTIONS_TOTAL,
    AGENT_HYPERPOD_LEASE_EXPIRIES_TOTAL,
    AGENT_HYPERPOD_LEASES,
    AGENT_HYPERPOD_LEASES_TOTAL,
    AGENT_HYPERPOD_MISSES_TOTAL,
    AGENT_HYPERPOD_OBJECTS,
    AGENT_HYPERPOD_OCCUPANCY_BYTES,
    AGENT_HYPERPOD_OP_DURATION_SECONDS,
    AGENT_HYPERPOD_PUTS_TOTAL,
    AGENT_HYPERPOD_REQUEST_ERRORS_TOTAL,
    AGENT_HITS_TOTAL,
    AGENT_KV_BATCHES_TOTAL,
    AGENT_KV_EVENTS_TOTAL,
    AGENT_KV_REPLAYS_TOTAL,
    AGENT_KV_RESYNCS_TOTAL,
    AGENT_L2_DAMAGED_TOTAL,
    AGENT_L2_ERRORS_TOTAL,
    AGENT_L2_OP_DURATION_SECONDS,
    AGENT_L2_WRITE_DROPPED_TOTAL,
    AGENT_LEARNED_TENANTS,
    AGENT_LEARNED_TENANTS_VERSION,
    AGENT_LEASED_BLOCKS,
    AGENT_LEASES,
    AGENT_LEASES_TOTAL,
    AGENT_LOOKUP_BLOCKS_TOTAL,
    AGENT_MISSES_TOTAL,
    AGENT_OCCUPANCY_BYTES,
    AGENT_OP_DURATION_SECONDS,
    AGENT_PINNED_BLOCKS,
    AGENT_SEALED_BLOCKS,
    AGENT_PINS_ENDED_TOTAL,
    AGENT_LM_REQUESTS_TOTAL,
    AGENT_HANDSHAKES_DISPLACED_TOTAL,
    AGENT_FRAMES_REFUSED_TOTAL,
    AGENT_PREFETCH_BLOCKS_TOTAL,
    AGENT_ALIASES_TOTAL,
    AGENT_PROMOTIONS_TOTAL,
    AGENT_PROTOCOL_ERRORS_TOTAL,
    AGENT_PUT_REFUSED_TOTAL,
    AGENT_REQUEST_ERRORS_TOTAL,
    AGENT_TENANT_TABLES_REFUSED_TOTAL,
];
