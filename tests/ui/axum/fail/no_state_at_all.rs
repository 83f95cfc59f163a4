use axum::Router;
use axum::routing::post;
use idempotent_runtime::axum::idempotent;

// The handler names no `State` and the router has none: the handle is nowhere to be found.
#[idempotent(require_key)]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new().route("/orders", post(create));
}
