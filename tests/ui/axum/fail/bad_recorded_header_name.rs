use idempotent_runtime::axum::idempotent;

#[idempotent(recorded_headers = ["x trace"])]
async fn create(body: String) -> String {
    body
}

fn main() {}
