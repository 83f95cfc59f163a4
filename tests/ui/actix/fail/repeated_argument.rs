use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(require_key, lease = "30s", require_key)]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
