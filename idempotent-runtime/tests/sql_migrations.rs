//! The versioned migrations shared by the SQL stores and the inbox (DESIGN.md §5 "Migrations",
//! §6): checksums recorded and checked, tables of earlier releases adopted, and the same DDL
//! applied by sqlx's own `Migrator` instead of `migrate()`.
//!
//! The PostgreSQL tests read `DATABASE_URL` and skip without it (fail under
//! `IDEMPOTENT_REQUIRE_DB=1`); each works in a schema of its own.

use std::path::PathBuf;
use std::sync::Arc;

use idempotent_runtime::clock::ManualClock;
use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::inbox::{PostgresInbox, Processed};
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::store::sqlite::SqliteStore;
use idempotent_runtime::store::{
    Claim, ClaimRequest, ConnectError, FencingToken, InvalidName, RecordedResponse, StandingState,
    Store, contract,
};
use sha2::{Digest, Sha256};
use sqlx::migrate::MigrateError;
use sqlx::postgres::{PgPool, PgPoolOptions};

mod support;
use support::database_url;

/// A schema of its own, dropped at the end of the test.
struct Db {
    url: String,
    schema: String,
    pool: PgPool,
}

impl Db {
    async fn new() -> Option<Self> {
        let url = database_url()?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect to DATABASE_URL");
        let schema = format!("idem_mig_{:016x}", FencingToken::mint().0);
        Some(Self { url, schema, pool })
    }

    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// `(version, checksum)` rows of a version table, in order.
    async fn versions(&self, table: &str) -> Vec<(i64, Option<Vec<u8>>)> {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT version, checksum FROM \"{}\".\"{table}\" ORDER BY version",
            self.schema
        )))
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    async fn tables(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 \
             ORDER BY 1",
        )
        .bind(&self.schema)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    async fn drop_schema(&self) {
        self.exec(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        ))
        .await;
    }
}

fn expected_checksums(m: &idempotent_runtime::store::Migrations) -> Vec<(i64, Option<Vec<u8>>)> {
    m.iter()
        .map(|m| (m.version, Some(Sha256::digest(&m.sql).to_vec())))
        .collect()
}

fn is_version_mismatch(e: &sqlx::Error, version: i64) -> bool {
    matches!(e, sqlx::Error::Migrate(m) if matches!(**m, MigrateError::VersionMismatch(v) if v == version))
}

/// Today's release's inline DDL of the inbox, verbatim: what existing deployments have.
fn inbox_inline_ddl(schema: &str) -> String {
    format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; \
         CREATE TABLE IF NOT EXISTS \"{schema}\".\"processed_messages\" (\
           consumer text NOT NULL, \
           message_id text NOT NULL, \
           processed_at timestamptz NOT NULL DEFAULT now(), \
           CONSTRAINT \"processed_messages_pkey\" PRIMARY KEY (consumer, message_id)); \
         CREATE INDEX IF NOT EXISTS \"processed_messages_sweep_idx\" ON \
           \"{schema}\".\"processed_messages\" (consumer, processed_at)"
    )
}

async fn mark(inbox: &PostgresInbox, message: &str) -> Processed<()> {
    inbox
        .process(message, |_conn| {
            Box::pin(async { Ok::<_, sqlx::Error>(()) })
        })
        .await
        .expect("process")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_migrate_a_fresh_schema_at_once_and_record_each_version_with_its_checksum() {
    let Some(db) = Db::new().await else {
        return;
    };
    let store = |()| {
        PostgresStore::builder()
            .schema(&db.schema)
            .table("records")
            .build(db.pool.clone())
            .unwrap()
    };
    let (a, b) = (store(()), store(()));
    let (ra, rb) = tokio::join!(
        tokio::spawn(async move { a.migrate().await }),
        tokio::spawn(async move { b.migrate().await })
    );
    ra.unwrap().expect("one replica");
    rb.unwrap().expect("the other at once");
    let expected =
        expected_checksums(&PostgresStore::migrations(Some(&db.schema), "records").unwrap());
    assert_eq!(expected.len(), 4);
    assert_eq!(db.versions("records_migrations").await, expected);

    let inbox = || {
        PostgresInbox::builder(db.pool.clone(), "c")
            .schema(&db.schema)
            .build()
            .unwrap()
    };
    let (a, b) = (inbox(), inbox());
    let (ra, rb) = tokio::join!(
        tokio::spawn(async move { a.migrate().await }),
        tokio::spawn(async move { b.migrate().await })
    );
    ra.unwrap().expect("one inbox process");
    rb.unwrap().expect("the other at once");
    inbox().migrate().await.expect("again");
    assert_eq!(
        db.versions("processed_messages_migrations").await,
        expected_checksums(
            &PostgresInbox::migrations(Some(&db.schema), "processed_messages").unwrap()
        )
    );
    assert_eq!(
        db.tables().await,
        [
            "processed_messages",
            "processed_messages_migrations",
            "records",
            "records_migrations"
        ]
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_migration_applied_with_other_sql_is_refused_naming_its_version() {
    let Some(db) = Db::new().await else {
        return;
    };
    let store = PostgresStore::builder()
        .schema(&db.schema)
        .table("records")
        .build(db.pool.clone())
        .unwrap();
    store.migrate().await.unwrap();
    db.exec(&format!(
        "UPDATE \"{}\".records_migrations SET checksum = '\\x00' WHERE version = 2",
        db.schema
    ))
    .await;
    let before = db.versions("records_migrations").await;
    let e = store.migrate().await.expect_err("a changed migration");
    assert!(is_version_mismatch(&e, 2), "{e:?}");
    assert_eq!(
        e.to_string(),
        "migration 2 was previously applied but has been modified"
    );
    assert_eq!(
        db.versions("records_migrations").await,
        before,
        "nothing changed"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn versions_recorded_before_checksums_are_adopted_with_this_releases_checksums() {
    let Some(db) = Db::new().await else {
        return;
    };
    // The version table as earlier releases left it: no checksum column, versions 1-3 applied.
    let store = PostgresStore::builder()
        .schema(&db.schema)
        .table("records")
        .build(db.pool.clone())
        .unwrap();
    let migrations = PostgresStore::migrations(Some(&db.schema), "records").unwrap();
    db.exec(&format!("CREATE SCHEMA \"{}\"", db.schema)).await;
    for m in &migrations {
        db.exec(&m.sql).await;
    }
    db.exec(&format!(
        "CREATE TABLE \"{s}\".records_migrations (version bigint PRIMARY KEY, \
             description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now()); \
         INSERT INTO \"{s}\".records_migrations (version, description) VALUES (1, 'a'), (2, 'b'), (3, 'c')",
        s = db.schema
    ))
    .await;
    store
        .migrate()
        .await
        .expect("migrate over the earlier version table");
    assert_eq!(
        db.versions("records_migrations").await,
        expected_checksums(&migrations)
    );
    // And an older release's replica still migrates against the new table (its statements).
    db.exec(&format!(
        "SELECT version FROM \"{}\".records_migrations",
        db.schema
    ))
    .await;
    db.drop_schema().await;
}

#[tokio::test]
async fn an_inbox_table_created_by_the_inline_ddl_is_adopted_and_keeps_its_markers() {
    let Some(db) = Db::new().await else {
        return;
    };
    db.exec(&inbox_inline_ddl(&db.schema)).await;
    db.exec(&format!(
        "INSERT INTO \"{}\".processed_messages (consumer, message_id) VALUES ('c', 'm-old')",
        db.schema
    ))
    .await;
    let inbox = PostgresInbox::builder(db.pool.clone(), "c")
        .schema(&db.schema)
        .build()
        .unwrap();
    inbox
        .migrate()
        .await
        .expect("migrate over the inline DDL's table");
    inbox.migrate().await.expect("and again");
    assert_eq!(
        db.versions("processed_messages_migrations").await,
        expected_checksums(
            &PostgresInbox::migrations(Some(&db.schema), "processed_messages").unwrap()
        ),
        "version 1 recorded, the table adopted"
    );
    assert_eq!(
        mark(&inbox, "m-old").await,
        Processed::Duplicate,
        "an old marker holds"
    );
    assert_eq!(mark(&inbox, "m-new").await, Processed::Done(()));
    assert_eq!(mark(&inbox, "m-new").await, Processed::Duplicate);
    let copies: Vec<_> = (0..8)
        .map(|_| {
            let inbox = inbox.clone();
            tokio::spawn(async move { mark(&inbox, "m-many").await })
        })
        .collect();
    let mut done = 0;
    for c in copies {
        match c.await.unwrap() {
            Processed::Done(()) => done += 1,
            Processed::Duplicate | Processed::Busy => {}
        }
    }
    assert_eq!(done, 1, "eight concurrent copies, one processed");
    let markers: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{}\".processed_messages",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(markers, 3);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_postgres_ddl_applied_by_sqlxs_migrator_passes_the_store_contract() {
    let Some(db) = Db::new().await else {
        return;
    };
    let migrator = PostgresStore::migrations(Some(&db.schema), "records")
        .unwrap()
        .migrator();
    migrator.run(&db.pool).await.expect("sqlx migrator");
    migrator.run(&db.pool).await.expect("sqlx migrator, again");
    assert_eq!(db.tables().await, ["records", "records_sqlx_migrations"]);
    // No `migrate()`: the store runs on the table the user's tool made.
    let store = Arc::new(
        PostgresStore::builder()
            .schema(&db.schema)
            .table("records")
            .connect(&db.url)
            .await
            .unwrap(),
    );
    let clock = Arc::clone(&store);
    contract::run(Arc::clone(&store), move |d| {
        clock.advance_clock_for_tests(d)
    })
    .await;
    store.pool().close().await;

    let migrator = PostgresInbox::migrations(Some(&db.schema), "markers")
        .unwrap()
        .migrator();
    migrator
        .run(&db.pool)
        .await
        .expect("the inbox's DDL by sqlx");
    let inbox = PostgresInbox::builder(db.pool.clone(), "c")
        .schema(&db.schema)
        .table("markers")
        .build()
        .unwrap();
    assert_eq!(mark(&inbox, "m").await, Processed::Done(()));
    assert_eq!(mark(&inbox, "m").await, Processed::Duplicate);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_bad_table_name_is_a_typed_error() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://nowhere/x")
        .unwrap();
    let e: InvalidName = PostgresStore::builder()
        .table("a b")
        .build(pool.clone())
        .unwrap_err();
    assert_eq!(e.name(), "a b");
    assert_eq!(
        e.to_string(),
        "invalid idempotency store table name \"a b\": it must be 1-48 ASCII letters, digits or '_', \
         not starting with a digit"
    );
    let e = PostgresStore::builder()
        .schema("x\"y")
        .connect("postgres://nowhere/x")
        .await
        .unwrap_err();
    let ConnectError::InvalidName(name) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(name.name(), "x\"y");
    // Code written against sqlx's error still gets the name with `?`.
    let sqlx::Error::Configuration(source) = sqlx::Error::from(e) else {
        panic!("a name converts into sqlx::Error::Configuration")
    };
    assert_eq!(source.downcast_ref::<InvalidName>().unwrap().name(), "x\"y");
    let db = TempDb::new();
    let e = SqliteStore::builder()
        .table("1x")
        .open(&db.0)
        .await
        .unwrap_err();
    let ConnectError::InvalidName(name) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(name.name(), "1x");
    let e = PostgresInbox::builder(pool, "c")
        .table("Upper")
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid inbox table name \"Upper\": it must be 1-50 lowercase ASCII letters, digits or '_', \
         not starting with a digit"
    );
    assert!(PostgresStore::migrations(Some("a-b"), "t").is_err());
    assert!(SqliteStore::migrations("t;").is_err());
}

struct TempDb(PathBuf);

impl TempDb {
    fn new() -> Self {
        Self(
            std::env::temp_dir().join(format!("idempotent-mig-{:016x}.db", FencingToken::mint().0)),
        )
    }

    async fn pool(&self) -> sqlx::SqlitePool {
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(&self.0)
                    .create_if_missing(true),
            )
            .await
            .unwrap()
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.0.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sqlite_ddl_applied_by_sqlxs_migrator_passes_the_store_contract() {
    let db = TempDb::new();
    let pool = db.pool().await;
    let migrator = SqliteStore::migrations("records").unwrap().migrator();
    migrator.run(&pool).await.expect("sqlx migrator");
    migrator.run(&pool).await.expect("sqlx migrator, again");
    pool.close().await;
    let clock = ManualClock::new();
    let store = SqliteStore::builder()
        .table("records")
        .clock(clock.clone())
        .open(&db.0)
        .await
        .unwrap();
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(store.writer())
            .await
            .unwrap();
    assert_eq!(tables, ["records", "records_sqlx_migrations"]);
    contract::run(Arc::new(store), move |d| clock.advance(d)).await;
}

#[tokio::test]
async fn sqlite_checksums_are_recorded_adopted_and_checked() {
    let db = TempDb::new();
    let store = SqliteStore::builder()
        .table("records")
        .open(&db.0)
        .await
        .unwrap();
    // The version table as earlier releases left it: no checksum column, versions 1-2 applied.
    for m in SqliteStore::migrations("records").unwrap().iter().take(2) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(m.sql.clone()))
            .execute(store.writer())
            .await
            .unwrap();
    }
    sqlx::raw_sql(
        "CREATE TABLE records_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
             applied_at INTEGER NOT NULL); \
         INSERT INTO records_migrations VALUES (1, 'a', 0), (2, 'b', 0)",
    )
    .execute(store.writer())
    .await
    .unwrap();
    store
        .migrate()
        .await
        .expect("adopts the earlier version table");
    let versions = || async {
        sqlx::query_as::<_, (i64, Option<Vec<u8>>)>(
            "SELECT version, checksum FROM records_migrations ORDER BY version",
        )
        .fetch_all(store.writer())
        .await
        .unwrap()
    };
    assert_eq!(
        versions().await,
        expected_checksums(&SqliteStore::migrations("records").unwrap())
    );
    sqlx::raw_sql("UPDATE records_migrations SET checksum = x'00' WHERE version = 1")
        .execute(store.writer())
        .await
        .unwrap();
    let e = store.migrate().await.expect_err("a changed migration");
    assert!(is_version_mismatch(&e, 1), "{e:?}");
}

/// The answer rows of releases before trailers hold, and the claim that finds one.
fn old_answer() -> RecordedResponse {
    RecordedResponse::new(
        201,
        vec![("location".into(), "/orders/1".into())],
        "{}".into(),
    )
}

async fn replayed_from_an_old_row<S: Store>(store: &S) -> RecordedResponse {
    let req = ClaimRequest {
        scope: &[1; 32],
        key: "old",
        quota_bucket: 1,
        fingerprint: Fingerprint {
            version: 1,
            digest: [2; 32],
        },
        token: FencingToken::mint(),
        lease: std::time::Duration::from_secs(30),
        retention: std::time::Duration::from_secs(30),
        route: "/orders",
        response_room: 0,
    };
    match store.claim(&req).await.expect("claim") {
        Claim::Standing(st) => match st.state {
            StandingState::Completed(r) => (*r).clone(),
            other => panic!("the old row stands as {other:?}"),
        },
        Claim::Acquired => panic!("the old row was not found"),
    }
}

/// A row completed before the trailers migration (version 3) reads back, once migrated, as the
/// answer it was, with no trailers.
#[tokio::test]
async fn a_sqlite_row_written_before_trailers_reads_back_with_none() {
    let db = TempDb::new();
    let store = SqliteStore::builder()
        .table("records")
        .open(&db.0)
        .await
        .unwrap();
    let migrations = SqliteStore::migrations("records").unwrap();
    assert_eq!(migrations.iter().nth(2).map(|m| m.version), Some(3));
    for m in migrations.iter().take(2) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(m.sql.clone()))
            .execute(store.writer())
            .await
            .unwrap();
    }
    sqlx::raw_sql(
        "CREATE TABLE records_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
             applied_at INTEGER NOT NULL); \
         INSERT INTO records_migrations VALUES (1, 'a', 0), (2, 'b', 0)",
    )
    .execute(store.writer())
    .await
    .unwrap();
    let old = old_answer();
    sqlx::query(
        "INSERT INTO records (scope, key, token, fingerprint, fp_version, state, lease_until, \
                              expires_at, status, headers, body, route, created_at) \
         VALUES (?1, 'old', 7, ?2, 1, 1, 0, 4102444800000, 201, ?3, ?4, '/orders', 0)",
    )
    .bind(&[1u8; 32][..])
    .bind(&[2u8; 32][..])
    .bind(old.encode_headers())
    .bind(&old.body[..])
    .execute(store.writer())
    .await
    .unwrap();
    store.migrate().await.expect("migrates to trailers");
    let replayed = replayed_from_an_old_row(&store).await;
    assert_eq!(replayed, old);
    assert!(replayed.trailers.is_empty());
}

/// [`a_sqlite_row_written_before_trailers_reads_back_with_none`] on PostgreSQL (migration 4).
#[tokio::test]
async fn a_postgres_row_written_before_trailers_reads_back_with_none() {
    let Some(db) = Db::new().await else {
        return;
    };
    let store = PostgresStore::builder()
        .schema(&db.schema)
        .table("records")
        .build(db.pool.clone())
        .unwrap();
    let migrations = PostgresStore::migrations(Some(&db.schema), "records").unwrap();
    assert_eq!(migrations.iter().nth(3).map(|m| m.version), Some(4));
    db.exec(&format!("CREATE SCHEMA \"{}\"", db.schema)).await;
    for m in migrations.iter().take(3) {
        db.exec(&m.sql).await;
    }
    db.exec(&format!(
        "CREATE TABLE \"{s}\".records_migrations (version bigint PRIMARY KEY, \
             description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now()); \
         INSERT INTO \"{s}\".records_migrations (version, description) VALUES (1, 'a'), (2, 'b'), (3, 'c')",
        s = db.schema
    ))
    .await;
    let old = old_answer();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".records (scope, key, token, fingerprint, fp_version, state, \
                                     lease_until, expires_at, status, headers, body, route, \
                                     created_at, sweep_after) \
         VALUES ($1, 'old', 7, $2, 1, 1, now(), now() + interval '1 hour', 201, $3, $4, \
                 '/orders', now(), now() + interval '1 hour')",
        db.schema
    )))
    .bind(&[1u8; 32][..])
    .bind(&[2u8; 32][..])
    .bind(old.encode_headers())
    .bind(&old.body[..])
    .execute(&db.pool)
    .await
    .unwrap();
    store.migrate().await.expect("migrates to trailers");
    let replayed = replayed_from_an_old_row(&store).await;
    assert_eq!(replayed, old);
    assert!(replayed.trailers.is_empty());
    db.drop_schema().await;
}
