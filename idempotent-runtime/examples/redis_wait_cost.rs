//! What the Redis store's `wait_for_replicas` costs a first request (a claim and a completion),
//! on a primary with one replica: the same load run without the option and with it.
//!
//! ```text
//! scripts/redis-replica primary 16390 && scripts/redis-replica replica 16391 16390
//! until redis-cli -p 16391 info replication | grep -q link_status:up; do sleep 0.1; done
//! cargo run --release -p idempotent-runtime --features redis --example redis_wait_cost \
//!     -- redis://127.0.0.1:16390/0 [SECONDS] [CONCURRENCY]
//! scripts/redis-replica stop 16391 && scripts/redis-replica stop 16390
//! ```
//!
//! Each run claims and completes fresh keys from CONCURRENCY tasks (default 16) for SECONDS
//! (default 8) on a two-worker runtime, and prints first requests a second, the completion's
//! latency (median and 99th percentile) and how many completions no replica acknowledged within
//! the 100 ms wait. The keys are deleted afterwards.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::store::redis::RedisStore;
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, Store, StoreError,
};

const SCOPE: [u8; 32] = [9; 32];

/// Completions, their latencies sorted, and how many were not replicated in time.
async fn run(
    store: Arc<RedisStore>,
    secs: u64,
    concurrency: usize,
) -> (usize, Vec<Duration>, usize) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let answer = RecordedResponse::new(201, Vec::new(), vec![b'a'; 1024].into());
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let store = Arc::clone(&store);
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut not_replicated = 0;
                let mut n = 0;
                while Instant::now() < deadline {
                    n += 1;
                    let key = format!("cost-{task}-{n}");
                    let req = ClaimRequest {
                        scope: &SCOPE,
                        key: &key,
                        quota_bucket: 0,
                        fingerprint: Fingerprint {
                            version: 1,
                            digest: [1; 32],
                        },
                        token: FencingToken::mint(),
                        lease: Duration::from_secs(60),
                        retention: Duration::from_secs(600),
                        route: "/cost",
                        response_room: 0,
                    };
                    let Ok(Claim::Acquired) = store.claim(&req).await else {
                        panic!("claim of a fresh key did not acquire");
                    };
                    let start = Instant::now();
                    match store
                        .complete(&SCOPE, &key, req.token, &answer, req.retention)
                        .await
                    {
                        Ok(true) => {}
                        Err(StoreError::NotReplicated { .. }) => not_replicated += 1,
                        other => panic!("completion: {other:?}"),
                    }
                    latencies.push(start.elapsed());
                }
                (latencies, not_replicated)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut not_replicated = 0;
    for t in tasks {
        let (latencies, late) = t.await.expect("task");
        all.extend(latencies);
        not_replicated += late;
    }
    all.sort();
    (all.len(), all, not_replicated)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .expect("usage: redis_wait_cost REDIS_URL [SECONDS] [CONCURRENCY]");
    let secs: u64 = args.next().map_or(8, |s| s.parse().expect("SECONDS"));
    let concurrency: usize = args.next().map_or(16, |s| s.parse().expect("CONCURRENCY"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        for (label, wait) in [
            ("without wait_for_replicas", None),
            (
                "wait_for_replicas(1, 100 ms)",
                Some((1, Duration::from_millis(100))),
            ),
        ] {
            let prefix = format!("wait-cost-{:016x}", FencingToken::mint().0);
            let mut builder = RedisStore::builder().prefix(&prefix);
            if let Some((replicas, timeout)) = wait {
                builder = builder.wait_for_replicas(replicas, timeout);
            }
            let store = Arc::new(builder.connect(&url).await.expect("connect"));
            let (n, latencies, not_replicated) = run(Arc::clone(&store), secs, concurrency).await;
            let at = |q: f64| {
                latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)]
            };
            println!(
                "{label}: {:.0} first requests/s ({concurrency} concurrent, {secs} s), \
                 completion median {:?}, p99 {:?}, not replicated in time {not_replicated}",
                n as f64 / secs as f64,
                at(0.5),
                at(0.99)
            );
            let client = redis::Client::open(url.as_str()).expect("url");
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("connection");
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{prefix}:*"))
                .query_async(&mut conn)
                .await
                .expect("KEYS");
            for chunk in keys.chunks(1000) {
                let _: i64 = redis::cmd("DEL")
                    .arg(chunk)
                    .query_async(&mut conn)
                    .await
                    .expect("DEL");
            }
        }
    });
}
