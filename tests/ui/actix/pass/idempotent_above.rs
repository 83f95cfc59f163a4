//! `#[idempotent]` above `#[post]`: the route attribute is re-emitted unchanged.

use actix_web::{App, HttpResponse, Responder, post, web};
use idempotent_runtime::actix::idempotent;
use idempotent_runtime::{IdempotencyContext, Idempotency};

#[derive(serde::Deserialize)]
struct NewOrder {
    sku: String,
}

/// Documented handler.
#[idempotent(require_key, max_response = "1MiB")]
#[post("/shops/{shop}/orders")]
async fn create(
    shop: web::Path<String>,
    context: IdempotencyContext,
    web::Json(order): web::Json<NewOrder>,
) -> impl Responder {
    let _ = context.derived_key("charge");
    HttpResponse::Created().json(serde_json::json!({ "shop": shop.into_inner(), "sku": order.sku }))
}

fn main() {
    let _ = App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .service(create);
}
