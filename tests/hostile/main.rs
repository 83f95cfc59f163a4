//! Hostile callers against every conformance server, over raw HTTP/1.1 with a deadline on every
//! read: hostile input (keys, headers, bodies, quotas), a scope that floods or lies about who it
//! is, and idle connections announcing large bodies. The cases that do not depend on the memory
//! store run again with every server on `--store mysql` (`on_mysql::`).
//!
//! ```text
//! cargo test --all-features --test hostile [input::|fair_scope::|idle_bodies::]
//! ```

#[path = "../support/mod.rs"]
mod support;

mod fair_scope;
#[cfg(feature = "actix")]
mod idle_bodies;
mod input;
