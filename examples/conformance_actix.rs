//! The conformance server on actix-web (../shared/CONFORMANCE.md): every behaviour of the
//! contract over real HTTP, for black-box checkers.
//!
//! ```text
//! cargo run --release --example conformance_actix -- --addr 127.0.0.1:0
//! ```
//!
//! Every route takes the store from the application data (`web::Data<Idempotency>`).
//! `/orders` (attribute above `#[post]`), `/slow` (attribute below `#[post]`), `/notes`,
//! `/status` and `/panic` (attribute with `.route().to()`) use the attribute;
//! `/shops/{shop}/orders` (a scope) and `/search` (a resource) sit behind
//! `IdempotencyMiddleware`; `/big` has both, and the attribute steps aside. `/metrics` is the
//! Prometheus scrape; `/admin/records?key=K` inspects (GET) and forgets (DELETE) the caller's
//! own record. `/webhooks/standard` reads its key from the `webhook-id` header after a
//! middleware checked the signature; `/events` reads its key from the body and fingerprints two
//! of its fields.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{StatusCode, header};
use actix_web::{
    App, HttpMessage, HttpRequest, HttpResponse, HttpServer, Responder, get, post, web,
};
use idempotent_examples::admin;
use idempotent_examples::conformance::{self, Executions, Options, RunLog, identity, init_logging};
use idempotent_runtime::actix::{CallerScope, IdempotencyMiddleware, idempotent};
use idempotent_runtime::{Idempotency, IdempotencyContext, config::EndpointConfig};
use metrics_exporter_prometheus::PrometheusHandle;

#[path = "support/prometheus.rs"]
mod prometheus;
use serde::Deserialize;
use serde_json::{Value, json};

struct AppState {
    executions: Executions,
    run_log: RunLog,
    orders: Mutex<HashMap<u64, Value>>,
}

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
    quantity: i64,
}

#[idempotent(require_key)]
#[post("/orders")]
async fn create_order(
    state: web::Data<AppState>,
    context: IdempotencyContext,
    order: web::Json<NewOrder>,
) -> HttpResponse {
    let n = state.executions.next("/orders");
    state.run_log.record(context.key().as_str());
    tracing::debug!(derived_key = %context.derived_key("orders"), "creating an order");
    if order.quantity < 1 {
        return HttpResponse::UnprocessableEntity()
            .json(json!({"error": "quantity must be positive", "execution": n}));
    }
    let body = json!({"id": n, "sku": order.sku, "quantity": order.quantity, "execution": n});
    state
        .orders
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(n, body.clone());
    HttpResponse::Created()
        .insert_header((header::LOCATION, format!("/orders/{n}")))
        .insert_header((header::SET_COOKIE, format!("seen={n}")))
        .json(body)
}

#[get("/orders/{id}")]
async fn get_order(state: web::Data<AppState>, id: web::Path<u64>) -> HttpResponse {
    let orders = state.orders.lock().unwrap_or_else(|p| p.into_inner());
    match orders.get(&id) {
        Some(order) => HttpResponse::Ok().json(order),
        None => HttpResponse::NotFound().finish(),
    }
}

#[idempotent]
async fn create_note(state: web::Data<AppState>, _note: web::Json<Value>) -> impl Responder {
    let n = state.executions.next("/notes");
    HttpResponse::Created().json(json!({"execution": n}))
}

async fn create_shop_order(
    state: web::Data<AppState>,
    shop: web::Path<String>,
    _order: web::Json<Value>,
) -> HttpResponse {
    let n = state.executions.next("/shops/{shop}/orders");
    HttpResponse::Created().json(json!({"shop": shop.into_inner(), "execution": n}))
}

#[derive(Deserialize)]
struct Slow {
    #[serde(default)]
    ms: u64,
}

#[post("/slow")]
#[idempotent(require_key)]
async fn slow(state: web::Data<AppState>, slow: web::Query<Slow>) -> HttpResponse {
    let n = state.executions.next("/slow");
    tokio::time::sleep(Duration::from_millis(slow.ms)).await;
    HttpResponse::Created().json(json!({"execution": n}))
}

#[derive(Deserialize)]
struct Status {
    code: u16,
}

#[idempotent(require_key)]
async fn status(state: web::Data<AppState>, status: web::Query<Status>) -> HttpResponse {
    let n = state.executions.next("/status");
    let code = StatusCode::from_u16(status.code).unwrap_or(StatusCode::BAD_REQUEST);
    HttpResponse::build(code).json(json!({"execution": n}))
}

/// `POST /webhooks/standard`: a Standard Webhooks receiver. The delivery id (`webhook-id`) is
/// the key; the signature is checked by a middleware on the resource ([`verify_delivery`])
/// that publishes the provider as the caller, so a forged delivery claims nothing.
#[idempotent(require_key, key = header("webhook-id"))]
async fn standard_webhook(state: web::Data<AppState>, _event: web::Json<Value>) -> HttpResponse {
    let n = state.executions.next("/webhooks/standard");
    HttpResponse::Ok().json(json!({"execution": n}))
}

/// Checks a delivery's signature over its body, then puts the body back for the handler.
async fn verify_delivery(
    mut req: ServiceRequest,
    next: actix_web::middleware::Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let max_body = req
        .app_data::<web::Data<Idempotency>>()
        .map_or(1 << 20, |handle| handle.config().max_body());
    let payload = req.take_payload();
    let headers = req.headers().clone();
    let header = |name: &str| headers.get(name).map(|v| v.as_bytes());
    let (body, provider) = match conformance::verify_delivery(payload, max_body, header).await {
        Ok(verified) => verified,
        Err(status) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
            let response = HttpResponse::build(status).finish();
            return Ok(req.into_response(response).map_into_right_body());
        }
    };
    req.extensions_mut().insert(provider);
    req.set_payload(actix_web::dev::Payload::from(body));
    Ok(next.call(req).await?.map_into_left_body())
}

/// `POST /events`: a Stripe-style receiver. The key is the event's `id` in the body; retries are
/// compared by `/type` and `/data` only, so a redelivery with another envelope replays.
#[idempotent(require_key, key = body("/id"), fingerprint = ["/type", "/data"])]
async fn event(state: web::Data<AppState>, _event: web::Json<Value>) -> HttpResponse {
    let n = state.executions.next("/events");
    HttpResponse::Ok().json(json!({"execution": n}))
}

#[derive(Deserialize)]
struct Big {
    bytes: usize,
}

/// Streamed in chunks with no declared length, so the recorder meets a body of unknown size.
#[idempotent(require_key)]
async fn big(state: web::Data<AppState>, big: web::Query<Big>) -> HttpResponse {
    state.executions.next("/big");
    const CHUNK: usize = 8 * 1024;
    let total = big.bytes;
    let chunks = (0..total.div_ceil(CHUNK)).map(move |i| {
        let len = CHUNK.min(total - i * CHUNK);
        Ok::<_, std::convert::Infallible>(web::Bytes::from(vec![b'a'; len]))
    });
    HttpResponse::Ok()
        .content_type("application/octet-stream")
        .streaming(futures_util::stream::iter(chunks))
}

#[idempotent(require_key)]
async fn panic(state: web::Data<AppState>) -> HttpResponse {
    state.executions.next("/panic");
    panic!("the /panic endpoint panics on purpose");
}

async fn search(state: web::Data<AppState>, req: HttpRequest) -> HttpResponse {
    let n = state.executions.next("/search");
    HttpResponse::Ok().json(json!({"query": req.query_string(), "execution": n}))
}

/// `POST /ledger?ms=N` and `GET /ledger` (the PostgreSQL, MySQL and SQLite stores): an enlisted
/// handler writing a row through the request's transaction, one per database (a handler's
/// `EnlistedTx` names its database), and the committed rows.
#[cfg(feature = "postgres")]
mod ledger {
    use super::*;
    use idempotent_examples::conformance::ledger::{self, Ledger};
    use idempotent_runtime::enlisted::EnlistedTx;

    /// The pool `GET /ledger` reads with; `None` for a store without SQL transactions.
    pub(super) struct LedgerPool(pub(super) Option<Ledger>);

    fn reply((status, body): (u16, Value)) -> HttpResponse {
        let status = StatusCode::from_u16(status).expect("a status the ledger answers");
        HttpResponse::build(status).json(body)
    }

    /// PostgreSQL's, and the one other stores route to (it answers 500
    /// `IDEMPOTENCY_STORE_NOT_ENLISTABLE` there).
    #[idempotent(require_key, enlisted)]
    async fn write(
        state: web::Data<AppState>,
        tx: &mut EnlistedTx,
        hold: web::Query<Slow>,
    ) -> HttpResponse {
        let n = state.executions.next("/ledger");
        let inserted = ledger::insert(tx.conn(), n).await;
        reply(ledger::answer(n, inserted, hold.ms).await)
    }

    #[cfg(feature = "mysql")]
    #[idempotent(require_key, enlisted)]
    async fn write_mysql(
        state: web::Data<AppState>,
        tx: &mut EnlistedTx<sqlx::MySql>,
        hold: web::Query<Slow>,
    ) -> HttpResponse {
        let n = state.executions.next("/ledger");
        let inserted = ledger::insert_mysql(tx.conn(), n).await;
        reply(ledger::answer(n, inserted, hold.ms).await)
    }

    #[cfg(feature = "sqlite")]
    #[idempotent(require_key, enlisted)]
    async fn write_sqlite(
        state: web::Data<AppState>,
        tx: &mut EnlistedTx<sqlx::Sqlite>,
        hold: web::Query<Slow>,
    ) -> HttpResponse {
        let n = state.executions.next("/ledger");
        let inserted = ledger::insert_sqlite(tx.conn(), n).await;
        reply(ledger::answer(n, inserted, hold.ms).await)
    }

    async fn rows(pool: web::Data<LedgerPool>) -> HttpResponse {
        let Some(ledger) = &pool.0 else {
            return HttpResponse::NotFound().finish();
        };
        match ledger::rows(ledger).await {
            Ok(rows) => HttpResponse::Ok().json(rows),
            Err(error) => HttpResponse::ServiceUnavailable().body(error.to_string()),
        }
    }

    pub(super) fn routes(
        store: idempotent_examples::conformance::StoreKind,
        pool: web::Data<LedgerPool>,
    ) -> impl FnOnce(&mut web::ServiceConfig) {
        move |config| {
            let write = match store {
                #[cfg(feature = "mysql")]
                idempotent_examples::conformance::StoreKind::Mysql => web::post().to(write_mysql),
                #[cfg(feature = "sqlite")]
                idempotent_examples::conformance::StoreKind::Sqlite => web::post().to(write_sqlite),
                _ => web::post().to(write),
            };
            config.service(
                web::resource("/ledger")
                    .app_data(pool)
                    .route(write)
                    .route(web::get().to(rows)),
            );
        }
    }
}

#[get("/executions")]
async fn executions(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(state.executions.snapshot())
}

#[get("/metrics")]
async fn scrape(
    handle: web::Data<PrometheusHandle>,
    idempotency: web::Data<Idempotency>,
) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(prometheus::CONTENT_TYPE)
        .body(prometheus::render(&handle, &idempotency))
}

#[derive(Deserialize)]
struct RecordQuery {
    key: String,
    route: Option<String>,
}

/// `GET` and `DELETE /admin/records?key=K`: the record of `K` in the caller's own scope, the
/// caller resolved by the runtime exactly as for its idempotent requests (`CallerScope`).
async fn admin_record(
    req: HttpRequest,
    caller: CallerScope,
    idempotency: web::Data<Idempotency>,
    query: web::Query<RecordQuery>,
) -> HttpResponse {
    let route = query.route.as_deref();
    if req.method() == actix_web::http::Method::DELETE {
        return match idempotency.forget(caller.hash(), route, &query.key).await {
            Ok(true) => HttpResponse::NoContent().finish(),
            Ok(false) => HttpResponse::NotFound().finish(),
            Err(_) => HttpResponse::ServiceUnavailable().finish(),
        };
    }
    match idempotency
        .inspect(caller.hash(), route, &query.key, false)
        .await
    {
        Ok(Some(info)) => HttpResponse::Ok().json(admin::record_json(&info)),
        Ok(None) => HttpResponse::NotFound().finish(),
        Err(_) => HttpResponse::ServiceUnavailable().finish(),
    }
}

/// The conformance identity rules: `Bearer <tenant>:<subject>` (with an `X-Api-Key` beside it),
/// published here; a malformed `Authorization` is 401 before any idempotency step. `X-Api-Key`
/// alone is left to the runtime's resolver (`Options::resolver`), so both ways of stating an
/// identity are exercised.
async fn authenticate(
    req: ServiceRequest,
    next: actix_web::middleware::Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let headers = req.headers();
    let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let api_key = headers.get("x-api-key").map(|v| v.as_bytes());
    if authorization.is_none() {
        return Ok(next.call(req).await?.map_into_left_body());
    }
    match identity(authorization, api_key) {
        Ok(Some(identity)) => {
            req.extensions_mut().insert(identity);
        }
        Ok(None) => {}
        Err(()) => {
            let response = HttpResponse::Unauthorized().finish();
            return Ok(req.into_response(response).map_into_right_body());
        }
    }
    Ok(next.call(req).await?.map_into_left_body())
}

#[actix_web::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    init_logging();
    let options = match Options::from_env() {
        Ok(options) => options,
        Err(usage) => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let metrics = web::Data::new(prometheus::install());
    let idempotency = web::Data::new(options.idempotency().await?);
    let state = web::Data::new(AppState {
        executions: Executions::default(),
        run_log: RunLog::from_env(),
        orders: Mutex::default(),
    });
    // actix's own JSON limit is a second cap beside max_body; keep it above, so max_body wins.
    let json_limit = options.max_body.max(2 << 20);

    #[cfg(feature = "postgres")]
    let store = options.store;
    #[cfg(feature = "postgres")]
    let ledger_pool = web::Data::new(ledger::LedgerPool(
        idempotent_examples::conformance::ledger::open(&options).await?,
    ));

    let grace = idempotency.config().shutdown_grace().as_secs();
    let server = {
        let idempotency = idempotency.clone();
        HttpServer::new(move || {
            let app = App::new()
                .app_data(idempotency.clone())
                .app_data(state.clone())
                .app_data(metrics.clone())
                .app_data(web::JsonConfig::default().limit(json_limit))
                .wrap(actix_web::middleware::from_fn(authenticate))
                .service(create_order)
                .service(get_order)
                .service(slow)
                .service(executions)
                .service(scrape)
                .service(
                    web::resource("/admin/records")
                        .route(web::get().to(admin_record))
                        .route(web::delete().to(admin_record)),
                )
                .route("/notes", web::post().to(create_note))
                .route("/status", web::post().to(status))
                .route("/panic", web::post().to(panic))
                .route("/events", web::post().to(event))
                .service(
                    web::resource("/webhooks/standard")
                        .wrap(actix_web::middleware::from_fn(verify_delivery))
                        .route(web::post().to(standard_webhook)),
                )
                .service(
                    web::resource("/big")
                        .wrap(IdempotencyMiddleware::new().endpoint(EndpointConfig::REQUIRED))
                        .route(web::post().to(big)),
                )
                .service(
                    web::resource("/search")
                        .wrap(IdempotencyMiddleware::new().endpoint(EndpointConfig::REQUIRED))
                        .route(web::post().to(search)),
                )
                .service(
                    web::scope("/shops")
                        .wrap(IdempotencyMiddleware::new().endpoint(EndpointConfig::REQUIRED))
                        .route("/{shop}/orders", web::post().to(create_shop_order)),
                );
            #[cfg(feature = "postgres")]
            let app = app.configure(ledger::routes(store, ledger_pool.clone()));
            app
        })
        .workers(2)
        .shutdown_timeout(grace)
        .bind(options.addr)?
    };
    let addr = server.addrs()[0];
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{addr}")?;
    stdout.flush()?;
    drop(stdout);
    // actix-web's server stops gracefully on SIGTERM and SIGINT by itself.
    server.run().await?;
    idempotency.shutdown().await;
    Ok(())
}
