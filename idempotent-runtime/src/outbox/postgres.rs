//! The PostgreSQL outbox: messages written in the caller's transaction, claimed by relays under
//! a lease.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::Notify;

use crate::sql::{self, InvalidName, Migrations, OUTBOX_NAMES, Pg, Step, TableName};

use super::storage::{Claimed, Failed, Storage};
use super::{
    DEFAULT_RETENTION, DEFAULT_TABLE, Delivery, Enqueued, Message, OutboxError, OutboxRecord,
    OutboxStats, State, from_millis, millis,
};

/// The versioned DDL of the outbox's table, in order. Never edit a shipped migration: add one.
const MIGRATIONS: &[Step] = &[Step {
    version: 1,
    description: "create outbox messages",
    template: include_str!("../../migrations/postgres_outbox/0001_create_outbox_messages.sql"),
}];

/// The columns an [`OutboxRecord`] is read from.
const RECORD_COLUMNS: &str = "id, destination, ordering_key, state, attempts, last_error, \
     (extract(epoch FROM enqueued_at) * 1000)::bigint, \
     (extract(epoch FROM delivered_at) * 1000)::bigint, \
     (extract(epoch FROM available_at) * 1000)::bigint, \
     COALESCE(lease_until > now(), false), octet_length(payload)";

/// A transactional outbox in PostgreSQL ([the contract](crate::design) §6).
///
/// [`enqueue`](Self::enqueue) writes a [`Message`] through the caller's connection, inside the
/// caller's transaction: an [enlisted](crate::enlisted) handler's, an [inbox](crate::inbox)
/// handler's, or any sqlx transaction. A [`Relay`](super::Relay) delivers what committed.
///
/// ```no_run
/// use idempotent_runtime::outbox::{Message, PostgresOutbox};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = PostgresOutbox::new(pool.clone());
/// outbox.migrate().await?;
///
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id, sku) VALUES (42, 'A1')").execute(&mut *tx).await?;
/// let placed = Message::new("order-42-placed", "orders.placed", r#"{"order":42}"#)
///     .ordered_by("order-42");
/// outbox.enqueue(&mut tx, placed).await?;
/// tx.commit().await?; // the order and its message, or neither
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresOutbox {
    pool: PgPool,
    s: Arc<Settings>,
}

struct Settings {
    table: TableName,
    channel: String,
    notify: bool,
    named: bool,
    retention: Duration,
    enqueue_sql: Arc<str>,
    claim_sql: Arc<str>,
    delivered_sql: Arc<str>,
    failed_sql: Arc<str>,
    inspect_sql: Arc<str>,
    payload_sql: Arc<str>,
    dead_sql: Arc<str>,
    retry_sql: Arc<str>,
    discard_sql: Arc<str>,
    sweep_sql: Arc<str>,
    stats_sql: Arc<str>,
}

impl fmt::Debug for PostgresOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresOutbox")
            .field("table", &self.s.table.qualified)
            .field("notify", &self.s.notify)
            .field("retention", &self.s.retention)
            .finish_non_exhaustive()
    }
}

/// Configures a [`PostgresOutbox`]; from [`PostgresOutbox::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct PostgresOutboxBuilder {
    pool: PgPool,
    schema: Option<String>,
    table: String,
    retention: Duration,
    notify: bool,
    transaction_pooler: bool,
}

impl PostgresOutboxBuilder {
    /// The schema holding the table (default: the connection's `search_path`). `migrate()`
    /// creates it if missing.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The table name (default `outbox_messages`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long delivered messages are kept before [`PostgresOutbox::sweep`] deletes them (default
    /// 7 days). Within it, enqueuing the same id again is a no-op.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Whether [`enqueue`](PostgresOutbox::enqueue) wakes listening relays with a `NOTIFY` that
    /// PostgreSQL delivers at commit (default `false`: relays poll, every 100 ms by default).
    /// A notifying commit takes a lock that serialises every notifying commit on the server:
    /// in one run of `outbox_bench` (16 concurrent enlisted first requests) the message alone
    /// kept 0.80× the throughput without it, the message and its `NOTIFY` 0.46×. Turn
    /// it on when messages are rare and each must leave at once; relays `LISTEN` then, and
    /// still poll as the fallback.
    pub fn notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Whether the pool reaches PostgreSQL through a connection pooler in transaction pooling
    /// mode (default `false`): statements are then unnamed and each runs in a transaction of its
    /// own, and relays poll rather than `LISTEN` (a pooler does not keep a session's listeners).
    pub fn transaction_pooler(mut self, behind: bool) -> Self {
        self.transaction_pooler = behind;
        self
    }

    /// The outbox, or the schema or table name it refuses: a lowercase SQL identifier
    /// (`[a-z_][a-z0-9_]*`; table names up to 50 bytes, schema names up to 63).
    pub fn build(self) -> Result<PostgresOutbox, InvalidName> {
        let table = TableName::new(OUTBOX_NAMES, self.schema.as_deref(), &self.table)?;
        let t = &table.qualified;
        let digest = Sha256::digest(format!("idempotent-outbox:{t}"));
        let channel = format!("idempotent_outbox_{}", hex(&digest[..8]));
        // The lock of an ordering key in this table: a transaction-scoped advisory lock on a
        // 64-bit hash of the key, seeded by the table, taken before the row and its `seq`
        // exist. The row is selected from the count of the lock's (zero or one) rows, so
        // PostgreSQL takes the lock before it draws `seq`; a second transaction enqueuing the
        // same key waits there until the first commits or rolls back, and its message's `seq`
        // comes after. Within a key, `seq` order is then commit order. No key, no lock.
        let lock_seed = i64::from_be_bytes(
            Sha256::digest(format!("idempotent-outbox-lock:{t}"))[..8]
                .try_into()
                .expect("8 bytes"),
        );
        let insert = format!(
            "INSERT INTO {t} (id, destination, ordering_key, header_names, header_values, payload) \
             SELECT $1::text, $2::text, $3::text, $4::text[], $5::text[], $6::bytea \
             FROM (SELECT count(*) AS n FROM (\
               SELECT pg_advisory_xact_lock(hashtextextended($3::text, {lock_seed})) \
               WHERE $3::text IS NOT NULL) AS l) AS k \
             WHERE k.n >= 0 \
             ON CONFLICT (id) DO NOTHING RETURNING 1"
        );
        // The notification is sent only for a row actually inserted, and PostgreSQL folds a
        // transaction's identical notifications into one, delivered at commit.
        let enqueue_sql = if self.notify && !self.transaction_pooler {
            format!(
                "WITH ins AS ({insert}) SELECT count(*) FROM ins, LATERAL pg_notify('{channel}', '') AS n"
            )
        } else {
            format!("WITH ins AS ({insert}) SELECT count(*) FROM ins")
        };
        // The head of each ordering key (no earlier pending message of that key, and none of
        // that key in flight under a live lease), and messages without a key, that are due and
        // not held by a live lease; rows another relay is claiming right now are skipped, not
        // waited for. The lease is conditional on the row still qualifying (re-checked under
        // its lock). A row already claimed `max_attempts` times ($4) is one whose relays kept
        // stopping mid-publish (a failed publish records its outcome and dead-letters at the
        // limit): it is dead-lettered here, not published.
        let claim_sql = format!(
            "WITH c AS (\
               SELECT o.id FROM {t} o \
               WHERE o.state = 'pending' AND o.available_at <= now() \
                 AND (o.lease_until IS NULL OR o.lease_until <= now()) \
                 AND (o.ordering_key IS NULL OR NOT EXISTS (\
                   SELECT 1 FROM {t} p WHERE p.state = 'pending' \
                     AND p.ordering_key = o.ordering_key \
                     AND (p.seq < o.seq OR p.lease_until > now()))) \
               ORDER BY o.seq LIMIT $1 \
               FOR UPDATE OF o SKIP LOCKED) \
             UPDATE {t} o SET \
               state = CASE WHEN o.attempts >= $4 THEN 'dead' ELSE o.state END, \
               last_error = CASE WHEN o.attempts >= $4 THEN 'claimed ' || o.attempts || \
                 ' times without a recorded outcome: a relay stopped while publishing it each time' \
                 ELSE o.last_error END, \
               lease_until = CASE WHEN o.attempts >= $4 THEN NULL \
                 ELSE now() + $2::bigint * interval '1 millisecond' END, \
               lease_token = CASE WHEN o.attempts >= $4 THEN NULL ELSE $3 END, \
               attempts = CASE WHEN o.attempts >= $4 THEN o.attempts ELSE o.attempts + 1 END \
             FROM c WHERE o.id = c.id \
             RETURNING o.id, o.destination, o.ordering_key, o.header_names, o.header_values, \
               o.payload, o.attempts, (extract(epoch FROM o.enqueued_at) * 1000)::bigint, o.seq, \
               o.state = 'dead'"
        );
        let delivered_sql = format!(
            "UPDATE {t} o SET state = 'delivered', delivered_at = now(), lease_until = NULL, \
               lease_token = NULL, last_error = NULL \
             FROM unnest($1::text[]) AS d(id) \
             WHERE o.id = d.id AND o.lease_token = $2 AND o.state = 'pending' \
             RETURNING o.destination, (extract(epoch FROM now() - o.enqueued_at) * 1000)::bigint"
        );
        let failed_sql = format!(
            "UPDATE {t} SET lease_until = NULL, lease_token = NULL, last_error = $3, \
               available_at = now() + $4::bigint * interval '1 millisecond', \
               state = CASE WHEN $5 OR attempts >= $6 THEN 'dead' ELSE 'pending' END \
             WHERE id = $1 AND lease_token = $2 AND state = 'pending' \
             RETURNING state"
        );
        let inspect_sql = format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE id = $1");
        let payload_sql = format!("SELECT payload FROM {t} WHERE id = $1");
        let dead_sql =
            format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE state = 'dead' ORDER BY seq LIMIT $1");
        // A retried message goes to the back of its key: a new `seq`, drawn under the key's
        // lock (as an enqueue's), so after every message of its key enqueued before it,
        // committed or not.
        let retry_sql = format!(
            "UPDATE {t} o SET state = 'pending', seq = DEFAULT, attempts = 0, \
               available_at = now(), lease_until = NULL, lease_token = NULL \
             FROM (SELECT count(*) AS n FROM (\
               SELECT pg_advisory_xact_lock(hashtextextended(d.ordering_key, {lock_seed})) \
               FROM {t} d WHERE d.id = $1 AND d.state = 'dead' \
                 AND d.ordering_key IS NOT NULL) AS l) AS k \
             WHERE o.id = $1 AND o.state = 'dead' AND k.n >= 0"
        );
        let discard_sql = format!("DELETE FROM {t} WHERE id = $1");
        // The delete re-checks the predicate; the batch is chosen once (a CTE), and two sweepers
        // skip each other's rows rather than queue.
        let sweep_sql = format!(
            "WITH batch AS MATERIALIZED (\
               SELECT id FROM {t} \
               WHERE state = 'delivered' AND delivered_at < now() - $1::bigint * interval '1 millisecond' \
               ORDER BY delivered_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
             DELETE FROM {t} AS o USING batch \
             WHERE o.id = batch.id AND o.state = 'delivered' \
               AND o.delivered_at < now() - $1::bigint * interval '1 millisecond'"
        );
        let stats_sql = format!(
            "SELECT (SELECT count(*) FROM {t} WHERE state = 'pending'), \
               (SELECT count(*) FROM {t} WHERE state = 'dead'), \
               (SELECT COALESCE((extract(epoch FROM now() - min(enqueued_at)) * 1000)::bigint, 0) \
                  FROM {t} WHERE state = 'pending')"
        );
        Ok(PostgresOutbox {
            pool: self.pool,
            s: Arc::new(Settings {
                table,
                channel,
                notify: self.notify && !self.transaction_pooler,
                named: !self.transaction_pooler,
                retention: self.retention,
                enqueue_sql: enqueue_sql.into(),
                claim_sql: claim_sql.into(),
                delivered_sql: delivered_sql.into(),
                failed_sql: failed_sql.into(),
                inspect_sql: inspect_sql.into(),
                payload_sql: payload_sql.into(),
                dead_sql: dead_sql.into(),
                retry_sql: retry_sql.into(),
                discard_sql: discard_sql.into(),
                sweep_sql: sweep_sql.into(),
                stats_sql: stats_sql.into(),
            }),
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn record(row: &PgRow) -> Result<OutboxRecord, sqlx::Error> {
    let state: String = row.try_get(3)?;
    let attempts: i32 = row.try_get(4)?;
    let delivered: Option<i64> = row.try_get(7)?;
    let payload_len: i32 = row.try_get(10)?;
    Ok(OutboxRecord {
        id: row.try_get(0)?,
        destination: row.try_get(1)?,
        ordering_key: row.try_get(2)?,
        state: State::parse(&state),
        attempts: attempts.max(0) as u32,
        last_error: row.try_get(5)?,
        enqueued_at: from_millis(row.try_get(6)?),
        delivered_at: delivered.map(from_millis),
        available_at: from_millis(row.try_get(8)?),
        leased: row.try_get(9)?,
        payload_len: payload_len.max(0) as usize,
    })
}

impl PostgresOutbox {
    /// An outbox in table `outbox_messages`, keeping delivered messages 7 days, found by
    /// relays polling (see [`PostgresOutboxBuilder::notify`]).
    pub fn new(pool: PgPool) -> Self {
        Self::builder(pool)
            .build()
            .expect("the default table name is a valid identifier")
    }

    /// Configures an outbox.
    pub fn builder(pool: PgPool) -> PostgresOutboxBuilder {
        PostgresOutboxBuilder {
            pool,
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
            retention: DEFAULT_RETENTION,
            notify: false,
            transaction_pooler: false,
        }
    }

    /// The pool relays and operators' calls run on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table, quoted and schema-qualified as it appears in SQL.
    pub fn qualified_table(&self) -> &str {
        &self.s.table.qualified
    }

    /// The channel relays `LISTEN` on, if the outbox notifies.
    fn channel(&self) -> Option<&str> {
        self.s.notify.then_some(self.s.channel.as_str())
    }

    /// Creates the schema (if configured), the table and its indexes, or upgrades them, through
    /// versioned migrations recorded in `<table>_migrations`. Idempotent, and safe to run from
    /// several processes at once. To apply the DDL with a migration tool of your own instead,
    /// see [`migrations`](Self::migrations).
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sql::migrate::<Pg>(&self.pool, &self.s.table, MIGRATIONS).await
    }

    /// The DDL [`migrate`](Self::migrate) applies, rendered for `table` in `schema`.
    ///
    /// ```
    /// use idempotent_runtime::outbox::PostgresOutbox;
    ///
    /// let migrations = PostgresOutbox::migrations(None, "outbox_messages")?;
    /// assert!(migrations.iter().next().unwrap().sql.contains("\"outbox_messages_pkey\""));
    /// # Ok::<(), idempotent_runtime::store::InvalidName>(())
    /// ```
    pub fn migrations(schema: Option<&str>, table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::new(OUTBOX_NAMES, schema, table)?.migrations(MIGRATIONS))
    }

    /// Writes `message` through `conn`, which must be inside the caller's transaction (a
    /// `sqlx::Transaction` as `&mut tx`, an [`EnlistedTx`](crate::enlisted::EnlistedTx) as
    /// `tx.conn()`, an inbox handler's connection): it is sent once that transaction commits,
    /// and never if it rolls back. One statement, one row; no other write.
    ///
    /// A message with an ordering key first takes a lock on that key in this outbox (a
    /// transaction-scoped advisory lock, held until the transaction ends), so that, per key,
    /// messages go out in the order their transactions commit. Consequences: a second
    /// transaction enqueuing the same key waits in its `enqueue` until the first commits or
    /// rolls back, at most its `lock_timeout` if one is set (an enlisted transaction has the
    /// PostgreSQL store's, 1 s by default; an inbox handler's the inbox's, 5 s); past it,
    /// SQLSTATE 55P03, and the transaction must roll back. Keep such transactions short after
    /// their enqueue. Two transactions that
    /// enqueue several keys in different orders can deadlock: PostgreSQL detects it and aborts
    /// one (SQLSTATE 40P01); enqueue a transaction's keys in a fixed order (sorted, say).
    /// Messages without an ordering key take no lock. Being transaction-scoped, the lock works
    /// behind a transaction pooler.
    ///
    /// A message whose id is already in the outbox (pending, delivered within the retention,
    /// or dead) is not written again: [`Enqueued::AlreadyEnqueued`]. An invalid message is
    /// refused before any statement ([`OutboxError::Invalid`]); a database error leaves the
    /// transaction aborted: roll it back.
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        message: Message,
    ) -> Result<Enqueued, OutboxError> {
        message.validate()?;
        let (names, values): (Vec<String>, Vec<String>) = message.headers.into_iter().unzip();
        let inserted: i64 = sqlx::query_scalar(AssertSqlSafe(self.s.enqueue_sql.clone()))
            .bind(message.id)
            .bind(message.destination)
            .bind(message.ordering_key)
            .bind(names)
            .bind(values)
            .bind(message.payload.as_ref())
            .persistent(self.s.named)
            .fetch_one(conn)
            .await?;
        Ok(if inserted > 0 {
            Enqueued::New
        } else {
            Enqueued::AlreadyEnqueued
        })
    }

    /// Runs `f` on a connection of the pool: on its own, or behind a transaction pooler in a
    /// transaction of its own (a pooler may otherwise send an unnamed statement's parse and its
    /// execution to two server connections).
    async fn on_pool<T, F>(&self, f: F) -> Result<T, sqlx::Error>
    where
        F: for<'c> FnOnce(&'c mut PgConnection, bool) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        if self.s.named {
            let mut conn = self.pool.acquire().await?;
            f(&mut conn, true).await
        } else {
            let mut tx = self.pool.begin().await?;
            let value = f(&mut tx, false).await?;
            tx.commit().await?;
            Ok(value)
        }
    }

    /// See [`Storage::claim`].
    async fn claim(
        &self,
        batch: usize,
        lease: Duration,
        token: i64,
        max_attempts: u32,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        let sql = self.s.claim_sql.clone();
        let rows = self
            .on_pool(move |conn, named| {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(batch.min(i64::MAX as usize) as i64)
                        .bind(millis(lease))
                        .bind(token)
                        .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
                        .persistent(named)
                        .fetch_all(conn)
                        .await
                })
            })
            .await?;
        let mut claimed = rows
            .iter()
            .map(|row| {
                let names: Vec<String> = row.try_get(3)?;
                let values: Vec<String> = row.try_get(4)?;
                let payload: Vec<u8> = row.try_get(5)?;
                let attempts: i32 = row.try_get(6)?;
                let seq: i64 = row.try_get(8)?;
                let spent: bool = row.try_get(9)?;
                let message = Message {
                    id: row.try_get(0)?,
                    destination: row.try_get(1)?,
                    ordering_key: row.try_get(2)?,
                    headers: names.into_iter().zip(values).collect(),
                    payload: payload.into(),
                };
                let enqueued_at: SystemTime = from_millis(row.try_get(7)?);
                Ok((
                    seq,
                    Claimed {
                        delivery: Delivery::new(message, attempts.max(1) as u32, enqueued_at),
                        spent,
                    },
                ))
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        // UPDATE … RETURNING gives no order; publish in insertion order.
        claimed.sort_unstable_by_key(|(seq, _)| *seq);
        Ok(claimed.into_iter().map(|(_, c)| c).collect())
    }

    /// See [`Storage::delivered`].
    async fn delivered(
        &self,
        ids: Vec<String>,
        token: i64,
    ) -> Result<Vec<(String, Duration)>, sqlx::Error> {
        let sql = self.s.delivered_sql.clone();
        let rows: Vec<(String, i64)> = self
            .on_pool(move |conn, named| {
                Box::pin(async move {
                    sqlx::query_as(AssertSqlSafe(sql))
                        .bind(ids)
                        .bind(token)
                        .persistent(named)
                        .fetch_all(conn)
                        .await
                })
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|(d, ms)| (d, Duration::from_millis(ms.max(0) as u64)))
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
        let sql = self.s.failed_sql.clone();
        let (id, error) = (id.to_owned(), error.to_owned());
        let state: Option<String> = self
            .on_pool(move |conn, named| {
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(id)
                        .bind(token)
                        .bind(error)
                        .bind(millis(delay))
                        .bind(permanent)
                        .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
                        .persistent(named)
                        .fetch_optional(conn)
                        .await
                })
            })
            .await?;
        Ok(match state.as_deref() {
            Some("dead") => Failed::Dead,
            Some(_) => Failed::Retrying,
            None => Failed::LeaseLost,
        })
    }

    /// What the outbox knows of message `id`, without its payload; `None` if it is not there
    /// (never enqueued, committed yet, or swept).
    pub async fn inspect(&self, id: &str) -> Result<Option<OutboxRecord>, sqlx::Error> {
        let row = self.row_by_id(&self.s.inspect_sql, id).await?;
        row.as_ref().map(record).transpose()
    }

    /// The payload of message `id`, for an operator who asked for it.
    pub async fn payload(&self, id: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        let row = self.row_by_id(&self.s.payload_sql, id).await?;
        row.map(|row| row.try_get(0)).transpose()
    }

    /// Up to `limit` dead-lettered messages, oldest first, each with its last error.
    pub async fn dead_letters(&self, limit: usize) -> Result<Vec<OutboxRecord>, sqlx::Error> {
        let sql = self.s.dead_sql.clone();
        let rows = self
            .on_pool(move |conn, named| {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(limit.min(i64::MAX as usize) as i64)
                        .persistent(named)
                        .fetch_all(conn)
                        .await
                })
            })
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
        let retried = self.affected_by_id(&self.s.retry_sql, id).await? > 0;
        if retried {
            self.wake().await;
        }
        Ok(retried)
    }

    /// Deletes message `id` whatever its state: a dead letter an operator gave up on, or a
    /// pending message that must not go out (a relay publishing it right now may still
    /// deliver it once). Afterwards the id may be enqueued again. `false` if it was not there.
    pub async fn discard(&self, id: &str) -> Result<bool, sqlx::Error> {
        Ok(self.affected_by_id(&self.s.discard_sql, id).await? > 0)
    }

    /// Runs `sql` with `id` as its one parameter; the rows it changed.
    async fn affected_by_id(&self, sql: &Arc<str>, id: &str) -> Result<u64, sqlx::Error> {
        let (sql, id) = (sql.clone(), id.to_owned());
        let done = self
            .on_pool(move |conn, named| {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(id)
                        .persistent(named)
                        .execute(conn)
                        .await
                })
            })
            .await?;
        Ok(done.rows_affected())
    }

    /// Runs the query `sql` with `id` as its one parameter; its row, if any.
    async fn row_by_id(&self, sql: &Arc<str>, id: &str) -> Result<Option<PgRow>, sqlx::Error> {
        let (sql, id) = (sql.clone(), id.to_owned());
        self.on_pool(move |conn, named| {
            Box::pin(async move {
                sqlx::query(AssertSqlSafe(sql))
                    .bind(id)
                    .persistent(named)
                    .fetch_optional(conn)
                    .await
            })
        })
        .await
    }

    /// How many messages are pending and dead, and the age of the oldest pending one.
    pub async fn stats(&self) -> Result<OutboxStats, sqlx::Error> {
        let sql = self.s.stats_sql.clone();
        let (pending, dead, oldest): (i64, i64, i64) = self
            .on_pool(move |conn, named| {
                Box::pin(async move {
                    sqlx::query_as(AssertSqlSafe(sql))
                        .persistent(named)
                        .fetch_one(conn)
                        .await
                })
            })
            .await?;
        Ok(OutboxStats {
            pending: pending.max(0) as u64,
            dead: dead.max(0) as u64,
            oldest_pending: Duration::from_millis(oldest.max(0) as u64),
        })
    }

    /// Deletes up to `batch` messages delivered longer ago than the retention, re-checking the
    /// age in the delete itself; returns how many. A full batch means more may remain.
    pub async fn sweep(&self, batch: usize) -> Result<usize, sqlx::Error> {
        let sql = self.s.sweep_sql.clone();
        let retention = millis(self.s.retention);
        let done = self
            .on_pool(move |conn, named| {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(retention)
                        .bind(batch.min(i64::MAX as usize) as i64)
                        .persistent(named)
                        .execute(conn)
                        .await
                })
            })
            .await?;
        let deleted = done.rows_affected() as usize;
        #[cfg(feature = "metrics")]
        metrics::counter!("idempotent_outbox_swept_total").increment(deleted as u64);
        if deleted > 0 {
            tracing::debug!(deleted, table = %self.s.table.qualified, "outbox: swept delivered messages");
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

    /// Wakes listening relays (after an operator's retry); a failure only delays delivery to
    /// the next poll.
    async fn wake(&self) {
        let Some(channel) = self.channel() else {
            return;
        };
        let sql = format!("SELECT pg_notify('{channel}', '')");
        if let Err(e) = sqlx::query(AssertSqlSafe(sql))
            .persistent(false)
            .execute(&self.pool)
            .await
        {
            tracing::debug!(error = %e, "outbox: could not wake the relays; they find it at their next poll");
        }
    }
}

impl Storage for PostgresOutbox {
    fn claim(
        &self,
        batch: usize,
        lease: Duration,
        token: i64,
        max_attempts: u32,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>> {
        Box::pin(PostgresOutbox::claim(
            self,
            batch,
            lease,
            token,
            max_attempts,
        ))
    }

    fn delivered(
        &self,
        ids: Vec<String>,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<(String, Duration)>, sqlx::Error>> {
        Box::pin(PostgresOutbox::delivered(self, ids, token))
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
        Box::pin(PostgresOutbox::failed(
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
        Box::pin(PostgresOutbox::stats(self))
    }

    fn notifies(&self) -> bool {
        self.channel().is_some()
    }

    /// Listens on a connection of its own (not one of the pool's), reconnecting when it is
    /// lost (and waking the relay then, as notifications may have been missed).
    fn spawn_listener(
        &self,
        wake: Arc<Notify>,
        retry: Duration,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let channel = self.channel()?.to_owned();
        let options = self.pool.connect_options();
        Some(tokio::spawn(async move {
            loop {
                let pool = PgPoolOptions::new()
                    .max_connections(1)
                    .min_connections(0)
                    .connect_lazy_with((*options).clone());
                let listening = async {
                    let mut listener = PgListener::connect_with(&pool).await?;
                    listener.listen(&channel).await?;
                    // Anything committed before LISTEN took effect is found by this wake's batch.
                    wake.notify_one();
                    loop {
                        // `None`: the connection was lost (and is re-established by the next
                        // call); notifications in between are lost, so look now.
                        let _ = listener.try_recv().await?;
                        wake.notify_one();
                    }
                };
                let result: Result<(), sqlx::Error> = listening.await;
                if let Err(e) = result {
                    tracing::debug!(error = %e, "outbox relay: listening failed; polling until it is back");
                }
                pool.close().await;
                tokio::time::sleep(retry).await;
            }
        }))
    }
}
