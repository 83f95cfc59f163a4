//! Make POST endpoints and message consumers safe to repeat.
//!
//! A client retries a POST that already succeeded, a user double-clicks Pay, a proxy replays a
//! request: with `#[idempotent]` on the handler, the second arrival gets the first one's
//! answer and the handler does not run again. What it promises (status codes, the record's
//! life, fingerprint and scope) is [the contract](design), which ships with the crate.
//!
//! The core modules know no web framework; the `axum` and `actix` features add the integrations.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

#[cfg(feature = "actix")]
#[cfg_attr(docsrs, doc(cfg(feature = "actix")))]
pub mod actix;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod axum;
mod budget;
pub mod clock;
pub mod config;
pub mod context;
pub mod design;
mod digest;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod enlisted;
pub mod fingerprint;
pub mod handle;
pub mod inbox;
pub mod key;
pub mod observe;
pub mod pipeline;
pub mod problem;
pub mod record;
pub mod reservation;
pub mod scope;
pub mod store;

pub use config::{Config, EndpointConfig};
pub use context::IdempotencyContext;
pub use handle::Idempotency;
pub use pipeline::REPLAYED_HEADER;
pub use scope::{ClientId, Identity};

#[doc(hidden)]
pub mod __private;
#[cfg(test)]
mod testlog;

/// `#[idempotent]` for the one framework that is enabled (here: axum). Libraries should name
/// `idempotent_runtime::axum::idempotent`, which does not depend on which other features are on.
#[cfg(all(feature = "axum", not(feature = "actix")))]
#[doc(inline)]
pub use idempotent_macros::idempotent_axum as idempotent;

/// `#[idempotent]` when both the `axum` and `actix` features are on: it needs
/// `framework = axum|actix` and says so in a compile error otherwise.
#[cfg(all(feature = "axum", feature = "actix"))]
#[doc(inline)]
pub use idempotent_macros::idempotent_select as idempotent;

/// `#[idempotent]` for the one framework that is enabled (here: actix-web). Libraries should name
/// `idempotent_runtime::actix::idempotent`, which does not depend on which other features are on.
#[cfg(all(feature = "actix", not(feature = "axum")))]
#[doc(inline)]
pub use idempotent_macros::idempotent_actix as idempotent;
