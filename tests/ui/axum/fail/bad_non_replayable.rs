use idempotent_runtime::axum::idempotent;

#[idempotent(non_replayable = [404, 503])]
async fn create(body: String) -> String {
    body
}

fn main() {}
