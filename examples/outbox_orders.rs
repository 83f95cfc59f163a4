//! One POST, one event, one effect: the outbox end to end (DESIGN.md §6).
//!
//! - **serve**: `POST /orders` (`#[idempotent(require_key, enlisted)]`) writes the order and an
//!   `OrderPlaced` message in the transaction that also records the idempotent answer: the
//!   three commit together or not at all. The message id is derived from the request (its
//!   scope, key and the purpose `order-placed`), so a retried POST never makes a second one.
//! - **relay**: publishes committed messages at least once, per customer one at a time in
//!   commit order: to NATS JetStream with `Nats-Msg-Id` = the message id (the default), or to
//!   RabbitMQ with `message_id` = the message id, persistent, `mandatory`, each confirmed by
//!   the broker (`OUTBOX_BROKER=amqp`, feature `rabbitmq`).
//! - **consume**: reserves stock through the inbox keyed by the same id, so a message
//!   published or delivered twice reserves once. On NATS, a durable JetStream consumer; on
//!   RabbitMQ, a lapin consumer with manual acks and a prefetch of [`amqp::PREFETCH`], acking
//!   each delivery after the inbox's transaction commits (a delivery that was processed but
//!   not acked before a crash or a lost connection comes back `redelivered`, and the inbox
//!   answers it `Duplicate`).
//!
//! The consumer prints a line per delivery it receives (`received <id>`, `redelivered` when the
//! broker says so) and per outcome (`done <id>` / `duplicate <id>`): the end-to-end test counts
//! deliveries from them.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test NATS_URL=127.0.0.1:4222 \
//!     cargo run --example outbox_orders
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test OUTBOX_BROKER=amqp \
//!     AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run --features rabbitmq --example outbox_orders
//! curl -si -X POST 127.0.0.1:3000/orders -H 'Idempotency-Key: k1' \
//!     -H 'Content-Type: application/json' -d '{"customer":"ada","sku":"A1","quantity":2}'
//! ```
//!
//! `OUTBOX_ROLE` = `serve`, `relay`, `consume` or `all` (default: all three in one process; the
//! end-to-end test runs each as its own process and SIGKILLs them). `OUTBOX_BROKER` = `nats`
//! (default) or `amqp`. `OUTBOX_NAME` (default `demo`) names the schema, stream, subject,
//! exchange and queue, so that runs never meet. `ORDERS_ADDR` (default `127.0.0.1:3000`) is
//! where `serve` listens.
//!
//! # Ordering
//!
//! The relay publishes one message per customer (the ordering key) at a time, the next only
//! after the broker confirmed the previous one, so each broker receives a customer's events in
//! commit order (a message published again after a crash lands after its first copy but before
//! the customer's next event).
//!
//! - **NATS**: the stream keeps that order. The consumer naks a message it could not process
//!   (redelivered 200 ms later) and JetStream redelivers unacked messages after the ack wait, so
//!   the order in which effects are *applied* may differ from the stream's when processing fails.
//! - **RabbitMQ**: the effects are applied in the customer's commit order too. The relay
//!   publishes to one durable classic queue, declared with `x-single-active-consumer`, which has
//!   one consumer at a time that processes its deliveries one by one. A delivery the consumer
//!   cannot process yet (a database error, the inbox `Busy`) is retried in place, never nacked:
//!   a nack would requeue it behind the deliveries already prefetched. When the consumer dies or
//!   loses its connection, the broker requeues its unacked deliveries at their place at the
//!   head of the queue, and the single-active-consumer rule lets the next consumer (a reconnect,
//!   or a restarted process) receive anything only after that requeue. Several queues, or
//!   several consumers on one queue without that rule, would give up this order.

use std::io::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures_util::StreamExt;
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::inbox::{PostgresInbox, Processed};
use idempotent_runtime::outbox::{Message, NatsPublisher, PostgresOutbox, Relay};
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::{Idempotency, IdempotencyContext};
use serde::{Deserialize, Serialize};
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgPool, PgPoolOptions};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Everything a run creates, named after `OUTBOX_NAME`.
#[derive(Debug, Clone)]
pub struct Names {
    /// PostgreSQL schema: orders, reservations, the idempotency store, outbox and inbox.
    pub schema: String,
    /// JetStream stream.
    pub stream: String,
    /// Subject `OrderPlaced` is published on.
    pub subject: String,
    /// Durable consumer, and the inbox's consumer name.
    pub durable: String,
    /// RabbitMQ: the durable direct exchange the relay publishes to (routing key: `subject`).
    pub exchange: String,
    /// RabbitMQ: the durable queue bound to `exchange` with the routing key `subject`.
    pub queue: String,
}

impl Names {
    /// The names of run `name` (lowercase letters, digits, `_`).
    pub fn new(name: &str) -> Self {
        Self {
            schema: format!("outbox_orders_{name}"),
            stream: format!("ORDERS_{}", name.to_uppercase()),
            subject: format!("orders.{name}.placed"),
            durable: format!("reserve-stock-{name}"),
            exchange: format!("orders.{name}"),
            queue: format!("orders.{name}.placed"),
        }
    }
}

/// The event a committed order publishes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order's id.
    pub order_id: i64,
    /// Who ordered: the ordering key, so one customer's events arrive in commit order.
    pub customer: String,
    /// What.
    pub sku: String,
    /// How many.
    pub quantity: i32,
}

/// Creates the schema and the application's tables, and migrates the crate's.
pub async fn setup_database(pool: &PgPool, names: &Names) -> Result<(), Error> {
    let s = &names.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.orders (
             id bigserial PRIMARY KEY, customer text NOT NULL, sku text NOT NULL,
             quantity integer NOT NULL);
         CREATE TABLE IF NOT EXISTS {s}.reservations (
             seq bigserial PRIMARY KEY, order_id bigint NOT NULL, customer text NOT NULL, sku text NOT NULL,
             quantity integer NOT NULL, message_id text NOT NULL,
             reserved_at timestamptz NOT NULL DEFAULT clock_timestamp());"
    )))
    .execute(pool)
    .await?;
    store(pool, names)?.migrate().await?;
    outbox(pool, names)?.migrate().await?;
    inbox(pool, names)?.migrate().await?;
    Ok(())
}

fn store(pool: &PgPool, names: &Names) -> Result<PostgresStore, Error> {
    Ok(PostgresStore::builder()
        .schema(&names.schema)
        .build(pool.clone())?)
}

/// The outbox of run `names`.
pub fn outbox(pool: &PgPool, names: &Names) -> Result<PostgresOutbox, Error> {
    Ok(PostgresOutbox::builder(pool.clone())
        .schema(&names.schema)
        .build()?)
}

/// The inbox of run `names`.
pub fn inbox(pool: &PgPool, names: &Names) -> Result<PostgresInbox, Error> {
    Ok(PostgresInbox::builder(pool.clone(), &names.durable)
        .schema(&names.schema)
        .build()?)
}

/// Creates the stream (deduplicating by `Nats-Msg-Id` for two minutes) and the consumer.
pub async fn setup_broker(
    js: &jetstream::Context,
    names: &Names,
    ack_wait: Duration,
) -> Result<PullConsumer, Error> {
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: names.stream.clone(),
            subjects: vec![names.subject.clone()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    Ok(stream
        .get_or_create_consumer(
            &names.durable,
            jetstream::consumer::pull::Config {
                durable_name: Some(names.durable.clone()),
                ack_wait,
                ..Default::default()
            },
        )
        .await?)
}

#[derive(Clone)]
struct App {
    idempotency: Idempotency,
    outbox: PostgresOutbox,
    names: Names,
}

impl FromRef<App> for Idempotency {
    fn from_ref(app: &App) -> Self {
        app.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    customer: String,
    sku: String,
    quantity: i32,
}

/// A failure of the handler: answered 500, and the transaction (order, message, record) rolls
/// back.
struct ApiError(String);

impl<E: std::fmt::Display> From<E> for ApiError {
    fn from(e: E) -> Self {
        Self(e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        eprintln!("create_order failed: {}", self.0);
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "could not place the order",
        )
            .into_response()
    }
}

/// Runs once per `Idempotency-Key`: the order, its `OrderPlaced` message and the recorded 201
/// commit together after it returns.
#[idempotent(require_key, enlisted)]
async fn create_order(
    State(app): State<App>,
    context: IdempotencyContext,
    tx: &mut EnlistedTx,
    Json(new): Json<NewOrder>,
) -> Result<(StatusCode, Json<OrderPlaced>), ApiError> {
    let (order_id,): (i64,) = sqlx::query_as(AssertSqlSafe(format!(
        "INSERT INTO {}.orders (customer, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
        app.names.schema
    )))
    .bind(&new.customer)
    .bind(&new.sku)
    .bind(new.quantity)
    .fetch_one(tx.conn())
    .await?;
    let placed = OrderPlaced {
        order_id,
        customer: new.customer,
        sku: new.sku,
        quantity: new.quantity,
    };
    let message = Message::for_request(
        &context,
        "order-placed",
        &app.names.subject,
        serde_json::to_vec(&placed)?,
    )
    .ordered_by(&placed.customer)
    .header("content-type", "application/json");
    app.outbox.enqueue(tx.conn(), message).await?;
    Ok((StatusCode::CREATED, Json(placed)))
}

async fn serve(
    pool: PgPool,
    names: Names,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let idempotency = Idempotency::new(store(&pool, &names)?);
    let app = App {
        idempotency: idempotency.clone(),
        outbox: outbox(&pool, &names)?,
        names,
    };
    let addr = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let router = Router::new()
        .route("/orders", post(create_order))
        .with_state(app);
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await?;
    idempotency.shutdown().await;
    Ok(())
}

async fn relay_nats(
    pool: PgPool,
    names: Names,
    js: jetstream::Context,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let outbox = outbox(&pool, &names)?;
    let _sweeper = outbox.spawn_sweeper();
    println!("relaying to {}", names.subject);
    std::io::stdout().flush()?;
    Relay::new(outbox, NatsPublisher::new(js))
        .run_until(shutdown)
        .await;
    Ok(())
}

/// Reserves stock for one delivered `OrderPlaced`, once per message id.
pub async fn reserve(
    inbox: &PostgresInbox,
    schema: &str,
    message_id: &str,
    event: OrderPlaced,
) -> Result<Processed<()>, Error> {
    let sql = format!(
        "INSERT INTO {schema}.reservations (order_id, customer, sku, quantity, message_id) \
         VALUES ($1, $2, $3, $4, $5)"
    );
    let id = message_id.to_owned();
    Ok(inbox
        .process(message_id, |conn| {
            Box::pin(async move {
                sqlx::query(AssertSqlSafe(sql))
                    .bind(event.order_id)
                    .bind(&event.customer)
                    .bind(&event.sku)
                    .bind(event.quantity)
                    .bind(id)
                    .execute(&mut *conn)
                    .await
                    .map(|_| ())
            })
        })
        .await?)
}

/// Prints (and flushes) one line: what the end-to-end test reads.
fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

async fn consume_nats(
    pool: PgPool,
    names: Names,
    js: jetstream::Context,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let inbox = inbox(&pool, &names)?;
    let consumer = setup_broker(&js, &names, Duration::from_secs(2)).await?;
    let mut messages = consumer.messages().await?;
    println!("consuming {}", names.subject);
    std::io::stdout().flush()?;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let message = tokio::select! {
            () = &mut shutdown => return Ok(()),
            next = messages.next() => match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    eprintln!("consumer: {e}");
                    continue;
                }
                None => return Ok(()),
            },
        };
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str().to_owned());
        let redelivered = message.info().is_ok_and(|i| i.delivered > 1);
        say(format_args!(
            "received {}{}",
            id.as_deref().unwrap_or("-"),
            if redelivered { " redelivered" } else { "" }
        ));
        let (Some(id), Ok(event)) = (id, serde_json::from_slice::<OrderPlaced>(&message.payload))
        else {
            eprintln!("consumer: a message without an id or not an OrderPlaced; terminating it");
            let _ = message.ack_with(AckKind::Term).await;
            continue;
        };
        match reserve(&inbox, &names.schema, &id, event).await {
            Ok(outcome @ (Processed::Done(()) | Processed::Duplicate)) => {
                say(format_args!("{} {id}", outcome_word(&outcome)));
                let _ = message.ack().await;
            }
            Ok(Processed::Busy) | Err(_) => {
                let _ = message
                    .ack_with(AckKind::Nak(Some(Duration::from_millis(200))))
                    .await;
            }
        }
    }
}

fn outcome_word(outcome: &Processed<()>) -> &'static str {
    match outcome {
        Processed::Done(()) => "done",
        Processed::Duplicate => "duplicate",
        Processed::Busy => "busy",
    }
}

/// The RabbitMQ mode (`OUTBOX_BROKER=amqp`, feature `rabbitmq`).
#[cfg(feature = "rabbitmq")]
pub mod amqp {
    use std::time::Duration;

    use futures_util::StreamExt;
    use idempotent_runtime::inbox::{PostgresInbox, Processed};
    use idempotent_runtime::outbox::{AmqpPublisher, Relay};
    use lapin::message::Delivery;
    use lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
        ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
    use sqlx::postgres::PgPool;

    use super::{Error, Names, OrderPlaced, inbox, outbox, outcome_word, reserve, say};

    /// Deliveries the broker sends the consumer ahead of its acks.
    pub const PREFETCH: u16 = 32;

    /// How long the roles wait before reconnecting, or retrying a delivery in place.
    const PAUSE: Duration = Duration::from_millis(200);

    /// How long an ack (or a reject) may take: one frame written to the socket. lapin 4.12 can
    /// leave its future unresolved when the connection is cut as the frame is sent (seen in
    /// the end-to-end test: the consumer waited on it for good, connected by lapin's account,
    /// while the broker had closed the connection and requeued its deliveries). Past this the
    /// connection is taken for lost: the consumer opens another, and the broker redelivers
    /// whatever it had not acked, which the inbox answers as a duplicate.
    const ACK_WAIT: Duration = Duration::from_secs(5);

    /// How long opening a connection may take before it is tried again (lapin's handshake
    /// has hung when the connection was cut in the middle of it).
    const CONNECT_WAIT: Duration = Duration::from_secs(10);

    /// Connects to RabbitMQ, trying again until it answers.
    pub async fn connect(url: &str) -> Connection {
        loop {
            let connecting = Connection::connect(url, ConnectionProperties::default());
            match tokio::time::timeout(CONNECT_WAIT, connecting).await {
                Ok(Ok(connection)) => return connection,
                Ok(Err(e)) => eprintln!("RabbitMQ at {url}: {e}; trying again"),
                Err(_) => eprintln!(
                    "RabbitMQ at {url}: no connection after {CONNECT_WAIT:?}; trying again"
                ),
            }
            tokio::time::sleep(PAUSE).await;
        }
    }

    /// Declares the durable direct exchange, the durable classic queue with a single active
    /// consumer, and the binding between them by the subject (redeclaring is a no-op).
    pub async fn setup_broker(channel: &Channel, names: &Names) -> Result<(), lapin::Error> {
        channel
            .exchange_declare(
                names.exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("classic".into()),
        );
        arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        channel
            .queue_declare(
                names.queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                arguments,
            )
            .await?;
        channel
            .queue_bind(
                names.queue.as_str().into(),
                names.exchange.as_str().into(),
                names.subject.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
    }

    /// Completes once `connection` is no longer usable (closed, or its socket lost).
    async fn lost(connection: &Connection) {
        while connection.status().connected() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Relays to the exchange until `shutdown`, on a connection of its own that it opens again
    /// when it is lost (the relay retries what failed meanwhile).
    pub async fn relay(
        pool: PgPool,
        names: Names,
        url: String,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), Error> {
        let _sweeper = outbox(&pool, &names)?.spawn_sweeper();
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let connection = tokio::select! {
                () = &mut shutdown => return Ok(()),
                c = connect(&url) => c,
            };
            let publisher = async {
                let channel = connection.create_channel().await?;
                setup_broker(&channel, &names).await?;
                AmqpPublisher::new(channel, names.exchange.as_str()).await
            };
            let publisher = match publisher.await {
                Ok(publisher) => publisher,
                Err(e) => {
                    eprintln!("relay: RabbitMQ: {e}; reconnecting");
                    tokio::time::sleep(PAUSE).await;
                    continue;
                }
            };
            say(format_args!(
                "relaying to exchange {} with routing key {}",
                names.exchange, names.subject
            ));
            let mut stopped = false;
            Relay::new(outbox(&pool, &names)?, publisher)
                .run_until(async {
                    tokio::select! {
                        () = &mut shutdown => stopped = true,
                        () = lost(&connection) => {}
                    }
                })
                .await;
            if stopped {
                return Ok(());
            }
            eprintln!("relay: the RabbitMQ connection was lost; reconnecting");
        }
    }

    /// Consumes the queue until `shutdown`, one delivery at a time, on a connection it opens
    /// again when it is lost; the broker then redelivers what was not acked.
    pub async fn consume(
        pool: PgPool,
        names: Names,
        url: String,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), Error> {
        let inbox = inbox(&pool, &names)?;
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let connection = tokio::select! {
                () = &mut shutdown => return Ok(()),
                c = connect(&url) => c,
            };
            let consumer = async {
                let channel = connection.create_channel().await?;
                setup_broker(&channel, &names).await?;
                channel
                    .basic_qos(PREFETCH, BasicQosOptions::default())
                    .await?;
                channel
                    .basic_consume(
                        names.queue.as_str().into(),
                        names.durable.as_str().into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
            };
            let mut consumer = match consumer.await {
                Ok(consumer) => consumer,
                Err(e) => {
                    eprintln!("consumer: RabbitMQ: {e}; reconnecting");
                    tokio::time::sleep(PAUSE).await;
                    continue;
                }
            };
            say(format_args!("consuming queue {}", names.queue));
            loop {
                let delivery = tokio::select! {
                    () = &mut shutdown => return Ok(()),
                    next = consumer.next() => match next {
                        Some(Ok(delivery)) => delivery,
                        Some(Err(e)) => {
                            eprintln!("consumer: {e}; reconnecting");
                            break;
                        }
                        None => break,
                    },
                };
                if !handle(&inbox, &names, &connection, delivery).await {
                    break;
                }
            }
        }
    }

    /// Processes one delivery through the inbox and acks it once the inbox's transaction
    /// committed (`Done` or `Duplicate`). Returns `false` when the connection is gone: the
    /// broker redelivers whatever was not acked, in order, to the next consumer.
    async fn handle(
        inbox: &PostgresInbox,
        names: &Names,
        connection: &Connection,
        delivery: Delivery,
    ) -> bool {
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned());
        say(format_args!(
            "received {}{}",
            id.as_deref().unwrap_or("-"),
            if delivery.redelivered {
                " redelivered"
            } else {
                ""
            }
        ));
        let (Some(id), Ok(event)) = (id, serde_json::from_slice::<OrderPlaced>(&delivery.data))
        else {
            eprintln!("consumer: a message without an id or not an OrderPlaced; rejecting it");
            let rejected = delivery.acker.reject(BasicRejectOptions { requeue: false });
            return settled("reject", rejected).await;
        };
        loop {
            match reserve(inbox, &names.schema, &id, event.clone()).await {
                Ok(outcome @ (Processed::Done(()) | Processed::Duplicate)) => {
                    say(format_args!("{} {id}", outcome_word(&outcome)));
                    let acked = delivery.acker.ack(BasicAckOptions::default());
                    return settled("ack", acked).await;
                }
                // Retried in place: a nack would requeue it behind the prefetched deliveries.
                Ok(Processed::Busy) | Err(_) => {
                    if !connection.status().connected() {
                        return false;
                    }
                    tokio::time::sleep(PAUSE).await;
                }
            }
        }
    }

    /// Whether an ack or reject `what` reached the connection within [`ACK_WAIT`]; `false`
    /// when the connection is lost (or the wait ran out, taken for the same).
    async fn settled<T>(what: &str, sent: impl Future<Output = lapin::Result<T>>) -> bool {
        match tokio::time::timeout(ACK_WAIT, sent).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                eprintln!("consumer: {what}: {e}; reconnecting");
                false
            }
            Err(_) => {
                eprintln!("consumer: {what} not sent within {ACK_WAIT:?}; reconnecting");
                false
            }
        }
    }
}

/// The broker the relay and the consumer use.
enum Broker {
    Nats(jetstream::Context),
    #[cfg(feature = "rabbitmq")]
    Amqp(String),
}

async fn relay(
    pool: PgPool,
    names: Names,
    broker: &Broker,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    match broker {
        Broker::Nats(js) => relay_nats(pool, names, js.clone(), shutdown).await,
        #[cfg(feature = "rabbitmq")]
        Broker::Amqp(url) => amqp::relay(pool, names, url.clone(), shutdown).await,
    }
}

async fn consume(
    pool: PgPool,
    names: Names,
    broker: &Broker,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    match broker {
        Broker::Nats(js) => consume_nats(pool, names, js.clone(), shutdown).await,
        #[cfg(feature = "rabbitmq")]
        Broker::Amqp(url) => amqp::consume(pool, names, url.clone(), shutdown).await,
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("outbox_orders needs PostgreSQL: set DATABASE_URL=postgres://user@host/db");
        std::process::exit(2);
    };
    let names = Names::new(&std::env::var("OUTBOX_NAME").unwrap_or_else(|_| "demo".into()));
    let role = std::env::var("OUTBOX_ROLE").unwrap_or_else(|_| "all".into());
    let broker = std::env::var("OUTBOX_BROKER").unwrap_or_else(|_| "nats".into());

    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await?;
    setup_database(&pool, &names).await?;
    let broker = match broker.as_str() {
        "nats" => {
            let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
            let js = jetstream::new(async_nats::connect(&nats_url).await?);
            setup_broker(&js, &names, Duration::from_secs(2)).await?;
            Broker::Nats(js)
        }
        #[cfg(feature = "rabbitmq")]
        "amqp" => Broker::Amqp(
            std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        ),
        #[cfg(not(feature = "rabbitmq"))]
        "amqp" => return Err("OUTBOX_BROKER=amqp needs the feature `rabbitmq`".into()),
        other => return Err(format!("OUTBOX_BROKER={other}: expected nats or amqp").into()),
    };

    let ctrl_c = || async { tokio::signal::ctrl_c().await.unwrap_or(()) };
    match role.as_str() {
        "serve" => serve(pool, names, ctrl_c()).await,
        "relay" => relay(pool, names, &broker, ctrl_c()).await,
        "consume" => consume(pool, names, &broker, ctrl_c()).await,
        "all" => {
            let (a, b, c) = tokio::join!(
                serve(pool.clone(), names.clone(), ctrl_c()),
                relay(pool.clone(), names.clone(), &broker, ctrl_c()),
                consume(pool, names, &broker, ctrl_c()),
            );
            a.and(b).and(c)
        }
        other => Err(format!("OUTBOX_ROLE={other}: expected serve, relay, consume or all").into()),
    }
}
