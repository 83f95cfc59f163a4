use idempotent_runtime::axum::idempotent;

#[idempotent]
async fn create<T: Send>(body: String) -> String {
    body
}

fn main() {}
