//! `#[tracing::instrument]` below `#[idempotent]` stays on the user's function, which keeps its
//! name: its fields name the handler's parameters, a bare one records them with `Debug`, and
//! the span is named after the handler.

use axum::extract::{Path, State};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
#[tracing::instrument(skip_all, fields(shop = %shop))]
async fn create(
    State(_store): State<Idempotency>,
    Path(shop): Path<String>,
    Json(order): Json<serde_json::Value>,
) -> Json<serde_json::Value> {
    tracing::info!("creating");
    Json(order)
}

/// Documented, linted and instrumented with every parameter recorded.
#[idempotent]
#[allow(clippy::needless_pass_by_value)]
#[tracing::instrument]
async fn bare(Json(order): Json<serde_json::Value>) -> String {
    order.to_string()
}

fn main() {
    let _app: Router = Router::new()
        .route("/shops/{shop}/orders", post(create))
        .route("/bare", post(bare))
        .with_state(Idempotency::memory());
}
