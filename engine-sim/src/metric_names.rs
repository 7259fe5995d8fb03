//! The names of the metrics this crate exports: engine-sim's (beside the vLLM-named ones it exports as vLLM does). The one place each name is
//! written; the code, the dashboards' test and the alert rules' test use these.

pub const ENGINE_AGENT_BLOCKS_TOTAL: &str = "warmpath_engine_agent_blocks_total";
pub const ENGINE_AGENT_ERRORS_TOTAL: &str = "warmpath_engine_agent_errors_total";
pub const ENGINE_AGENT_ARRIVAL_LOOKUPS_TOTAL: &str = "warmpath_engine_agent_arrival_lookups_total";
pub const ENGINE_AGENT_OBJECTS_TOTAL: &str = "warmpath_engine_agent_objects_total";
pub const ENGINE_PREFIX_HIT_TOKENS_TOTAL: &str = "warmpath_engine_prefix_hit_tokens_total";
pub const ENGINE_PREFILL_GPU_SECONDS_TOTAL: &str = "warmpath_engine_prefill_gpu_seconds_total";

/// Every name above.
pub const ALL: &[&str] = &[
    ENGINE_AGENT_BLOCKS_TOTAL,
    ENGINE_AGENT_ERRORS_TOTAL,
    ENGINE_AGENT_ARRIVAL_LOOKUPS_TOTAL,
    ENGINE_AGENT_OBJECTS_TOTAL,
    ENGINE_PREFIX_HIT_TOKENS_TOTAL,
    ENGINE_PREFILL_GPU_SECONDS_TOTAL,
];
