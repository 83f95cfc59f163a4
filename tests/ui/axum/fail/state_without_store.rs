use axum::extract::State;
use idempotent_runtime::axum::idempotent;

#[derive(Clone)]
struct AppState {
    orders: u32,
}

// The handler's own definition fails, on the state type, naming the missing `FromRef`. Routing
// it (`.route("/orders", post(create))`) adds axum's `Handler` error at `.route()` after this
// one, which names the expansion's extractor type; that one is axum's, so it is left out here.
#[idempotent(require_key)]
async fn create(State(state): State<AppState>, body: String) -> String {
    format!("{} {body}", state.orders)
}

fn main() {}
