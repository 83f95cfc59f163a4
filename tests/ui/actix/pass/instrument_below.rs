//! `#[tracing::instrument]` below `#[idempotent]` stays on the user's function: its fields name
//! the handler's parameters.

use actix_web::{HttpResponse, post, web};
use idempotent_runtime::Idempotency;
use idempotent_runtime::actix::idempotent;

#[idempotent(require_key)]
#[post("/shops/{shop}/orders")]
#[tracing::instrument(skip_all, fields(shop = %shop))]
async fn create(shop: web::Path<String>, body: web::Json<serde_json::Value>) -> HttpResponse {
    tracing::info!("creating");
    HttpResponse::Created().json(body.into_inner())
}

fn main() {
    let _ = actix_web::App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .service(create);
}
