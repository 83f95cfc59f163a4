use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(recorded_headers = ["Location"])]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
