//! The black-box conformance suite (DESIGN.md §2–§4, ../shared/CONFORMANCE.md), written once
//! over real HTTP and run against every server in [`harness::SERVERS`]: each case starts its
//! own server process (with the options it needs) and drives it with an HTTP client, or with
//! raw TCP where a client library would refuse to send the hostile request.

use std::io::Write as _;
use std::time::Duration;

use crate::support::harness::{self, Resp, Server};
use serde_json::{Value, json};

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                for server in harness::SERVERS {
                    eprintln!("{} against {server}", stringify!($case));
                    cases::$case(server).await;
                }
            }
        )*

        /// The same cases with every server on `--store redis` (`REDIS_URL`; skipped when it
        /// is unset, unless `IDEMPOTENT_REQUIRE_REDIS=1`). A case that picks its own store
        /// keeps it.
        #[cfg(feature = "redis")]
        mod on_redis {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(url) = crate::support::redis_url() else { return };
                    for server in harness::SERVERS {
                        eprintln!("{} against {server} on Redis", stringify!($case));
                        harness::on_redis(url.clone(), cases::$case(server)).await;
                    }
                }
            )*
        }

        /// The same cases with every server on `--store postgres --transaction-pooler` behind
        /// PgBouncer in transaction mode (`PGBOUNCER_URL`, each server in a database of its
        /// own; skipped when it is unset, unless `IDEMPOTENT_REQUIRE_PGBOUNCER=1`). A case that
        /// picks its own store keeps it.
        #[cfg(feature = "postgres")]
        mod on_pgbouncer {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    if crate::support::pgbouncer_url().is_none()
                        || crate::support::database_url().is_none()
                    {
                        return;
                    }
                    for server in harness::SERVERS {
                        eprintln!("{} against {server} behind PgBouncer", stringify!($case));
                        harness::on_pgbouncer(cases::$case(server)).await;
                    }
                }
            )*
        }

        /// The same cases with every server on `--store mysql` (`MYSQL_URL`, each server in a
        /// database of its own; skipped when it is unset, unless `IDEMPOTENT_REQUIRE_MYSQL=1`).
        /// A case that picks its own store keeps it.
        #[cfg(feature = "mysql")]
        mod on_mysql {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(url) = crate::support::mysql_url() else { return };
                    for server in harness::SERVERS {
                        eprintln!("{} against {server} on MySQL", stringify!($case));
                        harness::on_mysql(url.clone(), cases::$case(server)).await;
                    }
                }
            )*
        }
    };
}

conformance! {
    first_request_runs_and_is_not_marked_replayed,
    replays_completed_response_with_replayed_header,
    repeat_while_running_is_409_in_progress_with_retry_after,
    reused_key_with_another_body_is_422,
    reuse_status_409_variant,
    missing_key_where_required_is_400,
    missing_status_428_variant,
    optional_key_absent_runs_every_time,
    optional_key_present_replays,
    malformed_keys_are_400_and_never_echoed,
    quoted_and_bare_keys_are_the_same_key,
    checks_run_in_the_documented_order,
    body_over_max_body_is_413,
    chunked_body_past_the_cap_is_413,
    slow_body_is_408,
    thirty_two_concurrent_requests_run_once,
    same_key_under_two_tenants_runs_twice,
    api_key_and_anonymous_callers_are_scoped_apart,
    path_parameters_are_fingerprinted,
    query_order_is_irrelevant_but_raw_pairs_matter,
    client_disconnect_does_not_cancel_the_handler,
    panic_frees_the_key,
    server_errors_and_non_replayable_statuses_are_not_recorded,
    client_errors_are_recorded,
    framework_rejection_of_malformed_json_is_recorded,
    response_over_max_response_is_sent_and_not_recorded,
    response_over_max_response_is_recorded_without_body_when_configured,
    lease_is_renewed_while_the_handler_runs,
    abandoned_reservation_is_reclaimed_after_its_lease_lapses,
    retention_lapses_and_the_key_runs_again,
    malformed_authorization_is_401_before_idempotency,
    other_methods_pass_through,
    standard_webhook_redeliveries_run_once,
    standard_webhook_with_a_bad_signature_claims_nothing,
    event_keyed_by_its_body_id_replays_a_new_envelope,
    event_key_mistakes_are_answered_as_the_contract_says,
    duplicates_wait_for_the_first_answer_when_asked,
}

mod cases {
    use super::*;

    fn order(quantity: i64) -> Value {
        json!({"sku": "book", "quantity": quantity})
    }

    async fn order_call(s: &Server, key: &str, body: &Value) -> Resp {
        s.post("/orders").key(key).json(body).send().await
    }

    pub async fn first_request_runs_and_is_not_marked_replayed(name: &'static str) {
        let s = Server::start(name, &[]);
        let r = order_call(&s, "k-first", &order(2)).await;
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
        assert_eq!(r.header("location"), Some("/orders/1"));
        assert_eq!(r.header("set-cookie"), Some("seen=1"));
        assert_eq!(
            r.json(),
            json!({"id": 1, "sku": "book", "quantity": 2, "execution": 1})
        );
        assert_eq!(s.runs("/orders").await, 1);
        let stored = s.get("/orders/1").await;
        assert_eq!(stored.status, 200);
        assert_eq!(stored.json()["sku"], "book");
    }

    pub async fn replays_completed_response_with_replayed_header(name: &'static str) {
        let s = Server::start(name, &[]);
        let first = order_call(&s, "k-replay", &order(3)).await;
        let again = order_call(&s, "k-replay", &order(3)).await;
        assert_eq!(first.status, 201);
        assert_eq!(again.status, 201);
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "replayed body differs");
        assert_eq!(again.header("location"), Some("/orders/1"));
        assert_eq!(again.header("content-type"), first.header("content-type"));
        assert_eq!(
            again.header("set-cookie"),
            None,
            "Set-Cookie must not be replayed"
        );
        assert_eq!(s.runs("/orders").await, 1);
    }

    pub async fn repeat_while_running_is_409_in_progress_with_retry_after(name: &'static str) {
        let s = Server::start(name, &[]);
        let first = s.post("/slow?ms=2000").key("k-slow").send();
        let first = tokio::spawn(first);
        s.wait_runs("/slow", 1).await;
        let during = s.post("/slow?ms=2000").key("k-slow").send().await;
        during.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        assert_eq!(during.header("retry-after"), Some("1"));
        let first = first.await.unwrap();
        assert_eq!(first.status, 201);
        assert!(!first.replayed());
        let after = s.post("/slow?ms=2000").key("k-slow").send().await;
        assert_eq!(after.status, 201);
        assert!(after.replayed());
        assert_eq!(after.body, first.body);
        assert_eq!(s.runs("/slow").await, 1);
    }

    pub async fn reused_key_with_another_body_is_422(name: &'static str) {
        let s = Server::start(name, &[]);
        assert_eq!(order_call(&s, "k-reuse", &order(1)).await.status, 201);
        let other = order_call(&s, "k-reuse", &order(2)).await;
        other.assert_problem(422, "IDEMPOTENCY_KEY_REUSED");
        assert_eq!(s.runs("/orders").await, 1);
    }

    pub async fn reuse_status_409_variant(name: &'static str) {
        let s = Server::start(name, &["--reuse-status", "409"]);
        assert_eq!(order_call(&s, "k-reuse", &order(1)).await.status, 201);
        order_call(&s, "k-reuse", &order(2))
            .await
            .assert_problem(409, "IDEMPOTENCY_KEY_REUSED");
        assert_eq!(s.runs("/orders").await, 1);
    }

    pub async fn missing_key_where_required_is_400(name: &'static str) {
        let s = Server::start(name, &[]);
        let r = s.post("/orders").json(&order(1)).send().await;
        r.assert_problem(400, "IDEMPOTENCY_KEY_REQUIRED");
        assert_eq!(s.runs("/orders").await, 0);
    }

    pub async fn missing_status_428_variant(name: &'static str) {
        let s = Server::start(name, &["--missing-status", "428"]);
        let r = s.post("/orders").json(&order(1)).send().await;
        r.assert_problem(428, "IDEMPOTENCY_KEY_REQUIRED");
        assert_eq!(s.runs("/orders").await, 0);
    }

    pub async fn optional_key_absent_runs_every_time(name: &'static str) {
        let s = Server::start(name, &[]);
        for n in 1..=2 {
            let r = s.post("/notes").json(&json!({"text": "hi"})).send().await;
            assert_eq!(r.status, 201);
            assert!(!r.replayed());
            assert_eq!(r.json(), json!({"execution": n}));
        }
        assert_eq!(s.runs("/notes").await, 2);
    }

    pub async fn optional_key_present_replays(name: &'static str) {
        let s = Server::start(name, &[]);
        let body = json!({"text": "hi"});
        let first = s.post("/notes").key("k-note").json(&body).send().await;
        let again = s.post("/notes").key("k-note").json(&body).send().await;
        assert_eq!((first.status, again.status), (201, 201));
        assert!(!first.replayed());
        assert!(again.replayed());
        assert_eq!(again.json(), json!({"execution": 1}));
        assert_eq!(s.runs("/notes").await, 1);
    }

    pub async fn malformed_keys_are_400_and_never_echoed(name: &'static str) {
        let s = Server::start(name, &[]);
        let long = "k".repeat(256);
        let bad = [
            "\"\"",
            long.as_str(),
            "secret-1, secret-2",
            "secret with space",
            "\"secret-unterminated",
            "\"secret\";param=1",
        ];
        for route in ["/orders", "/notes"] {
            for key in bad {
                let r = s.post(route).key(key).json(&order(1)).send().await;
                r.assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
                let text = String::from_utf8_lossy(&r.body);
                assert!(!text.contains("secret"), "key echoed: {text}");
            }
            // An empty value and two header lines need a raw request.
            for headers in [
                "Idempotency-Key: \r\n",
                "Idempotency-Key: a\r\nIdempotency-Key: b\r\n",
            ] {
                let request = format!(
                    "POST {route} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\
                     Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
                );
                let r = s.raw(request.as_bytes());
                assert_eq!(r.status, 400, "{headers:?}: {}", r.text);
                assert_eq!(r.json()["code"], "IDEMPOTENCY_KEY_INVALID");
            }
        }
        let max = "k".repeat(255);
        let ok = s.post("/orders").key(&max).json(&order(1)).send().await;
        assert_eq!(ok.status, 201, "a 255-character key is valid");
        assert_eq!(s.runs("/orders").await, 1);
        assert_eq!(s.runs("/notes").await, 0);
    }

    pub async fn quoted_and_bare_keys_are_the_same_key(name: &'static str) {
        let s = Server::start(name, &[]);
        let first = order_call(&s, "\"same-key\"", &order(1)).await;
        let again = order_call(&s, "same-key", &order(1)).await;
        assert_eq!((first.status, again.status), (201, 201));
        assert!(again.replayed());
        let case = order_call(&s, "SAME-KEY", &order(1)).await;
        assert!(!case.replayed(), "keys are case-sensitive");
        assert_eq!(s.runs("/orders").await, 2);
    }

    pub async fn checks_run_in_the_documented_order(name: &'static str) {
        let s = Server::start(name, &["--max-body", "64"]);
        let big = json!({"sku": "x".repeat(200), "quantity": 1});
        // key syntax before presence and body
        s.post("/orders")
            .key("a,b")
            .json(&big)
            .send()
            .await
            .assert_problem(400, "IDEMPOTENCY_KEY_INVALID");
        // key presence before body
        s.post("/orders")
            .json(&big)
            .send()
            .await
            .assert_problem(400, "IDEMPOTENCY_KEY_REQUIRED");
        // body before claim: a refused body never claims the key
        s.post("/orders")
            .key("k-order")
            .json(&big)
            .send()
            .await
            .assert_problem(413, "IDEMPOTENCY_PAYLOAD_TOO_LARGE");
        let ok = order_call(&s, "k-order", &order(1)).await;
        assert_eq!(ok.status, 201);
        assert!(!ok.replayed());
        assert_eq!(s.runs("/orders").await, 1);
    }

    pub async fn body_over_max_body_is_413(name: &'static str) {
        let s = Server::start(name, &["--max-body", "100"]);
        let big = json!({"text": "x".repeat(200)});
        let r = s.post("/notes").key("k-big").json(&big).send().await;
        r.assert_problem(413, "IDEMPOTENCY_PAYLOAD_TOO_LARGE");
        assert_eq!(s.runs("/notes").await, 0);
        let small = s
            .post("/notes")
            .key("k-small")
            .json(&json!({"t": 1}))
            .send()
            .await;
        assert_eq!(small.status, 201);
        // Without a key on an optional endpoint, nothing is buffered: the handler sees it all.
        let unkeyed = s.post("/notes").json(&big).send().await;
        assert_eq!(unkeyed.status, 201);
        assert_eq!(s.runs("/notes").await, 2);
    }

    pub async fn chunked_body_past_the_cap_is_413(name: &'static str) {
        let s = Server::start(name, &["--max-body", "100"]);
        let chunk = format!("{{\"t\":\"{}\"}}", "x".repeat(150));
        let request = format!(
            "POST /notes HTTP/1.1\r\nHost: x\r\nConnection: close\r\nIdempotency-Key: k-chunked\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n\
             {:x}\r\n{chunk}\r\n0\r\n\r\n",
            chunk.len()
        );
        let r = s.raw(request.as_bytes());
        assert_eq!(r.status, 413, "{}", r.text);
        assert_eq!(r.json()["code"], "IDEMPOTENCY_PAYLOAD_TOO_LARGE");
        assert_eq!(s.runs("/notes").await, 0);
    }

    pub async fn slow_body_is_408(name: &'static str) {
        let s = Server::start(name, &["--body-timeout", "0.3"]);
        let mut stream = s.connect();
        stream
            .write_all(
                b"POST /notes HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                  Idempotency-Key: k-slow-body\r\nContent-Type: application/json\r\n\
                  Content-Length: 20\r\n\r\n{\"a\"",
            )
            .unwrap();
        let r = harness::read_raw(&mut stream);
        assert_eq!(r.status, 408, "{}", r.text);
        assert_eq!(r.json()["code"], "IDEMPOTENCY_BODY_TIMEOUT");
        assert_eq!(s.runs("/notes").await, 0);
    }

    pub async fn thirty_two_concurrent_requests_run_once(name: &'static str) {
        let s = Server::start(name, &[]);
        let calls = (0..32).map(|_| s.post("/slow?ms=300").key("k-herd").send());
        let answers = futures_util::future::join_all(calls).await;
        let originals: Vec<&Resp> = answers
            .iter()
            .filter(|r| r.status == 201 && !r.replayed())
            .collect();
        assert_eq!(originals.len(), 1, "exactly one request runs the handler");
        let original = originals[0];
        for r in &answers {
            match r.status {
                201 => assert_eq!(r.body, original.body, "a replay differs"),
                409 => r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS"),
                other => panic!("unexpected {other}: {:?}", r.body),
            }
        }
        assert_eq!(s.runs("/slow").await, 1);
    }

    pub async fn same_key_under_two_tenants_runs_twice(name: &'static str) {
        let s = Server::start(name, &[]);
        let a = s
            .post("/orders")
            .key("k-shared")
            .bearer("acme:alice")
            .json(&order(1))
            .send()
            .await;
        let b = s
            .post("/orders")
            .key("k-shared")
            .bearer("globex:alice")
            .json(&order(1))
            .send()
            .await;
        assert_eq!((a.status, b.status), (201, 201));
        assert!(
            !a.replayed() && !b.replayed(),
            "never another tenant's replay"
        );
        assert_eq!(a.json()["execution"], 1);
        assert_eq!(b.json()["execution"], 2);
        let a_again = s
            .post("/orders")
            .key("k-shared")
            .bearer("acme:alice")
            .json(&order(1))
            .send()
            .await;
        assert!(a_again.replayed());
        assert_eq!(a_again.body, a.body);
        assert_eq!(s.runs("/orders").await, 2);
    }

    pub async fn api_key_and_anonymous_callers_are_scoped_apart(name: &'static str) {
        let s = Server::start(name, &[]);
        let anonymous = order_call(&s, "k-scope", &order(1)).await;
        let machine = s
            .post("/orders")
            .key("k-scope")
            .header("x-api-key", "key-1")
            .json(&order(1))
            .send()
            .await;
        assert!(!anonymous.replayed() && !machine.replayed());
        let machine_again = s
            .post("/orders")
            .key("k-scope")
            .header("x-api-key", "key-1")
            .json(&order(1))
            .send()
            .await;
        assert!(machine_again.replayed());
        assert_eq!(machine_again.body, machine.body);
        assert_eq!(s.runs("/orders").await, 2);
    }

    pub async fn path_parameters_are_fingerprinted(name: &'static str) {
        let s = Server::start(name, &[]);
        let body = json!({"item": 1});
        let one = s
            .post("/shops/1/orders")
            .key("k-shop")
            .json(&body)
            .send()
            .await;
        assert_eq!(one.status, 201);
        assert_eq!(one.json(), json!({"shop": "1", "execution": 1}));
        let two = s
            .post("/shops/2/orders")
            .key("k-shop")
            .json(&body)
            .send()
            .await;
        two.assert_problem(422, "IDEMPOTENCY_KEY_REUSED");
        let one_again = s
            .post("/shops/1/orders")
            .key("k-shop")
            .json(&body)
            .send()
            .await;
        assert!(one_again.replayed());
        assert_eq!(s.runs("/shops/{shop}/orders").await, 1);
    }

    pub async fn query_order_is_irrelevant_but_raw_pairs_matter(name: &'static str) {
        let s = Server::start(name, &[]);
        let first = s.post("/search?a=1&b=2").key("k-q").send().await;
        assert_eq!(first.status, 200);
        assert_eq!(first.json(), json!({"query": "a=1&b=2", "execution": 1}));
        let reordered = s.post("/search?b=2&a=1").key("k-q").send().await;
        assert_eq!(reordered.status, 200);
        assert!(reordered.replayed());
        assert_eq!(reordered.body, first.body);
        let bare = s.post("/search?a").key("k-raw").send().await;
        assert_eq!(bare.status, 200);
        s.post("/search?a=")
            .key("k-raw")
            .send()
            .await
            .assert_problem(422, "IDEMPOTENCY_KEY_REUSED");
        s.post("/search")
            .send()
            .await
            .assert_problem(400, "IDEMPOTENCY_KEY_REQUIRED");
        assert_eq!(s.runs("/search").await, 2);
    }

    pub async fn client_disconnect_does_not_cancel_the_handler(name: &'static str) {
        let s = Server::start(name, &[]);
        let mut stream = s.connect();
        stream
            .write_all(
                b"POST /slow?ms=800 HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-gone\r\n\
                  Content-Length: 0\r\n\r\n",
            )
            .unwrap();
        s.wait_runs("/slow", 1).await;
        drop(stream);
        let retry = loop {
            let r = s.post("/slow?ms=800").key("k-gone").send().await;
            if r.status != 409 {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(retry.status, 201, "{:?}", retry.body);
        assert!(retry.replayed(), "the handler finished and was recorded");
        assert_eq!(retry.json(), json!({"execution": 1}));
        assert_eq!(s.runs("/slow").await, 1);
    }

    pub async fn panic_frees_the_key(name: &'static str) {
        let s = Server::start(name, &[]);
        for run in 1..=2 {
            let r = s.post("/panic").key("k-panic").send().await;
            r.assert_problem(500, "IDEMPOTENCY_HANDLER_PANICKED");
            assert_eq!(s.runs("/panic").await, run);
        }
    }

    /// 5xx is never recorded, nor are the default non-replayable statuses (401, 403, 408, 412,
    /// 429: the caller may fix its token, be granted access, change its precondition or wait).
    pub async fn server_errors_and_non_replayable_statuses_are_not_recorded(name: &'static str) {
        let s = Server::start(name, &[]);
        let mut runs = 0;
        for code in [500, 503, 429, 401, 403, 408, 412] {
            let key = format!("k-status-{code}");
            for _ in 0..2 {
                let r = s
                    .post(&format!("/status?code={code}"))
                    .key(&key)
                    .send()
                    .await;
                runs += 1;
                assert_eq!(r.status, code);
                assert!(!r.replayed(), "{code} must not be replayed");
                assert_eq!(r.json(), json!({"execution": runs}));
            }
        }
        assert_eq!(s.runs("/status").await, runs);
    }

    pub async fn client_errors_are_recorded(name: &'static str) {
        let s = Server::start(name, &[]);
        for (i, code) in [404, 409, 422].into_iter().enumerate() {
            let key = format!("k-status-{code}");
            let path = format!("/status?code={code}");
            let first = s.post(&path).key(&key).send().await;
            let again = s.post(&path).key(&key).send().await;
            assert_eq!((first.status, again.status), (code, code));
            assert!(!first.replayed());
            assert!(again.replayed(), "{code} is recorded");
            assert_eq!(again.json(), json!({"execution": i + 1}));
        }
        let first = order_call(&s, "k-zero", &order(0)).await;
        assert_eq!(first.status, 422);
        let want = json!({"error": "quantity must be positive", "execution": 1});
        assert_eq!(first.json(), want);
        let again = order_call(&s, "k-zero", &order(0)).await;
        assert_eq!(again.status, 422);
        assert!(again.replayed());
        assert_eq!(again.json(), want);
        assert_eq!(s.runs("/status").await, 3);
        assert_eq!(s.runs("/orders").await, 1);
    }

    pub async fn framework_rejection_of_malformed_json_is_recorded(name: &'static str) {
        let s = Server::start(name, &[]);
        let first = s
            .post("/orders")
            .key("k-bad-json")
            .raw_json("{\"sku\":")
            .send()
            .await;
        assert!((400..500).contains(&first.status), "{}", first.status);
        assert!(!first.replayed());
        let again = s
            .post("/orders")
            .key("k-bad-json")
            .raw_json("{\"sku\":")
            .send()
            .await;
        assert_eq!(again.status, first.status);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        assert_eq!(s.runs("/orders").await, 0, "the handler never ran");
    }

    pub async fn response_over_max_response_is_sent_and_not_recorded(name: &'static str) {
        let s = Server::start(name, &["--max-response", "1000"]);
        for run in 1..=2 {
            let r = s.post("/big?bytes=50000").key("k-big").send().await;
            assert_eq!(r.status, 200);
            assert!(!r.replayed());
            assert_eq!(r.body.len(), 50_000, "the whole body is sent");
            assert!(r.body.iter().all(|&b| b == b'a'));
            assert_eq!(s.runs("/big").await, run);
        }
        let small = s.post("/big?bytes=1000").key("k-small").send().await;
        let again = s.post("/big?bytes=1000").key("k-small").send().await;
        assert!(!small.replayed());
        assert!(again.replayed(), "a body within the cap is recorded");
        assert_eq!(again.body.len(), 1000);
        assert_eq!(
            again.header("content-type"),
            Some("application/octet-stream")
        );
        assert_eq!(s.runs("/big").await, 3);
    }

    /// `--oversized record_without_body` (contract §3, "Oversized answers"): the first answer
    /// streams whole and is not marked; the retry replays the status and recorded headers with
    /// an empty body and `Idempotency-Replay: body-omitted`, and the handler never runs again.
    pub async fn response_over_max_response_is_recorded_without_body_when_configured(
        name: &'static str,
    ) {
        let s = Server::start(
            name,
            &[
                "--max-response",
                "1000",
                "--oversized",
                "record_without_body",
            ],
        );
        let first = s.post("/big?bytes=5000").key("k-receipt").send().await;
        assert_eq!(first.status, 200);
        assert!(!first.replayed());
        assert_eq!(first.header("idempotency-replay"), None);
        assert_eq!(first.body.len(), 5000, "the whole body is sent");
        assert!(first.body.iter().all(|&b| b == b'a'));
        assert_eq!(s.runs("/big").await, 1);
        for _ in 0..2 {
            let retry = s.post("/big?bytes=5000").key("k-receipt").send().await;
            assert_eq!(retry.status, 200);
            let (headers, len) = (&retry.headers, retry.body.len());
            assert!(retry.replayed(), "ran again: {headers:?}, {len} bytes");
            assert_eq!(retry.header("idempotency-replay"), Some("body-omitted"));
            assert_eq!(
                retry.header("content-type"),
                Some("application/octet-stream")
            );
            assert!(retry.body.is_empty(), "{} bytes replayed", retry.body.len());
            assert!(
                matches!(retry.header("content-length"), None | Some("0")),
                "content-length {:?} on an empty replay",
                retry.header("content-length")
            );
            assert_eq!(s.runs("/big").await, 1, "the handler never runs again");
        }
        // An answer within the cap is still recorded whole, with no marker.
        let small = s.post("/big?bytes=1000").key("k-small").send().await;
        let again = s.post("/big?bytes=1000").key("k-small").send().await;
        assert!(!small.replayed() && again.replayed());
        assert_eq!(again.body.len(), 1000);
        assert_eq!(again.header("idempotency-replay"), None);
        assert_eq!(s.runs("/big").await, 2);
    }

    /// Renewal keeps the key for the whole run, not for one probe: a 0.5 s lease is renewed
    /// every third of it while the 2.5 s handler lives, and a probe every 100 ms until 2.1 s
    /// must see 409 each time (a renewal loop that died after a few ticks would let a probe
    /// reclaim the key and run the handler again).
    pub async fn lease_is_renewed_while_the_handler_runs(name: &'static str) {
        let s = Server::start(name, &["--lease", "0.5"]);
        let first = tokio::spawn(s.post("/slow?ms=2500").key("k-lease").send());
        s.wait_runs("/slow", 1).await;
        let running = std::time::Instant::now();
        let mut probes = 0;
        while running.elapsed() < Duration::from_millis(2100) {
            let during = s.post("/slow?ms=2500").key("k-lease").send().await;
            let at = running.elapsed();
            assert_eq!(
                during.status, 409,
                "probe {probes} at {at:?} into a 2.5 s handler with a 0.5 s lease: the key was \
                 not held ({:?})",
                during.body
            );
            during.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
            assert_eq!(during.header("retry-after"), Some("1"));
            probes += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(probes >= 10, "only {probes} probes in 2.1 s");
        let first = first.await.unwrap();
        assert_eq!(first.status, 201);
        let after = s.post("/slow?ms=2500").key("k-lease").send().await;
        assert!(after.replayed());
        assert_eq!(after.body, first.body);
        assert_eq!(s.runs("/slow").await, 1);
    }

    /// A crash (SIGKILL mid-handler) leaves a reservation nobody renews: the restarted server
    /// answers 409 for it until its lease lapses, then the same request reclaims the key and
    /// runs. Timed both ways: the key must not come free before the lease (less the third a
    /// renewal may have taken off it, less a margin), which a reservation that was never
    /// stored would, and must come free within the lease plus slack. Needs a store that
    /// outlives the process.
    pub async fn abandoned_reservation_is_reclaimed_after_its_lease_lapses(name: &'static str) {
        if !cfg!(feature = "sqlite") {
            eprintln!("skipped: needs the sqlite feature");
            return;
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let db = std::env::temp_dir().join(format!("idempotent-lapse-{name}-{nanos}.db"));
        let db = db.to_str().unwrap().to_owned();
        // Long enough that a restart on a loaded machine still probes inside the lease.
        let lease = Duration::from_secs(4);
        let options = ["--store", "sqlite", "--database-url", &db, "--lease", "4"];
        let crashed = Server::start(name, &options);
        let first = tokio::spawn(crashed.post("/slow?ms=1500").key("k-crash").try_send());
        crashed.wait_runs("/slow", 1).await;
        drop(crashed);
        let killed = std::time::Instant::now();
        assert!(
            first.await.unwrap().is_err(),
            "the server was killed mid-handler"
        );

        let s = Server::start(name, &options);
        // The bounds are judged from the first moment the restarted server could answer.
        let first_probe = killed.elapsed();
        let latest = lease.max(first_probe) + Duration::from_secs(1);
        let mut probes = 0;
        let (retry, freed) = loop {
            let sent = killed.elapsed();
            let r = s.post("/slow?ms=1500").key("k-crash").send().await;
            if r.status != 409 {
                break (r, sent);
            }
            r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
            probes += 1;
            assert!(
                killed.elapsed() < latest + Duration::from_secs(1),
                "the abandoned key was still held {:?} after the kill (lease {lease:?})",
                killed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        eprintln!(
            "{name}: reclaimed {freed:?} after the kill, after {probes} x 409 \
             (restarted after {first_probe:?})"
        );
        assert!(
            freed <= latest,
            "reclaimed only {freed:?} after the kill (lease {lease:?}, restarted after \
             {first_probe:?})"
        );
        if first_probe < lease * 2 / 3 {
            assert!(
                freed >= lease * 2 / 3 - Duration::from_millis(100),
                "reclaimed {freed:?} after the kill, before a {lease:?} lease could have lapsed: \
                 was the reservation stored?"
            );
            assert!(probes > 0, "the restarted server never saw the reservation");
        } else {
            eprintln!(
                "{name}: the restart outlasted most of the lease; its lower bound is not judged"
            );
        }
        assert_eq!(retry.status, 201, "{:?}", retry.body);
        assert!(!retry.replayed(), "the abandoned request never finished");
        assert_eq!(retry.json(), json!({"execution": 1}));
        let again = s.post("/slow?ms=1500").key("k-crash").send().await;
        assert!(again.replayed());
        assert_eq!(again.body, retry.body);
        assert_eq!(s.runs("/slow").await, 1);
        drop(s);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{db}{suffix}"));
        }
    }

    pub async fn retention_lapses_and_the_key_runs_again(name: &'static str) {
        let s = Server::start(name, &["--retention", "0.5"]);
        let body = json!({"t": 1});
        let first = s.post("/notes").key("k-ret").json(&body).send().await;
        assert_eq!(first.json(), json!({"execution": 1}));
        tokio::time::sleep(Duration::from_millis(800)).await;
        let later = s.post("/notes").key("k-ret").json(&body).send().await;
        assert_eq!(later.status, 201);
        assert!(!later.replayed(), "an expired record is gone");
        assert_eq!(later.json(), json!({"execution": 2}));
    }

    pub async fn malformed_authorization_is_401_before_idempotency(name: &'static str) {
        let s = Server::start(name, &[]);
        let r = s
            .post("/orders")
            .header("authorization", "Basic Zm9vOmJhcg==")
            .key("a,b")
            .json(&order(1))
            .send()
            .await;
        assert_eq!(r.status, 401);
        assert_eq!(s.runs("/orders").await, 0);
    }

    pub async fn other_methods_pass_through(name: &'static str) {
        let s = Server::start(name, &[]);
        assert_eq!(order_call(&s, "k-get", &order(1)).await.status, 201);
        // GET is not wrapped: an invalid key changes nothing.
        let r = s.get("/orders/1").await;
        assert_eq!(r.status, 200);
        let request = "GET /orders/1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                       Idempotency-Key: a, b\r\n\r\n";
        let raw = s.raw(request.as_bytes());
        assert_eq!(raw.status, 200, "{}", raw.text);
        assert_eq!(s.get("/orders/99").await.status, 404);
    }

    /// A Standard Webhooks delivery of `body` with id `id`, signed now (or with `signature`).
    fn delivery(s: &Server, id: &str, body: &str, signature: Option<&str>) -> harness::Call {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let signed =
            idempotent_examples::conformance::webhook_verifier().sign(id, now, body.as_bytes());
        s.post("/webhooks/standard")
            .header("webhook-id", id)
            .header("webhook-timestamp", &now.to_string())
            .header("webhook-signature", signature.unwrap_or(&signed))
            .raw_json(body)
    }

    /// Sends `call()` until it is not 409, as a provider retries "later": at most 50 times.
    async fn until_done(call: impl Fn() -> harness::Call) -> Resp {
        for _ in 0..50 {
            let r = call().send().await;
            if r.status != 409 {
                return r;
            }
            r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("still in progress after 50 attempts");
    }

    pub async fn standard_webhook_redeliveries_run_once(name: &'static str) {
        let s = Server::start(name, &[]);
        let body = r#"{"type":"invoice.paid","data":{"id":"in_1"}}"#;
        // Eight copies at once (a provider's retries racing), each retried on 409.
        let racing = (0..8).map(|_| until_done(|| delivery(&s, "msg_race", body, None)));
        let answers = futures_util::future::join_all(racing).await;
        // Then eight one after another.
        let mut all = answers;
        for _ in 0..8 {
            all.push(delivery(&s, "msg_race", body, None).send().await);
        }
        let first = all
            .iter()
            .find(|r| !r.replayed())
            .expect("one delivery ran");
        assert_eq!((first.status, first.json()), (200, json!({"execution": 1})));
        for r in &all {
            assert_eq!(r.status, 200, "{:?}", r.body);
            assert_eq!(r.body, first.body, "every answer is the recorded one");
        }
        assert_eq!(all.iter().filter(|r| !r.replayed()).count(), 1);
        assert_eq!(s.runs("/webhooks/standard").await, 1);
        // Another delivery id is another event.
        let other = delivery(&s, "msg_other", body, None).send().await;
        assert_eq!((other.status, other.replayed()), (200, false));
        assert_eq!(s.runs("/webhooks/standard").await, 2);
    }

    pub async fn standard_webhook_with_a_bad_signature_claims_nothing(name: &'static str) {
        let s = Server::start(name, &[]);
        let body = r#"{"type":"invoice.paid"}"#;
        let forged = "v1,bm90IHRoZSByaWdodCBzaWduYXR1cmUgYXQgYWxsIQ==";
        let r = delivery(&s, "msg_forged", body, Some(forged)).send().await;
        assert_eq!(r.status, 401, "{:?}", r.body);
        // Signed for another body: as forged.
        let tampered = delivery(&s, "msg_forged", r#"{"type":"other"}"#, None)
            .raw_json(body)
            .send()
            .await;
        assert_eq!(tampered.status, 401);
        assert_eq!(s.runs("/webhooks/standard").await, 0);
        // Nothing was claimed: the genuine delivery with that id runs.
        let genuine = delivery(&s, "msg_forged", body, None).send().await;
        assert_eq!((genuine.status, genuine.replayed()), (200, false));
        assert_eq!(genuine.json(), json!({"execution": 1}));
    }

    pub async fn event_keyed_by_its_body_id_replays_a_new_envelope(name: &'static str) {
        let s = Server::start(name, &[]);
        let event = |created: u64, amount: u64| {
            json!({"id": "evt_1", "created": created, "type": "charge.succeeded",
                   "data": {"amount": amount, "currency": "eur"}})
        };
        let first = s.post("/events").json(&event(1, 100)).send().await;
        assert_eq!((first.status, first.replayed()), (200, false));
        assert_eq!(first.json(), json!({"execution": 1}));
        // A redelivery with another timestamp, and members in another order: a replay.
        let reordered = r#"{"data":{"currency":"eur","amount":100},"type":"charge.succeeded","created":2,"id":"evt_1"}"#;
        let again = s.post("/events").raw_json(reordered).send().await;
        assert_eq!((again.status, again.replayed()), (200, true));
        assert_eq!(again.body, first.body);
        // The same id with another amount is another request under a used key.
        let changed = s.post("/events").json(&event(3, 101)).send().await;
        changed.assert_problem(422, "IDEMPOTENCY_KEY_REUSED");
        // The Idempotency-Key header means nothing here.
        let header_only = s
            .post("/events")
            .key("evt_1")
            .json(&json!({"type": "x"}))
            .send()
            .await;
        header_only.assert_problem(400, "IDEMPOTENCY_KEY_REQUIRED");
        assert_eq!(s.runs("/events").await, 1);
    }

    pub async fn event_key_mistakes_are_answered_as_the_contract_says(name: &'static str) {
        let s = Server::start(name, &[]);
        let cases = [
            (r#"{"type":"x","data":{}}"#, 400, "IDEMPOTENCY_KEY_REQUIRED"),
            (
                r#"{"id":{"nested":"evt"},"type":"x"}"#,
                400,
                "IDEMPOTENCY_KEY_INVALID",
            ),
            (
                r#"{"id":["evt_1"],"type":"x"}"#,
                400,
                "IDEMPOTENCY_KEY_INVALID",
            ),
            (r#"{"id":null,"type":"x"}"#, 400, "IDEMPOTENCY_KEY_INVALID"),
            (r#"{"id":"","type":"x"}"#, 400, "IDEMPOTENCY_KEY_INVALID"),
            (
                r#"{"id":"two words","type":"x"}"#,
                400,
                "IDEMPOTENCY_KEY_INVALID",
            ),
            (
                r#"{"id":"evt_1","id":"evt_2"}"#,
                400,
                "IDEMPOTENCY_KEY_INVALID",
            ),
            ("not json at all", 400, "IDEMPOTENCY_KEY_INVALID"),
        ];
        for (body, status, code) in cases {
            let r = s.post("/events").raw_json(body).send().await;
            assert!(
                !r.body.windows(5).any(|w| w == b"evt_2"),
                "a key is never echoed"
            );
            r.assert_problem(status, code);
        }
        // A numeric id is a key too, as its JSON text.
        let numeric = s
            .post("/events")
            .json(&json!({"id": 42, "type": "x"}))
            .send()
            .await;
        assert_eq!(numeric.status, 200);
        let again = s
            .post("/events")
            .json(&json!({"id": 42, "type": "x"}))
            .send()
            .await;
        assert!(again.replayed());
        assert_eq!(s.runs("/events").await, 1);
    }

    pub async fn duplicates_wait_for_the_first_answer_when_asked(name: &'static str) {
        let s = Server::start(name, &["--wait-in-progress", "10"]);
        // Sixteen copies at once: one runs, fifteen wait for it and replay its answer.
        let calls = (0..16).map(|_| s.post("/slow?ms=400").key("k-wait").send());
        let answers = futures_util::future::join_all(calls).await;
        assert!(
            answers.iter().all(|r| r.status == 201),
            "no 409 while waiting"
        );
        assert_eq!(answers.iter().filter(|r| !r.replayed()).count(), 1);
        assert!(answers.iter().all(|r| r.body == answers[0].body));
        assert_eq!(s.runs("/slow").await, 1);
        // Racing webhook redeliveries: every answer is the recorded 2xx at once.
        let body = r#"{"type":"invoice.paid"}"#;
        let racing = (0..8).map(|_| delivery(&s, "msg_wait", body, None).send());
        let answers = futures_util::future::join_all(racing).await;
        assert!(
            answers.iter().all(|r| r.status == 200),
            "every delivery is answered 200"
        );
        assert_eq!(s.runs("/webhooks/standard").await, 1);

        // A wait shorter than the handler ends in 409, as without the setting.
        let short = Server::start(name, &["--wait-in-progress", "0.2"]);
        let first = short.post("/slow?ms=2000").key("k-short").send();
        let second = async {
            short.wait_runs("/slow", 1).await;
            short.post("/slow?ms=2000").key("k-short").send().await
        };
        let (first, second) = tokio::join!(first, second);
        assert_eq!(first.status, 201);
        second.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        assert_eq!(short.runs("/slow").await, 1);
    }
}
