use axum::body::Body;
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
async fn upload(body: axum::body::Body) -> &'static str {
    let _ = body;
    "ok"
}

fn main() {
    let _ = Body::empty();
    let _app: axum::Router = axum::Router::new()
        .route("/upload", axum::routing::post(upload))
        .with_state(Idempotency::memory());
}
