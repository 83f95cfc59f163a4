use idempotent_runtime::axum::idempotent;

#[idempotent(key = "webhook-id")]
async fn create(body: String) -> String {
    body
}

fn main() {}
