//! How long the sweeper takes to free expired records from a large in-memory store, and the
//! longest pause a request on the same (single) worker thread sees meanwhile, beside the same
//! requests without a sweep.
//!
//! `cargo run --release -p idempotent-runtime --features testing --example sweep_pause [-- TOTAL EXPIRED ANSWER]`
//!
//! Fills a store with TOTAL (default 1,000,000) completed records, EXPIRED (default 100,000) of
//! them past their retention. Then, on a one-thread runtime, a task claims and completes new keys
//! in a loop (each recording an ANSWER-byte body, default 1,024 as the benchmarks' handler's),
//! timing each
//! iteration: first 2,000 iterations without a sweep,
//! then while the sweeper (500 a batch) runs beside it. A pause is the time between two
//! iterations' ends, on the wall clock and on this thread's CPU clock
//! (`CLOCK_THREAD_CPUTIME_ID`: on a shared machine the wall clock also counts the time the OS
//! ran other processes, which says nothing about the sweeper).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_runtime::clock::ManualClock;
use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
use idempotent_runtime::store::{Claim, ClaimRequest, FencingToken, RecordedResponse, Store};
use idempotent_runtime::test_helpers::store::spawn_sweeper;

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
        response_room: 0,
    }
}

/// Time this thread has spent on a CPU. Not `/proc/thread-self/schedstat`, which the kernel
/// brings up to date only at its ticks (4 ms apart here) while the thread runs.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn on_cpu() -> Duration {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid `struct timespec` (two 64-bit fields on 64-bit Linux), written
    // only during the call.
    if unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn on_cpu() -> Duration {
    Duration::ZERO
}

async fn record(
    store: &MemoryStore,
    scope: &[u8; 32],
    key: &str,
    retention: Duration,
    body: Bytes,
) {
    let req = request(scope, key, retention);
    assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
    let response = RecordedResponse::new(201, vec![], body);
    assert!(
        store
            .complete(scope, key, req.token, &response, retention)
            .await
            .unwrap()
    );
}

/// Pauses between iterations of the request loop, on the wall clock and on the CPU.
#[derive(Default)]
struct Pauses {
    wall: Vec<Duration>,
    cpu: Vec<Duration>,
}

impl Pauses {
    fn summary(&mut self) -> String {
        self.wall.sort();
        self.cpu.sort();
        let p99 = |v: &[Duration]| v[(v.len() * 99 / 100).min(v.len() - 1)];
        format!(
            "{} requests, pause p99 {:.2?} / max {:.2?} wall clock, p99 {:.2?} / max {:.2?} on the CPU",
            self.wall.len(),
            p99(&self.wall),
            self.wall[self.wall.len() - 1],
            p99(&self.cpu),
            self.cpu[self.cpu.len() - 1],
        )
    }
}

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().expect("a count"));
    let total = args.next().unwrap_or(1_000_000);
    let expired = args.next().unwrap_or(100_000);
    // Below 1,009 bytes an answer is a small allocation for glibc, and nothing in the loop makes
    // a large one: the chunks the sweep frees are then merged all at once by whichever large
    // allocation comes next (see benchmarks/NOTES.md).
    let answer_len = args.next().unwrap_or(1_024);
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
        let small = Bytes::from_static(b"{\"id\":1}");
        for i in 0..total {
            let scope = [(i % 251) as u8; 32];
            let key = format!("{:08x}-0000-4000-8000-{:012x}", i, i);
            let retention = if i % every == 0 { 1 } else { 86_400 };
            record(
                &store,
                &scope,
                &key,
                Duration::from_secs(retention),
                small.clone(),
            )
            .await;
        }
        clock.advance(Duration::from_secs(120));
        let expiring = total.div_ceil(every);
        let live = store.len() - expiring;
        let scope = [3u8; 32];
        let day = Duration::from_secs(86_400);
        let answer = || Bytes::from(vec![b'x'; answer_len]);

        // The same loop without a sweep first (expired records stay until the sweep).
        let mut quiet = Pauses::default();
        let mut last = (Instant::now(), on_cpu());
        for i in 0..2_000 {
            record(&store, &scope, &format!("quiet-{i}"), day, answer()).await;
            tokio::task::yield_now().await;
            let now = (Instant::now(), on_cpu());
            quiet.wall.push(now.0 - last.0);
            quiet.cpu.push(now.1 - last.1);
            last = now;
        }
        let live = live + 2_000;

        let started = Instant::now();
        let cpu_at_start = on_cpu();
        let sweeper = spawn_sweeper(Arc::downgrade(&store), Duration::from_secs(3600), 500);
        let mut sweeping = Pauses::default();
        let mut last = (Instant::now(), on_cpu());
        let mut requests = 0;
        while store.len() > live + requests {
            record(&store, &scope, &format!("during-{requests}"), day, answer()).await;
            requests += 1;
            tokio::task::yield_now().await;
            let now = (Instant::now(), on_cpu());
            sweeping.wall.push(now.0 - last.0);
            sweeping.cpu.push(now.1 - last.1);
            last = now;
        }
        let took = started.elapsed();
        let took_cpu = on_cpu() - cpu_at_start;
        sweeper.abort();
        println!(
            "swept {expiring} expired among {total} in {took:.2?} ({took_cpu:.2?} on the CPU); \
             during the sweep: {}; without a sweep: {}",
            sweeping.summary(),
            quiet.summary(),
        );
    });
}
