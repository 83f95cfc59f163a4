//! The orders example over HTTP: refusals in the service's own error envelope (the handle's
//! refusal renderer), and `GET /metrics` when `ORDERS_METRICS=1` (#18).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::{Value, json};

struct Orders {
    child: Child,
    url: String,
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Orders {
    let mut child = Command::new(crate::support::example_binary("orders_axum"))
        .env("ORDERS_ADDR", "127.0.0.1:0")
        .env("ORDERS_METRICS", "1")
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start orders_axum");
    let mut line = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    stdout.read_line(&mut line).unwrap();
    // Keep reading what it prints after that line: a closed pipe would make its next print fail
    // and the server exit.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_owned();
    Orders { child, url }
}

#[tokio::test]
async fn refusals_use_the_services_envelope_and_metrics_are_scraped() {
    let orders = start();
    let client = reqwest::Client::new();
    let post = |key: Option<&str>, quantity: u32| {
        let call = client
            .post(format!("{}/orders", orders.url))
            .header("content-type", "application/json")
            .body(json!({"sku": "A1", "quantity": quantity}).to_string());
        match key {
            Some(key) => call.header("idempotency-key", key),
            None => call,
        }
    };

    let missing = post(None, 1).send().await.unwrap();
    assert_eq!(missing.status(), 400);
    assert_eq!(missing.headers()["content-type"], "application/json");
    let doc: Value = serde_json::from_slice(&missing.bytes().await.unwrap()).unwrap();
    assert_eq!(doc["error"]["code"], "IDEMPOTENCY_KEY_REQUIRED", "{doc}");
    assert!(doc["error"]["message"].is_string(), "{doc}");

    assert_eq!(post(Some("o-1"), 2).send().await.unwrap().status(), 201);
    let replay = post(Some("o-1"), 2).send().await.unwrap();
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    let reused = post(Some("o-1"), 3).send().await.unwrap();
    assert_eq!(reused.status(), 422);
    let doc: Value = serde_json::from_slice(&reused.bytes().await.unwrap()).unwrap();
    assert_eq!(doc["error"]["code"], "IDEMPOTENCY_KEY_REUSED", "{doc}");

    let scrape = client
        .get(format!("{}/metrics", orders.url))
        .send()
        .await
        .unwrap();
    assert_eq!(scrape.status(), 200);
    let text = scrape.text().await.unwrap();
    for line in [
        r#"idempotent_executed_total{route="/orders"} 1"#,
        r#"idempotent_replayed_total{route="/orders"} 1"#,
        r#"idempotent_key_reused_total{route="/orders"} 1"#,
        r#"idempotent_key_missing_total{route="/orders"} 1"#,
        "idempotent_memory_store_records 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
}
