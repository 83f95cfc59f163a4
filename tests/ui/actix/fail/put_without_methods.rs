use actix_web::{HttpResponse, put, web};
use idempotent_runtime::actix::idempotent;

// The attribute applies to POST and PATCH unless `methods = [...]` says otherwise.
#[put("/items/{id}")]
#[idempotent(require_key)]
async fn replace(id: web::Path<u32>) -> HttpResponse {
    HttpResponse::Ok().body(id.to_string())
}

fn main() {}
