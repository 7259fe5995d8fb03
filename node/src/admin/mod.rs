//! The admin API of a router and the `warmpath admin …` CLI that uses it.
//!
//! - [`api`]: the HTTP API (`/admin/v1/…`, its own port, JSON, bearer-token authenticated)
//!   over the tenant configuration in Raft and the router's own facts.
//! - [`openapi`]: the hand-written OpenAPI 3.0 document the API serves.
//! - [`cli`]: the command-line client, printing aligned tables or raw JSON.

// Until main.rs wires `warmpath admin` to `cli::run` and the router serves `api::routes`,
// nothing outside the tests calls into this module. Remove this line once it is wired.
#![allow(dead_code, unused_imports)]

pub mod api;
pub mod cli;
pub mod openapi;

pub use api::{routes, AdminDeps, RouterInfo};
pub use cli::{run, AdminArgs};
