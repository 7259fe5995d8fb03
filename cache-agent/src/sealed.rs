//! Sealed blocks: the block API's shared-memory data plane on the Unix socket (version 3,
//! [record 0120](../../docs/decisions/0120-sealed-memfd-blocks.md)).
//!
//! Over a socket a block is copied twice each way: into the kernel by the sender, out of it
//! by the receiver (issue 24 measured 0.47× memcpy at best for puts). On the Unix socket a
//! block can instead travel as a file descriptor: the engine writes the payload into a memfd
//! (`memfd_create`, one copy), seals it against writing, growing and shrinking, and passes
//! the descriptor with its `PutSealed` frame (`SCM_RIGHTS`); the agent adds the seals itself
//! (so a writer that kept a writable mapping is refused: the kernel will not seal it),
//! checks its length, and keeps the descriptor as the L1 block: no copy, no pass over the
//! bytes on the agent's side (the checksum is taken when first needed, [`Sealed::checksum`]).
//! A `GetSealed` answers with the descriptors; the engine reads each once (one copy).
//!
//! Why it is safe to share: once sealed, nobody can change the bytes, not the writer who
//! holds another descriptor of it, nor a reader; the first writer's bytes stay its own
//! (issue 26). A descriptor received is accepted only if the kernel seals it (a memfd; a
//! pipe, socket or regular file is refused) and only at the length its frame announced.
//! Bounded: the descriptors waiting on a connection are capped ([`MAX_QUEUED_FDS`]), one
//! message carries at most [`MAX_FDS_PER_FRAME`] (the kernel's `SCM_MAX_FD`), and the agent
//! keeps at most a share of its open-file limit as sealed L1 blocks (past it, a sealed put
//! is read into memory like a socket put).
//!
//! No `unsafe` (the workspace forbids it): nothing is mapped; the bytes move with `pwrite`
//! and `pread` (what a copy into or out of a mapping costs, one copy each way).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::pool::BufPool;

/// Descriptors one message carries at most (Linux's `SCM_MAX_FD`): a sealed put or get of
/// more blocks goes as several.
pub const MAX_FDS_PER_FRAME: usize = 253;
/// Descriptors received on one connection and not yet taken by their frames: past it the
/// connection ends.
pub const MAX_QUEUED_FDS: usize = 2 * MAX_FDS_PER_FRAME;
/// Descriptors the agent's connections together hold received and not yet settled (queued,
/// or taken by a put still being handled): past it the connection whose read would pass it
/// ends. With the connections' cap this bounds what clients can hold of the agent's
/// descriptor table; L1's own memfds are bounded apart (`agent`'s `sealed_fd_budget`).
pub const MAX_UNSETTLED_FDS: usize = 4096;
/// Payloads shorter than this go through the socket even where sealed blocks are on: a
/// memfd costs a few system calls, which a copy of a small block does not.
pub const SEALED_MIN_BYTES: usize = 64 << 10;
/// What a sealed block can no longer do.
const SEALS: SealFlags = SealFlags::WRITE
    .union(SealFlags::GROW)
    .union(SealFlags::SHRINK)
    .union(SealFlags::SEAL);
/// Bytes read at a time to checksum a sealed block (in cache while hashed).
const CHUNK: usize = 256 << 10;

/// Why a received descriptor is not a block.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("not a sealable memfd: {0}")]
    NotSealable(io::Error),
    #[error("{got} bytes where {want} were announced")]
    Length { got: u64, want: u64 },
    #[error("reading it: {0}")]
    Io(#[from] io::Error),
}

/// A block's bytes in a sealed memfd: immutable, whoever holds it. Its checksum is taken
/// when first needed (an L2 write, a get through the socket, a second put of its key), not
/// when it arrives: the bytes cannot change in between, and most offloaded blocks are never
/// read again, so a put costs the agent no pass over them.
#[derive(Debug)]
pub struct Sealed {
    file: File,
    len: usize,
    checksum: OnceLock<u64>,
}

impl Sealed {
    /// A sealed copy of `bytes` (an engine's put), its checksum left to be taken when first
    /// needed.
    pub fn copy_of(bytes: &[u8]) -> io::Result<Sealed> {
        let fd = rustix::fs::memfd_create(
            "warmpath-block",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        let file = File::from(fd);
        file.write_all_at(bytes, 0)?;
        rustix::fs::fcntl_add_seals(&file, SEALS)?;
        Ok(Sealed {
            file,
            len: bytes.len(),
            checksum: OnceLock::new(),
        })
    }

    /// Takes a descriptor received from a peer as a block of `want` bytes: sealed here (an
    /// existing writable mapping makes the kernel refuse) and its length checked.
    pub fn adopt(fd: OwnedFd, want: u64) -> Result<Sealed, SealError> {
        match rustix::fs::fcntl_add_seals(&fd, SEALS) {
            Ok(()) => {}
            // Sealed already, F_SEAL_SEAL included: acceptable if what we need is there.
            Err(rustix::io::Errno::PERM) => {
                let have = rustix::fs::fcntl_get_seals(&fd)
                    .map_err(|e| SealError::NotSealable(e.into()))?;
                if !have.contains(SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK) {
                    return Err(SealError::NotSealable(io::Error::other(
                        "sealed without F_SEAL_WRITE, F_SEAL_GROW and F_SEAL_SHRINK",
                    )));
                }
            }
            Err(e) => return Err(SealError::NotSealable(e.into())),
        }
        let file = File::from(fd);
        let got = file.metadata()?.len();
        if got != want {
            return Err(SealError::Length { got, want });
        }
        Ok(Sealed {
            file,
            len: want as usize,
            checksum: OnceLock::new(),
        })
    }

    /// A descriptor the agent passed with a get's answer: sealed by it, of `want` bytes.
    pub fn received(fd: OwnedFd, want: u64) -> io::Result<Sealed> {
        let have = rustix::fs::fcntl_get_seals(&fd)?;
        if !have.contains(SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK) {
            return Err(io::Error::other("a block descriptor that is not sealed"));
        }
        let file = File::from(fd);
        let got = file.metadata()?.len();
        if got != want {
            return Err(io::Error::other(format!(
                "a sealed block of {got} bytes where {want} were announced"
            )));
        }
        Ok(Sealed {
            file,
            len: want as usize,
            checksum: OnceLock::new(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The checksum, if it was taken already.
    pub fn known_checksum(&self) -> Option<u64> {
        self.checksum.get().copied()
    }

    /// The checksum, taken now if it was not (reading the block once, a chunk at a time).
    pub fn checksum(&self) -> io::Result<u64> {
        if let Some(&c) = self.checksum.get() {
            return Ok(c);
        }
        let mut chunk = vec![0u8; CHUNK.min(self.len.max(1))];
        let mut sum = crate::block::Checksum::default();
        let mut at = 0;
        while at < self.len {
            let n = (self.len - at).min(CHUNK);
            self.file.read_exact_at(&mut chunk[..n], at as u64)?;
            sum.update(&chunk[..n]);
            at += n;
        }
        Ok(*self.checksum.get_or_init(|| sum.digest()))
    }

    /// The bytes, read once into a buffer from `pool` (one copy, no checksum: sealed bytes
    /// are the bytes that were sealed).
    pub fn read(&self, pool: &BufPool) -> io::Result<Bytes> {
        let mut buf = pool.take(self.len);
        while buf.len() < self.len {
            let at = buf.len();
            let n = rustix::io::pread(
                &self.file,
                rustix::buffer::spare_capacity(&mut buf),
                at as u64,
            )?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(pool.freeze(buf))
    }

    /// The bytes and their checksum (taken now if it was not, from the bytes read).
    pub fn read_checked(&self, pool: &BufPool) -> io::Result<(Bytes, u64)> {
        let bytes = self.read(pool)?;
        let sum = crate::block::checksum(&bytes);
        match self.checksum.get() {
            Some(&c) if c != sum => Err(io::Error::other("sealed block checksum mismatch")),
            _ => Ok((bytes, *self.checksum.get_or_init(|| sum))),
        }
    }
}

impl AsFd for Sealed {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// Descriptors a connection received, in order, for its frames to take; and those its next
/// write is to carry.
#[derive(Debug, Default)]
pub struct Fds {
    received: Mutex<Received>,
    to_send: Mutex<Vec<Arc<Sealed>>>,
    /// The listener's budget of unsettled descriptors (the agent's side; a client has none).
    budget: Option<Arc<Semaphore>>,
}

#[derive(Debug, Default)]
struct Received {
    fds: VecDeque<OwnedFd>,
    /// The budget's permits for `fds`, one each.
    permits: Option<OwnedSemaphorePermit>,
}

/// Descriptors a frame took, with their share of the budget (given back when dropped: when
/// the frame's handling is done).
#[derive(Debug)]
pub struct Taken {
    fds: Vec<OwnedFd>,
    _permits: Option<OwnedSemaphorePermit>,
}

impl Taken {
    /// The descriptors, and their share of the budget to drop when done with them.
    pub fn split(self) -> (Vec<OwnedFd>, Option<OwnedSemaphorePermit>) {
        (self.fds, self._permits)
    }
}

impl Fds {
    /// The next `n` descriptors received; None when fewer arrived (the peer is out of step).
    pub fn take(&self, n: usize) -> Option<Taken> {
        let mut q = self.received.lock().unwrap_or_else(|p| p.into_inner());
        if q.fds.len() < n {
            return None;
        }
        let fds = q.fds.drain(..n).collect();
        let all = q.permits.as_ref().map(|p| p.num_permits()) == Some(n);
        let permits = if n == 0 {
            None
        } else if all {
            q.permits.take()
        } else {
            q.permits.as_mut().and_then(|p| p.split(n))
        };
        Some(Taken {
            fds,
            _permits: permits,
        })
    }

    /// Descriptors for the next write to carry (the start of the frame written next).
    pub fn send_with_next_write(&self, fds: Vec<Arc<Sealed>>) {
        *self.to_send.lock().unwrap_or_else(|p| p.into_inner()) = fds;
    }

    /// Waits until the listener's budget has room for a connection's worth of descriptors
    /// ([`MAX_QUEUED_FDS`]), before the next frame is read: an engine that pipelines sealed
    /// puts faster than the agent settles them is slowed down, not cut off.
    pub async fn room(&self) {
        if let Some(budget) = &self.budget {
            let _ = budget.acquire_many(MAX_QUEUED_FDS as u32).await;
        }
    }

    pub fn queued(&self) -> usize {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fds
            .len()
    }

    /// Queues descriptors just received, within the connection's cap and the budget.
    fn queue(&self, fresh: Vec<OwnedFd>) -> io::Result<()> {
        let mut q = self.received.lock().unwrap_or_else(|p| p.into_inner());
        if q.fds.len() + fresh.len() > MAX_QUEUED_FDS {
            return Err(io::Error::other(format!(
                "more than {MAX_QUEUED_FDS} descriptors waiting for their frames"
            )));
        }
        if let Some(budget) = &self.budget {
            let Ok(p) = budget.clone().try_acquire_many_owned(fresh.len() as u32) else {
                return Err(io::Error::other(format!(
                    "the agent holds {MAX_UNSETTLED_FDS} descriptors received and not yet stored"
                )));
            };
            match &mut q.permits {
                Some(held) => held.merge(p),
                None => q.permits = Some(p),
            }
        }
        q.fds.extend(fresh);
        Ok(())
    }
}

/// A Unix stream that carries descriptors: reads into an initialized buffer (the frame
/// prefixes and headers, through the connection's read buffer) use `recvmsg` and queue
/// the descriptors that came with them; reads into uninitialized memory (payloads, which
/// never start a message) are plain reads; a write after [`Fds::send_with_next_write`]
/// is a `sendmsg` that carries them.
#[derive(Debug)]
pub struct FdStream {
    io: tokio::net::UnixStream,
    fds: Arc<Fds>,
}

impl FdStream {
    /// A stream with no budget on what it receives past its own cap (an engine's).
    pub fn new(io: tokio::net::UnixStream) -> (FdStream, Arc<Fds>) {
        Self::with_budget(io, None)
    }

    /// A stream whose unsettled descriptors count against `budget` (the agent's listener's).
    pub fn with_budget(
        io: tokio::net::UnixStream,
        budget: Option<Arc<Semaphore>>,
    ) -> (FdStream, Arc<Fds>) {
        let fds = Arc::new(Fds {
            budget,
            ..Fds::default()
        });
        (
            FdStream {
                io,
                fds: fds.clone(),
            },
            fds,
        )
    }
}

impl AsyncRead for FdStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if buf.initialized().len() < buf.capacity() {
            return Pin::new(&mut me.io).poll_read(cx, buf);
        }
        loop {
            ready!(me.io.poll_read_ready(cx))?;
            let dst = buf.initialize_unfilled();
            let mut space = [std::mem::MaybeUninit::uninit();
                rustix::cmsg_space!(ScmRights(MAX_FDS_PER_FRAME))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = me.io.try_io(Interest::READABLE, || {
                rustix::net::recvmsg(
                    &me.io,
                    &mut [io::IoSliceMut::new(dst)],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC,
                )
                .map_err(io::Error::from)
            });
            match got {
                Ok(msg) => {
                    let mut fresh = Vec::new();
                    for m in control.drain() {
                        if let RecvAncillaryMessage::ScmRights(fds) = m {
                            fresh.extend(fds);
                        }
                    }
                    if msg.flags.contains(ReturnFlags::CTRUNC) {
                        return Poll::Ready(Err(io::Error::other(
                            "descriptors past what one message may carry",
                        )));
                    }
                    if !fresh.is_empty() {
                        if let Err(e) = me.fds.queue(fresh) {
                            return Poll::Ready(Err(e));
                        }
                    }
                    buf.advance(msg.bytes);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl FdStream {
    /// Writes `bufs` with `sendmsg`, carrying the queued descriptors if there are any
    /// (kept queued until a write carries them).
    fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let fds = self.fds.clone();
        let mut pending = fds.to_send.lock().unwrap_or_else(|p| p.into_inner());
        if pending.is_empty() {
            drop(pending);
            return Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        }
        loop {
            ready!(self.io.poll_write_ready(cx))?;
            let borrowed: Vec<BorrowedFd<'_>> = pending.iter().map(|s| s.as_fd()).collect();
            let mut space = vec![
                std::mem::MaybeUninit::uninit();
                rustix::cmsg_space!(ScmRights(borrowed.len()))
            ];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
                return Poll::Ready(Err(io::Error::other(
                    "too many descriptors for one message",
                )));
            }
            let sent = self.io.try_io(Interest::WRITABLE, || {
                rustix::net::sendmsg(&self.io, bufs, &mut control, SendFlags::NOSIGNAL)
                    .map_err(io::Error::from)
            });
            match sent {
                Ok(n) => {
                    drop(borrowed);
                    pending.clear();
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for FdStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

    fn unsealed(bytes: &[u8]) -> OwnedFd {
        let fd = rustix::fs::memfd_create("t", MemfdFlags::ALLOW_SEALING).unwrap();
        let f = File::from(fd);
        f.write_all_at(bytes, 0).unwrap();
        f.into()
    }

    /// A memfd is adopted sealed, at its length, with the checksum of its bytes; read back
    /// whole; its writer can no longer change it. What is not a sealable memfd of the
    /// announced length is refused.
    #[test]
    fn memfds_are_adopted_sealed_and_nothing_else_is() {
        let bytes: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
        let fd = unsealed(&bytes);
        let writer = File::from(fd.try_clone().unwrap());
        let s = Sealed::adopt(fd, bytes.len() as u64).unwrap();
        assert!(writer.write_all_at(b"x", 0).is_err());
        assert!(writer.set_len(1).is_err());
        assert_eq!(s.known_checksum(), None);
        let sum = crate::block::checksum(&bytes);
        assert_eq!(s.checksum().unwrap(), sum);
        assert_eq!(s.known_checksum(), Some(sum));
        let pool = BufPool::new(1 << 20);
        let (back, sum2) = s.read_checked(&pool).unwrap();
        assert_eq!((&back[..], sum2), (&bytes[..], sum));
        // Sealed by its writer already (F_SEAL_SEAL included): taken as it is.
        let copy = Sealed::copy_of(&bytes).unwrap();
        let again = Sealed::adopt(copy.file.into(), bytes.len() as u64).unwrap();
        assert_eq!(again.read_checked(&pool).unwrap().1, sum);
        // A checksum that does not match the bytes is caught when they are read.
        let wrong = Sealed::copy_of(&bytes).unwrap();
        wrong.checksum.set(sum ^ 1).unwrap();
        assert!(wrong.read_checked(&pool).is_err());
        // Another length than announced.
        assert!(matches!(
            Sealed::adopt(unsealed(b"short"), 6),
            Err(SealError::Length { got: 5, want: 6 })
        ));
        // A pipe, a regular file: not memfds.
        let (r, _w) = rustix::pipe::pipe().unwrap();
        assert!(matches!(
            Sealed::adopt(r, 0),
            Err(SealError::NotSealable(_))
        ));
        let file = tempfile::tempfile().unwrap();
        assert!(matches!(
            Sealed::adopt(file.into(), 0),
            Err(SealError::NotSealable(_))
        ));
        // Sealed without F_SEAL_WRITE, then F_SEAL_SEAL: it could still change; refused.
        let open = unsealed(b"abc");
        rustix::fs::fcntl_add_seals(&open, SealFlags::SEAL).unwrap();
        assert!(matches!(
            Sealed::adopt(open, 3),
            Err(SealError::NotSealable(_))
        ));
        // A client accepts only what is sealed and of the announced length.
        assert!(Sealed::received(unsealed(b"abc"), 3).is_err());
        assert!(Sealed::received(Sealed::copy_of(b"abc").unwrap().file.into(), 4).is_err());
        assert!(Sealed::received(Sealed::copy_of(b"abc").unwrap().file.into(), 3).is_ok());
    }

    /// Descriptors written with a frame arrive queued, in order, through a read buffer as
    /// the server reads; payload reads into uninitialized memory are plain reads; a flood of
    /// descriptors past the cap ends the reading.
    #[test]
    fn descriptors_travel_with_their_frames_and_are_bounded() {
        crate::test_runtime().block_on(async {
            let (a, b) = tokio::net::UnixStream::pair().unwrap();
            let (mut a, a_fds) = FdStream::new(a);
            let (b, b_fds) = FdStream::new(b);
            let mut b = BufReader::with_capacity(16 << 10, b);
            let blocks: Vec<Arc<Sealed>> = (0..3u8)
                .map(|i| Arc::new(Sealed::copy_of(&[i; 100]).unwrap()))
                .collect();
            a_fds.send_with_next_write(blocks.clone());
            a.write_all(b"frame-one").await.unwrap();
            let payload = vec![9u8; 200_000];
            a.write_all(&payload).await.unwrap();
            a_fds.send_with_next_write(vec![blocks[2].clone()]);
            a.write_all(b"frame-two").await.unwrap();
            let mut head = [0u8; 9];
            b.read_exact(&mut head).await.unwrap();
            assert_eq!(&head, b"frame-one");
            let mut got = Vec::with_capacity(payload.len());
            (&mut b)
                .take(payload.len() as u64)
                .read_to_end(&mut got)
                .await
                .unwrap();
            assert_eq!(got, payload);
            b.read_exact(&mut head).await.unwrap();
            assert_eq!(&head, b"frame-two");
            let first = b_fds.take(3).unwrap();
            let pool = BufPool::new(1 << 20);
            for (i, fd) in first.fds.into_iter().enumerate() {
                let s = Sealed::received(fd, 100).unwrap();
                assert_eq!(&s.read(&pool).unwrap()[..], &[i as u8; 100]);
            }
            assert_eq!(b_fds.take(1).unwrap().fds.len(), 1);
            assert!(b_fds.take(1).is_none());

            // Past MAX_QUEUED_FDS waiting: the read fails.
            for _ in 0..(MAX_QUEUED_FDS / MAX_FDS_PER_FRAME + 1) {
                a_fds.send_with_next_write(vec![blocks[0].clone(); MAX_FDS_PER_FRAME]);
                a.write_all(b"x").await.unwrap();
            }
            let mut one = [0u8; 1];
            let mut failed = false;
            for _ in 0..4 {
                if b.read_exact(&mut one).await.is_err() {
                    failed = true;
                    break;
                }
            }
            assert!(failed, "a flood of descriptors ends the connection");
            assert!(b_fds.queued() <= MAX_QUEUED_FDS);

            // A listener's budget: descriptors count against it until their frame is done.
            let budget = Arc::new(Semaphore::new(3));
            let (c, d) = tokio::net::UnixStream::pair().unwrap();
            let (mut c, c_fds) = FdStream::new(c);
            let (d, d_fds) = FdStream::with_budget(d, Some(budget.clone()));
            let mut d = BufReader::with_capacity(16 << 10, d);
            c_fds.send_with_next_write(blocks[..2].to_vec());
            c.write_all(b"a").await.unwrap();
            d.read_exact(&mut one).await.unwrap();
            assert_eq!(budget.available_permits(), 1);
            let taken = d_fds.take(2).unwrap();
            assert_eq!(
                budget.available_permits(),
                1,
                "held while the put is handled"
            );
            drop(taken);
            assert_eq!(budget.available_permits(), 3);
            c_fds.send_with_next_write(blocks[..2].to_vec());
            c.write_all(b"b").await.unwrap();
            d.read_exact(&mut one).await.unwrap();
            c_fds.send_with_next_write(blocks[..2].to_vec());
            c.write_all(b"c").await.unwrap();
            assert!(
                d.read_exact(&mut one).await.is_err(),
                "past the budget the read fails"
            );
        });
    }
}
