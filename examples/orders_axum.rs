//! An orders service whose `POST /orders` is safe to repeat.
//!
//! ```text
//! cargo run --example orders_axum
//! ```
//!
//! It runs on the embedded in-memory store, on Redis when `REDIS_URL` is set
//! (`redis://127.0.0.1:6379/0`), or on PostgreSQL when `DATABASE_URL` is set (several replicas
//! may then share the database or the Redis). It prints where it listens and a `curl` to paste twice:
//! the first answer is `201 Created`, the second the same answer with `Idempotency-Replayed: true`,
//! and the order was created once.
//!
//! `ORDERS_ADDR` (default `127.0.0.1:3000`) sets the address; port 0 picks a free one.
//! `ORDERS_METRICS=1` adds `GET /metrics`, the runtime's metrics in Prometheus text format.
//!
//! Refusals (a missing key, a reused one, …) come in the service's own error envelope,
//! `{"error": {"code", "message"}}`, through the handle's refusal renderer; their status and
//! `Retry-After` are the runtime's.

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{FromRef, Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::problem::{Problem, RenderedRefusal};
use idempotent_runtime::{Idempotency, scope::Identity};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};

#[path = "support/prometheus.rs"]
mod prometheus;

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
    orders: Arc<Mutex<Vec<Order>>>,
    next_id: Arc<AtomicU64>,
}

/// How `#[idempotent]` finds the store: checked at compile time.
impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
    quantity: u32,
}

#[derive(Clone, Serialize)]
struct Order {
    id: u64,
    sku: String,
    quantity: u32,
}

/// Runs once per `Idempotency-Key`: a retry, a double click or a replayed request gets the
/// recorded answer instead.
#[idempotent(require_key)]
async fn create_order(
    State(state): State<AppState>,
    Json(new): Json<NewOrder>,
) -> Result<(StatusCode, [(header::HeaderName, String); 1], Json<Order>), (StatusCode, String)> {
    if new.quantity == 0 {
        return Err((
            StatusCode::UNPROCESSABLE_ENTITY,
            "quantity must be positive".into(),
        ));
    }
    let order = Order {
        id: state.next_id.fetch_add(1, Ordering::Relaxed) + 1,
        sku: new.sku,
        quantity: new.quantity,
    };
    state
        .orders
        .lock()
        .expect("orders lock")
        .push(order.clone());
    let location = format!("/orders/{}", order.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(order),
    ))
}

async fn get_order(State(state): State<AppState>, Path(id): Path<u64>) -> Response {
    let orders = state.orders.lock().expect("orders lock");
    match orders.iter().find(|o| o.id == id) {
        Some(order) => Json(order.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn list_orders(State(state): State<AppState>) -> Json<Vec<Order>> {
    Json(state.orders.lock().expect("orders lock").clone())
}

/// A stand-in for real authentication: `Authorization: Bearer <user>` is user `<user>` of tenant
/// `demo`. Publishing the `Identity` scopes keys per caller; anonymous callers are scoped by
/// their IP address.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let bearer = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")));
    match bearer {
        None => {}
        Some(Some(user)) if !user.is_empty() => {
            let identity = Identity::subject("demo", user);
            request.extensions_mut().insert(identity);
        }
        Some(_) => return (StatusCode::UNAUTHORIZED, "expected: Bearer <user>").into_response(),
    }
    next.run(request).await
}

/// The service's own error envelope, for the runtime's refusals too.
fn render_refusal(problem: &Problem) -> RenderedRefusal {
    let body = serde_json::json!({
        "error": {"code": problem.code().as_str(), "message": problem.detail()}
    });
    RenderedRefusal::new("application/json", serde_json::to_vec(&body).expect("JSON"))
}

async fn idempotency_store() -> Result<Idempotency, Box<dyn std::error::Error>> {
    #[cfg(feature = "redis")]
    if let Ok(url) = std::env::var("REDIS_URL") {
        let store = idempotent_runtime::store::redis::RedisStore::builder()
            .prefix("orders")
            .connect(&url)
            .await?;
        eprintln!("idempotency store: Redis");
        return Ok(Idempotency::builder(store)
            .refusal_renderer(render_refusal)
            .build());
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("postgres") => {
            let store = idempotent_runtime::store::postgres::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            eprintln!("idempotency store: PostgreSQL");
            Ok(Idempotency::builder(store)
                .refusal_renderer(render_refusal)
                .build())
        }
        _ => {
            eprintln!(
                "idempotency store: in memory (set REDIS_URL=redis://… or DATABASE_URL=postgres://…)"
            );
            let store = idempotent_runtime::store::memory::MemoryStore::default();
            Ok(Idempotency::builder(store)
                .refusal_renderer(render_refusal)
                .build())
        }
    }
}

fn app(idempotency: Idempotency, metrics: Option<PrometheusHandle>) -> Router {
    let scrape = metrics.map(|handle| {
        let idempotency = idempotency.clone();
        get(move || async move {
            let text = prometheus::render(&handle, &idempotency);
            ([(header::CONTENT_TYPE, prometheus::CONTENT_TYPE)], text)
        })
    });
    let state = AppState {
        idempotency,
        orders: Arc::default(),
        next_id: Arc::default(),
    };
    let router = Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .route("/orders/{id}", get(get_order));
    let router = match scrape {
        Some(scrape) => router.route("/metrics", scrape),
        None => router,
    };
    router
        .layer(middleware::from_fn(authenticate))
        .with_state(state)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let metrics = (std::env::var("ORDERS_METRICS").as_deref() == Ok("1")).then(prometheus::install);
    let idempotency = idempotency_store().await?;
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
    axum::serve(
        listener,
        app(idempotency, metrics).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async { tokio::signal::ctrl_c().await.unwrap_or(()) })
    .await?;
    // Claimed handlers run to completion even after the server stops accepting.
    shutdown.shutdown().await;
    Ok(())
}
