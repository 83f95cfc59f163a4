//! Payments, idempotent by construction: where the domain gives a natural guard, use it, and use
//! `#[idempotent]` where only the client knows which requests are the same.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example payments
//! ```
//!
//! - `POST /payments` authorizes a charge with a (local, fake) payment provider. Only the client
//!   knows that two requests are one payment, so it takes an `Idempotency-Key`; the handler passes
//!   the provider a *derived* key (scope + key + purpose), never the raw one, so a retry after a
//!   crash between the provider call and our insert reuses the same charge, and two tenants who
//!   happen to send the same key get two charges.
//! - `POST /payments/{id}/capture` is a guarded transition: `UPDATE … WHERE id = $1 AND status =
//!   'Authorized'`. Zero rows means it already happened (or cannot): no header needed.
//! - `POST /webhooks/provider` is de-duplicated by the provider's natural unique key
//!   (`provider_event_id`), with no header at all: providers redeliver webhooks.
//!
//! `PAYMENTS_ADDR` (default `127.0.0.1:3001`) and `PAYMENTS_SCHEMA` (default `payments_demo`)
//! are settable.

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::{FromRef, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::{Idempotency, IdempotencyContext};
use serde::Deserialize;
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, PgPool};

/// A stand-in for a payment provider's API client. Like real providers, it de-duplicates
/// authorizations by the idempotency key it is given, and its charge ids are its own: derived
/// from that key here, so they never collide across restarts (of this example, or of a
/// provider's counter) the way a local sequence would.
#[derive(Default)]
pub struct FakeProvider {
    charges: Mutex<HashMap<String, String>>,
    /// Every `authorize` call, whatever it answered: how often a handler reached the provider.
    calls: std::sync::atomic::AtomicUsize,
}

impl FakeProvider {
    /// Authorizes `amount_cents`; the same `idempotency_key` always yields the same charge, in
    /// this process or the next.
    pub fn authorize(&self, idempotency_key: &str, amount_cents: i64) -> String {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut charges = self.charges.lock().expect("provider lock");
        let prefix = idempotency_key.get(..24).unwrap_or(idempotency_key);
        charges
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| format!("ch_{prefix}_{amount_cents}"))
            .clone()
    }

    /// Charges created so far (distinct keys seen).
    #[allow(dead_code)] // read by the example's test
    pub fn charges(&self) -> usize {
        self.charges.lock().expect("provider lock").len()
    }

    /// How many times `authorize` was called (a second call with the same key counts, though
    /// it yields the same charge): the handler runs that reached the provider.
    #[allow(dead_code)] // read by the example's test
    pub fn calls(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The idempotency keys the provider has seen.
    #[allow(dead_code)] // read by the example's test
    pub fn keys(&self) -> Vec<String> {
        self.charges
            .lock()
            .expect("provider lock")
            .keys()
            .cloned()
            .collect()
    }
}

#[derive(Clone)]
pub struct AppState {
    pub idempotency: Idempotency,
    pub db: PgPool,
    pub provider: Arc<FakeProvider>,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewPayment {
    amount_cents: i64,
}

type ApiError = (StatusCode, String);

fn internal(e: sqlx::Error) -> ApiError {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

#[idempotent(require_key)]
async fn create_payment(
    State(state): State<AppState>,
    context: IdempotencyContext,
    Json(new): Json<NewPayment>,
) -> Result<Response, ApiError> {
    if new.amount_cents <= 0 {
        return Err((
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount must be positive".into(),
        ));
    }
    let charge = state
        .provider
        .authorize(&context.derived_key("authorize"), new.amount_cents);
    // The provider's charge id is unique here too: a retry that lost our response (but not the
    // provider's) finds the row instead of inserting a second one. A row found is only ever this
    // request's own payment: the charge id comes from the derived key (this caller, this key),
    // and the amount must match too; anything else is refused, never merged into the row.
    let inserted: Option<(i64, String)> = sqlx::query_as(
        "INSERT INTO payments (amount_cents, status, provider_charge_id)
         VALUES ($1, 'Authorized', $2)
         ON CONFLICT (provider_charge_id) DO NOTHING
         RETURNING id, status",
    )
    .bind(new.amount_cents)
    .bind(&charge)
    .fetch_optional(&state.db)
    .await
    .map_err(internal)?;
    let (id, status) = match inserted {
        Some(row) => row,
        None => {
            let (id, status, amount): (i64, String, i64) = sqlx::query_as(
                "SELECT id, status, amount_cents FROM payments WHERE provider_charge_id = $1",
            )
            .bind(&charge)
            .fetch_one(&state.db)
            .await
            .map_err(internal)?;
            if amount != new.amount_cents {
                return Err((
                    StatusCode::CONFLICT,
                    format!("charge {charge} is already a payment of another amount"),
                ));
            }
            (id, status)
        }
    };
    let body =
        json!({"id": id, "status": status, "charge": charge, "amount_cents": new.amount_cents});
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(body),
    )
        .into_response())
}

async fn capture(State(state): State<AppState>, Path(id): Path<i64>) -> Result<Response, ApiError> {
    let moved = sqlx::query(
        "UPDATE payments SET status = 'Captured' WHERE id = $1 AND status = 'Authorized'",
    )
    .bind(id)
    .execute(&state.db)
    .await
    .map_err(internal)?
    .rows_affected();
    if moved == 1 {
        return Ok(Json(json!({"id": id, "status": "Captured"})).into_response());
    }
    // Zero rows: already captured (a retry: same answer), or not capturable.
    let status: Option<String> = sqlx::query_scalar("SELECT status FROM payments WHERE id = $1")
        .bind(id)
        .fetch_optional(&state.db)
        .await
        .map_err(internal)?;
    Ok(match status.as_deref() {
        Some("Captured") => Json(json!({"id": id, "status": "Captured"})).into_response(),
        Some(other) => (
            StatusCode::CONFLICT,
            Json(json!({"id": id, "status": other, "error": "not capturable"})),
        )
            .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    })
}

#[derive(Deserialize)]
struct ProviderEvent {
    event_id: String,
    charge: String,
}

async fn provider_webhook(
    State(state): State<AppState>,
    Json(event): Json<ProviderEvent>,
) -> Result<Response, ApiError> {
    let mut tx = state.db.begin().await.map_err(internal)?;
    let fresh = sqlx::query(
        "INSERT INTO webhook_events (provider_event_id) VALUES ($1) ON CONFLICT DO NOTHING",
    )
    .bind(&event.event_id)
    .execute(&mut *tx)
    .await
    .map_err(internal)?
    .rows_affected()
        == 1;
    if fresh {
        sqlx::query(
            "UPDATE payments SET settlements = settlements + 1 WHERE provider_charge_id = $1",
        )
        .bind(&event.charge)
        .execute(&mut *tx)
        .await
        .map_err(internal)?;
    }
    tx.commit().await.map_err(internal)?;
    Ok(Json(json!({"event_id": event.event_id, "duplicate": !fresh})).into_response())
}

/// Creates the example's tables (idempotent) in the pool's schema.
pub async fn migrate(db: &PgPool) -> Result<(), sqlx::Error> {
    let ddl = "CREATE TABLE IF NOT EXISTS payments (
             id bigserial PRIMARY KEY,
             amount_cents bigint NOT NULL,
             status text NOT NULL CHECK (status IN ('Authorized', 'Captured')),
             provider_charge_id text NOT NULL UNIQUE,
             settlements int NOT NULL DEFAULT 0
         );
         CREATE TABLE IF NOT EXISTS webhook_events (
             provider_event_id text PRIMARY KEY,
             received_at timestamptz NOT NULL DEFAULT now()
         );";
    sqlx::raw_sql(ddl).execute(db).await?;
    Ok(())
}

/// The service's routes.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/{id}/capture", post(capture))
        .route("/webhooks/provider", post(provider_webhook))
        .with_state(state)
}

/// Connects, migrates the example's tables and the idempotency store, all in `schema` (created
/// if missing; schema names are plain lowercase identifiers here).
pub async fn state(url: &str, schema: &str) -> Result<AppState, Box<dyn std::error::Error>> {
    if !schema
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(format!("schema {schema:?}: use lowercase letters, digits and _").into());
    }
    let options: PgConnectOptions = url.parse()?;
    let admin = PgPool::connect_with(options.clone()).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {schema}"
    )))
    .execute(&admin)
    .await?;
    admin.close().await;
    let db = PgPool::connect_with(options.options([("search_path", schema)])).await?;
    migrate(&db).await?;
    let store = PostgresStore::builder().schema(schema).connect(url).await?;
    store.migrate().await?;
    Ok(AppState {
        idempotency: Idempotency::new(store),
        db,
        provider: Arc::default(),
    })
}

#[allow(dead_code)] // the test includes this file as a module and starts its own server
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("set DATABASE_URL=postgres://postgres@127.0.0.1:5432/test to run this example");
        std::process::exit(2);
    };
    let schema = std::env::var("PAYMENTS_SCHEMA").unwrap_or_else(|_| "payments_demo".into());
    let addr = std::env::var("PAYMENTS_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let state = state(&url, &schema).await?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let url = format!("http://{}", listener.local_addr()?);
    println!("listening on {url}");
    println!(
        "authorize (twice: one charge): curl -si -X POST {url}/payments -H 'Idempotency-Key: pay-1' -H 'Content-Type: application/json' -d '{{\"amount_cents\":1250}}'"
    );
    println!("capture (twice: captured once): curl -si -X POST {url}/payments/1/capture");
    println!(
        "webhook (twice: applied once): curl -si -X POST {url}/webhooks/provider -H 'Content-Type: application/json' -d '{{\"event_id\":\"evt_1\",\"charge\":\"<charge from the authorization>\"}}'"
    );
    std::io::stdout().flush()?;
    axum::serve(
        listener,
        app(state).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async { tokio::signal::ctrl_c().await.unwrap_or(()) })
    .await?;
    Ok(())
}
