//! [`CallerScope`]: the caller's scope for the operators' API, resolved as the pipeline does.

use axum::extract::FromRequestParts;
use axum::response::Response;
use http::request::Parts;

use super::adapter::{self, HANDLE_MISSING_FIX, route_of};
use super::extract::{FromState, HandleSource};

/// The caller's scope, resolved exactly as the request pipeline resolves it for a keyed
/// request ([the contract](crate::design) §4): the [`Identity`](crate::scope::Identity) the
/// application published in the request extensions, else the runtime's
/// [resolver](crate::IdempotencyBuilder::resolver), else — for a request that carries no
/// credential header — the peer address, read past the runtime's `trusted_proxies`, under its
/// `anonymous` setting. It is what [`Idempotency::inspect`](crate::Idempotency::inspect) and
/// [`Idempotency::forget`](crate::Idempotency::forget) take, so an operators' route only ever
/// reaches the records the same caller's requests made, and never another caller's.
///
/// The [`Idempotency`](crate::Idempotency) handle is found as [`Idempotent`](super::Idempotent)
/// finds it: from the state (`Idempotency: FromRef<S>`, the default `Src`) or, with
/// `CallerScope<FromExtension>`, from the request extensions. Its rejection is the answer the
/// pipeline would give the same request (500 `IDEMPOTENCY_SCOPE_UNRESOLVED`, or the resolver's
/// own refusal), rendered by the handle's refusal renderer. Put it after the application's
/// authentication, as for the idempotent routes.
///
/// ```
/// use axum::extract::{Path, State};
/// use axum::http::StatusCode;
/// use axum::{Router, routing::delete};
/// use idempotent_runtime::Idempotency;
/// use idempotent_runtime::axum::CallerScope;
///
/// /// `DELETE /admin/records/{key}`: forgets the caller's own record of `key`.
/// async fn forget(
///     State(idempotency): State<Idempotency>,
///     caller: CallerScope,
///     Path(key): Path<String>,
/// ) -> StatusCode {
///     match idempotency.forget(caller.hash(), None, &key).await {
///         Ok(true) => StatusCode::NO_CONTENT,
///         Ok(false) => StatusCode::NOT_FOUND,
///         Err(_) => StatusCode::SERVICE_UNAVAILABLE,
///     }
/// }
///
/// let app: Router = Router::new()
///     .route("/admin/records/{key}", delete(forget))
///     .with_state(Idempotency::memory());
/// ```
pub type CallerScope<Src = FromState> = crate::adapter::CallerScope<Src>;

impl<S, Src> FromRequestParts<S> for CallerScope<Src>
where
    S: Send + Sync,
    Src: HandleSource<S>,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Some(handle) = Src::handle(&parts.extensions, state) else {
            let route = route_of(&parts.extensions);
            return Err(crate::adapter::handle_missing(route, HANDLE_MISSING_FIX));
        };
        let params = adapter::params(parts);
        Self::resolve(&handle, &adapter::head(parts, &params)).await
    }
}
