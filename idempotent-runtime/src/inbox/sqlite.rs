//! The SQLite inbox: a marker row per processed message, written in the handler's transaction.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::error::ErrorKind;
use sqlx::sqlite::{SqliteConnection, SqlitePool};
use sqlx::{AssertSqlSafe, Sqlite, Transaction};

use super::{
    BoxFuture, DEFAULT_RETENTION, DEFAULT_SWEEP_BATCH, DEFAULT_TABLE, InboxError, Outcome,
    Processed, answered, observe, observe_swept, roll_back, spawn_sweep_loop, store_failed,
};
use crate::clock::{Clock, SystemClock};
use crate::sql::{self, INBOX_NAMES, InvalidName, Lite, Migrations, Step, TableName};

/// The versioned DDL shipped with the crate, in order. Never edit a shipped migration: add one.
const MIGRATIONS: &[Step] = &[Step {
    version: 1,
    description: "create processed messages",
    template: include_str!("../../migrations/sqlite_inbox/0001_create_processed_messages.sql"),
}];

/// A processed-messages inbox on SQLite. Cheap to clone.
///
/// [`process`](Self::process) opens a transaction with `BEGIN IMMEDIATE` (SQLite's one writer
/// lock, taken at once), inserts the marker `(consumer, message_id)` first, runs the handler on
/// the same connection, and commits both. A copy processed before fails the marker's insert on
/// the table's own primary key (the constraint failure naming its `consumer` and `message_id`
/// columns): [`Processed::Duplicate`], the handler not run. A concurrent copy holds the writer
/// lock while it runs, so this one waits for it (up to the connection's `busy_timeout`) and then
/// finds its marker: a duplicate; if the wait runs out, [`Processed::Busy`]. Any other error,
/// the handler's own constraint failures included, rolls back and propagates.
///
/// ```no_run
/// # async fn example(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// use idempotent_runtime::inbox::{Processed, SqliteInbox};
///
/// let inbox = SqliteInbox::new(pool, "stock-reserver");
/// inbox.migrate().await?;
/// let processed = inbox
///     .process("msg-42", |conn| {
///         Box::pin(async move {
///             sqlx::query("UPDATE stock SET held = held + 1 WHERE sku = ?1")
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
pub struct SqliteInbox {
    pool: SqlitePool,
    s: Arc<Settings>,
}

struct Settings {
    consumer: String,
    table: TableName,
    retention: Duration,
    clock: Arc<dyn Clock>,
    insert_sql: Arc<str>,
    sweep_sql: Arc<str>,
    /// The end of the primary key's constraint failure message: `<table>.consumer,
    /// <table>.message_id`.
    duplicate: String,
}

impl fmt::Debug for SqliteInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteInbox")
            .field("consumer", &self.s.consumer)
            .field("table", &self.s.table.qualified)
            .field("retention", &self.s.retention)
            .finish_non_exhaustive()
    }
}

/// Builds a [`SqliteInbox`]: its table, retention and clock.
#[derive(Clone)]
#[must_use]
pub struct SqliteInboxBuilder {
    pool: SqlitePool,
    consumer: String,
    table: String,
    retention: Duration,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for SqliteInboxBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteInboxBuilder")
            .field("consumer", &self.consumer)
            .field("table", &self.table)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl SqliteInboxBuilder {
    /// The table (default `processed_messages`): lowercase ASCII letters, digits and `_`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long markers are kept before [`SqliteInbox::sweep`] deletes them (default 7 days):
    /// longer than the broker may redeliver.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The clock markers are stamped and swept by (default the system's).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The inbox; fails on a bad table name.
    pub fn build(self) -> Result<SqliteInbox, InvalidName> {
        let table = TableName::new(INBOX_NAMES, None, &self.table)?;
        let t = &table.qualified;
        let insert_sql =
            format!("INSERT INTO {t} (consumer, message_id, processed_at) VALUES (?1, ?2, ?3)");
        // Oldest first, in batches; the outer predicate re-checks the age.
        let sweep_sql = format!(
            "DELETE FROM {t} WHERE rowid IN \
                 (SELECT rowid FROM {t} WHERE consumer = ?1 AND processed_at < ?2 \
                  ORDER BY processed_at LIMIT ?3) \
             AND processed_at < ?2"
        );
        Ok(SqliteInbox {
            pool: self.pool,
            s: Arc::new(Settings {
                duplicate: format!("{0}.consumer, {0}.message_id", table.name),
                consumer: self.consumer,
                table,
                retention: self.retention,
                clock: self.clock,
                insert_sql: insert_sql.into(),
                sweep_sql: sweep_sql.into(),
            }),
        })
    }
}

/// Whether SQLite answered "busy" (the writer lock was not free within `busy_timeout`), in any
/// of its extended forms.
fn is_busy(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| code & 0xff == 5)
}

impl SqliteInbox {
    /// An inbox for `consumer` over `pool`, with the table `processed_messages`.
    pub fn new(pool: SqlitePool, consumer: impl Into<String>) -> Self {
        Self::builder(pool, consumer)
            .build()
            .expect("the default table name is a valid identifier")
    }

    /// A builder for an inbox for `consumer` over `pool`.
    pub fn builder(pool: SqlitePool, consumer: impl Into<String>) -> SqliteInboxBuilder {
        SqliteInboxBuilder {
            pool,
            consumer: consumer.into(),
            table: DEFAULT_TABLE.to_owned(),
            retention: DEFAULT_RETENTION,
            clock: Arc::new(SystemClock),
        }
    }

    /// The consumer whose markers this inbox keeps.
    pub fn consumer(&self) -> &str {
        &self.s.consumer
    }

    /// The quoted table name.
    pub fn qualified_table(&self) -> &str {
        &self.s.table.qualified
    }

    /// The pool the inbox's transactions run on.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Creates or upgrades the table through the crate's versioned runner.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sql::migrate::<Lite>(&self.pool, &self.s.table, MIGRATIONS).await
    }

    /// The DDL of every migration, for your own migration tool.
    pub fn migrations(table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::new(INBOX_NAMES, None, table)?.migrations(MIGRATIONS))
    }

    /// Whether the marker's insert failed on the marker's own key.
    fn is_duplicate(&self, e: &sqlx::Error) -> bool {
        e.as_database_error().is_some_and(|db| {
            db.kind() == ErrorKind::UniqueViolation && db.message().ends_with(&self.s.duplicate)
        })
    }

    fn now(&self) -> i64 {
        i64::try_from(self.s.clock.now_millis()).unwrap_or(i64::MAX)
    }

    /// Processes the message `message_id` once for this consumer: see [`SqliteInbox`]. The
    /// handler writes through the connection it is given and must not commit.
    pub async fn process<T, E, F>(
        &self,
        message_id: &str,
        handler: F,
    ) -> Result<Processed<T>, InboxError<E>>
    where
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<T, E>>,
    {
        let s = &*self.s;
        let mut tx: Transaction<'static, Sqlite> =
            match self.pool.begin_with("BEGIN IMMEDIATE").await {
                Ok(tx) => tx,
                Err(e) if is_busy(&e) => {
                    return answered(&s.consumer, message_id, Processed::Busy);
                }
                Err(e) => return store_failed(&s.consumer, message_id, e),
            };
        let marker = sqlx::query(AssertSqlSafe(s.insert_sql.clone()))
            .bind(&s.consumer)
            .bind(message_id)
            .bind(self.now())
            .execute(&mut *tx)
            .await;
        if let Err(e) = marker {
            roll_back(&s.consumer, tx).await;
            return if self.is_duplicate(&e) {
                answered(&s.consumer, message_id, Processed::Duplicate)
            } else if is_busy(&e) {
                answered(&s.consumer, message_id, Processed::Busy)
            } else {
                store_failed(&s.consumer, message_id, e)
            };
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
            .bind(&self.s.consumer)
            .bind(self.now().saturating_sub(retention_ms))
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
