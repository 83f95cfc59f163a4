use actix_web::{FromRequest, HttpResponse};
use idempotent_runtime::actix::idempotent;

#[idempotent]
async fn create<T: FromRequest>(value: T) -> HttpResponse {
    drop(value);
    HttpResponse::Ok().finish()
}

fn main() {}
