use idempotent_runtime::axum::idempotent;

#[idempotent(recorded_headers = ["content-type", "X-Trace"])]
async fn create(body: String) -> String {
    body
}

fn main() {}
