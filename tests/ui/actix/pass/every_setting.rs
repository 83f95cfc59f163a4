//! Every per-route setting on the attribute, for actix-web.

use actix_web::{App, HttpResponse, post, web};
use idempotent_runtime::Idempotency;
use idempotent_runtime::actix::idempotent;

#[post("/charges")]
#[idempotent(
    require_key,
    lease = "1.5m",
    retention = "7d",
    max_body = "1.5MiB",
    max_response = "64KB",
    oversized = "record_without_body",
    reuse_status = 409,
    failure_mode = "open",
    non_replayable = [401, 403, 404, 429],
    recorded_headers = ["content-type", "location", "x-payment-id"],
)]
async fn charge(body: web::Json<serde_json::Value>) -> HttpResponse {
    HttpResponse::Created().json(body.into_inner())
}

#[idempotent(reuse_status = 422, failure_mode = "closed", non_replayable = [], recorded_headers = [])]
async fn quote(body: web::Json<serde_json::Value>) -> HttpResponse {
    HttpResponse::Ok().json(body.into_inner())
}

fn main() {
    let _ = App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .service(charge)
        .route("/quotes", web::post().to(quote));
}
