//! Conformance servers sharing one store (DESIGN.md §3, §5), through one replica harness
//! ([`shared`]) on PostgreSQL and on Redis: two replicas racing on the same keys, and a replica
//! killed mid-handler.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/0 \
//! PGBOUNCER_URL=$(scripts/pgbouncer start) \
//!     cargo test --all-features --test replicas [postgres::|redis::|pgbouncer::]
//! ```

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "postgres")]
mod pgbouncer;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod shared;
