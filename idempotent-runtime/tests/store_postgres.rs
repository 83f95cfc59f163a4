//! The PostgreSQL store against a real database (DESIGN.md §3, §5).
//!
//! Reads `DATABASE_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Every test works in its own schema, so tests run in
//! parallel and across runs.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features -p idempotent-runtime --test store_postgres
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, Standing, StandingState, Store,
    StoreError, contract,
};
use idempotent_runtime::test_helpers;
use idempotent_runtime::test_helpers::record::{self, Verdict};
use sqlx::postgres::{PgPool, PgPoolOptions};

mod support;
use support::database_url;

/// A schema of its own, dropped when the test ends (also on panic, best effort).
struct TestDb {
    url: String,
    schema: String,
    admin: PgPool,
}

impl TestDb {
    async fn new() -> Option<Self> {
        let url = database_url()?;
        let schema = format!("idem_test_{:016x}", FencingToken::mint().0);
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .expect("connect to DATABASE_URL");
        Some(Self { url, schema, admin })
    }

    /// The application name the store's connections carry, so a test can find its backends.
    fn application_name(&self) -> String {
        format!("idem-{}", self.schema)
    }

    fn builder(&self) -> idempotent_runtime::store::postgres::PostgresStoreBuilder {
        PostgresStore::builder()
            .schema(&self.schema)
            .table("records")
            .application_name(self.application_name())
    }

    async fn store(&self) -> PostgresStore {
        let store = self.builder().connect(&self.url).await.expect("connect");
        store.migrate().await.expect("migrate");
        store
    }

    /// Another transaction's uncommitted reservation of `key` (an enlisted request's, say), held
    /// until the returned transaction ends.
    async fn hold_uncommitted(
        &self,
        scope: &ScopeHash,
        key: &str,
        fingerprint: Fingerprint,
    ) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = self.admin.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{}\".records (scope, key, token, fingerprint, fp_version, state, \
             lease_until, expires_at) VALUES ($1, $2, 7, $3, 1, 0, now() + interval '1 minute', \
             now() + interval '1 hour')",
            self.schema
        )))
        .bind(&scope[..])
        .bind(key)
        .bind(&fingerprint.digest[..])
        .execute(&mut *tx)
        .await
        .unwrap();
        tx
    }

    async fn scalar_i64(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.admin)
            .await
            .expect(sql)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let url = self.url.clone();
        let sql = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.schema);
        // The test's runtime (and with it the admin pool's connections) may be shutting down:
        // drop from a runtime and a connection of our own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                use sqlx::Connection;
                if let Ok(mut conn) = sqlx::PgConnection::connect(&url).await {
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
    // The cache judges its copies by a clock that moves with the database's test offset.
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

/// A replica's cache keeps a record another replica completed from its first replay on: the
/// store reports how long the record has left.
#[tokio::test]
async fn a_cache_keeps_a_record_another_replica_completed() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let elsewhere = db.store().await;
    let scope = test_helpers::store::fresh_scope();
    let first = req(&scope, "k", Duration::from_secs(30));
    assert_eq!(elsewhere.claim(&first).await.unwrap(), Claim::Acquired);
    let answer = response(r#"{"id":7}"#);
    let retention = Duration::from_secs(600);
    assert!(
        elsewhere
            .complete(&scope, "k", first.token, &answer, retention)
            .await
            .unwrap()
    );
    let cached = idempotent_runtime::store::cache::CachedStore::new(db.store().await);
    let before = cached.inner().statements_executed();
    for _ in 0..3 {
        match cached
            .claim(&req(&scope, "k", Duration::from_secs(30)))
            .await
            .unwrap()
        {
            Claim::Standing(st) => {
                assert_eq!(st.token, first.token);
                assert_eq!(st.state, StandingState::Completed(Arc::new(answer.clone())));
                let left = st.expires_in.expect("PostgreSQL reports the time left");
                assert!(left <= retention, "{left:?} left of {retention:?}");
            }
            Claim::Acquired => panic!("a completed key was acquired"),
        }
    }
    assert_eq!(
        cached.inner().statements_executed() - before,
        1,
        "only the first of three replays reached the database"
    );
    assert_eq!(cached.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_safe_from_several_replicas_at_once() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let stores: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..6 {
            v.push(Arc::new(db.builder().connect(&db.url).await.unwrap()));
        }
        v
    };
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
    stores[0].migrate().await.expect("migrate again");
    let schema = &db.schema;
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM \"{schema}\".records_migrations"
        ))
        .await,
        4,
        "each version is applied and recorded once"
    );
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(&db.admin)
    .await
    .unwrap();
    assert_eq!(
        tables,
        ["records", "records_migrations"],
        "never sqlx's _sqlx_migrations"
    );
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND tablename = 'records' \
         ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(&db.admin)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        ["records_pkey", "records_sweep_after_idx"],
        "the key and the sweeper's index, none on a column a completion changes"
    );
    let options: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT unnest(reloptions) FROM pg_class WHERE oid = '\"{schema}\".records'::regclass"
    )))
    .fetch_all(&db.admin)
    .await
    .unwrap();
    assert_eq!(
        options,
        ["fillfactor=70"],
        "room on each page for completions"
    );
    // The store works on the migrated table.
    let scope = test_helpers::store::fresh_scope();
    assert_eq!(
        stores[3]
            .claim(&req(&scope, "k", Duration::from_secs(5)))
            .await
            .unwrap(),
        Claim::Acquired
    );
}

#[tokio::test]
async fn invalid_table_names_are_refused() {
    for (schema, table) in [
        (None, "bad name"),
        (Some("x;drop"), "records"),
        (None, "1x"),
    ] {
        let mut b = PostgresStore::builder().table(table);
        if let Some(s) = schema {
            b = b.schema(s);
        }
        let err = b
            .connect("postgres://nobody@127.0.0.1:1/none")
            .await
            .expect_err("invalid identifier accepted");
        assert!(err.to_string().contains("must be"), "{err}");
    }
}

async fn xmin(db: &TestDb, scope: &ScopeHash, key: &str) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT xmin::text FROM \"{}\".records WHERE scope = $1 AND key = $2",
        db.schema
    )))
    .bind(&scope[..])
    .bind(key)
    .fetch_one(&db.admin)
    .await
    .unwrap()
}

#[tokio::test]
async fn first_request_costs_two_round_trips_and_a_replay_one_that_writes_nothing() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = test_helpers::store::fresh_scope();
    let same = |f: &Fingerprint| *f == fp(1);

    let before = store.statements_executed();
    let first = req(&scope, "order-1", Duration::from_secs(30));
    assert_eq!(
        record::claim(&store, &first, same).await.unwrap(),
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

    let written = xmin(&db, &scope, "order-1").await;
    for _ in 0..3 {
        let before = store.statements_executed();
        let replay = record::claim(
            &store,
            &req(&scope, "order-1", Duration::from_secs(30)),
            same,
        )
        .await
        .unwrap();
        assert_eq!(
            replay,
            Verdict::Replay(Arc::new(response(r#"{"id":1}"#))),
            "the replay carries the recorded response"
        );
        assert_eq!(
            store.statements_executed() - before,
            1,
            "a replay is one statement"
        );
    }
    assert_eq!(
        xmin(&db, &scope, "order-1").await,
        written,
        "a replay wrote nothing: the row's version is the completion's"
    );

    // An in-progress answer is one statement and writes nothing either.
    let running = req(&scope, "order-2", Duration::from_secs(30));
    assert_eq!(store.claim(&running).await.unwrap(), Claim::Acquired);
    let reserved = xmin(&db, &scope, "order-2").await;
    let before = store.statements_executed();
    assert!(matches!(
        record::claim(
            &store,
            &req(&scope, "order-2", Duration::from_secs(30)),
            same
        )
        .await
        .unwrap(),
        Verdict::InProgress { .. }
    ));
    assert_eq!(store.statements_executed() - before, 1);
    assert_eq!(xmin(&db, &scope, "order-2").await, reserved);
}

#[tokio::test]
async fn recorded_responses_round_trip_byte_for_byte() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = test_helpers::store::fresh_scope();
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
    );
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_meeting_an_uncommitted_row_answers_in_progress_instead_of_waiting() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db
        .builder()
        .lock_timeout(Duration::from_millis(200))
        .connect(&db.url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();

    // Another transaction holds an uncommitted row for the key (an enlisted request, say).
    let tx = db.hold_uncommitted(&scope, "k", fp(9)).await;

    let started = Instant::now();
    let claimed = record::claim(
        &store,
        &req(&scope, "k", Duration::from_secs(30)),
        |f: &Fingerprint| *f == fp(1),
    )
    .await
    .unwrap();
    assert_eq!(
        claimed,
        Verdict::InProgress {
            lease_left: Duration::from_secs(30)
        },
        "reported as running, with the request's lease"
    );
    // Not a speed assertion: the claim must not have waited for the transaction, which is
    // still open now.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the claim waited for the other transaction"
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committed_after_the_claims_snapshot_is_read_back_by_a_rerun() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(
        db.builder()
            .lock_timeout(Duration::from_secs(20))
            .connect(&db.url)
            .await
            .unwrap(),
    );
    store.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();

    let tx = db.hold_uncommitted(&scope, "k", fp(1)).await;

    // The claim's statement starts (and takes its snapshot) while the row is uncommitted, waits
    // on it, and finds the conflict once it commits: its read-back cannot see the row.
    let before = store.statements_executed();
    let claim = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let r = req(&scope, "k", Duration::from_secs(30));
            store.claim(&r).await
        })
    };
    let app = db.application_name();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting = db
            .scalar_i64(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{app}' \
                 AND wait_event_type = 'Lock'"
            ))
            .await;
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the claim never waited on the row"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.commit().await.unwrap();

    match claim.await.unwrap().unwrap() {
        Claim::Standing(st) => {
            assert_eq!(st.token, FencingToken(7), "the committed row is reported");
            assert!(matches!(st.state, StandingState::Running { .. }));
        }
        Claim::Acquired => panic!("a claim acquired a key another transaction holds"),
    }
    assert_eq!(
        store.statements_executed() - before,
        2,
        "the empty read-back was re-run once"
    );
}

/// Backends terminated under load (a failover, `pg_terminate_backend`): claims on dead pooled
/// connections are sent again on live ones, no key runs twice, and the pool recovers. A claim
/// that still fails is `Unavailable` (503), never a wrong answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminated_connections_never_run_a_key_twice_and_the_pool_recovers() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(
        db.builder()
            .max_connections(4)
            .acquire_timeout(Duration::from_millis(500))
            .connect(&db.url)
            .await
            .unwrap(),
    );
    store.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let errors = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // More workers than connections: claims and completions queue and go out in batches, so
    // connections die with batches in flight.
    let workers: Vec<_> = (0..24)
        .map(|w| {
            let (store, runs, errors) =
                (Arc::clone(&store), Arc::clone(&runs), Arc::clone(&errors));
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let mut keys = 0;
                for k in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    keys += 1;
                    let key = format!("w{w}-k{k}");
                    // A client that retries until it gets an answer other than 503 or 409.
                    loop {
                        let r = req(&scope, &key, Duration::from_secs(2));
                        match record::claim(&*store, &r, |f: &Fingerprint| *f == fp(1)).await {
                            Ok(Verdict::Acquired { .. }) => {
                                *runs.lock().unwrap().entry(key.clone()).or_default() += 1;
                                // A careful caller retries its completion while it holds the
                                // key, so a lost write cannot make the key run twice here.
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
                                assert_eq!(
                                    resp.body,
                                    key.as_bytes(),
                                    "replayed another key's response"
                                );
                                break;
                            }
                            Ok(Verdict::InProgress { .. }) => {
                                tokio::time::sleep(Duration::from_millis(50)).await
                            }
                            Ok(Verdict::KeyReused) => panic!("{key}: reused"),
                            Err(StoreError::Unavailable(_)) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                // What the engine does before its 503: free the key if the
                                // claim was written after all.
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

    let app = db.application_name();
    let mut terminated = 0i64;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let n: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1",
        )
        .bind(&app)
        .fetch_one(&db.admin)
        .await
        .unwrap();
        terminated += n;
    }
    stop.store(true, Ordering::Relaxed);
    let mut keys = 0;
    for w in workers {
        keys += w.await.expect("worker");
    }
    eprintln!(
        "terminated {terminated} connections; {} claims failed with unavailable",
        errors.load(Ordering::Relaxed)
    );
    assert!(terminated > 0, "no store connection was found to terminate");
    let statements = store.statements_executed();
    eprintln!("{keys} keys, {statements} statements");
    assert!(
        statements < 2 * keys as u64,
        "{statements} statements for {keys} keys: the claims and completions were not batched"
    );
    let runs = std::mem::take(&mut *runs.lock().unwrap());
    assert_eq!(runs.len(), keys, "every key ran");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "keys that ran more than once: {twice:?}");

    // The pool reconnects: connections terminated while idle fail at most once each, then
    // every claim succeeds.
    let mut failures = 0;
    let mut tail_failures = 0;
    for i in 0..60 {
        let key = format!("after-{i}");
        match store
            .claim(&req(&scope, &key, Duration::from_secs(30)))
            .await
        {
            Ok(c) => assert_eq!(c, Claim::Acquired),
            Err(StoreError::Unavailable(_)) => {
                failures += 1;
                if i >= 20 {
                    tail_failures += 1;
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
    eprintln!("after the terminations, {failures} of 60 claims failed");
    // Dead idle connections are replaced as they are met, so no claim fails.
    assert_eq!(
        failures, 0,
        "{failures} claims failed after the terminations"
    );
    assert_eq!(tail_failures, 0, "the pool did not recover");
}

/// A database that cannot be reached answers unavailable (503) within the acquire timeout.
#[tokio::test]
async fn an_unreachable_database_is_unavailable_not_a_hang() {
    let store = PostgresStore::builder()
        .acquire_timeout(Duration::from_millis(300))
        .connect("postgres://postgres@127.0.0.1:1/none")
        .await
        .expect("connecting is lazy");
    let scope = test_helpers::store::fresh_scope();
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

/// A sweep of 100,000 expired rows while claims continue: no claim fails. Prints p50/p99 claim
/// latency with and without the sweep (measured, not asserted).
///
/// ```text
/// DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo test --all-features \
///     -p idempotent-runtime --test store_postgres -- --ignored --nocapture sweep_of_100k
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "slow: seeds 100,000 rows; run explicitly to measure"]
async fn sweep_of_100k_expired_rows_while_claims_continue() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(
        db.builder()
            .max_connections(9)
            .connect(&db.url)
            .await
            .unwrap(),
    );
    store.migrate().await.unwrap();
    let seed = |n: i64| {
        format!(
            "INSERT INTO \"{}\".records (scope, key, token, fingerprint, fp_version, state, \
             lease_until, expires_at, status, headers, body) \
             SELECT sha256(('old' || i)::bytea), 'k' || i, i, sha256(i::text::bytea), 1, 1, \
                    now() - interval '2 days', now() - interval '1 day', 201, ''::bytea, \
                    convert_to(repeat('x', 200), 'UTF8') \
             FROM generate_series(1, {n}) i",
            db.schema
        )
    };
    sqlx::query(sqlx::AssertSqlSafe(seed(100_000)))
        .execute(&db.admin)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ANALYZE \"{}\".records",
        db.schema
    )))
    .execute(&db.admin)
    .await
    .unwrap();

    async fn claims(
        store: Arc<PostgresStore>,
        tag: &'static str,
        until: Arc<std::sync::atomic::AtomicBool>,
    ) -> Vec<Duration> {
        let workers: Vec<_> = (0..8)
            .map(|w| {
                let store = Arc::clone(&store);
                let until = Arc::clone(&until);
                tokio::spawn(async move {
                    let scope = test_helpers::store::fresh_scope();
                    let mut lat = Vec::new();
                    let mut i = 0;
                    while !until.load(Ordering::Relaxed) {
                        let key = format!("{tag}-{w}-{i}");
                        i += 1;
                        let r = req(&scope, &key, Duration::from_secs(30));
                        let t = Instant::now();
                        let c = store
                            .claim(&r)
                            .await
                            .expect("a claim failed during the sweep");
                        lat.push(t.elapsed());
                        assert_eq!(c, Claim::Acquired);
                        if lat.len() >= 20_000 {
                            break;
                        }
                    }
                    lat
                })
            })
            .collect();
        let mut all = Vec::new();
        for w in workers {
            all.extend(w.await.expect("claim worker"));
        }
        all.sort();
        all
    }
    fn pct(v: &[Duration], p: f64) -> Duration {
        v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
    }

    // Baseline: claims alone, for 3 s.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let baseline = tokio::spawn(claims(Arc::clone(&store), "base", Arc::clone(&stop)));
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let baseline = baseline.await.unwrap();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let during = tokio::spawn(claims(Arc::clone(&store), "sweep", Arc::clone(&stop)));
    let started = Instant::now();
    let mut deleted = 0;
    let mut statements = 0;
    loop {
        let n = store.sweep(500).await.expect("sweep");
        deleted += n;
        statements += 1;
        if n < 500 {
            break;
        }
    }
    let sweep_time = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let during = during.await.unwrap();

    assert_eq!(
        deleted, 100_000,
        "the sweep freed every expired row, and only those"
    );
    let live = db
        .scalar_i64(&format!("SELECT count(*) FROM \"{}\".records", db.schema))
        .await;
    assert_eq!(
        live as usize,
        baseline.len() + during.len(),
        "every claimed row survived"
    );
    println!(
        "sweep: {deleted} rows in {statements} statements, {sweep_time:?}\n\
         claims without sweep: n={} p50={:?} p99={:?}\n\
         claims during sweep:  n={} p50={:?} p99={:?}",
        baseline.len(),
        pct(&baseline, 0.50),
        pct(&baseline, 0.99),
        during.len(),
        pct(&during, 0.50),
        pct(&during, 0.99),
    );
}

/// The store's record for `key`, read as a claim that must find it completed.
async fn completed_body(store: &PostgresStore, scope: &ScopeHash, key: &str) -> bytes::Bytes {
    match store
        .claim(&req(scope, key, Duration::from_secs(30)))
        .await
        .unwrap()
    {
        Claim::Standing(st) => match st.state {
            StandingState::Completed(r) => r.body.clone(),
            other => panic!("{key}: {other:?}, not completed"),
        },
        Claim::Acquired => panic!("{key}: a completed key was acquired"),
    }
}

// Group commit (DESIGN.md §5). On a current-thread runtime, `join_all` queues every claim before
// the task that sends the statement first runs, so the burst goes out together.
#[tokio::test]
async fn claims_arriving_together_go_out_as_one_statement_each_answered_on_its_own() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db
        .builder()
        .batches_in_flight(1)
        .connect(&db.url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();
    let keys: Vec<String> = (0..24).map(|i| format!("k{i:02}")).collect();
    // Every key twice: the first eight duplicates share a statement with their original (32
    // rows a statement), the rest come in the next one.
    let reqs: Vec<ClaimRequest<'_>> = keys
        .iter()
        .chain(keys.iter())
        .map(|k| req(&scope, k, Duration::from_secs(30)))
        .collect();
    let before = store.statements_executed();
    let claims = futures_util::future::join_all(reqs.iter().map(|r| store.claim(r))).await;
    let claim_statements = store.statements_executed() - before;
    for (i, key) in keys.iter().enumerate() {
        let (a, b) = (&claims[i], &claims[i + keys.len()]);
        let (won, lost, winner) = match (a.as_ref().unwrap(), b.as_ref().unwrap()) {
            (Claim::Acquired, other) => (i, other, &reqs[i]),
            (other, Claim::Acquired) => (i + keys.len(), other, &reqs[i + keys.len()]),
            other => panic!("{key}: neither copy acquired: {other:?}"),
        };
        match lost {
            Claim::Standing(st) => {
                assert_eq!(
                    st.token, winner.token,
                    "{key}: the loser sees the winner's token"
                );
                assert!(
                    matches!(st.state, StandingState::Running { .. }),
                    "{key}: {:?}",
                    st.state
                );
            }
            Claim::Acquired => panic!("{key}: both copies acquired"),
        }
        let _ = won;
    }
    // Two statements carry the 48 rows; the 8 duplicates that shared a statement with their
    // original read back nothing there and are sent again (together). A slow machine may start
    // a statement beside one that seems stalled, so the bound has room; one a claim would be 48.
    assert!(
        claim_statements <= 8,
        "48 claims took {claim_statements} statements"
    );

    let winners: Vec<&ClaimRequest<'_>> = (0..keys.len())
        .map(|i| match claims[i].as_ref().unwrap() {
            Claim::Acquired => &reqs[i],
            _ => &reqs[i + keys.len()],
        })
        .collect();
    let before = store.statements_executed();
    let store = &store;
    let completed = futures_util::future::join_all(winners.iter().map(|r| {
        let body = format!(r#"{{"key":"{}"}}"#, r.key);
        async move {
            store
                .complete(
                    r.scope,
                    r.key,
                    r.token,
                    &response(&body),
                    Duration::from_secs(60),
                )
                .await
        }
    }))
    .await;
    assert!(
        completed.into_iter().all(|c| c.unwrap()),
        "every holder completes"
    );
    let complete_statements = store.statements_executed() - before;
    assert!(
        complete_statements <= 4,
        "24 completions took {complete_statements} statements"
    );
    // A stale token in a batch changes nothing and is answered false, beside rows that succeed.
    let stale = futures_util::future::join_all([
        store.complete(
            &scope,
            "k00",
            FencingToken::mint(),
            &response("{}"),
            Duration::from_secs(60),
        ),
        store.complete(
            &scope,
            "k01",
            winners[1].token,
            &response(r#"{"key":"k01"}"#),
            Duration::from_secs(60),
        ),
    ])
    .await;
    assert!(
        !stale[0].as_ref().unwrap(),
        "a stale token completes nothing"
    );
    assert!(
        *stale[1].as_ref().unwrap(),
        "a resent identical completion succeeds"
    );
    for key in &keys {
        assert_eq!(
            completed_body(store, &scope, key).await,
            format!(r#"{{"key":"{key}"}}"#).into_bytes(),
            "each row was answered with its own record"
        );
    }
}

#[tokio::test]
async fn a_batch_refused_as_a_whole_is_sent_row_by_row_so_one_bad_row_never_fails_its_neighbours() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db
        .builder()
        .lock_timeout(Duration::from_millis(200))
        .batches_in_flight(1)
        .connect(&db.url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();
    // Another transaction holds an uncommitted row for one key: the batch carrying it meets the
    // lock and PostgreSQL refuses the whole statement.
    let tx = db.hold_uncommitted(&scope, "locked", fp(9)).await;
    // Two keys held here, completed in the same round as the claims.
    let held: Vec<_> = ["h1", "h2"]
        .iter()
        .map(|k| req(&scope, k, Duration::from_secs(30)))
        .collect();
    for r in &held {
        assert_eq!(store.claim(r).await.unwrap(), Claim::Acquired);
    }
    let keys = ["a", "b", "c", "locked", "d", "e"];
    let reqs: Vec<_> = keys
        .iter()
        .map(|k| req(&scope, k, Duration::from_secs(30)))
        .collect();
    let answer = response("{}");
    let completions = futures_util::future::join_all(
        held.iter()
            .map(|r| store.complete(r.scope, r.key, r.token, &answer, Duration::from_secs(60))),
    );
    let claims = futures_util::future::join_all(reqs.iter().map(|r| store.claim(r)));
    let (completed, claims) = futures_util::future::join(completions, claims).await;
    for (r, done) in held.iter().zip(completed) {
        assert!(
            done.expect("no row fails"),
            "{} completes beside the bad row",
            r.key
        );
    }
    for (key, claim) in keys.iter().zip(&claims) {
        match (*key, claim.as_ref().expect("no row fails")) {
            ("locked", Claim::Standing(st)) => assert!(
                matches!(st.state, StandingState::Running { .. }),
                "the locked key is in progress: {st:?}"
            ),
            ("locked", Claim::Acquired) => panic!("the locked key was acquired"),
            (_, Claim::Acquired) => {}
            (key, other) => panic!("{key}: {other:?}, not acquired beside the bad row"),
        }
    }
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn completions_are_heap_only_updates() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = test_helpers::store::fresh_scope();
    let n = 60;
    let body = "x".repeat(1024);
    for i in 0..n {
        let key = format!("order-{i}");
        let r = req(&scope, &key, Duration::from_secs(30));
        assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
        assert!(
            store
                .complete(
                    &scope,
                    &key,
                    r.token,
                    &response(&body),
                    // The claim's retention, as the engine sends: a shorter one would move
                    // `sweep_after` earlier, an indexed column.
                    r.retention
                )
                .await
                .unwrap()
        );
    }
    // A backend reports its table statistics when it ends.
    store.pool().close().await;
    let stats = format!(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables \
         WHERE schemaname = '{}' AND relname = 'records'",
        db.schema
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let (updates, hot) = loop {
        let (updates, hot): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(stats.clone()))
            .fetch_one(&db.admin)
            .await
            .unwrap();
        if updates >= n || Instant::now() > deadline {
            break (updates, hot);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(updates, n, "one update a completion");
    assert!(
        hot * 10 >= updates * 9,
        "{hot} of {updates} completions were heap-only"
    );
}

/// Claims and completions that arrive together go out as one round: one statement, one commit,
/// each row answered as its kind. A duplicate of a key completed in the same round reads the
/// round's snapshot: the key still in progress, as if it had come just before the completion.
#[tokio::test]
async fn claims_and_completions_arriving_together_share_one_round() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db.store().await;
    let scope = test_helpers::store::fresh_scope();
    let held: Vec<String> = (0..4).map(|i| format!("held-{i}")).collect();
    let held_reqs: Vec<ClaimRequest<'_>> = held
        .iter()
        .map(|k| req(&scope, k, Duration::from_secs(30)))
        .collect();
    for r in &held_reqs {
        assert_eq!(store.claim(r).await.unwrap(), Claim::Acquired);
    }
    let fresh: Vec<String> = (0..4).map(|i| format!("fresh-{i}")).collect();
    let fresh_reqs: Vec<ClaimRequest<'_>> = fresh
        .iter()
        .map(|k| req(&scope, k, Duration::from_secs(30)))
        .collect();
    let duplicate = req(&scope, &held[0], Duration::from_secs(30));
    let answer = response(r#"{"ok":true}"#);
    let before = store.statements_executed();
    let store = &store;
    let completions = futures_util::future::join_all(
        held_reqs
            .iter()
            .map(|r| store.complete(r.scope, r.key, r.token, &answer, Duration::from_secs(60))),
    );
    let claims = futures_util::future::join_all(
        fresh_reqs
            .iter()
            .chain(std::iter::once(&duplicate))
            .map(|r| store.claim(r)),
    );
    let (completed, claimed) = futures_util::future::join(completions, claims).await;
    assert_eq!(
        store.statements_executed() - before,
        1,
        "4 completions and 5 claims together"
    );
    assert!(
        completed.into_iter().all(|c| c.unwrap()),
        "every holder completes"
    );
    for (r, claim) in fresh_reqs.iter().zip(&claimed) {
        assert_eq!(claim.as_ref().unwrap(), &Claim::Acquired, "{}", r.key);
    }
    match claimed[4].as_ref().unwrap() {
        Claim::Standing(st) => {
            assert_eq!(st.token, held_reqs[0].token);
            assert!(
                matches!(st.state, StandingState::Running { .. }),
                "{:?}",
                st.state
            );
        }
        other => panic!("the duplicate acquired a held key: {other:?}"),
    }
    // After the round, the duplicate finds the completion.
    match store.claim(&duplicate).await.unwrap() {
        Claim::Standing(st) => match st.state {
            StandingState::Completed(recorded) => assert_eq!(recorded.body, answer.body),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

/// Rounds from two processes (two pools) that carry duplicates of each other's keys, claims of
/// keys the other is completing among them, never deadlock: a round's claims run before its
/// completions, so a round waiting in its claims holds only rows nobody completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rounds_of_two_replicas_sharing_keys_never_deadlock() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()";
    let before = db.scalar_i64(deadlocks).await;
    let replica = || async {
        Arc::new(
            db.builder()
                .max_connections(3)
                .lock_timeout(Duration::from_secs(30))
                .connect(&db.url)
                .await
                .unwrap(),
        )
    };
    let (a, b) = (replica().await, replica().await);
    a.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let workers: Vec<_> = (0..24)
        .map(|w| {
            let store = Arc::clone(if w % 2 == 0 { &a } else { &b });
            let (scope, runs) = (scope, Arc::clone(&runs));
            tokio::spawn(async move {
                // Every key sent by four workers, two on each replica, in a different order.
                for i in 0..60 {
                    let key = format!("k{}", (i * 7 + w / 4 * 13) % 90);
                    loop {
                        let r = req(&scope, &key, Duration::from_secs(30));
                        match store.claim(&r).await.unwrap() {
                            Claim::Acquired => {
                                *runs.lock().unwrap().entry(key.clone()).or_default() += 1;
                                let answer = response(&key);
                                let done =
                                    store.complete(&scope, &key, r.token, &answer, r.retention);
                                assert!(done.await.unwrap(), "{key}");
                                break;
                            }
                            Claim::Standing(Standing {
                                state: StandingState::Completed(recorded),
                                ..
                            }) => {
                                assert_eq!(recorded.body, key.as_bytes());
                                break;
                            }
                            Claim::Standing(_) => tokio::task::yield_now().await,
                        }
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(
        runs.lock().unwrap().values().all(|&n| n == 1),
        "a key ran twice"
    );
    // A backend reports its statistics when it ends.
    a.pool().close().await;
    b.pool().close().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        db.scalar_i64(deadlocks).await - before,
        0,
        "rounds deadlocked"
    );
}

/// Requests that become runnable together (woken by one batch's answer, say) reach the store
/// one after another on the same worker; the first must not go out alone with the rest queued
/// behind it for a whole round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn requests_runnable_together_share_one_statement() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = Arc::new(db.store().await);
    let scope = test_helpers::store::fresh_scope();
    // Warm a connection, so the claims below find one ready.
    let warm = req(&scope, "warm", Duration::from_secs(30));
    assert_eq!(store.claim(&warm).await.unwrap(), Claim::Acquired);
    let before = store.statements_executed();
    let (store2, scope2) = (Arc::clone(&store), scope);
    // Spawned from the worker, so the claims are all runnable before any of them runs.
    tokio::spawn(async move {
        let claims: Vec<_> = (0..8)
            .map(|i| {
                let (store, scope) = (Arc::clone(&store2), scope2);
                tokio::spawn(async move {
                    let key = format!("k{i}");
                    let r = req(&scope, &key, Duration::from_secs(30));
                    store.claim(&r).await.unwrap()
                })
            })
            .collect();
        for claim in claims {
            assert_eq!(claim.await.unwrap(), Claim::Acquired);
        }
    })
    .await
    .unwrap();
    assert_eq!(
        store.statements_executed() - before,
        1,
        "8 claims runnable at once went out in more than one statement"
    );
}

/// A batch statement planned while the table is young must still look rows up by primary key
/// once it has grown: PostgreSQL keeps a connection's plan of a prepared statement (it planned
/// the former `UPDATE … FROM unnest(…)` as a hash join over a sequential scan of the young
/// table, and every later batch read the whole table, until an `ANALYZE` replaced the plan).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_planned_on_a_young_table_never_scan_it_once_it_has_grown() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    // Few connections, many workers: every connection runs its batch statements more than the
    // five times after which PostgreSQL may keep a generic plan, while the table is young.
    let store = Arc::new(
        db.builder()
            .max_connections(3)
            .connect(&db.url)
            .await
            .unwrap(),
    );
    store.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();
    let body = "x".repeat(1024);
    let workers: Vec<_> = (0..24)
        .map(|w| {
            let (store, scope, body) = (Arc::clone(&store), scope, body.clone());
            tokio::spawn(async move {
                for k in 0..40 {
                    let key = format!("w{w}-k{k}");
                    let r = req(&scope, &key, Duration::from_secs(30));
                    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired, "{key}");
                    let answer = response(&body);
                    let done = store.complete(&scope, &key, r.token, &answer, r.retention);
                    assert!(done.await.unwrap(), "{key}");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let requests = 24 * 40;
    assert!(
        store.statements_executed() < requests,
        "{} statements for {requests} claims and completions: the work was not batched",
        store.statements_executed()
    );
    // A backend reports its table statistics when it ends.
    store.pool().close().await;
    let stats = format!(
        "SELECT n_tup_ins, seq_tup_read, idx_scan FROM pg_stat_user_tables \
         WHERE schemaname = '{}' AND relname = 'records'",
        db.schema
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let (inserted, scanned) = loop {
        let (inserted, scanned, _): (i64, i64, Option<i64>) =
            sqlx::query_as(sqlx::AssertSqlSafe(stats.clone()))
                .fetch_one(&db.admin)
                .await
                .unwrap();
        if inserted >= requests as i64 || Instant::now() > deadline {
            break (inserted, scanned);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(inserted, requests as i64);
    assert_eq!(
        scanned, 0,
        "statements read {scanned} rows by sequential scans of a table of {inserted}"
    );
}

#[tokio::test]
async fn migrating_a_table_of_the_previous_shape_keeps_its_records_and_sweeps_them() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    let scope = test_helpers::store::fresh_scope();
    let table = format!("\"{}\".records", db.schema);
    // The table as versions 1 and 2 left it, with a completed record, a live one and an
    // expired one.
    for (version, ddl) in [
        (
            1,
            include_str!("../migrations/postgres/0001_create_records.sql"),
        ),
        (
            2,
            include_str!("../migrations/postgres/0002_record_route_and_creation.sql"),
        ),
    ] {
        let ddl = ddl.replace("{table}", &table).replace("{name}", "records");
        let setup = format!(
            "CREATE SCHEMA IF NOT EXISTS \"{s}\"; {ddl}; \
             CREATE TABLE IF NOT EXISTS \"{s}\".records_migrations (version bigint PRIMARY KEY, \
                 description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now()); \
             INSERT INTO \"{s}\".records_migrations (version, description) VALUES ({version}, 'old')",
            s = db.schema
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(setup))
            .execute(&db.admin)
            .await
            .unwrap();
    }
    for (key, expires) in [("done", "1 hour"), ("gone", "-1 minute")] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, key, token, fingerprint, fp_version, state, lease_until, \
             expires_at, status, headers, body) VALUES ($1, $2, 7, $3, 1, 1, now(), \
             now() + interval '{expires}', 201, $4, 'old')"
        )))
        .bind(&scope[..])
        .bind(key)
        .bind(&fp(1).digest[..])
        .bind(response("").encode_headers())
        .execute(&db.admin)
        .await
        .unwrap();
    }
    let store = db.store().await;
    assert_eq!(
        completed_body(&store, &scope, "done").await,
        &b"old"[..],
        "a record written before the migration replays after it"
    );
    assert_eq!(
        store.sweep(100).await.unwrap(),
        1,
        "the expired old row is swept"
    );
    assert_eq!(
        completed_body(&store, &scope, "done").await,
        &b"old"[..],
        "the live old row is kept"
    );
    // New records are swept by their own expiry too.
    let r = req(&scope, "new", Duration::from_secs(1));
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
    store.advance_clock_for_tests(Duration::from_secs(3602));
    assert_eq!(
        store.sweep(100).await.unwrap(),
        2,
        "the new row and the old live one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_waiting_on_a_lock_never_holds_the_queue() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    // The claim of the locked key can only come back once the other transaction ends.
    let store = Arc::new(
        db.builder()
            .lock_timeout(Duration::from_secs(600))
            .batches_in_flight(1)
            .connect(&db.url)
            .await
            .unwrap(),
    );
    store.migrate().await.unwrap();
    let scope = test_helpers::store::fresh_scope();
    let tx = db.hold_uncommitted(&scope, "locked", fp(9)).await;
    let waiting = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            store
                .claim(&req(&scope, "locked", Duration::from_secs(30)))
                .await
        })
    };
    // Until the statement carrying it is on the wire and waiting.
    let app = db.application_name();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let blocked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
             AND wait_event_type = 'Lock'",
        )
        .bind(&app)
        .fetch_one(&db.admin)
        .await
        .unwrap();
        if blocked > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the claim never reached the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Other keys' claims go out beside the stalled statement and come back while it waits.
    for i in 0..5 {
        let key = format!("free-{i}");
        let claim = tokio::time::timeout(
            Duration::from_secs(60),
            store.claim(&req(&scope, &key, Duration::from_secs(30))),
        )
        .await
        .expect("a claim queued behind the statement waiting on the lock");
        assert_eq!(claim.unwrap(), Claim::Acquired);
    }
    assert!(
        !waiting.is_finished(),
        "the locked key's claim came back before the lock was freed"
    );
    tx.rollback().await.unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), Claim::Acquired);
}

/// What holds a claim's statement in flight in the test below.
#[derive(Debug, Clone, Copy)]
enum Hold {
    /// `LOCK TABLE … IN SHARE MODE` in another session: every write to the table waits (the
    /// issue's reproduction). The pipeline's release waits beside the statement, and whether it
    /// sees the claim's row once both run is a race.
    TableLock,
    /// Another transaction's uncommitted row under each key (and a row lock on the abandoned
    /// record): the claim waits for that transaction; the release finds nothing at once. No race:
    /// without the store's own release the key always stands.
    Rows,
}

/// A claim whose request's future is dropped while its statement is in flight never leaves its
/// key standing (DESIGN.md §3, "Renewal outlives outages"). The pipeline releases a dropped
/// claim under its token at once, as this test does; that release runs beside the statement and
/// cannot see its row, so what frees the key is the store, which hears the statement's outcome.
/// Batched claims (a batch of one and larger ones), unbatched ones (`batch_rows(1)`), and a
/// reclaim of an abandoned record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_dropped_while_their_statement_waits_leave_their_keys_free() {
    let Some(db) = TestDb::new().await else {
        return;
    };
    for (rows, hold) in [
        (32, Hold::TableLock),
        (32, Hold::Rows),
        (1, Hold::TableLock),
        (1, Hold::Rows),
    ] {
        let table = format!("dropped_{rows}_{hold:?}").to_lowercase();
        let store = Arc::new(
            db.builder()
                .table(&table)
                .batch_rows(rows)
                // Room for every statement and every release at once, so that no release waits
                // for a connection that only comes back once the claims' statements ended.
                .max_connections(16)
                .connect(&db.url)
                .await
                .unwrap(),
        );
        store.migrate().await.unwrap();
        let qualified = format!("\"{}\".\"{table}\"", db.schema);
        let scope = test_helpers::store::fresh_scope();
        let lease = Duration::from_secs(60);
        // An abandoned reservation, for the reclaim.
        let stale = req(&scope, "abandoned", Duration::from_secs(1));
        assert_eq!(store.claim(&stale).await.unwrap(), Claim::Acquired);
        let stale = stale.token;
        store.advance_clock_for_tests(Duration::from_secs(2));
        let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();

        let mut holder = db.admin.begin().await.unwrap();
        match hold {
            Hold::TableLock => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "LOCK TABLE {qualified} IN SHARE MODE"
                )))
                .execute(&mut *holder)
                .await
                .unwrap();
            }
            Hold::Rows => {
                for key in &keys {
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "INSERT INTO {qualified} (scope, key, token, fingerprint, fp_version, \
                         state, lease_until, expires_at) VALUES ($1, $2, 7, $3, 1, 0, \
                         now() + interval '1 minute', now() + interval '1 hour')"
                    )))
                    .bind(&scope[..])
                    .bind(key)
                    .bind(&fp(9).digest[..])
                    .execute(&mut *holder)
                    .await
                    .unwrap();
                }
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT 1 FROM {qualified} WHERE scope = $1 AND key = 'abandoned' FOR UPDATE"
                )))
                .bind(&scope[..])
                .execute(&mut *holder)
                .await
                .unwrap();
            }
        }

        let dropped = keys
            .iter()
            .cloned()
            .chain(["abandoned".to_owned()])
            .map(|key| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let r = req(&scope, &key, lease);
                    let attempt = async {
                        if key == "abandoned" {
                            store.reclaim(&r, stale).await
                        } else {
                            store.claim(&r).await
                        }
                    };
                    let gave_up = tokio::time::timeout(Duration::from_millis(300), attempt).await;
                    assert!(gave_up.is_err(), "{key}: answered while held: {gave_up:?}");
                    // What the pipeline's guard does for a dropped claim.
                    let (store, token) = (Arc::clone(&store), r.token);
                    tokio::spawn(async move { store.release(&scope, &key, token).await });
                })
            })
            .collect::<Vec<_>>();
        for d in dropped {
            d.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        holder.rollback().await.unwrap();

        for key in keys.iter().map(String::as_str).chain(["abandoned"]) {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                // The claim loop a retry runs: the abandoned record is taken over again.
                let retry = req(&scope, key, lease);
                match record::claim(&*store, &retry, |_| true).await.unwrap() {
                    Verdict::Acquired { .. } => break,
                    other => assert!(
                        Instant::now() < deadline,
                        "batch_rows({rows}), {hold:?}: {key} still stands after its claim was \
                         dropped: {other:?}"
                    ),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Duplicates waiting for a running request (`wait_in_progress`) hold no database connection
/// while they wait (DESIGN.md §6, "never holding a database connection while it waits"): on a
/// pool of one connection, eight waiting duplicates leave it free nearly all the time, the
/// first request completes through it at once, and every waiter gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_duplicates_hold_no_connection_while_they_wait() {
    use idempotent_runtime::Idempotency;
    use idempotent_runtime::config::EndpointConfig;
    use idempotent_runtime::fingerprint::FingerprintInput;
    use idempotent_runtime::key::IdempotencyKey;
    use idempotent_runtime::scope::{Identity, Scope};
    use idempotent_runtime::test_helpers::pipeline::{Begin, BeginRequest, begin, effective};

    let Some(db) = TestDb::new().await else {
        return;
    };
    let store = db
        .builder()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let pool = store.pool().clone();
    let handle = Idempotency::new(store);
    let waits = EndpointConfig::REQUIRED.wait_in_progress(Duration::from_secs(20));
    let endpoint = Arc::new(effective(&waits, handle.config()));
    let scope = Arc::new(Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap());
    let key = IdempotencyKey::new("waited").unwrap();
    let begin_one = {
        let (handle, endpoint, scope, key) = (handle.clone(), endpoint.clone(), scope.clone(), key);
        move || {
            let (handle, endpoint, scope, key) =
                (handle.clone(), endpoint.clone(), scope.clone(), key.clone());
            async move {
                let req = BeginRequest {
                    key: &key,
                    input: FingerprintInput {
                        method: "POST",
                        route: Some("/orders"),
                        path_params: &[],
                        query: None,
                        scope: &scope,
                        content_type: Some(b"application/json"),
                        body: b"{}",
                    },
                    endpoint: &endpoint,
                };
                begin(&handle, &req).await
            }
        }
    };
    let Begin::Run(mut first) = begin_one().await else {
        panic!("the first request claims the key")
    };
    let waiters: Vec<_> = (0..8).map(|_| tokio::spawn(begin_one())).collect();

    // While they wait: the one connection is checked out only for a poll's statement.
    let mut samples = Vec::new();
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        samples.push(pool.size() as usize - pool.num_idle());
    }
    let free = samples.iter().filter(|&&in_use| in_use == 0).count();
    assert!(
        free * 4 >= samples.len() * 3,
        "connections in use while waiting: {samples:?}"
    );
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "they are still waiting"
    );

    // The first completes through that connection at once, and every waiter replays it.
    let response = RecordedResponse::new(201, vec![], bytes::Bytes::from_static(b"created"));
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), first.complete(&response))
        .await
        .expect("the completion is not starved of a connection");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    for waiter in waiters {
        match waiter.await.unwrap() {
            Begin::Replay(recorded) => assert_eq!(recorded.status, 201),
            _ => panic!("a waiter is answered with the replay"),
        }
    }
}
