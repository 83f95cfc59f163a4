use axum::Router;
use axum::routing::post;
use idempotent_runtime as rt;

#[rt::axum::idempotent(crate = rt, require_key)]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/create", post(create))
        .with_state(rt::Idempotency::memory());
}
