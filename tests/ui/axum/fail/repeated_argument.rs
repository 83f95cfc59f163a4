use idempotent_runtime::axum::idempotent;

#[idempotent(lease = "30s", lease = "60s")]
async fn create(body: String) -> String {
    body
}

fn main() {}
