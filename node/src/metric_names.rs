//! The names of the metrics this crate exports: the router's (and its index's, cluster's
//! and configuration's). The one place each name is written; the code, the dashboards' test
//! and the alert rules' test use these.

pub const CLUSTER_DECISIONS_APPLIED_TOTAL: &str = "warmpath_cluster_decisions_applied_total";
pub const CLUSTER_DECISIONS_SENT_TOTAL: &str = "warmpath_cluster_decisions_sent_total";
pub const CLUSTER_DECISIONS_UNKNOWN_INSTANCE_TOTAL: &str =
    "warmpath_cluster_decisions_unknown_instance_total";
pub const CLUSTER_DIGEST_MISMATCHES_TOTAL: &str = "warmpath_cluster_digest_mismatches_total";
pub const CLUSTER_DISSEMINATION_LAG_SECONDS: &str = "warmpath_cluster_dissemination_lag_seconds";
pub const CONFIG_VERSION: &str = "warmpath_config_version";
pub const INDEX_BYTES_PER_ENTRY: &str = "warmpath_index_bytes_per_entry";
pub const INDEX_ENTRIES: &str = "warmpath_index_entries";
pub const INDEX_HOLDERS: &str = "warmpath_index_holders";
pub const INDEX_L2_BLOCKS: &str = "warmpath_index_l2_blocks";
pub const ROUTER_ACCEPT_ERRORS_TOTAL: &str = "warmpath_router_accept_errors_total";
pub const ROUTER_CACHED_TOKENS_TOTAL: &str = "warmpath_router_cached_tokens_total";
pub const ROUTER_CONFIG_FOLLOWED: &str = "warmpath_router_config_followed";
pub const ROUTER_CONNECTIONS: &str = "warmpath_router_connections";
pub const ROUTER_CONNECTIONS_REFUSED_TOTAL: &str = "warmpath_router_connections_refused_total";
pub const ROUTER_DECISIONS_TOTAL: &str = "warmpath_router_decisions_total";
pub const ROUTER_ERRORS_TOTAL: &str = "warmpath_router_errors_total";
pub const ROUTER_INSTANCE_CLUSTER_IN_FLIGHT: &str = "warmpath_router_instance_cluster_in_flight";
pub const ROUTER_INSTANCE_HEALTHY: &str = "warmpath_router_instance_healthy";
pub const ROUTER_INSTANCE_IN_FLIGHT: &str = "warmpath_router_instance_in_flight";
pub const ROUTER_OVERHEAD_SECONDS: &str = "warmpath_router_overhead_seconds";
pub const ROUTER_PREFETCHES_TOTAL: &str = "warmpath_router_prefetches_total";
pub const ROUTER_PREDICTIONS_CONTRADICTED_TOTAL: &str =
    "warmpath_router_predictions_contradicted_total";
pub const ROUTER_PROMPT_TOKENS_TOTAL: &str = "warmpath_router_prompt_tokens_total";
pub const ROUTER_RATE_LIMITED_TOTAL: &str = "warmpath_router_rate_limited_total";
pub const ROUTER_REQUESTS_TOTAL: &str = "warmpath_router_requests_total";
pub const ROUTER_RESIDENCY_AGENTS: &str = "warmpath_router_residency_agents";
pub const ROUTER_RESIDENCY_CHANGES_TOTAL: &str = "warmpath_router_residency_changes_total";
pub const ROUTER_RESIDENCY_LAG_SECONDS: &str = "warmpath_router_residency_lag_seconds";
pub const ROUTER_STREAM_BREAKS_TOTAL: &str = "warmpath_router_stream_breaks_total";
pub const ROUTER_TENANT_STRATEGY_FALLBACKS_TOTAL: &str =
    "warmpath_router_tenant_strategy_fallbacks_total";
pub const ROUTER_TOKENIZE_SECONDS: &str = "warmpath_router_tokenize_seconds";
pub const ROUTER_TOKENIZER_ERRORS: &str = "warmpath_router_tokenizer_errors";
pub const ROUTER_UPSTREAM_FAILURES_TOTAL: &str = "warmpath_router_upstream_failures_total";

/// Every name above.
pub const ALL: &[&str] = &[
    CLUSTER_DECISIONS_APPLIED_TOTAL,
    CLUSTER_DECISIONS_SENT_TOTAL,
    CLUSTER_DECISIONS_UNKNOWN_INSTANCE_TOTAL,
    CLUSTER_DIGEST_MISMATCHES_TOTAL,
    CLUSTER_DISSEMINATION_LAG_SECONDS,
    CONFIG_VERSION,
    INDEX_BYTES_PER_ENTRY,
    INDEX_ENTRIES,
    INDEX_HOLDERS,
    INDEX_L2_BLOCKS,
    ROUTER_ACCEPT_ERRORS_TOTAL,
    ROUTER_CACHED_TOKENS_TOTAL,
    ROUTER_CONFIG_FOLLOWED,
    ROUTER_CONNECTIONS,
    ROUTER_CONNECTIONS_REFUSED_TOTAL,
    ROUTER_DECISIONS_TOTAL,
    ROUTER_ERRORS_TOTAL,
    ROUTER_INSTANCE_CLUSTER_IN_FLIGHT,
    ROUTER_INSTANCE_HEALTHY,
    ROUTER_INSTANCE_IN_FLIGHT,
    ROUTER_OVERHEAD_SECONDS,
    ROUTER_PREFETCHES_TOTAL,
    ROUTER_PREDICTIONS_CONTRADICTED_TOTAL,
    ROUTER_PROMPT_TOKENS_TOTAL,
    ROUTER_RATE_LIMITED_TOTAL,
    ROUTER_REQUESTS_TOTAL,
    ROUTER_RESIDENCY_AGENTS,
    ROUTER_RESIDENCY_CHANGES_TOTAL,
    ROUTER_RESIDENCY_LAG_SECONDS,
    ROUTER_STREAM_BREAKS_TOTAL,
    ROUTER_TENANT_STRATEGY_FALLBACKS_TOTAL,
    ROUTER_TOKENIZE_SECONDS,
    ROUTER_TOKENIZER_ERRORS,
    ROUTER_UPSTREAM_FAILURES_TOTAL,
];
