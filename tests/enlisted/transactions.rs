//! Enlisted mode over real HTTP (DESIGN.md §5, #6): the recorded response commits with the
//! handler's own writes, or neither remains.
//!
//! In-test axum and actix-web servers, and the `orders_enlisted` example as a subprocess for
//! the SIGKILL case. Reads `DATABASE_URL`; when it is unset each test says so and passes,
//! unless `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Each test works in a schema of its own.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features -p idempotent-examples --test enlisted transactions:: -- --nocapture
//! ```

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::Schema;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::test_helpers::store::Forwarding;
use idempotent_runtime::{Idempotency, IdempotencyContext};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::sync::{Notify, mpsc};

// ---------------------------------------------------------------------------------------------
// A schema of its own.

/// A pool on a test's own schema, for the test's own checks outside the server.
async fn checking_pool(schema: &Schema) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&schema.url())
        .await
        .expect("connect the checking pool")
}

const TABLES: &str = "
    CREATE TABLE IF NOT EXISTS orders (
        id bigserial PRIMARY KEY, key text NOT NULL, item text NOT NULL);";

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("count query")
}

async fn rows_for(pool: &PgPool, key: &str) -> (i64, i64) {
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .expect("count orders");
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE key = $1")
            .bind(key)
            .fetch_one(pool)
            .await
            .expect("count records");
    (orders, records)
}

// ---------------------------------------------------------------------------------------------
// The in-test axum server.

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
    /// How long the handler holds its transaction after writing.
    hold: Duration,
    /// Handler runs per key.
    runs: Arc<Mutex<HashMap<String, u32>>>,
    /// The backend pid of a `wait`/`kill` request, sent once it has written.
    pids: mpsc::UnboundedSender<i32>,
    /// Lets a `wait`/`kill` request answer.
    gate: Arc<Notify>,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[derive(Deserialize)]
struct NewOrder {
    item: String,
    /// How the first run of this key ends: `status500`, `error`, `panic`, `big`,
    /// `not_replayable`, or `wait` (publish the backend pid, wait for the gate, answer 201).
    #[serde(default)]
    first_run: Option<String>,
}

struct HandlerError;

impl IntoResponse for HandlerError {
    fn into_response(self) -> Response {
        (StatusCode::SERVICE_UNAVAILABLE, "the handler failed").into_response()
    }
}

#[idempotent_runtime::axum::idempotent(require_key, enlisted, max_response = "4KiB")]
async fn create_order(
    State(state): State<AppState>,
    context: IdempotencyContext,
    tx: &mut EnlistedTx,
    Json(new): Json<NewOrder>,
) -> Result<Response, HandlerError> {
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
        .execute(tx.conn())
        .await
        .map_err(|_| HandlerError)?;
    if !state.hold.is_zero() {
        tokio::time::sleep(state.hold).await;
    }
    let ending = if run == 1 {
        new.first_run.as_deref()
    } else {
        None
    };
    match ending {
        Some("status500") => {
            return Ok((StatusCode::INTERNAL_SERVER_ERROR, "failed after writing").into_response());
        }
        Some("error") => return Err(HandlerError),
        Some("panic") => panic!("the handler panics after writing, on purpose"),
        Some("big") => return Ok((StatusCode::CREATED, "x".repeat(8192)).into_response()),
        Some("not_replayable") => {
            return Ok((StatusCode::TOO_MANY_REQUESTS, "slow down").into_response());
        }
        Some("wait") => {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(tx.conn())
                .await
                .map_err(|_| HandlerError)?;
            let _ = state.pids.send(pid);
            state.gate.notified().await;
        }
        _ => {}
    }
    let body = json!({ "key": key, "item": new.item, "run": run });
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// A receipt too large to keep (8 KiB over a 4 KiB cap), on an endpoint that records it without
/// its body rather than running the charge again.
#[idempotent_runtime::axum::idempotent(
    require_key,
    enlisted,
    max_response = "4KiB",
    oversized = "record_without_body"
)]
async fn create_receipt(
    State(state): State<AppState>,
    context: IdempotencyContext,
    tx: &mut EnlistedTx,
    Json(new): Json<NewOrder>,
) -> Result<Response, HandlerError> {
    let key = context.key().as_str().to_owned();
    *state
        .runs
        .lock()
        .expect("runs")
        .entry(key.clone())
        .or_default() += 1;
    sqlx::query("INSERT INTO orders (key, item) VALUES ($1, $2)")
        .bind(&key)
        .bind(&new.item)
        .execute(tx.conn())
        .await
        .map_err(|_| HandlerError)?;
    let location = [(axum::http::header::LOCATION, format!("/orders/{key}"))];
    Ok((StatusCode::CREATED, location, "r".repeat(8192)).into_response())
}

/// The key is optional here: a keyless request still runs in a transaction.
#[idempotent_runtime::axum::idempotent(enlisted)]
async fn loose_order(tx: &mut EnlistedTx, Json(new): Json<NewOrder>) -> Response {
    let inserted = sqlx::query("INSERT INTO orders (key, item) VALUES ('', $1)")
        .bind(&new.item)
        .execute(tx.conn())
        .await;
    match (inserted, new.first_run.as_deref()) {
        (Err(_), _) | (_, Some("status500")) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        _ => StatusCode::CREATED.into_response(),
    }
}

struct TestServer {
    url: String,
    runs: Arc<Mutex<HashMap<String, u32>>>,
    pids: mpsc::UnboundedReceiver<i32>,
    gate: Arc<Notify>,
    client: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn postgres_store(schema: &Schema, connections: u32) -> PostgresStore {
    let store = PostgresStore::builder()
        .max_connections(connections)
        .connect(&schema.url())
        .await
        .expect("connect the store");
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(TABLES)
        .execute(store.pool())
        .await
        .expect("create the orders table");
    store
}

/// A store whose connections would wait a minute on a row lock (the default is 1 s): the
/// duplicate tests use it, so that a claim that waited on the first request's lock instead of
/// trying it would show as a wait, not as a quick 409 after the default `lock_timeout`.
async fn patient_store(schema: &Schema, connections: u32) -> PostgresStore {
    let store = PostgresStore::builder()
        .max_connections(connections)
        .lock_timeout(Duration::from_secs(60))
        .connect(&schema.url())
        .await
        .expect("connect the store");
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(TABLES)
        .execute(store.pool())
        .await
        .expect("create the orders table");
    store
}

/// The slowest a duplicate may answer 409 while the first transaction stays open (until the
/// test opens its gate): far under the store's 60 s `lock_timeout`, and over the default 1 s one
/// that a lock wait would otherwise end at, with room for a loaded 2-core machine.
const DUPLICATE_BOUND: Duration = Duration::from_secs(2);

async fn serve(idempotency: Idempotency, hold: Duration) -> TestServer {
    let (pids_tx, pids) = mpsc::unbounded_channel();
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let gate = Arc::new(Notify::new());
    let state = AppState {
        idempotency,
        hold,
        runs: Arc::clone(&runs),
        pids: pids_tx,
        gate: Arc::clone(&gate),
    };
    let app = Router::new()
        .route("/orders", post(create_order))
        .route(
            "/loose",
            post(loose_order).put(loose_order).get(loose_order),
        )
        .route("/receipts", post(create_receipt))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let task = tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await;
    });
    TestServer {
        url,
        runs,
        pids,
        gate,
        client: reqwest::Client::new(),
        task,
    }
}

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    replayed: bool,
    body: String,
}

impl Answer {
    fn code(&self) -> Option<String> {
        let v: Value = serde_json::from_str(&self.body).ok()?;
        v["code"].as_str().map(str::to_owned)
    }
}

async fn post_json(client: &reqwest::Client, url: &str, key: Option<&str>, body: &Value) -> Answer {
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let body = response.text().await.expect("body");
    Answer {
        status,
        replayed,
        body,
    }
}

impl TestServer {
    async fn order(&self, key: &str, body: &Value) -> Answer {
        post_json(
            &self.client,
            &format!("{}/orders", self.url),
            Some(key),
            body,
        )
        .await
    }

    fn runs(&self, key: &str) -> u32 {
        self.runs
            .lock()
            .expect("runs")
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

// ---------------------------------------------------------------------------------------------
// Tests.

/// The happy path: one run, the order and the record commit together, the repeat is an
/// identical replay, a different body is 422, and the record is completed in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_request_commits_order_and_record_together_then_replays() {
    let Some(schema) = Schema::new("happy").await else {
        return;
    };
    let server = serve(
        Idempotency::new(postgres_store(&schema, 8).await),
        Duration::ZERO,
    )
    .await;
    let pool = checking_pool(&schema).await;
    let body = json!({ "item": "book" });

    let first = server.order("k-happy", &body).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed);
    assert_eq!(rows_for(&pool, "k-happy").await, (1, 1));
    let state: i16 =
        sqlx::query_scalar("SELECT state FROM idempotency_records WHERE key = 'k-happy'")
            .fetch_one(&pool)
            .await
            .expect("record");
    assert_eq!(state, 1, "the record commits completed, never reserved");

    let again = server.order("k-happy", &body).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.body, first.body);

    let other = server.order("k-happy", &json!({ "item": "pen" })).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.code().as_deref(), Some("IDEMPOTENCY_KEY_REUSED"));

    assert_eq!(server.runs("k-happy"), 1);
    assert_eq!(rows_for(&pool, "k-happy").await, (1, 1));
}

/// A 5xx, a handler error, a panic, a non-replayable status and a response too large to
/// record all roll back: neither the order nor the record remains, and the retry runs and
/// commits both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_roll_back_the_order_and_the_reservation_and_the_retry_runs() {
    let Some(schema) = Schema::new("rollback").await else {
        return;
    };
    let server = serve(
        Idempotency::new(postgres_store(&schema, 8).await),
        Duration::ZERO,
    )
    .await;
    let pool = checking_pool(&schema).await;
    // (how the first run ends, the status it is answered with, the problem code if ours)
    let cases = [
        ("status500", 500, None),
        ("error", 503, None),
        ("panic", 500, Some("IDEMPOTENCY_HANDLER_PANICKED")),
        ("not_replayable", 429, None),
        ("big", 500, Some("IDEMPOTENCY_NOT_RECORDED")),
    ];
    for (ending, status, code) in cases {
        let key = format!("k-{ending}");
        let body = json!({ "item": "book", "first_run": ending });
        let failed = server.order(&key, &body).await;
        assert_eq!(failed.status, status, "{ending}: {failed:?}");
        if code.is_some() {
            assert_eq!(failed.code().as_deref(), code, "{ending}: {failed:?}");
        }
        assert!(!failed.replayed);
        assert_eq!(
            rows_for(&pool, &key).await,
            (0, 0),
            "{ending}: neither the order nor the record may remain"
        );

        let retry = server.order(&key, &body).await;
        assert_eq!(retry.status, 201, "{ending}: the retry runs: {retry:?}");
        assert!(!retry.replayed, "{ending}");
        assert_eq!(server.runs(&key), 2, "{ending}: ran once more");
        assert_eq!(rows_for(&pool, &key).await, (1, 1), "{ending}");

        let replay = server.order(&key, &body).await;
        assert!(replay.replayed, "{ending}: {replay:?}");
        assert_eq!(replay.body, retry.body);
        assert_eq!(server.runs(&key), 2, "{ending}");
    }
}

/// `oversized = "record_without_body"`: an answer over the cap commits with the order as its
/// status and headers alone (not 500 `IDEMPOTENCY_NOT_RECORDED` and a rollback), and the retry
/// replays them with an empty body and `Idempotency-Replay: body-omitted` without running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_answer_commits_without_its_body_and_the_retry_replays_it() {
    let Some(schema) = Schema::new("bodiless").await else {
        return;
    };
    let server = serve(
        Idempotency::new(postgres_store(&schema, 8).await),
        Duration::ZERO,
    )
    .await;
    let pool = checking_pool(&schema).await;
    let url = format!("{}/receipts", server.url);
    let send = || {
        server
            .client
            .post(&url)
            .header("idempotency-key", "k-receipt")
            .header("content-type", "application/json")
            .body(json!({ "item": "charge" }).to_string())
            .send()
    };
    let first = send().await.expect("send");
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotency-replayed").is_none());
    assert_eq!(first.text().await.expect("body"), "r".repeat(8192));
    assert_eq!(
        rows_for(&pool, "k-receipt").await,
        (1, 1),
        "committed together"
    );

    let retry = send().await.expect("send");
    assert_eq!(retry.status(), 201);
    let header = |name| {
        retry
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(header("idempotency-replayed").as_deref(), Some("true"));
    assert_eq!(
        header("idempotency-replay").as_deref(),
        Some("body-omitted")
    );
    assert_eq!(header("location").as_deref(), Some("/orders/k-receipt"));
    assert!(matches!(
        header("content-length").as_deref(),
        None | Some("0")
    ));
    assert_eq!(retry.text().await.expect("body"), "");
    assert_eq!(server.runs("k-receipt"), 1, "the charge ran once");
    assert_eq!(rows_for(&pool, "k-receipt").await, (1, 1));
}

/// The connection dies mid-handler (`pg_terminate_backend`): the response is withheld (503,
/// nothing committed), neither the order nor the record remains, and the retry runs once and
/// commits both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connection_leaves_neither_order_nor_record() {
    let Some(schema) = Schema::new("killconn").await else {
        return;
    };
    let mut server = serve(
        Idempotency::new(postgres_store(&schema, 8).await),
        Duration::ZERO,
    )
    .await;
    let pool = checking_pool(&schema).await;
    let body = json!({ "item": "book", "first_run": "wait" });

    let client = server.client.clone();
    let url = format!("{}/orders", server.url);
    let sent = {
        let body = body.clone();
        tokio::spawn(async move { post_json(&client, &url, Some("k-kill"), &body).await })
    };
    let pid = tokio::time::timeout(Duration::from_secs(10), server.pids.recv())
        .await
        .expect("the handler wrote and published its backend")
        .expect("pid");
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .expect("terminate");
    assert!(terminated);
    server.gate.notify_one();
    let answer = sent.await.expect("request task");
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(
        answer.code().as_deref(),
        Some("IDEMPOTENCY_STORE_UNAVAILABLE")
    );
    assert_eq!(rows_for(&pool, "k-kill").await, (0, 0));

    let retry = server.order("k-kill", &body).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed);
    assert_eq!(server.runs("k-kill"), 2);
    assert_eq!(rows_for(&pool, "k-kill").await, (1, 1));
    let replay = server.order("k-kill", &body).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, retry.body);
}

/// While the first request's transaction is open (it waits on a gate the test opens only
/// afterwards), 15 duplicates are 409 at once, whatever their body (the reservation is
/// invisible). The store's `lock_timeout` is 60 s, so a duplicate that waited on the first
/// one's row lock would not answer before the test's bound: the warm wave must answer within
/// [`DUPLICATE_BOUND`]. Once the first committed, the same body replays and another is 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_during_open_transaction_is_409_whatever_its_body() {
    let Some(schema) = Schema::new("inflight").await else {
        return;
    };
    let mut server = serve(
        Idempotency::new(patient_store(&schema, 20).await),
        Duration::ZERO,
    )
    .await;
    let body = json!({ "item": "book", "first_run": "wait" });
    let client = server.client.clone();
    let url = format!("{}/orders", server.url);
    let first = {
        let body = body.clone();
        tokio::spawn(async move { post_json(&client, &url, Some("k-open"), &body).await })
    };
    tokio::time::timeout(Duration::from_secs(10), server.pids.recv())
        .await
        .expect("the first request is running")
        .expect("pid");
    let server = Arc::new(server);
    // Two waves: the first also opens the HTTP and pool connections; the second shows what a
    // 409 costs once they are open.
    for wave in ["cold", "warm"] {
        let duplicates: Vec<_> = (0..15)
            .map(|i| {
                let server = Arc::clone(&server);
                let other = if i % 2 == 0 {
                    body.clone()
                } else {
                    json!({ "item": format!("something else {i}") })
                };
                tokio::spawn(async move {
                    let started = Instant::now();
                    let answer = server.order("k-open", &other).await;
                    (answer, started.elapsed())
                })
            })
            .collect();
        let mut latencies = Vec::new();
        for duplicate in duplicates {
            let (dup, took) = tokio::time::timeout(Duration::from_secs(10), duplicate)
                .await
                .expect("a duplicate waited for the open transaction instead of answering 409")
                .expect("duplicate task");
            assert_eq!(dup.status, 409, "{dup:?}");
            assert_eq!(dup.code().as_deref(), Some("IDEMPOTENCY_IN_PROGRESS"));
            latencies.push(took);
        }
        latencies.sort();
        eprintln!(
            "15 concurrent duplicates ({wave}) while the first transaction stays open: 409 in \
             min {:?}, median {:?}, max {:?}",
            latencies[0],
            latencies[latencies.len() / 2],
            latencies[latencies.len() - 1]
        );
        // The cold wave also opens connections; a lock wait would last until the gate opens.
        let bound = if wave == "cold" {
            Duration::from_secs(3)
        } else {
            DUPLICATE_BOUND
        };
        assert!(
            latencies[latencies.len() - 1] < bound,
            "a duplicate ({wave}) took {:?} to answer 409 (bound {bound:?}): did it wait on the \
             open transaction's lock?",
            latencies[latencies.len() - 1]
        );
    }
    server.gate.notify_one();
    let first = first.await.expect("first");
    assert_eq!(first.status, 201);
    let replay = server.order("k-open", &body).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);
    let other = server
        .order("k-open", &json!({ "item": "something else" }))
        .await;
    assert_eq!(other.status, 422);
    assert_eq!(server.runs("k-open"), 1);
}

/// 500 keys, each sent 16 times at once while its handler holds the transaction for 1 s:
/// exactly one order per key, and every answer is the original, an identical replay, or 409.
/// The store's `lock_timeout` is 60 s, and every copy of a key sent within half a second of its
/// batch (while its original surely holds its transaction) must have been answered before the
/// original was: a duplicate that waited on the first one's lock would
/// answer only once it committed, a second later, as a 409 or a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_each_key_once_and_never_wait_on_a_lock() {
    let Some(schema) = Schema::new("dups").await else {
        return;
    };
    const KEYS: usize = 500;
    const SENDS: usize = 16;
    const KEYS_AT_ONCE: usize = 12;
    let hold = Duration::from_secs(1);
    let server = Arc::new(serve(Idempotency::new(patient_store(&schema, 40).await), hold).await);
    let pool = checking_pool(&schema).await;

    let mut in_progress: Vec<Duration> = Vec::new();
    let mut originals: Vec<Duration> = Vec::new();
    let mut replays: Vec<Duration> = Vec::new();
    let started = Instant::now();
    let keys: Vec<usize> = (0..KEYS).collect();
    let mut late: Vec<String> = Vec::new();
    for batch in keys.chunks(KEYS_AT_ONCE) {
        let batch_start = Instant::now();
        let mut sends = Vec::new();
        for &k in batch {
            for _ in 0..SENDS {
                let server = Arc::clone(&server);
                sends.push(tokio::spawn(async move {
                    let key = format!("dup-{k}");
                    let body = json!({ "item": format!("item-{k}") });
                    let t = Instant::now();
                    let answer = server.order(&key, &body).await;
                    (key, answer, t.elapsed(), batch_start.elapsed())
                }));
            }
        }
        let mut per_key: HashMap<String, Vec<Answer>> = HashMap::new();
        let mut ends: HashMap<String, (Option<Duration>, Duration)> = HashMap::new();
        for send in sends {
            let (key, answer, took, end) = send.await.expect("send task");
            let (original_end, others_end) = ends.entry(key.clone()).or_default();
            if answer.status == 201 && !answer.replayed {
                *original_end = Some(end);
            } else if end.saturating_sub(took) < hold / 2 {
                // Sent while the original's transaction was surely open (it holds `hold`): a
                // copy sent later, on a loaded machine, may fairly arrive after the commit and
                // be answered as a replay after the original.
                *others_end = (*others_end).max(end);
            }
            match (answer.status, answer.replayed) {
                (201, false) => originals.push(took),
                (201, true) => replays.push(took),
                (409, _) => {
                    assert_eq!(answer.code().as_deref(), Some("IDEMPOTENCY_IN_PROGRESS"));
                    in_progress.push(took);
                }
                _ => panic!("{key}: unexpected answer {answer:?}"),
            }
            per_key.entry(key).or_default().push(answer);
        }
        for (key, answers) in per_key {
            let firsts: Vec<&Answer> = answers
                .iter()
                .filter(|a| a.status == 201 && !a.replayed)
                .collect();
            assert_eq!(firsts.len(), 1, "{key}: exactly one original: {answers:?}");
            for replay in answers.iter().filter(|a| a.replayed) {
                assert_eq!(replay.body, firsts[0].body, "{key}: identical replay");
            }
            assert_eq!(server.runs(&key), 1, "{key}: the handler ran once");
        }
        for (key, (original_end, others_end)) in ends {
            let original_end = original_end.expect("an original");
            if others_end >= original_end {
                late.push(format!(
                    "{key}: a duplicate answered at {others_end:?}, the original at \
                     {original_end:?}"
                ));
            }
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM orders").await,
        KEYS as i64
    );
    assert_eq!(
        scalar(&pool, "SELECT count(DISTINCT key) FROM orders").await,
        KEYS as i64
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM idempotency_records WHERE state = 1"
        )
        .await,
        KEYS as i64
    );

    in_progress.sort();
    originals.sort();
    let pct =
        |v: &[Duration], p: f64| v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1];
    eprintln!(
        "enlisted duplicates: {KEYS} keys x {SENDS} sends ({KEYS_AT_ONCE} keys at once, handler \
         holds its transaction {hold:?}) in {elapsed:?}: {} originals, {} replays, {} x 409",
        originals.len(),
        replays.len(),
        in_progress.len()
    );
    if !in_progress.is_empty() {
        eprintln!(
            "409 latency: p50 {:?}, p99 {:?}, max {:?}; originals: p50 {:?}, max {:?}",
            pct(&in_progress, 0.50),
            pct(&in_progress, 0.99),
            in_progress[in_progress.len() - 1],
            pct(&originals, 0.50),
            originals[originals.len() - 1],
        );
    }
    assert_eq!(originals.len(), KEYS);
    assert_eq!(
        originals.len() + replays.len() + in_progress.len(),
        KEYS * SENDS
    );
    assert!(
        late.is_empty(),
        "{} keys had a duplicate answered only after the original (the handler holds its \
         transaction {hold:?}): did it wait on the first one's lock? {:?}",
        late.len(),
        &late[..late.len().min(5)]
    );
}

/// A keyless request on an endpoint whose key is optional runs in a transaction too: a 201
/// commits its write, a 5xx rolls it back; nothing is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_request_commits_or_rolls_back_by_its_status() {
    let Some(schema) = Schema::new("loose").await else {
        return;
    };
    let server = serve(
        Idempotency::new(postgres_store(&schema, 4).await),
        Duration::ZERO,
    )
    .await;
    let pool = checking_pool(&schema).await;
    let url = format!("{}/loose", server.url);
    let ok = post_json(&server.client, &url, None, &json!({ "item": "kept" })).await;
    assert_eq!(ok.status, 201);
    let failed = post_json(
        &server.client,
        &url,
        None,
        &json!({ "item": "dropped", "first_run": "status500" }),
    )
    .await;
    assert_eq!(failed.status, 500);
    let items: Vec<String> = sqlx::query_scalar("SELECT item FROM orders ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("orders");
    assert_eq!(items, ["kept"]);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM idempotency_records").await,
        0
    );
}

/// An enlisted handler honours its methods like the others: a request with another method runs
/// in a transaction without a claim (never replayed); a keyed PUT under the default POST and
/// PATCH is a setup mistake, refused 500 in strict mode with nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enlisted_handlers_apply_to_their_methods_only() {
    let Some(schema) = Schema::new("methods").await else {
        return;
    };
    let strict = |on| {
        idempotent_runtime::config::Config::builder()
            .strict(on)
            .build()
    };
    let store = postgres_store(&schema, 4).await;
    let handle = Idempotency::builder(store).config(strict(true)).build();
    let server = serve(handle, Duration::ZERO).await;
    let pool = checking_pool(&schema).await;
    let url = format!("{}/loose", server.url);
    let send = |method: reqwest::Method, key: &'static str, item: &'static str| {
        let request = server
            .client
            .request(method, &url)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(json!({ "item": item }).to_string());
        async move {
            let response = request.send().await.expect("send");
            let replayed = response.headers().contains_key("idempotency-replayed");
            let status = response.status().as_u16();
            (status, replayed, response.text().await.expect("body"))
        }
    };
    let (status, _, body) = send(reqwest::Method::PUT, "p", "put").await;
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("IDEMPOTENCY_MISCONFIGURED"), "{body}");
    for _ in 0..2 {
        let (status, replayed, body) = send(reqwest::Method::GET, "g", "got").await;
        assert_eq!((status, replayed), (201, false), "{body}");
    }
    let items: Vec<String> = sqlx::query_scalar("SELECT item FROM orders ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("orders");
    assert_eq!(items, ["got", "got"], "the PUT wrote nothing; each GET ran");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM idempotency_records").await,
        0
    );
    drop(server);

    let store = postgres_store(&schema, 4).await;
    let handle = Idempotency::builder(store).config(strict(false)).build();
    let server = serve(handle, Duration::ZERO).await;
    let url = format!("{}/loose", server.url);
    for _ in 0..2 {
        let request = server
            .client
            .put(&url)
            .header("content-type", "application/json")
            .header("idempotency-key", "p")
            .body(json!({ "item": "put" }).to_string());
        let response = request.send().await.expect("send");
        assert_eq!(response.status().as_u16(), 201);
        assert!(!response.headers().contains_key("idempotency-replayed"));
    }
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM orders WHERE item = 'put'").await,
        2,
        "outside strict mode the PUT passes, unclaimed, as before"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM idempotency_records").await,
        0
    );
}

/// An enlisted handler over a store that is not PostgreSQL answers 500 without running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enlisted_handler_over_another_store_answers_500_without_running() {
    let server = serve(Idempotency::memory(), Duration::ZERO).await;
    let answer = server.order("k-memory", &json!({ "item": "book" })).await;
    assert_eq!(answer.status, 500, "{answer:?}");
    assert!(answer.body.contains("PostgreSQL"), "{answer:?}");
    assert_eq!(server.runs("k-memory"), 0);
}

/// A user-written wrapper around `PostgresStore` keeps its enlisting: the enlisted endpoint
/// commits the order with its record through the wrapper and replays it, where a store found by
/// its type would have answered 500 `IDEMPOTENCY_STORE_NOT_ENLISTABLE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_wrapper_around_postgres_serves_an_enlisted_endpoint() {
    let Some(schema) = Schema::new("wrapped").await else {
        return;
    };
    // What a user's own wrapper (metrics, retries) does: forward every method and capability.
    let store = Forwarding::new(postgres_store(&schema, 4).await);
    let calls = store.calls();
    let server = serve(
        Idempotency::builder(store).sweeper(false).build(),
        Duration::ZERO,
    )
    .await;
    let pool = checking_pool(&schema).await;
    let body = json!({ "item": "book" });

    let first = server.order("k-wrapped", &body).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed);
    assert_eq!(rows_for(&pool, "k-wrapped").await, (1, 1));
    let state: i16 =
        sqlx::query_scalar("SELECT state FROM idempotency_records WHERE key = 'k-wrapped'")
            .fetch_one(&pool)
            .await
            .expect("record");
    assert_eq!(state, 1, "the record commits completed, with the order");

    let again = server.order("k-wrapped", &body).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(server.runs("k-wrapped"), 1);
    assert_eq!(rows_for(&pool, "k-wrapped").await, (1, 1));

    use std::sync::atomic::Ordering;
    assert!(
        calls.enlisting.load(Ordering::Relaxed) >= 2,
        "each enlisted request asked the wrapper what it can join"
    );
    assert_eq!(
        calls.request_path(),
        0,
        "an enlisted request claims and completes in its transaction, not through the detached methods"
    );
}

// ---------------------------------------------------------------------------------------------
// actix-web.

mod actix_server {
    use super::*;
    use actix_web::{App, HttpResponse, HttpServer, web};

    pub(super) struct Runs(pub Mutex<HashMap<String, u32>>);

    #[idempotent_runtime::actix::idempotent(require_key, enlisted)]
    async fn create(
        runs: web::Data<Runs>,
        context: IdempotencyContext,
        tx: &mut EnlistedTx,
        order: web::Json<Value>,
    ) -> HttpResponse {
        let key = context.key().as_str().to_owned();
        let run = {
            let mut runs = runs.0.lock().expect("runs");
            let n = runs.entry(key.clone()).or_default();
            *n += 1;
            *n
        };
        let inserted = sqlx::query("INSERT INTO orders (key, item) VALUES ($1, $2)")
            .bind(&key)
            .bind(order["item"].as_str().unwrap_or_default())
            .execute(tx.conn())
            .await;
        if inserted.is_err() || (run == 1 && order["first_run"] == "status500") {
            return HttpResponse::InternalServerError().body("failed after writing");
        }
        HttpResponse::Created().json(json!({ "key": key, "run": run }))
    }

    /// Starts the server on its own thread; returns its base URL and the run counter.
    pub(super) fn start(
        store: Idempotency,
    ) -> (String, web::Data<Runs>, actix_web::dev::ServerHandle) {
        let runs = web::Data::new(Runs(Mutex::new(HashMap::new())));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let data = runs.clone();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let store = web::Data::new(store);
                let server = HttpServer::new(move || {
                    App::new()
                        .app_data(store.clone())
                        .app_data(data.clone())
                        .route("/orders", web::post().to(create))
                })
                .workers(1)
                .bind("127.0.0.1:0")
                .expect("bind");
                let addr = server.addrs()[0];
                let server = server.run();
                ready_tx
                    .send((format!("http://{addr}"), server.handle()))
                    .expect("ready");
                let _ = server.await;
            });
        });
        let (url, handle) = ready_rx.recv().expect("actix server started");
        (url, runs, handle)
    }
}

/// The same guarantees through actix-web's attribute: a 5xx rolls back both, the retry
/// commits both, the repeat replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actix_enlisted_handler_rolls_back_then_commits_and_replays() {
    let Some(schema) = Schema::new("actix").await else {
        return;
    };
    let store = Idempotency::new(postgres_store(&schema, 4).await);
    let (url, runs, handle) = actix_server::start(store);
    let pool = checking_pool(&schema).await;
    let client = reqwest::Client::new();
    let url = format!("{url}/orders");
    let body = json!({ "item": "book", "first_run": "status500" });

    let failed = post_json(&client, &url, Some("k-actix"), &body).await;
    assert_eq!(failed.status, 500, "{failed:?}");
    assert_eq!(rows_for(&pool, "k-actix").await, (0, 0));
    let retry = post_json(&client, &url, Some("k-actix"), &body).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed);
    assert_eq!(rows_for(&pool, "k-actix").await, (1, 1));
    let replay = post_json(&client, &url, Some("k-actix"), &body).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(runs.0.lock().expect("runs").get("k-actix"), Some(&2));
    handle.stop(true).await;
}

// ---------------------------------------------------------------------------------------------
// The example, SIGKILLed mid-handler.

struct Example {
    child: Child,
    url: String,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_example(database_url: &str, hold_ms: u64) -> Example {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut child = Command::new(cargo)
        .args([
            "run",
            "--quiet",
            "--all-features",
            "-p",
            "idempotent-examples",
            "--example",
            "orders_enlisted",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("DATABASE_URL", database_url)
        .env("ORDERS_ADDR", "127.0.0.1:0")
        .env("ORDERS_HOLD_MS", hold_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start orders_enlisted");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut example = Example {
        child,
        url: String::new(),
        lines,
    };
    let line = example.wait_line("listening on ", Duration::from_secs(300));
    example.url = line["listening on ".len()..].trim().to_owned();
    example
}

impl Example {
    fn wait_line(&self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(e) => panic!("orders_enlisted never printed {prefix:?}: {e}"),
            }
        }
    }
}

/// SIGKILL the example while its handler holds the transaction (order and outbox written,
/// not committed): neither the order, nor its outbox event, nor the record remains; a new
/// process runs the retry once and commits all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_process_leaves_nothing_and_the_retry_commits_once() {
    let Some(schema) = Schema::new("sigkill").await else {
        return;
    };
    let database_url = schema.url();
    let url = database_url.clone();
    let example = tokio::task::spawn_blocking(move || start_example(&url, 60_000))
        .await
        .expect("start");
    let client = reqwest::Client::new();
    let orders = format!("{}/orders", example.url);
    let body = json!({ "sku": "A1", "quantity": 2 });
    let in_flight = {
        let (client, orders, body) = (client.clone(), orders.clone(), body.clone());
        tokio::spawn(async move {
            client
                .post(&orders)
                .header("idempotency-key", "k-sigkill")
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
        })
    };
    let mut example = tokio::task::spawn_blocking(move || {
        example.wait_line("order ", Duration::from_secs(30));
        example
    })
    .await
    .expect("the handler wrote");
    example.child.kill().expect("SIGKILL the example");
    let _ = example.child.wait();
    assert!(
        in_flight.await.expect("task").is_err(),
        "no answer from a killed process"
    );
    drop(example);

    let pool = checking_pool(&schema).await;
    let count = |sql: &'static str| scalar(&pool, sql);
    assert_eq!(count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(count("SELECT count(*) FROM outbox").await, 0);
    assert_eq!(count("SELECT count(*) FROM idempotency_records").await, 0);

    let url = database_url.clone();
    let example = tokio::task::spawn_blocking(move || start_example(&url, 0))
        .await
        .expect("restart");
    let orders = format!("{}/orders", example.url);
    // PostgreSQL ends the killed backend (and its try-lock) once it sees the socket close.
    let deadline = Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let answer = post_json(&client, &orders, Some("k-sigkill"), &body).await;
        if answer.status != 409 || Instant::now() > deadline {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed);
    assert_eq!(count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(count("SELECT count(*) FROM outbox").await, 1);
    assert_eq!(
        count("SELECT count(*) FROM idempotency_records WHERE state = 1").await,
        1
    );
    let replay = post_json(&client, &orders, Some("k-sigkill"), &body).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(count("SELECT count(*) FROM orders").await, 1);
    drop(example);
}

/// What an enlisted request costs before any transaction: a replay and a reused key are one
/// statement (the read on the store's reserved connections), and a duplicate of a request this
/// process is running is none at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_one_round_trip_and_a_local_duplicate_none() {
    let Some(schema) = Schema::new("trips").await else {
        return;
    };
    let store = Arc::new(postgres_store(&schema, 4).await);
    let typed = Arc::clone(&store);
    let mut server = serve(
        Idempotency::builder_arc(store).sweeper(false).build(),
        Duration::ZERO,
    )
    .await;
    let body = json!({ "item": "book" });
    let first = server.order("k-trips", &body).await;
    assert_eq!(first.status, 201, "{first:?}");

    let before = typed.statements_executed();
    let replay = server.order("k-trips", &body).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(
        typed.statements_executed() - before,
        1,
        "a replay is one read"
    );

    let before = typed.statements_executed();
    let other = server.order("k-trips", &json!({ "item": "pen" })).await;
    assert_eq!(other.code().as_deref(), Some("IDEMPOTENCY_KEY_REUSED"));
    assert_eq!(
        typed.statements_executed() - before,
        1,
        "a reused key is one read"
    );

    let waiting = json!({ "item": "book", "first_run": "wait" });
    let client = server.client.clone();
    let url = format!("{}/orders", server.url);
    let running = {
        let waiting = waiting.clone();
        tokio::spawn(async move { post_json(&client, &url, Some("k-local"), &waiting).await })
    };
    tokio::time::timeout(Duration::from_secs(10), server.pids.recv())
        .await
        .expect("the first request is running")
        .expect("pid");
    let before = typed.statements_executed();
    let duplicate = server.order("k-local", &waiting).await;
    assert_eq!(duplicate.status, 409, "{duplicate:?}");
    assert_eq!(duplicate.code().as_deref(), Some("IDEMPOTENCY_IN_PROGRESS"));
    assert_eq!(
        typed.statements_executed() - before,
        0,
        "a duplicate held by this process needs no database"
    );
    server.gate.notify_one();
    assert_eq!(running.await.expect("first").status, 201);
    assert_eq!(server.runs("k-local"), 1);
    assert_eq!(server.runs("k-trips"), 1);
}
