//! What a relay needs of an outbox's database: claim, record outcomes, read the gauges, and
//! (PostgreSQL) listen for commits.

use std::sync::Arc;
use std::time::Duration;

/// An outbox a [`Relay`](super::Relay) delivers from: [`PostgresOutbox`](super::PostgresOutbox)
/// (feature `postgres`) or [`MySqlOutbox`](super::MySqlOutbox) (feature `mysql`). Sealed: the
/// relay's promises rest on each database's own statements, so only this crate implements it.
///
/// Name it to write code that relays from either database:
///
/// ```
/// use idempotent_runtime::outbox::{Outbox, Publisher, Relay};
///
/// /// Relays from `outbox` until the process ends, polling every 50 ms when idle.
/// fn spawn_relay<O: Outbox, P: Publisher>(outbox: O, publisher: P) -> tokio::task::JoinHandle<()> {
///     let relay: Relay<P, O> = Relay::builder(outbox, publisher)
///         .poll_interval(std::time::Duration::from_millis(50))
///         .build();
///     tokio::spawn(relay.run())
/// }
/// ```
pub trait Outbox: sealed::Storage {}

impl<T: sealed::Storage> Outbox for T {}

pub(crate) use sealed::{Claimed, Failed, Storage};

mod sealed {
    use std::fmt;

    use futures_util::future::BoxFuture;
    use tokio::sync::Notify;

    use super::{Arc, Duration};
    use crate::outbox::{Delivery, OutboxStats};

    /// The relay's operations on one database. Boxed futures: a relay round trip dwarfs the
    /// box, and the relay stays one type whatever the database.
    pub trait Storage: Clone + fmt::Debug + Send + Sync + 'static {
        /// Claims up to `batch` due messages (the head of each ordering key, and messages
        /// without one) for `lease` under `token`; those already claimed `max_attempts` times
        /// come back dead-lettered ([`Claimed::spent`]), not leased. In insertion order.
        fn claim(
            &self,
            batch: usize,
            lease: Duration,
            token: i64,
            max_attempts: u32,
        ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>>;

        /// Marks the messages `ids` of the claim `token` delivered; returns each one's
        /// destination and its lag (enqueued → delivered). A message whose lease passed to
        /// another relay is left to it.
        fn delivered(
            &self,
            ids: Vec<String>,
            token: i64,
        ) -> BoxFuture<'_, Result<Vec<(String, Duration)>, sqlx::Error>>;

        /// Records a failed delivery of `id` under `token`: tried again after `delay`, or dead
        /// if `permanent` or past `max_attempts`.
        #[allow(clippy::too_many_arguments)]
        fn failed<'a>(
            &'a self,
            id: &'a str,
            token: i64,
            error: &'a str,
            delay: Duration,
            permanent: bool,
            max_attempts: u32,
        ) -> BoxFuture<'a, Result<Failed, sqlx::Error>>;

        /// How many messages are pending and dead, and the oldest pending one's age.
        fn stats(&self) -> BoxFuture<'_, Result<OutboxStats, sqlx::Error>>;

        /// Whether commits notify idle relays (PostgreSQL's `NOTIFY`).
        fn notifies(&self) -> bool {
            false
        }

        /// A task waking `wake` on each commit's notification, if the outbox notifies;
        /// reconnecting after `retry` when its connection is lost.
        fn spawn_listener(
            &self,
            wake: Arc<Notify>,
            retry: Duration,
        ) -> Option<tokio::task::JoinHandle<()>> {
            let _ = (wake, retry);
            None
        }
    }

    /// A message a relay claimed: what it publishes.
    pub struct Claimed {
        pub(crate) delivery: Delivery,
        /// Claimed `max_attempts` times already without an outcome: dead-lettered by this
        /// claim, not to be published.
        pub(crate) spent: bool,
    }

    /// What became of a failed delivery.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Failed {
        /// Tried again after its backoff.
        Retrying,
        /// Dead-lettered.
        Dead,
        /// The claim's lease had passed to another relay: nothing was recorded.
        LeaseLost,
    }
}
