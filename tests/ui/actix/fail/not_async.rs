use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent]
fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
