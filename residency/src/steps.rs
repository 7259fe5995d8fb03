//! How a router applies residency beside its requests: both need the routing core's lock,
//! and a request must not wait for a whole snapshot or burst of changes.
//!
//! The residency task takes the lock once for a batch and, after each step of
//! [`APPLY_STEP`] changes, hands it to a thread that waits for it, if any
//! (`parking_lot::MutexGuard::bump`: an atomic read when nobody waits), taking it back when
//! that thread lets go. A request so waits for one step, not for several slices of a lock
//! that lets the task take it straight back before the request it woke runs (BENCHMARKS.md,
//! "Routes paced as a router's arrive"). A saturated router's requests would then keep the
//! lock from the task for good (each lets go and takes it again at once; parking_lot forces
//! a fair hand-over only about every 0.5 ms): after a hand-over that kept it waiting `w`,
//! the task holds the lock at least `w / SHARE`, and at most [`MAX_HOLD`], before it offers
//! it again, which keeps it about 1 / (1 + [`SHARE`]) of a contended lock while a request
//! never waits for more than one such hold (a thread descheduled with the lock would
//! otherwise make `w`, and the next hold, as long as it liked).

use parking_lot::MutexGuard;
use std::time::{Duration, Instant};

/// Changes applied between two chances for a waiting request to take the lock: about
/// 16 µs at 8,000 instances (a change costs 0.5–1.3 µs, BENCHMARKS.md "Fleet scale").
pub const APPLY_STEP: usize = 16;

/// After a hand-over that kept it waiting `w`, the task holds the lock at least
/// `w / SHARE` (at most [`MAX_HOLD`]) before offering it again.
pub const SHARE: u32 = 4;

/// The longest the task holds on to the lock after a hand-over, however long that kept it
/// waiting: about what 256 changes took under the router's earlier lock.
pub const MAX_HOLD: Duration = Duration::from_micros(250);

/// Applies `items` to what `guard` holds with `apply`, [`APPLY_STEP`] at a time, handing
/// the lock to a waiting thread between steps as the module says. Returns the sum of what
/// `apply` returned.
pub fn apply_in_steps<T, C>(
    guard: &mut MutexGuard<'_, T>,
    items: &[C],
    mut apply: impl FnMut(&mut T, &[C]) -> usize,
) -> usize {
    let mut applied = 0;
    let mut held_since = Instant::now();
    let mut hold_at_least = Duration::ZERO;
    let mut steps = items.chunks(APPLY_STEP).peekable();
    while let Some(step) = steps.next() {
        applied += apply(guard, step);
        if steps.peek().is_none() {
            break;
        }
        let now = Instant::now();
        if now.duration_since(held_since) >= hold_at_least {
            MutexGuard::bump(guard);
            let back = Instant::now();
            hold_at_least = (back.duration_since(now) / SHARE).min(MAX_HOLD);
            held_since = back;
        }
    }
    applied
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    #[test]
    fn every_item_is_applied_once_in_order_in_steps() {
        let m = Mutex::new(Vec::new());
        let items: Vec<u32> = (0..100).collect();
        let mut steps = Vec::new();
        let applied = apply_in_steps(&mut m.lock(), &items, |v, step| {
            steps.push(step.len());
            v.extend_from_slice(step);
            step.len()
        });
        assert_eq!(applied, 100);
        assert_eq!(*m.lock(), items);
        assert_eq!(steps, [16, 16, 16, 16, 16, 16, 4]);
        assert_eq!(apply_in_steps(&mut m.lock(), &[] as &[u32], |_, _| 1), 0);
    }

    /// A thread that waits for the lock while a long batch is applied gets it before the
    /// batch ends, and the batch still ends while that thread keeps taking the lock back.
    #[test]
    fn a_waiter_gets_the_lock_before_the_batch_ends_and_the_batch_still_ends() {
        let m = Mutex::new(0usize);
        let started = AtomicBool::new(false);
        let stop = AtomicBool::new(false);
        let seen_mid_batch = AtomicUsize::new(0);
        let items = vec![(); 1 << 20];
        std::thread::scope(|s| {
            s.spawn(|| {
                while !started.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
                // Back to back, as a saturated router's requests: each lets go and
                // takes the lock again at once.
                while !stop.load(Ordering::Acquire) {
                    let n = *m.lock();
                    if n > 0 && n < items.len() {
                        seen_mid_batch.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            let mut guard = m.lock();
            started.store(true, Ordering::Release);
            let applied = apply_in_steps(&mut guard, &items, |n, step| {
                // Slow until the other thread has had the lock mid-batch (it is then
                // parked on the lock at a step's end), at full speed after.
                if seen_mid_batch.load(Ordering::Relaxed) == 0 {
                    std::thread::sleep(Duration::from_micros(1));
                }
                *n += step.len();
                step.len()
            });
            drop(guard);
            stop.store(true, Ordering::Release);
            assert_eq!(applied, items.len());
        });
        assert_eq!(*m.lock(), items.len());
        assert!(seen_mid_batch.load(Ordering::Relaxed) > 0);
    }
}
