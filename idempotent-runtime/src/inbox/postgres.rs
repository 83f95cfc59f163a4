//! The PostgreSQL inbox: a marker row per processed message, written in the handler's transaction.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnection, PgDatabaseError, PgPool};
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use crate::sql::{self, INBOX_NAMES, Migrations, Pg, Step, TableName};

use super::{
    BoxFuture, DEFAULT_LOCK_TIMEOUT, DEFAULT_RETENTION, DEFAULT_SWEEP_BATCH, DEFAULT_TABLE,
    InboxError, Outcome, Processed, answered, observe, observe_swept, roll_back, spawn_sweep_loop,
    store_failed,
};

/// The versioned DDL of the inbox's table, in order (`{table}`: the quoted, qualified name,
/// `{name}`: the bare one; the names' length limits are in [`INBOX_NAMES`]). Never edit a
/// shipped migration: add one.
const MIGRATIONS: &[Step] = &[Step {
    version: 1,
    description: "create processed messages",
    template: include_str!("../../migrations/postgres_inbox/0001_create_processed_messages.sql"),
}];

/// A processed-messages inbox in PostgreSQL ([the contract](crate::design) §6), for any number of consumer processes.
///
/// [`process`](Self::process) opens a transaction, sets `lock_timeout` for it, inserts the
/// marker `(consumer, message_id)` **first**, then runs the handler on the same connection and
/// commits marker and effects together:
///
/// - the insert violates the inbox's primary key `processed_messages_pkey` → the message was
///   processed before: rolled back, [`Processed::Duplicate`], the handler does not run;
/// - the insert waits on a concurrent copy's uncommitted marker: it proceeds if that copy rolls
///   back, is a duplicate if it commits, and gives up after `lock_timeout` (SQLSTATE 55P03) as
///   [`Processed::Busy`];
/// - the handler fails → rolled back, no marker stays, [`InboxError::Handler`]: the redelivery
///   runs it again. A unique violation of the handler's own (any other constraint) is the
///   handler's failure, never taken for a duplicate;
/// - the commit fails → [`InboxError::Store`], or [`Processed::Duplicate`] if it failed on the
///   inbox's own constraint.
///
/// The handler receives the transaction's connection: it writes through it and must not commit.
/// The transaction's `lock_timeout` applies to its statements too. To recover from an expected
/// error inside the handler, use a savepoint (`sqlx::Connection::begin(conn)`): a failed
/// statement otherwise aborts the whole transaction, which the inbox reports as
/// [`InboxError::Store`] rather than committing nothing and acking.
///
/// ```no_run
/// use idempotent_runtime::inbox::{InboxError, PostgresInbox, Processed};
/// use sqlx::PgPool;
///
/// # async fn example(pool: PgPool, message_id: &str, sku: &str, qty: i32) -> Result<(), InboxError<sqlx::Error>> {
/// let inbox = PostgresInbox::new(pool, "reserve-stock");
/// inbox.migrate().await.map_err(|e| InboxError::Store(e.into()))?;
///
/// let sku = sku.to_owned();
/// let outcome = inbox
///     .process(message_id, |conn| {
///         Box::pin(async move {
///             sqlx::query("UPDATE stock SET reserved = reserved + $2 WHERE sku = $1")
///                 .bind(&sku)
///                 .bind(qty)
///                 .execute(&mut *conn)
///                 .await?;
///             Ok::<_, sqlx::Error>(sku)
///         })
///     })
///     .await?;
/// match outcome {
///     Processed::Done(sku) => println!("reserved {sku}: ack"),
///     Processed::Duplicate => println!("already reserved: ack"),
///     Processed::Busy => println!("a copy is being processed: nack"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresInbox {
    pool: PgPool,
    s: Arc<Settings>,
}

struct Settings {
    consumer: String,
    table: TableName,
    constraint: String,
    lock_timeout: Duration,
    retention: Duration,
    begin_sql: Arc<str>,
    insert_sql: Arc<str>,
    sweep_sql: Arc<str>,
    /// Statements prepared once per connection and kept (no transaction pooler in between).
    named: bool,
}

impl fmt::Debug for PostgresInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresInbox")
            .field("consumer", &self.s.consumer)
            .field("table", &self.s.table.qualified)
            .field("lock_timeout", &self.s.lock_timeout)
            .field("retention", &self.s.retention)
            .finish_non_exhaustive()
    }
}

/// Configures a [`PostgresInbox`]; from [`PostgresInbox::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct PostgresInboxBuilder {
    pool: PgPool,
    consumer: String,
    schema: Option<String>,
    table: String,
    lock_timeout: Duration,
    retention: Duration,
    transaction_pooler: bool,
}

use crate::sql::InvalidName;

impl PostgresInboxBuilder {
    /// The schema holding the table (default: the connection's `search_path`). `migrate()`
    /// creates it if missing.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The table name (default `processed_messages`). Its primary key constraint is
    /// `<table>_pkey`, the name by which duplicates are recognised.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long a copy waits on a concurrent copy's uncommitted marker before answering
    /// [`Processed::Busy`] (default 5 s; at least 1 ms, since 0 would mean "wait forever").
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// How long markers are kept before [`PostgresInbox::sweep`] deletes them (default 7 days). A
    /// copy redelivered after that runs again: keep it longer than the broker may redeliver.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Whether the pool reaches PostgreSQL through a connection pooler in transaction pooling
    /// mode (PgBouncer `pool_mode = transaction`) (default `false`). The inbox's statements are
    /// then unnamed (`persistent(false)`), never a named prepared statement another client could
    /// meet on the same server connection, and the sweep runs in a transaction of its own. Its
    /// `lock_timeout` is `SET LOCAL` in each transaction either way. The handler's own statements
    /// must be unnamed too behind such a pooler (`.persistent(false)` on each sqlx query).
    ///
    /// ```no_run
    /// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotent_runtime::inbox::PostgresInbox;
    ///
    /// let inbox = PostgresInbox::builder(pool, "billing").transaction_pooler(true).build()?;
    /// inbox.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn transaction_pooler(mut self, behind: bool) -> Self {
        self.transaction_pooler = behind;
        self
    }

    /// The inbox, or the schema or table name it refuses as
    /// [`store::InvalidName`](crate::store::InvalidName), the SQL stores' own naming error: a
    /// lowercase SQL identifier (`[a-z_][a-z0-9_]*`; table names up to 50 bytes, schema names
    /// up to 63) is accepted.
    pub fn build(self) -> Result<PostgresInbox, InvalidName> {
        let table = TableName::new(INBOX_NAMES, self.schema.as_deref(), &self.table)?;
        let qualified = &table.qualified;
        let lock_ms = self.lock_timeout.as_millis().clamp(1, i32::MAX as u128);
        let begin_sql = format!("BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms'");
        let insert_sql = format!("INSERT INTO {qualified} (consumer, message_id) VALUES ($1, $2)");
        // The delete re-checks the age predicate (the contract, docs/DESIGN.md §3). The batch is a CTE so that it is
        // chosen once: as an `IN (… LIMIT n)` subquery it may be rescanned and, among rows of
        // equal age, pick different ones each time, deleting more than `n`. SKIP LOCKED keeps
        // two sweepers from queueing behind each other.
        let sweep_sql = format!(
            "WITH batch AS MATERIALIZED (\
               SELECT message_id FROM {qualified} \
               WHERE consumer = $1 AND processed_at < now() - $2::bigint * interval '1 millisecond' \
               ORDER BY processed_at, message_id LIMIT $3 FOR UPDATE SKIP LOCKED) \
             DELETE FROM {qualified} AS m USING batch \
             WHERE m.consumer = $1 AND m.message_id = batch.message_id \
               AND m.processed_at < now() - $2::bigint * interval '1 millisecond'"
        );
        Ok(PostgresInbox {
            pool: self.pool,
            s: Arc::new(Settings {
                constraint: format!("{}_pkey", table.name),
                consumer: self.consumer,
                table,
                lock_timeout: self.lock_timeout,
                retention: self.retention,
                begin_sql: begin_sql.into(),
                insert_sql: insert_sql.into(),
                sweep_sql: sweep_sql.into(),
                named: !self.transaction_pooler,
            }),
        })
    }
}

/// The handler returned `Ok` although one of its statements failed and aborted the transaction.
#[derive(Debug)]
struct AbortedTransaction(sqlx::Error);

impl fmt::Display for AbortedTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "the inbox handler returned Ok, but one of its statements failed and aborted the \
             transaction, so nothing was committed; return the error, or recover inside a \
             savepoint (sqlx::Connection::begin on the handler's connection)",
        )
    }
}

impl std::error::Error for AbortedTransaction {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code().map(|c| c.into_owned()))
}

impl PostgresInbox {
    /// An inbox for `consumer` in table `processed_messages`, with the default lock timeout
    /// (5 s) and retention (7 days).
    pub fn new(pool: PgPool, consumer: impl Into<String>) -> Self {
        Self::builder(pool, consumer)
            .build()
            .expect("the default table name is a valid identifier")
    }

    /// Configures an inbox for `consumer`: markers are per consumer, so several consumers of the
    /// same messages may share one table.
    pub fn builder(pool: PgPool, consumer: impl Into<String>) -> PostgresInboxBuilder {
        PostgresInboxBuilder {
            pool,
            consumer: consumer.into(),
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            retention: DEFAULT_RETENTION,
            transaction_pooler: false,
        }
    }

    /// The consumer this inbox deduplicates for.
    pub fn consumer(&self) -> &str {
        &self.s.consumer
    }

    /// The table, quoted and schema-qualified as it appears in SQL.
    pub fn qualified_table(&self) -> &str {
        &self.s.table.qualified
    }

    /// The primary key constraint by whose name duplicates are recognised.
    pub fn constraint(&self) -> &str {
        &self.s.constraint
    }

    /// The pool the inbox runs on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates the schema (if configured), the table and its sweep index, or upgrades them,
    /// through versioned migrations recorded in `<table>_migrations` (with the checksum of each
    /// step's SQL), and checks that the table's primary key carries the expected constraint
    /// name. A table created by a release before versioned migrations is adopted as it is.
    /// Idempotent, and safe to run from several processes at once (serialised by a
    /// transaction-scoped advisory lock derived from the table's name, so it never waits on the
    /// application's own sqlx migrations). To apply the DDL with a migration tool of your own
    /// instead, see [`migrations`](Self::migrations).
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        let s = &*self.s;
        sql::migrate::<Pg>(&self.pool, &s.table, MIGRATIONS).await?;
        // In a transaction, unnamed: it runs behind a transaction pooler too.
        let mut tx = self.pool.begin().await?;
        let has_pkey: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_constraint \
             WHERE conrelid = $1::regclass AND conname = $2 AND contype = 'p')",
        )
        .bind(&s.table.qualified)
        .bind(&s.constraint)
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        if !has_pkey {
            return Err(sqlx::Error::Configuration(
                format!(
                    "inbox table {} exists without a primary key constraint named {}; the inbox \
                     recognises duplicates by that name: rename the constraint or choose another table",
                    s.table.qualified, s.constraint
                )
                .into(),
            ));
        }
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) applies, rendered for `table` in `schema` (`None`: the
    /// connection's default schema), for users who ship schema changes with their own migration
    /// tool: each step's SQL, in order, or a sqlx `Migrator` of them. Use either this or
    /// `migrate()` for a table, never both (see [`Migrations`]).
    ///
    /// ```
    /// use idempotent_runtime::inbox::PostgresInbox;
    ///
    /// let migrations = PostgresInbox::migrations(None, "processed_messages")?;
    /// assert!(migrations.iter().next().unwrap().sql.contains("\"processed_messages_pkey\""));
    /// # Ok::<(), idempotent_runtime::store::InvalidName>(())
    /// ```
    pub fn migrations(schema: Option<&str>, table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::new(INBOX_NAMES, schema, table)?.migrations(MIGRATIONS))
    }

    /// Whether `e` is a unique violation of this inbox's own primary key (a duplicate), as
    /// opposed to one of the handler's constraints.
    fn is_duplicate(&self, e: &sqlx::Error) -> bool {
        let Some(db) = e.as_database_error() else {
            return false;
        };
        if db.code().as_deref() != Some("23505") || db.constraint() != Some(&self.s.constraint) {
            return false;
        }
        match db.try_downcast_ref::<PgDatabaseError>() {
            Some(pg) => {
                pg.table().is_none_or(|t| t == self.s.table.name)
                    && match (&self.s.table.schema, pg.schema()) {
                        (Some(want), Some(got)) => want == got,
                        _ => true,
                    }
            }
            None => true,
        }
    }

    async fn roll_back(&self, tx: Transaction<'static, Postgres>) {
        roll_back(&self.s.consumer, tx).await;
    }

    fn store_error<T, E>(
        &self,
        message_id: &str,
        e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Result<Processed<T>, InboxError<E>> {
        store_failed(&self.s.consumer, message_id, e)
    }

    fn outcome<T, E>(
        &self,
        message_id: &str,
        p: Processed<T>,
    ) -> Result<Processed<T>, InboxError<E>> {
        answered(&self.s.consumer, message_id, p)
    }

    /// Runs `handler` in a transaction that also records `message_id` as processed, unless it was
    /// processed before ([`Processed::Duplicate`]) or a concurrent copy holds its marker past the
    /// lock timeout ([`Processed::Busy`]). See the [type's documentation](Self) for every outcome.
    ///
    /// The handler gets the transaction's connection for `'c` and returns a boxed future
    /// borrowing it: write `|conn| Box::pin(async move { … })` and execute statements with
    /// `.execute(&mut *conn)`. Move what the future needs into it (clone, or `to_owned()`).
    pub async fn process<T, E, F>(
        &self,
        message_id: &str,
        handler: F,
    ) -> Result<Processed<T>, InboxError<E>>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, E>>,
    {
        let s = &*self.s;
        let mut tx = match self
            .pool
            .begin_with(AssertSqlSafe(s.begin_sql.clone()))
            .await
        {
            Ok(tx) => tx,
            Err(e) => return self.store_error(message_id, e),
        };
        let marker = sqlx::query(AssertSqlSafe(s.insert_sql.clone()))
            .bind(&s.consumer)
            .bind(message_id)
            .persistent(s.named)
            .execute(&mut *tx)
            .await;
        if let Err(e) = marker {
            self.roll_back(tx).await;
            return if self.is_duplicate(&e) {
                self.outcome(message_id, Processed::Duplicate)
            } else if sqlstate(&e).as_deref() == Some("55P03") {
                self.outcome(message_id, Processed::Busy)
            } else {
                self.store_error(message_id, e)
            };
        }

        let value = match handler(&mut tx).await {
            Ok(value) => value,
            Err(e) => {
                self.roll_back(tx).await;
                observe(Outcome::Failed, &s.consumer, message_id);
                return Err(InboxError::Handler(e));
            }
        };

        // PostgreSQL turns COMMIT of an aborted transaction into a silent ROLLBACK: a handler
        // that swallowed a failed statement's error would be acked with nothing committed.
        if let Err(e) = sqlx::query("SELECT 1")
            .persistent(s.named)
            .execute(&mut *tx)
            .await
        {
            self.roll_back(tx).await;
            return if sqlstate(&e).as_deref() == Some("25P02") {
                self.store_error(message_id, AbortedTransaction(e))
            } else {
                self.store_error(message_id, e)
            };
        }
        match tx.commit().await {
            Ok(()) => self.outcome(message_id, Processed::Done(value)),
            // Only possible with a deferred constraint, but then it is still a duplicate: the
            // whole transaction, the handler's changes included, was rolled back.
            Err(e) if self.is_duplicate(&e) => self.outcome(message_id, Processed::Duplicate),
            Err(e) => self.store_error(message_id, e),
        }
    }

    /// Deletes up to `batch` of this consumer's markers older than the retention, re-checking
    /// the age in the delete itself; returns how many. A full batch means more may remain.
    pub async fn sweep(&self, batch: usize) -> Result<usize, sqlx::Error> {
        let retention_ms = self.s.retention.as_millis().min(i64::MAX as u128) as i64;
        let query = sqlx::query(AssertSqlSafe(self.s.sweep_sql.clone()))
            .bind(&self.s.consumer)
            .bind(retention_ms)
            .bind(batch.min(i64::MAX as usize) as i64);
        let done = if self.s.named {
            query.execute(&self.pool).await?
        } else {
            // Outside a transaction a transaction pooler may send the parse and the execution
            // of an unnamed statement to two server connections.
            let mut tx = self
                .pool
                .begin_with(AssertSqlSafe(self.s.begin_sql.clone()))
                .await?;
            let done = query.persistent(false).execute(&mut *tx).await?;
            tx.commit().await?;
            done
        };
        let deleted = done.rows_affected() as usize;
        observe_swept(&self.s.consumer, deleted);
        Ok(deleted)
    }

    /// Sweeps in batches of 500 on a cadence of `min(retention, 1 h)`, again at once while
    /// batches come back full; a failed sweep is logged and retried at the next tick. Runs until
    /// the handle is aborted. Must be called inside a Tokio runtime.
    ///
    /// ```no_run
    /// # async fn example(inbox: idempotent_runtime::inbox::PostgresInbox) {
    /// let sweeper = inbox.spawn_sweeper();
    /// // … consume …
    /// sweeper.abort();
    /// # }
    /// ```
    pub fn spawn_sweeper(&self) -> tokio::task::JoinHandle<()> {
        let inbox = self.clone();
        let (consumer, retention) = (self.s.consumer.clone(), self.s.retention);
        spawn_sweep_loop(format!("inbox {consumer}"), retention, move || {
            let inbox = inbox.clone();
            async move { inbox.sweep(DEFAULT_SWEEP_BATCH).await }
        })
    }
}
