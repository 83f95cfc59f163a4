//! A NATS JetStream consumer that reserves stock in PostgreSQL through the inbox (DESIGN.md §6).
//!
//! JetStream delivers at least once. This consumer reserves stock for each order message inside
//! `PostgresInbox::process`, so the reservation and the message's marker commit together: a copy
//! delivered again is acked without reserving twice.
//!
//! The run publishes four messages and forces every kind of repeat:
//!
//! - `order-1` is published twice (a producer retry). The message id travels in the
//!   `Order-Message-Id` header, not `Nats-Msg-Id`: JetStream's own duplicate window would drop
//!   the second publish, and a duplicate that slips past that window is exactly the case the
//!   inbox exists for;
//! - `order-2` is processed, then the consumer "crashes" before acking: JetStream redelivers it
//!   after `ack_wait` and the inbox answers Duplicate;
//! - `order-3` is nak'd on its first delivery (say, a dependency was down) and runs on the
//!   redelivery.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test NATS_URL=127.0.0.1:4222 \
//!     cargo run --all-features --example consumer_nats
//! ```
//!
//! The broker test (tests/examples/consumer_nats.rs) runs this same code under unique names.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures_util::StreamExt;
use idempotent_runtime::inbox::{BoxFuture, InboxError, PostgresInbox, Processed};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Row};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The header carrying the producer's message id: the inbox's key.
pub const MESSAGE_ID_HEADER: &str = "Order-Message-Id";

/// Everything the example creates, named so that several runs never meet.
#[derive(Debug, Clone)]
pub struct Names {
    /// JetStream stream.
    pub stream: String,
    /// Subject the orders are published on.
    pub subject: String,
    /// Durable consumer, and the inbox's consumer name.
    pub durable: String,
    /// PostgreSQL schema holding the stock and the inbox.
    pub schema: String,
}

impl Names {
    /// Names with `suffix` appended.
    pub fn new(suffix: &str) -> Self {
        Self {
            stream: format!("IDEMPOTENT_ORDERS_{suffix}"),
            subject: format!("idempotent.orders.{suffix}.reserve"),
            durable: format!("reserve-stock-{suffix}"),
            schema: format!("consumer_example_{suffix}"),
        }
    }
}

/// The message body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReserveStock {
    /// The order the reservation is for.
    pub order_id: String,
    /// What to reserve.
    pub sku: String,
    /// How many.
    pub qty: i32,
}

/// Creates the schema, the stock table with `available` units of `apple`, and the inbox.
pub async fn setup_database(
    pool: &PgPool,
    names: &Names,
    available: i32,
) -> Result<PostgresInbox, Error> {
    let s = &names.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.stock (
             sku text PRIMARY KEY, available int NOT NULL, reserved int NOT NULL DEFAULT 0);
         CREATE TABLE IF NOT EXISTS {s}.reservations (
             order_id text PRIMARY KEY, sku text NOT NULL, qty int NOT NULL);
         -- One row per committed handler run, with no key of any kind: a message processed twice
         -- shows twice here, where the reservations' primary key would make it impossible.
         CREATE TABLE IF NOT EXISTS {s}.attempts (
             message_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());"
    )))
    .execute(pool)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {s}.stock (sku, available) VALUES ('apple', $1) \
         ON CONFLICT (sku) DO UPDATE SET available = $1, reserved = 0"
    )))
    .bind(available)
    .execute(pool)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "TRUNCATE {s}.reservations, {s}.attempts"
    )))
    .execute(pool)
    .await?;
    let inbox = PostgresInbox::builder(pool.clone(), names.durable.clone())
        .schema(s.clone())
        .build()?;
    inbox.migrate().await?;
    // A demo reset, so that every run starts from scratch: a real consumer never deletes its
    // markers (the sweeper does, after the retention).
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {} WHERE consumer = $1",
        inbox.qualified_table()
    )))
    .bind(inbox.consumer())
    .execute(pool)
    .await?;
    Ok(inbox)
}

/// Creates the stream and a durable pull consumer that redelivers after `ack_wait`.
pub async fn setup_broker(
    js: &jetstream::Context,
    names: &Names,
    ack_wait: Duration,
) -> Result<PullConsumer, Error> {
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: names.stream.clone(),
            subjects: vec![names.subject.clone()],
            ..Default::default()
        })
        .await?;
    let consumer = stream
        .get_or_create_consumer(
            &names.durable,
            jetstream::consumer::pull::Config {
                durable_name: Some(names.durable.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait,
                max_deliver: 20,
                ..Default::default()
            },
        )
        .await?;
    Ok(consumer)
}

/// Publishes one order with its message id in [`MESSAGE_ID_HEADER`], and waits for the stream
/// to store it.
pub async fn publish(
    js: &jetstream::Context,
    names: &Names,
    message_id: &str,
    body: &ReserveStock,
) -> Result<(), Error> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(MESSAGE_ID_HEADER, message_id);
    js.publish_with_headers(
        names.subject.clone(),
        headers,
        serde_json::to_vec(body)?.into(),
    )
    .await?
    .await?;
    Ok(())
}

/// The handler: reserves the stock and records the reservation, in the inbox's transaction.
/// Returns the units left, or `None` when there were not enough (also a final answer: ack).
/// Each entry into the handler is counted in `entries` (rolled back or not), and each committed
/// run leaves a row in `attempts`.
fn reserve(
    schema: String,
    message_id: String,
    order: ReserveStock,
    entries: Arc<Shared>,
) -> impl for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<Option<i32>, sqlx::Error>> {
    move |conn| {
        Box::pin(async move {
            *entries
                .report
                .lock()
                .unwrap()
                .handler_entries
                .entry(message_id.clone())
                .or_default() += 1;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {schema}.attempts (message_id) VALUES ($1)"
            )))
            .bind(&message_id)
            .execute(&mut *conn)
            .await?;
            let left = sqlx::query(AssertSqlSafe(format!(
                "UPDATE {schema}.stock SET available = available - $2, reserved = reserved + $2 \
                 WHERE sku = $1 AND available >= $2 RETURNING available"
            )))
            .bind(&order.sku)
            .bind(order.qty)
            .fetch_optional(&mut *conn)
            .await?;
            let Some(left) = left else { return Ok(None) };
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {schema}.reservations (order_id, sku, qty) VALUES ($1, $2, $3)"
            )))
            .bind(&order.order_id)
            .bind(&order.sku)
            .bind(order.qty)
            .execute(&mut *conn)
            .await?;
            Ok(Some(left.get::<i32, _>(0)))
        })
    }
}

/// What the consumer saw, for the summary and the broker test.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Messages whose handler ran and committed.
    pub done: usize,
    /// Copies acked as duplicates.
    pub duplicate: usize,
    /// Copies nak'd because a concurrent copy held the marker.
    pub busy: usize,
    /// Copies nak'd because the handler or the database failed.
    pub failed: usize,
    /// Deliveries JetStream marked as redeliveries (`delivered > 1`).
    pub redeliveries: usize,
    /// Processed but deliberately not acked (simulated crashes).
    pub crashed_before_ack: usize,
    /// Nak'd before processing (simulated transient failure).
    pub nakked_first: usize,
    /// Entries into the handler per message id, committed or not.
    pub handler_entries: BTreeMap<String, usize>,
}

/// The consumer: the inbox, plus the faults it is told to simulate.
pub struct StockConsumer {
    inbox: PostgresInbox,
    schema: String,
    shared: Arc<Shared>,
}

/// What the replicas of one consumer share: the faults to simulate, the report and the acks.
#[derive(Default)]
struct Shared {
    /// Message ids to process but not ack, once: JetStream redelivers them after `ack_wait`.
    crash_before_ack: Mutex<HashSet<String>>,
    /// Message ids to nak before processing, once.
    nak_first: Mutex<HashSet<String>>,
    report: Mutex<Report>,
    /// Stream sequences acked: each published copy once, however often it was delivered.
    acked: Mutex<HashSet<u64>>,
}

impl StockConsumer {
    /// A consumer writing to `schema` through `inbox`.
    pub fn new(inbox: PostgresInbox, schema: String) -> Self {
        Self {
            inbox,
            schema,
            shared: Arc::default(),
        }
    }

    /// Another replica of this consumer (a second process, with its own inbox handle and
    /// pool), sharing the faults to simulate, the report and the ack count.
    pub fn replica(&self, inbox: PostgresInbox) -> Self {
        Self {
            inbox,
            schema: self.schema.clone(),
            shared: self.shared.clone(),
        }
    }

    /// Processes `message_id` but skips its ack once, as a consumer crashing before its ack would.
    pub fn crash_before_ack(self, message_id: &str) -> Self {
        self.shared
            .crash_before_ack
            .lock()
            .unwrap()
            .insert(message_id.into());
        self
    }

    /// Naks `message_id` once before processing it.
    pub fn nak_first(self, message_id: &str) -> Self {
        self.shared
            .nak_first
            .lock()
            .unwrap()
            .insert(message_id.into());
        self
    }

    /// What happened so far, over all replicas.
    pub fn report(&self) -> Report {
        self.shared.report.lock().unwrap().clone()
    }

    /// Published messages acked so far, over all replicas.
    pub fn acked(&self) -> usize {
        self.shared.acked.lock().unwrap().len()
    }

    fn note(&self, f: impl FnOnce(&mut Report)) {
        f(&mut self.shared.report.lock().unwrap());
    }

    /// Handles one delivery: processes it through the inbox and acks or naks it.
    pub async fn handle(&self, msg: jetstream::Message) -> Result<(), Error> {
        let (delivered, sequence) = {
            let info = msg.info()?;
            (info.delivered, info.stream_sequence)
        };
        if delivered > 1 {
            self.note(|r| r.redeliveries += 1);
        }
        let Some(message_id) = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(MESSAGE_ID_HEADER))
            .map(|v| v.as_str().to_owned())
        else {
            // Without an id the inbox cannot deduplicate it; a real consumer would dead-letter it.
            println!("message without {MESSAGE_ID_HEADER}: terminated");
            msg.ack_with(AckKind::Term).await?;
            return Ok(());
        };
        let order: ReserveStock = match serde_json::from_slice(&msg.payload) {
            Ok(order) => order,
            Err(e) => {
                println!("{message_id}: unreadable body ({e}): terminated");
                msg.ack_with(AckKind::Term).await?;
                return Ok(());
            }
        };
        if self.shared.nak_first.lock().unwrap().remove(&message_id) {
            println!("{message_id} (delivery {delivered}): not ready yet, nak");
            self.note(|r| r.nakked_first += 1);
            msg.ack_with(AckKind::Nak(Some(Duration::from_millis(100))))
                .await?;
            return Ok(());
        }

        let outcome = self
            .inbox
            .process(
                &message_id,
                reserve(
                    self.schema.clone(),
                    message_id.clone(),
                    order.clone(),
                    self.shared.clone(),
                ),
            )
            .await;
        match outcome {
            Ok(Processed::Done(left)) => {
                self.note(|r| r.done += 1);
                match left {
                    Some(left) => println!(
                        "{message_id} (delivery {delivered}): reserved {} {} for {}, {left} left",
                        order.qty, order.sku, order.order_id
                    ),
                    None => println!(
                        "{message_id} (delivery {delivered}): not enough {} for {}",
                        order.sku, order.order_id
                    ),
                }
                if self
                    .shared
                    .crash_before_ack
                    .lock()
                    .unwrap()
                    .remove(&message_id)
                {
                    println!(
                        "{message_id}: simulating a crash before the ack; JetStream will redeliver it"
                    );
                    self.note(|r| r.crashed_before_ack += 1);
                    return Ok(());
                }
                msg.ack().await?;
            }
            Ok(Processed::Duplicate) => {
                self.note(|r| r.duplicate += 1);
                println!("{message_id} (delivery {delivered}): duplicate, already reserved: ack");
                msg.ack().await?;
            }
            Ok(Processed::Busy) => {
                self.note(|r| r.busy += 1);
                println!("{message_id} (delivery {delivered}): a copy is being processed: nak");
                msg.ack_with(AckKind::Nak(Some(Duration::from_millis(200))))
                    .await?;
                return Ok(());
            }
            Err(e) => {
                self.note(|r| r.failed += 1);
                let why = match &e {
                    InboxError::Handler(e) => format!("handler failed: {e}"),
                    InboxError::Store(e) => format!("database failed: {e}"),
                    other => format!("{other}"),
                };
                println!("{message_id} (delivery {delivered}): {why}: nak");
                msg.ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                    .await?;
                return Ok(());
            }
        }
        self.shared.acked.lock().unwrap().insert(sequence);
        Ok(())
    }

    /// Pulls and handles messages until `expected_acks` published messages were acked (over
    /// all replicas), or `deadline` passes.
    pub async fn run(
        &self,
        consumer: &PullConsumer,
        expected_acks: usize,
        deadline: Duration,
    ) -> Result<(), Error> {
        let stop = tokio::time::Instant::now() + deadline;
        // Pull a few at a time: JetStream's ack_wait runs from delivery, so messages waiting in a
        // large prefetch buffer could be redelivered before this consumer even looked at them.
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(4)
            .messages()
            .await?;
        while self.acked() < expected_acks && tokio::time::Instant::now() < stop {
            match tokio::time::timeout(Duration::from_millis(250), messages.next()).await {
                Ok(Some(msg)) => self.handle(msg?).await?,
                Ok(None) => break,
                Err(_idle) => {}
            }
        }
        Ok(())
    }
}

/// Committed handler runs per message id (the `attempts` table).
pub async fn attempts(pool: &PgPool, schema: &str) -> Result<BTreeMap<String, i64>, Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, count(*) FROM {schema}.attempts GROUP BY message_id"
    )))
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Units of `apple` reserved so far, and how many reservations were recorded.
pub async fn reserved(pool: &PgPool, schema: &str) -> Result<(i64, i64), Error> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT (SELECT reserved FROM {schema}.stock WHERE sku = 'apple')::bigint, \
                (SELECT count(*) FROM {schema}.reservations)"
    )))
    .fetch_one(pool)
    .await?;
    Ok((row.get(0), row.get(1)))
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let names = Names::new("example");

    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url)
        .await?;
    let inbox = setup_database(&pool, &names, 100).await?;
    // Deletes markers older than the retention (7 days), in batches, for as long as we run.
    let sweeper = inbox.spawn_sweeper();
    let client = async_nats::connect(&nats_url).await?;
    let js = jetstream::new(client);
    // Start from an empty stream, so that a second run shows the same thing.
    let _ = js.delete_stream(&names.stream).await;
    let consumer = setup_broker(&js, &names, Duration::from_secs(1)).await?;

    let order = |id: &str, qty| ReserveStock {
        order_id: id.into(),
        sku: "apple".into(),
        qty,
    };
    publish(&js, &names, "order-1", &order("o-1", 2)).await?;
    publish(&js, &names, "order-2", &order("o-2", 3)).await?;
    publish(&js, &names, "order-1", &order("o-1", 2)).await?; // the producer retried
    publish(&js, &names, "order-3", &order("o-3", 1)).await?;
    println!("published order-1, order-2, order-1 again, order-3");

    let stock = StockConsumer::new(inbox.clone(), names.schema.clone())
        .crash_before_ack("order-2")
        .nak_first("order-3");
    stock.run(&consumer, 4, Duration::from_secs(30)).await?;

    sweeper.abort();
    let report = stock.report();
    let (units, reservations) = reserved(&pool, &names.schema).await?;
    println!(
        "done: {} messages processed, {} duplicates acked without running, {} redeliveries",
        report.done, report.duplicate, report.redeliveries
    );
    println!("apple reserved: {units} units in {reservations} reservations (expected 6 in 3)");
    if (units, reservations) != (6, 3) {
        return Err("a repeated message changed the stock twice".into());
    }
    Ok(())
}
