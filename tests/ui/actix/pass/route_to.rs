//! Handlers registered with `.route().to()`: no parameters, an optional context, `?` and early
//! returns in a `Result` handler.

use actix_web::{App, HttpResponse, error, web};
use idempotent_runtime::actix::idempotent;
use idempotent_runtime::{IdempotencyContext, Idempotency};

#[idempotent]
async fn ping() -> &'static str {
    "pong"
}

#[idempotent]
async fn note(
    context: Option<IdempotencyContext>,
    body: String,
) -> Result<HttpResponse, actix_web::Error> {
    if body.is_empty() {
        return Err(error::ErrorBadRequest("empty"));
    }
    let n: u32 = body.trim().parse().map_err(error::ErrorBadRequest)?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "n": n, "keyed": context.is_some() })))
}

#[idempotent(crate = idempotent_runtime)]
async fn bytes(body: web::Bytes) -> HttpResponse {
    HttpResponse::Ok().body(body)
}

fn main() {
    let _ = App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .route("/ping", web::post().to(ping))
        .route("/notes", web::post().to(note))
        .route("/bytes", web::post().to(bytes));
}
