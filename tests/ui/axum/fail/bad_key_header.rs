use idempotent_runtime::axum::idempotent;

#[idempotent(key = header("x delivery"))]
async fn create(body: String) -> String {
    body
}

fn main() {}
