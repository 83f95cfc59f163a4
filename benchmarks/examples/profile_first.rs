//! A loop for profilers (callgrind, perf): `n` in-process requests through one variant.
//!
//! ```text
//! valgrind --tool=callgrind target/release/examples/profile_first first 20000
//! ```
//!
//! Variants: `bare`, `first` (`#[idempotent]` on the memory store, a new key each request, the
//! store growing), `first-steady` (the same at a steady state: one second's retention, the
//! sweeper on),
//! `replay` (one key), `cached-first` / `cached-replay`, the same behind a `CachedStore`, and
//! `peer-replay`, a replay through the peer `axum-idempotent` (its session cookie set), and
//! `pg-first` / `pg-replay` on the PostgreSQL store at `DATABASE_URL` (the client side only:
//! the server's work is not in this process).

use std::fmt::Write as _;

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
            // The steady state of a long-running service: one second's retention and the
            // sweeper on, so records are freed as fast as they arrive (the loop yields to the
            // sweeper's task every 64 requests; its work is counted with theirs).
            "first-steady" => bench::idempotent_router(bench::steady_memory_store(
                std::time::Duration::from_secs(1),
                true,
            )),
            "cached-first" | "cached-replay" => {
                bench::idempotent_router(bench::cached_unbounded_memory_store())
            }
            "peer-replay" => bench::axum_idempotent_router(),
            "pg-first" | "pg-replay" => {
                let url = std::env::var("DATABASE_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
                bench::idempotent_router(bench::postgres_store(&url, 4, false).await)
            }
            _ => panic!(
                "variant: bare | first | first-steady | replay | cached-first | cached-replay | peer-replay | pg-first \
                 | pg-replay"
            ),
        };
        // PostgreSQL keeps the keys of earlier runs: this run's are its own.
        let run = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos();
        // One key buffer for the whole loop: the client's formatting is not the server's
        // work, and `bare` gets the same keys as `first`, so both build the same requests.
        let mut key = String::with_capacity(32);
        for i in 0..n {
            key.clear();
            match variant.as_str() {
                "replay" | "cached-replay" | "peer-replay" => key.push_str("replayed"),
                "pg-replay" => write!(key, "replayed-{run}").expect("a String takes any write"),
                "pg-first" => write!(key, "first-{run}-{i}").expect("a String takes any write"),
                _ => write!(key, "first-{i}").expect("a String takes any write"),
            }
            if variant == "first-steady" && i % 64 == 0 {
                tokio::task::yield_now().await;
            }
            let mut request = bench::request(body, Some(&key));
            if variant == "peer-replay" {
                // The peer records only for a request with a session (as `wrk/replay.lua`).
                let session = http::HeaderValue::from_static("session=000000000000000000000A");
                request.headers_mut().insert(http::header::COOKIE, session);
            }
            let response = router
                .clone()
                .oneshot(request)
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
