//! Runs `examples/payments.rs` against PostgreSQL and checks each thing it claims.

#[allow(dead_code)]
#[path = "../../examples/payments.rs"]
mod example;

use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

async fn serve(state: example::AppState) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = example::app(state).into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
    body: Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, headers, body)
}

#[tokio::test]
async fn payments_are_idempotent_by_key_by_guard_and_by_natural_key() {
    let Some(url) = crate::support::database_url() else {
        return;
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let schema = format!("payments_test_{}_{nanos}", std::process::id());
    let state = example::state(&url, &schema).await.unwrap();
    let provider = state.provider.clone();
    let db = state.db.clone();
    let base = serve(state).await;
    let client = reqwest::Client::new();

    // Authorize twice with one key: one charge, the second answer is the replay.
    let pay = |client: reqwest::Client| {
        let url = format!("{base}/payments");
        async move {
            post(
                &client,
                &url,
                &[("idempotency-key", "pay-1")],
                json!({"amount_cents": 1250}),
            )
            .await
        }
    };
    let (s1, h1, b1) = pay(client.clone()).await;
    let (s2, h2, b2) = pay(client.clone()).await;
    assert_eq!((s1, s2), (201, 201), "{b1} {b2}");
    assert!(h1.get("idempotency-replayed").is_none());
    assert_eq!(h2.get("idempotency-replayed").unwrap(), "true");
    assert_eq!(b1, b2);
    assert_eq!(provider.charges(), 1, "one charge at the provider");
    // Counted where the handler runs: the provider's own de-duplication would hide a second
    // run behind the same charge.
    assert_eq!(provider.calls(), 1, "the handler reached the provider once");
    // The provider saw a derived key, never the client's.
    let keys = provider.keys();
    assert_eq!(keys[0].len(), 64);
    assert_ne!(keys[0], "pay-1");

    // Capture twice: a guarded transition, no header; captured once, same answer.
    let id = b1["id"].as_i64().unwrap();
    let capture = format!("{base}/payments/{id}/capture");
    let (c1, _, cb1) = post(&client, &capture, &[], Value::Null).await;
    let (c2, _, cb2) = post(&client, &capture, &[], Value::Null).await;
    assert_eq!((c1, c2), (200, 200));
    assert_eq!(cb1, cb2);
    assert_eq!(cb1["status"], "Captured");

    // The webhook twice: de-duplicated by the provider's event id, applied once.
    let charge = b1["charge"].as_str().unwrap();
    let event = json!({"event_id": "evt_1", "charge": charge});
    let webhook = format!("{base}/webhooks/provider");
    let (w1, _, wb1) = post(&client, &webhook, &[], event.clone()).await;
    let (w2, _, wb2) = post(&client, &webhook, &[], event).await;
    assert_eq!((w1, w2), (200, 200));
    assert_eq!(
        (wb1["duplicate"].as_bool(), wb2["duplicate"].as_bool()),
        (Some(false), Some(true))
    );
    let settlements: i32 = sqlx::query_scalar("SELECT settlements FROM payments WHERE id = $1")
        .bind(id)
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(settlements, 1, "the webhook's effect applied once");

    // Another caller (anonymous from another address: another scope) with the same raw key is
    // another payment, and the provider sees another derived key.
    let elsewhere = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .build()
        .unwrap();
    let (s3, h3, b3) = pay(elsewhere).await;
    assert_eq!(s3, 201, "{b3}");
    assert!(h3.get("idempotency-replayed").is_none());
    assert_ne!(b3["id"], b1["id"]);
    assert_eq!(provider.charges(), 2);
    assert_eq!(provider.calls(), 2, "the other scope's payment ran once");

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&db)
        .await
        .unwrap();
}

/// The example restarted between two clients (a new process: the provider's memory is gone,
/// the `payments` table stays): the second client's new key is a new payment with a charge of
/// its own, never the first client's payment, and the first client's retry still replays.
#[tokio::test]
async fn a_restart_never_hands_a_new_client_another_clients_payment() {
    let Some(url) = crate::support::database_url() else {
        return;
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let schema = format!("payments_restart_{}_{nanos}", std::process::id());
    let start = |state: example::AppState| async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = example::app(state).into_make_service_with_connect_info::<SocketAddr>();
        let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (format!("http://{addr}"), server)
    };
    let client_a = reqwest::Client::new();
    let client_b = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .build()
        .unwrap();
    let amount = json!({"amount_cents": 1250});

    // Client A authorizes and captures.
    let first = example::state(&url, &schema).await.unwrap();
    let db = first.db.clone();
    let (base, server) = start(first).await;
    let (s, h, a) = post(
        &client_a,
        &format!("{base}/payments"),
        &[("idempotency-key", "a-1")],
        amount.clone(),
    )
    .await;
    assert_eq!(s, 201, "{a}");
    assert!(h.get("idempotency-replayed").is_none());
    assert_eq!(a["status"], "Authorized");
    let a_id = a["id"].as_i64().unwrap();
    let capture = format!("{base}/payments/{a_id}/capture");
    let (c, _, captured) = post(&client_a, &capture, &[], Value::Null).await;
    assert_eq!((c, &captured["status"]), (200, &json!("Captured")));

    // Restart: a new process over the same database.
    server.abort();
    let _ = server.await;
    let second = example::state(&url, &schema).await.unwrap();
    let provider = second.provider.clone();
    let (base, _server) = start(second).await;

    // Client B, another caller with a new key and the same amount: its own payment.
    let (s, h, b) = post(
        &client_b,
        &format!("{base}/payments"),
        &[("idempotency-key", "b-1")],
        amount.clone(),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    assert!(h.get("idempotency-replayed").is_none());
    assert_eq!(b["status"], "Authorized", "B got A's captured payment: {b}");
    assert_ne!(b["id"], a["id"], "B's payment merged into A's: {b}");
    assert_ne!(
        b["charge"], a["charge"],
        "the provider reused A's charge id"
    );
    assert_eq!(
        provider.charges(),
        1,
        "B's authorization reached the provider"
    );

    // Client A's retry after the restart replays its own answer; the provider is not called.
    let (s, h, again) = post(
        &client_a,
        &format!("{base}/payments"),
        &[("idempotency-key", "a-1")],
        amount,
    )
    .await;
    assert_eq!(s, 201, "{again}");
    assert_eq!(h.get("idempotency-replayed").unwrap(), "true");
    assert_eq!(again, a);
    assert_eq!(provider.charges(), 1);

    let rows: Vec<(i64, String, i64)> =
        sqlx::query_as("SELECT id, status, amount_cents FROM payments ORDER BY id")
            .fetch_all(&db)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![
            (a_id, "Captured".to_owned(), 1250),
            (b["id"].as_i64().unwrap(), "Authorized".to_owned(), 1250)
        ],
        "one payment each"
    );

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&db)
        .await
        .unwrap();
}
