//! Enlisted mode on MySQL/MariaDB and SQLite in process, over real HTTP: a failed handler
//! leaves neither its row nor a record and the retry runs; a replay and a reused key are one
//! statement each, read before any transaction; a user's wrapper around the store that forwards
//! `Store::enlisting` serves the endpoint. (Crashes, concurrent duplicates and a second replica
//! are driven through the conformance servers' `/ledger`: `tests/conformance/enlisted_ledger.rs`.)

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::store::FencingToken;
use idempotent_runtime::test_helpers::store::Forwarding;
use serde_json::{Value, json};

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
    runs: Arc<AtomicU64>,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

/// The handler's end: 500 after its insert when asked to fail (so the insert must roll back),
/// else 201 with the item.
fn answer(state: &AppState, inserted: Result<(), sqlx::Error>, new: &Value) -> Response {
    state.runs.fetch_add(1, Ordering::SeqCst);
    if let Err(error) = inserted {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    if new["fail"] == json!(true) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "failed after its insert").into_response();
    }
    (StatusCode::CREATED, Json(json!({ "item": new["item"] }))).into_response()
}

#[idempotent_runtime::axum::idempotent(require_key, enlisted)]
async fn order_mysql(
    State(state): State<AppState>,
    tx: &mut EnlistedTx<sqlx::MySql>,
    Json(new): Json<Value>,
) -> Response {
    let inserted = sqlx::query("INSERT INTO orders (item) VALUES (?)")
        .bind(new["item"].as_str().unwrap_or_default().to_owned())
        .execute(tx.conn())
        .await
        .map(drop);
    answer(&state, inserted, &new)
}

#[idempotent_runtime::axum::idempotent(require_key, enlisted)]
async fn order_sqlite(
    State(state): State<AppState>,
    tx: &mut EnlistedTx<sqlx::Sqlite>,
    Json(new): Json<Value>,
) -> Response {
    let inserted = sqlx::query("INSERT INTO orders (item) VALUES (?1)")
        .bind(new["item"].as_str().unwrap_or_default().to_owned())
        .execute(tx.conn())
        .await
        .map(drop);
    answer(&state, inserted, &new)
}

struct Served {
    url: String,
    runs: Arc<AtomicU64>,
    client: reqwest::Client,
    _task: tokio::task::JoinHandle<()>,
}

async fn serve(idempotency: Idempotency, app: Router<AppState>) -> Served {
    let runs = Arc::new(AtomicU64::new(0));
    let app = app.with_state(AppState {
        idempotency,
        runs: Arc::clone(&runs),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        let _ = axum::serve(listener, service).await;
    });
    Served {
        url,
        runs,
        client: reqwest::Client::new(),
        _task: task,
    }
}

impl Served {
    async fn post(&self, key: &str, body: &Value) -> (u16, bool, String) {
        let response = self
            .client
            .post(&self.url)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let replayed = response.headers().get("idempotency-replayed").is_some();
        (status, replayed, response.text().await.unwrap())
    }
}

/// The case on a served endpoint: `orders` counts committed rows, `statements` the store's.
async fn case<O, S>(what: &str, served: &Served, orders: impl Fn() -> O, statements: S)
where
    O: Future<Output = i64>,
    S: Fn() -> u64,
{
    let failing = json!({"item": "pen", "fail": true});
    let (status, _, _) = served.post("k-1", &failing).await;
    assert_eq!(status, 500, "{what}");
    assert_eq!(
        orders().await,
        0,
        "{what}: a failed handler's row committed"
    );

    // Nothing was recorded: the retry runs (with any body) and commits once.
    let body = json!({"item": "pen"});
    let (status, replayed, first) = served.post("k-1", &body).await;
    assert_eq!((status, replayed), (201, false), "{what}: {first}");
    assert_eq!(orders().await, 1, "{what}");
    assert_eq!(served.runs.load(Ordering::SeqCst), 2, "{what}");

    let before = statements();
    let (status, replayed, again) = served.post("k-1", &body).await;
    assert_eq!((status, replayed, &again), (201, true, &first), "{what}");
    assert_eq!(statements() - before, 1, "{what}: a replay is one read");

    let before = statements();
    let (status, _, reused) = served.post("k-1", &json!({"item": "ink"})).await;
    assert_eq!(status, 422, "{what}: {reused}");
    assert_eq!(statements() - before, 1, "{what}: a reused key is one read");
    assert_eq!(served.runs.load(Ordering::SeqCst), 2, "{what}: ran again");
    assert_eq!(orders().await, 1, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_rolls_back_a_failed_handler_and_replays_in_one_statement_through_a_wrapper() {
    use idempotent_runtime::store::mysql::MySqlStore;

    let Some(base) = crate::support::mysql_url() else {
        return;
    };
    let db = crate::support::MysqlDatabase::new(&base, "enlisted");
    // A user's wrapper (metrics, retries) that forwards every capability, enlisting included.
    let store = Arc::new(Forwarding::new(
        MySqlStore::connect(&db.url()).await.unwrap(),
    ));
    store.inner().migrate().await.unwrap();
    let pool = store.inner().pool().clone();
    sqlx::query("CREATE TABLE orders (item VARCHAR(32) NOT NULL) ENGINE = InnoDB")
        .execute(&pool)
        .await
        .unwrap();
    let idempotency = Idempotency::builder_arc(store.clone())
        .sweeper(false)
        .build();
    let served = serve(
        idempotency,
        Router::new().route("/orders", post(order_mysql)),
    )
    .await;
    let orders = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT CAST(count(*) AS SIGNED) FROM orders")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    case("mysql", &served, orders, || {
        store.inner().statements_executed()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rolls_back_a_failed_handler_and_replays_in_one_statement_through_a_wrapper() {
    use idempotent_runtime::store::sqlite::SqliteStore;

    let dir = std::env::temp_dir().join(format!(
        "idem-enlisted-{}-{:016x}",
        std::process::id(),
        FencingToken::mint().0
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(Forwarding::new(
        SqliteStore::open(dir.join("store.db")).await.unwrap(),
    ));
    store.inner().migrate().await.unwrap();
    sqlx::query("CREATE TABLE orders (item TEXT NOT NULL)")
        .execute(store.inner().writer())
        .await
        .unwrap();
    let idempotency = Idempotency::builder_arc(store.clone())
        .sweeper(false)
        .build();
    let served = serve(
        idempotency,
        Router::new().route("/orders", post(order_sqlite)),
    )
    .await;
    let orders = || {
        let store = Arc::clone(&store);
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
                .fetch_one(store.inner().writer())
                .await
                .unwrap()
        }
    };
    case("sqlite", &served, orders, || {
        store.inner().statements_executed()
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}
