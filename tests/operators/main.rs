//! What operators use (DESIGN.md §5 "Admin", §7): the conformance servers' `GET`/`DELETE
//! /admin/records` and `GET /metrics`, and the `idempotent_admin` tool against real stores.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test operators [endpoints::|admin_cli::]
//! ```

#[path = "../support/mod.rs"]
mod support;

#[cfg(all(feature = "postgres", feature = "sqlite"))]
mod admin_cli;
#[cfg(feature = "axum")]
mod endpoints;
