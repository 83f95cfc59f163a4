//! Core costs without any web framework: fingerprinting, and the store round trips of a first
//! request (claim + complete) and a replay on the in-memory store.
//!
//! `cargo bench -p idempotent-runtime --features testing --bench core` (it drives the request
//! sequence through the hidden `test_helpers`, which the `testing` feature compiles).

use std::hint::black_box;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idempotent_runtime::Idempotency;
use idempotent_runtime::config::EndpointConfig;
use idempotent_runtime::fingerprint::FingerprintInput;
use idempotent_runtime::key::IdempotencyKey;
use idempotent_runtime::scope::{Identity, Scope};
use idempotent_runtime::store::RecordedResponse;
use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
use idempotent_runtime::test_helpers;
use idempotent_runtime::test_helpers::fingerprint;
use idempotent_runtime::test_helpers::pipeline::{Begin, BeginRequest, begin};

fn input<'a>(scope: &'a Scope, body: &'a [u8]) -> FingerprintInput<'a> {
    FingerprintInput {
        method: "POST",
        route: Some("/shops/{shop}/orders"),
        path_params: &["7"],
        query: Some("b=2&a=1"),
        scope,
        content_type: Some(b"application/json"),
        body,
    }
}

fn fingerprinting(c: &mut Criterion) {
    let scope = Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap();
    let mut group = c.benchmark_group("fingerprint");
    for size in [1 << 10, 64 << 10, 1 << 20] {
        let body = vec![b'x'; size];
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::from_parameter(size), &body, |b, body| {
            b.iter(|| fingerprint::compute(black_box(&input(&scope, body)), None))
        });
    }
    group.finish();
}

fn memory_store(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Unbounded, so that millions of iterations measure the claim path, not the quota refusal.
    let store = MemoryStore::builder()
        .limits(MemoryLimits {
            max_records: usize::MAX,
            max_bytes: usize::MAX,
            max_records_per_scope: usize::MAX,
            max_bytes_per_scope: usize::MAX,
            ..MemoryLimits::default()
        })
        .build();
    let handle = rt.block_on(async { Idempotency::new(store) });
    let scope = Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap();
    let body = vec![b'x'; 1024];
    let endpoint = test_helpers::pipeline::effective(&EndpointConfig::REQUIRED, handle.config());
    let response = RecordedResponse::new(
        201,
        vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )],
        Bytes::from(vec![b'y'; 200]),
    );
    let mut group = c.benchmark_group("memory_store");
    let mut n = 0u64;
    group.bench_function("first_request_claim_complete", |b| {
        b.iter(|| {
            n += 1;
            let key = IdempotencyKey::new(&format!("key-{n}")).unwrap();
            rt.block_on(async {
                let req = BeginRequest {
                    key: &key,
                    input: input(&scope, &body),
                    endpoint: &endpoint,
                };
                match begin(&handle, &req).await {
                    Begin::Run(mut reservation) => reservation.complete(&response).await,
                    other => panic!("{other:?}"),
                }
            })
        })
    });
    let key = IdempotencyKey::new("replayed").unwrap();
    rt.block_on(async {
        let req = BeginRequest {
            key: &key,
            input: input(&scope, &body),
            endpoint: &endpoint,
        };
        match begin(&handle, &req).await {
            Begin::Run(mut reservation) => reservation.complete(&response).await,
            other => panic!("{other:?}"),
        }
    });
    group.bench_function("replay", |b| {
        b.iter(|| {
            rt.block_on(async {
                let req = BeginRequest {
                    key: &key,
                    input: input(&scope, &body),
                    endpoint: &endpoint,
                };
                match begin(&handle, &req).await {
                    Begin::Replay(r) => black_box(Arc::clone(&r)),
                    other => panic!("{other:?}"),
                }
            })
        })
    });
    group.finish();
}

criterion_group!(benches, fingerprinting, memory_store);
criterion_main!(benches);
