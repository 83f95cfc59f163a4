use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(max_body = "64kib")]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
