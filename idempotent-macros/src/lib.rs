//! Implementation detail of `idempotent-runtime`: the `#[idempotent]` attribute.
//!
//! Depend on `idempotent-runtime` and use `idempotent_runtime::idempotent`; this crate's API is
//! not stable on its own.
