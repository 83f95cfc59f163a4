//! How much memory a completed record costs in the in-memory store, and whether claim latency
//! stays flat as the store fills.
//!
//! `cargo run --release -p idempotent-runtime --example memory_footprint [-- RECORDS]`
//!
//! Fills a store with RECORDS (default 1,000,000) completed records of 200-byte bodies, reading
//! the process's resident memory before and after, then times claims on the full store against
//! claims on an empty one.

use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
use idempotent_runtime::store::{Claim, ClaimRequest, FencingToken, RecordedResponse, Store};

fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn request<'a>(scope: &'a [u8; 32], key: &'a str) -> ClaimRequest<'a> {
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
        retention: Duration::from_secs(3600),
        route: "/test",
        response_room: 0,
    }
}

async fn fill(store: &MemoryStore, records: usize) {
    // Keys shaped like UUIDs (36 bytes), the common client choice, spread over many scopes.
    for i in 0..records {
        let scope = [(i % 251) as u8; 32];
        let key = format!("{:08x}-0000-4000-8000-{:012x}", i, i);
        let req = request(&scope, &key);
        assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
        let response = RecordedResponse::new(
            201,
            vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            Bytes::from(vec![b'x'; 200]),
        );
        assert!(
            store
                .complete(
                    &scope,
                    &key,
                    req.token,
                    &response,
                    Duration::from_secs(3600)
                )
                .await
                .unwrap()
        );
    }
}

async fn claim_latencies(store: &MemoryStore, samples: usize) -> (Duration, Duration) {
    let scope = [255u8; 32];
    let mut times = Vec::with_capacity(samples);
    for i in 0..samples {
        let key = format!("probe-{i}");
        let req = request(&scope, &key);
        let start = Instant::now();
        let claimed = store.claim(&req).await.unwrap();
        times.push(start.elapsed());
        assert_eq!(claimed, Claim::Acquired);
        store.release(&scope, &key, req.token).await.unwrap();
    }
    times.sort();
    (times[samples / 2], times[samples * 99 / 100])
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let records: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let unbounded = MemoryLimits {
        max_records: usize::MAX,
        max_bytes: usize::MAX,
        max_records_per_scope: usize::MAX,
        max_bytes_per_scope: usize::MAX,
        ..MemoryLimits::default()
    };
    let empty = MemoryStore::builder().limits(unbounded).build();
    let (empty_p50, empty_p99) = claim_latencies(&empty, 100_000).await;

    let store = MemoryStore::builder().limits(unbounded).build();
    let before = resident_bytes();
    fill(&store, records).await;
    let after = resident_bytes();
    let per_record = (after - before) as f64 / records as f64;
    let (full_p50, full_p99) = claim_latencies(&store, 100_000).await;

    println!("records: {records}, body 200 B, key 36 B");
    println!(
        "resident per record: {per_record:.0} B ({:.0} B beyond the body)",
        per_record - 200.0
    );
    println!(
        "charged per record by the byte bound: {:.0} B",
        store.bytes() as f64 / records as f64
    );
    println!("claim latency, empty store: p50 {empty_p50:?}, p99 {empty_p99:?}");
    println!("claim latency, full store:  p50 {full_p50:?}, p99 {full_p99:?}");
    println!(
        "p99 ratio full/empty: {:.2}",
        full_p99.as_secs_f64() / empty_p99.as_secs_f64()
    );
}
