use axum::Router;
use axum::routing::post;
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
async fn ping() -> &'static str {
    "pong"
}

fn main() {
    let _app: Router = Router::new()
        .route("/ping", post(ping))
        .with_state(Idempotency::memory());
}
