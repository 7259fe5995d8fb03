//! The tenant-configuration state machine: plain data, no I/O, no clock.
//!
//! Every router applies the same committed [`Command`]s in log order to a [`ConfigState`]
//! and so holds the same tenant table. [`ConfigState::apply`] is deterministic: it depends
//! only on the state, the log index and the command (validation rules are fixed in this
//! workspace's `warmpath-spec`, never borrowed from elsewhere, so that two builds never
//! disagree about what a command does).
//! A rejected command leaves the state untouched and says why, naming every bad field.
//!
//! `version` is the log index of the last command that changed the state (0 when empty).
//! Blank and membership log entries, and rejected commands, do not change it, so a client
//! that read version `v` can write with `expected_version: Some(v)` (compare-and-set) and
//! only fails if the configuration really changed in between.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

// The specs and their rules live in `warmpath-spec`; the state machine's users name them
// here as well.
pub use warmpath_spec::*;

/// How many write keys the state remembers ([`Command::Once`]): a retry of any of the last
/// this many keyed writes gets the first one's result. Config writes are rare; a retry
/// comes within its 5 s deadline.
pub const MAX_RECENT_WRITES: usize = 4096;
/// Longest write key, bytes.
pub const MAX_WRITE_KEY_BYTES: usize = 128;

/// The replicated tenant configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConfigState {
    /// Log index of the last command that changed this state; 0 for the empty state.
    pub version: u64,
    /// Tenants by id.
    pub tenants: BTreeMap<String, TenantSpec>,
    /// Instance pools by model name.
    pub pools: BTreeMap<String, PoolSpec>,
    /// The keys of the last [`MAX_RECENT_WRITES`] keyed writes and what applying each did,
    /// oldest first: what makes a retried write apply at most once. Not configuration:
    /// readers of tenants and pools never see it; snapshots carry it.
    #[serde(default, skip_serializing_if = "std::collections::VecDeque::is_empty")]
    pub recent_writes: std::collections::VecDeque<RecentWrite>,
}

/// A keyed write the state remembers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecentWrite {
    pub key: String,
    /// xxh3 of the command's JSON: the same key with another command is refused.
    pub command: u64,
    /// What applying it did.
    pub result: CommandResult,
}

/// What identifies a keyed write's command.
fn fingerprint(cmd: &CommandV1) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&serde_json::to_vec(cmd).unwrap_or_default())
}

/// A change to the configuration, as stored in the Raft log.
///
/// The log outlives any one build: variants are only ever appended, never changed or
/// removed, so that every build can replay every log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// The first command set.
    V1(CommandV1),
    /// A command applied at most once per `key`: a later command with the same key (a
    /// follower forwarding a write again after its leader went silent with it, or a
    /// client retrying with the same `Idempotency-Key`) changes nothing and gets the
    /// first one's result, as long as the key is among the last [`MAX_RECENT_WRITES`].
    Once { key: String, command: CommandV1 },
}

/// Commands of version 1. Each `expected_version`, when given, must equal the state's
/// `version` or the command is refused with [`CommandResult::Conflict`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CommandV1 {
    /// Create or replace a tenant.
    PutTenant {
        id: String,
        spec: TenantSpec,
        expected_version: Option<u64>,
    },
    /// Delete a tenant.
    DeleteTenant {
        id: String,
        expected_version: Option<u64>,
    },
    /// Create or replace the pool of a model.
    PutPool {
        model: String,
        spec: PoolSpec,
        expected_version: Option<u64>,
    },
    /// Delete a pool no tenant uses.
    DeletePool {
        model: String,
        expected_version: Option<u64>,
    },
    /// Add an instance to an existing pool.
    AddInstance {
        model: String,
        url: String,
        expected_version: Option<u64>,
    },
    /// Remove an instance from a pool.
    RemoveInstance {
        model: String,
        url: String,
        expected_version: Option<u64>,
    },
    /// Add an API key hash to a tenant.
    AddApiKey {
        tenant: String,
        key_hash: String,
        expected_version: Option<u64>,
    },
    /// Remove an API key hash from a tenant.
    RemoveApiKey {
        tenant: String,
        key_hash: String,
        expected_version: Option<u64>,
    },
    /// Seed an empty configuration (version 0) with these pools and tenants, all or
    /// nothing: a router never sees a seeded cluster with its pools but not yet its
    /// tenants. Refused with [`CommandResult::Conflict`] once anything is configured.
    Seed {
        pools: Vec<(String, PoolSpec)>,
        tenants: Vec<(String, TenantSpec)>,
    },
}

impl CommandV1 {
    fn expected_version(&self) -> Option<u64> {
        match self {
            CommandV1::PutTenant {
                expected_version, ..
            }
            | CommandV1::DeleteTenant {
                expected_version, ..
            }
            | CommandV1::PutPool {
                expected_version, ..
            }
            | CommandV1::DeletePool {
                expected_version, ..
            }
            | CommandV1::AddInstance {
                expected_version, ..
            }
            | CommandV1::RemoveInstance {
                expected_version, ..
            }
            | CommandV1::AddApiKey {
                expected_version, ..
            }
            | CommandV1::RemoveApiKey {
                expected_version, ..
            } => *expected_version,
            CommandV1::Seed { .. } => Some(0),
        }
    }
}

/// What applying a command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandResult {
    /// The state changed; `version` is its new version (the command's log index).
    Applied { version: u64 },
    /// `expected_version` did not match; nothing changed.
    Conflict { current_version: u64 },
    /// The command is malformed; each problem names its field. Nothing changed.
    Invalid { problems: Vec<String> },
    /// The tenant, pool, instance or key named does not exist. Nothing changed.
    NotFound { what: String },
}

impl ConfigState {
    /// Applies `cmd`, committed at log `index`, and says what happened.
    pub fn apply(&mut self, index: u64, cmd: &Command) -> CommandResult {
        match cmd {
            Command::V1(cmd) => self.apply_v1(index, cmd),
            Command::Once { key, command } => {
                if let Some(first) = self.recent_writes.iter().find(|w| w.key == *key) {
                    if first.command != fingerprint(command) {
                        return CommandResult::Invalid {
                            problems: vec![format!(
                                "idempotency key {key:?}: already used for another write"
                            )],
                        };
                    }
                    return first.result.clone();
                }
                if key.is_empty() || key.len() > MAX_WRITE_KEY_BYTES {
                    return CommandResult::Invalid {
                        problems: vec![format!(
                            "idempotency key: 1 to {MAX_WRITE_KEY_BYTES} bytes, not {}",
                            key.len()
                        )],
                    };
                }
                let result = self.apply_v1(index, command);
                if self.recent_writes.len() >= MAX_RECENT_WRITES {
                    self.recent_writes.pop_front();
                }
                self.recent_writes.push_back(RecentWrite {
                    key: key.clone(),
                    command: fingerprint(command),
                    result: result.clone(),
                });
                result
            }
        }
    }

    fn apply_v1(&mut self, index: u64, cmd: &CommandV1) -> CommandResult {
        if let Some(expected) = cmd.expected_version() {
            if expected != self.version {
                return CommandResult::Conflict {
                    current_version: self.version,
                };
            }
        }
        let outcome = match cmd {
            CommandV1::PutTenant { id, spec, .. } => self.put_tenant(id, spec),
            CommandV1::DeleteTenant { id, .. } => match self.tenants.remove(id) {
                Some(_) => Ok(()),
                None => Err(not_found(format!("tenant {id:?}"))),
            },
            CommandV1::PutPool { model, spec, .. } => self.put_pool(model, spec),
            CommandV1::Seed { pools, tenants } => {
                // All or nothing: put everything into a copy, keep it if all went in.
                let mut next = self.clone();
                let mut problems = Vec::new();
                let mut note = |what: String, outcome: Result<(), CommandResult>| match outcome {
                    Ok(()) => {}
                    Err(CommandResult::Invalid { problems: p }) => {
                        problems.extend(p.into_iter().map(|p| format!("{what}: {p}")))
                    }
                    Err(other) => problems.push(format!("{what}: {other:?}")),
                };
                for (model, spec) in pools {
                    let outcome = next.put_pool(model, spec);
                    note(format!("pool {model:?}"), outcome);
                }
                for (id, spec) in tenants {
                    let outcome = next.put_tenant(id, spec);
                    note(format!("tenant {id:?}"), outcome);
                }
                invalid_unless_empty(problems).map(|()| *self = next)
            }
            CommandV1::DeletePool { model, .. } => self.delete_pool(model),
            CommandV1::AddInstance { model, url, .. } => self.add_instance(model, url),
            CommandV1::RemoveInstance { model, url, .. } => {
                let Some(pool) = self.pools.get_mut(model) else {
                    return not_found(format!("pool {model:?}"));
                };
                match pool.instances.iter().position(|u| u == url) {
                    Some(i) => {
                        pool.instances.remove(i);
                        Ok(())
                    }
                    None => Err(not_found(format!("instance {url:?} in pool {model:?}"))),
                }
            }
            CommandV1::AddApiKey {
                tenant, key_hash, ..
            } => self.add_api_key(tenant, key_hash),
            CommandV1::RemoveApiKey {
                tenant, key_hash, ..
            } => {
                let Some(t) = self.tenants.get_mut(tenant) else {
                    return not_found(format!("tenant {tenant:?}"));
                };
                match t.api_key_hashes.iter().position(|h| h == key_hash) {
                    Some(i) => {
                        t.api_key_hashes.remove(i);
                        Ok(())
                    }
                    None => Err(not_found(format!("api key hash of tenant {tenant:?}"))),
                }
            }
        };
        match outcome {
            Ok(()) => {
                self.version = index;
                CommandResult::Applied { version: index }
            }
            Err(refusal) => refusal,
        }
    }

    /// The tenant that owns an API key hash, if any.
    pub fn tenant_of_key(&self, key_hash: &str) -> Option<&str> {
        self.tenants
            .iter()
            .find(|(_, t)| t.api_key_hashes.iter().any(|h| h == key_hash))
            .map(|(id, _)| id.as_str())
    }

    fn put_tenant(&mut self, id: &str, spec: &TenantSpec) -> Result<(), CommandResult> {
        let mut problems = Vec::new();
        check_name("id", id, &mut problems);
        problems.extend(validate_tenant(spec));
        if !spec.pool.is_empty() && !self.pools.contains_key(&spec.pool) {
            problems.push(format!("pool: no pool serves model {:?}", spec.pool));
        }
        for h in &spec.api_key_hashes {
            if let Some(owner) = self.tenant_of_key(h) {
                if owner != id {
                    problems.push(format!(
                        "api_key_hashes: {h:?} already belongs to tenant {owner:?}"
                    ));
                }
            }
        }
        invalid_unless_empty(problems)?;
        self.tenants.insert(id.to_string(), spec.clone());
        Ok(())
    }

    fn put_pool(&mut self, model: &str, spec: &PoolSpec) -> Result<(), CommandResult> {
        let mut problems = pool_problems(model, spec);
        // Only a pool with adapters can clash: logs written before adapters replay alike.
        problems.extend(pool_clashes(
            model,
            spec,
            self.pools.iter().map(|(m, p)| (m.as_str(), p)),
        ));
        invalid_unless_empty(problems)?;
        self.pools.insert(model.to_string(), spec.clone());
        Ok(())
    }

    fn delete_pool(&mut self, model: &str) -> Result<(), CommandResult> {
        if !self.pools.contains_key(model) {
            return Err(not_found(format!("pool {model:?}")));
        }
        let users: Vec<&str> = self
            .tenants
            .iter()
            .filter(|(_, t)| t.pool == model)
            .map(|(id, _)| id.as_str())
            .collect();
        if !users.is_empty() {
            return Err(CommandResult::Invalid {
                problems: vec![format!(
                    "model: pool {model:?} is used by tenants {}",
                    users.join(", ")
                )],
            });
        }
        self.pools.remove(model);
        Ok(())
    }

    fn add_instance(&mut self, model: &str, url: &str) -> Result<(), CommandResult> {
        let Some(pool) = self.pools.get_mut(model) else {
            return Err(not_found(format!("pool {model:?}")));
        };
        let mut problems = Vec::new();
        if let Err(e) = check_instance_url(url) {
            problems.push(format!("url {url:?}: {e}"));
        }
        if pool.instances.iter().any(|u| u == url) {
            problems.push(format!("url {url:?}: already in pool {model:?}"));
        }
        if pool.instances.len() >= MAX_POOL_INSTANCES {
            problems.push(format!(
                "url: pool {model:?} already has {MAX_POOL_INSTANCES} instances"
            ));
        }
        invalid_unless_empty(problems)?;
        pool.instances.push(url.to_string());
        Ok(())
    }

    fn add_api_key(&mut self, tenant: &str, key_hash: &str) -> Result<(), CommandResult> {
        if !self.tenants.contains_key(tenant) {
            return Err(not_found(format!("tenant {tenant:?}")));
        }
        let mut problems = Vec::new();
        if !is_key_hash(key_hash) {
            problems.push("key_hash: not 64 lowercase hex digits".to_string());
        }
        if let Some(owner) = self.tenant_of_key(key_hash) {
            problems.push(if owner == tenant {
                "key_hash: the tenant already has this key".to_string()
            } else {
                format!("key_hash: already belongs to tenant {owner:?}")
            });
        }
        let t = self
            .tenants
            .get_mut(tenant)
            .ok_or_else(|| not_found(format!("tenant {tenant:?}")))?;
        if t.api_key_hashes.len() >= MAX_TENANT_KEYS {
            problems.push(format!(
                "key_hash: tenant already has {MAX_TENANT_KEYS} keys"
            ));
        }
        invalid_unless_empty(problems)?;
        t.api_key_hashes.push(key_hash.to_string());
        Ok(())
    }
}

fn not_found(what: String) -> CommandResult {
    CommandResult::NotFound { what }
}

fn invalid_unless_empty(problems: Vec<String>) -> Result<(), CommandResult> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CommandResult::Invalid { problems })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_applies_all_or_nothing_and_only_to_an_empty_state() {
        let pool = PoolSpec {
            instances: vec!["http://10.0.0.1:8000".into()],
            ..PoolSpec::default()
        };
        let seed = |tenant: TenantSpec| {
            Command::V1(CommandV1::Seed {
                pools: vec![("m".into(), pool.clone())],
                tenants: vec![("acme".into(), tenant)],
            })
        };
        // A bad tenant: nothing applies, not even the pool.
        let mut state = ConfigState::default();
        let bad = tenant(|t| t.strategy = "fastest".into());
        match state.apply(1, &seed(bad)) {
            CommandResult::Invalid { problems } => {
                assert!(
                    problems.iter().any(|p| p.starts_with("tenant \"acme\"")),
                    "{problems:?}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!((state.version, state.pools.len()), (0, 0));
        // A good one: both, in one version.
        assert_eq!(
            state.apply(2, &seed(tenant(|_| {}))),
            CommandResult::Applied { version: 2 }
        );
        assert_eq!((state.pools.len(), state.tenants.len()), (1, 1));
        // Once seeded, a second seed conflicts and changes nothing.
        assert_eq!(
            state.apply(3, &seed(tenant(|_| {}))),
            CommandResult::Conflict { current_version: 2 }
        );
    }

    #[test]
    fn a_keyed_write_applies_at_most_once() {
        let once = |key: &str, cmd: Command| match cmd {
            Command::V1(command) => Command::Once {
                key: key.into(),
                command,
            },
            other => other,
        };
        let mut s = base();
        let first = s.apply(10, &once("k1", put_tenant("beta", tenant(|_| {}))));
        assert_eq!(first, CommandResult::Applied { version: 10 });
        // The same write again (a retry delivered later): nothing changes, and the answer
        // is the first one's.
        let after_first = s.clone();
        let again = s.apply(11, &once("k1", put_tenant("beta", tenant(|_| {}))));
        assert_eq!(again, first);
        assert_eq!(s, after_first);
        // The same key for another write is refused, and changes nothing.
        let other = s.apply(11, &once("k1", put_tenant("gamma", tenant(|_| {}))));
        assert!(matches!(other, CommandResult::Invalid { .. }), "{other:?}");
        assert_eq!(s, after_first);
        // A refusal is remembered too: a retry does not turn it into something else.
        let conflict = Command::V1(CommandV1::DeleteTenant {
            id: "beta".into(),
            expected_version: Some(3),
        });
        let refused = s.apply(12, &once("k2", conflict.clone()));
        assert_eq!(
            refused,
            CommandResult::Conflict {
                current_version: 10
            }
        );
        assert_eq!(s.tenants.len(), 2);
        assert_eq!(s.apply(13, &once("k2", conflict)), refused);
        // Keys are bounded: the oldest is forgotten first.
        for i in 0..MAX_RECENT_WRITES {
            let key = format!("fill-{i}");
            s.apply(
                20 + i as u64,
                &once(&key, put_tenant("beta", tenant(|_| {}))),
            );
        }
        assert_eq!(s.recent_writes.len(), MAX_RECENT_WRITES);
        assert!(!s.recent_writes.iter().any(|w| w.key == "k1"));
        let long = "k".repeat(MAX_WRITE_KEY_BYTES + 1);
        assert!(matches!(
            s.apply(9000, &once(&long, put_tenant("x", tenant(|_| {})))),
            CommandResult::Invalid { .. }
        ));
        // The keys survive a snapshot (the state's serialized form); old snapshots
        // without them read as none.
        let json = serde_json::to_string(&s).unwrap();
        let back: ConfigState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        let old: ConfigState =
            serde_json::from_str(r#"{"version":1,"tenants":{},"pools":{}}"#).unwrap();
        assert!(old.recent_writes.is_empty());
    }

    #[test]
    fn tenant_validation_names_every_bad_field() {
        check(
            put_tenant(
                "bad",
                tenant(|t| {
                    t.strategy = "fastest".into();
                    t.block_tokens = 0;
                    t.temperature = f64::NAN;
                    t.pool = "nope".into();
                    t.api_key_hashes = vec!["xyz".into()];
                    t.cache_salt = String::new();
                    t.rate_limit_rps = Some(0.0);
                }),
            ),
            invalid(&[
                "strategy \"fastest\": not one of round-robin, least-loaded, prefix-aware, kv-aware",
                "block_tokens: must be positive",
                "temperature NaN: must be a finite non-negative number",
                "api_key_hashes[0]: not 64 lowercase hex digits",
                "cache_salt: empty",
                "rate_limit_rps 0: must be a finite positive number",
                "pool: no pool serves model \"nope\"",
            ]),
        );
        check(
            put_tenant("", tenant(|t| t.temperature = -1.0)),
            invalid(&[
                "id: empty",
                "temperature -1: must be a finite non-negative number",
            ]),
        );
        check(
            put_tenant("a b", tenant(|t| t.pool = String::new())),
            invalid(&[
                "id \"a b\": contains whitespace or control characters",
                "pool: empty",
            ]),
        );
        check(
            put_tenant("other", tenant(|t| t.api_key_hashes = vec![H1.into(), H2.into(), H2.into()])),
            invalid(&[
                "api_key_hashes[2]: listed twice",
                "api_key_hashes: \"1111111111111111111111111111111111111111111111111111111111111111\" already belongs to tenant \"acme\"",
            ]),
        );
    }

    #[test]
    fn tenant_put_and_replace() {
        for strategy in STRATEGIES {
            let s = check(
                put_tenant("t2", tenant(|t| t.strategy = strategy.into())),
                CommandResult::Applied { version: 10 },
            );
            assert_eq!(s.tenants["t2"].strategy, strategy);
            assert_eq!(s.version, 10);
        }
        // Replacing a tenant may keep its own keys.
        let s = check(
            put_tenant(
                "acme",
                tenant(|t| {
                    t.api_key_hashes = vec![H1.into()];
                    t.rate_limit_rps = Some(5.0);
                }),
            ),
            CommandResult::Applied { version: 10 },
        );
        assert_eq!(s.tenants["acme"].rate_limit_rps, Some(5.0));
    }

    #[test]
    fn compare_and_set() {
        let cas = |v| {
            Command::V1(CommandV1::DeleteTenant {
                id: "acme".into(),
                expected_version: Some(v),
            })
        };
        check(cas(1), CommandResult::Conflict { current_version: 2 });
        check(cas(3), CommandResult::Conflict { current_version: 2 });
        let s = check(cas(2), CommandResult::Applied { version: 10 });
        assert!(s.tenants.is_empty());
        // A conflict wins over not-found and invalid: the client's view is stale.
        check(
            Command::V1(CommandV1::AddInstance {
                model: "nope".into(),
                url: "bad".into(),
                expected_version: Some(0),
            }),
            CommandResult::Conflict { current_version: 2 },
        );
    }

    #[test]
    fn refused_commands_keep_the_version() {
        let mut s = base();
        assert!(matches!(
            s.apply(7, &put_pool("", &[])),
            CommandResult::Invalid { .. }
        ));
        assert_eq!(s.version, 2);
        assert_eq!(
            s.apply(
                8,
                &Command::V1(CommandV1::DeleteTenant {
                    id: "x".into(),
                    expected_version: None
                })
            ),
            CommandResult::NotFound {
                what: "tenant \"x\"".into()
            }
        );
        assert_eq!(s.version, 2);
    }

    #[test]
    fn pools() {
        check(
            put_pool(
                "m2",
                &[
                    "https://a:1",
                    "http://a",
                    "http://a:1/v1",
                    "http://:1",
                    "http://a:0",
                    "http://a:99999",
                    "http://[::1]:8000",
                    "http://[::1]:8000",
                ],
            ),
            invalid(&[
                "instances[0] \"https://a:1\": must start with http://",
                "instances[1] \"http://a\": write it as \"http://a:80\"",
                "instances[2] \"http://a:1/v1\": give http://host:port without path, query or user",
                "instances[3] \"http://:1\": bad host",
                "instances[4] \"http://a:0\": port 0",
                "instances[5] \"http://a:99999\": bad port \"99999\"",
                "instances[7] \"http://[::1]:8000\": listed twice",
            ]),
        );
        let s = check(put_pool("m2", &[]), CommandResult::Applied { version: 10 });
        assert!(s.pools["m2"].instances.is_empty());
        check(
            Command::V1(CommandV1::DeletePool {
                model: "m".into(),
                expected_version: None,
            }),
            invalid(&["model: pool \"m\" is used by tenants acme"]),
        );
        check(
            Command::V1(CommandV1::DeletePool {
                model: "zz".into(),
                expected_version: None,
            }),
            CommandResult::NotFound {
                what: "pool \"zz\"".into(),
            },
        );
    }

    #[test]
    fn instances() {
        let add = |model: &str, url: &str| {
            Command::V1(CommandV1::AddInstance {
                model: model.into(),
                url: url.into(),
                expected_version: None,
            })
        };
        let remove = |model: &str, url: &str| {
            Command::V1(CommandV1::RemoveInstance {
                model: model.into(),
                url: url.into(),
                expected_version: None,
            })
        };
        let s = check(
            add("m", "http://c:3"),
            CommandResult::Applied { version: 10 },
        );
        assert_eq!(
            s.pools["m"].instances,
            ["http://a:1", "http://b:2", "http://c:3"]
        );
        check(
            add("m", "http://a:1"),
            invalid(&["url \"http://a:1\": already in pool \"m\""]),
        );
        check(
            add("m", "ftp://x"),
            invalid(&["url \"ftp://x\": must start with http://"]),
        );
        check(
            add("q", "http://c:3"),
            CommandResult::NotFound {
                what: "pool \"q\"".into(),
            },
        );
        let s = check(
            remove("m", "http://a:1"),
            CommandResult::Applied { version: 10 },
        );
        assert_eq!(s.pools["m"].instances, ["http://b:2"]);
        check(
            remove("m", "http://z:1"),
            CommandResult::NotFound {
                what: "instance \"http://z:1\" in pool \"m\"".into(),
            },
        );
    }

    #[test]
    fn api_keys() {
        let add = |tenant: &str, h: &str| {
            Command::V1(CommandV1::AddApiKey {
                tenant: tenant.into(),
                key_hash: h.into(),
                expected_version: None,
            })
        };
        let remove = |tenant: &str, h: &str| {
            Command::V1(CommandV1::RemoveApiKey {
                tenant: tenant.into(),
                key_hash: h.into(),
                expected_version: None,
            })
        };
        let s = check(add("acme", H2), CommandResult::Applied { version: 10 });
        assert_eq!(s.tenant_of_key(H2), Some("acme"));
        check(
            add("acme", H1),
            invalid(&["key_hash: the tenant already has this key"]),
        );
        check(
            add("acme", &"AB".repeat(32)),
            invalid(&["key_hash: not 64 lowercase hex digits"]),
        );
        check(
            add("nobody", H2),
            CommandResult::NotFound {
                what: "tenant \"nobody\"".into(),
            },
        );
        let s = check(remove("acme", H1), CommandResult::Applied { version: 10 });
        assert!(s.tenants["acme"].api_key_hashes.is_empty());
        check(
            remove("acme", H2),
            CommandResult::NotFound {
                what: "api key hash of tenant \"acme\"".into(),
            },
        );
        // Another tenant cannot take acme's key.
        let mut s = base();
        s.apply(11, &put_tenant("b", tenant(|_| {})));
        assert_eq!(
            s.apply(12, &add("b", H1)),
            invalid(&["key_hash: already belongs to tenant \"acme\""])
        );
    }

    #[test]
    fn stored_specs_ignore_fields_a_newer_build_adds() {
        // A newer router wrote a field this build does not know: the log still applies.
        let json = r#"{"V1":{"PutTenant":{"id":"t","spec":{"strategy":"kv-aware","pool":"m",
            "cache_salt":"s","brand_new_knob":7},"expected_version":null}}}"#;
        let cmd: Command = serde_json::from_str(json).expect("parses");
        let Command::V1(CommandV1::PutTenant { spec, .. }) = cmd else {
            panic!("a PutTenant");
        };
        assert_eq!(
            spec,
            TenantSpec {
                strategy: "kv-aware".into(),
                pool: "m".into(),
                cache_salt: "s".into(),
                ..TenantSpec::default()
            }
        );
        let pool: PoolSpec =
            serde_json::from_str(r#"{"instances":["http://a:1"],"weights":[1]}"#).expect("parses");
        assert_eq!(pool.instances, vec!["http://a:1".to_string()]);
        // Input surfaces find the fields to refuse.
        let keys: Vec<String> = ["strategy", "stratgy", "api_keys"]
            .iter()
            .map(|k| k.to_string())
            .collect();
        assert_eq!(
            TenantSpec::unknown_fields(&keys, &["api_keys"]),
            vec!["stratgy".to_string()]
        );
    }

    #[test]
    fn commands_round_trip_through_json_and_postcard() {
        let cmds = [
            put_pool("m", &["http://a:1"]),
            put_tenant("acme", tenant(|t| t.rate_limit_rps = Some(2.5))),
        ];
        for cmd in cmds {
            let json = serde_json::to_string(&cmd).unwrap_or_default();
            assert_eq!(
                serde_json::from_str::<Command>(&json).ok(),
                Some(cmd.clone())
            );
            let bin = postcard::to_allocvec(&cmd).unwrap_or_default();
            assert_eq!(postcard::from_bytes::<Command>(&bin).ok(), Some(cmd));
        }
        let s = base();
        let json = serde_json::to_vec(&s).unwrap_or_default();
        assert_eq!(serde_json::from_slice::<ConfigState>(&json).ok(), Some(s));
    }

    #[test]
    fn an_adapter_names_one_pool_and_old_entries_have_none() {
        let with_adapters = |model: &str, adapters: &[&str]| {
            Command::V1(CommandV1::PutPool {
                model: model.into(),
                spec: PoolSpec {
                    instances: vec!["http://a:1".into()],
                    adapters: adapters.iter().map(|a| a.to_string()).collect(),
                    ..PoolSpec::default()
                },
                expected_version: None,
            })
        };
        let mut s = base();
        // A pool replaced with its own adapters is no clash with itself.
        for version in [3, 4] {
            assert_eq!(
                s.apply(version, &with_adapters("m", &["sql-lora"])),
                CommandResult::Applied { version }
            );
        }
        for (model, adapters, problem) in [
            (
                "sql-lora",
                &[][..],
                "model: \"sql-lora\" is an adapter of pool \"m\"",
            ),
            (
                "q",
                &["sql-lora"][..],
                "adapters[0] \"sql-lora\": already an adapter of pool \"m\"",
            ),
            (
                "q",
                &["m"][..],
                "adapters[0] \"m\": the model of another pool",
            ),
        ] {
            assert_eq!(
                s.apply(5, &with_adapters(model, adapters)),
                CommandResult::Invalid {
                    problems: vec![problem.to_string()]
                },
                "{model} {adapters:?}"
            );
        }
        assert_eq!(s.pools["m"].adapters, vec!["sql-lora".to_string()]);
        // A log entry written before adapters (no field) reads as a pool without any.
        let old = r#"{"V1":{"PutPool":{"model":"m","spec":{"instances":["http://a:1"],"agents":[],"tokenizer":"","chat_template":"","block_tokens":0},"expected_version":null}}}"#;
        let Ok(Command::V1(CommandV1::PutPool { spec, .. })) = serde_json::from_str(old) else {
            panic!("{old} does not decode");
        };
        assert!(spec.adapters.is_empty());
    }

    const H1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const H2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    fn put_pool(model: &str, urls: &[&str]) -> Command {
        Command::V1(CommandV1::PutPool {
            model: model.into(),
            spec: PoolSpec {
                instances: urls.iter().map(|s| s.to_string()).collect(),
                ..PoolSpec::default()
            },
            expected_version: None,
        })
    }

    fn tenant(f: impl FnOnce(&mut TenantSpec)) -> TenantSpec {
        let mut t = TenantSpec::with_defaults("acme", "m");
        f(&mut t);
        t
    }

    fn put_tenant(id: &str, spec: TenantSpec) -> Command {
        Command::V1(CommandV1::PutTenant {
            id: id.into(),
            spec,
            expected_version: None,
        })
    }

    /// A state with pool "m" (two instances, version 1) and tenant "acme" (key H1, version 2).
    fn base() -> ConfigState {
        let mut s = ConfigState::default();
        assert_eq!(
            s.apply(1, &put_pool("m", &["http://a:1", "http://b:2"])),
            CommandResult::Applied { version: 1 }
        );
        let spec = tenant(|t| t.api_key_hashes = vec![H1.into()]);
        assert_eq!(
            s.apply(2, &put_tenant("acme", spec)),
            CommandResult::Applied { version: 2 }
        );
        s
    }

    /// Applies `cmd` at index 10 to [`base`] and checks the result; a refused command must
    /// leave the state unchanged.
    fn check(cmd: Command, expected: CommandResult) -> ConfigState {
        let mut s = base();
        let before = s.clone();
        let got = s.apply(10, &cmd);
        assert_eq!(got, expected, "command {cmd:?}");
        if !matches!(expected, CommandResult::Applied { .. }) {
            assert_eq!(s, before, "a refused command changed the state");
        }
        s
    }

    fn invalid(problems: &[&str]) -> CommandResult {
        CommandResult::Invalid {
            problems: problems.iter().map(|s| s.to_string()).collect(),
        }
    }
}
