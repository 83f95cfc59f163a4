//! The MySQL / MariaDB outbox: messages written in the caller's transaction, claimed by relays
//! under a lease (InnoDB; `FOR UPDATE SKIP LOCKED` needs MySQL 8.0 or MariaDB 10.6).
//!
//! The per-key lock is a row of a small table beside the messages (`<table>_keys`), upserted
//! in the caller's transaction (`INSERT … ON DUPLICATE KEY UPDATE`) before the message's row:
//! InnoDB holds the row's exclusive lock until that transaction commits or rolls back, so it
//! is transaction-scoped like PostgreSQL's advisory lock, and works behind any connection pool.
//! `GET_LOCK` would not do: its lock belongs to the session, outlives the transaction, and
//! would be left held on a pooled connection by a transaction that ended without releasing it.
//!
//! MySQL has no `UPDATE … RETURNING`, so a relay's claim is a transaction of three statements
//! at `READ COMMITTED` (no gap locks, so enqueuers never wait on a relay): the candidates
//! locked with `FOR UPDATE SKIP LOCKED`, the head-of-key condition read again once they are
//! locked (a fresh read: a message committed before a locked candidate of its key is visible
//! to it), and the lease written on those that still qualify.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError, MySqlPool, MySqlRow};
use sqlx::{AssertSqlSafe, Row};

use crate::sql::{self, InvalidName, Migrations, My, OUTBOX_NAMES, Step, TableName};

use super::storage::{Claimed, Failed, Storage};
use super::{
    DEFAULT_RETENTION, DEFAULT_TABLE, Delivery, Enqueued, Message, OutboxError, OutboxRecord,
    OutboxStats, State, from_millis, millis,
};

/// The versioned DDL of the outbox's tables, in order. Never edit a shipped migration: add one.
const MIGRATIONS: &[Step] = &[Step {
    version: 1,
    description: "create outbox messages",
    template: include_str!("../../migrations/mysql_outbox/0001_create_outbox_messages.sql"),
}];

/// `ER_DUP_ENTRY`.
const DUPLICATE_KEY: u16 = 1062;

/// The database's clock in epoch milliseconds.
const NOW_MS: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) DIV 1000)";

/// The columns an [`OutboxRecord`] is read from.
fn record_columns() -> String {
    format!(
        "id, destination, ordering_key, state, attempts, last_error, enqueued_at, delivered_at, \
         available_at, CAST(COALESCE(lease_until > {NOW_MS}, 0) AS SIGNED), \
         CAST(OCTET_LENGTH(payload) AS SIGNED)"
    )
}

/// A transactional outbox in MySQL or MariaDB (InnoDB; [the contract](crate::design) §6), with
/// [`PostgresOutbox`](super::PostgresOutbox)'s operations and promises. Cheap to clone.
///
/// [`enqueue`](Self::enqueue) writes a [`Message`] through the caller's connection, inside the
/// caller's transaction: an [enlisted](crate::enlisted) handler's, an
/// [inbox](crate::inbox::MySqlInbox) handler's, or any sqlx transaction. A
/// [`Relay`](super::Relay) delivers what committed, polling (MySQL has no `NOTIFY`).
///
/// Relays' and operators' transactions run at `READ COMMITTED` (the caller's own transaction
/// keeps its level): with binary logging on, `binlog_format` must be `ROW` or `MIXED` (the
/// defaults of MySQL 8 and MariaDB), as InnoDB refuses writes at that level under `STATEMENT`.
///
/// ```no_run
/// use idempotent_runtime::outbox::{Delivery, Message, MySqlOutbox, PublishError, Publisher, Relay};
///
/// struct Print;
/// impl Publisher for Print {
///     async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
///         println!("{} → {}", d.id(), d.destination());
///         Ok(())
///     }
/// }
///
/// # async fn example(pool: sqlx::MySqlPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = MySqlOutbox::new(pool.clone());
/// outbox.migrate().await?;
///
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id, sku) VALUES (42, 'A1')").execute(&mut *tx).await?;
/// let placed = Message::new("order-42-placed", "orders.placed", r#"{"order":42}"#)
///     .ordered_by("order-42");
/// outbox.enqueue(&mut tx, placed).await?;
/// tx.commit().await?; // the order and its message, or neither
///
/// let relay: Relay<Print, MySqlOutbox> = Relay::new(outbox, Print);
/// tokio::spawn(relay.run());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MySqlOutbox {
    pool: MySqlPool,
    s: Arc<Settings>,
}

struct Settings {
    table: TableName,
    retention: Duration,
    lock_key_sql: Arc<str>,
    insert_sql: Arc<str>,
    candidates_sql: Arc<str>,
    /// The head-of-key check and the columns a claim publishes, `{seqs}` to be filled in.
    recheck_sql: String,
    /// The lease, `{seqs}` to be filled in.
    lease_sql: String,
    /// The claim's outcome rows, `{ids}` to be filled in.
    delivering_sql: String,
    delivered_sql: String,
    failing_sql: Arc<str>,
    failed_sql: Arc<str>,
    inspect_sql: Arc<str>,
    payload_sql: Arc<str>,
    dead_sql: Arc<str>,
    retrying_sql: Arc<str>,
    delete_sql: Arc<str>,
    reinsert_sql: Arc<str>,
    sweep_sql: Arc<str>,
    idle_keys_sql: Arc<str>,
    delete_keys_sql: String,
    stats_sql: Arc<str>,
}

impl fmt::Debug for MySqlOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlOutbox")
            .field("table", &self.s.table.qualified)
            .field("retention", &self.s.retention)
            .finish_non_exhaustive()
    }
}

/// Configures a [`MySqlOutbox`]; from [`MySqlOutbox::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::outbox::MySqlOutbox;
///
/// # async fn example(pool: sqlx::MySqlPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = MySqlOutbox::builder(pool)
///     .database("events")           // `events`.`order_events` and `events`.`order_events_keys`
///     .table("order_events")
///     .retention(Duration::from_secs(3 * 24 * 3600))
///     .build()?;
/// outbox.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct MySqlOutboxBuilder {
    pool: MySqlPool,
    database: Option<String>,
    table: String,
    retention: Duration,
}

impl MySqlOutboxBuilder {
    /// The database holding the tables (default: the connection's). `migrate()` creates it if
    /// missing.
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.database = Some(database.into());
        self
    }

    /// The table name (default `outbox_messages`); its keys' locks are in `<table>_keys`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long delivered messages are kept before [`MySqlOutbox::sweep`] deletes them (default
    /// 7 days). Within it, enqueuing the same id again is a no-op.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The outbox, or the database or table name it refuses: a lowercase SQL identifier
    /// (`[a-z_][a-z0-9_]*`; table names up to 48 bytes, database names up to 63).
    pub fn build(self) -> Result<MySqlOutbox, InvalidName> {
        let table =
            TableName::quoted_with(OUTBOX_NAMES, self.database.as_deref(), &self.table, '`')?;
        let t = &table.qualified;
        let keys = format!("{}`{}_keys`", table.prefix, table.name);
        let now = NOW_MS;
        // The key's lock: its row, created on the key's first use. Taken before the message's
        // row and its `seq` exist, so a second transaction enqueuing the same key waits here
        // until the first ends, and its `seq` comes after.
        let lock_key_sql = format!(
            "INSERT INTO {keys} (ordering_key) VALUES (?) \
             ON DUPLICATE KEY UPDATE ordering_key = ordering_key"
        );
        let insert_sql = format!(
            "INSERT INTO {t} (id, destination, ordering_key, headers, payload, available_at, \
               enqueued_at) VALUES (?, ?, ?, ?, ?, {now}, {now})"
        );
        // The head of each ordering key (no earlier pending message of that key, and none of
        // that key in flight under a live lease), and messages without a key, that are due
        // and not held by a live lease.
        let head = format!(
            "(o.ordering_key IS NULL OR NOT EXISTS (\
               SELECT 1 FROM {t} p WHERE p.ordering_key = o.ordering_key \
                 AND p.state = 'pending' AND (p.seq < o.seq OR p.lease_until > {now})))"
        );
        let due = format!(
            "o.state = 'pending' AND o.available_at <= {now} \
             AND (o.lease_until IS NULL OR o.lease_until <= {now})"
        );
        // Rows another relay is claiming right now are skipped, not waited for.
        let candidates_sql = format!(
            "SELECT o.seq FROM {t} o WHERE {due} AND {head} \
             ORDER BY o.seq LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        let recheck_sql = format!(
            "SELECT o.seq, o.id, o.destination, o.ordering_key, o.headers, o.payload, \
               o.attempts, o.enqueued_at FROM {t} o \
             WHERE o.seq IN ({{seqs}}) AND {due} AND {head} ORDER BY o.seq"
        );
        // A row already claimed `max_attempts` times (the first parameter) is one whose relays
        // kept stopping mid-publish: dead-lettered here, not leased. MySQL assigns left to
        // right, so `attempts` goes last and every test above reads its old value.
        let lease_sql = format!(
            "UPDATE {t} SET \
               state = IF(attempts >= ?, 'dead', state), \
               last_error = IF(attempts >= ?, CONCAT('claimed ', attempts, \
                 ' times without a recorded outcome: a relay stopped while publishing it each time'), \
                 last_error), \
               lease_until = IF(attempts >= ?, NULL, {now} + ?), \
               lease_token = IF(attempts >= ?, NULL, ?), \
               attempts = IF(attempts >= ?, attempts, attempts + 1) \
             WHERE seq IN ({{seqs}})"
        );
        let delivering_sql = format!(
            "SELECT id, destination, CAST({now} - enqueued_at AS SIGNED) FROM {t} \
             WHERE id IN ({{ids}}) AND lease_token = ? AND state = 'pending' FOR UPDATE"
        );
        let delivered_sql = format!(
            "UPDATE {t} SET state = 'delivered', delivered_at = {now}, lease_until = NULL, \
               lease_token = NULL, last_error = NULL \
             WHERE id IN ({{ids}}) AND lease_token = ? AND state = 'pending'"
        );
        let failing_sql = format!(
            "SELECT attempts FROM {t} WHERE id = ? AND lease_token = ? AND state = 'pending' \
             FOR UPDATE"
        );
        let failed_sql = format!(
            "UPDATE {t} SET lease_until = NULL, lease_token = NULL, last_error = ?, \
               available_at = {now} + ?, state = ? \
             WHERE id = ? AND lease_token = ? AND state = 'pending'"
        );
        let columns = record_columns();
        let inspect_sql = format!("SELECT {columns} FROM {t} WHERE id = ?");
        let payload_sql = format!("SELECT payload FROM {t} WHERE id = ?");
        let dead_sql =
            format!("SELECT {columns} FROM {t} WHERE state = 'dead' ORDER BY seq LIMIT ?");
        // A retried message goes to the back of its key: deleted and written again under the
        // key's lock (as an enqueue), so its new `seq` is after every message of its key
        // enqueued before it, committed or not.
        let retrying_sql = format!(
            "SELECT destination, ordering_key, headers, payload, enqueued_at, last_error \
             FROM {t} WHERE id = ? AND state = 'dead' FOR UPDATE"
        );
        let delete_sql = format!("DELETE FROM {t} WHERE id = ?");
        let reinsert_sql = format!(
            "INSERT INTO {t} (id, destination, ordering_key, headers, payload, available_at, \
               enqueued_at, last_error) VALUES (?, ?, ?, ?, ?, {now}, ?, ?)"
        );
        // Oldest first; the delete's own predicate is the re-check.
        let sweep_sql = format!(
            "DELETE FROM {t} WHERE state = 'delivered' AND delivered_at < {now} - ? \
             ORDER BY delivered_at LIMIT ?"
        );
        // Keys without a message, their lock free: an enqueue holding one is skipped (its
        // message is on the way), and one waiting for it finds the row gone and writes it again.
        let idle_keys_sql = format!(
            "SELECT k.ordering_key FROM {keys} k WHERE NOT EXISTS (\
               SELECT 1 FROM {t} m WHERE m.ordering_key = k.ordering_key) \
             LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        let delete_keys_sql = format!("DELETE FROM {keys} WHERE ordering_key IN ({{keys}})");
        let stats_sql = format!(
            "SELECT (SELECT COUNT(*) FROM {t} WHERE state = 'pending'), \
               (SELECT COUNT(*) FROM {t} WHERE state = 'dead'), \
               (SELECT CAST(COALESCE({now} - MIN(enqueued_at), 0) AS SIGNED) \
                  FROM {t} WHERE state = 'pending')"
        );
        Ok(MySqlOutbox {
            pool: self.pool,
            s: Arc::new(Settings {
                table,
                retention: self.retention,
                lock_key_sql: lock_key_sql.into(),
                insert_sql: insert_sql.into(),
                candidates_sql: candidates_sql.into(),
                recheck_sql,
                lease_sql,
                delivering_sql,
                delivered_sql,
                failing_sql: failing_sql.into(),
                failed_sql: failed_sql.into(),
                inspect_sql: inspect_sql.into(),
                payload_sql: payload_sql.into(),
                dead_sql: dead_sql.into(),
                retrying_sql: retrying_sql.into(),
                delete_sql: delete_sql.into(),
                reinsert_sql: reinsert_sql.into(),
                sweep_sql: sweep_sql.into(),
                idle_keys_sql: idle_keys_sql.into(),
                delete_keys_sql,
                stats_sql: stats_sql.into(),
            }),
        })
    }
}

/// The server's error number, for a database error.
fn number(e: &sqlx::Error) -> Option<u16> {
    e.as_database_error()?
        .try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

/// `n` placeholders, comma-separated.
fn placeholders(n: usize) -> String {
    let mut s = "?,".repeat(n);
    s.pop();
    s
}

/// Text stored as bytes (ids, ordering keys), back as the `String` it was written from.
fn text(bytes: Vec<u8>) -> Result<String, sqlx::Error> {
    String::from_utf8(bytes).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

fn headers(encoded: &[u8]) -> Result<Vec<(String, String)>, sqlx::Error> {
    serde_json::from_slice(encoded).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

fn record(row: &MySqlRow) -> Result<OutboxRecord, sqlx::Error> {
    let state: String = row.try_get(3)?;
    let attempts: i32 = row.try_get(4)?;
    let key: Option<Vec<u8>> = row.try_get(2)?;
    let delivered: Option<i64> = row.try_get(7)?;
    let leased: i64 = row.try_get(9)?;
    let payload_len: i64 = row.try_get(10)?;
    Ok(OutboxRecord {
        id: text(row.try_get(0)?)?,
        destination: row.try_get(1)?,
        ordering_key: key.map(text).transpose()?,
        state: State::parse(&state),
        attempts: attempts.max(0) as u32,
        last_error: row.try_get(5)?,
        enqueued_at: from_millis(row.try_get(6)?),
        delivered_at: delivered.map(from_millis),
        available_at: from_millis(row.try_get(8)?),
        leased: leased != 0,
        payload_len: payload_len.max(0) as usize,
    })
}

impl MySqlOutbox {
    /// An outbox in table `outbox_messages` (and `outbox_messages_keys`), keeping delivered
    /// messages 7 days.
    pub fn new(pool: MySqlPool) -> Self {
        Self::builder(pool)
            .build()
            .expect("the default table name is a valid identifier")
    }

    /// Configures an outbox.
    pub fn builder(pool: MySqlPool) -> MySqlOutboxBuilder {
        MySqlOutboxBuilder {
            pool,
            database: None,
            table: DEFAULT_TABLE.to_owned(),
            retention: DEFAULT_RETENTION,
        }
    }

    /// The pool relays and operators' calls run on.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table, backtick-quoted and database-qualified as it appears in SQL.
    pub fn qualified_table(&self) -> &str {
        &self.s.table.qualified
    }

    /// Creates the database (if configured), the tables and their indexes, or upgrades them,
    /// through versioned migrations recorded in `<table>_migrations`. Idempotent, and safe to
    /// run from several processes at once (they queue on a `GET_LOCK` named after the table).
    /// To apply the DDL with a migration tool of your own instead, see
    /// [`migrations`](Self::migrations).
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sql::migrate::<My>(&self.pool, &self.s.table, MIGRATIONS).await
    }

    /// The DDL [`migrate`](Self::migrate) applies, rendered for `table` in `database`.
    ///
    /// ```
    /// use idempotent_runtime::outbox::MySqlOutbox;
    ///
    /// let migrations = MySqlOutbox::migrations(None, "outbox_messages")?;
    /// assert!(migrations.iter().next().unwrap().sql.contains("`outbox_messages_keys`"));
    /// # Ok::<(), idempotent_runtime::store::InvalidName>(())
    /// ```
    pub fn migrations(database: Option<&str>, table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::quoted_with(OUTBOX_NAMES, database, table, '`')?.migrations(MIGRATIONS))
    }

    /// Writes `message` through `conn`, which must be inside the caller's transaction (a
    /// `sqlx::Transaction` as `&mut tx`, an [`EnlistedTx<MySql>`](crate::enlisted::EnlistedTx)
    /// as `tx.conn()`, an inbox handler's connection): it is sent once that transaction
    /// commits, and never if it rolls back. One row; for a message with an ordering key, also
    /// the key's lock row below, written on the key's first use.
    ///
    /// A message with an ordering key first locks that key in this outbox: it upserts the
    /// key's row in `<table>_keys`, whose exclusive row lock InnoDB holds until the transaction
    /// ends, so that, per key, messages go out in the order their transactions commit.
    /// Consequences: a second transaction enqueuing the same key waits in its `enqueue` until
    /// the first commits or rolls back, at most the session's `innodb_lock_wait_timeout` (the
    /// server's default is 50 s; the connections of a pool the MySQL store built set its
    /// `lock_wait_timeout`, 1 s by default); past it, error 1205, and the transaction must roll
    /// back. Keep such transactions short after their
    /// enqueue. Two transactions that enqueue several keys in different orders can deadlock:
    /// InnoDB detects it and rolls one back (error 1213); enqueue a transaction's keys in a
    /// fixed order (sorted, say). The key is its table's primary key, so the upsert locks the
    /// key's row alone, at any isolation level, never a gap: keys do not wait for their
    /// neighbours. Messages without an ordering key take no lock.
    ///
    /// A message whose id is already in the outbox (pending, delivered within the retention,
    /// or dead) is not written again: [`Enqueued::AlreadyEnqueued`], after taking the key's
    /// lock as PostgreSQL does (a retry of the same change, with the same key, finds the key's
    /// row there: nothing is written). An invalid message is refused before any statement
    /// ([`OutboxError::Invalid`]); after a database error, roll the transaction back.
    pub async fn enqueue(
        &self,
        conn: &mut MySqlConnection,
        message: Message,
    ) -> Result<Enqueued, OutboxError> {
        message.validate()?;
        let headers = serde_json::to_vec(&message.headers).expect("strings encode as JSON");
        if let Some(key) = &message.ordering_key {
            sqlx::query(AssertSqlSafe(self.s.lock_key_sql.clone()))
                .bind(key.as_bytes())
                .execute(&mut *conn)
                .await?;
        }
        let inserted = sqlx::query(AssertSqlSafe(self.s.insert_sql.clone()))
            .bind(message.id.as_bytes())
            .bind(message.destination)
            .bind(message.ordering_key.as_deref().map(str::as_bytes))
            .bind(headers)
            .bind(message.payload.as_ref())
            .execute(&mut *conn)
            .await;
        match inserted {
            Ok(_) => Ok(Enqueued::New),
            // The table's only unique keys are the id and the AUTO_INCREMENT `seq`.
            Err(e) if number(&e) == Some(DUPLICATE_KEY) => Ok(Enqueued::AlreadyEnqueued),
            Err(e) => Err(e.into()),
        }
    }

    /// Runs `f` in a transaction of its own at `READ COMMITTED`: InnoDB then takes no gap
    /// locks, so a relay's or an operator's locking reads never make an enqueue wait, and each
    /// statement reads what committed before it.
    async fn in_tx<T, F>(&self, f: F) -> Result<T, sqlx::Error>
    where
        F: for<'c> FnOnce(&'c mut MySqlConnection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        let mut conn = self.pool.acquire().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *conn)
            .await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let value = f(&mut tx).await?;
        tx.commit().await?;
        Ok(value)
    }

    /// See [`Storage::claim`].
    async fn claim(
        &self,
        batch: usize,
        lease: Duration,
        token: i64,
        max_attempts: u32,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        let s = self.s.clone();
        let max = i64::from(max_attempts);
        let rows = self
            .in_tx(move |conn| {
                Box::pin(async move {
                    let seqs: Vec<i64> =
                        sqlx::query_scalar(AssertSqlSafe(s.candidates_sql.clone()))
                            .bind(batch.min(i64::MAX as usize) as i64)
                            .fetch_all(&mut *conn)
                            .await?;
                    if seqs.is_empty() {
                        return Ok(Vec::new());
                    }
                    // Read again with the candidates locked: a message of the same key that
                    // committed before a candidate is visible now, whatever the first read saw.
                    let sql = s.recheck_sql.replace("{seqs}", &placeholders(seqs.len()));
                    let mut recheck = sqlx::query(AssertSqlSafe(sql)).persistent(false);
                    for seq in &seqs {
                        recheck = recheck.bind(*seq);
                    }
                    let rows = recheck.fetch_all(&mut *conn).await?;
                    if rows.is_empty() {
                        return Ok(rows);
                    }
                    let sql = s.lease_sql.replace("{seqs}", &placeholders(rows.len()));
                    let mut update = sqlx::query(AssertSqlSafe(sql))
                        .persistent(false)
                        .bind(max)
                        .bind(max)
                        .bind(max)
                        .bind(millis(lease))
                        .bind(max)
                        .bind(token)
                        .bind(max);
                    for row in &rows {
                        update = update.bind(row.try_get::<i64, _>(0)?);
                    }
                    update.execute(&mut *conn).await?;
                    Ok(rows)
                })
            })
            .await?;
        rows.iter()
            .map(|row| {
                let attempts: i32 = row.try_get(6)?;
                let spent = i64::from(attempts) >= max;
                let key: Option<Vec<u8>> = row.try_get(3)?;
                let encoded: Vec<u8> = row.try_get(4)?;
                let payload: Vec<u8> = row.try_get(5)?;
                let message = Message {
                    id: text(row.try_get(1)?)?,
                    destination: row.try_get(2)?,
                    ordering_key: key.map(text).transpose()?,
                    headers: headers(&encoded)?,
                    payload: payload.into(),
                };
                let attempt = if spent { attempts } else { attempts + 1 };
                let enqueued_at: SystemTime = from_millis(row.try_get(7)?);
                Ok(Claimed {
                    delivery: Delivery::new(message, attempt.max(1) as u32, enqueued_at),
                    spent,
                })
            })
            .collect()
    }

    /// See [`Storage::delivered`].
    async fn delivered(
        &self,
        ids: Vec<String>,
        token: i64,
    ) -> Result<Vec<(String, Duration)>, sqlx::Error> {
        let s = self.s.clone();
        let rows: Vec<(Vec<u8>, String, i64)> = self
            .in_tx(move |conn| {
                Box::pin(async move {
                    let sql = s.delivering_sql.replace("{ids}", &placeholders(ids.len()));
                    let mut select = sqlx::query_as(AssertSqlSafe(sql)).persistent(false);
                    for id in &ids {
                        select = select.bind(id.as_bytes());
                    }
                    let rows: Vec<(Vec<u8>, String, i64)> =
                        select.bind(token).fetch_all(&mut *conn).await?;
                    if rows.is_empty() {
                        return Ok(rows);
                    }
                    let sql = s.delivered_sql.replace("{ids}", &placeholders(rows.len()));
                    let mut update = sqlx::query(AssertSqlSafe(sql)).persistent(false);
                    for (id, _, _) in &rows {
                        update = update.bind(id.as_slice());
                    }
                    update.bind(token).execute(&mut *conn).await?;
                    Ok(rows)
                })
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|(_, d, ms)| (d, Duration::from_millis(ms.max(0) as u64)))
            .collect())
    }

    /// See [`Storage::failed`].
    async fn failed(
        &self,
        id: &str,
        token: i64,
        error: &str,
        delay: Duration,
        permanent: bool,
        max_attempts: u32,
    ) -> Result<Failed, sqlx::Error> {
        let s = self.s.clone();
        let (id, error) = (id.to_owned(), error.to_owned());
        self.in_tx(move |conn| {
            Box::pin(async move {
                let attempts: Option<i32> =
                    sqlx::query_scalar(AssertSqlSafe(s.failing_sql.clone()))
                        .bind(id.as_bytes())
                        .bind(token)
                        .fetch_optional(&mut *conn)
                        .await?;
                let Some(attempts) = attempts else {
                    return Ok(Failed::LeaseLost);
                };
                let dead = permanent || i64::from(attempts) >= i64::from(max_attempts);
                sqlx::query(AssertSqlSafe(s.failed_sql.clone()))
                    .bind(error)
                    .bind(millis(delay))
                    .bind(if dead { "dead" } else { "pending" })
                    .bind(id.as_bytes())
                    .bind(token)
                    .execute(&mut *conn)
                    .await?;
                Ok(if dead { Failed::Dead } else { Failed::Retrying })
            })
        })
        .await
    }

    /// What the outbox knows of message `id`, without its payload; `None` if it is not there
    /// (never enqueued, committed yet, or swept).
    pub async fn inspect(&self, id: &str) -> Result<Option<OutboxRecord>, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(self.s.inspect_sql.clone()))
            .bind(id.as_bytes())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(record).transpose()
    }

    /// The payload of message `id`, for an operator who asked for it.
    pub async fn payload(&self, id: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar(AssertSqlSafe(self.s.payload_sql.clone()))
            .bind(id.as_bytes())
            .fetch_optional(&self.pool)
            .await
    }

    /// Up to `limit` dead-lettered messages, oldest first, each with its last error.
    pub async fn dead_letters(&self, limit: usize) -> Result<Vec<OutboxRecord>, sqlx::Error> {
        let rows = sqlx::query(AssertSqlSafe(self.s.dead_sql.clone()))
            .bind(limit.min(i64::MAX as usize) as i64)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(record).collect()
    }

    /// Puts a dead-lettered message back to be delivered now, its attempts counted from zero;
    /// `false` if `id` is not dead-lettered.
    ///
    /// A message with an ordering key goes to the back of its key: it is delivered after every
    /// message of that key enqueued before the retry (one in flight or pending included), never
    /// beside one. Like [`enqueue`](Self::enqueue), it takes the key's lock, so it waits for
    /// transactions that enqueued the key and are still open.
    pub async fn retry(&self, id: &str) -> Result<bool, sqlx::Error> {
        let s = self.s.clone();
        let id = id.to_owned();
        self.in_tx(move |conn| {
            Box::pin(async move {
                type Dead = (
                    String,
                    Option<Vec<u8>>,
                    Vec<u8>,
                    Vec<u8>,
                    i64,
                    Option<String>,
                );
                let dead: Option<Dead> = sqlx::query_as(AssertSqlSafe(s.retrying_sql.clone()))
                    .bind(id.as_bytes())
                    .fetch_optional(&mut *conn)
                    .await?;
                let Some((destination, key, headers, payload, enqueued_at, last_error)) = dead
                else {
                    return Ok(false);
                };
                if let Some(key) = &key {
                    sqlx::query(AssertSqlSafe(s.lock_key_sql.clone()))
                        .bind(key.as_slice())
                        .execute(&mut *conn)
                        .await?;
                }
                sqlx::query(AssertSqlSafe(s.delete_sql.clone()))
                    .bind(id.as_bytes())
                    .execute(&mut *conn)
                    .await?;
                sqlx::query(AssertSqlSafe(s.reinsert_sql.clone()))
                    .bind(id.as_bytes())
                    .bind(destination)
                    .bind(key)
                    .bind(headers)
                    .bind(payload)
                    .bind(enqueued_at)
                    .bind(last_error)
                    .execute(&mut *conn)
                    .await?;
                Ok(true)
            })
        })
        .await
    }

    /// Deletes message `id` whatever its state: a dead letter an operator gave up on, or a
    /// pending message that must not go out (a relay publishing it right now may still
    /// deliver it once). Afterwards the id may be enqueued again. `false` if it was not there.
    pub async fn discard(&self, id: &str) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(self.s.delete_sql.clone()))
            .bind(id.as_bytes())
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// How many messages are pending and dead, and the age of the oldest pending one.
    pub async fn stats(&self) -> Result<OutboxStats, sqlx::Error> {
        let (pending, dead, oldest): (i64, i64, i64) =
            sqlx::query_as(AssertSqlSafe(self.s.stats_sql.clone()))
                .fetch_one(&self.pool)
                .await?;
        Ok(OutboxStats {
            pending: pending.max(0) as u64,
            dead: dead.max(0) as u64,
            oldest_pending: Duration::from_millis(oldest.max(0) as u64),
        })
    }

    /// Deletes up to `batch` messages delivered longer ago than the retention, re-checking the
    /// age in the delete itself, and up to `batch` ordering keys' lock rows whose keys have no
    /// message left; returns how many messages. A full batch means more may remain.
    pub async fn sweep(&self, batch: usize) -> Result<usize, sqlx::Error> {
        let s = self.s.clone();
        let limit = batch.min(i64::MAX as usize) as i64;
        let deleted = self
            .in_tx(move |conn| {
                Box::pin(async move {
                    let done = sqlx::query(AssertSqlSafe(s.sweep_sql.clone()))
                        .bind(millis(s.retention))
                        .bind(limit)
                        .execute(&mut *conn)
                        .await?;
                    Ok(done.rows_affected() as usize)
                })
            })
            .await?;
        let s = self.s.clone();
        let keys = self
            .in_tx(move |conn| {
                Box::pin(async move {
                    let keys: Vec<Vec<u8>> =
                        sqlx::query_scalar(AssertSqlSafe(s.idle_keys_sql.clone()))
                            .bind(limit)
                            .fetch_all(&mut *conn)
                            .await?;
                    if keys.is_empty() {
                        return Ok(0);
                    }
                    let sql = s
                        .delete_keys_sql
                        .replace("{keys}", &placeholders(keys.len()));
                    let mut delete = sqlx::query(AssertSqlSafe(sql)).persistent(false);
                    for key in &keys {
                        delete = delete.bind(key.as_slice());
                    }
                    Ok(delete.execute(&mut *conn).await?.rows_affected())
                })
            })
            .await?;
        #[cfg(feature = "metrics")]
        metrics::counter!("idempotent_outbox_swept_total").increment(deleted as u64);
        if deleted > 0 || keys > 0 {
            tracing::debug!(deleted, keys, table = %self.s.table.qualified, "outbox: swept delivered messages and idle keys");
        }
        Ok(deleted)
    }

    /// Sweeps in batches of 500 on a cadence of `min(retention, 1 h)`, again at once while
    /// batches come back full; a failed sweep is logged and retried at the next tick. Runs until
    /// the handle is aborted. Must be called inside a Tokio runtime.
    pub fn spawn_sweeper(&self) -> tokio::task::JoinHandle<()> {
        let outbox = self.clone();
        crate::inbox::spawn_sweep_loop(
            format!("outbox {}", self.s.table.qualified),
            self.s.retention,
            move || {
                let outbox = outbox.clone();
                async move { outbox.sweep(crate::inbox::DEFAULT_SWEEP_BATCH).await }
            },
        )
    }
}

impl Storage for MySqlOutbox {
    fn claim(
        &self,
        batch: usize,
        lease: Duration,
        token: i64,
        max_attempts: u32,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>> {
        Box::pin(MySqlOutbox::claim(self, batch, lease, token, max_attempts))
    }

    fn delivered(
        &self,
        ids: Vec<String>,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<(String, Duration)>, sqlx::Error>> {
        Box::pin(MySqlOutbox::delivered(self, ids, token))
    }

    fn failed<'a>(
        &'a self,
        id: &'a str,
        token: i64,
        error: &'a str,
        delay: Duration,
        permanent: bool,
        max_attempts: u32,
    ) -> BoxFuture<'a, Result<Failed, sqlx::Error>> {
        Box::pin(MySqlOutbox::failed(
            self,
            id,
            token,
            error,
            delay,
            permanent,
            max_attempts,
        ))
    }

    fn stats(&self) -> BoxFuture<'_, Result<OutboxStats, sqlx::Error>> {
        Box::pin(MySqlOutbox::stats(self))
    }
}
