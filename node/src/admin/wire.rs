//! The admin API's HTTP contract as data: where it lives ([`PREFIX`]), its operations
//! ([`ROUTES`], which the OpenAPI document must list exactly), and the bodies clients send
//! (the `*Input` types, whose schemas the document generates). The server ([`super::api`]),
//! the document ([`super::openapi`]) and the CLI ([`super::cli`]) all read it here; it
//! reads none of them.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use warmpath_membership::raft::state::{api_key_hash, check_plain_key, TenantSpec};

/// Where the API lives.
pub const PREFIX: &str = "/admin/v1";

/// Every operation, as (method, path under [`PREFIX`]); a test holds the OpenAPI document
/// and this list equal, both ways.
#[cfg(test)]
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/openapi.json"),
    ("get", "/tenants"),
    ("get", "/tenants/{id}"),
    ("put", "/tenants/{id}"),
    ("delete", "/tenants/{id}"),
    ("post", "/tenants/{id}/api-keys"),
    ("delete", "/tenants/{id}/api-keys/{hash}"),
    ("get", "/pools"),
    ("get", "/pools/{model}"),
    ("put", "/pools/{model}"),
    ("delete", "/pools/{model}"),
    ("post", "/pools/{model}/instances"),
    ("delete", "/pools/{model}/instances"),
    ("get", "/cluster"),
    ("delete", "/cluster/learners/{id}"),
    ("get", "/index"),
    ("post", "/route/explain"),
];

/// A tenant as clients send it: a [`TenantSpec`] (any field may be left out and takes its
/// default), plus plain `api_keys` to hash. Unknown fields are refused here, at the edge.
#[derive(Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(
    description = "A tenant to create or replace: a TenantSpec (new tenants must name their pool) plus plain API keys to hash."
)]
pub struct TenantInput {
    /// Plain API keys; hashed before they are stored, never kept.
    #[serde(default)]
    api_keys: Vec<String>,
    #[serde(flatten)]
    spec: TenantSpec,
}

impl TenantInput {
    /// The tenant `id` to store: the spec completed, key hashes in lowercase, the plain
    /// keys hashed; `Err`: every plain key that is not acceptable.
    pub(crate) fn into_spec(self, id: &str) -> Result<TenantSpec, Vec<String>> {
        let mut spec = self.spec.complete(id);
        spec.api_key_hashes = spec
            .api_key_hashes
            .into_iter()
            .map(|h| h.to_ascii_lowercase())
            .collect();
        let mut problems = Vec::new();
        for (i, key) in self.api_keys.iter().enumerate() {
            match check_plain_key(key) {
                Ok(()) => spec.api_key_hashes.push(api_key_hash(key)),
                Err(why) => problems.push(format!("api_keys[{i}]: {why}")),
            }
        }
        if problems.is_empty() {
            Ok(spec)
        } else {
            Err(problems)
        }
    }
}

/// An API key to add to a tenant.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyInput {
    /// The plain API key; only its hash is stored.
    pub(crate) key: String,
}

/// An instance to add to a pool.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InstanceInput {
    /// `http://host:port`.
    pub(crate) url: String,
}

/// A routing dry run.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExplainInput {
    pub(crate) tenant: String,
    /// An OpenAI completions or chat request body.
    #[schema(value_type = Object)]
    pub(crate) request: Value,
}
