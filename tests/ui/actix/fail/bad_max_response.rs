use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(max_response = "0B")]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
