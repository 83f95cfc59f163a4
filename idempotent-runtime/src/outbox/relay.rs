//! The relay: claims committed messages under a lease, publishes them, records the outcome.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument as _;

#[cfg(feature = "postgres")]
use super::PostgresOutbox;
use super::storage::{Claimed, Failed, Outbox};
use super::{PublishError, Publisher};

/// Messages a relay claims at once by default (each published concurrently).
const DEFAULT_BATCH: usize = 64;
/// How long a claim holds its messages by default: 30 s.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// How often an idle relay looks for messages by default when no notification woke it: 100 ms.
const DEFAULT_POLL: Duration = Duration::from_millis(100);
/// Tries before a message is dead-lettered by default.
const DEFAULT_MAX_ATTEMPTS: u32 = 12;
/// The first retry's delay by default (doubling each try): 1 s.
const DEFAULT_BACKOFF: Duration = Duration::from_secs(1);
/// The longest delay between tries by default: 10 min.
const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(600);

/// The longest `Retry-After` honoured: a day.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);
/// How often a running relay refreshes the outbox's gauges.
const STATS_EVERY: Duration = Duration::from_secs(10);

/// Delivers an outbox's committed messages through a [`Publisher`], at least once each
/// ([the contract](crate::design) §6; what it promises is in the [module's
/// documentation](super)).
///
/// Run as many relays as you like, in one process or several: they claim disjoint messages.
/// Each claims a batch (the head of every ordering key, and messages without one) under a
/// lease, publishes them concurrently, gives up a publish still running when the lease nears its
/// end, and records each outcome under its claim's token. An idle relay sleeps until its poll
/// interval passes, or a commit notifies it (`LISTEN`) when a [`PostgresOutbox`] notifies.
///
/// `O` is the outbox it delivers from, inferred from [`new`](Self::new)'s argument:
/// [`PostgresOutbox`] (the default, so `Relay<P>` names a PostgreSQL relay) or
/// [`MySqlOutbox`](super::MySqlOutbox) (`Relay<P, MySqlOutbox>`), which relays by polling.
///
#[cfg_attr(feature = "postgres", doc = "```no_run")]
#[cfg_attr(not(feature = "postgres"), doc = "```ignore")]
/// use idempotent_runtime::outbox::{Delivery, PostgresOutbox, PublishError, Publisher, Relay};
///
/// struct Print;
/// impl Publisher for Print {
///     async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
///         println!("{} → {}", d.id(), d.destination());
///         Ok(())
///     }
/// }
///
/// # async fn example(pool: sqlx::PgPool) {
/// let outbox = PostgresOutbox::new(pool);
/// let relay = Relay::new(outbox, Print);
/// tokio::spawn(relay.run_until(async { tokio::signal::ctrl_c().await.unwrap_or(()) }));
/// # }
/// ```
pub struct Relay<
    P,
    #[cfg(feature = "postgres")] O = PostgresOutbox,
    #[cfg(not(feature = "postgres"))] O,
> {
    outbox: O,
    publisher: Arc<P>,
    s: Settings,
    wake: Arc<Notify>,
}

#[derive(Debug, Clone)]
struct Settings {
    batch: usize,
    lease: Duration,
    poll: Duration,
    max_attempts: u32,
    backoff: Duration,
    max_backoff: Duration,
    listen: bool,
}

impl<P, O: fmt::Debug> fmt::Debug for Relay<P, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.outbox)
            .field("settings", &self.s)
            .finish_non_exhaustive()
    }
}

/// Configures a [`Relay`]; from [`Relay::builder`].
#[must_use]
pub struct RelayBuilder<
    P,
    #[cfg(feature = "postgres")] O = PostgresOutbox,
    #[cfg(not(feature = "postgres"))] O,
> {
    outbox: O,
    publisher: P,
    s: Settings,
}

impl<P, O> fmt::Debug for RelayBuilder<P, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("settings", &self.s)
            .finish_non_exhaustive()
    }
}

impl<P: Publisher, O: Outbox> RelayBuilder<P, O> {
    /// Messages claimed at once, published concurrently (default 64, at least 1).
    pub fn batch(mut self, batch: usize) -> Self {
        self.s.batch = batch.max(1);
        self
    }

    /// How long a claim holds its messages (default 30 s, at least 1 s). A publish still
    /// running at four fifths of it is abandoned and retried, so that it cannot overlap
    /// another relay's publish of the same message after the lease; keep it well above the
    /// publisher's own timeouts.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.s.lease = lease.max(Duration::from_secs(1));
        self
    }

    /// How often an idle relay looks for due messages without being notified (default 100 ms:
    /// one indexed query a tick): the longest an idle relay takes to see a message when the
    /// outbox does not notify, and the delay of retries after their backoff.
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.s.poll = poll.max(Duration::from_millis(10));
        self
    }

    /// Tries before a message is dead-lettered (default 12, at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.s.max_attempts = attempts.max(1);
        self
    }

    /// The delay before the first retry, doubling each try up to `max` (defaults 1 s and
    /// 10 min), with a random quarter taken off so that relays spread their retries. A
    /// receiver's `Retry-After` is honoured instead (up to a day).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.s.backoff = first;
        self.s.max_backoff = max.max(first);
        self
    }

    /// Whether an idle relay `LISTEN`s for the outbox's commit notifications (default: when
    /// the outbox notifies, which only a [`PostgresOutbox`] built with
    /// [`notify(true)`](super::PostgresOutboxBuilder::notify) does). Without it, it polls.
    pub fn listen(mut self, listen: bool) -> Self {
        self.s.listen = listen;
        self
    }

    /// The relay.
    pub fn build(self) -> Relay<P, O> {
        Relay {
            outbox: self.outbox,
            publisher: Arc::new(self.publisher),
            s: self.s,
            wake: Arc::new(Notify::new()),
        }
    }
}

/// What one [`Relay::deliver_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Relayed {
    /// Messages claimed.
    pub claimed: usize,
    /// Published and recorded delivered.
    pub delivered: usize,
    /// Failed, to be tried again after a backoff.
    pub retrying: usize,
    /// Failed for the last time (or permanently): dead-lettered.
    pub dead: usize,
    /// Outcomes not recorded because the lease had passed to another relay (published or not,
    /// that relay delivers it again).
    pub lease_lost: usize,
}

/// A claim's token: random, distinct per claim.
fn token() -> i64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish() as i64
}

/// A random fraction in [0, 1).
fn jitter() -> f64 {
    (token() as u64 >> 11) as f64 / (1u64 << 53) as f64
}

impl<P: Publisher, O: Outbox> Relay<P, O> {
    /// A relay with the default settings.
    pub fn new(outbox: O, publisher: P) -> Self {
        Self::builder(outbox, publisher).build()
    }

    /// Configures a relay.
    pub fn builder(outbox: O, publisher: P) -> RelayBuilder<P, O> {
        let listen = outbox.notifies();
        RelayBuilder {
            outbox,
            publisher,
            s: Settings {
                batch: DEFAULT_BATCH,
                lease: DEFAULT_LEASE,
                poll: DEFAULT_POLL,
                max_attempts: DEFAULT_MAX_ATTEMPTS,
                backoff: DEFAULT_BACKOFF,
                max_backoff: DEFAULT_MAX_BACKOFF,
                listen,
            },
        }
    }

    /// The delay before try `attempt + 1` after try `attempt` failed.
    fn delay(&self, attempt: u32, error: &PublishError) -> Duration {
        if let Some(after) = error.retry_after_hint() {
            return after.min(MAX_RETRY_AFTER);
        }
        let doubled = self
            .s
            .backoff
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        doubled
            .min(self.s.max_backoff)
            .mul_f64(1.0 - 0.25 * jitter())
    }

    /// Claims one batch, publishes it, records each outcome. Returns what it did; an `Err` is
    /// the database failing (the claimed messages' leases then lapse and they are delivered
    /// again). [`run_until`](Self::run_until) calls it in a loop; call it yourself to relay
    /// from a job of your own.
    pub async fn deliver_batch(&self) -> Result<Relayed, sqlx::Error> {
        let started = Instant::now();
        let token = token();
        let claimed = self
            .outbox
            .claim(self.s.batch, self.s.lease, token, self.s.max_attempts)
            .await?;
        let mut report = Relayed {
            claimed: claimed.len(),
            ..Relayed::default()
        };
        let (spent, claimed): (Vec<_>, Vec<_>) = claimed.into_iter().partition(|c| c.spent);
        for c in &spent {
            let d = &c.delivery;
            let error = PublishError::permanent(format!(
                "claimed {} times without a recorded outcome: a relay stopped while publishing it each time",
                d.attempt()
            ));
            observe_failure(
                d.id(),
                d.destination(),
                d.attempt(),
                &error,
                Failed::Dead,
                Duration::ZERO,
            );
            report.dead += 1;
        }
        if claimed.is_empty() {
            return Ok(report);
        }
        // Measured from before the claim was sent, so it ends before the database's lease.
        let deadline = started + self.s.lease.mul_f64(0.8);
        let outcomes = join_all(claimed.iter().map(|c| self.publish(c, deadline))).await;

        let mut delivered = Vec::new();
        for (c, outcome) in claimed.iter().zip(outcomes) {
            let d = &c.delivery;
            let Err(error) = outcome else {
                delivered.push(d.id().to_owned());
                continue;
            };
            let delay = self.delay(d.attempt(), &error);
            let failed = self
                .outbox
                .failed(
                    d.id(),
                    token,
                    &error.to_string(),
                    delay,
                    error.is_permanent(),
                    self.s.max_attempts,
                )
                .await?;
            observe_failure(d.id(), d.destination(), d.attempt(), &error, failed, delay);
            match failed {
                Failed::Retrying => report.retrying += 1,
                Failed::Dead => report.dead += 1,
                Failed::LeaseLost => report.lease_lost += 1,
            }
        }
        if !delivered.is_empty() {
            let asked = delivered.len();
            let recorded = self.outbox.delivered(delivered, token).await?;
            report.delivered = recorded.len();
            report.lease_lost += asked - recorded.len();
            for (destination, lag) in &recorded {
                observe_delivered(destination, *lag);
            }
        }
        Ok(report)
    }

    /// Publishes one claimed message, abandoned at `deadline`.
    async fn publish(&self, c: &Claimed, deadline: Instant) -> Result<(), PublishError> {
        let d = &c.delivery;
        let span = tracing::debug_span!(
            "outbox.publish",
            message = d.id(),
            destination = d.destination(),
            attempt = d.attempt()
        );
        let started = Instant::now();
        let published = tokio::time::timeout_at(deadline, self.publisher.publish(d))
            .instrument(span)
            .await
            .unwrap_or_else(|_| {
                Err(PublishError::retry(
                    "the publish was abandoned as the claim's lease neared its end",
                ))
            });
        #[cfg(feature = "metrics")]
        metrics::histogram!(
            "idempotent_outbox_publish_seconds",
            "destination" => d.destination().to_owned(),
            "outcome" => if published.is_ok() { "ok" } else { "error" }
        )
        .record(started.elapsed().as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = started;
        published
    }

    /// Relays until `shutdown` completes: a batch, then at once another while batches come
    /// back full, else a wait for a commit's notification or the poll interval. The batch in
    /// progress when `shutdown` completes is finished first. A database failure is logged and
    /// retried after the poll interval; the relay never gives up.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let listener = self.spawn_listener();
        let mut shutdown = std::pin::pin!(shutdown);
        // The gauges are set after the first batch, then every `STATS_EVERY`: a relay that
        // just started reports the backlog it found, not nothing for ten seconds.
        let mut stats_at: Option<Instant> = None;
        loop {
            let full = match self.deliver_batch().await {
                Ok(r) => r.claimed >= self.s.batch,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay: the database failed; claimed messages are delivered again after their lease");
                    false
                }
            };
            if stats_at.is_none_or(|at| at.elapsed() >= STATS_EVERY) {
                stats_at = Some(Instant::now());
                self.refresh_gauges().await;
            }
            if full {
                // Between batches: stop here if asked, without waiting.
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = std::future::ready(()) => continue,
                }
            }
            tokio::select! {
                () = &mut shutdown => break,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(self.s.poll) => {}
            }
        }
        if let Some(listener) = listener {
            listener.abort();
        }
    }

    /// Relays until the task is aborted or the process ends (see [`run_until`](Self::run_until)).
    pub async fn run(self) {
        self.run_until(std::future::pending()).await;
    }

    /// A task that wakes the relay on each commit notification, if it listens.
    fn spawn_listener(&self) -> Option<tokio::task::JoinHandle<()>> {
        if !self.s.listen {
            return None;
        }
        let retry = self.s.poll.max(Duration::from_millis(500));
        self.outbox.spawn_listener(self.wake.clone(), retry)
    }

    /// Sets the gauges of pending and dead messages and of the oldest pending one's age.
    async fn refresh_gauges(&self) {
        match self.outbox.stats().await {
            #[cfg(feature = "metrics")]
            Ok(stats) => {
                metrics::gauge!("idempotent_outbox_pending").set(stats.pending as f64);
                metrics::gauge!("idempotent_outbox_dead").set(stats.dead as f64);
                metrics::gauge!("idempotent_outbox_oldest_pending_seconds")
                    .set(stats.oldest_pending.as_secs_f64());
            }
            #[cfg(not(feature = "metrics"))]
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "outbox relay: could not read the outbox's stats")
            }
        }
    }
}

fn observe_delivered(destination: &str, lag: Duration) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("idempotent_outbox_delivered_total", "destination" => destination.to_owned())
            .increment(1);
        metrics::histogram!("idempotent_outbox_lag_seconds", "destination" => destination.to_owned())
            .record(lag.as_secs_f64());
    }
    tracing::debug!(destination, ?lag, "outbox: delivered");
}

fn observe_failure(
    id: &str,
    destination: &str,
    attempt: u32,
    error: &PublishError,
    failed: Failed,
    delay: Duration,
) {
    match failed {
        Failed::Retrying => {
            #[cfg(feature = "metrics")]
            metrics::counter!("idempotent_outbox_retried_total", "destination" => destination.to_owned())
                .increment(1);
            tracing::warn!(message = id, destination, attempt, error = %error, retry_in = ?delay, "outbox: publish failed; will retry");
        }
        Failed::Dead => {
            #[cfg(feature = "metrics")]
            metrics::counter!("idempotent_outbox_dead_total", "destination" => destination.to_owned())
                .increment(1);
            tracing::error!(message = id, destination, attempt, error = %error, permanent = error.is_permanent(), "outbox: message dead-lettered; retry or discard it with the outbox's retry / discard");
        }
        Failed::LeaseLost => {
            tracing::info!(message = id, destination, attempt, error = %error, "outbox: publish failed after the claim's lease passed to another relay");
        }
    }
}
