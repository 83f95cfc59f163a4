//! Conformance servers sharing one Redis (DESIGN.md §3, §5): two replicas racing on the same
//! keys, and a replica killed mid-handler.
//!
//! Reads `REDIS_URL`; when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_REDIS=1`, when it fails. Each test's replicas share a key prefix of
//! their own.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379/0 \
//!     cargo test --all-features -p idempotent-examples --test replicas_redis
//! ```

#[allow(dead_code)]
#[path = "conformance/harness.rs"]
mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{Resp, Server};
use idempotent_examples::testkit::redis_url;
use serde_json::json;

const SERVER: &str = "conformance_axum";

/// Replicas on one Redis under one key prefix.
struct Replicas {
    url: String,
    prefix: String,
}

impl Replicas {
    fn new(what: &str) -> Option<Self> {
        Some(Self {
            url: redis_url()?,
            prefix: format!(
                "replicas-{what}-{:016x}",
                idempotent_runtime::store::FencingToken::mint().0
            ),
        })
    }

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
    let Some(shared) = Replicas::new("race") else {
        return;
    };
    let replicas = Arc::new([shared.start(&[]), shared.start(&[])]);
    const KEYS: usize = 100;
    const SENDS: usize = 8;
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
    let Some(shared) = Replicas::new("kill") else {
        return;
    };
    // A 2 s lease, renewed every 2/3 s while the handler lives; the handler takes 3 s.
    let doomed = shared.start(&["--lease", "2"]);
    let survivor = shared.start(&["--lease", "2"]);
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
