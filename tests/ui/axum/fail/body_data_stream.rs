use axum::body::BodyDataStream;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
async fn upload(stream: BodyDataStream) -> &'static str {
    let _ = stream;
    "ok"
}

fn main() {}
