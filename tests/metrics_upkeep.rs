//! The examples' Prometheus recorder (examples/support/prometheus.rs) drains its histogram
//! samples on its own, without a scrape: a recorder installed with `install_recorder` keeps every
//! sample recorded (one per store operation) until `render` or `run_upkeep`, so a server nobody
//! scrapes grew without end (the hostile soak's PostgreSQL servers, 0.25 MB a minute).
//!
//! The heap is counted by this test binary's own allocator; the clock is Tokio's paused one, so
//! the upkeep's period passes without waiting for it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

#[allow(dead_code)]
#[path = "../examples/support/prometheus.rs"]
mod prometheus;

/// Bytes allocated and not yet freed, by anyone in this process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Store operations timed between two upkeeps, and how many upkeep periods the test covers.
const PER_PERIOD: usize = 10_000;
const PERIODS: usize = 20;

fn store_operations(n: usize) {
    for i in 0..n {
        metrics::histogram!(
            idempotent_runtime::observe::STORE_LATENCY,
            "op" => "claim",
            "store" => "postgres"
        )
        .record(0.001 * (i % 7) as f64);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn histogram_samples_are_drained_without_a_scrape() {
    let handle = prometheus::install();
    // The histogram, its buckets and the registry's entries, made once.
    store_operations(PER_PERIOD);
    tokio::time::sleep(prometheus::UPKEEP).await;
    store_operations(PER_PERIOD);
    tokio::time::sleep(prometheus::UPKEEP).await;
    let before = LIVE.load(Ordering::Relaxed);

    for _ in 0..PERIODS {
        store_operations(PER_PERIOD);
        tokio::time::sleep(prometheus::UPKEEP).await;
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;

    // Kept raw, the samples take 16.4 bytes each (blocks of 64 values and times): 3.3 MB here.
    // Drained every period, at most a period's or two stand (freed blocks wait for their epoch).
    let samples = (PER_PERIOD * PERIODS) as isize;
    assert!(
        grown < samples,
        "the heap grew by {grown} bytes over {samples} samples recorded with no scrape: the \
         recorder keeps them"
    );
    // Nothing was lost: a scrape still sees every sample.
    let text = handle.render();
    let count = text
        .lines()
        .find(|l| l.starts_with("idempotent_store_operation_seconds_count"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<usize>().ok());
    assert_eq!(count, Some(PER_PERIOD * (PERIODS + 2)), "{text}");
}
