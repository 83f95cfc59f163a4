use actix_web::HttpResponse;

#[idempotent_runtime::idempotent(require_key)]
async fn create() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
