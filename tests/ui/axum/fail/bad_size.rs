use idempotent_runtime::axum::idempotent;

#[idempotent(max_body = "64kb")]
async fn create(body: String) -> String {
    body
}

fn main() {}
