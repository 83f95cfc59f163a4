use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(framework = axum)]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
