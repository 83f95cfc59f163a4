use idempotent_runtime::axum::idempotent;

#[idempotent(retention = "1.5 h")]
async fn create(body: String) -> String {
    body
}

fn main() {}
