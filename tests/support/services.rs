//! A schema of the test's own in the database, a database of its own behind PgBouncer (and on
//! MySQL), and the example binaries the tests start as servers; the services' URLs are `urls.rs`.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use sqlx::Connection;

use super::urls::{database_url, pgbouncer_url};

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
