use idempotent_runtime::axum::idempotent;

#[idempotent(require_key = true)]
async fn create(body: String) -> String {
    body
}

fn main() {}
