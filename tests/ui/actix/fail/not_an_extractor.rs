use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

struct Order;

#[idempotent(require_key)]
async fn create(order: Order) -> HttpResponse {
    drop(order);
    HttpResponse::Ok().finish()
}

fn main() {}
