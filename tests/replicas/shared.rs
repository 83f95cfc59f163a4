//! The replica harness both stores share: two conformance servers on one store racing on the
//! same keys, and one of them killed mid-handler. Each store's module says how its replicas
//! share the store (a schema of the test's own, a key prefix of its own) and how fast a
//! killed replica's key must come free.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use crate::support::harness::{Resp, Server};

/// The server every replica runs.
pub const SERVER: &str = "conformance_axum";

/// The route the killed replica was running: 3 s, longer than the 2 s lease.
pub const SLOW: &str = "/slow?ms=3000";

/// Replicas sharing one store, each test's own.
pub trait Replicas {
    /// A replica on the shared store, with `extra` options.
    fn start(&self, extra: &[&str]) -> Server;
}

/// `KEYS` keys, each sent `SENDS` times at once (`KEYS_AT_ONCE` keys at a time), split across
/// two replicas: every handler ran exactly once per key, and every answer is the original, an
/// identical replay, or 409 in progress.
pub async fn race<const KEYS: usize, const SENDS: usize, const KEYS_AT_ONCE: usize>(
    shared: &impl Replicas,
) {
    let replicas = Arc::new([shared.start(&[]), shared.start(&[])]);

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

/// Two replicas with a 2 s lease; the first killed (SIGKILL) while it runs [`SLOW`] under
/// `crash-key`, after which the key answers the survivor 409 and its handler has not run
/// there. The survivor, and when the first was killed.
pub async fn kill_one_mid_handler(shared: &impl Replicas) -> (Server, Instant) {
    // A 2 s lease, renewed every 2/3 s while the handler lives; the handler takes 3 s.
    let doomed = shared.start(&["--lease", "2"]);
    let survivor = shared.start(&["--lease", "2"]);
    let path = SLOW;

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
    (survivor, killed_at)
}

/// The survivor's answer once it took the key over: the original, run once there, and replayed
/// after.
pub async fn assert_taken_over_once(survivor: &Server, taken_over: Resp) {
    let path = SLOW;
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
