use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(failure_mode = "closd")]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
