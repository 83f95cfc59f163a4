//! What the `#[idempotent]` expansions name, through `::idempotent_runtime::__private::…` (or
//! the `crate = path` argument). Not a stable API: it changes with the macros, which are pinned
//! to this exact version.

pub use crate::config::EndpointConfig;

pub use crate::probe::{BodyProbe, NotStreaming, StreamingBody};

/// The axum expansion's helpers.
#[cfg(feature = "axum")]
pub mod axum {
    pub use crate::axum::__private::*;
}

/// The actix-web expansion's helpers.
#[cfg(feature = "actix")]
pub mod actix {
    pub use crate::actix::__private::*;
}
