//! The admin tests' shared harness: one Raft node with the admin API on its listener and
//! a stand-in for the router's own facts. The API's tests ([`super::api`]) and the CLI's
//! ([`super::cli`]) both start it from here, so neither test module reaches into the other.

use super::api::{routes, AdminDeps, RouterInfo};
use super::cli::AdminClient;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use warmpath_membership::raft::{NodeConfig, RaftNode};

/// The bearer token the harness's API takes.
pub(crate) const TOKEN: &str = "admin-secret";

/// The router's facts, made up: two instances, three blocks, a tenant `nobody` unknown.
struct FakeRouter;

impl RouterInfo for FakeRouter {
    fn index_stats(&self) -> Value {
        json!({"blocks": 3, "instances": 2})
    }
    fn explain(&self, tenant: &str, body: &[u8]) -> Result<Value, (u16, String)> {
        if tenant == "nobody" {
            return Err((404, format!("unknown tenant {tenant:?}")));
        }
        Ok(json!({"tenant": tenant, "body_bytes": body.len(), "instance": "http://a:1"}))
    }
    fn cluster(&self) -> Value {
        json!({"node_id": "r1", "peers": []})
    }
}

/// One Raft node with the admin API on the same listener, and a client for it.
pub(crate) struct Harness {
    pub(crate) raft: Arc<RaftNode>,
    pub(crate) base: String,
    _dir: tempfile::TempDir,
    server: tokio::task::JoinHandle<()>,
}

impl Harness {
    /// `extra_voter`: a second voter that never starts, so there is no quorum.
    pub(crate) async fn start(extra_voter: bool) -> Harness {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let dir = tempfile::Builder::new()
            .prefix("warmpath-admin-api-")
            .tempdir()
            .expect("create temp dir");
        let mut voters = BTreeMap::from([(1, base.clone())]);
        if extra_voter {
            voters.insert(2, "http://127.0.0.1:9".to_string());
        }
        let mut cfg = NodeConfig::new(1, base.clone(), dir.path(), voters);
        cfg.write_timeout = if extra_voter {
            Duration::from_millis(800)
        } else {
            Duration::from_secs(15)
        };
        let raft = Arc::new(RaftNode::start(cfg).await.expect("raft starts"));
        let deps = Arc::new(AdminDeps {
            raft: raft.clone(),
            token_hash: *blake3::hash(TOKEN.as_bytes()).as_bytes(),
            router: Arc::new(FakeRouter),
        });
        let app = raft.router().merge(routes(deps));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Harness {
            raft,
            base,
            _dir: dir,
            server,
        }
    }

    /// A client of the harness's API, with `token` as its bearer token.
    pub(crate) fn client(&self, token: Option<&str>) -> AdminClient {
        AdminClient::new(&self.base, token.map(str::to_string)).expect("client")
    }

    /// Shuts the node down and stops the server.
    pub(crate) async fn stop(self) {
        self.raft.shutdown().await;
        self.server.abort();
    }
}
