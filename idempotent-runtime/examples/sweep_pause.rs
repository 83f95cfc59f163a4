//! How long the sweeper takes to free expired records from a large in-memory store, and the
//! longest pause a request on the same (single) worker thread sees meanwhile.
//!
//! `cargo run --release -p idempotent-runtime --example sweep_pause [-- TOTAL EXPIRED]`
//!
//! Fills a store with TOTAL (default 1,000,000) completed records, EXPIRED (default 100,000) of
//! them past their retention, then runs the sweeper on a one-thread runtime beside a task that
//! claims and completes new keys in a loop, timing the gap between its iterations.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_runtime::clock::ManualClock;
use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, Store, spawn_sweeper,
};

fn request<'a>(scope: &'a [u8; 32], key: &'a str, retention: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        quota_bucket: u64::from(scope[0]),
        fingerprint: Fingerprint {
            version: 1,
            digest: [7; 32],
        },
        token: FencingToken::mint(),
        lease: Duration::from_secs(60),
        retention,
        route: "/orders",
    }
}

/// Time this thread has spent on a CPU, from `/proc/thread-self/schedstat` (zero elsewhere): on a
/// busy machine the wall-clock gap between two requests includes the time the OS ran other
/// processes, which says nothing about the sweeper.
fn on_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = stat
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

async fn record(store: &MemoryStore, scope: &[u8; 32], key: &str, retention: Duration) {
    let req = request(scope, key, retention);
    assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
    let response = RecordedResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"{\"id\":1}"),
    };
    assert!(
        store
            .complete(scope, key, req.token, &response, retention)
            .await
            .unwrap()
    );
}

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().expect("a count"));
    let total = args.next().unwrap_or(1_000_000);
    let expired = args.next().unwrap_or(100_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let clock = ManualClock::new();
        let unbounded = MemoryLimits {
            max_records: usize::MAX,
            max_bytes: usize::MAX,
            max_records_per_scope: usize::MAX,
            max_bytes_per_scope: usize::MAX,
            ..MemoryLimits::default()
        };
        let store = Arc::new(
            MemoryStore::builder()
                .limits(unbounded)
                .clock(clock.clone())
                .build(),
        );
        // Expiring and kept records interleaved, as arrival order mixes them.
        let every = (total / expired.max(1)).max(1);
        for i in 0..total {
            let scope = [(i % 251) as u8; 32];
            let key = format!("{:08x}-0000-4000-8000-{:012x}", i, i);
            let retention = if i % every == 0 { 1 } else { 86_400 };
            record(&store, &scope, &key, Duration::from_secs(retention)).await;
        }
        clock.advance(Duration::from_secs(120));
        let live = store.len() - total.div_ceil(every);

        let dyn_store: Arc<dyn Store> = store.clone();
        let started = Instant::now();
        let cpu_at_start = on_cpu();
        let sweeper = spawn_sweeper(Arc::downgrade(&dyn_store), Duration::from_secs(3600), 500);
        let mut longest = Duration::ZERO;
        let mut longest_on_cpu = Duration::ZERO;
        let mut requests = 0u64;
        let mut last = Instant::now();
        let mut last_cpu = on_cpu();
        let scope = [3u8; 32];
        while store.len() > live + requests as usize {
            let key = format!("during-{requests}");
            record(&store, &scope, &key, Duration::from_secs(86_400)).await;
            requests += 1;
            tokio::task::yield_now().await;
            let now = Instant::now();
            longest = longest.max(now - last);
            last = now;
            let cpu = on_cpu();
            longest_on_cpu = longest_on_cpu.max(cpu - last_cpu);
            last_cpu = cpu;
        }
        let took = started.elapsed();
        sweeper.abort();
        println!(
            "swept {} expired among {total} in {took:?} ({:?} on the CPU); longest pause between \
             requests {longest:?} wall clock, {longest_on_cpu:?} on the CPU ({requests} requests \
             served meanwhile)",
            total.div_ceil(every),
            on_cpu() - cpu_at_start
        );
    });
}
