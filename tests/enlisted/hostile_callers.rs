//! Enlisted mode under hostile or careless callers (DESIGN.md §5, #14), over real HTTP on an
//! in-test axum server: slow request bodies never hold a database connection, keyed or not; a
//! handler that swallows a database error is answered 500 with nothing written, keyed or not;
//! times inside the transaction are the statement's, not the transaction's start.
//!
//! Reads `DATABASE_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Each test works in a schema of its own.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test enlisted hostile_callers::
//! ```

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::Schema;
use axum::extract::Query;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::config::Config;
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::store::postgres::PostgresStore;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::io::AsyncWriteExt;

const TABLES: &str =
    "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, item text NOT NULL);";

#[derive(Deserialize)]
struct Order {
    item: String,
}

#[derive(Deserialize)]
struct How {
    /// `swallow`: write, then run a failing statement, ignore its error and answer 201.
    #[serde(default)]
    then: String,
    /// Milliseconds to wait after writing.
    #[serde(default)]
    hold_ms: u64,
}

async fn write_order(tx: &mut EnlistedTx, how: &How, order: &Order) -> Response {
    sqlx::query("INSERT INTO orders (item) VALUES ($1)")
        .bind(&order.item)
        .execute(tx.conn())
        .await
        .expect("insert");
    if how.then == "swallow" {
        // The careless handler: the error aborts the transaction, and it answers success.
        let _ = sqlx::query("SELECT 1 / 0").execute(tx.conn()).await;
    }
    if how.hold_ms > 0 {
        tokio::time::sleep(Duration::from_millis(how.hold_ms)).await;
    }
    (StatusCode::CREATED, Json(json!({"item": order.item}))).into_response()
}

#[idempotent_runtime::axum::idempotent(require_key, enlisted)]
async fn keyed(tx: &mut EnlistedTx, Query(how): Query<How>, Json(order): Json<Order>) -> Response {
    write_order(tx, &how, &order).await
}

#[idempotent_runtime::axum::idempotent(enlisted)]
async fn loose(tx: &mut EnlistedTx, Query(how): Query<How>, Json(order): Json<Order>) -> Response {
    write_order(tx, &how, &order).await
}

struct TestServer {
    addr: SocketAddr,
    client: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The server over a store whose pool has `connections` connections.
async fn serve(schema: &Schema, connections: u32) -> (TestServer, PgPool) {
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
    let idempotency = Idempotency::builder(store)
        .config(
            Config::builder()
                .body_timeout(Duration::from_secs(20))
                .build(),
        )
        .build();
    let app = Router::new()
        .route("/keyed", post(keyed))
        .route("/loose", post(loose))
        .with_state(idempotency);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await;
    });
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&schema.url())
        .await
        .expect("connect the checking pool");
    let server = TestServer {
        addr,
        client: reqwest::Client::new(),
        task,
    };
    (server, pool)
}

impl TestServer {
    async fn post(&self, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
        let mut request = self
            .client
            .post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let response = request.send().await.expect("send");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Ten clients announce bodies and send them slower than anyone waits, on a pool of ten
/// connections: the bodies are read before any transaction begins, so everyone else is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_slow_bodies_do_not_take_the_pool() {
    let Some(schema) = Schema::new("slow_bodies").await else {
        return;
    };
    let (server, pool) = serve(&schema, 10).await;
    let mut slow = Vec::new();
    for i in 0..12 {
        let mut conn = tokio::net::TcpStream::connect(server.addr)
            .await
            .expect("connect");
        let key_line = if i % 2 == 0 {
            String::new()
        } else {
            format!("Idempotency-Key: slow-{i}\r\n")
        };
        let path = if i % 2 == 0 { "/loose" } else { "/keyed" };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             {key_line}Content-Length: 100\r\n\r\n{{\"item\":"
        );
        conn.write_all(head.as_bytes()).await.expect("write");
        slow.push(conn);
    }
    // Let the server read what arrived and wait for the rest.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    for i in 0..5 {
        let (status, _) = server
            .post(
                "/keyed",
                Some(&format!("fast-{i}")),
                &json!({"item": "fast"}),
            )
            .await;
        assert_eq!(status, 201);
        let (status, _) = server.post("/loose", None, &json!({"item": "fast"})).await;
        assert_eq!(status, 201);
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "slow bodies held the pool: ten requests took {:?}",
        started.elapsed()
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 10);
    // Twelve stalled bodies on ten connections: had any begun a transaction, the fast
    // requests above would have waited for the pool (or been refused) instead.
    drop(slow);
}

/// A handler that swallows a database error and answers 201: the COMMIT would silently roll
/// back, so the answer is 500 and nothing is written or recorded, keyed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_database_error_answers_500_and_writes_nothing() {
    let Some(schema) = Schema::new("swallowed").await else {
        return;
    };
    let (server, pool) = serve(&schema, 4).await;
    for (path, key) in [
        ("/keyed?then=swallow", Some("k1")),
        ("/loose?then=swallow", None),
    ] {
        let (status, body) = server.post(path, key, &json!({"item": "lost"})).await;
        assert_eq!(status, 500, "{path}: {body}");
        assert_eq!(body["code"], "IDEMPOTENCY_NOT_RECORDED", "{path}: {body}");
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_records").await,
        0
    );
    // The key is free: the retry, done right, runs and commits once.
    let (status, _) = server
        .post("/keyed", Some("k1"), &json!({"item": "kept"}))
        .await;
    assert_eq!(status, 201);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

/// A completion written two seconds into its transaction expires `retention` after it was
/// written, not after the transaction began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn times_inside_the_transaction_are_the_statements() {
    let Some(schema) = Schema::new("statement_clock").await else {
        return;
    };
    let (server, pool) = serve(&schema, 4).await;
    let (status, _) = server
        .post(
            "/keyed?hold_ms=2000",
            Some("late"),
            &json!({"item": "late"}),
        )
        .await;
    assert_eq!(status, 201);
    let left: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 \
         FROM idempotency_records WHERE key = 'late'",
    )
    .fetch_one(&pool)
    .await
    .expect("expires_at");
    let retention = 86_400.0;
    assert!(
        left > retention - 1.0,
        "the record expires {:.1} s early: it was timed by the transaction's start",
        retention - left
    );
}
