use actix_web::{FromRequest, HttpResponse};
use idempotent_runtime::actix::idempotent;

#[idempotent]
async fn create(value: impl FromRequest) -> HttpResponse {
    drop(value);
    HttpResponse::Ok().finish()
}

fn main() {}
