//! The processed-messages inbox for message consumers ([the contract](crate::design) §6).
//!
//! Brokers deliver at least once: a consumer that crashes before it acks, a redelivery after an
//! ack timeout, a producer that publishes twice. The inbox makes the consumer's effects happen once
//! per `(consumer, message_id)`: it records a marker for the message **in the same transaction as
//! the handler's changes**, so the marker and the effects commit together or not at all.
//!
//! [`Processed`] says what to do with the delivery:
//!
//! | Result | Meaning | Broker action |
//! |---|---|---|
//! | [`Processed::Done`] | the handler ran and its changes committed | ack |
//! | [`Processed::Duplicate`] | a copy was processed before; the handler did not run | ack |
//! | [`Processed::Busy`] | a concurrent copy holds the marker right now | nack, let it redeliver |
//! | `Err(`[`InboxError::Handler`]`)` | the handler failed; nothing was kept, no marker | nack |
//! | `Err(`[`InboxError::Store`]`)` | the database failed; the outcome was rolled back | nack |
//!
//! The inboxes share these results:
//!
//! - `PostgresInbox` (feature `postgres`), `MySqlInbox` (feature `mysql`, InnoDB) and
//!   `SqliteInbox` (feature `sqlite`): the marker is a row in a `processed_messages` table and
//!   the handler writes through the same transaction. Any number of consumer processes may share
//!   one.
//! - [`MemoryInbox`]: one process, for tests and for consumers whose effects are not in a database.
//!   Its markers live as long as the process.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::{Clock, Millis, SystemClock};
use crate::observe::KeyDisplay;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use mysql::{MySqlInbox, MySqlInboxBuilder};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::{PostgresInbox, PostgresInboxBuilder};
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sqlite::{SqliteInbox, SqliteInboxBuilder};

/// The inbox table's default name, on every database.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) const DEFAULT_TABLE: &str = "processed_messages";

/// How long the marker's insert waits for a concurrent copy's uncommitted marker by default
/// before the message is [`Busy`](Processed::Busy): 5 s. (SQLite waits on its connection's
/// `busy_timeout` instead.)
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// A boxed, `Send` future borrowing for `'a`: what a [`PostgresInbox`](crate::inbox) handler
/// returns (write `Box::pin(async move { … })`). Re-exported so callers need no `futures`
/// dependency.
pub use futures_util::future::BoxFuture;

/// How long markers are kept by default before the sweeper deletes them: 7 days.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Markers a sweep deletes per statement.
pub(crate) const DEFAULT_SWEEP_BATCH: usize = 500;

/// What became of a delivered message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "ack on Done and Duplicate, nack on Busy"]
pub enum Processed<T> {
    /// The handler ran and its effects (with the marker) are committed. Ack the message.
    Done(T),
    /// A copy of this message was processed before; the handler did not run. Ack the message.
    Duplicate,
    /// A concurrent copy of this message is being processed right now and holds its marker; the
    /// handler did not run. Nack (or do not ack) and let the broker redeliver: if that copy
    /// fails, the redelivery runs; if it succeeds, the redelivery is a [`Duplicate`](Self::Duplicate).
    Busy,
}

impl<T> Processed<T> {
    /// Whether the broker should be told the message is handled: `true` for
    /// [`Done`](Self::Done) and [`Duplicate`](Self::Duplicate), `false` for [`Busy`](Self::Busy).
    pub fn should_ack(&self) -> bool {
        !matches!(self, Self::Busy)
    }

    /// The handler's value, if it ran in this call.
    pub fn done(self) -> Option<T> {
        match self {
            Self::Done(v) => Some(v),
            _ => None,
        }
    }
}

/// Why processing a message failed. Whatever the variant, nothing was committed and no marker
/// stays, so a redelivery runs the handler again: nack the message. Non-exhaustive: a match
/// needs a `_` arm, so that a later version may tell more failures apart.
#[derive(Debug)]
#[non_exhaustive]
pub enum InboxError<E> {
    /// The handler returned this error; its changes were rolled back.
    Handler(E),
    /// The inbox's own storage failed (for `PostgresInbox`, a `sqlx::Error` inside: connecting,
    /// inserting the marker, or committing). Downcast with
    /// `err.downcast_ref::<sqlx::Error>()`.
    Store(Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl<E> InboxError<E> {
    /// The handler's error, if that is what failed.
    pub fn handler(self) -> Option<E> {
        match self {
            Self::Handler(e) => Some(e),
            Self::Store(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for InboxError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handler(e) => write!(f, "message handler failed: {e}"),
            Self::Store(e) => write!(f, "inbox storage failed: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for InboxError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Handler(e) => Some(e),
            Self::Store(e) => Some(&**e),
        }
    }
}

/// An inbox outcome, for logs and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Done,
    Duplicate,
    Busy,
    Failed,
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    StoreError,
}

impl Outcome {
    #[cfg(feature = "metrics")]
    fn counter(self) -> &'static str {
        match self {
            Self::Done => "idempotent_inbox_done_total",
            Self::Duplicate => "idempotent_inbox_duplicate_total",
            Self::Busy => "idempotent_inbox_busy_total",
            Self::Failed => "idempotent_inbox_failed_total",
            Self::StoreError => "idempotent_inbox_store_error_total",
        }
    }
}

/// Logs and counts one outcome. Counters (feature `metrics`): `idempotent_inbox_{done,duplicate,
/// busy,failed,store_error}_total`, labelled with the consumer. The message id is logged as its
/// hash only, like an idempotency key.
pub(crate) fn observe(outcome: Outcome, consumer: &str, message_id: &str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(outcome.counter(), "consumer" => consumer.to_owned()).increment(1);
    let message = KeyDisplay(message_id);
    match outcome {
        Outcome::Done => tracing::debug!(consumer, %message, "inbox: message processed"),
        Outcome::Duplicate => {
            tracing::debug!(consumer, %message, "inbox: duplicate message, handler skipped; ack it")
        }
        Outcome::Busy => tracing::info!(
            consumer,
            %message,
            "inbox: a concurrent copy of the message holds its marker; nack it and let the broker redeliver"
        ),
        Outcome::Failed => tracing::info!(
            consumer,
            %message,
            "inbox: handler failed, its changes were rolled back; a redelivery runs it again"
        ),
        // Logged where the error is known (with it).
        Outcome::StoreError => {}
    }
}

/// Counts swept markers (`idempotent_inbox_swept_total`, feature `metrics`).
/// A database step failed: logged with its error and counted; nothing was committed.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn store_failed<T, E>(
    consumer: &str,
    message_id: &str,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Result<Processed<T>, InboxError<E>> {
    let e = e.into();
    tracing::warn!(
        consumer,
        message = %KeyDisplay(message_id),
        error = %e,
        "inbox: database failed, nothing was committed; nack the message so it is redelivered"
    );
    observe(Outcome::StoreError, consumer, message_id);
    Err(InboxError::Store(e))
}

/// What became of the message, counted.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn answered<T, E>(
    consumer: &str,
    message_id: &str,
    p: Processed<T>,
) -> Result<Processed<T>, InboxError<E>> {
    let o = match p {
        Processed::Done(_) => Outcome::Done,
        Processed::Duplicate => Outcome::Duplicate,
        Processed::Busy => Outcome::Busy,
    };
    observe(o, consumer, message_id);
    Ok(p)
}

/// Ends a transaction whose message was not processed; a failed rollback leaves the connection
/// to its pool, which discards a broken one.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) async fn roll_back<DB: sqlx::Database>(
    consumer: &str,
    tx: sqlx::Transaction<'static, DB>,
) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(consumer, error = %e, "inbox: rollback failed");
    }
}

/// A SQL inbox's or outbox's sweeper (`what` names it in logs): every [`sweep_cadence`] of
/// `retention`, `sweep` batches of [`DEFAULT_SWEEP_BATCH`] until one comes back short.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn spawn_sweep_loop<S, Fut>(
    what: String,
    retention: Duration,
    sweep: S,
) -> tokio::task::JoinHandle<()>
where
    S: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<usize, sqlx::Error>> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(sweep_cadence(retention));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            loop {
                match sweep().await {
                    Ok(n) if n >= DEFAULT_SWEEP_BATCH => continue,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(
                            sweeping = %what,
                            error = %e,
                            "sweep failed; will retry at the next tick"
                        );
                        break;
                    }
                }
            }
        }
    })
}

pub(crate) fn observe_swept(consumer: &str, deleted: usize) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotent_inbox_swept_total", "consumer" => consumer.to_owned())
        .increment(deleted as u64);
    if deleted > 0 {
        tracing::debug!(consumer, deleted, "inbox: swept old markers");
    }
}

/// How often a background sweeper runs: the retention, capped at one hour (as for the HTTP
/// stores' sweeper, [the contract](crate::design) §3).
pub(crate) fn sweep_cadence(retention: Duration) -> Duration {
    retention
        .min(Duration::from_secs(3600))
        .max(Duration::from_millis(10))
}

#[derive(Debug, Clone, Copy)]
enum Marker {
    /// A copy is being processed.
    Running,
    /// Processed at this time.
    Processed(Millis),
}

/// A one-process inbox, with the same results as the PostgreSQL one: while a copy runs, a
/// concurrent copy gets [`Processed::Busy`]; after it succeeded, copies get
/// [`Processed::Duplicate`]; after it failed (error, panic or cancellation), the next copy runs.
///
/// Markers are kept until [`sweep`](Self::sweep) deletes those older than the retention, and are
/// lost with the process: use it where effects are not durable either, or in tests.
///
/// ```
/// use idempotent_runtime::inbox::{MemoryInbox, Processed};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let inbox = MemoryInbox::new("reserve-stock");
/// let first = inbox.process("msg-1", || async { Ok::<_, std::io::Error>(42) }).await;
/// assert!(matches!(first, Ok(Processed::Done(42))));
/// let again = inbox.process("msg-1", || async { Ok::<_, std::io::Error>(43) }).await;
/// assert!(matches!(again, Ok(Processed::Duplicate)));
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryInbox {
    consumer: Arc<str>,
    markers: Arc<Mutex<HashMap<String, Marker>>>,
    clock: Arc<dyn Clock>,
    retention: Duration,
}

impl fmt::Debug for MemoryInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryInbox")
            .field("consumer", &self.consumer)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// Removes a `Running` marker unless the handler succeeded: on error, panic or cancellation the
/// next copy must run.
struct RunningGuard<'a> {
    inbox: &'a MemoryInbox,
    message_id: &'a str,
    armed: bool,
}

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inbox.lock().remove(self.message_id);
        }
    }
}

impl MemoryInbox {
    /// An inbox for `consumer` with the system clock and the default retention (7 days).
    pub fn new(consumer: impl Into<Arc<str>>) -> Self {
        Self {
            consumer: consumer.into(),
            markers: Arc::default(),
            clock: Arc::new(SystemClock),
            retention: DEFAULT_RETENTION,
        }
    }

    /// How long a processed marker is kept before [`sweep`](Self::sweep) may delete it.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The clock the retention is judged by (a [`ManualClock`](crate::clock::ManualClock) in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The consumer this inbox deduplicates for.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Marker>> {
        // A panic while the lock is held cannot leave the map half-updated: every critical
        // section is a single insert or remove.
        self.markers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `handler` once for `message_id`, unless a copy was processed before
    /// ([`Processed::Duplicate`]) or is being processed right now ([`Processed::Busy`]).
    /// A handler error is returned as [`InboxError::Handler`] and leaves no marker.
    pub async fn process<T, E, F, Fut>(
        &self,
        message_id: &str,
        handler: F,
    ) -> Result<Processed<T>, InboxError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        {
            let mut markers = self.lock();
            match markers.get(message_id) {
                Some(Marker::Running) => {
                    drop(markers);
                    observe(Outcome::Busy, &self.consumer, message_id);
                    return Ok(Processed::Busy);
                }
                Some(Marker::Processed(_)) => {
                    drop(markers);
                    observe(Outcome::Duplicate, &self.consumer, message_id);
                    return Ok(Processed::Duplicate);
                }
                None => {
                    markers.insert(message_id.to_owned(), Marker::Running);
                }
            }
        }
        let mut guard = RunningGuard {
            inbox: self,
            message_id,
            armed: true,
        };
        let result = handler().await;
        match result {
            Ok(value) => {
                guard.armed = false;
                let now = self.clock.now_millis();
                self.lock()
                    .insert(message_id.to_owned(), Marker::Processed(now));
                observe(Outcome::Done, &self.consumer, message_id);
                Ok(Processed::Done(value))
            }
            Err(e) => {
                drop(guard);
                observe(Outcome::Failed, &self.consumer, message_id);
                Err(InboxError::Handler(e))
            }
        }
    }

    /// Deletes up to `batch` processed markers older than the retention; returns how many.
    /// Markers of copies still running are never deleted.
    pub fn sweep(&self, batch: usize) -> usize {
        let retention = self.retention.as_millis() as Millis;
        let cutoff = self.clock.now_millis().saturating_sub(retention);
        let mut markers = self.lock();
        let old: Vec<String> = markers
            .iter()
            .filter(|(_, m)| matches!(m, Marker::Processed(at) if *at < cutoff))
            .map(|(id, _)| id.clone())
            .take(batch)
            .collect();
        for id in &old {
            markers.remove(id);
        }
        drop(markers);
        observe_swept(&self.consumer, old.len());
        old.len()
    }

    /// Markers currently held (running and processed).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no marker is held.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Sweeps on a cadence of `min(retention, 1 h)`, again at once while batches come back full.
    /// Runs until the handle is aborted. Must be called inside a Tokio runtime.
    pub fn spawn_sweeper(&self) -> tokio::task::JoinHandle<()> {
        let inbox = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(sweep_cadence(inbox.retention));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                while inbox.sweep(DEFAULT_SWEEP_BATCH) >= DEFAULT_SWEEP_BATCH {}
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Debug, PartialEq)]
    struct Boom;

    #[tokio::test]
    async fn a_processed_message_is_a_duplicate_and_the_handler_does_not_run_again() {
        let inbox = MemoryInbox::new("c");
        let runs = AtomicUsize::new(0);
        let run = || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Boom>("reserved")
        };
        assert_eq!(
            inbox.process("m1", run).await.unwrap(),
            Processed::Done("reserved")
        );
        assert_eq!(
            inbox.process("m1", run).await.unwrap(),
            Processed::Duplicate
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(
            inbox.process("m2", run).await.unwrap(),
            Processed::Done("reserved")
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_failed_handler_leaves_no_marker_so_the_redelivery_runs() {
        let inbox = MemoryInbox::new("c");
        let err = inbox
            .process("m1", || async { Err::<(), _>(Boom) })
            .await
            .unwrap_err();
        assert_eq!(err.handler(), Some(Boom));
        assert!(inbox.is_empty());
        assert_eq!(
            inbox
                .process("m1", || async { Ok::<_, Boom>(1) })
                .await
                .unwrap(),
            Processed::Done(1)
        );
    }

    #[tokio::test]
    async fn a_concurrent_copy_is_busy_while_the_first_runs() {
        let inbox = MemoryInbox::new("c");
        let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let first = {
            let inbox = inbox.clone();
            tokio::spawn(async move {
                inbox
                    .process("m1", || async move {
                        entered_tx.send(()).unwrap();
                        release_rx.await.unwrap();
                        Ok::<_, Boom>(1)
                    })
                    .await
            })
        };
        entered_rx.await.unwrap();
        let ran = AtomicUsize::new(0);
        let second = inbox
            .process("m1", || async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Boom>(2)
            })
            .await
            .unwrap();
        assert_eq!(second, Processed::Busy);
        assert!(!second.should_ack());
        release_tx.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap(), Processed::Done(1));
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        assert_eq!(
            inbox
                .process("m1", || async { Ok::<_, Boom>(3) })
                .await
                .unwrap(),
            Processed::Duplicate
        );
    }

    #[tokio::test]
    async fn a_cancelled_or_panicking_handler_leaves_no_marker() {
        let inbox = MemoryInbox::new("c");
        let fut = inbox.process("m1", std::future::pending::<Result<(), Boom>>);
        assert!(
            tokio::time::timeout(Duration::from_millis(5), fut)
                .await
                .is_err()
        );
        assert!(inbox.is_empty(), "a cancelled copy kept its marker");

        let panicking = {
            let inbox = inbox.clone();
            tokio::spawn(async move {
                inbox
                    .process("m1", || async { panic!("handler panicked") })
                    .await
                    .map(|_: Processed<()>| ())
                    .map_err(|_: InboxError<Boom>| ())
            })
        };
        assert!(panicking.await.is_err());
        assert!(inbox.is_empty(), "a panicking copy kept its marker");
    }

    #[tokio::test]
    async fn sweep_deletes_only_markers_older_than_retention() {
        let clock = ManualClock::new();
        let inbox = MemoryInbox::new("c")
            .retention(Duration::from_secs(60))
            .clock(clock.clone());
        for id in ["old-1", "old-2", "old-3"] {
            let _ = inbox
                .process(id, || async { Ok::<_, Boom>(()) })
                .await
                .unwrap();
        }
        clock.advance(Duration::from_secs(61));
        let _ = inbox
            .process("new", || async { Ok::<_, Boom>(()) })
            .await
            .unwrap();
        assert_eq!(inbox.sweep(2), 2);
        assert_eq!(inbox.sweep(2), 1);
        assert_eq!(inbox.sweep(2), 0);
        assert_eq!(inbox.len(), 1);
        assert_eq!(
            inbox
                .process("new", || async { Ok::<_, Boom>(()) })
                .await
                .unwrap(),
            Processed::Duplicate
        );
        assert_eq!(
            inbox
                .process("old-1", || async { Ok::<_, Boom>(()) })
                .await
                .unwrap(),
            Processed::Done(())
        );
    }
}
