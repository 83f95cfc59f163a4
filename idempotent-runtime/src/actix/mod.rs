//! actix-web 4 integration: the `#[idempotent]` attribute for handlers and
//! [`IdempotencyMiddleware`] for whole scopes.
//!
//! Register the handle once as application data; both read it from there:
//!
//! ```
//! use actix_web::{App, HttpResponse, Responder, post, web};
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::actix::idempotent;
//!
//! #[idempotent(require_key)]
//! #[post("/orders")]
//! async fn create_order(order: web::Json<serde_json::Value>) -> impl Responder {
//!     HttpResponse::Created().json(serde_json::json!({ "sku": order["sku"] }))
//! }
//!
//! # #[actix_web::main] async fn main() {
//! let idempotency = web::Data::new(Idempotency::memory());
//! let app = App::new().app_data(idempotency.clone()).service(create_order);
//! # let _ = actix_web::test::init_service(app).await;
//! // after the server stopped: let claimed handlers finish
//! idempotency.shutdown().await;
//! # }
//! ```
//!
//! The attribute works above or below a route macro (`#[post("/x")]`), and on handlers
//! registered with `.route("/x", web::post().to(handler))`. It rewrites the handler to take the
//! request and its raw payload. It checks the key, reads the body (bounded), then runs each of
//! the handler's own extractors on the buffered body, in order, as they would run without the
//! attribute: before the claim and on replays too, so an authentication extractor still
//! rejects a caller, whatever was recorded. Then it resolves the scope and claims the key, and
//! runs the handler in a task of its own: a client that disconnects does not cancel a claimed
//! handler. An extractor's rejection with a recordable status (malformed JSON, say) is recorded
//! like any 4xx; one that is not (401, 403, 5xx) is answered without claiming the key.
//! `IdempotencyContext` and `Option<IdempotencyContext>` parameters are filled by the runtime
//! after the claim.
//!
//! # Shutdown
//!
//! Call [`Idempotency::shutdown`](crate::Idempotency::shutdown) after the server
//! stopped. actix-web's graceful shutdown waits for requests whose client is still connected
//! (`HttpServer::shutdown_timeout`, which should match `shutdown_grace`), then stops its workers;
//! a claimed handler whose client had already gone is cancelled with its worker, like a crash:
//! its key frees itself when the lease lapses, and the retry then runs it again (counted as
//! `reclaimed`).
//!
//! # Which body cap wins
//!
//! `max_body` (the runtime's setting, or the attribute's `max_body = "…"`) is checked first,
//! while the body is read and before the key is claimed: a larger body gets 413
//! `IDEMPOTENCY_PAYLOAD_TOO_LARGE` and claims nothing. actix's own `PayloadConfig` and
//! `JsonConfig` limits apply afterwards, when the handler's extractors run on the buffered body;
//! their rejection (413 from actix) is then the handler's recorded response. Keep `max_body` at
//! or below those limits so that `max_body` is the one clients meet. Under
//! [`IdempotencyMiddleware`] the same holds, with the middleware's endpoint settings.
//!
//! # Identity
//!
//! The scope is built from an [`Identity`](crate::scope::Identity) in the request extensions
//! (`req.extensions_mut().insert(identity)`). Authentication runs before the idempotency step,
//! an outer layer in tower terms: a `wrap` registered *after* the scope's
//! [`IdempotencyMiddleware`] (actix runs the last-registered `wrap` first), an App-level `wrap`
//! around an attributed handler, or, with the attribute, an authentication extractor before the
//! handler's last parameter. A request that carries `Authorization` without a published
//! identity is refused (500 `IDEMPOTENCY_SCOPE_UNRESOLVED`); anonymous callers are scoped by
//! `peer_addr().ip()` (behind `trusted_proxies`, by `X-Forwarded-For`).

use std::future::{Ready, ready};

use actix_web::{FromRequest, HttpMessage, HttpRequest, dev};

use crate::context::IdempotencyContext;

mod adapter;
mod caller;
mod handler;
mod middleware;
#[cfg(test)]
mod tests;

pub use caller::CallerScope;
pub use middleware::{IdempotencyMiddleware, IdempotencyService};

/// What a `#[idempotent]` handler returns: every actix-web [`Responder`](actix_web::Responder)
/// whose body can be boxed. Implement `Responder` for your type, never this trait; it exists
/// so a handler returning something else fails on its return type with that fix.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an actix-web `Responder`, so #[idempotent] cannot answer with it",
    label = "the handler's return type must implement `actix_web::Responder`",
    note = "return `HttpResponse` (or `impl Responder`), or implement `actix_web::Responder` for `{Self}`"
)]
pub trait HandlerResponse {
    /// The handler's return value as a response.
    #[doc(hidden)]
    fn respond(self, req: &HttpRequest) -> actix_web::HttpResponse;
}

// The impl's bounds are actix-web's; they would lead the reader away from the fix.
#[diagnostic::do_not_recommend]
impl<R> HandlerResponse for R
where
    R: actix_web::Responder,
    R::Body: actix_web::body::MessageBody + 'static,
{
    fn respond(self, req: &HttpRequest) -> actix_web::HttpResponse {
        self.respond_to(req).map_into_boxed_body()
    }
}

/// Makes an actix-web handler idempotent. See the [module documentation](self).
///
/// Arguments: `require_key`; `lease = "30s"`, `retention = "24h"`, `max_body = "64KiB"`,
/// `max_response = "1MiB"`; `oversized = "record_without_body"`, `reuse_status = 409`,
/// `failure_mode = "open"`, `non_replayable = [401, 404]`, `recorded_headers = ["content-type"]`;
/// `methods = ["POST", "PUT"]` (default POST and PATCH); `crate = path`
/// for a renamed dependency; `enlisted` (PostgreSQL: the handler takes `&mut EnlistedTx`, see
/// `idempotent_runtime::enlisted`).
pub use idempotent_macros::idempotent_actix as idempotent;

/// Available in a handler behind `#[idempotent]` or [`IdempotencyMiddleware`] for requests
/// that carry a key. Take `Option<IdempotencyContext>` on endpoints where the key is optional.
impl FromRequest for IdempotencyContext {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut dev::Payload) -> Self::Future {
        let context = req.extensions().get::<IdempotencyContext>().cloned();
        let message = "this request has no idempotency context";
        ready(context.ok_or_else(|| adapter::failed(message, crate::adapter::context_missing())))
    }
}

/// What `#[idempotent]` expansions call. Not a stable API.
#[doc(hidden)]
pub mod __private {
    use actix_web::HttpResponse;

    pub use super::handler::handle;
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub use super::handler::handle_enlisted;
    pub use crate::context::IdempotencyContext as Context;
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub use crate::enlisted::EnlistedTx;
    pub use crate::probe::{BodyProbe, NotStreaming, StreamingBody};
    pub use actix_web::dev::Payload as RawPayload;
    pub use actix_web::web::Payload;
    pub use actix_web::{FromRequest, HttpRequest as Request, HttpResponse as Response};

    /// The answer when a handler takes `IdempotencyContext` and the request has none (a
    /// keyless request let through by an outer middleware whose key is optional).
    pub fn context_missing() -> HttpResponse {
        crate::adapter::context_missing()
    }

    /// An extractor's rejection as the handler's response.
    pub fn rejection<E: Into<actix_web::Error>>(error: E) -> HttpResponse {
        HttpResponse::from_error(error)
    }

    pub use super::HandlerResponse;
}
