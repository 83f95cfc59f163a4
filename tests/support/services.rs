//! The services the integration tests may use, a schema of their own in the database, and the
//! example binaries they start as servers.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use sqlx::Connection;

/// `DATABASE_URL`, or `None` after saying the test skips. With `IDEMPOTENT_REQUIRE_DB=1` (CI) a
/// missing URL fails the test instead, so database tests cannot silently skip there.
pub fn database_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) => Some(url),
        Err(_) if required("IDEMPOTENT_REQUIRE_DB") => {
            panic!("IDEMPOTENT_REQUIRE_DB=1 but DATABASE_URL is unset")
        }
        Err(_) => {
            eprintln!("DATABASE_URL is unset: skipping this PostgreSQL test");
            None
        }
    }
}

/// `REDIS_URL`, or `None` after saying the test skips. With `IDEMPOTENT_REQUIRE_REDIS=1` (CI) a
/// missing URL fails the test instead, so Redis tests cannot silently skip there.
pub fn redis_url() -> Option<String> {
    match std::env::var("REDIS_URL") {
        Ok(url) => Some(url),
        Err(_) if required("IDEMPOTENT_REQUIRE_REDIS") => {
            panic!("IDEMPOTENT_REQUIRE_REDIS=1 but REDIS_URL is unset")
        }
        Err(_) => {
            eprintln!("REDIS_URL is unset: skipping this Redis test");
            None
        }
    }
}

/// Whether CI's `switch` is set (`IDEMPOTENT_REQUIRE_DB=1`, `IDEMPOTENT_REQUIRE_REDIS=1`,
/// `IDEMPOTENT_REQUIRE_BROKER=1`): a service the test needs must then be there, and its absence
/// fails the test instead of skipping it.
pub fn required(switch: &str) -> bool {
    std::env::var(switch).as_deref() == Ok("1")
}

/// A PostgreSQL schema of the test's own, dropped with it, so tests run in parallel and leave
/// nothing behind.
pub struct Schema {
    base: String,
    name: String,
}

impl Schema {
    /// Creates `idem_<prefix>_<random>`; `None` when the test skips (see [`database_url`]).
    pub async fn new(prefix: &str) -> Option<Self> {
        let base = database_url()?;
        let name = format!(
            "idem_{prefix}_{:016x}",
            idempotent_runtime::store::FencingToken::mint().0
        );
        let mut conn = sqlx::PgConnection::connect(&base)
            .await
            .expect("connect to DATABASE_URL");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create schema");
        let _ = conn.close().await;
        Some(Self { base, name })
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The database URL with this schema first on the `search_path`.
    pub fn url(&self) -> String {
        let sep = if self.base.contains('?') { '&' } else { '?' };
        format!("{}{sep}options=-c%20search_path%3D{}", self.base, self.name)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let url = self.base.clone();
        let sql = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name);
        // Drop may run inside a runtime, which cannot block on another: use a thread.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                if let Ok(mut conn) = sqlx::PgConnection::connect(&url).await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}

/// `PGBOUNCER_URL` (PgBouncer in transaction pooling mode in front of `DATABASE_URL`'s server,
/// passing every database name through, as `scripts/pgbouncer start` runs it), or `None` after
/// saying the test skips. With `IDEMPOTENT_REQUIRE_PGBOUNCER=1` (CI) a missing URL fails the
/// test instead.
pub fn pgbouncer_url() -> Option<String> {
    match std::env::var("PGBOUNCER_URL") {
        Ok(url) => Some(url),
        Err(_) if required("IDEMPOTENT_REQUIRE_PGBOUNCER") => {
            panic!(
                "IDEMPOTENT_REQUIRE_PGBOUNCER=1 but PGBOUNCER_URL is unset (scripts/pgbouncer start)"
            )
        }
        Err(_) => {
            eprintln!("PGBOUNCER_URL is unset: skipping this test behind PgBouncer");
            None
        }
    }
}

/// A PostgreSQL database of the test's own (`idem_<prefix>_<random>`), created and dropped on a
/// direct connection (`DATABASE_URL`) and reached through PgBouncer (`PGBOUNCER_URL`). A
/// [`Schema`] cannot isolate a test there: a transaction pooler drops the `search_path` a URL
/// sets as a startup option.
pub struct PooledDatabase {
    direct: String,
    pooled: String,
    name: String,
}

impl PooledDatabase {
    /// Creates the database; `None` when the test skips (see [`pgbouncer_url`]). From a thread
    /// and runtime of its own, so it works inside and outside a runtime (a server started for a
    /// conformance case makes one).
    pub fn new(prefix: &str) -> Option<Self> {
        let pooled = pgbouncer_url()?;
        let direct = database_url()?;
        let name = format!(
            "idem_{prefix}_{:016x}",
            idempotent_runtime::store::FencingToken::mint().0
        );
        let (url, sql) = (direct.clone(), format!("CREATE DATABASE \"{name}\""));
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let mut conn = sqlx::PgConnection::connect(&url)
                    .await
                    .expect("connect to DATABASE_URL");
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut conn)
                    .await
                    .expect("create database");
                let _ = conn.close().await;
            });
        })
        .join()
        .expect("the thread creating the database panicked");
        Some(Self {
            direct,
            pooled,
            name,
        })
    }

    /// The database's URL through PgBouncer.
    pub fn url(&self) -> String {
        let (base, query) = self
            .pooled
            .split_once('?')
            .map_or((self.pooled.as_str(), None), |(b, q)| (b, Some(q)));
        let server = base.rsplit_once('/').map_or(base, |(server, _)| server);
        match query {
            Some(q) => format!("{server}/{}?{q}", self.name),
            None => format!("{server}/{}", self.name),
        }
    }

    /// The database's URL on a direct connection, for checks beside the pooler.
    pub fn direct_url(&self) -> String {
        let server = self.direct.split('?').next().unwrap_or(&self.direct);
        let server = server.rsplit_once('/').map_or(server, |(server, _)| server);
        format!("{server}/{}", self.name)
    }
}

impl Drop for PooledDatabase {
    fn drop(&mut self) {
        let url = self.direct.clone();
        // FORCE: PgBouncer keeps server connections to it open.
        let sql = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                if let Ok(mut conn) = sqlx::PgConnection::connect(&url).await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}

static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The path of example `name`, built once per test binary with the features the rest of the
/// workspace uses (so the target dir is shared), and in the test's own profile: `cargo test
/// --test x` alone builds no examples, and a stale server would test old code.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if !built.iter().any(|b| b == name) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args([
            "build",
            "--quiet",
            "--all-features",
            "-p",
            "idempotent-examples",
            "--example",
            name,
        ]);
        if profile_dir.file_name().is_some_and(|p| p == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "building the {name} example failed");
        built.push(name.to_owned());
    }
    profile_dir.join("examples").join(name)
}

#[cfg(feature = "mysql")]
/// `MYSQL_URL`, or `None` after saying the test skips. With `IDEMPOTENT_REQUIRE_MYSQL=1` (CI) a
/// missing URL fails the test instead, so MySQL tests cannot silently skip there.
pub fn mysql_url() -> Option<String> {
    match std::env::var("MYSQL_URL") {
        Ok(url) => Some(url),
        Err(_) if std::env::var("IDEMPOTENT_REQUIRE_MYSQL").as_deref() == Ok("1") => {
            panic!("IDEMPOTENT_REQUIRE_MYSQL=1 but MYSQL_URL is unset")
        }
        Err(_) => {
            eprintln!("MYSQL_URL is unset: skipping this MySQL/MariaDB test");
            None
        }
    }
}

/// A MySQL/MariaDB database of the test's own (`idem_<prefix>_<random>`), dropped with it.
/// Created and dropped from a thread of its own, so it works inside and outside a runtime.
#[cfg(feature = "mysql")]
pub struct MysqlDatabase {
    base: String,
    name: String,
}

#[cfg(feature = "mysql")]
impl MysqlDatabase {
    /// Creates the database on the server `base` (a `mysql://` URL) names.
    pub fn new(base: &str, prefix: &str) -> Self {
        let name = format!(
            "idem_{prefix}_{:016x}",
            idempotent_runtime::store::FencingToken::mint().0
        );
        mysql_admin(base, format!("CREATE DATABASE `{name}`")).expect("create database");
        Self {
            base: base.to_owned(),
            name,
        }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `base` with this database as its path (`mysql://user@host:port/<name>?…`).
    pub fn url(&self) -> String {
        let (scheme, rest) = self.base.split_once("://").expect("a mysql:// URL");
        let (authority, tail) = rest.split_once('/').unwrap_or((rest, ""));
        let query = tail.split_once('?').map(|(_, q)| format!("?{q}"));
        format!(
            "{scheme}://{authority}/{}{}",
            self.name,
            query.unwrap_or_default()
        )
    }
}

#[cfg(feature = "mysql")]
impl Drop for MysqlDatabase {
    fn drop(&mut self) {
        let _ = mysql_admin(
            &self.base,
            format!("DROP DATABASE IF EXISTS `{}`", self.name),
        );
    }
}

/// Runs one statement on the server `url` names, from a thread and runtime of its own.
#[cfg(feature = "mysql")]
fn mysql_admin(url: &str, sql: String) -> Result<(), String> {
    let url = url.to_owned();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async move {
            let mut conn = sqlx::MySqlConnection::connect(&url)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            let _ = conn.close().await;
            Ok(())
        })
    })
    .join()
    .map_err(|_| "the admin thread panicked".to_owned())?
}
