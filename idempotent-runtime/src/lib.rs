//! Make POST endpoints and message consumers safe to repeat.
//!
//! A client retries a POST that already succeeded, a user double-clicks Pay, a proxy replays a
//! request: with `#[idempotent]` on the handler, the second arrival gets the first one's
//! answer and the handler does not run again. The contract (status codes, the record's life,
//! fingerprint and scope) is the one in the repository's DESIGN.md.
//!
//! The core modules know no web framework; the `axum` and `actix` features add the integrations.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

pub mod clock;
pub mod config;
pub mod context;
pub mod fingerprint;
pub mod inbox;
pub mod key;
pub mod observe;
pub mod problem;
pub mod record;
pub mod runtime;
pub mod scope;
pub mod store;

pub use config::{Config, EndpointConfig};
pub use context::IdempotencyContext;
pub use runtime::IdempotencyStore;
pub use scope::{ClientId, Identity};
