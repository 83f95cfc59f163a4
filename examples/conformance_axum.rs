//! The conformance server on axum (../shared/CONFORMANCE.md): every behaviour of the contract
//! over real HTTP, for black-box checkers.
//!
//! ```text
//! cargo run --release --example conformance_axum -- --addr 127.0.0.1:0
//! ```
//!
//! `/orders` and `/status` take the store from the application state (`FromRef`); `/notes`,
//! `/shops/{shop}/orders`, `/slow` and `/panic` from the request extensions
//! (`Extension<Idempotency>`); `/search` and `/big` sit behind `IdempotencyLayer` (and
//! `/big` also carries the attribute, which steps aside). `/webhooks/standard` reads its key from
//! the `webhook-id` header after a route layer checked the signature; `/events` reads its key
//! from the body and fingerprints two of its fields. `/metrics` is the Prometheus scrape;
//! `/admin/records?key=K` inspects (GET) and forgets (DELETE) the caller's own record.

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRef, Path, Query, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idempotent_examples::admin;
use idempotent_examples::conformance::{
    self, Executions, Options, RunLog, identity, init_logging, shutdown_signal,
};
use idempotent_runtime::axum::{CallerScope, IdempotencyLayer, idempotent};
use idempotent_runtime::{Idempotency, IdempotencyContext, config::EndpointConfig};
use metrics_exporter_prometheus::PrometheusHandle;

#[path = "support/prometheus.rs"]
mod prometheus;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
    executions: Arc<Executions>,
    run_log: Arc<RunLog>,
    orders: Arc<Mutex<HashMap<u64, Value>>>,
    metrics: PrometheusHandle,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
    quantity: i64,
}

#[idempotent(require_key)]
async fn create_order(
    State(state): State<AppState>,
    context: IdempotencyContext,
    Json(order): Json<NewOrder>,
) -> Response {
    let n = state.executions.next("/orders");
    state.run_log.record(context.key().as_str());
    tracing::debug!(derived_key = %context.derived_key("orders"), "creating an order");
    if order.quantity < 1 {
        let body = json!({"error": "quantity must be positive", "execution": n});
        return (StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response();
    }
    let body = json!({"id": n, "sku": order.sku, "quantity": order.quantity, "execution": n});
    state
        .orders
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(n, body.clone());
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/orders/{n}")),
            (header::SET_COOKIE, format!("seen={n}")),
        ],
        Json(body),
    )
        .into_response()
}

async fn get_order(State(state): State<AppState>, Path(id): Path<u64>) -> Response {
    let orders = state.orders.lock().unwrap_or_else(|p| p.into_inner());
    match orders.get(&id) {
        Some(order) => Json(order.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[idempotent]
async fn create_note(
    Extension(_store): Extension<Idempotency>,
    State(state): State<AppState>,
    Json(_note): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = state.executions.next("/notes");
    (StatusCode::CREATED, Json(json!({"execution": n})))
}

#[idempotent(require_key)]
async fn create_shop_order(
    Extension(_store): Extension<Idempotency>,
    State(state): State<AppState>,
    Path(shop): Path<String>,
    Json(_order): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = state.executions.next("/shops/{shop}/orders");
    (
        StatusCode::CREATED,
        Json(json!({"shop": shop, "execution": n})),
    )
}

#[derive(Deserialize)]
struct Slow {
    #[serde(default)]
    ms: u64,
}

#[idempotent(require_key)]
async fn slow(
    Extension(_store): Extension<Idempotency>,
    State(state): State<AppState>,
    Query(slow): Query<Slow>,
) -> (StatusCode, Json<Value>) {
    let n = state.executions.next("/slow");
    tokio::time::sleep(Duration::from_millis(slow.ms)).await;
    (StatusCode::CREATED, Json(json!({"execution": n})))
}

#[derive(Deserialize)]
struct Status {
    code: u16,
}

#[idempotent(require_key)]
async fn status(State(state): State<AppState>, Query(status): Query<Status>) -> Response {
    let n = state.executions.next("/status");
    let code = StatusCode::from_u16(status.code).unwrap_or(StatusCode::BAD_REQUEST);
    (code, Json(json!({"execution": n}))).into_response()
}

#[derive(Deserialize)]
struct Big {
    bytes: usize,
}

/// Streamed in chunks with no declared length, so the recorder meets a body of unknown size.
#[idempotent(require_key)]
async fn big(State(state): State<AppState>, Query(big): Query<Big>) -> Response {
    state.executions.next("/big");
    const CHUNK: usize = 8 * 1024;
    let chunks = (0..big.bytes.div_ceil(CHUNK)).map(move |i| {
        let len = CHUNK.min(big.bytes - i * CHUNK);
        Ok::<_, std::convert::Infallible>(vec![b'a'; len])
    });
    let body = Body::from_stream(futures_util::stream::iter(chunks));
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        )],
        body,
    )
        .into_response()
}

#[idempotent(require_key)]
async fn panic(
    Extension(_store): Extension<Idempotency>,
    State(state): State<AppState>,
) -> StatusCode {
    state.executions.next("/panic");
    panic!("the /panic endpoint panics on purpose");
}

async fn search(State(state): State<AppState>, RawQuery(query): RawQuery) -> Json<Value> {
    let n = state.executions.next("/search");
    Json(json!({"query": query.unwrap_or_default(), "execution": n}))
}

/// `POST /ledger?ms=N` and `GET /ledger` (the PostgreSQL, MySQL and SQLite stores): an enlisted
/// handler writing a row through the request's transaction, one per database (a handler's
/// `EnlistedTx` names its database), and the committed rows.
#[cfg(feature = "postgres")]
mod ledger {
    use super::*;
    use idempotent_examples::conformance::Options;
    use idempotent_examples::conformance::ledger::{self, Ledger};
    use idempotent_runtime::enlisted::EnlistedTx;

    #[derive(Clone)]
    pub(super) struct LedgerState {
        pub(super) idempotency: Idempotency,
        pub(super) executions: Arc<Executions>,
        pub(super) ledger: Option<Ledger>,
    }

    impl FromRef<LedgerState> for Idempotency {
        fn from_ref(state: &LedgerState) -> Self {
            state.idempotency.clone()
        }
    }

    fn reply((status, body): (u16, Value)) -> Response {
        let status = StatusCode::from_u16(status).expect("a status the ledger answers");
        (status, Json(body)).into_response()
    }

    /// PostgreSQL's, and the one other stores route to (it answers 500
    /// `IDEMPOTENCY_STORE_NOT_ENLISTABLE` there).
    #[idempotent(require_key, enlisted)]
    async fn write(
        State(state): State<LedgerState>,
        tx: &mut EnlistedTx,
        Query(slow): Query<Slow>,
    ) -> Response {
        let n = state.executions.next("/ledger");
        let inserted = ledger::insert(tx.conn(), n).await;
        reply(ledger::answer(n, inserted, slow.ms).await)
    }

    #[cfg(feature = "mysql")]
    #[idempotent(require_key, enlisted)]
    async fn write_mysql(
        State(state): State<LedgerState>,
        tx: &mut EnlistedTx<sqlx::MySql>,
        Query(slow): Query<Slow>,
    ) -> Response {
        let n = state.executions.next("/ledger");
        let inserted = ledger::insert_mysql(tx.conn(), n).await;
        reply(ledger::answer(n, inserted, slow.ms).await)
    }

    #[cfg(feature = "sqlite")]
    #[idempotent(require_key, enlisted)]
    async fn write_sqlite(
        State(state): State<LedgerState>,
        tx: &mut EnlistedTx<sqlx::Sqlite>,
        Query(slow): Query<Slow>,
    ) -> Response {
        let n = state.executions.next("/ledger");
        let inserted = ledger::insert_sqlite(tx.conn(), n).await;
        reply(ledger::answer(n, inserted, slow.ms).await)
    }

    async fn rows(State(state): State<LedgerState>) -> Response {
        let Some(ledger) = &state.ledger else {
            return StatusCode::NOT_FOUND.into_response();
        };
        match ledger::rows(ledger).await {
            Ok(rows) => Json(rows).into_response(),
            Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
        }
    }

    pub(super) fn routes<S>(options: &Options, state: LedgerState) -> Router<S> {
        let write = match options.store {
            #[cfg(feature = "mysql")]
            idempotent_examples::conformance::StoreKind::Mysql => post(write_mysql),
            #[cfg(feature = "sqlite")]
            idempotent_examples::conformance::StoreKind::Sqlite => post(write_sqlite),
            _ => post(write),
        };
        Router::new()
            .route("/ledger", write.get(rows))
            .with_state(state)
    }
}

/// `POST /webhooks/standard`: a Standard Webhooks receiver. The delivery id (`webhook-id`) is
/// the key; the signature is checked before the idempotency step ([`verify_delivery`]), which
/// publishes the provider as the caller, so a forged delivery claims nothing.
#[idempotent(require_key, key = header("webhook-id"))]
async fn standard_webhook(
    State(state): State<AppState>,
    Json(_event): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = state.executions.next("/webhooks/standard");
    (StatusCode::OK, Json(json!({"execution": n})))
}

/// Checks a delivery's signature over its body, then hands the body on (a route layer, so it
/// runs before the handler's extractors and the idempotency step among them).
async fn verify_delivery(State(max_body): State<usize>, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let header = |name: &str| parts.headers.get(name).map(HeaderValue::as_bytes);
    let delivery = conformance::verify_delivery(body.into_data_stream(), max_body, header);
    let (body, provider) = match delivery.await {
        Ok(verified) => verified,
        Err(status) => {
            return StatusCode::from_u16(status)
                .unwrap_or(StatusCode::BAD_REQUEST)
                .into_response();
        }
    };
    parts.extensions.insert(provider);
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// `POST /events`: a Stripe-style receiver. The key is the event's `id` in the body; retries are
/// compared by `/type` and `/data` only, so a redelivery with another envelope (a new
/// `created` time, say) replays.
#[idempotent(require_key, key = body("/id"), fingerprint = ["/type", "/data"])]
async fn event(
    State(state): State<AppState>,
    Json(_event): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = state.executions.next("/events");
    (StatusCode::OK, Json(json!({"execution": n})))
}

async fn executions(State(state): State<AppState>) -> Json<Value> {
    Json(state.executions.snapshot())
}

async fn scrape(State(state): State<AppState>) -> Response {
    let text = prometheus::render(&state.metrics, &state.idempotency);
    ([(header::CONTENT_TYPE, prometheus::CONTENT_TYPE)], text).into_response()
}

#[derive(Deserialize)]
struct RecordQuery {
    key: String,
    route: Option<String>,
}

/// `GET` and `DELETE /admin/records?key=K`: the record of `K` in the caller's own scope, the
/// caller resolved by the runtime exactly as for its idempotent requests (`CallerScope`).
async fn admin_record(
    State(state): State<AppState>,
    caller: CallerScope,
    method: Method,
    Query(query): Query<RecordQuery>,
) -> Response {
    let (idempotency, route) = (&state.idempotency, query.route.as_deref());
    if method == Method::DELETE {
        return match idempotency.forget(caller.hash(), route, &query.key).await {
            Ok(true) => StatusCode::NO_CONTENT.into_response(),
            Ok(false) => StatusCode::NOT_FOUND.into_response(),
            Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        };
    }
    match idempotency
        .inspect(caller.hash(), route, &query.key, false)
        .await
    {
        Ok(Some(info)) => Json(admin::record_json(&info)).into_response(),
        Ok(None) => StatusCode::NOT_FOUND.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// The conformance identity rules: `Bearer <tenant>:<subject>` (with an `X-Api-Key` beside it),
/// published here; a malformed `Authorization` is 401 before any idempotency step. `X-Api-Key`
/// alone is left to the runtime's resolver (`Options::resolver`), so both ways of stating an
/// identity are exercised.
async fn authenticate(headers: HeaderMap, mut request: Request, next: Next) -> Response {
    let Some(authorization) = headers.get(header::AUTHORIZATION) else {
        return next.run(request).await;
    };
    let authorization = Some(authorization.as_bytes());
    let api_key = headers.get("x-api-key").map(HeaderValue::as_bytes);
    match identity(authorization, api_key) {
        Ok(Some(identity)) => {
            request.extensions_mut().insert(identity);
        }
        Ok(None) => {}
        Err(()) => return StatusCode::UNAUTHORIZED.into_response(),
    }
    next.run(request).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    init_logging();
    let options = match Options::from_env() {
        Ok(options) => options,
        Err(usage) => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let metrics = prometheus::install();
    let idempotency = options.idempotency().await?;
    let state = AppState {
        idempotency: idempotency.clone(),
        executions: Arc::default(),
        run_log: Arc::new(RunLog::from_env()),
        orders: Arc::default(),
        metrics,
    };
    #[cfg(feature = "postgres")]
    let ledger = ledger::routes(
        &options,
        ledger::LedgerState {
            idempotency: idempotency.clone(),
            executions: Arc::clone(&state.executions),
            ledger: idempotent_examples::conformance::ledger::open(&options).await?,
        },
    );
    #[cfg(not(feature = "postgres"))]
    let ledger = Router::new();
    let layered = Router::new()
        .route("/search", post(search))
        .route("/big", post(big))
        .route_layer(IdempotencyLayer::new(idempotency.clone()).endpoint(EndpointConfig::REQUIRED));
    let webhooks = Router::new()
        .route("/webhooks/standard", post(standard_webhook))
        .route_layer(middleware::from_fn_with_state(
            options.max_body,
            verify_delivery,
        ));
    let app = Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .route("/notes", post(create_note))
        .route("/shops/{shop}/orders", post(create_shop_order))
        .route("/slow", post(slow))
        .route("/status", post(status))
        .route("/panic", post(panic))
        .route("/events", post(event))
        .merge(webhooks)
        .route("/executions", get(executions))
        .route("/metrics", get(scrape))
        .route("/admin/records", get(admin_record).delete(admin_record))
        .merge(layered)
        .merge(ledger)
        .layer(Extension(idempotency.clone()))
        .layer(middleware::from_fn(authenticate))
        .with_state(state);

    let listener = tokio::net::TcpListener::bind(options.addr).await?;
    let addr = listener.local_addr()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{addr}")?;
    stdout.flush()?;
    drop(stdout);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown_signal())
    .await?;
    idempotency.shutdown().await;
    Ok(())
}
