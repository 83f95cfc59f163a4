use idempotent_runtime::axum::idempotent;

#[idempotent]
fn create(body: String) -> String {
    body
}

fn main() {}
