use idempotent_runtime::axum::idempotent;

#[idempotent(max_body = "1.3B")]
async fn create(body: String) -> String {
    body
}

fn main() {}
