//! Internals the crate's benches (`benches/core.rs`), fuzz targets and integration tests drive
//! directly. Hidden and behind the `testing` feature: nothing here is public API or covered by
//! semver; users reach the same behaviour through [`Idempotency`](crate::Idempotency) and the
//! framework modules.

/// The record's claim loop over a store, and what it decides (the store tests check the SQL
/// stores' round trips through it).
pub mod record {
    pub use crate::record::{Verdict, claim};
}

/// The framework-free start of a request (the core bench measures a first request and a
/// replay through it).
pub mod pipeline {
    pub use crate::pipeline::claim::{Begin, BeginRequest, begin};
}
