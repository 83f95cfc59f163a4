use idempotent_runtime::axum::idempotent;

#[idempotent(require_key)]
async fn upload(form: Option<axum::extract::Multipart>) -> &'static str {
    let _ = form;
    "ok"
}

fn main() {}
