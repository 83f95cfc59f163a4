//! What the benchmarks share: the one handler every variant serves (parse a 1 KiB JSON order,
//! serialize it back with 201), the request body, and the routers and apps built around it —
//! bare, behind `#[idempotent]` on each of our stores, and behind the peer crates.
//!
//! Nothing here is published; `benches/inprocess.rs` measures in-process costs and
//! `src/bin/bench_server.rs` serves each variant over HTTP for `scripts/bench`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use idempotent_runtime::Idempotency;
use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
use serde::{Deserialize, Serialize};

/// The route every variant serves.
pub const ROUTE: &str = "/orders";

/// The order a client posts and the handler echoes back.
#[derive(Debug, Serialize, Deserialize)]
pub struct Order {
    /// Who orders.
    pub customer: String,
    /// ISO 4217 code.
    pub currency: String,
    /// Lines of the order.
    pub items: Vec<Item>,
    /// Free text, padded so that the body is exactly [`BODY_LEN`] bytes.
    pub note: String,
}

/// One line of an [`Order`].
#[derive(Debug, Serialize, Deserialize)]
pub struct Item {
    /// Stock-keeping unit.
    pub sku: String,
    /// How many.
    pub quantity: u32,
    /// Price of one, in cents.
    pub unit_price_cents: u64,
}

/// Length of the request body.
pub const BODY_LEN: usize = 1024;

/// The 1 KiB JSON request body every benchmark posts.
pub fn order_body() -> Vec<u8> {
    let mut order = Order {
        customer: "cus_4f1c2a9e7b".into(),
        currency: "EUR".into(),
        items: (0..8)
            .map(|i| Item {
                sku: format!("SKU-{i:04}-BLUE-M"),
                quantity: i + 1,
                unit_price_cents: 1999 + u64::from(i) * 100,
            })
            .collect(),
        note: String::new(),
    };
    let len = serde_json::to_vec(&order).expect("serializes").len();
    order.note = "x".repeat(BODY_LEN.saturating_sub(len));
    let body = serde_json::to_vec(&order).expect("serializes");
    assert_eq!(body.len(), BODY_LEN, "the body must be exactly 1 KiB");
    body
}

/// The handler, bare: what every variant runs.
pub async fn create_order(Json(order): Json<Order>) -> (StatusCode, Json<Order>) {
    (StatusCode::CREATED, Json(order))
}

/// The same handler under `#[idempotent(require_key)]`.
#[idempotent_runtime::axum::idempotent(require_key)]
pub async fn create_order_idempotent(Json(order): Json<Order>) -> (StatusCode, Json<Order>) {
    (StatusCode::CREATED, Json(order))
}

/// The bare axum router.
pub fn bare_router() -> Router {
    Router::new().route(ROUTE, post(create_order))
}

/// The axum router with `#[idempotent]` over `store`.
pub fn idempotent_router(store: Idempotency) -> Router {
    Router::new()
        .route(ROUTE, post(create_order_idempotent))
        .with_state(store)
}

/// A memory store that never refuses for room: a load test from one address is one scope, and
/// it must measure the claim path, not the per-scope quota's refusal.
pub fn unbounded_memory_store() -> Idempotency {
    Idempotency::builder(unbounded_memory())
        .max_buffered_bytes(usize::MAX / 2)
        .build()
}

/// [`unbounded_memory_store`]'s store behind a
/// [`CachedStore`](idempotent_runtime::store::cache::CachedStore) of its defaults: what the cache
/// adds to a request, measured against the same store without it.
pub fn cached_unbounded_memory_store() -> Idempotency {
    Idempotency::builder(idempotent_runtime::store::cache::CachedStore::new(
        unbounded_memory(),
    ))
    .max_buffered_bytes(usize::MAX / 2)
    .build()
}

/// The same memory store with a short `retention`, the steady state of a long-running service
/// when `sweeper` is on (records are freed as fast as they arrive, so the store stops growing);
/// with it off, expired records stay and the store grows as [`unbounded_memory_store`]'s does.
/// Must be called inside a Tokio runtime for the sweeper to start.
pub fn steady_memory_store(retention: Duration, sweeper: bool) -> Idempotency {
    Idempotency::builder(unbounded_memory())
        .config(
            idempotent_runtime::config::Config::builder()
                .retention(retention)
                .build(),
        )
        .sweeper(sweeper)
        .max_buffered_bytes(usize::MAX / 2)
        .build()
}

fn unbounded_memory() -> MemoryStore {
    MemoryStore::builder()
        .limits(MemoryLimits {
            max_records: usize::MAX,
            max_bytes: usize::MAX,
            max_records_per_scope: usize::MAX,
            max_bytes_per_scope: usize::MAX,
            ..MemoryLimits::default()
        })
        .build()
}

/// Our PostgreSQL store at `url`, migrated, with a pool of `connections`; with `cached`, behind
/// a [`CachedStore`](idempotent_runtime::store::cache::CachedStore) of its defaults (what the
/// conformance servers' `--local-cache` builds). Group commit keeps its defaults unless
/// `BENCH_PG_BATCH_ROWS` or `BENCH_PG_BATCHES_IN_FLIGHT` say otherwise (for tuning them).
pub async fn postgres_store(url: &str, connections: u32, cached: bool) -> Idempotency {
    let mut builder =
        idempotent_runtime::store::postgres::PostgresStore::builder().max_connections(connections);
    let setting = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    if let Some(rows) = setting("BENCH_PG_BATCH_ROWS") {
        builder = builder.batch_rows(rows);
    }
    if let Some(n) = setting("BENCH_PG_BATCHES_IN_FLIGHT") {
        builder = builder.batches_in_flight(n);
    }
    let store = builder.connect(url).await.expect("connect to PostgreSQL");
    store.migrate().await.expect("migrate");
    if cached {
        Idempotency::new(idempotent_runtime::store::cache::CachedStore::new(store))
    } else {
        Idempotency::new(store)
    }
}

/// Our SQLite store in the file at `path`, migrated.
pub async fn sqlite_store(path: &str) -> Idempotency {
    let store = idempotent_runtime::store::sqlite::SqliteStore::open(path)
        .await
        .expect("open SQLite");
    store.migrate().await.expect("migrate");
    Idempotency::new(store)
}

/// Our MySQL/MariaDB store at `url`, migrated, with a pool of `connections` (#33).
pub async fn mysql_store(url: &str, connections: u32) -> Idempotency {
    let store = idempotent_runtime::store::mysql::MySqlStore::builder()
        .max_connections(connections)
        .connect(url)
        .await
        .expect("connect to MySQL");
    store.migrate().await.expect("migrate");
    Idempotency::new(store)
}

/// Our Redis store at `url`, under a key prefix of this run's own (records of earlier runs
/// never meet it).
pub async fn redis_store(url: &str) -> Idempotency {
    let prefix = format!(
        "bench-{:016x}",
        idempotent_runtime::store::FencingToken::mint().0
    );
    let store = idempotent_runtime::store::redis::RedisStore::builder()
        .prefix(prefix)
        .connect(url)
        .await
        .expect("connect to Redis");
    Idempotency::new(store)
}

/// The peer `cratestack-axum` + `cratestack-sqlx` (=0.8.15): its `IdempotencyLayer` over its
/// `SqlxIdempotencyStore` on the same PostgreSQL, around the bare router. With `pings` off the
/// pool is set like our store's (no ping before each checkout); on, it is sqlx's default pool,
/// as the peer's documentation builds it, and every statement pays a ping round trip first.
pub async fn cratestack_router(url: &str, connections: u32, pings: bool) -> Router {
    use cratestack_sqlx::sqlx::postgres::PgPoolOptions;
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(pings)
        .connect(url)
        .await
        .expect("connect to PostgreSQL");
    let store = cratestack_sqlx::SqlxIdempotencyStore::new(pool);
    store.ensure_schema().await.expect("cratestack schema");
    bare_router().layer(cratestack_axum::idempotency::IdempotencyLayer::new(
        Arc::new(store),
        Duration::from_secs(24 * 3600),
    ))
}

/// The peer `axum-idempotent` (=0.6.0) keyed by the `Idempotency-Key` header, over its sessions
/// (`ruts`) in a moka memory store, around the bare router. It records only for requests that
/// carry a session cookie (see RESULTS.md).
pub fn axum_idempotent_router() -> Router {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::store::moka::MokaStore;
    use ruts::{CookieOptions, SessionLayer};
    let store = Arc::new(MokaStore::builder().max_capacity(u64::MAX).build());
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("idempotency-key"), true)
        .expire_after(24 * 3600);
    bare_router()
        .layer(IdempotentLayer::<MokaStore>::new(options))
        .layer(
            SessionLayer::new(store).with_cookie_options(
                CookieOptions::build()
                    .name("session")
                    .max_age(24 * 3600)
                    .path("/"),
            ),
        )
        .layer(tower_cookies::CookieManagerLayer::new())
}

/// Serves `router` on `addr` with peer addresses (our anonymous scope and cratestack's default
/// principal both need them; the bare router pays the same).
pub async fn serve_axum(router: Router, addr: SocketAddr) {
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
    println!("listening on {}", listener.local_addr().expect("address"));
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .expect("serve");
}

/// Builds a `POST /orders` request with `body`, an `Idempotency-Key` when `key` is set, and the
/// peer address a server would put there.
pub fn request(body: &'static [u8], key: Option<&str>) -> Request {
    let mut builder = Request::post(ROUTE).header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    let mut request = builder.body(axum::body::Body::from(body)).expect("request");
    request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(SocketAddr::from((
            [127, 0, 0, 1],
            40_000,
        ))));
    request
}

/// actix-web: the handler, bare.
pub async fn actix_create_order(order: actix_web::web::Json<Order>) -> actix_web::HttpResponse {
    actix_web::HttpResponse::Created().json(order.into_inner())
}

/// actix-web: the same handler under `#[idempotent(require_key)]`.
#[idempotent_runtime::actix::idempotent(require_key)]
pub async fn actix_create_order_idempotent(
    order: actix_web::web::Json<Order>,
) -> actix_web::HttpResponse {
    actix_web::HttpResponse::Created().json(order.into_inner())
}
