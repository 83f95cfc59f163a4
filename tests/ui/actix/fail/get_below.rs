use actix_web::{HttpResponse, get};
use idempotent_runtime::actix::idempotent;

// GET is idempotent by HTTP semantics: the attribute would never apply.
#[idempotent(require_key)]
#[get("/orders")]
async fn list() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
