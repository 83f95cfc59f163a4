use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(retention = "30")]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
