use axum::extract::FromRequest;
use idempotent_runtime::axum::idempotent;

#[idempotent]
async fn create(value: impl FromRequest<()>) -> &'static str {
    drop(value);
    "ok"
}

fn main() {}
