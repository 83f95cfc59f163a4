use actix_web::{HttpResponse, get};
use idempotent_runtime::actix::idempotent;

// `#[get]` above expands first; the attribute still sees it.
#[get("/orders")]
#[idempotent]
async fn list() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
