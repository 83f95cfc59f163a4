use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;
use serde::Deserialize;

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
}

/// Docs and other attributes are kept.
#[idempotent(
    require_key,
    lease = "30s",
    retention = "24h",
    max_body = "64KiB",
    max_response = "1MiB"
)]
async fn create_order(
    State(_state): State<AppState>,
    Json(NewOrder { sku }): Json<NewOrder>,
) -> (StatusCode, String) {
    (StatusCode::CREATED, sku)
}

#[idempotent]
pub(crate) async fn optional(State(_state): State<AppState>, body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/orders", post(create_order))
        .route("/optional", post(optional))
        .with_state(AppState {
            idempotency: Idempotency::memory(),
        });
}
