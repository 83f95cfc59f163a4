use axum::Router;
use axum::routing::post;
use idempotent_runtime::axum::{IdempotencyLayer, idempotent};
use idempotent_runtime::config::Methods;
use idempotent_runtime::{IdempotencyContext, Idempotency, config::EndpointConfig};

async fn plain(context: IdempotencyContext) -> String {
    context.derived_key("plain")
}

// Where the layer applies, the attribute steps aside.
#[idempotent(require_key)]
async fn both(body: String) -> String {
    body
}

fn main() {
    let store = Idempotency::memory();
    let _app: Router = Router::new()
        .route("/plain", post(plain))
        .route("/both", post(both))
        .layer(
            IdempotencyLayer::new(store.clone())
                .endpoint(EndpointConfig::REQUIRED.methods(Methods::POST.with(Methods::PUT))),
        )
        .with_state(store);
}
