//! Conformance servers sharing one PostgreSQL database (DESIGN.md §3, §5): two replicas racing
//! on the same keys, and a replica killed mid-handler.
//!
//! Reads `DATABASE_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Each test works in a schema of its own, selected
//! through the URL's `search_path`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features -p idempotent-examples --test replicas postgres::
//! ```

use std::time::Duration;

use serde_json::json;

use super::shared::{Replicas, SERVER, SLOW, assert_taken_over_once, kill_one_mid_handler, race};
use crate::support::Schema;
use crate::support::harness::{Server, on_postgres};

impl Replicas for Schema {
    fn start(&self, extra: &[&str]) -> Server {
        on_postgres(SERVER, self, extra)
    }
}

/// 1,000 keys, each sent 16 times at once, split across two replicas: every handler ran exactly
/// once per key, and every answer is the original, an identical replay, or 409 in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_run_each_key_exactly_once() {
    let Some(schema) = Schema::new("replicas").await else {
        return;
    };
    race::<1_000, 16, 8>(&schema).await;
}

/// A replica killed (SIGKILL) mid-handler leaves its reservation: the key answers 409 until
/// the lease lapses, then another replica takes it over and runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_handler_blocks_its_key_until_the_lease_lapses() {
    let Some(schema) = Schema::new("replicas").await else {
        return;
    };
    let (survivor, killed_at) = kill_one_mid_handler(&schema).await;
    let path = SLOW;

    // Retry like a client until the key is taken over, every 50 ms: the takeover must come no
    // earlier than the lease less the third a renewal may have taken off it (less a margin),
    // and no later than the lease plus slack.
    let lease = Duration::from_secs(2);
    let mut probes = 1;
    let (taken_over, freed) = loop {
        let sent = killed_at.elapsed();
        let r = survivor
            .post(path)
            .key("crash-key")
            .json(&json!({}))
            .send()
            .await;
        if r.status != 409 {
            break (r, sent);
        }
        r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        probes += 1;
        assert!(
            killed_at.elapsed() < lease + Duration::from_millis(1500),
            "the key was still held {:?} after the kill (lease {lease:?})",
            killed_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("taken over {freed:?} after the kill, after {probes} x 409");
    assert!(
        freed >= lease * 2 / 3 - Duration::from_millis(100),
        "taken over {freed:?} after the kill, before a {lease:?} lease could have lapsed"
    );
    assert!(
        freed <= lease + Duration::from_secs(1),
        "taken over only {freed:?} after the kill (lease {lease:?})"
    );
    assert_taken_over_once(&survivor, taken_over).await;
}
