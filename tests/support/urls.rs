//! The services' URLs, read from the environment: one source for the root package's test
//! groups (through this directory's `mod.rs`) and the runtime's own integration tests
//! (`idempotent-runtime/tests/support/mod.rs` includes this file by its path).
//!
//! Without a service's URL a test says so and skips, unless CI's switch for that service is set
//! (`IDEMPOTENT_REQUIRE_DB=1`, `IDEMPOTENT_REQUIRE_REDIS=1`, `IDEMPOTENT_REQUIRE_MYSQL=1`,
//! `IDEMPOTENT_REQUIRE_PGBOUNCER=1`), when it fails, so service tests cannot silently skip there.

/// Whether CI's `switch` is set (`IDEMPOTENT_REQUIRE_DB=1`, `IDEMPOTENT_REQUIRE_REDIS=1`,
/// `IDEMPOTENT_REQUIRE_BROKER=1`, …): a service the test needs must then be there, and its
/// absence fails the test instead of skipping it.
pub fn required(switch: &str) -> bool {
    std::env::var(switch).as_deref() == Ok("1")
}

/// `var`, or `None` after saying the test skips (a panic when `switch` is set).
fn service_url(var: &str, switch: &str, skipping: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) => Some(url),
        Err(_) if required(switch) => panic!("{switch}=1 but {var} is unset"),
        Err(_) => {
            eprintln!("{var} is unset: skipping this {skipping}");
            None
        }
    }
}

/// `DATABASE_URL` (PostgreSQL), or `None` after saying the test skips (a panic under
/// `IDEMPOTENT_REQUIRE_DB=1`).
pub fn database_url() -> Option<String> {
    service_url("DATABASE_URL", "IDEMPOTENT_REQUIRE_DB", "PostgreSQL test")
}

/// `REDIS_URL`, or `None` after saying the test skips (a panic under
/// `IDEMPOTENT_REQUIRE_REDIS=1`).
pub fn redis_url() -> Option<String> {
    service_url("REDIS_URL", "IDEMPOTENT_REQUIRE_REDIS", "Redis test")
}

/// `MYSQL_URL` (MySQL or MariaDB), or `None` after saying the test skips (a panic under
/// `IDEMPOTENT_REQUIRE_MYSQL=1`).
pub fn mysql_url() -> Option<String> {
    service_url(
        "MYSQL_URL",
        "IDEMPOTENT_REQUIRE_MYSQL",
        "MySQL/MariaDB test",
    )
}

/// `PGBOUNCER_URL` (PgBouncer in transaction pooling mode in front of `DATABASE_URL`'s server,
/// passing every database name through, as `scripts/pgbouncer start` runs it), or `None` after
/// saying the test skips (a panic under `IDEMPOTENT_REQUIRE_PGBOUNCER=1`).
pub fn pgbouncer_url() -> Option<String> {
    service_url(
        "PGBOUNCER_URL",
        "IDEMPOTENT_REQUIRE_PGBOUNCER",
        "test behind PgBouncer (scripts/pgbouncer start)",
    )
}
