use idempotent_runtime::axum::idempotent;

#[idempotent(failure_mode = "fail_open")]
async fn create(body: String) -> String {
    body
}

fn main() {}
