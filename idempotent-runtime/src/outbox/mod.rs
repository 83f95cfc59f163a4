//! The transactional outbox: side effects outside the database, sent once per committed change
//! ([the contract](crate::design) §6).
//!
//! A handler that must publish `OrderPlaced`, call a webhook or send an email after its write has
//! no safe moment to do it: published before the commit, a rollback leaves a message about
//! nothing; published after it, a crash in between loses the message. The outbox writes the
//! message **in the caller's transaction** instead ([`PostgresOutbox::enqueue`],
//! [`MySqlOutbox::enqueue`]), so it commits or
//! rolls back with the business rows, and a [`Relay`] delivers what committed, at least once,
//! each message carrying its stable id so that the receiver deduplicates it: NATS JetStream's
//! `Nats-Msg-Id`, RabbitMQ's `message_id`, a webhook's `Idempotency-Key` and `webhook-id`, or
//! the [inbox](crate::inbox) of a consumer of this crate, keyed by [`Delivery::id`].
//!
//! ```text
//!  POST /orders ─► handler tx: INSERT order; outbox.enqueue(OrderPlaced) ─► COMMIT (with the record)
//!                                                                               │
//!  relay: claim committed rows (lease) ─► Publisher::publish ─► mark delivered ◄┘
//!                                              │
//!  consumer: inbox.process(delivery id) ─► one effect per message id
//! ```
//!
//! What the relay promises:
//!
//! - **At least once, never twice at once.** A message is claimed under a lease (a database
//!   row update conditional on the lease having ended), published, then marked delivered under
//!   the claim's token. A relay that dies between publishing and marking leaves the message to
//!   be published again after the lease: receivers deduplicate by id. Two relays never hold one
//!   message at once; a relay gives up its publish before its lease ends, so a late publish
//!   cannot overlap the next relay's.
//! - **Per ordering key, one in flight, in commit order.** A message with an ordering key is
//!   claimed only when no earlier pending message of that key remains and none of its key is in
//!   flight. "Earlier" is the order the rows were inserted, which per key is the order their
//!   transactions commit: `enqueue` takes a transaction-scoped lock on the key before it writes
//!   the row, so **a second transaction enqueuing the same key waits in its `enqueue` until the
//!   first commits or rolls back** (two transactions enqueuing several keys in different orders
//!   can deadlock; the database aborts one: enqueue keys in a fixed order). A message failing
//!   under backoff holds its key's later messages back; a dead-lettered one no longer does, and
//!   an operator's `retry` puts it at the back of its key. Messages without a key go out in
//!   parallel, and take no lock.
//! - **Retries, then the dead letter.** A failed publish is retried with exponential backoff
//!   (or after the receiver's `Retry-After`), and after `max_attempts` the message is
//!   dead-lettered with its last error; the outbox's `retry` and `discard` let an operator
//!   decide. A publisher may call a failure permanent ([`PublishError::permanent`]): dead at
//!   once.
//! - **Swept after a retention.** Delivered rows stay for the retention (default 7 days), so
//!   the outbox's `inspect` answers "was it sent?" and re-enqueuing the same id within it is a
//!   no-op ([`Enqueued::AlreadyEnqueued`]); the sweeper deletes them after.
//!
//! Publishers, each behind its feature: `NatsPublisher` (NATS JetStream, `Nats-Msg-Id`; feature
//! `nats`), `AmqpPublisher` (RabbitMQ with publisher confirms, `message_id`; feature
//! `rabbitmq`), `WebhookPublisher` (HTTP POST signed as Standard Webhooks, `Idempotency-Key` and
//! `webhook-id`, `Retry-After` honoured; feature `outbox-webhooks`), or any type implementing
//! [`Publisher`].
//!
//! Two databases, the same operations and promises: [`PostgresOutbox`] (feature `postgres`) and
//! [`MySqlOutbox`] (feature `mysql`: MySQL 8.0 or MariaDB 10.6 and later, for `FOR UPDATE SKIP
//! LOCKED`). A [`Relay`] runs over either ([`Outbox`]; `Relay<P>` is a PostgreSQL relay,
//! `Relay<P, MySqlOutbox>` a MySQL one, and `Relay::new` infers which). What differs is how:
//!
//! | | PostgreSQL | MySQL / MariaDB |
//! |---|---|---|
//! | an ordering key's lock | a transaction-scoped advisory lock on a hash of (table, key) | the exclusive row lock of the key's row in `<table>_keys`, upserted in the caller's transaction (`GET_LOCK` is session-scoped: it would outlive the transaction on a pooled connection) |
//! | a claim | one `UPDATE … FROM … RETURNING` over candidates locked `FOR UPDATE SKIP LOCKED` | a `READ COMMITTED` transaction: candidates locked `FOR UPDATE SKIP LOCKED`, the head-of-key condition read again, the lease written |
//! | an idle relay | polls, or wakes on a commit's `NOTIFY` ([`PostgresOutboxBuilder::notify`]) | polls ([`RelayBuilder::poll_interval`]) |
//! | an operator's retry | a new `seq` under the key's lock | the row written again (a new `AUTO_INCREMENT` `seq`) under the key's lock |

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::context::IdempotencyContext;

#[cfg(feature = "rabbitmq")]
mod amqp;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod relay;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod storage;
#[cfg(feature = "outbox-webhooks")]
mod webhook;

#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub use amqp::AmqpPublisher;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use mysql::{MySqlOutbox, MySqlOutboxBuilder};
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use nats::NatsPublisher;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::{PostgresOutbox, PostgresOutboxBuilder};
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
pub use relay::{Relay, RelayBuilder, Relayed};
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
pub use storage::Outbox;
#[cfg(feature = "outbox-webhooks")]
#[cfg_attr(docsrs, doc(cfg(feature = "outbox-webhooks")))]
pub use webhook::{WebhookPublisher, WebhookPublisherBuilder};

/// The outbox table's default name.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const DEFAULT_TABLE: &str = "outbox_messages";

/// How long delivered messages are kept by default before the sweeper deletes them: 7 days.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The longest message id, ordering key or header name accepted, in bytes.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const MAX_ID_LEN: usize = 255;

/// A message to send once its transaction commits: a stable id, a destination, an optional
/// ordering key, headers and a payload.
///
/// The id is what receivers deduplicate by, so it must be the same every time the same change
/// is enqueued: derive it from the request ([`for_request`](Self::for_request)) or from the
/// application's own identity of the change (`order-42-placed`), never from a clock or a
/// random number. Ids are visible ASCII (they travel as header values), 1 to 255 bytes.
///
/// ```
/// use idempotent_runtime::outbox::Message;
///
/// let m = Message::new("order-42-placed", "orders.placed", r#"{"order":42}"#)
///     .ordered_by("order-42")
///     .header("content-type", "application/json");
/// assert_eq!(m.id(), "order-42-placed");
/// assert_eq!(m.ordering_key(), Some("order-42"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    id: String,
    destination: String,
    ordering_key: Option<String>,
    headers: Vec<(String, String)>,
    payload: Bytes,
}

impl Message {
    /// A message with the application's own stable `id`, for `destination` (a NATS subject, a
    /// RabbitMQ routing key, a URL: whatever the relay's [`Publisher`] reads it as).
    pub fn new(
        id: impl Into<String>,
        destination: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Self {
        Self {
            id: id.into(),
            destination: destination.into(),
            ordering_key: None,
            headers: Vec::new(),
            payload: payload.into(),
        }
    }

    /// A message whose id is derived from the idempotent request being handled and a
    /// `purpose` ([`IdempotencyContext::derived_key`]): the same on every retry of the request,
    /// distinct across tenants and purposes, and never the client's raw key.
    ///
    /// ```
    /// use idempotent_runtime::IdempotencyContext;
    /// use idempotent_runtime::key::IdempotencyKey;
    /// use idempotent_runtime::outbox::Message;
    ///
    /// let ctx = IdempotencyContext::new(IdempotencyKey::new("k1").unwrap(), [7; 32]);
    /// let m = Message::for_request(&ctx, "order-placed", "orders.placed", "{}");
    /// assert_eq!(m.id(), ctx.derived_key("order-placed"));
    /// ```
    pub fn for_request(
        context: &IdempotencyContext,
        purpose: &str,
        destination: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Self {
        Self::new(context.derived_key(purpose), destination, payload)
    }

    /// Orders this message under `key`: messages with the same ordering key are delivered one
    /// at a time, in commit order. Enqueuing it takes a lock on the key until the transaction
    /// ends, so concurrent transactions enqueuing the same key wait for each other
    /// ([`PostgresOutbox::enqueue`], [`MySqlOutbox::enqueue`]).
    pub fn ordered_by(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Adds a header (a NATS or AMQP header, an HTTP request header of a webhook). Names are
    /// HTTP tokens; values visible ASCII and spaces.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The stable id receivers deduplicate by.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where the relay's publisher sends it.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The ordering key, if any.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// The headers, in the order they were added.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// The payload.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// Checks what the outbox stores and the publishers send: the id, the ordering key and
    /// the header values are visible ASCII within 255 bytes, header names HTTP tokens.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn validate(&self) -> Result<(), InvalidMessage> {
        let visible = |s: &str| s.bytes().all(|b| (0x21..=0x7e).contains(&b));
        if self.id.is_empty() || self.id.len() > MAX_ID_LEN || !visible(&self.id) {
            return Err(InvalidMessage::new(
                "id",
                "must be 1 to 255 bytes of visible ASCII",
            ));
        }
        if self.destination.is_empty() || self.destination.bytes().any(|b| b.is_ascii_control()) {
            return Err(InvalidMessage::new(
                "destination",
                "must be non-empty, without control characters",
            ));
        }
        if let Some(key) = &self.ordering_key
            && (key.is_empty()
                || key.len() > MAX_ID_LEN
                || key.bytes().any(|b| b.is_ascii_control()))
        {
            return Err(InvalidMessage::new(
                "ordering key",
                "must be 1 to 255 bytes, without control characters",
            ));
        }
        for (name, value) in &self.headers {
            let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
            if name.is_empty() || name.len() > MAX_ID_LEN || !name.bytes().all(token) {
                return Err(InvalidMessage::new("header name", "must be an HTTP token"));
            }
            if value.len() > 8192
                || !value
                    .bytes()
                    .all(|b| b == b' ' || (0x21..=0x7e).contains(&b))
            {
                return Err(InvalidMessage::new(
                    "header value",
                    "must be visible ASCII and spaces, up to 8 KiB",
                ));
            }
        }
        Ok(())
    }
}

/// A message the outbox refuses before writing anything.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidMessage {
    what: &'static str,
    reason: &'static str,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl InvalidMessage {
    fn new(what: &'static str, reason: &'static str) -> Self {
        Self { what, reason }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl fmt::Display for InvalidMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "outbox message refused: its {} {}",
            self.what, self.reason
        )
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl StdError for InvalidMessage {}

/// Why an outbox's `enqueue` wrote nothing. Non-exhaustive.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
#[derive(Debug)]
#[non_exhaustive]
pub enum OutboxError {
    /// The message itself was refused.
    Invalid(InvalidMessage),
    /// The database failed; the caller's transaction is to be rolled back (PostgreSQL has
    /// aborted it; MySQL may have rolled back the statement only, or the whole transaction on a
    /// deadlock).
    Database(sqlx::Error),
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl From<sqlx::Error> for OutboxError {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl From<InvalidMessage> for OutboxError {
    fn from(e: InvalidMessage) -> Self {
        Self::Invalid(e)
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl fmt::Display for OutboxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(e) => e.fmt(f),
            Self::Database(e) => write!(f, "outbox: database failed: {e}"),
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl StdError for OutboxError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::Invalid(e) => Some(e),
            Self::Database(e) => Some(e),
        }
    }
}

/// Whether an outbox's `enqueue` wrote the message.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Written in the caller's transaction: sent once it commits.
    New,
    /// A message with this id is in the outbox already (pending, delivered within the
    /// retention, or dead-lettered): nothing was written, nothing more will be sent.
    AlreadyEnqueued,
}

/// A committed message the relay hands to its [`Publisher`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    message: Message,
    attempt: u32,
    enqueued_at: SystemTime,
}

impl Delivery {
    /// The delivery of `message` as its `attempt`th try (1 for the first), enqueued at
    /// `enqueued_at`: what a [`Publisher`]'s own tests build.
    pub fn new(message: Message, attempt: u32, enqueued_at: SystemTime) -> Self {
        Self {
            message,
            attempt,
            enqueued_at,
        }
    }

    /// The message's stable id: send it where the receiver deduplicates by it.
    pub fn id(&self) -> &str {
        &self.message.id
    }

    /// Where to send it.
    pub fn destination(&self) -> &str {
        &self.message.destination
    }

    /// Its ordering key, if any.
    pub fn ordering_key(&self) -> Option<&str> {
        self.message.ordering_key.as_deref()
    }

    /// The headers it was enqueued with.
    pub fn headers(&self) -> &[(String, String)] {
        &self.message.headers
    }

    /// The payload.
    pub fn payload(&self) -> &Bytes {
        &self.message.payload
    }

    /// Which try this is: 1 for the first. A relay that died mid-publish counts as a try.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// When the message was enqueued (the database's clock).
    pub fn enqueued_at(&self) -> SystemTime {
        self.enqueued_at
    }
}

/// Sends a committed message to where it goes: a broker, an HTTP endpoint, anything.
///
/// Return `Ok` only once the receiver has taken the message for good (a broker's publish
/// acknowledgement, a 2xx). Send [`Delivery::id`] where the receiver deduplicates by it: the
/// relay delivers at least once, so the same id may arrive again after a relay dies between
/// the publish and its record.
///
/// ```
/// use idempotent_runtime::outbox::{Delivery, PublishError, Publisher};
///
/// /// Prints each message (a stand-in for a real transport).
/// struct Print;
///
/// impl Publisher for Print {
///     async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
///         println!("{} → {}: {} bytes", d.id(), d.destination(), d.payload().len());
///         Ok(())
///     }
/// }
/// ```
pub trait Publisher: Send + Sync + 'static {
    /// Publishes one delivery. The relay abandons (drops) the future when the delivery's lease
    /// nears its end, so a publish never overlaps another relay's of the same message.
    fn publish(&self, delivery: &Delivery)
    -> impl Future<Output = Result<(), PublishError>> + Send;
}

impl<P: Publisher> Publisher for std::sync::Arc<P> {
    fn publish(
        &self,
        delivery: &Delivery,
    ) -> impl Future<Output = Result<(), PublishError>> + Send {
        (**self).publish(delivery)
    }
}

/// Why a publish failed, and whether to try again.
#[derive(Debug)]
pub struct PublishError {
    permanent: bool,
    retry_after: Option<Duration>,
    source: Box<dyn StdError + Send + Sync>,
}

impl PublishError {
    /// A failure worth retrying (a timeout, a refused connection, a 5xx): tried again after
    /// the relay's backoff.
    pub fn retry(source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            permanent: false,
            retry_after: None,
            source: source.into(),
        }
    }

    /// A failure the receiver asked to be retried no sooner than `after` (`Retry-After` on a
    /// 409, 429 or 503).
    pub fn retry_after(
        after: Duration,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self {
            permanent: false,
            retry_after: Some(after),
            source: source.into(),
        }
    }

    /// A failure no retry can mend (a 4xx refusal, a destination that does not exist): the
    /// message is dead-lettered at once.
    pub fn permanent(source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            permanent: true,
            retry_after: None,
            source: source.into(),
        }
    }

    /// Whether the message is dead-lettered without another try.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The receiver's own delay before the next try, if it named one.
    pub fn retry_after_hint(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.source.fmt(f)
    }
}

impl StdError for PublishError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// Where a message is in its life.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum State {
    /// Committed, not yet delivered (waiting, leased to a relay, or backing off after a failure).
    Pending,
    /// Delivered; kept until the retention ends.
    Delivered,
    /// Failed `max_attempts` times or permanently; waits for an operator's retry or discard.
    Dead,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl State {
    fn parse(s: &str) -> Self {
        match s {
            "delivered" => Self::Delivered,
            "dead" => Self::Dead,
            _ => Self::Pending,
        }
    }
}

/// What an outbox's `inspect` and `dead_letters` tell about a message (its payload only when
/// asked).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// The message's id.
    pub id: String,
    /// Its destination.
    pub destination: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// Where it is.
    pub state: State,
    /// Tries so far (claims, including those of relays that died).
    pub attempts: u32,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// When it was enqueued (database clock).
    pub enqueued_at: SystemTime,
    /// When it was delivered.
    pub delivered_at: Option<SystemTime>,
    /// Not tried again before this time (backoff).
    pub available_at: SystemTime,
    /// Whether a relay holds it right now.
    pub leased: bool,
    /// The payload's size in bytes.
    pub payload_len: usize,
}

/// What is waiting in an outbox, for gauges and health checks.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Messages committed and not yet delivered.
    pub pending: u64,
    /// Dead-lettered messages waiting for an operator.
    pub dead: u64,
    /// How long the oldest pending message has waited (zero when none): the relay's lag.
    pub oldest_pending: Duration,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn from_millis(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

#[cfg(all(test, any(feature = "postgres", feature = "mysql")))]
mod tests {
    use super::*;

    #[test]
    fn messages_that_cannot_travel_as_headers_are_refused() {
        let ok = Message::new("order-1", "orders.placed", "{}").header("content-type", "a/b");
        assert_eq!(ok.validate(), Ok(()));
        for bad in [
            Message::new("", "d", ""),
            Message::new("has space", "d", ""),
            Message::new("x".repeat(256), "d", ""),
            Message::new("é", "d", ""),
            Message::new("id", "", ""),
            Message::new("id", "line\nbreak", ""),
            Message::new("id", "d", "").ordered_by(""),
            Message::new("id", "d", "").header("bad name", "v"),
            Message::new("id", "d", "").header("n", "line\r\nInjected: yes"),
        ] {
            assert!(bad.validate().is_err(), "{bad:?} was accepted");
        }
        assert!(Message::new("x".repeat(255), "d", "").validate().is_ok());
    }

    #[test]
    fn publish_errors_say_whether_to_retry() {
        let e = PublishError::retry("timeout");
        assert!(!e.is_permanent() && e.retry_after_hint().is_none());
        let e = PublishError::retry_after(Duration::from_secs(3), "429");
        assert_eq!(e.retry_after_hint(), Some(Duration::from_secs(3)));
        assert!(PublishError::permanent("404").is_permanent());
        assert_eq!(PublishError::permanent("gone").to_string(), "gone");
    }
}
