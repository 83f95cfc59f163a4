//! The SQLite store against real database files (DESIGN.md §3, §5).
//!
//! ```text
//! cargo test --all-features -p idempotent-runtime --test store_sqlite
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::clock::ManualClock;
use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::sqlite::SqliteStore;
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, StandingState, Store, contract,
};
use idempotent_runtime::test_helpers::record::{self, Verdict};

/// A database file of its own, removed (with its WAL files) when the test ends.
struct TempDb(PathBuf);

impl TempDb {
    fn new() -> Self {
        Self(std::env::temp_dir().join(format!(
            "idempotent-test-{:016x}.db",
            FencingToken::mint().0
        )))
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
    let db = TempDb::new();
    let clock = ManualClock::new();
    let store = SqliteStore::builder()
        .clock(clock.clone())
        .open(&db.0)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    contract::run(Arc::new(store), move |d| clock.advance(d)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_keeps_its_own_version_table() {
    let db = TempDb::new();
    let a = SqliteStore::builder()
        .table("records")
        .open(&db.0)
        .await
        .unwrap();
    let b = SqliteStore::builder()
        .table("records")
        .open(&db.0)
        .await
        .unwrap();
    let (ra, rb) = tokio::join!(a.migrate(), b.migrate());
    ra.expect("migrate from one process");
    rb.expect("migrate from another at once");
    a.migrate().await.expect("migrate again");
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(a.writer())
            .await
            .unwrap();
    assert_eq!(tables, ["records", "records_migrations"]);
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM records_migrations")
        .fetch_one(a.writer())
        .await
        .unwrap();
    assert_eq!(versions, 3);
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(a.writer())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    assert_eq!(
        b.claim(&req(&scope, "k", Duration::from_secs(5)))
            .await
            .unwrap(),
        Claim::Acquired
    );
    assert!(
        matches!(
            a.claim(&req(&scope, "k", Duration::from_secs(5)))
                .await
                .unwrap(),
            Claim::Standing(_)
        ),
        "two stores on one file share its records"
    );
}

#[tokio::test]
async fn invalid_table_names_are_refused() {
    let db = TempDb::new();
    for bad in ["bad name", "x;drop", "1x"] {
        let err = SqliteStore::builder()
            .table(bad)
            .open(&db.0)
            .await
            .expect_err("invalid identifier accepted");
        assert!(err.to_string().contains("must be"), "{err}");
    }
}

#[tokio::test]
async fn first_request_costs_two_statements_and_a_replay_one() {
    let db = TempDb::new();
    let store = SqliteStore::open(&db.0).await.unwrap();
    store.migrate().await.unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let same = |f: &Fingerprint| *f == fp(1);

    let before = store.statements_executed();
    let first = req(&scope, "order-1", Duration::from_secs(30));
    assert_eq!(
        record::claim(&store, &first, same).await.unwrap(),
        Verdict::Acquired { reclaimed: false }
    );
    assert_eq!(
        store.statements_executed() - before,
        2,
        "a first claim is the optimistic read plus the insert"
    );
    assert!(
        store
            .complete(
                &scope,
                "order-1",
                first.token,
                &response("{}"),
                Duration::from_secs(60)
            )
            .await
            .unwrap()
    );
    let before = store.statements_executed();
    assert_eq!(
        record::claim(
            &store,
            &req(&scope, "order-1", Duration::from_secs(30)),
            same
        )
        .await
        .unwrap(),
        Verdict::Replay(Arc::new(response("{}")))
    );
    assert_eq!(
        store.statements_executed() - before,
        1,
        "a replay is one statement"
    );
}

#[tokio::test]
async fn recorded_responses_round_trip_byte_for_byte() {
    let db = TempDb::new();
    let store = SqliteStore::open(&db.0).await.unwrap();
    store.migrate().await.unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let r = req(&scope, "k", Duration::from_secs(30));
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
    let recorded = RecordedResponse::new(
        409,
        vec![
            ("content-type".into(), "application/octet-stream".into()),
            ("etag".into(), "".into()),
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
        Claim::Standing(st) => assert_eq!(st.state, StandingState::Completed(Arc::new(recorded))),
        Claim::Acquired => panic!("completed key acquired"),
    }
}

#[tokio::test]
async fn records_survive_reopening_the_file() {
    let db = TempDb::new();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let token = {
        let store = SqliteStore::open(&db.0).await.unwrap();
        store.migrate().await.unwrap();
        let r = req(&scope, "k", Duration::from_secs(30));
        assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
        assert!(
            store
                .complete(
                    &scope,
                    "k",
                    r.token,
                    &response("kept"),
                    Duration::from_secs(60)
                )
                .await
                .unwrap()
        );
        store.writer().close().await;
        r.token
    };
    let store = SqliteStore::open(&db.0).await.unwrap();
    store.migrate().await.unwrap();
    match store
        .claim(&req(&scope, "k", Duration::from_secs(30)))
        .await
        .unwrap()
    {
        Claim::Standing(st) => {
            assert_eq!(st.token, token);
            assert_eq!(
                st.state,
                StandingState::Completed(Arc::new(response("kept")))
            );
        }
        Claim::Acquired => panic!("a completed record was lost on reopening"),
    }
}

#[tokio::test]
async fn migrating_a_version_1_table_keeps_its_records_and_inspects_them_without_a_route() {
    let db = TempDb::new();
    let store = SqliteStore::open(&db.0).await.unwrap();
    // The table as version 1 of the crate left it, with one completed record.
    let v1 = include_str!("../migrations/sqlite/0001_create_records.sql")
        .replace("{table}", "\"idempotency_records\"")
        .replace("{name}", "idempotency_records");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{v1}; CREATE TABLE idempotency_records_migrations (version INTEGER PRIMARY KEY, \
         description TEXT NOT NULL, applied_at INTEGER NOT NULL); \
         INSERT INTO idempotency_records_migrations VALUES (1, 'create records', 0);"
    )))
    .execute(store.writer())
    .await
    .unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let far = i64::MAX / 2;
    sqlx::query(
        "INSERT INTO idempotency_records (scope, key, token, fingerprint, fp_version, state, \
         lease_until, expires_at, status, headers, body) VALUES (?1, 'old', 7, ?2, 1, 1, 0, ?3, 200, x'', x'6f6b')",
    )
    .bind(&scope[..])
    .bind(&fp(1).digest[..])
    .bind(far)
    .execute(store.writer())
    .await
    .unwrap();
    store.migrate().await.expect("upgrade from version 1");
    let info = store
        .inspect(&scope, "old", true)
        .await
        .unwrap()
        .expect("the old record survives the upgrade");
    assert_eq!(
        info.state,
        idempotent_runtime::store::RecordState::Completed
    );
    assert_eq!(
        (info.route, info.created_at),
        (None, None),
        "unknown for old rows"
    );
    assert_eq!(info.response.unwrap().body, "ok");
    match store
        .claim(&req(&scope, "old", Duration::from_secs(5)))
        .await
        .unwrap()
    {
        Claim::Standing(st) => assert!(matches!(st.state, StandingState::Completed(_))),
        Claim::Acquired => panic!("the old record was lost"),
    }
}
