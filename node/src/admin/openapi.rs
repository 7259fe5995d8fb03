//! The OpenAPI 3.1 document of the admin API.
//!
//! The schemas of what the API stores and takes (`TenantSpec`, `PoolSpec`, the inputs) are
//! generated from the Rust types by utoipa, so the document cannot drift from them; the
//! operations (paths, parameters, status codes, the small answer envelopes) are the HTTP
//! contract and are written here. Every operation of [`super::wire::ROUTES`] is in the
//! document (a test checks both ways, and that every `$ref` resolves); paths are relative
//! to the server URL `/admin/v1`.

use serde_json::{json, Map, Value};
use utoipa::ToSchema;
use warmpath_membership::raft::state::{PoolSpec, TenantSpec};

/// The JSON schema utoipa generates for `T`, and those of the types it refers to.
fn generated<T: ToSchema>(into: &mut Map<String, Value>) {
    let mut deps = Vec::new();
    T::schemas(&mut deps);
    for (name, schema) in deps {
        into.insert(name, serde_json::to_value(schema).unwrap_or_default());
    }
    into.insert(
        T::name().to_string(),
        serde_json::to_value(T::schema()).unwrap_or_default(),
    );
}

/// A reference to a component schema.
fn schema(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn param(name: &str) -> Value {
    json!({"$ref": format!("#/components/parameters/{name}")})
}

fn json_content(s: Value) -> Value {
    json!({"application/json": {"schema": s}})
}

/// One operation: a summary, its parameters, an optional request body schema, the success
/// (status, description, schema) and the error responses it may give.
fn op(
    summary: &str,
    params: &[&str],
    body: Option<Value>,
    ok: (&str, &str, Value),
    errors: &[&str],
) -> Value {
    let mut responses = Map::new();
    responses.insert(
        ok.0.to_string(),
        json!({"description": ok.1, "content": json_content(ok.2)}),
    );
    for e in ["401"].iter().chain(errors) {
        responses.insert(
            e.to_string(),
            json!({"$ref": format!("#/components/responses/E{e}")}),
        );
    }
    let mut o = json!({
        "summary": summary,
        "parameters": params.iter().map(|p| param(p)).collect::<Vec<_>>(),
        "responses": responses,
    });
    if let Some(b) = body {
        o["requestBody"] = json!({"required": true, "content": json_content(b)});
    }
    o
}

const READ_ERRORS: &[&str] = &["400", "503", "504"];
const WRITE_ERRORS: &[&str] = &["400", "404", "409", "421", "503", "504"];

fn write_result() -> Value {
    schema("WriteResult")
}

/// The document.
pub fn document() -> Value {
    with_puts(json!({
        "openapi": "3.1.0",
        "info": {
            "title": "warmpath admin API",
            "version": "1",
            "description": "Tenant configuration (in Raft), pools and instances, cluster and \
                Raft status, index statistics and route explain. Every request needs \
                `Authorization: Bearer <admin token>`. Reads are linearizable unless \
                `?consistency=local`; each read answer carries the config `version` (also \
                as `ETag`). Writes are compare-and-set with `If-Match: <version>` or \
                `?expected_version=N`. A 504 on a write means it MAY have been applied: \
                re-read, never assume it was lost."
        },
        "servers": [{"url": "/admin/v1"}],
        "security": [{"bearer": []}],
        "paths": {
            "/openapi.json": {
                "get": op("This document", &[], None,
                    ("200", "The OpenAPI document", json!({"type": "object"})), &[]),
            },
            "/tenants": {
                "get": op("List tenants", &["Consistency"], None,
                    ("200", "Every tenant by id", schema("TenantList")), READ_ERRORS),
            },
            "/tenants/{id}": {
                "get": op("Get a tenant", &["TenantId", "Consistency"], None,
                    ("200", "The tenant", schema("TenantRead")), &["400", "404", "503", "504"]),
                "put": {},
                "delete": op("Delete a tenant", &["TenantId", "IfMatch", "ExpectedVersion"], None,
                    ("200", "Deleted", write_result()), WRITE_ERRORS),
            },
            "/tenants/{id}/api-keys": {
                "post": op("Add an API key (stored as its blake3 hash)",
                    &["TenantId", "IfMatch", "ExpectedVersion"], Some(schema("KeyInput")),
                    ("201", "Added; the answer carries the key's hash", schema("KeyAdded")),
                    WRITE_ERRORS),
            },
            "/tenants/{id}/api-keys/{hash}": {
                "delete": op("Remove an API key by its hash",
                    &["TenantId", "KeyHash", "IfMatch", "ExpectedVersion"], None,
                    ("200", "Removed", write_result()), WRITE_ERRORS),
            },
            "/pools": {
                "get": op("List pools", &["Consistency"], None,
                    ("200", "Every pool by model", schema("PoolList")), READ_ERRORS),
            },
            "/pools/{model}": {
                "get": op("Get a pool", &["Model", "Consistency"], None,
                    ("200", "The pool", schema("PoolRead")), &["400", "404", "503", "504"]),
                "put": {},
                "delete": op("Delete a pool no tenant uses", &["Model", "IfMatch", "ExpectedVersion"],
                    None, ("200", "Deleted", write_result()), WRITE_ERRORS),
            },
            "/pools/{model}/instances": {
                "post": op("Add an instance to a pool", &["Model", "IfMatch", "ExpectedVersion"],
                    Some(schema("InstanceInput")), ("201", "Added", write_result()), WRITE_ERRORS),
                "delete": op("Remove an instance from a pool",
                    &["Model", "InstanceUrl", "IfMatch", "ExpectedVersion"], None,
                    ("200", "Removed", write_result()), WRITE_ERRORS),
            },
            "/cluster": {
                "get": op("Raft status and gossip peers of this node", &[], None,
                    ("200", "Cluster view", schema("Cluster")), &["400"]),
            },
            "/cluster/learners/{id}": {
                "delete": op("Remove a Raft learner: it stops receiving the log (voters are \
                    refused: change the voters first)", &["LearnerId"], None,
                    ("200", "Removed", write_result()), &["400", "404", "421", "503", "504"]),
            },
            "/index": {
                "get": op("Block index statistics of this router", &[], None,
                    ("200", "Index statistics", schema("IndexStats")), &["400"]),
            },
            "/route/explain": {
                "post": op("Routing dry run: the explained decision, nothing sent",
                    &[], Some(schema("ExplainInput")),
                    ("200", "The decision", schema("Explained")), &["400", "404", "503"]),
            },
        },
        "components": components(),
    }))
}

/// Adds the two PUT operations (created or replaced: 201 or 200).
fn with_puts(mut doc: Value) -> Value {
    let put = |summary: &str, id: &str, body: &str, result: &str| {
        let mut o = op(
            summary,
            &[id, "IfMatch", "ExpectedVersion"],
            Some(schema(body)),
            ("200", "Replaced", schema(result)),
            WRITE_ERRORS,
        );
        o["responses"]["201"] =
            json!({"description": "Created", "content": json_content(schema(result))});
        o
    };
    doc["paths"]["/tenants/{id}"]["put"] = put(
        "Create or replace a tenant; optional fields default, plain `api_keys` are hashed",
        "TenantId",
        "TenantInput",
        "TenantWrite",
    );
    doc["paths"]["/pools/{model}"]["put"] = put(
        "Create or replace the pool of a model",
        "Model",
        "PoolSpec",
        "PoolWrite",
    );
    doc
}

fn components() -> Value {
    let version = json!({"type": "integer", "format": "int64", "minimum": 0,
        "description": "The config version (log index of the last change)"});
    let hash = json!({"type": "string", "pattern": "^[0-9a-f]{64}$",
        "description": "blake3 of an API key, lowercase hex"});
    let with_version = |props: Value, required: &[&str]| {
        let mut p = props;
        p["version"] = version.clone();
        let mut req: Vec<&str> = vec!["version"];
        req.extend_from_slice(required);
        json!({"type": "object", "required": req, "properties": p})
    };
    let error = json!({
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {"type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string"},
            }},
            "problems": {"type": "array", "items": {"type": "string"},
                "description": "On 400 for a refused command: every bad field"},
            "current_version": version,
            "leader_url": {"type": "string", "description": "On 421: the leader"},
        },
    });
    let resp = |description: &str, headers: Value| {
        json!({"description": description, "headers": headers,
            "content": json_content(schema("Error"))})
    };
    let retry = json!({"Retry-After": {"schema": {"type": "integer"},
        "description": "Seconds to wait"}});
    let mut schemas = Map::new();
    generated::<TenantSpec>(&mut schemas);
    generated::<PoolSpec>(&mut schemas);
    generated::<super::wire::TenantInput>(&mut schemas);
    generated::<super::wire::KeyInput>(&mut schemas);
    generated::<super::wire::InstanceInput>(&mut schemas);
    generated::<super::wire::ExplainInput>(&mut schemas);
    let mut components = json!({
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "parameters": {
            "TenantId": {"name": "id", "in": "path", "required": true, "schema": {"type": "string"}},
            "LearnerId": {"name": "id", "in": "path", "required": true,
                "schema": {"type": "integer", "minimum": 0}, "description": "Raft node id"},
            "Model": {"name": "model", "in": "path", "required": true, "schema": {"type": "string"}},
            "KeyHash": {"name": "hash", "in": "path", "required": true, "schema": hash},
            "InstanceUrl": {"name": "url", "in": "query", "required": true,
                "schema": {"type": "string"}, "description": "http://host:port"},
            "Consistency": {"name": "consistency", "in": "query", "required": false,
                "schema": {"type": "string", "enum": ["linearizable", "local"],
                    "default": "linearizable"}},
            "IfMatch": {"name": "If-Match", "in": "header", "required": false,
                "schema": {"type": "string"},
                "description": "Compare-and-set: the version the write expects"},
            "ExpectedVersion": {"name": "expected_version", "in": "query", "required": false,
                "schema": {"type": "integer", "minimum": 0},
                "description": "Compare-and-set, like If-Match"},
        },
        "schemas": {
            "TenantList": with_version(json!({"tenants": {"type": "object",
                "additionalProperties": schema("TenantSpec")}}), &["tenants"]),
            "TenantRead": with_version(json!({"id": {"type": "string"},
                "tenant": schema("TenantSpec")}), &["id", "tenant"]),
            "TenantWrite": with_version(json!({"id": {"type": "string"},
                "tenant": schema("TenantSpec")}), &["id", "tenant"]),
            "PoolList": with_version(json!({"pools": {"type": "object",
                "additionalProperties": schema("PoolSpec")}}), &["pools"]),
            "PoolRead": with_version(json!({"model": {"type": "string"},
                "pool": schema("PoolSpec")}), &["model", "pool"]),
            "PoolWrite": with_version(json!({"model": {"type": "string"},
                "pool": schema("PoolSpec")}), &["model", "pool"]),
            "WriteResult": with_version(json!({}), &[]),
            "KeyAdded": with_version(json!({"key_hash": hash}), &["key_hash"]),
            "RaftStatus": {"type": "object", "properties": {
                "node_id": {"type": "integer"},
                "role": {"type": "string"},
                "leader": {"type": ["integer", "null"]},
                "leader_url": {"type": ["string", "null"]},
                "term": {"type": "integer"},
                "last_log_index": {"type": ["integer", "null"]},
                "applied_index": {"type": ["integer", "null"]},
                "config_version": {"type": "integer"},
                "members": {"type": "object", "additionalProperties": {"type": "string"}},
                "learners": {"type": "object", "additionalProperties": {"type": "string"}},
                "replication_lag": {"type": ["object", "null"],
                    "additionalProperties": {"type": "integer"}},
                "millis_since_quorum_ack": {"type": ["integer", "null"]},
                "quorum_lost": {"type": "boolean", "description":
                    "A leader no quorum has acknowledged for over 2 s: cut off, it refuses writes and linearizable reads"},
            }},
            "Cluster": with_version(json!({"raft": schema("RaftStatus"),
                "gossip": {"type": "object", "description": "Gossip peers and node id"}}),
                &["raft", "gossip"]),
            "IndexStats": with_version(json!({"index": {"type": "object"}}), &["index"]),
            "Explained": with_version(json!({"tenant": {"type": "string"},
                "decision": {"type": "object"}}), &["tenant", "decision"]),
            "Error": error,
        },
        "responses": {
            "E400": resp("Bad input: the message says what is wrong; a refused command lists \
                every bad field in `problems`", json!({})),
            "E401": resp("No or a wrong admin token", json!({})),
            "E404": resp("No such tenant, pool, instance or key", json!({})),
            "E409": resp("Stale If-Match / expected_version; `current_version` says the \
                version now", json!({})),
            "E421": resp("This node is not the leader; `leader_url` names it", json!({})),
            "E503": resp("No leader or no quorum now; retry after Retry-After", retry),
            "E504": resp("Timed out; for a write the outcome is unknown: it MAY have been \
                applied, re-read before retrying", json!({})),
        },
    });
    if let Some(hand) = components["schemas"].as_object_mut() {
        hand.extend(schemas);
    }
    components
}

#[cfg(test)]
mod tests {
    use super::super::wire::ROUTES;
    use super::*;

    #[test]
    fn openapi_lists_every_route_and_only_those() {
        let doc = document();
        let text = serde_json::to_string(&doc).unwrap_or_default();
        let parsed: Value = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(parsed["openapi"], json!("3.1.0"));
        // The tenant schema is the type's: every field of TenantSpec, each optional.
        let spec = &parsed["components"]["schemas"]["TenantSpec"];
        let fields = serde_json::to_value(TenantSpec::default()).unwrap_or_default();
        for field in fields.as_object().map(|o| o.keys()).into_iter().flatten() {
            assert!(
                spec["properties"][field].is_object(),
                "TenantSpec.{field}: {spec}"
            );
        }
        assert!(
            spec["required"].as_array().is_none_or(|r| r.is_empty()),
            "{spec}"
        );
        let paths = parsed["paths"].as_object().cloned().unwrap_or_default();
        for (method, path) in ROUTES {
            let op = &paths.get(*path).unwrap_or(&Value::Null)[*method];
            assert!(
                op["responses"].is_object(),
                "{method} {path} missing from the document"
            );
            assert!(op["responses"]["401"].is_object(), "{method} {path}: 401");
        }
        let mut listed = 0;
        for (path, item) in &paths {
            for method in item.as_object().map(|m| m.keys()).into_iter().flatten() {
                assert!(
                    ROUTES.contains(&(method.as_str(), path.as_str())),
                    "{method} {path} documented but not served"
                );
                listed += 1;
            }
        }
        assert_eq!(listed, ROUTES.len());
        // Every $ref resolves.
        let mut refs = Vec::new();
        collect_refs(&parsed, &mut refs);
        for r in refs {
            let pointer = r.trim_start_matches('#');
            assert!(parsed.pointer(pointer).is_some(), "dangling $ref {r}");
        }
    }

    fn collect_refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    if k == "$ref" {
                        if let Some(s) = x.as_str() {
                            out.push(s.to_string());
                        }
                    } else {
                        collect_refs(x, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| collect_refs(x, out)),
            _ => {}
        }
    }
}
