//! Where the key comes from (a header of the endpoint's own, or a JSON Pointer into the body),
//! what the fingerprint covers, and the wait instead of 409: written on the attribute, and a
//! header name in any case.

use axum::Router;
use axum::routing::post;
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key, key = header("X-GitHub-Delivery"))]
async fn github(body: String) -> String {
    body
}

#[idempotent(
    require_key,
    key = body("/id"),
    fingerprint = ["/type", "/data/object/amount", "/a~1b"],
    wait_in_progress = "2.5s",
)]
pub async fn stripe(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/github", post(github))
        .route("/stripe", post(stripe))
        .with_state(Idempotency::memory());
}
