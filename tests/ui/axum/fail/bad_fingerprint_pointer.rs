use idempotent_runtime::axum::idempotent;

#[idempotent(fingerprint = ["/amount", "currency"])]
async fn create(body: String) -> String {
    body
}

fn main() {}
