//! What the runtime's integration tests share: the services they may use.
//!
//! Without the service's URL a test says so and skips, unless CI's switch for it is set
//! (`IDEMPOTENT_REQUIRE_DB=1`, `IDEMPOTENT_REQUIRE_REDIS=1`, `IDEMPOTENT_REQUIRE_MYSQL=1`,
//! `IDEMPOTENT_REQUIRE_PGBOUNCER=1`), when it fails, so service tests cannot silently skip there.
//! The brokers (NATS, RabbitMQ) have default local addresses: a test skips when its broker is
//! unreachable, unless `IDEMPOTENT_REQUIRE_BROKER=1`.

// Each test file is its own crate and uses part of this.
#![allow(dead_code)]

/// `DATABASE_URL`, or `None` after saying the test skips (a panic under `IDEMPOTENT_REQUIRE_DB=1`).
pub fn database_url() -> Option<String> {
    service_url("DATABASE_URL", "IDEMPOTENT_REQUIRE_DB", "PostgreSQL")
}

/// `REDIS_URL`, or `None` after saying the test skips (a panic under
/// `IDEMPOTENT_REQUIRE_REDIS=1`).
pub fn redis_url() -> Option<String> {
    service_url("REDIS_URL", "IDEMPOTENT_REQUIRE_REDIS", "Redis")
}

/// Whether CI requires the Redis tests to run (so a missing tool fails them too).
pub fn redis_required() -> bool {
    required("IDEMPOTENT_REQUIRE_REDIS")
}

/// Whether CI requires the broker tests (NATS JetStream, RabbitMQ) to run.
pub fn broker_required() -> bool {
    required("IDEMPOTENT_REQUIRE_BROKER")
}

fn required(switch: &str) -> bool {
    std::env::var(switch).as_deref() == Ok("1")
}

fn service_url(var: &str, switch: &str, service: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) => Some(url),
        Err(_) if required(switch) => panic!("{switch}=1 but {var} is unset"),
        Err(_) => {
            eprintln!("{var} is unset: skipping this {service} test");
            None
        }
    }
}

/// `MYSQL_URL`, or `None` after saying the test skips (a panic under
/// `IDEMPOTENT_REQUIRE_MYSQL=1`).
pub fn mysql_url() -> Option<String> {
    service_url("MYSQL_URL", "IDEMPOTENT_REQUIRE_MYSQL", "MySQL/MariaDB")
}

/// `PGBOUNCER_URL` (PgBouncer in transaction pooling mode in front of `DATABASE_URL`'s server,
/// as `scripts/pgbouncer start` runs it), or `None` after saying the test skips (a panic under
/// `IDEMPOTENT_REQUIRE_PGBOUNCER=1`).
pub fn pgbouncer_url() -> Option<String> {
    service_url(
        "PGBOUNCER_URL",
        "IDEMPOTENT_REQUIRE_PGBOUNCER",
        "PgBouncer (scripts/pgbouncer start)",
    )
}
