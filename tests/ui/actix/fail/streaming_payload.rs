use actix_web::{HttpResponse, web};
use idempotent_runtime::actix::idempotent;

#[idempotent(require_key)]
async fn upload(payload: web::Payload) -> HttpResponse {
    drop(payload);
    HttpResponse::Ok().finish()
}

fn main() {}
