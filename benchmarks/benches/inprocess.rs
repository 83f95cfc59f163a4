//! In-process costs through axum with tower's `oneshot`: the bare handler against the same
//! handler under `#[idempotent]` on the memory store (a first request with a new key each
//! iteration, and a replay of one key), and fingerprinting alone at 1 KiB, 64 KiB and 1 MiB.
//! Each iteration posts the 1 KiB JSON body and reads the whole response body; building the
//! request (and its key) is setup, outside the measurement.
//!
//! `cargo bench -p idempotent-benchmarks --bench inprocess`

use std::hint::black_box;
use std::sync::LazyLock;

use axum::Router;
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use http_body_util::BodyExt;
use idempotent_benchmarks as bench;
use idempotent_runtime::fingerprint::FingerprintInput;
use idempotent_runtime::scope::{Identity, Scope};
use idempotent_runtime::test_helpers::fingerprint;
use tower::ServiceExt;

static BODY: LazyLock<Vec<u8>> = LazyLock::new(bench::order_body);

fn body() -> &'static [u8] {
    BODY.as_slice()
}

async fn call(router: &Router, request: axum::extract::Request) -> (u16, bytes::Bytes) {
    let (status, _, body) = call_replayed(router, request).await;
    (status, body)
}

/// Status, whether it carries `Idempotency-Replayed: true`, and the body.
async fn call_replayed(
    router: &Router,
    request: axum::extract::Request,
) -> (u16, bool, bytes::Bytes) {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, replayed, body)
}

fn handler(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let bare = bench::bare_router();
    let ours = rt.block_on(async { bench::idempotent_router(bench::unbounded_memory_store()) });
    // The steady state of a long-running service: records kept 2 s and swept as they expire,
    // so the store stops growing (the unbounded one above grows by a record an iteration, and
    // its first requests write into ever-fresh memory). Its sweeper runs on a runtime of its
    // own: a current-thread runtime whose `block_on` finishes at the future's first poll (as
    // every request here does) never runs its other tasks, so a sweeper spawned on `rt` would
    // never sweep and the "steady" store would grow like the other.
    let sweeping = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let steady = sweeping.block_on(async {
        let store = bench::steady_memory_store(std::time::Duration::from_secs(2), true);
        bench::idempotent_router(store)
    });

    // Every variant answers what it should before it is timed: the first request runs (not
    // marked replayed), and the "replay" is one (marked, the original's body), so a replay
    // that re-ran the handler is not measured as one.
    rt.block_on(async {
        assert_eq!(call(&bare, bench::request(body(), Some("k"))).await.0, 201);
        let (status, replayed, first) =
            call_replayed(&ours, bench::request(body(), Some("r"))).await;
        assert_eq!((status, replayed), (201, false), "the first request runs");
        for _ in 0..3 {
            let (status, replayed, again) =
                call_replayed(&ours, bench::request(body(), Some("r"))).await;
            assert_eq!(status, 201);
            assert!(replayed, "the replay variant must measure replays");
            assert_eq!(again, first, "a replay answers the original body");
            assert_eq!(again.len(), bench::BODY_LEN);
        }
    });

    let mut group = c.benchmark_group("axum_1KiB");
    group.bench_function("bare", |b| {
        b.iter_batched(
            || bench::request(body(), Some("bare")),
            |request| rt.block_on(call(&bare, request)),
            BatchSize::SmallInput,
        )
    });
    let mut n = 0u64;
    for (name, router) in [
        ("idempotent_memory_first", &ours),
        ("idempotent_memory_first_steady", &steady),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || {
                    n += 1;
                    bench::request(body(), Some(&format!("first-{n}")))
                },
                |request| rt.block_on(call(router, request)),
                BatchSize::SmallInput,
            )
        });
    }
    group.bench_function("idempotent_memory_replay", |b| {
        b.iter_batched(
            || bench::request(body(), Some("r")),
            |request| rt.block_on(call(&ours, request)),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

fn fingerprinting(c: &mut Criterion) {
    let scope = Scope::from_identity(&Identity::subject("acme", "alice"), None).expect("scope");
    let mut group = c.benchmark_group("fingerprint");
    for size in [1 << 10, 64 << 10, 1 << 20] {
        let body = vec![b'x'; size];
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::from_parameter(size), &body, |b, body| {
            b.iter(|| {
                let input = FingerprintInput {
                    method: "POST",
                    route: Some(bench::ROUTE),
                    path_params: &[],
                    query: None,
                    scope: &scope,
                    content_type: Some(b"application/json"),
                    body,
                };
                fingerprint::compute(black_box(&input), None)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, handler, fingerprinting);
criterion_main!(benches);
