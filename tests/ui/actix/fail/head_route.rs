use actix_web::{HttpResponse, route};
use idempotent_runtime::actix::idempotent;

#[idempotent]
#[route("/orders", method = "GET", method = "HEAD")]
async fn list() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
