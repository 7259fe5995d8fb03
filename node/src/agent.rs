//! `warmpath agent`: the cache-agent of one GPU host (see `warmpath_cache_agent`), from
//! `--config agent.toml` and flags. A flag overrides the file's value for that setting;
//! the token may come from one place only (a token in both is an error, never a silent
//! choice).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use axum::routing::get;
use axum::Router;
use clap::Args;
use warmpath_cache_agent::agent::Agent;
use warmpath_cache_agent::config::{
    parse_bytes, parse_mode, read_token, AgentConfig, FileConfig, HyperPodConfig, L2Config,
    WritePolicy,
};
use warmpath_cache_agent::hyperpod::HyperPod;
use warmpath_cache_agent::server;
use warmpath_residency::tls::TlsFiles;
use warmpath_tiers::Eviction;

use crate::router::listener;

#[derive(Args, Debug, Clone, Default)]
pub struct AgentArgs {
    /// agent.toml (version = 1); flags override its values.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// TCP address of the block API (default 127.0.0.1:7600; port 0 picks one, printed).
    #[arg(long)]
    pub listen: Option<String>,
    /// Unix socket of the block API (mode 0660).
    #[arg(long)]
    pub unix: Option<PathBuf>,
    /// File holding the token engines must present; required off loopback.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Run a non-loopback block API without a token (anyone who reaches it can read and
    /// overwrite KV blocks).
    #[arg(long)]
    pub insecure_no_token: bool,
    /// Address for /metrics and /healthz over HTTP.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// L1 capacity (bytes, or with a unit: 512MiB, 4GiB).
    #[arg(long)]
    pub l1_bytes: Option<String>,
    /// L1 eviction: lru or s3fifo.
    #[arg(long)]
    pub l1_eviction: Option<Eviction>,
    /// L2: none, dir:PATH or redis://HOST:PORT[/DB].
    #[arg(long)]
    pub l2: Option<L2Config>,
    /// Bound of a directory L2 (bytes or with a unit).
    #[arg(long)]
    pub l2_bytes: Option<String>,
    /// When blocks (and HyperPod objects) go to L2: on-evict (default), or through, as they
    /// are stored.
    #[arg(long)]
    pub l2_write: Option<WritePolicy>,
    /// Put blocks engines read from L2 into L1 as well (off by default: the reader holds
    /// them on its GPU; worth it where several engines of this host read the same prefixes).
    #[arg(long)]
    pub l2_promote_reads: bool,
    /// Largest block payload accepted (bytes or with a unit).
    #[arg(long)]
    pub max_block_bytes: Option<String>,
    /// An engine on this host and its KV-event endpoint, NAME=tcp://HOST:PORT (repeat per
    /// engine; NAME is how routers know the instance), optionally followed by
    /// ,tcp://HOST:PORT of its replay socket, from which missed batches are recovered.
    #[arg(long = "kv-events", value_name = "NAME=ENDPOINT")]
    pub kv_events: Vec<String>,
    /// A tenant whose chains the engines' KV events carry, ID or ID=SALT (repeatable; the
    /// salt defaults to the one routers derive for a tenant configured without one). A
    /// chain's first block names its salt; chains of other salts are not reported. With
    /// none, every chain is tenant `engine-sim` with its own salt (engine-sim served
    /// without a router).
    #[arg(long = "kv-tenant", value_name = "ID[=SALT]")]
    pub kv_tenants: Vec<String>,
    /// The pool's block size in tokens (the routers' pool `block_tokens`): KV-event blocks
    /// of any size (LMCache's 256-token chunks, vLLM's CPU offload blocks) are re-cut into
    /// keys of this size. Without it (or 0) each engine's GPU block size is used, learnt
    /// from its first GPU store: a pool of another block size never matches, and CPU
    /// blocks published before any GPU store are not reported.
    #[arg(long = "kv-block-tokens", value_name = "N")]
    pub kv_block_tokens: Option<u32>,
    /// UDP address for routers' residency sessions over QUIC (mutual TLS: needs --tls-dir
    /// and --tls-name).
    #[arg(long)]
    pub residency_listen: Option<String>,
    /// Most routers served residency at once; a router past it is refused (closed, counted
    /// in warmpath_agent_residency_routers_refused_total) and retries after its back-off.
    /// Routers follow an agent by a few each (`router --residency-followers`, default 4), so
    /// the default leaves room for membership changes and bounds the agent's outbound
    /// whatever the cluster's size.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub residency_max_routers: u32,
    /// Report every block to routers, not the protocol's sample (one key per 64 tokens of
    /// the pool's blocks for a chain's first 4,096 tokens, fewer past them: one in 4 of
    /// vLLM's 16-token blocks there; records 0115, 0117 and 0122, coarse residency): for
    /// comparing with full residency. Routers of any build take it; at 16-token blocks it
    /// costs 4 times the residency bandwidth of short prompts, 16 and more of long ones.
    #[arg(long)]
    pub residency_every_block: bool,
    /// Directory of the cluster's TLS files (`warmpath certs`): ca.pem, NAME.pem, NAME.key.
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// This agent's name in --tls-dir.
    #[arg(long)]
    pub tls_name: Option<String>,
    /// Serve the HyperPod daemon API that LMCache's connector speaks
    /// (`remote_url: sagemaker-hyperpod://HOST:PORT`) on this TCP address (loopback unless
    /// a token is configured). Off by default; `[hyperpod]` in the config file turns it on
    /// too.
    #[arg(long)]
    pub hyperpod_listen: Option<String>,
    /// Its shared-memory segment, /dev/shm/NAME (LMCache's `_shared_memory_name`; default
    /// shared_memory).
    #[arg(long)]
    pub hyperpod_shm_name: Option<String>,
    /// The segment's size (bytes or with a unit; default 1GiB), reserved at start.
    #[arg(long)]
    pub hyperpod_shm_bytes: Option<String>,
    /// The segment's file mode in octal (default 600): LMCache opens it read-write, so its
    /// user needs both.
    #[arg(long)]
    pub hyperpod_shm_mode: Option<String>,
    /// Serve LMCache's `lm://` server protocol (`remote_url: lm://HOST:PORT`) on this
    /// loopback TCP address too, a second front to the HyperPod API's store and segment
    /// (objects stored through either are read through both). Needs --hyperpod-listen.
    #[arg(long)]
    pub lm_listen: Option<String>,
}

impl AgentArgs {
    /// The configuration: defaults, then the file, then the flags.
    pub fn to_config(&self) -> Result<AgentConfig> {
        let mut c = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                FileConfig::parse(&text)
                    .and_then(FileConfig::into_config)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
            }
            None => AgentConfig::default(),
        };
        if let Some(v) = &self.listen {
            c.listen = v.clone();
        }
        if let Some(v) = &self.unix {
            c.unix = Some(v.clone());
        }
        if let Some(path) = &self.token_file {
            if c.token.is_some() {
                bail!("the block API token is given twice (token_file in the config and --token-file); give it once");
            }
            c.token = Some(read_token(path).map_err(anyhow::Error::msg)?);
        }
        if let Some(v) = &self.metrics_listen {
            c.metrics_listen = Some(v.clone());
        }
        if let Some(v) = &self.l1_bytes {
            c.l1_bytes = parse_bytes(v).map_err(anyhow::Error::msg)?;
        }
        if let Some(v) = self.l1_eviction {
            c.l1_eviction = v;
        }
        if let Some(v) = &self.l2 {
            c.l2 = v.clone();
        }
        if let Some(v) = &self.l2_bytes {
            let bytes = parse_bytes(v).map_err(anyhow::Error::msg)?;
            match &mut c.l2 {
                L2Config::Dir { bytes: b, .. } => *b = bytes,
                _ => bail!("--l2-bytes bounds a directory L2 (--l2 dir:PATH); Redis is bounded by its maxmemory"),
            }
        }
        if let Some(v) = self.l2_write {
            c.l2_write = v;
        }
        if self.l2_promote_reads {
            c.l2_promote_reads = true;
        }
        if let Some(v) = &self.max_block_bytes {
            c.max_block_bytes = parse_bytes(v).map_err(anyhow::Error::msg)?;
        }
        for e in &self.kv_events {
            let (name, endpoint) = e
                .split_once('=')
                .with_context(|| format!("--kv-events {e:?}: give NAME=tcp://HOST:PORT"))?;
            c.kv_events.push((name.to_string(), endpoint.to_string()));
        }
        for t in &self.kv_tenants {
            let (id, salt) = match t.split_once('=') {
                Some((id, salt)) => (id.to_string(), salt.to_string()),
                None => (t.clone(), warmpath_index::keys::default_cache_salt(t)),
            };
            if id.is_empty() || salt.is_empty() {
                bail!("--kv-tenant {t:?}: give ID or ID=SALT");
            }
            c.kv_tenants.push((id, salt));
        }
        if let Some(v) = self.kv_block_tokens {
            c.kv_block_tokens = v;
        }
        c.residency_every_block |= self.residency_every_block;
        let hyperpod_flags = self.hyperpod_shm_name.is_some()
            || self.hyperpod_shm_bytes.is_some()
            || self.hyperpod_shm_mode.is_some()
            || self.lm_listen.is_some();
        if self.hyperpod_listen.is_some() || hyperpod_flags {
            if c.hyperpod.is_none() && self.hyperpod_listen.is_none() {
                bail!("--hyperpod-shm-* and --lm-listen set the HyperPod store's segment and fronts: turn the API on with --hyperpod-listen (or [hyperpod] in the config file)");
            }
            let h = c.hyperpod.get_or_insert_with(HyperPodConfig::default);
            if let Some(v) = &self.hyperpod_listen {
                h.listen = v.clone();
            }
            if let Some(v) = &self.hyperpod_shm_name {
                h.shm_name = v.clone();
            }
            if let Some(v) = &self.hyperpod_shm_bytes {
                h.shm_bytes = parse_bytes(v).map_err(anyhow::Error::msg)?;
            }
            if let Some(v) = &self.hyperpod_shm_mode {
                h.shm_mode = parse_mode(v).map_err(anyhow::Error::msg)?;
            }
            if let Some(v) = &self.lm_listen {
                h.lm_listen = Some(v.clone());
            }
        }
        c.validate(self.insecure_no_token)
            .map_err(anyhow::Error::msg)?;
        Ok(c)
    }
}

pub fn run(args: AgentArgs) -> Result<()> {
    let config = args.to_config()?;
    let residency = match &args.residency_listen {
        Some(at) => {
            let (Some(dir), Some(name)) = (&args.tls_dir, &args.tls_name) else {
                bail!("--residency-listen needs --tls-dir and --tls-name: residency runs over mutual TLS only");
            };
            let addr: std::net::SocketAddr = at
                .parse()
                .with_context(|| format!("--residency-listen {at:?}: give IP:PORT"))?;
            Some(ResidencyServing {
                addr,
                tls: TlsFiles::in_dir(dir, name),
                max_routers: args.residency_max_routers as usize,
            })
        }
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(config, residency, crate::shutdown_signal()))
}

/// Where and to whom an agent serves residency.
#[derive(Debug)]
pub struct ResidencyServing {
    pub addr: std::net::SocketAddr,
    pub tls: TlsFiles,
    /// Most routers served at once (`--residency-max-routers`).
    pub max_routers: usize,
}

/// Runs an agent until `shutdown`, printing where it listens.
pub async fn serve(
    config: AgentConfig,
    residency: Option<ResidencyServing>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let handle = crate::router::metrics_handle();
    let tcp = if config.listen.is_empty() {
        None
    } else {
        let l = tokio::net::TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("cannot listen on {} (block API)", config.listen))?;
        let addr = l.local_addr()?;
        if config.token.is_none() && !addr.ip().is_loopback() {
            tracing::warn!(%addr, "the block API runs WITHOUT a token (--insecure-no-token): anyone who reaches it can read and overwrite KV blocks");
        }
        println!("warmpath agent listening on {addr}");
        Some(l)
    };
    let unix = match &config.unix {
        Some(path) => {
            let l = server::bind_unix(path)
                .with_context(|| format!("cannot listen on {} (block API)", path.display()))?;
            println!("warmpath agent listening on unix:{}", path.display());
            Some(l)
        }
        None => None,
    };
    let agent = Agent::start(config.clone()).context("cannot open the L2 store")?;
    let l2 = match &config.l2 {
        L2Config::None => "none".to_string(),
        L2Config::Dir { path, bytes } => format!("dir {} ({bytes} bytes)", path.display()),
        L2Config::Redis { url, .. } => format!("redis {url}"),
    };
    tracing::info!(
        l1_bytes = config.l1_bytes,
        eviction = ?config.l1_eviction,
        %l2,
        write = ?config.l2_write,
        promote_reads = config.l2_promote_reads,
        "cache agent started"
    );
    if let Some(ResidencyServing {
        addr,
        tls,
        max_routers,
    }) = residency
    {
        let server = tls.server_config().map_err(anyhow::Error::msg)?;
        let quic = warmpath_residency::net::endpoint(addr, Some(server), None)
            .map_err(anyhow::Error::msg)?;
        println!(
            "warmpath agent residency (QUIC, mutual TLS) on {}",
            quic.local_addr()?
        );
        let (residency, changed) = agent.residency();
        let (learner, prefetcher) = (agent.clone(), agent.clone());
        tokio::spawn(warmpath_residency::net::serve(
            quic,
            residency,
            changed,
            warmpath_residency::net::FromRouters {
                tenants: std::sync::Arc::new(move |version, salts| {
                    learner.learn_tenants(version, salts)
                }),
                prefetch: std::sync::Arc::new(move |_instance, keys| prefetcher.prefetch(keys)),
            },
            max_routers,
        ));
    }
    if let Some(at) = &config.metrics_listen {
        let l = tokio::net::TcpListener::bind(at)
            .await
            .with_context(|| format!("cannot listen on {at} (metrics)"))?;
        println!(
            "warmpath agent metrics on http://{}/metrics",
            l.local_addr()?
        );
        let app = Router::new()
            .route("/metrics", get(move || std::future::ready(handle.render())))
            .route("/healthz", get(|| std::future::ready("ok")));
        let limits = listener::Limits {
            header_read_timeout: std::time::Duration::from_secs(10),
            max_connections: 64,
        };
        tokio::spawn(listener::serve(l, app, limits, std::future::pending()));
    }
    if let Some(h) = &config.hyperpod {
        let l = tokio::net::TcpListener::bind(&h.listen)
            .await
            .with_context(|| format!("cannot listen on {} (HyperPod API)", h.listen))?;
        let addr = l.local_addr()?;
        // Off loopback the API takes the agent's token (validated: there is one, or
        // --insecure-no-token); on loopback it is open, since LMCache's connector sends none.
        let token = if addr.ip().is_loopback() {
            None
        } else {
            if config.token.is_none() {
                tracing::warn!(%addr, "the HyperPod API runs WITHOUT a token (--insecure-no-token): anyone who reaches it can store objects engines then load");
            }
            config.token.clone()
        };
        let write_through = config.l2_write == WritePolicy::Through;
        let hp = HyperPod::start(
            h,
            config.l1_eviction,
            token,
            agent.l2(),
            agent.l2_seal(),
            write_through,
        )
        .with_context(|| format!("cannot set up the HyperPod segment /dev/shm/{}", h.shm_name))?;
        // Objects stored through it are reported as the agent's L1 (L2 once evicted there).
        let follower = agent.clone();
        hp.follow(std::sync::Arc::new(move |name, event| {
            follower.hyperpod_object(name, event)
        }));
        println!(
            "warmpath agent hyperpod API on {addr} (segment /dev/shm/{}, {} bytes, generation {})",
            h.shm_name,
            h.shm_bytes,
            hp.generation()
        );
        if let Some(at) = &h.lm_listen {
            let lm = tokio::net::TcpListener::bind(at)
                .await
                .with_context(|| format!("cannot listen on {at} (lm://)"))?;
            if !lm.local_addr()?.ip().is_loopback() {
                tracing::warn!(addr = %lm.local_addr()?, "lm:// runs off loopback (--insecure-no-token): its protocol carries no credentials, anyone who reaches it can store objects engines then load");
            }
            println!(
                "warmpath agent lm:// on {} (remote_url: lm://{})",
                lm.local_addr()?,
                lm.local_addr()?
            );
            tokio::spawn(hp.clone().serve_lm(lm, std::future::pending()));
        }
        tokio::spawn(hp.serve(l, std::future::pending()));
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    server::serve(agent, tcp, unix, shutdown).await;
    if let Some(path) = &config.unix {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
