//! The MySQL / MariaDB inbox: a marker row per processed message, written in the handler's
//! transaction (InnoDB).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{MySqlConnection, MySqlDatabaseError, MySqlPool};
use sqlx::{AssertSqlSafe, MySql, Transaction};

use super::{
    BoxFuture, DEFAULT_LOCK_TIMEOUT, DEFAULT_RETENTION, DEFAULT_SWEEP_BATCH, DEFAULT_TABLE,
    InboxError, Outcome, Processed, answered, observe, observe_swept, roll_back, spawn_sweep_loop,
    store_failed,
};
use crate::sql::{self, INBOX_NAMES, InvalidName, Migrations, My, Step, TableName};

/// The versioned DDL shipped with the crate, in order. Never edit a shipped migration: add one.
const MIGRATIONS: &[Step] = &[Step {
    version: 1,
    description: "create processed messages",
    template: include_str!("../../migrations/mysql_inbox/0001_create_processed_messages.sql"),
}];

/// `ER_DUP_ENTRY`.
const DUPLICATE_KEY: u16 = 1062;
/// `ER_LOCK_WAIT_TIMEOUT`.
const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// The database's clock in epoch milliseconds.
const NOW_MS: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) DIV 1000)";

/// A processed-messages inbox on MySQL or MariaDB (InnoDB). Cheap to clone.
///
/// [`process`](Self::process) opens a transaction on the pool, inserts the marker
/// `(consumer, message_id)` first, runs the handler on the same connection, and commits both.
/// A copy processed before fails the marker's insert with error 1062 on the table's own primary
/// key (`PRIMARY`): [`Processed::Duplicate`], the handler not run. A concurrent copy holding the
/// uncommitted marker makes the insert wait up to [`lock_timeout`](MySqlInboxBuilder::lock_timeout)
/// (`innodb_lock_wait_timeout` for that one statement, the session's own restored after it),
/// then [`Processed::Busy`]. Any other error, the handler's duplicate-key errors included,
/// rolls back and propagates.
///
/// ```no_run
/// # async fn example(pool: sqlx::MySqlPool) -> Result<(), Box<dyn std::error::Error>> {
/// use idempotent_runtime::inbox::{MySqlInbox, Processed};
///
/// let inbox = MySqlInbox::new(pool, "stock-reserver");
/// inbox.migrate().await?;
/// let processed = inbox
///     .process("msg-42", |conn| {
///         Box::pin(async move {
///             sqlx::query("UPDATE stock SET held = held + 1 WHERE sku = ?")
///                 .bind("sku-1")
///                 .execute(&mut *conn)
///                 .await
///         })
///     })
///     .await?;
/// assert!(matches!(processed, Processed::Done(_) | Processed::Duplicate | Processed::Busy));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MySqlInbox {
    pool: MySqlPool,
    s: Arc<Settings>,
}

struct Settings {
    consumer: String,
    table: TableName,
    lock_timeout: Duration,
    retention: Duration,
    lock_sql: Arc<str>,
    insert_sql: Arc<str>,
    sweep_sql: Arc<str>,
}

impl fmt::Debug for MySqlInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlInbox")
            .field("consumer", &self.s.consumer)
            .field("table", &self.s.table.qualified)
            .field("lock_timeout", &self.s.lock_timeout)
            .field("retention", &self.s.retention)
            .finish_non_exhaustive()
    }
}

/// Builds a [`MySqlInbox`]: its table and timings.
#[derive(Debug, Clone)]
#[must_use]
pub struct MySqlInboxBuilder {
    pool: MySqlPool,
    consumer: String,
    database: Option<String>,
    table: String,
    lock_timeout: Duration,
    retention: Duration,
}

impl MySqlInboxBuilder {
    /// The database the table is in (default: the connection's).
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.database = Some(database.into());
        self
    }

    /// The table (default `processed_messages`): lowercase ASCII letters, digits and `_`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long the marker's insert waits for a concurrent copy's uncommitted marker before
    /// the message is [`Busy`](Processed::Busy) (default 5 s; whole seconds, at least 1,
    /// MySQL's unit and minimum).
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// How long markers are kept before [`MySqlInbox::sweep`] deletes them (default 7 days):
    /// longer than the broker may redeliver.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The inbox; fails on a bad table or database name.
    pub fn build(self) -> Result<MySqlInbox, InvalidName> {
        let table =
            TableName::quoted_with(INBOX_NAMES, self.database.as_deref(), &self.table, '`')?;
        let t = &table.qualified;
        let secs = self.lock_timeout.as_secs() + u64::from(self.lock_timeout.subsec_nanos() > 0);
        // One statement: keep the session's own wait, then bound this insert's.
        let lock_sql = format!(
            "SET @idempotent_inbox_wait = @@SESSION.innodb_lock_wait_timeout, \
                 SESSION innodb_lock_wait_timeout = {}",
            secs.clamp(1, 1_073_741_824)
        );
        let insert_sql =
            format!("INSERT INTO {t} (consumer, message_id, processed_at) VALUES (?, ?, {NOW_MS})");
        // Oldest first, in batches; the delete's own predicate is the re-check.
        let sweep_sql = format!(
            "DELETE FROM {t} WHERE consumer = ? AND processed_at < {NOW_MS} - ? \
             ORDER BY processed_at LIMIT ?"
        );
        Ok(MySqlInbox {
            pool: self.pool,
            s: Arc::new(Settings {
                consumer: self.consumer,
                table,
                lock_timeout: self.lock_timeout,
                retention: self.retention,
                lock_sql: lock_sql.into(),
                insert_sql: insert_sql.into(),
                sweep_sql: sweep_sql.into(),
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

impl MySqlInbox {
    /// An inbox for `consumer` over `pool`, with the table `processed_messages`.
    pub fn new(pool: MySqlPool, consumer: impl Into<String>) -> Self {
        Self::builder(pool, consumer)
            .build()
            .expect("the default table name is a valid identifier")
    }

    /// A builder for an inbox for `consumer` over `pool`.
    pub fn builder(pool: MySqlPool, consumer: impl Into<String>) -> MySqlInboxBuilder {
        MySqlInboxBuilder {
            pool,
            consumer: consumer.into(),
            database: None,
            table: DEFAULT_TABLE.to_owned(),
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            retention: DEFAULT_RETENTION,
        }
    }

    /// The consumer whose markers this inbox keeps.
    pub fn consumer(&self) -> &str {
        &self.s.consumer
    }

    /// The quoted, qualified table name.
    pub fn qualified_table(&self) -> &str {
        &self.s.table.qualified
    }

    /// The pool the inbox's transactions run on.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Creates or upgrades the table through the crate's versioned runner (safe from several
    /// consumers at once: they queue on a `GET_LOCK` named after the table).
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sql::migrate::<My>(&self.pool, &self.s.table, MIGRATIONS).await
    }

    /// The DDL of every migration, for your own migration tool.
    pub fn migrations(database: Option<&str>, table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::quoted_with(INBOX_NAMES, database, table, '`')?.migrations(MIGRATIONS))
    }

    /// Whether the marker's insert failed on the marker's own key: error 1062 naming the
    /// `PRIMARY` key (MariaDB says `'PRIMARY'`, MySQL 8 `'<table>.PRIMARY'`).
    fn is_duplicate(&self, e: &sqlx::Error) -> bool {
        number(e) == Some(DUPLICATE_KEY)
            && e.as_database_error().is_some_and(|db| {
                let message = db.message();
                message.ends_with("'PRIMARY'")
                    || message.ends_with(&format!("'{}.PRIMARY'", self.s.table.name))
            })
    }

    /// Processes the message `message_id` once for this consumer: see [`MySqlInbox`]. The
    /// handler writes through the connection it is given and must not commit.
    pub async fn process<T, E, F>(
        &self,
        message_id: &str,
        handler: F,
    ) -> Result<Processed<T>, InboxError<E>>
    where
        F: for<'c> FnOnce(&'c mut MySqlConnection) -> BoxFuture<'c, Result<T, E>>,
    {
        let s = &*self.s;
        let mut tx: Transaction<'static, MySql> = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return store_failed(&s.consumer, message_id, e),
        };
        if let Err(e) = sqlx::query(AssertSqlSafe(s.lock_sql.clone()))
            .execute(&mut *tx)
            .await
        {
            roll_back(&s.consumer, tx).await;
            return store_failed(&s.consumer, message_id, e);
        }
        let marker = sqlx::query(AssertSqlSafe(s.insert_sql.clone()))
            .bind(s.consumer.as_bytes())
            .bind(message_id.as_bytes())
            .execute(&mut *tx)
            .await;
        let restored = sqlx::query("SET SESSION innodb_lock_wait_timeout = @idempotent_inbox_wait")
            .execute(&mut *tx)
            .await;
        if let Err(e) = marker {
            roll_back(&s.consumer, tx).await;
            return if self.is_duplicate(&e) {
                answered(&s.consumer, message_id, Processed::Duplicate)
            } else if number(&e) == Some(LOCK_WAIT_TIMEOUT) {
                answered(&s.consumer, message_id, Processed::Busy)
            } else {
                store_failed(&s.consumer, message_id, e)
            };
        }
        if let Err(e) = restored {
            roll_back(&s.consumer, tx).await;
            return store_failed(&s.consumer, message_id, e);
        }
        let value = match handler(&mut tx).await {
            Ok(value) => value,
            Err(e) => {
                roll_back(&s.consumer, tx).await;
                observe(Outcome::Failed, &s.consumer, message_id);
                return Err(InboxError::Handler(e));
            }
        };
        match tx.commit().await {
            Ok(()) => answered(&s.consumer, message_id, Processed::Done(value)),
            Err(e) => store_failed(&s.consumer, message_id, e),
        }
    }

    /// Deletes up to `batch` of this consumer's markers older than the retention; returns how
    /// many.
    pub async fn sweep(&self, batch: usize) -> Result<usize, sqlx::Error> {
        let retention_ms = self.s.retention.as_millis().min(i64::MAX as u128) as i64;
        let done = sqlx::query(AssertSqlSafe(self.s.sweep_sql.clone()))
            .bind(self.s.consumer.as_bytes())
            .bind(retention_ms)
            .bind(batch.min(i64::MAX as usize) as i64)
            .execute(&self.pool)
            .await?;
        let deleted = done.rows_affected() as usize;
        observe_swept(&self.s.consumer, deleted);
        Ok(deleted)
    }

    /// Sweeps in the background, at a cadence of the retention (at most hourly); abort the
    /// handle to stop.
    pub fn spawn_sweeper(&self) -> tokio::task::JoinHandle<()> {
        let inbox = self.clone();
        let (consumer, retention) = (self.s.consumer.clone(), self.s.retention);
        spawn_sweep_loop(format!("inbox {consumer}"), retention, move || {
            let inbox = inbox.clone();
            async move { inbox.sweep(DEFAULT_SWEEP_BATCH).await }
        })
    }
}
