//! `methods = [...]` on the attribute, under an actix `#[put]`.

use actix_web::{App, HttpResponse, put, web};
use idempotent_runtime::Idempotency;
use idempotent_runtime::actix::idempotent;

#[put("/items/{id}")]
#[idempotent(require_key, methods = ["PUT"])]
async fn replace(id: web::Path<u32>, body: web::Bytes) -> HttpResponse {
    HttpResponse::Ok().body(format!("{id} {}", body.len()))
}

fn main() {
    let _ = App::new()
        .app_data(web::Data::new(Idempotency::memory()))
        .service(replace);
}
