//! `oversized` on the attribute, for actix-web.

use actix_web::{App, HttpResponse, post, web};
use idempotent_runtime::Idempotency;
use idempotent_runtime::actix::idempotent;

#[post("/charges")]
#[idempotent(require_key, max_response = "64KiB", oversized = "record_without_body")]
async fn charge(body: web::Json<serde_json::Value>) -> HttpResponse {
    HttpResponse::Created().json(body.into_inner())
}

#[idempotent(oversized = "run_again")]
async fn quote(body: web::Json<serde_json::Value>) -> HttpResponse {
    HttpResponse::Ok().json(body.into_inner())
}

fn main() {
    let _ = App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .service(charge)
        .route("/quotes", web::post().to(quote));
}
