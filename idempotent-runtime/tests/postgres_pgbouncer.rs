//! The PostgreSQL store, its migration runner and the inbox behind PgBouncer in transaction
//! pooling mode (Debian's 1.18, as `scripts/pgbouncer start` runs it): each transaction may get
//! another server connection, so nothing may stay on one past its transaction — no named
//! prepared statement, no session setting.
//!
//! Reads `PGBOUNCER_URL` (the pooler) and `DATABASE_URL` (the same server, directly, for the
//! schema and the checks); without them each test says so and skips, unless
//! `IDEMPOTENT_REQUIRE_PGBOUNCER=1` / `IDEMPOTENT_REQUIRE_DB=1`, when it fails.
//!
//! ```text
//! PGBOUNCER_URL=$(scripts/pgbouncer start) DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test -p idempotent-runtime --features postgres,testing --test postgres_pgbouncer
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::inbox::{BoxFuture, PostgresInbox, Processed};
use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::postgres::{PostgresStore, PostgresStoreBuilder};
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, StandingState, Store, contract,
};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection};

mod support;

/// A schema of the test's own, made and dropped on a direct connection; the code under test
/// reaches it through PgBouncer.
struct Behind {
    direct: String,
    pooled: String,
    schema: String,
    admin: PgPool,
}

impl Behind {
    async fn new() -> Option<Self> {
        let pooled = support::pgbouncer_url()?;
        let direct = support::database_url()?;
        let schema = format!("idem_pgb_{:016x}", FencingToken::mint().0);
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect(&direct)
            .await
            .expect("connect to DATABASE_URL");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
            .execute(&admin)
            .await
            .expect("create schema");
        Some(Self {
            direct,
            pooled,
            schema,
            admin,
        })
    }

    fn builder(&self) -> PostgresStoreBuilder {
        PostgresStore::builder()
            .schema(&self.schema)
            .table("records")
            .transaction_pooler(true)
    }

    async fn store(&self) -> PostgresStore {
        let store = self
            .builder()
            .connect(&self.pooled)
            .await
            .expect("connect through PgBouncer");
        store.migrate().await.expect("migrate through PgBouncer");
        store
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

impl Drop for Behind {
    fn drop(&mut self) {
        let url = self.direct.clone();
        let sql = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.schema);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                if let Ok(mut conn) = PgConnection::connect(&url).await {
                    let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut conn).await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}

fn req<'a>(scope: &'a ScopeHash, key: &'a str, token: FencingToken) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        quota_bucket: 0,
        fingerprint: Fingerprint {
            version: 1,
            digest: [7; 32],
        },
        token,
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
        route: "/pgbouncer",
        response_room: 0,
    }
}

/// Without the setting, the store sends `lock_timeout` as a session setting when connecting;
/// PgBouncer (told by `scripts/pgbouncer` to ignore the `options` startup parameter, as managed
/// poolers do) drops it, and claims would wait on other transactions' rows without bound.
/// `migrate()` notices before anything is created and names the fix.
#[tokio::test]
async fn the_default_store_behind_a_transaction_pooler_is_refused_at_migrate_naming_the_fix() {
    let Some(db) = Behind::new().await else {
        return;
    };
    let store = PostgresStore::builder()
        .schema(&db.schema)
        .table("records")
        .connect(&db.pooled)
        .await
        .expect("the pool connects lazily");
    let error = store
        .migrate()
        .await
        .expect_err("migrate ran behind a transaction pooler without the setting");
    let message = error.to_string();
    assert!(
        matches!(error, sqlx::Error::Configuration(_)),
        "not a configuration error: {error:?}"
    );
    // PgBouncer told to refuse the `options` startup parameter instead fails the first
    // statement; that refusal names the fix too.
    assert!(
        message.contains("transaction_pooler(true)")
            && (message.contains("lock_timeout")
                || message.contains("unsupported startup parameter")),
        "the refusal does not name the fix: {message}"
    );
    let created = db
        .scalar(&format!(
            "SELECT count(*) FROM pg_tables WHERE schemaname = '{}'",
            db.schema
        ))
        .await;
    assert_eq!(created, 0, "migrate created tables before refusing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_store_contract_behind_pgbouncer() {
    let Some(db) = Behind::new().await else {
        return;
    };
    let store = Arc::new(db.store().await);
    let clock = Arc::clone(&store);
    contract::run(store, move |d| clock.advance_clock_for_tests(d)).await;
}

/// Four replicas migrating at once through the pooler queue on the migration's
/// transaction-scoped advisory lock: each succeeds, every version is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_migrating_at_once_behind_pgbouncer_apply_each_version_once() {
    let Some(db) = Behind::new().await else {
        return;
    };
    let mut migrations = Vec::new();
    for _ in 0..4 {
        let store = db
            .builder()
            .connect(&db.pooled)
            .await
            .expect("connect through PgBouncer");
        migrations.push(tokio::spawn(async move { store.migrate().await }));
    }
    for migration in migrations {
        migration.await.unwrap().expect("migrate through PgBouncer");
    }
    let applied = db
        .scalar(&format!(
            "SELECT count(*) FROM \"{}\".records_migrations",
            db.schema
        ))
        .await;
    let shipped = PostgresStore::migrations(None, "records")
        .unwrap()
        .into_iter()
        .count();
    assert_eq!(applied as usize, shipped);
}

/// Two replicas (two pools of 8 through one PgBouncer, whose server connections they share
/// transaction by transaction), 200 keys each claimed 8 times at once across both: each key is
/// acquired exactly once, its holder completes it, and every claim afterwards replays it. A
/// named prepared statement would meet another client's on a shared server connection (42P05);
/// an unnamed one parsed outside a transaction could be executed on another server connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_claiming_the_same_keys_through_pgbouncer_acquire_each_once() {
    let Some(db) = Behind::new().await else {
        return;
    };
    // One request a statement (no group commit), so up to 16 client connections are busy at
    // once and PgBouncer hands each transaction whichever server connection is free.
    // A claim waits for a pool connection as long as the flood needs: the other tests of this
    // binary share PgBouncer's server connections (one holds a transaction open on purpose),
    // and the store's 2 s fail-fast default would turn that queue into 503s, which is not what
    // this test is about.
    let replica = || {
        db.builder()
            .max_connections(8)
            .batch_rows(1)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&db.pooled)
    };
    let first = Arc::new(replica().await.unwrap());
    first.migrate().await.expect("migrate through PgBouncer");
    let second = Arc::new(replica().await.unwrap());
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let acquired: Arc<std::sync::Mutex<HashMap<String, usize>>> = Arc::default();
    let mut claims = Vec::new();
    for copy in 0..8 {
        for n in 0..200 {
            let store = if copy % 2 == 0 {
                Arc::clone(&first)
            } else {
                Arc::clone(&second)
            };
            let acquired = Arc::clone(&acquired);
            claims.push(tokio::spawn(async move {
                let key = format!("key-{n}");
                let token = FencingToken::mint();
                match store.claim(&req(&scope, &key, token)).await {
                    Ok(Claim::Acquired) => {
                        *acquired.lock().unwrap().entry(key.clone()).or_default() += 1;
                        let done = store
                            .complete(
                                &scope,
                                &key,
                                token,
                                &RecordedResponse::new(201, vec![], key.clone().into()),
                                Duration::from_secs(3600),
                            )
                            .await
                            .expect("complete through PgBouncer");
                        assert!(done, "{key}: the holder's completion was refused");
                    }
                    Ok(Claim::Standing(_)) => {}
                    Err(e) => panic!("{key}: claim through PgBouncer failed: {e}"),
                }
            }));
        }
    }
    for claim in claims {
        claim.await.unwrap();
    }
    let acquired = acquired.lock().unwrap().clone();
    assert_eq!(acquired.len(), 200, "keys never acquired");
    assert!(
        acquired.values().all(|&n| n == 1),
        "a key acquired twice: {:?}",
        acquired.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    for n in 0..200 {
        let key = format!("key-{n}");
        let store = if n % 2 == 0 { &first } else { &second };
        match store
            .claim(&req(&scope, &key, FencingToken::mint()))
            .await
            .unwrap()
        {
            Claim::Standing(standing) => match standing.state {
                StandingState::Completed(response) => {
                    assert_eq!((response.status, &response.body[..]), (201, key.as_bytes()))
                }
                other => panic!("{key}: not completed: {other:?}"),
            },
            Claim::Acquired => panic!("{key}: acquired again after completion"),
        }
    }
    // What the store left on the server connections: hold 8 transactions at once, so each is
    // on a server connection of its own, and look on each for a prepared statement of this
    // test's table or a setting that outlived its transaction.
    let mut held = Vec::new();
    for _ in 0..8 {
        let mut conn = PgConnection::connect(&db.pooled).await.unwrap();
        sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
        let row: (String, String, String) = sqlx::query_as(
            "SELECT (SELECT coalesce(string_agg(name || ': ' || statement, '; '), '') \
                     FROM pg_prepared_statements WHERE strpos(statement, $1) > 0), \
                    current_setting('lock_timeout'), current_setting('statement_timeout')",
        )
        .bind(&db.schema)
        .persistent(false)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            row,
            (String::new(), "0".to_owned(), "0".to_owned()),
            "a server connection kept the store's state past its transaction"
        );
        held.push(conn);
    }
}

/// `lock_timeout` still bounds a claim's wait behind the pooler (it is `SET LOCAL` in each of
/// the store's transactions): a claim meeting another transaction's uncommitted row for its key
/// answers "in progress" after the store's 200 ms, not when that transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_meeting_an_uncommitted_row_behind_pgbouncer_answers_within_the_lock_timeout() {
    let Some(db) = Behind::new().await else {
        return;
    };
    let store = db
        .builder()
        .lock_timeout(Duration::from_millis(200))
        .connect(&db.pooled)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let mut holder = db.admin.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".records (scope, key, token, fingerprint, fp_version, state, \
         lease_until, expires_at) VALUES ($1, 'held', 7, $2, 1, 0, now() + interval '1 minute', \
         now() + interval '1 hour')",
        db.schema
    )))
    .bind(&scope[..])
    .bind(&[7u8; 32][..])
    .execute(&mut *holder)
    .await
    .unwrap();
    let started = Instant::now();
    let claim = tokio::time::timeout(
        Duration::from_secs(10),
        store.claim(&req(&scope, "held", FencingToken::mint())),
    )
    .await
    .expect("the claim waited for the other transaction: lock_timeout did not apply")
    .unwrap();
    let waited = started.elapsed();
    match claim {
        Claim::Standing(standing) => assert!(
            matches!(standing.state, StandingState::Running { .. }),
            "{standing:?}"
        ),
        Claim::Acquired => panic!("acquired a key another transaction holds"),
    }
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(3),
        "answered after {waited:?}, not after the 200 ms lock_timeout"
    );
    holder.rollback().await.unwrap();
    assert_eq!(
        store
            .claim(&req(&scope, "held", FencingToken::mint()))
            .await
            .unwrap(),
        Claim::Acquired
    );
}

/// The inbox through the pooler: 100 messages each delivered 4 times at once run their handler
/// once each (a handler writing through the transaction with unnamed statements), the other
/// copies are duplicates, and the sweep runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inbox_behind_pgbouncer_runs_each_message_once() {
    let Some(db) = Behind::new().await else {
        return;
    };
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{}\".effects (message_id text NOT NULL)",
        db.schema
    )))
    .execute(&db.admin)
    .await
    .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(12)
        .connect(&db.pooled)
        .await
        .expect("connect through PgBouncer");
    let inbox = PostgresInbox::builder(pool, "billing")
        .schema(&db.schema)
        .transaction_pooler(true)
        .build()
        .unwrap();
    inbox
        .migrate()
        .await
        .expect("migrate the inbox through PgBouncer");
    let runs = Arc::new(AtomicUsize::new(0));
    let duplicates = Arc::new(AtomicUsize::new(0));
    let mut copies = Vec::new();
    for _copy in 0..4 {
        for n in 0..100 {
            let (inbox, runs, duplicates) =
                (inbox.clone(), Arc::clone(&runs), Arc::clone(&duplicates));
            let insert = format!(
                "INSERT INTO \"{}\".effects (message_id) VALUES ($1)",
                db.schema
            );
            copies.push(tokio::spawn(async move {
                let id = format!("message-{n}");
                let handler_id = id.clone();
                let outcome = inbox
                    .process(
                        &id,
                        move |conn: &mut PgConnection| -> BoxFuture<'_, Result<(), sqlx::Error>> {
                            Box::pin(async move {
                                sqlx::query(AssertSqlSafe(insert))
                                    .bind(handler_id)
                                    .persistent(false)
                                    .execute(&mut *conn)
                                    .await?;
                                Ok(())
                            })
                        },
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{id}: {e}"));
                match outcome {
                    Processed::Done(()) => runs.fetch_add(1, Ordering::SeqCst),
                    Processed::Duplicate => duplicates.fetch_add(1, Ordering::SeqCst),
                    Processed::Busy => panic!("{id}: busy within a 5 s lock_timeout"),
                };
            }));
        }
    }
    for copy in copies {
        copy.await.unwrap();
    }
    assert_eq!(runs.load(Ordering::SeqCst), 100);
    assert_eq!(duplicates.load(Ordering::SeqCst), 300);
    let effects = db
        .scalar(&format!(
            "SELECT count(DISTINCT message_id) * 1000 + count(*) FROM \"{}\".effects",
            db.schema
        ))
        .await;
    assert_eq!(
        effects,
        100 * 1000 + 100,
        "an effect missing or written twice"
    );
    assert_eq!(inbox.sweep(500).await.expect("sweep through PgBouncer"), 0);
}

/// What `transaction_pooler(true)` costs a replay (one claim reading a completed record back):
/// 2,000 replays one after another, on the default store directly, on the pooler setting
/// directly, and on the pooler setting through PgBouncer; each must replay. Prints the mean of
/// each. Run explicitly to measure:
/// `cargo test --release -p idempotent-runtime --features postgres,testing --test
/// postgres_pgbouncer -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run explicitly"]
async fn what_the_setting_costs_a_replay() {
    let Some(db) = Behind::new().await else {
        return;
    };
    db.store().await;
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let stores = [
        (
            "default, direct",
            PostgresStore::builder()
                .schema(&db.schema)
                .table("records")
                .connect(&db.direct)
                .await
                .unwrap(),
        ),
        (
            "transaction_pooler, direct",
            db.builder().connect(&db.direct).await.unwrap(),
        ),
        (
            "transaction_pooler, through PgBouncer",
            db.builder().connect(&db.pooled).await.unwrap(),
        ),
    ];
    let token = FencingToken::mint();
    let (first, _) = &stores[0];
    assert_eq!(
        stores[0]
            .1
            .claim(&req(&scope, "replayed", token))
            .await
            .unwrap(),
        Claim::Acquired,
        "{first}"
    );
    assert!(
        stores[0]
            .1
            .complete(
                &scope,
                "replayed",
                token,
                &RecordedResponse::new(201, vec![], "done".into()),
                Duration::from_secs(3600),
            )
            .await
            .unwrap()
    );
    for (name, store) in &stores {
        let mut started = Instant::now();
        for n in 0..2_100 {
            if n == 100 {
                // The first hundred open the pool's connections and prepare the statements.
                started = Instant::now();
            }
            let claim = store
                .claim(&req(&scope, "replayed", FencingToken::mint()))
                .await
                .unwrap();
            match claim {
                Claim::Standing(standing) => {
                    assert!(matches!(standing.state, StandingState::Completed(_)))
                }
                Claim::Acquired => panic!("{name}: acquired a completed key"),
            }
        }
        eprintln!(
            "{name}: {:?} a replay (mean of 2,000, one at a time)",
            started.elapsed() / 2_000
        );
    }
}
