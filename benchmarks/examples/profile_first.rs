//! A loop for profilers (callgrind, perf): `n` in-process requests through one variant.
//!
//! ```text
//! valgrind --tool=callgrind target/release/examples/profile_first first 20000
//! ```
//!
//! Variants: `bare`, `first` (`#[idempotent]` on the memory store, a new key each request),
//! `replay` (one key), and `cached-first` / `cached-replay`, the same behind a `CachedStore`.

use http_body_util::BodyExt;
use idempotent_benchmarks as bench;
use tower::ServiceExt;

fn main() {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_else(|| "first".into());
    let n: u64 = args.next().map_or(20_000, |s| s.parse().expect("a count"));
    let body: &'static [u8] = Box::leak(bench::order_body().into_boxed_slice());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let router = match variant.as_str() {
            "bare" => bench::bare_router(),
            "first" | "replay" => bench::idempotent_router(bench::unbounded_memory_store()),
            "cached-first" | "cached-replay" => {
                bench::idempotent_router(bench::cached_unbounded_memory_store())
            }
            _ => panic!("variant: bare | first | replay | cached-first | cached-replay"),
        };
        for i in 0..n {
            let key = match variant.as_str() {
                "first" | "cached-first" => format!("first-{i}"),
                _ => "replayed".to_owned(),
            };
            let response = router
                .clone()
                .oneshot(bench::request(body, Some(&key)))
                .await
                .expect("infallible");
            assert_eq!(response.status(), 201);
            let bytes = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            assert_eq!(bytes.len(), bench::BODY_LEN);
        }
        // Tearing a store of `n` records down is not what is being profiled.
        std::mem::forget(router);
    });
}
