//! The NATS JetStream publisher (feature `nats`).

use std::fmt;
use std::str::FromStr as _;

use async_nats::jetstream::context::{PublishError as NatsError, PublishErrorKind};
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{HeaderMap, HeaderName, HeaderValue, SubjectError};

use super::{Delivery, PublishError, Publisher};

/// The header JetStream deduplicates by.
const MSG_ID: &str = "Nats-Msg-Id";

/// Publishes each delivery to NATS JetStream: the destination is the subject, the delivery's
/// id travels as `Nats-Msg-Id` beside its headers, and a publish succeeds once the stream's
/// acknowledgement arrives.
///
/// # Deduplication and its window
///
/// JetStream drops a message whose `Nats-Msg-Id` it has stored within the stream's
/// **duplicate window** (`duplicate_window`, two minutes by default) and acknowledges it as a
/// duplicate, which this publisher reports as delivered. A publish of the same id after the
/// window puts a **second message** in the stream: a retry after a long backoff of a publish
/// whose acknowledgement was lost (a timeout, a dropped connection), or an operator's retry of
/// a dead-lettered message that had in fact reached the stream.
/// So the consumer still deduplicates by the id, with an [inbox](crate::inbox) keyed by
/// `Nats-Msg-Id`: the window makes duplicates rare, the inbox makes their effects once. Keep the
/// window well above the relay's lease ([`RelayBuilder::lease`](super::RelayBuilder::lease),
/// 30 s by default) so that the ordinary redelivery after a relay's death falls inside it.
///
/// # Failures
///
/// - **No stream captures the subject** (the server has no responder for it): retried. It is
///   usually a deployment step not taken yet (the stream is created by a migration or an
///   operator, perhaps after the service started) and the same answer comes from a clustered
///   stream while it has no leader; retries mend both, and a message that keeps failing is
///   dead-lettered after the relay's `max_attempts` with this error, for an operator to
///   [`retry`](super::PostgresOutbox::retry) once the stream exists. Called permanent, it would
///   dead-letter every message of such a deploy at once.
/// - Timeouts waiting for the acknowledgement, a dropped connection, the client's own limit of
///   acknowledgements in flight, other errors of the server: retried.
/// - A message larger than the server's `max_payload` or the stream's `max_msg_size`, a
///   destination that is not a valid subject, a header NATS cannot carry: permanent (the same
///   message fails the same way every time).
///
/// The publish waits for the acknowledgement up to the JetStream context's timeout
/// (`jetstream::ContextBuilder::timeout`, 5 s by default); keep it well under the relay's lease.
///
/// A relay from PostgreSQL; over a `MySqlOutbox` the publisher is the same.
///
#[cfg_attr(feature = "postgres", doc = "```no_run")]
#[cfg_attr(not(feature = "postgres"), doc = "```ignore")]
/// use idempotent_runtime::outbox::{NatsPublisher, PostgresOutbox, Relay};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let client = async_nats::connect("127.0.0.1:4222").await?;
/// let publisher = NatsPublisher::new(async_nats::jetstream::new(client));
/// let relay = Relay::new(PostgresOutbox::new(pool), publisher);
/// relay.run_until(async { tokio::signal::ctrl_c().await.unwrap_or(()) }).await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct NatsPublisher {
    context: jetstream::Context,
}

impl NatsPublisher {
    /// A publisher on `context` (`async_nats::jetstream::new(client)`).
    pub fn new(context: jetstream::Context) -> Self {
        Self { context }
    }
}

impl fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsPublisher").finish_non_exhaustive()
    }
}

impl Publisher for NatsPublisher {
    async fn publish(&self, delivery: &Delivery) -> Result<(), PublishError> {
        let headers = headers(delivery)?;
        let subject = delivery.destination().to_owned();
        // An acknowledgement marked `duplicate` is the stream saying it holds this id already:
        // delivered all the same.
        self.context
            .publish_with_headers(subject, headers, delivery.payload().clone())
            .await
            .map_err(|e| classify(delivery, e))?
            .await
            .map_err(|e| classify(delivery, e))?;
        Ok(())
    }
}

/// The delivery's headers, then `Nats-Msg-Id` (replacing one the message carried).
fn headers(delivery: &Delivery) -> Result<HeaderMap, PublishError> {
    let mut map = HeaderMap::new();
    for (name, value) in delivery.headers() {
        if name.eq_ignore_ascii_case(MSG_ID) {
            continue;
        }
        let (Ok(name), Ok(value)) = (HeaderName::from_str(name), HeaderValue::from_str(value))
        else {
            return Err(PublishError::permanent(format!(
                "outbox message {}: header {name:?} cannot travel as a NATS header",
                delivery.id()
            )));
        };
        map.append(name, value);
    }
    let id = HeaderValue::from_str(delivery.id()).map_err(|_| {
        PublishError::permanent(format!(
            "outbox message {}: the id cannot travel as {MSG_ID}",
            delivery.id()
        ))
    })?;
    map.insert(MSG_ID, id);
    Ok(map)
}

/// Whether a failed publish is worth another try (see [`NatsPublisher`]'s documentation).
fn classify(delivery: &Delivery, e: NatsError) -> PublishError {
    let permanent = match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => true,
        PublishErrorKind::Other => {
            let source = std::error::Error::source(&e);
            source.is_some_and(|s| s.downcast_ref::<SubjectError>().is_some())
                || source
                    .and_then(|s| s.downcast_ref::<jetstream::Error>())
                    .is_some_and(|s| s.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
        }
        _ => false,
    };
    let what = format!(
        "NATS JetStream publish of outbox message {} to subject {}: {e}",
        delivery.id(),
        delivery.destination()
    );
    if permanent {
        PublishError::permanent(format!(
            "{what} (not retried: the message itself is refused)"
        ))
    } else if e.kind() == PublishErrorKind::StreamNotFound {
        PublishError::retry(format!(
            "{what} (create a stream whose subjects match it; retried until then)"
        ))
    } else {
        PublishError::retry(what)
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use crate::outbox::Message;

    fn delivery(m: Message) -> Delivery {
        Delivery::new(m, 1, SystemTime::UNIX_EPOCH)
    }

    #[test]
    fn the_id_travels_as_nats_msg_id_beside_the_headers() {
        let d = delivery(
            Message::new("order-1-placed", "orders.placed", "{}")
                .header("content-type", "application/json")
                .header("x-tag", "a")
                .header("x-tag", "b")
                .header("nats-msg-id", "forged"),
        );
        let map = headers(&d).unwrap();
        assert_eq!(map.get(MSG_ID).map(|v| v.as_str()), Some("order-1-placed"));
        assert_eq!(map.get_all(MSG_ID).count(), 1);
        assert_eq!(
            map.get("content-type").map(|v| v.as_str()),
            Some("application/json")
        );
        let tags: Vec<&str> = map.get_all("x-tag").map(|v| v.as_str()).collect();
        assert_eq!(tags, ["a", "b"]);
    }

    #[test]
    fn a_header_nats_cannot_carry_is_permanent() {
        let d = delivery(Message::new("m", "s", "").header("bad:name", "v"));
        assert!(headers(&d).unwrap_err().is_permanent());
    }

    #[test]
    fn errors_say_whether_to_retry() {
        let d = delivery(Message::new("m-1", "orders.placed", ""));
        let retried = [
            NatsError::new(PublishErrorKind::StreamNotFound),
            NatsError::new(PublishErrorKind::TimedOut),
            NatsError::new(PublishErrorKind::BrokenPipe),
            NatsError::new(PublishErrorKind::MaxAckPending),
            NatsError::new(PublishErrorKind::Other),
        ];
        for e in retried {
            let kind = e.kind();
            let p = classify(&d, e);
            assert!(!p.is_permanent(), "{kind:?} was permanent");
            assert!(p.to_string().contains("m-1"), "{p}");
        }
        let refused = [
            NatsError::new(PublishErrorKind::MaxPayloadExceeded),
            NatsError::with_source(PublishErrorKind::Other, SubjectError::InvalidFormat),
        ];
        for e in refused {
            let kind = e.kind();
            assert!(classify(&d, e).is_permanent(), "{kind:?} was retried");
        }
        let missing = classify(&d, NatsError::new(PublishErrorKind::StreamNotFound));
        assert!(missing.to_string().contains("create a stream"), "{missing}");
    }
}
