// Both the `axum` and the `actix` features are on here, so the short path cannot guess.
use idempotent_runtime::idempotent;

#[idempotent(require_key)]
async fn create(body: String) -> String {
    body
}

fn main() {}
