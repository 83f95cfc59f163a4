//! What the SQL stores and the inbox share ([the contract](crate::design) §5 "Migrations"): one
//! table-name validation, one versioned migration runner parameterised by [`Dialect`], and the
//! rendered DDL for users who ship schema changes with their own migration tool.
//!
//! A dialect says how to open the migration's transaction so that concurrent migrators of the
//! same tables queue behind each other (PostgreSQL: a transaction-scoped advisory lock derived
//! from the table's name; SQLite: `BEGIN IMMEDIATE`, the database's write lock; MySQL/MariaDB: a
//! named `GET_LOCK` held by the migrating session), and the few column types, parameters and
//! identifier quotes that differ. Adding a database is one more `impl Dialect`.
//!
//! The runner keeps nothing on a connection beyond its transaction on PostgreSQL: every
//! statement is unnamed (`persistent(false)`, never a prepared statement left behind), its
//! settings are `SET LOCAL` and its lock is transaction-scoped, so it runs unchanged behind a
//! connection pooler in transaction mode (PgBouncer `pool_mode = transaction`).

use std::fmt;

use sha2::{Digest, Sha256};
use sqlx::migrate::MigrateError;
use sqlx::{AssertSqlSafe, Database, Decode, Encode, Executor, FromRow, IntoArguments, Pool, Type};

/// A schema or table name refused by a store or the inbox: names are interpolated into SQL, so
/// only plain identifiers are accepted, short enough that the indexes, constraints and the
/// version table named after them stay within the database's identifier length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidName {
    rules: NameRules,
    kind: &'static str,
    name: String,
}

impl InvalidName {
    /// The refused name, as given.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for InvalidName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.rules;
        let max = if self.kind == "schema" {
            r.max_schema
        } else {
            r.max_table
        };
        let letters = if r.lowercase {
            "lowercase ASCII letters"
        } else {
            "ASCII letters"
        };
        write!(
            f,
            "invalid {} {} name {:?}: it must be 1-{max} {letters}, digits or '_', not starting with \
             a digit",
            r.subject, self.kind, self.name
        )
    }
}

impl std::error::Error for InvalidName {}

/// A bad name reaches callers whose error type is sqlx's (the builders that also connect) as
/// `sqlx::Error::Configuration`, with the [`InvalidName`] as its source, so `?` keeps working
/// and the cause can still be told apart by downcasting.
impl From<InvalidName> for sqlx::Error {
    fn from(e: InvalidName) -> Self {
        sqlx::Error::Configuration(Box::new(e))
    }
}

/// Why a SQL store's builder could not open it: a refused schema or table name (told before
/// anything connects), or the database itself. Converts into `sqlx::Error` with `?` (a name as
/// `sqlx::Error::Configuration`), so code written against sqlx's error keeps working.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConnectError {
    /// A schema or table name the store refuses.
    InvalidName(InvalidName),
    /// The database refused or could not be reached, or the URL or options were wrong.
    Database(sqlx::Error),
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidName(e) => e.fmt(f),
            Self::Database(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::InvalidName(e) => Some(e),
            Self::Database(e) => Some(e),
        }
    }
}

impl From<InvalidName> for ConnectError {
    fn from(e: InvalidName) -> Self {
        Self::InvalidName(e)
    }
}

impl From<sqlx::Error> for ConnectError {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

impl From<ConnectError> for sqlx::Error {
    fn from(e: ConnectError) -> Self {
        match e {
            ConnectError::InvalidName(e) => e.into(),
            ConnectError::Database(e) => e,
        }
    }
}

/// What names one kind of table accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NameRules {
    /// What the table is, for the error message.
    subject: &'static str,
    max_table: usize,
    max_schema: usize,
    /// Lowercase only (the inbox: its names are also written unquoted by users' own SQL).
    lowercase: bool,
}

/// The stores' tables: `<name>_migrations` and the index names stay within 63 bytes.
pub(crate) const STORE_NAMES: NameRules = NameRules {
    subject: "idempotency store",
    max_table: 48,
    max_schema: 48,
    lowercase: false,
};

/// The inbox's table: `<table>_migrations`, `<table>_pkey` (by whose exact name duplicates are
/// recognised; PostgreSQL truncates longer names silently) and `<table>_sweep_idx` fit 63 bytes.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) const INBOX_NAMES: NameRules = NameRules {
    subject: "inbox",
    max_table: 50,
    max_schema: 63,
    lowercase: true,
};

/// The outbox's table: `<table>_migrations`, `<table>_pkey`, `<table>_pending_idx` and its
/// other index and constraint names fit 63 bytes (MySQL's limit, 64, too, with `<table>_keys`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) const OUTBOX_NAMES: NameRules = NameRules {
    subject: "outbox",
    max_table: 48,
    max_schema: 63,
    lowercase: true,
};

/// A validated table name and the names derived from it, quoted for SQL.
#[derive(Debug, Clone)]
pub(crate) struct TableName {
    /// The bare table name.
    pub(crate) name: String,
    /// The bare schema name, if one is configured.
    pub(crate) schema: Option<String>,
    /// `"schema"."table"` or `"table"`.
    pub(crate) qualified: String,
    /// `"schema"."table_migrations"` or `"table_migrations"`: the version table of
    /// [`migrate`], never sqlx's `_sqlx_migrations`.
    pub(crate) versions: String,
    /// `"schema".` or nothing: what qualifies the table's indexes.
    pub(crate) prefix: String,
    /// The identifier quote: `"` (PostgreSQL, SQLite) or `` ` `` (MySQL, whose sessions do not
    /// set `ANSI_QUOTES`).
    quote: char,
}

impl TableName {
    // Only the PostgreSQL and SQLite stores quote with `"`.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn new(
        rules: NameRules,
        schema: Option<&str>,
        name: &str,
    ) -> Result<Self, InvalidName> {
        Self::quoted_with(rules, schema, name, '"')
    }

    /// [`new`](Self::new) with identifiers quoted by `quote` (MySQL's backtick).
    pub(crate) fn quoted_with(
        rules: NameRules,
        schema: Option<&str>,
        name: &str,
        quote: char,
    ) -> Result<Self, InvalidName> {
        let check = |kind: &'static str, ident: &str, max: usize| {
            let mut chars = ident.chars();
            let letter = |c: char| {
                if rules.lowercase {
                    c.is_ascii_lowercase()
                } else {
                    c.is_ascii_alphabetic()
                }
            };
            let ok = ident.len() <= max
                && chars.next().is_some_and(|c| letter(c) || c == '_')
                && chars.all(|c| letter(c) || c.is_ascii_digit() || c == '_');
            if ok {
                Ok(())
            } else {
                Err(InvalidName {
                    rules,
                    kind,
                    name: ident.to_owned(),
                })
            }
        };
        check("table", name, rules.max_table)?;
        if let Some(schema) = schema {
            check("schema", schema, rules.max_schema)?;
        }
        let q = quote;
        let prefix = schema.map_or_else(String::new, |s| format!("{q}{s}{q}."));
        Ok(Self {
            qualified: format!("{prefix}{q}{name}{q}"),
            versions: format!("{prefix}{q}{name}_migrations{q}"),
            prefix,
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
            quote,
        })
    }

    /// A migration template for this table: `{table}` is the quoted, qualified table name,
    /// `{name}` the bare one (what its indexes are named after), `{schema}` the quoted schema
    /// and a dot, or nothing.
    fn render(&self, template: &str) -> String {
        template
            .replace("{table}", &self.qualified)
            .replace("{name}", &self.name)
            .replace("{schema}", &self.prefix)
    }

    /// The migrations of `steps` rendered for this table, for users' own migration tools.
    pub(crate) fn migrations(&self, steps: &[Step]) -> Migrations {
        Migrations {
            items: steps
                .iter()
                .map(|s| Migration {
                    version: s.version,
                    description: s.description,
                    sql: self.render(s.template),
                })
                .collect(),
            schema: self
                .schema
                .as_ref()
                .map(|s| format!("{q}{s}{q}", q = self.quote)),
            sqlx_table: format!(
                "{}{q}{}_sqlx_migrations{q}",
                self.prefix,
                self.name,
                q = self.quote
            ),
        }
    }
}

/// One shipped migration: a `{table}` template. Never edit a shipped one (its checksum is
/// recorded where it was applied, and [`migrate`] refuses a changed one): add a step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Step {
    pub(crate) version: i64,
    pub(crate) description: &'static str,
    pub(crate) template: &'static str,
}

/// One versioned step of a store's or the inbox's schema, rendered for the configured table.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Migration {
    /// Its version: steps apply in ascending order, each once.
    pub version: i64,
    /// What it does, as recorded in the version table.
    pub description: &'static str,
    /// The SQL to run, one or more statements (run them in one transaction).
    pub sql: String,
}

/// The ordered migrations of one table, for a migration tool of the user's own instead of
/// `migrate()`: take each [`Migration`]'s SQL into your tool (refinery, Flyway, sqlx-cli files)
/// or run them with [`migrator`](Self::migrator).
///
/// Use one or the other for a table, never both: `migrate()` records what it applied in
/// `<table>_migrations`, your tool in its own table, and neither sees the other's records. (The
/// PostgreSQL steps are idempotent, so a table migrated by one is adopted by the other; the
/// SQLite ones are not.)
#[derive(Debug, Clone)]
pub struct Migrations {
    items: Vec<Migration>,
    /// The quoted schema, if one is configured.
    schema: Option<String>,
    sqlx_table: String,
}

impl Migrations {
    /// The migrations in the order they apply.
    pub fn iter(&self) -> std::slice::Iter<'_, Migration> {
        self.items.iter()
    }

    /// A sqlx [`Migrator`](sqlx::migrate::Migrator) of these migrations that records them in
    /// `<table>_sqlx_migrations` beside the table (creating the schema, if one is configured),
    /// so their version numbers never meet the application's own in `_sqlx_migrations`. Run
    /// it with `migrator.run(&pool).await`.
    pub fn migrator(&self) -> sqlx::migrate::Migrator {
        let mut m = sqlx::migrate::Migrator::with_migrations(
            self.items
                .iter()
                .map(|i| {
                    sqlx::migrate::Migration::new(
                        i.version,
                        i.description.into(),
                        sqlx::migrate::MigrationType::Simple,
                        sqlx::SqlSafeStr::into_sql_str(AssertSqlSafe(i.sql.clone())),
                        false,
                    )
                })
                .collect(),
        );
        m.dangerous_set_table_name(self.sqlx_table.clone());
        if let Some(schema) = &self.schema {
            m.create_schema(schema.clone());
        }
        m
    }
}

impl IntoIterator for Migrations {
    type Item = Migration;
    type IntoIter = std::vec::IntoIter<Migration>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

impl<'a> IntoIterator for &'a Migrations {
    type Item = &'a Migration;
    type IntoIter = std::slice::Iter<'a, Migration>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

/// What differs between databases in [`migrate`].
pub(crate) trait Dialect {
    type Db: Database;

    /// Opens the migration's transaction. Where that alone serialises migrators (SQLite's
    /// `BEGIN IMMEDIATE` takes the write lock), nothing else is needed.
    const BEGIN: &'static str;

    /// The type of the version table's `checksum` column.
    const BLOB: &'static str;

    /// The value of `applied_at` for a row inserted now.
    const NOW: &'static str;

    /// Statements run first in the transaction: the lock that queues concurrent migrators of
    /// this table, and whatever must exist before the version table (its schema).
    fn prelude(table: &TableName) -> Vec<String>;

    /// A query of one `bigint` run after the prelude that must answer 1: a lock that can also
    /// be refused (MySQL's `GET_LOCK` gives up after its timeout), so that migrators never run
    /// unserialised. Default: none.
    fn lock(_table: &TableName) -> Option<String> {
        None
    }

    /// Statements run on the migrating connection once the transaction has ended, committed
    /// or not: the release of a session-scoped lock the prelude took (MySQL's `GET_LOCK`
    /// outlives transactions). If they fail, the connection is closed rather than pooled, which
    /// releases such a lock too. Default: none.
    fn finish(_table: &TableName) -> Vec<String> {
        Vec::new()
    }

    /// The version table, created if missing (with the columns earlier releases created).
    fn versions_ddl(table: &TableName) -> String;

    /// A query of one `bigint`: 1 if the version table has its `checksum` column, 0 if it was
    /// created before checksums were recorded.
    fn has_checksum(table: &TableName) -> String;

    /// The `n`th (1-based) bind parameter.
    fn param(n: usize) -> String;
}

/// PostgreSQL: DDL is transactional, and migrators of the same table queue on a
/// transaction-scoped advisory lock, released at commit or rollback, never left behind.
#[cfg(feature = "postgres")]
pub(crate) struct Pg;

#[cfg(feature = "postgres")]
impl Dialect for Pg {
    type Db = sqlx::Postgres;
    const BEGIN: &'static str = "BEGIN";
    const BLOB: &'static str = "bytea";
    const NOW: &'static str = "now()";

    fn prelude(table: &TableName) -> Vec<String> {
        let digest = Sha256::digest(format!("idempotent-migrate:{}", table.versions));
        let key = i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
        let mut sql = vec![
            // Migrating replicas queue behind each other; a store's short lock_timeout is for
            // claims, not for this.
            "SET LOCAL lock_timeout = '60s'".to_owned(),
            format!("SELECT pg_advisory_xact_lock({key})"),
        ];
        if let Some(schema) = &table.schema {
            sql.push(format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""));
        }
        sql
    }

    fn versions_ddl(table: &TableName) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\
                 version bigint PRIMARY KEY, \
                 description text NOT NULL, \
                 applied_at timestamptz NOT NULL DEFAULT now(), \
                 checksum bytea)",
            table.versions
        )
    }

    fn has_checksum(table: &TableName) -> String {
        format!(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = '{}'::regclass \
             AND attname = 'checksum' AND NOT attisdropped",
            table.versions
        )
    }

    fn param(n: usize) -> String {
        format!("${n}")
    }
}

/// SQLite: `BEGIN IMMEDIATE` takes the database's write lock, so migrators (of any process)
/// queue behind each other for up to the connection's `busy_timeout`.
#[cfg(feature = "sqlite")]
pub(crate) struct Lite;

#[cfg(feature = "sqlite")]
impl Dialect for Lite {
    type Db = sqlx::Sqlite;
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const BLOB: &'static str = "BLOB";
    // Milliseconds since the UNIX epoch, what earlier releases recorded.
    const NOW: &'static str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";

    fn prelude(_: &TableName) -> Vec<String> {
        Vec::new()
    }

    fn versions_ddl(table: &TableName) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\
                 version INTEGER PRIMARY KEY, \
                 description TEXT NOT NULL, \
                 applied_at INTEGER NOT NULL, \
                 checksum BLOB)",
            table.versions
        )
    }

    fn has_checksum(table: &TableName) -> String {
        format!(
            "SELECT count(*) FROM pragma_table_info('{}_migrations') WHERE name = 'checksum'",
            table.name
        )
    }

    fn param(n: usize) -> String {
        format!("?{n}")
    }
}

/// MySQL and MariaDB: DDL commits implicitly, so a transaction cannot serialise migrators.
/// They queue instead on a named lock (`GET_LOCK`, up to 60 s) derived from the table's name
/// and held by the migrating session across the implicit commits; [`Dialect::finish`]
/// releases it (and a session that dies releases it too). The shipped DDL is idempotent
/// (`CREATE TABLE IF NOT EXISTS`), so a step interrupted between its DDL and its version row
/// is applied again harmlessly.
#[cfg(feature = "mysql")]
pub(crate) struct My;

#[cfg(feature = "mysql")]
impl My {
    /// The lock's name: at most 64 characters, whatever the table's.
    fn lock_name(table: &TableName) -> String {
        let digest = Sha256::digest(format!("idempotent-migrate:{}", table.versions));
        let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
        format!("idempotent-migrate-{hex}")
    }
}

#[cfg(feature = "mysql")]
impl Dialect for My {
    type Db = sqlx::MySql;
    const BEGIN: &'static str = "BEGIN";
    const BLOB: &'static str = "VARBINARY(32)";
    const NOW: &'static str = "NOW(3)";

    fn prelude(table: &TableName) -> Vec<String> {
        let mut sql = vec![
            // Migrating replicas queue behind each other; a store's short lock waits are for
            // claims, not for DDL waiting on a table's metadata lock. The session's own values
            // come back in `finish`: the connection returns to a store's pool.
            "SET @idempotent_lwt = @@SESSION.lock_wait_timeout, \
                 @idempotent_ilwt = @@SESSION.innodb_lock_wait_timeout"
                .to_owned(),
            "SET SESSION lock_wait_timeout = 60, innodb_lock_wait_timeout = 60".to_owned(),
        ];
        if let Some(schema) = &table.schema {
            sql.push(format!("CREATE DATABASE IF NOT EXISTS `{schema}`"));
        }
        sql
    }

    fn lock(table: &TableName) -> Option<String> {
        Some(format!(
            "SELECT CAST(COALESCE(GET_LOCK('{}', 60), 0) AS SIGNED)",
            Self::lock_name(table)
        ))
    }

    fn finish(table: &TableName) -> Vec<String> {
        vec![
            format!("DO RELEASE_LOCK('{}')", Self::lock_name(table)),
            "SET SESSION lock_wait_timeout = @idempotent_lwt, \
                 innodb_lock_wait_timeout = @idempotent_ilwt"
                .to_owned(),
        ]
    }

    fn versions_ddl(table: &TableName) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\
                 version BIGINT NOT NULL PRIMARY KEY, \
                 description TEXT NOT NULL, \
                 applied_at DATETIME(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3), \
                 checksum VARBINARY(32)) ENGINE = InnoDB",
            table.versions
        )
    }

    fn has_checksum(table: &TableName) -> String {
        let schema = table
            .schema
            .as_ref()
            .map_or_else(|| "DATABASE()".to_owned(), |s| format!("'{s}'"));
        format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.columns \
             WHERE table_schema = {schema} AND table_name = '{}_migrations' \
               AND column_name = 'checksum'",
            table.name
        )
    }

    fn param(_: usize) -> String {
        "?".to_owned()
    }
}

/// The checksum recorded for a rendered migration.
fn checksum(sql: &str) -> Vec<u8> {
    Sha256::digest(sql).to_vec()
}

/// `operation` bounded by a store's `operation_timeout` (`database` names it in the error):
/// past it, unavailable, its outcome unknown. Not an `async fn`: that would keep `operation`
/// twice in its state (the argument and the timeout around it), and every claim and completion
/// future, moved and boxed whole on every request, would carry both copies.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn bounded<T>(
    database: &'static str,
    limit: std::time::Duration,
    operation: impl Future<Output = Result<T, crate::store::StoreError>>,
) -> impl Future<Output = Result<T, crate::store::StoreError>> {
    use futures_util::FutureExt as _;
    tokio::time::timeout(limit, operation).map(move |answer| match answer {
        Ok(answer) => answer,
        Err(_) => Err(crate::store::StoreError::unavailable(format!(
            "{database} did not answer within {limit:?} (the store's operation_timeout): the \
             network or the server is down, and the operation's outcome is unknown"
        ))),
    })
}

/// Applies the steps not yet recorded in the table's version table, in order, in one
/// transaction, and records each with its description and the checksum of its rendered SQL.
/// Idempotent, and safe from several replicas at once (they queue on the dialect's lock; the
/// later ones find everything applied).
///
/// A step recorded with another checksum is refused with
/// [`MigrateError::VersionMismatch`] naming its version, before anything runs. A step recorded
/// without one (by a release before checksums) is adopted: its checksum is filled in. Versions
/// recorded but unknown here (a newer release's) are left alone, so an older replica of a
/// rolling deployment still starts.
pub(crate) async fn migrate<D: Dialect>(
    pool: &Pool<D::Db>,
    table: &TableName,
    steps: &[Step],
) -> Result<(), sqlx::Error>
where
    D::Db: sqlx::database::HasStatementCache,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    i64: Type<D::Db> + for<'q> Encode<'q, D::Db> + for<'r> Decode<'r, D::Db>,
    String: Type<D::Db> + for<'q> Encode<'q, D::Db>,
    Vec<u8>: Type<D::Db> + for<'q> Encode<'q, D::Db>,
    (i64,): for<'r> FromRow<'r, <D::Db as Database>::Row>,
    (i64, Option<Vec<u8>>): for<'r> FromRow<'r, <D::Db as Database>::Row>,
{
    let mut conn = pool.acquire().await?;
    let migrated = migrate_on::<D>(&mut conn, table, steps).await;
    for sql in D::finish(table) {
        if let Err(e) = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *conn).await {
            tracing::warn!(table = %table.qualified, error = %e, "could not end the migration's lock");
            conn.close_on_drop();
            break;
        }
    }
    migrated
}

/// [`migrate`]'s transaction, on one connection.
async fn migrate_on<D: Dialect>(
    conn: &mut <D::Db as Database>::Connection,
    table: &TableName,
    steps: &[Step],
) -> Result<(), sqlx::Error>
where
    D::Db: sqlx::database::HasStatementCache,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    i64: Type<D::Db> + for<'q> Encode<'q, D::Db> + for<'r> Decode<'r, D::Db>,
    String: Type<D::Db> + for<'q> Encode<'q, D::Db>,
    Vec<u8>: Type<D::Db> + for<'q> Encode<'q, D::Db>,
    (i64,): for<'r> FromRow<'r, <D::Db as Database>::Row>,
    (i64, Option<Vec<u8>>): for<'r> FromRow<'r, <D::Db as Database>::Row>,
{
    use sqlx::Connection as _;
    let mut tx = conn.begin_with(AssertSqlSafe(D::BEGIN.to_owned())).await?;
    for sql in D::prelude(table) {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    if let Some(lock) = D::lock(table) {
        let got: i64 = sqlx::query_scalar(AssertSqlSafe(lock))
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        if got != 1 {
            return Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "another migrator of {} held its lock for 60 s; nothing was applied",
                    table.qualified
                ),
            )));
        }
    }
    sqlx::raw_sql(AssertSqlSafe(D::versions_ddl(table)))
        .execute(&mut *tx)
        .await?;
    let has_checksum: i64 = sqlx::query_scalar(AssertSqlSafe(D::has_checksum(table)))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
    if has_checksum == 0 {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER TABLE {} ADD COLUMN checksum {}",
            table.versions,
            D::BLOB
        )))
        .execute(&mut *tx)
        .await?;
    }
    let applied: Vec<(i64, Option<Vec<u8>>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT version, checksum FROM {}",
        table.versions
    )))
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    let (p1, p2, p3) = (D::param(1), D::param(2), D::param(3));
    let rendered: Vec<(Step, String, Vec<u8>)> = steps
        .iter()
        .map(|s| {
            let sql = table.render(s.template);
            let sum = checksum(&sql);
            (*s, sql, sum)
        })
        .collect();
    // Every recorded checksum is checked before any step runs, so a refused migration
    // changes nothing.
    for (step, _, sum) in &rendered {
        if let Some((_, Some(recorded))) = applied.iter().find(|(v, _)| *v == step.version)
            && recorded != sum
        {
            tracing::error!(
                table = %table.qualified,
                version = step.version,
                "migration {} of {} was applied with other SQL than this release ships",
                step.version,
                table.qualified,
            );
            return Err(MigrateError::VersionMismatch(step.version).into());
        }
    }
    for (step, sql, sum) in rendered {
        match applied.iter().find(|(v, _)| *v == step.version) {
            Some((_, Some(_))) => {}
            Some((_, None)) => {
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {} SET checksum = {p1} WHERE version = {p2}",
                    table.versions
                )))
                .bind(sum)
                .bind(step.version)
                .persistent(false)
                .execute(&mut *tx)
                .await?;
            }
            None => {
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {} (version, description, applied_at, checksum) \
                     VALUES ({p1}, {p2}, {now}, {p3})",
                    table.versions,
                    now = D::NOW,
                )))
                .bind(step.version)
                .bind(step.description.to_owned())
                .bind(sum)
                .persistent(false)
                .execute(&mut *tx)
                .await?;
            }
        }
    }
    tx.commit().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_names_are_validated_and_quoted() {
        let t = TableName::new(STORE_NAMES, Some("app"), "Records_1").unwrap();
        assert_eq!(t.qualified, "\"app\".\"Records_1\"");
        assert_eq!(t.versions, "\"app\".\"Records_1_migrations\"");
        assert_eq!(t.prefix, "\"app\".");
        let t = TableName::new(STORE_NAMES, None, "_r").unwrap();
        assert_eq!((t.qualified.as_str(), t.prefix.as_str()), ("\"_r\"", ""));
        assert!(TableName::new(STORE_NAMES, None, &"a".repeat(48)).is_ok());
        for bad in ["", "1abc", "a\"b", "a b", "x;drop", "é", &"a".repeat(49)] {
            let e = TableName::new(STORE_NAMES, None, bad).unwrap_err();
            assert_eq!(e.name(), bad);
            assert_eq!(
                e.to_string(),
                format!(
                    "invalid idempotency store table name {bad:?}: it must be 1-48 ASCII letters, \
                     digits or '_', not starting with a digit"
                )
            );
            let e = TableName::new(STORE_NAMES, Some(bad), "ok").unwrap_err();
            assert!(e.to_string().contains("store schema name"), "{e}");
        }
    }

    #[test]
    fn mysql_names_are_quoted_with_backticks_everywhere() {
        let t = TableName::quoted_with(STORE_NAMES, Some("app"), "r", '`').unwrap();
        assert_eq!(t.qualified, "`app`.`r`");
        assert_eq!(t.versions, "`app`.`r_migrations`");
        let steps = [Step {
            version: 1,
            description: "one",
            template: "CREATE INDEX `{name}_i` ON {table}",
        }];
        let m = t.migrations(&steps);
        assert_eq!(
            m.iter().next().unwrap().sql,
            "CREATE INDEX `r_i` ON `app`.`r`"
        );
        assert_eq!(m.migrator().table_name, "`app`.`r_sqlx_migrations`");
        assert!(TableName::quoted_with(STORE_NAMES, None, "a`b", '`').is_err());
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn inbox_names_are_lowercase_and_may_be_longer() {
        assert!(TableName::new(INBOX_NAMES, Some(&"s".repeat(63)), &"t".repeat(50)).is_ok());
        for bad in ["Upper", "Bad-Name", &"t".repeat(51)] {
            let e = TableName::new(INBOX_NAMES, None, bad).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "invalid inbox table name {bad:?}: it must be 1-50 lowercase ASCII letters, digits \
                     or '_', not starting with a digit"
                )
            );
        }
        assert!(TableName::new(INBOX_NAMES, Some(&"s".repeat(64)), "t").is_err());
        assert!(TableName::new(STORE_NAMES, None, "Upper").is_ok());
    }

    #[test]
    fn a_bad_name_converts_to_a_configuration_error_that_keeps_it() {
        let e: sqlx::Error = TableName::new(STORE_NAMES, None, "a b").unwrap_err().into();
        let sqlx::Error::Configuration(source) = &e else {
            panic!("{e:?}")
        };
        let invalid = source
            .downcast_ref::<InvalidName>()
            .expect("an InvalidName");
        assert_eq!(invalid.name(), "a b");
    }

    #[test]
    fn templates_render_every_placeholder() {
        let t = TableName::new(STORE_NAMES, Some("app"), "r").unwrap();
        assert_eq!(
            t.render("CREATE INDEX \"{name}_i\" ON {table}; DROP INDEX {schema}\"{name}_j\""),
            "CREATE INDEX \"r_i\" ON \"app\".\"r\"; DROP INDEX \"app\".\"r_j\""
        );
        let steps = [
            Step {
                version: 1,
                description: "one",
                template: "SELECT 1 FROM {table}",
            },
            Step {
                version: 2,
                description: "two",
                template: "SELECT 2",
            },
        ];
        let m = t.migrations(&steps);
        let v: Vec<_> = m.iter().map(|m| (m.version, m.sql.as_str())).collect();
        assert_eq!(v, [(1, "SELECT 1 FROM \"app\".\"r\""), (2, "SELECT 2")]);
        let migrator = m.migrator();
        assert_eq!(migrator.iter().count(), 2);
        assert_eq!(migrator.table_name, "\"app\".\"r_sqlx_migrations\"");
    }
}
