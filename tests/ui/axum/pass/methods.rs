//! `methods = [...]` on the attribute: PUT and DELETE claimed, beside the default POST and PATCH.

use axum::Router;
use axum::extract::State;
use axum::routing::put;
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key, methods = ["PUT", "DELETE"], lease = "30s")]
async fn replace(State(_store): State<Idempotency>, body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/items", put(replace).delete(replace))
        .with_state(Idempotency::memory());
}
