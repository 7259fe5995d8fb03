//! The block API's listeners: TCP and a Unix socket, the same protocol on both.
//!
//! Per connection: the handshake (version and token, within [`HANDSHAKE_TIMEOUT`]), then a
//! reader that decodes frames and runs each request as its own task (pipelining: answers
//! go back as they are ready, tagged with the request's id), at most [`IN_FLIGHT`] at once
//! per connection, and a writer that sends the answers. A frame over the size limit or a
//! body that stops arriving ends the connection after an error answer; a header that does
//! not decode is answered with an error and the connection goes on (the length prefix keeps
//! the stream in step).
//!
//! Under attack (issue 26): a connection has [`HANDSHAKE_TIMEOUT`] to authenticate, and
//! connections still in their handshake are capped per source address and overall
//! ([`crate::handshakes`]): one over a cap displaces the oldest (of its source, or of all), so that a
//! flood of silent connections never keeps an engine from its turn. Only an authenticated
//! connection takes one of the `max_connections` places. Frames are bounded by the
//! connection's in-flight budget before their body is read, and a frame's bytes are taken
//! from the connection's budget and the agent's before its body is read and given back
//! when its answer is ready. A connection's pins and leases end when it closes.
//!
//! On the Unix socket a connection also carries descriptors (`sealed.rs`): a sealed put's
//! come with its frame's first byte and are taken, in order, by that frame (a frame whose
//! descriptors did not come ends the connection); a sealed get's answer carries L1's own.
//! Over TCP a sealed request is refused and the connection goes on.

use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};

use crate::agent::Agent;
use crate::block::Block;
use crate::handshakes::Unproven;
use crate::pool::BufPool;
use crate::proto::{self, ErrorKind, Outgoing, ProtoError, Request, Response};
use crate::sealed::{FdStream, Fds};

/// Time a new connection has to present its handshake (a local engine needs microseconds).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Time a frame's body has to arrive once its length did.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Requests of one connection handled at once.
pub const IN_FLIGHT: usize = 64;
/// The read buffer in front of a connection: frame prefixes and headers come out of it;
/// payloads bypass it into their own buffers, all but the start of a payload that arrived
/// with its frame's header, which is copied out of it once. Small, so that this start is
/// at most 16 KiB of a megabyte block (it was 64 KiB: 6% of a 1 MiB put copied twice).
pub const READ_BUFFER_BYTES: usize = 16 << 10;

/// Serves the block API on `tcp` and `unix` until `shutdown` resolves.
pub async fn serve(
    agent: Arc<Agent>,
    tcp: Option<tokio::net::TcpListener>,
    unix: Option<tokio::net::UnixListener>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let limit = Arc::new(Shared {
        authenticated: Arc::new(Semaphore::new(agent.config().max_connections)),
        inflight: Arc::new(Semaphore::new(agent.config().inflight_bytes() as usize)),
        pending: Unproven::new(
            "block",
            agent.config().max_unauthenticated,
            agent.config().max_unauthenticated_per_source,
        ),
    });
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
                Ok((s, peer)) => {
                    let _ = s.set_nodelay(true);
                    spawn_conn(&agent, &limit, Some(peer.ip()), s, None);
                }
                Err(e) => {
                    accept_failed(e);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    let fd_budget = Arc::new(Semaphore::new(crate::sealed::MAX_UNSETTLED_FDS));
    let unix_loop = async {
        let Some(l) = unix else {
            return std::future::pending().await;
        };
        loop {
            match l.accept().await {
                Ok((s, _)) => {
                    let (s, fds) = FdStream::with_budget(s, Some(fd_budget.clone()));
                    spawn_conn(&agent, &limit, None, s, Some(fds))
                }
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

/// What every connection of one listener shares: the places of authenticated connections,
/// the agent's in-flight byte budget, and the connections still in their handshake.
struct Shared {
    authenticated: Arc<Semaphore>,
    inflight: Arc<Semaphore>,
    pending: Unproven,
}

/// `n` permits of `budget`: at once when enough are free (the common case: one CAS, no
/// waiter set up), else waiting for them (permits given back go to waiters first).
async fn take(
    budget: &Arc<Semaphore>,
    n: u32,
) -> Result<tokio::sync::OwnedSemaphorePermit, tokio::sync::AcquireError> {
    match budget.clone().try_acquire_many_owned(n) {
        Ok(p) => Ok(p),
        Err(_) => budget.clone().acquire_many_owned(n).await,
    }
}

/// Owners of pins and leases: one per connection, never reused (0 is nobody's).
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// `fds`: the descriptors of a Unix connection (sealed blocks, `sealed.rs`); None on TCP.
fn spawn_conn<S>(
    agent: &Arc<Agent>,
    shared: &Arc<Shared>,
    source: Option<IpAddr>,
    stream: S,
    fds: Option<Arc<Fds>>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (agent, shared) = (agent.clone(), shared.clone());
    tokio::spawn(async move {
        let owner = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = connection(&agent, &shared, source, owner, stream, fds).await {
            counter!(crate::metric_names::AGENT_PROTOCOL_ERRORS_TOTAL).increment(1);
            tracing::debug!(error = %e, "block api connection ended");
        }
        agent.connection_closed(owner);
    });
}

async fn connection<S>(
    agent: &Arc<Agent>,
    shared: &Arc<Shared>,
    source: Option<IpAddr>,
    owner: u64,
    stream: S,
    fds: Option<Arc<Fds>>,
) -> Result<(), ProtoError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let io = |e: std::io::Error| ProtoError::Malformed(e.to_string());
    // Handshake: nothing else is read before the token is checked.
    let (pending, displaced) = shared.pending.admit(source);
    let hello = tokio::select! {
        hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
            let mut prefix = [0u8; 8];
            rd.read_exact(&mut prefix).await.map_err(io)?;
            let (version, token_len) = proto::decode_hello_prefix(&prefix)?;
            let mut token = vec![0u8; token_len];
            rd.read_exact(&mut token).await.map_err(io)?;
            Ok::<_, ProtoError>((version, token))
        }) => hello,
        _ = displaced => {
            return Err(ProtoError::Malformed("displaced before its handshake".into()));
        }
    };
    shared.pending.done(pending);
    let hello = hello.map_err(|_| ProtoError::Malformed("no handshake in time".into()))?;
    let (version, token) = match hello {
        Ok(h) => h,
        Err(e) => {
            let _ = wr
                .write_all(&proto::encode_welcome(proto::HELLO_VERSION, &e.to_string()))
                .await;
            return Err(e);
        }
    };
    if !(proto::MIN_VERSION..=proto::VERSION).contains(&version) {
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
    let Ok(_place) = shared.authenticated.clone().try_acquire_owned() else {
        counter!(crate::metric_names::AGENT_CONNECTIONS_REFUSED_TOTAL).increment(1);
        // Closing it: the engine sees a refused connection and recomputes.
        return Err(ProtoError::Malformed("over max_connections".into()));
    };
    wr.write_all(&proto::encode_welcome(proto::HELLO_OK, ""))
        .await
        .map_err(io)?;

    let (tx, rx) = mpsc::channel::<Outgoing>(IN_FLIGHT);
    let writer = tokio::spawn(write_frames(wr, rx, fds.clone()));
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let budget = Arc::new(Semaphore::new(
        agent.config().connection_inflight_bytes() as usize
    ));
    let limit = agent.config().max_frame_bytes();
    let mut rd = tokio::io::BufReader::with_capacity(READ_BUFFER_BYTES, rd);
    let put_lens = |r: &Request| match r {
        Request::Put { blocks, .. } => Some(blocks.iter().map(|b| b.bytes).collect()),
        _ => None,
    };
    let result = loop {
        if let Some(f) = &fds {
            f.room().await;
        }
        let mut len = [0u8; 4];
        match rd.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(io(e)),
        }
        let len = match proto::frame_len(len, limit) {
            Ok(l) => l,
            Err(e) => {
                counter!(crate::metric_names::AGENT_FRAMES_REFUSED_TOTAL).increment(1);
                let _ = tx.send(error_frame(0, ErrorKind::Malformed, &e)).await;
                break Err(e);
            }
        };
        // The frame's bytes from this connection's budget and the agent's, before its body
        // is read: a frame that would pass them waits, within the body's deadline.
        let bytes = len as u32;
        let read = async {
            let mine = take(&budget, bytes).await;
            let all = take(&shared.inflight, bytes).await;
            let frame = read_body::<_, Request>(&mut rd, len, agent.pool(), put_lens).await;
            Ok::<_, std::io::Error>((frame?, (mine.ok(), all.ok())))
        };
        let (frame, held) = match tokio::time::timeout(BODY_TIMEOUT, read).await {
            Ok(Ok(got)) => got,
            Ok(Err(e)) => break Err(io(e)),
            Err(_) => {
                break Err(ProtoError::Malformed(
                    "frame body did not arrive in time".into(),
                ))
            }
        };
        let (id, payloads) = (frame.id, frame.payloads);
        let header = match frame.header {
            Ok(h) => h,
            Err(e) => {
                counter!(crate::metric_names::AGENT_PROTOCOL_ERRORS_TOTAL).increment(1);
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
        // A sealed frame's descriptors came with its first byte; they are the next ones
        // queued. Fewer than it names: the stream is out of step, and ends.
        let mut passed = None;
        match (&header, &fds) {
            (Request::PutSealed { blocks, .. }, Some(f)) => match f.take(blocks.len()) {
                Some(got) => passed = Some(got),
                None => {
                    let e = ProtoError::Malformed(format!(
                        "a sealed put of {} blocks came with {} descriptors",
                        blocks.len(),
                        f.queued()
                    ));
                    let _ = tx.send(error_frame(id, ErrorKind::Malformed, &e)).await;
                    break Err(e);
                }
            },
            (Request::PutSealed { .. } | Request::GetSealed { .. }, None) => {
                let e =
                    ProtoError::Malformed("sealed blocks travel on the Unix socket only".into());
                if tx
                    .send(error_frame(id, ErrorKind::BadRequest, &e))
                    .await
                    .is_err()
                {
                    break Ok(());
                }
                continue;
            }
            _ => {}
        }
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break Ok(());
        };
        let (agent, tx) = (agent.clone(), tx.clone());
        tokio::spawn(async move {
            // The descriptors' share of the budget is given back when the put is done.
            let (fds, permits) = match passed {
                Some(t) => t.split(),
                None => (Vec::new(), None),
            };
            let (response, payloads, sealed) = agent.handle(owner, header, payloads, fds).await;
            drop(permits);
            drop(held);
            let response = response.for_version(version);
            let mut out = proto::encode_frame(id, &response, payloads);
            out.fds = sealed;
            let _ = tx.send(out).await;
            drop(slot);
        });
    };
    drop(tx);
    let _ = writer.await;
    // Every request of the connection answered (or dropped) before its holds are ended by
    // the caller: none takes a pin after its owner closed.
    let _ = slots.acquire_many(IN_FLIGHT as u32).await;
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

/// A frame's body as read off the wire: its request id, its header or why that is not one,
/// and its payloads, each in a buffer of its own with its checksum.
#[derive(Debug)]
pub struct ReadFrame<H> {
    pub id: u64,
    pub header: Result<H, ProtoError>,
    pub payloads: Vec<Block>,
}

/// Reads the body of a frame whose prefix announced `len` bytes (at least 12, checked by
/// [`proto::frame_len`]). `lens` says which payloads a decoded header announces; when they
/// add up to the rest of the body, each is read into a buffer of its own from `pool` (no
/// copy out of a frame buffer afterwards, no fresh pages when the pool has one) and its
/// xxh3 is computed chunk by chunk as it arrives, while the bytes are still in cache. A
/// header that does not decode, or payloads that do not add up, leave the rest of the body
/// read and dropped, so the stream stays in step, and come back as the header's error.
pub async fn read_body<R, H>(
    rd: &mut R,
    len: usize,
    pool: &BufPool,
    lens: impl FnOnce(&H) -> Option<Vec<u32>>,
) -> std::io::Result<ReadFrame<H>>
where
    R: AsyncRead + Unpin,
    H: DeserializeOwned,
{
    let mut fixed = [0u8; 12];
    rd.read_exact(&mut fixed).await?;
    let id = u64::from_le_bytes(fixed[..8].try_into().unwrap_or([0; 8]));
    let header_len = u32::from_le_bytes(fixed[8..].try_into().unwrap_or([0; 4])) as usize;
    let mut rest = len.saturating_sub(12);
    let unread = |header| ReadFrame {
        id,
        header,
        payloads: Vec::new(),
    };
    if header_len > rest {
        skip(rd, rest).await?;
        return Ok(unread(Err(ProtoError::Malformed(format!(
            "header of {header_len} bytes in a body of {rest}"
        )))));
    }
    // Grown as the bytes arrive: a length is not an allocation until they do.
    let mut raw = Vec::new();
    (&mut *rd)
        .take(header_len as u64)
        .read_to_end(&mut raw)
        .await?;
    if raw.len() < header_len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    rest -= header_len;
    let header =
        postcard::from_bytes::<H>(&raw).map_err(|e| ProtoError::Malformed(format!("header: {e}")));
    let header = match header {
        Ok(h) => match lens(&h) {
            Some(lens) => {
                let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
                if total == rest as u64 {
                    let mut payloads = Vec::with_capacity(lens.len());
                    for l in lens {
                        payloads.push(read_payload(rd, l as usize, pool).await?);
                    }
                    return Ok(ReadFrame {
                        id,
                        header: Ok(h),
                        payloads,
                    });
                }
                Err(ProtoError::Malformed(format!(
                    "payloads of {total} bytes announced where {rest} follow the header"
                )))
            }
            None => Ok(h),
        },
        Err(e) => Err(e),
    };
    skip(rd, rest).await?;
    Ok(unread(header))
}

/// One payload of `len` bytes into a buffer of its own, checksummed as it arrives.
async fn read_payload<R: AsyncRead + Unpin>(
    rd: &mut R,
    len: usize,
    pool: &BufPool,
) -> std::io::Result<Block> {
    let mut buf = pool.take(len);
    let mut sum = crate::block::Checksum::default();
    while buf.len() < len {
        let before = buf.len();
        // Into the buffer's spare capacity: never zeroed first.
        let n = (&mut *rd)
            .take((len - before) as u64)
            .read_buf(&mut buf)
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        sum.update(&buf[before..]);
    }
    Ok(Block {
        checksum: sum.digest(),
        payload: pool.freeze(buf),
    })
}

/// Reads and drops `n` bytes.
async fn skip<R: AsyncRead + Unpin>(rd: &mut R, n: usize) -> std::io::Result<()> {
    if n == 0 {
        return Ok(());
    }
    let copied = tokio::io::copy(&mut (&mut *rd).take(n as u64), &mut tokio::io::sink()).await?;
    if copied < n as u64 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Writes the frames `rx` brings, in order, until it closes or a write fails (a
/// connection's writer task, the agent's and the client's); on a Unix connection (`fds`)
/// each frame's sealed blocks go with its first byte. Flushes when no frame is waiting.
pub async fn write_frames<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Outgoing>,
    fds: Option<Arc<Fds>>,
) {
    while let Some(mut out) = rx.recv().await {
        if let Some(f) = &fds {
            f.send_with_next_write(std::mem::take(&mut out.fds));
        }
        if write_frame(&mut w, &out).await.is_err() {
            return;
        }
        if rx.is_empty() && w.flush().await.is_err() {
            return;
        }
    }
}

/// Writes a frame, its head and its payloads as they are, with vectored writes: a frame of
/// many small blocks is a few system calls, and no payload is copied into a frame buffer.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, out: &Outgoing) -> std::io::Result<()> {
    let parts: Vec<&[u8]> = std::iter::once(&out.head[..])
        .chain(out.payloads.iter().map(|p| &p[..]))
        .collect();
    crate::io::write_all_vectored(w, &parts).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::checksum;
    use crate::proto::PutItem;
    use bytes::Bytes;

    fn put_lens(r: &Request) -> Option<Vec<u32>> {
        match r {
            Request::Put { blocks, .. } => Some(blocks.iter().map(|b| b.bytes).collect()),
            _ => None,
        }
    }

    /// Frames written with vectored writes through a small pipe read back whole: payloads in
    /// buffers of their own, checksums computed on arrival equal to the one-pass checksum,
    /// and a frame whose payloads do not add up is an error that leaves the stream in step.
    #[test]
    fn frames_cross_a_pipe_with_their_checksums() {
        crate::test_runtime().block_on(async {
            let (mut a, mut b) = tokio::io::duplex(4096);
            let big: Bytes = (0..300_000u32).map(|i| (i % 251) as u8).collect();
            let small = Bytes::from_static(b"small block");
            let item = |key, bytes| PutItem {
                key,
                bytes,
                pin: false,
            };
            let good = proto::encode_frame(
                1,
                &Request::Put {
                    layout: 1,
                    blocks: vec![item(1, big.len() as u32), item(2, small.len() as u32)],
                },
                vec![big.clone(), small.clone()],
            );
            // Announces 5 bytes, carries 11.
            let bad = proto::encode_frame(
                2,
                &Request::Put {
                    layout: 1,
                    blocks: vec![item(3, 5)],
                },
                vec![small.clone()],
            );
            let lookup = proto::encode_frame(3, &Request::Stats, Vec::new());
            let writer = tokio::spawn(async move {
                for f in [good, bad, lookup] {
                    write_frame(&mut a, &f).await.unwrap();
                }
            });
            let pool = BufPool::new(1 << 20);
            let mut frames = Vec::new();
            for _ in 0..3 {
                let mut len = [0u8; 4];
                b.read_exact(&mut len).await.unwrap();
                let len = proto::frame_len(len, 1 << 20).unwrap();
                frames.push(
                    read_body::<_, Request>(&mut b, len, &pool, put_lens)
                        .await
                        .unwrap(),
                );
            }
            writer.await.unwrap();
            assert_eq!(frames[0].id, 1);
            assert!(frames[0].header.is_ok());
            let got: Vec<&Block> = frames[0].payloads.iter().collect();
            assert_eq!(got[0].payload, big);
            assert_eq!(got[0].checksum, checksum(&big));
            assert_eq!(got[1].payload, small);
            assert_eq!(got[1].checksum, checksum(&small));
            assert_eq!(frames[1].id, 2);
            assert!(matches!(frames[1].header, Err(ProtoError::Malformed(_))));
            assert_eq!(frames[2].id, 3);
            assert_eq!(frames[2].header, Ok(Request::Stats));
        });
    }
}
