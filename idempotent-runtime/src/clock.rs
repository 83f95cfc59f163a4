//! Time, injectable so that leases and retention are tested without sleeping ([the contract](crate::design) §3).
//!
//! The in-memory store reads this clock; the SQL stores use the database's clock so that replicas
//! never disagree about a lease.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the UNIX epoch.
pub(crate) type Millis = u64;

/// A source of wall-clock time, and of a monotonic one.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the UNIX epoch.
    fn now_millis(&self) -> u64;

    /// Milliseconds on a clock that never steps (unlike the wall clock, which NTP or a resumed
    /// VM may move): what a one-process store measures leases on, so that a wall-clock step
    /// never makes a live handler look abandoned. Only differences between two readings mean
    /// anything. The default is the wall clock.
    fn monotonic_millis(&self) -> u64 {
        self.now_millis()
    }
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now_millis(&self) -> Millis {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as Millis)
    }

    /// [`Instant`] since the first reading, from the wall time of that reading.
    fn monotonic_millis(&self) -> u64 {
        static ANCHOR: OnceLock<(Instant, Millis)> = OnceLock::new();
        let (start, wall) = *ANCHOR.get_or_init(|| (Instant::now(), self.now_millis()));
        wall.saturating_add(millis(start.elapsed()))
    }
}

/// A clock that moves only when told to, for tests.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let before = clock.now_millis();
/// clock.advance(Duration::from_secs(61));
/// assert_eq!(clock.now_millis() - before, 61_000);
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    monotonic: Arc<AtomicU64>,
    /// How far the wall clock was stepped from the monotonic one, in ms (two's complement).
    step: Arc<AtomicU64>,
}

impl ManualClock {
    /// Starts at the current system time.
    pub fn new() -> Self {
        Self {
            monotonic: Arc::new(AtomicU64::new(SystemClock.now_millis())),
            step: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Moves time forward: the wall clock and the monotonic clock alike.
    pub fn advance(&self, by: Duration) {
        self.monotonic.fetch_add(millis(by), Ordering::SeqCst);
    }

    /// Steps the wall clock alone, forward (`ahead`) or back, as NTP or a resumed VM does:
    /// the monotonic clock does not move.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::clock::{Clock, ManualClock};
    ///
    /// let clock = ManualClock::new();
    /// let (wall, mono) = (clock.now_millis(), clock.monotonic_millis());
    /// clock.step_wall(Duration::from_secs(3600), true);
    /// assert_eq!(clock.now_millis() - wall, 3_600_000);
    /// assert_eq!(clock.monotonic_millis(), mono);
    /// ```
    pub fn step_wall(&self, by: Duration, ahead: bool) {
        let by = millis(by);
        let delta = if ahead { by } else { by.wrapping_neg() };
        self.step.fetch_add(delta, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> Millis {
        self.monotonic_millis()
            .wrapping_add(self.step.load(Ordering::SeqCst))
    }

    fn monotonic_millis(&self) -> u64 {
        self.monotonic.load(Ordering::SeqCst)
    }
}

pub(crate) fn millis(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
