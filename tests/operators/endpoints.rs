//! The operators' endpoints of both conformance servers (DESIGN.md §5 "Admin", §7,
//! ../shared/CONFORMANCE.md): `GET`/`DELETE /admin/records?key=K` in the caller's own scope,
//! and `GET /metrics` after a scripted sequence of decisions.

use std::time::Duration;

use crate::support::harness::{self, Server, sample};
use serde_json::json;

fn order() -> serde_json::Value {
    json!({"sku": "book", "quantity": 1})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_records_inspects_and_forgets_in_the_callers_own_scope_only() {
    for name in harness::SERVERS {
        eprintln!("against {name}");
        let s = Server::start(name, &[]);
        let first = s
            .post("/orders")
            .key("k-admin")
            .bearer("acme:alice")
            .json(&order())
            .send()
            .await;
        assert_eq!(first.status, 201);

        let seen = s
            .get_call("/admin/records?key=k-admin")
            .bearer("acme:alice")
            .send()
            .await;
        assert_eq!(seen.status, 200, "{name}: {:?}", seen.body);
        let doc = seen.json();
        assert_eq!(doc["state"], "completed", "{doc}");
        assert_eq!(doc["status"], 201, "{doc}");
        assert_eq!(doc["route"], "/orders", "{doc}");
        for time in ["expires_at", "created_at", "completed_at"] {
            assert!(
                doc[time].as_str().is_some_and(|t| t.ends_with('Z')),
                "{time}: {doc}"
            );
        }
        assert!(doc["body_bytes"].as_u64().unwrap() > 0, "{doc}");
        assert!(
            doc.get("body").is_none(),
            "the body is never shown over HTTP: {doc}"
        );

        // Another tenant, another subject, an API key and an anonymous caller see nothing and
        // forget nothing.
        for other in [
            s.get_call("/admin/records?key=k-admin")
                .bearer("globex:alice"),
            s.get_call("/admin/records?key=k-admin").bearer("acme:bob"),
            s.get_call("/admin/records?key=k-admin")
                .header("x-api-key", "alice"),
            s.get_call("/admin/records?key=k-admin"),
        ] {
            assert_eq!(
                other.send().await.status,
                404,
                "{name}: another scope saw the record"
            );
        }
        let foreign = s
            .delete("/admin/records?key=k-admin")
            .bearer("globex:alice")
            .send()
            .await;
        assert_eq!(
            foreign.status, 404,
            "{name}: another tenant forgot the record"
        );
        let wrong_route = s
            .delete("/admin/records?key=k-admin&route=/notes")
            .bearer("acme:alice")
            .send()
            .await;
        assert_eq!(
            wrong_route.status, 404,
            "{name}: forgotten through another route"
        );
        let kept = s
            .post("/orders")
            .key("k-admin")
            .bearer("acme:alice")
            .json(&order())
            .send()
            .await;
        assert!(
            kept.replayed(),
            "{name}: the record survived the others' deletes"
        );

        let forgot = s
            .delete("/admin/records?key=k-admin")
            .bearer("acme:alice")
            .send()
            .await;
        assert_eq!(forgot.status, 204, "{name}");
        assert!(forgot.body.is_empty());
        let gone = s
            .get_call("/admin/records?key=k-admin")
            .bearer("acme:alice")
            .send()
            .await;
        assert_eq!(gone.status, 404, "{name}");
        let again = s
            .delete("/admin/records?key=k-admin")
            .bearer("acme:alice")
            .send()
            .await;
        assert_eq!(again.status, 404, "{name}: forgetting twice");
        let rerun = s
            .post("/orders")
            .key("k-admin")
            .bearer("acme:alice")
            .json(&order())
            .send()
            .await;
        assert_eq!(rerun.status, 201);
        assert!(!rerun.replayed(), "{name}: a forgotten key runs again");
        assert_eq!(rerun.json()["execution"], 2);

        // A running reservation, of an anonymous caller (scoped by its peer address).
        let slow = {
            let call = s.post("/slow?ms=1500").key("k-running").json(&json!({}));
            tokio::spawn(call.send())
        };
        s.wait_runs("/slow", 1).await;
        let running = s.get("/admin/records?key=k-running").await;
        assert_eq!(running.status, 200, "{name}");
        let doc = running.json();
        assert_eq!(doc["state"], "running", "{doc}");
        assert_eq!(doc["status"], serde_json::Value::Null, "{doc}");
        assert!(doc["lease_until"].is_string(), "{doc}");
        assert_eq!(slow.await.unwrap().status, 201);
        let done = s.get("/admin/records?key=k-running").await.json();
        assert_eq!(done["state"], "completed", "{done}");
        assert_eq!(done["route"], "/slow", "{done}");
    }
}

/// The admin routes resolve the caller exactly as the request pipeline does (#27 item 5): an
/// `X-Api-Key` caller (identified by the runtime's resolver) is not the anonymous caller of
/// the same address, and each finds and forgets only its own record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_records_resolve_the_caller_as_the_pipeline_does() {
    for name in harness::SERVERS {
        eprintln!("against {name}");
        let s = Server::start(name, &[]);
        let anonymous = s
            .post("/notes")
            .key("k-shared")
            .json(&json!({}))
            .send()
            .await;
        assert_eq!(anonymous.status, 201);
        let keyed = s
            .post("/notes")
            .key("k-shared")
            .header("x-api-key", "svc")
            .json(&json!({}))
            .send()
            .await;
        assert_eq!(keyed.status, 201);
        assert!(
            !keyed.replayed(),
            "{name}: an API key shared the anonymous scope"
        );
        let only_keyed = s
            .post("/notes")
            .key("k-api-only")
            .header("x-api-key", "svc")
            .json(&json!({}))
            .send()
            .await;
        assert_eq!(only_keyed.status, 201);
        assert_eq!(s.runs("/notes").await, 3);

        // The API-key caller's DELETE forgets its own record, not the anonymous caller's.
        let forgot = s
            .delete("/admin/records?key=k-shared")
            .header("x-api-key", "svc")
            .send()
            .await;
        assert_eq!(forgot.status, 204, "{name}");
        let kept = s
            .post("/notes")
            .key("k-shared")
            .json(&json!({}))
            .send()
            .await;
        assert!(
            kept.replayed(),
            "{name}: the API-key caller forgot the anonymous caller's record"
        );
        assert_eq!(kept.body, anonymous.body);
        assert_eq!(s.runs("/notes").await, 3);
        assert_eq!(s.get("/admin/records?key=k-shared").await.status, 200);
        let rerun = s
            .post("/notes")
            .key("k-shared")
            .header("x-api-key", "svc")
            .json(&json!({}))
            .send()
            .await;
        assert!(
            !rerun.replayed(),
            "{name}: the API-key caller's record survived its forget"
        );
        assert_eq!(s.runs("/notes").await, 4);

        // The API-key caller inspects its own record, one the anonymous caller does not have.
        let seen = s
            .get_call("/admin/records?key=k-api-only")
            .header("x-api-key", "svc")
            .send()
            .await;
        assert_eq!(seen.status, 200, "{name}: the API-key caller's own record");
        assert_eq!(seen.json()["route"], "/notes");
        assert_eq!(s.get("/admin/records?key=k-api-only").await.status, 404);
        // The resolver's refusal is the admin route's answer too, before anything is read.
        let empty = s
            .get_call("/admin/records?key=k-api-only")
            .header("x-api-key", "")
            .send()
            .await;
        assert_eq!(empty.status, 401, "{name}");
    }
}

/// An anonymous client behind a trusted proxy is scoped by the address the proxy forwards, in
/// the admin routes as in the pipeline; a proxy that forwards none is refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_records_follow_trusted_proxies() {
    for name in harness::SERVERS {
        eprintln!("against {name}");
        let s = Server::start(name, &["--trusted-proxy", "127.0.0.1/32"]);
        let first = s
            .post("/notes")
            .key("k-proxied")
            .header("x-forwarded-for", "203.0.113.5")
            .json(&json!({}))
            .send()
            .await;
        assert_eq!(first.status, 201);
        let own = s
            .get_call("/admin/records?key=k-proxied")
            .header("x-forwarded-for", "203.0.113.5")
            .send()
            .await;
        assert_eq!(own.status, 200, "{name}: a proxied client's own record");
        assert_eq!(own.json()["state"], "completed");
        let other = s
            .get_call("/admin/records?key=k-proxied")
            .header("x-forwarded-for", "203.0.113.6")
            .send()
            .await;
        assert_eq!(other.status, 404, "{name}: another client behind the proxy");
        s.get_call("/admin/records?key=k-proxied")
            .send()
            .await
            .assert_problem(500, "IDEMPOTENCY_SCOPE_UNRESOLVED");
        let foreign = s
            .delete("/admin/records?key=k-proxied")
            .header("x-forwarded-for", "203.0.113.6")
            .send()
            .await;
        assert_eq!(foreign.status, 404, "{name}");
        let forgot = s
            .delete("/admin/records?key=k-proxied")
            .header("x-forwarded-for", "203.0.113.5")
            .send()
            .await;
        assert_eq!(forgot.status, 204, "{name}");
        let rerun = s
            .post("/notes")
            .key("k-proxied")
            .header("x-forwarded-for", "203.0.113.5")
            .json(&json!({}))
            .send()
            .await;
        assert!(!rerun.replayed(), "{name}: a forgotten key runs again");
        assert_eq!(s.runs("/notes").await, 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_each_decision_and_time_the_store() {
    for name in harness::SERVERS {
        eprintln!("against {name}");
        let s = Server::start(name, &["--max-body", "64"]);
        let first = s.post("/orders").key("k1").json(&order()).send().await;
        assert_eq!(first.status, 201);
        let replay = s.post("/orders").key("k1").json(&order()).send().await;
        assert!(replay.replayed());
        let reused = s
            .post("/orders")
            .key("k1")
            .json(&json!({"sku": "pen", "quantity": 1}))
            .send()
            .await;
        assert_eq!(reused.status, 422);
        let too_large = s
            .post("/orders")
            .key("k2")
            .raw_json(&format!("{{\"sku\":\"{}\"}}", "x".repeat(100)))
            .send()
            .await;
        assert_eq!(too_large.status, 413);
        let slow = tokio::spawn(s.post("/slow?ms=1500").key("k3").json(&json!({})).send());
        s.wait_runs("/slow", 1).await;
        let busy = s
            .post("/slow?ms=1500")
            .key("k3")
            .json(&json!({}))
            .send()
            .await;
        assert_eq!(busy.status, 409);
        let missing = s.post("/orders").json(&order()).send().await;
        assert_eq!(missing.status, 400);

        // While /slow runs, its reservation is counted.
        let during = s.get("/metrics").await;
        assert_eq!(during.status, 200);
        assert!(
            during
                .header("content-type")
                .unwrap()
                .starts_with("text/plain")
        );
        let text = String::from_utf8(during.body.to_vec()).unwrap();
        assert_eq!(
            sample(&text, "idempotent_running_reservations", &[]),
            Some(1.0),
            "{text}"
        );
        assert_eq!(slow.await.unwrap().status, 201);
        tokio::time::sleep(Duration::from_millis(50)).await;

        let text = String::from_utf8(s.get("/metrics").await.body.to_vec()).unwrap();
        let orders = r#"route="/orders""#;
        let slow = r#"route="/slow""#;
        for (metric, labels, want) in [
            ("idempotent_executed_total", orders, 1.0),
            ("idempotent_replayed_total", orders, 1.0),
            ("idempotent_key_reused_total", orders, 1.0),
            ("idempotent_payload_too_large_total", orders, 1.0),
            ("idempotent_key_missing_total", orders, 1.0),
            ("idempotent_executed_total", slow, 1.0),
            ("idempotent_in_progress_total", slow, 1.0),
        ] {
            assert_eq!(
                sample(&text, metric, &[labels]),
                Some(want),
                "{name}: {metric}{{{labels}}}\n{text}"
            );
        }
        assert_eq!(
            sample(&text, "idempotent_running_reservations", &[]),
            Some(0.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "idempotent_buffered_bytes", &[]),
            Some(0.0),
            "{text}"
        );
        // Records: k1 and k3 completed (the refused and oversized requests claimed nothing).
        assert_eq!(
            sample(&text, "idempotent_memory_store_records", &[]),
            Some(2.0),
            "{text}"
        );
        assert!(sample(&text, "idempotent_memory_store_bytes", &[]).unwrap() > 0.0);
        for op in ["claim", "complete"] {
            let labels = [&*format!("op=\"{op}\""), "store=\"memory\""];
            let count = sample(&text, "idempotent_store_operation_seconds_count", &labels);
            assert!(
                count.is_some_and(|n| n >= 2.0),
                "{name}: {op} latency: {count:?}\n{text}"
            );
            let bucket = sample(
                &text,
                "idempotent_store_operation_seconds_bucket",
                &[labels[0], labels[1], "le=\"+Inf\""],
            );
            assert_eq!(bucket, count, "{name}: {op}: the histogram has buckets");
        }
    }
}
