use axum::Router;
use axum::routing::post;
use idempotent_runtime::axum::idempotent;

#[derive(Clone)]
struct AppState {
    orders: u32,
}

// The handler names no `State`, so it takes the handle from the router's state, which here
// cannot give it (no `FromRef<AppState> for Idempotency`): refused at `post(create)` with the
// fix, not with rustc's "expected `Idempotency`, found `AppState`" at `.with_state`.
#[idempotent(require_key)]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/orders", post(create))
        .with_state(AppState { orders: 0 });
}
