use axum::Router;
use axum::routing::post;
use idempotent_runtime::axum::idempotent;

#[derive(Clone)]
struct AppState {
    orders: u32,
}

// The handler names no `State`, so the handle comes from the router's state through
// `Idempotency: FromRef<S>`, and the only such state the compiler knows is the handle itself:
// the error is rustc's "expected `Idempotency`, found `AppState`" at `.with_state`, which a
// macro cannot reword. The attribute's docs say what it means (take `State<AppState>` with
// `impl FromRef<AppState> for Idempotency`, or `.with_state(idempotency)`); this case records
// the error so a better one shows up in review.
#[idempotent(require_key)]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/orders", post(create))
        .with_state(AppState { orders: 0 });
}
