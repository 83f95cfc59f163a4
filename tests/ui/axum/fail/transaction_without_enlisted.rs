use idempotent_runtime::axum::idempotent;
use idempotent_runtime::enlisted::EnlistedTx;

#[idempotent(require_key)]
async fn create(tx: &mut EnlistedTx, body: String) -> String {
    let _ = tx;
    body
}

fn main() {}
