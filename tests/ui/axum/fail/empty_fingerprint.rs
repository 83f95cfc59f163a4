use idempotent_runtime::axum::idempotent;

#[idempotent(fingerprint = [])]
async fn create(body: String) -> String {
    body
}

fn main() {}
