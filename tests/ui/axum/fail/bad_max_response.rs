use idempotent_runtime::axum::idempotent;

#[idempotent(max_response = "1mb")]
async fn create(body: String) -> String {
    body
}

fn main() {}
