use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(require_keys)]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
