//! What trying the release examples as a new user found (#20), over real HTTP against both
//! conformance servers: a layered route's unserved method never burns the key, two
//! `Content-Type` lines are one fingerprinted value, a broken body is a problem, both forms of a
//! SQLite URL open one file, and an enlisted pool that handlers fill still answers duplicates
//! and replays at once.

use std::time::{Duration, Instant};

use crate::support::harness::{self, Server};
use serde_json::json;

/// PATCH with a key to a POST-only route behind the layer or middleware is the router's
/// refusal and is not recorded: the POST with the same key then runs, and its repeat replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unserved_method_does_not_burn_the_key_of_a_layered_route() {
    for name in harness::SERVERS {
        let s = Server::start(name, &[]);
        let mut routes = vec![("/search?q=1", "/search")];
        if *name == "conformance_actix" {
            routes.push(("/shops/1/orders", "/shops/{shop}/orders"));
        }
        for (path, route) in routes {
            let key = format!("k-patch-{route}");
            let patch = format!(
                "PATCH {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nIdempotency-Key: {key}\r\n\
                 Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
            );
            let refused = s.raw(patch.as_bytes());
            assert!(
                matches!(refused.status, 404 | 405),
                "{name} {path}: {}",
                refused.text
            );
            assert_eq!(s.runs(route).await, 0, "{name} {path}");
            let post = s.post(path).key(&key).json(&json!({})).send().await;
            assert!(
                matches!(post.status, 200 | 201),
                "{name} {path}: the POST after the PATCH: {} {:?}",
                post.status,
                post.body
            );
            assert!(!post.replayed(), "{name} {path}");
            assert_eq!(post.json()["execution"], 1, "{name} {path}");
            let again = s.post(path).key(&key).json(&json!({})).send().await;
            assert!(again.replayed(), "{name} {path}");
            assert_eq!(again.body, post.body);
            assert_eq!(s.runs(route).await, 1, "{name} {path}");
        }
    }
}

/// Two `Content-Type` lines are fingerprinted as their combined value: changing the second
/// line is another request (422), repeating both lines replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_content_type_lines_are_fingerprinted_together() {
    for name in harness::SERVERS {
        let s = Server::start(name, &[]);
        let send = |second: &str| {
            let request = format!(
                "POST /slow?ms=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                 Idempotency-Key: k-types\r\nContent-Type: application/json\r\n\
                 Content-Type: {second}\r\nContent-Length: 2\r\n\r\n{{}}"
            );
            s.raw(request.as_bytes())
        };
        let first = send("text/plain");
        assert_eq!(first.status, 201, "{name}: {}", first.text);
        let other = send("application/xml");
        assert_eq!(other.status, 422, "{name}: {}", other.text);
        assert_eq!(other.json()["code"], "IDEMPOTENCY_KEY_REUSED", "{name}");
        let again = send("text/plain");
        assert_eq!(again.status, 201, "{name}: {}", again.text);
        assert!(
            again
                .text
                .to_ascii_lowercase()
                .contains("idempotency-replayed: true"),
            "{name}: {}",
            again.text
        );
        assert_eq!(s.runs("/slow").await, 1, "{name}");
    }
}

/// A body broken mid-read (bad chunking) is 400 `IDEMPOTENCY_BODY_INVALID` as
/// problem+json, and nothing was claimed: the intact request with the same key runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_broken_mid_read_is_problem_body_invalid() {
    for name in harness::SERVERS {
        let s = Server::start(name, &[]);
        let broken = "POST /orders HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                      Idempotency-Key: k-broken\r\nContent-Type: application/json\r\n\
                      Transfer-Encoding: chunked\r\n\r\n5\r\n{\"sku\r\nzz\r\n";
        let refused = s.raw(broken.as_bytes());
        assert_eq!(refused.status, 400, "{name}: {}", refused.text);
        let head = refused.text.to_ascii_lowercase();
        assert!(
            head.contains("content-type: application/problem+json"),
            "{name}: {}",
            refused.text
        );
        assert_eq!(refused.json()["code"], "IDEMPOTENCY_BODY_INVALID", "{name}");
        assert_eq!(s.runs("/orders").await, 0, "{name}");
        let order = json!({"sku": "book", "quantity": 1});
        let intact = s.post("/orders").key("k-broken").json(&order).send().await;
        assert_eq!(intact.status, 201, "{name}: {:?}", intact.body);
        assert!(!intact.replayed(), "{name}");
    }
}

/// `sqlite://PATH?mode=rwc` and the plain `PATH` open the same file: a restart that switches
/// forms replays, and no file named after the query appears.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sqlite_url_forms_reach_one_file() {
    for name in harness::SERVERS {
        let dir =
            std::env::temp_dir().join(format!("idem-sqlite-forms-{}-{}", std::process::id(), name));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.db");
        let plain = path.to_str().unwrap().to_owned();
        let url = format!("sqlite://{plain}?mode=rwc");
        let order = json!({"sku": "book", "quantity": 1});
        let first = {
            let s = Server::start(name, &["--store", "sqlite", "--database-url", &url]);
            s.post("/orders").key("k-file").json(&order).send().await
        };
        assert_eq!(first.status, 201, "{name}: {:?}", first.body);
        assert!(path.exists(), "{name}: {path:?} was not created");
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(
            files.iter().all(|f| !f.contains('?')),
            "{name}: the query became a file name: {files:?}"
        );
        for form in [plain.as_str(), url.as_str()] {
            let s = Server::start(name, &["--store", "sqlite", "--database-url", form]);
            let again = s.post("/orders").key("k-file").json(&order).send().await;
            assert_eq!(again.status, 201, "{name} {form}");
            assert!(again.replayed(), "{name} {form}: the key ran again");
            assert_eq!(again.body, first.body, "{name} {form}");
            assert_eq!(s.runs("/orders").await, 0, "{name} {form}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Two replicas on one database, the first with every pooled connection held by enlisted
/// handlers: a duplicate of one of them, a duplicate of a request the other replica runs, and a
/// replay are all answered at once (409, 409, replay), never after the pool's acquire timeout;
/// and the committed ledger rows equal the handlers' executions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_enlisted_pool_still_answers_duplicates_and_replays_at_once() {
    const POOL: usize = 10; // the store's default pool size, which the servers keep
    for name in harness::SERVERS {
        let Some(schema) = crate::support::Schema::new("ledger").await else {
            return;
        };
        let url = schema.url();
        let options = ["--store", "postgres", "--database-url", url.as_str()];
        let a = std::sync::Arc::new(Server::start(name, &options));
        let b = std::sync::Arc::new(Server::start(name, &options));

        let done = a.post("/ledger?ms=0").key("k-done").send().await;
        assert_eq!(done.status, 201, "{name}: {:?}", done.body);

        let mut holding = Vec::new();
        for i in 0..POOL {
            let a = std::sync::Arc::clone(&a);
            holding.push(tokio::spawn(async move {
                a.post("/ledger?ms=3000")
                    .key(&format!("k-hold-{i}"))
                    .send()
                    .await
            }));
        }
        let elsewhere = {
            let b = std::sync::Arc::clone(&b);
            tokio::spawn(async move { b.post("/ledger?ms=3000").key("k-b").send().await })
        };
        a.wait_runs("/ledger", 1 + POOL as u64).await;
        b.wait_runs("/ledger", 1).await;

        let timed = |key: &'static str| {
            let a = std::sync::Arc::clone(&a);
            async move {
                let started = Instant::now();
                let r = a.post("/ledger?ms=3000").key(key).send().await;
                (r, started.elapsed())
            }
        };
        let (local, local_took) = timed("k-hold-3").await;
        local.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        let (remote, remote_took) = timed("k-b").await;
        remote.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        let started = Instant::now();
        let replay = a.post("/ledger?ms=0").key("k-done").send().await;
        let replay_took = started.elapsed();
        assert_eq!(replay.status, 201, "{name}: {:?}", replay.body);
        assert!(replay.replayed(), "{name}");
        assert_eq!(replay.body, done.body);
        eprintln!(
            "{name}, pool full: local duplicate {local_took:?}, other replica's duplicate \
             {remote_took:?}, replay {replay_took:?}"
        );
        // Generous bounds: before, each of these waited for the pool's 2 s acquire timeout.
        for (what, took) in [
            ("local duplicate", local_took),
            ("other replica's duplicate", remote_took),
            ("replay", replay_took),
        ] {
            assert!(
                took < Duration::from_secs(1),
                "{name}: {what} took {took:?}"
            );
        }

        for held in holding {
            let r = held.await.unwrap();
            assert_eq!(r.status, 201, "{name}: {:?}", r.body);
        }
        assert_eq!(elsewhere.await.unwrap().status, 201, "{name}");
        let executions = a.runs("/ledger").await + b.runs("/ledger").await;
        assert_eq!(executions, 1 + POOL as u64 + 1, "{name}");
        let rows = a.get("/ledger").await.json()["rows"].as_u64().unwrap();
        assert_eq!(
            rows, executions,
            "{name}: ledger rows differ from executions"
        );
    }
}
