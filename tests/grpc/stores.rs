//! The guarantees over gRPC on the shared stores: concurrent duplicates, replays and released
//! statuses, then two replicas sharing the store, 1,000 keys × 8 duplicates → 1,000 runs.

use idempotent_examples::grpc::{ExecutionReply, SlowRequest, StatusRequest, keyed};
use idempotent_runtime::{Idempotency, config::Config};
use tonic::Code;

use crate::{assert_refusal, conformance, replayed, runs};

fn config() -> Config {
    Config::builder().strict(false).build()
}

/// Duplicates, a replay and a released status against a server on `handle`.
async fn guarantees(handle: Idempotency) {
    let (_, mut client) = conformance(handle).await;
    let calls = (0..16).map(|_| {
        let mut client = client.clone();
        tokio::spawn(async move {
            client
                .call::<_, ExecutionReply>("Slow", keyed(SlowRequest { ms: 500 }, "slow"))
                .await
        })
    });
    let mut ok = 0;
    for result in futures_util::future::join_all(calls).await {
        match result.expect("task") {
            Ok(_) => ok += 1,
            Err(status) => assert_refusal(&status, Code::Aborted, "IDEMPOTENCY_IN_PROGRESS"),
        }
    }
    assert_eq!(ok, 1);
    let replay = client
        .call::<_, ExecutionReply>("Slow", keyed(SlowRequest { ms: 500 }, "slow"))
        .await
        .expect("the replay");
    assert!(replayed(replay.metadata()));
    assert_eq!(runs(&mut client, "Slow").await, 1);
    for _ in 0..2 {
        let request = keyed(
            StatusRequest {
                code: Code::Unavailable as i32,
            },
            "released",
        );
        let status = client
            .call::<_, ExecutionReply>("Status", request)
            .await
            .expect_err("UNAVAILABLE");
        assert_eq!(status.code(), Code::Unavailable);
    }
    assert_eq!(runs(&mut client, "Status").await, 2);
}

#[cfg(any(feature = "postgres", feature = "redis"))]
/// Two replicas over `handles`, 1,000 keys each sent 8 times at once (4 to each replica):
/// every key runs exactly once across both.
async fn replicas(handles: [Idempotency; 2]) {
    use futures_util::StreamExt as _;
    use idempotent_examples::grpc::{Client, OrderReply, OrderRequest};
    let [a, b] = handles;
    let (_, a) = conformance(a).await;
    let (_, b) = conformance(b).await;
    let keys = futures_util::stream::iter(0..1000u32).map(|k| {
        let (a, b) = (a.clone(), b.clone());
        async move {
            let calls = (0..8).map(|i| {
                let mut client: Client = if i % 2 == 0 { a.clone() } else { b.clone() };
                let order = OrderRequest {
                    sku: format!("sku-{k}"),
                    quantity: 1,
                };
                async move {
                    client
                        .call::<_, OrderReply>("Order", keyed(order, &format!("key-{k}")))
                        .await
                }
            });
            for result in futures_util::future::join_all(calls).await {
                if let Err(status) = result {
                    assert_refusal(&status, Code::Aborted, "IDEMPOTENCY_IN_PROGRESS");
                }
            }
        }
    });
    futures_util::StreamExt::buffer_unordered(keys, 16)
        .collect::<Vec<()>>()
        .await;
    let (mut a, mut b) = (a, b);
    let total = runs(&mut a, "Order").await + runs(&mut b, "Order").await;
    assert_eq!(
        total, 1000,
        "each of 1,000 keys ran once across two replicas"
    );
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_and_its_cache_run_each_key_once_across_duplicates_and_replicas() {
    use idempotent_runtime::store::postgres::PostgresStore;
    let Some(schema) = crate::support::Schema::new("grpc").await else {
        return;
    };
    let store = || async {
        let store = PostgresStore::connect(&schema.url())
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        Idempotency::builder(store).config(config()).build()
    };
    guarantees(store().await).await;
    // Behind the cache of completed records (a second schema: the first one's keys are taken).
    let cached_schema = crate::support::Schema::new("grpc_cached")
        .await
        .expect("a schema");
    let store = PostgresStore::connect(&cached_schema.url())
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let cached = idempotent_runtime::store::cache::CachedStore::new(store);
    guarantees(Idempotency::builder(cached).config(config()).build()).await;
    let schema2 = crate::support::Schema::new("grpc_replicas")
        .await
        .expect("a second schema");
    let replica = || async {
        let store = PostgresStore::connect(&schema2.url())
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        Idempotency::builder(store).config(config()).build()
    };
    let handles = [replica().await, replica().await];
    tokio::time::timeout(std::time::Duration::from_secs(300), replicas(handles))
        .await
        .expect("1,000 keys within five minutes");
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_runs_each_key_once_across_duplicates_and_replicas() {
    use idempotent_runtime::store::redis::RedisStore;
    let Some(url) = crate::support::redis_url() else {
        return;
    };
    let prefix = |what: &str| {
        format!(
            "grpc-{what}-{:016x}",
            idempotent_runtime::store::FencingToken::mint().0
        )
    };
    let connect = |prefix: String| {
        let url = url.clone();
        async move {
            let store = RedisStore::builder()
                .prefix(prefix)
                .connect(&url)
                .await
                .expect("connect");
            Idempotency::builder(store).config(config()).build()
        }
    };
    guarantees(connect(prefix("one")).await).await;
    let shared = prefix("replicas");
    let handles = [connect(shared.clone()).await, connect(shared).await];
    tokio::time::timeout(std::time::Duration::from_secs(300), replicas(handles))
        .await
        .expect("1,000 keys within five minutes");
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_runs_each_key_once_across_duplicates() {
    use idempotent_runtime::store::sqlite::SqliteStore;
    let path = std::env::temp_dir().join(format!(
        "idempotent-grpc-{:016x}.db",
        idempotent_runtime::store::FencingToken::mint().0
    ));
    let store = SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    guarantees(Idempotency::builder(store).config(config()).build()).await;
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}
