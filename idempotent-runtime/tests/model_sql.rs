//! Model-based checks of every store (DESIGN.md §3): random operation sequences, concurrent
//! claims among them, run against SQLite (with a manual clock), PostgreSQL and MySQL/MariaDB
//! (with their test clock offsets) and the memory store, each compared step by step with
//! `contract::model`'s reference.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features -p idempotent-runtime --test model_sql
//! ```
//!
//! `IDEMPOTENT_MODEL_CASES` sets the number of random sequences per store (default 256, what CI
//! runs); a failure is shrunk to a minimal sequence, printed, and its seed persisted in
//! `tests/model_sql.proptest-regressions` (commit it: every later run replays it first). PostgreSQL tests read
//! `DATABASE_URL` and skip with a message when it is unset, unless `IDEMPOTENT_REQUIRE_DB=1`;
//! the MySQL one reads `MYSQL_URL` (`IDEMPOTENT_REQUIRE_MYSQL=1`).

mod support;

use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::clock::ManualClock;
use idempotent_runtime::store::contract::model::{Op, check_model};
use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
use idempotent_runtime::store::{FencingToken, Store};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};

fn cases() -> u32 {
    std::env::var("IDEMPOTENT_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<u8>(), any::<u8>(), 1u8..5)
            .prop_map(|(key, fp, lease_s)| Op::Claim { key, fp, lease_s }),
        1 => (any::<u8>(), any::<u8>(), 1u8..5, 2u8..9)
            .prop_map(|(key, fp, lease_s, copies)| Op::ClaimConcurrently { key, fp, lease_s, copies }),
        2 => (any::<u8>(), any::<bool>(), 1u8..5)
            .prop_map(|(key, stale, retention_s)| Op::Complete { key, stale, retention_s }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(key, stale)| Op::Release { key, stale }),
        1 => (any::<u8>(), any::<bool>(), 1u8..5)
            .prop_map(|(key, stale, lease_s)| Op::Renew { key, stale, lease_s }),
        2 => (0u8..4).prop_map(|secs| Op::Advance { secs }),
        1 => Just(Op::Sweep),
    ]
}

/// Runs `cases()` random sequences against one store. Every sequence works in a scope of its
/// own; before each one the clock jumps an hour and the table is swept, so what earlier
/// sequences left behind neither grows the table past a sweep batch nor meets the model.
fn run_model<S: Store>(
    rt: &tokio::runtime::Runtime,
    store: Arc<S>,
    advance: impl Fn(Duration) + Clone,
) {
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/model_sql.proptest-regressions"
        )))),
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(op(), 1..50), |ops| {
        rt.block_on(async {
            advance(Duration::from_secs(3600));
            while store.sweep(500).await.expect("sweep") > 0 {}
            check_model(Arc::clone(&store), advance.clone(), &ops).await;
        });
        Ok(())
    });
    if let Err(e) = result {
        panic!("the store disagrees with the reference model: {e}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn memory_store_agrees_with_the_model_including_concurrent_claims() {
    let rt = runtime();
    let clock = ManualClock::new();
    let store = Arc::new(
        MemoryStore::builder()
            .clock(clock.clone())
            .limits(MemoryLimits {
                // Many claims of one scope in flight at once.
                response_headroom: 4 << 10,
                ..MemoryLimits::default()
            })
            .build(),
    );
    run_model(&rt, store, move |d| clock.advance(d));
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_store_agrees_with_the_model() {
    use idempotent_runtime::store::sqlite::SqliteStore;

    /// A database file of its own, removed (with its WAL files) when the test ends.
    struct TempDb(std::path::PathBuf);
    impl Drop for TempDb {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut p = self.0.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        }
    }

    let db = TempDb(std::env::temp_dir().join(format!(
        "idempotent-model-{:016x}.db",
        FencingToken::mint().0
    )));
    let rt = runtime();
    let clock = ManualClock::new();
    let store = rt.block_on(async {
        let store = SqliteStore::builder()
            .clock(clock.clone())
            .open(&db.0)
            .await
            .expect("open");
        store.migrate().await.expect("migrate");
        store
    });
    run_model(&rt, Arc::new(store), move |d| clock.advance(d));
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_store_agrees_with_the_model() {
    use idempotent_runtime::store::postgres::PostgresStore;

    let Some(url) = support::database_url() else {
        return;
    };
    let schema = format!("idem_model_{:016x}", FencingToken::mint().0);

    /// Drops the test's schema when the test ends, panicking or not.
    struct DropSchema<'a>(&'a tokio::runtime::Runtime, &'a str, &'a str);
    impl Drop for DropSchema<'_> {
        fn drop(&mut self) {
            let (url, sql) = (
                self.1,
                format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.2),
            );
            self.0.block_on(async {
                use sqlx::Connection;
                if let Ok(mut conn) = sqlx::PgConnection::connect(url).await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        }
    }

    let rt = runtime();
    let _drop = DropSchema(&rt, &url, &schema);
    let store = rt.block_on(async {
        let store = PostgresStore::builder()
            .schema(&schema)
            .table("records")
            .connect(&url)
            .await
            .expect("connect to DATABASE_URL");
        store.migrate().await.expect("migrate");
        Arc::new(store)
    });
    let clock = Arc::clone(&store);
    run_model(&rt, store, move |d| clock.advance_clock_for_tests(d));
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_store_agrees_with_the_model() {
    use idempotent_runtime::store::mysql::MySqlStore;
    use sqlx::ConnectOptions as _;

    let Some(url) = support::mysql_url() else {
        return;
    };
    let database = format!("idem_model_{:016x}", FencingToken::mint().0);

    /// Drops the test's database when the test ends, panicking or not.
    struct DropDatabase<'a>(&'a tokio::runtime::Runtime, &'a str, &'a str);
    impl Drop for DropDatabase<'_> {
        fn drop(&mut self) {
            let sql = format!("DROP DATABASE IF EXISTS `{}`", self.2);
            self.0.block_on(async {
                use sqlx::Connection;
                let Ok(options) = self.1.parse::<sqlx::mysql::MySqlConnectOptions>() else {
                    return;
                };
                if let Ok(mut conn) = options.connect().await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        }
    }

    let rt = runtime();
    let _drop = DropDatabase(&rt, &url, &database);
    let store = rt.block_on(async {
        let store = MySqlStore::builder()
            .database(&database)
            .table("records")
            .connect(&url)
            .await
            .expect("connect to MYSQL_URL");
        store.migrate().await.expect("migrate");
        Arc::new(store)
    });
    let clock = Arc::clone(&store);
    run_model(&rt, store, move |d| clock.advance_clock_for_tests(d));
}

/// DESIGN.md §3: a handler runs once while the store is reachable. A database restart, a
/// failover or `pg_terminate_backend` leaves the pool holding dead connections while the
/// database itself answers; a completion, release or renewal sent on one must still land (these
/// writes are token-conditional, so sending one again is safe), or the next retry of the key
/// would run its handler a second time.
#[cfg(feature = "postgres")]
#[test]
fn token_conditional_writes_survive_connections_the_database_dropped() {
    use idempotent_runtime::fingerprint::Fingerprint;
    use idempotent_runtime::store::postgres::PostgresStore;
    use idempotent_runtime::store::{Claim, ClaimRequest, RecordedResponse, StandingState};

    let Some(url) = support::database_url() else {
        return;
    };
    let schema = format!("idem_drop_{:016x}", FencingToken::mint().0);
    let rt = runtime();
    rt.block_on(async {
        use sqlx::Connection;
        let mut admin = sqlx::PgConnection::connect(&url).await.expect("connect");
        let store = PostgresStore::builder()
            .schema(&schema)
            .table("records")
            .application_name(&schema)
            .max_connections(3)
            .connect(&url)
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        let scope = idempotent_runtime::test_helpers::store::fresh_scope();
        let req = |key: &'static str| ClaimRequest {
            scope: &scope,
            key,
            quota_bucket: 0,
            fingerprint: Fingerprint {
                version: 1,
                digest: [7; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(60),
            route: "/test",
            response_room: 0,
        };
        let (done, renewed, released) = (req("done"), req("renewed"), req("released"));
        for r in [&done, &renewed, &released] {
            assert_eq!(store.claim(r).await.expect("claim"), Claim::Acquired);
        }
        let terminate = format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = '{schema}'"
        );
        let response = RecordedResponse::new(201, vec![], "{}".into());

        let killed: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(terminate.clone()))
            .fetch_one(&mut admin)
            .await
            .expect("terminate");
        assert!(killed > 0, "the store held no connection to terminate");
        let completed = store
            .complete(
                &scope,
                "done",
                done.token,
                &response,
                Duration::from_secs(60),
            )
            .await;
        assert!(
            matches!(completed, Ok(true)),
            "completion on a dropped connection: {completed:?}"
        );

        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(terminate.clone()))
            .fetch_one(&mut admin)
            .await
            .expect("terminate");
        let renew = store
            .renew(&scope, "renewed", renewed.token, Duration::from_secs(30))
            .await;
        assert!(
            matches!(renew, Ok(true)),
            "renewal on a dropped connection: {renew:?}"
        );

        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(terminate))
            .fetch_one(&mut admin)
            .await
            .expect("terminate");
        let release = store.release(&scope, "released", released.token).await;
        assert!(
            matches!(release, Ok(true)),
            "release on a dropped connection: {release:?}"
        );

        match store.claim(&req("done")).await.expect("claim") {
            Claim::Standing(st) => assert!(
                matches!(st.state, StandingState::Completed(_)),
                "{:?}",
                st.state
            ),
            Claim::Acquired => panic!("the completed key ran again"),
        }
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
        )))
        .execute(&mut admin)
        .await;
    });
}
