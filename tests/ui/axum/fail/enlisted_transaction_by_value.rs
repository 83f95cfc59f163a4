use idempotent_runtime::axum::idempotent;
use idempotent_runtime::enlisted::EnlistedTx;

#[idempotent(require_key, enlisted)]
async fn create(tx: EnlistedTx, body: String) -> String {
    drop(tx);
    body
}

fn main() {}
