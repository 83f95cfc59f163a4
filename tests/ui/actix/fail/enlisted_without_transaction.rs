use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(require_key, enlisted)]
async fn create(body: String) -> HttpResponse {
    HttpResponse::Created().body(body)
}

fn main() {}
