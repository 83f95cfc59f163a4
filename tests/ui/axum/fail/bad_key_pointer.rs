use idempotent_runtime::axum::idempotent;

#[idempotent(key = body("id"))]
async fn create(body: String) -> String {
    body
}

fn main() {}
