//! What the store does, seen over HTTP (DESIGN.md §2, §3, §5): a spy store taken down or filled
//! under each `FailureMode` and asked for the attribute's durations, the conformance servers on
//! PostgreSQL (clients gone mid-claim, the cache in the metrics), and on a Redis at `maxmemory`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test stores [store_outage::|postgres_http::|redis_maxmemory::]
//! ```

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "postgres")]
mod postgres_http;
#[cfg(feature = "redis")]
mod redis_maxmemory;
mod store_outage;
