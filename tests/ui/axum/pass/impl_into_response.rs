use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;

struct ApiError;

impl IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        StatusCode::CONFLICT.into_response()
    }
}

fn parse(v: &serde_json::Value) -> Result<u64, ApiError> {
    v.as_u64().ok_or(ApiError)
}

#[idempotent(require_key)]
async fn create(
    State(_s): State<Idempotency>,
    Json(v): Json<serde_json::Value>,
) -> Result<impl IntoResponse, ApiError> {
    let n = parse(&v)?;
    if n == 0 {
        return Err(ApiError);
    }
    Ok((StatusCode::CREATED, Json(n)))
}

#[idempotent]
async fn opaque(mut body: String) -> impl IntoResponse {
    body.push('!');
    body
}

fn main() {
    let _app: Router = Router::new()
        .route("/create", post(create))
        .route("/opaque", post(opaque))
        .with_state(Idempotency::memory());
}
