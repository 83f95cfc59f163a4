//! What reaches the store, and what happens when it cannot be reached (DESIGN.md §2, §3), over
//! real HTTP on an in-test axum server whose store is a spy around the memory store: it can be
//! taken down (every call `Unavailable`) or filled (claims answer `Full`), and it keeps the
//! lease and retention each call asked for.
//!
//! - `FailureMode::Open`: while the store is down a keyed request runs unprotected, every time,
//!   and nothing is recorded; once it is back the key runs once more and then replays.
//! - `FailureMode::Closed` (the default): 503 `IDEMPOTENCY_STORE_UNAVAILABLE`, the handler never
//!   runs; a full store is 503 `IDEMPOTENCY_STORE_FULL` in both modes (failing open is for an
//!   unreachable store only).
//! - The attribute's `lease` and `retention` arguments are what the store is asked for at run
//!   time (claim, renewal, completion), not the handle's defaults.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::Idempotency;
use idempotent_runtime::axum::idempotent;
use idempotent_runtime::config::{Config, FailureMode};
use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::memory::MemoryStore;
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordInfo, RecordedResponse, Store, StoreError,
};
use serde_json::{Value, json};

/// The memory store behind switches, remembering the durations it was asked for.
#[derive(Default)]
struct Spy {
    inner: MemoryStore,
    down: AtomicBool,
    full: AtomicBool,
    claims: AtomicUsize,
    /// `(lease, retention)` of each claim and reclaim.
    claimed: Mutex<Vec<(Duration, Duration)>>,
    /// The lease of each renewal.
    renewed: Mutex<Vec<Duration>>,
    /// The retention of each completion.
    completed: Mutex<Vec<Duration>>,
}

impl Spy {
    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            Err(StoreError::unavailable("the spy store is down"))
        } else {
            Ok(())
        }
    }
}

/// Lets the test keep a handle on the spy that the runtime owns.
#[derive(Clone, Default)]
struct SharedSpy(Arc<Spy>);

impl Store for SharedSpy {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.0.claims.fetch_add(1, Ordering::SeqCst);
        self.0.check()?;
        if self.0.full.load(Ordering::SeqCst) {
            return Err(StoreError::Full);
        }
        self.0
            .claimed
            .lock()
            .unwrap()
            .push((req.lease, req.retention));
        self.0.inner.claim(req).await
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.0.check()?;
        self.0
            .claimed
            .lock()
            .unwrap()
            .push((req.lease, req.retention));
        self.0.inner.reclaim(req, stale).await
    }

    async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.0.check()?;
        self.0.completed.lock().unwrap().push(retention);
        self.0
            .inner
            .complete(scope, key, token, response, retention)
            .await
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.0.check()?;
        self.0.inner.release(scope, key, token).await
    }

    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.0.check()?;
        self.0.renewed.lock().unwrap().push(lease);
        self.0.inner.renew(scope, key, token, lease).await
    }

    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        self.0.check()?;
        self.0.inner.sweep(batch).await
    }

    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        self.0.check()?;
        self.0.inner.inspect(scope, key, with_response).await
    }

    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        self.0.check()?;
        self.0.inner.forget(scope, key).await
    }
}

#[derive(Clone)]
struct AppState {
    idempotency: Idempotency,
    runs: Arc<AtomicUsize>,
}

impl FromRef<AppState> for Idempotency {
    fn from_ref(state: &AppState) -> Self {
        state.idempotency.clone()
    }
}

#[idempotent(require_key)]
async fn create(
    State(state): State<AppState>,
    Json(_body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = state.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, Json(json!({ "execution": n })))
}

/// Durations set on the attribute, far from the handle's (60 s lease, 24 h retention). The
/// handler outlives a third of the lease, so the runtime renews it at least once.
#[idempotent(require_key, lease = "3s", retention = "90s")]
async fn tuned(
    State(state): State<AppState>,
    Json(_body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = state.runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    (StatusCode::CREATED, Json(json!({ "execution": n })))
}

struct TestServer {
    url: String,
    spy: Arc<Spy>,
    runs: Arc<AtomicUsize>,
    client: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    body: Value,
}

impl TestServer {
    async fn start(mode: FailureMode) -> Self {
        let spy = SharedSpy::default();
        let config = Config::builder().failure_mode(mode).build();
        let idempotency = Idempotency::builder(spy.clone())
            .config(config)
            .sweeper(false)
            .build();
        let runs = Arc::new(AtomicUsize::new(0));
        let app = Router::new()
            .route("/create", post(create))
            .route("/tuned", post(tuned))
            .with_state(AppState {
                idempotency,
                runs: Arc::clone(&runs),
            });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await;
        });
        Self {
            url,
            spy: spy.0,
            runs,
            client: reqwest::Client::new(),
            task,
        }
    }

    async fn post(&self, path: &str, key: &str) -> Answer {
        let response = self
            .client
            .post(format!("{}{path}", self.url))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(r#"{"item":"book"}"#)
            .send()
            .await
            .expect("send");
        let status = response.status().as_u16();
        let replayed = match response.headers().get("idempotency-replayed") {
            None => false,
            Some(v) if v == "true" => true,
            Some(v) => panic!("Idempotency-Replayed: {v:?}"),
        };
        let bytes = response.bytes().await.expect("a body");
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{e}: status {status}, body {bytes:?}"));
        Answer {
            status,
            replayed,
            body,
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

#[track_caller]
fn assert_problem(a: &Answer, status: u16, code: &str) {
    assert_eq!(a.status, status, "{a:?}");
    assert_eq!(a.body["code"], code, "{a:?}");
    assert!(!a.replayed, "{a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_runs_unprotected_while_the_store_is_down_and_records_nothing() {
    let s = TestServer::start(FailureMode::Open).await;
    s.spy.down.store(true, Ordering::SeqCst);
    for run in 1..=3 {
        let a = s.post("/create", "k-open").await;
        assert_eq!(a.status, 201, "run {run} while the store is down: {a:?}");
        assert!(!a.replayed, "nothing was recorded to replay: {a:?}");
        assert_eq!(a.body, json!({ "execution": run }));
        assert_eq!(s.runs(), run, "the handler ran unprotected, every time");
    }
    assert!(
        s.spy.completed.lock().unwrap().is_empty(),
        "nothing is completed while failing open"
    );

    // Back up: nothing stands under the key, so it runs once more, then replays.
    s.spy.down.store(false, Ordering::SeqCst);
    let first = s.post("/create", "k-open").await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    assert_eq!(first.body, json!({ "execution": 4 }));
    let again = s.post("/create", "k-open").await;
    assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(s.runs(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_refuses_with_503_while_the_store_is_down() {
    let s = TestServer::start(FailureMode::Closed).await;
    s.spy.down.store(true, Ordering::SeqCst);
    for _ in 0..2 {
        let a = s.post("/create", "k-closed").await;
        assert_problem(&a, 503, "IDEMPOTENCY_STORE_UNAVAILABLE");
    }
    assert_eq!(s.runs(), 0, "nothing runs unprotected");
    assert!(
        s.spy.claims.load(Ordering::SeqCst) >= 2,
        "the store was asked"
    );
    s.spy.down.store(false, Ordering::SeqCst);
    let a = s.post("/create", "k-closed").await;
    assert_eq!((a.status, a.replayed), (201, false), "{a:?}");
    assert_eq!(s.runs(), 1);
}

/// Failing open is for a store that cannot be reached: a full store refuses in both modes,
/// before the handler runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_is_503_store_full_in_both_modes() {
    for mode in [FailureMode::Closed, FailureMode::Open] {
        let s = TestServer::start(mode).await;
        s.spy.full.store(true, Ordering::SeqCst);
        let a = s.post("/create", "k-full").await;
        assert_problem(&a, 503, "IDEMPOTENCY_STORE_FULL");
        assert_eq!(s.runs(), 0, "{mode:?}: the handler did not run");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attributes_lease_and_retention_are_what_the_store_is_asked_for() {
    let s = TestServer::start(FailureMode::Closed).await;
    let tuned = s.post("/tuned", "k-tuned").await;
    assert_eq!((tuned.status, tuned.replayed), (201, false), "{tuned:?}");
    let plain = s.post("/create", "k-plain").await;
    assert_eq!(plain.status, 201, "{plain:?}");

    let claimed = s.spy.claimed.lock().unwrap().clone();
    assert_eq!(
        claimed,
        vec![
            (Duration::from_secs(3), Duration::from_secs(90)),
            (Duration::from_secs(60), Duration::from_secs(86_400)),
        ],
        "(lease, retention) of each claim: the attribute's, then the handle's defaults"
    );
    let renewed = s.spy.renewed.lock().unwrap().clone();
    assert!(
        !renewed.is_empty(),
        "a 1.5 s handler under a 3 s lease is renewed (every third of it)"
    );
    assert!(
        renewed.iter().all(|&l| l == Duration::from_secs(3)),
        "renewals extend by the attribute's lease: {renewed:?}"
    );
    let completed = s.spy.completed.lock().unwrap().clone();
    assert_eq!(
        completed,
        vec![Duration::from_secs(90), Duration::from_secs(86_400)],
        "each completion keeps its record for its endpoint's retention"
    );
    let replay = s.post("/tuned", "k-tuned").await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(s.runs(), 2);
}
