//! Conformance servers sharing one PostgreSQL database (DESIGN.md §3, §5): two replicas racing
//! on the same keys, and a replica killed mid-handler.
//!
//! Reads `DATABASE_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Each test works in a schema of its own, selected
//! through the URL's `search_path`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features -p idempotent-examples --test replicas_postgres
//! ```

#[allow(dead_code)]
#[path = "conformance/harness.rs"]
mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{Resp, Server};
use idempotent_examples::testkit::Schema;
use serde_json::json;

const SERVER: &str = "conformance_axum";

/// A schema of its own in the test database, dropped at the end.
/// Starting replicas on a test's own schema.
trait Replicas {
    fn start(&self, extra: &[&str]) -> Server;
}

impl Replicas for Schema {
    fn start(&self, extra: &[&str]) -> Server {
        let url = self.url();
        let mut options = vec!["--store", "postgres", "--database-url", &url];
        options.extend_from_slice(extra);
        Server::start(SERVER, &options)
    }
}

/// 1,000 keys, each sent 16 times at once, split across two replicas: every handler ran exactly
/// once per key, and every answer is the original, an identical replay, or 409 in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_run_each_key_exactly_once() {
    let Some(schema) = Schema::new("replicas").await else {
        return;
    };
    let replicas = Arc::new([schema.start(&[]), schema.start(&[])]);
    const KEYS: usize = 1_000;
    const SENDS: usize = 16;
    const KEYS_AT_ONCE: usize = 8;

    let mut answers: Vec<Vec<(usize, Resp)>> = Vec::with_capacity(KEYS);
    for batch in (0..KEYS).collect::<Vec<_>>().chunks(KEYS_AT_ONCE) {
        let tasks: Vec<_> = batch
            .iter()
            .map(|&k| {
                let replicas = Arc::clone(&replicas);
                tokio::spawn(async move {
                    let key = format!("replica-key-{k}");
                    let sends: Vec<_> = (0..SENDS)
                        .map(|i| {
                            let replicas = Arc::clone(&replicas);
                            let key = key.clone();
                            tokio::spawn(async move {
                                let r = replicas[i % 2]
                                    .post("/orders")
                                    .key(&key)
                                    .json(&json!({"sku": key, "quantity": 1}))
                                    .send()
                                    .await;
                                (i % 2, r)
                            })
                        })
                        .collect();
                    let mut out = Vec::with_capacity(SENDS);
                    for s in sends {
                        out.push(s.await.expect("send"));
                    }
                    out
                })
            })
            .collect();
        for t in tasks {
            answers.push(t.await.expect("key task"));
        }
    }

    let (mut originals, mut replays, mut in_progress) = (0, 0, 0);
    for (k, key_answers) in answers.iter().enumerate() {
        let first: Vec<_> = key_answers
            .iter()
            .filter(|(_, r)| r.status == 201 && !r.replayed())
            .collect();
        assert_eq!(
            first.len(),
            1,
            "replica-key-{k}: {} original answers (the handler ran more than once or never)",
            first.len()
        );
        let (_, original) = first[0];
        assert_eq!(original.json()["sku"], format!("replica-key-{k}"));
        for (replica, r) in key_answers {
            match r.status {
                201 if !r.replayed() => originals += 1,
                201 => {
                    replays += 1;
                    assert_eq!(r.body, original.body, "replica-key-{k}: replay differs");
                    assert_eq!(r.header("location"), original.header("location"));
                }
                409 => {
                    in_progress += 1;
                    r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
                }
                other => panic!(
                    "replica-key-{k}: replica {replica} answered {other}: {:?}",
                    r.body
                ),
            }
        }
    }
    let runs = replicas[0].runs("/orders").await + replicas[1].runs("/orders").await;
    eprintln!(
        "{originals} originals, {replays} replays, {in_progress} in progress; handler runs: \
         {} + {}",
        replicas[0].runs("/orders").await,
        replicas[1].runs("/orders").await
    );
    assert_eq!(runs, KEYS as u64, "handler runs across both replicas");
    assert!(
        replicas[0].runs("/orders").await > 0 && replicas[1].runs("/orders").await > 0,
        "both replicas ran handlers"
    );
}

/// A replica killed (SIGKILL) mid-handler leaves its reservation: the key answers 409 until
/// the lease lapses, then another replica takes it over and runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_handler_blocks_its_key_until_the_lease_lapses() {
    let Some(schema) = Schema::new("replicas").await else {
        return;
    };
    // A 2 s lease, renewed every 2/3 s while the handler lives; the handler takes 3 s.
    let doomed = schema.start(&["--lease", "2"]);
    let survivor = schema.start(&["--lease", "2"]);
    let path = "/slow?ms=3000";

    let in_flight = doomed
        .post(path)
        .key("crash-key")
        .json(&json!({}))
        .try_send();
    let in_flight = tokio::spawn(in_flight);
    doomed.wait_runs("/slow", 1).await;
    drop(doomed); // SIGKILL, mid-handler
    let killed_at = Instant::now();
    assert!(
        in_flight.await.expect("request task").is_err(),
        "the killed replica answered"
    );

    let r = survivor
        .post(path)
        .key("crash-key")
        .json(&json!({}))
        .send()
        .await;
    r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
    assert_eq!(survivor.runs("/slow").await, 0);

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
    assert_eq!(taken_over.status, 201, "{:?}", taken_over.body);
    assert!(!taken_over.replayed());
    assert_eq!(taken_over.json()["execution"], 1);
    assert_eq!(survivor.runs("/slow").await, 1, "the survivor ran it once");

    let replay = survivor
        .post(path)
        .key("crash-key")
        .json(&json!({}))
        .send()
        .await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, taken_over.body);
    assert_eq!(survivor.runs("/slow").await, 1);
}
