//! Make POST endpoints and message consumers safe to repeat.
//!
//! A client retries a POST that already succeeded, a user double-clicks Pay, a proxy replays a
//! request: with `#[idempotent]` on the handler, the second arrival gets the first one's
//! answer and the handler does not run again. What it promises (status codes, the record's
//! life, fingerprint and scope) is [the contract](design), which ships with the crate.
//!
//! # Two minutes
//!
//! ```toml
//! [dependencies]
//! idempotent-runtime = { version = "0.1", features = ["axum"] } # or "actix"; add "postgres"
//! ```
//!
//! Annotate the handler, give the router the handle, serve with the peer address:
//!
//! ```no_run
//! # #[cfg(feature = "axum")] mod m {
//! use axum::{Json, Router, extract::State, http::StatusCode, routing::post};
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::axum::idempotent; // `idempotent_runtime::idempotent` with one framework
//!
//! #[derive(Clone)]
//! struct App {
//!     idempotency: Idempotency,
//! }
//!
//! impl axum::extract::FromRef<App> for Idempotency {
//!     fn from_ref(app: &App) -> Self {
//!         app.idempotency.clone()
//!     }
//! }
//!
//! #[idempotent(require_key)]
//! async fn create_order(State(_app): State<App>, Json(order): Json<serde_json::Value>)
//!     -> (StatusCode, Json<serde_json::Value>) {
//!     (StatusCode::CREATED, Json(order)) // runs once per Idempotency-Key
//! }
//!
//! fn router() -> Router {
//!     Router::new()
//!         .route("/orders", post(create_order))
//!         .with_state(App { idempotency: Idempotency::memory() })
//! }
//! // Serve it with the peer address, which scopes anonymous callers:
//! // axum::serve(listener, router().into_make_service_with_connect_info::<SocketAddr>())
//! # }
//! ```
//!
//! A retry with the same `Idempotency-Key` gets the recorded answer with
//! `Idempotency-Replayed: true`; a different body under that key is 422; a duplicate while the
//! first runs is 409.
//!
//! # Where authentication goes
//!
//! Records are scoped by the caller's [`Identity`](scope::Identity), which your authentication inserts into the
//! request extensions. Authentication runs before the idempotency step, an outer layer in tower
//! terms: on axum a layer added *after* the `axum::IdempotencyLayer` (so it wraps it), on
//! actix-web a `wrap` registered after the `actix::IdempotencyMiddleware`, or, with the
//! attribute, an extractor before the handler's last parameter. A request with an `Authorization` header and no
//! published identity is refused (500 `IDEMPOTENCY_SCOPE_UNRESOLVED`), never scoped as anonymous.
//!
//! # Map
//!
//! - [`axum`] and [`actix`]: the attribute, the router-level layer / middleware (features
//!   `axum`, `actix`);
//! - [`Idempotency`]: the handle your application shares; [`config`]: settings;
//! - [`store`]: the memory store (default), PostgreSQL, SQLite and Redis (features `postgres`,
//!   `sqlite`, `redis`), and a cache of completed records in front of shared ones;
//! - [`enlisted`]: the record committed in the handler's own PostgreSQL, MySQL or SQLite transaction;
//! - [`inbox`]: de-duplicating message consumers;
//! - [`scope`], [`fingerprint`], [`key`], [`problem`]: who the caller is, what "the same request"
//!   means, the key's syntax, the refusals;
//! - [`observe`]: counters, audit; [`adapter`]: the request sequence every framework adapter calls.
//! - [`openapi`]: the key header and the refusals in a utoipa 5 document (feature `utoipa`).
//!
//! The core modules know no web framework; the `axum` and `actix` features add the integrations.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![forbid(unsafe_code)]
#![deny(unreachable_pub)]

#[cfg(feature = "actix")]
#[cfg_attr(docsrs, doc(cfg(feature = "actix")))]
pub mod actix;
pub mod adapter;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod axum;
mod budget;
pub mod clock;
pub mod config;
mod context;
pub mod design;
mod digest;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite")))
)]
pub mod enlisted;
pub mod fingerprint;
mod handle;
pub mod inbox;
pub mod key;
pub mod observe;
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub mod once;
#[cfg(feature = "utoipa")]
#[cfg_attr(docsrs, doc(cfg(feature = "utoipa")))]
pub mod openapi;
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "nats",
    feature = "rabbitmq",
    feature = "outbox-webhooks"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "postgres",
        feature = "mysql",
        feature = "nats",
        feature = "rabbitmq",
        feature = "outbox-webhooks"
    )))
)]
pub mod outbox;
mod pipeline;
mod probe;
pub mod problem;
mod record;
mod reservation;
pub mod scope;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod sql;
pub mod store;
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub mod tonic;
mod watch;
#[cfg(feature = "webhooks")]
#[cfg_attr(docsrs, doc(cfg(feature = "webhooks")))]
pub mod webhook;

pub use context::IdempotencyContext;
pub use handle::{Idempotency, IdempotencyBuilder};
pub use pipeline::REPLAYED_HEADER;

#[doc(hidden)]
pub mod __private;
/// What the crate's own benches, fuzz targets and integration tests reach past the public API
/// for (feature `testing`, hidden, as axum's `test_helpers`): not part of the API, no semver.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod test_helpers;
#[cfg(test)]
mod testlog;

/// `#[idempotent]` for the one framework that is enabled (here: axum). Libraries should name
/// `idempotent_runtime::axum::idempotent`, which does not depend on which other features are on.
#[cfg(all(feature = "axum", not(feature = "actix")))]
#[doc(inline)]
pub use idempotent_macros::idempotent_axum as idempotent;

/// `#[idempotent]` when both the `axum` and `actix` features are on (cargo unifies features
/// across a workspace): each handler's framework is told from its own tokens (`State`,
/// `impl IntoResponse` are axum's; `web::Json`, `HttpResponse`, an actix route attribute are
/// actix-web's; the full rules are on [`idempotent_macros::idempotent_select`]), and
/// `framework = axum|actix` decides where they cannot (a compile error says so).
#[cfg(all(feature = "axum", feature = "actix"))]
#[doc(inline)]
pub use idempotent_macros::idempotent_select as idempotent;

/// `#[idempotent]` for the one framework that is enabled (here: actix-web). Libraries should name
/// `idempotent_runtime::actix::idempotent`, which does not depend on which other features are on.
#[cfg(all(feature = "actix", not(feature = "axum")))]
#[doc(inline)]
pub use idempotent_macros::idempotent_actix as idempotent;
