//! `#[post]` above `#[idempotent]`: the route macro re-emits the function inside its factory.

use actix_web::{App, HttpResponse, post, web};
use idempotent_runtime::Idempotency;
use idempotent_runtime::actix::idempotent;

#[post("/orders")]
#[idempotent(require_key, lease = "30s", retention = "24h", max_body = "64KiB")]
async fn create(body: web::Json<serde_json::Value>) -> HttpResponse {
    HttpResponse::Created().json(body.into_inner())
}

fn main() {
    let _ = App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .service(create);
}
