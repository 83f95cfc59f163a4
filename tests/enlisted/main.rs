//! Enlisted mode over real HTTP (DESIGN.md §5): the recorded response commits with the
//! handler's own writes or neither remains, under crashes, duplicates and rollbacks, and under
//! slow bodies and swallowed database errors.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test enlisted [transactions::|hostile_callers::|pgbouncer::]
//! ```

#[path = "../support/mod.rs"]
mod support;

mod hostile_callers;
#[cfg(all(feature = "mysql", feature = "sqlite"))]
mod other_databases;
mod pgbouncer;
#[cfg(feature = "actix")]
mod transactions;
