//! Socket I/O shared by the block API's server and the Redis backend, which otherwise
//! know nothing of each other.

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Writes all of `parts`, in order, with vectored writes of up to 64 slices each (the
/// block API's frames, the Redis backend's `SET`s).
pub async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    parts: &[&[u8]],
) -> std::io::Result<()> {
    const SLICES: usize = 64;
    let parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    let (mut first, mut offset) = (0, 0);
    while first < parts.len() {
        let slices: Vec<std::io::IoSlice<'_>> = parts[first..]
            .iter()
            .take(SLICES)
            .enumerate()
            .map(|(i, p)| std::io::IoSlice::new(if i == 0 { &p[offset..] } else { p }))
            .collect();
        let mut n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let left = parts[first].len() - offset;
            if n >= left {
                n -= left;
                first += 1;
                offset = 0;
            } else {
                offset += n;
                n = 0;
            }
        }
    }
    Ok(())
}
