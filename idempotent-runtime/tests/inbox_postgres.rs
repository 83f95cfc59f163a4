//! The PostgreSQL inbox against a real database (DESIGN.md §6).
//!
//! Reads `DATABASE_URL`; without it each test says so and skips, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Each test works in its own schema.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::inbox::{BoxFuture, InboxError, PostgresInbox, Processed};
use idempotent_runtime::store::FencingToken;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection};

/// A pool and a fresh schema, dropped at the end of the test (best effort).
struct Db {
    pool: PgPool,
    schema: String,
}

impl Db {
    async fn connect() -> Option<Self> {
        let url = support::database_url()?;
        let pool = PgPoolOptions::new()
            .max_connections(24)
            .connect(&url)
            .await
            .expect("connect to DATABASE_URL");
        let schema = format!("inbox_test_{:016x}", FencingToken::mint().0);
        let db = Self { pool, schema };
        db.exec(&format!("CREATE SCHEMA {}", db.schema)).await;
        db.exec(&format!(
            "CREATE TABLE {}.stock (sku text PRIMARY KEY, reserved int NOT NULL DEFAULT 0)",
            db.schema
        ))
        .await;
        db.exec(&format!(
            "CREATE TABLE {}.reservations (message_id text NOT NULL, order_id text NOT NULL, \
             CONSTRAINT reservations_order_key UNIQUE (order_id))",
            db.schema
        ))
        .await;
        db.exec(&format!(
            "INSERT INTO {}.stock (sku) VALUES ('apple')",
            db.schema
        ))
        .await;
        Some(db)
    }

    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    async fn inbox(&self, consumer: &str) -> PostgresInbox {
        let inbox = PostgresInbox::builder(self.pool.clone(), consumer)
            .schema(&self.schema)
            .build()
            .unwrap();
        inbox.migrate().await.expect("migrate");
        inbox
    }

    async fn reserved(&self) -> i64 {
        self.scalar(&format!(
            "SELECT reserved::bigint FROM {}.stock WHERE sku = 'apple'",
            self.schema
        ))
        .await
    }

    async fn markers(&self, inbox: &PostgresInbox, message_id: &str) -> i64 {
        self.scalar(&format!(
            "SELECT count(*) FROM {} WHERE consumer = '{}' AND message_id = '{message_id}'",
            inbox.qualified_table(),
            inbox.consumer()
        ))
        .await
    }

    async fn drop_schema(self) {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema
        )))
        .execute(&self.pool)
        .await;
    }
}

/// Reserves one apple and counts the runs: the effect whose once-ness the tests check.
async fn reserve(
    conn: &mut PgConnection,
    schema: &str,
    runs: &AtomicUsize,
) -> Result<&'static str, sqlx::Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {schema}.stock SET reserved = reserved + 1 WHERE sku = 'apple'"
    )))
    .execute(&mut *conn)
    .await?;
    Ok("reserved")
}

/// A named handler: a function returning the closure gives the compiler the higher-ranked
/// signature that an inline `let` closure would not get.
fn insert_order(
    schema: String,
    message_id: &'static str,
) -> impl for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<(), sqlx::Error>> {
    move |conn| {
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {schema}.reservations (message_id, order_id) VALUES ($1, 'order-1')"
            )))
            .bind(message_id)
            .execute(&mut *conn)
            .await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn a_redelivered_message_is_a_duplicate_and_the_handler_does_not_run_again() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = db.inbox("reserve-stock").await;
    let runs = Arc::new(AtomicUsize::new(0));
    for expected in [Processed::Done("reserved"), Processed::Duplicate] {
        let (schema, runs) = (db.schema.clone(), runs.clone());
        let got = inbox
            .process("msg-1", move |conn| {
                Box::pin(async move { reserve(conn, &schema, &runs).await })
            })
            .await
            .unwrap();
        assert_eq!(got, expected);
        assert!(got.should_ack());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran twice");
    assert_eq!(db.reserved().await, 1);
    assert_eq!(db.markers(&inbox, "msg-1").await, 1);

    // Another consumer of the same message has its own marker and runs.
    let other = db.inbox("notify").await;
    let got = other
        .process("msg-1", |_| Box::pin(async { Ok::<_, sqlx::Error>(()) }))
        .await
        .unwrap();
    assert_eq!(got, Processed::Done(()));
    db.drop_schema().await;
}

#[tokio::test]
async fn sixteen_concurrent_copies_apply_the_effect_once() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = db.inbox("reserve-stock").await;
    let runs = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (inbox, schema, runs, barrier) = (
                inbox.clone(),
                db.schema.clone(),
                runs.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                inbox
                    .process("msg-1", move |conn| {
                        Box::pin(async move {
                            let r = reserve(conn, &schema, &runs).await;
                            // Keep the marker uncommitted a while, so that copies meet it.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            r
                        })
                    })
                    .await
            })
        })
        .collect();
    // A liveness bound, not a speed assertion: no copy may wait forever on another's marker.
    let results = tokio::time::timeout(Duration::from_secs(120), async {
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap().unwrap());
        }
        out
    })
    .await
    .expect("a copy blocked indefinitely");
    let done = results
        .iter()
        .filter(|r| matches!(r, Processed::Done(_)))
        .count();
    assert_eq!(done, 1, "{results:?}");
    assert!(
        results.iter().all(|r| matches!(
            r,
            Processed::Done(_) | Processed::Duplicate | Processed::Busy
        )),
        "{results:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran more than once"
    );
    assert_eq!(db.reserved().await, 1);
    assert_eq!(db.markers(&inbox, "msg-1").await, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_copy_meeting_an_uncommitted_marker_past_the_lock_timeout_is_busy() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = PostgresInbox::builder(db.pool.clone(), "reserve-stock")
        .schema(&db.schema)
        .lock_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    inbox.migrate().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (inbox, schema, runs) = (inbox.clone(), db.schema.clone(), runs.clone());
        tokio::spawn(async move {
            inbox
                .process("msg-1", move |conn| {
                    Box::pin(async move {
                        let r = reserve(conn, &schema, &runs).await;
                        entered_tx.send(()).unwrap();
                        release_rx.await.unwrap();
                        r
                    })
                })
                .await
        })
    };
    entered_rx.await.unwrap();
    let (schema, runs2) = (db.schema.clone(), runs.clone());
    let second = inbox
        .process("msg-1", move |conn| {
            Box::pin(async move { reserve(conn, &schema, &runs2).await })
        })
        .await
        .unwrap();
    assert_eq!(second, Processed::Busy);
    assert!(!second.should_ack());
    release_tx.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Processed::Done("reserved"));
    let (schema, runs3) = (db.schema.clone(), runs.clone());
    let third = inbox
        .process("msg-1", move |conn| {
            Box::pin(async move { reserve(conn, &schema, &runs3).await })
        })
        .await
        .unwrap();
    assert_eq!(third, Processed::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(db.reserved().await, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_handlers_own_unique_violation_propagates_and_is_not_a_duplicate() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = db.inbox("record-order").await;
    assert_eq!(
        inbox
            .process("msg-1", insert_order(db.schema.clone(), "msg-1"))
            .await
            .unwrap(),
        Processed::Done(())
    );
    // A different message for the same order violates the handler's own constraint.
    let err = inbox
        .process("msg-2", insert_order(db.schema.clone(), "msg-2"))
        .await
        .expect_err("the handler's unique violation was swallowed");
    let InboxError::Handler(sqlx::Error::Database(e)) = &err else {
        panic!("expected the handler's database error, got {err:?}");
    };
    assert_eq!(e.code().as_deref(), Some("23505"));
    assert_eq!(e.constraint(), Some("reservations_order_key"));
    assert_eq!(
        db.markers(&inbox, "msg-2").await,
        0,
        "a failed message kept its marker"
    );

    // Even a constraint that shares the inbox's name, on another table, is the handler's.
    let other = format!("{}_other", db.schema);
    db.exec(&format!(
        "CREATE SCHEMA {other}; CREATE TABLE {other}.processed_messages (id int, \
         CONSTRAINT processed_messages_pkey PRIMARY KEY (id)); \
         INSERT INTO {other}.processed_messages VALUES (1)"
    ))
    .await;
    let other2 = other.clone();
    let err = inbox
        .process("msg-3", move |conn| {
            Box::pin(async move {
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {other2}.processed_messages VALUES (1)"
                )))
                .execute(&mut *conn)
                .await?;
                Ok::<_, sqlx::Error>(())
            })
        })
        .await
        .expect_err("a unique violation on another table was taken for a duplicate");
    assert!(
        matches!(err, InboxError::Handler(sqlx::Error::Database(_))),
        "{err:?}"
    );
    assert_eq!(db.markers(&inbox, "msg-3").await, 0);
    db.exec(&format!("DROP SCHEMA {other} CASCADE")).await;
    db.drop_schema().await;
}

#[tokio::test]
async fn a_unique_violation_at_commit_is_a_duplicate_only_on_the_inboxs_constraint() {
    let Some(db) = Db::connect().await else {
        return;
    };
    // A deferred primary key moves the duplicate check to COMMIT: the copy runs its handler,
    // then the commit fails on the inbox's constraint and everything is rolled back.
    db.exec(&format!(
        "CREATE TABLE {}.deferred_inbox (consumer text NOT NULL, message_id text NOT NULL, \
         processed_at timestamptz NOT NULL DEFAULT now(), CONSTRAINT deferred_inbox_pkey \
         PRIMARY KEY (consumer, message_id) DEFERRABLE INITIALLY DEFERRED)",
        db.schema
    ))
    .await;
    let deferred = PostgresInbox::builder(db.pool.clone(), "reserve-stock")
        .schema(&db.schema)
        .table("deferred_inbox")
        .build()
        .unwrap();
    deferred.migrate().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    for expected in [Processed::Done("reserved"), Processed::Duplicate] {
        let (schema, runs) = (db.schema.clone(), runs.clone());
        let got = deferred
            .process("msg-1", move |conn| {
                Box::pin(async move { reserve(conn, &schema, &runs).await })
            })
            .await
            .unwrap();
        assert_eq!(got, expected);
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the deferred check did not defer"
    );
    assert_eq!(
        db.reserved().await,
        1,
        "the duplicate's changes were committed"
    );

    // The handler's own deferred constraint failing at COMMIT is a failure, never a duplicate:
    // acking it would lose the message.
    let inbox = db.inbox("reserve-stock").await;
    db.exec(&format!(
        "CREATE TABLE {s}.tickets (id int, CONSTRAINT tickets_id_key UNIQUE (id) \
         DEFERRABLE INITIALLY DEFERRED); INSERT INTO {s}.tickets VALUES (1)",
        s = db.schema
    ))
    .await;
    let schema = db.schema.clone();
    let err = inbox
        .process("msg-2", move |conn| {
            Box::pin(async move {
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {schema}.tickets VALUES (1)"
                )))
                .execute(&mut *conn)
                .await?;
                Ok::<_, sqlx::Error>(())
            })
        })
        .await
        .expect_err("a failed commit was reported as processed");
    let InboxError::Store(e) = &err else {
        panic!("expected the commit's failure, got {err:?}");
    };
    let e = e.downcast_ref::<sqlx::Error>().expect("a sqlx::Error");
    let e = e.as_database_error().expect("a database error");
    assert_eq!(e.constraint(), Some("tickets_id_key"));
    assert_eq!(db.markers(&inbox, "msg-2").await, 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_handler_error_rolls_back_and_leaves_no_marker_so_the_redelivery_runs() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = db.inbox("reserve-stock").await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (schema, runs1) = (db.schema.clone(), runs.clone());
    let err = inbox
        .process("msg-1", move |conn| {
            Box::pin(async move {
                reserve(conn, &schema, &runs1).await?;
                Err::<(), _>(sqlx::Error::Protocol("payment declined".into()))
            })
        })
        .await
        .expect_err("the handler's error was swallowed");
    assert!(
        matches!(err, InboxError::Handler(sqlx::Error::Protocol(_))),
        "{err:?}"
    );
    assert_eq!(
        db.reserved().await,
        0,
        "the failed handler's change was kept"
    );
    assert_eq!(
        db.markers(&inbox, "msg-1").await,
        0,
        "the failed message kept its marker"
    );

    let (schema, runs2) = (db.schema.clone(), runs.clone());
    let redelivery = inbox
        .process("msg-1", move |conn| {
            Box::pin(async move { reserve(conn, &schema, &runs2).await })
        })
        .await
        .unwrap();
    assert_eq!(redelivery, Processed::Done("reserved"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(db.reserved().await, 1);
    assert_eq!(db.markers(&inbox, "msg-1").await, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_handler_that_swallows_a_failed_statement_is_not_acked() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = db.inbox("reserve-stock").await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (schema, runs1) = (db.schema.clone(), runs.clone());
    let err = inbox
        .process("msg-1", move |conn| {
            Box::pin(async move {
                reserve(conn, &schema, &runs1).await?;
                let _ = sqlx::query("SELECT 1/0").execute(&mut *conn).await;
                Ok::<_, sqlx::Error>(())
            })
        })
        .await
        .expect_err("an aborted transaction was reported as processed");
    assert!(matches!(err, InboxError::Store(_)), "{err:?}");
    assert_eq!(db.reserved().await, 0);
    assert_eq!(db.markers(&inbox, "msg-1").await, 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn sweep_deletes_only_markers_older_than_retention() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = db.inbox("reserve-stock").await;
    let other = db.inbox("notify").await;
    for id in ["old-1", "old-2", "old-3", "young"] {
        let got = inbox
            .process(id, |_| Box::pin(async { Ok::<_, sqlx::Error>(()) }))
            .await
            .unwrap();
        assert_eq!(got, Processed::Done(()));
    }
    let got = other
        .process("old-1", |_| Box::pin(async { Ok::<_, sqlx::Error>(()) }))
        .await
        .unwrap();
    assert_eq!(got, Processed::Done(()));
    // Retention is 7 days by default: backdate rather than wait.
    db.exec(&format!(
        "UPDATE {t} SET processed_at = now() - interval '8 days' WHERE message_id LIKE 'old-%'; \
         UPDATE {t} SET processed_at = now() - interval '6 days 23 hours' WHERE message_id = 'young'",
        t = inbox.qualified_table()
    ))
    .await;

    assert_eq!(inbox.sweep(2).await.unwrap(), 2, "a full batch");
    assert_eq!(inbox.sweep(2).await.unwrap(), 1);
    assert_eq!(inbox.sweep(2).await.unwrap(), 0);
    assert_eq!(
        db.markers(&inbox, "young").await,
        1,
        "swept a marker inside retention"
    );
    assert_eq!(
        db.markers(&other, "old-1").await,
        1,
        "swept another consumer's marker"
    );
    let young = inbox
        .process("young", |_| Box::pin(async { Ok::<_, sqlx::Error>(()) }))
        .await
        .unwrap();
    assert_eq!(young, Processed::Duplicate);
    let swept = inbox
        .process("old-2", |_| Box::pin(async { Ok::<_, sqlx::Error>(()) }))
        .await
        .unwrap();
    assert_eq!(swept, Processed::Done(()), "a swept message runs again");
    db.drop_schema().await;
}

#[tokio::test]
async fn the_background_sweeper_deletes_old_markers() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = PostgresInbox::builder(db.pool.clone(), "reserve-stock")
        .schema(&db.schema)
        .retention(Duration::from_secs(3600))
        .build()
        .unwrap();
    inbox.migrate().await.unwrap();
    for id in ["old", "young"] {
        let got = inbox
            .process(id, |_| Box::pin(async { Ok::<_, sqlx::Error>(()) }))
            .await
            .unwrap();
        assert_eq!(got, Processed::Done(()));
    }
    db.exec(&format!(
        "UPDATE {} SET processed_at = now() - interval '2 hours' WHERE message_id = 'old'",
        inbox.qualified_table()
    ))
    .await;
    let sweeper = inbox.spawn_sweeper();
    // Its first tick is immediate; poll with a liveness bound, not a speed assertion.
    let swept = tokio::time::timeout(Duration::from_secs(60), async {
        while db.markers(&inbox, "old").await != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    sweeper.abort();
    assert!(swept.is_ok(), "the sweeper never deleted the old marker");
    assert_eq!(db.markers(&inbox, "young").await, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn migrate_is_idempotent_from_several_processes_and_honours_a_renamed_table() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let inbox = PostgresInbox::builder(db.pool.clone(), "reserve-stock")
        .schema(format!("{}_inbox", db.schema))
        .table("consumer_markers")
        .build()
        .unwrap();
    assert_eq!(inbox.constraint(), "consumer_markers_pkey");
    let migrations: Vec<_> = (0..4)
        .map(|_| {
            let inbox = inbox.clone();
            tokio::spawn(async move { inbox.migrate().await })
        })
        .collect();
    for m in migrations {
        m.await.unwrap().expect("a concurrent migrate failed");
    }
    inbox.migrate().await.expect("a repeated migrate failed");
    for expected in [Processed::Done(()), Processed::Duplicate] {
        let got = inbox
            .process("msg-1", |_| Box::pin(async { Ok::<_, sqlx::Error>(()) }))
            .await
            .unwrap();
        assert_eq!(got, expected);
    }

    // A table of that name without the expected constraint is refused, not silently used.
    db.exec(&format!(
        "CREATE TABLE {}.foreign_markers (consumer text, message_id text, \
         processed_at timestamptz DEFAULT now(), PRIMARY KEY (consumer, message_id), \
         CONSTRAINT x UNIQUE (message_id))",
        db.schema
    ))
    .await;
    db.exec(&format!(
        "ALTER TABLE {}.foreign_markers RENAME CONSTRAINT foreign_markers_pkey TO something_else",
        db.schema
    ))
    .await;
    let foreign = PostgresInbox::builder(db.pool.clone(), "c")
        .schema(&db.schema)
        .table("foreign_markers")
        .build()
        .unwrap();
    assert!(foreign.migrate().await.is_err());

    assert!(
        PostgresInbox::builder(db.pool.clone(), "c")
            .table("Bad-Name")
            .build()
            .is_err()
    );
    assert!(
        PostgresInbox::builder(db.pool.clone(), "c")
            .schema("x\"; DROP TABLE y; --")
            .build()
            .is_err()
    );
    db.exec(&format!("DROP SCHEMA {}_inbox CASCADE", db.schema))
        .await;
    db.drop_schema().await;
}
