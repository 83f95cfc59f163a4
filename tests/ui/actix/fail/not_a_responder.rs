use actix_web::web;
use idempotent_runtime::actix::idempotent;

struct Created;

#[idempotent]
async fn create(_body: web::Bytes) -> Created {
    Created
}

fn main() {}
