// Both features are on: `State` is axum's, `HttpResponse` actix-web's, so the short path asks.
use actix_web::HttpResponse;
use axum::extract::State;

#[idempotent_runtime::idempotent(require_key)]
async fn create(State(_state): State<u32>) -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {}
