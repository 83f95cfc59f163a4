use idempotent_runtime::axum::idempotent;

#[idempotent(wait_in_progress = "soon")]
async fn create(body: String) -> String {
    body
}

fn main() {}
