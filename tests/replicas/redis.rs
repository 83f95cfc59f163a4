//! Conformance servers sharing one Redis (DESIGN.md §3, §5): two replicas racing on the same
//! keys, and a replica killed mid-handler.
//!
//! Reads `REDIS_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_REDIS=1`, when it fails. Each test's replicas share a key prefix of
//! their own.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379/0 \
//!     cargo test --all-features -p idempotent-examples --test replicas redis::
//! ```

use std::time::{Duration, Instant};

use serde_json::json;

use super::shared::{Replicas, SERVER, SLOW, assert_taken_over_once, kill_one_mid_handler, race};
use crate::support::harness::Server;
use crate::support::redis_url;

/// Replicas on one Redis under one key prefix.
struct Shared {
    url: String,
    prefix: String,
}

impl Shared {
    fn new(what: &str) -> Option<Self> {
        Some(Self {
            url: redis_url()?,
            prefix: format!(
                "replicas-{what}-{:016x}",
                idempotent_runtime::store::FencingToken::mint().0
            ),
        })
    }
}

impl Replicas for Shared {
    fn start(&self, extra: &[&str]) -> Server {
        let mut options = vec![
            "--store",
            "redis",
            "--database-url",
            &self.url,
            "--redis-prefix",
            &self.prefix,
        ];
        options.extend_from_slice(extra);
        Server::start(SERVER, &options)
    }
}

/// 100 keys, each sent 8 times at once, split across two replicas: every handler ran exactly
/// once per key, and every answer is the original, an identical replay, or 409 in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_run_each_key_exactly_once() {
    let Some(shared) = Shared::new("race") else {
        return;
    };
    race::<100, 8, 8>(&shared).await;
}

/// A replica killed (SIGKILL) mid-handler leaves its reservation: the key answers 409 until
/// the lease lapses, then another replica takes it over and runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_handler_blocks_its_key_until_the_lease_lapses() {
    let Some(shared) = Shared::new("kill") else {
        return;
    };
    let (survivor, killed_at) = kill_one_mid_handler(&shared).await;
    let path = SLOW;

    // Retry like a client until the key is taken over.
    let deadline = Instant::now() + Duration::from_secs(30);
    let taken_over = loop {
        let r = survivor
            .post(path)
            .key("crash-key")
            .json(&json!({}))
            .send()
            .await;
        if r.status != 409 {
            break r;
        }
        r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        assert!(Instant::now() < deadline, "the key never became free again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("taken over {:?} after the kill", killed_at.elapsed());
    assert_taken_over_once(&survivor, taken_over).await;
}
