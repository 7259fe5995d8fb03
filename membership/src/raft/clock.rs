//! The wall clock that bounds forwarded writes ([`unix_ms`]): the system clock, or under
//! the deterministic simulation ([`super::enter_simulation`]) one that follows tokio's
//! simulated clock. The node and the `/raft/` handlers both read it here.

use tokio::time::Instant;

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before it); under
/// [`super::enter_simulation`], the simulated clock. Forwarded writes' deadlines are on it.
pub fn unix_ms() -> u64 {
    if let Some((wall_ms, at)) = SIM_WALL.with(std::cell::Cell::get) {
        return wall_ms + at.elapsed().as_millis() as u64;
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

thread_local! {
    /// Set by [`follow_tokio`]: the wall clock at that moment and tokio's clock then.
    static SIM_WALL: std::cell::Cell<Option<(u64, Instant)>> = const { std::cell::Cell::new(None) };
}

/// Makes [`unix_ms`] on the calling thread follow tokio's clock from now on, starting
/// from the wall clock's present reading.
pub(crate) fn follow_tokio() {
    SIM_WALL.with(|w| w.set(Some((unix_ms(), Instant::now()))));
}
