use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

// `#[idempotent]` goes above `#[axum::debug_handler]`, which then checks the rewritten handler.
#[idempotent(require_key)]
#[axum::debug_handler]
async fn create(
    State(_store): State<Idempotency>,
    Json(v): Json<serde_json::Value>,
) -> Json<serde_json::Value> {
    Json(v)
}

#[idempotent]
#[axum::debug_handler(state = Idempotency)]
async fn no_parameters() -> &'static str {
    "ok"
}

fn main() {
    let _app: Router = Router::new()
        .route("/create", post(create))
        .route("/none", post(no_parameters))
        .with_state(Idempotency::memory());
}
