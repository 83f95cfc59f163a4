//! A framework adapter written outside the crate, over plain types, with nothing but the public
//! `idempotent_runtime::adapter` module: the proof a tonic, poem or hyper adapter needs nothing
//! private. It replays, answers 409 for a duplicate in progress and 422 for a reused key.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use idempotent_runtime::adapter::{self, Chunks, Ended, Head, Prepared, Reply, Served};
use idempotent_runtime::scope::Identity;
use idempotent_runtime::store::memory::MemoryStore;
use idempotent_runtime::{Idempotency, config::EndpointConfig};
use tokio::sync::Notify;

/// A request head: method, route, headers and the peer.
struct PlainHead {
    method: &'static str,
    headers: Vec<(&'static str, Vec<u8>)>,
}

impl Head for PlainHead {
    fn method(&self) -> &str {
        self.method
    }
    fn route(&self) -> Option<&str> {
        Some("/plain")
    }
    fn path_params(&self) -> Vec<&str> {
        Vec::new()
    }
    fn query(&self) -> Option<&str> {
        None
    }
    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| &v[..])
    }
    fn peer(&self) -> Option<IpAddr> {
        Some([192, 0, 2, 7].into())
    }
    fn with_identity<T>(&self, f: impl FnOnce(Option<&Identity>) -> T) -> T {
        f(None)
    }
}

/// A body held in memory, sent as one chunk.
struct PlainBody(Option<Bytes>);

/// A request body the pipeline read (to find a key in it) and hands back to the handler.
impl From<Bytes> for PlainBody {
    fn from(bytes: Bytes) -> Self {
        Self(Some(bytes))
    }
}

impl Chunks for PlainBody {
    type Error = Infallible;
    fn exact_len(&self) -> Option<u64> {
        Some(self.0.as_ref().map_or(0, |b| b.len() as u64))
    }
    fn poll_chunk(&mut self, _: &mut Context<'_>) -> Poll<Option<Result<Bytes, Infallible>>> {
        Poll::Ready(self.0.take().filter(|b| !b.is_empty()).map(Ok))
    }
}

type Headers = Vec<(String, Vec<u8>)>;

/// A response: status, headers, body.
struct PlainResponse {
    status: u16,
    headers: Headers,
    body: PlainBody,
}

impl PlainResponse {
    fn header(&self, name: &str) -> Option<&[u8]> {
        let found = self.headers.iter().find(|(n, _)| n == name);
        found.map(|(_, v)| &v[..])
    }
    fn text(&mut self) -> String {
        let body = self.body.0.take().unwrap_or_default();
        String::from_utf8_lossy(&body).into_owned()
    }
}

impl Reply for PlainResponse {
    type Head = (u16, Headers);
    type Body = PlainBody;

    fn status(&self) -> u16 {
        self.status
    }
    fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.headers.iter().map(|(n, v)| (n.as_str(), &v[..]))
    }
    fn into_parts(self) -> (Self::Head, PlainBody) {
        ((self.status, self.headers), self.body)
    }
    fn from_parts((status, headers): Self::Head, body: PlainBody) -> Self {
        Self {
            status,
            headers,
            body,
        }
    }
    fn recorded(head: Self::Head, bytes: Bytes, _drained: PlainBody) -> Self {
        Self::from_parts(head, PlainBody(Some(bytes)))
    }
    fn resumed(head: Self::Head, read: Bytes, _: Option<Infallible>, rest: PlainBody) -> Self {
        let mut whole = read.to_vec();
        whole.extend_from_slice(&rest.0.unwrap_or_default());
        Self::from_parts(head, PlainBody(Some(whole.into())))
    }
    fn build<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        body: Bytes,
    ) -> Self {
        let headers = headers.into_iter();
        Self {
            status,
            headers: headers.map(|(n, v)| (n.to_owned(), v.to_vec())).collect(),
            body: PlainBody(Some(body)),
        }
    }
    fn mark_replayed(mut self) -> Self {
        self.headers.push((
            idempotent_runtime::REPLAYED_HEADER.to_owned(),
            b"true".to_vec(),
        ));
        self
    }
}

/// The whole adapter: translate, prepare, run the handler under the claim.
async fn serve<F, Fut>(
    handle: &Idempotency,
    method: &'static str,
    key: Option<&str>,
    body: &'static str,
    handler: F,
) -> PlainResponse
where
    F: FnOnce(Bytes) -> Fut,
    Fut: Future<Output = PlainResponse> + Send + 'static,
{
    let mut headers = vec![("content-type", b"text/plain".to_vec())];
    if let Some(key) = key {
        headers.push(("idempotency-key", key.as_bytes().to_vec()));
    }
    let head = PlainHead { method, headers };
    let body = PlainBody(Some(Bytes::from_static(body.as_bytes())));
    match adapter::prepare(handle, &EndpointConfig::REQUIRED, &head, body).await {
        Prepared::Pass(body) => handler(body.0.unwrap_or_default()).await,
        Prepared::Answer(answer) => answer,
        Prepared::Claimed(claimed) => {
            let running = handler(claimed.body().clone());
            let run = async move { Ok::<_, Infallible>((running.await, ())) };
            match claimed.run(Served::ByHandler, run).await {
                Ended::Answered(response, ()) | Ended::Panicked(response) => response,
                Ended::Failed(never) => match never {},
            }
        }
    }
}

fn created(runs: &Arc<AtomicUsize>, body: Bytes) -> impl Future<Output = PlainResponse> + use<> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let text = format!("order {n}: {}", String::from_utf8_lossy(&body));
    async move { PlainResponse::build(201, [], text.into()) }
}

fn code(response: &mut PlainResponse) -> String {
    let text = response.text();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    doc["code"].as_str().unwrap_or(&text).to_owned()
}

fn handle() -> Idempotency {
    Idempotency::builder(MemoryStore::default())
        .sweeper(false)
        .build()
}

#[tokio::test]
async fn a_plain_adapter_records_replays_and_refuses_a_reused_key() {
    let handle = handle();
    let runs = Arc::new(AtomicUsize::new(0));
    let run = |body| created(&runs, body);
    let mut first = serve(&handle, "POST", Some("k1"), "tea", run).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotency-replayed"), None);
    assert_eq!(first.text(), "order 1: tea");

    let mut again = serve(&handle, "POST", Some("k1"), "tea", |b| created(&runs, b)).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotency-replayed"), Some(&b"true"[..]));
    assert_eq!(
        again.text(),
        "order 1: tea",
        "the recorded answer, not a second run"
    );

    let mut reused = serve(&handle, "POST", Some("k1"), "cake", |b| created(&runs, b)).await;
    assert_eq!(reused.status, 422);
    assert_eq!(code(&mut reused), "IDEMPOTENCY_KEY_REUSED");

    let mut keyless = serve(&handle, "POST", None, "tea", |b| created(&runs, b)).await;
    assert_eq!(keyless.status, 400);
    assert_eq!(code(&mut keyless), "IDEMPOTENCY_KEY_REQUIRED");

    let mut get = serve(&handle, "GET", Some("k1"), "", |b| created(&runs, b)).await;
    assert_eq!((get.status, get.text().as_str()), (201, "order 2: "));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "safe methods pass, untouched"
    );
}

#[tokio::test]
async fn a_plain_adapter_answers_409_while_the_first_request_runs() {
    let handle = handle();
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let first = {
        let (handle, started, release) = (handle.clone(), started.clone(), release.clone());
        tokio::spawn(async move {
            let slow = move |_| async move {
                started.notify_one();
                release.notified().await;
                PlainResponse::build(201, [], Bytes::from_static(b"done"))
            };
            serve(&handle, "POST", Some("k"), "x", slow).await.status
        })
    };
    started.notified().await;
    let never = |_| async { unreachable!("a duplicate never runs") };
    let mut duplicate = serve(&handle, "POST", Some("k"), "x", never).await;
    assert_eq!(duplicate.status, 409);
    assert!(duplicate.header("retry-after").is_some());
    assert_eq!(code(&mut duplicate), "IDEMPOTENCY_IN_PROGRESS");
    release.notify_one();
    assert_eq!(first.await.unwrap(), 201);
    let replay = serve(&handle, "POST", Some("k"), "x", never).await;
    assert_eq!(replay.header("idempotency-replayed"), Some(&b"true"[..]));
}
