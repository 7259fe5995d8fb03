//! Payload buffers that are used again: the block API reads each payload of a frame into a
//! buffer of its own, and when the last handle to that payload drops (an L1 eviction, a
//! get's answer sent, an engine done with a fetched block) the allocation comes back here
//! for the next payload of the same size instead of going back to the allocator.
//!
//! Why: a fresh allocation of megabytes is fresh pages, which the kernel zeroes and maps one
//! fault at a time on first touch; that cost more than the copy itself (issue 24). A reused
//! buffer's pages are mapped already. In a full L1 every put evicts about what it stores,
//! so puts run on reused buffers.
//!
//! Bounded: the idle buffers held add up to at most `max_idle_bytes`, and buffers are
//! matched by exact capacity, so a block never holds more memory than its length. A buffer
//! that comes back to a full pool displaces idle buffers of the sizes least recently used
//! (freed), and is itself freed only when those do not make room: when the block size
//! changes (another model, or the benchmark's 1 MiB then 16 MiB rounds), the pool follows
//! it instead of staying full of the old size while every new buffer is fresh pages.
//! Payloads below [`POOLED_MIN`] bytes are plain allocations.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

/// Payloads shorter than this are not pooled (the allocator serves them from its own free
/// lists, without page faults).
pub const POOLED_MIN: usize = 64 << 10;

/// A pool of payload buffers.
#[derive(Debug, Clone)]
pub struct BufPool {
    inner: Arc<Mutex<Idle>>,
}

#[derive(Debug, Default)]
struct Idle {
    /// Idle buffers (length 0) by capacity, with when that size was last taken or given
    /// back (a tick of `clock`).
    by_size: HashMap<usize, (Vec<Vec<u8>>, u64)>,
    bytes: u64,
    max_bytes: u64,
    reused: u64,
    clock: u64,
}

impl Idle {
    /// Frees idle buffers of sizes other than `keep`, least recently used first, until
    /// `need` more bytes fit; whether they do.
    fn make_room(&mut self, need: u64, keep: usize) -> bool {
        if need > self.max_bytes {
            return false;
        }
        while self.bytes + need > self.max_bytes {
            let oldest = self
                .by_size
                .iter()
                .filter(|(&size, (bufs, _))| size != keep && !bufs.is_empty())
                .min_by_key(|(_, (_, used))| *used)
                .map(|(&size, _)| size);
            let Some(size) = oldest else { return false };
            let (bufs, _) = self.by_size.get_mut(&size).expect("a size just found");
            bufs.pop();
            self.bytes -= size as u64;
            if bufs.is_empty() {
                self.by_size.remove(&size);
            }
        }
        true
    }
}

/// What the pool did, for tests and the agent's stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub idle_bytes: u64,
    /// Buffers handed out again instead of allocated.
    pub reused: u64,
}

impl BufPool {
    pub fn new(max_idle_bytes: u64) -> Self {
        BufPool {
            inner: Arc::new(Mutex::new(Idle {
                max_bytes: max_idle_bytes,
                ..Idle::default()
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An empty buffer with capacity for exactly `len` bytes: an idle one when there is.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= POOLED_MIN {
            let mut idle = self.lock();
            idle.clock += 1;
            let now = idle.clock;
            if let Some((bufs, used)) = idle.by_size.get_mut(&len) {
                *used = now;
                if let Some(buf) = bufs.pop() {
                    idle.bytes -= len as u64;
                    idle.reused += 1;
                    return buf;
                }
            }
        }
        Vec::with_capacity(len)
    }

    /// `buf` as shared bytes whose allocation returns to this pool when the last handle to
    /// it drops.
    pub fn freeze(&self, buf: Vec<u8>) -> Bytes {
        if buf.capacity() < POOLED_MIN || buf.capacity() != buf.len() {
            return Bytes::from(buf);
        }
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::downgrade(&self.inner),
        })
    }

    pub fn stats(&self) -> PoolStats {
        let idle = self.lock();
        PoolStats {
            idle_bytes: idle.bytes,
            reused: idle.reused,
        }
    }
}

/// A pooled buffer behind a `Bytes`.
struct Pooled {
    buf: Vec<u8>,
    pool: Weak<Mutex<Idle>>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        let mut idle = pool.lock().unwrap_or_else(|p| p.into_inner());
        let size = self.buf.capacity();
        if idle.make_room(size as u64, size) {
            let mut buf = std::mem::take(&mut self.buf);
            buf.clear();
            idle.bytes += size as u64;
            idle.clock += 1;
            let now = idle.clock;
            let (bufs, used) = idle.by_size.entry(size).or_default();
            bufs.push(buf);
            *used = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_within_the_bound() {
        let pool = BufPool::new(3 * POOLED_MIN as u64);
        let fill = |len: usize| {
            let mut b = pool.take(len);
            b.resize(len, 7);
            pool.freeze(b)
        };
        let a = fill(POOLED_MIN);
        let b = fill(POOLED_MIN);
        let small = fill(100);
        let slice = a.slice(10..20);
        drop(a);
        // A slice still holds the buffer.
        assert_eq!(pool.stats().idle_bytes, 0);
        drop(slice);
        drop(b);
        drop(small);
        assert_eq!(pool.stats().idle_bytes, 2 * POOLED_MIN as u64);
        let again = fill(POOLED_MIN);
        assert_eq!(again.len(), POOLED_MIN);
        assert!(again.iter().all(|&x| x == 7));
        assert_eq!(pool.stats().reused, 1);
        // Another size is a fresh allocation; past the bound, buffers are freed.
        let big: Vec<Bytes> = (0..3).map(|_| fill(2 * POOLED_MIN)).collect();
        drop(big);
        drop(again);
        assert!(pool.stats().idle_bytes <= 3 * POOLED_MIN as u64);
    }

    /// When the block size changes, the pool follows: buffers of the new size displace idle
    /// ones of the old, so the new size is served from the pool, not from fresh pages.
    #[test]
    fn a_new_block_size_displaces_the_old_one() {
        let (small, large) = (POOLED_MIN, 4 * POOLED_MIN);
        let pool = BufPool::new(8 * POOLED_MIN as u64);
        let fill = |len: usize| {
            let mut b = pool.take(len);
            b.resize(len, 1);
            pool.freeze(b)
        };
        // The pool full of the old size.
        drop((0..8).map(|_| fill(small)).collect::<Vec<_>>());
        assert_eq!(pool.stats().idle_bytes, 8 * small as u64);
        // Two large buffers come back: they push out the small ones they need room for.
        drop((0..2).map(|_| fill(large)).collect::<Vec<_>>());
        assert_eq!(pool.stats().idle_bytes, 2 * large as u64);
        let reused = pool.stats().reused;
        drop((0..2).map(|_| fill(large)).collect::<Vec<_>>());
        assert_eq!(pool.stats().reused, reused + 2);
        // A buffer larger than the bound is never kept, and evicts nothing.
        drop(fill(16 * POOLED_MIN));
        assert_eq!(pool.stats().idle_bytes, 2 * large as u64);
    }
}
