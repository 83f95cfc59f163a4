//! Each step of the pipeline, driven by a test adapter without any framework.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;

use futures_util::FutureExt as _;

use super::*;
use crate::config::Config;
use crate::problem::ProblemCode;
use crate::store::memory::MemoryStore;

// `'static` references: an `EndpointConfig` owns its lists, so `&EndpointConfig::REQUIRED` is a
// temporary.
const OPTIONAL: &EndpointConfig = &EndpointConfig::OPTIONAL;
const REQUIRED: &EndpointConfig = &EndpointConfig::REQUIRED;

#[derive(Default)]
struct TestHead {
    headers: Vec<(&'static str, Vec<u8>)>,
    peer: Option<IpAddr>,
    identity: Option<Identity>,
}

impl TestHead {
    fn keyed(key: &str) -> Self {
        Self::default()
            .header("idempotency-key", key)
            .peer(Ipv4Addr::new(10, 0, 0, 1).into())
    }

    fn header(mut self, name: &'static str, value: &str) -> Self {
        self.headers.push((name, value.as_bytes().to_vec()));
        self
    }

    fn header_bytes(mut self, name: &'static str, value: &[u8]) -> Self {
        self.headers.push((name, value.to_vec()));
        self
    }

    fn peer(mut self, ip: IpAddr) -> Self {
        self.peer = Some(ip);
        self
    }
}

impl Head for TestHead {
    fn method(&self) -> &str {
        "POST"
    }

    fn route(&self) -> Option<&str> {
        Some("/orders")
    }

    fn path_params(&self) -> Vec<&str> {
        Vec::new()
    }

    fn query(&self) -> Option<&str> {
        None
    }

    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        let values = self.headers.iter().filter(move |(n, _)| *n == name);
        values.map(|(_, v)| v.as_slice())
    }

    fn peer(&self) -> Option<IpAddr> {
        self.peer
    }

    fn with_identity<T>(&self, f: impl FnOnce(Option<&Identity>) -> T) -> T {
        f(self.identity.as_ref())
    }
}

/// Chunks that arrive one per poll (or one per `gap`), then (unless `stalls`) the end.
#[derive(Debug, Default)]
struct TestBody {
    chunks: VecDeque<Result<Bytes, &'static str>>,
    exact: Option<u64>,
    stalls: bool,
    gap: Option<Duration>,
    waiting: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl TestBody {
    fn of(chunks: &[&'static [u8]]) -> Self {
        let chunks = chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        Self {
            chunks,
            ..Self::default()
        }
    }

    fn sized(body: &'static [u8]) -> Self {
        Self {
            exact: Some(body.len() as u64),
            ..Self::of(&[body])
        }
    }

    fn stalled() -> Self {
        Self {
            stalls: true,
            ..Self::default()
        }
    }

    /// Each chunk `gap` after the one before: a response that streams slowly.
    fn every(self, gap: Duration) -> Self {
        Self {
            gap: Some(gap),
            ..self
        }
    }
}

impl From<Bytes> for TestBody {
    fn from(bytes: Bytes) -> Self {
        Self {
            exact: Some(bytes.len() as u64),
            chunks: VecDeque::from([Ok(bytes)]),
            ..Self::default()
        }
    }
}

impl Chunks for TestBody {
    type Error = &'static str;

    fn exact_len(&self) -> Option<u64> {
        self.exact
    }

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, &'static str>>> {
        if let (Some(gap), false) = (self.gap, self.chunks.is_empty()) {
            let waiting = self
                .waiting
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(gap)));
            if waiting.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.waiting = None;
        }
        match self.chunks.pop_front() {
            Some(chunk) => Poll::Ready(Some(chunk)),
            None if self.stalls => Poll::Pending,
            None => Poll::Ready(None),
        }
    }
}

#[derive(Debug)]
struct TestReply {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Bytes,
    /// Set when the body was put back as read + rest (unrecorded).
    resumed: bool,
    replayed: bool,
    code: Option<ProblemCode>,
}

impl TestReply {
    fn new(status: u16, body: &'static [u8]) -> (Self, TestBody) {
        let reply = Self {
            status,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: Bytes::new(),
            resumed: false,
            replayed: false,
            code: None,
        };
        (reply, TestBody::sized(body))
    }
}

/// A response with its (test) body beside it, as `Reply` sees frameworks' responses.
#[derive(Debug)]
struct Sent(TestReply, TestBody);

impl Reply for Sent {
    type Head = TestReply;
    type Body = TestBody;

    fn status(&self) -> u16 {
        self.0.status
    }

    fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.0
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
    }

    fn into_parts(self) -> (TestReply, TestBody) {
        (self.0, self.1)
    }

    fn from_parts(head: TestReply, body: TestBody) -> Self {
        Self(head, body)
    }

    fn recorded(mut head: TestReply, bytes: Bytes, _: TestBody) -> Self {
        head.body = bytes;
        Self(head, TestBody::default())
    }

    fn resumed(mut head: TestReply, read: Bytes, _: Option<&'static str>, rest: TestBody) -> Self {
        head.body = read;
        head.resumed = true;
        Self(head, rest)
    }

    fn mark_replayed(mut self) -> Self {
        self.0.replayed = true;
        self
    }

    fn build<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        body: Bytes,
    ) -> Self {
        let (mut reply, _) = TestReply::new(status, b"");
        reply.headers = headers
            .into_iter()
            .map(|(n, v)| (n.to_owned(), v.to_vec()))
            .collect();
        reply.replayed = reply
            .headers
            .iter()
            .any(|(n, v)| n == REPLAYED_HEADER && v == b"true");
        let doc: Option<serde_json::Value> = serde_json::from_slice(&body).ok();
        reply.code = doc.and_then(|d| {
            let code = d["code"].as_str()?.to_owned();
            ALL_CODES.iter().copied().find(|c| c.as_str() == code)
        });
        reply.body = body;
        Self(reply, TestBody::default())
    }
}

#[test]
fn only_a_routers_empty_404_405_501_is_a_routing_refusal() {
    let empty = |status, headers: Vec<(String, Vec<u8>)>| {
        let (mut reply, _) = TestReply::new(status, b"");
        reply.headers = headers;
        Sent(reply, TestBody::sized(b""))
    };
    for status in [404, 405, 501] {
        assert!(routing_refusal(empty(status, vec![])).is_ok(), "{status}");
    }
    let typed = vec![("content-type".into(), b"application/json".to_vec())];
    assert!(routing_refusal(empty(405, typed)).is_err());
    assert!(routing_refusal(empty(400, vec![])).is_err());
    let (mut reply, body) = TestReply::new(404, b"{}");
    reply.headers.clear();
    assert!(
        routing_refusal(Sent(reply, body)).is_err(),
        "a body is a handler's"
    );
}

#[tokio::test]
async fn content_type_lines_are_fingerprinted_as_one_combined_value() {
    let handle = Idempotency::memory();
    let head = |second: &str| {
        TestHead::keyed("k-types")
            .header("content-type", "application/json")
            .header("content-type", second)
    };
    let mut first = claimed(&handle, &head("text/plain"), b"{}").await;
    let (reply, body) = TestReply::new(201, b"{}");
    settle(&handle, &mut first.held, Sent(reply, body)).await;
    let other = answer_of(&handle, &head("application/xml"), b"{}").await;
    assert_eq!(other.0.code, Some(ProblemCode::KeyReused));
    let again = answer_of(&handle, &head("text/plain"), b"{}").await;
    assert!(again.0.replayed, "{again:?}");
}

const ALL_CODES: [ProblemCode; 13] = [
    ProblemCode::InProgress,
    ProblemCode::KeyReused,
    ProblemCode::KeyRequired,
    ProblemCode::KeyInvalid,
    ProblemCode::PayloadTooLarge,
    ProblemCode::BodyTimeout,
    ProblemCode::BodyInvalid,
    ProblemCode::ScopeUnresolved,
    ProblemCode::StoreUnavailable,
    ProblemCode::StoreFull,
    ProblemCode::HandlerPanicked,
    ProblemCode::NotRecorded,
    ProblemCode::StoreNotEnlistable,
];

fn handle_with_budget(bytes: usize) -> Idempotency {
    Idempotency::builder(MemoryStore::default())
        .max_buffered_bytes(bytes)
        .sweeper(false)
        .build()
}

fn refusal<B>(front: Front<B>) -> ProblemCode {
    match front {
        Front::Refuse(problem) => problem.code(),
        Front::Pass(_) => panic!("passed"),
        Front::Buffered(_) => panic!("buffered"),
    }
}

async fn buffered(handle: &Idempotency, head: &TestHead, body: TestBody) -> Buffered {
    match front::<Detached, _, _>(handle, REQUIRED, head, body).await {
        Front::Buffered(buffered) => buffered,
        Front::Refuse(problem) => panic!("refused: {problem:?}"),
        Front::Pass(_) => panic!("passed"),
    }
}

async fn claimed(
    handle: &Idempotency,
    head: &TestHead,
    body: &'static [u8],
) -> Admitted<Reservation> {
    let buffered = buffered(handle, head, TestBody::of(&[body])).await;
    match claim::<Detached, _, Sent>(handle, head, buffered).await {
        Ok(claimed) => claimed,
        Err(answer) => panic!("not claimed: {answer:?}"),
    }
}

async fn answer_of(handle: &Idempotency, head: &TestHead, body: &'static [u8]) -> Sent {
    let buffered = buffered(handle, head, TestBody::of(&[body])).await;
    match claim::<Detached, _, Sent>(handle, head, buffered).await {
        Ok(_) => panic!("claimed"),
        Err(answer) => answer,
    }
}

#[tokio::test]
async fn key_syntax_and_presence_are_checked_before_the_body() {
    let handle = handle_with_budget(1 << 20);
    let bad = TestHead::keyed("a,b");
    let step = front::<Detached, _, _>(&handle, OPTIONAL, &bad, TestBody::stalled());
    assert_eq!(refusal(step.await), ProblemCode::KeyInvalid);
    let none = TestHead::default();
    let required = front::<Detached, _, _>(&handle, REQUIRED, &none, TestBody::stalled());
    assert_eq!(refusal(required.await), ProblemCode::KeyRequired);
    let optional = front::<Detached, _, _>(&handle, OPTIONAL, &none, TestBody::of(&[b"x"]));
    let Front::Pass(body) = optional.await else {
        panic!("a keyless request on an optional endpoint passes");
    };
    assert_eq!(body.chunks.len(), 1, "its body is untouched");
}

#[tokio::test]
async fn an_announced_length_over_the_cap_is_refused_without_reading() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k").header("content-length", "2000000");
    let step = front::<Detached, _, _>(&handle, REQUIRED, &head, TestBody::stalled());
    assert_eq!(refusal(step.await), ProblemCode::PayloadTooLarge);
}

#[tokio::test]
async fn a_body_is_refused_when_what_arrived_passes_the_cap() {
    let handle = Idempotency::builder(MemoryStore::default())
        .config(Config::builder().max_body(4).build())
        .build();
    let head = TestHead::keyed("k");
    let body = TestBody::of(&[b"abc", b"de"]);
    let step = front::<Detached, _, _>(&handle, REQUIRED, &head, body);
    assert_eq!(refusal(step.await), ProblemCode::PayloadTooLarge);
    assert_eq!(
        handle.buffered_bytes(),
        0,
        "the refused body's bytes are returned"
    );
}

#[tokio::test]
async fn a_body_broken_mid_read_is_body_invalid() {
    let handle = handle_with_budget(1 << 20);
    let mut body = TestBody::of(&[b"abc"]);
    body.chunks.push_back(Err("connection reset"));
    let head = TestHead::keyed("k");
    let step = front::<Detached, _, _>(&handle, REQUIRED, &head, body);
    assert_eq!(refusal(step.await), ProblemCode::BodyInvalid);
}

#[tokio::test(start_paused = true)]
async fn a_body_slower_than_the_timeout_is_refused() {
    let handle = Idempotency::builder(MemoryStore::default())
        .config(
            Config::builder()
                .body_timeout(Duration::from_secs(2))
                .build(),
        )
        .build();
    let head = TestHead::keyed("k");
    let step = front::<Detached, _, _>(&handle, REQUIRED, &head, TestBody::stalled());
    assert_eq!(refusal(step.await), ProblemCode::BodyTimeout);
}

#[tokio::test]
async fn announced_bodies_that_never_arrive_hold_no_budget() {
    let handle = handle_with_budget(64);
    let idle = TestHead::keyed("idle").header("content-length", "1000");
    let mut waiting = Vec::new();
    for _ in 0..300 {
        let step = front::<Detached, _, _>(&handle, REQUIRED, &idle, TestBody::stalled());
        let mut front = Box::pin(step);
        assert!(
            (&mut front).now_or_never().is_none(),
            "waiting for its body"
        );
        waiting.push(front);
    }
    assert_eq!(
        handle.buffered_bytes(),
        0,
        "announced bytes reserve nothing"
    );
    let head = TestHead::keyed("honest");
    let claimed = claimed(&handle, &head, b"{\"sku\":\"a\"}").await;
    assert!(
        claimed.context.is_some(),
        "another caller's request is claimed"
    );
}

#[tokio::test]
async fn bytes_that_arrived_beyond_the_budget_are_refused_with_store_full() {
    let handle = handle_with_budget(8);
    let head = TestHead::keyed("k");
    let body = TestBody::of(&[b"12345", b"6789"]);
    let step = front::<Detached, _, _>(&handle, REQUIRED, &head, body);
    assert_eq!(refusal(step.await), ProblemCode::StoreFull);
    assert_eq!(handle.buffered_bytes(), 0);
}

#[tokio::test]
async fn a_credential_without_a_published_identity_is_scope_unresolved() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k").header("authorization", "Bearer t");
    let answer = answer_of(&handle, &head, b"{}").await;
    assert_eq!(
        (answer.0.status, answer.0.code),
        (500, Some(ProblemCode::ScopeUnresolved))
    );
    let mut anonymous = TestHead::keyed("k");
    anonymous.peer = None;
    let answer = answer_of(&handle, &anonymous, b"{}").await;
    assert_eq!(
        answer.0.code,
        Some(ProblemCode::ScopeUnresolved),
        "no peer address"
    );
}

#[tokio::test]
async fn a_completed_key_replays_and_a_different_body_is_key_reused() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    let mut claimed = claimed(&handle, &head, b"{\"n\":1}").await;
    let (reply, body) = TestReply::new(201, b"{\"id\":7}");
    let sent = settle(&handle, &mut claimed.held, Sent(reply, body)).await;
    assert_eq!(
        (sent.0.status, &sent.0.body[..], sent.0.replayed),
        (201, &b"{\"id\":7}"[..], false)
    );

    let replay = answer_of(&handle, &head, b"{\"n\":1}").await;
    assert_eq!(
        (replay.0.status, &replay.0.body[..]),
        (201, &b"{\"id\":7}"[..])
    );
    assert!(replay.0.replayed, "marked replayed");
    let reused = answer_of(&handle, &head, b"{\"n\":2}").await;
    assert_eq!(
        (reused.0.status, reused.0.code),
        (422, Some(ProblemCode::KeyReused))
    );
}

#[tokio::test]
async fn a_duplicate_while_the_first_runs_is_in_progress() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    let _first = claimed(&handle, &head, b"{}").await;
    let second = answer_of(&handle, &head, b"{}").await;
    assert_eq!(
        (second.0.status, second.0.code),
        (409, Some(ProblemCode::InProgress))
    );
}

#[tokio::test]
async fn a_sized_response_is_recorded_while_the_budget_is_exhausted() {
    let handle = handle_with_budget(32);
    let head = TestHead::keyed("k");
    let mut claimed = claimed(&handle, &head, b"{}").await;
    drop(claimed.permit);
    let mut others = handle.budget().permit();
    assert!(others.grow(32), "other requests hold the whole budget");
    let (reply, body) = TestReply::new(201, b"a response longer than the whole budget");
    let sent = settle(&handle, &mut claimed.held, Sent(reply, body)).await;
    assert!(!sent.0.resumed, "recorded, not streamed past the record");
    drop(others);
    let replay = answer_of(&handle, &head, b"{}").await;
    assert!(replay.0.replayed, "the retry is a replay, not a second run");
    assert_eq!(
        &replay.0.body[..],
        b"a response longer than the whole budget"
    );
}

#[tokio::test]
async fn an_unsized_response_past_the_budget_is_sent_whole_and_its_key_released() {
    let handle = handle_with_budget(16);
    let head = TestHead::keyed("k");
    let mut claimed = claimed(&handle, &head, b"{}").await;
    drop(claimed.permit);
    let (reply, _) = TestReply::new(200, b"");
    let body = TestBody::of(&[b"0123456789", b"abcdefghij", b"tail"]);
    let sent = settle(&handle, &mut claimed.held, Sent(reply, body)).await;
    assert!(sent.0.resumed, "not recorded");
    assert_eq!(
        &sent.0.body[..],
        b"0123456789abcdefghij",
        "what was read goes first"
    );
    assert_eq!(sent.1.chunks.len(), 1, "then the rest of the stream");
    let again = claimed_again(&handle, &head).await;
    assert!(again, "the key was released: the retry runs");
}

async fn claimed_again(handle: &Idempotency, head: &TestHead) -> bool {
    let buffered = buffered(handle, head, TestBody::of(&[b"{}"])).await;
    match claim::<Detached, _, Sent>(handle, head, buffered).await {
        Ok(mut claimed) => {
            claimed.held.release().await;
            true
        }
        Err(_) => false,
    }
}

#[tokio::test]
async fn unrecordable_responses_are_sent_untouched_and_release_the_key() {
    let handle = Idempotency::builder(MemoryStore::default())
        .config(Config::builder().max_response(4).build())
        .build();
    let head = TestHead::keyed("k");
    for (status, body) in [(500, &b"{}"[..]), (403, b"{}"), (201, b"too large")] {
        let mut claimed = claimed(&handle, &head, b"{}").await;
        let (reply, _) = TestReply::new(status, b"");
        let sent = settle(
            &handle,
            &mut claimed.held,
            Sent(reply, TestBody::sized(body)),
        )
        .await;
        assert_eq!(sent.0.status, status);
        assert_eq!(
            sent.1.chunks.len(),
            1,
            "{status}: the body is left as it was"
        );
        assert!(
            claimed_again(&handle, &head).await,
            "{status}: the key was released"
        );
    }
}

#[tokio::test]
async fn a_panicking_handler_answers_500_and_releases_its_key() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    let claimed = claimed(&handle, &head, b"{}").await;
    let handler = async { panic!("handler bug") };
    let work = work::<Sent, (), Infallible>(
        handle.clone(),
        claimed.held,
        claimed.permit,
        Served::ByHandler,
        handler,
    );
    let ended = drive(boxed(&handle, work), tokio::spawn).await;
    let Ended::Panicked(answer) = ended else {
        panic!("not a panic");
    };
    assert_eq!(
        (answer.0.status, answer.0.code),
        (500, Some(ProblemCode::HandlerPanicked))
    );
    assert!(claimed_again(&handle, &head).await, "the key was released");
}

#[tokio::test]
async fn pending_work_finishes_in_its_task_and_is_recorded() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    let claimed = claimed(&handle, &head, b"{}").await;
    let handler = async {
        tokio::task::yield_now().await;
        let (reply, body) = TestReply::new(201, b"later");
        Ok::<_, Infallible>((Sent(reply, body), 7))
    };
    let work = work(
        handle.clone(),
        claimed.held,
        claimed.permit,
        Served::ByHandler,
        handler,
    );
    match drive(boxed(&handle, work), tokio::spawn).await {
        Ended::Answered(sent, extra) => assert_eq!((sent.0.status, extra), (201, 7)),
        _ => panic!("not answered"),
    }
    assert_eq!(handle.running(), 0);
    let replay = answer_of(&handle, &head, b"{}").await;
    assert_eq!(&replay.0.body[..], b"later");
}

fn handle_with(config: Config) -> Idempotency {
    Idempotency::builder(MemoryStore::default())
        .config(config)
        .sweeper(false)
        .build()
}

async fn scope_of_claim(handle: &Idempotency, head: &TestHead) -> crate::scope::ScopeHash {
    let mut claimed = claimed(handle, head, b"{}").await;
    let scope = *claimed.context.as_ref().expect("keyed").scope_hash();
    claimed.held.release().await;
    scope
}

#[tokio::test]
async fn the_key_header_is_a_setting() {
    let handle = handle_with(Config::builder().key_header("X-Idempotency-Key").build());
    let custom = TestHead::default()
        .header("x-idempotency-key", "k")
        .peer(Ipv4Addr::new(10, 0, 0, 1).into());
    let mut claimed = claimed(&handle, &custom, b"{}").await;
    assert_eq!(claimed.context.as_ref().unwrap().key().as_str(), "k");
    claimed.held.release().await;
    // The default name is just another header now, and the refusal names the configured one.
    let default_name = TestHead::keyed("k");
    let step = front::<Detached, _, _>(&handle, REQUIRED, &default_name, TestBody::stalled());
    let Front::Refuse(problem) = step.await else {
        panic!("not refused")
    };
    assert_eq!(problem.code(), ProblemCode::KeyRequired);
    assert_eq!(
        problem.detail(),
        "this endpoint requires an idempotency key in the x-idempotency-key header"
    );
    let bad = TestHead::default().header("x-idempotency-key", "a,b");
    let step = front::<Detached, _, _>(&handle, OPTIONAL, &bad, TestBody::stalled());
    assert_eq!(refusal(step.await), ProblemCode::KeyInvalid);
}

#[tokio::test]
async fn a_configured_credential_header_without_identity_is_scope_unresolved() {
    let head = TestHead::keyed("k").header("cookie", "session=abc");
    // By default a cookie is no credential: the caller is anonymous.
    let plain = handle_with(Config::default());
    let _ = scope_of_claim(&plain, &head).await;
    let strict = handle_with(
        Config::builder()
            .credential_headers(["authorization", "cookie"])
            .build(),
    );
    let answer = answer_of(&strict, &head, b"{}").await;
    assert_eq!(
        (answer.0.status, answer.0.code),
        (500, Some(ProblemCode::ScopeUnresolved))
    );
    // Once identified, the same request runs.
    let mut known = TestHead::keyed("k").header("cookie", "session=abc");
    known.identity = Some(Identity::subject("t", "u"));
    let _ = scope_of_claim(&strict, &known).await;
}

#[tokio::test]
async fn the_resolver_identifies_callers_the_application_did_not() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::scope::{ClientId, Resolution};

    let asked = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&asked);
    let handle = Idempotency::builder(MemoryStore::default())
        .sweeper(false)
        .resolver(move |head| {
            counter.fetch_add(1, Ordering::SeqCst);
            assert_eq!((head.method(), head.route()), ("POST", Some("/orders")));
            match head.header_str("x-api-key") {
                Some("") => Resolution::Refuse(Problem::new(
                    401,
                    ProblemCode::ScopeUnresolved,
                    "empty api key",
                )),
                Some(id) => Resolution::Identity(Identity::client(ClientId::ApiKey(id.into()))),
                None => Resolution::Unknown,
            }
        })
        .build();
    let a = scope_of_claim(&handle, &TestHead::keyed("k").header("x-api-key", "a")).await;
    let b = scope_of_claim(&handle, &TestHead::keyed("k").header("x-api-key", "b")).await;
    let anonymous = scope_of_claim(&handle, &TestHead::keyed("k")).await;
    assert!(
        a != b && a != anonymous && b != anonymous,
        "three callers, three scopes"
    );
    assert_eq!(asked.load(Ordering::SeqCst), 3);

    // A published identity wins; the resolver is not asked.
    let mut published = TestHead::keyed("k").header("x-api-key", "a");
    published.identity = Some(Identity::subject("t", "u"));
    let _ = scope_of_claim(&handle, &published).await;
    assert_eq!(asked.load(Ordering::SeqCst), 3);

    // A refusal is answered before anything is claimed.
    let answer = answer_of(
        &handle,
        &TestHead::keyed("r").header("x-api-key", ""),
        b"{}",
    )
    .await;
    assert_eq!(answer.0.status, 401);
    let _ = scope_of_claim(&handle, &TestHead::keyed("r").header("x-api-key", "a")).await;

    // Unknown leaves the usual rules: a credential without identity is refused.
    let answer = answer_of(
        &handle,
        &TestHead::keyed("k").header("authorization", "Bearer x"),
        b"{}",
    )
    .await;
    assert_eq!(answer.0.code, Some(ProblemCode::ScopeUnresolved));
}

#[tokio::test]
async fn an_async_resolver_is_awaited_before_the_claim_and_decides_like_a_sync_one() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::scope::{ClientId, Resolution};

    let asked = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&asked);
    let handle = Idempotency::builder(MemoryStore::default())
        .sweeper(false)
        .resolver_async(move |head| {
            counter.fetch_add(1, Ordering::SeqCst);
            // What the lookup needs is read now; the future owns it.
            let key = head.header_str("x-api-key").map(str::to_owned);
            async move {
                // A real lookup suspends: so does this one, more than once.
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                match key.as_deref() {
                    Some("") => {
                        Resolution::Refuse(Problem::new(401, ProblemCode::ScopeUnresolved, "empty"))
                    }
                    Some(id) => Resolution::Identity(Identity::client(ClientId::ApiKey(id.into()))),
                    None => Resolution::Unknown,
                }
            }
        })
        .build();
    let a = scope_of_claim(&handle, &TestHead::keyed("k").header("x-api-key", "a")).await;
    let b = scope_of_claim(&handle, &TestHead::keyed("k").header("x-api-key", "b")).await;
    let anonymous = scope_of_claim(&handle, &TestHead::keyed("k")).await;
    assert!(
        a != b && a != anonymous && b != anonymous,
        "three callers, three scopes"
    );
    assert_eq!(asked.load(Ordering::SeqCst), 3);
    // The scope it resolves is the one a sync resolver (or the application) gives that identity.
    let mut published = TestHead::keyed("k");
    published.identity = Some(Identity::client(ClientId::ApiKey("a".into())));
    assert_eq!(scope_of_claim(&handle, &published).await, a);
    assert_eq!(asked.load(Ordering::SeqCst), 3, "a published identity wins");
    // A refusal is answered before anything is claimed: the key stays free for the caller.
    let answer = answer_of(
        &handle,
        &TestHead::keyed("r").header("x-api-key", ""),
        b"{}",
    )
    .await;
    assert_eq!(answer.0.status, 401);
    let _ = scope_of_claim(&handle, &TestHead::keyed("r").header("x-api-key", "a")).await;
    // Unknown leaves the usual rules: a credential without identity is refused.
    let answer = answer_of(
        &handle,
        &TestHead::keyed("k").header("authorization", "Bearer x"),
        b"{}",
    )
    .await;
    assert_eq!(answer.0.code, Some(ProblemCode::ScopeUnresolved));
}

#[tokio::test]
async fn clients_behind_a_trusted_proxy_are_scoped_by_their_forwarded_address() {
    let handle = handle_with(
        Config::builder()
            .trusted_proxies(["10.0.0.0/8".parse().unwrap()])
            .build(),
    );
    let direct = TestHead::keyed("k").peer("203.0.113.9".parse().unwrap());
    let direct = scope_of_claim(&handle, &direct).await;
    for forwarded in [
        ("x-forwarded-for", "203.0.113.9:4711, 10.0.0.7"),
        ("x-forwarded-for", "::ffff:203.0.113.9"),
        ("forwarded", "for=\"203.0.113.9:80\";proto=https"),
    ] {
        let via = TestHead::keyed("k").header(forwarded.0, forwarded.1);
        assert_eq!(scope_of_claim(&handle, &via).await, direct, "{forwarded:?}");
    }
    let v6 = TestHead::keyed("k").header("x-forwarded-for", "[2001:db8::1]:443");
    let v6_direct = TestHead::keyed("k").peer("2001:db8::1".parse().unwrap());
    assert_eq!(
        scope_of_claim(&handle, &v6).await,
        scope_of_claim(&handle, &v6_direct).await
    );
    // The proxy's own address never scopes the clients behind it.
    for nothing in [None, Some("unknown")] {
        let mut head = TestHead::keyed("k");
        if let Some(v) = nothing {
            head = head.header("x-forwarded-for", v);
        }
        let answer = answer_of(&handle, &head, b"{}").await;
        assert_eq!(
            (answer.0.status, answer.0.code),
            (500, Some(ProblemCode::ScopeUnresolved)),
            "{nothing:?}"
        );
    }
    // An authenticated caller needs no address.
    let mut known = TestHead::keyed("k");
    known.identity = Some(Identity::subject("t", "u"));
    let _ = scope_of_claim(&handle, &known).await;
    // An untrusted peer's header is ignored.
    let spoofed = TestHead::keyed("k")
        .peer("198.51.100.1".parse().unwrap())
        .header("x-forwarded-for", "203.0.113.9");
    assert_ne!(scope_of_claim(&handle, &spoofed).await, direct);
}

#[tokio::test]
async fn a_client_behind_a_trusted_proxy_never_picks_its_scope_with_bytes_it_wrote() {
    let handle = handle_with(
        Config::builder()
            .trusted_proxies(["10.0.0.0/8".parse().unwrap()])
            .build(),
    );
    let real = TestHead::keyed("k").peer("198.51.100.9".parse().unwrap());
    let real = scope_of_claim(&handle, &real).await;
    let victim = TestHead::keyed("k").peer("192.0.2.7".parse().unwrap());
    let victim = scope_of_claim(&handle, &victim).await;
    // The proxy appended the real address to the client's line, a non-UTF-8 byte and all.
    let attack = TestHead::keyed("k")
        .header_bytes("x-forwarded-for", b"6.6.6.6\xff, 198.51.100.9")
        .header("forwarded", "for=192.0.2.7");
    assert_eq!(scope_of_claim(&handle, &attack).await, real);
    assert_ne!(real, victim);
    // An X-Forwarded-For line without a readable hop never hands the decision to Forwarded.
    for unreadable in [&b"\xff"[..], b"", b" , ", b"\xff\xfe, \x80"] {
        let head = TestHead::keyed("k")
            .header_bytes("x-forwarded-for", unreadable)
            .header("forwarded", "for=192.0.2.7");
        let answer = answer_of(&handle, &head, b"{}").await;
        assert_eq!(
            (answer.0.status, answer.0.code),
            (500, Some(ProblemCode::ScopeUnresolved)),
            "{unreadable:?}"
        );
    }
}

#[tokio::test]
async fn a_claim_dropped_while_the_store_call_is_in_flight_leaves_the_key_free() {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use crate::reservation::tests::Outage;

    let store = Arc::new(Outage::default());
    let handle = Idempotency::builder_arc(Arc::clone(&store))
        .sweeper(false)
        .build();
    let head = TestHead::keyed("k");
    store.hang_claims.store(true, Ordering::SeqCst);
    let first = buffered(&handle, &head, TestBody::of(&[b"{}"])).await;
    let gone = tokio::time::timeout(
        Duration::from_millis(50),
        claim::<Detached, _, Sent>(&handle, &head, first),
    )
    .await;
    assert!(
        gone.is_err(),
        "the claim was still in flight when its client left"
    );
    store.hang_claims.store(false, Ordering::SeqCst);
    // The release runs in the background, at once.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut retry = claimed(&handle, &head, b"{}").await;
    retry.held.release().await;
}

/// A clock that follows tokio's time (paused in the test, so it moves as the test's sleeps
/// pass): the memory store's leases lapse exactly as the renewal loop's ticks see them.
struct TokioClock {
    start: tokio::time::Instant,
    wall: crate::clock::Millis,
}

impl TokioClock {
    fn new() -> Self {
        use crate::clock::Clock as _;
        Self {
            start: tokio::time::Instant::now(),
            wall: crate::clock::SystemClock.now_millis(),
        }
    }
}

impl crate::clock::Clock for TokioClock {
    fn now_millis(&self) -> crate::clock::Millis {
        self.wall + crate::clock::millis(self.start.elapsed())
    }
}

#[tokio::test(start_paused = true)]
async fn the_lease_is_renewed_while_the_response_body_is_read() {
    let store = MemoryStore::builder().clock(TokioClock::new()).build();
    let lease = Duration::from_millis(300);
    let handle = Idempotency::builder(store)
        .config(Config::builder().lease(lease).build())
        .sweeper(false)
        .build();
    let head = TestHead::keyed("k-slow-answer");
    let claimed = claimed(&handle, &head, b"{}").await;
    // The handler answers at once; its body then streams for four leases.
    let (reply, _) = TestReply::new(200, b"");
    let body = TestBody::of(&[&b"a"[..]; 6]).every(Duration::from_millis(200));
    let handler = async move { Ok::<_, Infallible>((Sent(reply, body), ())) };
    let work = work(
        handle.clone(),
        claimed.held,
        claimed.permit,
        Served::ByHandler,
        handler,
    );
    let first = tokio::spawn(work);
    for _ in 0..4 {
        tokio::time::sleep(lease).await;
        let buffered = buffered(&handle, &head, TestBody::of(&[b"{}"])).await;
        match claim::<Detached, _, Sent>(&handle, &head, buffered).await {
            Ok(_) => panic!("a duplicate took the key over while the first answer was still read"),
            Err(duplicate) => assert_eq!(
                (duplicate.0.status, duplicate.0.code),
                (409, Some(ProblemCode::InProgress)),
                "{duplicate:?}"
            ),
        }
    }
    let Ok(Ended::Answered(sent, ())) = first.await else {
        panic!("the first request did not answer");
    };
    assert_eq!((sent.0.status, &sent.0.body[..]), (200, &b"aaaaaa"[..]));
    assert!(!sent.0.resumed && !sent.0.replayed, "{sent:?}");
    let replay = answer_of(&handle, &head, b"{}").await;
    assert!(replay.0.replayed, "{replay:?}");
    assert_eq!(&replay.0.body[..], b"aaaaaa");
}

async fn claimed_on(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &TestHead,
) -> Admitted<Reservation> {
    let front = front::<Detached, _, _>(handle, endpoint, head, TestBody::of(&[b"{}"])).await;
    let Front::Buffered(buffered) = front else {
        panic!("not buffered");
    };
    match claim::<Detached, _, Sent>(handle, head, buffered).await {
        Ok(claimed) => claimed,
        Err(answer) => panic!("not claimed: {answer:?}"),
    }
}

fn header<'a>(sent: &'a Sent, name: &str) -> Option<&'a [u8]> {
    let mut values = sent.0.headers.iter().filter(|(n, _)| n == name);
    let value = values.next().map(|(_, v)| v.as_slice());
    assert!(values.next().is_none(), "{name} sent twice: {sent:?}");
    value
}

/// A 201 with a `Location` over a 4-byte cap, sized (already in memory) or streamed with no
/// declared length past the cap.
fn oversized_answer(sized: bool) -> Sent {
    let (mut reply, _) = TestReply::new(201, b"");
    reply
        .headers
        .push(("location".into(), b"/charges/7".to_vec()));
    let body = if sized {
        TestBody::sized(b"a receipt too large to keep")
    } else {
        TestBody::of(&[b"a rec", b"eipt too large", b" to keep"])
    };
    Sent(reply, body)
}

#[tokio::test]
async fn an_oversized_answer_recorded_without_body_replays_its_status_and_headers_only() {
    use crate::config::Oversized;

    let config = Config::builder().max_response(4).build();
    let per_endpoint = EndpointConfig {
        oversized: Some(Oversized::RecordWithoutBody),
        ..EndpointConfig::REQUIRED
    };
    let on_config = Config::builder()
        .max_response(4)
        .oversized(Oversized::RecordWithoutBody)
        .build();
    for (config, endpoint) in [
        (config, per_endpoint),
        (on_config, EndpointConfig::REQUIRED),
    ] {
        for sized in [true, false] {
            let handle = handle_with(config.clone());
            let head = TestHead::keyed("k-receipt");
            let mut claimed = claimed_on(&handle, &endpoint, &head).await;
            let sent = settle(&handle, &mut claimed.held, oversized_answer(sized)).await;
            assert_eq!(sent.0.status, 201);
            assert!(
                !sent.0.replayed,
                "the first answer is never marked replayed"
            );
            assert_eq!(header(&sent, "idempotency-replay"), None, "{sent:?}");
            let whole: Vec<u8> = sent
                .0
                .body
                .iter()
                .copied()
                .chain(sent.1.chunks.iter().flat_map(|c| c.clone().unwrap()))
                .collect();
            assert_eq!(
                whole, b"a receipt too large to keep",
                "sized {sized}: sent whole"
            );

            let replay = answer_of(&handle, &head, b"{}").await;
            assert_eq!(replay.0.status, 201, "sized {sized}: {replay:?}");
            assert!(replay.0.replayed, "sized {sized}: {replay:?}");
            assert_eq!(&replay.0.body[..], b"", "the body is not kept");
            assert_eq!(
                header(&replay, "idempotency-replay"),
                Some(&b"body-omitted"[..])
            );
            assert_eq!(
                header(&replay, "content-type"),
                Some(&b"application/json"[..])
            );
            assert_eq!(header(&replay, "location"), Some(&b"/charges/7"[..]));
        }
    }
}

#[tokio::test]
async fn an_oversized_answer_releases_its_key_by_default() {
    let handle = handle_with(Config::builder().max_response(4).build());
    let head = TestHead::keyed("k-receipt");
    for sized in [true, false] {
        let mut claimed = claimed_on(&handle, REQUIRED, &head).await;
        let sent = settle(&handle, &mut claimed.held, oversized_answer(sized)).await;
        assert_eq!(sent.0.status, 201);
        assert!(
            claimed_again(&handle, &head).await,
            "sized {sized}: released"
        );
    }
}

#[tokio::test]
async fn a_handlers_own_idempotency_replay_header_is_never_recorded() {
    let handle = handle_with(
        Config::builder()
            .recorded_headers(["content-type", "idempotency-replay"])
            .build(),
    );
    let head = TestHead::keyed("k-forged");
    let mut claimed = claimed(&handle, &head, b"{}").await;
    let (mut reply, body) = TestReply::new(201, b"{}");
    reply
        .headers
        .push(("idempotency-replay".into(), b"body-omitted".to_vec()));
    let sent = settle(&handle, &mut claimed.held, Sent(reply, body)).await;
    assert_eq!(
        header(&sent, "idempotency-replay"),
        Some(&b"body-omitted"[..]),
        "the first answer is the handler's own"
    );
    let replay = answer_of(&handle, &head, b"{}").await;
    assert!(replay.0.replayed);
    assert_eq!(&replay.0.body[..], b"{}");
    assert_eq!(
        header(&replay, "idempotency-replay"),
        None,
        "a replay of a whole answer never says its body was omitted: {replay:?}"
    );
}

// Where the key comes from, and what the fingerprint covers (issue 31).

const EVENT_FIELDS: &[crate::key::JsonPointer] = &[
    crate::key::JsonPointer::from_static("/type"),
    crate::key::JsonPointer::from_static("/data"),
];
const EVENTS: &EndpointConfig = &EndpointConfig::REQUIRED
    .key(crate::key::KeySource::body_static("/id"))
    .fingerprint(crate::fingerprint::BodySubset::from_static(EVENT_FIELDS));
const OPTIONAL_BODY_KEY: &EndpointConfig =
    &EndpointConfig::OPTIONAL.key(crate::key::KeySource::body_static("/id"));
const WEBHOOK: &EndpointConfig =
    &EndpointConfig::REQUIRED.key(crate::key::KeySource::header_static("webhook-id"));

async fn front_of(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &TestHead,
    body: &'static [u8],
) -> Front<TestBody> {
    front::<Detached, _, _>(handle, endpoint, head, TestBody::of(&[body])).await
}

/// Claims through `endpoint` and answers `status` with `body`, or returns the answer instead.
async fn through(
    handle: &Idempotency,
    endpoint: &EndpointConfig,
    head: &TestHead,
    request: &'static [u8],
) -> Result<(Admitted<Reservation>, String), Sent> {
    let buffered = match front_of(handle, endpoint, head, request).await {
        Front::Buffered(buffered) => buffered,
        Front::Refuse(problem) => panic!("refused: {problem:?}"),
        Front::Pass(_) => panic!("passed"),
    };
    let admitted = claim::<Detached, _, Sent>(handle, head, buffered).await?;
    let key = admitted.context.as_ref().unwrap().key().as_str().to_owned();
    Ok((admitted, key))
}

#[tokio::test]
async fn a_key_in_the_body_is_read_after_the_body_and_checked_as_a_header_key() {
    let handle = handle_with_budget(1 << 20);
    let anonymous = TestHead::default().peer(Ipv4Addr::new(10, 0, 0, 1).into());
    // The Idempotency-Key header means nothing on such an endpoint: the body's id is the key.
    let head = TestHead::keyed("header-key");
    let (mut admitted, key) = through(&handle, EVENTS, &head, br#"{"id":"evt_1","type":"a"}"#)
        .await
        .unwrap_or_else(|sent| panic!("not claimed: {sent:?}"));
    assert_eq!(key, "evt_1");
    admitted.held.release().await;
    let (mut admitted, key) = through(&handle, EVENTS, &anonymous, br#"{"id": 42}"#)
        .await
        .unwrap_or_else(|sent| panic!("not claimed: {sent:?}"));
    assert_eq!(key, "42", "a number is its JSON text");
    admitted.held.release().await;

    for (body, code) in [
        (&br#"{"type":"a"}"#[..], ProblemCode::KeyRequired),
        (br#"{"id":{"nested":1}}"#, ProblemCode::KeyInvalid),
        (br#"{"id":["a"]}"#, ProblemCode::KeyInvalid),
        (br#"{"id":null}"#, ProblemCode::KeyInvalid),
        (br#"{"id":""}"#, ProblemCode::KeyInvalid),
        (br#"{"id":"has space"}"#, ProblemCode::KeyInvalid),
        (b"not json", ProblemCode::KeyInvalid),
    ] {
        let refused = front_of(&handle, EVENTS, &anonymous, body).await;
        assert_eq!(refusal(refused), code, "{}", String::from_utf8_lossy(body));
    }
    // The body's bounds come first: a body over the cap is 413 whatever key it would hold.
    let small = EndpointConfig::REQUIRED
        .key(crate::key::KeySource::body_static("/id"))
        .max_body(8);
    let big = front_of(&handle, &small, &anonymous, br#"{"id":"evt_1"}"#).await;
    assert_eq!(refusal(big), ProblemCode::PayloadTooLarge);
}

#[tokio::test]
async fn an_optional_body_key_that_is_absent_passes_the_body_on_whole() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::default().peer(Ipv4Addr::new(10, 0, 0, 1).into());
    let Front::Pass(mut body) = front_of(&handle, OPTIONAL_BODY_KEY, &head, br#"{"a":1}"#).await
    else {
        panic!("a body without the key passes on an optional endpoint");
    };
    let chunk = std::future::poll_fn(|cx| body.poll_chunk(cx)).await;
    assert_eq!(chunk.unwrap().unwrap(), &br#"{"a":1}"#[..]);
    assert_eq!(handle.budget().used(), 0, "nothing stays charged");
}

#[tokio::test]
async fn an_endpoint_reads_its_key_from_its_own_header() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::default()
        .header("webhook-id", "msg_1")
        .peer(Ipv4Addr::new(10, 0, 0, 1).into());
    let (mut admitted, key) = through(&handle, WEBHOOK, &head, b"{}")
        .await
        .unwrap_or_else(|sent| panic!("not claimed: {sent:?}"));
    assert_eq!(key, "msg_1");
    admitted.held.release().await;
    // The configured header is not this endpoint's.
    let default_only = TestHead::keyed("k");
    let missing = front_of(&handle, WEBHOOK, &default_only, b"{}").await;
    let Front::Refuse(problem) = missing else {
        panic!("a request without webhook-id is refused");
    };
    assert_eq!(problem.code(), ProblemCode::KeyRequired);
    assert!(
        problem.detail().contains("webhook-id"),
        "{}",
        problem.detail()
    );
    let bad = TestHead::default().header("webhook-id", "a,b");
    assert_eq!(
        refusal(front_of(&handle, WEBHOOK, &bad, b"{}").await),
        ProblemCode::KeyInvalid
    );
}

#[tokio::test]
async fn a_subset_fingerprint_replays_other_fields_and_refuses_a_changed_field() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::default().peer(Ipv4Addr::new(10, 0, 0, 1).into());
    let first =
        br#"{"id":"evt_9","type":"paid","data":{"amount":100,"currency":"EUR"},"sent_at":1}"#;
    let (mut admitted, _) = through(&handle, EVENTS, &head, first)
        .await
        .unwrap_or_else(|sent| panic!("not claimed: {sent:?}"));
    let (reply, body) = TestReply::new(200, b"{\"ok\":true}");
    settle(&handle, &mut admitted.held, Sent(reply, body)).await;

    // Another timestamp, member order and number form: the same request.
    let retry =
        br#"{"sent_at":2,"data":{"currency":"EUR","amount":1e2},"type":"paid","id":"evt_9"}"#;
    let replay = through(&handle, EVENTS, &head, retry)
        .await
        .err()
        .expect("a replay");
    assert!(replay.0.replayed);
    assert_eq!(&replay.0.body[..], b"{\"ok\":true}");
    // A changed amount is another request under the same key.
    let changed = br#"{"id":"evt_9","type":"paid","data":{"amount":101,"currency":"EUR"}}"#;
    let reused = through(&handle, EVENTS, &head, changed)
        .await
        .err()
        .expect("refused");
    assert_eq!(
        (reused.0.status, reused.0.code),
        (422, Some(ProblemCode::KeyReused))
    );
}

#[tokio::test]
async fn a_subset_fingerprint_refuses_a_body_that_is_not_json_before_claiming() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    const SUBSET_ONLY: &EndpointConfig = &EndpointConfig::REQUIRED
        .fingerprint(crate::fingerprint::BodySubset::from_static(EVENT_FIELDS));
    let refused = through(&handle, SUBSET_ONLY, &head, b"{not json")
        .await
        .err()
        .expect("refused");
    assert_eq!(
        (refused.0.status, refused.0.code),
        (400, Some(ProblemCode::BodyInvalid))
    );
    // Nothing was claimed: the same key with a JSON body runs.
    let (mut admitted, _) = through(&handle, SUBSET_ONLY, &head, b"{}")
        .await
        .unwrap_or_else(|sent| panic!("not claimed: {sent:?}"));
    admitted.held.release().await;
}

// Waiting for a running request instead of 409 (`wait_in_progress`).

const WAITS: &EndpointConfig = &EndpointConfig::REQUIRED.wait_in_progress(Duration::from_secs(5));

async fn answer_through(handle: &Idempotency, endpoint: &EndpointConfig, head: &TestHead) -> Sent {
    let buffered = match front_of(handle, endpoint, head, b"{}").await {
        Front::Buffered(buffered) => buffered,
        Front::Refuse(problem) => panic!("refused: {problem:?}"),
        Front::Pass(_) => panic!("passed"),
    };
    match claim::<Detached, _, Sent>(handle, head, buffered).await {
        Ok(_) => panic!("claimed"),
        Err(answer) => answer,
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_is_answered_with_the_first_ones_response() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    let first = claimed(&handle, &head, b"{}").await;
    let waiting = {
        let (handle, head) = (handle.clone(), TestHead::keyed("k"));
        tokio::spawn(async move { answer_through(&handle, WAITS, &head).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished(), "the duplicate waits");
    let (reply, body) = TestReply::new(201, b"{\"id\":1}");
    let handler = async move { Ok::<_, Infallible>((Sent(reply, body), ())) };
    let ended = work(
        handle.clone(),
        first.held,
        first.permit,
        Served::ByHandler,
        handler,
    );
    assert!(matches!(ended.await, Ended::Answered(..)));
    let answer = waiting.await.unwrap();
    assert_eq!((answer.0.status, answer.0.replayed), (201, true));
    assert_eq!(&answer.0.body[..], b"{\"id\":1}");
}

#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_is_answered_409_past_its_wait() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    let _first = claimed(&handle, &head, b"{}").await;
    let started = tokio::time::Instant::now();
    let answer = answer_through(&handle, WAITS, &head).await;
    assert_eq!(
        (answer.0.status, answer.0.code),
        (409, Some(ProblemCode::InProgress))
    );
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "it waited its bound"
    );
    assert!(started.elapsed() < Duration::from_secs(6), "and no longer");
}

#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_runs_when_the_first_releases_its_key() {
    let handle = handle_with_budget(1 << 20);
    let head = TestHead::keyed("k");
    let first = claimed(&handle, &head, b"{}").await;
    let waiting = {
        let (handle, head) = (handle.clone(), TestHead::keyed("k"));
        tokio::spawn(async move {
            let buffered = match front_of(&handle, WAITS, &head, b"{}").await {
                Front::Buffered(buffered) => buffered,
                _ => panic!("not buffered"),
            };
            claim::<Detached, _, Sent>(&handle, &head, buffered)
                .await
                .is_ok()
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A 503 is not recordable: the first releases the key.
    let (reply, body) = TestReply::new(503, b"{}");
    let handler = async move { Ok::<_, Infallible>((Sent(reply, body), ())) };
    work(
        handle.clone(),
        first.held,
        first.permit,
        Served::ByHandler,
        handler,
    )
    .await;
    assert!(
        waiting.await.unwrap(),
        "the waiting duplicate claimed the key and runs"
    );
}

/// `work` as [`drive`] takes it.
fn boxed<W>(handle: &Idempotency, work: W) -> Work<W> {
    Work {
        handle: handle.clone(),
        route: "/orders".into(),
        future: Box::pin(work),
    }
}
