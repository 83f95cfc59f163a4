use idempotent_runtime::IdempotencyContext;
use idempotent_runtime::axum::idempotent;

#[idempotent]
async fn create(context: IdempotencyContext, body: String) -> String {
    format!("{} {body}", context.derived_key("x"))
}

fn main() {}
