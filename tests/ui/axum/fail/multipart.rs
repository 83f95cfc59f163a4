use axum::extract::Multipart;
use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
async fn upload(mut form: Multipart) -> &'static str {
    let _ = form.next_field().await;
    "ok"
}

fn main() {}
