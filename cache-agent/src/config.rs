//! The agent's configuration: `agent.toml` (versioned, unknown fields rejected), validated
//! into [`AgentConfig`]. Flags of `warmpath agent` override the file's values one way
//! (`node/src/agent.rs`); a token given both ways is an error there.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use warmpath_tiers::Eviction;

/// When L1 writes to L2.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WritePolicy {
    /// Every block put into L1, and every object stored in the HyperPod segment, is also
    /// written to L2 as it is stored, in the background.
    Through,
    /// A block goes to L2 when L1 evicts it (the default: L2 holds what L1 could not).
    #[default]
    OnEvict,
}

impl std::str::FromStr for WritePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "through" => Ok(WritePolicy::Through),
            "on-evict" | "evict" => Ok(WritePolicy::OnEvict),
            other => Err(format!(
                "unknown L2 write policy {other:?}: through or on-evict"
            )),
        }
    }
}

/// Which L2 backend, and where.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum L2Config {
    /// No L2: blocks L1 evicts are gone.
    #[default]
    None,
    /// A directory (local disk or a shared mount), bounded at `bytes`.
    Dir { path: PathBuf, bytes: u64 },
    /// A Redis or Valkey server; keys get `prefix`.
    Redis { url: String, prefix: String },
}

impl std::str::FromStr for L2Config {
    type Err = String;
    /// `none`, `dir:PATH` (bounded by `--l2-bytes`) or `redis://HOST:PORT[/DB]`.
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "none" {
            Ok(L2Config::None)
        } else if let Some(path) = s.strip_prefix("dir:") {
            Ok(L2Config::Dir {
                path: path.into(),
                bytes: DEFAULT_L2_DIR_BYTES,
            })
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Ok(L2Config::Redis {
                url: s.to_string(),
                prefix: DEFAULT_REDIS_PREFIX.to_string(),
            })
        } else {
            Err(format!(
                "unknown L2 {s:?}: none, dir:PATH or redis://HOST:PORT"
            ))
        }
    }
}

/// The HyperPod daemon API (`crate::hyperpod`): the per-node daemon that LMCache's
/// `SageMakerHyperPodConnector` (`remote_url: sagemaker-hyperpod://HOST:PORT`) speaks to.
/// Off unless configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HyperPodConfig {
    /// TCP address of its HTTP control plane; loopback unless a token is configured (or
    /// `--insecure-no-token`).
    pub listen: String,
    /// The shared-memory segment, `/dev/shm/NAME` (LMCache's `_shared_memory_name`).
    pub shm_name: String,
    /// Its size, header page included.
    pub shm_bytes: u64,
    /// Its file mode: clients open it read-write (LMCache maps it with Python's
    /// `SharedMemory`), so they need read and write permission; 0600 limits it to the
    /// agent's user.
    pub shm_mode: u32,
    /// Longest lease; a longer `ttl_s` is shortened to this.
    pub max_lease: Duration,
    /// Open leases at most, and per client (peer address).
    pub max_leases: usize,
    pub max_leases_per_client: usize,
    /// Puts being written at once at most.
    pub max_pending_puts: usize,
    /// Open connections at most (per listener: the HTTP API and `lm://` each).
    pub max_connections: usize,
    /// Connections that have not yet sent their first request (header) at most, per
    /// listener; one more displaces the oldest (`crate::handshakes`).
    pub max_unproven: usize,
    /// LMCache's `lm://` server protocol on this TCP address, a second front to the same
    /// store (`crate::hyperpod::lm`). The protocol carries no credentials: loopback only,
    /// unless `--insecure-no-token`.
    pub lm_listen: Option<String>,
}

pub const DEFAULT_HYPERPOD_SHM_NAME: &str = "shared_memory";
pub const DEFAULT_HYPERPOD_SHM_BYTES: u64 = 1 << 30;

impl Default for HyperPodConfig {
    fn default() -> Self {
        HyperPodConfig {
            listen: "127.0.0.1:9200".into(),
            shm_name: DEFAULT_HYPERPOD_SHM_NAME.into(),
            shm_bytes: DEFAULT_HYPERPOD_SHM_BYTES,
            shm_mode: 0o600,
            max_lease: Duration::from_secs(60),
            max_leases: 65_536,
            max_leases_per_client: 16_384,
            max_pending_puts: 256,
            max_connections: 1024,
            max_unproven: 256,
            lm_listen: None,
        }
    }
}

impl HyperPodConfig {
    /// Whether its address needs the agent's token (any address but loopback).
    pub fn needs_token(&self) -> Result<bool, String> {
        let addr: std::net::SocketAddr = self
            .listen
            .parse()
            .map_err(|e| format!("--hyperpod-listen {:?}: {e}", self.listen))?;
        Ok(!addr.ip().is_loopback())
    }
}

/// A file mode in octal (`600`, `0640`).
pub fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not a file mode in octal (say 600 or 660)"))
}

pub const DEFAULT_L1_BYTES: u64 = 1 << 30;
pub const DEFAULT_L2_DIR_BYTES: u64 = 16 << 30;
pub const DEFAULT_REDIS_PREFIX: &str = "wp:b:";
pub const DEFAULT_MAX_BLOCK_BYTES: u64 = 64 << 20;
/// The largest `kv_block_tokens`: a pool's largest `block_tokens`.
pub const MAX_KV_BLOCK_TOKENS: u32 = 65_536;

/// A validated agent configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    /// TCP address of the block API ("" for none).
    pub listen: String,
    /// Unix socket of the block API.
    pub unix: Option<PathBuf>,
    /// The token engines present; required when `listen` is not loopback.
    pub token: Option<String>,
    pub metrics_listen: Option<String>,
    pub l1_bytes: u64,
    pub l1_eviction: Eviction,
    pub l2: L2Config,
    pub l2_write: WritePolicy,
    /// Whether a block an engine reads from L2 is also put into L1 (record 0131): off by
    /// default, since the reader now holds it on its GPU and offloads it back to L1 when it
    /// evicts it, so a copy in L1 meanwhile only displaces blocks no GPU holds. Worth it on
    /// a host whose several engines read the same prefixes (LMCache's write-back to its
    /// CPU tier). Prefetch hints load into L1 either way: that is their point.
    pub l2_promote_reads: bool,
    /// Deadline of each L2 operation.
    pub l2_deadline: Duration,
    /// The cluster key L2 objects are sealed under (`l2.key_file`): objects not sealed
    /// under it are counted misses (decision 0106).
    pub l2_key: Option<crate::block::SealKey>,
    /// Blocks queued for background L2 writes at most; more are dropped, counted.
    pub l2_write_queue: usize,
    /// L2 blocks reported to routers at most: the latest this agent wrote or read (see
    /// [`warmpath_residency::L2Window`]); 0 reports none.
    pub residency_l2_blocks: usize,
    /// Residency reports every block with its parent (`--residency-every-block`), rather
    /// than the protocol's sample ([`warmpath_index::keys::Reporting::Tokens`]: one key per
    /// [`warmpath_index::keys::REPORT_TOKENS`] tokens of the pool's blocks, fewer deep in
    /// long chains; records 0115, 0117, 0122).
    pub residency_every_block: bool,
    pub max_block_bytes: u64,
    /// Keys per request at most.
    pub max_keys: usize,
    /// Longest lease a lookup may ask for.
    pub max_lease: Duration,
    /// Open block API connections at most (authenticated ones: a connection counts from
    /// its accepted handshake).
    pub max_connections: usize,
    /// Connections still in their handshake at most, overall and per source address; one
    /// more displaces the oldest (of its source when that is full), so a flood of silent
    /// connections costs an engine at most a retry, never its turn.
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_source: usize,
    /// Pins and leases one connection holds at most; more are refused (counted).
    pub max_pins_per_connection: usize,
    pub max_leases_per_connection: usize,
    /// The share of L1 pinned blocks may take at most, in percent.
    pub max_pinned_percent: u32,
    /// Bytes of frames being read or handled at most, per connection and overall; a frame
    /// waits for its bytes before its body is read, and one larger than a connection's
    /// budget is refused from its length.
    pub max_connection_inflight_bytes: u64,
    pub max_inflight_bytes: u64,
    /// The host's engines: (name, KV-event endpoint `tcp://HOST:PORT`, optionally followed
    /// by `,tcp://HOST:PORT` of its replay socket), in order.
    pub kv_events: Vec<(String, String)>,
    /// The tenants whose chains KV events may carry: (id, cache salt). Empty: every chain
    /// belongs to tenant `engine-sim` with its own salt (engine-sim served directly).
    pub kv_tenants: Vec<(String, String)>,
    /// The pool's block size in tokens (the routers' `block_tokens`), which KV-event blocks
    /// of any size are re-cut into. 0: each engine's GPU block size, learnt from its first
    /// GPU store (until then its CPU-tier blocks are counted `no_block_size`, not reported).
    pub kv_block_tokens: u32,
    /// The HyperPod daemon API, when on.
    pub hyperpod: Option<HyperPodConfig>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            listen: "127.0.0.1:7600".into(),
            unix: None,
            token: None,
            metrics_listen: None,
            l1_bytes: DEFAULT_L1_BYTES,
            l1_eviction: Eviction::Lru,
            l2: L2Config::None,
            l2_write: WritePolicy::OnEvict,
            l2_promote_reads: false,
            l2_deadline: Duration::from_millis(250),
            l2_key: None,
            l2_write_queue: 4096,
            residency_l2_blocks: 1_000_000,
            residency_every_block: false,
            max_block_bytes: DEFAULT_MAX_BLOCK_BYTES,
            max_keys: 4096,
            max_lease: Duration::from_secs(30),
            max_connections: 256,
            max_unauthenticated: 128,
            max_unauthenticated_per_source: 16,
            max_pins_per_connection: 65_536,
            max_leases_per_connection: 1024,
            max_pinned_percent: 50,
            max_connection_inflight_bytes: 128 << 20,
            max_inflight_bytes: 512 << 20,
            kv_events: Vec::new(),
            kv_tenants: Vec::new(),
            kv_block_tokens: 0,
            hyperpod: None,
        }
    }
}

impl AgentConfig {
    /// The largest frame a peer may send: a full batch of the largest blocks, bounded.
    pub fn max_frame_bytes(&self) -> u64 {
        (self.max_block_bytes.saturating_mul(16))
            .min(self.connection_inflight_bytes())
            .clamp(1 << 20, u32::MAX as u64)
    }

    /// A connection's in-flight budget: as configured, but always room for one frame of a
    /// block of the largest size (and its header).
    pub fn connection_inflight_bytes(&self) -> u64 {
        self.max_connection_inflight_bytes
            .max(self.max_block_bytes.saturating_add(1 << 20))
            .min(u32::MAX as u64)
    }

    /// The agent's in-flight budget, never below a connection's.
    pub fn inflight_bytes(&self) -> u64 {
        self.max_inflight_bytes
            .max(self.connection_inflight_bytes())
            .min(u32::MAX as u64)
    }

    /// The most bytes of L1 pinned blocks may take.
    pub fn pin_cap_bytes(&self) -> u64 {
        (u128::from(self.l1_bytes) * u128::from(self.max_pinned_percent.min(100)) / 100) as u64
    }
}

/// `agent.toml`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub version: u32,
    pub listen: Option<String>,
    pub unix: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
    pub metrics_listen: Option<String>,
    #[serde(default, deserialize_with = "opt_bytes")]
    pub max_block_bytes: Option<u64>,
    pub max_keys: Option<usize>,
    pub max_lease_ms: Option<u64>,
    pub max_connections: Option<usize>,
    pub max_unauthenticated: Option<usize>,
    pub max_unauthenticated_per_source: Option<usize>,
    pub max_pins_per_connection: Option<usize>,
    pub max_leases_per_connection: Option<usize>,
    pub max_pinned_percent: Option<u32>,
    #[serde(default, deserialize_with = "opt_bytes")]
    pub max_connection_inflight_bytes: Option<u64>,
    #[serde(default, deserialize_with = "opt_bytes")]
    pub max_inflight_bytes: Option<u64>,
    /// The pool's block size in tokens, which KV events are re-cut into (0 or absent: each
    /// engine's GPU block size).
    pub kv_block_tokens: Option<u32>,
    #[serde(default)]
    pub l1: L1Section,
    #[serde(default)]
    pub l2: L2Section,
    /// Present: the HyperPod daemon API is on.
    pub hyperpod: Option<HyperPodSection>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct HyperPodSection {
    pub listen: Option<String>,
    pub shm_name: Option<String>,
    #[serde(default, deserialize_with = "opt_bytes")]
    pub shm_bytes: Option<u64>,
    /// Octal, as a string: "600".
    pub shm_mode: Option<String>,
    pub max_lease_ms: Option<u64>,
    pub max_leases: Option<usize>,
    pub max_leases_per_client: Option<usize>,
    pub max_pending_puts: Option<usize>,
    pub max_connections: Option<usize>,
    pub max_unproven: Option<usize>,
    /// LMCache's `lm://` protocol on this address (loopback).
    pub lm_listen: Option<String>,
}

impl HyperPodSection {
    fn into_config(self) -> Result<HyperPodConfig, String> {
        let mut h = HyperPodConfig::default();
        if let Some(v) = self.listen {
            h.listen = v;
        }
        if let Some(v) = self.shm_name {
            h.shm_name = v;
        }
        if let Some(v) = self.shm_bytes {
            h.shm_bytes = v;
        }
        if let Some(v) = self.shm_mode {
            h.shm_mode = parse_mode(&v).map_err(|e| format!("hyperpod.shm_mode: {e}"))?;
        }
        if let Some(v) = self.max_lease_ms {
            h.max_lease = Duration::from_millis(v);
        }
        if let Some(v) = self.max_leases {
            h.max_leases = v;
        }
        if let Some(v) = self.max_leases_per_client {
            h.max_leases_per_client = v;
        }
        if let Some(v) = self.max_pending_puts {
            h.max_pending_puts = v;
        }
        if let Some(v) = self.max_connections {
            h.max_connections = v;
        }
        if let Some(v) = self.max_unproven {
            h.max_unproven = v;
        }
        h.lm_listen = self.lm_listen;
        Ok(h)
    }
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct L1Section {
    #[serde(default, deserialize_with = "opt_bytes")]
    pub bytes: Option<u64>,
    pub eviction: Option<Eviction>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct L2Section {
    /// none, dir or redis.
    pub backend: Option<String>,
    pub path: Option<PathBuf>,
    #[serde(default, deserialize_with = "opt_bytes")]
    pub bytes: Option<u64>,
    pub url: Option<String>,
    pub prefix: Option<String>,
    pub write: Option<WritePolicy>,
    /// Put blocks read from L2 into L1 as well.
    pub promote_reads: Option<bool>,
    pub deadline_ms: Option<u64>,
    pub write_queue: Option<usize>,
    /// L2 blocks reported to routers at most.
    pub report_blocks: Option<usize>,
    /// A file with the cluster's secret, the same on every agent: L2 objects are sealed
    /// under a key derived from it, and only those are served.
    pub key_file: Option<PathBuf>,
}

impl FileConfig {
    pub fn parse(text: &str) -> Result<FileConfig, String> {
        let file: FileConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        if file.version != 1 {
            return Err(format!(
                "agent config version {} is not supported (this build reads 1)",
                file.version
            ));
        }
        Ok(file)
    }

    /// Applies the file over the defaults; the token comes from `token_file`, read here.
    pub fn into_config(self) -> Result<AgentConfig, String> {
        let mut c = AgentConfig::default();
        if let Some(v) = self.listen {
            c.listen = v;
        }
        c.unix = self.unix;
        if let Some(path) = self.token_file {
            c.token = Some(read_token(&path)?);
        }
        c.metrics_listen = self.metrics_listen;
        if let Some(v) = self.max_block_bytes {
            c.max_block_bytes = v;
        }
        if let Some(v) = self.max_keys {
            c.max_keys = v;
        }
        if let Some(v) = self.max_lease_ms {
            c.max_lease = Duration::from_millis(v);
        }
        if let Some(v) = self.max_connections {
            c.max_connections = v;
        }
        if let Some(v) = self.max_unauthenticated {
            c.max_unauthenticated = v;
        }
        if let Some(v) = self.max_unauthenticated_per_source {
            c.max_unauthenticated_per_source = v;
        }
        if let Some(v) = self.max_pins_per_connection {
            c.max_pins_per_connection = v;
        }
        if let Some(v) = self.max_leases_per_connection {
            c.max_leases_per_connection = v;
        }
        if let Some(v) = self.max_pinned_percent {
            c.max_pinned_percent = v;
        }
        if let Some(v) = self.max_connection_inflight_bytes {
            c.max_connection_inflight_bytes = v;
        }
        if let Some(v) = self.max_inflight_bytes {
            c.max_inflight_bytes = v;
        }
        if let Some(v) = self.kv_block_tokens {
            c.kv_block_tokens = v;
        }
        if let Some(v) = self.l1.bytes {
            c.l1_bytes = v;
        }
        if let Some(v) = self.l1.eviction {
            c.l1_eviction = v;
        }
        let l2 = self.l2;
        c.l2 = match l2.backend.as_deref().unwrap_or("none") {
            "none" => L2Config::None,
            "dir" => L2Config::Dir {
                path: l2.path.ok_or("l2.backend = \"dir\" needs l2.path")?,
                bytes: l2.bytes.unwrap_or(DEFAULT_L2_DIR_BYTES),
            },
            "redis" => L2Config::Redis {
                url: l2.url.ok_or("l2.backend = \"redis\" needs l2.url")?,
                prefix: l2.prefix.unwrap_or_else(|| DEFAULT_REDIS_PREFIX.into()),
            },
            other => return Err(format!("unknown l2.backend {other:?}: none, dir or redis")),
        };
        if let Some(v) = l2.write {
            c.l2_write = v;
        }
        if let Some(v) = l2.promote_reads {
            c.l2_promote_reads = v;
        }
        if let Some(v) = l2.deadline_ms {
            c.l2_deadline = Duration::from_millis(v);
        }
        if let Some(v) = l2.write_queue {
            c.l2_write_queue = v;
        }
        if let Some(v) = l2.report_blocks {
            c.residency_l2_blocks = v;
        }
        if let Some(path) = l2.key_file {
            let secret =
                std::fs::read(&path).map_err(|e| format!("l2.key_file {}: {e}", path.display()))?;
            if secret.trim_ascii().len() < 16 {
                return Err(format!(
                    "l2.key_file {}: at least 16 bytes of secret",
                    path.display()
                ));
            }
            c.l2_key = Some(crate::block::SealKey::from_secret(&secret));
        }
        c.hyperpod = self
            .hyperpod
            .map(HyperPodSection::into_config)
            .transpose()?;
        Ok(c)
    }
}

impl AgentConfig {
    /// Checks what no run could fix later: bounds and the token rule.
    pub fn validate(&self, insecure: bool) -> Result<(), String> {
        if self.listen.is_empty() && self.unix.is_none() {
            return Err(
                "the block API needs a TCP address (--listen) or a Unix socket (--unix)".into(),
            );
        }
        if self.max_block_bytes == 0 || self.max_block_bytes > u32::MAX as u64 {
            return Err(format!(
                "max_block_bytes {} must be between 1 and {}",
                self.max_block_bytes,
                u32::MAX
            ));
        }
        if self.kv_events.len() > u16::MAX as usize {
            return Err("more engines than a host can have".into());
        }
        for (name, endpoint) in &self.kv_events {
            let parts: Vec<&str> = endpoint.split(',').collect();
            if parts.len() > 2 || parts.iter().any(|p| !p.starts_with("tcp://")) {
                return Err(format!(
                    "KV events of {name}: {endpoint:?} is not tcp://HOST:PORT, optionally \
                     followed by ,tcp://HOST:PORT of the engine's replay socket"
                ));
            }
        }
        if self.kv_block_tokens > MAX_KV_BLOCK_TOKENS {
            return Err(format!(
                "kv_block_tokens {}: at most {MAX_KV_BLOCK_TOKENS}, as a pool's block_tokens",
                self.kv_block_tokens
            ));
        }
        if self.max_keys == 0 || self.max_connections == 0 || self.l2_deadline.is_zero() {
            return Err("max_keys, max_connections and l2 deadline must be positive".into());
        }
        if self.max_unauthenticated == 0 || self.max_unauthenticated_per_source == 0 {
            return Err("max_unauthenticated and its per-source share must be positive".into());
        }
        if self.max_pinned_percent > 100 {
            return Err(format!(
                "max_pinned_percent {} is over 100",
                self.max_pinned_percent
            ));
        }
        if let Some(h) = &self.hyperpod {
            h.validate(self.token.is_some(), insecure)?;
        }
        if !self.listen.is_empty() && self.token.is_none() && !insecure {
            let addr: std::net::SocketAddr = self
                .listen
                .parse()
                .map_err(|e| format!("--listen {:?}: {e}", self.listen))?;
            if !addr.ip().is_loopback() {
                return Err(format!(
                    "the block API on {addr} (not loopback) needs a token (--token-file): \
                     anyone who reaches it could read and overwrite KV blocks; \
                     --insecure-no-token runs it open"
                ));
            }
        }
        Ok(())
    }
}

impl HyperPodConfig {
    /// Checks bounds and the token rule: off loopback the API needs the agent's token
    /// (LMCache's connector sends none, so such an address serves only clients that add
    /// one), unless `insecure`.
    pub fn validate(&self, has_token: bool, insecure: bool) -> Result<(), String> {
        let min = crate::hyperpod::segment::HEADER_BYTES + crate::hyperpod::segment::UNIT_BYTES;
        if self.shm_bytes < min {
            return Err(format!(
                "--hyperpod-shm-bytes {} is too small: at least {min} (a header page and a data page)",
                self.shm_bytes
            ));
        }
        if self.max_lease.is_zero()
            || self.max_leases == 0
            || self.max_leases_per_client == 0
            || self.max_pending_puts == 0
            || self.max_connections == 0
            || self.max_unproven == 0
        {
            return Err("hyperpod lease, put and connection bounds must be positive".into());
        }
        if self.needs_token()? && !has_token && !insecure {
            return Err(format!(
                "the HyperPod API on {} (not loopback) needs a token (--token-file): anyone \
                 who reaches it could store KV objects an engine then loads; \
                 --insecure-no-token runs it open",
                self.listen
            ));
        }
        if let Some(lm) = &self.lm_listen {
            let addr: std::net::SocketAddr =
                lm.parse().map_err(|e| format!("--lm-listen {lm:?}: {e}"))?;
            if !addr.ip().is_loopback() && !insecure {
                return Err(format!(
                    "lm:// on {addr} (not loopback): its protocol carries no credentials, so \
                     anyone who reaches it could store KV objects an engine then loads; it \
                     runs on loopback only, unless --insecure-no-token"
                ));
            }
        }
        Ok(())
    }
}

/// A token file's content, trimmed; empty is an error.
pub fn read_token(path: &std::path::Path) -> Result<String, String> {
    let t =
        std::fs::read_to_string(path).map_err(|e| format!("token file {}: {e}", path.display()))?;
    let t = t.trim().to_string();
    if t.is_empty() {
        return Err(format!("token file {} is empty", path.display()));
    }
    if t.len() > crate::proto::MAX_TOKEN_BYTES {
        return Err(format!("token in {} is over 1024 bytes", path.display()));
    }
    Ok(t)
}

/// A size in bytes: an integer or a string with a unit (`512MiB`, `4GiB`, `1GB`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (say 1048576, 512MiB or 4GiB)"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        N(u64),
        S(String),
    }
    match Option::<Size>::deserialize(d)? {
        None => Ok(None),
        Some(Size::N(n)) => Ok(Some(n)),
        Some(Size::S(s)) => parse_bytes(&s).map(Some).map_err(serde::de::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (s, want) in [
            ("1024", Ok(1024)),
            ("4GiB", Ok(4 << 30)),
            ("512 MiB", Ok(512 << 20)),
            ("1GB", Ok(1_000_000_000)),
        ] {
            assert_eq!(parse_bytes(s), want, "{s}");
        }
        assert!(parse_bytes("4 GiBs").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
    }

    #[test]
    fn files() {
        let c = FileConfig::parse(
            r#"
            version = 1
            listen = "127.0.0.1:0"
            kv_block_tokens = 16
            [l1]
            bytes = "64MiB"
            eviction = "s3fifo"
            [l2]
            backend = "redis"
            url = "redis://127.0.0.1:6379"
            write = "through"
            promote_reads = true
            "#,
        )
        .unwrap()
        .into_config()
        .unwrap();
        assert_eq!(c.l1_bytes, 64 << 20);
        assert_eq!(c.l1_eviction, Eviction::S3Fifo);
        assert_eq!(c.l2_write, WritePolicy::Through);
        assert!(c.l2_promote_reads);
        assert!(!AgentConfig::default().l2_promote_reads);
        assert!(matches!(c.l2, L2Config::Redis { .. }));
        assert_eq!(c.kv_block_tokens, 16);
        assert!(c.validate(false).is_ok());
        let too_large = AgentConfig {
            kv_block_tokens: MAX_KV_BLOCK_TOKENS + 1,
            ..c.clone()
        };
        assert!(too_large
            .validate(false)
            .unwrap_err()
            .contains("kv_block_tokens"));

        for (bad, want) in [
            ("version = 2", "version 2"),
            ("version = 1\nlisten_at = \"x\"", "unknown field"),
            ("version = 1\n[l2]\nbackend = \"dir\"", "needs l2.path"),
            ("version = 1\n[l2]\nbackend = \"s3\"", "unknown l2.backend"),
            ("version = 1\n[l1]\nbytes = \"lots\"", "not a size"),
        ] {
            let err = FileConfig::parse(bad)
                .and_then(FileConfig::into_config)
                .unwrap_err();
            assert!(err.contains(want), "{bad}: {err}");
        }
        let c = FileConfig::parse(
            "version = 1\n[hyperpod]\nshm_name = \"lmc\"\nshm_bytes = \"64MiB\"\n\
             shm_mode = \"660\"\nmax_lease_ms = 5000\n",
        )
        .unwrap()
        .into_config()
        .unwrap();
        let h = c.hyperpod.clone().expect("[hyperpod] turns it on");
        assert_eq!(
            (h.shm_name.as_str(), h.shm_bytes, h.shm_mode, h.max_lease),
            ("lmc", 64 << 20, 0o660, Duration::from_secs(5))
        );
        assert_eq!(h.listen, HyperPodConfig::default().listen);
        assert!(c.validate(false).is_ok());
        assert_eq!(
            FileConfig::parse("version = 1")
                .unwrap()
                .into_config()
                .unwrap()
                .hyperpod,
            None
        );
        for (bad, want) in [
            ("[hyperpod]\nshm_mode = \"9\"", "not a file mode"),
            ("[hyperpod]\nshm_bytes = 4096", "too small"),
            ("[hyperpod]\nlisten = \"0.0.0.0:9200\"", "needs a token"),
            ("[hyperpod]\nmax_leases = 0", "must be positive"),
            ("[hyperpod]\nshm = \"x\"", "unknown field"),
            ("[hyperpod]\nmax_unproven = 0", "must be positive"),
            ("[hyperpod]\nlm_listen = \"0.0.0.0:65432\"", "loopback only"),
            ("[hyperpod]\nlm_listen = \"lm://x\"", "--lm-listen"),
        ] {
            let err = FileConfig::parse(&format!("version = 1\n{bad}"))
                .and_then(FileConfig::into_config)
                .and_then(|c| c.validate(false).map(|_| c))
                .unwrap_err();
            assert!(err.contains(want), "{bad}: {err}");
        }
        let open = AgentConfig {
            listen: "0.0.0.0:7600".into(),
            ..AgentConfig::default()
        };
        assert!(open.validate(false).unwrap_err().contains("needs a token"));
        assert!(open.validate(true).is_ok());
    }
}
