//! The names of the metrics the residency link exports: the agent's end and the router's.
//! The one place each name is written.

/// Routers' links an agent served, by `version` of the link (1 or 2, record 0123).
pub const AGENT_RESIDENCY_LINKS_TOTAL: &str = "warmpath_agent_residency_links_total";
pub const AGENT_RESIDENCY_REFUSED_TOTAL: &str = "warmpath_agent_residency_refused_total";
pub const AGENT_RESIDENCY_ROUTERS_REFUSED_TOTAL: &str =
    "warmpath_agent_residency_routers_refused_total";
pub const AGENT_RESIDENCY_SNAPSHOTS_TOTAL: &str = "warmpath_agent_residency_snapshots_total";
pub const AGENT_RESIDENCY_SUBSCRIBERS: &str = "warmpath_agent_residency_subscribers";
pub const RESIDENCY_BYTES_TOTAL: &str = "warmpath_residency_bytes_total";
pub const ROUTER_RESIDENCY_DISCONNECTS_TOTAL: &str = "warmpath_router_residency_disconnects_total";
pub const ROUTER_RESIDENCY_RESYNCS_TOTAL: &str = "warmpath_router_residency_resyncs_total";

/// Every name above.
pub const ALL: &[&str] = &[
    AGENT_RESIDENCY_LINKS_TOTAL,
    AGENT_RESIDENCY_REFUSED_TOTAL,
    AGENT_RESIDENCY_ROUTERS_REFUSED_TOTAL,
    AGENT_RESIDENCY_SNAPSHOTS_TOTAL,
    AGENT_RESIDENCY_SUBSCRIBERS,
    RESIDENCY_BYTES_TOTAL,
    ROUTER_RESIDENCY_DISCONNECTS_TOTAL,
    ROUTER_RESIDENCY_RESYNCS_TOTAL,
];
