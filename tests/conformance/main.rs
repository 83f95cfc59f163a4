//! The conformance servers' promises over real HTTP, against every server in
//! [`support::SERVERS`] (DESIGN.md §2–§4, ../shared/CONFORMANCE.md): the black-box suite (also
//! on Redis, MySQL, and PostgreSQL behind PgBouncer), no response replayed to another scope, and the edge cases a new user's requests
//! met (a layered route's unserved method, two `Content-Type` lines, a broken body, both SQLite
//! URL forms, a saturated enlisted pool).
//!
//! ```text
//! cargo test --all-features --test conformance [suite::|cross_scope::|edge_cases::]
//! PGBOUNCER_URL=$(scripts/pgbouncer start) DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test conformance suite::on_pgbouncer::
//! ```

#[path = "../support/mod.rs"]
mod support;

mod cross_scope;
#[cfg(feature = "postgres")]
mod edge_cases;
#[cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod enlisted_ledger;
mod suite;
