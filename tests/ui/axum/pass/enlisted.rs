use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::{IdempotencyContext, Idempotency};

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

/// The transaction may sit anywhere among the parameters; the last extractor is still wrapped.
#[idempotent(require_key, enlisted, lease = "30s")]
async fn create_order(
    State(_state): State<AppState>,
    tx: &mut EnlistedTx,
    context: IdempotencyContext,
    Json(order): Json<serde_json::Value>,
) -> Result<(StatusCode, String), StatusCode> {
    sqlx::query("INSERT INTO orders (body, request) VALUES ($1, $2)")
        .bind(order.to_string())
        .bind(context.derived_key("order"))
        .execute(tx.conn())
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, order.to_string()))
}

/// Optional key, the transaction last, `Option<IdempotencyContext>`.
#[idempotent(enlisted)]
async fn optional(
    body: String,
    context: Option<IdempotencyContext>,
    tx: &mut EnlistedTx,
) -> StatusCode {
    let _ = (body, context, &mut **tx);
    StatusCode::NO_CONTENT
}

/// No other parameter at all.
#[idempotent(enlisted)]
async fn bare(tx: &mut EnlistedTx) -> StatusCode {
    let _ = tx.conn();
    StatusCode::NO_CONTENT
}

fn main() {
    let _app: Router = Router::new()
        .route("/orders", post(create_order))
        .route("/optional", post(optional))
        .route("/bare", post(bare))
        .with_state(AppState {
            idempotency: Idempotency::memory(),
        });
}
