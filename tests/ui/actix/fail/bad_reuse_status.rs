use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(reuse_status = 400)]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
