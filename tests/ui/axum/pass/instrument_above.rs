//! `#[tracing::instrument]` above `#[idempotent]` expands first, on the function as written.

use axum::extract::{Path, State};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[tracing::instrument(skip_all, fields(shop = %shop))]
#[idempotent(require_key)]
async fn create(
    State(_store): State<Idempotency>,
    Path(shop): Path<String>,
    Json(order): Json<serde_json::Value>,
) -> Json<serde_json::Value> {
    tracing::info!("creating");
    Json(order)
}

fn main() {
    let _app: Router = Router::new()
        .route("/shops/{shop}/orders", post(create))
        .with_state(Idempotency::memory());
}
