use actix_web::HttpResponse;
use idempotent_runtime::actix::idempotent;

#[idempotent(non_replayable = [101])]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
