//! What the runtime's integration tests share: the services they may use, from the same source
//! as the root package's test groups (`tests/support/urls.rs`, included by its path).
//!
//! Without the service's URL a test says so and skips, unless CI's switch for it is set
//! (`IDEMPOTENT_REQUIRE_DB=1`, `IDEMPOTENT_REQUIRE_REDIS=1`, `IDEMPOTENT_REQUIRE_MYSQL=1`,
//! `IDEMPOTENT_REQUIRE_PGBOUNCER=1`), when it fails, so service tests cannot silently skip there.
//! The brokers (NATS, RabbitMQ) have default local addresses: a test skips when its broker is
//! unreachable, unless `IDEMPOTENT_REQUIRE_BROKER=1`.

// Each test file is its own crate and uses part of this.
#![allow(dead_code, unused_imports)]

#[path = "../../../tests/support/urls.rs"]
mod urls;

pub use urls::{database_url, mysql_url, pgbouncer_url, redis_url, required};

/// Whether CI requires the Redis tests to run (so a missing tool fails them too).
pub fn redis_required() -> bool {
    required("IDEMPOTENT_REQUIRE_REDIS")
}

/// Whether CI requires the broker tests (NATS JetStream, RabbitMQ) to run.
pub fn broker_required() -> bool {
    required("IDEMPOTENT_REQUIRE_BROKER")
}
