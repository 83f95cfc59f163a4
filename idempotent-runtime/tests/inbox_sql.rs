//! The MySQL/MariaDB and SQLite inboxes against real databases (DESIGN.md §6): the same cases
//! for both, written once. MySQL reads `MYSQL_URL` (skipping without it unless
//! `IDEMPOTENT_REQUIRE_MYSQL=1`) and works in a database of its own; SQLite in a file of its own.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::inbox::{InboxError, Processed};
use idempotent_runtime::store::FencingToken;

/// The cases, for an inbox type over a connection type, given a `Db` with `inbox(consumer,
/// lock_timeout)`, `exec(sql)`, `scalar(sql)` and the statements of its dialect.
macro_rules! inbox_cases {
    ($db:ident, $conn:ty) => {
        /// The handler: counts its run and reserves one apple in the message's transaction.
        fn reserve(
            runs: Arc<AtomicUsize>,
            hold: Duration,
        ) -> impl for<'c> FnOnce(
            &'c mut $conn,
        ) -> idempotent_runtime::inbox::BoxFuture<
            'c,
            Result<&'static str, sqlx::Error>,
        > {
            move |conn| {
                Box::pin(async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'apple'")
                        .execute(&mut *conn)
                        .await?;
                    tokio::time::sleep(hold).await;
                    Ok("reserved")
                })
            }
        }

        /// A handler that inserts into a table of its own with a unique key of its own.
        fn insert_order() -> impl for<'c> FnOnce(
            &'c mut $conn,
        ) -> idempotent_runtime::inbox::BoxFuture<
            'c,
            Result<(), sqlx::Error>,
        > {
            move |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO reservations (order_id) VALUES ('order-1')")
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            }
        }

        /// A handler that writes, then fails.
        fn failing() -> impl for<'c> FnOnce(
            &'c mut $conn,
        ) -> idempotent_runtime::inbox::BoxFuture<
            'c,
            Result<(), String>,
        > {
            move |conn| {
                Box::pin(async move {
                    sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'apple'")
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    Err("the downstream call failed".to_owned())
                })
            }
        }

        #[tokio::test]
        async fn a_redelivered_message_is_a_duplicate_and_the_handler_does_not_run_again() {
            let Some(db) = $db::new().await else { return };
            let inbox = db.inbox("reserve-stock", Duration::from_secs(5)).await;
            let runs = Arc::new(AtomicUsize::new(0));
            for expected in [Processed::Done("reserved"), Processed::Duplicate] {
                let got = inbox
                    .process("msg-1", reserve(runs.clone(), Duration::ZERO))
                    .await
                    .unwrap();
                assert_eq!(got, expected);
                assert!(got.should_ack());
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran twice");
            assert_eq!(db.scalar("SELECT reserved FROM stock").await, 1);
            // Ids are compared exactly: another case is another message.
            let other = inbox
                .process("MSG-1", reserve(runs.clone(), Duration::ZERO))
                .await
                .unwrap();
            assert_eq!(other, Processed::Done("reserved"));
            // Another consumer of the same message has its own marker and runs.
            let notify = db.inbox("notify", Duration::from_secs(5)).await;
            let got = notify
                .process("msg-1", reserve(runs.clone(), Duration::ZERO))
                .await
                .unwrap();
            assert_eq!(got, Processed::Done("reserved"));
            assert_eq!(
                db.scalar("SELECT count(*) FROM processed_messages").await,
                3
            );
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn sixteen_concurrent_copies_apply_the_effect_once() {
            let Some(db) = $db::new().await else { return };
            let inbox = db.inbox("reserve-stock", Duration::from_secs(10)).await;
            let runs = Arc::new(AtomicUsize::new(0));
            let mut copies = Vec::new();
            for _ in 0..16 {
                let (inbox, runs) = (inbox.clone(), runs.clone());
                copies.push(tokio::spawn(async move {
                    inbox
                        .process("msg-crowd", reserve(runs, Duration::from_millis(200)))
                        .await
                        .unwrap()
                }));
            }
            let mut done = 0;
            for copy in copies {
                match copy.await.unwrap() {
                    Processed::Done(_) => done += 1,
                    Processed::Duplicate | Processed::Busy => {}
                }
            }
            assert_eq!(done, 1, "more than one copy ran");
            assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran twice");
            assert_eq!(db.scalar("SELECT reserved FROM stock").await, 1);
        }

        #[tokio::test]
        async fn a_handlers_own_unique_violation_propagates_and_is_not_a_duplicate() {
            let Some(db) = $db::new().await else { return };
            let inbox = db.inbox("orders", Duration::from_secs(5)).await;
            assert_eq!(
                inbox.process("msg-a", insert_order()).await.unwrap(),
                Processed::Done(())
            );
            // Another message whose handler violates the reservations' own unique key.
            match inbox.process("msg-b", insert_order()).await {
                Err(InboxError::Handler(e)) => {
                    assert!(e.as_database_error().is_some(), "{e}");
                }
                other => panic!("a foreign unique violation was taken as {other:?}"),
            }
            // Nothing of msg-b was kept: no marker, so a redelivery runs (and fails) again.
            assert!(matches!(
                inbox.process("msg-b", insert_order()).await,
                Err(InboxError::Handler(_))
            ));
            assert_eq!(
                db.scalar("SELECT count(*) FROM processed_messages").await,
                1
            );
        }

        #[tokio::test]
        async fn a_handler_error_rolls_back_and_leaves_no_marker_so_the_redelivery_runs() {
            let Some(db) = $db::new().await else { return };
            let inbox = db.inbox("reserve-stock", Duration::from_secs(5)).await;
            assert!(matches!(
                inbox.process("msg-1", failing()).await,
                Err(InboxError::Handler(_))
            ));
            assert_eq!(
                db.scalar("SELECT reserved FROM stock").await,
                0,
                "not rolled back"
            );
            assert_eq!(
                db.scalar("SELECT count(*) FROM processed_messages").await,
                0
            );
            let runs = Arc::new(AtomicUsize::new(0));
            let again = inbox
                .process("msg-1", reserve(runs.clone(), Duration::ZERO))
                .await
                .unwrap();
            assert_eq!(again, Processed::Done("reserved"));
            assert_eq!(db.scalar("SELECT reserved FROM stock").await, 1);
        }

        #[tokio::test]
        async fn migrate_is_idempotent_and_sweep_deletes_only_markers_older_than_retention() {
            let Some(db) = $db::new().await else { return };
            let inbox = db.inbox("reserve-stock", Duration::from_secs(5)).await;
            inbox.migrate().await.expect("a second migrate");
            let runs = Arc::new(AtomicUsize::new(0));
            for id in ["old-1", "old-2", "old-3"] {
                let _ = inbox
                    .process(id, reserve(runs.clone(), Duration::ZERO))
                    .await
                    .unwrap();
            }
            db.age_markers(Duration::from_secs(8 * 24 * 3600)).await;
            let _ = inbox
                .process("new-1", reserve(runs.clone(), Duration::ZERO))
                .await
                .unwrap();
            assert_eq!(
                inbox.sweep(2).await.unwrap(),
                2,
                "a batch is at most its size"
            );
            assert_eq!(inbox.sweep(100).await.unwrap(), 1);
            assert_eq!(inbox.sweep(100).await.unwrap(), 0);
            // The recent marker still stands: its copy is a duplicate.
            let again = inbox
                .process("new-1", reserve(runs.clone(), Duration::ZERO))
                .await
                .unwrap();
            assert_eq!(again, Processed::Duplicate);
        }
    };
}

mod mysql {
    use idempotent_runtime::inbox::MySqlInbox;
    use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

    use super::*;

    /// A database of its own with the handler's tables, dropped at the end (best effort).
    pub(super) struct Db {
        base: MySqlConnectOptions,
        pool: MySqlPool,
        name: String,
    }

    impl Db {
        pub(super) async fn new() -> Option<Self> {
            let url = support::mysql_url()?;
            let base: MySqlConnectOptions = url.parse().expect("MYSQL_URL");
            let admin = MySqlPoolOptions::new()
                .max_connections(1)
                .connect_with(base.clone())
                .await
                .expect("connect to MYSQL_URL");
            let name = format!("idem_inbox_{:016x}", FencingToken::mint().0);
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
                .execute(&admin)
                .await
                .expect("create database");
            let pool = MySqlPoolOptions::new()
                .max_connections(20)
                .connect_with(base.clone().database(&name))
                .await
                .expect("connect");
            admin.close().await;
            let db = Self { base, pool, name };
            db.exec("CREATE TABLE stock (sku VARCHAR(16) PRIMARY KEY, reserved INT NOT NULL DEFAULT 0) ENGINE = InnoDB").await;
            db.exec("CREATE TABLE reservations (order_id VARCHAR(16) NOT NULL, UNIQUE KEY reservations_order_key (order_id)) ENGINE = InnoDB").await;
            db.exec("INSERT INTO stock (sku) VALUES ('apple')").await;
            Some(db)
        }

        pub(super) async fn inbox(&self, consumer: &str, lock: Duration) -> MySqlInbox {
            let inbox = MySqlInbox::builder(self.pool.clone(), consumer)
                .lock_timeout(lock)
                .build()
                .unwrap();
            inbox.migrate().await.expect("migrate");
            inbox
        }

        async fn exec(&self, sql: &str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }

        pub(super) async fn scalar(&self, sql: &str) -> i64 {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT CAST(({sql}) AS SIGNED)"
            )))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
        }

        pub(super) async fn age_markers(&self, by: Duration) {
            self.exec(&format!(
                "UPDATE processed_messages SET processed_at = processed_at - {}",
                by.as_millis()
            ))
            .await;
        }
    }

    impl Drop for Db {
        /// Drops the database from a thread and runtime of their own, on a connection of their
        /// own: the test's runtime may be the current-thread one this drop blocks, which must
        /// not be asked to drive any I/O meanwhile.
        fn drop(&mut self) {
            let (base, name) = (self.base.clone(), self.name.clone());
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    use sqlx::Connection as _;
                    if let Ok(mut conn) = sqlx::MySqlConnection::connect_with(&base).await {
                        let drop = format!("DROP DATABASE IF EXISTS `{name}`");
                        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
                            .execute(&mut conn)
                            .await;
                        let _ = conn.close().await;
                    }
                });
            })
            .join();
        }
    }

    inbox_cases!(Db, sqlx::MySqlConnection);

    /// A handler that reads its session's `innodb_lock_wait_timeout`.
    fn session_lock_wait() -> impl for<'c> FnOnce(
        &'c mut sqlx::MySqlConnection,
    ) -> idempotent_runtime::inbox::BoxFuture<
        'c,
        Result<i64, sqlx::Error>,
    > {
        |conn| {
            Box::pin(async move {
                sqlx::query_scalar("SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)")
                    .fetch_one(&mut *conn)
                    .await
            })
        }
    }

    /// A copy that meets a concurrent copy's uncommitted marker waits the inbox's lock timeout
    /// (not the session's 50 s), then is Busy; the session's own timeout is restored after.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_meeting_an_uncommitted_marker_past_the_lock_timeout_is_busy() {
        let Some(db) = Db::new().await else { return };
        let inbox = db.inbox("reserve-stock", Duration::from_secs(1)).await;
        let runs = Arc::new(AtomicUsize::new(0));
        let first = {
            let (inbox, runs) = (inbox.clone(), runs.clone());
            tokio::spawn(async move {
                inbox
                    .process("msg-1", reserve(runs, Duration::from_millis(3000)))
                    .await
                    .unwrap()
            })
        };
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let second = inbox
            .process("msg-1", reserve(runs.clone(), Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(second, Processed::Busy);
        assert!(!second.should_ack());
        assert_eq!(first.await.unwrap(), Processed::Done("reserved"));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // The handler ran with the session's own lock wait, not the inbox's.
        let wait = inbox.process("msg-2", session_lock_wait()).await.unwrap();
        assert_eq!(
            wait,
            Processed::Done(50),
            "the inbox's lock wait leaked to the handler"
        );
    }
}

mod sqlite {
    use idempotent_runtime::inbox::SqliteInbox;
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

    use super::*;

    /// A database file of its own with the handler's tables, removed at the end.
    pub(super) struct Db {
        pool: SqlitePool,
        dir: std::path::PathBuf,
    }

    impl Db {
        pub(super) async fn new() -> Option<Self> {
            let dir = std::env::temp_dir().join(format!(
                "idem-inbox-{}-{:016x}",
                std::process::id(),
                FencingToken::mint().0
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let options = SqliteConnectOptions::new()
                .filename(dir.join("inbox.db"))
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(10));
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(options)
                .await
                .expect("open");
            let db = Self { pool, dir };
            db.exec(
                "CREATE TABLE stock (sku TEXT PRIMARY KEY, reserved INTEGER NOT NULL DEFAULT 0)",
            )
            .await;
            db.exec("CREATE TABLE reservations (order_id TEXT NOT NULL, CONSTRAINT reservations_order_key UNIQUE (order_id))").await;
            db.exec("INSERT INTO stock (sku) VALUES ('apple')").await;
            Some(db)
        }

        pub(super) async fn inbox(&self, consumer: &str, _lock: Duration) -> SqliteInbox {
            let inbox = SqliteInbox::new(self.pool.clone(), consumer);
            inbox.migrate().await.expect("migrate");
            inbox
        }

        async fn exec(&self, sql: &str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }

        pub(super) async fn scalar(&self, sql: &str) -> i64 {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
        }

        pub(super) async fn age_markers(&self, by: Duration) {
            self.exec(&format!(
                "UPDATE processed_messages SET processed_at = processed_at - {}",
                by.as_millis()
            ))
            .await;
        }
    }

    impl Drop for Db {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    inbox_cases!(Db, sqlx::SqliteConnection);
}
