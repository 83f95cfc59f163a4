use actix_web::{HttpResponse, web};
use idempotent_runtime::actix::idempotent;

type Upload = web::Payload;

#[idempotent(require_key)]
async fn upload(payload: Upload) -> HttpResponse {
    drop(payload);
    HttpResponse::Ok().finish()
}

fn main() {}
