//! What a run is asked to do ([`LoadgenConfig`]: targets, mode, tenants, bounds), checked
//! once into a [`Plan`] (target URIs, tenant headers), and when each request is due
//! ([`schedule`]). Pure: no I/O.

use std::time::Duration;

use hyper::header::{HeaderName, HeaderValue, AUTHORIZATION};
use hyper::Uri;
use warmpath_index::rng::Rng;

use crate::request::{Endpoint, LiveRequest};

/// Header naming the tenant under [`TenantAuth::Header`].
pub const TENANT_HEADER: &str = "x-tenant-id";

/// When requests are sent.
#[derive(Clone, Debug, PartialEq)]
pub enum Mode {
    /// Each request at its `at_us / time_scale`, whether or not earlier ones have finished.
    OpenLoop {
        /// Speed-up: arrival times are divided by this (2.0 replays twice as fast).
        time_scale: f64,
    },
    /// Requests in order, with exponential gaps of mean `1 / rate_per_s` (their `at_us`
    /// is ignored), whether or not earlier ones have finished.
    Poisson {
        /// Mean arrivals per second.
        rate_per_s: f64,
        /// Fixes the gaps.
        seed: u64,
    },
    /// `concurrency` users, each sending the next request (in order) when its previous one
    /// has finished.
    ClosedLoop {
        /// Number of users (requests in flight).
        concurrency: u32,
    },
}

/// How tenant `i` is named on the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TenantAuth {
    /// Not at all (single-tenant targets).
    #[default]
    None,
    /// `x-tenant-id: tenant-{i}`.
    Header,
    /// `Authorization: Bearer {keys[i % keys.len()]}`.
    ApiKey(Vec<String>),
}

/// What [`run`] does.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadgenConfig {
    /// Base URLs like `http://127.0.0.1:8080` (plain HTTP; a trailing `/v1` is accepted);
    /// requests go to them round-robin in sending order.
    pub targets: Vec<String>,
    /// The `model` field of every request.
    pub model: String,
    /// When requests are sent.
    pub mode: Mode,
    /// Ask for streamed responses (server-sent events). Without streaming TTFT is E2E.
    pub stream: bool,
    /// Per request, from the moment it is due to the end of its response.
    pub timeout: Duration,
    /// How tenants are named.
    pub tenant_header: TenantAuth,
    /// Send at most this many requests (the first ones).
    pub max_requests: Option<usize>,
    /// Send no request after this long; requests in flight then still finish (or time
    /// out).
    pub max_duration: Option<Duration>,
}

impl LoadgenConfig {
    /// A configuration with the defaults: open loop in real time, streaming, a 60 s
    /// timeout, no tenant naming, no bounds beyond the requests given.
    pub fn new(targets: Vec<String>, model: impl Into<String>) -> Self {
        LoadgenConfig {
            targets,
            model: model.into(),
            mode: Mode::OpenLoop { time_scale: 1.0 },
            stream: true,
            timeout: Duration::from_secs(60),
            tenant_header: TenantAuth::None,
            max_requests: None,
            max_duration: None,
        }
    }
}

/// Why a load run could not start. Failures of single requests are not errors: they are
/// counted in the [`LoadReport`].
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    /// No target URL was given.
    #[error("no target: give at least one base URL such as http://127.0.0.1:8080")]
    NoTargets,
    /// A target URL that the load generator cannot send to.
    #[error("bad target `{target}`: {reason}")]
    BadTarget {
        /// The URL as given.
        target: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A setting outside its valid range.
    #[error("bad load generator setting: {0}")]
    BadConfig(String),
}

/// Where one target's endpoints are.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub(crate) completions: Uri,
    pub(crate) chat: Uri,
}

impl Target {
    pub(crate) fn parse(base: &str) -> Result<Target, LoadgenError> {
        let bad = |reason: String| LoadgenError::BadTarget {
            target: base.to_string(),
            reason,
        };
        let trimmed = base.trim().trim_end_matches('/');
        let root = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        if !root.contains("://") {
            return Err(bad("no scheme: write http://host:port".to_string()));
        }
        let uri = |path: &str| -> Result<Uri, LoadgenError> {
            let uri: Uri = format!("{root}{path}")
                .parse()
                .map_err(|e| bad(format!("not a URL: {e}")))?;
            match uri.scheme_str() {
                Some("http") => {}
                Some(other) => {
                    return Err(bad(format!(
                    "scheme `{other}` is not supported: the load generator speaks plain HTTP/1.1"
                )))
                }
                None => return Err(bad("no scheme: write http://host:port".to_string())),
            }
            if uri.authority().is_none() {
                return Err(bad("no host".to_string()));
            }
            Ok(uri)
        };
        Ok(Target {
            completions: uri(Endpoint::Completions.path())?,
            chat: uri(Endpoint::Chat.path())?,
        })
    }

    pub(crate) fn uri(&self, endpoint: Endpoint) -> &Uri {
        match endpoint {
            Endpoint::Completions => &self.completions,
            Endpoint::Chat => &self.chat,
        }
    }
}

/// The configuration, checked and turned into what sending needs.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) targets: Vec<Target>,
    auth: Auth,
}

#[derive(Debug)]
enum Auth {
    None,
    Header,
    ApiKey(Vec<HeaderValue>),
}

impl Plan {
    pub(crate) fn new(config: &LoadgenConfig) -> Result<Plan, LoadgenError> {
        if config.targets.is_empty() {
            return Err(LoadgenError::NoTargets);
        }
        let targets = config
            .targets
            .iter()
            .map(|t| Target::parse(t))
            .collect::<Result<Vec<_>, _>>()?;
        let bad = |s: String| Err(LoadgenError::BadConfig(s));
        match config.mode {
            Mode::OpenLoop { time_scale } if !(time_scale.is_finite() && time_scale > 0.0) => {
                return bad(format!("time scale {time_scale} is not a positive number"))
            }
            Mode::Poisson { rate_per_s, .. } if !(rate_per_s.is_finite() && rate_per_s > 0.0) => {
                return bad(format!("rate {rate_per_s}/s is not a positive number"))
            }
            Mode::ClosedLoop { concurrency: 0 } => return bad("concurrency is 0".to_string()),
            _ => {}
        }
        if config.timeout.is_zero() {
            return bad("the request timeout is 0".to_string());
        }
        let auth = match &config.tenant_header {
            TenantAuth::None => Auth::None,
            TenantAuth::Header => Auth::Header,
            TenantAuth::ApiKey(keys) if keys.is_empty() => {
                return bad("no API keys given for the tenants".to_string())
            }
            TenantAuth::ApiKey(keys) => Auth::ApiKey(
                keys.iter()
                    .enumerate()
                    .map(|(i, k)| {
                        HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                            LoadgenError::BadConfig(format!(
                                "API key {i} has characters a header cannot carry"
                            ))
                        })
                    })
                    .collect::<Result<_, _>>()?,
            ),
        };
        Ok(Plan { targets, auth })
    }

    pub(crate) fn tenant_header(&self, tenant: u32) -> Option<(HeaderName, HeaderValue)> {
        match &self.auth {
            Auth::None => None,
            Auth::Header => HeaderValue::from_str(&format!("tenant-{tenant}"))
                .ok()
                .map(|v| (HeaderName::from_static(TENANT_HEADER), v)),
            Auth::ApiKey(keys) => Some((AUTHORIZATION, keys[tenant as usize % keys.len()].clone())),
        }
    }
}

/// When each request (by index) is due, from the start of the run; `None` for the closed
/// loop.
pub(crate) fn schedule(mode: &Mode, requests: &[LiveRequest]) -> Option<Vec<Duration>> {
    match *mode {
        Mode::OpenLoop { time_scale } => Some(
            requests
                .iter()
                .map(|r| Duration::from_secs_f64(r.at_us as f64 / 1e6 / time_scale))
                .collect(),
        ),
        Mode::Poisson { rate_per_s, seed } => {
            let mut rng = Rng::new(seed);
            let mut t = 0.0f64;
            Some(
                requests
                    .iter()
                    .map(|_| {
                        t += rng.exp(1.0 / rate_per_s);
                        Duration::from_secs_f64(t)
                    })
                    .collect(),
            )
        }
        Mode::ClosedLoop { .. } => None,
    }
}
