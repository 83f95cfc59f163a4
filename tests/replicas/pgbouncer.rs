//! Conformance servers on the PostgreSQL store behind PgBouncer in transaction pooling mode
//! (`scripts/pgbouncer start`), started with `--transaction-pooler`: the replica race, enlisted
//! requests writing through their transaction, and the refusal of a server started without the
//! setting.
//!
//! Reads `PGBOUNCER_URL` and `DATABASE_URL` (each test makes a database of its own directly and
//! reaches it through the pooler); without them each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_PGBOUNCER=1` / `IDEMPOTENT_REQUIRE_DB=1`, when it fails.
//!
//! ```text
//! PGBOUNCER_URL=$(scripts/pgbouncer start) DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features --test replicas pgbouncer::
//! ```

use std::process::{Command, Stdio};
use std::sync::Arc;

use serde_json::json;

use super::shared::{Replicas, SERVER, race};
use crate::support::harness::Server;
use crate::support::{PooledDatabase, example_binary};

impl Replicas for PooledDatabase {
    fn start(&self, extra: &[&str]) -> Server {
        let url = self.url();
        let mut options = vec![
            "--store",
            "postgres",
            "--database-url",
            &url,
            "--transaction-pooler",
        ];
        options.extend_from_slice(extra);
        Server::start(SERVER, &options)
    }
}

/// The replica race through the pooler: 1,000 keys, each sent 16 times at once across two
/// replicas, ran exactly 1,000 handlers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_behind_pgbouncer_run_each_key_exactly_once() {
    let Some(db) = PooledDatabase::new("pgbouncer") else {
        return;
    };
    race::<1_000, 16, 8>(&db).await;
}

/// Enlisted requests through the pooler: 100 keys, each sent 4 times at once across two
/// replicas (8 keys at a time), each handler inserting a ledger row through the request's transaction: one
/// execution and one committed row a key, every other copy a replay or 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enlisted_requests_behind_pgbouncer_commit_each_key_once() {
    let Some(db) = PooledDatabase::new("pgbouncer_enlisted") else {
        return;
    };
    let replicas = Arc::new([db.start(&[]), db.start(&[])]);
    let mut originals = vec![0; 100];
    // Eight keys at a time, as the replica race sends them: each enlisted request holds one of
    // its replica's 10 pooled connections for its whole transaction, and a flood of them
    // would only measure the pool's acquire timeout (503).
    for keys in (0..100).collect::<Vec<usize>>().chunks(8) {
        let mut sends = Vec::new();
        for &k in keys {
            for i in 0..4 {
                let replicas = Arc::clone(&replicas);
                sends.push(tokio::spawn(async move {
                    let r = replicas[i % 2]
                        .post("/ledger")
                        .key(&format!("ledger-{k}"))
                        .json(&json!({}))
                        .send()
                        .await;
                    (k, r)
                }));
            }
        }
        for send in sends {
            let (k, r) = send.await.unwrap();
            match r.status {
                201 if !r.replayed() => originals[k] += 1,
                201 => {}
                409 => r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS"),
                other => panic!("ledger-{k}: {other} {:?}", r.body),
            }
        }
    }
    assert!(
        originals.iter().all(|&n| n == 1),
        "keys answered by more or fewer than one execution: {originals:?}"
    );
    let runs = replicas[0].runs("/ledger").await + replicas[1].runs("/ledger").await;
    assert_eq!(runs, 100, "handler runs across both replicas");
    let rows = replicas[0].get("/ledger").await.json();
    assert_eq!(rows["rows"], 100, "committed ledger rows");
}

/// A server on the store's default settings behind the pooler does not start: `migrate()`
/// finds the store's `lock_timeout` dropped and the error names the setting.
#[tokio::test]
async fn a_server_without_the_setting_behind_pgbouncer_refuses_to_start_naming_it() {
    let Some(db) = PooledDatabase::new("pgbouncer_refused") else {
        return;
    };
    let out = tokio::task::spawn_blocking(move || {
        Command::new(example_binary(SERVER))
            .args(["--addr", "127.0.0.1:0", "--store", "postgres"])
            .args(["--database-url", &db.url()])
            .env_remove("IDEMPOTENT_LOG")
            .stdin(Stdio::null())
            .output()
            .expect("run the server")
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).is_empty(),
        "it listened before refusing"
    );
    assert!(
        stderr.contains("transaction_pooler(true)") && stderr.contains("lock_timeout"),
        "the refusal does not name the fix: {stderr}"
    );
}
