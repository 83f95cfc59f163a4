//! An orders service whose `POST /orders` writes an order and its outbox event in the same
//! PostgreSQL transaction as the idempotency record (`#[idempotent(enlisted)]`): the three
//! commit together or not at all, so a crash can never leave an order without its record (and
//! run it again on the retry), nor a record without its order.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example orders_enlisted
//! ```
//!
//! It prints where it listens and a `curl` to paste twice: the first answer is `201 Created`,
//! the second the same answer with `Idempotency-Replayed: true`, and there is one order and one
//! outbox event. A duplicate sent while the first is still running gets 409 at once.
//!
//! `ORDERS_ADDR` (default `127.0.0.1:3000`) sets the address; port 0 picks a free one. Put
//! `options=-c%20search_path%3Dmy_schema` in `DATABASE_URL` to keep the tables in a schema.
//! `ORDERS_HOLD_MS` makes the handler wait that long after writing, before answering (to watch
//! duplicates get 409, or to kill the process mid-request and see nothing committed).

use std::io::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::store::postgres::PostgresStore;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
    db: PgPool,
    hold: Duration,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
    quantity: i32,
}

#[derive(Serialize)]
struct Order {
    id: i64,
    sku: String,
    quantity: i32,
}

/// A failure of the handler: answered 500, and the transaction rolls back.
struct ApiError(sqlx::Error);

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        Self(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        eprintln!("create_order failed: {}", self.0);
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "could not create the order",
        )
            .into_response()
    }
}

/// Runs once per `Idempotency-Key`, in the transaction that holds the key's reservation: the
/// order, its outbox event and the recorded `201` commit together, after this returns.
#[idempotent(require_key, enlisted)]
async fn create_order(
    State(state): State<AppState>,
    tx: &mut EnlistedTx,
    Json(new): Json<NewOrder>,
) -> Result<Response, ApiError> {
    if new.quantity <= 0 {
        // Recorded like any 4xx; nothing was written.
        return Ok((
            StatusCode::UNPROCESSABLE_ENTITY,
            "quantity must be positive",
        )
            .into_response());
    }
    let (id,): (i64,) =
        sqlx::query_as("INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id")
            .bind(&new.sku)
            .bind(new.quantity)
            .fetch_one(tx.conn())
            .await?;
    let order = Order {
        id,
        sku: new.sku,
        quantity: new.quantity,
    };
    let event = serde_json::json!({ "order_id": order.id, "sku": order.sku });
    sqlx::query("INSERT INTO outbox (topic, payload) VALUES ('order.created', $1::jsonb)")
        .bind(event.to_string())
        .execute(tx.conn())
        .await?;
    if !state.hold.is_zero() {
        println!("order {} written, answering in {:?}", order.id, state.hold);
        let _ = std::io::stdout().flush();
        tokio::time::sleep(state.hold).await;
    }
    let location = format!("/orders/{}", order.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(order),
    )
        .into_response())
}

async fn list_orders(State(state): State<AppState>) -> Result<Json<Vec<Order>>, ApiError> {
    let rows: Vec<(i64, String, i32)> =
        sqlx::query_as("SELECT id, sku, quantity FROM orders ORDER BY id")
            .fetch_all(&state.db)
            .await?;
    let orders = rows
        .into_iter()
        .map(|(id, sku, quantity)| Order { id, sku, quantity })
        .collect();
    Ok(Json(orders))
}

/// The application's own tables (a real service would use its migrations).
const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS orders (
        id bigserial PRIMARY KEY, sku text NOT NULL, quantity integer NOT NULL);
    CREATE TABLE IF NOT EXISTS outbox (
        id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now());";

fn app(state: AppState) -> Router {
    Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .with_state(state)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!(
            "orders_enlisted needs PostgreSQL: set DATABASE_URL=postgres://user@host/db \
             (enlisted mode commits the record with the order, in one transaction)"
        );
        std::process::exit(2);
    };
    let addr = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let hold = std::env::var("ORDERS_HOLD_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(Duration::ZERO, Duration::from_millis);

    let store = PostgresStore::connect(&url).await?;
    store.migrate().await?;
    let db = store.pool().clone();
    sqlx::raw_sql(SCHEMA).execute(&db).await?;
    let idempotency = Idempotency::new(store);

    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e} (set ORDERS_ADDR=127.0.0.1:0)"))?;
    let url = format!("http://{}", listener.local_addr()?);
    println!("listening on {url}");
    println!("send this twice; the second answer is the replay (Idempotency-Replayed: true):");
    println!(
        "curl -si -X POST {url}/orders -H 'Idempotency-Key: order-1' \
         -H 'Content-Type: application/json' -d '{{\"sku\":\"A1\",\"quantity\":2}}'"
    );
    println!("then list the orders (one, not two): curl -s {url}/orders");
    std::io::stdout().flush()?;

    let shutdown = idempotency.clone();
    let state = AppState {
        idempotency,
        db,
        hold,
    };
    axum::serve(
        listener,
        app(state).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async { tokio::signal::ctrl_c().await.unwrap_or(()) })
    .await?;
    shutdown.shutdown().await;
    Ok(())
}
