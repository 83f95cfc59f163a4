use idempotent_runtime::axum::idempotent;

#[idempotent(require_key, retries = 3)]
async fn create(body: String) -> String {
    body
}

fn main() {}
