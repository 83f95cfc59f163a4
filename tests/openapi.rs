//! `#[utoipa::path]` beside `#[idempotent]`, in either order, registered in a
//! `#[derive(OpenApi)]` document that `idempotent_runtime::openapi` completes: the operations are
//! in the document with the key header and the refusals, and the handlers still run once per key.
//!
//! Above the attribute, utoipa sees the handler as written; below it, the macro keeps
//! `#[utoipa::path]` on the function it generates under the handler's name (DESIGN.md §1), where
//! the `__path_<name>` item it registers stays beside the name `paths(…)` refers to.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::openapi::{IdempotentOperation, IdempotentPaths, ProblemDetails};
use serde_json::{Value, json};
use utoipa::OpenApi;

static ORDERS: AtomicUsize = AtomicUsize::new(0);
static REFUNDS: AtomicUsize = AtomicUsize::new(0);

/// Create an order.
#[utoipa::path(
    post,
    path = "/orders",
    responses((status = 201, description = "Order created")),
)]
#[idempotent(require_key)]
async fn create_order(
    State(_idempotency): State<Idempotency>,
    Json(order): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = ORDERS.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(json!({"order": n, "item": order["item"]})),
    )
}

/// Refund an order.
#[idempotent]
#[utoipa::path(
    post,
    path = "/refunds",
    responses((status = 201, description = "Refund created")),
)]
async fn create_refund(
    State(_idempotency): State<Idempotency>,
    Json(refund): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = REFUNDS.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(json!({"refund": n, "order": refund["order"]})),
    )
}

/// The two endpoints' settings: orders require a key, refunds take one when sent.
struct Idempotent;

impl utoipa::Modify for Idempotent {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::path::HttpMethod;
        IdempotentPaths::new(IdempotentOperation::new().require_key(true))
            .only("/orders", HttpMethod::Post)
            .modify(doc);
        IdempotentPaths::new(IdempotentOperation::new())
            .only("/refunds", HttpMethod::Post)
            .modify(doc);
    }
}

#[derive(OpenApi)]
#[openapi(
    paths(create_order, create_refund),
    components(schemas(ProblemDetails)),
    modifiers(&Idempotent)
)]
struct ApiDoc;

#[test]
fn both_orders_of_the_attributes_register_the_operation_with_its_header_and_refusals() {
    let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
    let problem = json!({"$ref": "#/components/schemas/IdempotencyProblemDetails"});
    for (path, id, required) in [
        ("/orders", "create_order", true),
        ("/refunds", "create_refund", false),
    ] {
        let operation = &doc["paths"][path]["post"];
        assert_eq!(operation["operationId"], id, "{doc:#}");
        assert_eq!(
            operation["summary"],
            if required {
                "Create an order."
            } else {
                "Refund an order."
            }
        );
        let key = &operation["parameters"][0];
        assert_eq!(key["name"], "Idempotency-Key", "{operation:#}");
        assert_eq!(key["in"], "header");
        assert_eq!(key["required"], required);
        let responses = &operation["responses"];
        assert!(
            responses["201"]["headers"]["Idempotency-Replayed"].is_object(),
            "{responses:#}"
        );
        for status in ["400", "409", "422", "503"] {
            assert_eq!(
                responses[status]["content"]["application/problem+json"]["schema"], problem,
                "{path} {status}"
            );
        }
        for status in ["409", "503"] {
            assert!(
                responses[status]["headers"]["Retry-After"].is_object(),
                "{path} {status}"
            );
        }
    }
    let codes =
        &doc["components"]["schemas"]["IdempotencyProblemDetails"]["properties"]["code"]["enum"];
    assert!(
        codes
            .as_array()
            .unwrap()
            .contains(&json!("IDEMPOTENCY_IN_PROGRESS")),
        "{codes}"
    );
}

/// The documented handlers are still idempotent handlers: a retry is replayed, not run again.
#[tokio::test]
async fn documented_handlers_run_once_per_key_in_both_orders() {
    let app = Router::new()
        .route("/orders", post(create_order))
        .route("/refunds", post(create_refund))
        .with_state(Idempotency::memory());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    let client = reqwest::Client::new();
    for (path, body, counter) in [
        ("/orders", r#"{"item":"book"}"#, &ORDERS),
        ("/refunds", r#"{"order":1}"#, &REFUNDS),
    ] {
        let mut answers = Vec::new();
        for _ in 0..2 {
            let response = client
                .post(format!("http://{addr}{path}"))
                .header("content-type", "application/json")
                .header("idempotency-key", format!("key-{path}"))
                .body(body)
                .send()
                .await
                .unwrap();
            let replayed = response
                .headers()
                .get("idempotency-replayed")
                .map(|v| v.to_str().unwrap().to_owned());
            answers.push((
                response.status().as_u16(),
                replayed,
                response.text().await.unwrap(),
            ));
        }
        assert_eq!(answers[0].0, 201, "{path}: {answers:?}");
        assert_eq!(answers[0].1, None, "{path}: {answers:?}");
        assert_eq!(
            answers[1],
            (201, Some("true".to_owned()), answers[0].2.clone()),
            "{path}"
        );
        assert_eq!(counter.load(Ordering::SeqCst), 1, "{path} ran once");
    }
    // Without a key, the required endpoint refuses and the optional one runs.
    let refused = client
        .post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    let problem: Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    assert_eq!(problem["code"], "IDEMPOTENCY_KEY_REQUIRED");
    assert_eq!(ORDERS.load(Ordering::SeqCst), 1);
}
