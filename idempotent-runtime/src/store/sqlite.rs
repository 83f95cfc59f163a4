//! The SQLite store, through sqlx ([the contract](crate::design) §5): embedded and durable, for one node.
//!
//! The database runs in WAL mode, so reads never wait for the writer. Writes go through a
//! single connection (SQLite allows one writer at a time; queueing in the pool is cheaper than
//! `SQLITE_BUSY` retries), and every connection sets `busy_timeout` for other processes. A
//! claim first reads optimistically, so a replay or an in-progress answer is one statement,
//! then inserts conditionally (`INSERT … ON CONFLICT DO NOTHING`) and reads back on a conflict.
//! Times are integer milliseconds from the store's [`Clock`], which tests replace.
//!
//! ```no_run
//! # async fn example() -> Result<(), sqlx::Error> {
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::store::sqlite::SqliteStore;
//!
//! let store = SqliteStore::builder()
//!     .table("idempotency_records")
//!     .open("idempotency.db")
//!     .await?;
//! store.migrate().await?;
//! let idempotency = Idempotency::builder(store).build();
//! # Ok(()) }
//! ```

use std::path::Path;
mod enlisted;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
};
use sqlx::{AssertSqlSafe, Executor, Row};

use super::{
    Claim, ClaimRequest, FencingToken, InspectedRow, RecordInfo, RecordedResponse, Standing,
    StandingState, Store, StoreError,
};
use crate::clock::{Clock, SystemClock};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;
use crate::sql::{self, ConnectError, InvalidName, Lite, Migrations, STORE_NAMES, Step, TableName};

/// The versioned DDL shipped with the crate, in order (`{table}`: quoted name, `{name}`: bare).
/// Never edit a shipped migration: add one.
const MIGRATIONS: &[Step] = &[
    Step {
        version: 1,
        description: "create records",
        template: include_str!("../../migrations/sqlite/0001_create_records.sql"),
    },
    Step {
        version: 2,
        description: "record route and creation time",
        template: include_str!("../../migrations/sqlite/0002_record_route_and_creation.sql"),
    },
    Step {
        version: 3,
        description: "record trailers",
        template: include_str!("../../migrations/sqlite/0003_record_trailers.sql"),
    },
];

/// How often a claim retries when its record vanishes between its insert and its read-back.
const MAX_RERUNS: usize = 8;

/// The default table name.
pub(crate) const DEFAULT_TABLE: &str = "idempotency_records";

/// Builds a [`SqliteStore`].
#[must_use]
pub struct SqliteStoreBuilder {
    table: String,
    clock: Arc<dyn Clock>,
    busy_timeout: Duration,
    acquire_timeout: Duration,
    readers: u32,
}

impl std::fmt::Debug for SqliteStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStoreBuilder")
            .field("table", &self.table)
            .field("busy_timeout", &self.busy_timeout)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("readers", &self.readers)
            .finish_non_exhaustive()
    }
}

impl SqliteStoreBuilder {
    /// The table name (default `idempotency_records`): ASCII letters, digits and `_`, not
    /// starting with a digit, at most 48 characters. Another name fails
    /// [`open`](Self::open) with [`ConnectError::InvalidName`], before anything opens.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The clock that judges leases and expiry (default the system clock; tests inject a
    /// [`ManualClock`](crate::clock::ManualClock)).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// How long a connection waits for another process's lock on the file (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// How long an operation waits for a pooled connection, the single writer included, before
    /// failing with [`StoreError::Unavailable`] (503) (default 5 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Connections for reads (default 4); writes always use one connection.
    pub fn readers(mut self, readers: u32) -> Self {
        self.readers = readers.max(1);
        self
    }

    /// Opens (creating it if missing) the database file at `path`. Does not migrate: call
    /// [`SqliteStore::migrate`].
    pub async fn open(self, path: impl AsRef<Path>) -> Result<SqliteStore, ConnectError> {
        self.connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true),
        )
        .await
    }

    /// Opens the database described by `options` (a file: an in-memory database would give
    /// every connection a database of its own). WAL mode and `busy_timeout` are set here.
    pub async fn connect_with(
        self,
        options: SqliteConnectOptions,
    ) -> Result<SqliteStore, ConnectError> {
        let table = TableName::new(STORE_NAMES, None, &self.table)?;
        let options = options
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(self.busy_timeout);
        // The writer connects first so that the file exists and is in WAL mode before any
        // reader opens it.
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
            .connect_with(options.clone())
            .await?;
        let readers = SqlitePoolOptions::new()
            .max_connections(self.readers)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
            .connect_lazy_with(options.pragma("query_only", "ON"));
        Ok(SqliteStore {
            sql: Statements::new(&table.qualified),
            writer,
            readers,
            table,
            clock: self.clock,
            statements: AtomicU64::new(0),
        })
    }
}

struct Statements {
    read: Arc<str>,
    insert: Arc<str>,
    reclaim: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
    renew: Arc<str>,
    sweep: Arc<str>,
    inspect: Arc<str>,
    forget: Arc<str>,
}

impl Statements {
    fn new(t: &str) -> Self {
        Self {
            read: format!(
                "SELECT token, fingerprint, fp_version, state, lease_until, expires_at, status, \
                        headers, body, trailers \
                 FROM {t} WHERE scope = ?1 AND key = ?2"
            )
            .into(),
            // ?1 scope, ?2 key, ?3 token, ?4 fingerprint, ?5 version, ?6 lease_until,
            // ?7 expires_at, ?8 route, ?9 now.
            insert: format!(
                "INSERT INTO {t} (scope, key, token, fingerprint, fp_version, state, lease_until, \
                                  expires_at, route, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, 0, ?6, ?7, ?8, ?9) ON CONFLICT DO NOTHING"
            )
            .into(),
            // ?8 now, ?9 the stale token: an expired record (whoever holds it) or an abandoned
            // one still held by `stale`, the same rule as the in-memory store. ?10 the route.
            reclaim: format!(
                "UPDATE {t} SET token = ?3, fingerprint = ?4, fp_version = ?5, state = 0, \
                     lease_until = ?6, expires_at = ?7, status = NULL, headers = NULL, body = NULL, \
                     trailers = NULL, route = ?10, created_at = ?8 \
                 WHERE scope = ?1 AND key = ?2 \
                   AND (expires_at <= ?8 OR (token = ?9 AND state = 0 AND lease_until <= ?8))"
            )
            .into(),
            // ?4 status, ?5 headers, ?6 body, ?7 now, ?8 expires_at, ?9 trailers (NULL for
            // none). A resent completion that finds its own completed record (same token, same
            // answer) succeeds again.
            complete: format!(
                "UPDATE {t} SET state = 1, status = ?4, headers = ?5, body = ?6, \
                     lease_until = ?7, expires_at = ?8, trailers = ?9 \
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 \
                   AND (state = 0 OR (status = ?4 AND headers = ?5 AND body = ?6 \
                                      AND trailers IS ?9))"
            )
            .into(),
            release: format!(
                "DELETE FROM {t} WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 0"
            )
            .into(),
            // ?4 the new lease_until. A reservation expires `retention` after its lease: keep
            // that distance.
            renew: format!(
                "UPDATE {t} SET expires_at = ?4 + (expires_at - lease_until), lease_until = ?4 \
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 0"
            )
            .into(),
            // ?1 now, ?2 batch. The outer predicate re-checks expiry.
            sweep: format!(
                "DELETE FROM {t} WHERE (scope, key) IN \
                     (SELECT scope, key FROM {t} WHERE expires_at <= ?1 LIMIT ?2) \
                 AND expires_at <= ?1"
            )
            .into(),
            // ?3: whether to read the response too. Sizes come from the stored lengths.
            inspect: format!(
                "SELECT state, status, route, created_at, lease_until, expires_at, \
                        COALESCE(length(body), 0), COALESCE(length(headers), 0), \
                        CASE WHEN ?3 THEN headers END, CASE WHEN ?3 THEN body END, \
                        CASE WHEN ?3 THEN trailers END \
                 FROM {t} WHERE scope = ?1 AND key = ?2"
            )
            .into(),
            forget: format!("DELETE FROM {t} WHERE scope = ?1 AND key = ?2").into(),
        }
    }
}

/// The SQLite store. Cheap to share behind an `Arc`; build it with [`SqliteStore::open`] or
/// [`SqliteStore::builder`].
pub struct SqliteStore {
    writer: SqlitePool,
    readers: SqlitePool,
    table: TableName,
    sql: Statements,
    clock: Arc<dyn Clock>,
    statements: AtomicU64,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.table.name)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

fn corrupt(what: &str) -> StoreError {
    StoreError::unavailable(format!("corrupt idempotency record: {what}"))
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Judges a stored row by `now`, the same rule as the in-memory store.
fn standing(row: &SqliteRow, now: i64) -> Result<Standing, StoreError> {
    let get_i64 = |i: usize| row.try_get::<i64, _>(i).map_err(unavailable);
    let token = get_i64(0)?;
    let digest: Vec<u8> = row.try_get(1).map_err(unavailable)?;
    let fingerprint = Fingerprint {
        version: u16::try_from(get_i64(2)?).map_err(|_| corrupt("fingerprint version"))?,
        digest: digest
            .try_into()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?,
    };
    let (state, lease_until, expires_at) = (get_i64(3)?, get_i64(4)?, get_i64(5)?);
    let state = if now >= expires_at {
        StandingState::Expired
    } else if state == 1 {
        let status: Option<i64> = row.try_get(6).map_err(unavailable)?;
        let headers: Option<Vec<u8>> = row.try_get(7).map_err(unavailable)?;
        let body: Option<Vec<u8>> = row.try_get(8).map_err(unavailable)?;
        // NULL: no trailers (or a row written before they were kept).
        let trailers: Option<Vec<u8>> = row.try_get(9).map_err(unavailable)?;
        let recorded = RecordedResponse::new(
            status
                .and_then(|s| u16::try_from(s).ok())
                .ok_or_else(|| corrupt("completed without a status"))?,
            RecordedResponse::decode_headers(headers.as_deref().unwrap_or_default())
                .ok_or_else(|| corrupt("headers do not decode"))?,
            Bytes::from(body.unwrap_or_default()),
        )
        .with_trailers(
            RecordedResponse::decode_headers(trailers.as_deref().unwrap_or_default())
                .ok_or_else(|| corrupt("trailers do not decode"))?,
        );
        StandingState::Completed(Arc::new(recorded))
    } else if now < lease_until {
        StandingState::Running {
            lease_left: Duration::from_millis((lease_until - now) as u64),
        }
    } else {
        StandingState::Abandoned
    };
    let expires_in = matches!(state, StandingState::Completed(_))
        .then(|| Duration::from_millis((expires_at - now) as u64));
    Ok(Standing {
        token: FencingToken::from_i64(token),
        fingerprint,
        state,
        expires_in,
    })
}

impl SqliteStore {
    /// A builder: table `idempotency_records`, the system clock, `busy_timeout` 5 s, 4 readers.
    pub fn builder() -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            table: DEFAULT_TABLE.to_owned(),
            clock: Arc::new(SystemClock),
            busy_timeout: Duration::from_secs(5),
            acquire_timeout: Duration::from_secs(5),
            readers: 4,
        }
    }

    /// Opens (creating it if missing) the database file at `path` with the default settings.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), sqlx::Error> {
    /// use idempotent_runtime::store::sqlite::SqliteStore;
    ///
    /// let store = SqliteStore::open("idempotency.db").await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, ConnectError> {
        Self::builder().open(path).await
    }

    /// The pool of the single writer connection.
    pub fn writer(&self) -> &SqlitePool {
        &self.writer
    }

    /// The quoted table name.
    pub fn table(&self) -> &str {
        &self.table.qualified
    }

    /// Creates or upgrades the table to this crate's schema; idempotent, and safe from several
    /// processes at once (`BEGIN IMMEDIATE`). Applied versions are kept in `<table>_migrations`,
    /// with the checksum of the SQL each ran, never in sqlx's `_sqlx_migrations`. A version
    /// recorded with another checksum is refused with
    /// [`MigrateError::VersionMismatch`](sqlx::migrate::MigrateError::VersionMismatch) before
    /// anything runs.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sql::migrate::<Lite>(&self.writer, &self.table, MIGRATIONS).await
    }

    /// The DDL [`migrate`](Self::migrate) applies, rendered for `table`, for users who ship
    /// schema changes with their own migration tool: each step's SQL, in order, or a sqlx
    /// `Migrator` of them. Use either this or `migrate()` for a table, never both (see
    /// [`Migrations`]).
    ///
    /// ```
    /// use idempotent_runtime::store::sqlite::SqliteStore;
    ///
    /// let migrations = SqliteStore::migrations("idempotency_records")?;
    /// assert_eq!(migrations.iter().map(|m| m.version).collect::<Vec<_>>(), [1, 2, 3]);
    /// # Ok::<(), idempotent_runtime::store::InvalidName>(())
    /// ```
    pub fn migrations(table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::new(STORE_NAMES, None, table)?.migrations(MIGRATIONS))
    }

    /// Statements sent to the database so far.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn statements_executed(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    fn count(&self) {
        self.statements.fetch_add(1, Ordering::Relaxed);
    }

    fn now(&self) -> i64 {
        i64::try_from(self.clock.now_millis()).unwrap_or(i64::MAX)
    }

    /// The standing row under `(scope, key)`, read on `on` (a pool, or an enlisted
    /// transaction's connection).
    async fn read<'e>(
        &self,
        on: impl Executor<'e, Database = Sqlite>,
        scope: &ScopeHash,
        key: &str,
    ) -> Result<Option<Standing>, StoreError> {
        self.count();
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.read)))
            .bind(&scope[..])
            .bind(key)
            .fetch_optional(on)
            .await
            .map_err(unavailable)?;
        let now = self.now();
        row.map(|row| standing(&row, now)).transpose()
    }

    /// The claim's conditional insert on `on`: `true` when it inserted (acquired).
    async fn insert<'e>(
        &self,
        on: impl Executor<'e, Database = Sqlite>,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError> {
        let now = self.now();
        let lease_until = now.saturating_add(ms(req.lease));
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.insert)))
            .bind(&req.scope[..])
            .bind(req.key)
            .bind(req.token.as_i64())
            .bind(&req.fingerprint.digest[..])
            .bind(i64::from(req.fingerprint.version))
            .bind(lease_until)
            .bind(lease_until.saturating_add(ms(req.retention)))
            .bind(req.route)
            .bind(now)
            .execute(on)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    /// The reclaim's conditional update on `on`: `true` when it took the key over.
    async fn takeover<'e>(
        &self,
        on: impl Executor<'e, Database = Sqlite>,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<bool, StoreError> {
        let now = self.now();
        let lease_until = now.saturating_add(ms(req.lease));
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.reclaim)))
            .bind(&req.scope[..])
            .bind(req.key)
            .bind(req.token.as_i64())
            .bind(&req.fingerprint.digest[..])
            .bind(i64::from(req.fingerprint.version))
            .bind(lease_until)
            .bind(lease_until.saturating_add(ms(req.retention)))
            .bind(now)
            .bind(stale.as_i64())
            .bind(req.route)
            .execute(on)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    /// The completion's conditional update on `on`: `true` when `token` held the record.
    async fn complete_on<'e>(
        &self,
        on: impl Executor<'e, Database = Sqlite>,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.now();
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.complete)))
            .bind(&scope[..])
            .bind(key)
            .bind(token.as_i64())
            .bind(i64::from(response.status))
            .bind(response.encode_headers())
            .bind(&response.body[..])
            .bind(now)
            .bind(now.saturating_add(ms(retention)))
            .bind((!response.trailers.is_empty()).then(|| response.encode_trailers()))
            .execute(on)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }
}

fn still_running(req: &ClaimRequest<'_>) -> Claim {
    Claim::Standing(Standing {
        token: FencingToken(0),
        fingerprint: req.fingerprint,
        state: StandingState::Running {
            lease_left: req.lease,
        },
        expires_in: None,
    })
}

impl Store for SqliteStore {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        // Optimistic read: a replay or an in-progress answer costs this one statement.
        if let Some(standing) = self.read(&self.readers, req.scope, req.key).await? {
            return Ok(Claim::Standing(standing));
        }
        for _ in 0..MAX_RERUNS {
            if self.insert(&self.writer, req).await? {
                return Ok(Claim::Acquired);
            }
            // Lost the race to another claim: read back what won, through the writer, which
            // has seen every committed write.
            if let Some(standing) = self.read(&self.writer, req.scope, req.key).await? {
                return Ok(Claim::Standing(standing));
            }
        }
        Ok(still_running(req))
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        if self.takeover(&self.writer, req, stale).await? {
            return Ok(Claim::Acquired);
        }
        match self.read(&self.writer, req.scope, req.key).await? {
            Some(standing) => Ok(Claim::Standing(standing)),
            // Released or swept in between: claim it afresh.
            None => self.claim(req).await,
        }
    }

    async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.complete_on(&self.writer, scope, key, token, response, retention)
            .await
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.release)))
            .bind(&scope[..])
            .bind(key)
            .bind(token.as_i64())
            .execute(&self.writer)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let lease_until = self.now().saturating_add(ms(lease));
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.renew)))
            .bind(&scope[..])
            .bind(key)
            .bind(token.as_i64())
            .bind(lease_until)
            .execute(&self.writer)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        let now = self.now();
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.sweep)))
            .bind(now)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(&self.writer)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() as usize)
    }

    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        self.count();
        // Through the writer, which has seen every committed write: an operator who just
        // completed or forgot a record reads what they did.
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.inspect)))
            .bind(&scope[..])
            .bind(key)
            .bind(with_response)
            .fetch_optional(&self.writer)
            .await
            .map_err(unavailable)?;
        let now = self.now();
        row.map(|row| record_info(&row, now)).transpose()
    }

    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.forget)))
            .bind(&scope[..])
            .bind(key)
            .execute(&self.writer)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    /// Joins SQLite transactions ([enlisted mode](crate::enlisted)).
    fn enlisting(&self) -> Option<super::Enlisting<'_>> {
        Some(super::Enlisting::sqlite(self))
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }
}

/// A row of the inspect statement as what an operator sees, judged by `now`.
fn record_info(row: &SqliteRow, now: i64) -> Result<RecordInfo, StoreError> {
    let get = |i: usize| row.try_get::<i64, _>(i).map_err(unavailable);
    InspectedRow {
        completed: get(0)? == 1,
        status: row.try_get(1).map_err(unavailable)?,
        route: row.try_get(2).map_err(unavailable)?,
        created: row.try_get(3).map_err(unavailable)?,
        lease: get(4)?,
        expires: get(5)?,
        now,
        body_bytes: get(6)?,
        header_bytes: get(7)?,
        headers: row.try_get(8).map_err(unavailable)?,
        body: row.try_get(9).map_err(unavailable)?,
        trailers: row.try_get(10).map_err(unavailable)?,
    }
    .into_info()
}
