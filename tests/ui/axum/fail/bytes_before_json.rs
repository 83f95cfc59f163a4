use axum::Json;
use axum::body::Bytes;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
async fn create(raw: Bytes, Json(order): Json<serde_json::Value>) -> String {
    format!("{} {order}", raw.len())
}

fn main() {}
