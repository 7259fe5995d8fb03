//! Tenant configuration in Raft (being written).
