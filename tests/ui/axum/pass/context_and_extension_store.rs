use axum::routing::post;
use axum::{Extension, Json, Router};
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::{IdempotencyContext, Idempotency};

// The store comes from the request extensions, so the router needs no state.
#[idempotent(require_key)]
async fn charge(
    Extension(_store): Extension<Idempotency>,
    context: IdempotencyContext,
    Json(amount): Json<u64>,
) -> String {
    format!("{amount} with {}", context.derived_key("charge"))
}

#[idempotent]
async fn maybe(
    context: Option<IdempotencyContext>,
    Extension(_store): Extension<Idempotency>,
) -> String {
    context.map(|c| c.derived_key("note")).unwrap_or_default()
}

fn main() {
    let _app: Router = Router::new()
        .route("/charge", post(charge))
        .route("/maybe", post(maybe))
        .layer(Extension(Idempotency::memory()));
}
