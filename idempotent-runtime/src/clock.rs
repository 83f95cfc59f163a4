//! Time, injectable so that leases and retention are tested without sleeping ([the contract](crate::design) §3).
//!
//! The in-memory store reads this clock; the SQL stores use the database's clock so that replicas
//! never disagree about a lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the UNIX epoch.
pub type Millis = u64;

/// A source of wall-clock time.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the UNIX epoch.
    fn now_millis(&self) -> Millis;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_millis(&self) -> Millis {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as Millis)
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
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// Starts at the current system time.
    pub fn new() -> Self {
        Self(Arc::new(AtomicU64::new(SystemClock.now_millis())))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

pub(crate) fn millis(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
