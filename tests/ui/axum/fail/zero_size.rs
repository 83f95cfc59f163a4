use idempotent_runtime::axum::idempotent;

#[idempotent(max_response = "0KiB")]
async fn create(body: String) -> String {
    body
}

fn main() {}
