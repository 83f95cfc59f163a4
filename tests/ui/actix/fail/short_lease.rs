use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(lease = "10ms")]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
