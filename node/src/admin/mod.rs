//! The admin API of a router and the `warmpath admin …` CLI that uses it.
//!
//! - [`api`]: the HTTP API (`/admin/v1/…`, its own port, JSON, bearer-token authenticated)
//!   over the tenant configuration in Raft and the router's own facts.
//! - [`openapi`]: the hand-written OpenAPI 3.0 document the API serves.
//! - [`cli`]: the command-line client, printing aligned tables or raw JSON.
//! - [`wire`]: the HTTP contract as data (prefix, operations, request bodies), which the
//!   other three read.
//! - `testing` (tests only): the harness the API's and the CLI's tests share.

pub mod api;
pub mod cli;
pub mod openapi;
pub mod wire;

#[cfg(test)]
mod testing;

pub use api::{routes, AdminDeps, RouterInfo};
pub use cli::{run, AdminArgs};
