use axum::Router;
use axum::extract::{Path, Query, State};
use axum::routing::post;
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Page {
    n: u32,
}

#[idempotent(require_key)]
async fn by_path(State(_store): State<Idempotency>, Path(id): Path<u32>) -> String {
    id.to_string()
}

#[idempotent]
async fn by_query(Query(page): Query<Page>) -> String {
    page.n.to_string()
}

fn main() {
    let _app: Router = Router::new()
        .route("/items/{id}", post(by_path))
        .route("/pages", post(by_query))
        .with_state(Idempotency::memory());
}
