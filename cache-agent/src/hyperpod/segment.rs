//! The POSIX shared-memory segment that clients map (`/dev/shm/NAME`, what Python's
//! `multiprocessing.shared_memory.SharedMemory(NAME)` opens): created or taken over at
//! start, written with `pwrite` and read with `pread`.
//!
//! Why no mapping on this side: mapping memory needs `unsafe` (memmap2's and rustix's
//! `mmap` are unsafe calls, for good reason: another process may change the bytes), and the
//! workspace forbids it. `pwrite` into tmpfs is one kernel copy, what a `memcpy` into a
//! mapping costs, plus a system call per chunk of a body (tens of KiB): the benchmark in
//! `node/benches/agent.rs` measures it against memcpy.
//!
//! The segment's first [`HEADER_BYTES`] are a header: magic, format version, the
//! **generation**, the size, the data area's offset and the allocation unit. Each start
//! writes a generation higher than any before, and lease ids carry it, so an id from an
//! earlier run is refused as such.
//!
//! Restart: the agent opens the segment of that name if it exists and is a warmpath
//! segment (or all zero at its start: a crash before the header was written), and keeps
//! the same inode. It does not unlink and recreate it, because LMCache maps the segment
//! once, when its connector starts: a recreated segment would be a new inode that such a
//! client never sees, and it would read the new run's offsets in the old run's memory, i.e.
//! stale bytes. With the inode kept, the new run starts with no objects, so every lease
//! misses until objects are put again, and every offset it hands out points at bytes it
//! wrote. For the same reason the segment is not unlinked at shutdown; an operator removes
//! `/dev/shm/NAME` to give its memory back.
//!
//! One agent per segment: an exclusive `flock` on it is held for the agent's life (the
//! kernel drops it when the process dies), so a second agent on the same name fails at
//! start instead of writing over the first one's objects.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use rustix::fs::{FallocateFlags, FlockOperation, Mode};
use rustix::shm;

/// Bytes reserved at the segment's start for the header (one page, so that the data area
/// starts page-aligned).
pub const HEADER_BYTES: u64 = 4096;
/// The allocation unit: objects start on a page and take whole pages.
pub const UNIT_BYTES: u64 = 4096;
/// What the header starts with.
const MAGIC: &[u8; 8] = b"WPHPSEG\0";
/// The header's format.
const VERSION: u32 = 1;
/// The longest segment name (Linux's NAME_MAX, less the slash).
pub const MAX_NAME_BYTES: usize = 254;

/// Why the segment could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error(
        "shared-memory name {0:?} is not 1 to 254 of A-Z a-z 0-9 . _ - (no slash; \
         LMCache's default is shared_memory)"
    )]
    Name(String),
    #[error("shared-memory segment of {0} bytes is too small: it needs a page of header and one of data")]
    TooSmall(u64),
    #[error(
        "/dev/shm/{0} exists and is not a warmpath segment (another program's?); remove it \
         or choose another name"
    )]
    Foreign(String),
    #[error("/dev/shm/{0} is in use by another running agent")]
    Locked(String),
    #[error(
        "cannot reserve {bytes} bytes for /dev/shm/{name}: {source} (is /dev/shm large \
         enough? in a container it is often 64 MiB unless raised)"
    )]
    Reserve {
        name: String,
        bytes: u64,
        source: io::Error,
    },
    #[error("/dev/shm/{name}: {source}")]
    Io { name: String, source: io::Error },
}

/// The segment, open for writing, locked by this agent.
#[derive(Debug)]
pub struct Segment {
    file: File,
    name: String,
    size: u64,
    generation: u64,
}

impl Segment {
    /// Opens (creating it if needed) the segment `name` at `size` bytes with file mode
    /// `mode`, takes it over with a new generation, and reserves its memory.
    pub fn create(name: &str, size: u64, mode: u32) -> Result<Segment, SegmentError> {
        let name_ok = !name.is_empty()
            && name.len() <= MAX_NAME_BYTES
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            && name != "."
            && name != "..";
        if !name_ok {
            return Err(SegmentError::Name(name.to_string()));
        }
        let size = size - size % UNIT_BYTES;
        if size < HEADER_BYTES + UNIT_BYTES {
            return Err(SegmentError::TooSmall(size));
        }
        let io_err = |source| SegmentError::Io {
            name: name.to_string(),
            source,
        };
        let fd = shm::open(
            format!("/{name}"),
            shm::OFlags::CREATE | shm::OFlags::RDWR,
            Mode::from_raw_mode(mode),
        )
        .map_err(|e| io_err(e.into()))?;
        match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => return Err(SegmentError::Locked(name.into())),
            Err(e) => return Err(io_err(e.into())),
        }
        let file = File::from(fd);
        let old_len = file.metadata().map_err(io_err)?.len();
        let mut previous = 0;
        if old_len > 0 {
            let mut head = [0u8; 48];
            let n = (old_len as usize).min(head.len());
            file.read_exact_at(&mut head[..n], 0).map_err(io_err)?;
            if &head[..8] == MAGIC {
                previous = u64::from_le_bytes(head[16..24].try_into().expect("8 bytes"));
            } else if head[..n].iter().any(|&b| b != 0) {
                return Err(SegmentError::Foreign(name.into()));
            }
        }
        // The mode asked for, whatever the umask and whoever created the file before.
        rustix::fs::fchmod(&file, Mode::from_raw_mode(mode)).map_err(|e| io_err(e.into()))?;
        if old_len != size {
            file.set_len(size).map_err(io_err)?;
        }
        match rustix::fs::fallocate(&file, FallocateFlags::empty(), 0, size) {
            Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) => {}
            Err(e) => {
                return Err(SegmentError::Reserve {
                    name: name.into(),
                    bytes: size,
                    source: e.into(),
                })
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let generation = now.max(previous.saturating_add(1));
        let seg = Segment {
            file,
            name: name.to_string(),
            size,
            generation,
        };
        seg.write_header().map_err(io_err)?;
        Ok(seg)
    }

    fn write_header(&self) -> io::Result<()> {
        let mut h = vec![0u8; HEADER_BYTES as usize];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[16..24].copy_from_slice(&self.generation.to_le_bytes());
        h[24..32].copy_from_slice(&self.size.to_le_bytes());
        h[32..40].copy_from_slice(&HEADER_BYTES.to_le_bytes());
        h[40..48].copy_from_slice(&UNIT_BYTES.to_le_bytes());
        self.file.write_all_at(&h, 0)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of the whole segment, header included.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Offset and bytes of the data area.
    pub fn data_area(&self) -> (u64, u64) {
        (HEADER_BYTES, self.size - HEADER_BYTES)
    }

    /// Writes `buf` at `offset`; the caller owns that range (a placement).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check(offset, buf.len())?;
        self.file.write_all_at(buf, offset)
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check(offset, buf.len())?;
        self.file.read_exact_at(buf, offset)
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<()> {
        if offset < HEADER_BYTES || offset.saturating_add(len as u64) > self.size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{len} bytes at {offset} are outside the data area"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment name no other test or run uses.
    pub(crate) fn unique_name(tag: &str) -> String {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        format!(
            "wp-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )
    }

    #[test]
    fn creates_locks_and_takes_over_with_a_new_generation() {
        let name = unique_name("seg");
        let a = Segment::create(&name, 64 << 10, 0o600).unwrap();
        assert_eq!(a.size(), 64 << 10);
        assert_eq!(a.data_area(), (4096, 60 << 10));
        a.write_at(b"hello", 4096).unwrap();
        assert!(a.write_at(b"x", 0).is_err(), "the header is not data");
        assert!(a.write_at(b"xy", (64 << 10) - 1).is_err());
        let meta = std::fs::metadata(format!("/dev/shm/{name}")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(matches!(
            Segment::create(&name, 64 << 10, 0o600),
            Err(SegmentError::Locked(_))
        ));
        let first = a.generation();
        drop(a);
        // A restart keeps the inode and raises the generation; a resize is allowed.
        let b = Segment::create(&name, 128 << 10, 0o640).unwrap();
        assert!(b.generation() > first);
        assert_eq!(
            std::fs::metadata(format!("/dev/shm/{name}")).unwrap().len(),
            128 << 10
        );
        drop(b);
        rustix::shm::unlink(format!("/{name}")).unwrap();
    }

    #[test]
    fn refuses_bad_names_small_sizes_and_foreign_segments() {
        for bad in ["", "a/b", "..", "a b", &"x".repeat(255)] {
            assert!(matches!(
                Segment::create(bad, 1 << 20, 0o600),
                Err(SegmentError::Name(_))
            ));
        }
        assert!(matches!(
            Segment::create(&unique_name("small"), 4096, 0o600),
            Err(SegmentError::TooSmall(_))
        ));
        let name = unique_name("foreign");
        std::fs::write(format!("/dev/shm/{name}"), b"someone else's").unwrap();
        let err = Segment::create(&name, 1 << 20, 0o600).unwrap_err();
        assert!(err.to_string().contains("not a warmpath segment"), "{err}");
        std::fs::remove_file(format!("/dev/shm/{name}")).unwrap();
    }
}
