//! Enlisted mode behind PgBouncer in transaction pooling mode (`scripts/pgbouncer start`), over
//! real HTTP on an in-test axum server whose store is built with `transaction_pooler(true)`:
//! the record commits with the handler's writes or neither remains, a swallowed database error
//! is 500 with nothing written, and a duplicate meets the transaction-scoped try-lock (409 at
//! once, never a wait) although every transaction may run on another server connection.
//!
//! The handler's own statements are unnamed (`.persistent(false)`), as they must be behind such
//! a pooler. Reads `PGBOUNCER_URL` and `DATABASE_URL` (a database of the test's own, made
//! directly and reached through the pooler); without them each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_PGBOUNCER=1` / `IDEMPOTENT_REQUIRE_DB=1`, when it fails.
//!
//! ```text
//! PGBOUNCER_URL=$(scripts/pgbouncer start) DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test enlisted pgbouncer::
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::{Idempotency, IdempotencyContext};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::support::PooledDatabase;

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
    /// Handler runs per key.
    runs: Arc<Mutex<HashMap<String, u32>>>,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    item: String,
    /// How the first run of this key ends: `error` (the handler fails after writing),
    /// `swallow` (a failed statement's error ignored, then 201), `hold` (1.5 s with the
    /// transaction open, then 201).
    #[serde(default)]
    first_run: Option<String>,
}

#[idempotent_runtime::axum::idempotent(require_key, enlisted)]
async fn create_order(
    State(state): State<AppState>,
    context: IdempotencyContext,
    tx: &mut EnlistedTx,
    Json(new): Json<NewOrder>,
) -> Response {
    let key = context.key().as_str().to_owned();
    let run = {
        let mut runs = state.runs.lock().expect("runs");
        let n = runs.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    sqlx::query("INSERT INTO orders (key, item) VALUES ($1, $2)")
        .bind(&key)
        .bind(&new.item)
        .persistent(false)
        .execute(tx.conn())
        .await
        .expect("insert through PgBouncer");
    match (run, new.first_run.as_deref()) {
        (1, Some("error")) => {
            return (StatusCode::SERVICE_UNAVAILABLE, "failed after writing").into_response();
        }
        (1, Some("swallow")) => {
            let _ = sqlx::query("SELECT 1 / 0")
                .persistent(false)
                .execute(tx.conn())
                .await;
        }
        (1, Some("hold")) => tokio::time::sleep(Duration::from_millis(1500)).await,
        _ => {}
    }
    (
        StatusCode::CREATED,
        Json(json!({ "key": key, "item": new.item, "run": run })),
    )
        .into_response()
}

struct TestServer {
    url: String,
    runs: Arc<Mutex<HashMap<String, u32>>>,
    client: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
    /// On a direct connection, for the test's checks.
    direct: PgPool,
    _db: PooledDatabase,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The server over a store behind PgBouncer; `None` when the test skips.
async fn serve(prefix: &str) -> Option<TestServer> {
    let db = PooledDatabase::new(prefix)?;
    let direct = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&db.direct_url())
        .await
        .expect("connect directly");
    sqlx::raw_sql("CREATE TABLE orders (id bigserial PRIMARY KEY, key text NOT NULL, item text)")
        .execute(&direct)
        .await
        .expect("create the orders table");
    // A claim that waited on the first request's row lock would show as a minute's wait.
    let store = PostgresStore::builder()
        .transaction_pooler(true)
        .lock_timeout(Duration::from_secs(60))
        .connect(&db.url())
        .await
        .expect("connect through PgBouncer");
    store.migrate().await.expect("migrate through PgBouncer");
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let state = AppState {
        idempotency: Idempotency::new(store),
        runs: Arc::clone(&runs),
    };
    let app = Router::new()
        .route("/orders", post(create_order))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/orders", listener.local_addr().expect("address"));
    let task = tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await;
    });
    Some(TestServer {
        url,
        runs,
        client: reqwest::Client::new(),
        task,
        direct,
        _db: db,
    })
}

#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    body: Value,
}

impl TestServer {
    async fn order(&self, key: &str, body: &Value) -> Answer {
        let response = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(body.to_string())
            .send()
            .await
            .expect("send");
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotency-replayed")
            .is_some_and(|v| v == "true");
        let text = response.text().await.expect("body");
        Answer {
            status,
            replayed,
            body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        }
    }

    fn runs(&self, key: &str) -> u32 {
        self.runs
            .lock()
            .expect("runs")
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    /// (orders, completed records) of `key`, read directly.
    async fn rows(&self, key: &str) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM orders WHERE key = $1), \
                    (SELECT count(*) FROM idempotency_records WHERE key = $1 AND state = 1)",
        )
        .bind(key)
        .fetch_one(&self.direct)
        .await
        .expect("count rows")
    }
}

/// A handler failing after its write rolls the write and the reservation back; the retry runs
/// and commits both; the next copy replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_the_record_commits_with_the_writes_or_neither_remains() {
    let Some(server) = serve("pgb_enlisted_commit").await else {
        return;
    };
    let body = json!({ "item": "book", "first_run": "error" });
    let failed = server.order("k-error", &body).await;
    assert_eq!(failed.status, 503, "{failed:?}");
    assert_eq!(
        server.rows("k-error").await,
        (0, 0),
        "the rollback left rows"
    );

    let retry = server.order("k-error", &body).await;
    assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
    assert_eq!(retry.body["run"], 2);
    assert_eq!(server.rows("k-error").await, (1, 1));

    let replay = server.order("k-error", &body).await;
    assert_eq!((replay.status, replay.replayed), (201, true), "{replay:?}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(server.runs("k-error"), 2);
    assert_eq!(server.rows("k-error").await, (1, 1));
}

/// A handler that swallows a failed statement's error and answers 201: the aborted transaction
/// is found before the commit (whose COMMIT would silently roll back) and answered 500, with
/// nothing written; the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_a_swallowed_database_error_is_500_with_nothing_written() {
    let Some(server) = serve("pgb_enlisted_swallow").await else {
        return;
    };
    let body = json!({ "item": "book", "first_run": "swallow" });
    let failed = server.order("k-swallow", &body).await;
    assert_eq!(failed.status, 500, "{failed:?}");
    assert_eq!(server.rows("k-swallow").await, (0, 0));
    let retry = server.order("k-swallow", &body).await;
    assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
    assert_eq!(server.rows("k-swallow").await, (1, 1));
}

/// While the first request's transaction is open (1.5 s), duplicates answer 409 at once — the
/// key's transaction-scoped try-lock, seen from other server connections — not after a lock
/// wait (the store's `lock_timeout` is 60 s); once it commits, the copy replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_a_duplicate_during_the_open_transaction_is_409_at_once() {
    let Some(server) = serve("pgb_enlisted_dup").await else {
        return;
    };
    let server = Arc::new(server);
    let body = json!({ "item": "book", "first_run": "hold" });
    let first = {
        let (server, body) = (Arc::clone(&server), body.clone());
        tokio::spawn(async move { server.order("k-open", &body).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.runs("k-open") == 0 {
        assert!(Instant::now() < deadline, "the first request never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = Instant::now();
    let duplicate = server.order("k-open", &body).await;
    let took = started.elapsed();
    assert_eq!(duplicate.status, 409, "{duplicate:?}");
    assert_eq!(duplicate.body["code"], "IDEMPOTENCY_IN_PROGRESS");
    assert!(
        took < Duration::from_millis(1200),
        "the duplicate took {took:?}: did it wait on the open transaction?"
    );
    let first = first.await.expect("first");
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    let replay = server.order("k-open", &body).await;
    assert_eq!((replay.status, replay.replayed), (201, true), "{replay:?}");
    assert_eq!(server.runs("k-open"), 1);
    assert_eq!(server.rows("k-open").await, (1, 1));
}
