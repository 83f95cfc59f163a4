//! The MySQL / MariaDB store, through sqlx ([the contract](crate::design) §5): several replicas
//! share one InnoDB table. Tested on MariaDB 10.11; the SQL is the subset MySQL 8 shares.
//!
//! **How the race is decided.** A claim is one plain `INSERT` of the reservation (no `IGNORE`,
//! no `ON DUPLICATE KEY UPDATE`): the primary key `(scope, key)` decides. The request that
//! inserts has acquired, in one round trip. The others fail with the duplicate-key error
//! (1062) and read the standing row back with a consistent (non-locking) read, a second round
//! trip, and answer from it (replay, 409 or 422). So:
//!
//! - a first request costs two round trips (claim, complete), as on PostgreSQL;
//! - a replay or an in-progress answer costs two statements, and **writes nothing**: the
//!   failed `INSERT` changes no row and writes no undo or redo, and a statement that fails is
//!   never written to the binary log, in any `binlog_format`. It holds a shared lock on the
//!   standing row for the statement's duration (InnoDB's duplicate check), which only a writer
//!   of that same row (its sweep or forget) could meet.
//!
//! Measured on MariaDB 10.11 with `--log-bin --binlog-format=STATEMENT` (the worst case for the
//! binary log), over replays of one completed key: this claim wrote 0 bytes of redo and 0 bytes
//! of binary log in 1,000 replays; in 100 replays of the same row, `INSERT IGNORE` wrote 19,200
//! bytes of binary log (192 a replay) and `INSERT … ON DUPLICATE KEY UPDATE token = token` 22,300,
//! and with another session holding a shared lock on the row the plain `INSERT` answered at once
//! while `ON DUPLICATE KEY UPDATE` waited out its lock wait timeout (it takes an exclusive lock
//! even when its assignments change nothing). `INSERT IGNORE` also turns errors into warnings
//! (a truncated value would be stored silently), and sqlx connects with `CLIENT_FOUND_ROWS`,
//! under which `ROW_COUNT()` cannot tell a no-op duplicate from an insert. A read before the
//! insert would make a replay one statement but every first request three.
//!
//! Taking over an expired record, or an abandoned one with the same fingerprint, is one more
//! token-conditional `UPDATE` ([`Store::reclaim`]). Completing, releasing and renewing are
//! single statements conditional on the fencing token; with `CLIENT_FOUND_ROWS` their affected
//! rows are the rows their condition matched, so a resent completion that finds its own
//! completed record succeeds again.
//!
//! **Lock waits are bounded.** Every connection of the store's pool sets `innodb_lock_wait_timeout`
//! and `lock_wait_timeout` (default 1 s, whole seconds, MySQL's minimum): a claim that meets
//! another transaction's uncommitted row for its key (an open transaction holding it) answers
//! in progress (409) after at most that long, never waits for that transaction. A deadlock
//! victim (1213) is sent again.
//!
//! **Every operation is bounded on the client** by
//! [`operation_timeout`](MySqlStoreBuilder::operation_timeout) (default `lock_wait_timeout` +
//! 10 s): across a network partition MySQL's answer never comes and TCP resends for about 15
//! minutes, so past the bound the operation fails as unavailable (503), as on PostgreSQL.
//!
//! **Times** are milliseconds since the UNIX epoch by the database's clock
//! (`UTC_TIMESTAMP(3)`, whatever the session's time zone), so replicas never disagree about a
//! lease.
//!
//! **Group commit** is not done here, unlike PostgreSQL: InnoDB already merges the log flushes
//! of concurrent commits (measured with `innodb_flush_log_at_trx_commit = 1`: 2,000 first-request
//! claims made 1.04 fsyncs a claim from one task, 175 a second, and 0.17 from 16 tasks, 6,000 a
//! second), and MySQL has no statement that inserts many rows and answers, row by row, which of
//! them conflicted and with what: a batched claim would need a second statement to find out, the
//! round trip it was meant to save.
//!
//! The schema ships with the crate and is applied by [`MySqlStore::migrate`], which keeps its
//! own version table and serialises replicas on a `GET_LOCK` named after the table.
//!
//! ```no_run
//! # async fn example() -> Result<(), sqlx::Error> {
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::store::mysql::MySqlStore;
//!
//! let store = MySqlStore::builder()
//!     .table("idempotency_records")
//!     .connect("mysql://app@db:3306/app")
//!     .await?;
//! store.migrate().await?;
//! let idempotency = Idempotency::builder(store).build();
//! # Ok(()) }
//! ```

mod enlisted;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::{AssertSqlSafe, Executor as _, Row};

use super::{
    Claim, ClaimRequest, FencingToken, InspectedRow, RecordInfo, RecordedResponse, Standing,
    StandingState, Store, StoreError,
};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;
use crate::sql::{self, ConnectError, InvalidName, Migrations, My, STORE_NAMES, Step, TableName};

/// The versioned DDL shipped with the crate, in order (`{table}`: the backtick-quoted,
/// qualified name, `{name}`: the bare one). Never edit a shipped migration: add one.
const MIGRATIONS: &[Step] = &[Step {
    version: 1,
    description: "create records",
    template: include_str!("../../migrations/mysql/0001_create_records.sql"),
}];

/// The default table name.
pub(crate) const DEFAULT_TABLE: &str = "idempotency_records";

/// How often a claim is sent again when its read-back finds nothing (the standing row was
/// deleted in between) or it was chosen as a deadlock victim.
const MAX_RERUNS: usize = 8;

/// `ER_DUP_ENTRY`: the primary key refused the insert.
const DUPLICATE_KEY: u16 = 1062;
/// `ER_LOCK_WAIT_TIMEOUT`: `innodb_lock_wait_timeout` (or `lock_wait_timeout`) elapsed.
const LOCK_WAIT_TIMEOUT: u16 = 1205;
/// `ER_LOCK_DEADLOCK`: the statement was rolled back to break a deadlock.
const DEADLOCK: u16 = 1213;

/// The database's clock in epoch milliseconds, moved by the test offset bound at its `?`.
const NOW: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(3)) DIV 1000 + ?)";

/// Builds a [`MySqlStore`]: the table's name and database, and the settings of the pool it
/// opens.
#[derive(Debug, Clone)]
#[must_use]
pub struct MySqlStoreBuilder {
    database: Option<String>,
    table: String,
    lock_wait_timeout: Duration,
    acquire_timeout: Duration,
    max_connections: u32,
    operation_timeout: Option<Duration>,
}

impl MySqlStoreBuilder {
    /// The table name (default `idempotency_records`): ASCII letters, digits and `_`, not
    /// starting with a digit, at most 48 characters (its index and version table are named
    /// after it). Another name fails [`build`](Self::build) with [`InvalidName`], and
    /// [`connect`](Self::connect) with [`ConnectError::InvalidName`], before anything connects.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The database (MySQL's schema) holding the table (default: the connection's). Same
    /// naming rules as [`table`](Self::table); `migrate()` creates it.
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.database = Some(database.into());
        self
    }

    /// `innodb_lock_wait_timeout` and `lock_wait_timeout` of the store's connections (default
    /// 1 s, rounded up to whole seconds, at least 1): a claim that meets another transaction's
    /// uncommitted row for the same key waits at most this long, then reports the key as in
    /// progress (409) instead of waiting for that transaction.
    pub fn lock_wait_timeout(mut self, timeout: Duration) -> Self {
        self.lock_wait_timeout = timeout;
        self
    }

    /// How long an operation waits for a pooled connection before failing with
    /// [`StoreError::Unavailable`] (503) (default 2 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long a store operation (claim with its read-back, reclaim, completion, release,
    /// renewal, inspect, forget, sweep, and enlisted mode's glance, lock and statements) waits
    /// for MySQL's answer before it fails with [`StoreError::Unavailable`] (default:
    /// [`lock_wait_timeout`](Self::lock_wait_timeout) + 10 s, 11 s with the defaults, as the
    /// PostgreSQL store's `statement_timeout` + 1 s: MySQL has no server-side timeout for
    /// writes, so the bound is the longest lock wait plus the PostgreSQL store's statement
    /// allowance, never shorter than a lock wait the server would end itself). Across a network
    /// partition nothing comes back, not even an error (TCP keeps resending for about 15
    /// minutes): without this bound a claim would hang there instead of answering 503, and a
    /// renewal could not see its lease lapse. The outcome of an operation cut off is unknown,
    /// as after a dropped connection.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = Some(timeout);
        self
    }

    fn effective_operation_timeout(&self) -> Duration {
        self.operation_timeout
            .unwrap_or(self.lock_wait_timeout + Duration::from_secs(10))
    }

    /// Size of the pool the store opens (default 10).
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// Opens a pool to `url` (`mysql://user:password@host:3306/database`) with these settings
    /// and builds the store over it. Does not migrate: call [`MySqlStore::migrate`] (once per
    /// deployment is enough; it is safe from several replicas at once).
    pub async fn connect(self, url: &str) -> Result<MySqlStore, ConnectError> {
        let options: MySqlConnectOptions = url.parse()?;
        self.connect_with(options).await
    }

    /// As [`connect`](Self::connect), from parsed connect options.
    pub async fn connect_with(
        self,
        options: MySqlConnectOptions,
    ) -> Result<MySqlStore, ConnectError> {
        let table = self.table_name()?;
        let session = session_settings(self.lock_wait_timeout);
        let pool = MySqlPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            // A ping before every checkout would add a round trip to every operation; a dead
            // connection fails its statement instead, and the token-conditional writes are sent
            // again on another.
            .test_before_acquire(false)
            .after_connect(set_session(Arc::clone(&session)))
            .connect_lazy_with(options);
        Ok(MySqlStore::with_table(
            pool,
            table,
            session,
            self.effective_operation_timeout(),
        ))
    }

    /// Builds the store over an existing pool. The pool's connections should set
    /// `innodb_lock_wait_timeout` low (see [`lock_wait_timeout`](Self::lock_wait_timeout)):
    /// without it, a claim that meets another transaction's uncommitted row waits up to the
    /// server's default, 50 s. The pool settings of this builder do not apply. Fails only on a
    /// bad table or database name (which converts into `sqlx::Error` with `?`).
    pub fn build(self, pool: MySqlPool) -> Result<MySqlStore, InvalidName> {
        let session = session_settings(self.lock_wait_timeout);
        Ok(MySqlStore::with_table(
            pool,
            self.table_name()?,
            session,
            self.effective_operation_timeout(),
        ))
    }

    fn table_name(&self) -> Result<TableName, InvalidName> {
        TableName::quoted_with(STORE_NAMES, self.database.as_deref(), &self.table, '`')
    }
}

/// The session settings of the store's connections: lock waits bounded to `timeout` (whole
/// seconds, at least 1, MySQL's minimum).
fn session_settings(timeout: Duration) -> Arc<str> {
    let secs = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
    format!(
        "SET SESSION innodb_lock_wait_timeout = {s}, lock_wait_timeout = {s}",
        s = secs.max(1)
    )
    .into()
}

/// A pool's `after_connect` hook that applies [`session_settings`].
#[allow(clippy::type_complexity)]
fn set_session(
    session: Arc<str>,
) -> impl for<'c> Fn(
    &'c mut sqlx::MySqlConnection,
    sqlx::pool::PoolConnectionMetadata,
) -> futures_util::future::BoxFuture<'c, Result<(), sqlx::Error>>
+ Send
+ Sync
+ 'static {
    move |conn, _| {
        let session = Arc::clone(&session);
        Box::pin(async move {
            conn.execute(AssertSqlSafe(session)).await?;
            Ok(())
        })
    }
}

/// The statements, rendered once for the configured table. Each `?` is bound in the order it
/// appears; [`NOW`] takes the clock offset.
struct Statements {
    insert: Arc<str>,
    read: Arc<str>,
    reclaim: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
    renew: Arc<str>,
    expired: Arc<str>,
    inspect: Arc<str>,
    forget: Arc<str>,
}

impl Statements {
    fn new(t: &str) -> Self {
        Self {
            // offset, scope, key, token, fingerprint, version, lease, lease, retention,
            // retention, route. A reservation expires `retention` after its lease; the sweeper's
            // `sweep_after` is the earliest the record can expire (claim time plus retention).
            insert: format!(
                "INSERT INTO {t} (scope, `key`, token, fingerprint, fp_version, state, \
                                  lease_until, expires_at, sweep_after, route, created_at) \
                 SELECT ?, ?, ?, ?, ?, 0, c.now + ?, c.now + ? + ?, c.now + ?, ?, c.now \
                 FROM (SELECT {NOW} AS now) c"
            )
            .into(),
            // offset, scope, key. Phase: 0 running, 1 abandoned, 2 completed, 3 expired.
            read: format!(
                "SELECT r.token, r.fingerprint, r.fp_version, \
                        CAST(CASE WHEN r.expires_at <= c.now THEN 3 \
                                  WHEN r.state = 1 THEN 2 \
                                  WHEN r.lease_until > c.now THEN 0 \
                                  ELSE 1 END AS SIGNED), \
                        CAST(GREATEST(0, r.lease_until - c.now) AS SIGNED), \
                        r.status, r.headers, r.body, \
                        CAST(GREATEST(0, r.expires_at - c.now) AS SIGNED), r.trailers \
                 FROM (SELECT {NOW} AS now) c JOIN {t} r \
                 WHERE r.scope = ? AND r.`key` = ?"
            )
            .into(),
            // token, fingerprint, version, offset+lease, offset+lease+retention,
            // offset+retention, route, offset (created_at), scope, key, offset, stale, offset.
            // Takes over an expired record (whoever holds it) or an abandoned one still held by
            // `stale`, the same rule as the in-memory store.
            reclaim: format!(
                "UPDATE {t} SET token = ?, fingerprint = ?, fp_version = ?, state = 0, \
                     lease_until = {NOW} + ?, expires_at = {NOW} + ? + ?, \
                     sweep_after = {NOW} + ?, status = NULL, headers = NULL, body = NULL, \
                     trailers = NULL, route = ?, created_at = {NOW} \
                 WHERE scope = ? AND `key` = ? \
                   AND (expires_at <= {NOW} \
                        OR (token = ? AND state = 0 AND lease_until <= {NOW}))"
            )
            .into(),
            // status, headers, body, trailers, offset, offset, retention, offset, retention,
            // scope, key, token, status, headers, body, trailers. A resent completion that finds
            // its own completed record (same token, same answer) matches again; `<=>` because a
            // record without trailers holds NULL. Only a completion kept for less
            // than the claim's retention moves `sweep_after` (the index) earlier.
            complete: format!(
                "UPDATE {t} SET state = 1, status = ?, headers = ?, body = ?, trailers = ?, \
                     lease_until = {NOW}, expires_at = {NOW} + ?, \
                     sweep_after = LEAST(sweep_after, {NOW} + ?) \
                 WHERE scope = ? AND `key` = ? AND token = ? \
                   AND (state = 0 OR (status = ? AND headers = ? AND body = ? \
                                      AND trailers <=> ?))"
            )
            .into(),
            release: format!(
                "DELETE FROM {t} WHERE scope = ? AND `key` = ? AND token = ? AND state = 0"
            )
            .into(),
            // offset, lease, offset, lease, scope, key, token. Assignments run left to right
            // on the row: `expires_at` keeps its distance from the old `lease_until`.
            renew: format!(
                "UPDATE {t} SET expires_at = {NOW} + ? + (expires_at - lease_until), \
                     lease_until = {NOW} + ? \
                 WHERE scope = ? AND `key` = ? AND token = ? AND state = 0"
            )
            .into(),
            // offset, offset, limit: the sweep's candidates, by a consistent read (no locks);
            // the delete of each re-checks expiry on the row it locks.
            expired: format!(
                "SELECT scope, `key` FROM {t} \
                 WHERE sweep_after <= {NOW} AND expires_at <= {NOW} LIMIT ?"
            )
            .into(),
            // with, with, with, offset, scope, key. Sizes come from the stored lengths; the response
            // only when asked for.
            inspect: format!(
                "SELECT r.state, r.status, r.route, r.created_at, r.lease_until, r.expires_at, \
                        c.now, CAST(COALESCE(LENGTH(r.body), 0) AS SIGNED), \
                        CAST(COALESCE(LENGTH(r.headers), 0) AS SIGNED), \
                        CASE WHEN ? THEN r.headers END, CASE WHEN ? THEN r.body END, \
                        CASE WHEN ? THEN r.trailers END \
                 FROM (SELECT {NOW} AS now) c JOIN {t} r WHERE r.scope = ? AND r.`key` = ?"
            )
            .into(),
            forget: format!("DELETE FROM {t} WHERE scope = ? AND `key` = ?").into(),
        }
    }
}

/// The MySQL / MariaDB store. Cheap to share behind an `Arc`; build it with
/// [`MySqlStore::connect`], [`MySqlStore::new`] or [`MySqlStore::builder`].
pub struct MySqlStore {
    core: Arc<Core>,
    table: TableName,
    /// Enlisted mode's statements and the pool its transactions run on.
    enlisted: enlisted::Transactions,
    /// How long an operation waits for MySQL.
    operation_timeout: Duration,
}

/// What every statement needs, shared with the tasks that send claims.
struct Core {
    pool: MySqlPool,
    /// The session settings every connection of the store's own pools starts with.
    session: Arc<str>,
    sql: Statements,
    /// `` `db`.`table` `` or `` `table` ``, for the sweep's delete.
    table: String,
    clock_offset_ms: AtomicI64,
    statements: AtomicU64,
}

impl std::fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.table.qualified)
            .finish_non_exhaustive()
    }
}

fn millis_i64(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

fn corrupt(what: &str) -> StoreError {
    StoreError::unavailable(format!("corrupt idempotency record: {what}"))
}

/// The server's error number, for a database error.
fn number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Whether the connection a statement went out on was already gone: the socket failed, or the
/// server said so (killed: 1927, shutting down: 1053, gone: 2006/2013, SQLSTATE 08S01).
fn connection_dropped(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => {
            matches!(number(e), Some(1053 | 1927 | 2006 | 2013 | 4031))
                || db.code().as_deref() == Some("08S01")
        }
        _ => false,
    }
}

/// A statement with its parameters bound.
type MyQuery<'q> = sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>;

/// What a claim's `INSERT` that failed with `e` means, when it is an answer and not a failure.
fn inserted(e: &sqlx::Error) -> Option<Inserted> {
    match number(e) {
        Some(DUPLICATE_KEY) => Some(Inserted::Duplicate),
        Some(LOCK_WAIT_TIMEOUT) => Some(Inserted::Busy),
        Some(DEADLOCK) => Some(Inserted::Again),
        _ => None,
    }
}

/// A completion's values, encoded once (a completion sent again binds them again).
struct Completion<'a> {
    scope: &'a ScopeHash,
    key: &'a str,
    token: i64,
    status: i64,
    headers: Vec<u8>,
    body: &'a [u8],
    /// `None` (NULL) for an answer without trailers, as the other SQL stores keep it.
    trailers: Option<Vec<u8>>,
    retention: i64,
}

impl<'a> Completion<'a> {
    fn new(
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        response: &'a RecordedResponse,
        retention: Duration,
    ) -> Self {
        Self {
            scope,
            key,
            token: token.as_i64(),
            status: i64::from(response.status),
            headers: response.encode_headers(),
            body: &response.body,
            trailers: (!response.trailers.is_empty()).then(|| response.encode_trailers()),
            retention: millis_i64(retention),
        }
    }

    /// The completion's `UPDATE`, bound.
    fn query(&'a self, core: &Core) -> MyQuery<'a> {
        let off = core.offset();
        sqlx::query(AssertSqlSafe(Arc::clone(&core.sql.complete)))
            .bind(self.status)
            .bind(&self.headers[..])
            .bind(self.body)
            .bind(self.trailers.as_deref())
            .bind(off)
            .bind(off)
            .bind(self.retention)
            .bind(off)
            .bind(self.retention)
            .bind(&self.scope[..])
            .bind(self.key.as_bytes())
            .bind(self.token)
            .bind(self.status)
            .bind(&self.headers[..])
            .bind(self.body)
            .bind(self.trailers.as_deref())
    }
}

/// What the claim's `INSERT` did.
enum Inserted {
    Acquired,
    /// The key stands: read it back.
    Duplicate,
    /// Another transaction's uncommitted row held the key past the lock wait timeout.
    Busy,
    /// Chosen as a deadlock victim and rolled back: send it again.
    Again,
}

/// A claim's parameters, owned, for the task that sends them.
struct ClaimRow {
    scope: ScopeHash,
    key: String,
    token: i64,
    fingerprint: Fingerprint,
    lease: i64,
    retention: i64,
    route: String,
}

impl ClaimRow {
    fn new(req: &ClaimRequest<'_>) -> Self {
        Self {
            scope: *req.scope,
            key: req.key.to_owned(),
            token: req.token.as_i64(),
            fingerprint: req.fingerprint,
            lease: millis_i64(req.lease),
            retention: millis_i64(req.retention),
            route: req.route.to_owned(),
        }
    }
}

/// A key whose state cannot be read: another transaction holds it. Reported as running, with
/// the request's own fingerprint and lease (the holder's are unknown), token 0.
fn busy(req: &ClaimRequest<'_>) -> Standing {
    Standing {
        token: FencingToken(0),
        fingerprint: req.fingerprint,
        state: StandingState::Running {
            lease_left: req.lease,
        },
        expires_in: None,
    }
}

impl Core {
    fn offset(&self) -> i64 {
        self.clock_offset_ms.load(Ordering::SeqCst)
    }

    fn count(&self) {
        self.statements.fetch_add(1, Ordering::Relaxed);
    }

    /// Sends a token-conditional write (complete, release, renew, forget) and returns the rows
    /// it matched, sending it again when the connection it went out on was already dead (a
    /// restart, a failover or `KILL` leaves such connections in the pool, which does not ping
    /// before lending one). The write is conditional on the token, so sending it twice can
    /// neither apply twice nor touch a new holder's record.
    async fn conditional_write<'q>(
        &self,
        query: impl Fn() -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<u64, StoreError> {
        let mut attempts_left = self.pool.options().get_max_connections();
        loop {
            self.count();
            match query().execute(&self.pool).await {
                Ok(done) => return Ok(done.rows_affected()),
                Err(e) if attempts_left > 0 && connection_dropped(&e) => attempts_left -= 1,
                Err(e) => return Err(unavailable(e)),
            }
        }
    }

    /// The claim's `INSERT`; sent again on a connection that was already dead (if the first
    /// attempt was written after all, the second meets it as a duplicate and reads back the
    /// request's own token, which the engine takes as acquired).
    async fn insert(&self, row: &ClaimRow) -> Result<Inserted, StoreError> {
        let mut attempts_left = self.pool.options().get_max_connections();
        loop {
            self.count();
            let done = self.insert_query(row).execute(&self.pool).await;
            return match done {
                Ok(_) => Ok(Inserted::Acquired),
                Err(e) => match inserted(&e) {
                    Some(inserted) => Ok(inserted),
                    None if attempts_left > 0 && connection_dropped(&e) => {
                        attempts_left -= 1;
                        continue;
                    }
                    None => Err(unavailable(e)),
                },
            };
        }
    }

    /// The claim's `INSERT` of `row`, bound.
    fn insert_query<'q>(&self, row: &'q ClaimRow) -> MyQuery<'q> {
        sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.insert)))
            .bind(&row.scope[..])
            .bind(row.key.as_bytes())
            .bind(row.token)
            .bind(&row.fingerprint.digest[..])
            .bind(i64::from(row.fingerprint.version))
            .bind(row.lease)
            .bind(row.lease)
            .bind(row.retention)
            .bind(row.retention)
            .bind(row.route.as_str())
            .bind(self.offset())
    }

    /// The read of the standing row under `(scope, key)`, bound.
    fn read_query<'q>(&self, scope: &'q ScopeHash, key: &'q str) -> MyQuery<'q> {
        sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.read)))
            .bind(self.offset())
            .bind(&scope[..])
            .bind(key.as_bytes())
    }

    /// The reclaim's `UPDATE` of `row` over the record `stale` held, bound.
    fn takeover_query<'q>(&self, row: &'q ClaimRow, stale: FencingToken) -> MyQuery<'q> {
        let off = self.offset();
        sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.reclaim)))
            .bind(row.token)
            .bind(&row.fingerprint.digest[..])
            .bind(i64::from(row.fingerprint.version))
            .bind(off)
            .bind(row.lease)
            .bind(off)
            .bind(row.lease)
            .bind(row.retention)
            .bind(off)
            .bind(row.retention)
            .bind(row.route.as_str())
            .bind(off)
            .bind(&row.scope[..])
            .bind(row.key.as_bytes())
            .bind(off)
            .bind(stale.as_i64())
            .bind(off)
    }

    /// The standing row under `(scope, key)`, judged by the database's clock; `None` when there
    /// is none. A consistent read: no lock, and it sees every row committed before it began.
    async fn read(&self, scope: &ScopeHash, key: &str) -> Result<Option<Standing>, StoreError> {
        self.count();
        let row = self
            .read_query(scope, key)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        row.map(|row| standing(&row)).transpose()
    }

    /// The reclaim's `UPDATE`: `Some(true)` when it took the key over, `Some(false)` when the
    /// record was not takeable, `None` when another transaction held the row too long.
    async fn takeover(
        &self,
        row: &ClaimRow,
        stale: FencingToken,
    ) -> Result<Option<bool>, StoreError> {
        let mut attempts_left = self.pool.options().get_max_connections();
        loop {
            self.count();
            let done = self.takeover_query(row, stale).execute(&self.pool).await;
            return match done {
                Ok(done) => Ok(Some(done.rows_affected() == 1)),
                Err(e) => match number(&e) {
                    Some(LOCK_WAIT_TIMEOUT | DEADLOCK) => Ok(None),
                    _ if attempts_left > 0 && connection_dropped(&e) => {
                        attempts_left -= 1;
                        continue;
                    }
                    _ => Err(unavailable(e)),
                },
            };
        }
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let rows = self
            .conditional_write(|| {
                sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.release)))
                    .bind(&scope[..])
                    .bind(key.as_bytes())
                    .bind(token.as_i64())
            })
            .await?;
        Ok(rows == 1)
    }
}

/// What a claim's write did: the insert of [`Store::claim`], or the takeover of
/// [`Store::reclaim`].
enum Sent {
    Inserted(Inserted),
    TookOver(Option<bool>),
}

impl Core {
    async fn send(&self, row: &ClaimRow, stale: Option<FencingToken>) -> Result<Sent, StoreError> {
        match stale {
            None => self.insert(row).await.map(Sent::Inserted),
            Some(stale) => self.takeover(row, stale).await.map(Sent::TookOver),
        }
    }
}

/// Sends a claim's write ([`Core::send`]) from a task of its own, so that if the request stops
/// waiting (client gone, server shutting down) while it is in flight, the reservation it may
/// have committed is released there under its own token instead of standing at 409 for a
/// whole lease ([the contract](crate::design) §3).
async fn send_unheard_safe(
    core: &Arc<Core>,
    row: ClaimRow,
    stale: Option<FencingToken>,
) -> Result<Sent, StoreError> {
    let (answer, answer_rx) = tokio::sync::oneshot::channel();
    let core = Arc::clone(core);
    tokio::spawn(async move {
        let out = core.send(&row, stale).await;
        // A failed write may have been committed before the failure.
        let holds = matches!(
            out,
            Ok(Sent::Inserted(Inserted::Acquired) | Sent::TookOver(Some(true))) | Err(_)
        );
        if answer.send(out).is_err() && holds {
            let token = FencingToken::from_i64(row.token);
            if let Err(error) = core.release(&row.scope, &row.key, token).await {
                tracing::warn!(
                    %error,
                    "could not release a claim whose request was gone; its key stands until its lease lapses"
                );
            }
        }
    });
    answer_rx
        .await
        .unwrap_or_else(|_| Err(StoreError::unavailable("the task sending the claim ended")))
}

/// The standing record of a [`Statements::read`] row.
fn standing(row: &MySqlRow) -> Result<Standing, StoreError> {
    let get = |i: usize| row.try_get::<i64, _>(i).map_err(unavailable);
    let token = get(0)?;
    let digest: Vec<u8> = row.try_get(1).map_err(unavailable)?;
    let fingerprint = Fingerprint {
        version: u16::try_from(get(2)?).map_err(|_| corrupt("fingerprint version"))?,
        digest: digest
            .try_into()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?,
    };
    let state = match get(3)? {
        0 => StandingState::Running {
            lease_left: Duration::from_millis(get(4)?.max(0) as u64),
        },
        1 => StandingState::Abandoned,
        2 => {
            let status: Option<i64> = row.try_get(5).map_err(unavailable)?;
            let headers: Option<Vec<u8>> = row.try_get(6).map_err(unavailable)?;
            let body: Option<Vec<u8>> = row.try_get(7).map_err(unavailable)?;
            let trailers: Option<Vec<u8>> = row.try_get(9).map_err(unavailable)?;
            let response = RecordedResponse::new(
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
            StandingState::Completed(Arc::new(response))
        }
        _ => StandingState::Expired,
    };
    let expires_in = matches!(state, StandingState::Completed(_))
        .then(|| get(8).map(|left| Duration::from_millis(left.max(0) as u64)))
        .transpose()?;
    Ok(Standing {
        token: FencingToken::from_i64(token),
        fingerprint,
        state,
        expires_in,
    })
}

impl MySqlStore {
    /// A builder: table `idempotency_records` in the connection's database, lock waits of 1 s,
    /// a pool of 10.
    pub fn builder() -> MySqlStoreBuilder {
        MySqlStoreBuilder {
            database: None,
            table: DEFAULT_TABLE.to_owned(),
            lock_wait_timeout: Duration::from_secs(1),
            acquire_timeout: Duration::from_secs(2),
            max_connections: 10,
            operation_timeout: None,
        }
    }

    /// Opens a pool to `url` with the default settings (see [`builder`](Self::builder)).
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), sqlx::Error> {
    /// use idempotent_runtime::store::mysql::MySqlStore;
    ///
    /// let store = MySqlStore::connect("mysql://app@db:3306/app").await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, ConnectError> {
        Self::builder().connect(url).await
    }

    /// The store over an existing pool, with the default table `idempotency_records` in the
    /// connection's database. See [`MySqlStoreBuilder::build`] about `innodb_lock_wait_timeout`.
    pub fn new(pool: MySqlPool) -> Self {
        let table = TableName::quoted_with(STORE_NAMES, None, DEFAULT_TABLE, '`')
            .expect("the default table name is valid");
        let builder = Self::builder();
        let session = session_settings(builder.lock_wait_timeout);
        Self::with_table(pool, table, session, builder.effective_operation_timeout())
    }

    fn with_table(
        pool: MySqlPool,
        table: TableName,
        session: Arc<str>,
        operation_timeout: Duration,
    ) -> Self {
        Self {
            operation_timeout,
            enlisted: enlisted::Transactions::new(&table.qualified),
            core: Arc::new(Core {
                sql: Statements::new(&table.qualified),
                table: table.qualified.clone(),
                session,
                pool,
                clock_offset_ms: AtomicI64::new(0),
                statements: AtomicU64::new(0),
            }),
            table,
        }
    }

    /// `operation` bounded by the store's [`operation_timeout`]: past it, unavailable. A
    /// statement cut off leaves its connection with an answer pending; sqlx does not lend it
    /// again before it has read that answer and a ping's (or closes it), as after any future
    /// dropped mid-statement.
    ///
    /// [`operation_timeout`]: MySqlStoreBuilder::operation_timeout
    fn bounded<T>(
        &self,
        operation: impl Future<Output = Result<T, StoreError>>,
    ) -> impl Future<Output = Result<T, StoreError>> {
        crate::sql::bounded("MySQL", self.operation_timeout, operation)
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &MySqlPool {
        &self.core.pool
    }

    /// The quoted, qualified table name, e.g. `` `app`.`idempotency_records` ``.
    pub fn table(&self) -> &str {
        &self.table.qualified
    }

    /// Creates or upgrades the table to this crate's schema. Safe to call from several replicas
    /// at once (they queue on a `GET_LOCK` named after the table, for up to 60 s) and
    /// idempotent. Applied versions are kept in `<table>_migrations` beside the table, with the
    /// checksum of the SQL each ran, never in sqlx's `_sqlx_migrations`. A version recorded
    /// with another checksum is refused with
    /// [`MigrateError::VersionMismatch`](sqlx::migrate::MigrateError::VersionMismatch) before
    /// anything runs.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sql::migrate::<My>(&self.core.pool, &self.table, MIGRATIONS).await
    }

    /// The DDL [`migrate`](Self::migrate) applies, rendered for `table` in `database` (`None`:
    /// the connection's), for users who ship schema changes with their own migration tool:
    /// each step's SQL, in order, or a sqlx `Migrator` of them. Use either this or `migrate()`
    /// for a table, never both (see [`Migrations`]).
    ///
    /// ```
    /// use idempotent_runtime::store::mysql::MySqlStore;
    ///
    /// let migrations = MySqlStore::migrations(None, "idempotency_records")?;
    /// assert_eq!(migrations.iter().map(|m| m.version).collect::<Vec<_>>(), [1]);
    /// assert!(migrations.iter().next().unwrap().sql.contains("`idempotency_records`"));
    /// # Ok::<(), idempotent_runtime::store::InvalidName>(())
    /// ```
    pub fn migrations(database: Option<&str>, table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::quoted_with(STORE_NAMES, database, table, '`')?.migrations(MIGRATIONS))
    }

    /// Moves the store's clock forward by `by` (an offset added to the database's clock in
    /// every statement), so the contract suite can test leases and retention without sleeping.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn advance_clock_for_tests(&self, by: Duration) {
        self.core
            .clock_offset_ms
            .fetch_add(millis_i64(by), Ordering::SeqCst);
    }

    /// Statements sent to the database so far (each one round trip).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn statements_executed(&self) -> u64 {
        self.core.statements.load(Ordering::Relaxed)
    }
}

impl MySqlStore {
    /// [`Store::claim`], unbounded.
    async fn claim_unbounded(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        for _ in 0..MAX_RERUNS {
            let Sent::Inserted(inserted) =
                send_unheard_safe(&self.core, ClaimRow::new(req), None).await?
            else {
                unreachable!("an insert is answered as an insert")
            };
            match inserted {
                Inserted::Acquired => return Ok(Claim::Acquired),
                Inserted::Busy => return Ok(Claim::Standing(busy(req))),
                Inserted::Again => continue,
                Inserted::Duplicate => {
                    if let Some(standing) = self.core.read(req.scope, req.key).await? {
                        return Ok(Claim::Standing(standing));
                    }
                    // Deleted between the insert and the read (released, swept): again.
                }
            }
        }
        // Every attempt met a record that came and went: the key is being fought over right
        // now, which is what "in progress" means.
        Ok(Claim::Standing(busy(req)))
    }

    /// [`Store::reclaim`], unbounded.
    async fn reclaim_unbounded(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        let Sent::TookOver(took) =
            send_unheard_safe(&self.core, ClaimRow::new(req), Some(stale)).await?
        else {
            unreachable!("a takeover is answered as a takeover")
        };
        match took {
            Some(true) => Ok(Claim::Acquired),
            None => Ok(Claim::Standing(busy(req))),
            Some(false) => match self.core.read(req.scope, req.key).await? {
                Some(standing) => Ok(Claim::Standing(standing)),
                // Released or swept in between: claim it afresh.
                None => self.claim_unbounded(req).await,
            },
        }
    }

    /// [`Store::sweep`], unbounded.
    async fn sweep_unbounded(&self, batch: usize) -> Result<usize, StoreError> {
        let off = self.core.offset();
        self.core.count();
        let candidates: Vec<(Vec<u8>, Vec<u8>)> =
            sqlx::query_as(AssertSqlSafe(Arc::clone(&self.core.sql.expired)))
                .bind(off)
                .bind(off)
                .bind(i64::try_from(batch).unwrap_or(i64::MAX))
                .fetch_all(&self.core.pool)
                .await
                .map_err(unavailable)?;
        if candidates.is_empty() {
            return Ok(0);
        }
        let keys = vec!["(scope = ? AND `key` = ?)"; candidates.len()].join(" OR ");
        let sql = format!(
            "DELETE FROM {} WHERE expires_at <= {NOW} AND ({keys})",
            self.core.table
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).persistent(false).bind(off);
        for (scope, key) in &candidates {
            query = query.bind(&scope[..]).bind(&key[..]);
        }
        self.core.count();
        let done = query.execute(&self.core.pool).await.map_err(unavailable)?;
        Ok(done.rows_affected() as usize)
    }
}

impl Store for MySqlStore {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.bounded(self.claim_unbounded(req)).await
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.bounded(self.reclaim_unbounded(req, stale)).await
    }

    async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let completion = Completion::new(scope, key, token, response, retention);
        let rows = self
            .bounded(self.core.conditional_write(|| completion.query(&self.core)))
            .await?;
        Ok(rows == 1)
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.bounded(self.core.release(scope, key, token)).await
    }

    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let (lease, off) = (millis_i64(lease), self.core.offset());
        let rows = self
            .bounded(self.core.conditional_write(|| {
                sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.renew)))
                    .bind(off)
                    .bind(lease)
                    .bind(off)
                    .bind(lease)
                    .bind(&scope[..])
                    .bind(key.as_bytes())
                    .bind(token.as_i64())
            }))
            .await?;
        Ok(rows == 1)
    }

    /// Two statements a batch: the candidates by a consistent read (no locks, so it never
    /// holds a range of the index against new claims), then one delete of exactly those rows by
    /// primary key that re-checks their expiry, so a key reclaimed or renewed in between is
    /// never freed.
    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        self.bounded(self.sweep_unbounded(batch)).await
    }

    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        self.core.count();
        let query = sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.inspect)))
            .bind(with_response)
            .bind(with_response)
            .bind(with_response)
            .bind(self.core.offset())
            .bind(&scope[..])
            .bind(key.as_bytes());
        let row = self
            .bounded(async {
                query
                    .fetch_optional(&self.core.pool)
                    .await
                    .map_err(unavailable)
            })
            .await?;
        row.map(|row| record_info(&row)).transpose()
    }

    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        let rows = self
            .bounded(self.core.conditional_write(|| {
                sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.forget)))
                    .bind(&scope[..])
                    .bind(key.as_bytes())
            }))
            .await?;
        Ok(rows == 1)
    }

    fn kind(&self) -> &'static str {
        "mysql"
    }

    /// Joins MySQL / MariaDB transactions ([enlisted mode](crate::enlisted)).
    fn enlisting(&self) -> Option<super::Enlisting<'_>> {
        Some(super::Enlisting::mysql(self))
    }
}

/// A row of the inspect statement as what an operator sees.
fn record_info(row: &MySqlRow) -> Result<RecordInfo, StoreError> {
    let get = |i: usize| row.try_get::<i64, _>(i).map_err(unavailable);
    InspectedRow {
        completed: get(0)? == 1,
        status: row.try_get(1).map_err(unavailable)?,
        route: row.try_get(2).map_err(unavailable)?,
        created: row.try_get(3).map_err(unavailable)?,
        lease: get(4)?,
        expires: get(5)?,
        now: get(6)?,
        body_bytes: get(7)?,
        header_bytes: get(8)?,
        headers: row.try_get(9).map_err(unavailable)?,
        body: row.try_get(10).map_err(unavailable)?,
        trailers: row.try_get(11).map_err(unavailable)?,
    }
    .into_info()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_bind_the_clock_where_they_say() {
        let s = Statements::new("`t`");
        // The comments above each statement list its parameters in order; these counts keep
        // them honest.
        let params = |sql: &str| sql.matches('?').count();
        assert_eq!(params(&s.insert), 11);
        assert_eq!(params(&s.read), 3);
        assert_eq!(params(&s.reclaim), 17);
        assert_eq!(params(&s.complete), 16);
        assert_eq!(params(&s.renew), 7);
        assert_eq!(params(&s.expired), 3);
        assert_eq!(params(&s.inspect), 6);
        assert!(s.forget.contains("`key`"), "`key` is reserved in MySQL");
    }
}
