use idempotent_runtime::axum::idempotent;

// GET is safe: repeating it changes nothing, so it always passes through.
#[idempotent(require_key, methods = ["POST", "GET"])]
async fn create(body: String) -> String {
    body
}

fn main() {}
