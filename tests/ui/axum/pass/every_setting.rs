//! Every per-route setting on the attribute, in the one grammar (fractions, every unit), and a
//! `pub` handler whose settings type is as public as it is.

use axum::Router;
use axum::routing::post;
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[idempotent(
    require_key,
    lease = "1.5m",
    retention = "7d",
    max_body = "1.5MiB",
    max_response = "64KB",
    oversized = "record_without_body",
    reuse_status = 409,
    failure_mode = "open",
    non_replayable = [401, 403, 404, 429],
    recorded_headers = ["content-type", "location", "x-payment-id"],
    methods = ["POST", "PUT"],
)]
pub async fn charge(body: String) -> String {
    body
}

#[idempotent(reuse_status = 422, failure_mode = "closed", non_replayable = [], recorded_headers = [])]
async fn quote(body: String) -> String {
    body
}

#[idempotent(lease = "500ms", retention = "24h", max_body = "512", max_response = "1GB")]
async fn note(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/charges", post(charge))
        .route("/quotes", post(quote))
        .route("/notes", post(note))
        .with_state(Idempotency::memory());
}
