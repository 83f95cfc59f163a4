//! axum 0.8 integration: the `#[idempotent]` attribute, the [`Idempotent`] extractor it wraps a
//! handler's last parameter in, and [`IdempotencyLayer`] for whole routers.
//!
//! The [`Idempotency`](crate::Idempotency) handle comes from the application state
//! (`Idempotency: FromRef<AppState>`, checked at compile time), or from the request extensions
//! when the handler takes an `Extension<Idempotency>` parameter. The caller's identity is an
//! [`Identity`](crate::scope::Identity) the application's authentication inserts into the request
//! extensions. Authentication runs before the idempotency step, an outer layer in tower terms: a
//! layer added *after* the [`IdempotencyLayer`] (`.route_layer(idempotency).layer(auth)`, so it
//! wraps it; any router layer around an attributed handler), or an extractor before the
//! handler's last parameter. Anonymous callers are scoped by their peer address, so serve with
//! `into_make_service_with_connect_info::<SocketAddr>()`.
//!
//! ```
//! use axum::{Json, Router, extract::State, http::StatusCode, routing::post};
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::axum::idempotent;
//!
//! #[derive(Clone)]
//! struct AppState {
//!     idempotency: Idempotency,
//! }
//!
//! impl axum::extract::FromRef<AppState> for Idempotency {
//!     fn from_ref(state: &AppState) -> Self {
//!         state.idempotency.clone()
//!     }
//! }
//!
//! #[idempotent(require_key, lease = "30s")]
//! async fn create_order(
//!     State(_state): State<AppState>,
//!     Json(order): Json<serde_json::Value>,
//! ) -> (StatusCode, Json<serde_json::Value>) {
//!     (StatusCode::CREATED, Json(order))
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .with_state(AppState { idempotency: Idempotency::memory() });
//! # }
//! ```

mod adapter;
mod caller;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod enlisted;
mod extract;
mod layer;
mod probe;

pub use caller::CallerScope;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite")))
)]
pub use enlisted::EnlistedIdempotent;
pub use extract::Idempotent;
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use probe::ProvidesIdempotency;

/// Makes an axum handler idempotent. See the [crate-level docs](crate) and
/// [`idempotent_macros::idempotent_axum`].
#[doc(inline)]
pub use idempotent_macros::idempotent_axum as idempotent;

/// What `#[idempotent]` expansions for axum name. Not a stable API.
#[doc(hidden)]
pub mod __private {
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub use super::enlisted::EnlistedIdempotent;
    pub use super::extract::{
        FromExtension, FromState, FromStateOf, HandleSource, Idempotent, Via, context_missing,
    };
    pub use super::probe::ProvidesIdempotency;
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub use crate::enlisted::{EnlistedTx, TxDatabase};
    pub use crate::probe::{BodyProbe, NotStreaming, StreamingBody};
    pub use axum::response::Response;

    /// The handler's answer as a response.
    #[inline]
    pub fn into_response<R: axum::response::IntoResponse>(r: R) -> Response {
        r.into_response()
    }
}

#[cfg(test)]
mod tests;
