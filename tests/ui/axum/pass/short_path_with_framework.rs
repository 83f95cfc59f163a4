// With both the `axum` and `actix` features on, the short path needs `framework = axum`.
use axum::Router;
use axum::routing::post;
use idempotent_runtime::{Idempotency, idempotent};

#[idempotent(framework = axum, require_key)]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/create", post(create))
        .with_state(Idempotency::memory());
}
