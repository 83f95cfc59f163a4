use idempotent_runtime::axum::idempotent;

#[idempotent(require_key, oversized = "truncate")]
async fn create(body: String) -> String {
    body
}

fn main() {}
