use idempotent_runtime::axum::idempotent;

#[idempotent(lease = "10ms")]
async fn create(body: String) -> String {
    body
}

fn main() {}
