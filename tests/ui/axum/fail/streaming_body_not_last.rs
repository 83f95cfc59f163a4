use axum::body::Body;
use idempotent_runtime::axum::idempotent;

// Every extractor is probed, not only the last one.
#[idempotent(require_key)]
async fn upload(body: Body, name: String) -> String {
    let _ = body;
    name
}

fn main() {}
