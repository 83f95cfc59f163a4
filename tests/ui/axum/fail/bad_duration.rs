use idempotent_runtime::axum::idempotent;

#[idempotent(require_key, lease = "30 seconds")]
async fn create(body: String) -> String {
    body
}

fn main() {}
