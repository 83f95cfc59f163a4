//! The RabbitMQ (AMQP 0-9-1) publisher (feature `rabbitmq`).

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};
use tokio::sync::Mutex;

use super::{Delivery, PublishError, Publisher};

/// AMQP's persistent delivery mode: the broker writes the message to disk in a durable queue.
const PERSISTENT: u8 = 2;

/// Publishes each delivery to a RabbitMQ exchange with publisher confirms: the destination is
/// the routing key, the delivery's id is the `message_id` property, its headers the message's
/// headers, and a publish succeeds once the broker acknowledges it.
///
/// Messages are persistent (`delivery_mode` 2) and published `mandatory`, so that a message no
/// queue is bound to receive comes back instead of vanishing. The broker does not deduplicate
/// by `message_id`: the consumer does, with an [inbox](crate::inbox) keyed by it, as the relay
/// delivers at least once.
///
/// # Failures
///
/// - **Returned as unroutable** (no queue bound for the routing key): retried, like a missing
///   NATS stream. The broker dropped the message, and what mends it is a deployment step (the
///   consumer declaring and binding its queue, often after the producer started); a message
///   that keeps failing is dead-lettered after the relay's `max_attempts` with this error, for
///   an operator to retry once the binding exists. An exchange with an `alternate-exchange`
///   routes such messages there instead, and they count as delivered.
/// - A negative acknowledgement (the broker could not take it), a closed channel or
///   connection: retried.
/// - A routing key longer than AMQP's 255 bytes: permanent.
///
/// A publish to an exchange that does not exist makes the broker close the channel, and every
/// later publish on it fails (retried). Connect with
/// `ConnectionProperties::default().enable_auto_recover()` so that lapin reopens a closed
/// connection's channels, with their confirms.
///
/// # Concurrency
///
/// AMQP's `basic.return` does not say which publish it answers, and lapin hands it to the
/// next confirmation it completes; so that a returned message is never taken for another's, a
/// channel carries one publish at a time, from the publish to the broker's acknowledgement
/// (a round trip each). Give the publisher several channels
/// ([`with_channels`](Self::with_channels)) for a relay that publishes batches concurrently.
///
/// A relay from PostgreSQL; over a `MySqlOutbox` the publisher is the same.
///
#[cfg_attr(feature = "postgres", doc = "```no_run")]
#[cfg_attr(not(feature = "postgres"), doc = "```ignore")]
/// use idempotent_runtime::outbox::{AmqpPublisher, PostgresOutbox, Relay};
/// use lapin::{Connection, ConnectionProperties};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let properties = ConnectionProperties::default().enable_auto_recover();
/// let connection = Connection::connect("amqp://127.0.0.1:5672/%2f", properties).await?;
/// let publisher = AmqpPublisher::new(connection.create_channel().await?, "orders").await?;
/// let relay = Relay::new(PostgresOutbox::new(pool), publisher);
/// relay.run_until(async { tokio::signal::ctrl_c().await.unwrap_or(()) }).await;
/// # Ok(())
/// # }
/// ```
pub struct AmqpPublisher {
    channels: Box<[Mutex<Channel>]>,
    next: AtomicUsize,
    exchange: ShortString,
}

impl AmqpPublisher {
    /// A publisher to `exchange` (`""` for the default exchange, where the routing key is a
    /// queue's name) on `channel`, with publisher confirms enabled on it.
    ///
    /// # Panics
    ///
    /// When `exchange` is longer than 255 bytes, which no AMQP exchange name is.
    pub async fn new(channel: Channel, exchange: impl Into<String>) -> Result<Self, lapin::Error> {
        Self::with_channels([channel], exchange).await
    }

    /// A publisher to `exchange` publishing on each of `channels` in turn (one publish at a
    /// time on each), with publisher confirms enabled on them.
    ///
    /// # Panics
    ///
    /// When `channels` is empty, or `exchange` is longer than 255 bytes.
    pub async fn with_channels(
        channels: impl IntoIterator<Item = Channel>,
        exchange: impl Into<String>,
    ) -> Result<Self, lapin::Error> {
        let exchange = ShortString::try_new(exchange)
            .unwrap_or_else(|e| panic!("AmqpPublisher: the exchange name is too long: {e}"));
        let mut confirmed = Vec::new();
        for channel in channels {
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            confirmed.push(Mutex::new(channel));
        }
        assert!(!confirmed.is_empty(), "AmqpPublisher: no channel given");
        Ok(Self {
            channels: confirmed.into_boxed_slice(),
            next: AtomicUsize::new(0),
            exchange,
        })
    }
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("exchange", &self.exchange.as_str())
            .field("channels", &self.channels.len())
            .finish_non_exhaustive()
    }
}

impl Publisher for AmqpPublisher {
    async fn publish(&self, delivery: &Delivery) -> Result<(), PublishError> {
        let failed = |what: &str| {
            format!(
                "RabbitMQ publish of outbox message {} to exchange {:?} with routing key {:?}: {what}",
                delivery.id(),
                self.exchange.as_str(),
                delivery.destination()
            )
        };
        let routing_key = ShortString::try_new(delivery.destination()).map_err(|e| {
            PublishError::permanent(failed(&format!("not a routing key ({e}); not retried")))
        })?;
        let properties = properties(delivery)
            .map_err(|e| PublishError::permanent(failed(&format!("{e}; not retried"))))?;
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        let channel = self.channels[i].lock().await;
        // Settles what a publish abandoned mid-flight left on the channel (its confirmation,
        // its return), so that the broker's next acknowledgement and return are this message's:
        // a `multiple` acknowledgement covering both would otherwise hand lapin's one returned
        // message to either.
        channel
            .wait_for_confirms()
            .await
            .map_err(|e| PublishError::retry(failed(&e.to_string())))?;
        let confirmation = channel
            .basic_publish(
                self.exchange.clone(),
                routing_key,
                options,
                delivery.payload(),
                properties,
            )
            .await
            .map_err(|e| PublishError::retry(failed(&e.to_string())))?
            .await
            .map_err(|e| PublishError::retry(failed(&e.to_string())))?;
        drop(channel);
        match confirmation {
            Confirmation::Ack(returned) => match returned {
                // A return carrying another id belongs to a publish abandoned mid-flight
                // (the relay retries that one); the wait above makes it unlikely.
                Some(returned) if is_for(&returned.properties, delivery.id()) => {
                    Err(PublishError::retry(failed(&format!(
                        "returned unroutable ({} {}): bind a queue to the exchange for this \
                         routing key; retried until then",
                        returned.reply_code, returned.reply_text
                    ))))
                }
                _ => Ok(()),
            },
            Confirmation::Nack(_) => Err(PublishError::retry(failed(
                "the broker refused it (nack); retried",
            ))),
            Confirmation::NotRequested => Err(PublishError::retry(failed(
                "publisher confirms are off on the channel, so delivery is unknown",
            ))),
        }
    }
}

fn is_for(properties: &BasicProperties, id: &str) -> bool {
    properties.message_id().as_ref().map(ShortString::as_str) == Some(id)
}

/// Persistent, `message_id` = the delivery's id, the headers as an AMQP table (a repeated
/// name as an array of its values), and a `content-type` header also as the property.
fn properties(delivery: &Delivery) -> Result<BasicProperties, String> {
    let short =
        |s: &str| ShortString::try_new(s).map_err(|e| format!("{s:?} cannot travel in AMQP ({e})"));
    let mut table = FieldTable::default();
    let mut content_type = None;
    for (name, raw) in delivery.headers() {
        let key = short(name)?;
        let value = AMQPValue::LongString(LongString::from(raw.as_bytes()));
        let entry = match table.inner().get(&key) {
            None => value,
            Some(AMQPValue::FieldArray(values)) => {
                let mut values = values.clone();
                values.push(value);
                AMQPValue::FieldArray(values)
            }
            Some(first) => AMQPValue::FieldArray(FieldArray::from(vec![first.clone(), value])),
        };
        table.insert(key, entry);
        if name.eq_ignore_ascii_case("content-type") && content_type.is_none() {
            content_type = Some(short(raw)?);
        }
    }
    let mut properties = BasicProperties::default()
        .with_message_id(short(delivery.id())?)
        .with_delivery_mode(PERSISTENT)
        .with_headers(table);
    if let Some(content_type) = content_type {
        properties = properties.with_content_type(content_type);
    }
    Ok(properties)
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
    fn the_id_is_the_message_id_and_headers_are_a_table() {
        let d = delivery(
            Message::new("order-1-placed", "orders.placed", "{}")
                .header("content-type", "application/json")
                .header("x-tag", "a")
                .header("x-tag", "b"),
        );
        let p = properties(&d).unwrap();
        assert!(is_for(&p, "order-1-placed"));
        assert!(!is_for(&p, "order-2-placed"));
        assert_eq!(*p.delivery_mode(), Some(PERSISTENT));
        assert_eq!(
            p.content_type().as_ref().map(ShortString::as_str),
            Some("application/json")
        );
        let headers = p.headers().as_ref().unwrap().inner();
        assert_eq!(
            headers.get("content-type"),
            Some(&AMQPValue::LongString("application/json".into()))
        );
        assert_eq!(
            headers.get("x-tag"),
            Some(&AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongString("a".into()),
                AMQPValue::LongString("b".into()),
            ])))
        );
    }
}
