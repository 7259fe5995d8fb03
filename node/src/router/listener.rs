//! The client port's connections, bounded: how many, and for how long each may dawdle.
//!
//! `axum::serve` sets no timer, so a half-sent request line or an idle keep-alive
//! connection stayed open for ever, and enough of them exhausted the process's file
//! descriptors. This accept loop serves each connection with hyper's HTTP/1 server and:
//! - a **header read timeout** (also the keep-alive idle timeout: hyper restarts it while
//!   it waits for the next request's head on the connection);
//! - a **connection limit**: beyond it a new connection gets `503 Service Unavailable`
//!   with `Retry-After` and an OpenAI error body as soon as it has sent its request's head
//!   (within a second), then is closed;
//!   the default limit leaves room under the process's open-file limit for upstream
//!   connections, the store and the accept itself;
//! - accept errors (such as running out of file descriptors) are logged and retried after
//!   a short pause, never fatal;
//! - graceful shutdown: on the signal, stop accepting and let open connections (streams
//!   included) finish.
//!
//! Request bodies are read under their own deadline by the request path (`proxy`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Limits of the client port.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest wait for a request's headers, and for the next request on an idle
    /// keep-alive connection.
    pub header_read_timeout: Duration,
    /// Most connections served at once.
    pub max_connections: usize,
}

/// Open-file slots kept free for everything but client connections (upstream connections,
/// health checks, the Raft store, gossip, the accept itself).
const RESERVED_FILES: usize = 256;

/// The default connection limit: the soft open-file limit less [`RESERVED_FILES`] (from
/// `/proc/self/limits`), at least 64; 10,000 where the limit cannot be read.
pub fn default_max_connections() -> usize {
    let soft = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3)?.parse::<usize>().ok())
        });
    match soft {
        Some(n) => n.saturating_sub(RESERVED_FILES).max(64),
        None => 10_000,
    }
}

/// The answer to a connection over the limit.
fn overload_response() -> Vec<u8> {
    let body = br#"{"error":{"message":"the router is at its connection limit; retry shortly","type":"service_unavailable","code":"overloaded"}}"#;
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves, then waits for
/// open connections to finish.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let service = TowerToHyperService::new(router);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let overload = Arc::new(overload_response());
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    // Under file-descriptor exhaustion accept fails every pause: warn at most every 10 s,
    // saying how many failures went unlogged (the counter has them all).
    let mut warned: Option<std::time::Instant> = None;
    let mut unlogged = 0u64;
    loop {
        let (tcp, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(error) => {
                    // Out of file descriptors, or a connection reset before accept: pause
                    // so the loop does not spin, and go on.
                    if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                        tracing::warn!(%error, unlogged, "accept failed");
                        warned = Some(std::time::Instant::now());
                        unlogged = 0;
                    } else {
                        unlogged += 1;
                    }
                    metrics::counter!(crate::metric_names::ROUTER_ACCEPT_ERRORS_TOTAL).increment(1);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Streamed tokens are small writes: never hold them back for Nagle's algorithm.
        let _ = tcp.set_nodelay(true);
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics::counter!(crate::metric_names::ROUTER_CONNECTIONS_REFUSED_TOTAL).increment(1);
            let overload = overload.clone();
            tokio::spawn(async move {
                // Answer after the request's head (clients do not expect a response
                // before they have sent one), within a second, then close.
                let mut tcp = tcp;
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    let mut head = Vec::with_capacity(1024);
                    let mut buf = [0u8; 1024];
                    while head.len() < 16 * 1024 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = tcp.write_all(&overload).await;
                })
                .await;
            });
            continue;
        };
        let conn = http.serve_connection(TokioIo::new(tcp), service.clone());
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            metrics::gauge!(crate::metric_names::ROUTER_CONNECTIONS).increment(1.0);
            let _ = conn.await;
            metrics::gauge!(crate::metric_names::ROUTER_CONNECTIONS).decrement(1.0);
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
