//! [`CallerScope`]: the caller's scope for the operators' API, resolved as the pipeline does.

use futures_util::future::LocalBoxFuture;

use actix_web::{FromRequest, HttpRequest, dev};

use super::adapter::{ActixHead, HANDLE_MISSING_FIX, failed, handle_of};
use crate::adapter::{self, Head as _};

/// The caller's scope, resolved exactly as the request pipeline resolves it for a keyed
/// request ([the contract](crate::design) §4): the [`Identity`](crate::scope::Identity) the
/// application published in the request extensions, else the runtime's
/// [resolver](crate::IdempotencyBuilder::resolver), else — for a request that carries no
/// credential header — the peer address, read past the runtime's `trusted_proxies`, under its
/// `anonymous` setting. It is what [`Idempotency::inspect`](crate::Idempotency::inspect) and
/// [`Idempotency::forget`](crate::Idempotency::forget) take, so an operators' route only ever
/// reaches the records the same caller's requests made, and never another caller's.
///
/// The [`Idempotency`](crate::Idempotency) handle is the one registered as application data,
/// as `#[idempotent]` finds it. The extractor's error answers what the pipeline would answer
/// the same request (500 `IDEMPOTENCY_SCOPE_UNRESOLVED`, or the resolver's own refusal),
/// rendered by the handle's refusal renderer. As for the idempotent routes, authentication runs
/// before it: a `wrap` around the route, registered after any other.
///
/// ```
/// use actix_web::{App, HttpResponse, delete, web};
/// use idempotent_runtime::Idempotency;
/// use idempotent_runtime::actix::CallerScope;
///
/// /// `DELETE /admin/records/{key}`: forgets the caller's own record of `key`.
/// #[delete("/admin/records/{key}")]
/// async fn forget(
///     idempotency: web::Data<Idempotency>,
///     caller: CallerScope,
///     key: web::Path<String>,
/// ) -> HttpResponse {
///     match idempotency.forget(caller.hash(), None, &key).await {
///         Ok(true) => HttpResponse::NoContent().finish(),
///         Ok(false) => HttpResponse::NotFound().finish(),
///         Err(_) => HttpResponse::ServiceUnavailable().finish(),
///     }
/// }
///
/// # #[actix_web::main] async fn main() {
/// let idempotency = web::Data::new(Idempotency::memory());
/// let app = App::new().app_data(idempotency).service(forget);
/// # let _ = actix_web::test::init_service(app).await;
/// # }
/// ```
pub type CallerScope = adapter::CallerScope;

impl FromRequest for adapter::CallerScope {
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut dev::Payload) -> Self::Future {
        let req = req.clone();
        Box::pin(async move {
            let head = ActixHead::matched(&req);
            let resolved = match handle_of(&req) {
                Some(handle) => Self::resolve(&handle, &head).await,
                None => Err(adapter::handle_missing(
                    head.route().unwrap_or(""),
                    HANDLE_MISSING_FIX,
                )),
            };
            resolved.map_err(|answer| failed("the caller's scope was not resolved", answer))
        })
    }
}
