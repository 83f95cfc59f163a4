use axum::extract::State;
use idempotent_runtime::axum::idempotent;

#[derive(Clone)]
struct AppState {
    orders: u32,
}

#[idempotent(require_key)]
async fn create(State(state): State<AppState>, body: String) -> String {
    format!("{} {body}", state.orders)
}

fn main() {
    let _app: axum::Router = axum::Router::new()
        .route("/orders", axum::routing::post(create))
        .with_state(AppState { orders: 0 });
}
