//! In-process checks of what the conformance suite cannot reach over HTTP: requests without a
//! peer address, credentials without a published identity, the buffer budget, and the layer's
//! pass-through rules.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::extract::{Request, State};
use axum::response::Response;
use axum::routing::{get, post};
use http::StatusCode;
use http_body_util::BodyExt;
use tower_service::Service;

use super::{IdempotencyLayer, idempotent};
use crate::{Idempotency, IdempotencyContext};

#[derive(Clone)]
struct App {
    store: Idempotency,
    runs: Arc<AtomicUsize>,
}

impl axum::extract::FromRef<App> for Idempotency {
    fn from_ref(app: &App) -> Self {
        app.store.clone()
    }
}

#[idempotent(crate = crate, require_key)]
async fn create(State(app): State<App>, context: IdempotencyContext, body: String) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    format!("{body}:{}", context.derived_key("t"))
}

async fn plain(State(app): State<App>) -> &'static str {
    app.runs.fetch_add(1, Ordering::SeqCst);
    "plain"
}

fn app(store: Idempotency) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route("/create", post(create))
        .with_state(App {
            store,
            runs: Arc::clone(&runs),
        });
    (router, runs)
}

/// A memory-store handle with strict mode on or off (its default follows the build).
fn strict(on: bool) -> Idempotency {
    let config = crate::config::Config::builder().strict(on).build();
    Idempotency::builder(crate::store::memory::MemoryStore::default())
        .config(config)
        .build()
}

fn peer() -> MockConnectInfo<SocketAddr> {
    MockConnectInfo(([10, 0, 0, 1], 4000).into())
}

async fn call(router: &Router, request: Request) -> (StatusCode, http::HeaderMap, String) {
    let response: Response = router.clone().call(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn post_with_key(path: &str, key: &str, body: &str) -> Request {
    Request::post(path)
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn code(body: &str) -> String {
    let doc: serde_json::Value = serde_json::from_str(body).unwrap();
    doc["code"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn anonymous_request_without_a_peer_address_is_500_scope_unresolved() {
    let (router, runs) = app(Idempotency::memory());
    let (status, headers, body) = call(&router, post_with_key("/create", "k", "x")).await;
    assert_eq!(status, 500);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(code(&body), "IDEMPOTENCY_SCOPE_UNRESOLVED");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn credentials_without_a_published_identity_are_500_not_the_peer_scope() {
    let (router, runs) = app(Idempotency::memory());
    let router = router.layer(peer());
    let mut request = post_with_key("/create", "k", "x");
    request
        .headers_mut()
        .insert("authorization", "Bearer t:u".parse().unwrap());
    let (status, _, body) = call(&router, request).await;
    assert_eq!(status, 500);
    assert_eq!(code(&body), "IDEMPOTENCY_SCOPE_UNRESOLVED");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn exhausted_buffer_budget_is_503_with_retry_after() {
    let store = Idempotency::builder(crate::store::memory::MemoryStore::default())
        .max_buffered_bytes(4)
        .build();
    let (router, runs) = app(store);
    let router = router.layer(peer());
    let mut request = post_with_key("/create", "k", "0123456789");
    request
        .headers_mut()
        .insert("content-length", "10".parse().unwrap());
    let (status, headers, body) = call(&router, request).await;
    assert_eq!(status, 503);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(code(&body), "IDEMPOTENCY_STORE_FULL");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_context_is_stable_across_the_replay() {
    let (router, runs) = app(Idempotency::memory());
    let router = router.layer(peer());
    let (s1, h1, first) = call(&router, post_with_key("/create", "k", "x")).await;
    let (s2, h2, again) = call(&router, post_with_key("/create", "k", "x")).await;
    assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
    assert!(!h1.contains_key("idempotency-replayed"));
    assert_eq!(h2["idempotency-replayed"], "true");
    assert_eq!(first, again);
    assert!(first.starts_with("x:") && first.len() == 2 + 64);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_layer_applies_to_post_and_passes_other_requests_through() {
    let store = Idempotency::memory();
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route("/plain", get(plain).post(plain).put(plain))
        .route("/create", post(create))
        .fallback(plain)
        .layer(
            IdempotencyLayer::new(store.clone()).endpoint(crate::config::EndpointConfig::REQUIRED),
        )
        .layer(peer())
        .with_state(App {
            store,
            runs: Arc::clone(&runs),
        });
    let no_key = |method: &str, path: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap()
    };
    // POST without a key is refused; GET, PUT, HEAD and unmatched routes pass.
    let (status, _, body) = call(&router, no_key("POST", "/plain")).await;
    assert_eq!(status, 400);
    assert_eq!(code(&body), "IDEMPOTENCY_KEY_REQUIRED");
    for (method, path) in [
        ("GET", "/plain"),
        ("PUT", "/plain"),
        ("HEAD", "/plain"),
        ("POST", "/nowhere"),
    ] {
        let (status, _, _) = call(&router, no_key(method, path)).await;
        assert_eq!(status, 200, "{method} {path}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    // Under the layer, the attribute steps aside: one claim, one run, then the replay.
    let (s1, _, first) = call(&router, post_with_key("/create", "k", "x")).await;
    let (s2, h2, again) = call(&router, post_with_key("/create", "k", "x")).await;
    assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
    assert_eq!(h2["idempotency-replayed"], "true");
    assert_eq!(first, again);
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

/// The memory store, with switches that make claims or completions fail as an unreachable
/// database would.
#[derive(Default)]
struct Flaky {
    inner: crate::store::memory::MemoryStore,
    fail_claim: std::sync::atomic::AtomicBool,
    fail_complete: std::sync::atomic::AtomicBool,
}

fn down() -> crate::store::StoreError {
    crate::store::StoreError::unavailable("connection refused")
}

impl crate::store::Store for Flaky {
    async fn claim(
        &self,
        req: &crate::store::ClaimRequest<'_>,
    ) -> Result<crate::store::Claim, crate::store::StoreError> {
        if self.fail_claim.load(Ordering::SeqCst) {
            return Err(down());
        }
        self.inner.claim(req).await
    }
    async fn reclaim(
        &self,
        req: &crate::store::ClaimRequest<'_>,
        stale: crate::store::FencingToken,
    ) -> Result<crate::store::Claim, crate::store::StoreError> {
        self.inner.reclaim(req, stale).await
    }
    async fn complete(
        &self,
        scope: &crate::scope::ScopeHash,
        key: &str,
        token: crate::store::FencingToken,
        response: &crate::store::RecordedResponse,
        retention: std::time::Duration,
    ) -> Result<bool, crate::store::StoreError> {
        if self.fail_complete.load(Ordering::SeqCst) {
            return Err(down());
        }
        self.inner
            .complete(scope, key, token, response, retention)
            .await
    }
    async fn release(
        &self,
        scope: &crate::scope::ScopeHash,
        key: &str,
        token: crate::store::FencingToken,
    ) -> Result<bool, crate::store::StoreError> {
        self.inner.release(scope, key, token).await
    }
    async fn renew(
        &self,
        scope: &crate::scope::ScopeHash,
        key: &str,
        token: crate::store::FencingToken,
        lease: std::time::Duration,
    ) -> Result<bool, crate::store::StoreError> {
        self.inner.renew(scope, key, token, lease).await
    }
    async fn sweep(&self, batch: usize) -> Result<usize, crate::store::StoreError> {
        self.inner.sweep(batch).await
    }
    async fn inspect(
        &self,
        scope: &crate::scope::ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<crate::store::RecordInfo>, crate::store::StoreError> {
        self.inner.inspect(scope, key, with_response).await
    }
    async fn forget(
        &self,
        scope: &crate::scope::ScopeHash,
        key: &str,
    ) -> Result<bool, crate::store::StoreError> {
        self.inner.forget(scope, key).await
    }
}

#[tokio::test]
async fn unreachable_store_when_claiming_is_503_and_nothing_runs() {
    let flaky = Arc::new(Flaky::default());
    flaky.fail_claim.store(true, Ordering::SeqCst);
    let store = Idempotency::builder_arc(flaky).build();
    let (router, runs) = app(store);
    let router = router.layer(peer());
    let (status, headers, body) = call(&router, post_with_key("/create", "k", "x")).await;
    assert_eq!(status, 503);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(code(&body), "IDEMPOTENCY_STORE_UNAVAILABLE");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn unreachable_store_when_recording_still_sends_the_response() {
    let flaky = Arc::new(Flaky::default());
    flaky.fail_complete.store(true, Ordering::SeqCst);
    let store = Idempotency::builder_arc(flaky).build();
    let (router, runs) = app(store);
    let router = router.layer(peer());
    let (status, headers, body) = call(&router, post_with_key("/create", "k", "x")).await;
    assert_eq!(status, 200);
    assert!(!headers.contains_key("idempotency-replayed"));
    assert!(body.starts_with("x:"));
    // The reservation stands until its lease lapses: the retry is told to wait, not run.
    let (status, headers, body) = call(&router, post_with_key("/create", "k", "x")).await;
    assert_eq!(status, 409);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(code(&body), "IDEMPOTENCY_IN_PROGRESS");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn status_of(State(app): State<App>, request: Request) -> Response {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let code: u16 = request.uri().query().unwrap_or("200").parse().unwrap();
    Response::builder()
        .status(code)
        .header("x-trace", format!("t{n}"))
        .header("content-type", "text/plain")
        .body(Body::from(format!("run {n}")))
        .unwrap()
}

#[tokio::test]
async fn the_layer_applies_its_own_reuse_status_recording_rules_and_failure_mode() {
    let flaky = Arc::new(Flaky::default());
    let store = Idempotency::builder_arc(flaky.clone()).build();
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone()).endpoint(
        crate::config::EndpointConfig::REQUIRED
            .reuse_status(crate::config::ReuseStatus::Conflict)
            .non_replayable(&[404])
            .recorded_headers(&["x-trace"])
            .failure_mode(crate::config::FailureMode::Open),
    );
    let router = Router::new()
        .route("/s", post(status_of))
        .route_layer(layer)
        .with_state(App {
            store,
            runs: Arc::clone(&runs),
        })
        .layer(peer());
    let post = |key: &str, code: &str, body: &str| {
        Request::post(format!("/s?{code}"))
            .header("idempotency-key", key)
            .body(Body::from(body.to_owned()))
            .unwrap()
    };

    let (status, headers, body) = call(&router, post("a", "201", "x")).await;
    assert_eq!((status.as_u16(), body.as_str()), (201, "run 1"));
    assert_eq!(headers["x-trace"], "t1");
    let (status, headers, body) = call(&router, post("a", "201", "x")).await;
    assert_eq!((status.as_u16(), body.as_str()), (201, "run 1"), "replayed");
    assert_eq!(
        headers["x-trace"], "t1",
        "the route's allowlist kept x-trace"
    );
    assert!(
        headers.get("content-type").is_none(),
        "content-type is not on the route's list"
    );

    let (status, _, body) = call(&router, post("a", "201", "other body")).await;
    assert_eq!(
        (status.as_u16(), code(&body).as_str()),
        (409, "IDEMPOTENCY_KEY_REUSED")
    );

    // 404 is not recordable on this route, though it is by default; 429 is, here.
    for _ in 0..2 {
        assert_eq!(call(&router, post("b", "404", "x")).await.0, 404);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3, "each 404 ran");
    for _ in 0..2 {
        assert_eq!(call(&router, post("c", "429", "x")).await.0, 429);
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "the 429 was recorded and replayed"
    );

    flaky.fail_claim.store(true, Ordering::SeqCst);
    let (status, _, body) = call(&router, post("d", "201", "x")).await;
    assert_eq!(
        (status.as_u16(), body.as_str()),
        (201, "run 5"),
        "failing open"
    );
}

#[tokio::test]
async fn a_refusal_renderer_sets_the_content_type_and_body_and_keeps_the_status() {
    let store = Idempotency::builder(crate::store::memory::MemoryStore::default())
        .refusal_renderer(
            |p: &crate::problem::Problem| crate::problem::RenderedRefusal {
                content_type: "application/vnd.app+json".into(),
                body: format!("{{\"error\":\"{}\"}}", p.code()).into(),
            },
        )
        .build();
    let (router, _) = app(store);
    let router = router.layer(peer());
    let missing = Request::post("/create").body(Body::from("x")).unwrap();
    let (status, headers, body) = call(&router, missing).await;
    assert_eq!(status, 400);
    assert_eq!(headers["content-type"], "application/vnd.app+json");
    assert_eq!(body, r#"{"error":"IDEMPOTENCY_KEY_REQUIRED"}"#);
}

/// A span's metadata and the fields recorded on it.
type SpanRecord = (&'static tracing::Metadata<'static>, Vec<(String, String)>);

/// A subscriber that keeps every span's fields and every event's, to check what is logged.
#[derive(Default)]
struct Capture {
    spans: std::sync::Mutex<Vec<SpanRecord>>,
    stack: std::sync::Mutex<Vec<u64>>,
    events: std::sync::Mutex<Vec<String>>,
}

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, attrs: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut fields = Vec::new();
        attrs.record(&mut Fields(&mut fields));
        let mut spans = self.spans.lock().unwrap();
        spans.push((attrs.metadata(), fields));
        tracing::span::Id::from_u64(spans.len() as u64)
    }
    fn record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut spans = self.spans.lock().unwrap();
        values.record(&mut Fields(&mut spans[id.into_u64() as usize - 1].1));
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        self.events.lock().unwrap().push(format!("{fields:?}"));
    }
    fn enter(&self, id: &tracing::span::Id) {
        self.stack.lock().unwrap().push(id.into_u64());
    }
    fn exit(&self, _: &tracing::span::Id) {
        self.stack.lock().unwrap().pop();
    }
    fn current_span(&self) -> tracing_core::span::Current {
        match self.stack.lock().unwrap().last() {
            Some(&id) => {
                let metadata = self.spans.lock().unwrap()[id as usize - 1].0;
                tracing_core::span::Current::new(tracing::span::Id::from_u64(id), metadata)
            }
            None => tracing_core::span::Current::none(),
        }
    }
}

#[tokio::test]
async fn each_request_runs_in_one_span_with_route_decision_and_scope_never_the_key() {
    let capture = Arc::new(Capture::default());
    let _guard = crate::testlog::ThreadDefault::set(Arc::clone(&capture));
    let (router, runs) = app(Idempotency::memory());
    let router = router.layer(peer());
    let key = "secret-key-5b8e";
    for _ in 0..2 {
        assert_eq!(
            call(&router, post_with_key("/create", key, "x")).await.0,
            200
        );
    }
    assert_eq!(
        call(&router, post_with_key("/create", key, "y")).await.0,
        422
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let spans = capture.spans.lock().unwrap();
    let requests: Vec<_> = spans
        .iter()
        .filter(|(m, _)| m.name() == "idempotency")
        .map(|(_, fields)| fields)
        .collect();
    assert_eq!(requests.len(), 3, "one span per request: {requests:?}");
    let field = |fields: &Vec<(String, String)>, name: &str| {
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    for (fields, decision) in requests.iter().zip(["executed", "replayed", "key_reused"]) {
        assert_eq!(
            field(fields, "route").as_deref(),
            Some("/create"),
            "{fields:?}"
        );
        assert_eq!(
            field(fields, "decision").as_deref(),
            Some(decision),
            "{fields:?}"
        );
        let scope = field(fields, "scope").expect("the scope hash prefix");
        assert!(
            scope.len() >= 8 && scope.chars().all(|c| c.is_ascii_hexdigit()),
            "{scope}"
        );
    }
    let logged = format!("{spans:?}{:?}", capture.events.lock().unwrap());
    assert!(!logged.contains(key), "the key was logged: {logged}");
}

// Setups that would silently turn protection off are said once, with their fix (#19).

async fn ready_call<S>(service: &mut S, request: Request) -> StatusCode
where
    S: Service<Request, Response = Response, Error = std::convert::Infallible>,
{
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .unwrap();
    service.call(request).await.unwrap().status()
}

#[tokio::test]
async fn a_layer_around_the_finished_router_says_it_protects_nothing() {
    let runs = Arc::new(AtomicUsize::new(0));
    let routes = |path: &str| {
        let app = App {
            store: Idempotency::memory(),
            runs: Arc::clone(&runs),
        };
        Router::new().route(path, post(plain)).with_state(app)
    };
    let (logs, _guard) = crate::testlog::Logs::capture();
    let layer = IdempotencyLayer::new(strict(false));
    let mut outside = tower_layer::Layer::layer(&layer, routes("/misuse-outside").layer(peer()));
    for i in 0..16 {
        let request = post_with_key("/misuse-outside", &format!("k{i}"), "x");
        assert_eq!(ready_call(&mut outside, request).await, 200);
    }
    let errors = logs.errors();
    assert_eq!(errors.len(), 1, "said once: {errors:?}");
    assert!(
        errors[0].contains("Router::layer or Router::route_layer"),
        "{errors:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        16,
        "unprotected: nothing was claimed"
    );
    drop(_guard);

    let (logs, _guard) = crate::testlog::Logs::capture();
    let layer = IdempotencyLayer::new(strict(true));
    let mut inside = routes("/misuse-inside").layer(layer).layer(peer());
    for i in 0..16 {
        let request = post_with_key("/misuse-inside", &format!("k{i}"), "x");
        assert_eq!(ready_call(&mut inside, request).await, 200);
    }
    assert!(logs.errors().is_empty(), "{:?}", logs.errors());
}

/// Strict mode: a layer around a finished `Router` refuses the first request it would apply
/// to (the router it wraps sets the matched route only for its own handlers, so the layer can
/// never see one), with the fix in the log; other methods still pass.
#[tokio::test]
async fn strict_a_layer_around_the_finished_router_refuses_the_first_request() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = App {
        store: Idempotency::memory(),
        runs: Arc::clone(&runs),
    };
    let routes = Router::new()
        .route("/strict-outside", post(plain).get(plain))
        .with_state(app)
        .layer(peer());
    let (logs, _guard) = crate::testlog::Logs::capture();
    let layer =
        IdempotencyLayer::new(strict(true)).endpoint(crate::config::EndpointConfig::REQUIRED);
    let mut outside = tower_layer::Layer::layer(&layer, routes);
    for key in ["k", "k"] {
        let request = post_with_key("/strict-outside", key, "x");
        let response = {
            std::future::poll_fn(|cx| outside.poll_ready(cx))
                .await
                .unwrap();
            outside.call(request).await.unwrap()
        };
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert_eq!(parts.status, 500, "{body}");
        assert_eq!(parts.headers["content-type"], "application/problem+json");
        assert_eq!(code(&body), "IDEMPOTENCY_MISCONFIGURED");
    }
    let keyless = Request::post("/strict-outside")
        .body(Body::empty())
        .unwrap();
    assert_eq!(ready_call(&mut outside, keyless).await, 500);
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran unprotected");
    let get = Request::get("/strict-outside").body(Body::empty()).unwrap();
    assert_eq!(
        ready_call(&mut outside, get).await,
        200,
        "GET is not its business"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let errors = logs.errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("Router::layer or Router::route_layer")),
        "{errors:?}"
    );
}

#[tokio::test]
async fn a_required_key_under_an_optional_layer_is_still_required_and_said() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let store = strict(false);
    let (router, runs) = app(store.clone());
    let router = router.layer(IdempotencyLayer::new(store)).layer(peer());
    let request = Request::post("/create").body(Body::from("x")).unwrap();
    let (status, _, body) = call(&router, request).await;
    assert_eq!(
        (status.as_u16(), code(&body).as_str()),
        (400, "IDEMPOTENCY_KEY_REQUIRED")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler did not run");
    let errors = logs.errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("make the layer require the key")),
        "{errors:?}"
    );

    let (logs, _guard) = crate::testlog::Logs::capture();
    let store = Idempotency::memory();
    let (router, _) = app(store.clone());
    let router = router
        .layer(IdempotencyLayer::new(store).endpoint(crate::config::EndpointConfig::REQUIRED))
        .layer(peer());
    let request = Request::post("/create").body(Body::from("x")).unwrap();
    let (status, _, _) = call(&router, request).await;
    assert_eq!(status, 400);
    assert!(logs.errors().is_empty(), "{:?}", logs.errors());
}

#[idempotent(crate = crate, require_key, key = header("X-Request-Key"))]
async fn create_by_header(State(app): State<App>, body: String) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    body
}

#[idempotent(crate = crate, require_key, key = body("/id"))]
async fn create_by_body(State(app): State<App>, body: String) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    body
}

/// Under an optional layer (strict mode off), a `require_key` attribute judges "keyless" where
/// it reads its own key, as it would alone: its own header, not the configured one; a key in
/// the body is not refused as missing before the body is read.
#[tokio::test]
async fn a_required_key_under_an_optional_layer_is_looked_for_where_the_attribute_reads_it() {
    let store = strict(false);
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route("/by-header", post(create_by_header))
        .route("/by-body", post(create_by_body))
        .with_state(App {
            store: store.clone(),
            runs: Arc::clone(&runs),
        })
        .layer(IdempotencyLayer::new(store))
        .layer(peer());
    let by_header = Request::post("/by-header")
        .header("x-request-key", "k1")
        .body(Body::from("x"))
        .unwrap();
    let (status, _, body) = call(&router, by_header).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "x"));
    let by_body = Request::post("/by-body")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"id":"k2"}"#))
        .unwrap();
    let (status, _, body) = call(&router, by_body).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"id":"k2"}"#));
    assert_eq!(runs.load(Ordering::SeqCst), 2, "both ran under the layer");

    // Keyless where the attribute reads its key, and the layer left no context.
    let keyless = Request::post("/by-header").body(Body::from("x")).unwrap();
    let (status, _, body) = call(&router, keyless).await;
    assert_eq!(
        (status.as_u16(), code(&body).as_str()),
        (400, "IDEMPOTENCY_KEY_REQUIRED")
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the keyless one did not run"
    );
}

/// Strict mode: a `require_key` attribute under a layer whose key is optional is refused on the
/// first request either way, keyed or not (the layer's marker says its key is optional).
#[tokio::test]
async fn strict_a_required_key_under_an_optional_layer_is_refused() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let store = strict(true);
    let (router, runs) = app(store.clone());
    let router = router.layer(IdempotencyLayer::new(store)).layer(peer());
    for request in [
        post_with_key("/create", "k", "x"),
        Request::post("/create").body(Body::from("x")).unwrap(),
    ] {
        let (status, headers, body) = call(&router, request).await;
        assert_eq!(status, 500, "{body}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert!(!headers.contains_key("idempotency-replayed"));
        assert_eq!(code(&body), "IDEMPOTENCY_MISCONFIGURED");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler did not run");
    let errors = logs.errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("make the layer require the key")),
        "{errors:?}"
    );

    // Off, today's behaviour: the keyed request runs under the layer, and is replayed.
    let store = strict(false);
    let (router, runs) = app(store.clone());
    let router = router.layer(IdempotencyLayer::new(store)).layer(peer());
    let (s1, _, first) = call(&router, post_with_key("/create", "k", "x")).await;
    let (s2, h2, again) = call(&router, post_with_key("/create", "k", "x")).await;
    assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
    assert_eq!(h2["idempotency-replayed"], "true");
    assert_eq!(first, again);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn two_memory_stores_on_one_route_are_said_and_one_shared_store_replays() {
    let routed = |store: Idempotency| {
        Router::new()
            .route("/misuse-split", post(create))
            .with_state(App {
                store,
                runs: Arc::default(),
            })
            .layer(peer())
    };
    let (logs, _guard) = crate::testlog::Logs::capture();
    let (a, b) = (routed(Idempotency::memory()), routed(Idempotency::memory()));
    assert_eq!(
        call(&a, post_with_key("/misuse-split", "k", "x")).await.0,
        200
    );
    let (_, headers, _) = call(&b, post_with_key("/misuse-split", "k", "x")).await;
    assert!(
        !headers.contains_key("idempotency-replayed"),
        "the other store ran it again"
    );
    let errors = logs.errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("build the Idempotency handle once")),
        "{errors:?}"
    );
    drop((a, b));

    let (logs, _guard) = crate::testlog::Logs::capture();
    let shared = Idempotency::memory();
    let (a, b) = (routed(shared.clone()), routed(shared));
    assert_eq!(
        call(&a, post_with_key("/misuse-split", "k", "x")).await.0,
        200
    );
    let (_, headers, _) = call(&b, post_with_key("/misuse-split", "k", "x")).await;
    assert_eq!(headers["idempotency-replayed"], "true");
    assert!(logs.errors().is_empty(), "{:?}", logs.errors());
}

#[idempotent(crate = crate, require_key)]
async fn read(State(app): State<App>, body: String) -> String {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    format!("run {n} {body}")
}

/// GET, HEAD and OPTIONS are idempotent by HTTP semantics (DESIGN.md §8): a handler under
/// `#[idempotent(require_key)]` routed for them runs every time, keyed or not, and is never
/// replayed; POST to the same handler is still claimed.
#[tokio::test]
async fn the_attribute_passes_get_head_and_options_through() {
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route("/read", get(read).post(read).options(read))
        .with_state(App {
            store: Idempotency::memory(),
            runs: Arc::clone(&runs),
        })
        .layer(peer());
    let keyed = |method: &str, body: &str| {
        Request::builder()
            .method(method)
            .uri("/read")
            .header("idempotency-key", "k")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    for (n, body) in [(1, "a"), (2, "a"), (3, "b")] {
        let (status, headers, text) = call(&router, keyed("GET", body)).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(!headers.contains_key("idempotency-replayed"));
        assert_eq!(text, format!("run {n} {body}"));
    }
    let (status, headers, text) = call(&router, keyed("HEAD", "c")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(!headers.contains_key("idempotency-replayed"));
    assert_eq!(text, "", "HEAD has no body");
    let (status, headers, text) = call(&router, keyed("OPTIONS", "d")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(!headers.contains_key("idempotency-replayed"));
    assert_eq!(text, "run 5 d");
    let keyless = Request::get("/read").body(Body::empty()).unwrap();
    let (status, _, text) = call(&router, keyless).await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "run 6 "));
    assert_eq!(runs.load(Ordering::SeqCst), 6);

    let (s1, h1, first) = call(&router, keyed("POST", "p")).await;
    let (s2, h2, again) = call(&router, keyed("POST", "p")).await;
    assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
    assert!(!h1.contains_key("idempotency-replayed"));
    assert_eq!(h2["idempotency-replayed"], "true");
    assert_eq!((first.as_str(), again.as_str()), ("run 7 p", "run 7 p"));
    let keyless = Request::post("/read").body(Body::empty()).unwrap();
    let (status, _, body) = call(&router, keyless).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(code(&body), "IDEMPOTENCY_KEY_REQUIRED");
    assert_eq!(runs.load(Ordering::SeqCst), 7);
}

#[idempotent(crate = crate)]
async fn by_default(State(app): State<App>, body: String) -> String {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    format!("run {n} {body}")
}

#[idempotent(crate = crate, methods = ["PUT"])]
async fn put_only(State(app): State<App>, body: String) -> String {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    format!("run {n} {body}")
}

/// The attribute applies to POST and PATCH by default, like the layer: a PUT with a key runs
/// every time (outside strict mode, see below). With `methods = ["PUT"]` the PUT is claimed and
/// replayed, and POST passes.
#[tokio::test]
async fn the_attribute_applies_to_its_methods_post_and_patch_by_default() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route(
            "/default",
            post(by_default).put(by_default).patch(by_default),
        )
        .route("/put-only", post(put_only).put(put_only))
        .with_state(App {
            store: strict(false),
            runs: Arc::clone(&runs),
        })
        .layer(peer());
    let keyed = |method: &str, path: &str, key: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header("idempotency-key", key)
            .body(Body::from("b"))
            .unwrap()
    };
    let mut seen = Vec::new();
    for (method, path, key) in [
        ("PUT", "/default", "k1"),
        ("PUT", "/default", "k1"),
        ("PATCH", "/default", "k2"),
        ("PATCH", "/default", "k2"),
        ("PUT", "/put-only", "k3"),
        ("PUT", "/put-only", "k3"),
        ("POST", "/put-only", "k4"),
        ("POST", "/put-only", "k4"),
    ] {
        let (status, headers, text) = call(&router, keyed(method, path, key)).await;
        assert_eq!(status, StatusCode::OK, "{method} {path}: {text}");
        let replayed = headers.contains_key("idempotency-replayed");
        seen.push((text, replayed));
    }
    let expect = |n: usize, replayed: bool| (format!("run {n} b"), replayed);
    assert_eq!(
        seen,
        [
            expect(1, false),
            expect(2, false),
            expect(3, false),
            expect(3, true),
            expect(4, false),
            expect(4, true),
            expect(5, false),
            expect(6, false),
        ],
        "default PUT runs twice, PATCH replays; methods = [\"PUT\"]: PUT replays, POST runs twice"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 6);
    let errors = logs.errors();
    assert_eq!(errors.len(), 1, "said once per handle: {errors:?}");
    assert!(errors[0].contains("/default"), "{errors:?}");
}

/// A keyed unsafe request outside the attribute's methods (`put(…)`, `delete(…)` under a plain
/// `#[idempotent]`) is a setup mistake: said once with the fix, and refused 500 in strict mode.
/// Safe methods and keyless requests still pass untouched.
#[tokio::test]
async fn strict_a_keyed_put_or_delete_outside_the_methods_is_refused_and_said() {
    let (logs, _guard) = crate::testlog::Logs::capture();
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route(
            "/unlisted",
            post(by_default)
                .put(by_default)
                .delete(by_default)
                .get(by_default),
        )
        .with_state(App {
            store: strict(true),
            runs: Arc::clone(&runs),
        })
        .layer(peer());
    let request = |method: &str, key: Option<&str>| {
        let request = Request::builder().method(method).uri("/unlisted");
        let request = match key {
            Some(key) => request.header("idempotency-key", key),
            None => request,
        };
        request.body(Body::from("b")).unwrap()
    };
    for method in ["PUT", "DELETE", "PUT"] {
        let (status, headers, body) = call(&router, request(method, Some("k"))).await;
        assert_eq!(status, 500, "{method}: {body}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert_eq!(code(&body), "IDEMPOTENCY_MISCONFIGURED");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran unprotected");
    let errors = logs.errors();
    assert_eq!(errors.len(), 1, "said once: {errors:?}");
    for part in ["/unlisted", "PUT", r#"methods = ["PUT"]"#] {
        assert!(errors[0].contains(part), "{part}: {errors:?}");
    }
    let (status, _, text) = call(&router, request("PUT", None)).await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "run 1 b"));
    let (status, headers, text) = call(&router, request("GET", Some("g"))).await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "run 2 b"));
    assert!(!headers.contains_key("idempotency-replayed"));
    let (s1, _, _) = call(&router, request("POST", Some("p"))).await;
    let (s2, h2, _) = call(&router, request("POST", Some("p"))).await;
    assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
    assert_eq!(h2["idempotency-replayed"], "true");
    assert_eq!(logs.errors().len(), 1);
}

/// An answer whose body streams its data, then trailers: gRPC's status (always recorded), one
/// the allowlist keeps (`x-checksum`) and one it does not (`x-secret`).
async fn trailed(State(app): State<App>) -> Response {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    trailers.insert("x-checksum", format!("c{n}").parse().unwrap());
    trailers.insert("x-secret", http::HeaderValue::from_static("s"));
    let frames = futures_util::stream::iter([
        Ok::<_, std::convert::Infallible>(http_body::Frame::data(bytes::Bytes::from(format!(
            "run {n}"
        )))),
        Ok(http_body::Frame::trailers(trailers)),
    ]);
    Response::builder()
        .header("content-type", "text/plain")
        .body(Body::new(http_body_util::StreamBody::new(frames)))
        .unwrap()
}

#[idempotent(crate = crate, require_key)]
async fn trailed_by_attribute(state: State<App>) -> Response {
    trailed(state).await
}

/// A handle whose allowlist keeps `x-checksum` and whose answers may record `max_response`
/// bytes.
fn trailers_handle(max_response: usize) -> Idempotency {
    let config = crate::config::Config::builder()
        .recorded_headers(["content-type", "x-checksum"])
        .max_response(max_response)
        .build();
    Idempotency::builder(crate::store::memory::MemoryStore::default())
        .config(config)
        .build()
}

/// The routers under test: the attribute's and the layer's, each with its run counter.
fn trailed_routers(store: &Idempotency) -> [(&'static str, Router, Arc<AtomicUsize>); 2] {
    let state = |runs: &Arc<AtomicUsize>| App {
        store: store.clone(),
        runs: Arc::clone(runs),
    };
    let (a, b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let attribute = Router::new()
        .route("/t", post(trailed_by_attribute))
        .with_state(state(&a))
        .layer(peer());
    let layer = Router::new()
        .route("/t", post(trailed))
        .route_layer(
            IdempotencyLayer::new(store.clone()).endpoint(crate::config::EndpointConfig::REQUIRED),
        )
        .with_state(state(&b))
        .layer(peer());
    [("attribute", attribute, a), ("layer", layer, b)]
}

/// [`call`], with the trailers the body ended with.
async fn call_trailed(
    router: &Router,
    request: Request,
) -> (http::HeaderMap, String, Option<http::HeaderMap>) {
    let response: Response = router.clone().call(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    let body = collected.to_bytes();
    (
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
        trailers,
    )
}

#[tokio::test]
async fn an_answer_with_trailers_is_recorded_and_replayed_with_them() {
    // One store, a key of each router's own.
    let store = trailers_handle(1 << 20);
    for (what, router, runs) in trailed_routers(&store) {
        let (_, body, trailers) = call_trailed(&router, post_with_key("/t", what, "x")).await;
        assert_eq!(body, "run 1", "{what}");
        let trailers = trailers.unwrap_or_else(|| panic!("{what}: the first answer's trailers"));
        // The first answer carries every trailer its handler sent.
        assert_eq!(trailers["grpc-status"], "0", "{what}");
        assert_eq!(trailers["x-checksum"], "c1", "{what}");
        assert_eq!(trailers["x-secret"], "s", "{what}");

        let (headers, body, trailers) = call_trailed(&router, post_with_key("/t", what, "x")).await;
        assert_eq!(body, "run 1", "{what}: replayed");
        assert_eq!(headers["idempotency-replayed"], "true", "{what}");
        let trailers = trailers.unwrap_or_else(|| panic!("{what}: the replay's trailers"));
        // The replay carries the recorded trailers.
        assert_eq!(trailers["grpc-status"], "0", "{what}");
        assert_eq!(trailers["x-checksum"], "c1", "{what}");
        assert_eq!(
            trailers.get("x-secret"),
            None,
            "{what}: a trailer off the allowlist is not recorded"
        );
        assert_eq!(trailers.len(), 2, "{what}: {trailers:?}");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{what}: the handler ran once"
        );
    }
}

/// An answer over `max_response` is sent on unrecorded, its trailers included.
#[tokio::test]
async fn an_answer_too_large_to_record_still_ends_with_its_trailers() {
    let store = trailers_handle(2);
    for (what, router, runs) in trailed_routers(&store) {
        for n in 1..=2 {
            let (_, body, trailers) = call_trailed(&router, post_with_key("/t", what, "x")).await;
            assert_eq!(
                body,
                format!("run {n}"),
                "{what}: not recorded, so run again"
            );
            let trailers = trailers.unwrap_or_else(|| panic!("{what}: the answer's trailers"));
            assert_eq!(trailers["x-checksum"], format!("c{n}"), "{what}");
            assert_eq!(trailers["x-secret"], "s", "{what}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{what}");
    }
}
