//! The MySQL / MariaDB store against a real server (DESIGN.md §3, §5).
//!
//! Reads `MYSQL_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_MYSQL=1`, when it fails. Every test works in a database of its own,
//! dropped when it ends, so tests run in parallel and across runs.
//!
//! ```text
//! MYSQL_URL=mysql://root@127.0.0.1:3306/test \
//!     cargo test --all-features -p idempotent-runtime --test store_mysql
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::mysql::{MySqlStore, MySqlStoreBuilder};
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, StandingState, Store, StoreError, contract,
};
use idempotent_runtime::test_helpers::record::{self, Verdict};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

mod support;

/// A database of its own, dropped when the test ends (also on panic, best effort).
struct TestDb {
    base: MySqlConnectOptions,
    name: String,
    admin: MySqlPool,
}

impl TestDb {
    async fn new() -> Option<Self> {
        let url = support::mysql_url()?;
        let base: MySqlConnectOptions = url.parse().expect("MYSQL_URL");
        let name = format!("idem_test_{:016x}", FencingToken::mint().0);
        let admin = MySqlPoolOptions::new()
            .max_connections(3)
            .connect_with(base.clone())
            .await
            .expect("connect to MYSQL_URL");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
            .execute(&admin)
            .await
            .expect("create database");
        Some(Self { base, name, admin })
    }

    /// Options connecting to the test's database (its connections are told apart by it in
    /// the process list).
    fn options(&self) -> MySqlConnectOptions {
        self.base.clone().database(&self.name)
    }

    fn builder(&self) -> MySqlStoreBuilder {
        MySqlStore::builder().table("records")
    }

    async fn store_with(&self, builder: MySqlStoreBuilder) -> MySqlStore {
        let store = builder.connect_with(self.options()).await.expect("connect");
        store.migrate().await.expect("migrate");
        store
    }

    async fn store(&self) -> MySqlStore {
        self.store_with(self.builder()).await
    }

    async fn scalar_i64(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.admin)
            .await
            .expect(sql)
    }

    /// The server's store connections: those whose default database is the test's.
    async fn kill_store_connections(&self) -> usize {
        let ids: Vec<u64> = sqlx::query_scalar(
            "SELECT CAST(ID AS UNSIGNED) FROM information_schema.PROCESSLIST WHERE DB = ?",
        )
        .bind(&self.name)
        .fetch_all(&self.admin)
        .await
        .unwrap();
        for id in &ids {
            // Gone already is fine.
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
                .execute(&self.admin)
                .await;
        }
        ids.len()
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let base = self.base.clone();
        let sql = format!("DROP DATABASE IF EXISTS `{}`", self.name);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                use sqlx::{ConnectOptions, Connection};
                if let Ok(mut conn) = base.connect().await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint {
        version: 1,
        digest: [n; 32],
    }
}

fn req<'a>(scope: &'a ScopeHash, key: &'a str, lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        quota_bucket: 0,
        fingerprint: fp(1),
        token: FencingToken::mint(),
        lease,
        retention: Duration::from_secs(3600),
        route: "/test",
        response_room: 0,
    }
}

fn response(body: &str) -> RecordedResponse {
    RecordedResponse::new(
        201,
        vec![("content-type".into(), "application/json".into())],
        body.to_owned().into(),
    )
}

const SAME: fn(&Fingerprint) -> bool = |f| *f == fp(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_store_contract() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(db.store().await);
    let clock = Arc::clone(&store);
    contract::run(store, move |d| clock.advance_clock_for_tests(d)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cache_in_front_of_it_passes_the_store_contract() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let clock = idempotent_runtime::clock::ManualClock::new();
    let store = Arc::new(
        idempotent_runtime::store::cache::CachedStore::new(db.store().await).clock(clock.clone()),
    );
    let inner = Arc::clone(&store);
    contract::run(Arc::clone(&store), move |d| {
        inner.inner().advance_clock_for_tests(d);
        clock.advance(d);
    })
    .await;
    assert!(store.hits() > 0, "no replay of the contract met the cache");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_safe_from_several_replicas_at_once() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let mut stores = Vec::new();
    for _ in 0..6 {
        let store = db
            .builder()
            .max_connections(1)
            .connect_with(db.options())
            .await
            .unwrap();
        stores.push(Arc::new(store));
    }
    let tasks: Vec<_> = stores
        .iter()
        .map(|s| {
            let s = Arc::clone(s);
            tokio::spawn(async move { s.migrate().await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().expect("concurrent migrate");
    }
    // Had a migrator kept its lock, another store's migration would wait for it (60 s).
    tokio::time::timeout(Duration::from_secs(20), stores[5].migrate())
        .await
        .expect("a migration waited on a lock left behind")
        .expect("migrate again");
    let name = &db.name;
    assert_eq!(
        db.scalar_i64(&format!("SELECT COUNT(*) FROM `{name}`.records_migrations"))
            .await,
        1,
        "each version is applied and recorded once"
    );
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = ? \
         ORDER BY 1",
    )
    .bind(name)
    .fetch_all(&db.admin)
    .await
    .unwrap();
    assert_eq!(
        tables,
        ["records", "records_migrations"],
        "never sqlx's _sqlx_migrations"
    );
    // The migration's own lock waits were for it alone: the pooled connection is back at the
    // store's.
    let waits: (i64, i64) = sqlx::query_as(
        "SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED), \
                CAST(@@SESSION.lock_wait_timeout AS SIGNED)",
    )
    .fetch_one(stores[0].pool())
    .await
    .unwrap();
    assert_eq!(
        waits,
        (1, 1),
        "the store's connection kept the migration's lock waits"
    );
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    assert_eq!(
        stores[3]
            .claim(&req(&scope, "k", Duration::from_secs(5)))
            .await
            .unwrap(),
        Claim::Acquired
    );
}

/// A shipped migration recorded with other SQL is refused before anything runs, and a migrator
/// queues behind another session holding the table's migration lock instead of running beside
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_refuse_changed_sql_and_queue_behind_the_lock() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let name = &db.name;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE `{name}`.records_migrations SET checksum = 'not this' WHERE version = 1"
    )))
    .execute(&db.admin)
    .await
    .unwrap();
    match store.migrate().await {
        Err(sqlx::Error::Migrate(e))
            if matches!(*e, sqlx::migrate::MigrateError::VersionMismatch(1)) => {}
        other => panic!("a changed migration was not refused: {other:?}"),
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE `{name}`.records_migrations SET checksum = NULL WHERE version = 1"
    )))
    .execute(&db.admin)
    .await
    .unwrap();
    store
        .migrate()
        .await
        .expect("a step recorded without a checksum is adopted");
    let adopted = db
        .scalar_i64(&format!(
            "SELECT COUNT(*) FROM `{name}`.records_migrations WHERE checksum IS NOT NULL"
        ))
        .await;
    assert_eq!(adopted, 1, "its checksum is filled in");

    // Another session holds every lock this database's migrators could be using.
    let mut holder = db.admin.acquire().await.unwrap();
    let locks: Vec<String> = sqlx::query_scalar(
        "SELECT CONCAT('idempotent-migrate-', LEFT(SHA2(CONCAT('idempotent-migrate:',              '`records_migrations`'), 256), 24))",
    )
    .fetch_all(&mut *holder)
    .await
    .unwrap();
    let got: i64 = sqlx::query_scalar("SELECT CAST(GET_LOCK(?, 5) AS SIGNED)")
        .bind(&locks[0])
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    assert_eq!(got, 1);
    let store = Arc::new(store);
    let waiting = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.migrate().await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "a migration ran beside another session's lock"
    );
    sqlx::query("DO RELEASE_LOCK(?)")
        .bind(&locks[0])
        .execute(&mut *holder)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the migration never took the lock once it was free")
        .unwrap()
        .expect("migrate");
}

/// A table in another database than the connection's: `database(…)` qualifies every
/// statement, and `migrate()` creates the database.
#[tokio::test]
async fn a_table_in_another_database_is_created_and_used() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let other = format!("{}_x", db.name);
    let store = MySqlStore::builder()
        .database(&other)
        .table("r")
        .connect_with(db.options())
        .await
        .unwrap();
    store.migrate().await.expect("migrate creates the database");
    assert_eq!(store.table(), format!("`{other}`.`r`"));
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let first = req(&scope, "k", Duration::from_secs(5));
    assert_eq!(store.claim(&first).await.unwrap(), Claim::Acquired);
    let rows = db
        .scalar_i64(&format!("SELECT COUNT(*) FROM `{other}`.r"))
        .await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE `{other}`")))
        .execute(&db.admin)
        .await;
    assert_eq!(rows, 1);
}

#[tokio::test]
async fn invalid_table_names_are_refused() {
    for (database, table) in [
        (None, "bad name"),
        (Some("x;drop"), "records"),
        (None, "1x"),
    ] {
        let mut b = MySqlStore::builder().table(table);
        if let Some(d) = database {
            b = b.database(d);
        }
        let err = b
            .connect("mysql://nobody@127.0.0.1:1/none")
            .await
            .expect_err("invalid identifier accepted");
        assert!(err.to_string().contains("must be"), "{err}");
    }
}

/// The InnoDB log sequence number: what a statement wrote to the redo log moves it.
async fn lsn(db: &TestDb) -> i64 {
    let (_, value): (String, String) =
        sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_lsn_current'")
            .fetch_one(&db.admin)
            .await
            .unwrap();
    value.parse().unwrap()
}

#[tokio::test]
async fn first_request_costs_two_round_trips_and_a_replay_two_that_write_nothing() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();

    let before = store.statements_executed();
    let first = req(&scope, "order-1", Duration::from_secs(30));
    assert_eq!(
        record::claim(&store, &first, SAME).await.unwrap(),
        Verdict::Acquired { reclaimed: false }
    );
    assert!(
        store
            .complete(
                &scope,
                "order-1",
                first.token,
                &response(r#"{"id":1}"#),
                Duration::from_secs(60)
            )
            .await
            .unwrap()
    );
    assert_eq!(
        store.statements_executed() - before,
        2,
        "first request = claim + complete"
    );

    let (lsn_before, before) = (lsn(&db).await, store.statements_executed());
    for _ in 0..100 {
        let replay = record::claim(
            &store,
            &req(&scope, "order-1", Duration::from_secs(30)),
            SAME,
        )
        .await
        .unwrap();
        assert_eq!(replay, Verdict::Replay(Arc::new(response(r#"{"id":1}"#))));
    }
    let (lsn_after, statements) = (lsn(&db).await, store.statements_executed() - before);
    assert_eq!(
        statements, 200,
        "a replay is the failed insert and its read-back"
    );
    // Other tests of this binary write at the same time, so the log may move; printed, and
    // measured alone by `replays_write_no_redo` below.
    eprintln!(
        "100 replays: the InnoDB LSN moved {} bytes",
        lsn_after - lsn_before
    );

    let running = req(&scope, "order-2", Duration::from_secs(30));
    assert_eq!(store.claim(&running).await.unwrap(), Claim::Acquired);
    let before = store.statements_executed();
    assert!(matches!(
        record::claim(
            &store,
            &req(&scope, "order-2", Duration::from_secs(30)),
            SAME
        )
        .await
        .unwrap(),
        Verdict::InProgress { .. }
    ));
    assert_eq!(store.statements_executed() - before, 2);
}

/// The binary log's position (file, offset), `None` when the server keeps none.
async fn binlog(db: &TestDb) -> Option<(String, u64)> {
    use sqlx::Row;
    let row = sqlx::query("SHOW MASTER STATUS")
        .fetch_optional(&db.admin)
        .await
        .unwrap()?;
    Some((row.get::<String, _>(0), row.get::<u64, _>(1)))
}

/// What a replay writes to the redo log and the binary log, measured alone (both are
/// server-wide; a server started with `--log-bin --binlog-format=STATEMENT` is the worst case
/// for the binary log):
///
/// ```text
/// MYSQL_URL=mysql://root@127.0.0.1:3306/test cargo test --all-features -p idempotent-runtime \
///     --test store_mysql -- --ignored --nocapture replays_write_no_redo
/// ```
#[tokio::test]
#[ignore = "the LSN is server-wide: run alone on a quiet server"]
async fn replays_write_no_redo() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let first = req(&scope, "k", Duration::from_secs(30));
    assert_eq!(store.claim(&first).await.unwrap(), Claim::Acquired);
    let (l0, b0) = (lsn(&db).await, binlog(&db).await);
    assert!(
        store
            .complete(
                &scope,
                "k",
                first.token,
                &response("{}"),
                Duration::from_secs(600)
            )
            .await
            .unwrap()
    );
    // Background work (the purge of the completion's undo) settles first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (l1, b1) = (lsn(&db).await, binlog(&db).await);
    let started = Instant::now();
    for _ in 0..1_000 {
        assert!(matches!(
            record::claim(&store, &req(&scope, "k", Duration::from_secs(30)), SAME)
                .await
                .unwrap(),
            Verdict::Replay(_)
        ));
    }
    let elapsed = started.elapsed();
    let (l2, b2) = (lsn(&db).await, binlog(&db).await);
    match (&b0, &b1, &b2) {
        (Some(b0), Some(b1), Some(b2)) => {
            eprintln!(
                "binary log ({}): the completion wrote {} bytes, 1,000 replays {}",
                sqlx::query_scalar::<_, String>("SELECT @@binlog_format")
                    .fetch_one(&db.admin)
                    .await
                    .unwrap(),
                b1.1.saturating_sub(b0.1),
                b2.1 - b1.1
            );
            assert_eq!(b2, b1, "a replay wrote to the binary log");
        }
        _ => eprintln!("the server keeps no binary log"),
    }
    eprintln!(
        "one completion wrote {} bytes of redo; 1,000 replays wrote {} ({:?} a replay)",
        l1 - l0,
        l2 - l1,
        elapsed / 1_000
    );
    // Any row, undo or lock-table write a statement made would be tens of bytes; what the
    // server's background threads write meanwhile is far less than a byte a replay.
    assert!(
        l2 - l1 < 1_000,
        "1,000 replays wrote {} bytes of redo",
        l2 - l1
    );
}

#[tokio::test]
async fn recorded_responses_round_trip_byte_for_byte() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let r = req(&scope, "k", Duration::from_secs(30));
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
    let recorded = RecordedResponse::new(
        409,
        vec![
            ("content-type".into(), "application/octet-stream".into()),
            ("etag".into(), "".into()),
            ("location".into(), "/x?\u{e9}".into()),
        ],
        (0..=255u8).collect::<Vec<_>>().into(),
    )
    .with_trailers(vec![("grpc-status".into(), "0".into())]);
    assert!(
        store
            .complete(&scope, "k", r.token, &recorded, Duration::from_secs(60))
            .await
            .unwrap()
    );
    match store
        .claim(&req(&scope, "k", Duration::from_secs(30)))
        .await
        .unwrap()
    {
        Claim::Standing(st) => {
            assert_eq!(st.token, r.token);
            assert_eq!(st.state, StandingState::Completed(Arc::new(recorded)));
        }
        Claim::Acquired => panic!("completed key acquired"),
    }
    // Keys are bytes, compared exactly: case and trailing characters matter.
    for other in ["K", "k!", "k "] {
        assert_eq!(
            store
                .claim(&req(&scope, other, Duration::from_secs(30)))
                .await
                .unwrap(),
            Claim::Acquired,
            "{other:?} is another key"
        );
    }
}

/// Another session's uncommitted reservation of the key (an open transaction), held until the
/// returned transaction ends.
async fn hold_uncommitted(
    db: &TestDb,
    scope: &ScopeHash,
    key: &str,
) -> sqlx::Transaction<'static, sqlx::MySql> {
    let mut tx = db.admin.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{}`.records (scope, `key`, token, fingerprint, fp_version, state, \
         lease_until, expires_at, sweep_after) VALUES (?, ?, 7, ?, 1, 0, 1e13, 1e13, 1e13)",
        db.name
    )))
    .bind(&scope[..])
    .bind(key)
    .bind(&fp(9).digest[..])
    .execute(&mut *tx)
    .await
    .unwrap();
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_meeting_an_uncommitted_row_answers_in_progress_instead_of_waiting() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let tx = hold_uncommitted(&db, &scope, "k").await;

    let started = Instant::now();
    let claimed = record::claim(&store, &req(&scope, "k", Duration::from_secs(30)), SAME)
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(
        claimed,
        Verdict::InProgress {
            lease_left: Duration::from_secs(30)
        },
        "reported as running, with the request's lease"
    );
    eprintln!("the claim answered in progress after {waited:?}");
    assert!(
        waited < Duration::from_secs(5),
        "the claim waited {waited:?}, past its 1 s lock wait timeout"
    );

    tx.rollback().await.unwrap();
    assert_eq!(
        store
            .claim(&req(&scope, "k", Duration::from_secs(30)))
            .await
            .unwrap(),
        Claim::Acquired,
        "once the other transaction is gone, the key is free"
    );
}

/// A claim whose request stops waiting while its insert waits on another transaction's row
/// (client gone): when that transaction rolls back, the insert commits with nobody to hear it,
/// and is released, so the key is free again instead of standing at 409 for the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_dropped_while_their_statement_waits_leave_their_keys_free() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(
        db.store_with(db.builder().lock_wait_timeout(Duration::from_secs(10)))
            .await,
    );
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let tx = hold_uncommitted(&db, &scope, "k").await;
    let gone = tokio::time::timeout(
        Duration::from_millis(300),
        store.claim(&req(&scope, "k", Duration::from_secs(600))),
    )
    .await;
    assert!(
        gone.is_err(),
        "the claim answered through the other transaction's row"
    );
    tx.rollback().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store
            .claim(&req(&scope, "k", Duration::from_secs(600)))
            .await
            .unwrap()
        {
            Claim::Acquired => break,
            Claim::Standing(st) => {
                assert!(
                    Instant::now() < deadline,
                    "the dropped claim's reservation still stands: {st:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Two replicas (two pools) and 16 copies of each of 1,000 keys, all at once: every key is
/// acquired exactly once, and every other copy sees the winner's reservation or the key in
/// progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pools_1000_keys_16_duplicates_acquire_each_key_once() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let a = Arc::new(db.store().await);
    let b = Arc::new(db.store().await);
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let acquired: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for copy in 0..16 {
        let store = if copy % 2 == 0 {
            Arc::clone(&a)
        } else {
            Arc::clone(&b)
        };
        let acquired = Arc::clone(&acquired);
        tasks.push(tokio::spawn(async move {
            for k in 0..1_000 {
                let key = format!("k{k}");
                let r = req(&scope, &key, Duration::from_secs(60));
                match store.claim(&r).await.expect("claim") {
                    Claim::Acquired => *acquired.lock().unwrap().entry(key).or_default() += 1,
                    Claim::Standing(st) => assert!(
                        matches!(st.state, StandingState::Running { .. }),
                        "{key}: {st:?}"
                    ),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let acquired = std::mem::take(&mut *acquired.lock().unwrap());
    eprintln!(
        "16,000 claims of 1,000 keys over two pools in {:?}",
        started.elapsed()
    );
    assert_eq!(acquired.len(), 1_000, "every key was acquired");
    let twice: Vec<_> = acquired.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "keys acquired more than once: {twice:?}");
}

/// Store connections killed (`KILL <id>`) while claims and completions are in flight: no key
/// runs twice, a claim that still fails is `Unavailable` (503), and the pool recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connections_never_run_a_key_twice_and_the_pool_recovers() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(
        db.store_with(
            db.builder()
                .max_connections(4)
                .acquire_timeout(Duration::from_millis(500)),
        )
        .await,
    );
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let errors = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..16)
        .map(|w| {
            let (store, runs, errors, stop) = (
                Arc::clone(&store),
                Arc::clone(&runs),
                Arc::clone(&errors),
                Arc::clone(&stop),
            );
            tokio::spawn(async move {
                let mut keys = 0;
                for k in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    keys += 1;
                    let key = format!("w{w}-k{k}");
                    loop {
                        let r = req(&scope, &key, Duration::from_secs(2));
                        match record::claim(&*store, &r, SAME).await {
                            Ok(Verdict::Acquired { .. }) => {
                                *runs.lock().unwrap().entry(key.clone()).or_default() += 1;
                                loop {
                                    match store
                                        .complete(
                                            &scope,
                                            &key,
                                            r.token,
                                            &response(&key),
                                            Duration::from_secs(600),
                                        )
                                        .await
                                    {
                                        Ok(true) => break,
                                        Ok(false) => panic!("{key}: fenced while holding it"),
                                        Err(_) => {
                                            tokio::time::sleep(Duration::from_millis(5)).await
                                        }
                                    }
                                }
                                break;
                            }
                            Ok(Verdict::Replay(resp)) => {
                                assert_eq!(resp.body, key.as_bytes(), "another key's response");
                                break;
                            }
                            Ok(Verdict::InProgress { .. }) => {
                                tokio::time::sleep(Duration::from_millis(50)).await
                            }
                            Ok(Verdict::KeyReused) => panic!("{key}: reused"),
                            Err(StoreError::Unavailable(_)) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                // What the engine does before its 503.
                                let _ = store.release(&scope, &key, r.token).await;
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            Err(e) => panic!("unexpected store error {e}"),
                        }
                    }
                }
                keys
            })
        })
        .collect();
    let mut killed = 0;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        killed += db.kill_store_connections().await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut keys = 0;
    for w in workers {
        keys += w.await.expect("worker");
    }
    eprintln!(
        "killed {killed} connections; {keys} keys; {} claims failed with unavailable",
        errors.load(Ordering::Relaxed)
    );
    assert!(killed > 0, "no store connection was found to kill");
    let runs = std::mem::take(&mut *runs.lock().unwrap());
    assert_eq!(runs.len(), keys, "every key ran");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "keys that ran more than once: {twice:?}");

    db.kill_store_connections().await;
    for i in 0..40 {
        let key = format!("after-{i}");
        assert_eq!(
            store
                .claim(&req(&scope, &key, Duration::from_secs(30)))
                .await
                .unwrap_or_else(|e| panic!("claim {i} after the kills: {e}")),
            Claim::Acquired
        );
    }
}

/// A server that cannot be reached answers unavailable (503) within the acquire timeout.
#[tokio::test]
async fn an_unreachable_database_is_unavailable_not_a_hang() {
    let store = MySqlStore::builder()
        .acquire_timeout(Duration::from_millis(300))
        .connect("mysql://root@127.0.0.1:1/none")
        .await
        .expect("connecting is lazy");
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let started = Instant::now();
    match store
        .claim(&req(&scope, "k", Duration::from_secs(30)))
        .await
    {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected unavailable, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the claim hung"
    );
}

/// The sweep frees only expired rows, in batches, and never a key claimed again in between.
#[tokio::test]
async fn sweep_frees_expired_rows_in_batches_and_keeps_live_ones() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    for i in 0..25 {
        let key = format!("old-{i}");
        let mut r = req(&scope, &key, Duration::from_secs(1));
        r.retention = Duration::from_secs(1);
        assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
    }
    let live = req(&scope, "live", Duration::from_secs(3600));
    assert_eq!(store.claim(&live).await.unwrap(), Claim::Acquired);
    store.advance_clock_for_tests(Duration::from_secs(5));
    assert_eq!(store.sweep(10).await.unwrap(), 10);
    assert_eq!(store.sweep(10).await.unwrap(), 10);
    assert_eq!(store.sweep(10).await.unwrap(), 5);
    assert_eq!(store.sweep(10).await.unwrap(), 0);
    let left = db
        .scalar_i64(&format!("SELECT COUNT(*) FROM `{}`.records", db.name))
        .await;
    assert_eq!(left, 1, "the live reservation stays");
}

/// Whether group commit would pay here: first-request claims (each its own commit) from 1 and
/// from 16 concurrent tasks, with the log writes and fsyncs InnoDB made for them. Measured, not
/// asserted (the counters are server-wide):
///
/// ```text
/// MYSQL_URL=mysql://root@127.0.0.1:3306/test cargo test --release --all-features \
///     -p idempotent-runtime --test store_mysql -- --ignored --nocapture innodb_groups
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement: run alone on a quiet server"]
async fn innodb_groups_the_log_flushes_of_concurrent_claims() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(db.store_with(db.builder().max_connections(16)).await);
    let status = |name: &'static str| {
        let admin = db.admin.clone();
        async move {
            let (_, v): (String, String) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SHOW GLOBAL STATUS LIKE '{name}'"
            )))
            .fetch_one(&admin)
            .await
            .unwrap();
            v.parse::<u64>().unwrap()
        }
    };
    for tasks in [1usize, 16] {
        let scope = idempotent_runtime::test_helpers::store::fresh_scope();
        let claims = 2_000;
        let (writes, fsyncs) = (
            status("Innodb_log_writes").await,
            status("Innodb_data_fsyncs").await,
        );
        let started = Instant::now();
        let workers: Vec<_> = (0..tasks)
            .map(|t| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    for i in (t..claims).step_by(tasks) {
                        let key = format!("k{i}");
                        let r = req(&scope, &key, Duration::from_secs(60));
                        assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
                    }
                })
            })
            .collect();
        for w in workers {
            w.await.unwrap();
        }
        let elapsed = started.elapsed();
        let writes = status("Innodb_log_writes").await - writes;
        let fsyncs = status("Innodb_data_fsyncs").await - fsyncs;
        eprintln!(
            "{tasks:>2} tasks: {claims} claims in {elapsed:?} ({:.0}/s); {:.2} log writes and \
             {:.2} fsyncs a claim",
            claims as f64 / elapsed.as_secs_f64(),
            writes as f64 / claims as f64,
            fsyncs as f64 / claims as f64
        );
    }
}

/// A server that accepts connections and never says a word, as MySQL does across a network
/// partition (no MySQL needed): every operation fails as unavailable once `operation_timeout`
/// passes, though the pool would wait a minute for a connection.
#[tokio::test]
async fn every_operation_fails_unavailable_when_mysql_never_answers() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            conns.push(conn);
        }
    });
    let store = MySqlStore::builder()
        .acquire_timeout(Duration::from_secs(600))
        .operation_timeout(Duration::from_millis(200))
        .connect(&format!("mysql://root@127.0.0.1:{port}/test"))
        .await
        .unwrap();
    let scope: ScopeHash = [7; 32];
    let token = FencingToken::mint();
    let unavailable = |what: &str, e: StoreError| {
        assert!(matches!(e, StoreError::Unavailable(_)), "{what}: {e:?}");
    };
    // A liveness bound, far below the pool's own wait.
    async fn within<T>(f: impl std::future::Future<Output = T>) -> Result<T, ()> {
        tokio::time::timeout(Duration::from_secs(60), f)
            .await
            .map_err(drop)
    }
    let claim = req(&scope, "silent", Duration::from_secs(5));
    unavailable(
        "claim",
        within(store.claim(&claim)).await.unwrap().unwrap_err(),
    );
    unavailable(
        "reclaim",
        within(store.reclaim(&claim, token))
            .await
            .unwrap()
            .unwrap_err(),
    );
    unavailable(
        "complete",
        within(store.complete(
            &scope,
            "silent",
            token,
            &response("{}"),
            Duration::from_secs(60),
        ))
        .await
        .unwrap()
        .unwrap_err(),
    );
    unavailable(
        "release",
        within(store.release(&scope, "silent", token))
            .await
            .unwrap()
            .unwrap_err(),
    );
    unavailable(
        "renew",
        within(store.renew(&scope, "silent", token, Duration::from_secs(5)))
            .await
            .unwrap()
            .unwrap_err(),
    );
    unavailable(
        "inspect",
        within(store.inspect(&scope, "silent", true))
            .await
            .unwrap()
            .unwrap_err(),
    );
    unavailable(
        "forget",
        within(store.forget(&scope, "silent"))
            .await
            .unwrap()
            .unwrap_err(),
    );
    unavailable("sweep", within(store.sweep(10)).await.unwrap().unwrap_err());
    held.abort();
}
