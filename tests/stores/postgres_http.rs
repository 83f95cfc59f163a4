//! The conformance servers on PostgreSQL, where what the store does is visible over HTTP
//! (DESIGN.md §3, §5): clients that disconnect while their claim's statement is in flight, and
//! the store latency metrics with the process cache in front of the database.
//!
//! Reads `DATABASE_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Each server works in a schema of its own, selected
//! through the URL's `search_path`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features -p idempotent-examples --test stores postgres_http::
//! ```

use std::time::{Duration, Instant};

use crate::support::Schema;
use crate::support::harness::{self, on_postgres, sample};
use serde_json::json;
use sqlx::Connection as _;

/// Clients send keyed POSTs while another session holds `LOCK TABLE … IN SHARE MODE` (every
/// claim's statement waits) and disconnect after 0.3 s; the lock is released at 0.6 s. A retry
/// of each key then gets 201 (the handler's answer, or its replay), never a 409 that lasts a
/// lease, and each handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_gone_while_their_claim_waits_leave_their_keys_free() {
    for name in harness::SERVERS {
        let Some(schema) = Schema::new("dropped").await else {
            return;
        };
        let server = on_postgres(name, &schema, &[]);
        let mut admin = sqlx::PgConnection::connect(&schema.url()).await.unwrap();
        let mut lock = admin.begin().await.unwrap();
        sqlx::raw_sql("LOCK TABLE idempotency_records IN SHARE MODE")
            .execute(&mut *lock)
            .await
            .unwrap();
        let keys: Vec<String> = (0..8).map(|i| format!("gone-{i}")).collect();
        let order = |key: &str| json!({"sku": key, "quantity": 1});
        let gone: Vec<_> = keys
            .iter()
            .map(|key| {
                let send = server.post("/orders").key(key).json(&order(key)).try_send();
                tokio::time::timeout(Duration::from_millis(300), send)
            })
            .collect();
        for answer in futures_util::future::join_all(gone).await {
            assert!(answer.is_err(), "{name}: answered through the table lock");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        lock.commit().await.unwrap();

        for key in &keys {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let retry = server
                    .post("/orders")
                    .key(key)
                    .json(&order(key))
                    .send()
                    .await;
                if retry.status != 409 {
                    assert_eq!(retry.status, 201, "{name}: {key}: {:?}", retry.body);
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{name}: {key} still answers 409 after its client went away: {:?}",
                    retry.body
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let again = server
                .post("/orders")
                .key(key)
                .json(&order(key))
                .send()
                .await;
            assert_eq!(again.status, 201, "{name}: {key}");
            assert!(
                again.replayed(),
                "{name}: {key}: the second retry ran again"
            );
        }
        assert_eq!(
            server.runs("/orders").await,
            keys.len() as u64,
            "{name}: each key's handler runs once"
        );
    }
}

/// With `--local-cache`, one first request and 21 replays: the first replay reads PostgreSQL
/// (the cache keeps a record from its first replay), the 20 after it are answered from the
/// process cache. PostgreSQL's claim latency counts the two claims that reached it, the cache's
/// the 20 replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_answered_by_the_cache_are_the_caches_in_the_metrics_not_the_databases() {
    for name in harness::SERVERS {
        let Some(schema) = Schema::new("cache_metrics").await else {
            return;
        };
        let server = on_postgres(name, &schema, &["--local-cache"]);
        let order = json!({"sku": "pen", "quantity": 1});
        let first = server.post("/orders").key("k").json(&order).send().await;
        assert_eq!(first.status, 201, "{name}");
        const REPLAYS: usize = 21;
        for _ in 0..REPLAYS {
            let replay = server.post("/orders").key("k").json(&order).send().await;
            assert_eq!(replay.status, 201, "{name}");
            assert!(replay.replayed(), "{name}");
            assert_eq!(replay.body, first.body, "{name}");
        }
        assert_eq!(server.runs("/orders").await, 1, "{name}");
        let text = String::from_utf8(server.get("/metrics").await.body.to_vec()).unwrap();
        let claims = |store: &str| {
            let store = format!("store=\"{store}\"");
            sample(
                &text,
                "idempotent_store_operation_seconds_count",
                &["op=\"claim\"", &store],
            )
        };
        assert_eq!(claims("postgres"), Some(2.0), "{name}: {text}");
        assert_eq!(
            claims("cache"),
            Some((REPLAYS - 1) as f64),
            "{name}: {text}"
        );
        assert_eq!(
            sample(&text, "idempotent_replayed_total", &["route=\"/orders\""]),
            Some(REPLAYS as f64),
            "{name}: {text}"
        );
    }
}
