// Both the `axum` and the `actix` features are on here, and nothing in the handler belongs to
// only one framework (`Json`, `String` are in both), so the short path asks.
use idempotent_runtime::idempotent;

#[idempotent(require_key)]
async fn create(body: String) -> String {
    body
}

fn main() {}
