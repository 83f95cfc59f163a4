use actix_web::HttpResponse;
use idempotent_runtime::IdempotencyContext;
use idempotent_runtime::actix::idempotent;

#[idempotent]
async fn create(context: IdempotencyContext) -> HttpResponse {
    HttpResponse::Ok().body(context.derived_key("charge"))
}

fn main() {}
