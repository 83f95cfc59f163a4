//! One POST, one event, one effect: the outbox end to end (DESIGN.md §6).
//!
//! - **serve**: `POST /orders` (`#[idempotent(require_key, enlisted)]`) writes the order and an
//!   `OrderPlaced` message in the transaction that also records the idempotent answer: the
//!   three commit together or not at all. The message id is derived from the request (its
//!   scope, key and the purpose `order-placed`), so a retried POST never makes a second one.
//! - **relay**: publishes committed messages to NATS JetStream with `Nats-Msg-Id` = the
//!   message id, per customer one at a time in commit order, at least once.
//! - **consume**: a JetStream consumer reserving stock through the inbox keyed by the same id,
//!   so a message published or delivered twice reserves once.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test NATS_URL=127.0.0.1:4222 \
//!     cargo run --example outbox_orders
//! curl -si -X POST 127.0.0.1:3000/orders -H 'Idempotency-Key: k1' \
//!     -H 'Content-Type: application/json' -d '{"customer":"ada","sku":"A1","quantity":2}'
//! ```
//!
//! `OUTBOX_ROLE` = `serve`, `relay`, `consume` or `all` (default: all three in one process; the
//! end-to-end test runs each as its own process and SIGKILLs them). `OUTBOX_NAME` (default
//! `demo`) names the schema, stream and subject, so that runs never meet. `ORDERS_ADDR`
//! (default `127.0.0.1:3000`) is where `serve` listens.

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
}

impl Names {
    /// The names of run `name` (lowercase letters, digits, `_`).
    pub fn new(name: &str) -> Self {
        Self {
            schema: format!("outbox_orders_{name}"),
            stream: format!("ORDERS_{}", name.to_uppercase()),
            subject: format!("orders.{name}.placed"),
            durable: format!("reserve-stock-{name}"),
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
             order_id bigint NOT NULL, customer text NOT NULL, sku text NOT NULL,
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

fn inbox(pool: &PgPool, names: &Names) -> Result<PostgresInbox, Error> {
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

async fn relay(
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

async fn consume(
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
        let (Some(id), Ok(event)) = (id, serde_json::from_slice::<OrderPlaced>(&message.payload))
        else {
            eprintln!("consumer: a message without an id or not an OrderPlaced; terminating it");
            let _ = message.ack_with(AckKind::Term).await;
            continue;
        };
        match reserve(&inbox, &names.schema, &id, event).await {
            Ok(Processed::Done(())) | Ok(Processed::Duplicate) => {
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

#[tokio::main]
async fn main() -> Result<(), Error> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("outbox_orders needs PostgreSQL: set DATABASE_URL=postgres://user@host/db");
        std::process::exit(2);
    };
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let names = Names::new(&std::env::var("OUTBOX_NAME").unwrap_or_else(|_| "demo".into()));
    let role = std::env::var("OUTBOX_ROLE").unwrap_or_else(|_| "all".into());

    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await?;
    setup_database(&pool, &names).await?;
    let js = jetstream::new(async_nats::connect(&nats_url).await?);
    setup_broker(&js, &names, Duration::from_secs(2)).await?;

    let ctrl_c = || async { tokio::signal::ctrl_c().await.unwrap_or(()) };
    match role.as_str() {
        "serve" => serve(pool, names, ctrl_c()).await,
        "relay" => relay(pool, names, js, ctrl_c()).await,
        "consume" => consume(pool, names, js, ctrl_c()).await,
        "all" => {
            let (a, b, c) = tokio::join!(
                serve(pool.clone(), names.clone(), ctrl_c()),
                relay(pool.clone(), names.clone(), js.clone(), ctrl_c()),
                consume(pool, names, js, ctrl_c()),
            );
            a.and(b).and(c)
        }
        other => Err(format!("OUTBOX_ROLE={other}: expected serve, relay, consume or all").into()),
    }
}
