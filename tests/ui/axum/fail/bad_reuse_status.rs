use idempotent_runtime::axum::idempotent;

#[idempotent(reuse_status = 418)]
async fn create(body: String) -> String {
    body
}

fn main() {}
