//! The block API's listeners: TCP and a Unix socket, the same protocol on both.
//!
//! Per connection: the handshake (version and token, within [`HANDSHAKE_TIMEOUT`]), then a
//! reader that decodes frames and runs each request as its own task (pipelining: answers
//! go back as they are ready, tagged with the request's id), at most [`IN_FLIGHT`] at once
//! per connection, and a writer that sends the answers. A frame over the size limit or a
//! body that stops arriving ends the connection after an error answer; a header that does
//! not decode is answered with an error and the connection goes on (the length prefix keeps
//! the stream in step). Connections beyond the limit are refused at accept.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use metrics::counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};

use crate::agent::Agent;
use crate::proto::{self, ErrorKind, Outgoing, ProtoError, Request, Response};

/// Time a new connection has to present its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a frame's body has to arrive once its length did.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Requests of one connection handled at once.
pub const IN_FLIGHT: usize = 64;

/// Serves the block API on `tcp` and `unix` until `shutdown` resolves.
pub async fn serve(
    agent: Arc<Agent>,
    tcp: Option<tokio::net::TcpListener>,
    unix: Option<tokio::net::UnixListener>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let limit = Arc::new(Semaphore::new(agent.config().max_connections));
    // Under file-descriptor exhaustion accept fails every pause: warn at most every 10 s.
    let warned = std::sync::Mutex::new(None::<std::time::Instant>);
    let accept_failed = |e: std::io::Error| {
        counter!(crate::metric_names::AGENT_ACCEPT_ERRORS_TOTAL).increment(1);
        let mut w = warned.lock().unwrap_or_else(|p| p.into_inner());
        if w.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!(error = %e, "block api accept failed");
            *w = Some(std::time::Instant::now());
        }
    };
    let tcp_loop = async {
        let Some(l) = tcp else {
            return std::future::pending().await;
        };
        loop {
            match l.accept().await {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    spawn_conn(&agent, &limit, s);
                }
                Err(e) => {
                    accept_failed(e);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    let unix_loop = async {
        let Some(l) = unix else {
            return std::future::pending().await;
        };
        loop {
            match l.accept().await {
                Ok((s, _)) => spawn_conn(&agent, &limit, s),
                Err(e) => {
                    accept_failed(e);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    tokio::select! {
        _ = tcp_loop => {}
        _ = unix_loop => {}
        _ = shutdown => {}
    }
}

/// Binds the Unix socket at `path` (replacing a stale one), readable and writable by the
/// owner and group only: the socket's permissions are its access control.
pub fn bind_unix(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let l = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(l)
}

fn spawn_conn<S>(agent: &Arc<Agent>, limit: &Arc<Semaphore>, stream: S)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Ok(permit) = limit.clone().try_acquire_owned() else {
        counter!(crate::metric_names::AGENT_CONNECTIONS_REFUSED_TOTAL).increment(1);
        // Dropping the stream closes it: the engine sees a refused connection and recomputes.
        return;
    };
    let agent = agent.clone();
    tokio::spawn(async move {
        if let Err(e) = connection(agent, stream).await {
            counter!(crate::metric_names::AGENT_PROTOCOL_ERRORS_TOTAL).increment(1);
            tracing::debug!(error = %e, "block api connection ended");
        }
        drop(permit);
    });
}

async fn connection<S>(agent: Arc<Agent>, stream: S) -> Result<(), ProtoError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let io = |e: std::io::Error| ProtoError::Malformed(e.to_string());
    // Handshake: nothing else is read before the token is checked.
    let hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let mut prefix = [0u8; 8];
        rd.read_exact(&mut prefix).await.map_err(io)?;
        let (version, token_len) = proto::decode_hello_prefix(&prefix)?;
        let mut token = vec![0u8; token_len];
        rd.read_exact(&mut token).await.map_err(io)?;
        Ok::<_, ProtoError>((version, token))
    })
    .await
    .map_err(|_| ProtoError::Malformed("no handshake in time".into()))?;
    let (version, token) = match hello {
        Ok(h) => h,
        Err(e) => {
            let _ = wr
                .write_all(&proto::encode_welcome(proto::HELLO_VERSION, &e.to_string()))
                .await;
            return Err(e);
        }
    };
    if version != proto::VERSION {
        let e = ProtoError::Version(version);
        let _ = wr
            .write_all(&proto::encode_welcome(proto::HELLO_VERSION, &e.to_string()))
            .await;
        return Err(e);
    }
    if let Some(want) = &agent.config().token {
        // blake3's hash equality is constant-time, as the admin API's token check.
        if blake3::hash(want.as_bytes()) != blake3::hash(&token) {
            let _ = wr
                .write_all(&proto::encode_welcome(
                    proto::HELLO_TOKEN,
                    "missing or wrong block API token",
                ))
                .await;
            return Err(ProtoError::Malformed("wrong token".into()));
        }
    }
    wr.write_all(&proto::encode_welcome(proto::HELLO_OK, ""))
        .await
        .map_err(io)?;

    let (tx, mut rx) = mpsc::channel::<Outgoing>(IN_FLIGHT);
    let writer = tokio::spawn(async move {
        while let Some(out) = rx.recv().await {
            if write_frame(&mut wr, &out).await.is_err() {
                return;
            }
            if rx.is_empty() && wr.flush().await.is_err() {
                return;
            }
        }
    });
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let limit = agent.config().max_frame_bytes();
    let result = loop {
        let mut len = [0u8; 4];
        match rd.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(io(e)),
        }
        let len = match proto::frame_len(len, limit) {
            Ok(l) => l,
            Err(e) => {
                let _ = tx.send(error_frame(0, ErrorKind::Malformed, &e)).await;
                break Err(e);
            }
        };
        let body = match tokio::time::timeout(BODY_TIMEOUT, read_bytes(&mut rd, len)).await {
            Ok(Ok(body)) => body,
            Ok(Err(e)) => break Err(io(e)),
            Err(_) => {
                break Err(ProtoError::Malformed(
                    "frame body did not arrive in time".into(),
                ))
            }
        };
        let frame = match proto::decode_body::<Request>(body.clone()) {
            Ok(f) => f,
            Err(e) => {
                counter!(crate::metric_names::AGENT_PROTOCOL_ERRORS_TOTAL).increment(1);
                let id = proto::frame_id(&body).unwrap_or(0);
                if tx
                    .send(error_frame(id, ErrorKind::Malformed, &e))
                    .await
                    .is_err()
                {
                    break Ok(());
                }
                continue;
            }
        };
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break Ok(());
        };
        let (agent, tx) = (agent.clone(), tx.clone());
        tokio::spawn(async move {
            let (response, payloads) = agent.handle(frame.header, frame.payloads).await;
            let _ = tx
                .send(proto::encode_frame(frame.id, &response, payloads))
                .await;
            drop(slot);
        });
    };
    drop(tx);
    let _ = writer.await;
    result
}

fn error_frame(id: u64, kind: ErrorKind, e: &ProtoError) -> Outgoing {
    proto::encode_frame(
        id,
        &Response::Error {
            kind,
            message: e.to_string(),
        },
        Vec::new(),
    )
}

/// Reads exactly `len` bytes into a buffer of their own: no zeroing first, and a put of one
/// block can keep the buffer as the block's storage (see `agent.rs`).
pub async fn read_bytes<R: AsyncRead + Unpin>(
    rd: &mut R,
    len: usize,
) -> std::io::Result<bytes::Bytes> {
    let mut buf = BytesMut::with_capacity(len);
    let mut limited = rd.take(len as u64);
    while buf.len() < len {
        if limited.read_buf(&mut buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf.freeze())
}

/// Writes a frame: its head, then each payload as it is.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, out: &Outgoing) -> std::io::Result<()> {
    w.write_all(&out.head).await?;
    for p in &out.payloads {
        w.write_all(p).await?;
    }
    Ok(())
}
