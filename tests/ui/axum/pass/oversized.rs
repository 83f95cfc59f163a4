//! `oversized` on the attribute, both values.

use axum::Router;
use axum::routing::post;
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key, max_response = "64KiB", oversized = "record_without_body")]
async fn charge(body: String) -> String {
    body
}

#[idempotent(oversized = "run_again")]
async fn quote(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/charges", post(charge))
        .route("/quotes", post(quote))
        .with_state(Idempotency::memory());
}
